//! Anthropic's Messages API (`POST /v1/messages`) served through idem's chat
//! completions core.
//!
//! idem's core only speaks OpenAI chat completions, so this module is a pair
//! of translations around it: [`to_chat`] checks an Anthropic Messages request
//! and turns it into a chat completions request; the core answers with a chat
//! completion (one JSON object, or a stream of `chat.completion.chunk`
//! objects); [`message_from_completion`], [`StreamTranslator`] and
//! [`stream_from_completion`] render that answer as an Anthropic `message`
//! object or as Anthropic's streamed event sequence. [`error_body`] and
//! [`error_kind`] give errors Anthropic's shape.
//!
//! Top-level request fields fall into four groups:
//!
//! * **Translated:** `model` (kept as the client sent it), `max_tokens`,
//!   `messages`, `system` (a leading system message), `temperature`,
//!   `top_p`, `stop_sequences` (as `stop`), `tools`, `tool_choice` (with
//!   `disable_parallel_tool_use` as `parallel_tool_calls: false`), `stream`
//!   (`true` becomes chat `stream: true`; `stream_options` is never set here)
//!   and `metadata.user_id` (as `user`).
//! * **Dropped as noise**, because they change neither the question nor the
//!   answer: the rest of `metadata`, `service_tier`, a `thinking` of type
//!   `disabled` (the same as no `thinking`), and `cache_control` wherever it
//!   appears (it changes cost, not the answer).
//! * **Refused** with a 400, because chat completions has no way to say them
//!   and silently dropping them would change the answer: `top_k`, `thinking`
//!   (enabled), `mcp_servers` (non-empty), `container`, server tools (a tool
//!   whose `type` is not `custom`), and content blocks other than `text`,
//!   `image`, `tool_use` and `tool_result` (`document`, `thinking`,
//!   `redacted_thinking`, `server_tool_use`, `search_result`, ...).
//! * **Passed through unchanged:** any other top-level field, so it counts
//!   in idem's fingerprint and the OpenAI-compatible target decides whether
//!   to accept it. A translated field of the same name wins over it.
//!
//! A field whose value is JSON `null` is treated as absent everywhere.

use bytes::Bytes;
use serde_json::{Map, Value, json};

/// The key under which the chat request of a Messages request keeps the
/// client's own request ([`original`]): an Anthropic target is sent that
/// request as the client wrote it (every field and block, `cache_control`
/// included, with the target's model), not the translation; any other
/// target gets the translation, without this key. Being in the chat
/// request, it counts in the fingerprint.
pub const ORIGINAL: &str = "idem_anthropic_request";

/// What [`ORIGINAL`] keeps of a Messages request: all of it but its noise
/// (`stream`, `metadata`, `service_tier`) and its `model` (the route's
/// name, which the chat request carries and a target replaces), so that it
/// changes the fingerprint only by what changes the answer.
pub fn original(request: &Map<String, Value>) -> Value {
    let mut kept = request.clone();
    for noise in ["stream", "metadata", "service_tier", "model"] {
        kept.remove(noise);
    }
    Value::Object(kept)
}

pub use super::Refusal;

/// A checked Messages request translated to chat.
#[derive(Debug, Clone, PartialEq)]
pub struct Translated {
    /// The chat completions request body: `model` (as the client sent it),
    /// `messages`, `max_tokens`, sampling fields, `stop`, `tools`,
    /// `tool_choice`, `parallel_tool_calls`, `stream`, `user`, plus any
    /// passed-through unknown fields. `stream_options` is never set: asking
    /// for usage chunks is the core's business.
    pub chat: Map<String, Value>,
    /// The model name the client asked for.
    pub model: String,
    /// Whether the client asked for Anthropic's event stream.
    pub stream: bool,
}

/// The Anthropic fields this module understands at the top level; every
/// other field is passed through to chat unchanged.
const KNOWN_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "messages",
    "system",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "tools",
    "tool_choice",
    "stream",
    "metadata",
    "service_tier",
    "thinking",
    "mcp_servers",
    "container",
];

use super::{PIECE_BYTES, pieces};

/// Returns the field's value, treating JSON `null` as absent.
fn field<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

