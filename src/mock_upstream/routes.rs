//! The mock's HTTP surface: the OpenAI-compatible endpoints, their Azure
//! OpenAI twins, Anthropic's messages endpoints, OpenAI's Files and Batch
//! endpoints (handled in `batches`), and the `/_mock` control API that
//! tests use to observe and steer it.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::header::{AUTHORIZATION, CACHE_CONTROL, CONTENT_TYPE, RETRY_AFTER};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::answer::{Garbled, error_body, garbage, plain_body, stream_frames};
use super::anthropic::{self, Reply};
use super::batches;
use super::embeddings::{self, EmbeddingsRequest, answer_body};
use super::state::{Arrival, InFlight, Incoming, Outcome, Release, Sent, Shared};
use super::{Behaviour, Endpoint};
use super::{responses, responses_request};

/// Request bodies up to this size are accepted (above the gateway's own
/// limit, so the gateway's limit is the one a test observes).
const MAX_BODY_BYTES: usize = 64 * 1024 * 1024;

/// How long `/_mock/held` waits when the caller gives no `timeout_ms`.
const DEFAULT_HELD_TIMEOUT_MS: u64 = 10_000;

pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/chat/completions", post(chat))
        .route("/v1/embeddings", post(embeddings))
        .route("/embeddings", post(embeddings))
        .route(
            "/openai/deployments/{deployment}/chat/completions",
            post(azure_chat),
        )
        .route(
            "/openai/deployments/{deployment}/embeddings",
            post(azure_embeddings),
        )
        .route("/v1/responses", post(responses))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/files", post(batches::upload))
        .route("/files", post(batches::upload))
        .route(
            "/v1/files/{id}",
            get(batches::file).delete(batches::delete_file),
        )
        .route(
            "/files/{id}",
            get(batches::file).delete(batches::delete_file),
        )
        .route("/v1/files/{id}/content", get(batches::content))
        .route("/files/{id}/content", get(batches::content))
        .route("/v1/batches", post(batches::create).get(batches::list))
        .route("/batches", post(batches::create).get(batches::list))
        .route("/v1/batches/{id}", get(batches::retrieve))
        .route("/batches/{id}", get(batches::retrieve))
        .route("/v1/batches/{id}/cancel", post(batches::cancel))
        .route("/batches/{id}/cancel", post(batches::cancel))
        .route("/", get(root).head(root))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/_mock/stats", get(stats))
        .route("/_mock/calls", get(calls))
        .route("/_mock/reset", post(reset))
        .route(
            "/_mock/behaviour",
            get(get_behaviour).put(put_behaviour).patch(patch_behaviour),
        )
        .route("/_mock/held", get(held))
        .route("/_mock/release", post(release))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(shared)
}

/// The parts of an Azure OpenAI URL.
pub(super) struct Azure {
    deployment: String,
    /// The `api-version` query; none when missing or empty.
    api_version: Option<String>,
}

impl Azure {
    fn of(deployment: String, query: &HashMap<String, String>) -> Azure {
        Azure {
            deployment,
            api_version: query.get("api-version").filter(|v| !v.is_empty()).cloned(),
        }
    }

    /// Why Azure would refuse a request that carried `sent`: a missing
    /// `api-version` is a 404, a missing `api-key` a 401.
    fn refusal(&self, sent: &Sent) -> Option<Response> {
        if self.api_version.is_none() {
            return Some(azure_error(404, "Resource not found"));
        }
        if sent.api_key.as_deref().is_none_or(str::is_empty) {
            return Some(azure_error(
                401,
                "Access denied due to invalid subscription key or wrong API endpoint. \
                 Make sure to provide a valid key for an active subscription and use a \
                 correct regional API endpoint for your resource.",
            ));
        }
        None
    }

    /// `request` with the deployment as its `model`, as Azure answers.
    fn request(&self, request: &Arc<Value>) -> Arc<Value> {
        let mut request = Value::clone(request);
        if let Some(object) = request.as_object_mut() {
            object.insert("model".into(), json!(self.deployment));
        }
        Arc::new(request)
    }
}

/// `POST /v1/chat/completions`: count and record, then hold, wait, fail,
/// reset or answer as the behaviour says.
async fn chat(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    chat_answer(shared, &headers, &body, None).await
}

