//! A finished stream assembled into the plain `chat.completion` it stands
//! for, for whoever needs the answer whole: a non-streaming follower, the
//! result cache, the job store.

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

use super::SseError;
use super::events::EventSplitter;

/// Parses an OpenAI chat completion SSE byte stream and assembles the
/// equivalent non-streaming `chat.completion` object.
///
/// The stream is complete but may have been received in arbitrary pieces;
/// it has `data:` lines, optional `event:`/`id:`/comment lines, CRLF or LF,
/// and ends with `data: [DONE]`; one without it, or with a choice that
/// never got a `finish_reason`, is [`SseError::Truncated`]. The result has `id`, `object`, `created`,
/// `model`, `system_fingerprint`, `service_tier` (if the stream has one),
/// `choices` ordered by index, and `usage` (from the chunk that carries it,
/// else null). Each choice has `index`, `finish_reason`, `logprobs` (the
/// `content`/`refusal` arrays concatenated, or null) and a `message` with
/// `role`, `content` (the deltas concatenated; null if there never was any),
/// `tool_calls` merged by their index (first `id`, `type` and
/// `function.name`; `function.arguments` concatenated), and any other delta
/// field (`refusal`, `annotations`, `reasoning_content`...) merged: strings
/// and arrays concatenated, other values replaced by the latest non-null.
pub fn assemble(sse: &[u8]) -> Result<Value, SseError> {
    let mut splitter = EventSplitter::new();
    let mut events = Vec::new();
    splitter.feed(sse, &mut events);
    events.extend(splitter.finish_event());

    let mut assembly = Assembly::default();
    let mut done = false;
    for (n, event) in events.into_iter().enumerate() {
        let data = event.data.trim();
        if data == "[DONE]" {
            done = true;
            break;
        }
        if data.is_empty() {
            continue;
        }
        let value: Value =
            serde_json::from_str(data).map_err(|source| SseError::Json { event: n, source })?;
        let Value::Object(mut chunk) = value else {
            if event.kind.as_deref() == Some("error") {
                return Err(SseError::Upstream(value));
            }
            return Err(SseError::NotAChunk { event: n });
        };
        let error = chunk.remove("error").filter(|e| !e.is_null());
        match error {
            Some(error) => return Err(SseError::Upstream(error)),
            None if event.kind.as_deref() == Some("error") => {
                return Err(SseError::Upstream(Value::Object(chunk)));
            }
            None => assembly.add(chunk),
        }
    }
    assembly.finish(done)
}

#[derive(Default)]
struct Assembly {
    chunks: usize,
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    system_fingerprint: Option<Value>,
    service_tier: Option<Value>,
    usage: Option<Value>,
    choices: BTreeMap<u64, ChoiceAssembly>,
}

#[derive(Default)]
struct ChoiceAssembly {
    role: Option<Value>,
    content: Option<String>,
    /// Other delta fields, merged by [`merge`], in first-seen order.
    other: Map<String, Value>,
    tool_calls: BTreeMap<u64, ToolCallAssembly>,
    function_call: Option<FunctionAssembly>,
    logprobs: Option<LogprobsAssembly>,
    finish_reason: Option<Value>,
}

#[derive(Default)]
struct ToolCallAssembly {
    id: Option<Value>,
    kind: Option<Value>,
    function: Option<FunctionAssembly>,
    other: Map<String, Value>,
}

#[derive(Default)]
struct FunctionAssembly {
    name: Option<String>,
    arguments: String,
}

#[derive(Default)]
struct LogprobsAssembly {
    content: Option<Vec<Value>>,
    refusal: Option<Vec<Value>>,
}

/// Takes a field for a slot that keeps the latest non-null value (or null
/// if that is all there ever was).
fn keep(slot: &mut Option<Value>, value: Option<Value>) {
    if let Some(value) = value
        && (slot.is_none() || !value.is_null())
    {
        *slot = Some(value);
    }
}

/// Merges one delta field into what the earlier deltas built: streamed
/// strings and arrays arrive in pieces, anything else whole.
fn merge(map: &mut Map<String, Value>, key: String, value: Value) {
    match (map.get_mut(&key), value) {
        (None, value) => {
            map.insert(key, value);
        }
        (Some(_), Value::Null) => {}
        (Some(Value::String(so_far)), Value::String(piece)) => so_far.push_str(&piece),
        (Some(Value::Array(so_far)), Value::Array(piece)) => so_far.extend(piece),
        (Some(slot), value) => *slot = value,
    }
}

impl FunctionAssembly {
    fn add(&mut self, mut function: Map<String, Value>) {
        // A name is one identifier, sent once; some providers repeat it in
        // every chunk, so it is taken, never concatenated.
        if let Some(Value::String(name)) = function.remove("name")
            && !name.is_empty()
            && self.name.is_none()
        {
            self.name = Some(name);
        }
        if let Some(Value::String(piece)) = function.remove("arguments") {
            self.arguments.push_str(&piece);
        }
    }

    fn finish(self) -> Value {
        json!({"name": self.name.unwrap_or_default(), "arguments": self.arguments})
    }
}

