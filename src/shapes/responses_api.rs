//! Bridge between OpenAI's Responses API and chat completions. idem's core
//! speaks chat completions only, but some upstream providers speak the
//! Responses API natively: idem sends them a Responses request and reads the
//! reply back here, either as a plain chat completion (from a `response`
//! object) or as a chat completion SSE stream (from Responses streaming
//! events), so everything downstream keeps working unchanged. idem also keeps
//! conversations as chat messages, so [`input_items`] turns them back into
//! Responses `input` items for the next request.

use bytes::Bytes;
use serde_json::{Value, json};

/// Chat ids are derived from the response id so one upstream answer always maps
/// to the same chat id, in both the plain and the streaming form.
fn chat_id(response: &Value) -> String {
    let id = response["id"].as_str().unwrap_or_default();
    format!("chatcmpl-{}", id.strip_prefix("resp_").unwrap_or(id))
}

/// `created_at` is a float in some SDK types; chat clients expect an integer.
fn created_at(response: &Value) -> i64 {
    let created = &response["created_at"];
    created
        .as_i64()
        .or_else(|| created.as_f64().map(|f| f as i64))
        .unwrap_or(0)
}

/// Shared by the plain and streaming paths so both report the same reason.
/// `saw_call` covers streams whose final `response.output` is absent or trimmed.
fn finish_reason(response: &Value, saw_call: bool) -> &'static str {
    let has_call = saw_call
        || response["output"]
            .as_array()
            .is_some_and(|items| items.iter().any(|i| i["type"] == "function_call"));
    if has_call {
        return "tool_calls";
    }
    if response["status"] == "incomplete" {
        match response["incomplete_details"]["reason"].as_str() {
            Some("max_output_tokens") => return "length",
            Some("content_filter") => return "content_filter",
            _ => {}
        }
    }
    "stop"
}

/// Responses usage in chat shape; None when the response carries no usage, so
/// callers can omit the key instead of inventing zeros.
fn chat_usage(usage: &Value) -> Option<Value> {
    let u = usage.as_object()?;
    let count = |key: &str| u.get(key).and_then(Value::as_u64).unwrap_or(0);
    let (input, output) = (count("input_tokens"), count("output_tokens"));
    let total = u
        .get("total_tokens")
        .and_then(Value::as_u64)
        .unwrap_or(input + output);
    let mut out =
        json!({ "prompt_tokens": input, "completion_tokens": output, "total_tokens": total });
    let cached = &usage["input_tokens_details"]["cached_tokens"];
    if !cached.is_null() {
        out["prompt_tokens_details"] = json!({ "cached_tokens": cached });
    }
    let reasoning = &usage["output_tokens_details"]["reasoning_tokens"];
    if !reasoning.is_null() {
        out["completion_tokens_details"] = json!({ "reasoning_tokens": reasoning });
    }
    Some(out)
}

/// A Responses `response` object (status completed or incomplete) as a chat
/// completion, or None when it is not a response object (no `output` array),
/// so callers can fall back to treating the body as something else.
/// Only choice 0 is produced: the Responses API has a single output list.
/// Reasoning and built-in tool items have no chat equivalent and are dropped.
pub fn completion_from_response(response: &Value) -> Option<Value> {
    let output = response.get("output")?.as_array()?;
    let mut text = String::new();
    let mut refusal: Option<String> = None;
    let mut tool_calls = Vec::new();
    for item in output {
        match item["type"].as_str() {
            Some("message") => {
                for part in item["content"].as_array().into_iter().flatten() {
                    match part["type"].as_str() {
                        Some("output_text") => text.push_str(part["text"].as_str().unwrap_or("")),
                        Some("refusal") => refusal
                            .get_or_insert_with(String::new)
                            .push_str(part["refusal"].as_str().unwrap_or("")),
                        _ => {}
                    }
                }
            }
            Some("function_call") => tool_calls.push(json!({
                "id": item["call_id"],
                "type": "function",
                "function": {
                    "name": item["name"],
                    "arguments": item["arguments"].as_str().unwrap_or(""),
                },
            })),
            _ => {}
        }
    }
    let mut message = json!({
        "role": "assistant",
        "content": if text.is_empty() { Value::Null } else { Value::String(text) },
        "refusal": refusal,
    });
    if !tool_calls.is_empty() {
        message["tool_calls"] = Value::Array(tool_calls);
    }
    let mut completion = json!({
        "id": chat_id(response),
        "object": "chat.completion",
        "created": created_at(response),
        "model": response["model"].as_str().unwrap_or(""),
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish_reason(response, false),
        }],
    });
    if let Some(usage) = chat_usage(&response["usage"]) {
        completion["usage"] = usage;
    }
    Some(completion)
}

