//! OpenAI's Files and Batch endpoints on the provider side, as a gateway
//! uses them to send a batch of chat requests to a provider: `POST
//! /v1/files` (a multipart form: `purpose` = `batch` and a JSONL `file`),
//! `GET` and `DELETE /v1/files/{id}`, `GET /v1/files/{id}/content`,
//! `POST` and `GET /v1/batches`, `GET /v1/batches/{id}` and `POST
//! /v1/batches/{id}/cancel` (each also without the `/v1` prefix), in
//! OpenAI's shapes, errors included.
//!
//! A batch runs in a tokio task of its own, started when it is created:
//! `validating` (an empty input file or a `custom_id` used twice fails the
//! batch, as OpenAI does), then `in_progress`, then `completed` with an
//! output file (the lines answered 200) and an error file (the others),
//! each present only if it has a line. Each request line is answered as
//! `POST /v1/chat/completions` answers its body under the behaviour of the
//! moment (its content, `pad_bytes`, `fail_status` and `fail_rate`; not
//! latency, resets or garbage), and is counted and logged as a call of
//! endpoint `batch_line` (`Stats::batch_lines` counts them too). A line
//! that cannot be read as a request (no JSON object, no `custom_id`,
//! another method or URL) is no call: its error line has `response: null`
//! and an `error` instead.
//!
//! A batch created while the behaviour holds (`hold` or `hang`) stays
//! `in_progress`, none of its lines run, until `POST /_mock/release` (with
//! no `seq`, or naming the batch), a cancel, a reset (which forgets it) or
//! shutdown. Files and batches live in memory until a reset; their ids
//! (`file-mock-<n>`, `batch_mock_<n>`, `batch_req_<n>`) are never given
//! twice, not even across a reset, so an id kept from before a reset is
//! unknown after it, never another's.

