//! `[breaker]`: the per-target circuit breaker, also taken by a provider's
//! own `[providers.breaker]`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

/// The per-target circuit breaker: `[breaker]` for every provider,
/// `[providers.breaker]` for one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct BreakerConfig {
    /// Consecutive failed calls (connect errors, timeouts, lost
    /// connections, 429, 5xx) that open a target's circuit; 0 turns the
    /// breaker off.
    pub failures: u32,
    /// How long an open circuit stays open before one probe call may try.
    #[serde(with = "humantime_serde")]
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failures: 5,
            cooldown: Duration::from_secs(30),
        }
    }
}

impl BreakerConfig {
    /// The checks of a breaker whose keys start with `at`: `breaker`, or a
    /// provider's `providers[N].breaker`.
    pub(super) fn validate(&self, at: &str, source: &Source) -> Result<(), ConfigError> {
        if self.failures > 0 && self.cooldown.is_zero() {
            return Err(source.invalid(
                format!("{at}.cooldown"),
                "must be above zero while failures > 0",
            ));
        }
        Ok(())
    }
}
