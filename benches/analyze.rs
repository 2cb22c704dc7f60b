//! `cargo bench --profile profiling --bench analyze`: how fast `idem analyze` reads a request
//! log. Writes a 1,000,000-line log of realistic lines (a mix of one-off
//! requests, bursts and repeats, two tenants) to a temporary file, analyses
//! it as the command does, and prints lines per second against the
//! 100,000 lines/s target (one million lines within ten seconds).

use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use idem::analyze::{Options, RawRules, ReportOptions, Wait, analyze_files};
use idem::fingerprint::Fingerprint;

const LINES: u64 = 1_000_000;
const TARGET_LINES_PER_S: f64 = 100_000.0;

/// A small deterministic generator (xorshift), so runs are comparable.
struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

fn write_log(path: &PathBuf) -> std::io::Result<u64> {
    let mut out = BufWriter::with_capacity(1 << 20, std::fs::File::create(path)?);
    let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15);
    let start = humantime::parse_rfc3339("2025-03-01T00:00:00Z").unwrap_or(std::time::UNIX_EPOCH);
    let outcomes = ["leader", "follower", "cache-hit", "leader", "bypass"];
    let mut t_ms = 0u64;
    for i in 0..LINES {
        t_ms += rng.next() % 20;
        // A third of the requests repeat one of 5,000 hot prompts.
        let key = if rng.next().is_multiple_of(3) {
            rng.next() % 5_000
        } else {
            10_000 + i
        };
        let fp = Fingerprint::from_bytes(*blake3::hash(&key.to_le_bytes()).as_bytes());
        let tenant = if key.is_multiple_of(2) {
            "acme"
        } else {
            "beta"
        };
        let time = humantime::format_rfc3339_millis(start + Duration::from_millis(t_ms));
        writeln!(
            out,
            r#"{{"time":"{time}","tenant":"{tenant}","route":"support-bot","fingerprint":"{fp}","outcome":"{}","status":200,"latency_ms":{}.{:03},"upstream_ms":{}.{:03},"prompt_tokens":{},"completion_tokens":{}}}"#,
            outcomes[(rng.next() % 5) as usize],
            rng.next() % 2000,
            rng.next() % 1000,
            rng.next() % 2000,
            rng.next() % 1000,
            rng.next() % 4000,
            rng.next() % 800,
        )?;
    }
    out.flush()?;
    Ok(std::fs::metadata(path)?.len())
}

fn main() -> std::io::Result<()> {
    let path =
        std::env::temp_dir().join(format!("idem-bench-analyze-{}.jsonl", std::process::id()));
    let bytes = write_log(&path)?;
    let opts = Options {
        raw: RawRules::default(),
        only_route: None,
        report: ReportOptions {
            wait: Wait::Auto,
            ttl: Duration::from_secs(30),
            top: 10,
        },
        progress: false,
    };
    let started = Instant::now();
    let report = analyze_files(std::slice::from_ref(&path), &opts);
    let elapsed = started.elapsed();
    let _ = std::fs::remove_file(&path);
    let report = report.map_err(std::io::Error::other)?;
    assert_eq!(report.requests, LINES, "every line is a request");
    let rate = LINES as f64 / elapsed.as_secs_f64();
    println!(
        "analyze: {LINES} lines ({:.0} MiB) in {:.2} s: {:.0} lines/s ({:.0} MiB/s); target {:.0} lines/s: {}",
        bytes as f64 / (1024.0 * 1024.0),
        elapsed.as_secs_f64(),
        rate,
        bytes as f64 / (1024.0 * 1024.0) / elapsed.as_secs_f64(),
        TARGET_LINES_PER_S,
        if rate >= TARGET_LINES_PER_S {
            "met"
        } else {
            "MISSED"
        }
    );
    println!(
        "  ({} distinct tasks, duplicate share {:.1} %)",
        report.distinct_tasks,
        report.duplicate_share * 100.0
    );
    Ok(())
}
