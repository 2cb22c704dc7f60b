//! `[[tenants]]`: who may call the gateway, with which API keys, at what rate.

use serde::{Deserialize, Serialize};

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
}

#[derive(Debug, Clone, Copy, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Sustained requests per second.
    pub requests_per_second: f64,
    /// Requests allowed at once above the sustained rate.
    pub burst: u32,
}
