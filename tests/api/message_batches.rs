//! Anthropic's Message Batches against the real gateway and a mock
//! Anthropic provider: each request one job, identical requests one call,
//! results in Anthropic's shape (the message as the provider wrote it), a
//! batch created again with its Idempotency-Key is the same batch,
//! creation refused with Anthropic's errors, a cancel counts the requests
//! it kept from running, a batch is deleted (with its files) only once it
//! has ended, and another tenant (or the OpenAI face) sees nothing.

use std::time::Duration;

use idem::config::ProviderKind;
use serde_json::{Value, json};

use crate::helpers::*;

fn anthropic_target() -> Spec {
    Spec {
        primary_kind: ProviderKind::Anthropic,
        ..Spec::default()
    }
}

fn request(custom_id: &str, prompt: &str) -> Value {
    json!({"custom_id": custom_id, "params": {
        "model": "bot", "max_tokens": 32,
        "messages": [{"role": "user", "content": prompt}],
    }})
}

async fn send(
    app: &TestApp,
    key: &str,
    method: reqwest::Method,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let mut r = app
        .client
        .request(method, app.url(path))
        .header("x-api-key", key)
        .header("anthropic-version", "2023-06-01");
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    if let Some(b) = body {
        r = r.json(b);
    }
    r.send().await.unwrap()
}

async fn create(
    app: &TestApp,
    key: &str,
    requests: &[Value],
    headers: &[(&str, &str)],
) -> reqwest::Response {
    let body = json!({"requests": requests});
    send(
        app,
        key,
        reqwest::Method::POST,
        "/v1/messages/batches",
        Some(&body),
        headers,
    )
    .await
}