/// A failed response, a `response.failed` event or an `error` event as an
/// OpenAI error object, so idem reports upstream failures the way a chat
/// provider would. Accepts the event wrapper too, which keeps callers simple.
pub fn error_from_response(value: &Value) -> Value {
    let source = if value.get("response").is_some_and(Value::is_object) {
        &value["response"]["error"]
    } else if value.get("error").is_some_and(Value::is_object) {
        &value["error"]
    } else {
        value
    };
    let message = source["message"]
        .as_str()
        .unwrap_or("upstream response failed");
    json!({ "error": { "message": message, "type": "upstream_error", "code": source["code"] } })
}

/// One SSE frame; `Value`'s `Display` is compact JSON, as chat streams are.
fn push_frame(out: &mut String, data: &str) {
    out.push_str("data: ");
    out.push_str(data);
    out.push_str("\n\n");
}

/// Responses streaming events in, chat completion chunks out, as they arrive.
/// Keeps only what chat chunks need: the response identity and which output
/// index belongs to which tool call.
pub struct ChunkTranslator {
    include_usage: bool,
    started: bool,
    finished: bool,
    id: String,
    created: i64,
    model: String,
    /// Position is the chat tool call index; holds (output_index, arguments sent so far).
    calls: Vec<(Option<u64>, String)>,
}

impl ChunkTranslator {
    /// `include_usage`: end with a usage chunk (`choices: []`) as chat streams
    /// do when the client asked for `stream_options.include_usage`.
    pub fn new(include_usage: bool) -> Self {
        Self {
            include_usage,
            started: false,
            finished: false,
            id: "chatcmpl-".into(),
            created: 0,
            model: String::new(),
            calls: Vec::new(),
        }
    }

    /// One event's parsed data. Returns the SSE bytes of zero or more chat
    /// chunks (`data: <json>\n\n`); after the stream ends (completed,
    /// incomplete, failed or error) further events yield nothing.
    pub fn push(&mut self, event: &Value) -> Bytes {
        let mut out = String::new();
        if self.finished {
            return Bytes::new();
        }
        match event["type"].as_str().unwrap_or("") {
            "response.created" | "response.in_progress" => self.start(&mut out, &event["response"]),
            "response.output_text.delta" => {
                self.start(&mut out, &Value::Null);
                self.chunk(&mut out, json!({ "content": event["delta"] }), None);
            }
            "response.refusal.delta" => {
                self.start(&mut out, &Value::Null);
                self.chunk(&mut out, json!({ "refusal": event["delta"] }), None);
            }
            "response.output_item.added" if event["item"]["type"] == "function_call" => {
                self.start(&mut out, &Value::Null);
                let item = &event["item"];
                let index = self.calls.len();
                self.calls
                    .push((event["output_index"].as_u64(), String::new()));
                let call = json!({
                    "index": index,
                    "id": item["call_id"],
                    "type": "function",
                    "function": { "name": item["name"], "arguments": "" },
                });
                self.chunk(&mut out, json!({ "tool_calls": [call] }), None);
            }
            "response.function_call_arguments.delta" => {
                let delta = event["delta"].as_str().unwrap_or("");
                self.arguments(&mut out, event, delta);
            }
            "response.function_call_arguments.done" => {
                // Some providers send the arguments only here; send whatever
                // the deltas did not already cover.
                let full = event["arguments"].as_str().unwrap_or("");
                let sent = self.call(event).map(|k| self.calls[k].1.clone());
                if let Some(rest) = sent.and_then(|s| full.strip_prefix(s.as_str()))
                    && !rest.is_empty()
                {
                    self.arguments(&mut out, event, rest);
                }
            }
            "response.completed" | "response.incomplete" => {
                let response = &event["response"];
                self.start(&mut out, response);
                let reason = finish_reason(response, !self.calls.is_empty());
                self.chunk(&mut out, json!({}), Some(reason));
                if self.include_usage {
                    let usage = chat_usage(&response["usage"]).unwrap_or(Value::Null);
                    let mut last = self.envelope(json!([]));
                    last["usage"] = usage;
                    push_frame(&mut out, &last.to_string());
                }
                push_frame(&mut out, "[DONE]");
                self.finished = true;
            }
            "response.failed" | "error" => {
                push_frame(&mut out, &error_from_response(event).to_string());
                self.finished = true;
            }
            _ => {}
        }
        Bytes::from(out)
    }

