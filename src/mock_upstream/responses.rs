//! The mock's Responses API face (`POST /v1/responses`), the answer side:
//! the reply to a (valid) request as a `response` object or as its typed
//! events, and the garbage. Pure functions of the request and the call
//! number, spoken natively (no translation through chat); what is accepted
//! and how a request is read is in `responses_request`.
//!
//! The reply to call number `seq`, deterministic, its output items in this
//! order:
//! - `reasoning` (`rs_mock<seq>`), when the request has `reasoning`: its
//!   `summary` a `summary_text` part when `reasoning.summary` is set (not
//!   `none`), its `encrypted_content` (sealed, accepted back) only when
//!   `include` has `reasoning.encrypted_content`;
//! - `web_search_call` (`ws_mock<seq>`, `status: completed`, `action:
//!   {type: search, query: <last user text>}`), when a `web_search*` tool
//!   is offered and the last user text contains `search` (any case);
//! - the `message` (`msg_mock<seq>`): one `output_text` part, `mock answer
//!   #<seq> to: <last user text>` (or `content`; in the form `text.format`
//!   asks, as the chat answer's `response_format`), cut to `4 ×
//!   max_output_tokens` characters when longer (then `status: incomplete`,
//!   `incomplete_details.reason: max_output_tokens`); left out when a
//!   `tool_choice` forces the call;
//! - a tool call, when `tool_choice` names a function or custom tool (that
//!   one) or is `required` (the first), or, with `auto` or none, when the
//!   last user text contains `call tool NAME` (the tool of that name, its
//!   own or `namespace.name`, else the first): a `function_call`
//!   (`fc_mock<seq>`, `call_id` `call_mock_<seq>`, the `namespace` of a
//!   nested function, `arguments` the JSON object written after the name
//!   or one built from the `parameters` as the chat answer's) or a
//!   `custom_tool_call` (`ctc_mock<seq>`, `input` the JSON string written
//!   after the name, or the last user text).
//!
//! The last user text is that of the last user message or tool output of
//! the input, so a tool round trip ends with a message. `usage`: the input
//! tokens as `responses_request::input_tokens` counts, the output tokens
//! those of the items' texts (four characters a token), of which the
//! reasoning's are `reasoning_tokens`.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::Garbage;
use super::answer::{
    ECHO_CHARS, Garbled, HTML, cut_in_half, estimate_tokens, formatted, garbled_json, grown,
    html_page, marked_tool, server_error,
};
use super::responses_request::{Offered, REASONING_SEAL, input_tokens, last_user_text};
use super::seal;

/// The longest piece of a call's arguments or input in one delta.
const PIECE_BYTES: usize = 12;

/// One output item of a reply.
#[derive(Debug, Clone, PartialEq)]
enum Item {
    Reasoning {
        summary: Option<String>,
        encrypted: Option<String>,
    },
    WebSearch {
        query: String,
    },
    Message {
        text: String,
    },
    FunctionCall {
        name: String,
        namespace: Option<String>,
        arguments: String,
    },
    CustomCall {
        name: String,
        input: String,
    },
}

/// The mock's answer to a (valid) Responses request, in every form.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    seq: u64,
    created_at: u64,
    /// The request's fields a `response` object echoes.
    echo: Map<String, Value>,
    items: Vec<Item>,
    /// The whole reasoning text (counted as reasoning tokens).
    reasoning: Option<String>,
    /// Cut by `max_output_tokens`.
    cut: bool,
    input_tokens: u64,
}

