//! Table 1: what idem adds in front of a provider, for unique prompts
//! (nothing coalesced, nothing cached): the same load against the mock
//! directly, through nginx as a plain reverse proxy (what one proxy hop
//! costs here) and through idem, in alternating rounds so that background
//! load on the machine falls on every side alike. A third side, idem with
//! an Anthropic target (the mock's Messages API face), prices the
//! translation both ways: table 1c. A fourth, idem with traces on (to a
//! collector in this process that takes every export), prices them:
//! table 1d. A fifth, in the closed loop only, a bare proxy on the libraries
//! idem is built on (tokio and hyper), is the floor of what such a gateway
//! costs here: table 1e. A sixth, idem asked with a key of the store that
//! has a budget, a tenant budget and rate limits (each request checks the
//! key's windows and each call reserves and settles against both
//! budgets), prices admission: table 1f.

use std::sync::Arc;
use std::time::Duration;

use crate::Settings;
use crate::bare::Bare;
use crate::http::Endpoint;
use crate::load::{self, Run};
use crate::nginx::{self, Nginx};
use crate::procs::{Gateway, GatewaySpec, KEY, Mock, Workdir};
use crate::report::{
    self, NOISY_NOTE, Table, int, ms, per_sec, plus_ms, ratio, spread, too_spread, verdict,
    verdict_noisy,
};

/// Connections of the closed loop (and of the open loop's pool).
const CONNS: usize = 32;
/// The open loop's rate.
const RATE: u32 = 10_000;
/// Target: idem's added p99 at `RATE`, in ms.
const ADDED_P99_MS: f64 = 1.0;
/// Target: idem's added p99 at most nginx's plus this, in ms.
const OVER_NGINX_P99_MS: f64 = 0.3;
/// Target: idem's closed-loop throughput at least this share of nginx's.
const THROUGHPUT_SHARE: f64 = 0.8;
/// Target: idem's CPU per request at most this multiple of nginx's.
const CPU_MULTIPLE: f64 = 1.5;

#[derive(Clone, Copy, PartialEq)]
enum Side {
    Direct,
    /// nginx as a plain reverse proxy to the mock.
    Nginx,
    Idem,
    /// idem in front of the mock's Anthropic face.
    Anthropic,
    /// idem with traces on.
    Traced,
    /// A bare tokio/hyper proxy (closed loop only).
    Bare,
    /// idem with a key of the store with a budget and limits, in a tenant
    /// with a budget.
    Budgeted,
}

const SIDES: [Side; 7] = [
    Side::Direct,
    Side::Nginx,
    Side::Idem,
    Side::Anthropic,
    Side::Traced,
    Side::Bare,
    Side::Budgeted,
];

/// Target: what a key's budget and limits add to idem's CPU per request,
/// in microseconds (no database round trip per request).
const BUDGET_CPU_US: f64 = 10.0;

/// An OTLP/HTTP collector that takes every export and counts its bytes.
async fn collector() -> anyhow::Result<(String, Arc<std::sync::atomic::AtomicU64>)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    let received = Arc::new(AtomicU64::new(0));
    let counted = received.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            counted.fetch_add(body.len() as u64, Ordering::Relaxed);
            async { [("content-type", "application/x-protobuf")] }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((format!("http://{addr}"), received))
}

/// What one side measured over all its rounds.
struct Measured {
    a: Run,
    b: Run,
    /// CPU of the process the closed loop loads: the mock's when direct,
    /// nginx's (master and workers) through nginx, idem's otherwise.
    cpu: Duration,
    /// (b) p99 of each round.
    p99s: Vec<f64>,
    /// Upstream calls made while this side was measured.
    calls: u64,
}

impl Measured {
    fn new() -> anyhow::Result<Measured> {
        Ok(Measured {
            a: Run::new()?,
            b: Run::new()?,
            cpu: Duration::ZERO,
            p99s: Vec::new(),
            calls: 0,
        })
    }