/// `POST /openai/deployments/{deployment}/chat/completions?api-version=V`:
/// the same, after Azure's checks, with the deployment as the model.
async fn azure_chat(
    State(shared): State<Arc<Shared>>,
    Path(deployment): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let azure = Azure::of(deployment, &query);
    chat_answer(shared, &headers, &body, Some(azure)).await
}

async fn chat_answer(
    shared: Arc<Shared>,
    headers: &HeaderMap,
    body: &[u8],
    azure: Option<Azure>,
) -> Response {
    let in_flight = shared.in_flight();
    let (request, valid) = request_of(body);
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    let sent = sent_of(headers, azure.as_ref());
    let refusal = azure.as_ref().and_then(|azure| azure.refusal(&sent));
    let arrival = shared.arrive(Incoming {
        endpoint: Endpoint::ChatCompletions,
        body: Arc::clone(&request),
        sent,
        stream,
        items: 0,
    });
    if let Some(refused) = refusal {
        shared.count(&arrival, Outcome::Failed(refused.status().as_u16()));
        return refused;
    }
    if !valid {
        shared.count(&arrival, Outcome::Failed(400));
        return error(400, NOT_AN_OBJECT, None);
    }
    let request = match &azure {
        Some(azure) => azure.request(&request),
        None => request,
    };
    let (behaviour, release) = match gate(&shared, &arrival, Face::OpenAi).await {
        Ok(go) => go,
        Err(refused) => return refused,
    };

    shared.count(
        &arrival,
        match (behaviour.garbage, behaviour.pad_bytes) {
            (Some(_), _) => Outcome::Garbage,
            (None, Some(_)) => Outcome::Padded,
            (None, None) => Outcome::Completed,
        },
    );
    let content = release.content.as_deref().or(behaviour.content.as_deref());
    let delay = Duration::from_millis(behaviour.chunk_delay_ms);
    if let Some(kind) = behaviour.garbage {
        let garbled = garbage(kind, &request, arrival.seq, content, stream);
        return garbled_response(shared, garbled, delay, in_flight);
    }
    if stream {
        let frames = stream_frames(&request, arrival.seq, content, behaviour.pad_bytes);
        event_stream(shared, frames, delay, in_flight)
    } else {
        let body = plain_body(&request, arrival.seq, content, behaviour.pad_bytes);
        json_text(body)
    }
}

/// `POST /v1/embeddings`: count and record, refuse an invalid request with
/// a 400 at once (as OpenAI does), then hold, wait, fail, reset or answer
/// as the behaviour says. `pad_bytes` and a release's `content` do not
/// apply (a release with content still chooses success).
async fn embeddings(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    embeddings_answer(shared, &headers, &body, None).await
}

/// `POST /openai/deployments/{deployment}/embeddings?api-version=V`: the
/// same, after Azure's checks, with the deployment as the model.
async fn azure_embeddings(
    State(shared): State<Arc<Shared>>,
    Path(deployment): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let azure = Azure::of(deployment, &query);
    embeddings_answer(shared, &headers, &body, Some(azure)).await
}

async fn embeddings_answer(
    shared: Arc<Shared>,
    headers: &HeaderMap,
    body: &[u8],
    azure: Option<Azure>,
) -> Response {
    let in_flight = shared.in_flight();
    let (request, valid) = request_of(body);
    let sent = sent_of(headers, azure.as_ref());
    let refusal = azure.as_ref().and_then(|azure| azure.refusal(&sent));
    let answered = match &azure {
        Some(azure) => azure.request(&request),
        None => Arc::clone(&request),
    };
    let parsed = valid.then(|| EmbeddingsRequest::parse(&answered));
    let items = match (&parsed, &refusal) {
        (Some(Ok(parsed)), None) => parsed.items.len() as u64,
        _ => 0,
    };
    let arrival = shared.arrive(Incoming {
        endpoint: Endpoint::Embeddings,
        body: request,
        sent,
        stream: false,
        items,
    });
    if let Some(refused) = refusal {
        shared.count(&arrival, Outcome::Failed(refused.status().as_u16()));
        return refused;
    }
    let parsed = match parsed {
        Some(Ok(parsed)) => parsed,
        Some(Err(invalid)) => {
            shared.count(&arrival, Outcome::Failed(400));
            return error_with_param(400, &invalid.message, Some(invalid.param), None);
        }
        None => {
            shared.count(&arrival, Outcome::Failed(400));
            return error(400, NOT_AN_OBJECT, None);
        }
    };
    let (behaviour, _release) = match gate(&shared, &arrival, Face::OpenAi).await {
        Ok(go) => go,
        Err(refused) => return refused,
    };

    let body = match answer_body(&parsed) {
        Ok(body) => body,
        Err(err) => {
            shared.count(&arrival, Outcome::Failed(500));
            return error(500, &format!("mock: cannot serialize: {err}"), None);
        }
    };
    if let Some(kind) = behaviour.garbage {
        shared.count(&arrival, Outcome::Garbage);
        let garbled = embeddings::garbage(kind, &body);
        return garbled_response(shared, garbled, Duration::ZERO, in_flight);
    }
    shared.count(&arrival, Outcome::Completed);
    json_text(body)
}

