//! idem's benchmark suite: `cargo bench --profile profiling --bench gateway`
//! (the release build with line tables, for profiles: docs/benchmarks.md).
//!
//! Each table starts what it measures as real processes on loopback: the
//! gateway (`idem serve`, the binary cargo builds for this bench)
//! and the provider (`idem mock-upstream`). This process is the load
//! generator, on its own tokio runtime. Every figure is printed next to a
//! baseline measured in the same run (the provider without idem, nginx as
//! a plain reverse proxy, the memory backend without Redis, a plain chat
//! completion without a job), and next to its target with PASS or MISS; a
//! summary of the targets closes the run. A MISS is a finding, not a
//! failure: the suite exits 0 unless a table could not run at all.
//!
//! Knobs: `IDEM_BENCH_QUICK=1` (small sizes, short runs, for iterating),
//! `IDEM_BENCH_ONLY=2,4` (just these tables), `IDEM_BENCH_INSTALL_NGINX=0`
//! (do not install nginx when it is missing). PostgreSQL and Redis come
//! from `IDEM_BENCH_DATABASE_URL` / `IDEM_BENCH_REDIS_URL` (else the tests'
//! variables, else the local servers).
//!
//! Layout: `http` (a lean HTTP/1.1 client), `load` (closed and open loops),
//! `nginx` and `bare` (the proxy baselines of table 1), `wave` (N identical requests at
//! once), `procs` (child processes, their memory and CPU, schemas and Redis
//! keys), `report` (tables, and the summary of targets printed last), then
//! one module per table.

// Cargo would take `benches/*.rs` files for bench targets of their own, so
// the modules live in `benches/gateway/`.
#[path = "gateway/bare.rs"]
mod bare;
#[path = "gateway/http.rs"]
mod http;
#[path = "gateway/load.rs"]
mod load;
#[path = "gateway/nginx.rs"]
mod nginx;
#[path = "gateway/procs.rs"]
mod procs;
#[path = "gateway/report.rs"]
mod report;
#[path = "gateway/t1_overhead.rs"]
mod t1_overhead;
#[path = "gateway/t2_wave.rs"]
mod t2_wave;
#[path = "gateway/t3_jobs.rs"]
mod t3_jobs;
#[path = "gateway/t4_redis.rs"]
mod t4_redis;
#[path = "gateway/t5_embeddings.rs"]
mod t5_embeddings;
#[path = "gateway/t6_batches.rs"]
mod t6_batches;
#[path = "gateway/wave.rs"]
mod wave;

use std::collections::BTreeSet;
use std::process::{Command, ExitCode};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;

use report::Table;

/// What the environment asked for.
pub struct Settings {
    pub quick: bool,
    only: Option<BTreeSet<u8>>,
}

impl Settings {
    fn from_env() -> anyhow::Result<Settings> {
        let quick = std::env::var("IDEM_BENCH_QUICK")
            .map(|v| !matches!(v.trim(), "" | "0" | "false" | "no"))
            .unwrap_or(false);
        let only = match std::env::var("IDEM_BENCH_ONLY") {
            Ok(v) if !v.trim().is_empty() => Some(
                v.split(',')
                    .map(|t| {
                        t.trim()
                            .parse::<u8>()
                            .ok()
                            .filter(|n| (1..=6).contains(n))
                            .with_context(|| {
                                format!("IDEM_BENCH_ONLY: {t:?} is not a table number (1..6)")
                            })
                    })
                    .collect::<anyhow::Result<BTreeSet<u8>>>()?,
            ),
            _ => None,
        };
        Ok(Settings { quick, only })
    }

    fn wants(&self, table: u8) -> bool {
        self.only.as_ref().is_none_or(|o| o.contains(&table))
    }

    /// `quick` in quick mode, else `full`.
    pub fn pick<T>(&self, quick: T, full: T) -> T {
        if self.quick { quick } else { full }
    }
}

const TABLES: [(u8, &str); 6] = [
    (1, "proxy overhead"),
    (2, "wave of identical requests"),
    (3, "idempotent job creations"),
    (4, "Redis vs memory backend"),
    (5, "embeddings re-index"),
    (6, "Batch API"),
];

async fn table(n: u8, s: Arc<Settings>) -> anyhow::Result<Vec<Table>> {
    match n {
        1 => t1_overhead::run(s).await,
        2 => t2_wave::run(s).await,
        3 => t3_jobs::run(s).await.map(|t| vec![t]),
        4 => t4_redis::run(s).await.map(|t| vec![t]),
        5 => t5_embeddings::run(s).await.map(|t| vec![t]),
        _ => t6_batches::run(s).await.map(|t| vec![t]),
    }
}

