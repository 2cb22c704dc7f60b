//! Coalescing and the result cache (docs/design.md, "Coalescing and the caches"): one upstream call per
//! identical prompt in flight, against a provider the tests hold and
//! release.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::helpers::*;

each_kind! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_wave_of_1000_makes_one_call_the_next_wave_none_and_another_tenant_one(kind) {
        let app = TestApp::with(Spec {
            primary_kind: kind,
            ..holding()
        }).await;
        let body = chat_body("Where is my order?");
        let tasks = wave(&app, ACME, &body, 1000).await;
        held(&app.mock, 1).await;
        app.until_followers(999).await;
        release(&app.mock, None).await;
        let results = collect(tasks).await;
        assert_eq!(
            app.calls(),
            1,
            "a wave of 1000 identical requests made more than one call"
        );
        assert!(results.iter().all(|(s, _, _)| *s == 200));
        let bodies: HashSet<&str> = results.iter().map(|(_, _, b)| b.as_str()).collect();
        assert_eq!(bodies.len(), 1, "followers got different answers");
        let outcomes = count_by(&results, |(_, o, _)| o.clone());
        assert_eq!(outcomes.get("leader"), Some(&1));
        assert_eq!(outcomes.get("follower"), Some(&999));
        let first: Value = serde_json::from_str(results[0].2.as_str()).unwrap();
        assert_eq!(content_of(&first), "mock answer #1 to: Where is my order?");

        // A second wave within the TTL: no call at all.
        let results = collect(wave(&app, ACME, &body, 1000).await).await;
        assert_eq!(app.calls(), 1);
        assert!(
            results
                .iter()
                .all(|(s, o, b)| *s == 200 && o == "cache-hit" && bodies.contains(b.as_str()))
        );

        // The figures agree.
        let (_, stats) = app.get_json(ACME, "/v1/stats").await;
        let c = &stats["coalescing"];
        assert_eq!(c["incoming_requests"], 2000);
        assert_eq!(c["upstream_calls"], 1);
        assert_eq!(c["followers"], 999);
        assert_eq!(c["cache_hits"], 1000);
        assert_eq!(c["saved_calls"], 1999);
        let metrics = app.metrics().await;
        assert!(
            metrics.contains("idem_requests_total{route=\"bot\",outcome=\"follower\"} 999"),
            "{metrics}"
        );
        assert!(
            metrics.contains("idem_upstream_calls_total{provider=\"primary\",status=\"200\"} 1"),
            "{metrics}"
        );
        assert!(
            metrics.contains("idem_coalesce_wait_seconds_count{route=\"bot\"} 999"),
            "{metrics}"
        );

        // The same wave from another tenant: one more call, never acme's answer.
        let tasks = wave(&app, BETA, &body, 1000).await;
        held(&app.mock, 1).await;
        release(&app.mock, None).await;
        let results = collect(tasks).await;
        assert_eq!(app.calls(), 2);
        for (s, _, b) in &results {
            assert_eq!(*s, 200);
            assert!(
                !bodies.contains(b.as_str()),
                "tenant beta received tenant acme's answer"
            );
            assert!(b.contains("mock answer #2"), "{b}");
        }
        app.until_no_flights().await;
    }
}

#[tokio::test]
async fn what_changes_the_answer_makes_a_separate_call_and_noise_does_not() {
    let app = TestApp::with(Spec {
        extra: "[[routes]]\nmodel = \"other\"\ntargets = [{ provider = \"primary\", model = \"gpt-4o\" }]\n".into(),
        ..Spec::default()
    })
    .await;
    let base = json!({"model": "bot", "messages": [{"role": "user", "content": "Summarise this"}], "temperature": 0});
    assert_eq!(app.chat(ACME, &base).await.status(), 200);
    assert_eq!(app.calls(), 1);

    let mut hot = base.clone();
    hot["temperature"] = json!(0.8);
    assert_eq!(
        app.chat(ACME, &hot).await.headers()["idem-outcome"],
        "leader"
    );
    assert_eq!(app.calls(), 2, "temperature 0 and 0.8 shared a call");

    let mut other = base.clone();
    other["model"] = json!("other");
    assert_eq!(
        app.chat(ACME, &other).await.headers()["idem-outcome"],
        "leader"
    );
    assert_eq!(app.calls(), 3, "two models shared a call");

    let image = |byte: u8| {
        let data: String = format!("data:image/png;base64,iVBORw0KGgo{}", byte as char);
        json!({"model": "bot", "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is on this picture?"},
            {"type": "image_url", "image_url": {"url": data}}]}]})
    };
    app.chat(ACME, &image(b'A')).await;
    app.chat(ACME, &image(b'B')).await;
    assert_eq!(
        app.calls(),
        5,
        "attachments that differ by one byte shared a call"
    );

    // Noise: request ids, stream, user (tenant scope): the same task.
    let mut noisy = base.clone();
    noisy["request_id"] = json!("req-123");
    noisy["user"] = json!("someone");
    noisy["stream"] = json!(false);
    noisy["stream_options"] = json!({"include_usage": false});
    let r = app.chat(ACME, &noisy).await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    let mut streamed = base.clone();
    streamed["stream"] = json!(true);
    let r = app.chat(ACME, &streamed).await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    assert_eq!(
        sse_content(&r.text().await.unwrap()),
        "mock answer #1 to: Summarise this"
    );
    assert_eq!(app.calls(), 5);
}

