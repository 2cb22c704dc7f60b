//! Provider answers that are not chat completions (a 200 with garbage) and
//! answers past the provider's `max_answer_bytes`: each is a failed attempt,
//! shared with the flight's followers as a 502 (or, on a stream already
//! relayed, an in-band error event without `[DONE]`), negatively cached like
//! a 5xx, never in the result cache, never a job's result.

use std::str::FromStr;
use std::time::{Duration, Instant};

use idem::cache::Lookup;
use idem::fingerprint::Fingerprint;
use idem::mock_upstream::{Behaviour, Garbage};
use serde_json::{Value, json};

use crate::helpers::*;

/// The routes' `server_error_ttl` here: short, so that its end is seen.
const NEGATIVE_TTL: Duration = Duration::from_millis(1000);

/// The answer limit the size tests give the primary provider.
const LIMIT: u64 = 64 * 1024;

/// The short negative TTL, and the primary's answer limit when given.
fn failing_spec(primary: Behaviour, limit: Option<u64>) -> Spec {
    Spec {
        primary,
        cache: format!("server_error_ttl = \"{}ms\"\n", NEGATIVE_TTL.as_millis()),
        provider_extra: limit
            .map(|l| format!("max_answer_bytes = {l}\n"))
            .unwrap_or_default(),
        ..Spec::default()
    }
}

fn garbage_spec(kind: Garbage) -> Spec {
    failing_spec(
        Behaviour {
            hold: true,
            garbage: Some(kind),
            ..Behaviour::default()
        },
        None,
    )
}

fn streamed(content: &str) -> Value {
    let mut body = chat_body(content);
    body["stream"] = json!(true);
    body
}

/// Asserts that one answer is the failure `code`: for a streaming client of
/// a live stream, a 200 whose last event is the error and no `[DONE]`;
/// otherwise a 502 OpenAI error object.
fn assert_failed(status: u16, body: &str, in_band: bool, code: &str) {
    if in_band {
        assert_eq!(status, 200, "{body}");
        assert!(
            !body.lines().any(|l| l.trim() == "data: [DONE]"),
            "a failed stream ended with [DONE]: {body}"
        );
        let last = body
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .last()
            .unwrap_or_else(|| panic!("an empty stream: {body:?}"));
        let data = last
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("the last event is not whole: {last:?}"));
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{e}: {data}"));
        assert_eq!(v["error"]["code"], code, "{body}");
        return;
    }
    assert_eq!(status, 502, "{body}");
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    assert_eq!(v["error"]["code"], code, "{v}");
    assert_eq!(v["error"]["type"], "upstream_error", "{v}");
    assert!(v["error"]["message"].is_string(), "{v}");
}

/// A wave of `n` identical requests behind a held leader: one upstream call,
/// every answer the failure `code`, the leader's and the followers' alike;
/// then the same request within the negative TTL is a `negative-hit`
/// without a call. Returns the fingerprint and when the failure was cached.
async fn failing_wave(app: &TestApp, body: &Value, n: usize, code: &str) -> (Fingerprint, Instant) {
    let stream = body["stream"] == true;
    let calls = app.calls();
    let tasks = wave(app, ACME, body, n).await;
    held(&app.mock, 1).await;
    app.until_followers(n as u64 - 1).await;
    release(&app.mock, None).await;
    let results = collect(tasks).await;
    let cached_at = Instant::now();
    assert_eq!(app.calls(), calls + 1, "the wave made more than one call");
    let outcomes = count_by(&results, |(_, o, _)| o.clone());
    assert_eq!(outcomes.get("leader"), Some(&1), "{outcomes:?}");
    assert_eq!(outcomes.get("follower"), Some(&(n - 1)), "{outcomes:?}");
    for (status, _, b) in &results {
        assert_failed(*status, b, stream, code);
    }

    let r = app.chat(ACME, body).await;
    assert_eq!(r.headers()["idem-outcome"], "negative-hit");
    let fp = Fingerprint::from_str(r.headers()["idem-fingerprint"].to_str().unwrap()).unwrap();
    let status = r.status().as_u16();
    assert_failed(status, &r.text().await.unwrap(), false, code);
    assert!(
        cached_at.elapsed() < NEGATIVE_TTL,
        "the check ran past the negative TTL"
    );
    assert_eq!(app.calls(), calls + 1, "a negative hit called the provider");
    (fp, cached_at)
}

