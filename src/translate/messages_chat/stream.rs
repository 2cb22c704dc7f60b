//! A chat completion stream read back as Anthropic's event stream, chunk
//! by chunk as it arrives.

use bytes::Bytes;
use serde_json::{Value, json};

use super::reply::{Usage, content_text, fallback_tool_id, message_id, stop_reason};

/// Appends one SSE event (`event: <type>\ndata: <json>\n\n`).
fn emit(out: &mut String, event: Value) {
    let kind = event
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or_default();
    out.push_str("event: ");
    out.push_str(kind);
    out.push_str("\ndata: ");
    out.push_str(&event.to_string());
    out.push_str("\n\n");
}

/// `message_start` and the `ping` Anthropic sends right after it.
fn emit_start(out: &mut String, id: &str, model: Value, input_tokens: u64) {
    emit(
        out,
        json!({
            "type": "message_start",
            "message": {
                "id": id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {"input_tokens": input_tokens, "output_tokens": 0},
            },
        }),
    );
    emit(out, json!({"type": "ping"}));
}

fn emit_text_start(out: &mut String, index: usize) {
    emit(
        out,
        json!({
            "type": "content_block_start",
            "index": index,
            "content_block": {"type": "text", "text": ""},
        }),
    );
}

fn emit_tool_start(out: &mut String, index: usize, id: &str, name: &str) {
    emit(
        out,
        json!({
            "type": "content_block_start",
            "index": index,
            "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}},
        }),
    );
}

fn emit_text_delta(out: &mut String, index: usize, text: &str) {
    emit(
        out,
        json!({
            "type": "content_block_delta",
            "index": index,
            "delta": {"type": "text_delta", "text": text},
        }),
    );
}

fn emit_json_delta(out: &mut String, index: usize, partial: &str) {
    emit(
        out,
        json!({
            "type": "content_block_delta",
            "index": index,
            "delta": {"type": "input_json_delta", "partial_json": partial},
        }),
    );
}

fn emit_block_stop(out: &mut String, index: usize) {
    emit(out, json!({"type": "content_block_stop", "index": index}));
}

/// `message_delta` (stop reason and final usage, `input_tokens` included)
/// and `message_stop`.
fn emit_end(out: &mut String, stop_reason: &str, usage: Usage) {
    emit(
        out,
        json!({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": null},
            "usage": usage.to_json(),
        }),
    );
    emit(out, json!({"type": "message_stop"}));
}

/// Chat completion chunks in, Anthropic SSE events out, as they arrive.
///
/// Text opens a `text` block lazily; a tool call seen for the first time (by
/// its chat `index`) closes the open block and opens a `tool_use` block;
/// argument fragments become `input_json_delta`s on their call's block. A
/// fragment for a call whose block was already closed (servers that
/// interleave parallel calls) is still sent, with that block's index.
/// `refusal` deltas are streamed as text. Only choice 0 is rendered.
#[derive(Debug, Default)]
pub struct StreamTranslator {
    started: bool,
    finished: bool,
    message_id: String,
    /// The open content block: (block index, is it text?).
    open: Option<(usize, bool)>,
    next_index: usize,
    /// Chat tool call index -> Anthropic block index.
    tools: Vec<(u64, usize)>,
    finish_reason: Option<String>,
    usage: Usage,
}

impl StreamTranslator {
    pub fn new() -> Self {
        Self::default()
    }

    /// One parsed `chat.completion.chunk` (a usage-only chunk with
    /// `choices: []` included). Returns the SSE text of zero or more
    /// Anthropic events (`event: <type>\ndata: <json>\n\n` each). The first
    /// chunk's `id` and `model` start the message; its `input_tokens` is 0
    /// unless that chunk already carries usage (the real count arrives in
    /// `message_delta`). Chunks after [`finish`](Self::finish) are ignored.
    pub fn push(&mut self, chunk: &Value) -> Bytes {
        let mut out = String::new();
        if self.finished {
            return Bytes::new();
        }
        let usage = Usage::from_chat(chunk.get("usage"));
        if !self.started {
            self.start(&mut out, chunk, usage.map_or(0, |u| u.input));
        }
        if let Some(usage) = usage {
            self.usage = usage;
        }
        let choices = chunk.get("choices").and_then(Value::as_array);
        for choice in choices.into_iter().flatten() {
            if choice.get("index").and_then(Value::as_u64).unwrap_or(0) != 0 {
                continue;
            }
            if let Some(delta) = choice.get("delta") {
                for key in ["content", "refusal"] {
                    let text = content_text(delta.get(key));
                    if !text.is_empty() {
                        self.text(&mut out, &text);
                    }
                }
                let calls = delta.get("tool_calls").and_then(Value::as_array);
                for (pos, call) in calls.into_iter().flatten().enumerate() {
                    self.tool_fragment(&mut out, call, pos as u64);
                }
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(reason.to_owned());
            }
        }
        Bytes::from(out)
    }

