//! The mock's Anthropic face, the answer side: the reply to a (valid)
//! `POST /v1/messages`, its plain and streamed forms, the error body and
//! the garbage, in Anthropic's shapes. Pure functions of the request and
//! the call number, like `answer`; what is accepted and how a request is
//! read is in `anthropic_request`.
//!
//! The reply to call number `seq`, deterministic, its content blocks in
//! this order:
//! - `thinking`, when the request turns thinking on (`enabled` or
//!   `adaptive`): `mock thinking #<seq> about: <last user text>` (shown
//!   empty with `display: "omitted"`), with a `signature` the mock checks
//!   when the block is sent back (see [`super::seal`]);
//! - `redacted_thinking` (its `data` sealed), when thinking is on and the
//!   last user text contains `redact` (any case);
//! - `server_tool_use` (`srvtoolu_mock_<seq>`, `web_search`, `{"query":
//!   <last user text>}`) then `web_search_tool_result` (one result, its
//!   `encrypted_content` sealed), when a `web_search_*` server tool is
//!   offered and the last user text contains `search` (any case); the
//!   text block then carries a `web_search_result_location` citation of
//!   that result and the usage `server_tool_use.web_search_requests: 1`;
//! - the text: `content` when set, else `mock answer #<seq> to: <last user
//!   text>` (the last `user` message's string content, or its `text`
//!   blocks and the text of its `tool_result` blocks joined by spaces; its
//!   first 200 characters). A stop sequence of the request found in the
//!   text cuts the text before the earliest one: `stop_reason:
//!   "stop_sequence"`, `stop_sequence` set. A text of more tokens than
//!   `max_tokens` (a token is four characters, as everywhere in the mock)
//!   is cut to `4 × max_tokens` characters: `stop_reason: "max_tokens"`;
//! - a tool call: when the request has tools and `tool_choice` is
//!   `{"type": "tool", "name": X}` (tool X) or `{"type": "any"}` (the first
//!   tool), the content is one `tool_use` block; when `tool_choice` is
//!   `auto` or absent and the last user text contains `call tool` (any
//!   case), the text block (cut by nothing) is followed by a `tool_use`
//!   block for the tool named by the word after the marker, or the first
//!   tool. Either way `stop_reason: "tool_use"`. The input is the JSON
//!   object written after the tool's name, if one is (`call tool Read
//!   {"file_path": "/tmp/x"}`), else it holds each `required` property of
//!   the tool's `input_schema` (see [`super::answer::tool_input`]);
//! - otherwise `stop_reason: "end_turn"`.
//!
//! `input_tokens` (of the reply and of `count_tokens`) is as
//! [`input_tokens`] counts; `output_tokens` the sum over the blocks of
//! their text's (or input's JSON) characters divided by four (each at
//! least 1).

use bytes::Bytes;
use serde_json::{Value, json};

use super::Garbage;
use super::answer::{
    ECHO_CHARS, Garbled, HTML, cut_in_half, estimate_tokens, garbled_json, grown, html_page,
    marked_tool,
};
use super::anthropic_request::{Asks, THINKING_SEAL, last_user_text};
pub(crate) use super::anthropic_request::{Kind, echoed, input_tokens, validate};
use super::seal;

/// The longest piece of a tool input's JSON in one `input_json_delta`.
const JSON_PIECE_BYTES: usize = 12;

/// What a redacted thinking block's `data` is sealed for.
const REDACTED_SEAL: &str = "anthropic redacted thinking";

/// What a search result's `encrypted_content` is sealed for.
const SEARCH_SEAL: &str = "anthropic web search result";

