//! Table 4: the Redis coalescing backend against the memory one: what it
//! adds to every request (unique prompts at a fixed rate), and whether a
//! wave spread over three replicas sharing Redis and PostgreSQL still
//! makes one upstream call. Rerun alone with `IDEM_BENCH_ONLY=4`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::Settings;
use crate::http::Endpoint;
use crate::load::{self, Run};
use crate::procs::{Gateway, GatewaySpec, KEY, Mock, Workdir, pg_schema, redis_prefix, redis_url};
use crate::report::{
    NOISY_NOTE, Table, int, ms, per_sec, plus_ms, spread, too_spread, verdict, verdict_noisy,
};
use crate::wave;

const CONNS: usize = 32;
const RATE: u32 = 1_000;
/// Target: Redis's added p99 over memory, in ms.
const ADDED_P99_MS: f64 = 2.0;
const REPLICAS: usize = 3;
const LATENCY_MS: u64 = 200;

pub async fn run(s: Arc<Settings>) -> anyhow::Result<Table> {
    let (rounds, secs) = s.pick((1, 2.0), (5, 2.0));
    let wave_n = s.pick(99, 1_200);
    let warm = Duration::from_secs_f64(s.pick(0.3, 1.0));
    let dir = Workdir::new("redis")?;
    let mock = Mock::start(&dir, "mock", &[]).await?;
    let redis = redis_url();

    let mut t = Table::new(
        format!("4. Redis vs memory coalescing backend ({redis})"),
        &[
            "figure",
            "memory",
            "redis",
            "redis vs memory",
            "target",
            "result",
        ],
    );

    // (a) added latency, unique prompts, alternating rounds.
    {
        let mut memory_spec = GatewaySpec::new(&mock, &dir);
        memory_spec.storage = format!("sqlite://{}", dir.file("memory.db").display());
        let mut redis_spec = GatewaySpec::new(&mock, &dir);
        redis_spec.storage = format!("sqlite://{}", dir.file("redis.db").display());
        redis_spec.backend = redis.clone();
        redis_spec.redis_prefix = redis_prefix();
        let memory = Gateway::start(&dir, "idem-memory", &memory_spec).await?;
        match Gateway::start(&dir, "idem-redis", &redis_spec).await {
            Err(e) => t.na(
                &format!("(a) p99 at {} req/s", int(RATE.into())),
                &format!("{e:#}"),
            ),
            Ok(with_redis) => {
                let (m_ep, r_ep) = (
                    Endpoint::new(memory.addr, Some(KEY)),
                    Endpoint::new(with_redis.addr, Some(KEY)),
                );
                load::closed(m_ep.addr, CONNS, warm, load::unique_chats(&m_ep)).await?;
                load::closed(r_ep.addr, CONNS, warm, load::unique_chats(&r_ep)).await?;
                let (mut m_run, mut r_run) = (Run::new()?, Run::new()?);
                let (mut r_requests, mut r_calls) = (0u64, 0u64);
                let (mut m_p99s, mut r_p99s) = (Vec::new(), Vec::new());
                let d = Duration::from_secs_f64(secs);
                for round in 0..rounds {
                    let redis_first = round % 2 == 1;
                    for is_redis in [redis_first, !redis_first] {
                        let ep = if is_redis { &r_ep } else { &m_ep };
                        let before = mock.calls().await?;
                        let run =
                            load::open(ep.addr, RATE, d, CONNS, load::unique_chats(ep)).await?;
                        if is_redis {
                            r_p99s.push(run.ms(0.99));
                            r_calls += mock.calls().await? - before;
                            r_requests += run.sent();
                            r_run.absorb(run)?;
                        } else {
                            m_p99s.push(run.ms(0.99));
                            m_run.absorb(run)?;
                        }
                    }
                }
                let rate = int(RATE.into());
                t.row([
                    format!("(a) p50 at {rate} req/s, ms"),
                    ms(m_run.ms(0.5)),
                    ms(r_run.ms(0.5)),
                    plus_ms(r_run.ms(0.5) - m_run.ms(0.5)),
                    "-".into(),
                    String::new(),
                ]);
                let added = r_run.ms(0.99) - m_run.ms(0.99);
                let pairs: Vec<(f64, f64)> = m_p99s.into_iter().zip(r_p99s).collect();
                let noisy = too_spread(&pairs, ADDED_P99_MS);
                t.row([
                    format!("(a) p99 at {rate} req/s, ms"),
                    ms(m_run.ms(0.99)),
                    ms(r_run.ms(0.99)),
                    plus_ms(added),
                    format!("added < {ADDED_P99_MS} ms"),
                    verdict_noisy(added < ADDED_P99_MS, noisy),
                ]);
                t.row([
                    "(a) added p99 per round: median (min .. max)".into(),
                    String::new(),
                    String::new(),
                    spread(&pairs),
                    "-".into(),
                    String::new(),
                ]);
                t.row([
                    "(a) achieved rate, req/s".into(),
                    per_sec(m_run.rate()),
                    per_sec(r_run.rate()),
                    String::new(),
                    rate,
                    String::new(),
                ]);
                t.row([
                    "(a) answers not 2xx".into(),
                    int(m_run.failed()),
                    int(r_run.failed()),
                    String::new(),
                    "0".into(),
                    verdict(m_run.failed() + r_run.failed() == 0),
                ]);
                t.row([
                    "(a) upstream calls / requests".into(),
                    "-".into(),
                    format!("{} / {}", int(r_calls), int(r_requests)),
                    String::new(),
                    "equal".into(),
                    verdict(r_calls == r_requests),
                ]);
                if let Some(e) = &r_run.first_error {
                    t.note(format!("(a) first error with redis: {e}"));
                }
                if noisy {
                    t.note(NOISY_NOTE);
                }
                t.note(format!(
                    "(a) open loop, unique prompts, {CONNS} connections, {rounds} x {secs} s per \
                     backend in alternating rounds, latency from the scheduled send time"
                ));
            }
        }
    }

    // (b) a wave spread over three replicas on the same Redis and PostgreSQL.
    let label = format!(
        "(b) upstream calls, wave of {} over {REPLICAS} replicas",
        int(wave_n as u64)
    );
    match replicas_wave(&mock, &dir, &redis, wave_n).await {
        Err(e) => t.na(&label, &format!("{e:#}")),
        Ok((calls, per_replica, statuses)) => {
            t.row([
                label,
                "-".into(),
                int(calls),
                String::new(),
                "exactly 1".into(),
                verdict(calls == 1),
            ]);
            t.row([
                "(b) answers".into(),
                "-".into(),
                statuses,
                String::new(),
                "all 200".into(),
                String::new(),
            ]);
            for (i, outcomes) in per_replica.iter().enumerate() {
                t.row([
                    format!("(b) replica {} outcomes", i + 1),
                    "-".into(),
                    outcomes.clone(),
                    String::new(),
                    "-".into(),
                    String::new(),
                ]);
            }
            t.note(format!(
                "(b) the mock holds the first call until every request is written and every \
                 replica is quiet, then answers in {LATENCY_MS} ms; requests round-robin over the replicas"
            ));
        }
    }
    Ok(t)
}

