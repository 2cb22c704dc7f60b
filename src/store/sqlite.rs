//! The SQLite store: the embedded default, one file in WAL mode.
//!
//! SQLite has one writer at a time. Every method that reads and then writes
//! opens its transaction with `BEGIN IMMEDIATE`, which takes the write lock
//! up front (waiting up to `busy_timeout`): a deferred transaction would
//! read under a shared lock and then fail with `SQLITE_BUSY` when it tries
//! to upgrade while another connection writes, and two of them could both
//! pass a check before either writes. Single statements need no such care:
//! an autocommit write statement takes the write lock before it reads.

use std::ffi::OsString;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::rows::{self, AttemptRow, CertificationRow, JobRow};
use super::{
    AttemptRecord, AttemptState, Backend, Certification, Completion, Created, Cursor, JobRecord,
    JobState, NewJob, Result, StartAttempt, Store, StoreError,
};

/// How long a statement waits for the write lock before failing. Writes are
/// short, so a long wait means something is stuck; several seconds absorbs
/// bursts of concurrent writers.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

/// The statement that opens read-then-write transactions (see the module
/// documentation).
const BEGIN_WRITE: &str = "BEGIN IMMEDIATE";

/// One `idem serve` per SQLite file: the exclusive lock on `<file>.lock`,
/// held for as long as the gateway runs.
///
/// At start-up a gateway on SQLite takes every attempt still `starting` or
/// `running` for the leftover of a process that is gone and makes it
/// `unknown`; a second gateway on the same file would do that to the first
/// one's live attempts, so it must not start. The lock is the kernel's
/// (`flock`), not a row or a file's existence: it goes with the process
/// however it ends, SIGKILL included, so a crash never blocks the restart.
/// The file itself stays, with the pid of the last holder, for the message
/// the next refused gateway prints.
#[derive(Debug)]
pub struct ServeLock {
    _file: File,
    path: PathBuf,
}

impl ServeLock {
    /// Takes the lock for the file named by a `sqlite:` url; `None` for an
    /// in-memory database (nothing to share). Never waits: a lock held by
    /// another process is [`StoreError::Locked`].
    pub fn acquire(url: &str) -> Result<Option<ServeLock>> {
        let options = SqliteConnectOptions::from_str(url)?;
        let db = options.get_filename();
        let name = db.to_string_lossy();
        if url.contains("mode=memory") || name == ":memory:" || name.starts_with("file:") {
            return Ok(None);
        }
        let mut path = OsString::from(db.as_os_str());
        path.push(".lock");
        let path = PathBuf::from(path);
        let shown = || path.display().to_string();
        let lock_error = |source| StoreError::Lock {
            path: shown(),
            source,
        };
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(lock_error)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(StoreError::Locked {
                    path: shown(),
                    holder: text.trim().parse().ok(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(lock_error(e)),
        }
        // The pid is for the message only: a failure to write it costs
        // nothing but that.
        let _ = file
            .set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| writeln!(file, "{}", std::process::id()));
        Ok(Some(ServeLock { _file: file, path }))
    }

    /// The lock file.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

/// The SQLite implementation of [`Store`].
///
/// Writes go through a pool of one connection: SQLite takes one writer at
/// a time anyway, and queueing writers in the pool (fair, asynchronous)
/// beats letting many connections spin in SQLite's busy handler. Reads use
/// the other pool; in WAL mode they never wait for the writer.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    writer: SqlitePool,
}

impl SqliteStore {
    /// Opens (creating if missing) the database file named by a
    /// `sqlite://FILE` url and runs the embedded migrations.
    pub async fn connect(url: &str, max_connections: u32) -> Result<Self> {
        let options = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // In WAL mode NORMAL is durable against application crashes and
            // only risks the last commits on power loss; FULL would fsync
            // on every commit.
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true)
            // SQLite's advice for long-lived databases: refresh the query
            // planner's statistics where it noted a need, when a connection
            // closes (the pools recycle theirs every 30 minutes), scanning
            // at most 400 rows per index.
            .optimize_on_close(true, 400);
        let writer = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await?;
        sqlx::migrate!("./migrations/sqlite").run(&writer).await?;
        let pool = SqlitePoolOptions::new()
            .max_connections(max_connections.max(1))
            .connect_with(options)
            .await?;
        Ok(SqliteStore { pool, writer })
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
        .fetch_optional(&self.writer)
        .await?;
        rows::job(row)
    }
}