each_kind! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_failing_provider_is_not_re_attacked_by_waiters(kind) {
        let app = TestApp::with(Spec {
            primary: Behaviour {
                hold: true,
                fail_status: Some(500),
                ..Behaviour::default()
            },
            cache: "server_error_ttl = \"1500ms\"\n".into(),
            primary_kind: kind,
            ..Spec::default()
        })
        .await;
        let body = chat_body("Is the service up?");
        let tasks = wave(&app, ACME, &body, 200).await;
        held(&app.mock, 1).await;
        app.until_followers(199).await;
        release(&app.mock, None).await;
        let results = collect(tasks).await;
        assert_eq!(app.calls(), 1);
        let first = &results[0].2;
        for (status, _, b) in &results {
            assert_eq!(*status, 500);
            assert_eq!(b, first, "a follower got another error than its leader");
        }
        let v: Value = serde_json::from_str(first).unwrap();
        assert_eq!(v["error"]["message"], "mock failure");
        let metrics = app.metrics().await;
        assert!(
            metrics.contains("idem_leader_errors_shared_total{route=\"bot\"} 199"),
            "{metrics}"
        );

        // A new wave right after: answered from the negative cache.
        let started = Instant::now();
        let results = collect(wave(&app, ACME, &body, 200).await).await;
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "the check ran past the negative TTL"
        );
        assert_eq!(app.calls(), 1, "waiters re-attacked a failing provider");
        assert!(
            results
                .iter()
                .all(|(s, o, _)| *s == 500 && o == "negative-hit")
        );

        // After the negative TTL: exactly one call again.
        tokio::time::sleep(Duration::from_millis(1600)).await;
        let tasks = wave(&app, ACME, &body, 50).await;
        held(&app.mock, 1).await;
        app.until_followers(49).await;
        release(&app.mock, None).await;
        collect(tasks).await;
        assert_eq!(app.calls(), 2);
    }
}

#[tokio::test]
async fn retry_after_sets_the_negative_ttl() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            fail_status: Some(429),
            retry_after: Some(5),
            ..Behaviour::default()
        },
        ..Spec::default()
    })
    .await;
    let body = chat_body("rate limited");
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["idem-cache-ttl-ms"], "5000");
    assert_eq!(r.headers()["retry-after"], "5");
    // Past the 2 s default, the 429 is still served from the negative cache.
    tokio::time::sleep(Duration::from_millis(2300)).await;
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["idem-outcome"], "negative-hit");
    assert_eq!(app.calls(), 1);
}

each_kind! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_leaders_client_leaving_does_not_cancel_the_call(kind) {
        let app = TestApp::with(Spec {
            primary_kind: kind,
            ..holding()
        }).await;
        let body = chat_body("I will hang up");
        let leader = tokio::spawn({
            let (client, url) = (app.client.clone(), app.url("/v1/chat/completions"));
            let body = body.clone();
            async move { client.post(url).bearer_auth(ACME).json(&body).send().await }
        });
        held(&app.mock, 1).await;
        let followers = wave(&app, ACME, &body, 20).await;
        app.until_followers(20).await;
        leader.abort();
        let _ = leader.await;
        release(&app.mock, None).await;
        let results = collect(followers).await;
        assert!(
            results
                .iter()
                .all(|(s, o, b)| *s == 200 && o == "follower" && b.contains("#1"))
        );
        assert_eq!(app.calls(), 1);
        app.until_no_flights().await;
    }
}

