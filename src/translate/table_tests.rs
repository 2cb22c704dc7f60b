//! The tests of docs/http-api.md's table "What becomes of each field":
//! one table of cases per face and target kind, each case labelled as the
//! table cites it (`face_to_target`, case `label`). Every case goes through
//! [`prepare`], the dispatch the request path calls, with a target of the
//! kind built from a configuration, and says what the target is sent: a
//! value at a place in the body, nothing there, the same body as without
//! the field (a field left out), or a refusal naming the field.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{Prepared, Refusal, prepare};
use crate::config::{Config, Source};
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::metrics::Metrics;
use crate::providers::Providers;
use crate::routes::{Route, Routes, Target};

/// One provider of each kind, and a route (named after the target) to
/// each model the cases need.
const CONFIG: &str = r#"
[[providers]]
name = "oa"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"

[[providers]]
name = "az"
kind = "azure"
base_url = "http://127.0.0.1:9"

[[providers]]
name = "an"
kind = "anthropic"
base_url = "http://127.0.0.1:9"

[[providers]]
name = "rs"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
responses_api = true

[[providers]]
name = "mk"
kind = "mock"

[[routes]]
model = "openai"
targets = [{ provider = "oa", model = "gpt-4o" }]

[[routes]]
model = "openai-reasoning"
targets = [{ provider = "oa", model = "o4-mini" }]

[[routes]]
model = "azure"
targets = [{ provider = "az", model = "gpt-4o" }]

[[routes]]
model = "azure-deployment"
targets = [{ provider = "az", model = "my-deployment" }]

[[routes]]
model = "anthropic"
targets = [{ provider = "an", model = "claude-x" }]

[[routes]]
model = "responses-api"
targets = [{ provider = "rs", model = "gpt-4o" }]

[[routes]]
model = "mock"
targets = [{ provider = "mk", model = "gpt-4o" }]
"#;

/// The targets of [`CONFIG`], by route name.
struct Targets(Routes);

impl Targets {
    fn new() -> Targets {
        let config = Config::from_toml_str(CONFIG, Source::Embedded, false).unwrap();
        let metrics = Metrics::new(&config);
        let providers = Providers::from_config(&config).unwrap();
        Targets(Routes::from_config(&config, &providers, &metrics).unwrap())
    }

    /// The route named `route`, whose first target the cases use.
    fn get(&self, route: &str) -> Arc<Route> {
        self.0.get(route).unwrap()
    }
}

/// What a target gets for a request.
#[derive(Debug)]
enum Sent {
    /// The request in its own dialect (the target speaks it), and the
    /// client's headers.
    Native(Value, Forwarded),
    /// The request translated into `dialect`.
    Translated(Dialect, Value),
    /// No call: idem's own answer.
    Local(Value),
}

impl Sent {
    fn body(&self) -> &Value {
        match self {
            Sent::Native(v, _) | Sent::Translated(_, v) | Sent::Local(v) => v,
        }
    }
}

fn json_of(bytes: &Bytes) -> Value {
    serde_json::from_slice(bytes).unwrap()
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        other => panic!("not an object: {other}"),
    }
}

/// Sends `request` of dialect `from` to `target` through [`prepare`],
/// with an `anthropic-beta` header from the client.
fn send(from: Dialect, request: &Value, target: &Target) -> Result<Sent, Refusal> {
    let forwarded = Forwarded::read(from, |name| match name {
        "anthropic-beta" => vec!["tools-2099"],
        "openai-beta" => vec!["responses=v9"],
        _ => vec![],
    });
    let fp = Fingerprint::from_bytes([7; 32]);
    let request = object(request.clone());
    Ok(match prepare(from, &request, &forwarded, target, &fp)? {
        Prepared::Local(body) => Sent::Local(json_of(&body)),
        // A native call keeps the dialect (its reply is read as it comes,
        // or, for a continued conversation, with the client's fields).
        Prepared::Send(s) if s.dialect == from => Sent::Native(json_of(&s.body), s.forwarded),
        Prepared::Send(s) => {
            assert_eq!(
                s.forwarded,
                Forwarded::default(),
                "a translated call carries no client header"
            );
            Sent::Translated(s.dialect, json_of(&s.body))
        }
    })
}

/// What a case wants of the target's body.
enum Want {
    /// This value at this JSON pointer.
    At(&'static str, Value),
    /// Nothing at this pointer.
    Absent(&'static str),
    /// The body the base request alone becomes: the field was left out.
    Same,
    /// Refused before anything is sent, naming this field.
    Refused(&'static str),
}

/// One row (or part of a row) of the table.
struct Case {
    label: &'static str,
    /// Top-level fields set over the table's base request (`null`: the
    /// field removed).
    patch: Value,
    wants: Vec<Want>,
}

fn case(label: &'static str, patch: Value, wants: Vec<Want>) -> Case {
    Case {
        label,
        patch,
        wants,
    }
}

use Want::{Absent, At, Refused, Same};

/// The base request with `patch`'s fields set over it.
fn patched(base: &Value, patch: &Value) -> Value {
    let mut out = object(base.clone());
    for (k, v) in object(patch.clone()) {
        if v.is_null() {
            out.remove(&k);
        } else {
            out.insert(k, v);
        }
    }
    Value::Object(out)
}

/// Runs every case of a face x target table: `from` requests (the `base`
/// with each case's patch) to the target of route `route`, whose calls are
/// in `to` (the request's own dialect: passed as sent).
fn run(from: Dialect, route: &str, to: Dialect, base: Value, cases: &[Case]) {
    let targets = Targets::new();
    let route = targets.get(route);
    let target = &route.targets[0];
    let plain = send(from, &base, target).expect("the base request is sent");
    let mut failures = Vec::new();
    for c in cases {
        let request = patched(&base, &c.patch);
        let sent = send(from, &request, target);
        for want in &c.wants {
            let problem = match (want, &sent) {
                (Refused(param), Err(r)) => {
                    let named = r.param.as_deref() == Some(*param);
                    let says_target = r.message.contains(&*target.model);
                    (!named || !says_target).then(|| {
                        format!(
                            "refused with param {:?} ({}), wanted {param:?} and the target named",
                            r.param, r.message
                        )
                    })
                }
                (Refused(param), Ok(s)) => Some(format!(
                    "not refused (wanted param {param:?}): sent {}",
                    s.body()
                )),
                (_, Err(r)) => Some(format!("refused: {:?} {}", r.param, r.message)),
                (want, Ok(s)) => {
                    let dialect = match s {
                        Sent::Native(..) => Some(from),
                        Sent::Translated(d, _) => Some(*d),
                        Sent::Local(_) => None,
                    };
                    if dialect.is_some() && dialect != Some(to) {
                        Some(format!("sent as {dialect:?}, wanted {to:?}"))
                    } else {
                        let body = s.body();
                        match want {
                            At(ptr, v) => (body.pointer(ptr) != Some(v)).then(|| {
                                format!(
                                    "at {ptr}: {:?}, wanted {v} (body {body})",
                                    body.pointer(ptr)
                                )
                            }),
                            Absent(ptr) => body
                                .pointer(ptr)
                                .map(|v| format!("at {ptr}: {v}, wanted nothing")),
                            Same => (body != plain.body()).then(|| {
                                format!("changed the body: {body}, without it {}", plain.body())
                            }),
                            Refused(_) => unreachable!(),
                        }
                    }
                }
            };
            if let Some(p) = problem {
                failures.push(format!("case `{}`: {p}", c.label));
            }
        }
    }
    assert!(failures.is_empty(), "\n{}", failures.join("\n"));
}

// ---------------------------------------------------------------------------
// The chat completions face.

fn chat_base() -> Value {
    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}]})
}

