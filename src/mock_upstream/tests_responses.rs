//! The Responses API face: `POST /v1/responses`, spoken natively.

use serde_json::{Value, json};

use super::tests::{client, control, held, start};
use super::*;

async fn send(client: &reqwest::Client, server: &MockServer, body: &Value) -> reqwest::Response {
    client
        .post(format!("{}/responses", server.base_url()))
        .json(body)
        .send()
        .await
        .unwrap()
}

async fn answered(client: &reqwest::Client, server: &MockServer, body: &Value) -> Value {
    let response = send(client, server, body).await;
    assert_eq!(response.status(), 200, "{body}");
    response.json().await.unwrap()
}

/// The events of an SSE body, each checked to name its type in `event:`.
fn events(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            let mut lines = e.lines();
            let kind = lines.next().unwrap().strip_prefix("event: ").unwrap();
            let data: Value =
                serde_json::from_str(lines.next().unwrap().strip_prefix("data: ").unwrap())
                    .unwrap();
            assert_eq!(data["type"], kind);
            data
        })
        .collect()
}

async fn streamed(client: &reqwest::Client, server: &MockServer, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let response = send(client, server, &body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    events(&response.text().await.unwrap())
}

fn types(events: &[Value]) -> Vec<&str> {
    events.iter().map(|e| e["type"].as_str().unwrap()).collect()
}

fn output_types(response: &Value) -> Vec<&str> {
    response["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect()
}

/// Codex's tools, in short: a function, a custom tool with a grammar, a
/// namespace of functions, web search and tool search.
fn codex_tools() -> Value {
    json!([
        {"type": "function", "name": "exec_command", "strict": false, "parameters": {
            "type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark",
            "definition": "start: /.+/"}},
        {"type": "namespace", "name": "clock", "description": "", "tools": [
            {"type": "function", "name": "sleep", "parameters": {"type": "object",
                "properties": {"duration_ms": {"type": "number"}}, "required": ["duration_ms"]}}]},
        {"type": "web_search", "external_web_access": false},
        {"type": "tool_search", "execution": "client"},
    ])
}

#[tokio::test]
async fn a_plain_response_has_openai_s_shape_and_usage() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let r = answered(
        &client,
        &server,
        &json!({"model": "gpt-test", "instructions": "Be brief.", "metadata": {"k": "v"},
        "input": [
            {"role": "developer", "content": "dev"},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "hello"},
                {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                {"type": "input_text", "text": "there"}]},
        ]}),
    )
    .await;
    assert_eq!(r["id"], "resp_mock1");
    assert_eq!(r["object"], "response");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["model"], "gpt-test");
    assert_eq!(r["instructions"], "Be brief.");
    assert_eq!(r["metadata"], json!({"k": "v"}));
    assert_eq!(r["incomplete_details"], Value::Null);
    assert_eq!(output_types(&r), ["message"]);
    assert_eq!(
        r["output"][0],
        json!({"id": "msg_mock1", "type": "message", "status": "completed", "role": "assistant",
            "content": [{"type": "output_text", "text": "mock answer #1 to: hello there",
                "annotations": [], "logprobs": []}]})
    );
    let usage = &r["usage"];
    let (input, output) = (
        usage["input_tokens"].as_u64().unwrap(),
        usage["output_tokens"].as_u64().unwrap(),
    );
    assert!(input >= 1 && output >= 1, "{usage}");
    assert_eq!(usage["total_tokens"], input + output);
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);
    let call = &server.calls()[0];
    assert_eq!(call.endpoint, Endpoint::Responses);
    assert_eq!(call.prompt, "hello there");
    server.shutdown().await;
}

