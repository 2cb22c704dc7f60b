//! The mock's embeddings: the request's validation (OpenAI's rules, as 400s
//! naming the offending `param`), the vectors, and the answer in OpenAI's
//! wire format, `float` or `base64`.
//!
//! A vector is a pure function of the item and the dimensions (not of the
//! model, the item's place in the batch or the call number), so a test can
//! recompute the vector of any item with [`embedding_of`] and check that each
//! returned vector is its own item's. It is derived with SHA-256 so that a
//! script can recompute it with nothing but its language's standard library:
//! `seed = SHA-256("idem mock embedding\n" || dimensions as u64 LE ||
//! encoding)`, where the encoding of a string item is `s` and its UTF-8 bytes
//! and of a token array `j` and its compact JSON (`[1,2,3]`); block `k` (from
//! 0) is `SHA-256(seed || k as u64 LE)`, read as eight u32 LE; each u32 `u`
//! gives the component `u / (2^32 - 1) * 2 - 1` (in f64), the first
//! `dimensions` components are divided by their L2 norm (summed in order,
//! in f64) and rounded to f32.

use base64::Engine as _;
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::Garbage;
use super::answer::{ECHO_CHARS, Garbled};
use super::answer::{cut_in_half, estimate_tokens, garbled_json, html_page, server_error};

/// The vectors' length when the request gives no `dimensions`: small, so
/// tests stay small.
pub const DEFAULT_DIMENSIONS: usize = 8;

/// The largest `dimensions` accepted.
pub const MAX_DIMENSIONS: usize = 4096;

/// The most items one request may embed (OpenAI's limit).
pub const MAX_ITEMS: usize = 2048;

/// The vector the mock answers for `item` (a string, or a token array: an
/// array of integers) with `dimensions` components: unit length, each
/// component in [-1, 1]. Any other JSON value gets a vector too (from its
/// compact JSON), though the mock never answers one.
pub fn embedding_of(item: &Value, dimensions: usize) -> Vec<f32> {
    let mut seed = Sha256::new();
    seed.update(b"idem mock embedding\n");
    seed.update((dimensions as u64).to_le_bytes());
    match item {
        Value::String(text) => {
            seed.update(b"s");
            seed.update(text.as_bytes());
        }
        other => {
            seed.update(b"j");
            seed.update(other.to_string().as_bytes());
        }
    }
    let seed = seed.finalize();
    let mut components: Vec<f64> = Vec::with_capacity(dimensions);
    let mut block: u64 = 0;
    while components.len() < dimensions {
        let digest = Sha256::new()
            .chain_update(seed)
            .chain_update(block.to_le_bytes())
            .finalize();
        for word in digest.chunks_exact(4) {
            let mut bytes = [0u8; 4];
            bytes.copy_from_slice(word);
            let unit = f64::from(u32::from_le_bytes(bytes)) / f64::from(u32::MAX);
            components.push(unit * 2.0 - 1.0);
        }
        block += 1;
    }
    components.truncate(dimensions);
    let norm = components.iter().fold(0.0, |sum, x| sum + x * x).sqrt();
    let norm = if norm > 0.0 { norm } else { 1.0 };
    components.iter().map(|x| (x / norm) as f32).collect()
}

/// A request OpenAI would refuse with a 400.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub(crate) struct InvalidRequest {
    /// The request field at fault, as the error object's `param`.
    pub(crate) param: &'static str,
    pub(crate) message: String,
}

fn invalid(param: &'static str, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest {
        param,
        message: message.into(),
    }
}

/// How the vectors go on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    /// A JSON array of numbers.
    Float,
    /// The little-endian f32 bytes, base64 (standard alphabet, padded).
    Base64,
}

/// A valid embeddings request.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EmbeddingsRequest {
    /// One value per item: a string or an array of token integers.
    pub(crate) items: Vec<Value>,
    pub(crate) model: Value,
    pub(crate) dimensions: usize,
    pub(crate) encoding: Encoding,
}

