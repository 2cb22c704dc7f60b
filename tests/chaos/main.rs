//! The chaos test (`cargo test --test chaos`): three idem replicas on a
//! private Redis and PostgreSQL, two tenants, one misbehaving mock provider,
//! a fleet of clients (and a hostile one: worst-case bodies and
//! conversations past their bound, with every replica's memory watched) and
//! a nemesis that kills replicas and restarts Redis and PostgreSQL, then a
//! history checker over everything that was recorded
//! (Jepsen-style: the promises are checked on the history, not on the happy
//! path).
//!
//! - `IDEM_CHAOS_SCALE=small` (default, for CI: about a minute) or `large`
//!   (five minutes of load and about two dozen infrastructure faults);
//! - `IDEM_CHAOS_SEED=N` replays a run's schedule and choices (printed at
//!   the start; the timing of a real cluster still varies from run to run);
//! - `IDEM_CHAOS_PG=shared` uses the machine's PostgreSQL (a fresh schema)
//!   and restarts it, instead of a private cluster.
//!
//! `checker` holds the rules and their unit tests; `history` what is
//! recorded; `cluster` the processes; `fleet` the clients; `nemesis` the
//! faults.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test code: a failed unwrap is a failed test"
)]

mod checker;
mod cluster;
mod fleet;
#[path = "../api/helpers.rs"]
mod helpers;
mod history;
mod nemesis;
#[path = "../support/services.rs"]
mod services;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use idem::mock_upstream::CallOutcome;
use serde_json::Value;
use sqlx::Row;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, REPLICAS, calm};
use crate::fleet::Ctx;
use crate::history::{AttemptRow, FaultKind, History, JobRow, OpKind, Quiet, Recorder};

/// How big a run is.
#[derive(Debug, Clone)]
struct Scale {
    name: String,
    /// How long the fleet and the nemesis run.
    run: Duration,
    job_clients: usize,
    wave_clients: usize,
    /// Requests per tenant per wave.
    wave_size: usize,
    /// Infrastructure faults (kills, PostgreSQL and Redis restarts).
    faults: usize,
}

impl Scale {
    fn from_env() -> Scale {
        let name = std::env::var("IDEM_CHAOS_SCALE").unwrap_or_else(|_| "small".into());
        match name.as_str() {
            "small" => Scale {
                name,
                run: Duration::from_secs(30),
                job_clients: 4,
                wave_clients: 2,
                wave_size: 6,
                faults: 4,
            },
            "large" => Scale {
                name,
                run: Duration::from_secs(300),
                job_clients: 8,
                wave_clients: 3,
                wave_size: 16,
                faults: 24,
            },
            other => panic!("IDEM_CHAOS_SCALE must be small or large, not {other:?}"),
        }
    }
}

