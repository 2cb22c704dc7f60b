//! Several replicas (docs/design.md, "Coalescing and the caches" and "Replicas: take-overs and late writes"): three real `idem` processes
//! sharing Redis and PostgreSQL in front of one mock provider.

use std::collections::HashSet;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::helpers::*;

/// Redis for tests: the test process's (`IDEM_TEST_REDIS_URL`, the
/// machine's at the default address, or a private one: `services.rs`).
pub fn redis_url() -> String {
    crate::services::redis_url()
}

/// Fails with a clear message when Redis is not there.
pub(crate) fn require_redis(url: &str) {
    // A cluster's URL lists its seed nodes: each must answer.
    if let Some(nodes) = url.strip_prefix("redis+cluster://") {
        for node in nodes.split(',') {
            require_redis(&format!("redis://{node}"));
        }
        return;
    }
    let ok = redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
        .is_ok();
    assert!(ok, "Redis not reachable at {url}");
}

pub(crate) struct Cluster {
    pub(crate) procs: Vec<Proc>,
    pub(crate) mocks: Mocks,
    pub(crate) dir: PathBuf,
    pub(crate) client: reqwest::Client,
}

impl Cluster {
    pub(crate) async fn start(n: usize, spec: Spec, redis: &str) -> Cluster {
        Cluster::start_with(n, spec, redis, |_| vec![]).await
    }

    pub(crate) async fn start_with(
        n: usize,
        spec: Spec,
        redis: &str,
        envs: impl Fn(usize) -> Vec<(&'static str, &'static str)>,
    ) -> Cluster {
        require_redis(redis);
        let mocks = start_mocks(&spec).await;
        let dir = temp_dir();
        let db = pg_schema().await;
        let prefix = format!("idem-test-{}", uuid::Uuid::now_v7().simple());
        // A Redis operation gets 2 s, not the default 250 ms: on two cores
        // busy with the whole suite, a slow answer would make a replica
        // coalesce locally (as designed) and a wave make a second call.
        // The test of that timeout itself sets it back.
        let text = config_text(&spec, &mocks, &db, "127.0.0.1:0").replacen(
            "[storage]",
            &format!(
                "[coalescing]\nbackend = \"{redis}\"\nredis_prefix = \"{prefix}\"\nredis_poll = \"200ms\"\nredis_timeout = \"2s\"\n[storage]"
            ),
            1,
        );
        let config = dir.join("idem.toml");
        std::fs::write(&config, text).unwrap();
        let mut procs = Vec::new();
        for i in 0..n {
            procs.push(Proc::start(&config, &envs(i)).await);
        }
        Cluster {
            procs,
            mocks,
            dir,
            client: client(),
        }
    }

    pub(crate) fn base(&self, i: usize) -> &str {
        &self.procs[i].base
    }

