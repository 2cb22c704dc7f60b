//! OpenAI's Batch API (docs/http-api.md, "Batches"): create, read, list and
//! cancel a tenant's batches; the work is [`crate::batches`]'s. Every
//! lookup is scoped to the caller's tenant: another tenant's batch is 404.
//! Also the faces' checks a batch line gets ([`plan_line`]), which the
//! drivers reach through [`crate::batches::BatchEnv`].

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::jobs::{IDEMPOTENT_REPLAYED, idempotency_key};
use super::openai::content_length;
use super::validate;
use super::{ApiPath, ApiQuery, AppState, Caller, Shared};
use crate::batches::{BatchError, LineRefusal, MESSAGES_ENDPOINT, NewBatch, Planned, batch_json};
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint;
use crate::store::BatchRecord;

impl From<BatchError> for ApiError {
    fn from(e: BatchError) -> ApiError {
        let message = e.to_string();
        match e {
            BatchError::KeyReused => ApiError::Conflict {
                message,
                code: "idempotency_key_reused",
            },
            BatchError::NotFound => ApiError::NotFound("batch"),
            BatchError::Invalid { param, .. } => {
                ApiError::bad_request(message, "invalid_value", Some(param))
            }
            BatchError::TooMany { .. } => ApiError::KeyRateLimited {
                message,
                retry_after: 60,
                remaining_requests: None,
                remaining_tokens: None,
            },
            BatchError::NotCancellable { .. } => ApiError::Conflict {
                message,
                code: "batch_not_cancellable",
            },
            BatchError::NotDeletable { .. } => {
                ApiError::bad_request(message, "invalid_request", None)
            }
            BatchError::Store(e) => e.into(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateBody {
    input_file_id: String,
    endpoint: String,
    completion_window: String,
    #[serde(default)]
    metadata: Option<Map<String, Value>>,
}

/// `POST /v1/batches`: a batch of the tenant's input file. With an
/// `Idempotency-Key`, created again it is the same batch (409 if the
/// request differs).
pub async fn create(
    State(app): State<AppState>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let tenant = caller.tenant()?;
    let key = idempotency_key(&headers)?;
    let (bytes, share) = app
        .intake
        .read(body, content_length(&headers), caller.body_limit(&app))
        .await?;
    let object = validate::parse_object(&bytes, &app.limits)?;
    drop(share);
    let asked: CreateBody = serde_json::from_value(Value::Object(object)).map_err(|e| {
        ApiError::bad_request(
            format!("invalid batch request: {e}"),
            "invalid_request",
            None,
        )
    })?;
    let new = NewBatch {
        input_file_id: asked.input_file_id,
        endpoint: asked.endpoint,
        completion_window: asked.completion_window,
        metadata: asked.metadata,
        hash: None,
        total: 0,
    };
    let (batch, created) = app
        .batches
        .create(
            &tenant,
            caller.key.as_ref().map(|k| &*k.id),
            new,
            key,
            &caller.live.config.batches,
        )
        .await?;
    let mut resp = Json(batch_json(&batch)).into_response();
    if !created {
        resp.headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    }
    Ok(resp)
}

/// The tenant's batch `id` of this face (`messages`: a Message Batch).
pub(super) async fn load(
    app: &AppState,
    tenant: &str,
    id: &str,
    messages: bool,
) -> Result<BatchRecord, ApiError> {
    app.store
        .batch(Some(tenant), id)
        .await?
        .filter(|b| (b.endpoint == MESSAGES_ENDPOINT) == messages)
        .ok_or(ApiError::NotFound("batch"))
}

/// `GET /v1/batches/{id}`.
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    Ok(Json(batch_json(&load(&app, &tenant, &id, false).await?)))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default)]
    after: Option<String>,
}

/// `GET /v1/batches`: the tenant's batches, newest first, `limit` 1 to 100
/// (default 20), after the batch `after`.
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    let limit = q.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return Err(ApiError::bad_request(
            "limit must be 1 to 100",
            "invalid_value",
            Some("limit"),
        ));
    }
    let mut batches = app
        .store
        .list_batches(&tenant, false, q.after.as_deref(), limit + 1)
        .await?;
    let has_more = batches.len() > limit as usize;
    batches.truncate(limit as usize);
    Ok(Json(json!({
        "object": "list",
        "data": batches.iter().map(batch_json).collect::<Vec<_>>(),
        "first_id": batches.first().map(|b| b.id.as_str()),
        "last_id": batches.last().map(|b| b.id.as_str()),
        "has_more": has_more,
    })))
}

