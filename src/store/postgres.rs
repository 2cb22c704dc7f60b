//! The PostgreSQL store, for several idem replicas sharing one database.
//!
//! Transactions run at READ COMMITTED, where every statement sees what was
//! committed before it started. A method that checks something and then
//! writes first locks the job row (`SELECT ... FOR UPDATE`); the checks
//! that follow are new statements, so they see everything committed by
//! whoever held the lock before, and nobody can change the job until we
//! commit. A single `UPDATE ... WHERE NOT EXISTS (...)` would not be
//! enough: after waiting for a row lock PostgreSQL re-checks the updated
//! row, but not the sub-select, which keeps the statement's old snapshot.
//!
//! Locks are always taken job row first, then attempt rows (as `DELETE`
//! cascading from jobs to attempts does), so transactions cannot deadlock.
//!
//! Migrations may run from several replicas at once: sqlx's migrator holds
//! a `pg_advisory_lock` (keyed on the database name) while it migrates.

use async_trait::async_trait;
use sqlx::postgres::{PgPool, PgPoolOptions};

use super::rows::{self, AttemptRow, CertificationRow, JobRow};
use super::{
    AttemptRecord, AttemptState, Backend, Certification, Completion, Created, Cursor, JobRecord,
    JobState, NewJob, Result, StartAttempt, Store, StoreError,
};

/// The PostgreSQL implementation of [`Store`].
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
}

impl PgStore {
    /// Connects a pool to a `postgres://` url and runs the embedded
    /// migrations (in the connection's `search_path` schema).
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self> {
        // A short acquire timeout: when PostgreSQL is down, job endpoints
        // answer 503 within seconds instead of hanging.
        let pool = PgPoolOptions::new()
            .max_connections(max_connections.max(1))
            .acquire_timeout(std::time::Duration::from_secs(5))
            .connect(url)
            .await?;
        sqlx::migrate!("./migrations/postgres").run(&pool).await?;
        Ok(PgStore { pool })
    }

    async fn insert_job(&self, job: &NewJob) -> Result<Option<JobRecord>> {
        let row: Option<JobRow> = sqlx::query_as(
            "INSERT INTO jobs (id, tenant, idempotency_key, payload_hash, fingerprint, route, request, metadata,
                               state, version, not_before, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'queued', 0, $9, $9, $9)
             ON CONFLICT (tenant, idempotency_key) DO NOTHING
             RETURNING *",
        )
        .bind(&job.id)
        .bind(&job.tenant)
        .bind(&job.idempotency_key)
        .bind(&job.payload_hash)
        .bind(&job.fingerprint)
        .bind(&job.route)
        .bind(&job.request)
        .bind(&job.metadata)
        .bind(job.created_at)
        .fetch_optional(&self.pool)
        .await?;
        rows::job(row)
    }
}

/// Locks a job row for the rest of the transaction (see the module
/// documentation); returns its state and version, or None if it does not
/// exist.
async fn lock_job(conn: &mut sqlx::PgConnection, job_id: &str) -> Result<Option<(JobState, i64)>> {
    let row: Option<(String, i64)> =
        sqlx::query_as("SELECT state, version FROM jobs WHERE id = $1 FOR UPDATE")
            .bind(job_id)
            .fetch_optional(conn)
            .await?;
    row.map(|(state, version)| Ok((rows::job_state(job_id, &state)?, version)))
        .transpose()
}

#[async_trait]
impl Store for PgStore {
    fn backend(&self) -> Backend {
        Backend::Postgres
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }

    async fn create_job(&self, job: &NewJob) -> Result<Created> {
        // The second round only happens when the row that made the insert
        // conflict was purged before it could be read.
        for _ in 0..2 {
            if let Some(new) = self.insert_job(job).await? {
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
            "SELECT * FROM jobs WHERE id = $1 AND ($2::text IS NULL OR tenant = $2)",
        )
        .bind(id)
        .bind(tenant)
        .fetch_optional(&self.pool)
        .await?;
        rows::job(row)
    }

    async fn job_by_key(&self, tenant: &str, key: &str) -> Result<Option<JobRecord>> {
        let row: Option<JobRow> =
            sqlx::query_as("SELECT * FROM jobs WHERE tenant = $1 AND idempotency_key = $2")
                .bind(tenant)
                .bind(key)
                .fetch_optional(&self.pool)
                .await?;
        rows::job(row)
    }

    async fn attempts(&self, job_id: &str) -> Result<Vec<AttemptRecord>> {
        let rows: Vec<AttemptRow> =
            sqlx::query_as("SELECT * FROM attempts WHERE job_id = $1 ORDER BY n")
                .bind(job_id)
                .fetch_all(&self.pool)
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
               AND ($2::text IS NULL OR state = $2)
               AND ($3::bigint IS NULL OR (created_at, id) < ($3, $4::text))
             ORDER BY created_at DESC, id DESC
             LIMIT $5",
        )
        .bind(tenant)
        .bind(state.map(JobState::as_str))
        .bind(before.map(|c| c.created_at))
        .bind(before.map(|c| c.id.as_str()))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
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
             WHERE ($1::text IS NULL OR state = $1)
               AND ($2::bigint IS NULL OR (created_at, id) < ($2, $3::text))
             ORDER BY created_at DESC, id DESC
             LIMIT $4",
        )
        .bind(state.map(JobState::as_str))
        .bind(before.map(|c| c.created_at))
        .bind(before.map(|c| c.id.as_str()))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
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
        // SKIP LOCKED: concurrent claimers each lock different rows instead
        // of queueing behind one another; a row claimed and committed by
        // another worker meanwhile fails the re-checked `state = 'queued'`.
        let rows: Vec<JobRow> = sqlx::query_as(
            "WITH picked AS (
                 SELECT id FROM jobs
                 WHERE state = 'queued' AND not_before <= $2
                 ORDER BY created_at, id
                 LIMIT $4
                 FOR UPDATE SKIP LOCKED)
             UPDATE jobs
             SET state = 'running', claimed_by = $1, claim_until = $3, version = jobs.version + 1, updated_at = $2
             FROM picked
             WHERE jobs.id = picked.id
             RETURNING jobs.*",
        )
        .bind(worker)
        .bind(now)
        .bind(claim_until)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
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
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn requeue(
        &self,
        job_id: &str,
        worker: Option<&str>,
        not_before: i64,
        reopen: bool,
        now: i64,
    ) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        if lock_job(&mut tx, job_id).await?.is_none() {
            return Ok(false);
        }
        let done = sqlx::query(
            "UPDATE jobs
             SET state = 'queued', not_before = $3, version = version + 1, claimed_by = NULL, claim_until = NULL,
                 error = NULL, updated_at = $5,
                 retries = retries + CASE WHEN state = 'failed' THEN 1 ELSE 0 END
             WHERE id = $1
               AND ((state = 'running' AND ($2::text IS NULL OR claimed_by = $2)) OR (state = 'failed' AND $4))
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
        Ok(done.rows_affected() == 1)
    }

    async fn fail_job(&self, job_id: &str, error: &str, now: i64) -> Result<bool> {
        let mut tx = self.pool.begin().await?;
        if lock_job(&mut tx, job_id).await?.is_none() {
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
        Ok(done.rows_affected() == 1)
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
        let mut tx = self.pool.begin().await?;
        let Some((state, version)) = lock_job(&mut tx, job_id).await? else {
            return Ok(StartAttempt::Closed);
        };
        if !matches!(state, JobState::Queued | JobState::Running) {
            return Ok(StartAttempt::Closed);
        }
        let (active, last): (i64, i64) = sqlx::query_as(
            "SELECT COUNT(*) FILTER (WHERE state IN ('starting', 'running', 'unknown')), COALESCE(MAX(n), 0)::bigint
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
        let done = sqlx::query("UPDATE attempts SET state = 'running' WHERE job_id = $1 AND n = $2 AND state = 'starting'")
            .bind(job_id)
            .bind(n)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn renew_attempt(
        &self,
        job_id: &str,
        n: i32,
        owner: &str,
        lease_until: i64,
    ) -> Result<bool> {
        // Not `unknown`: a false here tells the owner its attempt was
        // declared unknown (its lease ran out).
        let done = sqlx::query(
            "UPDATE attempts SET lease_until = $4
             WHERE job_id = $1 AND n = $2 AND owner = $3 AND state IN ('starting', 'running')",
        )
        .bind(job_id)
        .bind(n)
        .bind(owner)
        .bind(lease_until)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
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
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn complete(
        &self,
        job_id: &str,
        n: i32,
        read_version: i64,
        result: &str,
        now: i64,
    ) -> Result<Completion> {
        let mut tx = self.pool.begin().await?;
        if lock_job(&mut tx, job_id).await?.is_none() {
            return Ok(Completion::Lost);
        }
        let attempt: Option<(String,)> =
            sqlx::query_as("SELECT state FROM attempts WHERE job_id = $1 AND n = $2 FOR UPDATE")
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
        let mut tx = self.pool.begin().await?;
        let current: Option<JobRow> =
            sqlx::query_as("SELECT * FROM jobs WHERE id = $1 AND tenant = $2 FOR UPDATE")
                .bind(job_id)
                .bind(tenant)
                .fetch_optional(&mut *tx)
                .await?;
        let Some(current) = rows::job(current)? else {
            return Ok(None);
        };
        if matches!(current.state, JobState::Succeeded | JobState::Cancelled) {
            return Ok(Some(current));
        }
        let row: JobRow = sqlx::query_as(
            "UPDATE jobs
             SET state = 'cancelled', error = COALESCE(error, 'cancelled'), version = version + 1,
                 claimed_by = NULL, claim_until = NULL, updated_at = $2
             WHERE id = $1
             RETURNING *",
        )
        .bind(job_id)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Some(row.try_into()?))
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
        .fetch_all(&self.pool)
        .await?;
        let mut attempts = rows::attempts(rows)?;
        attempts.sort_by(|a, b| (&a.job_id, a.n).cmp(&(&b.job_id, b.n)));
        Ok(attempts)
    }

    async fn expire_job_claims(&self, now: i64) -> Result<u64> {
        let mut tx = self.pool.begin().await?;
        // Lock first, check attempts after (module documentation). Rows
        // locked by someone else right now are left for the next pass.
        let due: Vec<(String,)> = sqlx::query_as(
            "SELECT id FROM jobs WHERE state = 'running' AND claim_until < $1 FOR UPDATE SKIP LOCKED",
        )
        .bind(now)
        .fetch_all(&mut *tx)
        .await?;
        if due.is_empty() {
            return Ok(0);
        }
        let ids: Vec<String> = due.into_iter().map(|(id,)| id).collect();
        let done = sqlx::query(
            "UPDATE jobs
             SET state = 'queued', version = version + 1, claimed_by = NULL, claim_until = NULL, updated_at = $1
             WHERE id = ANY($2)
               AND NOT EXISTS (SELECT 1 FROM attempts
                               WHERE attempts.job_id = jobs.id AND attempts.state IN ('starting', 'running', 'unknown'))",
        )
        .bind(now)
        .bind(&ids)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(done.rows_affected())
    }

    async fn unknown_attempts(&self) -> Result<Vec<AttemptRecord>> {
        let rows: Vec<AttemptRow> = sqlx::query_as(
            "SELECT * FROM attempts WHERE state = 'unknown' ORDER BY started_at, job_id, n",
        )
        .fetch_all(&self.pool)
        .await?;
        rows::attempts(rows)
    }

    async fn count_jobs(&self, tenant: Option<&str>) -> Result<Vec<(JobState, i64)>> {
        let rows: Vec<(String, i64)> =
            sqlx::query_as("SELECT state, COUNT(*) FROM jobs WHERE ($1::text IS NULL OR tenant = $1) GROUP BY state")
                .bind(tenant)
                .fetch_all(&self.pool)
                .await?;
        rows::zero_filled_counts(rows)
    }

    async fn purge(&self, created_before: i64) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM jobs WHERE created_at < $1 AND state IN ('succeeded', 'failed', 'cancelled')",
        )
        .bind(created_before)
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected())
    }

    async fn record_certification(&self, c: &Certification) -> Result<()> {
        sqlx::query(
            "INSERT INTO certifications (route, provider, model, contract_hash, passed, failures, certified_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&c.route)
        .bind(&c.provider)
        .bind(&c.model)
        .bind(&c.contract_hash)
        .bind(c.passed)
        .bind(&c.failures)
        .bind(c.certified_at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    async fn certifications(&self, route: &str) -> Result<Vec<Certification>> {
        let rows: Vec<CertificationRow> = sqlx::query_as(
            "SELECT DISTINCT ON (provider, model) * FROM certifications
             WHERE route = $1
             ORDER BY provider, model, certified_at DESC, id DESC",
        )
        .bind(route)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(Certification::from).collect())
    }
}