/// Checks an Anthropic Messages request and translates it to a chat
/// completions request.
///
/// The chat `messages` are built as follows, so the same Anthropic request
/// always gives the same chat request (and so the same idem fingerprint):
///
/// * `system` (a string, or text blocks joined with `"\n\n"`) becomes one
///   leading `system` message with string content; an empty one is omitted.
/// * A turn whose content is a string keeps it as a string.
/// * In a block list, `text` and `image` blocks become chat content parts;
///   when the result is exactly one text part, it becomes a plain string
///   (the form every OpenAI-compatible server accepts). Images become
///   `image_url` parts: base64 sources as `data:` URLs, url sources as is.
/// * `tool_result` blocks (user turns) become `tool` messages placed before
///   the rest of that turn, because chat requires tool answers right after
///   the assistant message that called the tools. Their content is a string
///   (text blocks joined with `"\n\n"`); `is_error: true` prefixes it with
///   `"Error: "`, as chat has no error flag and the model should still know.
/// * `tool_use` blocks (assistant turns) become `tool_calls`, their `input`
///   serialized as the JSON `arguments` string. The turn's text comes first
///   (chat cannot interleave text and calls); with no text, content is null.
/// * A final assistant turn with an empty block list is dropped (an empty
///   prefill asks for nothing); an empty block list elsewhere is refused,
///   as Anthropic refuses it.
pub fn to_chat(request: &Map<String, Value>) -> Result<Translated, Refusal> {
    let model = match field(request, "model") {
        None => return Err(Refusal::at("model", "`model` is required")),
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(_) => {
            return Err(Refusal::at("model", "`model` must be a non-empty string"));
        }
    };
    let max_tokens = match field(request, "max_tokens") {
        None => return Err(Refusal::at("max_tokens", "`max_tokens` is required")),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => n,
            _ => {
                return Err(Refusal::at(
                    "max_tokens",
                    "`max_tokens` must be a positive integer",
                ));
            }
        },
    };
    let turns = match field(request, "messages") {
        None => return Err(Refusal::at("messages", "`messages` is required")),
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => {
            return Err(Refusal::at("messages", "`messages` must not be empty"));
        }
        Some(_) => return Err(Refusal::at("messages", "`messages` must be an array")),
    };
    refuse_untranslatable(request)?;

    let mut chat = Map::new();
    // Unknown fields first, so that a translated field of the same name wins.
    for (key, value) in request {
        if !KNOWN_FIELDS.contains(&key.as_str()) {
            chat.insert(key.clone(), value.clone());
        }
    }

    let mut messages = Vec::new();
    if let Some(system) = system_text(request)? {
        messages.push(json!({"role": "system", "content": system}));
    }
    let last = turns.len() - 1;
    for (i, turn) in turns.iter().enumerate() {
        translate_turn(turn, i, i == last, &mut messages)?;
    }

    chat.insert("model".into(), Value::String(model.clone()));
    chat.insert("messages".into(), Value::Array(messages));
    chat.insert("max_tokens".into(), Value::from(max_tokens));
    for key in ["temperature", "top_p"] {
        if let Some(v) = field(request, key) {
            match v.as_f64() {
                Some(x) if (0.0..=1.0).contains(&x) => {
                    chat.insert(key.into(), v.clone());
                }
                _ => {
                    return Err(Refusal::at(
                        key,
                        format!("`{key}` must be a number between 0 and 1"),
                    ));
                }
            }
        }
    }
    if let Some(stop) = stop_sequences(request)? {
        chat.insert("stop".into(), stop);
    }
    if let Some(tools) = field(request, "tools") {
        let tools = translate_tools(tools)?;
        // Some OpenAI-compatible servers reject an empty `tools` array, and an
        // empty list offers the model nothing, so it is left out.
        if !tools.is_empty() {
            chat.insert("tools".into(), Value::Array(tools));
        }
    }
    if let Some(choice) = field(request, "tool_choice") {
        let (choice, parallel) = translate_tool_choice(choice)?;
        chat.insert("tool_choice".into(), choice);
        if !parallel {
            chat.insert("parallel_tool_calls".into(), Value::Bool(false));
        }
    }
    let stream = match field(request, "stream") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(Refusal::at("stream", "`stream` must be a boolean")),
    };
    if stream {
        chat.insert("stream".into(), Value::Bool(true));
    }
    match field(request, "metadata") {
        None => {}
        Some(Value::Object(meta)) => match field(meta, "user_id") {
            None => {}
            Some(Value::String(user)) => {
                chat.insert("user".into(), Value::String(user.clone()));
            }
            Some(_) => {
                return Err(Refusal::at(
                    "metadata.user_id",
                    "`metadata.user_id` must be a string",
                ));
            }
        },
        Some(_) => return Err(Refusal::at("metadata", "`metadata` must be an object")),
    }

    Ok(Translated {
        chat,
        model,
        stream,
    })
}

/// Refuses the top-level fields that change the answer but have no chat
/// completions equivalent.
fn refuse_untranslatable(request: &Map<String, Value>) -> Result<(), Refusal> {
    if field(request, "top_k").is_some() {
        return Err(Refusal::at(
            "top_k",
            "`top_k` cannot be translated to an OpenAI-compatible target",
        ));
    }
    if let Some(thinking) = field(request, "thinking") {
        let disabled = thinking.get("type").and_then(Value::as_str) == Some("disabled");
        if !disabled {
            return Err(Refusal::at(
                "thinking",
                "extended `thinking` cannot be translated to an OpenAI-compatible target",
            ));
        }
    }
    if let Some(servers) = field(request, "mcp_servers") {
        let empty = servers.as_array().is_some_and(Vec::is_empty);
        if !empty {
            return Err(Refusal::at(
                "mcp_servers",
                "`mcp_servers` cannot be translated to an OpenAI-compatible target",
            ));
        }
    }
    if field(request, "container").is_some() {
        return Err(Refusal::at(
            "container",
            "`container` cannot be translated to an OpenAI-compatible target",
        ));
    }
    Ok(())
}

/// The system prompt as one string, or `None` when absent or empty.
fn system_text(request: &Map<String, Value>) -> Result<Option<String>, Refusal> {
    let text = match field(request, "system") {
        None => return Ok(None),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (j, block) in blocks.iter().enumerate() {
                texts.push(text_of_block(block, &format!("system.{j}"))?);
            }
            texts.join("\n\n")
        }
        Some(_) => {
            return Err(Refusal::at(
                "system",
                "`system` must be a string or an array of text blocks",
            ));
        }
    };
    Ok(if text.is_empty() { None } else { Some(text) })
}

/// The text of a block that must be a `text` block (system prompt and tool
/// result content).
fn text_of_block(block: &Value, path: &str) -> Result<String, Refusal> {
    let obj = block
        .as_object()
        .ok_or_else(|| Refusal::at(path, format!("`{path}` must be an object")))?;
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => {}
        Some(other) => {
            return Err(Refusal::at(
                format!("{path}.type"),
                format!("only `text` blocks are accepted here, not `{other}`"),
            ));
        }
        None => {
            return Err(Refusal::at(
                format!("{path}.type"),
                "a content block needs a string `type`",
            ));
        }
    }
    match obj.get("text") {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(Refusal::at(
            format!("{path}.text"),
            "a `text` block needs a string `text`",
        )),
    }
}

