//! The mock's Anthropic face: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`.

use futures_util::StreamExt;
use serde_json::{Value, json};

use super::tests::{SAFETY, client, control, held, start};
use super::*;

pub(super) const KEY: &str = "sk-ant-test";

pub(super) fn ask(text: &str) -> Value {
    json!({"model": "claude-test", "max_tokens": 1024, "messages": [
        {"role": "user", "content": text},
    ]})
}

pub(super) fn weather() -> Value {
    json!({
        "name": "get_weather",
        "description": "The weather somewhere.",
        "input_schema": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": ["integer", "null"]},
                "alerts": {"type": "boolean"},
                "hours": {"type": "array"},
                "where": {"type": "object"},
                "mode": {"const": "fast"},
            },
            "required": ["city", "unit", "days", "alerts", "hours", "where", "mode"],
        },
    })
}

fn clock() -> Value {
    json!({"name": "get_time", "input_schema": {"type": "object", "properties": {}}})
}

async fn send(
    client: &reqwest::Client,
    server: &MockServer,
    path: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .post(format!("http://{}/v1/{path}", server.addr()))
        .header("x-api-key", KEY)
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .unwrap()
}

pub(super) async fn message(
    client: &reqwest::Client,
    server: &MockServer,
    body: &Value,
) -> reqwest::Response {
    send(client, server, "messages", body).await
}

/// A successful plain answer's body.
pub(super) async fn answered(client: &reqwest::Client, server: &MockServer, body: &Value) -> Value {
    let response = message(client, server, body).await;
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// The (event, data) pairs of an Anthropic SSE body; each frame must be
/// `event: <type>\ndata: <json>` with the data's `type` the event's.
pub(super) fn frames(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|frame| !frame.is_empty())
        .map(|frame| {
            let (event, data) = frame.split_once('\n').unwrap();
            let event = event.strip_prefix("event: ").unwrap();
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(data["type"], event, "{frame}");
            (event.to_owned(), data)
        })
        .collect()
}

pub(super) async fn streamed(
    client: &reqwest::Client,
    server: &MockServer,
    body: &Value,
) -> Vec<(String, Value)> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let response = message(client, server, &body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    assert!(response.headers().contains_key("request-id"));
    frames(&response.text().await.unwrap())
}

/// The text blocks' text of a message.
pub(super) fn text(message: &Value) -> String {
    message["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "text")
        .map(|b| b["text"].as_str().unwrap())
        .collect()
}

/// The message a stream builds, as an SDK accumulates it: the
/// `message_start` message, each block from its start and deltas (a tool
/// input from its `partial_json` pieces), the stop reason and usage of the
/// `message_delta`.
pub(super) fn assemble(events: &[(String, Value)]) -> Value {
    let mut message = events[0].1["message"].clone();
    let mut json_parts: Vec<String> = Vec::new();
    for (event, data) in events {
        let index = data["index"].as_u64().unwrap_or(0) as usize;
        match event.as_str() {
            "content_block_start" => {
                message["content"]
                    .as_array_mut()
                    .unwrap()
                    .push(data["content_block"].clone());
                json_parts.push(String::new());
            }
            "content_block_delta" => {
                let block = &mut message["content"][index];
                match data["delta"]["type"].as_str().unwrap() {
                    "text_delta" => {
                        let text = block["text"].as_str().unwrap().to_owned();
                        block["text"] = json!(text + data["delta"]["text"].as_str().unwrap());
                    }
                    "input_json_delta" => {
                        json_parts[index].push_str(data["delta"]["partial_json"].as_str().unwrap());
                    }
                    "thinking_delta" => {
                        let text = block["thinking"].as_str().unwrap().to_owned();
                        block["thinking"] =
                            json!(text + data["delta"]["thinking"].as_str().unwrap());
                    }
                    "signature_delta" => block["signature"] = data["delta"]["signature"].clone(),
                    "citations_delta" => block["citations"]
                        .as_array_mut()
                        .unwrap()
                        .push(data["delta"]["citation"].clone()),
                    other => panic!("delta {other}"),
                }
            }
            "content_block_stop"
                if matches!(
                    message["content"][index]["type"].as_str(),
                    Some("tool_use" | "server_tool_use")
                ) =>
            {
                message["content"][index]["input"] =
                    serde_json::from_str(&json_parts[index]).unwrap();
            }
            "message_delta" => {
                message["stop_reason"] = data["delta"]["stop_reason"].clone();
                message["stop_sequence"] = data["delta"]["stop_sequence"].clone();
                message["usage"]["output_tokens"] = data["usage"]["output_tokens"].clone();
                if let Some(server) = data["usage"].get("server_tool_use") {
                    message["usage"]["server_tool_use"] = server.clone();
                }
            }
            _ => {}
        }
    }
    message
}

pub(super) fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(event, _)| event.as_str()).collect()
}