/// `POST /v1/responses` (OpenAI's Responses API, spoken natively): count
/// and record, refuse what OpenAI refuses with its 400 at once (naming the
/// `param`), then hold, wait, fail, reset or answer as the behaviour says:
/// a `response` object or its typed events, garbled or padded when the
/// behaviour says so (see the `responses` module).
async fn responses(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let in_flight = shared.in_flight();
    let (request, valid) = request_of(&body);
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    let arrival = shared.arrive(Incoming {
        endpoint: Endpoint::Responses,
        body: Arc::clone(&request),
        sent: sent_of(&headers, None),
        stream,
        items: 0,
    });
    let Some(object) = request.as_object().filter(|_| valid) else {
        shared.count(&arrival, Outcome::Failed(400));
        return error(400, NOT_AN_OBJECT, None);
    };
    if let Err(refusal) = responses_request::validate(object) {
        shared.count(&arrival, Outcome::Failed(400));
        let code = StatusCode::BAD_REQUEST;
        let mut body = error_body(400, &refusal.message, refusal.param.as_deref());
        body["error"]["code"] = json!(refusal.code);
        return json_response(code, &body);
    }
    let (behaviour, release) = match gate(&shared, &arrival, Face::OpenAi).await {
        Ok(go) => go,
        Err(refused) => return refused,
    };
    let content = release.content.as_deref().or(behaviour.content.as_deref());
    let reply = responses::Reply::new(&request, arrival.seq, content);
    shared.count(
        &arrival,
        match (behaviour.garbage, behaviour.pad_bytes) {
            (Some(_), _) => Outcome::Garbage,
            (None, Some(_)) if reply.paddable() => Outcome::Padded,
            _ => Outcome::Completed,
        },
    );
    let delay = Duration::from_millis(behaviour.chunk_delay_ms);
    if let Some(kind) = behaviour.garbage {
        let garbled = responses::garbage(kind, &reply, stream);
        garbled_response(shared, garbled, delay, in_flight)
    } else if stream {
        let frames = responses::stream_frames(&reply, behaviour.pad_bytes);
        event_stream(shared, frames, delay, in_flight)
    } else {
        json_text(responses::plain_body(&reply, behaviour.pad_bytes))
    }
}

/// `POST /v1/messages` (Anthropic): count and record, refuse a request
/// without credentials (401) or that Anthropic would refuse (400) at once,
/// then hold, wait, fail, reset or answer as the behaviour says, in
/// Anthropic's shapes. Every answer has a `request-id` header.
async fn messages(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let in_flight = shared.in_flight();
    let (request, _) = request_of(&body);
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    let (arrival, refused) = anthropic_arrival(
        &shared,
        &headers,
        &request,
        anthropic::Kind::Messages,
        stream,
    );
    if let Some(refused) = refused {
        return refused;
    }
    let seq = arrival.seq;
    let (behaviour, release) = match gate(&shared, &arrival, Face::Anthropic).await {
        Ok(go) => go,
        Err(refused) => return refused,
    };

    let content = release.content.as_deref().or(behaviour.content.as_deref());
    let reply = Reply::new(&request, seq, content);
    shared.count(
        &arrival,
        match (behaviour.garbage, behaviour.pad_bytes) {
            (Some(_), _) => Outcome::Garbage,
            (None, Some(_)) if reply.paddable() => Outcome::Padded,
            _ => Outcome::Completed,
        },
    );
    let delay = Duration::from_millis(behaviour.chunk_delay_ms);
    let response = if let Some(kind) = behaviour.garbage {
        let garbled = anthropic::garbage(kind, &reply, stream);
        garbled_response(shared, garbled, delay, in_flight)
    } else if stream {
        let frames = anthropic::stream_frames(&reply, behaviour.pad_bytes);
        event_stream(shared, frames, delay, in_flight)
    } else {
        json_text(anthropic::plain_body(&reply, behaviour.pad_bytes))
    };
    with_request_id(response, seq)
}