/// A chat request to an Anthropic target, said in the Messages API.
#[test]
fn chat_to_anthropic() {
    let hi = || json!({"role": "user", "content": "hi"});
    let call = || {
        json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]})
    };
    let tool = || json!([{"type": "function", "function": {"name": "f"}}]);
    let cases = [
        case("model", json!({}), vec![At("/model", json!("claude-x"))]),
        case(
            "system",
            json!({"messages": [{"role": "system", "content": "A"}, hi(),
                {"role": "developer", "content": [{"type": "text", "text": "B"}]}]}),
            vec![
                At("/system", json!("A\n\nB")),
                At(
                    "/messages",
                    json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
                ),
            ],
        ),
        case(
            "system-image",
            json!({"messages": [{"role": "system", "content": [
                {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}, hi()]}),
            vec![Refused("messages.0")],
        ),
        case(
            "user",
            json!({"messages": [{"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "text", "text": "b"}]}]}),
            vec![At(
                "/messages",
                json!([{"role": "user", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
            )],
        ),
        case(
            "assistant",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "text", "text": "x"}, {"type": "refusal", "refusal": "no"}],
                "tool_calls": call()["tool_calls"]}]}),
            vec![At(
                "/messages/1",
                json!({"role": "assistant", "content": [
                    {"type": "text", "text": "x"}, {"type": "text", "text": "no"},
                    {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]}),
            )],
        ),
        case(
            "tool_calls-not-json",
            json!({"messages": [hi(), {"role": "assistant", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "nope"}}]}]}),
            vec![Refused("messages.1")],
        ),
        case(
            "tool",
            json!({"messages": [hi(), call(),
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
                {"role": "user", "content": "thanks"}]}),
            vec![At(
                "/messages/2",
                json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": "r"},
                    {"type": "text", "text": "thanks"}]}),
            )],
        ),
        case(
            "tool-image",
            json!({"messages": [hi(), call(), {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]}),
            vec![Refused("messages.2")],
        ),
        case(
            "function-role",
            json!({"messages": [hi(), {"role": "function", "name": "f", "content": "x"}]}),
            vec![Refused("messages.1")],
        ),
        case(
            "image-data-url",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]}]}),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}),
            )],
        ),
        case(
            "image-url",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}]}]}),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}),
            )],
        ),
        case(
            "image-not-base64",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png,QUJD"}}]}]}),
            vec![Refused("messages.0")],
        ),
        case(
            "input_audio",
            json!({"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}}]}]}),
            vec![Refused("messages.0")],
        ),
        case(
            "file",
            json!({"messages": [{"role": "user", "content": [
                {"type": "file", "file": {"file_data": "data:application/pdf;base64,QUJD"}}]}]}),
            vec![Refused("messages.0")],
        ),
        case(
            "max_tokens-default",
            json!({}),
            vec![At("/max_tokens", json!(4096))],
        ),
        case(
            "max_tokens",
            json!({"max_tokens": 50}),
            vec![At("/max_tokens", json!(50))],
        ),
        case(
            "max_completion_tokens",
            json!({"max_tokens": 50, "max_completion_tokens": 70}),
            vec![At("/max_tokens", json!(70))],
        ),
        case(
            "temperature-top_p",
            json!({"temperature": 1.5, "top_p": 0.9}),
            vec![At("/temperature", json!(1.5)), At("/top_p", json!(0.9))],
        ),
        case(
            "stop",
            json!({"stop": "END"}),
            vec![At("/stop_sequences", json!(["END"])), Absent("/stop")],
        ),
        case(
            "stop-list",
            json!({"stop": ["a", "b"]}),
            vec![At("/stop_sequences", json!(["a", "b"]))],
        ),
        case(
            "user",
            json!({"user": "u-1"}),
            vec![At("/metadata", json!({"user_id": "u-1"})), Absent("/user")],
        ),
        case(
            "stream",
            json!({"stream": true, "stream_options": {"include_usage": false}}),
            vec![At("/stream", json!(true)), Absent("/stream_options")],
        ),
        case("n", json!({"n": 2}), vec![Refused("n")]),
        case("n-1", json!({"n": 1}), vec![Same]),
        case(
            "logprobs",
            json!({"logprobs": true}),
            vec![Refused("logprobs")],
        ),
        case(
            "top_logprobs",
            json!({"logprobs": false, "top_logprobs": 3}),
            vec![Same],
        ),
        case(
            "modalities",
            json!({"modalities": ["text", "audio"]}),
            vec![Refused("modalities")],
        ),
        case(
            "audio",
            json!({"audio": {"voice": "alloy", "format": "wav"}}),
            vec![Refused("modalities")],
        ),
        case(
            "tools",
            json!({"tools": [{"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}, "strict": true}},
                {"type": "function", "function": {"name": "g"}}]}),
            vec![At(
                "/tools",
                json!([{"name": "f", "description": "d",
                        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}},
                       {"name": "g", "input_schema": {"type": "object", "properties": {}}}]),
            )],
        ),
        case(
            "tools-other",
            json!({"tools": [{"type": "function", "function": {"name": "f"}},
                {"type": "custom", "custom": {"name": "g"}}]}),
            vec![Refused("tools.1.type")],
        ),
        case(
            "tool_choice-auto",
            json!({"tools": tool(), "tool_choice": "auto"}),
            vec![At("/tool_choice", json!({"type": "auto"}))],
        ),
        case(
            "tool_choice-none",
            json!({"tools": tool(), "tool_choice": "none"}),
            vec![At("/tool_choice", json!({"type": "none"}))],
        ),
        case(
            "tool_choice-required",
            json!({"tools": tool(), "tool_choice": "required"}),
            vec![At("/tool_choice", json!({"type": "any"}))],
        ),
        case(
            "tool_choice-function",
            json!({"tools": tool(), "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            vec![At("/tool_choice", json!({"type": "tool", "name": "f"}))],
        ),
        case(
            "tool_choice-allowed_tools",
            json!({"tools": tool(), "tool_choice": {"type": "allowed_tools",
                "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}}}),
            vec![Refused("tool_choice")],
        ),
        case(
            "tool_choice-without-tools",
            json!({"tool_choice": "required"}),
            vec![Same],
        ),
        case(
            "parallel_tool_calls",
            json!({"tools": tool(), "parallel_tool_calls": false}),
            vec![At(
                "/tool_choice",
                json!({"type": "auto", "disable_parallel_tool_use": true}),
            )],
        ),
        case(
            "response_format-json_schema",
            json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "object", "required": ["a"]}}}}),
            vec![
                At("/tools/0/name", json!("answer")),
                At(
                    "/tools/0/input_schema",
                    json!({"type": "object", "required": ["a"]}),
                ),
                At("/tool_choice", json!({"type": "tool", "name": "answer"})),
            ],
        ),
        case(
            "response_format-json_object",
            json!({"response_format": {"type": "json_object"}}),
            vec![
                At("/tools/0/name", json!("json_object")),
                At(
                    "/tool_choice",
                    json!({"type": "tool", "name": "json_object"}),
                ),
            ],
        ),
        case(
            "response_format-text",
            json!({"response_format": {"type": "text"}}),
            vec![Same],
        ),
        case(
            "response_format-with-tools",
            json!({"tools": tool(), "response_format": {"type": "json_object"}}),
            vec![Refused("response_format")],
        ),
        case(
            "response_format-other",
            json!({"response_format": {"type": "grammar"}}),
            vec![Refused("response_format.type")],
        ),
        case(
            "reasoning_effort",
            json!({"reasoning_effort": "high"}),
            vec![Same],
        ),
        case(
            "left-out",
            json!({"seed": 7, "frequency_penalty": 1.0, "presence_penalty": 1.0,
                "logit_bias": {"50256": -100}, "service_tier": "flex", "store": true,
                "metadata": {"k": "v"}, "prediction": {"type": "content", "content": "x"},
                "web_search_options": {}, "verbosity": "low", "prompt_cache_key": "k",
                "safety_identifier": "s", "custom_knob": 1}),
            vec![Same],
        ),
        case(
            "functions",
            json!({"functions": [{"name": "f", "parameters": {"type": "object"}}],
                "function_call": {"name": "f"}}),
            vec![Same],
        ),
    ];
    run(
        Dialect::Chat,
        "anthropic",
        Dialect::Messages,
        chat_base(),
        &cases,
    );
}

