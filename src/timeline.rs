//! The gateway's own last hour, for the dashboard: every 10 seconds a
//! sampler started with the [`App`](crate::app::App) reads the cumulative
//! figures of [`Metrics`] and keeps what changed since the previous sample
//! in a fixed ring of 360 samples (one hour), so that `/ui` is useful
//! without Prometheus.
//!
//! A sample holds the interval's deltas (requests by outcome, errors by
//! class, upstream and saved calls, tokens and dollars spent and saved,
//! calls and failures per provider) and the interval's percentiles
//! (followers' wait, request latency per route, upstream latency per
//! target), with each target's circuit state at the sample's time.
//! `GET /v1/admin/timeline` ([`view`]) returns the ring, the interval in
//! progress (`current`), the sums since start and over the last hour, and
//! each route's targets with their health.
//!
//! Dollars follow the rule of `/v1/stats`: `null` (unknown) while nothing
//! counted had a price, never a made-up 0.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::metrics::{LatencyView, Metrics, Percentiles};
use crate::routes::Routes;
use crate::store::{now_ms, rfc3339};

/// How often a sample is taken.
pub const EVERY: Duration = Duration::from_secs(10);

/// How many samples the ring keeps: one hour.
pub const CAPACITY: usize = 360;

/// Defines [`Counts`] with its plain counters, and their arithmetic.
macro_rules! counts {
    ($($field:ident),* $(,)?) => {
        /// Cumulative counters (a [`Snapshot`]'s) or what they did over an
        /// interval (a [`Sample`]'s). `provider_errors`: upstream calls
        /// without an answer or with a status other than 2xx; `timeouts`:
        /// followers whose wait ran out, requests whose job was not done
        /// in time, requests whose answer was a provider's timeout;
        /// `rejections`: requests refused before any work;
        /// `contract_violations`: requests whose answer broke the route's
        /// contract.
        #[derive(Debug, Clone, Default, Serialize, PartialEq)]
        pub struct Counts {
            $(pub $field: u64,)*
            /// US dollars; `None` while nothing counted had a price.
            pub spent_cost_usd: Option<f64>,
            pub saved_cost_usd: Option<f64>,
        }

        impl Counts {
            /// What changed from `earlier` to `self` (counters only grow;
            /// a smaller one counts as no change).
            pub fn since(&self, earlier: &Counts) -> Counts {
                Counts {
                    $($field: self.$field.saturating_sub(earlier.$field),)*
                    spent_cost_usd: dollars_since(self.spent_cost_usd, earlier.spent_cost_usd),
                    saved_cost_usd: dollars_since(self.saved_cost_usd, earlier.saved_cost_usd),
                }
            }

            /// Adds `other`'s figures.
            pub fn add(&mut self, other: &Counts) {
                $(self.$field += other.$field;)*
                self.spent_cost_usd = dollars_sum(self.spent_cost_usd, other.spent_cost_usd);
                self.saved_cost_usd = dollars_sum(self.saved_cost_usd, other.saved_cost_usd);
            }
        }
    };
}

counts!(
    requests,
    leaders,
    followers,
    cache_hits,
    negative_hits,
    bypass,
    replays,
    upstream_calls,
    saved_calls,
    provider_errors,
    timeouts,
    rejections,
    contract_violations,
    no_target,
    internal_errors,
    spent_input_tokens,
    spent_cached_input_tokens,
    spent_output_tokens,
    unpriced_calls,
    saved_input_tokens,
    saved_cached_input_tokens,
    saved_output_tokens,
    unpriced_saves,
);

/// Dollars spent over an interval: known once anything priced was counted.
fn dollars_since(now: Option<f64>, earlier: Option<f64>) -> Option<f64> {
    match (now, earlier) {
        (Some(n), Some(e)) => Some(round_nanos((n - e).max(0.0))),
        (Some(n), None) => Some(n),
        (None, _) => None,
    }
}

fn dollars_sum(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(round_nanos(a + b)),
        (a, b) => a.or(b),
    }
}

/// Dollars to the nano-dollar the metrics count in (no float dust).
fn round_nanos(d: f64) -> f64 {
    (d * 1e9).round() / 1e9
}

