//! Hostile input: a table of malformed or hostile requests, each with its
//! documented status and error object, none of which may reach a provider,
//! panic the server, or stop it serving.

use std::time::Duration;

use http_body_util::BodyExt;
use reqwest::Method;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::helpers::*;

const CHAT: &str = "/v1/chat/completions";

struct Case {
    name: &'static str,
    method: Method,
    path: String,
    key: Option<String>,
    headers: Vec<(&'static str, Vec<u8>)>,
    body: Vec<u8>,
    status: u16,
    code: &'static str,
}

fn case(name: &'static str, body: impl Into<Vec<u8>>, status: u16, code: &'static str) -> Case {
    Case {
        name,
        method: Method::POST,
        path: CHAT.into(),
        key: Some(ACME.into()),
        headers: vec![],
        body: body.into(),
        status,
        code,
    }
}

fn chat_with(field: &str, value: Value) -> Vec<u8> {
    let mut v = json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}]});
    v[field] = value;
    serde_json::to_vec(&v).unwrap()
}

fn message(m: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "bot", "messages": [m]})).unwrap()
}

fn table(other_tenants_job: &str) -> Vec<Case> {
    let nest_arrays = "[".repeat(10_000) + &"]".repeat(10_000);
    let nest_objects = "{\"a\":".repeat(10_000) + "1" + &"}".repeat(10_000);
    let deep_content = format!(
        r#"{{"model":"bot","messages":[{{"role":"user","content":"hi","x":{}}}]}}"#,
        "[".repeat(500) + &"]".repeat(500)
    );
    let many = |n: usize| {
        let msgs: Vec<Value> = (0..n)
            .map(|_| json!({"role": "user", "content": ""}))
            .collect();
        serde_json::to_vec(&json!({"model": "bot", "messages": msgs})).unwrap()
    };
    let mut cases = vec![
        // Bodies that are not JSON objects.
        case("empty body", "", 400, "invalid_json"),
        case("whitespace only", "   \n\t ", 400, "invalid_json"),
        case(
            "truncated JSON",
            r#"{"model":"bot","messages":[{"role":"us"#,
            400,
            "invalid_json",
        ),
        case(
            "trailing garbage",
            r#"{"model":"bot"} xyz"#,
            400,
            "invalid_json",
        ),
        case("JSON null", "null", 400, "invalid_type"),
        case("JSON string", r#""hello""#, 400, "invalid_type"),
        case("JSON number", "42", 400, "invalid_type"),
        case("JSON array", "[1,2,3]", 400, "invalid_type"),
        case(
            "invalid UTF-8",
            b"{\"model\":\"\xc3\x28\"}".to_vec(),
            400,
            "invalid_json",
        ),
        case(
            "raw NUL byte",
            b"{\"model\":\"bo\x00t\"}".to_vec(),
            400,
            "invalid_json",
        ),
        case(
            "a lone surrogate escape",
            r#"{"model":"bot","messages":[{"role":"user","content":"\ud800"}]}"#,
            400,
            "invalid_json",
        ),
        case("10,000-deep arrays", nest_arrays, 400, "nesting_too_deep"),
        case("10,000-deep objects", nest_objects, 400, "nesting_too_deep"),
        case(
            "deep nesting inside a message",
            deep_content,
            400,
            "nesting_too_deep",
        ),
        case(
            "a huge string",
            chat_with("x", json!("a".repeat(100_000))),
            413,
            "request_too_large",
        ),
        case("10,000 messages", many(10_000), 413, "request_too_large"),
        case(
            "more messages than max_messages",
            many(1_500),
            400,
            "invalid_value",
        ),
        // Wrong types and values.
        case(
            "NaN",
            r#"{"model":"bot","messages":[{"role":"user","content":"x"}],"temperature":NaN}"#,
            400,
            "invalid_json",
        ),
        case(
            "Infinity",
            r#"{"model":"bot","messages":[{"role":"user","content":"x"}],"top_p":Infinity}"#,
            400,
            "invalid_json",
        ),
        case(
            "a number out of range",
            r#"{"model":"bot","messages":[{"role":"user","content":"x"}],"temperature":1e400}"#,
            400,
            "invalid_json",
        ),
        case(
            "negative temperature",
            chat_with("temperature", json!(-0.5)),
            400,
            "invalid_value",
        ),
        case(
            "temperature a string",
            chat_with("temperature", json!("hot")),
            400,
            "invalid_type",
        ),
        case(
            "top_p above 1",
            chat_with("top_p", json!(2)),
            400,
            "invalid_value",
        ),
        case(
            "presence_penalty below -2",
            chat_with("presence_penalty", json!(-3)),
            400,
            "invalid_value",
        ),
        case(
            "negative n",
            chat_with("n", json!(-1)),
            400,
            "invalid_value",
        ),
        case("n a float", chat_with("n", json!(1.5)), 400, "invalid_type"),
        case(
            "zero max_tokens",
            chat_with("max_tokens", json!(0)),
            400,
            "invalid_value",
        ),
        case(
            "huge max_tokens",
            chat_with("max_tokens", json!(1_000_000_000_000_i64)),
            400,
            "invalid_value",
        ),
        case(
            "u64 max_tokens",
            chat_with("max_tokens", json!(u64::MAX)),
            400,
            "invalid_value",
        ),
        case(
            "stream a number",
            chat_with("stream", json!(1)),
            400,
            "invalid_type",
        ),
        case(
            "stop with five strings",
            chat_with("stop", json!(["a", "b", "c", "d", "e"])),
            400,
            "invalid_type",
        ),
        case(
            "logit_bias an array",
            chat_with("logit_bias", json!([1])),
            400,
            "invalid_type",
        ),
        case(
            "tools an object",
            chat_with("tools", json!({})),
            400,
            "invalid_type",
        ),
        case(
            "tool_choice a number",
            chat_with("tool_choice", json!(3)),
            400,
            "invalid_type",
        ),
        case(
            "model empty",
            chat_with("model", json!("")),
            400,
            "invalid_value",
        ),
        case(
            "model 1,000 characters",
            chat_with("model", json!("m".repeat(1000))),
            400,
            "invalid_value",
        ),
        case(
            "model an object",
            chat_with("model", json!({"$gt": ""})),
            400,
            "invalid_type",
        ),
        case(
            "messages null",
            chat_with("messages", Value::Null),
            400,
            "invalid_type",
        ),
        case(
            "a message that is a string",
            message(json!("hello")),
            400,
            "invalid_type",
        ),
        case(
            "a message without role",
            message(json!({"content": "x"})),
            400,
            "missing_required_parameter",
        ),
        case(
            "role a number",
            message(json!({"role": 1, "content": "x"})),
            400,
            "invalid_type",
        ),
        case(
            "role with a NUL",
            message(json!({"role": "user\u{0}", "content": "x"})),
            400,
            "invalid_value",
        ),
        case(
            "content an object",
            message(json!({"role": "user", "content": {"a": 1}})),
            400,
            "invalid_type",
        ),
        case(
            "a content part without type",
            message(json!({"role": "user", "content": [{"text": "x"}]})),
            400,
            "invalid_type",
        ),
        case(
            "name a number",
            message(json!({"role": "user", "content": "x", "name": 5})),
            400,
            "invalid_type",
        ),
        case(
            "tool_calls a string",
            message(json!({"role": "assistant", "content": "x", "tool_calls": "x"})),
            400,
            "invalid_type",
        ),
        case(
            "an unknown model",
            chat_with("model", json!("../../etc/passwd")),
            404,
            "model_not_found",
        ),
    ];
    // Authentication.
    let good = chat_with("model", json!("bot"));
    for (name, key, header) in [
        ("no Authorization", None, None),
        ("an empty bearer", None, Some("Bearer ".to_string())),
        (
            "Basic auth",
            None,
            Some("Basic YWNtZTpzZWNyZXQ=".to_string()),
        ),
        ("a wrong key", Some("sk-not-a-key".to_string()), None),
        (
            "a key with a SQL payload",
            Some("' OR '1'='1".to_string()),
            None,
        ),
        // Within the 32 KiB request head (past it: 431, `bounds`).
        ("a 30 KB key", Some("k".repeat(30_000)), None),
    ] {
        let mut c = case(name, good.clone(), 401, "invalid_api_key");
        c.key = key;
        if let Some(h) = header {
            c.headers.push(("authorization", h.into_bytes()));
        }
        cases.push(c);
    }
    let mut admin_chat = case(
        "an admin key on a tenant endpoint",
        good.clone(),
        403,
        "tenant_key_required",
    );
    admin_chat.key = Some(ADMIN.into());
    cases.push(admin_chat);
    // Jobs.
    let job = serde_json::to_vec(
        &json!({"request": {"model": "bot", "messages": [{"role": "user", "content": "x"}]}}),
    )
    .unwrap();
    let mut jobs = |name: &'static str,
                    key: Option<Vec<u8>>,
                    body: Vec<u8>,
                    status: u16,
                    code: &'static str| {
        let mut c = case(name, body, status, code);
        c.path = "/v1/jobs".into();
        if let Some(k) = key {
            c.headers.push(("idempotency-key", k));
        }
        cases.push(c);
    };
    jobs(
        "a job without a key",
        None,
        job.clone(),
        400,
        "idempotency_key_missing",
    );
    jobs(
        "a 256-character key",
        Some(vec![b'k'; 256]),
        job.clone(),
        400,
        "idempotency_key_invalid",
    );
    jobs(
        "a key with a tab",
        Some(b"a\tb".to_vec()),
        job.clone(),
        400,
        "idempotency_key_invalid",
    );
    jobs(
        "a key with non-ASCII bytes",
        Some("caf\u{e9}".as_bytes().to_vec()),
        job.clone(),
        400,
        "idempotency_key_invalid",
    );
    jobs(
        "a key of spaces only",
        Some(b"   ".to_vec()),
        job.clone(),
        400,
        "idempotency_key_invalid",
    );
    jobs(
        "a job request that is a string",
        Some(b"k1".to_vec()),
        br#"{"request":"x"}"#.to_vec(),
        400,
        "invalid_type",
    );
    jobs(
        "a job with an unknown field",
        Some(b"k2".to_vec()),
        br#"{"request":{},"priority":9}"#.to_vec(),
        400,
        "unknown_parameter",
    );
    jobs(
        "a job with metadata a list",
        Some(b"k3".to_vec()),
        br#"{"request":{"model":"bot","messages":[{"role":"user","content":"x"}]},"metadata":[1]}"#
            .to_vec(),
        400,
        "invalid_type",
    );
    jobs(
        "a job with a bad request inside",
        Some(b"k4".to_vec()),
        br#"{"request":{"model":"bot","messages":[]}}"#.to_vec(),
        400,
        "invalid_value",
    );
    let get =
        |name: &'static str, path: String, key: Option<&str>, status: u16, code: &'static str| {
            Case {
                name,
                method: Method::GET,
                path,
                key: key.map(str::to_string),
                headers: vec![],
                body: vec![],
                status,
                code,
            }
        };
    cases.extend([
        get(
            "a SQL-looking job id",
            "/v1/jobs/1'%20OR%20'1'%3D'1".into(),
            Some(ACME),
            404,
            "not_found",
        ),
        get(
            "a traversal job id",
            "/v1/jobs/..%2F..%2Fetc%2Fpasswd".into(),
            Some(ACME),
            404,
            "not_found",
        ),
        get(
            "a 10 KB job id",
            format!("/v1/jobs/{}", "a".repeat(10_000)),
            Some(ACME),
            404,
            "not_found",
        ),
        get(
            "another tenant's job",
            format!("/v1/jobs/{other_tenants_job}"),
            Some(ACME),
            404,
            "not_found",
        ),
        get(
            "a state that is SQL",
            "/v1/jobs?state=succeeded'%3B--".into(),
            Some(ACME),
            400,
            "invalid_value",
        ),
        get(
            "a huge page size",
            "/v1/jobs?limit=100000".into(),
            Some(ACME),
            400,
            "invalid_value",
        ),
        get(
            "a page size that is not a number",
            "/v1/jobs?limit=abc".into(),
            Some(ACME),
            400,
            "invalid_parameter",
        ),
        get(
            "a negative page size",
            "/v1/jobs?limit=-1".into(),
            Some(ACME),
            400,
            "invalid_parameter",
        ),
        get(
            "a forged cursor",
            "/v1/jobs?after=1_'%20OR%201%3D1".into(),
            Some(ACME),
            400,
            "invalid_value",
        ),
        get(
            "stats without a key",
            "/v1/stats".into(),
            None,
            401,
            "invalid_api_key",
        ),
        get(
            "an unknown path",
            "/v1/admin/../../etc/passwd".into(),
            Some(ACME),
            404,
            "not_found",
        ),
    ]);
    let mut resolve = case(
        "resolve with a tenant key",
        br#"{"outcome":"failed"}"#.to_vec(),
        403,
        "admin_key_required",
    );
    resolve.path = format!("/v1/jobs/{other_tenants_job}/attempts/1/resolve");
    cases.push(resolve);
    let mut resolve = case(
        "resolve without a key",
        br#"{"outcome":"failed"}"#.to_vec(),
        401,
        "invalid_api_key",
    );
    resolve.path = format!("/v1/jobs/{other_tenants_job}/attempts/1/resolve");
    resolve.key = None;
    cases.push(resolve);
    let mut resolve = case(
        "resolve with a bogus outcome",
        br#"{"outcome":"won"}"#.to_vec(),
        400,
        "invalid_value",
    );
    resolve.path = format!("/v1/jobs/{other_tenants_job}/attempts/1/resolve");
    resolve.key = Some(ADMIN.into());
    cases.push(resolve);
    let mut cancel = case(
        "cancel another tenant's job",
        b"{}".to_vec(),
        404,
        "not_found",
    );
    cancel.path = format!("/v1/jobs/{other_tenants_job}/cancel");
    cases.push(cancel);
    let mut put = case("a PUT on chat completions", good, 405, "method_not_allowed");
    put.method = Method::PUT;
    cases.push(put);
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_hostile_request_gets_its_documented_error_and_nothing_else() {
    let app = TestApp::with(Spec {
        server: "max_messages = 1000\n".into(),
        ..Spec::default()
    })
    .await;
    // A job that belongs to tenant beta (its one upstream call is counted).
    let beta_job: Value = app
        .post_json(
            BETA,
            "/v1/jobs",
            &json!({"request": chat_body("beta's secret")}),
            &[("idempotency-key", "beta-1")],
        )
        .await
        .json()
        .await
        .unwrap();
    let beta_id = beta_job["id"].as_str().unwrap().to_string();
    eventually(Duration::from_secs(10), || app.calls() == 1).await;
    app.until_no_flights().await;

    let cases = table(&beta_id);
    assert!(cases.len() >= 50, "only {} cases", cases.len());
    let mut failures = Vec::new();
    for c in &cases {
        let mut req = app
            .client
            .request(c.method.clone(), app.url(&c.path))
            .body(c.body.clone());
        if let Some(k) = &c.key {
            req = req.bearer_auth(k);
        }
        for (k, v) in &c.headers {
            req = req.header(*k, reqwest::header::HeaderValue::from_bytes(v).unwrap());
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                failures.push(format!("{}: no answer: {e}", c.name));
                continue;
            }
        };
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let code = body["error"]["code"].as_str().unwrap_or("<none>");
        let shaped = body["error"]["message"].is_string()
            && body["error"]["type"].is_string()
            && body["error"]
                .as_object()
                .is_some_and(|o| o.contains_key("param"));
        if status != c.status || code != c.code || !shaped {
            failures.push(format!(
                "{}: expected {} {}, got {status} {code}: {}",
                c.name,
                c.status,
                c.code,
                text.chars().take(200).collect::<String>()
            ));
        }
        if text.contains("beta's secret") {
            failures.push(format!("{}: leaked another tenant's data", c.name));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    assert_eq!(app.calls(), 1, "a hostile request reached the provider");
    // Malformed HTTP (a NUL or a control byte in a header, a negative or
    // doubled Content-Length, no request line, an unknown version, a chunk
    // size that is not hex) is refused with a 400 status line, then the
    // connection closes: a silent close would leave the client guessing.
    for raw in [
        &b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\x00b\r\nContent-Length: 2\r\n\r\n{}"[..],
        &b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"[..],
        &b"GARBAGE\r\n\r\n"[..],
        &b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}"[..],
        &b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-acme-test-1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"[..],
        &b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: \x7f\x01\r\n\r\n"[..],
        &b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n"[..],
    ] {
        let mut s = tokio::net::TcpStream::connect(app.base.trim_start_matches("http://")).await.unwrap();
        s.write_all(raw).await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut got))
            .await
            .expect("the connection was not closed")
            .expect("the connection was reset instead of answered");
        let head = String::from_utf8_lossy(&got);
        assert!(
            head.starts_with("HTTP/1.1 400 "),
            "{:?}: {head:?}",
            String::from_utf8_lossy(raw)
        );
    }
    // No panics (a panic would have been a 500) and the gateway still serves.
    let r = app.chat(ACME, &chat_body("still serving")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(app.calls(), 2);
    // beta's job is untouched by everything above.
    let (status, job) = app.get_json(BETA, &format!("/v1/jobs/{beta_id}")).await;
    assert_eq!(status, 200);
    assert_eq!(job["idempotency_key"], "beta-1");
}