/// One content block of a reply.
#[derive(Debug, Clone, PartialEq)]
enum Block {
    Thinking {
        /// The thinking shown (empty when omitted).
        shown: String,
        signature: String,
    },
    RedactedThinking(String),
    ServerToolUse {
        id: String,
        query: String,
    },
    SearchResult {
        tool_use_id: String,
        result: Value,
    },
    Text {
        text: String,
        citations: Vec<Value>,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

impl Block {
    fn json(&self) -> Value {
        match self {
            Block::Thinking { shown, signature } => {
                json!({"type": "thinking", "thinking": shown, "signature": signature})
            }
            Block::RedactedThinking(data) => json!({"type": "redacted_thinking", "data": data}),
            Block::ServerToolUse { id, query } => json!({"type": "server_tool_use", "id": id,
                "name": "web_search", "input": {"query": query}}),
            Block::SearchResult {
                tool_use_id,
                result,
            } => json!({"type": "web_search_tool_result", "tool_use_id": tool_use_id,
                "content": [result]}),
            Block::Text { text, citations } if citations.is_empty() => {
                json!({"type": "text", "text": text})
            }
            Block::Text { text, citations } => {
                json!({"type": "text", "text": text, "citations": citations})
            }
            Block::ToolUse { id, name, input } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        }
    }

    /// The block as `content_block_start` announces it, and its deltas.
    fn streamed(&self) -> (Value, Vec<Value>) {
        match self {
            Block::Thinking { shown, signature } => {
                let mut deltas: Vec<Value> = shown
                    .split_inclusive(' ')
                    .map(|piece| json!({"type": "thinking_delta", "thinking": piece}))
                    .collect();
                deltas.push(json!({"type": "signature_delta", "signature": signature}));
                (
                    json!({"type": "thinking", "thinking": "", "signature": ""}),
                    deltas,
                )
            }
            Block::RedactedThinking(_) | Block::SearchResult { .. } => (self.json(), Vec::new()),
            Block::ServerToolUse { id, query } => (
                json!({"type": "server_tool_use", "id": id, "name": "web_search", "input": {}}),
                input_deltas(&json!({"query": query})),
            ),
            Block::Text { text, citations } => {
                let mut deltas: Vec<Value> = citations
                    .iter()
                    .map(|citation| json!({"type": "citations_delta", "citation": citation}))
                    .collect();
                deltas.extend(
                    text.split_inclusive(' ')
                        .map(|piece| json!({"type": "text_delta", "text": piece})),
                );
                if text.is_empty() {
                    deltas.push(json!({"type": "text_delta", "text": ""}));
                }
                let start = if citations.is_empty() {
                    json!({"type": "text", "text": ""})
                } else {
                    json!({"type": "text", "text": "", "citations": []})
                };
                (start, deltas)
            }
            Block::ToolUse { id, name, input } => (
                json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                input_deltas(input),
            ),
        }
    }

    fn tokens(&self, thinking: &str) -> u64 {
        let chars = match self {
            Block::Thinking { .. } => thinking.chars().count(),
            Block::RedactedThinking(data) => data.chars().count(),
            Block::ServerToolUse { query, .. } => query.chars().count(),
            Block::SearchResult { .. } => return 0,
            Block::Text { text, .. } => text.chars().count(),
            Block::ToolUse { input, .. } => input.to_string().chars().count(),
        };
        estimate_tokens(chars)
    }
}

/// A tool input's JSON as `input_json_delta`s.
fn input_deltas(input: &Value) -> Vec<Value> {
    json_pieces(&input.to_string())
        .into_iter()
        .map(|piece| json!({"type": "input_json_delta", "partial_json": piece}))
        .collect()
}

/// The mock's answer to a (valid) messages request, in every form.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    seq: u64,
    model: Value,
    blocks: Vec<Block>,
    /// The whole thinking text (what the signature seals).
    thinking: String,
    searched: bool,
    stop_reason: &'static str,
    stop_sequence: Option<String>,
    input_tokens: u64,
}

impl Reply {
    /// The reply to `request` as call number `seq`; `content` fixes the
    /// text (see the module's documentation).
    pub(crate) fn new(request: &Value, seq: u64, content: Option<&str>) -> Reply {
        let asks = Asks::of(request);
        let last = last_user_text(request);
        let lower = last.to_lowercase();
        let echo: String = last.chars().take(ECHO_CHARS).collect();
        let text = match content {
            Some(content) => content.to_owned(),
            None => format!("mock answer #{seq} to: {echo}"),
        };
        let thinking = format!("mock thinking #{seq} about: {echo}");
        let mut blocks = Vec::new();
        if asks.thinking {
            blocks.push(Block::Thinking {
                shown: if asks.thinking_omitted {
                    String::new()
                } else {
                    thinking.clone()
                },
                signature: seal::seal(THINKING_SEAL, &thinking),
            });
            if lower.contains("redact") {
                let data = seal::seal(REDACTED_SEAL, &format!("mock redacted thinking #{seq}"));
                blocks.push(Block::RedactedThinking(data));
            }
        }
        let tool = tool_call(request, &last, &echo, seq);
        let searched = asks.web_search && lower.contains("search") && tool.is_none();
        let mut citations = Vec::new();
        if searched {
            let id = format!("srvtoolu_mock_{seq}");
            let (result, citation) = search_result(seq, &echo);
            blocks.push(Block::ServerToolUse {
                id: id.clone(),
                query: echo.clone(),
            });
            blocks.push(Block::SearchResult {
                tool_use_id: id,
                result,
            });
            citations.push(citation);
        }
        let (stop_reason, stop_sequence) = match tool {
            Some((block, true)) => {
                blocks.push(block);
                ("tool_use", None)
            }
            tool => {
                let (text, stop_reason, stop_sequence) = ended(text, request);
                blocks.push(Block::Text { text, citations });
                match tool {
                    Some((block, _)) if stop_reason == "end_turn" => {
                        blocks.push(block);
                        ("tool_use", None)
                    }
                    _ => (stop_reason, stop_sequence),
                }
            }
        };
        Reply {
            seq,
            model: request.get("model").cloned().unwrap_or(json!("mock")),
            blocks,
            thinking,
            searched,
            stop_reason,
            stop_sequence,
            input_tokens: input_tokens(request),
        }
    }