#[tokio::test]
async fn a_plain_message_has_anthropic_s_shape() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = ask("hello there");
    body["system"] = json!([{"type": "text", "text": "be brief"}]);
    body["metadata"] = json!({"user_id": "u1"});
    body["temperature"] = json!(0.5);
    let response = message(&client, &server, &body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    assert_eq!(response.headers()["request-id"], "req_mock_1");
    let answer: Value = response.json().await.unwrap();
    let keys: Vec<&str> = answer
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        keys,
        [
            "id",
            "type",
            "role",
            "model",
            "content",
            "stop_reason",
            "stop_sequence",
            "usage"
        ]
    );
    assert_eq!(answer["id"], "msg_mock_1");
    assert_eq!(answer["type"], "message");
    assert_eq!(answer["role"], "assistant");
    assert_eq!(answer["model"], "claude-test");
    assert_eq!(
        answer["content"],
        json!([{"type": "text", "text": "mock answer #1 to: hello there"}])
    );
    assert_eq!(answer["stop_reason"], "end_turn");
    assert_eq!(answer["stop_sequence"], Value::Null);
    // "be brief" + "hello there": 19 characters, 4 tokens; the answer's
    // 30 characters, 7 tokens.
    assert_eq!(
        answer["usage"],
        json!({"input_tokens": 4, "output_tokens": 7,
               "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0})
    );

    // Block content: the last user message's text blocks and tool results
    // are echoed, an image and an earlier message are not.
    let body = json!({"model": "m", "max_tokens": 100, "messages": [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "let me look"},
            {"type": "tool_use", "id": "toolu_1", "name": "look", "input": {"at": "x"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "found"}]},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "text", "text": "and now?"},
        ]},
    ]});
    let answer = answered(&client, &server, &body).await;
    assert_eq!(text(&answer), "mock answer #2 to: found and now?");
    assert_eq!(server.calls()[1].prompt, "found and now?");
    server.shutdown().await;
}

#[tokio::test]
async fn count_tokens_counts_as_the_answer_does() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = ask("how many tokens is this question?");
    body["system"] = json!("a system prompt");
    body["tools"] = json!([weather()]);
    let answer = answered(&client, &server, &body).await;
    let mut counted = body.clone();
    counted.as_object_mut().unwrap().remove("max_tokens");
    let response = send(&client, &server, "messages/count_tokens", &counted).await;
    assert_eq!(response.status(), 200);
    assert!(response.headers().contains_key("request-id"));
    let count: Value = response.json().await.unwrap();
    assert_eq!(
        count,
        json!({"input_tokens": answer["usage"]["input_tokens"]})
    );
    assert!(count["input_tokens"].as_u64().unwrap() > 50, "{count}");

    // Its own validation: max_tokens is no field of it; messages are required.
    let response = send(&client, &server, "messages/count_tokens", &body).await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(
        error["error"]["message"],
        "max_tokens: Extra inputs are not permitted"
    );
    let response = send(
        &client,
        &server,
        "messages/count_tokens",
        &json!({"model": "m"}),
    )
    .await;
    assert_eq!(response.status(), 400);

    let calls = server.calls();
    let endpoints: Vec<Endpoint> = calls.iter().map(|c| c.endpoint).collect();
    assert_eq!(
        endpoints,
        [
            Endpoint::Messages,
            Endpoint::CountTokens,
            Endpoint::CountTokens,
            Endpoint::CountTokens
        ]
    );
    assert_eq!(calls[1].prompt, "how many tokens is this question?");
    assert_eq!(server.stats().failed, 2);
    server.shutdown().await;
}

