//! Durable storage of jobs, attempts, certifications, virtual keys,
//! budgets and the Batch API's files, behind one trait with two
//! implementations: SQLite (the embedded default, WAL) and PostgreSQL
//! (several replicas). Both run the same test suite.
//! Both also run the same SQL: it is written once, in `sql.rs` (the files'
//! in `files.rs`).
//!
//! The rules that must hold under concurrency live here, in SQL, not in
//! Rust read-then-write sequences: `(tenant, idempotency_key)` is UNIQUE and
//! creation races are settled by `INSERT ... ON CONFLICT`; an attempt starts
//! only if no other attempt of the job is `starting`, `running` or `unknown`
//! (hedges excepted), checked and written in one transaction that holds the
//! job row; a job is completed only by compare-and-swap on its `version`;
//! a budget is reserved only in a transaction that holds its row
//! ([`Store::grant`]).
//!
//! Times are milliseconds since the Unix epoch (`BIGINT`), ids are text
//! (UUID v7), requests and results are stored as the exact JSON text.

/// `FromRow` for a row struct on both backends' rows: each field read from
/// the column of its name. Written out rather than derived, so that sqlx's
/// macros (which would compile both database drivers a second time, for
/// the compiler) are not needed.
macro_rules! from_row {
    ($ty:ident { $($field:ident),* $(,)? }) => {
        from_row!(@on $ty, sqlx::sqlite::SqliteRow, $($field),*);
        from_row!(@on $ty, sqlx::postgres::PgRow, $($field),*);
    };
    (@on $ty:ident, $row:ty, $($field:ident),*) => {
        impl<'r> sqlx::FromRow<'r, $row> for $ty {
            fn from_row(row: &'r $row) -> Result<Self, sqlx::Error> {
                use sqlx::Row as _;
                Ok($ty {
                    $($field: row.try_get(stringify!($field))?,)*
                })
            }
        }
    };
}

mod batches;
mod files;
mod keys;
mod migrations;
pub mod parts;
pub mod postgres;
mod rows;
mod sql;
pub mod sqlite;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

pub use batches::{BatchCounts, BatchCreated, BatchRecord, BatchStatus, BatchStore, HELD};
pub use files::{ABANDONED_UPLOAD_MS, FileRecord, FileStore, Order, PART_BYTES};
pub use keys::{AuditEntry, BudgetRecord, KeyChange, KeyRecord, Settlement, period_ms};

/// Storage failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached (connection refused, pool timeout).
    #[error("storage unavailable: {0}")]
    Unavailable(#[source] sqlx::Error),
    #[error("storage error: {0}")]
    Database(#[source] sqlx::Error),
    #[error("migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// The directory of the files' parts (`batches.files_dir`) failed.
    #[error("file storage: {0}")]
    Files(#[source] std::io::Error),
    #[error("unsupported storage url (expected sqlite:// or postgres://)")]
    UnsupportedUrl,
    /// Another `idem serve` holds the SQLite file (see
    /// [`sqlite::ServeLock`]).
    #[error(
        "another `idem serve`{} already uses this SQLite file (it holds the lock on {path}); \
         one SQLite file serves one gateway: stop that one first, or use PostgreSQL to run several",
        holder.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    Locked { path: String, holder: Option<u32> },
    #[error("cannot lock {path}: {source}")]
    Lock {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        match e {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => StoreError::Unavailable(e),
            sqlx::Error::Database(ref db) if db.code().is_some_and(|c| transient_code(&c)) => {
                StoreError::Unavailable(e)
            }
            other => StoreError::Database(other),
        }
    }
}

/// Database error codes that mean "not now" rather than "wrong": the
/// caller gets 503 and may retry. PostgreSQL: connection exceptions (class
/// 08), a server shutting down or starting up (57P01..57P03), too many
/// connections (53300). SQLite: busy or locked past the busy timeout.
fn transient_code(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "53300" | "5" | "6")
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

/// Job states (docs/design.md, "Jobs and attempts").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum JobState {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl JobState {
    pub const ALL: [JobState; 5] = [
        JobState::Queued,
        JobState::Running,
        JobState::Succeeded,
        JobState::Failed,
        JobState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Running => "running",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|j| j.as_str() == s)
    }

    /// Succeeded or cancelled: nothing can change the job any more.
    pub fn is_final(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Cancelled)
    }
}

