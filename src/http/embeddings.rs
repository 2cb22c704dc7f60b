//! `POST /v1/embeddings`: the embeddings face. It reads OpenAI's wire
//! format, cuts the request into one task per input item
//! ([`crate::endpoints::embeddings`]), hands them to the core together
//! ([`Core::obtain_batch`]: each item its cache entry and its flight; the
//! items this request leads share one upstream call) and renders the
//! answers in the caller's order and encoding.
//!
//! `Idem-Outcome` is `leader` when anything was sent upstream, else
//! `follower` or `cache-hit` (`negative-hit` when an item's failure was
//! cached); `Idem-Items-Sent` and `Idem-Items-Saved` count the items.
//!
//! [`Core::obtain_batch`]: crate::task::Core::obtain_batch

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::openai::{
    IDEM_FINGERPRINT, IDEM_OUTCOME, IDEM_PROVIDER, IDEM_USER, cache_policy, content_length,
};
use super::{AppState, Caller, validate};
use crate::answer::Answer;
use crate::dialect::Dialect;
use crate::endpoints::embeddings::{self as wire, EMBEDDINGS, Encoding};
use crate::fingerprint::{self, Fingerprint};
use crate::flight::{RequestBody, Source};
use crate::outcome::Outcome;
use crate::prices::Tokens;
use crate::routes::Route;
use crate::task::{Count, Finish, Items, Line, Task};
use crate::telemetry::Trace;

pub const IDEM_ITEMS_SENT: HeaderName = HeaderName::from_static("idem-items-sent");
pub const IDEM_ITEMS_SAVED: HeaderName = HeaderName::from_static("idem-items-saved");

/// `POST /v1/embeddings`.
pub async fn embeddings(State(app): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    match handle(&app, &headers, body, started).await {
        Ok(resp) => resp,
        Err(e) => {
            let refusal = e.refusal();
            let mut resp = e.into_response();
            resp.headers_mut()
                .insert(IDEM_OUTCOME, HeaderValue::from_static(refusal.as_str()));
            resp
        }
    }
}

/// A request as far as it got before it was refused, for counting it.
struct Known<'a> {
    app: &'a AppState,
    tenant: Option<&'a Arc<str>>,
    route: Option<&'a Arc<str>>,
}

impl Known<'_> {
    fn refused(&self, e: ApiError) -> ApiError {
        self.app.core.finish(Finish {
            tenant: self.tenant,
            route: self.route,
            count: Some(Count::Refused(e.refusal())),
            ..Finish::default()
        });
        e
    }
}

async fn handle(
    app: &AppState,
    headers: &HeaderMap,
    body: Body,
    started: Instant,
) -> Result<Response, ApiError> {
    let mut known = Known {
        app,
        tenant: None,
        route: None,
    };
    let caller = Caller::admit(headers, app)
        .await
        .map_err(|e| known.refused(e))?;
    let tenant = caller.tenant().map_err(|e| known.refused(e))?;
    known.tenant = Some(&tenant);
    let (bytes, share) = app
        .intake
        .read(body, content_length(headers), caller.body_limit(app))
        .await
        .map_err(|e| known.refused(e))?;
    let object = validate::parse_object(&bytes, &app.limits).map_err(|e| known.refused(e))?;
    drop(bytes);
    let req = wire::parse(object)
        .map_err(|i| known.refused(ApiError::bad_request(i.message, i.code, Some(i.param))))?;
    drop(share);
    let trace = super::openai::request_trace(app, "embeddings", &req.model, headers);
    let Some(route) = caller.live.route(&req.model) else {
        return Err(known.refused(super::openai::unknown_model(
            &caller.live.routes,
            &req.model,
            Dialect::Embeddings,
        )));
    };
    known.route = Some(&route.name);
    if !route.serves(Dialect::Embeddings) {
        return Err(known.refused(super::openai::not_served(&req.model, "embeddings")));
    }
    caller.may_use(&route).map_err(|e| known.refused(e))?;
    let payer = caller.payer(app);
    let user = headers.get(IDEM_USER).and_then(|v| v.to_str().ok());
    let rules = route.rules(&tenant);
    let fp = fingerprint::fingerprint(&req.whole, user, &rules);
    let bodies: Vec<(RequestBody, Fingerprint)> = req
        .items
        .into_iter()
        .map(|item| {
            let fp = fingerprint::fingerprint(&item, user, &rules);
            (RequestBody::kept(Arc::new(item)), fp)
        })
        .collect();
    let policy = cache_policy(headers);
    let tasks: Vec<Task<'_>> = bodies
        .iter()
        .map(|(body, fp)| Task {
            tenant: &tenant,
            route: &route,
            fp: *fp,
            body,
            wire: &EMBEDDINGS,
            policy,
            trace: trace.as_ref(),
            payer: payer.as_ref(),
        })
        .collect();
    let obtained = app.core.obtain_batch(&tasks).await;
    let mut items = Vec::with_capacity(obtained.len());
    let mut refused = None;
    for result in obtained {
        match result {
            Ok(d) => {
                let answer = match &d.source {
                    Source::Done(a) => a.clone(),
                    Source::Live(_) => d.answer().await,
                };
                items.push((d.outcome, answer));
            }
            Err(e) => {
                refused.get_or_insert(ApiError::from(e));
            }
        }
    }
    let reply = Reply {
        app,
        tenant: &tenant,
        route: &route,
        fp,
        started,
        trace: trace.as_ref(),
    };
    match refused {
        Some(e) => Ok(reply.refused(e)),
        None => Ok(reply.answer(&items, req.encoding)),
    }
}

