//! Numbers, not feelings: the Prometheus metrics of docs/design.md, "Numbers" and the
//! per-tenant figures behind `GET /v1/stats`.
//!
//! Each [`App`](crate::app::App) owns its own Prometheus recorder (not the
//! process-global one), so several gateways in one test process never mix
//! their counts. Handles for every label set the configuration names (routes,
//! outcomes, tenants) are registered at start-up, and for new names when a
//! reload brings them; the hot path only bumps atomics.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use dashmap::DashMap;
use hdrhistogram::Histogram as Hdr;
use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder};
use metrics_exporter_prometheus::{
    Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder,
};
use serde::Serialize;
use tracing_appender::non_blocking::ErrorCounter;

use crate::config::Config;
use crate::outcome::{Outcome, Refusal};
use crate::prices::{Price, Tokens};
use crate::tenants::ANONYMOUS_TENANT;

/// The `route` label of a request refused before it was routed (or whose
/// model names no route).
pub const UNROUTED: &str = "-";

const WAIT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

struct RouteHandles {
    requests: HashMap<Outcome, Counter>,
    refused: [Counter; 5],
    wait: Histogram,
    wait_timeouts: Counter,
    leader_errors_shared: Counter,
    saved: Counter,
    races: Tally,
    failover_blocked: Counter,
    /// Embeddings items by how each was answered.
    items: HashMap<Outcome, Counter>,
    saved_input_tokens: Counter,
    saved_cached_input_tokens: Counter,
    saved_output_tokens: Counter,
    /// What the saved calls would have cost, where their target has a
    /// price (`idem_saved_cost_total`, rendered by [`Metrics::render`]).
    saved_cost: Dollars,
    /// Request latency (arrival to the answer's head), for the timeline.
    latency: Latencies,
}

/// US dollars added up exactly, as nano-dollars, and whether anything
/// priced was added at all (until then the figure is unknown, not 0).
#[derive(Default)]
struct Dollars {
    nanos: AtomicU64,
    priced: AtomicU64,
}

impl Dollars {
    fn add(&self, dollars: f64) {
        self.nanos
            .fetch_add(crate::prices::nanos(dollars), Ordering::Relaxed);
        self.priced.fetch_add(1, Ordering::Relaxed);
    }

