//! `[[tenants]]`: who may call the gateway, with which API keys, at what
//! rate; and the form of an API key, the admin's too.

use std::collections::HashSet;

use serde::{Deserialize, Serialize};

use super::{ConfigError, NAME_RULE, Source, valid_name};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    pub api_keys: Vec<String>,
    /// A token bucket for this tenant's requests (none: unlimited).
    #[serde(default)]
    pub rate_limit: Option<RateLimitConfig>,
    /// A body limit below `server.max_body_bytes` for this tenant.
    #[serde(default)]
    pub max_body_bytes: Option<usize>,
    /// A budget in US dollars that every key of the tenant shares, those
    /// of this file and those of the store (none: no budget).
    #[serde(default)]
    pub budget_usd: Option<f64>,
    /// When the budget starts again: `1d`, `7d` or `30d` (none: never).
    #[serde(default)]
    pub budget_period: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Sustained requests per second.
    pub requests_per_second: f64,
    /// Requests allowed at once above the sustained rate.
    pub burst: u32,
}

impl TenantConfig {
    /// The checks of tenant `t` of `[[tenants]]`. `names` holds the names of
    /// the tenants before it (this one's is added); `claim` is given each of
    /// its API keys, once well formed, with the key's name, and refuses a
    /// key that is already someone else's.
    pub(super) fn validate<'a>(
        &'a self,
        t: usize,
        names: &mut HashSet<&'a str>,
        mut claim: impl FnMut(String, &'a str) -> Result<(), ConfigError>,
        source: &Source,
    ) -> Result<(), ConfigError> {
        let at = |k: &str| format!("tenants[{t}].{k}");
        if !valid_name(&self.name) {
            return Err(source.invalid(at("name"), NAME_RULE));
        }
        if !names.insert(self.name.as_str()) {
            return Err(source.invalid(at("name"), "duplicate tenant name"));
        }
        if let Some(rl) = &self.rate_limit {
            rl.validate(&at("rate_limit"), source)?;
        }
        if self.max_body_bytes.is_some_and(|n| n < 1024) {
            return Err(source.invalid(at("max_body_bytes"), "must be at least 1024"));
        }
        if let Some(b) = self.budget_usd
            && !(b.is_finite() && b >= 0.0)
        {
            return Err(source.invalid(at("budget_usd"), "expected dollars, zero or more"));
        }
        if let Some(p) = &self.budget_period {
            if crate::store::period_ms(p).is_none() {
                return Err(source.invalid(at("budget_period"), "expected 1d, 7d or 30d"));
            }
            if self.budget_usd.is_none() {
                return Err(source.invalid(at("budget_period"), "a period needs a budget_usd"));
            }
        }
        if self.api_keys.is_empty() {
            return Err(source.invalid(at("api_keys"), "a tenant needs at least one key"));
        }
        for (i, key) in self.api_keys.iter().enumerate() {
            let k = at(&format!("api_keys[{i}]"));
            check_key(key).map_err(|m| source.invalid(&k, m))?;
            claim(k, key)?;
        }
        Ok(())
    }
}

impl RateLimitConfig {
    /// The checks of a rate limit whose keys start with `at`.
    fn validate(&self, at: &str, source: &Source) -> Result<(), ConfigError> {
        if !(self.requests_per_second.is_finite() && self.requests_per_second > 0.0) {
            return Err(source.invalid(format!("{at}.requests_per_second"), "must be above zero"));
        }
        if self.burst == 0 {
            return Err(source.invalid(format!("{at}.burst"), "must be at least 1"));
        }
        Ok(())
    }
}

/// The `sha256:<hex>` form of a key, for operators who do not want plain keys
/// in their config (`idem hash-key`), and for showing a config
/// (`idem config`): it admits the same clients and reveals no key.
pub fn hashed_key(plain: &str) -> String {
    use sha2::{Digest, Sha256};
    format!("sha256:{}", hex::encode(Sha256::digest(plain.as_bytes())))
}

/// Why an API key (the admin's or a tenant's) is refused: a key is plain
/// printable ASCII of 8 characters or more, or `sha256:` and 64 hex digits.
pub(super) fn check_key(key: &str) -> Result<(), String> {
    if let Some(hex) = key.strip_prefix("sha256:") {
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err("a sha256: key needs 64 hex digits".into());
        }
        return Ok(());
    }
    if key.len() < 8 {
        return Err("an API key needs at least 8 characters".into());
    }
    if !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("an API key must be printable ASCII without spaces".into());
    }
    Ok(())
}