/// `POST /v1/batches/{id}/cancel`: `cancelling`, then `cancelled` once the
/// lines in flight have ended; 409 for a batch that has ended otherwise.
pub async fn cancel(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    load(&app, &tenant, &id, false).await?;
    Ok(Json(batch_json(&app.batches.cancel(&tenant, &id).await?)))
}

/// A refusal of a line's own, as its face would have answered it.
fn refusal(e: &ApiError, fails_batch: bool) -> LineRefusal {
    let param = match e {
        ApiError::BadRequest { param, .. } => param.clone(),
        _ => None,
    };
    LineRefusal {
        status: e.status().as_u16(),
        code: e.kind().1.to_string(),
        message: e.to_string(),
        param,
        fails_batch,
    }
}

/// A batch line's body, checked as `POST {endpoint}` checks a request and
/// routed for `tenant`: a model no route serves (for the endpoint) fails
/// the batch, as OpenAI's validation does; anything else the face would
/// refuse is the line's own error.
pub fn plan_line(
    app: &Shared,
    tenant: &str,
    dialect: Dialect,
    body: Map<String, Value>,
) -> Result<Planned, LineRefusal> {
    let req = match dialect {
        Dialect::Embeddings => return plan_embeddings(app, tenant, body),
        Dialect::Responses => validate::responses_request(body, &app.limits),
        Dialect::Messages => validate::messages_request(body, false, &app.limits),
        _ => validate::chat_request(body, &app.limits),
    }
    .map_err(|e| refusal(&e, false))?;
    if req.stream {
        return Err(refusal(
            &ApiError::bad_request(
                "a batch line cannot stream",
                "invalid_value",
                Some("stream"),
            ),
            false,
        ));
    }
    if dialect == Dialect::Responses
        && ["previous_response_id", "conversation"]
            .iter()
            .any(|f| req.body.get(*f).is_some_and(|v| !v.is_null()))
    {
        return Err(refusal(
            &ApiError::bad_request(
                "a batch line cannot continue a stored response or conversation",
                "invalid_value",
                Some("previous_response_id"),
            ),
            false,
        ));
    }
    let request = std::sync::Arc::unwrap_or_clone(req.body);
    routed(app, tenant, dialect, &req.model, None, request)
}

/// A line's embeddings request, checked as `POST /v1/embeddings` checks
/// one; it is fingerprinted whole (without `encoding_format`), as the face
/// fingerprints a request.
fn plan_embeddings(
    app: &Shared,
    tenant: &str,
    body: Map<String, Value>,
) -> Result<Planned, LineRefusal> {
    let req = crate::endpoints::embeddings::parse(body.clone()).map_err(|i| {
        refusal(
            &ApiError::bad_request(i.message, i.code, Some(i.param)),
            false,
        )
    })?;
    routed(
        app,
        tenant,
        Dialect::Embeddings,
        &req.model,
        Some(&req.whole),
        body,
    )
}

/// A checked line routed for `tenant`: its route (a model no route serves
/// for the endpoint fails the batch) and its fingerprint (of `whole`, or
/// of the request itself).
fn routed(
    app: &Shared,
    tenant: &str,
    dialect: Dialect,
    model: &str,
    whole: Option<&Map<String, Value>>,
    request: Map<String, Value>,
) -> Result<Planned, LineRefusal> {
    let live = app.live.load();
    let Some(route) = live.route(model) else {
        return Err(refusal(
            &super::openai::unknown_model(&live.routes, model, dialect),
            true,
        ));
    };
    if !route.serves(dialect) {
        return Err(refusal(
            &super::openai::not_served(model, dialect.as_str()),
            true,
        ));
    }
    let forwarded = Forwarded::default();
    let rules = fingerprint::Rules {
        dialect,
        headers: &forwarded,
        ..route.rules(tenant)
    };
    let fp = fingerprint::fingerprint(whole.unwrap_or(&request), None, &rules);
    Ok(Planned { route, fp, request })
}
