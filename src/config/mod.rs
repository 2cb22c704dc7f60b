//! Configuration: the TOML file (docs/configuration.md), `IDEM_...__...` environment
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
mod batches;
mod breaker;
mod budgets;
mod coalescing;
mod contracts;
mod jobs;
mod log;
mod place;
mod providers;
mod responses;
mod routes;
mod server;
mod storage;
mod telemetry;
mod tenants;

pub use admin::AdminConfig;
pub use batches::BatchesConfig;
pub use breaker::BreakerConfig;
pub use budgets::{BudgetsConfig, Unpriced};
pub use coalescing::{CoalescingConfig, SharedBackend};
pub use contracts::ContractsConfig;
pub use jobs::JobsConfig;
pub use log::LogConfig;
pub use providers::{
    ANTHROPIC_BASE_URL, ANTHROPIC_VERSION, AZURE_API_VERSION, ProviderConfig, ProviderKind,
    chat_url,
};
pub use responses::ResponsesConfig;
pub use routes::{
    MODEL_PLACEHOLDER, MaxWait, Normalize, OnWaitTimeout, PriceConfig, RouteAttempts, RouteCache,
    RouteCoalesce, RouteConfig, RouteEndpoint, Scope, TargetConfig,
};
pub use server::{MaxConnections, ServerConfig};
pub use storage::StorageConfig;
pub use telemetry::TelemetryConfig;
pub use tenants::{RateLimitConfig, TenantConfig, hashed_key};

/// The configuration used when no file is given (docs/configuration.md).
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

/// What [`Config::redacted`] writes in place of a secret.
pub const REDACTED: &str = "<redacted>";

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
    /// The cause is in the message, not a `source` of its own, so that a
    /// report that walks the chain says it once.
    #[error("cannot read config file {path}: {error}")]
    Read { path: String, error: std::io::Error },
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
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub responses: ResponsesConfig,
    #[serde(default)]
    pub budgets: BudgetsConfig,
    #[serde(default)]
    pub batches: BatchesConfig,
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
                let text = std::fs::read_to_string(p).map_err(|error| ConfigError::Read {
                    path: p.display().to_string(),
                    error,
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
            message: describe_figment_error(e, text, &source, use_env),
        })?;
        config.source = source;
        config.resolve_relative_paths();
        config
            .validate()
            .map_err(|e| e.placed(text, &config.source, use_env))?;
        Ok(config)
    }

    /// The configuration with its secrets replaced, to be shown: client
    /// keys by their `sha256:` forms (which admit the same clients, so
    /// that what is shown loads back as the same configuration) and the
    /// passwords in storage and Redis URLs by a marker. Provider keys are
    /// never here, only the names of the variables that hold them.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        let hide = |keys: &mut Vec<String>| {
            for k in keys.iter_mut() {
                if !k.starts_with("sha256:") {
                    *k = hashed_key(k);
                }
            }
        };
        hide(&mut c.admin.api_keys);
        for t in &mut c.tenants {
            hide(&mut t.api_keys);
        }
        c.storage.url = place::without_password(&c.storage.url);
        c.coalescing.backend = place::without_password(&c.coalescing.backend);
        c
    }

    /// What is valid but probably not meant, for `idem check` and the
    /// start-up log.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.routes.is_empty() {
            out.push(
                "the config has no [[routes]]: every request will be answered 404 \
                 (`idem init` writes a starter config)"
                    .to_string(),
            );
        }
        out
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
        // Serving everybody without a key must be a choice, not an omission.
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
        self.telemetry.validate(source)?;
        self.log.validate(source)?;
        self.responses.validate(source)?;
        self.budgets.validate(source)?;
        self.batches
            .validate(self.jobs.workers, &self.storage.url, source)?;
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
            // Anthropic's API embeds nothing.
            if route.endpoints.contains(&RouteEndpoint::Embeddings)
                && let Some((i, t)) = route.targets.iter().enumerate().find(|(_, t)| {
                    self.provider(&t.provider)
                        .is_some_and(|p| p.kind == ProviderKind::Anthropic)
                })
            {
                return Err(self.invalid(
                    format!("routes[{r}].targets[{i}].provider"),
                    format!(
                        "provider \"{}\" is kind anthropic, which has no embeddings API, and this route serves embeddings",
                        t.provider
                    ),
                ));
            }
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

    /// Whether two settings are the same (as they would be written out).
    pub fn same<T: Serialize>(a: &T, b: &T) -> bool {
        match (serde_json::to_value(a), serde_json::to_value(b)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }

    /// The breaker settings of a provider: its own, else `[breaker]`.
    pub fn breaker_for(&self, provider: &str) -> BreakerConfig {
        self.provider(provider)
            .and_then(|p| p.breaker)
            .unwrap_or(self.breaker)
    }
}

