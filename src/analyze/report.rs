//! `idem analyze`'s figures, its recommendation, and their two renderings:
//! text for people, JSON (`--json`) for machines. The JSON field names are
//! as stable as the request log's.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::Serialize;

use super::input::{Collector, Counts, EndpointCounts};
use super::simulate::{self, Savings, Settings};

/// The usual range of a success TTL (docs/design.md, "Coalescing and the caches"'s advice): long enough
/// to absorb the next wave, short enough that answers stay fresh.
pub const TTL_FLOOR_S: u64 = 15;
pub const TTL_CAP_S: u64 = 60;
/// `coalesce.max_wait = "auto"`'s bounds.
pub const WAIT_FLOOR: Duration = Duration::from_millis(300);
pub const WAIT_CEILING: Duration = Duration::from_secs(30);
/// The wait window assumed when `--wait auto` finds no leader latency.
pub const WAIT_ASSUMED: Duration = Duration::from_secs(1);
/// Below these duplicate shares coalescing is not worth it, or marginal.
pub const NOT_WORTH_IT: f64 = 0.01;
pub const MARGINAL: f64 = 0.02;

/// `--wait`: a fixed window, or `auto` (as the gateway's `max_wait`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Wait {
    #[default]
    Auto,
    Fixed(Duration),
}

impl std::str::FromStr for Wait {
    type Err = String;
    fn from_str(s: &str) -> Result<Wait, String> {
        if s == "auto" {
            return Ok(Wait::Auto);
        }
        humantime::parse_duration(s)
            .map(Wait::Fixed)
            .map_err(|e| format!("expected \"auto\" or a duration such as 500ms or 2s: {e}"))
    }
}

/// Three percentiles of a distribution, in milliseconds.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Quantiles {
    pub count: u64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
}

impl Quantiles {
    /// Of sorted microsecond values; None when there are none.
    fn of(sorted_us: &[u64]) -> Option<Quantiles> {
        let ms = |p| simulate::percentile(sorted_us, p).map(|us| us as f64 / 1000.0);
        Some(Quantiles {
            count: sorted_us.len() as u64,
            p50_ms: ms(50)?,
            p95_ms: ms(95)?,
            p99_ms: ms(99)?,
        })
    }
}

/// One of the largest duplicate groups.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GroupReport {
    pub fingerprint: String,
    pub tenant: String,
    pub route: String,
    pub requests: u64,
    /// First and last arrival (RFC 3339), when the input has times.
    pub first: Option<String>,
    pub last: Option<String>,
}

/// The wait window the simulation used, and where it came from.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WaitUsed {
    pub ms: f64,
    pub source: String,
}

/// What the log itself says happened (request-log input only).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Observed {
    pub outcomes: BTreeMap<String, u64>,
    /// Lines answered without a call of their own (`follower`,
    /// `cache-hit`, `negative-hit`, `replay`).
    pub saved: u64,
    pub saved_share: f64,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    WorthIt,
    Marginal,
    NotWorthIt,
    Unknown,
}

/// The suggested settings and why.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Recommendation {
    pub verdict: Verdict,
    /// `coalesce.max_wait`; None: keep `"auto"`.
    pub max_wait_ms: Option<u64>,
    /// `cache.ttl` in seconds; None: no basis in the data.
    pub ttl_s: Option<u64>,
    /// The share of repeat gaps no longer than the suggested TTL.
    pub ttl_covers_share: Option<f64>,
    pub reasons: Vec<String>,
    /// The simulation rerun with the suggested settings.
    pub simulation: Option<Savings>,
}