    /// The chat stream ended (`data: [DONE]` seen, or the source ended): the
    /// closing events (`content_block_stop` for an open block,
    /// `message_delta` with stop_reason/stop_sequence and usage,
    /// `message_stop`). A stream that ended before any chunk still gets a
    /// whole (empty) message, so the client sees a well-formed stream.
    /// Idempotent: a second call returns empty.
    /// True once a chunk gave the choice its `finish_reason`.
    pub fn saw_finish(&self) -> bool {
        self.finish_reason.is_some()
    }

    pub fn finish(&mut self) -> Bytes {
        if self.finished {
            return Bytes::new();
        }
        let mut out = String::new();
        if !self.started {
            self.start(&mut out, &Value::Null, 0);
        }
        self.close_open(&mut out);
        emit_end(
            &mut out,
            stop_reason(self.finish_reason.as_deref()),
            self.usage,
        );
        self.finished = true;
        Bytes::from(out)
    }

    fn start(&mut self, out: &mut String, chunk: &Value, input_tokens: u64) {
        self.started = true;
        self.message_id = message_id(chunk.get("id").and_then(Value::as_str));
        let model = match chunk.get("model") {
            Some(m @ Value::String(_)) => m.clone(),
            _ => Value::from(""),
        };
        emit_start(out, &self.message_id, model, input_tokens);
    }

    fn close_open(&mut self, out: &mut String) {
        if let Some((index, _)) = self.open.take() {
            emit_block_stop(out, index);
        }
    }

    fn open_block(&mut self, out: &mut String) -> usize {
        self.close_open(out);
        let index = self.next_index;
        self.next_index += 1;
        index
    }

    fn text(&mut self, out: &mut String, text: &str) {
        let index = match self.open {
            Some((index, true)) => index,
            _ => {
                let index = self.open_block(out);
                emit_text_start(out, index);
                self.open = Some((index, true));
                index
            }
        };
        emit_text_delta(out, index, text);
    }

