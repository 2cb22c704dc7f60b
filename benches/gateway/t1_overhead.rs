//! Table 1: what idem adds in front of a provider, for unique prompts
//! (nothing coalesced, nothing cached): the same load against the mock
//! directly and through idem, in alternating rounds so that background
//! load on the machine falls on both sides alike.

use std::sync::Arc;
use std::time::Duration;

use crate::Settings;
use crate::http::Endpoint;
use crate::load::{self, Run};
use crate::procs::{Gateway, GatewaySpec, KEY, Mock, Workdir};
use crate::report::{
    NOISY_NOTE, Table, int, ms, per_sec, plus_ms, ratio, spread, too_spread, verdict, verdict_noisy,
};

/// Connections of the closed loop (and of the open loop's pool).
const CONNS: usize = 32;
/// The open loop's rate.
const RATE: u32 = 1_000;
/// Target: idem's added p99 at `RATE`, in ms.
const ADDED_P99_MS: f64 = 1.0;

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Direct,
    Idem,
}

pub async fn run(s: Arc<Settings>) -> anyhow::Result<Table> {
    let (rounds_a, secs_a) = s.pick((1, 1.0), (3, 2.0));
    let (rounds_b, secs_b) = s.pick((1, 2.0), (5, 2.0));
    let warm = Duration::from_secs_f64(s.pick(0.3, 1.0));

    let dir = Workdir::new("overhead")?;
    let mock = Mock::start(&dir, "mock", &[]).await?;
    let spec = GatewaySpec::new(&mock, &dir);
    let mut gateway = Gateway::start(&dir, "idem", &spec).await?;
    let direct = Endpoint::new(mock.addr, Some(KEY));
    let mut idem = Endpoint::new(gateway.addr, Some(KEY));

    // Warm-up: connection pools, allocator, the route's latency tracker.
    load::closed(direct.addr, CONNS, warm, load::unique_chats(&direct)).await?;
    load::closed(idem.addr, CONNS, warm, load::unique_chats(&idem)).await?;

    let (mut a_direct, mut a_idem) = (Run::new()?, Run::new()?);
    let (mut b_direct, mut b_idem) = (Run::new()?, Run::new()?);
    // Upstream calls made while idem was measured, against its requests.
    let (mut idem_requests, mut idem_calls) = (0u64, 0u64);
    // CPU of the closed loop: the mock's when direct, idem's through idem.
    let (mut mock_cpu, mut idem_cpu) = (Duration::ZERO, Duration::ZERO);
    // (b) p99 of each round, direct and idem, for the spread.
    let (mut direct_p99s, mut idem_p99s) = (Vec::new(), Vec::new());
    let rounds = (0..rounds_a)
        .map(|r| (true, r))
        .chain((0..rounds_b).map(|r| (false, r)));
    for (closed, round) in rounds {
        if !closed && round == 0 {
            // (b) gets a gateway of its own: (a) leaves ~100,000 cached
            // answers whose expiry, 30 s later, would fall into (b) at many
            // times the rate (b) itself causes.
            drop(gateway);
            gateway = Gateway::start(&dir, "idem-b", &spec).await?;
            idem = Endpoint::new(gateway.addr, Some(KEY));
            load::closed(idem.addr, CONNS, warm, load::unique_chats(&idem)).await?;
        }
        let order = if round % 2 == 0 {
            [Side::Direct, Side::Idem]
        } else {
            [Side::Idem, Side::Direct]
        };
        for side in order {
            let endpoint = if side == Side::Direct { &direct } else { &idem };
            let make = load::unique_chats(endpoint);
            let before = mock.calls().await?;
            let cpu = if side == Side::Direct {
                &mock.proc
            } else {
                &gateway.proc
            };
            let cpu_before = cpu.cpu()?;
            let run = if closed {
                load::closed(endpoint.addr, CONNS, Duration::from_secs_f64(secs_a), make).await?
            } else {
                load::open(
                    endpoint.addr,
                    RATE,
                    Duration::from_secs_f64(secs_b),
                    CONNS,
                    make,
                )
                .await?
            };
            if closed {
                let used = cpu.cpu()?.saturating_sub(cpu_before);
                match side {
                    Side::Direct => mock_cpu += used,
                    Side::Idem => idem_cpu += used,
                }
            }
            if side == Side::Idem {
                idem_calls += mock.calls().await? - before;
                idem_requests += run.sent();
            }
            let target = match (closed, side) {
                (true, Side::Direct) => &mut a_direct,
                (true, Side::Idem) => &mut a_idem,
                (false, Side::Direct) => &mut b_direct,
                (false, Side::Idem) => &mut b_idem,
            };
            if !closed {
                match side {
                    Side::Direct => direct_p99s.push(run.ms(0.99)),
                    Side::Idem => idem_p99s.push(run.ms(0.99)),
                }
            }
            target.absorb(run)?;
        }
    }

    let mut t = Table::new(
        "1. Proxy overhead, unique prompts (mock latency 0)",
        &[
            "figure",
            "direct",
            "through idem",
            "idem vs direct",
            "target",
            "result",
        ],
    );
    let pair = |r: &Run, a: f64, b: f64| format!("{} / {}", ms(r.ms(a)), ms(r.ms(b)));
    t.row([
        format!("(a) throughput, {CONNS} connections, req/s"),
        per_sec(a_direct.rate()),
        per_sec(a_idem.rate()),
        ratio(a_idem.rate(), a_direct.rate()),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "(a) latency p50 / p99 at that load, ms".into(),
        pair(&a_direct, 0.5, 0.99),
        pair(&a_idem, 0.5, 0.99),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    let per_request = |cpu: Duration, r: &Run| cpu.as_secs_f64() * 1e6 / r.sent().max(1) as f64;
    let (mock_us, idem_us) = (
        per_request(mock_cpu, &a_direct),
        per_request(idem_cpu, &a_idem),
    );
    t.row([
        "(a) CPU per request, us (mock / idem process)".into(),
        format!("{mock_us:.1}"),
        format!("{idem_us:.1}"),
        ratio(idem_us, mock_us),
        "-".into(),
        String::new(),
    ]);
    t.row([
        format!("(b) p50 at {} req/s, ms", int(RATE.into())),
        ms(b_direct.ms(0.5)),
        ms(b_idem.ms(0.5)),
        plus_ms(b_idem.ms(0.5) - b_direct.ms(0.5)),
        "-".into(),
        String::new(),
    ]);
    let added_p99 = b_idem.ms(0.99) - b_direct.ms(0.99);
    let pairs: Vec<(f64, f64)> = direct_p99s.into_iter().zip(idem_p99s).collect();
    let noisy = too_spread(&pairs, ADDED_P99_MS);
    t.row([
        format!("(b) p99 at {} req/s, ms", int(RATE.into())),
        ms(b_direct.ms(0.99)),
        ms(b_idem.ms(0.99)),
        plus_ms(added_p99),
        format!("added < {ADDED_P99_MS} ms"),
        verdict_noisy(added_p99 < ADDED_P99_MS, noisy),
    ]);
    t.row([
        "(b) added p99 per round: median (min .. max)".into(),
        String::new(),
        String::new(),
        spread(&pairs),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "(b) p99.9 / max, ms".into(),
        pair(&b_direct, 0.999, 1.0),
        pair(&b_idem, 0.999, 1.0),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "(b) achieved rate, req/s".into(),
        per_sec(b_direct.rate()),
        per_sec(b_idem.rate()),
        String::new(),
        int(RATE.into()),
        String::new(),
    ]);
    t.row([
        "answers not 2xx (all runs)".into(),
        int(a_direct.failed() + b_direct.failed()),
        int(a_idem.failed() + b_idem.failed()),
        String::new(),
        "0".into(),
        verdict(a_direct.failed() + b_direct.failed() + a_idem.failed() + b_idem.failed() == 0),
    ]);
    t.row([
        "upstream calls / requests through idem".into(),
        "-".into(),
        format!("{} / {}", int(idem_calls), int(idem_requests)),
        String::new(),
        "equal".into(),
        verdict(idem_calls == idem_requests),
    ]);
    t.note(format!(
        "(a) closed loop: {CONNS} connections, each sends its next request when answered; \
         {rounds_a} x {secs_a} s per side"
    ));
    t.note(format!(
        "(b) open loop: {} req/s on a fixed timeline over {CONNS} connections, latency from the \
         scheduled send time; {rounds_b} x {secs_b} s per side",
        int(RATE.into())
    ));
    t.note(
        "rounds alternate direct/idem (ABBA); idem logs one JSON line per request (its default); \
         (b) runs on a fresh gateway, warmed up like (a)'s",
    );
    if noisy {
        t.note(NOISY_NOTE);
    }
    for (label, run) in [
        ("direct", &a_direct),
        ("idem", &a_idem),
        ("direct", &b_direct),
        ("idem", &b_idem),
    ] {
        if let Some(e) = &run.first_error {
            t.note(format!("first error ({label}): {e}"));
        }
    }
    Ok(t)
}
