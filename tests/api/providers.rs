//! Provider kinds (docs/providers.md): an Anthropic target behind the
//! OpenAI face (plain, streamed, tool calls, usage, stop reasons, errors,
//! failover across vendors under a contract), and an Azure target (the
//! deployment URL, `api-version` and `api-key` the mock checks).

use std::path::Path;
use std::time::Duration;

use idem::config::ProviderKind;
use idem::mock_upstream::{Behaviour, RecordedRequest};
use serde_json::{Value, json};

use crate::helpers::*;

fn anthropic(primary: Behaviour) -> Spec {
    Spec {
        primary,
        primary_kind: ProviderKind::Anthropic,
        ..Spec::default()
    }
}

fn last_request(app: &TestApp) -> RecordedRequest {
    app.mock
        .stats()
        .last_requests
        .pop()
        .expect("the mock saw no request")
}

fn streamed(mut body: Value) -> Value {
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body
}

/// The SSE events of a stream, as JSON (`[DONE]` left out).
fn chunks(text: &str) -> Vec<Value> {
    text.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

#[tokio::test]
async fn an_anthropic_target_answers_chat_completions_plain_and_streamed() {
    let app = TestApp::with(anthropic(Behaviour::default())).await;
    let mut body = chat_body("Where is my order?");
    body["messages"] = json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is my order?"}
    ]);
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(content_of(&v), "mock answer #1 to: Where is my order?");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0, "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{v}");
    // What went upstream: Anthropic's format, key and version.
    let sent = last_request(&app);
    assert_eq!(sent.x_api_key.as_deref(), Some("idem"));
    assert_eq!(sent.anthropic_version.as_deref(), Some("2023-06-01"));
    assert_eq!(sent.body["system"], "Be brief.");
    assert_eq!(sent.body["max_tokens"], 4096);
    assert_eq!(sent.body["model"], "gpt-4o-mini");
    assert_eq!(
        sent.body["messages"],
        json!([{"role": "user", "content": [{"type": "text", "text": "Where is my order?"}]}])
    );

    // Streamed, with usage, its text in pieces.
    let r = app.chat(ACME, &streamed(chat_body("tell me more"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(sse_content(&text), "mock answer #2 to: tell me more");
    let events = chunks(&text);
    assert!(
        events
            .iter()
            .filter(|e| e["choices"][0]["delta"]["content"].is_string())
            .count()
            > 2
    );
    let usage = events
        .iter()
        .find(|e| e["choices"] == json!([]))
        .expect("a usage chunk");
    assert!(usage["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    let finish: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["finish_reason"].as_str().map(|_| e))
        .collect();
    assert_eq!(finish.len(), 1);
    assert_eq!(finish[0]["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn tool_calls_and_stop_reasons_come_back_as_openai_says_them() {
    let app = TestApp::with(anthropic(Behaviour::default())).await;
    let tools = json!([{"type": "function", "function": {"name": "lookup", "description": "find an order",
        "parameters": {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]}}}]);
    let mut body = chat_body("where is 1234");
    body["tools"] = tools.clone();
    body["tool_choice"] = json!({"type": "function", "function": {"name": "lookup"}});
    let v: Value = app.chat(ACME, &body).await.json().await.unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "lookup");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(args["order"].is_string(), "{args}");
    assert!(call["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(
        last_request(&app).body["tool_choice"],
        json!({"type": "tool", "name": "lookup"})
    );

    // Streamed (its own call, not the cached answer): the arguments
    // arrive in several pieces and assemble.
    let r = app
        .chat_with(
            ACME,
            &streamed(body.clone()),
            &[("cache-control", "no-cache")],
        )
        .await;
    let text = r.text().await.unwrap();
    let pieces = chunks(&text)
        .iter()
        .filter(|e| e["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"].is_string())
        .count();
    assert!(pieces > 2, "{text}");
    let plain: Value = app
        .chat_with(ACME, &body, &[("cache-control", "no-cache")])
        .await
        .json()
        .await
        .unwrap();
    let assembled_args = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|e| {
            e["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .map(str::to_owned)
        })
        .collect::<String>();
    assert_eq!(
        serde_json::from_str::<Value>(&assembled_args).unwrap(),
        serde_json::from_str::<Value>(
            plain["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
                .as_str()
                .unwrap()
        )
        .unwrap()
    );

    // max_tokens: length; a stop sequence: stop, the text cut before it.
    let mut short = chat_body("a long question that needs a long answer");
    short["max_tokens"] = json!(2);
    let v: Value = app.chat(ACME, &short).await.json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert_eq!(content_of(&v).chars().count(), 8);
    let mut stop = chat_body("stop here please");
    stop["stop"] = json!(["here"]);
    let v: Value = app.chat(ACME, &stop).await.json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(!content_of(&v).contains("here"), "{v}");
    assert_eq!(last_request(&app).body["stop_sequences"], json!(["here"]));
}

#[tokio::test]
async fn what_the_messages_api_cannot_say_is_refused_before_it_is_sent() {
    let app = TestApp::with(anthropic(Behaviour::default())).await;
    let mut body = chat_body("two answers please");
    body["n"] = json!(2);
    let r = app.chat(ACME, &body).await;
    let v = assert_error(r, 400, "unsupported_by_provider").await;
    assert!(
        v["error"]["message"].as_str().unwrap().contains("`n`"),
        "{v}"
    );
    assert_eq!(app.calls(), 0);
    // Not an upstream call.
    let metrics = app.metrics().await;
    assert!(
        !metrics.contains("idem_upstream_calls_total{provider=\"primary\""),
        "{metrics}"
    );
}

#[tokio::test]
async fn an_overloaded_anthropic_target_fails_over_to_the_next_one() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            fail_status: Some(529),
            retry_after: Some(3),
            ..Behaviour::default()
        },
        primary_kind: ProviderKind::Anthropic,
        fallback: Some(Behaviour::default()),
        ..Spec::default()
    })
    .await;
    let r = app.chat(ACME, &chat_body("are you there")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-provider"], "fallback");
    assert_eq!(app.calls(), 1);
    assert_eq!(app.fallback.as_ref().unwrap().stats().calls, 1);
    // Counted as the provider answered (529, overloaded) and failed over.
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("idem_upstream_calls_total{provider=\"primary\",status=\"529\"} 1"),
        "{metrics}"
    );

    // A job: attempt 1 on the overloaded target fails, attempt 2 completes
    // on the next one.
    let app = TestApp::with(Spec {
        primary: Behaviour {
            fail_status: Some(529),
            ..Behaviour::default()
        },
        primary_kind: ProviderKind::Anthropic,
        fallback: Some(Behaviour::default()),
        attempts: "max = 2\nbackoff_base = \"10ms\"\nbackoff_max = \"20ms\"\n".into(),
        ..Spec::default()
    })
    .await;
    let r = app
        .post_json(
            ACME,
            "/v1/jobs",
            &json!({"request": chat_body("overloaded job")}),
            &[("idempotency-key", "k-529")],
        )
        .await;
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let job = until_job(&app, &id, |j| {
        j["state"] == "succeeded" || j["state"] == "failed"
    })
    .await;
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["attempts"][0]["provider"], "primary");
    assert_eq!(job["attempts"][0]["state"], "failed");
    assert_eq!(job["attempts"][0]["reason"], "provider_error");
    assert_eq!(job["attempts"][1]["provider"], "fallback");
    assert_eq!(job["completed_by"], 2);
}

async fn until_job(app: &TestApp, id: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..1000 {
        let (status, v) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
        assert_eq!(status, 200, "{v}");
        if cond(&v) {
            return v;
        }
        last = v;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the job never got there: {last}");
}

const GOOD: &str = r#"{"answer": "Order 1234 left the warehouse today.", "category": "delivery"}"#;
const PROSE: &str = "Sure! Your order 1234 left the warehouse today.";

/// An OpenAI primary that fails and an Anthropic fallback under the
/// example contract.
fn cross_vendor(fallback_content: &str) -> Spec {
    let contract = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/contracts/support.toml");
    Spec {
        primary: Behaviour {
            fail_status: Some(500),
            ..Behaviour::default()
        },
        fallback: Some(Behaviour {
            content: Some(fallback_content.into()),
            ..Behaviour::default()
        }),
        fallback_kind: ProviderKind::Anthropic,
        route: format!("contract = {:?}\n", contract.display().to_string()),
        attempts: "max = 2\nbackoff_base = \"10ms\"\nbackoff_max = \"20ms\"\n".into(),
        ..Spec::default()
    }
}

async fn job(app: &TestApp, key: &str) -> Value {
    let body = json!({"request": chat_body("Where is my order 1234?")});
    let r = app
        .post_json(ACME, "/v1/jobs", &body, &[("idempotency-key", key)])
        .await;
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    until_job(app, &id, |j| {
        j["state"] == "succeeded" || j["state"] == "failed"
    })
    .await
}

#[tokio::test]
async fn a_failed_openai_primary_fails_over_to_an_anthropic_fallback_only_once_certified() {
    let app = TestApp::with(cross_vendor(GOOD)).await;
    // Not certified: the failover is blocked and the job fails.
    let blocked = job(&app, "before").await;
    assert_eq!(blocked["state"], "failed", "{blocked}");
    assert!(
        blocked["error"].as_str().unwrap().contains("not certified"),
        "{blocked}"
    );
    assert_eq!(app.fallback.as_ref().unwrap().stats().calls, 0);
    // Certified against the contract, through the Messages API.
    let r = app
        .post_json(
            ADMIN,
            "/v1/admin/certify",
            &json!({"route": "bot", "target": "fallback"}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let report: Value = r.json().await.unwrap();
    assert_eq!(report["reports"][0]["passed"], true, "{report}");
    // Certification counted the prompts with the provider's count_tokens.
    assert_eq!(
        report["reports"][0]["tokenizer"], "the provider's count_tokens",
        "{report}"
    );
    let done = job(&app, "after").await;
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(done["completed_by"], 2);
    assert_eq!(done["attempts"][0]["provider"], "primary");
    assert_eq!(done["attempts"][1]["provider"], "fallback");
    let result: Value = serde_json::from_str(content_of(&done["result"]).as_str()).unwrap();
    assert_eq!(result["category"], "delivery");
}

#[tokio::test]
async fn an_anthropic_answer_that_breaks_the_contract_is_a_failed_attempt() {
    let contract = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/contracts/support.toml");
    let app = TestApp::with(Spec {
        primary: Behaviour {
            content: Some(PROSE.into()),
            ..Behaviour::default()
        },
        primary_kind: ProviderKind::Anthropic,
        route: format!("contract = {:?}\n", contract.display().to_string()),
        attempts: "max = 1\n".into(),
        ..Spec::default()
    })
    .await;
    let j = job(&app, "prose").await;
    assert_eq!(j["state"], "failed", "{j}");
    assert_eq!(j["attempts"][0]["reason"], "contract_violation", "{j}");
    let r = app.chat(ACME, &chat_body("Where is my order 1234?")).await;
    assert_error(r, 502, "contract_violation").await;
}

#[tokio::test]
async fn an_azure_target_gets_its_deployment_url_api_version_and_key() {
    let app = TestApp::with(Spec {
        primary_kind: ProviderKind::Azure,
        provider_extra: "api_key_env = \"CARGO_PKG_NAME\"\napi_version = \"2024-06-01\"\n".into(),
        route: "endpoints = [\"chat\", \"embeddings\"]\n".into(),
        ..Spec::default()
    })
    .await;
    let v: Value = app
        .chat(ACME, &chat_body("hello azure"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(content_of(&v), "mock answer #1 to: hello azure", "{v}");
    let sent = last_request(&app);
    assert_eq!(sent.deployment.as_deref(), Some("gpt-4o-mini"));
    assert_eq!(sent.api_version.as_deref(), Some("2024-06-01"));
    assert_eq!(sent.api_key.as_deref(), Some("idem"));
    assert!(sent.authorization.is_none(), "no bearer token to Azure");
    let r = app.chat(ACME, &streamed(chat_body("stream azure"))).await;
    assert_eq!(
        sse_content(&r.text().await.unwrap()),
        "mock answer #2 to: stream azure"
    );
    assert_eq!(
        last_request(&app).deployment.as_deref(),
        Some("gpt-4o-mini")
    );
    let r = app
        .post_json(
            ACME,
            "/v1/embeddings",
            &json!({"model": "bot", "input": ["x"]}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let sent = last_request(&app);
    assert_eq!(sent.deployment.as_deref(), Some("gpt-4o-mini"));
    assert_eq!(sent.api_version.as_deref(), Some("2024-06-01"));
}

/// Sends a chat completion asking `prompt` to a gateway process.
async fn ask(proc: &Proc, prompt: &str) -> reqwest::Response {
    client()
        .post(format!("{}/v1/chat/completions", proc.base))
        .bearer_auth(ACME)
        .json(&chat_body(prompt))
        .send()
        .await
        .unwrap()
}

/// Stops a gateway process and returns every line it logged.
async fn stopped(mut proc: Proc) -> Vec<String> {
    proc.signal("TERM");
    let _ = tokio::time::timeout(Duration::from_secs(10), proc.child.wait()).await;
    // Every line up to the end of its output: the readers end with it.
    let mut lines = Vec::new();
    while let Ok(Some(line)) = tokio::time::timeout(Duration::from_secs(5), proc.lines.recv()).await
    {
        lines.push(line);
    }
    lines
}

/// A provider that refuses idem's own key (its 401, then its 403) reaches
/// the client as a 502 `provider_auth_failed` that names the provider and
/// says whose credentials were refused, never as the provider's
/// `invalid_api_key` (which a client would read as its own key being
/// wrong); the gateway logs it as a warning once for all those requests
/// (once per provider and minute), naming the provider.
#[tokio::test]
async fn a_provider_refusing_idems_key_is_a_502_naming_it_with_one_warning() {
    let spec = Spec {
        primary: Behaviour {
            fail_status: Some(401),
            ..Behaviour::default()
        },
        ..Spec::default()
    };
    let mocks = start_mocks(&spec).await;
    let (proc, dir) = Proc::start_default(&mocks).await;
    for (i, status) in [401, 401, 403, 403].into_iter().enumerate() {
        mocks.primary.set_behaviour(Behaviour {
            fail_status: Some(status),
            ..Behaviour::default()
        });
        let v = assert_error(
            ask(&proc, &format!("refused {i}")).await,
            502,
            "provider_auth_failed",
        )
        .await;
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("provider primary refused idem's credentials")
                && message.contains(&status.to_string()),
            "{message}"
        );
    }
    assert_eq!(mocks.primary.stats().calls, 4);
    let log = stopped(proc).await;
    let warnings: Vec<_> = log
        .iter()
        .filter(|l| l.contains("refused idem's credentials") && l.contains(r#""level":"WARN""#))
        .collect();
    assert_eq!(warnings.len(), 1, "{warnings:#?}");
    let w: Value = serde_json::from_str(warnings[0]).unwrap();
    assert_eq!(w["provider"], "primary", "{w}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A provider that cannot be reached is logged with the cause under
/// reqwest's "error sending request": the connection refused by a closed
/// port, the name that does not resolve; the client gets a 502
/// `upstream_unreachable` naming the provider and no address.
#[tokio::test]
async fn an_unreachable_provider_is_logged_with_its_cause() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mocks = start_mocks(&Spec::default()).await;
    let (proc, dir) = Proc::start_default(&mocks).await;
    let config = dir.join("idem.toml");
    let text = std::fs::read_to_string(&config).unwrap();
    drop(stopped(proc).await);
    for (base, cause) in [
        (format!("http://{closed}/v1"), "Connection refused"),
        ("http://idem-test.invalid/v1".to_string(), "dns error"),
    ] {
        let text = text.replace(&mocks.primary.base_url(), &base);
        assert!(text.contains(&base), "{text}");
        std::fs::write(&config, text).unwrap();
        let proc = Proc::start(&config, &[]).await;
        let v = assert_error(
            ask(&proc, "anyone there?").await,
            502,
            "upstream_unreachable",
        )
        .await;
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("primary") && !message.contains(&base),
            "{message}"
        );
        let log = stopped(proc).await;
        let line = log
            .iter()
            .find(|l| l.contains("upstream call failed"))
            .unwrap_or_else(|| panic!("no warning in {log:#?}"));
        assert!(line.contains(cause), "{cause} not in {line}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