/// Everything `idem analyze` reports.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    pub inputs: Vec<String>,
    pub lines: Counts,
    pub requests: u64,
    /// Distinct (tenant, fingerprint) pairs.
    pub distinct_tasks: u64,
    /// Requests whose (tenant, fingerprint) was seen before.
    pub duplicates: u64,
    /// `duplicates / requests`.
    pub duplicate_share: f64,
    pub largest_groups: Vec<GroupReport>,
    /// The requests of each endpoint (chat completions, Messages,
    /// Responses, embeddings, jobs), by name.
    pub endpoints: BTreeMap<String, EndpointCounts>,
    /// Why the time-based figures are missing, when they are.
    pub time_unavailable: Option<String>,
    pub wait: WaitUsed,
    pub simulation: Option<Savings>,
    pub repeat_gaps: Option<Quantiles>,
    /// `upstream_ms` of `leader` and `bypass` lines.
    pub leader_latency: Option<Quantiles>,
    pub observed: Option<Observed>,
    pub recommendation: Recommendation,
}

/// What the report is computed with.
#[derive(Debug, Clone)]
pub struct ReportOptions {
    pub wait: Wait,
    pub ttl: Duration,
    pub top: usize,
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

fn rfc3339_us(t: i64) -> Option<String> {
    let t = std::time::UNIX_EPOCH.checked_add(Duration::from_micros(u64::try_from(t).ok()?))?;
    Some(humantime::format_rfc3339_millis(t).to_string())
}

impl Report {
    /// Computes every figure from what `c` collected.
    pub fn build(mut c: Collector, inputs: Vec<String>, opts: &ReportOptions) -> Report {
        simulate::sort(&mut c.events);
        let events = &c.events;
        let requests = events.len() as u64;
        let distinct = c.groups.len() as u64;
        let duplicates = requests - distinct;
        let duplicate_share = if requests > 0 {
            duplicates as f64 / requests as f64
        } else {
            0.0
        };

        c.leader_upstream_us.sort_unstable();
        let leader_latency = Quantiles::of(&c.leader_upstream_us);
        let leader_p99 = simulate::percentile(&c.leader_upstream_us, 99);
        let wait = match (opts.wait, leader_p99) {
            (Wait::Fixed(d), _) => WaitUsed {
                ms: d.as_secs_f64() * 1000.0,
                source: "--wait".into(),
            },
            (Wait::Auto, Some(p99)) => WaitUsed {
                ms: auto_wait(p99) as f64 / 1000.0,
                source: format!(
                    "auto: 1.5 x the p99 leader latency ({:.1} ms), within [300 ms, 30 s]",
                    p99 as f64 / 1000.0
                ),
            },
            (Wait::Auto, None) => WaitUsed {
                ms: WAIT_ASSUMED.as_secs_f64() * 1000.0,
                source: "auto: no leader latency in the input, 1 s assumed".into(),
            },
        };
        let wait_us = (wait.ms * 1000.0).round() as u64;

        let time_unavailable = if requests == 0 {
            Some("no requests".to_string())
        } else if c.counts.untimed == requests {
            Some("no request has a time or timestamp field".to_string())
        } else if c.counts.untimed > 0 {
            Some(format!(
                "{} of {requests} requests have no time or timestamp field",
                c.counts.untimed
            ))
        } else {
            None
        };
        let timed = time_unavailable.is_none();

        // Groups are contiguous in sorted order and numbered by first
        // appearance, so the n-th run of events is group n.
        let spans: Vec<(i64, i64)> = events
            .chunk_by(|a, b| a.group == b.group)
            .map(|g| {
                let first = g.first().map_or(0, |e| e.time_us);
                let last = g.last().map_or(0, |e| e.time_us);
                (first, last)
            })
            .collect();
        let mut order: Vec<usize> = (0..c.groups.len())
            .filter(|&i| c.groups[i].requests > 1)
            .collect();
        order.sort_by_key(|&i| (Reverse(c.groups[i].requests), i));
        let largest_groups = order
            .into_iter()
            .take(opts.top)
            .map(|i| {
                let g = &c.groups[i];
                let (first, last) = spans.get(i).copied().unwrap_or((0, 0));
                GroupReport {
                    fingerprint: c.fingerprint_text(g),
                    tenant: c.tenants.get(g.tenant as usize).map_or("", |s| s).into(),
                    route: c.routes.get(g.route as usize).map_or("", |s| s).into(),
                    requests: g.requests,
                    first: timed.then(|| rfc3339_us(first)).flatten(),
                    last: timed.then(|| rfc3339_us(last)).flatten(),
                }
            })
            .collect();

        let settings = Settings {
            wait_us,
            ttl_us: us(opts.ttl),
        };
        let simulation = timed.then(|| simulate::simulate(events, settings, &c.prices));
        let gaps = if timed {
            simulate::repeat_gaps(events)
        } else {
            Vec::new()
        };
        let repeat_gaps = Quantiles::of(&gaps);

        let observed = (c.counts.log_lines > 0).then(|| {
            let outcomes: BTreeMap<String, u64> = c
                .outcomes
                .iter()
                .map(|(k, v)| (k.to_string(), *v))
                .collect();
            let saved = ["follower", "cache-hit", "negative-hit", "replay"]
                .iter()
                .filter_map(|k| outcomes.get(*k))
                .sum::<u64>();
            Observed {
                saved,
                saved_share: saved as f64 / c.counts.log_lines as f64,
                outcomes,
            }
        });

        let mut recommendation = recommend(
            requests,
            duplicate_share,
            leader_latency.as_ref(),
            leader_p99,
            timed.then_some(gaps.as_slice()),
        );
        if timed {
            let rec = Settings {
                wait_us: recommendation.max_wait_ms.map_or(wait_us, |ms| ms * 1000),
                ttl_us: recommendation.ttl_s.map_or(us(opts.ttl), |s| s * 1_000_000),
            };
            recommendation.simulation = Some(simulate::simulate(events, rec, &c.prices));
        }

        let endpoints = c
            .endpoints
            .iter()
            .zip(&c.by_endpoint)
            .map(|(name, counts)| (name.to_string(), counts.clone()))
            .collect();
        Report {
            inputs,
            endpoints,
            lines: c.counts.clone(),
            requests,
            distinct_tasks: distinct,
            duplicates,
            duplicate_share,
            largest_groups,
            time_unavailable,
            wait,
            simulation,
            repeat_gaps,
            leader_latency,
            observed,
            recommendation,
        }
    }
}

/// `max_wait = "auto"`: 1.5 x p99, within [300 ms, 30 s] (microseconds).
fn auto_wait(p99_us: u64) -> u64 {
    (p99_us.saturating_mul(3) / 2).clamp(us(WAIT_FLOOR), us(WAIT_CEILING))
}

/// The recommendation rule (docs/analyze.md, "The recommendation"):
///
/// - verdict from the duplicate share: under 1 % coalescing is not worth
///   it, under 2 % it is marginal;
/// - wait window: 1.5 x the p99 leader latency within [300 ms, 30 s],
///   rounded up to 50 ms (what `max_wait = "auto"` converges to); without
///   leader latencies, keep `auto`;
/// - TTL: the p95 of the gaps between repeats, rounded up to whole seconds
///   and held within [15 s, 60 s]; none without times or repeats.
pub fn recommend(
    requests: u64,
    duplicate_share: f64,
    leader: Option<&Quantiles>,
    leader_p99_us: Option<u64>,
    sorted_gaps_us: Option<&[u64]>,
) -> Recommendation {
    let mut reasons = Vec::new();
    let pct = duplicate_share * 100.0;
    let verdict = if requests == 0 {
        reasons.push("no requests in the input: nothing to recommend".into());
        Verdict::Unknown
    } else if duplicate_share < NOT_WORTH_IT {
        reasons.push(format!(
            "only {pct:.2} % of requests repeat an earlier one (under 1 %): coalescing and \
             the result cache would save almost nothing here; leave them on only for routes \
             known to be hot"
        ));
        Verdict::NotWorthIt
    } else if duplicate_share < MARGINAL {
        reasons.push(format!(
            "{pct:.2} % of requests repeat an earlier one (under 2 %): the saving is \
             marginal unless calls on these routes are expensive"
        ));
        Verdict::Marginal
    } else {
        reasons.push(format!(
            "{pct:.2} % of requests repeat an earlier one: coalescing and caching pay off"
        ));
        Verdict::WorthIt
    };

    let max_wait_ms = match (leader, leader_p99_us) {
        (Some(q), Some(p99)) => {
            let ms = auto_wait(p99).div_ceil(50_000) * 50;
            reasons.push(format!(
                "coalesce.max_wait = \"{ms}ms\": 1.5 x the p99 leader latency ({}; p95 {}), \
                 within [300 ms, 30 s], so a follower outwaits nearly every call; this is what \
                 max_wait = \"auto\" converges to",
                human_ms(q.p99_ms),
                human_ms(q.p95_ms)
            ));
            Some(ms)
        }
        _ => {
            reasons.push(
                "coalesce.max_wait: the input has no upstream_ms of leaders; keep \
                 max_wait = \"auto\" (1.5 x the p99 latency the gateway observes)"
                    .into(),
            );
            None
        }
    };

    let (ttl_s, ttl_covers_share) = match sorted_gaps_us {
        None => {
            reasons.push(
                "cache.ttl: without times the gaps between repeats are unknown; keep the \
                 default 30s"
                    .into(),
            );
            (None, None)
        }
        Some([]) => {
            reasons.push("cache.ttl: no fingerprint repeats, a cache would never be hit".into());
            (None, None)
        }
        Some(gaps) => {
            let p95 = simulate::percentile(gaps, 95).unwrap_or(0);
            let ttl = p95.div_ceil(1_000_000).clamp(TTL_FLOOR_S, TTL_CAP_S);
            let covered =
                gaps.partition_point(|&g| g <= ttl * 1_000_000) as f64 / gaps.len() as f64;
            let p95_h = human_ms(p95 as f64 / 1000.0);
            let cov = covered * 100.0;
            reasons.push(if p95 <= TTL_FLOOR_S * 1_000_000 {
                format!(
                    "cache.ttl = \"{ttl}s\": 95 % of repeats come within {p95_h} of the \
                     previous one; the 15 s floor of the usual range costs little and also \
                     catches stragglers ({cov:.1} % of repeat gaps are within {ttl} s)"
                )
            } else if p95 <= TTL_CAP_S * 1_000_000 {
                format!(
                    "cache.ttl = \"{ttl}s\": 95 % of repeats come within {p95_h} of the \
                     previous one ({cov:.1} % of repeat gaps are within {ttl} s)"
                )
            } else {
                format!(
                    "cache.ttl = \"{ttl}s\": repeats are spread out (p95 gap {p95_h}); \
                     60 s, the top of the usual 15-60 s range, catches {cov:.1} % of them; a \
                     longer TTL would catch more but serves older answers, so raise it only if \
                     answers stay valid that long"
                )
            });
            (Some(ttl), Some(covered))
        }
    };

    Recommendation {
        verdict,
        max_wait_ms,
        ttl_s,
        ttl_covers_share,
        reasons,
        simulation: None,
    }
}

/// A duration in milliseconds, in the unit that reads best.
fn human_ms(ms: f64) -> String {
    if ms < 1.0 {
        format!("{ms:.2} ms")
    } else if ms < 1000.0 {
        format!("{ms:.0} ms")
    } else if ms < 120_000.0 {
        format!("{:.1} s", ms / 1000.0)
    } else {
        format!("{:.1} min", ms / 60_000.0)
    }
}

fn pct(x: f64) -> String {
    format!("{:.2} %", x * 100.0)
}

fn savings_text(out: &mut String, s: &Savings) {
    let _ = writeln!(out, "  wait window           {:>10}", human_ms(s.wait_ms));
    let _ = writeln!(
        out,
        "  cache ttl             {:>10}",
        human_ms(s.ttl_s * 1000.0)
    );
    let _ = writeln!(
        out,
        "  upstream calls        {:>10}   (of {} requests)",
        s.upstream_calls, s.requests
    );
    let _ = writeln!(out, "  saved by coalescing   {:>10}", s.saved_by_coalescing);
    let _ = writeln!(out, "  saved by the cache    {:>10}", s.saved_by_cache);
    let _ = writeln!(
        out,
        "  saved in all          {:>10}   ({})",
        s.saved,
        pct(s.saved_share)
    );
    let _ = writeln!(out, "  wait timeouts         {:>10}", s.wait_timeouts);
    let _ = writeln!(
        out,
        "  saved tokens          {:>10}   ({} input, {} output)",
        s.saved_input_tokens + s.saved_output_tokens,
        s.saved_input_tokens,
        s.saved_output_tokens
    );
    let cost = match s.saved_cost_usd {
        Some(d) => format!("{:>10}", format!("${d:.6}")),
        None => format!("{:>10}", "unknown"),
    };
    let unpriced = match s.unpriced_saves {
        0 => String::new(),
        n => format!("   ({n} saved requests without a price are not in it)"),
    };
    let _ = writeln!(out, "  saved cost            {cost}{unpriced}");
}

fn quantiles_text(q: &Option<Quantiles>) -> String {
    match q {
        Some(q) => format!(
            "p50 {}, p95 {}, p99 {}   (n = {})",
            human_ms(q.p50_ms),
            human_ms(q.p95_ms),
            human_ms(q.p99_ms),
            q.count
        ),
        None => "unavailable".into(),
    }
}

impl Report {
    /// The human-readable report.
    pub fn text(&self) -> String {
        let mut o = String::new();
        let l = &self.lines;
        let _ = writeln!(
            o,
            "idem analyze: {} requests from {} ({} log lines, {} raw bodies)",
            self.requests,
            self.inputs.join(", "),
            l.log_lines,
            l.raw_bodies
        );
        if l.other_lines + l.unreadable_lines + l.other_routes > 0 {
            let _ = writeln!(
                o,
                "  skipped: {} other lines (not requests), {} unreadable lines, {} lines of other routes",
                l.other_lines, l.unreadable_lines, l.other_routes
            );
        }
        if self.requests == 0 && l.unreadable_lines > 0 {
            let _ = writeln!(
                o,
                "  no requests found: a request log is idem's JSON or text request lines, \
                 or raw chat completion bodies"
            );
        }

        let _ = writeln!(o, "\nDuplicates (by the fingerprint rule)");
        let _ = writeln!(o, "  distinct tasks        {:>10}", self.distinct_tasks);
        let _ = writeln!(
            o,
            "  repeats               {:>10}   ({} of requests)",
            self.duplicates,
            pct(self.duplicate_share)
        );
        if !self.largest_groups.is_empty() {
            let _ = writeln!(o, "  largest groups:");
            for g in &self.largest_groups {
                let short: String = g.fingerprint.chars().take(19).collect();
                let _ = write!(
                    o,
                    "    {:>8}  {short}..  tenant {}  route {}",
                    g.requests, g.tenant, g.route
                );
                if let (Some(f), Some(t)) = (&g.first, &g.last) {
                    let _ = write!(o, "  {f} .. {t}");
                }
                let _ = writeln!(o);
            }
        }

        if !self.endpoints.is_empty() {
            let _ = writeln!(
                o,
                "\nBy endpoint        requests   distinct           repeats   saved in the log"
            );
            for (name, e) in &self.endpoints {
                let repeats = e.requests.saturating_sub(e.distinct_tasks);
                let share = if e.requests > 0 {
                    repeats as f64 / e.requests as f64
                } else {
                    0.0
                };
                let _ = writeln!(
                    o,
                    "  {name:<12} {:>10} {:>10} {:>9} {:>7} {:>10}",
                    e.requests,
                    e.distinct_tasks,
                    repeats,
                    format!("({})", pct(share)),
                    e.saved,
                );
            }
        }

        match (&self.simulation, &self.time_unavailable) {
            (Some(s), _) => {
                let _ = writeln!(
                    o,
                    "\nWhat idem would have saved (wait: {})",
                    self.wait.source
                );
                savings_text(&mut o, s);
            }
            (None, why) => {
                let _ = writeln!(
                    o,
                    "\nWhat idem would have saved: unavailable ({})",
                    why.as_deref().unwrap_or("no times")
                );
            }
        }
        let _ = writeln!(
            o,
            "\nGaps between repeats   {}",
            quantiles_text(&self.repeat_gaps)
        );
        let _ = writeln!(
            o,
            "Leader latency         {}",
            quantiles_text(&self.leader_latency)
        );
        if let Some(obs) = &self.observed {
            let list: Vec<String> = obs
                .outcomes
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect();
            let _ = writeln!(
                o,
                "Observed in the log    {}; saved {} ({})",
                list.join(", "),
                obs.saved,
                pct(obs.saved_share)
            );
        }

        let r = &self.recommendation;
        let verdict = match r.verdict {
            Verdict::WorthIt => "worth it",
            Verdict::Marginal => "marginal",
            Verdict::NotWorthIt => "not worth it",
            Verdict::Unknown => "unknown",
        };
        let _ = writeln!(o, "\nRecommendation: coalescing and caching are {verdict}");
        for reason in &r.reasons {
            let _ = writeln!(o, "  - {reason}");
        }
        if let Some(s) = &r.simulation {
            let _ = writeln!(o, "\nWith the recommended settings");
            savings_text(&mut o, s);
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_parses_auto_or_a_duration() {
        assert_eq!("auto".parse::<Wait>(), Ok(Wait::Auto));
        assert_eq!(
            "750ms".parse::<Wait>(),
            Ok(Wait::Fixed(Duration::from_millis(750)))
        );
        assert!("soon".parse::<Wait>().is_err());
    }

    #[test]
    fn the_verdict_follows_the_duplicate_share() {
        let r = recommend(1000, 0.005, None, None, None);
        assert_eq!(r.verdict, Verdict::NotWorthIt);
        assert!(r.reasons[0].contains("under 1 %"), "{:?}", r.reasons);
        assert_eq!(
            recommend(1000, 0.015, None, None, None).verdict,
            Verdict::Marginal
        );
        assert_eq!(
            recommend(1000, 0.3, None, None, None).verdict,
            Verdict::WorthIt
        );
        assert_eq!(
            recommend(0, 0.0, None, None, None).verdict,
            Verdict::Unknown
        );
    }

    #[test]
    fn the_wait_window_comes_from_the_leader_p99() {
        let q = Quantiles {
            count: 100,
            p50_ms: 400.0,
            p95_ms: 700.0,
            p99_ms: 810.0,
        };
        let r = recommend(100, 0.5, Some(&q), Some(810_000), None);
        assert_eq!(r.max_wait_ms, Some(1250), "1.5 x 810 = 1215, up to 50 ms");
        let r = recommend(100, 0.5, Some(&q), Some(50_000), None);
        assert_eq!(r.max_wait_ms, Some(300), "the 300 ms floor");
        let r = recommend(100, 0.5, Some(&q), Some(60_000_000), None);
        assert_eq!(r.max_wait_ms, Some(30_000), "the 30 s ceiling");
        assert_eq!(recommend(100, 0.5, None, None, None).max_wait_ms, None);
    }

    #[test]
    fn the_ttl_comes_from_the_repeat_gaps_within_15_to_60_s() {
        let s = 1_000_000u64;
        let tight: Vec<u64> = (1..=100).map(|i| i * 10_000).collect();
        let r = recommend(100, 0.5, None, None, Some(&tight));
        assert_eq!(r.ttl_s, Some(15));
        assert_eq!(r.ttl_covers_share, Some(1.0));
        let mid: Vec<u64> = (1..=100).map(|i| i * 300_000).collect(); // p95 = 28.5 s
        assert_eq!(recommend(100, 0.5, None, None, Some(&mid)).ttl_s, Some(29));
        let wide: Vec<u64> = (1..=100).map(|i| i * 10 * s).collect();
        let r = recommend(100, 0.5, None, None, Some(&wide));
        assert_eq!(r.ttl_s, Some(60));
        assert_eq!(r.ttl_covers_share, Some(0.06));
        assert_eq!(recommend(100, 0.0, None, None, Some(&[])).ttl_s, None);
        assert_eq!(recommend(100, 0.5, None, None, None).ttl_s, None);
    }
}
