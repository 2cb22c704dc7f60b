//! The Responses API face of idem (`POST /v1/responses`), served through the chat core.
//!
//! idem's core speaks OpenAI chat completions and nothing else. This module lets it also
//! answer OpenAI's Responses API: a Responses request is translated into a chat
//! completions request ([`to_chat`]), the core answers it like any other chat request, and
//! the chat answer is rendered back as a Responses `response` object
//! ([`response_from_completion`]) or as the Responses API's typed server-sent events
//! ([`StreamTranslator`], [`stream_from_completion`]). Nothing here talks to the network
//! or keeps state between requests: storing conversations for `previous_response_id` is
//! the caller's job, helped by [`Translated::turns`] and [`answer_turns`].
//!
//! Request fields, by what becomes of them:
//!
//! * Translated: `model`; `input` (a string, or a list of message, `function_call` and
//!   `function_call_output` items); `instructions` (a leading system message);
//!   `temperature`, `top_p`, `parallel_tool_calls`, `user`, `safety_identifier` (same
//!   names); `max_output_tokens` (as `max_completion_tokens`); function `tools`;
//!   `tool_choice`; `text.format` (as `response_format`); `text.verbosity` (as
//!   `verbosity`); `reasoning.effort` (as `reasoning_effort`); `stream`.
//! * Read but not sent upstream: `stream`, `store` and `previous_response_id` are handed
//!   to the caller in [`Translated`].
//! * Noise, dropped because they cannot change the answer's content or only concern
//!   OpenAI's own platform: `metadata` (echoed only), `include`, `truncation`,
//!   `service_tier`, `prompt_cache_key`, `prompt_cache_retention`, `stream_options`,
//!   `max_tool_calls` (it only limits built-in tools, which are refused anyway),
//!   `reasoning.summary` and `reasoning.generate_summary` (chat targets return no
//!   reasoning summaries), `background: false`, `top_logprobs: 0`, and input items of
//!   type `reasoning` (they carry nothing a chat target can use).
//! * Refused with a 400 ([`Refusal`]): `background: true` (no background runs),
//!   `conversation` (use `previous_response_id`), `prompt` (no stored prompt
//!   templates), `top_logprobs` above 0 (logprobs are not rendered), built-in tools
//!   (web search, file search, computer use, MCP, code interpreter, image generation,
//!   custom tools...) and tool choices naming them, `input_file` parts, images given by
//!   `file_id`, `item_reference` items and any other input item type, and
//!   `text.format` types other than `text`, `json_object` and `json_schema`.
//! * Unknown top-level fields are copied into the chat request unchanged: a field idem
//!   does not know is assumed to matter, and the upstream may reject it.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{PIECE_BYTES, pieces};

/// Top-level Responses fields this module handles itself (translated, read, dropped or
/// refused); every other field is copied into the chat request unchanged.
const KNOWN_FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "temperature",
    "top_p",
    "max_output_tokens",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "user",
    "safety_identifier",
    "metadata",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "include",
    "background",
    "truncation",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "conversation",
    "prompt",
    "max_tool_calls",
    "top_logprobs",
];

pub use super::Refusal;

/// The key under which the chat request of a Responses request keeps the
/// Responses request itself ([`native`]): a provider that speaks the
/// Responses API (`responses_api = true`) is sent it as written, not the
/// translation; any other target gets the translation, without this key.
/// Being in the chat request, it counts in the fingerprint.
pub const ORIGINAL: &str = "idem_responses_request";

/// What [`ORIGINAL`] keeps of a Responses request: all of it but its noise
/// (`stream`, `stream_options`, `store`, `metadata`, `include`,
/// `background`) and its `model` (which a target replaces), with the
/// conversation it continues spelled out: `previous_response_id` names a
/// response idem keeps, which the provider does not know, so its turns
/// (`history`, chat messages) go before the request's own `input`.
pub fn native(request: &Map<String, Value>, history: &[Value]) -> Value {
    let mut kept = request.clone();
    for noise in [
        "stream",
        "stream_options",
        "store",
        "metadata",
        "include",
        "background",
        "previous_response_id",
        "model",
    ] {
        kept.remove(noise);
    }
    if !history.is_empty() {
        let mut input = super::responses_api::input_items(history);
        match kept.remove("input") {
            Some(Value::String(text)) => input.push(json!({"role": "user", "content": text})),
            Some(Value::Array(items)) => input.extend(items),
            Some(other) => input.push(other),
            None => {}
        }
        kept.insert("input".into(), Value::Array(input));
    }
    Value::Object(kept)
}

/// Builds the `Err` of a refusal, so that every refusal names its field.
fn refuse<T>(message: impl Into<String>, param: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal::at(param, message))
}

/// A Responses request turned into what the chat core needs, plus the parts of it that
/// only the caller can act on.
#[derive(Debug, Clone, PartialEq)]
pub struct Translated {
    /// The chat completions request: model (as sent), messages, sampling fields, tools,
    /// tool_choice, response_format, reasoning_effort, max_completion_tokens, stream,
    /// user. Never `stream_options`: whether usage is streamed is the core's business.
    pub chat: Map<String, Value>,
    /// The model as the client named it.
    pub model: String,
    /// Whether the client asked for server-sent events.
    pub stream: bool,
    /// `store` as the client sent it. OpenAI's default is true, so `None` means the
    /// response is to be kept just like `Some(true)`; only `Some(false)` opts out.
    pub store: Option<bool>,
    /// The stored response this one continues; the caller loads its conversation and
    /// passes it as `history` to [`to_chat`].
    pub previous_response_id: Option<String>,
    /// This request's own turns as chat messages (instructions excluded), for storing
    /// the conversation: the input items translated.
    pub turns: Vec<Value>,
}

/// Translates a Responses request into a chat completions request.
///
/// `history`: the chat messages of the earlier turns of a stored conversation (from
/// previous_response_id), oldest first, already in chat form (user/assistant/tool
/// messages); they go after the system message made of `instructions` and before this
/// request's input. Per OpenAI, instructions of the previous response do NOT carry over,
/// which is why the history never holds them.
pub fn to_chat(request: &Map<String, Value>, history: &[Value]) -> Result<Translated, Refusal> {
    let model = match request.get("model") {
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        Some(Value::String(_)) | Some(Value::Null) | None => {
            return refuse("Missing required parameter: 'model'.", "model");
        }
        Some(_) => return refuse("Invalid type for 'model': expected a string.", "model"),
    };
    refuse_unsupported(request)?;
    let stream = optional_bool(request, "stream")?.unwrap_or(false);
    let store = optional_bool(request, "store")?;
    let previous_response_id = optional_string(request, "previous_response_id")?;
    let turns = input_turns(request.get("input"))?;

    // Unknown fields go in first so that a translated field wins a name clash.
    let mut chat: Map<String, Value> = request
        .iter()
        .filter(|(key, _)| !KNOWN_FIELDS.contains(&key.as_str()))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    chat.insert("model".into(), Value::String(model.clone()));

    let mut messages = Vec::with_capacity(1 + history.len() + turns.len());
    match present(request, "instructions") {
        None => {}
        Some(Value::String(text)) if text.is_empty() => {}
        Some(Value::String(text)) => messages.push(json!({"role": "system", "content": text})),
        Some(_) => {
            return refuse(
                "Invalid type for 'instructions': expected a string.",
                "instructions",
            );
        }
    }
    messages.extend(history.iter().cloned());
    messages.extend(turns.iter().cloned());
    chat.insert("messages".into(), Value::Array(messages));

    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_completion_tokens"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
        ("safety_identifier", "safety_identifier"),
    ] {
        if let Some(value) = present(request, from) {
            chat.insert(to.into(), value.clone());
        }
    }
    if let Some(tools) = present(request, "tools") {
        let tools = chat_tools(tools)?;
        // Chat completions rejects an empty tools list; no tools is the same thing.
        if !tools.is_empty() {
            chat.insert("tools".into(), Value::Array(tools));
        }
    }
    if let Some(choice) = present(request, "tool_choice") {
        chat.insert("tool_choice".into(), chat_tool_choice(choice)?);
    }
    if let Some(text) = present(request, "text") {
        translate_text(text, &mut chat)?;
    }
    if let Some(reasoning) = present(request, "reasoning") {
        let Some(reasoning) = reasoning.as_object() else {
            return refuse(
                "Invalid type for 'reasoning': expected an object.",
                "reasoning",
            );
        };
        if let Some(effort) = reasoning.get("effort").filter(|v| !v.is_null()) {
            chat.insert("reasoning_effort".into(), effort.clone());
        }
    }
    if stream {
        chat.insert("stream".into(), Value::Bool(true));
    }

    Ok(Translated {
        chat,
        model,
        stream,
        store,
        previous_response_id,
        turns,
    })
}

/// A field's value unless it is absent or null: in the Responses API an explicit null
/// means "the default", exactly like leaving the field out.
fn present<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    map.get(key).filter(|value| !value.is_null())
}

fn optional_bool(request: &Map<String, Value>, key: &str) -> Result<Option<bool>, Refusal> {
    match present(request, key) {
        None => Ok(None),
        Some(Value::Bool(flag)) => Ok(Some(*flag)),
        Some(_) => refuse(
            format!("Invalid type for '{key}': expected a boolean."),
            key,
        ),
    }
}

fn optional_string(request: &Map<String, Value>, key: &str) -> Result<Option<String>, Refusal> {
    match present(request, key) {
        None => Ok(None),
        Some(Value::String(text)) => Ok(Some(text.clone())),
        Some(_) => refuse(format!("Invalid type for '{key}': expected a string."), key),
    }
}

/// Refuses the top-level features a chat completions upstream cannot provide, rather
/// than silently answering something else than what was asked.
fn refuse_unsupported(request: &Map<String, Value>) -> Result<(), Refusal> {
    if present(request, "background").is_some_and(|v| v != &Value::Bool(false)) {
        return refuse(
            "Background responses are not supported by idem; send the request without 'background'.",
            "background",
        );
    }
    if present(request, "conversation").is_some() {
        return refuse(
            "Conversations are not supported by idem; chain responses with 'previous_response_id' instead.",
            "conversation",
        );
    }
    if present(request, "prompt").is_some() {
        return refuse(
            "Reusable prompt templates are not supported by idem; send 'instructions' and 'input' instead.",
            "prompt",
        );
    }
    if present(request, "top_logprobs").is_some_and(|v| v.as_u64() != Some(0)) {
        return refuse(
            "'top_logprobs' is not supported by idem's Responses endpoint.",
            "top_logprobs",
        );
    }
    Ok(())
}

