//! Coalescing: one upstream call per identical task in flight, on one
//! target (docs/design.md, "Coalescing and the caches").
//!
//! [`Coalescer::via_target`] is the flight stage of the request path: a
//! task's negative cache on that target, then its flight. The first request
//! for a fingerprint leads: it spawns a detached task ([`leader`]) that
//! calls the provider, fills the flight and the cache, so a client that
//! hangs up cancels nothing. Every other request with the same fingerprint
//! follows: it waits, bounded by `coalesce.max_wait`, for the leader's
//! first byte, then reads the same answer. [`Coalescer::via_target_batch`]
//! does the same for several tasks at once (the items of an embeddings
//! batch): the tasks it leads share one upstream call. The result cache
//! before this stage, and the walk over a route's targets around it, are
//! the core's ([`crate::task`]).

pub mod leader;
pub mod redis;
pub mod table;

use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::Rng;
use serde_json::{Map, Value};

use crate::answer::Answer;
use crate::budgets::{BudgetError, Payer, Reservation};
use crate::cache::{Lookup, ResultCache};
use crate::config::OnWaitTimeout;
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::metrics::Metrics;
use crate::outcome::Outcome;
use crate::routes::{Route, Target};
use crate::telemetry::{Kind, Trace};

pub use leader::Wire;
pub use table::{Flight, FlightKey, FlightTable, Head, Joined, LeaderTicket, Origin};

use self::redis::RedisFlights;

/// Why coalescing gave a request no answer at all (an answer that is an
/// error is a [`Delivery`] like any other).
#[derive(Debug, thiserror::Error)]
pub enum FlightError {
    /// A follower's wait for its leader ran out.
    #[error("waited {waited:?} for an identical request in flight")]
    WaitTimeout { waited: Duration, retry_after: u64 },
    /// A parked request's body no longer parses (a bug).
    #[error("a parked request's body no longer parses")]
    BodyLost,
    /// The call this request would lead does not fit its budget.
    #[error(transparent)]
    Budget(#[from] crate::budgets::BudgetError),
}

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
    fn live(outcome: Outcome, flight: Arc<Flight>) -> Delivery {
        Delivery {
            outcome,
            source: Source::Live(flight),
            waited: None,
            cache_age: None,
            stale: false,
        }
    }

    pub fn done(outcome: Outcome, answer: Arc<Answer>) -> Delivery {
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

/// One task on one target, under the rules the core derived for it.
pub struct Ask<'a> {
    pub tenant: &'a Arc<str>,
    pub route: &'a Arc<Route>,
    /// Borrowed, as the rest: a request keeps its `Ask` while it waits.
    pub fp: &'a Fingerprint,
    /// The task's request (the leader sends it, through `wire`, with the
    /// target's model).
    pub body: &'a RequestBody,
    /// The endpoint: how a call is made of requests and its answer read.
    pub wire: &'static dyn Wire,
    /// The leader may take a cached answer it finds (the request that
    /// found the cache empty just before may lead just after the previous
    /// flight filled it).
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
    /// A job attempt: only an answer of this very target serves it.
    pub pinned: bool,
    /// A job attempt's rule: how long a late answer still counts. A
    /// follower then waits that long (`None`: the route's `max_wait`), and
    /// a call this request leads may take that long, or the provider's
    /// `timeout` if longer (`None`: the provider's `timeout`).
    pub late: Option<Duration>,
    /// The span of the request (or attempt) asking, when traces are on.
    pub trace: Option<&'a Trace>,
    /// Who pays for a call this request leads (none: nobody counts it).
    pub payer: Option<&'a Payer>,
}

/// A request's body as the flights need it: parsed while the request may
/// lead (the leader sends it upstream). A follower lets its parse go while
/// it waits when the bytes it arrived in are at hand, and parses them again
/// only if it has to lead after all (a take-over, a failover): the parse is
/// about 1 KiB of maps and strings per parked request, while the bytes
/// stay in the connection's read buffer anyway.
#[derive(Debug)]
pub struct RequestBody {
    parsed: Mutex<Option<Arc<Map<String, Value>>>>,
    raw: Option<Bytes>,
    /// The client's headers that change the answer (sent on to a target of
    /// the request's dialect); boxed, and none for most requests: every
    /// waiting follower holds this.
    forwarded: Option<Box<Forwarded>>,
}

impl RequestBody {
    /// A body that stays parsed (no bytes to parse again: a job's request
    /// read from the store).
    pub fn kept(parsed: Arc<Map<String, Value>>) -> RequestBody {
        RequestBody {
            parsed: Mutex::new(Some(parsed)),
            raw: None,
            forwarded: None,
        }
    }

