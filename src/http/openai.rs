//! The chat path's endpoints: `POST /v1/chat/completions`, and its other
//! faces `POST /v1/messages` and `POST /v1/responses` ([`super::faces`]);
//! and `GET /v1/models`.
//!
//! The handler is the request path (docs/design.md, "The request path"), one
//! stage per line: auth -> parse & validate -> route -> [Idempotency-Key?
//! -> job] -> fingerprint -> the core ([`Core::obtain`]: cache -> targets
//! -> flight -> provider). This file turns the request into the core's
//! [`Task`] and its [`Delivery`] into an HTTP answer in the form the client
//! asked for.
//!
//! [`Core::obtain`]: crate::task::Core::obtain

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Json;
use axum::body::Body;
use axum::extract::Request;
use axum::handler::Handler;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use futures_util::future::Either;
use futures_util::{FutureExt, TryFutureExt};
use serde_json::json;

use super::error::ApiError;
use super::faces::{self, Asked, Face, ResponsesAsk, Wants};
use super::validate::{self, ChatRequest};
use super::{AppState, Caller};
use crate::answer::{Answer, Form};
use crate::endpoints::chat::CHAT;
use crate::fingerprint::{self, Fingerprint};
use crate::flight::{Delivery, Flight, RequestBody, Source};
use crate::live::Live;
use crate::outcome::Outcome;
use crate::providers::Endpoint;
use crate::routes::{Route, Routes};
use crate::shapes::{messages, responses};
use crate::task::{CachePolicy, Count, Finish, Line, Task, TaskError};
use crate::telemetry::{self, Attribute, Trace, attr};

pub const IDEM_OUTCOME: HeaderName = HeaderName::from_static("idem-outcome");
pub const IDEM_FINGERPRINT: HeaderName = HeaderName::from_static("idem-fingerprint");
pub const IDEM_PROVIDER: HeaderName = HeaderName::from_static("idem-provider");
pub const IDEM_CACHE_TTL: HeaderName = HeaderName::from_static("idem-cache-ttl-ms");
pub const IDEM_WAIT: HeaderName = HeaderName::from_static("idem-wait-ms");
pub const IDEM_STALE: HeaderName = HeaderName::from_static("idem-stale");
pub const IDEM_USER: &str = "idem-user";

/// `POST /v1/chat/completions`: an axum [`Handler`] of its own rather than
/// an `async fn` with extractors. axum's wrapper for those keeps the
/// request's parts (its header map, URI, extensions) in the boxed future
/// until the handler returns, which for a coalesced follower is after its
/// whole wait; here the header map goes to [`admit`] and is dropped with
/// it, and the rest at once.
///
/// Two futures, one after the other: [`admit`] reads the request, and only
/// what it hands on lives in [`coalesce`], where a follower may wait a
/// long time. In a single `async fn` the arguments (the header map, the body
/// stream) would stay in every waiting request's state. The boxed future
/// fits jemalloc's 1,024-byte size class (a unit test keeps it there).
///
/// One handler serves each face of the chat path ([`Face`]): the face says
/// how the request is read and the answer (or error) rendered.
#[derive(Clone, Copy)]
pub struct ChatPath(pub Face);

/// The [`Handler`] marker of [`ChatPath`].
pub enum OwnHandler {}

impl Handler<OwnHandler, AppState> for ChatPath {
    type Future = Pin<Box<dyn Future<Output = Response> + Send>>;

    fn call(self, req: Request, app: AppState) -> Self::Future {
        let face = self.0;
        let handled = chat_completions(app, req, face).map(|r| r.unwrap_or_else(refusal_response));
        if face == Face::Messages {
            // Anthropic's clients read Anthropic's error shape.
            Box::pin(handled.then(faces::anthropic_error))
        } else {
            Box::pin(handled)
        }
    }
}

