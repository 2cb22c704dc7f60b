//! OpenAI's Responses API answers as idem keeps them: a `response` object,
//! or the typed event stream it came as (`response.created` ...
//! `response.completed`).
//!
//! A streamed answer succeeds only with `response.completed`, whose
//! `response` is the whole answer (so the plain form of a stream is that
//! object); `response.failed`, `response.incomplete` and `error` events
//! are failures. A plain answer is rendered as the event stream a live
//! call would have sent, item by item (messages, reasoning with its
//! summary, function and custom tool calls, web searches, item types that
//! come after these), each event numbered as the API numbers them.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{Unfit, event_type, frame, stream_events};
use crate::prices::Tokens;
use crate::sse::{PIECE_BYTES, pieces};

/// A whole response's token counts (`None`: no usage).
pub fn tokens(response: &Value) -> Option<Tokens> {
    let usage = response.get("usage")?;
    let n = |p: &str| usage.pointer(p).and_then(Value::as_u64);
    Some(Tokens {
        input: n("/input_tokens")?,
        cached_input: n("/input_tokens_details/cached_tokens").unwrap_or(0),
        output: n("/output_tokens").unwrap_or(0),
    })
}

/// A plain answer's verdict: a `response` object that completed.
pub fn check_plain(body: &[u8]) -> Result<Value, Unfit> {
    if body.is_empty() {
        return Err(Unfit::Empty);
    }
    let v: Value = serde_json::from_slice(body).map_err(Unfit::NotJson)?;
    check_response(&v)?;
    Ok(v)
}

fn check_response(v: &Value) -> Result<(), Unfit> {
    let obj = v.as_object().ok_or(Unfit::NotA("a response object"))?;
    if obj.get("error").is_some_and(|e| !e.is_null()) {
        return Err(Unfit::ErrorObject);
    }
    if obj.get("object").and_then(Value::as_str) != Some("response")
        || !obj.get("output").is_some_and(Value::is_array)
    {
        return Err(Unfit::NotA("a response object"));
    }
    match obj.get("status").and_then(Value::as_str) {
        Some("completed") => Ok(()),
        other => {
            let reason = obj
                .get("incomplete_details")
                .and_then(|d| d.get("reason"))
                .and_then(Value::as_str);
            Err(Unfit::Status(match (other, reason) {
                (Some(s), Some(r)) => format!("{s} ({r})"),
                (Some(s), None) => s.to_string(),
                (None, _) => "without a status".to_string(),
            }))
        }
    }
}

/// A whole stream's answer: the `response` of its `response.completed`.
pub fn assemble(sse: &[u8]) -> Result<Value, Unfit> {
    for event in stream_events(sse)? {
        match event_type(&event) {
            "response.completed" => {
                let response = event.get("response").cloned().unwrap_or(Value::Null);
                check_response(&response)?;
                return Ok(response);
            }
            "response.failed" | "response.incomplete" => {
                let response = event.get("response").cloned().unwrap_or(Value::Null);
                return match response.get("error").filter(|e| !e.is_null()) {
                    Some(error) => Err(Unfit::Failed(error.clone())),
                    None => Err(check_response(&response)
                        .err()
                        .unwrap_or(Unfit::Status("failed".into()))),
                };
            }
            "error" => return Err(Unfit::Failed(Value::Object(event))),
            _ => {}
        }
    }
    Err(Unfit::Unfinished("response.completed"))
}

/// The events a live call would have sent for `response`: what a streaming
/// client gets of an answer that was not streamed. [`assemble`] gives the
/// response back.
pub fn synthesize(response: &Value) -> Bytes {
    let mut s = Stream {
        out: Vec::with_capacity(2048),
        seq: 0,
    };
    let mut started = response.as_object().cloned().unwrap_or_default();
    let items = match started.insert("output".into(), json!([])) {
        Some(Value::Array(items)) => items,
        _ => Vec::new(),
    };
    started.insert("status".into(), json!("in_progress"));
    for key in ["usage", "incomplete_details"] {
        if started.contains_key(key) {
            started.insert(key.into(), Value::Null);
        }
    }
    let started = Value::Object(started);
    s.emit("response.created", json!({"response": started}));
    s.emit("response.in_progress", json!({"response": started}));
    for (index, item) in items.iter().enumerate() {
        s.item(index, item);
    }
    let end = match response.get("status").and_then(Value::as_str) {
        Some("incomplete") => "response.incomplete",
        Some("failed") => "response.failed",
        _ => "response.completed",
    };
    s.emit(end, json!({"response": response}));
    Bytes::from(s.out)
}

struct Stream {
    out: Vec<u8>,
    seq: u64,
}