#[tokio::test]
async fn reasoning_comes_first_with_a_summary_and_encrypted_content_when_asked() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = json!({"model": "gpt-test", "input": "think", "store": false,
        "reasoning": {"effort": "low", "summary": "auto"},
        "include": ["reasoning.encrypted_content"]});
    let r = answered(&client, &server, &body).await;
    assert_eq!(output_types(&r), ["reasoning", "message"]);
    let reasoning = &r["output"][0];
    assert_eq!(reasoning["id"], "rs_mock1");
    assert_eq!(reasoning["summary"][0]["type"], "summary_text");
    assert!(
        reasoning["summary"][0]["text"]
            .as_str()
            .unwrap()
            .contains("mock reasoning #1 about: think")
    );
    let encrypted = reasoning["encrypted_content"].as_str().unwrap().to_owned();
    assert!(r["usage"]["output_tokens_details"]["reasoning_tokens"].as_u64() > Some(0));

    // Without include, no encrypted content; without summary, none.
    body["include"] = json!([]);
    body["reasoning"] = json!({"effort": "low"});
    let r = answered(&client, &server, &body).await;
    assert_eq!(r["output"][0]["summary"], json!([]));
    assert_eq!(r["output"][0].get("encrypted_content"), None);

    // The second turn sends the reasoning back: accepted as the mock made it.
    let turn = |item: Value| {
        json!({"model": "gpt-test", "store": false, "reasoning": {"effort": "low"}, "input": [
            {"role": "user", "content": "think"},
            item,
            {"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": "mock answer #1 to: think"}]},
            {"role": "user", "content": "again"},
        ]})
    };
    let back = json!({"type": "reasoning", "id": "rs_mock1", "summary": [],
        "encrypted_content": encrypted});
    let r = answered(&client, &server, &turn(back)).await;
    assert_eq!(
        r["output"][1]["content"][0]["text"],
        "mock answer #3 to: again"
    );
    // Tampered: OpenAI's invalid_encrypted_content.
    let mut tampered = encrypted.clone();
    tampered.insert(4, 'x');
    let forged = json!({"type": "reasoning", "id": "rs_mock1", "summary": [],
        "encrypted_content": tampered});
    let response = send(&client, &server, &turn(forged)).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(
        error["error"]["code"], "invalid_encrypted_content",
        "{error}"
    );
    // Without encrypted content under store: false, an unknown item.
    let bare = json!({"type": "reasoning", "id": "rs_mock1", "summary": []});
    let response = send(&client, &server, &turn(bare)).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("Item with id 'rs_mock1' not found")
            && message.contains("`store` is set to false"),
        "{error}"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn the_marker_calls_custom_function_and_namespaced_tools() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let ask = |text: &str| json!({"model": "gpt-test", "input": text, "tools": codex_tools()});

    // A custom tool: its input the JSON string after the name.
    let r = answered(
        &client,
        &server,
        &ask(r#"call tool apply_patch "*** Begin Patch\n*** End Patch""#),
    )
    .await;
    assert_eq!(output_types(&r), ["message", "custom_tool_call"]);
    let call = &r["output"][1];
    assert_eq!(call["name"], "apply_patch");
    assert_eq!(call["call_id"], "call_mock_1");
    assert_eq!(call["id"], "ctc_mock1");
    assert_eq!(call["input"], "*** Begin Patch\n*** End Patch");

    // A function: arguments from its required properties, or as written.
    let r = answered(&client, &server, &ask("call tool exec_command please")).await;
    let call = &r["output"][1];
    assert_eq!(call["type"], "function_call");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(arguments, json!({"cmd": "call tool exec_command please"}));
    let r = answered(
        &client,
        &server,
        &ask(r#"call tool exec_command {"cmd": "ls"}"#),
    )
    .await;
    assert_eq!(r["output"][1]["arguments"], r#"{"cmd":"ls"}"#);

    // A function nested in a namespace, named alone or with it.
    for text in ["call tool sleep", "call tool clock.sleep"] {
        let r = answered(&client, &server, &ask(text)).await;
        let call = &r["output"][1];
        assert_eq!(call["name"], "sleep", "{r}");
        assert_eq!(call["namespace"], "clock", "{r}");
        assert_eq!(call["arguments"], r#"{"duration_ms":1}"#);
    }

    // Tools in an additional_tools input item count too (Codex sends its
    // tools so for some models).
    let r = answered(
        &client,
        &server,
        &json!({"model": "gpt-test", "input": [
            {"type": "additional_tools", "role": "developer", "tools": [{"type": "namespace",
                "name": "functions", "tools": [{"type": "custom", "name": "exec"}]}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "call tool exec \"1 + 1\""}]},
        ]}),
    )
    .await;
    assert_eq!(r["output"][1]["type"], "custom_tool_call", "{r}");
    assert_eq!(r["output"][1]["input"], "1 + 1");

    // Forced by tool_choice: the call alone.
    let mut forced = ask("anything");
    forced["tool_choice"] = json!({"type": "function", "name": "exec_command"});
    let r = answered(&client, &server, &forced).await;
    assert_eq!(output_types(&r), ["function_call"]);
    forced["tool_choice"] = json!("required");
    assert_eq!(
        output_types(&answered(&client, &server, &forced).await),
        ["function_call"]
    );
    forced["tool_choice"] = json!("none");
    let mut marked = forced.clone();
    marked["input"] = json!("call tool exec_command");
    assert_eq!(
        output_types(&answered(&client, &server, &marked).await),
        ["message"]
    );

    // A tool output ends the round trip: the answer echoes it, no call.
    let r = answered(
        &client,
        &server,
        &json!({"model": "gpt-test", "tools": codex_tools(), "input": [
            {"role": "user", "content": "call tool exec_command"},
            {"type": "function_call", "call_id": "call_mock_9", "name": "exec_command",
                "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_mock_9", "output": "done: 0"},
        ]}),
    )
    .await;
    assert_eq!(output_types(&r), ["message"]);
    assert!(
        r["output"][0]["content"][0]["text"]
            .as_str()
            .unwrap()
            .ends_with("to: done: 0")
    );
    server.shutdown().await;
}

#[tokio::test]
async fn a_search_adds_a_web_search_call_before_the_message() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let body = json!({"model": "gpt-test", "input": "search the web for otters",
        "tools": [{"type": "web_search"}]});
    let r = answered(&client, &server, &body).await;
    assert_eq!(output_types(&r), ["web_search_call", "message"]);
    assert_eq!(
        r["output"][0],
        json!({"id": "ws_mock1", "type": "web_search_call", "status": "completed",
            "action": {"type": "search", "query": "search the web for otters"}})
    );
    // No web search tool, no search.
    let r = answered(
        &client,
        &server,
        &json!({"model": "gpt-test", "input": "search the web"}),
    )
    .await;
    assert_eq!(output_types(&r), ["message"]);

    let events = streamed(&client, &server, &body).await;
    let names = types(&events);
    let at = names
        .iter()
        .position(|t| *t == "response.web_search_call.in_progress")
        .unwrap();
    assert_eq!(
        names[at..at + 4],
        [
            "response.web_search_call.in_progress",
            "response.web_search_call.searching",
            "response.web_search_call.completed",
            "response.output_item.done",
        ]
    );
    server.shutdown().await;
}

#[tokio::test]
async fn a_stream_is_the_real_event_sequence_and_ends_as_the_plain_response() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let body = json!({"model": "gpt-test", "input": "call tool apply_patch",
        "tools": codex_tools(), "reasoning": {"summary": "detailed"},
        "include": ["reasoning.encrypted_content"]});
    let events = streamed(&client, &server, &body).await;
    let numbers: Vec<u64> = events
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, (0..events.len() as u64).collect::<Vec<_>>());
    let names = types(&events);
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.reasoning_summary_part.added",
    ];
    let deltas = |kind: &str| names.iter().filter(|t| **t == kind).count();
    let summary_deltas = deltas("response.reasoning_summary_text.delta");
    expected.extend(std::iter::repeat_n(
        "response.reasoning_summary_text.delta",
        summary_deltas,
    ));
    expected.extend([
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
    ]);
    expected.extend(std::iter::repeat_n(
        "response.output_text.delta",
        deltas("response.output_text.delta"),
    ));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]);
    let input_deltas = deltas("response.custom_tool_call_input.delta");
    assert!(input_deltas >= 2, "{names:?}");
    expected.extend(std::iter::repeat_n(
        "response.custom_tool_call_input.delta",
        input_deltas,
    ));
    expected.extend([
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, expected);
    assert_eq!(events[0]["response"]["status"], "in_progress");
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, "mock answer #1 to: call tool apply_patch");
    let input: String = events
        .iter()
        .filter(|e| e["type"] == "response.custom_tool_call_input.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(input, "call tool apply_patch");
    // The added items are empty, the done items whole; the last event
    // carries the response the plain request gets.
    assert_eq!(events[2]["item"]["summary"], json!([]));
    assert!(events[2]["item"].get("encrypted_content").is_none());
    let done = events.last().unwrap()["response"].clone();
    let plain = answered(&client, &server, &body).await;
    let strip = |mut r: Value| {
        for key in ["id", "created_at", "output"] {
            r.as_object_mut().unwrap().remove(key);
        }
        r
    };
    assert_eq!(output_types(&done), output_types(&plain));
    assert_eq!(strip(done.clone()), strip(plain));
    assert!(done["output"][0]["encrypted_content"].is_string());

    // A function call streams its arguments.
    let body = json!({"model": "gpt-test", "input": "x", "tools": codex_tools(),
        "tool_choice": {"type": "function", "name": "exec_command"}});
    let events = streamed(&client, &server, &body).await;
    let arguments: String = events
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(arguments, r#"{"cmd":"x"}"#);
    assert!(types(&events).contains(&"response.function_call_arguments.done"));
    server.shutdown().await;
}

#[tokio::test]
async fn max_output_tokens_cuts_the_text_and_the_response_is_incomplete() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let body = json!({"model": "gpt-test", "max_output_tokens": 16,
        "input": "a question long enough that its echo passes sixty four characters"});
    let r = answered(&client, &server, &body).await;
    assert_eq!(r["status"], "incomplete");
    assert_eq!(
        r["incomplete_details"],
        json!({"reason": "max_output_tokens"})
    );
    assert_eq!(r["output"][0]["status"], "incomplete");
    let text = r["output"][0]["content"][0]["text"].as_str().unwrap();
    assert_eq!(text.chars().count(), 64);
    let events = streamed(&client, &server, &body).await;
    assert_eq!(types(&events).last(), Some(&"response.incomplete"));
    server.shutdown().await;
}

