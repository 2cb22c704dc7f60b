//! OpenAI's Files API for the Batch API (docs/http-api.md, "Files"):
//! upload (a multipart form), list, read, download and delete a tenant's
//! files. Every lookup is scoped to the caller's tenant: another tenant's
//! file is 404.
//!
//! An upload is streamed into the store part by part
//! ([`crate::store::FileStore`]): idem holds at most two parts of it at a
//! time, whatever its size (reserved from the intake, as any body is:
//! docs/design.md, "Bounds on what a client can make idem hold"), and
//! refuses it (413) as soon as it passes `batches.max_file_bytes`. A
//! download streams the parts back.

use axum::Json;
use axum::body::Body;
use axum::extract::multipart::{Field, MultipartError, MultipartRejection};
use axum::extract::{Multipart, State};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::{Value, json};

use super::error::ApiError;
use super::{ApiPath, ApiQuery, AppState, Caller};
use crate::store::{FileRecord, Order, PART_BYTES, now_ms};

/// The one purpose idem keeps files for.
const BATCH: &str = "batch";
/// The longest a form's text field (`purpose`, `expires_after[...]`) may be.
const MAX_TEXT_FIELD: usize = 256;

/// A file as OpenAI's API shows it (times in seconds).
pub fn file_json(f: &FileRecord) -> Value {
    json!({
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at / 1000,
        "expires_at": f.expires_at.map(|t| t / 1000),
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": null,
    })
}

fn bad(message: impl Into<String>, code: &'static str, param: &str) -> ApiError {
    ApiError::bad_request(message, code, Some(param))
}

fn form_error(e: &MultipartError) -> ApiError {
    bad(
        format!("the multipart form cannot be read: {}", e.body_text()),
        "invalid_multipart",
        "file",
    )
}

/// What an upload has written so far.
struct Upload {
    file: FileRecord,
    /// The bytes not yet written as a part.
    pending: BytesMut,
    parts: i32,
    bytes: u64,
    lines: u64,
    /// The last byte written ends a line (or nothing was written).
    at_line_start: bool,
}

impl Upload {
    async fn take(&mut self, app: &AppState, chunk: &[u8], limit: u64) -> Result<(), ApiError> {
        self.bytes += chunk.len() as u64;
        if self.bytes > limit {
            return Err(ApiError::PayloadTooLarge {
                limit: usize::try_from(limit).unwrap_or(usize::MAX),
            });
        }
        self.lines += memchr::memchr_iter(b'\n', chunk).count() as u64;
        if let Some(last) = chunk.last() {
            self.at_line_start = *last == b'\n';
        }
        self.pending.extend_from_slice(chunk);
        while self.pending.len() >= PART_BYTES {
            let part = self.pending.split_to(PART_BYTES).freeze();
            self.put(app, part).await?;
        }
        Ok(())
    }

    async fn put(&mut self, app: &AppState, part: Bytes) -> Result<(), ApiError> {
        app.store
            .put_file_part(&self.file.id, self.parts, &part)
            .await?;
        self.parts += 1;
        Ok(())
    }

    /// The rest written; the file's size and lines.
    async fn finish(&mut self, app: &AppState) -> Result<(), ApiError> {
        if !self.pending.is_empty() {
            let part = std::mem::take(&mut self.pending).freeze();
            self.put(app, part).await?;
        }
        if !self.at_line_start {
            self.lines += 1;
        }
        self.file.bytes = i64::try_from(self.bytes).unwrap_or(i64::MAX);
        self.file.lines = i64::try_from(self.lines).unwrap_or(i64::MAX);
        Ok(())
    }
}

/// A text field of the form, bounded.
async fn text(mut field: Field<'_>, name: &str) -> Result<String, ApiError> {
    let mut out = Vec::new();
    while let Some(chunk) = field.chunk().await.map_err(|e| form_error(&e))? {
        out.extend_from_slice(&chunk);
        if out.len() > MAX_TEXT_FIELD {
            return Err(bad(
                format!("'{name}' is longer than {MAX_TEXT_FIELD} bytes"),
                "invalid_value",
                name,
            ));
        }
    }
    String::from_utf8(out).map_err(|_| bad(format!("'{name}' is not UTF-8"), "invalid_value", name))
}

/// What the form said besides the file.
#[derive(Default)]
struct Form {
    purpose: Option<String>,
    expires_after_seconds: Option<i64>,
    anchor: Option<String>,
}

