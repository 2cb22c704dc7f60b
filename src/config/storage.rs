//! `[storage]`: where jobs, attempts and certifications are kept.

use std::time::Duration;

use serde::{Deserialize, Serialize};

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