#[tokio::test]
async fn text_format_json_schema_answers_a_json_object() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let body = json!({"model": "gpt-test", "input": "who?", "text": {"format": {
        "type": "json_schema", "name": "person", "strict": true, "schema": {"type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"], "additionalProperties": false}}}});
    let r = answered(&client, &server, &body).await;
    let text = r["output"][0]["content"][0]["text"].as_str().unwrap();
    let parsed: Value = serde_json::from_str(text).unwrap();
    assert_eq!(parsed, json!({"name": "mock answer #1 to: who?", "age": 1}));
    assert_eq!(r["text"]["format"]["type"], "json_schema");
    server.shutdown().await;
}

#[tokio::test]
async fn what_openai_refuses_is_a_400_naming_the_param() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let with = |change: &dyn Fn(&mut Value)| {
        let mut body = json!({"model": "gpt-test", "input": "hi"});
        change(&mut body);
        body
    };
    let cases = [
        (
            with(&|b| b["temperatur"] = json!(1)),
            "temperatur",
            "unknown_parameter",
        ),
        (
            with(&|b| {
                b.as_object_mut().unwrap().remove("model");
            }),
            "model",
            "missing_required_parameter",
        ),
        (
            with(&|b| b["previous_response_id"] = json!("resp_1")),
            "previous_response_id",
            "previous_response_not_found",
        ),
        (
            with(&|b| b["input"] = json!({"role": "user"})),
            "input",
            "invalid_type",
        ),
        (
            with(&|b| b["input"] = json!([{"type": "telepathy"}])),
            "input[0].type",
            "invalid_value",
        ),
        (
            with(&|b| b["input"] = json!([{"role": "tool", "content": "x"}])),
            "input[0].role",
            "invalid_value",
        ),
        (
            with(&|b| {
                b["input"] = json!([{"role": "assistant", "content": [
                    {"type": "input_text", "text": "x"}]}])
            }),
            "input[0].content[0].type",
            "invalid_value",
        ),
        (
            with(&|b| b["input"] = json!([{"type": "function_call", "call_id": "c", "name": "f"}])),
            "input[0].arguments",
            "missing_required_parameter",
        ),
        (
            with(&|b| b["include"] = json!(["everything"])),
            "include[0]",
            "invalid_value",
        ),
        (
            with(&|b| b["reasoning"] = json!({"effort": "enormous"})),
            "reasoning.effort",
            "invalid_value",
        ),
        (
            with(&|b| b["max_output_tokens"] = json!(5)),
            "max_output_tokens",
            "integer_below_min_value",
        ),
        (
            with(&|b| b["tools"] = json!([{"type": "function"}])),
            "tools[0].name",
            "missing_required_parameter",
        ),
        (
            with(&|b| {
                b["tools"] = json!([{"type": "custom", "name": "c"}]);
                b["tool_choice"] = json!({"type": "function", "name": "nope"});
            }),
            "tool_choice",
            "invalid_value",
        ),
        (
            with(&|b| b["text"] = json!({"format": {"type": "yaml"}})),
            "text.format.type",
            "invalid_value",
        ),
    ];
    for (body, param, code) in &cases {
        let response = send(&client, &server, body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
        assert_eq!(error["error"]["param"], *param, "{body}: {error}");
        assert_eq!(error["error"]["code"], *code, "{body}: {error}");
    }
    let stats = server.stats();
    assert_eq!(stats.failed, cases.len() as u64);
    assert!(server.calls().iter().all(|c| c.status == Some(400)));
    server.shutdown().await;
}

