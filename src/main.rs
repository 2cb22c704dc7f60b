//! The `idem` command: parses flags, sets up logging, and hands over to the
//! library. Each subcommand is one call.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// jemalloc instead of the C library's allocator (the `jemalloc` feature in
/// Cargo.toml says why).
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "idem",
    version,
    about = "An OpenAI-compatible LLM gateway that does each piece of work once"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the gateway (without --config: the embedded default).
    Serve {
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Start a mock provider and a gateway in one process, fire a wave of
    /// identical requests, and print what happened.
    Demo(idem::demo::DemoArgs),
    /// A fake OpenAI-compatible provider for demos, tests and benchmarks.
    MockUpstream(idem::mock_upstream::MockArgs),
    /// Print the sha256: form of an API key for the config file.
    HashKey { key: String },
    /// Duplicates, saved calls, and a TTL and wait window, from a request log.
    Analyze(idem::analyze::AnalyzeArgs),
    /// Write a commented starter configuration (with a fresh tenant key).
    Init {
        /// Where to write it.
        #[arg(default_value = "idem.toml")]
        file: PathBuf,
        /// Overwrite an existing file.
        #[arg(long)]
        force: bool,
    },
    /// Print the effective configuration (defaults, file and environment
    /// merged), secrets redacted.
    Config {
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Check a configuration file and print its routes.
    Check {
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Certify a route's targets against its contract (default: every
    /// target but the primary) and record the result; exits non-zero when a
    /// target fails.
    Certify {
        #[arg(long)]
        route: String,
        /// A provider name (or provider/model) of the route.
        #[arg(long)]
        target: Option<String>,
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
    },
    /// List every route's targets with their certification state.
    Routes {
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("idem: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Serve { config } => idem::cli::serve(config.as_deref()).await,
            Command::Demo(args) => idem::demo::run(args).await,
            Command::MockUpstream(args) => {
                let _log = idem::cli::init_logging("text");
                idem::mock_upstream::run(args).await
            }
            Command::HashKey { key } => {
                println!("{}", idem::tenants::hashed_key(&key));
                Ok(())
            }
            Command::Init { file, force } => idem::cli::init(&file, force),
            Command::Config { config } => idem::cli::print_config(config.as_deref()),
            Command::Check { config } => idem::cli::check(config.as_deref()),
            Command::Certify {
                route,
                target,
                config,
            } => idem::cli::certify(config.as_deref(), &route, target.as_deref()).await,
            Command::Routes { config } => idem::cli::routes(config.as_deref()).await,
            Command::Analyze(args) => idem::analyze::run(args).map_err(Into::into),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem: {e:#}");
            ExitCode::FAILURE
        }
    }
}
