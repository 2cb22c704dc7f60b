//! An OpenAI chat completion request said in Anthropic's Messages API.
//!
//! - `system` and `developer` messages go to the top-level `system`;
//!   user, assistant and tool turns become `messages`, consecutive turns of
//!   one role merged into one (the API wants them alternating);
//! - text parts, images (data URLs as base64 sources, other URLs as URL
//!   sources), assistant `tool_calls` (as `tool_use` blocks) and `tool`
//!   messages (as `tool_result` blocks) are carried over;
//! - `max_tokens` (or `max_completion_tokens`, else the provider's
//!   default), `temperature`, `top_p`, `stop` (as `stop_sequences`),
//!   `tools`, `tool_choice`, `parallel_tool_calls: false`, `stream` and
//!   `user` (as `metadata.user_id`) are translated;
//! - `response_format` (`json_schema` or `json_object`) becomes a tool the
//!   model must call, whose input is the answer's content (see
//!   [`Reading::json_tool`]);
//! - what would change the answer's shape and has no equivalent (`n` above
//!   1, `logprobs`, audio output, a content part other than text or image,
//!   a tool other than a function) is refused before anything is sent;
//!   sampling hints without an equivalent (`seed`, the penalties,
//!   `logit_bias`, `service_tier`, `reasoning_effort`, ...) are left out.

use serde_json::{Map, Value, json};

use super::Reading;
use crate::translate::Refusal;

/// The translated request and what reading its reply needs.
pub fn translate(
    chat: &Map<String, Value>,
    default_max_tokens: u32,
) -> Result<(Map<String, Value>, Reading), Refusal> {
    let mut out = Map::new();
    let mut reading = Reading::default();
    if let Some(model) = chat.get("model") {
        out.insert("model".into(), model.clone());
    }
    let (system, messages) = messages(chat.get("messages"))?;
    if !system.is_empty() {
        out.insert("system".into(), Value::String(system.join("\n\n")));
    }
    out.insert("messages".into(), Value::Array(messages));
    let max_tokens = chat
        .get("max_completion_tokens")
        .or_else(|| chat.get("max_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(u64::from(default_max_tokens));
    out.insert("max_tokens".into(), json!(max_tokens));
    for (from, to) in [("temperature", "temperature"), ("top_p", "top_p")] {
        if let Some(v) = chat.get(from).filter(|v| !v.is_null()) {
            out.insert(to.into(), v.clone());
        }
    }
    match chat.get("stop") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => {
            out.insert("stop_sequences".into(), json!([s]));
        }
        Some(Value::Array(a)) => {
            out.insert("stop_sequences".into(), Value::Array(a.clone()));
        }
        Some(_) => {
            return Err(Refusal::at(
                "stop",
                "`stop` must be a string or an array of strings",
            ));
        }
    }
    if let Some(user) = chat.get("user").and_then(Value::as_str) {
        out.insert("metadata".into(), json!({"user_id": user}));
    }
    let form = Reading::of_chat(chat);
    if form.stream {
        out.insert("stream".into(), json!(true));
        reading.stream = true;
        reading.include_usage = form.include_usage;
    }
    if chat.get("n").and_then(Value::as_u64).is_some_and(|n| n > 1) {
        return Err(Refusal::at(
            "n",
            "`n` above 1 has no equivalent in the Messages API",
        ));
    }
    if chat.get("logprobs").and_then(Value::as_bool) == Some(true) {
        return Err(Refusal::at(
            "logprobs",
            "`logprobs` has no equivalent in the Messages API",
        ));
    }
    if chat
        .get("modalities")
        .and_then(Value::as_array)
        .is_some_and(|m| m.iter().any(|x| x != "text"))
        || chat.get("audio").is_some_and(|a| !a.is_null())
    {
        return Err(Refusal::at(
            "modalities",
            "audio output has no equivalent in the Messages API",
        ));
    }
    let tools = tools(chat.get("tools"))?;
    let parallel = chat.get("parallel_tool_calls").and_then(Value::as_bool) != Some(false);
    let mut choice = tool_choice(chat.get("tool_choice"))?;
    match json_format(chat.get("response_format"))? {
        Some((name, schema)) => {
            if !tools.is_empty() {
                return Err(Refusal::at(
                    "response_format",
                    "`response_format` together with `tools` has no equivalent in the Messages API",
                ));
            }
            out.insert(
                "tools".into(),
                json!([{"name": name, "description": "Respond with the answer as this tool's input.", "input_schema": schema}]),
            );
            choice = Some(json!({"type": "tool", "name": name}));
            reading.json_tool = Some(name);
        }
        None if !tools.is_empty() => {
            out.insert("tools".into(), Value::Array(tools));
        }
        None => {}
    }
    if !parallel {
        let mut c = choice.unwrap_or_else(|| json!({"type": "auto"}));
        if let Some(obj) = c.as_object_mut()
            && obj.get("type").and_then(Value::as_str) != Some("none")
        {
            obj.insert("disable_parallel_tool_use".into(), json!(true));
        }
        choice = Some(c);
    }
    if let Some(c) = choice
        && out.contains_key("tools")
    {
        out.insert("tool_choice".into(), c);
    }
    // Everything else is left out: a sampling hint without an equivalent,
    // or a field idem does not know (the Messages API refuses fields it
    // does not know).
    Ok((out, reading))
}

/// The system text and the turns.
fn messages(messages: Option<&Value>) -> Result<(Vec<String>, Vec<Value>), Refusal> {
    let Some(Value::Array(list)) = messages else {
        return Err(Refusal::at("messages", "`messages` must be an array"));
    };
    let mut system = Vec::new();
    let mut turns: Vec<(String, Vec<Value>)> = Vec::new();
    for (i, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
        let (role, blocks) = match role {
            "system" | "developer" => {
                system.push(text_of(m.get("content"), i)?);
                continue;
            }
            "user" => ("user", content_blocks(m.get("content"), i)?),
            "assistant" => ("assistant", assistant_blocks(m, i)?),
            "tool" => {
                let id = m
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        Refusal::at(
                            format!("messages.{i}"),
                            "a tool message needs tool_call_id".to_string(),
                        )
                    })?;
                let text = text_of(m.get("content"), i)?;
                (
                    "user",
                    vec![json!({"type": "tool_result", "tool_use_id": id, "content": text})],
                )
            }
            other => {
                return Err(Refusal::at(
                    format!("messages.{i}"),
                    format!("role {other:?} has no equivalent in the Messages API"),
                ));
            }
        };
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some((last, existing)) if last == role => existing.extend(blocks),
            _ => turns.push((role.to_string(), blocks)),
        }
    }
    // Tool results first within a user turn: the API wants them to answer
    // the tool calls of the turn before.
    let turns = turns
        .into_iter()
        .map(|(role, mut blocks)| {
            blocks.sort_by_key(|b| b.get("type").and_then(Value::as_str) != Some("tool_result"));
            json!({"role": role, "content": blocks})
        })
        .collect();
    Ok((system, turns))
}

