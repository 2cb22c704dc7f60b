//! Batches of the Batch API in the store: a row per batch, its lines as
//! jobs (`jobs.batch_id`), and the claim that lets one replica at a time
//! drive a batch (docs/design.md, "Batches").
//!
//! A batch's status only moves by compare-and-swap on the status its
//! driver read ([`BatchStore::set_batch`]), so a cancel that lands while
//! the driver writes progress is never overwritten; a driver that died
//! leaves a claim that lapses ([`BatchStore::claim_batch`] takes it over).

use async_trait::async_trait;
use sqlx::{Database, Encode, Executor, FromRow, IntoArguments, Type};

use super::rows::JobRow;
use super::sql::Dialect;
use super::{Created, JobRecord, NewJob, Result, StoreError, rows};

/// A batch's status, as OpenAI names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchStatus {
    Validating,
    Failed,
    InProgress,
    Finalizing,
    Completed,
    Expired,
    Cancelling,
    Cancelled,
}

impl BatchStatus {
    pub const ALL: [BatchStatus; 8] = [
        BatchStatus::Validating,
        BatchStatus::Failed,
        BatchStatus::InProgress,
        BatchStatus::Finalizing,
        BatchStatus::Completed,
        BatchStatus::Expired,
        BatchStatus::Cancelling,
        BatchStatus::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            BatchStatus::Validating => "validating",
            BatchStatus::Failed => "failed",
            BatchStatus::InProgress => "in_progress",
            BatchStatus::Finalizing => "finalizing",
            BatchStatus::Completed => "completed",
            BatchStatus::Expired => "expired",
            BatchStatus::Cancelling => "cancelling",
            BatchStatus::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<BatchStatus> {
        BatchStatus::ALL.into_iter().find(|b| b.as_str() == s)
    }

    /// A status a driver still has work in.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            BatchStatus::Validating
                | BatchStatus::InProgress
                | BatchStatus::Finalizing
                | BatchStatus::Cancelling
        )
    }
}

/// A batch's lines by how they ended, and the `idem` extension's counts of
/// those answered without a call of their own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchCounts {
    pub total: i64,
    pub completed: i64,
    pub failed: i64,
    /// Answered by an earlier line of the same batch.
    pub deduplicated: i64,
    /// Answered by a line of an earlier batch of the tenant.
    pub reused: i64,
    /// Not run: the batch was cancelled or expired first (among `failed`).
    pub not_run: i64,
}

/// A `batches` row.
#[derive(Debug, Clone, PartialEq)]
pub struct BatchRecord {
    /// `batch_<uuid v7, hex>`.
    pub id: String,
    pub tenant: String,
    pub idempotency_key: Option<String>,
    /// What a batch created again with the same key must match.
    pub payload_hash: String,
    pub endpoint: String,
    pub input_file_id: String,
    pub completion_window: String,
    /// JSON text.
    pub metadata: Option<String>,
    /// The store's key the batch was created with (its budget pays).
    pub key_id: Option<String>,
    pub status: BatchStatus,
    /// JSON text: the validation errors that failed the batch.
    pub errors: Option<String>,
    pub output_file_id: Option<String>,
    pub error_file_id: Option<String>,
    pub counts: BatchCounts,
    pub created_at: i64,
    pub expires_at: i64,
    pub in_progress_at: Option<i64>,
    pub finalizing_at: Option<i64>,
    pub completed_at: Option<i64>,
    pub failed_at: Option<i64>,
    pub expired_at: Option<i64>,
    pub cancelling_at: Option<i64>,
    pub cancelled_at: Option<i64>,
    pub claimed_by: Option<String>,
    pub claim_until: Option<i64>,
    /// JSON text: the provider batches its lines were sent to (provider,
    /// model, provider batch id), for a driver that resumes it.
    pub upstream: Option<String>,
}

