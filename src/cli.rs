//! What the `idem` subcommands do, so `main` stays a table of calls:
//! logging set-up, which configuration file a command uses, `serve`,
//! `check`, `certify` and `routes`, and their output on standard output.

use std::io::{BufWriter, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;

use tracing_appender::non_blocking::{ErrorCounter, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{Compact, DefaultFields, FmtSpan, Format, Json, JsonFields};
use tracing_subscriber::fmt::{MakeWriter, SubscriberBuilder};

use crate::app::{App, shutdown_signal};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::providers::Providers;
use crate::reqlog::QUEUED_LINES;
use crate::routes::Routes;
use crate::store::Store;

/// Keeps the log writer thread alive (dropping it flushes what is queued)
/// and tells how many lines the writer dropped.
pub struct LogGuard {
    _worker: Option<WorkerGuard>,
    dropped: Option<ErrorCounter>,
}

impl LogGuard {
    /// The writer's count of dropped lines; `None` when another subscriber
    /// was installed first (tests) and this writer is not used.
    pub fn dropped_lines(&self) -> Option<ErrorCounter> {
        self.dropped.clone()
    }
}

/// Installs the global tracing subscriber: `IDEM_LOG` (an `EnvFilter`,
/// default `info`) chooses what is logged, `format` is `json` or `text`.
#[must_use = "dropping the guard stops the log writer"]
pub fn init_logging(format: &str) -> LogGuard {
    init_logging_with(format, true)
}

/// `requests`: whether the per-request lines (`idem::request`) are kept
/// (they are only when `[log] requests = "stdout"`; a file gets its own
/// writer, see [`crate::reqlog`]).
///
/// Lines go to stdout through a writer thread: a request never waits on a
/// slow terminal or pipe (past [`QUEUED_LINES`] queued lines, new lines are
/// dropped, and counted, rather than holding up requests). The thread
/// writes what is queued in one call where it can (a buffer of 64 KiB,
/// flushed whenever the queue runs dry), not one call per line.
#[must_use = "dropping the guard stops the log writer"]
pub fn init_logging_with(format: &str, requests: bool) -> LogGuard {
    let mut filter = EnvFilter::try_from_env("IDEM_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    if !requests && let Ok(d) = "idem::request=off".parse() {
        filter = filter.add_directive(d);
    }
    let (writer, guard) = NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(QUEUED_LINES)
        .thread_name("idem-log")
        .finish(BufWriter::with_capacity(64 * 1024, std::io::stdout()));
    let dropped = writer.error_counter();
    let installed = if format == "json" {
        let installed = json_subscriber(filter, writer.clone()).try_init();
        if installed.is_ok() {
            crate::reqlog::write_json_lines_to(writer);
        }
        installed
    } else {
        text_subscriber(filter, writer, std::io::stdout().is_terminal()).try_init()
    };
    // Only the first subscriber installed in a process keeps its writer.
    match installed {
        Ok(()) => LogGuard {
            _worker: Some(guard),
            dropped: Some(dropped),
        },
        Err(_) => LogGuard {
            _worker: None,
            dropped: None,
        },
    }
}

/// The process log's common settings: the filter, no span events, the
/// writer; each format adds its own.
fn subscriber<W>(
    filter: EnvFilter,
    writer: W,
) -> SubscriberBuilder<DefaultFields, Format, EnvFilter, W>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(FmtSpan::NONE)
        .with_writer(writer)
}

/// The JSON process log: one object per event, its fields flattened
/// beside `timestamp`, `level` and `target`. Request lines take a shorter
/// way to the same writer in the same form
/// ([`crate::reqlog::write_json_lines_to`]); a test holds the two to it.
pub fn json_subscriber<W>(
    filter: EnvFilter,
    writer: W,
) -> SubscriberBuilder<JsonFields, Format<Json>, EnvFilter, W>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    subscriber(filter, writer)
        .json()
        .flatten_event(true)
        .with_current_span(false)
}

/// The text process log (`log.format = "text"`, the default): one line
/// per event, `<timestamp> <LEVEL> <target>: key=value ...`, which
/// `idem analyze` reads back (`analyze::text`).
pub fn text_subscriber<W>(
    filter: EnvFilter,
    writer: W,
    ansi: bool,
) -> SubscriberBuilder<DefaultFields, Format<Compact>, EnvFilter, W>
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    subscriber(filter, writer).with_ansi(ansi).compact()
}

