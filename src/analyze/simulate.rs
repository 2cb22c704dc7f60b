//! The what-if simulation behind `idem analyze`'s "saved calls": replays
//! every (tenant, fingerprint) group's arrivals through a simplified gateway
//! with a given wait window and result-cache TTL, and counts the upstream
//! calls it would have made.
//!
//! The rule is deterministic so that the same input and flags always give
//! the same numbers. For each group, requests are taken in arrival order
//! (equal times: input order), with a current call `[start, end)` and a
//! cache that lasts until `cache_until` (both empty at first):
//!
//! 1. `t < end` (a call is in flight): if `end - t <= wait` the request is
//!    a **follower** (saved by coalescing); otherwise its wait would run out
//!    before the answer, so it is a **wait timeout**, counted as an upstream
//!    call of its own, and the flight and cache are left as they were.
//! 2. else `t < cache_until`: a **cache hit** (saved by the cache).
//! 3. else the request is a **leader**: a call starts at `t` and ends at
//!    `end = t + d`, where `d` is the line's `upstream_ms` when it is above 0
//!    and the wait window otherwise; its answer is cached until
//!    `end + ttl` when the line's status is below 400 (or absent), and not
//!    at all otherwise.
//!
//! Windows are half-open: a repeat exactly at `end` is not a follower, and
//! one exactly at `cache_until` is not a cache hit.
//!
//! A saved request (follower or cache hit) saves the tokens of the call
//! that answers it: its leader's line's `prompt_tokens` and
//! `completion_tokens`, at the leader's price when it has one. The cache's jitter and
//! the negative cache are not modelled; tenants are never merged, because
//! groups are per tenant.

use serde::Serialize;

use super::input::{Event, NO_PRICE};
use crate::prices::{Price, Tokens};

/// The wait window and TTL a simulation runs with, in microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settings {
    pub wait_us: u64,
    pub ttl_us: u64,
}

/// What a simulation counted.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Savings {
    pub wait_ms: f64,
    pub ttl_s: f64,
    pub requests: u64,
    /// Calls the gateway would have sent: leaders plus wait timeouts.
    pub upstream_calls: u64,
    pub saved_by_coalescing: u64,
    pub saved_by_cache: u64,
    /// `saved_by_coalescing + saved_by_cache`.
    pub saved: u64,
    /// `saved / requests`.
    pub saved_share: f64,
    pub wait_timeouts: u64,
    /// The tokens the saved requests did not spend.
    pub saved_input_tokens: u64,
    pub saved_output_tokens: u64,
    /// What they would have cost, in US dollars; `None` when no saved
    /// request's call had a price.
    pub saved_cost_usd: Option<f64>,
    /// Saved requests whose call has no price (not in `saved_cost_usd`).
    pub unpriced_saves: u64,
}

/// Orders events by group, then arrival, then input order: the order
/// [`simulate`] and [`repeat_gaps`] expect.
pub fn sort(events: &mut [Event]) {
    events.sort_unstable_by_key(|e| (e.group, e.time_us, e.seq));
}

fn signed(us: u64) -> i64 {
    i64::try_from(us).unwrap_or(i64::MAX)
}

