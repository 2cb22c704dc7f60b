//! Admin endpoints (admin key only) for contracts and failover, the
//! configuration reload, and the admin's view of every tenant's jobs:
//!
//! - `POST /v1/admin/reload` reads the configuration file again and puts it
//!   in force (as SIGHUP does), answering what changed or why not;
//! - `POST /v1/admin/certify` `{"route": R, "target": P?}` runs
//!   certification like `idem certify`, records it, makes it count at once
//!   in this gateway, and returns the reports as JSON;
//! - `GET /v1/admin/routes` lists every route's targets with the
//!   certification state this gateway enforces for the current contract
//!   hash, whether failover may use them, and their circuit state;
//! - `GET /v1/admin/jobs` and `GET /v1/admin/jobs/{id}`: jobs across tenants
//!   (the tenant endpoints under `/v1/jobs` stay scoped to the caller's
//!   tenant), for the operator and the dashboard at `/ui`;
//! - `GET /v1/admin/timeline`: the last hour at 10-second resolution that
//!   this gateway keeps for the dashboard (see [`crate::timeline`]).

use std::collections::HashMap;

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::jobs::{check_id, parse_cursor};
use super::{ApiPath, ApiQuery};
use super::{AppState, Caller};
use crate::certification::certify::{self, CertifyError};
use crate::certification::failover;
use crate::certification::registry::{self, CertView};
use crate::contracts::short_hash;
use crate::jobs::job_json;
use crate::routes::Routes;
use crate::store::{JobRecord, JobState};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CertifyRequest {
    route: String,
    #[serde(default)]
    target: Option<String>,
}

impl From<CertifyError> for ApiError {
    fn from(e: CertifyError) -> Self {
        match e {
            CertifyError::NoRoute(r) => ApiError::ModelNotFound {
                model: r,
                available: None,
            },
            CertifyError::Store(s) => s.into(),
            other => ApiError::bad_request(other.to_string(), "cannot_certify", Some("route")),
        }
    }
}

/// `POST /v1/admin/certify`.
pub async fn certify(
    State(app): State<AppState>,
    caller: Caller,
    body: axum::body::Bytes,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let req: CertifyRequest = serde_json::from_slice(&body).map_err(|e| {
        ApiError::bad_request(
            format!("expected {{\"route\": ..., \"target\": ...}}: {e}"),
            "invalid_request_body",
            None,
        )
    })?;
    let reports = certify::certify(
        &*app.store,
        &caller.live.config,
        &caller.live.routes,
        &req.route,
        req.target.as_deref(),
    )
    .await?;
    // Count at once here (in the routes in force, should a reload have
    // come meanwhile); other replicas see it at their next refresh.
    registry::refresh(&*app.store, &app.live.load().routes).await?;
    Ok(Json(json!({
        "object": "certification",
        "route": req.route,
        "passed": reports.iter().all(|r| r.passed),
        "reports": reports,
    })))
}

/// `POST /v1/admin/reload`: reads the configuration file again and puts
/// it in force, as SIGHUP does; answers what changed, or 409 with why the
/// new configuration was refused (the one in force stays).
pub async fn reload(State(app): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let changes = app.live.reload(&app.metrics, &*app.store).await?;
    Ok(Json(json!({"object": "reload", "changes": changes})))
}

/// `GET /v1/admin/routes`.
pub async fn routes(caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    Ok(Json(
        json!({"object": "list", "data": routes_view(&caller.live.routes, true)}),
    ))
}

/// Every route with its targets' certification state, from the in-memory
/// registry; with `circuits`, each target's breaker too (only a running
/// gateway has one).
pub fn routes_view(routes: &Routes, circuits: bool) -> Vec<Value> {
    routes
        .iter()
        .map(|route| {
            let targets: Vec<Value> = route
                .targets
                .iter()
                .map(|t| {
                    let certification = route
                        .contract
                        .as_ref()
                        .map(|c| CertView::of(t.certificate.get().as_ref(), &c.hash));
                    let mut v = json!({
                        "index": t.index,
                        "provider": t.provider.name.as_ref(),
                        "model": t.model.as_ref(),
                        "primary": t.index == 0,
                        "certification": certification,
                        "failover_allowed": failover::certified_for_failover(route, t),
                        "price": t.price.map(|p| json!({
                            "input_per_mtok": p.input_per_mtok,
                            "cached_input_per_mtok": p.cached_input_per_mtok,
                            "output_per_mtok": p.output_per_mtok,
                            "currency": "USD",
                            "source": p.source,
                            "as_of": (p.source == "built-in").then_some(crate::prices::BUILT_IN_AS_OF),
                        })),
                    });
                    if circuits {
                        v["circuit"] = json!(t.breaker.view());
                    }
                    v
                })
                .collect();
            let contract = route.contract.as_ref().map(|c| {
                json!({
                    "path": c.path.display().to_string(),
                    "hash": c.hash,
                    "short_hash": short_hash(&c.hash),
                })
            });
            json!({
                "route": route.name.as_ref(),
                "contract": contract,
                "failover": if route.contract.is_some() { "certified_only" } else { "any_target" },
                "targets": targets,
            })
        })
        .collect()
}