// ---------------------------------------------------------------------------
// The Messages face.

fn messages_base() -> Value {
    json!({"model": "bot", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]})
}

/// The cases of a Messages request to a chat target whose model does not
/// reason.
fn messages_to_chat_cases() -> Vec<Case> {
    let hi = || json!({"role": "user", "content": "hi"});
    let png = || json!({"type": "base64", "media_type": "image/png", "data": "QUJD"});
    let asks = || {
        json!({"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]})
    };
    let asked = || {
        json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]})
    };
    let tool = || json!({"name": "f", "input_schema": {"type": "object"}});
    vec![
        case("model", json!({}), vec![At("/model", json!("gpt-4o"))]),
        case(
            "max_tokens",
            json!({}),
            vec![
                At("/max_tokens", json!(100)),
                Absent("/max_completion_tokens"),
            ],
        ),
        case(
            "roles",
            json!({"messages": [hi(), {"role": "assistant", "content": "yo"}, hi()]}),
            vec![At(
                "/messages",
                json!([hi(), {"role": "assistant", "content": "yo"}, hi()]),
            )],
        ),
        case(
            "system-turn",
            json!({"messages": [{"role": "system", "content": [{"type": "text", "text": "S"}]}, hi()]}),
            vec![At("/messages/0", json!({"role": "system", "content": "S"}))],
        ),
        case(
            "other-role",
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            vec![Refused("messages.0.role")],
        ),
        case(
            "text",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                "cache_control": {"type": "ephemeral"}, "citations": []}]}]}),
            vec![Same],
        ),
        case(
            "text-blocks",
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
            vec![At(
                "/messages/0/content",
                json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
            )],
        ),
        case(
            "image",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": png()},
                {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}]}]}),
            vec![At(
                "/messages/0/content",
                json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                       {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]),
            )],
        ),
        case(
            "image-file",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}),
            vec![Refused("messages.0.content.0.source.type")],
        ),
        case(
            "document",
            json!({"messages": [{"role": "user", "content": [
                {"type": "document", "title": "spec.pdf", "source":
                    {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain"}}]}]}),
            vec![At(
                "/messages/0/content",
                json!([{"type": "file", "file": {"filename": "spec.pdf",
                            "file_data": "data:application/pdf;base64,JVBE"}},
                       {"type": "text", "text": "plain"}]),
            )],
        ),
        case(
            "document-url",
            json!({"messages": [{"role": "user", "content": [
                {"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}}]}]}),
            vec![Refused("messages.0.content.0.source.type")],
        ),
        case(
            "search_result",
            json!({"messages": [{"role": "user", "content": [{"type": "search_result",
                "title": "T", "source": "https://x", "content": [{"type": "text", "text": "body"}]}]}]}),
            vec![At("/messages/0/content", json!("T\nhttps://x\nbody"))],
        ),
        case(
            "tool_use",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "text", "text": "Let me see."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]}]}),
            vec![At(
                "/messages/1",
                json!({"role": "assistant", "content": "Let me see.",
                       "tool_calls": asked()["tool_calls"]}),
            )],
        ),
        case(
            "tool_use-in-user",
            json!({"messages": [{"role": "user", "content": [
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}),
            vec![Refused("messages.0.content.0.type")],
        ),
        case(
            "tool_result",
            json!({"messages": [hi(), asks(), {"role": "user", "content": [
                {"type": "text", "text": "thanks"},
                {"type": "tool_result", "tool_use_id": "t1", "is_error": true, "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                    {"type": "image", "source": png()}]}]}]}),
            vec![At(
                "/messages",
                json!([hi(), asked(),
                    {"role": "tool", "tool_call_id": "t1", "content": "Error: a\n\nb"},
                    {"role": "user", "content": [
                        {"type": "text", "text": "The tool results' images:"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]},
                    {"role": "user", "content": "thanks"}]),
            )],
        ),
        case(
            "tool_result-in-assistant",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]}),
            vec![Refused("messages.1.content.0.type")],
        ),
        case(
            "thinking",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "redacted_thinking", "data": "xx"},
                {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {"query": "q"}},
                {"type": "web_search_tool_result", "tool_use_id": "s1", "content": []},
                {"type": "text", "text": "yo"}]}]}),
            vec![At(
                "/messages",
                json!([hi(), {"role": "assistant", "content": "yo"}]),
            )],
        ),
        case(
            "other-block",
            json!({"messages": [{"role": "user", "content": [
                {"type": "container_upload", "file_id": "f"}]}]}),
            vec![Refused("messages.0.content.0.type")],
        ),
        case(
            "other-server-result",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "web_fetch_tool_result", "tool_use_id": "s1", "content": {}}]}]}),
            vec![Refused("messages.1.content.0.type")],
        ),
        case(
            "empty-content",
            json!({"messages": [{"role": "user", "content": []}]}),
            vec![Refused("messages.0.content")],
        ),
        case(
            "empty-final-assistant",
            json!({"messages": [hi(), {"role": "assistant", "content": []}]}),
            vec![Same],
        ),
        case(
            "system",
            json!({"system": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                              {"type": "text", "text": "B"}]}),
            vec![At(
                "/messages/0",
                json!({"role": "system", "content": "A\n\nB"}),
            )],
        ),
        case(
            "system-image",
            json!({"system": [{"type": "image", "source": png()}]}),
            vec![Refused("system.0.type")],
        ),
        case(
            "temperature-top_p",
            json!({"temperature": 0.5, "top_p": 0.9}),
            vec![At("/temperature", json!(0.5)), At("/top_p", json!(0.9))],
        ),
        case(
            "temperature-range",
            json!({"temperature": 1.5}),
            vec![Refused("temperature")],
        ),
        case("top_k", json!({"top_k": 40}), vec![At("/top_k", json!(40))]),
        case(
            "stop_sequences",
            json!({"stop_sequences": ["a", "b"]}),
            vec![At("/stop", json!(["a", "b"])), Absent("/stop_sequences")],
        ),
        case(
            "stream",
            json!({"stream": true}),
            vec![At("/stream", json!(true))],
        ),
        case(
            "metadata",
            json!({"metadata": {"user_id": "u-1", "other": 1}}),
            vec![At("/user", json!("u-1")), Absent("/metadata")],
        ),
        case(
            "tools",
            json!({"tools": [
                {"name": "f", "description": "d", "input_schema": {"type": "object"},
                 "cache_control": {"type": "ephemeral"}, "strict": true},
                {"type": "custom", "name": "g", "input_schema": {"type": "object"}}]}),
            vec![At(
                "/tools",
                json!([{"type": "function", "function": {"name": "f", "description": "d",
                            "parameters": {"type": "object"}, "strict": true}},
                       {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]),
            )],
        ),
        case(
            "server-tools",
            json!({"tools": [tool(), {"type": "web_search_20250305", "name": "web_search"}]}),
            vec![Refused("tools.1.type")],
        ),
        case(
            "tool_choice-auto",
            json!({"tools": [tool()], "tool_choice": {"type": "auto"}}),
            vec![
                At("/tool_choice", json!("auto")),
                Absent("/parallel_tool_calls"),
            ],
        ),
        case(
            "tool_choice-any",
            json!({"tools": [tool()], "tool_choice": {"type": "any"}}),
            vec![At("/tool_choice", json!("required"))],
        ),
        case(
            "tool_choice-none",
            json!({"tools": [tool()], "tool_choice": {"type": "none"}}),
            vec![At("/tool_choice", json!("none"))],
        ),
        case(
            "tool_choice-tool",
            json!({"tools": [tool()], "tool_choice": {"type": "tool", "name": "f"}}),
            vec![At(
                "/tool_choice",
                json!({"type": "function", "function": {"name": "f"}}),
            )],
        ),
        case(
            "disable_parallel_tool_use",
            json!({"tools": [tool()], "tool_choice": {"type": "any", "disable_parallel_tool_use": true}}),
            vec![
                At("/tool_choice", json!("required")),
                At("/parallel_tool_calls", json!(false)),
            ],
        ),
        case(
            "thinking-plain-model",
            json!({"thinking": {"type": "enabled", "budget_tokens": 20000}}),
            vec![Same],
        ),
        case(
            "thinking-disabled",
            json!({"thinking": {"type": "disabled"}}),
            vec![Same],
        ),
        case(
            "thinking-no-budget",
            json!({"thinking": {"type": "enabled"}}),
            vec![Refused("thinking.budget_tokens")],
        ),
        case(
            "thinking-other",
            json!({"thinking": {"type": "sometimes"}}),
            vec![Refused("thinking.type")],
        ),
        case(
            "output_config-effort-plain-model",
            json!({"output_config": {"effort": "high"}}),
            vec![Same],
        ),
        case(
            "output_config-format",
            json!({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}),
            vec![At(
                "/response_format",
                json!({"type": "json_schema", "json_schema":
                    {"name": "output", "schema": {"type": "object"}, "strict": true}}),
            )],
        ),
        case(
            "output_config-format-other",
            json!({"output_config": {"format": {"type": "text"}}}),
            vec![Refused("output_config.format.type")],
        ),
        case(
            "left-out",
            json!({"context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
                   "service_tier": "auto", "mcp_servers": []}),
            vec![Same],
        ),
        case(
            "mcp_servers",
            json!({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}),
            vec![Refused("mcp_servers")],
        ),
        case(
            "container",
            json!({"container": "cntr_1"}),
            vec![Refused("container")],
        ),
        case(
            "other-fields",
            json!({"custom_knob": {"a": 1}}),
            vec![At("/custom_knob", json!({"a": 1}))],
        ),
    ]
}

/// A Messages request to each kind that speaks chat, said in chat.
#[test]
fn messages_to_chat() {
    for route in ["openai", "azure", "responses-api", "mock"] {
        run(
            Dialect::Messages,
            route,
            Dialect::Chat,
            messages_base(),
            &messages_to_chat_cases(),
        );
    }
}

/// A Messages request to a chat target whose model reasons (`o1`, `o3`,
/// `o4`, `gpt-5`): thinking and effort as `reasoning_effort`.
#[test]
fn messages_to_chat_reasoning_model() {
    let cases = [
        case(
            "max_tokens",
            json!({}),
            vec![
                At("/max_completion_tokens", json!(100)),
                Absent("/max_tokens"),
            ],
        ),
        case(
            "thinking-small-budget",
            json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
            vec![At("/reasoning_effort", json!("low")), Absent("/thinking")],
        ),
        case(
            "thinking-medium-budget",
            json!({"thinking": {"type": "enabled", "budget_tokens": 4096}}),
            vec![At("/reasoning_effort", json!("medium"))],
        ),
        case(
            "thinking-large-budget",
            json!({"thinking": {"type": "enabled", "budget_tokens": 16384}}),
            vec![At("/reasoning_effort", json!("high"))],
        ),
        case(
            "thinking-adaptive",
            json!({"thinking": {"type": "adaptive"}}),
            vec![At("/reasoning_effort", json!("medium"))],
        ),
        case(
            "thinking-disabled",
            json!({"thinking": {"type": "disabled"}}),
            vec![Absent("/reasoning_effort")],
        ),
        case(
            "output_config-effort",
            json!({"output_config": {"effort": "max"},
                   "thinking": {"type": "enabled", "budget_tokens": 1024}}),
            vec![
                At("/reasoning_effort", json!("high")),
                Absent("/output_config"),
            ],
        ),
        case(
            "output_config-effort-low",
            json!({"output_config": {"effort": "low"}}),
            vec![At("/reasoning_effort", json!("low"))],
        ),
    ];
    run(
        Dialect::Messages,
        "openai-reasoning",
        Dialect::Chat,
        messages_base(),
        &cases,
    );
}

// ---------------------------------------------------------------------------
// The Responses face.

fn responses_base() -> Value {
    json!({"model": "bot", "input": "hi"})
}

/// The cases of a Responses request to a target that speaks chat.
fn responses_to_chat_cases() -> Vec<Case> {
    let hi = || json!({"role": "user", "content": "hi"});
    let user =
        |parts: Value| json!({"input": [{"type": "message", "role": "user", "content": parts}]});
    vec![
        case(
            "model",
            json!({}),
            vec![
                At("/model", json!("gpt-4o")),
                At("/messages", json!([hi()])),
            ],
        ),
        case(
            "input-items",
            json!({"input": [
                {"role": "developer", "content": "D"},
                {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "S"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}]},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "x", "annotations": []}, {"type": "output_text", "text": "y"}]}]}),
            vec![At(
                "/messages",
                json!([{"role": "developer", "content": "D"},
                       {"role": "system", "content": [{"type": "text", "text": "S"}]},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": "xy"}]),
            )],
        ),
        case(
            "other-role",
            json!({"input": [{"role": "tool", "content": "x"}]}),
            vec![Refused("input.0.role")],
        ),
        case(
            "refusal",
            json!({"input": [hi(), {"type": "message", "role": "assistant", "content": [
                {"type": "refusal", "refusal": "no"}]}]}),
            vec![At(
                "/messages/1",
                json!({"role": "assistant", "content": null, "refusal": "no"}),
            )],
        ),
        case(
            "input_image",
            user(json!([{"type": "input_image", "image_url": "https://x/a.png", "detail": "low"}])),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}),
            )],
        ),
        case(
            "input_image-file_id",
            user(json!([{"type": "input_image", "file_id": "file-1"}])),
            vec![Refused("input.0.content.0.file_id")],
        ),
        case(
            "input_image-not-user",
            json!({"input": [{"role": "system", "content": [
                {"type": "input_image", "image_url": "https://x/a.png"}]}]}),
            vec![Refused("input.0.content.0.type")],
        ),
        case(
            "input_file",
            user(json!([{"type": "input_file", "filename": "a.pdf",
                         "file_data": "data:application/pdf;base64,JVBE"}])),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "file", "file": {"filename": "a.pdf",
                       "file_data": "data:application/pdf;base64,JVBE"}}),
            )],
        ),
        case(
            "input_file-by-id",
            user(json!([{"type": "input_file", "file_id": "file-1"}])),
            vec![Refused("input.0.content.0.type")],
        ),
        case(
            "other-part",
            user(json!([{"type": "input_audio", "input_audio": {}}])),
            vec![Refused("input.0.content.0.type")],
        ),
        case(
            "function_call",
            json!({"input": [hi(),
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "s"}]}]}),
            vec![At(
                "/messages",
                json!([hi(),
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r"},
                    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "s"}]}]),
            )],
        ),
        case(
            "function_call_output-image",
            json!({"input": [{"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_image", "image_url": "https://x/a.png"}]}]}),
            vec![Refused("input.0.output.0.type")],
        ),
        case(
            "custom_tool_call",
            json!({"input": [hi(),
                {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin"},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"}]}),
            vec![
                At(
                    "/messages/1/tool_calls/0",
                    json!({"id": "c1", "type": "function", "function":
                        {"name": "apply_patch", "arguments": "{\"input\":\"*** Begin\"}"}}),
                ),
                At(
                    "/messages/2",
                    json!({"role": "tool", "tool_call_id": "c1", "content": "done"}),
                ),
            ],
        ),
        case(
            "reasoning-item",
            json!({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
                hi(), {"type": "web_search_call", "id": "ws_1", "status": "completed"}]}),
            vec![Same],
        ),
        case(
            "item_reference",
            json!({"input": [hi(), {"type": "item_reference", "id": "msg_1"}]}),
            vec![Refused("input.1.type")],
        ),
        case(
            "other-item",
            json!({"input": [hi(), {"type": "computer_call_output", "call_id": "c"}]}),
            vec![Refused("input.1.type")],
        ),
        case(
            "instructions",
            json!({"instructions": "Be brief."}),
            vec![At(
                "/messages",
                json!([{"role": "system", "content": "Be brief."}, hi()]),
            )],
        ),
        case(
            "tools-function",
            json!({"tools": [{"type": "function", "name": "f", "description": "d",
                "parameters": {"type": "object"}, "strict": false}, {"type": "function", "name": "g"}]}),
            vec![At(
                "/tools",
                json!([{"type": "function", "function": {"name": "f", "description": "d",
                            "parameters": {"type": "object"}, "strict": false}},
                       {"type": "function", "function": {"name": "g"}}]),
            )],
        ),
        case(
            "tools-custom",
            json!({"tools": [{"type": "custom", "name": "apply_patch", "description": "Patch.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}]}),
            vec![At(
                "/tools/0",
                json!({"type": "function", "function": {"name": "apply_patch",
                    "description": "Patch.\n\nThe input follows this grammar:\nstart: x",
                    "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                                   "required": ["input"]}}}),
            )],
        ),
        case(
            "tools-namespace",
            json!({"tools": [{"type": "namespace", "name": "fs", "tools": [
                {"type": "function", "name": "read"}, {"type": "custom", "name": "write"}]}]}),
            vec![
                At("/tools/0/function/name", json!("fs__read")),
                At("/tools/1/function/name", json!("fs__write")),
            ],
        ),
        case(
            "additional_tools",
            json!({"tools": [{"type": "function", "name": "f"}], "input": [
                {"type": "additional_tools", "role": "developer", "tools": [
                    {"type": "namespace", "name": "fs", "tools": [{"type": "custom", "name": "write"}]}]},
                hi()]}),
            vec![
                At("/tools/0/function/name", json!("f")),
                At("/tools/1/function/name", json!("fs__write")),
                At("/messages", json!([hi()])),
            ],
        ),
        case(
            "additional_tools-other",
            json!({"input": [{"type": "additional_tools", "tools": [{"type": "shell"}]}, hi()]}),
            vec![Refused("input.0.tools.0.type")],
        ),
        case(
            "tools-hosted",
            json!({"tools": [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]},
                {"type": "code_interpreter"}, {"type": "image_generation"}, {"type": "mcp"},
                {"type": "tool_search"}, {"type": "computer_use_preview"}, {"type": "local_shell"}]}),
            vec![Same],
        ),
        case(
            "tools-other",
            json!({"tools": [{"type": "shell"}]}),
            vec![Refused("tools.0.type")],
        ),
        case(
            "tool_choice-mode",
            json!({"tool_choice": "required"}),
            vec![At("/tool_choice", json!("required"))],
        ),
        case(
            "tool_choice-function",
            json!({"tool_choice": {"type": "custom", "name": "apply_patch"}}),
            vec![At(
                "/tool_choice",
                json!({"type": "function", "function": {"name": "apply_patch"}}),
            )],
        ),
        case(
            "tool_choice-allowed_tools",
            json!({"tool_choice": {"type": "allowed_tools", "mode": "auto",
                "tools": [{"type": "function", "name": "f"}]}}),
            vec![At(
                "/tool_choice",
                json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto",
                    "tools": [{"type": "function", "function": {"name": "f"}}]}}),
            )],
        ),
        case(
            "tool_choice-hosted",
            json!({"tool_choice": {"type": "web_search"}}),
            vec![Refused("tool_choice.type")],
        ),
        case(
            "text-format-json_schema",
            json!({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"},
                "strict": true}, "verbosity": "low"}}),
            vec![
                At(
                    "/response_format",
                    json!({"type": "json_schema", "json_schema":
                        {"name": "a", "schema": {"type": "object"}, "strict": true}}),
                ),
                At("/verbosity", json!("low")),
            ],
        ),
        case(
            "text-format-json_object",
            json!({"text": {"format": {"type": "json_object"}}}),
            vec![At("/response_format", json!({"type": "json_object"}))],
        ),
        case(
            "text-format-text",
            json!({"text": {"format": {"type": "text"}}}),
            vec![Same],
        ),
        case(
            "text-format-other",
            json!({"text": {"format": {"type": "grammar"}}}),
            vec![Refused("text.format.type")],
        ),
        case(
            "reasoning",
            json!({"reasoning": {"effort": "high", "summary": "auto"}}),
            vec![At("/reasoning_effort", json!("high")), Absent("/reasoning")],
        ),
        case(
            "left-out",
            json!({"include": ["reasoning.encrypted_content"], "store": true,
                "previous_response_id": "resp_1", "background": false, "truncation": "auto",
                "service_tier": "flex", "prompt_cache_retention": "24h",
                "client_metadata": {"x": "y"}, "stream_options": {"include_obfuscation": false},
                "max_tool_calls": 3, "metadata": {"k": "v"}, "top_logprobs": 0}),
            vec![Same],
        ),
        case(
            "background",
            json!({"background": true}),
            vec![Refused("background")],
        ),
        case(
            "conversation",
            json!({"conversation": "conv_1"}),
            vec![Refused("conversation")],
        ),
        case(
            "prompt",
            json!({"prompt": {"id": "pmpt_1"}}),
            vec![Refused("prompt")],
        ),
        case(
            "top_logprobs",
            json!({"top_logprobs": 2}),
            vec![Refused("top_logprobs")],
        ),
        case(
            "renamed",
            json!({"max_output_tokens": 500}),
            vec![
                At("/max_completion_tokens", json!(500)),
                Absent("/max_output_tokens"),
            ],
        ),
        case(
            "same-names",
            json!({"temperature": 0.3, "top_p": 0.9, "parallel_tool_calls": false,
                "user": "u", "safety_identifier": "s", "prompt_cache_key": "k"}),
            vec![
                At("/temperature", json!(0.3)),
                At("/top_p", json!(0.9)),
                At("/parallel_tool_calls", json!(false)),
                At("/user", json!("u")),
                At("/safety_identifier", json!("s")),
                At("/prompt_cache_key", json!("k")),
            ],
        ),
        case(
            "stream",
            json!({"stream": true}),
            vec![At("/stream", json!(true))],
        ),
        case(
            "other-fields",
            json!({"seed": 7}),
            vec![At("/seed", json!(7))],
        ),
    ]
}

