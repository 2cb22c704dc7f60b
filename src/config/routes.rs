//! `[[routes]]`: the models clients ask for, the targets that answer them,
//! and how each route caches, coalesces and retries.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    pub provider: String,
    pub model: String,
    /// The upstream model's version, when the provider's model name does not
    /// pin one; part of the fingerprint so a version change is a new task.
    #[serde(default)]
    pub version: Option<String>,
    /// The model's context window in tokens, checked by certification;
    /// default: the provider's `context_window`, else the model family's.
    #[serde(default)]
    pub context_window: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Normalize {
    #[default]
    None,
    Whitespace,
    Casefold,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    #[default]
    Tenant,
    User,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub model: String,
    pub targets: Vec<TargetConfig>,
    #[serde(default)]
    pub normalize: Normalize,
    #[serde(default)]
    pub scope: Scope,
    #[serde(default)]
    pub contract: Option<PathBuf>,
    /// Request fields that never change the answer on this route.
    #[serde(default)]
    pub ignore_fields: Vec<String>,
    #[serde(default)]
    pub cache: RouteCache,
    #[serde(default)]
    pub coalesce: RouteCoalesce,
    #[serde(default)]
    pub attempts: RouteAttempts,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteCache {
    pub enabled: bool,
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    pub jitter: f64,
    /// How long past its TTL an answer may still be served by
    /// `on_wait_timeout = "stale"`.
    #[serde(with = "humantime_serde")]
    pub stale_grace: Duration,
    /// Negative-cache TTL for 429s and timeouts (a `Retry-After` raises it).
    #[serde(with = "humantime_serde")]
    pub rate_limit_ttl: Duration,
    /// Cap for a `Retry-After`-raised negative TTL.
    #[serde(with = "humantime_serde")]
    pub rate_limit_ttl_max: Duration,
    /// Negative-cache TTL for provider 5xx.
    #[serde(with = "humantime_serde")]
    pub server_error_ttl: Duration,
}

impl Default for RouteCache {
    fn default() -> Self {
        Self {
            enabled: true,
            ttl: Duration::from_secs(30),
            jitter: 0.15,
            stale_grace: Duration::from_secs(300),
            rate_limit_ttl: Duration::from_secs(2),
            rate_limit_ttl_max: Duration::from_secs(30),
            server_error_ttl: Duration::from_secs(10),
        }
    }
}

/// `coalesce.max_wait`: a duration, or `auto` (1.5 x the route's observed p99
/// leader latency, clamped to [300 ms, the target timeout]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MaxWait {
    #[default]
    Auto,
    Fixed(Duration),
}

impl<'de> Deserialize<'de> for MaxWait {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == "auto" {
            return Ok(MaxWait::Auto);
        }
        humantime::parse_duration(&s)
            .map(MaxWait::Fixed)
            .map_err(|e| serde::de::Error::custom(format!("expected \"auto\" or a duration: {e}")))
    }
}

impl Serialize for MaxWait {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            MaxWait::Auto => s.serialize_str("auto"),
            MaxWait::Fixed(d) => s.serialize_str(&humantime::format_duration(*d).to_string()),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnWaitTimeout {
    #[default]
    Fail,
    Stale,
    Lead,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteCoalesce {
    pub enabled: bool,
    pub max_wait: MaxWait,
    pub on_wait_timeout: OnWaitTimeout,
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
}

impl Default for RouteCoalesce {
    fn default() -> Self {
        Self {
            enabled: true,
            max_wait: MaxWait::Auto,
            on_wait_timeout: OnWaitTimeout::Fail,
            lease: Duration::from_secs(3),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteAttempts {
    pub max: u32,
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    #[serde(with = "humantime_serde::option")]
    pub hedge_after: Option<Duration>,
    #[serde(with = "humantime_serde")]
    pub backoff_base: Duration,
    #[serde(with = "humantime_serde")]
    pub backoff_max: Duration,
    #[serde(with = "humantime_serde")]
    pub late_result_window: Duration,
    #[serde(with = "humantime_serde::option")]
    pub auto_resolve_unknown_after: Option<Duration>,
}

impl Default for RouteAttempts {
    fn default() -> Self {
        Self {
            max: 3,
            timeout: Duration::from_secs(30),
            hedge_after: None,
            backoff_base: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
            late_result_window: Duration::from_secs(600),
            auto_resolve_unknown_after: None,
        }
    }
}