/// An error of idem's own as the client gets it. Its `Idem-Outcome` says
/// what happened to the request, the outcome it is counted under
/// (`rejected`, `wait-timeout`, `no-target`, `job-timeout`, `error`): a
/// request refused before any flight existed was neither a leader nor a
/// follower.
fn refusal_response(e: ApiError) -> Response {
    let refusal = e.refusal();
    let mut resp = e.into_response();
    resp.headers_mut()
        .insert(IDEM_OUTCOME, HeaderValue::from_static(refusal.as_str()));
    resp
}

fn chat_completions(
    app: AppState,
    req: Request,
    face: Face,
) -> impl Future<Output = Result<Response, ApiError>> {
    let (parts, body) = req.into_parts();
    let authenticated = if face == Face::Messages {
        Caller::authenticate_anthropic(&parts.headers, &app)
    } else {
        Caller::authenticate(&parts.headers, &app)
    };
    let caller = match authenticated {
        Ok(caller) => caller,
        Err(e) => return Either::Left(std::future::ready(Err(refused(&app, None, None, e)))),
    };
    if let Err(e) = caller.limit(&app) {
        let e = refused(&app, caller.tenant_name(), None, e);
        return Either::Left(std::future::ready(Err(e)));
    }
    Either::Right(admit(app, caller, parts.headers, body, face).and_then(
        |admitted| match admitted {
            Admitted::Answered(resp) => Either::Left(std::future::ready(Ok(resp))),
            Admitted::Coalesce(request) => Either::Right(coalesce(request)),
        },
    ))
}

/// What [`admit`] found a chat request to need.
enum Admitted {
    /// Answered already (the job path).
    Answered(Response),
    /// The request path after the fingerprint.
    Coalesce(Admission),
}

/// A chat request read, validated, routed and fingerprinted: all that
/// [`coalesce`] needs of it.
struct Admission {
    app: AppState,
    tenant: Arc<str>,
    route: Arc<Route>,
    fp: Fingerprint,
    body: RequestBody,
    policy: CachePolicy,
    /// The face it came in by and the form it wants (with `rare`).
    face: Face,
    stream: bool,
    include_usage: bool,
    started: Instant,
    /// What few requests have, boxed: a waiting request's state stays
    /// within its allocation class (see the test below).
    rare: Option<Box<Rare>>,
}

/// The parts of an [`Admission`] most requests do not have.
struct Rare {
    /// The request's span (traces on).
    trace: Option<Trace>,
    /// A Responses request's extras.
    responses: Option<Box<ResponsesAsk>>,
}

impl Admission {
    fn task(&self) -> Task<'_> {
        Task {
            tenant: &self.tenant,
            route: &self.route,
            fp: self.fp,
            body: &self.body,
            wire: &CHAT,
            policy: self.policy,
            trace: self.trace(),
        }
    }

    fn trace(&self) -> Option<&Trace> {
        self.rare.as_ref()?.trace.as_ref()
    }

    fn asked(&self) -> Asked<'_> {
        let responses = self.rare.as_ref().and_then(|r| r.responses.as_deref());
        faces::asked(self.face, self.stream, self.include_usage, responses)
    }
}

/// Counts a request that ends with `e` before it has a fingerprint (every
/// request is counted, its refusals too), under its tenant and route as far
/// as they are known.
fn refused(
    app: &AppState,
    tenant: Option<&Arc<str>>,
    route: Option<&Arc<str>>,
    e: ApiError,
) -> ApiError {
    app.core.finish(Finish {
        tenant,
        route,
        count: (!e.counted_by_its_job()).then(|| Count::Refused(e.refusal())),
        line: None,
        ..Finish::default()
    });
    e
}

