//! Test harness: a real idem gateway on port 0, in this process or as a
//! child process, in front of mock providers that tests hold and release,
//! on a fresh SQLite file or a fresh PostgreSQL schema.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use idem::app::App;
use idem::config::{Config, ProviderKind, Source};
use idem::http::AppState;
use idem::mock_upstream::{Behaviour, MockServer};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::oneshot;

pub const ACME: &str = "sk-acme-test-1";
pub const BETA: &str = "sk-beta-test-1";
pub const ADMIN: &str = "admin-test-secret";

/// PostgreSQL for tests: the test process's (`IDEM_TEST_DATABASE_URL`, the
/// machine's at the default address, or a private one: `services.rs`).
pub fn pg_url() -> String {
    crate::services::postgres_url()
}

/// A fresh, empty PostgreSQL schema for one test; the URL selects it.
pub async fn pg_schema() -> String {
    let url = pg_url();
    let schema = format!("idem_it_{}", uuid::Uuid::now_v7().simple());
    let conn = sqlx_connect(&url).await;
    sqlx_exec(&conn, &format!("CREATE SCHEMA {schema}")).await;
    format!("{url}?options=-c%20search_path%3D{schema}")
}

async fn sqlx_connect(url: &str) -> sqlx::PgPool {
    match sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(url)
        .await
    {
        Ok(p) => p,
        Err(e) => panic!("PostgreSQL at {url} answered the tests before, but not now: {e}"),
    }
}

async fn sqlx_exec(pool: &sqlx::PgPool, sql: &str) {
    sqlx::query(sqlx::AssertSqlSafe(sql.to_string()))
        .execute(pool)
        .await
        .unwrap();
}

/// What a test gateway looks like. The default: tenants `acme` and `beta`,
/// an admin key, one route `bot` on the primary mock, SQLite.
#[derive(Clone)]
pub struct Spec {
    pub primary: Behaviour,
    /// A second provider `fallback`, the route's second target.
    pub fallback: Option<Behaviour>,
    /// Plain keys of the `[[routes]]` table (`normalize = "casefold"`).
    pub route: String,
    pub cache: String,
    pub coalesce: String,
    pub attempts: String,
    pub server: String,
    pub jobs: String,
    pub provider_timeout: String,
    /// Extra keys of the primary provider's `[[providers]]` table
    /// (`max_answer_bytes = 65536`).
    pub provider_extra: String,
    /// Extra TOML appended at the end (more routes).
    pub extra: String,
    pub postgres: bool,
    /// An explicit storage URL (shared by several gateways).
    pub storage_url: Option<String>,
    /// Extra keys of tenant `acme` (`rate_limit = {...}`).
    pub acme: String,
    /// Extra keys of the `[admin]` table (`metrics_require_key = true`).
    pub admin: String,
    /// The provider kinds of `primary` and `fallback`: the mock speaks
    /// OpenAI's wire format and Anthropic's.
    pub primary_kind: ProviderKind,
    pub fallback_kind: ProviderKind,
}

impl Default for Spec {
    fn default() -> Self {
        Spec {
            primary: Behaviour::default(),
            fallback: None,
            route: String::new(),
            cache: String::new(),
            coalesce: String::new(),
            attempts: String::new(),
            server: String::new(),
            jobs: "reconcile_interval = \"200ms\"\npoll_interval = \"200ms\"\n".into(),
            provider_timeout: "30s".into(),
            provider_extra: String::new(),
            extra: String::new(),
            postgres: false,
            storage_url: None,
            acme: String::new(),
            admin: String::new(),
            primary_kind: ProviderKind::Openai,
            fallback_kind: ProviderKind::Openai,
        }
    }
}

