//! Jobs: one job per user intent (docs/design.md, "Jobs and attempts").
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
mod items;
pub mod reconciler;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use serde_json::{Map, Value, json};
use tokio::sync::{Notify, watch};

use crate::answer::{Answer, Form};
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::{self, Fingerprint, Rules};
use crate::live::Live;
use crate::metrics::Metrics;
use crate::routes::Route;
use crate::store::{
    AttemptRecord, AttemptState, Completion, Created, JobRecord, JobState, NewJob, Store,
    StoreError, now_ms, rfc3339,
};

/// Why the job subsystem could not do what was asked. The HTTP layer
/// turns these into error bodies, in one place.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("this Idempotency-Key was already used with a different request")]
    KeyReused,
    #[error("job not found")]
    NotFound,
    #[error("attempt not found")]
    AttemptNotFound,
    /// The job was not done by the caller's deadline.
    #[error("the job is still in progress")]
    InProgress { job_id: String },
    /// The job is succeeded, failed or cancelled: it takes no more attempts.
    #[error("the job is {state}; it takes no more attempts")]
    Closed { state: &'static str },
    /// The job already succeeded.
    #[error("the job already succeeded")]
    Succeeded,
    /// An attempt is `starting`, `running` or `unknown` (or the job is
    /// queued or running): no new attempt until it is resolved.
    #[error("an attempt of this job is starting, running or unknown; resolve it first")]
    AttemptInProgress,
    /// Only an `unknown` attempt is resolved out of band.
    #[error("attempt {n} is {state}, not unknown")]
    NotUnknown { n: i32, state: &'static str },
    /// The attempt changed while it was being resolved.
    #[error("attempt {n} changed meanwhile")]
    AttemptChanged { n: i32 },
    /// A resolution as succeeded lost the compare-and-swap.
    #[error("the job was completed or changed by something else; the result was discarded")]
    Lost,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How an operator settles an `unknown` attempt out of band.
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    /// The provider did not do the work: the job fails (a manual retry may
    /// reopen it).
    Failed,
    /// The work is not wanted, done or not: the job is cancelled.
    Cancelled,
    /// The provider did the work; this is its result, which completes the
    /// job by compare-and-swap like any attempt's.
    Succeeded(Value),
}

impl Resolution {
    pub fn as_str(&self) -> &'static str {
        match self {
            Resolution::Failed => "failed",
            Resolution::Cancelled => "cancelled",
            Resolution::Succeeded(_) => "succeeded",
        }
    }
}

/// What the executor and the reconciler use of the gateway: its handles,
/// not its HTTP layer (which implements this for its shared state).
pub trait JobEnv: Send + Sync + 'static {
    /// The configuration in force; a job's run takes it once and keeps it.
    fn live(&self) -> Arc<Live>;
    fn jobs(&self) -> &Arc<Jobs>;
    fn store(&self) -> &Arc<dyn Store>;
    fn metrics(&self) -> &Arc<Metrics>;
    fn core(&self) -> &crate::task::Core;
    /// Who pays for the calls of a job of `tenant` created with the
    /// store's key `key_id` (none: nobody counts them).
    fn payer(&self, tenant: &str, key_id: Option<&str>) -> Option<crate::budgets::Payer>;
}

/// A shared handle on the gateway for the job workers.
pub type Env = Arc<dyn JobEnv>;

/// What a job-creating request wants done: the request as its client sent
/// it (what the payload hash reads), the request its attempts send (the
/// same, or a Responses request with its conversation spelled out), its
/// dialect and answer-changing headers, its fingerprint, and the job's
/// metadata.
#[derive(Clone, Copy)]
pub struct Intent<'a> {
    pub asked: &'a Map<String, Value>,
    pub request: &'a Map<String, Value>,
    pub dialect: Dialect,
    pub forwarded: &'a Forwarded,
    pub fp: &'a Fingerprint,
    pub metadata: Option<&'a Value>,
    /// The store's key the request came with (its budget pays the job's
    /// calls); not part of the intent's identity.
    pub key_id: Option<&'a str>,
}