    /// The same body, with the client's answer-changing headers.
    pub fn with_forwarded(self, forwarded: Forwarded) -> RequestBody {
        RequestBody {
            forwarded: (!forwarded.is_empty()).then(|| Box::new(forwarded)),
            ..self
        }
    }

    /// The client's answer-changing headers.
    pub fn forwarded(&self) -> &Forwarded {
        self.forwarded
            .as_deref()
            .unwrap_or(&crate::fingerprint::NO_HEADERS)
    }

    /// A body parsed from `raw`, the JSON object it arrived as.
    pub fn from_bytes(parsed: Arc<Map<String, Value>>, raw: Bytes) -> RequestBody {
        RequestBody {
            parsed: Mutex::new(Some(parsed)),
            raw: Some(raw),
            forwarded: None,
        }
    }

    /// The parsed body (parsed again if a follower let it go).
    pub fn get(&self) -> Result<Arc<Map<String, Value>>, FlightError> {
        let mut parsed = self.parsed.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(map) = &*parsed {
            return Ok(map.clone());
        }
        // Only a body that has bytes lets its parse go, and those bytes
        // parsed into an object once already.
        let map = self
            .raw
            .as_deref()
            .and_then(|raw| serde_json::from_slice::<Map<String, Value>>(raw).ok())
            .map(Arc::new)
            .ok_or(FlightError::BodyLost)?;
        *parsed = Some(map.clone());
        Ok(map)
    }

    /// Lets the parse go if the bytes can give it back (a follower about to
    /// wait).
    pub fn park(&self) {
        if self.raw.is_some() {
            *self.parsed.lock().unwrap_or_else(PoisonError::into_inner) = None;
        }
    }

    /// True while the body is held parsed.
    #[cfg(test)]
    fn is_parsed(&self) -> bool {
        self.parsed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }
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

    /// The result cache's fresh answer for `fp`, as a delivery.
    pub fn cached(&self, fp: &Fingerprint) -> Option<Delivery> {
        match self.cache.get(fp) {
            Lookup::Fresh { answer, age, .. } => {
                let mut d = Delivery::done(Outcome::CacheHit, answer);
                d.cache_age = Some(age);
                Some(d)
            }
            _ => None,
        }
    }

    /// One task on one target: its negative cache, then its flight.
    pub async fn via_target(
        &self,
        ask: &Ask<'_>,
        target: &Target,
    ) -> Result<Delivery, FlightError> {
        match self.join(ask, target) {
            Step::Done(d) => Ok(d),
            Step::Lead(ticket) => {
                let outcome = if ask.coalesce {
                    Outcome::Leader
                } else {
                    Outcome::Bypass
                };
                self.lead(ask, target, ticket, outcome).await
            }
            Step::Follow(flight) => self.follow(ask, target, flight).await,
        }
    }