/// A Responses request to each kind that speaks chat and not Responses.
#[test]
fn responses_to_chat() {
    for route in ["openai", "azure", "mock"] {
        run(
            Dialect::Responses,
            route,
            Dialect::Chat,
            responses_base(),
            &responses_to_chat_cases(),
        );
    }
}

/// A Responses request to an Anthropic target: said in chat, then in the
/// Messages API.
#[test]
fn responses_to_anthropic() {
    let hi = || json!({"role": "user", "content": "hi"});
    let text = |t: &str| json!({"type": "text", "text": t});
    let cases = [
        case(
            "model",
            json!({}),
            vec![
                At("/model", json!("claude-x")),
                At(
                    "/messages",
                    json!([{"role": "user", "content": [text("hi")]}]),
                ),
                At("/max_tokens", json!(4096)),
            ],
        ),
        case(
            "instructions",
            json!({"instructions": "I", "input": [{"role": "developer", "content": "D"}, hi(),
                {"role": "system", "content": "S"}]}),
            vec![
                At("/system", json!("I\n\nD\n\nS")),
                At(
                    "/messages",
                    json!([{"role": "user", "content": [text("hi")]}]),
                ),
            ],
        ),
        case(
            "input_image",
            json!({"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/png;base64,QUJD"}]}]}),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}),
            )],
        ),
        case(
            "input_file",
            json!({"input": [hi(), {"role": "user", "content": [{"type": "input_file",
                "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBE"}]}]}),
            vec![Refused("messages.1")],
        ),
        case(
            "function_call",
            json!({"input": [hi(),
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\":1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r"}]}),
            vec![At(
                "/messages",
                json!([{"role": "user", "content": [text("hi")]},
                       {"role": "assistant", "content": [
                           {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": "c1", "content": "r"}]}]),
            )],
        ),
        case(
            "custom_tool_call",
            json!({"input": [hi(),
                {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin"}]}),
            vec![At(
                "/messages/1/content/0",
                json!({"type": "tool_use", "id": "c1", "name": "apply_patch", "input": {"input": "*** Begin"}}),
            )],
        ),
        case(
            "refusal",
            json!({"input": [hi(), {"type": "message", "role": "assistant", "content": [
                {"type": "refusal", "refusal": "no"}]}, {"role": "user", "content": "again"}]}),
            vec![At(
                "/messages",
                json!([{"role": "user", "content": [text("hi"), text("again")]}]),
            )],
        ),
        case(
            "reasoning-item",
            json!({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}, hi()]}),
            vec![Same],
        ),
        case(
            "tools-custom",
            json!({"tools": [{"type": "custom", "name": "apply_patch"},
                {"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read"}]},
                {"type": "web_search"}]}),
            vec![At(
                "/tools",
                json!([{"name": "apply_patch", "description": "",
                        "input_schema": {"type": "object", "properties": {"input": {"type": "string"}},
                                         "required": ["input"]}},
                       {"name": "fs__read", "input_schema": {"type": "object", "properties": {}}}]),
            )],
        ),
        case(
            "tool_choice",
            json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
                   "parallel_tool_calls": false}),
            vec![At(
                "/tool_choice",
                json!({"type": "any", "disable_parallel_tool_use": true}),
            )],
        ),
        case(
            "tool_choice-allowed_tools",
            json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools",
                "mode": "auto", "tools": [{"type": "function", "name": "f"}]}}),
            vec![Refused("tool_choice")],
        ),
        case(
            "text-format",
            json!({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}}),
            vec![
                At("/tools/0/name", json!("a")),
                At("/tool_choice", json!({"type": "tool", "name": "a"})),
            ],
        ),
        case(
            "text-format-with-tools",
            json!({"tools": [{"type": "function", "name": "f"}],
                   "text": {"format": {"type": "json_object"}}}),
            vec![Refused("response_format")],
        ),
        case(
            "max_output_tokens",
            json!({"max_output_tokens": 300}),
            vec![At("/max_tokens", json!(300))],
        ),
        case(
            "user",
            json!({"user": "u", "safety_identifier": "s"}),
            vec![At("/metadata", json!({"user_id": "u"}))],
        ),
        case(
            "left-out",
            json!({"reasoning": {"effort": "high", "summary": "auto"}, "text": {"verbosity": "low"},
                   "safety_identifier": "s", "prompt_cache_key": "k", "seed": 7,
                   "include": ["reasoning.encrypted_content"], "store": true, "metadata": {"k": "v"}}),
            vec![Same],
        ),
        case(
            "temperature",
            json!({"temperature": 1.5, "top_p": 0.5}),
            vec![At("/temperature", json!(1.5)), At("/top_p", json!(0.5))],
        ),
        case(
            "stream",
            json!({"stream": true}),
            vec![At("/stream", json!(true))],
        ),
        case(
            "refusals",
            json!({"conversation": "conv_1"}),
            vec![Refused("conversation")],
        ),
    ];
    run(
        Dialect::Responses,
        "anthropic",
        Dialect::Messages,
        responses_base(),
        &cases,
    );
}