/// The chat messages for `input`: a string is one user message; a list is translated
/// item by item.
fn input_turns(input: Option<&Value>) -> Result<Vec<Value>, Refusal> {
    match input {
        None | Some(Value::Null) => refuse("Missing required parameter: 'input'.", "input"),
        Some(Value::String(text)) => Ok(vec![json!({"role": "user", "content": text})]),
        Some(Value::Array(items)) => {
            let mut turns = Vec::with_capacity(items.len());
            for (index, item) in items.iter().enumerate() {
                add_input_item(&mut turns, &format!("input.{index}"), item)?;
            }
            Ok(turns)
        }
        Some(_) => refuse(
            "Invalid type for 'input': expected a string or a list of input items.",
            "input",
        ),
    }
}

fn add_input_item(turns: &mut Vec<Value>, at: &str, item: &Value) -> Result<(), Refusal> {
    let Some(item) = item.as_object() else {
        return refuse(format!("Invalid type for '{at}': expected an object."), at);
    };
    // Messages may leave out `"type": "message"` (the SDK's EasyInputMessage).
    let kind = match item.get("type") {
        None | Some(Value::Null) => "message",
        Some(Value::String(kind)) => kind.as_str(),
        Some(_) => {
            return refuse(
                format!("Invalid type for '{at}.type': expected a string."),
                format!("{at}.type"),
            );
        }
    };
    match kind {
        "message" => turns.push(message_turn(item, at)?),
        "function_call" => push_tool_call(turns, tool_call(item, at)?),
        "function_call_output" => turns.push(tool_turn(item, at)?),
        // Reasoning items replay a model's private reasoning to OpenAI's own models; a
        // chat target has no place for them and answers the same without them.
        "reasoning" => {}
        "item_reference" => {
            return refuse(
                "Item references are not supported by idem; send the item itself, or continue a stored response with 'previous_response_id'.",
                format!("{at}.type"),
            );
        }
        other => {
            return refuse(
                format!(
                    "Input items of type '{other}' are not supported by idem's Responses endpoint."
                ),
                format!("{at}.type"),
            );
        }
    }
    Ok(())
}

/// A message item as a chat message. Roles keep their names (`developer` included).
fn message_turn(item: &Map<String, Value>, at: &str) -> Result<Value, Refusal> {
    let role = match item.get("role").and_then(Value::as_str) {
        Some(role @ ("user" | "system" | "developer" | "assistant")) => role,
        Some(other) => {
            return refuse(
                format!("Invalid value for '{at}.role': '{other}'."),
                format!("{at}.role"),
            );
        }
        None => {
            return refuse(
                format!("Missing required parameter: '{at}.role'."),
                format!("{at}.role"),
            );
        }
    };
    let content = item.get("content");
    if role == "assistant" {
        return assistant_turn(content, at);
    }
    let content = match content {
        Some(Value::String(text)) => Value::String(text.clone()),
        Some(Value::Array(parts)) => {
            let mut translated = Vec::with_capacity(parts.len());
            for (index, part) in parts.iter().enumerate() {
                translated.push(input_part(part, role, &format!("{at}.content.{index}"))?);
            }
            Value::Array(translated)
        }
        _ => {
            return refuse(
                format!("Invalid or missing '{at}.content': expected a string or a list of parts."),
                format!("{at}.content"),
            );
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// One content part of a user, system or developer message as a chat content part.
fn input_part(part: &Value, role: &str, at: &str) -> Result<Value, Refusal> {
    let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
    match kind {
        "input_text" | "output_text" => Ok(json!({"type": "text", "text": part_text(part, at)?})),
        "input_image" if role == "user" => image_part(part, at),
        "input_image" => refuse(
            format!("Images are only accepted in user messages, not in {role} messages."),
            format!("{at}.type"),
        ),
        "input_file" => refuse(
            "File inputs are not supported by idem's Responses endpoint.",
            format!("{at}.type"),
        ),
        "" => refuse(
            format!("Missing required parameter: '{at}.type'."),
            format!("{at}.type"),
        ),
        other => refuse(
            format!("Content parts of type '{other}' are not supported in {role} messages."),
            format!("{at}.type"),
        ),
    }
}

fn part_text<'a>(part: &'a Value, at: &str) -> Result<&'a str, Refusal> {
    match part.get("text").and_then(Value::as_str) {
        Some(text) => Ok(text),
        None => refuse(
            format!("Missing required parameter: '{at}.text'."),
            format!("{at}.text"),
        ),
    }
}

/// An `input_image` part as a chat `image_url` part (URLs and data URLs alike).
fn image_part(part: &Value, at: &str) -> Result<Value, Refusal> {
    if part.get("file_id").is_some_and(|v| !v.is_null()) {
        return refuse(
            "Images given by 'file_id' are not supported by idem: it keeps no files; send 'image_url' (a URL or a data URL).",
            format!("{at}.file_id"),
        );
    }
    let Some(url) = part.get("image_url").and_then(Value::as_str) else {
        return refuse(
            format!("Missing required parameter: '{at}.image_url'."),
            format!("{at}.image_url"),
        );
    };
    let mut image = Map::new();
    image.insert("url".into(), Value::String(url.to_owned()));
    if let Some(detail) = part.get("detail").filter(|v| !v.is_null()) {
        image.insert("detail".into(), detail.clone());
    }
    Ok(json!({"type": "image_url", "image_url": image}))
}

/// An assistant message (usually earlier output sent back by the client) as a chat
/// assistant message. Its text parts are joined into one string, because that is the
/// single answer they were cut from and how [`answer_turns`] stores answers; refusal
/// parts become the chat message's `refusal`.
fn assistant_turn(content: Option<&Value>, at: &str) -> Result<Value, Refusal> {
    let parts = match content {
        Some(Value::String(text)) => return Ok(json!({"role": "assistant", "content": text})),
        Some(Value::Array(parts)) => parts,
        _ => {
            return refuse(
                format!("Invalid or missing '{at}.content': expected a string or a list of parts."),
                format!("{at}.content"),
            );
        }
    };
    let mut text: Option<String> = None;
    let mut refusal: Option<String> = None;
    for (index, part) in parts.iter().enumerate() {
        let part_at = format!("{at}.content.{index}");
        match part.get("type").and_then(Value::as_str).unwrap_or_default() {
            "output_text" | "input_text" => {
                text.get_or_insert_default()
                    .push_str(part_text(part, &part_at)?);
            }
            "refusal" => match part.get("refusal").and_then(Value::as_str) {
                Some(said) => refusal.get_or_insert_default().push_str(said),
                None => {
                    return refuse(
                        format!("Missing required parameter: '{part_at}.refusal'."),
                        format!("{part_at}.refusal"),
                    );
                }
            },
            other => {
                return refuse(
                    format!(
                        "Content parts of type '{other}' are not supported in assistant messages."
                    ),
                    format!("{part_at}.type"),
                );
            }
        }
    }
    let mut message = Map::new();
    message.insert("role".into(), "assistant".into());
    let content = match (text, &refusal) {
        (Some(text), _) => Value::String(text),
        (None, Some(_)) => Value::Null,
        (None, None) => Value::String(String::new()),
    };
    message.insert("content".into(), content);
    if let Some(refusal) = refusal {
        message.insert("refusal".into(), Value::String(refusal));
    }
    Ok(Value::Object(message))
}

/// A `function_call` item as a chat tool call.
fn tool_call(item: &Map<String, Value>, at: &str) -> Result<Value, Refusal> {
    let field = |key: &str| -> Result<String, Refusal> {
        match item.get(key) {
            Some(Value::String(value)) => Ok(value.clone()),
            None | Some(Value::Null) => refuse(
                format!("Missing required parameter: '{at}.{key}'."),
                format!("{at}.{key}"),
            ),
            Some(_) => refuse(
                format!("Invalid type for '{at}.{key}': expected a string."),
                format!("{at}.{key}"),
            ),
        }
    };
    Ok(json!({
        "id": field("call_id")?,
        "type": "function",
        "function": {"name": field("name")?, "arguments": field("arguments")?},
    }))
}

/// Adds a tool call to the assistant message just before it, or starts one. In chat
/// form an answer's text and all its tool calls are one assistant message, and a client
/// sending back `[message, function_call, function_call]` means exactly that.
fn push_tool_call(turns: &mut Vec<Value>, call: Value) {
    let last_is_assistant = turns
        .last()
        .and_then(|turn| turn.get("role"))
        .and_then(Value::as_str)
        == Some("assistant");
    if let (true, Some(Value::Object(last))) = (last_is_assistant, turns.last_mut()) {
        match last.get_mut("tool_calls") {
            Some(Value::Array(calls)) => calls.push(call),
            _ => {
                last.insert("tool_calls".into(), Value::Array(vec![call]));
            }
        }
        return;
    }
    turns.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
}

/// A `function_call_output` item as a chat tool message.
fn tool_turn(item: &Map<String, Value>, at: &str) -> Result<Value, Refusal> {
    let Some(call_id) = item.get("call_id").and_then(Value::as_str) else {
        return refuse(
            format!("Missing required parameter: '{at}.call_id'."),
            format!("{at}.call_id"),
        );
    };
    let content = match item.get("output") {
        Some(Value::String(text)) => Value::String(text.clone()),
        Some(Value::Array(parts)) => {
            let mut translated = Vec::with_capacity(parts.len());
            for (index, part) in parts.iter().enumerate() {
                let part_at = format!("{at}.output.{index}");
                match part.get("type").and_then(Value::as_str) {
                    Some("input_text") => {
                        translated.push(json!({"type": "text", "text": part_text(part, &part_at)?}))
                    }
                    // Chat tool messages carry text only.
                    _ => {
                        return refuse(
                            "Only text is supported in function call outputs.",
                            format!("{part_at}.type"),
                        );
                    }
                }
            }
            Value::Array(translated)
        }
        _ => {
            return refuse(
                format!("Invalid or missing '{at}.output': expected a string or a list of parts."),
                format!("{at}.output"),
            );
        }
    };
    Ok(json!({"role": "tool", "tool_call_id": call_id, "content": content}))
}

/// Responses function tools (flat) as chat tools (nested under `function`). `strict`
/// is passed on only when the client set it: OpenAI's Responses API treats a missing
/// `strict` as true and rewrites the schema to fit, which a chat upstream cannot be
/// made to do, so such tools run non-strict.
fn chat_tools(tools: &Value) -> Result<Vec<Value>, Refusal> {
    let Some(tools) = tools.as_array() else {
        return refuse("Invalid type for 'tools': expected a list.", "tools");
    };
    let mut translated = Vec::with_capacity(tools.len());
    for (index, tool) in tools.iter().enumerate() {
        let at = format!("tools.{index}");
        match tool.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return refuse(
                    format!(
                        "Tools of type '{other}' are not supported by idem: it serves the Responses API through chat completions, which only run function tools."
                    ),
                    format!("{at}.type"),
                );
            }
            None => {
                return refuse(
                    format!("Missing required parameter: '{at}.type'."),
                    format!("{at}.type"),
                );
            }
        }
        let Some(name) = tool.get("name").and_then(Value::as_str) else {
            return refuse(
                format!("Missing required parameter: '{at}.name'."),
                format!("{at}.name"),
            );
        };
        let mut function = Map::new();
        function.insert("name".into(), Value::String(name.to_owned()));
        for key in ["description", "parameters", "strict"] {
            if let Some(value) = tool.get(key).filter(|v| !v.is_null()) {
                function.insert(key.into(), value.clone());
            }
        }
        translated.push(json!({"type": "function", "function": function}));
    }
    Ok(translated)
}