/// Runs the rule of the module documentation over `sorted` events, with
/// the events' `prices`.
pub fn simulate(sorted: &[Event], s: Settings, prices: &[Price]) -> Savings {
    let wait = signed(s.wait_us);
    let ttl = signed(s.ttl_us);
    let mut out = Savings {
        wait_ms: s.wait_us as f64 / 1000.0,
        ttl_s: s.ttl_us as f64 / 1_000_000.0,
        requests: sorted.len() as u64,
        ..Savings::default()
    };
    // Summed in nano-dollars, so that the order of the sum does not change
    // the figure.
    let mut saved_nanos: u64 = 0;
    let mut priced_saves: u64 = 0;
    for group in sorted.chunk_by(|a, b| a.group == b.group) {
        let mut end = i64::MIN;
        let mut cache_until = i64::MIN;
        // The event whose call answers the saved ones.
        let mut call: Option<&Event> = None;
        let mut save = |call: Option<&Event>| {
            let Some(c) = call else { return };
            let tokens = Tokens {
                input: u64::from(c.input_tokens),
                cached_input: 0,
                output: u64::from(c.output_tokens),
            };
            out.saved_input_tokens += tokens.input;
            out.saved_output_tokens += tokens.output;
            match prices.get(c.price as usize).filter(|_| c.price != NO_PRICE) {
                Some(p) => {
                    saved_nanos += crate::prices::nanos(p.cost(&tokens));
                    priced_saves += 1;
                }
                None => out.unpriced_saves += 1,
            }
        };
        for e in group {
            let t = e.time_us;
            if t < end {
                if end.saturating_sub(t) <= wait {
                    out.saved_by_coalescing += 1;
                    save(call);
                } else {
                    out.wait_timeouts += 1;
                    out.upstream_calls += 1;
                }
            } else if t < cache_until {
                out.saved_by_cache += 1;
                save(call);
            } else {
                out.upstream_calls += 1;
                call = Some(e);
                let d = if e.upstream_us > 0 {
                    signed(e.upstream_us)
                } else {
                    wait
                };
                end = t.saturating_add(d);
                cache_until = if e.cacheable {
                    end.saturating_add(ttl)
                } else {
                    end
                };
            }
        }
    }
    out.saved = out.saved_by_coalescing + out.saved_by_cache;
    out.saved_cost_usd = (priced_saves > 0).then(|| saved_nanos as f64 / 1e9);
    if out.requests > 0 {
        out.saved_share = out.saved as f64 / out.requests as f64;
    }
    out
}

/// The gaps between consecutive arrivals within each group, in
/// microseconds, sorted.
pub fn repeat_gaps(sorted: &[Event]) -> Vec<u64> {
    let mut gaps: Vec<u64> = sorted
        .windows(2)
        .filter(|w| w[0].group == w[1].group)
        .map(|w| u64::try_from(w[1].time_us.saturating_sub(w[0].time_us)).unwrap_or(0))
        .collect();
    gaps.sort_unstable();
    gaps
}

