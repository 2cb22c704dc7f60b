//! After a leader dies, pauses or comes back late, every waiter on every
//! replica gets one answer: the take-over's. Real `idem` processes share
//! Redis and PostgreSQL; leaders are SIGKILLed or SIGSTOPped.

use std::collections::HashSet;
use std::time::Duration;

use idem::mock_upstream::Behaviour;
use serde_json::json;

use crate::helpers::*;
use crate::replicas::{Cluster, redis_url};

/// Status, `Idem-Outcome` and body of every request of a wave.
type Results = Vec<(u16, String, String)>;

fn bodies(results: &Results) -> HashSet<&str> {
    results.iter().map(|(_, _, b)| b.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_takeover_that_answers_at_once_is_every_waiters_answer() {
    let _ = takeover_answers_at_once(&redis_url()).await;
}

/// Leader replica 0 is SIGKILLed mid-call with followers waiting on
/// replicas 1 and 2; the take-over's call answers at once, before the other
/// replica's waiter looks again. Every survivor gets the take-over's answer
/// and nobody calls a third time. Returns the cluster (replicas 1 and 2 up).
pub(crate) async fn takeover_answers_at_once(redis: &str) -> Cluster {
    let spec = Spec {
        coalesce: "lease = \"1s\"\nmax_wait = \"30s\"\n".into(),
        ..holding()
    };
    let mut c = Cluster::start(3, spec, redis).await;
    let body = chat_body("Who answers after a take-over?");
    let doomed = c.fire(&[0], &body, 1);
    held(&c.mocks.primary, 1).await;
    let survivors = c.fire(&[1, 2], &body, 40);
    c.until_waiting(&[1, 2], 38).await;
    // The take-over's call answers at once; the dead leader's stays held.
    c.mocks.primary.set_behaviour(Behaviour::default());
    c.procs[0].child.kill().await.unwrap();
    let _ = c.procs[0].child.wait().await;
    let results = collect(survivors).await;
    assert!(
        results.iter().all(|(s, _, _)| *s == 200),
        "{:?}",
        results.iter().map(|r| r.0).collect::<Vec<_>>()
    );
    let seen = bodies(&results);
    assert_eq!(seen.len(), 1, "replicas handed out different answers");
    assert!(seen.iter().next().unwrap().contains("#2"), "{seen:?}");
    assert_eq!(
        c.mocks.primary.stats().calls,
        2,
        "a waiter led again after the take-over had answered"
    );
    let _ = collect(doomed).await;
    c
}

/// Leader A (replica 0) calls and is paused past its lease with its local
/// followers; replica 1 takes the flight over and its call answers at once
/// with `takeover`; then A's held call answers and A resumes.
async fn a_paused_leader_comes_back(cache: &str, takeover: Behaviour) -> (Cluster, Results) {
    let spec = Spec {
        coalesce: "lease = \"1s\"\nmax_wait = \"30s\"\n".into(),
        cache: cache.into(),
        ..holding()
    };
    let c = Cluster::start(3, spec, &redis_url()).await;
    let body = chat_body("Who writes last?");
    let mut on_a = c.fire(&[0], &body, 1);
    held(&c.mocks.primary, 1).await;
    on_a.extend(c.fire(&[0], &body, 5));
    c.until_waiting(&[0], 5).await;
    c.procs[0].signal("STOP");
    c.mocks.primary.set_behaviour(takeover);
    let on_b = collect(c.fire(&[1], &body, 10)).await;
    assert_eq!(c.mocks.primary.stats().calls, 2, "no take-over");
    let b = bodies(&on_b);
    assert_eq!(b.len(), 1, "{on_b:?}");
    // A's call answers now (a success, whatever the take-over got), then A
    // wakes up and completes late.
    release_with(
        &c.mocks.primary,
        json!({"content": "the paused leader's answer"}),
    )
    .await;
    c.procs[0].signal("CONT");
    let on_a = collect(on_a).await;
    for (status, _, text) in &on_a {
        assert!(
            b.contains(text.as_str()),
            "a client of the paused leader got its late answer ({status} {text}) instead of \
             the take-over's ({b:?})"
        );
    }
    (c, on_b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_leaders_late_answer_goes_nowhere_when_the_takeover_was_not_cached() {
    let (c, on_b) = a_paused_leader_comes_back("enabled = false\n", Behaviour::default()).await;
    assert!(on_b.iter().all(|(s, _, t)| *s == 200 && t.contains("#2")));
    assert_eq!(c.mocks.primary.stats().calls, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_leaders_late_success_does_not_replace_the_takeovers_error() {
    let failing = Behaviour {
        fail_status: Some(500),
        ..Behaviour::default()
    };
    let (c, on_b) = a_paused_leader_comes_back("", failing).await;
    assert!(on_b.iter().all(|(s, _, _)| *s == 500), "{on_b:?}");
    // The take-over's error is what every replica serves now, the paused
    // leader's own included: nobody serves its late success from a cache.
    for i in [0, 1, 2] {
        let r = c
            .client
            .post(format!("{}/v1/chat/completions", c.base(i)))
            .bearer_auth(ACME)
            .json(&chat_body("Who writes last?"))
            .send()
            .await
            .unwrap();
        let outcome = r.headers()["idem-outcome"].to_str().unwrap().to_string();
        assert_eq!(
            (r.status().as_u16(), outcome.as_str()),
            (500, "negative-hit"),
            "replica {i}"
        );
    }
    assert_eq!(c.mocks.primary.stats().calls, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_on_another_replica_waits_for_a_stream_longer_than_the_provider_timeout() {
    // Chunks every 400 ms for about 4 s: each pause is well within the
    // provider's 1 s (idle) timeout, the whole answer is not.
    let spec = Spec {
        primary: Behaviour {
            chunk_delay_ms: 400,
            ..Behaviour::default()
        },
        provider_timeout: "1s".into(),
        coalesce: "lease = \"300ms\"\nmax_wait = \"30s\"\n".into(),
        ..Spec::default()
    };
    let c = Cluster::start(2, spec, &redis_url()).await;
    let mut body = chat_body("a long stream, please");
    body["stream"] = json!(true);
    let leader = c.fire(&[0], &body, 1);
    eventually(Duration::from_secs(10), || {
        c.mocks.primary.stats().calls == 1
    })
    .await;
    body["stream"] = json!(false);
    let follower = collect(c.fire(&[1], &body, 1)).await;
    let (status, outcome, text) = &follower[0];
    assert_eq!(*status, 200, "{text}");
    assert_eq!(outcome, "follower");
    let v: serde_json::Value = serde_json::from_str(text).unwrap();
    assert!(content_of(&v).contains("#1"), "{text}");
    let (status, _, streamed) = &collect(leader).await[0];
    assert_eq!(*status, 200);
    assert_eq!(sse_content(streamed), content_of(&v));
    assert_eq!(c.mocks.primary.stats().calls, 1);
}
