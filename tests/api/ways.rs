//! The jobs' race and garbage on every way through idem: each face (chat
//! completions, Messages, Responses) in front of each kind of provider,
//! native (same dialect on both sides) and translated, one body per test
//! run once per way (`each_way!`). The waves, the failing provider, the
//! double click and the timeout run the same way in `faces.rs`.

use std::time::Duration;

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
    app.post_json(key, way.face.path(), body, headers).await
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
        let body = way.face.body("who wins");
        let asking = {
            let (client, url, body) = (app.client.clone(), app.url(way.face.path()), body.clone());
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
        assert_eq!(way.face.text(&r.json::<Value>().await.unwrap()), "ANSWER-FROM-B");
        let j = job_until(&app, &id, |j| j["state"] == "succeeded").await;
        assert_eq!(j["completed_by"], 2);
        let version = j["version"].clone();
        release_with(&app.mock, json!({"seq": a[0], "content": "ANSWER-FROM-A"})).await;
        let j = job_until(&app, &id, |j| j["attempts"][0]["state"] == "discarded").await;
        assert_eq!(j["completed_by"], 2);
        assert_eq!(j["version"], version, "{way:?}: the loser changed the job");
        assert_eq!(way.face.text(&j["result"]), "ANSWER-FROM-B", "{way:?}: {j}");
        assert!(!j.to_string().contains("ANSWER-FROM-A"), "{way:?}: the loser's payload leaked");
        // Asked again: the job's answer, the winner's.
        let r = ask(&app, way, ACME, &body, &[("idempotency-key", "race-1")]).await;
        assert_eq!(way.face.text(&r.json::<Value>().await.unwrap()), "ANSWER-FROM-B");
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
            let r = ask(&app, way, ACME, &way.face.body(&prompt), &[]).await;
            calls += 1;
            let status = r.status().as_u16();
            let text = r.text().await.unwrap();
            assert_eq!(status, 502, "{way:?} {garbage:?}: {text}");
            assert_eq!(app.calls(), calls);
            // Kept as a failure: the next asker gets it without a call.
            let again = ask(&app, way, ACME, &way.face.body(&prompt), &[]).await;
            assert_eq!(again.status(), 502, "{way:?} {garbage:?}: {:?}", again.headers());
            assert_eq!(again.headers()["idem-outcome"], "negative-hit", "{way:?} {garbage:?}");
            assert_eq!(app.calls(), calls);

            // Another prompt: `stream` is no part of the task.
            let streamed = way.face.streamed(&format!("{prompt}, streamed"));
            let r = ask(&app, way, ACME, &streamed, &[]).await;
            calls += 1;
            let status = r.status().as_u16();
            let text = r.text().await.unwrap();
            assert!(
                status == 502 || (status == 200 && !way.face.stream_succeeded(&text)),
                "{way:?} {garbage:?}: a garbage stream ended as a success: {status} {text}"
            );
            assert_eq!(app.calls(), calls);
        }
        app.stop().await;
    }
}
