//! Table 3: idempotent job creations per second (`POST /v1/jobs` with an
//! `Idempotency-Key`) on SQLite and PostgreSQL, against a baseline of plain
//! chat completions through the same gateway. The jobs also run (against
//! the mock, latency 0) while they are being created.

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
        let mut spec = GatewaySpec::new(&mock, &dir);
        if storage == "PostgreSQL" {
            match pg_schema().await {
                Ok(url) => spec.storage = url,
                Err(e) => {
                    t.na(storage, &format!("{e:#}"));
                    continue;
                }
            }
        }
        let gateway =
            match Gateway::start(&dir, &format!("idem-{}", storage.to_lowercase()), &spec).await {
                Ok(g) => g,
                Err(e) => {
                    t.na(storage, &format!("{e:#}"));
                    continue;
                }
            };
        let endpoint = Endpoint::new(gateway.addr, Some(KEY));
        load::closed(gateway.addr, CONNS, warm, load::unique_chats(&endpoint)).await?;
        load::closed(gateway.addr, CONNS, warm, load::jobs(&endpoint, false)).await?;

        let baseline =
            load::closed(gateway.addr, CONNS, secs, load::unique_chats(&endpoint)).await?;
        // Jobs finished while the two job workloads ran: does the executor
        // keep up with the creations?
        let (done_before, since) = (succeeded(&gateway).await, Instant::now());
        let distinct =
            load::closed(gateway.addr, CONNS, secs, load::jobs(&endpoint, false)).await?;
        let repeated = load::closed(gateway.addr, CONNS, secs, load::jobs(&endpoint, true)).await?;
        let finished = match (done_before, succeeded(&gateway).await) {
            (Some(a), Some(b)) => Some(b.saturating_sub(a) as f64 / since.elapsed().as_secs_f64()),
            _ => None,
        };

        let row = |label: &str, r: &Run, target: Option<f64>| -> Vec<String> {
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
                format!("{storage}: {label}"),
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
        if let Some(rate) = finished {
            t.row([
                format!("{storage}: jobs run to completion meanwhile"),
                per_sec(rate),
                ratio(rate, baseline.rate()),
                String::new(),
                String::new(),
                "(executor, during both job runs)".into(),
                "-".into(),
                String::new(),
            ]);
        }
        for (label, r) in [("distinct", &distinct), ("repeated", &repeated)] {
            if let Some(e) = &r.first_error {
                t.note(format!("{storage}, {label}: first error: {e}"));
            }
        }
        if let Ok(stats) = gateway.stats().await
            && let Some(jobs) = stats["jobs"].as_object()
        {
            let states: Vec<String> = jobs
                .iter()
                .filter(|(_, v)| v.as_u64().unwrap_or(0) > 0)
                .map(|(k, v)| format!("{k} {}", int(v.as_u64().unwrap_or(0))))
                .collect();
            t.note(format!(
                "{storage}: jobs by state right after the runs: {}",
                states.join(", ")
            ));
        }
    }
    t.note(format!(
        "{} s per workload; repeated keys: every key is sent twice in a row with the same payload \
         (the twin often races it on another connection); 201 = new job, 200 = replay",
        secs.as_secs_f64()
    ));
    t.note(
        "SQLite file in the temporary folder; PostgreSQL on a fresh schema; idem's defaults \
         (16 storage connections, 16 job workers) unless the header lists overrides",
    );
    Ok(t)
}

/// Jobs in state `succeeded`, from `/v1/stats`.
async fn succeeded(gateway: &Gateway) -> Option<u64> {
    let stats = gateway.stats().await.ok()?;
    stats["jobs"]["succeeded"].as_u64()
}