/// Auth, parse and validate, route, fingerprint; a request with an
/// `Idempotency-Key` goes the job path from here. A request refused here
/// is counted here (one that goes the job path and is answered, by the
/// job path).
async fn admit(
    app: AppState,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
    face: Face,
) -> Result<Admitted, ApiError> {
    let started = Instant::now();
    let tenant = caller.tenant().map_err(|e| refused(&app, None, None, e))?;
    let Read {
        req,
        raw,
        wants,
        face_doc,
    } = read_request(&app, &tenant, &headers, body, caller.body_limit(&app), face)
        .await
        .map_err(|e| refused(&app, Some(&tenant), None, e))?;
    let trace = request_trace(&app, face.as_str(), &req.model, &headers);
    let (route, fp) = match route_chat(&caller.live, &tenant, &req, &headers, face_doc.as_ref()) {
        Ok(routed) => routed,
        Err(e) => {
            // Counted under the route when the model names one.
            let route = caller.live.route(&req.model).map(|r| r.name.clone());
            return Err(refused(&app, Some(&tenant), route.as_ref(), e));
        }
    };
    let key = super::jobs::idempotency_key(&headers)
        .map_err(|e| refused(&app, Some(&tenant), Some(&route.name), e))?;
    if let Some(key) = key {
        // Boxed: the job path's state would otherwise enlarge every chat
        // request's future, coalesced followers' included.
        let job = Box::pin(super::jobs::chat(
            &app,
            &tenant,
            &route,
            super::jobs::Asking {
                req,
                wants,
                face: face_doc,
                fp,
            },
            key,
            started,
            trace,
        ));
        return match job.await {
            Ok(resp) => Ok(Admitted::Answered(resp)),
            Err(e) => Err(refused(&app, Some(&tenant), Some(&route.name), e)),
        };
    }
    Ok(Admitted::Coalesce(Admission {
        policy: cache_policy(&headers),
        body: match raw {
            // A follower lets the parse go while it waits (see `RequestBody`).
            Some(raw) => RequestBody::from_bytes(req.body, raw),
            // A translated request has no bytes of its own to parse again.
            None => RequestBody::kept(req.body),
        },
        app,
        tenant,
        route,
        fp,
        face: wants.face,
        stream: wants.stream,
        include_usage: wants.include_usage,
        started,
        rare: (trace.is_some() || wants.responses.is_some()).then(|| {
            Box::new(Rare {
                trace,
                responses: wants.responses,
            })
        }),
    }))
}

/// A request of any face, read and checked as the chat request it asks.
struct Read {
    req: ChatRequest,
    /// The bytes a chat request was parsed from (None: translated).
    raw: Option<Bytes>,
    wants: Wants,
    /// What the face adds to the fingerprint (None: chat completions).
    face_doc: Option<serde_json::Value>,
}

/// Reads and checks a request of `face`: a chat request as sent, or a
/// Messages or Responses request translated into one (a Responses request
/// that continues a stored one gets its earlier turns from the store).
async fn read_request(
    app: &AppState,
    tenant: &str,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    face: Face,
) -> Result<Read, ApiError> {
    let bytes = validate::read_body(body, content_length(headers), limit).await?;
    let object = validate::parse_object(&bytes, app.limits.max_json_depth)?;
    match face {
        Face::Chat => {
            let req = validate::chat_request(object, &app.limits)?;
            Ok(Read {
                wants: Wants {
                    face,
                    stream: req.stream,
                    include_usage: req.include_usage,
                    responses: None,
                },
                req,
                raw: Some(bytes),
                face_doc: None,
            })
        }
        Face::Messages => {
            let mut translated = messages::to_chat(&object)?;
            // Kept for Anthropic targets, which get it as sent.
            translated
                .chat
                .insert(messages::ORIGINAL.into(), messages::original(&object));
            let req = validate::chat_request(translated.chat, &app.limits)?;
            Ok(Read {
                wants: Wants {
                    face,
                    stream: req.stream,
                    include_usage: false,
                    responses: None,
                },
                req,
                raw: None,
                face_doc: Some(json!({"face": "messages"})),
            })
        }
        Face::Responses => {
            let previous = match object.get("previous_response_id") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(id)) => Some(id.clone()),
                Some(_) => {
                    return Err(ApiError::bad_request(
                        "`previous_response_id` must be a string",
                        "invalid_type",
                        Some("previous_response_id"),
                    ));
                }
            };
            let history = match &previous {
                None => Vec::new(),
                Some(id) => previous_turns(app, tenant, id).await?,
            };
            let mut translated = responses::to_chat(&object, &history)?;
            // Kept for providers that speak the Responses API.
            translated.chat.insert(
                responses::ORIGINAL.into(),
                responses::native(&object, &history),
            );
            let store = translated.store.unwrap_or(true);
            let mut turns = history;
            turns.extend(translated.turns);
            let req = validate::chat_request(translated.chat, &app.limits)?;
            Ok(Read {
                wants: Wants {
                    face,
                    stream: req.stream,
                    include_usage: false,
                    responses: Some(Box::new(ResponsesAsk {
                        stream: req.stream,
                        echo: responses::Echo::of(&object),
                        store,
                        turns,
                    })),
                },
                req,
                raw: None,
                face_doc: Some(json!({"face": "responses", "previous_response_id": previous})),
            })
        }
    }
}