/// Translates one Anthropic turn into one or more chat messages.
fn translate_turn(
    turn: &Value,
    i: usize,
    is_last: bool,
    out: &mut Vec<Value>,
) -> Result<(), Refusal> {
    let path = format!("messages.{i}");
    let obj = turn
        .as_object()
        .ok_or_else(|| Refusal::at(&path, format!("`{path}` must be an object")))?;
    let role = match obj.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(Refusal::at(
                format!("{path}.role"),
                "`role` must be \"user\" or \"assistant\"",
            ));
        }
    };
    let blocks = match field(obj, "content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => {
            return Err(Refusal::at(
                format!("{path}.content"),
                "`content` must be a string or an array of content blocks",
            ));
        }
    };
    if blocks.is_empty() {
        if role == "assistant" && is_last {
            return Ok(());
        }
        return Err(Refusal::at(
            format!("{path}.content"),
            "`content` must not be empty, except in a final assistant turn",
        ));
    }
    if role == "user" {
        user_blocks(blocks, &path, out)
    } else {
        assistant_blocks(blocks, &path, out)
    }
}

/// The `type` of a content block, or a refusal naming its path.
fn block_type<'a>(block: &'a Value, path: &str) -> Result<&'a Map<String, Value>, Refusal> {
    let obj = block
        .as_object()
        .ok_or_else(|| Refusal::at(path, format!("`{path}` must be an object")))?;
    if obj.get("type").and_then(Value::as_str).is_none() {
        return Err(Refusal::at(
            format!("{path}.type"),
            "a content block needs a string `type`",
        ));
    }
    Ok(obj)
}

/// The refusal for a block type that chat completions cannot carry.
fn unsupported_block(kind: &str, path: &str) -> Refusal {
    Refusal::at(
        format!("{path}.type"),
        format!(
            "content blocks of type `{kind}` cannot be translated to an OpenAI-compatible target"
        ),
    )
}

/// A user turn: tool results first (as `tool` messages), then the rest.
fn user_blocks(blocks: &[Value], path: &str, out: &mut Vec<Value>) -> Result<(), Refusal> {
    let mut tool_messages = Vec::new();
    let mut parts = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let bpath = format!("{path}.content.{j}");
        let obj = block_type(block, &bpath)?;
        match obj.get("type").and_then(Value::as_str).unwrap_or_default() {
            "text" => parts.push(text_part(obj, &bpath)?),
            "image" => parts.push(image_part(obj, &bpath)?),
            "tool_result" => tool_messages.push(tool_message(obj, &bpath)?),
            "tool_use" => {
                return Err(Refusal::at(
                    format!("{bpath}.type"),
                    "`tool_use` blocks belong in assistant turns",
                ));
            }
            other => return Err(unsupported_block(other, &bpath)),
        }
    }
    out.extend(tool_messages);
    if !parts.is_empty() {
        out.push(json!({"role": "user", "content": parts_content(parts)}));
    }
    Ok(())
}

/// An assistant turn: its text as content, its `tool_use` blocks as calls.
fn assistant_blocks(blocks: &[Value], path: &str, out: &mut Vec<Value>) -> Result<(), Refusal> {
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let bpath = format!("{path}.content.{j}");
        let obj = block_type(block, &bpath)?;
        match obj.get("type").and_then(Value::as_str).unwrap_or_default() {
            "text" => parts.push(text_part(obj, &bpath)?),
            "tool_use" => calls.push(tool_call(obj, &bpath)?),
            kind @ ("image" | "tool_result") => {
                return Err(Refusal::at(
                    format!("{bpath}.type"),
                    format!("`{kind}` blocks belong in user turns"),
                ));
            }
            other => return Err(unsupported_block(other, &bpath)),
        }
    }
    let mut message = Map::new();
    message.insert("role".into(), "assistant".into());
    let content = if parts.is_empty() {
        Value::Null
    } else {
        parts_content(parts)
    };
    message.insert("content".into(), content);
    if !calls.is_empty() {
        message.insert("tool_calls".into(), Value::Array(calls));
    }
    out.push(Value::Object(message));
    Ok(())
}

/// Content parts as chat content: one text part becomes a plain string.
fn parts_content(mut parts: Vec<Value>) -> Value {
    if parts.len() == 1
        && parts[0].get("type").and_then(Value::as_str) == Some("text")
        && let Some(text) = parts[0].get_mut("text")
    {
        return text.take();
    }
    Value::Array(parts)
}

/// A `text` block as a chat text part (`cache_control` and `citations`
/// dropped: they do not change what the model reads).
fn text_part(obj: &Map<String, Value>, path: &str) -> Result<Value, Refusal> {
    match obj.get("text") {
        Some(Value::String(s)) => Ok(json!({"type": "text", "text": s})),
        _ => Err(Refusal::at(
            format!("{path}.text"),
            "a `text` block needs a string `text`",
        )),
    }
}