/// Attempt states (docs/design.md, "Jobs and attempts").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttemptState {
    /// Row written before the request leaves.
    Starting,
    /// The provider answered with headers; streaming in progress.
    Running,
    Succeeded,
    /// The provider certainly did not do the work.
    Failed,
    /// idem cannot know whether the provider did the work. Holds the job.
    Unknown,
    /// Resolved out of band as cancelled.
    Cancelled,
    /// Finished with a result but lost the race to complete the job.
    Discarded,
}

impl AttemptState {
    pub const ALL: [AttemptState; 7] = [
        AttemptState::Starting,
        AttemptState::Running,
        AttemptState::Succeeded,
        AttemptState::Failed,
        AttemptState::Unknown,
        AttemptState::Cancelled,
        AttemptState::Discarded,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            AttemptState::Starting => "starting",
            AttemptState::Running => "running",
            AttemptState::Succeeded => "succeeded",
            AttemptState::Failed => "failed",
            AttemptState::Unknown => "unknown",
            AttemptState::Cancelled => "cancelled",
            AttemptState::Discarded => "discarded",
        }
    }

    pub fn parse(s: &str) -> Option<AttemptState> {
        AttemptState::ALL.into_iter().find(|a| a.as_str() == s)
    }

    /// States that block a new (non-hedge) attempt of the same job.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            AttemptState::Starting | AttemptState::Running | AttemptState::Unknown
        )
    }
}

/// A job to create.
#[derive(Debug, Clone)]
pub struct NewJob {
    pub id: String,
    pub tenant: String,
    pub idempotency_key: String,
    pub payload_hash: String,
    pub fingerprint: String,
    pub route: String,
    /// The request its attempts send, as JSON text, in its dialect.
    pub request: String,
    /// The dialect of the request (`chat`, `messages`, `responses`, ...).
    pub dialect: String,
    /// The client's headers that change the answer, as a JSON object.
    pub forwarded: Option<String>,
    /// Client metadata, as JSON text.
    pub metadata: Option<String>,
    /// The store's key the job was created with (none: a key of the
    /// configuration file), whose budget its attempts' calls are charged.
    pub key_id: Option<String>,
    /// The batch whose line the job is (none: a job of its own).
    pub batch_id: Option<String>,
    pub created_at: i64,
}

/// A job row.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    pub id: String,
    pub tenant: String,
    pub idempotency_key: String,
    pub payload_hash: String,
    pub fingerprint: String,
    pub route: String,
    pub request: String,
    /// The dialect of the request and of its result.
    pub dialect: String,
    /// The client's headers that change the answer, as a JSON object.
    pub forwarded: Option<String>,
    pub metadata: Option<String>,
    pub state: JobState,
    pub version: i64,
    pub completed_by: Option<i32>,
    /// The winning attempt's answer, as JSON text.
    pub result: Option<String>,
    /// Why the job failed or was cancelled.
    pub error: Option<String>,
    /// A queued job is not claimed before this time (retry backoff).
    pub not_before: i64,
    pub claimed_by: Option<String>,
    pub claim_until: Option<i64>,
    /// Manual retries granted (each one attempt beyond `attempts.max`).
    pub retries: i32,
    /// The store's key the job was created with.
    pub key_id: Option<String>,
    /// The batch whose line the job is.
    pub batch_id: Option<String>,
    pub created_at: i64,
    pub updated_at: i64,
}

/// An attempt row.
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptRecord {
    pub job_id: String,
    pub n: i32,
    pub provider: String,
    pub model: String,
    pub state: AttemptState,
    pub reason: Option<String>,
    pub hedge: bool,
    /// The job version read when the attempt started (its CAS operand).
    pub read_version: i64,
    /// Which replica/worker runs it.
    pub owner: Option<String>,
    pub started_at: i64,
    pub finished_at: Option<i64>,
    pub lease_until: Option<i64>,
}

