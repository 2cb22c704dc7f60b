//! Coalescing: one upstream call per identical prompt in flight (SPEC
//! section 4).
//!
//! [`Coalescer::obtain`] is the request path after the fingerprint: result
//! cache, then for each target in order its negative cache and its flight.
//! The first request for a fingerprint leads: it spawns a detached task
//! ([`leader`]) that calls the provider, fills the flight and the cache, so a
//! client that hangs up cancels nothing. Every other request with the same
//! fingerprint follows: it waits, bounded by `coalesce.max_wait`, for the
//! leader's first byte, then reads the same answer. A failure that the
//! provider certainly caused moves everybody on to the next target, where
//! they coalesce again, if [`failover::admit`] lets the work go there
//! (certified for the route's contract, circuit not open).

pub mod leader;
pub mod redis;
pub mod table;

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rand::Rng;
use serde_json::{Map, Value};

use crate::answer::{Answer, Verdict};
use crate::cache::{Lookup, ResultCache};
use crate::config::OnWaitTimeout;
use crate::contracts::failover;
use crate::fingerprint::Fingerprint;
use crate::http::error::ApiError;
use crate::metrics::{Metrics, Outcome};
use crate::routes::{Route, Target};

pub use table::{Flight, FlightKey, FlightTable, Head, Joined, LeaderTicket, Origin};

use self::redis::RedisFlights;

/// Where a request's answer comes from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Finished (cache hit, negative hit, or a flight that ended).
    Done(Arc<Answer>),
    /// A flight whose provider answered with a success head; the body may
    /// still be streaming in.
    Live(Arc<Flight>),
}

/// The answer for one request and how it was obtained.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub outcome: Outcome,
    pub source: Source,
    /// How long a follower waited for its leader's first byte.
    pub waited: Option<Duration>,
    /// For cache hits: the entry's age.
    pub cache_age: Option<Duration>,
    /// True when a stale answer was served after a wait timeout.
    pub stale: bool,
}

impl Delivery {
    fn done(outcome: Outcome, answer: Arc<Answer>) -> Delivery {
        Delivery {
            outcome,
            source: Source::Done(answer),
            waited: None,
            cache_age: None,
            stale: false,
        }
    }

    /// The finished answer (waits for a live flight to end).
    pub async fn answer(&self) -> Arc<Answer> {
        match &self.source {
            Source::Done(a) => a.clone(),
            Source::Live(f) => match f.done(None).await {
                Some(a) => a,
                // Unreachable in practice: the guard always finishes a flight.
                None => Arc::new(Answer::from_failure(
                    crate::answer::Failure::LeaderLost,
                    "the call ended without an answer",
                    "idem".into(),
                    "".into(),
                )),
            },
        }
    }
}

/// What to obtain and under which rules.
pub struct Ask<'a> {
    pub tenant: &'a Arc<str>,
    pub route: &'a Arc<Route>,
    pub fp: Fingerprint,
    /// The client's request body (the leader sends it with the target's
    /// model).
    pub body: &'a Arc<Map<String, Value>>,
    /// Read the result and negative caches (`Cache-Control: no-cache` and
    /// `cache.enabled = false` turn this off).
    pub read_cache: bool,
    /// Read the negative cache. Job attempts do not: they pace themselves
    /// with backoff, and an attempt answered from the cache would burn the
    /// job's budget without asking the provider.
    pub read_negative: bool,
    /// Write answers to the caches.
    pub write_cache: bool,
    /// Share the call with identical requests (`no-store` and
    /// `coalesce.enabled = false` turn this off).
    pub coalesce: bool,
    /// Only these targets (job attempts name one); `None`: the route's
    /// targets in order, with failover.
    pub only_target: Option<usize>,
    /// How long a follower may wait; `None`: the route's `max_wait`.
    pub max_wait: Option<Duration>,
}

