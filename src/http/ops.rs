//! Operations endpoints: liveness, readiness (the store answers real
//! queries), Prometheus metrics, and `/v1/stats` (admin: every tenant;
//! tenant key: its own).

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::error::ApiError;
use super::{AppState, Caller};
use crate::store::{Store, StoreError};
use crate::tenants::Principal;

/// How long readiness waits for the store.
const READY_TIMEOUT: Duration = Duration::from_secs(2);

/// An id no job, attempt or route has: what readiness looks up.
const PROBE_ID: &str = "idem-readiness-probe";

pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

/// Ready when the store answers a query on each of its tables. `SELECT 1`
/// alone says the database is reachable, not that its tables are there: a
/// SQLite file whose tables were dropped, or a PostgreSQL schema dropped or
/// never migrated, answers it and fails every request.
pub async fn readyz(State(app): State<AppState>) -> Response {
    let (storage, detail) = match tokio::time::timeout(READY_TIMEOUT, probe(&*app.store)).await {
        Ok(Ok(())) => return Json(json!({"status": "ready", "storage": "ok"})).into_response(),
        Ok(Err(e)) => (store_state(&e), e.to_string()),
        Err(_) => ("timeout", format!("no answer within {READY_TIMEOUT:?}")),
    };
    tracing::warn!(error = %detail, storage, "readiness: storage not usable");
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({"status": "unavailable", "storage": storage})),
    )
        .into_response()
}

/// A lookup by key in each table, which finds nothing and costs next to
/// nothing, but fails if the table is not there.
async fn probe(store: &dyn Store) -> Result<(), StoreError> {
    store.ping().await?;
    store.job(None, PROBE_ID).await?;
    store.attempts(PROBE_ID).await?;
    store.certifications(PROBE_ID).await?;
    Ok(())
}

/// What a store failure says about the store, in one word for clients
/// (the details, which may name hosts and tables, go to the log).
fn store_state(e: &StoreError) -> &'static str {
    match e {
        StoreError::Unavailable(_) => "unreachable",
        _ => "broken",
    }
}

pub async fn metrics(
    State(app): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let live = app.live.load();
    if live.config.admin.metrics_require_key {
        let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        // As on every admin endpoint: no key or an unknown one is 401, a
        // tenant's key is 403.
        match live.keyring.authenticate(auth) {
            Some(Principal::Admin) => {}
            Some(Principal::Tenant(_)) => return Err(ApiError::AdminOnly),
            None => return Err(ApiError::Unauthorized),
        }
    }
    let mut resp = app.metrics.render().into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    Ok(resp)
}

pub async fn stats(State(app): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    let now = crate::store::now_ms();
    // Figures the store could not give are null, and named here with the
    // reason, rather than shown as zeros that look like real counts.
    let mut unreadable = Vec::new();
    match &caller.who {
        Principal::Tenant(t) => {
            let jobs = job_counts(&app, Some(t)).await;
            let jobs = readable("jobs", jobs, &mut unreadable);
            let budgets = budgets(&app, Some(t)).await;
            let budgets = readable("budgets", budgets, &mut unreadable);
            Ok(Json(json!({
                "object": "stats",
                "tenant": t.as_ref(),
                "at": crate::store::rfc3339(now),
                "coalescing": app.metrics.stats(Some(t)),
                "jobs": jobs,
                "budgets": budgets,
                "unreadable": unreadable,
            })))
        }
        Principal::Admin => {
            let mut tenants = serde_json::Map::new();
            for name in app.metrics.tenant_names() {
                tenants.insert(
                    name.to_string(),
                    serde_json::to_value(app.metrics.stats(Some(&name))).unwrap_or_default(),
                );
            }
            let jobs = readable("jobs", job_counts(&app, None).await, &mut unreadable);
            let budgets = readable("budgets", budgets(&app, None).await, &mut unreadable);
            let unknown = app.store.unknown_attempts().await.map(|v| json!(v.len()));
            let unknown = readable("unknown_attempts", unknown, &mut unreadable);
            Ok(Json(json!({
                "object": "stats",
                "at": crate::store::rfc3339(now),
                "coalescing": app.metrics.stats(None),
                "tenants": tenants,
                "jobs": jobs,
                "budgets": budgets,
                "unknown_attempts": unknown,
                "attempt_races": app.metrics.attempt_races(),
                "inflight_flights": app.core.coalescer.table.inflight(),
                "waiting_followers": app.core.coalescer.table.followers(),
                "replica": app.jobs.worker_id,
                "backend": if caller.live.config.coalescing.backend == "memory" { "memory" } else { "redis" },
                "redis_connected": app.core.coalescer.shared.get().map(|s| s.healthy()),
                "redis_subscribed": app.core.coalescer.shared.get().map(|s| s.listening()),
                "redis_errors": app.metrics.redis_errors.get(),
                "unreadable": unreadable,
            })))
        }
    }
}

/// A figure read from the store, or null with `{"figure", "reason"}` added
/// to `unreadable`.
fn readable(figure: &str, read: Result<Value, StoreError>, unreadable: &mut Vec<Value>) -> Value {
    match read {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(error = %e, figure, "stats: a figure could not be read");
            let reason = match e {
                StoreError::Unavailable(_) => "storage unavailable",
                _ => "storage error",
            };
            unreadable.push(json!({"figure": figure, "reason": reason}));
            Value::Null
        }
    }
}

/// Spend, reservations and what is left, per key of the store and per
/// tenant with a budget (one tenant's, or all), as the store has them
/// (the same on every replica).
async fn budgets(app: &AppState, tenant: Option<&str>) -> Result<Value, StoreError> {
    let now = crate::store::now_ms();
    let rows = app.store.budgets(now).await?;
    let lines = crate::keys::budget_lines(&app.keys, &rows);
    let data: Vec<Value> = lines
        .iter()
        .filter(|l| tenant.is_none_or(|t| l.tenant == t))
        .map(|l| {
            json!({
                "tenant": l.tenant,
                "key": (!l.key.is_empty()).then_some(&l.key),
                "name": (!l.name.is_empty()).then_some(&l.name),
                "limit_usd": l.limit,
                "spent_usd": l.spent,
                "reserved_usd": l.reserved,
                "remaining_usd": l.limit.map(|limit| (limit - l.spent - l.reserved).max(0.0)),
            })
        })
        .collect();
    Ok(Value::Array(data))
}

/// Jobs by state (every state, zeros included).
async fn job_counts(app: &AppState, tenant: Option<&str>) -> Result<Value, StoreError> {
    let mut counts = serde_json::Map::new();
    for s in crate::store::JobState::ALL {
        counts.insert(s.as_str().into(), json!(0));
    }
    for (state, n) in app.store.count_jobs(tenant).await? {
        counts.insert(state.as_str().into(), json!(n));
    }
    Ok(Value::Object(counts))
}