/// The payload hash: the fingerprint rules without text normalization
/// (docs/design.md, "Jobs and attempts"), with the request's dialect and
/// answer-changing headers, plus the job's metadata. Two requests are the
/// same intent only if this matches.
pub fn payload_hash(tenant: &str, route: &Route, intent: &Intent) -> String {
    // Without text normalization: "Refund order 45" and "refund order 45"
    // may share an answer, never a job.
    let rules = Rules {
        normalize: crate::config::Normalize::None,
        dialect: intent.dialect,
        headers: intent.forwarded,
        ..route.rules(tenant)
    };
    let fp = fingerprint::fingerprint(intent.asked, None, &rules);
    let mut hasher = blake3::Hasher::new();
    hasher.update(fp.as_bytes());
    if let Some(m) = intent.metadata {
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
        intent: Intent<'_>,
        key: &str,
    ) -> Result<CreatedJob, JobError> {
        let hash = payload_hash(tenant, route, &intent);
        let Intent {
            request,
            dialect,
            forwarded,
            fp,
            metadata,
            key_id,
            ..
        } = intent;
        let new = NewJob {
            id: uuid::Uuid::now_v7().to_string(),
            tenant: tenant.to_string(),
            idempotency_key: key.to_string(),
            payload_hash: hash.clone(),
            fingerprint: fp.to_string(),
            route: route.model.to_string(),
            request: serde_json::to_string(request).unwrap_or_default(),
            dialect: dialect.as_str().to_string(),
            forwarded: (!forwarded.is_empty())
                .then(|| Value::Object(forwarded.to_json()).to_string()),
            metadata: metadata.map(Value::to_string),
            key_id: key_id.map(str::to_string),
            batch_id: None,
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

    /// A manual retry (docs/design.md, "Jobs and attempts"): a failed job goes
    /// back to the queue with one more attempt in its budget. Refused while
    /// the job is queued or running or any attempt is `starting`, `running`
    /// or `unknown`; the store's guard settles a race.
    pub async fn retry(&self, tenant: &str, id: &str) -> Result<JobRecord, JobError> {
        let job = self.load(Some(tenant), id).await?;
        if job.state.is_final() {
            return Err(JobError::Closed {
                state: job.state.as_str(),
            });
        }
        let attempts = self.store.attempts(&job.id).await?;
        if attempts.iter().any(|a| a.state.is_active())
            || matches!(job.state, JobState::Queued | JobState::Running)
        {
            return Err(JobError::AttemptInProgress);
        }
        // failed -> queued, atomically guarded in the store.
        if !self
            .store
            .requeue(&job.id, None, now_ms(), true, now_ms())
            .await?
        {
            return Err(JobError::AttemptInProgress);
        }
        self.wake();
        self.load(Some(tenant), id).await
    }

    /// Settles an `unknown` attempt out of band (an operator's decision):
    /// as failed it fails the job, as cancelled it cancels it, as succeeded
    /// its result completes the job by compare-and-swap.
    pub async fn resolve(
        &self,
        id: &str,
        n: i32,
        resolution: Resolution,
    ) -> Result<JobRecord, JobError> {
        let job = self.load(None, id).await?;
        let attempt = self
            .store
            .attempts(id)
            .await?
            .into_iter()
            .find(|a| a.n == n)
            .ok_or(JobError::AttemptNotFound)?;
        if attempt.state != AttemptState::Unknown {
            return Err(JobError::NotUnknown {
                n,
                state: attempt.state.as_str(),
            });
        }
        let now = now_ms();
        match &resolution {
            Resolution::Failed | Resolution::Cancelled => {
                let to = if resolution == Resolution::Failed {
                    AttemptState::Failed
                } else {
                    AttemptState::Cancelled
                };
                if !self
                    .store
                    .finish_attempt(id, n, to, Some("resolved"), now)
                    .await?
                {
                    return Err(JobError::AttemptChanged { n });
                }
                // The attempt's outcome is the job's.
                if to == AttemptState::Cancelled {
                    self.store.cancel_job(&job.tenant, id, now).await?;
                } else {
                    let why = format!("attempt {n} was unknown and resolved as failed");
                    self.store.fail_job(id, &why, now).await?;
                }
            }
            Resolution::Succeeded(result) => {
                match self
                    .store
                    .complete(id, n, attempt.read_version, &result.to_string(), now)
                    .await?
                {
                    Completion::Won(_) => {}
                    Completion::Lost => return Err(JobError::Lost),
                }
            }
        }
        tracing::warn!(job = %id, attempt = n, outcome = resolution.as_str(), route = %job.route, "attempt resolved out of band");
        self.changed(id);
        self.load(None, id).await
    }

    /// Cancels a job that has not completed (a succeeded one stays so).
    pub async fn cancel(&self, tenant: &str, id: &str) -> Result<JobRecord, JobError> {
        let job = self
            .store
            .cancel_job(tenant, id, now_ms())
            .await?
            .ok_or(JobError::NotFound)?;
        if job.state == JobState::Succeeded {
            return Err(JobError::Succeeded);
        }
        self.changed(id);
        Ok(job)
    }

    /// The job `id`, within `tenant`'s jobs when given.
    async fn load(&self, tenant: Option<&str>, id: &str) -> Result<JobRecord, JobError> {
        self.store.job(tenant, id).await?.ok_or(JobError::NotFound)
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

/// A succeeded job's stored result as an [`Answer`] (for rendering), named
/// after the attempt that completed it (its provider, model and call
/// duration) when `attempts` holds it.
pub fn job_answer(job: &JobRecord, route: &Route, attempts: &[AttemptRecord]) -> Answer {
    let by = job
        .completed_by
        .and_then(|n| attempts.iter().find(|a| a.n == n));
    Answer {
        dialect: Dialect::parse(&job.dialect).unwrap_or(Dialect::Chat),
        status: reqwest::StatusCode::OK,
        form: Form::Plain,
        body: bytes::Bytes::from(job.result.clone().unwrap_or_default()),
        retry_after: None,
        failure: None,
        provider: by.map_or_else(|| "job".into(), |a| a.provider.as_str().into()),
        model: by.map_or_else(|| route.model.clone(), |a| a.model.as_str().into()),
        created_at: std::time::SystemTime::now(),
        upstream_latency: by
            .and_then(|a| Some(a.finished_at? - a.started_at))
            .and_then(|ms| u64::try_from(ms).ok())
            .map_or(Duration::ZERO, Duration::from_millis),
        cache_ttl: None,
        rendered: Default::default(),
    }
}

/// A job as the API shows it (docs/design.md, "Jobs and attempts": the field names are part of
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
        "dialect": job.dialect,
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