/// A provider's `kind` and `base_url` keys for a mock speaking `kind`.
pub fn provider_keys(kind: ProviderKind, mock: &MockServer) -> String {
    match kind {
        // The Messages API lives at `{base_url}/v1/messages`, and wants a
        // key (the mock answers 401 without one): any variable cargo sets
        // for the tests it runs will do, here the package's name.
        ProviderKind::Anthropic => format!(
            "kind = \"anthropic\"\nbase_url = \"http://{}\"\napi_key_env = \"CARGO_PKG_NAME\"\n",
            mock.addr()
        ),
        // An Azure resource's deployments live under its root.
        ProviderKind::Azure => format!("kind = \"azure\"\nbase_url = \"http://{}\"\n", mock.addr()),
        other => format!(
            "kind = \"{}\"\nbase_url = \"{}\"\n",
            other.as_str(),
            mock.base_url()
        ),
    }
}

pub struct Mocks {
    pub primary: MockServer,
    pub fallback: Option<MockServer>,
}

/// Writes the config text for `spec`; `db` is the storage URL.
pub fn config_text(spec: &Spec, mocks: &Mocks, db: &str, listen: &str) -> String {
    let mut t = format!(
        r#"
[server]
listen = "{listen}"
max_body_bytes = 65536
shutdown_grace = "5s"
{server}
[storage]
url = "{db}"
max_connections = 8
[jobs]
{jobs}
[log]
format = "json"
[admin]
api_keys = ["{ADMIN}"]
{admin}
[[tenants]]
name = "acme"
api_keys = ["{ACME}"]
{acme}
[[tenants]]
name = "beta"
api_keys = ["{BETA}"]
[[providers]]
name = "primary"
{primary}timeout = "{timeout}"
{provider_extra}
"#,
        server = spec.server,
        jobs = spec.jobs,
        acme = spec.acme,
        admin = spec.admin,
        primary = provider_keys(spec.primary_kind, &mocks.primary),
        timeout = spec.provider_timeout,
        provider_extra = spec.provider_extra,
    );
    if let Some(f) = &mocks.fallback {
        t.push_str(&format!(
            "[[providers]]\nname = \"fallback\"\n{}timeout = \"{}\"\n",
            provider_keys(spec.fallback_kind, f),
            spec.provider_timeout
        ));
    }
    let targets = if mocks.fallback.is_some() {
        r#"[{ provider = "primary", model = "gpt-4o-mini" }, { provider = "fallback", model = "llama-3.1-8b" }]"#
    } else {
        r#"[{ provider = "primary", model = "gpt-4o-mini" }]"#
    };
    t.push_str(&format!(
        "[[routes]]\nmodel = \"bot\"\ntargets = {targets}\n{}\n[routes.cache]\n{}\n[routes.coalesce]\n{}\n[routes.attempts]\n{}\n",
        spec.route, spec.cache, spec.coalesce, spec.attempts
    ));
    t.push_str(&spec.extra);
    t
}

