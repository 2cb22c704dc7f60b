//! The processes a table runs against, and what the suite reads from them.
//!
//! Every gateway is a real `idem serve` child process and every provider an
//! `idem mock-upstream` child process, on loopback port 0; each learns its
//! port from the line it prints on start. Their output goes to a log file in
//! the table's temporary folder (a pipe nobody drains would block them), and
//! [`Proc`] kills its child when dropped, so a table that fails or panics
//! leaves nothing running. PostgreSQL schemas and Redis keys a table creates
//! are registered in [`Cleanup`] and removed at the end of the run.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

/// The tenant key every benchmark request carries.
pub const KEY: &str = "sk-bench-tenant-1";
/// The admin key (for `/v1/stats`).
pub const ADMIN: &str = "sk-bench-admin-1";
/// The public model name of the benchmark route.
pub const MODEL: &str = "bench";
/// The variable an Anthropic provider entry reads its key from
/// (`api_key_env`); every child process gets it.
const ANTHROPIC_KEY_ENV: &str = "IDEM_BENCH_ANTHROPIC_KEY";

/// How long a process may take to print its listening line (PostgreSQL
/// migrations included).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A temporary folder, removed when dropped.
pub struct Workdir {
    pub path: PathBuf,
}

impl Workdir {
    pub fn new(label: &str) -> anyhow::Result<Workdir> {
        let path = std::env::temp_dir().join(format!(
            "idem-bench-{label}-{}",
            uuid::Uuid::now_v7().simple()
        ));
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Workdir { path })
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A child process, killed when dropped.
pub struct Proc {
    name: String,
    child: Child,
    log: PathBuf,
}

/// `text` without the temporary folder's path (error messages name the
/// config file, and the folder's long name would hide the reason).
fn without_dir(text: &str, log: &Path) -> String {
    match log.parent().and_then(Path::to_str) {
        Some(dir) => text.replace(&format!("{dir}/"), ""),
        None => text.to_string(),
    }
}

impl Proc {
    fn spawn(name: &str, args: &[&str], log: PathBuf) -> anyhow::Result<Proc> {
        Proc::spawn_program(Path::new(env!("CARGO_BIN_EXE_idem")), name, args, log)
    }

    /// `program` with `args`, its output to `log`.
    pub fn spawn_program(
        program: &Path,
        name: &str,
        args: &[&str],
        log: PathBuf,
    ) -> anyhow::Result<Proc> {
        let mut command = Command::new(program);
        command.args(args);
        Proc::spawn_command(command, name, log)
    }

