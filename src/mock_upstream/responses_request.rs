//! The mock's Responses API face (`POST /v1/responses`), the request side:
//! what it accepts, refusing the rest with OpenAI's 400s (`unknown_parameter`,
//! `missing_required_parameter`, `invalid_value`, `invalid_type`,
//! `invalid_encrypted_content`, `previous_response_not_found`, each naming
//! its `param`), and what the reply reads from a request: the last user
//! text, the tools offered (nested `namespace` tools and the tools of
//! `additional_tools` input items included), the reasoning asked for.
//!
//! The mock keeps nothing between calls, so whatever refers to an earlier
//! response by id is refused as OpenAI refuses an id it does not know:
//! `previous_response_id`, `conversation`, an `item_reference`, and a
//! `reasoning` item without `encrypted_content`. A reasoning item's
//! `encrypted_content` is accepted back only if the mock made it (see
//! [`super::seal`]).

use serde_json::{Map, Value};

use super::answer::{ECHO_CHARS, estimate_tokens};
use super::seal;

/// The top-level fields of a Responses request; OpenAI refuses any other.
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_tool_calls",
    "reasoning",
    "include",
    "store",
    "stream",
    "stream_options",
    "text",
    "max_output_tokens",
    "metadata",
    "prompt",
    "prompt_cache_key",
    "prompt_cache_retention",
    "client_metadata",
    "service_tier",
    "truncation",
    "user",
    "safety_identifier",
    "top_p",
    "top_logprobs",
    "temperature",
    "previous_response_id",
    "conversation",
    "background",
];

/// The input item types the mock takes.
const ITEM_TYPES: &[&str] = &[
    "message",
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "web_search_call",
    "local_shell_call",
    "local_shell_call_output",
    "tool_search_call",
    "tool_search_output",
    "additional_tools",
    "item_reference",
    "file_search_call",
    "image_generation_call",
    "code_interpreter_call",
    "computer_call",
    "computer_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_call",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "compaction",
];

/// The tool types the mock takes (`function`, `custom` and `namespace` are
/// checked further; the hosted ones are taken as they are).
const TOOL_TYPES: &[&str] = &[
    "function",
    "custom",
    "namespace",
    "web_search",
    "web_search_preview",
    "web_search_2025_08_26",
    "web_search_preview_2025_03_11",
    "tool_search",
    "local_shell",
    "shell",
    "apply_patch",
    "file_search",
    "image_generation",
    "code_interpreter",
    "computer_use_preview",
    "computer",
    "mcp",
];

/// The values `include` takes.
const INCLUDES: &[&str] = &[
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "message.input_image.image_url",
    "web_search_call.action.sources",
    "web_search_call.results",
    "file_search_call.results",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
];

/// What a reasoning item's `encrypted_content` is sealed for.
pub(crate) const REASONING_SEAL: &str = "openai reasoning";

/// The smallest `max_output_tokens` OpenAI takes.
const MIN_OUTPUT_TOKENS: u64 = 16;

/// An OpenAI 400: its message, the `param` at fault, its `code`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Refusal {
    pub(crate) message: String,
    pub(crate) param: Option<String>,
    pub(crate) code: Option<&'static str>,
}

impl Refusal {
    fn new(message: String, param: impl Into<String>, code: &'static str) -> Refusal {
        Refusal {
            message,
            param: Some(param.into()),
            code: Some(code),
        }
    }

    fn invalid_value(param: &str, value: &str, supported: &[&str]) -> Refusal {
        let supported = supported
            .iter()
            .map(|s| format!("'{s}'"))
            .collect::<Vec<_>>()
            .join(", ");
        Refusal::new(
            format!("Invalid value: '{value}'. Supported values are: {supported}."),
            param,
            "invalid_value",
        )
    }

    fn missing(param: &str) -> Refusal {
        Refusal::new(
            format!("Missing required parameter: '{param}'."),
            param,
            "missing_required_parameter",
        )
    }

    fn invalid_type(param: &str, expected: &str, got: &Value) -> Refusal {
        Refusal::new(
            format!(
                "Invalid type for '{param}': expected {expected}, but got {} instead.",
                type_name(got)
            ),
            param,
            "invalid_type",
        )
    }

