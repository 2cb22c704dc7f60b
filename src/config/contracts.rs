//! `[contracts]`: how route contracts and their certifications are kept fresh.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Route contracts and their certifications.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ContractsConfig {
    /// How often the gateway re-reads certifications from the store (an
    /// `idem certify` run by another process, or another replica's admin
    /// certify, counts after at most this long).
    #[serde(with = "humantime_serde")]
    pub refresh_interval: Duration,
}

impl Default for ContractsConfig {
    fn default() -> Self {
        Self {
            refresh_interval: Duration::from_secs(10),
        }
    }
}
