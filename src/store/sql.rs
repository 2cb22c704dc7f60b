//! The store's statements and transactions, written once for both
//! backends: [`Store`] is implemented here for any [`Dialect`], and each
//! backend supplies only what its database does differently (pools, how a
//! read-then-write transaction begins, row locks, claiming queued jobs and
//! requeueing expired claims).
//!
//! One text serves both databases: sqlx's SQLite driver takes `$N`
//! placeholders as PostgreSQL does, and where PostgreSQL must be told a
//! parameter's type (`$N IS NULL`) the text says `CAST($N AS TEXT)` (or
//! `BIGINT`), which changes nothing on SQLite for a value of that type.
//!
//! The statements that look rows up by a list of ids (a batch's) are
//! planned at each execution, not prepared once and cached per connection
//! (`persistent(false)`): PostgreSQL would keep the plan it made while the
//! tables were small (a fresh database), a scan of the whole table, long
//! after they have grown, until the next ANALYZE. A batch is one statement
//! for many jobs, so planning it each time costs little.
//!
//! A method that checks something and then writes runs in one transaction
//! begun by [`Dialect::begin_write`] and reads the job row with
//! [`Dialect::LOCK_JOB`] first: on SQLite the transaction holds the write
//! lock from its start, on PostgreSQL the statement locks the row (the
//! backends' module documentation says why each is enough).
//! Reservations from a budget do the same with the budget row
//! ([`Dialect::LOCK_BUDGET`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;

use async_trait::async_trait;
use serde_json::{Value, json};
use sqlx::database::HasStatementCache;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Pool, Transaction, Type};

use super::keys::current_period;
use super::rows::{self, AttemptRow, BudgetRow, CertificationRow, JobRow, KeyRow};
use super::{
    AttemptRecord, AttemptResult, AttemptState, AuditEntry, Backend, BudgetRecord, Certification,
    Chooser, ClaimedJob, Completion, Created, Cursor, JobRecord, JobState, KeyChange, KeyRecord,
    NewJob, Result, Room, Settlement, StartAttempt, Store, StoreError, StoredResponse, period_ms,
};

/// What one database does differently; everything else is shared.
pub(super) trait Dialect: Send + Sync + 'static {
    type Db: Database + HasStatementCache;

    const BACKEND: Backend;

    /// The directory of the files' parts, when they are not in the
    /// database.
    fn parts(&self) -> Option<&super::parts::PartsDir> {
        None
    }

    /// In a write transaction, `SELECT state, version` of job `$1`, the row
    /// kept from change until the transaction ends.
    const LOCK_JOB: &'static str;

    /// The claim of [`Store::claim_and_start`] in one statement: up to `$4` queued jobs whose
    /// `not_before <= $2`, those of no batch first and then at most `$5`
    /// batch lines, each kind oldest first, become `running`, claimed by `$1`
    /// until `$3`, version + 1, updated at `$2`; `RETURNING` them (in any
    /// order). No two claimers may pick the same job.
    const CLAIM: &'static str;

    /// In a write transaction, `SELECT id, version, completed_by`
    /// of the jobs whose ids are in the JSON array `$1`, in id order, the
    /// rows kept from change until the transaction ends.
    const LOCK_JOBS: &'static str;

    /// In a write transaction, `SELECT job_id, n, state` of every attempt
    /// of the jobs in the JSON array `$1`, the rows kept from change until
    /// the transaction ends.
    const LOCK_ATTEMPTS: &'static str;

    /// `SELECT *` of the attempts of the jobs in the JSON array `$1`.
    const ATTEMPTS_OF: &'static str;

    /// Inserts the attempts of the JSON array `$1` (objects with `job_id`,
    /// `n`, `provider`, `model`, `hedge`, `read_version`) as `starting`,
    /// owned by `$2`, started at `$3`, leased until `$4`; `RETURNING *`.
    const INSERT_ATTEMPTS: &'static str;

    /// The compare-and-swap of [`Store::complete`] for each object of the
    /// JSON array `$1` (`id`, `n`, `read_version`, `result`; one per job),
    /// updated at `$2`; `RETURNING` the jobs it completed.
    const COMPLETE_JOBS: &'static str;

    /// Sets `state` and `finished_at = $2` of the attempts named in the
    /// JSON array `$1` (objects with `job_id`, `n`, `state`).
    const END_ATTEMPTS: &'static str;

    /// In a write transaction, a lock on the name `$1` held until the
    /// transaction ends: two transactions that take it run one after the
    /// other (a tenant's batch creations, counted against its limit).
    const LOCK_NAME: &'static str;

    /// In a write transaction, `SELECT limit_nanos, period_ms,
    /// period_start, spent_nanos` of budget `$1`, the row kept from change
    /// until the transaction ends.
    const LOCK_BUDGET: &'static str;

    /// Sets `last_used_at = t` of each key of the JSON array `$1` (objects
    /// with `id` and `t`, one per id) whose `last_used_at` is null or
    /// earlier; other columns are left alone. Two of them running at once
    /// must not deadlock.
    const TOUCH_KEYS: &'static str;

    /// Deletes the grants whose `lease_until <= $1`. It must not deadlock
    /// with a holder renewing its grants meanwhile.
    const EXPIRE_GRANTS: &'static str;

    /// The pool reads use.
    fn reader(&self) -> &Pool<Self::Db>;

    /// The pool writes use.
    fn writer(&self) -> &Pool<Self::Db>;

    /// Begins a transaction that reads and then writes.
    fn begin_write(&self) -> impl Future<Output = Result<Transaction<'static, Self::Db>>> + Send;

    /// [`Store::expire_job_claims`].
    fn requeue_expired_claims(&self, now: i64) -> impl Future<Output = Result<u64>> + Send;

    /// How many rows a statement changed.
    fn rows_affected(done: &<Self::Db as Database>::QueryResult) -> u64;
}

/// A row as the dialect's database returns it.
type Row<D> = <<D as Dialect>::Db as Database>::Row;