impl EmbeddingsRequest {
    /// Validates `request` (a JSON object) as OpenAI does.
    pub(crate) fn parse(request: &Value) -> Result<EmbeddingsRequest, InvalidRequest> {
        let items = items(request.get("input"))?;
        let model = match request.get("model") {
            None | Some(Value::Null) => json!("mock"),
            Some(model @ Value::String(_)) => model.clone(),
            Some(_) => return Err(invalid("model", "'model' must be a string")),
        };
        let dimensions = match request.get("dimensions") {
            None | Some(Value::Null) => DEFAULT_DIMENSIONS,
            Some(value) => value
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|n| (1..=MAX_DIMENSIONS).contains(n))
                .ok_or_else(|| {
                    invalid(
                        "dimensions",
                        format!(
                            "'dimensions' must be an integer from 1 to {MAX_DIMENSIONS}, not {value}"
                        ),
                    )
                })?,
        };
        let encoding = match request.get("encoding_format") {
            None | Some(Value::Null) => Encoding::Float,
            Some(Value::String(format)) if format == "float" => Encoding::Float,
            Some(Value::String(format)) if format == "base64" => Encoding::Base64,
            Some(other) => {
                return Err(invalid(
                    "encoding_format",
                    format!("'encoding_format' must be 'float' or 'base64', not {other}"),
                ));
            }
        };
        match request.get("user") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(_) => return Err(invalid("user", "'user' must be a string")),
        }
        Ok(EmbeddingsRequest {
            items,
            model,
            dimensions,
            encoding,
        })
    }

    /// The usage's token count: estimated for a string (as for a chat
    /// prompt), the length of a token array.
    fn prompt_tokens(&self) -> u64 {
        self.items
            .iter()
            .map(|item| match item {
                Value::String(text) => estimate_tokens(text.chars().count()),
                Value::Array(tokens) => tokens.len() as u64,
                _ => 0,
            })
            .sum()
    }
}

/// The items of `input`: a string, an array of strings, one token array
/// (an array of integers) or an array of token arrays; none empty.
fn items(input: Option<&Value>) -> Result<Vec<Value>, InvalidRequest> {
    const SHAPE: &str = "'input' must be a non-empty string, an array of non-empty strings, \
                         an array of token integers or an array of such arrays";
    let shape = || invalid("input", SHAPE);
    let input = match input {
        None | Some(Value::Null) => return Err(invalid("input", "'input' is required")),
        Some(input) => input,
    };
    let items = match input {
        Value::String(text) if !text.is_empty() => vec![input.clone()],
        Value::Array(values) if values.iter().all(is_token) && !values.is_empty() => {
            vec![input.clone()]
        }
        Value::Array(values) if !values.is_empty() => {
            let strings = values
                .iter()
                .all(|v| v.as_str().is_some_and(|s| !s.is_empty()));
            let token_arrays = values.iter().all(|v| {
                v.as_array()
                    .is_some_and(|tokens| !tokens.is_empty() && tokens.iter().all(is_token))
            });
            if !(strings || token_arrays) {
                return Err(shape());
            }
            values.clone()
        }
        _ => return Err(shape()),
    };
    if items.len() > MAX_ITEMS {
        return Err(invalid(
            "input",
            format!("'input' has more than {MAX_ITEMS} items"),
        ));
    }
    Ok(items)
}

/// A token: a non-negative integer that fits in a u32.
fn is_token(value: &Value) -> bool {
    value.as_u64().is_some_and(|n| u32::try_from(n).is_ok())
}

/// What the call log shows as the prompt: the first item (a string as is,
/// a token array as its JSON), its first 200 characters.
pub(crate) fn echoed(request: &Value) -> String {
    let first = match request.get("input") {
        Some(Value::Array(values)) if values.iter().all(Value::is_number) => request.get("input"),
        Some(Value::Array(values)) => values.first(),
        other => other,
    };
    let text = match first {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    };
    text.chars().take(ECHO_CHARS).collect()
}

