//! The circuit breaker of one target (provider + upstream model), shared by
//! every route that uses it, so failover and hedging stop sending work to a
//! provider that keeps failing.
//!
//! Closed: calls go through; `failures` consecutive failed calls open it.
//! Open: automatic work skips the target for `cooldown`. Then half-open:
//! exactly one caller gets the probe; its success closes the circuit, its
//! failure opens it for another cool-down. A probe whose outcome never
//! arrives (its caller was answered from a cache, say) expires after one
//! more cool-down, so a lost probe cannot wedge the circuit.
//!
//! Outcomes are recorded by the leader task of each upstream call, the one
//! place every call goes through. A small std `Mutex` guards the state: it
//! is taken for a few instructions per call, never across an `.await`.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::answer::{Answer, Failure};
use crate::config::BreakerConfig;

/// What a call said about the target's health.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// The provider answered (a 2xx, or a 4xx the request caused).
    Up,
    /// Connect error, timeout, lost connection, 429, 5xx, or a 2xx that
    /// is no chat completion.
    Down,
    /// Says nothing about the provider (idem's own trouble).
    Neutral,
}

impl Health {
    pub fn of(answer: &Answer) -> Health {
        match answer.failure {
            // Garbage in a 200 is a provider (or its proxy) that is not well.
            // So is a provider that refuses idem's key: no call to it can
            // succeed until the operator fixes the key.
            Some(
                Failure::Connect
                | Failure::Timeout
                | Failure::Broken
                | Failure::BadAnswer
                | Failure::Credentials,
            ) => Health::Down,
            Some(Failure::LeaderLost) => Health::Neutral,
            // The provider answered; whether the content is acceptable is
            // the route's contract, not the provider's health, and whether
            // it is too large is this gateway's limit.
            Some(Failure::Contract | Failure::TooLarge) => Health::Up,
            None => match answer.status.as_u16() {
                429 | 500..=599 => Health::Down,
                _ => Health::Up,
            },
        }
    }
}

/// Whether a caller may send work to the target now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Closed: go.
    Yes,
    /// Half-open: this caller is the one probe.
    Probe,
    /// Open: skip it; a probe may go after `retry_in`.
    No { retry_in: Duration },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed,
    Open { until: Instant },
    HalfOpen { probe_since: Instant },
}

#[derive(Debug)]
struct Inner {
    state: State,
    consecutive: u32,
}

/// The state as the admin listing and the metric show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BreakerView {
    /// `closed`, `open` or `half_open`.
    pub state: &'static str,
    pub consecutive_failures: u32,
    /// While open: milliseconds until a probe may go.
    pub retry_in_ms: Option<u64>,
    pub failures_to_open: u32,
    pub cooldown_ms: u64,
}

/// One target's circuit breaker.
#[derive(Debug)]
pub struct Breaker {
    config: BreakerConfig,
    inner: Mutex<Inner>,
    /// `idem_circuit_state{provider,model}`: 0 closed, 1 half-open, 2 open.
    gauge: metrics::Gauge,
}

impl Breaker {
    pub fn new(config: BreakerConfig, gauge: metrics::Gauge) -> Breaker {
        gauge.set(0.0);
        Breaker {
            config,
            inner: Mutex::new(Inner {
                state: State::Closed,
                consecutive: 0,
            }),
            gauge,
        }
    }

    /// Its settings.
    /// The gauge this breaker reports its state to (shared by the breakers
    /// a pattern route makes for the names it serves: one label per target
    /// of the configuration, not per name a client asked).
    pub fn gauge(&self) -> metrics::Gauge {
        self.gauge.clone()
    }

    pub fn settings(&self) -> BreakerConfig {
        self.config
    }