#[tokio::test]
async fn no_flight_is_left_behind_after_success_error_timeout_or_cancel() {
    let app = TestApp::with(Spec {
        provider_timeout: "400ms".into(),
        ..Spec::default()
    })
    .await;
    let gauge = |m: &str| {
        m.lines()
            .find(|l| l.starts_with("idem_inflight_flights "))
            .map(|l| l.split(' ').nth(1).unwrap().to_string())
            .unwrap()
    };
    // Success.
    assert_eq!(app.chat(ACME, &chat_body("ok")).await.status(), 200);
    app.until_no_flights().await;
    assert_eq!(gauge(&app.metrics().await), "0");
    // Provider error.
    app.mock.set_behaviour(Behaviour {
        fail_status: Some(503),
        ..Behaviour::default()
    });
    assert_eq!(app.chat(ACME, &chat_body("error")).await.status(), 503);
    app.until_no_flights().await;
    assert_eq!(gauge(&app.metrics().await), "0");
    // Timeout (the provider hangs past its timeout): 504, unknown outcome.
    app.mock.set_behaviour(Behaviour {
        hang: true,
        ..Behaviour::default()
    });
    let r = app.chat(ACME, &chat_body("timeout")).await;
    assert_error(r, 504, "upstream_timeout").await;
    app.until_no_flights().await;
    assert_eq!(gauge(&app.metrics().await), "0");
    // The client cancels while the provider hangs: the call ends by itself
    // at the provider timeout, and so does the flight.
    let cancelled = tokio::spawn({
        let (client, url) = (app.client.clone(), app.url("/v1/chat/completions"));
        async move {
            client
                .post(url)
                .bearer_auth(ACME)
                .json(&chat_body("cancel"))
                .send()
                .await
        }
    });
    held(&app.mock, 1).await;
    cancelled.abort();
    app.until_no_flights().await;
    assert_eq!(gauge(&app.metrics().await), "0");
    // (A panic in the leader task is covered by flight::table's unit test.)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hanging_leader_releases_followers_at_max_wait_without_re_attack() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            hang: true,
            ..Behaviour::default()
        },
        coalesce: "max_wait = \"300ms\"\non_wait_timeout = \"fail\"\n".into(),
        ..Spec::default()
    })
    .await;
    let body = chat_body("hang");
    let leader = tokio::spawn({
        let (client, url, body) = (
            app.client.clone(),
            app.url("/v1/chat/completions"),
            body.clone(),
        );
        async move { client.post(url).bearer_auth(ACME).json(&body).send().await }
    });
    held(&app.mock, 1).await;
    let started = Instant::now();
    let results = collect(
        (0..20)
            .map(|_| {
                let (client, url, body) = (
                    app.client.clone(),
                    app.url("/v1/chat/completions"),
                    body.clone(),
                );
                tokio::spawn(async move {
                    let r = client
                        .post(url)
                        .bearer_auth(ACME)
                        .json(&body)
                        .send()
                        .await
                        .unwrap();
                    let retry: u64 = r.headers()["retry-after"]
                        .to_str()
                        .unwrap()
                        .parse()
                        .unwrap();
                    let v: Value = r.json().await.unwrap();
                    (v["error"]["code"].as_str().unwrap().to_string(), retry)
                })
            })
            .collect(),
    )
    .await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(300),
        "followers released early: {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "followers waited far past max_wait: {waited:?}"
    );
    for (code, retry) in &results {
        assert_eq!(code, "coalesce_wait_timeout");
        assert!((1..=3).contains(retry), "Retry-After {retry}");
    }
    assert_eq!(
        app.calls(),
        1,
        "released followers re-attacked the provider"
    );
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("idem_coalesce_wait_timeouts_total{route=\"bot\"} 20"),
        "{metrics}"
    );
    leader.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_wait_timeout_stale_serves_the_previous_answer() {
    let app = TestApp::with(Spec {
        cache: "ttl = \"1s\"\njitter = 0.0\nstale_grace = \"60s\"\n".into(),
        coalesce: "max_wait = \"300ms\"\non_wait_timeout = \"stale\"\n".into(),
        ..Spec::default()
    })
    .await;
    let body = chat_body("prices today");
    let first: Value = app.chat(ACME, &body).await.json().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    app.mock.set_behaviour(Behaviour {
        hang: true,
        ..Behaviour::default()
    });
    let leader = tokio::spawn({
        let (client, url, body) = (
            app.client.clone(),
            app.url("/v1/chat/completions"),
            body.clone(),
        );
        async move { client.post(url).bearer_auth(ACME).json(&body).send().await }
    });
    held(&app.mock, 1).await;
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-stale"], "true");
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v, first);
    assert_eq!(app.calls(), 2);
    leader.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_wait_timeout_lead_does_not_steal_a_live_lease() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            hang: true,
            ..Behaviour::default()
        },
        coalesce: "max_wait = \"300ms\"\non_wait_timeout = \"lead\"\nlease = \"300ms\"\n".into(),
        ..Spec::default()
    })
    .await;
    let body = chat_body("lead?");
    let leader = tokio::spawn({
        let (client, url, body) = (
            app.client.clone(),
            app.url("/v1/chat/completions"),
            body.clone(),
        );
        async move { client.post(url).bearer_auth(ACME).json(&body).send().await }
    });
    held(&app.mock, 1).await;
    // The leader task is alive and renews its lease: nobody takes over.
    let results = collect(wave(&app, ACME, &body, 10).await).await;
    assert!(results.iter().all(|(s, _, _)| *s == 504));
    assert_eq!(app.calls(), 1);
    leader.abort();
}

