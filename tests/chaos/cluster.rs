//! The system under test: three `idem serve` processes sharing a private
//! Redis and a PostgreSQL database, in front of one mock provider that runs
//! in the test process. Everything here can be stopped and started again by
//! the nemesis: replicas (SIGKILL, then a restart on a new port that the
//! clients learn through the [`Directory`]), Redis (same port), PostgreSQL.
//!
//! PostgreSQL is, by default, a private cluster made with `initdb` in a
//! temporary folder on a free port, so restarting it disturbs nobody else
//! using the machine's server. `IDEM_CHAOS_PG=shared` uses a fresh schema on
//! the machine's server instead (`IDEM_TEST_DATABASE_URL`) and restarts that
//! server with `pg_ctlcluster`: only where nothing else uses it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use idem::mock_upstream::{Behaviour, MockServer};
use serde_json::Value;
use tokio::io::AsyncWriteExt;

use crate::helpers::{ACME, ADMIN, BETA, Proc, pg_schema, temp_dir};
use crate::services::{self, as_postgres};

pub const REPLICAS: usize = 3;
/// The providers' timeout: the mock's stalls stay below it.
pub const PROVIDER_TIMEOUT_MS: u64 = 3_000;
/// The providers' `max_answer_bytes`: the mock's padded answers exceed it.
pub const MAX_ANSWER_BYTES: u64 = 65_536;

/// The replicas' `responses.max_conversation_bytes`: the hostile client's
/// chains run past it within a few turns.
pub const MAX_CONVERSATION_BYTES: usize = 1024 * 1024;

pub fn free_port() -> u16 {
    services::free_port().unwrap_or_else(|e| panic!("{e}"))
}

/// Where each replica listens now; `None` while it is down. Clients read it
/// before every request, so they follow restarts.
#[derive(Default)]
pub struct Directory {
    bases: RwLock<Vec<Option<(String, u32)>>>,
}

impl Directory {
    pub fn get(&self, i: usize) -> Option<String> {
        let b = self.bases.read().unwrap();
        b.get(i).cloned().flatten().map(|(base, _)| base)
    }

    /// The process ids of the replicas that are up, with their slots.
    pub fn pids(&self) -> Vec<(usize, u32)> {
        let b = self.bases.read().unwrap();
        b.iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|(_, pid)| (i, *pid)))
            .collect()
    }

    fn set(&self, i: usize, replica: Option<(String, u32)>) {
        let mut b = self.bases.write().unwrap();
        if b.len() <= i {
            b.resize(i + 1, None);
        }
        b[i] = replica;
    }
}

/// A Redis server of our own on a free port.
pub struct PrivateRedis {
    pub port: u16,
    child: Option<std::process::Child>,
    dir: PathBuf,
}

