//! Budgets across replicas (docs/design.md, "Keys and budgets"): three
//! real `idem` processes on PostgreSQL and Redis never overspend a key's
//! budget together, a replica killed holding reservations holds them no
//! longer than its lease, and a key changed on one replica is in force on
//! the others within a second.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::helpers::*;
use crate::keys::{PRICED, assert_spent, cost_of, make_key, priced, tally, usd, worst};
use crate::replicas::{Cluster, redis_url};

/// The tests' budgets: grants live one second without their heartbeat.
const LEASE: &str = "\n[budgets]\nlease = \"1s\"\n";

/// A request of [`priced`] as `key` at replica `base`: (status, body).
async fn ask(c: &reqwest::Client, base: &str, key: &str, i: usize) -> (u16, Value) {
    let r = match c
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&priced(i))
        .send()
        .await
    {
        Ok(r) => r,
        // A replica killed under the request.
        Err(e) => return (0, json!({"error": e.to_string()})),
    };
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// Waits until `key` is admitted by every replica (`GET /v1/key`).
async fn in_force_everywhere(cluster: &Cluster, key: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(1);
    for i in 0..n {
        loop {
            let r = cluster
                .client
                .get(format!("{}/v1/key", cluster.base(i)))
                .bearer_auth(key)
                .send()
                .await
                .unwrap();
            if r.status() == 200 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "replica {i} did not admit the new key within 1 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test]
async fn three_replicas_never_overspend_and_a_killed_replicas_reservations_are_released() {
    let spec = Spec {
        extra: format!("{PRICED}{LEASE}"),
        ..holding()
    };
    let cluster = Cluster::start(3, spec, &redis_url()).await;
    let c = cluster.client.clone();
    let w = worst(0);
    let budget = 10 * w;
    let (id, secret, _) = make_key(
        &c,
        cluster.base(0),
        json!({"tenant": "acme", "name": "shared", "budget_usd": usd(budget)}),
    )
    .await;
    in_force_everywhere(&cluster, &secret, 3).await;
    // 200 distinct requests spread over the three replicas at once.
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let (c, base, key) = (c.clone(), cluster.base(i % 3).to_string(), secret.clone());
            tokio::spawn(async move { ask(&c, &base, &key, i).await })
        })
        .collect();
    held(&cluster.mocks.primary, 10).await;
    eventually(Duration::from_secs(30), || {
        tasks.iter().filter(|t| t.is_finished()).count() >= 190
    })
    .await;
    assert_eq!(
        cluster.mocks.primary.stats().calls,
        10,
        "calls past the budget"
    );
    release(&cluster.mocks.primary, None).await;
    let (cost, refused) = tally(collect(tasks).await);
    assert_eq!(refused, 190);
    // The spend recorded is what the answers cost.
    assert_spent(&c, cluster.base(1), &id, cost).await;
    assert!(cost <= budget);

    // A replica killed while its calls hold the whole budget: the others
    // refuse until its lease ends, then serve; its calls, whose answers
    // it never got, are not counted, and nothing is counted twice. What
    // it answered just before it died (another key's calls) is counted.
    let (id, secret, _) = make_key(
        &c,
        cluster.base(0),
        json!({"tenant": "acme", "name": "survivor", "budget_usd": usd(budget)}),
    )
    .await;
    let (paid_id, paid, _) = make_key(
        &c,
        cluster.base(0),
        json!({"tenant": "acme", "name": "paid", "budget_usd": usd(budget)}),
    )
    .await;
    in_force_everywhere(&cluster, &secret, 3).await;
    in_force_everywhere(&cluster, &paid, 3).await;
    let calls = cluster.mocks.primary.stats().calls;
    let doomed: Vec<_> = (300..310)
        .map(|i| {
            let (c, base, key) = (c.clone(), cluster.base(2).to_string(), secret.clone());
            tokio::spawn(async move { ask(&c, &base, &key, i).await })
        })
        .collect();
    let doomed_seqs = held(&cluster.mocks.primary, 10).await;
    assert_eq!(cluster.mocks.primary.stats().calls, calls + 10);
    let (status, body) = ask(&c, cluster.base(0), &secret, 400).await;
    assert_eq!(status, 429, "{body}");
    let answered: Vec<_> = (600..605)
        .map(|i| {
            let (c, base, key) = (c.clone(), cluster.base(2).to_string(), paid.clone());
            tokio::spawn(async move { ask(&c, &base, &key, i).await })
        })
        .collect();
    for seq in held(&cluster.mocks.primary, 15).await {
        if !doomed_seqs.contains(&seq) {
            release(&cluster.mocks.primary, Some(seq)).await;
        }
    }
    let mut paid_cost = 0;
    for (status, body) in collect(answered).await {
        assert_eq!(status, 200, "{body}");
        paid_cost += cost_of(&body);
    }
    // At once: nothing a timer writes has had the time to.
    cluster.procs[2].signal("KILL");
    for t in doomed {
        let _ = t.await;
    }
    // From here on the provider answers at once.
    cluster
        .mocks
        .primary
        .set_behaviour(idem::mock_upstream::Behaviour::default());
    release(&cluster.mocks.primary, None).await;
    let killed = Instant::now();
    let mut served = None;
    while served.is_none() {
        let (status, body) = ask(&c, cluster.base(0), &secret, 401).await;
        match status {
            200 => served = Some(body),
            429 => {
                assert!(
                    killed.elapsed() < Duration::from_secs(5),
                    "the dead replica's reservations were not released: {body}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => panic!("{other}: {body}"),
        }
    }
    assert!(
        killed.elapsed() >= Duration::from_millis(500),
        "released before the lease could end"
    );
    let mut cost = cost_of(&served.unwrap());
    assert_spent(&c, cluster.base(1), &id, cost).await;
    assert_spent(&c, cluster.base(1), &paid_id, paid_cost).await;
    // The rest of the budget, spent by calls that each cost less than they
    // reserved: as many fit as their settlements leave room for.
    let rest: Vec<_> = (500..520)
        .map(|i| {
            let (c, base, key) = (c.clone(), cluster.base(i % 2).to_string(), secret.clone());
            tokio::spawn(async move { ask(&c, &base, &key, i).await })
        })
        .collect();
    let (spent, refused) = tally(collect(rest).await);
    assert!(20 - refused >= 9, "{refused} of 20 refused");
    cost += spent;
    assert_spent(&c, cluster.base(0), &id, cost).await;
    assert!(cost <= budget);
    let _ = std::fs::remove_dir_all(&cluster.dir);
}

/// A key changed on one replica is in force on another within a second:
/// its rate limit, then its revocation.
#[tokio::test]
async fn changes_to_a_key_reach_every_replica_within_a_second() {
    let cluster = Cluster::start(2, Spec::default(), &redis_url()).await;
    let c = cluster.client.clone();
    let (id, secret, _) = make_key(
        &c,
        cluster.base(0),
        json!({"tenant": "acme", "name": "moving"}),
    )
    .await;
    in_force_everywhere(&cluster, &secret, 2).await;
    let chat = |i: usize| {
        let (c, url, key) = (
            c.clone(),
            format!("{}/v1/chat/completions", cluster.base(1)),
            secret.clone(),
        );
        async move {
            let r = c
                .post(url)
                .bearer_auth(key)
                .json(&chat_body(&format!("m{i}")))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.text().await.unwrap())
        }
    };
    let r = c
        .patch(format!("{}/v1/admin/keys/{id}", cluster.base(0)))
        .bearer_auth(ADMIN)
        .json(&json!({"rpm": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let changed = Instant::now();
    // Within a second, replica 1 admits one request a minute.
    let mut i = 0;
    loop {
        let (status, body) = chat(i).await;
        i += 1;
        if status == 429 {
            assert!(body.contains("rate_limit_exceeded"), "{body}");
            break;
        }
        assert_eq!(status, 200, "{body}");
        assert!(
            changed.elapsed() < Duration::from_secs(1),
            "the limit did not reach replica 1 within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = c
        .post(format!("{}/v1/admin/keys/{id}/revoke", cluster.base(0)))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let revoked = Instant::now();
    loop {
        let (status, body) = chat(i).await;
        i += 1;
        if status == 401 {
            assert!(body.contains("revoked"), "{body}");
            break;
        }
        assert!(
            revoked.elapsed() < Duration::from_secs(1),
            "the revocation did not reach replica 1 within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = std::fs::remove_dir_all(&cluster.dir);
}

/// A key's requests per minute are one count for every replica (Redis):
/// a key of 3 a minute gets 3 answers in a minute, wherever it asks.
#[tokio::test]
async fn a_keys_requests_per_minute_are_counted_across_replicas() {
    let cluster = Cluster::start(2, Spec::default(), &redis_url()).await;
    let c = cluster.client.clone();
    let minute = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
            / 60
    };
    for _ in 0..3 {
        let (_, secret, _) = make_key(
            &c,
            cluster.base(0),
            json!({"tenant": "acme", "name": "metered", "rpm": 3}),
        )
        .await;
        in_force_everywhere(&cluster, &secret, 2).await;
        let start = minute();
        let mut statuses = Vec::new();
        for i in 0..5 {
            let r = c
                .post(format!("{}/v1/chat/completions", cluster.base(i % 2)))
                .bearer_auth(&secret)
                .json(&chat_body(&format!("metered {i}")))
                .send()
                .await
                .unwrap();
            statuses.push(r.status().as_u16());
        }
        if minute() != start {
            // A minute began in the middle: its windows started afresh.
            continue;
        }
        assert_eq!(statuses, [200, 200, 200, 429, 429]);
        let _ = std::fs::remove_dir_all(&cluster.dir);
        return;
    }
    panic!("three minutes began in the middle of three tries");
}