/// The answer to an embeddings request, counted and logged.
struct Reply<'a> {
    app: &'a AppState,
    tenant: &'a Arc<str>,
    route: &'a Arc<Route>,
    fp: Fingerprint,
    started: Instant,
    trace: Option<&'a Trace>,
}

impl Reply<'_> {
    /// An error of idem's own for the request (an item's wait ran out, no
    /// target could take the items).
    fn refused(&self, e: ApiError) -> Response {
        let refusal = e.refusal();
        let mut resp = e.into_response();
        let h = resp.headers_mut();
        h.insert(IDEM_OUTCOME, HeaderValue::from_static(refusal.as_str()));
        if let Ok(v) = HeaderValue::from_str(&self.fp.to_string()) {
            h.insert(IDEM_FINGERPRINT, v);
        }
        self.finish(
            Count::Refused(refusal),
            refusal.as_str(),
            resp.status(),
            None,
            None,
        );
        resp
    }

    /// The items' answers, or the first item's failure: an item that failed
    /// fails the request.
    fn answer(&self, items: &[(Outcome, Arc<Answer>)], encoding: Encoding) -> Response {
        let outcome = wire::outcome_of(items.iter().map(|(o, _)| *o));
        let sent = items.iter().filter(|(o, _)| !o.saved_a_call()).count();
        let saved = items.len() - sent;
        let whole = wire::whole(items, encoding);
        let mut resp = Response::new(Body::from(whole.body.clone()));
        *resp.status_mut() = whole.status;
        if let Some(ra) = whole.retry_after.filter(|_| !whole.is_success()) {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(ra.as_secs()));
        }
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h.insert(IDEM_OUTCOME, HeaderValue::from_static(outcome.as_str()));
        if let Ok(v) = HeaderValue::from_str(&self.fp.to_string()) {
            h.insert(IDEM_FINGERPRINT, v);
        }
        if let Some((_, first)) = items.first()
            && let Ok(v) = HeaderValue::from_str(&first.provider)
        {
            h.insert(IDEM_PROVIDER, v);
        }
        h.insert(IDEM_ITEMS_SENT, HeaderValue::from(sent));
        h.insert(IDEM_ITEMS_SAVED, HeaderValue::from(saved));
        let mut by_outcome: Vec<(Outcome, u64)> = Vec::new();
        for (o, _) in items {
            match by_outcome.iter_mut().find(|(k, _)| k == o) {
                Some((_, n)) => *n += 1,
                None => by_outcome.push((*o, 1)),
            }
        }
        let saved: Vec<&Arc<Answer>> = items
            .iter()
            .filter(|(o, a)| o.saved_a_call() && a.is_success())
            .map(|(_, a)| a)
            .collect();
        let saved_tokens = saved.iter().map(|a| wire::tokens_of(a)).sum();
        // What the saved items would have cost: each at the input price of
        // the target that embedded it; unknown if any of them has none.
        let saved_cost = saved
            .iter()
            .map(|a| {
                let price = self.route.price_of(&a.provider, &a.model)?;
                let tokens = Tokens {
                    input: wire::tokens_of(a),
                    ..Tokens::default()
                };
                Some(price.cost(&tokens))
            })
            .sum::<Option<f64>>()
            .filter(|_| !saved.is_empty());
        let tokens: u64 = items.iter().map(|(_, a)| wire::tokens_of(a)).sum();
        self.finish(
            Count::Answered(outcome),
            outcome.as_str(),
            resp.status(),
            Some(Items {
                by_outcome: &by_outcome,
                saved_tokens,
                saved_cost,
            }),
            items.first().map(|(_, a)| (a.clone(), tokens)),
        );
        resp
    }

    fn finish(
        &self,
        count: Count,
        outcome: &'static str,
        status: StatusCode,
        items: Option<Items<'_>>,
        answer: Option<(Arc<Answer>, u64)>,
    ) {
        let (answer, usage) = match answer {
            Some((a, tokens)) => (Some(Source::Done(a)), Some((tokens, 0))),
            None => (None, None),
        };
        self.app.core.finish(Finish {
            tenant: Some(self.tenant),
            route: Some(&self.route.name),
            count: Some(count),
            line: Some(Line {
                endpoint: "embeddings",
                fp: self.fp,
                outcome,
                status: status.as_u16(),
                started: self.started,
                job: None,
                body: None,
                answer,
                answer_of_job: None,
                usage,
            }),
            items,
            priced: Some(self.route),
            answered: None,
            trace: self.trace,
        });
    }
}
