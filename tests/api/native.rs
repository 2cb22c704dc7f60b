//! Same dialect on both sides: the provider's bytes reach every client
//! (docs/design.md, "Endpoints: one core, several dialects"). A recording
//! proxy between idem and the mock keeps each answer exactly as the
//! provider wrote it; the leader, twenty followers and a cache hit each get
//! its events, event for event, byte for byte.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::IntoResponse;
use idem::config::ProviderKind;
use serde_json::{Value, json};

use crate::helpers::*;

/// What the proxy saw the provider answer, per call.
type Answers = Arc<Mutex<Vec<Bytes>>>;

/// A proxy in front of `upstream` that sends each request on as it came
/// and keeps each answer's body whole before passing it back unchanged.
async fn recording_proxy(upstream: SocketAddr) -> (SocketAddr, Answers) {
    let answers: Answers = Arc::default();
    let kept = answers.clone();
    let http = reqwest::Client::new();
    let app = axum::Router::new().fallback(
        move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let (http, kept) = (http.clone(), kept.clone());
            async move {
                let mut forwarded = HeaderMap::new();
                for (k, v) in &headers {
                    if k != "host" && k != "content-length" {
                        forwarded.append(k.clone(), v.clone());
                    }
                }
                let r = http
                    .request(method, format!("http://{upstream}{uri}"))
                    .headers(forwarded)
                    .body(body)
                    .send()
                    .await
                    .unwrap();
                let status = StatusCode::from_u16(r.status().as_u16()).unwrap();
                let kind = r.headers().get("content-type").cloned();
                let bytes = r.bytes().await.unwrap();
                kept.lock().unwrap().push(bytes.clone());
                let mut resp = (status, bytes).into_response();
                if let Some(kind) = kind {
                    resp.headers_mut().insert("content-type", kind);
                }
                resp
            }
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, answers)
}

/// A gateway whose primary (of `kind`, holding every call) is reached
/// through a recording proxy.
async fn recorded(kind: ProviderKind, provider_extra: &str) -> (TestApp, Answers) {
    let spec = Spec {
        primary_kind: kind,
        provider_extra: provider_extra.into(),
        cache: "ttl = \"60s\"\n".into(),
        ..holding()
    };
    let mut answers = None;
    let app = TestApp::with_config(spec, |text, mocks| {
        let mock = mocks.primary.addr();
        // The proxy's address goes into the configuration in place of the
        // mock's.
        let handle = tokio::runtime::Handle::current();
        let (proxy, kept) = tokio::task::block_in_place(|| handle.block_on(recording_proxy(mock)));
        answers = Some(kept);
        text.replace(&mock.to_string(), &proxy.to_string())
    })
    .await;
    (app, answers.unwrap())
}

/// A stream's events, each as its text between blank lines.
fn events(body: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(body)
        .replace("\r\n", "\n")
        .split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Sends `body` to `path` from one leader and twenty followers while the
/// provider holds the call, then once more for a cache hit; every client's
/// events are the provider's, and the cache hit's too.
async fn the_provider_s_stream_reaches_every_client(
    app: &TestApp,
    answers: &Answers,
    path: &'static str,
    body: Value,
    headers: &'static [(&'static str, &'static str)],
) -> Vec<String> {
    let send = || {
        let r = app.client.post(app.url(path)).bearer_auth(ACME).json(&body);
        let r = headers.iter().fold(r, |r, (k, v)| r.header(*k, *v));
        async move {
            let r = r.send().await.unwrap();
            let status = r.status().as_u16();
            let outcome = r.headers()["idem-outcome"].to_str().unwrap().to_string();
            (status, outcome, r.bytes().await.unwrap())
        }
    };
    let leader = tokio::spawn(send());
    held(&app.mock, 1).await;
    let followers: Vec<_> = (0..20).map(|_| tokio::spawn(send())).collect();
    app.until_followers(20).await;
    release(&app.mock, None).await;
    let mut got = vec![leader.await.unwrap()];
    for f in followers {
        got.push(f.await.unwrap());
    }
    got.push(send().await);
    assert_eq!(app.calls(), 1);
    let provider = answers.lock().unwrap().clone();
    assert_eq!(provider.len(), 1, "one call through the proxy");
    let expected = events(&provider[0]);
    assert!(expected.len() > 5, "{expected:?}");
    for (i, (status, outcome, bytes)) in got.iter().enumerate() {
        assert_eq!(*status, 200, "client {i}");
        let want = match i {
            0 => "leader",
            21 => "cache-hit",
            _ => "follower",
        };
        assert_eq!(outcome, want, "client {i}");
        assert_eq!(
            events(bytes),
            expected,
            "client {i} ({outcome}) got other events than the provider's"
        );
    }
    expected
}

/// A Messages stream from an Anthropic target, with thinking and its
/// signature, redacted thinking, a server tool call and its result and a
/// cited text, reaches the leader, twenty followers and a cache hit as the
/// provider wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_anthropic_stream_reaches_every_client_as_the_provider_wrote_it() {
    let (app, answers) = recorded(ProviderKind::Anthropic, "").await;
    let body = json!({
        "model": "bot",
        "max_tokens": 2048,
        "stream": true,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}],
        "messages": [{"role": "user", "content": "search the web for otters, and redact"}],
    });
    let events = the_provider_s_stream_reaches_every_client(
        &app,
        &answers,
        "/v1/messages",
        body,
        &[("anthropic-version", "2023-06-01")],
    )
    .await;
    let all = events.join("\n");
    for needle in [
        "\"thinking\"",
        "signature_delta",
        "redacted_thinking",
        "server_tool_use",
        "web_search_tool_result",
        "citations_delta",
        "message_stop",
    ] {
        assert!(all.contains(needle), "no {needle} in {all}");
    }
    app.stop().await;
}

/// A Responses stream from a `responses_api` target, with a reasoning item
/// and its encrypted content, a web search call and a custom tool call,
/// reaches the leader, twenty followers and a cache hit as the provider
/// wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_responses_stream_reaches_every_client_as_the_provider_wrote_it() {
    let (app, answers) = recorded(ProviderKind::Openai, "responses_api = true\n").await;
    let body = json!({
        "model": "bot",
        "stream": true,
        "store": false,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"effort": "medium", "summary": "auto"},
        "tools": [
            {"type": "web_search"},
            {"type": "custom", "name": "apply_patch", "description": "Applies a patch",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        ],
        "input": "search the web, then call tool apply_patch",
    });
    let events =
        the_provider_s_stream_reaches_every_client(&app, &answers, "/v1/responses", body, &[])
            .await;
    let all = events.join("\n");
    for needle in [
        "\"type\":\"reasoning\"",
        "encrypted_content",
        "web_search_call",
        "custom_tool_call",
        "response.completed",
    ] {
        assert!(all.contains(needle), "no {needle} in {all}");
    }
    app.stop().await;
}