impl Assembly {
    fn add(&mut self, mut chunk: Map<String, Value>) {
        self.chunks += 1;
        keep(&mut self.id, chunk.remove("id"));
        keep(&mut self.created, chunk.remove("created"));
        keep(&mut self.model, chunk.remove("model"));
        keep(
            &mut self.system_fingerprint,
            chunk.remove("system_fingerprint"),
        );
        keep(&mut self.service_tier, chunk.remove("service_tier"));
        keep(&mut self.usage, chunk.remove("usage"));
        let Some(Value::Array(choices)) = chunk.remove("choices") else {
            return;
        };
        for (position, choice) in choices.into_iter().enumerate() {
            let Value::Object(mut choice) = choice else {
                continue;
            };
            let index = choice
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(position as u64);
            let acc = self.choices.entry(index).or_default();
            if let Some(Value::Object(delta)) = choice.remove("delta") {
                acc.add_delta(delta);
            }
            if let Some(Value::Object(mut logprobs)) = choice.remove("logprobs") {
                let lp = acc.logprobs.get_or_insert_with(Default::default);
                for (key, slot) in [("content", &mut lp.content), ("refusal", &mut lp.refusal)] {
                    if let Some(Value::Array(items)) = logprobs.remove(key) {
                        slot.get_or_insert_with(Vec::new).extend(items);
                    }
                }
            }
            keep(&mut acc.finish_reason, choice.remove("finish_reason"));
        }
    }

    fn finish(self, done: bool) -> Result<Value, SseError> {
        if self.chunks == 0 {
            return Err(SseError::Empty);
        }
        let all_finished = self
            .choices
            .values()
            .all(|c| c.finish_reason.as_ref().is_some_and(|r| !r.is_null()));
        // Ended as a success: every choice finished *and* `[DONE]` came.
        // Either alone may be a stream that stopped short, and a shared
        // answer must be whole. (A stream of no choice at all assembles into
        // a completion without choices, which its reader refuses as such.)
        if !done || !all_finished {
            return Err(SseError::Truncated);
        }
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|(index, choice)| choice.finish(index))
            .collect();

        // OpenAI's own key order, so the assembled body looks like theirs.
        let mut out = Map::new();
        out.insert("id".into(), self.id.unwrap_or(Value::Null));
        out.insert("object".into(), json!("chat.completion"));
        out.insert("created".into(), self.created.unwrap_or(Value::Null));
        out.insert("model".into(), self.model.unwrap_or(Value::Null));
        out.insert("choices".into(), Value::Array(choices));
        out.insert("usage".into(), self.usage.unwrap_or(Value::Null));
        if let Some(tier) = self.service_tier {
            out.insert("service_tier".into(), tier);
        }
        out.insert(
            "system_fingerprint".into(),
            self.system_fingerprint.unwrap_or(Value::Null),
        );
        Ok(Value::Object(out))
    }
}

impl ChoiceAssembly {
    fn add_delta(&mut self, delta: Map<String, Value>) {
        for (key, value) in delta {
            match (key.as_str(), value) {
                ("role", role) => keep(&mut self.role, Some(role)),
                ("content", Value::String(piece)) => {
                    self.content
                        .get_or_insert_with(String::new)
                        .push_str(&piece);
                }
                ("content", _) => {}
                ("tool_calls", Value::Array(calls)) => {
                    for (position, call) in calls.into_iter().enumerate() {
                        if let Value::Object(call) = call {
                            let index = call
                                .get("index")
                                .and_then(Value::as_u64)
                                .unwrap_or(position as u64);
                            self.tool_calls.entry(index).or_default().add(call);
                        }
                    }
                }
                ("function_call", Value::Object(function)) => {
                    self.function_call
                        .get_or_insert_with(Default::default)
                        .add(function);
                }
                ("tool_calls" | "function_call", _) => {}
                (_, value) => merge(&mut self.other, key, value),
            }
        }
    }

    fn finish(self, index: u64) -> Value {
        let mut message = Map::new();
        message.insert(
            "role".into(),
            self.role
                .filter(|r| !r.is_null())
                .unwrap_or_else(|| json!("assistant")),
        );
        message.insert(
            "content".into(),
            self.content.map(Value::String).unwrap_or(Value::Null),
        );
        message.extend(self.other);
        if !self.tool_calls.is_empty() {
            let calls = self.tool_calls.into_values().map(ToolCallAssembly::finish);
            message.insert("tool_calls".into(), Value::Array(calls.collect()));
        }
        if let Some(function) = self.function_call {
            message.insert("function_call".into(), function.finish());
        }
        let logprobs = self.logprobs.map_or(
            Value::Null,
            |lp| json!({"content": lp.content, "refusal": lp.refusal}),
        );
        json!({
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason.unwrap_or(Value::Null),
        })
    }
}

