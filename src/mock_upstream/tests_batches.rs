//! The mock's Files and Batch endpoints: an upload, a batch whose lines are
//! answered as the chat endpoint would and counted as calls, its output and
//! error files, a held batch released or cancelled, a reset, and OpenAI's
//! errors.

use std::time::Duration;

use serde_json::{Value, json};

use super::tests::{SAFETY, chat, client, control, start};
use super::*;

const BOUNDARY: &str = "mock-batches-boundary-7MA4YWxkTrZu0gW";

/// A multipart form with these text fields and, if given, a file (its
/// name and bytes), built by hand.
fn form(fields: &[(&str, &str)], file: Option<(&str, &[u8])>) -> Vec<u8> {
    let mut body = Vec::new();
    for (name, value) in fields {
        body.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
            )
            .as_bytes(),
        );
    }
    if let Some((filename, bytes)) = file {
        body.extend_from_slice(
            format!(
                "--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; \
                 filename=\"{filename}\"\r\nContent-Type: application/jsonl\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{BOUNDARY}--\r\n").as_bytes());
    body
}

async fn post_form(client: &reqwest::Client, url: String, body: Vec<u8>) -> reqwest::Response {
    client
        .post(url)
        .header(
            "content-type",
            format!("multipart/form-data; boundary={BOUNDARY}"),
        )
        .body(body)
        .send()
        .await
        .unwrap()
}