    /// Several tasks on one target: each its negative cache and its flight,
    /// as [`Coalescer::via_target`], except that the tasks this request
    /// leads share one upstream call. The deliveries are in the tasks'
    /// order.
    pub async fn via_target_batch(
        &self,
        asks: &[Ask<'_>],
        target: &Target,
    ) -> Vec<Result<Delivery, FlightError>> {
        let mut out: Vec<Option<Result<Delivery, FlightError>>> =
            std::iter::repeat_with(|| None).take(asks.len()).collect();
        let mut led = Vec::new();
        let mut following = Vec::new();
        for (i, ask) in asks.iter().enumerate() {
            match self.join(ask, target) {
                Step::Done(d) => out[i] = Some(Ok(d)),
                Step::Lead(ticket) => match ask.body.get() {
                    Ok(request) => {
                        let outcome = if ask.coalesce {
                            Outcome::Leader
                        } else {
                            Outcome::Bypass
                        };
                        led.push((i, outcome, ticket, request));
                    }
                    Err(e) => out[i] = Some(Err(e)),
                },
                Step::Follow(flight) => following.push((i, flight)),
            }
        }
        // Led before anybody waits: a task may follow another of the same
        // batch. The call is reserved for as one: the tasks share a payer.
        if let Some(first) = asks.first()
            && !led.is_empty()
        {
            let requests: Vec<Arc<Map<String, Value>>> =
                led.iter().map(|(.., r)| r.clone()).collect();
            let reserved = match first.payer {
                Some(_) => Box::pin(self.reserve(first, target, &requests)).await,
                None => Ok(None),
            };
            match reserved {
                Ok(reservation) => {
                    let mut flights = Vec::with_capacity(led.len());
                    for (i, outcome, ticket, request) in led {
                        out[i] = Some(Ok(Delivery::live(outcome, ticket.flight.clone())));
                        flights.push((ticket, request));
                    }
                    self.spawn_leader(first, target, flights, reservation);
                }
                Err(e) => {
                    for (i, _, ticket, _) in led {
                        ticket.abandon();
                        out[i] = Some(Err(FlightError::Budget(e.clone())));
                    }
                }
            }
        }
        let followed =
            futures_util::future::join_all(following.into_iter().map(|(i, flight)| async move {
                (i, self.follow(&asks[i], target, flight).await)
            }))
            .await;
        for (i, d) in followed {
            out[i] = Some(d);
        }
        out.into_iter()
            .map(|d| d.unwrap_or(Err(FlightError::BodyLost)))
            .collect()
    }

    /// The first step on a target: the negative cache, then the flight
    /// table (or a private flight when the task does not coalesce).
    fn join(&self, ask: &Ask<'_>, target: &Target) -> Step {
        if ask.read_negative
            && let Some((answer, age)) = self.cache.negative(ask.fp, target.index)
        {
            let mut d = Delivery::done(Outcome::NegativeHit, answer);
            d.cache_age = Some(age);
            return Step::Done(d);
        }
        let key = FlightKey {
            fp: *ask.fp,
            target: target.index,
        };
        let lease = ask.route.config.coalesce.lease;
        if !ask.coalesce {
            return Step::Lead(self.table.private(key, lease));
        }
        match self.table.join(key, lease) {
            Joined::Leader(ticket) => Step::Lead(ticket),
            Joined::Follower(flight) => Step::Follow(flight),
        }
    }

    /// A follower's wait for its flight's first byte, bounded by its
    /// `max_wait`; when the wait runs out, the route's rule decides.
    async fn follow(
        &self,
        ask: &Ask<'_>,
        target: &Target,
        mut flight: Arc<Flight>,
    ) -> Result<Delivery, FlightError> {
        // The key and the lease are read again where they are used: kept in
        // variables, they would live through the wait in every follower's
        // state.
        let key = || FlightKey {
            fp: *ask.fp,
            target: target.index,
        };
        let lease = || ask.route.config.coalesce.lease;
        let max_wait = ask.late.unwrap_or_else(|| ask.route.max_wait());
        loop {
            ask.body.park();
            let joined = Instant::now();
            if flight.head(Some(joined + max_wait)).await.is_some() {
                if flight.abandoned() {
                    // Its leader could not pay for the call: this request
                    // joins again, and leads (paying itself) or follows
                    // whoever does.
                    match self.table.join(key(), lease()) {
                        Joined::Follower(now) => {
                            flight = now;
                            continue;
                        }
                        Joined::Leader(ticket) => {
                            let mut d =
                                Box::pin(self.lead(ask, target, ticket, Outcome::Leader)).await?;
                            d.waited = Some(joined.elapsed());
                            return Ok(d);
                        }
                    }
                }
                let waited = joined.elapsed();
                self.metrics.wait(ask.tenant, &ask.route.name, waited);
                // The wait, linked to the call that answered it.
                if let Some(t) = ask.trace {
                    let answered_by = flight.call_span().into_iter().collect();
                    t.child(
                        "coalesce wait",
                        Kind::Internal,
                        Some(joined),
                        answered_by,
                        vec![],
                    )
                    .end();
                }
                let mut d = Delivery::live(Outcome::Follower, flight);
                d.waited = Some(waited);
                return Ok(d);
            }
            // The wait ran out: the route's rule decides, and nobody
            // re-attacks the provider while the leader's lease is alive.
            match ask.route.config.coalesce.on_wait_timeout {
                OnWaitTimeout::Lead => {
                    if let Some(ticket) = self.table.take_over(&flight, lease()) {
                        tracing::warn!(route = %ask.route.name, fp = %ask.fp, "leader lease expired; taking over");
                        let mut d =
                            Box::pin(self.lead(ask, target, ticket, Outcome::Leader)).await?;
                        d.waited = Some(joined.elapsed());
                        return Ok(d);
                    }
                    let replaced = self
                        .table
                        .current(&key())
                        .is_some_and(|now| !Arc::ptr_eq(&now, &flight));
                    if replaced {
                        // Somebody else took over: wait for the new leader
                        // (or lead, if its flight ended meanwhile).
                        match self.table.join(key(), lease()) {
                            Joined::Follower(now) => {
                                flight = now;
                                continue;
                            }
                            Joined::Leader(ticket) => {
                                let mut d =
                                    Box::pin(self.lead(ask, target, ticket, Outcome::Leader))
                                        .await?;
                                d.waited = Some(joined.elapsed());
                                return Ok(d);
                            }
                        }
                    }
                }
                OnWaitTimeout::Stale => {
                    if let Lookup::Stale { answer, age } | Lookup::Fresh { answer, age, .. } =
                        self.cache.get(ask.fp)
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
            return Err(FlightError::WaitTimeout {
                waited: max_wait,
                retry_after: retry_after_with_jitter(max_wait),
            });
        }
    }

    /// Leads `ticket`'s flight: reserves the call against the payer's
    /// budgets, then spawns its leader. A call that does not fit is not
    /// made: the flight is abandoned (its followers join again, and one of
    /// them leads on its own budget) and this request gets the refusal
    /// (docs/design.md, "Keys and budgets").
    async fn lead(
        &self,
        ask: &Ask<'_>,
        target: &Target,
        ticket: LeaderTicket,
        outcome: Outcome,
    ) -> Result<Delivery, FlightError> {
        let request = match ask.body.get() {
            Ok(r) => r,
            Err(e) => {
                ticket.abandon();
                return Err(e);
            }
        };
        if ask.payer.is_none() {
            // Nobody pays: nothing to wait for.
            let flight = ticket.flight.clone();
            self.spawn_leader(ask, target, vec![(ticket, request)], None);
            return Ok(Delivery::live(outcome, flight));
        }
        // Boxed: a reservation's wait (the store, when a grant runs short)
        // would otherwise enlarge every leading request's future.
        let reserved = Box::pin(self.reserve(ask, target, std::slice::from_ref(&request))).await;
        match reserved {
            Ok(reservation) => {
                let flight = ticket.flight.clone();
                self.spawn_leader(ask, target, vec![(ticket, request)], reservation);
                Ok(Delivery::live(outcome, flight))
            }
            Err(e) => {
                ticket.abandon();
                Err(FlightError::Budget(e))
            }
        }
    }

    /// The reservation of a call to `target` for `requests`, when the
    /// request has a payer (token counts cost nothing).
    async fn reserve(
        &self,
        ask: &Ask<'_>,
        target: &Target,
        requests: &[Arc<Map<String, Value>>],
    ) -> Result<Option<Reservation>, BudgetError> {
        let Some(payer) = ask.payer else {
            return Ok(None);
        };
        let dialect = ask.wire.dialect();
        if dialect == Dialect::CountTokens {
            return Ok(None);
        }
        let embeddings = dialect == Dialect::Embeddings;
        let mut total: Option<Reservation> = None;
        for request in requests {
            let r = payer
                .reserve(target.price.as_ref(), &target.model, request, embeddings)
                .await?;
            total = Some(match total {
                None => r,
                Some(t) => t.join(r),
            });
        }
        Ok(total)
    }

    /// Spawns the leader of these flights on `target`: one upstream call
    /// for all of them, under `ask`'s rules (the batch's tasks share them).
    fn spawn_leader(
        &self,
        ask: &Ask<'_>,
        target: &Target,
        flights: Vec<(LeaderTicket, Arc<Map<String, Value>>)>,
        reservation: Option<Reservation>,
    ) {
        let job = leader::LeaderJob {
            flights,
            call: leader::Call {
                wire: ask.wire,
                tenant: ask.tenant.clone(),
                route: ask.route.clone(),
                target: target.index,
                read_cache: ask.read_cache,
                read_negative: ask.read_negative,
                write_cache: ask.write_cache,
                pinned: ask.pinned,
                call_timeout: ask.late.map_or(target.provider.timeout, |late| {
                    late.max(target.provider.timeout)
                }),
                forwarded: ask.body.forwarded().clone(),
                cache: self.cache.clone(),
                metrics: self.metrics.clone(),
                trace: ask.trace.cloned(),
                reservation: std::sync::Mutex::new(reservation),
                rate_windows: self.shared.get().cloned(),
            },
            shared: self.shared.clone(),
        };
        tokio::spawn(leader::lead(job));
    }
}

/// Where a task stands after its first step on a target.
enum Step {
    /// Answered (the negative cache).
    Done(Delivery),
    /// This request leads the flight (or a private one).
    Lead(LeaderTicket),
    /// Another request leads it.
    Follow(Arc<Flight>),
}

/// The outcome of a request that started a local flight, once the flight
/// knows where its answer came from (the shared cache, another replica).
pub fn reported(outcome: Outcome, flight: &Flight) -> Outcome {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::Failure;
    use crate::config::{Config, Source as ConfigSource};
    use crate::providers::Providers;
    use crate::routes::Routes;
    use std::str::FromStr;

    const PROMPT: &str = "what does a parked follower keep?";

    /// A coalescer and the route `bot` (the in-process mock provider)
    /// with these `[routes.coalesce]` settings.
    fn setup(coalesce: &str) -> (Coalescer, Arc<Route>) {
        setup_with("", coalesce)
    }

    /// [`setup`] with more keys for the provider's table.
    pub(super) fn setup_with(provider: &str, coalesce: &str) -> (Coalescer, Arc<Route>) {
        let toml = format!(
            "[[providers]]\nname = \"p\"\nkind = \"mock\"\n{provider}\n\n[[routes]]\nmodel = \"bot\"\n\
             targets = [{{ provider = \"p\", model = \"m\" }}]\n[routes.coalesce]\n{coalesce}\n"
        );
        let config = Config::from_toml_str(&toml, ConfigSource::Embedded, false).unwrap();
        let metrics = Arc::new(Metrics::new(&config));
        let providers = Providers::from_config(&config).unwrap();
        let routes = Routes::from_config(&config, &providers, &metrics).unwrap();
        let route = routes.get("bot").unwrap().clone();
        let cache = Arc::new(ResultCache::new(100, 1 << 20).unwrap());
        (Coalescer::new(cache, metrics), route)
    }

    fn body() -> RequestBody {
        let raw = serde_json::to_vec(&serde_json::json!({
            "model": "bot",
            "messages": [{"role": "user", "content": PROMPT}],
        }))
        .unwrap();
        let parsed: Map<String, Value> = serde_json::from_slice(&raw).unwrap();
        RequestBody::from_bytes(Arc::new(parsed), Bytes::from(raw))
    }

    pub(super) fn fp() -> Fingerprint {
        let hex = blake3::hash(PROMPT.as_bytes()).to_hex().to_string();
        Fingerprint::from_str(&format!("v1:{hex}")).unwrap()
    }

    fn ask<'a>(tenant: &'a Arc<str>, route: &'a Arc<Route>, body: &'a RequestBody) -> Ask<'a> {
        static FP: std::sync::LazyLock<Fingerprint> = std::sync::LazyLock::new(fp);
        Ask {
            tenant,
            route,
            fp: &FP,
            body,
            wire: &crate::endpoints::CHAT,
            read_cache: true,
            read_negative: true,
            write_cache: true,
            coalesce: true,
            pinned: false,
            late: None,
            trace: None,
            payer: None,
        }
    }

    /// Joins the flight of [`fp`] on the first target as its leader (a
    /// leader that calls nobody: the test finishes its flight, or not).
    pub(super) fn lead(coalescer: &Coalescer, lease: Duration) -> LeaderTicket {
        let key = FlightKey {
            fp: fp(),
            target: 0,
        };
        match coalescer.table.join(key, lease) {
            Joined::Leader(ticket) => ticket,
            Joined::Follower(_) => panic!("the table had a flight already"),
        }
    }

    fn success(text: &str) -> Arc<Answer> {
        let mut a = Answer::from_failure(Failure::Timeout, "x", "p".into(), "m".into());
        a.failure = None;
        a.status = reqwest::StatusCode::OK;
        a.body = Bytes::from(text.to_string());
        Arc::new(a)
    }

    #[test]
    fn an_automatic_wait_is_one_and_a_half_p99s_clamped_to_300_ms_and_the_timeout() {
        let (_, route) = setup_with("timeout = \"10s\"", "max_wait = \"auto\"");
        // Nothing observed yet: as long as a leader may take.
        assert_eq!(route.max_wait(), Duration::from_secs(10));
        route.latency.record(Duration::from_millis(100));
        assert_eq!(route.max_wait(), Duration::from_millis(300));
        for _ in 0..200 {
            route.latency.record(Duration::from_secs(2));
        }
        assert_eq!(route.max_wait(), Duration::from_secs(3));
        for _ in 0..200 {
            route.latency.record(Duration::from_secs(60));
        }
        assert_eq!(route.max_wait(), Duration::from_secs(10));
    }

    /// With a Redis backend, a leader may spend up to the Redis timeout
    /// before it calls the provider: an automatic wait adds it (a wave
    /// while Redis hangs timed its followers out otherwise).
    #[test]
    fn an_automatic_wait_allows_for_the_redis_timeout() {
        let toml = "[coalescing]\nbackend = \"redis://127.0.0.1:6379\"\nredis_timeout = \"250ms\"\n\
                    [[providers]]\nname = \"p\"\nkind = \"mock\"\n\n[[routes]]\nmodel = \"bot\"\n\
                    targets = [{ provider = \"p\", model = \"m\" }]\n";
        let config = Config::from_toml_str(toml, ConfigSource::Embedded, false).unwrap();
        let metrics = Arc::new(Metrics::new(&config));
        let providers = Providers::from_config(&config).unwrap();
        let routes = Routes::from_config(&config, &providers, &metrics).unwrap();
        let route = routes.get("bot").unwrap();
        route.latency.record(Duration::from_millis(10));
        assert_eq!(route.max_wait(), Duration::from_millis(550));
        // A fixed wait is the operator's and stays as written.
        let (_, fixed) = setup_with("", "max_wait = \"2s\"");
        assert_eq!(fixed.max_wait(), Duration::from_secs(2));
    }

    #[test]
    fn a_body_with_bytes_lets_its_parse_go_and_gets_it_back() {
        let b = body();
        let before = b.get().unwrap();
        b.park();
        assert!(!b.is_parsed());
        let again = b.get().unwrap();
        assert_eq!(again, before);
        assert!(b.is_parsed());
        // Without bytes, nothing could give the parse back: it stays.
        let kept = RequestBody::kept(before.clone());
        kept.park();
        assert!(kept.is_parsed());
        assert!(Arc::ptr_eq(&kept.get().unwrap(), &before));
    }

    #[tokio::test]
    async fn a_follower_waits_without_its_parse() {
        let (coalescer, route) = setup("");
        let tenant: Arc<str> = "acme".into();
        let ticket = lead(&coalescer, Duration::from_secs(30));
        let body = body();
        let ask = ask(&tenant, &route, &body);
        let mut following = std::pin::pin!(coalescer.via_target(&ask, &route.targets[0]));
        // One poll: the request joins the flight and waits.
        assert!(futures_util::poll!(following.as_mut()).is_pending());
        assert!(!body.is_parsed(), "a parked follower still holds its parse");
        ticket.flight.finish(success("shared"));
        let d = following.await.unwrap();
        assert_eq!(d.outcome, Outcome::Follower);
        assert_eq!(d.answer().await.body, "shared");
        // The request log (with `log.bodies`) gets the body back.
        assert_eq!(body.get().unwrap()["messages"][0]["content"], PROMPT);
    }

    #[tokio::test]
    async fn a_follower_that_takes_over_sends_its_request_parsed_again() {
        let (coalescer, route) = setup("max_wait = \"50ms\"\non_wait_timeout = \"lead\"");
        let tenant: Arc<str> = "acme".into();
        // A leader that hangs and never renews its (short) lease.
        let _hung = lead(&coalescer, Duration::from_millis(10));
        let body = body();
        let d = coalescer
            .via_target(&ask(&tenant, &route, &body), &route.targets[0])
            .await
            .unwrap();
        assert_eq!(d.outcome, Outcome::Leader);
        let answer = d.answer().await;
        assert!(answer.is_success(), "{answer:?}");
        // The mock provider echoes the last user message: the request that
        // went upstream is this follower's own.
        let text = String::from_utf8_lossy(&answer.body);
        assert!(text.contains(PROMPT), "{text}");
    }
}