    fn tool_fragment(&mut self, out: &mut String, call: &Value, pos: u64) {
        let chat_index = call.get("index").and_then(Value::as_u64).unwrap_or(pos);
        let known = self
            .tools
            .iter()
            .find(|(i, _)| *i == chat_index)
            .map(|(_, b)| *b);
        let function = call.get("function");
        let block = match known {
            Some(block) => block,
            None => {
                let block = self.open_block(out);
                let id = match call.get("id").and_then(Value::as_str) {
                    Some(s) if !s.is_empty() => s.to_owned(),
                    _ => fallback_tool_id(&self.message_id, chat_index),
                };
                let name = function
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                emit_tool_start(out, block, &id, name);
                self.tools.push((chat_index, block));
                self.open = Some((block, false));
                block
            }
        };
        let arguments = function
            .and_then(|f| f.get("arguments"))
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !arguments.is_empty() {
            emit_json_delta(out, block, arguments);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::reply::message_from_completion;
    use super::*;
    use crate::sse::{PIECE_BYTES, pieces};

    /// Parses SSE text back into (event, data) pairs, checking the framing.
    fn events(sse: &[u8]) -> Vec<(String, Value)> {
        let text = std::str::from_utf8(sse).unwrap();
        assert!(
            text.is_empty() || text.ends_with("\n\n"),
            "framing: {text:?}"
        );
        text.split_terminator("\n\n")
            .map(|frame| {
                let (event, data) = frame.split_once('\n').unwrap();
                let event = event.strip_prefix("event: ").unwrap().to_owned();
                let data: Value =
                    serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                assert_eq!(data["type"], event.as_str());
                (event, data)
            })
            .collect()
    }

    fn chunk(delta: Value, finish: Value) -> Value {
        json!({
            "id": "chatcmpl-s1",
            "object": "chat.completion.chunk",
            "model": "gpt-x",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        })
    }

    #[test]
    fn live_stream_gives_anthropic_events() {
        let chunks = vec![
            chunk(json!({"role": "assistant", "content": ""}), Value::Null),
            chunk(json!({"content": "Hel"}), Value::Null),
            chunk(json!({"content": "lo"}), Value::Null),
            chunk(
                json!({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                    "function": {"name": "f", "arguments": ""}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"x\":"}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 1, "id": "call_b", "type": "function",
                    "function": {"name": "g", "arguments": "{\"y\""}}]}),
                Value::Null,
            ),
            chunk(
                json!({"tool_calls": [{"index": 1, "function": {"arguments": ":2}"}}]}),
                Value::Null,
            ),
            chunk(json!({}), json!("tool_calls")),
            json!({"id": "chatcmpl-s1", "object": "chat.completion.chunk", "model": "gpt-x",
                   "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 9,
                   "prompt_tokens_details": {"cached_tokens": 4}}}),
        ];
        let mut translator = StreamTranslator::new();
        let mut sse = Vec::new();
        for c in &chunks {
            sse.extend_from_slice(&translator.push(c));
        }
        sse.extend_from_slice(&translator.finish());
        assert!(translator.finish().is_empty());
        assert!(translator.push(&chunks[1]).is_empty());

        let expected = vec![
            json!({"type": "message_start", "message": {"id": "msg_s1", "type": "message",
                "role": "assistant", "model": "gpt-x", "content": [], "stop_reason": null,
                "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}}}),
            json!({"type": "ping"}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block":
                {"type": "tool_use", "id": "call_a", "name": "f", "input": {}}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "{\"x\":"}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "input_json_delta", "partial_json": "1}"}}),
            json!({"type": "content_block_stop", "index": 1}),
            json!({"type": "content_block_start", "index": 2, "content_block":
                {"type": "tool_use", "id": "call_b", "name": "g", "input": {}}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": "{\"y\""}}),
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": ":2}"}}),
            json!({"type": "content_block_stop", "index": 2}),
            json!({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                "usage": {"input_tokens": 16, "output_tokens": 9, "cache_read_input_tokens": 4}}),
            json!({"type": "message_stop"}),
        ];
        let got: Vec<Value> = events(&sse).into_iter().map(|(_, d)| d).collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn finish_without_chunks_or_finish_reason_is_well_formed() {
        let mut translator = StreamTranslator::default();
        let names: Vec<String> = events(&translator.finish())
            .into_iter()
            .map(|(e, _)| e)
            .collect();
        assert_eq!(
            names,
            ["message_start", "ping", "message_delta", "message_stop"]
        );

        let mut translator = StreamTranslator::new();
        translator.push(&chunk(json!({"content": "x"}), Value::Null));
        let closing = events(&translator.finish());
        assert_eq!(
            closing[0].1,
            json!({"type": "content_block_stop", "index": 0})
        );
        assert_eq!(closing[1].1["delta"]["stop_reason"], "end_turn");
    }

    /// The canonical chunking of a completion, as `stream_from_completion`
    /// documents it.
    fn chunks_of(completion: &Value) -> Vec<Value> {
        let id = completion["id"].clone();
        let model = completion["model"].clone();
        let make = |choices: Value| json!({"id": id, "object": "chat.completion.chunk", "model": model, "choices": choices});
        let delta = |d: Value| make(json!([{"index": 0, "delta": d, "finish_reason": null}]));
        let choice = &completion["choices"][0];
        let message = &choice["message"];
        let mut out = vec![delta(json!({"role": "assistant", "content": ""}))];
        let text = message["content"].as_str().unwrap_or_default();
        for piece in pieces(text, PIECE_BYTES) {
            out.push(delta(json!({"content": piece})));
        }
        let calls = message["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        for (i, call) in calls.iter().enumerate() {
            out.push(delta(
                json!({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                "function": {"name": call["function"]["name"], "arguments": ""}}]}),
            ));
            let arguments = call["function"]["arguments"].as_str().unwrap();
            for piece in pieces(arguments, PIECE_BYTES) {
                out.push(delta(
                    json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}),
                ));
            }
        }
        out.push(make(
            json!([{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]),
        ));
        let mut usage = make(json!([]));
        usage["usage"] = completion["usage"].clone();
        out.push(usage);
        out
    }

    fn completion(message: Value, finish: &str, usage: Value) -> Value {
        json!({
            "id": "chatcmpl-abc123",
            "object": "chat.completion",
            "model": "gpt-x",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage,
        })
    }

    fn long_completion() -> Value {
        // Multi-byte chars straddle the 256-byte cuts.
        let text: String = "héllo wörld ✓ 🦀 ".repeat(40);
        let big_args = json!({"text": "ü".repeat(300), "n": [1, 2, 3]}).to_string();
        completion(
            json!({"role": "assistant", "content": text, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "write", "arguments": big_args}},
                {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": ""}}
            ]}),
            "tool_calls",
            json!({"prompt_tokens": 300, "completion_tokens": 200,
                   "prompt_tokens_details": {"cached_tokens": 100}}),
        )
    }

    /// A live translation, assembled, is the message the plain
    /// translation makes of the same completion: a follower that wants the
    /// other form than the leader's gets the same answer.
    #[test]
    fn a_live_translation_assembles_into_the_plain_one() {
        let text_only = completion(
            json!({"role": "assistant", "content": "just text"}),
            "stop",
            json!({"prompt_tokens": 3, "completion_tokens": 1}),
        );
        let empty = completion(
            json!({"role": "assistant", "content": ""}),
            "length",
            json!({"prompt_tokens": 3, "completion_tokens": 0}),
        );
        for c in [long_completion(), text_only, empty] {
            let mut translator = StreamTranslator::new();
            let mut live = Vec::new();
            for ch in chunks_of(&c) {
                live.extend_from_slice(&translator.push(&ch));
            }
            live.extend_from_slice(&translator.finish());
            let assembled = crate::dialect::messages::assemble(&live).unwrap();
            let plain = message_from_completion(&c);
            for key in ["content", "stop_reason", "usage", "id"] {
                assert_eq!(assembled[key], plain[key], "{key} of {c}");
            }
        }
    }
}
