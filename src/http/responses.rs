//! Stored responses (`store: true` on `POST /v1/responses`): `GET
//! /v1/responses/{id}` returns one, `DELETE` removes it (and its answer
//! from every cache). Every lookup is scoped to the caller's tenant:
//! another tenant's id is 404, never 403. What is kept and how a
//! conversation continues is [`crate::conversations`]'s.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::{ApiPath, AppState, Caller};
use crate::conversations::{self, ConversationError};
use crate::fingerprint::Fingerprint;
use crate::flight::Source;

pub use crate::conversations::Turn as ResponsesAsk;

/// A Responses request's turn, and the request to send when it continues
/// a stored response (404 when this tenant kept none by that id; 400 past
/// `responses.max_conversation_bytes`).
pub async fn continued(
    app: &AppState,
    tenant: &str,
    request: &Map<String, Value>,
) -> Result<(ResponsesAsk, Option<Map<String, Value>>), ApiError> {
    let limit = app.live.load().config.responses.max_conversation_bytes;
    conversations::continued(&*app.store, tenant, request, limit)
        .await
        .map_err(|e| match e {
            ConversationError::NotFound(_) => ApiError::NotFound("previous response"),
            e @ ConversationError::TooLong { .. } => ApiError::bad_request(
                e.to_string(),
                "conversation_too_long",
                Some("previous_response_id"),
            ),
            ConversationError::Store(e) => e.into(),
            e @ ConversationError::Unreadable(_) => ApiError::Internal(anyhow::anyhow!(e)),
        })
}

/// Keeps a Responses answer (`store: true`) once it is whole. A plain
/// answer is kept before its client gets it, so that a `GET` (or a
/// continuation) right after finds it; a streamed one beside its relay, as
/// it ends.
pub async fn keep(
    app: &AppState,
    tenant: &Arc<str>,
    fp: &Fingerprint,
    turn: &ResponsesAsk,
    source: Source,
    stream: bool,
) {
    let keeping = {
        let (app, tenant, fp, turn) = (app.clone(), tenant.clone(), *fp, turn.clone());
        async move {
            let answer = match source {
                Source::Done(a) => a,
                Source::Live(f) => match f.done(None).await {
                    Some(a) => a,
                    None => return,
                },
            };
            let Some(kept) = conversations::stored(&tenant, &fp, &turn, &answer) else {
                return;
            };
            if let Err(e) = app.kept.keep(&*app.store, &kept).await {
                tracing::warn!(error = %e, response = %kept.id, "cannot keep a stored response");
            }
        }
    };
    if stream {
        tokio::spawn(keeping);
    } else {
        keeping.await;
    }
}

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
/// "deleted": true}`, as OpenAI answers. The answer is forgotten by every
/// cache too: asked again, the same request makes a new call.
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    let deleted =
        conversations::delete(&*app.store, &app.core.coalescer, &app.kept, &tenant, &id).await?;
    if !deleted {
        return Err(ApiError::NotFound("response"));
    }
    Ok(Json(
        json!({"id": id, "object": "response.deleted", "deleted": true}),
    ))
}
