//! Table 2: a wave of identical concurrent requests through one gateway:
//! how many upstream calls it makes, how much later than the leader its
//! followers are answered, and its resident memory while they wait. Twice:
//! over HTTP/1.1 with a connection per request, then over HTTP/2 with the
//! requests as streams of a few connections.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hdrhistogram::Histogram;
use serde_json::json;

use crate::Settings;
use crate::http::Endpoint;
use crate::load;
use crate::procs::{Gateway, GatewaySpec, KEY, Mock, Workdir};
use crate::report::{self, Table, int, mib, ms, plus_ms, verdict};
use crate::wave::{self, Transport};

/// The mock's latency once the held call is released.
const LATENCY_MS: u64 = 200;
/// Target: resident memory during the wave.
const MEMORY_MIB: f64 = 100.0;
/// Target: answering the followers takes at most this multiple of the time
/// a burst of as many cache hits takes.
const FAN_OUT_TIME: f64 = 1.2;
/// Target: CPU per follower at most this multiple of CPU per cache hit.
const FAN_OUT_CPU: f64 = 1.1;
/// Unique requests before the wave (their answers are cached: about 1.3
/// KiB each of the idle figure).
const WARM_UP_REQUESTS: u64 = 2_000;
/// Streams per HTTP/2 connection: idem's limit per connection.
const STREAMS_PER_CONNECTION: usize = 200;

pub async fn run(s: Arc<Settings>) -> anyhow::Result<Vec<Table>> {
    let n = s.pick(1_000, 10_000);
    let h1 = one(n, Transport::Http1, "2").await?;
    let connections = n.div_ceil(STREAMS_PER_CONNECTION);
    let h2 = one(n, Transport::Http2 { connections }, "2b").await?;
    Ok(vec![h1, h2])
}

