//! Table 3: idempotent job creations per second (`POST /v1/jobs` with an
//! `Idempotency-Key`) on SQLite and PostgreSQL, against a baseline of plain
//! chat completions through the same gateway: once on an API replica that
//! only creates jobs (`jobs.workers = 0`), once with idem's defaults, where
//! the jobs also run (against the mock, latency 0) while they are being
//! created.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::Settings;
use crate::http::Endpoint;
use crate::load::{self, Run};
use crate::procs::{Gateway, GatewaySpec, KEY, Mock, Workdir, pg_schema};
use crate::report::{Table, int, ms, per_sec, ratio, verdict};

const CONNS: usize = 32;

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

/// Jobs in state `succeeded`, from `/v1/stats`.
async fn succeeded(gateway: &Gateway) -> Option<u64> {
    let stats = gateway.stats().await.ok()?;
    stats["jobs"]["succeeded"].as_u64()
}
