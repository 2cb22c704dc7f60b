//! An Anthropic event stream read back as OpenAI's chat completion chunks,
//! as it arrives.
//!
//! `message_start` opens the stream (the role chunk); a text block's
//! `text_delta`s are content deltas; a `tool_use` block is a tool call
//! whose `input_json_delta` pieces are its arguments' pieces (the tool that
//! carries a `response_format`'s JSON is content instead); `message_delta`
//! is the finish chunk; `message_stop` ends the stream (after the usage
//! chunk when the request asked for one) with `[DONE]`. `ping` says
//! nothing, thinking blocks are left out, and an `error` event becomes an
//! OpenAI error event (no `[DONE]` follows it), so the stream is a failed
//! answer, as one from an OpenAI-compatible provider would be.

use std::collections::HashMap;

use serde_json::{Value, json};

use super::Reading;
use super::reply::{finish_reason, now_secs, usage};
use crate::sse::EventSplitter;

/// What a content block of the Anthropic stream is in OpenAI's.
enum Block {
    /// Text: content deltas.
    Text,
    /// A tool call at this index of `tool_calls`.
    Tool(u64),
    /// The JSON answer's tool: content deltas.
    Json,
    /// Left out (thinking, anything unknown).
    Skip,
}

/// The translation of one stream.
pub struct Translator {
    splitter: EventSplitter,
    reading: Reading,
    id: Value,
    model: Value,
    created: u64,
    /// Usage as `message_start` gave it; `message_delta` updates it.
    usage: Value,
    blocks: HashMap<u64, Block>,
    tools: u64,
    /// Past `message_stop` or an error: nothing more is said.
    ended: bool,
}

impl Translator {
    pub fn new(reading: Reading) -> Translator {
        Translator {
            splitter: EventSplitter::new(),
            reading,
            id: Value::Null,
            model: Value::Null,
            created: now_secs(),
            usage: json!({}),
            blocks: HashMap::new(),
            tools: 0,
            ended: false,
        }
    }

    /// The OpenAI events for the Anthropic bytes that arrived.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for data in self.splitter.push(bytes) {
            self.event(&data, &mut out);
        }
        out
    }

    /// The OpenAI events for a last event that lacked its blank line.
    pub fn finish(self) -> Vec<u8> {
        let mut me = self;
        let splitter = std::mem::replace(&mut me.splitter, EventSplitter::new());
        let mut out = Vec::new();
        if let Some(data) = splitter.finish() {
            me.event(&data, &mut out);
        }
        out
    }

    fn event(&mut self, data: &str, out: &mut Vec<u8>) {
        if self.ended || data.trim().is_empty() {
            return;
        }
        let Ok(event) = serde_json::from_str::<Value>(data) else {
            // Not JSON: passed on as it is, so the answer fails its check.
            push(out, data);
            return;
        };
        match event.get("type").and_then(Value::as_str) {
            Some("message_start") => {
                let m = event.get("message").unwrap_or(&Value::Null);
                self.id = m.get("id").cloned().unwrap_or(Value::Null);
                self.model = m.get("model").cloned().unwrap_or(Value::Null);
                if let Some(u) = m.get("usage") {
                    self.usage = u.clone();
                }
                self.chunk(out, json!({"role": "assistant", "content": ""}), None);
            }
            Some("content_block_start") => {
                let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
                let block = event.get("content_block").unwrap_or(&Value::Null);
                let kind = match block.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        let text = block.get("text").and_then(Value::as_str).unwrap_or("");
                        if !text.is_empty() {
                            self.chunk(out, json!({"content": text}), None);
                        }
                        Block::Text
                    }
                    Some("tool_use") => {
                        let name = block.get("name").and_then(Value::as_str).unwrap_or("");
                        if Some(name) == self.reading.json_tool.as_deref() {
                            Block::Json
                        } else {
                            let k = self.tools;
                            self.tools += 1;
                            let call = json!([{
                                "index": k,
                                "id": block.get("id").cloned().unwrap_or(Value::Null),
                                "type": "function",
                                "function": {"name": name, "arguments": ""}
                            }]);
                            self.chunk(out, json!({"tool_calls": call}), None);
                            Block::Tool(k)
                        }
                    }
                    _ => Block::Skip,
                };
                self.blocks.insert(index, kind);
            }
            Some("content_block_delta") => {
                let index = event.get("index").and_then(Value::as_u64).unwrap_or(0);
                let delta = event.get("delta").unwrap_or(&Value::Null);
                let text = delta
                    .get("text")
                    .or_else(|| delta.get("partial_json"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                match self.blocks.get(&index) {
                    Some(Block::Text | Block::Json) if !text.is_empty() => {
                        self.chunk(out, json!({"content": text}), None);
                    }
                    Some(Block::Tool(k)) if !text.is_empty() => {
                        let call = json!([{"index": k, "function": {"arguments": text}}]);
                        self.chunk(out, json!({"tool_calls": call}), None);
                    }
                    _ => {}
                }
            }
            Some("message_delta") => {
                if let (Some(total), Some(delta)) = (self.usage.as_object_mut(), event.get("usage"))
                    && let Some(d) = delta.as_object()
                {
                    for (k, v) in d {
                        if !v.is_null() {
                            total.insert(k.clone(), v.clone());
                        }
                    }
                }
                let stop = event.pointer("/delta/stop_reason").and_then(Value::as_str);
                let finish = finish_reason(stop, self.reading.json_tool.is_some());
                self.chunk(out, json!({}), Some(finish));
            }
            Some("message_stop") => {
                if self.reading.include_usage {
                    let mut c = self.base();
                    c["choices"] = json!([]);
                    c["usage"] = usage(&self.usage);
                    push(out, &c.to_string());
                }
                push(out, "[DONE]");
                self.ended = true;
            }
            Some("error") => {
                let e = event.get("error").unwrap_or(&Value::Null);
                let kind = e.get("type").and_then(Value::as_str).unwrap_or("api_error");
                let message = e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("the provider reported an error");
                let body = crate::answer::error_body(message, kind, kind, None);
                push(out, &body.to_string());
                self.ended = true;
            }
            // `ping`, and whatever a later API version adds.
            _ => {}
        }
    }

    /// A chunk's common fields.
    fn base(&self) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [],
        });
        if self.reading.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn chunk(&self, out: &mut Vec<u8>, delta: Value, finish: Option<&str>) {
        let mut c = self.base();
        c["choices"] =
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]);
        push(out, &c.to_string());
    }
}

