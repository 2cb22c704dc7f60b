//! `idem analyze`: what a request log (or a file of raw OpenAI request
//! bodies) says about duplicates, and which wait window and TTL to choose,
//! from data rather than feel (docs/design.md, "Numbers").
//!
//! The command streams its inputs through the [`input::Collector`] (one
//! small event per request, grouped by tenant and fingerprint), then
//! [`report::Report::build`] counts duplicates, replays the arrivals through
//! the deterministic rule of [`simulate`] for the given `--wait` and
//! `--ttl`, measures the gaps between repeats, and derives a
//! recommendation. Nothing here touches the gateway's state: it is a pure
//! function of the files and the flags, so its numbers are reproducible.

pub mod input;
pub mod report;
pub mod simulate;
pub mod text;

use std::fs::File;
use std::io::{BufRead, BufReader, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::config::{Config, ConfigError};
use crate::prices::Price;
pub use input::{Collector, RawRules};
pub use report::{Report, ReportOptions, Wait};

/// Inputs at least this large get a progress bar (when stderr is a
/// terminal).
const PROGRESS_FROM_BYTES: u64 = 16 * 1024 * 1024;

#[derive(clap::Args, Debug, Clone)]
pub struct AnalyzeArgs {
    /// Request logs or raw OpenAI request bodies, as JSON lines (`-`: standard input).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// The config whose route rules fingerprint raw request bodies.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Raw bodies: fingerprint every body with this route's rules. Logs:
    /// only this route's lines.
    #[arg(long)]
    pub route: Option<String>,
    /// The tenant of raw request bodies.
    #[arg(long, default_value = "default")]
    pub tenant: String,
    /// Coalescing window to simulate: how long a repeat may wait for the
    /// identical call in flight. `auto`: 1.5 x the p99 leader latency in the
    /// log, within [300ms, 30s] (1s when the input has none).
    #[arg(long, default_value = "auto")]
    pub wait: Wait,
    /// Result-cache TTL to simulate (after the call ends).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub ttl: Duration,
    /// How many of the largest duplicate groups to list.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// The price of every line's input tokens, in US dollars per million
    /// (with `--output-price`); default: each line's target's price in
    /// `--config`, else the built-in price of its `model`.
    #[arg(long, requires = "output_price")]
    pub input_price: Option<f64>,
    /// The price of every line's output tokens, in US dollars per million.
    #[arg(long, requires = "input_price")]
    pub output_price: Option<f64>,
}

impl AnalyzeArgs {
    /// `--input-price` and `--output-price` as one price.
    fn price(&self) -> Result<Option<Price>, AnalyzeError> {
        let (Some(input), Some(output)) = (self.input_price, self.output_price) else {
            return Ok(None);
        };
        if !(input.is_finite() && input >= 0.0 && output.is_finite() && output >= 0.0) {
            return Err(AnalyzeError::Price);
        }
        Ok(Some(Price {
            input_per_mtok: input,
            cached_input_per_mtok: input,
            output_per_mtok: output,
            source: "flags",
        }))
    }
}

/// Why `idem analyze` could not produce a report.
#[derive(Debug, thiserror::Error)]
pub enum AnalyzeError {
    #[error("cannot open {path}: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("--route {route}: {config} has no such route (routes: {known})")]
    UnknownRoute {
        route: String,
        config: String,
        known: String,
    },
    #[error("cannot write the report: {0}")]
    Write(std::io::Error),
    #[error(
        "--input-price and --output-price are US dollars per million tokens: numbers, 0 or more"
    )]
    Price,
    /// The report is written first; the exit status says it had nothing
    /// to count.
    #[error(
        "no requests in {lines} lines of input: idem analyze reads idem's request log \
         (JSON lines, or the text lines of the default log, `... idem::request: tenant=...`; \
         `[log] requests = \"<file>\"` writes them to a file) or raw chat completion bodies, \
         one JSON object with `messages` per line"
    )]
    NoRequests { lines: u64 },
}

