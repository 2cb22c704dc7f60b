//! The conversation path's endpoints: `POST /v1/chat/completions`,
//! `POST /v1/messages` (and its token count) and `POST /v1/responses`, one
//! handler for every dialect; and `GET /v1/models`.
//!
//! The handler is the request path (docs/design.md, "The request path"), one
//! stage per line: auth -> parse & validate -> route -> [Idempotency-Key?
//! -> job] -> fingerprint -> the core ([`Core::obtain`]: cache -> targets
//! -> flight -> provider). This file turns the request into the core's
//! [`Task`], in its own dialect, and its [`Delivery`] into an HTTP answer
//! in the form the client asked for ([`super::faces`]).
//!
//! [`Core::obtain`]: crate::task::Core::obtain

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
use bytes::Bytes;
use futures_util::future::Either;
use futures_util::{FutureExt, TryFutureExt};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::faces::{self, Asked};
use super::responses::ResponsesAsk;
use super::validate::{self, ChatRequest};
use super::{AppState, Caller};
use crate::answer::Answer;
use crate::budgets::Payer;
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::{self, Fingerprint};
use crate::flight::{Delivery, RequestBody, Source};
use crate::live::Live;
use crate::outcome::Outcome;
use crate::routes::{Route, Routes};
use crate::task::{CachePolicy, Count, Finish, Line, Task, TaskError};
use crate::telemetry::{self, Attribute, Trace, attr};

pub const IDEM_OUTCOME: HeaderName = HeaderName::from_static("idem-outcome");
pub const IDEM_FINGERPRINT: HeaderName = HeaderName::from_static("idem-fingerprint");
pub const IDEM_PROVIDER: HeaderName = HeaderName::from_static("idem-provider");
pub const IDEM_CACHE_TTL: HeaderName = HeaderName::from_static("idem-cache-ttl-ms");
pub const IDEM_WAIT: HeaderName = HeaderName::from_static("idem-wait-ms");
pub const IDEM_STALE: HeaderName = HeaderName::from_static("idem-stale");
pub const IDEM_USER: &str = "idem-user";

/// `POST /v1/chat/completions`, `/v1/messages`, `/v1/messages/count_tokens`
/// and `/v1/responses`: an axum [`Handler`] of its own rather than an
/// `async fn` with extractors. axum's wrapper for those keeps the request's
/// parts (its header map, URI, extensions) in the boxed future until the
/// handler returns, which for a coalesced follower is after its whole
/// wait; here the header map goes to [`admit`] and is dropped with it, and
/// the rest at once.
///
/// Two futures, one after the other: [`admit`] reads the request, and only
/// what it hands on lives in [`coalesce`], where a follower may wait a
/// long time. In a single `async fn` the arguments (the header map, the body
/// stream) would stay in every waiting request's state. The boxed future
/// fits jemalloc's 1,024-byte size class (a unit test keeps it there).
///
/// One handler serves each dialect: the dialect says how the request is
/// read and checked; its answer comes back in the same dialect.
#[derive(Clone, Copy)]
pub struct ChatPath(pub Dialect);

/// The [`Handler`] marker of [`ChatPath`].
pub enum OwnHandler {}

impl Handler<OwnHandler, AppState> for ChatPath {
    type Future = Pin<Box<dyn Future<Output = Response> + Send>>;

    fn call(self, req: Request, app: AppState) -> Self::Future {
        let dialect = self.0;
        let handled = conversation(app, req, dialect).map(|r| r.unwrap_or_else(refusal_response));
        if is_anthropic(dialect) {
            // Anthropic's clients read Anthropic's error shape.
            Box::pin(handled.then(faces::anthropic_error))
        } else {
            Box::pin(handled)
        }
    }
}