/// Reads the job's state and version with [`Dialect::LOCK_JOB`]; None if
/// there is no such job.
async fn lock_job<D>(
    conn: &mut <D::Db as Database>::Connection,
    job_id: &str,
) -> Result<Option<(JobState, i64)>>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'r> (String, i64): FromRow<'r, Row<D>>,
{
    let row: Option<(String, i64)> = sqlx::query_as(D::LOCK_JOB)
        .bind(job_id)
        .fetch_optional(conn)
        .await?;
    row.map(|(state, version)| Ok((rows::job_state(job_id, &state)?, version)))
        .transpose()
}

/// A job row as [`Dialect::LOCK_JOBS`] reads it.
struct Locked {
    version: i64,
    completed_by: Option<i32>,
}

/// Locks the jobs of the JSON array `ids` with [`Dialect::LOCK_JOBS`]; the
/// ones that exist, by id.
async fn lock_jobs<D>(
    conn: &mut <D::Db as Database>::Connection,
    ids: &str,
) -> Result<HashMap<String, Locked>>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'r> (String, i64, Option<i32>): FromRow<'r, Row<D>>,
{
    let rows: Vec<(String, i64, Option<i32>)> = sqlx::query_as(D::LOCK_JOBS)
        .persistent(false)
        .bind(ids)
        .fetch_all(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(id, version, completed_by)| {
            (
                id,
                Locked {
                    version,
                    completed_by,
                },
            )
        })
        .collect())
}

/// Writes an audit entry in the caller's transaction.
async fn insert_audit<D>(
    conn: &mut <D::Db as Database>::Connection,
    audit: &AuditEntry,
) -> Result<()>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
{
    sqlx::query(
        "INSERT INTO key_audit (at, actor, action, key_id, tenant, detail)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(audit.at)
    .bind(audit.actor.as_str())
    .bind(audit.action.as_str())
    .bind(audit.key_id.as_str())
    .bind(audit.tenant.as_str())
    .bind(audit.detail.as_str())
    .execute(conn)
    .await?;
    Ok(())
}

/// Sets the limit and period of budget `scope` in the caller's
/// transaction, creating the row (its period starting at `start`) if there
/// is none; the spend and period start of an existing row stay.
async fn upsert_budget<D>(
    conn: &mut <D::Db as Database>::Connection,
    scope: &str,
    limit_nanos: Option<i64>,
    period_ms: Option<i64>,
    start: i64,
) -> Result<()>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<i64>: Encode<'q, D::Db>,
{
    sqlx::query(
        "INSERT INTO budgets (scope, limit_nanos, period_ms, period_start)
         VALUES ($1, CAST($2 AS BIGINT), CAST($3 AS BIGINT), $4)
         ON CONFLICT (scope) DO UPDATE
         SET limit_nanos = excluded.limit_nanos, period_ms = excluded.period_ms",
    )
    .bind(scope)
    .bind(limit_nanos)
    .bind(period_ms)
    .bind(start)
    .execute(conn)
    .await?;
    Ok(())
}

/// Takes `amount` off `holder`'s grant of `scope` (not below 0) in the
/// caller's transaction, and renews its lease when `lease_until` is given;
/// a grant that reaches 0 is removed.
async fn shrink_grant<D>(
    conn: &mut <D::Db as Database>::Connection,
    scope: &str,
    holder: &str,
    amount: i64,
    lease_until: Option<i64>,
) -> Result<()>
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<i64>: Encode<'q, D::Db>,
{
    sqlx::query(
        "UPDATE budget_grants
         SET amount_nanos = CASE WHEN amount_nanos > $3 THEN amount_nanos - $3 ELSE 0 END,
             lease_until = COALESCE(CAST($4 AS BIGINT), lease_until)
         WHERE scope = $1 AND holder = $2",
    )
    .bind(scope)
    .bind(holder)
    .bind(amount)
    .bind(lease_until)
    .execute(&mut *conn)
    .await?;
    sqlx::query("DELETE FROM budget_grants WHERE scope = $1 AND holder = $2 AND amount_nanos <= 0")
        .bind(scope)
        .bind(holder)
        .execute(conn)
        .await?;
    Ok(())
}

/// The budget row of a key.
fn key_scope(id: &str) -> String {
    format!("key:{id}")
}

/// The period of a key's budget in milliseconds; None when it has none
/// (a text other than `1d`, `7d`, `30d` is refused by the table's check).
fn key_period(key: &KeyRecord) -> Option<i64> {
    key.budget_period.as_deref().and_then(period_ms)
}

/// The distinct job ids of a batch as a JSON array (the statements' `$1`).
fn json_ids<'a>(ids: impl Iterator<Item = &'a str>) -> String {
    let set: BTreeSet<&str> = ids.collect();
    Value::from(set.into_iter().collect::<Vec<_>>()).to_string()
}

/// The number of a job's next attempt: one past the highest so far.
fn next_attempt(job_id: &str, earlier: &[AttemptRecord]) -> Result<i32> {
    earlier
        .iter()
        .map(|a| a.n)
        .max()
        .unwrap_or(0)
        .checked_add(1)
        .ok_or_else(|| StoreError::Corrupt(format!("job {job_id}: too many attempts")))
}

