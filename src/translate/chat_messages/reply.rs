//! An Anthropic reply read back as OpenAI's: a message as a chat
//! completion, an error as an OpenAI error object.
//!
//! Content blocks become the message's `content` (text blocks joined) and
//! `tool_calls` (`tool_use` blocks, their input as the arguments' JSON);
//! the tool that carries a `response_format`'s JSON becomes the content
//! instead. `stop_reason` becomes `finish_reason`: `end_turn`,
//! `stop_sequence` and `pause_turn` are `stop`, `max_tokens` is `length`,
//! `tool_use` is `tool_calls`, `refusal` is `content_filter`. Usage: OpenAI
//! counts cached prompt tokens inside `prompt_tokens`, Anthropic beside
//! `input_tokens`, so `prompt_tokens` is their sum and
//! `prompt_tokens_details.cached_tokens` the cache reads.

use serde_json::{Map, Value, json};

use super::Reading;

/// `finish_reason` for a `stop_reason` (`json`: the answer is a
/// `response_format`'s forced tool, which ended the turn as a stop).
pub fn finish_reason(stop_reason: Option<&str>, json: bool) -> &'static str {
    match stop_reason {
        Some("max_tokens") => "length",
        Some("tool_use") if !json => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    }
}

/// OpenAI's usage for Anthropic's.
pub fn usage(u: &Value) -> Value {
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let cached = n("cache_read_input_tokens");
    let prompt = n("input_tokens") + n("cache_creation_input_tokens") + cached;
    let completion = n("output_tokens");
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached}
    })
}

/// The seconds since the Unix epoch (a completion's `created`).
pub fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A message as a chat completion, or `None` if it is not a message.
pub fn completion(message: &Value, reading: &Reading) -> Option<Value> {
    if message.get("type").and_then(Value::as_str) != Some("message") {
        return None;
    }
    let blocks = message.get("content")?.as_array()?;
    let mut text = String::new();
    let mut has_text = false;
    let mut tool_calls = Vec::new();
    let json_tool = reading.json_tool.as_deref();
    for block in blocks {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                has_text = true;
                text.push_str(
                    block
                        .get("text")
                        .and_then(Value::as_str)
                        .unwrap_or_default(),
                );
            }
            Some("tool_use") => {
                let name = block
                    .get("name")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                if Some(name) == json_tool {
                    has_text = true;
                    text.push_str(&input.to_string());
                    continue;
                }
                tool_calls.push(json!({
                    "id": block.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {"name": name, "arguments": input.to_string()}
                }));
            }
            // Thinking and other blocks have no place in a chat message.
            _ => {}
        }
    }
    let mut msg = Map::new();
    msg.insert("role".into(), json!("assistant"));
    msg.insert(
        "content".into(),
        if has_text {
            Value::String(text)
        } else {
            Value::Null
        },
    );
    if !tool_calls.is_empty() {
        msg.insert("tool_calls".into(), Value::Array(tool_calls));
    }
    msg.insert("refusal".into(), Value::Null);
    let stop = message.get("stop_reason").and_then(Value::as_str);
    Some(json!({
        "id": message.get("id").cloned().unwrap_or(Value::Null),
        "object": "chat.completion",
        "created": now_secs(),
        "model": message.get("model").cloned().unwrap_or(Value::Null),
        "choices": [{
            "index": 0,
            "message": Value::Object(msg),
            "logprobs": null,
            "finish_reason": finish_reason(stop, json_tool.is_some())
        }],
        "usage": usage(message.get("usage").unwrap_or(&Value::Null)),
    }))
}

/// An Anthropic error (`{"type": "error", "error": {"type", "message"}}`)
/// as an OpenAI error object; a body that is no such error keeps its text
/// as the message.
pub fn error(status: u16, body: &[u8]) -> Value {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    let kind = error
        .and_then(|e| e.get("type"))
        .and_then(Value::as_str)
        .unwrap_or(match status {
            429 => "rate_limit_error",
            529 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        });
    let message = error
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .map(str::to_owned)
        .unwrap_or_else(|| String::from_utf8_lossy(&body[..body.len().min(500)]).into_owned());
    crate::answer::error_body(&message, kind, kind, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_is_a_chat_completion() {
        let message = json!({
            "id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x",
            "content": [
                {"type": "thinking", "thinking": "hm", "signature": "s"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "cat"}}
            ],
            "stop_reason": "tool_use", "stop_sequence": null,
            "usage": {"input_tokens": 10, "output_tokens": 5, "cache_creation_input_tokens": 2, "cache_read_input_tokens": 3}
        });
        let c = completion(&message, &Reading::default()).unwrap();
        let choice = &c["choices"][0];
        assert_eq!(choice["message"]["content"], "Let me look.");
        assert_eq!(choice["message"]["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(
            choice["message"]["tool_calls"][0]["function"]["name"],
            "lookup"
        );
        let args: Value = serde_json::from_str(
            choice["message"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap(),
        )
        .unwrap();
        assert_eq!(args, json!({"q": "cat"}));
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(
            c["usage"],
            json!({"prompt_tokens": 15, "completion_tokens": 5, "total_tokens": 20, "prompt_tokens_details": {"cached_tokens": 3}})
        );
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["model"], "claude-x");
        assert_eq!(c["id"], "msg_1");
    }

    #[test]
    fn stop_reasons_map_to_finish_reasons() {
        for (stop, finish) in [
            (Some("end_turn"), "stop"),
            (Some("stop_sequence"), "stop"),
            (Some("max_tokens"), "length"),
            (Some("tool_use"), "tool_calls"),
            (Some("refusal"), "content_filter"),
            (Some("pause_turn"), "stop"),
            (None, "stop"),
        ] {
            assert_eq!(finish_reason(stop, false), finish, "{stop:?}");
        }
        assert_eq!(finish_reason(Some("tool_use"), true), "stop");
    }

    #[test]
    fn the_json_tools_input_is_the_content() {
        let message = json!({
            "id": "m", "type": "message", "content": [{"type": "tool_use", "id": "t", "name": "reply", "input": {"answer": "yes"}}],
            "stop_reason": "tool_use", "usage": {}
        });
        let reading = Reading {
            json_tool: Some("reply".into()),
            ..Reading::default()
        };
        let c = completion(&message, &reading).unwrap();
        assert_eq!(
            c["choices"][0]["message"]["content"],
            "{\"answer\":\"yes\"}"
        );
        assert!(c["choices"][0]["message"].get("tool_calls").is_none());
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
        assert!(completion(&json!({"type": "error"}), &reading).is_none());
    }

    #[test]
    fn errors_keep_their_type_and_message() {
        let e = error(
            529,
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        assert_eq!(e["error"]["type"], "overloaded_error");
        assert_eq!(e["error"]["message"], "Overloaded");
        let e = error(502, b"<html>bad gateway</html>");
        assert_eq!(e["error"]["type"], "api_error");
        assert_eq!(e["error"]["message"], "<html>bad gateway</html>");
    }
}
