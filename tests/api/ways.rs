//! The acceptance tests of coalescing, jobs and garbage on every way
//! through idem: each face (chat completions, Messages, Responses) in
//! front of each kind of provider, native (same dialect on both sides) and
//! translated, by one body per test run once per way (`each_way!`).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use idem::mock_upstream::{Behaviour, Garbage};
use serde_json::{Value, json};

use crate::helpers::*;

/// Sends `body` to the way's face as `key`, with `headers`.
async fn ask(
    app: &TestApp,
    way: Way,
    key: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> reqwest::Response {
    app.post_json(key, way.path(), body, headers).await
}

/// The job named by an answer's `Idem-Job-Id`.
async fn job_of(app: &TestApp, r: &reqwest::Response) -> Value {
    let id = r.headers()["idem-job-id"].to_str().unwrap().to_string();
    let (status, j) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
    assert_eq!(status, 200, "{j}");
    j
}

/// Polls the job `id` until `cond` holds.
async fn job_until(app: &TestApp, id: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..1500 {
        let (_, j) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
        if cond(&j) {
            return j;
        }
        last = j;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the job never reached the expected state: {last}");
}

each_way! {
    /// A wave of 200 identical requests is one call; the next wave is
    /// answered from the cache; the same wave from another tenant is one
    /// call of its own and never gets the first tenant's answer.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_wave_is_one_call_the_next_none_and_another_tenant_one(way) {
        let app = way.start(holding()).await;
        let body = way.body("Where is my order?");
        let tasks = wave_at(&app, way.path(), ACME, &body, 200).await;
        held(&app.mock, 1).await;
        app.until_followers(199).await;
        release(&app.mock, None).await;
        let results = collect(tasks).await;
        assert_eq!(app.calls(), 1, "{way:?}: a wave made more than one call");
        assert!(results.iter().all(|(s, _, _)| *s == 200), "{way:?}: {:?}", results[0]);
        let bodies: HashSet<&str> = results.iter().map(|(_, _, b)| b.as_str()).collect();
        assert_eq!(bodies.len(), 1, "{way:?}: followers got different answers");
        let outcomes = count_by(&results, |(_, o, _)| o.clone());
        assert_eq!(outcomes.get("leader"), Some(&1));
        assert_eq!(outcomes.get("follower"), Some(&199));
        let first: Value = serde_json::from_str(&results[0].2).unwrap();
        assert_eq!(way.text(&first), "mock answer #1 to: Where is my order?", "{way:?}");

        let results = collect(wave_at(&app, way.path(), ACME, &body, 100).await).await;
        assert_eq!(app.calls(), 1);
        assert!(results
            .iter()
            .all(|(s, o, b)| *s == 200 && o == "cache-hit" && bodies.contains(b.as_str())));

        let tasks = wave_at(&app, way.path(), BETA, &body, 50).await;
        held(&app.mock, 1).await;
        release(&app.mock, None).await;
        let results = collect(tasks).await;
        assert_eq!(app.calls(), 2, "{way:?}");
        for (s, _, b) in &results {
            assert_eq!(*s, 200);
            assert!(!bodies.contains(b.as_str()), "{way:?}: beta got acme's answer");
            let v: Value = serde_json::from_str(b).unwrap();
            assert_eq!(way.text(&v), "mock answer #2 to: Where is my order?");
        }
        app.until_no_flights().await;
        app.stop().await;
    }
}

each_way! {
    /// A failing provider's error is every waiter's, and the waiters that
    /// come next get it from the negative cache: one call.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_failing_provider_is_not_re_attacked_by_waiters(way) {
        let app = way
            .start(Spec {
                primary: Behaviour {
                    hold: true,
                    fail_status: Some(500),
                    ..Behaviour::default()
                },
                cache: "server_error_ttl = \"5s\"\n".into(),
                ..Spec::default()
            })
            .await;
        let body = way.body("Is the service up?");
        let tasks = wave_at(&app, way.path(), ACME, &body, 50).await;
        held(&app.mock, 1).await;
        app.until_followers(49).await;
        release(&app.mock, None).await;
        let results = collect(tasks).await;
        assert_eq!(app.calls(), 1);
        let (status, _, first) = &results[0];
        assert!(*status >= 500, "{way:?}: {status} {first}");
        for (s, _, b) in &results {
            assert_eq!((s, b), (status, first), "{way:?}: a follower got another error");
        }
        let started = Instant::now();
        let results = collect(wave_at(&app, way.path(), ACME, &body, 50).await).await;
        assert!(started.elapsed() < Duration::from_secs(5), "past the negative TTL");
        assert_eq!(app.calls(), 1, "{way:?}: waiters re-attacked a failing provider");
        assert!(results.iter().all(|(s, o, _)| s == status && o == "negative-hit"));
        app.stop().await;
    }
}

