//! Table 6: the Batch API. An earlier batch answers a tenth of the lines'
//! prompts; then a batch of 50,000 lines of which 30 % repeat lines of the
//! same batch and 10 % repeat lines of the earlier one goes through idem
//! (upload, create, poll to `completed`, download). Upstream calls must be
//! the new unique lines exactly; every output line is checked against its
//! `custom_id`; the gateway's peak resident memory is printed. The
//! baseline: the same unique prompts sent straight to the mock, at the
//! route's batch concurrency, in the same run. Live chat completions (on
//! a route of their own, another mock) run before the batch and while it
//! runs: their added p99 says what the batch costs live traffic.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::Settings;
use crate::http::Endpoint;
use crate::load::{self, Maker};
use crate::procs::{Gateway, GatewaySpec, JOBS_MODEL, KEY, Mock, Workdir};
use crate::report::{self, Table, int, mib, per_sec, plus_ms, ratio, verdict};

/// Lines repeating a line of the same batch, in percent.
const SAME_BATCH_PERCENT: usize = 30;
/// Lines repeating a line of the earlier batch, in percent.
const EARLIER_PERCENT: usize = 10;
/// The route's `batch.concurrency` (idem's default), also the baseline's
/// connections.
const CONCURRENCY: usize = 8;
/// The peak resident memory the issue allows, MiB.
const MEMORY_MIB: u64 = 200;
const SEED: u64 = 6;
/// The live chats' rate, requests/s, and their connections.
const CHAT_RATE: u32 = 500;
const CHAT_CONNS: usize = 8;
const BOUNDARY: &str = "idem-bench-boundary-6";

/// The two batches' lines: each a custom_id and its prompt.
struct Workload {
    earlier: Vec<(String, String)>,
    lines: Vec<(String, String)>,
    /// Prompts of `lines` that neither an earlier line of it nor the
    /// earlier batch has: what must reach the provider.
    new_unique: usize,
}

impl Workload {
    fn new(n: usize) -> Workload {
        let mut rng = rand::rngs::StdRng::seed_from_u64(SEED);
        let earlier_n = n * EARLIER_PERCENT / 100;
        let same_n = n * SAME_BATCH_PERCENT / 100;
        let new_unique = n - earlier_n - same_n;
        let prompt =
            |tag: &str, i: usize| format!("{tag} ticket {i}: classify this support request");
        let earlier: Vec<(String, String)> = (0..earlier_n)
            .map(|i| (format!("e-{i}"), prompt("earlier", i)))
            .collect();
        // The kinds of line in a shuffled order; a repeat of the same batch
        // repeats a new line already placed (the first line is new).
        let mut kinds: Vec<u8> = std::iter::repeat_n(0u8, new_unique - 1)
            .chain(std::iter::repeat_n(1, earlier_n))
            .chain(std::iter::repeat_n(2, same_n))
            .collect();
        kinds.shuffle(&mut rng);
        let (mut placed, mut next_earlier, mut lines) = (Vec::new(), 0, Vec::with_capacity(n));
        for kind in std::iter::once(0).chain(kinds) {
            let text = match kind {
                1 => {
                    next_earlier += 1;
                    earlier[next_earlier - 1].1.clone()
                }
                2 if !placed.is_empty() => {
                    let i: usize = placed[rng.random_range(0..placed.len())];
                    prompt("new", i)
                }
                _ => {
                    placed.push(placed.len());
                    prompt("new", placed.len() - 1)
                }
            };
            lines.push((format!("l-{}", lines.len()), text));
        }
        Workload {
            earlier,
            new_unique: placed.len(),
            lines,
        }
    }
}

