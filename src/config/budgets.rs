//! `[budgets]`: how budgets are reserved and settled, and how often the
//! store's keys are read again (docs/design.md, "Keys and budgets").

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

/// What to do with a call on a target whose price is unknown, for a key or
/// tenant that has a budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Unpriced {
    /// Refuse it (403 `price_unknown`): its cost could not be counted.
    Refuse,
    /// Let it through, counted as costing nothing against the budget
    /// (its tokens are still counted: `idem_tokens_total`, the request
    /// log).
    Allow,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct BudgetsConfig {
    /// How often each replica asks the store whether a key changed: a key
    /// created, revoked or limited anywhere is in force everywhere within
    /// this interval.
    #[serde(with = "humantime_serde")]
    pub keys_refresh: Duration,
    /// How long a replica's grant of budget lives without its heartbeat:
    /// the reservations of a replica that died are released after it.
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    /// How soon settlements the store refused to write are tried again.
    /// (A call's spend is written before its answer goes, with the other
    /// settlements ready at that moment; this timer only retries.)
    #[serde(with = "humantime_serde")]
    pub flush_interval: Duration,
    /// The output a request that sets no `max_tokens` (or
    /// `max_completion_tokens`, `max_output_tokens`) reserves for.
    pub default_max_output_tokens: u64,
    pub unpriced: Unpriced,
}

impl Default for BudgetsConfig {
    fn default() -> Self {
        Self {
            keys_refresh: Duration::from_millis(250),
            lease: Duration::from_secs(10),
            flush_interval: Duration::from_millis(100),
            default_max_output_tokens: 4096,
            unpriced: Unpriced::Refuse,
        }
    }
}

impl BudgetsConfig {
    /// The checks of `[budgets]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if self.keys_refresh < Duration::from_millis(10)
            || self.keys_refresh > Duration::from_secs(60)
        {
            return Err(source.invalid("budgets.keys_refresh", "expected 10ms to 60s"));
        }
        if self.lease < Duration::from_millis(300) {
            return Err(source.invalid("budgets.lease", "expected at least 300ms"));
        }
        if self.flush_interval < Duration::from_millis(10) || self.flush_interval * 3 > self.lease {
            return Err(source.invalid(
                "budgets.flush_interval",
                "expected at least 10ms and at most a third of budgets.lease",
            ));
        }
        if self.default_max_output_tokens == 0 {
            return Err(source.invalid(
                "budgets.default_max_output_tokens",
                "expected a positive number of tokens",
            ));
        }
        Ok(())
    }
}