#[tokio::test]
async fn a_stream_is_anthropic_s_event_sequence_and_reassembles_to_the_message() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let body = ask("tell me a story about a mock");
    let plain = answered(&client, &server, &body).await;
    let events = streamed(&client, &server, &body).await;
    let names = names(&events);
    let deltas = names
        .iter()
        .filter(|n| **n == "content_block_delta")
        .count();
    assert!(deltas > 3, "{names:?}");
    let mut expected = vec!["message_start", "content_block_start", "ping"];
    expected.extend(std::iter::repeat_n("content_block_delta", deltas));
    expected.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, expected);

    let start = &events[0].1["message"];
    assert_eq!(start["id"], "msg_mock_2");
    assert_eq!(start["content"], json!([]));
    assert_eq!(start["stop_reason"], Value::Null);
    assert_eq!(start["usage"]["output_tokens"], 1);
    assert_eq!(
        start["usage"]["input_tokens"],
        plain["usage"]["input_tokens"]
    );
    assert_eq!(
        events[1].1["content_block"],
        json!({"type": "text", "text": ""})
    );
    assert!(
        events[3..3 + deltas]
            .iter()
            .all(|(_, d)| d["index"] == 0 && d["delta"]["type"] == "text_delta")
    );

    let mut assembled = assemble(&events);
    assert_eq!(
        text(&assembled),
        "mock answer #2 to: tell me a story about a mock"
    );
    // Apart from the call number, the stream builds the plain message.
    assembled["id"] = plain["id"].clone();
    assembled["content"][0]["text"] = plain["content"][0]["text"].clone();
    assert_eq!(assembled, plain);
    server.shutdown().await;
}

