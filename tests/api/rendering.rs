//! One shared answer, rendered for each asker: a follower or a cache hit of
//! a leader that asked for other rendering options (`stream_options`) gets
//! the answer as it asked itself, and `Idem-Outcome` says what happened to
//! each request, a refused one included.

use serde_json::{Value, json};

use idem::mock_upstream::Behaviour;

use crate::helpers::*;

fn held_spec() -> Spec {
    Spec {
        primary: Behaviour {
            hold: true,
            ..Behaviour::default()
        },
        ..Spec::default()
    }
}

fn streamed(content: &str, include_usage: Option<bool>) -> Value {
    let mut body = chat_body(content);
    body["stream"] = json!(true);
    if let Some(on) = include_usage {
        body["stream_options"] = json!({"include_usage": on});
    }
    body
}

/// The JSON chunks of an SSE body, and whether it ended with `[DONE]`.
fn chunks(body: &str) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    let mut done = false;
    for event in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not a data event: {event:?} in {body}"));
        if data == "[DONE]" {
            done = true;
            continue;
        }
        out.push(serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}")));
    }
    (out, done)
}

/// A stream as the openai SDK's `for chunk in stream: chunk.choices[0]`
/// loop reads it: every chunk has a choice.
fn assert_no_usage_chunk(body: &str, who: &str) {
    let (chunks, done) = chunks(body);
    assert!(done, "{who}: no [DONE]: {body}");
    assert!(!chunks.is_empty(), "{who}: no chunk: {body}");
    for c in &chunks {
        assert!(
            c["choices"].as_array().is_some_and(|a| !a.is_empty()),
            "{who} got a chunk without choices: {c}"
        );
    }
}

/// The stream ends with a usage chunk with token counts.
fn assert_usage_chunk(body: &str, who: &str) {
    let (chunks, done) = chunks(body);
    assert!(done, "{who}: no [DONE]: {body}");
    let last = chunks.last().unwrap_or_else(|| panic!("{who}: no chunk"));
    assert_eq!(last["choices"], json!([]), "{who}: {body}");
    assert_usage(&last["usage"], who);
    let with_choices = chunks.iter().filter(|c| c["choices"] != json!([])).count();
    assert_eq!(with_choices, chunks.len() - 1, "{who}: {body}");
}

fn assert_usage(usage: &Value, who: &str) {
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert!(
            usage[field].as_u64().is_some_and(|n| n > 0),
            "{who}: usage without {field}: {usage}"
        );
    }
}

/// Fires `leader`, waits until the mock holds its call, then `followers`
/// followers with `follower` (same fingerprint), and releases the call.
async fn shared(
    app: &TestApp,
    leader: &Value,
    follower: &Value,
    followers: usize,
) -> ((u16, String, String), Vec<(u16, String, String)>) {
    let calls = app.calls();
    let first = wave(app, ACME, leader, 1).await;
    held(&app.mock, 1).await;
    let rest = wave(app, ACME, follower, followers).await;
    app.until_followers(followers as u64).await;
    release(&app.mock, None).await;
    let leader = collect(first).await.remove(0);
    let followers = collect(rest).await;
    assert_eq!(app.calls(), calls + 1, "the wave made more than one call");
    assert_eq!(leader.1, "leader", "{leader:?}");
    for f in &followers {
        assert_eq!((f.0, f.1.as_str()), (200, "follower"), "{f:?}");
    }
    (leader, followers)
}

