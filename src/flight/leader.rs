//! The leader task: the one upstream call of a flight, detached from the
//! client that started it.
//!
//! It first asks the shared layer (Redis, when configured) whether another
//! replica already has the answer or the flight; otherwise it renews the
//! flight's lease while it lives, relays the provider's head and body into
//! the flight as they arrive, in whole SSE events (on a route with a
//! contract: only once the whole answer passed it), turns an answer past
//! the provider's size limit or a 2xx that is no chat completion into a
//! failure, records the call's outcome in the target's circuit breaker,
//! then completes the shared flight (a leader whose lease a newer one took
//! writes nothing and hands its waiters the newer answer), writes its own
//! replica's result (or negative) cache, and ends the flight. Its
//! [`LeaderTicket`] is dropped on every path, which removes the flight.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;

use crate::answer::{Answer, Failure, Form};
use crate::cache::{ResultCache, jittered_ttl};
use crate::fingerprint::Fingerprint;
use crate::metrics::Metrics;
use crate::providers::breaker::Health;
use crate::routes::Route;

use super::redis::{Begin, Completion, Lease, RedisFlights, Remote};
use super::table::{Flight, Head, LeaderTicket, Origin};

pub struct LeaderJob {
    pub ticket: LeaderTicket,
    pub tenant: Arc<str>,
    pub route: Arc<Route>,
    pub target: usize,
    pub body: Bytes,
    pub fp: Fingerprint,
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
    pub shared: Arc<OnceLock<Arc<RedisFlights>>>,
    pub metrics: Arc<Metrics>,
}

impl LeaderJob {
    /// Whether a cached answer may finish this flight.
    fn may_serve(&self, answer: &Answer) -> bool {
        !self.pinned
            || self
                .route
                .targets
                .get(self.target)
                .is_some_and(|t| answer.provider == t.provider.name && answer.model == t.model)
    }
}

/// How long an ended flight's answer stays readable for followers on other
/// replicas that have not fetched it yet.
const RESULT_TTL: Duration = Duration::from_secs(60);

