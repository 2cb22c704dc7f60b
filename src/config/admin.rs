//! `[admin]`: the admin API keys.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Admin API keys, plain or `sha256:<hex>`.
    pub api_keys: Vec<String>,
    /// Require an admin key for `GET /metrics`.
    pub metrics_require_key: bool,
}