#[tokio::test]
async fn held_failed_and_released_like_the_other_endpoints() {
    let server = start(Behaviour {
        hold: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let body = json!({"model": "gpt-test", "input": "wait"});
    let first = tokio::spawn({
        let (client, url) = (client.clone(), format!("{}/responses", server.base_url()));
        let body = body.clone();
        async move { client.post(url).json(&body).send().await.unwrap() }
    });
    assert_eq!(held(&client, &server, 1).await, [1]);
    control(
        &client,
        &server,
        "release",
        json!({"seq": 1, "content": "chosen"}),
    )
    .await;
    let r: Value = first.await.unwrap().json().await.unwrap();
    assert_eq!(r["output"][0]["content"][0]["text"], "chosen");

    server.set_behaviour(Behaviour {
        fail_status: Some(429),
        retry_after: Some(3),
        ..Behaviour::default()
    });
    let response = send(&client, &server, &body).await;
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "3");
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "rate_limit_error");
    let calls = server.calls();
    assert_eq!(calls.len(), 2);
    assert!(calls.iter().all(|c| c.endpoint == Endpoint::Responses));
    assert_eq!(calls[1].status, Some(429));
    server.shutdown().await;
}

async fn garbled(kind: Garbage, stream: bool) -> (String, String) {
    let server = start(Behaviour {
        garbage: Some(kind),
        ..Behaviour::default()
    })
    .await;
    let body = json!({"model": "gpt-test", "input": "hello there", "stream": stream});
    let response = send(&client(), &server, &body).await;
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    let text = response.text().await.unwrap();
    assert_eq!(server.calls()[0].outcome, CallOutcome::Garbage);
    server.shutdown().await;
    (content_type, text)
}