fn seed_from_env() -> u64 {
    match std::env::var("IDEM_CHAOS_SEED") {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("IDEM_CHAOS_SEED must be a number, not {s:?}")),
        Err(_) => u64::try_from(history::now_ms()).unwrap_or(1) % 1_000_000,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos_history_keeps_every_promise() {
    let scale = Scale::from_env();
    let seed = seed_from_env();
    println!(
        "chaos: seed {seed} (replay with IDEM_CHAOS_SEED={seed}), scale {} ({} s of load, {} faults)",
        scale.name,
        scale.run.as_secs(),
        scale.faults
    );
    let started = Instant::now();
    let mut cluster = Cluster::start().await;
    println!(
        "chaos: {REPLICAS} replicas up in {:.1} s; PostgreSQL: {}; Redis: private on port {}",
        started.elapsed().as_secs_f64(),
        cluster.pg().describe(),
        cluster.redis.port
    );

    let rec = Arc::new(Recorder::default());
    let stop = CancellationToken::new();
    let ctx = Ctx {
        directory: cluster.directory.clone(),
        rec: rec.clone(),
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .pool_max_idle_per_host(64)
            .build()
            .unwrap(),
        stop: stop.clone(),
        seed,
        waves: Arc::new(AtomicUsize::new(0)),
    };
    let start = Instant::now();
    let mut fleet = Vec::new();
    for i in 0..scale.job_clients {
        fleet.push(tokio::spawn(fleet::job_client(ctx.clone(), i)));
    }
    for i in 0..scale.wave_clients {
        fleet.push(tokio::spawn(fleet::wave_client(
            ctx.clone(),
            i,
            scale.wave_size,
        )));
    }
    let provider = tokio::spawn(nemesis::provider(
        cluster.mock.clone(),
        rec.clone(),
        seed,
        stop.clone(),
        start,
    ));
    let hostile = tokio::spawn(fleet::hostile_client(ctx.clone()));
    let memory_stop = CancellationToken::new();
    let memory = tokio::spawn(cluster::watch_memory(
        cluster.directory.clone(),
        rec.clone(),
        memory_stop.clone(),
    ));
    let watcher = tokio::spawn(cluster::watch_redis_errors(
        cluster.directory.clone(),
        rec.clone(),
        stop.clone(),
    ));
    nemesis::infrastructure(&mut cluster, &rec, seed, scale.faults, scale.run, start).await;

    // Quiesce: stop the clients and the provider faults, let leases expire
    // and the reconcilers settle what the faults left.
    stop.cancel();
    for t in fleet {
        let _ = tokio::time::timeout(Duration::from_secs(30), t).await;
    }
    let _ = tokio::time::timeout(Duration::from_secs(30), hostile).await;
    let _ = provider.await;
    let _ = watcher.await;
    cluster.mock.set_behaviour(calm());
    println!("chaos: t={:>6.2}s  quiesce", start.elapsed().as_secs_f64());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(&cluster.pg().url())
        .await
        .unwrap();
    let settled = settle(&cluster, &pool).await;
    println!(
        "chaos: t={:>6.2}s  quiet{}",
        start.elapsed().as_secs_f64(),
        if settled {
            ""
        } else {
            " (not everything settled: see the violations)"
        }
    );
    final_reads(&ctx).await;
    // The replicas' memory is watched through the quiet phase too.
    memory_stop.cancel();
    let _ = memory.await;

    let mut history = History {
        ops: std::mem::take(&mut *rec.ops.lock().unwrap()),
        faults: std::mem::take(&mut *rec.faults.lock().unwrap()),
        waves: std::mem::take(&mut *rec.waves.lock().unwrap()),
        calls: cluster.mock.calls(),
        replicas: REPLICAS,
        memory: std::mem::take(&mut *rec.memory.lock().unwrap()),
        hostile: std::mem::take(&mut *rec.hostile.lock().unwrap()),
        ..History::default()
    };
    (history.jobs, history.attempts) = snapshot(&pool).await;
    history.quiet = quiet(&cluster).await;
    let violations = checker::check(&history);
    print_figures(&history, start);
    let progress = checker::Progress::of(&history, scale.faults);
    println!("chaos: progress: {progress}");
    if violations.is_empty() {
        println!("chaos: violations: 0");
    } else {
        println!("chaos: violations: {}", violations.len());
        for v in violations.iter().take(60) {
            println!("  [{}] {}", v.rule, v.detail);
        }
    }
    println!(
        "chaos: done in {:.1} s (seed {seed})",
        started.elapsed().as_secs_f64()
    );
    assert!(
        violations.is_empty(),
        "{} violations of idem's promises (seed {seed}); see the list above",
        violations.len()
    );
    // No violation proves nothing in a run that got nothing done.
    let short = progress.shortfalls();
    assert!(
        short.is_empty(),
        "the run made too little progress to show anything (seed {seed}): {}; {progress}",
        short.join(", ")
    );
}

/// Waits until no job is queued or running, no attempt is active, and no
/// flight is left (in Redis or in a replica). False if that took too long.
async fn settle(cluster: &Cluster, pool: &sqlx::PgPool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(45);
    while Instant::now() < deadline {
        let busy: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM jobs WHERE state IN ('queued', 'running'))
                  + (SELECT count(*) FROM attempts WHERE state IN ('starting', 'running', 'unknown'))",
        )
        .fetch_one(pool)
        .await
        .unwrap_or(1);
        let q = quiet(cluster).await;
        if busy == 0 && q.flight_keys.is_empty() && q.inflight.iter().all(|n| *n == 0) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

/// What is left in Redis and in the replicas.
async fn quiet(cluster: &Cluster) -> Quiet {
    let mut inflight = Vec::new();
    for i in 0..REPLICAS {
        let n = cluster
            .admin_stats(i)
            .await
            .and_then(|s| s["inflight_flights"].as_u64())
            .unwrap_or(u64::MAX);
        inflight.push(n);
    }
    Quiet {
        flight_keys: cluster.redis.flight_keys(&cluster.prefix),
        inflight,
    }
}

/// Every acknowledged job read once more through the API, by its tenant:
/// what the API shows is checked against the database.
async fn final_reads(ctx: &Ctx) {
    let jobs: BTreeMap<String, (&'static str, String)> = ctx
        .rec
        .ops
        .lock()
        .unwrap()
        .iter()
        .filter(|o| o.kind.creates_job() && (200..300).contains(&o.status))
        .filter_map(|o| Some((o.job_id.clone()?, (o.tenant, o.prompt.clone()))))
        .collect();
    let jobs: Vec<_> = jobs.into_iter().collect();
    for (k, chunk) in jobs.chunks(16).enumerate() {
        let reads = chunk.iter().enumerate().map(|(i, (id, (tenant, prompt)))| {
            fleet::get_job(ctx, (k + i) % REPLICAS, tenant, id, prompt)
        });
        for op in futures_util::future::join_all(reads).await {
            ctx.rec.op(op);
        }
    }
}

async fn snapshot(pool: &sqlx::PgPool) -> (Vec<JobRow>, Vec<AttemptRow>) {
    let json = |t: Option<String>| t.and_then(|t| serde_json::from_str::<Value>(&t).ok());
    let jobs = sqlx::query(
        "SELECT id, tenant, idempotency_key, payload_hash, fingerprint, request, metadata, state,
                completed_by, result, created_at FROM jobs",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|r| JobRow {
        id: r.get("id"),
        tenant: r.get("tenant"),
        key: r.get("idempotency_key"),
        payload_hash: r.get("payload_hash"),
        fingerprint: r.get("fingerprint"),
        request: json(r.get("request")).unwrap_or(Value::Null),
        metadata: json(r.get("metadata")),
        state: r.get("state"),
        completed_by: r.get("completed_by"),
        result: json(r.get("result")),
        created_at: r.get("created_at"),
    })
    .collect();
    let attempts = sqlx::query(
        "SELECT job_id, n, model, state, reason, hedge, started_at, finished_at
           FROM attempts",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|r| AttemptRow {
        job_id: r.get("job_id"),
        n: r.get("n"),
        model: r.get("model"),
        state: r.get("state"),
        reason: r.get("reason"),
        hedge: r.get("hedge"),
        started_at: r.get("started_at"),
        finished_at: r.get("finished_at"),
    })
    .collect();
    (jobs, attempts)
}

