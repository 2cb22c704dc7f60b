//! `[admin]`: the admin API keys.

use serde::{Deserialize, Serialize};

use super::tenants::check_key;
use super::{ConfigError, Source};

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    /// Admin API keys, plain or `sha256:<hex>`.
    pub api_keys: Vec<String>,
    /// Require an admin key for `GET /metrics`.
    pub metrics_require_key: bool,
}

impl AdminConfig {
    /// The checks of `[admin]`: every key is well formed.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        for (i, key) in self.api_keys.iter().enumerate() {
            check_key(key).map_err(|m| source.invalid(format!("admin.api_keys[{i}]"), m))?;
        }
        Ok(())
    }
}