/// Past the negative TTL of a failure cached at `cached_at`, the request
/// leads a new call, which fails the same way.
async fn fails_again_after_the_ttl(app: &TestApp, body: &Value, cached_at: Instant, code: &str) {
    tokio::time::sleep_until((cached_at + NEGATIVE_TTL + Duration::from_millis(50)).into()).await;
    let calls = app.calls();
    let task = wave(app, ACME, body, 1).await;
    held(&app.mock, 1).await;
    release(&app.mock, None).await;
    let (status, outcome, b) = collect(task).await.remove(0);
    assert_eq!(outcome, "leader");
    assert_failed(status, &b, body["stream"] == true, code);
    assert_eq!(app.calls(), calls + 1);
}

/// Nothing was served from, or is in, the result cache.
async fn never_cached(app: &TestApp, fps: &[Fingerprint]) {
    for fp in fps {
        assert!(
            matches!(app.state.core.coalescer.cache.get(fp), Lookup::Miss),
            "a failure is in the result cache"
        );
    }
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("idem_requests_total{route=\"bot\",outcome=\"cache-hit\"} 0"),
        "{metrics}"
    );
}

/// Plain and streamed waves against a provider answering garbage of `kind`.
async fn garbage_is_a_shared_failure(kind: Garbage) {
    let app = TestApp::with(garbage_spec(kind)).await;
    let code = "bad_upstream_answer";
    let plain = chat_body(&format!("garbage {kind:?}, plain"));
    let stream = streamed(&format!("garbage {kind:?}, streamed"));
    let (plain_fp, plain_at) = failing_wave(&app, &plain, 20, code).await;
    let (stream_fp, stream_at) = failing_wave(&app, &stream, 20, code).await;
    fails_again_after_the_ttl(&app, &plain, plain_at, code).await;
    fails_again_after_the_ttl(&app, &stream, stream_at, code).await;
    never_cached(&app, &[plain_fp, stream_fp]).await;
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("idem_bad_upstream_answers_total{provider=\"primary\"} 4"),
        "{metrics}"
    );
    assert!(
        metrics.contains("idem_upstream_calls_total{provider=\"primary\",status=\"200\"} 4"),
        "{metrics}"
    );
    app.until_no_flights().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_that_is_not_json_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::NotJson).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_truncated_answer_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::Truncated).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_empty_answer_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::Empty).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_error_object_with_a_200_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::ErrorObject).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_without_choices_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::EmptyChoices).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_that_ends_without_done_or_finish_reason_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::StreamWithoutDone).await;
}

/// Every chunk, finish reasons included, but the body ends without
/// `[DONE]`: an OpenAI-compatible stream that did not end as a success.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_finished_stream_without_done_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::FinishedWithoutDone).await;
}

/// `[DONE]` after content chunks of which none finished its choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stream_with_done_but_no_finish_reason_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::DoneWithoutFinish).await;
}

/// Two chunks, then `data: {"error": ...}`, then `[DONE]`, as OpenAI
/// sends a server error mid-stream: every client of the wave gets the
/// error, the next identical stream and plain request are negative hits
/// (a plain one a 502, never a 200 with an error body), and nothing is in
/// the result cache.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_error_inside_a_stream_is_a_shared_502_bad_upstream_answer() {
    garbage_is_a_shared_failure(Garbage::StreamError).await;
}

/// The provider's own message reaches the client.
#[tokio::test]
async fn an_error_inside_a_stream_carries_the_providers_message() {
    let app = TestApp::with(failing_spec(
        Behaviour {
            garbage: Some(Garbage::StreamError),
            ..Behaviour::default()
        },
        None,
    ))
    .await;
    let r = app.chat(ACME, &streamed("an error inside")).await;
    let r2 = app.chat(ACME, &chat_body("an error inside")).await;
    assert_eq!(r2.headers()["idem-outcome"], "negative-hit");
    let v = assert_error(r2, 502, "bad_upstream_answer").await;
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("The server had an error while processing your request."),
        "{message}"
    );
    assert_eq!(r.status(), 200, "the stream had begun");
}

