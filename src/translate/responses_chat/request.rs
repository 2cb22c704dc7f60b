//! A Responses request said in chat completions, for a target that speaks
//! chat (or, one step further, Anthropic's Messages API).
//!
//! Request fields, by what becomes of them (docs/http-api.md, "What becomes
//! of each field"):
//!
//! * Translated: `model`; `input` (a string, or a list of message,
//!   `function_call`, `function_call_output`, `custom_tool_call` and
//!   `custom_tool_call_output` items: the conversation a stored response
//!   continues is in it already); `instructions` (a leading system
//!   message); `temperature`, `top_p`, `parallel_tool_calls`, `user`,
//!   `safety_identifier`, `prompt_cache_key` (same names);
//!   `max_output_tokens` (as `max_completion_tokens`); `function` tools;
//!   `custom` tools (as a function with one string argument, `input`, and
//!   their calls back as `custom_tool_call` items); the tools of a
//!   `namespace` (flattened, as `<namespace>__<name>`); the tools of
//!   `additional_tools` input items (joining the request's); `tool_choice`;
//!   `text.format` (as `response_format`); `text.verbosity` (as
//!   `verbosity`); `reasoning.effort` (as `reasoning_effort`); `stream`.
//! * Left out, because a chat target has no use for them and the answer
//!   means the same without them: `store` and `previous_response_id` (idem
//!   keeps responses itself), `metadata` (echoed only), `include`,
//!   `truncation`, `service_tier`, `prompt_cache_retention`,
//!   `client_metadata`, `stream_options`, `max_tool_calls`,
//!   `reasoning.summary`, `background: false`, `top_logprobs: 0`; hosted
//!   tools (`web_search`, `tool_search`, `file_search`, `code_interpreter`,
//!   `image_generation`, `computer_use_preview`, `mcp`): the model is not
//!   offered them; and input items only OpenAI reads back (`reasoning`,
//!   `web_search_call` and the other hosted tools' calls).
//! * Refused with a 400 ([`Refusal`]): `background: true`, `conversation`,
//!   `prompt` (stored prompt templates), `top_logprobs` above 0,
//!   `input_file` parts, images given by `file_id`, `item_reference` items
//!   and any item type chat has no form for, and `text.format` types other
//!   than `text`, `json_object` and `json_schema`.
//! * Unknown top-level fields are copied into the chat request unchanged: a
//!   field idem does not know is assumed to matter, and the upstream may
//!   reject it.

use serde_json::{Map, Value, json};

use crate::translate::Refusal;

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
    "client_metadata",
    "conversation",
    "prompt",
    "max_tool_calls",
    "top_logprobs",
];

/// Tools a provider runs itself: a chat target is not offered them.
const HOSTED_TOOLS: &[&str] = &[
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "tool_search",
    "file_search",
    "code_interpreter",
    "image_generation",
    "computer_use_preview",
    "mcp",
    "local_shell",
];

/// Input items only the Responses API reads back: left out.
const HOSTED_ITEMS: &[&str] = &[
    "reasoning",
    "web_search_call",
    "tool_search_call",
    "tool_search_output",
    "file_search_call",
    "code_interpreter_call",
    "image_generation_call",
    "computer_call",
    "mcp_call",
    "mcp_list_tools",
];

/// Builds the `Err` of a refusal, so that every refusal names its field.
fn refuse<T>(message: impl Into<String>, param: impl Into<String>) -> Result<T, Refusal> {
    Err(Refusal::at(param, message))
}

/// The separator of a namespace and a tool's name in a flattened name.
pub const NAMESPACE_SEPARATOR: &str = "__";

