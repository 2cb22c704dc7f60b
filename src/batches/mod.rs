//! Batches: OpenAI's Batch API on idem's jobs (docs/design.md, "Batches").
//!
//! A batch is a tenant's input file run line by line, each line a job of
//! its own keyed by the batch and the line's `custom_id`, so a line never
//! runs twice and a batch driven again after a crash resumes from the jobs
//! already made. Identical lines share one call: the first of them runs,
//! the others are created already answered by it, and a line identical to
//! one of an earlier batch of the tenant (within the route's
//! `batch.reuse`) is answered by that one. The [`driver`] does the work;
//! this file is what the API calls: create, cancel, and the batch's wire
//! object. Nothing here knows HTTP.

pub mod driver;
pub mod lines;
mod output;

use std::num::NonZeroU32;
use std::sync::Arc;

use dashmap::DashMap;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde_json::{Map, Value, json};
use tokio::sync::Notify;

use crate::config::BatchesConfig;
use crate::dialect::Dialect;
use crate::fingerprint::{self, Fingerprint};
use crate::routes::Route;
use crate::store::{
    BatchCounts, BatchCreated, BatchRecord, BatchStatus, Store, StoreError, now_ms,
};

/// The only completion window OpenAI offers.
pub const COMPLETION_WINDOW: &str = "24h";
const WINDOW_MS: i64 = 24 * 3600 * 1000;

/// The most metadata pairs, and the longest key and value (OpenAI's).
const METADATA_PAIRS: usize = 16;
const METADATA_KEY: usize = 64;
const METADATA_VALUE: usize = 512;