impl Reply {
    /// The reply to `request` as call number `seq`; `content` fixes the
    /// message's text (see the module's documentation).
    pub(crate) fn new(request: &Value, seq: u64, content: Option<&str>) -> Reply {
        let last = last_user_text(request);
        let echo_text: String = last.chars().take(ECHO_CHARS).collect();
        let offered = Offered::of(request);
        let mut items = Vec::new();
        let reasoning = request
            .get("reasoning")
            .filter(|r| r.is_object())
            .map(|_| format!("mock reasoning #{seq} about: {echo_text}"));
        if let Some(thinking) = &reasoning {
            let summary = request
                .pointer("/reasoning/summary")
                .and_then(Value::as_str)
                .filter(|s| *s != "none")
                .map(|_| format!("**Mock reasoning**\n\n{thinking}"));
            let encrypted = includes(request, "reasoning.encrypted_content")
                .then(|| seal::seal(REASONING_SEAL, &format!("rs_mock{seq} {thinking}")));
            items.push(Item::Reasoning { summary, encrypted });
        }
        let call = tool_call(request, &offered, &last, &echo_text);
        if offered.web_search() && last.to_lowercase().contains("search") {
            items.push(Item::WebSearch {
                query: echo_text.clone(),
            });
        }
        let mut cut = false;
        if !call.as_ref().is_some_and(|(_, forced)| *forced) {
            let text = match content {
                Some(content) => content.to_owned(),
                None => formatted(
                    chat_format(request).as_ref(),
                    format!("mock answer #{seq} to: {echo_text}"),
                ),
            };
            let limit = request.get("max_output_tokens").and_then(Value::as_u64);
            let text = match limit {
                Some(limit) if estimate_tokens(text.chars().count()) > limit => {
                    cut = true;
                    let chars = usize::try_from(limit.saturating_mul(4)).unwrap_or(usize::MAX);
                    text.chars().take(chars).collect()
                }
                _ => text,
            };
            items.push(Item::Message { text });
        }
        if let Some((item, _)) = call.filter(|_| !cut) {
            items.push(item);
        }
        Reply {
            seq,
            created_at: super::answer::now_secs(),
            echo: echo_fields(request),
            items,
            reasoning,
            cut,
            input_tokens: input_tokens(request),
        }
    }

    fn id(&self) -> String {
        format!("resp_mock{}", self.seq)
    }

    /// The id of item `index` (`rs_mock<seq>`, `msg_mock<seq>`, ...).
    fn item_id(&self, item: &Item) -> String {
        let prefix = match item {
            Item::Reasoning { .. } => "rs",
            Item::WebSearch { .. } => "ws",
            Item::Message { .. } => "msg",
            Item::FunctionCall { .. } => "fc",
            Item::CustomCall { .. } => "ctc",
        };
        format!("{prefix}_mock{}", self.seq)
    }

    fn call_id(&self) -> String {
        format!("call_mock_{}", self.seq)
    }

    /// `item` as the response shows it: whole (`done`), or as
    /// `response.output_item.added` announces it.
    fn item_json(&self, item: &Item, done: bool) -> Value {
        let id = self.item_id(item);
        let status = if !done {
            "in_progress"
        } else if self.cut && matches!(item, Item::Message { .. }) {
            "incomplete"
        } else {
            "completed"
        };
        match item {
            Item::Reasoning { summary, encrypted } => {
                let mut value = json!({"id": id, "type": "reasoning", "summary": []});
                if done {
                    if let Some(summary) = summary {
                        value["summary"] = json!([{"type": "summary_text", "text": summary}]);
                    }
                    if let Some(encrypted) = encrypted {
                        value["encrypted_content"] = json!(encrypted);
                    }
                }
                value
            }
            Item::WebSearch { query } => {
                let mut value = json!({"id": id, "type": "web_search_call", "status": status});
                if done {
                    value["action"] = json!({"type": "search", "query": query});
                }
                value
            }
            Item::Message { text } => {
                let content = if done {
                    json!([output_text(text)])
                } else {
                    json!([])
                };
                json!({"id": id, "type": "message", "status": status, "role": "assistant",
                    "content": content})
            }
            Item::FunctionCall {
                name,
                namespace,
                arguments,
            } => {
                let mut value = json!({"id": id, "type": "function_call", "status": status,
                    "call_id": self.call_id(), "name": name,
                    "arguments": if done { arguments.as_str() } else { "" }});
                if let Some(namespace) = namespace {
                    value["namespace"] = json!(namespace);
                }
                value
            }
            Item::CustomCall { name, input } => json!({"id": id, "type": "custom_tool_call",
                "status": status, "call_id": self.call_id(), "name": name,
                "input": if done { input.as_str() } else { "" }}),
        }
    }

