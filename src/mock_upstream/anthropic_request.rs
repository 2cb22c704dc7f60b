//! The mock's Anthropic face, the request side: what `POST /v1/messages`
//! and `POST /v1/messages/count_tokens` accept (Anthropic's 400s, with the
//! field at fault named as Anthropic names it), and what the reply reads
//! from a request (the last user text, the input tokens, the thinking and
//! server tools asked for).
//!
//! Accepted as the real API and Claude Code 2.1.x use it: `thinking`
//! (`enabled` with `budget_tokens` >= 1024 and below `max_tokens`,
//! `adaptive`, `disabled`; `display`), `output_config`,
//! `context_management`, `top_k`, `mcp_servers`, `container`,
//! `service_tier`, `metadata`, `system` (a string or text blocks), messages
//! of role `user`, `assistant` and `system` (the first one `user`), content
//! blocks of every type the API knows (a replayed `thinking` block must
//! carry a signature the mock made: see [`super::seal`]), custom tools and
//! server tools (`web_search_*`, `bash_*`, `text_editor_*` and the other
//! dated types).

use serde_json::{Map, Value, json};

use super::answer::{ECHO_CHARS, estimate_tokens};
use super::seal;

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
    "output_config",
    "context_management",
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
    "output_config",
    "context_management",
];

/// The fields of a message: its `output_config` is a turn's own (Claude
/// Code sends one on its `system` message, with the `per-turn-control`
/// beta).
const MESSAGE_FIELDS: &[&str] = &["role", "content", "output_config"];

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
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "mcp_tool_use",
    "mcp_tool_result",
    "container_upload",
];

/// The beginnings of the server tools' `type`s (`web_search_20250305`,
/// `bash_20250124`, ...): a tool of any other type than these and
/// `custom` is refused.
const SERVER_TOOL_PREFIXES: &[&str] = &[
    "web_search_",
    "web_fetch_",
    "code_execution_",
    "bash_",
    "text_editor_",
    "computer_",
    "memory_",
    "tool_search_tool_",
    "mcp_toolset",
];

/// What a thinking `signature` is sealed for (see [`super::seal`]).
pub(crate) const THINKING_SEAL: &str = "anthropic thinking";

/// The smallest `thinking.budget_tokens` Anthropic takes.
const MIN_THINKING_BUDGET: u64 = 1024;

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
    let max_tokens = match kind {
        Kind::Messages => Some(check_max_tokens(object.get("max_tokens"))?),
        Kind::CountTokens => None,
    };
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
    for field in [
        "metadata",
        "output_config",
        "context_management",
        "container",
    ] {
        if let Some(value) = object.get(field)
            && !value.is_object()
            && !(field == "container" && value.is_string())
        {
            return Err(format!("{field}: Input should be a valid dictionary"));
        }
    }
    if let Some(servers) = object.get("mcp_servers")
        && !servers.is_array()
    {
        return Err("mcp_servers: Input should be a valid list".into());
    }
    if let Some(tier) = object.get("service_tier")
        && !matches!(tier.as_str(), Some("auto" | "standard_only"))
    {
        return Err("service_tier: Input should be 'auto' or 'standard_only'".into());
    }
    let thinking = match object.get("thinking") {
        None => false,
        Some(thinking) => check_thinking(thinking, max_tokens)?,
    };
    let tools = match object.get("tools") {
        None => &[][..],
        Some(tools) => check_tools(tools)?,
    };
    if let Some(choice) = object.get("tool_choice") {
        check_tool_choice(choice, tools)?;
        let forced = matches!(
            choice.get("type").and_then(Value::as_str),
            Some("any" | "tool")
        );
        if thinking && forced {
            return Err("Thinking may not be enabled when tool_choice forces tool use.".into());
        }
    }
    Ok(())
}

fn required(field: &str) -> String {
    format!("{field}: Field required")
}

fn check_max_tokens(max_tokens: Option<&Value>) -> Result<u64, String> {
    match max_tokens {
        None => Err(required("max_tokens")),
        Some(value) => match value.as_u64() {
            Some(n) if n >= 1 => Ok(n),
            _ if value.is_i64() || value.is_u64() => {
                Err("max_tokens: Input should be greater than or equal to 1".into())
            }
            _ => Err("max_tokens: Input should be a valid integer".into()),
        },
    }
}

