//! The mock's Anthropic face: the body of `POST /v1/messages` and
//! `POST /v1/messages/count_tokens` as Anthropic's Messages API has them.
//! Pure functions of the request, like `answer`: the validation
//! (Anthropic's 400s), the reply, its plain and streamed forms, the error
//! body and the garbage.
//!
//! The reply to call number `seq`, deterministic:
//! - its text is `content` when set, else `mock answer #<seq> to: <last
//!   user text>` (the last `user` message's string content, or its `text`
//!   blocks and the text of its `tool_result` blocks joined by spaces; its
//!   first 200 characters);
//! - a stop sequence of the request found in the text cuts the text before
//!   the earliest one: `stop_reason: "stop_sequence"`, `stop_sequence` set;
//! - a text of more tokens than `max_tokens` (a token is four characters,
//!   as everywhere in the mock) is cut to `4 × max_tokens` characters:
//!   `stop_reason: "max_tokens"`, `output_tokens` = `max_tokens`;
//! - a tool call: when the request has tools and `tool_choice` is
//!   `{"type": "tool", "name": X}` (tool X) or `{"type": "any"}` (the first
//!   tool), the content is one `tool_use` block; when `tool_choice` is
//!   `auto` or absent and the last user text contains `call tool` (any
//!   case), the text block (cut by nothing) is followed by a `tool_use`
//!   block for the tool named by the word after the marker, or the first
//!   tool. Either way `stop_reason: "tool_use"`. The input holds each
//!   `required` property of the tool's `input_schema`: its first `enum`
//!   value or its `const`, else by `type` 1 (integer, number), true,
//!   `[]`, `{}`, null, or the last user text (string, or no type); a
//!   schema without required properties gives `{"q": <last user text>}`;
//! - otherwise `stop_reason: "end_turn"`.
//!
//! `input_tokens` (of the reply and of `count_tokens`) is the characters
//! of the system text, of every message's text (as above, plus each
//! `tool_use` input's JSON) and of every tool definition's JSON, divided by
//! four, at least 1; `output_tokens` the text's characters divided by four
//! plus the tool input's JSON characters divided by four (each at least 1).

use bytes::Bytes;
use serde_json::{Value, json};

use super::Garbage;
use super::answer::{
    ECHO_CHARS, Garbled, HTML, cut_in_half, estimate_tokens, garbled_json, grown, html_page,
};

/// The top-level fields of a messages request; Anthropic refuses any other.
const MESSAGES_FIELDS: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "system",
    "metadata",
    "stop_sequences",
    "stream",
    "temperature",
    "top_k",
    "top_p",
    "tools",
    "tool_choice",
    "thinking",
    "service_tier",
    "container",
    "mcp_servers",
];

/// The top-level fields of a token counting request.
const COUNT_TOKENS_FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "tools",
    "tool_choice",
    "thinking",
    "mcp_servers",
];

/// The content block types a message may hold.
const BLOCK_TYPES: &[&str] = &[
    "text",
    "image",
    "document",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "search_result",
    "server_tool_use",
    "web_search_tool_result",
];

/// What in the last user text makes an `auto` tool choice call a tool.
pub(crate) const TOOL_MARKER: &str = "call tool";

/// The longest piece of a tool input's JSON in one `input_json_delta`.
const JSON_PIECE_BYTES: usize = 12;

/// Which Anthropic endpoint a body is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `POST /v1/messages`.
    Messages,
    /// `POST /v1/messages/count_tokens`.
    CountTokens,
}

/// Checks `request` as Anthropic does; `Err` is the message of the 400
/// (`invalid_request_error`), naming the field at fault as Anthropic does
/// (`max_tokens: Field required`).
pub(crate) fn validate(request: &Value, kind: Kind) -> Result<(), String> {
    let Some(object) = request.as_object() else {
        return Err("mock: the body is not a JSON object".into());
    };
    let fields = match kind {
        Kind::Messages => MESSAGES_FIELDS,
        Kind::CountTokens => COUNT_TOKENS_FIELDS,
    };
    if let Some(extra) = object.keys().find(|key| !fields.contains(&key.as_str())) {
        return Err(format!("{extra}: Extra inputs are not permitted"));
    }
    match object.get("model") {
        None => return Err(required("model")),
        Some(Value::String(_)) => {}
        Some(_) => return Err("model: Input should be a valid string".into()),
    }
    if kind == Kind::Messages {
        match object.get("max_tokens") {
            None => return Err(required("max_tokens")),
            Some(value) if value.as_u64().is_some_and(|n| n >= 1) => {}
            Some(value) if value.is_i64() || value.is_u64() => {
                return Err("max_tokens: Input should be greater than or equal to 1".into());
            }
            Some(_) => return Err("max_tokens: Input should be a valid integer".into()),
        }
    }
    check_messages(object.get("messages"))?;
    if let Some(system) = object.get("system") {
        check_system(system)?;
    }
    if let Some(stops) = object.get("stop_sequences")
        && !stops
            .as_array()
            .is_some_and(|stops| stops.iter().all(Value::is_string))
    {
        return Err("stop_sequences: Input should be a valid list of strings".into());
    }
    for field in ["temperature", "top_p"] {
        if let Some(value) = object.get(field)
            && !value.as_f64().is_some_and(|x| (0.0..=1.0).contains(&x))
        {
            return Err(format!("{field}: Input should be a number from 0 to 1"));
        }
    }
    if let Some(top_k) = object.get("top_k")
        && top_k.as_u64().is_none()
    {
        return Err("top_k: Input should be a non-negative integer".into());
    }
    if let Some(stream) = object.get("stream")
        && !stream.is_boolean()
    {
        return Err("stream: Input should be a valid boolean".into());
    }
    if let Some(metadata) = object.get("metadata")
        && !metadata.is_object()
    {
        return Err("metadata: Input should be a valid dictionary".into());
    }
    let tools = match object.get("tools") {
        None => &[][..],
        Some(tools) => check_tools(tools)?,
    };
    if let Some(choice) = object.get("tool_choice") {
        check_tool_choice(choice, tools)?;
    }
    Ok(())
}