fn main() -> ExitCode {
    // Table 1's bare proxy is this executable again.
    if let Some(code) = bare::serve_if_asked() {
        return code;
    }
    let settings = match Settings::from_env() {
        Ok(s) => Arc::new(s),
        Err(e) => {
            eprintln!("bench: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(settings))
}

async fn run(settings: Arc<Settings>) -> ExitCode {
    println!("{}", header(&settings));
    let mut all_ran = true;
    for (n, name) in TABLES {
        if !settings.wants(n) {
            continue;
        }
        let started = Instant::now();
        // Each table in a task of its own: a panic ends that table (its
        // processes are killed as it unwinds), not the suite; Ctrl-C aborts
        // it, which drops (and kills) its processes the same way.
        let mut task = tokio::spawn(table(n, Arc::clone(&settings)));
        let ended = tokio::select! {
            ended = &mut task => ended,
            _ = tokio::signal::ctrl_c() => {
                task.abort();
                let _ = task.await;
                println!("\ninterrupted");
                all_ran = false;
                break;
            }
        };
        match ended {
            Ok(Ok(tables)) => {
                for t in tables {
                    print!("{}", t.render());
                }
                println!(
                    "  ({:.0} s; load average {} after it)",
                    started.elapsed().as_secs_f64(),
                    load_average()
                );
            }
            Ok(Err(e)) => {
                all_ran = false;
                println!("\n{n}. {name}: could not run: {e:#}");
            }
            Err(e) => {
                all_ran = false;
                println!("\n{n}. {name}: panicked: {e}");
            }
        }
    }
    print!("{}", report::targets(|n| settings.wants(n)).render());
    for failure in procs::cleanup().await {
        println!("cleanup failed: {failure}");
    }
    if all_ran {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// The 1, 5 and 15 minute load averages: other work on the machine
/// competes with the processes measured.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// The output of a command, trimmed; `None` if it failed.
fn output(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn header(s: &Settings) -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = output("uname", &["-sr"]).unwrap_or_else(|| "unknown kernel".into());
    let load = load_average();
    // `IDEM_<SECTION>__<KEY>` variables reach every gateway started here.
    let mut overrides: Vec<String> = std::env::vars()
        .filter(|(k, _)| k.starts_with("IDEM_") && k.contains("__"))
        .map(|(k, v)| {
            let secret = ["KEY", "SECRET", "PASS", "TOKEN", "URL"]
                .iter()
                .any(|s| k.contains(s));
            format!("{k}={}", if secret { "***" } else { v.as_str() })
        })
        .collect();
    overrides.sort();
    let overrides = if overrides.is_empty() {
        String::new()
    } else {
        format!(
            "\n  overrides {} (config overrides every gateway inherits)",
            overrides.join(" ")
        )
    };
    let version =
        output(env!("CARGO_BIN_EXE_idem"), &["--version"]).unwrap_or_else(|| "idem ?".into());
    let repo = env!("CARGO_MANIFEST_DIR");
    let commit = output("git", &["-C", repo, "rev-parse", "--short=12", "HEAD"])
        .unwrap_or_else(|| "unknown commit".into());
    let dirty = output(
        "git",
        &["-C", repo, "status", "--porcelain", "--untracked-files=no"],
    )
    .is_some_and(|s| !s.is_empty());
    let date = output("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"]).unwrap_or_default();
    let selection = match &s.only {
        Some(o) => o.iter().map(u8::to_string).collect::<Vec<_>>().join(","),
        None => "all".into(),
    };
    format!(
        "idem benchmark suite (cargo bench --profile profiling --bench gateway)\n\
         \x20 date      {date}\n\
         \x20 machine   {cores} cores ({cpu}), {kernel}, load average {load} at start\n\
         \x20 idem      {version}, commit {commit}{}\n\
         \x20 mode      {} (IDEM_BENCH_QUICK={}), tables {selection} (IDEM_BENCH_ONLY)\n\
         \x20 setup     load generator = this process; gateway = `idem serve`, provider = `idem mock-upstream`,\n\
         \x20           separate processes on loopback, all sharing the machine's {cores} cores{overrides}",
        if dirty { " + uncommitted changes" } else { "" },
        s.pick("quick", "full"),
        s.pick("1", "0"),
    )
}
