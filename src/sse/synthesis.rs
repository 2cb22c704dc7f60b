//! A plain `chat.completion` rendered as the stream a live call would have
//! sent, for a streaming client whose answer was never streamed.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{PIECE_BYTES, pieces};

/// Renders a plain `chat.completion` as an SSE byte stream a client cannot
/// tell from a real one.
///
/// Per choice: a first chunk with the role (and `content: ""`, or null when
/// the message has no content) plus the message's non-text fields such as
/// `refusal: null` or `annotations`; then text fields such as
/// `reasoning_content` or `refusal`; then the content in one or a few
/// chunks (one chunk per token when `logprobs` has the tokens, each with its
/// logprob entry, as a live stream does); then each tool call (id, type and
/// name, then the arguments in pieces); then a chunk with the
/// `finish_reason`. Then, when `include_usage`, a chunk with `choices: []`
/// and the usage (every other chunk then carries `usage: null`, as OpenAI's
/// do); then `data: [DONE]`. Every event is `data: <json>\n\n`.
/// [`assemble`](super::assemble) turns the result back into the same completion.
pub fn synthesize(completion: &Value, include_usage: bool) -> Bytes {
    let field = |key: &str| completion.get(key).cloned().unwrap_or(Value::Null);
    let mut header = Map::new();
    header.insert("id".into(), field("id"));
    header.insert("object".into(), json!("chat.completion.chunk"));
    header.insert("created".into(), field("created"));
    header.insert("model".into(), field("model"));
    if let Some(tier) = completion.get("service_tier") {
        header.insert("service_tier".into(), tier.clone());
    }
    header.insert("system_fingerprint".into(), field("system_fingerprint"));

    let mut stream = Stream {
        out: Vec::with_capacity(1024),
        // Every chunk starts with the same header; it is serialized once and
        // the chunk's choices are appended after it. The header always has
        // "object", so the text ends in `}` after a value.
        prefix: {
            let mut text = Value::Object(header).to_string();
            text.pop();
            text.push_str(",\"choices\":");
            text
        },
        suffix: if include_usage {
            ",\"usage\":null}"
        } else {
            "}"
        },
    };

    let no_choices = Vec::new();
    let choices = completion
        .get("choices")
        .and_then(Value::as_array)
        .unwrap_or(&no_choices);
    for (position, choice) in choices.iter().enumerate() {
        synthesize_choice(&mut stream, choice, position);
    }
    if include_usage {
        stream.out.extend_from_slice(b"data: ");
        stream.out.extend_from_slice(stream.prefix.as_bytes());
        stream.out.extend_from_slice(b"[],\"usage\":");
        stream
            .out
            .extend_from_slice(field("usage").to_string().as_bytes());
        stream.out.extend_from_slice(b"}\n\n");
    }
    stream.out.extend_from_slice(b"data: [DONE]\n\n");
    Bytes::from(stream.out)
}

struct Stream {
    out: Vec<u8>,
    prefix: String,
    suffix: &'static str,
}

impl Stream {
    /// Writes one chunk event with one choice.
    fn chunk(&mut self, index: &Value, delta: Value, logprobs: Value, finish_reason: Value) {
        let choice = json!([{
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }]);
        self.out.extend_from_slice(b"data: ");
        self.out.extend_from_slice(self.prefix.as_bytes());
        self.out.extend_from_slice(choice.to_string().as_bytes());
        self.out.extend_from_slice(self.suffix.as_bytes());
        self.out.extend_from_slice(b"\n\n");
    }

    fn delta(&mut self, index: &Value, delta: Value) {
        self.chunk(index, delta, Value::Null, Value::Null);
    }
}

/// Message fields with their own chunks; the others ride in the first one.
const STREAMED_FIELDS: &[&str] = &["role", "content", "tool_calls", "function_call"];