impl Stream {
    fn emit(&mut self, kind: &str, body: Value) {
        let mut data = Map::new();
        data.insert("type".into(), json!(kind));
        if let Value::Object(fields) = body {
            data.extend(fields);
        }
        data.insert("sequence_number".into(), json!(self.seq));
        self.seq += 1;
        frame(&mut self.out, kind, &Value::Object(data));
    }

    /// One output item's events, from `added` to `done`.
    fn item(&mut self, index: usize, item: &Value) {
        let Some(obj) = item.as_object() else {
            return;
        };
        let id = obj.get("id").cloned().unwrap_or(Value::Null);
        let kind = obj.get("type").and_then(Value::as_str).unwrap_or("");
        let mut added = obj.clone();
        if added.contains_key("status") {
            added.insert("status".into(), json!("in_progress"));
        }
        let str_of = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        match kind {
            "message" => {
                added.insert("content".into(), json!([]));
            }
            "reasoning" => {
                added.insert("summary".into(), json!([]));
            }
            "function_call" => {
                added.insert("arguments".into(), json!(""));
            }
            "custom_tool_call" => {
                added.insert("input".into(), json!(""));
            }
            _ => {}
        }
        let at = |extra: Value| {
            let mut m = json!({"item_id": id, "output_index": index});
            if let (Value::Object(m), Value::Object(extra)) = (&mut m, extra) {
                m.extend(extra);
            }
            m
        };
        self.emit(
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        );
        match kind {
            "message" => {
                let parts = obj.get("content").and_then(Value::as_array);
                for (p, part) in parts.into_iter().flatten().enumerate() {
                    self.part(part, p, &at);
                }
            }
            "reasoning" => {
                let parts = obj.get("summary").and_then(Value::as_array);
                for (p, part) in parts.into_iter().flatten().enumerate() {
                    let text = part.get("text").and_then(Value::as_str).unwrap_or("");
                    let empty = json!({"type": "summary_text", "text": ""});
                    self.emit(
                        "response.reasoning_summary_part.added",
                        at(json!({"summary_index": p, "part": empty})),
                    );
                    for piece in pieces(text, PIECE_BYTES) {
                        self.emit(
                            "response.reasoning_summary_text.delta",
                            at(json!({"summary_index": p, "delta": piece})),
                        );
                    }
                    self.emit(
                        "response.reasoning_summary_text.done",
                        at(json!({"summary_index": p, "text": text})),
                    );
                    self.emit(
                        "response.reasoning_summary_part.done",
                        at(json!({"summary_index": p, "part": part})),
                    );
                }
            }
            "function_call" => {
                let args = str_of("arguments");
                for piece in pieces(&args, PIECE_BYTES) {
                    self.emit(
                        "response.function_call_arguments.delta",
                        at(json!({"delta": piece})),
                    );
                }
                self.emit(
                    "response.function_call_arguments.done",
                    at(json!({"arguments": args})),
                );
            }
            "custom_tool_call" => {
                let input = str_of("input");
                for piece in pieces(&input, PIECE_BYTES) {
                    self.emit(
                        "response.custom_tool_call_input.delta",
                        at(json!({"delta": piece})),
                    );
                }
                self.emit(
                    "response.custom_tool_call_input.done",
                    at(json!({"input": input})),
                );
            }
            "web_search_call" => {
                for phase in ["in_progress", "searching", "completed"] {
                    self.emit(&format!("response.web_search_call.{phase}"), at(json!({})));
                }
            }
            _ => {}
        }
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
    }

    /// One content part of a message item.
    fn part(&mut self, part: &Value, p: usize, at: &dyn Fn(Value) -> Value) {
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        let (field, delta_event, done_event) = match kind {
            "output_text" => (
                "text",
                "response.output_text.delta",
                "response.output_text.done",
            ),
            "refusal" => ("refusal", "response.refusal.delta", "response.refusal.done"),
            _ => {
                self.emit(
                    "response.content_part.added",
                    at(json!({"content_index": p, "part": part})),
                );
                self.emit(
                    "response.content_part.done",
                    at(json!({"content_index": p, "part": part})),
                );
                return;
            }
        };
        let text = part.get(field).and_then(Value::as_str).unwrap_or("");
        let mut empty = part.as_object().cloned().unwrap_or_default();
        empty.insert(field.into(), json!(""));
        if empty.contains_key("annotations") {
            empty.insert("annotations".into(), json!([]));
        }
        self.emit(
            "response.content_part.added",
            at(json!({"content_index": p, "part": empty})),
        );
        for piece in pieces(text, PIECE_BYTES) {
            self.emit(delta_event, at(json!({"content_index": p, "delta": piece})));
        }
        let mut done = json!({"content_index": p});
        done[field] = json!(text);
        self.emit(done_event, at(done));
        self.emit(
            "response.content_part.done",
            at(json!({"content_index": p, "part": part})),
        );
    }
}