/// The coalescing layer of one gateway.
pub struct Coalescer {
    pub table: Arc<FlightTable>,
    pub cache: Arc<ResultCache>,
    pub metrics: Arc<Metrics>,
    /// The Redis layer shared by replicas, once connected (never, with the
    /// memory backend).
    pub shared: Arc<OnceLock<Arc<RedisFlights>>>,
}

impl Coalescer {
    pub fn new(cache: Arc<ResultCache>, metrics: Arc<Metrics>) -> Coalescer {
        let gauge = metrics.inflight_flights.clone();
        Coalescer {
            table: FlightTable::new(move |n| gauge.set(n as f64)),
            cache,
            metrics,
            shared: Arc::new(OnceLock::new()),
        }
    }

    /// Obtains the answer for `ask`: from the cache, a flight in progress,
    /// or a new upstream call, trying the route's targets in order.
    pub async fn obtain(&self, ask: &Ask<'_>) -> Result<Delivery, ApiError> {
        if ask.read_cache
            && ask.only_target.is_none()
            && let Lookup::Fresh { answer, age, .. } = self.cache.get(&ask.fp)
        {
            let mut d = Delivery::done(Outcome::CacheHit, answer);
            d.cache_age = Some(age);
            return Ok(d);
        }
        let targets: Vec<&Target> = match ask.only_target {
            Some(i) => ask.route.targets.get(i).into_iter().collect(),
            None => ask.route.targets.iter().collect(),
        };
        let mut last: Option<Delivery> = None;
        let mut skipped = Vec::new();
        for (pos, target) in targets.iter().enumerate() {
            // Failover goes only to certified, healthy targets (a job's
            // attempt names its target, already chosen by the same rule).
            if ask.only_target.is_none()
                && let Err(skip) = failover::admit(&self.metrics, ask.route, target)
            {
                skipped.push(skip);
                continue;
            }
            let mut d = self.via_target(ask, target).await?;
            let answer = match &d.source {
                Source::Done(a) => a.clone(),
                Source::Live(f) => {
                    let head = f.head(None).await;
                    d.outcome = reported(d.outcome, f);
                    match head {
                        Some(h) if h.status.is_success() => return Ok(d),
                        _ => d.answer().await,
                    }
                }
            };
            if answer.is_success() {
                return Ok(Delivery {
                    source: Source::Done(answer),
                    ..d
                });
            }
            if d.outcome == Outcome::Follower {
                self.metrics
                    .leader_error_shared(ask.tenant, &ask.route.name);
            }
            let more = pos + 1 < targets.len();
            let definite =
                matches!(answer.verdict(), Verdict::Failed(_)) && !answer.is_request_error();
            if more && definite {
                tracing::info!(
                    route = %ask.route.name,
                    from = %target.provider.name,
                    status = answer.status.as_u16(),
                    "failing over to the next target"
                );
                last = Some(Delivery {
                    source: Source::Done(answer),
                    ..d
                });
                continue;
            }
            return Ok(Delivery {
                source: Source::Done(answer),
                ..d
            });
        }
        match last {
            Some(d) => Ok(d),
            None => Err(failover::NoTarget(skipped).into_api_error()),
        }
    }

