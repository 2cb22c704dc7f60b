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

use sqlx::Transaction;
use sqlx::sqlite::{
    Sqlite, SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteQueryResult, SqliteSynchronous,
};

use super::sql::Dialect;
use super::{Backend, Result, StoreError};

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

/// The SQLite implementation of [`Store`](super::Store) (the statements
/// are the shared ones of [`super::sql`]).
///
/// Writes go through a pool of one connection: SQLite takes one writer at
/// a time anyway, and queueing writers in the pool (fair, asynchronous)
/// beats letting many connections spin in SQLite's busy handler. Reads use
/// the other pool; in WAL mode they never wait for the writer.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    writer: SqlitePool,
    /// Where the files' parts live when not in the database.
    pub(super) parts: Option<super::parts::PartsDir>,
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
        super::migrations::migrator(super::migrations::SQLITE)
            .await?
            .run(&writer)
            .await?;
        let pool = SqlitePoolOptions::new()
            .max_connections(max_connections.max(1))
            .connect_with(options)
            .await?;
        Ok(SqliteStore {
            pool,
            writer,
            parts: None,
        })
    }
}

impl Dialect for SqliteStore {
    type Db = Sqlite;

    fn parts(&self) -> Option<&super::parts::PartsDir> {
        self.parts.as_ref()
    }

    const BACKEND: Backend = Backend::Sqlite;

    // The transaction holds the write lock already (`BEGIN IMMEDIATE`).
    const LOCK_JOB: &'static str = "SELECT state, version FROM jobs WHERE id = $1";
    // The write transaction holds SQLite's one write lock already.
    const LOCK_NAME: &'static str = "SELECT $1";
    const LOCK_JOBS: &'static str = "SELECT id, version, completed_by FROM jobs
         WHERE id IN (SELECT value FROM json_each($1))
         ORDER BY id";
    const LOCK_ATTEMPTS: &'static str = "SELECT job_id, n, state FROM attempts
         WHERE job_id IN (SELECT value FROM json_each($1))";
    const ATTEMPTS_OF: &'static str =
        "SELECT * FROM attempts WHERE job_id IN (SELECT value FROM json_each($1))";
    const INSERT_ATTEMPTS: &'static str =
        "INSERT INTO attempts (job_id, n, provider, model, state, hedge, read_version, owner, started_at, lease_until)
         SELECT json_extract(value, '$.job_id'), json_extract(value, '$.n'),
                json_extract(value, '$.provider'), json_extract(value, '$.model'), 'starting',
                json_extract(value, '$.hedge'), json_extract(value, '$.read_version'), $2, $3, $4
         FROM json_each($1)
         RETURNING *";
    const COMPLETE_JOBS: &'static str = "UPDATE jobs
         SET result = r.result, completed_by = r.n, version = jobs.version + 1, state = 'succeeded',
             claimed_by = NULL, claim_until = NULL, updated_at = $2
         FROM (SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.n') AS n,
                      json_extract(value, '$.read_version') AS read_version,
                      json_extract(value, '$.result') AS result
               FROM json_each($1)) AS r
         WHERE jobs.id = r.id AND jobs.version = r.read_version AND jobs.completed_by IS NULL
         RETURNING *";
    const END_ATTEMPTS: &'static str = "UPDATE attempts SET state = r.state, finished_at = $2
         FROM (SELECT json_extract(value, '$.job_id') AS job_id, json_extract(value, '$.n') AS n,
                      json_extract(value, '$.state') AS state
               FROM json_each($1)) AS r
         WHERE attempts.job_id = r.job_id AND attempts.n = r.n";

    // One statement: it holds the write lock from the selection to the
    // update, so no other claimer can pick the same rows.
    // Live jobs first, then batch lines up to their own limit.
    const CLAIM: &'static str =
        "UPDATE jobs
         SET state = 'running', claimed_by = $1, claim_until = $3, version = version + 1, updated_at = $2
         WHERE id IN (SELECT id FROM (
                          SELECT id, 0 AS kind, created_at FROM (
                              SELECT id, created_at FROM jobs
                              WHERE state = 'queued' AND not_before <= $2 AND batch_id IS NULL
                              ORDER BY created_at, id LIMIT $4)
                          UNION ALL
                          SELECT id, 1 AS kind, created_at FROM (
                              SELECT id, created_at FROM jobs
                              WHERE state = 'queued' AND not_before <= $2 AND batch_id IS NOT NULL
                              ORDER BY created_at, id LIMIT $5))
                      ORDER BY kind, created_at, id
                      LIMIT $4)
         RETURNING *";

    // The transaction holds the write lock already (`BEGIN IMMEDIATE`).
    const LOCK_BUDGET: &'static str =
        "SELECT limit_nanos, period_ms, period_start, spent_nanos FROM budgets WHERE scope = $1";
    const TOUCH_KEYS: &'static str = "UPDATE api_keys SET last_used_at = used.t
         FROM (SELECT json_extract(value, '$.id') AS id, json_extract(value, '$.t') AS t
               FROM json_each($1)) AS used
         WHERE api_keys.id = used.id
           AND (api_keys.last_used_at IS NULL OR api_keys.last_used_at < used.t)";
    const EXPIRE_GRANTS: &'static str = "DELETE FROM budget_grants WHERE lease_until <= $1";

    fn reader(&self) -> &SqlitePool {
        &self.pool
    }

    fn writer(&self) -> &SqlitePool {
        &self.writer
    }

    async fn begin_write(&self) -> Result<Transaction<'static, Sqlite>> {
        Ok(self.writer.begin_with(BEGIN_WRITE).await?)
    }

    async fn requeue_expired_claims(&self, now: i64) -> Result<u64> {
        // One statement: the active-attempt check and the update run under
        // the same write lock, so no attempt can start in between.
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

    fn rows_affected(done: &SqliteQueryResult) -> u64 {
        done.rows_affected()
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
