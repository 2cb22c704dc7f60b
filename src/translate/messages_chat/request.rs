//! A Messages request said in chat completions, for a target that speaks
//! chat (an OpenAI-compatible, Azure or mock provider).
//!
//! What has a meaning in chat is translated; what the target could not
//! act on and would not change the answer's meaning is left out; what has
//! no meaning there is refused, naming the field (docs/http-api.md, "What
//! becomes of each field"):
//!
//! * **Translated:** `max_tokens` (as `max_completion_tokens` for an OpenAI
//!   reasoning model), `messages`, `system` and `system` turns inside
//!   `messages` (system messages), `temperature`, `top_p`, `top_k` (the same
//!   name, which OpenAI-compatible servers such as vLLM take),
//!   `stop_sequences` (as `stop`), custom `tools`, `tool_choice` (with
//!   `disable_parallel_tool_use` as `parallel_tool_calls: false`), `stream`,
//!   `metadata.user_id` (as `user`), `thinking` and `output_config.effort`
//!   (as `reasoning_effort` for an OpenAI reasoning model, left out for
//!   others), `output_config.format` (as `response_format`); content blocks
//!   `text`, `image`, `document` (a PDF as a `file` part, a text document
//!   as text), `search_result` (as text), `tool_use`, `tool_result` (text;
//!   its images in a user message right after the tool messages).
//! * **Left out:** `service_tier`, the rest of `metadata`,
//!   `context_management`, `cache_control` and `citations` wherever they
//!   are, a `thinking` of type `disabled`, and the blocks of earlier turns
//!   that only Anthropic can read back: `thinking`, `redacted_thinking`,
//!   `server_tool_use` and `web_search_tool_result`.
//! * **Refused:** server tools (a tool whose `type` is not `custom`),
//!   `mcp_servers`, `container`, documents given by URL or file id, and
//!   block types chat has no form for.
//! * **Passed through unchanged:** any other top-level field, so the target
//!   decides whether to accept it.
//!
//! A field whose value is JSON `null` is treated as absent everywhere.

use serde_json::{Map, Value, json};

use crate::translate::Refusal;

/// The Anthropic fields this module reads at the top level; every other
/// field is passed through to chat unchanged.
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
    "output_config",
    "context_management",
    "mcp_servers",
    "container",
];

/// Returns the field's value, treating JSON `null` as absent.
fn field<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|v| !v.is_null())
}

/// True for an OpenAI model that reasons (`o1`, `o3`, `o4-mini`, the
/// `gpt-5` family): it takes `reasoning_effort`, and `max_completion_tokens`
/// instead of `max_tokens`.
pub fn is_reasoning_model(model: &str) -> bool {
    let m = model.rsplit('/').next().unwrap_or(model);
    ["o1", "o3", "o4", "gpt-5"].iter().any(|p| {
        m.strip_prefix(p)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['-', '.']))
    })
}