fn required(field: &str) -> String {
    format!("{field}: Field required")
}

fn check_messages(messages: Option<&Value>) -> Result<(), String> {
    let messages = match messages {
        None => return Err(required("messages")),
        Some(Value::Array(messages)) => messages,
        Some(_) => return Err("messages: Input should be a valid list".into()),
    };
    if messages.is_empty() {
        return Err("messages: at least one message is required".into());
    }
    for (i, message) in messages.iter().enumerate() {
        let Some(message) = message.as_object() else {
            return Err(format!("messages.{i}: Input should be a valid dictionary"));
        };
        if let Some(extra) = message.keys().find(|k| *k != "role" && *k != "content") {
            return Err(format!(
                "messages.{i}.{extra}: Extra inputs are not permitted"
            ));
        }
        match message.get("role") {
            None => return Err(required(&format!("messages.{i}.role"))),
            Some(Value::String(role)) if role == "user" || role == "assistant" => {}
            Some(_) => {
                return Err(format!(
                    "messages.{i}.role: Input should be 'user' or 'assistant'"
                ));
            }
        }
        match message.get("content") {
            None => return Err(required(&format!("messages.{i}.content"))),
            Some(Value::String(_)) => {}
            Some(Value::Array(blocks)) => {
                for (j, block) in blocks.iter().enumerate() {
                    check_block(block, &format!("messages.{i}.content.{j}"))?;
                }
            }
            Some(_) => {
                return Err(format!(
                    "messages.{i}.content: Input should be a valid string or list of content blocks"
                ));
            }
        }
    }
    if messages
        .first()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        != Some("user")
    {
        return Err("messages: first message must use the \"user\" role".into());
    }
    Ok(())
}

/// One content block at `at` (`messages.0.content.1`).
fn check_block(block: &Value, at: &str) -> Result<(), String> {
    let Some(kind) = block.get("type").and_then(Value::as_str) else {
        return Err(required(&format!("{at}.type")));
    };
    let string = |field: &str| -> Result<(), String> {
        match block.get(field) {
            Some(Value::String(_)) => Ok(()),
            None => Err(required(&format!("{at}.{field}"))),
            Some(_) => Err(format!("{at}.{field}: Input should be a valid string")),
        }
    };
    let object = |field: &str| -> Result<(), String> {
        match block.get(field) {
            Some(Value::Object(_)) => Ok(()),
            None => Err(required(&format!("{at}.{field}"))),
            Some(_) => Err(format!("{at}.{field}: Input should be a valid dictionary")),
        }
    };
    match kind {
        "text" => string("text"),
        "image" => object("source"),
        "tool_use" => {
            string("id")?;
            string("name")?;
            object("input")
        }
        "tool_result" => {
            string("tool_use_id")?;
            match block.get("content") {
                None | Some(Value::String(_) | Value::Array(_)) => Ok(()),
                Some(_) => Err(format!(
                    "{at}.content: Input should be a valid string or list of content blocks"
                )),
            }
        }
        known if BLOCK_TYPES.contains(&known) => Ok(()),
        other => Err(format!(
            "{at}: Input tag '{other}' found using 'type' does not match any of the expected tags"
        )),
    }
}

fn check_system(system: &Value) -> Result<(), String> {
    let text_block = |block: &Value| {
        block.get("type").and_then(Value::as_str) == Some("text")
            && block.get("text").is_some_and(Value::is_string)
    };
    match system {
        Value::String(_) => Ok(()),
        Value::Array(blocks) if blocks.iter().all(text_block) => Ok(()),
        _ => Err("system: Input should be a valid string or list of text blocks".into()),
    }
}

