//! Provenance: a job's result is credited to the attempt, so to the provider
//! and model, that produced it. Found by the chaos test: a hedge on the
//! fallback completed a job with the answer the primary had just put in the
//! result cache, and the job named the fallback as its source.

use std::time::Duration;

use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::helpers::*;

#[tokio::test]
async fn an_attempt_is_never_completed_with_another_targets_cached_answer() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            fail_status: Some(500),
            ..Behaviour::default()
        },
        fallback: Some(Behaviour::default()),
        ..Spec::default()
    })
    .await;
    // A chat completion fails over: the fallback's answer is now in the
    // result cache under this request's fingerprint.
    let body = chat_body("who answers?");
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.status(), 200);
    let answer: Value = r.json().await.unwrap();
    assert_eq!(answer["model"], "llama-3.1-8b");

    // The primary is healthy again. A job with the same request runs its
    // first attempt on the primary: that attempt asks the primary, it does
    // not take the fallback's cached answer as its own.
    app.mock.set_behaviour(Behaviour::default());
    let created: Value = app
        .post_json(
            ACME,
            "/v1/jobs",
            &json!({"request": body}),
            &[("idempotency-key", "provenance-1")],
        )
        .await
        .json()
        .await
        .unwrap();
    let id = created["id"].as_str().unwrap().to_string();
    let mut job = Value::Null;
    for _ in 0..500 {
        job = app.get_json(ACME, &format!("/v1/jobs/{id}")).await.1;
        if job["state"] == "succeeded" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(job["state"], "succeeded", "{job}");
    let n = job["completed_by"].as_u64().unwrap() as usize;
    let winner = &job["attempts"][n - 1];
    assert_eq!(
        job["result"]["model"], winner["model"],
        "the result came from another target than its attempt: {job}"
    );
    assert_eq!(winner["model"], "gpt-4o-mini");
    assert_eq!(app.calls(), 2, "the primary was not asked again");
}