/// What to analyse, and how.
#[derive(Debug, Clone)]
pub struct Options {
    pub raw: RawRules,
    /// Only these log lines' route (`--route`).
    pub only_route: Option<String>,
    pub report: ReportOptions,
    /// Draw a progress bar on stderr for large inputs.
    pub progress: bool,
}

impl Options {
    /// From the command line: loads `--config` and checks `--route`.
    pub fn from_args(args: &AnalyzeArgs) -> Result<Options, AnalyzeError> {
        let config = match &args.config {
            Some(path) => Some(Config::load(Some(path))?),
            None => None,
        };
        if let (Some(route), Some(c)) = (&args.route, &config)
            && !c.routes.iter().any(|r| &r.model == route)
        {
            let known: Vec<&str> = c.routes.iter().map(|r| r.model.as_str()).collect();
            return Err(AnalyzeError::UnknownRoute {
                route: route.clone(),
                config: c.source.to_string(),
                known: known.join(", "),
            });
        }
        Ok(Options {
            raw: RawRules {
                config,
                route: args.route.clone(),
                tenant: args.tenant.clone(),
                price: args.price()?,
            },
            only_route: args.route.clone(),
            report: ReportOptions {
                wait: args.wait,
                ttl: args.ttl,
                top: args.top,
            },
            progress: std::io::stderr().is_terminal(),
        })
    }
}

/// Analyses files (`-` is standard input) into a report.
pub fn analyze_files(paths: &[PathBuf], opts: &Options) -> Result<Report, AnalyzeError> {
    let mut collector = Collector::new(opts.only_route.clone(), opts.raw.clone());
    let total: u64 = paths
        .iter()
        .filter(|p| !is_stdin(p))
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let bar = progress_bar(opts.progress && total >= PROGRESS_FROM_BYTES, total);
    let mut done = 0u64;
    for path in paths {
        let name = path.display().to_string();
        let input: Box<dyn Read> = if is_stdin(path) {
            Box::new(std::io::stdin().lock())
        } else {
            Box::new(File::open(path).map_err(|source| AnalyzeError::Open {
                path: name.clone(),
                source,
            })?)
        };
        let reader = BufReader::with_capacity(1 << 20, input);
        let mut file_bytes = 0;
        collector
            .read(reader, |n| {
                file_bytes = n;
                if let Some(b) = &bar {
                    b.set_position(done + n);
                }
            })
            .map_err(|source| AnalyzeError::Read {
                path: name.clone(),
                source,
            })?;
        done += file_bytes;
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let names = paths.iter().map(|p| p.display().to_string()).collect();
    Ok(Report::build(collector, names, &opts.report))
}

/// Analyses one reader (for tests and benchmarks).
pub fn analyze_reader(
    input: impl BufRead,
    name: &str,
    opts: &Options,
) -> Result<Report, AnalyzeError> {
    let mut collector = Collector::new(opts.only_route.clone(), opts.raw.clone());
    collector
        .read(input, |_| {})
        .map_err(|source| AnalyzeError::Read {
            path: name.to_string(),
            source,
        })?;
    Ok(Report::build(collector, vec![name.into()], &opts.report))
}

fn is_stdin(p: &Path) -> bool {
    p.as_os_str() == "-"
}

fn progress_bar(show: bool, total: u64) -> Option<ProgressBar> {
    if !show {
        return None;
    }
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(
        "{spinner} reading {bytes}/{total_bytes} [{bar:40}] {percent}%  {bytes_per_sec}, eta {eta}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    Some(bar)
}

/// `idem analyze`.
pub fn run(args: AnalyzeArgs) -> Result<(), AnalyzeError> {
    let opts = Options::from_args(&args)?;
    let report = analyze_files(&args.files, &opts)?;
    let mut out = std::io::stdout().lock();
    let written = if args.json {
        serde_json::to_writer_pretty(&mut out, &report)
            .map_err(std::io::Error::from)
            .and_then(|()| writeln!(out))
    } else {
        out.write_all(report.text().as_bytes())
    };
    written.map_err(AnalyzeError::Write)?;
    if report.requests == 0 {
        return Err(AnalyzeError::NoRequests {
            lines: report.lines.lines,
        });
    }
    Ok(())
}
