//! Table 3: idempotent job creations per second (`POST /v1/jobs` with an
//! `Idempotency-Key`) on SQLite and PostgreSQL, against a baseline of plain
//! chat completions through the same gateway: once on an API replica that
//! only creates jobs (`jobs.workers = 0`), once with idem's defaults, where
//! the jobs also run (against the mock, latency 0) while they are being
//! created. Then the executor's throughput: a burst of 10,000 jobs created
//! at once and drained (from the first creation to the last completion),
//! and jobs against a provider that takes 500 ms, where throughput is
//! bounded by `jobs.workers` / latency, with chat completions on a fast
//! provider through the same gateway meanwhile (their added p99).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Settings;
use crate::http::Endpoint;
use crate::load::{self, Run};
use anyhow::Context;

use crate::procs::{Gateway, GatewaySpec, JOBS_MODEL, KEY, MODEL, Mock, Workdir, pg_schema};
use crate::report::{self, Table, int, ms, per_sec, plus_ms, ratio, verdict};

const CONNS: usize = 32;
/// The burst: jobs created at once, then drained.
const BURST: u64 = 10_000;
/// The burst's target: jobs/s from the first creation to the last
/// completion, on either store.
const DRAIN_TARGET: f64 = 2_000.0;
/// The slow provider's latency.
const SLOW_MS: u64 = 500;
/// The chats' open-loop rate beside the slow jobs (table 1's).
const CHAT_RATE: u32 = 1_000;
/// Creation while the workers run, against the API replica's.
const CREATE_RATIO_TARGET: f64 = 0.6;

