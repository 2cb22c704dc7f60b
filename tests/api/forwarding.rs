//! The client headers that change an answer in its dialect
//! (`anthropic-beta`, `anthropic-version`; `OpenAI-Beta`) go on to a target
//! of that dialect and are part of the task; `?beta=true` (Anthropic's
//! SDKs' beta resource, Claude Code) is accepted.

use idem::config::ProviderKind;
use serde_json::{Value, json};

use crate::helpers::*;

fn fingerprint(r: &reqwest::Response) -> String {
    r.headers()["idem-fingerprint"]
        .to_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn anthropic_headers_go_to_an_anthropic_target_and_change_the_task() {
    let app = TestApp::with(Spec {
        primary_kind: ProviderKind::Anthropic,
        ..Spec::default()
    })
    .await;
    let body = Face::Messages.body("which betas");
    let beta = [
        (
            "anthropic-beta",
            "context-management-2025-06-27,interleaved-thinking-2025-05-14",
        ),
        ("anthropic-version", "2023-06-01"),
    ];
    let path = "/v1/messages?beta=true";
    let first = app.post_json(ACME, path, &body, &beta).await;
    assert_eq!(first.status(), 200);
    let sent = app.mock.stats().last_requests.pop().unwrap();
    assert_eq!(sent.anthropic_beta.as_deref(), Some(beta[0].1));
    assert_eq!(sent.anthropic_version.as_deref(), Some("2023-06-01"));

    // The same headers: the same task (a cache hit, no call).
    let calls = app.calls();
    let again = app.post_json(ACME, path, &body, &beta).await;
    assert_eq!(again.status(), 200);
    assert_eq!(fingerprint(&again), fingerprint(&first));
    assert_eq!(again.headers()["idem-outcome"], "cache-hit");
    assert_eq!(app.calls(), calls);

    // Another beta list, or none: another task, its own call.
    let other = [("anthropic-beta", "interleaved-thinking-2025-05-14")];
    let r = app.post_json(ACME, path, &body, &other).await;
    assert_eq!(r.status(), 200);
    assert_ne!(fingerprint(&r), fingerprint(&first));
    assert_eq!(app.calls(), calls + 1);
    let r = app.post_json(ACME, "/v1/messages", &body, &[]).await;
    assert_eq!(r.status(), 200);
    assert_ne!(fingerprint(&r), fingerprint(&first));
    assert_eq!(app.calls(), calls + 2);
    assert_eq!(
        app.mock.stats().last_requests.pop().unwrap().anthropic_beta,
        None
    );

    // count_tokens under the beta resource too.
    let r = app
        .post_json(
            ACME,
            "/v1/messages/count_tokens?beta=true",
            &json!({"model": "bot",
            "messages": [{"role": "user", "content": "count me"}]}),
            &beta,
        )
        .await;
    assert_eq!(r.status(), 200);
    let counted: Value = r.json().await.unwrap();
    assert!(counted["input_tokens"].as_u64().unwrap() > 0, "{counted}");
    app.stop().await;
}

/// `OpenAI-Beta` goes to an OpenAI-compatible target with a chat request
/// and counts; a Messages request translated for that target sends no
/// Anthropic header on (the target would not know it), but its headers
/// still tell two tasks apart.
#[tokio::test]
async fn openai_beta_goes_on_and_translation_sends_no_foreign_header() {
    let app = TestApp::spawn().await;
    let body = chat_body("a beta question");
    let r = app
        .chat_with(ACME, &body, &[("openai-beta", "assistants=v2")])
        .await;
    assert_eq!(r.status(), 200);
    let with = fingerprint(&r);
    assert_eq!(
        app.mock
            .stats()
            .last_requests
            .pop()
            .unwrap()
            .openai_beta
            .as_deref(),
        Some("assistants=v2")
    );
    let r = app.chat(ACME, &body).await;
    assert_ne!(fingerprint(&r), with);

    let messages = Face::Messages.body("translated");
    let beta = [("anthropic-beta", "context-management-2025-06-27")];
    let a = app.ask(Face::Messages, ACME, &messages, &beta).await;
    assert_eq!(a.status(), 200);
    let sent = app.mock.stats().last_requests.pop().unwrap();
    assert_eq!(sent.anthropic_beta, None);
    let b = app.ask(Face::Messages, ACME, &messages, &[]).await;
    assert_ne!(fingerprint(&a), fingerprint(&b));
    app.stop().await;
}
