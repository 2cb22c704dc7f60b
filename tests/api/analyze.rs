//! The request log as a gateway writes it, and `idem analyze` over it: a
//! seeded 100,000-request log of known duplicate structure whose figures
//! are known exactly, and the real gateway's file and stdout logs read back
//! by the real binary.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use idem::analyze::report::Verdict;
use idem::analyze::{Options, RawRules, Report, ReportOptions, Wait, analyze_files};
use idem::app::App;
use idem::config::{Config, Source};
use idem::fingerprint::Fingerprint;
use idem::http::AppState;
use idem::mock_upstream::Behaviour;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::helpers::*;

const MS: u64 = 1;
const S: u64 = 1000;

/// A request-log line at `t_ms` (milliseconds after 2025-03-01T00:00:00Z).
fn line(t_ms: u64, tenant: &str, fp: &Fingerprint, outcome: &str, upstream_ms: u64) -> String {
    let t = humantime::parse_rfc3339("2025-03-01T00:00:00Z").unwrap() + Duration::from_millis(t_ms);
    json!({
        "time": humantime::format_rfc3339_millis(t).to_string(),
        "tenant": tenant,
        "route": "bot",
        "fingerprint": fp.to_string(),
        "outcome": outcome,
        "status": 200,
        "latency_ms": 1.0,
        "upstream_ms": upstream_ms as f64,
        "prompt_tokens": 10,
        "completion_tokens": 20,
    })
    .to_string()
}

/// The seeded log: 100,000 requests in shuffled order.
///
/// - 400 bursts of 40 identical requests, 10 ms apart; the leader's call
///   takes 500 ms;
/// - 1,000 waves of 10 identical requests, 20 s apart; calls take 100 ms;
/// - 500 fingerprints sent once by tenant `acme` and once by `beta` at the
///   same instant (two tasks each, never one);
/// - 73,000 one-off requests; calls take 100, 200, ... or 1,000 ms.
///
/// Groups: 400 + 1,000 + 1,000 + 73,000 = 75,400, so 24,600 requests
/// (24.6 %) repeat an earlier one. Gaps between repeats: 15,600 of 10 ms,
/// 9,000 of 20 s.
fn seeded_log(path: &Path) {
    let mut rng = StdRng::seed_from_u64(0x1de5);
    let mut next_fp = {
        let mut n = 0u64;
        move || {
            n += 1;
            let mut b = [0u8; 32];
            b[..8].copy_from_slice(&n.to_le_bytes());
            Fingerprint::from_bytes(*blake3::hash(&b).as_bytes())
        }
    };
    let start = |rng: &mut StdRng| rng.random_range(0..86_400 * S);
    let mut lines = Vec::with_capacity(100_000);
    for _ in 0..400 {
        let (fp, t0) = (next_fp(), start(&mut rng));
        for j in 0..40 {
            let outcome = if j == 0 { "leader" } else { "follower" };
            lines.push(line(t0 + j * 10 * MS, "acme", &fp, outcome, 500));
        }
    }
    for _ in 0..1000 {
        let (fp, t0) = (next_fp(), start(&mut rng));
        for j in 0..10 {
            let outcome = if j % 2 == 0 { "leader" } else { "cache-hit" };
            lines.push(line(t0 + j * 20 * S, "beta", &fp, outcome, 100));
        }
    }
    for _ in 0..500 {
        let (fp, t0) = (next_fp(), start(&mut rng));
        lines.push(line(t0, "acme", &fp, "leader", 300));
        lines.push(line(t0, "beta", &fp, "leader", 300));
    }
    for i in 0..73_000u64 {
        let (fp, t0) = (next_fp(), start(&mut rng));
        lines.push(line(t0, "acme", &fp, "leader", 100 * (1 + i % 10)));
    }
    assert_eq!(lines.len(), 100_000);
    lines.shuffle(&mut rng);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    for l in &lines {
        writeln!(f, "{l}").unwrap();
    }
    f.flush().unwrap();
}

fn analyze(path: &Path, wait: Wait, ttl: Duration) -> Report {
    let opts = Options {
        raw: RawRules::default(),
        only_route: None,
        report: ReportOptions { wait, ttl, top: 5 },
        progress: false,
    };
    analyze_files(&[path.to_path_buf()], &opts).unwrap()
}