fn event_types(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|e| e.lines().next()?.strip_prefix("event: ").map(str::to_owned))
        .collect()
}

#[tokio::test]
async fn each_kind_of_garbage_has_a_responses_form() {
    let (_, text) = garbled(Garbage::StreamWithoutDone, false).await;
    let names = event_types(&text);
    assert_eq!(names.last().unwrap(), "response.output_text.delta");
    assert!(!names.iter().any(|n| n == "response.completed"));

    let (_, text) = garbled(Garbage::StreamError, true).await;
    let names = event_types(&text);
    assert_eq!(names.last().unwrap(), "response.failed");
    let failed: Value = serde_json::from_str(
        text.trim_end()
            .rsplit("\n\n")
            .next()
            .unwrap()
            .lines()
            .nth(1)
            .unwrap()
            .strip_prefix("data: ")
            .unwrap(),
    )
    .unwrap();
    assert_eq!(failed["response"]["status"], "failed");
    assert_eq!(failed["response"]["error"]["code"], "server_error");
    let (_, text) = garbled(Garbage::StreamError, false).await;
    assert!(serde_json::from_str::<Value>(&text).unwrap()["error"].is_object());

    let (_, text) = garbled(Garbage::ErrorObject, false).await;
    assert_eq!(
        serde_json::from_str::<Value>(&text).unwrap()["error"]["type"],
        "server_error"
    );
    let (_, text) = garbled(Garbage::ErrorObject, true).await;
    assert_eq!(event_types(&text), ["response.created", "error"]);

    let (_, text) = garbled(Garbage::EmptyChoices, false).await;
    let r: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        (r["status"].clone(), r["output"].clone()),
        (json!("completed"), json!([]))
    );
    let (_, text) = garbled(Garbage::EmptyChoices, true).await;
    assert_eq!(
        event_types(&text),
        [
            "response.created",
            "response.in_progress",
            "response.completed"
        ]
    );

    let (_, text) = garbled(Garbage::Truncated, false).await;
    assert!(serde_json::from_str::<Value>(&text).is_err());
    let (content_type, text) = garbled(Garbage::NotJson, false).await;
    assert!(content_type.starts_with("text/html") && text.starts_with("<html>"));
    let (_, text) = garbled(Garbage::Empty, false).await;
    assert!(text.is_empty());

    let (_, text) = garbled(Garbage::FinishedWithoutDone, true).await;
    let names = event_types(&text);
    assert_eq!(names.last().unwrap(), "response.output_item.done");
    let (_, text) = garbled(Garbage::DoneWithoutFinish, true).await;
    let names = event_types(&text);
    assert_eq!(names.last().unwrap(), "response.completed");
    assert!(!names.iter().any(|n| n == "response.output_text.done"));
}

