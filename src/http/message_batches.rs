//! Anthropic's Message Batches (docs/http-api.md, "Message Batches") on
//! the Messages face: create, read, list, cancel and the results of a
//! tenant's batches, in Anthropic's shapes and errors. A batch's requests
//! are kept as a file of its own and run by [`crate::batches`] exactly as
//! an OpenAI batch's lines are: each a job, identical requests one call.

use std::collections::HashSet;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures_util::stream;
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::batches::load;
use super::error::ApiError;
use super::faces::anthropic_error;
use super::jobs::{IDEMPOTENT_REPLAYED, idempotency_key};
use super::openai::content_length;
use super::{ApiPath, ApiQuery, AppState, Caller, validate};
use crate::batches::lines::{FileWriter, Line, LineReader};
use crate::batches::{
    BatchError, COMPLETION_WINDOW, MESSAGE_BATCH_PURPOSE, MESSAGES_ENDPOINT, NewBatch,
};
use crate::dialect::messages;
use crate::fingerprint;
use crate::store::{BatchRecord, BatchStatus, now_ms, rfc3339};

/// The longest `custom_id` Anthropic takes (of letters, digits, `_`, `-`).
const MAX_CUSTOM_ID: usize = 64;

/// Renders a handler's result as Anthropic's clients read it.
async fn anthropic(result: Result<Response, ApiError>) -> Response {
    anthropic_error(result.into_response()).await
}

/// The caller, by `x-api-key` (else `Authorization: Bearer`), within its
/// rate limits.
async fn caller(headers: &HeaderMap, app: &AppState) -> Result<Caller, ApiError> {
    let caller = Caller::authenticate_anthropic(headers, app)?;
    caller.limit(app).await?;
    Ok(caller)
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    requests: Vec<Request>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    custom_id: String,
    params: Map<String, Value>,
}

/// `POST /v1/messages/batches`.
pub async fn create(State(app): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    anthropic(create_batch(app, headers, body).await).await
}

async fn create_batch(app: AppState, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    let caller = caller(&headers, &app).await?;
    let tenant = caller.tenant()?;
    let key = idempotency_key(&headers)?;
    let (bytes, share) = app
        .intake
        .read(body, content_length(&headers), caller.body_limit(&app))
        .await?;
    let object = validate::parse_object(&bytes, &app.limits)?;
    drop(share);
    let hash = requests_hash(&object);
    let asked: CreateBody = serde_json::from_value(Value::Object(object)).map_err(|e| {
        ApiError::bad_request(
            format!("invalid batch request: {e}"),
            "invalid_request",
            None,
        )
    })?;
    let cfg = &caller.live.config.batches;
    check_requests(&asked.requests, cfg.max_lines)?;
    // A replay is answered before anything is written.
    if let Some(key) = &key
        && let Some(existing) = app.batches.existing(&tenant, key).await?
    {
        if existing.payload_hash != hash || existing.endpoint != MESSAGES_ENDPOINT {
            return Err(BatchError::KeyReused.into());
        }
        return Ok(replayed(&existing, &headers));
    }
    let total = asked.requests.len();
    let expires = now_ms() + i64::try_from(cfg.file_retention.as_millis()).unwrap_or(i64::MAX);
    let mut file = FileWriter::new(
        app.store.clone(),
        &tenant,
        "message_batch_requests.jsonl".into(),
        expires,
    )
    .purpose(MESSAGE_BATCH_PURPOSE);
    for r in asked.requests {
        let line = json!({
            "custom_id": r.custom_id,
            "method": "POST",
            "url": MESSAGES_ENDPOINT,
            "body": r.params,
        });
        file.line(line.to_string().as_bytes()).await?;
    }
    let Some(file_id) = file.finish().await? else {
        return Err(no_requests());
    };
    let new = NewBatch {
        input_file_id: file_id.clone(),
        endpoint: MESSAGES_ENDPOINT.into(),
        completion_window: COMPLETION_WINDOW.into(),
        metadata: None,
        hash: Some(hash),
        total: i64::try_from(total).unwrap_or(i64::MAX),
    };
    let made = app
        .batches
        .create(&tenant, caller.key.as_ref().map(|k| &*k.id), new, key, cfg)
        .await;
    match made {
        Ok((batch, true)) => Ok(axum::Json(message_batch_json(&batch, &headers)).into_response()),
        other => {
            // Another creation with the key came first (or none was made):
            // this one's requests file is not needed.
            let _ = app.store.delete_file(&tenant, &file_id).await;
            let (batch, _) = other?;
            Ok(replayed(&batch, &headers))
        }
    }
}

