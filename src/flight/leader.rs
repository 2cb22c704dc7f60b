//! The leader task: one upstream call for one or more flights, detached
//! from the clients that started them.
//!
//! A call usually answers one flight (a chat completion). An endpoint whose
//! tasks can share a call (the items of an embeddings batch) hands the
//! leader several flights at once: one call carries all of them, and its
//! answer is split into one answer per flight by the endpoint's [`Wire`].
//!
//! For each flight the leader first asks the shared layer (Redis, when
//! configured) whether another replica already has the answer or the
//! flight; the flights nobody else answers go into the call. It renews
//! their leases while the call lives, relays the provider's head and body
//! into a single flight as they arrive, in whole SSE events (on a route
//! with a contract: only once the whole answer passed it), turns an answer
//! past the provider's size limit or a 2xx the endpoint cannot read into a
//! failure, records the call's outcome in the target's circuit breaker,
//! then, flight by flight, completes the shared flight (a leader whose
//! lease a newer one took writes nothing and hands its waiters the newer
//! answer), writes its own replica's result (or negative) cache, and ends
//! the flight. Each [`LeaderTicket`] is dropped on every path, which
//! removes its flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use futures_util::future::join_all;
use serde_json::{Map, Value};

use crate::answer::{Answer, Failure, Form};
use crate::cache::{ResultCache, jittered_ttl};
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::metrics::Metrics;
use crate::providers::breaker::Health;
use crate::routes::{Route, Target};
use crate::telemetry::{Attribute, EndOnDrop, Kind, Trace, attr, provider_name};
use crate::translate::{Prepared, Refusal};

use super::redis::{Begin, Completion, Lease, RedisFlights, Remote};
use super::table::{Flight, Head, LeaderTicket, Origin};

/// An endpoint's part of an upstream call: what it sends and how its
/// answer is read. The leader knows no wire format; each dialect (chat
/// completions, Messages, Responses, token counts, embeddings) implements
/// this once.
pub trait Wire: Send + Sync + 'static {
    /// The dialect of the requests, and of the answers the flights keep.
    fn dialect(&self) -> Dialect;
    /// The call to `target` that carries these tasks' requests, in order
    /// (one request, or several when tasks share a call), for the task
    /// `fp` (a one-task call's): sent as the requests' dialect, translated
    /// into the target's, or answered here; or why the target cannot take
    /// them.
    fn prepare(
        &self,
        route: &Route,
        target: &Target,
        requests: &[Arc<Map<String, Value>>],
        forwarded: &Forwarded,
        fp: &Fingerprint,
    ) -> Result<Prepared, Refusal>;
    /// `answer` (a 2xx to a call for these requests, in the requests'
    /// dialect) if it is a whole, well-formed answer, else the failure that
    /// replaces it (logged here, with why).
    fn check(
        &self,
        answer: Answer,
        requests: &[Arc<Map<String, Value>>],
    ) -> Result<Answer, Box<Answer>>;
    /// A checked answer to a call for these requests as one answer per
    /// request, in order.
    fn split(&self, answer: Answer, requests: &[Arc<Map<String, Value>>]) -> Vec<Answer>;
}

pub struct LeaderJob {
    /// The flights this call answers, each with the request its task sends.
    pub flights: Vec<(LeaderTicket, Arc<Map<String, Value>>)>,
    pub call: Call,
    pub shared: Arc<OnceLock<Arc<RedisFlights>>>,
}

