//! Jobs: one job per user intent (SPEC section 5).
//!
//! A job-creating request carries an `Idempotency-Key`; the database's
//! UNIQUE `(tenant, idempotency_key)` decides which request created the job,
//! and every other request with that key gets the same job back (or 409 if
//! its payload differs). Retries, failovers and hedges are attempts under the
//! job, run by the [`executor`]; the [`reconciler`] turns attempts whose
//! replica died into `unknown`. This file is the part the HTTP handlers call:
//! create, wait, and render.

pub mod executor;
pub mod reconciler;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use dashmap::DashMap;
use serde_json::{Map, Value, json};
use tokio::sync::{Notify, watch};

use crate::answer::{Answer, Form};
use crate::fingerprint::{self, Fingerprint, Rules};
use crate::http::AppState;
use crate::http::error::ApiError;
use crate::http::openai::{decorate, render};
use crate::http::validate::ChatRequest;
use crate::metrics::Outcome;
use crate::reqlog::Entry;
use crate::routes::Route;
use crate::store::{AttemptRecord, Created, JobRecord, JobState, NewJob, Store, now_ms};

pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
pub const IDEM_JOB_ID: HeaderName = HeaderName::from_static("idem-job-id");
pub const IDEM_ATTEMPT: HeaderName = HeaderName::from_static("idem-attempt");
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// The `Idempotency-Key` header, if present: 1..255 printable ASCII.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get(IDEMPOTENCY_KEY) else {
        return Ok(None);
    };
    let bytes = v.as_bytes();
    if bytes.is_empty() || bytes.len() > 255 {
        return Err(ApiError::bad_request(
            "Idempotency-Key must be 1 to 255 characters",
            "idempotency_key_invalid",
            Some("Idempotency-Key"),
        ));
    }
    if !bytes.iter().all(|b| (0x20..=0x7e).contains(b)) {
        return Err(ApiError::bad_request(
            "Idempotency-Key must be printable ASCII",
            "idempotency_key_invalid",
            Some("Idempotency-Key"),
        ));
    }
    // Checked: printable ASCII is valid UTF-8.
    Ok(Some(String::from_utf8_lossy(bytes).into_owned()))
}

