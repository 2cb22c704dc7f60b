//! The gateway foundation: proxying (plain and streamed), headers, input
//! validation, authentication, and graceful shutdown.

use std::time::Duration;

use futures_util::StreamExt;
use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::helpers::*;

#[tokio::test]
async fn a_plain_completion_is_proxied_with_the_upstream_model_and_idem_headers() {
    let app = TestApp::spawn().await;
    let r = app.chat(ACME, &chat_body("hello there")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_eq!(r.headers()["idem-outcome"], "leader");
    let fp = r.headers()["idem-fingerprint"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(fp.starts_with("v1:") && fp.len() == 67, "{fp}");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(content_of(&v), "mock answer #1 to: hello there");
    // The provider saw the upstream model, and never the client's key.
    let seen = &app.mock.stats().last_requests[0];
    assert_eq!(seen.body["model"], "gpt-4o-mini");
    assert_eq!(seen.body["messages"][0]["content"], "hello there");
    assert_eq!(seen.authorization, None);
    assert_eq!(app.calls(), 1);
}

#[tokio::test]
async fn unknown_request_fields_reach_the_provider_untouched() {
    let app = TestApp::spawn().await;
    let body = json!({"model": "bot", "messages": [{"role": "user", "content": "x"}],
                      "x_vendor": {"b": [1, 2.5, "z"], "a": null}, "temperature": 0.7});
    assert_eq!(app.chat(ACME, &body).await.status(), 200);
    let seen = &app.mock.stats().last_requests[0].body;
    assert_eq!(seen["x_vendor"], body["x_vendor"]);
    assert_eq!(seen["temperature"], 0.7);
}

#[tokio::test]
async fn a_streamed_completion_is_relayed_chunk_by_chunk() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            chunk_delay_ms: 150,
            ..Behaviour::default()
        },
        ..Spec::default()
    })
    .await;
    let mut body = chat_body("one two three four five six");
    body["stream"] = json!(true);
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert_eq!(r.headers()["idem-outcome"], "leader");
    let mut stream = r.bytes_stream();
    let first = stream.next().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    // The first event reached the client while the provider was still
    // sending: nothing waited for the whole answer.
    assert_eq!(
        app.mock.stats().in_flight,
        1,
        "the gateway buffered the stream"
    );
    let mut text = String::from_utf8(first.to_vec()).unwrap();
    while let Some(chunk) = stream.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert_eq!(
        sse_content(&text),
        "mock answer #1 to: one two three four five six"
    );
}

#[tokio::test]
async fn models_lists_the_routes() {
    let app = TestApp::with(Spec {
        extra: "[[routes]]\nmodel = \"second\"\ntargets = [{ provider = \"primary\", model = \"m2\" }]\n".into(),
        ..Spec::default()
    })
    .await;
    let (status, v) = app.get_json(ACME, "/v1/models").await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec!["bot", "second"]);
}