/// The file a command reads when none is named: `idem init` writes it.
pub const LOCAL_CONFIG: &str = "idem.toml";

/// The configuration file of a command: the one named (`--config`,
/// `IDEM_CONFIG`), else `./idem.toml` when it exists, which is then said on
/// standard error; else none, and the command uses the embedded default.
pub fn config_file(named: Option<PathBuf>) -> Option<PathBuf> {
    if named.is_some() {
        return named;
    }
    let local = Path::new(LOCAL_CONFIG);
    if !local.is_file() {
        return None;
    }
    let _ = writeln!(
        std::io::stderr(),
        "idem: using ./{LOCAL_CONFIG} (found in the current folder; --config FILE names another)"
    );
    Some(local.to_path_buf())
}

/// Writes `text` to standard output. An error is a value: a reader that
/// stopped reading (`idem config | head`) gives a `BrokenPipe` error, which
/// `main` ends on quietly ([`is_broken_pipe`]).
pub fn print(text: &str) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// True when `error` comes from writing to a pipe nobody reads any more.
pub fn is_broken_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// `idem hash-key KEY`: the `sha256:` form of the key; `-` reads the key
/// from standard input (one line; its line ending is not part of it), so
/// that it stays out of the shell's history and the process list.
pub fn hash_key(key: &str) -> anyhow::Result<()> {
    let key = if key == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read the key from standard input")?;
        key_from_input(&text)?.to_string()
    } else {
        key.to_string()
    };
    print(&format!("{}\n", crate::tenants::hashed_key(&key)))?;
    Ok(())
}

/// The key in what standard input gave: one line, without its line ending.
fn key_from_input(text: &str) -> anyhow::Result<&str> {
    let key = text
        .strip_suffix("\r\n")
        .or_else(|| text.strip_suffix('\n'))
        .unwrap_or(text);
    if key.is_empty() {
        anyhow::bail!("no key on standard input");
    }
    if key.contains(['\n', '\r']) {
        anyhow::bail!("standard input holds more than one line: give one key");
    }
    Ok(key)
}

/// `idem serve`.
pub async fn serve(path: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    let log = init_logging_with(&config.log.format, config.log.requests == "stdout");
    for warning in config.warnings() {
        tracing::warn!(source = %config.source, "{warning}");
    }
    // A reload reads the same file, with the same environment.
    let path = path.map(Path::to_path_buf);
    let loader = move || Config::load(path.as_deref());
    let app = App::build(config).await?.reload_from(Arc::new(loader));
    if let Some(dropped) = log.dropped_lines() {
        app.state().metrics.watch_log_drops("stdout", dropped);
    }
    app.run(shutdown_signal()).await
}

/// `idem check`: validates a config (and its contracts) and prints its
/// routes; warns about provider keys this environment lacks.
pub fn check(config: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    crate::contracts::load_all(&config)?;
    let mut out = format!("{}: ok\n", config.source);
    for route in &config.routes {
        let targets: Vec<String> = route
            .targets
            .iter()
            .map(|t| format!("{}/{}", t.provider, t.model))
            .collect();
        out.push_str(&format!(
            "  route {:<24} -> {}\n",
            route.model,
            targets.join(", ")
        ));
    }
    print(&out)?;
    let mut err = std::io::stderr().lock();
    for problem in crate::providers::key_problems(&config) {
        let _ = writeln!(
            err,
            "warning: {problem}: `idem serve` would not start in this environment"
        );
    }
    for warning in config.warnings() {
        let _ = writeln!(err, "warning: {warning}");
    }
    Ok(())
}

/// The starter configuration `idem init` writes (its tenant key is drawn
/// at init).
const STARTER: &str = include_str!("starter.toml");