/// Two prompts on the same route and the same provider: while the call for
/// one is held at the provider, the other is sent upstream and answered at
/// once. Flights are per fingerprint, so nothing about the first (its
/// flight, its waiting, its lock) may stand in the second's way.
#[tokio::test]
async fn an_automatic_wait_follows_the_observed_latency_not_the_timeout() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            latency_ms: 50,
            ..Behaviour::default()
        },
        coalesce: "max_wait = \"auto\"\n".into(),
        ..Spec::default()
    })
    .await;
    // The route learns that its leaders answer in about 50 ms ...
    for i in 0..5 {
        let r = app.chat(ACME, &chat_body(&format!("warm-up {i}"))).await;
        assert_eq!(r.status(), 200);
    }
    // ... so followers of a leader that hangs give up at the 300 ms floor,
    // not at the provider's 30 s timeout, and nobody calls again.
    app.mock.set_behaviour(Behaviour {
        hang: true,
        ..Behaviour::default()
    });
    let body = chat_body("a leader that hangs");
    let leader = tokio::spawn({
        let (client, url, body) = (
            app.client.clone(),
            app.url("/v1/chat/completions"),
            body.clone(),
        );
        async move { client.post(url).bearer_auth(ACME).json(&body).send().await }
    });
    held(&app.mock, 1).await;
    let started = Instant::now();
    let results = collect(wave(&app, ACME, &body, 10).await).await;
    let took = started.elapsed();
    assert!(results.iter().all(|(s, _, _)| *s == 504), "{results:?}");
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(10),
        "followers waited {took:?}"
    );
    assert_eq!(app.calls(), 6);
    leader.abort();
}