/// What every flight of one leader's call shares: the call's target and
/// rules, and the handles it writes to.
pub struct Call {
    pub wire: &'static dyn Wire,
    pub tenant: Arc<str>,
    pub route: Arc<Route>,
    pub target: usize,
    pub read_cache: bool,
    pub read_negative: bool,
    pub write_cache: bool,
    /// A job attempt: it names its target, so a cached answer serves it only
    /// if that target produced it (the attempt's row names its provider and
    /// model; another target's answer would be credited to the wrong one).
    pub pinned: bool,
    /// The bound of the upstream call: the provider's timeout, or longer
    /// for a job attempt that still listens for a late answer.
    pub call_timeout: Duration,
    pub cache: Arc<ResultCache>,
    pub metrics: Arc<Metrics>,
    /// The span of the request (or attempt) that leads, when traces are on:
    /// the provider call's span is its child.
    pub trace: Option<Trace>,
    /// The client's answer-changing headers (identical for every flight of
    /// the call: they are in the fingerprint).
    pub forwarded: Forwarded,
    /// The call's reservation against its payer's budgets: settled at the
    /// call's real cost once its answer is in, released (dropped) if no
    /// call is made (another replica's flight or cache answered).
    pub reservation: std::sync::Mutex<Option<crate::budgets::Reservation>>,
    /// Where a key's tokens per minute are counted for every replica
    /// (Redis, when the gateway has it).
    pub rate_windows: Option<Arc<RedisFlights>>,
}

impl Call {
    /// Whether a cached answer may finish a flight of this call.
    fn may_serve(&self, answer: &Answer) -> bool {
        !self.pinned
            || self
                .route
                .targets
                .get(self.target)
                .is_some_and(|t| answer.provider == t.provider.name && answer.model == t.model)
    }
}

/// One flight this leader answers, with its task's request and, once it
/// leads the shared flight too, that lease.
struct Led {
    ticket: LeaderTicket,
    request: Arc<Map<String, Value>>,
    global: Option<(Arc<RedisFlights>, Lease)>,
}

impl Led {
    fn flight(&self) -> &Arc<Flight> {
        &self.ticket.flight
    }

    fn fp(&self) -> Fingerprint {
        self.ticket.flight.key.fp
    }
}

/// How long an ended flight's answer stays readable for followers on other
/// replicas that have not fetched it yet.
const RESULT_TTL: Duration = Duration::from_secs(60);

pub async fn lead(job: LeaderJob) {
    let LeaderJob {
        flights,
        call,
        shared,
    } = job;
    let shared = shared.get().cloned();
    // Each flight first looks where an answer may already be (this
    // replica's cache, then the shared layer), all at once.
    let found = join_all(
        flights
            .into_iter()
            .map(|(ticket, request)| resolve(&call, shared.clone(), ticket, request)),
    )
    .await;
    let mut calling = Vec::new();
    let mut following = Vec::new();
    for found in found {
        match found {
            Resolved::Done => {}
            Resolved::Lead(led) => calling.push(led),
            Resolved::Follow(led, shared, generation, token) => {
                following.push((led, shared, generation, token))
            }
        }
    }
    // Flights another replica leads are followed beside this call; one
    // whose remote leader died is led by a call of its own.
    let follow_all = join_all(
        following
            .into_iter()
            .map(|(led, shared, generation, token)| {
                follow_then_call(&call, led, shared, generation, token)
            }),
    );
    tokio::join!(call_and_settle(&call, calling), follow_all);
}

/// Where a flight's answer will come from.
enum Resolved {
    /// Answered already (a cache, local or shared).
    Done,
    /// This replica calls the provider for it.
    Lead(Led),
    /// Another replica leads it, under this generation; this replica
    /// waits with its own token.
    Follow(Led, Arc<RedisFlights>, u64, String),
}

