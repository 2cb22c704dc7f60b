//! `[[routes]]`: the models clients ask for, the targets that answer them,
//! and how each route caches, coalesces and retries.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::{ConfigError, Source};

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
    /// What this target's tokens cost; default: the built-in price of the
    /// model, if idem knows it (see `crate::prices`). Not part of the
    /// fingerprint: a price changes what a call costs, not its answer.
    #[serde(default)]
    pub price: Option<PriceConfig>,
}

/// Prices in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PriceConfig {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
    /// Input tokens read from the provider's prompt cache; default: the
    /// input price.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cached_input_per_mtok: Option<f64>,
}

impl TargetConfig {
    /// The checks of a target whose keys start with `at`, but for its
    /// provider: that it exists is for the whole configuration to say.
    fn validate(&self, at: &str, source: &Source) -> Result<(), ConfigError> {
        if self.model.is_empty() {
            return Err(source.invalid(format!("{at}.model"), "must not be empty"));
        }
        if self.context_window == Some(0) {
            return Err(source.invalid(format!("{at}.context_window"), "must be above zero"));
        }
        if let Some(p) = &self.price {
            let prices = [
                ("input_per_mtok", Some(p.input_per_mtok)),
                ("output_per_mtok", Some(p.output_per_mtok)),
                ("cached_input_per_mtok", p.cached_input_per_mtok),
            ];
            for (key, value) in prices {
                if let Some(v) = value
                    && !(v.is_finite() && v >= 0.0)
                {
                    return Err(source.invalid(
                        format!("{at}.price.{key}"),
                        "must be a number of US dollars per million tokens, 0 or more",
                    ));
                }
            }
        }
        Ok(())
    }
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

/// An API shape a route serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteEndpoint {
    /// `POST /v1/chat/completions` (and jobs).
    Chat,
    /// `POST /v1/embeddings`.
    Embeddings,
}

impl RouteEndpoint {
    pub fn as_str(self) -> &'static str {
        match self {
            RouteEndpoint::Chat => "chat",
            RouteEndpoint::Embeddings => "embeddings",
        }
    }
}

fn default_endpoints() -> Vec<RouteEndpoint> {
    vec![RouteEndpoint::Chat]
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub model: String,
    pub targets: Vec<TargetConfig>,
    /// The endpoints this route serves (default: chat completions only).
    #[serde(default = "default_endpoints")]
    pub endpoints: Vec<RouteEndpoint>,
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
    #[serde(default)]
    pub batch: RouteBatch,
}

/// In a target's model, the model name a client asked a pattern route for.
pub const MODEL_PLACEHOLDER: &str = "{model}";

impl RouteConfig {
    /// True when `model` is a pattern (`claude-*`): the route serves every
    /// model name it matches that no route names exactly.
    pub fn is_pattern(&self) -> bool {
        self.model.contains('*')
    }

    /// The checks of route `r` of `[[routes]]`. `names` holds the models of
    /// the routes before it (this one's is added); `known_provider` is given
    /// each target's provider, with its key, before the target's own checks,
    /// and refuses one that does not exist.
    pub(super) fn validate<'a>(
        &'a self,
        r: usize,
        names: &mut HashSet<&'a str>,
        known_provider: impl Fn(String, &str) -> Result<(), ConfigError>,
        source: &Source,
    ) -> Result<(), ConfigError> {
        let at = |k: &str| format!("routes[{r}].{k}");
        if self.model.is_empty() {
            return Err(source.invalid(at("model"), "must not be empty"));
        }
        if !names.insert(self.model.as_str()) {
            return Err(source.invalid(at("model"), format!("duplicate route \"{}\"", self.model)));
        }
        if self.targets.is_empty() {
            return Err(source.invalid(at("targets"), "a route needs at least one target"));
        }
        let pattern = self.is_pattern();
        if pattern && self.contract.is_some() {
            return Err(source.invalid(
                at("contract"),
                "a route that matches model names by pattern cannot have a contract: each name \
                 it serves is another model, certified on its own (give the model a route of its own)",
            ));
        }
        if let Some((i, _)) = self
            .targets
            .iter()
            .enumerate()
            .find(|(_, t)| !pattern && t.model.contains(MODEL_PLACEHOLDER))
        {
            return Err(source.invalid(
                at(&format!("targets[{i}].model")),
                format!(
                    "{MODEL_PLACEHOLDER} stands for the model a client asked for: only a route whose \
                     model is a pattern (with `*`) has one"
                ),
            ));
        }
        if self.endpoints.is_empty() {
            return Err(source.invalid(
                at("endpoints"),
                "a route serves at least one endpoint (chat, embeddings)",
            ));
        }
        if let Some((i, e)) = self
            .endpoints
            .iter()
            .enumerate()
            .find(|(i, e)| self.endpoints[..*i].contains(e))
        {
            return Err(source.invalid(
                at(&format!("endpoints[{i}]")),
                format!("{} is listed twice", e.as_str()),
            ));
        }
        if self.contract.is_some() && !self.endpoints.contains(&RouteEndpoint::Chat) {
            return Err(source.invalid(
                at("contract"),
                "a contract checks chat completions, and this route serves none",
            ));
        }
        for (i, target) in self.targets.iter().enumerate() {
            let target_at = at(&format!("targets[{i}]"));
            known_provider(format!("{target_at}.provider"), &target.provider)?;
            target.validate(&target_at, source)?;
        }
        self.cache.validate(&at("cache"), source)?;
        self.coalesce.validate(&at("coalesce"), source)?;
        self.attempts.validate(&at("attempts"), source)?;
        self.batch.validate(&at("batch"), source)?;
        if let Some(contract) = &self.contract
            && !contract.exists()
        {
            return Err(source.invalid(
                at("contract"),
                format!("contract file {} does not exist", contract.display()),
            ));
        }
        Ok(())
    }
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