/// An `image` block as a chat `image_url` part.
fn image_part(obj: &Map<String, Value>, path: &str) -> Result<Value, Refusal> {
    let source = obj
        .get("source")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            Refusal::at(
                format!("{path}.source"),
                "an `image` block needs a `source` object",
            )
        })?;
    let string_at = |key: &str| -> Result<&str, Refusal> {
        source.get(key).and_then(Value::as_str).ok_or_else(|| {
            Refusal::at(
                format!("{path}.source.{key}"),
                format!("the image source needs a string `{key}`"),
            )
        })
    };
    let url = match source.get("type").and_then(Value::as_str) {
        Some("base64") => {
            let media_type = string_at("media_type")?;
            let data = string_at("data")?;
            format!("data:{media_type};base64,{data}")
        }
        Some("url") => string_at("url")?.to_owned(),
        Some(other) => {
            return Err(Refusal::at(
                format!("{path}.source.type"),
                format!(
                    "image sources of type `{other}` cannot be translated to an OpenAI-compatible target"
                ),
            ));
        }
        None => {
            return Err(Refusal::at(
                format!("{path}.source.type"),
                "the image source needs a string `type`",
            ));
        }
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

/// A `tool_result` block as a chat `tool` message.
fn tool_message(obj: &Map<String, Value>, path: &str) -> Result<Value, Refusal> {
    let id = obj
        .get("tool_use_id")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            Refusal::at(
                format!("{path}.tool_use_id"),
                "a `tool_result` block needs a string `tool_use_id`",
            )
        })?;
    let mut text = match field(obj, "content") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (k, block) in blocks.iter().enumerate() {
                texts.push(text_of_block(block, &format!("{path}.content.{k}"))?);
            }
            texts.join("\n\n")
        }
        Some(_) => {
            return Err(Refusal::at(
                format!("{path}.content"),
                "`tool_result` content must be a string or an array of text blocks",
            ));
        }
    };
    match field(obj, "is_error") {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => text.insert_str(0, "Error: "),
        Some(_) => {
            return Err(Refusal::at(
                format!("{path}.is_error"),
                "`is_error` must be a boolean",
            ));
        }
    }
    Ok(json!({"role": "tool", "tool_call_id": id, "content": text}))
}

/// A `tool_use` block as a chat tool call.
fn tool_call(obj: &Map<String, Value>, path: &str) -> Result<Value, Refusal> {
    let string_at = |key: &str| -> Result<&str, Refusal> {
        obj.get(key).and_then(Value::as_str).ok_or_else(|| {
            Refusal::at(
                format!("{path}.{key}"),
                format!("a `tool_use` block needs a string `{key}`"),
            )
        })
    };
    let id = string_at("id")?;
    let name = string_at("name")?;
    let input = match obj.get("input") {
        Some(v @ Value::Object(_)) => v.to_string(),
        _ => {
            return Err(Refusal::at(
                format!("{path}.input"),
                "a `tool_use` block needs an object `input`",
            ));
        }
    };
    Ok(json!({
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": input},
    }))
}

/// `stop_sequences` as chat `stop`, or `None` when absent or empty.
fn stop_sequences(request: &Map<String, Value>) -> Result<Option<Value>, Refusal> {
    let Some(value) = field(request, "stop_sequences") else {
        return Ok(None);
    };
    let list = value.as_array().ok_or_else(|| {
        Refusal::at(
            "stop_sequences",
            "`stop_sequences` must be an array of strings",
        )
    })?;
    for (i, item) in list.iter().enumerate() {
        if !item.is_string() {
            return Err(Refusal::at(
                format!("stop_sequences.{i}"),
                "`stop_sequences` must be an array of strings",
            ));
        }
    }
    Ok(if list.is_empty() {
        None
    } else {
        Some(value.clone())
    })
}

/// Anthropic tool definitions as chat function tools.
fn translate_tools(tools: &Value) -> Result<Vec<Value>, Refusal> {
    let list = tools
        .as_array()
        .ok_or_else(|| Refusal::at("tools", "`tools` must be an array"))?;
    let mut out = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let path = format!("tools.{i}");
        let obj = tool
            .as_object()
            .ok_or_else(|| Refusal::at(&path, format!("`{path}` must be an object")))?;
        match field(obj, "type") {
            None => {}
            Some(Value::String(t)) if t == "custom" => {}
            Some(other) => {
                let name = other.as_str().unwrap_or("?");
                return Err(Refusal::at(
                    format!("{path}.type"),
                    format!(
                        "server tool `{name}` cannot be translated to an OpenAI-compatible target"
                    ),
                ));
            }
        }
        let name = obj
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| Refusal::at(format!("{path}.name"), "a tool needs a string `name`"))?;
        let schema = match obj.get("input_schema") {
            Some(v @ Value::Object(_)) => v.clone(),
            _ => {
                return Err(Refusal::at(
                    format!("{path}.input_schema"),
                    "a tool needs an object `input_schema`",
                ));
            }
        };
        let mut function = Map::new();
        function.insert("name".into(), name.into());
        match field(obj, "description") {
            None => {}
            Some(d @ Value::String(_)) => {
                function.insert("description".into(), d.clone());
            }
            Some(_) => {
                return Err(Refusal::at(
                    format!("{path}.description"),
                    "a tool's `description` must be a string",
                ));
            }
        }
        function.insert("parameters".into(), schema);
        // `strict` means the same on both sides: arguments must match the schema.
        if let Some(strict @ Value::Bool(_)) = field(obj, "strict") {
            function.insert("strict".into(), strict.clone());
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(out)
}

/// Anthropic `tool_choice` as chat `tool_choice`, and whether parallel tool
/// calls stay allowed.
fn translate_tool_choice(choice: &Value) -> Result<(Value, bool), Refusal> {
    let obj = choice
        .as_object()
        .ok_or_else(|| Refusal::at("tool_choice", "`tool_choice` must be an object"))?;
    let parallel = match field(obj, "disable_parallel_tool_use") {
        None => true,
        Some(Value::Bool(disable)) => !disable,
        Some(_) => {
            return Err(Refusal::at(
                "tool_choice.disable_parallel_tool_use",
                "`disable_parallel_tool_use` must be a boolean",
            ));
        }
    };
    let translated = match obj.get("type").and_then(Value::as_str) {
        Some("auto") => Value::from("auto"),
        Some("any") => Value::from("required"),
        // With no tool to call, parallelism means nothing.
        Some("none") => return Ok((Value::from("none"), true)),
        Some("tool") => {
            let name = obj.get("name").and_then(Value::as_str).ok_or_else(|| {
                Refusal::at(
                    "tool_choice.name",
                    "`tool_choice` of type `tool` needs a string `name`",
                )
            })?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(Refusal::at(
                "tool_choice.type",
                "`tool_choice.type` must be one of \"auto\", \"any\", \"tool\", \"none\"",
            ));
        }
    };
    Ok((translated, parallel))
}