    fn id(&self) -> String {
        format!("msg_mock_{}", self.seq)
    }

    fn output_tokens(&self) -> u64 {
        self.blocks.iter().map(|b| b.tokens(&self.thinking)).sum()
    }

    fn usage(&self, output_tokens: u64) -> Value {
        let mut usage = json!({
            "input_tokens": self.input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        });
        if self.searched {
            usage["server_tool_use"] = json!({"web_search_requests": 1});
        }
        usage
    }

    /// The plain answer: Anthropic's `message` object.
    pub(crate) fn message(&self) -> Value {
        json!({
            "id": self.id(),
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks.iter().map(Block::json).collect::<Vec<_>>(),
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage(self.output_tokens()),
        })
    }

    /// The streamed answer, as (event type, data) pairs: `message_start`
    /// (no content, `output_tokens: 1`), per block `content_block_start`,
    /// its deltas and `content_block_stop`, with a `ping` after the first
    /// `content_block_start`; then `message_delta` (the stop reason and the
    /// usage) and `message_stop`. The deltas, by block: `thinking` starts
    /// empty, then `thinking_delta`s (its text split after each space) and
    /// one `signature_delta`; `redacted_thinking` and
    /// `web_search_tool_result` start whole, without deltas;
    /// `server_tool_use` and `tool_use` start with `input: {}`, then their
    /// input's JSON in `input_json_delta`s of up to 12 bytes (at least two
    /// for two bytes or more); text starts empty, then a `citations_delta`
    /// per citation and `text_delta`s (split after each space).
    pub(crate) fn events(&self) -> Vec<(&'static str, Value)> {
        let mut start = self.message();
        start["content"] = json!([]);
        start["stop_reason"] = Value::Null;
        start["stop_sequence"] = Value::Null;
        start["usage"] = self.usage(1);
        let mut events = vec![(
            "message_start",
            json!({"type": "message_start", "message": start}),
        )];
        let ping = ("ping", json!({"type": "ping"}));
        for (index, block) in self.blocks.iter().enumerate() {
            let (empty, deltas) = block.streamed();
            events.push((
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": empty}),
            ));
            if index == 0 {
                events.push(ping.clone());
            }
            for delta in deltas {
                events.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": delta}),
                ));
            }
            events.push((
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ));
        }
        if self.blocks.is_empty() {
            events.push(ping);
        }
        let mut usage = json!({"output_tokens": self.output_tokens()});
        if self.searched {
            usage["server_tool_use"] = json!({"web_search_requests": 1});
        }
        events.push((
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": usage,
            }),
        ));
        events.push(("message_stop", json!({"type": "message_stop"})));
        events
    }

    /// True when `pad_bytes` applies: the reply has a text block that no
    /// stop sequence or `max_tokens` cut.
    pub(crate) fn paddable(&self) -> bool {
        matches!(self.stop_reason, "end_turn" | "tool_use")
            && self.blocks.iter().any(|b| matches!(b, Block::Text { .. }))
    }

    /// The same reply with `text` as its text block's.
    fn with_text(&self, text: &str) -> Reply {
        let mut reply = self.clone();
        if let Some(Block::Text { text: old, .. }) = reply
            .blocks
            .iter_mut()
            .find(|b| matches!(b, Block::Text { .. }))
        {
            text.clone_into(old);
        }
        reply
    }

    /// This reply, its text padded until `size_of` it is at least `pad`
    /// bytes (unchanged when not [`Reply::paddable`]).
    fn padded(&self, pad: Option<u64>, size_of: impl Fn(&Reply) -> usize) -> Reply {
        let text = self.blocks.iter().find_map(|b| match b {
            Block::Text { text, .. } => Some(text.clone()),
            _ => None,
        });
        match (pad, text) {
            (Some(pad), Some(text)) if self.paddable() => {
                let text = grown(text, 1, pad, |t| size_of(&self.with_text(t)));
                self.with_text(&text)
            }
            _ => self.clone(),
        }
    }
}