/// The upstream call of a stream asks for usage, whatever its leader asked.
fn assert_asked_for_usage(app: &TestApp) {
    let last = app.mock.stats().last_requests.pop().unwrap();
    assert_eq!(
        last.body["stream_options"],
        json!({"include_usage": true}),
        "{}",
        last.body
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn followers_and_cache_hits_of_a_leader_that_asked_for_usage_get_no_usage_chunk() {
    let app = TestApp::with(held_spec()).await;
    let leader = streamed("usage for the leader only", Some(true));
    let follower = streamed("usage for the leader only", None);
    let (l, followers) = shared(&app, &leader, &follower, 10).await;
    assert_eq!(l.0, 200);
    assert_usage_chunk(&l.2, "the leader");
    assert_asked_for_usage(&app);
    for (_, _, body) in &followers {
        assert_no_usage_chunk(body, "a follower");
    }
    // Asked for usage with `false`: the same as not asking.
    let mut off = follower.clone();
    off["stream_options"] = json!({"include_usage": false});
    for body in [&follower, &off] {
        let r = app.chat(ACME, body).await;
        assert_eq!(r.headers()["idem-outcome"], "cache-hit");
        assert_no_usage_chunk(&r.text().await.unwrap(), "a cache hit");
    }
    // One that asks gets it from the cache too, and so does a plain one.
    let r = app.chat(ACME, &leader).await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    assert_usage_chunk(&r.text().await.unwrap(), "a cache hit that asked");
    let r = app
        .chat(ACME, &chat_body("usage for the leader only"))
        .await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    let v: Value = r.json().await.unwrap();
    assert_usage(&v["usage"], "a plain cache hit");
    assert_eq!(app.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn followers_and_cache_hits_that_ask_for_usage_get_it_when_the_leader_did_not() {
    let app = TestApp::with(held_spec()).await;
    let leader = streamed("usage for everybody but the leader", None);
    let follower = streamed("usage for everybody but the leader", Some(true));
    let (l, followers) = shared(&app, &leader, &follower, 10).await;
    assert_eq!(l.0, 200);
    assert_no_usage_chunk(&l.2, "the leader");
    assert_asked_for_usage(&app);
    for (_, _, body) in &followers {
        assert_usage_chunk(body, "a follower");
    }
    let r = app.chat(ACME, &follower).await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    assert_usage_chunk(&r.text().await.unwrap(), "a cache hit");
    let r = app.chat(ACME, &leader).await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    assert_no_usage_chunk(&r.text().await.unwrap(), "a cache hit that did not ask");
    let r = app
        .chat(ACME, &chat_body("usage for everybody but the leader"))
        .await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    let v: Value = r.json().await.unwrap();
    assert_usage(&v["usage"], "a plain cache hit");
    assert_eq!(app.calls(), 1);
}

/// A plain leader: streaming followers are given a stream made from its
/// answer, with or without the usage chunk, each as it asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streaming_followers_of_a_plain_leader_get_usage_as_each_asked() {
    let app = TestApp::with(held_spec()).await;
    let leader = chat_body("a plain leader");
    let calls = app.calls();
    let first = wave(&app, ACME, &leader, 1).await;
    held(&app.mock, 1).await;
    let with = wave(&app, ACME, &streamed("a plain leader", Some(true)), 3).await;
    let without = wave(&app, ACME, &streamed("a plain leader", None), 3).await;
    app.until_followers(6).await;
    release(&app.mock, None).await;
    let (status, _, body) = collect(first).await.remove(0);
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_usage(&v["usage"], "the plain leader");
    for (_, outcome, body) in collect(with).await {
        assert_eq!(outcome, "follower");
        assert_usage_chunk(&body, "a follower that asked");
    }
    for (_, outcome, body) in collect(without).await {
        assert_eq!(outcome, "follower");
        assert_no_usage_chunk(&body, "a follower that did not ask");
    }
    assert_eq!(app.calls(), calls + 1);
}

/// A streamed call's `stream_options` are idem's: other fields a client
/// sends there (rendering options of its own) never reach the provider, so
/// they cannot be copied to another client of the same answer.
#[tokio::test]
async fn a_clients_other_stream_options_are_not_sent_upstream() {
    let app = TestApp::with(Spec::default()).await;
    let mut body = streamed("obfuscated", Some(false));
    body["stream_options"]["include_obfuscation"] = json!(true);
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.status(), 200);
    assert_no_usage_chunk(&r.text().await.unwrap(), "the leader");
    assert_asked_for_usage(&app);
    // A plain request never carries them: providers refuse stream_options
    // without a stream.
    let mut plain = chat_body("plain with options");
    plain["stream_options"] = json!({"include_usage": true});
    let r = app.chat(ACME, &plain).await;
    assert_eq!(r.status(), 200);
    let last = app.mock.stats().last_requests.pop().unwrap();
    assert!(last.body.get("stream_options").is_none(), "{}", last.body);
}

/// A provider that refuses `stream_options` (`stream_usage = false`): the
/// call asks for nothing, and a client that asked gets no usage chunk made
/// up (the usage is not known).
#[tokio::test]
async fn with_stream_usage_off_the_call_asks_for_nothing() {
    let app = TestApp::with(Spec {
        provider_extra: "stream_usage = false\n".into(),
        ..Spec::default()
    })
    .await;
    let r = app.chat(ACME, &streamed("no usage here", Some(true))).await;
    assert_eq!(r.status(), 200);
    let body = r.text().await.unwrap();
    assert_no_usage_chunk(&body, "a client that asked");
    let last = app.mock.stats().last_requests.pop().unwrap();
    assert!(last.body.get("stream_options").is_none(), "{}", last.body);
}

/// A request refused before any flight existed says so: an open circuit's
/// `no_target_available` is `no-target`, a bad body `rejected`, an unknown
/// model `rejected`; a follower whose wait ran out is `wait-timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idem_outcome_names_what_happened_to_a_refused_request() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            hold: true,
            ..Behaviour::default()
        },
        coalesce: "max_wait = \"200ms\"\n".into(),
        ..Spec::default()
    })
    .await;
    let r = app
        .post_json(ACME, "/v1/chat/completions", &json!({"model": "bot"}), &[])
        .await;
    assert_eq!(r.headers()["idem-outcome"], "rejected");
    assert_error(r, 400, "missing_required_parameter").await;
    let mut unknown = chat_body("which model?");
    unknown["model"] = json!("no-such-model");
    let r = app.chat(ACME, &unknown).await;
    assert_eq!(r.headers()["idem-outcome"], "rejected");
    assert_error(r, 404, "model_not_found").await;
    let r = app.chat("sk-not-a-key-of-anybody", &unknown).await;
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["idem-outcome"], "rejected");

    let body = chat_body("a leader that does not come back in time");
    let first = wave(&app, ACME, &body, 1).await;
    held(&app.mock, 1).await;
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.headers()["idem-outcome"], "wait-timeout");
    assert!(r.headers().contains_key("idem-fingerprint"));
    assert_error(r, 504, "coalesce_wait_timeout").await;
    release(&app.mock, None).await;
    assert_eq!(collect(first).await[0].1, "leader");
    let (_, stats) = app.get_json(ACME, "/v1/stats").await;
    // The tenant's own: the bad body and the unknown model (the 401 has no
    // tenant).
    assert_eq!(stats["coalescing"]["rejected"], 2, "{stats}");
    assert_eq!(stats["coalescing"]["wait_timeouts"], 1, "{stats}");
}