    fn not_found(id: &str, store: bool) -> Refusal {
        let message = if store {
            format!("Item with id '{id}' not found.")
        } else {
            format!(
                "Item with id '{id}' not found. Items are not persisted when `store` is set to \
                 false. Try again with `store` set to true, or remove this item from your input."
            )
        };
        Refusal {
            message,
            param: Some("input".into()),
            code: None,
        }
    }
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Checks `request` as OpenAI's Responses API does.
pub(crate) fn validate(request: &Map<String, Value>) -> Result<(), Refusal> {
    if let Some(extra) = request.keys().find(|key| !FIELDS.contains(&key.as_str())) {
        return Err(Refusal::new(
            format!("Unknown parameter: '{extra}'."),
            extra.as_str(),
            "unknown_parameter",
        ));
    }
    match request.get("model") {
        None | Some(Value::Null) => return Err(Refusal::missing("model")),
        Some(Value::String(_)) => {}
        Some(other) => return Err(Refusal::invalid_type("model", "a string", other)),
    }
    for (field, what) in [
        ("previous_response_id", "Previous response"),
        ("conversation", "Conversation"),
    ] {
        match request.get(field) {
            None | Some(Value::Null) => {}
            Some(value) => {
                let id = value
                    .as_str()
                    .or_else(|| value.get("id").and_then(Value::as_str))
                    .unwrap_or_default();
                return Err(Refusal::new(
                    format!("{what} with id '{id}' not found."),
                    field,
                    if field == "conversation" {
                        "conversation_not_found"
                    } else {
                        "previous_response_not_found"
                    },
                ));
            }
        }
    }
    for field in ["stream", "store", "parallel_tool_calls", "background"] {
        if let Some(value) = request.get(field)
            && !value.is_boolean()
            && !value.is_null()
        {
            return Err(Refusal::invalid_type(field, "a boolean", value));
        }
    }
    for field in [
        "instructions",
        "prompt_cache_key",
        "user",
        "safety_identifier",
    ] {
        if let Some(value) = request.get(field)
            && !value.is_string()
            && !value.is_null()
        {
            return Err(Refusal::invalid_type(field, "a string", value));
        }
    }
    for field in ["metadata", "client_metadata", "stream_options", "prompt"] {
        if let Some(value) = request.get(field)
            && !value.is_object()
            && !value.is_null()
        {
            return Err(Refusal::invalid_type(field, "an object", value));
        }
    }
    check_numbers(request)?;
    check_choice_fields(request)?;
    let store = request
        .get("store")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let mut tools = Vec::new();
    if let Some(list) = request.get("tools") {
        check_tools(list, "tools")?;
        tools.extend(list.as_array().into_iter().flatten());
    }
    match request.get("input") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                check_item(item, &format!("input[{i}]"), store)?;
                if item.get("type").and_then(Value::as_str) == Some("additional_tools")
                    && let Some(Value::Array(more)) = item.get("tools")
                {
                    tools.extend(more);
                }
            }
        }
        Some(other) => {
            return Err(Refusal::invalid_type(
                "input",
                "one of a string or array of input items",
                other,
            ));
        }
    }
    if let Some(choice) = request.get("tool_choice") {
        check_tool_choice(choice, &tools)?;
    }
    Ok(())
}