pub async fn lead(job: LeaderJob) {
    let flight = job.ticket.flight.clone();
    let cfg = &job.route.config;

    // A request that became leader just after the previous flight ended
    // finds that flight's answer in the cache: no second call.
    if job.read_cache
        && let Some(answer) = job.cache.fresh(&job.fp)
        && job.may_serve(&answer)
    {
        flight.set_origin(Origin::Cache);
        flight.finish(answer);
        return;
    }

    let mut global = match job.shared.get().cloned() {
        Some(shared) => match share(&job, &flight, shared).await {
            Shared::Done => return,
            Shared::Lead(shared, lease) => Some((shared, lease)),
            Shared::Local => None,
        },
        None => None,
    };

    let progress = Progress::new();
    let call = call(&job, &flight, &progress);
    let mut answer = tokio::select! {
        a = call => a,
        () = heartbeat(&job, &flight, &progress, global.as_ref()) => return,
    };
    if let Some(t) = job.route.targets.get(job.target) {
        t.breaker.record(Health::of(&answer));
    }
    // On a contract route nothing reaches a follower, the cache or a job
    // before the answer is checked; `call` buffered a streamed answer, which
    // is released to the flight as one chunk once it passes.
    if let Some(contract) = &job.route.contract {
        answer = crate::contracts::enforce(contract, &job.route.name, answer);
        if answer.is_success() && answer.form == Form::Stream {
            flight.push(answer.body.clone());
        }
    }

    // A local follower took this flight over while the call looked stuck:
    // its answer is the flight's, this late one goes nowhere.
    if let Some(next) = flight.successor() {
        tracing::warn!(fp = %job.fp, "a newer leader took this flight over: its answer is shared, not this late one");
        let theirs = next.done(None).await.unwrap_or_else(|| lost(&job));
        flight.set_origin(Origin::Remote);
        flight.finish(theirs);
        return;
    }

    let mut answer_ttl = None;
    let mut negative_ttl = None;
    if job.write_cache {
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
                tracing::warn!(fp = %job.fp, "a newer leader answered this flight: this late answer was not shared");
                let theirs = theirs.unwrap_or_else(|| lost(&job));
                keep_remote(&job, &theirs);
                flight.set_origin(Origin::Remote);
                flight.finish(theirs);
                return;
            }
            Ok(Completion::Superseded(newer)) => newer,
        };
        tracing::warn!(fp = %job.fp, "a newer leader owns this flight: waiting for its answer instead of sharing this late one");
        match follow_remote(&job, &flight, &shared, newer, &lease.token).await {
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
        job.cache.put(job.fp, answer.clone(), ttl, cfg);
    }
    if let Some(ttl) = negative_ttl {
        job.cache
            .put_negative(job.fp, job.target, answer.clone(), ttl);
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

/// Renews the flight's lease (local and shared) every lease/3 while the
/// call is alive. The call's timeout (the provider's, or a job attempt's
/// late-answer window) bounds the wait for the head and every pause
/// between chunks, so a call that has shown no sign of life for longer
/// than that is stuck: its lease is no longer renewed and lapses, and a
/// waiter may take the flight over. Never returns.
async fn heartbeat(
    job: &LeaderJob,
    flight: &Flight,
    progress: &Progress,
    global: Option<&(Arc<RedisFlights>, Lease)>,
) {
    let lease = job.route.config.coalesce.lease;
    let stuck_after = job.call_timeout + lease / 3;
    // The lease was just taken: the first renewal is due a third of it
    // later, not at once.
    let every = lease / 3;
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut lost_shared = false;
    loop {
        tick.tick().await;
        if progress.idle() > stuck_after {
            continue;
        }
        flight.renew(lease);
        if let Some((shared, held)) = global
            && !lost_shared
        {
            match shared.renew(&flight.key, held, lease).await {
                Ok(true) => {}
                Ok(false) => {
                    lost_shared = true;
                    tracing::warn!(fp = %job.fp, "lost the shared lease; the answer will not overwrite a newer one")
                }
                Err(e) => shared.failed("renew", &e),
            }
        }
    }
}

/// The answer for waiters whose flight was answered by a newer leader
/// whose result is gone already.
fn lost(job: &LeaderJob) -> Arc<Answer> {
    Arc::new(Answer::from_failure(
        Failure::LeaderLost,
        "a newer call answered this request, and its answer is no longer at hand",
        "idem".into(),
        job.route.name.clone(),
    ))
}

/// Keeps another replica's answer in this replica's cache for as long as
/// the shared cache does.
fn keep_remote(job: &LeaderJob, answer: &Arc<Answer>) {
    let cfg = &job.route.config;
    if answer.is_success()
        && cfg.cache.enabled
        && job.write_cache
        && job.may_serve(answer)
        && let Some(ttl) = answer.cache_ttl
    {
        job.cache.put(job.fp, answer.clone(), ttl, cfg);
    }
}

enum Shared {
    /// The flight was answered from the shared layer.
    Done,
    /// This replica leads the shared flight.
    Lead(Arc<RedisFlights>, Lease),
    /// Redis is unavailable: lead locally.
    Local,
}

/// Consults the shared layer: its caches, then its flight (leading it, or
/// waiting for the replica that does).
async fn share(job: &LeaderJob, flight: &Arc<Flight>, shared: Arc<RedisFlights>) -> Shared {
    let cfg = &job.route.config;
    let lease = cfg.coalesce.lease;
    let token = uuid::Uuid::now_v7().simple().to_string();
    let key = flight.key;
    let mut begin = shared
        .begin(&key, &token, lease, job.read_cache, job.read_negative)
        .await;
    if let Ok(Begin::Hit(answer, _)) = &begin
        && !job.may_serve(answer)
    {
        // Another target's answer: this attempt asks its own target.
        begin = shared
            .begin(&key, &token, lease, false, job.read_negative)
            .await;
    }
    let awaited = match begin {
        Ok(Begin::Hit(answer, left)) => {
            if left > Duration::ZERO {
                job.cache.put(job.fp, answer.clone(), left, cfg);
            }
            flight.set_origin(Origin::Cache);
            flight.finish(answer);
            return Shared::Done;
        }
        Ok(Begin::Negative(answer)) => {
            flight.set_origin(Origin::Negative);
            flight.finish(answer);
            return Shared::Done;
        }
        Ok(Begin::Lead(generation)) => {
            return Shared::Lead(shared, Lease { generation, token });
        }
        Ok(Begin::Follow(generation)) => generation,
        Err(e) => {
            shared.failed("begin", &e);
            return Shared::Local;
        }
    };
    match follow_remote(job, flight, &shared, awaited, &token).await {
        Followed::Answer(answer) => {
            flight.set_origin(Origin::Remote);
            flight.finish(answer);
            Shared::Done
        }
        Followed::Lead(lease) => {
            tracing::warn!(fp = %job.fp, "the leading replica's lease expired; taking the flight over");
            Shared::Lead(shared, lease)
        }
        Followed::Local => Shared::Local,
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
    job: &LeaderJob,
    flight: &Flight,
    shared: &RedisFlights,
    awaited: u64,
    token: &str,
) -> Followed {
    let lease = job.route.config.coalesce.lease;
    let keep_local = async {
        let every = lease / 3;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            flight.renew(lease);
        }
    };
    // A job's attempt names its target: another target's cached answer
    // would be credited to the wrong one, so it does not take one here.
    let read_cache = job.read_cache && !job.pinned;
    let waited = tokio::select! {
        r = shared.wait_remote(&flight.key, awaited, token, lease, read_cache) => r,
        () = keep_local => return Followed::Local,
    };
    match waited {
        Ok(Remote::Done(answer)) => {
            keep_remote(job, &answer);
            Followed::Answer(answer)
        }
        Ok(Remote::Hit(answer, left)) => {
            if left > Duration::ZERO && job.write_cache {
                job.cache
                    .put(job.fp, answer.clone(), left, &job.route.config);
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

/// Calls the target and relays what arrives into the flight; an answer
/// past the provider's `max_answer_bytes`, or a 2xx that is no chat
/// completion, ends as a failure.
async fn call(job: &LeaderJob, flight: &Flight, progress: &Progress) -> Answer {
    let (route, target, body, timeout) =
        (&job.route, job.target, job.body.clone(), job.call_timeout);
    let (tenant, metrics) = (&job.tenant, &job.metrics);
    let Some(t) = route.targets.get(target) else {
        return Answer::from_failure(
            Failure::LeaderLost,
            "no such target",
            "idem".into(),
            route.name.clone(),
        );
    };
    let provider = &t.provider;
    let started = Instant::now();
    let reply = match provider.send(body, timeout).await {
        Ok(r) => r,
        Err(e) => {
            metrics.upstream_call(tenant, &provider.name, 0);
            tracing::warn!(route = %route.name, provider = %provider.name, error = %e, "upstream call failed");
            return e.answer(provider.name.clone(), t.model.clone());
        }
    };
    progress.mark();
    metrics.upstream_call(tenant, &provider.name, reply.status.as_u16());
    let form = if reply.streaming {
        Form::Stream
    } else {
        Form::Plain
    };
    // Relay as it arrives, unless the route's contract must see the whole
    // answer first.
    let streaming = form == Form::Stream && reply.status.is_success() && route.contract.is_none();
    if streaming {
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
    let mut point = crate::sse::RelayPoint::default();
    let mut relayed = 0;
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(bytes) => {
                progress.mark();
                // Checked before buffering: past the limit not a byte more is
                // kept, and dropping the body stops the download.
                if whole.len() + bytes.len() > limit {
                    metrics.upstream_answer_too_large(&provider.name);
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
                if streaming {
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
                tracing::warn!(route = %route.name, provider = %provider.name, error = %e, "upstream body broke off");
                return e.answer(provider.name.clone(), t.model.clone());
            }
        }
    }
    let latency = started.elapsed();
    if reply.status.is_success() {
        route.latency.record(latency);
    }
    let answer = Answer {
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
    // A 2xx that is no chat completion must not reach anybody as a success:
    // it becomes a failure here, which the followers, the caches and a job
    // see as such.
    if let Some(why) = answer.malformed() {
        metrics.bad_upstream_answer(&provider.name);
        tracing::warn!(route = %route.name, provider = %provider.name, why = %why, "upstream answer is not a chat completion");
        return answer.into_bad(&why);
    }
    // The rest of a well-formed stream: its `[DONE]`, or a last event
    // without its closing blank line.
    if streaming && relayed < answer.body.len() {
        flight.push(answer.body.slice(relayed..));
    }
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
        let job = LeaderJob {
            ticket,
            tenant: "acme".into(),
            route,
            target: 0,
            body: Bytes::new(),
            fp: super::super::tests::fp(),
            read_cache: true,
            read_negative: true,
            write_cache: true,
            pinned: false,
            cache: coalescer.cache.clone(),
            shared: coalescer.shared.clone(),
            metrics: coalescer.metrics.clone(),
            call_timeout: Duration::from_secs(1),
        };
        // A call that started and then never showed a sign of life again.
        let progress = Progress::new();
        let beat = heartbeat(&job, &flight, &progress, None);
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