    /// The sum, or `None` while nothing priced was added.
    fn get(&self) -> Option<f64> {
        (self.priced.load(Ordering::Relaxed) > 0)
            .then(|| self.nanos.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// A Prometheus counter that also keeps its own total, for the few figures
/// `/v1/stats` reports beside `/metrics` (a `metrics::Counter` cannot be
/// read back).
pub struct Tally {
    counter: Counter,
    total: AtomicU64,
}

impl Tally {
    fn new(counter: Counter) -> Tally {
        Tally {
            counter,
            total: AtomicU64::new(0),
        }
    }

    pub fn increment(&self, n: u64) {
        self.counter.increment(n);
        self.total.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

/// Per-tenant figures for `/v1/stats`.
#[derive(Default)]
pub struct TenantStats {
    incoming: AtomicU64,
    upstream_calls: AtomicU64,
    by_outcome: [AtomicU64; 6],
    /// By [`Refusal::index`].
    refused: [AtomicU64; 5],
    wait_timeouts: AtomicU64,
    leader_errors_shared: AtomicU64,
    waits_us: Mutex<Option<Hdr<u64>>>,
    items: AtomicU64,
    items_sent: AtomicU64,
    /// The tokens and dollars of the calls not made.
    saved: Money,
    /// The tokens and dollars of the calls made.
    spent: Money,
}

/// Tokens and what they cost, added up; `unpriced` counts the additions
/// without a price (in the tokens, not in the dollars).
#[derive(Default)]
struct Money {
    input: AtomicU64,
    cached_input: AtomicU64,
    output: AtomicU64,
    cost: Dollars,
    unpriced: AtomicU64,
}

impl Money {
    fn add(&self, tokens: Tokens, cost: Option<f64>) {
        self.input.fetch_add(tokens.input, Ordering::Relaxed);
        self.cached_input
            .fetch_add(tokens.cached_input, Ordering::Relaxed);
        self.output.fetch_add(tokens.output, Ordering::Relaxed);
        match cost {
            Some(c) => self.cost.add(c),
            None => {
                self.unpriced.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// The figures `/v1/stats` returns for one tenant or for all.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct StatsView {
    pub incoming_requests: u64,
    pub upstream_calls: u64,
    /// upstream calls / incoming requests.
    pub upstream_ratio: f64,
    /// Share of incoming requests answered by another request's call.
    pub duplicate_share: f64,
    pub saved_calls: u64,
    pub leaders: u64,
    pub followers: u64,
    pub cache_hits: u64,
    pub negative_hits: u64,
    pub bypass: u64,
    pub replays: u64,
    /// Requests refused before any work (bad key, bad body, unknown model...).
    pub rejected: u64,
    /// Requests no target could take.
    pub no_target: u64,
    /// Requests whose job was not done within the request timeout.
    pub job_timeouts: u64,
    /// Requests that failed inside idem (the store unavailable...).
    pub errors: u64,
    pub wait_p50_ms: f64,
    pub wait_p95_ms: f64,
    pub wait_p99_ms: f64,
    pub wait_timeouts: u64,
    pub wait_timeout_share: f64,
    pub leader_errors_shared: u64,
    /// Embeddings items asked for (each item of a batch is a task).
    pub embedding_items: u64,
    /// Embeddings items sent upstream.
    pub embedding_items_sent: u64,
    /// Embeddings items answered without being sent (cache, a flight).
    pub embedding_items_saved: u64,
    /// Input tokens not spent: those of the calls that requests answered
    /// without a call of their own did not make (for embeddings, the share
    /// of each saved item in the call that embedded it).
    pub saved_input_tokens: u64,
    /// Of those, the ones the provider would have read from its cache.
    pub saved_cached_input_tokens: u64,
    pub saved_output_tokens: u64,
    /// What those calls would have cost, in US dollars; `null` when none
    /// of them had a price (unknown, not zero).
    pub saved_cost_usd: Option<f64>,
    /// Saved calls whose target has no price (not in `saved_cost_usd`).
    pub unpriced_saves: u64,
    /// Tokens of the upstream calls made.
    pub spent_input_tokens: u64,
    pub spent_cached_input_tokens: u64,
    pub spent_output_tokens: u64,
    /// What the upstream calls cost, in US dollars; `null` when none had
    /// a price.
    pub spent_cost_usd: Option<f64>,
    /// Upstream calls whose target has no price (not in `spent_cost_usd`).
    pub unpriced_calls: u64,
}

/// The handles of every route, tenant and provider a configuration of
/// this gateway has named.
#[derive(Default, Clone)]
struct Named {
    routes: HashMap<String, Arc<RouteHandles>>,
    tenants: HashMap<String, Arc<TenantStats>>,
    /// Per provider: 2xx answers that were no answer of their endpoint.
    bad_answers: HashMap<String, Counter>,
    /// Per provider: answers past its `max_answer_bytes`.
    too_large: HashMap<String, Counter>,
}

/// All metrics of one gateway.
/// One spender's budget as `/metrics` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct BudgetLine {
    pub tenant: String,
    /// The key's id; empty for a tenant's own budget.
    pub key: String,
    /// The key's name; empty for a tenant's own budget.
    pub name: String,
    pub limit: Option<f64>,
    pub spent: f64,
    pub reserved: f64,
}

pub struct Metrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    /// The handles of the configuration's names (see [`Metrics::adopt`]).
    named: ArcSwap<Named>,
    /// `idem_requests_total{route="-"}` by [`Refusal::index`].
    unrouted: [Counter; 5],
    /// Requests of no tenant (no or a wrong key, an admin key): in the
    /// gateway's figures, in no tenant's.
    unattributed: TenantStats,
    upstream: DashMap<(Arc<str>, u16), Counter>,
    attempts: DashMap<(Arc<str>, &'static str), Counter>,
    /// `idem_tokens_total{route,provider,kind}`: tokens of upstream calls.
    spent_tokens: DashMap<(Arc<str>, Arc<str>, &'static str), Counter>,
    /// `idem_cost_total{route,provider}`: what they cost, for the targets
    /// with a price (rendered by [`Metrics::render`]).
    spent_cost: DashMap<(Arc<str>, Arc<str>), Arc<Dollars>>,
    /// The budgets as last read from the store (see
    /// [`Metrics::set_budgets`]).
    budgets: std::sync::Mutex<Vec<BudgetLine>>,
    pub inflight_flights: Gauge,
    pub jobs_unknown: Gauge,
    pub redis_errors: Tally,
    /// Passes of the job reconciler (`idem_reconciler_passes_total`).
    pub reconciler_passes: Counter,
    rate_limited: Counter,
    /// Configuration reloads by result (`idem_config_reloads_total`), and
    /// whether the last one succeeded.
    reloads_ok: Counter,
    reloads_refused: Counter,
    last_reload_ok: Gauge,
    pub connections: ConnectionGauges,
    /// Log writers whose dropped lines `/metrics` reports, read at each
    /// scrape (the writer keeps its own count).
    log_drops: Mutex<Vec<(Counter, ErrorCounter)>>,
    /// What the dashboard's timeline reads beside the figures above.
    observed: Observed,
}

/// Open client connections by protocol (`idem_http_connections`), counted
/// from their first bytes, when the protocol is known; and the connections
/// refused past `server.max_connections` (`idem_connections_shed_total`).
#[derive(Clone)]
pub struct ConnectionGauges {
    pub http1: Gauge,
    pub http2: Gauge,
    pub shed: Counter,
}

impl ConnectionGauges {
    /// Gauges that count nothing (a server outside an [`App`](crate::app::App)).
    pub fn noop() -> ConnectionGauges {
        ConnectionGauges {
            http1: Gauge::noop(),
            http2: Gauge::noop(),
            shed: Counter::noop(),
        }
    }
}

fn labels(pairs: &[(&'static str, &str)]) -> Vec<Label> {
    pairs
        .iter()
        .map(|(k, v)| Label::new(*k, v.to_string()))
        .collect()
}

/// A counter registered on `recorder` under `name` and `labels`.
fn counter_on(
    recorder: &PrometheusRecorder,
    name: &'static str,
    l: &[(&'static str, &str)],
) -> Counter {
    recorder.register_counter(&Key::from_parts(name, labels(l)), &meta())
}

fn meta() -> Metadata<'static> {
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()))
}

/// `idem_requests_total{route, outcome}` of each [`Refusal`] on `route`.
fn refused_on(recorder: &PrometheusRecorder, route: &str) -> [Counter; 5] {
    Refusal::ALL.map(|why| {
        counter_on(
            recorder,
            "idem_requests_total",
            &[("route", route), ("outcome", why.as_str())],
        )
    })
}

impl Metrics {
    pub fn new(config: &Config) -> Metrics {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full("idem_coalesce_wait_seconds".into()),
                WAIT_BUCKETS,
            )
            .map(|b| b.build_recorder())
            .unwrap_or_else(|_| PrometheusBuilder::new().build_recorder());
        let handle = recorder.handle();
        let meta = meta();
        let unrouted = refused_on(&recorder, UNROUTED);
        let gauge = |name: &'static str| recorder.register_gauge(&Key::from_name(name), &meta);
        let inflight_flights = gauge("idem_inflight_flights");
        let jobs_unknown = gauge("idem_jobs_unknown");
        let redis_errors = Tally::new(
            recorder.register_counter(&Key::from_name("idem_redis_errors_total"), &meta),
        );
        redis_errors.increment(0);
        let rate_limited =
            recorder.register_counter(&Key::from_name("idem_rate_limited_total"), &meta);
        let reconciler_passes =
            recorder.register_counter(&Key::from_name("idem_reconciler_passes_total"), &meta);
        reconciler_passes.increment(0);
        let connections_of = |protocol: &'static str| {
            let key = Key::from_parts("idem_http_connections", labels(&[("protocol", protocol)]));
            let gauge = recorder.register_gauge(&key, &meta);
            gauge.set(0.0);
            gauge
        };
        let shed = recorder.register_counter(&Key::from_name("idem_connections_shed_total"), &meta);
        shed.absolute(0);
        let reloads = |result| {
            let c = counter_on(
                &recorder,
                "idem_config_reloads_total",
                &[("result", result)],
            );
            c.absolute(0);
            c
        };
        let (reloads_ok, reloads_refused) = (reloads("ok"), reloads("refused"));
        let last_reload_ok = gauge("idem_config_last_reload_successful");
        last_reload_ok.set(1.0);
        let connections = ConnectionGauges {
            http1: connections_of("http1"),
            http2: connections_of("http2"),
            shed,
        };
        let m = Metrics {
            recorder,
            handle,
            named: ArcSwap::from_pointee(Named::default()),
            unrouted,
            unattributed: TenantStats::default(),
            upstream: DashMap::new(),
            attempts: DashMap::new(),
            spent_tokens: DashMap::new(),
            spent_cost: DashMap::new(),
            budgets: std::sync::Mutex::new(Vec::new()),
            inflight_flights,
            jobs_unknown,
            redis_errors,
            reconciler_passes,
            rate_limited,
            reloads_ok,
            reloads_refused,
            last_reload_ok,
            connections,
            log_drops: Mutex::new(Vec::new()),
            observed: Observed::default(),
        };
        m.describe();
        m.adopt(config);
        m
    }

    /// Registers the handles of the routes, tenants and providers of
    /// `config` that have none yet: at start-up, and when a reload brings
    /// new names. Handles are never removed: a route that a reload took
    /// away keeps its counts.
    pub fn adopt(&self, config: &Config) {
        self.named.rcu(|named| {
            let mut named = Named::clone(named);
            for route in &config.routes {
                named
                    .routes
                    .entry(route.model.clone())
                    .or_insert_with(|| Arc::new(self.route_handles(&route.model)));
            }
            for t in &config.tenants {
                named.tenants.entry(t.name.clone()).or_default();
            }
            if config.tenants.is_empty() {
                named.tenants.entry(ANONYMOUS_TENANT.into()).or_default();
            }
            for p in &config.providers {
                let name = p.name.as_str();
                let per = |metric| counter_on(&self.recorder, metric, &[("provider", name)]);
                named
                    .bad_answers
                    .entry(p.name.clone())
                    .or_insert_with(|| per("idem_bad_upstream_answers_total"));
                named
                    .too_large
                    .entry(p.name.clone())
                    .or_insert_with(|| per("idem_upstream_answers_too_large_total"));
            }
            named
        });
    }

    fn route_handles(&self, r: &str) -> RouteHandles {
        let recorder = &self.recorder;
        let counter = |name, l: &[(&'static str, &str)]| counter_on(recorder, name, l);
        let requests = Outcome::ALL
            .iter()
            .map(|o| {
                (
                    *o,
                    counter(
                        "idem_requests_total",
                        &[("route", r), ("outcome", o.as_str())],
                    ),
                )
            })
            .collect();
        RouteHandles {
            requests,
            refused: refused_on(recorder, r),
            wait: recorder.register_histogram(
                &Key::from_parts("idem_coalesce_wait_seconds", labels(&[("route", r)])),
                &meta(),
            ),
            wait_timeouts: counter("idem_coalesce_wait_timeouts_total", &[("route", r)]),
            leader_errors_shared: counter("idem_leader_errors_shared_total", &[("route", r)]),
            saved: counter("idem_saved_upstream_calls_total", &[("route", r)]),
            races: Tally::new(counter("idem_attempt_races_total", &[("route", r)])),
            failover_blocked: counter("idem_failover_blocked_total", &[("route", r)]),
            items: Outcome::ALL
                .iter()
                .filter(|o| **o != Outcome::Replay)
                .map(|o| {
                    (
                        *o,
                        counter(
                            "idem_embedding_items_total",
                            &[("route", r), ("outcome", o.as_str())],
                        ),
                    )
                })
                .collect(),
            saved_input_tokens: counter(
                "idem_saved_tokens_total",
                &[("route", r), ("kind", "input")],
            ),
            saved_cached_input_tokens: counter(
                "idem_saved_tokens_total",
                &[("route", r), ("kind", "cached_input")],
            ),
            saved_output_tokens: counter(
                "idem_saved_tokens_total",
                &[("route", r), ("kind", "output")],
            ),
            saved_cost: Dollars::default(),
            latency: Latencies::default(),
        }
    }

    fn describe(&self) {
        let d = |name: &'static str, text: &'static str| {
            self.recorder
                .describe_counter(name.into(), None, text.into());
        };
        d(
            "idem_requests_total",
            "Chat completion requests by route (\"-\": not routed) and outcome (the Idem-Outcome, or why it was refused: rejected, wait-timeout, no-target, job-timeout, error).",
        );
        d(
            "idem_upstream_calls_total",
            "Calls sent to providers, by provider and answer status.",
        );
        d(
            "idem_coalesce_wait_timeouts_total",
            "Followers whose wait for a leader ran out.",
        );
        d(
            "idem_leader_errors_shared_total",
            "Followers that received their leader's error.",
        );
        d(
            "idem_saved_upstream_calls_total",
            "Requests answered without their own upstream call.",
        );
        d(
            "idem_bad_upstream_answers_total",
            "Provider answers with a 2xx status that were not an answer of their endpoint (not JSON, cut short, an error object, no choices, too few embeddings), by provider.",
        );
        d(
            "idem_embedding_items_total",
            "Embeddings input items by route and how each was answered (leader: sent upstream; follower, cache-hit, negative-hit: not sent; bypass: sent without sharing).",
        );
        d(
            "idem_saved_tokens_total",
            "Tokens not spent because a request was answered without its own upstream call, by route and kind (input: every input token; cached_input: of those, the ones the provider would have read from its cache; output).",
        );
        d(
            "idem_tokens_total",
            "Tokens of the upstream calls made, by route, provider and kind (input: every input token; cached_input: of those, read from the provider's cache; output).",
        );
        d(
            "idem_upstream_answers_too_large_total",
            "Provider answers larger than the provider's max_answer_bytes, by provider.",
        );
        d(
            "idem_attempts_total",
            "Job attempts by provider and outcome.",
        );
        d(
            "idem_attempt_races_total",
            "Attempts that finished after another attempt completed the job.",
        );
        d(
            "idem_failover_blocked_total",
            "Failovers not sent because the target is not certified.",
        );
        d(
            "idem_redis_errors_total",
            "Redis operations that failed (idem fell back to local coalescing).",
        );
        d(
            "idem_reconciler_passes_total",
            "Passes of the job reconciler (expired attempts, abandoned jobs, purge).",
        );
        d(
            "idem_rate_limited_total",
            "Requests refused with 429 by a tenant's rate limit.",
        );
        d(
            "idem_trace_spans_dropped_total",
            "Trace spans dropped because their export to the OTLP collector failed (traces on).",
        );
        d(
            "idem_config_reloads_total",
            "Configuration reloads (SIGHUP, POST /v1/admin/reload) by result: ok, refused (the configuration in force stayed).",
        );
        d(
            "idem_connections_shed_total",
            "Client connections refused (503 and closed) because server.max_connections were open.",
        );
        d(
            "idem_log_lines_dropped_total",
            "Log lines dropped because the writer's queue was full, by sink (stdout: the process log, request lines included when they go there; file: the request log file).",
        );
        self.recorder.describe_histogram(
            "idem_coalesce_wait_seconds".into(),
            Some(metrics::Unit::Seconds),
            "How long followers waited for their leader.".into(),
        );
        self.recorder.describe_gauge(
            "idem_inflight_flights".into(),
            None,
            "Upstream calls in flight.".into(),
        );
        self.recorder.describe_gauge(
            "idem_http_connections".into(),
            None,
            "Open client connections by protocol (http1, http2), from their first bytes.".into(),
        );
        self.recorder.describe_gauge(
            "idem_config_last_reload_successful".into(),
            None,
            "1 when the last configuration reload succeeded (or none was tried), 0 when it was refused.".into(),
        );
        self.recorder.describe_gauge(
            "idem_jobs_unknown".into(),
            None,
            "Attempts in state unknown.".into(),
        );

        self.recorder.describe_gauge(
            "idem_circuit_state".into(),
            None,
            "Circuit breaker per target: 0 closed, 1 half-open, 2 open.".into(),
        );
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        if let Ok(watched) = self.log_drops.lock() {
            for (counter, dropped) in watched.iter() {
                counter.absolute(dropped.dropped_lines() as u64);
            }
        }
        self.handle.run_upkeep();
        let mut text = self.handle.render();
        self.render_dollars(&mut text);
        self.render_budgets(&mut text);
        text
    }

    /// The budgets read from the store a moment ago: every replica reads
    /// the same rows, so every replica shows the same figures.
    pub fn set_budgets(&self, lines: Vec<BudgetLine>) {
        if let Ok(mut b) = self.budgets.lock() {
            *b = lines;
        }
    }

    /// `idem_budget_{limit,spent,reserved}_dollars{tenant,key,name}` (a
    /// tenant's own budget has `key=""`).
    fn render_budgets(&self, text: &mut String) {
        use std::fmt::Write;
        let Ok(lines) = self.budgets.lock() else {
            return;
        };
        if lines.is_empty() {
            return;
        }
        let labels = |l: &BudgetLine| {
            format!(
                "tenant=\"{}\",key=\"{}\",name=\"{}\"",
                escape_label(&l.tenant),
                escape_label(&l.key),
                escape_label(&l.name)
            )
        };
        type Figure = fn(&BudgetLine) -> Option<f64>;
        let figures: [(&str, &str, Figure); 3] = [
            (
                "idem_budget_limit_dollars",
                "A key's or tenant's budget for its period, in US dollars (no series: no budget).",
                |l| l.limit,
            ),
            (
                "idem_budget_spent_dollars",
                "What a key or tenant spent in its budget's period (all time without a period), in US dollars, as its calls were settled.",
                |l| Some(l.spent),
            ),
            (
                "idem_budget_reserved_dollars",
                "What calls in progress of a key or tenant reserved against its budget, in US dollars.",
                |l| Some(l.reserved),
            ),
        ];
        for (name, help, figure) in figures {
            let _ = writeln!(text, "# HELP {name} {help}");
            let _ = writeln!(text, "# TYPE {name} gauge");
            for l in lines.iter() {
                if let Some(v) = figure(l) {
                    let _ = writeln!(text, "{name}{{{}}} {v}", labels(l));
                }
            }
            text.push('\n');
        }
    }

    /// The dollar counters, which the exporter's integer counters cannot
    /// hold: a series only for what has a price (no series: unknown).
    fn render_dollars(&self, text: &mut String) {
        use std::fmt::Write;
        let mut spent: Vec<(String, f64)> = self
            .spent_cost
            .iter()
            .filter_map(|e| {
                let (route, provider) = e.key();
                let labels = format!(
                    "route=\"{}\",provider=\"{}\"",
                    escape_label(route),
                    escape_label(provider)
                );
                e.value().get().map(|d| (labels, d))
            })
            .collect();
        let named = self.named.load();
        let mut saved: Vec<(String, f64)> = named
            .routes
            .iter()
            .filter_map(|(route, r)| {
                let labels = format!("route=\"{}\"", escape_label(route));
                r.saved_cost.get().map(|d| (labels, d))
            })
            .collect();
        for (name, help, series) in [
            (
                "idem_cost_total",
                "US dollars spent on upstream calls, from each call's usage and its target's price, by route and provider (no series: no price, the cost is unknown).",
                &mut spent,
            ),
            (
                "idem_saved_cost_total",
                "US dollars not spent: what the calls that followers, cache hits and replays did not make would have cost, by route (no series: no price).",
                &mut saved,
            ),
        ] {
            if series.is_empty() {
                continue;
            }
            series.sort_by(|a, b| a.0.cmp(&b.0));
            let _ = writeln!(text, "# HELP {name} {help}");
            let _ = writeln!(text, "# TYPE {name} counter");
            for (labels, dollars) in series.iter() {
                let _ = writeln!(text, "{name}{{{labels}}} {dollars}");
            }
            text.push('\n');
        }
    }

    /// Reports a log writer's dropped lines as
    /// `idem_log_lines_dropped_total{sink}` (a writer drops rather than make
    /// a request wait when its queue is full).
    pub fn watch_log_drops(&self, sink: &'static str, dropped: ErrorCounter) {
        let key = Key::from_parts("idem_log_lines_dropped_total", labels(&[("sink", sink)]));
        let counter = self.recorder.register_counter(&key, &meta());
        counter.absolute(dropped.dropped_lines() as u64);
        if let Ok(mut watched) = self.log_drops.lock() {
            watched.push((counter, dropped));
        }
    }

    /// A request got its answer with this outcome.
    pub fn request(&self, tenant: &str, route: &str, outcome: Outcome) {
        let named = self.named.load();
        if let Some(r) = named.routes.get(route) {
            if let Some(c) = r.requests.get(&outcome) {
                c.increment(1);
            }
            if outcome.saved_a_call() {
                r.saved.increment(1);
            }
        }
        if let Some(t) = named.tenants.get(tenant) {
            t.incoming.fetch_add(1, Ordering::Relaxed);
            t.by_outcome[outcome_index(outcome)].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A request got an error of idem's own; `tenant` and `route` as far
    /// as they were known (a name that is no tenant's or no route's counts
    /// as unknown, so that no client chooses a label).
    pub fn refused(&self, tenant: Option<&str>, route: Option<&str>, why: Refusal) {
        let named = self.named.load();
        let counters = route
            .and_then(|r| named.routes.get(r))
            .map_or(&self.unrouted, |r| &r.refused);
        counters[why.index()].increment(1);
        let t = tenant
            .and_then(|t| named.tenants.get(t))
            .map_or(&self.unattributed, |t| &**t);
        t.incoming.fetch_add(1, Ordering::Relaxed);
        t.refused[why.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The items of an embeddings request: how many were answered each way
    /// (`leader`/`bypass`: sent), and the input tokens the ones not sent
    /// saved.
    pub fn embedding_items(
        &self,
        tenant: &str,
        route: &str,
        by_outcome: &[(Outcome, u64)],
        saved_tokens: u64,
        saved_cost: Option<f64>,
    ) {
        let named = self.named.load();
        let sent: u64 = by_outcome
            .iter()
            .filter(|(o, _)| !o.saved_a_call())
            .map(|(_, n)| n)
            .sum();
        let all: u64 = by_outcome.iter().map(|(_, n)| n).sum();
        if let Some(r) = named.routes.get(route) {
            for (o, n) in by_outcome {
                if let Some(c) = r.items.get(o) {
                    c.increment(*n);
                }
            }
            r.saved_input_tokens.increment(saved_tokens);
            if let Some(c) = saved_cost {
                r.saved_cost.add(c);
            }
        }
        if let Some(t) = named.tenants.get(tenant) {
            t.items.fetch_add(all, Ordering::Relaxed);
            t.items_sent.fetch_add(sent, Ordering::Relaxed);
            if saved_tokens > 0 || saved_cost.is_some() {
                let tokens = Tokens {
                    input: saved_tokens,
                    ..Tokens::default()
                };
                t.saved.add(tokens, saved_cost);
            }
        }
    }

    /// One upstream call of `tenant` on `route` to `provider` used `tokens`;
    /// with a price, it cost that much (without, its cost is unknown).
    pub fn spent(
        &self,
        tenant: &str,
        route: &Arc<str>,
        provider: &Arc<str>,
        tokens: Tokens,
        price: Option<Price>,
    ) {
        for (kind, n) in [
            ("input", tokens.input),
            ("cached_input", tokens.cached_input),
            ("output", tokens.output),
        ] {
            self.spent_tokens
                .entry((route.clone(), provider.clone(), kind))
                .or_insert_with(|| {
                    counter_on(
                        &self.recorder,
                        "idem_tokens_total",
                        &[("route", route), ("provider", provider), ("kind", kind)],
                    )
                })
                .increment(n);
        }
        let cost = price.map(|p| p.cost(&tokens));
        if let Some(cost) = cost {
            self.spent_cost
                .entry((route.clone(), provider.clone()))
                .or_default()
                .add(cost);
        }
        if let Some(t) = self.named.load().tenants.get(tenant) {
            t.spent.add(tokens, cost);
        }
    }

    /// A request of `tenant` on `route` was answered without a call of its
    /// own: it saved the tokens of the call that answered it and, with
    /// that call's price, its cost.
    pub fn saved(&self, tenant: &str, route: &str, tokens: Tokens, price: Option<Price>) {
        let named = self.named.load();
        let cost = price.map(|p| p.cost(&tokens));
        if let Some(r) = named.routes.get(route) {
            r.saved_input_tokens.increment(tokens.input);
            r.saved_cached_input_tokens.increment(tokens.cached_input);
            r.saved_output_tokens.increment(tokens.output);
            if let Some(c) = cost {
                r.saved_cost.add(c);
            }
        }
        if let Some(t) = named.tenants.get(tenant) {
            t.saved.add(tokens, cost);
        }
    }

    /// A follower waited `waited` for its leader.
    pub fn wait(&self, tenant: &str, route: &str, waited: Duration) {
        self.observed.waits.record(waited);
        let named = self.named.load();
        if let Some(r) = named.routes.get(route) {
            r.wait.record(waited.as_secs_f64());
        }
        if let Some(t) = named.tenants.get(tenant)
            && let Ok(mut h) = t.waits_us.lock()
        {
            let hist = h.get_or_insert_with(new_hdr);
            // Saturate rather than fail on absurd values.
            let us = u64::try_from(waited.as_micros())
                .unwrap_or(u64::MAX)
                .clamp(1, 3_600_000_000);
            let _ = hist.record(us);
        }
    }

    pub fn wait_timeout(&self, tenant: &str, route: &str) {
        let named = self.named.load();
        if let Some(r) = named.routes.get(route) {
            r.wait_timeouts.increment(1);
        }
        if let Some(t) = named.tenants.get(tenant) {
            t.wait_timeouts.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn leader_error_shared(&self, tenant: &str, route: &str) {
        let named = self.named.load();
        if let Some(r) = named.routes.get(route) {
            r.leader_errors_shared.increment(1);
        }
        if let Some(t) = named.tenants.get(tenant) {
            t.leader_errors_shared.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One call went to a provider and ended with `status` (0: no answer).
    pub fn upstream_call(&self, tenant: &str, provider: &Arc<str>, status: u16) {
        let named = self.named.load();
        let key = (provider.clone(), status);
        let counter = self
            .upstream
            .entry(key)
            .or_insert_with(|| {
                let status_label = if status == 0 {
                    "none".to_string()
                } else {
                    status.to_string()
                };
                let l = vec![
                    Label::new("provider", provider.to_string()),
                    Label::new("status", status_label),
                ];
                self.recorder
                    .register_counter(&Key::from_parts("idem_upstream_calls_total", l), &meta())
            })
            .clone();
        counter.increment(1);
        if let Some(t) = named.tenants.get(tenant) {
            t.upstream_calls.fetch_add(1, Ordering::Relaxed);
        }
        let tally = match self.observed.providers.get(provider) {
            Some(t) => t.clone(),
            None => self
                .observed
                .providers
                .entry(provider.clone())
                .or_default()
                .clone(),
        };
        tally.calls.fetch_add(1, Ordering::Relaxed);
        if !(200..300).contains(&status) {
            tally.errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A provider's 2xx answer was not a chat completion.
    pub fn bad_upstream_answer(&self, provider: &str) {
        let named = self.named.load();
        if let Some(c) = named.bad_answers.get(provider) {
            c.increment(1);
        }
    }

    /// A provider's answer grew past its `max_answer_bytes`.
    pub fn upstream_answer_too_large(&self, provider: &str) {
        let named = self.named.load();
        if let Some(c) = named.too_large.get(provider) {
            c.increment(1);
        }
    }

    pub fn attempt(&self, provider: &Arc<str>, outcome: &'static str) {
        let counter = self
            .attempts
            .entry((provider.clone(), outcome))
            .or_insert_with(|| {
                let l = vec![
                    Label::new("provider", provider.to_string()),
                    Label::new("outcome", outcome),
                ];
                self.recorder
                    .register_counter(&Key::from_parts("idem_attempts_total", l), &meta())
            })
            .clone();
        counter.increment(1);
    }

    pub fn attempt_race(&self, route: &str) {
        let named = self.named.load();
        if let Some(r) = named.routes.get(route) {
            r.races.increment(1);
        }
    }

    /// `idem_circuit_state{provider,model}` (0 closed, 1 half-open, 2 open)
    /// for one target's breaker.
    pub fn circuit_gauge(&self, provider: &str, model: &str) -> Gauge {
        let key = Key::from_parts(
            "idem_circuit_state",
            labels(&[("provider", provider), ("model", model)]),
        );
        self.recorder.register_gauge(&key, &meta())
    }

    /// A configuration reload succeeded (`ok`) or was refused.
    pub fn config_reload(&self, ok: bool) {
        if ok {
            self.reloads_ok.increment(1);
        } else {
            self.reloads_refused.increment(1);
        }
        self.last_reload_ok.set(if ok { 1.0 } else { 0.0 });
    }

    /// `idem_trace_spans_dropped_total`: spans an export could not send.
    pub fn spans_dropped(&self) -> Counter {
        let c = counter_on(&self.recorder, "idem_trace_spans_dropped_total", &[]);
        c.absolute(0);
        c
    }

    /// A tenant's request was refused by its token bucket.
    pub fn rate_limited(&self) {
        self.rate_limited.increment(1);
    }

    /// Attempt races on every route (`idem_attempt_races_total` summed).
    pub fn attempt_races(&self) -> u64 {
        let named = self.named.load();
        named.routes.values().map(|r| r.races.get()).sum()
    }

    pub fn failover_blocked(&self, route: &str) {
        let named = self.named.load();
        if let Some(r) = named.routes.get(route) {
            r.failover_blocked.increment(1);
        }
    }

    /// `/v1/stats` figures for one tenant, or for all when `tenant` is None.
    pub fn stats(&self, tenant: Option<&str>) -> StatsView {
        let named = self.named.load();
        let selected: Vec<&TenantStats> = match tenant {
            Some(t) => named.tenants.get(t).map(|t| &**t).into_iter().collect(),
            None => named
                .tenants
                .values()
                .map(|t| &**t)
                .chain([&self.unattributed])
                .collect(),
        };
        let mut v = StatsView::default();
        let mut waits = new_hdr();
        for t in selected {
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
            v.incoming_requests += get(&t.incoming);
            v.upstream_calls += get(&t.upstream_calls);
            v.leaders += get(&t.by_outcome[outcome_index(Outcome::Leader)]);
            v.followers += get(&t.by_outcome[outcome_index(Outcome::Follower)]);
            v.cache_hits += get(&t.by_outcome[outcome_index(Outcome::CacheHit)]);
            v.negative_hits += get(&t.by_outcome[outcome_index(Outcome::NegativeHit)]);
            v.bypass += get(&t.by_outcome[outcome_index(Outcome::Bypass)]);
            v.replays += get(&t.by_outcome[outcome_index(Outcome::Replay)]);
            v.rejected += get(&t.refused[Refusal::Rejected.index()]);
            v.no_target += get(&t.refused[Refusal::NoTarget.index()]);
            v.job_timeouts += get(&t.refused[Refusal::JobTimeout.index()]);
            v.errors += get(&t.refused[Refusal::Error.index()]);
            v.wait_timeouts += get(&t.wait_timeouts);
            v.leader_errors_shared += get(&t.leader_errors_shared);
            v.embedding_items += get(&t.items);
            v.embedding_items_sent += get(&t.items_sent);
            v.saved_input_tokens += get(&t.saved.input);
            v.saved_cached_input_tokens += get(&t.saved.cached_input);
            v.saved_output_tokens += get(&t.saved.output);
            v.unpriced_saves += get(&t.saved.unpriced);
            v.spent_input_tokens += get(&t.spent.input);
            v.spent_cached_input_tokens += get(&t.spent.cached_input);
            v.spent_output_tokens += get(&t.spent.output);
            v.unpriced_calls += get(&t.spent.unpriced);
            let add = |sum: Option<f64>, d: &Dollars| match (sum, d.get()) {
                (Some(a), Some(b)) => Some(a + b),
                (a, b) => a.or(b),
            };
            v.saved_cost_usd = add(v.saved_cost_usd, &t.saved.cost);
            v.spent_cost_usd = add(v.spent_cost_usd, &t.spent.cost);
            if let Ok(h) = t.waits_us.lock()
                && let Some(h) = h.as_ref()
            {
                let _ = waits.add(h);
            }
        }
        v.saved_calls = v.followers + v.cache_hits + v.negative_hits + v.replays;
        v.embedding_items_saved = v.embedding_items - v.embedding_items_sent;
        if v.incoming_requests > 0 {
            let n = v.incoming_requests as f64;
            v.upstream_ratio = v.upstream_calls as f64 / n;
            v.duplicate_share = v.saved_calls as f64 / n;
        }
        let waited = v.followers + v.wait_timeouts;
        if waited > 0 {
            v.wait_timeout_share = v.wait_timeouts as f64 / waited as f64;
        }
        if !waits.is_empty() {
            let ms = |q: f64| waits.value_at_quantile(q) as f64 / 1000.0;
            v.wait_p50_ms = ms(0.50);
            v.wait_p95_ms = ms(0.95);
            v.wait_p99_ms = ms(0.99);
        }
        v
    }

    /// Names of the tenants with figures.
    pub fn tenant_names(&self) -> Vec<String> {
        self.named.load().tenants.keys().cloned().collect()
    }
}

/// Percentiles of a set of durations, in milliseconds (`None` when the
/// set is empty: no figure, not 0).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct Percentiles {
    pub count: u64,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

impl Percentiles {
    fn of(h: &Hdr<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        let ms = |q: f64| Some(h.value_at_quantile(q) as f64 / 1000.0);
        Percentiles {
            count: h.len(),
            p50_ms: ms(0.50),
            p95_ms: ms(0.95),
            p99_ms: ms(0.99),
        }
    }
}

/// One set of durations read twice: since the timeline's last sample
/// (`interval`) and since start (`total`).
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct LatencyView {
    pub interval: Percentiles,
    pub total: Percentiles,
}

/// Durations kept since start and since the timeline's last sample: two
/// histograms behind one short lock (taken once per recording, never
/// across an await), at 2 significant digits (1 us .. 1 h).
pub struct Latencies {
    /// (since the last sample, since start).
    hists: Mutex<Option<(Hdr<u64>, Hdr<u64>)>>,
}

impl Default for Latencies {
    fn default() -> Latencies {
        Latencies {
            hists: Mutex::new(None),
        }
    }
}

impl Latencies {
    pub fn record(&self, d: Duration) {
        let us = u64::try_from(d.as_micros())
            .unwrap_or(u64::MAX)
            .clamp(1, 3_600_000_000);
        if let Ok(mut h) = self.hists.lock() {
            let (interval, total) = h.get_or_insert_with(|| (new_coarse_hdr(), new_coarse_hdr()));
            let _ = interval.record(us);
            let _ = total.record(us);
        }
    }

    /// The percentiles of both; with `reset`, the interval starts again.
    pub fn read(&self, reset: bool) -> LatencyView {
        let Ok(mut h) = self.hists.lock() else {
            return LatencyView::default();
        };
        let Some((interval, total)) = h.as_mut() else {
            return LatencyView::default();
        };
        let view = LatencyView {
            interval: Percentiles::of(interval),
            total: Percentiles::of(total),
        };
        if reset {
            interval.reset();
        }
        view
    }
}

/// Calls to one provider and how many of them failed (no answer or a
/// status other than 2xx).
#[derive(Default)]
struct CallTally {
    calls: AtomicU64,
    errors: AtomicU64,
}

/// What the dashboard's timeline reads beside the Prometheus figures.
#[derive(Default)]
struct Observed {
    /// Followers' waits, every route.
    waits: Latencies,
    /// Upstream latency of the successful calls whose answer a request
    /// took as its own (leaders, bypasses, a job's first attempt), by
    /// provider and model.
    targets: DashMap<(Arc<str>, Arc<str>), Arc<Latencies>>,
    /// Every call sent to each provider.
    providers: DashMap<Arc<str>, Arc<CallTally>>,
    /// Requests whose answer was a provider's timeout.
    timeouts: AtomicU64,
    /// Requests whose answer broke the route's contract.
    contract_violations: AtomicU64,
}

/// The dashboard's figures (see [`crate::timeline`]): read, never reset,
/// except the interval histograms when the timeline takes a sample.
impl Metrics {
    /// A request on `route` ended (called by
    /// [`Core::finish`](crate::task::Core::finish) for each): its latency
    /// from its arrival to its answer's head when it has one; with the
    /// `outcome` it was counted with and its `answer`, the upstream latency
    /// of the call that answered it when that call was its own and
    /// succeeded, and whether the answer was a provider's timeout or broke
    /// the route's contract.
    pub fn request_done(
        &self,
        route: &str,
        latency: Option<Duration>,
        outcome: Option<Outcome>,
        answer: Option<&crate::answer::Answer>,
    ) {
        if let Some(latency) = latency {
            let named = self.named.load();
            if let Some(r) = named.routes.get(route) {
                r.latency.record(latency);
            }
        }
        let (Some(outcome), Some(answer)) = (outcome, answer) else {
            return;
        };
        match answer.failure {
            Some(crate::answer::Failure::Timeout) => {
                self.observed.timeouts.fetch_add(1, Ordering::Relaxed);
            }
            Some(crate::answer::Failure::Contract) => {
                self.observed
                    .contract_violations
                    .fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        if matches!(outcome, Outcome::Leader | Outcome::Bypass) && answer.is_success() {
            let key = (answer.provider.clone(), answer.model.clone());
            let target = match self.observed.targets.get(&key) {
                Some(t) => t.clone(),
                None => self.observed.targets.entry(key).or_default().clone(),
            };
            target.record(answer.upstream_latency);
        }
    }

    /// Request latency by route (every route a configuration named).
    pub fn route_latencies(&self, reset: bool) -> Vec<(String, LatencyView)> {
        let named = self.named.load();
        let mut out: Vec<(String, LatencyView)> = named
            .routes
            .iter()
            .map(|(name, r)| (name.clone(), r.latency.read(reset)))
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Upstream latency by (provider, model), of the targets that answered.
    pub fn target_latencies(&self, reset: bool) -> Vec<((String, String), LatencyView)> {
        let mut out: Vec<((String, String), LatencyView)> = self
            .observed
            .targets
            .iter()
            .map(|e| {
                let (p, m) = e.key();
                ((p.to_string(), m.to_string()), e.value().read(reset))
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Followers' waits, every route.
    pub fn wait_latency(&self, reset: bool) -> LatencyView {
        self.observed.waits.read(reset)
    }

    /// Calls sent to each provider and how many failed (no answer, or a
    /// status other than 2xx), since start.
    pub fn provider_calls(&self) -> Vec<(String, u64, u64)> {
        let mut out: Vec<(String, u64, u64)> = self
            .observed
            .providers
            .iter()
            .map(|e| {
                let t = e.value();
                (
                    e.key().to_string(),
                    t.calls.load(Ordering::Relaxed),
                    t.errors.load(Ordering::Relaxed),
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Requests whose answer was a provider's timeout, since start.
    pub fn answer_timeouts(&self) -> u64 {
        self.observed.timeouts.load(Ordering::Relaxed)
    }

    /// Requests whose answer broke the route's contract, since start.
    pub fn contract_violations(&self) -> u64 {
        self.observed.contract_violations.load(Ordering::Relaxed)
    }
}

/// A label value in Prometheus' text format.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn outcome_index(o: Outcome) -> usize {
    match o {
        Outcome::Leader => 0,
        Outcome::Follower => 1,
        Outcome::CacheHit => 2,
        Outcome::NegativeHit => 3,
        Outcome::Bypass => 4,
        Outcome::Replay => 5,
    }
}

#[expect(
    clippy::expect_used,
    reason = "the bounds are constants that hdrhistogram accepts"
)]
fn new_hdr() -> Hdr<u64> {
    // 1 us .. 1 h with 3 significant digits.
    Hdr::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

#[expect(
    clippy::expect_used,
    reason = "the bounds are constants that hdrhistogram accepts"
)]
fn new_coarse_hdr() -> Hdr<u64> {
    // 1 us .. 1 h with 2 significant digits: a few kilobytes.
    Hdr::new_with_bounds(1, 3_600_000_000, 2).expect("valid histogram bounds")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Source;

    #[test]
    fn stats_add_up_and_tenants_stay_apart() {
        let c = Config::from_toml_str(
            "[[tenants]]\nname=\"a\"\napi_keys=[\"key-aaaaaaaa\"]\n[[tenants]]\nname=\"b\"\napi_keys=[\"key-bbbbbbbb\"]\n[[providers]]\nname=\"p\"\nkind=\"mock\"\n[[routes]]\nmodel=\"m\"\ntargets=[{provider=\"p\",model=\"x\"}]\n",
            Source::Embedded,
            false,
        )
        .unwrap();
        let m = Metrics::new(&c);
        let p: Arc<str> = "p".into();
        m.request("a", "m", Outcome::Leader);
        m.upstream_call("a", &p, 200);
        for _ in 0..3 {
            m.request("a", "m", Outcome::Follower);
            m.wait("a", "m", Duration::from_millis(10));
        }
        m.request("b", "m", Outcome::Leader);
        m.upstream_call("b", &p, 200);
        let a = m.stats(Some("a"));
        assert_eq!(a.incoming_requests, 4);
        assert_eq!(a.upstream_calls, 1);
        assert_eq!(a.saved_calls, 3);
        assert!((a.duplicate_share - 0.75).abs() < 1e-9);
        assert!((a.wait_p50_ms - 10.0).abs() < 0.1, "{}", a.wait_p50_ms);
        assert_eq!(m.stats(Some("b")).incoming_requests, 1);
        assert_eq!(m.stats(None).incoming_requests, 5);
        let text = m.render();
        assert!(
            text.contains("idem_requests_total{route=\"m\",outcome=\"follower\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("idem_upstream_calls_total{provider=\"p\",status=\"200\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn a_reload_brings_the_handles_of_new_names_and_keeps_the_old_ones() {
        let text = |tenant: &str, route: &str| {
            format!(
                "[[tenants]]\nname=\"{tenant}\"\napi_keys=[\"key-{tenant}-12345\"]\n[[providers]]\nname=\"p\"\nkind=\"mock\"\n[[routes]]\nmodel=\"{route}\"\ntargets=[{{provider=\"p\",model=\"x\"}}]\n"
            )
        };
        let first = Config::from_toml_str(&text("a", "m"), Source::Embedded, false).unwrap();
        let m = Metrics::new(&first);
        m.request("a", "m", Outcome::Leader);
        // Before the reload, `b` and `n` are names no configuration gave:
        // not counted under them.
        m.request("b", "n", Outcome::Leader);
        assert_eq!(m.stats(Some("b")).incoming_requests, 0);
        let second = Config::from_toml_str(&text("b", "n"), Source::Embedded, false).unwrap();
        m.adopt(&second);
        m.request("b", "n", Outcome::Leader);
        m.request("a", "m", Outcome::Follower);
        assert_eq!(m.stats(Some("b")).incoming_requests, 1);
        assert_eq!(
            m.stats(Some("a")).incoming_requests,
            2,
            "a keeps its figures"
        );
        let text = m.render();
        for line in [
            "idem_requests_total{route=\"n\",outcome=\"leader\"} 1",
            "idem_requests_total{route=\"m\",outcome=\"leader\"} 1",
            "idem_requests_total{route=\"m\",outcome=\"follower\"} 1",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        let mut names = m.tenant_names();
        names.sort();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn refused_requests_are_counted_on_a_fixed_set_of_labels() {
        let c = Config::from_toml_str(
            "[[tenants]]\nname=\"a\"\napi_keys=[\"key-aaaaaaaa\"]\n[[providers]]\nname=\"p\"\nkind=\"mock\"\n[[routes]]\nmodel=\"m\"\ntargets=[{provider=\"p\",model=\"x\"}]\n",
            Source::Embedded,
            false,
        )
        .unwrap();
        let m = Metrics::new(&c);
        m.request("a", "m", Outcome::Leader);
        m.refused(Some("a"), Some("m"), Refusal::WaitTimeout);
        m.refused(Some("a"), Some("m"), Refusal::NoTarget);
        m.refused(Some("a"), None, Refusal::Rejected);
        // A client's own names are no labels: an unknown route and an
        // unknown tenant count as unknown.
        m.refused(Some("a"), Some("../../etc/passwd"), Refusal::Rejected);
        m.refused(None, None, Refusal::Rejected);
        m.refused(Some("not-a-tenant"), None, Refusal::Error);
        let a = m.stats(Some("a"));
        assert_eq!(a.incoming_requests, 5);
        assert_eq!((a.leaders, a.rejected, a.no_target), (1, 2, 1));
        // The wait timeout itself is counted by the coalescer's call.
        assert_eq!(a.wait_timeouts, 0);
        let all = m.stats(None);
        assert_eq!(all.incoming_requests, 7);
        assert_eq!((all.rejected, all.errors), (3, 1));
        assert!((all.upstream_ratio - 0.0).abs() < 1e-9);
        let text = m.render();
        for line in [
            "idem_requests_total{route=\"m\",outcome=\"leader\"} 1",
            "idem_requests_total{route=\"m\",outcome=\"wait-timeout\"} 1",
            "idem_requests_total{route=\"m\",outcome=\"no-target\"} 1",
            "idem_requests_total{route=\"m\",outcome=\"rejected\"} 0",
            "idem_requests_total{route=\"-\",outcome=\"rejected\"} 3",
            "idem_requests_total{route=\"-\",outcome=\"error\"} 1",
            "idem_requests_total{route=\"-\",outcome=\"job-timeout\"} 0",
        ] {
            assert!(text.contains(line), "{line}: {text}");
        }
        assert!(!text.contains("passwd"), "{text}");
        assert!(!text.contains("not-a-tenant"), "{text}");
    }

    #[test]
    fn races_and_redis_errors_are_counted_for_stats_and_prometheus() {
        let c = Config::from_toml_str(
            "[[providers]]\nname=\"p\"\nkind=\"mock\"\n[[routes]]\nmodel=\"m\"\ntargets=[{provider=\"p\",model=\"x\"}]\n[[routes]]\nmodel=\"n\"\ntargets=[{provider=\"p\",model=\"x\"}]\n",
            Source::Embedded,
            false,
        )
        .unwrap();
        let m = Metrics::new(&c);
        assert_eq!((m.attempt_races(), m.redis_errors.get()), (0, 0));
        m.attempt_race("m");
        m.attempt_race("n");
        m.attempt_race("n");
        m.attempt_race("no-such-route");
        m.redis_errors.increment(2);
        assert_eq!((m.attempt_races(), m.redis_errors.get()), (3, 2));
        let text = m.render();
        assert!(
            text.contains("idem_attempt_races_total{route=\"n\"} 2"),
            "{text}"
        );
        assert!(text.contains("idem_redis_errors_total 2"), "{text}");
    }

    #[test]
    fn the_dashboards_figures_are_read_per_interval_and_since_start() {
        let c = Config::from_toml_str(
            "[[providers]]\nname=\"p\"\nkind=\"mock\"\n[[routes]]\nmodel=\"m\"\ntargets=[{provider=\"p\",model=\"x\"}]\n",
            Source::Embedded,
            false,
        )
        .unwrap();
        let m = Metrics::new(&c);
        let p: Arc<str> = "p".into();
        m.upstream_call("anonymous", &p, 200);
        m.upstream_call("anonymous", &p, 500);
        m.upstream_call("anonymous", &p, 0);
        assert_eq!(m.provider_calls(), vec![("p".to_string(), 3, 2)]);
        for ms in [10, 20, 30, 40] {
            m.wait("anonymous", "m", Duration::from_millis(ms));
        }
        let w = m.wait_latency(true);
        assert_eq!((w.interval.count, w.total.count), (4, 4));
        let p95 = w.interval.p95_ms.unwrap();
        assert!((p95 - 40.0).abs() < 0.5, "{p95}");
        let w = m.wait_latency(false);
        assert_eq!(w.interval, Percentiles::default(), "reset: no figure");
        assert_eq!(w.total.count, 4, "since start stays");
        // No route latency without a request.
        let routes = m.route_latencies(false);
        assert_eq!(routes.len(), 1);
        assert_eq!(routes[0].1.total.p50_ms, None);
    }

    /// A writer that takes nothing until `release` is dropped: its log
    /// thread blocks on the first line, the queue behind it fills.
    struct Stuck {
        release: std::sync::mpsc::Receiver<()>,
    }

    impl std::io::Write for Stuck {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.release.recv();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_log_writers_dropped_lines_reach_prometheus_at_each_scrape() {
        use std::io::Write;
        let c = Config::from_toml_str(
            "[[providers]]\nname=\"p\"\nkind=\"mock\"\n[[routes]]\nmodel=\"m\"\ntargets=[{provider=\"p\",model=\"x\"}]\n",
            Source::Embedded,
            false,
        )
        .unwrap();
        let m = Metrics::new(&c);
        let (hold, release) = std::sync::mpsc::channel::<()>();
        let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
            .lossy(true)
            .buffered_lines_limit(1)
            .finish(Stuck { release });
        m.watch_log_drops("file", writer.error_counter());
        assert!(
            m.render()
                .contains("idem_log_lines_dropped_total{sink=\"file\"} 0"),
            "watched from zero"
        );
        // One line in the writer's hands at most, one in the queue: of
        // five, at least three are dropped.
        for i in 0..5 {
            let _ = writer.clone().write_all(format!("line {i}\n").as_bytes());
        }
        let dropped = writer.error_counter().dropped_lines();
        assert!(dropped >= 3, "{dropped}");
        let text = m.render();
        assert!(
            text.contains(&format!(
                "idem_log_lines_dropped_total{{sink=\"file\"}} {dropped}"
            )),
            "{text}"
        );
        drop(hold);
        drop(guard);
    }
}