/// The tools, checked: a custom tool (no `type`, or `custom`) has a
/// non-empty `name` and an `input_schema` object; a server tool (any other
/// `type`) is taken as it is.
fn check_tools(tools: &Value) -> Result<&[Value], String> {
    let Some(list) = tools.as_array() else {
        return Err("tools: Input should be a valid list".into());
    };
    for (i, tool) in list.iter().enumerate() {
        let Some(tool) = tool.as_object() else {
            return Err(format!("tools.{i}: Input should be a valid dictionary"));
        };
        let custom = matches!(
            tool.get("type").and_then(Value::as_str),
            None | Some("custom")
        );
        if !custom {
            continue;
        }
        match tool.get("name") {
            Some(Value::String(name)) if !name.is_empty() => {}
            None => return Err(required(&format!("tools.{i}.name"))),
            Some(_) => {
                return Err(format!(
                    "tools.{i}.name: String should have at least 1 character"
                ));
            }
        }
        match tool.get("input_schema") {
            Some(Value::Object(_)) => {}
            None => return Err(required(&format!("tools.{i}.input_schema"))),
            Some(_) => {
                return Err(format!(
                    "tools.{i}.input_schema: Input should be a valid dictionary"
                ));
            }
        }
    }
    Ok(list)
}

fn check_tool_choice(choice: &Value, tools: &[Value]) -> Result<(), String> {
    let kind = match choice.get("type") {
        None => return Err(required("tool_choice.type")),
        Some(Value::String(kind)) if ["auto", "any", "tool", "none"].contains(&kind.as_str()) => {
            kind.as_str()
        }
        Some(_) => {
            return Err("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'".into());
        }
    };
    if kind != "none" && tools.is_empty() {
        return Err("tool_choice: tool_choice may only be specified while providing tools".into());
    }
    if kind == "tool" {
        let Some(name) = choice.get("name").and_then(Value::as_str) else {
            return Err(required("tool_choice.name"));
        };
        if !tools
            .iter()
            .any(|tool| tool.get("name") == Some(&json!(name)))
        {
            return Err(format!(
                "tool_choice.name: tool '{name}' is not among the request's tools"
            ));
        }
    }
    Ok(())
}

/// One content block of a reply.
#[derive(Debug, Clone, PartialEq)]
enum Block {
    Text(String),
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
}

impl Block {
    fn json(&self) -> Value {
        match self {
            Block::Text(text) => json!({"type": "text", "text": text}),
            Block::ToolUse { id, name, input } => {
                json!({"type": "tool_use", "id": id, "name": name, "input": input})
            }
        }
    }

    fn tokens(&self) -> u64 {
        match self {
            Block::Text(text) => estimate_tokens(text.chars().count()),
            Block::ToolUse { input, .. } => estimate_tokens(input.to_string().chars().count()),
        }
    }
}

/// The mock's answer to a (valid) messages request, in every form.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Reply {
    seq: u64,
    model: Value,
    blocks: Vec<Block>,
    stop_reason: &'static str,
    stop_sequence: Option<String>,
    input_tokens: u64,
}

impl Reply {
    /// The reply to `request` as call number `seq`; `content` fixes the
    /// text (see the module's documentation).
    pub(crate) fn new(request: &Value, seq: u64, content: Option<&str>) -> Reply {
        let last = last_user_text(request);
        let echo: String = last.chars().take(ECHO_CHARS).collect();
        let text = match content {
            Some(content) => content.to_owned(),
            None => format!("mock answer #{seq} to: {echo}"),
        };
        let tool = tool_call(request, &last, &echo, seq);
        let (blocks, stop_reason, stop_sequence) = match tool {
            Some((block, true)) => (vec![block], "tool_use", None),
            tool => {
                let (text, stop_reason, stop_sequence) = ended(text, request);
                match tool {
                    Some((block, _)) if stop_reason == "end_turn" => {
                        (vec![Block::Text(text), block], "tool_use", None)
                    }
                    _ => (vec![Block::Text(text)], stop_reason, stop_sequence),
                }
            }
        };
        Reply {
            seq,
            model: request.get("model").cloned().unwrap_or(json!("mock")),
            blocks,
            stop_reason,
            stop_sequence,
            input_tokens: input_tokens(request),
        }
    }

    fn id(&self) -> String {
        format!("msg_mock_{}", self.seq)
    }

    fn output_tokens(&self) -> u64 {
        self.blocks.iter().map(Block::tokens).sum()
    }