fn check_numbers(request: &Map<String, Value>) -> Result<(), Refusal> {
    if let Some(value) = request.get("max_output_tokens").filter(|v| !v.is_null()) {
        let Some(n) = value.as_u64() else {
            return Err(Refusal::invalid_type(
                "max_output_tokens",
                "an integer",
                value,
            ));
        };
        if n < MIN_OUTPUT_TOKENS {
            return Err(Refusal::new(
                format!(
                    "Invalid 'max_output_tokens': integer below minimum value. Expected a value \
                     >= {MIN_OUTPUT_TOKENS}, but got {n} instead."
                ),
                "max_output_tokens",
                "integer_below_min_value",
            ));
        }
    }
    for (field, max) in [("temperature", 2.0), ("top_p", 1.0)] {
        if let Some(value) = request.get(field).filter(|v| !v.is_null()) {
            match value.as_f64() {
                Some(x) if (0.0..=max).contains(&x) => {}
                Some(_) => {
                    return Err(Refusal::new(
                        format!(
                            "Invalid '{field}': decimal above maximum value. Expected a value \
                             <= {max}."
                        ),
                        field,
                        "decimal_above_max_value",
                    ));
                }
                None => return Err(Refusal::invalid_type(field, "a decimal", value)),
            }
        }
    }
    for field in ["max_tool_calls", "top_logprobs"] {
        if let Some(value) = request.get(field).filter(|v| !v.is_null())
            && value.as_u64().is_none()
        {
            return Err(Refusal::invalid_type(field, "an integer", value));
        }
    }
    Ok(())
}

/// `reasoning`, `include`, `text`, `truncation`, `service_tier`.
fn check_choice_fields(request: &Map<String, Value>) -> Result<(), Refusal> {
    if let Some(reasoning) = request.get("reasoning").filter(|v| !v.is_null()) {
        let Some(reasoning) = reasoning.as_object() else {
            return Err(Refusal::invalid_type("reasoning", "an object", reasoning));
        };
        for (key, value) in reasoning {
            let allowed: &[&str] = match key.as_str() {
                "effort" => &["none", "minimal", "low", "medium", "high", "xhigh"],
                "summary" | "generate_summary" => &["auto", "concise", "detailed", "none"],
                "context" => continue,
                _ => {
                    return Err(Refusal::new(
                        format!("Unknown parameter: 'reasoning.{key}'."),
                        format!("reasoning.{key}"),
                        "unknown_parameter",
                    ));
                }
            };
            if let Some(v) = value.as_str().filter(|v| !allowed.contains(v)) {
                return Err(Refusal::invalid_value(
                    &format!("reasoning.{key}"),
                    v,
                    allowed,
                ));
            }
        }
    }
    if let Some(include) = request.get("include").filter(|v| !v.is_null()) {
        let Some(list) = include.as_array() else {
            return Err(Refusal::invalid_type("include", "an array", include));
        };
        for (i, value) in list.iter().enumerate() {
            let value = value.as_str().unwrap_or_default();
            if !INCLUDES.contains(&value) {
                return Err(Refusal::invalid_value(
                    &format!("include[{i}]"),
                    value,
                    INCLUDES,
                ));
            }
        }
    }
    if let Some(text) = request.get("text").filter(|v| !v.is_null()) {
        let Some(text) = text.as_object() else {
            return Err(Refusal::invalid_type("text", "an object", text));
        };
        if let Some(kind) = text.get("format").and_then(|f| f.get("type")) {
            let kind = kind.as_str().unwrap_or_default();
            let kinds = ["text", "json_object", "json_schema"];
            if !kinds.contains(&kind) {
                return Err(Refusal::invalid_value("text.format.type", kind, &kinds));
            }
            if kind == "json_schema"
                && text
                    .get("format")
                    .and_then(|f| f.get("schema"))
                    .is_none_or(|s| !s.is_object())
            {
                return Err(Refusal::missing("text.format.schema"));
            }
        }
        if let Some(verbosity) = text.get("verbosity").and_then(Value::as_str) {
            let levels = ["low", "medium", "high"];
            if !levels.contains(&verbosity) {
                return Err(Refusal::invalid_value("text.verbosity", verbosity, &levels));
            }
        }
    }
    for (field, allowed) in [
        ("truncation", &["auto", "disabled"][..]),
        (
            "service_tier",
            &["auto", "default", "flex", "scale", "priority"][..],
        ),
    ] {
        if let Some(value) = request.get(field).and_then(Value::as_str)
            && !allowed.contains(&value)
        {
            return Err(Refusal::invalid_value(field, value, allowed));
        }
    }
    Ok(())
}

