//! What happened to a request: the words every layer shares for it (the
//! `Idem-Outcome` header, the `outcome` label of the metrics, the request
//! log's `outcome`).

use serde::Serialize;

/// What happened to a request (the `Idem-Outcome` header and the `outcome`
/// label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    Leader,
    Follower,
    CacheHit,
    NegativeHit,
    Bypass,
    Replay,
}

impl Outcome {
    pub const ALL: [Outcome; 6] = [
        Outcome::Leader,
        Outcome::Follower,
        Outcome::CacheHit,
        Outcome::NegativeHit,
        Outcome::Bypass,
        Outcome::Replay,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Leader => "leader",
            Outcome::Follower => "follower",
            Outcome::CacheHit => "cache-hit",
            Outcome::NegativeHit => "negative-hit",
            Outcome::Bypass => "bypass",
            Outcome::Replay => "replay",
        }
    }

    /// True when the request was answered without its own upstream call.
    pub fn saved_a_call(self) -> bool {
        matches!(
            self,
            Outcome::Follower | Outcome::CacheHit | Outcome::NegativeHit | Outcome::Replay
        )
    }
}

/// Why a chat completion request got an error of idem's own instead of an
/// answer with an [`Outcome`]: its `outcome` label, so that every request
/// is counted. A fixed set, like the route label (a configured route or
/// [`UNROUTED`]), so that no client can add label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Refusal {
    /// Refused before any work: no or a wrong key, a rate limit, a body
    /// that is invalid, too large or too slow, an unknown model, a reused
    /// idempotency key.
    Rejected,
    /// A follower whose wait for its leader ran out.
    WaitTimeout,
    /// No target of the route could take the request (circuits open,
    /// failover not certified).
    NoTarget,
    /// A request on the job path whose job was not done within the request
    /// timeout.
    JobTimeout,
    /// Anything else: the store unavailable, an internal error.
    Error,
}

impl Refusal {
    pub const ALL: [Refusal; 5] = [
        Refusal::Rejected,
        Refusal::WaitTimeout,
        Refusal::NoTarget,
        Refusal::JobTimeout,
        Refusal::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Rejected => "rejected",
            Refusal::WaitTimeout => "wait-timeout",
            Refusal::NoTarget => "no-target",
            Refusal::JobTimeout => "job-timeout",
            Refusal::Error => "error",
        }
    }

    /// Its position in per-refusal arrays.
    pub fn index(self) -> usize {
        match self {
            Refusal::Rejected => 0,
            Refusal::WaitTimeout => 1,
            Refusal::NoTarget => 2,
            Refusal::JobTimeout => 3,
            Refusal::Error => 4,
        }
    }
}