fn push(out: &mut Vec<u8>, data: &str) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data.as_bytes());
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(kind: &str, data: Value) -> String {
        format!("event: {kind}\ndata: {data}\n\n")
    }

    /// A tool-using stream as Anthropic sends it.
    fn anthropic_stream() -> String {
        [
            event("message_start", json!({"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant", "model": "claude-x", "content": [], "stop_reason": null, "usage": {"input_tokens": 12, "output_tokens": 1, "cache_read_input_tokens": 2}}})),
            event("ping", json!({"type": "ping"})),
            event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
            event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me "}})),
            event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "check."}})),
            event("content_block_stop", json!({"type": "content_block_stop", "index": 0})),
            event("content_block_start", json!({"type": "content_block_start", "index": 1, "content_block": {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {}}})),
            event("content_block_delta", json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"q\": "}})),
            event("content_block_delta", json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "\"cat\"}"}})),
            event("content_block_stop", json!({"type": "content_block_stop", "index": 1})),
            event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null}, "usage": {"output_tokens": 9}})),
            event("message_stop", json!({"type": "message_stop"})),
        ]
        .concat()
    }

    fn translate_in_pieces(stream: &str, reading: Reading, piece: usize) -> String {
        let mut t = Translator::new(reading);
        let mut out = Vec::new();
        for chunk in stream.as_bytes().chunks(piece) {
            out.extend(t.feed(chunk));
        }
        out.extend(t.finish());
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_tool_stream_assembles_into_the_same_completion_in_any_pieces() {
        let reading = Reading {
            stream: true,
            include_usage: true,
            ..Reading::default()
        };
        let whole = translate_in_pieces(&anthropic_stream(), reading.clone(), 1 << 20);
        for piece in [1, 7, 64] {
            assert_eq!(
                translate_in_pieces(&anthropic_stream(), reading.clone(), piece),
                whole
            );
        }
        assert!(whole.ends_with("data: [DONE]\n\n"), "{whole}");
        let c = crate::sse::assemble(whole.as_bytes()).unwrap();
        let choice = &c["choices"][0];
        assert_eq!(choice["message"]["content"], "Let me check.");
        assert_eq!(choice["message"]["tool_calls"][0]["id"], "toolu_1");
        assert_eq!(
            choice["message"]["tool_calls"][0]["function"]["arguments"],
            "{\"q\": \"cat\"}"
        );
        assert_eq!(choice["finish_reason"], "tool_calls");
        assert_eq!(c["usage"]["prompt_tokens"], 14);
        assert_eq!(c["usage"]["completion_tokens"], 9);
        assert_eq!(c["model"], "claude-x");
        // The arguments came in two pieces.
        assert_eq!(whole.matches("\"arguments\":\"").count(), 3, "{whole}");
        // Without include_usage: no usage chunk.
        let plain = translate_in_pieces(
            &anthropic_stream(),
            Reading {
                include_usage: false,
                ..reading
            },
            13,
        );
        assert!(!crate::sse::has_usage_chunk(plain.as_bytes()));
    }

    #[test]
    fn an_error_event_is_an_openai_error_event_and_ends_the_stream() {
        let stream = [
            event("message_start", json!({"type": "message_start", "message": {"id": "m", "model": "c", "usage": {}}})),
            event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
            event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "par"}})),
            event("error", json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})),
        ]
        .concat();
        let out = translate_in_pieces(&stream, Reading::default(), 5);
        assert!(!out.contains("[DONE]"), "{out}");
        match crate::sse::assemble(out.as_bytes()) {
            Err(crate::sse::SseError::Upstream(e)) => assert_eq!(e["message"], "Overloaded"),
            other => panic!("{other:?}"),
        }
        // A stream cut before message_stop is no whole answer either.
        let cut = &anthropic_stream()[..anthropic_stream().find("event: message_delta").unwrap()];
        let out = translate_in_pieces(cut, Reading::default(), 9);
        assert!(crate::sse::assemble(out.as_bytes()).is_err());
    }

    #[test]
    fn the_json_tools_input_streams_as_content() {
        let stream = [
            event("message_start", json!({"type": "message_start", "message": {"id": "m", "model": "c", "usage": {}}})),
            event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "t", "name": "reply", "input": {}}})),
            event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{\"answer\":"}})),
            event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "\"yes\"}"}})),
            event("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": {"output_tokens": 3}})),
            event("message_stop", json!({"type": "message_stop"})),
        ]
        .concat();
        let reading = Reading {
            stream: true,
            include_usage: false,
            json_tool: Some("reply".into()),
        };
        let out = translate_in_pieces(&stream, reading, 11);
        let c = crate::sse::assemble(out.as_bytes()).unwrap();
        assert_eq!(
            c["choices"][0]["message"]["content"],
            "{\"answer\":\"yes\"}"
        );
        assert_eq!(c["choices"][0]["finish_reason"], "stop");
        assert!(c["choices"][0]["message"].get("tool_calls").is_none());
    }
}