    /// Emits the opening role chunk once, taking identity from the first
    /// response object seen (normally `response.created`).
    fn start(&mut self, out: &mut String, response: &Value) {
        if self.started {
            return;
        }
        if response.is_object() {
            self.id = chat_id(response);
            self.created = created_at(response);
            self.model = response["model"].as_str().unwrap_or("").to_owned();
        }
        self.started = true;
        self.chunk(out, json!({ "role": "assistant", "content": "" }), None);
    }

    /// The chat tool call index of an event, by its output_index; falls back
    /// to the latest call when the provider omits the index.
    fn call(&self, event: &Value) -> Option<usize> {
        let wanted = event["output_index"].as_u64();
        self.calls
            .iter()
            .position(|(index, _)| wanted.is_some() && *index == wanted)
            .or_else(|| self.calls.len().checked_sub(1))
    }

    fn arguments(&mut self, out: &mut String, event: &Value, delta: &str) {
        if let Some(k) = self.call(event) {
            self.calls[k].1.push_str(delta);
            let call = json!({ "index": k, "function": { "arguments": delta } });
            self.chunk(out, json!({ "tool_calls": [call] }), None);
        }
    }

    fn envelope(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    fn chunk(&self, out: &mut String, delta: Value, finish: Option<&str>) {
        let choice =
            json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish });
        let mut chunk = self.envelope(json!([choice]));
        if self.include_usage {
            chunk["usage"] = Value::Null;
        }
        push_frame(out, &chunk.to_string());
    }
}