use std::cmp::Reverse;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::multipart::MultipartRejection;
use axum::extract::{Multipart, Path, Query, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::answer::{error_body, now_secs, plain_body};
use super::routes::{NOT_AN_OBJECT, drawn_failure, json_response, sent_of};
use super::state::{Arrival, Incoming, Outcome, Release, Sent, Shared};
use super::{Behaviour, Endpoint};

/// The one endpoint the mock runs batches of.
const CHAT: &str = "/v1/chat/completions";
/// The one completion window OpenAI offers.
const WINDOW: &str = "24h";
/// How long after its creation a batch expires: its 24-hour window.
const EXPIRES_AFTER_SECS: u64 = 24 * 60 * 60;
/// The purpose of the files a batch reads.
const BATCH: &str = "batch";
/// The purpose of the files a batch writes.
const BATCH_OUTPUT: &str = "batch_output";
/// The longest filename kept (in characters).
const MAX_FILENAME: usize = 255;
/// Lines run between two yields to the runtime.
const LINES_PER_YIELD: usize = 64;
/// How many batches `GET /v1/batches` lists when not told.
const DEFAULT_LIST_LIMIT: usize = 20;
/// The most it lists at once.
const MAX_LIST_LIMIT: usize = 100;

/// The files and batches, in the shared state.
#[derive(Default)]
pub(crate) struct Store {
    /// The last numbers given to a file, a batch and an output or error
    /// line (never reset).
    files_made: u64,
    batches_made: u64,
    lines_made: u64,
    files: HashMap<String, StoredFile>,
    batches: HashMap<String, Batch>,
}

impl Store {
    /// Forgets every file and batch (a held batch's task ends when it
    /// wakes, finding its batch gone); the numbering goes on.
    pub(crate) fn forget(&mut self) {
        self.files.clear();
        self.batches.clear();
    }

    /// Keeps a new file.
    fn add_file(&mut self, filename: String, purpose: &'static str, bytes: Bytes) -> &StoredFile {
        self.files_made += 1;
        let file = StoredFile {
            id: format!("file-mock-{}", self.files_made),
            filename,
            purpose,
            created_at: now_secs(),
            bytes,
        };
        self.files.entry(file.id.clone()).or_insert(file)
    }

    /// The batches, oldest first.
    fn batches_in_order(&self) -> Vec<&Batch> {
        let mut batches: Vec<&Batch> = self.batches.values().collect();
        batches.sort_by_key(|batch| batch.number);
        batches
    }

    /// Batch `id` fails validation with `errors` (or ends cancelled, if it
    /// was cancelled meanwhile).
    fn fail(&mut self, id: &str, errors: Value) {
        let Some(batch) = self.batches.get_mut(id) else {
            return;
        };
        // Its task has ended: nothing left to release.
        batch.hold = None;
        let now = now_secs();
        match batch.status {
            Status::Validating => {
                batch.status = Status::Failed;
                batch.failed_at = Some(now);
                batch.errors = Some(errors);
            }
            Status::Cancelling => {
                batch.status = Status::Cancelled;
                batch.cancelled_at = Some(now);
            }
            _ => {}
        }
    }

    /// Batch `id` passed validation with `total` lines: `in_progress`,
    /// unless it was cancelled meanwhile.
    fn start(&mut self, id: &str, total: u64) {
        if let Some(batch) = self.batches.get_mut(id) {
            batch.total = total;
            if batch.status == Status::Validating {
                batch.status = Status::InProgress;
                batch.in_progress_at = Some(now_secs());
            }
        }
    }

    /// Counts one line of batch `id` done, successful or not.
    fn tally(&mut self, id: &str, ok: bool) {
        if let Some(batch) = self.batches.get_mut(id) {
            if ok {
                batch.completed += 1;
            } else {
                batch.failed += 1;
            }
        }
    }

    /// Ends batch `id` with its output and error files (each kept only if
    /// it has a line): `completed`, or `cancelled` if it was cancelled.
    fn finish(&mut self, id: &str, output: Vec<u8>, errors: Vec<u8>) {
        let status = match self.batches.get(id).map(|batch| batch.status) {
            Some(Status::InProgress) => Status::Completed,
            Some(Status::Cancelling) => Status::Cancelled,
            _ => return,
        };
        let mut file = |bytes: Vec<u8>, kind: &str| {
            (!bytes.is_empty()).then(|| {
                let name = format!("{id}_{kind}.jsonl");
                self.add_file(name, BATCH_OUTPUT, Bytes::from(bytes))
                    .id
                    .clone()
            })
        };
        let output_file_id = file(output, "output");
        let error_file_id = file(errors, "error");
        let Some(batch) = self.batches.get_mut(id) else {
            return;
        };
        let now = now_secs();
        batch.status = status;
        batch.output_file_id = output_file_id;
        batch.error_file_id = error_file_id;
        if status == Status::Completed {
            batch.finalizing_at = Some(now);
            batch.completed_at = Some(now);
        } else {
            batch.cancelled_at = Some(now);
        }
    }
}

/// A file: an uploaded input, or a batch's output or error file.
struct StoredFile {
    id: String,
    filename: String,
    purpose: &'static str,
    /// Unix seconds.
    created_at: u64,
    bytes: Bytes,
}

impl StoredFile {
    /// The file object, as OpenAI shows it.
    fn object(&self) -> Value {
        json!({
            "id": self.id,
            "object": "file",
            "bytes": self.bytes.len(),
            "created_at": self.created_at,
            "expires_at": null,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": null,
        })
    }
}

/// Where a batch is (OpenAI's `finalizing` passes within one step here,
/// and a batch never expires).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Validating,
    Failed,
    InProgress,
    Completed,
    Cancelling,
    Cancelled,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Validating => "validating",
            Status::Failed => "failed",
            Status::InProgress => "in_progress",
            Status::Completed => "completed",
            Status::Cancelling => "cancelling",
            Status::Cancelled => "cancelled",
        }
    }
}

/// A provider batch.
struct Batch {
    /// Its number, in its id; orders the batches.
    number: u64,
    id: String,
    endpoint: String,
    input_file_id: String,
    completion_window: String,
    /// An object, or null.
    metadata: Value,
    status: Status,
    /// Why it failed validation (OpenAI's list of errors).
    errors: Option<Value>,
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    /// Unix seconds, as every `*_at`.
    created_at: u64,
    in_progress_at: Option<u64>,
    finalizing_at: Option<u64>,
    completed_at: Option<u64>,
    failed_at: Option<u64>,
    cancelling_at: Option<u64>,
    cancelled_at: Option<u64>,
    /// The request counts.
    total: u64,
    completed: u64,
    failed: u64,
    /// The input file's bytes when the batch was created.
    input: Bytes,
    /// What its creation request carried (credentials...), recorded with
    /// each of its lines.
    sent: Sent,
    /// Set while it is held: sending on it lets the batch run.
    hold: Option<oneshot::Sender<Release>>,
}