/// The payload hash: the fingerprint rules without text normalization
/// (SPEC section 5), plus the job's metadata. Two requests are the same
/// intent only if this matches.
pub fn payload_hash(
    tenant: &str,
    route: &Route,
    request: &Map<String, Value>,
    metadata: Option<&Value>,
) -> String {
    let rules = Rules {
        tenant,
        route: &route.name,
        targets: route.target_configs(),
        normalize: crate::config::Normalize::None,
        scope: route.config.scope,
        ignore_fields: &route.config.ignore_fields,
        contract: route.contract.as_ref().map(|c| c.hash.as_str()),
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
        request: &ChatRequest,
        fp: &Fingerprint,
        metadata: Option<&Value>,
        key: &str,
    ) -> Result<CreatedJob, ApiError> {
        let hash = payload_hash(tenant, route, &request.body, metadata);
        let new = NewJob {
            id: uuid::Uuid::now_v7().to_string(),
            tenant: tenant.to_string(),
            idempotency_key: key.to_string(),
            payload_hash: hash.clone(),
            fingerprint: fp.to_string(),
            route: route.name.to_string(),
            request: serde_json::to_string(&*request.body).unwrap_or_default(),
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
            Created::Existing(_) => Err(ApiError::Conflict {
                message: "this Idempotency-Key was already used with a different request".into(),
                code: "idempotency_key_reused",
            }),
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
    ) -> Result<JobRecord, ApiError> {
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
                .ok_or(ApiError::NotFound("job"))?;
            if matches!(
                job.state,
                JobState::Succeeded | JobState::Failed | JobState::Cancelled
            ) {
                break Ok(job);
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(ApiError::JobInProgress {
                    job_id: id.to_string(),
                    created: false,
                });
            }
            let nap = (deadline - now).min(Duration::from_millis(250));
            let _ = tokio::time::timeout(nap, rx.changed()).await;
        };
        drop(rx);
        self.changed.remove_if(id, |_, tx| tx.receiver_count() == 0);
        result
    }

    /// `POST /v1/chat/completions` with an `Idempotency-Key`: the request
    /// becomes (or finds) a job and waits for it within the request timeout.
    #[expect(clippy::too_many_arguments, reason = "the request path's context")]
    pub async fn chat(
        &self,
        app: &AppState,
        tenant: &Arc<str>,
        route: &Arc<Route>,
        req: ChatRequest,
        fp: Fingerprint,
        key: String,
        started: Instant,
    ) -> Result<Response, ApiError> {
        let created = self.create(tenant, route, &req, &fp, None, &key).await?;
        let replayed = !created.new && created.job.state == JobState::Succeeded;
        let new = created.new;
        let job = if created.job.state == JobState::Succeeded {
            created.job
        } else {
            let deadline = started + app.config.server.request_timeout;
            self.wait(tenant, &created.job.id, deadline)
                .await
                .map_err(|e| match e {
                    ApiError::JobInProgress { job_id, .. } => ApiError::JobInProgress {
                        job_id,
                        created: new,
                    },
                    e => e,
                })?
        };
        // The request that created the job leads it; a retry with the same
        // key that waited on it follows; one that found it done replays.
        let outcome = if replayed {
            Outcome::Replay
        } else if new {
            Outcome::Leader
        } else {
            Outcome::Follower
        };
        let answer = job_answer(&job, route);
        let mut resp = match job.state {
            JobState::Succeeded => render(&answer, req.stream, req.include_usage),
            JobState::Cancelled => ApiError::Conflict {
                message: "the job for this Idempotency-Key was cancelled".into(),
                code: "job_cancelled",
            }
            .into_response(),
            _ => ApiError::Upstream {
                status: axum::http::StatusCode::BAD_GATEWAY,
                message: format!(
                    "the job for this Idempotency-Key failed: {}",
                    job.error.as_deref().unwrap_or("unknown reason")
                ),
                code: "job_failed",
                retry_after: None,
            }
            .into_response(),
        };
        // The request that created the job is counted by the job's first
        // attempt, with how that attempt got its answer: one job, one
        // incoming request. A retry with the key is a request of its own.
        if !new {
            app.metrics.request(tenant, &route.name, outcome);
        }
        let h = resp.headers_mut();
        decorate(h, outcome, &fp, Some(&answer));
        if let Ok(v) = HeaderValue::from_str(&job.id) {
            h.insert(IDEM_JOB_ID, v);
        }
        if let Some(n) = job.completed_by {
            h.insert(IDEM_ATTEMPT, HeaderValue::from(n));
        }
        if replayed {
            h.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        }
        let status = resp.status().as_u16();
        app.reqlog.write(
            &Entry::new(tenant, &route.name, &fp, outcome.as_str(), status, started)
                .job(&job.id, job.completed_by)
                .answer(Some(&answer))
                .body(&req.body),
        );
        Ok(resp)
    }
}

/// A succeeded job's stored result as an [`Answer`] (for rendering).
fn job_answer(job: &JobRecord, route: &Route) -> Answer {
    Answer {
        status: axum::http::StatusCode::OK,
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

/// RFC 3339 text of a millisecond timestamp.
pub fn rfc3339(ms: i64) -> String {
    // humantime formats years up to 9999; clamp rather than fail.
    const MAX_MS: u64 = 253_402_300_799_999;
    let ms = u64::try_from(ms).unwrap_or(0).min(MAX_MS);
    let t = std::time::UNIX_EPOCH + Duration::from_millis(ms);
    humantime::format_rfc3339_millis(t).to_string()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idempotency_keys_are_checked() {
        let mut h = HeaderMap::new();
        assert_eq!(idempotency_key(&h).unwrap(), None);
        h.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("order-45"));
        assert_eq!(idempotency_key(&h).unwrap().as_deref(), Some("order-45"));
        h.insert(
            IDEMPOTENCY_KEY,
            HeaderValue::from_str(&"k".repeat(255)).unwrap(),
        );
        assert!(idempotency_key(&h).is_ok());
        h.insert(
            IDEMPOTENCY_KEY,
            HeaderValue::from_str(&"k".repeat(256)).unwrap(),
        );
        assert!(idempotency_key(&h).is_err());
        h.insert(
            IDEMPOTENCY_KEY,
            HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap(),
        );
        assert!(idempotency_key(&h).is_err());
        h.insert(IDEMPOTENCY_KEY, HeaderValue::from_bytes(b"a\tb").unwrap());
        assert!(idempotency_key(&h).is_err());
        h.insert(IDEMPOTENCY_KEY, HeaderValue::from_static(""));
        assert!(idempotency_key(&h).is_err());
    }
}