/// A `batches` row as the database returns it.
#[derive(Debug)]
pub(super) struct BatchRow {
    id: String,
    tenant: String,
    idempotency_key: Option<String>,
    payload_hash: String,
    endpoint: String,
    input_file_id: String,
    completion_window: String,
    metadata: Option<String>,
    key_id: Option<String>,
    status: String,
    errors: Option<String>,
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    total: i64,
    completed: i64,
    failed: i64,
    deduplicated: i64,
    reused: i64,
    not_run: i64,
    created_at: i64,
    expires_at: i64,
    in_progress_at: Option<i64>,
    finalizing_at: Option<i64>,
    completed_at: Option<i64>,
    failed_at: Option<i64>,
    expired_at: Option<i64>,
    cancelling_at: Option<i64>,
    cancelled_at: Option<i64>,
    claimed_by: Option<String>,
    claim_until: Option<i64>,
    upstream: Option<String>,
}

from_row!(BatchRow {
    id,
    tenant,
    idempotency_key,
    payload_hash,
    endpoint,
    input_file_id,
    completion_window,
    metadata,
    key_id,
    status,
    errors,
    output_file_id,
    error_file_id,
    total,
    completed,
    failed,
    deduplicated,
    reused,
    not_run,
    created_at,
    expires_at,
    in_progress_at,
    finalizing_at,
    completed_at,
    failed_at,
    expired_at,
    cancelling_at,
    cancelled_at,
    claimed_by,
    claim_until,
    upstream
});

impl TryFrom<BatchRow> for BatchRecord {
    type Error = StoreError;

    fn try_from(r: BatchRow) -> Result<Self, StoreError> {
        let status = BatchStatus::parse(&r.status).ok_or_else(|| {
            StoreError::Corrupt(format!("batch {}: unknown status {:?}", r.id, r.status))
        })?;
        Ok(BatchRecord {
            id: r.id,
            tenant: r.tenant,
            idempotency_key: r.idempotency_key,
            payload_hash: r.payload_hash,
            endpoint: r.endpoint,
            input_file_id: r.input_file_id,
            completion_window: r.completion_window,
            metadata: r.metadata,
            key_id: r.key_id,
            status,
            errors: r.errors,
            output_file_id: r.output_file_id,
            error_file_id: r.error_file_id,
            counts: BatchCounts {
                total: r.total,
                completed: r.completed,
                failed: r.failed,
                deduplicated: r.deduplicated,
                reused: r.reused,
                not_run: r.not_run,
            },
            created_at: r.created_at,
            expires_at: r.expires_at,
            in_progress_at: r.in_progress_at,
            finalizing_at: r.finalizing_at,
            completed_at: r.completed_at,
            failed_at: r.failed_at,
            expired_at: r.expired_at,
            cancelling_at: r.cancelling_at,
            cancelled_at: r.cancelled_at,
            claimed_by: r.claimed_by,
            claim_until: r.claim_until,
            upstream: r.upstream,
        })
    }
}

fn batch(row: Option<BatchRow>) -> Result<Option<BatchRecord>> {
    row.map(BatchRecord::try_from).transpose()
}

/// The result of [`BatchStore::create_batch`].
#[derive(Debug, Clone, PartialEq)]
pub enum BatchCreated {
    New(BatchRecord),
    /// The tenant's key already named this batch; the caller compares
    /// payload hashes.
    Existing(BatchRecord),
    /// The tenant has as many batches with work left as it may.
    TooMany,
}