    fn usage(&self, output_tokens: u64) -> Value {
        json!({
            "input_tokens": self.input_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        })
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
    /// its deltas (the text split after each space; the tool input's JSON
    /// in pieces of up to 12 bytes, always at least two for an input of
    /// two bytes or more) and `content_block_stop`, with a `ping` after the
    /// first `content_block_start`; then `message_delta` (the stop reason,
    /// `output_tokens`) and `message_stop`.
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
            let (empty, deltas): (Value, Vec<Value>) = match block {
                Block::Text(text) => {
                    let mut pieces: Vec<Value> = text
                        .split_inclusive(' ')
                        .map(|piece| json!({"type": "text_delta", "text": piece}))
                        .collect();
                    if pieces.is_empty() {
                        pieces.push(json!({"type": "text_delta", "text": ""}));
                    }
                    (json!({"type": "text", "text": ""}), pieces)
                }
                Block::ToolUse { id, name, input } => (
                    json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                    json_pieces(&input.to_string())
                        .into_iter()
                        .map(|piece| json!({"type": "input_json_delta", "partial_json": piece}))
                        .collect(),
                ),
            };
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
        events.push((
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                "usage": {"output_tokens": self.output_tokens()},
            }),
        ));
        events.push(("message_stop", json!({"type": "message_stop"})));
        events
    }

    /// True when `pad_bytes` applies: the reply has a text block that no
    /// stop sequence or `max_tokens` cut.
    pub(crate) fn paddable(&self) -> bool {
        matches!(self.stop_reason, "end_turn" | "tool_use")
            && self.blocks.iter().any(|b| matches!(b, Block::Text(_)))
    }

    /// The same reply with `text` as its text block's.
    fn with_text(&self, text: &str) -> Reply {
        let mut reply = self.clone();
        if let Some(Block::Text(old)) = reply
            .blocks
            .iter_mut()
            .find(|b| matches!(b, Block::Text(_)))
        {
            text.clone_into(old);
        }
        reply
    }

    /// This reply, its text padded until `size_of` it is at least `pad`
    /// bytes (unchanged when not [`Reply::paddable`]).
    fn padded(&self, pad: Option<u64>, size_of: impl Fn(&Reply) -> usize) -> Reply {
        let text = self.blocks.iter().find_map(|b| match b {
            Block::Text(text) => Some(text.clone()),
            Block::ToolUse { .. } => None,
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
        .collect();
    let named = |name: &str| {
        tools
            .iter()
            .copied()
            .find(|tool| tool.get("name").and_then(Value::as_str) == Some(name))
    };
    let choice = request.get("tool_choice");
    let (tool, forced) = match choice.and_then(|c| c.get("type")).and_then(Value::as_str) {
        Some("none") => return None,
        Some("tool") => (named(choice?.get("name")?.as_str()?)?, true),
        Some("any") => (*tools.first()?, true),
        _ => {
            let at = last.to_ascii_lowercase().find(TOOL_MARKER)?;
            let word: String = last[at + TOOL_MARKER.len()..]
                .trim_start()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == '-')
                .collect();
            (named(&word).or_else(|| tools.first().copied())?, false)
        }
    };
    let name = tool.get("name")?.as_str()?.to_owned();
    let block = Block::ToolUse {
        id: format!("toolu_mock_{seq}"),
        name,
        input: super::answer::tool_input(tool.get("input_schema"), echo),
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

/// The text of the last `user` message.
fn last_user_text(request: &Value) -> String {
    request
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|messages| {
            messages
                .iter()
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        })
        .map(|message| content_text(message.get("content")))
        .unwrap_or_default()
}

/// What the call log shows as the prompt: the last user text, its first
/// 200 characters.
pub(crate) fn echoed(request: &Value) -> String {
    last_user_text(request).chars().take(ECHO_CHARS).collect()
}

/// The text of a message's (or a tool result's) content: the string, or
/// its `text` blocks and the text of its `tool_result` blocks joined by
/// spaces.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|block| match block.get("type").and_then(Value::as_str) {
                Some("text") => block.get("text").and_then(Value::as_str).map(str::to_owned),
                Some("tool_result") => Some(content_text(block.get("content"))),
                _ => None,
            })
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// The request's input tokens (see the module's documentation).
pub(crate) fn input_tokens(request: &Value) -> u64 {
    let system = match request.get("system") {
        Some(Value::String(text)) => text.chars().count(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .map(|text| text.chars().count())
            .sum(),
        _ => 0,
    };
    let messages: usize = request
        .get("messages")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|message| {
            let content = message.get("content");
            let inputs: usize = content
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("tool_use"))
                .filter_map(|b| b.get("input"))
                .map(|input| input.to_string().chars().count())
                .sum();
            content_text(content).chars().count() + inputs
        })
        .sum();
    let tools: usize = request
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|tool| tool.to_string().chars().count())
        .sum();
    estimate_tokens(system + messages + tools)
}

/// The body of a plain answer, its text padded so the body is at least
/// `pad` bytes when `pad` is set and the reply is paddable.
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