impl Counts {
    /// The gateway's cumulative counters now.
    pub fn read(m: &Metrics) -> Counts {
        let s = m.stats(None);
        let provider_errors = m.provider_calls().iter().map(|(_, _, e)| e).sum();
        Counts {
            requests: s.incoming_requests,
            leaders: s.leaders,
            followers: s.followers,
            cache_hits: s.cache_hits,
            negative_hits: s.negative_hits,
            bypass: s.bypass,
            replays: s.replays,
            upstream_calls: s.upstream_calls,
            saved_calls: s.saved_calls,
            provider_errors,
            timeouts: s.wait_timeouts + s.job_timeouts + m.answer_timeouts(),
            rejections: s.rejected,
            contract_violations: m.contract_violations(),
            no_target: s.no_target,
            internal_errors: s.errors,
            spent_input_tokens: s.spent_input_tokens,
            spent_cached_input_tokens: s.spent_cached_input_tokens,
            spent_output_tokens: s.spent_output_tokens,
            unpriced_calls: s.unpriced_calls,
            saved_input_tokens: s.saved_input_tokens,
            saved_cached_input_tokens: s.saved_cached_input_tokens,
            saved_output_tokens: s.saved_output_tokens,
            unpriced_saves: s.unpriced_saves,
            spent_cost_usd: s.spent_cost_usd,
            saved_cost_usd: s.saved_cost_usd,
        }
    }
}

/// Calls to one provider and how many failed.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Calls {
    pub calls: u64,
    pub errors: u64,
}

/// The cumulative figures at one moment.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub at_ms: i64,
    pub counts: Counts,
    pub providers: BTreeMap<String, Calls>,
}

impl Snapshot {
    pub fn read(m: &Metrics, at_ms: i64) -> Snapshot {
        Snapshot {
            at_ms,
            counts: Counts::read(m),
            providers: m
                .provider_calls()
                .into_iter()
                .map(|(p, calls, errors)| (p, Calls { calls, errors }))
                .collect(),
        }
    }
}

/// One target's state in a sample.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TargetSample {
    pub provider: String,
    pub model: String,
    /// `closed`, `half_open`, `open`.
    pub circuit: &'static str,
    /// Upstream latency over the interval (see [`Metrics::request_done`]).
    pub latency: Percentiles,
}

/// The interval's percentiles, read when the sample is taken.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IntervalPercentiles {
    pub wait: Percentiles,
    /// Request latency by route (routes with requests only).
    pub routes: BTreeMap<String, Percentiles>,
    pub targets: Vec<TargetSample>,
}

/// One interval of the timeline.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Sample {
    /// The interval's end.
    pub at: String,
    pub at_ms: i64,
    /// Its length.
    pub seconds: f64,
    #[serde(flatten)]
    pub counts: Counts,
    /// Upstream calls and failures by provider (providers with calls only).
    pub providers: BTreeMap<String, Calls>,
    /// Followers' wait.
    pub wait: Percentiles,
    /// Request latency by route.
    pub routes: BTreeMap<String, Percentiles>,
    pub targets: Vec<TargetSample>,
}

impl Sample {
    /// The interval from `earlier` to `later`.
    pub fn between(earlier: &Snapshot, later: &Snapshot, p: IntervalPercentiles) -> Sample {
        let providers = later
            .providers
            .iter()
            .filter_map(|(name, now)| {
                let before = earlier.providers.get(name).copied().unwrap_or_default();
                let d = Calls {
                    calls: now.calls.saturating_sub(before.calls),
                    errors: now.errors.saturating_sub(before.errors),
                };
                (d.calls > 0 || d.errors > 0).then(|| (name.clone(), d))
            })
            .collect();
        Sample {
            at: rfc3339(later.at_ms),
            at_ms: later.at_ms,
            seconds: (later.at_ms - earlier.at_ms).max(0) as f64 / 1000.0,
            counts: later.counts.since(&earlier.counts),
            providers,
            wait: p.wait,
            routes: p.routes,
            targets: p.targets,
        }
    }
}

/// A fixed ring: the newest `capacity` items, oldest first.
#[derive(Debug, Clone)]
pub struct Ring<T> {
    items: VecDeque<T>,
    capacity: usize,
}

impl<T> Ring<T> {
    pub fn new(capacity: usize) -> Ring<T> {
        Ring {
            items: VecDeque::with_capacity(capacity),
            capacity: capacity.max(1),
        }
    }

    /// Adds `item`, dropping the oldest when full.
    pub fn push(&mut self, item: T) {
        if self.items.len() == self.capacity {
            self.items.pop_front();
        }
        self.items.push_back(item);
    }

    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.items.iter()
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    pub fn last(&self) -> Option<&T> {
        self.items.back()
    }
}

struct State {
    ring: Ring<Sample>,
    /// The figures at the last sample (at start: all zero).
    last: Snapshot,
    started_ms: i64,
}

/// The ring and the figures of its last sample.
pub struct Timeline {
    state: Mutex<State>,
}

impl Default for Timeline {
    fn default() -> Timeline {
        Timeline::new()
    }
}