// ---------------------------------------------------------------------------
// count_tokens.

/// A token count for a target whose API has none: counted here by the
/// model's tokenizer, of the messages the request becomes in chat.
#[test]
fn count_tokens_counted_locally() {
    let targets = Targets::new();
    let count = |route: &str, request: Value| -> Result<u64, Refusal> {
        match send(
            Dialect::CountTokens,
            &request,
            &targets.get(route).targets[0],
        )? {
            Sent::Local(v) => Ok(v["input_tokens"].as_u64().unwrap()),
            other => panic!("{route}: a call was made: {other:?}"),
        }
    };
    let base = json!({"model": "bot", "messages": [{"role": "user", "content": "hello there"}]});
    for route in ["openai", "azure", "responses-api", "mock"] {
        let n = count(route, base.clone()).unwrap();
        assert!(n > 0, "{route}");
        // `system` is counted, as the system message it becomes.
        let with_system = patched(
            &base,
            &json!({"system": "You are a careful assistant who answers briefly."}),
        );
        assert!(count(route, with_system).unwrap() > n, "{route}: system");
        // Tool definitions are not counted.
        let with_tools = patched(
            &base,
            &json!({"tools": [{"name": "lookup", "description": "Looks a long thing up in a big table.",
                               "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]}),
        );
        assert_eq!(count(route, with_tools).unwrap(), n, "{route}: tools");
        // Nor are images.
        let with_image = patched(
            &base,
            &json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "hello there"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]}]}),
        );
        assert_eq!(count(route, with_image).unwrap(), n, "{route}: images");
        // What the translation refuses, the count refuses.
        let server_tool = patched(
            &base,
            &json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        );
        let r = count(route, server_tool).unwrap_err();
        assert_eq!(r.param.as_deref(), Some("tools.0.type"), "{route}");
    }
    // A model whose tokenizer idem does not know (an Azure deployment
    // named otherwise) cannot be counted.
    let r = count("azure-deployment", base).unwrap_err();
    assert_eq!(r.param.as_deref(), Some("model"));
    assert!(r.message.contains("my-deployment"), "{}", r.message);
}