/// This replica's cache, then the shared layer's caches and flight.
async fn resolve(
    call: &Call,
    shared: Option<Arc<RedisFlights>>,
    ticket: LeaderTicket,
    request: Arc<Map<String, Value>>,
) -> Resolved {
    let flight = ticket.flight.clone();
    let fp = flight.key.fp;
    // A request that became leader just after the previous flight ended
    // finds that flight's answer in the cache: no second call.
    if call.read_cache
        && let Some(answer) = call.cache.fresh(&fp)
        && call.may_serve(&answer)
    {
        flight.set_origin(Origin::Cache);
        flight.finish(answer);
        return Resolved::Done;
    }
    let mut led = Led {
        ticket,
        request,
        global: None,
    };
    let Some(shared) = shared else {
        return Resolved::Lead(led);
    };
    let cfg = &call.route.config;
    let lease = cfg.coalesce.lease;
    let token = uuid::Uuid::now_v7().simple().to_string();
    let key = flight.key;
    let mut begin = shared
        .begin(&key, &token, lease, call.read_cache, call.read_negative)
        .await;
    if let Ok(Begin::Hit(answer, _)) = &begin
        && !call.may_serve(answer)
    {
        // Another target's answer: this attempt asks its own target.
        begin = shared
            .begin(&key, &token, lease, false, call.read_negative)
            .await;
    }
    match begin {
        Ok(Begin::Hit(answer, left)) => {
            if left > Duration::ZERO {
                call.cache.put(fp, answer.clone(), left, cfg);
            }
            flight.set_origin(Origin::Cache);
            flight.finish(answer);
            Resolved::Done
        }
        Ok(Begin::Negative(answer)) => {
            flight.set_origin(Origin::Negative);
            flight.finish(answer);
            Resolved::Done
        }
        Ok(Begin::Lead(generation)) => {
            led.global = Some((shared, Lease { generation, token }));
            Resolved::Lead(led)
        }
        Ok(Begin::Follow(generation)) => Resolved::Follow(led, shared, generation, token),
        Err(e) => {
            shared.failed("begin", &e);
            Resolved::Lead(led)
        }
    }
}

/// Follows another replica's flight; if its leader died and this replica
/// took the flight over, or Redis failed, calls the provider for it.
async fn follow_then_call(
    call: &Call,
    mut led: Led,
    shared: Arc<RedisFlights>,
    awaited: u64,
    token: String,
) {
    match follow_remote(call, led.flight(), &shared, awaited, &token).await {
        Followed::Answer(answer) => {
            led.flight().set_origin(Origin::Remote);
            led.flight().finish(answer);
        }
        Followed::Lead(lease) => {
            tracing::warn!(fp = %led.fp(), "the leading replica's lease expired; taking the flight over");
            led.global = Some((shared, lease));
            call_and_settle(call, vec![led]).await;
        }
        Followed::Local => call_and_settle(call, vec![led]).await,
    }
}

/// Calls the provider for `led` (one call for all of them), then settles
/// each flight with its part of the answer.
async fn call_and_settle(call: &Call, led: Vec<Led>) {
    if led.is_empty() {
        return;
    }
    let progress = Progress::new();
    let mut answer = tokio::select! {
        a = upstream(call, &led, &progress) => a,
        () = heartbeat(call, &led, &progress) => return,
    };
    if let Some(t) = call.route.targets.get(call.target) {
        t.breaker.record(Health::of(&answer));
        // What the call spent, whatever becomes of its answer (a contract
        // violation was paid for too).
        let tokens = answer.tokens();
        if let Some(tokens) = tokens {
            call.metrics.spent(
                &call.tenant,
                &call.route.name,
                &t.provider.name,
                tokens,
                t.price,
            );
        }
        // Settled, in the store, before anybody gets the answer's end: a
        // process killed after answering has recorded what it cost.
        let reservation = call
            .reservation
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(r) = reservation {
            if let (Some(shared), Some(key), Some(t)) = (&call.rate_windows, r.key(), &tokens)
                && key.tokens.is_some()
            {
                let minute = u64::try_from(crate::store::now_ms()).unwrap_or(0) / 60_000;
                let n = t.input.saturating_add(t.output);
                let _ = shared
                    .count_window(&format!("tpm:{}", key.id), minute, n)
                    .await;
            }
            // A failure costs nothing (providers bill answers); an unknown
            // price, nothing either (`budgets.unpriced` let it through).
            let cost = match &t.price {
                Some(price) if answer.is_success() => {
                    crate::budgets::real_cost(price, tokens.as_ref(), r.amount)
                }
                _ => 0,
            };
            r.settle(cost, tokens.as_ref()).await;
        }
    }
    // On a contract route nothing reaches a follower, the cache or a job
    // before the answer is checked; `upstream` buffered a streamed answer,
    // which is released to the flight as one chunk once it passes.
    if let Some(contract) = &call.route.contract
        && call.wire.dialect() != Dialect::Embeddings
    {
        answer = crate::contracts::enforce(contract, &call.route.name, answer);
        if answer.is_success()
            && answer.form == Form::Stream
            && let [one] = led.as_slice()
        {
            one.flight().push(answer.body.clone());
        }
    }
    let answers = if answer.is_success() {
        let requests: Vec<_> = led.iter().map(|l| l.request.clone()).collect();
        call.wire.split(answer, &requests)
    } else {
        vec![answer; led.len()]
    };
    join_all(
        led.into_iter()
            .zip(answers)
            .map(|(led, answer)| settle(call, led, answer)),
    )
    .await;
}