/// Why a batch could not be created or changed. The HTTP layer renders
/// these.
#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("this Idempotency-Key was already used with a different batch")]
    KeyReused,
    #[error("batch not found")]
    NotFound,
    #[error("{message}")]
    Invalid {
        message: String,
        param: &'static str,
    },
    #[error("the tenant has {limit} batches in progress, the most batches.max_active allows")]
    TooMany { limit: u32 },
    #[error("a batch that is {status} cannot be cancelled")]
    NotCancellable { status: &'static str },
    #[error("batch {id} has not ended ({status}): cancel it and wait for it to end first")]
    NotDeletable { id: String, status: &'static str },
    #[error(transparent)]
    Store(#[from] StoreError),
}

fn invalid(param: &'static str, message: impl Into<String>) -> BatchError {
    BatchError::Invalid {
        message: message.into(),
        param,
    }
}

/// The endpoint of an Anthropic Message Batch's requests.
pub const MESSAGES_ENDPOINT: &str = "/v1/messages";

/// The purpose of the file that holds a Message Batch's requests (made by
/// idem, one line per request, as an OpenAI batch's input).
pub const MESSAGE_BATCH_PURPOSE: &str = "message_batch";

/// The dialect of a batch's endpoint, if batches serve it.
pub fn endpoint_dialect(endpoint: &str) -> Option<Dialect> {
    match endpoint {
        "/v1/chat/completions" => Some(Dialect::Chat),
        "/v1/responses" => Some(Dialect::Responses),
        "/v1/embeddings" => Some(Dialect::Embeddings),
        MESSAGES_ENDPOINT => Some(Dialect::Messages),
        _ => None,
    }
}

/// The idempotency key of a batch line's job.
pub fn line_key(batch_id: &str, custom_id: &str) -> String {
    format!("{batch_id}/{custom_id}")
}

/// A line, checked and routed as its endpoint's face would: what its job
/// runs.
pub struct Planned {
    pub route: Arc<Route>,
    pub fp: Fingerprint,
    pub request: Map<String, Value>,
}

/// Why a line is not run: an error of the line's own (in the error file,
/// as the endpoint would have answered it), or one that fails the whole
/// batch in validation (a model no route serves).
#[derive(Debug, Clone)]
pub struct LineRefusal {
    pub status: u16,
    pub code: String,
    pub message: String,
    pub param: Option<String>,
    pub fails_batch: bool,
}

/// What the drivers use of the gateway: the job system's handles, and
/// the faces' checks (which live in the HTTP layer).
pub trait BatchEnv: crate::jobs::JobEnv {
    fn batches(&self) -> &Arc<Batches>;
    /// A line's body checked and routed as its endpoint's face would
    /// check and route it, for `tenant`.
    fn plan_line(
        &self,
        tenant: &str,
        dialect: Dialect,
        body: Map<String, Value>,
    ) -> Result<Planned, LineRefusal>;
    /// Whether the store's key `key_id` may use the route `route`.
    fn key_allows(&self, key_id: &str, route: &str) -> bool;
}

/// What `POST /v1/batches` asks for.
pub struct NewBatch {
    pub input_file_id: String,
    pub endpoint: String,
    pub completion_window: String,
    pub metadata: Option<Map<String, Value>>,
    /// What a batch created again with the same key must match, when not
    /// these fields: a Message Batch's requests (its input file is made
    /// anew for each creation).
    pub hash: Option<String>,
    /// The lines, when known before validation (a Message Batch's).
    pub total: i64,
}

/// The batches of one gateway: the store, the wake-up of this replica's
/// drivers, and the rate of lines each route's batches start here.
pub struct Batches {
    pub store: Arc<dyn Store>,
    /// Identifies this replica's drivers in claims.
    pub worker_id: String,
    wake: Notify,
    /// Per route with a `batch.rate`: that rate and its limiter, shared by
    /// the route's batches on this replica (made again when the rate
    /// changes).
    rates: DashMap<Arc<str>, (u32, Arc<DefaultDirectRateLimiter>)>,
}

impl Batches {
    pub fn new(store: Arc<dyn Store>) -> Batches {
        Batches {
            store,
            worker_id: format!("idem-batches-{}", uuid::Uuid::now_v7().simple()),
            wake: Notify::new(),
            rates: DashMap::new(),
        }
    }

    /// Waits until a batch may start one more line on `route` (its
    /// `batch.rate`, on this replica).
    pub(crate) async fn pace(&self, route: &Route) {
        let Some(rate) = route.config.batch.rate.and_then(NonZeroU32::new) else {
            return;
        };
        let limiter = {
            let mut entry = self.rates.entry(route.name.clone()).or_insert_with(|| {
                (
                    rate.get(),
                    Arc::new(RateLimiter::direct(Quota::per_second(rate))),
                )
            });
            if entry.0 != rate.get() {
                *entry = (
                    rate.get(),
                    Arc::new(RateLimiter::direct(Quota::per_second(rate))),
                );
            }
            entry.1.clone()
        };
        limiter.until_ready().await;
    }

    /// Deletes the tenant's ended batch `id` with its files (the input
    /// too when the batch made it: a Message Batch's). Its lines' jobs
    /// stay, as jobs do, until the reconciler's purge.
    pub async fn delete(&self, tenant: &str, id: &str) -> Result<BatchRecord, BatchError> {
        let Some(b) = self.store.delete_batch(tenant, id).await? else {
            return match self.store.batch(Some(tenant), id).await? {
                Some(b) => Err(BatchError::NotDeletable {
                    id: b.id,
                    status: b.status.as_str(),
                }),
                None => Err(BatchError::NotFound),
            };
        };
        let made = (b.endpoint == MESSAGES_ENDPOINT).then_some(&b.input_file_id);
        for file in made
            .into_iter()
            .chain(b.output_file_id.as_ref())
            .chain(b.error_file_id.as_ref())
        {
            // A file left behind expires with its retention.
            if let Err(e) = self.store.delete_file(tenant, file).await {
                tracing::warn!(batch = %b.id, file = %file, error = %e, "cannot delete a deleted batch's file");
            }
        }
        Ok(b)
    }

    /// A driver of this replica looks for work now.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Creates the batch, or returns the one the tenant's `key` names (409
    /// if that one was made from another request). The second value is
    /// false for an existing batch.
    pub async fn create(
        &self,
        tenant: &str,
        key_id: Option<&str>,
        new: NewBatch,
        key: Option<String>,
        cfg: &BatchesConfig,
    ) -> Result<(BatchRecord, bool), BatchError> {
        // The Messages face makes its own input file; the OpenAI face's
        // endpoints are chat and Responses.
        let messages = new.hash.is_some();
        if messages != (new.endpoint == MESSAGES_ENDPOINT)
            || endpoint_dialect(&new.endpoint).is_none()
        {
            return Err(invalid(
                "endpoint",
                format!(
                    "endpoint {:?} is not supported: batches run /v1/chat/completions, \
                     /v1/responses or /v1/embeddings",
                    new.endpoint
                ),
            ));
        }
        if new.completion_window != COMPLETION_WINDOW {
            return Err(invalid(
                "completion_window",
                format!(
                    "completion_window must be \"{COMPLETION_WINDOW}\", not {:?}",
                    new.completion_window
                ),
            ));
        }
        if let Some(m) = &new.metadata {
            check_metadata(m)?;
        }
        let hash = new.hash.clone().unwrap_or_else(|| payload_hash(&new));
        if let Some(key) = &key
            && let Some(existing) = self.existing(tenant, key).await?
        {
            return same(existing, &hash);
        }
        let Some(file) = self.store.file(tenant, &new.input_file_id).await? else {
            return Err(invalid(
                "input_file_id",
                format!("no file with id {:?}", new.input_file_id),
            ));
        };
        let purpose = if messages {
            MESSAGE_BATCH_PURPOSE
        } else {
            "batch"
        };
        if file.purpose != purpose {
            return Err(invalid(
                "input_file_id",
                format!(
                    "file {} has purpose {:?}; a batch's input needs purpose {purpose:?}",
                    file.id, file.purpose
                ),
            ));
        }
        let now = now_ms();
        let record = BatchRecord {
            id: format!(
                "{}_{}",
                if messages { "msgbatch" } else { "batch" },
                uuid::Uuid::now_v7().simple()
            ),
            tenant: tenant.to_string(),
            idempotency_key: key,
            payload_hash: hash.clone(),
            endpoint: new.endpoint,
            input_file_id: new.input_file_id,
            completion_window: new.completion_window,
            metadata: new.metadata.map(|m| Value::Object(m).to_string()),
            key_id: key_id.map(str::to_string),
            status: BatchStatus::Validating,
            errors: None,
            output_file_id: None,
            error_file_id: None,
            counts: BatchCounts {
                total: new.total,
                ..BatchCounts::default()
            },
            created_at: now,
            expires_at: now + WINDOW_MS,
            in_progress_at: None,
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            expired_at: None,
            cancelling_at: None,
            cancelled_at: None,
            claimed_by: None,
            claim_until: None,
            upstream: None,
        };
        // The limit is counted in the statement's transaction, the
        // tenant's creations one at a time: two at once never both pass it.
        match self.store.create_batch(&record, cfg.max_active).await? {
            BatchCreated::New(b) => {
                self.wake();
                Ok((b, true))
            }
            BatchCreated::Existing(b) => same(b, &hash),
            BatchCreated::TooMany => Err(BatchError::TooMany {
                limit: cfg.max_active,
            }),
        }
    }

    /// The tenant's batch of `key`, read before anything else so that a
    /// replay is answered even after its input file was deleted.
    pub async fn existing(
        &self,
        tenant: &str,
        key: &str,
    ) -> Result<Option<BatchRecord>, BatchError> {
        Ok(self.store.batch_by_key(tenant, key).await?)
    }

    /// `POST /v1/batches/{id}/cancel`: a batch validating or in progress
    /// becomes `cancelling` (its driver cancels it); one already cancelling
    /// or cancelled is returned as it is.
    pub async fn cancel(&self, tenant: &str, id: &str) -> Result<BatchRecord, BatchError> {
        let b = self
            .store
            .cancel_batch(tenant, id, now_ms())
            .await?
            .ok_or(BatchError::NotFound)?;
        match b.status {
            BatchStatus::Cancelling | BatchStatus::Cancelled => {
                self.wake();
                Ok(b)
            }
            other => Err(BatchError::NotCancellable {
                status: other.as_str(),
            }),
        }
    }
}

/// An existing batch for a repeated key: the same request, or 409.
fn same(b: BatchRecord, hash: &str) -> Result<(BatchRecord, bool), BatchError> {
    if b.payload_hash == hash {
        Ok((b, false))
    } else {
        Err(BatchError::KeyReused)
    }
}

fn check_metadata(m: &Map<String, Value>) -> Result<(), BatchError> {
    if m.len() > METADATA_PAIRS {
        return Err(invalid(
            "metadata",
            format!("metadata has {} pairs; at most {METADATA_PAIRS}", m.len()),
        ));
    }
    for (k, v) in m {
        if k.chars().count() > METADATA_KEY {
            return Err(invalid(
                "metadata",
                format!("metadata key {k:?} is longer than {METADATA_KEY} characters"),
            ));
        }
        match v {
            Value::String(s) if s.chars().count() <= METADATA_VALUE => {}
            Value::String(_) => {
                return Err(invalid(
                    "metadata",
                    format!("metadata[{k:?}] is longer than {METADATA_VALUE} characters"),
                ));
            }
            _ => {
                return Err(invalid(
                    "metadata",
                    format!("metadata[{k:?}] must be a string"),
                ));
            }
        }
    }
    Ok(())
}

/// What a batch created again with the same key must match.
fn payload_hash(new: &NewBatch) -> String {
    let mut hasher = blake3::Hasher::new();
    let what = json!({
        "input_file_id": new.input_file_id,
        "endpoint": new.endpoint,
        "completion_window": new.completion_window,
        "metadata": new.metadata,
    });
    // Writing into a hasher cannot fail.
    let _ = fingerprint::write_canonical(&what, &mut hasher);
    format!("b1:{}", hasher.finalize().to_hex())
}

fn secs(ms: Option<i64>) -> Value {
    ms.map_or(Value::Null, |ms| Value::from(ms / 1000))
}

/// A batch as the API shows it: OpenAI's batch object, plus `idem`, the
/// lines answered without a call of their own.
pub fn batch_json(b: &BatchRecord) -> Value {
    let errors = b
        .errors
        .as_deref()
        .and_then(|e| serde_json::from_str::<Value>(e).ok())
        .map(|data| json!({"object": "list", "data": data}));
    let metadata = b
        .metadata
        .as_deref()
        .and_then(|m| serde_json::from_str::<Value>(m).ok());
    json!({
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": b.status.as_str(),
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": b.created_at / 1000,
        "in_progress_at": secs(b.in_progress_at),
        "expires_at": b.expires_at / 1000,
        "finalizing_at": secs(b.finalizing_at),
        "completed_at": secs(b.completed_at),
        "failed_at": secs(b.failed_at),
        "expired_at": secs(b.expired_at),
        "cancelling_at": secs(b.cancelling_at),
        "cancelled_at": secs(b.cancelled_at),
        "request_counts": {
            "total": b.counts.total,
            "completed": b.counts.completed,
            "failed": b.counts.failed,
        },
        "metadata": metadata,
        "idem": {
            "answered_without_call": b.counts.deduplicated + b.counts.reused,
            "deduplicated": b.counts.deduplicated,
            "reused": b.counts.reused,
            "provider_batches": driver::provider_batches(b),
        },
    })
}
