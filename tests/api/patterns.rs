//! Routes that match model names by pattern (`claude-*`), as agents ask
//! for a dozen model ids: the asked name goes on to the target, an exact
//! route wins, the longest pattern next, `GET /v1/models` lists them, and
//! the fingerprint and jobs keep the asked name.

use serde_json::{Value, json};

use crate::helpers::*;

const PATTERN_ROUTES: &str = r#"
[[routes]]
model = "claude-*"
targets = [{ provider = "primary", model = "{model}" }]

[[routes]]
model = "claude-opus-*"
targets = [{ provider = "primary", model = "big-{model}" }]

[[routes]]
model = "claude-opus-4-8"
targets = [{ provider = "primary", model = "exact-opus" }]
"#;

async fn app() -> TestApp {
    TestApp::with(Spec {
        primary_kind: idem::config::ProviderKind::Anthropic,
        extra: PATTERN_ROUTES.into(),
        ..Spec::default()
    })
    .await
}

fn ask(model: &str, content: &str) -> Value {
    let mut body = Face::Messages.body(content);
    body["model"] = json!(model);
    body
}

#[tokio::test]
async fn a_pattern_route_sends_the_asked_name_and_the_exact_route_wins() {
    let app = app().await;
    let last_model = || {
        app.mock.stats().last_requests.pop().unwrap().body["model"]
            .as_str()
            .unwrap()
            .to_string()
    };
    for (asked, sent) in [
        ("claude-haiku-4-5-20251001", "claude-haiku-4-5-20251001"),
        ("claude-opus-5", "big-claude-opus-5"),
        ("claude-opus-4-8", "exact-opus"),
    ] {
        let r = app
            .ask(Face::Messages, ACME, &ask(asked, "hello"), &[])
            .await;
        assert_eq!(r.status(), 200, "{asked}");
        assert_eq!(last_model(), sent, "{asked}");
    }
    let r = app
        .ask(Face::Messages, ACME, &ask("gpt-4o", "hello"), &[])
        .await;
    assert_eq!(r.status(), 404, "no route matches");

    // Two names of one pattern are two models: never one answer.
    let calls = app.calls();
    for model in ["claude-a", "claude-b"] {
        let r = app
            .ask(Face::Messages, ACME, &ask(model, "same words"), &[])
            .await;
        assert_eq!(r.status(), 200);
    }
    assert_eq!(app.calls(), calls + 2);

    // The models list names the patterns as they are configured.
    let (status, models) = app.get_json(ACME, "/v1/models").await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    for id in ["bot", "claude-*", "claude-opus-*", "claude-opus-4-8"] {
        assert!(ids.contains(&id), "{models}");
    }
    app.stop().await;
}

/// A job on a pattern route keeps the name it was asked for: its attempts
/// (and a retry after a restart) go to the same upstream model.
#[tokio::test]
async fn a_job_on_a_pattern_route_keeps_the_asked_name() {
    let app = app().await;
    let r = app
        .post_json(
            ACME,
            "/v1/jobs",
            &json!({"request": {"model": "claude-sonnet-4-5",
                "messages": [{"role": "user", "content": "a job"}]}}),
            &[("idempotency-key", "pattern-job")],
        )
        .await;
    assert!(r.status().is_success(), "{}", r.status());
    let job: Value = r.json().await.unwrap();
    let id = job["id"].as_str().unwrap().to_string();
    eventually_async(std::time::Duration::from_secs(10), || {
        let (app, id) = (&app, &id);
        async move {
            let (_, v) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
            v["state"] == "succeeded"
        }
    })
    .await;
    let (_, done) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
    assert_eq!(done["route"], "claude-sonnet-4-5", "{done}");
    let sent = app.mock.stats().last_requests.pop().unwrap().body;
    assert_eq!(sent["model"], "claude-sonnet-4-5");
    app.stop().await;
}