/// The conversation a stored response continues, as chat messages: 404
/// when this tenant kept none by that id (another tenant's included).
async fn previous_turns(
    app: &AppState,
    tenant: &str,
    id: &str,
) -> Result<Vec<serde_json::Value>, ApiError> {
    let Some(kept) = app.store.response(tenant, id).await? else {
        return Err(ApiError::NotFound("previous response"));
    };
    match serde_json::from_str(&kept.turns) {
        Ok(serde_json::Value::Array(turns)) => Ok(turns),
        _ => Err(ApiError::Internal(anyhow::anyhow!(
            "stored response {id} has unreadable turns"
        ))),
    }
}

/// A request's span, when traces are on: `{operation} {model}`, under the
/// client's `traceparent` if it sent one.
pub fn request_trace(
    app: &AppState,
    operation: &'static str,
    model: &str,
    headers: &HeaderMap,
) -> Option<Trace> {
    let telemetry = &app.core.telemetry;
    if !telemetry.is_on() {
        return None;
    }
    let carried: Vec<(&str, &str)> = ["traceparent", "tracestate"]
        .into_iter()
        .filter_map(|k| Some((k, headers.get(k)?.to_str().ok()?)))
        .collect();
    let trace = telemetry.request(telemetry::span_name(operation, model), &carried)?;
    trace.set(vec![
        Attribute::new(attr::OPERATION, operation),
        Attribute::new(attr::REQUEST_MODEL, model.to_string()),
    ]);
    Some(trace)
}

/// The core (cache, targets, flight, provider), then [`reply`]: two
/// futures, one after the other, so that the reply's state is not added to
/// a waiting one's.
fn coalesce(a: Admission) -> impl Future<Output = Result<Response, ApiError>> {
    async move {
        let obtained = a.app.core.obtain(&a.task()).await;
        (a, obtained)
    }
    .then(|(a, obtained)| reply(a, obtained))
}

/// The answer in the form the client asked for; the request is counted and
/// logged by the core's finish step.
async fn reply(a: Admission, obtained: Result<Delivery, TaskError>) -> Result<Response, ApiError> {
    let (resp, count, source) = match obtained {
        Ok(delivery) => {
            if let Asked::Responses(r) = a.asked()
                && r.store
            {
                // Boxed: only these requests carry its state.
                Box::pin(keep_response(
                    &a.app,
                    &a.tenant,
                    &a.fp,
                    r,
                    delivery.source.clone(),
                ))
                .await;
            }
            let resp = respond(&delivery, &a.fp, a.asked()).await;
            (
                resp,
                Count::Answered(delivery.outcome),
                Some(delivery.source),
            )
        }
        Err(e) => {
            let e = ApiError::from(e);
            let refusal = e.refusal();
            let mut resp = refusal_response(e);
            if let Ok(v) = HeaderValue::from_str(&a.fp.to_string()) {
                resp.headers_mut().insert(IDEM_FINGERPRINT, v);
            }
            (resp, Count::Refused(refusal), None)
        }
    };
    let outcome = match count {
        Count::Answered(o) => o.as_str(),
        Count::Refused(r) => r.as_str(),
    };
    a.app.core.finish(Finish {
        tenant: Some(&a.tenant),
        route: Some(&a.route.name),
        count: Some(count),
        line: Some(Line {
            fp: a.fp,
            endpoint: a.face.as_str(),
            outcome,
            status: resp.status().as_u16(),
            started: a.started,
            job: None,
            body: Some(&a.body),
            answer: source,
            answer_of_job: None,
            usage: None,
        }),
        priced: Some(&a.route),
        trace: a.trace(),
        ..Finish::default()
    });
    Ok(resp)
}

