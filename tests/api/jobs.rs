//! Jobs and attempts (docs/design.md, "Jobs and attempts") over HTTP: idempotency keys, the
//! attempt state machine, compare-and-swap completion, crash recovery.

use std::collections::HashSet;
use std::time::Duration;

use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::helpers::*;

fn job_request(content: &str) -> Value {
    json!({"request": chat_body(content), "metadata": {"order": 45}})
}

async fn create(app: &TestApp, tenant: &str, key: &str, body: &Value) -> reqwest::Response {
    app.post_json(tenant, "/v1/jobs", body, &[("idempotency-key", key)])
        .await
}

async fn job(app: &TestApp, tenant: &str, id: &str) -> Value {
    let (status, v) = app.get_json(tenant, &format!("/v1/jobs/{id}")).await;
    assert_eq!(status, 200, "{v}");
    v
}

/// Polls the job until `cond` holds.
async fn job_until(app: &TestApp, tenant: &str, id: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..1500 {
        last = job(app, tenant, id).await;
        if cond(&last) {
            return last;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("job never reached the expected state: {last}");
}

/// The value of one Prometheus sample line (`name{labels}`), 0 if absent.
pub fn sample(metrics: &str, series: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Waits until the reconciler has made `n` whole passes from now.
async fn reconciled(app: &TestApp, n: u32) {
    let passes = "idem_reconciler_passes_total";
    let from = sample(&app.metrics().await, passes);
    eventually_async(Duration::from_secs(20), || async {
        sample(&app.metrics().await, passes) >= from + f64::from(n)
    })
    .await;
}

fn state_is(s: &'static str) -> impl Fn(&Value) -> bool {
    move |j: &Value| j["state"] == s
}

async fn double_click(spec: Spec) {
    let app = TestApp::with(spec).await;
    let body = job_request("Charge order 45");
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (client, url, body) = (app.client.clone(), app.url("/v1/jobs"), body.clone());
            tokio::spawn(async move {
                let r = client
                    .post(url)
                    .bearer_auth(ACME)
                    .header("idempotency-key", "order-45")
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
                let status = r.status().as_u16();
                let replayed = r.headers().get("idempotent-replayed").is_some();
                let v: Value = r.json().await.unwrap();
                (status, replayed, v["id"].as_str().unwrap().to_string())
            })
        })
        .collect();
    let results = collect(tasks).await;
    let ids: HashSet<&str> = results.iter().map(|(_, _, id)| id.as_str()).collect();
    assert_eq!(ids.len(), 1, "one key made several jobs");
    assert_eq!(results.iter().filter(|(s, _, _)| *s == 201).count(), 1);
    assert!(
        results
            .iter()
            .filter(|(s, _, _)| *s == 200)
            .all(|(_, replayed, _)| *replayed)
    );
    let id = ids.into_iter().next().unwrap().to_string();
    held(&app.mock, 1).await;
    release(&app.mock, None).await;
    let done = job_until(&app, ACME, &id, state_is("succeeded")).await;
    assert_eq!(done["completed_by"], 1);
    assert_eq!(done["attempts"].as_array().unwrap().len(), 1);
    assert_eq!(
        content_of(&done["result"]),
        "mock answer #1 to: Charge order 45"
    );
    let (_, list) = app.get_json(ACME, "/v1/jobs").await;
    assert_eq!(
        list["data"].as_array().unwrap().len(),
        1,
        "more than one row"
    );
    assert_eq!(
        app.calls(),
        1,
        "a double-click made more than one upstream call"
    );
}

each_kind! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn double_click_makes_one_job_and_one_call_on_sqlite(kind) {
        double_click(Spec {
            primary_kind: kind,
            ..holding()
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn double_click_makes_one_job_and_one_call_on_postgres() {
    double_click(Spec {
        postgres: true,
        ..holding()
    })
    .await;
}

#[tokio::test]
async fn same_key_other_payload_is_409_and_changes_nothing() {
    let app = TestApp::spawn().await;
    let r = create(&app, ACME, "k-1", &job_request("first")).await;
    assert_eq!(r.status(), 201);
    let first: Value = r.json().await.unwrap();
    let id = first["id"].as_str().unwrap().to_string();
    let before = job_until(&app, ACME, &id, state_is("succeeded")).await;
    let r = create(&app, ACME, "k-1", &job_request("second")).await;
    assert_error(r, 409, "idempotency_key_reused").await;
    // Other metadata is another intent too.
    let mut other_meta = job_request("first");
    other_meta["metadata"] = json!({"order": 46});
    assert_error(
        create(&app, ACME, "k-1", &other_meta).await,
        409,
        "idempotency_key_reused",
    )
    .await;
    let after = job(&app, ACME, &id).await;
    assert_eq!(before, after, "the first job changed");
    let (_, list) = app.get_json(ACME, "/v1/jobs").await;
    assert_eq!(list["data"].as_array().unwrap().len(), 1);
    // The same payload replays with 200.
    let r = create(&app, ACME, "k-1", &job_request("first")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn keys_are_required_and_checked() {
    let app = TestApp::spawn().await;
    let r = app
        .post_json(ACME, "/v1/jobs", &job_request("x"), &[])
        .await;
    assert_error(r, 400, "idempotency_key_missing").await;
    let long = "k".repeat(256);
    assert_error(
        create(&app, ACME, &long, &job_request("x")).await,
        400,
        "idempotency_key_invalid",
    )
    .await;
    let ok = "k".repeat(255);
    assert_eq!(
        create(&app, ACME, &ok, &job_request("x")).await.status(),
        201
    );
    let r = app
        .post_json(
            ACME,
            "/v1/jobs",
            &json!({"metadata": {}}),
            &[("idempotency-key", "k2")],
        )
        .await;
    assert_error(r, 400, "missing_required_parameter").await;
    let r = create(
        &app,
        ACME,
        "k3",
        &json!({"request": {"model": "nope", "messages": [{"role": "user", "content": "x"}]}}),
    )
    .await;
    assert_error(r, 404, "model_not_found").await;
}

each_kind! {
    #[tokio::test]
    async fn a_timeout_is_unknown_blocks_retries_until_resolved(kind) {
        let app = TestApp::with(Spec {
            primary: Behaviour {
                hang: true,
                ..Behaviour::default()
            },
            provider_timeout: "3s".into(),
            attempts: "timeout = \"500ms\"\nmax = 3\n".into(),
            primary_kind: kind,
            ..Spec::default()
        })
        .await;
        let r = create(&app, ACME, "slow-1", &job_request("will hang")).await;
        let id = r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        let j = job_until(&app, ACME, &id, |j| j["attempts"][0]["state"] == "unknown").await;
        assert_eq!(j["attempts"][0]["reason"], "timeout");
        assert_eq!(
            j["state"], "running",
            "an unknown attempt must hold the job"
        );
        // No automatic retry: give the executor every chance (the reconciler
        // has looked at the job twice since, the workers have polled), then
        // count.
        reconciled(&app, 2).await;
        let j = job(&app, ACME, &id).await;
        assert_eq!(
            j["attempts"].as_array().unwrap().len(),
            1,
            "an unknown attempt was retried: {j}"
        );
        assert_eq!(app.calls(), 1);
        // A manual retry is refused while the attempt is unknown.
        let r = app
            .post_json(ACME, &format!("/v1/jobs/{id}/attempts"), &json!({}), &[])
            .await;
        assert_error(r, 409, "attempt_in_progress").await;
        // Only an admin may resolve.
        let resolve = format!("/v1/jobs/{id}/attempts/1/resolve");
        let r = app
            .post_json(ACME, &resolve, &json!({"outcome": "failed"}), &[])
            .await;
        assert_error(r, 403, "admin_key_required").await;
        let r = app
            .post_json(ADMIN, &resolve, &json!({"outcome": "failed"}), &[])
            .await;
        assert_eq!(r.status(), 200);
        let j: Value = r.json().await.unwrap();
        assert_eq!(j["attempts"][0]["state"], "failed");
        assert_eq!(j["state"], "failed");
        // Now a retry is allowed and succeeds.
        app.mock.set_behaviour(Behaviour::default());
        let r = app
            .post_json(ACME, &format!("/v1/jobs/{id}/attempts"), &json!({}), &[])
            .await;
        assert_eq!(r.status(), 202);
        let j = job_until(&app, ACME, &id, state_is("succeeded")).await;
        assert_eq!(j["completed_by"], 2);
        assert_eq!(j["attempts"][1]["state"], "succeeded");
        assert_eq!(app.calls(), 2);
    }
}

each_kind! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn reverse_order_finish_the_second_to_return_loses(kind) {
        let app = TestApp::with(Spec {
            primary: Behaviour {
                hold: true,
                ..Behaviour::default()
            },
            fallback: Some(Behaviour {
                hold: true,
                ..Behaviour::default()
            }),
            attempts: "hedge_after = \"100ms\"\n".into(),
            primary_kind: kind,
            fallback_kind: kind,
            ..Spec::default()
        })
        .await;
        let fallback = app.fallback.as_ref().unwrap();
        let r = create(&app, ACME, "race-1", &job_request("who wins")).await;
        let id = r.json::<Value>().await.unwrap()["id"]
            .as_str()
            .unwrap()
            .to_string();
        // Attempt A (primary) started first and is held; the hedge B follows.
        let a = held(&app.mock, 1).await;
        let b = held(fallback, 1).await;
        // B returns first and wins.
        release_with(fallback, json!({"seq": b[0], "content": "ANSWER-FROM-B"})).await;
        let j = job_until(&app, ACME, &id, state_is("succeeded")).await;
        assert_eq!(j["completed_by"], 2);
        let version = j["version"].clone();
        // A returns last and loses.
        release_with(&app.mock, json!({"seq": a[0], "content": "ANSWER-FROM-A"})).await;
        let j = job_until(&app, ACME, &id, |j| {
            j["attempts"][0]["state"] == "discarded"
        })
        .await;
        assert_eq!(j["attempts"][1]["state"], "succeeded");
        assert_eq!(j["attempts"][1]["hedge"], true);
        assert_eq!(j["completed_by"], 2);
        assert_eq!(j["version"], version, "the loser changed the job");
        assert_eq!(content_of(&j["result"]), "ANSWER-FROM-B");
        assert!(
            !j.to_string().contains("ANSWER-FROM-A"),
            "the loser's payload leaked into the job"
        );
        let (_, list) = app.get_json(ACME, "/v1/jobs").await;
        assert!(!list.to_string().contains("ANSWER-FROM-A"));
        let metrics = app.metrics().await;
        assert!(
            metrics.contains("idem_attempt_races_total{route=\"bot\"} 1"),
            "{metrics}"
        );
    }
}

#[tokio::test]
async fn sigkill_mid_attempt_leaves_it_unknown_and_the_key_still_names_the_job() {
    let mocks = start_mocks(&holding()).await;
    let (proc, dir) = Proc::start_default(&mocks).await;
    let config = dir.join("idem.toml");
    let client = client();
    let r = client
        .post(format!("{}/v1/jobs", proc.base))
        .bearer_auth(ACME)
        .header("idempotency-key", "crash-1")
        .json(&job_request("in flight at the crash"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    held(&mocks.primary, 1).await;
    let mut proc = proc;
    proc.child.kill().await.unwrap(); // SIGKILL
    let _ = proc.child.wait().await;
    release(&mocks.primary, None).await;

    let proc = Proc::start(&config, &[]).await;
    let get = || {
        let (client, url) = (client.clone(), format!("{}/v1/jobs/{id}", proc.base));
        async move {
            client
                .get(url)
                .bearer_auth(ACME)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let mut j = get().await;
    for _ in 0..200 {
        if j["attempts"][0]["state"] == "unknown" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        j = get().await;
    }
    assert_eq!(j["attempts"][0]["state"], "unknown", "{j}");
    assert_eq!(j["state"], "running");
    // Several reconcile passes later, nothing was re-run.
    tokio::time::sleep(Duration::from_millis(800)).await;
    let j = get().await;
    assert_eq!(j["attempts"].as_array().unwrap().len(), 1, "{j}");
    assert_eq!(mocks.primary.stats().calls, 1);
    let r = client
        .post(format!("{}/v1/jobs", proc.base))
        .bearer_auth(ACME)
        .header("idempotency-key", "crash-1")
        .json(&job_request("in flight at the crash"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["id"], id.as_str());
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn two_tenants_with_one_key_get_two_jobs_and_cannot_see_each_other() {
    let app = TestApp::spawn().await;
    let a: Value = create(&app, ACME, "shared-key", &job_request("mine"))
        .await
        .json()
        .await
        .unwrap();
    let b: Value = create(&app, BETA, "shared-key", &job_request("mine"))
        .await
        .json()
        .await
        .unwrap();
    assert_ne!(a["id"], b["id"]);
    let (status, _) = app
        .get_json(BETA, &format!("/v1/jobs/{}", a["id"].as_str().unwrap()))
        .await;
    assert_eq!(status, 404);
    let (status, _) = app
        .get_json(ACME, &format!("/v1/jobs/{}", b["id"].as_str().unwrap()))
        .await;
    assert_eq!(status, 404);
    let r = app
        .post_json(
            BETA,
            &format!("/v1/jobs/{}/cancel", a["id"].as_str().unwrap()),
            &json!({}),
            &[],
        )
        .await;
    assert_error(r, 404, "not_found").await;
    let (_, list) = app.get_json(BETA, "/v1/jobs").await;
    let ids: Vec<&Value> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| &j["id"])
        .collect();
    assert_eq!(ids, vec![&b["id"]]);
    // Garbage and traversal ids are plain 404s.
    for bad in [
        "..%2F..%2Fetc%2Fpasswd",
        "1%27%20OR%20%271%27%3D%271",
        "not-a-uuid",
    ] {
        let (status, v) = app.get_json(ACME, &format!("/v1/jobs/{bad}")).await;
        assert_eq!(status, 404, "{bad}: {v}");
    }
}

#[tokio::test]
async fn chat_with_an_idempotency_key_replays_without_a_call() {
    let app = TestApp::spawn().await;
    let body = chat_body("pay invoice 7");
    let r = app
        .chat_with(ACME, &body, &[("idempotency-key", "inv-7")])
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-outcome"], "leader");
    let job_id = r.headers()["idem-job-id"].to_str().unwrap().to_string();
    assert_eq!(r.headers()["idem-attempt"], "1");
    let first: Value = r.json().await.unwrap();
    let r = app
        .chat_with(ACME, &body, &[("idempotency-key", "inv-7")])
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(r.headers()["idem-outcome"], "replay");
    assert_eq!(r.headers()["idem-job-id"], job_id.as_str());
    let again: Value = r.json().await.unwrap();
    assert_eq!(first, again);
    // The replay in streamed form.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = app
        .chat_with(ACME, &streamed, &[("idempotency-key", "inv-7")])
        .await;
    assert_eq!(r.headers()["idempotent-replayed"], "true");
    assert_eq!(sse_content(&r.text().await.unwrap()), content_of(&first));
    assert_eq!(app.calls(), 1);
    // Another payload under the same key is refused.
    let r = app
        .chat_with(
            ACME,
            &chat_body("pay invoice 8"),
            &[("idempotency-key", "inv-7")],
        )
        .await;
    assert_error(r, 409, "idempotency_key_reused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_job_answers_504_and_a_retry_waits_on_the_same_job() {
    let app = TestApp::with(Spec {
        server: "request_timeout = \"500ms\"\n".into(),
        ..holding()
    })
    .await;
    let body = chat_body("slow job");
    let r = app
        .chat_with(ACME, &body, &[("idempotency-key", "slow-7")])
        .await;
    let job_id = r.headers()["idem-job-id"].to_str().unwrap().to_string();
    assert_error(r, 504, "job_in_progress").await;
    let retry = tokio::spawn({
        let (client, url, body) = (
            app.client.clone(),
            app.url("/v1/chat/completions"),
            body.clone(),
        );
        async move {
            client
                .post(url)
                .bearer_auth(ACME)
                .header("idempotency-key", "slow-7")
                .json(&body)
                .send()
                .await
                .unwrap()
        }
    });
    held(&app.mock, 1).await;
    release(&app.mock, None).await;
    let r = retry.await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-job-id"], job_id.as_str());
    assert_eq!(r.headers()["idem-outcome"], "follower");
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_keys_with_one_payload_share_one_upstream_call() {
    let app = TestApp::with(holding()).await;
    let a: Value = create(&app, ACME, "k-a", &job_request("same work"))
        .await
        .json()
        .await
        .unwrap();
    let b: Value = create(&app, ACME, "k-b", &job_request("same work"))
        .await
        .json()
        .await
        .unwrap();
    assert_ne!(a["id"], b["id"]);
    held(&app.mock, 1).await;
    app.until_followers(1).await;
    release(&app.mock, None).await;
    let ja = job_until(&app, ACME, a["id"].as_str().unwrap(), state_is("succeeded")).await;
    let jb = job_until(&app, ACME, b["id"].as_str().unwrap(), state_is("succeeded")).await;
    assert_eq!(ja["result"], jb["result"]);
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn failed_attempts_retry_with_backoff_then_fail_the_job() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            fail_status: Some(500),
            ..Behaviour::default()
        },
        cache: "enabled = false\n".into(),
        attempts: "max = 3\nbackoff_base = \"10ms\"\nbackoff_max = \"50ms\"\n".into(),
        ..Spec::default()
    })
    .await;
    let v: Value = create(&app, ACME, "fail-1", &job_request("doomed"))
        .await
        .json()
        .await
        .unwrap();
    let j = job_until(&app, ACME, v["id"].as_str().unwrap(), state_is("failed")).await;
    let states: Vec<&str> = j["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, vec!["failed", "failed", "failed"]);
    assert_eq!(j["attempts"][0]["reason"], "provider_error");
    assert!(
        j["error"]
            .as_str()
            .unwrap()
            .contains("all 3 attempts failed"),
        "{j}"
    );
    assert_eq!(app.calls(), 3);
    // A manual retry of the spent job grants it one attempt, not a new
    // budget of three.
    let id = v["id"].as_str().unwrap();
    let retry = format!("/v1/jobs/{id}/attempts");
    let r = app.post_json(ACME, &retry, &json!({}), &[]).await;
    assert_eq!(r.status(), 202);
    let j = job_until(&app, ACME, id, |j| {
        j["state"] == "failed" && j["attempts"].as_array().unwrap().len() > 3
    })
    .await;
    assert_eq!(j["attempts"].as_array().unwrap().len(), 4, "{j}");
    assert!(
        j["error"]
            .as_str()
            .unwrap()
            .contains("all 4 attempts failed"),
        "{j}"
    );
    assert_eq!(app.calls(), 4);
    app.mock.set_behaviour(Behaviour::default());
    let r = app.post_json(ACME, &retry, &json!({}), &[]).await;
    assert_eq!(r.status(), 202);
    let j = job_until(&app, ACME, id, state_is("succeeded")).await;
    assert_eq!(j["completed_by"], 5, "{j}");
}

#[tokio::test]
async fn a_failed_primary_fails_over_to_the_next_target_as_attempt_2() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            fail_status: Some(500),
            ..Behaviour::default()
        },
        fallback: Some(Behaviour::default()),
        attempts: "backoff_base = \"10ms\"\n".into(),
        ..Spec::default()
    })
    .await;
    let v: Value = create(&app, ACME, "fo-1", &job_request("fail over"))
        .await
        .json()
        .await
        .unwrap();
    let j = job_until(&app, ACME, v["id"].as_str().unwrap(), state_is("succeeded")).await;
    assert_eq!(j["completed_by"], 2);
    assert_eq!(j["attempts"][0]["provider"], "primary");
    assert_eq!(j["attempts"][0]["state"], "failed");
    assert_eq!(j["attempts"][1]["provider"], "fallback");
    assert_eq!(j["attempts"][1]["model"], "llama-3.1-8b");
    // On chat completions with a key, the job's answer names the target
    // that gave it (attempt 2's), not the route's first; so does its
    // replay.
    for replayed in [false, true] {
        let r = app
            .post_json(
                ACME,
                "/v1/chat/completions",
                &chat_body("fail over on chat"),
                &[("idempotency-key", "fo-2")],
            )
            .await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers().contains_key("idempotent-replayed"), replayed);
        assert_eq!(r.headers()["idem-attempt"], "2");
        assert_eq!(r.headers()["idem-provider"], "fallback");
    }
}

#[tokio::test]
async fn cancel_and_list() {
    let app = TestApp::with(holding()).await;
    let a: Value = create(&app, ACME, "c-1", &job_request("to cancel"))
        .await
        .json()
        .await
        .unwrap();
    let id = a["id"].as_str().unwrap();
    held(&app.mock, 1).await;
    let r = app
        .post_json(ACME, &format!("/v1/jobs/{id}/cancel"), &json!({}), &[])
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["state"], "cancelled");
    // The attempt in flight finishes later and cannot complete a cancelled job.
    release(&app.mock, None).await;
    let j = job_until(&app, ACME, id, |j| j["attempts"][0]["state"] == "discarded").await;
    assert_eq!(j["state"], "cancelled");
    assert!(j["result"].is_null());
    // Listing: newest first, filtered, paginated.
    app.mock.set_behaviour(Behaviour::default());
    for i in 0..5 {
        create(
            &app,
            ACME,
            &format!("l-{i}"),
            &job_request(&format!("list {i}")),
        )
        .await;
    }
    let (_, page) = app.get_json(ACME, "/v1/jobs?limit=2").await;
    assert_eq!(page["data"].as_array().unwrap().len(), 2);
    assert_eq!(page["has_more"], true);
    assert_eq!(page["data"][0]["idempotency_key"], "l-4");
    let next = page["next_cursor"].as_str().unwrap();
    let (_, page2) = app
        .get_json(ACME, &format!("/v1/jobs?limit=2&after={next}"))
        .await;
    assert_eq!(page2["data"][0]["idempotency_key"], "l-2");
    let (_, cancelled) = app.get_json(ACME, "/v1/jobs?state=cancelled").await;
    assert_eq!(cancelled["data"].as_array().unwrap().len(), 1);
    let (status, _) = app.get_json(ACME, "/v1/jobs?state=bogus").await;
    assert_eq!(status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_answer_within_the_window_still_completes_the_job() {
    let app = TestApp::with(Spec {
        attempts: "timeout = \"300ms\"\nlate_result_window = \"1m\"\n".into(),
        ..holding()
    })
    .await;
    // Two jobs with one payload: the second attempt follows the first's call.
    let a: Value = create(&app, ACME, "late-a", &job_request("slow but sure"))
        .await
        .json()
        .await
        .unwrap();
    let b: Value = create(&app, ACME, "late-b", &job_request("slow but sure"))
        .await
        .json()
        .await
        .unwrap();
    let (a, b) = (
        a["id"].as_str().unwrap().to_string(),
        b["id"].as_str().unwrap().to_string(),
    );
    held(&app.mock, 1).await;
    for id in [&a, &b] {
        let j = job_until(&app, ACME, id, |j| j["attempts"][0]["state"] == "unknown").await;
        assert_eq!(j["state"], "running");
    }
    // The provider answers late: both jobs complete with that one answer.
    release(&app.mock, None).await;
    let ja = job_until(&app, ACME, &a, state_is("succeeded")).await;
    let jb = job_until(&app, ACME, &b, state_is("succeeded")).await;
    for j in [&ja, &jb] {
        assert_eq!(j["completed_by"], 1);
        assert_eq!(j["attempts"][0]["state"], "succeeded");
        assert_eq!(j["attempts"].as_array().unwrap().len(), 1);
    }
    assert_eq!(ja["result"], jb["result"]);
    assert_eq!(app.calls(), 1);
}

async fn job_id(resp: reqwest::Response) -> String {
    let v: Value = resp.json().await.unwrap();
    v["id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_past_its_timeout_is_unknown_and_its_late_answer_still_completes_the_job() {
    // The provider's own timeout is shorter than the attempt's: a job
    // attempt's call outlives both (up to the late window), so the answer
    // that comes after them is still heard.
    let app = TestApp::with(Spec {
        provider_timeout: "500ms".into(),
        attempts: "timeout = \"1s\"\n".into(),
        ..holding()
    })
    .await;
    let id = job_id(create(&app, ACME, "late-1", &job_request("slow provider")).await).await;
    held(&app.mock, 1).await;
    let j = job_until(&app, ACME, &id, |j| j["attempts"][0]["state"] == "unknown").await;
    assert_eq!(j["attempts"][0]["reason"], "timeout");
    assert_eq!(j["state"], "running", "an unknown attempt holds the job");
    // Past both timeouts the call is still in progress, not abandoned.
    let seqs = held(&app.mock, 1).await;
    assert_eq!(seqs.len(), 1, "the provider call was cut");
    assert_eq!(app.state.core.coalescer.table.inflight(), 1);
    let r = app
        .post_json(ACME, &format!("/v1/jobs/{id}/attempts"), &json!({}), &[])
        .await;
    assert_error(r, 409, "attempt_in_progress").await;
    release_with(
        &app.mock,
        json!({"seq": seqs[0], "content": "LATE BUT RIGHT"}),
    )
    .await;
    let j = job_until(&app, ACME, &id, state_is("succeeded")).await;
    assert_eq!(j["completed_by"], 1);
    assert_eq!(j["attempts"].as_array().unwrap().len(), 1, "{j}");
    assert_eq!(j["attempts"][0]["state"], "succeeded");
    assert_eq!(content_of(&j["result"]), "LATE BUT RIGHT");
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_requeued_job_keeps_counting_its_attempts() {
    // Attempt 1 hangs and is auto-resolved as failed, which requeues the
    // job; the next run has one attempt left of the job's two, not two.
    let app = TestApp::with(Spec {
        coalesce: "enabled = false\n".into(),
        cache: "enabled = false\n".into(),
        attempts: "max = 2\ntimeout = \"300ms\"\nauto_resolve_unknown_after = \"100ms\"\n\
                   backoff_base = \"10ms\"\nbackoff_max = \"20ms\"\n"
            .into(),
        ..holding()
    })
    .await;
    let id = job_id(create(&app, ACME, "budget-1", &job_request("twice at most")).await).await;
    held(&app.mock, 1).await;
    // From now on every call fails at once.
    app.mock.set_behaviour(Behaviour {
        fail_status: Some(500),
        ..Behaviour::default()
    });
    let j = job_until(&app, ACME, &id, state_is("failed")).await;
    let states: Vec<(&str, &str)> = j["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["state"].as_str().unwrap(), a["reason"].as_str().unwrap()))
        .collect();
    assert_eq!(
        states,
        vec![("failed", "auto_resolved"), ("failed", "provider_error")],
        "{j}"
    );
    assert!(
        j["error"]
            .as_str()
            .unwrap()
            .contains("all 2 attempts failed"),
        "{j}"
    );
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_failure_with_budget_left_makes_the_next_attempt() {
    let app = TestApp::with(Spec {
        attempts: "max = 3\ntimeout = \"300ms\"\nbackoff_base = \"10ms\"\nbackoff_max = \"20ms\"\n"
            .into(),
        ..holding()
    })
    .await;
    let id = job_id(create(&app, ACME, "late-fail-1", &job_request("try again")).await).await;
    let seqs = held(&app.mock, 1).await;
    job_until(&app, ACME, &id, |j| j["attempts"][0]["state"] == "unknown").await;
    // The next call answers at once; the held one fails late.
    app.mock.set_behaviour(Behaviour::default());
    release_with(&app.mock, json!({"seq": seqs[0], "status": 500})).await;
    let j = job_until(&app, ACME, &id, state_is("succeeded")).await;
    assert_eq!(j["completed_by"], 2, "{j}");
    assert_eq!(j["attempts"][0]["state"], "failed");
    assert_eq!(j["attempts"][0]["reason"], "late_provider_error");
    assert_eq!(j["attempts"][1]["state"], "succeeded");
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_attempt_that_lost_its_lease_stops_and_does_not_complete_the_job() {
    let app = TestApp::with(Spec {
        jobs:
            "attempt_lease = \"900ms\"\nreconcile_interval = \"200ms\"\npoll_interval = \"200ms\"\n"
                .into(),
        ..holding()
    })
    .await;
    let id = job_id(create(&app, ACME, "lease-1", &job_request("who owns me")).await).await;
    held(&app.mock, 1).await;
    // Another replica's reconciler believed this one dead and declared the
    // attempt unknown: the owner's next renewal is refused.
    let expired = app
        .state
        .store
        .expire_attempt_leases(i64::MAX, idem::store::now_ms())
        .await
        .unwrap();
    assert_eq!(expired.len(), 1);
    let lost = "idem_attempts_total{provider=\"primary\",outcome=\"lease_lost\"}";
    eventually_async(Duration::from_secs(10), || async {
        sample(&app.metrics().await, lost) >= 1.0
    })
    .await;
    // The provider answers after all: the stopped attempt takes no part.
    release(&app.mock, None).await;
    app.until_no_flights().await;
    let j = job(&app, ACME, &id).await;
    assert_eq!(j["state"], "running", "{j}");
    assert_eq!(j["attempts"][0]["state"], "unknown");
    assert_eq!(j["attempts"][0]["reason"], "lease_expired");
    assert!(j["result"].is_null());
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn resolving_an_unknown_attempt_as_cancelled_cancels_the_job() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            hang: true,
            ..Behaviour::default()
        },
        attempts: "timeout = \"300ms\"\n".into(),
        ..Spec::default()
    })
    .await;
    let id = job_id(create(&app, ACME, "cancel-unknown", &job_request("never mind")).await).await;
    job_until(&app, ACME, &id, |j| j["attempts"][0]["state"] == "unknown").await;
    let r = app
        .post_json(
            ADMIN,
            &format!("/v1/jobs/{id}/attempts/1/resolve"),
            &json!({"outcome": "cancelled"}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let j: Value = r.json().await.unwrap();
    assert_eq!(j["attempts"][0]["state"], "cancelled");
    assert_eq!(j["state"], "cancelled", "{j}");
    let j = job(&app, ACME, &id).await;
    assert_eq!(j["state"], "cancelled");
    // A cancelled job takes no more attempts.
    let r = app
        .post_json(ACME, &format!("/v1/jobs/{id}/attempts"), &json!({}), &[])
        .await;
    assert_error(r, 409, "job_completed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_is_one_incoming_request_and_its_call_one_upstream_call() {
    let app = TestApp::spawn().await;
    let coalescing = |v: &Value| v["coalescing"].clone();
    let id = job_id(create(&app, ACME, "count-1", &job_request("count me")).await).await;
    job_until(&app, ACME, &id, state_is("succeeded")).await;
    let (_, s) = app.get_json(ACME, "/v1/stats").await;
    let s = coalescing(&s);
    assert_eq!(
        (&s["incoming_requests"], &s["upstream_calls"], &s["leaders"]),
        (&json!(1), &json!(1), &json!(1)),
        "{s}"
    );
    assert_eq!(s["upstream_ratio"], 1.0, "{s}");
    // The same job asked for again is a replay that made no call.
    let r = create(&app, ACME, "count-1", &job_request("count me")).await;
    assert_eq!(r.status(), 200);
    // A job on the chat path: one more incoming, one more call.
    let r = app
        .chat_with(
            ACME,
            &chat_body("count me too"),
            &[("idempotency-key", "count-2")],
        )
        .await;
    assert_eq!(r.status(), 200);
    let (_, s) = app.get_json(ACME, "/v1/stats").await;
    let s = coalescing(&s);
    assert_eq!(
        (&s["incoming_requests"], &s["upstream_calls"], &s["replays"]),
        (&json!(3), &json!(2), &json!(1)),
        "{s}"
    );
    assert_eq!(s["leaders"], 2, "{s}");
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_jobs_sharing_one_call_count_a_leader_and_a_follower() {
    let app = TestApp::with(holding()).await;
    let a = job_id(create(&app, ACME, "share-a", &job_request("same work")).await).await;
    let b = job_id(create(&app, ACME, "share-b", &job_request("same work")).await).await;
    held(&app.mock, 1).await;
    app.until_followers(1).await;
    release(&app.mock, None).await;
    job_until(&app, ACME, &a, state_is("succeeded")).await;
    job_until(&app, ACME, &b, state_is("succeeded")).await;
    let (_, s) = app.get_json(ACME, "/v1/stats").await;
    let s = &s["coalescing"];
    assert_eq!(
        (&s["incoming_requests"], &s["upstream_calls"]),
        (&json!(2), &json!(1)),
        "{s}"
    );
    assert_eq!(
        (&s["leaders"], &s["followers"]),
        (&json!(1), &json!(1)),
        "{s}"
    );
    assert_eq!(s["saved_calls"], 1, "{s}");
}

/// Runs `idem serve` on `config` and expects it to exit without
/// listening; returns what it printed on stderr.
async fn serve_refused(config: &std::path::Path) -> String {
    let out = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("serve")
            .arg("--config")
            .arg(config)
            .env_remove("IDEM_CONFIG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the second gateway neither started nor exited: it is serving")
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && !stdout.contains("idem listening"),
        "the second gateway started: {stdout}"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_gateway_on_one_sqlite_file_refuses_to_start_and_a_killed_ones_lock_does_not_stay()
{
    let mocks = start_mocks(&holding()).await;
    let (mut first, dir) = Proc::start_default(&mocks).await;
    let config = dir.join("idem.toml");
    let client = client();
    let r = client
        .post(format!("{}/v1/jobs", first.base))
        .bearer_auth(ACME)
        .header("idempotency-key", "one-file")
        .json(&job_request("mine alone"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = job_id(r).await;
    held(&mocks.primary, 1).await;

    let stderr = serve_refused(&config).await;
    assert!(stderr.contains("another `idem serve`"), "{stderr}");
    assert!(stderr.contains(&first.pid().to_string()), "{stderr}");
    assert!(stderr.contains("idem.db"), "{stderr}");
    // The refused gateway did not touch the first one's live attempt.
    let get = |base: String| {
        let (client, id) = (client.clone(), id.clone());
        async move {
            client
                .get(format!("{base}/v1/jobs/{id}"))
                .bearer_auth(ACME)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let j = get(first.base.clone()).await;
    assert_eq!(j["attempts"][0]["state"], "starting", "{j}");

    // SIGKILL leaves the lock file behind, not the lock: a restart starts.
    first.child.kill().await.unwrap();
    let _ = first.child.wait().await;
    let second = Proc::start(&config, &[]).await;
    let j = get(second.base.clone()).await;
    assert_eq!(j["attempts"][0]["state"], "unknown", "{j}");
    assert_eq!(j["attempts"][0]["reason"], "lease_expired");
    drop(second);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_job_gives_its_slot_back_once_its_answer_is_with_the_writer_of_completions() {
    // One slot, and a database that holds job A's completion: A's row is
    // locked by this test, so the writer waits on it. The slot goes back
    // as soon as A's answer is handed to the writer, and job B runs (its
    // call reaches the provider) while A's completion still waits.
    let url = pg_schema().await;
    let app = TestApp::with(Spec {
        storage_url: Some(url.clone()),
        jobs: "workers = 1\nreconcile_interval = \"200ms\"\npoll_interval = \"200ms\"\n".into(),
        ..holding()
    })
    .await;
    let a = job_id(create(&app, ACME, "slot-a", &job_request("first in line")).await).await;
    held(&app.mock, 1).await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await
        .unwrap();
    let mut lock = pool.begin().await.unwrap();
    sqlx::query("SELECT id FROM jobs WHERE id = $1 FOR UPDATE")
        .bind(&a)
        .fetch_one(&mut *lock)
        .await
        .unwrap();
    release(&app.mock, None).await;
    let b = job_id(create(&app, ACME, "slot-b", &job_request("second in line")).await).await;
    // B's call arrives: A's slot was given back before its commit.
    held(&app.mock, 1).await;
    assert_eq!(app.calls(), 2);
    let j = job(&app, ACME, &a).await;
    assert_eq!(j["state"], "running", "A's completion waits: {j}");
    lock.rollback().await.unwrap();
    release(&app.mock, None).await;
    for id in [&a, &b] {
        let j = job_until(&app, ACME, id, state_is("succeeded")).await;
        assert_eq!(j["attempts"].as_array().map(Vec::len), Some(1), "{j}");
    }
    assert_eq!(app.calls(), 2);
}