/// The tools at `at` (`tools`, `input[0].tools`, `tools[2].tools`).
fn check_tools(tools: &Value, at: &str) -> Result<(), Refusal> {
    let Some(list) = tools.as_array() else {
        return Err(Refusal::invalid_type(at, "an array", tools));
    };
    for (i, tool) in list.iter().enumerate() {
        let here = format!("{at}[{i}]");
        let Some(tool) = tool.as_object() else {
            return Err(Refusal::invalid_type(&here, "an object", tool));
        };
        let Some(kind) = tool.get("type").and_then(Value::as_str) else {
            return Err(Refusal::missing(&format!("{here}.type")));
        };
        if !TOOL_TYPES.contains(&kind) {
            return Err(Refusal::invalid_value(
                &format!("{here}.type"),
                kind,
                TOOL_TYPES,
            ));
        }
        if matches!(kind, "function" | "custom" | "namespace")
            && !tool.get("name").is_some_and(Value::is_string)
        {
            return Err(Refusal::missing(&format!("{here}.name")));
        }
        match kind {
            "function" => {
                if let Some(parameters) = tool.get("parameters")
                    && !parameters.is_object()
                    && !parameters.is_null()
                {
                    return Err(Refusal::invalid_type(
                        &format!("{here}.parameters"),
                        "an object",
                        parameters,
                    ));
                }
            }
            "custom" => {
                if let Some(format) = tool.get("format") {
                    let kind = format.get("type").and_then(Value::as_str).unwrap_or("");
                    if !["text", "grammar"].contains(&kind) {
                        return Err(Refusal::invalid_value(
                            &format!("{here}.format.type"),
                            kind,
                            &["text", "grammar"],
                        ));
                    }
                }
            }
            "namespace" => match tool.get("tools") {
                Some(nested) => check_tools(nested, &format!("{here}.tools"))?,
                None => return Err(Refusal::missing(&format!("{here}.tools"))),
            },
            _ => {}
        }
    }
    Ok(())
}

fn check_tool_choice(choice: &Value, tools: &[&Value]) -> Result<(), Refusal> {
    match choice {
        Value::String(mode) => {
            let modes = ["none", "auto", "required"];
            if !modes.contains(&mode.as_str()) {
                return Err(Refusal::invalid_value("tool_choice", mode, &modes));
            }
            Ok(())
        }
        Value::Object(choice) => {
            let kind = choice.get("type").and_then(Value::as_str).unwrap_or("");
            if matches!(kind, "function" | "custom") {
                let name = choice.get("name").and_then(Value::as_str).unwrap_or("");
                let offered = Offered::of_tools(tools.iter().copied());
                if !offered.callable().any(|t| t.kind == kind && t.name == name) {
                    return Err(Refusal::new(
                        format!("Tool choice '{kind}' not found in 'tools' parameter."),
                        "tool_choice",
                        "invalid_value",
                    ));
                }
            }
            Ok(())
        }
        other => Err(Refusal::invalid_type(
            "tool_choice",
            "a string or an object",
            other,
        )),
    }
}

/// One input item at `at` (`input[3]`).
fn check_item(item: &Value, at: &str, store: bool) -> Result<(), Refusal> {
    let Some(object) = item.as_object() else {
        return Err(Refusal::invalid_type(at, "an object", item));
    };
    let kind = match object.get("type").and_then(Value::as_str) {
        Some(kind) => kind,
        None if object.contains_key("role") => "message",
        None => return Err(Refusal::missing(&format!("{at}.type"))),
    };
    if !ITEM_TYPES.contains(&kind) {
        return Err(Refusal::invalid_value(
            &format!("{at}.type"),
            kind,
            ITEM_TYPES,
        ));
    }
    let string = |field: &str| match object.get(field) {
        Some(Value::String(_)) => Ok(()),
        None => Err(Refusal::missing(&format!("{at}.{field}"))),
        Some(other) => Err(Refusal::invalid_type(
            &format!("{at}.{field}"),
            "a string",
            other,
        )),
    };
    match kind {
        "message" => check_message(object, at),
        "function_call" => {
            string("call_id")?;
            string("name")?;
            string("arguments")
        }
        "custom_tool_call" => {
            string("call_id")?;
            string("name")?;
            string("input")
        }
        "function_call_output" | "custom_tool_call_output" => {
            string("call_id")?;
            match object.get("output") {
                Some(Value::String(_) | Value::Array(_)) => Ok(()),
                None => Err(Refusal::missing(&format!("{at}.output"))),
                Some(other) => Err(Refusal::invalid_type(
                    &format!("{at}.output"),
                    "a string or an array",
                    other,
                )),
            }
        }
        "reasoning" => check_reasoning(object, at, store),
        "item_reference" => {
            string("id")?;
            let id = object.get("id").and_then(Value::as_str).unwrap_or_default();
            Err(Refusal::not_found(id, store))
        }
        "additional_tools" => match object.get("tools") {
            Some(tools) => check_tools(tools, &format!("{at}.tools")),
            None => Err(Refusal::missing(&format!("{at}.tools"))),
        },
        _ => Ok(()),
    }
}