// The bounds: what the shared statements bind and read, which both sqlx
// drivers provide.
#[async_trait]
impl<D> Store for D
where
    D: Dialect + super::FileStore + super::BatchStore,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<&'q str>: Encode<'q, D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<i64>: Encode<'q, D::Db>,
    for<'q> i32: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> bool: Encode<'q, D::Db> + Type<D::Db>,
    for<'r> JobRow: FromRow<'r, Row<D>>,
    for<'r> AttemptRow: FromRow<'r, Row<D>>,
    for<'r> CertificationRow: FromRow<'r, Row<D>>,
    for<'r> StoredResponse: FromRow<'r, Row<D>>,
    for<'r> KeyRow: FromRow<'r, Row<D>>,
    for<'r> BudgetRow: FromRow<'r, Row<D>>,
    for<'r> AuditEntry: FromRow<'r, Row<D>>,
    for<'r> (Option<i64>, Option<i64>, i64, i64): FromRow<'r, Row<D>>,
    for<'r> (i64,): FromRow<'r, Row<D>>,
    for<'r> (String,): FromRow<'r, Row<D>>,
    for<'r> (String, i64): FromRow<'r, Row<D>>,
    for<'r> (i64, i64): FromRow<'r, Row<D>>,
    for<'r> (String, i32, String): FromRow<'r, Row<D>>,
    for<'r> (String, i64, Option<i32>): FromRow<'r, Row<D>>,
{
    fn backend(&self) -> Backend {
        D::BACKEND
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(self.reader()).await?;
        Ok(())
    }

    async fn create_job(&self, job: &NewJob) -> Result<Created> {
        // The second round only happens when the row that made the insert
        // conflict was purged before it could be read.
        for _ in 0..2 {
            let row: Option<JobRow> = sqlx::query_as(
                "INSERT INTO jobs (id, tenant, idempotency_key, payload_hash, fingerprint, route, request, metadata,
                                   state, version, not_before, created_at, updated_at, dialect, forwarded, key_id,
                                   batch_id)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'queued', 0, $9, $9, $9, $10, $11, $12, $13)
                 ON CONFLICT (tenant, idempotency_key) DO NOTHING
                 RETURNING *",
            )
            .bind(job.id.as_str())
            .bind(job.tenant.as_str())
            .bind(job.idempotency_key.as_str())
            .bind(job.payload_hash.as_str())
            .bind(job.fingerprint.as_str())
            .bind(job.route.as_str())
            .bind(job.request.as_str())
            .bind(job.metadata.as_deref())
            .bind(job.created_at)
            .bind(job.dialect.as_str())
            .bind(job.forwarded.as_deref())
            .bind(job.key_id.as_deref())
            .bind(job.batch_id.as_deref())
            .fetch_optional(self.writer())
            .await?;
            if let Some(new) = rows::job(row)? {
                return Ok(Created::New(new));
            }
            if let Some(existing) = self.job_by_key(&job.tenant, &job.idempotency_key).await? {
                return Ok(Created::Existing(existing));
            }
        }
        Err(StoreError::Corrupt(format!(
            "job key {:?} of tenant {:?} conflicts but cannot be read",
            job.idempotency_key, job.tenant
        )))
    }

    async fn job(&self, tenant: Option<&str>, id: &str) -> Result<Option<JobRecord>> {
        let row: Option<JobRow> = sqlx::query_as(
            "SELECT * FROM jobs WHERE id = $1 AND (CAST($2 AS TEXT) IS NULL OR tenant = $2)",
        )
        .bind(id)
        .bind(tenant)
        .fetch_optional(self.reader())
        .await?;
        rows::job(row)
    }

    async fn job_by_key(&self, tenant: &str, key: &str) -> Result<Option<JobRecord>> {
        let row: Option<JobRow> =
            sqlx::query_as("SELECT * FROM jobs WHERE tenant = $1 AND idempotency_key = $2")
                .bind(tenant)
                .bind(key)
                .fetch_optional(self.reader())
                .await?;
        rows::job(row)
    }

    async fn attempts(&self, job_id: &str) -> Result<Vec<AttemptRecord>> {
        let rows: Vec<AttemptRow> =
            sqlx::query_as("SELECT * FROM attempts WHERE job_id = $1 ORDER BY n")
                .bind(job_id)
                .fetch_all(self.reader())
                .await?;
        rows::attempts(rows)
    }

    async fn list_jobs(
        &self,
        tenant: &str,
        state: Option<JobState>,
        before: Option<&Cursor>,
        limit: u32,
    ) -> Result<Vec<JobRecord>> {
        let rows: Vec<JobRow> = sqlx::query_as(
            "SELECT * FROM jobs
             WHERE tenant = $1
               AND (CAST($2 AS TEXT) IS NULL OR state = $2)
               AND (CAST($3 AS BIGINT) IS NULL OR (created_at, id) < ($3, CAST($4 AS TEXT)))
             ORDER BY created_at DESC, id DESC
             LIMIT $5",
        )
        .bind(tenant)
        .bind(state.map(JobState::as_str))
        .bind(before.map(|c| c.created_at))
        .bind(before.map(|c| c.id.as_str()))
        .bind(i64::from(limit))
        .fetch_all(self.reader())
        .await?;
        rows::jobs(rows)
    }

    async fn list_all_jobs(
        &self,
        state: Option<JobState>,
        before: Option<&Cursor>,
        limit: u32,
    ) -> Result<Vec<JobRecord>> {
        let rows: Vec<JobRow> = sqlx::query_as(
            "SELECT * FROM jobs
             WHERE (CAST($1 AS TEXT) IS NULL OR state = $1)
               AND (CAST($2 AS BIGINT) IS NULL OR (created_at, id) < ($2, CAST($3 AS TEXT)))
             ORDER BY created_at DESC, id DESC
             LIMIT $4",
        )
        .bind(state.map(JobState::as_str))
        .bind(before.map(|c| c.created_at))
        .bind(before.map(|c| c.id.as_str()))
        .bind(i64::from(limit))
        .fetch_all(self.reader())
        .await?;
        rows::jobs(rows)
    }

    async fn claim_and_start(
        &self,
        worker: &str,
        now: i64,
        claim_until: i64,
        lease_until: i64,
        room: Room,
        choose: Chooser<'_>,
    ) -> Result<Vec<ClaimedJob>> {
        let mut tx = self.begin_write().await?;
        // The claim locks the rows it takes (PostgreSQL; SQLite's write
        // lock covers everything) until the commit: nobody starts, ends or
        // completes an attempt of these jobs meanwhile.
        let rows: Vec<JobRow> = sqlx::query_as(D::CLAIM)
            .bind(worker)
            .bind(now)
            .bind(claim_until)
            .bind(i64::from(room.jobs))
            .bind(i64::from(room.lines.min(room.jobs)))
            .fetch_all(&mut *tx)
            .await?;
        let mut jobs = rows::jobs(rows)?;
        if jobs.is_empty() {
            return Ok(Vec::new());
        }
        // RETURNING gives no order guarantee.
        jobs.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        let ids = json_ids(jobs.iter().map(|j| j.id.as_str()));
        let rows: Vec<AttemptRow> = sqlx::query_as(D::ATTEMPTS_OF)
            .persistent(false)
            .bind(ids.as_str())
            .fetch_all(&mut *tx)
            .await?;
        let mut by_job: HashMap<String, Vec<AttemptRecord>> = HashMap::new();
        for a in rows::attempts(rows)? {
            by_job.entry(a.job_id.clone()).or_default().push(a);
        }
        let mut claimed = Vec::with_capacity(jobs.len());
        let mut inserts = Vec::new();
        for job in jobs {
            let mut earlier = by_job.remove(&job.id).unwrap_or_default();
            earlier.sort_by_key(|a| a.n);
            if let Some(to) = choose(&job, &earlier)
                && !earlier.iter().any(|a| a.state.is_active())
            {
                inserts.push(json!({
                    "job_id": job.id,
                    "n": next_attempt(&job.id, &earlier)?,
                    "provider": to.provider,
                    "model": to.model,
                    "hedge": false,
                    "read_version": job.version,
                }));
            }
            claimed.push(ClaimedJob {
                job,
                earlier,
                started: None,
            });
        }
        if !inserts.is_empty() {
            let rows: Vec<AttemptRow> = sqlx::query_as(D::INSERT_ATTEMPTS)
                .bind(Value::from(inserts).to_string().as_str())
                .bind(worker)
                .bind(now)
                .bind(lease_until)
                .fetch_all(&mut *tx)
                .await?;
            let mut started: HashMap<String, AttemptRecord> = rows::attempts(rows)?
                .into_iter()
                .map(|a| (a.job_id.clone(), a))
                .collect();
            for c in &mut claimed {
                c.started = started.remove(&c.job.id);
            }
        }
        tx.commit().await?;
        Ok(claimed)
    }

    async fn renew_claim(&self, job_id: &str, worker: &str, claim_until: i64) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE jobs SET claim_until = $3 WHERE id = $1 AND state = 'running' AND claimed_by = $2",
        )
        .bind(job_id)
        .bind(worker)
        .bind(claim_until)
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done) == 1)
    }

    async fn requeue(
        &self,
        job_id: &str,
        worker: Option<&str>,
        not_before: i64,
        reopen: bool,
        now: i64,
    ) -> Result<bool> {
        let mut tx = self.begin_write().await?;
        if lock_job::<D>(&mut *tx, job_id).await?.is_none() {
            return Ok(false);
        }
        let done = sqlx::query(
            "UPDATE jobs
             SET state = 'queued', not_before = $3, version = version + 1, claimed_by = NULL, claim_until = NULL,
                 error = NULL, updated_at = $5,
                 retries = retries + CASE WHEN state = 'failed' THEN 1 ELSE 0 END
             WHERE id = $1
               AND ((state = 'running' AND (CAST($2 AS TEXT) IS NULL OR claimed_by = $2))
                    OR (state = 'failed' AND $4))
               AND NOT EXISTS (SELECT 1 FROM attempts
                               WHERE job_id = $1 AND state IN ('starting', 'running', 'unknown'))",
        )
        .bind(job_id)
        .bind(worker)
        .bind(not_before)
        .bind(reopen)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(D::rows_affected(&done) == 1)
    }

    async fn fail_job(&self, job_id: &str, error: &str, now: i64) -> Result<bool> {
        let mut tx = self.begin_write().await?;
        if lock_job::<D>(&mut *tx, job_id).await?.is_none() {
            return Ok(false);
        }
        let done = sqlx::query(
            "UPDATE jobs
             SET state = 'failed', error = $2, version = version + 1, claimed_by = NULL, claim_until = NULL,
                 updated_at = $3
             WHERE id = $1 AND state IN ('queued', 'running')
               AND NOT EXISTS (SELECT 1 FROM attempts
                               WHERE job_id = $1 AND state IN ('starting', 'running', 'unknown'))",
        )
        .bind(job_id)
        .bind(error)
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(D::rows_affected(&done) == 1)
    }

    async fn start_attempt(
        &self,
        job_id: &str,
        provider: &str,
        model: &str,
        hedge: bool,
        owner: &str,
        now: i64,
        lease_until: i64,
    ) -> Result<StartAttempt> {
        let mut tx = self.begin_write().await?;
        // The job row first: nobody starts, ends or completes an attempt
        // of this job until this transaction ends, and the attempts read
        // next are everything committed before.
        let version = match lock_job::<D>(&mut *tx, job_id).await? {
            Some((JobState::Queued | JobState::Running, version)) => version,
            _ => return Ok(StartAttempt::Closed),
        };
        let rows: Vec<AttemptRow> =
            sqlx::query_as("SELECT * FROM attempts WHERE job_id = $1 ORDER BY n")
                .bind(job_id)
                .fetch_all(&mut *tx)
                .await?;
        let earlier = rows::attempts(rows)?;
        if !hedge && earlier.iter().any(|a| a.state.is_active()) {
            return Ok(StartAttempt::Busy);
        }
        let row = json!([{
            "job_id": job_id,
            "n": next_attempt(job_id, &earlier)?,
            "provider": provider,
            "model": model,
            "hedge": hedge,
            "read_version": version,
        }]);
        let rows: Vec<AttemptRow> = sqlx::query_as(D::INSERT_ATTEMPTS)
            .bind(row.to_string().as_str())
            .bind(owner)
            .bind(now)
            .bind(lease_until)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        rows::attempts(rows)?
            .into_iter()
            .next()
            .map(StartAttempt::Started)
            .ok_or_else(|| {
                StoreError::Corrupt(format!("job {job_id}: the attempt was not returned"))
            })
    }

    async fn attempt_running(&self, job_id: &str, n: i32) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE attempts SET state = 'running' WHERE job_id = $1 AND n = $2 AND state = 'starting'",
        )
        .bind(job_id)
        .bind(n)
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done) == 1)
    }

    async fn renew_attempt(
        &self,
        job_id: &str,
        n: i32,
        owner: &str,
        lease_until: i64,
    ) -> Result<bool> {
        // Not `unknown`: a false here tells the owner its attempt was
        // declared unknown (its lease ran out) and must not carry on as if
        // nothing happened.
        let done = sqlx::query(
            "UPDATE attempts SET lease_until = $4
             WHERE job_id = $1 AND n = $2 AND owner = $3 AND state IN ('starting', 'running')",
        )
        .bind(job_id)
        .bind(n)
        .bind(owner)
        .bind(lease_until)
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done) == 1)
    }

    async fn finish_attempt(
        &self,
        job_id: &str,
        n: i32,
        to: AttemptState,
        reason: Option<&str>,
        now: i64,
    ) -> Result<bool> {
        if !rows::is_finish_target(to) {
            return Ok(false);
        }
        let done = sqlx::query(
            "UPDATE attempts SET state = $3, reason = $4, finished_at = $5
             WHERE job_id = $1 AND n = $2 AND state IN ('starting', 'running', 'unknown')",
        )
        .bind(job_id)
        .bind(n)
        .bind(to.as_str())
        .bind(reason)
        .bind(now)
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done) == 1)
    }

    async fn complete(
        &self,
        job_id: &str,
        n: i32,
        read_version: i64,
        result: &str,
        now: i64,
    ) -> Result<Completion> {
        let one = AttemptResult {
            job_id: job_id.to_string(),
            n,
            read_version,
            result: result.to_string(),
        };
        let done = self.complete_all(&[one], now).await?;
        done.into_iter()
            .next()
            .ok_or_else(|| StoreError::Corrupt(format!("job {job_id}: no completion outcome")))
    }

    async fn complete_all(&self, batch: &[AttemptResult], now: i64) -> Result<Vec<Completion>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        let ids = json_ids(batch.iter().map(|r| r.job_id.as_str()));
        let mut tx = self.begin_write().await?;
        // Job rows first, then their attempts (the order every
        // transaction takes them in).
        let jobs = lock_jobs::<D>(&mut *tx, &ids).await?;
        let attempts: Vec<(String, i32, String)> = sqlx::query_as(D::LOCK_ATTEMPTS)
            .persistent(false)
            .bind(ids.as_str())
            .fetch_all(&mut *tx)
            .await?;
        let mut active: HashSet<(String, i32)> = HashSet::new();
        for (job_id, n, state) in attempts {
            if rows::attempt_state(&job_id, n, &state)?.is_active() {
                active.insert((job_id, n));
            }
        }
        // Each entry in order, as if alone. An attempt that no longer runs
        // (or never existed) cannot complete the job, and its state (maybe
        // `succeeded`) must not be overwritten; one that runs wins if the
        // job is still at the version it read, and is discarded otherwise.
        let mut claimed_jobs: HashSet<&str> = HashSet::new();
        let mut wins = Vec::new();
        let mut ends = Vec::new();
        // Per entry: None (left alone), Some(true) (may win), Some(false).
        let mut verdicts: Vec<Option<bool>> = Vec::with_capacity(batch.len());
        for r in batch {
            let job = jobs.get(&r.job_id);
            if job.is_none() || !active.remove(&(r.job_id.clone(), r.n)) {
                verdicts.push(None);
                continue;
            }
            let wins_cas = job
                .is_some_and(|j| j.version == r.read_version && j.completed_by.is_none())
                && claimed_jobs.insert(r.job_id.as_str());
            if wins_cas {
                wins.push(json!({
                    "id": r.job_id,
                    "n": r.n,
                    "read_version": r.read_version,
                    "result": r.result,
                }));
            }
            verdicts.push(Some(wins_cas));
        }
        let mut won: HashMap<String, JobRecord> = HashMap::new();
        if !wins.is_empty() {
            // The compare-and-swap itself stays in the statement.
            let rows: Vec<JobRow> = sqlx::query_as(D::COMPLETE_JOBS)
                .persistent(false)
                .bind(Value::from(wins).to_string().as_str())
                .bind(now)
                .fetch_all(&mut *tx)
                .await?;
            for job in rows::jobs(rows)? {
                won.insert(job.id.clone(), job);
            }
        }
        let mut outcomes = Vec::with_capacity(batch.len());
        for (r, verdict) in batch.iter().zip(verdicts) {
            let Some(may_win) = verdict else {
                outcomes.push(Completion::Lost);
                continue;
            };
            let job = if may_win { won.remove(&r.job_id) } else { None };
            let to = if job.is_some() {
                AttemptState::Succeeded
            } else {
                AttemptState::Discarded
            };
            ends.push(json!({"job_id": r.job_id, "n": r.n, "state": to.as_str()}));
            outcomes.push(job.map_or(Completion::Lost, Completion::Won));
        }
        if !ends.is_empty() {
            sqlx::query(D::END_ATTEMPTS)
                .persistent(false)
                .bind(Value::from(ends).to_string().as_str())
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(outcomes)
    }

    async fn cancel_job(&self, tenant: &str, job_id: &str, now: i64) -> Result<Option<JobRecord>> {
        // The update re-checks the state of the row it changes (PostgreSQL
        // does so after waiting for a lock on it), so no lock is taken
        // first; a job it leaves alone is read as it is now.
        let mut tx = self.begin_write().await?;
        let cancelled: Option<JobRow> = sqlx::query_as(
            "UPDATE jobs
             SET state = 'cancelled', error = COALESCE(error, 'cancelled'), version = version + 1,
                 claimed_by = NULL, claim_until = NULL, updated_at = $3
             WHERE id = $1 AND tenant = $2 AND state NOT IN ('succeeded', 'cancelled')
             RETURNING *",
        )
        .bind(job_id)
        .bind(tenant)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let job = match cancelled {
            Some(row) => Some(row),
            None => {
                sqlx::query_as("SELECT * FROM jobs WHERE id = $1 AND tenant = $2")
                    .bind(job_id)
                    .bind(tenant)
                    .fetch_optional(&mut *tx)
                    .await?
            }
        };
        tx.commit().await?;
        rows::job(job)
    }

    async fn expire_attempt_leases(
        &self,
        lease_before: i64,
        now: i64,
    ) -> Result<Vec<AttemptRecord>> {
        let rows: Vec<AttemptRow> = sqlx::query_as(
            "UPDATE attempts SET state = 'unknown', reason = $3, finished_at = $2
             WHERE state IN ('starting', 'running') AND lease_until < $1
             RETURNING *",
        )
        .bind(lease_before)
        .bind(now)
        .bind(super::LEASE_EXPIRED)
        .fetch_all(self.writer())
        .await?;
        let mut attempts = rows::attempts(rows)?;
        attempts.sort_by(|a, b| (&a.job_id, a.n).cmp(&(&b.job_id, b.n)));
        Ok(attempts)
    }

    async fn expire_job_claims(&self, now: i64) -> Result<u64> {
        self.requeue_expired_claims(now).await
    }

    async fn unknown_attempts(&self) -> Result<Vec<AttemptRecord>> {
        let rows: Vec<AttemptRow> = sqlx::query_as(
            "SELECT * FROM attempts WHERE state = 'unknown' ORDER BY started_at, job_id, n",
        )
        .fetch_all(self.reader())
        .await?;
        rows::attempts(rows)
    }

    async fn count_jobs(&self, tenant: Option<&str>) -> Result<Vec<(JobState, i64)>> {
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT state, COUNT(*) FROM jobs
             WHERE (CAST($1 AS TEXT) IS NULL OR tenant = $1)
             GROUP BY state",
        )
        .bind(tenant)
        .fetch_all(self.reader())
        .await?;
        rows::zero_filled_counts(rows)
    }

    async fn purge(&self, created_before: i64) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM jobs WHERE created_at < $1 AND state IN ('succeeded', 'failed', 'cancelled')",
        )
        .bind(created_before)
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done))
    }

    async fn record_certification(&self, c: &Certification) -> Result<()> {
        sqlx::query(
            "INSERT INTO certifications (route, provider, model, contract_hash, passed, failures, certified_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(c.route.as_str())
        .bind(c.provider.as_str())
        .bind(c.model.as_str())
        .bind(c.contract_hash.as_str())
        .bind(c.passed)
        .bind(c.failures.as_str())
        .bind(c.certified_at)
        .execute(self.writer())
        .await?;
        Ok(())
    }

    async fn certifications(&self, route: &str) -> Result<Vec<Certification>> {
        let rows: Vec<CertificationRow> = sqlx::query_as(
            "SELECT * FROM (
                 SELECT *, ROW_NUMBER() OVER (PARTITION BY provider, model
                                              ORDER BY certified_at DESC, id DESC) AS rank
                 FROM certifications WHERE route = $1) AS ranked
             WHERE rank = 1
             ORDER BY provider, model",
        )
        .bind(route)
        .fetch_all(self.reader())
        .await?;
        Ok(rows.into_iter().map(Certification::from).collect())
    }

    async fn put_response(&self, r: &StoredResponse) -> Result<()> {
        sqlx::query(
            "INSERT INTO responses (tenant, id, body, turns, created_at, format, previous_id, fingerprint)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (tenant, id) DO NOTHING",
        )
        .bind(r.tenant.as_str())
        .bind(r.id.as_str())
        .bind(r.body.as_str())
        .bind(r.turns.as_str())
        .bind(r.created_at)
        .bind(r.format)
        .bind(r.previous_id.as_deref())
        .bind(r.fingerprint.as_deref())
        .execute(self.writer())
        .await?;
        Ok(())
    }

    async fn response(&self, tenant: &str, id: &str) -> Result<Option<StoredResponse>> {
        Ok(sqlx::query_as(
            "SELECT tenant, id, body, turns, created_at, format, previous_id, fingerprint
             FROM responses WHERE tenant = $1 AND id = $2",
        )
        .bind(tenant)
        .bind(id)
        .fetch_optional(self.reader())
        .await?)
    }

    async fn delete_response(&self, tenant: &str, id: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM responses WHERE tenant = $1 AND id = $2")
            .bind(tenant)
            .bind(id)
            .execute(self.writer())
            .await?;
        Ok(D::rows_affected(&done) > 0)
    }

    async fn purge_responses(&self, created_before: i64) -> Result<u64> {
        let done = sqlx::query("DELETE FROM responses WHERE created_at < $1")
            .bind(created_before)
            .execute(self.writer())
            .await?;
        Ok(D::rows_affected(&done))
    }

    async fn create_key(&self, key: &KeyRecord, audit: &AuditEntry) -> Result<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO api_keys (id, tenant, name, digest, hint, expires_at, models, rpm, tpm,
                                   budget_nanos, budget_period, metadata, created_at, revoked_at,
                                   rotated_at, last_used_at, version)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)",
        )
        .bind(key.id.as_str())
        .bind(key.tenant.as_str())
        .bind(key.name.as_str())
        .bind(key.digest.as_str())
        .bind(key.hint.as_str())
        .bind(key.expires_at)
        .bind(rows::models_text(key.models.as_deref()).as_deref())
        .bind(key.rpm)
        .bind(key.tpm)
        .bind(key.budget_nanos)
        .bind(key.budget_period.as_deref())
        .bind(key.metadata.as_deref())
        .bind(key.created_at)
        .bind(key.revoked_at)
        .bind(key.rotated_at)
        .bind(key.last_used_at)
        .bind(key.version)
        .execute(&mut *tx)
        .await?;
        upsert_budget::<D>(
            &mut *tx,
            &key_scope(&key.id),
            key.budget_nanos,
            key_period(key),
            key.created_at,
        )
        .await?;
        insert_audit::<D>(&mut *tx, audit).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn keys(&self, tenant: Option<&str>) -> Result<Vec<KeyRecord>> {
        let rows: Vec<KeyRow> = sqlx::query_as(
            "SELECT * FROM api_keys
             WHERE CAST($1 AS TEXT) IS NULL OR tenant = $1
             ORDER BY created_at, id",
        )
        .bind(tenant)
        .fetch_all(self.reader())
        .await?;
        rows::keys(rows)
    }

    async fn key(&self, id: &str) -> Result<Option<KeyRecord>> {
        let row: Option<KeyRow> = sqlx::query_as("SELECT * FROM api_keys WHERE id = $1")
            .bind(id)
            .fetch_optional(self.reader())
            .await?;
        rows::key(row)
    }

    async fn update_key(
        &self,
        id: &str,
        change: &KeyChange,
        audit: &AuditEntry,
    ) -> Result<Option<KeyRecord>> {
        let mut tx = self.begin_write().await?;
        // Each nullable column is set when its flag is, to its value (null
        // included); the update locks the row until the commit.
        let models: Option<Option<String>> = change
            .models
            .as_ref()
            .map(|m| rows::models_text(m.as_deref()));
        let new_models = models.clone().flatten();
        let row: Option<KeyRow> = sqlx::query_as(
            "UPDATE api_keys
             SET name = COALESCE(CAST($2 AS TEXT), name),
                 expires_at = CASE WHEN $3 THEN CAST($4 AS BIGINT) ELSE expires_at END,
                 models = CASE WHEN $5 THEN CAST($6 AS TEXT) ELSE models END,
                 rpm = CASE WHEN $7 THEN CAST($8 AS BIGINT) ELSE rpm END,
                 tpm = CASE WHEN $9 THEN CAST($10 AS BIGINT) ELSE tpm END,
                 budget_nanos = CASE WHEN $11 THEN CAST($12 AS BIGINT) ELSE budget_nanos END,
                 budget_period = CASE WHEN $13 THEN CAST($14 AS TEXT) ELSE budget_period END,
                 metadata = CASE WHEN $15 THEN CAST($16 AS TEXT) ELSE metadata END,
                 version = version + 1
             WHERE id = $1
             RETURNING *",
        )
        .bind(id)
        .bind(change.name.as_deref())
        .bind(change.expires_at.is_some())
        .bind(change.expires_at.flatten())
        .bind(models.is_some())
        .bind(new_models.as_deref())
        .bind(change.rpm.is_some())
        .bind(change.rpm.flatten())
        .bind(change.tpm.is_some())
        .bind(change.tpm.flatten())
        .bind(change.budget_nanos.is_some())
        .bind(change.budget_nanos.flatten())
        .bind(change.budget_period.is_some())
        .bind(change.budget_period.as_ref().and_then(|p| p.as_deref()))
        .bind(change.metadata.is_some())
        .bind(change.metadata.as_ref().and_then(|m| m.as_deref()))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(key) = rows::key(row)? else {
            return Ok(None);
        };
        if change.budget_nanos.is_some() || change.budget_period.is_some() {
            upsert_budget::<D>(
                &mut *tx,
                &key_scope(&key.id),
                key.budget_nanos,
                key_period(&key),
                audit.at,
            )
            .await?;
        }
        insert_audit::<D>(&mut *tx, audit).await?;
        tx.commit().await?;
        Ok(Some(key))
    }

    async fn revoke_key(
        &self,
        id: &str,
        now: i64,
        audit: &AuditEntry,
    ) -> Result<Option<KeyRecord>> {
        let mut tx = self.begin_write().await?;
        let revoked: Option<KeyRow> = sqlx::query_as(
            "UPDATE api_keys SET revoked_at = $2, version = version + 1
             WHERE id = $1 AND revoked_at IS NULL
             RETURNING *",
        )
        .bind(id)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let key = match revoked {
            Some(row) => {
                insert_audit::<D>(&mut *tx, audit).await?;
                Some(row)
            }
            // Revoked already, or no such key.
            None => {
                sqlx::query_as("SELECT * FROM api_keys WHERE id = $1")
                    .bind(id)
                    .fetch_optional(&mut *tx)
                    .await?
            }
        };
        tx.commit().await?;
        rows::key(key)
    }

    async fn rotate_key(
        &self,
        id: &str,
        digest: &str,
        hint: &str,
        now: i64,
        audit: &AuditEntry,
    ) -> Result<Option<KeyRecord>> {
        let mut tx = self.begin_write().await?;
        let row: Option<KeyRow> = sqlx::query_as(
            "UPDATE api_keys SET digest = $2, hint = $3, rotated_at = $4, version = version + 1
             WHERE id = $1 AND revoked_at IS NULL
             RETURNING *",
        )
        .bind(id)
        .bind(digest)
        .bind(hint)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(key) = rows::key(row)? else {
            return Ok(None);
        };
        insert_audit::<D>(&mut *tx, audit).await?;
        tx.commit().await?;
        Ok(Some(key))
    }

    async fn keys_version(&self) -> Result<(i64, i64)> {
        Ok(sqlx::query_as(
            "SELECT COUNT(*), CAST(COALESCE(SUM(version), 0) AS BIGINT) FROM api_keys",
        )
        .fetch_one(self.reader())
        .await?)
    }

    async fn touch_keys(&self, used: &[(String, i64)]) -> Result<()> {
        // One entry per key, its latest use (a key twice in one statement
        // would be updated from either entry).
        let mut latest: BTreeMap<&str, i64> = BTreeMap::new();
        for (id, t) in used {
            let at = latest.entry(id.as_str()).or_insert(*t);
            *at = (*at).max(*t);
        }
        if latest.is_empty() {
            return Ok(());
        }
        let batch: Vec<Value> = latest
            .into_iter()
            .map(|(id, t)| json!({"id": id, "t": t}))
            .collect();
        sqlx::query(D::TOUCH_KEYS)
            .persistent(false)
            .bind(Value::from(batch).to_string().as_str())
            .execute(self.writer())
            .await?;
        Ok(())
    }

    async fn audit_log(&self, key_id: Option<&str>, limit: u32) -> Result<Vec<AuditEntry>> {
        Ok(sqlx::query_as(
            "SELECT at, actor, action, key_id, tenant, detail FROM key_audit
             WHERE CAST($1 AS TEXT) IS NULL OR key_id = $1
             ORDER BY at DESC, id DESC
             LIMIT $2",
        )
        .bind(key_id)
        .bind(i64::from(limit))
        .fetch_all(self.reader())
        .await?)
    }

    async fn set_budget(
        &self,
        scope: &str,
        limit_nanos: Option<i64>,
        period_ms: Option<i64>,
        now: i64,
    ) -> Result<()> {
        let mut conn = self.writer().acquire().await?;
        upsert_budget::<D>(&mut *conn, scope, limit_nanos, period_ms, now).await
    }

    async fn grant(
        &self,
        scope: &str,
        holder: &str,
        need: i64,
        extra: i64,
        lease_until: i64,
        now: i64,
    ) -> Result<Option<i64>> {
        let need = need.max(0);
        let want = need.saturating_add(extra.max(0));
        let mut tx = self.begin_write().await?;
        // The budget row first: no other reservation or settlement of this
        // budget runs until the commit, and the grants read next are
        // everything committed before. Grants only grow under this lock;
        // what changes them meanwhile (a release, a lapsed lease removed)
        // only makes them smaller.
        let row: Option<(Option<i64>, Option<i64>, i64, i64)> = sqlx::query_as(D::LOCK_BUDGET)
            .bind(scope)
            .fetch_optional(&mut *tx)
            .await?;
        let (others, mine): (i64, i64) = sqlx::query_as(
            "SELECT CAST(COALESCE(SUM(CASE WHEN holder <> $2 AND lease_until > $3
                                           THEN amount_nanos ELSE 0 END), 0) AS BIGINT),
                    CAST(COALESCE(SUM(CASE WHEN holder = $2 THEN amount_nanos ELSE 0 END), 0) AS BIGINT)
             FROM budget_grants WHERE scope = $1",
        )
        .bind(scope)
        .bind(holder)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        let Some((limit, period, start, spent)) = row else {
            // No budget row: no budget. Nothing is written.
            return Ok(Some(mine.saturating_add(want)));
        };
        let (start_now, spent_now) = current_period(period, start, spent, now);
        let add = match limit {
            None => want,
            Some(limit) => {
                let left = limit
                    .saturating_sub(spent_now)
                    .saturating_sub(others)
                    .saturating_sub(mine);
                if left < need {
                    return Ok(None);
                }
                want.min(left)
            }
        };
        if (start_now, spent_now) != (start, spent) {
            sqlx::query("UPDATE budgets SET period_start = $2, spent_nanos = $3 WHERE scope = $1")
                .bind(scope)
                .bind(start_now)
                .bind(spent_now)
                .execute(&mut *tx)
                .await?;
        }
        // Added to the grant as it is now, not as read: a release that
        // committed meanwhile is kept.
        let (granted,): (i64,) = sqlx::query_as(
            "INSERT INTO budget_grants (scope, holder, amount_nanos, lease_until)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (scope, holder) DO UPDATE
             SET amount_nanos = budget_grants.amount_nanos + excluded.amount_nanos,
                 lease_until = excluded.lease_until
             RETURNING amount_nanos",
        )
        .bind(scope)
        .bind(holder)
        .bind(add)
        .bind(lease_until)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(granted))
    }

    async fn settle(&self, holder: &str, batch: &[Settlement], now: i64) -> Result<()> {
        // Rows are locked in the order of their scope, on every replica: two
        // batches never wait for each other in a circle.
        let mut sorted: Vec<&Settlement> = batch.iter().collect();
        sorted.sort_by(|a, b| a.scope.cmp(&b.scope));
        let mut tx = self.begin_write().await?;
        for s in sorted {
            // One statement for the row, which it locks until the commit.
            // A period that has elapsed moves on by whole periods and its
            // spend starts from 0, as `current_period` computes it.
            sqlx::query(
                "INSERT INTO budgets (scope, period_start, spent_nanos, total_nanos, calls)
                 VALUES ($1, $2, $3, $3, $4)
                 ON CONFLICT (scope) DO UPDATE
                 SET period_start = CASE
                         WHEN budgets.period_ms > 0 AND $2 >= budgets.period_start + budgets.period_ms
                         THEN budgets.period_start
                              + ($2 - budgets.period_start) / budgets.period_ms * budgets.period_ms
                         ELSE budgets.period_start END,
                     spent_nanos = CASE
                         WHEN budgets.period_ms > 0 AND $2 >= budgets.period_start + budgets.period_ms
                         THEN 0 ELSE budgets.spent_nanos END + $3,
                     total_nanos = budgets.total_nanos + $3,
                     calls = budgets.calls + $4",
            )
            .bind(s.scope.as_str())
            .bind(now)
            .bind(s.spent)
            .bind(s.calls)
            .execute(&mut *tx)
            .await?;
            if s.reserved > 0 {
                shrink_grant::<D>(&mut *tx, &s.scope, holder, s.reserved, None).await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    async fn release(&self, scope: &str, holder: &str, amount: i64) -> Result<()> {
        let mut tx = self.begin_write().await?;
        shrink_grant::<D>(&mut *tx, scope, holder, amount.max(0), None).await?;
        tx.commit().await?;
        Ok(())
    }

    async fn renew_grants(&self, holder: &str, now: i64, lease_until: i64) -> Result<u64> {
        let done = sqlx::query(
            "UPDATE budget_grants SET lease_until = $2 WHERE holder = $1 AND lease_until > $3",
        )
        .bind(holder)
        .bind(lease_until)
        .bind(now)
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done))
    }

    async fn expire_grants(&self, now: i64) -> Result<u64> {
        let done = sqlx::query(D::EXPIRE_GRANTS)
            .bind(now)
            .execute(self.writer())
            .await?;
        Ok(D::rows_affected(&done))
    }

    async fn budget(&self, scope: &str, now: i64) -> Result<Option<BudgetRecord>> {
        let row: Option<BudgetRow> = sqlx::query_as(
            "SELECT scope, limit_nanos, period_ms, period_start, spent_nanos, total_nanos, calls,
                    CAST(COALESCE((SELECT SUM(g.amount_nanos) FROM budget_grants AS g
                                   WHERE g.scope = budgets.scope AND g.lease_until > $2), 0)
                         AS BIGINT) AS reserved_nanos
             FROM budgets WHERE scope = $1",
        )
        .bind(scope)
        .bind(now)
        .fetch_optional(self.reader())
        .await?;
        Ok(row.map(|r| r.at(now)))
    }

    async fn budgets(&self, now: i64) -> Result<Vec<BudgetRecord>> {
        let rows: Vec<BudgetRow> = sqlx::query_as(
            "SELECT scope, limit_nanos, period_ms, period_start, spent_nanos, total_nanos, calls,
                    CAST(COALESCE((SELECT SUM(g.amount_nanos) FROM budget_grants AS g
                                   WHERE g.scope = budgets.scope AND g.lease_until > $1), 0)
                         AS BIGINT) AS reserved_nanos
             FROM budgets ORDER BY scope",
        )
        .bind(now)
        .fetch_all(self.reader())
        .await?;
        Ok(rows.into_iter().map(|r| r.at(now)).collect())
    }
}