#[async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> Backend {
        Backend::Sqlite
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
        let row: Option<JobRow> =
            sqlx::query_as("SELECT * FROM jobs WHERE id = $1 AND ($2 IS NULL OR tenant = $2)")
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
               AND ($2 IS NULL OR state = $2)
               AND ($3 IS NULL OR (created_at, id) < ($3, $4))
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
             WHERE ($1 IS NULL OR state = $1)
               AND ($2 IS NULL OR (created_at, id) < ($2, $3))
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
        // One statement: it holds the write lock from the selection to the
        // update, so no other claimer can pick the same rows.
        let rows: Vec<JobRow> = sqlx::query_as(
            "UPDATE jobs
             SET state = 'running', claimed_by = $1, claim_until = $3, version = version + 1, updated_at = $2
             WHERE id IN (SELECT id FROM jobs
                          WHERE state = 'queued' AND not_before <= $2
                          ORDER BY created_at, id
                          LIMIT $4)
             RETURNING *",
        )
        .bind(worker)
        .bind(now)
        .bind(claim_until)
        .bind(i64::from(limit))
        .fetch_all(&self.writer)
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
        .execute(&self.writer)
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
        // One statement: the active-attempt check and the update run under
        // the same write lock, so no attempt can start in between.
        let done = sqlx::query(
            "UPDATE jobs
             SET state = 'queued', not_before = $3, version = version + 1, claimed_by = NULL, claim_until = NULL,
                 error = NULL, updated_at = $5,
                 retries = retries + CASE WHEN state = 'failed' THEN 1 ELSE 0 END
             WHERE id = $1
               AND ((state = 'running' AND ($2 IS NULL OR claimed_by = $2)) OR (state = 'failed' AND $4))
               AND NOT EXISTS (SELECT 1 FROM attempts
                               WHERE job_id = $1 AND state IN ('starting', 'running', 'unknown'))",
        )
        .bind(job_id)
        .bind(worker)
        .bind(not_before)
        .bind(reopen)
        .bind(now)
        .execute(&self.writer)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn fail_job(&self, job_id: &str, error: &str, now: i64) -> Result<bool> {
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
        .execute(&self.writer)
        .await?;
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
        let mut tx = self.writer.begin_with(BEGIN_WRITE).await?;
        let job: Option<(String, i64)> =
            sqlx::query_as("SELECT state, version FROM jobs WHERE id = $1")
                .bind(job_id)
                .fetch_optional(&mut *tx)
                .await?;
        let Some((state, version)) = job else {
            return Ok(StartAttempt::Closed);
        };
        if !matches!(
            rows::job_state(job_id, &state)?,
            JobState::Queued | JobState::Running
        ) {
            return Ok(StartAttempt::Closed);
        }
        let (active, last): (i64, i64) = sqlx::query_as(
            "SELECT COUNT(*) FILTER (WHERE state IN ('starting', 'running', 'unknown')), COALESCE(MAX(n), 0)
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
            .execute(&self.writer)
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
        .execute(&self.writer)
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
        .execute(&self.writer)
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
        let mut tx = self.writer.begin_with(BEGIN_WRITE).await?;
        let attempt: Option<(String,)> =
            sqlx::query_as("SELECT state FROM attempts WHERE job_id = $1 AND n = $2")
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
        let mut tx = self.writer.begin_with(BEGIN_WRITE).await?;
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
        .fetch_all(&self.writer)
        .await?;
        let mut attempts = rows::attempts(rows)?;
        attempts.sort_by(|a, b| (&a.job_id, a.n).cmp(&(&b.job_id, b.n)));
        Ok(attempts)
    }

    async fn expire_job_claims(&self, now: i64) -> Result<u64> {
        let done = sqlx::query(
            "UPDATE jobs
             SET state = 'queued', version = version + 1, claimed_by = NULL, claim_until = NULL, updated_at = $1
             WHERE state = 'running' AND claim_until < $1
               AND NOT EXISTS (SELECT 1 FROM attempts
                               WHERE attempts.job_id = jobs.id AND attempts.state IN ('starting', 'running', 'unknown'))",
        )
        .bind(now)
        .execute(&self.writer)
        .await?;
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
        let rows: Vec<(String, i64)> = sqlx::query_as(
            "SELECT state, COUNT(*) FROM jobs WHERE ($1 IS NULL OR tenant = $1) GROUP BY state",
        )
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
        .execute(&self.writer)
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
        .execute(&self.writer)
        .await?;
        Ok(())
    }

    async fn certifications(&self, route: &str) -> Result<Vec<Certification>> {
        let rows: Vec<CertificationRow> = sqlx::query_as(
            "SELECT * FROM (
                 SELECT *, ROW_NUMBER() OVER (PARTITION BY provider, model
                                              ORDER BY certified_at DESC, id DESC) AS rank
                 FROM certifications WHERE route = $1)
             WHERE rank = 1
             ORDER BY provider, model",
        )
        .bind(route)
        .fetch_all(&self.pool)
        .await?;
        Ok(rows.into_iter().map(Certification::from).collect())
    }
}

#[cfg(test)]
mod lock_tests {
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_the_lock_goes_with_its_holder() {
        let dir = std::env::temp_dir().join(format!("idem-lock-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("idem.db").display());
        let first = ServeLock::acquire(&url).unwrap().unwrap();
        assert_eq!(first.path(), dir.join("idem.db.lock"));
        // Another open file description conflicts even in one process, as
        // another process's would.
        match ServeLock::acquire(&url) {
            Err(StoreError::Locked { path, holder }) => {
                assert!(path.ends_with("idem.db.lock"), "{path}");
                assert_eq!(holder, Some(std::process::id()));
            }
            other => panic!("a second holder: {other:?}"),
        }
        drop(first);
        // The file stays; its lock does not.
        assert!(dir.join("idem.db.lock").exists());
        let again = ServeLock::acquire(&url).unwrap();
        assert!(again.is_some());
        assert!(ServeLock::acquire("sqlite::memory:").unwrap().is_none());
        drop(again);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
