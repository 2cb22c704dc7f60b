//! Table 5: an embeddings re-index through idem. A corpus of chunks, some
//! of them repeated, goes to `POST /v1/embeddings` in batches from a few
//! concurrent clients: once to the mock directly (before and after idem's
//! run, so that a change in the machine's other work weighs on the baseline
//! as on idem), once through idem, where each item is its own task. The
//! mock's stats say how many items reached it: exactly the unique ones is
//! the target.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::Settings;
use crate::http::{Conn, Endpoint};
use crate::load::{self, Maker, Run};
use crate::procs::{Embedded, Gateway, GatewaySpec, KEY, MODEL, Mock, Proc, Workdir};
use crate::report::{self, Table, int, mib, ms, per_sec, ratio, verdict};

/// Concurrent clients (connections of the closed loop).
const CLIENTS: usize = 16;
/// Items per request.
const BATCH: usize = 64;
/// Share of the items that repeat an earlier chunk, in percent.
const REPEATED_PERCENT: usize = 30;
/// A repeat of a recent chunk picks one of the last this many unique
/// chunks: about what `CLIENTS` x `BATCH` items have in flight.
const RECENT: usize = CLIENTS * BATCH;
/// Chunk lengths, in characters.
const CHUNK_CHARS: std::ops::RangeInclusive<usize> = 200..=800;
/// The route's cache TTL: long enough to span the run (idem's default, 30
/// s, would let early chunks expire before their repeats come).
const CACHE_TTL: &str = "10m";
/// Batches re-sent after the run, whose vectors are checked.
const CHECKED_BATCHES: usize = 16;
/// The workload's seed: every run sends the same chunks in the same order.
const SEED: u64 = 5;

/// Outcomes of items, in the order the table lists them.
const OUTCOMES: [&str; 5] = ["leader", "bypass", "follower", "cache-hit", "negative-hit"];

const WORDS: [&str; 48] = [
    "the", "gateway", "request", "answer", "provider", "cache", "flight", "leader", "follower",
    "tenant", "route", "target", "token", "vector", "index", "document", "section", "retry",
    "timeout", "latency", "budget", "policy", "contract", "schema", "replica", "storage", "queue",
    "worker", "stream", "batch", "item", "call", "and", "of", "to", "in", "is", "with", "for",
    "each", "every", "once", "when", "after", "before", "which", "not", "its",
];

/// The re-index: unique chunks, the order the items go in, the requests.
struct Workload {
    chunks: Vec<String>,
    /// The chunk of each item, in sending order.
    order: Vec<usize>,
    /// One request body per batch of `BATCH` consecutive items.
    bodies: Arc<Vec<Bytes>>,
    /// Repeats whose chunk is already in the same batch.
    repeats_in_batch: usize,
}