/// The one result of the mock's web search `seq` for `query`, and the
/// text's citation of it.
fn search_result(seq: u64, query: &str) -> (Value, Value) {
    let url = format!("https://search.mock.invalid/result/{seq}");
    let title = format!("Mock result #{seq}");
    let result = json!({
        "type": "web_search_result",
        "url": url,
        "title": title,
        "encrypted_content": seal::seal(SEARCH_SEAL, &format!("{url} {query}")),
        "page_age": "January 1, 2026",
    });
    let citation = json!({
        "type": "web_search_result_location",
        "url": url,
        "title": title,
        "encrypted_index": seal::seal(SEARCH_SEAL, &format!("{url} #0")),
        "cited_text": format!("mock search result for: {query}"),
    });
    (result, citation)
}

/// `text` ended as the request's `stop_sequences` and `max_tokens` end it:
/// the text kept, the stop reason and the stop sequence met.
fn ended(text: String, request: &Value) -> (String, &'static str, Option<String>) {
    let limit = request.get("max_tokens").and_then(Value::as_u64);
    let fits =
        |text: &str| limit.is_none_or(|limit| estimate_tokens(text.chars().count()) <= limit);
    let stop = request
        .get("stop_sequences")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .filter(|stop| !stop.is_empty())
        .filter_map(|stop| text.find(stop).map(|at| (at, stop)))
        .min_by_key(|(at, _)| *at);
    if let Some((at, stop)) = stop
        && fits(&text[..at])
    {
        return (
            text[..at].to_owned(),
            "stop_sequence",
            Some(stop.to_owned()),
        );
    }
    match limit {
        Some(limit) if !fits(&text) => {
            let chars = usize::try_from(limit.saturating_mul(4)).unwrap_or(usize::MAX);
            (text.chars().take(chars).collect(), "max_tokens", None)
        }
        _ => (text, "end_turn", None),
    }
}