    fn requests(&self) -> u64 {
        self.a.sent() + self.b.sent()
    }

    fn failed(&self) -> u64 {
        self.a.failed() + self.b.failed()
    }

    /// Closed-loop CPU per request, in us.
    fn cpu_us(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.a.sent().max(1) as f64
    }
}

pub async fn run(s: Arc<Settings>) -> anyhow::Result<Vec<Table>> {
    let (rounds_a, secs_a) = s.pick((1, 1.0), (3, 2.0));
    let (rounds_b, secs_b) = s.pick((1, 2.0), (5, 2.0));
    let warm = Duration::from_secs_f64(s.pick(0.3, 1.0));

    let dir = Workdir::new("overhead")?;
    let mock = Mock::start(&dir, "mock", &[]).await?;
    let spec = GatewaySpec::new(&mock, &dir);
    // One SQLite file serves one gateway.
    let spec_c = GatewaySpec {
        anthropic: true,
        storage: format!("sqlite://{}", dir.file("idem-c.db").display()),
        ..GatewaySpec::new(&mock, &dir)
    };
    let (collector_url, exported) = collector().await?;
    let spec_t = GatewaySpec {
        otlp_endpoint: Some(collector_url),
        storage: format!("sqlite://{}", dir.file("idem-t.db").display()),
        ..GatewaySpec::new(&mock, &dir)
    };
    let spec_k = GatewaySpec {
        budgeted: true,
        storage: format!("sqlite://{}", dir.file("idem-k.db").display()),
        ..GatewaySpec::new(&mock, &dir)
    };
    let mut gateway = Gateway::start(&dir, "idem", &spec).await?;
    let mut gateway_c = Gateway::start(&dir, "idem-c", &spec_c).await?;
    let mut gateway_t = Gateway::start(&dir, "idem-t", &spec_t).await?;
    let mut gateway_k = Gateway::start(&dir, "idem-k", &spec_k).await?;
    // The key lives in the store: the gateways of (b) find it there.
    let budgeted_key = gateway_k.key().await?;
    // The nginx side, when nginx is here (else why not, for the notes).
    let proxy = match nginx::find_or_install() {
        Ok(found) => match Nginx::start(&dir, &found, mock.addr).await {
            Ok(n) => Ok((n, found)),
            Err(e) => Err(format!("nginx did not start: {e:#}")),
        },
        Err(why) => Err(why),
    };
    let bare = Bare::start(&dir, mock.addr).await?;
    let via_bare = Endpoint::new(bare.addr, Some(KEY));
    let direct = Endpoint::new(mock.addr, Some(KEY));
    let via_nginx = proxy
        .as_ref()
        .ok()
        .map(|(n, _)| Endpoint::new(n.addr, Some(KEY)));
    let mut idem = Endpoint::new(gateway.addr, Some(KEY));
    let mut idem_c = Endpoint::new(gateway_c.addr, Some(KEY));
    let mut idem_t = Endpoint::new(gateway_t.addr, Some(KEY));
    let mut idem_k = Endpoint::new(gateway_k.addr, Some(&budgeted_key));

    // Warm-up: connection pools, allocator, the route's latency tracker.
    for endpoint in [&direct, &idem, &idem_c, &idem_t, &idem_k, &via_bare]
        .into_iter()
        .chain(via_nginx.as_ref())
    {
        load::closed(endpoint.addr, CONNS, warm, load::unique_chats(endpoint)).await?;
    }

    let mut measured = [
        Measured::new()?,
        Measured::new()?,
        Measured::new()?,
        Measured::new()?,
        Measured::new()?,
        Measured::new()?,
        Measured::new()?,
    ];
    let rounds = (0..rounds_a)
        .map(|r| (true, r))
        .chain((0..rounds_b).map(|r| (false, r)));
    for (closed, round) in rounds {
        if !closed && round == 0 {
            // (b) gets gateways of their own: (a) leaves ~100,000 cached
            // answers whose expiry, 30 s later, would fall into (b) at many
            // times the rate (b) itself causes.
            drop(gateway);
            drop(gateway_c);
            drop(gateway_t);
            drop(gateway_k);
            gateway = Gateway::start(&dir, "idem-b", &spec).await?;
            gateway_c = Gateway::start(&dir, "idem-cb", &spec_c).await?;
            gateway_t = Gateway::start(&dir, "idem-tb", &spec_t).await?;
            gateway_k = Gateway::start(&dir, "idem-kb", &spec_k).await?;
            idem = Endpoint::new(gateway.addr, Some(KEY));
            idem_c = Endpoint::new(gateway_c.addr, Some(KEY));
            idem_t = Endpoint::new(gateway_t.addr, Some(KEY));
            idem_k = Endpoint::new(gateway_k.addr, Some(&budgeted_key));
            for endpoint in [&idem, &idem_c, &idem_t, &idem_k] {
                load::closed(endpoint.addr, CONNS, warm, load::unique_chats(endpoint)).await?;
            }
        }
        // Each round starts with another side, so that none is always
        // measured first or last.
        for i in 0..SIDES.len() {
            let side = SIDES[(i + round) % SIDES.len()];
            let (endpoint, cpu): (
                &Endpoint,
                Box<dyn Fn() -> anyhow::Result<Duration> + Send + Sync>,
            ) = match (side, &proxy, &via_nginx) {
                (Side::Direct, _, _) => (&direct, Box::new(|| mock.proc.cpu())),
                (Side::Nginx, Ok((n, _)), Some(e)) => (e, Box::new(|| n.cpu())),
                (Side::Nginx, _, _) => continue,
                (Side::Idem, _, _) => (&idem, Box::new(|| gateway.proc.cpu())),
                (Side::Anthropic, _, _) => (&idem_c, Box::new(|| gateway_c.proc.cpu())),
                (Side::Traced, _, _) => (&idem_t, Box::new(|| gateway_t.proc.cpu())),
                (Side::Bare, _, _) if closed => (&via_bare, Box::new(|| bare.proc.cpu())),
                (Side::Bare, _, _) => continue,
                (Side::Budgeted, _, _) => (&idem_k, Box::new(|| gateway_k.proc.cpu())),
            };
            let make = load::unique_chats(endpoint);
            let calls_before = mock.calls().await?;
            let cpu_before = cpu()?;
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
            let m = &mut measured[side as usize];
            if closed {
                m.cpu += cpu()?.saturating_sub(cpu_before);
            }
            m.calls += mock.calls().await? - calls_before;
            if closed {
                m.a.absorb(run)?;
            } else {
                m.p99s.push(run.ms(0.99));
                m.b.absorb(run)?;
            }
        }
    }
    let [d, n, i, c, t, b, k] = measured;
    let exported = exported.load(std::sync::atomic::Ordering::Relaxed);
    let n = match &proxy {
        Ok((_, found)) => Ok((&n, found.describe())),
        Err(why) => Err(why.as_str()),
    };
    Ok(vec![
        overhead(&d, n.clone(), &i, rounds_a, secs_a, rounds_b, secs_b),
        translation(&d, &i, &c),
        tracing_cost(&d, &i, &t, exported),
        floor(&d, n.ok().map(|(m, _)| m), &i, &b),
        admission(&d, &i, &k),
    ])
}

