//! The jobs API (docs/design.md, "Jobs and attempts"): create with an `Idempotency-Key`, read,
//! list, retry, resolve (admin) and cancel. Every lookup is scoped to the
//! caller's tenant: another tenant's job is 404, never 403.

use std::sync::Arc;
use std::time::Instant;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::faces::{Asked, render};
use super::openai::{content_length, decorate, forwarded, route_request};
use super::responses::ResponsesAsk;
use super::validate::{self, ChatRequest};
use super::{ApiPath, ApiQuery};
use super::{AppState, Caller};
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::flight::RequestBody;
use crate::jobs::{Intent, JobError, Resolution, job_answer, job_json};
use crate::outcome::Outcome;
use crate::routes::Route;
use crate::store::{Cursor, JobRecord, JobState};
use crate::task::{Count, Finish, Line};
use crate::telemetry::Trace;

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

/// Job ids are UUIDs; anything else cannot name a job.
pub(super) fn check_id(id: &str) -> Result<(), ApiError> {
    if id.len() == 36 && uuid::Uuid::parse_str(id).is_ok() {
        Ok(())
    } else {
        Err(ApiError::NotFound("job"))
    }
}

async fn load(app: &AppState, tenant: &str, id: &str) -> Result<JobRecord, ApiError> {
    check_id(id)?;
    app.store
        .job(Some(tenant), id)
        .await?
        .ok_or(ApiError::NotFound("job"))
}

async fn with_attempts(app: &AppState, job: &JobRecord) -> Result<Value, ApiError> {
    let attempts = app.store.attempts(&job.id).await?;
    Ok(job_json(job, Some(&attempts)))
}

/// `POST /v1/jobs`: `{"request": <chat completion body>, "metadata": {...}}`.
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let tenant = caller.tenant()?;
    let key = idempotency_key(&headers)?.ok_or_else(|| {
        ApiError::bad_request(
            "POST /v1/jobs needs an Idempotency-Key header",
            "idempotency_key_missing",
            Some("Idempotency-Key"),
        )
    })?;
    let (bytes, share) = app
        .intake
        .read(body, content_length(&headers), caller.body_limit(&app))
        .await?;
    let outer = validate::parse_object(&bytes, &app.limits)?;
    let (request, metadata) = validate::job_body(outer)?;
    let req = validate::chat_request(request, &app.limits)?;
    drop(share);
    let forwarded = forwarded(Dialect::Chat, &headers);
    let (route, fp) = route_request(
        &caller.live,
        &tenant,
        Dialect::Chat,
        &req,
        &headers,
        &forwarded,
    )?;
    caller.may_use(&route)?;
    let intent = Intent {
        asked: &req.body,
        request: &req.body,
        dialect: Dialect::Chat,
        forwarded: &forwarded,
        fp: &fp,
        metadata: metadata.as_ref(),
        key_id: caller.key.as_ref().map(|k| &*k.id),
    };
    let created = app.jobs.create(&tenant, &route, intent, &key).await?;
    let status = if created.new {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    // A job created just now has no attempts to show yet; an existing one
    // is read with its attempts.
    let body = if created.new {
        job_json(&created.job, Some(&[]))
    } else {
        with_attempts(&app, &created.job).await?
    };
    let mut resp = (status, Json(body)).into_response();
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&created.job.id) {
        h.insert(IDEM_JOB_ID, v);
    }
    if !created.new {
        h.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    // A new job is counted as an incoming request by its first attempt
    // (which knows whether it made the call); asking again for an existing
    // job is a request answered without one.
    let body = RequestBody::kept(req.body.clone());
    app.core.finish(Finish {
        tenant: Some(&tenant),
        route: Some(&route.name),
        count: (!created.new).then_some(Count::Answered(Outcome::Replay)),
        line: Some(Line {
            fp,
            endpoint: "jobs",
            outcome: if created.new { "created" } else { "replay" },
            status: status.as_u16(),
            started,
            job: Some((&created.job.id, created.job.completed_by)),
            body: Some(&body),
            answer: None,
            answer_of_job: None,
            usage: None,
        }),
        priced: Some(&route),
        ..Finish::default()
    });
    Ok(resp)
}

/// A request of the conversation path on its way to a job: the request as
/// its client sent it, the request its attempts send, the form its asker
/// wants, its answer-changing headers, a Responses request's turn, and its
/// fingerprint.
pub struct Asking {
    pub req: ChatRequest,
    pub send: Arc<serde_json::Map<String, Value>>,
    pub asked: Asked,
    pub forwarded: Forwarded,
    pub responses: Option<Box<ResponsesAsk>>,
    pub fp: Fingerprint,
    /// The store's key the request came with (its budget pays).
    pub key_id: Option<Arc<str>>,
}