impl Timeline {
    pub fn new() -> Timeline {
        let now = now_ms();
        Timeline {
            state: Mutex::new(State {
                ring: Ring::new(CAPACITY),
                last: Snapshot {
                    at_ms: now,
                    ..Snapshot::default()
                },
                started_ms: now,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // Every update is whole: a poisoned lock still holds a usable ring.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes the interval at `now`: the sample from the last one's
    /// figures to these.
    pub fn close(&self, now: Snapshot, p: IntervalPercentiles) {
        let mut st = self.lock();
        let sample = Sample::between(&st.last, &now, p);
        st.ring.push(sample);
        st.last = now;
    }

    /// The samples, oldest first.
    pub fn samples(&self) -> Vec<Sample> {
        self.lock().ring.iter().cloned().collect()
    }
}

/// Each configured target once (a target shared by routes has one
/// breaker), with its circuit state, and the interval's latencies.
fn percentiles(m: &Metrics, routes: &Routes, reset: bool) -> IntervalPercentiles {
    let by_route = m
        .route_latencies(reset)
        .into_iter()
        .filter(|(_, v)| v.interval.count > 0)
        .map(|(r, v)| (r, v.interval))
        .collect();
    let latencies: BTreeMap<(String, String), LatencyView> =
        m.target_latencies(reset).into_iter().collect();
    let mut targets: Vec<TargetSample> = Vec::new();
    for route in routes.iter() {
        for t in &route.targets {
            let (provider, model) = (t.provider.name.to_string(), t.model.to_string());
            if targets
                .iter()
                .any(|x| x.provider == provider && x.model == model)
            {
                continue;
            }
            let latency = latencies
                .get(&(provider.clone(), model.clone()))
                .map(|v| v.interval)
                .unwrap_or_default();
            targets.push(TargetSample {
                circuit: t.breaker.view().state,
                provider,
                model,
                latency,
            });
        }
    }
    IntervalPercentiles {
        wait: m.wait_latency(reset).interval,
        routes: by_route,
        targets,
    }
}

/// Takes a sample now (the sampler does every [`EVERY`]), with the
/// circuits of the targets of `routes`.
pub fn sample(m: &Metrics, timeline: &Timeline, routes: &Routes) {
    let now = Snapshot::read(m, now_ms());
    let p = percentiles(m, routes, true);
    timeline.close(now, p);
}

/// The sampler: calls `sample` every [`EVERY`] until `stop`.
pub async fn run(stop: CancellationToken, mut sample: impl FnMut() + Send + 'static) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + EVERY, EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => sample(),
        }
    }
}

/// `GET /v1/admin/timeline`'s answer, with the targets of `routes`.
pub fn view(m: &Metrics, timeline: &Timeline, routes: &Routes) -> Value {
    let at = now_ms();
    let now = Snapshot::read(m, at);
    let (samples, last, started_ms) = {
        let st = timeline.lock();
        (
            st.ring.iter().cloned().collect::<Vec<Sample>>(),
            st.last.clone(),
            st.started_ms,
        )
    };
    let current = Sample::between(&last, &now, percentiles(m, routes, false));
    // The last hour: the ring and the interval in progress.
    let mut hour = Counts::default();
    let mut hour_providers: BTreeMap<String, Calls> = BTreeMap::new();
    for s in samples.iter().chain([&current]) {
        hour.add(&s.counts);
        for (p, c) in &s.providers {
            let e = hour_providers.entry(p.clone()).or_default();
            e.calls += c.calls;
            e.errors += c.errors;
        }
    }
    let hour_from = samples
        .first()
        .map_or(last.at_ms, |s| s.at_ms - (s.seconds * 1000.0) as i64);
    let by_route: BTreeMap<String, LatencyView> = m.route_latencies(false).into_iter().collect();
    let target_latency: BTreeMap<(String, String), LatencyView> =
        m.target_latencies(false).into_iter().collect();
    let mut targets = Vec::new();
    for route in routes.iter() {
        for t in &route.targets {
            let provider = t.provider.name.to_string();
            let latency = target_latency
                .get(&(provider.clone(), t.model.to_string()))
                .copied()
                .unwrap_or_default();
            let hour_calls = hour_providers.get(&provider).copied().unwrap_or_default();
            let all_calls = now.providers.get(&provider).copied().unwrap_or_default();
            targets.push(json!({
                "route": route.name.as_ref(),
                "index": t.index,
                "provider": provider,
                "model": t.model.as_ref(),
                "circuit": t.breaker.view(),
                "priced": t.price.is_some(),
                "latency": latency,
                "provider_calls": {
                    "last_hour": hour_calls,
                    "since_start": all_calls,
                    "error_share_last_hour": share(hour_calls),
                    "error_share_since_start": share(all_calls),
                },
            }));
        }
    }
    json!({
        "object": "timeline",
        "at": rfc3339(at),
        "interval_seconds": EVERY.as_secs(),
        "capacity": CAPACITY,
        "started_at": rfc3339(started_ms),
        "since_start": {
            "seconds": (at - started_ms).max(0) as f64 / 1000.0,
            "counts": now.counts,
            "providers": now.providers,
            "wait": m.wait_latency(false).total,
            "routes": by_route.iter().map(|(r, v)| (r.clone(), v.total)).collect::<BTreeMap<_, _>>(),
        },
        "last_hour": {
            "from": rfc3339(hour_from),
            "seconds": (at - hour_from).max(0) as f64 / 1000.0,
            "counts": hour,
            "providers": hour_providers,
        },
        "samples": samples,
        "current": current,
        "targets": targets,
    })
}

/// Failed calls' share, or `None` without calls.
fn share(c: Calls) -> Option<f64> {
    (c.calls > 0).then(|| c.errors as f64 / c.calls as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(at_ms: i64, requests: u64, spent: Option<f64>, calls: u64) -> Snapshot {
        Snapshot {
            at_ms,
            counts: Counts {
                requests,
                upstream_calls: calls,
                spent_cost_usd: spent,
                ..Counts::default()
            },
            providers: [(
                "p".to_string(),
                Calls {
                    calls,
                    errors: calls / 2,
                },
            )]
            .into(),
        }
    }

    #[test]
    fn the_ring_keeps_the_newest_360_oldest_first() {
        let mut ring = Ring::new(CAPACITY);
        for i in 0..CAPACITY {
            ring.push(i);
        }
        assert_eq!(ring.len(), CAPACITY);
        assert_eq!(ring.iter().next(), Some(&0));
        ring.push(CAPACITY);
        ring.push(CAPACITY + 1);
        assert_eq!(ring.len(), CAPACITY, "it wraps, it never grows");
        assert_eq!(ring.iter().next(), Some(&2));
        assert_eq!(ring.last(), Some(&(CAPACITY + 1)));
        let all: Vec<usize> = ring.iter().copied().collect();
        assert_eq!(all, (2..CAPACITY + 2).collect::<Vec<_>>());
    }

    #[test]
    fn a_sample_holds_the_intervals_deltas() {
        let a = snapshot(10_000, 7, None, 2);
        let b = snapshot(20_000, 19, Some(0.25), 6);
        let c = snapshot(30_000, 19, Some(0.75), 6);
        let s = Sample::between(&a, &b, IntervalPercentiles::default());
        assert_eq!(s.seconds, 10.0);
        assert_eq!(s.counts.requests, 12);
        assert_eq!(s.counts.upstream_calls, 4);
        assert_eq!(s.counts.spent_cost_usd, Some(0.25), "the first priced call");
        assert_eq!(
            s.providers.get("p"),
            Some(&Calls {
                calls: 4,
                errors: 2
            })
        );
        let s = Sample::between(&b, &c, IntervalPercentiles::default());
        assert_eq!(s.counts.requests, 0);
        assert_eq!(s.counts.spent_cost_usd, Some(0.5));
        assert!(s.providers.is_empty(), "idle providers are left out");
        // Nothing priced yet: unknown, not zero.
        let s = Sample::between(&a, &a, IntervalPercentiles::default());
        assert_eq!(s.counts.spent_cost_usd, None);
    }

    #[test]
    fn the_timeline_closes_intervals_from_the_last_sample_and_wraps() {
        let t = Timeline::new();
        let start = t.lock().last.at_ms;
        for i in 1..=(CAPACITY as u64 + 5) {
            let at = start + i as i64 * 10_000;
            t.close(
                snapshot(at, i * 3, Some(i as f64), i),
                IntervalPercentiles::default(),
            );
        }
        let samples = t.samples();
        assert_eq!(samples.len(), CAPACITY);
        // Each interval: 3 requests, one call, one dollar.
        for s in &samples {
            assert_eq!(s.counts.requests, 3, "{s:?}");
            assert_eq!(s.counts.upstream_calls, 1);
            assert_eq!(s.counts.spent_cost_usd, Some(1.0));
            assert_eq!(s.seconds, 10.0);
        }
        // The oldest five were dropped.
        assert_eq!(samples[0].at_ms, start + 6 * 10_000);
        let mut hour = Counts::default();
        for s in &samples {
            hour.add(&s.counts);
        }
        assert_eq!(hour.requests, 3 * CAPACITY as u64);
        assert_eq!(hour.spent_cost_usd, Some(CAPACITY as f64));
    }

    #[test]
    fn unknown_dollars_stay_unknown_when_added() {
        let mut c = Counts::default();
        c.add(&Counts::default());
        assert_eq!(c.saved_cost_usd, None);
        c.add(&Counts {
            saved_cost_usd: Some(0.1),
            ..Counts::default()
        });
        c.add(&Counts {
            saved_cost_usd: Some(0.2),
            ..Counts::default()
        });
        assert_eq!(c.saved_cost_usd, Some(0.3));
        assert_eq!(share(Calls::default()), None);
        assert_eq!(
            share(Calls {
                calls: 4,
                errors: 1
            }),
            Some(0.25)
        );
    }
}
