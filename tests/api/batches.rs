//! The Batch API against the real gateway, store and a mock provider:
//! every line answered with its own custom_id, one upstream call per
//! distinct line (within a batch and across a tenant's batches), a batch
//! created again with its Idempotency-Key is the same batch, validation
//! fails a batch with OpenAI's errors, a cancel lets the lines in flight
//! finish and runs no other, lines leave live jobs their workers and keep
//! their route's rate, another tenant sees nothing, and a batch
//! whose process was SIGKILLed resumes after a restart, no line called
//! twice.

use std::collections::HashMap;
use std::time::Duration;

use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::files::upload;
use crate::helpers::*;

/// A batch input line asking route `bot` for `prompt`.
fn line(custom_id: &str, prompt: &str) -> String {
    json!({
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "bot", "messages": [{"role": "user", "content": prompt}]},
    })
    .to_string()
}

/// Uploads `lines` as a batch input file of tenant `key`: its id.
async fn input(app: &TestApp, key: &str, lines: &[String]) -> String {
    let content = lines.join("\n") + "\n";
    let resp = upload(
        app,
        key,
        &[
            ("purpose", None, b"batch"),
            ("file", Some("input.jsonl"), content.as_bytes()),
        ],
    )
    .await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    v["id"].as_str().unwrap().to_owned()
}

async fn create(
    app: &TestApp,
    key: &str,
    file: &str,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    app.post_json(
        key,
        "/v1/batches",
        &json!({"input_file_id": file, "endpoint": "/v1/chat/completions", "completion_window": "24h"}),
        headers,
    )
    .await
}

async fn created(app: &TestApp, key: &str, file: &str) -> String {
    let resp = create(app, key, file, &[]).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "batch");
    assert_eq!(v["status"], "validating");
    v["id"].as_str().unwrap().to_owned()
}

/// Runs `lines` as a batch of tenant ACME to its end: the batch.
async fn ran(app: &TestApp, lines: &[String]) -> Value {
    let file = input(app, ACME, lines).await;
    let id = created(app, ACME, &file).await;
    until_status(
        app,
        ACME,
        &id,
        &["completed", "failed", "cancelled", "expired"],
    )
    .await
}

