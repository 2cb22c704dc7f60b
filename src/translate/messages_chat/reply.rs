//! A chat completion read back as an Anthropic `message`: its text and
//! tool calls as content blocks, its finish reason as a stop reason, its
//! usage in Anthropic's terms.

use serde_json::{Map, Value, json};

/// Token counts in Anthropic's terms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Usage {
    /// Prompt tokens not read from the cache (Anthropic's `input_tokens`
    /// excludes cache reads).
    pub(super) input: u64,
    pub(super) output: u64,
    pub(super) cache_read: u64,
}

impl Usage {
    /// Reads a chat `usage` object; `None` when there is none.
    pub(super) fn from_chat(usage: Option<&Value>) -> Option<Usage> {
        let usage = usage.filter(|u| u.is_object())?;
        let number = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
        let prompt = number(usage.get("prompt_tokens"));
        let cached = number(usage.pointer("/prompt_tokens_details/cached_tokens"));
        Some(Usage {
            input: prompt.saturating_sub(cached),
            output: number(usage.get("completion_tokens")),
            cache_read: cached,
        })
    }

    pub(super) fn to_json(self) -> Value {
        let mut map = Map::new();
        map.insert("input_tokens".into(), self.input.into());
        map.insert("output_tokens".into(), self.output.into());
        if self.cache_read > 0 {
            map.insert("cache_read_input_tokens".into(), self.cache_read.into());
        }
        Value::Object(map)
    }
}

/// The Anthropic message id for a chat completion id: `msg_` followed by the
/// completion id without its `chatcmpl-` prefix, so the same completion
/// always gets the same message id.
pub(super) fn message_id(completion_id: Option<&str>) -> String {
    let id = completion_id.unwrap_or_default();
    // A completion translated from an Anthropic message carries its `msg_`
    // id already: never `msg_msg_...`.
    let bare = id.strip_prefix("chatcmpl-").unwrap_or(id);
    format!("msg_{}", bare.strip_prefix("msg_").unwrap_or(bare))
}

/// The id given to a tool call that arrived without one, derived from the
/// message id and the call's chat index so it is stable across replays.
pub(super) fn fallback_tool_id(message_id: &str, index: u64) -> String {
    let suffix = message_id.strip_prefix("msg_").unwrap_or(message_id);
    format!("toolu_{suffix}_{index}")
}

/// Anthropic's `stop_reason` for a chat `finish_reason`. Chat never says
/// which stop sequence matched, so `stop_sequence` stays null and a stop on
/// a sequence reads as `end_turn`.
pub(super) fn stop_reason(finish_reason: Option<&str>) -> &'static str {
    match finish_reason {
        Some("length") => "max_tokens",
        Some("tool_calls" | "function_call") => "tool_use",
        Some("content_filter") => "refusal",
        _ => "end_turn",
    }
}

/// The tool `input` for a chat `arguments` string: the parsed JSON object;
/// `{}` for empty arguments (what models send for a tool without
/// parameters); otherwise `{"_raw": arguments}`, so a tool runner sees the
/// malformed arguments instead of silently running with none.
pub(super) fn tool_input(arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return Value::Object(Map::new());
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({"_raw": arguments}),
    }
}

/// The text of a chat content value: a string, or the concatenated text of
/// content parts (some servers answer with parts).
pub(super) fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// What one chat completion says, in the order Anthropic shows it.
pub(super) struct Answer {
    id: String,
    model: Value,
    /// The message text, or the refusal text when there is no content.
    text: String,
    /// (id, name, arguments) of each tool call.
    calls: Vec<(String, String, String)>,
    stop_reason: &'static str,
    usage: Usage,
}

