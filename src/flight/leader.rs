//! The leader task: the one upstream call of a flight, detached from the
//! client that started it.
//!
//! It first asks the shared layer (Redis, when configured) whether another
//! replica already has the answer or the flight; otherwise it renews the
//! flight's lease while it lives, relays the provider's head and body into
//! the flight as they arrive (on a route with a contract: only once the
//! whole answer passed it), records the call's outcome in the target's
//! circuit breaker, writes the result (or the negative) cache before the
//! flight ends, and ends the flight. Its [`LeaderTicket`] is dropped on
//! every path, which removes the flight.

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

use super::redis::{Begin, RedisFlights, Remote, SharedError};
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
    let lease = cfg.coalesce.lease;

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

    let global = match job.shared.get().cloned() {
        Some(shared) => match share(&job, &flight, shared).await {
            Shared::Done => return,
            Shared::Lead(shared, token) => Some((shared, token)),
            Shared::Local => None,
        },
        None => None,
    };

    let heartbeat = async {
        // The lease was just taken: the first renewal is due a third of it
        // later, not at once.
        let every = lease / 3;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            flight.renew(lease);
            if let Some((shared, token)) = &global {
                match shared.renew(&flight.key, token, lease).await {
                    Ok(true) => {}
                    Ok(false) => {
                        tracing::warn!(fp = %job.fp, "lost the shared lease; the answer will not overwrite a newer one")
                    }
                    Err(e) => shared.failed("renew", &e),
                }
            }
        }
    };
    let call = call(
        &flight,
        &job.route,
        job.target,
        job.body.clone(),
        job.call_timeout,
        &job.tenant,
        &job.metrics,
    );
    let mut answer = tokio::select! {
        a = call => a,
        () = heartbeat => return,
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

    let mut answer_ttl = None;
    let mut negative_ttl = None;
    if job.write_cache && !flight.is_superseded() {
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
    if let Some(ttl) = answer_ttl {
        job.cache.put(job.fp, answer.clone(), ttl, cfg);
    }
    if let Some(ttl) = negative_ttl {
        job.cache
            .put_negative(job.fp, job.target, answer.clone(), ttl);
    }
    if let Some((shared, token)) = &global {
        match shared
            .complete(
                &flight.key,
                token,
                &answer,
                answer_ttl,
                negative_ttl,
                RESULT_TTL,
            )
            .await
        {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!(fp = %job.fp, "a newer leader owns this flight: this answer was not shared")
            }
            Err(e) => shared.failed("complete", &e),
        }
    }
    flight.finish(answer);
}

enum Shared {
    /// The flight was answered from the shared layer.
    Done,
    /// This replica leads the shared flight.
    Lead(Arc<RedisFlights>, String),
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
    let leader = match begin {
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
        Ok(Begin::Lead) => return Shared::Lead(shared, token),
        Ok(Begin::Follow(leader)) => leader,
        Err(e) => {
            shared.failed("begin", &e);
            return Shared::Local;
        }
    };
    // Another replica leads: wait for its answer, keeping this replica's own
    // flight lease alive meanwhile. Its call is bounded by the provider
    // timeout (or this flight's longer bound); past that and a lease,
    // something is wrong with it.
    let deadline = Instant::now() + job.call_timeout + lease * 2;
    let heartbeat = async {
        let every = lease / 3;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            tick.tick().await;
            flight.renew(lease);
        }
    };
    let waited = tokio::select! {
        r = shared.wait_remote(&key, leader, &token, lease, deadline) => r,
        () = heartbeat => return Shared::Local,
    };
    match waited {
        Ok(Remote::Done(answer)) => {
            if answer.is_success()
                && cfg.cache.enabled
                && job.write_cache
                && let Some(ttl) = answer.cache_ttl
            {
                job.cache.put(job.fp, answer.clone(), ttl, cfg);
            }
            flight.set_origin(Origin::Remote);
            flight.finish(answer);
            Shared::Done
        }
        Ok(Remote::Lead) => {
            tracing::warn!(fp = %job.fp, "the leading replica's lease expired; taking the flight over");
            Shared::Lead(shared, token)
        }
        Err(SharedError::Deadline) => {
            let provider = job
                .route
                .targets
                .get(job.target)
                .map(|t| t.provider.name.clone());
            let answer = Answer::from_failure(
                Failure::Timeout,
                "the replica leading this request did not finish in time",
                provider.unwrap_or_else(|| "idem".into()),
                job.route.name.clone(),
            );
            flight.set_origin(Origin::Remote);
            flight.finish(Arc::new(answer));
            Shared::Done
        }
        Err(e) => {
            shared.failed("wait", &e);
            Shared::Local
        }
    }
}

/// Calls the target and relays what arrives into the flight.
async fn call(
    flight: &Flight,
    route: &Route,
    target: usize,
    body: Bytes,
    timeout: Duration,
    tenant: &str,
    metrics: &Metrics,
) -> Answer {
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
            return Answer::from_call_error(&e, provider.name.clone(), t.model.clone());
        }
    };
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
    let mut body = reply.body;
    let mut whole = BytesMut::new();
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(bytes) => {
                whole.extend_from_slice(&bytes);
                if streaming {
                    flight.push(bytes);
                }
            }
            Err(e) => {
                tracing::warn!(route = %route.name, provider = %provider.name, error = %e, "upstream body broke off");
                return Answer::from_call_error(&e, provider.name.clone(), t.model.clone());
            }
        }
    }
    let latency = started.elapsed();
    if reply.status.is_success() {
        route.latency.record(latency);
    }
    Answer {
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
    }
}
