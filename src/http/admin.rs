//! Admin endpoints for contracts and failover (admin key only):
//!
//! - `POST /v1/admin/certify` `{"route": R, "target": P?}` runs
//!   certification like `idem certify`, records it, makes it count at once
//!   in this gateway, and returns the reports as JSON;
//! - `GET /v1/admin/routes` lists every route's targets with the
//!   certification state this gateway enforces for the current contract
//!   hash, whether failover may use them, and their circuit state.

use axum::Json;
use axum::extract::State;
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::{AppState, Caller};
use crate::contracts::certify::{self, CertifyError};
use crate::contracts::registry::{self, CertView};
use crate::contracts::{failover, short_hash};
use crate::routes::Routes;

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
            CertifyError::NoRoute(r) => ApiError::ModelNotFound(r),
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
        &app.config,
        &app.routes,
        &req.route,
        req.target.as_deref(),
    )
    .await?;
    // Count at once here; other replicas see it at their next refresh.
    registry::refresh(&*app.store, &app.routes).await?;
    Ok(Json(json!({
        "object": "certification",
        "route": req.route,
        "passed": reports.iter().all(|r| r.passed),
        "reports": reports,
    })))
}

/// `GET /v1/admin/routes`.
pub async fn routes(State(app): State<AppState>, caller: Caller) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    Ok(Json(
        json!({"object": "list", "data": routes_view(&app.routes, true)}),
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