/// Ends one flight with its answer: fenced by the shared layer first, then
/// this replica's caches, then the flight itself.
async fn settle(call: &Call, led: Led, mut answer: Answer) {
    let cfg = &call.route.config;
    let Led {
        ticket,
        request: _,
        global,
    } = led;
    let flight = &ticket.flight;
    let fp = flight.key.fp;
    // A local follower took this flight over while the call looked stuck:
    // its answer is the flight's, this late one goes nowhere.
    if let Some(next) = flight.successor() {
        tracing::warn!(fp = %fp, "a newer leader took this flight over: its answer is shared, not this late one");
        let theirs = next.done(None).await.unwrap_or_else(|| lost(call));
        flight.set_origin(Origin::Remote);
        flight.finish(theirs);
        return;
    }

    let mut answer_ttl = None;
    let mut negative_ttl = None;
    if call.write_cache {
        if answer.is_success() {
            if cfg.cache.enabled {
                let ttl = jittered_ttl(cfg.cache.ttl, cfg.cache.jitter);
                answer.cache_ttl = Some(ttl);
                answer_ttl = Some(ttl);
            }
        } else if let Some(ttl) = answer.negative_ttl(&cfg.cache) {
            answer.cache_ttl = Some(ttl);
            negative_ttl = Some(ttl);
        }
    }
    let answer = Arc::new(answer);
    // The shared layer decides first whether this answer is the flight's:
    // a leader that lost its lease to a newer one writes nothing anywhere,
    // not even into this replica's own cache, and its waiters get the newer
    // leader's answer.
    let mut global = global;
    while let Some((shared, lease)) = global.take() {
        let completed = shared
            .complete(
                &flight.key,
                &lease,
                &answer,
                answer_ttl,
                negative_ttl,
                RESULT_TTL,
            )
            .await;
        let newer = match completed {
            Ok(Completion::Accepted) => break,
            Err(e) => {
                shared.failed("complete", &e);
                break;
            }
            Ok(Completion::Answered(theirs)) => {
                tracing::warn!(fp = %fp, "a newer leader answered this flight: this late answer was not shared");
                let theirs = theirs.unwrap_or_else(|| lost(call));
                keep_remote(call, fp, &theirs);
                flight.set_origin(Origin::Remote);
                flight.finish(theirs);
                return;
            }
            Ok(Completion::Superseded(newer)) => newer,
        };
        tracing::warn!(fp = %fp, "a newer leader owns this flight: waiting for its answer instead of sharing this late one");
        match follow_remote(call, flight, &shared, newer, &lease.token).await {
            Followed::Answer(theirs) => {
                flight.set_origin(Origin::Remote);
                flight.finish(theirs);
                return;
            }
            // The newer leader died too and this replica leads again: the
            // answer at hand is as good as a new call's, under the new lease.
            Followed::Lead(lease) => global = Some((shared, lease)),
            // Redis failed meanwhile: the waiters here get this answer,
            // which nothing caches.
            Followed::Local => {
                flight.finish(answer);
                return;
            }
        }
    }
    if let Some(ttl) = answer_ttl {
        call.cache.put(fp, answer.clone(), ttl, cfg);
    }
    if let Some(ttl) = negative_ttl {
        call.cache
            .put_negative(fp, call.target, answer.clone(), ttl);
    }
    flight.finish(answer);
}