impl RouteCache {
    /// The checks of a route's `cache`, whose keys start with `at`.
    fn validate(&self, at: &str, source: &Source) -> Result<(), ConfigError> {
        if self.ttl < Duration::from_secs(1) {
            return Err(source.invalid(format!("{at}.ttl"), "must be at least 1s"));
        }
        if !(0.0..=1.0).contains(&self.jitter) {
            return Err(source.invalid(format!("{at}.jitter"), "must be within 0.0..=1.0"));
        }
        Ok(())
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

impl RouteCoalesce {
    /// The checks of a route's `coalesce`, whose keys start with `at`.
    fn validate(&self, at: &str, source: &Source) -> Result<(), ConfigError> {
        if self.lease < Duration::from_millis(300) {
            return Err(source.invalid(format!("{at}.lease"), "must be at least 300ms"));
        }
        if let MaxWait::Fixed(d) = self.max_wait
            && d.is_zero()
        {
            return Err(
                source.invalid(format!("{at}.max_wait"), "must be above zero (or \"auto\")")
            );
        }
        Ok(())
    }
}

/// How the Batch API's lines run on a route (docs/design.md, "Batches").
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouteBatch {
    /// The most lines of one batch in flight at once on this route, per
    /// replica (each also takes one of `jobs.workers`): live traffic keeps
    /// the rest.
    pub concurrency: u32,
    /// The most batch lines started per second on this route, per replica
    /// (all its batches together; a burst of as many); none: no limit
    /// but `concurrency`.
    pub rate: Option<u32>,
    /// How long a batch line's answer answers the same line of a later
    /// batch of the tenant (instead of a call); zero: never.
    #[serde(with = "humantime_serde")]
    pub reuse: Duration,
}

impl Default for RouteBatch {
    fn default() -> Self {
        Self {
            concurrency: 8,
            rate: None,
            reuse: Duration::from_secs(24 * 3600),
        }
    }
}

impl RouteBatch {
    fn validate(&self, at: &str, source: &Source) -> Result<(), ConfigError> {
        if self.concurrency == 0 || self.concurrency > 4096 {
            return Err(source.invalid(format!("{at}.concurrency"), "expected 1 to 4096"));
        }
        if self.rate.is_some_and(|r| r == 0 || r > 100_000) {
            return Err(
                source.invalid(format!("{at}.rate"), "expected 1 to 100,000 lines a second")
            );
        }
        Ok(())
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

impl RouteAttempts {
    /// The checks of a route's `attempts`, whose keys start with `at`.
    fn validate(&self, at: &str, source: &Source) -> Result<(), ConfigError> {
        if self.max == 0 {
            return Err(source.invalid(format!("{at}.max"), "must be at least 1"));
        }
        if self.timeout.is_zero() {
            return Err(source.invalid(format!("{at}.timeout"), "must be above zero"));
        }
        // Past its timeout an attempt is unknown and its call goes on
        // until the late window ends (from the attempt's start): a
        // window no longer than the timeout would never hear an answer.
        if self.late_result_window <= self.timeout {
            return Err(source.invalid(
                format!("{at}.late_result_window"),
                format!(
                    "must be longer than {at}.timeout ({}): a late answer is only heard between the two",
                    humantime::format_duration(self.timeout)
                ),
            ));
        }
        Ok(())
    }
}