fn check_message(object: &Map<String, Value>, at: &str) -> Result<(), Refusal> {
    let roles = ["user", "system", "developer", "assistant"];
    let role = match object.get("role") {
        Some(Value::String(role)) if roles.contains(&role.as_str()) => role.as_str(),
        Some(Value::String(role)) => {
            return Err(Refusal::invalid_value(&format!("{at}.role"), role, &roles));
        }
        None => return Err(Refusal::missing(&format!("{at}.role"))),
        Some(other) => {
            return Err(Refusal::invalid_type(
                &format!("{at}.role"),
                "a string",
                other,
            ));
        }
    };
    let parts = match object.get("content") {
        Some(Value::String(_)) => return Ok(()),
        Some(Value::Array(parts)) => parts,
        None => return Err(Refusal::missing(&format!("{at}.content"))),
        Some(other) => {
            return Err(Refusal::invalid_type(
                &format!("{at}.content"),
                "one of a string or array of input content",
                other,
            ));
        }
    };
    let allowed: &[&str] = if role == "assistant" {
        &["output_text", "refusal"]
    } else {
        &["input_text", "input_image", "input_file", "input_audio"]
    };
    for (j, part) in parts.iter().enumerate() {
        let here = format!("{at}.content[{j}]");
        let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
        if !allowed.contains(&kind) {
            return Err(Refusal::invalid_value(
                &format!("{here}.type"),
                kind,
                allowed,
            ));
        }
        let field = match kind {
            "input_text" | "output_text" => Some("text"),
            "refusal" => Some("refusal"),
            _ => None,
        };
        if let Some(field) = field
            && !part.get(field).is_some_and(Value::is_string)
        {
            return Err(Refusal::missing(&format!("{here}.{field}")));
        }
        if kind == "input_image" && part.get("image_url").is_none() && part.get("file_id").is_none()
        {
            return Err(Refusal::missing(&format!("{here}.image_url")));
        }
    }
    Ok(())
}

/// A reasoning item comes back whole only with `encrypted_content` the
/// mock made; without it, it names an item the mock never kept.
fn check_reasoning(object: &Map<String, Value>, at: &str, store: bool) -> Result<(), Refusal> {
    if !object.get("summary").is_some_and(Value::is_array) {
        return Err(Refusal::missing(&format!("{at}.summary")));
    }
    let id = object.get("id").and_then(Value::as_str).unwrap_or_default();
    match object.get("encrypted_content") {
        None | Some(Value::Null) => Err(Refusal::not_found(id, store)),
        Some(Value::String(token)) if seal::open(REASONING_SEAL, token).is_some() => Ok(()),
        Some(_) => Err(Refusal {
            message: format!(
                "The encrypted content for item {id} could not be verified. Reason: Encrypted \
                 content could not be decrypted or parsed."
            ),
            param: None,
            code: Some("invalid_encrypted_content"),
        }),
    }
}

/// One tool a request offers, with the namespace it is nested in.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tool<'a> {
    /// `function`, `custom`, `web_search`, ...
    pub(crate) kind: &'a str,
    pub(crate) name: &'a str,
    pub(crate) namespace: Option<&'a str>,
    pub(crate) definition: &'a Value,
}

