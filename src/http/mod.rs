//! The HTTP surface: the router, the shared state handlers see, and the
//! caller's identity. Handlers live in one file per area: `openai` (the
//! conversation path of every dialect, whose answers `faces` renders;
//! models), `embeddings`, `responses` (stored responses), `jobs` (the jobs
//! API), `ops` (health, metrics, stats),
//! `admin` (certification, routes, jobs across tenants), `ui` (the
//! dashboard page); `server` is the accept loop, `error` renders every
//! failure, `validate` checks bodies.

pub mod admin;
pub mod embeddings;
pub mod error;
pub mod faces;
pub mod intake;
pub mod jobs;
pub mod openai;
pub mod ops;
pub mod responses;
pub mod server;
pub mod ui;
pub mod validate;

use std::ops::Deref;
use std::sync::Arc;

use axum::Router;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::dialect::Dialect;
use crate::jobs::Jobs;
use crate::live::{Live, LiveConfig};
use crate::metrics::Metrics;
use crate::store::Store;
use crate::task::Core;
use crate::tenants::Principal;
use error::ApiError;
use validate::Limits;

/// Everything a handler may use: cheap handles, no global lock.
pub struct Shared {
    /// Tenants, keys, providers and routes in force (a reload replaces
    /// them): a request takes them once, with its [`Caller`].
    pub live: LiveConfig,
    /// The request path's core: coalescing, the request log, the work
    /// requests leave behind.
    pub core: Core,
    pub metrics: Arc<Metrics>,
    pub store: Arc<dyn Store>,
    pub jobs: Arc<Jobs>,
    pub limits: Limits,
    /// Request bodies being read and parsed at once, bounded together.
    pub intake: intake::Intake,
    /// The last hour at 10-second resolution, for the dashboard.
    pub timeline: crate::timeline::Timeline,
    /// The responses kept a moment ago (`store: true`): written once a wave.
    pub kept: crate::conversations::Kept,
}

/// The job workers see the gateway through its handles only.
impl crate::jobs::JobEnv for Shared {
    fn live(&self) -> Arc<Live> {
        self.live.load()
    }
    fn jobs(&self) -> &Arc<Jobs> {
        &self.jobs
    }
    fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }
    fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }
    fn core(&self) -> &Core {
        &self.core
    }
}

#[derive(Clone)]
pub struct AppState(pub Arc<Shared>);

impl AppState {
    /// The handle the job workers and the reconciler take.
    pub fn job_env(&self) -> crate::jobs::Env {
        self.0.clone()
    }
}

impl Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The authenticated caller, and the configuration in force when it was
/// admitted, which the request keeps to its end (docs/design.md,
/// "Reloading the configuration").
pub struct Caller {
    pub who: Principal,
    pub live: Arc<Live>,
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        Caller::admit(&parts.headers, state)
    }
}

impl Caller {
    /// Authenticates the request's key, then spends a token of its tenant's
    /// rate limit, before any work is done for it.
    pub fn admit(headers: &HeaderMap, state: &AppState) -> Result<Caller, ApiError> {
        let caller = Caller::authenticate(headers, state)?;
        caller.limit(state)?;
        Ok(caller)
    }

    /// The caller the request's key names.
    pub fn authenticate(headers: &HeaderMap, state: &AppState) -> Result<Caller, ApiError> {
        let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        let live = state.live.load();
        let who = live
            .keyring
            .authenticate(auth)
            .ok_or(ApiError::Unauthorized)?;
        Ok(Caller { who, live })
    }

    /// The caller of an Anthropic-shaped request: its key in `x-api-key`
    /// (what Anthropic's SDKs send), else in `Authorization: Bearer`.
    pub fn authenticate_anthropic(
        headers: &HeaderMap,
        state: &AppState,
    ) -> Result<Caller, ApiError> {
        let Some(key) = headers.get("x-api-key") else {
            return Caller::authenticate(headers, state);
        };
        let live = state.live.load();
        let who = live
            .keyring
            .authenticate_token(Some(key.as_bytes()))
            .ok_or(ApiError::Unauthorized)?;
        Ok(Caller { who, live })
    }

    /// Spends a token of the caller's rate limit (a tenant's; admins have
    /// none): 429 when the bucket is empty.
    pub fn limit(&self, state: &AppState) -> Result<(), ApiError> {
        if let Principal::Tenant(t) = &self.who
            && let Some(limits) = self.live.keyring.limits(t)
            && let Err(wait) = limits.admit()
        {
            state.metrics.rate_limited();
            return Err(ApiError::RateLimited {
                retry_after: wait.as_secs_f64().ceil().max(1.0) as u64,
            });
        }
        Ok(())
    }