fn synthesize_choice(stream: &mut Stream, choice: &Value, position: usize) {
    let index = choice
        .get("index")
        .cloned()
        .unwrap_or_else(|| json!(position));
    let empty = Map::new();
    let message = choice
        .get("message")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let content = message.get("content").and_then(Value::as_str);
    let logprobs = choice.get("logprobs").and_then(Value::as_object);

    // The first chunk. When logprobs were asked for, it says so with empty
    // arrays (or null, as in the completion), so the assembled logprobs have
    // the completion's shape even when there is no token at all.
    let mut first = Map::new();
    first.insert(
        "role".into(),
        message
            .get("role")
            .cloned()
            .unwrap_or_else(|| json!("assistant")),
    );
    first.insert(
        "content".into(),
        if content.is_some() {
            json!("")
        } else {
            Value::Null
        },
    );
    let mut text_fields = Vec::new();
    for (key, value) in message {
        if STREAMED_FIELDS.contains(&key.as_str()) {
            continue;
        }
        match value {
            Value::String(text) => {
                // `null` first, the text in its own chunks, as a live
                // stream sends a refusal.
                first.insert(key.clone(), Value::Null);
                text_fields.push((key, text));
            }
            other => {
                first.insert(key.clone(), other.clone());
            }
        }
    }
    let logprobs_shape = |key: &str| match logprobs.and_then(|lp| lp.get(key)) {
        Some(Value::Array(_)) => json!([]),
        _ => Value::Null,
    };
    let first_logprobs = match logprobs {
        Some(_) => {
            json!({"content": logprobs_shape("content"), "refusal": logprobs_shape("refusal")})
        }
        None => Value::Null,
    };
    stream.chunk(&index, Value::Object(first), first_logprobs, Value::Null);

    let entries = |key: &str| {
        logprobs
            .and_then(|lp| lp.get(key))
            .and_then(Value::as_array)
            .filter(|items| !items.is_empty())
    };
    for (key, text) in text_fields {
        let mut lp = if key == "refusal" {
            entries("refusal")
        } else {
            None
        };
        for piece in pieces(text, PIECE_BYTES) {
            let logprobs = lp.take().map_or(
                Value::Null,
                |items| json!({"content": null, "refusal": items}),
            );
            stream.chunk(&index, json!({ key: piece }), logprobs, Value::Null);
        }
        if let Some(items) = lp {
            // The text was empty but had logprobs.
            stream.chunk(
                &index,
                json!({}),
                json!({"content": null, "refusal": items}),
                Value::Null,
            );
        }
    }

    if let Some(text) = content {
        let tokens = entries("content");
        fn token_text(entry: &Value) -> Option<&str> {
            entry.get("token").and_then(Value::as_str)
        }
        match tokens {
            // One chunk per token, each with its own logprob, as OpenAI
            // streams them, when the tokens spell the content.
            Some(items)
                if items.iter().all(|e| token_text(e).is_some())
                    && items.iter().filter_map(token_text).collect::<String>() == text =>
            {
                for entry in items {
                    let token = token_text(entry).unwrap_or_default();
                    stream.chunk(
                        &index,
                        json!({ "content": token }),
                        json!({"content": [entry], "refusal": null}),
                        Value::Null,
                    );
                }
            }
            _ => {
                let mut lp = tokens;
                for piece in pieces(text, PIECE_BYTES) {
                    let logprobs = lp.take().map_or(
                        Value::Null,
                        |items| json!({"content": items, "refusal": null}),
                    );
                    stream.chunk(&index, json!({ "content": piece }), logprobs, Value::Null);
                }
                if let Some(items) = lp {
                    stream.chunk(
                        &index,
                        json!({}),
                        json!({"content": items, "refusal": null}),
                        Value::Null,
                    );
                }
            }
        }
    }

    if let Some(Value::Array(calls)) = message.get("tool_calls") {
        for (i, call) in calls.iter().enumerate() {
            let Some(call) = call.as_object() else {
                continue;
            };
            let mut head = Map::new();
            head.insert("index".into(), json!(i));
            let mut arguments = "";
            for (key, value) in call {
                match (key.as_str(), value) {
                    ("index", _) => {}
                    ("function", Value::Object(function)) => {
                        arguments = function
                            .get("arguments")
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        let mut f = function.clone();
                        f.insert("arguments".into(), json!(""));
                        head.insert(key.clone(), Value::Object(f));
                    }
                    _ => {
                        head.insert(key.clone(), value.clone());
                    }
                }
            }
            stream.delta(&index, json!({"tool_calls": [head]}));
            for piece in pieces(arguments, PIECE_BYTES) {
                stream.delta(
                    &index,
                    json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}),
                );
            }
        }
    }

    if let Some(Value::Object(function)) = message.get("function_call") {
        let name = function.get("name").cloned().unwrap_or_else(|| json!(""));
        stream.delta(
            &index,
            json!({"function_call": {"name": name, "arguments": ""}}),
        );
        let arguments = function
            .get("arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        for piece in pieces(arguments, PIECE_BYTES) {
            stream.delta(&index, json!({"function_call": {"arguments": piece}}));
        }
    }

    let finish_reason = choice.get("finish_reason").cloned().unwrap_or(Value::Null);
    stream.chunk(&index, json!({}), Value::Null, finish_reason);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::assemble;
    use crate::sse::fixtures::{TEXT_STREAM, TOOL_STREAM, events_of, text_completion};

    fn tool_completion() -> Value {
        json!({
            "id": "chatcmpl-2",
            "object": "chat.completion",
            "created": 1745000001,
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
                "refusal": null,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "lookup_order",
                        "arguments": format!("{{\"id\": \"{}\"}}", "4".repeat(700))}},
                    {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": ""}}
                ]},
                "logprobs": null, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 30, "total_tokens": 80},
            "system_fingerprint": null
        })
    }

    fn two_choices() -> Value {
        // Long multi-byte content, split into several chunks on character
        // boundaries.
        let long = "Grüße aus Zürich! 🚚 ".repeat(40);
        json!({
            "id": "chatcmpl-3",
            "object": "chat.completion",
            "created": 1745000002,
            "model": "llama-3.1-8b",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": long},
                    "logprobs": null, "finish_reason": "length"},
                {"index": 1, "message": {"role": "assistant", "content": "",
                    "reasoning_content": "Nothing to add."},
                    "logprobs": null, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 400, "total_tokens": 405},
            "system_fingerprint": "fp_3"
        })
    }

    fn logprobs_completion() -> Value {
        let entry = |t: &str, lp: f64| json!({"token": t, "logprob": lp, "bytes": t.as_bytes(), "top_logprobs": []});
        json!({
            "id": "chatcmpl-4",
            "object": "chat.completion",
            "created": 1745000003,
            "model": "gpt-4o-mini",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "Yes, it is.", "refusal": null},
                    "logprobs": {"content": [entry("Yes", -0.01), entry(",", -0.2),
                        entry(" it", -0.3), entry(" is", -0.1), entry(".", -0.0)], "refusal": null},
                    "finish_reason": "stop"},
                {"index": 1, "message": {"role": "assistant", "content": null,
                    "refusal": "I can't help with that."},
                    "logprobs": {"content": null, "refusal": [entry("I", -0.5)]},
                    "finish_reason": "stop"},
                {"index": 2, "message": {"role": "assistant", "content": "no tokens match"},
                    "logprobs": {"content": [entry("x", -1.0)], "refusal": null},
                    "finish_reason": "stop"}
            ],
            "usage": null,
            "system_fingerprint": null
        })
    }

    #[test]
    fn synthesize_then_assemble_is_identity() {
        for completion in [
            text_completion(),
            tool_completion(),
            two_choices(),
            logprobs_completion(),
        ] {
            let stream = synthesize(&completion, true);
            assert_eq!(
                assemble(&stream).unwrap(),
                completion,
                "{}",
                String::from_utf8_lossy(&stream)
            );
        }
        // Without usage in the stream, the assembled usage is null.
        let mut no_usage = text_completion();
        no_usage["usage"] = Value::Null;
        assert_eq!(
            assemble(&synthesize(&text_completion(), false)).unwrap(),
            no_usage
        );
        // And a real stream survives the trip the other way.
        for fixture in [TOOL_STREAM, TEXT_STREAM] {
            let once = assemble(fixture.as_bytes()).unwrap();
            let include_usage = !once["usage"].is_null();
            assert_eq!(assemble(&synthesize(&once, include_usage)).unwrap(), once);
        }
    }

    #[test]
    fn synthesized_stream_looks_like_openai() {
        let completion = two_choices();
        let stream = synthesize(&completion, true);
        let text = std::str::from_utf8(&stream).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"));
        let events = events_of(&stream);
        assert_eq!(text.matches("\n\n").count(), events.len());
        assert!(
            text.split_terminator("\n\n")
                .all(|e| e.starts_with("data: ") && !e.contains('\n'))
        );
        let (done, chunks) = events.split_last().unwrap();
        assert_eq!(done, "[DONE]");
        let chunks: Vec<Value> = chunks
            .iter()
            .map(|c| serde_json::from_str(c).unwrap())
            .collect();
        for chunk in &chunks {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["id"], "chatcmpl-3");
            assert_eq!(chunk["model"], "llama-3.1-8b");
            assert!(
                chunk.get("usage").is_some(),
                "include_usage: every chunk has usage"
            );
        }
        // Per choice: the role first, with an empty content.
        let first = &chunks[0]["choices"][0];
        assert_eq!(first["index"], 0);
        assert_eq!(first["delta"], json!({"role": "assistant", "content": ""}));
        // The long content comes in a few chunks, not one per character.
        let content_chunks = chunks
            .iter()
            .filter(|c| {
                c["choices"][0]["index"] == 0
                    && c["choices"][0]["delta"]["content"]
                        .as_str()
                        .is_some_and(|s| !s.is_empty())
            })
            .count();
        assert!(
            (2..=10).contains(&content_chunks),
            "{content_chunks} content chunks"
        );
        // The last chunk before [DONE] carries the usage and no choice.
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(last["usage"], completion["usage"]);
        // Without include_usage there is no usage anywhere.
        let bare = synthesize(&completion, false);
        assert!(!String::from_utf8_lossy(&bare).contains("usage"));
    }
}
