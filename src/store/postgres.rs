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
//! In the same way a key's row comes before its budget row, and a budget
//! row before its grants.
//!
//! Migrations may run from several replicas at once: sqlx's migrator holds
//! a `pg_advisory_lock` (keyed on the database name) while it migrates.

use sqlx::Transaction;
use sqlx::postgres::{PgPool, PgPoolOptions, PgQueryResult, Postgres};

use super::sql::Dialect;
use super::{Backend, Result};

/// The PostgreSQL implementation of [`Store`](super::Store) (the
/// statements are the shared ones of [`super::sql`]).
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
        super::migrations::migrator(super::migrations::POSTGRES)
            .await?
            .run(&pool)
            .await?;
        Ok(PgStore { pool })
    }
}

impl Dialect for PgStore {
    type Db = Postgres;

    const BACKEND: Backend = Backend::Postgres;

    const LOCK_JOB: &'static str = "SELECT state, version FROM jobs WHERE id = $1 FOR UPDATE";
    const LOCK_NAME: &'static str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";
    // Several job rows are locked in id order, so two transactions that
    // lock overlapping sets cannot wait on each other in a cycle. A batch
    // names its rows as `= ANY(ARRAY(...))` of the JSON parameter: the
    // planner then reads them by index, where a join on the JSON function
    // (estimated at 100 rows) scanned the whole table.
    const LOCK_JOBS: &'static str = "SELECT id, version, completed_by FROM jobs
         WHERE id = ANY(ARRAY(SELECT jsonb_array_elements_text(CAST($1 AS jsonb))))
         ORDER BY id
         FOR UPDATE";
    const LOCK_ATTEMPTS: &'static str = "SELECT job_id, n, state FROM attempts
         WHERE job_id = ANY(ARRAY(SELECT jsonb_array_elements_text(CAST($1 AS jsonb))))
         ORDER BY job_id, n
         FOR UPDATE";
    const ATTEMPTS_OF: &'static str = "SELECT * FROM attempts
         WHERE job_id = ANY(ARRAY(SELECT jsonb_array_elements_text(CAST($1 AS jsonb))))";
    const INSERT_ATTEMPTS: &'static str =
        "INSERT INTO attempts (job_id, n, provider, model, state, hedge, read_version, owner, started_at, lease_until)
         SELECT r.job_id, r.n, r.provider, r.model, 'starting', r.hedge, r.read_version, $2, $3, $4
         FROM jsonb_to_recordset(CAST($1 AS jsonb))
              AS r(job_id TEXT, n INTEGER, provider TEXT, model TEXT, hedge BOOLEAN, read_version BIGINT)
         RETURNING *";
    const COMPLETE_JOBS: &'static str = "UPDATE jobs
         SET result = r.result, completed_by = r.n, version = jobs.version + 1, state = 'succeeded',
             claimed_by = NULL, claim_until = NULL, updated_at = $2
         FROM jsonb_to_recordset(CAST($1 AS jsonb))
              AS r(id TEXT, n INTEGER, read_version BIGINT, result TEXT)
         WHERE jobs.id = ANY(ARRAY(SELECT jsonb_array_elements(CAST($1 AS jsonb)) ->> 'id'))
           AND jobs.id = r.id AND jobs.version = r.read_version AND jobs.completed_by IS NULL
         RETURNING jobs.*";
    const END_ATTEMPTS: &'static str = "UPDATE attempts SET state = r.state, finished_at = $2
         FROM jsonb_to_recordset(CAST($1 AS jsonb)) AS r(job_id TEXT, n INTEGER, state TEXT)
         WHERE attempts.job_id = ANY(ARRAY(SELECT jsonb_array_elements(CAST($1 AS jsonb)) ->> 'job_id'))
           AND attempts.job_id = r.job_id AND attempts.n = r.n";

    // SKIP LOCKED: concurrent claimers each lock different rows instead
    // of queueing behind one another; a row claimed and committed by
    // another worker meanwhile fails the re-checked `state = 'queued'`.
    // Live jobs first, then batch lines up to their own limit; the lines
    // locked and not taken are free again at the commit.
    const CLAIM: &'static str =
        "WITH live AS (
             SELECT id, created_at FROM jobs
             WHERE state = 'queued' AND not_before <= $2 AND batch_id IS NULL
             ORDER BY created_at, id
             LIMIT $4
             FOR UPDATE SKIP LOCKED),
         lines AS (
             SELECT id, created_at FROM jobs
             WHERE state = 'queued' AND not_before <= $2 AND batch_id IS NOT NULL
             ORDER BY created_at, id
             LIMIT $5
             FOR UPDATE SKIP LOCKED),
         picked AS (
             SELECT id FROM (SELECT id, 0 AS kind, created_at FROM live
                             UNION ALL
                             SELECT id, 1 AS kind, created_at FROM lines) AS due
             ORDER BY kind, created_at, id
             LIMIT $4)
         UPDATE jobs
         SET state = 'running', claimed_by = $1, claim_until = $3, version = jobs.version + 1, updated_at = $2
         FROM picked
         WHERE jobs.id = picked.id
         RETURNING jobs.*";

    const LOCK_BUDGET: &'static str = "SELECT limit_nanos, period_ms, period_start, spent_nanos
         FROM budgets WHERE scope = $1 FOR UPDATE";
    // The keys are locked in id order first, so two replicas recording
    // overlapping sets of keys cannot wait on each other in a cycle.
    const TOUCH_KEYS: &'static str = "WITH used AS (
             SELECT id, t FROM jsonb_to_recordset(CAST($1 AS jsonb)) AS r(id TEXT, t BIGINT)),
         locked AS (
             SELECT id FROM api_keys
             WHERE id = ANY(ARRAY(SELECT id FROM used))
             ORDER BY id
             FOR UPDATE)
         UPDATE api_keys SET last_used_at = used.t
         FROM used, locked
         WHERE api_keys.id = locked.id AND api_keys.id = used.id
           AND (api_keys.last_used_at IS NULL OR api_keys.last_used_at < used.t)";
    // SKIP LOCKED: a grant being renewed right now is left alone (it is
    // about to live on), so the reconciler never waits on a holder.
    const EXPIRE_GRANTS: &'static str = "DELETE FROM budget_grants
         WHERE (scope, holder) IN (SELECT scope, holder FROM budget_grants
                                   WHERE lease_until <= $1
                                   FOR UPDATE SKIP LOCKED)";

    fn reader(&self) -> &PgPool {
        &self.pool
    }

    fn writer(&self) -> &PgPool {
        &self.pool
    }

    async fn begin_write(&self) -> Result<Transaction<'static, Postgres>> {
        Ok(self.pool.begin().await?)
    }

    async fn requeue_expired_claims(&self, now: i64) -> Result<u64> {
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

    fn rows_affected(done: &PgQueryResult) -> u64 {
        done.rows_affected()
    }
}
