//! Configuration: the TOML file of SPEC section 8, `IDEM_...__...` environment
//! overrides, the embedded default, and start-up validation.
//!
//! Loading is two steps. [`figment`] merges the file (or the embedded default)
//! with the environment and deserializes with `deny_unknown_fields`, so a typo
//! in a key is an error that names the key and the file. [`Config::validate`]
//! then checks what types cannot: each section, in a file of its own, checks
//! its ranges and forms, and this module what spans sections: references
//! between them, and that tenant keys are unambiguous. Everything after
//! start-up reads the validated [`Config`] through an `Arc` and never
//! re-parses it.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use serde::{Deserialize, Serialize};

mod admin;
mod breaker;
mod coalescing;
mod contracts;
mod jobs;
mod log;
mod providers;
mod routes;
mod server;
mod storage;
mod tenants;

pub use admin::AdminConfig;
pub use breaker::BreakerConfig;
pub use coalescing::{CoalescingConfig, SharedBackend};
pub use contracts::ContractsConfig;
pub use jobs::JobsConfig;
pub use log::LogConfig;
pub use providers::{ProviderConfig, ProviderKind, chat_url};
pub use routes::{
    MaxWait, Normalize, OnWaitTimeout, RouteAttempts, RouteCache, RouteCoalesce, RouteConfig,
    Scope, TargetConfig,
};
pub use server::{MaxConnections, ServerConfig};
pub use storage::StorageConfig;
pub use tenants::{RateLimitConfig, TenantConfig};

/// The configuration used when no file is given (SPEC section 8).
pub const EMBEDDED_DEFAULT: &str = include_str!("../default.toml");

/// Where the configuration came from, for error messages and the start-up log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    File(PathBuf),
    Embedded,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Embedded => f.write_str("<embedded default>"),
        }
    }
}

impl Source {
    /// The error for the value at `key` in this source: `message` says
    /// what is wrong with it.
    fn invalid(&self, key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            source_name: self.to_string(),
            key: key.into(),
            message: message.into(),
        }
    }
}

/// A configuration that could not be loaded; the message names the file and
/// the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{source_name}: {message}")]
    Parse {
        source_name: String,
        message: String,
    },
    #[error("{source_name}: `{key}`: {message}")]
    Invalid {
        source_name: String,
        key: String,
        message: String,
    },
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub storage: StorageConfig,
    #[serde(default)]
    pub coalescing: CoalescingConfig,
    #[serde(default)]
    pub admin: AdminConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub jobs: JobsConfig,
    #[serde(default)]
    pub breaker: BreakerConfig,
    #[serde(default)]
    pub contracts: ContractsConfig,
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    #[serde(default)]
    pub providers: Vec<ProviderConfig>,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// Where this configuration came from (not a TOML key).
    #[serde(skip, default = "embedded_source")]
    pub source: Source,
}

fn embedded_source() -> Source {
    Source::Embedded
}