/// `POST /v1/files`: a multipart form with `file` and `purpose` (in either
/// order), and optionally `expires_after[anchor]` (`created_at`) and
/// `expires_after[seconds]` (3600 to 2592000; else `batches.file_retention`).
pub async fn upload(
    State(app): State<AppState>,
    caller: Caller,
    form: Result<Multipart, MultipartRejection>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    // What the upload buffers at once (two parts) counts in the intake,
    // so that many uploads at once cannot take more than bodies may.
    let _share = app.intake.hold(2 * PART_BYTES).await?;
    let mut form = form.map_err(|e| {
        bad(
            format!("expected a multipart/form-data body: {}", e.body_text()),
            "invalid_multipart",
            "file",
        )
    })?;
    let limit = caller.live.config.batches.max_file_bytes;
    let mut said = Form::default();
    let mut upload: Option<Upload> = None;
    let read = async {
        while let Some(field) = form.next_field().await.map_err(|e| form_error(&e))? {
            let name = field.name().unwrap_or_default().to_owned();
            match name.as_str() {
                "purpose" => said.purpose = Some(text(field, "purpose").await?),
                "expires_after[anchor]" => said.anchor = Some(text(field, &name).await?),
                "expires_after[seconds]" => {
                    let s = text(field, &name).await?;
                    let secs = s
                        .trim()
                        .parse::<i64>()
                        .ok()
                        .filter(|s| (3600..=2_592_000).contains(s))
                        .ok_or_else(|| {
                            bad(
                                "expires_after[seconds] must be 3600 to 2592000",
                                "invalid_value",
                                &name,
                            )
                        })?;
                    said.expires_after_seconds = Some(secs);
                }
                "file" if upload.is_some() => {
                    return Err(bad("the form has two files", "invalid_value", "file"));
                }
                "file" => {
                    let filename = field
                        .file_name()
                        .filter(|n| !n.is_empty())
                        .unwrap_or("upload.jsonl")
                        .chars()
                        .take(255)
                        .collect();
                    let file = FileRecord {
                        id: format!("file-{}", uuid::Uuid::now_v7().simple()),
                        tenant: tenant.to_string(),
                        purpose: said.purpose.clone().unwrap_or_else(|| BATCH.into()),
                        filename,
                        bytes: 0,
                        lines: 0,
                        created_at: now_ms(),
                        expires_at: None,
                    };
                    app.store.begin_file(&file).await?;
                    let up = upload.insert(Upload {
                        file,
                        pending: BytesMut::new(),
                        parts: 0,
                        bytes: 0,
                        lines: 0,
                        at_line_start: true,
                    });
                    let mut field = field;
                    while let Some(chunk) = field.chunk().await.map_err(|e| form_error(&e))? {
                        up.take(&app, &chunk, limit).await?;
                    }
                    up.finish(&app).await?;
                }
                other => {
                    return Err(bad(
                        format!("unknown parameter '{other}'"),
                        "unknown_parameter",
                        other,
                    ));
                }
            }
        }
        Ok::<(), ApiError>(())
    };
    let result = match read.await {
        Ok(()) => check(&said, upload.as_ref()),
        Err(e) => Err(e),
    };
    let Some(mut up) = upload else {
        result?;
        return Err(bad(
            "Missing required parameter: 'file'.",
            "missing_required_parameter",
            "file",
        ));
    };
    if let Err(e) = result {
        // Best effort: what is left of a refused upload is swept anyway.
        let _ = app.store.delete_file(&tenant, &up.file.id).await;
        return Err(e);
    }
    let retention = said.expires_after_seconds.map_or_else(
        || i64::try_from(caller.live.config.batches.file_retention.as_millis()).unwrap_or(i64::MAX),
        |s| s * 1000,
    );
    up.file.purpose = BATCH.into();
    up.file.expires_at = Some(up.file.created_at.saturating_add(retention));
    if !app.store.finish_file(&up.file).await? {
        return Err(ApiError::internal(anyhow::anyhow!(
            "upload {} was swept before it finished",
            up.file.id
        )));
    }
    tracing::info!(tenant = %tenant, file = %up.file.id, bytes = up.file.bytes, lines = up.file.lines, "file uploaded");
    Ok(Json(file_json(&up.file)))
}