pub async fn run(s: Arc<Settings>) -> anyhow::Result<Table> {
    let secs = Duration::from_secs_f64(s.pick(1.0, 4.0));
    let warm = Duration::from_secs_f64(s.pick(0.3, 1.0));
    let dir = Workdir::new("jobs")?;
    let mock = Mock::start(&dir, "mock", &[]).await?;

    let mut t = Table::new(
        format!("3. Idempotent job creations per second ({CONNS} connections, closed loop)"),
        &[
            "storage / workload",
            "per second",
            "vs baseline",
            "p50 ms",
            "p99 ms",
            "answers",
            "target",
            "result",
        ],
    );
    for (storage, target) in [("SQLite", 2_000.0), ("PostgreSQL", 3_000.0)] {
        // Creations/s of the API replica (distinct, repeated), for the
        // default gateway's ratio.
        let mut api_rates: Option<(f64, f64)> = None;
        // Two gateways per storage, one after the other, each on its own
        // database: an API replica that only creates jobs (`jobs.workers =
        // 0`, workers run elsewhere), then idem's default, whose 16 workers
        // run the jobs on the same two cores while they are being created.
        for workers in [Some(0), None] {
            let mut spec = GatewaySpec::new(&mock, &dir);
            spec.job_workers = workers;
            let name = format!(
                "idem-{}-{}",
                storage.to_lowercase(),
                if workers.is_some() { "api" } else { "default" }
            );
            let label = if workers.is_some() {
                format!("{storage}, jobs.workers = 0")
            } else {
                format!("{storage}, jobs.workers = 16")
            };
            spec.storage = if storage == "PostgreSQL" {
                match pg_schema().await {
                    Ok(url) => url,
                    Err(e) => {
                        t.na(&label, &format!("{e:#}"));
                        continue;
                    }
                }
            } else {
                format!("sqlite://{}", dir.file(&format!("{name}.db")).display())
            };
            let gateway = match Gateway::start(&dir, &name, &spec).await {
                Ok(g) => g,
                Err(e) => {
                    t.na(&label, &format!("{e:#}"));
                    continue;
                }
            };
            let endpoint = Endpoint::new(gateway.addr, Some(KEY));
            load::closed(gateway.addr, CONNS, warm, load::unique_chats(&endpoint)).await?;
            load::closed(gateway.addr, CONNS, warm, load::jobs(&endpoint, false)).await?;

            let baseline =
                load::closed(gateway.addr, CONNS, secs, load::unique_chats(&endpoint)).await?;
            // Jobs finished while the two job workloads ran: does the
            // executor keep up with the creations?
            let (done_before, since) = (succeeded(&gateway).await, Instant::now());
            let distinct =
                load::closed(gateway.addr, CONNS, secs, load::jobs(&endpoint, false)).await?;
            let repeated =
                load::closed(gateway.addr, CONNS, secs, load::jobs(&endpoint, true)).await?;
            let finished = match (done_before, succeeded(&gateway).await) {
                (Some(a), Some(b)) => {
                    Some(b.saturating_sub(a) as f64 / since.elapsed().as_secs_f64())
                }
                _ => None,
            };

            let row = |what: &str, r: &Run, target: Option<f64>| -> Vec<String> {
                let answers = if target.is_some() {
                    let other = r.sent() - r.count(201) - r.count(200);
                    format!(
                        "201 x {}, 200 x {}, other x {}",
                        int(r.count(201)),
                        int(r.count(200)),
                        int(other)
                    )
                } else {
                    format!("2xx x {}, other x {}", int(r.ok()), int(r.failed()))
                };
                vec![
                    format!("{label}: {what}"),
                    per_sec(r.rate()),
                    ratio(r.rate(), baseline.rate()),
                    ms(r.ms(0.5)),
                    ms(r.ms(0.99)),
                    answers,
                    target.map_or("-".into(), |v| format!(">= {}/s", int(v as u64))),
                    target.map_or(String::new(), |v| verdict(r.rate() >= v && r.failed() == 0)),
                ]
            };
            t.row(row("chat completions, no key (baseline)", &baseline, None));
            t.row(row("jobs, distinct keys", &distinct, Some(target)));
            t.row(row("jobs, 50 % repeated keys", &repeated, Some(target)));
            match (workers, api_rates) {
                (Some(_), _) => api_rates = Some((distinct.rate(), repeated.rate())),
                (None, Some((api_distinct, api_repeated))) => {
                    for (what, r, api) in [
                        ("distinct", &distinct, api_distinct),
                        ("repeated", &repeated, api_repeated),
                    ] {
                        let share = if api > 0.0 { r.rate() / api } else { 0.0 };
                        report::target(
                            6,
                            format!("{label}: job creations/s with workers, {what} keys"),
                            per_sec(r.rate()),
                            format!("API replica {}", per_sec(api)),
                            format!(">= {CREATE_RATIO_TARGET}x"),
                            format!("{} ({share:.2}x)", verdict(share >= CREATE_RATIO_TARGET)),
                        );
                        t.row([
                            format!("{label}: jobs, {what} keys, against the API replica"),
                            per_sec(r.rate()),
                            format!("{share:.2} x"),
                            String::new(),
                            String::new(),
                            format!("API replica {}", per_sec(api)),
                            format!(">= {CREATE_RATIO_TARGET} x"),
                            verdict(share >= CREATE_RATIO_TARGET),
                        ]);
                    }
                }
                (None, None) => {}
            }
            if workers.is_none()
                && let Some(rate) = finished
            {
                t.row([
                    format!("{label}: jobs run to completion meanwhile"),
                    per_sec(rate),
                    ratio(rate, baseline.rate()),
                    String::new(),
                    String::new(),
                    "(executor, during both job runs)".into(),
                    "-".into(),
                    String::new(),
                ]);
            }
            for (what, r) in [("distinct", &distinct), ("repeated", &repeated)] {
                if let Some(e) = &r.first_error {
                    t.note(format!("{label}, {what}: first error: {e}"));
                }
            }
            if workers.is_none()
                && let Ok(stats) = gateway.stats().await
                && let Some(jobs) = stats["jobs"].as_object()
            {
                let states: Vec<String> = jobs
                    .iter()
                    .filter(|(_, v)| v.as_u64().unwrap_or(0) > 0)
                    .map(|(k, v)| format!("{k} {}", int(v.as_u64().unwrap_or(0))))
                    .collect();
                t.note(format!(
                    "{storage}, jobs.workers = 16: jobs by state right after the runs: {}",
                    states.join(", ")
                ));
            }
        }
    }
    burst(&s, &dir, &mock, &mut t).await?;
    slow(&s, &dir, &mock, &mut t).await?;
    t.note(format!(
        "{} s per workload; repeated keys: every key is sent twice in a row with the same payload \
         (the twin often races it on another connection); 201 = new job, 200 = replay",
        secs.as_secs_f64()
    ));
    t.note(
        "jobs.workers = 0: an API replica that only creates jobs (workers run elsewhere); \
         jobs.workers = 16 (idem's default): the workers run the jobs on the same 2 cores while \
         they are being created (load generator, gateway, database and mock share the machine)",
    );
    t.note(
        "each gateway on its own database (SQLite file in the temporary folder, PostgreSQL on a \
         fresh schema), 16 storage connections",
    );
    Ok(t)
}

/// A storage URL for a gateway named `name`: a fresh SQLite file in `dir`
/// or a fresh PostgreSQL schema.
async fn storage_url(storage: &str, dir: &Workdir, name: &str) -> anyhow::Result<String> {
    if storage == "PostgreSQL" {
        pg_schema().await
    } else {
        Ok(format!(
            "sqlite://{}",
            dir.file(&format!("{name}.db")).display()
        ))
    }
}