/// A message's content as plain text (system and tool messages).
fn text_of(content: Option<&Value>, i: usize) -> Result<String, Refusal> {
    match content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for part in parts {
                match part.get("type").and_then(Value::as_str) {
                    Some("text") => {
                        text.push_str(part.get("text").and_then(Value::as_str).unwrap_or_default())
                    }
                    other => {
                        return Err(Refusal::at(
                            format!("messages.{i}"),
                            format!(
                                "a {} part here has no equivalent in the Messages API",
                                other.unwrap_or("typeless")
                            ),
                        ));
                    }
                }
            }
            Ok(text)
        }
        Some(_) => Err(Refusal::at(
            format!("messages.{i}"),
            "content must be a string or an array of parts".to_string(),
        )),
    }
}

/// A user message's content as blocks: text and images.
fn content_blocks(content: Option<&Value>, i: usize) -> Result<Vec<Value>, Refusal> {
    let parts = match content {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => return Ok(text_block(s).into_iter().collect()),
        Some(Value::Array(parts)) => parts,
        Some(_) => {
            return Err(Refusal::at(
                format!("messages.{i}"),
                "content must be a string or an array of parts".to_string(),
            ));
        }
    };
    let mut blocks = Vec::new();
    for part in parts {
        match part.get("type").and_then(Value::as_str) {
            Some("text") => {
                blocks.extend(text_block(
                    part.get("text").and_then(Value::as_str).unwrap_or_default(),
                ));
            }
            Some("image_url") => {
                let url = part
                    .pointer("/image_url/url")
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        Refusal::at(
                            format!("messages.{i}"),
                            "an image_url part needs image_url.url".to_string(),
                        )
                    })?;
                blocks.push(image_block(url, i)?);
            }
            other => {
                return Err(Refusal::at(
                    format!("messages.{i}"),
                    format!(
                        "a {} part has no equivalent in the Messages API",
                        other.unwrap_or("typeless")
                    ),
                ));
            }
        }
    }
    Ok(blocks)
}

/// A text block; none for empty text (the API refuses empty text blocks).
fn text_block(text: &str) -> Option<Value> {
    (!text.is_empty()).then(|| json!({"type": "text", "text": text}))
}