/// `idem init`: writes a commented starter configuration with a fresh
/// tenant key, one that `idem check` passes; never over an existing file
/// unless `force`.
pub fn init(path: &Path, force: bool) -> anyhow::Result<()> {
    use rand::Rng;
    use std::io::Write;
    let key = format!("sk-idem-{}", hex::encode(rand::rng().random::<[u8; 16]>()));
    let text = STARTER.replace("__TENANT_KEY__", &key);
    Config::from_toml_str(&text, crate::config::Source::File(path.into()), false)?;
    let mut open = std::fs::OpenOptions::new();
    open.write(true);
    if force {
        open.create(true).truncate(true);
    } else {
        open.create_new(true);
    }
    // It holds a client key: readable by its owner only.
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut open, 0o600);
    let mut file = open.open(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => anyhow::anyhow!(
            "{} exists; not overwritten (`idem init --force` overwrites it)",
            path.display()
        ),
        _ => anyhow::anyhow!("cannot write {}: {e}", path.display()),
    })?;
    // An existing file overwritten keeps its mode: set it.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    file.write_all(text.as_bytes())?;
    let p = path.display();
    print(&format!(
        "wrote {p}: routes `chat` (OpenAI, then Anthropic) and `embeddings`\n  \
         tenant `default`, API key {key}\n\
         next:\n  export OPENAI_API_KEY=... ANTHROPIC_API_KEY=...\n  \
         idem check --config {p}\n  idem serve --config {p}\n"
    ))?;
    Ok(())
}

/// `idem config`: the effective configuration (the defaults, the file and
/// the `IDEM_*` variables merged) as TOML, its secrets redacted.
pub fn print_config(config: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    let text = toml::to_string(&config.redacted())?;
    print(&format!(
        "# the effective configuration of {}: defaults, the file and IDEM_* variables merged; secrets redacted\n{text}\n",
        config.source
    ))?;
    Ok(())
}

/// `idem certify`: certifies a route's targets against its contract,
/// prints the reports and records them; fails when any target fails.
pub async fn certify(
    config: Option<&Path>,
    route: &str,
    target: Option<&str>,
) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    let (store, routes) = offline(&config).await?;
    let reports =
        crate::certification::certify::certify(&*store, &config, &routes, route, target).await?;
    let text: String = reports.iter().map(|r| r.render_text()).collect();
    print(&text)?;
    let failed: Vec<String> = reports
        .iter()
        .filter(|r| !r.passed)
        .map(|r| format!("{}/{}", r.provider, r.model))
        .collect();
    if failed.is_empty() {
        Ok(())
    } else {
        anyhow::bail!("certification failed for {}", failed.join(", "))
    }
}

/// `idem routes`: every route's targets and their certification state for
/// the current contract hash, as stored.
pub async fn routes(config: Option<&Path>) -> anyhow::Result<()> {
    let mut config = Config::load(config)?;
    // Listing calls no provider, so it needs none of their keys.
    for p in &mut config.providers {
        p.api_key_env = None;
    }
    let (store, routes) = offline(&config).await?;
    crate::certification::registry::refresh(&*store, &routes).await?;
    let text: String = crate::http::admin::routes_view(&routes, false)
        .iter()
        .map(routes_text)
        .collect();
    print(&text)?;
    Ok(())
}

/// The store and the resolved routes (with contracts), without a server.
async fn offline(config: &Config) -> anyhow::Result<(Arc<dyn Store>, Routes)> {
    let store = crate::store::connect(&config.storage.url, config.storage.max_connections)
        .await
        .with_context(|| {
            format!(
                "cannot open storage {}",
                crate::app::redact(&config.storage.url)
            )
        })?;
    let providers = Providers::from_config(config)?;
    let routes = Routes::from_config(config, &providers, &Metrics::new(config))?;
    Ok((store, routes))
}

