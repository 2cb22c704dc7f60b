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
    /// Run the gateway (without --config: ./idem.toml if it exists, else
    /// the embedded default).
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
    HashKey {
        /// The key; `-` reads it from standard input (one line), which keeps
        /// it out of the shell's history and the process list.
        key: String,
    },
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
    /// Manage the API keys kept in the store (virtual keys): create, list,
    /// show, update, revoke, rotate, audit.
    Keys(idem::cli::KeysArgs),
    /// List every route's targets with their certification state.
    Routes {
        #[arg(long, env = "IDEM_CONFIG")]
        config: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    quiet_on_broken_pipe();
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
        use idem::cli::config_file;
        match cli.command {
            Command::Serve { config } => idem::cli::serve(config_file(config).as_deref()).await,
            Command::Demo(args) => idem::demo::run(args).await,
            Command::MockUpstream(args) => {
                let _log = idem::cli::init_logging("text");
                idem::mock_upstream::run(args).await
            }
            Command::HashKey { key } => idem::cli::hash_key(&key),
            Command::Init { file, force } => idem::cli::init(&file, force),
            Command::Config { config } => idem::cli::print_config(config_file(config).as_deref()),
            Command::Check { config } => idem::cli::check(config_file(config).as_deref()),
            Command::Certify {
                route,
                target,
                config,
            } => {
                let config = config_file(config);
                idem::cli::certify(config.as_deref(), &route, target.as_deref()).await
            }
            Command::Keys(args) => idem::cli::keys(args).await,
            Command::Routes { config } => idem::cli::routes(config_file(config).as_deref()).await,
            Command::Analyze(args) => idem::analyze::run(args).map_err(Into::into),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`idem config | head`): nothing to say.
        Err(e) if idem::cli::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Standard output closed by its reader (`idem analyze log | head`) ends the
/// process quietly, as it would a C program's: Rust ignores SIGPIPE, so a
/// `println!` there panics. The subcommands of `cli` write with
/// `idem::cli::print` and return the error as a value; this hook covers
/// the others' `println!`, whose panic message names the failed write.
fn quiet_on_broken_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or_default();
        // "failed printing to stdout: Broken pipe (os error 32)"
        if message.starts_with("failed printing to stdout")
            && message.to_ascii_lowercase().contains("broken pipe")
        {
            std::process::exit(0);
        }
        default(info);
    }));
}
