//! The HTTP surface: the router, the shared state handlers see, and the
//! caller's identity. Handlers live in one file per area: `openai` (the
//! conversation path of every dialect, whose answers `faces` renders;
//! models), `embeddings`, `responses` (stored responses), `jobs` (the jobs
//! API), `ops` (health, metrics, stats),
//! `admin` (certification, routes, jobs across tenants), `keys` (the
//! store's keys, and a key's own view), `ui` (the
//! dashboard page); `server` is the accept loop, `error` renders every
//! failure, `validate` checks bodies.

pub mod admin;
pub mod batches;
pub mod embeddings;
pub mod error;
pub mod faces;
pub mod files;
pub mod intake;
pub mod jobs;
pub mod keys;
pub mod message_batches;
pub mod openai;
pub mod ops;
pub mod responses;
pub mod server;
pub mod ui;
pub mod validate;

use std::ops::Deref;
use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequestParts, State};
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
    pub batches: Arc<crate::batches::Batches>,
    pub limits: Limits,
    /// Request bodies being read and parsed at once, bounded together.
    pub intake: intake::Intake,
    /// The last hour at 10-second resolution, for the dashboard.
    pub timeline: crate::timeline::Timeline,
    /// The responses kept a moment ago (`store: true`): written once a wave.
    pub kept: crate::conversations::Kept,
    /// The store's keys, as this replica holds them.
    pub keys: Arc<crate::keys::KeyTable>,
    /// This replica's side of every budget.
    pub ledger: Arc<crate::budgets::Ledger>,
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
    fn payer(&self, tenant: &str, key_id: Option<&str>) -> Option<crate::budgets::Payer> {
        let live = self.live.load();
        // A key revoked since the job was made still pays for its calls.
        let key = key_id.and_then(|id| self.keys.by_id(id));
        let budgeted = live.keyring.limits(tenant).and_then(|l| l.budget);
        crate::budgets::Payer::of(&self.ledger, tenant, key, budgeted, &live.config.budgets)
    }
}

/// The batch drivers see the gateway through its handles, and the faces'
/// checks of a line.
impl crate::batches::BatchEnv for Shared {
    fn batches(&self) -> &Arc<crate::batches::Batches> {
        &self.batches
    }
    fn plan_line(
        &self,
        tenant: &str,
        dialect: Dialect,
        body: serde_json::Map<String, serde_json::Value>,
    ) -> Result<crate::batches::Planned, crate::batches::LineRefusal> {
        batches::plan_line(self, tenant, dialect, body)
    }
    fn key_allows(&self, key_id: &str, route: &str) -> bool {
        self.keys.by_id(key_id).is_some_and(|k| k.allows(route))
    }
}

#[derive(Clone)]
pub struct AppState(pub Arc<Shared>);

impl AppState {
    /// The handle the job workers and the reconciler take.
    pub fn job_env(&self) -> crate::jobs::Env {
        self.0.clone()
    }

    /// The handle the batch drivers take.
    pub fn batch_env(&self) -> crate::batches::driver::Env {
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
    /// The store's key the request came with (none: a key of the
    /// configuration file, or no key).
    pub key: Option<Arc<crate::keys::Key>>,
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        Caller::admit(&parts.headers, state).await
    }
}

impl Caller {
    /// Authenticates the request's key, then spends a token of its tenant's
    /// rate limit and of its key's, before any work is done for it.
    pub async fn admit(headers: &HeaderMap, state: &AppState) -> Result<Caller, ApiError> {
        let caller = Caller::authenticate(headers, state)?;
        caller.limit(state).await?;
        Ok(caller)
    }

    /// The caller the request's key names.
    pub fn authenticate(headers: &HeaderMap, state: &AppState) -> Result<Caller, ApiError> {
        let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        Caller::of_token(auth.and_then(crate::tenants::bearer_token), state)
    }