async fn a_job_against_a_garbage_provider_fails(kind: Garbage) {
    let request = match kind {
        Garbage::StreamError => streamed("a job for a broken provider"),
        _ => chat_body("a job for a broken provider"),
    };
    let app = TestApp::with(Spec {
        primary: Behaviour {
            garbage: Some(kind),
            ..Behaviour::default()
        },
        attempts: "max = 2\nbackoff_base = \"10ms\"\nbackoff_max = \"20ms\"\n".into(),
        ..Spec::default()
    })
    .await;
    let r = app
        .post_json(
            ACME,
            "/v1/jobs",
            &json!({"request": request}),
            &[("idempotency-key", "garbage-1")],
        )
        .await;
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let started = Instant::now();
    let job = loop {
        let (_, job) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
        if job["state"] != "queued" && job["state"] != "running" {
            break job;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "{job}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(job["state"], "failed", "{job}");
    assert!(job["result"].is_null(), "{job}");
    assert!(job["completed_by"].is_null(), "{job}");
    let attempts = job["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2, "{job}");
    for a in attempts {
        assert_eq!(a["state"], "failed", "{job}");
        assert_eq!(a["reason"], "bad_upstream_answer", "{job}");
    }
    assert_eq!(app.calls(), 2);
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("idem_attempts_total{provider=\"primary\",outcome=\"failed\"} 2"),
        "{metrics}"
    );
}

#[tokio::test]
async fn a_job_against_a_garbage_provider_fails_and_never_succeeds_with_garbage() {
    a_job_against_a_garbage_provider_fails(Garbage::ErrorObject).await;
}

/// A job's request that streams gets the error inside the stream: the job
/// fails and never succeeds with half an answer.
#[tokio::test]
async fn a_job_whose_stream_fails_inside_does_not_succeed() {
    a_job_against_a_garbage_provider_fails(Garbage::StreamError).await;
}

/// A provider whose answers are padded to `bytes`, held until released.
fn padded_spec(bytes: u64) -> Spec {
    failing_spec(
        Behaviour {
            hold: true,
            pad_bytes: Some(bytes),
            ..Behaviour::default()
        },
        Some(LIMIT),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_past_max_answer_bytes_is_a_shared_502_and_never_cached() {
    let app = TestApp::with(padded_spec(2 * LIMIT)).await;
    let code = "upstream_answer_too_large";
    let (plain_fp, _) = failing_wave(&app, &chat_body("a long answer, plain"), 10, code).await;
    let (stream_fp, _) = failing_wave(&app, &streamed("a long answer, streamed"), 10, code).await;
    never_cached(&app, &[plain_fp, stream_fp]).await;
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("idem_upstream_answers_too_large_total{provider=\"primary\"} 2"),
        "{metrics}"
    );
    app.until_no_flights().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_answer_just_under_max_answer_bytes_passes_and_is_cached() {
    let app = TestApp::with(padded_spec(LIMIT - 2048)).await;
    for body in [
        chat_body("nearly too long"),
        streamed("nearly too long, streamed"),
    ] {
        let stream = body["stream"] == true;
        let task = wave(&app, ACME, &body, 1).await;
        held(&app.mock, 1).await;
        release(&app.mock, None).await;
        let (status, outcome, text) = collect(task).await.remove(0);
        assert_eq!((status, outcome.as_str()), (200, "leader"), "{text}");
        assert!(text.len() as u64 > LIMIT / 2 && (text.len() as u64) < LIMIT);
        let content = if stream {
            sse_content(&text)
        } else {
            content_of(&serde_json::from_str(&text).unwrap())
        };
        assert!(content.starts_with("mock answer #"), "{content}");
        assert!(content.len() as u64 > LIMIT / 2, "{}", content.len());
        let r = app.chat(ACME, &body).await;
        assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    }
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gateway_stops_reading_an_answer_at_the_limit() {
    // 4 MiB streamed in frames of about a kilobyte, 5 ms apart: reading it
    // all would take some 17 s; the limit is reached in a third of a second.
    let app = TestApp::with(failing_spec(
        Behaviour {
            pad_bytes: Some(4 * 1024 * 1024),
            chunk_delay_ms: 5,
            ..Behaviour::default()
        },
        Some(LIMIT),
    ))
    .await;
    let started = Instant::now();
    let r = app.chat(ACME, &streamed("an endless answer")).await;
    let text = r.text().await.unwrap();
    assert_failed(200, &text, true, "upstream_answer_too_large");
    // What the client got is at most the limit plus the error event.
    assert!((text.len() as u64) < LIMIT + 1024, "{}", text.len());
    // The gateway hung up: the mock's stream ended long before its end.
    eventually(Duration::from_secs(10), || app.mock.stats().in_flight == 0).await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the whole answer was read"
    );
}

#[tokio::test]
async fn certification_stops_reading_an_answer_at_the_limit_too() {
    let contract =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/contracts/support.toml");
    let app = TestApp::with(Spec {
        primary: Behaviour {
            pad_bytes: Some(2 * LIMIT),
            ..Behaviour::default()
        },
        route: format!("contract = {:?}\n", contract.display().to_string()),
        provider_extra: format!("max_answer_bytes = {LIMIT}\n"),
        ..Spec::default()
    })
    .await;
    let r = app
        .post_json(
            ADMIN,
            "/v1/admin/certify",
            &json!({"route": "bot", "target": "primary"}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["passed"], false, "{v}");
    let run = &v["reports"][0]["cases"][0]["runs"][0];
    let error = run["error"].as_str().unwrap_or_default();
    assert!(error.contains("max_answer_bytes"), "{v}");
}