    /// `command`, its output to `log`.
    pub fn spawn_command(mut command: Command, name: &str, log: PathBuf) -> anyhow::Result<Proc> {
        let out = File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        let child = command
            .env_remove("IDEM_CONFIG")
            .env(ANTHROPIC_KEY_ENV, KEY)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {name}"))?;
        Ok(Proc {
            name: name.to_string(),
            child,
            log,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Polls the log until `pick` finds what it looks for in a line; fails
    /// with the process's last words if it exits first.
    pub async fn wait_for(
        &mut self,
        what: &str,
        pick: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<String> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            if let Some(found) = text.lines().find_map(&pick) {
                return Ok(found);
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited ({status}) before {what}: {}",
                    self.name,
                    self.last_words()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{} did not report {what} within {START_TIMEOUT:?}: {}",
                    self.name,
                    self.last_words()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The last line of its log, shortened: the reason it failed.
    pub fn last_words(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let line = text
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("(no output)");
        // A JSON log line: its message and error fields say enough.
        let line = match serde_json::from_str::<Value>(line) {
            Ok(v) => {
                let mut s = v["message"].as_str().unwrap_or(line).to_string();
                if let Some(e) = v["error"].as_str() {
                    s.push_str(": ");
                    s.push_str(e);
                }
                s
            }
            Err(_) => line.to_string(),
        };
        shorten(without_dir(line.trim(), &self.log).as_str(), 200)
    }

    /// Resident memory now and its peak so far.
    pub fn mem(&self) -> anyhow::Result<Mem> {
        mem_of(self.pid())
    }

    /// User plus system CPU time so far.
    pub fn cpu(&self) -> anyhow::Result<Duration> {
        cpu_of(self.pid())
    }

    /// Whether the process has exited (and how).
    pub fn exited(&mut self) -> anyhow::Result<Option<std::process::ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    /// Waits until the process has used (almost) no CPU for 200 ms: every
    /// request it was sent has been read and parked. Gives up after `limit`.
    pub async fn until_quiet(&self, limit: Duration) -> anyhow::Result<bool> {
        let deadline = Instant::now() + limit;
        let step = Duration::from_millis(50);
        let mut last = self.cpu()?;
        let mut calm = 0;
        while Instant::now() < deadline {
            tokio::time::sleep(step).await;
            let now = self.cpu()?;
            // One tick of slack for timers (lease renewals, the reconciler).
            if now.saturating_sub(last) <= Duration::from_millis(10) {
                calm += 1;
                if calm >= 4 {
                    return Ok(true);
                }
            } else {
                calm = 0;
            }
            last = now;
        }
        Ok(false)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// User plus system CPU time of process `pid` so far, from
/// `/proc/<pid>/stat`.
pub fn cpu_of(pid: u32) -> anyhow::Result<Duration> {
    // utime is field 14, stime 15.
    let ticks = stat_field::<u64>(pid, 14)? + stat_field::<u64>(pid, 15)?;
    Ok(Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64))
}

/// Field `n` (counted from 1, as `man 5 proc` does) of `/proc/<pid>/stat`.
pub fn stat_field<T: std::str::FromStr>(pid: u32, n: usize) -> anyhow::Result<T> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    // The fields after the command name (field 2, which may hold spaces
    // and parens) start with field 3, the state.
    text.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(n.checked_sub(3)?))
        .and_then(|f| f.parse().ok())
        .with_context(|| format!("no field {n} in {path}"))
}

/// Resident memory of a process, in KiB.
#[derive(Clone, Copy, Debug, Default)]
pub struct Mem {
    pub rss_kib: u64,
    /// The part of `rss_kib` mapped from files (the binary's code pages).
    pub file_kib: u64,
    /// Peak resident set size (high water mark).
    pub hwm_kib: u64,
}

/// Resident memory of process `pid` now and its peak so far, from
/// `/proc/<pid>/status`.
pub fn mem_of(pid: u32) -> anyhow::Result<Mem> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    let field = |name: &str| -> anyhow::Result<u64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .with_context(|| format!("no {name} in {path}"))
    };
    Ok(Mem {
        rss_kib: field("VmRSS:")?,
        file_kib: field("RssFile:")?,
        hwm_kib: field("VmHWM:")?,
    })
}

/// Kernel clock ticks per second (`getconf CLK_TCK`, 100 on Linux).
fn clock_ticks() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100)
    })
}

/// `idem mock-upstream` on a loopback port, and its control API.
pub struct Mock {
    pub proc: Proc,
    pub addr: SocketAddr,
    control: reqwest::Client,
}

impl Mock {
    /// Starts a mock with these extra flags (`--latency-ms 200`, `--hold`).
    pub async fn start(dir: &Workdir, name: &str, flags: &[&str]) -> anyhow::Result<Mock> {
        let mut args = vec!["mock-upstream", "--listen", "127.0.0.1:0"];
        args.extend_from_slice(flags);
        let mut proc = Proc::spawn(name, &args, dir.file(&format!("{name}.log")))?;
        let addr = proc
            .wait_for("listening", |line| {
                line.strip_prefix("mock-upstream listening on http://")
                    .and_then(|rest| rest.strip_suffix("/v1"))
                    .map(str::to_string)
            })
            .await?;
        Ok(Mock {
            proc,
            addr: addr.parse().context("mock address")?,
            control: control_client()?,
        })
    }

