//! `[storage]`: where jobs, attempts and certifications are kept.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct StorageConfig {
    pub url: String,
    #[serde(with = "humantime_serde")]
    pub idempotency_retention: Duration,
    pub max_connections: u32,
}

impl Default for StorageConfig {
    fn default() -> Self {
        Self {
            url: "sqlite://idem.db".into(),
            idempotency_retention: Duration::from_secs(24 * 3600),
            max_connections: 16,
        }
    }
}

impl StorageConfig {
    /// The checks of `[storage]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        let url = &self.url;
        if !(url.starts_with("sqlite:")
            || url.starts_with("postgres://")
            || url.starts_with("postgresql://"))
        {
            return Err(source.invalid("storage.url", "expected sqlite://FILE or postgres://..."));
        }
        Ok(())
    }
}