/// A batch input file's bytes.
fn jsonl(lines: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (id, prompt) in lines {
        let line = json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": JOBS_MODEL, "messages": [{"role": "user", "content": prompt}]}});
        out.extend_from_slice(line.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

/// The gateway's HTTP API, as a client of the Batch API uses it.
struct Api {
    base: String,
    client: reqwest::Client,
}

impl Api {
    async fn upload(&self, content: Vec<u8>) -> anyhow::Result<String> {
        let mut body = format!(
            "--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n\
             --{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n\
             content-type: application/jsonl\r\n\r\n"
        )
        .into_bytes();
        body.extend_from_slice(&content);
        body.extend_from_slice(format!("\r\n--{BOUNDARY}--\r\n").as_bytes());
        let v: Value = self
            .client
            .post(format!("{}/v1/files", self.base))
            .bearer_auth(KEY)
            .header(
                "content-type",
                format!("multipart/form-data; boundary={BOUNDARY}"),
            )
            .body(body)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        v["id"]
            .as_str()
            .map(str::to_string)
            .context("the file's id")
    }

    async fn batch(&self, file: &str) -> anyhow::Result<String> {
        let v: Value = self
            .client
            .post(format!("{}/v1/batches", self.base))
            .bearer_auth(KEY)
            .json(
                &json!({"input_file_id": file, "endpoint": "/v1/chat/completions",
                          "completion_window": "24h"}),
            )
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        v["id"]
            .as_str()
            .map(str::to_string)
            .context("the batch's id")
    }

    /// Polls the batch until it has ended.
    async fn until_ended(&self, id: &str, limit: Duration) -> anyhow::Result<Value> {
        let deadline = Instant::now() + limit;
        loop {
            let b: Value = self
                .client
                .get(format!("{}/v1/batches/{id}", self.base))
                .bearer_auth(KEY)
                .send()
                .await?
                .error_for_status()?
                .json()
                .await?;
            match b["status"].as_str() {
                Some("completed") => return Ok(b),
                Some("failed" | "expired" | "cancelled") => bail!("batch {id} ended: {b}"),
                _ if Instant::now() > deadline => bail!("batch {id} not done in {limit:?}: {b}"),
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    async fn content(&self, file: &str) -> anyhow::Result<String> {
        Ok(self
            .client
            .get(format!("{}/v1/files/{file}/content", self.base))
            .bearer_auth(KEY)
            .send()
            .await?
            .error_for_status()?
            .text()
            .await?)
    }
}

/// Whether every line of `lines` is in the output once, answered for its
/// own prompt (the mock echoes it): the lines wrong, or missing.
fn check_output(lines: &[(String, String)], output: &str) -> (u64, u64) {
    let want: HashMap<&str, &str> = lines
        .iter()
        .map(|(i, p)| (i.as_str(), p.as_str()))
        .collect();
    let mut seen = HashMap::with_capacity(lines.len());
    let mut wrong = 0;
    for l in output.lines() {
        let Ok(v) = serde_json::from_str::<Value>(l) else {
            wrong += 1;
            continue;
        };
        let id = v["custom_id"].as_str().unwrap_or_default().to_string();
        let text = v["response"]["body"]["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default();
        let right = want.get(id.as_str()).is_some_and(|p| text.contains(p))
            && v["response"]["status_code"] == 200;
        if !right || seen.insert(id, ()).is_some() {
            wrong += 1;
        }
    }
    let missing = lines.len().saturating_sub(seen.len()) as u64;
    (wrong, missing)
}

/// The baseline: `n` unique prompts straight to the mock, `CONCURRENCY`
/// at a time.
fn direct(endpoint: &Endpoint) -> Maker {
    load::unique_chats(endpoint)
}

pub async fn run(s: Arc<Settings>) -> anyhow::Result<Table> {
    let n = s.pick(5_000, 50_000);
    let w = Workload::new(n);
    let dir = Workdir::new("batches")?;
    // The batch's lines go to `mock` (the route JOBS_MODEL); live chats to
    // `live`, so each mock counts its own calls.
    let mock = Mock::start(&dir, "mock", &[]).await?;
    let live = Mock::start(&dir, "live", &[]).await?;
    let mut spec = GatewaySpec::new(&live, &dir);
    spec.jobs_upstream = Some(mock.base_url());
    let gateway = Gateway::start(&dir, "idem", &spec).await?;
    let chat_secs = Duration::from_secs_f64(s.pick(1.0, 3.0));
    let chats = |addr| {
        let endpoint = Endpoint::new(addr, Some(KEY));
        load::open(
            addr,
            CHAT_RATE,
            chat_secs,
            CHAT_CONNS,
            load::unique_chats(&endpoint),
        )
    };
    let api = Api {
        base: format!("http://{}", gateway.addr),
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(300))
            .build()?,
    };
    let limit = Duration::from_secs(s.pick(300, 1800));

    // The earlier batch.
    let file = api.upload(jsonl(&w.earlier)).await?;
    let earlier = api.batch(&file).await?;
    api.until_ended(&earlier, limit).await?;

    // Live chats: the mock directly, then through idem, before the batch.
    let direct_p99 = chats(live.addr).await?.ms(0.99);
    let idle_p99 = chats(gateway.addr).await?.ms(0.99);

    // The batch measured: from the upload to its output read; the live
    // chats again a moment after it starts (it runs for longer).
    let calls_before = mock.calls().await?;
    let cpu_before = gateway.proc.cpu()?;
    let started = Instant::now();
    let measured = async {
        let file = api.upload(jsonl(&w.lines)).await?;
        let id = api.batch(&file).await?;
        let b = api.until_ended(&id, limit).await?;
        let output = api
            .content(b["output_file_id"].as_str().context("no output file")?)
            .await?;
        anyhow::Ok((b, output, started.elapsed()))
    };
    let (measured, busy) = tokio::join!(measured, async {
        tokio::time::sleep(Duration::from_secs(2)).await;
        chats(gateway.addr).await
    });
    let (b, output, took) = measured?;
    let busy = busy?;
    let cpu = gateway.proc.cpu()?.saturating_sub(cpu_before);
    let calls = mock.calls().await? - calls_before;
    let mem = gateway.proc.mem()?;
    let (wrong, missing) = check_output(&w.lines, &output);
    drop(output);

    // The baseline, the same run: the new unique prompts to the mock.
    let endpoint = Endpoint::new(mock.addr, Some(KEY));
    let base = load::closed_count(
        mock.addr,
        CONCURRENCY,
        w.new_unique as u64,
        direct(&endpoint),
    )
    .await?;

    let lines_per_sec = n as f64 / took.as_secs_f64();
    let mut t = Table::new(
        format!(
            "6. Batch API: {} lines, {SAME_BATCH_PERCENT} % repeating the batch, \
             {EARLIER_PERCENT} % an earlier batch ({} lines); batch.concurrency {CONCURRENCY}",
            int(n as u64),
            int(w.earlier.len() as u64)
        ),
        &["figure", "baseline", "through idem", "target", "result"],
    );
    let sent_unique = calls == w.new_unique as u64;
    t.row([
        "upstream calls / new unique lines".into(),
        format!("{} sent direct", int(base.sent())),
        format!("{} / {}", int(calls), int(w.new_unique as u64)),
        "calls = unique".into(),
        verdict(sent_unique),
    ]);
    report::target(
        7,
        "batch: upstream calls / new unique lines",
        format!("{} / {}", int(calls), int(w.new_unique as u64)),
        String::new(),
        "calls = unique",
        verdict(sent_unique),
    );
    let idem = &b["idem"];
    t.row([
        "lines answered without a call (same batch / earlier)".into(),
        "-".into(),
        format!(
            "{} / {}",
            int(idem["deduplicated"].as_u64().unwrap_or(0)),
            int(idem["reused"].as_u64().unwrap_or(0))
        ),
        format!(
            "{} / {}",
            int((n - w.new_unique - w.earlier.len()) as u64),
            int(w.earlier.len() as u64)
        ),
        verdict(
            idem["deduplicated"].as_u64() == Some((n - w.new_unique - w.earlier.len()) as u64)
                && idem["reused"].as_u64() == Some(w.earlier.len() as u64),
        ),
    ]);
    t.row([
        "output lines wrong / missing".into(),
        "-".into(),
        format!("{} / {}", int(wrong), int(missing)),
        "0 / 0".into(),
        verdict(wrong == 0 && missing == 0),
    ]);
    let base_rate = base.rate();
    t.row([
        "lines/s (upload to output read; baseline: unique calls/s)".into(),
        per_sec(base_rate),
        format!(
            "{} ({})",
            per_sec(lines_per_sec),
            ratio(lines_per_sec, base_rate)
        ),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "time, s".into(),
        format!("{:.1}", base.elapsed.as_secs_f64()),
        format!("{:.1}", took.as_secs_f64()),
        "-".into(),
        String::new(),
    ]);
    t.row([
        "idem's CPU per line, us".into(),
        "-".into(),
        format!("{:.0}", cpu.as_secs_f64() * 1e6 / n as f64),
        "-".into(),
        String::new(),
    ]);
    t.row([
        format!("live chats' added p99 at {CHAT_RATE}/s: before the batch / while it runs"),
        format!("the mock directly {:.2} ms", direct_p99),
        format!(
            "{} / {}",
            plus_ms(idle_p99 - direct_p99),
            plus_ms(busy.ms(0.99) - direct_p99)
        ),
        "printed".into(),
        String::new(),
    ]);
    let under = mem.hwm_kib < MEMORY_MIB * 1024;
    t.row([
        "idem's peak resident memory (after the batch)".into(),
        "-".into(),
        format!("{} ({})", mib(mem.hwm_kib), mib(mem.rss_kib)),
        format!("< {MEMORY_MIB} MiB"),
        verdict(under),
    ]);
    report::target(
        7,
        "batch: idem's peak resident memory",
        mib(mem.hwm_kib),
        String::new(),
        format!("< {MEMORY_MIB} MiB"),
        verdict(under),
    );
    t.note(format!(
        "the embedded default store (SQLite); the route's batch.concurrency {CONCURRENCY} lines \
         in flight, each a job of jobs.workers (16); the baseline is {} unique prompts straight \
         to the mock over {CONCURRENCY} connections; the live chats go to a route and mock of \
         their own, {CHAT_CONNS} connections, open loop",
        int(w.new_unique as u64)
    ));
    Ok(t)
}