fn replayed(batch: &BatchRecord, headers: &HeaderMap) -> Response {
    let mut resp = axum::Json(message_batch_json(batch, headers)).into_response();
    resp.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    resp
}

fn no_requests() -> ApiError {
    ApiError::bad_request(
        "requests: a batch needs at least one request",
        "invalid_request",
        Some("requests"),
    )
}

/// What Anthropic checks when a batch is created: at least one request,
/// not too many, each `custom_id` well formed and given once. A request's
/// `params` are checked when it runs (its own error, as Anthropic's are).
fn check_requests(requests: &[Request], max: u64) -> Result<(), ApiError> {
    if requests.is_empty() {
        return Err(no_requests());
    }
    if requests.len() as u64 > max {
        return Err(ApiError::bad_request(
            format!("requests: a batch takes at most {max} requests"),
            "invalid_request",
            Some("requests"),
        ));
    }
    let mut seen = HashSet::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        let id = &r.custom_id;
        let well_formed = !id.is_empty()
            && id.len() <= MAX_CUSTOM_ID
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
        if !well_formed {
            return Err(ApiError::bad_request(
                format!(
                    "requests.{i}.custom_id: must be 1 to {MAX_CUSTOM_ID} letters, digits, \
                     underscores or hyphens"
                ),
                "invalid_request",
                Some("custom_id"),
            ));
        }
        if !seen.insert(id.as_str()) {
            return Err(ApiError::bad_request(
                format!("requests.{i}.custom_id: duplicate custom_id {id:?}"),
                "invalid_request",
                Some("custom_id"),
            ));
        }
    }
    Ok(())
}

/// What a Message Batch created again with the same key must match.
fn requests_hash(body: &Map<String, Value>) -> String {
    let mut hasher = blake3::Hasher::new();
    let requests = body.get("requests").cloned().unwrap_or(Value::Null);
    // Writing into a hasher cannot fail.
    let _ = fingerprint::write_canonical(&requests, &mut hasher);
    format!("m1:{}", hasher.finalize().to_hex())
}

/// Where this gateway is, as the client reached it: for `results_url`.
fn base_url(headers: &HeaderMap) -> String {
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .filter(|h| !h.is_empty() && !h.contains(['/', ' ']));
    let proto = headers
        .get("x-forwarded-proto")
        .and_then(|h| h.to_str().ok())
        .filter(|p| *p == "https" || *p == "http")
        .unwrap_or("http");
    host.map_or_else(String::new, |h| format!("{proto}://{h}"))
}

fn ended(status: BatchStatus) -> bool {
    matches!(
        status,
        BatchStatus::Completed
            | BatchStatus::Cancelled
            | BatchStatus::Expired
            | BatchStatus::Failed
    )
}

/// A batch as Anthropic's Message Batch object.
pub fn message_batch_json(b: &BatchRecord, headers: &HeaderMap) -> Value {
    let done = ended(b.status);
    let processing_status = match b.status {
        BatchStatus::Cancelling => "canceling",
        s if ended(s) => "ended",
        _ => "in_progress",
    };
    let c = b.counts;
    let (canceled, expired) = match b.status {
        BatchStatus::Cancelled => (c.not_run, 0),
        BatchStatus::Expired => (0, c.not_run),
        _ => (0, 0),
    };
    let ended_at = b
        .completed_at
        .or(b.cancelled_at)
        .or(b.expired_at)
        .or(b.failed_at)
        .filter(|_| done);
    json!({
        "id": b.id,
        "type": "message_batch",
        "processing_status": processing_status,
        "request_counts": {
            "processing": if done { 0 } else { (c.total - c.completed - c.failed).max(0) },
            "succeeded": c.completed,
            "errored": (c.failed - canceled - expired).max(0),
            "canceled": canceled,
            "expired": expired,
        },
        "ended_at": ended_at.map(rfc3339),
        "created_at": rfc3339(b.created_at),
        "expires_at": rfc3339(b.expires_at),
        "archived_at": null,
        "cancel_initiated_at": b.cancelling_at.map(rfc3339),
        "results_url": done.then(|| {
            format!("{}/v1/messages/batches/{}/results", base_url(headers), b.id)
        }),
        "idem": {
            "answered_without_call": c.deduplicated + c.reused,
            "deduplicated": c.deduplicated,
            "reused": c.reused,
        },
    })
}