    /// One target: its negative cache, then its flight.
    async fn via_target(&self, ask: &Ask<'_>, target: &Target) -> Result<Delivery, ApiError> {
        if ask.read_negative
            && let Some((answer, age)) = self.cache.negative(&ask.fp, target.index)
        {
            let mut d = Delivery::done(Outcome::NegativeHit, answer);
            d.cache_age = Some(age);
            return Ok(d);
        }
        let key = FlightKey {
            fp: ask.fp,
            target: target.index,
        };
        let lease = ask.route.config.coalesce.lease;
        if !ask.coalesce {
            let ticket = self.table.private(key, lease);
            let flight = ticket.flight.clone();
            self.spawn_leader(ask, target, ticket);
            return Ok(Delivery {
                outcome: Outcome::Bypass,
                source: Source::Live(flight),
                waited: None,
                cache_age: None,
                stale: false,
            });
        }
        let max_wait = ask.max_wait.unwrap_or_else(|| ask.route.max_wait());
        loop {
            let flight = match self.table.join(key, lease) {
                Joined::Leader(ticket) => {
                    let flight = ticket.flight.clone();
                    self.spawn_leader(ask, target, ticket);
                    return Ok(Delivery {
                        outcome: Outcome::Leader,
                        source: Source::Live(flight),
                        waited: None,
                        cache_age: None,
                        stale: false,
                    });
                }
                Joined::Follower(flight) => flight,
            };
            let joined = Instant::now();
            if flight.head(Some(joined + max_wait)).await.is_some() {
                let waited = joined.elapsed();
                self.metrics.wait(ask.tenant, &ask.route.name, waited);
                return Ok(Delivery {
                    outcome: Outcome::Follower,
                    source: Source::Live(flight),
                    waited: Some(waited),
                    cache_age: None,
                    stale: false,
                });
            }
            // The wait ran out: the route's rule decides, and nobody
            // re-attacks the provider while the leader's lease is alive.
            match ask.route.config.coalesce.on_wait_timeout {
                OnWaitTimeout::Lead => {
                    if let Some(ticket) = self.table.take_over(&flight, lease) {
                        tracing::warn!(route = %ask.route.name, fp = %ask.fp, "leader lease expired; taking over");
                        let flight = ticket.flight.clone();
                        self.spawn_leader(ask, target, ticket);
                        return Ok(Delivery {
                            outcome: Outcome::Leader,
                            source: Source::Live(flight),
                            waited: Some(joined.elapsed()),
                            cache_age: None,
                            stale: false,
                        });
                    }
                    let replaced = self
                        .table
                        .current(&key)
                        .is_some_and(|now| !Arc::ptr_eq(&now, &flight));
                    if replaced {
                        // Somebody else took over: wait for the new leader.
                        continue;
                    }
                }
                OnWaitTimeout::Stale => {
                    if let Lookup::Stale { answer, age } | Lookup::Fresh { answer, age, .. } =
                        self.cache.get(&ask.fp)
                    {
                        let mut d = Delivery::done(Outcome::CacheHit, answer);
                        d.cache_age = Some(age);
                        d.stale = true;
                        d.waited = Some(joined.elapsed());
                        return Ok(d);
                    }
                }
                OnWaitTimeout::Fail => {}
            }
            self.metrics.wait_timeout(ask.tenant, &ask.route.name);
            return Err(ApiError::WaitTimeout {
                waited: max_wait,
                retry_after: retry_after_with_jitter(max_wait),
            });
        }
    }

    fn spawn_leader(&self, ask: &Ask<'_>, target: &Target, ticket: LeaderTicket) {
        let job = leader::LeaderJob {
            ticket,
            tenant: ask.tenant.clone(),
            route: ask.route.clone(),
            target: target.index,
            body: ask.route.body_for(target, ask.body),
            fp: ask.fp,
            read_cache: ask.read_cache,
            read_negative: ask.read_negative,
            write_cache: ask.write_cache,
            pinned: ask.only_target.is_some(),
            cache: self.cache.clone(),
            shared: self.shared.clone(),
            metrics: self.metrics.clone(),
        };
        tokio::spawn(leader::lead(job));
    }
}

/// The outcome of a request that started a local flight, once the flight
/// knows where its answer came from (the shared cache, another replica).
fn reported(outcome: Outcome, flight: &Flight) -> Outcome {
    if outcome != Outcome::Leader {
        return outcome;
    }
    match flight.origin() {
        Origin::Upstream => Outcome::Leader,
        Origin::Cache => Outcome::CacheHit,
        Origin::Negative => Outcome::NegativeHit,
        Origin::Remote => Outcome::Follower,
    }
}

/// `Retry-After` for a follower that gave up: the wait window plus a random
/// 0..=2 s, so released waiters do not all come back at once.
fn retry_after_with_jitter(max_wait: Duration) -> u64 {
    let base = max_wait.as_secs_f64().ceil().max(1.0) as u64;
    base + rand::rng().random_range(0..=2)
}
