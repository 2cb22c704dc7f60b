//! The answers the mock gives: a chat completion, the same completion as SSE
//! chunks, and the OpenAI error object. Pure functions of the request, so
//! idem's in-process provider of kind "mock" can answer exactly like the HTTP
//! mock without a socket.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

/// Longest part of the last user message echoed in a generated answer.
const ECHO_CHARS: usize = 200;

/// Upper bound on `n`, so a hostile request cannot make the mock build a
/// gigantic answer.
const MAX_CHOICES: u64 = 128;

/// The chat completion answering `request` as call number `seq`.
///
/// `content` fixes the assistant text; without it the text is
/// `mock answer #<seq> to: <last user message, first 200 chars>`.
/// `n > 1` gives `n` identical choices.
pub fn completion(request: &Value, seq: u64, content: Option<&str>) -> Value {
    let answer = Answer::new(request, seq, content);
    let choices: Vec<Value> = (0..answer.choices)
        .map(|index| {
            json!({
                "index": index,
                "message": {"role": "assistant", "content": answer.content},
                "logprobs": null,
                "finish_reason": "stop",
            })
        })
        .collect();
    json!({
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "system_fingerprint": "fp_mock",
        "choices": choices,
        "usage": answer.usage(),
    })
}

/// The same answer as [`completion`], as the JSON payloads of the SSE `data:`
/// events (without the `data: ` prefix and without the final `[DONE]`).
///
/// Per choice: a chunk with the role and empty content, the content split
/// after each space (the deltas concatenate to the content exactly), and a
/// chunk with an empty delta and `finish_reason: "stop"`. When the request
/// sets `stream_options.include_usage`, a last chunk with `choices: []` carries
/// the usage and the other chunks carry `usage: null`, as OpenAI does.
pub fn completion_chunks(request: &Value, seq: u64, content: Option<&str>) -> Vec<String> {
    let answer = Answer::new(request, seq, content);
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let chunk = |choices: Value, usage: Option<Value>| -> String {
        let mut chunk = json!({
            "id": answer.id,
            "object": "chat.completion.chunk",
            "created": answer.created,
            "model": answer.model,
            "system_fingerprint": "fp_mock",
            "choices": choices,
        });
        if include_usage {
            chunk["usage"] = usage.unwrap_or(Value::Null);
        }
        chunk.to_string()
    };
    let delta = |index: u64, delta: Value, finish: Option<&str>| -> Value {
        json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}])
    };

    let pieces: Vec<&str> = answer.content.split_inclusive(' ').collect();
    let mut chunks = Vec::with_capacity((pieces.len() + 2) * answer.choices as usize + 1);
    for index in 0..answer.choices {
        chunks.push(chunk(
            delta(index, json!({"role": "assistant", "content": ""}), None),
            None,
        ));
        for piece in &pieces {
            chunks.push(chunk(delta(index, json!({"content": piece}), None), None));
        }
        chunks.push(chunk(delta(index, json!({}), Some("stop")), None));
    }
    if include_usage {
        chunks.push(chunk(json!([]), Some(answer.usage())));
    }
    chunks
}

/// The OpenAI error object for a mock failure with this HTTP status.
pub(crate) fn error_body(status: u16, message: &str) -> Value {
    let (kind, code) = match status {
        400 | 413 | 422 => ("invalid_request_error", Value::Null),
        401 => ("authentication_error", json!("invalid_api_key")),
        403 => ("permission_error", Value::Null),
        404 => ("invalid_request_error", json!("model_not_found")),
        408 | 504 => ("timeout_error", Value::Null),
        429 => ("rate_limit_error", json!("rate_limit_exceeded")),
        _ => ("server_error", Value::Null),
    };
    json!({"error": {"message": message, "type": kind, "code": code, "param": null}})
}

/// What every form of one answer shares.
struct Answer {
    id: String,
    created: u64,
    model: Value,
    content: String,
    choices: u64,
    prompt_tokens: u64,
}

impl Answer {
    fn new(request: &Value, seq: u64, content: Option<&str>) -> Answer {
        let messages = request
            .get("messages")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let content = match content {
            Some(content) => content.to_owned(),
            None => format!("mock answer #{seq} to: {}", echoed(request)),
        };
        let prompt_chars = messages
            .iter()
            .map(|m| message_text(m).chars().count())
            .sum();
        Answer {
            id: format!("chatcmpl-mock-{seq}"),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            model: request.get("model").cloned().unwrap_or(json!("mock")),
            content,
            choices: request
                .get("n")
                .and_then(Value::as_u64)
                .unwrap_or(1)
                .clamp(1, MAX_CHOICES),
            prompt_tokens: estimate_tokens(prompt_chars),
        }
    }

    fn usage(&self) -> Value {
        let completion_tokens = estimate_tokens(self.content.chars().count()) * self.choices;
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }
}

/// What a generated answer echoes: the last user message's text, its first
/// 200 characters.
pub(crate) fn echoed(request: &Value) -> String {
    request
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|messages| {
            messages
                .iter()
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        })
        .map(message_text)
        .unwrap_or_default()
        .chars()
        .take(ECHO_CHARS)
        .collect()
}

/// The text of a message: a string content, or its text parts joined by spaces.
fn message_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// A rough token count (about four characters per token), at least 1.
fn estimate_tokens(chars: usize) -> u64 {
    (chars as u64 / 4).max(1)
}
