//! A Redis Cluster as the shared backend (`redis+cluster://...`): the test
//! starts three real masters of its own, then real `idem` replicas on them.

use std::collections::{BTreeSet, HashSet};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idem::mock_upstream::Behaviour;

use crate::helpers::*;
use crate::replicas::Cluster;

/// Three `redis-server` masters in cluster mode, every slot assigned; the
/// servers are killed when it is dropped.
struct RedisCluster {
    ports: Vec<u16>,
    children: Vec<Child>,
    dir: PathBuf,
}

/// A port that is free now, and whose cluster bus port (port + 10000) is too.
fn free_cluster_port(taken: &[u16]) -> u16 {
    for _ in 0..100 {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        if port > 55_535 || taken.contains(&port) {
            continue;
        }
        if TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
    panic!("no free port pair for a cluster node");
}

fn require_binary(name: &str) {
    let found = Command::new(name)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        found,
        "`{name}` is not installed: the Redis Cluster tests start a cluster of their own \
         (Debian/Ubuntu: apt-get install redis-server redis-tools)"
    );
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl RedisCluster {
    fn start() -> RedisCluster {
        require_binary("redis-server");
        require_binary("redis-cli");
        let mut cluster = RedisCluster {
            ports: Vec::new(),
            children: Vec::new(),
            dir: temp_dir(),
        };
        // A port found free may be taken before the server binds it (by any
        // connection's ephemeral port): then try other ports.
        for attempt in 1.. {
            cluster.ports.clear();
            for _ in 0..3 {
                let port = free_cluster_port(&cluster.ports);
                cluster.ports.push(port);
            }
            match cluster.spawn_nodes() {
                Ok(()) => break,
                Err(e) if attempt < 5 => {
                    eprintln!("redis cluster: {e}; trying other ports");
                    cluster.stop();
                }
                Err(e) => panic!("cannot start a redis cluster: {e}"),
            }
        }
        let nodes: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let created = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&nodes)
            .arg("--cluster-yes")
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli runs");
        assert!(
            created.status.success(),
            "redis-cli --cluster create failed: {}",
            String::from_utf8_lossy(&created.stdout)
        );
        cluster.until_ok();
        cluster
    }

    /// Starts the three servers (a restart finds its cluster in its nodes
    /// file) and waits until each answers, or says which one exited.
    fn spawn_nodes(&mut self) -> Result<(), String> {
        for &port in &self.ports {
            let child = Command::new("redis-server")
                .args(["--cluster-enabled", "yes", "--port", &port.to_string()])
                .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                .arg("--dir")
                .arg(&self.dir)
                .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
                .args(["--daemonize", "no"])
                .stdout(Stdio::null())
                .spawn()
                .expect("redis-server starts");
            self.children.push(child);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        for (i, &port) in self.ports.iter().enumerate() {
            while !redis_cli(port, &["ping"]).contains("PONG") {
                if let Ok(Some(status)) = self.children[i].try_wait() {
                    return Err(format!("the server on port {port} exited: {status}"));
                }
                if Instant::now() > deadline {
                    return Err(format!("the server on port {port} never answered"));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        Ok(())
    }

    /// Waits until every node knows the whole slot map, so that no client
    /// asks a node that does not.
    fn until_ok(&self) {
        for &port in &self.ports {
            self.until(port, "cluster_state:ok", &["cluster", "info"]);
        }
    }

    /// Kills every server: the whole cluster is gone.
    fn stop(&mut self) {
        for mut child in self.children.drain(..) {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The same nodes again on the same ports, empty.
    fn restart(&mut self) {
        self.stop();
        if let Err(e) = self.spawn_nodes() {
            panic!("cannot restart the redis cluster: {e}");
        }
        self.until_ok();
    }

    /// Waits until `redis-cli -p port args` prints `expected`.
    fn until(&self, port: u16, expected: &str, args: &[&str]) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !redis_cli(port, args).contains(expected) {
            assert!(
                Instant::now() < deadline,
                "redis node {port} never said {expected:?} to {args:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// The keys each master holds (a master stores only its own slots').
    fn keys_by_master(&self) -> Vec<BTreeSet<String>> {
        self.ports
            .iter()
            .map(|&p| {
                // Not a terminal: one key a line, nothing for none.
                redis_cli(p, &["keys", "*"])
                    .lines()
                    .filter(|l| !l.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .collect()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn redis_errors(c: &Cluster, i: usize) -> u64 {
    get_text(&c.client, format!("{}/metrics", c.base(i)))
        .await
        .lines()
        .find_map(|l| l.strip_prefix("idem_redis_errors_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waves_over_three_replicas_on_a_redis_cluster_make_one_call_each() {
    let redis = RedisCluster::start();
    // A poll far longer than the test: a follower on another replica wakes
    // only on the completion message, which a PUBLISH on the master of the
    // flight's slot must carry to the subscription on whichever node it is.
    // A fixed wait: "auto" would learn from the first wave's held call how
    // long a call takes, and the next wave's followers would stop waiting.
    let spec = Spec {
        coalesce: "max_wait = \"30s\"\n".into(),
        ..holding()
    };
    let c = Cluster::start_with(3, spec, &redis.url(), |_| {
        vec![("IDEM_COALESCING__REDIS_POLL", "60s")]
    })
    .await;
    for i in 0..3 {
        assert_eq!(
            c.admin_stats(i).await["redis_connected"],
            serde_json::json!(true),
            "replica {i} is not on the cluster"
        );
    }
    let mut answers = HashSet::new();
    let mut masters = BTreeSet::new();
    let mut seen = BTreeSet::new();
    let mut wave = 0_u64;
    // New prompts until their flights were on at least two masters (each
    // lands on a master at random: three in a row on one is a 1 in 9 case).
    while wave < 3 || (masters.len() < 2 && wave < 12) {
        wave += 1;
        let body = chat_body(&format!("Which master holds wave {wave}?"));
        let tasks = c.fire(&[0, 1, 2], &body, 100);
        held(&c.mocks.primary, 1).await;
        c.until_waiting(&[0, 1, 2], 97).await;
        let released = Instant::now();
        release(&c.mocks.primary, None).await;
        let results = collect(tasks).await;
        let took = released.elapsed();
        assert_eq!(
            c.mocks.primary.stats().calls,
            wave,
            "wave {wave} over three replicas made more than one call"
        );
        let failed: Vec<_> = results.iter().filter(|(s, _, _)| *s != 200).collect();
        assert!(failed.is_empty(), "wave {wave}: {failed:?}");
        let bodies: HashSet<&str> = results.iter().map(|(_, _, b)| b.as_str()).collect();
        assert_eq!(
            bodies.len(),
            1,
            "wave {wave}: replicas handed out different answers"
        );
        let outcomes = count_by(&results, |(_, o, _)| o.clone());
        assert_eq!(
            outcomes.get("leader"),
            Some(&1),
            "wave {wave}: {outcomes:?}"
        );
        assert!(
            took < Duration::from_secs(10),
            "wave {wave}: the followers on other replicas waited {took:?}: \
             the completion message did not reach them"
        );
        answers.insert(bodies.into_iter().next().unwrap().to_string());
        // The wave's keys (one hash tag) are all on one master.
        let now = redis.keys_by_master();
        let new: Vec<(usize, &String)> = now
            .iter()
            .enumerate()
            .flat_map(|(m, keys)| keys.iter().map(move |k| (m, k)))
            .filter(|(_, k)| !seen.contains(*k))
            .collect();
        let on: BTreeSet<usize> = new.iter().map(|(m, _)| *m).collect();
        assert_eq!(
            on.len(),
            1,
            "wave {wave}'s keys are on several masters: {new:?}"
        );
        assert!(
            new.iter().any(|(_, k)| k.ends_with(":answer")),
            "wave {wave} left no shared answer: {new:?}"
        );
        masters.extend(on);
        seen.extend(now.into_iter().flatten());
    }
    assert!(
        masters.len() >= 2,
        "{wave} waves' flights all landed on one master"
    );
    assert_eq!(answers.len() as u64, wave);
    for i in 0..3 {
        assert_eq!(
            redis_errors(&c, i).await,
            0,
            "replica {i} counted redis errors"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_redis_cluster_a_takeover_that_answers_at_once_is_every_waiters_answer() {
    let redis = RedisCluster::start();
    let c = crate::takeover::takeover_answers_at_once(&redis.url()).await;
    for i in [1, 2] {
        assert_eq!(
            redis_errors(&c, i).await,
            0,
            "replica {i} counted redis errors"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_cluster_outage_degrades_to_local_coalescing_and_recovers() {
    let mut redis = RedisCluster::start();
    let spec = Spec {
        coalesce: "max_wait = \"30s\"\n".into(),
        ..holding()
    };
    // Only a completion message wakes a follower on another replica (see
    // the waves' test): after the outage, the subscription must be back.
    let c = Cluster::start_with(3, spec, &redis.url(), |_| {
        vec![("IDEM_COALESCING__REDIS_POLL", "60s")]
    })
    .await;
    redis.stop();
    // A wave while the whole cluster is down: nobody fails, at most one
    // call per replica.
    let body = chat_body("The cluster is down");
    let tasks = c.fire(&[0, 1, 2], &body, 90);
    held(&c.mocks.primary, 1).await;
    c.until_waiting(&[0, 1, 2], 87).await;
    // Each replica leads on its own now; one whose leader has not reached
    // the provider yet must not be left held: stop holding first.
    c.mocks.primary.set_behaviour(Behaviour::default());
    release(&c.mocks.primary, None).await;
    let results = collect(tasks).await;
    let failed: Vec<_> = results.iter().filter(|(s, _, _)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "requests failed while the cluster was down: {failed:?}"
    );
    let calls = c.mocks.primary.stats().calls;
    assert!(
        (1..=3).contains(&calls),
        "{calls} calls for one fingerprint on three replicas"
    );
    let mut errors = 0;
    for i in 0..3 {
        errors += redis_errors(&c, i).await;
    }
    assert!(errors >= 3, "the outage was not counted: {errors}");

    // The cluster comes back: each replica reconnects by itself.
    redis.restart();
    let mut probe = 0;
    for i in 0..3 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
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
            if stats["redis_connected"] == serde_json::json!(true)
                && stats["redis_subscribed"] == serde_json::json!(true)
            {
                break;
            }
            assert!(Instant::now() < deadline, "replica {i} never reconnected");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let before = c.mocks.primary.stats().calls;
    c.mocks.primary.set_behaviour(Behaviour {
        hold: true,
        ..Behaviour::default()
    });
    let body = chat_body("The cluster is back");
    let tasks = c.fire(&[0, 1, 2], &body, 90);
    held(&c.mocks.primary, 1).await;
    c.until_waiting(&[0, 1, 2], 87).await;
    release(&c.mocks.primary, None).await;
    let results = collect(tasks).await;
    let failed: Vec<_> = results.iter().filter(|(s, _, _)| *s != 200).collect();
    assert!(
        failed.is_empty(),
        "after the outage (no completion message reached a follower?): {failed:?}"
    );
    assert_eq!(
        c.mocks.primary.stats().calls - before,
        1,
        "shared coalescing did not resume on the cluster"
    );
}