// ---------------------------------------------------------------------------
// Answer translation (chat -> Anthropic)
// ---------------------------------------------------------------------------

/// Token counts in Anthropic's terms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Usage {
    /// Prompt tokens not read from the cache (Anthropic's `input_tokens`
    /// excludes cache reads).
    input: u64,
    output: u64,
    cache_read: u64,
}

impl Usage {
    /// Reads a chat `usage` object; `None` when there is none.
    fn from_chat(usage: Option<&Value>) -> Option<Usage> {
        let usage = usage.filter(|u| u.is_object())?;
        let number = |v: Option<&Value>| v.and_then(Value::as_u64).unwrap_or(0);
        let prompt = number(usage.get("prompt_tokens"));
        let cached = number(usage.pointer("/prompt_tokens_details/cached_tokens"));
        Some(Usage {
            input: prompt.saturating_sub(cached),
            output: number(usage.get("completion_tokens")),
            cache_read: cached,
        })
    }

    fn to_json(self) -> Value {
        let mut map = Map::new();
        map.insert("input_tokens".into(), self.input.into());
        map.insert("output_tokens".into(), self.output.into());
        if self.cache_read > 0 {
            map.insert("cache_read_input_tokens".into(), self.cache_read.into());
        }
        Value::Object(map)
    }
}

/// The Anthropic message id for a chat completion id: `msg_` followed by the
/// completion id without its `chatcmpl-` prefix, so the same completion
/// always gets the same message id.
fn message_id(completion_id: Option<&str>) -> String {
    let id = completion_id.unwrap_or_default();
    format!("msg_{}", id.strip_prefix("chatcmpl-").unwrap_or(id))
}

/// The id given to a tool call that arrived without one, derived from the
/// message id and the call's chat index so it is stable across replays.
fn fallback_tool_id(message_id: &str, index: u64) -> String {
    let suffix = message_id.strip_prefix("msg_").unwrap_or(message_id);
    format!("toolu_{suffix}_{index}")
}

/// Anthropic's `stop_reason` for a chat `finish_reason`. Chat never says
/// which stop sequence matched, so `stop_sequence` stays null and a stop on
/// a sequence reads as `end_turn`.
fn stop_reason(finish_reason: Option<&str>) -> &'static str {
    match finish_reason {
        Some("length") => "max_tokens",
        Some("tool_calls" | "function_call") => "tool_use",
        Some("content_filter") => "refusal",
        _ => "end_turn",
    }
}

/// The tool `input` for a chat `arguments` string: the parsed JSON object;
/// `{}` for empty arguments (what models send for a tool without
/// parameters); otherwise `{"_raw": arguments}`, so a tool runner sees the
/// malformed arguments instead of silently running with none.
fn tool_input(arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return Value::Object(Map::new());
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => json!({"_raw": arguments}),
    }
}

/// The text of a chat content value: a string, or the concatenated text of
/// content parts (some servers answer with parts).
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// What one chat completion says, in the order Anthropic shows it.
struct Answer {
    id: String,
    model: Value,
    /// The message text, or the refusal text when there is no content.
    text: String,
    /// (id, name, arguments) of each tool call.
    calls: Vec<(String, String, String)>,
    stop_reason: &'static str,
    usage: Usage,
}

