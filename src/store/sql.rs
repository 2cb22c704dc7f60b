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

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;

use async_trait::async_trait;
use serde_json::{Value, json};
use sqlx::database::HasStatementCache;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Pool, Transaction, Type};

use super::rows::{self, AttemptRow, CertificationRow, JobRow};
use super::{
    AttemptRecord, AttemptResult, AttemptState, Backend, Certification, Chooser, ClaimedJob,
    Completion, Created, Cursor, JobRecord, JobState, NewJob, Result, StartAttempt, Store,
    StoreError, StoredResponse,
};

/// What one database does differently; everything else is shared.
pub(super) trait Dialect: Send + Sync + 'static {
    type Db: Database + HasStatementCache;

    const BACKEND: Backend;

    /// In a write transaction, `SELECT state, version` of job `$1`, the row
    /// kept from change until the transaction ends.
    const LOCK_JOB: &'static str;

    /// The claim of [`Store::claim_and_start`] in one statement: up to `$4` queued jobs whose
    /// `not_before <= $2`, oldest first, become `running`, claimed by `$1`
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
    D: Dialect,
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
                                   state, version, not_before, created_at, updated_at, dialect, forwarded)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'queued', 0, $9, $9, $9, $10, $11)
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
        limit: u32,
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
            .bind(i64::from(limit))
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
            "UPDATE attempts SET state = 'unknown', reason = 'lease_expired', finished_at = $2
             WHERE state IN ('starting', 'running') AND lease_until < $1
             RETURNING *",
        )
        .bind(lease_before)
        .bind(now)
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
}