#[tokio::test]
async fn a_stream_is_sent_event_by_event() {
    let server = start(Behaviour {
        chunk_delay_ms: 60_000,
        ..Behaviour::default()
    })
    .await;
    let mut body = ask("slowly");
    body["stream"] = json!(true);
    let response = message(&client(), &server, &body).await;
    let mut frames = response.bytes_stream();
    let first = tokio::time::timeout(SAFETY, frames.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let first = std::str::from_utf8(&first).unwrap();
    assert!(first.starts_with("event: message_start\n"), "{first}");
    assert_eq!(server.stats().in_flight, 1);
    tokio::time::timeout(SAFETY, server.shutdown())
        .await
        .unwrap();
}

#[tokio::test]
async fn a_forced_tool_is_the_only_block_its_input_built_from_the_schema() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = ask("weather in Paris");
    body["tools"] = json!([clock(), weather()]);
    body["tool_choice"] = json!({"type": "tool", "name": "get_weather"});
    let answer = answered(&client, &server, &body).await;
    assert_eq!(
        answer["content"],
        json!([{"type": "tool_use", "id": "toolu_mock_1", "name": "get_weather", "input": {
            "city": "weather in Paris", "unit": "celsius", "days": 1, "alerts": true,
            "hours": [], "where": {}, "mode": "fast",
        }}])
    );
    assert_eq!(answer["stop_reason"], "tool_use");
    assert_eq!(answer["stop_sequence"], Value::Null);
    let input_chars = answer["content"][0]["input"].to_string().chars().count() as u64;
    assert_eq!(answer["usage"]["output_tokens"], input_chars / 4);

    // `any`: the first tool, whose schema requires nothing: {"q": <text>}.
    body["tool_choice"] = json!({"type": "any"});
    let answer = answered(&client, &server, &body).await;
    assert_eq!(answer["content"][0]["name"], "get_time");
    assert_eq!(
        answer["content"][0]["input"],
        json!({"q": "weather in Paris"})
    );
    assert_eq!(answer["stop_reason"], "tool_use");

    // `auto` (or none given) without the marker, and `none`: no tool.
    body["tool_choice"] = json!({"type": "auto"});
    let answer = answered(&client, &server, &body).await;
    assert_eq!(answer["stop_reason"], "end_turn");
    body["messages"][0]["content"] = json!("please CALL TOOL get_weather");
    body["tool_choice"] = json!({"type": "none"});
    let answer = answered(&client, &server, &body).await;
    assert_eq!(answer["stop_reason"], "end_turn");
    assert_eq!(answer["content"].as_array().unwrap().len(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn the_marker_adds_a_tool_call_after_the_text_streamed_in_json_pieces() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = ask("now call tool get_weather, for Oslo");
    body["tools"] = json!([clock(), weather()]);
    let plain = answered(&client, &server, &body).await;
    let blocks = plain["content"].as_array().unwrap();
    assert_eq!(blocks.len(), 2);
    assert_eq!(
        text(&plain),
        "mock answer #1 to: now call tool get_weather, for Oslo"
    );
    assert_eq!(blocks[1]["name"], "get_weather");
    assert_eq!(
        blocks[1]["input"]["city"],
        "now call tool get_weather, for Oslo"
    );
    assert_eq!(plain["stop_reason"], "tool_use");

    let events = streamed(&client, &server, &body).await;
    let tool_start = events
        .iter()
        .find(|(e, d)| e == "content_block_start" && d["index"] == 1)
        .unwrap();
    assert_eq!(
        tool_start.1["content_block"],
        json!({"type": "tool_use", "id": "toolu_mock_2", "name": "get_weather", "input": {}})
    );
    let pieces: Vec<&str> = events
        .iter()
        .filter(|(_, d)| d["delta"]["type"] == "input_json_delta")
        .map(|(_, d)| d["delta"]["partial_json"].as_str().unwrap())
        .collect();
    assert!(pieces.len() > 1, "{pieces:?}");
    assert!(
        pieces
            .iter()
            .all(|p| serde_json::from_str::<Value>(p).is_err())
    );
    let input: Value = serde_json::from_str(&pieces.concat()).unwrap();
    assert_eq!(input, blocks[1]["input"]);
    let mut assembled = assemble(&events);
    assert_eq!(
        names(&events)
            .iter()
            .filter(|n| **n == "content_block_stop")
            .count(),
        2
    );
    assembled["id"] = plain["id"].clone();
    assembled["content"][0]["text"] = plain["content"][0]["text"].clone();
    assembled["content"][1]["id"] = plain["content"][1]["id"].clone();
    assert_eq!(assembled, plain);

    // The word after the marker names the tool; an unknown word, the first.
    body["messages"][0]["content"] = json!("call tool nobody");
    let answer = answered(&client, &server, &body).await;
    assert_eq!(answer["content"][1]["name"], "get_time");
    server.shutdown().await;
}

#[tokio::test]
async fn max_tokens_and_stop_sequences_cut_the_text() {
    let server = start(Behaviour {
        content: Some("alpha beta. gamma delta END more".into()),
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let mut body = ask("q");
    body["max_tokens"] = json!(3);
    let answer = answered(&client, &server, &body).await;
    assert_eq!(text(&answer), "alpha beta. ");
    assert_eq!(answer["stop_reason"], "max_tokens");
    assert_eq!(answer["stop_sequence"], Value::Null);
    assert_eq!(answer["usage"]["output_tokens"], 3);

    // The earliest stop sequence, whatever its place in the list.
    body["max_tokens"] = json!(100);
    body["stop_sequences"] = json!(["END", ". "]);
    let answer = answered(&client, &server, &body).await;
    assert_eq!(text(&answer), "alpha beta");
    assert_eq!(answer["stop_reason"], "stop_sequence");
    assert_eq!(answer["stop_sequence"], ". ");
    let events = streamed(&client, &server, &body).await;
    let assembled = assemble(&events);
    assert_eq!(text(&assembled), "alpha beta");
    assert_eq!(
        events[events.len() - 2].1["delta"],
        json!({"stop_reason": "stop_sequence", "stop_sequence": ". "})
    );

    // A stop sequence past max_tokens: max_tokens comes first.
    body["max_tokens"] = json!(2);
    body["stop_sequences"] = json!(["END"]);
    let answer = answered(&client, &server, &body).await;
    assert_eq!(text(&answer), "alpha be");
    assert_eq!(answer["stop_reason"], "max_tokens");

    // A stop sequence absent from the text: end_turn.
    body["max_tokens"] = json!(100);
    body["stop_sequences"] = json!(["nowhere"]);
    let answer = answered(&client, &server, &body).await;
    assert_eq!(answer["stop_reason"], "end_turn");
    assert_eq!(text(&answer), "alpha beta. gamma delta END more");
    server.shutdown().await;
}

#[tokio::test]
async fn invalid_requests_are_anthropic_s_400s() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let with = |change: &dyn Fn(&mut Value)| {
        let mut body = ask("x");
        change(&mut body);
        body
    };
    let cases = [
        (
            with(&|b| {
                b.as_object_mut().unwrap().remove("max_tokens");
            }),
            "max_tokens: Field required",
        ),
        (with(&|b| b["max_tokens"] = json!(0)), "max_tokens"),
        (with(&|b| b["max_tokens"] = json!("10")), "max_tokens"),
        (
            with(&|b| {
                b.as_object_mut().unwrap().remove("model");
            }),
            "model: Field required",
        ),
        (
            with(&|b| {
                b.as_object_mut().unwrap().remove("messages");
            }),
            "messages: Field required",
        ),
        (with(&|b| b["messages"] = json!([])), "messages"),
        (with(&|b| b["messages"] = json!("hi")), "messages"),
        (
            with(&|b| b["messages"] = json!([{"role": "assistant", "content": "me first"}])),
            "first message",
        ),
        (
            with(&|b| {
                b["messages"] =
                    json!([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
            }),
            "first message",
        ),
        (
            with(&|b| b["messages"][0]["role"] = json!("tool")),
            "messages.0.role",
        ),
        (
            with(&|b| b["messages"][0]["content"] = json!(7)),
            "messages.0.content",
        ),
        (
            with(&|b| {
                b["messages"][0]["content"] = json!([{"type": "image_url", "image_url": {}}])
            }),
            "messages.0.content.0",
        ),
        (
            with(&|b| b["messages"][0]["content"] = json!([{"type": "text"}])),
            "messages.0.content.0.text",
        ),
        (
            with(&|b| b["messages"][0]["name"] = json!("bob")),
            "messages.0.name",
        ),
        (
            with(&|b| b["n"] = json!(2)),
            "n: Extra inputs are not permitted",
        ),
        (
            with(&|b| b["user"] = json!("u")),
            "user: Extra inputs are not permitted",
        ),
        (
            with(&|b| b["system"] = json!([{"type": "image"}])),
            "system",
        ),
        (
            with(&|b| b["stop_sequences"] = json!("END")),
            "stop_sequences",
        ),
        (with(&|b| b["temperature"] = json!(1.5)), "temperature"),
        (with(&|b| b["stream"] = json!("yes")), "stream"),
        (
            with(&|b| b["tools"] = json!([{"name": "t"}])),
            "tools.0.input_schema",
        ),
        (
            with(&|b| b["tool_choice"] = json!({"type": "any"})),
            "tool_choice",
        ),
        (
            with(&|b| {
                b["tools"] = json!([clock()]);
                b["tool_choice"] = json!({"type": "tool", "name": "other"});
            }),
            "tool_choice.name",
        ),
        (
            with(&|b| {
                b["tools"] = json!([clock()]);
                b["tool_choice"] = json!({"type": "sometimes"});
            }),
            "tool_choice.type",
        ),
    ];
    for (body, says) in &cases {
        let response = message(&client, &server, body).await;
        assert_eq!(response.status(), 400, "{body}");
        assert!(response.headers().contains_key("request-id"));
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["type"], "error", "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    let response = client
        .post(format!("http://{}/v1/messages", server.addr()))
        .header("x-api-key", KEY)
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let stats = server.stats();
    let refused = cases.len() as u64 + 1;
    assert_eq!(
        (stats.calls, stats.failed, stats.completed),
        (refused, refused, 0)
    );
    assert!(server.calls().iter().all(|c| c.status == Some(400)));
    server.shutdown().await;
}

#[tokio::test]
async fn a_call_without_a_key_is_a_401_and_the_key_and_version_are_recorded() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let url = format!("http://{}/v1/messages", server.addr());
    let response = client
        .post(&url)
        .json(&ask("anonymous"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    assert_eq!(response.headers()["request-id"], "req_mock_1");
    let error: Value = response.json().await.unwrap();
    assert_eq!(
        error,
        json!({"type": "error", "error": {"type": "authentication_error",
               "message": "x-api-key header is required"}, "request_id": "req_mock_1"})
    );
    let response = client
        .post(&url)
        .header("x-api-key", "")
        .json(&ask("empty key"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);
    // A bearer token stands in for the key; so does any non-empty key.
    let response = client
        .post(&url)
        .bearer_auth("oauth-token")
        .json(&ask("bearer"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(message(&client, &server, &ask("keyed")).await.status(), 200);
    // count_tokens asks for a key too.
    let response = client
        .post(format!("{url}/count_tokens"))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 401);

    let stats = server.stats();
    let last = &stats.last_requests;
    assert_eq!(
        (
            last[0].x_api_key.as_deref(),
            last[0].authorization.as_deref()
        ),
        (None, None)
    );
    assert_eq!(last[2].authorization.as_deref(), Some("Bearer oauth-token"));
    assert_eq!(last[3].x_api_key.as_deref(), Some(KEY));
    assert_eq!(last[3].anthropic_version.as_deref(), Some("2023-06-01"));
    assert_eq!(last[3].endpoint, Endpoint::Messages);
    assert_eq!(last[3].body, ask("keyed"));
    assert_eq!((stats.failed, stats.completed), (3, 2));
    server.shutdown().await;
}

#[tokio::test]
async fn failures_take_anthropic_s_error_types() {
    let server = start(Behaviour::default()).await;
    let client = client();
    for (status, kind) in [
        (529, "overloaded_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "api_error"),
        (504, "timeout_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (400, "invalid_request_error"),
        (409, "invalid_request_error"),
    ] {
        server.set_behaviour(Behaviour {
            fail_status: Some(status),
            retry_after: (status == 429).then_some(9),
            ..Behaviour::default()
        });
        for stream in [false, true] {
            let mut body = ask("fail");
            body["stream"] = json!(stream);
            let response = message(&client, &server, &body).await;
            assert_eq!(response.status(), status);
            assert_eq!(response.headers()["content-type"], "application/json");
            assert!(response.headers().contains_key("request-id"));
            assert_eq!(
                response
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned()),
                (status == 429).then(|| "9".to_owned())
            );
            let error: Value = response.json().await.unwrap();
            assert_eq!(error["type"], "error");
            assert_eq!(error["error"]["type"], kind, "{status}");
            assert_eq!(error["error"]["message"], "mock failure");
        }
    }
    // count_tokens fails the same way.
    server.set_behaviour(Behaviour {
        fail_status: Some(529),
        ..Behaviour::default()
    });
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
    let response = send(&client, &server, "messages/count_tokens", &body).await;
    assert_eq!(response.status(), 529);
    let calls = server.calls();
    assert!(calls.iter().all(|c| c.outcome == CallOutcome::Failed));
    assert_eq!(calls.last().unwrap().status, Some(529));
    server.shutdown().await;
}

#[tokio::test]
async fn a_held_message_is_released_with_a_content_or_a_status() {
    let server = start(Behaviour {
        hold: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let spawn = |body: Value| {
        let client = client.clone();
        let url = format!("http://{}/v1/messages", server.addr());
        tokio::spawn(async move {
            client
                .post(url)
                .header("x-api-key", KEY)
                .json(&body)
                .send()
                .await
                .unwrap()
        })
    };
    let first = spawn(ask("first"));
    assert_eq!(held(&client, &server, 1).await, vec![1]);
    let mut streamed = ask("second");
    streamed["stream"] = json!(true);
    let second = spawn(streamed);
    assert_eq!(held(&client, &server, 2).await, vec![1, 2]);
    let third = spawn(ask("third"));
    assert_eq!(held(&client, &server, 3).await, vec![1, 2, 3]);
    let stats = server.stats();
    assert_eq!((stats.calls, stats.held, stats.in_flight), (3, 3, 3));

    control(
        &client,
        &server,
        "release",
        json!({"seq": 3, "status": 529}),
    )
    .await;
    let response = third.await.unwrap();
    assert_eq!(response.status(), 529);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "overloaded_error");

    control(
        &client,
        &server,
        "release",
        json!({"seq": 2, "content": "chosen words"}),
    )
    .await;
    let events = frames(&second.await.unwrap().text().await.unwrap());
    assert_eq!(text(&assemble(&events)), "chosen words");

    control(&client, &server, "release", json!({})).await;
    let answer: Value = first.await.unwrap().json().await.unwrap();
    assert_eq!(text(&answer), "mock answer #1 to: first");

    let calls = server.calls();
    let summary: Vec<_> = calls
        .iter()
        .map(|c| {
            (
                c.seq,
                c.endpoint,
                c.prompt.as_str(),
                c.stream,
                c.outcome,
                c.status,
            )
        })
        .collect();
    assert_eq!(
        summary,
        [
            (
                1,
                Endpoint::Messages,
                "first",
                false,
                CallOutcome::Completed,
                Some(200)
            ),
            (
                2,
                Endpoint::Messages,
                "second",
                true,
                CallOutcome::Completed,
                Some(200)
            ),
            (
                3,
                Endpoint::Messages,
                "third",
                false,
                CallOutcome::Failed,
                Some(529)
            ),
        ]
    );
    assert_eq!(calls[0].model.as_deref(), Some("claude-test"));
    server.shutdown().await;
}

#[tokio::test]
async fn hang_and_reset_apply_to_messages() {
    let server = start(Behaviour {
        hang: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let request = tokio::spawn({
        let client = client.clone();
        let url = format!("http://{}/v1/messages", server.addr());
        async move {
            client
                .post(url)
                .header("x-api-key", KEY)
                .json(&ask("hung"))
                .send()
                .await
                .unwrap()
        }
    });
    assert_eq!(held(&client, &server, 1).await, vec![1]);
    control(&client, &server, "reset", json!({})).await;
    assert_eq!(request.await.unwrap().status(), 200);

    server.set_behaviour(Behaviour {
        reset_rate: 1.0,
        ..Behaviour::default()
    });
    let err = client
        .post(format!("http://{}/v1/messages", server.addr()))
        .header("x-api-key", KEY)
        .json(&ask("drop me"))
        .send()
        .await
        .unwrap_err();
    assert!(err.status().is_none() && err.is_request(), "{err:?}");
    assert_eq!(server.stats().resets, 1);
    server.shutdown().await;
}

#[tokio::test]
async fn pad_bytes_pads_the_text_plain_and_streamed() {
    let server = start(Behaviour {
        pad_bytes: Some(5000),
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let body = ask("pad me");
    let response = message(&client, &server, &body).await;
    let plain = response.text().await.unwrap();
    assert!((5000..5100).contains(&plain.len()), "{}", plain.len());
    let answer: Value = serde_json::from_str(&plain).unwrap();
    assert!(text(&answer).starts_with("mock answer #1 to: pad me "));
    assert_eq!(answer["stop_reason"], "end_turn");

    let mut body = body;
    body["stream"] = json!(true);
    let stream = message(&client, &server, &body).await.text().await.unwrap();
    assert!((5000..5100).contains(&stream.len()), "{}", stream.len());
    assert!(text(&assemble(&frames(&stream))).starts_with("mock answer #2 to: pad me "));
    let calls = server.calls();
    assert!(calls.iter().all(|c| c.outcome == CallOutcome::Padded));
    server.shutdown().await;
}

/// One answer of a mock set to `kind` of garbage: content type and body.
async fn garbled(kind: Garbage, stream: bool) -> (String, String) {
    let server = start(Behaviour {
        garbage: Some(kind),
        ..Behaviour::default()
    })
    .await;
    let mut body = ask("garbage please");
    body["stream"] = json!(stream);
    let response = message(&client(), &server, &body).await;
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

fn event_names(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter_map(|frame| frame.strip_prefix("event: "))
        .map(|frame| frame.split('\n').next().unwrap())
        .collect()
}

#[tokio::test]
async fn each_kind_of_garbage_has_an_anthropic_form() {
    let json_of = |text: &str| serde_json::from_str::<Value>(text);

    let (kind, body) = garbled(Garbage::NotJson, false).await;
    assert!(
        kind.starts_with("text/html") && json_of(&body).is_err(),
        "{body}"
    );
    let (kind, body) = garbled(Garbage::NotJson, true).await;
    assert_eq!(kind, "text/event-stream");
    assert!(body.starts_with("event: message_start\n"), "{body}");
    assert!(body.contains("data: <html>"), "{body}");

    let (_, body) = garbled(Garbage::Truncated, false).await;
    assert!(body.starts_with('{') && json_of(&body).is_err(), "{body}");
    let (_, body) = garbled(Garbage::Truncated, true).await;
    assert!(body.starts_with("event: message_start\n"), "{body}");
    assert!(
        !body.contains("message_stop") && !body.ends_with("\n\n"),
        "{body}"
    );

    for stream in [false, true] {
        assert_eq!(garbled(Garbage::Empty, stream).await.1, "");
    }

    for kind in [Garbage::ErrorObject, Garbage::StreamError] {
        let (content_type, body) = garbled(kind, false).await;
        assert_eq!(content_type, "application/json");
        let error = json_of(&body).unwrap();
        assert_eq!(
            (&error["type"], &error["error"]["type"]),
            (&json!("error"), &json!("api_error"))
        );
    }
    let (_, body) = garbled(Garbage::ErrorObject, true).await;
    assert_eq!(event_names(&body), ["error"]);

    // A stream error as Anthropic sends one: some events, then `error`.
    let (_, body) = garbled(Garbage::StreamError, true).await;
    assert_eq!(
        event_names(&body),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "error"
        ]
    );
    let (_, error) = frames(&body).pop().unwrap();
    assert_eq!(error["error"]["type"], "overloaded_error");

    let (_, body) = garbled(Garbage::EmptyChoices, false).await;
    let message = json_of(&body).unwrap();
    assert_eq!(
        (&message["type"], &message["content"]),
        (&json!("message"), &json!([]))
    );
    let (_, body) = garbled(Garbage::EmptyChoices, true).await;
    assert_eq!(
        event_names(&body),
        ["message_start", "ping", "message_delta", "message_stop"]
    );

    // The stream endings stream whatever was asked.
    for stream in [false, true] {
        let (kind, body) = garbled(Garbage::StreamWithoutDone, stream).await;
        assert_eq!(kind, "text/event-stream");
        let names = event_names(&body);
        assert_eq!(names.last(), Some(&"content_block_delta"), "{names:?}");
        assert!(!names.contains(&"content_block_stop") && !names.contains(&"message_delta"));

        let (_, body) = garbled(Garbage::FinishedWithoutDone, stream).await;
        let names = event_names(&body);
        assert_eq!(names.last(), Some(&"message_delta"), "{names:?}");
        assert!(!names.contains(&"message_stop"));

        let (_, body) = garbled(Garbage::DoneWithoutFinish, stream).await;
        let names = event_names(&body);
        assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
        assert!(!names.contains(&"message_delta"));
    }
}

#[test]
fn a_reply_is_a_pure_function_of_the_request_and_the_call_number() {
    use super::anthropic::{Reply, input_tokens};
    let mut request = ask("same");
    request["tools"] = json!([weather()]);
    request["tool_choice"] = json!({"type": "any"});
    assert_eq!(Reply::new(&request, 4, None), Reply::new(&request, 4, None));
    assert_ne!(Reply::new(&request, 4, None), Reply::new(&request, 5, None));
    let message = Reply::new(&request, 4, None).message();
    assert_eq!(message["usage"]["input_tokens"], input_tokens(&request));
    // An empty request still gets an answer (the handler validates first).
    let empty = Reply::new(&json!({}), 1, None).message();
    assert_eq!(empty["model"], "mock");
    assert_eq!(text(&empty), "mock answer #1 to: ");
    assert_eq!(input_tokens(&json!({})), 1);
}