/// When the leader's call last showed a sign of life (it started, the head
/// came, a chunk came).
pub struct Progress {
    epoch: Instant,
    last_ms: AtomicU64,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            epoch: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn mark(&self) {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(now, Ordering::Relaxed);
    }

    fn idle(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.epoch.elapsed().saturating_sub(last)
    }
}

/// Renews the leases (local and shared) of the call's flights every
/// lease/3 while the call is alive. The call's timeout (the provider's, or
/// a job attempt's late-answer window) bounds the wait for the head and
/// every pause between chunks, so a call that has shown no sign of life for
/// longer than that is stuck: its leases are no longer renewed and lapse,
/// and a waiter may take a flight over. Never returns.
async fn heartbeat(call: &Call, led: &[Led], progress: &Progress) {
    let lease = call.route.config.coalesce.lease;
    let stuck_after = call.call_timeout + lease / 3;
    let mut tick = crate::lease::renewals(lease);
    let mut lost_shared = vec![false; led.len()];
    loop {
        tick.tick().await;
        if progress.idle() > stuck_after {
            continue;
        }
        for (led, lost) in led.iter().zip(lost_shared.iter_mut()) {
            led.flight().renew(lease);
            if let Some((shared, held)) = &led.global
                && !*lost
            {
                match shared.renew(&led.flight().key, held, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        *lost = true;
                        tracing::warn!(fp = %led.fp(), "lost the shared lease; the answer will not overwrite a newer one")
                    }
                    Err(e) => shared.failed("renew", &e),
                }
            }
        }
    }
}

/// The answer for waiters whose flight was answered by a newer leader
/// whose result is gone already.
fn lost(call: &Call) -> Arc<Answer> {
    Arc::new(Answer::from_failure(
        Failure::LeaderLost,
        "a newer call answered this request, and its answer is no longer at hand",
        "idem".into(),
        call.route.name.clone(),
    ))
}

/// Keeps another replica's answer in this replica's cache for as long as
/// the shared cache does.
fn keep_remote(call: &Call, fp: Fingerprint, answer: &Arc<Answer>) {
    let cfg = &call.route.config;
    if answer.is_success()
        && cfg.cache.enabled
        && call.write_cache
        && call.may_serve(answer)
        && let Some(ttl) = answer.cache_ttl
    {
        call.cache.put(fp, answer.clone(), ttl, cfg);
    }
}

/// How following another replica's flight ended.
enum Followed {
    /// Its answer (or a take-over's, or the shared cache's).
    Answer(Arc<Answer>),
    /// Nobody leads and nothing is cached: this replica took the flight.
    Lead(Lease),
    /// Redis failed.
    Local,
}