#[derive(Debug, Deserialize)]
pub struct JobsQuery {
    state: Option<String>,
    tenant: Option<String>,
    limit: Option<String>,
    after: Option<String>,
}

/// A job in the admin's view: the tenant's JSON plus whose job it is.
fn admin_job(job: &JobRecord, attempts: Option<&[crate::store::AttemptRecord]>) -> Value {
    let mut v = job_json(job, attempts);
    v["tenant"] = json!(job.tenant);
    v
}

/// `GET /v1/admin/jobs?state=&tenant=&limit=&after=`: every tenant's jobs
/// (or one tenant's), newest first, with `next_cursor` as in `/v1/jobs`.
/// `state=unknown` lists instead the jobs held by an `unknown` attempt,
/// the longest held first (all of them fit in one page: no cursor).
pub async fn jobs(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<JobsQuery>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let limit = match q.limit.as_deref() {
        None | Some("") => 20,
        Some(n) => n
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request("`limit` must be 1..=100", "invalid_value", Some("limit"))
            })?,
    };
    let tenant = q.tenant.as_deref().filter(|t| !t.is_empty());
    let cursor = match q.after.as_deref() {
        None | Some("") => None,
        Some(c) => Some(parse_cursor(c).ok_or_else(|| {
            ApiError::bad_request("invalid cursor", "invalid_value", Some("after"))
        })?),
    };
    let state = match q.state.as_deref() {
        None | Some("") => None,
        Some("unknown") => {
            if cursor.is_some() {
                return Err(ApiError::bad_request(
                    "`state=unknown` returns one page; it takes no cursor",
                    "invalid_value",
                    Some("after"),
                ));
            }
            return held_by_unknown(&app, tenant, limit).await.map(Json);
        }
        Some(s) => Some(JobState::parse(s).ok_or_else(|| {
            ApiError::bad_request(
                "`state` must be queued, running, succeeded, failed, cancelled or unknown",
                "invalid_value",
                Some("state"),
            )
        })?),
    };
    let mut jobs = match tenant {
        Some(t) => {
            app.store
                .list_jobs(t, state, cursor.as_ref(), limit + 1)
                .await?
        }
        None => {
            app.store
                .list_all_jobs(state, cursor.as_ref(), limit + 1)
                .await?
        }
    };
    let has_more = jobs.len() > limit as usize;
    jobs.truncate(limit as usize);
    let next = if has_more {
        jobs.last().map(|j| format!("{}_{}", j.created_at, j.id))
    } else {
        None
    };
    let data: Vec<Value> = jobs.iter().map(|j| admin_job(j, None)).collect();
    Ok(Json(
        json!({"object": "list", "data": data, "has_more": has_more, "next_cursor": next}),
    ))
}

/// The jobs held by `unknown` attempts, the longest held first, each with
/// the numbers of its unknown attempts.
async fn held_by_unknown(
    app: &AppState,
    tenant: Option<&str>,
    limit: u32,
) -> Result<Value, ApiError> {
    let mut attempts = app.store.unknown_attempts().await?;
    attempts.sort_by_key(|a| (a.started_at, a.n));
    let mut order: Vec<String> = Vec::new();
    let mut numbers: HashMap<String, Vec<i32>> = HashMap::new();
    for a in attempts {
        let ns = numbers.entry(a.job_id.clone()).or_default();
        if ns.is_empty() {
            order.push(a.job_id);
        }
        ns.push(a.n);
    }
    let mut data = Vec::new();
    let mut has_more = false;
    for id in order {
        // A job purged or changed meanwhile simply drops out.
        let Some(job) = app.store.job(tenant, &id).await? else {
            continue;
        };
        if data.len() == limit as usize {
            has_more = true;
            break;
        }
        let mut v = admin_job(&job, None);
        v["unknown_attempts"] = json!(numbers.get(&id));
        data.push(v);
    }
    Ok(json!({"object": "list", "data": data, "has_more": has_more, "next_cursor": null}))
}

/// `GET /v1/admin/jobs/{id}`: any tenant's job with its attempts.
pub async fn job(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    check_id(&id)?;
    let job = app
        .store
        .job(None, &id)
        .await?
        .ok_or(ApiError::NotFound("job"))?;
    let attempts = app.store.attempts(&job.id).await?;
    Ok(Json(admin_job(&job, Some(&attempts))))
}

/// `GET /v1/admin/timeline`: this gateway's last hour, sampled every 10
/// seconds, with the sums since start and each target's health.
pub async fn timeline(
    State(app): State<AppState>,
    caller: Caller,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    Ok(Json(crate::timeline::view(
        &app.metrics,
        &app.timeline,
        &caller.live.routes,
    )))
}