/// The result of [`Store::create_job`].
#[derive(Debug, Clone, PartialEq)]
pub enum Created {
    /// This call inserted the row.
    New(JobRecord),
    /// A row with this `(tenant, idempotency_key)` already existed; the
    /// caller compares payload hashes.
    Existing(JobRecord),
}

/// The target of a claimed job's first attempt (see
/// [`Store::claim_and_start`]).
#[derive(Debug, Clone, PartialEq)]
pub struct NewAttempt {
    pub provider: String,
    pub model: String,
}

/// How many jobs [`Store::claim_and_start`] may claim: at most `jobs`, of
/// which at most `lines` batch lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub jobs: u32,
    pub lines: u32,
}

/// What [`Store::claim_and_start`] is told, per claimed job (with its
/// earlier attempts, by number): the target of the attempt to start, if
/// any. Called once per job, in the order the claim returns them.
pub type Chooser<'a> =
    &'a mut (dyn FnMut(&JobRecord, &[AttemptRecord]) -> Option<NewAttempt> + Send);

/// A job [`Store::claim_and_start`] claimed.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedJob {
    /// The job as claimed (`running`, the claim's version).
    pub job: JobRecord,
    /// Its attempts before the claim, by number.
    pub earlier: Vec<AttemptRecord>,
    /// The attempt started with the claim, if one was chosen.
    pub started: Option<AttemptRecord>,
}

/// An attempt's result, one of a batch of completions (see
/// [`Store::complete_all`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AttemptResult {
    pub job_id: String,
    pub n: i32,
    /// The job version the attempt read when it started.
    pub read_version: i64,
    /// The answer, as JSON text.
    pub result: String,
}

/// The result of [`Store::start_attempt`].
#[derive(Debug, Clone, PartialEq)]
pub enum StartAttempt {
    Started(AttemptRecord),
    /// Another attempt is `starting`, `running` or `unknown`.
    Busy,
    /// The job is succeeded, failed or cancelled, or does not exist.
    Closed,
}

/// The result of [`Store::complete`].
#[derive(Debug, Clone, PartialEq)]
#[expect(
    clippy::large_enum_variant,
    reason = "one value per completion, returned and matched at once; boxing would only add an allocation"
)]
pub enum Completion {
    /// This attempt completed the job (the job as it is now).
    Won(JobRecord),
    /// Another attempt (or a cancel) got there first; this attempt is now
    /// `discarded` and its result was not written anywhere.
    Lost,
}

/// Where a listing continues (newest first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub created_at: i64,
    pub id: String,
}

/// A certification run of one target against a route's contract.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Certification {
    pub route: String,
    pub provider: String,
    pub model: String,
    pub contract_hash: String,
    pub passed: bool,
    /// JSON text: the failures found (empty array when passed).
    pub failures: String,
    pub certified_at: i64,
}

/// A response kept for its tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub tenant: String,
    pub id: String,
    /// JSON text: the `response` object as the client got it.
    pub body: String,
    /// JSON text: with `format` 2, this turn's items (its input, then the
    /// answer's output, as Responses items); with `format` 1 (rows written
    /// before), the conversation up to and including this answer, as chat
    /// messages, oldest first.
    pub turns: String,
    pub created_at: i64,
    pub format: i64,
    /// The response this one continued (format 2).
    pub previous_id: Option<String>,
    /// The task's fingerprint: a deletion removes its cached answers.
    pub fingerprint: Option<String>,
}