impl Config {
    /// Loads the file at `path`, or the embedded default when `path` is
    /// `None`, then applies `IDEM_...__...` environment overrides and
    /// validates.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        Self::load_with_env(path, true)
    }

    /// Like [`Config::load`], with the environment overrides optional (tests
    /// run in one process and must not see each other's variables).
    pub fn load_with_env(path: Option<&Path>, use_env: bool) -> Result<Config, ConfigError> {
        let (source, text) = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| ConfigError::Read {
                    path: p.display().to_string(),
                    source: e,
                })?;
                (Source::File(p.to_path_buf()), text)
            }
            None => (Source::Embedded, embedded_default_text()),
        };
        Self::from_toml_str(&text, source, use_env)
    }

    /// Parses a TOML document (plus environment overrides when `use_env`)
    /// and validates it.
    pub fn from_toml_str(text: &str, source: Source, use_env: bool) -> Result<Config, ConfigError> {
        let mut fig = Figment::new().merge(Toml::string(text));
        if use_env {
            fig = fig.merge(env_overrides());
        }
        let mut config: Config = fig.extract().map_err(|e| ConfigError::Parse {
            source_name: source.to_string(),
            message: describe_figment_error(e),
        })?;
        config.source = source;
        config.resolve_relative_paths();
        config.validate()?;
        Ok(config)
    }

    /// Contract paths are relative to the config file's folder.
    fn resolve_relative_paths(&mut self) {
        let Source::File(file) = &self.source else {
            return;
        };
        let Some(dir) = file.parent() else { return };
        for route in &mut self.routes {
            if let Some(c) = &route.contract
                && c.is_relative()
            {
                route.contract = Some(dir.join(c));
            }
        }
    }

    fn invalid(&self, key: impl Into<String>, message: impl Into<String>) -> ConfigError {
        self.source.invalid(key, message)
    }

    /// Start-up checks that types cannot express. Each error names the key.
    ///
    /// Each section checks itself; what concerns several sections is checked
    /// here, between them, so that of several errors the same one always
    /// comes first.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let source = &self.source;
        self.server.validate(source)?;
        let listen = self.listen_addr()?;
        if self.tenants.is_empty() && !listen.ip().is_loopback() && !self.server.allow_anonymous {
            return Err(self.invalid(
                "tenants",
                "no [[tenants]] configured and server.listen is not a loopback address: \
                 everybody could use this gateway; add tenants or set server.allow_anonymous = true",
            ));
        }
        self.storage.validate(source)?;
        self.coalescing.validate(source)?;
        self.jobs.validate(source)?;
        self.breaker.validate("breaker", source)?;
        self.contracts.validate(source)?;
        self.log.validate(source)?;
        self.admin.validate(source)?;

        // A key names one caller: no two tenants share one, nor a tenant and
        // the admin.
        let mut keys: HashSet<&str> = self.admin.api_keys.iter().map(String::as_str).collect();
        let mut tenant_names = HashSet::new();
        for (t, tenant) in self.tenants.iter().enumerate() {
            let claim = |k: String, key| {
                if keys.insert(key) {
                    return Ok(());
                }
                Err(self.invalid(k, "this key is already used by another tenant or the admin"))
            };
            tenant.validate(t, &mut tenant_names, claim, source)?;
        }

        let mut provider_names = HashSet::new();
        for (p, provider) in self.providers.iter().enumerate() {
            provider.validate(p, &mut provider_names, source)?;
        }

        // Every target of a route names a provider that exists.
        let known_provider = |k: String, provider: &str| {
            if provider_names.contains(provider) {
                return Ok(());
            }
            let known: Vec<&str> = self.providers.iter().map(|p| p.name.as_str()).collect();
            Err(self.invalid(
                k,
                format!(
                    "unknown provider \"{}\" (known: {})",
                    provider,
                    known.join(", ")
                ),
            ))
        };
        let mut route_names = HashSet::new();
        for (r, route) in self.routes.iter().enumerate() {
            route.validate(r, &mut route_names, known_provider, source)?;
        }
        Ok(())
    }

    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.server
            .listen
            .parse()
            .map_err(|e| self.invalid("server.listen", format!("not an address: {e}")))
    }

    pub fn provider(&self, name: &str) -> Option<&ProviderConfig> {
        self.providers.iter().find(|p| p.name == name)
    }

    /// The breaker settings of a provider: its own, else `[breaker]`.
    pub fn breaker_for(&self, provider: &str) -> BreakerConfig {
        self.provider(provider)
            .and_then(|p| p.breaker)
            .unwrap_or(self.breaker)
    }
}

/// The rule of tenant and provider names, as [`valid_name`] checks it.
const NAME_RULE: &str = "names are 1..64 characters of [A-Za-z0-9._-]";

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

/// `IDEM_SERVER__LISTEN=...` sets `server.listen`. Only names with a `__`
/// are config keys (every key lives in a section), so `IDEM_CONFIG`,
/// `IDEM_LOG` or a provider key named `IDEM_PRIMARY_KEY` never collide
/// with the configuration.
fn env_overrides() -> Env {
    Env::prefixed("IDEM_")
        .filter(|k| k.as_str().contains("__"))
        .split("__")
}

/// The embedded default, plus an OpenAI provider and routes when
/// `OPENAI_API_KEY` is set.
fn embedded_default_text() -> String {
    let mut text = EMBEDDED_DEFAULT.to_string();
    if std::env::var_os("OPENAI_API_KEY").is_some() {
        text.push_str(OPENAI_DEFAULT);
    }
    text
}