fn routes_text(r: &serde_json::Value) -> String {
    let s = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_string();
    let mut out = match r["contract"].as_object() {
        Some(c) => format!(
            "route {}: contract {} ({}); failover only to certified targets\n",
            s(&r["route"]),
            s(&c["path"]),
            s(&c["short_hash"])
        ),
        None => format!(
            "route {}: no contract; failover to any target\n",
            s(&r["route"])
        ),
    };
    for t in r["targets"].as_array().into_iter().flatten() {
        let name = format!("{}/{}", s(&t["provider"]), s(&t["model"]));
        let cert = &t["certification"];
        let state = if cert.is_null() {
            String::new()
        } else {
            let st = s(&cert["state"]);
            let at = cert["certified_at"]
                .as_str()
                .map(|a| format!(" at {a}"))
                .unwrap_or_default();
            match st.as_str() {
                "stale" => format!(
                    "stale{at}: certified for another contract ({}), does not count",
                    crate::contracts::short_hash(cert["contract_hash"].as_str().unwrap_or(""))
                ),
                "never" => "never certified".into(),
                _ => format!("{st}{at}"),
            }
        };
        let role = if t["primary"] == true {
            "primary, no certificate needed".to_string()
        } else if t["failover_allowed"] == true {
            "failover allowed".to_string()
        } else {
            "failover blocked".to_string()
        };
        let state = if state.is_empty() {
            String::new()
        } else {
            format!("; {state}")
        };
        let price = match t["price"].as_object() {
            Some(p) => {
                let n = |k: &str| p.get(k).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
                let from = match p.get("as_of").and_then(serde_json::Value::as_str) {
                    Some(date) => format!("built-in, as of {date}"),
                    None => "config".into(),
                };
                format!(
                    "; ${} in / ${} cached / ${} out per Mtok ({from})",
                    n("input_per_mtok"),
                    n("cached_input_per_mtok"),
                    n("output_per_mtok")
                )
            }
            None => "; no price: cost unknown".into(),
        };
        out.push_str(&format!(
            "  [{}] {name:<32} {role}{state}{price}\n",
            t["index"]
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::Mutex;
    use std::time::{Duration, Instant, SystemTime};

    use serde_json::{Map, Value};

    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::reqlog::{Entry, Line};

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn object(bytes: &[u8]) -> Map<String, Value> {
        match serde_json::from_slice(bytes).unwrap() {
            Value::Object(m) => m,
            other => panic!("not an object: {other}"),
        }
    }

    /// The request lines written straight to stdout are what the JSON
    /// formatter would have written for their event: the same keys in the
    /// same order, the same values, the timestamp aside.
    #[test]
    fn a_request_line_written_directly_is_the_formatters_line() {
        let captured = Captured::default();
        let dispatch = tracing::Dispatch::new(
            json_subscriber(EnvFilter::new("info"), {
                let c = captured.clone();
                move || c.clone()
            })
            .finish(),
        );
        let fp = Fingerprint::from_bytes([9; 32]);
        let chat = Entry::new("acme", "bot", &fp, "follower", 200, Instant::now());
        let mut job = Entry::new(
            "acme \"quoted\"\n",
            "bot",
            &fp,
            "created",
            201,
            Instant::now(),
        )
        .job("01J-job", Some(2));
        job.latency = Duration::from_micros(12_345);
        let answer = crate::answer::Answer::test_ok("primary", "gpt-4o-mini");
        let answered = Entry::new("acme", "bot", &fp, "leader", 200, Instant::now())
            .endpoint("messages")
            .answer(Some(&answer))
            .cost(Some(crate::reqlog::Cost::Spent(0.25)));
        for entry in [chat, job, answered] {
            captured.0.lock().unwrap().clear();
            let line = Line::new(&entry, false);
            tracing::dispatcher::with_default(&dispatch, || crate::reqlog::event(&line));
            let formatted = captured.0.lock().unwrap().clone();
            let direct = crate::reqlog::json_event(&line, SystemTime::now()).unwrap();
            assert!(direct.ends_with(b"}\n"));
            let (mut f, mut d) = (object(&formatted), object(&direct));
            for o in [&mut f, &mut d] {
                let t = o.get_mut("timestamp").expect("a timestamp");
                assert!(
                    t.as_str()
                        .is_some_and(|t| t.len() == 27 && t.ends_with('Z')),
                    "{t}"
                );
                *t = Value::Null;
            }
            let keys = |o: &Map<String, Value>| o.keys().cloned().collect::<Vec<_>>();
            assert_eq!(keys(&d), keys(&f));
            assert_eq!(d, f);
        }
    }

    /// `idem init` writes a starter config that passes the checks, with a
    /// fresh key, readable by its owner only, and never over a file unless
    /// forced.
    #[test]
    fn init_writes_a_starter_that_checks_and_keeps_what_exists() {
        let dir = std::env::temp_dir().join(format!("idem-init-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("idem.toml");
        init(&path, false).unwrap();
        let first = std::fs::read_to_string(&path).unwrap();
        let config = Config::load_with_env(Some(&path), false).unwrap();
        assert!(config.warnings().is_empty());
        assert_eq!(config.routes[0].targets.len(), 2, "a route with a fallback");
        let key = &config.tenants[0].api_keys[0];
        assert!(key.starts_with("sk-idem-") && key.len() > 30, "{key}");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let err = init(&path, false).unwrap_err().to_string();
        assert!(err.contains("exists") && err.contains("--force"), "{err}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), first);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        }
        init(&path, true).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "forced over a 0644 file");
        }
        let again = Config::load_with_env(Some(&path), false).unwrap();
        assert_ne!(
            &again.tenants[0].api_keys[0], key,
            "each init draws its key"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `idem config` shows the merged configuration, which loads back as
    /// the same configuration, without its secrets.
    #[test]
    fn the_effective_config_loads_back_without_its_secrets() {
        let text = STARTER.replace("__TENANT_KEY__", "sk-tenant-secret-1")
            + &format!(
                "[admin]\napi_keys = [\"sk-admin-secret-1\", \"sha256:{}\"]\n",
                "ab".repeat(32)
            );
        let text = text.replace(
            "url = \"sqlite://idem.db\"",
            "url = \"postgres://idem:db-secret@127.0.0.1:5432/idem\"",
        );
        let config = Config::from_toml_str(&text, crate::config::Source::Embedded, false).unwrap();
        let shown = toml::to_string(&config.redacted()).unwrap();
        for secret in ["sk-tenant-secret-1", "sk-admin-secret-1", "db-secret"] {
            assert!(!shown.contains(secret), "{secret} shown:\n{shown}");
        }
        assert!(
            shown.contains(&format!("sha256:{}", "ab".repeat(32))),
            "{shown}"
        );
        let back = Config::from_toml_str(&shown, crate::config::Source::Embedded, false).unwrap();
        assert_eq!(back.routes.len(), config.routes.len());
        assert_eq!(back.server.request_timeout, config.server.request_timeout);
        assert_eq!(
            toml::to_string(&back).unwrap(),
            shown,
            "what is shown loads back as itself"
        );
    }
}

/// `idem keys`: the store's API keys, managed without a server (the
/// gateways in service see a change within `budgets.keys_refresh`).
#[derive(Debug, clap::Args)]
pub struct KeysArgs {
    #[command(subcommand)]
    pub action: KeysAction,
    #[arg(long, env = "IDEM_CONFIG", global = true)]
    pub config: Option<PathBuf>,
}

/// A key's fields, as flags (each maps to the admin API's JSON field of
/// the same name, docs/http-api.md, "Keys").
#[derive(Debug, Default, clap::Args)]
pub struct KeyFlags {
    #[arg(long)]
    pub name: Option<String>,
    /// Dollars per period (none: no budget).
    #[arg(long)]
    pub budget_usd: Option<f64>,
    /// 1d, 7d or 30d (none: the budget never starts again).
    #[arg(long)]
    pub budget_period: Option<String>,
    /// Requests per minute.
    #[arg(long)]
    pub rpm: Option<i64>,
    /// Tokens per minute.
    #[arg(long)]
    pub tpm: Option<i64>,
    /// The models (routes) the key may use, comma-separated (none: all).
    #[arg(long, value_delimiter = ',')]
    pub models: Option<Vec<String>>,
    /// A duration from now (30d, 12h).
    #[arg(long)]
    pub expires_in: Option<String>,
    /// An RFC 3339 time.
    #[arg(long)]
    pub expires_at: Option<String>,
    /// A JSON object.
    #[arg(long)]
    pub metadata: Option<String>,
    /// Fields to clear (budget_usd, budget_period, rpm, tpm, models,
    /// expires_at, metadata), comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub clear: Vec<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum KeysAction {
    /// Make a key for a tenant; its secret is printed this once.
    Create {
        #[arg(long)]
        tenant: String,
        #[command(flatten)]
        fields: KeyFlags,
    },
    /// Every key (revoked ones too), or one tenant's.
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    /// One key, with its budget and spend.
    Show { id: String },
    /// Change a key's limits, budget, allowlist, expiry or metadata.
    Update {
        id: String,
        #[command(flatten)]
        fields: KeyFlags,
    },
    /// Revoke a key: no gateway admits it any more.
    Revoke { id: String },
    /// A new secret for a key (printed this once); its spend and history
    /// stay.
    Rotate { id: String },
    /// Who changed a key, when, and what.
    Audit { id: String },
}

impl KeyFlags {
    /// The admin API's JSON object these flags say.
    fn spec(&self) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
        use serde_json::{Value, json};
        let mut m = serde_json::Map::new();
        let mut put = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                m.insert(k.to_string(), v);
            }
        };
        put("name", self.name.as_ref().map(|v| json!(v)));
        put("budget_usd", self.budget_usd.map(|v| json!(v)));
        put(
            "budget_period",
            self.budget_period.as_ref().map(|v| json!(v)),
        );
        put("rpm", self.rpm.map(|v| json!(v)));
        put("tpm", self.tpm.map(|v| json!(v)));
        put("models", self.models.as_ref().map(|v| json!(v)));
        put("expires_in", self.expires_in.as_ref().map(|v| json!(v)));
        put("expires_at", self.expires_at.as_ref().map(|v| json!(v)));
        if let Some(text) = &self.metadata {
            let v: Value = serde_json::from_str(text).context("--metadata: expected JSON")?;
            m.insert("metadata".into(), v);
        }
        for field in &self.clear {
            if m.contains_key(field.as_str()) {
                anyhow::bail!("--clear {field}: the field is also set");
            }
            m.insert(field.clone(), Value::Null);
        }
        Ok(m)
    }
}

/// `idem keys ...`.
pub async fn keys(args: KeysArgs) -> anyhow::Result<()> {
    use crate::keys::manage;
    let config = Config::load(config_file(args.config).as_deref())?;
    let store = crate::store::connect(&config.storage.url, config.storage.max_connections)
        .await
        .with_context(|| {
            format!(
                "cannot open storage {}",
                crate::app::redact(&config.storage.url)
            )
        })?;
    let actor = format!(
        "cli ({})",
        std::env::var("USER").unwrap_or_else(|_| "unknown user".into())
    );
    let now = crate::store::now_ms();
    let view = |k: &crate::store::KeyRecord| {
        let store = store.clone();
        let k = k.clone();
        async move {
            let budget = store.budget(&format!("key:{}", k.id), now).await?;
            anyhow::Ok(manage::view(&k, budget.as_ref(), now))
        }
    };
    let shown_once = "the key's secret is printed this once: keep it now";
    let out = match args.action {
        KeysAction::Create { tenant, fields } => {
            let mut spec = fields.spec()?;
            spec.insert("tenant".into(), serde_json::json!(tenant));
            let (key, secret) = manage::create(&*store, &spec, &actor).await?;
            let mut v = view(&key).await?;
            v["key"] = serde_json::json!(secret);
            eprintln!("{shown_once}");
            v
        }
        KeysAction::List { tenant } => {
            let keys = store.keys(tenant.as_deref()).await?;
            let budgets = store.budgets(now).await?;
            let data: Vec<serde_json::Value> = keys
                .iter()
                .map(|k| {
                    let scope = format!("key:{}", k.id);
                    manage::view(k, budgets.iter().find(|b| b.scope == scope), now)
                })
                .collect();
            serde_json::json!({"object": "list", "data": data})
        }
        KeysAction::Show { id } => {
            let key = store
                .key(&id)
                .await?
                .with_context(|| format!("no key {id}"))?;
            view(&key).await?
        }
        KeysAction::Update { id, fields } => {
            let key = manage::update(&*store, &id, &fields.spec()?, &actor).await?;
            view(&key).await?
        }
        KeysAction::Revoke { id } => view(&manage::revoke(&*store, &id, &actor).await?).await?,
        KeysAction::Rotate { id } => {
            let (key, secret) = manage::rotate(&*store, &id, &actor).await?;
            let mut v = view(&key).await?;
            v["key"] = serde_json::json!(secret);
            eprintln!("{shown_once}");
            v
        }
        KeysAction::Audit { id } => {
            let entries = store.audit_log(Some(&id), 1000).await?;
            let data: Vec<serde_json::Value> = entries
                .iter()
                .map(|e| {
                    serde_json::json!({
                        "at": crate::store::rfc3339(e.at),
                        "actor": e.actor,
                        "action": e.action,
                        "change": serde_json::from_str::<serde_json::Value>(&e.detail)
                            .unwrap_or(serde_json::Value::Null),
                    })
                })
                .collect();
            serde_json::json!({"object": "list", "data": data})
        }
    };
    print(&format!("{}\n", serde_json::to_string_pretty(&out)?))?;
    Ok(())
}