#[tokio::test]
async fn a_sql_looking_key_is_only_a_key() {
    let app = TestApp::spawn().await;
    let key = "'; DROP TABLE jobs; --";
    let body = json!({"request": chat_body("x")});
    let r = app
        .post_json(ACME, "/v1/jobs", &body, &[("idempotency-key", key)])
        .await;
    assert_eq!(r.status(), 201);
    let r = app
        .post_json(ACME, "/v1/jobs", &body, &[("idempotency-key", key)])
        .await;
    assert_eq!(r.status(), 200);
    let (_, list) = app.get_json(ACME, "/v1/jobs").await;
    assert_eq!(list["data"][0]["idempotency_key"], key);
}

/// The bound the body tests set (`server.body_timeout`).
const BODY_TIMEOUT: Duration = Duration::from_millis(600);

/// Reads what the gateway sends until it closes the connection; how long
/// that took from `since`. A reset instead of a close fails the test.
async fn until_closed(
    read: &mut (impl tokio::io::AsyncRead + Unpin),
    since: std::time::Instant,
) -> (Duration, String) {
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), read.read_to_end(&mut got))
        .await
        .expect("the connection was not closed")
        .expect("the connection was reset, not closed");
    (since.elapsed(), String::from_utf8_lossy(&got).into_owned())
}