impl Workload {
    /// `items` items of which `REPEATED_PERCENT` % repeat an earlier chunk:
    /// half of the repeats one of the last `RECENT` unique chunks (still in
    /// flight, or just answered), half any earlier chunk.
    fn new(items: usize) -> anyhow::Result<Workload> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
        let repeats = items * REPEATED_PERCENT / 100;
        // The first item is new; the repeats fall anywhere after it.
        let mut is_repeat = vec![false; items.saturating_sub(1)];
        for r in is_repeat.iter_mut().take(repeats) {
            *r = true;
        }
        is_repeat.shuffle(&mut rng);
        let mut chunks: Vec<String> = Vec::with_capacity(items - repeats);
        let mut order = Vec::with_capacity(items);
        for repeat in std::iter::once(false).chain(is_repeat) {
            if repeat {
                let n = chunks.len();
                let pick = if rng.random_bool(0.5) {
                    rng.random_range(n.saturating_sub(RECENT)..n)
                } else {
                    rng.random_range(0..n)
                };
                order.push(pick);
            } else {
                order.push(chunks.len());
                chunks.push(chunk(chunks.len(), &mut rng));
            }
        }
        let mut repeats_in_batch = 0;
        let mut bodies = Vec::with_capacity(items.div_ceil(BATCH));
        for batch in order.chunks(BATCH) {
            let mut seen = std::collections::HashSet::new();
            repeats_in_batch += batch.iter().filter(|&&c| !seen.insert(c)).count();
            let input: Vec<&str> = batch.iter().map(|&c| chunks[c].as_str()).collect();
            bodies.push(Bytes::from(serde_json::to_vec(
                &json!({"model": MODEL, "input": input}),
            )?));
        }
        Ok(Workload {
            chunks,
            order,
            bodies: Arc::new(bodies),
            repeats_in_batch,
        })
    }

    fn items(&self) -> u64 {
        self.order.len() as u64
    }

    fn unique(&self) -> u64 {
        self.chunks.len() as u64
    }

    fn batches(&self) -> u64 {
        self.bodies.len() as u64
    }

    /// Batch `i` of the workload, to `endpoint`.
    fn maker(&self, endpoint: &Endpoint) -> Maker {
        let (endpoint, bodies) = (endpoint.clone(), Arc::clone(&self.bodies));
        Arc::new(move |i| {
            let body = usize::try_from(i)
                .ok()
                .and_then(|i| bodies.get(i))
                .map_or(&[][..], |b| &b[..]);
            endpoint.post("/v1/embeddings", &[], body)
        })
    }
}