/// An image block: a data URL's bytes as a base64 source, any other URL as
/// a URL source.
fn image_block(url: &str, i: usize) -> Result<Value, Refusal> {
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, data) = rest.split_once(',').ok_or_else(|| {
            Refusal::at(
                format!("messages.{i}"),
                "a data URL without data".to_string(),
            )
        })?;
        let media_type = meta.strip_suffix(";base64").ok_or_else(|| {
            Refusal::at(
                format!("messages.{i}"),
                "an image data URL must be base64".to_string(),
            )
        })?;
        return Ok(json!({
            "type": "image",
            "source": {"type": "base64", "media_type": media_type, "data": data}
        }));
    }
    Ok(json!({"type": "image", "source": {"type": "url", "url": url}}))
}

/// An assistant message as blocks: its text, then its tool calls.
fn assistant_blocks(m: &Value, i: usize) -> Result<Vec<Value>, Refusal> {
    let mut blocks = Vec::new();
    match m.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => blocks.extend(text_block(s)),
        Some(Value::Array(parts)) => {
            for part in parts {
                let text = match part.get("type").and_then(Value::as_str) {
                    Some("text") => part.get("text"),
                    Some("refusal") => part.get("refusal"),
                    other => {
                        return Err(Refusal::at(
                            format!("messages.{i}"),
                            format!(
                                "a {} part has no equivalent in the Messages API",
                                other.unwrap_or("typeless")
                            ),
                        ));
                    }
                };
                blocks.extend(text_block(text.and_then(Value::as_str).unwrap_or_default()));
            }
        }
        Some(_) => {
            return Err(Refusal::at(
                format!("messages.{i}"),
                "content must be a string or an array of parts".to_string(),
            ));
        }
    }
    if let Some(Value::Array(calls)) = m.get("tool_calls") {
        for call in calls {
            let id = call.get("id").and_then(Value::as_str).unwrap_or_default();
            let name = call
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    Refusal::at(
                        format!("messages.{i}"),
                        "a tool call needs function.name".to_string(),
                    )
                })?;
            let arguments = call
                .pointer("/function/arguments")
                .and_then(Value::as_str)
                .unwrap_or("{}");
            let input: Value = if arguments.trim().is_empty() {
                json!({})
            } else {
                serde_json::from_str(arguments).map_err(|_| {
                    Refusal::at(
                        format!("messages.{i}"),
                        format!("the arguments of tool call {id:?} are not JSON"),
                    )
                })?
            };
            blocks.push(json!({"type": "tool_use", "id": id, "name": name, "input": input}));
        }
    }
    Ok(blocks)
}

/// Function tools as Anthropic tools.
fn tools(tools: Option<&Value>) -> Result<Vec<Value>, Refusal> {
    let list = match tools {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(Refusal::at("tools", "`tools` must be an array")),
    };
    list.iter()
        .enumerate()
        .map(|(i, t)| {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(Refusal::at(format!("tools.{i}.type"), "only function tools have an equivalent in the Messages API"));
            }
            let f = t
                .get("function")
                .ok_or_else(|| Refusal::at(format!("tools.{i}.type"), "a function tool needs `function`"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| Refusal::at(format!("tools.{i}.type"), "a function needs a name"))?;
            let mut tool = json!({
                "name": name,
                "input_schema": f.get("parameters").cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            });
            if let Some(d) = f.get("description").filter(|d| !d.is_null()) {
                tool["description"] = d.clone();
            }
            Ok(tool)
        })
        .collect()
}

/// `tool_choice` in Anthropic's words.
fn tool_choice(choice: Option<&Value>) -> Result<Option<Value>, Refusal> {
    Ok(match choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(match s.as_str() {
            "auto" => json!({"type": "auto"}),
            "none" => json!({"type": "none"}),
            "required" => json!({"type": "any"}),
            other => {
                return Err(Refusal::at(
                    "tool_choice",
                    format!("`tool_choice` {other:?} has no equivalent in the Messages API"),
                ));
            }
        }),
        Some(c) => {
            let name = c
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(|| Refusal::at("tool_choice", "`tool_choice` must name a function"))?;
            Some(json!({"type": "tool", "name": name}))
        }
    })
}