each_way! {
    /// A double click (twenty identical requests with one
    /// `Idempotency-Key`) is one job and one call, every click its answer;
    /// the same key with another payload is 409.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_double_click_is_one_job_and_another_payload_is_409(way) {
        let app = way.start(holding()).await;
        let body = way.body("Charge order 45");
        let clicks: Vec<_> = (0..20)
            .map(|_| {
                let (client, url, body) = (app.client.clone(), app.url(way.path()), body.clone());
                tokio::spawn(async move {
                    let r = client
                        .post(url)
                        .bearer_auth(ACME)
                        .header("idempotency-key", "click-1")
                        .json(&body)
                        .send()
                        .await
                        .unwrap();
                    let job = r.headers()["idem-job-id"].to_str().unwrap().to_string();
                    (r.status().as_u16(), job, r.json::<Value>().await.unwrap())
                })
            })
            .collect();
        held(&app.mock, 1).await;
        release(&app.mock, None).await;
        let results = collect(clicks).await;
        assert_eq!(app.calls(), 1, "{way:?}");
        let jobs: HashSet<&str> = results.iter().map(|(_, j, _)| j.as_str()).collect();
        assert_eq!(jobs.len(), 1, "{way:?}: {jobs:?}");
        for (s, _, v) in &results {
            assert_eq!(*s, 200, "{way:?}: {v}");
            assert_eq!(way.text(v), "mock answer #1 to: Charge order 45", "{way:?}");
        }
        let other = way.body("Charge order 46");
        let r = ask(&app, way, ACME, &other, &[("idempotency-key", "click-1")]).await;
        assert_eq!(r.status(), 409, "{way:?}");
        let text = r.text().await.unwrap();
        assert!(text.contains("Idempotency-Key") || text.contains("idempotency"), "{text}");
        assert_eq!(app.calls(), 1);
        app.stop().await;
    }
}

each_way! {
    /// A timeout is `unknown`, never `failed`: the job stays running, a
    /// retry is refused, and asking again with the key makes no call.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_timeout_is_unknown_and_refuses_a_retry(way) {
        let app = way
            .start(Spec {
                primary: Behaviour {
                    hang: true,
                    ..Behaviour::default()
                },
                server: "request_timeout = \"1s\"\n".into(),
                provider_timeout: "5s".into(),
                attempts: "timeout = \"300ms\"\nmax = 3\n".into(),
                ..Spec::default()
            })
            .await;
        let body = way.body("will hang");
        let key = [("idempotency-key", "slow-1")];
        let r = ask(&app, way, ACME, &body, &key).await;
        assert_eq!(r.status(), 504, "{way:?}");
        let id = r.headers()["idem-job-id"].to_str().unwrap().to_string();
        let j = job_until(&app, &id, |j| j["attempts"][0]["state"] == "unknown").await;
        assert_eq!(j["attempts"][0]["reason"], "timeout");
        assert_eq!(j["state"], "running", "{way:?}: an unknown attempt must hold the job");
        let r = app
            .post_json(ACME, &format!("/v1/jobs/{id}/attempts"), &json!({}), &[])
            .await;
        assert_error(r, 409, "attempt_in_progress").await;
        let r = ask(&app, way, ACME, &body, &key).await;
        assert!(matches!(r.status().as_u16(), 409 | 504), "{way:?}: {}", r.status());
        let (_, j) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
        assert_eq!(j["attempts"].as_array().unwrap().len(), 1, "{way:?}: {j}");
        assert_eq!(app.calls(), 1, "{way:?}");
        app.stop().await;
    }
}