    pub(crate) async fn admin_stats(&self, i: usize) -> Value {
        self.client
            .get(format!("{}/v1/stats", self.base(i)))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Fires `n` requests spread round-robin over `replicas`.
    pub(crate) fn fire(
        &self,
        replicas: &[usize],
        body: &Value,
        n: usize,
    ) -> Vec<tokio::task::JoinHandle<(u16, String, String)>> {
        (0..n)
            .map(|i| {
                let url = format!(
                    "{}/v1/chat/completions",
                    self.base(replicas[i % replicas.len()])
                );
                let (client, body) = (self.client.clone(), body.clone());
                tokio::spawn(async move {
                    let r = match client.post(url).bearer_auth(ACME).json(&body).send().await {
                        Ok(r) => r,
                        Err(e) => return (0, String::new(), format!("{e:?}")),
                    };
                    let status = r.status().as_u16();
                    let outcome = r
                        .headers()
                        .get("idem-outcome")
                        .map(|v| v.to_str().unwrap().to_string())
                        .unwrap_or_default();
                    (status, outcome, r.text().await.unwrap())
                })
            })
            .collect()
    }

    /// Waits until the replicas hold `n` local followers in total.
    pub(crate) async fn until_waiting(&self, replicas: &[usize], n: u64) {
        for _ in 0..1500 {
            let mut total = 0;
            for &i in replicas {
                total += self.admin_stats(i).await["waiting_followers"]
                    .as_u64()
                    .unwrap_or(0);
            }
            if total >= n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("the replicas never held {n} waiting followers");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wave_split_over_three_replicas_makes_one_call() {
    let c = Cluster::start(3, holding(), &redis_url()).await;
    let body = chat_body("Where is my parcel?");
    let tasks = c.fire(&[0, 1, 2], &body, 900);
    held(&c.mocks.primary, 1).await;
    c.until_waiting(&[0, 1, 2], 897).await;
    release(&c.mocks.primary, None).await;
    let results = collect(tasks).await;
    assert_eq!(
        c.mocks.primary.stats().calls,
        1,
        "a wave over three replicas made more than one call"
    );
    assert!(results.iter().all(|(s, _, _)| *s == 200));
    let bodies: HashSet<&str> = results.iter().map(|(_, _, b)| b.as_str()).collect();
    assert_eq!(bodies.len(), 1, "replicas handed out different answers");
    let outcomes = count_by(&results, |(_, o, _)| o.clone());
    assert_eq!(outcomes.get("leader"), Some(&1), "{outcomes:?}");
    // A second wave on any replica comes from the shared or local cache.
    let results = collect(c.fire(&[0, 1, 2], &body, 90)).await;
    assert!(
        results
            .iter()
            .all(|(s, o, b)| *s == 200 && o == "cache-hit" && bodies.contains(b.as_str()))
    );
    assert_eq!(c.mocks.primary.stats().calls, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_the_leading_replica_dies_one_other_takes_over_after_the_lease() {
    let spec = Spec {
        coalesce: "lease = \"1s\"\n".into(),
        ..holding()
    };
    let mut c = Cluster::start(3, spec, &redis_url()).await;
    let body = chat_body("Who takes over?");
    let doomed = c.fire(&[0], &body, 1);
    held(&c.mocks.primary, 1).await;
    let survivors = c.fire(&[1, 2], &body, 40);
    c.until_waiting(&[1, 2], 38).await;
    c.procs[0].child.kill().await.unwrap(); // SIGKILL: the lease is no longer renewed
    let _ = c.procs[0].child.wait().await;
    // Exactly one surviving replica calls the provider again (the dead
    // replica's held call went away with its connection).
    let mock = &c.mocks.primary;
    eventually(Duration::from_secs(20), || mock.stats().calls >= 2).await;
    held(mock, 1).await;
    release(&c.mocks.primary, None).await;
    let results = collect(survivors).await;
    assert!(
        results.iter().all(|(s, _, _)| *s == 200),
        "{:?}",
        results.iter().map(|r| r.0).collect::<Vec<_>>()
    );
    let bodies: HashSet<&str> = results.iter().map(|(_, _, b)| b.as_str()).collect();
    assert_eq!(bodies.len(), 1);
    assert!(bodies.iter().next().unwrap().contains("#2"));
    assert_eq!(
        c.mocks.primary.stats().calls,
        2,
        "more than one replica took over"
    );
    let _ = collect(doomed).await;
}

/// A private Redis server, so stopping it disturbs no other test.
pub(crate) struct PrivateRedis {
    port: u16,
    pub(crate) child: Option<std::process::Child>,
    dir: PathBuf,
}

impl PrivateRedis {
    fn spawn(port: u16, dir: &std::path::Path) -> std::process::Child {
        let bin = crate::services::redis_server_bin().unwrap_or_else(|e| panic!("{e}"));
        let child = std::process::Command::new(bin)
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        let url = format!("redis://127.0.0.1:{port}");
        for _ in 0..250 {
            if redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
                .is_ok()
            {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        require_redis(&url);
        child
    }

    pub(crate) fn start() -> PrivateRedis {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = temp_dir();
        let child = PrivateRedis::spawn(port, &dir);
        PrivateRedis {
            port,
            child: Some(child),
            dir,
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn restart(&mut self) {
        self.stop();
        self.child = Some(PrivateRedis::spawn(self.port, &self.dir));
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_outage_degrades_to_local_coalescing_and_recovers() {
    let mut redis = PrivateRedis::start();
    // The probes below answer at once: an automatic max_wait would learn a
    // 300 ms wait from them, too short for a loaded machine's wave.
    let spec = Spec {
        coalesce: "max_wait = \"30s\"\n".into(),
        ..holding()
    };
    let c = Cluster::start(3, spec, &redis.url()).await;
    redis.stop();
    // A wave while Redis is down: nobody fails, at most one call per replica.
    let body = chat_body("Redis is down");
    let tasks = c.fire(&[0, 1, 2], &body, 90);
    held(&c.mocks.primary, 1).await;
    c.until_waiting(&[0, 1, 2], 87).await;
    // Each replica leads on its own now; a replica whose leader has not
    // reached the provider yet must not be left held: stop holding first.
    c.mocks.primary.set_behaviour(Behaviour::default());
    release(&c.mocks.primary, None).await;
    let results = collect(tasks).await;
    assert!(
        results.iter().all(|(s, _, _)| *s == 200),
        "a request failed because Redis was down"
    );
    let calls = c.mocks.primary.stats().calls;
    assert!(
        (1..=3).contains(&calls),
        "{calls} calls for one fingerprint on three replicas"
    );
    let errors: u64 = {
        let mut n = 0;
        for i in 0..3 {
            let m = get_text(&c.client, format!("{}/metrics", c.base(i))).await;
            n += m
                .lines()
                .find(|l| l.starts_with("idem_redis_errors_total "))
                .and_then(|l| l.split(' ').nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
        n
    };
    assert!(errors >= 3, "the outage was not counted: {errors}");

    // Redis comes back: each replica reconnects by itself.
    redis.restart();
    let mut probe = 0;
    for i in 0..3 {
        for _ in 0..200 {
            probe += 1;
            let r = c
                .client
                .post(format!("{}/v1/chat/completions", c.base(i)))
                .bearer_auth(ACME)
                .json(&chat_body(&format!("probe {probe}")))
                .send()
                .await;
            assert_eq!(r.unwrap().status(), 200);
            let stats = c.admin_stats(i).await;
            if stats["redis_connected"] == json!(true) && stats["redis_subscribed"] == json!(true) {
                break;
            }
        }
    }
    let before = c.mocks.primary.stats().calls;
    c.mocks.primary.set_behaviour(Behaviour {
        hold: true,
        ..Behaviour::default()
    });
    let body = chat_body("Redis is back");
    let tasks = c.fire(&[0, 1, 2], &body, 90);
    held(&c.mocks.primary, 1).await;
    c.until_waiting(&[0, 1, 2], 87).await;
    release(&c.mocks.primary, None).await;
    let results = collect(tasks).await;
    assert!(results.iter().all(|(s, _, _)| *s == 200));
    assert_eq!(
        c.mocks.primary.stats().calls - before,
        1,
        "shared coalescing did not resume"
    );
}

async fn create_job(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    body: &Value,
) -> (u16, String) {
    let r = client
        .post(format!("{base}/v1/jobs"))
        .bearer_auth(ACME)
        .header("idempotency-key", key)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap();
    (status, v["id"].as_str().unwrap_or_default().to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_double_click_over_three_replicas_is_one_job_and_one_call() {
    let c = Cluster::start(3, holding(), &redis_url()).await;
    let body = json!({"request": chat_body("Book the flight"), "metadata": {}});
    let tasks: Vec<_> = (0..50)
        .map(|i| {
            let (client, base, body) = (c.client.clone(), c.base(i % 3).to_string(), body.clone());
            tokio::spawn(async move { create_job(&client, &base, "flight-9", &body).await })
        })
        .collect();
    let results = collect(tasks).await;
    let ids: HashSet<&str> = results.iter().map(|(_, id)| id.as_str()).collect();
    assert_eq!(ids.len(), 1, "one key made several jobs across replicas");
    assert_eq!(results.iter().filter(|(s, _)| *s == 201).count(), 1);
    held(&c.mocks.primary, 1).await;
    release(&c.mocks.primary, None).await;
    let id = ids.into_iter().next().unwrap().to_string();
    let mut job = Value::Null;
    for _ in 0..500 {
        job = c
            .client
            .get(format!("{}/v1/jobs/{id}", c.base(2)))
            .bearer_auth(ACME)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if job["state"] == "succeeded" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["attempts"].as_array().unwrap().len(), 1);
    assert_eq!(c.mocks.primary.stats().calls, 1);
}

/// The `idem_reconciler_passes_total` of a replica.
async fn reconciler_passes(client: &reqwest::Client, base: &str) -> f64 {
    let m = get_text(client, format!("{base}/metrics")).await;
    crate::jobs::sample(&m, "idem_reconciler_passes_total")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_replica_running_an_attempt_leaves_it_unknown_and_unrepeated() {
    // Every replica runs jobs, and claims and attempt leases are short: the
    // survivors could re-run the job as soon as the dead one's claim runs
    // out, and must not. The claim outlasts the attempt's lease, so the
    // attempt is seen unknown before the claim runs out.
    let claim_lease = Duration::from_secs(2);
    let spec = Spec {
        jobs: "attempt_lease = \"1s\"\nclaim_lease = \"2s\"\nreconcile_interval = \"200ms\"\n\
               poll_interval = \"200ms\"\n"
            .into(),
        ..holding()
    };
    let mut c = Cluster::start(3, spec, &redis_url()).await;
    let body = json!({"request": chat_body("Transfer 100"), "metadata": {}});
    let (status, id) = create_job(&c.client, c.base(0), "transfer-1", &body).await;
    assert_eq!(status, 201);
    held(&c.mocks.primary, 1).await;
    // Whichever replica claimed the job logged its attempt's start.
    let mut runner = None;
    for _ in 0..1500 {
        runner = c.procs.iter_mut().position(|p| {
            p.drain().iter().any(|l| {
                serde_json::from_str::<Value>(l)
                    .is_ok_and(|v| v["message"] == "attempt started" && v["job"] == id.as_str())
            })
        });
        if runner.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let runner = runner.expect("no replica logged the attempt's start");
    let get = |base: String| {
        let client = c.client.clone();
        let id = id.clone();
        async move {
            client
                .get(format!("{base}/v1/jobs/{id}"))
                .bearer_auth(ACME)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    c.procs[runner].child.kill().await.unwrap();
    let _ = c.procs[runner].child.wait().await;
    let killed = std::time::Instant::now();
    let alive: Vec<usize> = (0..3).filter(|i| *i != runner).collect();
    let mut job = Value::Null;
    for _ in 0..500 {
        job = get(c.base(alive[0]).to_string()).await;
        if job["attempts"][0]["state"] == "unknown" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(job["attempts"][0]["state"], "unknown", "{job}");
    assert_eq!(job["attempts"][0]["reason"], "lease_expired");
    let version = job["version"].clone();
    // The dead replica's claim on the job has run out (it was renewed at
    // the latest when it died); from then on, each survivor's reconciler
    // passes three times (with 200 ms between passes, their workers poll
    // meanwhile): had any of them requeued the job, a worker would have
    // claimed it again.
    let expired = killed + claim_lease;
    eventually(Duration::from_secs(10), || {
        std::time::Instant::now() > expired
    })
    .await;
    let mut from = Vec::new();
    for &i in &alive {
        from.push(reconciler_passes(&c.client, c.base(i)).await);
    }
    for (&i, from) in alive.iter().zip(from) {
        let (client, base) = (&c.client, c.base(i));
        eventually_async(Duration::from_secs(10), || async move {
            reconciler_passes(client, base).await >= from + 3.0
        })
        .await;
    }
    let job = get(c.base(alive[1]).to_string()).await;
    assert_eq!(job["attempts"].as_array().unwrap().len(), 1, "{job}");
    assert_eq!(job["attempts"][0]["state"], "unknown", "{job}");
    assert_eq!(job["state"], "running");
    assert_eq!(
        job["version"], version,
        "the job was requeued or claimed again: {job}"
    );
    assert_eq!(c.mocks.primary.stats().calls, 1);
    let (status, again) = create_job(&c.client, c.base(alive[0]), "transfer-1", &body).await;
    assert_eq!((status, again.as_str()), (200, id.as_str()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streaming_follower_on_another_replica_gets_a_valid_stream() {
    let c = Cluster::start(2, holding(), &redis_url()).await;
    let mut streamed = chat_body("stream it across");
    streamed["stream"] = json!(true);
    let leader = c.fire(&[0], &streamed, 1);
    held(&c.mocks.primary, 1).await;
    let stream_followers = c.fire(&[1], &streamed, 3);
    let plain_followers = c.fire(&[1], &chat_body("stream it across"), 3);
    c.until_waiting(&[1], 5).await;
    release(&c.mocks.primary, None).await;
    let expected = "mock answer #1 to: stream it across";
    for (s, _, b) in collect(leader)
        .await
        .into_iter()
        .chain(collect(stream_followers).await)
    {
        assert_eq!(s, 200);
        assert_eq!(sse_content(&b), expected);
    }
    for (s, o, b) in collect(plain_followers).await {
        assert_eq!((s, o.as_str()), (200, "follower"));
        assert_eq!(content_of(&serde_json::from_str(&b).unwrap()), expected);
    }
    assert_eq!(c.mocks.primary.stats().calls, 1);
}

/// A stored response deleted on one replica leaves every replica's cache:
/// the replica that served it from its own cache makes a new call with a
/// new id for the same request, and `GET` on the deleted id is 404 on
/// both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_response_deleted_on_one_replica_leaves_every_replicas_cache() {
    let spec = Spec {
        cache: "ttl = \"60s\"\n".into(),
        ..Spec::default()
    };
    let c = Cluster::start(2, spec, &redis_url()).await;
    let body = json!({"model": "bot", "input": "remember me everywhere"});
    let respond = |i: usize| {
        let url = format!("{}/v1/responses", c.base(i));
        let r = c.client.post(url).bearer_auth(ACME).json(&body).send();
        async move {
            let r = r.await.unwrap();
            assert_eq!(r.status(), 200);
            let outcome = r.headers()["idem-outcome"].to_str().unwrap().to_string();
            let v: Value = r.json().await.unwrap();
            (v["id"].as_str().unwrap().to_string(), outcome)
        }
    };
    let (id, outcome) = respond(0).await;
    assert_eq!(outcome, "leader");
    // Both replicas answer it from a cache now: replica 1 from the shared
    // one (and keeps it in its own), replica 0 from its own.
    assert_eq!(respond(1).await, (id.clone(), "cache-hit".to_string()));
    assert_eq!(respond(0).await, (id.clone(), "cache-hit".to_string()));
    assert_eq!(respond(1).await, (id.clone(), "cache-hit".to_string()));
    assert_eq!(c.mocks.primary.stats().calls, 1);
    let r = c
        .client
        .delete(format!("{}/v1/responses/{id}", c.base(1)))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for i in 0..2 {
        let r = c
            .client
            .get(format!("{}/v1/responses/{id}", c.base(i)))
            .bearer_auth(ACME)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "replica {i}");
    }
    // Replica 0 hears of the deletion on the shared channel: once it has,
    // the same request is a new call with a new id (until then it may
    // still answer from its own copy, at most until the TTL; the 60 s TTL
    // is far past this wait).
    let mut fresh = None;
    for _ in 0..250 {
        let (again, outcome) = respond(0).await;
        if again != id {
            fresh = Some((again, outcome));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (fresh, outcome) = fresh.expect("replica 0 kept serving the deleted response");
    assert_eq!(outcome, "leader");
    assert_eq!(c.mocks.primary.stats().calls, 2);
    // Replica 1 now shares the new answer, not the deleted one.
    assert_eq!(respond(1).await.0, fresh);
    assert_eq!(c.mocks.primary.stats().calls, 2);
}