/// The tools a request offers: `tools` and those of its
/// `additional_tools` input items, namespaces opened.
#[derive(Debug, Clone, Default)]
pub(crate) struct Offered<'a> {
    pub(crate) tools: Vec<Tool<'a>>,
}

impl<'a> Offered<'a> {
    pub(crate) fn of(request: &'a Value) -> Offered<'a> {
        let top = request.get("tools").and_then(Value::as_array);
        let additional = request
            .get("input")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|item| item.get("type").and_then(Value::as_str) == Some("additional_tools"))
            .filter_map(|item| item.get("tools").and_then(Value::as_array));
        Offered::of_tools(top.into_iter().chain(additional).flatten())
    }

    fn of_tools(list: impl Iterator<Item = &'a Value>) -> Offered<'a> {
        let mut offered = Offered::default();
        for tool in list {
            offered.add(tool, None);
        }
        offered
    }

    fn add(&mut self, tool: &'a Value, namespace: Option<&'a str>) {
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or_default();
        let name = tool.get("name").and_then(Value::as_str).unwrap_or(kind);
        if kind == "namespace" {
            for nested in tool
                .get("tools")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                self.add(nested, Some(name));
            }
            return;
        }
        self.tools.push(Tool {
            kind,
            name,
            namespace,
            definition: tool,
        });
    }

    /// The tools a call can be made to: functions and custom tools.
    pub(crate) fn callable(&self) -> impl Iterator<Item = &Tool<'a>> {
        self.tools
            .iter()
            .filter(|tool| matches!(tool.kind, "function" | "custom"))
    }

    /// The callable tool named `name` (its own name, or
    /// `namespace.name`), if any.
    pub(crate) fn named(&self, name: &str) -> Option<&Tool<'a>> {
        self.callable().find(|tool| {
            tool.name == name
                || tool.namespace.is_some_and(|ns| {
                    name.strip_prefix(ns).and_then(|n| n.strip_prefix('.')) == Some(tool.name)
                })
        })
    }

    /// True when a web search tool is offered.
    pub(crate) fn web_search(&self) -> bool {
        self.tools
            .iter()
            .any(|tool| tool.kind.starts_with("web_search"))
    }
}

/// The text of the last user message or tool output of `request`'s input
/// (the input itself when it is a string): what the answer echoes and
/// what the `call tool` marker is looked for in. A tool output ends a
/// tool round trip: its text has no marker, so the answer is a message.
pub(crate) fn last_user_text(request: &Value) -> String {
    let items = match request.get("input") {
        Some(Value::String(text)) => return text.clone(),
        Some(Value::Array(items)) => items,
        _ => return String::new(),
    };
    items
        .iter()
        .rev()
        .find_map(|item| {
            let kind = item.get("type").and_then(Value::as_str);
            match kind {
                Some("message") | None
                    if item.get("role").and_then(Value::as_str) == Some("user") =>
                {
                    Some(content_text(item.get("content")))
                }
                Some(kind) if kind.ends_with("_output") => Some(content_text(item.get("output"))),
                _ => None,
            }
        })
        .unwrap_or_default()
}

/// What the call log shows as the prompt: the last user text, its first
/// 200 characters.
pub(crate) fn echoed(request: &Value) -> String {
    last_user_text(request).chars().take(ECHO_CHARS).collect()
}

/// The text of a content or an output: the string, or the `text` of its
/// parts joined by spaces.
fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// The request's input tokens: the characters of its `instructions`, of
/// every input item's JSON (a string input: its characters) and of every
/// tool's JSON, divided by four, at least 1.
pub(crate) fn input_tokens(request: &Value) -> u64 {
    let text = |key: &str| {
        request
            .get(key)
            .and_then(Value::as_str)
            .map_or(0, |t| t.chars().count())
    };
    let input = match request.get("input") {
        Some(Value::String(text)) => text.chars().count(),
        Some(Value::Array(items)) => items.iter().map(|i| i.to_string().chars().count()).sum(),
        _ => 0,
    };
    let tools = request
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|tool| tool.to_string().chars().count())
        .sum::<usize>();
    estimate_tokens(text("instructions") + input + tools)
}