/// `POST /v1/chat/completions` (or another face of the chat path) with an
/// `Idempotency-Key`: the request becomes (or finds) a job and waits for it
/// within the request timeout, then gets the job's answer in its face's
/// shape.
pub async fn chat(
    app: &AppState,
    tenant: &Arc<str>,
    route: &Arc<Route>,
    asking: Asking,
    key: String,
    started: Instant,
    trace: Option<Trace>,
) -> Result<Response, ApiError> {
    let Asking {
        req,
        send,
        asked,
        forwarded,
        responses,
        fp,
        key_id,
    } = asking;
    let intent = Intent {
        asked: &req.body,
        request: &send,
        dialect: asked.dialect,
        forwarded: &forwarded,
        fp: &fp,
        metadata: None,
        key_id: key_id.as_deref(),
    };
    let created = app.jobs.create(tenant, route, intent, &key).await?;
    let replayed = !created.new && created.job.state == JobState::Succeeded;
    let new = created.new;
    let job = if created.job.state == JobState::Succeeded {
        created.job
    } else {
        let deadline = started + app.live.load().config.server.request_timeout;
        app.jobs
            .wait(tenant, &created.job.id, deadline)
            .await
            .map_err(|e| match e {
                JobError::InProgress { job_id } => ApiError::JobInProgress {
                    job_id,
                    created: new,
                },
                e => e.into(),
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
    // Who answered: the attempt that completed the job. The answer is
    // there either way; a store that cannot say costs only its name.
    let attempts = match job.completed_by {
        Some(_) => app.store.attempts(&job.id).await.unwrap_or_else(|e| {
            tracing::warn!(job = %job.id, error = %e, "cannot read the job's attempts");
            Vec::new()
        }),
        None => Vec::new(),
    };
    let answer = Arc::new(job_answer(&job, route, &attempts));
    if let Some(r) = &responses
        && r.store
        && job.state == JobState::Succeeded
    {
        let source = crate::flight::Source::Done(answer.clone());
        super::responses::keep(app, tenant, &fp, r, source, false).await;
    }
    let mut resp = match job.state {
        JobState::Succeeded => render(&answer, asked),
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
    // The request that created the job is counted by the job's first
    // attempt, with how that attempt got its answer: one job, one
    // incoming request. A retry with the key is a request of its own.
    let body = RequestBody::kept(req.body.clone());
    app.core.finish(Finish {
        tenant: Some(tenant),
        route: Some(&route.name),
        count: (!new).then_some(Count::Answered(outcome)),
        line: Some(Line {
            fp,
            endpoint: asked.dialect.as_str(),
            outcome: outcome.as_str(),
            status: resp.status().as_u16(),
            started,
            job: Some((&job.id, job.completed_by)),
            body: Some(&body),
            answer: None,
            answer_of_job: Some(answer),
            usage: None,
        }),
        priced: Some(route),
        trace: trace.as_ref(),
        ..Finish::default()
    });
    Ok(resp)
}

/// `GET /v1/jobs/{id}`.
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    let job = load(&app, &tenant, &id).await?;
    Ok(Json(with_attempts(&app, &job).await?))
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    state: Option<String>,
    limit: Option<u32>,
    after: Option<String>,
}

pub(super) fn parse_cursor(text: &str) -> Option<Cursor> {
    let (at, id) = text.split_once('_')?;
    check_id(id).ok()?;
    Some(Cursor {
        created_at: at.parse().ok()?,
        id: id.to_string(),
    })
}

/// `GET /v1/jobs?state=...&limit=...&after=...`: newest first.
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    let state = match q.state.as_deref() {
        None | Some("") => None,
        Some(s) => Some(JobState::parse(s).ok_or_else(|| {
            ApiError::bad_request(
                "`state` must be queued, running, succeeded, failed or cancelled",
                "invalid_value",
                Some("state"),
            )
        })?),
    };
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::bad_request(
            "`limit` must be 1..=100",
            "invalid_value",
            Some("limit"),
        ));
    }
    let cursor = match q.after.as_deref() {
        None | Some("") => None,
        Some(c) => Some(parse_cursor(c).ok_or_else(|| {
            ApiError::bad_request("invalid cursor", "invalid_value", Some("after"))
        })?),
    };
    let mut jobs = app
        .store
        .list_jobs(&tenant, state, cursor.as_ref(), limit + 1)
        .await?;
    let has_more = jobs.len() > limit as usize;
    jobs.truncate(limit as usize);
    let next = if has_more {
        jobs.last().map(|j| format!("{}_{}", j.created_at, j.id))
    } else {
        None
    };
    let data: Vec<Value> = jobs.iter().map(|j| job_json(j, None)).collect();
    Ok(Json(
        json!({"object": "list", "data": data, "has_more": has_more, "next_cursor": next}),
    ))
}

/// `POST /v1/jobs/{id}/attempts`: a manual retry. Refused while any attempt
/// is `starting`, `running` or `unknown`.
pub async fn retry(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let tenant = caller.tenant()?;
    check_id(&id)?;
    let job = app.jobs.retry(&tenant, &id).await?;
    Ok((StatusCode::ACCEPTED, Json(with_attempts(&app, &job).await?)).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolutionBody {
    outcome: String,
    #[serde(default)]
    result: Option<Value>,
}

/// `POST /v1/jobs/{id}/attempts/{n}/resolve` (admin key): settles an
/// `unknown` attempt out of band.
pub async fn resolve(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath((id, n)): ApiPath<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    check_id(&id)?;
    let n: i32 = n.parse().map_err(|_| ApiError::NotFound("attempt"))?;
    let bytes =
        validate::read_body(body, content_length(&headers), app.limits.max_body_bytes).await?;
    let res: ResolutionBody = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::bad_request(format!("invalid resolution: {e}"), "invalid_json", None)
    })?;
    let resolution = match (res.outcome.as_str(), res.result) {
        ("failed", _) => Resolution::Failed,
        ("cancelled", _) => Resolution::Cancelled,
        ("succeeded", Some(result)) => Resolution::Succeeded(result),
        ("succeeded", None) => {
            return Err(ApiError::bad_request(
                "`result` is required to resolve as succeeded",
                "missing_required_parameter",
                Some("result"),
            ));
        }
        _ => {
            return Err(ApiError::bad_request(
                "`outcome` must be failed, cancelled or succeeded",
                "invalid_value",
                Some("outcome"),
            ));
        }
    };
    let job = app.jobs.resolve(&id, n, resolution).await?;
    Ok(Json(with_attempts(&app, &job).await?))
}

/// `POST /v1/jobs/{id}/cancel`.
pub async fn cancel(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    check_id(&id)?;
    let job = app.jobs.cancel(&tenant, &id).await?;
    Ok(Json(with_attempts(&app, &job).await?))
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