/// Keeps a Responses answer (`store: true`) once it is whole. A plain
/// answer is kept before the client gets it, so that a `GET` (or a
/// continuation) right after finds it; a streamed one beside its relay, as
/// it ends.
pub async fn keep_response(
    app: &AppState,
    tenant: &Arc<str>,
    fp: &Fingerprint,
    asked: &ResponsesAsk,
    source: Source,
) {
    let keeping = keeping(app, tenant, fp, asked, source);
    if asked.stream {
        tokio::spawn(keeping);
    } else {
        keeping.await;
    }
}

fn keeping(
    app: &AppState,
    tenant: &Arc<str>,
    fp: &Fingerprint,
    asked: &ResponsesAsk,
    source: Source,
) -> impl Future<Output = ()> + Send + 'static {
    let app = app.clone();
    let tenant = tenant.to_string();
    let fp = *fp;
    let echo = asked.echo.clone();
    let turns = asked.turns.clone();
    async move {
        let answer = match source {
            Source::Done(a) => a,
            Source::Live(f) => match f.done(None).await {
                Some(a) => a,
                None => return,
            },
        };
        let asked = ResponsesAsk {
            stream: false,
            echo,
            store: true,
            turns,
        };
        let Some((id, body, turns)) = faces::stored(&asked, &fp, &answer) else {
            return;
        };
        let kept = crate::store::StoredResponse {
            tenant,
            id,
            body: body.to_string(),
            turns: serde_json::Value::Array(turns).to_string(),
            created_at: crate::store::now_ms(),
        };
        if let Err(e) = app.kept.keep(&*app.store, &kept).await {
            tracing::warn!(error = %e, response = %kept.id, "cannot keep a stored response");
        }
    }
}

/// The 404 for a model no route serves, listing the models that serve
/// `endpoint` (every tenant may use every route).
pub fn unknown_model(routes: &Routes, model: &str, endpoint: Endpoint) -> ApiError {
    ApiError::ModelNotFound {
        model: model.to_string(),
        available: Some(
            routes
                .iter()
                .filter(|r| r.serves(endpoint))
                .map(|r| r.name.to_string())
                .collect(),
        ),
    }
}

pub fn not_served(model: &str, endpoint: &str) -> ApiError {
    ApiError::bad_request(
        format!("model `{model}` does not serve {endpoint}"),
        "model_not_supported",
        Some("model"),
    )
}

pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
}

/// A checked chat request's route (one that serves chat completions) and
/// its fingerprint under the route's rules, with what its face adds: the
/// stage the plain path and the jobs API share.
pub fn route_chat(
    live: &Live,
    tenant: &str,
    req: &ChatRequest,
    headers: &HeaderMap,
    face: Option<&serde_json::Value>,
) -> Result<(Arc<Route>, Fingerprint), ApiError> {
    let Some(route) = live.route(&req.model) else {
        return Err(unknown_model(&live.routes, &req.model, Endpoint::Chat));
    };
    if !route.serves(Endpoint::Chat) {
        return Err(not_served(&req.model, "chat completions"));
    }
    let user = headers.get(IDEM_USER).and_then(|v| v.to_str().ok());
    let rules = fingerprint::Rules {
        face,
        ..route.rules(tenant)
    };
    let fp = fingerprint::fingerprint(&req.body, user, &rules);
    Ok((route, fp))
}