/// The `thinking` field checked; true when it turns thinking on
/// (`enabled` or `adaptive`).
fn check_thinking(thinking: &Value, max_tokens: Option<u64>) -> Result<bool, String> {
    let Some(thinking) = thinking.as_object() else {
        return Err("thinking: Input should be a valid dictionary".into());
    };
    if let Some(display) = thinking.get("display")
        && !matches!(display.as_str(), Some("summarized" | "omitted"))
    {
        return Err("thinking.display: Input should be 'summarized' or 'omitted'".into());
    }
    match thinking.get("type").and_then(Value::as_str) {
        None => Err(required("thinking.type")),
        Some("disabled") => Ok(false),
        Some("adaptive") => Ok(true),
        Some("enabled") => {
            let budget = match thinking.get("budget_tokens") {
                None => return Err(required("thinking.enabled.budget_tokens")),
                Some(budget) => budget.as_u64().ok_or_else(|| {
                    "thinking.enabled.budget_tokens: Input should be a valid integer".to_owned()
                })?,
            };
            if budget < MIN_THINKING_BUDGET {
                return Err(format!(
                    "thinking.enabled.budget_tokens: Input should be greater than or equal to \
                     {MIN_THINKING_BUDGET}"
                ));
            }
            if max_tokens.is_some_and(|max| budget >= max) {
                return Err("`max_tokens` must be greater than `thinking.budget_tokens`. \
                            Please consult our documentation at \
                            https://docs.claude.com/en/docs/build-with-claude/extended-thinking#max-tokens-and-context-window-size"
                    .into());
            }
            Ok(true)
        }
        Some(other) => Err(format!(
            "thinking: Input tag '{other}' found using 'type' does not match any of the \
             expected tags: 'enabled', 'disabled', 'adaptive'"
        )),
    }
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
        if let Some(extra) = message
            .keys()
            .find(|k| !MESSAGE_FIELDS.contains(&k.as_str()))
        {
            return Err(format!(
                "messages.{i}.{extra}: Extra inputs are not permitted"
            ));
        }
        if let Some(config) = message.get("output_config")
            && !config.is_object()
        {
            return Err(format!(
                "messages.{i}.output_config: Input should be a valid dictionary"
            ));
        }
        match message.get("role").and_then(Value::as_str) {
            None if message.get("role").is_none() => {
                return Err(required(&format!("messages.{i}.role")));
            }
            Some("user" | "assistant" | "system") => {}
            _ => {
                return Err(format!(
                    "messages.{i}.role: Input should be 'user', 'assistant' or 'system'"
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
    let fields = Fields { block, at };
    match kind {
        "text" => fields.string("text"),
        "image" | "document" => check_source(block, at, kind),
        "tool_use" | "server_tool_use" | "mcp_tool_use" => {
            fields.string("id")?;
            fields.string("name")?;
            fields.object("input")
        }
        "tool_result" | "mcp_tool_result" => {
            fields.string("tool_use_id")?;
            match block.get("content") {
                None | Some(Value::String(_)) => Ok(()),
                Some(Value::Array(parts)) => parts
                    .iter()
                    .enumerate()
                    .try_for_each(|(k, part)| check_block(part, &format!("{at}.content.{k}"))),
                Some(_) => Err(format!(
                    "{at}.content: Input should be a valid string or list of content blocks"
                )),
            }
        }
        "thinking" => {
            fields.string("thinking")?;
            fields.string("signature")?;
            check_signature(block, at)
        }
        "redacted_thinking" => fields.string("data"),
        "web_search_tool_result" => {
            fields.string("tool_use_id")?;
            match block.get("content") {
                Some(Value::Array(_) | Value::Object(_)) => Ok(()),
                None => Err(required(&format!("{at}.content"))),
                Some(_) => Err(format!("{at}.content: Input should be a valid list")),
            }
        }
        "search_result" => {
            fields.string("source")?;
            fields.string("title")?;
            match block.get("content") {
                Some(Value::Array(_)) => Ok(()),
                None => Err(required(&format!("{at}.content"))),
                Some(_) => Err(format!("{at}.content: Input should be a valid list")),
            }
        }
        known if BLOCK_TYPES.contains(&known) => Ok(()),
        other => Err(format!(
            "{at}: Input tag '{other}' found using 'type' does not match any of the expected tags"
        )),
    }
}

/// The fields of one block, checked by type.
struct Fields<'a> {
    block: &'a Value,
    at: &'a str,
}

impl Fields<'_> {
    fn string(&self, field: &str) -> Result<(), String> {
        match self.block.get(field) {
            Some(Value::String(_)) => Ok(()),
            None => Err(required(&format!("{}.{field}", self.at))),
            Some(_) => Err(format!(
                "{}.{field}: Input should be a valid string",
                self.at
            )),
        }
    }

    fn object(&self, field: &str) -> Result<(), String> {
        match self.block.get(field) {
            Some(Value::Object(_)) => Ok(()),
            None => Err(required(&format!("{}.{field}", self.at))),
            Some(_) => Err(format!(
                "{}.{field}: Input should be a valid dictionary",
                self.at
            )),
        }
    }
}

/// An image's or a document's `source`: `base64` (`media_type`, `data`),
/// `url` (`url`), `file` (`file_id`), and for documents `text` (`data`)
/// and `content` (blocks).
fn check_source(block: &Value, at: &str, kind: &str) -> Result<(), String> {
    let Some(source) = block.get("source") else {
        return Err(required(&format!("{at}.source")));
    };
    let fields = Fields {
        block: source,
        at: &format!("{at}.source"),
    };
    match source.get("type").and_then(Value::as_str) {
        Some("base64") => {
            fields.string("media_type")?;
            fields.string("data")
        }
        Some("url") => fields.string("url"),
        Some("file") => fields.string("file_id"),
        Some("text") if kind == "document" => fields.string("data"),
        Some("content") if kind == "document" => Ok(()),
        _ => Err(format!(
            "{at}.source: Input tag found using 'type' does not match any of the expected tags"
        )),
    }
}

/// A replayed thinking block must carry a signature the mock made for the
/// same thinking (or for a thinking shown empty, as `display: "omitted"`
/// shows it), as Anthropic refuses a tampered one.
fn check_signature(block: &Value, at: &str) -> Result<(), String> {
    let thinking = block.get("thinking").and_then(Value::as_str);
    let signed = block
        .get("signature")
        .and_then(Value::as_str)
        .and_then(|signature| seal::open(THINKING_SEAL, signature));
    match (thinking, signed) {
        (Some(thinking), Some(signed)) if thinking.is_empty() || thinking == signed => Ok(()),
        _ => Err(format!("{at}: Invalid `signature` in `thinking` block")),
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

/// True for a custom tool (no `type`, or `custom`).
fn is_custom(tool: &Map<String, Value>) -> bool {
    matches!(
        tool.get("type").and_then(Value::as_str),
        None | Some("custom")
    )
}

/// The tools, checked: a custom tool (no `type`, or `custom`) has a
/// non-empty `name` and an `input_schema` object; a server tool (a type of
/// [`SERVER_TOOL_PREFIXES`]) is taken as it is; any other type is refused.
fn check_tools(tools: &Value) -> Result<&[Value], String> {
    let Some(list) = tools.as_array() else {
        return Err("tools: Input should be a valid list".into());
    };
    for (i, tool) in list.iter().enumerate() {
        let Some(tool) = tool.as_object() else {
            return Err(format!("tools.{i}: Input should be a valid dictionary"));
        };
        if !is_custom(tool) {
            let kind = tool.get("type").and_then(Value::as_str).unwrap_or_default();
            if SERVER_TOOL_PREFIXES.iter().any(|p| kind.starts_with(p)) {
                continue;
            }
            return Err(format!(
                "tools.{i}: Input tag '{kind}' found using 'type' does not match any of the \
                 expected tags"
            ));
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

/// What a request asks of the reply besides its text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Asks {
    /// Thinking on (`enabled` or `adaptive`).
    pub(crate) thinking: bool,
    /// Thinking on, shown empty (`display: "omitted"`).
    pub(crate) thinking_omitted: bool,
    /// A server web search tool offered (`web_search_*`).
    pub(crate) web_search: bool,
}

impl Asks {
    pub(crate) fn of(request: &Value) -> Asks {
        let thinking_type = request.pointer("/thinking/type").and_then(Value::as_str);
        let thinking = matches!(thinking_type, Some("enabled" | "adaptive"));
        let web_search = request
            .get("tools")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|tool| tool.get("type").and_then(Value::as_str))
            .any(|kind| kind.starts_with("web_search_"));
        Asks {
            thinking,
            thinking_omitted: thinking
                && request.pointer("/thinking/display").and_then(Value::as_str) == Some("omitted"),
            web_search,
        }
    }
}

/// The text of the last `user` message.
pub(crate) fn last_user_text(request: &Value) -> String {
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

/// The request's input tokens: the characters of the system text, of
/// every message's text (as [`content_text`] reads it, plus each
/// `tool_use` input's JSON) and of every tool definition's JSON, divided
/// by four, at least 1.
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
