//! `POST /v1/messages/count_tokens`: Anthropic's token count of a Messages
//! request, which clients written for Anthropic (coding agents among them)
//! ask before they send one. Nothing is coalesced or cached: a count is a
//! cheap call, and no answer is shared.
//!
//! The route's primary target counts: an Anthropic one with its own
//! count_tokens API (sent the request as its client wrote it, as the
//! Messages face sends it), any other with the tokenizer of its model when
//! idem knows it (OpenAI's model families), else the request is refused
//! with a 400 that says why. Errors are in Anthropic's shape, as on the
//! Messages face.

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::error::ApiError;
use super::openai::{content_length, not_served, unknown_model};
use super::{AppState, Caller, faces, validate};
use crate::config::ProviderKind;
use crate::contracts::tokens::ModelLimits;
use crate::endpoints::chat::body_for;
use crate::providers::Endpoint;
use crate::shapes::messages;

/// `POST /v1/messages/count_tokens`: `{"input_tokens": N}`.
pub async fn count_tokens(State(app): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let counted = match count(&app, &headers, body).await {
        Ok(n) => Json(json!({"input_tokens": n})).into_response(),
        Err(e) => e.into_response(),
    };
    faces::anthropic_error(counted).await
}

async fn count(app: &AppState, headers: &HeaderMap, body: Body) -> Result<u32, ApiError> {
    let caller = Caller::authenticate_anthropic(headers, app)?;
    caller.limit(app)?;
    caller.tenant()?;
    let bytes = validate::read_body(body, content_length(headers), caller.body_limit(app)).await?;
    let mut request = validate::parse_object(&bytes, app.limits.max_json_depth)?;
    // A count takes no `max_tokens`; the translation wants one.
    if !request.contains_key("max_tokens") {
        request.insert("max_tokens".into(), json!(1));
    }
    let mut translated = messages::to_chat(&request)?;
    translated
        .chat
        .insert(messages::ORIGINAL.into(), messages::original(&request));
    let live = &caller.live;
    let Some(route) = live.route(&translated.model) else {
        return Err(unknown_model(
            &live.routes,
            &translated.model,
            Endpoint::Chat,
        ));
    };
    if !route.serves(Endpoint::Chat) {
        return Err(not_served(&translated.model, "messages"));
    }
    let Some(target) = route.targets.first() else {
        return Err(not_served(&translated.model, "messages"));
    };
    if target.provider.kind == ProviderKind::Anthropic {
        let body = body_for(target, &translated.chat);
        return match target.provider.count_tokens(&target.model, body).await {
            Some(Ok(n)) => Ok(n),
            Some(Err(why)) => Err(ApiError::Upstream {
                status: StatusCode::BAD_GATEWAY,
                message: format!("the provider could not count the tokens: {why}"),
                code: "upstream_error",
                retry_after: None,
            }),
            None => Err(cannot_count(&target.model)),
        };
    }
    let messages = match translated.chat.get("messages") {
        Some(Value::Array(m)) => m.as_slice(),
        _ => &[],
    };
    ModelLimits::of(&target.model, None, None)
        .count(&target.model, messages)
        .ok_or_else(|| cannot_count(&target.model))
}

/// Neither the target's API nor idem can count for this model.
fn cannot_count(model: &str) -> ApiError {
    ApiError::bad_request(
        format!(
            "idem cannot count tokens for model `{model}`: its provider has no token count API \
             and its tokenizer is unknown"
        ),
        "count_unavailable",
        Some("model"),
    )
}
