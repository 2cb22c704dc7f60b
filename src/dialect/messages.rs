//! Anthropic's Messages API answers as idem keeps them: a `message` object,
//! or the event stream it came as (`message_start`, content blocks,
//! `message_delta`, `message_stop`).
//!
//! Whatever the blocks are (text with citations, thinking with its
//! signature, redacted thinking, tool and server tool use, search results,
//! block types that come after these), a stream is assembled into the
//! message it stands for and a message rendered as the stream that would
//! have carried it, block by block, so that a follower or a cache hit that
//! wants the other form than the leader's call gets every block.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{Unfit, event_type, frame, stream_events};
use crate::prices::Tokens;
use crate::sse::{PIECE_BYTES, pieces};

/// A whole message's token counts (`None`: no usage).
pub fn tokens(message: &Value) -> Option<Tokens> {
    let usage = message.get("usage")?;
    let n = |k: &str| usage.get(k).and_then(Value::as_u64).unwrap_or(0);
    let fresh = usage.get("input_tokens").and_then(Value::as_u64)?;
    let read = n("cache_read_input_tokens");
    Some(Tokens {
        input: fresh + n("cache_creation_input_tokens") + read,
        cached_input: read,
        output: n("output_tokens"),
    })
}

/// A plain answer's verdict: a `message` object (`Unfit` otherwise), read
/// whole.
pub fn check_plain(body: &[u8]) -> Result<Value, Unfit> {
    if body.is_empty() {
        return Err(Unfit::Empty);
    }
    let v: Value = serde_json::from_slice(body).map_err(Unfit::NotJson)?;
    check_message(&v)?;
    Ok(v)
}

fn check_message(v: &Value) -> Result<(), Unfit> {
    let obj = v.as_object().ok_or(Unfit::NotA("a message object"))?;
    match obj.get("type").and_then(Value::as_str) {
        Some("message") if obj.get("content").is_some_and(Value::is_array) => Ok(()),
        Some("error") => Err(Unfit::ErrorObject),
        _ => Err(Unfit::NotA("a message object")),
    }
}

/// A whole stream assembled into the message it carried: it must end with
/// `message_stop`, and an `error` event is the provider's failure.
pub fn assemble(sse: &[u8]) -> Result<Value, Unfit> {
    let mut message: Option<Map<String, Value>> = None;
    let mut blocks: Vec<Block> = Vec::new();
    let mut stopped = false;
    for event in stream_events(sse)? {
        match event_type(&event) {
            "message_start" => {
                let m = event.get("message").and_then(Value::as_object).cloned();
                message = Some(m.ok_or(Unfit::NotA("a message stream"))?);
            }
            "content_block_start" => {
                let index = index_of(&event);
                let block = match event.get("content_block") {
                    Some(Value::Object(b)) => b.clone(),
                    _ => Map::new(),
                };
                while blocks.len() <= index {
                    blocks.push(Block::default());
                }
                blocks[index] = Block {
                    value: block,
                    json: String::new(),
                };
            }
            "content_block_delta" => {
                let index = index_of(&event);
                if let (Some(block), Some(Value::Object(delta))) =
                    (blocks.get_mut(index), event.get("delta"))
                {
                    block.add(delta);
                }
            }
            "content_block_stop" => {
                if let Some(block) = blocks.get_mut(index_of(&event)) {
                    block.close();
                }
            }
            "message_delta" => {
                let m = message.as_mut().ok_or(Unfit::NotA("a message stream"))?;
                if let Some(Value::Object(delta)) = event.get("delta") {
                    for (k, v) in delta {
                        m.insert(k.clone(), v.clone());
                    }
                }
                if let Some(Value::Object(usage)) = event.get("usage") {
                    let entry = m
                        .entry("usage")
                        .or_insert_with(|| Value::Object(Map::new()));
                    if let Value::Object(total) = entry {
                        for (k, v) in usage {
                            if !v.is_null() {
                                total.insert(k.clone(), v.clone());
                            }
                        }
                    }
                }
            }
            "message_stop" => {
                stopped = true;
                break;
            }
            "error" => {
                let error = event.get("error").cloned().unwrap_or(Value::Object(event));
                return Err(Unfit::Failed(error));
            }
            // `ping`, and event types that come after these.
            _ => {}
        }
    }
    let mut message = message.ok_or(Unfit::NotA("a message stream"))?;
    if !stopped {
        return Err(Unfit::Unfinished("message_stop"));
    }
    let content = blocks.into_iter().map(|b| Value::Object(b.value)).collect();
    message.insert("content".into(), Value::Array(content));
    Ok(Value::Object(message))
}

fn index_of(event: &Map<String, Value>) -> usize {
    event
        .get("index")
        .and_then(Value::as_u64)
        .and_then(|i| usize::try_from(i).ok())
        // An index past any sane answer is read as the last block's.
        .map_or(0, |i| i.min(4096))
}

/// A content block being assembled: its start, the deltas applied.
#[derive(Default)]
struct Block {
    value: Map<String, Value>,
    /// The pieces of a tool input's JSON.
    json: String,
}