/// The store's batches (see the module documentation).
#[async_trait]
pub trait BatchStore: Send + Sync + 'static {
    /// Inserts the batch unless the tenant's `idempotency_key` names one
    /// already, which is returned instead (the UNIQUE constraint settles a
    /// race).
    async fn create_batch(&self, b: &BatchRecord, max_active: u32) -> Result<BatchCreated>;

    /// A batch by id; `tenant: Some(t)` restricts to that tenant's.
    async fn batch(&self, tenant: Option<&str>, id: &str) -> Result<Option<BatchRecord>>;

    /// A tenant's batch by its idempotency key.
    async fn batch_by_key(&self, tenant: &str, key: &str) -> Result<Option<BatchRecord>>;

    /// A tenant's batches, newest first, strictly after the batch `after`
    /// (none if that batch is not the tenant's).
    /// A tenant's batches of one face (`messages`: Anthropic's Message
    /// Batches; else OpenAI's), newest first, after the batch `after`.
    async fn list_batches(
        &self,
        tenant: &str,
        messages: bool,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<BatchRecord>>;

    /// Claims the oldest batch that has work left and no live claim: it is
    /// `worker`'s until `claim_until`. Concurrent claimers never get the
    /// same batch.
    async fn claim_batch(
        &self,
        worker: &str,
        now: i64,
        claim_until: i64,
    ) -> Result<Option<BatchRecord>>;

    /// Extends the claim while `worker` still holds it.
    async fn renew_batch(&self, id: &str, worker: &str, claim_until: i64) -> Result<bool>;

    /// Writes the batch's status, counts, errors, files and times, if
    /// `worker` holds its claim and its status is still `from` (a cancel
    /// may have moved it meanwhile). Returns whether it was written.
    async fn set_batch(&self, b: &BatchRecord, worker: &str, from: BatchStatus) -> Result<bool>;

    /// Gives the claim up (the driver is done, or stops).
    async fn release_batch(&self, id: &str, worker: &str) -> Result<()>;

    /// Gives up every batch's claim: at the start of the one process that
    /// uses an SQLite file, a claim can only be a previous run's.
    async fn release_batch_claims(&self) -> Result<u64>;

    /// A tenant's `validating` or `in_progress` batch becomes `cancelling`.
    /// Returns the batch as it is afterwards (None: no such batch).
    async fn cancel_batch(&self, tenant: &str, id: &str, now: i64) -> Result<Option<BatchRecord>>;

    /// Deletes the tenant's batch `id` if it has ended (`completed`,
    /// `failed`, `expired`, `cancelled`): the row as it was, or None (no
    /// such batch, or it has not ended). Its files are the caller's to
    /// delete.
    async fn delete_batch(&self, tenant: &str, id: &str) -> Result<Option<BatchRecord>>;

    /// The newest succeeded line of another batch of the tenant with this
    /// fingerprint, created at `since` or later.
    async fn earlier_answer(
        &self,
        tenant: &str,
        fingerprint: &str,
        batch_id: &str,
        since: i64,
    ) -> Result<Option<JobRecord>>;

    /// Creates a line's job (`queued`) unless its key names one already
    /// (returned), but only while its batch is `in_progress`: after a
    /// cancel commits, no line starts. None: the batch is not in progress.
    /// A `held` line is due only at [`HELD`]: no job worker claims it (its
    /// batch's driver sends it in a provider batch) until
    /// [`BatchStore::release_line`].
    async fn create_line(&self, job: &NewJob, held: bool) -> Result<Option<Created>>;

    /// A held line's job, still `queued`, becomes due at `now`: the job
    /// workers take it as any job. Returns whether it was held.
    async fn release_line(&self, job_id: &str, now: i64) -> Result<bool>;

    /// Creates a line's job already ended as `from` ended (succeeded with
    /// its result, failed or cancelled with its error): a line answered
    /// without a call. A succeeded one gets one attempt, `succeeded`,
    /// that names `from` as what answered it, so that exactly one attempt
    /// completes every succeeded job. An existing job of the key is
    /// returned as it is.
    async fn create_answered(&self, job: &NewJob, from: &JobRecord, now: i64) -> Result<Created>;
}

/// When a held line is due: never, until released.
pub const HELD: i64 = i64::MAX;

/// The columns of a `batches` row, for `concat!`.
macro_rules! columns {
    () => {
        "id, tenant, idempotency_key, payload_hash, endpoint, input_file_id, completion_window,
         metadata, key_id, status, errors, output_file_id, error_file_id, total, completed,
         failed, deduplicated, reused, not_run, created_at, expires_at, in_progress_at, finalizing_at,
         completed_at, failed_at, expired_at, cancelling_at, cancelled_at, claimed_by,
         claim_until, upstream"
    };
}