const OPENAI_DEFAULT: &str = r#"
[[providers]]
name = "openai"
kind = "openai"
base_url = "https://api.openai.com/v1"
api_key_env = "OPENAI_API_KEY"
timeout = "60s"

[[routes]]
model = "gpt-4o-mini"
targets = [{ provider = "openai", model = "gpt-4o-mini" }]

[[routes]]
model = "gpt-4o"
targets = [{ provider = "openai", model = "gpt-4o" }]
"#;

/// Figment's messages name the key and the source; keep them, on one line.
fn describe_figment_error(e: figment::Error) -> String {
    e.into_iter()
        .map(|err| {
            let key = if err.path.is_empty() {
                String::new()
            } else {
                format!("`{}`: ", err.path.join("."))
            };
            let from = match &err.metadata {
                Some(m) if m.name.contains("environment") => format!(" (from {})", m.name),
                _ => String::new(),
            };
            format!("{key}{}{from}", err.kind)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_chat_url_is_joined_once_whatever_the_trailing_slash() {
        for base in ["http://127.0.0.1:9001/v1", "http://127.0.0.1:9001/v1/"] {
            let url = chat_url(base).unwrap();
            assert_eq!(url.as_str(), "http://127.0.0.1:9001/v1/chat/completions");
        }
        let err = chat_url("http://exa mple.com").unwrap_err();
        assert!(err.contains("not a URL"), "{err}");
        let err = chat_url("file:///v1").unwrap_err();
        assert!(err.contains("http:// or https://"), "{err}");
    }

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(text, Source::File("test.toml".into()), false)
    }

    #[test]
    fn embedded_default_is_valid() {
        let c = Config::from_toml_str(EMBEDDED_DEFAULT, Source::Embedded, false).unwrap();
        assert_eq!(c.server.listen, "127.0.0.1:8080");
        assert_eq!(c.storage.url, "sqlite://idem.db");
        assert_eq!(c.coalescing.backend, "memory");
        assert!(c.routes.iter().any(|r| r.model == "mock"));
    }

    #[test]
    fn spec_example_parses() {
        let text = r#"
[server]
listen = "127.0.0.1:8080"
request_timeout = "120s"
max_body_bytes = 8388608
[storage]
url = "sqlite://idem.db"
idempotency_retention = "24h"
[coalescing]
backend = "memory"
[admin]
api_keys = ["admin-key-1"]
[[tenants]]
name = "acme"
api_keys = ["sk-acme-1"]
[[providers]]
name = "primary"
kind = "openai"
base_url = "http://127.0.0.1:9001/v1"
api_key_env = "PRIMARY_API_KEY"
timeout = "30s"
[[providers]]
name = "fallback"
kind = "openai"
base_url = "http://127.0.0.1:9002/v1"
[[routes]]
model = "support-bot"
targets = [ { provider = "primary", model = "gpt-4o-mini" },
            { provider = "fallback", model = "llama-3.1-8b" } ]
normalize = "none"
scope = "tenant"
[routes.cache]
enabled = true
ttl = "30s"
jitter = 0.15
[routes.coalesce]
enabled = true
max_wait = "auto"
on_wait_timeout = "fail"
[routes.attempts]
max = 3
timeout = "30s"
hedge_after = "10s"
"#;
        let c = parse(text).unwrap();
        let r = &c.routes[0];
        assert_eq!(r.targets.len(), 2);
        assert_eq!(r.coalesce.max_wait, MaxWait::Auto);
        assert_eq!(r.attempts.hedge_after, Some(Duration::from_secs(10)));
        assert_eq!(c.storage.idempotency_retention, Duration::from_secs(86400));
    }

    #[test]
    fn unknown_key_is_named() {
        let err = parse("[server]\nlisten = \"127.0.0.1:1\"\nlisen = 3\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("test.toml"), "{err}");
        assert!(err.contains("lisen"), "{err}");
    }

    #[test]
    fn unknown_provider_names_the_route_key() {
        let text = r#"
[[providers]]
name = "primary"
kind = "mock"
[[routes]]
model = "m"
targets = [{ provider = "primray", model = "x" }]
"#;
        let err = parse(text).unwrap_err().to_string();
        assert!(err.contains("routes[0].targets[0].provider"), "{err}");
        assert!(err.contains("test.toml"), "{err}");
    }

    #[test]
    fn open_gateway_on_public_address_is_refused() {
        let err = parse("[server]\nlisten = \"0.0.0.0:8080\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("tenants"), "{err}");
    }

    #[test]
    fn an_openai_base_url_must_parse_as_an_http_url() {
        let with = |url: &str| {
            parse(&format!(
                "[[providers]]\nname = \"p\"\nkind = \"openai\"\nbase_url = \"{url}\"\n[[routes]]\nmodel = \"m\"\ntargets = [{{ provider = \"p\", model = \"x\" }}]\n"
            ))
        };
        for bad in [
            "",
            "api.example.com/v1",
            "ftp://example.com/v1",
            "http://exa mple.com/v1",
            "http://[::1/v1",
        ] {
            let err = with(bad).unwrap_err().to_string();
            assert!(err.contains("providers[0].base_url"), "{bad:?}: {err}");
        }
        for good in ["http://127.0.0.1:9001/v1", "https://api.example.com/v1/"] {
            assert!(with(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn bad_duration_names_the_key() {
        let text = "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\nmodel = \"m\"\ntargets = [{ provider = \"p\", model = \"x\" }]\n[routes.cache]\nttl = \"soon\"\n";
        let err = parse(text).unwrap_err().to_string();
        assert!(err.contains("ttl"), "{err}");
    }

    #[test]
    fn breaker_contracts_and_context_window_keys() {
        let text = r#"
[breaker]
failures = 2
cooldown = "5s"
[contracts]
refresh_interval = "1s"
[[providers]]
name = "a"
kind = "mock"
context_window = 4096
[providers.breaker]
failures = 7
cooldown = "1m"
[[providers]]
name = "b"
kind = "mock"
[[routes]]
model = "m"
targets = [{ provider = "a", model = "x", context_window = 1024 }, { provider = "b", model = "y" }]
"#;
        let c = parse(text).unwrap();
        assert_eq!(c.breaker_for("a").failures, 7);
        assert_eq!(c.breaker_for("b").cooldown, Duration::from_secs(5));
        assert_eq!(c.contracts.refresh_interval, Duration::from_secs(1));
        assert_eq!(c.providers[0].context_window, Some(4096));
        assert_eq!(c.routes[0].targets[0].context_window, Some(1024));
        let err = parse("[breaker]\nfailures = 3\ncooldown = \"0s\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("breaker.cooldown"), "{err}");
        let err = parse(&text.replace("context_window = 1024", "context_window = 0"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("routes[0].targets[0].context_window"), "{err}");
    }

    #[test]
    fn answer_and_cache_byte_limits_have_defaults_and_must_be_above_zero() {
        let text = "[[providers]]\nname = \"a\"\nkind = \"mock\"\n\
                    [[providers]]\nname = \"b\"\nkind = \"mock\"\nmax_answer_bytes = 65536\n";
        let c = parse(text).unwrap();
        assert_eq!(c.providers[0].max_answer_bytes, 8 * 1024 * 1024);
        assert_eq!(c.providers[1].max_answer_bytes, 65536);
        assert_eq!(c.coalescing.cache_max_bytes, 256 * 1024 * 1024);
        let err = parse(&text.replace("65536", "0")).unwrap_err().to_string();
        assert!(err.contains("providers[1].max_answer_bytes"), "{err}");
        let c = parse("[coalescing]\ncache_max_bytes = 1048576\n").unwrap();
        assert_eq!(c.coalescing.cache_max_bytes, 1048576);
        let err = parse("[coalescing]\ncache_max_bytes = 0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("coalescing.cache_max_bytes"), "{err}");
    }

    #[test]
    fn a_late_window_that_could_hear_nothing_is_refused_naming_both_keys() {
        let route = |attempts: &str| {
            format!(
                "[[providers]]\nname = \"p\"\nkind = \"mock\"\ntimeout = \"30s\"\n\
                 [[routes]]\nmodel = \"m\"\ntargets = [{{ provider = \"p\", model = \"x\" }}]\n\
                 [routes.attempts]\n{attempts}\n"
            )
        };
        // The defaults listen for ten minutes past a 30 s attempt timeout,
        // whatever the provider's own timeout.
        let c = parse(&route("")).unwrap();
        let a = &c.routes[0].attempts;
        assert!(a.late_result_window > a.timeout);
        for dead in [
            "timeout = \"10m\"",
            "timeout = \"20m\"",
            "timeout = \"5s\"\nlate_result_window = \"5s\"",
            "late_result_window = \"0s\"",
        ] {
            let err = parse(&route(dead)).unwrap_err().to_string();
            assert!(
                err.contains("routes[0].attempts.late_result_window")
                    && err.contains("routes[0].attempts.timeout"),
                "{dead}: {err}"
            );
        }
        assert!(parse(&route("timeout = \"5s\"\nlate_result_window = \"6s\"")).is_ok());
    }

    #[test]
    fn body_timeout_and_max_connections_parse_and_are_checked() {
        let c = parse("").unwrap();
        assert_eq!(c.server.body_timeout, Duration::from_secs(30));
        assert_eq!(c.server.max_connections, MaxConnections::Auto);
        let c = parse("[server]\nbody_timeout = \"500ms\"\nmax_connections = 3\n").unwrap();
        assert_eq!(c.server.body_timeout, Duration::from_millis(500));
        assert_eq!(c.server.max_connections, MaxConnections::Fixed(3));
        let c = parse("[server]\nmax_connections = \"auto\"\n").unwrap();
        assert_eq!(c.server.max_connections, MaxConnections::Auto);
        // As an environment override may give it.
        let c = parse("[server]\nmax_connections = \"250\"\n").unwrap();
        assert_eq!(c.server.max_connections, MaxConnections::Fixed(250));
        for (text, key) in [
            ("body_timeout = \"0s\"", "server.body_timeout"),
            ("max_connections = 0", "server.max_connections"),
            ("max_connections = -1", "max_connections"),
            ("max_connections = \"many\"", "max_connections"),
            ("max_connections = 100000000", "server.max_connections"),
        ] {
            let err = parse(&format!("[server]\n{text}\n"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
    }

    #[test]
    fn duplicate_keys_across_tenants_are_refused() {
        let text = "[[tenants]]\nname = \"a\"\napi_keys = [\"sk-same-key\"]\n[[tenants]]\nname = \"b\"\napi_keys = [\"sk-same-key\"]\n";
        let err = parse(text).unwrap_err().to_string();
        assert!(err.contains("tenants[1].api_keys[0]"), "{err}");
    }

    #[test]
    fn the_coalescing_backend_is_memory_one_redis_or_a_cluster() {
        let backend = |b: &str| {
            parse(&format!("[coalescing]\nbackend = \"{b}\"\n"))
                .map(|c| c.coalescing.shared_backend().unwrap())
        };
        assert_eq!(backend("memory").unwrap(), SharedBackend::Memory);
        assert_eq!(
            backend("redis://127.0.0.1:6379/2").unwrap(),
            SharedBackend::Redis("redis://127.0.0.1:6379/2".into())
        );
        assert_eq!(
            backend("redis+cluster://127.0.0.1:7000,redis-b:7001,[::1]:7002/").unwrap(),
            SharedBackend::RedisCluster(vec![
                "redis://127.0.0.1:7000".into(),
                "redis://redis-b:7001".into(),
                "redis://[::1]:7002".into(),
            ])
        );
        // The credentials reach every seed node.
        assert_eq!(
            backend("redis+cluster://idem:s%40cret@a:7000,b:7000").unwrap(),
            SharedBackend::RedisCluster(vec![
                "redis://idem:s%40cret@a:7000".into(),
                "redis://idem:s%40cret@b:7000".into(),
            ])
        );
        for bad in [
            "redis+cluster://",
            "redis+cluster://a:7000,",
            "redis+cluster://a",
            "redis+cluster://a:0",
            "redis+cluster://a:70000",
            "redis+cluster://::1:7000",
            "redis+cluster://a:7000,b:7000/1",
            "redis+cluster://a:7000?protocol=3",
            "redis-cluster://a:7000",
            "cluster://a:7000",
            "",
        ] {
            let err = backend(bad).unwrap_err().to_string();
            assert!(err.contains("`coalescing.backend`"), "{bad}: {err}");
        }
        let err = backend("redis+cluster://a:7000,b").unwrap_err().to_string();
        assert!(err.contains("\"b\" is not host:port"), "{err}");
    }
}