from_row!(StoredResponse {
    tenant,
    id,
    body,
    turns,
    created_at,
    format,
    previous_id,
    fingerprint
});

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// The storage interface. Every method is one short transaction (or one
/// statement); none holds a lock across a provider call.
#[async_trait]
pub trait Store: FileStore + BatchStore + Send + Sync + 'static {
    fn backend(&self) -> Backend;

    /// A round trip to the database (`/readyz`).
    async fn ping(&self) -> Result<()>;

    /// Inserts the job unless `(tenant, idempotency_key)` exists, in which
    /// case the existing row is returned. The database settles races:
    /// `INSERT ... ON CONFLICT DO NOTHING`, then a read of the winner.
    async fn create_job(&self, job: &NewJob) -> Result<Created>;

    /// A job by id; `tenant: Some(t)` restricts to that tenant's jobs.
    async fn job(&self, tenant: Option<&str>, id: &str) -> Result<Option<JobRecord>>;

    /// A job by its idempotency key.
    async fn job_by_key(&self, tenant: &str, key: &str) -> Result<Option<JobRecord>>;

    /// The attempts of a job, by number.
    async fn attempts(&self, job_id: &str) -> Result<Vec<AttemptRecord>>;

    /// A tenant's jobs, newest first, optionally of one state, strictly
    /// after `before`.
    async fn list_jobs(
        &self,
        tenant: &str,
        state: Option<JobState>,
        before: Option<&Cursor>,
        limit: u32,
    ) -> Result<Vec<JobRecord>>;

    /// Every tenant's jobs (the admin's view), newest first, optionally of
    /// one state, strictly after `before`: [`Store::list_jobs`] without the
    /// tenant filter.
    async fn list_all_jobs(
        &self,
        state: Option<JobState>,
        before: Option<&Cursor>,
        limit: u32,
    ) -> Result<Vec<JobRecord>>;

    /// Claims up to `room.jobs` queued jobs whose `not_before <= now`, live
    /// jobs first and then at most `room.lines` batch lines, each kind oldest
    /// first (docs/design.md, "Batches": the lines never take the workers
    /// kept for live jobs): they become `running`, claimed by `worker` until
    /// `claim_until`, version + 1. Concurrent claimers never get the same
    /// job (`FOR UPDATE SKIP LOCKED` on PostgreSQL). In the same
    /// transaction, it reads each job's attempts and starts the first
    /// attempt of this run where `choose` names a target and no attempt is
    /// active: as [`Store::start_attempt`] would, `starting`, owned by
    /// `worker`, leased until `lease_until`, with the claim's version as
    /// `read_version`. The jobs come back oldest first.
    async fn claim_and_start(
        &self,
        worker: &str,
        now: i64,
        claim_until: i64,
        lease_until: i64,
        room: Room,
        choose: Chooser<'_>,
    ) -> Result<Vec<ClaimedJob>>;

    /// Extends the claim while `worker` still holds it.
    async fn renew_claim(&self, job_id: &str, worker: &str, claim_until: i64) -> Result<bool>;

    /// `running` -> `queued` (not before `not_before`), version + 1, claim
    /// cleared; only if no attempt is active and, when `worker` is given,
    /// only if that worker holds the claim. Also `failed` -> `queued` when
    /// `reopen` (a manual retry), which grants the job one more attempt
    /// (`retries` + 1). Returns whether the row changed.
    async fn requeue(
        &self,
        job_id: &str,
        worker: Option<&str>,
        not_before: i64,
        reopen: bool,
        now: i64,
    ) -> Result<bool>;

    /// `queued`/`running` -> `failed` with `error`, version + 1, claim
    /// cleared; only if no attempt is active. Returns whether it changed.
    async fn fail_job(&self, job_id: &str, error: &str, now: i64) -> Result<bool>;

    /// Starts attempt `n = max(n) + 1` in state `starting` with
    /// `read_version` = the job's current version (not bumped). Refused
    /// (`Busy`) while another attempt is active unless `hedge`; `Closed`
    /// unless the job is `queued` or `running`. Check and insert happen in
    /// one transaction holding the job row.
    #[expect(clippy::too_many_arguments, reason = "one row's columns")]
    async fn start_attempt(
        &self,
        job_id: &str,
        provider: &str,
        model: &str,
        hedge: bool,
        owner: &str,
        now: i64,
        lease_until: i64,
    ) -> Result<StartAttempt>;

    /// `starting` -> `running` (the provider answered with headers).
    async fn attempt_running(&self, job_id: &str, n: i32) -> Result<bool>;

    /// Extends an active attempt's lease while `owner` runs it.
    async fn renew_attempt(
        &self,
        job_id: &str,
        n: i32,
        owner: &str,
        lease_until: i64,
    ) -> Result<bool>;

    /// Ends an attempt without a result: `to` is `failed`, `unknown` or
    /// `cancelled`; allowed from `starting`, `running` and `unknown` only.
    async fn finish_attempt(
        &self,
        job_id: &str,
        n: i32,
        to: AttemptState,
        reason: Option<&str>,
        now: i64,
    ) -> Result<bool>;

    /// Compare-and-swap completion (docs/design.md, "Jobs and attempts"):
    /// `UPDATE jobs SET result=.., completed_by=n, version=version+1,
    /// state='succeeded' WHERE id=$1 AND version=read_version AND
    /// completed_by IS NULL`; on success the attempt becomes `succeeded`,
    /// else `discarded` (its result is not stored). One transaction.
    async fn complete(
        &self,
        job_id: &str,
        n: i32,
        read_version: i64,
        result: &str,
        now: i64,
    ) -> Result<Completion>;

    /// [`Store::complete`] for a batch, in one transaction (one commit for
    /// many jobs): each entry is settled as if alone, in order (of two
    /// attempts of one job in the batch, the first wins and the second is
    /// discarded). One result per entry, in the same order.
    async fn complete_all(&self, batch: &[AttemptResult], now: i64) -> Result<Vec<Completion>>;

    /// Cancels a tenant's job unless it succeeded or is already
    /// cancelled: state `cancelled`, version + 1. Returns the job as it is
    /// afterwards (None: no such job for this tenant).
    async fn cancel_job(&self, tenant: &str, job_id: &str, now: i64) -> Result<Option<JobRecord>>;

    /// Attempts `starting`/`running` whose lease ended before
    /// `lease_before` become `unknown` (reason `lease_expired`, finished at
    /// `now`); returns them. Never re-runs.
    async fn expire_attempt_leases(
        &self,
        lease_before: i64,
        now: i64,
    ) -> Result<Vec<AttemptRecord>>;

    /// `running` jobs whose claim ended before `now` and that have no
    /// active attempt go back to `queued` (version + 1); returns how many.
    async fn expire_job_claims(&self, now: i64) -> Result<u64>;

    /// Attempts in state `unknown` (all tenants).
    async fn unknown_attempts(&self) -> Result<Vec<AttemptRecord>>;

    /// Jobs by state, for one tenant or all.
    async fn count_jobs(&self, tenant: Option<&str>) -> Result<Vec<(JobState, i64)>>;

    /// Deletes jobs (and their attempts) created before `created_before`
    /// that are no longer active (`succeeded`, `failed`, `cancelled`), so
    /// their keys may be reused. Returns how many.
    async fn purge(&self, created_before: i64) -> Result<u64>;

    async fn record_certification(&self, c: &Certification) -> Result<()>;

    /// Keeps a response (`store: true` on `POST /v1/responses`). The same
    /// tenant and id again is the same answer: the first one written stays.
    async fn put_response(&self, r: &StoredResponse) -> Result<()>;

    /// A tenant's kept response; another tenant's is `None`.
    async fn response(&self, tenant: &str, id: &str) -> Result<Option<StoredResponse>>;

    /// Deletes a tenant's kept response; false when it had none by that id.
    async fn delete_response(&self, tenant: &str, id: &str) -> Result<bool>;

    /// Deletes the responses kept before `created_before`. Returns how many.
    async fn purge_responses(&self, created_before: i64) -> Result<u64>;

    /// The latest certification of each (provider, model) for a route.
    async fn certifications(&self, route: &str) -> Result<Vec<Certification>>;

    /// Inserts a key, its budget row `key:<id>` (limit `budget_nanos`,
    /// period from `budget_period`, starting at `created_at`) and the audit
    /// entry, in one transaction. A key whose id or digest exists already
    /// is an error, and so is a `budget_period` other than `1d`, `7d` or
    /// `30d`: nothing is written.
    async fn create_key(&self, key: &KeyRecord, audit: &AuditEntry) -> Result<()>;

    /// Every key, revoked ones too, or one tenant's; oldest first.
    async fn keys(&self, tenant: Option<&str>) -> Result<Vec<KeyRecord>>;

    /// A key by id.
    async fn key(&self, id: &str) -> Result<Option<KeyRecord>>;

    /// Applies `change` to a key (revoked or not), version + 1, and writes
    /// the audit entry, in one transaction. A change of `budget_nanos` or
    /// `budget_period` changes the limit and period of the key's budget row
    /// and keeps its spend and period start (a shorter period moves on, by
    /// whole periods, at the next reservation or settlement). Returns the
    /// key as it is now; None (and nothing written) if there is no such
    /// key.
    async fn update_key(
        &self,
        id: &str,
        change: &KeyChange,
        audit: &AuditEntry,
    ) -> Result<Option<KeyRecord>>;

    /// Revokes a key at `now`: `revoked_at` set, version + 1, the audit
    /// entry written, in one transaction. A key revoked already is left as
    /// it is (no version, no audit entry). Returns the key as it is now;
    /// None if there is no such key.
    async fn revoke_key(&self, id: &str, now: i64, audit: &AuditEntry)
    -> Result<Option<KeyRecord>>;

    /// Gives a key a new secret: `digest` and `hint` replaced, `rotated_at`
    /// = `now`, version + 1, the audit entry written, in one transaction.
    /// The id stays, and with it the key's budget, spend and audit history.
    /// None (and nothing written) for a revoked key or no such key; a digest
    /// another key has is an error.
    async fn rotate_key(
        &self,
        id: &str,
        digest: &str,
        hint: &str,
        now: i64,
        audit: &AuditEntry,
    ) -> Result<Option<KeyRecord>>;

    /// `(COUNT(*), SUM(version))` of the keys: every change of a key adds a
    /// row or a version, so replicas poll this (one cheap statement) to
    /// notice changes and reload only then. [`Store::touch_keys`] does not
    /// change it.
    async fn keys_version(&self) -> Result<(i64, i64)>;

    /// Records when keys were used: `last_used_at` becomes the later of
    /// itself and `t` for each `(id, t)`, in one statement, without a
    /// version change. Unknown ids are ignored.
    async fn touch_keys(&self, used: &[(String, i64)]) -> Result<()>;

    /// The audit log, of one key or of all, newest first, at most `limit`
    /// entries.
    async fn audit_log(&self, key_id: Option<&str>, limit: u32) -> Result<Vec<AuditEntry>>;

    /// Sets the limit and period of budget `scope` (a tenant's, from the
    /// configuration), creating the row with its period starting at `now`
    /// if it has none; the spend and period start of an existing row stay.
    async fn set_budget(
        &self,
        scope: &str,
        limit_nanos: Option<i64>,
        period_ms: Option<i64>,
        now: i64,
    ) -> Result<()>;

    /// Reserves at least `need` and at most `need + extra` of budget
    /// `scope` for `holder`, leased until `lease_until`. Returns the
    /// holder's grant as it is afterwards, or None when less than `need` is
    /// left (nothing changes then). A negative `need` or `extra` counts as
    /// 0.
    ///
    /// In one transaction that holds the budget row: a period that has
    /// elapsed at `now` moves on (spend from 0); what is left is `limit -
    /// spent - others - mine`, where `others` is the sum of the live grants
    /// (`lease_until > now`) of other holders and `mine` this holder's
    /// grant, live or not (a lapsed grant is still its own holder's). The
    /// grant grows by `min(need + extra, left)`. Holders racing, on any
    /// connection or process, are never granted more together than the
    /// budget has left. A budget without a limit grants `need + extra`
    /// (and records it); a scope without a budget row has no budget: it
    /// grants `mine + need + extra` and writes nothing.
    async fn grant(
        &self,
        scope: &str,
        holder: &str,
        need: i64,
        extra: i64,
        lease_until: i64,
        now: i64,
    ) -> Result<Option<i64>>;

    /// Settles calls against their spenders, every spender of `batch` in
    /// one transaction (a batch is written whole or not at all), each
    /// holding its row: a period that has elapsed at `now` moves on;
    /// `spent` (the calls' real cost, which may exceed what they reserved)
    /// is added to the period's and the total spend, and `calls` to the
    /// count; `holder`'s grant shrinks by `reserved` (not below 0, and a
    /// grant that reaches 0 is removed). A scope without a budget row gets
    /// one without a limit, so that the spend of keys without a budget is
    /// counted too.
    async fn settle(&self, holder: &str, batch: &[Settlement], now: i64) -> Result<()>;

    /// Gives back `amount` of `holder`'s grant of `scope` (not below 0; a
    /// grant that reaches 0 is removed). Its lease stays as it is.
    async fn release(&self, scope: &str, holder: &str, amount: i64) -> Result<()>;

    /// Extends the lease of every grant of `holder` still alive at `now`
    /// until `lease_until`; returns how many. A grant whose lease ended is
    /// never revived: others may have been granted its room since (its
    /// holder asks [`Store::grant`] again, which checks).
    async fn renew_grants(&self, holder: &str, now: i64, lease_until: i64) -> Result<u64>;

    /// Deletes the grants whose lease ended at or before `now` (a dead
    /// holder's reservations are released); returns how many.
    async fn expire_grants(&self, now: i64) -> Result<u64>;

    /// Budget `scope` as of `now`: a period that has elapsed reads as the
    /// current one, with spend 0 (nothing is written); `reserved_nanos`
    /// is the sum of its live grants.
    async fn budget(&self, scope: &str, now: i64) -> Result<Option<BudgetRecord>>;

    /// Every budget as of `now`, as [`Store::budget`] reads one, by scope.
    async fn budgets(&self, now: i64) -> Result<Vec<BudgetRecord>>;
}