/// Says a Responses request in chat completions.
pub fn to_chat(request: &Map<String, Value>) -> Result<Map<String, Value>, Refusal> {
    let model = match request.get("model") {
        Some(Value::String(model)) if !model.is_empty() => model.clone(),
        Some(Value::String(_)) | Some(Value::Null) | None => {
            return refuse("Missing required parameter: 'model'.", "model");
        }
        Some(_) => return refuse("Invalid type for 'model': expected a string.", "model"),
    };
    refuse_unsupported(request)?;
    let stream = optional_bool(request, "stream")?.unwrap_or(false);
    optional_bool(request, "store")?;
    let turns = input_turns(request.get("input"))?;

    // Unknown fields go in first so that a translated field wins a name clash.
    let mut chat: Map<String, Value> = request
        .iter()
        .filter(|(key, _)| !KNOWN_FIELDS.contains(&key.as_str()))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    chat.insert("model".into(), Value::String(model));

    let mut messages = Vec::with_capacity(1 + turns.len());
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
    messages.extend(turns);
    chat.insert("messages".into(), Value::Array(messages));

    for (from, to) in [
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_completion_tokens"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
        ("safety_identifier", "safety_identifier"),
        ("prompt_cache_key", "prompt_cache_key"),
    ] {
        if let Some(value) = present(request, from) {
            chat.insert(to.into(), value.clone());
        }
    }
    let mut tools = match present(request, "tools") {
        Some(tools) => chat_tools(tools)?,
        None => Vec::new(),
    };
    tools.extend(additional_chat_tools(request)?);
    // Chat completions rejects an empty tools list; no tools is the same thing.
    if !tools.is_empty() {
        chat.insert("tools".into(), Value::Array(tools));
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
    Ok(chat)
}

/// The names of the request's `custom` tools (their calls come back as
/// `custom_tool_call` items), and of its namespaced tools as flattened
/// (`(flat, namespace, name)`).
pub fn tool_names(request: &Map<String, Value>) -> (Vec<String>, Vec<(String, String, String)>) {
    let mut custom = Vec::new();
    let mut namespaced = Vec::new();
    let tools = present(request, "tools").and_then(Value::as_array);
    let additional = additional_tools_items(request)
        .filter_map(|(_, item)| item.get("tools").and_then(Value::as_array));
    for tool in tools.into_iter().chain(additional).flatten() {
        let name = tool.get("name").and_then(Value::as_str).unwrap_or("");
        match tool.get("type").and_then(Value::as_str) {
            Some("custom") => custom.push(name.to_string()),
            Some("namespace") => {
                let inner = tool.get("tools").and_then(Value::as_array);
                for t in inner.into_iter().flatten() {
                    let n = t.get("name").and_then(Value::as_str).unwrap_or("");
                    let flat = format!("{name}{NAMESPACE_SEPARATOR}{n}");
                    if t.get("type").and_then(Value::as_str) == Some("custom") {
                        custom.push(flat.clone());
                    }
                    namespaced.push((flat, name.to_string(), n.to_string()));
                }
            }
            _ => {}
        }
    }
    (custom, namespaced)
}

/// A field's value unless it is absent or null: in the Responses API an explicit null
/// means "the default", exactly like leaving the field out.
pub(super) fn present<'a>(map: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
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
        "custom_tool_call" => push_tool_call(turns, custom_call(item, at)?),
        "function_call_output" | "custom_tool_call_output" => turns.push(tool_turn(item, at)?),
        // Its tools join the request's (`additional_chat_tools`).
        ADDITIONAL_TOOLS => {}
        // Reasoning and hosted tools' items replay what OpenAI's own models
        // did; a chat target has no place for them and answers the same
        // without them.
        kind if HOSTED_ITEMS.contains(&kind) => {}
        "item_reference" => {
            return refuse(
                "Item references are not supported by idem; send the item itself, or continue a stored response with 'previous_response_id'.",
                format!("{at}.type"),
            );
        }
        other => {
            return refuse(
                format!("Input items of type '{other}' have no form in chat completions."),
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
        "input_file" => match part.get("file_data").and_then(Value::as_str) {
            Some(data) => {
                let name = part
                    .get("filename")
                    .and_then(Value::as_str)
                    .unwrap_or("file");
                Ok(json!({"type": "file", "file": {"filename": name, "file_data": data}}))
            }
            None => refuse(
                "Files given by 'file_id' or 'file_url' have no form in chat completions; send 'file_data'.",
                format!("{at}.type"),
            ),
        },
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
/// single answer they were cut from; refusal
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

/// A `custom_tool_call` item as a chat tool call of the function that
/// stands for its tool (its one argument, `input`, the call's input).
fn custom_call(item: &Map<String, Value>, at: &str) -> Result<Value, Refusal> {
    let s = |key: &str| -> Result<String, Refusal> {
        match item.get(key) {
            Some(Value::String(value)) => Ok(value.clone()),
            _ => refuse(
                format!("Missing required parameter: '{at}.{key}'."),
                format!("{at}.{key}"),
            ),
        }
    };
    let arguments = json!({"input": s("input")?}).to_string();
    Ok(json!({
        "id": s("call_id")?,
        "type": "function",
        "function": {"name": s("name")?, "arguments": arguments},
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
    chat_tools_at(tools, "tools")
}

/// The tools of the input's `additional_tools` items (tools offered in the
/// course of a conversation, as Codex sends them), as chat tools: chat has
/// one list of tools, so they join the request's.
fn additional_chat_tools(request: &Map<String, Value>) -> Result<Vec<Value>, Refusal> {
    let mut translated = Vec::new();
    for (index, item) in additional_tools_items(request) {
        let at = format!("input.{index}.tools");
        let Some(tools) = item.get("tools").and_then(Value::as_array) else {
            return refuse(format!("Invalid type for '{at}': expected a list."), at);
        };
        translated.extend(chat_tools_at(tools, &at)?);
    }
    Ok(translated)
}

/// The input's `additional_tools` items, with their indexes.
fn additional_tools_items(request: &Map<String, Value>) -> impl Iterator<Item = (usize, &Value)> {
    present(request, "input")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
        .filter(|(_, item)| item.get("type").and_then(Value::as_str) == Some(ADDITIONAL_TOOLS))
}

/// The input item type that offers tools in the course of a conversation.
const ADDITIONAL_TOOLS: &str = "additional_tools";

fn chat_tools_at(tools: &[Value], prefix: &str) -> Result<Vec<Value>, Refusal> {
    let mut translated = Vec::with_capacity(tools.len());
    for (index, tool) in tools.iter().enumerate() {
        let at = format!("{prefix}.{index}");
        match tool.get("type").and_then(Value::as_str) {
            Some("function" | "custom") => translated.push(chat_tool(tool, &at, None)?),
            Some("namespace") => {
                let Some(ns) = tool.get("name").and_then(Value::as_str) else {
                    return refuse(
                        format!("Missing required parameter: '{at}.name'."),
                        format!("{at}.name"),
                    );
                };
                let inner = tool.get("tools").and_then(Value::as_array);
                for (j, t) in inner.into_iter().flatten().enumerate() {
                    translated.push(chat_tool(t, &format!("{at}.tools.{j}"), Some(ns))?);
                }
            }
            Some(kind) if HOSTED_TOOLS.contains(&kind) => {}
            Some(other) => {
                return refuse(
                    format!("Tools of type '{other}' have no form in chat completions."),
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
    }
    Ok(translated)
}

/// One function or custom tool as a chat function (a custom tool takes one
/// string argument, `input`; its grammar, which chat cannot enforce, goes
/// into the description); inside a namespace its name is flattened.
fn chat_tool(tool: &Value, at: &str, namespace: Option<&str>) -> Result<Value, Refusal> {
    let Some(name) = tool.get("name").and_then(Value::as_str) else {
        return refuse(
            format!("Missing required parameter: '{at}.name'."),
            format!("{at}.name"),
        );
    };
    let name = match namespace {
        Some(ns) => format!("{ns}{NAMESPACE_SEPARATOR}{name}"),
        None => name.to_string(),
    };
    let mut function = Map::new();
    function.insert("name".into(), Value::String(name));
    match tool.get("type").and_then(Value::as_str) {
        Some("custom") => {
            let mut description = tool
                .get("description")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            if let Some(def) = tool.pointer("/format/definition").and_then(Value::as_str) {
                description.push_str("\n\nThe input follows this grammar:\n");
                description.push_str(def);
            }
            function.insert("description".into(), Value::String(description));
            function.insert(
                "parameters".into(),
                json!({"type": "object", "properties": {"input": {"type": "string"}},
                       "required": ["input"]}),
            );
        }
        Some("function") => {
            for key in ["description", "parameters", "strict"] {
                if let Some(value) = tool.get(key).filter(|v| !v.is_null()) {
                    function.insert(key.into(), value.clone());
                }
            }
        }
        _ => {
            return refuse(
                format!(
                    "Tools of this type have no form in chat completions inside a namespace: '{at}.type'."
                ),
                format!("{at}.type"),
            );
        }
    }
    Ok(json!({"type": "function", "function": function}))
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
            Some("function" | "custom") => function_named(choice, "tool_choice"),
            Some("allowed_tools") => {
                let tools = object
                    .get("tools")
                    .and_then(Value::as_array)
                    .map(Vec::as_slice)
                    .unwrap_or_default();
                let mut allowed = Vec::with_capacity(tools.len());
                for (index, tool) in tools.iter().enumerate() {
                    let at = format!("tool_choice.tools.{index}");
                    if !matches!(
                        tool.get("type").and_then(Value::as_str),
                        Some("function" | "custom")
                    ) {
                        return refuse(
                            "Only function and custom tools can be allowed in chat completions.",
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
                "Only 'auto', 'none', 'required', a function or custom tool, or allowed tools can be chosen in chat completions.",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn object(value: Value) -> Map<String, Value> {
        match value {
            Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        }
    }

    /// A translation and the chat messages made of the request's input
    /// (the instructions' system message aside).
    struct Translated {
        chat: Map<String, Value>,
        turns: Vec<Value>,
    }

    fn translate(request: Value) -> Translated {
        let request = object(request);
        let chat = to_chat(&request).expect("request should translate");
        let mut turns = chat["messages"].as_array().cloned().unwrap_or_default();
        if present(&request, "instructions").is_some_and(|i| i != "") {
            turns.remove(0);
        }
        Translated { chat, turns }
    }

    fn refusal_param(request: Value) -> String {
        let refusal = to_chat(&object(request)).expect_err("request should be refused");
        refusal.param.expect("refusals name their field")
    }

    #[test]
    fn string_input_is_one_user_message() {
        let translated = translate(json!({"model": "gpt-4o", "input": "Hello"}));
        assert_eq!(
            Value::Object(translated.chat),
            json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "Hello"}]})
        );
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
    fn instructions_come_first_then_the_conversation_items() {
        // The conversation a stored response continues comes as items
        // before this request's own (the face spelled it out).
        let translated = translate(json!({
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": "My name is Ada."},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "Hello Ada.", "annotations": []}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
                {"role": "user", "content": "What is my name?"}
            ],
        }));
        assert_eq!(
            translated.chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": "Hello Ada."},
                {"role": "user", "content": "What is my name?"},
            ])
        );
    }

    /// What Codex sends by default reaches a chat target: custom and
    /// namespaced tools as functions, hosted tools left out, its custom
    /// tool round trip as a tool call and its answer, `include`,
    /// `client_metadata`, `store` and reasoning items without a refusal.
    #[test]
    fn codexs_defaults_are_translated_not_refused() {
        let request = object(json!({
            "model": "gpt-5-codex", "instructions": "You are Codex.", "stream": true,
            "store": false, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "medium", "summary": "auto"},
            "prompt_cache_key": "conv-1", "client_metadata": {"x": "y"},
            "tools": [
                {"type": "function", "name": "shell", "parameters": {"type": "object"}},
                {"type": "custom", "name": "apply_patch", "description": "Patch files.",
                 "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}},
                {"type": "namespace", "name": "mcp_fs", "description": "files",
                 "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}]},
                {"type": "web_search"},
                {"type": "tool_search"}
            ],
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "patch it"}]},
                {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
                {"type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch",
                 "input": "*** Begin Patch"},
                {"type": "custom_tool_call_output", "call_id": "call_1", "output": "Done"},
                {"type": "web_search_call", "id": "ws_1", "status": "completed",
                 "action": {"type": "search", "query": "q"}}
            ]
        }));
        let chat = to_chat(&request).unwrap();
        let names: Vec<&str> = chat["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["shell", "apply_patch", "mcp_fs__read"]);
        assert_eq!(
            chat["tools"][1]["function"]["parameters"]["required"],
            json!(["input"])
        );
        assert!(
            chat["tools"][1]["function"]["description"]
                .as_str()
                .unwrap()
                .contains("start: x")
        );
        let m = chat["messages"].as_array().unwrap();
        assert_eq!(
            m[1]["content"][0],
            json!({"type": "text", "text": "patch it"})
        );
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "apply_patch");
        assert_eq!(
            m[2]["tool_calls"][0]["function"]["arguments"],
            json!({"input": "*** Begin Patch"}).to_string()
        );
        assert_eq!(
            m[3],
            json!({"role": "tool", "tool_call_id": "call_1", "content": "Done"})
        );
        assert_eq!(m.len(), 4);
        for dropped in ["include", "client_metadata", "store", "reasoning"] {
            assert!(!chat.contains_key(dropped), "{dropped}");
        }
        assert_eq!(chat["reasoning_effort"], "medium");
        assert_eq!(chat["prompt_cache_key"], "conv-1");
        let (custom, namespaced) = tool_names(&request);
        assert_eq!(custom, ["apply_patch"]);
        assert_eq!(
            namespaced,
            [(
                "mcp_fs__read".to_string(),
                "mcp_fs".to_string(),
                "read".to_string()
            )]
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
                "prompt_cache_key": "key",
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
                json!({"model": "m", "input": "hi", "tools": [{"type": "computer_2030"}]}),
                "tools.0.type",
            ),
            (
                json!({"model": "m", "input": "hi", "tools": [
                    {"type": "function", "name": "f"}, {"type": "mystery"}]}),
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
        let refusal = to_chat(&object(
            json!({"model": "m", "input": "hi", "tools": [{"type": "mystery"}]}),
        ))
        .expect_err("refused");
        assert!(refusal.message.contains("mystery"), "{}", refusal.message);
        assert_eq!(refusal.to_string(), refusal.message);
    }
}