/// Checks a Messages request and says it in chat completions for a target
/// whose upstream model is `model`.
///
/// The chat `messages` are built as follows, so the same Anthropic request
/// always gives the same chat request:
///
/// * `system` (a string, or text blocks joined with `"\n\n"`) becomes one
///   leading `system` message; an empty one is omitted. A `system` turn
///   inside `messages` becomes a system message where it stands.
/// * A turn whose content is a string keeps it as a string.
/// * In a block list, `text`, `image`, `document` and `search_result`
///   blocks become chat content parts; exactly one text part becomes a
///   plain string.
/// * `tool_result` blocks (user turns) become `tool` messages placed before
///   the rest of that turn, because chat requires tool answers right after
///   the assistant message that called the tools. Their content is text
///   (text blocks joined with `"\n\n"`); `is_error: true` prefixes it with
///   `"Error: "`; their images follow in a user message.
/// * `tool_use` blocks (assistant turns) become `tool_calls`, their `input`
///   serialized as the JSON `arguments` string. The turn's text comes first
///   (chat cannot interleave text and calls); with no text, content is null.
/// * A final assistant turn with an empty block list is dropped (an empty
///   prefill asks for nothing); an empty block list elsewhere is refused,
///   as Anthropic refuses it.
pub fn to_chat(request: &Map<String, Value>, model: &str) -> Result<Map<String, Value>, Refusal> {
    let reasoning = is_reasoning_model(model);
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
    refuse_meaningless(request)?;

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

    if let Some(model) = field(request, "model") {
        chat.insert("model".into(), model.clone());
    }
    chat.insert("messages".into(), Value::Array(messages));
    let limit = if reasoning {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    chat.insert(limit.into(), Value::from(max_tokens));
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
    if let Some(k) = field(request, "top_k") {
        chat.insert("top_k".into(), k.clone());
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
    match field(request, "stream") {
        None | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => {
            chat.insert("stream".into(), Value::Bool(true));
        }
        Some(_) => return Err(Refusal::at("stream", "`stream` must be a boolean")),
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
    if let Some(effort) = effort(request)?
        && reasoning
    {
        chat.insert("reasoning_effort".into(), json!(effort));
    }
    if let Some(format) = field(request, "output_config").and_then(|o| o.get("format")) {
        chat.insert("response_format".into(), response_format(format)?);
    }
    Ok(chat)
}

/// The reasoning effort `thinking` or `output_config.effort` asks for:
/// a budget below 4,096 tokens is `low`, below 16,384 `medium`, else
/// `high`; adaptive thinking is `medium`; disabled thinking is none.
fn effort(request: &Map<String, Value>) -> Result<Option<&'static str>, Refusal> {
    if let Some(effort) = field(request, "output_config")
        .and_then(|o| o.get("effort"))
        .and_then(Value::as_str)
    {
        return Ok(match effort {
            "low" => Some("low"),
            "medium" => Some("medium"),
            "high" | "max" => Some("high"),
            _ => None,
        });
    }
    let Some(thinking) = field(request, "thinking") else {
        return Ok(None);
    };
    let kind = thinking.get("type").and_then(Value::as_str);
    Ok(match kind {
        Some("disabled") => None,
        Some("adaptive") => Some("medium"),
        Some("enabled") => {
            let budget = thinking
                .get("budget_tokens")
                .and_then(Value::as_u64)
                .ok_or_else(|| {
                    Refusal::at(
                        "thinking.budget_tokens",
                        "enabled `thinking` needs a whole `budget_tokens`",
                    )
                })?;
            Some(match budget {
                0..4096 => "low",
                4096..16384 => "medium",
                _ => "high",
            })
        }
        _ => {
            return Err(Refusal::at(
                "thinking.type",
                "`thinking.type` must be \"enabled\", \"adaptive\" or \"disabled\"",
            ));
        }
    })
}

/// `output_config.format` as chat's `response_format`.
fn response_format(format: &Value) -> Result<Value, Refusal> {
    match format.get("type").and_then(Value::as_str) {
        Some("json_schema") => {
            let schema = format.get("schema").cloned().unwrap_or_else(|| json!({}));
            Ok(json!({"type": "json_schema",
                "json_schema": {"name": "output", "schema": schema, "strict": true}}))
        }
        _ => Err(Refusal::at(
            "output_config.format.type",
            "only a `json_schema` output format has a form in chat completions",
        )),
    }
}

/// Refuses the top-level fields that have no meaning for a chat target.
fn refuse_meaningless(request: &Map<String, Value>) -> Result<(), Refusal> {
    if let Some(servers) = field(request, "mcp_servers") {
        let empty = servers.as_array().is_some_and(Vec::is_empty);
        if !empty {
            return Err(Refusal::at(
                "mcp_servers",
                "`mcp_servers` (MCP servers Anthropic connects to) has no form in chat completions",
            ));
        }
    }
    if field(request, "container").is_some() {
        return Err(Refusal::at(
            "container",
            "`container` (Anthropic's code execution container) has no form in chat completions",
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
        // A system turn among the messages (Claude Code sends one): a
        // system message where it stands.
        Some("system") => {
            let text = match field(obj, "content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(blocks)) => {
                    let mut texts = Vec::with_capacity(blocks.len());
                    for (j, block) in blocks.iter().enumerate() {
                        texts.push(text_of_block(block, &format!("{path}.content.{j}"))?);
                    }
                    texts.join("\n\n")
                }
                _ => {
                    return Err(Refusal::at(
                        format!("{path}.content"),
                        "a system turn's `content` must be a string or text blocks",
                    ));
                }
            };
            out.push(json!({"role": "system", "content": text}));
            return Ok(());
        }
        _ => {
            return Err(Refusal::at(
                format!("{path}.role"),
                "`role` must be \"user\", \"assistant\" or \"system\"",
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
        format!("content blocks of type `{kind}` have no form in chat completions"),
    )
}

/// Blocks of an earlier turn that only Anthropic can read back: left out.
const ANTHROPIC_ONLY: &[&str] = &[
    "thinking",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
];

/// A user turn: tool results first (as `tool` messages, their images in a
/// user message after them), then the rest.
fn user_blocks(blocks: &[Value], path: &str, out: &mut Vec<Value>) -> Result<(), Refusal> {
    let mut tool_messages = Vec::new();
    let mut tool_images = Vec::new();
    let mut parts = Vec::new();
    for (j, block) in blocks.iter().enumerate() {
        let bpath = format!("{path}.content.{j}");
        let obj = block_type(block, &bpath)?;
        match obj.get("type").and_then(Value::as_str).unwrap_or_default() {
            "text" => parts.push(text_part(obj, &bpath)?),
            "image" => parts.push(image_part(obj, &bpath)?),
            "document" => parts.push(document_part(obj, &bpath)?),
            "search_result" => parts.push(search_result_part(obj, &bpath)?),
            "tool_result" => {
                let (message, images) = tool_message(obj, &bpath)?;
                tool_messages.push(message);
                tool_images.extend(images);
            }
            "tool_use" => {
                return Err(Refusal::at(
                    format!("{bpath}.type"),
                    "`tool_use` blocks belong in assistant turns",
                ));
            }
            kind if ANTHROPIC_ONLY.contains(&kind) => {}
            other => return Err(unsupported_block(other, &bpath)),
        }
    }
    out.extend(tool_messages);
    if !tool_images.is_empty() {
        let mut content = vec![json!({"type": "text", "text": "The tool results' images:"})];
        content.extend(tool_images);
        out.push(json!({"role": "user", "content": content}));
    }
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
            kind @ ("image" | "tool_result" | "document") => {
                return Err(Refusal::at(
                    format!("{bpath}.type"),
                    format!("`{kind}` blocks belong in user turns"),
                ));
            }
            kind if ANTHROPIC_ONLY.contains(&kind) => {}
            other => return Err(unsupported_block(other, &bpath)),
        }
    }
    if parts.is_empty() && calls.is_empty() {
        // Only blocks chat cannot carry (a thinking block alone).
        return Ok(());
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

/// A `document` block: a base64 PDF as a chat `file` part, a text
/// document as its text.
fn document_part(obj: &Map<String, Value>, path: &str) -> Result<Value, Refusal> {
    let source = obj
        .get("source")
        .and_then(Value::as_object)
        .ok_or_else(|| {
            Refusal::at(
                format!("{path}.source"),
                "a `document` block needs a `source` object",
            )
        })?;
    let s = |k: &str| source.get(k).and_then(Value::as_str);
    match (s("type"), s("media_type"), s("data")) {
        (Some("base64"), Some(media_type), Some(data)) => {
            let name = obj
                .get("title")
                .and_then(Value::as_str)
                .unwrap_or("document.pdf");
            Ok(json!({"type": "file", "file": {"filename": name,
                "file_data": format!("data:{media_type};base64,{data}")}}))
        }
        (Some("text"), _, Some(text)) => Ok(json!({"type": "text", "text": text})),
        (Some(other), ..) => Err(Refusal::at(
            format!("{path}.source.type"),
            format!("documents given by `{other}` have no form in chat completions"),
        )),
        _ => Err(Refusal::at(
            format!("{path}.source"),
            "a document source needs a `type` and its `data`",
        )),
    }
}

/// A `search_result` block as text: its title, source and content.
fn search_result_part(obj: &Map<String, Value>, path: &str) -> Result<Value, Refusal> {
    let s = |k: &str| obj.get(k).and_then(Value::as_str).unwrap_or("");
    let mut text = format!("{}\n{}", s("title"), s("source"));
    for (k, block) in obj
        .get("content")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        text.push('\n');
        text.push_str(&text_of_block(block, &format!("{path}.content.{k}"))?);
    }
    Ok(json!({"type": "text", "text": text.trim()}))
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
                format!("images given by `{other}` have no form in chat completions"),
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

/// A `tool_result` block as a chat `tool` message, and its images (chat's
/// tool messages carry text only).
fn tool_message(obj: &Map<String, Value>, path: &str) -> Result<(Value, Vec<Value>), Refusal> {
    let id = obj
        .get("tool_use_id")
        .and_then(Value::as_str)
        .ok_or_else(|| {
            Refusal::at(
                format!("{path}.tool_use_id"),
                "a `tool_result` block needs a string `tool_use_id`",
            )
        })?;
    let mut images = Vec::new();
    let mut text = match field(obj, "content") {
        None => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => {
            let mut texts = Vec::with_capacity(blocks.len());
            for (k, block) in blocks.iter().enumerate() {
                let bpath = format!("{path}.content.{k}");
                match block.get("type").and_then(Value::as_str) {
                    Some("image") => {
                        let obj = block_type(block, &bpath)?;
                        images.push(image_part(obj, &bpath)?);
                    }
                    Some("document") => {
                        let obj = block_type(block, &bpath)?;
                        images.push(document_part(obj, &bpath)?);
                    }
                    Some("search_result") => {
                        let obj = block_type(block, &bpath)?;
                        if let Some(t) = search_result_part(obj, &bpath)?.get("text") {
                            texts.push(t.as_str().unwrap_or_default().to_string());
                        }
                    }
                    _ => texts.push(text_of_block(block, &bpath)?),
                }
            }
            texts.join("\n\n")
        }
        Some(_) => {
            return Err(Refusal::at(
                format!("{path}.content"),
                "`tool_result` content must be a string or an array of blocks",
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
    Ok((
        json!({"role": "tool", "tool_call_id": id, "content": text}),
        images,
    ))
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
                        "server tool `{name}` runs on Anthropic's servers: it has no form in chat completions"
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A translation for a chat model that does not reason.
    struct Translated {
        chat: Map<String, Value>,
    }

    impl Translated {
        fn of(request: &Map<String, Value>) -> Translated {
            Translated {
                chat: to_chat(request, "gpt-4o").unwrap(),
            }
        }

        fn of_ref(request: &Map<String, Value>) -> Translated {
            Translated::of(request)
        }
    }

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
        to_chat(&request, "gpt-4o").unwrap_err()
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
        let t = Translated::of(&request);
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
        let t = Translated::of_ref(&request);
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
        let t = Translated::of_ref(&with(base(), "tools", tools));
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
            let t = Translated::of_ref(&with(base(), "tool_choice", choice.clone()));
            assert_eq!(t.chat["tool_choice"], expected, "{choice}");
            assert_eq!(
                t.chat.get("parallel_tool_calls").cloned(),
                parallel,
                "{choice}"
            );
        }

        let empty = Translated::of_ref(&with(base(), "tools", json!([])));
        assert!(!empty.chat.contains_key("tools"));
    }

    #[test]
    fn stop_sequences_become_stop_and_nulls_are_absent() {
        let t = Translated::of_ref(&with(base(), "stop_sequences", json!(["a", "b"])));
        assert_eq!(t.chat["stop"], json!(["a", "b"]));
        let t = Translated::of_ref(&with(base(), "top_k", Value::Null));
        assert!(!t.chat.contains_key("top_k"));
        let t = Translated::of_ref(&with(base(), "thinking", json!({"type": "disabled"})));
        assert!(!t.chat.contains_key("thinking"));
        let r = refusal(with(base(), "stop_sequences", json!(["a", 1])));
        assert_eq!(r.param.as_deref(), Some("stop_sequences.1"));
    }

    #[test]
    fn translated_fields_win_over_passed_through_ones() {
        let mut request = base();
        request["user"] = json!("sneaky");
        request["metadata"] = json!({"user_id": "real"});
        let t = Translated::of_ref(&obj(request));
        assert_eq!(t.chat["user"], "real");
    }

    #[test]
    fn refusals_name_their_param() {
        let mut missing = obj(base());
        missing.remove("max_tokens");
        let cases: Vec<(Map<String, Value>, &str)> = vec![
            (missing, "max_tokens"),
            (with(base(), "max_tokens", json!(0)), "max_tokens"),
            (with(base(), "messages", json!([])), "messages"),
            (
                with(
                    base(),
                    "messages",
                    json!([{"role": "tool", "content": "x"}]),
                ),
                "messages.0.role",
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
            (
                with(base(), "thinking", json!({"type": "enabled"})),
                "thinking.budget_tokens",
            ),
            (
                with(
                    base(),
                    "messages",
                    json!([{"role": "user", "content": [
                        {"type": "document", "source": {"type": "url", "url": "https://x"}}
                    ]}]),
                ),
                "messages.0.content.0.source.type",
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
        let r = refusal(with(
            base(),
            "messages",
            json!([{"role": "user", "content": [{"type": "container_upload"}]}]),
        ));
        assert!(r.message.contains("container_upload"), "{}", r.message);
        let r = refusal(with(
            base(),
            "tools",
            json!([{"type": "bash_20250124", "name": "bash"}]),
        ));
        assert!(r.message.contains("bash_20250124"), "{}", r.message);
    }

    /// What Claude Code sends by default reaches a chat target: thinking as
    /// a reasoning model's effort (and nothing for others), a system turn
    /// inside the messages, replayed thinking left out, a document as a
    /// file, a tool result's image after the tool messages, `top_k` and
    /// `context_management` without a refusal.
    #[test]
    fn claude_codes_defaults_are_translated_not_refused() {
        let request = obj(json!({
            "model": "claude-opus-4-8", "max_tokens": 32000,
            "thinking": {"type": "enabled", "budget_tokens": 31999},
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "output_config": {"effort": "medium"},
            "top_k": 40,
            "messages": [
                {"role": "system", "content": [{"type": "text", "text": "Mind the repo."}]},
                {"role": "user", "content": [
                    {"type": "document", "title": "spec.pdf",
                     "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}},
                    {"type": "text", "text": "Read it."}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"p": "a"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [
                        {"type": "text", "text": "ok"},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QQ=="}}]}]}
            ]
        }));
        let reasoning = to_chat(&request, "o4-mini").unwrap();
        assert_eq!(reasoning["reasoning_effort"], "medium");
        assert_eq!(reasoning["max_completion_tokens"], 32000);
        assert!(!reasoning.contains_key("max_tokens"));
        let plain = to_chat(&request, "gpt-4o").unwrap();
        assert!(!plain.contains_key("reasoning_effort"));
        assert_eq!(plain["max_tokens"], 32000);
        assert_eq!(plain["top_k"], 40);
        assert!(!plain.contains_key("context_management"));
        assert!(!plain.contains_key("thinking"));
        let m = plain["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "system", "content": "Mind the repo."}));
        assert_eq!(m[1]["content"][0]["type"], "file");
        assert_eq!(
            m[1]["content"][0]["file"]["file_data"],
            "data:application/pdf;base64,JVBE"
        );
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "Read");
        assert_eq!(
            m[2]["content"],
            Value::Null,
            "the thinking block is left out"
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "t1", "content": "ok"})
        );
        assert_eq!(m[4]["role"], "user");
        assert_eq!(m[4]["content"][1]["type"], "image_url");
        assert_eq!(m.len(), 5);
        // Adaptive thinking and a small budget.
        let mut r = request.clone();
        r.remove("output_config");
        r.insert("thinking".into(), json!({"type": "adaptive"}));
        assert_eq!(to_chat(&r, "gpt-5").unwrap()["reasoning_effort"], "medium");
        r.insert(
            "thinking".into(),
            json!({"type": "enabled", "budget_tokens": 1024}),
        );
        assert_eq!(to_chat(&r, "o3").unwrap()["reasoning_effort"], "low");
        assert!(is_reasoning_model("gpt-5-mini") && is_reasoning_model("openai/o4-mini"));
        assert!(!is_reasoning_model("gpt-4o") && !is_reasoning_model("o1x"));
    }
}