/// What `Cache-Control` allows for this request: `no-cache` skips reading
/// the result cache (still coalesces, still stores the fresh answer);
/// `no-store`: no cache and no coalescing.
pub fn cache_policy(headers: &HeaderMap) -> CachePolicy {
    let mut p = CachePolicy::default();
    for value in headers.get_all(header::CACHE_CONTROL) {
        let Ok(v) = value.to_str() else { continue };
        for directive in v.split(',').map(|d| d.trim().to_ascii_lowercase()) {
            match directive.as_str() {
                "no-cache" => p.read = false,
                "no-store" => {
                    p.read = false;
                    p.write = false;
                    p.coalesce = false;
                }
                _ => {}
            }
        }
    }
    p
}

/// Turns a delivery into the HTTP answer the client asked for.
pub async fn respond(d: &Delivery, fp: &Fingerprint, asked: Asked<'_>) -> Response {
    let mut resp = match &d.source {
        Source::Live(flight) if asked.stream() && flight_streams(flight).await => match asked {
            Asked::Chat { include_usage, .. } => live_response(flight.clone(), include_usage),
            _ => match faces::live_response(asked, fp, flight.clone()) {
                Some(r) => r,
                None => render(&*d.answer().await, asked, fp),
            },
        },
        _ => render(&*d.answer().await, asked, fp),
    };
    let answer = match &d.source {
        Source::Done(a) => Some(a.clone()),
        Source::Live(f) => f.answer(),
    };
    decorate(resp.headers_mut(), d.outcome, fp, answer.as_deref());
    let h = resp.headers_mut();
    if let Some(w) = d.waited {
        h.insert(
            IDEM_WAIT,
            HeaderValue::from(u64::try_from(w.as_millis()).unwrap_or(u64::MAX)),
        );
    }
    if let Some(age) = d.cache_age {
        h.insert(header::AGE, HeaderValue::from(age.as_secs()));
    }
    if d.stale {
        h.insert(IDEM_STALE, HeaderValue::from_static("true"));
    }
    resp
}

async fn flight_streams(flight: &Flight) -> bool {
    flight
        .head(None)
        .await
        .is_some_and(|h| h.form == Form::Stream && h.status.is_success())
}

/// The `Idem-*` headers every chat completion answer carries.
pub fn decorate(h: &mut HeaderMap, outcome: Outcome, fp: &Fingerprint, answer: Option<&Answer>) {
    h.insert(IDEM_OUTCOME, HeaderValue::from_static(outcome.as_str()));
    if let Ok(v) = HeaderValue::from_str(&fp.to_string()) {
        h.insert(IDEM_FINGERPRINT, v);
    }
    if let Some(a) = answer {
        if let Ok(v) = HeaderValue::from_str(&a.provider) {
            h.insert(IDEM_PROVIDER, v);
        }
        if let Some(ttl) = a.cache_ttl {
            h.insert(
                IDEM_CACHE_TTL,
                HeaderValue::from(u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX)),
            );
        }
    }
}

/// A finished answer in the form and shape the asker wants.
pub fn render(answer: &Answer, asked: Asked<'_>, fp: &Fingerprint) -> Response {
    if !answer.is_success() {
        // Errors are JSON whatever the client asked for, as OpenAI does
        // (the Messages face gives them Anthropic's shape on the way out).
        return json_response(answer.body.clone(), answer.status, answer.retry_after);
    }
    let Asked::Chat {
        stream: wants_stream,
        include_usage,
    } = asked
    else {
        return faces::render_success(asked, fp, answer).unwrap_or_else(|| {
            json_response(
                Bytes::from(
                    crate::answer::error_body(
                        "the upstream answer is not a chat completion",
                        "upstream_error",
                        "bad_upstream_answer",
                        None,
                    )
                    .to_string(),
                ),
                StatusCode::BAD_GATEWAY,
                None,
            )
        });
    };
    if wants_stream {
        return sse_response(Body::from(answer.stream_body(include_usage)));
    }
    match answer.plain_body() {
        Ok(plain) => json_response(plain, StatusCode::OK, None),
        // A success whose stream cannot be assembled is no answer for a
        // plain request (the completion check keeps such answers out; this
        // is its last line): a 502, never a 200 with an error body.
        Err(error) => json_response(error, StatusCode::BAD_GATEWAY, None),
    }
}