/// `POST /v1/messages/count_tokens` (Anthropic): `{"input_tokens": N}`, N
/// as in a messages answer's usage. Counted, logged, held, delayed, failed
/// and reset like a messages call; `garbage`, `content`, `pad_bytes` and
/// `chunk_delay_ms` do not apply.
async fn count_tokens(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let _in_flight = shared.in_flight();
    let (request, _) = request_of(&body);
    let (arrival, refused) = anthropic_arrival(
        &shared,
        &headers,
        &request,
        anthropic::Kind::CountTokens,
        false,
    );
    if let Some(refused) = refused {
        return refused;
    }
    if let Err(refused) = gate(&shared, &arrival, Face::Anthropic).await {
        return refused;
    }
    shared.count(&arrival, Outcome::Completed);
    let body = json!({"input_tokens": anthropic::input_tokens(&request)});
    with_request_id(json_response(StatusCode::OK, &body), arrival.seq)
}

/// Counts and records an Anthropic call, then refuses it (counted) if it
/// has no credentials (401: neither a non-empty `x-api-key` nor an
/// `Authorization: Bearer` token) or a body Anthropic would refuse (400).
fn anthropic_arrival(
    shared: &Shared,
    headers: &HeaderMap,
    request: &Arc<Value>,
    kind: anthropic::Kind,
    stream: bool,
) -> (Arrival, Option<Response>) {
    let sent = sent_of(headers, None);
    let bearer = sent
        .authorization
        .as_deref()
        .and_then(|value| value.strip_prefix("Bearer "))
        .is_some_and(|token| !token.trim().is_empty());
    let unauthenticated = match sent.x_api_key.as_deref() {
        Some(key) if !key.is_empty() => None,
        _ if bearer => None,
        Some(_) => Some("invalid x-api-key"),
        None => Some("x-api-key header is required"),
    };
    let endpoint = match kind {
        anthropic::Kind::Messages => Endpoint::Messages,
        anthropic::Kind::CountTokens => Endpoint::CountTokens,
    };
    let arrival = shared.arrive(Incoming {
        endpoint,
        body: Arc::clone(request),
        sent,
        stream,
        items: 0,
    });
    let refused = if let Some(message) = unauthenticated {
        Some((401, message.to_owned()))
    } else {
        anthropic::validate(request, kind)
            .err()
            .map(|message| (400, message))
    };
    let refused = refused.map(|(status, message)| {
        shared.count(&arrival, Outcome::Failed(status));
        anthropic_error(status, &message, None, arrival.seq)
    });
    (arrival, refused)
}

/// An Anthropic error answer of call `seq`, with its `request-id`; an
/// invalid status code becomes 500.
fn anthropic_error(status: u16, message: &str, retry_after: Option<u64>, seq: u64) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = anthropic::error_body(code.as_u16(), message, seq);
    let mut response = json_response(code, &body);
    if let Some(seconds) = retry_after {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    with_request_id(response, seq)
}

/// `response` with the `request-id` header of call `seq`.
fn with_request_id(mut response: Response, seq: u64) -> Response {
    if let Ok(id) = HeaderValue::from_str(&anthropic::request_id(seq)) {
        response.headers_mut().insert("request-id", id);
    }
    response
}

/// Azure's error body: `{"error": {"code": "<status>", "message"}}`.
fn azure_error(status: u16, message: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let body = json!({"error": {"code": code.as_u16().to_string(), "message": message}});
    json_response(code, &body)
}

pub(super) const NOT_AN_OBJECT: &str = "mock: the body is not a JSON object";

