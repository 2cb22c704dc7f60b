//! The leader task: the one upstream call of a flight, detached from the
//! client that started it.
//!
//! It renews the flight's lease while it lives, relays the provider's head
//! and body into the flight as they arrive (on a route with a contract: only
//! once the whole answer passed it), records the call's outcome in the
//! target's circuit breaker, writes the result (or the negative) cache
//! before the flight ends, and ends the flight. Its
//! [`LeaderTicket`] is dropped on every path, which removes the flight.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;

use crate::answer::{Answer, Form};
use crate::cache::{ResultCache, jittered_ttl};
use crate::fingerprint::Fingerprint;
use crate::metrics::Metrics;
use crate::providers::breaker::Health;
use crate::routes::Route;

use super::table::{Flight, Head, LeaderTicket};

pub struct LeaderJob {
    pub ticket: LeaderTicket,
    pub tenant: Arc<str>,
    pub route: Arc<Route>,
    pub target: usize,
    pub body: Bytes,
    pub fp: Fingerprint,
    pub read_cache: bool,
    pub write_cache: bool,
    pub cache: Arc<ResultCache>,
    pub metrics: Arc<Metrics>,
}

pub async fn lead(job: LeaderJob) {
    let LeaderJob {
        ticket,
        tenant,
        route,
        target,
        body,
        fp,
        read_cache,
        write_cache,
        cache,
        metrics,
    } = job;
    let flight = ticket.flight.clone();
    let _guard = ticket.guard;

    // A request that became leader just after the previous flight ended
    // finds that flight's answer in the cache: no second call.
    if read_cache && let Some(answer) = cache.fresh(&fp) {
        flight.finish(answer);
        return;
    }

    let lease = route.config.coalesce.lease;
    let heartbeat = async {
        let mut tick = tokio::time::interval(lease / 3);
        loop {
            tick.tick().await;
            flight.renew(lease);
        }
    };
    let call = call(&flight, &route, target, body, &tenant, &metrics);
    let mut answer = tokio::select! {
        a = call => a,
        () = heartbeat => return,
    };
    if let Some(t) = route.targets.get(target) {
        t.breaker.record(Health::of(&answer));
    }
    // On a contract route nothing reaches a follower, the cache or a job
    // before the answer is checked; `call` buffered a streamed answer, which
    // is released to the flight as one chunk once it passes.
    if let Some(contract) = &route.contract {
        answer = crate::contracts::enforce(contract, &route.name, answer);
        if answer.is_success() && answer.form == Form::Stream {
            flight.push(answer.body.clone());
        }
    }

    let cfg = &route.config;
    if write_cache && !flight.is_superseded() {
        if answer.is_success() {
            if cfg.cache.enabled {
                let ttl = jittered_ttl(cfg.cache.ttl, cfg.cache.jitter);
                answer.cache_ttl = Some(ttl);
                let answer = Arc::new(answer);
                cache.put(fp, answer.clone(), ttl, cfg);
                flight.finish(answer);
                return;
            }
        } else if let Some(ttl) = answer.negative_ttl(&cfg.cache) {
            answer.cache_ttl = Some(ttl);
            let answer = Arc::new(answer);
            cache.put_negative(fp, target, answer.clone(), ttl);
            flight.finish(answer);
            return;
        }
    }
    flight.finish(Arc::new(answer));
}

/// Calls the target and relays what arrives into the flight.
async fn call(
    flight: &Flight,
    route: &Route,
    target: usize,
    body: Bytes,
    tenant: &str,
    metrics: &Metrics,
) -> Answer {
    let Some(t) = route.targets.get(target) else {
        return Answer::from_failure(
            crate::answer::Failure::LeaderLost,
            "no such target",
            "idem".into(),
            route.name.clone(),
        );
    };
    let provider = &t.provider;
    let started = Instant::now();
    let reply = match provider.send(body, provider.timeout).await {
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
        cache_ttl: None::<Duration>,
    }
}