impl Answer {
    fn of(completion: &Value) -> Answer {
        let id = message_id(completion.get("id").and_then(Value::as_str));
        let model = match completion.get("model") {
            Some(m @ Value::String(_)) => m.clone(),
            _ => Value::from(""),
        };
        let choice = completion.get("choices").and_then(|c| {
            c.as_array()?
                .iter()
                .find(|ch| ch.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
        });
        let message = choice.and_then(|c| c.get("message"));
        let mut text = content_text(message.and_then(|m| m.get("content")));
        if text.is_empty() {
            text = content_text(message.and_then(|m| m.get("refusal")));
        }
        let mut calls = Vec::new();
        let tool_calls = message
            .and_then(|m| m.get("tool_calls"))
            .and_then(Value::as_array);
        for (pos, call) in tool_calls.into_iter().flatten().enumerate() {
            let index = call
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(pos as u64);
            let call_id = match call.get("id").and_then(Value::as_str) {
                Some(s) if !s.is_empty() => s.to_owned(),
                _ => fallback_tool_id(&id, index),
            };
            let function = call.get("function");
            let name = function
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let arguments = function
                .and_then(|f| f.get("arguments"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            calls.push((call_id, name, arguments));
        }
        let finish = choice
            .and_then(|c| c.get("finish_reason"))
            .and_then(Value::as_str);
        Answer {
            id,
            model,
            text,
            calls,
            stop_reason: stop_reason(finish),
            usage: Usage::from_chat(completion.get("usage")).unwrap_or_default(),
        }
    }
}

/// The Anthropic `message` object for a plain chat completion (choice 0).
///
/// Content is the message text (when non-empty; a `refusal` stands in when
/// there is no content) as one `text` block, then one `tool_use` block per
/// tool call, its `input` parsed from the arguments (see `tool_input`).
/// `usage.input_tokens` excludes cached prompt tokens, which are reported as
/// `cache_read_input_tokens` when there are any, as Anthropic counts them.
pub fn message_from_completion(completion: &Value) -> Value {
    let answer = Answer::of(completion);
    let mut content = Vec::new();
    if !answer.text.is_empty() {
        content.push(json!({"type": "text", "text": answer.text}));
    }
    for (id, name, arguments) in &answer.calls {
        content.push(json!({
            "type": "tool_use",
            "id": id,
            "name": name,
            "input": tool_input(arguments),
        }));
    }
    json!({
        "id": answer.id,
        "type": "message",
        "role": "assistant",
        "model": answer.model,
        "content": content,
        "stop_reason": answer.stop_reason,
        "stop_sequence": null,
        "usage": answer.usage.to_json(),
    })
}

// ---------------------------------------------------------------------------
// Streaming
// ---------------------------------------------------------------------------

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

/// A whole chat completion rendered as the full Anthropic event stream (for
/// a cache hit or a follower asking for a stream).
///
/// It equals what [`StreamTranslator`] gives for that completion chunked the
/// canonical way: a role chunk, the text in pieces of at most 256 bytes (cut
/// on char boundaries), each tool call as a chunk with its id and name then
/// its arguments in such pieces, a finish chunk, and a usage-only chunk. So
/// `message_start` carries `input_tokens: 0` and the real counts come in
/// `message_delta`, exactly as on a live stream.
pub fn stream_from_completion(completion: &Value) -> Bytes {
    let answer = Answer::of(completion);
    let mut out = String::new();
    emit_start(&mut out, &answer.id, answer.model, 0);
    let mut index = 0;
    if !answer.text.is_empty() {
        emit_text_start(&mut out, index);
        for piece in pieces(&answer.text, PIECE_BYTES) {
            emit_text_delta(&mut out, index, piece);
        }
        emit_block_stop(&mut out, index);
        index += 1;
    }
    for (id, name, arguments) in &answer.calls {
        emit_tool_start(&mut out, index, id, name);
        for piece in pieces(arguments, PIECE_BYTES) {
            emit_json_delta(&mut out, index, piece);
        }
        emit_block_stop(&mut out, index);
        index += 1;
    }
    emit_end(&mut out, answer.stop_reason, answer.usage);
    Bytes::from(out)
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Anthropic's error body `{"type":"error","error":{"type": kind, "message": message}}`.
pub fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// The Anthropic error type for an HTTP status, as Anthropic's error
/// reference lists them. 408 joins 504 as `timeout_error` and 503 joins 529
/// as `overloaded_error`, since they mean the same to a client; other 4xx
/// are `invalid_request_error` (as Anthropic documents) and other 5xx
/// `api_error`.
pub fn error_kind(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        408 | 504 => "timeout_error",
        409 => "conflict_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            other => panic!("not an object: {other}"),
        }
    }

    fn base() -> Value {
        json!({
            "model": "claude-x",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}],
        })
    }

    fn with(mut request: Value, key: &str, value: Value) -> Map<String, Value> {
        request[key] = value;
        obj(request)
    }

    fn refusal(request: Map<String, Value>) -> Refusal {
        to_chat(&request).unwrap_err()
    }

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