/// The request as JSON (a JSON string holding the raw text if it is not
/// JSON), and whether it is a JSON object.
fn request_of(body: &[u8]) -> (Arc<Value>, bool) {
    let parsed = serde_json::from_slice::<Value>(body).ok();
    let valid = parsed.as_ref().is_some_and(Value::is_object);
    let request =
        parsed.unwrap_or_else(|| Value::String(String::from_utf8_lossy(body).into_owned()));
    (Arc::new(request), valid)
}

/// The headers of interest of a request, and the parts of its Azure URL.
pub(super) fn sent_of(headers: &HeaderMap, azure: Option<&Azure>) -> Sent {
    let header = |name: &str| {
        headers
            .get(name)
            .map(|value| String::from_utf8_lossy(value.as_bytes()).into_owned())
    };
    Sent {
        authorization: header(AUTHORIZATION.as_str()),
        x_api_key: header("x-api-key"),
        api_key: header("api-key"),
        anthropic_version: header("anthropic-version"),
        anthropic_beta: header("anthropic-beta"),
        openai_beta: header("openai-beta"),
        deployment: azure.map(|azure| azure.deployment.clone()),
        traceparent: header("traceparent"),
        api_version: azure.and_then(|azure| azure.api_version.clone()),
    }
}

/// Which provider's error body a failure takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Face {
    /// OpenAI's (also Azure's, for the failures the behaviour chooses).
    OpenAi,
    Anthropic,
}

/// The error answer of call `seq` with this status, in `face`'s shape.
fn failure(face: Face, status: u16, retry_after: Option<u64>, seq: u64) -> Response {
    match face {
        Face::OpenAi => error(status, "mock failure", retry_after),
        Face::Anthropic => anthropic_error(status, "mock failure", retry_after, seq),
    }
}

/// What every call goes through between its arrival and its answer: the
/// hold, the latency, then a failure or a reset if the release or the
/// behaviour chooses one (counted, as the `Err` response, in `face`'s
/// shape). `Ok` carries the behaviour of the moment and the release, for
/// the answer.
async fn gate(
    shared: &Shared,
    arrival: &Arrival,
    face: Face,
) -> Result<(Arc<Behaviour>, Release), Response> {
    let behaviour = shared.behaviour();
    let release = if behaviour.hold || behaviour.hang {
        shared.hold(arrival).await
    } else {
        Release::default()
    };
    // Read again: a test may change the behaviour while requests are held,
    // and released requests follow the behaviour of the moment they resume.
    let behaviour = shared.behaviour();
    pause(shared, delay(&behaviour)).await;

    if let Some(status) = release.status {
        shared.count(arrival, Outcome::Failed(status));
        return Err(failure(face, status, behaviour.retry_after, arrival.seq));
    }
    // A release that chose the content chose success: no random failure.
    if release.content.is_none() {
        if chance(behaviour.reset_rate) {
            shared.count(arrival, Outcome::Reset);
            return Err(connection_reset());
        }
        if let Some(status) = drawn_failure(&behaviour) {
            shared.count(arrival, Outcome::Failed(status));
            return Err(failure(face, status, behaviour.retry_after, arrival.seq));
        }
    }
    Ok((behaviour, release))
}

/// The status `behaviour` fails a call with, if it draws a failure:
/// `fail_status` with probability `fail_rate` (0 meaning always).
pub(super) fn drawn_failure(behaviour: &Behaviour) -> Option<u16> {
    let status = behaviour.fail_status?;
    let rate = if behaviour.fail_rate > 0.0 {
        behaviour.fail_rate
    } else {
        1.0
    };
    chance(rate).then_some(status)
}

/// A garbled 200: streamed frame by frame if it is an SSE body, else in one.
fn garbled_response(
    shared: Arc<Shared>,
    garbled: Garbled,
    delay: Duration,
    in_flight: InFlight,
) -> Response {
    if garbled.is_stream() {
        return event_stream(shared, garbled.frames, delay, in_flight);
    }
    let body: Vec<u8> = garbled.frames.concat();
    (
        StatusCode::OK,
        [(CONTENT_TYPE, HeaderValue::from_static(garbled.content_type))],
        body,
    )
        .into_response()
}

/// A 200 with a JSON body.
fn json_text(body: String) -> Response {
    (
        StatusCode::OK,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body,
    )
        .into_response()
}