/// Waits for the flight of generation `awaited` on another replica, keeping
/// this replica's own flight lease alive meanwhile (its followers wait on
/// it). It waits as long as a replica holds the shared lease: a long
/// stream is waited for; a dead leader's lease lapses and one waiter takes
/// over. The local followers' `max_wait` bounds their own wait.
async fn follow_remote(
    call: &Call,
    flight: &Flight,
    shared: &RedisFlights,
    awaited: u64,
    token: &str,
) -> Followed {
    let lease = call.route.config.coalesce.lease;
    let keep_local = async {
        let mut tick = crate::lease::renewals(lease);
        loop {
            tick.tick().await;
            flight.renew(lease);
        }
    };
    // A job's attempt names its target: another target's cached answer
    // would be credited to the wrong one, so it does not take one here.
    let read_cache = call.read_cache && !call.pinned;
    let waited = tokio::select! {
        r = shared.wait_remote(&flight.key, awaited, token, lease, read_cache) => r,
        () = keep_local => return Followed::Local,
    };
    match waited {
        Ok(Remote::Done(answer)) => {
            keep_remote(call, flight.key.fp, &answer);
            Followed::Answer(answer)
        }
        Ok(Remote::Hit(answer, left)) => {
            if left > Duration::ZERO && call.write_cache {
                call.cache
                    .put(flight.key.fp, answer.clone(), left, &call.route.config);
            }
            Followed::Answer(answer)
        }
        Ok(Remote::Lead(generation)) => Followed::Lead(Lease {
            generation,
            token: token.to_string(),
        }),
        Err(e) => {
            shared.failed("wait", &e);
            Followed::Local
        }
    }
}