fn line<K: std::fmt::Display>(counts: &BTreeMap<K, usize>) -> String {
    counts
        .iter()
        .map(|(k, n)| format!("{k} x{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The figures of the run: operations by kind and outcome, faults, upstream
/// calls, jobs and attempts.
fn print_figures(h: &History, start: Instant) {
    let t0 = history::now_ms() - i64::try_from(start.elapsed().as_millis()).unwrap_or(0);
    let mut by_kind: BTreeMap<OpKind, BTreeMap<String, usize>> = BTreeMap::new();
    for op in &h.ops {
        let what = match (op.status, &op.code, &op.outcome) {
            (0, _, _) => "transport error".to_string(),
            (s, Some(code), _) => format!("{s} {code}"),
            (200, _, Some(o)) => format!("200 {o}"),
            (s, _, _) if op.replayed => format!("{s} replayed"),
            (s, _, _) => s.to_string(),
        };
        *by_kind.entry(op.kind).or_default().entry(what).or_default() += 1;
    }
    println!("chaos: operations: {}", h.ops.len());
    for (kind, counts) in &by_kind {
        println!("  {:<12} {}", kind.name(), line(counts));
    }
    let injected = h
        .faults
        .iter()
        .filter(|f| !matches!(f.kind, FaultKind::RedisErrors { .. }));
    println!("chaos: faults injected: {}", injected.clone().count());
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for f in injected {
        let k = match &f.kind {
            FaultKind::Kill(_) => "replica SIGKILL + restart".to_string(),
            FaultKind::Pause(_) => "replica SIGSTOP + SIGCONT".to_string(),
            FaultKind::RedisDown => "Redis stop + start".to_string(),
            FaultKind::PgRestart => "PostgreSQL stop + start".to_string(),
            FaultKind::Provider(p) => format!("provider {p}"),
            FaultKind::RedisErrors { .. } => continue,
        };
        *kinds.entry(k).or_default() += 1;
        if !matches!(f.kind, FaultKind::Provider(_)) {
            println!(
                "  {:>6.2}s .. {:>6.2}s  {:?}",
                (f.from_ms - t0) as f64 / 1000.0,
                (f.until_ms - t0) as f64 / 1000.0,
                f.kind
            );
        }
    }
    println!("  by kind: {}", line(&kinds));
    let outages: Vec<_> = h
        .faults
        .iter()
        .filter(|f| f.kind == FaultKind::RedisDown)
        .collect();
    let (mut during, mut outside) = (0u64, 0u64);
    for f in &h.faults {
        if let FaultKind::RedisErrors { count, .. } = f.kind {
            // Until 3 s after an outage the replicas are reconnecting.
            let near = outages
                .iter()
                .any(|o| f.until_ms >= o.from_ms && f.from_ms <= o.until_ms + 3_000);
            if near {
                during += count;
            } else {
                outside += count;
            }
        }
    }
    println!(
        "chaos: Redis errors the replicas counted: {during} during or just after the outages, \
         {outside} at other times (timeouts under load: each lets one replica coalesce locally)"
    );
    let mut calls: BTreeMap<String, usize> = BTreeMap::new();
    for c in &h.calls {
        let k = match (c.outcome, c.status) {
            (CallOutcome::Failed, Some(s)) => format!("failed {s}"),
            (o, _) => format!("{o:?}").to_lowercase(),
        };
        *calls.entry(k).or_default() += 1;
    }
    println!(
        "chaos: upstream calls: {} ({})",
        h.calls.len(),
        line(&calls)
    );
    let mut answered: Vec<_> = h.calls.iter().filter(|c| c.done_ms.is_some()).collect();
    answered.sort_by_key(|c| (c.done_ms, c.seq));
    let reordered = answered.windows(2).filter(|w| w[1].seq < w[0].seq).count();
    println!(
        "chaos: calls answered before an earlier call: {reordered} of {}",
        answered.len()
    );
    let mut per_group: BTreeMap<(String, Option<String>, Option<String>), usize> = BTreeMap::new();
    for c in h.calls.iter().filter(|c| c.prompt.starts_with("wave ")) {
        *per_group
            .entry((c.prompt.clone(), c.user.clone(), c.model.clone()))
            .or_default() += 1;
    }
    println!(
        "chaos: upstream calls per wave fingerprint and target: max {}, {} of {} groups above 1",
        per_group.values().max().copied().unwrap_or(0),
        per_group.values().filter(|n| **n > 1).count(),
        per_group.len()
    );
    let traced = |kinds: &[OpKind]| {
        h.ops
            .iter()
            .filter(|o| kinds.contains(&o.kind) && o.seen.is_some())
            .count()
    };
    println!(
        "chaos: answers traced to the call that produced them: {} chat, {} streamed, {} job results",
        traced(&[OpKind::Chat]),
        traced(&[OpKind::ChatStream]),
        traced(&[OpKind::CreateJob, OpKind::GetJob, OpKind::ChatWithKey]),
    );
    let wave_requests = h.ops.iter().filter(|o| o.wave.is_some()).count();
    let wave_calls = h
        .calls
        .iter()
        .filter(|c| c.prompt.starts_with("wave "))
        .count();
    println!(
        "chaos: waves: {} with {wave_requests} requests made {wave_calls} upstream calls",
        h.waves.len()
    );
    let mut hostile: BTreeMap<String, usize> = BTreeMap::new();
    for r in &h.hostile {
        let what = match (r.what, &r.code) {
            ("turn", Some(code)) => format!("turn {} {} {code}", r.turn, r.status),
            ("turn", None) => format!("turn {} {}", r.turn, r.status),
            (what, Some(code)) => format!("{what} {} {code}", r.status),
            (what, None) => format!("{what} {}", r.status),
        };
        *hostile.entry(what).or_default() += 1;
    }
    println!(
        "chaos: hostile requests: {} ({})",
        h.hostile.len(),
        line(&hostile)
    );
    let peak = h.memory.iter().map(|m| m.peak).max().unwrap_or(0);
    println!(
        "chaos: replica processes watched: {}, highest resident memory {} MiB (bound {} MiB)",
        h.memory.len(),
        peak >> 20,
        crate::helpers::MEMORY_CEILING >> 20
    );
    let mut jobs: BTreeMap<&str, usize> = BTreeMap::new();
    for j in &h.jobs {
        *jobs.entry(j.state.as_str()).or_default() += 1;
    }
    let mut attempts: BTreeMap<String, usize> = BTreeMap::new();
    for a in &h.attempts {
        let k = match &a.reason {
            Some(r) => format!("{} ({r})", a.state),
            None => a.state.clone(),
        };
        *attempts.entry(k).or_default() += 1;
    }
    let hedges = h.attempts.iter().filter(|a| a.hedge).count();
    println!("chaos: jobs: {} ({})", h.jobs.len(), line(&jobs));
    println!(
        "chaos: attempts: {} ({}); hedges: {hedges}",
        h.attempts.len(),
        line(&attempts)
    );
}