/// An SSE answer sent frame by frame, `delay` apart; `in_flight` stays
/// counted until the last frame is out.
fn event_stream(
    shared: Arc<Shared>,
    frames: Vec<Bytes>,
    delay: Duration,
    in_flight: InFlight,
) -> Response {
    let state = (frames.into_iter(), true, shared, in_flight);
    let body = futures_util::stream::unfold(
        state,
        move |(mut frames, first, shared, in_flight)| async move {
            let frame = frames.next()?;
            if !first {
                pause(&shared, delay).await;
            }
            Some((
                Ok::<_, Infallible>(frame),
                (frames, false, shared, in_flight),
            ))
        },
    );
    (
        [
            (CONTENT_TYPE, HeaderValue::from_static("text/event-stream")),
            (CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::from_stream(body),
    )
        .into_response()
}

/// A response whose body fails before its first byte: hyper then closes the
/// connection without having written the status line, so the client sees a
/// connection error (reqwest: `send()` fails, "connection closed before
/// message completed"), never a status.
fn connection_reset() -> Response {
    let body = futures_util::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("mock upstream: reset on purpose"))
    });
    Body::from_stream(body).into_response()
}

/// An OpenAI error answer; an invalid status code becomes 500.
fn error(status: u16, message: &str, retry_after: Option<u64>) -> Response {
    error_with_param(status, message, None, retry_after)
}

/// [`error`] naming the request field at fault.
fn error_with_param(
    status: u16,
    message: &str,
    param: Option<&str>,
    retry_after: Option<u64>,
) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = json_response(code, &error_body(code.as_u16(), message, param));
    if let Some(seconds) = retry_after {
        response
            .headers_mut()
            .insert(RETRY_AFTER, HeaderValue::from(seconds));
    }
    response
}