/// The tool call the request asks for, if any: its `tool_use` block, and
/// whether it was forced (the only block) rather than chosen by the marker.
fn tool_call(request: &Value, last: &str, echo: &str, seq: u64) -> Option<(Block, bool)> {
    let tools: Vec<&Value> = request
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter(|tool| tool.get("name").is_some_and(Value::is_string))
        .filter(|tool| tool.get("input_schema").is_some())
        .collect();
    let named = |name: &str| {
        tools
            .iter()
            .copied()
            .find(|tool| tool.get("name").and_then(Value::as_str) == Some(name))
    };
    let choice = request.get("tool_choice");
    let (tool, forced, given) = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        Some("none") => return None,
        Some("tool") => (named(choice?.get("name")?.as_str()?)?, true, None),
        Some("any") => (*tools.first()?, true, None),
        _ => {
            let marked = marked_tool(last)?;
            let tool = named(&marked.name).or_else(|| tools.first().copied())?;
            (tool, false, marked.input.filter(Value::is_object))
        }
    };
    let name = tool.get("name")?.as_str()?.to_owned();
    let input = given.unwrap_or_else(|| super::answer::tool_input(tool.get("input_schema"), echo));
    let block = Block::ToolUse {
        id: format!("toolu_mock_{seq}"),
        name,
        input,
    };
    Some((block, forced))
}

/// `json` in pieces of at most [`JSON_PIECE_BYTES`], cut on character
/// boundaries, at least two when it has two characters or more.
pub(crate) fn json_pieces(json: &str) -> Vec<String> {
    let chars: Vec<char> = json.chars().collect();
    let size = chars.len().div_ceil(2).clamp(1, JSON_PIECE_BYTES);
    let mut pieces = Vec::new();
    let mut piece = String::new();
    for c in chars {
        if !piece.is_empty() && piece.len() + c.len_utf8() > size {
            pieces.push(std::mem::take(&mut piece));
        }
        piece.push(c);
    }
    if !piece.is_empty() {
        pieces.push(piece);
    }
    pieces
}

pub(crate) fn plain_body(reply: &Reply, pad: Option<u64>) -> String {
    let size = |reply: &Reply| reply.message().to_string().len();
    reply.padded(pad, size).message().to_string()
}

/// One SSE frame: `event: <type>\ndata: <json>\n\n`.
fn frame(event: &str, data: &str) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

