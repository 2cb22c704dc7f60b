//! Operations endpoints: liveness, readiness (storage reachable), Prometheus
//! metrics, and `/v1/stats` (admin: every tenant; tenant key: its own).

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::error::ApiError;
use super::{AppState, Caller};
use crate::tenants::Principal;

pub async fn healthz() -> Json<Value> {
    Json(json!({"status": "ok"}))
}

pub async fn readyz(State(app): State<AppState>) -> Response {
    match tokio::time::timeout(Duration::from_secs(2), app.store.ping()).await {
        Ok(Ok(())) => Json(json!({"status": "ready", "storage": "ok"})).into_response(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness: storage unreachable");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                Json(json!({"status": "unavailable", "storage": "unreachable"})),
            )
                .into_response()
        }
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "unavailable", "storage": "timeout"})),
        )
            .into_response(),
    }
}

pub async fn metrics(
    State(app): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if app.config.admin.metrics_require_key {
        let auth = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes());
        if app.keyring.authenticate(auth) != Some(Principal::Admin) {
            return Err(ApiError::AdminOnly);
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
    match &caller.0 {
        Principal::Tenant(t) => {
            let jobs = job_counts(&app, Some(t)).await;
            Ok(Json(json!({
                "object": "stats",
                "tenant": t.as_ref(),
                "at": crate::jobs::rfc3339(now),
                "coalescing": app.metrics.stats(Some(t)),
                "jobs": jobs,
            })))
        }
        Principal::Admin => {
            let mut tenants = serde_json::Map::new();
            for name in app.metrics.tenant_names() {
                tenants.insert(
                    name.to_string(),
                    serde_json::to_value(app.metrics.stats(Some(name))).unwrap_or_default(),
                );
            }
            let unknown = app
                .store
                .unknown_attempts()
                .await
                .map(|v| v.len())
                .unwrap_or(0);
            Ok(Json(json!({
                "object": "stats",
                "at": crate::jobs::rfc3339(now),
                "coalescing": app.metrics.stats(None),
                "tenants": tenants,
                "jobs": job_counts(&app, None).await,
                "unknown_attempts": unknown,
                "attempt_races": app.metrics.attempt_races(),
                "inflight_flights": app.coalescer.table.inflight(),
                "waiting_followers": app.coalescer.table.followers(),
                "replica": app.jobs.worker_id,
                "backend": if app.config.coalescing.backend == "memory" { "memory" } else { "redis" },
                "redis_connected": app.coalescer.shared.get().map(|s| s.healthy()),
                "redis_errors": app.metrics.redis_errors.get(),
            })))
        }
    }
}

async fn job_counts(app: &AppState, tenant: Option<&str>) -> Value {
    let mut counts = serde_json::Map::new();
    for s in crate::store::JobState::ALL {
        counts.insert(s.as_str().into(), json!(0));
    }
    if let Ok(rows) = app.store.count_jobs(tenant).await {
        for (state, n) in rows {
            counts.insert(state.as_str().into(), json!(n));
        }
    }
    Value::Object(counts)
}