#[tokio::test]
async fn pad_bytes_pads_the_message_plain_and_streamed() {
    let server = start(Behaviour {
        pad_bytes: Some(20_000),
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let body = json!({"model": "gpt-test", "input": "pad me"});
    let plain = send(&client, &server, &body).await.text().await.unwrap();
    assert!(
        plain.len() >= 20_000 && plain.len() < 21_000,
        "{}",
        plain.len()
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = send(&client, &server, &streamed)
        .await
        .text()
        .await
        .unwrap();
    assert!(text.len() >= 20_000, "{}", text.len());
    assert!(
        server
            .calls()
            .iter()
            .all(|c| c.outcome == CallOutcome::Padded)
    );
    server.shutdown().await;
}

#[test]
fn a_reply_is_a_pure_function_of_the_request_and_the_call_number() {
    use super::responses::Reply;
    let request = json!({"model": "m", "input": "same", "reasoning": {"summary": "auto"}});
    let body = |seq| {
        let mut body = Reply::new(&request, seq, None).body();
        body.as_object_mut().unwrap().remove("created_at");
        body
    };
    assert_eq!(body(4), body(4));
    assert_ne!(body(4), body(5));
    // An empty request still gets an answer (the handler validates first).
    let empty = Reply::new(&json!({}), 1, None).body();
    assert_eq!(
        empty["output"][0]["content"][0]["text"],
        "mock answer #1 to: "
    );
}