    /// The caller of an Anthropic-shaped request: its key in `x-api-key`
    /// (what Anthropic's SDKs send), else in `Authorization: Bearer`.
    pub fn authenticate_anthropic(
        headers: &HeaderMap,
        state: &AppState,
    ) -> Result<Caller, ApiError> {
        match headers.get("x-api-key") {
            Some(key) => Caller::of_token(Some(key.as_bytes()), state),
            None => Caller::authenticate(headers, state),
        }
    }

    /// The caller a presented key names: a key of the store (refused with
    /// a message when revoked or expired), else the configuration's.
    fn of_token(token: Option<&[u8]>, state: &AppState) -> Result<Caller, ApiError> {
        let live = state.live.load();
        let token = token.map(<[u8]>::trim_ascii).filter(|t| !t.is_empty());
        if let Some(t) = token {
            let now = crate::store::now_ms();
            match state.keys.find(t, now) {
                Some(crate::keys::Found::Live(key)) => {
                    state.keys.used(&key, now);
                    return Ok(Caller {
                        who: Principal::Tenant(key.tenant.clone()),
                        live,
                        key: Some(key),
                    });
                }
                Some(crate::keys::Found::Revoked(key)) => {
                    return Err(ApiError::KeyRefused(format!(
                        "this API key ({}, \"{}\") was revoked",
                        key.record.hint, key.record.name
                    )));
                }
                Some(crate::keys::Found::Expired(key)) => {
                    return Err(ApiError::KeyRefused(format!(
                        "this API key ({}, \"{}\") expired at {}",
                        key.record.hint,
                        key.record.name,
                        crate::store::rfc3339(key.record.expires_at.unwrap_or(0))
                    )));
                }
                None => {}
            }
        }
        let who = live
            .keyring
            .authenticate_token(token)
            .ok_or(ApiError::Unauthorized)?;
        Ok(Caller {
            who,
            live,
            key: None,
        })
    }

    /// Spends a token of the caller's rate limits (a tenant's, then its
    /// key's requests per minute; admins have none), and checks its key's
    /// tokens per minute: 429 when one is spent. A key's windows are
    /// shared by every replica through Redis when the gateway has it, else
    /// kept by each process (docs/operations.md, "Budgets and limits").
    pub async fn limit(&self, state: &AppState) -> Result<(), ApiError> {
        self.limit_tenant(state)?;
        self.limit_key(state).await
    }