impl PrivateRedis {
    pub fn start(dir: &Path) -> PrivateRedis {
        let mut r = PrivateRedis {
            port: free_port(),
            child: None,
            dir: dir.to_path_buf(),
        };
        r.up();
        r
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Starts it (again) on its port and waits until it answers.
    pub fn up(&mut self) {
        let bin = services::redis_server_bin().unwrap_or_else(|e| panic!("{e}"));
        let child = Command::new(bin)
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .spawn()
            .expect("redis-server starts");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.answers() {
            assert!(
                Instant::now() < deadline,
                "the private redis-server on port {} did not start",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn answers(&self) -> bool {
        redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_millis(200)))
            .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
            .is_ok()
    }

    /// Stops it at once (SIGKILL: nothing is saved, like a crash).
    pub fn down(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The keys under `prefix` whose name says they are flights.
    pub fn flight_keys(&self, prefix: &str) -> Vec<String> {
        let mut conn = redis::Client::open(self.url())
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
            .expect("the private redis answers");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}:*"))
            .query(&mut conn)
            .unwrap();
        keys.into_iter()
            .filter(|k| k.contains(":flight:"))
            .collect()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.down();
    }
}

/// The PostgreSQL the replicas store jobs in.
pub enum Postgres {
    /// `initdb` in a temporary folder, run as the `postgres` user when the
    /// test runs as root (the server refuses root).
    Private {
        bin: PathBuf,
        dir: PathBuf,
        port: u16,
    },
    /// A fresh schema on the machine's server.
    Shared { url: String, version: String },
}

impl Postgres {
    pub async fn start(dir: &Path) -> Postgres {
        if std::env::var("IDEM_CHAOS_PG").as_deref() == Ok("shared") {
            let version = std::fs::read_dir("/etc/postgresql")
                .ok()
                .and_then(|mut d| d.next())
                .and_then(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .expect("IDEM_CHAOS_PG=shared needs a cluster under /etc/postgresql");
            return Postgres::Shared {
                url: pg_schema().await,
                version,
            };
        }
        let bin = services::pg_bin_dir().unwrap_or_else(|e| {
            panic!(
                "the chaos test needs a private PostgreSQL cluster: {e}; or set \
                 IDEM_CHAOS_PG=shared to use (and restart) the machine's"
            )
        });
        let dir = dir.join("pg");
        std::fs::create_dir_all(&dir).unwrap();
        services::initdb(&bin, &dir.join("data")).unwrap_or_else(|e| panic!("{e}"));
        let pg = Postgres::Private {
            bin,
            dir,
            port: free_port(),
        };
        pg.up();
        pg
    }

    pub fn url(&self) -> String {
        match self {
            Postgres::Private { port, .. } => {
                format!("postgres://postgres@127.0.0.1:{port}/postgres")
            }
            Postgres::Shared { url, .. } => url.clone(),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Postgres::Private { port, .. } => format!("private cluster on port {port}"),
            Postgres::Shared { version, .. } => {
                format!("the machine's cluster {version}/main (IDEM_CHAOS_PG=shared)")
            }
        }
    }

    fn pg_ctl(&self, args: &[&str]) -> bool {
        match self {
            Postgres::Private { bin, dir, port } => as_postgres(&bin.join("pg_ctl"))
                .arg("-D")
                .arg(dir.join("data"))
                .args(args)
                .arg("-o")
                .arg(format!(
                    "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200",
                    dir.display()
                ))
                .arg("-l")
                .arg(dir.join("log"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success()),
            Postgres::Shared { version, .. } => {
                let action = args[0];
                Command::new("pg_ctlcluster")
                    .args(["--skip-systemctl-redirect", version, "main", action])
                    .stdout(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            }
        }
    }

    pub fn up(&self) {
        let ok = match self {
            Postgres::Private { .. } => self.pg_ctl(&["start", "-w"]),
            Postgres::Shared { .. } => self.pg_ctl(&["start"]),
        };
        self.wait_ready(ok);
    }

    pub fn down(&self) {
        match self {
            Postgres::Private { .. } => self.pg_ctl(&["stop", "-m", "fast", "-w"]),
            Postgres::Shared { .. } => self.pg_ctl(&["stop"]),
        };
    }

    /// Fails the test clearly if PostgreSQL does not answer within 30 s.
    pub fn wait_ready(&self, started: bool) {
        let (host, port) = match self {
            Postgres::Private { port, .. } => ("127.0.0.1".to_string(), port.to_string()),
            Postgres::Shared { .. } => ("127.0.0.1".to_string(), "5432".to_string()),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = Command::new("pg_isready")
                .args(["-q", "-h", &host, "-p", &port])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "PostgreSQL ({}) is not up again 30 s after a start (pg_ctl said {started}): \
                 start it with pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
                self.describe()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        match self {
            Postgres::Private { dir, .. } => {
                let dir = dir.clone();
                let _ = self.pg_ctl(&["stop", "-m", "immediate", "-w"]);
                let _ = std::fs::remove_dir_all(dir);
            }
            // The machine's server stays up whatever happened.
            Postgres::Shared { .. } => {
                if !Command::new("pg_isready")
                    .args(["-q", "-h", "127.0.0.1", "-p", "5432"])
                    .status()
                    .is_ok_and(|s| s.success())
                {
                    self.up();
                }
            }
        }
    }
}

/// The config every replica runs (listen port 0: each start gets a new one).
pub fn config_text(db: &str, redis: &str, prefix: &str, mock: &MockServer) -> String {
    let base = mock.base_url();
    format!(
        r#"
[server]
listen = "127.0.0.1:0"
request_timeout = "10s"
shutdown_grace = "2s"
[responses]
max_conversation_bytes = {MAX_CONVERSATION_BYTES}
[storage]
url = "{db}"
max_connections = 8
[coalescing]
backend = "{redis}"
redis_prefix = "{prefix}"
redis_timeout = "250ms"
redis_poll = "200ms"
[jobs]
workers = 8
poll_interval = "200ms"
attempt_lease = "1s"
claim_lease = "2s"
reconcile_interval = "250ms"
[log]
format = "json"
requests = "off"
[admin]
api_keys = ["{ADMIN}"]
[[tenants]]
name = "acme"
api_keys = ["{ACME}"]
[[tenants]]
name = "beta"
api_keys = ["{BETA}"]
[[providers]]
name = "primary"
kind = "openai"
base_url = "{base}"
timeout = "{PROVIDER_TIMEOUT_MS}ms"
max_answer_bytes = {MAX_ANSWER_BYTES}
[[providers]]
name = "fallback"
kind = "openai"
base_url = "{base}"
timeout = "{PROVIDER_TIMEOUT_MS}ms"
max_answer_bytes = {MAX_ANSWER_BYTES}
{bot}
{hedged}
"#,
        bot = route("bot", ""),
        hedged = route("hedged", "hedge_after = \"400ms\"\n"),
    )
}

fn route(model: &str, attempts: &str) -> String {
    format!(
        r#"
[[routes]]
model = "{model}"
targets = [{{ provider = "primary", model = "gpt-4o-mini" }}, {{ provider = "fallback", model = "llama-3.1-8b" }}]
[routes.cache]
ttl = "60s"
rate_limit_ttl = "{rl}ms"
server_error_ttl = "{se}ms"
[routes.coalesce]
lease = "2s"
max_wait = "6s"
on_wait_timeout = "fail"
[routes.attempts]
max = 3
timeout = "5s"
backoff_base = "100ms"
backoff_max = "1s"
late_result_window = "20s"
auto_resolve_unknown_after = "1s"
{attempts}"#,
        rl = crate::checker::RATE_LIMIT_TTL_MS,
        se = crate::checker::SERVER_ERROR_TTL_MS,
    )
}

/// The calm behaviour of the mock: jittered latency, so that concurrent
/// calls finish out of order.
pub fn calm() -> Behaviour {
    Behaviour {
        latency_ms: 20,
        latency_jitter_ms: 250,
        ..Behaviour::default()
    }
}

/// One replica slot: its process (while up) and how often it started.
pub struct Replica {
    pub proc: Option<Proc>,
    pub starts: usize,
}

pub struct Cluster {
    pub dir: PathBuf,
    pub config: PathBuf,
    pub prefix: String,
    pub mock: Arc<MockServer>,
    pub redis: PrivateRedis,
    /// Always `Some` until the cluster is dropped.
    pub pg: Option<Postgres>,
    pub replicas: Vec<Replica>,
    pub directory: Arc<Directory>,
    pub client: reqwest::Client,
}

impl Cluster {
    pub async fn start() -> Cluster {
        let dir = temp_dir();
        let mock = Arc::new(
            MockServer::start(([127, 0, 0, 1], 0).into(), calm())
                .await
                .unwrap(),
        );
        let redis = PrivateRedis::start(&dir);
        let pg = Postgres::start(&dir).await;
        let prefix = format!("idem-chaos-{}", uuid::Uuid::now_v7().simple());
        let config = dir.join("idem.toml");
        std::fs::write(
            &config,
            config_text(&pg.url(), &redis.url(), &prefix, &mock),
        )
        .unwrap();
        let pg = Some(pg);
        let mut c = Cluster {
            dir,
            config,
            prefix,
            mock,
            redis,
            pg,
            replicas: Vec::new(),
            directory: Arc::new(Directory::default()),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap(),
        };
        for i in 0..REPLICAS {
            c.replicas.push(Replica {
                proc: None,
                starts: 0,
            });
            c.start_replica(i).await;
        }
        c
    }

    /// Starts replica `i` and publishes its address; its log goes to a file.
    ///
    /// `IDEM_CHAOS_SABOTAGE=split-redis` gives each replica its own Redis
    /// prefix, so replicas no longer share flights: a way to watch the
    /// checker catch the extra upstream calls.
    pub async fn start_replica(&mut self, i: usize) {
        let split = format!("{}-replica-{i}", self.prefix);
        let envs: Vec<(&str, &str)> =
            if std::env::var("IDEM_CHAOS_SABOTAGE").as_deref() == Ok("split-redis") {
                vec![("IDEM_COALESCING__REDIS_PREFIX", split.as_str())]
            } else {
                vec![]
            };
        let mut proc = Proc::start(&self.config, &envs).await;
        let slot = &mut self.replicas[i];
        slot.starts += 1;
        let log = self.dir.join(format!("replica-{i}-{}.log", slot.starts));
        let (_, mut lines) = {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<String>();
            (tx, std::mem::replace(&mut proc.lines, rx))
        };
        tokio::spawn(async move {
            let Ok(mut f) = tokio::fs::File::create(&log).await else {
                return;
            };
            while let Some(l) = lines.recv().await {
                let _ = f.write_all(l.as_bytes()).await;
                let _ = f.write_all(b"\n").await;
            }
        });
        self.directory.set(i, Some((proc.base.clone(), proc.pid())));
        slot.proc = Some(proc);
    }

    /// SIGKILL (with the `kill` command), then forget its address.
    pub async fn kill_replica(&mut self, i: usize) {
        self.directory.set(i, None);
        if let Some(mut p) = self.replicas[i].proc.take() {
            p.signal("KILL");
            let _ = p.child.wait().await;
        }
    }

    /// Sends a signal to replica `i` (if it is up).
    pub fn signal_replica(&self, i: usize, sig: &str) {
        if let Some(p) = &self.replicas[i].proc {
            p.signal(sig);
        }
    }

    pub fn is_up(&self, i: usize) -> bool {
        self.replicas[i].proc.is_some()
    }

    pub async fn admin_stats(&self, i: usize) -> Option<Value> {
        let base = self.directory.get(i)?;
        let r = self
            .client
            .get(format!("{base}/v1/stats"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .ok()?;
        r.json().await.ok()
    }

    pub fn pg(&self) -> &Postgres {
        self.pg.as_ref().expect("the cluster's PostgreSQL")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for r in &mut self.replicas {
            r.proc = None;
        }
        // Stops a private PostgreSQL before its folder goes.
        self.pg = None;
        self.redis.down();
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        } else {
            eprintln!("chaos: replica logs kept in {}", self.dir.display());
        }
    }
}

/// Watches every replica's `idem_redis_errors_total` (every 200 ms, until
/// `stop`) and records each increase as a [`FaultKind::RedisErrors`]: the
/// Redis failures the replicas saw, injected or not, which the upstream-call
/// bound must pay for.
pub async fn watch_redis_errors(
    directory: Arc<Directory>,
    rec: Arc<crate::history::Recorder>,
    stop: tokio_util::sync::CancellationToken,
) {
    use crate::history::{Fault, FaultKind, now_ms};
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    // Per process (its address): the last count and when it was read.
    let mut last: std::collections::HashMap<String, (u64, i64)> = Default::default();
    while !stop.is_cancelled() {
        for i in 0..REPLICAS {
            let Some(base) = directory.get(i) else {
                continue;
            };
            let Ok(r) = client.get(format!("{base}/metrics")).send().await else {
                continue;
            };
            let Ok(text) = r.text().await else { continue };
            let Some(count) = text
                .lines()
                .find_map(|l| l.strip_prefix("idem_redis_errors_total "))
                .and_then(|v| v.trim().parse::<f64>().ok())
            else {
                continue;
            };
            let count = count as u64;
            let now = now_ms();
            let (before, since) = last.get(&base).copied().unwrap_or((0, now - 200));
            if count > before {
                rec.fault(Fault {
                    kind: FaultKind::RedisErrors {
                        replica: i,
                        count: count - before,
                    },
                    from_ms: since,
                    until_ms: now,
                });
            }
            last.insert(base, (count, now));
        }
        tokio::select! {
            () = stop.cancelled() => {}
            () = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}

/// Samples every live replica's peak resident memory (`VmHWM`, which only
/// grows over a process's life) every 100 ms until `stop`, and records each
/// process's highest reading.
pub async fn watch_memory(
    directory: Arc<Directory>,
    rec: Arc<crate::history::Recorder>,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut peaks: std::collections::BTreeMap<u32, (usize, u64, i64)> = Default::default();
    loop {
        for (replica, pid) in directory.pids() {
            let Some((peak, _)) = crate::helpers::try_memory_of(pid) else {
                continue;
            };
            let entry = peaks.entry(pid).or_insert((replica, 0, 0));
            if peak > entry.1 {
                *entry = (replica, peak, crate::history::now_ms());
            }
        }
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(Duration::from_millis(100)) => {}
        }
    }
    for (pid, (replica, peak, at_ms)) in peaks {
        rec.memory(crate::history::Memory {
            replica,
            pid,
            peak,
            at_ms,
        });
    }
}
