//! What the `idem` subcommands do, so `main` stays a table of calls:
//! logging set-up, `serve`, and `check`.

use std::io::IsTerminal;
use std::path::Path;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::FmtSpan;

use crate::app::{App, shutdown_signal};
use crate::config::Config;

/// Installs the global tracing subscriber: `IDEM_LOG` (an `EnvFilter`,
/// default `info`) chooses what is logged, `format` is `json` or `text`.
pub fn init_logging(format: &str) {
    init_logging_with(format, true);
}

/// `requests`: whether the per-request lines (`idem::request`) are kept
/// (they are only when `[log] requests = "stdout"`; a file gets its own
/// writer, see [`crate::reqlog`]).
pub fn init_logging_with(format: &str, requests: bool) {
    let mut filter = EnvFilter::try_from_env("IDEM_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    if !requests && let Ok(d) = "idem::request=off".parse() {
        filter = filter.add_directive(d);
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(FmtSpan::NONE)
        .with_ansi(std::io::stdout().is_terminal())
        .with_writer(std::io::stdout);
    let _ = if format == "json" {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init()
    } else {
        builder.compact().try_init()
    };
}

/// `idem serve`.
pub async fn serve(config: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    init_logging_with(&config.log.format, config.log.requests == "stdout");
    let app = App::build(config).await?;
    app.run(shutdown_signal()).await
}

/// `idem check`: validates a config and prints its routes.
pub fn check(config: Option<&Path>) -> anyhow::Result<()> {
    let config = Config::load(config)?;
    println!("{}: ok", config.source);
    for route in &config.routes {
        let targets: Vec<String> = route
            .targets
            .iter()
            .map(|t| format!("{}/{}", t.provider, t.model))
            .collect();
        println!("  route {:<24} -> {}", route.model, targets.join(", "));
    }
    Ok(())
}