/// Calls the target for the flights of `led` and, when it answers one
/// flight with a stream, relays what arrives into that flight; an answer
/// past the provider's `max_answer_bytes`, or a 2xx the endpoint cannot
/// read, ends as a failure.
async fn upstream(call: &Call, led: &[Led], progress: &Progress) -> Answer {
    let (route, target, timeout) = (&call.route, call.target, call.call_timeout);
    let (tenant, metrics) = (&call.tenant, &call.metrics);
    let Some(t) = route.targets.get(target) else {
        return Answer::from_failure(
            Failure::LeaderLost,
            "no such target",
            "idem".into(),
            route.name.clone(),
        );
    };
    let provider = &t.provider;
    let requests: Vec<_> = led.iter().map(|l| l.request.clone()).collect();
    let fp = led
        .first()
        .map(Led::fp)
        .unwrap_or(Fingerprint::from_bytes([0; 32]));
    let sendable = match call.wire.prepare(route, t, &requests, &call.forwarded, &fp) {
        Ok(Prepared::Send(s)) => s,
        Ok(Prepared::Local(body)) => return local_answer(call, t, body),
        Err(refusal) => return refused(t, &refusal),
    };
    // Only a call for one flight relays as it arrives: a shared call's
    // answer is split once it is whole.
    let relay_to = match led {
        [one] => Some(one.flight()),
        _ => None,
    };
    let started = Instant::now();
    // The provider call's span: every flight it answers knows it (their
    // followers link to it), and the provider gets its `traceparent`.
    let span = call.trace.as_ref().map(|parent| {
        let span = parent.child(
            "provider call",
            Kind::Client,
            None,
            vec![],
            vec![
                Attribute::new(attr::PROVIDER, provider_name(provider.kind)),
                Attribute::new(attr::REQUEST_MODEL, t.model.to_string()),
                Attribute::new("idem.provider", provider.name.to_string()),
            ],
        );
        for l in led {
            l.flight().set_call_span(span.span_context());
        }
        span
    });
    let traceparent = span.as_ref().and_then(Trace::traceparent);
    let _ends = span.clone().map(EndOnDrop);
    let reply = match provider
        .send(
            sendable.dialect,
            &t.model,
            sendable.body,
            &sendable.forwarded,
            timeout,
            traceparent.as_deref(),
        )
        .await
    {
        Ok(r) => r,
        Err(e) => {
            if e.was_sent() {
                metrics.upstream_call(tenant, &provider.name, 0);
            }
            tracing::warn!(route = %route.name, provider = %provider.name, error = %e.with_causes(), "upstream call failed");
            if let Some(s) = &span {
                s.fail(e.to_string());
            }
            return e.answer(provider.name.clone(), t.model.clone());
        }
    };
    progress.mark();
    metrics.upstream_call(tenant, &provider.name, reply.status.as_u16());
    // A 401 or 403 refuses idem's own key (the client's never travels):
    // the operator's to fix, so the client is not told its key is wrong.
    if matches!(reply.status.as_u16(), 401 | 403) {
        let status = reply.status.as_u16();
        if provider.auth_warning_due() {
            tracing::warn!(
                provider = %provider.name,
                status,
                "the provider refused idem's credentials: check the key its api_key_env names \
                 (logged at most once a minute per provider)"
            );
        }
        if let Some(s) = &span {
            s.fail("the provider refused idem's credentials");
        }
        let message = format!(
            "provider {} refused idem's credentials ({status}): the gateway's key for it is \
             wrong or lacks access; tell the gateway's operator",
            provider.name
        );
        let mut failed = Answer::from_failure(
            Failure::Credentials,
            &message,
            provider.name.clone(),
            t.model.clone(),
        );
        failed.upstream_latency = started.elapsed();
        return failed;
    }
    // The reply in the requests' dialect, translated as it arrives when the
    // target speaks another.
    let reply = match sendable.reply {
        Some(translator) => {
            crate::translate::translated(reply, translator, provider.max_answer_bytes)
        }
        None => reply,
    };
    if let Some(s) = &span {
        s.set(vec![Attribute::new(
            attr::STATUS,
            i64::from(reply.status.as_u16()),
        )]);
    }
    let form = if reply.streaming {
        Form::Stream
    } else {
        Form::Plain
    };
    // Relay as it arrives, unless the route's contract must see the whole
    // answer first.
    let relay = match relay_to {
        Some(flight)
            if form == Form::Stream && reply.status.is_success() && route.contract.is_none() =>
        {
            Some(flight)
        }
        _ => None,
    };
    if let Some(flight) = relay {
        // Followers may start relaying now.
        flight.set_head(Head {
            status: reply.status,
            form,
        });
    }
    let limit = provider.max_answer_bytes;
    let mut body = reply.body;
    let mut whole = BytesMut::new();
    // How much of `whole` the flight has: whole events, and `[DONE]` only
    // once the answer is known to be a completion (see `RelayPoint`). A
    // client whose stream breaks off or turns out to be garbage gets an
    // error event of its own after them.
    let mut point = crate::sse::RelayPoint::new(call.wire.dialect().terminal());
    let mut relayed = 0;
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(bytes) => {
                progress.mark();
                // Checked before buffering: past the limit not a byte more is
                // kept, and dropping the body stops the download.
                if whole.len() + bytes.len() > limit {
                    metrics.upstream_answer_too_large(&provider.name);
                    if let Some(s) = &span {
                        s.fail("answer larger than max_answer_bytes");
                    }
                    tracing::warn!(route = %route.name, provider = %provider.name, limit, "upstream answer larger than max_answer_bytes");
                    let message = format!(
                        "the answer of provider {} is larger than its limit of {limit} bytes",
                        provider.name
                    );
                    let mut failed = Answer::from_failure(
                        Failure::TooLarge,
                        &message,
                        provider.name.clone(),
                        t.model.clone(),
                    );
                    failed.upstream_latency = started.elapsed();
                    return failed;
                }
                let start = whole.len();
                whole.extend_from_slice(&bytes);
                if let Some(flight) = relay {
                    let cut = point.advance(&whole);
                    if cut > relayed {
                        flight.push(if relayed == start {
                            bytes.slice(..cut - start)
                        } else {
                            Bytes::copy_from_slice(&whole[relayed..cut])
                        });
                        relayed = cut;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(route = %route.name, provider = %provider.name, error = %e.with_causes(), "upstream body broke off");
                if let Some(s) = &span {
                    s.fail(e.to_string());
                }
                return e.answer(provider.name.clone(), t.model.clone());
            }
        }
    }
    let latency = started.elapsed();
    if reply.status.is_success() {
        route.latency.record(latency);
    }
    let answer = Answer {
        dialect: call.wire.dialect(),
        status: reply.status,
        form,
        body: whole.freeze(),
        retry_after: reply.retry_after,
        failure: None,
        provider: provider.name.clone(),
        model: t.model.clone(),
        created_at: SystemTime::now(),
        upstream_latency: latency,
        cache_ttl: None,
        rendered: Default::default(),
    };
    // A 2xx the endpoint cannot read must not reach anybody as a success:
    // it becomes a failure here, which the followers, the caches and a job
    // see as such.
    if !answer.is_success() {
        return answer;
    }
    let answer = match call.wire.check(answer, &requests) {
        Ok(answer) => answer,
        Err(bad) => {
            metrics.bad_upstream_answer(&provider.name);
            return *bad;
        }
    };
    // The rest of a well-formed stream: its `[DONE]`, or a last event
    // without its closing blank line.
    if let Some(flight) = relay
        && relayed < answer.body.len()
    {
        flight.push(answer.body.slice(relayed..));
    }
    answer
}