type Row<D> = <<D as Dialect>::Db as Database>::Row;

#[async_trait]
impl<D> BatchStore for D
where
    D: Dialect,
    for<'c> &'c mut <D::Db as Database>::Connection: Executor<'c, Database = D::Db>,
    <D::Db as Database>::Arguments: IntoArguments<D::Db>,
    for<'q> &'q str: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<&'q str>: Encode<'q, D::Db>,
    for<'q> i64: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<i64>: Encode<'q, D::Db>,
    for<'q> i32: Encode<'q, D::Db> + Type<D::Db>,
    for<'q> Option<i32>: Encode<'q, D::Db>,
    for<'r> BatchRow: FromRow<'r, Row<D>>,
    for<'r> JobRow: FromRow<'r, Row<D>>,
    for<'r> (String,): FromRow<'r, Row<D>>,
    for<'r> (i64,): FromRow<'r, Row<D>>,
    for<'r> (i64, String): FromRow<'r, Row<D>>,
    for<'r> (String, String): FromRow<'r, Row<D>>,
{
    async fn create_batch(&self, b: &BatchRecord, max_active: u32) -> Result<BatchCreated> {
        let mut tx = self.begin_write().await?;
        // The tenant's creations one at a time: none passes the limit
        // while another is between its count and its insert.
        sqlx::query(D::LOCK_NAME)
            .bind(format!("batches:{}", b.tenant).as_str())
            .execute(&mut *tx)
            .await?;
        if let Some(key) = b.idempotency_key.as_deref() {
            let row: Option<BatchRow> = sqlx::query_as(concat!(
                "SELECT ",
                columns!(),
                " FROM batches WHERE tenant = $1 AND idempotency_key = $2"
            ))
            .bind(b.tenant.as_str())
            .bind(key)
            .fetch_optional(&mut *tx)
            .await?;
            if let Some(existing) = batch(row)? {
                return Ok(BatchCreated::Existing(existing));
            }
        }
        let (active,): (i64,) = sqlx::query_as(
            "SELECT COUNT(*) FROM batches
             WHERE tenant = $1
               AND status IN ('validating', 'in_progress', 'finalizing', 'cancelling')",
        )
        .bind(b.tenant.as_str())
        .fetch_one(&mut *tx)
        .await?;
        if active >= i64::from(max_active) {
            return Ok(BatchCreated::TooMany);
        }
        let row: Option<BatchRow> = sqlx::query_as(concat!(
            "INSERT INTO batches (id, tenant, idempotency_key, payload_hash, endpoint,
                                  input_file_id, completion_window, metadata, key_id, status,
                                  total, created_at, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
             RETURNING ",
            columns!()
        ))
        .bind(b.id.as_str())
        .bind(b.tenant.as_str())
        .bind(b.idempotency_key.as_deref())
        .bind(b.payload_hash.as_str())
        .bind(b.endpoint.as_str())
        .bind(b.input_file_id.as_str())
        .bind(b.completion_window.as_str())
        .bind(b.metadata.as_deref())
        .bind(b.key_id.as_deref())
        .bind(b.status.as_str())
        .bind(b.counts.total)
        .bind(b.created_at)
        .bind(b.expires_at)
        .fetch_optional(&mut *tx)
        .await?;
        tx.commit().await?;
        match batch(row)? {
            Some(new) => Ok(BatchCreated::New(new)),
            None => Err(StoreError::Corrupt(format!(
                "batch {} of tenant {:?} was not written",
                b.id, b.tenant
            ))),
        }
    }

    async fn batch(&self, tenant: Option<&str>, id: &str) -> Result<Option<BatchRecord>> {
        let row: Option<BatchRow> = sqlx::query_as(concat!(
            "SELECT ",
            columns!(),
            " FROM batches WHERE id = $1 AND (CAST($2 AS TEXT) IS NULL OR tenant = $2)"
        ))
        .bind(id)
        .bind(tenant)
        .fetch_optional(self.reader())
        .await?;
        batch(row)
    }

    async fn batch_by_key(&self, tenant: &str, key: &str) -> Result<Option<BatchRecord>> {
        let row: Option<BatchRow> = sqlx::query_as(concat!(
            "SELECT ",
            columns!(),
            " FROM batches WHERE tenant = $1 AND idempotency_key = $2"
        ))
        .bind(tenant)
        .bind(key)
        .fetch_optional(self.writer())
        .await?;
        batch(row)
    }

    async fn list_batches(
        &self,
        tenant: &str,
        messages: bool,
        after: Option<&str>,
        limit: u32,
    ) -> Result<Vec<BatchRecord>> {
        // The cursor is the batch `after`'s place: (created_at, id), both
        // compared, so batches made in the same millisecond are neither
        // skipped nor repeated.
        let start: Option<(i64, String)> = match after {
            Some(id) => {
                let at = sqlx::query_as(
                    "SELECT created_at, id FROM batches WHERE id = $1 AND tenant = $2",
                )
                .bind(id)
                .bind(tenant)
                .fetch_optional(self.reader())
                .await?;
                if at.is_none() {
                    return Ok(Vec::new());
                }
                at
            }
            None => None,
        };
        let (at, id) = start.map_or((None, None), |(at, id)| (Some(at), Some(id)));
        let rows: Vec<BatchRow> = sqlx::query_as(concat!(
            "SELECT ",
            columns!(),
            " FROM batches
             WHERE tenant = $1
               AND (CAST($2 AS BIGINT) IS NULL OR (created_at, id) < ($2, $3))
               AND (CASE WHEN endpoint = '/v1/messages' THEN 1 ELSE 0 END) = $5
             ORDER BY created_at DESC, id DESC
             LIMIT $4"
        ))
        .bind(tenant)
        .bind(at)
        .bind(id.as_deref())
        .bind(i64::from(limit))
        .bind(i32::from(messages))
        .fetch_all(self.reader())
        .await?;
        rows.into_iter().map(BatchRecord::try_from).collect()
    }

    async fn claim_batch(
        &self,
        worker: &str,
        now: i64,
        claim_until: i64,
    ) -> Result<Option<BatchRecord>> {
        // A few candidates, then a compare-and-set on each: of two
        // claimers that read the same one, the second's update matches no
        // row (the claim is live by then) and it tries the next.
        let candidates: Vec<(String,)> = sqlx::query_as(
            "SELECT id FROM batches
             WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling')
               AND (claim_until IS NULL OR claim_until < $1)
             ORDER BY created_at, id
             LIMIT 8",
        )
        .bind(now)
        .fetch_all(self.reader())
        .await?;
        for (id,) in candidates {
            let row: Option<BatchRow> = sqlx::query_as(concat!(
                "UPDATE batches SET claimed_by = $2, claim_until = $3
                 WHERE id = $1
                   AND status IN ('validating', 'in_progress', 'finalizing', 'cancelling')
                   AND (claim_until IS NULL OR claim_until < $4)
                 RETURNING ",
                columns!()
            ))
            .bind(id.as_str())
            .bind(worker)
            .bind(claim_until)
            .bind(now)
            .fetch_optional(self.writer())
            .await?;
            if let Some(claimed) = batch(row)? {
                return Ok(Some(claimed));
            }
        }
        Ok(None)
    }

    async fn renew_batch(&self, id: &str, worker: &str, claim_until: i64) -> Result<bool> {
        let done =
            sqlx::query("UPDATE batches SET claim_until = $3 WHERE id = $1 AND claimed_by = $2")
                .bind(id)
                .bind(worker)
                .bind(claim_until)
                .execute(self.writer())
                .await?;
        Ok(D::rows_affected(&done) > 0)
    }

    async fn set_batch(&self, b: &BatchRecord, worker: &str, from: BatchStatus) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE batches
             SET status = $4, errors = $5, output_file_id = $6, error_file_id = $7,
                 total = $8, completed = $9, failed = $10, deduplicated = $11, reused = $12,
                 in_progress_at = $13, finalizing_at = $14, completed_at = $15,
                 failed_at = $16, expired_at = $17, cancelled_at = $18, not_run = $19,
                 upstream = $20
             WHERE id = $1 AND claimed_by = $2 AND status = $3",
        )
        .bind(b.id.as_str())
        .bind(worker)
        .bind(from.as_str())
        .bind(b.status.as_str())
        .bind(b.errors.as_deref())
        .bind(b.output_file_id.as_deref())
        .bind(b.error_file_id.as_deref())
        .bind(b.counts.total)
        .bind(b.counts.completed)
        .bind(b.counts.failed)
        .bind(b.counts.deduplicated)
        .bind(b.counts.reused)
        .bind(b.in_progress_at)
        .bind(b.finalizing_at)
        .bind(b.completed_at)
        .bind(b.failed_at)
        .bind(b.expired_at)
        .bind(b.cancelled_at)
        .bind(b.counts.not_run)
        .bind(b.upstream.as_deref())
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done) > 0)
    }

    async fn release_batch(&self, id: &str, worker: &str) -> Result<()> {
        sqlx::query(
            "UPDATE batches SET claimed_by = NULL, claim_until = NULL
             WHERE id = $1 AND claimed_by = $2",
        )
        .bind(id)
        .bind(worker)
        .execute(self.writer())
        .await?;
        Ok(())
    }

    async fn release_batch_claims(&self) -> Result<u64> {
        let done = sqlx::query(
            "UPDATE batches SET claimed_by = NULL, claim_until = NULL
             WHERE claimed_by IS NOT NULL",
        )
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done))
    }

    async fn cancel_batch(&self, tenant: &str, id: &str, now: i64) -> Result<Option<BatchRecord>> {
        sqlx::query(
            "UPDATE batches SET status = 'cancelling', cancelling_at = $3
             WHERE id = $1 AND tenant = $2 AND status IN ('validating', 'in_progress')",
        )
        .bind(id)
        .bind(tenant)
        .bind(now)
        .execute(self.writer())
        .await?;
        let row: Option<BatchRow> = sqlx::query_as(concat!(
            "SELECT ",
            columns!(),
            " FROM batches WHERE id = $1 AND tenant = $2"
        ))
        .bind(id)
        .bind(tenant)
        .fetch_optional(self.writer())
        .await?;
        batch(row)
    }

    async fn delete_batch(&self, tenant: &str, id: &str) -> Result<Option<BatchRecord>> {
        let row: Option<BatchRow> = sqlx::query_as(concat!(
            "DELETE FROM batches
             WHERE id = $1 AND tenant = $2
               AND status IN ('completed', 'failed', 'expired', 'cancelled')
             RETURNING ",
            columns!()
        ))
        .bind(id)
        .bind(tenant)
        .fetch_optional(self.writer())
        .await?;
        batch(row)
    }

    async fn earlier_answer(
        &self,
        tenant: &str,
        fingerprint: &str,
        batch_id: &str,
        since: i64,
    ) -> Result<Option<JobRecord>> {
        let row: Option<JobRow> = sqlx::query_as(
            "SELECT * FROM jobs
             WHERE tenant = $1 AND fingerprint = $2 AND batch_id IS NOT NULL
               AND batch_id <> $3 AND created_at >= $4 AND state = 'succeeded'
             ORDER BY created_at DESC
             LIMIT 1",
        )
        .bind(tenant)
        .bind(fingerprint)
        .bind(batch_id)
        .bind(since)
        .fetch_optional(self.reader())
        .await?;
        rows::job(row)
    }

    async fn create_line(&self, job: &NewJob, held: bool) -> Result<Option<Created>> {
        let row: Option<JobRow> = sqlx::query_as(
            "INSERT INTO jobs (id, tenant, idempotency_key, payload_hash, fingerprint, route, request,
                               metadata, state, version, not_before, created_at, updated_at, dialect,
                               forwarded, key_id, batch_id)
             SELECT $1, $2, $3, $4, $5, $6, $7, $8, 'queued', 0, $14, $9, $9, $10, $11, $12, $13
             WHERE EXISTS (SELECT 1 FROM batches WHERE id = $13 AND status = 'in_progress')
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
        .bind(if held { HELD } else { job.created_at })
        .fetch_optional(self.writer())
        .await?;
        if let Some(new) = rows::job(row)? {
            return Ok(Some(Created::New(new)));
        }
        let existing: Option<JobRow> =
            sqlx::query_as("SELECT * FROM jobs WHERE tenant = $1 AND idempotency_key = $2")
                .bind(job.tenant.as_str())
                .bind(job.idempotency_key.as_str())
                .fetch_optional(self.writer())
                .await?;
        Ok(rows::job(existing)?.map(Created::Existing))
    }

    async fn release_line(&self, job_id: &str, now: i64) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE jobs SET not_before = $2, updated_at = $2
             WHERE id = $1 AND state = 'queued' AND not_before = $3",
        )
        .bind(job_id)
        .bind(now)
        .bind(HELD)
        .execute(self.writer())
        .await?;
        Ok(D::rows_affected(&done) > 0)
    }

    async fn create_answered(&self, job: &NewJob, from: &JobRecord, now: i64) -> Result<Created> {
        let succeeded = from.state == super::JobState::Succeeded;
        let mut tx = self.begin_write().await?;
        let row: Option<JobRow> = sqlx::query_as(
            "INSERT INTO jobs (id, tenant, idempotency_key, payload_hash, fingerprint, route, request,
                               metadata, state, version, completed_by, result, error, not_before,
                               created_at, updated_at, dialect, forwarded, key_id, batch_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 1, $10, $11, $12, $13, $13, $13, $14,
                     $15, $16, $17)
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
        .bind(from.state.as_str())
        .bind(succeeded.then_some(1i32))
        .bind(from.result.as_deref())
        .bind(from.error.as_deref())
        .bind(now)
        .bind(job.dialect.as_str())
        .bind(job.forwarded.as_deref())
        .bind(job.key_id.as_deref())
        .bind(job.batch_id.as_deref())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(new) = rows::job(row)? else {
            tx.rollback().await?;
            let existing: Option<JobRow> =
                sqlx::query_as("SELECT * FROM jobs WHERE tenant = $1 AND idempotency_key = $2")
                    .bind(job.tenant.as_str())
                    .bind(job.idempotency_key.as_str())
                    .fetch_optional(self.writer())
                    .await?;
            return match rows::job(existing)? {
                Some(existing) => Ok(Created::Existing(existing)),
                None => Err(StoreError::Corrupt(format!(
                    "job key {:?} of tenant {:?} conflicts but cannot be read",
                    job.idempotency_key, job.tenant
                ))),
            };
        };
        if succeeded {
            // The attempt names the target of the attempt that answered
            // `from`, and `from` itself.
            let target: Option<(String, String)> = match from.completed_by {
                Some(n) => {
                    sqlx::query_as(
                        "SELECT provider, model FROM attempts WHERE job_id = $1 AND n = $2",
                    )
                    .bind(from.id.as_str())
                    .bind(n)
                    .fetch_optional(&mut *tx)
                    .await?
                }
                None => None,
            };
            let (provider, model) = target.unwrap_or_default();
            sqlx::query(
                "INSERT INTO attempts (job_id, n, provider, model, state, reason, hedge,
                                       read_version, owner, started_at, finished_at)
                 VALUES ($1, 1, $2, $3, 'succeeded', $4, FALSE, 0, NULL, $5, $5)",
            )
            .bind(new.id.as_str())
            .bind(provider.as_str())
            .bind(model.as_str())
            .bind(format!("answered by job {}", from.id).as_str())
            .bind(now)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(Created::New(new))
    }
}