#[tokio::test]
async fn health_and_readiness() {
    let app = TestApp::spawn().await;
    let r = app.client.get(app.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = app.client.get(app.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["storage"], "ok");
}

#[tokio::test]
async fn every_bad_request_gets_its_error_object_and_no_upstream_call() {
    let app = TestApp::spawn().await;
    let url = app.url("/v1/chat/completions");
    let post = |body: Vec<u8>| {
        app.client
            .post(&url)
            .bearer_auth(ACME)
            .header("content-type", "application/json")
            .body(body)
    };
    let deep = format!("{}{}", "[".repeat(5000), "]".repeat(5000));
    let deep_obj = format!(
        r#"{{"model":"bot","messages":[{{"role":"user","content":"x"}}],"x":{}}}"#,
        "[".repeat(100) + &"]".repeat(100)
    );
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("empty body", vec![], 400, "invalid_json"),
        (
            "truncated JSON",
            br#"{"model":"bot","messages":["#.to_vec(),
            400,
            "invalid_json",
        ),
        ("not JSON", b"model=bot".to_vec(), 400, "invalid_json"),
        (
            "invalid UTF-8",
            b"{\"model\":\"\xff\xfe\"}".to_vec(),
            400,
            "invalid_json",
        ),
        ("an array", b"[1,2,3]".to_vec(), 400, "invalid_type"),
        ("deep nesting", deep.into_bytes(), 400, "nesting_too_deep"),
        (
            "deep nesting inside",
            deep_obj.into_bytes(),
            400,
            "nesting_too_deep",
        ),
        (
            "no model",
            br#"{"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            400,
            "missing_required_parameter",
        ),
        (
            "model a number",
            br#"{"model":5,"messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            400,
            "invalid_type",
        ),
        (
            "messages a string",
            br#"{"model":"bot","messages":"hi"}"#.to_vec(),
            400,
            "invalid_type",
        ),
        (
            "no messages",
            br#"{"model":"bot","messages":[]}"#.to_vec(),
            400,
            "invalid_value",
        ),
        (
            "bad role",
            br#"{"model":"bot","messages":[{"role":"root","content":"x"}]}"#.to_vec(),
            400,
            "invalid_value",
        ),
        (
            "content a number",
            br#"{"model":"bot","messages":[{"role":"user","content":1}]}"#.to_vec(),
            400,
            "invalid_type",
        ),
        (
            "temperature too high",
            br#"{"model":"bot","messages":[{"role":"user","content":"x"}],"temperature":3}"#
                .to_vec(),
            400,
            "invalid_value",
        ),
        (
            "negative max_tokens",
            br#"{"model":"bot","messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#
                .to_vec(),
            400,
            "invalid_value",
        ),
        (
            "stream a string",
            br#"{"model":"bot","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#
                .to_vec(),
            400,
            "invalid_type",
        ),
        (
            "NaN",
            br#"{"model":"bot","messages":[{"role":"user","content":"x"}],"temperature":NaN}"#
                .to_vec(),
            400,
            "invalid_json",
        ),
        (
            "unknown model",
            br#"{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            404,
            "model_not_found",
        ),
        ("too large", vec![b' '; 70_000], 413, "request_too_large"),
    ];
    for (name, body, status, code) in cases {
        let r = post(body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{name}");
        let v: Value = r
            .json()
            .await
            .unwrap_or_else(|e| panic!("{name}: body is not JSON: {e}"));
        assert_eq!(v["error"]["code"], code, "{name}: {v}");
        assert!(v["error"]["message"].is_string(), "{name}");
        assert!(v["error"]["type"].is_string(), "{name}");
        assert!(
            v["error"].as_object().unwrap().contains_key("param"),
            "{name}"
        );
    }
    // A body over the limit without a content-length (chunked) is refused too.
    let chunks =
        futures_util::stream::iter((0..20).map(|_| Ok::<_, std::io::Error>(vec![b' '; 5000])));
    let r = app
        .client
        .post(&url)
        .bearer_auth(ACME)
        .body(reqwest::Body::wrap_stream(chunks))
        .send()
        .await
        .unwrap();
    assert_error(r, 413, "request_too_large").await;
    assert_eq!(app.calls(), 0, "a bad request reached the provider");
    // And the gateway still serves.
    assert_eq!(
        app.chat(ACME, &chat_body("still alive")).await.status(),
        200
    );
}

#[tokio::test]
async fn wrong_or_missing_keys_are_401_and_admin_keys_cannot_chat() {
    let app = TestApp::spawn().await;
    let url = app.url("/v1/chat/completions");
    let body = chat_body("x");
    let r = app.client.post(&url).json(&body).send().await.unwrap();
    let v = assert_error(r, 401, "invalid_api_key").await;
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let r = app
        .client
        .post(&url)
        .bearer_auth("sk-nope-nope")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_error(r, 401, "invalid_api_key").await;
    let r = app
        .client
        .post(&url)
        .header("authorization", ACME)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_error(r, 401, "invalid_api_key").await;
    let r = app
        .client
        .post(&url)
        .bearer_auth(ADMIN)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_error(r, 403, "tenant_key_required").await;
    // The error never echoes the presented key.
    let r = app
        .client
        .post(&url)
        .bearer_auth("sk-secret-guess")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(!r.text().await.unwrap().contains("sk-secret-guess"));
    assert_eq!(app.calls(), 0);
}

#[tokio::test]
async fn unknown_paths_and_methods_get_error_objects() {
    let app = TestApp::spawn().await;
    let r = app
        .client
        .get(app.url("/v1/nothing"))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_error(r, 404, "not_found").await;
    let r = app
        .client
        .get(app.url("/v1/chat/completions"))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_error(r, 405, "method_not_allowed").await;
}

#[tokio::test]
async fn graceful_shutdown_finishes_requests_in_progress_then_exits() {
    let mocks = start_mocks(&holding()).await;
    let (mut proc, dir) = Proc::start_default(&mocks).await;
    let client = client();
    let url = format!("{}/v1/chat/completions", proc.base);
    let pending = tokio::spawn({
        let (client, url) = (client.clone(), url.clone());
        async move {
            client
                .post(url)
                .bearer_auth(ACME)
                .json(&chat_body("in flight at shutdown"))
                .send()
                .await
        }
    });
    held(&mocks.primary, 1).await;
    proc.signal("TERM");
    // New connections are refused once the listener has closed.
    eventually_async(Duration::from_secs(10), || {
        let client = client.clone();
        let url = format!("{}/healthz", proc.base);
        async move { client.get(url).send().await.is_err() }
    })
    .await;
    release(&mocks.primary, None).await;
    let r = pending.await.unwrap().unwrap();
    assert_eq!(r.status(), 200, "the request in progress was not finished");
    let v: Value = r.json().await.unwrap();
    assert_eq!(content_of(&v), "mock answer #1 to: in flight at shutdown");
    let status = tokio::time::timeout(Duration::from_secs(10), proc.child.wait())
        .await
        .expect("idem did not exit after SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let log = proc.drain().join("\n");
    assert!(log.contains("shutting down"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn provider_keys_come_from_the_environment_and_client_keys_never_travel() {
    let mocks = start_mocks(&Spec::default()).await;
    let dir = temp_dir();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let text = config_text(&Spec::default(), &mocks, &db, "127.0.0.1:0").replace(
        "timeout = \"30s\"\n",
        "timeout = \"30s\"\napi_key_env = \"IDEM_TEST_PRIMARY_KEY\"\n",
    );
    let config = dir.join("idem.toml");
    std::fs::write(&config, text).unwrap();
    let mut proc = Proc::start(&config, &[("IDEM_TEST_PRIMARY_KEY", "sk-provider-secret")]).await;
    let r = client()
        .post(format!("{}/v1/chat/completions", proc.base))
        .bearer_auth(ACME)
        .json(&chat_body("who are you"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let seen = &mocks.primary.stats().last_requests[0];
    assert_eq!(
        seen.authorization.as_deref(),
        Some("Bearer sk-provider-secret")
    );
    proc.signal("TERM");
    let _ = proc.child.wait().await;
    // Neither key appears in the gateway's log.
    let log = proc.drain().join("\n");
    assert!(!log.contains("sk-provider-secret"), "provider key logged");
    assert!(!log.contains(ACME), "client key logged");
    // A key that no HTTP header can carry (a file's trailing line break)
    // stops the start, naming the variable and not the key.
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["serve", "--config"])
            .arg(&config)
            .env("IDEM_TEST_PRIMARY_KEY", "sk-provider-secret\n")
            .env_remove("IDEM_CONFIG")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("idem serve did not stop on an unsendable key")
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("IDEM_TEST_PRIMARY_KEY"), "{err}");
    assert!(!err.contains("sk-provider-secret"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn config_errors_name_the_file_and_the_key() {
    let dir = temp_dir();
    let config = dir.join("broken.toml");
    std::fs::write(
        &config,
        "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\nmodel = \"m\"\ntargets = [{ provider = \"q\", model = \"x\" }]\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["check", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("broken.toml"), "{err}");
    assert!(err.contains("routes[0].targets[0].provider"), "{err}");
    // An environment override reaches a key (and a typo'd one is refused).
    std::fs::write(&config, "[server]\nlisten = \"127.0.0.1:1\"\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["check", "--config"])
        .arg(&config)
        .env("IDEM_SERVER__LISTN", "127.0.0.1:2")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("listn"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["check", "--config"])
        .arg(&config)
        .env("IDEM_SERVER__LISTEN", "not-an-address")
        .output()
        .unwrap();
    assert!(!out.status.success());
    // Blamed on the variable, not on the file.
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("IDEM_SERVER__LISTEN=not-an-address: `server.listen`: not an address"),
        "{err}"
    );
    assert!(!err.contains("broken.toml"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn check_warns_about_provider_keys_this_environment_lacks() {
    let dir = temp_dir();
    let config = dir.join("idem.toml");
    std::fs::write(
        &config,
        "[[providers]]\nname = \"openai\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\napi_key_env = \"IDEM_TEST_CHECK_KEY\"\n[[routes]]\nmodel = \"m\"\ntargets = [{ provider = \"openai\", model = \"x\" }]\n",
    )
    .unwrap();
    let check = |key: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        cmd.args(["check", "--config"])
            .arg(&config)
            .env_remove("IDEM_CONFIG")
            .env_remove("IDEM_TEST_CHECK_KEY");
        if let Some(k) = key {
            cmd.env("IDEM_TEST_CHECK_KEY", k);
        }
        let out = cmd.output().unwrap();
        // The config itself is fine whatever the environment holds.
        assert!(out.status.success(), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stdout).contains(": ok"));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for (key, why) in [
        (None, "is not set"),
        (Some("sk-check-secret\r\n"), "cannot carry"),
    ] {
        let err = check(key);
        assert!(err.contains("IDEM_TEST_CHECK_KEY"), "{err}");
        assert!(err.contains(why), "{err}");
        assert!(err.contains("would not start"), "{err}");
        assert!(!err.contains("sk-check-secret"), "key printed: {err}");
    }
    let err = check(Some("sk-check-secret"));
    assert!(!err.contains("warning"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_tenant_over_its_rate_limit_gets_429_with_retry_after_and_others_do_not() {
    let app = TestApp::with(Spec {
        acme: "rate_limit = { requests_per_second = 0.5, burst = 3 }\nmax_body_bytes = 2048\n"
            .into(),
        ..Spec::default()
    })
    .await;
    for i in 0..3 {
        assert_eq!(
            app.chat(ACME, &chat_body(&format!("q{i}"))).await.status(),
            200
        );
    }
    let r = app.chat(ACME, &chat_body("one too many")).await;
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=2).contains(&retry), "Retry-After {retry}");
    assert_error(r, 429, "rate_limit_exceeded").await;
    // Another tenant has its own budget.
    assert_eq!(
        app.chat(BETA, &chat_body("beta is fine")).await.status(),
        200
    );
    assert_eq!(app.calls(), 4);
    assert!(app.metrics().await.contains("idem_rate_limited_total 1"));
    // acme's own body limit is below the server's.
    let big = chat_body(&"x".repeat(3000));
    let r = app.chat(BETA, &big).await;
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn a_tenant_body_limit_below_the_servers_is_enforced() {
    let app = TestApp::with(Spec {
        acme: "max_body_bytes = 2048\n".into(),
        ..Spec::default()
    })
    .await;
    let big = chat_body(&"x".repeat(3000));
    assert_error(app.chat(ACME, &big).await, 413, "request_too_large").await;
    assert_eq!(app.chat(BETA, &big).await.status(), 200);
    assert_eq!(app.calls(), 1);
}

/// Connection handling: a client that closes its sending side after its
/// request still gets the answer (the gateway does not read a waiting
/// request's socket), and connections with nothing in progress (one that
/// never sent a byte, one kept alive after an answer) neither hold up the
/// shutdown nor outlive it.
#[tokio::test]
async fn half_closed_requests_are_answered_and_idle_connections_do_not_delay_shutdown() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    let mocks = start_mocks(&Spec::default()).await;
    let (mut proc, dir) = Proc::start_default(&mocks).await;
    let addr = proc.base.trim_start_matches("http://").to_string();
    let read_all = |mut tcp: TcpStream| async move {
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut got))
            .await
            .expect("the connection was not closed")
            .unwrap();
        String::from_utf8_lossy(&got).into_owned()
    };

    // The request, then the client's FIN, then the answer.
    let body = serde_json::to_string(&chat_body("half closed")).unwrap();
    let mut tcp = TcpStream::connect(&addr).await.unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {ACME}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    tcp.write_all(format!("{head}{body}").as_bytes())
        .await
        .unwrap();
    tcp.shutdown().await.unwrap();
    let answer = read_all(tcp).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer.contains("mock answer #1 to: half closed"),
        "{answer}"
    );

    // Two idle connections: silent, and kept alive after one answer.
    let silent = TcpStream::connect(&addr).await.unwrap();
    let mut kept = TcpStream::connect(&addr).await.unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: idem\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 12];
    kept.read_exact(&mut first).await.unwrap();
    // The kept connection is answered, so the silent one, opened before it,
    // has been accepted too (one accept loop, in arrival order).
    assert_eq!(&first, b"HTTP/1.1 200");

    let asked = std::time::Instant::now();
    proc.signal("TERM");
    let status = tokio::time::timeout(Duration::from_secs(5), proc.child.wait())
        .await
        .expect("idle connections held up the shutdown")
        .unwrap();
    assert!(status.success(), "{status:?}");
    assert!(asked.elapsed() < Duration::from_secs(5));
    // Both were closed by the gateway (the rest of the kept one's answer,
    // then the end).
    read_all(silent).await;
    read_all(kept).await;
    let log = proc.drain().join("\n");
    assert!(!log.contains("grace ran out"), "{log}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// HTTP/2 with prior knowledge on the gateway's one port: identical
/// requests sent as streams of one connection coalesce into one call like
/// requests on separate connections, every stream gets the same answer, an
/// HTTP/1.1 client on the same port is served as before, and the open
/// connections are counted by protocol.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http2_streams_of_one_connection_coalesce_and_http1_shares_the_port() {
    use http_body_util::BodyExt;

    const STREAMS: usize = 150;
    let app = TestApp::with(holding()).await;
    let (sender, conn) = h2_connect(app.base.trim_start_matches("http://")).await;
    let body = chat_body("over one connection");
    let tasks: Vec<_> = (0..STREAMS)
        .map(|_| {
            let answer = sender.clone().send_request(h2_chat(&app.base, ACME, &body));
            tokio::spawn(async move {
                let r = answer.await.unwrap();
                assert_eq!(r.version(), hyper::Version::HTTP_2);
                let outcome = r.headers()["idem-outcome"].to_str().unwrap().to_string();
                let status = r.status().as_u16();
                let text = r.into_body().collect().await.unwrap().to_bytes();
                (status, outcome, String::from_utf8(text.to_vec()).unwrap())
            })
        })
        .collect();
    held(&app.mock, 1).await;
    app.until_followers(STREAMS as u64 - 1).await;
    release(&app.mock, None).await;
    let results = collect(tasks).await;
    assert_eq!(
        app.calls(),
        1,
        "streams of one connection made several calls"
    );
    assert!(results.iter().all(|(s, _, _)| *s == 200), "{results:?}");
    let outcomes = count_by(&results, |(_, o, _)| o.clone());
    assert_eq!(outcomes.get("leader"), Some(&1));
    assert_eq!(outcomes.get("follower"), Some(&(STREAMS - 1)));
    let first = &results[0].2;
    assert!(results.iter().all(|(_, _, b)| b == first));
    let v: Value = serde_json::from_str(first).unwrap();
    assert_eq!(content_of(&v), "mock answer #1 to: over one connection");

    // The same port, HTTP/1.1: the cached answer.
    let r = app.chat(ACME, &chat_body("over one connection")).await;
    assert_eq!(r.version(), reqwest::Version::HTTP_11);
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    assert_eq!(r.text().await.unwrap(), *first);
    // The open connections by protocol: this one, and the metrics request's.
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("idem_http_connections{protocol=\"http2\"} 1"),
        "{metrics}"
    );
    assert!(
        !metrics.contains("idem_http_connections{protocol=\"http1\"} 0"),
        "{metrics}"
    );
    drop(sender);
    conn.await.unwrap().expect("the HTTP/2 connection failed");
    eventually_async(Duration::from_secs(5), || async {
        app.metrics()
            .await
            .contains("idem_http_connections{protocol=\"http2\"} 0")
    })
    .await;
}

/// Shutdown over HTTP/2: an idle connection is closed at once (GOAWAY),
/// a request in progress on another connection still gets its answer, and
/// the gateway exits when it has.
#[tokio::test]
async fn on_shutdown_http2_requests_in_progress_finish_and_idle_connections_close() {
    use http_body_util::BodyExt;

    let mocks = start_mocks(&holding()).await;
    let (mut proc, dir) = Proc::start_default(&mocks).await;
    let addr = proc.base.trim_start_matches("http://").to_string();
    let (mut busy, busy_conn) = h2_connect(&addr).await;
    let (idle, idle_conn) = h2_connect(&addr).await;
    let request = h2_chat(&proc.base, ACME, &chat_body("finish me"));
    let answer = tokio::spawn(busy.send_request(request));
    held(&mocks.primary, 1).await;

    proc.signal("TERM");
    tokio::time::timeout(Duration::from_secs(5), idle_conn)
        .await
        .expect("the idle HTTP/2 connection was not closed at the shutdown")
        .unwrap()
        .expect("the idle connection ended with an error, not a GOAWAY");
    assert!(!answer.is_finished(), "answered before the release");
    release(&mocks.primary, None).await;
    let r = answer
        .await
        .unwrap()
        .expect("the request in progress was cut");
    assert_eq!(r.status(), 200);
    let text = r.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&text).contains("mock answer #1 to: finish me"),
        "{text:?}"
    );
    let status = tokio::time::timeout(Duration::from_secs(5), proc.child.wait())
        .await
        .expect("the gateway did not exit after the last answer")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let _ = tokio::time::timeout(Duration::from_secs(5), busy_conn).await;
    drop(idle);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The value of the Prometheus sample `line` (name and labels) in `text`.
fn sample(text: &str, line: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
}

/// Every chat completion request is counted, in `idem_requests_total` and
/// in `/v1/stats`, also those that get no answer of their own: refused
/// before any work (401, 403, 400, 404 model_not_found, 413, 408: route
/// `-` until routed, never the model a client made up), a follower whose
/// wait ran out, a request no target could take. A would-be leader's error
/// is not labelled `follower`.
#[tokio::test]
async fn every_chat_request_is_counted_refusals_included() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let app = TestApp::with(Spec {
        server: "body_timeout = \"300ms\"\nrequest_timeout = \"300ms\"\n".into(),
        coalesce: "max_wait = \"300ms\"\n".into(),
        // A route whose only provider refuses connections: once its
        // circuit is open, nothing may take the route's requests.
        extra: "[[providers]]\nname = \"down\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\n\
                [providers.breaker]\nfailures = 1\ncooldown = \"1h\"\n\
                [[routes]]\nmodel = \"down-bot\"\ntargets = [{ provider = \"down\", model = \"m\" }]\n"
            .into(),
        ..holding()
    })
    .await;
    let post = |key: Option<&str>, body: Vec<u8>, headers: &[(&str, &str)]| {
        let mut r = app
            .client
            .post(app.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.send()
    };
    let json = |v: &Value| serde_json::to_vec(v).unwrap();
    let good = json(&chat_body("counted"));

    // Refused before any work.
    assert_eq!(post(None, good.clone(), &[]).await.unwrap().status(), 401);
    let r = post(Some("sk-wrong-key"), good.clone(), &[]).await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        post(Some(ADMIN), good.clone(), &[]).await.unwrap().status(),
        403
    );
    let r = post(Some(ACME), b"{not json".to_vec(), &[]).await.unwrap();
    assert_eq!(r.status(), 400);
    let mut unknown = chat_body("counted");
    unknown["model"] = json!("made-up-by-a-client");
    let r = post(Some(ACME), json(&unknown), &[]).await.unwrap();
    assert_eq!(r.status(), 404);
    let r = post(Some(ACME), vec![b' '; 70_000], &[]).await.unwrap();
    assert_eq!(r.status(), 413);
    // Routed, then refused: a bad Idempotency-Key.
    let r = post(Some(ACME), good.clone(), &[("idempotency-key", "a\tb")])
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // A body that does not arrive in time.
    let mut tcp = tokio::net::TcpStream::connect(app.base.trim_start_matches("http://"))
        .await
        .unwrap();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: idem\r\nAuthorization: Bearer {ACME}\r\n\
         Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{{"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut answer))
        .await
        .unwrap()
        .unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 408 "), "{answer:?}");

    // A follower whose wait runs out, behind a held leader.
    let leader = tokio::spawn(post(Some(ACME), good.clone(), &[]));
    let seqs = held(&app.mock, 1).await;
    let r = post(Some(ACME), good.clone(), &[]).await.unwrap();
    assert_eq!(r.status(), 504);
    assert_eq!(r.headers()["idem-outcome"], "wait-timeout");
    release(&app.mock, Some(seqs[0])).await;
    assert_eq!(leader.await.unwrap().unwrap().status(), 200);

    // Requests on the job path whose job is not done in time: the one that
    // created the job is counted by the job's first attempt (one job, one
    // incoming request), a retry with the key as a job timeout.
    let job = json(&chat_body("a job in time?"));
    for _ in 0..2 {
        let r = post(Some(ACME), job.clone(), &[("idempotency-key", "counted-1")])
            .await
            .unwrap();
        assert_error(r, 504, "job_in_progress").await;
    }
    release(&app.mock, None).await;
    eventually_async(Duration::from_secs(10), || async {
        app.get_json(ACME, "/v1/jobs?state=succeeded").await.1["data"]
            .as_array()
            .is_some_and(|d| d.len() == 1)
    })
    .await;

    // A route whose provider is down: the first request leads and gets the
    // error; its circuit is then open, and the next request has no target.
    let mut down = chat_body("nobody answers");
    down["model"] = json!("down-bot");
    let r = post(Some(ACME), json(&down), &[]).await.unwrap();
    assert!(r.status().is_server_error(), "{}", r.status());
    assert_eq!(r.headers()["idem-outcome"], "leader");
    let r = post(Some(ACME), json(&down), &[]).await.unwrap();
    assert_eq!(
        r.headers()["idem-outcome"],
        "no-target",
        "no flight existed"
    );
    assert_error(r, 503, "no_target_available").await;

    let m = app.metrics().await;
    for (line, n) in [
        // 401 twice, 403, 400, 404, 413, 408.
        ("idem_requests_total{route=\"-\",outcome=\"rejected\"}", 7.0),
        (
            "idem_requests_total{route=\"bot\",outcome=\"rejected\"}",
            1.0,
        ),
        (
            "idem_requests_total{route=\"bot\",outcome=\"wait-timeout\"}",
            1.0,
        ),
        // The held leader, and the job's first attempt.
        ("idem_requests_total{route=\"bot\",outcome=\"leader\"}", 2.0),
        (
            "idem_requests_total{route=\"bot\",outcome=\"job-timeout\"}",
            1.0,
        ),
        (
            "idem_requests_total{route=\"bot\",outcome=\"follower\"}",
            0.0,
        ),
        (
            "idem_requests_total{route=\"down-bot\",outcome=\"leader\"}",
            1.0,
        ),
        (
            "idem_requests_total{route=\"down-bot\",outcome=\"no-target\"}",
            1.0,
        ),
        (
            "idem_requests_total{route=\"down-bot\",outcome=\"follower\"}",
            0.0,
        ),
        ("idem_coalesce_wait_timeouts_total{route=\"bot\"}", 1.0),
    ] {
        assert_eq!(sample(&m, line), Some(n), "{line}\n{m}");
    }
    assert!(!m.contains("made-up-by-a-client"), "{m}");

    // The same in /v1/stats: the tenant's own (its 5 refusals, 2 leaders,
    // a wait timeout, a job not done in time, a request with no target)
    // and the gateway's (with the 3 requests of no tenant).
    let (_, mine) = app.get_json(ACME, "/v1/stats").await;
    let c = &mine["coalescing"];
    assert_eq!(c["incoming_requests"], 11, "{mine}");
    assert_eq!(c["job_timeouts"], 1, "{mine}");
    assert_eq!(c["rejected"], 5, "{mine}");
    assert_eq!(c["leaders"], 3, "{mine}");
    assert_eq!(c["followers"], 0, "{mine}");
    assert_eq!(c["wait_timeouts"], 1, "{mine}");
    assert_eq!(c["no_target"], 1, "{mine}");
    let (_, all) = app.get_json(ADMIN, "/v1/stats").await;
    let c = &all["coalescing"];
    assert_eq!(c["incoming_requests"], 14, "{all}");
    assert_eq!(c["rejected"], 8, "{all}");
}

/// An unknown model's 404 names the models the key may use on that
/// endpoint, so that a typo is fixed from the error alone.
#[tokio::test]
async fn an_unknown_model_lists_the_models_to_use_instead() {
    let app = TestApp::with(Spec {
        extra: "[[routes]]\nmodel = \"embed\"\nendpoints = [\"embeddings\"]\n\
                targets = [{ provider = \"primary\", model = \"text-embedding-3-small\" }]\n"
            .into(),
        ..Spec::default()
    })
    .await;
    let message = |v: &Value| v["error"]["message"].as_str().unwrap().to_string();
    let r = app
        .post_json(
            ACME,
            "/v1/chat/completions",
            &json!({"model": "bto", "messages": [{"role": "user", "content": "x"}]}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "model_not_found");
    assert_eq!(
        message(&v),
        "model `bto` does not exist; this key may use `bot`"
    );
    let r = app
        .post_json(
            ACME,
            "/v1/embeddings",
            &json!({"model": "embd", "input": "x"}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        message(&v),
        "model `embd` does not exist; this key may use `embed`"
    );
}