/// Uploads `jsonl` with purpose `batch`; answers the file object.
async fn upload(client: &reqwest::Client, server: &MockServer, jsonl: &str) -> Value {
    let body = form(
        &[("purpose", "batch")],
        Some(("input.jsonl", jsonl.as_bytes())),
    );
    let response = post_form(client, format!("{}/files", server.base_url()), body).await;
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// A request line of an input file.
fn line(custom_id: &str, body: &Value) -> String {
    json!({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})
        .to_string()
}

async fn create(client: &reqwest::Client, server: &MockServer, body: &Value) -> reqwest::Response {
    client
        .post(format!("{}/batches", server.base_url()))
        .header("authorization", "Bearer sk-batch")
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Creates a batch of chat completions over `file_id`; answers its object.
async fn create_ok(client: &reqwest::Client, server: &MockServer, file_id: &str) -> Value {
    let body = json!({
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    });
    let response = create(client, server, &body).await;
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

async fn get(client: &reqwest::Client, url: String) -> reqwest::Response {
    client.get(url).send().await.unwrap()
}

async fn batch(client: &reqwest::Client, server: &MockServer, id: &str) -> Value {
    let response = get(client, format!("{}/batches/{id}", server.base_url())).await;
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

/// Polls batch `id` until its status is `status`.
async fn wait_for(client: &reqwest::Client, server: &MockServer, id: &str, status: &str) -> Value {
    let poll = async {
        loop {
            let batch = batch(client, server, id).await;
            if batch["status"] == status {
                return batch;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(SAFETY, poll)
        .await
        .unwrap_or_else(|_| panic!("batch {id} never became {status}"))
}

/// The lines of file `id`, as JSON.
async fn file_lines(client: &reqwest::Client, server: &MockServer, id: &Value) -> Vec<Value> {
    let id = id.as_str().unwrap();
    let response = get(client, format!("{}/files/{id}/content", server.base_url())).await;
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    assert!(text.ends_with('\n'));
    text.lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// An OpenAI error body naming `param`.
fn assert_openai_error(body: &Value, param: Option<&str>) {
    let error = &body["error"];
    assert!(error["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(error["type"], "invalid_request_error");
    assert_eq!(error["param"].as_str(), param);
    assert!(error.as_object().unwrap().contains_key("code"));
}

/// Batch `batch`'s request counts: total, completed, failed.
fn counts(batch: &Value) -> (u64, u64, u64) {
    let counts = &batch["request_counts"];
    let count = |key: &str| counts[key].as_u64().unwrap();
    (count("total"), count("completed"), count("failed"))
}

#[tokio::test]
async fn a_batch_answers_each_line_as_the_chat_endpoint_would_and_counts_it_as_a_call() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let jsonl = [
        line("a", &chat("alpha")),
        line("b", &chat("alpha")),
        line("c", &chat("beta")),
        line("d", &json!("not a chat request")),
    ]
    .join("\n")
        + "\n";

    let file = upload(&client, &server, &jsonl).await;
    assert_eq!(file["id"], "file-mock-1");
    assert_eq!(file["object"], "file");
    assert_eq!(file["bytes"], jsonl.len());
    assert_eq!(file["filename"], "input.jsonl");
    assert_eq!(file["purpose"], "batch");
    assert_eq!(file["status"], "processed");
    assert!(file["created_at"].as_u64().unwrap() > 1_600_000_000);
    let url = format!("{}/files/file-mock-1", server.base_url());
    let again: Value = get(&client, url).await.json().await.unwrap();
    assert_eq!(again, file);

    let body = json!({
        "input_file_id": "file-mock-1",
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": {"job": "nightly"},
    });
    let response = create(&client, &server, &body).await;
    assert_eq!(response.status(), 200);
    let created: Value = response.json().await.unwrap();
    assert_eq!(created["id"], "batch_mock_1");
    assert_eq!(created["object"], "batch");
    assert_eq!(created["endpoint"], "/v1/chat/completions");
    assert_eq!(created["status"], "validating");
    assert_eq!(created["input_file_id"], "file-mock-1");
    assert_eq!(created["completion_window"], "24h");
    assert_eq!(created["metadata"], json!({"job": "nightly"}));
    assert_eq!(created["errors"], Value::Null);
    assert_eq!(created["output_file_id"], Value::Null);
    assert_eq!(created["completed_at"], Value::Null);
    assert_eq!(counts(&created), (0, 0, 0));
    let created_at = created["created_at"].as_u64().unwrap();
    assert_eq!(created["expires_at"].as_u64(), Some(created_at + 86_400));

    let done = wait_for(&client, &server, "batch_mock_1", "completed").await;
    assert_eq!(counts(&done), (4, 3, 1));
    assert!(done["in_progress_at"].as_u64().unwrap() >= created_at);
    assert!(done["completed_at"].as_u64().unwrap() >= created_at);
    assert_eq!(done["metadata"], json!({"job": "nightly"}));

    // The output file: the three chat completions, in input order, each
    // the answer of its own call.
    let output = file_lines(&client, &server, &done["output_file_id"]).await;
    assert_eq!(output.len(), 3);
    let custom_ids: Vec<&str> = output
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap())
        .collect();
    assert_eq!(custom_ids, ["a", "b", "c"]);
    for (seq, (line, prompt)) in output.iter().zip(["alpha", "alpha", "beta"]).enumerate() {
        let seq = seq + 1;
        assert!(line["id"].as_str().unwrap().starts_with("batch_req_"));
        assert_eq!(line["error"], Value::Null);
        let response = &line["response"];
        assert_eq!(response["status_code"], 200);
        assert_eq!(response["request_id"], format!("req_mock_{seq}"));
        let completion = &response["body"];
        assert_eq!(completion["object"], "chat.completion");
        assert_eq!(completion["id"], format!("chatcmpl-mock-{seq}"));
        assert_eq!(completion["model"], "gpt-test");
        assert_eq!(
            completion["choices"][0]["message"]["content"],
            format!("mock answer #{seq} to: {prompt}")
        );
    }
    // The error file: the line whose body is no chat request, answered
    // 400 as the chat endpoint answers it.
    let errors = file_lines(&client, &server, &done["error_file_id"]).await;
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0]["custom_id"], "d");
    assert_eq!(errors[0]["error"], Value::Null);
    assert_eq!(errors[0]["response"]["status_code"], 400);
    assert_openai_error(&errors[0]["response"]["body"], None);

    // The files the batch made, and how their content is served.
    let output_id = done["output_file_id"].as_str().unwrap();
    let url = format!("{}/files/{output_id}", server.base_url());
    let output_file: Value = get(&client, url).await.json().await.unwrap();
    assert_eq!(output_file["purpose"], "batch_output");
    assert_eq!(output_file["filename"], "batch_mock_1_output.jsonl");
    let url = format!("{}/files/{output_id}/content", server.base_url());
    let response = get(&client, url).await;
    assert_eq!(
        response.headers()["content-type"],
        "application/octet-stream"
    );
    // The uploaded input is served back as it came.
    let url = format!("{}/files/file-mock-1/content", server.base_url());
    assert_eq!(get(&client, url).await.text().await.unwrap(), jsonl);

    // Every line answered is a call (the bad body too: the chat endpoint
    // counts it), in the call log with its prompt, and in `batch_lines`.
    let stats = server.stats();
    assert_eq!((stats.batches, stats.batch_lines), (1, 4));
    assert_eq!((stats.calls, stats.completed, stats.failed), (4, 3, 1));
    let calls = server.calls();
    let prompts: Vec<&str> = calls.iter().map(|c| c.prompt.as_str()).collect();
    assert_eq!(prompts, ["alpha", "alpha", "beta", ""]);
    assert!(calls.iter().all(|c| c.endpoint == Endpoint::BatchLine));
    let outcomes: Vec<CallOutcome> = calls.iter().map(|c| c.outcome).collect();
    let (completed, failed) = (CallOutcome::Completed, CallOutcome::Failed);
    assert_eq!(outcomes, [completed, completed, completed, failed]);
    let last = stats.last_requests.last().unwrap();
    assert_eq!(last.authorization.as_deref(), Some("Bearer sk-batch"));

    // A chat call goes on with the same numbering.
    let response = client
        .post(format!("{}/chat/completions", server.base_url()))
        .json(&chat("live"))
        .send()
        .await
        .unwrap();
    let answer: Value = response.json().await.unwrap();
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        "mock answer #5 to: live"
    );
    assert_eq!(server.stats().batch_lines, 4);

    // The list, newest first; and the same batch without the /v1 prefix.
    let list: Value = get(&client, format!("{}/batches", server.base_url()))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    assert_eq!(list["first_id"], "batch_mock_1");
    assert_eq!(list["has_more"], false);
    let url = format!("http://{}/batches/batch_mock_1", server.addr());
    let unprefixed: Value = get(&client, url).await.json().await.unwrap();
    assert_eq!(unprefixed, done);
    assert_eq!(server.batches(), vec![done]);
    server.shutdown().await;
}

#[tokio::test]
async fn lines_follow_the_behaviour_fail_status_and_content() {
    let server = start(Behaviour {
        fail_status: Some(429),
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let jsonl = [line("x", &chat("one")), line("y", &chat("two"))].join("\n");
    let file = upload(&client, &server, &jsonl).await;
    let id = create_ok(&client, &server, file["id"].as_str().unwrap()).await["id"].clone();
    let id = id.as_str().unwrap();
    let done = wait_for(&client, &server, id, "completed").await;
    assert_eq!(counts(&done), (2, 0, 2));
    assert_eq!(done["output_file_id"], Value::Null);
    let errors = file_lines(&client, &server, &done["error_file_id"]).await;
    for line in &errors {
        assert_eq!(line["response"]["status_code"], 429);
        assert_eq!(
            line["response"]["body"]["error"]["type"],
            "rate_limit_error"
        );
    }
    let stats = server.stats();
    assert_eq!((stats.batch_lines, stats.failed), (2, 2));

    server.set_behaviour(Behaviour {
        content: Some("fixed".into()),
        ..Behaviour::default()
    });
    let file = upload(&client, &server, &line("z", &chat("three"))).await;
    let id = create_ok(&client, &server, file["id"].as_str().unwrap()).await["id"].clone();
    let done = wait_for(&client, &server, id.as_str().unwrap(), "completed").await;
    assert_eq!(done["error_file_id"], Value::Null);
    let output = file_lines(&client, &server, &done["output_file_id"]).await;
    assert_eq!(
        output[0]["response"]["body"]["choices"][0]["message"]["content"],
        "fixed"
    );
    assert_eq!(server.stats().batches, 2);
    server.shutdown().await;
}

#[tokio::test]
async fn a_batch_created_while_holding_stays_in_progress_until_released() {
    let server = start(Behaviour {
        hold: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let jsonl = [line("a", &chat("held one")), line("b", &chat("held two"))].join("\n");
    let file = upload(&client, &server, &jsonl).await;
    create_ok(&client, &server, file["id"].as_str().unwrap()).await;
    let held = wait_for(&client, &server, "batch_mock_1", "in_progress").await;
    assert_eq!(counts(&held), (2, 0, 0));
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = batch(&client, &server, "batch_mock_1").await;
        assert_eq!(now["status"], "in_progress");
        assert_eq!(counts(&now), (2, 0, 0));
    }
    let stats = server.stats();
    assert_eq!((stats.batches, stats.batch_lines, stats.calls), (1, 0, 0));
    assert!(server.calls().is_empty());

    // A release of one request by seq leaves the batch held; a release of
    // everything lets it run (its lines are not held one by one).
    let released = control(&client, &server, "release", json!({"seq": 7})).await;
    assert_eq!(released["released_batches"], json!([]));
    let released = control(&client, &server, "release", json!({})).await;
    assert_eq!(released["released_batches"], json!(["batch_mock_1"]));
    let done = wait_for(&client, &server, "batch_mock_1", "completed").await;
    assert_eq!(counts(&done), (2, 2, 0));
    let stats = server.stats();
    assert_eq!((stats.batch_lines, stats.calls, stats.held), (2, 2, 0));
    let prompts: Vec<String> = server.calls().into_iter().map(|c| c.prompt).collect();
    assert_eq!(prompts, ["held one", "held two"]);

    // A release naming the batch, with a content for its lines.
    let file = upload(&client, &server, &line("c", &chat("named"))).await;
    create_ok(&client, &server, file["id"].as_str().unwrap()).await;
    wait_for(&client, &server, "batch_mock_2", "in_progress").await;
    let body = json!({"batch": "batch_mock_2", "content": "chosen"});
    let released = control(&client, &server, "release", body).await;
    assert_eq!(released["released_batches"], json!(["batch_mock_2"]));
    assert_eq!(released["released"], json!([]));
    let done = wait_for(&client, &server, "batch_mock_2", "completed").await;
    let output = file_lines(&client, &server, &done["output_file_id"]).await;
    assert_eq!(
        output[0]["response"]["body"]["choices"][0]["message"]["content"],
        "chosen"
    );
    server.shutdown().await;
}

#[tokio::test]
async fn a_held_batch_cancelled_runs_no_line() {
    let server = start(Behaviour {
        hold: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let file = upload(&client, &server, &line("a", &chat("never"))).await;
    create_ok(&client, &server, file["id"].as_str().unwrap()).await;
    wait_for(&client, &server, "batch_mock_1", "in_progress").await;
    let url = format!("{}/batches/batch_mock_1/cancel", server.base_url());
    let response = client.post(&url).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let cancelling: Value = response.json().await.unwrap();
    assert!(["cancelling", "cancelled"].contains(&cancelling["status"].as_str().unwrap()));
    assert!(cancelling["cancelling_at"].as_u64().is_some());
    let cancelled = wait_for(&client, &server, "batch_mock_1", "cancelled").await;
    assert_eq!(counts(&cancelled), (1, 0, 0));
    assert_eq!(cancelled["output_file_id"], Value::Null);
    assert_eq!(cancelled["error_file_id"], Value::Null);
    assert!(cancelled["cancelled_at"].as_u64().is_some());
    assert_eq!(server.stats().calls, 0);
    // Nothing left to release; an ended batch cannot be cancelled.
    let released = control(&client, &server, "release", json!({})).await;
    assert_eq!(released["released_batches"], json!([]));
    let response = client.post(&url).send().await.unwrap();
    assert_eq!(response.status(), 409);
    assert_openai_error(&response.json().await.unwrap(), None);
    server.shutdown().await;
}

#[tokio::test]
async fn a_reset_forgets_files_and_batches_and_never_reuses_their_ids() {
    let server = start(Behaviour {
        hold: true,
        ..Behaviour::default()
    })
    .await;
    let client = client();
    let file = upload(&client, &server, &line("a", &chat("forgotten"))).await;
    create_ok(&client, &server, file["id"].as_str().unwrap()).await;
    wait_for(&client, &server, "batch_mock_1", "in_progress").await;

    let stats: Stats =
        serde_json::from_value(control(&client, &server, "reset", json!({})).await).unwrap();
    assert_eq!((stats.batches, stats.batch_lines, stats.calls), (0, 0, 0));
    let url = format!("{}/batches/batch_mock_1", server.base_url());
    assert_eq!(get(&client, url).await.status(), 404);
    let url = format!("{}/files/file-mock-1/content", server.base_url());
    assert_eq!(get(&client, url).await.status(), 404);
    assert!(server.batches().is_empty());

    // The forgotten batch's task ran nothing; new ids go on from the old.
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.stats().calls, 0);
    let file = upload(&client, &server, &line("b", &chat("new"))).await;
    assert_eq!(file["id"], "file-mock-2");
    let created = create_ok(&client, &server, "file-mock-2").await;
    assert_eq!(created["id"], "batch_mock_2");
    // The start behaviour (hold) is back: the new batch waits too.
    wait_for(&client, &server, "batch_mock_2", "in_progress").await;
    control(&client, &server, "release", json!({})).await;
    wait_for(&client, &server, "batch_mock_2", "completed").await;
    let stats = server.stats();
    assert_eq!((stats.batches, stats.batch_lines), (1, 1));
    server.shutdown().await;
}

#[tokio::test]
async fn unreadable_lines_go_to_the_error_file_and_invalid_files_fail_the_batch() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let jsonl = [
        line("ok", &chat("fine")),
        "not json".to_owned(),
        json!({"method": "POST", "url": "/v1/chat/completions", "body": chat("x")}).to_string(),
        json!({"custom_id": "wrong-url", "method": "POST", "url": "/v1/embeddings", "body": {}})
            .to_string(),
        String::new(),
    ]
    .join("\r\n");
    let file = upload(&client, &server, &jsonl).await;
    let id = create_ok(&client, &server, file["id"].as_str().unwrap()).await["id"].clone();
    let done = wait_for(&client, &server, id.as_str().unwrap(), "completed").await;
    assert_eq!(counts(&done), (4, 1, 3));
    let errors = file_lines(&client, &server, &done["error_file_id"]).await;
    let codes: Vec<&str> = errors
        .iter()
        .map(|l| l["error"]["code"].as_str().unwrap())
        .collect();
    assert_eq!(codes, ["invalid_json", "missing_custom_id", "invalid_url"]);
    assert!(errors.iter().all(|l| l["response"].is_null()));
    assert_eq!(errors[2]["custom_id"], "wrong-url");
    // Only the request line was a call.
    let stats = server.stats();
    assert_eq!((stats.calls, stats.batch_lines), (1, 1));

    // An empty file and a custom_id used twice fail the batch, no line run.
    let file = upload(&client, &server, "\n").await;
    let id = create_ok(&client, &server, file["id"].as_str().unwrap()).await["id"].clone();
    let failed = wait_for(&client, &server, id.as_str().unwrap(), "failed").await;
    assert_eq!(failed["errors"]["data"][0]["code"], "empty_file");
    assert!(failed["failed_at"].as_u64().is_some());
    let jsonl = [line("same", &chat("1")), line("same", &chat("2"))].join("\n");
    let file = upload(&client, &server, &jsonl).await;
    let id = create_ok(&client, &server, file["id"].as_str().unwrap()).await["id"].clone();
    let failed = wait_for(&client, &server, id.as_str().unwrap(), "failed").await;
    let error = &failed["errors"]["data"][0];
    assert_eq!(error["code"], "duplicate_custom_id");
    assert_eq!(error["line"], 2);
    assert_eq!(failed["output_file_id"], Value::Null);
    let stats = server.stats();
    assert_eq!((stats.calls, stats.batches), (1, 3));
    server.shutdown().await;
}

#[tokio::test]
async fn refusals_are_openai_errors() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let base = server.base_url();

    // Unknown file and batch: 404.
    for (url, param) in [
        (format!("{base}/files/file-nope/content"), "id"),
        (format!("{base}/files/file-nope"), "id"),
        (format!("{base}/batches/batch_nope"), "batch_id"),
    ] {
        let response = get(&client, url).await;
        assert_eq!(response.status(), 404);
        assert_openai_error(&response.json().await.unwrap(), Some(param));
    }
    let response = client
        .post(format!("{base}/batches/batch_nope/cancel"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);

    // Uploads: another purpose, no purpose, no file, no form at all.
    let jsonl = line("a", &chat("a"));
    let file = Some(("in.jsonl", jsonl.as_bytes()));
    for (body, param) in [
        (form(&[("purpose", "fine-tune")], file), "purpose"),
        (form(&[], file), "purpose"),
        (form(&[("purpose", "batch")], None), "file"),
    ] {
        let response = post_form(&client, format!("{base}/files"), body).await;
        assert_eq!(response.status(), 400);
        assert_openai_error(&response.json().await.unwrap(), Some(param));
    }
    let response = client
        .post(format!("{base}/files"))
        .json(&json!({"purpose": "batch"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    assert_openai_error(&response.json().await.unwrap(), Some("file"));

    // Batches: an unknown input file, another endpoint or window, a
    // missing field, an output file as input.
    let file = upload(&client, &server, &jsonl).await;
    let file_id = file["id"].as_str().unwrap();
    let good = json!({
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    });
    let with = |key: &str, value: Value| {
        let mut body = good.clone();
        body[key] = value;
        body
    };
    let mut without_endpoint = good.clone();
    without_endpoint.as_object_mut().unwrap().remove("endpoint");
    for (body, param) in [
        (with("input_file_id", json!("file-nope")), "input_file_id"),
        (with("endpoint", json!("/v1/embeddings")), "endpoint"),
        (with("completion_window", json!("1h")), "completion_window"),
        (with("metadata", json!("text")), "metadata"),
        (without_endpoint, "endpoint"),
    ] {
        let response = create(&client, &server, &body).await;
        assert_eq!(response.status(), 400, "{body}");
        assert_openai_error(&response.json().await.unwrap(), Some(param));
    }
    let done = create_ok(&client, &server, file_id).await;
    let done = wait_for(&client, &server, done["id"].as_str().unwrap(), "completed").await;
    let output_as_input = with("input_file_id", done["output_file_id"].clone());
    let response = create(&client, &server, &output_as_input).await;
    assert_eq!(response.status(), 400);
    assert_openai_error(&response.json().await.unwrap(), Some("input_file_id"));
    assert_eq!(server.stats().batches, 1);

    // A deleted file is gone; the batch made from it is not.
    let url = format!("{base}/files/{file_id}");
    let deleted: Value = client
        .delete(&url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        deleted,
        json!({"id": file_id, "object": "file", "deleted": true})
    );
    assert_eq!(client.delete(&url).send().await.unwrap().status(), 404);
    assert_eq!(get(&client, url).await.status(), 404);
    batch(&client, &server, done["id"].as_str().unwrap()).await;
    server.shutdown().await;
}