    fn enabled(&self) -> bool {
        self.config.failures > 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every update is a whole assignment: a poisoned lock still holds a
        // consistent state.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// May a caller send work now? Takes the probe when half-open.
    pub fn admit(&self) -> Admit {
        self.admit_at(Instant::now())
    }

    fn admit_at(&self, now: Instant) -> Admit {
        if !self.enabled() {
            return Admit::Yes;
        }
        let cooldown = self.config.cooldown;
        let mut inner = self.lock();
        let admit = match inner.state {
            State::Closed => Admit::Yes,
            State::Open { until } if now < until => Admit::No {
                retry_in: until - now,
            },
            State::Open { .. } => {
                inner.state = State::HalfOpen { probe_since: now };
                Admit::Probe
            }
            State::HalfOpen { probe_since } => {
                let waited = now.saturating_duration_since(probe_since);
                if waited >= cooldown {
                    // The last probe never reported: let another one go.
                    inner.state = State::HalfOpen { probe_since: now };
                    Admit::Probe
                } else {
                    Admit::No {
                        retry_in: cooldown - waited,
                    }
                }
            }
        };
        self.show(inner.state);
        admit
    }

    /// Records the outcome of one call to the target.
    pub fn record(&self, health: Health) {
        self.record_at(health, Instant::now());
    }

    fn record_at(&self, health: Health, now: Instant) {
        if !self.enabled() || health == Health::Neutral {
            return;
        }
        let mut inner = self.lock();
        match health {
            Health::Up => {
                inner.consecutive = 0;
                inner.state = State::Closed;
            }
            _ => {
                inner.consecutive = inner.consecutive.saturating_add(1);
                let open = match inner.state {
                    State::HalfOpen { .. } => true,
                    State::Closed => inner.consecutive >= self.config.failures,
                    // A straggler from before the circuit opened.
                    State::Open { .. } => false,
                };
                if open {
                    inner.state = State::Open {
                        until: now + self.config.cooldown,
                    };
                }
            }
        }
        self.show(inner.state);
    }

    fn show(&self, state: State) {
        self.gauge.set(match state {
            State::Closed => 0.0,
            State::HalfOpen { .. } => 1.0,
            State::Open { .. } => 2.0,
        });
    }

    pub fn view(&self) -> BreakerView {
        let now = Instant::now();
        let inner = self.lock();
        let (state, retry_in) = match inner.state {
            State::Closed => ("closed", None),
            State::Open { until } => ("open", Some(until.saturating_duration_since(now))),
            State::HalfOpen { .. } => ("half_open", None),
        };
        BreakerView {
            state,
            consecutive_failures: inner.consecutive,
            retry_in_ms: retry_in.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            failures_to_open: self.config.failures,
            cooldown_ms: u64::try_from(self.config.cooldown.as_millis()).unwrap_or(u64::MAX),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker(failures: u32) -> Breaker {
        Breaker::new(
            BreakerConfig {
                failures,
                cooldown: Duration::from_secs(10),
            },
            metrics::Gauge::noop(),
        )
    }

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn opens_after_n_consecutive_failures_only() {
        let b = breaker(3);
        let t = Instant::now();
        b.record_at(Health::Down, t);
        b.record_at(Health::Down, t);
        b.record_at(Health::Up, t);
        b.record_at(Health::Down, t);
        b.record_at(Health::Down, t);
        assert_eq!(b.admit_at(t), Admit::Yes, "a success resets the count");
        b.record_at(Health::Neutral, t);
        b.record_at(Health::Down, t);
        assert_eq!(b.admit_at(t + S), Admit::No { retry_in: 9 * S });
        assert_eq!(b.view().state, "open");
        assert_eq!(b.view().consecutive_failures, 3);
    }

    #[test]
    fn half_open_lets_one_probe_through_and_its_success_closes() {
        let b = breaker(1);
        let t = Instant::now();
        b.record_at(Health::Down, t);
        assert!(matches!(b.admit_at(t + 9 * S), Admit::No { .. }));
        assert_eq!(b.admit_at(t + 10 * S), Admit::Probe);
        assert_eq!(b.view().state, "half_open");
        // Everybody else waits for the probe.
        assert!(matches!(b.admit_at(t + 11 * S), Admit::No { .. }));
        b.record_at(Health::Up, t + 12 * S);
        assert_eq!(b.admit_at(t + 12 * S), Admit::Yes);
        assert_eq!(b.view().state, "closed");
    }

    #[test]
    fn a_failed_probe_opens_for_another_cooldown() {
        let b = breaker(2);
        let t = Instant::now();
        b.record_at(Health::Down, t);
        b.record_at(Health::Down, t);
        assert_eq!(b.admit_at(t + 10 * S), Admit::Probe);
        b.record_at(Health::Down, t + 11 * S);
        assert_eq!(b.admit_at(t + 12 * S), Admit::No { retry_in: 9 * S });
        assert_eq!(b.admit_at(t + 21 * S), Admit::Probe);
    }

    #[test]
    fn a_lost_probe_expires_after_a_cooldown() {
        let b = breaker(1);
        let t = Instant::now();
        b.record_at(Health::Down, t);
        assert_eq!(b.admit_at(t + 10 * S), Admit::Probe);
        assert!(matches!(b.admit_at(t + 19 * S), Admit::No { .. }));
        assert_eq!(b.admit_at(t + 20 * S), Admit::Probe);
    }

    #[test]
    fn zero_failures_turns_it_off() {
        let b = breaker(0);
        let t = Instant::now();
        for _ in 0..100 {
            b.record_at(Health::Down, t);
        }
        assert_eq!(b.admit_at(t), Admit::Yes);
    }

    #[test]
    fn health_follows_the_answer() {
        use crate::answer::Form;
        use std::time::SystemTime;
        let answer = |status: u16, failure: Option<Failure>| Answer {
            dialect: crate::dialect::Dialect::Chat,
            status: reqwest::StatusCode::from_u16(status).unwrap(),
            form: Form::Plain,
            body: bytes::Bytes::new(),
            retry_after: None,
            failure,
            provider: "p".into(),
            model: "m".into(),
            created_at: SystemTime::now(),
            upstream_latency: Duration::ZERO,
            cache_ttl: None,
            rendered: Default::default(),
        };
        assert_eq!(Health::of(&answer(200, None)), Health::Up);
        assert_eq!(Health::of(&answer(400, None)), Health::Up);
        assert_eq!(Health::of(&answer(429, None)), Health::Down);
        assert_eq!(Health::of(&answer(503, None)), Health::Down);
        assert_eq!(
            Health::of(&answer(502, Some(Failure::Connect))),
            Health::Down
        );
        assert_eq!(
            Health::of(&answer(504, Some(Failure::Timeout))),
            Health::Down
        );
        assert_eq!(
            Health::of(&answer(502, Some(Failure::LeaderLost))),
            Health::Neutral
        );
        assert_eq!(
            Health::of(&answer(502, Some(Failure::Contract))),
            Health::Up
        );
        assert_eq!(
            Health::of(&answer(502, Some(Failure::BadAnswer))),
            Health::Down
        );
        assert_eq!(
            Health::of(&answer(502, Some(Failure::TooLarge))),
            Health::Up
        );
        assert_eq!(
            Health::of(&answer(502, Some(Failure::Credentials))),
            Health::Down
        );
    }
}