/// Table 1f: idem asked with a key of the configuration file against one
/// of the store with a budget and limits, in a tenant with a budget: what
/// admission costs (the key's windows, a reservation and a settlement
/// against two budgets per call).
fn admission(d: &Measured, i: &Measured, k: &Measured) -> Table {
    let mut t = beside(
        "1f. Proxy overhead with per-key budgets and limits",
        ["file key", "store key, budgets, limits", "budgets vs none"],
        (d, i, k),
        false,
    );
    let added = k.cpu_us() - i.cpu_us();
    t.row([
        "(a) CPU per request added by budgets and limits, us".into(),
        "-".into(),
        format!("{added:+.1}"),
        String::new(),
        format!("< {BUDGET_CPU_US} us"),
        verdict(added < BUDGET_CPU_US),
    ]);
    t.note(
        "the same rounds as table 1, a sixth side in each: a key of the store with a budget, \
         requests and tokens per minute (never reached), its tenant with a budget; every request \
         is a call, which reserves against both budgets in memory (the store only when a \
         replica's grant runs short) and is settled with the next batched write",
    );
    first_errors(&mut t, &[("budgets", k)]);
    t
}

/// Table 1e: the bare tokio/hyper proxy beside nginx and idem (closed loop):
/// the libraries' share of idem's cost and idem's own.
fn floor(d: &Measured, nginx: Option<&Measured>, i: &Measured, b: &Measured) -> Table {
    let mut t = Table::new(
        "1e. The floor: a bare tokio/hyper proxy (closed loop, unique prompts)",
        &[
            "figure",
            "nginx proxy",
            "bare tokio/hyper proxy",
            "through idem",
            "idem - bare",
        ],
    );
    let na = || "n/a".to_string();
    let rate_vs = |m: &Measured| {
        nginx.map_or_else(
            || per_sec(m.a.rate()),
            |n| {
                format!(
                    "{} ({})",
                    per_sec(m.a.rate()),
                    ratio(m.a.rate(), n.a.rate())
                )
            },
        )
    };
    let cpu_vs = |m: &Measured| {
        nginx.map_or_else(
            || format!("{:.1}", m.cpu_us()),
            |n| format!("{:.1} ({})", m.cpu_us(), ratio(m.cpu_us(), n.cpu_us())),
        )
    };
    t.row([
        "throughput, req/s (x nginx)".into(),
        nginx.map_or_else(na, |n| per_sec(n.a.rate())),
        rate_vs(b),
        rate_vs(i),
        String::new(),
    ]);
    let own = i.cpu_us() - b.cpu_us();
    t.row([
        "CPU per request, us (x nginx)".into(),
        nginx.map_or_else(na, |n| format!("{:.1}", n.cpu_us())),
        cpu_vs(b),
        cpu_vs(i),
        format!("{own:+.1}"),
    ]);
    report::target(
        3,
        "CPU per request beyond a bare tokio/hyper proxy, us",
        format!("{own:+.1}"),
        format!(
            "bare proxy {:.1}{}",
            b.cpu_us(),
            nginx.map_or_else(String::new, |n| format!(
                " ({} nginx)",
                ratio(b.cpu_us(), n.cpu_us())
            ))
        ),
        "-",
        "informational",
    );
    t.note(format!(
        "the bare proxy reads each request whole, sends it on a pooled keepalive \
         connection (hyper-util's client, as reqwest inside idem), reads the answer \
         whole and sends it back: no parsing, no cache, no log (the bench's own executable, so the \
         system allocator where idem has jemalloc); {} requests through it",
        int(b.a.sent())
    ));
    t.note(format!(
        "upstream calls through it: {} (the mock directly: {} req/s)",
        int(b.calls),
        per_sec(d.a.rate())
    ));
    t
}