impl Block {
    fn add(&mut self, delta: &Map<String, Value>) {
        let text = |k: &str| delta.get(k).and_then(Value::as_str).unwrap_or("");
        match delta.get("type").and_then(Value::as_str).unwrap_or("") {
            "text_delta" => self.append("text", text("text")),
            "thinking_delta" => self.append("thinking", text("thinking")),
            "signature_delta" => self.append("signature", text("signature")),
            "input_json_delta" => self.json.push_str(text("partial_json")),
            "citations_delta" => {
                if let Some(c) = delta.get("citation") {
                    let list = self
                        .value
                        .entry("citations")
                        .or_insert_with(|| Value::Array(Vec::new()));
                    if let Value::Array(list) = list {
                        list.push(c.clone());
                    } else {
                        *list = Value::Array(vec![c.clone()]);
                    }
                }
            }
            // A delta of a kind that comes later: its fields as they are.
            _ => {
                for (k, v) in delta {
                    if k != "type" {
                        self.value.insert(k.clone(), v.clone());
                    }
                }
            }
        }
    }

    fn append(&mut self, key: &str, piece: &str) {
        match self.value.get_mut(key) {
            Some(Value::String(s)) => s.push_str(piece),
            _ => {
                self.value.insert(key.into(), Value::String(piece.into()));
            }
        }
    }

    /// The block is whole: a tool input sent in pieces is parsed.
    fn close(&mut self) {
        if self.json.is_empty() {
            return;
        }
        let json = std::mem::take(&mut self.json);
        let input = serde_json::from_str(&json).unwrap_or(Value::String(json));
        self.value.insert("input".into(), input);
    }
}

/// The stream that carries `message`, block by block: what a streaming
/// client gets of an answer that was not streamed. [`assemble`] gives the
/// message back.
pub fn synthesize(message: &Value) -> Bytes {
    let mut out = Vec::with_capacity(1024);
    let mut head = message.as_object().cloned().unwrap_or_default();
    let content = match head.remove("content") {
        Some(Value::Array(c)) => c,
        _ => Vec::new(),
    };
    let usage = head.remove("usage");
    let mut tail = Map::new();
    for key in ["stop_reason", "stop_sequence"] {
        if let Some(v) = head.insert(key.into(), Value::Null) {
            tail.insert(key.into(), v);
        }
    }
    // The start carries the input's counts, the delta the output's.
    let (mut start_usage, mut end_usage) = (Map::new(), Map::new());
    if let Some(Value::Object(u)) = usage {
        for (k, v) in u {
            if k == "output_tokens" {
                start_usage.insert(k.clone(), json!(0));
                end_usage.insert(k, v);
            } else {
                start_usage.insert(k, v);
            }
        }
        head.insert("usage".into(), Value::Object(start_usage));
    }
    head.insert("content".into(), json!([]));
    frame(
        &mut out,
        "message_start",
        &json!({"type": "message_start", "message": head}),
    );
    for (index, block) in content.iter().enumerate() {
        block_events(&mut out, index, block);
    }
    let mut delta = json!({"type": "message_delta", "delta": tail});
    if !end_usage.is_empty() {
        delta["usage"] = Value::Object(end_usage);
    }
    frame(&mut out, "message_delta", &delta);
    frame(&mut out, "message_stop", &json!({"type": "message_stop"}));
    Bytes::from(out)
}