async fn get(app: &TestApp, key: &str, path: &str) -> (u16, Value) {
    let r = send(app, key, reqwest::Method::GET, path, None, &[]).await;
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

/// Polls the batch until it has ended; returns it.
async fn until_ended(app: &TestApp, key: &str, id: &str) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (status, b) = get(app, key, &format!("/v1/messages/batches/{id}")).await;
        assert_eq!(status, 200, "{b}");
        if b["processing_status"] == "ended" {
            return b;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "batch {id} did not end within 60 s: {b}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn results(app: &TestApp, key: &str, id: &str) -> Vec<Value> {
    let r = send(
        app,
        key,
        reqwest::Method::GET,
        &format!("/v1/messages/batches/{id}/results"),
        None,
        &[],
    )
    .await;
    assert_eq!(r.status(), 200);
    r.text()
        .await
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// An error in Anthropic's shape: its status and `error.type`.
async fn assert_anthropic_error(resp: reqwest::Response, status: u16, kind: &str) -> Value {
    assert_eq!(resp.status().as_u16(), status);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], kind, "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
    v
}

#[tokio::test]
async fn each_distinct_request_is_one_call_and_results_are_anthropics() {
    let app = TestApp::with(anthropic_target()).await;
    // 5 distinct prompts, each three times; one request the Messages API
    // refuses (no max_tokens).
    let mut requests: Vec<Value> = (0..15)
        .map(|i| request(&format!("r-{i}"), &format!("m{}", i % 5)))
        .collect();
    requests.push(json!({"custom_id": "bad", "params": {
        "model": "bot", "messages": [{"role": "user", "content": "x"}]}}));
    let key = [("idempotency-key", "msgbatch-1")];
    let r = create(&app, ACME, &requests, &key).await;
    assert_eq!(r.status(), 200);
    let b: Value = r.json().await.unwrap();
    let id = b["id"].as_str().unwrap().to_owned();
    assert!(id.starts_with("msgbatch_"), "{b}");
    assert_eq!(b["type"], "message_batch");
    assert_eq!(b["processing_status"], "in_progress");
    assert_eq!(b["request_counts"]["processing"], 16);
    assert_eq!(b["results_url"], Value::Null);

    // Created again with its key: the same batch; with other requests: 409.
    let r = create(&app, ACME, &requests, &key).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(r.json::<Value>().await.unwrap()["id"], id.as_str());
    let r = create(&app, ACME, &requests[..3], &key).await;
    // As the Messages face answers a reused key.
    assert_anthropic_error(r, 409, "conflict_error").await;

    let b = until_ended(&app, ACME, &id).await;
    assert_eq!(app.calls(), 5, "one upstream call per distinct request");
    assert_eq!(
        b["request_counts"],
        json!({"processing": 0, "succeeded": 15, "errored": 1, "canceled": 0, "expired": 0})
    );
    assert_eq!(b["idem"]["deduplicated"], 10);
    assert!(
        b["results_url"]
            .as_str()
            .unwrap()
            .ends_with(&format!("/v1/messages/batches/{id}/results")),
        "{b}"
    );
    let lines = results(&app, ACME, &id).await;
    assert_eq!(lines.len(), 16);
    let by_id: std::collections::HashMap<&str, &Value> = lines
        .iter()
        .map(|l| (l["custom_id"].as_str().unwrap(), &l["result"]))
        .collect();
    assert_eq!(by_id.len(), 16, "one result per custom_id");
    for i in 0..15 {
        let r = by_id[format!("r-{i}").as_str()];
        assert_eq!(r["type"], "succeeded", "{r}");
        // The message as the Anthropic provider wrote it.
        assert_eq!(r["message"]["type"], "message", "{r}");
        assert_eq!(r["message"]["role"], "assistant", "{r}");
        let first = by_id[format!("r-{}", i % 5).as_str()];
        assert_eq!(r["message"]["content"], first["message"]["content"]);
        assert!(
            r["message"]["content"][0]["text"]
                .as_str()
                .unwrap()
                .contains(&format!("m{}", i % 5)),
            "{r}"
        );
    }
    let bad = by_id["bad"];
    assert_eq!(bad["type"], "errored", "{bad}");
    assert_eq!(bad["error"]["type"], "error");
    assert_eq!(bad["error"]["error"]["type"], "invalid_request_error");

    // An ended batch's cancel answers it as it is.
    let r = send(
        &app,
        ACME,
        reqwest::Method::POST,
        &format!("/v1/messages/batches/{id}/cancel"),
        None,
        &[],
    )
    .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap()["processing_status"],
        "ended"
    );

    // Another tenant, and the OpenAI face, see nothing of it.
    for path in [
        format!("/v1/messages/batches/{id}"),
        format!("/v1/messages/batches/{id}/results"),
    ] {
        let (status, v) = get(&app, BETA, &path).await;
        assert_eq!(status, 404, "{path}");
        assert_eq!(v["error"]["type"], "not_found_error", "{v}");
    }
    let r = send(
        &app,
        BETA,
        reqwest::Method::POST,
        &format!("/v1/messages/batches/{id}/cancel"),
        None,
        &[],
    )
    .await;
    assert_eq!(r.status(), 404);
    let (_, theirs) = get(&app, BETA, "/v1/messages/batches").await;
    assert_eq!(theirs["data"], json!([]));
    let (status, _) = app.get_json(ACME, &format!("/v1/batches/{id}")).await;
    assert_eq!(status, 404, "a Message Batch is not an OpenAI batch");
    let (_, openai) = app.get_json(ACME, "/v1/batches").await;
    assert_eq!(openai["data"], json!([]));
    let (_, mine) = get(&app, ACME, "/v1/messages/batches?limit=1").await;
    assert_eq!(mine["data"][0]["id"], id.as_str());
    assert_eq!(mine["has_more"], false);
    app.stop().await;
}

#[tokio::test]
async fn a_batch_is_refused_at_creation_as_anthropic_refuses_it() {
    let app = TestApp::with(anthropic_target()).await;
    let dup = [request("a", "x"), request("a", "y")];
    let v = assert_anthropic_error(
        create(&app, ACME, &dup, &[]).await,
        400,
        "invalid_request_error",
    )
    .await;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("duplicate custom_id"),
        "{v}"
    );
    let bad_id = [request("not ok!", "x")];
    assert_anthropic_error(
        create(&app, ACME, &bad_id, &[]).await,
        400,
        "invalid_request_error",
    )
    .await;
    assert_anthropic_error(
        create(&app, ACME, &[], &[]).await,
        400,
        "invalid_request_error",
    )
    .await;
    let r = send(
        &app,
        ACME,
        reqwest::Method::POST,
        "/v1/messages/batches",
        Some(&json!({"requests": [request("a", "x")], "other": 1})),
        &[],
    )
    .await;
    assert_anthropic_error(r, 400, "invalid_request_error").await;
    let r = send(
        &app,
        "sk-wrong",
        reqwest::Method::GET,
        "/v1/messages/batches",
        None,
        &[],
    )
    .await;
    assert_anthropic_error(r, 401, "authentication_error").await;
    let (status, v) = get(&app, ACME, "/v1/messages/batches/msgbatch_nope").await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(app.calls(), 0);
    app.stop().await;
}