/// Chat content as plain text (tool outputs are strings in the Responses API).
fn text_of(content: &Value) -> String {
    match content {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Chat message content as Responses message content, or None when there is
/// nothing to send (so empty assistant turns that only call tools vanish).
fn message_content(content: &Value, assistant: bool) -> Option<Value> {
    match content {
        Value::String(s) if !s.is_empty() => Some(content.clone()),
        Value::Array(parts) => {
            let text_type = if assistant {
                "output_text"
            } else {
                "input_text"
            };
            let parts: Vec<Value> = parts
                .iter()
                .filter_map(|part| match part["type"].as_str() {
                    Some("text") => Some(json!({ "type": text_type, "text": part["text"] })),
                    Some("refusal") if assistant => {
                        Some(json!({ "type": "refusal", "refusal": part["refusal"] }))
                    }
                    Some("image_url") => {
                        let image = &part["image_url"];
                        let url = image["url"].as_str().or(image.as_str())?;
                        let detail = image["detail"].as_str().unwrap_or("auto");
                        Some(json!({ "type": "input_image", "image_url": url, "detail": detail }))
                    }
                    _ => None,
                })
                .collect();
            (!parts.is_empty()).then_some(Value::Array(parts))
        }
        _ => None,
    }
}

/// Chat messages (what idem keeps of a conversation) as Responses `input`
/// items, in order. Messages without text are skipped; tool calls become
/// `function_call` items after their message's text, and tool results become
/// `function_call_output` items, which is how the Responses API links them.
/// Roles with no Responses equivalent (legacy `function`) are dropped.
pub fn input_items(messages: &[Value]) -> Vec<Value> {
    let mut items = Vec::new();
    for message in messages {
        let role = message["role"].as_str().unwrap_or("");
        match role {
            "system" | "developer" | "user" | "assistant" => {
                if let Some(content) = message_content(&message["content"], role == "assistant") {
                    items.push(json!({ "role": role, "content": content }));
                }
                for call in message["tool_calls"].as_array().into_iter().flatten() {
                    items.push(json!({
                        "type": "function_call",
                        "call_id": call["id"],
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"].as_str().unwrap_or("{}"),
                    }));
                }
            }
            "tool" => items.push(json!({
                "type": "function_call_output",
                "call_id": message["tool_call_id"],
                "output": text_of(&message["content"]),
            })),
            _ => {}
        }
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(status: &str, output: Value) -> Value {
        json!({
            "id": "resp_abc", "object": "response", "created_at": 1700000000,
            "model": "gpt-4.1", "status": status, "output": output,
        })
    }

    fn message_item(parts: Value) -> Value {
        json!({ "type": "message", "id": "msg_1", "role": "assistant", "status": "completed", "content": parts })
    }

    fn frames(bytes: &[u8]) -> Vec<String> {
        let text = std::str::from_utf8(bytes).unwrap();
        assert!(text.is_empty() || text.ends_with("\n\n"));
        text.split_terminator("\n\n")
            .map(|f| f.strip_prefix("data: ").unwrap().to_owned())
            .collect()
    }

    #[test]
    fn text_response_becomes_completion() {
        let reasoning = json!({ "type": "reasoning", "id": "rs_1", "summary": [] });
        let parts = json!([
            { "type": "output_text", "text": "Hello, ", "annotations": [] },
            { "type": "output_text", "text": "world", "annotations": [] },
        ]);
        let c = completion_from_response(&response(
            "completed",
            json!([reasoning, message_item(parts)]),
        ))
        .unwrap();
        assert_eq!(c["id"], "chatcmpl-abc");
        assert_eq!(c["object"], "chat.completion");
        assert_eq!(c["created"], 1700000000);
        assert_eq!(c["model"], "gpt-4.1");
        let choice = &c["choices"][0];
        assert_eq!(choice["message"]["role"], "assistant");
        assert_eq!(choice["message"]["content"], "Hello, world");
        assert!(choice["message"].get("tool_calls").is_none());
        assert_eq!(choice["finish_reason"], "stop");
        assert!(c.get("usage").is_none());
    }

    #[test]
    fn refusal_response() {
        let parts = json!([{ "type": "refusal", "refusal": "I can't help with that." }]);
        let c =
            completion_from_response(&response("completed", json!([message_item(parts)]))).unwrap();
        let message = &c["choices"][0]["message"];
        assert_eq!(message["refusal"], "I can't help with that.");
        assert!(message["content"].is_null());
    }

    #[test]
    fn two_function_calls() {
        let call = |n: u8, name: &str, args: &str| {
            json!({ "type": "function_call", "id": format!("fc_{n}"), "call_id": format!("call_{n}"),
                    "name": name, "arguments": args, "status": "completed" })
        };
        let output = json!([
            call(1, "get_weather", "{\"city\":\"Paris\"}"),
            call(2, "get_time", "{}")
        ]);
        let c = completion_from_response(&response("completed", output)).unwrap();
        let choice = &c["choices"][0];
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert!(choice["message"]["content"].is_null());
        assert_eq!(
            choice["message"]["tool_calls"],
            json!([
                { "id": "call_1", "type": "function", "function": { "name": "get_weather", "arguments": "{\"city\":\"Paris\"}" } },
                { "id": "call_2", "type": "function", "function": { "name": "get_time", "arguments": "{}" } },
            ])
        );
    }

    #[test]
    fn incomplete_max_output_tokens_is_length() {
        let mut r = response(
            "incomplete",
            json!([message_item(
                json!([{ "type": "output_text", "text": "Once" }])
            )]),
        );
        r["incomplete_details"] = json!({ "reason": "max_output_tokens" });
        let c = completion_from_response(&r).unwrap();
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        r["incomplete_details"] = json!({ "reason": "content_filter" });
        assert_eq!(
            completion_from_response(&r).unwrap()["choices"][0]["finish_reason"],
            "content_filter"
        );
    }

    #[test]
    fn usage_with_details() {
        let mut r = response("completed", json!([]));
        r["usage"] = json!({
            "input_tokens": 100, "input_tokens_details": { "cached_tokens": 40 },
            "output_tokens": 25, "output_tokens_details": { "reasoning_tokens": 10 }, "total_tokens": 125,
        });
        let c = completion_from_response(&r).unwrap();
        assert_eq!(
            c["usage"],
            json!({
                "prompt_tokens": 100, "completion_tokens": 25, "total_tokens": 125,
                "prompt_tokens_details": { "cached_tokens": 40 },
                "completion_tokens_details": { "reasoning_tokens": 10 },
            })
        );
        assert!(c["choices"][0]["message"]["content"].is_null());
        r["usage"] = json!({ "input_tokens": 3, "output_tokens": 4 });
        let plain = completion_from_response(&r).unwrap();
        assert_eq!(
            plain["usage"],
            json!({ "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7 })
        );
    }

    #[test]
    fn non_response_is_none() {
        assert!(completion_from_response(&json!({ "error": { "message": "nope" } })).is_none());
        assert!(completion_from_response(&json!({ "output": "text" })).is_none());
        assert!(completion_from_response(&json!([1, 2])).is_none());
    }

    #[test]
    fn errors_from_failed_response_and_error_event() {
        let mut failed = response("failed", json!([]));
        failed["error"] = json!({ "code": "server_error", "message": "The model crashed" });
        let expected = json!({ "error": { "message": "The model crashed", "type": "upstream_error", "code": "server_error" } });
        assert_eq!(error_from_response(&failed), expected);
        let event = json!({ "type": "response.failed", "sequence_number": 3, "response": failed });
        assert_eq!(error_from_response(&event), expected);
        let error = json!({ "type": "error", "code": "rate_limit_exceeded", "message": "Slow down", "param": null });
        assert_eq!(
            error_from_response(&error),
            json!({ "error": { "message": "Slow down", "type": "upstream_error", "code": "rate_limit_exceeded" } })
        );
    }

    fn event_sequence() -> Vec<Value> {
        let base = json!({ "id": "resp_xyz", "object": "response", "created_at": 1710000000, "model": "gpt-4.1",
                           "status": "in_progress", "output": [] });
        let text = json!({ "type": "output_text", "text": "It is sunny.", "annotations": [] });
        let call_item = json!({ "type": "function_call", "id": "fc_1", "call_id": "call_9",
                                "name": "get_weather", "arguments": "", "status": "in_progress" });
        let mut done_call = call_item.clone();
        done_call["arguments"] = json!("{\"city\":\"Oslo\"}");
        let mut completed = base.clone();
        completed["status"] = json!("completed");
        completed["output"] = json!([message_item(json!([text])), done_call]);
        completed["usage"] = json!({ "input_tokens": 12, "input_tokens_details": { "cached_tokens": 0 },
            "output_tokens": 9, "output_tokens_details": { "reasoning_tokens": 0 }, "total_tokens": 21 });
        let delta = |d: &str| json!({ "type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": d });
        let args = |d: &str| json!({ "type": "response.function_call_arguments.delta", "item_id": "fc_1", "output_index": 1, "delta": d });
        vec![
            json!({ "type": "response.created", "response": base }),
            json!({ "type": "response.in_progress", "response": base }),
            json!({ "type": "response.output_item.added", "output_index": 0, "item": message_item(json!([])) }),
            json!({ "type": "response.content_part.added", "item_id": "msg_1", "output_index": 0, "content_index": 0,
                    "part": { "type": "output_text", "text": "", "annotations": [] } }),
            delta("It is"),
            delta(" sunny"),
            delta("."),
            json!({ "type": "response.output_text.done", "item_id": "msg_1", "output_index": 0, "content_index": 0, "text": "It is sunny." }),
            json!({ "type": "response.output_item.done", "output_index": 0, "item": message_item(json!([text])) }),
            json!({ "type": "response.output_item.added", "output_index": 1, "item": call_item }),
            args("{\"city\":"),
            args("\"Oslo\"}"),
            json!({ "type": "response.function_call_arguments.done", "item_id": "fc_1", "output_index": 1, "arguments": "{\"city\":\"Oslo\"}" }),
            json!({ "type": "response.output_item.done", "output_index": 1, "item": done_call }),
            json!({ "type": "response.completed", "response": completed }),
        ]
    }

    fn translate(include_usage: bool, events: &[Value]) -> Vec<String> {
        let mut t = ChunkTranslator::new(include_usage);
        events.iter().flat_map(|e| frames(&t.push(e))).collect()
    }

    #[test]
    fn stream_translates_realistic_sequence() {
        let out = translate(true, &event_sequence());
        assert_eq!(out.last().unwrap(), "[DONE]");
        let chunks: Vec<Value> = out[..out.len() - 1]
            .iter()
            .map(|f| serde_json::from_str(f).unwrap())
            .collect();
        // role, 3 text deltas, tool call start, 2 argument deltas, finish, usage.
        assert_eq!(chunks.len(), 9);
        for c in &chunks {
            assert_eq!(c["id"], "chatcmpl-xyz");
            assert_eq!(c["object"], "chat.completion.chunk");
            assert_eq!(c["created"], 1710000000);
            assert_eq!(c["model"], "gpt-4.1");
        }
        for c in &chunks[..8] {
            assert!(c["usage"].is_null() && c.get("usage").is_some());
            assert_eq!(c["choices"][0]["index"], 0);
            assert!(c["choices"][0]["logprobs"].is_null());
        }
        assert_eq!(
            chunks[0]["choices"][0]["delta"],
            json!({ "role": "assistant", "content": "" })
        );
        let deltas: Vec<&Value> = chunks[..8]
            .iter()
            .map(|c| &c["choices"][0]["delta"])
            .collect();
        let text: String = deltas
            .iter()
            .filter_map(|d| d["content"].as_str())
            .collect();
        assert_eq!(text, "It is sunny.");
        assert_eq!(
            *deltas[4],
            json!({ "tool_calls": [{ "index": 0, "id": "call_9", "type": "function",
                                      "function": { "name": "get_weather", "arguments": "" } }] })
        );
        let args: String = deltas[5..7]
            .iter()
            .map(|d| {
                assert_eq!(d["tool_calls"][0]["index"], 0);
                d["tool_calls"][0]["function"]["arguments"]
                    .as_str()
                    .unwrap()
            })
            .collect();
        assert_eq!(args, "{\"city\":\"Oslo\"}");
        assert!(
            chunks[..7]
                .iter()
                .all(|c| c["choices"][0]["finish_reason"].is_null())
        );
        assert_eq!(chunks[7]["choices"][0]["finish_reason"], "tool_calls");
        assert_eq!(*deltas[7], json!({}));
        assert_eq!(chunks[8]["choices"], json!([]));
        assert_eq!(
            chunks[8]["usage"],
            json!({ "prompt_tokens": 12, "completion_tokens": 9, "total_tokens": 21,
                    "prompt_tokens_details": { "cached_tokens": 0 },
                    "completion_tokens_details": { "reasoning_tokens": 0 } })
        );
    }

    #[test]
    fn stream_without_usage_has_no_usage_keys() {
        let out = translate(false, &event_sequence());
        assert_eq!(out.len(), 9);
        assert_eq!(out.last().unwrap(), "[DONE]");
        for frame in &out[..8] {
            let c: Value = serde_json::from_str(frame).unwrap();
            assert!(c.get("usage").is_none());
            assert_eq!(c["choices"].as_array().unwrap().len(), 1);
        }
    }

    #[test]
    fn stream_failure_ends_with_one_error_event() {
        let mut events = event_sequence()[..6].to_vec();
        let mut failed = response("failed", json!([]));
        failed["error"] = json!({ "code": "server_error", "message": "boom" });
        events.push(json!({ "type": "response.failed", "response": failed }));
        events.push(
            json!({ "type": "response.output_text.delta", "output_index": 0, "delta": "late" }),
        );
        events.push(json!({ "type": "response.completed", "response": failed }));
        let out = translate(true, &events);
        assert_eq!(out.len(), 4); // role + two deltas + error
        let last: Value = serde_json::from_str(&out[3]).unwrap();
        assert_eq!(
            last,
            json!({ "error": { "message": "boom", "type": "upstream_error", "code": "server_error" } })
        );
        assert!(out.iter().all(|f| f != "[DONE]"));
    }

    #[test]
    fn arguments_sent_only_in_done_are_not_lost() {
        let item = json!({ "type": "function_call", "call_id": "c", "name": "f", "arguments": "" });
        let done = |a: &str| json!({ "type": "response.function_call_arguments.done", "output_index": 0, "arguments": a });
        let mut t = ChunkTranslator::new(false);
        t.push(&json!({ "type": "response.output_item.added", "output_index": 0, "item": item }));
        let out = frames(&t.push(&done("{\"a\":1}")));
        let chunk: Value = serde_json::from_str(&out[0]).unwrap();
        assert_eq!(
            chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"],
            "{\"a\":1}"
        );
        assert!(t.push(&done("{\"a\":1}")).is_empty());
    }

    #[test]
    fn conversation_becomes_input_items() {
        let messages = vec![
            json!({ "role": "system", "content": "Be brief." }),
            json!({ "role": "user", "content": "Hi" }),
            json!({ "role": "assistant", "content": "Hello!" }),
            json!({ "role": "user", "content": [
                { "type": "text", "text": "Weather here?" },
                { "type": "image_url", "image_url": { "url": "https://x.test/sky.png" } },
            ] }),
            json!({ "role": "assistant", "content": null, "tool_calls": [
                { "id": "call_1", "type": "function", "function": { "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}" } },
            ] }),
            json!({ "role": "tool", "tool_call_id": "call_1", "content": "sunny" }),
            json!({ "role": "assistant", "content": [{ "type": "text", "text": "It is sunny." }] }),
        ];
        assert_eq!(
            input_items(&messages),
            vec![
                json!({ "role": "system", "content": "Be brief." }),
                json!({ "role": "user", "content": "Hi" }),
                json!({ "role": "assistant", "content": "Hello!" }),
                json!({ "role": "user", "content": [
                    { "type": "input_text", "text": "Weather here?" },
                    { "type": "input_image", "image_url": "https://x.test/sky.png", "detail": "auto" },
                ] }),
                json!({ "type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}" }),
                json!({ "type": "function_call_output", "call_id": "call_1", "output": "sunny" }),
                json!({ "role": "assistant", "content": [{ "type": "output_text", "text": "It is sunny." }] }),
            ]
        );
        let with_text = [
            json!({ "role": "assistant", "content": "Checking.", "tool_calls": [
            { "id": "c2", "type": "function", "function": { "name": "f", "arguments": "{}" } },
        ] }),
        ];
        let items = input_items(&with_text);
        assert_eq!(items.len(), 2);
        assert_eq!(
            items[0],
            json!({ "role": "assistant", "content": "Checking." })
        );
        assert_eq!(items[1]["type"], "function_call");
    }
}