/// A Responses `tool_choice` as a chat one; choices naming built-in tools are refused
/// like the tools themselves.
fn chat_tool_choice(choice: &Value) -> Result<Value, Refusal> {
    let function_named = |tool: &Value, at: &str| -> Result<Value, Refusal> {
        match tool.get("name").and_then(Value::as_str) {
            Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
            None => refuse(
                format!("Missing required parameter: '{at}.name'."),
                format!("{at}.name"),
            ),
        }
    };
    match choice {
        Value::String(mode) if matches!(mode.as_str(), "auto" | "none" | "required") => {
            Ok(choice.clone())
        }
        Value::String(mode) => refuse(
            format!("Invalid value for 'tool_choice': '{mode}'."),
            "tool_choice",
        ),
        Value::Object(object) => match object.get("type").and_then(Value::as_str) {
            Some("function") => function_named(choice, "tool_choice"),
            Some("allowed_tools") => {
                let tools = object
                    .get("tools")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let mut allowed = Vec::with_capacity(tools.len());
                for (index, tool) in tools.iter().enumerate() {
                    let at = format!("tool_choice.tools.{index}");
                    if tool.get("type").and_then(Value::as_str) != Some("function") {
                        return refuse(
                            "Only function tools can be allowed: idem runs no built-in tools.",
                            format!("{at}.type"),
                        );
                    }
                    allowed.push(function_named(tool, &at)?);
                }
                let mode = object.get("mode").cloned().unwrap_or_else(|| "auto".into());
                Ok(json!({
                    "type": "allowed_tools",
                    "allowed_tools": {"mode": mode, "tools": allowed},
                }))
            }
            _ => refuse(
                "Only 'auto', 'none', 'required', a function or allowed function tools can be chosen: idem runs no built-in tools.",
                "tool_choice.type",
            ),
        },
        _ => refuse(
            "Invalid type for 'tool_choice': expected a string or an object.",
            "tool_choice",
        ),
    }
}

/// `text.format` as `response_format` (`text` is the default and needs nothing) and
/// `text.verbosity` as `verbosity`.
fn translate_text(text: &Value, chat: &mut Map<String, Value>) -> Result<(), Refusal> {
    let Some(text) = text.as_object() else {
        return refuse("Invalid type for 'text': expected an object.", "text");
    };
    if let Some(verbosity) = present(text, "verbosity") {
        chat.insert("verbosity".into(), verbosity.clone());
    }
    let Some(format) = present(text, "format") else {
        return Ok(());
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => {}
        Some("json_object") => {
            chat.insert("response_format".into(), json!({"type": "json_object"}));
        }
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema"] {
                match format.get(key).filter(|v| !v.is_null()) {
                    Some(value) => schema.insert(key.into(), value.clone()),
                    None => {
                        return refuse(
                            format!("Missing required parameter: 'text.format.{key}'."),
                            format!("text.format.{key}"),
                        );
                    }
                };
            }
            for key in ["description", "strict"] {
                if let Some(value) = format.get(key).filter(|v| !v.is_null()) {
                    schema.insert(key.into(), value.clone());
                }
            }
            chat.insert(
                "response_format".into(),
                json!({"type": "json_schema", "json_schema": schema}),
            );
        }
        _ => {
            return refuse(
                "Invalid value for 'text.format.type': expected 'text', 'json_object' or 'json_schema'.",
                "text.format.type",
            );
        }
    }
    Ok(())
}

/// The chat message(s) an answer adds to a conversation (the assistant message with
/// content and/or tool_calls), for storing it: from a plain chat completion's choice 0.
/// Only what a later request needs is kept (no annotations, audio or provider extras).
pub fn answer_turns(completion: &Value) -> Vec<Value> {
    let Some(message) = first_choice(completion).and_then(|choice| choice.get("message")) else {
        return Vec::new();
    };
    let text = message.get("content").map(text_of).unwrap_or_default();
    let refusal = message
        .get("refusal")
        .and_then(Value::as_str)
        .filter(|r| !r.is_empty());
    let calls: Vec<Value> = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|call| {
            let function = call.get("function");
            let name = function.and_then(|f| f.get("name")).map(text_of);
            let arguments = function.and_then(|f| f.get("arguments")).map(text_of);
            json!({
                "id": call.get("id").map(text_of).unwrap_or_default(),
                "type": "function",
                "function": {
                    "name": name.unwrap_or_default(),
                    "arguments": arguments.unwrap_or_default(),
                },
            })
        })
        .collect();
    let mut turn = Map::new();
    turn.insert("role".into(), "assistant".into());
    // Chat wants content unless the message has tool calls or a refusal instead.
    let content = if text.is_empty() && (!calls.is_empty() || refusal.is_some()) {
        Value::Null
    } else {
        Value::String(text)
    };
    turn.insert("content".into(), content);
    if let Some(refusal) = refusal {
        turn.insert("refusal".into(), refusal.into());
    }
    if !calls.is_empty() {
        turn.insert("tool_calls".into(), Value::Array(calls));
    }
    vec![Value::Object(turn)]
}