    /// The base URL a provider entry points at.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// `GET /_mock/stats`.
    async fn stats(&self) -> anyhow::Result<Value> {
        Ok(self
            .control
            .get(self.url("/_mock/stats"))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }

    /// Chat completions that reached it (counted on arrival).
    pub async fn calls(&self) -> anyhow::Result<u64> {
        self.stats().await?["calls"]
            .as_u64()
            .context("no `calls` in /_mock/stats")
    }

    /// Embeddings calls that reached it and the items they carried.
    pub async fn embeddings(&self) -> anyhow::Result<Embedded> {
        let stats = self.stats().await?;
        let field = |name: &str| {
            stats[name]
                .as_u64()
                .with_context(|| format!("no `{name}` in /_mock/stats"))
        };
        Ok(Embedded {
            calls: field("embedding_calls")?,
            items: field("embedding_items")?,
        })
    }

    /// Replaces the behaviour (`{"hold": true, "latency_ms": 200}`).
    pub async fn behave(&self, behaviour: Value) -> anyhow::Result<()> {
        self.control
            .put(self.url("/_mock/behaviour"))
            .json(&behaviour)
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }

    /// Waits until at least `n` requests are held; false on timeout.
    pub async fn held(&self, n: usize, timeout: Duration) -> anyhow::Result<bool> {
        let url = self.url(&format!(
            "/_mock/held?at_least={n}&timeout_ms={}",
            timeout.as_millis()
        ));
        let status = self.control.get(url).send().await?.status();
        Ok(status.is_success())
    }

    /// Releases every held request; how many were released.
    pub async fn release(&self) -> anyhow::Result<u64> {
        let v: Value = self
            .control
            .post(self.url("/_mock/release"))
            .json(&json!({}))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        Ok(v["released"]
            .as_u64()
            .or_else(|| v["released"].as_array().map(|a| a.len() as u64))
            .unwrap_or(0))
    }
}

/// Embeddings calls and items a mock has seen.
#[derive(Clone, Copy, Debug, Default)]
pub struct Embedded {
    pub calls: u64,
    pub items: u64,
}

impl std::ops::Sub for Embedded {
    type Output = Embedded;

    fn sub(self, before: Embedded) -> Embedded {
        Embedded {
            calls: self.calls.saturating_sub(before.calls),
            items: self.items.saturating_sub(before.items),
        }
    }
}

fn control_client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?)
}

/// What differs between the gateways of the suite.
pub struct GatewaySpec {
    /// The provider's base URL (a [`Mock::base_url`]).
    pub upstream: String,
    /// `sqlite://...` or `postgres://...`.
    pub storage: String,
    /// `memory` or a `redis://` URL.
    pub backend: String,
    pub redis_prefix: String,
    /// `jobs.workers` (None: idem's default).
    pub job_workers: Option<usize>,
    /// The route also serves `POST /v1/embeddings`.
    pub embeddings: bool,
    /// The route's `cache.ttl` (None: idem's default).
    pub cache_ttl: Option<&'static str>,
    /// The provider speaks Anthropic's Messages API (the mock's Anthropic
    /// face) instead of OpenAI's: idem translates both ways.
    pub anthropic: bool,
    /// An OTLP/HTTP collector: traces on (None: idem's default, off).
    pub otlp_endpoint: Option<String>,
    /// A second provider's base URL, serving the route [`JOBS_MODEL`]
    /// (jobs on a slow provider beside chats on a fast one).
    pub jobs_upstream: Option<String>,
    /// The route's target has a price and the tenant a budget (a key of
    /// the store with a budget and limits is made by [`Gateway::key`]).
    pub budgeted: bool,
}

/// The route of [`GatewaySpec::jobs_upstream`].
pub const JOBS_MODEL: &str = "bench-jobs";

impl GatewaySpec {
    /// Memory coalescing, SQLite in `dir`.
    pub fn new(mock: &Mock, dir: &Workdir) -> GatewaySpec {
        GatewaySpec {
            upstream: mock.base_url(),
            storage: format!("sqlite://{}", dir.file("idem.db").display()),
            backend: "memory".into(),
            redis_prefix: "idem".into(),
            job_workers: None,
            embeddings: false,
            cache_ttl: None,
            anthropic: false,
            otlp_endpoint: None,
            jobs_upstream: None,
            budgeted: false,
        }
    }