/// A `response_format` that asks for JSON: the name and input schema of
/// the tool that will carry it.
fn json_format(format: Option<&Value>) -> Result<Option<(String, Value)>, Refusal> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") | None => Ok(None),
        Some("json_object") => Ok(Some((
            "json_object".into(),
            json!({"type": "object", "additionalProperties": true}),
        ))),
        Some("json_schema") => {
            let schema = format
                .pointer("/json_schema/schema")
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            let name: String = format
                .pointer("/json_schema/name")
                .and_then(Value::as_str)
                .unwrap_or("json_schema")
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '-')
                .take(64)
                .collect();
            let name = if name.is_empty() {
                "json_schema".into()
            } else {
                name
            };
            Ok(Some((name, schema)))
        }
        Some(other) => Err(Refusal::at(
            "response_format.type",
            format!("`response_format` {other:?} has no equivalent in the Messages API"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    fn go(v: Value) -> (Value, Reading) {
        let (m, r) = translate(&chat(v), 4096).unwrap();
        (Value::Object(m), r)
    }

    #[test]
    fn system_goes_up_turns_merge_and_parameters_are_renamed() {
        let (out, reading) = go(json!({
            "model": "claude-x",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use French."}]},
                {"role": "user", "content": "Hello"},
                {"role": "user", "content": [{"type": "text", "text": "again"}]},
                {"role": "assistant", "content": "Bonjour"},
                {"role": "user", "content": "?"}
            ],
            "temperature": 0.2, "top_p": 0.9, "stop": "END", "user": "u-1",
            "seed": 7, "frequency_penalty": 1.0, "unknown_field": true
        }));
        assert_eq!(out["system"], "Be brief.\n\nUse French.");
        assert_eq!(
            out["messages"],
            json!([
                {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "again"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "Bonjour"}]},
                {"role": "user", "content": [{"type": "text", "text": "?"}]}
            ])
        );
        assert_eq!(out["max_tokens"], 4096);
        assert_eq!(out["temperature"], 0.2);
        assert_eq!(out["top_p"], 0.9);
        assert_eq!(out["stop_sequences"], json!(["END"]));
        assert_eq!(out["metadata"], json!({"user_id": "u-1"}));
        assert_eq!(out["model"], "claude-x");
        for dropped in ["seed", "frequency_penalty", "unknown_field", "stream"] {
            assert!(out.get(dropped).is_none(), "{dropped}");
        }
        assert!(!reading.stream);
    }

    #[test]
    fn images_tools_and_tool_results_go_both_ways() {
        let (out, _) = go(json!({
            "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                    {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}}
                ]},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\":\"cat\"}"}}
                ]},
                {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
                {"role": "user", "content": "thanks"}
            ],
            "tools": [{"type": "function", "function": {"name": "lookup", "description": "d", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}],
            "tool_choice": {"type": "function", "function": {"name": "lookup"}},
            "parallel_tool_calls": false,
            "max_tokens": 100
        }));
        let m = &out["messages"];
        assert_eq!(
            m[0]["content"][1]["source"],
            json!({"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="})
        );
        assert_eq!(
            m[0]["content"][2]["source"],
            json!({"type": "url", "url": "https://example.com/cat.jpg"})
        );
        assert_eq!(
            m[1]["content"],
            json!([{"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": "cat"}}])
        );
        // The tool result and the next user text share one user turn,
        // the result first.
        assert_eq!(
            m[2]["content"],
            json!([{"type": "tool_result", "tool_use_id": "call_1", "content": "a cat"}, {"type": "text", "text": "thanks"}])
        );
        assert_eq!(
            out["tools"][0]["input_schema"]["properties"]["q"]["type"],
            "string"
        );
        assert_eq!(
            out["tool_choice"],
            json!({"type": "tool", "name": "lookup", "disable_parallel_tool_use": true})
        );
        assert_eq!(out["max_tokens"], 100);
        for (given, wanted) in [("auto", "auto"), ("none", "none"), ("required", "any")] {
            let (out, _) = go(
                json!({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": given}),
            );
            assert_eq!(out["tool_choice"]["type"], wanted);
        }
    }

    #[test]
    fn a_json_response_format_is_a_forced_tool() {
        let (out, reading) = go(json!({
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "support reply!", "schema": {"type": "object", "required": ["answer"]}}},
            "stream": true, "stream_options": {"include_usage": true}
        }));
        assert_eq!(out["tools"][0]["name"], "supportreply");
        assert_eq!(
            out["tools"][0]["input_schema"]["required"],
            json!(["answer"])
        );
        assert_eq!(
            out["tool_choice"],
            json!({"type": "tool", "name": "supportreply"})
        );
        assert_eq!(reading.json_tool.as_deref(), Some("supportreply"));
        assert!(reading.stream && reading.include_usage);
        assert_eq!(out["stream"], true);
    }

    #[test]
    fn what_changes_the_answers_shape_is_refused() {
        let refused = |v: Value| translate(&chat(v), 10).unwrap_err().message;
        let m = json!([{"role": "user", "content": "x"}]);
        assert!(refused(json!({"messages": m, "n": 2})).contains("`n`"));
        assert!(refused(json!({"messages": m, "logprobs": true})).contains("logprobs"));
        assert!(refused(json!({"messages": m, "modalities": ["text", "audio"]})).contains("audio"));
        assert!(
            refused(json!({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}))
                .contains("input_audio")
        );
        assert!(
            refused(json!({"messages": m, "tools": [{"type": "web_search"}]}))
                .contains("function tools")
        );
        assert!(
            refused(json!({"messages": [{"role": "function", "content": "x"}]}))
                .contains("function")
        );
        assert!(refused(json!({"messages": m, "tools": [{"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}})).contains("response_format"));
    }
}