impl Batch {
    /// The batch object, as OpenAI shows it.
    fn object(&self) -> Value {
        json!({
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": self.errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status.as_str(),
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": self.created_at + EXPIRES_AFTER_SECS,
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": null,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.total,
                "completed": self.completed,
                "failed": self.failed,
            },
            "metadata": self.metadata,
        })
    }
}

/// OpenAI's error answer for a request it refuses.
fn invalid(status: StatusCode, message: &str, param: Option<&str>, code: Option<&str>) -> Response {
    let body = json!({"error": {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": code,
    }});
    json_response(status, &body)
}

fn no_file(id: &str) -> Response {
    invalid(
        StatusCode::NOT_FOUND,
        &format!("No such File object: {id}"),
        Some("id"),
        None,
    )
}

fn no_batch(id: &str) -> Response {
    invalid(
        StatusCode::NOT_FOUND,
        &format!("No such Batch object: {id}"),
        Some("batch_id"),
        None,
    )
}

fn missing(param: &str) -> Response {
    invalid(
        StatusCode::BAD_REQUEST,
        &format!("Missing required parameter: '{param}'."),
        Some(param),
        Some("missing_required_parameter"),
    )
}

fn invalid_value(param: &str, message: &str) -> Response {
    invalid(
        StatusCode::BAD_REQUEST,
        message,
        Some(param),
        Some("invalid_value"),
    )
}

/// `POST /v1/files`: a multipart form with `purpose` (`batch`, the only
/// one the mock keeps) and `file` (in either order; other fields are
/// ignored). Answers the file object.
pub(super) async fn upload(
    State(shared): State<Arc<Shared>>,
    form: Result<Multipart, MultipartRejection>,
) -> Response {
    let mut form = match form {
        Ok(form) => form,
        Err(rejection) => {
            let message = format!(
                "mock: expected a multipart/form-data body: {}",
                rejection.body_text()
            );
            return invalid(StatusCode::BAD_REQUEST, &message, Some("file"), None);
        }
    };
    let mut purpose: Option<String> = None;
    let mut file: Option<(String, Bytes)> = None;
    loop {
        let field = match form.next_field().await {
            Ok(Some(field)) => field,
            Ok(None) => break,
            Err(err) => {
                let message = format!("mock: the multipart form cannot be read: {err}");
                return invalid(StatusCode::BAD_REQUEST, &message, Some("file"), None);
            }
        };
        match field.name() {
            Some("purpose") => match field.text().await {
                Ok(text) => purpose = Some(text),
                Err(err) => {
                    let message = format!("mock: the purpose cannot be read: {err}");
                    return invalid(StatusCode::BAD_REQUEST, &message, Some("purpose"), None);
                }
            },
            Some("file") => {
                let filename: String = field
                    .file_name()
                    .filter(|name| !name.is_empty())
                    .unwrap_or("upload.jsonl")
                    .chars()
                    .take(MAX_FILENAME)
                    .collect();
                match field.bytes().await {
                    Ok(bytes) => file = Some((filename, bytes)),
                    Err(err) => {
                        let message = format!("mock: the file cannot be read: {err}");
                        return invalid(StatusCode::BAD_REQUEST, &message, Some("file"), None);
                    }
                }
            }
            _ => {}
        }
    }
    match purpose.as_deref().map(str::trim) {
        None => return missing("purpose"),
        Some(BATCH) => {}
        Some(other) => {
            let message = format!(
                "Invalid value for 'purpose': '{other}'. The mock keeps only files of purpose 'batch'."
            );
            return invalid_value("purpose", &message);
        }
    }
    let Some((filename, bytes)) = file else {
        return missing("file");
    };
    let object = shared.store().add_file(filename, BATCH, bytes).object();
    json_response(StatusCode::OK, &object)
}