/// `GET /v1/messages/batches/{id}`.
pub async fn get(
    State(app): State<AppState>,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
) -> Response {
    let got = async {
        let tenant = caller(&headers, &app).await?.tenant()?;
        let b = load(&app, &tenant, &id, true).await?;
        Ok(axum::Json(message_batch_json(&b, &headers)).into_response())
    };
    anthropic(got.await).await
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default)]
    after_id: Option<String>,
    #[serde(default)]
    before_id: Option<String>,
}

/// `GET /v1/messages/batches`: newest first, `limit` 1 to 1000 (default
/// 20), the page after `after_id`.
pub async fn list(
    State(app): State<AppState>,
    headers: HeaderMap,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Response {
    let listed = async {
        let tenant = caller(&headers, &app).await?.tenant()?;
        let limit = q.limit.unwrap_or(20);
        if !(1..=1000).contains(&limit) {
            return Err(ApiError::bad_request(
                "limit: must be 1 to 1000",
                "invalid_request",
                Some("limit"),
            ));
        }
        if q.before_id.is_some() {
            return Err(ApiError::bad_request(
                "before_id: idem pages forward only (after_id)",
                "invalid_request",
                Some("before_id"),
            ));
        }
        let mut batches = app
            .store
            .list_batches(&tenant, true, q.after_id.as_deref(), limit + 1)
            .await?;
        let has_more = batches.len() > limit as usize;
        batches.truncate(limit as usize);
        Ok(axum::Json(json!({
            "data": batches.iter().map(|b| message_batch_json(b, &headers)).collect::<Vec<_>>(),
            "first_id": batches.first().map(|b| b.id.as_str()),
            "last_id": batches.last().map(|b| b.id.as_str()),
            "has_more": has_more,
        }))
        .into_response())
    };
    anthropic(listed.await).await
}

/// `POST /v1/messages/batches/{id}/cancel`: `canceling`, then `ended` once
/// the requests in flight have ended; an ended batch is answered as it is.
pub async fn cancel(
    State(app): State<AppState>,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
) -> Response {
    let cancelled = async {
        let tenant = caller(&headers, &app).await?.tenant()?;
        let b = load(&app, &tenant, &id, true).await?;
        let b = match app.batches.cancel(&tenant, &b.id).await {
            Ok(b) => b,
            // Anthropic answers the batch as it is once it has ended.
            Err(BatchError::NotCancellable { .. }) => load(&app, &tenant, &id, true).await?,
            Err(e) => return Err(e.into()),
        };
        Ok(axum::Json(message_batch_json(&b, &headers)).into_response())
    };
    anthropic(cancelled.await).await
}

/// `DELETE /v1/messages/batches/{id}`: an ended batch, with its results;
/// one that has not ended is refused (400), as Anthropic refuses it.
pub async fn delete(
    State(app): State<AppState>,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
) -> Response {
    let deleted = async {
        let tenant = caller(&headers, &app).await?.tenant()?;
        let b = load(&app, &tenant, &id, true).await?;
        let b = app.batches.delete(&tenant, &b.id).await?;
        Ok(axum::Json(json!({"id": b.id, "type": "message_batch_deleted"})).into_response())
    };
    anthropic(deleted.await).await
}

/// `GET /v1/messages/batches/{id}/results`: one line per request, in
/// Anthropic's result shape (`succeeded`, `errored`, `canceled`,
/// `expired`), read from the batch's output and error files a part at a
/// time; the answered requests first, then the others.
pub async fn results(
    State(app): State<AppState>,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
) -> Response {
    let streamed = async {
        let tenant = caller(&headers, &app).await?.tenant()?;
        let b = load(&app, &tenant, &id, true).await?;
        if !ended(b.status) {
            return Err(ApiError::bad_request(
                format!("batch {id} has not ended: its results are not ready"),
                "invalid_request",
                None,
            ));
        }
        let files: Vec<String> = [b.output_file_id, b.error_file_id]
            .into_iter()
            .flatten()
            .collect();
        let store = app.store.clone();
        let state = (files.into_iter(), None::<LineReader>);
        let lines = stream::unfold(
            (store, state),
            |(store, (mut files, mut reader))| async move {
                loop {
                    if reader.is_none() {
                        let file = files.next()?;
                        reader = Some(LineReader::new(store.clone(), &file));
                    }
                    let r = reader.as_mut()?;
                    match r.next().await {
                        Ok(Some(Line::Text(text))) => {
                            let Some(line) = result_line(&text) else {
                                continue;
                            };
                            return Some((Ok(Bytes::from(line)), (store, (files, reader))));
                        }
                        Ok(Some(Line::TooLong)) => {}
                        Ok(None) => reader = None,
                        Err(e) => {
                            let e = std::io::Error::other(e.to_string());
                            return Some((Err(e), (store, (files, None))));
                        }
                    }
                }
            },
        );
        let mut resp = Body::from_stream(lines).into_response();
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-jsonl"),
        );
        Ok(resp)
    };
    anthropic(streamed.await).await
}

