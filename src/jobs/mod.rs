//! Jobs: one job per user intent (SPEC section 5).
//!
//! A job-creating request carries an `Idempotency-Key`; the database's
//! UNIQUE `(tenant, idempotency_key)` decides which request created the job,
//! and every other request with that key gets the same job back (or 409 if
//! its payload differs). Retries, failovers and hedges are attempts under the
//! job, run by the [`executor`]; the [`reconciler`] turns attempts whose
//! replica died into `unknown`. This file is the part the request path
//! calls: create and wait. Nothing here knows HTTP: the faces render a job
//! and map [`JobError`] to their wire format.

pub mod executor;
pub mod reconciler;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use serde_json::{Map, Value, json};
use tokio::sync::{Notify, watch};

use crate::answer::{Answer, Form};
use crate::config::Config;
use crate::fingerprint::{self, Fingerprint, Rules};
use crate::metrics::Metrics;
use crate::routes::{Route, Routes};
use crate::store::{
    AttemptRecord, Created, JobRecord, JobState, NewJob, Store, StoreError, now_ms, rfc3339,
};

/// Why the job subsystem could not do what was asked. The HTTP layer
/// turns these into error bodies, in one place.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("this Idempotency-Key was already used with a different request")]
    KeyReused,
    #[error("job not found")]
    NotFound,
    /// The job was not done by the caller's deadline.
    #[error("the job is still in progress")]
    InProgress { job_id: String },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// What the executor and the reconciler use of the gateway: its handles,
/// not its HTTP layer (which implements this for its shared state).
pub trait JobEnv: Send + Sync + 'static {
    fn config(&self) -> &Arc<Config>;
    fn jobs(&self) -> &Arc<Jobs>;
    fn store(&self) -> &Arc<dyn Store>;
    fn metrics(&self) -> &Arc<Metrics>;
    fn routes(&self) -> &Routes;
    fn core(&self) -> &crate::task::Core;
}

/// A shared handle on the gateway for the job workers.
pub type Env = Arc<dyn JobEnv>;

/// The payload hash: the fingerprint rules without text normalization
/// (SPEC section 5), plus the job's metadata. Two requests are the same
/// intent only if this matches.
pub fn payload_hash(
    tenant: &str,
    route: &Route,
    request: &Map<String, Value>,
    metadata: Option<&Value>,
) -> String {
    // Without text normalization: "Refund order 45" and "refund order 45"
    // may share an answer, never a job.
    let rules = Rules {
        normalize: crate::config::Normalize::None,
        ..route.rules(tenant)
    };
    let fp = fingerprint::fingerprint(request, None, &rules);
    let mut hasher = blake3::Hasher::new();
    hasher.update(fp.as_bytes());
    if let Some(m) = metadata {
        // Writing into a hasher cannot fail.
        let _ = fingerprint::write_canonical(m, &mut hasher);
    }
    format!("p1:{}", hasher.finalize().to_hex())
}

/// What a job-creating request got.
pub struct CreatedJob {
    pub job: JobRecord,
    /// False when the key already named this job.
    pub new: bool,
}

/// The job subsystem of one gateway.
pub struct Jobs {
    pub store: Arc<dyn Store>,
    /// Identifies this replica's workers in claims and attempt owners.
    pub worker_id: String,
    wake: Notify,
    changed: DashMap<String, watch::Sender<u64>>,
}

impl Jobs {
    pub fn new(store: Arc<dyn Store>) -> Jobs {
        Jobs {
            store,
            worker_id: format!("idem-{}", uuid::Uuid::now_v7().simple()),
            wake: Notify::new(),
            changed: DashMap::new(),
        }
    }