/// One block's events: its start with the parts that stream emptied, the
/// deltas, its stop.
fn block_events(out: &mut Vec<u8>, index: usize, block: &Value) {
    let Some(obj) = block.as_object() else {
        return;
    };
    let kind = obj.get("type").and_then(Value::as_str).unwrap_or("");
    let mut start = obj.clone();
    let mut deltas: Vec<Value> = Vec::new();
    let text = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or("");
    match kind {
        "text" => {
            start.insert("text".into(), json!(""));
            if let Some(Value::Array(citations)) = start.remove("citations") {
                start.insert("citations".into(), json!([]));
                deltas.extend(
                    citations
                        .into_iter()
                        .map(|c| json!({"type": "citations_delta", "citation": c})),
                );
            }
            let texts: Vec<Value> = pieces(text("text"), PIECE_BYTES)
                .map(|p| json!({"type": "text_delta", "text": p}))
                .collect();
            // Text first, as the provider streams it, then its citations.
            deltas.splice(0..0, texts);
        }
        "thinking" => {
            start.insert("thinking".into(), json!(""));
            start.remove("signature");
            deltas.extend(
                pieces(text("thinking"), PIECE_BYTES)
                    .map(|p| json!({"type": "thinking_delta", "thinking": p})),
            );
            if let Some(sig) = obj.get("signature") {
                deltas.push(json!({"type": "signature_delta", "signature": sig}));
            }
        }
        "tool_use" | "server_tool_use" | "mcp_tool_use" => {
            let input = obj.get("input").cloned().unwrap_or_else(|| json!({}));
            start.insert("input".into(), json!({}));
            let input = input.to_string();
            if input != "{}" {
                deltas.extend(
                    pieces(&input, PIECE_BYTES)
                        .map(|p| json!({"type": "input_json_delta", "partial_json": p})),
                );
            }
        }
        // Redacted thinking, tool results, and block types that come
        // later: the start carries the whole block.
        _ => {}
    }
    frame(
        out,
        "content_block_start",
        &json!({"type": "content_block_start", "index": index, "content_block": start}),
    );
    for delta in deltas {
        frame(
            out,
            "content_block_delta",
            &json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }
    frame(
        out,
        "content_block_stop",
        &json!({"type": "content_block_stop", "index": index}),
    );
}

/// The answer's text (its `text` blocks, joined), for contracts.
pub fn text(message: &Value) -> Option<String> {
    let blocks = message.get("content")?.as_array()?;
    let texts: Vec<&str> = blocks
        .iter()
        .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
        .filter_map(|b| b.get("text").and_then(Value::as_str))
        .collect();
    (!texts.is_empty()).then(|| texts.concat())
}

/// An error object in Anthropic's shape.
pub fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// The `error` event a stream ends with when it breaks off.
pub fn error_event(kind: &str, message: &str) -> Bytes {
    let mut out = Vec::new();
    frame(&mut out, "error", &error_body(kind, message));
    Bytes::from(out)
}

/// The Anthropic error type for an HTTP status, as Anthropic's error
/// reference lists them. 408 joins 504 as `timeout_error` and 503 joins 529
/// as `overloaded_error`, since they mean the same to a client; other 4xx
/// are `invalid_request_error` (as Anthropic documents) and other 5xx
/// `api_error`.
pub fn error_kind(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        409 => "conflict_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// True for an error body already in Anthropic's shape.
pub fn is_error_body(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .ok()
        .is_some_and(|v| v.get("type").and_then(Value::as_str) == Some("error"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A message with every kind of block Anthropic's API sends today.
    fn rich() -> Value {
        json!({
            "id": "msg_01", "type": "message", "role": "assistant", "model": "claude-opus-4-8",
            "content": [
                {"type": "thinking", "thinking": "Let me think. ".repeat(40), "signature": "sig=="},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                 "input": {"query": "idem gateway"}},
                {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
                 "content": [{"type": "web_search_result", "url": "https://e.x", "title": "E",
                              "encrypted_content": "enc", "page_age": null}]},
                {"type": "text", "text": "It coalesces.",
                 "citations": [{"type": "web_search_result_location", "url": "https://e.x",
                                "title": "E", "encrypted_index": "i", "cited_text": "c"}]},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}},
                {"type": "some_future_block", "x": [1, 2]}
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 10, "cache_creation_input_tokens": 2,
                      "cache_read_input_tokens": 5, "output_tokens": 7,
                      "server_tool_use": {"web_search_requests": 1}}
        })
    }

    #[test]
    fn a_message_survives_its_stream_block_for_block() {
        let m = rich();
        let stream = synthesize(&m);
        let text = String::from_utf8(stream.to_vec()).unwrap();
        assert!(text.starts_with("event: message_start\n"), "{text}");
        assert!(text.ends_with("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"));
        for kind in [
            "thinking_delta",
            "signature_delta",
            "input_json_delta",
            "citations_delta",
        ] {
            assert!(text.contains(kind), "no {kind}: {text}");
        }
        assert_eq!(assemble(&stream).unwrap(), m);
        assert_eq!(
            tokens(&m),
            Some(Tokens {
                input: 17,
                cached_input: 5,
                output: 7
            })
        );
        assert_eq!(text_of(&m), "It coalesces.");
    }

    fn text_of(m: &Value) -> String {
        text(m).unwrap()
    }

    #[test]
    fn a_stream_without_message_stop_or_with_an_error_is_no_answer() {
        let whole = synthesize(&rich());
        let text = std::str::from_utf8(&whole).unwrap();
        let cut = text.split("event: message_stop").next().unwrap();
        assert!(matches!(
            assemble(cut.as_bytes()),
            Err(Unfit::Unfinished("message_stop"))
        ));
        let failed = format!(
            "{cut}event: error\ndata: {}\n\n",
            error_body("overloaded_error", "busy")
        );
        match assemble(failed.as_bytes()) {
            Err(Unfit::Failed(e)) => assert_eq!(e["type"], "overloaded_error"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            assemble(b"data: nope\n\n"),
            Err(Unfit::BadEvent(0))
        ));
    }

    #[test]
    fn a_plain_answer_must_be_a_message() {
        assert!(check_plain(rich().to_string().as_bytes()).is_ok());
        assert!(matches!(check_plain(b""), Err(Unfit::Empty)));
        assert!(matches!(check_plain(b"<html>"), Err(Unfit::NotJson(_))));
        let e = error_body("api_error", "x").to_string();
        assert!(matches!(check_plain(e.as_bytes()), Err(Unfit::ErrorObject)));
        assert!(matches!(
            check_plain(br#"{"type":"message"}"#),
            Err(Unfit::NotA(_))
        ));
        assert!(is_error_body(e.as_bytes()));
        assert!(!is_error_body(br#"{"error":{"message":"x"}}"#));
    }
}