    /// The tenant's token bucket (in this process, no waiting).
    pub fn limit_tenant(&self, state: &AppState) -> Result<(), ApiError> {
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

    /// The key's requests and tokens per minute (a key of the store with
    /// limits; nothing to do for the others).
    pub async fn limit_key(&self, state: &AppState) -> Result<(), ApiError> {
        let Some(key) = &self.key else {
            return Ok(());
        };
        let now = crate::store::now_ms();
        let mut left_requests = None;
        if let Some(w) = &key.requests {
            match window(state, &key.id, "rpm", w, 1, now).await {
                Ok(left) => left_requests = Some(left),
                Err(retry_after) => {
                    state.metrics.rate_limited();
                    let left_tokens = match &key.tokens {
                        Some(t) => window(state, &key.id, "tpm", t, 0, now).await.ok(),
                        None => None,
                    };
                    return Err(ApiError::KeyRateLimited {
                        message: format!(
                            "this key's limit of {} requests per minute is spent; retry in {retry_after} s",
                            w.limit
                        ),
                        retry_after,
                        remaining_requests: Some(0),
                        remaining_tokens: left_tokens,
                    });
                }
            }
        }
        if let Some(w) = &key.tokens
            && let Err(retry_after) = window(state, &key.id, "tpm", w, 0, now).await
        {
            state.metrics.rate_limited();
            return Err(ApiError::KeyRateLimited {
                message: format!(
                    "this key's limit of {} tokens per minute is spent; retry in {retry_after} s",
                    w.limit
                ),
                retry_after,
                remaining_requests: left_requests,
                remaining_tokens: Some(0),
            });
        }
        Ok(())
    }

    /// 403 when the caller's key may not use `route` (its allowlist).
    pub fn may_use(&self, route: &crate::routes::Route) -> Result<(), ApiError> {
        match &self.key {
            Some(key) if !key.allows(&route.name) => Err(ApiError::Forbidden {
                message: format!(
                    "this API key (\"{}\") may not use model `{}`; it may use {}",
                    key.record.name,
                    route.name,
                    key.record
                        .models
                        .iter()
                        .flatten()
                        .map(|m| format!("`{m}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                code: "model_not_allowed",
            }),
            _ => Ok(()),
        }
    }

    /// Who pays for the calls this caller's requests lead: its key of the
    /// store (limited by its budget, or only counted) and its tenant when
    /// the tenant has a budget; none when neither.
    pub fn payer(&self, state: &AppState) -> Option<crate::budgets::Payer> {
        let tenant = self.tenant_name()?;
        let budgeted = self.live.keyring.limits(tenant).and_then(|l| l.budget);
        crate::budgets::Payer::of(
            &state.ledger,
            tenant,
            self.key.clone(),
            budgeted,
            &self.live.config.budgets,
        )
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

/// Takes `n` from key `id`'s window `kind` (`rpm` takes 1 per request;
/// `tpm` takes 0: a request is admitted while tokens are left, its tokens
/// counted when its call is settled): `Ok(what is left)` or `Err(seconds
/// to the next minute)`. Through Redis when the gateway has it (every
/// replica's requests in one count), else this process's window; a Redis
/// that fails falls back to the process's window.
pub(crate) async fn window(
    state: &AppState,
    id: &str,
    kind: &str,
    local: &crate::keys::Window,
    n: u64,
    now: i64,
) -> Result<u64, u64> {
    let now_u = u64::try_from(now).unwrap_or(0);
    let minute = now_u / 60_000;
    let retry = ((minute + 1) * 60_000 - now_u).div_ceil(1000).max(1);
    if let Some(shared) = state.core.coalescer.shared.get()
        && let Ok(count) = shared
            .count_window(&format!("{kind}:{id}"), minute, n)
            .await
    {
        let over = if n == 0 {
            count >= local.limit
        } else {
            count > local.limit
        };
        return if over {
            Err(retry)
        } else {
            Ok(local.limit.saturating_sub(count))
        };
    }
    local.take(n, now)
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
        .route(
            "/v1/messages/batches",
            post(message_batches::create).get(message_batches::list),
        )
        .route(
            "/v1/messages/batches/{id}",
            get(message_batches::get).delete(message_batches::delete),
        )
        .route(
            "/v1/messages/batches/{id}/cancel",
            post(message_batches::cancel),
        )
        .route(
            "/v1/messages/batches/{id}/results",
            get(message_batches::results),
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
        .route(
            "/v1/files",
            // The upload is bounded by `batches.max_file_bytes` as it
            // streams, not by the extractors' default limit.
            post(files::upload)
                .layer(DefaultBodyLimit::disable())
                .get(files::list),
        )
        .route("/v1/files/{id}", get(files::get).delete(files::delete))
        .route("/v1/files/{id}/content", get(files::content))
        .route("/v1/batches", post(batches::create).get(batches::list))
        .route("/v1/batches/{id}", get(batches::get))
        .route("/v1/batches/{id}/cancel", post(batches::cancel))
        .route("/v1/stats", get(ops::stats))
        .route("/v1/admin/certify", post(admin::certify))
        .route("/v1/admin/routes", get(admin::routes))
        .route("/v1/admin/reload", post(admin::reload))
        .route("/v1/admin/jobs", get(admin::jobs))
        .route("/v1/admin/jobs/{id}", get(admin::job))
        .route("/v1/admin/timeline", get(admin::timeline))
        .route("/v1/admin/keys", post(keys::create).get(keys::list))
        .route("/v1/admin/keys/{id}", get(keys::show).patch(keys::update))
        .route("/v1/admin/keys/{id}/revoke", post(keys::revoke))
        .route("/v1/admin/keys/{id}/rotate", post(keys::rotate))
        .route("/v1/admin/keys/{id}/audit", get(keys::audit))
        .route("/v1/key", get(keys::own))
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