/// True for the dialects of Anthropic's clients: their key may come as
/// `x-api-key`, and their errors go in Anthropic's shape.
fn is_anthropic(dialect: Dialect) -> bool {
    matches!(dialect, Dialect::Messages | Dialect::CountTokens)
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

fn conversation(
    app: AppState,
    req: Request,
    dialect: Dialect,
) -> impl Future<Output = Result<Response, ApiError>> {
    let (parts, body) = req.into_parts();
    let authenticated = if is_anthropic(dialect) {
        Caller::authenticate_anthropic(&parts.headers, &app)
    } else {
        Caller::authenticate(&parts.headers, &app)
    };
    let caller = match authenticated {
        Ok(caller) => caller,
        Err(e) => return Either::Left(std::future::ready(Err(refused(&app, None, None, e)))),
    };
    if let Err(e) = caller.limit_tenant(&app) {
        let e = refused(&app, caller.tenant_name(), None, e);
        return Either::Left(std::future::ready(Err(e)));
    }
    Either::Right(
        admit(app, caller, parts.headers, body, dialect).and_then(|admitted| match admitted {
            Admitted::Answered(resp) => Either::Left(std::future::ready(Ok(resp))),
            Admitted::Coalesce(request) => Either::Right(coalesce(request)),
        }),
    )
}

/// What [`admit`] found a chat request to need.
enum Admitted {
    /// Answered already (the job path).
    Answered(Response),
    /// The request path after the fingerprint.
    Coalesce(Admission),
}

/// A request read, validated, routed and fingerprinted: all that
/// [`coalesce`] needs of it.
struct Admission {
    app: AppState,
    tenant: Arc<str>,
    route: Arc<Route>,
    fp: Fingerprint,
    body: RequestBody,
    policy: CachePolicy,
    /// The dialect it came in and the form it wants.
    asked: Asked,
    /// When it arrived (8 bytes: a waiting request's state stays within
    /// its allocation class, see the test below).
    started: Since,
    /// What few requests have, boxed: a waiting request's state stays
    /// within its allocation class (see the test below).
    rare: Option<Box<Rare>>,
}

/// An instant as nanoseconds since the process's first one: half the size
/// of an `Instant`.
#[derive(Clone, Copy)]
struct Since(u64);

/// The instant every [`Since`] counts from.
static EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

impl Since {
    fn of(at: Instant) -> Since {
        let nanos = at.saturating_duration_since(*EPOCH).as_nanos();
        Since(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    fn instant(self) -> Instant {
        *EPOCH + Duration::from_nanos(self.0)
    }
}

/// The parts of an [`Admission`] most requests do not have.
struct Rare {
    /// The request's span (traces on).
    trace: Option<Trace>,
    /// A Responses request's extras.
    responses: Option<Box<ResponsesAsk>>,
    /// Who pays for a call the request leads (a key of the store, a tenant
    /// with a budget).
    payer: Option<Payer>,
}

impl Admission {
    fn task(&self) -> Task<'_> {
        Task {
            tenant: &self.tenant,
            route: &self.route,
            fp: self.fp,
            body: &self.body,
            wire: crate::endpoints::wire(self.asked.dialect),
            policy: self.policy,
            trace: self.trace(),
            payer: self.rare.as_ref().and_then(|r| r.payer.as_ref()),
        }
    }

    fn trace(&self) -> Option<&Trace> {
        self.rare.as_ref()?.trace.as_ref()
    }

    fn responses(&self) -> Option<&ResponsesAsk> {
        self.rare.as_ref()?.responses.as_deref()
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
    dialect: Dialect,
) -> Result<Admitted, ApiError> {
    let started = Instant::now();
    let tenant = caller.tenant().map_err(|e| refused(&app, None, None, e))?;
    if caller.key.is_some() {
        // Boxed: only keys of the store have windows, and their wait (a
        // Redis round trip) would otherwise enlarge every request's
        // future.
        Box::pin(caller.limit_key(&app))
            .await
            .map_err(|e| refused(&app, Some(&tenant), None, e))?;
    }
    let Read {
        req,
        raw,
        responses,
        send,
    } = read_request(
        &app,
        &tenant,
        &headers,
        body,
        caller.body_limit(&app),
        dialect,
    )
    .await
    .map_err(|e| refused(&app, Some(&tenant), None, e))?;
    let trace = request_trace(&app, dialect.as_str(), &req.model, &headers);
    let forwarded = forwarded(dialect, &headers);
    let (route, fp) =
        match route_request(&caller.live, &tenant, dialect, &req, &headers, &forwarded) {
            Ok(routed) => routed,
            Err(e) => {
                // Counted under the route when the model names one.
                let route = caller.live.route(&req.model).map(|r| r.name.clone());
                return Err(refused(&app, Some(&tenant), route.as_ref(), e));
            }
        };
    caller
        .may_use(&route)
        .map_err(|e| refused(&app, Some(&tenant), Some(&route.name), e))?;
    let asked = Asked {
        dialect,
        stream: req.stream,
        include_usage: req.include_usage,
    };
    let key = super::jobs::idempotency_key(&headers)
        .map_err(|e| refused(&app, Some(&tenant), Some(&route.name), e))?;
    if let Some(key) = key {
        // Boxed: the job path's state would otherwise enlarge every
        // request's future, coalesced followers' included.
        let job = Box::pin(super::jobs::chat(
            &app,
            &tenant,
            &route,
            super::jobs::Asking {
                send: send
                    .map(|s| Arc::new(*s))
                    .unwrap_or_else(|| req.body.clone()),
                req,
                asked,
                forwarded,
                responses,
                fp,
                key_id: caller.key.as_ref().map(|k| k.id.clone()),
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
    // Made after the job path's wait, so that it is not kept across it
    // (a job pays with the key it records).
    let payer = caller.payer(&app);
    let body = match (send, raw) {
        // A Responses request that continues a stored one is sent with the
        // conversation spelled out: no bytes of its own to parse again.
        (Some(send), _) => RequestBody::kept(Arc::new(*send)),
        // A follower lets the parse go while it waits (see `RequestBody`).
        (None, Some(raw)) => RequestBody::from_bytes(req.body, raw),
        (None, None) => RequestBody::kept(req.body),
    };
    Ok(Admitted::Coalesce(Admission {
        policy: cache_policy(&headers),
        body: body.with_forwarded(forwarded),
        app,
        tenant,
        route,
        fp,
        asked,
        started: Since::of(started),
        rare: (trace.is_some() || responses.is_some() || payer.is_some()).then(|| {
            Box::new(Rare {
                trace,
                responses,
                payer,
            })
        }),
    }))
}

/// The client's headers that change the answer in `dialect`.
pub fn forwarded(dialect: Dialect, headers: &HeaderMap) -> Forwarded {
    Forwarded::read(dialect, |name| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect()
    })
}

/// A request of any dialect, read and checked.
struct Read {
    req: ChatRequest,
    /// The bytes it was parsed from.
    raw: Option<Bytes>,
    /// What a Responses request adds.
    responses: Option<Box<ResponsesAsk>>,
    /// What is sent instead of the request as it came: a Responses request
    /// that continues a stored one, the conversation spelled out.
    send: Option<Box<Map<String, Value>>>,
}

/// Reads and checks a request of `dialect` (a Responses request that
/// continues a stored one gets its earlier turns from the store).
async fn read_request(
    app: &AppState,
    tenant: &str,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    dialect: Dialect,
) -> Result<Read, ApiError> {
    // The body's share of the intake is held until it is read, parsed and
    // checked (its conversation spelled out, for a Responses request).
    let (bytes, share) = app
        .intake
        .read(body, content_length(headers), limit)
        .await?;
    let object = validate::parse_object(&bytes, &app.limits)?;
    let req = match dialect {
        Dialect::Chat | Dialect::Embeddings => validate::chat_request(object, &app.limits)?,
        Dialect::Messages => validate::messages_request(object, false, &app.limits)?,
        Dialect::CountTokens => validate::messages_request(object, true, &app.limits)?,
        Dialect::Responses => validate::responses_request(object, &app.limits)?,
    };
    let (responses, send) = match dialect {
        Dialect::Responses => {
            // Boxed: only these requests carry its state.
            let (ask, send) = Box::pin(super::responses::continued(app, tenant, &req.body)).await?;
            (Some(Box::new(ask)), send.map(Box::new))
        }
        _ => (None, None),
    };
    drop(share);
    Ok(Read {
        req,
        raw: Some(bytes),
        responses,
        send,
    })
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
            if let Some(r) = a.responses()
                && r.store
            {
                // Boxed: only these requests carry its state.
                Box::pin(super::responses::keep(
                    &a.app,
                    &a.tenant,
                    &a.fp,
                    r,
                    delivery.source.clone(),
                    a.asked.stream,
                ))
                .await;
            }
            let resp = respond(&delivery, &a.fp, a.asked).await;
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
            endpoint: a.asked.dialect.as_str(),
            outcome,
            status: resp.status().as_u16(),
            started: a.started.instant(),
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

/// The 404 for a model no route serves, listing the models that serve
/// `dialect` (every tenant may use every route).
pub fn unknown_model(routes: &Routes, model: &str, dialect: Dialect) -> ApiError {
    ApiError::ModelNotFound {
        model: model.to_string(),
        available: Some(
            routes
                .iter()
                .filter(|r| r.serves(dialect))
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

/// A checked request's route (one that serves its dialect) and its
/// fingerprint under the route's rules, with its dialect and the headers
/// that change its answer: the stage every face and the jobs API share.
pub fn route_request(
    live: &Live,
    tenant: &str,
    dialect: Dialect,
    req: &ChatRequest,
    headers: &HeaderMap,
    forwarded: &Forwarded,
) -> Result<(Arc<Route>, Fingerprint), ApiError> {
    let Some(route) = live.route(&req.model) else {
        return Err(unknown_model(&live.routes, &req.model, dialect));
    };
    if !route.serves(dialect) {
        return Err(not_served(&req.model, dialect.as_str()));
    }
    let user = headers.get(IDEM_USER).and_then(|v| v.to_str().ok());
    let rules = fingerprint::Rules {
        dialect,
        headers: forwarded,
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
pub async fn respond(d: &Delivery, fp: &Fingerprint, asked: Asked) -> Response {
    let mut resp = match &d.source {
        Source::Live(flight) if asked.stream && faces::flight_streams(flight).await => {
            faces::live_response(flight.clone(), asked)
        }
        _ => faces::render(&*d.answer().await, asked),
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
            let endpoints: Vec<&str> = [
                (Dialect::Chat, "chat.completions"),
                (Dialect::Messages, "messages"),
                (Dialect::Responses, "responses"),
                (Dialect::Embeddings, "embeddings"),
            ]
            .into_iter()
            .filter(|(d, _)| r.serves(*d))
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
            conversation(app, req, Dialect::Chat).map(|r| r.unwrap_or_else(refusal_response))
        });
        assert!(boxed <= 1024, "the chat handler's future is {boxed} bytes");
    }
}