pub(super) fn json_response(status: StatusCode, value: &Value) -> Response {
    (
        status,
        [(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        value.to_string(),
    )
        .into_response()
}

/// How long one call waits before answering: the latency, its jitter, and a
/// stall if one is drawn.
fn delay(behaviour: &Behaviour) -> Duration {
    let jitter = if behaviour.latency_jitter_ms > 0 {
        rand::random_range(0..=behaviour.latency_jitter_ms)
    } else {
        0
    };
    let stall = if chance(behaviour.stall_rate) {
        behaviour.stall_ms
    } else {
        0
    };
    Duration::from_millis(
        behaviour
            .latency_ms
            .saturating_add(jitter)
            .saturating_add(stall),
    )
}

/// True with probability `p` (never for `p <= 0`, always for `p >= 1`).
fn chance(p: f64) -> bool {
    p > 0.0 && rand::random::<f64>() < p
}

/// Sleeps for `duration`, cut short by shutdown.
async fn pause(shared: &Shared, duration: Duration) {
    if duration.is_zero() {
        return;
    }
    tokio::select! {
        () = tokio::time::sleep(duration) => {}
        () = shared.shutdown.cancelled() => {}
    }
}

/// `GET /` and `HEAD /`: 200, for clients that preconnect (Claude Code
/// sends `HEAD /` first). Not counted as a call.
async fn root() -> Response {
    json_response(StatusCode::OK, &json!({"mock": "idem mock-upstream"}))
}

/// `GET /v1/models`: a small fixed list.
async fn models() -> Response {
    let data: Vec<Value> = ["mock", "gpt-4o-mini", "gpt-4o"]
        .iter()
        .map(|id| json!({"id": id, "object": "model", "created": 1_700_000_000, "owned_by": "idem-mock"}))
        .collect();
    json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
}

async fn stats(State(shared): State<Arc<Shared>>) -> Response {
    json_of(&shared.stats())
}

/// `GET /_mock/calls`: every call since the start or the last reset.
async fn calls(State(shared): State<Arc<Shared>>) -> Response {
    json_of(&shared.calls())
}

/// `POST /_mock/reset`: answers the (zeroed) stats.
async fn reset(State(shared): State<Arc<Shared>>) -> Response {
    shared.reset();
    json_of(&shared.stats())
}

async fn get_behaviour(State(shared): State<Arc<Shared>>) -> Response {
    json_of(&*shared.behaviour())
}

/// `PUT /_mock/behaviour`: full replacement; missing fields take their
/// defaults (off / zero / none).
async fn put_behaviour(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    match parse::<Behaviour>(&body) {
        Ok(behaviour) => {
            shared.set_behaviour(behaviour);
            json_of(&*shared.behaviour())
        }
        Err(err) => bad_control_request(&err),
    }
}

/// `PATCH /_mock/behaviour`: merge; missing fields keep their current value,
/// `null` clears an optional one.
async fn patch_behaviour(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let patch = match parse::<serde_json::Map<String, Value>>(&body) {
        Ok(patch) => patch,
        Err(err) => return bad_control_request(&err),
    };
    let mut merged = match serde_json::to_value(&*shared.behaviour()) {
        Ok(Value::Object(current)) => current,
        _ => serde_json::Map::new(),
    };
    merged.extend(patch);
    match serde_json::from_value::<Behaviour>(Value::Object(merged)) {
        Ok(behaviour) => {
            shared.set_behaviour(behaviour);
            json_of(&*shared.behaviour())
        }
        Err(err) => error(400, &format!("mock: bad behaviour: {err}"), None),
    }
}

#[derive(Deserialize)]
struct HeldQuery {
    at_least: Option<usize>,
    timeout_ms: Option<u64>,
}

/// `GET /_mock/held?at_least=N&timeout_ms=T`: long-polls until N requests are
/// held; `{"held": [seq, ...]}`, with 408 if the timeout passed first.
async fn held(State(shared): State<Arc<Shared>>, Query(query): Query<HeldQuery>) -> Response {
    let at_least = query.at_least.unwrap_or(1);
    let timeout = Duration::from_millis(query.timeout_ms.unwrap_or(DEFAULT_HELD_TIMEOUT_MS));
    let reached = tokio::time::timeout(timeout, shared.wait_held(at_least))
        .await
        .unwrap_or(false);
    let status = if reached {
        StatusCode::OK
    } else {
        StatusCode::REQUEST_TIMEOUT
    };
    json_response(status, &json!({"held": shared.held()}))
}

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct ReleaseBody {
    seq: Option<u64>,
    /// A held provider batch's id.
    batch: Option<String>,
    status: Option<u16>,
    content: Option<String>,
}

/// `POST /_mock/release`: `{}` releases every held request and every held
/// provider batch, `{"seq": N}` just that request, `{"batch": ID}` just
/// that batch; `status` / `content` override how they answer (a batch's
/// every line). Answers `{"released": [seq, ...], "released_batches":
/// [id, ...]}`.
async fn release(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        ReleaseBody::default()
    } else {
        match parse::<ReleaseBody>(&body) {
            Ok(body) => body,
            Err(err) => return bad_control_request(&err),
        }
    };
    let release = Release {
        status: body.status,
        content: body.content,
    };
    let released = match (body.seq, &body.batch) {
        (None, Some(_)) => Vec::new(),
        (seq, _) => shared.release(seq, &release),
    };
    let released_batches = match (body.seq, body.batch.as_deref()) {
        (Some(_), None) => Vec::new(),
        (_, batch) => batches::release(&shared, batch, &release),
    };
    json_response(
        StatusCode::OK,
        &json!({"released": released, "released_batches": released_batches}),
    )
}

/// Any other path: OpenAI's 404, logged (at `warn`, with the method and
/// path) so a check can tell which requests of a client the mock does not
/// serve.
async fn not_found(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    tracing::warn!(%method, path = %uri.path(), "mock upstream: no such endpoint");
    let body = json!({"error": {
        "message": "mock: no such endpoint",
        "type": "invalid_request_error",
        "code": "unknown_url",
        "param": null,
    }});
    json_response(StatusCode::NOT_FOUND, &body)
}

fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, serde_json::Error> {
    serde_json::from_slice(body)
}

fn bad_control_request(err: &serde_json::Error) -> Response {
    error(400, &format!("mock: bad control request: {err}"), None)
}

fn json_of<T: serde::Serialize>(value: &T) -> Response {
    match serde_json::to_value(value) {
        Ok(value) => json_response(StatusCode::OK, &value),
        Err(err) => error(500, &format!("mock: cannot serialize: {err}"), None),
    }
}