#[tokio::test]
async fn a_slow_fingerprint_does_not_delay_another() {
    let app = TestApp::with(holding()).await;
    let slow = tokio::spawn({
        let (client, url) = (app.client.clone(), app.url("/v1/chat/completions"));
        async move {
            client
                .post(url)
                .bearer_auth(ACME)
                .json(&chat_body("slow"))
                .send()
                .await
                .unwrap()
        }
    });
    let slow_seq = held(&app.mock, 1).await[0];
    // From now on the provider answers at once; the slow call stays held.
    app.mock.set_behaviour(Behaviour::default());
    let started = Instant::now();
    let r = app.chat(ACME, &chat_body("quick")).await;
    let took = started.elapsed();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-outcome"], "leader");
    let v: Value = r.json().await.unwrap();
    assert_eq!(content_of(&v), "mock answer #2 to: quick");
    assert!(
        took < Duration::from_millis(500),
        "the quick request took {took:?} behind a slow one"
    );
    assert_eq!(app.mock.stats().held, 1, "the slow call was not held");
    assert!(!slow.is_finished(), "the slow request was answered early");
    release(&app.mock, Some(slow_seq)).await;
    let r = slow.await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(content_of(&v), "mock answer #1 to: slow");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cache_ttls_are_jittered_across_the_whole_band() {
    let app = TestApp::spawn().await;
    let tasks: Vec<_> = (0..1000)
        .map(|i| {
            let (client, url) = (app.client.clone(), app.url("/v1/chat/completions"));
            tokio::spawn(async move {
                let r = client
                    .post(url)
                    .bearer_auth(ACME)
                    .json(&chat_body(&format!("question {i}")))
                    .send()
                    .await
                    .unwrap();
                r.headers()["idem-cache-ttl-ms"]
                    .to_str()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap()
            })
        })
        .collect();
    let ttls = collect(tasks).await;
    let (min, max) = (*ttls.iter().min().unwrap(), *ttls.iter().max().unwrap());
    assert!(min >= 25_500 && max <= 34_500, "{min}..{max}");
    assert!(max - min >= 8_000, "expiry spread only {} ms", max - min);
}

each_kind! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn streaming_and_plain_followers_of_a_streaming_leader_get_the_same_text(kind) {
        let app = TestApp::with(Spec {
            primary: Behaviour {
                hold: true,
                chunk_delay_ms: 20,
                ..Behaviour::default()
            },
            primary_kind: kind,
            ..Spec::default()
        })
        .await;
        let mut streamed = chat_body("tell me a story about coalescing");
        streamed["stream"] = json!(true);
        let plain = chat_body("tell me a story about coalescing");
        let leader = wave(&app, ACME, &streamed, 1).await;
        held(&app.mock, 1).await;
        let stream_followers = wave(&app, ACME, &streamed, 5).await;
        let plain_followers = wave(&app, ACME, &plain, 5).await;
        app.until_followers(10).await;
        release(&app.mock, None).await;
        let expected = "mock answer #1 to: tell me a story about coalescing";
        for (s, o, b) in collect(leader)
            .await
            .into_iter()
            .chain(collect(stream_followers).await)
        {
            assert_eq!(s, 200);
            assert!(o == "leader" || o == "follower");
            assert_eq!(sse_content(&b), expected);
        }
        for (s, o, b) in collect(plain_followers).await {
            assert_eq!((s, o.as_str()), (200, "follower"));
            let v: Value = serde_json::from_str(&b).unwrap();
            assert_eq!(v["object"], "chat.completion");
            assert_eq!(content_of(&v), expected);
        }
        assert_eq!(app.calls(), 1);
    }
}

#[tokio::test]
async fn cache_control_no_cache_and_no_store() {
    let app = TestApp::spawn().await;
    let body = chat_body("cache control");
    app.chat(ACME, &body).await;
    let r = app
        .chat_with(ACME, &body, &[("cache-control", "no-cache")])
        .await;
    assert_eq!(r.headers()["idem-outcome"], "leader");
    assert_eq!(app.calls(), 2);
    let r = app
        .chat_with(ACME, &body, &[("cache-control", "no-store")])
        .await;
    assert_eq!(r.headers()["idem-outcome"], "bypass");
    assert_eq!(app.calls(), 3);
    // no-cache stored its fresh answer; a plain request now hits it.
    let r = app.chat(ACME, &body).await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    assert!(r.text().await.unwrap().contains("#2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_error_is_shared_with_followers_but_never_cached() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            hold: true,
            fail_status: Some(400),
            ..Behaviour::default()
        },
        ..Spec::default()
    })
    .await;
    let body = chat_body("bad for the provider");
    let tasks = wave(&app, ACME, &body, 10).await;
    held(&app.mock, 1).await;
    app.until_followers(9).await;
    release(&app.mock, None).await;
    let results = collect(tasks).await;
    assert!(results.iter().all(|(s, _, _)| *s == 400));
    assert_eq!(app.calls(), 1);
    let again = wave(&app, ACME, &body, 1).await;
    held(&app.mock, 1).await;
    release(&app.mock, None).await;
    let r = collect(again).await;
    assert_eq!(r[0].1, "leader");
    assert_eq!(app.calls(), 2);
}

#[tokio::test]
async fn coalescing_and_cache_can_be_switched_off_per_route() {
    let app = TestApp::with(Spec {
        cache: "enabled = false\n".into(),
        coalesce: "enabled = false\n".into(),
        ..Spec::default()
    })
    .await;
    let body = chat_body("no sharing");
    let a = app.chat(ACME, &body).await;
    let b = app.chat(ACME, &body).await;
    assert_eq!(a.headers()["idem-outcome"], "bypass");
    assert_eq!(b.headers()["idem-outcome"], "bypass");
    assert_eq!(app.calls(), 2);
}