/// `GET /v1/files/{id}`: the file object.
pub(super) async fn file(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let object = shared.store().files.get(&id).map(StoredFile::object);
    match object {
        Some(object) => json_response(StatusCode::OK, &object),
        None => no_file(&id),
    }
}

/// `DELETE /v1/files/{id}`: forgets the file (a batch made from it keeps
/// what it read).
pub(super) async fn delete_file(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Response {
    let removed = shared.store().files.remove(&id);
    match removed {
        Some(_) => json_response(
            StatusCode::OK,
            &json!({"id": id, "object": "file", "deleted": true}),
        ),
        None => no_file(&id),
    }
}

/// `GET /v1/files/{id}/content`: the file's bytes.
pub(super) async fn content(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let bytes = shared.store().files.get(&id).map(|file| file.bytes.clone());
    match bytes {
        Some(bytes) => (
            StatusCode::OK,
            [(
                CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            )],
            bytes,
        )
            .into_response(),
        None => no_file(&id),
    }
}

/// `POST /v1/batches`: `{"input_file_id", "endpoint":
/// "/v1/chat/completions", "completion_window": "24h", "metadata"?}`.
/// Answers the new batch (`validating`) and starts running it.
pub(super) async fn create(
    State(shared): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let Ok(Value::Object(request)) = serde_json::from_slice::<Value>(&body) else {
        return invalid(StatusCode::BAD_REQUEST, NOT_AN_OBJECT, None, None);
    };
    let text = |key: &str| request.get(key).and_then(Value::as_str);
    let Some(input_file_id) = text("input_file_id") else {
        return missing("input_file_id");
    };
    match text("endpoint") {
        None => return missing("endpoint"),
        Some(CHAT) => {}
        Some(other) => {
            let message = format!(
                "Invalid value for 'endpoint': '{other}'. The mock runs only batches of {CHAT}."
            );
            return invalid_value("endpoint", &message);
        }
    }
    match text("completion_window") {
        None => return missing("completion_window"),
        Some(WINDOW) => {}
        Some(other) => {
            let message =
                format!("Invalid value for 'completion_window': '{other}'. Supported: '24h'.");
            return invalid_value("completion_window", &message);
        }
    }
    let metadata = match request.get("metadata") {
        None | Some(Value::Null) => Value::Null,
        Some(Value::Object(map)) => Value::Object(map.clone()),
        Some(_) => {
            return invalid(
                StatusCode::BAD_REQUEST,
                "Invalid type for 'metadata': expected an object.",
                Some("metadata"),
                Some("invalid_type"),
            );
        }
    };
    let behaviour = shared.behaviour();
    let (hold, held) = if behaviour.hold || behaviour.hang {
        let (sender, receiver) = oneshot::channel();
        (Some(sender), Some(receiver))
    } else {
        (None, None)
    };

    let (id, object) = {
        let mut store = shared.store();
        let input = match store.files.get(input_file_id) {
            Some(file) if file.purpose == BATCH => file.bytes.clone(),
            Some(_) => {
                let message =
                    format!("The input file {input_file_id} does not have purpose 'batch'.");
                return invalid_value("input_file_id", &message);
            }
            None => {
                return invalid(
                    StatusCode::BAD_REQUEST,
                    &format!("No such File object: {input_file_id}"),
                    Some("input_file_id"),
                    Some("invalid_value"),
                );
            }
        };
        store.batches_made += 1;
        let number = store.batches_made;
        let batch = Batch {
            number,
            id: format!("batch_mock_{number}"),
            endpoint: CHAT.to_owned(),
            input_file_id: input_file_id.to_owned(),
            completion_window: WINDOW.to_owned(),
            metadata,
            status: Status::Validating,
            errors: None,
            output_file_id: None,
            error_file_id: None,
            created_at: now_secs(),
            in_progress_at: None,
            finalizing_at: None,
            completed_at: None,
            failed_at: None,
            cancelling_at: None,
            cancelled_at: None,
            total: 0,
            completed: 0,
            failed: 0,
            input,
            sent: sent_of(&headers, None),
            hold,
        };
        let object = batch.object();
        let id = batch.id.clone();
        store.batches.insert(id.clone(), batch);
        shared.batch_created();
        (id, object)
    };
    tokio::spawn(run(Arc::clone(&shared), id, held));
    json_response(StatusCode::OK, &object)
}

/// `GET /v1/batches?limit=N&after=ID`: the batches, newest first.
pub(super) async fn list(
    State(shared): State<Arc<Shared>>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let limit = match query.get("limit") {
        None => DEFAULT_LIST_LIMIT,
        Some(text) => match text.parse::<usize>() {
            Ok(limit) if (1..=MAX_LIST_LIMIT).contains(&limit) => limit,
            _ => return invalid_value("limit", "limit must be an integer from 1 to 100."),
        },
    };
    let store = shared.store();
    let mut batches = store.batches_in_order();
    batches.sort_by_key(|batch| Reverse(batch.number));
    let start = match query.get("after") {
        Some(after) => batches
            .iter()
            .position(|batch| &batch.id == after)
            .map_or(batches.len(), |index| index + 1),
        None => 0,
    };
    let page: Vec<&Batch> = batches.iter().skip(start).take(limit).copied().collect();
    let has_more = batches.len() > start + page.len();
    let body = json!({
        "object": "list",
        "data": page.iter().map(|batch| batch.object()).collect::<Vec<_>>(),
        "first_id": page.first().map(|batch| batch.id.clone()),
        "last_id": page.last().map(|batch| batch.id.clone()),
        "has_more": has_more,
    });
    drop(store);
    json_response(StatusCode::OK, &body)
}

/// `GET /v1/batches/{id}`: the batch as it is now.
pub(super) async fn retrieve(
    State(shared): State<Arc<Shared>>,
    Path(id): Path<String>,
) -> Response {
    let object = shared.store().batches.get(&id).map(Batch::object);
    match object {
        Some(object) => json_response(StatusCode::OK, &object),
        None => no_batch(&id),
    }
}

/// `POST /v1/batches/{id}/cancel`: a batch validating or in progress is
/// `cancelling` (answered so), then `cancelled` once its task stops, with
/// the output and error files of the lines run before; its other lines are
/// not run (a held batch runs none). 409 for a batch that has ended.
pub(super) async fn cancel(State(shared): State<Arc<Shared>>, Path(id): Path<String>) -> Response {
    let (object, hold) = {
        let mut store = shared.store();
        let Some(batch) = store.batches.get_mut(&id) else {
            return no_batch(&id);
        };
        match batch.status {
            Status::Validating | Status::InProgress => {
                batch.status = Status::Cancelling;
                batch.cancelling_at = Some(now_secs());
            }
            Status::Cancelling => {}
            ended => {
                let message = format!("Cannot cancel a batch with status '{}'.", ended.as_str());
                return invalid(StatusCode::CONFLICT, &message, None, None);
            }
        }
        (batch.object(), batch.hold.take())
    };
    // Wakes a held batch, whose task then ends it as cancelled.
    if let Some(hold) = hold {
        let _ = hold.send(Release::default());
    }
    json_response(StatusCode::OK, &object)
}

/// Lets the held batches run (batch `id` only, if given) with `release`
/// (its `status` fails each line with it, its `content` answers each line
/// with it); answers the ids released, oldest first.
pub(super) fn release(shared: &Shared, id: Option<&str>, release: &Release) -> Vec<String> {
    let holds: Vec<(String, oneshot::Sender<Release>)> = {
        let mut store = shared.store();
        let mut batches: Vec<&mut Batch> = store
            .batches
            .values_mut()
            .filter(|batch| id.is_none_or(|id| batch.id == id))
            .collect();
        batches.sort_by_key(|batch| batch.number);
        batches
            .into_iter()
            .filter_map(|batch| Some((batch.id.clone(), batch.hold.take()?)))
            .collect()
    };
    holds
        .into_iter()
        .map(|(id, hold)| {
            // The task is gone only on shutdown; nothing to do then.
            let _ = hold.send(release.clone());
            id
        })
        .collect()
}

/// Every batch, oldest first, as `GET /v1/batches/{id}` shows it.
pub(super) fn objects(shared: &Shared) -> Vec<Value> {
    shared
        .store()
        .batches_in_order()
        .into_iter()
        .map(Batch::object)
        .collect()
}

/// One line of an input file.
enum Line {
    /// A request: its `custom_id` and its body (any JSON: a body that is no
    /// object is answered 400, as the chat endpoint answers it).
    Request { custom_id: String, body: Value },
    /// A line that is no request.
    Unreadable {
        custom_id: Option<String>,
        code: &'static str,
        message: String,
    },
}

impl Line {
    fn read(raw: &[u8]) -> Line {
        let unreadable = |custom_id: Option<&str>, code, message: &str| Line::Unreadable {
            custom_id: custom_id.map(str::to_owned),
            code,
            message: message.to_owned(),
        };
        let Ok(Value::Object(mut object)) = serde_json::from_slice::<Value>(raw) else {
            return unreadable(None, "invalid_json", "This line is not a JSON object.");
        };
        let custom_id = match object.get("custom_id") {
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            _ => {
                return unreadable(
                    None,
                    "missing_custom_id",
                    "This line has no custom_id (a non-empty string).",
                );
            }
        };
        let id = Some(custom_id.as_str());
        if object.get("method").and_then(Value::as_str) != Some("POST") {
            return unreadable(id, "invalid_method", "This line's method must be POST.");
        }
        if object.get("url").and_then(Value::as_str) != Some(CHAT) {
            let message = format!("This line's url must be {CHAT}, the batch's endpoint.");
            return unreadable(id, "invalid_url", &message);
        }
        let Some(body) = object.remove("body") else {
            return unreadable(id, "missing_body", "This line has no body.");
        };
        Line::Request { custom_id, body }
    }
}

/// The lines of an input file (blank lines skipped), or OpenAI's list of
/// validation errors if the batch cannot run: an empty file, or a
/// `custom_id` used by two request lines.
fn read(input: &[u8]) -> Result<Vec<Line>, Value> {
    let errors = |code: &str, message: String, line: Option<usize>| {
        json!({"object": "list", "data": [
            {"code": code, "message": message, "param": null, "line": line},
        ]})
    };
    let mut lines = Vec::new();
    let mut seen = HashSet::new();
    for (index, raw) in input.split(|byte| *byte == b'\n').enumerate() {
        let raw = raw.trim_ascii();
        if raw.is_empty() {
            continue;
        }
        let line = Line::read(raw);
        if let Line::Request { custom_id, .. } = &line
            && !seen.insert(custom_id.clone())
        {
            let message = format!(
                "The custom_id '{custom_id}' is used by more than one request of the input file."
            );
            return Err(errors("duplicate_custom_id", message, Some(index + 1)));
        }
        lines.push(line);
    }
    if lines.is_empty() {
        let message = "The batch input file is empty.".to_owned();
        return Err(errors("empty_file", message, None));
    }
    Ok(lines)
}

/// Runs batch `id`: validates its input, waits while it is held (`held`),
/// then answers its lines in order, and ends it with its files. Stops
/// early if the batch is cancelled, and at once if a reset forgets it.
async fn run(shared: Arc<Shared>, id: String, held: Option<oneshot::Receiver<Release>>) {
    let Some(input) = shared.store().batches.get(&id).map(|b| b.input.clone()) else {
        return;
    };
    let lines = match read(&input) {
        Ok(lines) => lines,
        Err(errors) => {
            shared.store().fail(&id, errors);
            return;
        }
    };
    shared.store().start(&id, lines.len() as u64);
    let release = match held {
        // An error means the sender is gone: a reset forgot the batch,
        // which the first line then finds.
        Some(held) => tokio::select! {
            release = held => release.unwrap_or_default(),
            () = shared.shutdown.cancelled() => return,
        },
        None => Release::default(),
    };
    // Released lines follow the behaviour of the moment they run.
    let behaviour = shared.behaviour();
    let mut output = Vec::new();
    let mut errors = Vec::new();
    for (index, line) in lines.iter().enumerate() {
        if index > 0 && index % LINES_PER_YIELD == 0 {
            tokio::task::yield_now().await;
        }
        let Some((answered, ok)) = run_line(&shared, &id, line, &behaviour, &release) else {
            break;
        };
        shared.store().tally(&id, ok);
        let file = if ok { &mut output } else { &mut errors };
        file.extend_from_slice(answered.to_string().as_bytes());
        file.push(b'\n');
    }
    shared.store().finish(&id, output, errors);
}

/// Runs one line of batch `id`, unless the batch no longer runs
/// (cancelled, or forgotten by a reset): its output or error line, and
/// whether it is a success (status 200).
fn run_line(
    shared: &Shared,
    id: &str,
    line: &Line,
    behaviour: &Behaviour,
    release: &Release,
) -> Option<(Value, bool)> {
    let answered = match line {
        Line::Request { custom_id, body } => {
            let (line_id, arrival) = admit(shared, id, |sent| {
                shared.arrive(Incoming {
                    endpoint: Endpoint::BatchLine,
                    body: Arc::new(body.clone()),
                    sent,
                    stream: false,
                    items: 0,
                })
            })?;
            let (status, answer) = answer(shared, &arrival, body, behaviour, release);
            let response = json!({
                "status_code": status,
                "request_id": format!("req_mock_{}", arrival.seq),
                "body": answer,
            });
            let line = json!({
                "id": line_id,
                "custom_id": custom_id,
                "response": response,
                "error": null,
            });
            (line, status == 200)
        }
        Line::Unreadable {
            custom_id,
            code,
            message,
        } => {
            let (line_id, ()) = admit(shared, id, |_| ())?;
            let line = json!({
                "id": line_id,
                "custom_id": custom_id,
                "response": null,
                "error": {"code": code, "message": message},
            });
            (line, false)
        }
    };
    Some(answered)
}

/// Under the store lock, if batch `id` still runs: numbers a new output or
/// error line (`batch_req_<n>`) and calls `arrive` with what the batch's
/// creation carried. Calling `arrive` under the lock means a reset, which
/// forgets the batches first, cannot let a line of a forgotten batch count.
fn admit<T>(shared: &Shared, id: &str, arrive: impl FnOnce(Sent) -> T) -> Option<(String, T)> {
    let mut store = shared.store();
    let batch = store
        .batches
        .get(id)
        .filter(|batch| batch.status == Status::InProgress)?;
    let arrived = arrive(batch.sent.clone());
    store.lines_made += 1;
    Some((format!("batch_req_{}", store.lines_made), arrived))
}

/// The status and body with which `POST /v1/chat/completions` answers
/// `body` as call `arrival` under `behaviour` and `release` (latency,
/// resets and garbage aside), counted as that call's outcome.
fn answer(
    shared: &Shared,
    arrival: &Arrival,
    body: &Value,
    behaviour: &Behaviour,
    release: &Release,
) -> (u16, Value) {
    if !body.is_object() {
        shared.count(arrival, Outcome::Failed(400));
        return (400, error_body(400, NOT_AN_OBJECT, None));
    }
    // A release that chose the content chose success, as for a chat call.
    let failure = match (release.status, &release.content) {
        (Some(status), _) => Some(status),
        (None, Some(_)) => None,
        (None, None) => drawn_failure(behaviour),
    };
    if let Some(status) = failure {
        shared.count(arrival, Outcome::Failed(status));
        // As the chat endpoint answers it: an invalid status becomes 500.
        let status = StatusCode::from_u16(status).map_or(500, |code| code.as_u16());
        return (status, error_body(status, "mock failure", None));
    }
    let content = release.content.as_deref().or(behaviour.content.as_deref());
    let text = plain_body(body, arrival.seq, content, behaviour.pad_bytes);
    match serde_json::from_str::<Value>(&text) {
        Ok(completion) => {
            let outcome = match behaviour.pad_bytes {
                Some(_) => Outcome::Padded,
                None => Outcome::Completed,
            };
            shared.count(arrival, outcome);
            (200, completion)
        }
        Err(err) => {
            shared.count(arrival, Outcome::Failed(500));
            let message = format!("mock: cannot read its own answer: {err}");
            (500, error_body(500, &message, None))
        }
    }
}
