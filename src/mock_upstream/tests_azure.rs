//! The mock's Azure OpenAI routes:
//! `POST /openai/deployments/{deployment}/chat/completions?api-version=V`
//! and `.../embeddings?api-version=V`.

use serde_json::{Value, json};

use super::tests::{chat, client, content, control, events, held, start};
use super::*;

const VERSION: &str = "2024-10-21";
const KEY: &str = "azure-key";

fn url(server: &MockServer, deployment: &str, what: &str, version: Option<&str>) -> String {
    let query = version
        .map(|v| format!("?api-version={v}"))
        .unwrap_or_default();
    format!(
        "http://{}/openai/deployments/{deployment}/{what}{query}",
        server.addr()
    )
}

async fn azure(
    client: &reqwest::Client,
    server: &MockServer,
    deployment: &str,
    what: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .post(url(server, deployment, what, Some(VERSION)))
        .header("api-key", KEY)
        .json(body)
        .send()
        .await
        .unwrap()
}

#[tokio::test]
async fn azure_chat_answers_like_openai_with_the_deployment_as_model() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let response = azure(
        &client,
        &server,
        "gpt4o-prod",
        "chat/completions",
        &chat("hi"),
    )
    .await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["object"], "chat.completion");
    assert_eq!(answer["model"], "gpt4o-prod");
    assert_eq!(content(&answer), "mock answer #1 to: hi");

    // Streamed: every chunk names the deployment.
    let mut body = chat("stream");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let response = azure(&client, &server, "gpt4o-prod", "chat/completions", &body).await;
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let text = response.text().await.unwrap();
    let events = events(&text);
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks.iter().all(|c| c["model"] == "gpt4o-prod"));
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, "mock answer #2 to: stream");

    // What the gateway sent: the body as it was, the URL's parts, the key.
    let stats = server.stats();
    let last = &stats.last_requests[0];
    assert_eq!(last.endpoint, Endpoint::ChatCompletions);
    assert_eq!(last.body, chat("hi"));
    assert_eq!(last.deployment.as_deref(), Some("gpt4o-prod"));
    assert_eq!(last.api_version.as_deref(), Some(VERSION));
    assert_eq!(last.api_key.as_deref(), Some(KEY));
    assert_eq!(last.authorization, None);
    let calls = server.calls();
    assert_eq!(calls[0].model.as_deref(), Some("gpt4o-prod"));
    assert_eq!(calls[0].prompt, "hi");
    assert!(calls[1].stream);
    assert_eq!((stats.calls, stats.completed), (2, 2));
    server.shutdown().await;
}

#[tokio::test]
async fn azure_embeddings_answer_like_openai_with_the_deployment_as_model() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let body = json!({"input": ["a", "b"], "model": "ignored"});
    let response = azure(&client, &server, "embed-small", "embeddings", &body).await;
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["model"], "embed-small");
    let first: Vec<f32> = serde_json::from_value(answer["data"][0]["embedding"].clone()).unwrap();
    assert_eq!(first, embedding_of(&json!("a"), DEFAULT_DIMENSIONS));

    // Invalid inputs are OpenAI's 400s.
    let response = azure(
        &client,
        &server,
        "embed-small",
        "embeddings",
        &json!({"input": ""}),
    )
    .await;
    assert_eq!(response.status(), 400);
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["param"], "input");

    let stats = server.stats();
    assert_eq!((stats.embedding_calls, stats.embedding_items), (2, 2));
    let last = &stats.last_requests[0];
    assert_eq!(last.endpoint, Endpoint::Embeddings);
    assert_eq!(last.body, body);
    assert_eq!(last.deployment.as_deref(), Some("embed-small"));
    assert_eq!(server.calls()[0].model.as_deref(), Some("embed-small"));
    server.shutdown().await;
}

#[tokio::test]
async fn azure_refuses_a_missing_api_version_with_404_and_a_missing_key_with_401() {
    let server = start(Behaviour::default()).await;
    let client = client();
    for what in ["chat/completions", "embeddings"] {
        let body = if what == "embeddings" {
            json!({"input": "x"})
        } else {
            chat("x")
        };
        for version in [None, Some("")] {
            let response = client
                .post(url(&server, "d1", what, version))
                .header("api-key", KEY)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 404, "{what} {version:?}");
            let error: Value = response.json().await.unwrap();
            assert_eq!(
                error,
                json!({"error": {"code": "404", "message": "Resource not found"}})
            );
        }
        // No api-key: an Entra token (Authorization) is not taken for one.
        let response = client
            .post(url(&server, "d1", what, Some(VERSION)))
            .bearer_auth("entra-token")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 401, "{what}");
        let error: Value = response.json().await.unwrap();
        assert_eq!(error["error"]["code"], "401");
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("Access denied due to invalid subscription key"),
            "{error}"
        );
    }
    let stats = server.stats();
    assert_eq!((stats.calls, stats.failed, stats.completed), (6, 6, 0));
    // A refused embeddings call counts no items.
    assert_eq!(stats.embedding_items, 0);
    let last = &stats.last_requests;
    assert_eq!(last[0].api_version, None);
    assert_eq!(last[0].deployment.as_deref(), Some("d1"));
    assert_eq!(last[2].authorization.as_deref(), Some("Bearer entra-token"));
    assert_eq!(last[2].api_key, None);
    let statuses: Vec<Option<u16>> = server.calls().iter().map(|c| c.status).collect();
    assert_eq!(statuses, [Some(404), Some(404), Some(401)].repeat(2));
    server.shutdown().await;
}

#[tokio::test]
async fn azure_calls_are_held_released_and_failed_like_openai_calls() {
    let server = start(Behaviour {
        hold: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let request = tokio::spawn({
        let client = client.clone();
        let url = url(&server, "dep", "chat/completions", Some(VERSION));
        async move {
            client
                .post(url)
                .header("api-key", KEY)
                .json(&chat("held"))
                .send()
                .await
                .unwrap()
        }
    });
    assert_eq!(held(&client, &server, 1).await, vec![1]);
    control(&client, &server, "release", json!({"content": "released"})).await;
    let answer: Value = request.await.unwrap().json().await.unwrap();
    assert_eq!(content(&answer), "released");
    assert_eq!(answer["model"], "dep");

    server.set_behaviour(Behaviour {
        fail_status: Some(429),
        retry_after: Some(3),
        ..Behaviour::default()
    });
    let response = azure(
        &client,
        &server,
        "dep",
        "chat/completions",
        &chat("limited"),
    )
    .await;
    assert_eq!(response.status(), 429);
    assert_eq!(response.headers()["retry-after"], "3");
    let error: Value = response.json().await.unwrap();
    assert_eq!(error["error"]["type"], "rate_limit_error");

    server.set_behaviour(Behaviour {
        garbage: Some(Garbage::Empty),
        ..Behaviour::default()
    });
    let response = azure(
        &client,
        &server,
        "dep",
        "chat/completions",
        &chat("garbage"),
    )
    .await;
    assert_eq!(response.status(), 200);
    assert_eq!(response.text().await.unwrap(), "");
    let outcomes: Vec<CallOutcome> = server.calls().iter().map(|c| c.outcome).collect();
    assert_eq!(
        outcomes,
        [
            CallOutcome::Completed,
            CallOutcome::Failed,
            CallOutcome::Garbage
        ]
    );
    server.shutdown().await;
}