/// Choice 0 of a completion or chunk, if present (a choice without an `index` counts as
/// 0). The Responses API has no `n`: other choices are ignored, and a chunk carrying
/// only another choice carries nothing for this response.
fn first_choice(completion: &Value) -> Option<&Value> {
    completion
        .get("choices")?
        .as_array()?
        .iter()
        .find(|choice| choice.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
}

/// The text of a string, or of a list of text parts (some upstreams answer that way).
fn text_of(value: &Value) -> String {
    match value {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// What of the request the response object echoes (instructions, model as asked,
/// tools, tool_choice, temperature, top_p, max_output_tokens, text, reasoning, metadata,
/// store, previous_response_id, parallel_tool_calls, user...). Defaults are OpenAI's
/// where the field has one idem honours (store true, parallel_tool_calls true,
/// tool_choice auto, truncation disabled); sampling fields the client left out echo as
/// null, because the upstream's defaults are not known here.
#[derive(Debug, Clone, PartialEq)]
pub struct Echo {
    model: String,
    fields: Map<String, Value>,
}

impl Echo {
    /// Takes the echoed fields from a Responses request (valid or not: it never fails).
    pub fn of(request: &Map<String, Value>) -> Echo {
        let given = |key: &str| present(request, key).cloned();
        let mut fields = Map::new();
        for key in [
            "instructions",
            "temperature",
            "top_p",
            "max_output_tokens",
            "previous_response_id",
            "user",
            "safety_identifier",
            "prompt_cache_key",
            "max_tool_calls",
            "top_logprobs",
        ] {
            fields.insert(key.into(), given(key).unwrap_or(Value::Null));
        }
        fields.insert("tools".into(), given("tools").unwrap_or_else(|| json!([])));
        fields.insert(
            "tool_choice".into(),
            given("tool_choice").unwrap_or_else(|| "auto".into()),
        );
        fields.insert(
            "parallel_tool_calls".into(),
            given("parallel_tool_calls").unwrap_or(Value::Bool(true)),
        );
        fields.insert("store".into(), given("store").unwrap_or(Value::Bool(true)));
        fields.insert(
            "metadata".into(),
            given("metadata").unwrap_or_else(|| json!({})),
        );
        fields.insert(
            "truncation".into(),
            given("truncation").unwrap_or_else(|| "disabled".into()),
        );
        fields.insert("background".into(), Value::Bool(false));

        let text = request.get("text").and_then(Value::as_object);
        let mut text_echo = Map::new();
        text_echo.insert(
            "format".into(),
            text.and_then(|t| present(t, "format"))
                .cloned()
                .unwrap_or_else(|| json!({"type": "text"})),
        );
        if let Some(verbosity) = text.and_then(|t| present(t, "verbosity")) {
            text_echo.insert("verbosity".into(), verbosity.clone());
        }
        fields.insert("text".into(), Value::Object(text_echo));

        let reasoning = request.get("reasoning").and_then(Value::as_object);
        let pick = |key: &str| {
            reasoning
                .and_then(|r| present(r, key))
                .cloned()
                .unwrap_or(Value::Null)
        };
        fields.insert(
            "reasoning".into(),
            json!({"effort": pick("effort"), "summary": pick("summary")}),
        );

        let model = request
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        Echo { model, fields }
    }
}

/// Where a response stands, as its `status`, `incomplete_details` and `error` say.
enum Outcome<'a> {
    InProgress,
    Completed,
    /// Cut short; the reason is `max_output_tokens` or `content_filter`.
    Incomplete(&'static str),
    Failed {
        code: &'a str,
        message: &'a str,
    },
}

/// The Responses `incomplete_details.reason` for a chat `finish_reason`, if the answer
/// was cut short.
fn incomplete_reason(finish_reason: Option<&str>) -> Option<&'static str> {
    match finish_reason {
        Some("length") => Some("max_output_tokens"),
        Some("content_filter") => Some("content_filter"),
        _ => None,
    }
}

/// Chat usage as Responses usage; null when the upstream reported none. The newest SDK
/// requires `cache_write_tokens`, which chat usage rarely has: it counts as 0 then.
fn usage_of(usage: Option<&Value>) -> Value {
    let Some(usage) = usage.filter(|u| u.is_object()) else {
        return Value::Null;
    };
    let count = |pointer: &str| usage.pointer(pointer).and_then(Value::as_u64);
    let input = count("/prompt_tokens").unwrap_or(0);
    let output = count("/completion_tokens").unwrap_or(0);
    json!({
        "input_tokens": input,
        "input_tokens_details": {
            "cached_tokens": count("/prompt_tokens_details/cached_tokens").unwrap_or(0),
            "cache_write_tokens": count("/prompt_tokens_details/cache_write_tokens").unwrap_or(0),
        },
        "output_tokens": output,
        "output_tokens_details": {
            "reasoning_tokens": count("/completion_tokens_details/reasoning_tokens").unwrap_or(0),
        },
        "total_tokens": count("/total_tokens").unwrap_or(input + output),
    })
}

/// The full `response` object around an outcome, its output items and usage.
fn response_object(
    echo: &Echo,
    id: &str,
    created_at: u64,
    model: &str,
    outcome: &Outcome,
    output: Vec<Value>,
    usage: Value,
) -> Value {
    let mut response = echo.fields.clone();
    let (status, details, error) = match outcome {
        Outcome::InProgress => ("in_progress", Value::Null, Value::Null),
        Outcome::Completed => ("completed", Value::Null, Value::Null),
        Outcome::Incomplete(reason) => ("incomplete", json!({"reason": reason}), Value::Null),
        Outcome::Failed { code, message } => (
            "failed",
            Value::Null,
            json!({"code": code, "message": message}),
        ),
    };
    response.insert("id".into(), id.into());
    response.insert("object".into(), "response".into());
    response.insert("created_at".into(), created_at.into());
    response.insert("status".into(), status.into());
    response.insert("error".into(), error);
    response.insert("incomplete_details".into(), details);
    response.insert("model".into(), model.into());
    response.insert("output".into(), Value::Array(output));
    response.insert("usage".into(), usage);
    Value::Object(response)
}

/// The part of a response id that output item ids are derived from, so that every
/// follower of a coalesced request sees the same item ids.
fn id_suffix(id: &str) -> &str {
    id.strip_prefix("resp_").unwrap_or(id)
}

fn message_id(response_id: &str) -> String {
    format!("msg_{}", id_suffix(response_id))
}

fn call_item_id(response_id: &str, ordinal: usize) -> String {
    format!("fc_{}_{ordinal}", id_suffix(response_id))
}

/// One content part of the answer message: output text or a refusal.
#[derive(Debug, Clone)]
struct Part {
    refusal: bool,
    text: String,
}

/// One output item being built, from a whole completion or from chunks.
#[derive(Debug, Clone)]
enum Item {
    Message {
        id: String,
        parts: Vec<Part>,
    },
    Call {
        id: String,
        call_id: String,
        name: String,
        arguments: String,
    },
}

fn render_part(part: &Part, text: &str) -> Value {
    if part.refusal {
        json!({"type": "refusal", "refusal": text})
    } else {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    }
}

/// An item as the response shows it; `complete` false gives the empty shape that
/// `response.output_item.added` announces.
fn render_item(item: &Item, status: &str, complete: bool) -> Value {
    match item {
        Item::Message { id, parts } => {
            let content: Vec<Value> = if complete {
                parts.iter().map(|p| render_part(p, &p.text)).collect()
            } else {
                Vec::new()
            };
            json!({
                "id": id,
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": content,
            })
        }
        Item::Call {
            id,
            call_id,
            name,
            arguments,
        } => json!({
            "id": id,
            "type": "function_call",
            "status": status,
            "call_id": call_id,
            "name": name,
            "arguments": if complete { arguments.as_str() } else { "" },
        }),
    }
}

/// The status of item `index` among `count` once the response ended: when the answer
/// was cut short, the last item is the one that was cut.
fn final_status(index: usize, count: usize, cut: bool) -> &'static str {
    if cut && index + 1 == count {
        "incomplete"
    } else {
        "completed"
    }
}

fn render_output(items: &[Item], cut: bool) -> Vec<Value> {
    items
        .iter()
        .enumerate()
        .map(|(index, item)| render_item(item, final_status(index, items.len(), cut), true))
        .collect()
}

/// The output items of a whole completion: the message (text, then refusal) first,
/// then one function call per tool call.
fn items_of(completion: &Value, id: &str) -> Vec<Item> {
    let mut items = Vec::new();
    let Some(message) = first_choice(completion).and_then(|choice| choice.get("message")) else {
        return items;
    };
    let mut parts = Vec::new();
    let text = message.get("content").map(text_of).unwrap_or_default();
    if !text.is_empty() {
        parts.push(Part {
            refusal: false,
            text,
        });
    }
    let refusal = message.get("refusal").map(text_of).unwrap_or_default();
    if !refusal.is_empty() {
        parts.push(Part {
            refusal: true,
            text: refusal,
        });
    }
    if !parts.is_empty() {
        items.push(Item::Message {
            id: message_id(id),
            parts,
        });
    }
    let calls = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for (ordinal, call) in calls.iter().enumerate() {
        let item_id = call_item_id(id, ordinal);
        let function = call.get("function");
        let call_id = call.get("id").map(text_of).unwrap_or_default();
        items.push(Item::Call {
            call_id: if call_id.is_empty() {
                item_id.clone()
            } else {
                call_id
            },
            id: item_id,
            name: function
                .and_then(|f| f.get("name"))
                .map(text_of)
                .unwrap_or_default(),
            arguments: function
                .and_then(|f| f.get("arguments"))
                .map(text_of)
                .unwrap_or_default(),
        });
    }
    items
}

/// The `response` object for a plain chat completion. `id` is "resp_..." chosen by the
/// caller (idem derives it from the completion id and the tenant so every coalesced
/// follower sees the same id); `created_at` in seconds. `model` is the model that
/// answered, as the completion names it.
pub fn response_from_completion(
    completion: &Value,
    id: &str,
    created_at: u64,
    echo: &Echo,
) -> Value {
    let items = items_of(completion, id);
    let finish = first_choice(completion)
        .and_then(|choice| choice.get("finish_reason"))
        .and_then(Value::as_str);
    let reason = incomplete_reason(finish);
    let outcome = match reason {
        Some(reason) => Outcome::Incomplete(reason),
        None => Outcome::Completed,
    };
    let model = completion
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(&echo.model);
    response_object(
        echo,
        id,
        created_at,
        model,
        &outcome,
        render_output(&items, reason.is_some()),
        usage_of(completion.get("usage")),
    )
}

/// Writes one server-sent event with the next sequence number.
fn emit(out: &mut Vec<u8>, sequence: &mut u64, kind: &str, body: Value) {
    let mut event = match body {
        Value::Object(map) => map,
        _ => Map::new(),
    };
    event.insert("type".into(), kind.into());
    event.insert("sequence_number".into(), (*sequence).into());
    *sequence += 1;
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    out.extend_from_slice(Value::Object(event).to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// Chat chunks in, Responses events out, as they arrive; every event has its
/// `sequence_number` (0,1,2,... in order) and is written
/// `event: <type>\ndata: <compact json>\n\n`.
///
/// `response.created` and `response.in_progress` come with the first call. Items open
/// in the order their first delta arrives and all stay open until the end, so chunks
/// from upstreams that interleave tool calls still land in the right item; they are
/// closed (`*.done` events, in output order) just before the final event.
#[derive(Debug, Clone)]
pub struct StreamTranslator {
    id: String,
    created_at: u64,
    echo: Echo,
    sequence: u64,
    started: bool,
    ended: bool,
    model: Option<String>,
    items: Vec<Item>,
    /// Position of the message item in `items`, once text or a refusal arrived.
    message: Option<usize>,
    /// Chat tool call `index` to position in `items`.
    calls: Vec<(u64, usize)>,
    finish_reason: Option<String>,
    usage: Option<Value>,
}

impl StreamTranslator {
    /// A translator for the response `id`, created at `created_at` (seconds).
    pub fn new(id: &str, created_at: u64, echo: Echo) -> Self {
        StreamTranslator {
            id: id.to_owned(),
            created_at,
            echo,
            sequence: 0,
            started: false,
            ended: false,
            model: None,
            items: Vec::new(),
            message: None,
            calls: Vec::new(),
            finish_reason: None,
            usage: None,
        }
    }

    /// One parsed chunk (usage-only chunks with choices: [] included).
    pub fn push(&mut self, chunk: &Value) -> Bytes {
        if self.ended {
            return Bytes::new();
        }
        if self.model.is_none() {
            self.model = chunk
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_owned);
        }
        let mut out = Vec::new();
        self.start(&mut out);
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage = Some(usage.clone());
        }
        let Some(choice) = first_choice(chunk) else {
            return Bytes::from(out);
        };
        if let Some(delta) = choice.get("delta") {
            if let Some(text) = delta.get("content").map(text_of) {
                self.text_delta(&mut out, false, &text);
            }
            if let Some(text) = delta.get("refusal").map(text_of) {
                self.text_delta(&mut out, true, &text);
            }
            if let Some(calls) = delta.get("tool_calls").and_then(Value::as_array) {
                for (position, call) in calls.iter().enumerate() {
                    self.call_delta(&mut out, position, call);
                }
            }
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_owned());
        }
        Bytes::from(out)
    }

    /// The chat stream ended normally: close open parts/items, then `response.completed`
    /// with the full response object (or `response.incomplete` with
    /// `incomplete_details.reason` when the finish reason was `length` or
    /// `content_filter`). Idempotent.
    pub fn finish(&mut self) -> Bytes {
        if self.ended {
            return Bytes::new();
        }
        self.ended = true;
        let mut out = Vec::new();
        self.start(&mut out);
        let reason = incomplete_reason(self.finish_reason.as_deref());
        let count = self.items.len();
        for (index, item) in self.items.iter().enumerate() {
            let status = final_status(index, count, reason.is_some());
            match item {
                Item::Message { id, parts } => {
                    for (content_index, part) in parts.iter().enumerate() {
                        let (kind, key) = if part.refusal {
                            ("response.refusal.done", "refusal")
                        } else {
                            ("response.output_text.done", "text")
                        };
                        let mut body = json!({
                            "item_id": id,
                            "output_index": index,
                            "content_index": content_index,
                        });
                        body[key] = Value::String(part.text.clone());
                        if !part.refusal {
                            body["logprobs"] = json!([]);
                        }
                        emit(&mut out, &mut self.sequence, kind, body);
                        emit(
                            &mut out,
                            &mut self.sequence,
                            "response.content_part.done",
                            json!({
                                "item_id": id,
                                "output_index": index,
                                "content_index": content_index,
                                "part": render_part(part, &part.text),
                            }),
                        );
                    }
                }
                Item::Call {
                    id,
                    name,
                    arguments,
                    ..
                } => emit(
                    &mut out,
                    &mut self.sequence,
                    "response.function_call_arguments.done",
                    json!({
                        "item_id": id,
                        "output_index": index,
                        "name": name,
                        "arguments": arguments,
                    }),
                ),
            }
            emit(
                &mut out,
                &mut self.sequence,
                "response.output_item.done",
                json!({"output_index": index, "item": render_item(item, status, true)}),
            );
        }
        let (kind, outcome) = match reason {
            Some(reason) => ("response.incomplete", Outcome::Incomplete(reason)),
            None => ("response.completed", Outcome::Completed),
        };
        let response = self.response(&outcome, render_output(&self.items, reason.is_some()));
        emit(
            &mut out,
            &mut self.sequence,
            kind,
            json!({"response": response}),
        );
        Bytes::from(out)
    }

    /// The stream failed mid-way (`message` from the upstream error): `response.failed`
    /// with status failed and error {code, message}, its output holding what arrived so
    /// far (items marked incomplete). Use a code the SDK knows, such as `server_error`
    /// or `rate_limit_exceeded`. Idempotent with finish (only one of them emits).
    pub fn fail(&mut self, code: &str, message: &str) -> Bytes {
        if self.ended {
            return Bytes::new();
        }
        self.ended = true;
        let mut out = Vec::new();
        self.start(&mut out);
        let output = self
            .items
            .iter()
            .map(|item| render_item(item, "incomplete", true))
            .collect();
        let response = self.response(&Outcome::Failed { code, message }, output);
        emit(
            &mut out,
            &mut self.sequence,
            "response.failed",
            json!({"response": response}),
        );
        Bytes::from(out)
    }

    fn response(&self, outcome: &Outcome, output: Vec<Value>) -> Value {
        let usage = match outcome {
            Outcome::InProgress => Value::Null,
            _ => usage_of(self.usage.as_ref()),
        };
        let model = self.model.as_deref().unwrap_or(&self.echo.model);
        response_object(
            &self.echo,
            &self.id,
            self.created_at,
            model,
            outcome,
            output,
            usage,
        )
    }

    /// `response.created` and `response.in_progress`, once.
    fn start(&mut self, out: &mut Vec<u8>) {
        if self.started {
            return;
        }
        self.started = true;
        let response = self.response(&Outcome::InProgress, Vec::new());
        emit(
            out,
            &mut self.sequence,
            "response.created",
            json!({"response": response}),
        );
        emit(
            out,
            &mut self.sequence,
            "response.in_progress",
            json!({"response": response}),
        );
    }

    /// Appends text (or refusal text) to the message item, opening the item and the
    /// part first if needed.
    fn text_delta(&mut self, out: &mut Vec<u8>, refusal: bool, delta: &str) {
        if delta.is_empty() {
            return;
        }
        let output_index = match self.message {
            Some(index) => index,
            None => {
                let index = self.items.len();
                let item = Item::Message {
                    id: message_id(&self.id),
                    parts: Vec::new(),
                };
                emit(
                    out,
                    &mut self.sequence,
                    "response.output_item.added",
                    json!({"output_index": index, "item": render_item(&item, "in_progress", false)}),
                );
                self.items.push(item);
                self.message = Some(index);
                index
            }
        };
        let Some(Item::Message { id, parts }) = self.items.get_mut(output_index) else {
            return;
        };
        let content_index = match parts.iter().position(|p| p.refusal == refusal) {
            Some(content_index) => content_index,
            None => {
                let part = Part {
                    refusal,
                    text: String::new(),
                };
                emit(
                    out,
                    &mut self.sequence,
                    "response.content_part.added",
                    json!({
                        "item_id": id,
                        "output_index": output_index,
                        "content_index": parts.len(),
                        "part": render_part(&part, ""),
                    }),
                );
                parts.push(part);
                parts.len() - 1
            }
        };
        if let Some(part) = parts.get_mut(content_index) {
            part.text.push_str(delta);
        }
        let mut body = json!({
            "item_id": id,
            "output_index": output_index,
            "content_index": content_index,
            "delta": delta,
        });
        let kind = if refusal {
            "response.refusal.delta"
        } else {
            body["logprobs"] = json!([]);
            "response.output_text.delta"
        };
        emit(out, &mut self.sequence, kind, body);
    }

    /// Applies one tool call fragment, opening its function call item on first sight.
    fn call_delta(&mut self, out: &mut Vec<u8>, position: usize, call: &Value) {
        let chat_index = call
            .get("index")
            .and_then(Value::as_u64)
            .unwrap_or(position as u64);
        let function = call.get("function");
        let name = function
            .and_then(|f| f.get("name"))
            .map(text_of)
            .unwrap_or_default();
        let call_id = call.get("id").map(text_of).unwrap_or_default();
        let fragment = function
            .and_then(|f| f.get("arguments"))
            .map(text_of)
            .unwrap_or_default();
        let known = self
            .calls
            .iter()
            .find(|(index, _)| *index == chat_index)
            .map(|(_, at)| *at);
        let output_index = match known {
            Some(at) => {
                // Late names or ids from upstreams that split them complete the item.
                if let Some(Item::Call {
                    name: known_name,
                    call_id: known_id,
                    ..
                }) = self.items.get_mut(at)
                {
                    if known_id.is_empty() {
                        known_id.push_str(&call_id);
                    }
                    if known_name != &name {
                        known_name.push_str(&name);
                    }
                }
                at
            }
            None => {
                let at = self.items.len();
                let id = call_item_id(&self.id, self.calls.len());
                let item = Item::Call {
                    call_id: if call_id.is_empty() {
                        id.clone()
                    } else {
                        call_id
                    },
                    id,
                    name,
                    arguments: String::new(),
                };
                emit(
                    out,
                    &mut self.sequence,
                    "response.output_item.added",
                    json!({"output_index": at, "item": render_item(&item, "in_progress", false)}),
                );
                self.items.push(item);
                self.calls.push((chat_index, at));
                at
            }
        };
        if fragment.is_empty() {
            return;
        }
        if let Some(Item::Call { id, arguments, .. }) = self.items.get_mut(output_index) {
            arguments.push_str(&fragment);
            emit(
                out,
                &mut self.sequence,
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": output_index, "delta": fragment}),
            );
        }
    }
}