fn frames_of(events: &[(&'static str, Value)]) -> Vec<Bytes> {
    events
        .iter()
        .map(|(event, data)| frame(event, &data.to_string()))
        .collect()
}

/// The SSE frames of a streamed answer, its text padded so the whole
/// stream is at least `pad` bytes when `pad` is set and the reply is
/// paddable.
pub(crate) fn stream_frames(reply: &Reply, pad: Option<u64>) -> Vec<Bytes> {
    let size = |reply: &Reply| frames_of(&reply.events()).iter().map(Bytes::len).sum();
    frames_of(&reply.padded(pad, size).events())
}

/// The `request-id` header (and the error body's `request_id`) of call `seq`.
pub(crate) fn request_id(seq: u64) -> String {
    format!("req_mock_{seq}")
}

/// Anthropic's error `type` for an HTTP status.
pub(crate) fn error_type(status: u16) -> &'static str {
    match status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        405..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"},
/// "request_id"}`.
pub(crate) fn error_body(status: u16, message: &str, seq: u64) -> Value {
    json!({
        "type": "error",
        "error": {"type": error_type(status), "message": message},
        "request_id": request_id(seq),
    })
}

/// The garbage of `kind` in place of `reply`, in the form the request
/// asked for (`stream`), except the stream endings, which always stream:
/// - `not_json`: an HTML page (streamed: `message_start`, then an event
///   whose data is the HTML page, then `message_stop`);
/// - `truncated`: half the JSON document (streamed: half the events, then
///   half of the next one);
/// - `empty`: an empty body;
/// - `error_object`: an error body (`api_error`) with the 200 (streamed:
///   an `error` event and nothing else);
/// - `empty_choices`: a message with `content: []` (streamed: no content
///   block between `message_start` and `message_delta`);
/// - `stream_without_done`: `message_start` and the blocks' start and
///   deltas, then the end of the body: no `content_block_stop`,
///   `message_delta` nor `message_stop`;
/// - `finished_without_done`: every event but `message_stop`;
/// - `done_without_finish`: every event but `message_delta` (no stop reason);
/// - `stream_error`: `message_start`, the first block's start and first
///   delta, then `event: error` with an `overloaded_error`, as Anthropic
///   reports an error mid-stream, and the end (plain: like `error_object`).
pub(crate) fn garbage(kind: Garbage, reply: &Reply, stream: bool) -> Garbled {
    let sse = |frames: Vec<Bytes>| Garbled {
        content_type: "text/event-stream",
        frames,
    };
    let events = reply.events();
    let only = |keep: &dyn Fn(&str) -> bool| -> Vec<Bytes> {
        frames_of(
            &events
                .iter()
                .filter(|(event, _)| keep(event))
                .cloned()
                .collect::<Vec<_>>(),
        )
    };
    let error = |status: u16, message: &str| error_body(status, message, reply.seq).to_string();
    let server_error = error(500, "Internal server error");
    match (kind, stream) {
        (Garbage::NotJson, false) => html_page(),
        (Garbage::NotJson, true) => sse(frames_of(events.get(..1).unwrap_or_default())
            .into_iter()
            .chain([
                frame("content_block_start", HTML),
                frame("message_stop", &json!({"type": "message_stop"}).to_string()),
            ])
            .collect()),
        (Garbage::Truncated, false) => {
            garbled_json(cut_in_half(&reply.message().to_string()).to_owned())
        }
        (Garbage::Truncated, true) => {
            let mut frames = frames_of(&events);
            let keep = frames.len() / 2;
            frames.truncate(keep + 1);
            if let Some(last) = frames.last_mut() {
                *last = last.slice(..last.len() / 2);
            }
            sse(frames)
        }
        (Garbage::Empty, false) => garbled_json(String::new()),
        (Garbage::Empty, true) => sse(Vec::new()),
        (Garbage::ErrorObject | Garbage::StreamError, false) => garbled_json(server_error),
        (Garbage::ErrorObject, true) => sse(vec![frame("error", &server_error)]),
        (Garbage::StreamError, true) => {
            let mut frames = frames_of(
                &events
                    .iter()
                    .filter(|(event, _)| *event != "ping")
                    .take(3)
                    .cloned()
                    .collect::<Vec<_>>(),
            );
            frames.push(frame("error", &error(529, "Overloaded")));
            sse(frames)
        }
        (Garbage::EmptyChoices, false) => {
            let mut message = reply.message();
            message["content"] = json!([]);
            message["usage"] = reply.usage(0);
            garbled_json(message.to_string())
        }
        (Garbage::EmptyChoices, true) => {
            let mut empty = reply.clone();
            empty.blocks.clear();
            sse(frames_of(&empty.events()))
        }
        (Garbage::StreamWithoutDone, _) => sse(only(&|event| {
            !matches!(
                event,
                "content_block_stop" | "message_delta" | "message_stop"
            )
        })),
        (Garbage::FinishedWithoutDone, _) => sse(only(&|event| event != "message_stop")),
        (Garbage::DoneWithoutFinish, _) => sse(only(&|event| event != "message_delta")),
    }
}