/// Table 1: the mock directly, nginx in front of it, idem in front of it;
/// targets 1-3 of the summary. `n` is nginx's side and what it is, or why
/// there is none.
fn overhead(
    d: &Measured,
    n: Result<(&Measured, String), &str>,
    i: &Measured,
    rounds_a: usize,
    secs_a: f64,
    rounds_b: usize,
    secs_b: f64,
) -> Table {
    let nginx = n.as_ref().ok().map(|(m, _)| *m);
    let mut t = Table::new(
        "1. Proxy overhead, unique prompts (mock latency 0)",
        &[
            "figure",
            "direct",
            "nginx proxy",
            "through idem",
            "idem vs nginx",
            "target",
            "result",
        ],
    );
    let na = || "n/a".to_string();
    // A cell of nginx's column, and idem's figure against nginx's.
    let of_nginx = |f: &dyn Fn(&Measured) -> String| nginx.map_or_else(na, f);
    let pair = |r: &Run, a: f64, b: f64| format!("{} / {}", ms(r.ms(a)), ms(r.ms(b)));
    let with_share = |r: &Run| format!("{} ({})", per_sec(r.rate()), ratio(r.rate(), d.a.rate()));

    // Target 1: closed-loop throughput.
    let share = nginx.map(|m| i.a.rate() / m.a.rate().max(f64::MIN_POSITIVE));
    let result1 = share.map_or_else(na, |s| verdict(s >= THROUGHPUT_SHARE));
    t.row([
        format!("(a) throughput, {CONNS} connections, req/s (x direct)"),
        per_sec(d.a.rate()),
        of_nginx(&|m| with_share(&m.a)),
        with_share(&i.a),
        share.map_or_else(na, |s| format!("{s:.2}x")),
        format!(">= {THROUGHPUT_SHARE}x nginx"),
        result1.clone(),
    ]);
    report::target(
        1,
        format!("throughput, unique prompts, {CONNS} connections, req/s"),
        per_sec(i.a.rate()),
        of_nginx(&|m| format!("nginx {}", per_sec(m.a.rate()))),
        format!(">= {THROUGHPUT_SHARE}x nginx"),
        share.map_or_else(na, |s| format!("{} ({s:.2}x)", result1)),
    );
    t.row([
        "(a) latency p50 / p99 at that load, ms".into(),
        pair(&d.a, 0.5, 0.99),
        of_nginx(&|m| pair(&m.a, 0.5, 0.99)),
        pair(&i.a, 0.5, 0.99),
        String::new(),
        "-".into(),
        String::new(),
    ]);

    // Target 3: CPU per request.
    let multiple = nginx.map(|m| i.cpu_us() / m.cpu_us().max(f64::MIN_POSITIVE));
    let result3 = multiple.map_or_else(na, |x| verdict(x <= CPU_MULTIPLE));
    t.row([
        "(a) CPU per request, us (mock / nginx / idem processes)".into(),
        format!("{:.1}", d.cpu_us()),
        of_nginx(&|m| format!("{:.1}", m.cpu_us())),
        format!("{:.1}", i.cpu_us()),
        multiple.map_or_else(na, |x| format!("{x:.2}x")),
        format!("<= {CPU_MULTIPLE}x nginx"),
        result3.clone(),
    ]);
    report::target(
        3,
        "CPU per request, us",
        format!("{:.1}", i.cpu_us()),
        of_nginx(&|m| format!("nginx {:.1}", m.cpu_us())),
        format!("<= {CPU_MULTIPLE}x nginx"),
        multiple.map_or_else(na, |x| format!("{result3} ({x:.2}x)")),
    );

    // Target 2: added p99 at a fixed rate.
    let rate = int(RATE.into());
    t.row([
        format!("(b) p50 / p99 at {rate} req/s, ms"),
        pair(&d.b, 0.5, 0.99),
        of_nginx(&|m| pair(&m.b, 0.5, 0.99)),
        pair(&i.b, 0.5, 0.99),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    let added = |m: &Measured| m.b.ms(0.99) - d.b.ms(0.99);
    let added_idem = added(i);
    let added_nginx = nginx.map(added);
    let pairs = paired(&d.p99s, &i.p99s);
    let noisy = too_spread(&pairs, ADDED_P99_MS);
    let met2 = added_idem <= ADDED_P99_MS
        && added_nginx.is_some_and(|a| added_idem <= a + OVER_NGINX_P99_MS);
    let target2 = format!("<= {ADDED_P99_MS} ms and <= nginx + {OVER_NGINX_P99_MS} ms");
    let result2 = if added_nginx.is_some() {
        verdict_noisy(met2, noisy)
    } else {
        format!(
            "{} (nginx n/a)",
            verdict_noisy(added_idem <= ADDED_P99_MS, noisy)
        )
    };
    t.row([
        "(b) added p99 over direct, ms".into(),
        "-".into(),
        added_nginx.map_or_else(na, plus_ms),
        plus_ms(added_idem),
        added_nginx.map_or_else(na, |a| plus_ms(added_idem - a)),
        target2.clone(),
        result2.clone(),
    ]);
    report::target(
        2,
        format!("added p99 at {rate} req/s, open loop"),
        plus_ms(added_idem),
        added_nginx.map_or_else(na, |a| format!("nginx {}", plus_ms(a))),
        target2,
        result2,
    );
    t.row([
        "(b) added p99 per round: median (min .. max)".into(),
        String::new(),
        of_nginx(&|m| spread(&paired(&d.p99s, &m.p99s))),
        spread(&pairs),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "(b) p99.9 / max, ms".into(),
        pair(&d.b, 0.999, 1.0),
        of_nginx(&|m| pair(&m.b, 0.999, 1.0)),
        pair(&i.b, 0.999, 1.0),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "(b) achieved rate, req/s".into(),
        per_sec(d.b.rate()),
        of_nginx(&|m| per_sec(m.b.rate())),
        per_sec(i.b.rate()),
        String::new(),
        rate.clone(),
        String::new(),
    ]);
    let failed = d.failed() + i.failed() + nginx.map_or(0, Measured::failed);
    t.row([
        "answers not 2xx (all runs)".into(),
        int(d.failed()),
        of_nginx(&|m| int(m.failed())),
        int(i.failed()),
        String::new(),
        "0".into(),
        verdict(failed == 0),
    ]);
    t.row([
        "upstream calls / requests".into(),
        "-".into(),
        of_nginx(&|m| format!("{} / {}", int(m.calls), int(m.requests()))),
        format!("{} / {}", int(i.calls), int(i.requests())),
        String::new(),
        "equal".into(),
        verdict(i.calls == i.requests()),
    ]);
    t.note(format!(
        "(a) closed loop: {CONNS} connections, each sends its next request when answered; \
         {rounds_a} x {secs_a} s per side"
    ));
    t.note(format!(
        "(b) open loop: {rate} req/s on a fixed timeline over {CONNS} connections, latency from the \
         scheduled send time; {rounds_b} x {secs_b} s per side"
    ));
    t.note(
        "each round rotates the order of the sides (direct, nginx, idem, idem with an Anthropic target: table 1c, \
         idem with traces: table 1d, in (a) a bare tokio/hyper proxy: table 1e, idem with budgets: table 1f); idem logs one JSON \
         line per request (its default); \
         (b) runs on fresh gateways, warmed up like (a)'s",
    );
    match &n {
        Ok((_, what)) => t.note(format!(
            "nginx: {what}; a plain reverse proxy, keepalive to the mock and to the clients, \
             no access log, a worker process per core; its CPU is the master's and the workers'"
        )),
        Err(why) => t.note(format!("nginx: n/a: {why}")),
    }
    if noisy {
        t.note(NOISY_NOTE);
    }
    let mut sides = vec![("direct", d), ("idem", i)];
    sides.extend(nginx.map(|m| ("nginx", m)));
    first_errors(&mut t, &sides);
    t
}

/// Table 1c: idem with an OpenAI target against idem with an Anthropic
/// one, on the same mock: what translating each request and answer costs.
fn translation(d: &Measured, i: &Measured, c: &Measured) -> Table {
    let mut t = beside(
        "1c. Proxy overhead with an Anthropic target (translation both ways)",
        ["OpenAI target", "Anthropic target", "Anthropic vs OpenAI"],
        (d, i, c),
        true,
    );
    t.row([
        "upstream calls / requests".into(),
        format!("{} / {}", int(i.calls), int(i.requests())),
        format!("{} / {}", int(c.calls), int(c.requests())),
        String::new(),
        "equal".into(),
        verdict(c.calls == c.requests()),
    ]);
    t.note(
        "the same rounds as table 1, a third side in each: idem in front of the mock's Anthropic \
         face (POST /v1/messages), clients still speaking chat completions",
    );
    first_errors(&mut t, &[("Anthropic target", c)]);
    t
}

/// Table 1d: idem with traces off (its default) against on.
fn tracing_cost(d: &Measured, i: &Measured, t: &Measured, exported: u64) -> Table {
    let mut table = beside(
        "1d. Proxy overhead with traces on (OTLP/HTTP to a collector)",
        ["traces off", "traces on", "on vs off"],
        (d, i, t),
        false,
    );
    table.row([
        "bytes of spans the collector received".into(),
        "-".into(),
        int(exported),
        String::new(),
        "> 0".into(),
        verdict(exported > 0),
    ]);
    table.note(
        "the same rounds as table 1, a fourth side in each: idem exporting a span per request, \
         its cache lookup and its provider call to a collector in the bench's process",
    );
    first_errors(&mut table, &[("traces on", t)]);
    table
}

/// A side `x` beside idem's own (`i`), both against the mock directly
/// (`d`): throughput, CPU per request, added p99 (held to the target when
/// `p99_target`), and answers that were no 2xx.
fn beside(
    title: &str,
    [label_i, label_x, versus]: [&str; 3],
    (d, i, x): (&Measured, &Measured, &Measured),
    p99_target: bool,
) -> Table {
    let mut t = Table::new(
        title,
        &["figure", label_i, label_x, versus, "target", "result"],
    );
    t.row([
        format!("(a) throughput, {CONNS} connections, req/s (x direct)"),
        format!(
            "{} ({})",
            per_sec(i.a.rate()),
            ratio(i.a.rate(), d.a.rate())
        ),
        format!(
            "{} ({})",
            per_sec(x.a.rate()),
            ratio(x.a.rate(), d.a.rate())
        ),
        ratio(x.a.rate(), i.a.rate()),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "(a) CPU per request of the idem process, us".into(),
        format!("{:.1}", i.cpu_us()),
        format!("{:.1}", x.cpu_us()),
        format!("{:+.1}", x.cpu_us() - i.cpu_us()),
        "-".into(),
        String::new(),
    ]);
    let (added_i, added_x) = (i.b.ms(0.99) - d.b.ms(0.99), x.b.ms(0.99) - d.b.ms(0.99));
    let pairs = paired(&d.p99s, &x.p99s);
    let noisy = p99_target && too_spread(&pairs, ADDED_P99_MS);
    let (target, result) = if p99_target {
        (
            format!("added < {ADDED_P99_MS} ms"),
            verdict_noisy(added_x < ADDED_P99_MS, noisy),
        )
    } else {
        ("-".into(), String::new())
    };
    t.row([
        format!(
            "(b) added p99 over direct at {} req/s, ms",
            int(RATE.into())
        ),
        plus_ms(added_i),
        plus_ms(added_x),
        plus_ms(added_x - added_i),
        target,
        result,
    ]);
    t.row([
        "(b) added p99 per round: median (min .. max)".into(),
        spread(&paired(&d.p99s, &i.p99s)),
        spread(&pairs),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "answers not 2xx (all runs)".into(),
        int(i.failed()),
        int(x.failed()),
        String::new(),
        "0".into(),
        verdict(x.failed() == 0),
    ]);
    if noisy {
        t.note(NOISY_NOTE);
    }
    t
}

/// Per-round p99s of two sides, paired round by round.
fn paired(a: &[f64], b: &[f64]) -> Vec<(f64, f64)> {
    a.iter().copied().zip(b.iter().copied()).collect()
}

fn first_errors(t: &mut Table, sides: &[(&str, &Measured)]) {
    for (label, m) in sides {
        for run in [&m.a, &m.b] {
            if let Some(e) = &run.first_error {
                t.note(format!("first error ({label}): {e}"));
            }
        }
    }
}