impl ToolCallAssembly {
    fn add(&mut self, call: Map<String, Value>) {
        for (key, value) in call {
            match (key.as_str(), value) {
                ("index", _) => {}
                ("id", Value::String(id)) if id.is_empty() => {}
                ("id", id) => keep(&mut self.id, Some(id)),
                ("type", kind) => keep(&mut self.kind, Some(kind)),
                ("function", Value::Object(function)) => {
                    self.function
                        .get_or_insert_with(Default::default)
                        .add(function);
                }
                (_, value) => merge(&mut self.other, key, value),
            }
        }
    }

    fn finish(self) -> Value {
        let mut call = Map::new();
        call.insert("id".into(), self.id.unwrap_or(Value::Null));
        call.insert(
            "type".into(),
            self.kind.unwrap_or_else(|| json!("function")),
        );
        if let Some(function) = self.function {
            call.insert("function".into(), function.finish());
        }
        call.extend(self.other);
        Value::Object(call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::fixtures::{TEXT_STREAM, TOOL_STREAM};

    #[test]
    fn assembles_a_tool_call_stream() {
        let assembled = assemble(TOOL_STREAM.as_bytes()).unwrap();
        let expected = json!({
            "id": "chatcmpl-BQ1xq",
            "object": "chat.completion",
            "created": 1745001234,
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": null,
                    "refusal": null,
                    "tool_calls": [
                        {"id": "call_Wq1", "type": "function", "function": {
                            "name": "get_weather",
                            "arguments": "{\"city\": \"Paris, Île-de-France\"}"}},
                        {"id": "call_Xy2", "type": "function", "function": {
                            "name": "get_time",
                            "arguments": "{\"tz\": \"Europe/Paris\"}"}}
                    ]
                },
                "logprobs": null,
                "finish_reason": "tool_calls"
            }],
            "usage": {"prompt_tokens": 82, "completion_tokens": 47, "total_tokens": 129,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                    "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}},
            "service_tier": "default",
            "system_fingerprint": "fp_0392822090"
        });
        assert_eq!(assembled, expected);
        // The arguments are the JSON the model wrote.
        let args = assembled["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(args).unwrap()["city"],
            "Paris, Île-de-France"
        );
    }

    #[test]
    fn assembles_a_text_stream() {
        let assembled = assemble(TEXT_STREAM.as_bytes()).unwrap();
        assert_eq!(
            assembled,
            json!({
                "id": "chatcmpl-C7a",
                "object": "chat.completion",
                "created": 1745009999,
                "model": "gpt-4o-2024-08-06",
                "choices": [{"index": 0, "message": {"role": "assistant",
                    "content": "Your order ships to Zürich 🚚.", "refusal": null},
                    "logprobs": null, "finish_reason": "stop"}],
                "usage": null,
                "system_fingerprint": "fp_a1"
            })
        );
        // No `service_tier` in the stream, none in the answer.
        assert!(assembled.get("service_tier").is_none());
    }

    #[test]
    fn error_events_are_upstream_errors() {
        let error = json!({"message": "The server had an error", "type": "server_error", "param": null, "code": null});
        let stream = format!(
            "{}data: {}\n\n",
            &TEXT_STREAM[..TEXT_STREAM.find("\n\n").unwrap() + 2],
            json!({ "error": error })
        );
        match assemble(stream.as_bytes()) {
            Err(SseError::Upstream(e)) => assert_eq!(e, error),
            other => panic!("expected an upstream error, got {other:?}"),
        }
        let typed = "event: error\ndata: {\"message\": \"overloaded\"}\n\n";
        match assemble(typed.as_bytes()) {
            Err(SseError::Upstream(e)) => assert_eq!(e, json!({"message": "overloaded"})),
            other => panic!("expected an upstream error, got {other:?}"),
        }
    }

    #[test]
    fn broken_streams_are_refused() {
        // Cut before the finish chunk and [DONE].
        let cut = &TEXT_STREAM[..TEXT_STREAM.find("Zürich").unwrap()];
        let cut = &cut[..cut.rfind("\n\n").unwrap() + 2];
        assert!(matches!(assemble(cut.as_bytes()), Err(SseError::Truncated)));
        // Every choice finished but no [DONE]: not ended as a success.
        let no_done = TEXT_STREAM.replace("data: [DONE]\n\n", "");
        assert!(matches!(
            assemble(no_done.as_bytes()),
            Err(SseError::Truncated)
        ));
        // [DONE], but a choice never finished.
        let unfinished =
            TEXT_STREAM.replace("\"finish_reason\":\"stop\"", "\"finish_reason\":null");
        assert_ne!(unfinished, TEXT_STREAM);
        assert!(matches!(
            assemble(unfinished.as_bytes()),
            Err(SseError::Truncated)
        ));
        assert!(matches!(
            assemble(b"data: [DONE]\n\n"),
            Err(SseError::Empty)
        ));
        assert!(matches!(assemble(b""), Err(SseError::Empty)));
        assert!(matches!(
            assemble(b"data: {oops\n\n"),
            Err(SseError::Json { event: 0, .. })
        ));
        assert!(matches!(
            assemble(b"data: [1]\n\n"),
            Err(SseError::NotAChunk { event: 0 })
        ));
    }
}