    fn usage(&self) -> Value {
        let reasoning = self
            .reasoning
            .as_ref()
            .map_or(0, |r| estimate_tokens(r.chars().count()));
        let others: u64 = self
            .items
            .iter()
            .map(|item| match item {
                Item::Reasoning { .. } | Item::WebSearch { .. } => 0,
                Item::Message { text } => estimate_tokens(text.chars().count()),
                Item::FunctionCall { arguments, .. } => estimate_tokens(arguments.chars().count()),
                Item::CustomCall { input, .. } => estimate_tokens(input.chars().count()),
            })
            .sum();
        let output = reasoning + others;
        json!({
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": self.input_tokens + output,
        })
    }

    /// The `response` object in `status`, with `output` as given.
    fn response(&self, status: &str, output: Vec<Value>, usage: Value) -> Value {
        let mut response = Map::new();
        response.insert("id".into(), json!(self.id()));
        response.insert("object".into(), json!("response"));
        response.insert("created_at".into(), json!(self.created_at));
        response.insert("status".into(), json!(status));
        response.insert("background".into(), json!(false));
        response.insert("error".into(), Value::Null);
        let details = if status == "incomplete" {
            json!({"reason": "max_output_tokens"})
        } else {
            Value::Null
        };
        response.insert("incomplete_details".into(), details);
        for (key, value) in &self.echo {
            response.insert(key.clone(), value.clone());
        }
        response.insert("output".into(), Value::Array(output));
        response.insert("usage".into(), usage);
        Value::Object(response)
    }