    /// The config file. Everything not set here is idem's default (request
    /// log on stdout included, as an operator would run it), except that
    /// followers may wait two minutes, so that a held wave is not cut short.
    pub fn config_text(&self) -> String {
        format!(
            r#"[server]
listen = "127.0.0.1:0"
request_timeout = "120s"

[storage]
url = "{storage}"

[coalescing]
backend = "{backend}"
redis_prefix = "{prefix}"
{jobs}
[log]
format = "json"

[admin]
api_keys = ["{ADMIN}"]

[[tenants]]
name = "bench"
api_keys = ["{KEY}"]
{tenant_budget}
[[providers]]
name = "mock"
{provider}timeout = "120s"

[[routes]]
model = "{MODEL}"
targets = [{{ provider = "mock", model = "mock-model"{price} }}]
{endpoints}[routes.coalesce]
max_wait = "120s"
[routes.attempts]
timeout = "120s"
{cache}{telemetry}{jobs_route}"#,
            jobs_route = self.jobs_upstream.as_ref().map_or(String::new(), |url| format!(
                "\n[[providers]]\nname = \"mock-jobs\"\nkind = \"openai\"\nbase_url = \"{url}\"\ntimeout = \"120s\"\n\n\
                 [[routes]]\nmodel = \"{JOBS_MODEL}\"\ntargets = [{{ provider = \"mock-jobs\", model = \"mock-model\" }}]\n\
                 [routes.attempts]\ntimeout = \"120s\"\n"
            )),
            telemetry = self
                .otlp_endpoint
                .as_ref()
                .map_or(String::new(), |url| format!(
                    "\n[telemetry]\notlp_endpoint = \"{url}\"\n"
                )),
            tenant_budget = if self.budgeted {
                "budget_usd = 1000000\nbudget_period = \"30d\"\n"
            } else {
                ""
            },
            price = if self.budgeted {
                ", price = { input_per_mtok = 0.15, output_per_mtok = 0.6 }"
            } else {
                ""
            },
            storage = self.storage,
            backend = self.backend,
            prefix = self.redis_prefix,
            provider = if self.anthropic {
                // The Messages API's base URL has no `/v1`.
                format!(
                    "kind = \"anthropic\"\nbase_url = \"{}\"\napi_key_env = \"{ANTHROPIC_KEY_ENV}\"\nmax_tokens = 256\n",
                    self.upstream.trim_end_matches("/v1")
                )
            } else {
                format!("kind = \"openai\"\nbase_url = \"{}\"\n", self.upstream)
            },
            jobs = self
                .job_workers
                .map_or(String::new(), |n| format!("\n[jobs]\nworkers = {n}\n")),
            endpoints = if self.embeddings {
                "endpoints = [\"chat\", \"embeddings\"]\n"
            } else {
                ""
            },
            cache = self.cache_ttl.map_or(String::new(), |ttl| format!(
                "[routes.cache]\nttl = \"{ttl}\"\n"
            )),
        )
    }
}

/// `idem serve` on a loopback port.
pub struct Gateway {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl Gateway {
    pub async fn start(dir: &Workdir, name: &str, spec: &GatewaySpec) -> anyhow::Result<Gateway> {
        let config = dir.file(&format!("{name}.toml"));
        std::fs::write(&config, spec.config_text())
            .with_context(|| format!("cannot write {}", config.display()))?;
        let config = path_str(&config)?;
        let mut proc = Proc::spawn(
            name,
            &["serve", "--config", &config],
            dir.file(&format!("{name}.log")),
        )?;
        let addr = proc
            .wait_for("listening", |line| {
                let v: Value = serde_json::from_str(line).ok()?;
                if v["message"] == "idem listening" {
                    v["addr"].as_str().map(str::to_string)
                } else {
                    None
                }
            })
            .await?;
        Ok(Gateway {
            proc,
            addr: addr.parse().context("gateway address")?,
        })
    }

    /// A key of the store for tenant `bench`, with a budget and limits far
    /// above what a run spends (so that each request checks them all and
    /// none refuses): its secret.
    pub async fn key(&self) -> anyhow::Result<String> {
        let v: Value = control_client()?
            .post(format!("http://{}/v1/admin/keys", self.addr))
            .bearer_auth(ADMIN)
            .json(&serde_json::json!({
                "tenant": "bench",
                "name": "budgeted",
                "budget_usd": 1_000_000,
                "budget_period": "30d",
                "rpm": 1_000_000_000,
                "tpm": 1_000_000_000_000i64,
            }))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        v["key"]
            .as_str()
            .map(str::to_string)
            .context("the new key's secret")
    }

    /// `GET /metrics` (Prometheus text) with the admin key.
    pub async fn metrics(&self) -> anyhow::Result<String> {
        Ok(control_client()?
            .get(format!("http://{}/metrics", self.addr))
            .bearer_auth(ADMIN)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?)
    }

