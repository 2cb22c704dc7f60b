//! `[jobs]`: the job executor of this replica, its leases and intervals.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

/// The job executor of this replica.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobsConfig {
    /// Jobs this replica runs at once (0: an API-only replica that runs
    /// none; its reconciler still runs).
    pub workers: usize,
    /// How often idle workers look for queued jobs (new jobs on this
    /// replica wake them at once).
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// Lease of a running attempt, renewed every third of it while its call
    /// lives; a replica that dies stops renewing.
    #[serde(with = "humantime_serde")]
    pub attempt_lease: Duration,
    /// Lease of a worker's claim on a job.
    #[serde(with = "humantime_serde")]
    pub claim_lease: Duration,
    /// How often the reconciler turns expired attempts into `unknown`,
    /// requeues abandoned jobs and purges old ones.
    #[serde(with = "humantime_serde")]
    pub reconcile_interval: Duration,
}

impl Default for JobsConfig {
    fn default() -> Self {
        Self {
            workers: 16,
            poll_interval: Duration::from_secs(1),
            attempt_lease: Duration::from_secs(10),
            claim_lease: Duration::from_secs(30),
            reconcile_interval: Duration::from_secs(5),
        }
    }
}

impl JobsConfig {
    /// The checks of `[jobs]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if self.attempt_lease < Duration::from_millis(300) {
            return Err(source.invalid("jobs.attempt_lease", "must be at least 300ms"));
        }
        if self.claim_lease < Duration::from_millis(300) {
            return Err(source.invalid("jobs.claim_lease", "must be at least 300ms"));
        }
        if self.reconcile_interval.is_zero() || self.poll_interval.is_zero() {
            return Err(source.invalid("jobs.reconcile_interval", "intervals must be above zero"));
        }
        Ok(())
    }
}