#[derive(Serialize)]
struct List<'a> {
    object: &'static str,
    data: Vec<Embedding>,
    model: &'a Value,
    usage: Usage,
}

#[derive(Serialize)]
struct Embedding {
    object: &'static str,
    index: usize,
    embedding: Vector,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Vector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    total_tokens: u64,
}

/// The body of the answer: `{"object": "list", "data": [...], "model",
/// "usage"}`, one embedding per item, in order.
pub(crate) fn answer_body(request: &EmbeddingsRequest) -> Result<String, serde_json::Error> {
    let data = request
        .items
        .iter()
        .enumerate()
        .map(|(index, item)| {
            let vector = embedding_of(item, request.dimensions);
            let embedding = match request.encoding {
                Encoding::Float => Vector::Float(vector),
                Encoding::Base64 => {
                    let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                    Vector::Base64(base64::engine::general_purpose::STANDARD.encode(bytes))
                }
            };
            Embedding {
                object: "embedding",
                index,
                embedding,
            }
        })
        .collect();
    let tokens = request.prompt_tokens();
    let list = List {
        object: "list",
        data,
        model: &request.model,
        usage: Usage {
            prompt_tokens: tokens,
            total_tokens: tokens,
        },
    };
    serde_json::to_string(&list)
}

/// The mock's answer to an embeddings request, for the in-process `mock`
/// provider kind: 200 and the list, or 400 and OpenAI's error object for a
/// request OpenAI would refuse.
pub fn embeddings_answer(request: &Value) -> (reqwest::StatusCode, String) {
    let refused = |message: &str, param: Option<&str>| {
        let error = json!({"error": {"message": message, "type": "invalid_request_error", "param": param, "code": null}});
        (reqwest::StatusCode::BAD_REQUEST, error.to_string())
    };
    if !request.is_object() {
        return refused("mock: the body is not a JSON object", None);
    }
    match EmbeddingsRequest::parse(request) {
        Err(invalid) => refused(&invalid.message, Some(invalid.param)),
        Ok(parsed) => match answer_body(&parsed) {
            Ok(body) => (reqwest::StatusCode::OK, body),
            Err(e) => (
                reqwest::StatusCode::INTERNAL_SERVER_ERROR,
                json!({"error": {"message": format!("mock: cannot serialize: {e}"), "type": "server_error", "param": null, "code": null}}).to_string(),
            ),
        },
    }
}

/// The garbage of `kind` in place of the answer `body`. Embeddings do not
/// stream: `stream_error` is the `error_object`, `empty_choices` a list with
/// no data, `stream_without_done` and `finished_without_done` the answer as
/// one SSE event without `[DONE]` (a stream where a JSON document was due),
/// `done_without_finish` that event and `[DONE]`.
pub(crate) fn garbage(kind: Garbage, body: &str) -> Garbled {
    match kind {
        Garbage::NotJson => html_page(),
        Garbage::Truncated => garbled_json(cut_in_half(body).to_owned()),
        Garbage::Empty => garbled_json(String::new()),
        Garbage::ErrorObject | Garbage::StreamError => garbled_json(server_error()),
        Garbage::EmptyChoices => {
            let mut list = serde_json::from_str::<Value>(body).unwrap_or_else(|_| json!({}));
            list["data"] = json!([]);
            list["usage"] = json!({"prompt_tokens": 0, "total_tokens": 0});
            garbled_json(list.to_string())
        }
        Garbage::StreamWithoutDone | Garbage::FinishedWithoutDone => Garbled {
            content_type: "text/event-stream",
            frames: vec![bytes::Bytes::from(format!("data: {body}\n\n"))],
        },
        Garbage::DoneWithoutFinish => Garbled {
            content_type: "text/event-stream",
            frames: vec![bytes::Bytes::from(format!(
                "data: {body}\n\ndata: [DONE]\n\n"
            ))],
        },
    }
}