impl Answer {
    pub(super) fn of(completion: &Value) -> Answer {
        let id = message_id(completion.get("id").and_then(Value::as_str));
        let model = match completion.get("model") {
            Some(m @ Value::String(_)) => m.clone(),
            _ => Value::from(""),
        };
        let choice = completion.get("choices").and_then(|c| {
            c.as_array()?
                .iter()
                .find(|ch| ch.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
        });
        let message = choice.and_then(|c| c.get("message"));
        let mut text = content_text(message.and_then(|m| m.get("content")));
        if text.is_empty() {
            text = content_text(message.and_then(|m| m.get("refusal")));
        }
        let mut calls = Vec::new();
        let tool_calls = message
            .and_then(|m| m.get("tool_calls"))
            .and_then(Value::as_array);
        for (pos, call) in tool_calls.into_iter().flatten().enumerate() {
            let index = call
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(pos as u64);
            let call_id = match call.get("id").and_then(Value::as_str) {
                Some(s) if !s.is_empty() => s.to_owned(),
                _ => fallback_tool_id(&id, index),
            };
            let function = call.get("function");
            let name = function
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let arguments = function
                .and_then(|f| f.get("arguments"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            calls.push((call_id, name, arguments));
        }
        let finish = choice
            .and_then(|c| c.get("finish_reason"))
            .and_then(Value::as_str);
        Answer {
            id,
            model,
            text,
            calls,
            stop_reason: stop_reason(finish),
            usage: Usage::from_chat(completion.get("usage")).unwrap_or_default(),
        }
    }
}

/// The Anthropic `message` object for a plain chat completion (choice 0).
///
/// Content is the message text (when non-empty; a `refusal` stands in when
/// there is no content) as one `text` block, then one `tool_use` block per
/// tool call, its `input` parsed from the arguments (see `tool_input`).
/// `usage.input_tokens` excludes cached prompt tokens, which are reported as
/// `cache_read_input_tokens` when there are any, as Anthropic counts them.
pub fn message_from_completion(completion: &Value) -> Value {
    let answer = Answer::of(completion);
    let mut content = Vec::new();
    if !answer.text.is_empty() {
        content.push(json!({"type": "text", "text": answer.text}));
    }
    for (id, name, arguments) in &answer.calls {
        content.push(json!({
            "type": "tool_use",
            "id": id,
            "name": name,
            "input": tool_input(arguments),
        }));
    }
    json!({
        "id": answer.id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": content,
        "stop_reason": answer.stop_reason,
        "stop_sequence": null,
        "usage": answer.usage.to_json(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dialect::messages::{error_body, error_kind};

    fn completion(message: Value, finish: &str, usage: Value) -> Value {
        json!({
            "id": "chatcmpl-abc123",
            "object": "chat.completion",
            "model": "gpt-x",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage,
        })
    }

    #[test]
    fn message_from_text_completion() {
        let c = completion(
            json!({"role": "assistant", "content": "Hello there"}),
            "stop",
            json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}),
        );
        assert_eq!(
            message_from_completion(&c),
            json!({
                "id": "msg_abc123",
                "type": "message",
                "role": "assistant",
                "model": "gpt-x",
                "content": [{"type": "text", "text": "Hello there"}],
                "stop_reason": "end_turn",
                "stop_sequence": null,
                "usage": {"input_tokens": 10, "output_tokens": 3},
            })
        );
    }

    #[test]
    fn message_from_tool_call_completion() {
        let c = completion(
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}},
                {"type": "function", "function": {"name": "h", "arguments": "not json"}},
                {"id": "call_4", "type": "function", "function": {"name": "k", "arguments": "[1, 2]"}}
            ]}),
            "tool_calls",
            json!({"prompt_tokens": 5, "completion_tokens": 7}),
        );
        let m = message_from_completion(&c);
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(
            m["content"],
            json!([
                {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "id": "call_2", "name": "g", "input": {}},
                {"type": "tool_use", "id": "toolu_abc123_2", "name": "h", "input": {"_raw": "not json"}},
                {"type": "tool_use", "id": "call_4", "name": "k", "input": {"_raw": "[1, 2]"}}
            ])
        );
    }

    #[test]
    fn message_from_length_refusal_and_cached_usage() {
        let c = completion(
            json!({"role": "assistant", "content": "cut"}),
            "length",
            json!({"prompt_tokens": 100, "completion_tokens": 50,
                   "prompt_tokens_details": {"cached_tokens": 60}}),
        );
        let m = message_from_completion(&c);
        assert_eq!(m["stop_reason"], "max_tokens");
        assert_eq!(
            m["usage"],
            json!({"input_tokens": 40, "output_tokens": 50, "cache_read_input_tokens": 60})
        );
        let c = completion(
            json!({"role": "assistant", "content": null, "refusal": "I can't."}),
            "content_filter",
            json!({"prompt_tokens": 1, "completion_tokens": 1,
                   "prompt_tokens_details": {"cached_tokens": 0}}),
        );
        let m = message_from_completion(&c);
        assert_eq!(m["stop_reason"], "refusal");
        assert_eq!(m["content"], json!([{"type": "text", "text": "I can't."}]));
        assert_eq!(m["usage"], json!({"input_tokens": 1, "output_tokens": 1}));
    }

    #[test]
    fn stop_reasons_and_error_kinds() {
        assert_eq!(stop_reason(Some("stop")), "end_turn");
        assert_eq!(stop_reason(Some("function_call")), "tool_use");
        assert_eq!(stop_reason(None), "end_turn");
        assert_eq!(stop_reason(Some("weird")), "end_turn");
        let kinds = [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (402, "billing_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (408, "timeout_error"),
            (409, "conflict_error"),
            (413, "request_too_large"),
            (422, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
            (504, "timeout_error"),
            (529, "overloaded_error"),
        ];
        for (status, kind) in kinds {
            assert_eq!(error_kind(status), kind, "{status}");
        }
        assert_eq!(
            error_body("rate_limit_error", "slow down"),
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}})
        );
    }
}
