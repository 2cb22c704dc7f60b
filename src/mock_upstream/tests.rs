use std::time::Duration;

use futures_util::StreamExt;
use serde_json::{Value, json};

use super::*;

/// Safety net only: no test waits for it unless something is broken.
pub(super) const SAFETY: Duration = Duration::from_secs(5);

pub(super) async fn start(behaviour: Behaviour) -> MockServer {
    MockServer::start("127.0.0.1:0".parse().unwrap(), behaviour)
        .await
        .unwrap()
}

pub(super) fn client() -> reqwest::Client {
    reqwest::Client::builder().no_proxy().build().unwrap()
}

pub(super) fn chat(text: &str) -> Value {
    json!({"model": "gpt-test", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": text},
    ]})
}

pub(super) async fn post(
    client: &reqwest::Client,
    server: &MockServer,
    body: &Value,
) -> reqwest::Response {
    client
        .post(format!("{}/chat/completions", server.base_url()))
        .json(body)
        .send()
        .await
        .unwrap()
}

pub(super) async fn control(
    client: &reqwest::Client,
    server: &MockServer,
    path: &str,
    body: Value,
) -> Value {
    let response = client
        .post(format!("http://{}/_mock/{path}", server.addr()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(
        response.status().is_success(),
        "{path}: {}",
        response.status()
    );
    response.json().await.unwrap()
}

/// Waits (long-poll, no sleeping) until at least `n` requests are held.
pub(super) async fn held(client: &reqwest::Client, server: &MockServer, n: usize) -> Vec<u64> {
    let response = client
        .get(format!(
            "http://{}/_mock/held?at_least={n}&timeout_ms={}",
            server.addr(),
            SAFETY.as_millis()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.status(),
        200,
        "fewer than {n} requests held in time"
    );
    let body: Value = response.json().await.unwrap();
    serde_json::from_value(body["held"].clone()).unwrap()
}

pub(super) fn content(answer: &Value) -> &str {
    answer["choices"][0]["message"]["content"].as_str().unwrap()
}

/// The `data:` payloads of an SSE body.
pub(super) fn events(text: &str) -> Vec<&str> {
    text.split("\n\n")
        .filter(|event| !event.is_empty())
        .map(|event| event.strip_prefix("data: ").unwrap())
        .collect()
}

#[tokio::test]
async fn plain_answer_has_the_openai_shape() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let response = post(&client, &server, &chat("hello there")).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["id"], "chatcmpl-mock-1");
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["model"], "gpt-test");
    assert_eq!(answer["system_fingerprint"], "fp_mock");
    assert!(answer["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(content(&answer), "mock answer #1 to: hello there");
    assert_eq!(answer["choices"][0]["message"]["role"], "assistant");
    assert_eq!(answer["choices"][0]["finish_reason"], "stop");
    let usage = &answer["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() >= 1);
    assert!(usage["completion_tokens"].as_u64().unwrap() >= 1);
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(
            usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
        )
    );

    // Without the /v1 prefix, and with n = 3.
    let mut body = chat("again");
    body["n"] = json!(3);
    let response = client
        .post(format!("http://{}/chat/completions", server.addr()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let answer: Value = response.json().await.unwrap();
    let choices = answer["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    assert_eq!(choices[2]["index"], 2);
    assert_eq!(choices[2]["message"]["content"], "mock answer #2 to: again");

    let models: Value = client
        .get(format!("{}/models", server.base_url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    assert!(!models["data"].as_array().unwrap().is_empty());
    server.shutdown().await;
}

#[tokio::test]
async fn the_responses_api_answers_plain_streamed_and_with_a_function_call() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let url = format!("{}/responses", server.base_url());
    let request = json!({"model": "gpt-test", "input": "hello there", "instructions": "Be brief."});
    let r: Value = client
        .post(&url)
        .json(&request)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["object"], "response");
    assert_eq!(r["id"], "resp_mock1");
    assert_eq!(r["status"], "completed");
    assert_eq!(r["instructions"], "Be brief.");
    assert_eq!(
        r["output"][0]["content"][0]["text"],
        "mock answer #1 to: hello there"
    );
    assert!(r["usage"]["input_tokens"].as_u64().unwrap() > 0, "{r}");

    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    let text = client
        .post(&url)
        .json(&streamed)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(events[0]["type"], "response.created");
    assert_eq!(events.last().unwrap()["type"], "response.completed");
    let deltas: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, "mock answer #2 to: hello there");

    let tools = json!({"model": "gpt-test", "input": "where is 1234",
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object",
            "properties": {"order": {"type": "string"}}, "required": ["order"]}}],
        "tool_choice": "required"});
    let r: Value = client
        .post(&url)
        .json(&tools)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let call = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap();
    assert_eq!(call["name"], "lookup");
    assert_eq!(call["call_id"], "call_mock_3");
    // What OpenAI refuses, the mock refuses: a tool of no known type.
    let refused = json!({"model": "gpt-test", "input": "hi", "tools": [{"type": "teleport"}]});
    let response = client.post(&url).json(&refused).send().await.unwrap();
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["param"], "tools[0].type");
    assert_eq!(error["error"]["code"], "invalid_value");
    let stats = server.stats();
    assert_eq!(stats.calls, 4);
    assert_eq!(
        stats.last_requests.last().unwrap().endpoint,
        Endpoint::Responses
    );
    server.shutdown().await;
}

#[tokio::test]
async fn stream_deltas_concatenate_to_the_plain_content() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = chat("tell me a story about a mock");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let response = post(&client, &server, &body).await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let text = response.text().await.unwrap();
    let events = events(&text);
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|event| serde_json::from_str(event).unwrap())
        .collect();
    assert!(chunks.len() > 4, "only {} chunks", chunks.len());
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for chunk in &chunks {
        assert_eq!(chunk["id"], "chatcmpl-mock-1");
        assert_eq!(chunk["object"], "chat.completion.chunk");
        assert_eq!(chunk["model"], "gpt-test");
        assert_eq!(chunk["created"], chunks[0]["created"]);
    }
    let streamed: String = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, content(&completion(&body, 1, None)));
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert!(usage["usage"]["total_tokens"].as_u64().unwrap() >= 2);
    server.shutdown().await;
}