/// The latest `updated_at` of the jobs in `url`'s database (milliseconds
/// since the epoch): when the last one reached its final state.
async fn last_update(url: &str) -> anyhow::Result<i64> {
    let row: (Option<i64>,) = if url.starts_with("sqlite:") {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await?;
        let row = sqlx::query_as("SELECT MAX(updated_at) FROM jobs")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        row
    } else {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(url)
            .await?;
        let row = sqlx::query_as("SELECT MAX(updated_at) FROM jobs")
            .fetch_one(&pool)
            .await?;
        pool.close().await;
        row
    };
    row.0.context("no jobs")
}

fn epoch_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Jobs by state from `/v1/stats`: (finished, succeeded, all).
async fn finished(gateway: &Gateway) -> Option<(u64, u64, u64)> {
    let stats = gateway.stats().await.ok()?;
    let jobs = stats["jobs"].as_object()?;
    let n = |k: &str| jobs.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
    let done = n("succeeded") + n("failed") + n("cancelled");
    let all = jobs.values().filter_map(|v| v.as_u64()).sum();
    Some((done, n("succeeded"), all))
}

/// Creates `total` jobs at once (32 connections, distinct keys) and waits
/// until every job is finished: (creation, time to drain from the first
/// creation to the last completion, jobs succeeded).
async fn drain(
    gateway: &Gateway,
    url: &str,
    model: &'static str,
    total: u64,
    limit: Duration,
) -> anyhow::Result<(Run, Duration, u64)> {
    let endpoint = Endpoint::new(gateway.addr, Some(KEY));
    let start = epoch_ms();
    let created = load::closed_count(
        gateway.addr,
        CONNS,
        total,
        load::jobs_on(&endpoint, model, false),
    )
    .await?;
    let deadline = Instant::now() + limit;
    let succeeded = loop {
        match finished(gateway).await {
            Some((done, ok, all)) if done >= all => break ok,
            _ if Instant::now() > deadline => anyhow::bail!("not drained within {limit:?}"),
            // The time drained is read from the database afterwards: the
            // poll only notices the end, and is kept rare, so that it
            // weighs little on the chats measured meanwhile.
            _ => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    };
    let last = last_update(url).await?;
    let took = Duration::from_millis(u64::try_from(last.saturating_sub(start)).unwrap_or(0));
    Ok((created, took, succeeded))
}

/// The burst: 10,000 jobs created at once against the mock (latency 0),
/// default workers, drained on each store.
async fn burst(s: &Settings, dir: &Workdir, mock: &Mock, t: &mut Table) -> anyhow::Result<()> {
    let total = s.pick(2_000, BURST);
    for storage in ["SQLite", "PostgreSQL"] {
        let label = format!("{storage}, jobs.workers = 16: burst of {} jobs", int(total));
        let name = format!("idem-{}-burst", storage.to_lowercase());
        let mut spec = GatewaySpec::new(mock, dir);
        spec.storage = match storage_url(storage, dir, &name).await {
            Ok(url) => url,
            Err(e) => {
                t.na(&label, &format!("{e:#}"));
                continue;
            }
        };
        let gateway = match Gateway::start(dir, &name, &spec).await {
            Ok(g) => g,
            Err(e) => {
                t.na(&label, &format!("{e:#}"));
                continue;
            }
        };
        let (created, took, succeeded) = match drain(
            &gateway,
            &spec.storage,
            MODEL,
            total,
            Duration::from_secs(300),
        )
        .await
        {
            Ok(r) => r,
            Err(e) => {
                t.na(&label, &format!("{e:#}"));
                continue;
            }
        };
        let rate = total as f64 / took.as_secs_f64().max(1e-3);
        t.row([
            format!("{label}, drained"),
            per_sec(rate),
            String::new(),
            String::new(),
            String::new(),
            format!(
                "{} succeeded in {:.2} s (created in {:.2} s, {})",
                int(succeeded),
                took.as_secs_f64(),
                created.elapsed.as_secs_f64(),
                per_sec(created.rate()),
            ),
            format!(">= {}/s", int(DRAIN_TARGET as u64)),
            verdict(rate >= DRAIN_TARGET && succeeded == total && created.failed() == 0),
        ]);
        if let Some(e) = &created.first_error {
            t.note(format!("{label}: first error: {e}"));
        }
    }
    t.note(
        "burst: the jobs are created at once from 32 connections (distinct keys) on a fresh \
         gateway and database, mock latency 0; drained = every job finished, timed from the \
         first creation to the last job's final `updated_at`",
    );
    Ok(())
}

/// Jobs against a provider that answers in 500 ms: 16 and 256 workers, on
/// each store; jobs/s against `workers` / latency. Beside them, chat
/// completions on a fast provider through the same gateway, at table 1's
/// open-loop rate: their added p99 before the jobs and while they run.
async fn slow(s: &Settings, dir: &Workdir, fast: &Mock, t: &mut Table) -> anyhow::Result<()> {
    let latency = SLOW_MS.to_string();
    let mock = Mock::start(dir, "mock-slow", &["--latency-ms", &latency]).await?;
    let chat_secs = Duration::from_secs_f64(s.pick(1.0, 3.0));
    let chats = |addr| {
        let endpoint = Endpoint::new(addr, Some(KEY));
        load::open(
            addr,
            CHAT_RATE,
            chat_secs,
            CONNS,
            load::unique_chats(&endpoint),
        )
    };
    // The chats' baseline: the fast provider directly, in the same run.
    let direct = chats(fast.addr).await?.ms(0.99);
    for storage in ["SQLite", "PostgreSQL"] {
        for workers in [16usize, 256] {
            // About eight seconds of work at the expected rate.
            let total = (workers as u64) * s.pick(4, 16);
            let expected = workers as f64 * 1000.0 / SLOW_MS as f64;
            let label = format!(
                "{storage}, jobs.workers = {workers}: {} jobs, latency {SLOW_MS} ms",
                int(total)
            );
            let name = format!("idem-{}-slow-{workers}", storage.to_lowercase());
            let mut spec = GatewaySpec::new(fast, dir);
            spec.job_workers = Some(workers);
            spec.jobs_upstream = Some(mock.base_url());
            spec.storage = match storage_url(storage, dir, &name).await {
                Ok(url) => url,
                Err(e) => {
                    t.na(&label, &format!("{e:#}"));
                    continue;
                }
            };
            let gateway = match Gateway::start(dir, &name, &spec).await {
                Ok(g) => g,
                Err(e) => {
                    t.na(&label, &format!("{e:#}"));
                    continue;
                }
            };
            let limit = Duration::from_secs_f64(total as f64 / expected * 4.0 + 60.0);
            let warm = Endpoint::new(gateway.addr, Some(KEY));
            load::closed(
                gateway.addr,
                CONNS,
                chat_secs / 3,
                load::unique_chats(&warm),
            )
            .await?;
            let idle = chats(gateway.addr).await?.ms(0.99);
            // The chats start once the jobs are being created, and end
            // before they are drained (about eight seconds).
            let (drained, busy) = tokio::join!(
                drain(&gateway, &spec.storage, JOBS_MODEL, total, limit),
                async {
                    tokio::time::sleep(chat_secs / 3).await;
                    chats(gateway.addr).await
                }
            );
            let (_, took, succeeded) = match drained {
                Ok(r) => r,
                Err(e) => {
                    t.na(&label, &format!("{e:#}"));
                    continue;
                }
            };
            let busy = busy?.ms(0.99);
            let rate = total as f64 / took.as_secs_f64().max(1e-3);
            t.row([
                label,
                per_sec(rate),
                format!("{:.2} x", rate / expected),
                String::new(),
                String::new(),
                format!(
                    "{} succeeded in {:.2} s; workers / latency = {}; chats' added p99 {} \
                     before the jobs, {} while they run",
                    int(succeeded),
                    took.as_secs_f64(),
                    per_sec(expected),
                    plus_ms(idle - direct),
                    plus_ms(busy - direct),
                ),
                ">= 0.8 x".into(),
                verdict(rate >= 0.8 * expected && succeeded == total),
            ]);
        }
    }
    t.note(format!(
        "latency {SLOW_MS} ms: a second mock answers every job's call after {SLOW_MS} ms; a \
         job holds a worker for its call, so jobs/s is bounded by jobs.workers / latency (the \
         `vs baseline` column is against that bound). Chats go to the first mock (latency 0) \
         through the same gateway, {} requests/s on a fixed timeline (an open loop, as \
         table 1 (b) runs at its own rate); their added p99 is against the first mock's own, \
         measured in the same run",
        int(u64::from(CHAT_RATE))
    ));
    Ok(())
}

/// Jobs in state `succeeded`, from `/v1/stats`.
async fn succeeded(gateway: &Gateway) -> Option<u64> {
    let stats = gateway.stats().await.ok()?;
    stats["jobs"]["succeeded"].as_u64()
}