/// An answer idem made itself, without a call (a token count by the
/// target model's tokenizer).
fn local_answer(call: &Call, t: &Target, body: Bytes) -> Answer {
    Answer {
        dialect: call.wire.dialect(),
        status: reqwest::StatusCode::OK,
        form: Form::Plain,
        body,
        retry_after: None,
        failure: None,
        provider: t.provider.name.clone(),
        model: t.model.clone(),
        created_at: SystemTime::now(),
        upstream_latency: Duration::ZERO,
        cache_ttl: None,
        rendered: Default::default(),
    }
}

/// The 400 of a request the target cannot take (nothing was sent): shared
/// with the flight's followers, whose request is the same, never cached.
fn refused(t: &Target, refusal: &Refusal) -> Answer {
    let body = crate::answer::error_body(
        &refusal.message,
        "invalid_request_error",
        "unsupported_by_provider",
        refusal.param.as_deref(),
    );
    let mut answer = Answer::from_failure(
        Failure::Connect,
        "",
        t.provider.name.clone(),
        t.model.clone(),
    );
    answer.failure = None;
    answer.status = reqwest::StatusCode::BAD_REQUEST;
    answer.body = Bytes::from(body.to_string());
    answer
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stuck_calls_lease_lapses_once_it_has_been_silent_past_the_provider_timeout() {
        let lease = Duration::from_millis(600);
        let (coalescer, route) =
            super::super::tests::setup_with("timeout = \"1s\"", "lease = \"600ms\"");
        let ticket = super::super::tests::lead(&coalescer, lease);
        let flight = ticket.flight.clone();
        let call = Call {
            wire: &crate::endpoints::CHAT,
            tenant: "acme".into(),
            route,
            target: 0,
            read_cache: true,
            read_negative: true,
            write_cache: true,
            pinned: false,
            cache: coalescer.cache.clone(),
            metrics: coalescer.metrics.clone(),
            call_timeout: Duration::from_secs(1),
            trace: None,
            forwarded: Forwarded::default(),
            reservation: std::sync::Mutex::new(None),
            rate_windows: None,
        };
        let led = [Led {
            ticket,
            request: Arc::new(Map::new()),
            global: None,
        }];
        // A call that started and then never showed a sign of life again.
        let progress = Progress::new();
        let beat = heartbeat(&call, &led, &progress);
        tokio::pin!(beat);
        let mut wait = async |d: Duration| {
            tokio::select! {
                () = &mut beat => unreachable!("the heartbeat returned"),
                () = tokio::time::sleep(d) => {}
            }
        };
        // Silent for less than the provider timeout: the lease is renewed
        // past its own length.
        wait(Duration::from_millis(900)).await;
        assert!(!flight.lease_expired(), "renewals stopped too early");
        // Silent for the timeout and then a lease: nobody renews it.
        wait(Duration::from_millis(1_800)).await;
        assert!(flight.lease_expired(), "a stuck call's lease was renewed");
        // A sign of life (a chunk) renews it again.
        progress.mark();
        wait(Duration::from_millis(400)).await;
        assert!(!flight.lease_expired(), "a live call's lease lapsed");
    }
}