// ---------------------------------------------------------------------------
// Passed as sent.

/// A target that speaks the request's dialect gets it as its client sent
/// it, with the target's model and the client's answer-changing headers;
/// only what the call itself needs differs.
#[test]
fn native_targets_get_the_request_as_sent() {
    let targets = Targets::new();
    let native = |from: Dialect, route: &str, request: &Value| -> (Value, Forwarded) {
        match send(from, request, &targets.get(route).targets[0]).unwrap() {
            Sent::Native(body, forwarded) => (body, forwarded),
            other => panic!("{route}: not sent as it came: {other:?}"),
        }
    };
    let with_model = |request: &Value, model: &str| patched(request, &json!({"model": model}));

    // Messages to Anthropic: every field and block, cache_control included.
    let messages = json!({"model": "bot", "max_tokens": 100, "stream": true,
        "thinking": {"type": "enabled", "budget_tokens": 2048}, "top_k": 5,
        "context_management": {"edits": []}, "output_config": {"effort": "high"},
        "container": "cntr_1", "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}],
        "service_tier": "auto", "metadata": {"user_id": "u"}, "custom_knob": 1,
        "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        "messages": [{"role": "system", "content": "T"}, {"role": "user", "content": [
            {"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}}]},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]});
    let (body, forwarded) = native(Dialect::Messages, "anthropic", &messages);
    assert_eq!(body, with_model(&messages, "claude-x"));
    assert_eq!(
        forwarded,
        Forwarded::read(Dialect::Messages, |n| if n == "anthropic-beta" {
            vec!["tools-2099"]
        } else {
            vec![]
        })
    );
    // Its token count too.
    let mut count = object(messages.clone());
    count.remove("max_tokens");
    count.remove("stream");
    let count = Value::Object(count);
    let (body, _) = native(Dialect::CountTokens, "anthropic", &count);
    assert_eq!(body, with_model(&count, "claude-x"));

    // Responses to a provider with `responses_api`: `store: false`, no
    // `previous_response_id` (idem keeps the conversation and spells it
    // out as `input`); everything else as sent.
    let responses = json!({"model": "bot", "input": [{"role": "user", "content": "hi"}],
        "store": true, "previous_response_id": "resp_1", "background": true,
        "conversation": "conv_1", "prompt": {"id": "p"}, "include": ["reasoning.encrypted_content"],
        "tools": [{"type": "custom", "name": "apply_patch"}, {"type": "web_search"}],
        "reasoning": {"effort": "high", "summary": "auto"}, "top_logprobs": 3, "custom_knob": 1});
    let (body, forwarded) = native(Dialect::Responses, "responses-api", &responses);
    let mut want = object(with_model(&responses, "gpt-4o"));
    want.insert("store".into(), json!(false));
    want.remove("previous_response_id");
    assert_eq!(body, Value::Object(want));
    assert!(
        forwarded != Forwarded::default(),
        "OpenAI-Beta is forwarded"
    );

    // Chat to every kind that speaks it: a stream's `stream_options` are
    // idem's own (usage asked for), a plain call carries none.
    let chat = json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}],
        "n": 3, "logprobs": true, "reasoning_effort": "high", "custom_knob": 1,
        "stream_options": {"include_usage": false}});
    for route in ["openai", "azure", "responses-api", "mock"] {
        let (body, _) = native(Dialect::Chat, route, &chat);
        let mut want = object(with_model(&chat, "gpt-4o"));
        want.remove("stream_options");
        assert_eq!(body, Value::Object(want.clone()), "{route}");
        let streamed = patched(&chat, &json!({"stream": true}));
        let (body, _) = native(Dialect::Chat, route, &streamed);
        want.insert("stream".into(), json!(true));
        want.insert("stream_options".into(), json!({"include_usage": true}));
        assert_eq!(body, Value::Object(want), "{route}");
    }
}
