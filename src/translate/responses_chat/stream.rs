//! A chat completion stream read back as the Responses API's typed events,
//! chunk by chunk as it arrives.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::reply::{
    Echo, Item, Outcome, Part, call_item_id, final_status, first_choice, incomplete_reason,
    message_id, render_item, render_output, render_part, response_object, text_of, usage_of,
};
#[cfg(test)]
use crate::sse::{PIECE_BYTES, pieces};

/// Writes one server-sent event with the next sequence number.
pub(super) fn emit(out: &mut Vec<u8>, sequence: &mut u64, kind: &str, body: Value) {
    let mut event = match body {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    event.insert("type".into(), kind.into());
    event.insert("sequence_number".into(), (*sequence).into());
    *sequence += 1;
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(Value::Object(event).to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// Chat chunks in, Responses events out, as they arrive; every event has its
/// `sequence_number` (0,1,2,... in order) and is written
/// `event: <type>\ndata: <compact json>\n\n`.
///
/// `response.created` and `response.in_progress` come with the first call. Items open
/// in the order their first delta arrives and all stay open until the end, so chunks
/// from upstreams that interleave tool calls still land in the right item; they are
/// closed (`*.done` events, in output order) just before the final event.
#[derive(Debug, Clone)]
pub struct StreamTranslator {
    id: String,
    created_at: u64,
    echo: Echo,
    sequence: u64,
    started: bool,
    ended: bool,
    model: Option<String>,
    items: Vec<Item>,
    /// Position of the message item in `items`, once text or a refusal arrived.
    message: Option<usize>,
    /// Chat tool call `index` to position in `items`.
    calls: Vec<(u64, usize)>,
    finish_reason: Option<String>,
    usage: Option<Value>,
}

impl StreamTranslator {
    /// A translator for the response `id`, created at `created_at` (seconds).
    pub fn new(id: &str, created_at: u64, echo: Echo) -> Self {
        StreamTranslator {
            id: id.to_owned(),
            created_at,
            echo,
            sequence: 0,
            started: false,
            ended: false,
            model: None,
            items: Vec::new(),
            message: None,
            calls: Vec::new(),
            finish_reason: None,
            usage: None,
        }
    }

    /// True once a chunk gave the choice its `finish_reason`.
    pub fn saw_finish(&self) -> bool {
        self.finish_reason.is_some()
    }

    /// One parsed chunk (usage-only chunks with choices: [] included).
    pub fn push(&mut self, chunk: &Value) -> Bytes {
        if self.ended {
            return Bytes::new();
        }
        if self.model.is_none() {
            self.model = chunk
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned);
        }
        let mut out = Vec::new();
        self.start(&mut out);
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(usage.clone());
        }
        let Some(choice) = first_choice(chunk) else {
            return Bytes::from(out);
        };
        if let Some(delta) = choice.get("delta") {
            if let Some(text) = delta.get("content").map(text_of) {
                self.text_delta(&mut out, false, &text);
            }
            if let Some(text) = delta.get("refusal").map(text_of) {
                self.text_delta(&mut out, true, &text);
            }
            if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
                for (position, call) in calls.iter().enumerate() {
                    self.call_delta(&mut out, position, call);
                }
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_owned());
        }
        Bytes::from(out)
    }

    /// The chat stream ended normally: close open parts/items, then `response.completed`
    /// with the full response object (or `response.incomplete` with
    /// `incomplete_details.reason` when the finish reason was `length` or
    /// `content_filter`). Idempotent.
    pub fn finish(&mut self) -> Bytes {
        if self.ended {
            return Bytes::new();
        }
        self.ended = true;
        let mut out = Vec::new();
        self.start(&mut out);
        let reason = incomplete_reason(self.finish_reason.as_deref());
        let count = self.items.len();
        for (index, item) in self.items.iter().enumerate() {
            let status = final_status(index, count, reason.is_some());
            match item {
                Item::Message { id, parts } => {
                    for (content_index, part) in parts.iter().enumerate() {
                        let (kind, key) = if part.refusal {
                            ("response.refusal.done", "refusal")
                        } else {
                            ("response.output_text.done", "text")
                        };
                        let mut body = json!({
                            "item_id": id,
                            "output_index": index,
                            "content_index": content_index,
                        });
                        body[key] = Value::String(part.text.clone());
                        if !part.refusal {
                            body["logprobs"] = json!([]);
                        }
                        emit(&mut out, &mut self.sequence, kind, body);
                        emit(
                            &mut out,
                            &mut self.sequence,
                            "response.content_part.done",
                            json!({
                                "item_id": id,
                                "output_index": index,
                                "content_index": content_index,
                                "part": render_part(part, &part.text),
                            }),
                        );
                    }
                }
                Item::Call { id, name, .. } if self.echo.tools.is_custom(name) => {
                    let done = render_item(item, status, true, &self.echo.tools);
                    emit(
                        &mut out,
                        &mut self.sequence,
                        "response.custom_tool_call_input.done",
                        json!({"item_id": id, "output_index": index, "input": done["input"]}),
                    )
                }
                Item::Call {
                    id,
                    name,
                    arguments,
                    ..
                } => emit(
                    &mut out,
                    &mut self.sequence,
                    "response.function_call_arguments.done",
                    json!({
                        "item_id": id,
                        "output_index": index,
                        "name": name,
                        "arguments": arguments,
                    }),
                ),
            }
            emit(
                &mut out,
                &mut self.sequence,
                "response.output_item.done",
                json!({"output_index": index, "item": render_item(item, status, true, &self.echo.tools)}),
            );
        }
        let (kind, outcome) = match reason {
            Some(reason) => ("response.incomplete", Outcome::Incomplete(reason)),
            None => ("response.completed", Outcome::Completed),
        };
        let response = self.response(
            &outcome,
            render_output(&self.items, reason.is_some(), &self.echo.tools),
        );
        emit(
            &mut out,
            &mut self.sequence,
            kind,
            json!({"response": response}),
        );
        Bytes::from(out)
    }

    /// The stream failed mid-way (`message` from the upstream error): `response.failed`
    /// with status failed and error {code, message}, its output holding what arrived so
    /// far (items marked incomplete). Use a code the SDK knows, such as `server_error`
    /// or `rate_limit_exceeded`. Idempotent with finish (only one of them emits).
    pub fn fail(&mut self, code: &str, message: &str) -> Bytes {
        if self.ended {
            return Bytes::new();
        }
        self.ended = true;
        let mut out = Vec::new();
        self.start(&mut out);
        let output = self
            .items
            .iter()
            .map(|item| render_item(item, "incomplete", true, &self.echo.tools))
            .collect();
        let response = self.response(&Outcome::Failed { code, message }, output);
        emit(
            &mut out,
            &mut self.sequence,
            "response.failed",
            json!({"response": response}),
        );
        Bytes::from(out)
    }

    fn response(&self, outcome: &Outcome, output: Vec<Value>) -> Value {
        let usage = match outcome {
            Outcome::InProgress => Value::Null,
            _ => usage_of(self.usage.as_ref()),
        };
        let model = self.model.as_deref().unwrap_or(&self.echo.model);
        response_object(
            &self.echo,
            &self.id,
            self.created_at,
            model,
            outcome,
            output,
            usage,
        )
    }

    /// `response.created` and `response.in_progress`, once.
    fn start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let response = self.response(&Outcome::InProgress, Vec::new());
        emit(
            out,
            &mut self.sequence,
            "response.created",
            json!({"response": response}),
        );
        emit(
            out,
            &mut self.sequence,
            "response.in_progress",
            json!({"response": response}),
        );
    }

    /// Appends text (or refusal text) to the message item, opening the item and the
    /// part first if needed.
    fn text_delta(&mut self, out: &mut Vec<u8>, refusal: bool, delta: &str) {
        if delta.is_empty() {
            return;
        }
        let output_index = match self.message {
            Some(index) => index,
            None => {
                let index = self.items.len();
                let item = Item::Message {
                    id: message_id(&self.id),
                    parts: Vec::new(),
                };
                emit(
                    out,
                    &mut self.sequence,
                    "response.output_item.added",
                    json!({"output_index": index, "item": render_item(&item, "in_progress", false, &self.echo.tools)}),
                );
                self.items.push(item);
                self.message = Some(index);
                index
            }
        };
        let Some(Item::Message { id, parts }) = self.items.get_mut(output_index) else {
            return;
        };
        let content_index = match parts.iter().position(|p| p.refusal == refusal) {
            Some(content_index) => content_index,
            None => {
                let part = Part {
                    refusal,
                    text: String::new(),
                };
                emit(
                    out,
                    &mut self.sequence,
                    "response.content_part.added",
                    json!({
                        "item_id": id,
                        "output_index": output_index,
                        "content_index": parts.len(),
                        "part": render_part(&part, ""),
                    }),
                );
                parts.push(part);
                parts.len() - 1
            }
        };
        if let Some(part) = parts.get_mut(content_index) {
            part.text.push_str(delta);
        }
        let mut body = json!({
            "item_id": id,
            "output_index": output_index,
            "content_index": content_index,
            "delta": delta,
        });
        let kind = if refusal {
            "response.refusal.delta"
        } else {
            body["logprobs"] = json!([]);
            "response.output_text.delta"
        };
        emit(out, &mut self.sequence, kind, body);
    }

    /// Applies one tool call fragment, opening its function call item on first sight.
    fn call_delta(&mut self, out: &mut Vec<u8>, position: usize, call: &Value) {
        let chat_index = call
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(position as u64);
        let function = call.get("function");
        let name = function
            .and_then(|f| f.get("name"))
            .map(text_of)
            .unwrap_or_default();
        let call_id = call.get("id").map(text_of).unwrap_or_default();
        let fragment = function
            .and_then(|f| f.get("arguments"))
            .map(text_of)
            .unwrap_or_default();
        let known = self
            .calls
            .iter()
            .find(|(index, _)| *index == chat_index)
            .map(|(_, at)| *at);
        let output_index = match known {
            Some(at) => {
                // Late names or ids from upstreams that split them complete the item.
                if let Some(Item::Call {
                    name: known_name,
                    call_id: known_id,
                    ..
                }) = self.items.get_mut(at)
                {
                    if known_id.is_empty() {
                        known_id.push_str(&call_id);
                    }
                    if known_name != &name {
                        known_name.push_str(&name);
                    }
                }
                at
            }
            None => {
                let at = self.items.len();
                let id = call_item_id(&self.id, self.calls.len());
                let item = Item::Call {
                    call_id: if call_id.is_empty() {
                        id.clone()
                    } else {
                        call_id
                    },
                    id,
                    name,
                    arguments: String::new(),
                };
                emit(
                    out,
                    &mut self.sequence,
                    "response.output_item.added",
                    json!({"output_index": at, "item": render_item(&item, "in_progress", false, &self.echo.tools)}),
                );
                self.items.push(item);
                self.calls.push((chat_index, at));
                at
            }
        };
        if fragment.is_empty() {
            return;
        }
        if let Some(Item::Call {
            id,
            arguments,
            name,
            ..
        }) = self.items.get_mut(output_index)
        {
            arguments.push_str(&fragment);
            // A custom tool's input is inside the arguments' JSON: it is
            // given whole when the call is done.
            if self.echo.tools.is_custom(name) {
                return;
            }
            emit(
                out,
                &mut self.sequence,
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": output_index, "delta": fragment}),
            );
        }
    }
}