#[tokio::test]
async fn stream_is_sent_chunk_by_chunk() {
    // A chunk delay far longer than the safety net: if the answer were
    // buffered, the first chunk could not arrive in time.
    let server = start(Behaviour {
        chunk_delay_ms: 60_000,
        ..Behaviour::default()
    })
    .await;
    let mut body = chat("slowly");
    body["stream"] = json!(true);
    let response = post(&client(), &server, &body).await;
    let mut frames = response.bytes_stream();
    let first = tokio::time::timeout(SAFETY, frames.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let first = std::str::from_utf8(&first).unwrap();
    assert!(first.starts_with("data: "), "{first}");
    assert!(first.contains("\"role\":\"assistant\""), "{first}");
    assert_eq!(
        server.stats().in_flight,
        1,
        "a stream is in flight until its end"
    );
    // Shutdown cuts the remaining delays short.
    tokio::time::timeout(SAFETY, server.shutdown())
        .await
        .unwrap();
}

#[tokio::test]
async fn calls_are_counted_on_arrival_including_held_and_failed() {
    let server = start(Behaviour {
        hold: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let request = tokio::spawn({
        let client = client.clone();
        let url = format!("{}/chat/completions", server.base_url());
        async move { client.post(url).json(&chat("wait")).send().await.unwrap() }
    });
    assert_eq!(held(&client, &server, 1).await, vec![1]);
    let stats = server.stats();
    assert_eq!((stats.calls, stats.held, stats.completed), (1, 1, 0));
    assert_eq!(stats.in_flight, 1);

    control(&client, &server, "release", json!({})).await;
    assert_eq!(request.await.unwrap().status(), 200);
    let stats = server.stats();
    assert_eq!((stats.calls, stats.held, stats.completed), (1, 0, 1));

    server.set_behaviour(Behaviour {
        fail_status: Some(500),
        ..Behaviour::default()
    });
    assert_eq!(post(&client, &server, &chat("fail")).await.status(), 500);
    let stats = server.stats();
    assert_eq!((stats.calls, stats.completed, stats.failed), (2, 1, 1));
    server.shutdown().await;
}

#[tokio::test]
async fn fail_status_sends_an_openai_error_and_retry_after() {
    let server = start(Behaviour {
        fail_status: Some(429),
        retry_after: Some(7),
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let response = post(&client, &server, &chat("too many")).await;
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "7");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "rate_limit_error");
    assert_eq!(body["error"]["message"], "mock failure");
    assert_eq!(body["error"]["param"], Value::Null);

    server.set_behaviour(Behaviour {
        fail_status: Some(503),
        ..Behaviour::default()
    });
    let response = post(&client, &server, &chat("down")).await;
    assert_eq!(response.status(), 503);
    assert!(response.headers().get("retry-after").is_none());
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "server_error");
    assert_eq!(server.stats().failed, 2);
    server.shutdown().await;
}

#[tokio::test]
async fn release_by_seq_lets_a_test_choose_the_order() {
    let server = start(Behaviour {
        hold: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let (done, mut finished) = tokio::sync::mpsc::unbounded_channel();
    let send = |text: &'static str| {
        let client = client.clone();
        let done = done.clone();
        let url = format!("{}/chat/completions", server.base_url());
        tokio::spawn(async move {
            let answer: Value = client
                .post(url)
                .json(&chat(text))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            done.send(content(&answer).to_owned()).unwrap();
        })
    };
    let first = send("first");
    assert_eq!(held(&client, &server, 1).await, vec![1]);
    let second = send("second");
    assert_eq!(held(&client, &server, 2).await, vec![1, 2]);

    let released = control(&client, &server, "release", json!({"seq": 2})).await;
    assert_eq!(released["released"], json!([2]));
    second.await.unwrap();
    let answer = finished.recv().await.unwrap();
    assert_eq!(answer, "mock answer #2 to: second");
    assert_eq!(server.stats().held, 1);
    assert!(!first.is_finished());

    let released = control(
        &client,
        &server,
        "release",
        json!({"seq": 1, "content": "chosen"}),
    )
    .await;
    assert_eq!(released["released"], json!([1]));
    first.await.unwrap();
    assert_eq!(finished.recv().await.unwrap(), "chosen");

    // Releasing what is not held releases nothing.
    let released = control(&client, &server, "release", json!({"seq": 1})).await;
    assert_eq!(released["released"], json!([]));
    server.shutdown().await;
}

#[tokio::test]
async fn release_can_choose_an_error_status() {
    let server = start(Behaviour {
        hold: true,
        retry_after: Some(2),
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let request = tokio::spawn({
        let client = client.clone();
        let url = format!("{}/chat/completions", server.base_url());
        async move { client.post(url).json(&chat("x")).send().await.unwrap() }
    });
    held(&client, &server, 1).await;
    control(&client, &server, "release", json!({"status": 502})).await;
    let response = request.await.unwrap();
    assert_eq!(response.status(), 502);
    assert_eq!(response.headers()["retry-after"], "2");
    assert_eq!(server.stats().failed, 1);
    server.shutdown().await;
}

#[tokio::test]
async fn reset_releases_hung_requests_and_zeroes_counters() {
    let server = start(Behaviour::default()).await;
    let client = client();
    post(&client, &server, &chat("before")).await;
    server.set_behaviour(Behaviour {
        hang: true,
        ..Behaviour::default()
    });
    let request = tokio::spawn({
        let client = client.clone();
        let url = format!("{}/chat/completions", server.base_url());
        async move { client.post(url).json(&chat("hung")).send().await.unwrap() }
    });
    assert_eq!(held(&client, &server, 1).await, vec![2]);

    let stats: Stats =
        serde_json::from_value(control(&client, &server, "reset", json!({})).await).unwrap();
    assert_eq!((stats.calls, stats.completed, stats.held), (0, 0, 0));
    assert!(stats.last_requests.is_empty());
    let response = request.await.unwrap();
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(content(&answer), "mock answer #2 to: hung");

    // The start behaviour is back (no hang), numbering starts again from 1,
    // and the request released by the reset was not counted after it.
    let answer: Value = post(&client, &server, &chat("after"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(content(&answer), "mock answer #1 to: after");
    let stats = server.stats();
    assert_eq!((stats.calls, stats.completed), (1, 1));
    server.shutdown().await;
}

#[tokio::test]
async fn reset_rate_drops_the_connection() {
    let server = start(Behaviour {
        reset_rate: 1.0,
        ..Behaviour::default()
    })
    .await;
    let result = client()
        .post(format!("{}/chat/completions", server.base_url()))
        .json(&chat("drop me"))
        .send()
        .await;
    // hyper's IncompleteMessage: the connection closed before any status line.
    let err = result.unwrap_err();
    assert!(err.status().is_none() && err.is_request(), "{err:?}");
    let stats = server.stats();
    assert_eq!((stats.calls, stats.resets, stats.completed), (1, 1, 0));
    server.shutdown().await;
}

#[tokio::test]
async fn last_requests_record_authorization_and_body() {
    let server = start(Behaviour::default()).await;
    let client = client();
    client
        .post(format!("{}/chat/completions", server.base_url()))
        .bearer_auth("sk-test-1")
        .json(&chat("one"))
        .send()
        .await
        .unwrap();
    let mut body = chat("two");
    body["stream"] = json!(true);
    post(&client, &server, &body).await.text().await.unwrap();

    let stats: Stats = client
        .get(format!("http://{}/_mock/stats", server.addr()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let last = &stats.last_requests;
    assert_eq!(last.len(), 2);
    assert_eq!(last[0].seq, 1);
    assert_eq!(last[0].authorization.as_deref(), Some("Bearer sk-test-1"));
    assert_eq!(last[0].body, chat("one"));
    assert!(!last[0].stream);
    assert_eq!((last[1].seq, last[1].authorization.as_deref()), (2, None));
    assert!(last[1].stream);
    server.shutdown().await;
}

#[tokio::test]
async fn a_body_that_is_not_json_is_counted_and_refused() {
    let server = start(Behaviour::default()).await;
    let response = client()
        .post(format!("{}/chat/completions", server.base_url()))
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let stats = server.stats();
    assert_eq!((stats.calls, stats.failed), (1, 1));
    assert_eq!(stats.last_requests[0].body, json!("not json"));
    server.shutdown().await;
}

#[tokio::test]
async fn held_long_poll_times_out_with_408() {
    let server = start(Behaviour::default()).await;
    let response = client()
        .get(format!(
            "http://{}/_mock/held?at_least=1&timeout_ms=20",
            server.addr()
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 408);
    assert_eq!(response.json::<Value>().await.unwrap(), json!({"held": []}));
    server.shutdown().await;
}

#[tokio::test]
async fn behaviour_put_replaces_and_patch_merges() {
    let start_behaviour = Behaviour {
        latency_ms: 1,
        ..Behaviour::default()
    };
    let server = start(start_behaviour.clone()).await;
    let client = client();
    let url = format!("http://{}/_mock/behaviour", server.addr());
    let put: Behaviour = client
        .put(&url)
        .json(&json!({"fail_status": 500, "retry_after": 3}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        put,
        Behaviour {
            fail_status: Some(500),
            retry_after: Some(3),
            ..Behaviour::default()
        }
    );
    let patched: Behaviour = client
        .patch(&url)
        .json(&json!({"fail_status": null, "content": "fixed"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        patched,
        Behaviour {
            retry_after: Some(3),
            content: Some("fixed".into()),
            ..Behaviour::default()
        }
    );
    let answer: Value = post(&client, &server, &chat("q"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(content(&answer), "fixed");

    control(&client, &server, "reset", json!({})).await;
    let now: Behaviour = client.get(&url).send().await.unwrap().json().await.unwrap();
    assert_eq!(now, start_behaviour);
    server.shutdown().await;
}

#[test]
fn generated_content_echoes_the_last_user_text_truncated() {
    let long = "é".repeat(300);
    let request = json!({"model": "m", "messages": [
        {"role": "user", "content": "old"},
        {"role": "assistant", "content": "reply"},
        {"role": "user", "content": [
            {"type": "text", "text": long},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        ]},
    ]});
    let answer = completion(&request, 9, None);
    let expected = format!("mock answer #9 to: {}", "é".repeat(200));
    assert_eq!(content(&answer), expected);
    assert_eq!(content(&completion(&request, 9, Some("set"))), "set");
    assert_eq!(
        content(&completion(&json!({}), 1, None)),
        "mock answer #1 to: "
    );
    assert_eq!(completion(&json!({}), 1, None)["model"], "mock");
}

#[test]
fn chunks_cover_every_choice_and_only_add_usage_when_asked() {
    let mut request = chat("a b c");
    request["n"] = json!(2);
    let chunks: Vec<Value> = completion_chunks(&request, 4, None)
        .iter()
        .map(|chunk| serde_json::from_str(chunk).unwrap())
        .collect();
    assert!(chunks.iter().all(|chunk| chunk.get("usage").is_none()));
    for index in 0..2 {
        let text: String = chunks
            .iter()
            .filter(|chunk| chunk["choices"][0]["index"] == index)
            .filter_map(|chunk| chunk["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "mock answer #4 to: a b c");
        let finishes = chunks
            .iter()
            .filter(|chunk| {
                chunk["choices"][0]["index"] == index
                    && chunk["choices"][0]["finish_reason"] == "stop"
            })
            .count();
        assert_eq!(finishes, 1);
    }

    request["stream_options"] = json!({"include_usage": true});
    let chunks = completion_chunks(&request, 4, None);
    let last: Value = serde_json::from_str(chunks.last().unwrap()).unwrap();
    let plain = completion(&request, 4, None);
    assert_eq!(last["usage"], plain["usage"]);
    let first: Value = serde_json::from_str(&chunks[0]).unwrap();
    assert_eq!(first["usage"], Value::Null);
}

#[test]
fn a_forced_or_marked_function_is_called_plain_and_streamed() {
    let tools = json!([
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
            "properties": {"order": {"type": "string"}, "n": {"type": "integer"},
                "kind": {"enum": ["parcel", "letter"]}},
            "required": ["order", "n", "kind"]}}},
    ]);
    let mut request = chat("where is 1234");
    request["tools"] = tools;
    // Without a choice or the marker: text.
    assert_eq!(
        completion(&request, 1, None)["choices"][0]["finish_reason"],
        "stop"
    );

    request["tool_choice"] = json!({"type": "function", "function": {"name": "lookup"}});
    let plain = completion(&request, 2, None);
    let choice = &plain["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(
        choice["message"]["content"],
        Value::Null,
        "a forced call has no text"
    );
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["id"], "call_mock_2");
    assert_eq!(call["function"]["name"], "lookup");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(
        args,
        json!({"order": "where is 1234", "n": 1, "kind": "parcel"})
    );

    // Streamed: the head, then the arguments in pieces that add up.
    let chunks: Vec<Value> = completion_chunks(&request, 2, None)
        .iter()
        .map(|c| serde_json::from_str(c).unwrap())
        .collect();
    let deltas: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["tool_calls"][0]
                .as_object()
                .map(|_| c)
        })
        .map(|c| &c["choices"][0]["delta"]["tool_calls"][0])
        .collect();
    assert!(deltas.len() >= 3, "{chunks:?}");
    assert_eq!(deltas[0]["id"], "call_mock_2");
    let streamed: String = deltas
        .iter()
        .filter_map(|d| d["function"]["arguments"].as_str())
        .collect();
    assert_eq!(streamed, call["function"]["arguments"].as_str().unwrap());
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // `required`: the first function; `none`: text; the marker: text, then
    // the named function.
    request["tool_choice"] = json!("required");
    let first = completion(&request, 3, None);
    assert_eq!(
        first["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "search"
    );
    request["tool_choice"] = json!("none");
    assert_eq!(
        completion(&request, 4, None)["choices"][0]["finish_reason"],
        "stop"
    );
    request["tool_choice"] = json!("auto");
    request["messages"] = json!([{"role": "user", "content": "please call tool lookup now"}]);
    let marked = completion(&request, 5, None);
    let message = &marked["choices"][0]["message"];
    assert_eq!(
        message["content"],
        "mock answer #5 to: please call tool lookup now"
    );
    assert_eq!(message["tool_calls"][0]["function"]["name"], "lookup");
}

#[tokio::test]
async fn concurrent_calls_each_get_their_own_seq() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let client = client.clone();
            let url = format!("{}/chat/completions", server.base_url());
            tokio::spawn(async move {
                let answer: Value = client
                    .post(url)
                    .json(&chat("same"))
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                answer["id"].as_str().unwrap().to_owned()
            })
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    for task in tasks {
        assert!(ids.insert(task.await.unwrap()));
    }
    assert!(ids.contains("chatcmpl-mock-1") && ids.contains("chatcmpl-mock-100"));
    let stats = server.stats();
    assert_eq!(
        (stats.calls, stats.completed, stats.in_flight),
        (100, 100, 0)
    );
    assert_eq!(stats.last_requests.len(), 50);
    server.shutdown().await;
}

#[tokio::test]
async fn the_call_log_keeps_every_call_with_its_prompt_user_and_outcome() {
    let server = start(Behaviour::default()).await;
    let client = client();
    for i in 0..60 {
        let mut body = chat(&format!("q{i}"));
        body["user"] = json!(if i % 2 == 0 { "acme" } else { "beta" });
        assert_eq!(post(&client, &server, &body).await.status(), 200);
    }
    server.set_behaviour(Behaviour {
        fail_status: Some(429),
        ..Behaviour::default()
    });
    assert_eq!(post(&client, &server, &chat("late")).await.status(), 429);
    let calls = server.calls();
    // More than `last_requests` keeps.
    assert_eq!(calls.len(), 61);
    assert_eq!(calls[0].seq, 1);
    assert_eq!(calls[0].prompt, "q0");
    assert_eq!(calls[0].user.as_deref(), Some("acme"));
    assert_eq!(calls[1].user.as_deref(), Some("beta"));
    assert_eq!(calls[0].model.as_deref(), Some("gpt-test"));
    assert_eq!(calls[0].outcome, CallOutcome::Completed);
    assert_eq!(calls[60].outcome, CallOutcome::Failed);
    assert_eq!(calls[60].status, Some(429));
    // Garbage and padded answers are 200s the log tells apart.
    server.set_behaviour(Behaviour {
        garbage: Some(crate::mock_upstream::Garbage::Empty),
        ..Behaviour::default()
    });
    assert_eq!(post(&client, &server, &chat("garbage")).await.status(), 200);
    server.set_behaviour(Behaviour {
        pad_bytes: Some(4096),
        ..Behaviour::default()
    });
    assert_eq!(post(&client, &server, &chat("padded")).await.status(), 200);
    server.set_behaviour(Behaviour::default());
    let calls = server.calls();
    assert_eq!(calls[61].outcome, CallOutcome::Garbage);
    assert_eq!(calls[62].outcome, CallOutcome::Padded);
    assert!(
        calls
            .iter()
            .all(|c| c.done_ms.is_some_and(|d| d >= c.at_ms))
    );
    let over_http: Vec<CallRecord> = client
        .get(format!("http://{}/_mock/calls", server.addr()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(over_http, calls);
    control(&client, &server, "reset", json!({})).await;
    assert!(server.calls().is_empty());
    server.shutdown().await;
}

#[tokio::test]
async fn jitter_and_stalls_reorder_concurrent_answers() {
    let server = start(Behaviour {
        latency_ms: 5,
        latency_jitter_ms: 150,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let tasks: Vec<_> = (0..20)
        .map(|i| {
            let (client, url) = (
                client.clone(),
                format!("{}/chat/completions", server.base_url()),
            );
            tokio::spawn(async move {
                client
                    .post(url)
                    .json(&chat(&format!("r{i}")))
                    .send()
                    .await
                    .unwrap();
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let calls = server.calls();
    let mut by_arrival: Vec<u64> = calls.iter().map(|c| c.seq).collect();
    let mut by_answer = calls.clone();
    by_answer.sort_by_key(|c| c.done_ms);
    by_arrival.sort_unstable();
    assert_ne!(
        by_answer.iter().map(|c| c.seq).collect::<Vec<_>>(),
        by_arrival,
        "20 jittered calls answered in arrival order"
    );
    // A stall on every call: each waits at least stall_ms.
    server.set_behaviour(Behaviour {
        stall_rate: 1.0,
        stall_ms: 200,
        ..Behaviour::default()
    });
    let started = std::time::Instant::now();
    assert_eq!(post(&client, &server, &chat("stalled")).await.status(), 200);
    assert!(started.elapsed() >= Duration::from_millis(200));
    server.shutdown().await;
}

/// One answer of a mock with `behaviour`: its content type and body.
async fn answer_of(behaviour: Behaviour, stream: bool) -> (String, String) {
    let server = start(behaviour).await;
    let mut body = chat("garbage please");
    body["stream"] = json!(stream);
    let response = post(&client(), &server, &body).await;
    assert_eq!(response.status(), 200);
    let content_type = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_string();
    (content_type, response.text().await.unwrap())
}

#[tokio::test]
async fn each_kind_of_garbage_is_a_200_that_is_no_chat_completion() {
    let garbage = |kind| Behaviour {
        garbage: Some(kind),
        ..Behaviour::default()
    };
    let json_of = |text: &str| serde_json::from_str::<Value>(text);
    let assembled = |text: &str| crate::sse::assemble(text.as_bytes());

    let (kind, body) = answer_of(garbage(Garbage::NotJson), false).await;
    assert!(
        kind.starts_with("text/html") && json_of(&body).is_err(),
        "{body}"
    );
    let (kind, body) = answer_of(garbage(Garbage::NotJson), true).await;
    assert_eq!(kind, "text/event-stream");
    assert!(body.contains("data: <html>"), "{body}");
    assert!(assembled(&body).is_err());

    let (_, body) = answer_of(garbage(Garbage::Truncated), false).await;
    assert!(body.starts_with('{'), "{body}");
    assert!(json_of(&body).is_err(), "{body}");
    let (_, body) = answer_of(garbage(Garbage::Truncated), true).await;
    assert!(
        !body.contains("[DONE]") && !body.ends_with("\n\n"),
        "{body}"
    );
    assert!(assembled(&body).is_err());

    for stream in [false, true] {
        let (_, body) = answer_of(garbage(Garbage::Empty), stream).await;
        assert_eq!(body, "");
    }

    let (kind, body) = answer_of(garbage(Garbage::ErrorObject), false).await;
    assert_eq!(kind, "application/json");
    assert_eq!(json_of(&body).unwrap()["error"]["type"], "server_error");
    let (_, body) = answer_of(garbage(Garbage::ErrorObject), true).await;
    assert!(!body.contains("[DONE]"), "{body}");
    assert!(matches!(
        assembled(&body),
        Err(crate::sse::SseError::Upstream(_))
    ));

    // The error mid-stream, then [DONE]: two chunks of content before it.
    let (_, body) = answer_of(garbage(Garbage::StreamError), true).await;
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.len(), 4, "{body}");
    assert!(events[1].contains("\"content\":\"mock \""), "{body}");
    assert!(events[2].starts_with("data: {\"error\""), "{body}");
    assert_eq!(events[3], "data: [DONE]");
    assert!(matches!(
        assembled(&body),
        Err(crate::sse::SseError::Upstream(_))
    ));

    let (_, body) = answer_of(garbage(Garbage::EmptyChoices), false).await;
    let v = json_of(&body).unwrap();
    assert_eq!(
        (&v["object"], &v["choices"]),
        (&json!("chat.completion"), &json!([]))
    );
    let (_, body) = answer_of(garbage(Garbage::EmptyChoices), true).await;
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    assert_eq!(assembled(&body).unwrap()["choices"], json!([]));

    // Streamed even when the request asked for a plain answer.
    for stream in [false, true] {
        let (kind, body) = answer_of(garbage(Garbage::StreamWithoutDone), stream).await;
        assert_eq!(kind, "text/event-stream");
        assert!(body.contains("\"content\":\"mock \""), "{body}");
        assert!(
            !body.contains("[DONE]") && !body.contains("\"stop\""),
            "{body}"
        );
        assert!(matches!(
            assembled(&body),
            Err(crate::sse::SseError::Truncated)
        ));
        // Every chunk with its finish reason, but no [DONE].
        let (kind, finished) = answer_of(garbage(Garbage::FinishedWithoutDone), stream).await;
        assert_eq!(kind, "text/event-stream");
        assert!(
            finished.contains("\"finish_reason\":\"stop\""),
            "{finished}"
        );
        assert!(!finished.contains("[DONE]"), "{finished}");
        // [DONE], but no finish reason.
        let (kind, done) = answer_of(garbage(Garbage::DoneWithoutFinish), stream).await;
        assert_eq!(kind, "text/event-stream");
        assert!(done.ends_with("data: [DONE]\n\n"), "{done}");
        assert!(!done.contains("\"stop\""), "{done}");
        for body in [&finished, &done] {
            assert!(matches!(
                assembled(body),
                Err(crate::sse::SseError::Truncated)
            ));
        }
    }
}

#[tokio::test]
async fn pad_bytes_grows_plain_and_streamed_answers_to_the_size_asked() {
    let padded = Behaviour {
        pad_bytes: Some(100_000),
        ..Behaviour::default()
    };
    let (_, body) = answer_of(padded.clone(), false).await;
    assert!((100_000..100_100).contains(&body.len()), "{}", body.len());
    let v: Value = serde_json::from_str(&body).unwrap();
    assert!(content(&v).starts_with("mock answer #1 to: garbage please x"));
    let (_, body) = answer_of(padded, true).await;
    assert!((100_000..101_500).contains(&body.len()), "{}", body.len());
    let assembled = crate::sse::assemble(body.as_bytes()).unwrap();
    assert!(content(&assembled).starts_with("mock answer #1 to: garbage please x"));
    // The padding streams as many chunks, not one.
    assert!(events(&body).len() > 50, "{} events", events(&body).len());
}

#[tokio::test]
async fn the_control_api_takes_garbage_and_pad_bytes() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let url = format!("http://{}/_mock/behaviour", server.addr());
    let patched: Behaviour = client
        .patch(&url)
        .json(&json!({"garbage": "empty_choices", "pad_bytes": 4096}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(patched.garbage, Some(Garbage::EmptyChoices));
    assert_eq!(patched.pad_bytes, Some(4096));
    let answer: Value = post(&client, &server, &chat("q"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(answer["choices"], json!([]));
    let response = client
        .patch(&url)
        .json(&json!({"garbage": "nonsense"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let patched: Behaviour = client
        .patch(&url)
        .json(&json!({"garbage": null}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(patched.garbage, None);
    let body = post(&client, &server, &chat("q"))
        .await
        .text()
        .await
        .unwrap();
    assert!(body.len() >= 4096, "{}", body.len());
    server.shutdown().await;
}

async fn embed(client: &reqwest::Client, server: &MockServer, body: &Value) -> reqwest::Response {
    client
        .post(format!("{}/embeddings", server.base_url()))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// The answer's vectors, decoded from floats or base64.
fn vectors(answer: &Value) -> Vec<Vec<f32>> {
    use base64::Engine as _;
    answer["data"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, item)| {
            assert_eq!(item["object"], "embedding");
            assert_eq!(item["index"], i);
            match &item["embedding"] {
                Value::Array(numbers) => {
                    numbers.iter().map(|x| x.as_f64().unwrap() as f32).collect()
                }
                Value::String(text) => base64::engine::general_purpose::STANDARD
                    .decode(text)
                    .unwrap()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                other => panic!("an embedding that is {other}"),
            }
        })
        .collect()
}

#[tokio::test]
async fn embeddings_answer_in_the_openai_shape_with_each_items_own_vector() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let response = embed(
        &client,
        &server,
        &json!({"model": "text-embedding-3-small", "input": "hello there", "user": "acme"}),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["content-type"], "application/json");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["object"], "list");
    assert_eq!(answer["model"], "text-embedding-3-small");
    let usage = &answer["usage"];
    assert_eq!(usage["prompt_tokens"], 2);
    assert_eq!(usage["total_tokens"], 2);
    assert_eq!(
        usage.as_object().unwrap().len(),
        2,
        "no completion tokens: {usage}"
    );
    let got = vectors(&answer);
    assert_eq!(got, vec![embedding_of(&json!("hello there"), 8)]);
    assert_eq!(got[0].len(), DEFAULT_DIMENSIONS);
    let norm: f32 = got[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    assert!(got[0].iter().all(|x| (-1.0..=1.0).contains(x)));

    // A batch, without the /v1 prefix and without a model: in order, each
    // item's own vector.
    let items = [
        "alpha",
        "beta",
        "alpha",
        "a much longer item, of several tokens",
    ];
    let response = client
        .post(format!("http://{}/embeddings", server.addr()))
        .json(&json!({"input": items, "dimensions": 3}))
        .send()
        .await
        .unwrap();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["model"], "mock");
    let expected: Vec<Vec<f32>> = items
        .iter()
        .map(|item| embedding_of(&json!(item), 3))
        .collect();
    assert_eq!(vectors(&answer), expected);
    assert_eq!(answer["usage"]["prompt_tokens"], 1 + 1 + 1 + 9);
    server.shutdown().await;
}

#[tokio::test]
async fn a_vector_depends_on_its_item_and_the_dimensions_only() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let first: Value = embed(
        &client,
        &server,
        &json!({"model": "m1", "input": ["a", "b", "c"]}),
    )
    .await
    .json()
    .await
    .unwrap();
    // Another model, another call number, other places in the batch.
    let second: Value = embed(
        &client,
        &server,
        &json!({"model": "m2", "input": ["c", "a"], "dimensions": 8}),
    )
    .await
    .json()
    .await
    .unwrap();
    let (first, second) = (vectors(&first), vectors(&second));
    assert_eq!(second[0], first[2]);
    assert_eq!(second[1], first[0]);
    assert_ne!(first[0], first[1]);
    assert_ne!(first[1], first[2]);
    // Other dimensions: another vector, not a cut of the same one.
    let a = json!("a");
    let short = embedding_of(&a, 4);
    let long = embedding_of(&a, 8);
    assert_eq!(short.len(), 4);
    assert_ne!(short[..], long[..4]);
    assert_eq!(embedding_of(&a, 4096).len(), 4096);
    // A string and the token array that spells it the same way in JSON differ.
    assert_ne!(
        embedding_of(&json!([1, 2]), 8),
        embedding_of(&json!("[1,2]"), 8)
    );
    server.shutdown().await;
}

#[tokio::test]
async fn base64_embeddings_decode_to_the_float_vectors() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let request = json!({"input": ["x", "y"], "dimensions": 5});
    let floats: Value = embed(&client, &server, &request)
        .await
        .json()
        .await
        .unwrap();
    let mut request = request;
    request["encoding_format"] = json!("base64");
    let encoded: Value = embed(&client, &server, &request)
        .await
        .json()
        .await
        .unwrap();
    let text = encoded["data"][0]["embedding"].as_str().unwrap();
    // 5 f32s are 20 bytes: 28 characters of the standard, padded alphabet.
    assert_eq!(text.len(), 28);
    assert!(text.ends_with('='), "{text}");
    assert_eq!(vectors(&encoded), vectors(&floats));
    assert_eq!(vectors(&encoded)[1], embedding_of(&json!("y"), 5));
    assert_eq!(encoded["usage"], floats["usage"]);
    server.shutdown().await;
}

#[tokio::test]
async fn token_arrays_are_items_whose_usage_is_their_length() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let one: Value = embed(&client, &server, &json!({"input": [101, 2023, 7]}))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(vectors(&one), vec![embedding_of(&json!([101, 2023, 7]), 8)]);
    assert_eq!(one["usage"]["prompt_tokens"], 3);
    let many: Value = embed(&client, &server, &json!({"input": [[1, 2], [3], [1, 2]]}))
        .await
        .json()
        .await
        .unwrap();
    let got = vectors(&many);
    assert_eq!(got.len(), 3);
    assert_eq!(got[0], embedding_of(&json!([1, 2]), 8));
    assert_eq!(got[1], embedding_of(&json!([3]), 8));
    assert_eq!(got[0], got[2]);
    assert_eq!(many["usage"]["total_tokens"], 5);
    let calls = server.calls();
    assert_eq!(calls[0].prompt, "[101,2023,7]");
    assert_eq!(calls[1].prompt, "[1,2]");
    assert_eq!(server.stats().embedding_items, 4);
    server.shutdown().await;
}

#[tokio::test]
async fn invalid_embeddings_requests_are_400s_naming_the_param() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let cases = [
        (json!({"model": "m"}), "input"),
        (json!({"input": null}), "input"),
        (json!({"input": ""}), "input"),
        (json!({"input": []}), "input"),
        (json!({"input": [""]}), "input"),
        (json!({"input": ["a", ""]}), "input"),
        (json!({"input": [[]]}), "input"),
        (json!({"input": [[1], []]}), "input"),
        (json!({"input": ["a", 1]}), "input"),
        (json!({"input": [[1], "a"]}), "input"),
        (json!({"input": [1.5]}), "input"),
        (json!({"input": [-1]}), "input"),
        (json!({"input": [[1, "2"]]}), "input"),
        (json!({"input": [["a"]]}), "input"),
        (json!({"input": 3}), "input"),
        (json!({"input": {"text": "a"}}), "input"),
        (json!({"input": vec!["a"; MAX_ITEMS + 1]}), "input"),
        (json!({"input": "a", "model": 1}), "model"),
        (json!({"input": "a", "dimensions": 0}), "dimensions"),
        (json!({"input": "a", "dimensions": -3}), "dimensions"),
        (json!({"input": "a", "dimensions": 2.5}), "dimensions"),
        (json!({"input": "a", "dimensions": "8"}), "dimensions"),
        (json!({"input": "a", "dimensions": 4097}), "dimensions"),
        (
            json!({"input": "a", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (
            json!({"input": "a", "encoding_format": 1}),
            "encoding_format",
        ),
        (json!({"input": "a", "user": 7}), "user"),
    ];
    for (body, param) in &cases {
        let response = embed(&client, &server, body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["param"], *param, "{body}: {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{body}");
        assert!(error["error"]["message"].as_str().unwrap().contains(param));
    }
    let response = client
        .post(format!("{}/embeddings", server.base_url()))
        .body("[\"not an object\"]")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    // The largest values accepted are accepted.
    let answer: Value = embed(
        &client,
        &server,
        &json!({"input": vec!["a"; MAX_ITEMS], "dimensions": MAX_DIMENSIONS,
                "encoding_format": "base64", "user": null}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(answer["data"].as_array().unwrap().len(), MAX_ITEMS);
    let stats = server.stats();
    let refused = cases.len() as u64 + 1;
    assert_eq!(stats.calls, refused + 1);
    assert_eq!(stats.embedding_calls, refused + 1);
    assert_eq!(stats.failed, refused);
    // Only the valid request's items count.
    assert_eq!(stats.embedding_items, MAX_ITEMS as u64);
    server.shutdown().await;
}

#[tokio::test]
async fn an_embeddings_call_is_held_released_and_failed_like_a_chat_call() {
    let server = start(Behaviour {
        hold: true,
        retry_after: Some(4),
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let send = |body: Value| {
        let client = client.clone();
        let url = format!("{}/embeddings", server.base_url());
        tokio::spawn(async move { client.post(url).json(&body).send().await.unwrap() })
    };
    let first = send(json!({"input": ["held", "twice"], "model": "e"}));
    assert_eq!(held(&client, &server, 1).await, vec![1]);
    let second = send(json!({"input": "refused"}));
    assert_eq!(held(&client, &server, 2).await, vec![1, 2]);
    let stats = server.stats();
    assert_eq!(
        (
            stats.calls,
            stats.embedding_calls,
            stats.held,
            stats.completed
        ),
        (2, 2, 2, 0)
    );
    assert_eq!(stats.in_flight, 2);

    let released = control(
        &client,
        &server,
        "release",
        json!({"seq": 2, "status": 503}),
    )
    .await;
    assert_eq!(released["released"], json!([2]));
    let response = second.await.unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(response.headers()["retry-after"], "4");
    assert!(!first.is_finished());

    control(&client, &server, "release", json!({"seq": 1})).await;
    let answer: Value = first.await.unwrap().json().await.unwrap();
    assert_eq!(
        vectors(&answer),
        vec![
            embedding_of(&json!("held"), 8),
            embedding_of(&json!("twice"), 8)
        ]
    );

    server.set_behaviour(Behaviour {
        fail_status: Some(429),
        ..Behaviour::default()
    });
    let response = embed(&client, &server, &json!({"input": "limited"})).await;
    assert_eq!(response.status(), 429);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "rate_limit_error");

    let stats = server.stats();
    assert_eq!(
        (stats.calls, stats.completed, stats.failed, stats.held),
        (3, 1, 2, 0)
    );
    let calls = server.calls();
    assert!(calls.iter().all(|c| c.endpoint == Endpoint::Embeddings));
    let summary: Vec<_> = calls
        .iter()
        .map(|c| (c.seq, c.prompt.as_str(), c.outcome, c.status))
        .collect();
    assert_eq!(
        summary,
        vec![
            (1, "held", CallOutcome::Completed, Some(200)),
            (2, "refused", CallOutcome::Failed, Some(503)),
            (3, "limited", CallOutcome::Failed, Some(429)),
        ]
    );
    assert_eq!(calls[0].model.as_deref(), Some("e"));
    assert!(!calls[0].stream);
    server.shutdown().await;
}

#[tokio::test]
async fn stats_and_the_call_log_tell_embeddings_from_chat() {
    let server = start(Behaviour::default()).await;
    let client = client();
    assert_eq!(post(&client, &server, &chat("chat")).await.status(), 200);
    let three = json!({"input": ["a", "b", "c"], "user": "beta"});
    assert_eq!(embed(&client, &server, &three).await.status(), 200);
    assert_eq!(
        embed(&client, &server, &json!({"input": "d"}))
            .await
            .status(),
        200
    );
    let stats = server.stats();
    assert_eq!(
        (stats.calls, stats.embedding_calls, stats.embedding_items),
        (3, 2, 4)
    );
    assert_eq!(stats.completed, 3);
    let endpoints: Vec<Endpoint> = stats.last_requests.iter().map(|r| r.endpoint).collect();
    assert_eq!(
        endpoints,
        [
            Endpoint::ChatCompletions,
            Endpoint::Embeddings,
            Endpoint::Embeddings
        ]
    );
    assert_eq!(stats.last_requests[1].body, three);

    let over_http: Value = client
        .get(format!("http://{}/_mock/calls", server.addr()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(over_http[0]["endpoint"], "chat_completions");
    assert_eq!(over_http[1]["endpoint"], "embeddings");
    assert_eq!(over_http[1]["prompt"], "a");
    assert_eq!(over_http[1]["user"], "beta");
    let stats_over_http: Value = client
        .get(format!("http://{}/_mock/stats", server.addr()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats_over_http["embedding_items"], 4);

    let stats: Stats =
        serde_json::from_value(control(&client, &server, "reset", json!({})).await).unwrap();
    assert_eq!(
        (stats.calls, stats.embedding_calls, stats.embedding_items),
        (0, 0, 0)
    );
    server.shutdown().await;
}

#[tokio::test]
async fn embeddings_garbage_is_a_200_that_is_no_embeddings_list() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let request = json!({"input": ["one", "two"]});
    let answer = |kind: Option<Garbage>| {
        server.set_behaviour(Behaviour {
            garbage: kind,
            ..Behaviour::default()
        });
        let client = client.clone();
        let url = format!("{}/embeddings", server.base_url());
        let request = request.clone();
        async move {
            let response = client.post(url).json(&request).send().await.unwrap();
            assert_eq!(response.status(), 200);
            let kind = response.headers()["content-type"]
                .to_str()
                .unwrap()
                .to_owned();
            (kind, response.text().await.unwrap())
        }
    };
    let (_, whole) = answer(None).await;

    let (kind, body) = answer(Some(Garbage::NotJson)).await;
    assert!(kind.starts_with("text/html"), "{kind}");
    assert!(serde_json::from_str::<Value>(&body).is_err());
    let (_, body) = answer(Some(Garbage::Truncated)).await;
    assert!(whole.starts_with(&body) && body.len() == whole.len() / 2);
    assert!(serde_json::from_str::<Value>(&body).is_err());
    assert_eq!(answer(Some(Garbage::Empty)).await.1, "");
    for kind in [Garbage::ErrorObject, Garbage::StreamError] {
        let (_, body) = answer(Some(kind)).await;
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["type"], "server_error", "{kind:?}");
    }
    let (_, body) = answer(Some(Garbage::EmptyChoices)).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((&v["object"], &v["data"]), (&json!("list"), &json!([])));
    let (kind, body) = answer(Some(Garbage::StreamWithoutDone)).await;
    assert_eq!(kind, "text/event-stream");
    assert_eq!(body, format!("data: {whole}\n\n"));

    let calls = server.calls();
    assert_eq!(calls[0].outcome, CallOutcome::Completed);
    assert!(calls[1..].iter().all(|c| c.outcome == CallOutcome::Garbage));
    server.shutdown().await;
}

#[test]
fn the_embedding_derivation_is_the_documented_one() {
    // The first component of "a" in 2 dimensions, computed by hand from the
    // derivation the module documents (the same one the SDK check redoes).
    use sha2::{Digest, Sha256};
    let seed = Sha256::new()
        .chain_update(b"idem mock embedding\n")
        .chain_update(2u64.to_le_bytes())
        .chain_update(b"sa")
        .finalize();
    let block = Sha256::new()
        .chain_update(seed)
        .chain_update(0u64.to_le_bytes())
        .finalize();
    let unit = |i: usize| {
        let u = u32::from_le_bytes([block[i], block[i + 1], block[i + 2], block[i + 3]]);
        f64::from(u) / f64::from(u32::MAX) * 2.0 - 1.0
    };
    let (x, y) = (unit(0), unit(4));
    let norm = (x * x + y * y).sqrt();
    assert_eq!(
        embedding_of(&json!("a"), 2),
        vec![(x / norm) as f32, (y / norm) as f32]
    );
}

#[tokio::test]
async fn response_format_answers_a_json_object_that_fits_the_schema() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = chat("who are you?");
    body["response_format"] = json!({"type": "json_object"});
    let answer: Value = post(&client, &server, &body).await.json().await.unwrap();
    let parsed: Value = serde_json::from_str(content(&answer)).unwrap();
    assert_eq!(parsed, json!({"answer": "mock answer #1 to: who are you?"}));

    // A schema as pydantic (instructor) writes one: $defs, $ref, enum,
    // anyOf with null, nested objects, arrays.
    body["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "User",
    "strict": true, "schema": {
        "$defs": {"Role": {"type": "string", "enum": ["admin", "user"]},
            "Address": {"type": "object", "properties": {"city": {"type": "string"},
                "zip": {"type": "integer"}}, "required": ["city", "zip"]}},
        "type": "object",
        "properties": {
            "name": {"type": "string"}, "age": {"type": "integer"},
            "score": {"type": "number"}, "active": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "role": {"$ref": "#/$defs/Role"}, "address": {"$ref": "#/$defs/Address"},
            "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "optional": {"type": "string"},
        },
        "required": ["name", "age", "score", "active", "tags", "role", "address", "nickname"],
    }}});
    let answer: Value = post(&client, &server, &body).await.json().await.unwrap();
    let parsed: Value = serde_json::from_str(content(&answer)).unwrap();
    let text = "mock answer #2 to: who are you?";
    assert_eq!(
        parsed,
        json!({"name": text, "age": 1, "score": 1, "active": true, "tags": [], "role": "admin",
            "address": {"city": text, "zip": 1}, "nickname": text})
    );

    // The in-process answer (idem's provider of kind "mock") is the same,
    // plain and streamed.
    let completion = super::completion(&body, 7, None);
    let parsed: Value = serde_json::from_str(
        completion["choices"][0]["message"]["content"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(parsed["age"], 1);
    let streamed: String = super::completion_chunks(&body, 7, None)
        .iter()
        .filter_map(|c| {
            let c: Value = serde_json::from_str(c).unwrap();
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(
        streamed,
        completion["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
    );
    // A fixed content is left as it is.
    assert_eq!(
        super::completion(&body, 7, Some("plain"))["choices"][0]["message"]["content"],
        "plain"
    );
    server.shutdown().await;
}