/// Chunk number `n`: a heading, then words up to a length in `CHUNK_CHARS`.
fn chunk(n: usize, rng: &mut impl Rng) -> String {
    let len = rng.random_range(CHUNK_CHARS);
    let mut text = format!("Section {n}.");
    while text.len() < len {
        text.push(' ');
        text.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    // ASCII: any length is a character boundary.
    text.truncate(len);
    text
}

/// Batch `i` of the warm-up: unique chunks no run sends, to `endpoint`.
fn warm_up(endpoint: &Endpoint, tag: &str) -> Maker {
    let (endpoint, tag) = (endpoint.clone(), tag.to_string());
    Arc::new(move |i| {
        let input: Vec<String> = (0..BATCH)
            .map(|k| format!("warm-up {tag} {i} {k}: the gateway embeds each item once"))
            .collect();
        let body = json!({"model": MODEL, "input": input}).to_string();
        endpoint.post("/v1/embeddings", &[], body.as_bytes())
    })
}

/// What one side of the table spent on one run.
struct Side {
    run: Run,
    /// CPU of the measured process (the mock direct, idem through it).
    cpu: Duration,
}

/// Items answered per second (each run sends the whole workload: its 2xx
/// answers per second times the items per batch).
fn items_per_sec(run: &Run, w: &Workload) -> f64 {
    run.rate() * w.items() as f64 / w.batches().max(1) as f64
}

/// The whole workload to `endpoint`, and the CPU `process` spent on it.
async fn measured(w: &Workload, endpoint: &Endpoint, process: &Proc) -> anyhow::Result<Side> {
    let before = process.cpu()?;
    let run = load::closed_count(endpoint.addr, CLIENTS, w.batches(), w.maker(endpoint)).await?;
    Ok(Side {
        run,
        cpu: process.cpu()?.saturating_sub(before),
    })
}

pub async fn run(s: Arc<Settings>) -> anyhow::Result<Table> {
    let items = s.pick(10_000, 100_000);
    let warm_batches = s.pick(16, 64);
    let w = Workload::new(items)?;

    let dir = Workdir::new("embeddings")?;
    let mock = Mock::start(&dir, "mock", &[]).await?;
    let mut spec = GatewaySpec::new(&mock, &dir);
    spec.embeddings = true;
    spec.cache_ttl = Some(CACHE_TTL);
    let gateway = Gateway::start(&dir, "idem", &spec).await?;
    let direct = Endpoint::new(mock.addr, Some(KEY));
    let idem = Endpoint::new(gateway.addr, Some(KEY));

    // Warm-up: connection pools, allocator, the route's latency tracker.
    load::closed_count(direct.addr, CLIENTS, warm_batches, warm_up(&direct, "d")).await?;
    load::closed_count(idem.addr, CLIENTS, warm_batches, warm_up(&idem, "i")).await?;

    let direct_before = mock.embeddings().await?;
    let first = measured(&w, &direct, &mock.proc).await?;
    let direct_upstream = mock.embeddings().await? - direct_before;

    let mem_before = gateway.proc.mem()?;
    let (upstream_before, stats_before) = (mock.embeddings().await?, items_sent(&gateway).await?);
    let outcomes_before = item_outcomes(&gateway).await?;
    let mock_cpu_before = mock.proc.cpu()?;
    let through = measured(&w, &idem, &gateway.proc).await?;
    let mock_cpu_meanwhile = mock.proc.cpu()?.saturating_sub(mock_cpu_before);
    let upstream: Embedded = mock.embeddings().await? - upstream_before;
    let counted = items_sent(&gateway).await?.saturating_sub(stats_before);
    let mut outcomes = item_outcomes(&gateway).await?;
    for (outcome, n) in &mut outcomes {
        let before = outcomes_before
            .iter()
            .find(|(o, _)| o == outcome)
            .map_or(0, |(_, b)| *b);
        *n = n.saturating_sub(before);
    }
    outcomes.retain(|(_, n)| *n > 0);
    let rank = |o: &str| {
        OUTCOMES
            .iter()
            .position(|k| *k == o)
            .unwrap_or(OUTCOMES.len())
    };
    outcomes.sort_by_key(|(o, _)| rank(o));
    let mem_after = gateway.proc.mem()?;

    let second = measured(&w, &direct, &mock.proc).await?;
    let check = check_answers(&w, &idem, &mock).await;

    // The baseline: both direct runs together.
    let (first_rate, second_rate) = (
        items_per_sec(&first.run, &w),
        items_per_sec(&second.run, &w),
    );
    let mut baseline = Side {
        run: Run::new()?,
        cpu: first.cpu + second.cpu,
    };
    baseline.run.absorb(first.run)?;
    baseline.run.absorb(second.run)?;
    let direct_items = 2 * w.items();

    let mut t = Table::new(
        format!(
            "5. Embeddings re-index: {} chunks, {REPEATED_PERCENT} % repeated, batches of {BATCH}, \
             {CLIENTS} clients (closed loop)",
            int(w.items())
        ),
        &[
            "figure",
            "mock direct",
            "through idem",
            "idem vs direct",
            "target",
            "result",
        ],
    );
    let base_rate = items_per_sec(&baseline.run, &w);
    let idem_rate = items_per_sec(&through.run, &w);
    t.row([
        "throughput, items/s".into(),
        per_sec(base_rate),
        per_sec(idem_rate),
        ratio(idem_rate, base_rate),
        "-".into(),
        String::new(),
    ]);
    let pair = |r: &Run| format!("{} / {}", ms(r.ms(0.5)), ms(r.ms(0.99)));
    t.row([
        "latency of a batch p50 / p99, ms".into(),
        pair(&baseline.run),
        pair(&through.run),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    let per_item = |cpu: Duration, n: u64| cpu.as_secs_f64() * 1e6 / n.max(1) as f64;
    let (mock_us, idem_us) = (
        per_item(baseline.cpu, direct_items),
        per_item(through.cpu, w.items()),
    );
    t.row([
        "CPU per item, us (mock / idem process)".into(),
        format!("{mock_us:.1}"),
        format!("{idem_us:.1}"),
        ratio(idem_us, mock_us),
        "-".into(),
        String::new(),
    ]);
    let sent_unique = upstream.items == w.unique();
    report::target(
        5,
        "embeddings: CPU per item, us",
        format!("{idem_us:.1}"),
        format!("mock {mock_us:.1}; a chat request: target 3"),
        "printed",
        "-",
    );
    report::target(
        5,
        "embeddings: items sent upstream / unique",
        format!("{} / {}", int(upstream.items), int(w.unique())),
        String::new(),
        "sent = unique",
        verdict(sent_unique),
    );
    t.row([
        "upstream items sent / unique items".into(),
        format!("{} / {}", int(direct_upstream.items), int(w.unique())),
        format!("{} / {}", int(upstream.items), int(w.unique())),
        String::new(),
        "sent = unique".into(),
        verdict(sent_unique),
    ]);
    t.row([
        "items sent by idem's own count (/v1/stats)".into(),
        "-".into(),
        int(counted),
        String::new(),
        "= upstream items".into(),
        verdict(counted == upstream.items),
    ]);
    let per_call = |items: u64, calls: u64| {
        if calls > 0 {
            format!("{:.1}", items as f64 / calls as f64)
        } else {
            "-".into()
        }
    };
    t.row([
        "upstream calls (items per call)".into(),
        format!(
            "{} ({})",
            int(direct_upstream.calls),
            per_call(direct_upstream.items, direct_upstream.calls)
        ),
        format!(
            "{} ({})",
            int(upstream.calls),
            per_call(upstream.items, upstream.calls)
        ),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "resident memory after the run (idem: before it)".into(),
        mib(mock.proc.mem()?.rss_kib),
        format!("{} ({})", mib(mem_after.rss_kib), mib(mem_before.rss_kib)),
        String::new(),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "answers not 2xx".into(),
        int(baseline.run.failed()),
        int(through.run.failed()),
        String::new(),
        "0".into(),
        verdict(baseline.run.failed() + through.run.failed() == 0),
    ]);
    let label = format!("{CHECKED_BATCHES} batches re-sent after the run: vectors, outcome");
    match check {
        Ok(found) => t.row([
            label,
            "-".into(),
            found.clone(),
            String::new(),
            "each its item's, cache-hit".into(),
            verdict(found == "right, cache-hit"),
        ]),
        Err(e) => t.na(&label, &format!("{e:#}")),
    }
    t.note(format!(
        "the workload: {} chunks of {}-{} characters (seeded), {} of them unique; each repeat is \
         one of the last {} unique chunks (still in flight, or just answered) or any earlier \
         one, half and half; {} repeats fall in their own batch; {} batches sent in order, each \
         client taking the next when answered",
        int(w.items()),
        CHUNK_CHARS.start(),
        CHUNK_CHARS.end(),
        int(w.unique()),
        int(RECENT as u64),
        int(w.repeats_in_batch as u64),
        int(w.batches()),
    ));
    t.note(format!(
        "the route: endpoints = [\"chat\", \"embeddings\"], cache.ttl = \"{CACHE_TTL}\" (idem's \
         default, 30 s, would expire early chunks before their repeats), followers may wait 120 \
         s as in every table, the rest idem's defaults (the cache's bounds, 100,000 entries and \
         256 MiB, have room for the unique items); `dimensions` the mock's default (8), floats"
    ));
    t.note(format!(
        "mock direct: a run before and one after idem's ({} and {} items/s), CPU of the mock's \
         process; through idem: idem's process (the mock meanwhile: {:.1} us per item it \
         embedded)",
        per_sec(first_rate),
        per_sec(second_rate),
        per_item(mock_cpu_meanwhile, upstream.items),
    ));
    t.note(format!(
        "idem answered the items: {} (leader: sent upstream; follower: joined a call in flight; \
         cache-hit: from the result cache)",
        outcomes
            .iter()
            .map(|(o, n)| format!("{o} {}", int(*n)))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    for (label, run) in [("direct", &baseline.run), ("idem", &through.run)] {
        if let Some(e) = &run.first_error {
            t.note(format!("first error ({label}): {e}"));
        }
    }
    Ok(t)
}

/// `embedding_items_sent` from idem's `/v1/stats`.
async fn items_sent(gateway: &Gateway) -> anyhow::Result<u64> {
    gateway.stats().await?["coalescing"]["embedding_items_sent"]
        .as_u64()
        .context("no `coalescing.embedding_items_sent` in /v1/stats")
}

/// `idem_embedding_items_total` by outcome (summed over routes), from
/// idem's `/metrics`.
async fn item_outcomes(gateway: &Gateway) -> anyhow::Result<Vec<(String, u64)>> {
    let text = gateway.metrics().await?;
    let mut out: Vec<(String, u64)> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("idem_embedding_items_total{") else {
            continue;
        };
        let (labels, value) = rest.rsplit_once('}').context("a metric line without `}`")?;
        let outcome = labels
            .split(',')
            .find_map(|l| l.strip_prefix("outcome="))
            .map(|o| o.trim_matches('"').to_string())
            .context("idem_embedding_items_total without an outcome")?;
        let n = value.trim().parse::<f64>().context("a metric value")? as u64;
        match out.iter_mut().find(|(o, _)| *o == outcome) {
            Some((_, total)) => *total += n,
            None => out.push((outcome, n)),
        }
    }
    Ok(out)
}

/// Re-sends `CHECKED_BATCHES` batches spread over the workload through
/// idem: every vector must be its own item's (as the mock computes it), and
/// nothing may reach the mock (every item is cached). `right, cache-hit`
/// when so, else what was wrong.
async fn check_answers(w: &Workload, idem: &Endpoint, mock: &Mock) -> anyhow::Result<String> {
    let before = mock.embeddings().await?;
    let mut conn = Conn::connect(idem.addr).await?;
    let step = (w.bodies.len() / CHECKED_BATCHES).max(1);
    let mut problems = Vec::new();
    for b in (0..w.bodies.len()).step_by(step).take(CHECKED_BATCHES) {
        let reply = conn
            .call(&idem.post("/v1/embeddings", &[], &w.bodies[b]))
            .await?;
        if reply.status != 200 {
            bail!("batch {b}: status {}", reply.status);
        }
        if reply.outcome.as_deref() != Some("cache-hit") {
            problems.push(format!(
                "batch {b} {}",
                reply.outcome.as_deref().unwrap_or("(no outcome)")
            ));
        }
        let answer: Value =
            serde_json::from_slice(&reply.body).with_context(|| format!("batch {b}: not JSON"))?;
        let items = &w.order[b * BATCH..w.order.len().min((b + 1) * BATCH)];
        let data = answer["data"].as_array().map_or(&[][..], Vec::as_slice);
        if data.len() != items.len() {
            problems.push(format!(
                "batch {b}: {} vectors for {} items",
                data.len(),
                items.len()
            ));
            continue;
        }
        let wrong = items.iter().zip(data).filter(|&(&c, got)| {
            let want = idem::mock_upstream::embedding_of(
                &Value::String(w.chunks[c].clone()),
                idem::mock_upstream::DEFAULT_DIMENSIONS,
            );
            let got: Option<Vec<f32>> = got["embedding"].as_array().map(|v| {
                v.iter()
                    .filter_map(Value::as_f64)
                    .map(|x| x as f32)
                    .collect()
            });
            got.as_deref() != Some(&want[..])
        });
        let wrong = wrong.count();
        if wrong > 0 {
            problems.push(format!("batch {b}: {wrong} wrong vectors"));
        }
    }
    let reached = mock.embeddings().await? - before;
    if reached.items > 0 {
        problems.push(format!("{} items reached the mock", int(reached.items)));
    }
    Ok(if problems.is_empty() {
        "right, cache-hit".into()
    } else {
        crate::procs::shorten(&problems.join("; "), 120)
    })
}