    #[test]
    fn full_request_translates() {
        let request = obj(json!({
            "model": "claude-sonnet",
            "max_tokens": 512,
            "system": [
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be kind."}
            ],
            "temperature": 0.5,
            "top_p": 0.9,
            "stop_sequences": ["END"],
            "metadata": {"user_id": "u-1", "other": 1},
            "service_tier": "auto",
            "stream": true,
            "custom_knob": {"a": 1},
            "messages": [
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
                {"role": "user", "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}},
                    {"type": "image", "source": {"type": "url", "url": "https://x.test/a.jpg"}}
                ]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me check."},
                    {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "cat"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}}
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}
                    ]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "boom", "is_error": true},
                    {"type": "text", "text": "Thanks", "cache_control": {"type": "ephemeral"}}
                ]}
            ]
        }));
        let t = to_chat(&request).unwrap();
        assert_eq!(t.model, "claude-sonnet");
        assert!(t.stream);
        let expected = json!({
            "model": "claude-sonnet",
            "max_tokens": 512,
            "temperature": 0.5,
            "top_p": 0.9,
            "stop": ["END"],
            "user": "u-1",
            "stream": true,
            "custom_knob": {"a": 1},
            "messages": [
                {"role": "system", "content": "Be brief.\n\nBe kind."},
                {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi!"},
                {"role": "user", "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                    {"type": "image_url", "image_url": {"url": "https://x.test/a.jpg"}}
                ]},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\":\"cat\"}"}},
                    {"id": "toolu_2", "type": "function", "function": {"name": "now", "arguments": "{}"}}
                ]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "a\n\nb"},
                {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: boom"},
                {"role": "user", "content": "Thanks"}
            ]
        });
        assert_eq!(Value::Object(t.chat), expected);
    }

    #[test]
    fn assistant_with_only_tool_calls_has_null_content_and_final_empty_turn_is_dropped() {
        let request = with(
            base(),
            "messages",
            json!([
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": [
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": [1, 2]}}
                ]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
                {"role": "assistant", "content": []}
            ]),
        );
        let t = to_chat(&request).unwrap();
        assert_eq!(
            t.chat["messages"],
            json!([
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"x\":[1,2]}"}}
                ]},
                {"role": "tool", "tool_call_id": "t1", "content": ""}
            ])
        );
        assert!(!t.stream);
        assert!(!t.chat.contains_key("stream"));
        assert!(!t.chat.contains_key("stream_options"));
    }

    #[test]
    fn tools_and_tool_choice_variants() {
        let tools = json!([
            {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object", "properties": {}},
             "cache_control": {"type": "ephemeral"}},
            {"type": "custom", "name": "plain", "input_schema": {"type": "object"}}
        ]);
        let t = to_chat(&with(base(), "tools", tools)).unwrap();
        assert_eq!(
            t.chat["tools"],
            json!([
                {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                    "parameters": {"type": "object", "properties": {}}}},
                {"type": "function", "function": {"name": "plain", "parameters": {"type": "object"}}}
            ])
        );

        let cases = [
            (json!({"type": "auto"}), json!("auto"), None),
            (json!({"type": "any"}), json!("required"), None),
            (json!({"type": "none"}), json!("none"), None),
            (
                json!({"type": "tool", "name": "get_weather"}),
                json!({"type": "function", "function": {"name": "get_weather"}}),
                None,
            ),
            (
                json!({"type": "auto", "disable_parallel_tool_use": true}),
                json!("auto"),
                Some(json!(false)),
            ),
            (
                json!({"type": "any", "disable_parallel_tool_use": false}),
                json!("required"),
                None,
            ),
        ];
        for (choice, expected, parallel) in cases {
            let t = to_chat(&with(base(), "tool_choice", choice.clone())).unwrap();
            assert_eq!(t.chat["tool_choice"], expected, "{choice}");
            assert_eq!(
                t.chat.get("parallel_tool_calls").cloned(),
                parallel,
                "{choice}"
            );
        }

        let empty = to_chat(&with(base(), "tools", json!([]))).unwrap();
        assert!(!empty.chat.contains_key("tools"));
    }

    #[test]
    fn stop_sequences_become_stop_and_nulls_are_absent() {
        let t = to_chat(&with(base(), "stop_sequences", json!(["a", "b"]))).unwrap();
        assert_eq!(t.chat["stop"], json!(["a", "b"]));
        let t = to_chat(&with(base(), "top_k", Value::Null)).unwrap();
        assert!(!t.chat.contains_key("top_k"));
        let t = to_chat(&with(base(), "thinking", json!({"type": "disabled"}))).unwrap();
        assert!(!t.chat.contains_key("thinking"));
        let r = refusal(with(base(), "stop_sequences", json!(["a", 1])));
        assert_eq!(r.param.as_deref(), Some("stop_sequences.1"));
    }

    #[test]
    fn translated_fields_win_over_passed_through_ones() {
        let mut request = base();
        request["user"] = json!("sneaky");
        request["metadata"] = json!({"user_id": "real"});
        let t = to_chat(&obj(request)).unwrap();
        assert_eq!(t.chat["user"], "real");
    }

    #[test]
    fn refusals_name_their_param() {
        let mut missing = obj(base());
        missing.remove("max_tokens");
        let cases: Vec<(Map<String, Value>, &str)> = vec![
            (missing, "max_tokens"),
            (with(base(), "max_tokens", json!(0)), "max_tokens"),
            (with(base(), "model", json!(3)), "model"),
            (with(base(), "messages", json!([])), "messages"),
            (
                with(
                    base(),
                    "messages",
                    json!([{"role": "system", "content": "x"}]),
                ),
                "messages.0.role",
            ),
            (
                with(
                    base(),
                    "messages",
                    json!([
                        {"role": "user", "content": "q"},
                        {"role": "assistant", "content": "a"},
                        {"role": "assistant", "content": [
                            {"type": "thinking", "thinking": "hmm", "signature": "s"}
                        ]}
                    ]),
                ),
                "messages.2.content.0.type",
            ),
            (
                with(
                    base(),
                    "tools",
                    json!([
                        {"name": "ok", "input_schema": {"type": "object"}},
                        {"type": "web_search_20250305", "name": "web_search"}
                    ]),
                ),
                "tools.1.type",
            ),
            (with(base(), "top_k", json!(5)), "top_k"),
            (
                with(
                    base(),
                    "thinking",
                    json!({"type": "enabled", "budget_tokens": 1024}),
                ),
                "thinking",
            ),
            (
                with(
                    base(),
                    "messages",
                    json!([{"role": "user", "content": [
                        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
                    ]}]),
                ),
                "messages.0.content.0.type",
            ),
            (
                with(
                    base(),
                    "messages",
                    json!([{"role": "user", "content": [
                        {"type": "image", "source": {"type": "file", "file_id": "f"}}
                    ]}]),
                ),
                "messages.0.content.0.source.type",
            ),
            (
                with(base(), "messages", json!([{"role": "user", "content": []}])),
                "messages.0.content",
            ),
            (with(base(), "temperature", json!(1.5)), "temperature"),
            (
                with(base(), "tool_choice", json!({"type": "tool"})),
                "tool_choice.name",
            ),
            (
                with(base(), "mcp_servers", json!([{"url": "x"}])),
                "mcp_servers",
            ),
            (with(base(), "container", json!("c")), "container"),
        ];
        for (request, param) in cases {
            let r = refusal(request);
            assert_eq!(r.param.as_deref(), Some(param), "{}", r.message);
        }
        let r = refusal(with(base(), "top_k", json!(5)));
        assert_eq!(
            r.message,
            "`top_k` cannot be translated to an OpenAI-compatible target"
        );
        let r = refusal(with(
            base(),
            "messages",
            json!([{"role": "user", "content": [{"type": "search_result"}]}]),
        ));
        assert!(r.message.contains("search_result"), "{}", r.message);
        let r = refusal(with(
            base(),
            "tools",
            json!([{"type": "bash_20250124", "name": "bash"}]),
        ));
        assert!(r.message.contains("bash_20250124"), "{}", r.message);
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

    #[test]
    fn message_from_text_completion() {
        let c = completion(
            json!({"role": "assistant", "content": "Hello there"}),
            "stop",
            json!({"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}),
        );
        assert_eq!(
            message_from_completion(&c),
            json!({
                "id": "msg_abc123",
                "type": "message",
                "role": "assistant",
                "model": "gpt-x",
                "content": [{"type": "text", "text": "Hello there"}],
                "stop_reason": "end_turn",
                "stop_sequence": null,
                "usage": {"input_tokens": 10, "output_tokens": 3},
            })
        );
    }

    #[test]
    fn message_from_tool_call_completion() {
        let c = completion(
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}},
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": ""}},
                {"type": "function", "function": {"name": "h", "arguments": "not json"}},
                {"id": "call_4", "type": "function", "function": {"name": "k", "arguments": "[1, 2]"}}
            ]}),
            "tool_calls",
            json!({"prompt_tokens": 5, "completion_tokens": 7}),
        );
        let m = message_from_completion(&c);
        assert_eq!(m["stop_reason"], "tool_use");
        assert_eq!(
            m["content"],
            json!([
                {"type": "tool_use", "id": "call_1", "name": "f", "input": {"a": 1}},
                {"type": "tool_use", "id": "call_2", "name": "g", "input": {}},
                {"type": "tool_use", "id": "toolu_abc123_2", "name": "h", "input": {"_raw": "not json"}},
                {"type": "tool_use", "id": "call_4", "name": "k", "input": {"_raw": "[1, 2]"}}
            ])
        );
    }

    #[test]
    fn message_from_length_refusal_and_cached_usage() {
        let c = completion(
            json!({"role": "assistant", "content": "cut"}),
            "length",
            json!({"prompt_tokens": 100, "completion_tokens": 50,
                   "prompt_tokens_details": {"cached_tokens": 60}}),
        );
        let m = message_from_completion(&c);
        assert_eq!(m["stop_reason"], "max_tokens");
        assert_eq!(
            m["usage"],
            json!({"input_tokens": 40, "output_tokens": 50, "cache_read_input_tokens": 60})
        );
        let c = completion(
            json!({"role": "assistant", "content": null, "refusal": "I can't."}),
            "content_filter",
            json!({"prompt_tokens": 1, "completion_tokens": 1,
                   "prompt_tokens_details": {"cached_tokens": 0}}),
        );
        let m = message_from_completion(&c);
        assert_eq!(m["stop_reason"], "refusal");
        assert_eq!(m["content"], json!([{"type": "text", "text": "I can't."}]));
        assert_eq!(m["usage"], json!({"input_tokens": 1, "output_tokens": 1}));
    }

    #[test]
    fn stop_reasons_and_error_kinds() {
        assert_eq!(stop_reason(Some("stop")), "end_turn");
        assert_eq!(stop_reason(Some("function_call")), "tool_use");
        assert_eq!(stop_reason(None), "end_turn");
        assert_eq!(stop_reason(Some("weird")), "end_turn");
        let kinds = [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (402, "billing_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (408, "timeout_error"),
            (409, "conflict_error"),
            (413, "request_too_large"),
            (422, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (502, "api_error"),
            (503, "overloaded_error"),
            (504, "timeout_error"),
            (529, "overloaded_error"),
        ];
        for (status, kind) in kinds {
            assert_eq!(error_kind(status), kind, "{status}");
        }
        assert_eq!(
            error_body("rate_limit_error", "slow down"),
            json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}})
        );
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

    #[test]
    fn stream_from_completion_equals_live_translation() {
        let text_only = completion(
            json!({"role": "assistant", "content": "short"}),
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
            let replay = stream_from_completion(&c);
            assert_eq!(
                std::str::from_utf8(&replay).unwrap(),
                std::str::from_utf8(&live).unwrap()
            );
        }
        // The long text really was cut, on char boundaries, at most 256 bytes.
        let replay = events(&stream_from_completion(&long_completion()));
        let text_deltas: Vec<&str> = replay
            .iter()
            .filter_map(|(_, d)| d["delta"]["text"].as_str())
            .collect();
        assert!(text_deltas.len() > 1);
        assert!(text_deltas.iter().all(|p| !p.is_empty() && p.len() <= 256));
    }

    #[test]
    fn streamed_content_assembles_to_message_content() {
        let c = long_completion();
        let mut blocks: Vec<Value> = Vec::new();
        let mut partial: Vec<String> = Vec::new();
        for (event, data) in events(&stream_from_completion(&c)) {
            let index = data["index"].as_u64().map(|i| i as usize);
            match event.as_str() {
                "content_block_start" => {
                    assert_eq!(index, Some(blocks.len()));
                    blocks.push(data["content_block"].clone());
                    partial.push(String::new());
                }
                "content_block_delta" => {
                    let i = index.unwrap();
                    if let Some(t) = data["delta"]["text"].as_str() {
                        let joined = format!("{}{t}", blocks[i]["text"].as_str().unwrap());
                        blocks[i]["text"] = json!(joined);
                    } else {
                        partial[i].push_str(data["delta"]["partial_json"].as_str().unwrap());
                    }
                }
                "content_block_stop" => {
                    let i = index.unwrap();
                    if blocks[i]["type"] == "tool_use" {
                        blocks[i]["input"] = tool_input(&partial[i]);
                    }
                }
                _ => {}
            }
        }
        let message = message_from_completion(&c);
        assert_eq!(Value::Array(blocks), message["content"]);
        assert_eq!(message["content"].as_array().unwrap().len(), 3);
    }
}