/// The rule of tenant and provider names, as [`valid_name`] checks it.
pub const NAME_RULE: &str = "names are 1..64 characters of [A-Za-z0-9._-]";

pub fn valid_name(name: &str) -> bool {
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

[[routes]]
model = "text-embedding-3-small"
endpoints = ["embeddings"]
targets = [{ provider = "openai", model = "text-embedding-3-small" }]
"#;

/// Figment's messages, one per problem, on one line: each names its key
/// as idem writes keys, where it was set (the environment variable, or the
/// line and column in the file), a "did you mean" for a misspelt key and
/// the accepted form of a duration.
fn describe_figment_error(e: figment::Error, text: &str, source: &Source, use_env: bool) -> String {
    use figment::error::Kind;
    e.into_iter()
        .map(|err| {
            let key = place::key_path(&err.path);
            let from_env = err
                .metadata
                .as_ref()
                .is_some_and(|m| m.name.contains("environment"));
            let at = if from_env && use_env {
                place::env_override(&key).map(|v| format!("{v}: "))
            } else {
                place_in_file(text, source, &key).map(|p| format!("{p}: "))
            };
            let key = if key.is_empty() {
                String::new()
            } else {
                format!("`{key}`: ")
            };
            let message = match &err.kind {
                Kind::UnknownField(field, expected) => {
                    let hint = place::did_you_mean(field, expected)
                        .map(|m| format!("; did you mean `{m}`?"))
                        .unwrap_or_default();
                    format!(
                        "unknown key `{field}`{hint} (the keys here: {})",
                        expected.join(", ")
                    )
                }
                Kind::InvalidType(actual, expected) | Kind::InvalidValue(actual, expected)
                    if expected == "a duration" =>
                {
                    format!("found {actual}, expected {}", place::DURATION_FORMS)
                }
                // A key written where it does not belong is still a key:
                // not repeated in the message.
                Kind::InvalidType(_, expected) | Kind::InvalidValue(_, expected)
                    if key.contains("api_keys") =>
                {
                    format!("expected {expected}")
                }
                kind => kind.to_string(),
            };
            format!("{}{key}{message}", at.unwrap_or_default())
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `line L, column C` of `key` in a config file's text.
fn place_in_file(text: &str, source: &Source, key: &str) -> Option<String> {
    if !matches!(source, Source::File(_)) || key.is_empty() {
        return None;
    }
    let (line, col) = place::locate(text, key)?;
    Some(format!("line {line}, column {col}"))
}

impl ConfigError {
    /// A check's error, placed: blamed on the environment variable that
    /// set its key, else given the key's line and column in the file.
    fn placed(self, text: &str, source: &Source, use_env: bool) -> ConfigError {
        match self {
            ConfigError::Invalid {
                source_name,
                key,
                message,
            } => {
                let source_name = match use_env.then(|| place::env_override(&key)).flatten() {
                    Some(var) => var,
                    None => match place_in_file(text, source, &key) {
                        Some(at) => format!("{source_name}: {at}"),
                        None => source_name,
                    },
                };
                ConfigError::Invalid {
                    source_name,
                    key,
                    message,
                }
            }
            other => other,
        }
    }
}

#[cfg(test)]
mod tests;