each_way! {
    /// Two attempts of one job (the first held, a hedge after it) finish
    /// in reverse order: the second to return loses, changes nothing, and
    /// its answer reaches no one.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn reverse_order_finish_the_second_to_return_loses(way) {
        let app = way
            .start(Spec {
                primary: Behaviour {
                    hold: true,
                    ..Behaviour::default()
                },
                fallback: Some(Behaviour {
                    hold: true,
                    ..Behaviour::default()
                }),
                attempts: "hedge_after = \"100ms\"\n".into(),
                ..Spec::default()
            })
            .await;
        let fallback = app.fallback.as_ref().unwrap();
        let body = way.body("who wins");
        let asking = {
            let (client, url, body) = (app.client.clone(), app.url(way.path()), body.clone());
            tokio::spawn(async move {
                client
                    .post(url)
                    .bearer_auth(ACME)
                    .header("idempotency-key", "race-1")
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
            })
        };
        let a = held(&app.mock, 1).await;
        let b = held(fallback, 1).await;
        release_with(fallback, json!({"seq": b[0], "content": "ANSWER-FROM-B"})).await;
        let r = asking.await.unwrap();
        assert_eq!(r.status(), 200, "{way:?}");
        let j = job_of(&app, &r).await;
        let id = j["id"].as_str().unwrap().to_string();
        assert_eq!(way.text(&r.json::<Value>().await.unwrap()), "ANSWER-FROM-B");
        let j = job_until(&app, &id, |j| j["state"] == "succeeded").await;
        assert_eq!(j["completed_by"], 2);
        let version = j["version"].clone();
        release_with(&app.mock, json!({"seq": a[0], "content": "ANSWER-FROM-A"})).await;
        let j = job_until(&app, &id, |j| j["attempts"][0]["state"] == "discarded").await;
        assert_eq!(j["completed_by"], 2);
        assert_eq!(j["version"], version, "{way:?}: the loser changed the job");
        assert_eq!(way.text(&j["result"]), "ANSWER-FROM-B", "{way:?}: {j}");
        assert!(!j.to_string().contains("ANSWER-FROM-A"), "{way:?}: the loser's payload leaked");
        // Asked again: the job's answer, the winner's.
        let r = ask(&app, way, ACME, &body, &[("idempotency-key", "race-1")]).await;
        assert_eq!(way.text(&r.json::<Value>().await.unwrap()), "ANSWER-FROM-B");
        app.stop().await;
    }
}

each_way! {
    /// Garbage with a 200 (not JSON, cut short, an error object, an error
    /// inside a stream) is never anybody's success: a 502 for a plain
    /// request, a stream that does not end as a success ends for a
    /// streamed one, negatively cached and never in the result cache.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn garbage_is_never_a_success(way) {
        // The breaker off: eight garbage answers in a row would open it.
        let app = way
            .start(Spec {
                extra: "[breaker]\nfailures = 0\n".into(),
                ..Spec::default()
            })
            .await;
        let mut calls = 0;
        for garbage in [
            Garbage::NotJson,
            Garbage::Truncated,
            Garbage::ErrorObject,
            Garbage::StreamError,
        ] {
            app.mock.set_behaviour(Behaviour {
                garbage: Some(garbage),
                ..Behaviour::default()
            });
            let prompt = format!("garbage {garbage:?}");
            let r = ask(&app, way, ACME, &way.body(&prompt), &[]).await;
            calls += 1;
            let status = r.status().as_u16();
            let text = r.text().await.unwrap();
            assert_eq!(status, 502, "{way:?} {garbage:?}: {text}");
            assert_eq!(app.calls(), calls);
            // Kept as a failure: the next asker gets it without a call.
            let again = ask(&app, way, ACME, &way.body(&prompt), &[]).await;
            assert_eq!(again.status(), 502, "{way:?} {garbage:?}: {:?}", again.headers());
            assert_eq!(again.headers()["idem-outcome"], "negative-hit", "{way:?} {garbage:?}");
            assert_eq!(app.calls(), calls);

            // Another prompt: `stream` is no part of the task.
            let streamed = way.streamed(&format!("{prompt}, streamed"));
            let r = ask(&app, way, ACME, &streamed, &[]).await;
            calls += 1;
            let status = r.status().as_u16();
            let text = r.text().await.unwrap();
            assert!(
                status == 502 || (status == 200 && !way.stream_succeeded(&text)),
                "{way:?} {garbage:?}: a garbage stream ended as a success: {status} {text}"
            );
            assert_eq!(app.calls(), calls);
        }
        app.stop().await;
    }
}
