//! OpenTelemetry traces, received by an OTLP/HTTP collector of the test's
//! own that decodes them with the official protocol definitions: a wave's
//! leader and its provider call, its followers' waits linked to that call,
//! the GenAI attributes, the client's `traceparent`; and a collector that
//! is down costs requests nothing while the dropped spans are counted.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use crate::helpers::*;

/// The client's trace: `traceparent` of a span of its own.
const TRACE_ID: &str = "0af7651916cd43dd8448eb211c80319c";
const CLIENT_SPAN: &str = "b7ad6b7169203331";

/// An OTLP/HTTP collector on a free port: every span it receives.
async fn collector() -> (String, Arc<Mutex<Vec<Span>>>) {
    let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
    let kept = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let kept = kept.clone();
            async move {
                let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                let mut all = kept.lock().unwrap();
                for resource in request.resource_spans {
                    for scope in resource.scope_spans {
                        all.extend(scope.spans);
                    }
                }
                (
                    [("content-type", "application/x-protobuf")],
                    Vec::<u8>::new(),
                )
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (format!("http://{addr}"), spans)
}

fn attr(span: &Span, key: &str) -> Option<AnyValue> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.clone()?.value)
}

fn text(span: &Span, key: &str) -> String {
    match attr(span, key) {
        Some(AnyValue::StringValue(s)) => s,
        other => panic!("{key} of {}: {other:?}", span.name),
    }
}

fn int(span: &Span, key: &str) -> i64 {
    match attr(span, key) {
        Some(AnyValue::IntValue(n)) => n,
        other => panic!("{key} of {}: {other:?}", span.name),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waves_followers_link_to_the_leaders_provider_call_under_the_clients_trace() {
    let (url, spans) = collector().await;
    let app = TestApp::with(Spec {
        extra: format!("\n[telemetry]\notlp_endpoint = \"{url}\"\nexport_interval = \"100ms\"\n"),
        ..holding()
    })
    .await;
    let body = chat_body("trace me");
    // The leader first, under the client's trace.
    let leader = {
        let (client, url, body) = (
            app.client.clone(),
            app.url("/v1/chat/completions"),
            body.clone(),
        );
        tokio::spawn(async move {
            client
                .post(url)
                .bearer_auth(ACME)
                .header("traceparent", format!("00-{TRACE_ID}-{CLIENT_SPAN}-01"))
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    held(&app.mock, 1).await;
    let followers = wave(&app, ACME, &body, 4).await;
    app.until_followers(4).await;
    release(&app.mock, None).await;
    assert_eq!(leader.await.unwrap(), 200);
    for (status, outcome, _) in collect(followers).await {
        assert_eq!((status, outcome.as_str()), (200, "follower"));
    }
    assert_eq!(app.calls(), 1);

    // 5 request spans, a provider call, a cache lookup each and 4 waits.
    eventually(Duration::from_secs(20), || {
        let s = spans.lock().unwrap();
        s.iter().filter(|s| s.name == "chat bot").count() == 5
            && s.iter().filter(|s| s.name == "coalesce wait").count() == 4
            && s.iter().any(|s| s.name == "provider call")
    })
    .await;
    let spans = spans.lock().unwrap().clone();
    let hex = |b: &[u8]| hex::encode(b);
    let call = spans.iter().find(|s| s.name == "provider call").unwrap();
    let requests: Vec<&Span> = spans.iter().filter(|s| s.name == "chat bot").collect();
    let leader = requests
        .iter()
        .find(|s| text(s, "idem.outcome") == "leader")
        .unwrap();
    // The leader's span is the client's span's child, in the client's trace.
    assert_eq!(hex(&leader.trace_id), TRACE_ID);
    assert_eq!(hex(&leader.parent_span_id), CLIENT_SPAN);
    assert_eq!(leader.kind, 2, "SERVER");
    // The GenAI attributes, and idem's own.
    assert_eq!(text(leader, "gen_ai.operation.name"), "chat");
    assert_eq!(text(leader, "gen_ai.request.model"), "bot");
    assert_eq!(text(leader, "gen_ai.response.model"), "gpt-4o-mini");
    assert_eq!(text(leader, "gen_ai.provider.name"), "openai");
    assert!(int(leader, "gen_ai.usage.input_tokens") > 0);
    assert!(int(leader, "gen_ai.usage.output_tokens") > 0);
    assert_eq!(text(leader, "idem.tenant"), "acme");
    assert!(text(leader, "idem.fingerprint").starts_with("v1:"));
    // The provider call is the leader's child, and the provider got its
    // trace context.
    assert_eq!(call.kind, 3, "CLIENT");
    assert_eq!(call.parent_span_id, leader.span_id);
    assert_eq!(call.trace_id, leader.trace_id);
    let sent = app.mock.calls()[0].traceparent.clone().unwrap();
    assert_eq!(sent, format!("00-{TRACE_ID}-{}-01", hex(&call.span_id)));
    // Each follower's wait is its request's child and links to the call
    // that answered it.
    let followers: Vec<&&Span> = requests
        .iter()
        .filter(|s| text(s, "idem.outcome") == "follower")
        .collect();
    assert_eq!(followers.len(), 4);
    for f in followers {
        assert_ne!(hex(&f.trace_id), TRACE_ID, "a trace of its own");
        let wait = spans
            .iter()
            .find(|s| s.name == "coalesce wait" && s.parent_span_id == f.span_id)
            .unwrap_or_else(|| panic!("no wait under {}", hex(&f.span_id)));
        assert_eq!(wait.links.len(), 1, "{wait:?}");
        assert_eq!(wait.links[0].span_id, call.span_id);
        assert_eq!(wait.links[0].trace_id, call.trace_id);
    }
    app.stop().await;
}

#[tokio::test]
async fn a_collector_that_is_down_costs_requests_nothing_and_dropped_spans_are_counted() {
    // A port nobody listens on.
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let app = TestApp::with(Spec {
        extra: format!(
            "\n[telemetry]\notlp_endpoint = \"http://{closed}\"\nexport_interval = \"50ms\"\nexport_timeout = \"500ms\"\n"
        ),
        ..Spec::default()
    })
    .await;
    for i in 0..20 {
        let r = app.chat(ACME, &chat_body(&format!("question {i}"))).await;
        assert_eq!(r.status(), 200);
    }
    let dropped = || async {
        let text = app.metrics().await;
        text.lines()
            .find_map(|l| l.strip_prefix("idem_trace_spans_dropped_total "))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while dropped().await < 20.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "dropped spans not counted"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    app.stop().await;
}