    /// The tenant's name, if the caller is a tenant.
    pub fn tenant_name(&self) -> Option<&Arc<str>> {
        match &self.who {
            Principal::Tenant(t) => Some(t),
            Principal::Admin => None,
        }
    }

    /// The tenant, or 403 for an admin key on a tenant endpoint.
    pub fn tenant(&self) -> Result<Arc<str>, ApiError> {
        match &self.who {
            Principal::Tenant(t) => Ok(t.clone()),
            Principal::Admin => Err(ApiError::TenantOnly),
        }
    }

    /// The body limit for this caller: the tenant's own, within the server's.
    pub fn body_limit(&self, state: &AppState) -> usize {
        let server = state.limits.max_body_bytes;
        match &self.who {
            Principal::Tenant(t) => self
                .live
                .keyring
                .limits(t)
                .and_then(|l| l.max_body_bytes)
                .map_or(server, |n| n.min(server)),
            Principal::Admin => server,
        }
    }

    pub fn require_admin(&self) -> Result<(), ApiError> {
        match self.who {
            Principal::Admin => Ok(()),
            Principal::Tenant(_) => Err(ApiError::AdminOnly),
        }
    }
}

/// `Query` whose rejection is an OpenAI error object.
pub struct ApiQuery<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiQuery<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(e) => Err(ApiError::bad_request(
                e.body_text(),
                "invalid_parameter",
                None,
            )),
        }
    }
}

/// `Path` whose rejection is an OpenAI error object.
pub struct ApiPath<T>(pub T);

impl<T, S> FromRequestParts<S> for ApiPath<T>
where
    T: serde::de::DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            Err(e) => Err(ApiError::bad_request(
                e.body_text(),
                "invalid_parameter",
                None,
            )),
        }
    }
}

/// The router of one gateway.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route(
            "/v1/chat/completions",
            post(openai::ChatPath(Dialect::Chat)),
        )
        .route("/chat/completions", post(openai::ChatPath(Dialect::Chat)))
        .route("/v1/messages", post(openai::ChatPath(Dialect::Messages)))
        .route(
            "/v1/messages/count_tokens",
            post(openai::ChatPath(Dialect::CountTokens)),
        )
        .route("/v1/responses", post(openai::ChatPath(Dialect::Responses)))
        .route(
            "/v1/responses/{id}",
            get(responses::get).delete(responses::delete),
        )
        .route("/v1/embeddings", post(embeddings::embeddings))
        .route("/embeddings", post(embeddings::embeddings))
        .route("/v1/models", get(openai::models))
        .route("/v1/jobs", post(jobs::create).get(jobs::list))
        .route("/v1/jobs/{id}", get(jobs::get))
        .route("/v1/jobs/{id}/attempts", post(jobs::retry))
        .route("/v1/jobs/{id}/attempts/{n}/resolve", post(jobs::resolve))
        .route("/v1/jobs/{id}/cancel", post(jobs::cancel))
        .route("/v1/stats", get(ops::stats))
        .route("/v1/admin/certify", post(admin::certify))
        .route("/v1/admin/routes", get(admin::routes))
        .route("/v1/admin/reload", post(admin::reload))
        .route("/v1/admin/jobs", get(admin::jobs))
        .route("/v1/admin/jobs/{id}", get(admin::job))
        .route("/v1/admin/timeline", get(admin::timeline))
        // Claude Code sends `HEAD /` to warm its connection first.
        .route("/", get(|| async { "idem" }))
        .route("/healthz", get(ops::healthz))
        .route("/readyz", get(ops::readyz))
        .route("/metrics", get(ops::metrics))
        .merge(ui::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn not_found(State(_): State<AppState>, uri: axum::http::Uri) -> ApiError {
    tracing::debug!(target: "idem::refused", path = uri.path(), "no such endpoint");
    ApiError::NotFound("route")
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    tracing::debug!(target: "idem::refused", %method, path = uri.path(), "method not allowed");
    let body = error::error_body(
        "method not allowed",
        "invalid_request_error",
        "method_not_allowed",
        None,
    );
    (StatusCode::METHOD_NOT_ALLOWED, axum::Json(body)).into_response()
}

/// The answer to a request whose handler panicked (the server catches
/// it: see `server`).
pub fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    tracing::error!("a handler panicked");
    ApiError::internal(anyhow::anyhow!("handler panicked")).into_response()
}
