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
//! A method that checks something and then writes runs in one transaction
//! begun by [`Dialect::begin_write`] and reads the job row with
//! [`Dialect::LOCK_JOB`] first: on SQLite the transaction holds the write
//! lock from its start, on PostgreSQL the statement locks the row (the
//! backends' module documentation says why each is enough).

use std::future::Future;

use async_trait::async_trait;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Pool, Transaction, Type};

use super::rows::{self, AttemptRow, CertificationRow, JobRow};
use super::{
    AttemptRecord, AttemptState, Backend, Certification, Completion, Created, Cursor, JobRecord,
    JobState, NewJob, Result, StartAttempt, Store, StoreError,
};

/// What one database does differently; everything else is shared.
pub(super) trait Dialect: Send + Sync + 'static {
    type Db: Database;

    const BACKEND: Backend;

    /// In a write transaction, `SELECT state, version` of job `$1`, the row
    /// kept from change until the transaction ends.
    const LOCK_JOB: &'static str;

    /// In a write transaction, `SELECT state` of attempt `($1, $2)`, the
    /// row kept from change until the transaction ends.
    const LOCK_ATTEMPT: &'static str;

    /// [`Store::claim_jobs`] in one statement: up to `$4` queued jobs whose
    /// `not_before <= $2`, oldest first, become `running`, claimed by `$1`
    /// until `$3`, version + 1, updated at `$2`; `RETURNING` them (in any
    /// order). No two claimers may pick the same job.
    const CLAIM: &'static str;

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
    for<'r> (String,): FromRow<'r, Row<D>>,
    for<'r> (String, i64): FromRow<'r, Row<D>>,
    for<'r> (i64, i64): FromRow<'r, Row<D>>,
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
                                   state, version, not_before, created_at, updated_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'queued', 0, $9, $9, $9)
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

    async fn claim_jobs(
        &self,
        worker: &str,
        now: i64,
        claim_until: i64,
        limit: u32,
    ) -> Result<Vec<JobRecord>> {
        let rows: Vec<JobRow> = sqlx::query_as(D::CLAIM)
            .bind(worker)
            .bind(now)
            .bind(claim_until)
            .bind(i64::from(limit))
            .fetch_all(self.writer())
            .await?;
        let mut jobs = rows::jobs(rows)?;
        // RETURNING gives no order guarantee.
        jobs.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
        Ok(jobs)
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
        let Some((state, version)) = lock_job::<D>(&mut *tx, job_id).await? else {
            return Ok(StartAttempt::Closed);
        };
        if !matches!(state, JobState::Queued | JobState::Running) {
            return Ok(StartAttempt::Closed);
        }
        let (active, last): (i64, i64) = sqlx::query_as(
            "SELECT COUNT(*) FILTER (WHERE state IN ('starting', 'running', 'unknown')),
                    CAST(COALESCE(MAX(n), 0) AS BIGINT)
             FROM attempts WHERE job_id = $1",
        )
        .bind(job_id)
        .fetch_one(&mut *tx)
        .await?;
        if active > 0 && !hedge {
            return Ok(StartAttempt::Busy);
        }
        let n = i32::try_from(last + 1)
            .map_err(|_| StoreError::Corrupt(format!("job {job_id}: too many attempts")))?;
        let row: AttemptRow = sqlx::query_as(
            "INSERT INTO attempts (job_id, n, provider, model, state, hedge, read_version, owner, started_at, lease_until)
             VALUES ($1, $2, $3, $4, 'starting', $5, $6, $7, $8, $9)
             RETURNING *",
        )
        .bind(job_id)
        .bind(n)
        .bind(provider)
        .bind(model)
        .bind(hedge)
        .bind(version)
        .bind(owner)
        .bind(now)
        .bind(lease_until)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(StartAttempt::Started(row.try_into()?))
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
        let mut tx = self.begin_write().await?;
        if lock_job::<D>(&mut *tx, job_id).await?.is_none() {
            return Ok(Completion::Lost);
        }
        let attempt: Option<(String,)> = sqlx::query_as(D::LOCK_ATTEMPT)
            .bind(job_id)
            .bind(n)
            .fetch_optional(&mut *tx)
            .await?;
        // An attempt that no longer runs (or never existed) cannot complete
        // the job, and its state (maybe `succeeded`) must not be overwritten.
        match attempt {
            Some((state,)) if rows::attempt_state(job_id, n, &state)?.is_active() => {}
            _ => return Ok(Completion::Lost),
        }
        let won: Option<JobRow> = sqlx::query_as(
            "UPDATE jobs
             SET result = $3, completed_by = $4, version = version + 1, state = 'succeeded',
                 claimed_by = NULL, claim_until = NULL, updated_at = $5
             WHERE id = $1 AND version = $2 AND completed_by IS NULL
             RETURNING *",
        )
        .bind(job_id)
        .bind(read_version)
        .bind(result)
        .bind(n)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let to = if won.is_some() {
            AttemptState::Succeeded
        } else {
            AttemptState::Discarded
        };
        sqlx::query(
            "UPDATE attempts SET state = $3, finished_at = $4 WHERE job_id = $1 AND n = $2",
        )
        .bind(job_id)
        .bind(n)
        .bind(to.as_str())
        .bind(now)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(match rows::job(won)? {
            Some(job) => Completion::Won(job),
            None => Completion::Lost,
        })
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
}