/// One wave of `n` over `transport`, on a gateway and mock of its own.
async fn one(n: usize, transport: Transport, number: &str) -> anyhow::Result<Table> {
    let opened = transport.connections(n);
    let dir = Workdir::new("wave")?;
    let mock = Mock::start(&dir, "mock", &[]).await?;
    let gateway = Gateway::start(&dir, "idem", &GatewaySpec::new(&mock, &dir)).await?;

    // Warm-up with unique prompts (no hold yet): idem's upstream pool is
    // open and the route has a latency history. A fixed number of them, not
    // a fixed time: their answers stay in the cache, and the idle figure
    // would otherwise grow with the machine's speed.
    let endpoint = Endpoint::new(gateway.addr, Some(KEY));
    load::closed_count(
        gateway.addr,
        4,
        WARM_UP_REQUESTS,
        load::unique_chats(&endpoint),
    )
    .await?;
    mock.behave(json!({"hold": true, "latency_ms": LATENCY_MS}))
        .await?;

    let w = wave::run(&[&gateway], n, transport, &mock).await?;
    let calls = w.upstream_calls;

    let mut statuses = BTreeMap::<String, u64>::new();
    let mut outcomes = BTreeMap::<String, u64>::new();
    let mut followers = Histogram::<u64>::new_with_bounds(1, 300_000_000, 3)
        .context("cannot create a histogram")?;
    let mut leader = None;
    for a in &w.answers {
        match &a.reply {
            Ok((status, outcome)) => {
                *statuses.entry(status.to_string()).or_default() += 1;
                let outcome = outcome.clone().unwrap_or_else(|| "(none)".into());
                *outcomes.entry(outcome.clone()).or_default() += 1;
                let us = a
                    .after_release
                    .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
                match outcome.as_str() {
                    "leader" => leader = Some(us),
                    "follower" => followers.saturating_record(us),
                    _ => {}
                }
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
    let f_ms = |q: f64| followers.value_at_quantile(q) as f64 / 1000.0;
    let leader_ms = leader.map(|us| us as f64 / 1000.0);

    let short = match transport {
        Transport::Http1 => "HTTP/1.1",
        Transport::Http2 { .. } => "HTTP/2",
    };
    let how = match transport {
        Transport::Http1 => "HTTP/1.1, a connection each".to_string(),
        Transport::Http2 { .. } => format!(
            "HTTP/2, {} streams on each of {} connections",
            int(n.div_ceil(opened) as u64),
            int(opened as u64)
        ),
    };
    let mut t = Table::new(
        format!(
            "{number}. Wave of {} identical concurrent requests over {how} (mock holds the call, then answers in {LATENCY_MS} ms)",
            int(n as u64)
        ),
        &["figure", "measured", "baseline", "target", "result"],
    );
    t.row([
        "upstream calls".into(),
        int(calls),
        format!("{} requests", int(n as u64)),
        "exactly 1".into(),
        verdict(calls == 1),
    ]);
    let all_ok = statuses.get("200").copied() == Some(n as u64);
    t.row([
        "answers".into(),
        list(&statuses),
        String::new(),
        "all 200".into(),
        verdict(all_ok),
    ]);
    t.row([
        "outcomes (Idem-Outcome)".into(),
        list(&outcomes),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    let upstream_ms = w.probe.map(|d| d.as_secs_f64() * 1e3);
    t.row([
        "upstream latency after release, ms (probe)".into(),
        upstream_ms.map_or("-".into(), ms),
        format!("mock {LATENCY_MS} ms"),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "leader latency after release, ms".into(),
        leader_ms.map_or("-".into(), ms),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "followers after release p50 / p99 / max, ms".into(),
        format!("{} / {} / {}", ms(f_ms(0.5)), ms(f_ms(0.99)), ms(f_ms(1.0))),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    match upstream_ms {
        Some(u) if !followers.is_empty() => {
            let delay = f_ms(0.99) - u;
            // An absolute time that depends on the machine: the target is
            // the ratio to the burst below.
            t.row([
                "followers' p99 - upstream latency".into(),
                plus_ms(delay),
                "probe".into(),
                "-".into(),
                String::new(),
            ]);
        }
        _ => t.na(
            "followers' p99 - upstream latency",
            "no probe or no follower answer",
        ),
    }
    let (idle, conns, parked) = (w.idle_mem[0], w.connected_mem[0], w.parked_mem[0]);
    t.row([
        "resident memory: idle, before the wave".into(),
        mib(idle.rss_kib),
        format!("{} of it mapped files", mib(idle.file_kib)),
        "-".into(),
        String::new(),
    ]);
    t.row([
        format!("  with {} open idle connections", int(opened as u64)),
        mib(conns.rss_kib),
        format!(
            "+{} on idle",
            mib(conns.rss_kib.saturating_sub(idle.rss_kib))
        ),
        "-".into(),
        String::new(),
    ]);
    let memory_met = (parked.rss_kib as f64 / 1024.0) < MEMORY_MIB;
    t.row([
        format!("  with {} waiting followers", int(n as u64 - 1)),
        mib(parked.rss_kib),
        format!(
            "+{} on idle",
            mib(parked.rss_kib.saturating_sub(idle.rss_kib))
        ),
        format!("< {MEMORY_MIB} MiB"),
        verdict(memory_met),
    ]);
    report::target(
        4,
        format!(
            "{short}: resident memory, {} waiting followers",
            int(n as u64 - 1)
        ),
        mib(parked.rss_kib),
        format!("idle {}", mib(idle.rss_kib)),
        format!("< {MEMORY_MIB} MiB"),
        verdict(memory_met),
    );
    // The same target read as what the followers themselves cost: the
    // process's idle footprint (half of it the binary's code pages) is
    // there without them.
    let share = parked.rss_kib.saturating_sub(idle.rss_kib);
    t.row([
        "    the followers' share (waiting - idle)".into(),
        mib(share),
        format!("{:.1} KiB each", share as f64 / (n - 1).max(1) as f64),
        format!("< {MEMORY_MIB} MiB"),
        verdict((share as f64 / 1024.0) < MEMORY_MIB),
    ]);
    let peak = w.final_mem[0].hwm_kib.max(w.sampled_peak_kib[0]);
    t.row([
        "  peak over the whole wave (VmHWM)".into(),
        mib(peak),
        format!("+{} on idle", mib(peak.saturating_sub(idle.rss_kib))),
        // Reached once the followers are answered, not while they wait:
        // every connection still open then has its answer written into its
        // write buffer as well.
        "-".into(),
        String::new(),
    ]);
    let per = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
    t.row([
        "idem CPU: reading the wave / answering it".into(),
        format!(
            "{:.0} / {:.0} ms",
            w.cpu_intake[0].as_secs_f64() * 1e3,
            w.cpu_answer[0].as_secs_f64() * 1e3
        ),
        format!(
            "{:.0} / {:.0} us per request",
            per(w.cpu_intake[0]),
            per(w.cpu_answer[0])
        ),
        "-".into(),
        String::new(),
    ]);
    fan_out(&mut t, &w, n, short, upstream_ms);
    t.note(format!(
        "all {} connections opened first; requests written {:.0} ms after the fire; gateway quiet \
         (all parked) {:.0} ms after it{}; last answer {:.0} ms after the release",
        int(opened as u64),
        w.fire_to_sent.as_secs_f64() * 1e3,
        w.fire_to_parked.as_secs_f64() * 1e3,
        if w.quiet {
            ""
        } else {
            " (never quiet: gave up waiting)"
        },
        w.release_to_last.as_secs_f64() * 1e3,
    ));
    if !w.held {
        t.note("the mock never held a call: nothing reached the provider before the release");
    }
    if w.answered_early > 0 {
        t.note(format!(
            "{} requests were answered before the release",
            int(w.answered_early as u64)
        ));
    }
    t.note(
        "latencies count from the release of the held upstream call; the probe is the same \
         request sent to the mock directly, held and released with the leader's call",
    );
    t.note(format!(
        "idle: after a warm-up of {} unique requests, whose answers are in the cache",
        int(WARM_UP_REQUESTS)
    ));
    t.note(
        "burst: after the wave, the same request again on every one of its connections at once, \
         each a cache hit; its time runs from the fire to the last answer, the followers' from the \
         upstream's answer (release + probe latency) to the last follower answered",
    );
    Ok(t)
}

/// Target 4: the followers' answers against a burst of as many cache hits
/// on the same connections, in time and in CPU.
fn fan_out(t: &mut Table, w: &wave::Wave, n: usize, short: &str, upstream_ms: Option<f64>) {
    let b = &w.burst;
    let burst_ms = b.elapsed.as_secs_f64() * 1e3;
    t.row([
        "burst of cache hits after the wave: cache hits / sent".into(),
        format!("{} / {}", int(b.cache_hits as u64), int(b.sent as u64)),
        String::new(),
        "all".into(),
        verdict(b.cache_hits == b.sent && b.sent == n),
    ]);
    match upstream_ms {
        Some(u) => {
            let followers_ms = w.release_to_last.as_secs_f64() * 1e3 - u;
            let x = followers_ms / burst_ms.max(f64::MIN_POSITIVE);
            let result = verdict(x <= FAN_OUT_TIME);
            t.row([
                "answering the followers / the burst, ms".into(),
                format!("{} / {}", ms(followers_ms), ms(burst_ms)),
                format!("{x:.2}x"),
                format!("<= {FAN_OUT_TIME}x"),
                result.clone(),
            ]);
            report::target(
                4,
                format!(
                    "{short}: time to answer {} followers, ms",
                    int(n as u64 - 1)
                ),
                ms(followers_ms),
                format!("burst of cache hits {}", ms(burst_ms)),
                format!("<= {FAN_OUT_TIME}x"),
                format!("{result} ({x:.2}x)"),
            );
        }
        None => t.na("answering the followers / the burst", "no probe"),
    }
    let per = |d: Duration, k: usize| d.as_secs_f64() * 1e6 / k.max(1) as f64;
    let follower_us = per(w.cpu_intake[0] + w.cpu_answer[0], n);
    let hit_us = per(b.cpu[0], b.sent);
    let x = follower_us / hit_us.max(f64::MIN_POSITIVE);
    let result = verdict(x <= FAN_OUT_CPU);
    t.row([
        "idem CPU per request: wave (reading + answering) / burst, us".into(),
        format!("{follower_us:.1} / {hit_us:.1}"),
        format!("{x:.2}x"),
        format!("<= {FAN_OUT_CPU}x"),
        result.clone(),
    ]);
    report::target(
        4,
        format!("{short}: CPU per follower, us"),
        format!("{follower_us:.1}"),
        format!("per cache hit {hit_us:.1}"),
        format!("<= {FAN_OUT_CPU}x"),
        format!("{result} ({x:.2}x)"),
    );
}