/// A gateway running in this process.
pub struct TestApp {
    pub base: String,
    pub client: reqwest::Client,
    pub mock: MockServer,
    pub fallback: Option<MockServer>,
    pub state: AppState,
    pub dir: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

pub fn temp_dir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("idem-test-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub async fn start_mocks(spec: &Spec) -> Mocks {
    let lo: SocketAddr = ([127, 0, 0, 1], 0).into();
    let primary = MockServer::start(lo, spec.primary.clone()).await.unwrap();
    let fallback = match &spec.fallback {
        Some(b) => Some(MockServer::start(lo, b.clone()).await.unwrap()),
        None => None,
    };
    Mocks { primary, fallback }
}

pub async fn storage_url(spec: &Spec, dir: &Path) -> String {
    if let Some(u) = &spec.storage_url {
        return u.clone();
    }
    if spec.postgres {
        pg_schema().await
    } else {
        format!("sqlite://{}", dir.join("idem.db").display())
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(2048)
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap()
}

impl TestApp {
    pub async fn spawn() -> TestApp {
        TestApp::with(Spec::default()).await
    }

    pub async fn with(spec: Spec) -> TestApp {
        TestApp::with_config(spec, |text, _| text).await
    }

    /// A gateway of `spec` whose configuration text `edit` changes first
    /// (it gets the mocks, e.g. to put something between idem and them).
    pub async fn with_config(spec: Spec, edit: impl FnOnce(String, &Mocks) -> String) -> TestApp {
        let mocks = start_mocks(&spec).await;
        let dir = temp_dir();
        let db = storage_url(&spec, &dir).await;
        let text = edit(config_text(&spec, &mocks, &db, "127.0.0.1:0"), &mocks);
        let config = Config::from_toml_str(&text, Source::Embedded, false).unwrap();
        let app = App::build(config).await.unwrap();
        let base = format!("http://127.0.0.1:{}", app.port());
        let state = app.state().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(app.run(async move {
            let _ = stopped.await;
        }));
        TestApp {
            base,
            client: client(),
            mock: mocks.primary,
            fallback: mocks.fallback,
            state,
            dir,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A chat completion as tenant `key`.
    pub async fn chat(&self, key: &str, body: &Value) -> reqwest::Response {
        self.client
            .post(self.url("/v1/chat/completions"))
            .bearer_auth(key)
            .json(body)
            .send()
            .await
            .unwrap()
    }

    pub async fn chat_with(
        &self,
        key: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut r = self
            .client
            .post(self.url("/v1/chat/completions"))
            .bearer_auth(key)
            .json(body);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.send().await.unwrap()
    }

    pub async fn get_json(&self, key: &str, path: &str) -> (u16, Value) {
        let r = self
            .client
            .get(self.url(path))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    pub async fn post_json(
        &self,
        key: &str,
        path: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        let mut r = self.client.post(self.url(path)).bearer_auth(key).json(body);
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.send().await.unwrap()
    }

    pub async fn metrics(&self) -> String {
        get_text(&self.client, self.url("/metrics")).await
    }

    /// Upstream calls the primary mock has seen.
    pub fn calls(&self) -> u64 {
        self.mock.stats().calls
    }

    /// Waits until followers have joined flights, so a wave is known to be
    /// coalescing before the test releases the provider.
    pub async fn until_followers(&self, n: u64) {
        let table = &self.state.core.coalescer.table;
        eventually(Duration::from_secs(30), || table.followers() >= n).await;
    }

    /// Waits until no flight is in progress.
    pub async fn until_no_flights(&self) {
        let table = &self.state.core.coalescer.table;
        eventually(Duration::from_secs(30), || {
            table.inflight() == 0 && table.is_empty()
        })
        .await;
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), t).await;
        }
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `cond` until it holds; fails the test after `limit`. This waits
/// on observable state, never on elapsed time alone.
pub async fn eventually(limit: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "condition not reached within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Async variant of [`eventually`].
pub async fn eventually_async<F, Fut>(limit: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !cond().await {
        assert!(
            start.elapsed() < limit,
            "condition not reached within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the mock holds at least `n` requests; returns their seqs.
pub async fn held(mock: &MockServer, n: usize) -> Vec<u64> {
    let url = format!(
        "http://{}/_mock/held?at_least={n}&timeout_ms=20000",
        mock.addr()
    );
    let r = reqwest::get(&url).await.unwrap();
    assert_eq!(
        r.status(),
        200,
        "the mock did not hold {n} requests in time"
    );
    let v: Value = r.json().await.unwrap();
    v["held"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_u64().unwrap())
        .collect()
}

/// Releases held requests: all (`seq: None`) or one.
pub async fn release(mock: &MockServer, seq: Option<u64>) {
    let body = match seq {
        Some(s) => json!({"seq": s}),
        None => json!({}),
    };
    let r = reqwest::Client::new()
        .post(format!("http://{}/_mock/release", mock.addr()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

pub async fn release_with(mock: &MockServer, body: Value) {
    let r = reqwest::Client::new()
        .post(format!("http://{}/_mock/release", mock.addr()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// The default spec with a provider that holds every call until released.
pub fn holding() -> Spec {
    Spec {
        primary: Behaviour {
            hold: true,
            ..Behaviour::default()
        },
        ..Spec::default()
    }
}

/// An HTTP/2 connection (prior knowledge) to `addr`, driven by a task of
/// its own that ends with the connection.
pub async fn h2_connect(
    addr: &str,
) -> (
    hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
    tokio::task::JoinHandle<hyper::Result<()>>,
) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("no HTTP/2 handshake");
    (sender, tokio::spawn(conn))
}

/// A chat completion as tenant `key`, as an HTTP/2 request to `base`.
pub fn h2_chat(
    base: &str,
    key: &str,
    body: &Value,
) -> hyper::Request<http_body_util::Full<bytes::Bytes>> {
    hyper::Request::post(format!("{base}/v1/chat/completions"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            serde_json::to_vec(body).unwrap(),
        )))
        .unwrap()
}

pub fn chat_body(content: &str) -> Value {
    json!({"model": "bot", "messages": [{"role": "user", "content": content}]})
}

/// The assistant content of a plain completion.
pub fn content_of(v: &Value) -> String {
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// Concatenated delta contents of an SSE body; asserts it ends with [DONE].
pub fn sse_content(text: &str) -> String {
    assert!(
        text.trim_end().ends_with("data: [DONE]"),
        "stream does not end with [DONE]: {text}"
    );
    let mut out = String::new();
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk", "{data}");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            out.push_str(c);
        }
    }
    out
}

/// An OpenAI error object with this status and code.
pub async fn assert_error(resp: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(resp.status().as_u16(), status, "status");
    let v: Value = resp.json().await.unwrap();
    let e = &v["error"];
    assert_eq!(e["code"], code, "{v}");
    assert!(e["message"].is_string() && e["type"].is_string(), "{v}");
    assert!(e.as_object().unwrap().contains_key("param"), "{v}");
    v
}

/// Fires `n` identical requests at once; returns (status, outcome, body).
pub async fn wave(
    app: &TestApp,
    key: &str,
    body: &Value,
    n: usize,
) -> Vec<tokio::task::JoinHandle<(u16, String, String)>> {
    wave_at(app, "/v1/chat/completions", key, body, n).await
}

/// [`wave`] at another endpoint of the chat path.
pub async fn wave_at(
    app: &TestApp,
    path: &str,
    key: &str,
    body: &Value,
    n: usize,
) -> Vec<tokio::task::JoinHandle<(u16, String, String)>> {
    (0..n)
        .map(|_| {
            let (client, url, key, body) = (
                app.client.clone(),
                app.url(path),
                key.to_string(),
                body.clone(),
            );
            tokio::spawn(async move {
                let r = client
                    .post(url)
                    .bearer_auth(key)
                    .json(&body)
                    .send()
                    .await
                    .unwrap();
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

/// The body of `GET url`, as text.
pub async fn get_text(client: &reqwest::Client, url: String) -> String {
    client.get(url).send().await.unwrap().text().await.unwrap()
}

pub async fn collect<T>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

pub fn count_by<T, K: std::hash::Hash + Eq>(
    items: &[T],
    key: impl Fn(&T) -> K,
) -> HashMap<K, usize> {
    let mut m = HashMap::new();
    for i in items {
        *m.entry(key(i)).or_insert(0) += 1;
    }
    m
}

/// A gateway as a child process (`idem serve --config FILE`).
pub struct Proc {
    pub child: tokio::process::Child,
    pub base: String,
    pub lines: tokio::sync::mpsc::UnboundedReceiver<String>,
}

impl Proc {
    /// Starts `idem serve` on `config` (listen must be port 0) and waits for
    /// its listening line.
    pub async fn start(config: &Path, envs: &[(&str, &str)]) -> Proc {
        Proc::start_args(
            &["serve".as_ref(), "--config".as_ref(), config.as_os_str()],
            envs,
        )
        .await
    }

    /// Starts `idem` with these arguments (a `serve`), with `envs` set and
    /// `OPENAI_API_KEY` and `IDEM_CONFIG` unset unless in `envs`, and waits
    /// for its listening line.
    pub async fn start_args(args: &[&std::ffi::OsStr], envs: &[(&str, &str)]) -> Proc {
        Proc::start_in(None, args, envs).await
    }

    /// [`Proc::start_args`] in the folder `cwd` (else this process's).
    pub async fn start_in(
        cwd: Option<&Path>,
        args: &[&std::ffi::OsStr],
        envs: &[(&str, &str)],
    ) -> Proc {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_idem"));
        if let Some(dir) = cwd {
            cmd.current_dir(dir);
        }
        cmd.args(args)
            .env_remove("IDEM_CONFIG")
            .env_remove("OPENAI_API_KEY")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let (ltx, lrx) = tokio::sync::mpsc::unbounded_channel();
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = rx.recv().await {
                let _ = ltx.send(line.clone());
                if let Ok(v) = serde_json::from_str::<Value>(&line)
                    && v["message"] == "idem listening"
                {
                    return v["addr"].as_str().unwrap().to_string();
                }
                // The text log (`log.format = "text"`).
                if let Some((_, rest)) = line.split_once("idem listening addr=") {
                    return rest.split(' ').next().unwrap().to_string();
                }
            }
            panic!("idem exited before listening");
        })
        .await
        .expect("idem did not start listening within 30 s");
        tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                if ltx.send(line).is_err() {
                    break;
                }
            }
        });
        Proc {
            child,
            base: format!("http://{addr}"),
            lines: lrx,
        }
    }

    /// `idem serve` on the tests' default config: `mocks` as the providers,
    /// SQLite, both in a fresh temporary folder (the config is its
    /// `idem.toml`), which the caller removes.
    pub async fn start_default(mocks: &Mocks) -> (Proc, PathBuf) {
        Proc::start_default_with(mocks, |_| Vec::new()).await
    }

    /// [`Proc::start_default`] with environment overrides, chosen knowing
    /// the temporary folder (for paths inside it).
    pub async fn start_default_with(
        mocks: &Mocks,
        envs: impl FnOnce(&Path) -> Vec<(&'static str, String)>,
    ) -> (Proc, PathBuf) {
        let dir = temp_dir();
        let db = format!("sqlite://{}", dir.join("idem.db").display());
        let config = dir.join("idem.toml");
        std::fs::write(
            &config,
            config_text(&Spec::default(), mocks, &db, "127.0.0.1:0"),
        )
        .unwrap();
        let envs = envs(&dir);
        let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        (Proc::start(&config, &envs).await, dir)
    }

    pub fn pid(&self) -> u32 {
        self.child.id().unwrap()
    }

    /// Its `/metrics` text.
    pub async fn metrics(&self) -> String {
        get_text(&client(), format!("{}/metrics", self.base)).await
    }

    /// Sends a signal with the `kill` command (no unsafe code in tests).
    pub fn signal(&self, sig: &str) {
        let ok = std::process::Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// Everything the process printed so far (lines already read).
    pub fn drain(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(l) = self.lines.try_recv() {
            out.push(l);
        }
        out
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // kill_on_drop covers this too; be explicit, a leaked gateway keeps
        // polling its database long after the test.
        let _ = self.child.start_kill();
    }
}

/// A test that runs once for each wire format the mock's providers speak:
/// `mod <name> { fn openai(); fn anthropic() }`, each calling the body with
/// its `ProviderKind`, which the body gives its spec's providers. The same
/// body, so that every guarantee it checks holds whatever kind answers.
// The chaos test includes this file too and uses no `each_kind!`.
#[allow(unused_macros)]
macro_rules! each_kind {
    ($(#[$attr:meta])* async fn $name:ident($kind:ident) $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            async fn run($kind: idem::config::ProviderKind) $body

            $(#[$attr])*
            async fn openai() {
                run(idem::config::ProviderKind::Openai).await
            }

            $(#[$attr])*
            async fn anthropic() {
                run(idem::config::ProviderKind::Anthropic).await
            }
        }
    };
}
#[allow(unused_imports)]
pub(crate) use each_kind;

/// The process's peak and current resident memory, in bytes (`VmHWM`,
/// `VmRSS` of /proc/PID/status).
pub fn memory_of(pid: u32) -> (u64, u64) {
    try_memory_of(pid).unwrap_or_else(|| panic!("no memory figures for process {pid}"))
}

/// [`memory_of`], or `None` when the process is gone.
pub fn try_memory_of(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// The documented ceiling of a gateway at its defaults under hostile
/// bodies (SECURITY.md, "Bounds").
pub const MEMORY_CEILING: u64 = 512 * 1024 * 1024;

/// How far above its idle memory a gateway that has answered hostile
/// bodies may stay once they are gone (SECURITY.md, "Bounds").
pub const NEAR_IDLE_SLACK: u64 = 64 * 1024 * 1024;

/// `count` copies of `item` (JSON text), comma-separated.
fn repeated(item: &str, count: usize) -> String {
    let mut s = String::with_capacity((item.len() + 1) * count);
    for i in 0..count {
        if i > 0 {
            s.push(',');
        }
        s.push_str(item);
    }
    s
}

/// The size of a [`worst_body`] for `path` of about 95,000 JSON values
/// and keys: just under the default values budget of 100,000.
pub fn just_under_the_values_budget(path: &str) -> usize {
    // Per item: its values and keys, and its bytes with the comma.
    let (values, bytes) = match path {
        "/v1/messages" => (5, 26),
        "/v1/responses" => (5, 31),
        _ => (3, 8),
    };
    95_000 / values * bytes
}

/// A worst-case body for `path` of about `bytes` bytes, made of the
/// smallest JSON values each face reads: empty text blocks (Messages),
/// input items (Responses), tiny objects in an unknown field (chat,
/// embeddings, jobs; there `prompt` is the user's message).
pub fn worst_body(path: &str, bytes: usize, prompt: &str) -> Vec<u8> {
    let text = match path {
        "/v1/messages" => {
            let block = r#"{"type":"text","text":""}"#;
            format!(
                r#"{{"model":"bot","max_tokens":16,"messages":[{{"role":"user","content":[{}]}}]}}"#,
                repeated(block, bytes / (block.len() + 1))
            )
        }
        "/v1/responses" => {
            let item = r#"{"role":"user","content":"x"}"#;
            format!(
                r#"{{"model":"bot","input":[{}]}}"#,
                repeated(item, bytes / (item.len() + 1))
            )
        }
        _ => {
            let chat = format!(
                r#"{{"model":"bot","messages":[{{"role":"user","content":{}}}],"filler":[{}]}}"#,
                Value::from(prompt),
                repeated(r#"{"a":1}"#, bytes / 8)
            );
            if path == "/v1/jobs" {
                format!(r#"{{"request":{chat}}}"#)
            } else {
                chat
            }
        }
    };
    text.into_bytes()
}

/// A face idem serves a conversation on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Face {
    Chat,
    Messages,
    Responses,
}

impl Face {
    pub fn path(self) -> &'static str {
        match self {
            Face::Chat => "/v1/chat/completions",
            Face::Messages => "/v1/messages",
            Face::Responses => "/v1/responses",
        }
    }

    /// A request asking `content` of route `bot`, in the face's dialect.
    pub fn body(self, content: &str) -> Value {
        match self {
            Face::Chat => chat_body(content),
            Face::Messages => json!({"model": "bot", "max_tokens": 256,
                "messages": [{"role": "user", "content": content}]}),
            Face::Responses => json!({"model": "bot", "input": content}),
        }
    }

    /// The same request, streamed.
    pub fn streamed(self, content: &str) -> Value {
        let mut b = self.body(content);
        b["stream"] = json!(true);
        b
    }

    /// The answer's text, from a plain answer (or a job's result) of this
    /// face.
    pub fn text(self, v: &Value) -> String {
        match self {
            Face::Chat => content_of(v),
            Face::Messages => {
                assert_eq!(v["type"], "message", "{v}");
                assert_eq!(v["role"], "assistant", "{v}");
                v["content"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|b| b["type"] == "text")
                    .map(|b| b["text"].as_str().unwrap())
                    .collect()
            }
            Face::Responses => {
                assert_eq!(v["object"], "response", "{v}");
                v["output"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .filter(|i| i["type"] == "message")
                    .flat_map(|i| i["content"].as_array().unwrap())
                    .filter(|p| p["type"] == "output_text")
                    .map(|p| p["text"].as_str().unwrap())
                    .collect()
            }
        }
    }

    /// The answer's text, from a stream of this face (checked whole).
    pub fn stream_text(self, text: &str) -> String {
        if self == Face::Chat {
            return sse_content(text);
        }
        let events = events(text);
        let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
        match self {
            Face::Messages => {
                assert_eq!(kinds.first(), Some(&"message_start"), "{text}");
                assert_eq!(kinds.last(), Some(&"message_stop"), "{text}");
                assert!(kinds.contains(&"message_delta"), "{text}");
                events
                    .iter()
                    .filter(|(k, v)| {
                        k == "content_block_delta" && v["delta"]["type"] == "text_delta"
                    })
                    .map(|(_, v)| v["delta"]["text"].as_str().unwrap().to_string())
                    .collect()
            }
            _ => {
                assert_eq!(kinds.first(), Some(&"response.created"), "{text}");
                assert_eq!(kinds.last(), Some(&"response.completed"), "{text}");
                for (i, (k, v)) in events.iter().enumerate() {
                    assert_eq!(v["type"], k.as_str(), "{text}");
                    assert_eq!(v["sequence_number"], i, "{text}");
                }
                let streamed: String = events
                    .iter()
                    .filter(|(k, _)| k == "response.output_text.delta")
                    .map(|(_, v)| v["delta"].as_str().unwrap().to_string())
                    .collect();
                let (_, done) = events.last().unwrap();
                assert_eq!(self.text(&done["response"]), streamed, "{text}");
                streamed
            }
        }
    }

    /// Whether a stream of this face ended as a success ends.
    pub fn stream_succeeded(self, text: &str) -> bool {
        match self {
            Face::Chat => text.trim_end().ends_with("data: [DONE]") && !text.contains("\"error\""),
            Face::Messages => {
                text.contains("event: message_stop") && !text.contains("event: error")
            }
            Face::Responses => {
                text.contains("event: response.completed")
                    && !text.contains("event: error")
                    && !text.contains("event: response.failed")
            }
        }
    }

    /// An error body of this face: its kind (Anthropic's `error.type`,
    /// OpenAI's `error.code`).
    pub fn error_kind(self, v: &Value) -> String {
        match self {
            Face::Messages => {
                assert_eq!(v["type"], "error", "{v}");
                assert!(v["error"]["message"].is_string(), "{v}");
                v["error"]["type"].as_str().unwrap().to_string()
            }
            _ => {
                assert!(v["error"]["message"].is_string(), "{v}");
                v["error"]["code"].as_str().unwrap_or_default().to_string()
            }
        }
    }
}

/// The events of an SSE body with `event:` lines: (type, data).
pub fn events(text: &str) -> Vec<(String, Value)> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| {
            let mut kind = String::new();
            let mut data = String::new();
            for line in e.lines() {
                if let Some(k) = line.strip_prefix("event: ") {
                    kind = k.to_string();
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push_str(d);
                }
            }
            let v: Value = serde_json::from_str(&data)
                .unwrap_or_else(|e| panic!("not JSON ({e}): {data}\nin {text}"));
            (kind, v)
        })
        .collect()
}

impl TestApp {
    /// A request at `face` as tenant `key`, with extra headers.
    pub async fn ask(
        &self,
        face: Face,
        key: &str,
        body: &Value,
        headers: &[(&str, &str)],
    ) -> reqwest::Response {
        self.post_json(key, face.path(), body, headers).await
    }
}

/// One way through idem: a face, and the kind of provider behind it (with
/// `responses_api`, an OpenAI provider that takes Responses requests as
/// they are). Same dialect on both sides is native, else translated.
#[derive(Debug, Clone, Copy)]
pub struct Way {
    pub face: Face,
    pub kind: ProviderKind,
    pub responses_api: bool,
}

impl Way {
    /// Starts a gateway of `spec` whose providers (primary and fallback)
    /// are of this way's kind.
    pub async fn start(self, spec: Spec) -> TestApp {
        let spec = Spec {
            primary_kind: self.kind,
            fallback_kind: self.kind,
            ..spec
        };
        // What this way's providers need beside their kind: the Responses
        // API, or Azure's key and API version.
        let keys = match (self.kind, self.responses_api) {
            (_, true) => "responses_api = true\n",
            (ProviderKind::Azure, _) => {
                "api_key_env = \"CARGO_PKG_NAME\"\napi_version = \"2024-06-01\"\n"
            }
            _ => "",
        };
        TestApp::with_config(spec, move |text, _| {
            ["primary", "fallback"].iter().fold(text, |text, name| {
                let table = format!("name = \"{name}\"\n");
                text.replace(&table, &format!("{table}{keys}"))
            })
        })
        .await
    }
}

/// A test that runs once for each face and each kind of provider behind
/// it (OpenAI-compatible, with and without `responses_api`, Anthropic,
/// Azure), native and translated: `mod <name> { fn chat_openai(); ... }`,
/// each calling the body with its [`Way`].
#[allow(unused_macros)]
macro_rules! each_way {
    ($(#[$attr:meta])* async fn $name:ident($way:ident) $body:block) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            use crate::helpers::{Face, Way};
            use idem::config::ProviderKind;

            async fn run($way: Way) $body

            each_way!(@one $(#[$attr])* chat_openai, Face::Chat, ProviderKind::Openai, false);
            each_way!(@one $(#[$attr])* chat_anthropic, Face::Chat, ProviderKind::Anthropic, false);
            each_way!(@one $(#[$attr])* messages_anthropic, Face::Messages, ProviderKind::Anthropic, false);
            each_way!(@one $(#[$attr])* messages_openai, Face::Messages, ProviderKind::Openai, false);
            each_way!(@one $(#[$attr])* responses_responses_api, Face::Responses, ProviderKind::Openai, true);
            each_way!(@one $(#[$attr])* responses_openai, Face::Responses, ProviderKind::Openai, false);
            each_way!(@one $(#[$attr])* responses_anthropic, Face::Responses, ProviderKind::Anthropic, false);
            each_way!(@one $(#[$attr])* chat_azure, Face::Chat, ProviderKind::Azure, false);
            each_way!(@one $(#[$attr])* messages_azure, Face::Messages, ProviderKind::Azure, false);
            each_way!(@one $(#[$attr])* responses_azure, Face::Responses, ProviderKind::Azure, false);
        }
    };
    (@one $(#[$attr:meta])* $test:ident, $face:expr, $kind:expr, $responses_api:expr) => {
        $(#[$attr])*
        async fn $test() {
            run(Way { face: $face, kind: $kind, responses_api: $responses_api }).await
        }
    };
}
#[allow(unused_imports)]
pub(crate) use each_way;