/// The form's checks once it is all in.
fn check(said: &Form, upload: Option<&Upload>) -> Result<(), ApiError> {
    let Some(purpose) = said.purpose.as_deref() else {
        return Err(bad(
            "Missing required parameter: 'purpose'.",
            "missing_required_parameter",
            "purpose",
        ));
    };
    if purpose != BATCH {
        return Err(bad(
            format!(
                "idem keeps files for the Batch API only: purpose must be 'batch', not '{purpose}'"
            ),
            "invalid_value",
            "purpose",
        ));
    }
    if said.anchor.as_deref().is_some_and(|a| a != "created_at") {
        return Err(bad(
            "expires_after[anchor] must be 'created_at'",
            "invalid_value",
            "expires_after[anchor]",
        ));
    }
    if let Some(up) = upload {
        if !up.file.filename.ends_with(".jsonl") {
            return Err(bad(
                "Invalid file format for Batch API. Must be .jsonl",
                "invalid_file_format",
                "file",
            ));
        }
        if up.bytes == 0 {
            return Err(bad("the file is empty", "invalid_file_format", "file"));
        }
    }
    Ok(())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    #[serde(default)]
    purpose: Option<String>,
    #[serde(default)]
    limit: Option<u32>,
    #[serde(default)]
    order: Option<String>,
    #[serde(default)]
    after: Option<String>,
}

/// `GET /v1/files`: the tenant's files, newest first (`order=asc`: oldest
/// first), `limit` 1 to 10,000 (default 10,000), after the file `after`.
pub async fn list(
    State(app): State<AppState>,
    caller: Caller,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    let limit = q.limit.unwrap_or(10_000);
    if !(1..=10_000).contains(&limit) {
        return Err(bad("limit must be 1 to 10000", "invalid_value", "limit"));
    }
    let order = match q.order.as_deref() {
        None | Some("desc") => Order::Descending,
        Some("asc") => Order::Ascending,
        Some(_) => {
            return Err(bad(
                "order must be 'asc' or 'desc'",
                "invalid_value",
                "order",
            ));
        }
    };
    let mut files = app
        .store
        .list_files(
            &tenant,
            q.purpose.as_deref(),
            q.after.as_deref(),
            order,
            limit + 1,
        )
        .await?;
    let has_more = files.len() > limit as usize;
    files.truncate(limit as usize);
    Ok(Json(json!({
        "object": "list",
        "data": files.iter().map(file_json).collect::<Vec<_>>(),
        "first_id": files.first().map(|f| f.id.as_str()),
        "last_id": files.last().map(|f| f.id.as_str()),
        "has_more": has_more,
    })))
}

async fn load(app: &AppState, tenant: &str, id: &str) -> Result<FileRecord, ApiError> {
    app.store
        .file(tenant, id)
        .await?
        .ok_or(ApiError::NotFound("file"))
}

/// `GET /v1/files/{id}`.
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    Ok(Json(file_json(&load(&app, &tenant, &id).await?)))
}

/// `GET /v1/files/{id}/content`: the file as uploaded, streamed from the
/// store a part at a time. A part the store cannot give mid-way ends the
/// body short of its `Content-Length`, which the client sees as an error.
pub async fn content(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Response, ApiError> {
    let tenant = caller.tenant()?;
    let file = load(&app, &tenant, &id).await?;
    let store = app.store.clone();
    let parts = futures_util::stream::unfold(Some(0i32), move |next| {
        let store = store.clone();
        let id = id.clone();
        async move {
            let n = next?;
            match store.file_part(&id, n).await {
                Ok(Some(data)) => Some((Ok(Bytes::from(data)), Some(n + 1))),
                Ok(None) => None,
                Err(e) => {
                    tracing::warn!(file = %id, part = n, error = %e, "cannot read a file's part");
                    Some((Err(std::io::Error::other(e)), None))
                }
            }
        }
    });
    let mut response = Body::from_stream(parts).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from(file.bytes));
    Ok(response)
}

/// `DELETE /v1/files/{id}`: the file and its content.
pub async fn delete(
    State(app): State<AppState>,
    caller: Caller,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<Value>, ApiError> {
    let tenant = caller.tenant()?;
    load(&app, &tenant, &id).await?;
    if !app.store.delete_file(&tenant, &id).await? {
        return Err(ApiError::NotFound("file"));
    }
    Ok(Json(json!({"id": id, "object": "file", "deleted": true})))
}