/// The nearest-rank percentile `pct` (1..=100) of sorted values: the
/// smallest value with at least `pct` % of the values at or below it.
pub fn percentile(sorted: &[u64], pct: u64) -> Option<u64> {
    let n = sorted.len() as u64;
    if n == 0 {
        return None;
    }
    let rank = (n * pct.clamp(1, 100)).div_ceil(100).max(1);
    sorted.get(usize::try_from(rank - 1).ok()?).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: i64 = 1000;
    const S: i64 = 1_000_000;

    /// Events of one group from (time, upstream) pairs, in input order.
    fn group(g: u32, times: &[(i64, u64)]) -> Vec<Event> {
        times
            .iter()
            .enumerate()
            .map(|(i, &(t, up))| Event {
                group: g,
                time_us: t,
                upstream_us: up,
                cacheable: true,
                seq: g * 1000 + i as u32,
                input_tokens: 0,
                output_tokens: 0,
                price: NO_PRICE,
            })
            .collect()
    }

    fn run(mut events: Vec<Event>, wait_ms: u64, ttl_s: u64) -> Savings {
        sort(&mut events);
        simulate(
            &events,
            Settings {
                wait_us: wait_ms * 1000,
                ttl_us: ttl_s * 1_000_000,
            },
            &[],
        )
    }

    #[test]
    fn a_repeat_exactly_at_the_window_edge_is_not_a_follower() {
        // No upstream duration: the call lasts the wait window, [0, 1 s).
        let just_inside = group(0, &[(0, 0), (S - 1, 0)]);
        let s = run(just_inside, 1000, 0);
        assert_eq!((s.saved_by_coalescing, s.upstream_calls), (1, 1));
        let at_edge = group(0, &[(0, 0), (S, 0)]);
        let s = run(at_edge.clone(), 1000, 0);
        assert_eq!((s.saved, s.upstream_calls), (0, 2));
        // With a cache, the answer is there from the call's end on.
        let s = run(at_edge, 1000, 30);
        assert_eq!((s.saved_by_cache, s.upstream_calls), (1, 1));
    }

    #[test]
    fn a_repeat_after_the_ttl_makes_a_new_call() {
        // Call [0, 200 ms), cached until 200 ms + 30 s.
        let events = group(
            0,
            &[
                (0, 200_000),
                (30 * S + 199 * MS, 0),
                (30 * S + 200 * MS, 0),
                (30 * S + 300 * MS, 0),
            ],
        );
        let s = run(events, 1000, 30);
        assert_eq!(s.saved_by_cache, 1, "{s:?}");
        // The third request leads a new call lasting the wait window (no
        // upstream_ms on its line), which the fourth joins.
        assert_eq!(s.upstream_calls, 2);
        assert_eq!(s.saved_by_coalescing, 1);
    }

    #[test]
    fn a_call_longer_than_the_wait_window_times_early_followers_out() {
        // Call [0, 5 s); wait 1 s: only arrivals from 4 s on can wait.
        let events = group(0, &[(0, 5_000_000), (S, 0), (4 * S, 0), (6 * S, 0)]);
        let s = run(events, 1000, 0);
        assert_eq!(s.wait_timeouts, 1);
        assert_eq!(s.saved_by_coalescing, 1);
        assert_eq!(
            s.upstream_calls, 3,
            "leader, timeout, and a new leader at 6 s"
        );
    }

    #[test]
    fn errors_are_shared_but_not_cached() {
        let mut events = group(0, &[(0, 100_000), (50 * MS, 0), (150 * MS, 0)]);
        events[0].cacheable = false;
        let s = run(events, 1000, 30);
        assert_eq!(s.saved_by_coalescing, 1);
        assert_eq!(s.saved_by_cache, 0);
        assert_eq!(s.upstream_calls, 2);
    }

    #[test]
    fn two_tenants_are_never_merged() {
        // The same fingerprint under two tenants is two groups: the
        // collector keys groups by (tenant, fingerprint).
        let mut c = super::super::input::Collector::default();
        let fp = crate::fingerprint::Fingerprint::from_bytes([9; 32]);
        for tenant in ["a", "b", "a", "b"] {
            c.line(
                format!(r#"{{"time":"2025-01-01T00:00:00Z","tenant":"{tenant}","route":"r","fingerprint":"{fp}","outcome":"leader","status":200}}"#)
                    .as_bytes(),
            );
        }
        assert_eq!(c.groups.len(), 2);
        let s = run(c.events, 1000, 30);
        assert_eq!(s.upstream_calls, 2);
        assert_eq!(s.saved_by_coalescing, 2);
    }

    #[test]
    fn simultaneous_arrivals_follow_the_first_in_input_order() {
        let events = group(0, &[(5 * S, 0), (5 * S, 0), (5 * S, 0)]);
        let s = run(events, 0, 0);
        assert_eq!(
            s.upstream_calls, 3,
            "wait 0 and ttl 0: no coalescing, no cache"
        );
        let events = group(0, &[(5 * S, 0), (5 * S, 0), (5 * S, 0)]);
        let s = run(events, 1, 0);
        assert_eq!((s.upstream_calls, s.saved_by_coalescing), (1, 2));
    }

    #[test]
    fn gaps_and_percentiles() {
        let mut events = group(0, &[(0, 0), (10 * MS, 0), (30 * MS, 0)]);
        events.extend(group(1, &[(5 * MS, 0), (105 * MS, 0)]));
        sort(&mut events);
        assert_eq!(repeat_gaps(&events), [10_000, 20_000, 100_000]);
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50), Some(50));
        assert_eq!(percentile(&v, 95), Some(95));
        assert_eq!(percentile(&v, 99), Some(99));
        assert_eq!(percentile(&[7], 99), Some(7));
        assert_eq!(percentile(&[], 50), None);
        assert_eq!(percentile(&[1, 2, 3], 50), Some(2));
    }
}