/// The answer's text (its messages' `output_text`), for contracts.
pub fn text(response: &Value) -> Option<String> {
    let mut out = String::new();
    let mut any = false;
    for item in response.get("output")?.as_array()? {
        if item.get("type").and_then(Value::as_str) != Some("message") {
            continue;
        }
        for part in item
            .get("content")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            if part.get("type").and_then(Value::as_str) == Some("output_text")
                && let Some(t) = part.get("text").and_then(Value::as_str)
            {
                out.push_str(t);
                any = true;
            }
        }
    }
    any.then_some(out)
}

/// The `error` event a stream ends with when it breaks off after `seq`
/// events.
pub fn error_event(code: &str, message: &str, seq: u64) -> Bytes {
    let mut out = Vec::new();
    frame(
        &mut out,
        "error",
        &json!({"type": "error", "code": code, "message": message, "param": null,
                "sequence_number": seq}),
    );
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response with every kind of item Codex sees today.
    fn rich() -> Value {
        json!({
            "id": "resp_1", "object": "response", "created_at": 1, "status": "completed",
            "model": "gpt-5", "error": null, "incomplete_details": null,
            "output": [
                {"type": "reasoning", "id": "rs_1", "summary": [
                    {"type": "summary_text", "text": "Thinking about it."}],
                 "encrypted_content": "gAAAA=="},
                {"type": "web_search_call", "id": "ws_1", "status": "completed",
                 "action": {"type": "search", "query": "idem"}},
                {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                 "content": [{"type": "output_text", "text": "x".repeat(600), "annotations": []}]},
                {"type": "custom_tool_call", "id": "ctc_1", "call_id": "call_1",
                 "name": "apply_patch", "input": "*** Begin Patch", "status": "completed"},
                {"type": "function_call", "id": "fc_1", "call_id": "call_2", "name": "shell",
                 "arguments": "{\"command\":[\"ls\"]}", "status": "completed"},
                {"type": "future_item", "id": "fi_1"}
            ],
            "usage": {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 4},
                      "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 9},
                      "total_tokens": 42}
        })
    }

    #[test]
    fn a_response_survives_its_stream_item_for_item() {
        let r = rich();
        let stream = synthesize(&r);
        let events = stream_events(&stream).unwrap();
        for (n, e) in events.iter().enumerate() {
            assert_eq!(e["sequence_number"], n, "{e:?}");
        }
        let kinds: Vec<&str> = events.iter().map(event_type).collect();
        for kind in [
            "response.created",
            "response.reasoning_summary_text.delta",
            "response.web_search_call.completed",
            "response.output_text.delta",
            "response.custom_tool_call_input.done",
            "response.function_call_arguments.delta",
        ] {
            assert!(kinds.contains(&kind), "no {kind}: {kinds:?}");
        }
        assert_eq!(kinds.last(), Some(&"response.completed"));
        assert_eq!(assemble(&stream).unwrap(), r);
        assert_eq!(
            tokens(&r),
            Some(Tokens {
                input: 12,
                cached_input: 4,
                output: 30
            })
        );
        assert_eq!(text(&r).unwrap().len(), 600);
    }

    #[test]
    fn only_a_completed_response_is_an_answer() {
        let stream = synthesize(&rich());
        let text = std::str::from_utf8(&stream).unwrap();
        let cut = text.split("event: response.completed").next().unwrap();
        assert!(matches!(
            assemble(cut.as_bytes()),
            Err(Unfit::Unfinished(_))
        ));
        let mut incomplete = rich();
        incomplete["status"] = json!("incomplete");
        incomplete["incomplete_details"] = json!({"reason": "max_output_tokens"});
        let s = synthesize(&incomplete);
        assert!(
            std::str::from_utf8(&s)
                .unwrap()
                .contains("event: response.incomplete")
        );
        match assemble(&s) {
            Err(Unfit::Status(s)) => assert_eq!(s, "incomplete (max_output_tokens)"),
            other => panic!("{other:?}"),
        }
        assert!(check_plain(incomplete.to_string().as_bytes()).is_err());
        let failed = format!(
            "{cut}event: error\ndata: {}\n\n",
            json!({"type": "error", "code": "server_error", "message": "boom"})
        );
        assert!(matches!(assemble(failed.as_bytes()), Err(Unfit::Failed(_))));
        assert!(check_plain(rich().to_string().as_bytes()).is_ok());
        assert!(matches!(
            check_plain(br#"{"error":{"message":"x"}}"#),
            Err(Unfit::ErrorObject)
        ));
    }
}