pub(super) fn json_response(
    body: Bytes,
    status: StatusCode,
    retry_after: Option<Duration>,
) -> Response {
    let mut r = Response::new(Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(ra) = retry_after {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(ra.as_secs()));
    }
    r
}

pub(super) fn sse_response(body: Body) -> Response {
    let mut r = Response::new(body);
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

/// Relays a streaming flight: everything buffered so far, then live. The
/// leader's call asked the provider for usage (see `endpoints::chat`); a
/// client that did not ask for it gets the stream without its usage chunk.
fn live_response(flight: Arc<Flight>, include_usage: bool) -> Response {
    let rx = flight.subscribe();
    let stream = futures_util::stream::unfold(
        (flight, rx, 0usize, false),
        move |(flight, mut rx, next, ended)| async move {
            if ended {
                return None;
            }
            loop {
                let (chunks, done) = flight.chunks_from(next);
                if !chunks.is_empty() {
                    let n = chunks.len();
                    let mut bytes = concat(chunks);
                    if !include_usage && let Some(fewer) = crate::sse::without_usage(&bytes) {
                        bytes = fewer;
                    }
                    return Some((Ok::<_, Infallible>(bytes), (flight, rx, next + n, false)));
                }
                if let Some(answer) = done {
                    if answer.failure.is_some() {
                        // The stream broke after it began: tell the client in
                        // the stream, as providers do, instead of a silent cut.
                        let event = Bytes::from(format!(
                            "data: {}\n\n",
                            String::from_utf8_lossy(&answer.body)
                        ));
                        return Some((Ok(event), (flight, rx, next, true)));
                    }
                    return None;
                }
                if rx.changed().await.is_err() {
                    return None;
                }
            }
        },
    );
    sse_response(Body::from_stream(stream))
}

fn concat(chunks: Vec<Bytes>) -> Bytes {
    if chunks.len() == 1 {
        return chunks.into_iter().next().unwrap_or_default();
    }
    let mut buf = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
    for c in chunks {
        buf.extend_from_slice(&c);
    }
    buf.freeze()
}

/// `GET /v1/models`: the routes' public model names, each with the
/// endpoints it serves (`chat.completions`, `messages`, `responses`,
/// `embeddings`).
pub async fn models(caller: Caller) -> Result<Json<serde_json::Value>, ApiError> {
    caller.tenant()?;
    let data: Vec<_> = caller
        .live
        .routes
        .iter()
        .map(|r| {
            // The Messages and Responses faces run the chat path: a route
            // that serves chat completions serves them too.
            let endpoints: Vec<&str> = [
                (Endpoint::Chat, "chat.completions"),
                (Endpoint::Chat, "messages"),
                (Endpoint::Chat, "responses"),
                (Endpoint::Embeddings, "embeddings"),
            ]
            .into_iter()
            .filter(|(e, _)| r.serves(*e))
            .map(|(_, name)| name)
            .collect();
            json!({"id": r.name.as_ref(), "object": "model", "created": 0, "owned_by": "idem", "endpoints": endpoints})
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of the future that `f` returns.
    fn future_size<F: FnOnce(A, B) -> R, A, B, R>(_: &F) -> usize {
        size_of::<R>()
    }

    /// A chat request keeps this future, boxed, for as long as it waits: a
    /// follower behind a slow leader for seconds, thousands of them at once.
    /// jemalloc's size classes here are 896, 1,024 and 1,280 bytes: over
    /// 1,024 the box costs a quarter more per waiting request (2.5 MiB for
    /// 10,000). The bound is the allocator's, not the compiler's: if a
    /// change or a new compiler crosses it, look for a value kept across
    /// an `.await` that could be read again after it.
    #[test]
    fn a_chat_requests_boxed_future_fits_in_1024_bytes() {
        let boxed = future_size(&|app: AppState, req: Request| {
            chat_completions(app, req, Face::Chat).map(|r| r.unwrap_or_else(refusal_response))
        });
        assert!(boxed <= 1024, "the chat handler's future is {boxed} bytes");
    }
}