/// The chat chunks a streaming upstream would have sent for `completion`: a role chunk,
/// the text and then the refusal in pieces of at most 256 bytes, each tool call whole
/// in one chunk, the finish chunk, and a usage-only chunk when there is usage.
fn chunks_of(completion: &Value) -> Vec<Value> {
    let mut head = Map::new();
    for key in ["id", "created", "model", "system_fingerprint"] {
        if let Some(value) = completion.get(key) {
            head.insert(key.into(), value.clone());
        }
    }
    head.insert("object".into(), "chat.completion.chunk".into());
    let chunk = |choices: Value| {
        let mut chunk = head.clone();
        chunk.insert("choices".into(), choices);
        Value::Object(chunk)
    };
    let delta = |delta: Value| chunk(json!([{"index": 0, "delta": delta, "finish_reason": null}]));

    let mut chunks = vec![delta(json!({"role": "assistant", "content": ""}))];
    let choice = first_choice(completion);
    let message = choice.and_then(|c| c.get("message"));
    if let Some(message) = message {
        let text = message.get("content").map(text_of).unwrap_or_default();
        for piece in pieces(&text, PIECE_BYTES) {
            chunks.push(delta(json!({"content": piece})));
        }
        let refusal = message.get("refusal").map(text_of).unwrap_or_default();
        for piece in pieces(&refusal, PIECE_BYTES) {
            chunks.push(delta(json!({"refusal": piece})));
        }
        let calls = message
            .get("tool_calls")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        for (index, call) in calls.iter().enumerate() {
            let mut call = call.clone();
            call["index"] = index.into();
            chunks.push(delta(json!({"tool_calls": [call]})));
        }
    }
    let finish = choice
        .and_then(|c| c.get("finish_reason"))
        .cloned()
        .unwrap_or(Value::Null);
    chunks.push(chunk(
        json!([{"index": 0, "delta": {}, "finish_reason": finish}]),
    ));
    if let Some(usage) = completion.get("usage").filter(|u| u.is_object()) {
        let mut last = head.clone();
        last.insert("choices".into(), json!([]));
        last.insert("usage".into(), usage.clone());
        chunks.push(Value::Object(last));
    }
    chunks
}