    fn status(&self) -> &'static str {
        if self.cut { "incomplete" } else { "completed" }
    }

    /// The plain answer: the finished `response` object.
    pub(crate) fn body(&self) -> Value {
        let output = self
            .items
            .iter()
            .map(|item| self.item_json(item, true))
            .collect();
        self.response(self.status(), output, self.usage())
    }

    /// The streamed answer, as event payloads (each with its `type`;
    /// `sequence_number`s are added by [`frames_of`]): `response.created`,
    /// `response.in_progress`, per item `response.output_item.added`, its
    /// own events and `response.output_item.done`, then
    /// `response.completed` (or `response.incomplete`). An item's own
    /// events: reasoning, `response.reasoning_summary_part.added`,
    /// `response.reasoning_summary_text.delta`s and `.done`,
    /// `response.reasoning_summary_part.done` (when it has a summary);
    /// web search, `response.web_search_call.in_progress`, `.searching`,
    /// `.completed`; message, `response.content_part.added`,
    /// `response.output_text.delta`s (split after each space),
    /// `response.output_text.done`, `response.content_part.done`; function
    /// call, `response.function_call_arguments.delta`s (pieces of up to 12
    /// bytes) and `.done`; custom tool call,
    /// `response.custom_tool_call_input.delta`s and `.done`.
    pub(crate) fn events(&self) -> Vec<Value> {
        let started = self.response("in_progress", Vec::new(), Value::Null);
        let mut events = vec![
            json!({"type": "response.created", "response": started}),
            json!({"type": "response.in_progress", "response": started}),
        ];
        for (index, item) in self.items.iter().enumerate() {
            events.extend(self.item_events(index, item));
        }
        let kind = if self.cut {
            "response.incomplete"
        } else {
            "response.completed"
        };
        events.push(json!({"type": kind, "response": self.body()}));
        events
    }

    fn item_events(&self, index: usize, item: &Item) -> Vec<Value> {
        let id = self.item_id(item);
        let at = |kind: &str, mut fields: Value| {
            fields["type"] = json!(kind);
            fields["item_id"] = json!(id);
            fields["output_index"] = json!(index);
            fields
        };
        let mut events = vec![json!({"type": "response.output_item.added",
            "output_index": index, "item": self.item_json(item, false)})];
        match item {
            Item::Reasoning {
                summary: Some(summary),
                ..
            } => {
                let part = |text: &str| json!({"type": "summary_text", "text": text});
                events.push(at(
                    "response.reasoning_summary_part.added",
                    json!({"summary_index": 0, "part": part("")}),
                ));
                for piece in summary.split_inclusive(' ') {
                    events.push(at(
                        "response.reasoning_summary_text.delta",
                        json!({"summary_index": 0, "delta": piece}),
                    ));
                }
                events.push(at(
                    "response.reasoning_summary_text.done",
                    json!({"summary_index": 0, "text": summary}),
                ));
                events.push(at(
                    "response.reasoning_summary_part.done",
                    json!({"summary_index": 0, "part": part(summary)}),
                ));
            }
            Item::Reasoning { summary: None, .. } => {}
            Item::WebSearch { .. } => {
                for stage in ["in_progress", "searching", "completed"] {
                    events.push(at(&format!("response.web_search_call.{stage}"), json!({})));
                }
            }
            Item::Message { text } => {
                events.push(at(
                    "response.content_part.added",
                    json!({"content_index": 0, "part": output_text("")}),
                ));
                for piece in text.split_inclusive(' ') {
                    events.push(at(
                        "response.output_text.delta",
                        json!({"content_index": 0, "delta": piece, "logprobs": []}),
                    ));
                }
                events.push(at(
                    "response.output_text.done",
                    json!({"content_index": 0, "text": text, "logprobs": []}),
                ));
                events.push(at(
                    "response.content_part.done",
                    json!({"content_index": 0, "part": output_text(text)}),
                ));
            }
            Item::FunctionCall { arguments, .. } => {
                for piece in pieces(arguments) {
                    events.push(at(
                        "response.function_call_arguments.delta",
                        json!({"delta": piece}),
                    ));
                }
                events.push(at(
                    "response.function_call_arguments.done",
                    json!({"arguments": arguments}),
                ));
            }
            Item::CustomCall { input, .. } => {
                for piece in pieces(input) {
                    events.push(at(
                        "response.custom_tool_call_input.delta",
                        json!({"delta": piece}),
                    ));
                }
                events.push(at(
                    "response.custom_tool_call_input.done",
                    json!({"input": input}),
                ));
            }
        }
        events.push(
            json!({"type": "response.output_item.done", "output_index": index,
            "item": self.item_json(item, true)}),
        );
        events
    }

    /// True when `pad_bytes` applies: the reply has a message no
    /// `max_output_tokens` cut.
    pub(crate) fn paddable(&self) -> bool {
        !self.cut && self.items.iter().any(|i| matches!(i, Item::Message { .. }))
    }

    /// The same reply with `text` as its message's.
    fn with_text(&self, text: &str) -> Reply {
        let mut reply = self.clone();
        for item in &mut reply.items {
            if let Item::Message { text: old } = item {
                text.clone_into(old);
            }
        }
        reply
    }

    /// This reply, its message padded until `size_of` it is at least `pad`
    /// bytes (unchanged when not [`Reply::paddable`]).
    fn padded(&self, pad: Option<u64>, size_of: impl Fn(&Reply) -> usize) -> Reply {
        let text = self.items.iter().find_map(|item| match item {
            Item::Message { text } => Some(text.clone()),
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

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// True when `include` has `what`.
fn includes(request: &Value, what: &str) -> bool {
    request
        .get("include")
        .and_then(Value::as_array)
        .is_some_and(|list| list.iter().any(|v| v.as_str() == Some(what)))
}

/// `text.format` as chat's `response_format`, for [`formatted`].
fn chat_format(request: &Value) -> Option<Value> {
    let format = request.pointer("/text/format")?;
    Some(match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => json!({"type": "json_schema",
            "json_schema": {"schema": format.get("schema").cloned().unwrap_or(Value::Null)}}),
        _ => format.clone(),
    })
}

/// The request's fields a `response` object echoes, with OpenAI's defaults.
fn echo_fields(request: &Value) -> Map<String, Value> {
    let given = |key: &str| request.get(key).filter(|v| !v.is_null()).cloned();
    let mut echo = Map::new();
    for key in [
        "instructions",
        "max_output_tokens",
        "max_tool_calls",
        "model",
        "previous_response_id",
        "prompt_cache_key",
        "safety_identifier",
        "temperature",
        "top_logprobs",
        "top_p",
        "user",
    ] {
        echo.insert(key.into(), given(key).unwrap_or(Value::Null));
    }
    let defaults = [
        ("metadata", json!({})),
        ("parallel_tool_calls", json!(true)),
        ("service_tier", json!("default")),
        ("store", json!(true)),
        ("tool_choice", json!("auto")),
        ("tools", json!([])),
        ("truncation", json!("disabled")),
    ];
    for (key, default) in defaults {
        echo.insert(key.into(), given(key).unwrap_or(default));
    }
    let pick = |pointer: &str| request.pointer(pointer).cloned().unwrap_or(Value::Null);
    echo.insert(
        "reasoning".into(),
        json!({"effort": pick("/reasoning/effort"), "summary": pick("/reasoning/summary")}),
    );
    let mut text = json!({"format": {"type": "text"}, "verbosity": "medium"});
    if let Some(format) = given("text").and_then(|t| t.get("format").cloned()) {
        text["format"] = format;
    }
    if let Some(verbosity) = request.pointer("/text/verbosity").filter(|v| v.is_string()) {
        text["verbosity"] = verbosity.clone();
    }
    echo.insert("text".into(), text);
    echo
}

/// The tool call `request` asks for (see the module's documentation), and
/// whether `tool_choice` forced it.
fn tool_call(request: &Value, offered: &Offered, last: &str, echo: &str) -> Option<(Item, bool)> {
    let choice = request.get("tool_choice");
    let (tool, forced, given) = match choice {
        Some(Value::String(mode)) if mode == "none" => return None,
        Some(Value::String(mode)) if mode == "required" => (offered.callable().next()?, true, None),
        Some(Value::Object(choice)) if choice.contains_key("name") => {
            (offered.named(choice.get("name")?.as_str()?)?, true, None)
        }
        _ => {
            let marked = marked_tool(last)?;
            let tool = offered
                .named(&marked.name)
                .or_else(|| offered.callable().next())?;
            (tool, false, marked.input)
        }
    };
    let item = if tool.kind == "custom" {
        let input = match given {
            Some(Value::String(input)) => input,
            _ => echo.to_owned(),
        };
        Item::CustomCall {
            name: tool.name.to_owned(),
            input,
        }
    } else {
        let arguments = given
            .filter(Value::is_object)
            .unwrap_or_else(|| super::answer::tool_input(tool.definition.get("parameters"), echo));
        Item::FunctionCall {
            name: tool.name.to_owned(),
            namespace: tool.namespace.map(str::to_owned),
            arguments: arguments.to_string(),
        }
    };
    Some((item, forced))
}

/// `text` in pieces of at most [`PIECE_BYTES`] bytes, cut on character
/// boundaries (one empty piece for an empty text).
fn pieces(text: &str) -> Vec<String> {
    let mut pieces = Vec::new();
    let mut piece = String::new();
    for c in text.chars() {
        if !piece.is_empty() && piece.len() + c.len_utf8() > PIECE_BYTES {
            pieces.push(std::mem::take(&mut piece));
        }
        piece.push(c);
    }
    if !piece.is_empty() || pieces.is_empty() {
        pieces.push(piece);
    }
    pieces
}

/// The SSE frames of `events`, numbered from 0:
/// `event: <type>\ndata: <json with sequence_number>\n\n`.
fn frames_of(events: &[Value]) -> Vec<Bytes> {
    events
        .iter()
        .enumerate()
        .map(|(n, event)| {
            let mut event = event.clone();
            event["sequence_number"] = json!(n);
            let kind = event["type"].as_str().unwrap_or("message").to_owned();
            Bytes::from(format!("event: {kind}\ndata: {event}\n\n"))
        })
        .collect()
}

/// The body of a plain answer, its message padded so the body is at least
/// `pad` bytes when `pad` is set and the reply is paddable.
pub(crate) fn plain_body(reply: &Reply, pad: Option<u64>) -> String {
    let size = |reply: &Reply| reply.body().to_string().len();
    reply.padded(pad, size).body().to_string()
}

/// The SSE frames of a streamed answer, padded likewise.
pub(crate) fn stream_frames(reply: &Reply, pad: Option<u64>) -> Vec<Bytes> {
    let size = |reply: &Reply| frames_of(&reply.events()).iter().map(Bytes::len).sum();
    frames_of(&reply.padded(pad, size).events())
}

/// The garbage of `kind` in place of `reply`, in the form the request
/// asked for (`stream`), except the stream endings, which always stream:
/// - `not_json`: an HTML page (streamed: `response.created`, then an event
///   whose data is the HTML page);
/// - `truncated`: half the JSON document (streamed: half the events, then
///   half of the next one);
/// - `empty`: an empty body;
/// - `error_object`: OpenAI's `{"error": ...}` with the 200 (streamed:
///   `response.created`, then an `error` event);
/// - `empty_choices`: a completed response with `output: []` (streamed:
///   `response.created`, `response.in_progress`, `response.completed`,
///   no item);
/// - `stream_without_done`: every event up to the last delta, then the end
///   of the body: no item is done, no `response.completed`;
/// - `finished_without_done`: every event but `response.completed`;
/// - `done_without_finish`: `response.completed` comes, but the message
///   never got its `.done` events (`response.output_text.done`,
///   `response.content_part.done`, its `response.output_item.done`);
/// - `stream_error`: `response.created`, `response.in_progress`, the
///   first item's first events, then `response.failed` (status `failed`,
///   `error.code: server_error`), as OpenAI ends a stream on a server
///   error (plain: like `error_object`).
pub(crate) fn garbage(kind: Garbage, reply: &Reply, stream: bool) -> Garbled {
    let sse = |events: Vec<Value>| Garbled {
        content_type: "text/event-stream",
        frames: frames_of(&events),
    };
    let events = reply.events();
    let head = || events.iter().take(1).cloned().collect::<Vec<_>>();
    match (kind, stream) {
        (Garbage::NotJson, false) => html_page(),
        (Garbage::NotJson, true) => {
            let mut frames = frames_of(&head());
            frames.push(Bytes::from(format!(
                "event: response.output_item.added\ndata: {HTML}\n\n"
            )));
            Garbled {
                content_type: "text/event-stream",
                frames,
            }
        }
        (Garbage::Truncated, false) => {
            garbled_json(cut_in_half(&reply.body().to_string()).to_owned())
        }
        (Garbage::Truncated, true) => {
            let mut frames = frames_of(&events);
            let keep = frames.len() / 2;
            frames.truncate(keep + 1);
            if let Some(last) = frames.last_mut() {
                *last = last.slice(..last.len() / 2);
            }
            Garbled {
                content_type: "text/event-stream",
                frames,
            }
        }
        (Garbage::Empty, false) => garbled_json(String::new()),
        (Garbage::Empty, true) => sse(Vec::new()),
        (Garbage::ErrorObject | Garbage::StreamError, false) => garbled_json(server_error()),
        (Garbage::ErrorObject, true) => {
            let mut events = head();
            events.push(json!({"type": "error", "code": "server_error",
                "message": "The server had an error while processing your request.",
                "param": null}));
            sse(events)
        }
        (Garbage::StreamError, true) => {
            let mut kept: Vec<Value> = events.iter().take(4).cloned().collect();
            let mut failed = reply.response("failed", Vec::new(), Value::Null);
            failed["error"] = json!({"code": "server_error",
                "message": "The server had an error while processing your request."});
            kept.push(json!({"type": "response.failed", "response": failed}));
            sse(kept)
        }
        (Garbage::EmptyChoices, false) => garbled_json(
            reply
                .response("completed", Vec::new(), reply.usage())
                .to_string(),
        ),
        (Garbage::EmptyChoices, true) => {
            let mut kept: Vec<Value> = events.iter().take(2).cloned().collect();
            let done = reply.response("completed", Vec::new(), reply.usage());
            kept.push(json!({"type": "response.completed", "response": done}));
            sse(kept)
        }
        (Garbage::StreamWithoutDone, _) => {
            let last_delta = events
                .iter()
                .rposition(|e| e["type"].as_str().is_some_and(|t| t.ends_with(".delta")))
                .unwrap_or(1);
            sse(events.iter().take(last_delta + 1).cloned().collect())
        }
        (Garbage::FinishedWithoutDone, _) => sse(events
            .iter()
            .filter(|e| {
                !matches!(
                    e["type"].as_str(),
                    Some("response.completed" | "response.incomplete")
                )
            })
            .cloned()
            .collect()),
        (Garbage::DoneWithoutFinish, _) => {
            let message = reply.item_id(&Item::Message {
                text: String::new(),
            });
            sse(events
                .iter()
                .filter(|e| {
                    let done = matches!(
                        e["type"].as_str(),
                        Some("response.output_text.done" | "response.content_part.done")
                    ) || (e["type"] == "response.output_item.done"
                        && e["item"]["id"] == json!(message));
                    !done
                })
                .cloned()
                .collect())
        }
    }
}
