//! A chat completion read back as a Responses `response` object: its text
//! and refusal as a message item, its tool calls as function calls (custom
//! and namespaced tools' calls as the client offered them), its finish
//! reason as the response's status, its usage in the Responses API's
//! terms.

use serde_json::{Map, Value, json};

use super::request::present;

/// Choice 0 of a completion or chunk, if present (a choice without an `index` counts as
/// 0). The Responses API has no `n`: other choices are ignored, and a chunk carrying
/// only another choice carries nothing for this response.
pub(super) fn first_choice(completion: &Value) -> Option<&Value> {
    completion
        .get("choices")?
        .as_array()?
        .iter()
        .find(|choice| choice.get("index").and_then(Value::as_u64).unwrap_or(0) == 0)
}

/// The text of a string, or of a list of text parts (some upstreams answer that way).
pub(super) fn text_of(value: &Value) -> String {
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
    pub(super) model: String,
    fields: Map<String, Value>,
    /// Which function calls stand for custom or namespaced tools.
    pub(super) tools: ToolNames,
}

/// The request's custom tools and its namespaced tools as flattened, whose
/// calls come back from chat as function calls and go to the client as
/// they were offered.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolNames {
    custom: Vec<String>,
    /// (flattened name, namespace, name)
    namespaced: Vec<(String, String, String)>,
}

impl ToolNames {
    pub(super) fn is_custom(&self, name: &str) -> bool {
        self.custom.iter().any(|c| c == name)
    }

    fn namespace_of<'a>(&'a self, name: &str) -> Option<(&'a str, &'a str)> {
        self.namespaced
            .iter()
            .find(|(flat, ..)| flat == name)
            .map(|(_, ns, inner)| (ns.as_str(), inner.as_str()))
    }
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
        let (custom, namespaced) = super::request::tool_names(request);
        Echo {
            model,
            fields,
            tools: ToolNames { custom, namespaced },
        }
    }
}

/// Where a response stands, as its `status`, `incomplete_details` and `error` say.
pub(super) enum Outcome<'a> {
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
pub(super) fn incomplete_reason(finish_reason: Option<&str>) -> Option<&'static str> {
    match finish_reason {
        Some("length") => Some("max_output_tokens"),
        Some("content_filter") => Some("content_filter"),
        _ => None,
    }
}

/// Chat usage as Responses usage; null when the upstream reported none. The newest SDK
/// requires `cache_write_tokens`, which chat usage rarely has: it counts as 0 then.
pub(super) fn usage_of(usage: Option<&Value>) -> Value {
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
pub(super) fn response_object(
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

pub(super) fn message_id(response_id: &str) -> String {
    format!("msg_{}", id_suffix(response_id))
}

pub(super) fn call_item_id(response_id: &str, ordinal: usize) -> String {
    format!("fc_{}_{ordinal}", id_suffix(response_id))
}

/// One content part of the answer message: output text or a refusal.
#[derive(Debug, Clone)]
pub(super) struct Part {
    pub(super) refusal: bool,
    pub(super) text: String,
}

/// One output item being built, from a whole completion or from chunks.
#[derive(Debug, Clone)]
pub(super) enum Item {
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

pub(super) fn render_part(part: &Part, text: &str) -> Value {
    if part.refusal {
        json!({"type": "refusal", "refusal": text})
    } else {
        json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
    }
}

/// An item as the response shows it; `complete` false gives the empty shape that
/// `response.output_item.added` announces.
pub(super) fn render_item(item: &Item, status: &str, complete: bool, tools: &ToolNames) -> Value {
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
        } if tools.is_custom(name) => {
            // A custom tool's one argument is its input.
            let input = if complete {
                serde_json::from_str::<Value>(arguments)
                    .ok()
                    .and_then(|a| a.get("input").and_then(Value::as_str).map(str::to_string))
                    .unwrap_or_else(|| arguments.clone())
            } else {
                String::new()
            };
            let (namespace, name) = match tools.namespace_of(name) {
                Some((ns, inner)) => (Some(ns), inner),
                None => (None, name.as_str()),
            };
            let mut item = json!({
                "id": id,
                "type": "custom_tool_call",
                "status": status,
                "call_id": call_id,
                "name": name,
                "input": input,
            });
            if let Some(ns) = namespace {
                item["namespace"] = json!(ns);
            }
            item
        }
        Item::Call {
            id,
            call_id,
            name,
            arguments,
        } => {
            let (namespace, name) = match tools.namespace_of(name) {
                Some((ns, inner)) => (Some(ns), inner),
                None => (None, name.as_str()),
            };
            let mut item = json!({
                "id": id,
                "type": "function_call",
                "status": status,
                "call_id": call_id,
                "name": name,
                "arguments": if complete { arguments.as_str() } else { "" },
            });
            if let Some(ns) = namespace {
                item["namespace"] = json!(ns);
            }
            item
        }
    }
}

/// The status of item `index` among `count` once the response ended: when the answer
/// was cut short, the last item is the one that was cut.
pub(super) fn final_status(index: usize, count: usize, cut: bool) -> &'static str {
    if cut && index + 1 == count {
        "incomplete"
    } else {
        "completed"
    }
}

pub(super) fn render_output(items: &[Item], cut: bool, tools: &ToolNames) -> Vec<Value> {
    items
        .iter()
        .enumerate()
        .map(|(index, item)| render_item(item, final_status(index, items.len(), cut), true, tools))
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
        render_output(&items, reason.is_some(), &echo.tools),
        usage_of(completion.get("usage")),
    )
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
}