/// An output or error file line as Anthropic's result line (with its
/// newline); None for a line that is not one of idem's.
fn result_line(text: &[u8]) -> Option<String> {
    let line: Value = serde_json::from_slice(text).ok()?;
    let custom_id = line.get("custom_id")?.clone();
    let errored = |kind: &str, message: &str| json!({"type": "errored", "error": messages::error_body(kind, message)});
    let result = match (line.get("response"), line.get("error")) {
        (Some(resp), _) if !resp.is_null() => {
            let status = resp["status_code"].as_u64().unwrap_or(500);
            if status == 200 {
                json!({"type": "succeeded", "message": resp["body"]})
            } else {
                let message = resp["body"]["error"]["message"].as_str().unwrap_or("");
                errored(
                    messages::error_kind(u16::try_from(status).unwrap_or(500)),
                    message,
                )
            }
        }
        (_, Some(e)) => {
            let message = e["message"].as_str().unwrap_or("");
            match e["code"].as_str() {
                Some("batch_cancelled") => json!({"type": "canceled"}),
                Some("batch_expired") => json!({"type": "expired"}),
                _ => errored("api_error", message),
            }
        }
        _ => return None,
    };
    let mut out = json!({"custom_id": custom_id, "result": result}).to_string();
    out.push('\n');
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_and_error_lines_become_anthropics_results() {
        let ok = br#"{"id":"r1","custom_id":"a","response":{"status_code":200,"request_id":"j","body":{"type":"message","content":[]}},"error":null}"#;
        let v: Value = serde_json::from_str(&result_line(ok).unwrap()).unwrap();
        assert_eq!(
            v,
            json!({"custom_id": "a", "result": {"type": "succeeded",
                   "message": {"type": "message", "content": []}}})
        );
        let refused = br#"{"id":"r2","custom_id":"b","response":{"status_code":400,"request_id":null,"body":{"error":{"message":"max_tokens: required","type":"invalid_request_error"}}},"error":null}"#;
        let v: Value = serde_json::from_str(&result_line(refused).unwrap()).unwrap();
        assert_eq!(v["result"]["type"], "errored");
        assert_eq!(v["result"]["error"]["type"], "error");
        assert_eq!(
            v["result"]["error"]["error"]["type"],
            "invalid_request_error"
        );
        assert_eq!(
            v["result"]["error"]["error"]["message"],
            "max_tokens: required"
        );
        for (code, kind) in [
            ("batch_cancelled", "canceled"),
            ("batch_expired", "expired"),
            ("unknown", "errored"),
            ("request_failed", "errored"),
        ] {
            let line = json!({"id": "r", "custom_id": "c", "response": null,
                              "error": {"code": code, "message": "m"}})
            .to_string();
            let v: Value = serde_json::from_str(&result_line(line.as_bytes()).unwrap()).unwrap();
            assert_eq!(v["result"]["type"], kind, "{code}");
        }
        assert!(result_line(b"not json").is_none());
    }

    #[test]
    fn custom_ids_are_checked_as_anthropic_checks_them() {
        let req = |id: &str| Request {
            custom_id: id.into(),
            params: Map::new(),
        };
        assert!(check_requests(&[req("a-1_B")], 10).is_ok());
        assert!(check_requests(&[], 10).is_err());
        assert!(check_requests(&[req("a"), req("a")], 10).is_err());
        assert!(check_requests(&[req("has space")], 10).is_err());
        assert!(check_requests(&[req(&"x".repeat(65))], 10).is_err());
        assert!(check_requests(&[req("a"), req("b")], 1).is_err());
    }
}