    /// Creates the job for `(tenant, key)` or returns the existing one; 409
    /// if the key names a job with another payload.
    pub async fn create(
        &self,
        tenant: &str,
        route: &Route,
        request: &Map<String, Value>,
        fp: &Fingerprint,
        metadata: Option<&Value>,
        key: &str,
    ) -> Result<CreatedJob, JobError> {
        let hash = payload_hash(tenant, route, request, metadata);
        let new = NewJob {
            id: uuid::Uuid::now_v7().to_string(),
            tenant: tenant.to_string(),
            idempotency_key: key.to_string(),
            payload_hash: hash.clone(),
            fingerprint: fp.to_string(),
            route: route.name.to_string(),
            request: serde_json::to_string(request).unwrap_or_default(),
            metadata: metadata.map(Value::to_string),
            created_at: now_ms(),
        };
        match self.store.create_job(&new).await? {
            Created::New(job) => {
                self.wake.notify_one();
                Ok(CreatedJob { job, new: true })
            }
            Created::Existing(job) if job.payload_hash == hash => {
                Ok(CreatedJob { job, new: false })
            }
            Created::Existing(_) => Err(JobError::KeyReused),
        }
    }

    /// Wakes one idle worker (new or requeued work on this replica).
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    pub(crate) async fn woken(&self) {
        self.wake.notified().await;
    }

    /// Tells local waiters that a job changed.
    pub fn changed(&self, job_id: &str) {
        if let Some(tx) = self.changed.get(job_id) {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// Waits until the job is succeeded, failed or cancelled, or `deadline`.
    /// Jobs run on this replica wake the waiter at once; a job running on
    /// another replica is seen by a slow poll of the store.
    pub async fn wait(
        &self,
        tenant: &str,
        id: &str,
        deadline: Instant,
    ) -> Result<JobRecord, JobError> {
        let mut rx = self
            .changed
            .entry(id.to_string())
            .or_insert_with(|| watch::Sender::new(0))
            .subscribe();
        let result = loop {
            let job = self
                .store
                .job(Some(tenant), id)
                .await?
                .ok_or(JobError::NotFound)?;
            if matches!(
                job.state,
                JobState::Succeeded | JobState::Failed | JobState::Cancelled
            ) {
                break Ok(job);
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(JobError::InProgress {
                    job_id: id.to_string(),
                });
            }
            let nap = (deadline - now).min(Duration::from_millis(250));
            let _ = tokio::time::timeout(nap, rx.changed()).await;
        };
        drop(rx);
        self.changed.remove_if(id, |_, tx| tx.receiver_count() == 0);
        result
    }
}

/// A succeeded job's stored result as an [`Answer`] (for rendering).
pub fn job_answer(job: &JobRecord, route: &Route) -> Answer {
    Answer {
        status: reqwest::StatusCode::OK,
        form: Form::Plain,
        body: bytes::Bytes::from(job.result.clone().unwrap_or_default()),
        retry_after: None,
        failure: None,
        provider: "job".into(),
        model: route.name.clone(),
        created_at: std::time::SystemTime::now(),
        upstream_latency: Duration::ZERO,
        cache_ttl: None,
        rendered: Default::default(),
    }
}

/// A job as the API shows it (SPEC section 5: the field names are part of
/// the contract).
pub fn job_json(job: &JobRecord, attempts: Option<&[AttemptRecord]>) -> Value {
    let parse = |t: &Option<String>| {
        t.as_deref()
            .and_then(|s| serde_json::from_str::<Value>(s).ok())
    };
    let mut v = json!({
        "id": job.id,
        "object": "job",
        "state": job.state.as_str(),
        "version": job.version,
        "idempotency_key": job.idempotency_key,
        "route": job.route,
        "fingerprint": job.fingerprint,
        "created_at": rfc3339(job.created_at),
        "updated_at": rfc3339(job.updated_at),
        "completed_by": job.completed_by,
        "result": parse(&job.result),
        "error": job.error,
        "metadata": parse(&job.metadata),
    });
    if let (Some(attempts), Some(obj)) = (attempts, v.as_object_mut()) {
        let list: Vec<Value> = attempts.iter().map(attempt_json).collect();
        obj.insert("attempts".into(), Value::Array(list));
    }
    v
}

pub fn attempt_json(a: &AttemptRecord) -> Value {
    json!({
        "n": a.n,
        "provider": a.provider,
        "model": a.model,
        "state": a.state.as_str(),
        "reason": a.reason,
        "hedge": a.hedge,
        "started_at": rfc3339(a.started_at),
        "finished_at": a.finished_at.map(rfc3339),
    })
}