/// Opens the store named by `url` and runs its migrations.
pub async fn connect(url: &str, max_connections: u32) -> Result<Arc<dyn Store>> {
    connect_with(url, max_connections, None).await
}

/// [`connect`], with the files' parts in `files_dir` instead of the
/// database (SQLite only: the configuration refuses it beside PostgreSQL).
pub async fn connect_with(
    url: &str,
    max_connections: u32,
    files_dir: Option<&std::path::Path>,
) -> Result<Arc<dyn Store>> {
    if url.starts_with("sqlite:") {
        let mut store = sqlite::SqliteStore::connect(url, max_connections).await?;
        if let Some(dir) = files_dir {
            store.parts = Some(parts::PartsDir::new(dir.to_path_buf()));
        }
        Ok(Arc::new(store))
    } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        Ok(Arc::new(
            postgres::PgStore::connect(url, max_connections).await?,
        ))
    } else {
        Err(StoreError::UnsupportedUrl)
    }
}

/// The reason of an attempt made `unknown` because its lease expired (its
/// process died or stalled): no call of it listens for an answer.
pub const LEASE_EXPIRED: &str = "lease_expired";

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    let d = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// RFC 3339 text of a millisecond timestamp.
pub fn rfc3339(ms: i64) -> String {
    // humantime formats years up to 9999; clamp rather than fail.
    const MAX_MS: u64 = 253_402_300_799_999;
    let ms = u64::try_from(ms).unwrap_or(0).min(MAX_MS);
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    humantime::format_rfc3339_millis(t).to_string()
}

#[cfg(test)]
mod error_tests {
    use super::transient_code;

    #[test]
    fn a_database_restarting_is_unavailable_not_internal() {
        for code in [
            "08006", "08001", "57P01", "57P02", "57P03", "53300", "5", "6",
        ] {
            assert!(transient_code(code), "{code}");
        }
        for code in ["23505", "42P01", "40001", "19"] {
            assert!(!transient_code(code), "{code}");
        }
    }
}