    /// `GET /v1/stats` with the admin key.
    pub async fn stats(&self) -> anyhow::Result<Value> {
        Ok(control_client()?
            .get(format!("http://{}/v1/stats", self.addr))
            .bearer_auth(ADMIN)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?)
    }
}

fn path_str(p: &Path) -> anyhow::Result<String> {
    p.to_str()
        .map(str::to_string)
        .with_context(|| format!("not UTF-8: {}", p.display()))
}

/// Cuts `s` to at most `max` characters, with an ellipsis.
pub fn shorten(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_string()
    } else {
        let cut: String = s.chars().take(max.saturating_sub(3)).collect();
        format!("{cut}...")
    }
}

/// PostgreSQL base URL: `IDEM_BENCH_DATABASE_URL`, else the tests' variable,
/// else the local server.
pub fn pg_url() -> String {
    std::env::var("IDEM_BENCH_DATABASE_URL")
        .or_else(|_| std::env::var("IDEM_TEST_DATABASE_URL"))
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// Redis URL: `IDEM_BENCH_REDIS_URL`, else the tests' variable, else local.
pub fn redis_url() -> String {
    std::env::var("IDEM_BENCH_REDIS_URL")
        .or_else(|_| std::env::var("IDEM_TEST_REDIS_URL"))
        .unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

async fn pg_pool(url: &str) -> anyhow::Result<sqlx::PgPool> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
        .with_context(|| format!("PostgreSQL not reachable at {url}"))
}

async fn pg_exec(url: &str, sql: String) -> anyhow::Result<()> {
    let pool = pg_pool(url).await?;
    sqlx::query(sqlx::AssertSqlSafe(sql)).execute(&pool).await?;
    pool.close().await;
    Ok(())
}

/// A fresh PostgreSQL schema, dropped at the end of the run; returns the
/// storage URL that selects it.
pub async fn pg_schema() -> anyhow::Result<String> {
    let base = pg_url();
    let schema = format!("idem_bench_{}", uuid::Uuid::now_v7().simple());
    pg_exec(&base, format!("CREATE SCHEMA {schema}")).await?;
    register(Cleanup::PgSchema {
        url: base.clone(),
        schema: schema.clone(),
    });
    let sep = if base.contains('?') { '&' } else { '?' };
    Ok(format!("{base}{sep}options=-c%20search_path%3D{schema}"))
}

/// A unique Redis key prefix, whose keys are deleted at the end of the run.
pub fn redis_prefix() -> String {
    let prefix = format!("idem-bench-{}", uuid::Uuid::now_v7().simple());
    let url = redis_url();
    // A URL that does not parse cannot have keys (the gateway refuses it).
    if redis::Client::open(url.as_str()).is_ok() {
        register(Cleanup::RedisPrefix {
            url,
            prefix: prefix.clone(),
        });
    }
    prefix
}

/// Something outside the temporary folders to remove at the end of the run.
enum Cleanup {
    PgSchema { url: String, schema: String },
    RedisPrefix { url: String, prefix: String },
}

static CLEANUP: Mutex<Vec<Cleanup>> = Mutex::new(Vec::new());

fn register(c: Cleanup) {
    CLEANUP
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(c);
}

/// Drops the schemas and deletes the Redis keys the run created; returns
/// what could not be cleaned.
pub async fn cleanup() -> Vec<String> {
    let items = std::mem::take(&mut *CLEANUP.lock().unwrap_or_else(PoisonError::into_inner));
    let mut failures = Vec::new();
    for item in items {
        let result = match &item {
            Cleanup::PgSchema { url, schema } => {
                pg_exec(url, format!("DROP SCHEMA IF EXISTS {schema} CASCADE")).await
            }
            Cleanup::RedisPrefix { url, prefix } => delete_redis_keys(url, prefix).await,
        };
        if let Err(e) = result {
            let what = match &item {
                Cleanup::PgSchema { schema, .. } => format!("schema {schema}"),
                Cleanup::RedisPrefix { prefix, .. } => format!("Redis keys {prefix}*"),
            };
            failures.push(format!("{what}: {e:#}"));
        }
    }
    failures
}

async fn delete_redis_keys(url: &str, prefix: &str) -> anyhow::Result<()> {
    let client = redis::Client::open(url)?;
    let mut con = tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await
    .context("Redis connect timed out")??;
    // The prefix holds a UUID; it may sit inside a {hash tag}.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("*{prefix}*"))
        .query_async(&mut con)
        .await?;
    for chunk in keys.chunks(500) {
        let _: u64 = redis::cmd("DEL").arg(chunk).query_async(&mut con).await?;
    }
    Ok(())
}