#[test]
fn a_seeded_log_of_100k_requests_gives_exact_figures() {
    let dir = temp_dir();
    let path = dir.join("seeded.jsonl");
    seeded_log(&path);

    let r = analyze(
        &path,
        Wait::Fixed(Duration::from_secs(1)),
        Duration::from_secs(30),
    );
    assert_eq!(r.requests, 100_000);
    assert_eq!(r.lines.log_lines, 100_000);
    assert_eq!(r.distinct_tasks, 75_400);
    assert_eq!(r.duplicates, 24_600);
    assert!((r.duplicate_share - 0.246).abs() < 1e-12);
    assert_eq!(r.time_unavailable, None);
    assert_eq!(r.largest_groups.len(), 5);
    assert!(r.largest_groups.iter().all(|g| g.requests == 40));
    // Bursts: 39 followers each (every call ends within the 1 s window).
    // Waves: a call at 0 s is cached until 30.1 s: the 20 s repeat hits, the
    // 40 s one calls again; 5 calls and 5 hits per wave.
    let s = r.simulation.as_ref().unwrap();
    assert_eq!(s.saved_by_coalescing, 400 * 39);
    assert_eq!(s.saved_by_cache, 1000 * 5);
    assert_eq!(s.saved, 20_600);
    assert_eq!(s.upstream_calls, 79_400);
    assert_eq!(s.wait_timeouts, 0);

    let gaps = r.repeat_gaps.as_ref().unwrap();
    assert_eq!(gaps.count, 24_600);
    assert_eq!(gaps.p50_ms, 10.0);
    assert_eq!(gaps.p95_ms, 20_000.0);
    assert_eq!(gaps.p99_ms, 20_000.0);
    assert_eq!(r.leader_latency.as_ref().unwrap().p99_ms, 1000.0);

    let obs = r.observed.as_ref().unwrap();
    assert_eq!(obs.outcomes["follower"], 400 * 39);
    assert_eq!(obs.outcomes["cache-hit"], 1000 * 5);

    // The recommendation: wait 1.5 x p99 = 1,500 ms; TTL = the 20 s p95
    // gap, which covers every repeat.
    let rec = &r.recommendation;
    assert_eq!(rec.verdict, Verdict::WorthIt);
    assert_eq!(rec.max_wait_ms, Some(1500));
    assert_eq!(rec.ttl_s, Some(20));
    assert_eq!(rec.ttl_covers_share, Some(1.0));
    let rs = rec.simulation.as_ref().unwrap();
    assert_eq!((rs.saved_by_coalescing, rs.saved_by_cache), (15_600, 5_000));

    // A 200 ms window is shorter than the 500 ms burst calls: only the
    // repeats from 300 ms on (10 of 39) can wait; 29 time out. With a
    // 60 s TTL a wave calls at 0, 80 and 160 s and hits 7 times.
    let r = analyze(
        &path,
        Wait::Fixed(Duration::from_millis(200)),
        Duration::from_secs(60),
    );
    let s = r.simulation.as_ref().unwrap();
    assert_eq!(s.saved_by_coalescing, 400 * 10);
    assert_eq!(s.wait_timeouts, 400 * 29);
    assert_eq!(s.saved_by_cache, 1000 * 7);
    assert_eq!(s.upstream_calls, 100_000 - 11_000);

    // `auto` waits 1.5 x the p99 leader latency; no TTL, no cache hits.
    let r = analyze(&path, Wait::Auto, Duration::ZERO);
    assert_eq!(r.wait.ms, 1500.0);
    let s = r.simulation.as_ref().unwrap();
    assert_eq!((s.saved_by_coalescing, s.saved_by_cache), (15_600, 0));
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a gateway writes with the default log (text lines on stdout) is
/// what `idem analyze` reads; an input without requests exits non-zero
/// with the hint, after the report.
#[tokio::test]
async fn analyze_reads_the_default_text_log_and_refuses_an_input_without_requests() {
    let mocks = start_mocks(&Spec::default()).await;
    let (mut proc, dir) =
        Proc::start_default_with(&mocks, |_| vec![("IDEM_LOG__FORMAT", "text".to_string())]).await;
    // A leader and two cache hits, then another task.
    for content in ["same", "same", "same", "other"] {
        let r = client()
            .post(format!("{}/v1/chat/completions", proc.base))
            .bearer_auth(ACME)
            .json(&chat_body(content))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    proc.signal("TERM");
    let _ = tokio::time::timeout(Duration::from_secs(10), proc.child.wait()).await;
    let log = proc.drain().join("\n");
    assert!(
        log.contains(" INFO idem::request: ") && !log.contains("{\""),
        "not the text log: {log}"
    );
    let path = dir.join("stdout.log");
    std::fs::write(&path, &log).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["analyze", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 4, "{v}");
    assert_eq!(v["lines"]["log_lines"], 4, "{v}");
    assert_eq!(v["distinct_tasks"], 2, "{v}");
    assert_eq!(v["duplicates"], 2, "{v}");
    assert_eq!(v["observed"]["outcomes"]["cache-hit"], 2, "{v}");
    // The process's own lines are counted as other lines, not unreadable.
    assert_eq!(v["lines"]["unreadable_lines"], 0, "{v}");

    // Only the process's own lines: nothing to count.
    let others: Vec<&str> = log
        .lines()
        .filter(|l| !l.contains("idem::request"))
        .collect();
    assert!(!others.is_empty());
    std::fs::write(&path, others.join("\n")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("analyze")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no requests in"), "{err}");
    assert!(err.contains("idem::request"), "{err}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("Duplicates"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn raw_bodies_without_times_report_time_figures_as_unavailable() {
    let dir = temp_dir();
    let path = dir.join("bodies.jsonl");
    let mut text = String::new();
    for i in 0..30 {
        let body = json!({"model": "bot", "messages": [{"role": "user", "content": format!("q{}", i % 10)}]});
        text.push_str(&format!("{body}\n"));
    }
    std::fs::write(&path, text).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["analyze", "--json", "--tenant", "acme"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 30);
    assert_eq!(v["lines"]["raw_bodies"], 30);
    assert_eq!(v["distinct_tasks"], 10);
    assert_eq!(v["duplicates"], 20);
    assert_eq!(v["simulation"], Value::Null);
    assert_eq!(v["repeat_gaps"], Value::Null);
    assert_eq!(
        v["time_unavailable"],
        "no request has a time or timestamp field"
    );
    assert_eq!(v["largest_groups"][0]["tenant"], "acme");
    assert_eq!(v["largest_groups"][0]["requests"], 3);
    // The text report says so too.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("analyze")
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("What idem would have saved: unavailable"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A gateway serving in this process with a request log file.
pub struct LoggingGateway {
    pub mocks: Mocks,
    pub base: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
    pub state: AppState,
}

/// A gateway writing its request log to `path`.
async fn gateway_logging_to(path: &Path, bodies: bool) -> LoggingGateway {
    gateway_logging_with(&Spec::default(), path, bodies).await
}

pub async fn gateway_logging_with(spec: &Spec, path: &Path, bodies: bool) -> LoggingGateway {
    let spec = spec.clone();
    let mocks = start_mocks(&spec).await;
    let dir = path.parent().unwrap();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let text = config_text(&spec, &mocks, &db, "127.0.0.1:0").replace(
        "[log]\nformat = \"json\"\n",
        &format!(
            "[log]\nformat = \"json\"\nrequests = \"{}\"\nbodies = {bodies}\n",
            path.display()
        ),
    );
    let config = Config::from_toml_str(&text, Source::Embedded, false).unwrap();
    assert_eq!(config.log.requests, path.display().to_string());
    let app = App::build(config).await.unwrap();
    let base = format!("http://127.0.0.1:{}", app.port());
    let state = app.state().clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(app.run(async move {
        let _ = stopped.await;
    }));
    LoggingGateway {
        mocks,
        base,
        stop,
        task,
        state,
    }
}

impl LoggingGateway {
    /// Stops the gateway and waits (bounded) for it to finish serving.
    pub async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }
}

pub async fn log_lines(path: &PathBuf, n: usize) -> Vec<Value> {
    eventually(Duration::from_secs(10), || {
        std::fs::read_to_string(path).is_ok_and(|t| t.lines().count() >= n)
    })
    .await;
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test]
async fn the_request_log_file_has_one_line_per_request_and_no_secrets() {
    let dir = temp_dir();
    let path = dir.join("requests.jsonl");
    // Calls of 5 ms at least, so that the job path's call duration (kept
    // in milliseconds with its attempt) shows.
    let spec = Spec {
        primary: Behaviour {
            latency_ms: 5,
            ..Behaviour::default()
        },
        ..Spec::default()
    };
    let gw = gateway_logging_with(&spec, &path, false).await;
    let c = client();
    let chat = |key: &'static str, body: Value, idem_key: Option<&'static str>| {
        let mut r = c
            .post(format!("{}/v1/chat/completions", gw.base))
            .bearer_auth(key)
            .json(&body);
        if let Some(k) = idem_key {
            r = r.header("Idempotency-Key", k);
        }
        r.send()
    };
    for _ in 0..3 {
        assert_eq!(
            chat(ACME, chat_body("the secret plan"), None)
                .await
                .unwrap()
                .status(),
            200
        );
    }
    assert_eq!(
        chat(BETA, chat_body("the secret plan"), None)
            .await
            .unwrap()
            .status(),
        200
    );
    let job = json!({"request": chat_body("a job to do")});
    for expected in [201, 200] {
        let r = c
            .post(format!("{}/v1/jobs", gw.base))
            .bearer_auth(ACME)
            .header("Idempotency-Key", "order-45")
            .json(&job)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), expected);
    }
    let r = chat(ACME, chat_body("keyed"), Some("refund-45"))
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let job_id = r.headers()["idem-job-id"].to_str().unwrap().to_string();
    // Who answered a job: the attempt's provider, not the job machinery.
    assert_eq!(r.headers()["idem-provider"], "primary");

    let lines = log_lines(&path, 7).await;
    assert_eq!(lines.len(), 7);
    let outcomes: Vec<&str> = lines
        .iter()
        .map(|l| l["outcome"].as_str().unwrap())
        .collect();
    assert_eq!(
        outcomes,
        [
            "leader",
            "cache-hit",
            "cache-hit",
            "leader",
            "created",
            "replay",
            "leader"
        ]
    );
    let tenants: Vec<&str> = lines
        .iter()
        .map(|l| l["tenant"].as_str().unwrap())
        .collect();
    assert_eq!(
        tenants,
        ["acme", "acme", "acme", "beta", "acme", "acme", "acme"]
    );
    for l in &lines {
        for key in [
            "time",
            "tenant",
            "route",
            "fingerprint",
            "outcome",
            "status",
            "latency_ms",
            "upstream_ms",
            "prompt_tokens",
            "completion_tokens",
        ] {
            assert!(l.get(key).is_some(), "{key} missing in {l}");
        }
        assert!(l["fingerprint"].as_str().unwrap().starts_with("v1:"));
        assert_eq!(l["route"], "bot");
    }
    // The leader's call and its tokens; the cache hits carry the same answer.
    assert!(
        lines[0]["upstream_ms"].as_f64().unwrap() > 0.0,
        "{}",
        lines[0]
    );
    assert!(
        lines[0]["prompt_tokens"].as_u64().unwrap() > 0,
        "{}",
        lines[0]
    );
    assert_eq!(lines[1]["upstream_ms"], lines[0]["upstream_ms"]);
    // The job path names the job (and, once done, its attempt).
    assert!(lines[4]["job"].is_string() && lines[4]["job"] == lines[5]["job"]);
    assert_eq!(lines[4]["status"], 201);
    assert_eq!(lines[6]["job"], job_id.as_str());
    assert_eq!(lines[6]["attempt"], 1);
    assert!(lines[0].get("job").is_none());
    // Who answered: the provider and the model asked for there, on the
    // plain path (the cache hits carry the leader's) and on the job path
    // (the completing attempt's, with its call's duration); a job
    // creation has no answer yet.
    for i in [0, 1, 2, 3, 6] {
        assert_eq!(lines[i]["provider"], "primary", "{}", lines[i]);
        assert_eq!(lines[i]["model"], "gpt-4o-mini", "{}", lines[i]);
    }
    assert!(lines[4].get("provider").is_none(), "{}", lines[4]);
    assert!(
        lines[6]["upstream_ms"].as_f64().unwrap() >= 5.0,
        "{}",
        lines[6]
    );
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        !text.contains(ACME) && !text.contains(BETA),
        "an API key was logged"
    );
    assert!(
        !text.contains("secret plan"),
        "message contents logged without log.bodies"
    );
    assert!(!text.contains("messages"));

    // `idem analyze` reads it back: 7 requests, 4 tasks (one per tenant for
    // the same prompt).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["analyze", "--json", "--ttl", "30s"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 7);
    assert_eq!(v["distinct_tasks"], 4);
    assert_eq!(v["largest_groups"][0]["requests"], 3);
    assert_eq!(v["largest_groups"][0]["tenant"], "acme");
    assert_eq!(v["observed"]["outcomes"]["cache-hit"], 2);
    assert_eq!(v["simulation"]["saved"], 3);

    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_streamed_answer_is_logged_when_it_ends_with_its_upstream_time_and_tokens() {
    let dir = temp_dir();
    let path = dir.join("requests.jsonl");
    let mut spec = Spec::default();
    // The stream outlasts the handler: its head goes out at once, its
    // chunks over several times 30 ms.
    spec.primary.chunk_delay_ms = 30;
    let gw = gateway_logging_with(&spec, &path, false).await;
    let mut body = chat_body("tell me a long story");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.base))
        .bearer_auth(ACME)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("[DONE]"), "{text}");

    let lines = log_lines(&path, 1).await;
    assert_eq!(lines.len(), 1, "{lines:?}");
    let l = &lines[0];
    assert_eq!(l["outcome"], "leader");
    let upstream = l["upstream_ms"].as_f64().unwrap();
    assert!(upstream >= 60.0, "the whole call, not 0: {l}");
    assert!(l["completion_tokens"].as_u64().unwrap() > 0, "{l}");
    // The latency stays the time to the answer's head.
    assert!(l["latency_ms"].as_f64().unwrap() < upstream, "{l}");

    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn with_log_bodies_the_messages_are_included() {
    let dir = temp_dir();
    let path = dir.join("requests.jsonl");
    let gw = gateway_logging_to(&path, true).await;
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.base))
        .bearer_auth(ACME)
        .json(&chat_body("show me"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let lines = log_lines(&path, 1).await;
    assert_eq!(
        lines[0]["messages"],
        json!([{"role": "user", "content": "show me"}])
    );
    assert!(!std::fs::read_to_string(&path).unwrap().contains(ACME));
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A follower lets its parsed body go while it waits and parses it again
/// for its line: with `log.bodies`, its line has its messages too.
#[tokio::test]
async fn with_log_bodies_a_followers_line_has_its_messages() {
    let dir = temp_dir();
    let path = dir.join("requests.jsonl");
    let gw = gateway_logging_with(&holding(), &path, true).await;
    let send = || {
        let url = format!("{}/v1/chat/completions", gw.base);
        async move {
            let r = client()
                .post(url)
                .bearer_auth(ACME)
                .json(&chat_body("wait for me"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }
    };
    let leader = tokio::spawn(send());
    held(&gw.mocks.primary, 1).await;
    let follower = tokio::spawn(send());
    let table = &gw.state.core.coalescer.table;
    eventually(Duration::from_secs(10), || table.followers() >= 1).await;
    release(&gw.mocks.primary, None).await;
    leader.await.unwrap();
    follower.await.unwrap();
    let lines = log_lines(&path, 2).await;
    let outcomes: Vec<&str> = lines.iter().filter_map(|l| l["outcome"].as_str()).collect();
    assert!(outcomes.contains(&"follower"), "{outcomes:?}");
    for l in &lines {
        assert_eq!(
            l["messages"],
            json!([{"role": "user", "content": "wait for me"}]),
            "{l}"
        );
    }
    gw.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_stdout_request_lines_are_json_that_analyze_reads() {
    let mocks = start_mocks(&Spec::default()).await;
    let (mut proc, dir) = Proc::start_default(&mocks).await;
    for _ in 0..2 {
        let r = client()
            .post(format!("{}/v1/chat/completions", proc.base))
            .bearer_auth(ACME)
            .json(&chat_body("twice"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let mut seen = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while seen
        .iter()
        .filter(|l: &&String| l.contains("idem::request"))
        .count()
        < 2
    {
        assert!(std::time::Instant::now() < deadline, "{seen:?}");
        seen.extend(proc.drain());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    proc.signal("TERM");
    let _ = proc.child.wait().await;
    let request: Value = seen
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["target"] == "idem::request")
        .unwrap();
    for key in [
        "time",
        "tenant",
        "fingerprint",
        "outcome",
        "status",
        "upstream_ms",
    ] {
        assert!(request.get(key).is_some(), "{key} missing in {request}");
    }
    let log = dir.join("stdout.log");
    std::fs::write(&log, seen.join("\n")).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["analyze", "--json"])
        .arg(&log)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 2, "{v}");
    assert_eq!(v["duplicates"], 1);
    assert!(
        v["lines"]["other_lines"].as_u64().unwrap() >= 1,
        "the listening line"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stream's log line is written when the stream ends, after its handler
/// returned: the shutdown waits for it (within its grace) even when the
/// client has left and no connection is open any more.
#[tokio::test]
async fn a_stream_still_running_at_shutdown_keeps_its_log_line() {
    let mut spec = Spec::default();
    // Several chunks 250 ms apart: the stream runs well past the signal.
    spec.primary.chunk_delay_ms = 250;
    let mocks = start_mocks(&spec).await;
    let (mut proc, dir) = Proc::start_default(&mocks).await;
    let mut body = chat_body("a story that outlives its listener");
    body["stream"] = json!(true);
    let r = client()
        .post(format!("{}/v1/chat/completions", proc.base))
        .bearer_auth(ACME)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // The client leaves after the head; the upstream call goes on.
    drop(r);
    proc.signal("TERM");
    let status = tokio::time::timeout(Duration::from_secs(10), proc.child.wait())
        .await
        .expect("idem did not stop")
        .unwrap();
    assert!(status.success(), "{status:?}");
    let mut lines = Vec::new();
    // Everything printed, up to the end of the output.
    while let Ok(Some(line)) =
        tokio::time::timeout(Duration::from_secs(10), proc.lines.recv()).await
    {
        lines.push(line);
    }
    let request = lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["target"] == "idem::request")
        .unwrap_or_else(|| panic!("no request line before the exit: {lines:#?}"));
    assert_eq!(request["outcome"], "leader", "{request}");
    assert!(
        request["upstream_ms"].as_f64().unwrap() >= 250.0,
        "logged when the stream ended: {request}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A known log: what a cache and coalescing would have saved, in tokens and
/// dollars, to the nano-dollar.
#[test]
fn analyze_prints_the_saved_cost_of_a_known_log_exactly() {
    let dir = temp_dir();
    let path = dir.join("requests.jsonl");
    let fp = |n: u8| format!("v1:{}", hex::encode([n; 32]));
    let line = |t: &str, fp: &str, outcome: &str, model: &str, tokens: (u64, u64)| {
        format!(
            r#"{{"time":"2025-03-01T09:00:{t}Z","tenant":"acme","route":"bot","fingerprint":"{fp}","outcome":"{outcome}","provider":"primary","model":"{model}","status":200,"latency_ms":100.0,"upstream_ms":100.0,"prompt_tokens":{},"completion_tokens":{}}}"#,
            tokens.0, tokens.1
        )
    };
    let (a, b) = (fp(1), fp(2));
    let log = [
        // gpt-4o-mini (built-in: $0.15 in, $0.60 out per million): a call
        // of 1000 + 500 tokens costs $0.00045; a follower and a cache hit
        // save it twice.
        line(
            "00.000",
            &a,
            "leader",
            "gpt-4o-mini-2024-07-18",
            (1000, 500),
        ),
        line(
            "00.010",
            &a,
            "follower",
            "gpt-4o-mini-2024-07-18",
            (1000, 500),
        ),
        line(
            "05.000",
            &a,
            "cache-hit",
            "gpt-4o-mini-2024-07-18",
            (1000, 500),
        ),
        // A model without a price: tokens saved, cost unknown.
        line("00.000", &b, "leader", "llama-local", (100, 50)),
        line("00.020", &b, "follower", "llama-local", (100, 50)),
    ]
    .join("\n");
    std::fs::write(&path, log).unwrap();
    let analyze = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["analyze", "--wait", "1s", "--ttl", "30s"])
            .args(extra)
            .arg(&path)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let text = analyze(&[]);
    assert!(
        text.contains("saved tokens                3150   (2100 input, 1050 output)"),
        "{text}"
    );
    assert!(
        text.contains(
            "saved cost             $0.000900   (1 saved requests without a price are not in it)"
        ),
        "{text}"
    );
    // With prices for every line: $1 in, $2 out per million. Saved: two
    // calls of 1000 + 500 ($0.002 each) and one of 100 + 50 ($0.0002).
    let text = analyze(&["--input-price", "1", "--output-price", "2"]);
    assert!(
        text.contains("saved cost             $0.004200\n"),
        "{text}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args([
            "analyze",
            "--json",
            "--input-price",
            "1",
            "--output-price",
            "2",
        ])
        .arg(&path)
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["simulation"]["saved_cost_usd"], 0.0042, "{v}");
    assert_eq!(v["simulation"]["unpriced_saves"], 0, "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every face's requests are logged with their `endpoint`, and `idem
/// analyze` reads them all and reports each endpoint apart.
#[tokio::test]
async fn analyze_reports_each_face_of_a_real_log() {
    let dir = temp_dir();
    let path = dir.join("requests.jsonl");
    let spec = Spec {
        route: "endpoints = [\"chat\", \"embeddings\"]\n".into(),
        ..Spec::default()
    };
    let gw = gateway_logging_with(&spec, &path, false).await;
    let post = |url: String, body: Value| async move {
        let r = client()
            .post(url)
            .bearer_auth(ACME)
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
    };
    // Chat twice (a leader, then a cache hit), Messages three times, the
    // Responses API once, embeddings once: the same question each time.
    for _ in 0..2 {
        post(
            format!("{}/v1/chat/completions", gw.base),
            chat_body("same"),
        )
        .await;
    }
    let message = json!({"model": "bot", "max_tokens": 64, "messages": [{"role": "user", "content": "same"}]});
    for _ in 0..3 {
        post(format!("{}/v1/messages", gw.base), message.clone()).await;
    }
    post(
        format!("{}/v1/responses", gw.base),
        json!({"model": "bot", "input": "same", "store": false}),
    )
    .await;
    post(
        format!("{}/v1/embeddings", gw.base),
        json!({"model": "bot", "input": "same"}),
    )
    .await;
    let lines = log_lines(&path, 7).await;
    let endpoints: Vec<&str> = lines
        .iter()
        .map(|l| l["endpoint"].as_str().unwrap())
        .collect();
    assert_eq!(
        endpoints,
        [
            "chat",
            "chat",
            "messages",
            "messages",
            "messages",
            "responses",
            "embeddings"
        ]
    );
    gw.stop().await;

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["analyze", "--json"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 7, "{v}");
    // Three faces of one question are three tasks, not one.
    assert_eq!(v["distinct_tasks"], 4, "{v}");
    let e = &v["endpoints"];
    assert_eq!(
        e["chat"],
        json!({"requests": 2, "distinct_tasks": 1, "saved": 1}),
        "{v}"
    );
    assert_eq!(
        e["messages"],
        json!({"requests": 3, "distinct_tasks": 1, "saved": 2}),
        "{v}"
    );
    assert_eq!(
        e["responses"],
        json!({"requests": 1, "distinct_tasks": 1, "saved": 0}),
        "{v}"
    );
    assert_eq!(e["embeddings"]["requests"], 1, "{v}");
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .arg("analyze")
        .arg(&path)
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.contains("By endpoint"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.trim_start().starts_with("messages")
                && l.split_whitespace().nth(1) == Some("3")),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