/// A client that announces a large body and trickles it a byte every
/// 100 ms (never idle for long, never done) gets a 408 with an error
/// object once the body timeout has passed, on chat completions and on
/// jobs, and its connection is closed; the gateway goes on serving.
#[tokio::test]
async fn a_trickling_body_gets_408_within_the_body_timeout_and_its_connection_closes() {
    let app = TestApp::with(Spec {
        server: format!("body_timeout = \"{}ms\"\n", BODY_TIMEOUT.as_millis()),
        ..Spec::default()
    })
    .await;
    let addr = app.base.trim_start_matches("http://").to_string();
    for (path, extra) in [(CHAT, ""), ("/v1/jobs", "Idempotency-Key: trickle-1\r\n")] {
        let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let (mut read, mut write) = tcp.into_split();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {ACME}\r\n{extra}\
             Content-Type: application/json\r\nContent-Length: 60000\r\n\r\n{{"
        );
        write.write_all(head.as_bytes()).await.unwrap();
        let started = std::time::Instant::now();
        let trickle = tokio::spawn(async move {
            let mut sent = 0u32;
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if write.write_all(b" ").await.is_err() {
                    return sent;
                }
                sent += 1;
            }
        });
        let (took, answer) = until_closed(&mut read, started).await;
        assert!(
            took >= BODY_TIMEOUT - Duration::from_millis(50),
            "{path}: answered after {took:?}, before the body timeout: {answer}"
        );
        assert!(
            took < BODY_TIMEOUT + Duration::from_secs(2),
            "{path}: answered after {took:?}"
        );
        assert!(answer.starts_with("HTTP/1.1 408 "), "{path}: {answer}");
        let lower = answer.to_ascii_lowercase();
        assert!(
            lower.contains("\r\nconnection: close\r\n"),
            "{path}: {answer}"
        );
        let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
        let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
        assert_eq!(v["error"]["code"], "body_timeout", "{path}: {answer}");
        assert_eq!(
            v["error"]["type"], "invalid_request_error",
            "{path}: {answer}"
        );
        trickle.abort();
        let sent = trickle.await.unwrap_or(5);
        assert!(sent >= 3, "{path}: the client trickled only {sent} bytes");
    }
    // HTTP/2: the stream is answered 408, and the connection serves on.
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let conn = tokio::spawn(conn);
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(1);
    let trickled =
        http_body_util::StreamBody::new(futures_util::stream::unfold(rx, |mut rx| async move {
            let chunk = rx.recv().await?;
            Some((Ok(hyper::body::Frame::data(chunk)), rx))
        }));
    let req = hyper::Request::post(format!("{}{CHAT}", app.base))
        .header("authorization", format!("Bearer {ACME}"))
        .header("content-type", "application/json")
        .body(BodyExt::boxed(trickled))
        .unwrap();
    let started = std::time::Instant::now();
    let feeding = tokio::spawn(async move {
        let mut chunk = bytes::Bytes::from_static(b"{");
        while tx.send(chunk).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(100)).await;
            chunk = bytes::Bytes::from_static(b" ");
        }
    });
    let r = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .expect("no answer over HTTP/2")
        .unwrap();
    let took = started.elapsed();
    assert_eq!(r.status(), 408);
    assert!(
        took >= BODY_TIMEOUT - Duration::from_millis(50),
        "answered after {took:?}"
    );
    let v: Value =
        serde_json::from_slice(&r.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(v["error"]["code"], "body_timeout", "{v}");
    feeding.abort();
    let empty = http_body_util::Empty::<bytes::Bytes>::new()
        .map_err(|never| match never {})
        .boxed();
    let r = sender
        .send_request(
            hyper::Request::get(format!("{}/healthz", app.base))
                .body(empty)
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    drop(sender);
    let _ = conn.await;
    // The gateway goes on serving over HTTP/1.1 too.
    let r = app.chat(ACME, &chat_body("after the trickle")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(app.calls(), 1, "a trickled request reached the provider");
}

/// Sends a request for `/healthz` on a kept-alive connection and reads its
/// answer; true for a 200.
async fn healthz_on(tcp: &mut tokio::net::TcpStream) -> bool {
    if tcp
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: idem\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    // The answer is small and fixed: read up to its body's end.
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    while !got.ends_with(b"{\"status\":\"ok\"}") {
        match tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => return false,
        }
    }
    got.starts_with(b"HTTP/1.1 200 ")
}

/// With `max_connections = 3`, a fourth connection gets a 503 with an error
/// object and is closed at once (counted in `idem_connections_shed_total`),
/// while the three go on being served; once one of them closes, a new
/// connection is served again.
#[tokio::test]
async fn connections_past_max_connections_are_shed_and_the_open_ones_stay_served() {
    let app = TestApp::with(Spec {
        server: "max_connections = 3\n".into(),
        ..Spec::default()
    })
    .await;
    let addr = app.base.trim_start_matches("http://").to_string();
    let shed_total = || {
        let text = app.state.metrics.render();
        text.lines()
            .find_map(|l| l.strip_prefix("idem_connections_shed_total "))
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or_else(|| panic!("no idem_connections_shed_total: {text}"))
    };
    assert_eq!(shed_total(), 0);
    let mut open = Vec::new();
    for _ in 0..3 {
        let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
        assert!(
            healthz_on(&mut tcp).await,
            "one of the first three was refused"
        );
        open.push(tcp);
    }

    let mut fourth = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (took, answer) = until_closed(&mut fourth, std::time::Instant::now()).await;
    assert!(took < Duration::from_secs(2), "shed after {took:?}");
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    let lower = answer.to_ascii_lowercase();
    assert!(lower.contains("\r\nconnection: close\r\n"), "{answer}");
    assert!(lower.contains("\r\nretry-after: "), "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    let v: Value = serde_json::from_str(body).unwrap_or(Value::Null);
    assert_eq!(v["error"]["code"], "too_many_connections", "{answer}");
    assert!(v["error"]["message"].is_string(), "{answer}");
    assert_eq!(shed_total(), 1);

    // The three are served as before.
    for tcp in &mut open {
        assert!(healthz_on(tcp).await, "an open connection lost its service");
    }
    // One closes: its place is free again (once the gateway has seen the
    // close; until then a new connection is shed, and counted).
    drop(open.pop());
    eventually_async(Duration::from_secs(10), || {
        let addr = addr.clone();
        async move {
            let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
            healthz_on(&mut tcp).await
        }
    })
    .await;
    assert!(shed_total() >= 1);
    for tcp in &mut open {
        assert!(healthz_on(tcp).await);
    }
}