#[cfg(test)]
/// The chat chunks a streaming upstream would have sent for `completion`: a role chunk,
/// the text and then the refusal in pieces of at most 256 bytes, each tool call whole
/// in one chunk, the finish chunk, and a usage-only chunk when there is usage.
fn chunks_of(completion: &Value) -> Vec<Value> {
    let mut head = Map::new();
    for key in ["id", "created", "model", "system_fingerprint"] {
        if let Some(value) = completion.get(key) {
            head.insert(key.into(), value.clone());
        }
    }
    head.insert("object".into(), "chat.completion.chunk".into());
    let chunk = |choices: Value| {
        let mut chunk = head.clone();
        chunk.insert("choices".into(), choices);
        Value::Object(chunk)
    };
    let delta = |delta: Value| chunk(json!([{"index": 0, "delta": delta, "finish_reason": null}]));

    let mut chunks = vec![delta(json!({"role": "assistant", "content": ""}))];
    let choice = first_choice(completion);
    let message = choice.and_then(|c| c.get("message"));
    if let Some(message) = message {
        let text = message.get("content").map(text_of).unwrap_or_default();
        for piece in pieces(&text, PIECE_BYTES) {
            chunks.push(delta(json!({"content": piece})));
        }
        let refusal = message.get("refusal").map(text_of).unwrap_or_default();
        for piece in pieces(&refusal, PIECE_BYTES) {
            chunks.push(delta(json!({"refusal": piece})));
        }
        let calls = message
            .get("tool_calls")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for (index, call) in calls.iter().enumerate() {
            let mut call = call.clone();
            call["index"] = index.into();
            chunks.push(delta(json!({"tool_calls": [call]})));
        }
    }
    let finish = choice
        .and_then(|c| c.get("finish_reason"))
        .cloned()
        .unwrap_or(Value::Null);
    chunks.push(chunk(
        json!([{"index": 0, "delta": {}, "finish_reason": finish}]),
    ));
    if let Some(usage) = completion.get("usage").filter(|u| u.is_object()) {
        let mut last = head.clone();
        last.insert("choices".into(), json!([]));
        last.insert("usage".into(), usage.clone());
        chunks.push(Value::Object(last));
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::super::reply::response_from_completion;
    use super::*;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    /// The SDK's `Response.output_text`: every `output_text` part of every `message`.
    fn output_text(response: &Value) -> String {
        let mut text = String::new();
        for item in response["output"].as_array().expect("output is a list") {
            if item["type"] == "message" {
                for part in item["content"].as_array().expect("content is a list") {
                    if part["type"] == "output_text" {
                        text.push_str(part["text"].as_str().expect("text is a string"));
                    }
                }
            }
        }
        text
    }

    /// Splits an SSE body into (event name, data), checking the framing on the way.
    fn events(body: &[u8]) -> Vec<(String, Value)> {
        let body = std::str::from_utf8(body).expect("utf-8");
        assert!(body.is_empty() || body.ends_with("\n\n"), "{body}");
        body.split_terminator("\n\n")
            .map(|block| {
                let (head, data) = block.split_once('\n').expect("two lines per event");
                let name = head.strip_prefix("event: ").expect("event line");
                let data = data.strip_prefix("data: ").expect("data line");
                assert!(!data.contains('\n'), "data is compact json");
                let data: Value = serde_json::from_str(data).expect("data is json");
                assert_eq!(data["type"], name, "event name and type agree");
                (name.to_owned(), data)
            })
            .collect()
    }

    fn kinds(events: &[(String, Value)]) -> Vec<&str> {
        events.iter().map(|(name, _)| name.as_str()).collect()
    }

    fn assert_sequence(events: &[(String, Value)]) {
        for (expected, (_, data)) in events.iter().enumerate() {
            assert_eq!(data["sequence_number"], expected as u64, "{data}");
        }
    }

    fn completion(message: Value, finish_reason: &str) -> Value {
        json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": "gpt-4o-2024-08-06",
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {
                "prompt_tokens": 20,
                "completion_tokens": 7,
                "total_tokens": 27,
                "prompt_tokens_details": {"cached_tokens": 4},
                "completion_tokens_details": {"reasoning_tokens": 2},
            },
        })
    }

    fn echo() -> Echo {
        Echo::of(&object(json!({
            "model": "gpt-4o",
            "instructions": "Be brief.",
            "input": "hi",
            "temperature": 0.2,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        })))
    }

    /// A whole completion as the full event stream: the translator fed
    /// the chunks a streaming upstream would have sent for it.
    fn stream_from_completion(completion: &Value, id: &str, created_at: u64, echo: &Echo) -> Bytes {
        let mut translator = StreamTranslator::new(id, created_at, echo.clone());
        let mut out = Vec::new();
        for chunk in chunks_of(completion) {
            out.extend_from_slice(&translator.push(&chunk));
        }
        out.extend_from_slice(&translator.finish());
        Bytes::from(out)
    }

    fn chunk(choices: Value) -> Value {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
               "model": "gpt-4o-2024-08-06", "choices": choices})
    }

    fn delta(delta: Value) -> Value {
        chunk(json!([{"index": 0, "delta": delta, "finish_reason": null}]))
    }

    /// A realistic upstream stream: role, text, two tool calls with fragmented
    /// arguments, the finish chunk, then a usage-only chunk.
    fn live_chunks() -> Vec<Value> {
        vec![
            delta(json!({"role": "assistant", "content": ""})),
            delta(json!({"content": "Let me "})),
            delta(json!({"content": "check."})),
            delta(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": ""}}]}),
            ),
            delta(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]})),
            delta(json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]})),
            delta(
                json!({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                          "function": {"name": "get_time", "arguments": "{\"tz\":"}}]}),
            ),
            delta(json!({"tool_calls": [{"index": 1, "function": {"arguments": "\"CET\"}"}}]})),
            chunk(json!([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}])),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
                   "model": "gpt-4o-2024-08-06", "choices": [],
                   "usage": {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27,
                             "prompt_tokens_details": {"cached_tokens": 4},
                             "completion_tokens_details": {"reasoning_tokens": 2}}}),
        ]
    }

    fn run(chunks: &[Value]) -> Vec<u8> {
        let mut translator = StreamTranslator::new("resp_abc", 1_700_000_001, echo());
        let mut body = Vec::new();
        for chunk in chunks {
            body.extend_from_slice(&translator.push(chunk));
        }
        body.extend_from_slice(&translator.finish());
        body
    }

    #[test]
    fn live_translator_emits_the_responses_event_sequence() {
        let events = events(&run(&live_chunks()));
        assert_eq!(
            kinds(&events),
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_sequence(&events);

        let created = &events[0].1["response"];
        assert_eq!(created["status"], "in_progress");
        assert_eq!(created["output"], json!([]));
        assert_eq!(created["id"], "resp_abc");
        assert_eq!(
            events[2].1["item"],
            json!({"id": "msg_abc", "type": "message",
            "status": "in_progress", "role": "assistant", "content": []})
        );
        assert_eq!(
            events[3].1["part"],
            json!({"type": "output_text", "text": "",
            "annotations": [], "logprobs": []})
        );
        assert_eq!(events[4].1["delta"], "Let me ");
        assert_eq!(events[4].1["item_id"], "msg_abc");
        assert_eq!(events[4].1["content_index"], 0);
        assert_eq!(events[6].1["output_index"], 1);
        assert_eq!(
            events[6].1["item"],
            json!({"id": "fc_abc_0", "type": "function_call",
            "status": "in_progress", "call_id": "call_1", "name": "get_weather", "arguments": ""})
        );
        assert_eq!(events[8].1["delta"], "\"Paris\"}");
        assert_eq!(events[8].1["item_id"], "fc_abc_0");
        assert_eq!(events[9].1["output_index"], 2);
        assert_eq!(events[12].1["text"], "Let me check.");
        assert_eq!(events[15].1["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(events[15].1["name"], "get_weather");
        assert_eq!(events[17].1["arguments"], "{\"tz\":\"CET\"}");
        assert_eq!(events[18].1["item"]["status"], "completed");

        let response = &events[19].1["response"];
        assert_eq!(response["status"], "completed");
        assert_eq!(output_text(response), "Let me check.");
        assert_eq!(response["usage"]["input_tokens"], 20);
        assert_eq!(response["output"][1]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(response["output"][2]["call_id"], "call_2");
    }

    #[test]
    fn deltas_accumulate_into_the_final_output_like_the_sdk_does() {
        let events = events(&run(&live_chunks()));
        let mut snapshot = events[0].1["response"].clone();
        for (name, data) in &events[1..] {
            let index = data["output_index"].as_u64().unwrap_or(0) as usize;
            match name.as_str() {
                "response.output_item.added" => snapshot["output"]
                    .as_array_mut()
                    .expect("list")
                    .push(data["item"].clone()),
                "response.content_part.added" => snapshot["output"][index]["content"]
                    .as_array_mut()
                    .expect("list")
                    .push(data["part"].clone()),
                "response.output_text.delta" => {
                    let content = data["content_index"].as_u64().expect("index") as usize;
                    let text = &mut snapshot["output"][index]["content"][content]["text"];
                    *text = format!(
                        "{}{}",
                        text.as_str().expect("text"),
                        data["delta"].as_str().expect("delta")
                    )
                    .into();
                }
                "response.function_call_arguments.delta" => {
                    let arguments = &mut snapshot["output"][index]["arguments"];
                    *arguments = format!(
                        "{}{}",
                        arguments.as_str().expect("args"),
                        data["delta"].as_str().expect("delta")
                    )
                    .into();
                }
                "response.output_item.done" => snapshot["output"][index] = data["item"].clone(),
                _ => {}
            }
        }
        let completed = &events.last().expect("events").1["response"];
        assert_eq!(snapshot["output"], completed["output"]);
    }

    /// A chunking of a completion written independently of `chunks_of`: text in pieces
    /// of at most 256 bytes on char boundaries, tool calls whole.
    fn test_chunks(done: &Value) -> Vec<Value> {
        let message = &done["choices"][0]["message"];
        let mut chunks = vec![delta(json!({"role": "assistant", "content": ""}))];
        for (key, text) in [
            ("content", &message["content"]),
            ("refusal", &message["refusal"]),
        ] {
            let mut piece = String::new();
            for ch in text.as_str().unwrap_or("").chars() {
                if piece.len() + ch.len_utf8() > 256 {
                    chunks.push(delta(json!({ key: piece })));
                    piece = String::new();
                }
                piece.push(ch);
            }
            if !piece.is_empty() {
                chunks.push(delta(json!({ key: piece })));
            }
        }
        if let Some(calls) = message["tool_calls"].as_array() {
            for (index, call) in calls.iter().enumerate() {
                chunks.push(delta(
                    json!({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                    "function": call["function"]}]}),
                ));
            }
        }
        chunks.push(chunk(json!([{"index": 0, "delta": {}, "finish_reason": done["choices"][0]["finish_reason"]}])));
        chunks.push(
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
                           "model": "gpt-4o-2024-08-06", "choices": [], "usage": done["usage"]}),
        );
        chunks
    }

    fn sample_completions() -> Vec<Value> {
        let long: String = "Grüße aus Köln, 東京 und Zürich! ".repeat(30);
        vec![
            completion(json!({"role": "assistant", "content": long}), "stop"),
            completion(
                json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                ]}),
                "tool_calls",
            ),
            completion(
                json!({"role": "assistant", "content": "Once upon a"}),
                "length",
            ),
            completion(
                json!({"role": "assistant", "content": null, "refusal": "No."}),
                "stop",
            ),
            completion(json!({"role": "assistant", "content": ""}), "stop"),
        ]
    }

    #[test]
    fn stream_from_completion_equals_the_translator_fed_its_chunks() {
        for done in sample_completions() {
            let whole = stream_from_completion(&done, "resp_abc", 1_700_000_001, &echo());
            assert_eq!(
                whole.as_ref(),
                run(&test_chunks(&done)).as_slice(),
                "{done}"
            );
            let events = events(&whole);
            assert_sequence(&events);
            for (name, data) in &events {
                if name == "response.output_text.delta" {
                    assert!(data["delta"].as_str().expect("delta").len() <= 256);
                }
            }
        }
    }

    #[test]
    fn the_streamed_final_response_equals_the_plain_one() {
        for done in sample_completions() {
            let plain = response_from_completion(&done, "resp_abc", 1_700_000_001, &echo());
            let events = events(&stream_from_completion(
                &done,
                "resp_abc",
                1_700_000_001,
                &echo(),
            ));
            let (name, last) = events.last().expect("events");
            let expected = if plain["status"] == "incomplete" {
                "response.incomplete"
            } else {
                "response.completed"
            };
            assert_eq!(name, expected);
            assert_eq!(last["response"], plain, "{done}");
        }
        // And the live stream, whose chunks differ from the synthesized ones.
        let live = events(&run(&live_chunks()));
        let done = completion(
            json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\":\"CET\"}"}},
            ]}),
            "tool_calls",
        );
        assert_eq!(
            live.last().expect("events").1["response"],
            response_from_completion(&done, "resp_abc", 1_700_000_001, &echo())
        );
    }

    #[test]
    fn length_in_a_stream_ends_with_response_incomplete() {
        let chunks = vec![
            delta(json!({"role": "assistant", "content": "Once"})),
            chunk(json!([{"index": 0, "delta": {}, "finish_reason": "length"}])),
        ];
        let events = events(&run(&chunks));
        let (name, last) = events.last().expect("events");
        assert_eq!(name, "response.incomplete");
        assert_eq!(last["response"]["status"], "incomplete");
        assert_eq!(
            last["response"]["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        assert_eq!(last["response"]["usage"], Value::Null);
        let item_done = &events[events.len() - 2].1;
        assert_eq!(item_done["item"]["status"], "incomplete");
    }

    #[test]
    fn finish_and_fail_emit_once_between_them() {
        let mut translator = StreamTranslator::new("resp_abc", 1, echo());
        let first = events(&translator.push(&delta(json!({"content": "Hal"}))));
        assert_eq!(
            kinds(&first),
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta"
            ]
        );
        let failed = events(&translator.fail("server_error", "upstream reset the connection"));
        assert_eq!(kinds(&failed), vec!["response.failed"]);
        assert_eq!(failed[0].1["sequence_number"], 5);
        let response = &failed[0].1["response"];
        assert_eq!(response["status"], "failed");
        assert_eq!(
            response["error"],
            json!({"code": "server_error", "message": "upstream reset the connection"})
        );
        assert_eq!(response["output"][0]["status"], "incomplete");
        assert_eq!(output_text(response), "Hal");
        assert!(translator.finish().is_empty());
        assert!(translator.fail("server_error", "again").is_empty());
        assert!(
            translator
                .push(&delta(json!({"content": "late"})))
                .is_empty()
        );

        let mut translator = StreamTranslator::new("resp_abc", 1, echo());
        let done = events(&translator.finish());
        assert_eq!(
            kinds(&done),
            vec![
                "response.created",
                "response.in_progress",
                "response.completed"
            ]
        );
        assert_sequence(&done);
        assert!(translator.finish().is_empty());
        assert!(translator.fail("server_error", "x").is_empty());

        let mut translator = StreamTranslator::new("resp_abc", 1, echo());
        let failed = events(&translator.fail("server_error", "no upstream"));
        assert_eq!(
            kinds(&failed),
            vec![
                "response.created",
                "response.in_progress",
                "response.failed"
            ]
        );
        assert_eq!(failed[2].1["response"]["model"], "gpt-4o");
    }

    #[test]
    fn other_choices_are_ignored() {
        let chunks = vec![
            chunk(json!([{"index": 1, "delta": {"content": "other"}, "finish_reason": null}])),
            chunk(
                json!([{"index": 0, "delta": {"content": "mine"}, "finish_reason": "stop"},
                         {"index": 1, "delta": {"content": "other"}, "finish_reason": "length"}]),
            ),
        ];
        let events = events(&run(&chunks));
        let response = &events.last().expect("events").1["response"];
        assert_eq!(output_text(response), "mine");
        assert_eq!(response["status"], "completed");
    }

    #[test]
    fn echo_reflects_the_request() {
        let echo = Echo::of(&object(json!({
            "model": "gpt-4o",
            "input": "x",
            "store": false,
            "previous_response_id": "resp_prev",
            "metadata": {"k": "v"},
            "parallel_tool_calls": false,
            "tool_choice": "none",
            "max_output_tokens": 64,
            "user": "u",
            "text": {"format": {"type": "json_object"}, "verbosity": "high"},
            "reasoning": {"effort": "low", "summary": "concise"},
        })));
        let response = response_from_completion(
            &json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "{}"}, "finish_reason": "stop"}]}),
            "resp_x",
            5,
            &echo,
        );
        assert_eq!(
            response["model"], "gpt-4o",
            "the asked model when the completion names none"
        );
        assert_eq!(response["store"], false);
        assert_eq!(response["previous_response_id"], "resp_prev");
        assert_eq!(response["metadata"], json!({"k": "v"}));
        assert_eq!(response["parallel_tool_calls"], false);
        assert_eq!(response["tool_choice"], "none");
        assert_eq!(response["max_output_tokens"], 64);
        assert_eq!(response["user"], "u");
        assert_eq!(
            response["text"],
            json!({"format": {"type": "json_object"}, "verbosity": "high"})
        );
        assert_eq!(
            response["reasoning"],
            json!({"effort": "low", "summary": "concise"})
        );
        assert_eq!(response["instructions"], Value::Null);
        assert_eq!(response["output"][0]["id"], "msg_x");
    }
}