#[tokio::test]
async fn a_cancel_keeps_the_requests_not_started_from_running_and_counts_them() {
    let app = TestApp::with(Spec {
        route: "batch = { concurrency = 2 }".into(),
        primary: idem::mock_upstream::Behaviour {
            hold: true,
            ..Default::default()
        },
        ..anthropic_target()
    })
    .await;
    let requests: Vec<Value> = (0..6)
        .map(|i| request(&format!("c-{i}"), &format!("c{i}")))
        .collect();
    let r = create(&app, ACME, &requests, &[]).await;
    assert_eq!(r.status(), 200);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    held(&app.mock, 2).await;
    let r = send(
        &app,
        ACME,
        reqwest::Method::POST,
        &format!("/v1/messages/batches/{id}/cancel"),
        None,
        &[],
    )
    .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["processing_status"], "canceling", "{v}");
    assert!(v["cancel_initiated_at"].is_string(), "{v}");
    release(&app.mock, None).await;
    let b = until_ended(&app, ACME, &id).await;
    assert_eq!(app.calls(), 2, "no request started after the cancel");
    assert_eq!(
        b["request_counts"],
        json!({"processing": 0, "succeeded": 2, "errored": 0, "canceled": 4, "expired": 0}),
        "{b}"
    );
    let lines = results(&app, ACME, &id).await;
    let mut kinds: Vec<&str> = lines
        .iter()
        .map(|l| l["result"]["type"].as_str().unwrap())
        .collect();
    kinds.sort_unstable();
    assert_eq!(
        kinds,
        [
            "canceled",
            "canceled",
            "canceled",
            "canceled",
            "succeeded",
            "succeeded"
        ]
    );
    app.stop().await;
}

#[tokio::test]
async fn a_batch_is_deleted_only_once_it_has_ended_and_its_files_go_with_it() {
    let app = TestApp::with(Spec {
        primary: idem::mock_upstream::Behaviour {
            hold: true,
            ..Default::default()
        },
        ..anthropic_target()
    })
    .await;
    let requests: Vec<Value> = (0..2)
        .map(|i| request(&format!("d-{i}"), &format!("d{i}")))
        .collect();
    let r = create(&app, ACME, &requests, &[]).await;
    assert_eq!(r.status(), 200);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = format!("/v1/messages/batches/{id}");
    let delete = |key: &'static str| send(&app, key, reqwest::Method::DELETE, &path, None, &[]);
    held(&app.mock, 2).await;
    // Still running: refused, as Anthropic refuses it.
    let v = assert_anthropic_error(delete(ACME).await, 400, "invalid_request_error").await;
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cancel it"),
        "{v}"
    );
    // Another tenant's: not found.
    assert_anthropic_error(delete(BETA).await, 404, "not_found_error").await;
    release(&app.mock, None).await;
    until_ended(&app, ACME, &id).await;
    assert_eq!(results(&app, ACME, &id).await.len(), 2);
    let files = |v: &Value| v["data"].as_array().map_or(0, Vec::len);
    let (_, listed) = app.get_json(ACME, "/v1/files").await;
    assert_eq!(files(&listed), 2, "its requests and its results: {listed}");

    let r = delete(ACME).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"id": id, "type": "message_batch_deleted"})
    );
    assert_eq!(get(&app, ACME, &path).await.0, 404);
    let gone = send(
        &app,
        ACME,
        reqwest::Method::GET,
        &format!("{path}/results"),
        None,
        &[],
    )
    .await;
    assert_anthropic_error(gone, 404, "not_found_error").await;
    assert_anthropic_error(delete(ACME).await, 404, "not_found_error").await;
    let (_, listed) = app.get_json(ACME, "/v1/files").await;
    assert_eq!(files(&listed), 0, "{listed}");
    app.stop().await;
}
