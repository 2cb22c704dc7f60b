//! The keys' endpoints: the admin's (`/v1/admin/keys`: create, list, show,
//! change, revoke, rotate, audit) around [`crate::keys::manage`], and a
//! key's own view of itself (`GET /v1/key`: its limits, its budget and
//! what is left of it, its tenant's budget).

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::error::ApiError;
use super::{ApiPath, ApiQuery, AppState, Caller};
use crate::keys::manage::{self, KeyError};
use crate::store::now_ms;

impl From<KeyError> for ApiError {
    fn from(e: KeyError) -> ApiError {
        match e {
            KeyError::Invalid { field, .. } => {
                ApiError::bad_request(e.to_string(), "invalid_key_field", Some(field))
            }
            KeyError::NotFound(_) => ApiError::NotFound("key"),
            KeyError::Revoked(_) => ApiError::Conflict {
                message: e.to_string(),
                code: "key_revoked",
            },
            KeyError::Store(s) => s.into(),
        }
    }
}

/// Who made an admin change, for the audit: the admin key, by the start
/// of its digest (never the key).
fn actor(headers: &HeaderMap) -> String {
    let token = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes())
        .and_then(crate::tenants::bearer_token)
        .unwrap_or_default();
    let digest = hex::encode(Sha256::digest(token));
    format!("admin key sha256:{}", &digest[..12])
}

/// A JSON object body, or 400.
fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request(
            "expected a JSON object",
            "invalid_json",
            None,
        )),
        Err(e) => Err(ApiError::bad_request(
            format!("invalid JSON: {e}"),
            "invalid_json",
            None,
        )),
    }
}

/// Bodies of these endpoints are small.
const MAX_BODY: usize = 64 * 1024;

async fn read_body(body: axum::body::Body) -> Result<Map<String, Value>, ApiError> {
    let bytes = axum::body::to_bytes(body, MAX_BODY)
        .await
        .map_err(|_| ApiError::PayloadTooLarge { limit: MAX_BODY })?;
    object(&bytes)
}

/// The key's view with its budget row.
async fn view(app: &AppState, key: &crate::store::KeyRecord) -> Result<Value, ApiError> {
    let now = now_ms();
    let budget = app.store.budget(&format!("key:{}", key.id), now).await?;
    Ok(manage::view(key, budget.as_ref(), now))
}

/// Puts a change in force on this replica at once (the others follow
/// within `budgets.keys_refresh`).
async fn refresh(app: &AppState) {
    if let Err(e) = app.keys.refresh(&*app.store, true).await {
        tracing::warn!(error = %e, "cannot read the keys again after a change");
    }
}

/// `POST /v1/admin/keys`: 201 with the key and its secret (shown once).
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    caller.require_admin()?;
    let spec = read_body(body).await?;
    let (key, secret) = manage::create(&*app.store, &spec, &actor(&headers)).await?;
    refresh(&app).await;
    let mut v = view(&app, &key).await?;
    v["key"] = json!(secret);
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    tenant: Option<String>,
}

/// `GET /v1/admin/keys[?tenant=T]`: every key, revoked ones too, oldest
/// first, with its budget.
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let now = now_ms();
    let keys = app.store.keys(q.tenant.as_deref()).await?;
    let budgets = app.store.budgets(now).await?;
    let data: Vec<Value> = keys
        .iter()
        .map(|k| {
            let scope = format!("key:{}", k.id);
            manage::view(k, budgets.iter().find(|b| b.scope == scope), now)
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

/// `GET /v1/admin/keys/{id}`.
pub async fn show(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let key = app.store.key(&id).await?.ok_or(ApiError::NotFound("key"))?;
    Ok(Json(view(&app, &key).await?))
}

/// `PATCH /v1/admin/keys/{id}`: the fields given change (`null` clears).
pub async fn update(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
    body: axum::body::Body,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let spec = read_body(body).await?;
    let key = manage::update(&*app.store, &id, &spec, &actor(&headers)).await?;
    refresh(&app).await;
    Ok(Json(view(&app, &key).await?))
}

/// `POST /v1/admin/keys/{id}/revoke`.
pub async fn revoke(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let key = manage::revoke(&*app.store, &id, &actor(&headers)).await?;
    refresh(&app).await;
    Ok(Json(view(&app, &key).await?))
}

/// `POST /v1/admin/keys/{id}/rotate`: the key with its new secret (shown
/// once); its id, spend, budget and history stay.
pub async fn rotate(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let (key, secret) = manage::rotate(&*app.store, &id, &actor(&headers)).await?;
    refresh(&app).await;
    let mut v = view(&app, &key).await?;
    v["key"] = json!(secret);
    Ok(Json(v))
}

/// `GET /v1/admin/keys/{id}/audit`: who changed the key, when, and what.
pub async fn audit(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    caller.require_admin()?;
    let entries = app.store.audit_log(Some(&id), 1000).await?;
    let data: Vec<Value> = entries
        .iter()
        .map(|e| {
            json!({
                "at": crate::store::rfc3339(e.at),
                "actor": e.actor,
                "action": e.action,
                "key_id": e.key_id,
                "tenant": e.tenant,
                "change": serde_json::from_str::<Value>(&e.detail).unwrap_or(Value::Null),
            })
        })
        .collect();
    Ok(Json(json!({"object": "list", "data": data})))
}

/// `GET /v1/key`: the caller's own key (none for a key of the
/// configuration file) and its tenant's budget, as far as they have one.
/// Reading it spends none of the key's requests per minute.
pub async fn own(State(app): State<AppState>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    let caller = Caller::authenticate(&headers, &app)?;
    let tenant = caller.tenant()?;
    let now = now_ms();
    let key = match &caller.key {
        Some(k) => {
            let mut v = view(&app, &k.record).await?;
            if let Some(o) = v.as_object_mut() {
                o.remove("metadata");
            }
            // Read as admission counts them (every replica's, through
            // Redis when the gateway has it), spending nothing.
            for (kind, window, field) in [
                ("rpm", &k.requests, "remaining_requests"),
                ("tpm", &k.tokens, "remaining_tokens"),
            ] {
                if let Some(w) = window {
                    let left = super::window(&app, &k.id, kind, w, 0, now)
                        .await
                        .unwrap_or(0);
                    v[field] = json!(left);
                }
            }
            v
        }
        None => Value::Null,
    };
    let tenant_budget = match caller
        .live
        .config
        .tenants
        .iter()
        .find(|t| *t.name == *tenant)
        .filter(|t| t.budget_usd.is_some())
    {
        Some(t) => {
            let row = app.store.budget(&format!("tenant:{tenant}"), now).await?;
            let limit = t
                .budget_usd
                .map(|d| i64::try_from(crate::prices::nanos(d)).unwrap_or(i64::MAX));
            manage::budget_view(row.as_ref(), limit, t.budget_period.as_deref())
        }
        None => Value::Null,
    };
    Ok(Json(json!({
        "object": "key_info",
        "tenant": &*tenant,
        "key": key,
        "tenant_budget": tenant_budget,
    })))
}