/// Three replicas on one Redis prefix and one PostgreSQL schema; returns
/// upstream calls, outcomes per replica, and the answers' statuses.
async fn replicas_wave(
    mock: &Mock,
    dir: &Workdir,
    redis: &str,
    n: usize,
) -> anyhow::Result<(u64, Vec<String>, String)> {
    let mut spec = GatewaySpec::new(mock, dir);
    spec.storage = pg_schema().await?;
    spec.backend = redis.to_string();
    spec.redis_prefix = redis_prefix();
    // One after the other: the first runs the migrations.
    let mut replicas = Vec::with_capacity(REPLICAS);
    for i in 1..=REPLICAS {
        replicas.push(Gateway::start(dir, &format!("idem-replica-{i}"), &spec).await?);
    }
    mock.behave(json!({"hold": true, "latency_ms": LATENCY_MS}))
        .await?;
    let refs: Vec<&Gateway> = replicas.iter().collect();
    let w = wave::run(&refs, n, wave::Transport::Http1, mock).await?;
    let calls = w.upstream_calls;
    mock.behave(json!({})).await?;

    let mut per_replica = vec![BTreeMap::<String, u64>::new(); REPLICAS];
    let mut statuses = BTreeMap::<String, u64>::new();
    for a in &w.answers {
        match &a.reply {
            Ok((status, outcome)) => {
                *statuses.entry(status.to_string()).or_default() += 1;
                let o = outcome.clone().unwrap_or_else(|| "(none)".into());
                *per_replica[a.gateway].entry(o).or_default() += 1;
            }
            Err(_) => *statuses.entry("no answer".into()).or_default() += 1,
        }
    }
    let list = |m: &BTreeMap<String, u64>| {
        m.iter()
            .map(|(k, v)| format!("{k} x {}", int(*v)))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Ok((
        calls,
        per_replica.iter().map(list).collect(),
        list(&statuses),
    ))
}
