//! `[contracts]`: how route contracts and their certifications are kept fresh.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

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

impl ContractsConfig {
    /// The checks of `[contracts]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if self.refresh_interval < Duration::from_millis(10) {
            return Err(source.invalid("contracts.refresh_interval", "must be at least 10ms"));
        }
        Ok(())
    }
}