/// A whole completion as the full event stream (for followers and cache hits that asked
/// for a stream); equal to feeding the synthesized chunks of that completion through
/// [`StreamTranslator`] (text in pieces of at most 256 bytes, on char boundaries; each
/// tool call's arguments in one piece).
pub fn stream_from_completion(completion: &Value, id: &str, created_at: u64, echo: &Echo) -> Bytes {
    let mut translator = StreamTranslator::new(id, created_at, echo.clone());
    let mut out = Vec::new();
    for chunk in chunks_of(completion) {
        out.extend_from_slice(&translator.push(&chunk));
    }
    out.extend_from_slice(&translator.finish());
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    fn translate(request: Value) -> Translated {
        to_chat(&object(request), &[]).expect("request should translate")
    }

    fn refusal_param(request: Value) -> String {
        let refusal = to_chat(&object(request), &[]).expect_err("request should be refused");
        refusal.param.expect("refusals name their field")
    }

    /// The SDK's `Response.output_text`: every `output_text` part of every `message`.
    fn output_text(response: &Value) -> String {
        let mut text = String::new();
        for item in response["output"].as_array().expect("output is a list") {
            if item["type"] == "message" {
                for part in item["content"].as_array().expect("content is a list") {
                    if part["type"] == "output_text" {
                        text.push_str(part["text"].as_str().expect("text is a string"));
                    }
                }
            }
        }
        text
    }

    /// Splits an SSE body into (event name, data), checking the framing on the way.
    fn events(body: &[u8]) -> Vec<(String, Value)> {
        let body = std::str::from_utf8(body).expect("utf-8");
        assert!(body.is_empty() || body.ends_with("\n\n"), "{body}");
        body.split_terminator("\n\n")
            .map(|block| {
                let (head, data) = block.split_once('\n').expect("two lines per event");
                let name = head.strip_prefix("event: ").expect("event line");
                let data = data.strip_prefix("data: ").expect("data line");
                assert!(!data.contains('\n'), "data is compact json");
                let data: Value = serde_json::from_str(data).expect("data is json");
                assert_eq!(data["type"], name, "event name and type agree");
                (name.to_owned(), data)
            })
            .collect()
    }

    fn kinds(events: &[(String, Value)]) -> Vec<&str> {
        events.iter().map(|(name, _)| name.as_str()).collect()
    }

    fn assert_sequence(events: &[(String, Value)]) {
        for (expected, (_, data)) in events.iter().enumerate() {
            assert_eq!(data["sequence_number"], expected as u64, "{data}");
        }
    }

    fn completion(message: Value, finish_reason: &str) -> Value {
        json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": "gpt-4o-2024-08-06",
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
            "usage": {
                "prompt_tokens": 20,
                "completion_tokens": 7,
                "total_tokens": 27,
                "prompt_tokens_details": {"cached_tokens": 4},
                "completion_tokens_details": {"reasoning_tokens": 2},
            },
        })
    }

    fn echo() -> Echo {
        Echo::of(&object(json!({
            "model": "gpt-4o",
            "instructions": "Be brief.",
            "input": "hi",
            "temperature": 0.2,
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        })))
    }

    #[test]
    fn string_input_is_one_user_message() {
        let translated = translate(json!({"model": "gpt-4o", "input": "Hello"}));
        assert_eq!(
            Value::Object(translated.chat),
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello"}]})
        );
        assert_eq!(translated.model, "gpt-4o");
        assert!(!translated.stream);
        assert_eq!(translated.store, None);
        assert_eq!(translated.previous_response_id, None);
        assert_eq!(
            translated.turns,
            vec![json!({"role": "user", "content": "Hello"})]
        );
    }

    #[test]
    fn item_list_translates_roles_images_and_a_tool_round_trip() {
        let translated = translate(json!({
            "model": "gpt-4o",
            "input": [
                {"role": "developer", "content": "Answer in French."},
                {"type": "message", "role": "user", "content": [
                    {"type": "input_text", "text": "What is this and how warm is it there?"},
                    {"type": "input_image", "image_url": "https://example.com/paris.png", "detail": "low"},
                    {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo=", "detail": null},
                ]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant", "content": [
                    {"type": "output_text", "text": "Paris. ", "annotations": []},
                    {"type": "output_text", "text": "Let me check.", "annotations": []},
                ]},
                {"type": "function_call", "id": "fc_1", "call_id": "call_a", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"type": "function_call", "call_id": "call_b", "name": "get_time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_a", "output": "21C"},
                {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "14:00"}]},
                {"role": "user", "content": "Thanks"},
            ],
        }));
        let expected = vec![
            json!({"role": "developer", "content": "Answer in French."}),
            json!({"role": "user", "content": [
                {"type": "text", "text": "What is this and how warm is it there?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/paris.png", "detail": "low"}},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
            ]}),
            json!({"role": "assistant", "content": "Paris. Let me check.", "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ]}),
            json!({"role": "tool", "tool_call_id": "call_a", "content": "21C"}),
            json!({"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "14:00"}]}),
            json!({"role": "user", "content": "Thanks"}),
        ];
        assert_eq!(translated.chat["messages"], Value::Array(expected.clone()));
        assert_eq!(translated.turns, expected);
    }

    #[test]
    fn function_calls_without_a_preceding_assistant_message_start_one() {
        let translated = translate(json!({
            "model": "m",
            "input": [
                {"role": "user", "content": "weather?"},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
            ],
        }));
        assert_eq!(
            translated.turns,
            vec![
                json!({"role": "user", "content": "weather?"}),
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                ]}),
                json!({"role": "tool", "tool_call_id": "c1", "content": "sunny"}),
                json!({"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{}"}},
                ]}),
            ]
        );
    }

    #[test]
    fn assistant_refusal_parts_become_the_chat_refusal() {
        let translated = translate(json!({
            "model": "m",
            "input": [{"type": "message", "role": "assistant", "content": [
                {"type": "refusal", "refusal": "I can't help with that."},
            ]}],
        }));
        assert_eq!(
            translated.turns,
            vec![
                json!({"role": "assistant", "content": null, "refusal": "I can't help with that."})
            ]
        );
    }

    #[test]
    fn instructions_come_first_then_history_then_this_input() {
        let history = vec![
            json!({"role": "user", "content": "My name is Ada."}),
            json!({"role": "assistant", "content": "Hello Ada."}),
        ];
        let request = object(json!({
            "model": "m",
            "instructions": "Be brief.",
            "previous_response_id": "resp_prev",
            "input": "What is my name?",
        }));
        let translated = to_chat(&request, &history).expect("translates");
        assert_eq!(
            translated.chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": "Hello Ada."},
                {"role": "user", "content": "What is my name?"},
            ])
        );
        assert_eq!(
            translated.turns,
            vec![json!({"role": "user", "content": "What is my name?"})]
        );
        assert_eq!(
            translated.previous_response_id.as_deref(),
            Some("resp_prev")
        );
    }

    #[test]
    fn tools_choice_format_and_reasoning_map_to_chat_and_noise_is_dropped() {
        let translated = translate(json!({
            "model": "o4-mini",
            "input": "hi",
            "temperature": 0.3,
            "top_p": 0.9,
            "max_output_tokens": 500,
            "parallel_tool_calls": false,
            "user": "u-1",
            "safety_identifier": "s-1",
            "tools": [
                {"type": "function", "name": "get_weather", "description": "Weather now",
                 "parameters": {"type": "object", "properties": {}}, "strict": true},
                {"type": "function", "name": "noop", "parameters": null, "strict": null},
            ],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_schema", "name": "answer", "description": "An answer",
                                "schema": {"type": "object"}, "strict": true},
                     "verbosity": "low"},
            "reasoning": {"effort": "high", "summary": "auto"},
            "stream": true,
            "stream_options": {"include_obfuscation": false},
            "store": false,
            "previous_response_id": null,
            "metadata": {"k": "v"},
            "include": ["reasoning.encrypted_content"],
            "truncation": "auto",
            "service_tier": "flex",
            "prompt_cache_key": "key",
            "max_tool_calls": 3,
            "background": false,
            "top_logprobs": 0,
            "seed": 7,
        }));
        assert_eq!(
            Value::Object(translated.chat),
            json!({
                "model": "o4-mini",
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": 0.3,
                "top_p": 0.9,
                "max_completion_tokens": 500,
                "parallel_tool_calls": false,
                "user": "u-1",
                "safety_identifier": "s-1",
                "tools": [
                    {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                     "parameters": {"type": "object", "properties": {}}, "strict": true}},
                    {"type": "function", "function": {"name": "noop"}},
                ],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "answer", "description": "An answer", "schema": {"type": "object"}, "strict": true}},
                "verbosity": "low",
                "reasoning_effort": "high",
                "stream": true,
                "seed": 7,
            })
        );
        assert!(translated.stream);
        assert_eq!(translated.store, Some(false));
    }

    #[test]
    fn other_formats_and_tool_choices_map_too() {
        let chat = translate(json!({
            "model": "m", "input": "x", "text": {"format": {"type": "json_object"}}, "tool_choice": "required",
        }))
        .chat;
        assert_eq!(chat["response_format"], json!({"type": "json_object"}));
        assert_eq!(chat["tool_choice"], "required");

        let chat = translate(json!({
            "model": "m", "input": "x", "text": {"format": {"type": "text"}}, "tools": [],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": "a"}]},
        }))
        .chat;
        assert!(!chat.contains_key("response_format"));
        assert!(
            !chat.contains_key("tools"),
            "an empty tools list is left out"
        );
        assert_eq!(
            chat["tool_choice"],
            json!({"type": "allowed_tools", "allowed_tools": {"mode": "required",
                   "tools": [{"type": "function", "function": {"name": "a"}}]}})
        );
    }

    #[test]
    fn unsupported_requests_are_refused_with_their_param() {
        let cases = [
            (json!({"input": "hi"}), "model"),
            (json!({"model": 4, "input": "hi"}), "model"),
            (json!({"model": "m"}), "input"),
            (json!({"model": "m", "input": 42}), "input"),
            (
                json!({"model": "m", "input": [{"role": "user", "content": 42}]}),
                "input.0.content",
            ),
            (
                json!({"model": "m", "input": [{"role": "tool", "content": "x"}]}),
                "input.0.role",
            ),
            (
                json!({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}),
                "tools.0.type",
            ),
            (
                json!({"model": "m", "input": "hi", "tools": [
                    {"type": "function", "name": "f"}, {"type": "file_search", "vector_store_ids": []}]}),
                "tools.1.type",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [
                    {"type": "input_text", "text": "read this"},
                    {"type": "input_file", "file_id": "file-1"}]}]}),
                "input.0.content.1.type",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": [
                    {"type": "input_image", "file_id": "file-1", "detail": "auto"}]}]}),
                "input.0.content.0.file_id",
            ),
            (
                json!({"model": "m", "input": [{"role": "system", "content": [
                    {"type": "input_image", "image_url": "https://x/y.png", "detail": "auto"}]}]}),
                "input.0.content.0.type",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": "hi"},
                                               {"type": "item_reference", "id": "msg_1"}]}),
                "input.1.type",
            ),
            (
                json!({"model": "m", "input": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x"},
                                               {"role": "user", "content": "y"},
                                               {"type": "computer_call_output", "call_id": "c"}]}),
                "input.3.type",
            ),
            (
                json!({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}),
                "input.0.arguments",
            ),
            (
                json!({"model": "m", "input": "hi", "background": true}),
                "background",
            ),
            (
                json!({"model": "m", "input": "hi", "conversation": "conv_1"}),
                "conversation",
            ),
            (
                json!({"model": "m", "input": "hi", "prompt": {"id": "pmpt_1"}}),
                "prompt",
            ),
            (
                json!({"model": "m", "input": "hi", "top_logprobs": 5}),
                "top_logprobs",
            ),
            (
                json!({"model": "m", "input": "hi", "tool_choice": {"type": "web_search_preview"}}),
                "tool_choice.type",
            ),
            (
                json!({"model": "m", "input": "hi", "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"model": "m", "input": "hi", "text": {"format": {"type": "grammar"}}}),
                "text.format.type",
            ),
            (
                json!({"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}),
                "text.format.name",
            ),
            (
                json!({"model": "m", "input": "hi", "stream": "yes"}),
                "stream",
            ),
            (
                json!({"model": "m", "input": "hi", "instructions": ["x"]}),
                "instructions",
            ),
        ];
        for (request, param) in cases {
            assert_eq!(refusal_param(request.clone()), param, "{request}");
        }
        let refusal = to_chat(
            &object(json!({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]})),
            &[],
        )
        .expect_err("refused");
        assert!(
            refusal.message.contains("web_search"),
            "{}",
            refusal.message
        );
        assert_eq!(refusal.to_string(), refusal.message);
    }

    #[test]
    fn text_completion_renders_a_response_the_sdk_reads() {
        let done = completion(
            json!({"role": "assistant", "content": "Hello there."}),
            "stop",
        );
        let response = response_from_completion(&done, "resp_abc", 1_700_000_001, &echo());
        assert_eq!(output_text(&response), "Hello there.");
        assert_eq!(response["id"], "resp_abc");
        assert_eq!(response["object"], "response");
        assert_eq!(response["created_at"], 1_700_000_001);
        assert_eq!(response["status"], "completed");
        assert_eq!(response["error"], Value::Null);
        assert_eq!(response["incomplete_details"], Value::Null);
        assert_eq!(response["model"], "gpt-4o-2024-08-06");
        assert_eq!(
            response["output"],
            json!([{
                "id": "msg_abc", "type": "message", "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello there.", "annotations": [], "logprobs": []}],
            }])
        );
        // The echo of the request.
        assert_eq!(response["instructions"], "Be brief.");
        assert_eq!(response["temperature"], 0.2);
        assert_eq!(response["top_p"], Value::Null);
        assert_eq!(response["tool_choice"], "auto");
        assert_eq!(response["tools"][0]["name"], "get_weather");
        assert_eq!(response["parallel_tool_calls"], true);
        assert_eq!(response["store"], true);
        assert_eq!(response["metadata"], json!({}));
        assert_eq!(response["text"], json!({"format": {"type": "text"}}));
        assert_eq!(
            response["reasoning"],
            json!({"effort": null, "summary": null})
        );
        assert_eq!(response["truncation"], "disabled");
        assert_eq!(response["previous_response_id"], Value::Null);
    }

    #[test]
    fn usage_maps_to_responses_names() {
        let done = completion(json!({"role": "assistant", "content": "x"}), "stop");
        let response = response_from_completion(&done, "resp_abc", 1, &echo());
        assert_eq!(
            response["usage"],
            json!({
                "input_tokens": 20,
                "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
                "output_tokens": 7,
                "output_tokens_details": {"reasoning_tokens": 2},
                "total_tokens": 27,
            })
        );
        let mut bare = done.clone();
        bare["usage"] = json!({"prompt_tokens": 3, "completion_tokens": 2});
        let response = response_from_completion(&bare, "resp_abc", 1, &echo());
        assert_eq!(response["usage"]["total_tokens"], 5);
        assert_eq!(
            response["usage"]["input_tokens_details"]["cached_tokens"],
            0
        );
        bare.as_object_mut().expect("object").remove("usage");
        let response = response_from_completion(&bare, "resp_abc", 1, &echo());
        assert_eq!(response["usage"], Value::Null);
    }

    #[test]
    fn tool_calls_become_function_call_items() {
        let done = completion(
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ]}),
            "tool_calls",
        );
        let response = response_from_completion(&done, "resp_abc", 1, &echo());
        assert_eq!(response["status"], "completed");
        assert_eq!(output_text(&response), "");
        assert_eq!(
            response["output"],
            json!([
                {"id": "fc_abc_0", "type": "function_call", "status": "completed", "call_id": "call_1",
                 "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
                {"id": "fc_abc_1", "type": "function_call", "status": "completed", "call_id": "call_2",
                 "name": "get_time", "arguments": "{}"},
            ])
        );
    }

    #[test]
    fn length_and_content_filter_make_an_incomplete_response() {
        let done = completion(
            json!({"role": "assistant", "content": "Once upon a"}),
            "length",
        );
        let response = response_from_completion(&done, "resp_abc", 1, &echo());
        assert_eq!(response["status"], "incomplete");
        assert_eq!(
            response["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        assert_eq!(response["output"][0]["status"], "incomplete");
        assert_eq!(output_text(&response), "Once upon a");

        let done = completion(
            json!({"role": "assistant", "content": "Well"}),
            "content_filter",
        );
        let response = response_from_completion(&done, "resp_abc", 1, &echo());
        assert_eq!(response["status"], "incomplete");
        assert_eq!(
            response["incomplete_details"],
            json!({"reason": "content_filter"})
        );
    }

    #[test]
    fn refusals_render_as_refusal_parts() {
        let done = completion(
            json!({"role": "assistant", "content": null, "refusal": "I can't help with that."}),
            "stop",
        );
        let response = response_from_completion(&done, "resp_abc", 1, &echo());
        assert_eq!(
            response["output"][0]["content"],
            json!([{"type": "refusal", "refusal": "I can't help with that."}])
        );
        assert_eq!(output_text(&response), "");
    }

    #[test]
    fn answer_turns_keep_the_assistant_message_for_the_conversation() {
        let done = completion(
            json!({"role": "assistant", "content": "Checking.", "annotations": [], "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            ]}),
            "tool_calls",
        );
        assert_eq!(
            answer_turns(&done),
            vec![
                json!({"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                ]})
            ]
        );
        let done = completion(json!({"role": "assistant", "content": "Hi."}), "stop");
        assert_eq!(
            answer_turns(&done),
            vec![json!({"role": "assistant", "content": "Hi."})]
        );
        let done = completion(
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
            "tool_calls",
        );
        assert_eq!(answer_turns(&done)[0]["content"], Value::Null);
        assert!(answer_turns(&json!({"choices": []})).is_empty());
    }

    fn chunk(choices: Value) -> Value {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
               "model": "gpt-4o-2024-08-06", "choices": choices})
    }

    fn delta(delta: Value) -> Value {
        chunk(json!([{"index": 0, "delta": delta, "finish_reason": null}]))
    }

    /// A realistic upstream stream: role, text, two tool calls with fragmented
    /// arguments, the finish chunk, then a usage-only chunk.
    fn live_chunks() -> Vec<Value> {
        vec![
            delta(json!({"role": "assistant", "content": ""})),
            delta(json!({"content": "Let me "})),
            delta(json!({"content": "check."})),
            delta(
                json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": ""}}]}),
            ),
            delta(json!({"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]})),
            delta(json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]})),
            delta(
                json!({"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                          "function": {"name": "get_time", "arguments": "{\"tz\":"}}]}),
            ),
            delta(json!({"tool_calls": [{"index": 1, "function": {"arguments": "\"CET\"}"}}]})),
            chunk(json!([{"index": 0, "delta": {}, "finish_reason": "tool_calls"}])),
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
                   "model": "gpt-4o-2024-08-06", "choices": [],
                   "usage": {"prompt_tokens": 20, "completion_tokens": 7, "total_tokens": 27,
                             "prompt_tokens_details": {"cached_tokens": 4},
                             "completion_tokens_details": {"reasoning_tokens": 2}}}),
        ]
    }

    fn run(chunks: &[Value]) -> Vec<u8> {
        let mut translator = StreamTranslator::new("resp_abc", 1_700_000_001, echo());
        let mut body = Vec::new();
        for chunk in chunks {
            body.extend_from_slice(&translator.push(chunk));
        }
        body.extend_from_slice(&translator.finish());
        body
    }

    #[test]
    fn live_translator_emits_the_responses_event_sequence() {
        let events = events(&run(&live_chunks()));
        assert_eq!(
            kinds(&events),
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_sequence(&events);

        let created = &events[0].1["response"];
        assert_eq!(created["status"], "in_progress");
        assert_eq!(created["output"], json!([]));
        assert_eq!(created["id"], "resp_abc");
        assert_eq!(
            events[2].1["item"],
            json!({"id": "msg_abc", "type": "message",
            "status": "in_progress", "role": "assistant", "content": []})
        );
        assert_eq!(
            events[3].1["part"],
            json!({"type": "output_text", "text": "",
            "annotations": [], "logprobs": []})
        );
        assert_eq!(events[4].1["delta"], "Let me ");
        assert_eq!(events[4].1["item_id"], "msg_abc");
        assert_eq!(events[4].1["content_index"], 0);
        assert_eq!(events[6].1["output_index"], 1);
        assert_eq!(
            events[6].1["item"],
            json!({"id": "fc_abc_0", "type": "function_call",
            "status": "in_progress", "call_id": "call_1", "name": "get_weather", "arguments": ""})
        );
        assert_eq!(events[8].1["delta"], "\"Paris\"}");
        assert_eq!(events[8].1["item_id"], "fc_abc_0");
        assert_eq!(events[9].1["output_index"], 2);
        assert_eq!(events[12].1["text"], "Let me check.");
        assert_eq!(events[15].1["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(events[15].1["name"], "get_weather");
        assert_eq!(events[17].1["arguments"], "{\"tz\":\"CET\"}");
        assert_eq!(events[18].1["item"]["status"], "completed");

        let response = &events[19].1["response"];
        assert_eq!(response["status"], "completed");
        assert_eq!(output_text(response), "Let me check.");
        assert_eq!(response["usage"]["input_tokens"], 20);
        assert_eq!(response["output"][1]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(response["output"][2]["call_id"], "call_2");
    }

    #[test]
    fn deltas_accumulate_into_the_final_output_like_the_sdk_does() {
        let events = events(&run(&live_chunks()));
        let mut snapshot = events[0].1["response"].clone();
        for (name, data) in &events[1..] {
            let index = data["output_index"].as_u64().unwrap_or(0) as usize;
            match name.as_str() {
                "response.output_item.added" => snapshot["output"]
                    .as_array_mut()
                    .expect("list")
                    .push(data["item"].clone()),
                "response.content_part.added" => snapshot["output"][index]["content"]
                    .as_array_mut()
                    .expect("list")
                    .push(data["part"].clone()),
                "response.output_text.delta" => {
                    let content = data["content_index"].as_u64().expect("index") as usize;
                    let text = &mut snapshot["output"][index]["content"][content]["text"];
                    *text = format!(
                        "{}{}",
                        text.as_str().expect("text"),
                        data["delta"].as_str().expect("delta")
                    )
                    .into();
                }
                "response.function_call_arguments.delta" => {
                    let arguments = &mut snapshot["output"][index]["arguments"];
                    *arguments = format!(
                        "{}{}",
                        arguments.as_str().expect("args"),
                        data["delta"].as_str().expect("delta")
                    )
                    .into();
                }
                "response.output_item.done" => snapshot["output"][index] = data["item"].clone(),
                _ => {}
            }
        }
        let completed = &events.last().expect("events").1["response"];
        assert_eq!(snapshot["output"], completed["output"]);
    }

    /// A chunking of a completion written independently of `chunks_of`: text in pieces
    /// of at most 256 bytes on char boundaries, tool calls whole.
    fn test_chunks(done: &Value) -> Vec<Value> {
        let message = &done["choices"][0]["message"];
        let mut chunks = vec![delta(json!({"role": "assistant", "content": ""}))];
        for (key, text) in [
            ("content", &message["content"]),
            ("refusal", &message["refusal"]),
        ] {
            let mut piece = String::new();
            for ch in text.as_str().unwrap_or("").chars() {
                if piece.len() + ch.len_utf8() > 256 {
                    chunks.push(delta(json!({ key: piece })));
                    piece = String::new();
                }
                piece.push(ch);
            }
            if !piece.is_empty() {
                chunks.push(delta(json!({ key: piece })));
            }
        }
        if let Some(calls) = message["tool_calls"].as_array() {
            for (index, call) in calls.iter().enumerate() {
                chunks.push(delta(
                    json!({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                    "function": call["function"]}]}),
                ));
            }
        }
        chunks.push(chunk(json!([{"index": 0, "delta": {}, "finish_reason": done["choices"][0]["finish_reason"]}])));
        chunks.push(
            json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1_700_000_000,
                           "model": "gpt-4o-2024-08-06", "choices": [], "usage": done["usage"]}),
        );
        chunks
    }

    fn sample_completions() -> Vec<Value> {
        let long: String = "Grüße aus Köln, 東京 und Zürich! ".repeat(30);
        vec![
            completion(json!({"role": "assistant", "content": long}), "stop"),
            completion(
                json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
                ]}),
                "tool_calls",
            ),
            completion(
                json!({"role": "assistant", "content": "Once upon a"}),
                "length",
            ),
            completion(
                json!({"role": "assistant", "content": null, "refusal": "No."}),
                "stop",
            ),
            completion(json!({"role": "assistant", "content": ""}), "stop"),
        ]
    }

    #[test]
    fn stream_from_completion_equals_the_translator_fed_its_chunks() {
        for done in sample_completions() {
            let whole = stream_from_completion(&done, "resp_abc", 1_700_000_001, &echo());
            assert_eq!(
                whole.as_ref(),
                run(&test_chunks(&done)).as_slice(),
                "{done}"
            );
            let events = events(&whole);
            assert_sequence(&events);
            for (name, data) in &events {
                if name == "response.output_text.delta" {
                    assert!(data["delta"].as_str().expect("delta").len() <= 256);
                }
            }
        }
    }

    #[test]
    fn the_streamed_final_response_equals_the_plain_one() {
        for done in sample_completions() {
            let plain = response_from_completion(&done, "resp_abc", 1_700_000_001, &echo());
            let events = events(&stream_from_completion(
                &done,
                "resp_abc",
                1_700_000_001,
                &echo(),
            ));
            let (name, last) = events.last().expect("events");
            let expected = if plain["status"] == "incomplete" {
                "response.incomplete"
            } else {
                "response.completed"
            };
            assert_eq!(name, expected);
            assert_eq!(last["response"], plain, "{done}");
        }
        // And the live stream, whose chunks differ from the synthesized ones.
        let live = events(&run(&live_chunks()));
        let done = completion(
            json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\":\"CET\"}"}},
            ]}),
            "tool_calls",
        );
        assert_eq!(
            live.last().expect("events").1["response"],
            response_from_completion(&done, "resp_abc", 1_700_000_001, &echo())
        );
    }

    #[test]
    fn length_in_a_stream_ends_with_response_incomplete() {
        let chunks = vec![
            delta(json!({"role": "assistant", "content": "Once"})),
            chunk(json!([{"index": 0, "delta": {}, "finish_reason": "length"}])),
        ];
        let events = events(&run(&chunks));
        let (name, last) = events.last().expect("events");
        assert_eq!(name, "response.incomplete");
        assert_eq!(last["response"]["status"], "incomplete");
        assert_eq!(
            last["response"]["incomplete_details"],
            json!({"reason": "max_output_tokens"})
        );
        assert_eq!(last["response"]["usage"], Value::Null);
        let item_done = &events[events.len() - 2].1;
        assert_eq!(item_done["item"]["status"], "incomplete");
    }

    #[test]
    fn finish_and_fail_emit_once_between_them() {
        let mut translator = StreamTranslator::new("resp_abc", 1, echo());
        let first = events(&translator.push(&delta(json!({"content": "Hal"}))));
        assert_eq!(
            kinds(&first),
            vec![
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta"
            ]
        );
        let failed = events(&translator.fail("server_error", "upstream reset the connection"));
        assert_eq!(kinds(&failed), vec!["response.failed"]);
        assert_eq!(failed[0].1["sequence_number"], 5);
        let response = &failed[0].1["response"];
        assert_eq!(response["status"], "failed");
        assert_eq!(
            response["error"],
            json!({"code": "server_error", "message": "upstream reset the connection"})
        );
        assert_eq!(response["output"][0]["status"], "incomplete");
        assert_eq!(output_text(response), "Hal");
        assert!(translator.finish().is_empty());
        assert!(translator.fail("server_error", "again").is_empty());
        assert!(
            translator
                .push(&delta(json!({"content": "late"})))
                .is_empty()
        );

        let mut translator = StreamTranslator::new("resp_abc", 1, echo());
        let done = events(&translator.finish());
        assert_eq!(
            kinds(&done),
            vec![
                "response.created",
                "response.in_progress",
                "response.completed"
            ]
        );
        assert_sequence(&done);
        assert!(translator.finish().is_empty());
        assert!(translator.fail("server_error", "x").is_empty());

        let mut translator = StreamTranslator::new("resp_abc", 1, echo());
        let failed = events(&translator.fail("server_error", "no upstream"));
        assert_eq!(
            kinds(&failed),
            vec![
                "response.created",
                "response.in_progress",
                "response.failed"
            ]
        );
        assert_eq!(failed[2].1["response"]["model"], "gpt-4o");
    }

    #[test]
    fn other_choices_are_ignored() {
        let chunks = vec![
            chunk(json!([{"index": 1, "delta": {"content": "other"}, "finish_reason": null}])),
            chunk(
                json!([{"index": 0, "delta": {"content": "mine"}, "finish_reason": "stop"},
                         {"index": 1, "delta": {"content": "other"}, "finish_reason": "length"}]),
            ),
        ];
        let events = events(&run(&chunks));
        let response = &events.last().expect("events").1["response"];
        assert_eq!(output_text(response), "mine");
        assert_eq!(response["status"], "completed");
    }

    #[test]
    fn echo_reflects_the_request() {
        let echo = Echo::of(&object(json!({
            "model": "gpt-4o",
            "input": "x",
            "store": false,
            "previous_response_id": "resp_prev",
            "metadata": {"k": "v"},
            "parallel_tool_calls": false,
            "tool_choice": "none",
            "max_output_tokens": 64,
            "user": "u",
            "text": {"format": {"type": "json_object"}, "verbosity": "high"},
            "reasoning": {"effort": "low", "summary": "concise"},
        })));
        let response = response_from_completion(
            &json!({"choices": [{"index": 0, "message": {"role": "assistant", "content": "{}"}, "finish_reason": "stop"}]}),
            "resp_x",
            5,
            &echo,
        );
        assert_eq!(
            response["model"], "gpt-4o",
            "the asked model when the completion names none"
        );
        assert_eq!(response["store"], false);
        assert_eq!(response["previous_response_id"], "resp_prev");
        assert_eq!(response["metadata"], json!({"k": "v"}));
        assert_eq!(response["parallel_tool_calls"], false);
        assert_eq!(response["tool_choice"], "none");
        assert_eq!(response["max_output_tokens"], 64);
        assert_eq!(response["user"], "u");
        assert_eq!(
            response["text"],
            json!({"format": {"type": "json_object"}, "verbosity": "high"})
        );
        assert_eq!(
            response["reasoning"],
            json!({"effort": "low", "summary": "concise"})
        );
        assert_eq!(response["instructions"], Value::Null);
        assert_eq!(response["output"][0]["id"], "msg_x");
    }
}
