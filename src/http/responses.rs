//! Stored responses (`store: true` on `POST /v1/responses`): `GET
//! /v1/responses/{id}` returns one, `DELETE` removes it. Every lookup is
//! scoped to the caller's tenant: another tenant's id is 404, never 403.

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use super::error::ApiError;
use super::{ApiPath, AppState, Caller};

/// `GET /v1/responses/{id}`: the response object as its asker got it.
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    let kept = app
        .store
        .response(&tenant, &id)
        .await?
        .ok_or(ApiError::NotFound("response"))?;
    serde_json::from_str(&kept.body)
        .map(Json)
        .map_err(|e| ApiError::Internal(anyhow::anyhow!("stored response {id} is unreadable: {e}")))
}

/// `DELETE /v1/responses/{id}`: `{"id", "object": "response.deleted",
/// "deleted": true}`, as OpenAI answers.
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    if !app.store.delete_response(&tenant, &id).await? {
        return Err(ApiError::NotFound("response"));
    }
    Ok(Json(
        json!({"id": id, "object": "response.deleted", "deleted": true}),
    ))
}