/// Polls the batch until its status is one of `ended`; returns it.
async fn until_status(app: &TestApp, key: &str, id: &str, ended: &[&str]) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (status, v) = app.get_json(key, &format!("/v1/batches/{id}")).await;
        assert_eq!(status, 200, "{v}");
        if ended.iter().any(|s| v["status"] == *s) {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "batch {id} not in {ended:?} within 60 s: {v}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A file's lines, as JSON.
async fn file_lines(app: &TestApp, key: &str, id: &str) -> Vec<Value> {
    let r = app
        .client
        .get(app.url(&format!("/v1/files/{id}/content")))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.text()
        .await
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The answer text of each output line, by custom_id.
fn answers(lines: &[Value]) -> HashMap<String, String> {
    let mut by_id = HashMap::new();
    for l in lines {
        assert_eq!(l["response"]["status_code"], 200, "{l}");
        assert_eq!(l["error"], Value::Null);
        let id = l["custom_id"].as_str().unwrap().to_owned();
        let text = content_of(&l["response"]["body"]);
        assert!(by_id.insert(id, text).is_none(), "one line per custom_id");
    }
    by_id
}

#[tokio::test]
async fn each_distinct_line_is_one_call_within_a_batch_and_across_batches() {
    let app = TestApp::spawn().await;
    // 12 distinct prompts, then 8 lines repeating the first 8.
    let mut lines: Vec<String> = (0..12)
        .map(|i| line(&format!("a-{i}"), &format!("p{i}")))
        .collect();
    lines.extend((0..8).map(|i| line(&format!("dup-{i}"), &format!("p{i}"))));
    let file = input(&app, ACME, &lines).await;
    let id = created(&app, ACME, &file).await;
    let b = until_status(&app, ACME, &id, &["completed", "failed"]).await;
    assert_eq!(b["status"], "completed", "{b}");
    assert_eq!(app.calls(), 12, "one upstream call per distinct line");
    assert_eq!(
        b["request_counts"],
        json!({"total": 20, "completed": 20, "failed": 0})
    );
    assert_eq!(b["idem"]["deduplicated"], 8);
    assert_eq!(b["idem"]["reused"], 0);
    assert_eq!(b["error_file_id"], Value::Null);
    let out = file_lines(&app, ACME, b["output_file_id"].as_str().unwrap()).await;
    assert_eq!(out.len(), 20);
    let by_id = answers(&out);
    for i in 0..12 {
        let text = &by_id[&format!("a-{i}")];
        assert!(text.ends_with(&format!("to: p{i}")), "{text}");
    }
    for i in 0..8 {
        assert_eq!(
            by_id[&format!("dup-{i}")],
            by_id[&format!("a-{i}")],
            "the same call's answer"
        );
    }

    // A later batch: three lines asked before, two new ones.
    let again: Vec<String> = (0..3)
        .map(|i| line(&format!("b-{i}"), &format!("p{i}")))
        .chain((0..2).map(|i| line(&format!("new-{i}"), &format!("q{i}"))))
        .collect();
    let file2 = input(&app, ACME, &again).await;
    let key = [("Idempotency-Key", "nightly-2026-12-05")];
    let resp = create(&app, ACME, &file2, &key).await;
    assert_eq!(resp.status(), 200);
    let id2 = resp.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let b2 = until_status(&app, ACME, &id2, &["completed", "failed"]).await;
    assert_eq!(b2["status"], "completed", "{b2}");
    assert_eq!(app.calls(), 14, "only the new lines were sent");
    assert_eq!(b2["idem"]["reused"], 3);
    let by_id2 = answers(&file_lines(&app, ACME, b2["output_file_id"].as_str().unwrap()).await);
    for i in 0..3 {
        assert_eq!(by_id2[&format!("b-{i}")], by_id[&format!("a-{i}")]);
    }

    // The same key again: the same batch, nothing run again; with another
    // request: 409.
    let resp = create(&app, ACME, &file2, &key).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(
        resp.headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    assert_eq!(resp.json::<Value>().await.unwrap()["id"], id2.as_str());
    assert_error(
        create(&app, ACME, &file, &key).await,
        409,
        "idempotency_key_reused",
    )
    .await;
    assert_eq!(app.calls(), 14);

    // Listed newest first, paged; another tenant sees none of it.
    let (_, list) = app.get_json(ACME, "/v1/batches?limit=1").await;
    assert_eq!(list["data"][0]["id"], id2.as_str());
    assert_eq!(list["has_more"], true);
    let (_, rest) = app
        .get_json(ACME, &format!("/v1/batches?after={id2}"))
        .await;
    assert_eq!(rest["data"][0]["id"], id.as_str());
    assert_eq!(rest["has_more"], false);
    let (status, _) = app.get_json(BETA, &format!("/v1/batches/{id}")).await;
    assert_eq!(status, 404);
    let (_, theirs) = app.get_json(BETA, "/v1/batches").await;
    assert_eq!(theirs["data"], json!([]));
    assert_error(create(&app, BETA, &file, &[]).await, 400, "invalid_value").await;
    let cancel = app
        .post_json(BETA, &format!("/v1/batches/{id}/cancel"), &json!({}), &[])
        .await;
    assert_eq!(cancel.status(), 404);
    // A live request for a line's prompt is answered by the cache, not by
    // another call; a completed batch cannot be cancelled.
    let cancel = app
        .post_json(ACME, &format!("/v1/batches/{id}/cancel"), &json!({}), &[])
        .await;
    assert_error(cancel, 409, "batch_not_cancellable").await;
    app.stop().await;
}

#[tokio::test]
async fn a_batch_with_bad_lines_fails_validation_and_a_bad_body_is_its_lines_error() {
    let app = TestApp::spawn().await;
    let lines = vec![
        line("x", "fine"),
        line("x", "same custom_id"),
        "not json".to_owned(),
        json!({"custom_id": "u", "method": "POST", "url": "/v1/embeddings", "body": {"model": "bot"}}).to_string(),
        json!({"custom_id": "m", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}})
        .to_string(),
        json!({"custom_id": "g", "method": "GET", "url": "/v1/chat/completions",
               "body": {"model": "bot", "messages": [{"role": "user", "content": "hi"}]}})
        .to_string(),
        json!({"method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "bot", "messages": [{"role": "user", "content": "hi"}]}})
        .to_string(),
    ];
    let file = input(&app, ACME, &lines).await;
    let id = created(&app, ACME, &file).await;
    let b = until_status(&app, ACME, &id, &["failed", "completed"]).await;
    assert_eq!(b["status"], "failed", "{b}");
    assert!(b["failed_at"].is_u64());
    let errors: Vec<(String, u64)> = b["errors"]["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["code"].as_str().unwrap().to_owned(),
                e["line"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        errors,
        [
            ("duplicate_custom_id".to_owned(), 2),
            ("invalid_json_line".to_owned(), 3),
            ("mismatched_endpoint".to_owned(), 4),
            ("model_not_found".to_owned(), 5),
            ("invalid_method".to_owned(), 6),
            ("missing_required_parameter".to_owned(), 7),
        ]
    );
    assert_eq!(app.calls(), 0);
    // Endpoints a batch does not run: refused at creation.
    for endpoint in [
        "/v1/messages",
        "/v1/completions",
        "/v1/audio/transcriptions",
    ] {
        let r = app
            .post_json(
                ACME,
                "/v1/batches",
                &json!({"input_file_id": file, "endpoint": endpoint, "completion_window": "24h"}),
                &[],
            )
            .await;
        let v = assert_error(r, 400, "invalid_value").await;
        assert_eq!(v["error"]["param"], "endpoint", "{v}");
    }

    // A body its face would refuse is that line's error, not the batch's.
    let lines = vec![
        line("ok", "fine"),
        json!({"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "bot", "messages": "not an array"}})
        .to_string(),
    ];
    let b = ran(&app, &lines).await;
    assert_eq!(b["status"], "completed", "{b}");
    assert_eq!(
        b["request_counts"],
        json!({"total": 2, "completed": 1, "failed": 1})
    );
    let errors = file_lines(&app, ACME, b["error_file_id"].as_str().unwrap()).await;
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0]["custom_id"], "bad");
    assert_eq!(errors[0]["response"]["status_code"], 400);
    assert_eq!(errors[0]["response"]["body"]["error"]["param"], "messages");
    assert_eq!(app.calls(), 1);
    app.stop().await;
}

#[tokio::test]
async fn a_file_over_the_line_limit_fails_validation() {
    let app = TestApp::with(Spec {
        extra: "[batches]\nmax_lines = 3\n".into(),
        ..Spec::default()
    })
    .await;
    let lines: Vec<String> = (0..4)
        .map(|i| line(&format!("l-{i}"), &format!("l{i}")))
        .collect();
    let b = ran(&app, &lines).await;
    assert_eq!(b["status"], "failed", "{b}");
    let e = &b["errors"]["data"][0];
    assert_eq!(
        (e["code"].as_str(), e["line"].as_u64()),
        (Some("too_many_lines"), Some(4)),
        "{b}"
    );
    assert_eq!(app.calls(), 0);
    app.stop().await;
}

#[tokio::test]
async fn a_cancel_lets_the_lines_in_flight_finish_and_runs_no_other() {
    let app = TestApp::with(Spec {
        route: "batch = { concurrency = 2 }".into(),
        ..holding()
    })
    .await;
    let lines: Vec<String> = (0..6)
        .map(|i| line(&format!("c-{i}"), &format!("c{i}")))
        .collect();
    let file = input(&app, ACME, &lines).await;
    let id = created(&app, ACME, &file).await;
    // Two lines reach the provider (the route's batch concurrency) and are
    // held there.
    held(&app.mock, 2).await;
    let cancel = app
        .post_json(ACME, &format!("/v1/batches/{id}/cancel"), &json!({}), &[])
        .await;
    assert_eq!(cancel.status(), 200);
    let v: Value = cancel.json().await.unwrap();
    assert_eq!(v["status"], "cancelling");
    assert!(v["cancelling_at"].is_u64());
    release(&app.mock, None).await;
    let b = until_status(&app, ACME, &id, &["cancelled", "completed"]).await;
    assert_eq!(b["status"], "cancelled", "{b}");
    assert_eq!(app.calls(), 2, "no line started after the cancel");
    assert_eq!(
        b["request_counts"],
        json!({"total": 6, "completed": 2, "failed": 4})
    );
    assert_eq!(
        file_lines(&app, ACME, b["output_file_id"].as_str().unwrap())
            .await
            .len(),
        2
    );
    let errors = file_lines(&app, ACME, b["error_file_id"].as_str().unwrap()).await;
    assert_eq!(errors.len(), 4);
    assert!(
        errors
            .iter()
            .all(|e| e["error"]["code"] == "batch_cancelled"),
        "{errors:?}"
    );
    app.stop().await;
}

#[tokio::test]
async fn an_embeddings_batch_sends_each_item_once_and_answers_live_requests_from_its_cache() {
    let app = TestApp::with(Spec {
        // One line at a time: an item a later line repeats is in the
        // result cache by then.
        route: "endpoints = [\"chat\", \"embeddings\"]\nbatch = { concurrency = 1 }".into(),
        ..Spec::default()
    })
    .await;
    let embed_line = |id: &str, input: Value| {
        json!({
            "custom_id": id,
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "bot", "input": input},
        })
        .to_string()
    };
    let inputs = [
        json!(["alpha", "beta"]),
        json!("gamma"),
        json!(["alpha", "beta"]),
        json!(["beta", "delta"]),
    ];
    let lines: Vec<String> = inputs
        .iter()
        .enumerate()
        .map(|(i, input)| embed_line(&format!("e-{i}"), input.clone()))
        .collect();
    let file = input(&app, ACME, &lines).await;
    let resp = app
        .post_json(
            ACME,
            "/v1/batches",
            &json!({"input_file_id": file, "endpoint": "/v1/embeddings", "completion_window": "24h"}),
            &[],
        )
        .await;
    assert_eq!(resp.status(), 200);
    let id = resp.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let b = until_status(&app, ACME, &id, &["completed", "failed"]).await;
    assert_eq!(
        b["request_counts"],
        json!({"total": 4, "completed": 4, "failed": 0}),
        "{b}"
    );
    assert_eq!(b["idem"]["deduplicated"], 1, "e-2 repeats e-0: {b}");
    // alpha, beta, gamma, delta: each item sent once (e-3's beta is e-0's).
    assert_eq!(app.mock.stats().embedding_items, 4);
    let out = file_lines(&app, ACME, b["output_file_id"].as_str().unwrap()).await;
    let by_id: HashMap<String, Value> = out
        .iter()
        .map(|l| {
            assert_eq!(l["response"]["status_code"], 200, "{l}");
            (
                l["custom_id"].as_str().unwrap().to_owned(),
                l["response"]["body"].clone(),
            )
        })
        .collect();
    for (i, input) in inputs.iter().enumerate() {
        let body = &by_id[&format!("e-{i}")];
        assert_eq!(body["object"], "list", "{body}");
        let items: Vec<Value> = match input {
            Value::Array(xs) => xs.clone(),
            one => vec![one.clone()],
        };
        crate::embeddings::assert_vectors(body, &items, 8);
    }
    // A live request for an item a line sent: answered from the cache.
    let live =
        crate::embeddings::embed(&app, ACME, &json!({"model": "bot", "input": "gamma"})).await;
    assert_eq!((live.status, live.outcome.as_str()), (200, "cache-hit"));
    assert_eq!(app.mock.stats().embedding_items, 4);
    app.stop().await;
}

#[tokio::test]
async fn with_a_files_dir_the_files_are_in_it_and_a_batch_runs_the_same() {
    let dir = std::env::temp_dir().join(format!("idem-files-{}", uuid::Uuid::now_v7().simple()));
    let app = TestApp::with(Spec {
        extra: format!("[batches]\nfiles_dir = {:?}\n", dir.display().to_string()),
        ..Spec::default()
    })
    .await;
    let lines: Vec<String> = (0..3)
        .map(|i| line(&format!("f-{i}"), &format!("f{}", i % 2)))
        .collect();
    let file = input(&app, ACME, &lines).await;
    assert!(
        dir.join(&file).join("0").is_file(),
        "the input's part is a file of the directory"
    );
    let id = created(&app, ACME, &file).await;
    let b = until_status(&app, ACME, &id, &["completed", "failed"]).await;
    assert_eq!(b["request_counts"]["completed"], 3, "{b}");
    assert_eq!(app.calls(), 2);
    let out_id = b["output_file_id"].as_str().unwrap();
    assert!(dir.join(out_id).is_dir());
    assert_eq!(answers(&file_lines(&app, ACME, out_id).await).len(), 3);
    let r = app
        .client
        .delete(app.url(&format!("/v1/files/{out_id}")))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(!dir.join(out_id).exists(), "deleted with its row");
    app.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// The `q`-quantile of `ms`, sorted in place.
fn quantile(ms: &mut [f64], q: f64) -> f64 {
    ms.sort_by(f64::total_cmp);
    let i = ((ms.len() as f64 - 1.0) * q).round() as usize;
    ms[i]
}

/// `n` live chats, one after another, each a prompt of its own: their
/// latencies in milliseconds.
async fn live_chats(app: &TestApp, tag: &str, n: usize) -> Vec<f64> {
    let mut ms = Vec::with_capacity(n);
    for i in 0..n {
        let started = std::time::Instant::now();
        let r = app.chat(ACME, &chat_body(&format!("{tag}-{i}"))).await;
        assert_eq!(r.status(), 200);
        ms.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    ms
}

fn chat_body(prompt: &str) -> Value {
    json!({"model": "bot", "messages": [{"role": "user", "content": prompt}]})
}

#[tokio::test]
async fn a_batch_leaves_live_jobs_their_workers_and_live_chats_go_by() {
    let app = TestApp::with(Spec {
        jobs: "reconcile_interval = \"200ms\"\npoll_interval = \"200ms\"\nworkers = 4\n".into(),
        extra: "[batches]\nworkers = 2\n".into(),
        ..Spec::default()
    })
    .await;
    let mut before = live_chats(&app, "before", 50).await;

    // Every call is held from here: six lines, the route's concurrency (8)
    // would start them all, but lines hold at most two of the four workers.
    app.mock.set_behaviour(Behaviour {
        hold: true,
        ..Behaviour::default()
    });
    let lines: Vec<String> = (0..6)
        .map(|i| line(&format!("w-{i}"), &format!("w{i}")))
        .collect();
    let file = input(&app, ACME, &lines).await;
    let id = created(&app, ACME, &file).await;
    held(&app.mock, 2).await;
    // A live job, created after the four waiting lines, is claimed before
    // them into a worker kept for it: it is the third call held.
    let live_job = {
        let (client, url) = (app.client.clone(), app.url("/v1/chat/completions"));
        tokio::spawn(async move {
            client
                .post(url)
                .bearer_auth(ACME)
                .header("Idempotency-Key", "live-1")
                .json(&chat_body("live job"))
                .send()
                .await
                .unwrap()
        })
    };
    held(&app.mock, 3).await;
    let held_prompts: Vec<String> = app.mock.calls().into_iter().map(|c| c.prompt).collect();
    assert!(
        held_prompts.iter().any(|p| p == "live job"),
        "the live job was not called while the batch waited: {held_prompts:?}"
    );
    assert_eq!(
        held_prompts.iter().filter(|p| p.starts_with('w')).count(),
        2,
        "batch lines hold at most batches.workers: {held_prompts:?}"
    );

    // Live chats while the batch holds its workers (new calls answer).
    app.mock.set_behaviour(Behaviour::default());
    let mut during = live_chats(&app, "during", 50).await;
    let (p99_before, p99_during) = (quantile(&mut before, 0.99), quantile(&mut during, 0.99));
    eprintln!(
        "live chats p99: {p99_before:.2} ms before the batch, {p99_during:.2} ms while it runs \
         (added {:+.2} ms)",
        p99_during - p99_before
    );
    let (_, b) = app.get_json(ACME, &format!("/v1/batches/{id}")).await;
    assert_eq!(b["status"], "in_progress", "the batch ran meanwhile: {b}");

    release(&app.mock, None).await;
    assert_eq!(live_job.await.unwrap().status(), 200);
    let b = until_status(&app, ACME, &id, &["completed", "failed"]).await;
    assert_eq!(
        b["request_counts"],
        json!({"total": 6, "completed": 6, "failed": 0})
    );
    assert_eq!(app.calls(), 50 + 50 + 6 + 1);
    app.stop().await;
}

#[tokio::test]
async fn a_routes_batch_rate_spaces_its_lines() {
    let app = TestApp::with(Spec {
        route: "batch = { concurrency = 16, rate = 5 }".into(),
        ..Spec::default()
    })
    .await;
    let lines: Vec<String> = (0..10)
        .map(|i| line(&format!("r-{i}"), &format!("r{i}")))
        .collect();
    let b = ran(&app, &lines).await;
    assert_eq!(b["request_counts"]["completed"], 10, "{b}");
    // Five at once (the burst), then one every 200 ms: the last call
    // comes at least a second after the first.
    let at: Vec<i64> = app.mock.calls().iter().map(|c| c.at_ms).collect();
    assert_eq!(at.len(), 10);
    let spread = at.iter().max().unwrap() - at.iter().min().unwrap();
    assert!(
        spread >= 900,
        "10 lines at 5 a second came within {spread} ms"
    );
    app.stop().await;
}

/// `POST path` on a gateway process with tenant key `key`.
async fn proc_post(proc: &Proc, path: &str, body: reqwest::Body, ctype: &str) -> Value {
    let r = client()
        .post(format!("{}{path}", proc.base))
        .bearer_auth(ACME)
        .header("content-type", ctype)
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn proc_get(proc: &Proc, path: &str) -> reqwest::Response {
    client()
        .get(format!("{}{path}", proc.base))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap()
}

/// Six distinct prompts `<tag>0..5` (lines `a-0..5`), then three lines
/// (`dup-0..2`) repeating the first three: uploaded and made a batch on
/// `proc`. Returns the batch's id.
async fn proc_batch(proc: &Proc, tag: &str) -> String {
    let mut lines: Vec<String> = (0..6)
        .map(|i| line(&format!("a-{i}"), &format!("{tag}{i}")))
        .collect();
    lines.extend((0..3).map(|i| line(&format!("dup-{i}"), &format!("{tag}{i}"))));
    let content = lines.join("\n") + "\n";
    let form = crate::files::form(&[
        ("purpose", None, b"batch"),
        ("file", Some("input.jsonl"), content.as_bytes()),
    ]);
    let ctype = format!("multipart/form-data; boundary={}", crate::files::BOUNDARY);
    let file = proc_post(proc, "/v1/files", form.into(), &ctype).await;
    let body = json!({"input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                      "completion_window": "24h"});
    let batch = proc_post(
        proc,
        "/v1/batches",
        body.to_string().into(),
        "application/json",
    )
    .await;
    batch["id"].as_str().unwrap().to_owned()
}

/// Polls the batch on `proc` until it is completed, within `limit`.
async fn proc_completed(proc: &Proc, id: &str, limit: Duration) -> Value {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let b: Value = proc_get(proc, &format!("/v1/batches/{id}"))
            .await
            .json()
            .await
            .unwrap();
        if b["status"] == "completed" {
            return b;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the batch did not complete within {limit:?}: {b}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The lines of the batch's output and error files (none for a file the
/// batch does not have).
async fn proc_files(proc: &Proc, b: &Value) -> (Vec<Value>, Vec<Value>) {
    let mut read = Vec::new();
    for which in ["output_file_id", "error_file_id"] {
        let mut lines = Vec::new();
        if let Some(file) = b[which].as_str() {
            let text = proc_get(proc, &format!("/v1/files/{file}/content"))
                .await
                .text()
                .await
                .unwrap();
            lines = text
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
        }
        read.push(lines);
    }
    let errors = read.pop().unwrap_or_default();
    (read.pop().unwrap_or_default(), errors)
}

/// The mocks, a directory, the config of `spec` on an SQLite file in it,
/// and a gateway process started on that config.
async fn on_sqlite(spec: &Spec) -> (Mocks, std::path::PathBuf, std::path::PathBuf, Proc) {
    let mocks = start_mocks(spec).await;
    let dir = temp_dir();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let config = dir.join("idem.toml");
    std::fs::write(&config, config_text(spec, &mocks, &db, "127.0.0.1:0")).unwrap();
    let proc = Proc::start(&config, &[]).await;
    (mocks, dir, config, proc)
}

/// The prompts the mock was sent, sorted.
fn prompts(mock: &idem::mock_upstream::MockServer) -> Vec<String> {
    let mut p: Vec<String> = mock.calls().into_iter().map(|c| c.prompt).collect();
    p.sort();
    p
}

#[tokio::test]
async fn a_batch_killed_mid_run_resumes_after_a_restart_and_calls_no_line_twice() {
    let spec = Spec {
        route: "batch = { concurrency = 2 }".into(),
        ..holding()
    };
    let (mocks, dir, config, proc) = on_sqlite(&spec).await;
    let id = proc_batch(&proc, "k").await;

    // The first two lines are at the provider when the process dies; the
    // provider answers a process that is gone.
    held(&mocks.primary, 2).await;
    let mut proc = proc;
    proc.child.kill().await.unwrap(); // SIGKILL
    let _ = proc.child.wait().await;
    mocks.primary.set_behaviour(Behaviour::default());
    release(&mocks.primary, None).await;

    // Within the claim's lease (30 s): the restart resumes the batch at
    // once, not when the dead process's claim lapses.
    let proc = Proc::start(&config, &[]).await;
    let b = proc_completed(&proc, &id, Duration::from_secs(20)).await;

    // Every prompt was sent once: the two lines in flight at the kill were
    // not sent again (their outcome is unknown), the four never started
    // ran after the restart, and the repeats made no call.
    assert_eq!(
        prompts(&mocks.primary),
        ["k0", "k1", "k2", "k3", "k4", "k5"]
    );
    assert_eq!(
        b["request_counts"],
        json!({"total": 9, "completed": 5, "failed": 4}),
        "{b}"
    );
    assert_eq!(b["idem"]["deduplicated"], 1, "{b}");

    // No line is missing: each custom_id is in one file or the other.
    let (out, errors) = proc_files(&proc, &b).await;
    let answered = answers(&out);
    let mut ids: Vec<&str> = answered.keys().map(String::as_str).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["a-2", "a-3", "a-4", "a-5", "dup-2"]);
    assert_eq!(answered["dup-2"], answered["a-2"]);
    let mut unknown: Vec<&str> = errors
        .iter()
        .map(|e| {
            assert_eq!(e["error"]["code"], "unknown", "{e}");
            e["custom_id"].as_str().unwrap()
        })
        .collect();
    unknown.sort_unstable();
    assert_eq!(unknown, ["a-0", "a-1", "dup-0", "dup-1"]);
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A provider with OpenAI's Batch API, asked every 20 ms.
const BATCH_API: &str = "batch_api = true\nbatch_poll_interval = \"20ms\"\n";

#[tokio::test]
async fn a_provider_with_a_batch_api_gets_the_unique_lines_as_one_provider_batch() {
    let app = TestApp::with(Spec {
        provider_extra: BATCH_API.into(),
        ..Spec::default()
    })
    .await;
    let mut lines: Vec<String> = (0..4)
        .map(|i| line(&format!("u-{i}"), &format!("u{i}")))
        .collect();
    lines.extend((0..2).map(|i| line(&format!("dup-{i}"), &format!("u{i}"))));
    let b = ran(&app, &lines).await;
    assert_eq!(
        b["request_counts"],
        json!({"total": 6, "completed": 6, "failed": 0}),
        "{b}"
    );
    assert_eq!(b["idem"]["deduplicated"], 2, "{b}");
    assert_eq!(b["idem"]["provider_batches"], 1, "{b}");
    let stats = app.mock.stats();
    assert_eq!(
        (stats.batches, stats.batch_lines),
        (1, 4),
        "one provider batch of the unique lines"
    );
    assert_eq!(
        prompts(&app.mock),
        ["u0", "u1", "u2", "u3"],
        "each prompt once"
    );
    let by_id = answers(&file_lines(&app, ACME, b["output_file_id"].as_str().unwrap()).await);
    for i in 0..4 {
        assert!(
            by_id[&format!("u-{i}")].ends_with(&format!("to: u{i}")),
            "{by_id:?}"
        );
    }
    for i in 0..2 {
        assert_eq!(by_id[&format!("dup-{i}")], by_id[&format!("u-{i}")]);
    }
    app.stop().await;
}

#[tokio::test]
async fn lines_a_provider_batch_failed_go_to_the_job_workers() {
    let app = TestApp::with(Spec {
        provider_extra: BATCH_API.into(),
        ..holding()
    })
    .await;
    let lines: Vec<String> = (0..4)
        .map(|i| line(&format!("f-{i}"), &format!("f{i}")))
        .collect();
    let file = input(&app, ACME, &lines).await;
    let id = created(&app, ACME, &file).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while app.mock.stats().batches < 1 {
        assert!(std::time::Instant::now() < deadline, "no provider batch");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The provider fails every line of its batch: a definite failure, so
    // each line's next attempt runs as a job's, once.
    app.mock.set_behaviour(Behaviour::default());
    release_with(&app.mock, json!({"status": 500})).await;
    let b = until_status(&app, ACME, &id, &["completed", "failed"]).await;
    assert_eq!(
        b["request_counts"],
        json!({"total": 4, "completed": 4, "failed": 0}),
        "{b}"
    );
    let calls = app.mock.calls();
    let live = |p: &str| {
        calls
            .iter()
            .filter(|c| {
                c.prompt == p && c.endpoint == idem::mock_upstream::Endpoint::ChatCompletions
            })
            .count()
    };
    for i in 0..4 {
        assert_eq!(live(&format!("f{i}")), 1, "{calls:?}");
    }
    assert_eq!(app.mock.stats().batch_lines, 4);
    app.stop().await;
}

#[tokio::test]
async fn a_batch_killed_while_its_provider_batch_runs_polls_the_same_one_after_a_restart() {
    let spec = Spec {
        provider_extra: BATCH_API.into(),
        ..holding()
    };
    let (mocks, dir, config, proc) = on_sqlite(&spec).await;
    let id = proc_batch(&proc, "s").await;
    // The provider holds its batch; the gateway has noted it as sent.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let b: Value = proc_get(&proc, &format!("/v1/batches/{id}"))
            .await
            .json()
            .await
            .unwrap();
        if b["idem"]["provider_batches"] == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no provider batch: {b}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut proc = proc;
    proc.child.kill().await.unwrap(); // SIGKILL
    let _ = proc.child.wait().await;
    mocks.primary.set_behaviour(Behaviour::default());
    release(&mocks.primary, None).await;

    let proc = Proc::start(&config, &[]).await;
    let b = proc_completed(&proc, &id, Duration::from_secs(20)).await;
    let (out, errors) = proc_files(&proc, &b).await;
    assert_eq!(
        b["request_counts"],
        json!({"total": 9, "completed": 9, "failed": 0}),
        "{b} {errors:?}"
    );
    let stats = mocks.primary.stats();
    assert_eq!(
        (stats.batches, stats.batch_lines),
        (1, 6),
        "the same provider batch, polled again"
    );
    assert_eq!(
        prompts(&mocks.primary),
        ["s0", "s1", "s2", "s3", "s4", "s5"]
    );
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(answers(&out).len(), 9);
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_replica_killed_mid_batch_leaves_it_to_another_and_no_line_is_called_twice() {
    // Three replicas on PostgreSQL, each driving batches and running jobs,
    // with short claims and attempt leases.
    let spec = Spec {
        route: "batch = { concurrency = 2 }".into(),
        jobs: "attempt_lease = \"1s\"\nclaim_lease = \"2s\"\nreconcile_interval = \"200ms\"\n\
               poll_interval = \"200ms\"\n"
            .into(),
        ..holding()
    };
    let mut c = crate::replicas::Cluster::start(3, spec, &crate::replicas::redis_url()).await;
    let id = proc_batch(&c.procs[0], "r").await;
    held(&c.mocks.primary, 2).await;

    // The replica driving the batch logged its claim; it dies with two
    // lines at the provider.
    let mut driver = None;
    for _ in 0..1500 {
        driver = c.procs.iter_mut().position(|p| {
            p.drain().iter().any(|l| {
                serde_json::from_str::<Value>(l)
                    .is_ok_and(|v| v["message"] == "batch claimed" && v["batch"] == id.as_str())
            })
        });
        if driver.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let driver = driver.expect("no replica logged the batch's claim");
    c.procs[driver].child.kill().await.unwrap(); // SIGKILL
    let _ = c.procs[driver].child.wait().await;
    c.mocks.primary.set_behaviour(Behaviour::default());
    release(&c.mocks.primary, None).await;

    let alive = &c.procs[(0..3).find(|i| *i != driver).unwrap()];
    let b = proc_completed(alive, &id, Duration::from_secs(60)).await;
    // Every distinct prompt was sent once, whoever ran it.
    assert_eq!(
        prompts(&c.mocks.primary),
        ["r0", "r1", "r2", "r3", "r4", "r5"]
    );
    // No line is missing: each is answered, or unknown (its attempt ran on
    // the replica that died), never run twice.
    let (out, errors) = proc_files(alive, &b).await;
    let answered = answers(&out);
    let mut ids: Vec<String> = answered.keys().cloned().collect();
    for e in &errors {
        assert_eq!(e["error"]["code"], "unknown", "{e}");
        ids.push(e["custom_id"].as_str().unwrap().to_owned());
    }
    ids.sort();
    let mut all: Vec<String> = (0..6)
        .map(|i| format!("a-{i}"))
        .chain((0..3).map(|i| format!("dup-{i}")))
        .collect();
    all.sort();
    assert_eq!(ids, all, "each line once, in one file or the other");
    for (id, text) in &answered {
        let prompt = id.rsplit('-').next().unwrap();
        assert!(text.contains(&format!("r{prompt}")), "{id}: {text}");
    }
    assert_eq!(
        b["request_counts"]["completed"].as_u64().unwrap() as usize,
        out.len()
    );
    assert_eq!(
        b["request_counts"]["failed"].as_u64().unwrap() as usize,
        errors.len()
    );
}
