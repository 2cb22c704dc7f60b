//! The hostile probes' smaller findings, each against the real gateway:
//! `/metrics` behind the admin key answers like every admin endpoint, the
//! Responses face's errors name Responses fields, and message ids never
//! carry a doubled prefix.

use idem::config::ProviderKind;
use serde_json::{Value, json};

use crate::helpers::*;

/// With `admin.metrics_require_key = true`, `/metrics` without a key or
/// with an unknown one is 401 `invalid_api_key`, as on every admin
/// endpoint; a tenant's key is 403; the admin key gets the metrics.
#[tokio::test]
async fn metrics_behind_the_admin_key_answer_like_every_admin_endpoint() {
    let app = TestApp::with(Spec {
        admin: "metrics_require_key = true\n".into(),
        ..Spec::default()
    })
    .await;
    let get = |key: Option<&'static str>| {
        let mut r = app.client.get(app.url("/metrics"));
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    assert_error(get(None).await.unwrap(), 401, "invalid_api_key").await;
    assert_error(
        get(Some("sk-nobody")).await.unwrap(),
        401,
        "invalid_api_key",
    )
    .await;
    // The same as an admin endpoint says to a caller with no key.
    let stats = app
        .client
        .get(app.url("/v1/admin/routes"))
        .send()
        .await
        .unwrap();
    assert_eq!(stats.status(), 401);
    assert_error(get(Some(ACME)).await.unwrap(), 403, "admin_key_required").await;
    let ok = get(Some(ADMIN)).await.unwrap();
    assert_eq!(ok.status(), 200);
    assert!(ok.text().await.unwrap().contains("idem_"));
    app.stop().await;
}

/// A bad Responses request routed to a chat target is refused naming the
/// Responses field the client wrote (`max_output_tokens`, `input`), never
/// the chat field idem would have translated it to.
#[tokio::test]
async fn responses_errors_name_the_responses_fields() {
    let app = TestApp::spawn().await;
    let cases = [
        (
            json!({"model": "bot", "input": "hi", "max_output_tokens": -1}),
            "max_output_tokens",
        ),
        (
            json!({"model": "bot", "input": "hi", "max_output_tokens": "many"}),
            "max_output_tokens",
        ),
        (json!({"model": "bot", "input": 5}), "input"),
        (
            json!({"model": "bot", "input": "hi", "temperature": 9}),
            "temperature",
        ),
        (json!({"model": "bot"}), "input"),
    ];
    for (body, param) in cases {
        let r = app
            .client
            .post(app.url("/v1/responses"))
            .bearer_auth(ACME)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(
            !message.contains("max_completion_tokens") && !message.contains("`messages`"),
            "{body}: {v}"
        );
    }
    assert_eq!(app.calls(), 0);
    app.stop().await;
}

async fn post(app: &TestApp, path: &str, body: Value) -> (u16, Value) {
    let r = app.post_json(ACME, path, &body, &[]).await;
    (r.status().as_u16(), r.json().await.unwrap())
}

fn no_doubled_prefix(id: &str) {
    for p in [
        "msg_msg_",
        "chatcmpl-chatcmpl-",
        "resp_resp_",
        "msg_chatcmpl",
    ] {
        assert!(!id.contains(p), "{id}");
    }
}

/// Message ids: a Messages request to an Anthropic target keeps the
/// provider's id as written; one translated from a chat target gets one
/// `msg_` prefix; a chat request to an Anthropic target and a Responses
/// request to either kind carry no doubled prefix.
#[tokio::test]
async fn message_ids_never_carry_a_doubled_prefix() {
    for kind in [ProviderKind::Anthropic, ProviderKind::Openai] {
        let app = TestApp::with(Spec {
            primary_kind: kind,
            ..Spec::default()
        })
        .await;
        let (status, messages) = post(
            &app,
            "/v1/messages",
            json!({"model": "bot", "max_tokens": 16, "messages": [{"role": "user", "content": "ids"}]}),
        )
        .await;
        assert_eq!(status, 200, "{kind:?}: {messages}");
        let id = messages["id"].as_str().unwrap();
        assert!(id.starts_with("msg_"), "{kind:?}: {id}");
        no_doubled_prefix(id);
        if kind == ProviderKind::Anthropic {
            // As the provider wrote it.
            assert!(id.starts_with("msg_mock_"), "{id}");
        }
        let chat = app.chat(ACME, &chat_body("ids")).await;
        assert_eq!(chat.status(), 200);
        let chat: Value = chat.json().await.unwrap();
        no_doubled_prefix(chat["id"].as_str().unwrap());
        let (status, responses) = post(
            &app,
            "/v1/responses",
            json!({"model": "bot", "input": "ids"}),
        )
        .await;
        assert_eq!(status, 200, "{kind:?}: {responses}");
        no_doubled_prefix(responses["id"].as_str().unwrap());
        for item in responses["output"].as_array().unwrap() {
            no_doubled_prefix(item["id"].as_str().unwrap_or_default());
        }
        app.stop().await;
    }
}
