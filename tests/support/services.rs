//! The services the tests need, PostgreSQL and Redis: found, or started,
//! once per test process. The library's unit tests include this file
//! (`src/lib.rs`, under `cfg(test)`), and so do the integration tests
//! (`tests/api`) and the chaos test (`tests/chaos`); cargo runs each test
//! binary as a process of its own, so each has its own servers.
//!
//! Which server the tests of a process get, decided when a test first asks:
//!
//! 1. `IDEM_TEST_DATABASE_URL`, `IDEM_TEST_REDIS_URL`: that server, which
//!    must answer.
//! 2. `IDEM_TEST_SERVICES=private`: a private server, even when the
//!    machine's answer (CI runs the store and flight suites this way too).
//! 3. Otherwise the machine's server at the default address
//!    ([`DEFAULT_PG_URL`], [`DEFAULT_REDIS_URL`]) when it answers and lets
//!    the tests in; else a private server, and a line on standard error says
//!    why. So `cargo test` needs nothing started or prepared by hand, only
//!    the server programs installed.
//!
//! A private server runs from a temporary folder on a free port of
//! 127.0.0.1: PostgreSQL in a cluster made by `initdb` (as the `postgres`
//! user when the tests run as root, since the server refuses root), Redis
//! without persistence. It dies with the test process, however that ends
//! (a normal exit, a panic, Ctrl-C, SIGKILL): beside it runs a watchdog, a
//! small `sh` process that reads a pipe whose other end only the test
//! process holds. When the test process is gone the pipe closes, and the
//! watchdog stops the server and removes its folder. The server and the
//! watchdog each have a process group of their own, so the Ctrl-C that a
//! terminal sends to the test process's group reaches neither of them
//! before the watchdog does its work.
//!
//! The outcome is kept: when the server programs are missing, the first
//! test that needs one fails with a message naming the packages to install,
//! and every later one fails at once with the same message.

#![allow(
    dead_code,
    reason = "each test crate that includes this file uses part of it"
)]

use std::io::Write;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The machine's PostgreSQL as the tests look for it.
pub const DEFAULT_PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
/// The machine's Redis as the tests look for it.
pub const DEFAULT_REDIS_URL: &str = "redis://127.0.0.1:6379";

/// What to install for a private PostgreSQL.
pub const PG_PACKAGES: &str =
    "Debian/Ubuntu: `apt-get install postgresql`; Homebrew: `brew install postgresql@17`";
/// What to install for a private Redis.
pub const REDIS_PACKAGES: &str =
    "Debian/Ubuntu: `apt-get install redis-server`; Homebrew: `brew install redis`";

/// How long a private server may take to answer once started.
const START_LIMIT: Duration = Duration::from_secs(60);

/// A server the tests use.
pub struct Service {
    /// Its URL, for the tests' connections.
    pub url: String,
    /// Set when this process started it.
    pub private: Option<Private>,
}

/// A server this process started, and its watchdog.
pub struct Private {
    /// The server's process id.
    pub pid: u32,
    /// Its port on 127.0.0.1.
    pub port: u16,
    /// Its folder (data, socket, log), removed by the watchdog.
    pub dir: PathBuf,
    /// The watchdog's process id.
    pub watchdog_pid: u32,
    // Held until the process ends: the server's handle, and the write end
    // of the watchdog's pipe, whose closing tells the watchdog to act.
    _server: Mutex<Child>,
    _watchdog: Mutex<Watchdog>,
}

static POSTGRES: OnceLock<Result<Service, String>> = OnceLock::new();
static REDIS: OnceLock<Result<Service, String>> = OnceLock::new();

/// The PostgreSQL of this test process, found or started on first use; or
/// why there is none (the same message for every test that asks).
pub fn postgres() -> Result<&'static Service, String> {
    POSTGRES
        .get_or_init(|| on_a_thread_of_its_own(find_postgres))
        .as_ref()
        .map_err(Clone::clone)
}

/// The Redis of this test process, as [`postgres`].
pub fn redis() -> Result<&'static Service, String> {
    REDIS
        .get_or_init(|| on_a_thread_of_its_own(find_redis))
        .as_ref()
        .map_err(Clone::clone)
}

/// The URL of [`postgres`]; fails the calling test with the reason when
/// there is none.
pub fn postgres_url() -> String {
    match postgres() {
        Ok(s) => s.url.clone(),
        Err(why) => panic!("{why}"),
    }
}

/// The URL of [`redis`]; fails the calling test with the reason when there
/// is none.
pub fn redis_url() -> String {
    match redis() {
        Ok(s) => s.url.clone(),
        Err(why) => panic!("{why}"),
    }
}

/// The private servers this process has started so far: (name, server).
pub fn private_servers() -> Vec<(&'static str, &'static Private)> {
    let mut out = Vec::new();
    for (name, cell) in [("postgres", &POSTGRES), ("redis-server", &REDIS)] {
        if let Some(Ok(Service {
            private: Some(p), ..
        })) = cell.get()
        {
            out.push((name, p));
        }
    }
    out
}

/// Runs `f` on a new thread: it may block and run a runtime of its own,
/// whatever runtime the asking test runs on.
fn on_a_thread_of_its_own(
    f: impl FnOnce() -> Result<Service, String> + Send + 'static,
) -> Result<Service, String> {
    std::thread::spawn(f)
        .join()
        .unwrap_or_else(|_| Err("finding the test services panicked".into()))
}

/// Says something once on the process's standard error, past the test
/// harness's capture of a test's output.
fn note(text: &str) {
    let _ = writeln!(std::io::stderr(), "idem tests: {text}");
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// `IDEM_TEST_SERVICES`: true for `private`.
fn private_forced() -> Result<bool, String> {
    match env("IDEM_TEST_SERVICES").as_deref() {
        None | Some("auto") => Ok(false),
        Some("private") => Ok(true),
        Some(other) => Err(format!(
            "IDEM_TEST_SERVICES must be `private` (or unset), not {other:?}"
        )),
    }
}

fn find_postgres() -> Result<Service, String> {
    let rt = runtime()?;
    let why = if private_forced()? {
        "IDEM_TEST_SERVICES=private".to_string()
    } else if let Some(url) = env("IDEM_TEST_DATABASE_URL") {
        return match pg_answers(&rt, &url) {
            Ok(()) => Ok(Service { url, private: None }),
            Err(e) => Err(format!(
                "PostgreSQL at {url} (IDEM_TEST_DATABASE_URL) is not usable: {e}. Start it, \
                 or unset IDEM_TEST_DATABASE_URL to let the tests start a private server"
            )),
        };
    } else {
        match pg_answers(&rt, DEFAULT_PG_URL) {
            Ok(()) => {
                return Ok(Service {
                    url: DEFAULT_PG_URL.into(),
                    private: None,
                });
            }
            Err(e) => format!("nothing usable at {DEFAULT_PG_URL}: {e}"),
        }
    };
    let private = start_postgres(&rt).map_err(|e| {
        format!(
            "the tests need PostgreSQL ({why}) and cannot start a private one: {e}. \
             Or set IDEM_TEST_DATABASE_URL to a server's URL"
        )
    })?;
    let url = pg_private_url(private.port);
    note(&format!(
        "PostgreSQL: a private server on 127.0.0.1:{} for this test process ({why})",
        private.port
    ));
    Ok(Service {
        url,
        private: Some(private),
    })
}

fn find_redis() -> Result<Service, String> {
    let why = if private_forced()? {
        "IDEM_TEST_SERVICES=private".to_string()
    } else if let Some(url) = env("IDEM_TEST_REDIS_URL") {
        return match redis_answers(&url) {
            Ok(()) => Ok(Service { url, private: None }),
            Err(e) => Err(format!(
                "Redis at {url} (IDEM_TEST_REDIS_URL) is not usable: {e}. Start it, or unset \
                 IDEM_TEST_REDIS_URL to let the tests start a private server"
            )),
        };
    } else {
        match redis_answers(DEFAULT_REDIS_URL) {
            Ok(()) => {
                return Ok(Service {
                    url: DEFAULT_REDIS_URL.into(),
                    private: None,
                });
            }
            Err(e) => format!("nothing usable at {DEFAULT_REDIS_URL}: {e}"),
        }
    };
    let private = start_redis().map_err(|e| {
        format!(
            "the tests need Redis ({why}) and cannot start a private one: {e}. \
             Or set IDEM_TEST_REDIS_URL to a server's URL"
        )
    })?;
    let url = redis_private_url(private.port);
    note(&format!(
        "Redis: a private server on 127.0.0.1:{} for this test process ({why})",
        private.port
    ));
    Ok(Service {
        url,
        private: Some(private),
    })
}

fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))
}

/// Connects to PostgreSQL at `url` and runs a query.
fn pg_answers(rt: &tokio::runtime::Runtime, url: &str) -> Result<(), String> {
    use sqlx::Connection;
    rt.block_on(async {
        let connect = sqlx::postgres::PgConnection::connect(url);
        let mut conn = match tokio::time::timeout(Duration::from_secs(5), connect).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => return Err("no answer within 5 s".into()),
        };
        let ok = sqlx::query("SELECT 1")
            .execute(&mut conn)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string());
        let _ = conn.close().await;
        ok
    })
}

/// Sends PING to Redis at `url`.
fn redis_answers(url: &str) -> Result<(), String> {
    redis::Client::open(url)
        .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
        .map(|_| ())
        .map_err(|e| e.to_string())
}

pub fn pg_private_url(port: u16) -> String {
    format!("postgres://postgres@127.0.0.1:{port}/postgres")
}

pub fn redis_private_url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}")
}

/// A port of 127.0.0.1 that is free now.
pub fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port on 127.0.0.1: {e}"))
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// `program` as a command that runs as the `postgres` user when this
/// process is root (PostgreSQL refuses to run as root), else as is.
/// `setpriv` executes the program in its own process: its id is the
/// program's.
pub fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// The folders searched for the server programs: `IDEM_TEST_SERVER_BINS`
/// (`:`-separated) when set, else `PATH` and the folders packages install
/// them in that are not on it (Debian's `/usr/lib/postgresql/<version>/bin`,
/// newest first, Red Hat's `/usr/pgsql-<version>/bin`, Homebrew's).
fn search_dirs(versioned: &[(&str, &str)]) -> Vec<PathBuf> {
    if let Some(dirs) = std::env::var_os("IDEM_TEST_SERVER_BINS") {
        return std::env::split_paths(&dirs).collect();
    }
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for (parent, prefix) in versioned {
        let mut found: Vec<(Vec<u32>, PathBuf)> = std::fs::read_dir(parent)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let version = name.strip_prefix(prefix)?;
                let v: Vec<u32> = version
                    .split('.')
                    .map(|p| p.parse().ok())
                    .collect::<Option<_>>()?;
                Some((v, e.path().join("bin")))
            })
            .collect();
        found.sort();
        dirs.extend(found.into_iter().rev().map(|(_, d)| d));
    }
    dirs.extend(
        [
            "/usr/local/bin",
            "/opt/homebrew/bin",
            "/usr/bin",
            "/usr/sbin",
        ]
        .iter()
        .map(PathBuf::from),
    );
    dirs
}

/// The folder holding PostgreSQL's server programs (`initdb`, `pg_ctl`,
/// `postgres`), or a message naming the packages to install.
pub fn pg_bin_dir() -> Result<PathBuf, String> {
    let dirs = search_dirs(&[
        ("/usr/lib/postgresql", ""),
        ("/usr", "pgsql-"),
        ("/opt/homebrew/opt", "postgresql@"),
        ("/usr/local/opt", "postgresql@"),
    ]);
    dirs.iter()
        .find(|d| {
            ["initdb", "pg_ctl", "postgres"]
                .iter()
                .all(|p| d.join(p).is_file())
        })
        .cloned()
        .ok_or_else(|| {
            format!(
                "PostgreSQL's server programs (initdb, pg_ctl, postgres) are not installed \
                 ({PG_PACKAGES})"
            )
        })
}

/// `redis-server`, or a message naming the packages to install.
pub fn redis_server_bin() -> Result<PathBuf, String> {
    search_dirs(&[])
        .iter()
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
        .ok_or_else(|| format!("redis-server is not installed ({REDIS_PACKAGES})"))
}

/// A fresh folder under the system's temporary folder.
pub fn private_dir(what: &str) -> Result<PathBuf, String> {
    let dir = std::env::temp_dir().join(format!(
        "idem-test-{what}-{}",
        uuid::Uuid::now_v7().simple()
    ));
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    Ok(dir)
}

/// Makes a PostgreSQL cluster in `data` (a folder that does not exist yet,
/// in one the server's user may write): trust authentication for the
/// `postgres` user, UTF-8. As root, `data`'s parent is given to the
/// `postgres` user first.
pub fn initdb(bin: &Path, data: &Path) -> Result<(), String> {
    if is_root()
        && let Some(parent) = data.parent()
    {
        let owned = Command::new("chown")
            .arg("postgres")
            .arg(parent)
            .status()
            .is_ok_and(|s| s.success());
        if !owned {
            return Err(format!(
                "running as root: {} must belong to the `postgres` user, who runs the server \
                 (PostgreSQL refuses root), and `chown postgres` failed: does that user exist? \
                 ({PG_PACKAGES} creates it)",
                parent.display()
            ));
        }
    }
    let out = as_postgres(&bin.join("initdb"))
        .arg("-D")
        .arg(data)
        .args(["-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8"])
        .current_dir(data.parent().unwrap_or(Path::new("/")))
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.join("initdb").display()))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "initdb failed in {}: {}",
            data.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The watchdog: a `sh` process in a process group of its own that reads
/// its standard input, a pipe whose write end only this process holds,
/// until the pipe closes, which happens when this process ends, however it
/// ends. Each line written to it is a server's process id (the last one
/// counts); then it sends that process `signal`, waits up to 30 s for it to
/// go (then SIGKILL), and removes the folder.
pub struct Watchdog {
    child: Child,
    pipe: ChildStdin,
}

const WATCHDOG: &str = r#"pid=
while read -r line; do pid=$line; done
if [ -n "$pid" ]; then
  kill -"$1" "$pid" 2>/dev/null
  n=0
  while kill -0 "$pid" 2>/dev/null && [ "$n" -lt 300 ]; do sleep 0.1; n=$((n + 1)); done
  kill -KILL "$pid" 2>/dev/null
fi
rm -rf -- "$2"
"#;

impl Watchdog {
    /// Starts a watchdog over `dir`; `signal` (`INT`, `TERM`) is what stops
    /// the server cleanly.
    pub fn spawn(dir: &Path, signal: &str) -> Result<Watchdog, String> {
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(WATCHDOG)
            .arg("idem-test-watchdog")
            .arg(signal)
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| format!("cannot start the watchdog (sh): {e}"))?;
        let pipe = child
            .stdin
            .take()
            .ok_or_else(|| "the watchdog has no standard input".to_string())?;
        Ok(Watchdog { child, pipe })
    }

    /// From now on, `pid` is the server to stop.
    pub fn watch(&mut self, pid: u32) -> Result<(), String> {
        writeln!(self.pipe, "{pid}")
            .and_then(|()| self.pipe.flush())
            .map_err(|e| format!("the watchdog is gone: {e}"))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

/// Starts `command` (a server in the foreground) with its output in `log`,
/// in a process group of its own, under `watchdog`; waits until `ready`
/// holds. `Err(true)` when it exited first (worth another port), with what
/// it logged.
fn start_server(
    mut command: Command,
    log: &Path,
    watchdog: &mut Watchdog,
    ready: &mut dyn FnMut() -> bool,
) -> Result<Child, (bool, String)> {
    let file = std::fs::File::create(log)
        .map_err(|e| (false, format!("cannot create {}: {e}", log.display())))?;
    let err = file
        .try_clone()
        .map_err(|e| (false, format!("cannot open {}: {e}", log.display())))?;
    let mut child = command
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .process_group(0)
        .spawn()
        .map_err(|e| {
            (
                false,
                format!("cannot start {:?}: {e}", command.get_program()),
            )
        })?;
    if let Err(e) = watchdog.watch(child.id()) {
        let _ = child.kill();
        let _ = child.wait();
        return Err((false, e));
    }
    let tail = || {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(5)..].join(" | ")
    };
    let deadline = Instant::now() + START_LIMIT;
    loop {
        if ready() {
            return Ok(child);
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err((true, format!("it exited ({status}): {}", tail())));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err((
                false,
                format!("it did not answer within {START_LIMIT:?}: {}", tail()),
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A private PostgreSQL: `initdb`, then the server in the foreground on a
/// free port (another one if that port was taken meanwhile), tuned for
/// tests (no fsync).
fn start_postgres(rt: &tokio::runtime::Runtime) -> Result<Private, String> {
    let bin = pg_bin_dir()?;
    let dir = private_dir("pg")?;
    // First the watchdog: from here on the folder goes with this process.
    let mut watchdog = Watchdog::spawn(&dir, "INT")?;
    let data = dir.join("data");
    initdb(&bin, &data)?;
    let mut last = String::new();
    for attempt in 1..=3 {
        let port = free_port()?;
        let mut command = as_postgres(&bin.join("postgres"));
        command
            .arg("-D")
            .arg(&data)
            .arg("-p")
            .arg(port.to_string())
            .arg("-k")
            .arg(&dir)
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(["-c", "max_connections=300"])
            .args(["-c", "fsync=off", "-c", "synchronous_commit=off"])
            .args(["-c", "full_page_writes=off"])
            .current_dir(&dir);
        let url = pg_private_url(port);
        let log = dir.join(format!("server-{attempt}.log"));
        match start_server(command, &log, &mut watchdog, &mut || {
            pg_answers(rt, &url).is_ok()
        }) {
            Ok(child) => {
                return Ok(Private {
                    pid: child.id(),
                    port,
                    dir,
                    watchdog_pid: watchdog.pid(),
                    _server: Mutex::new(child),
                    _watchdog: Mutex::new(watchdog),
                });
            }
            Err((true, e)) => last = format!("the server on port {port}: {e}"),
            Err((false, e)) => return Err(format!("the server on port {port}: {e}")),
        }
    }
    Err(last)
}

/// A private Redis: `redis-server` in the foreground on a free port (another
/// one if that port was taken meanwhile), nothing saved.
fn start_redis() -> Result<Private, String> {
    let bin = redis_server_bin()?;
    let dir = private_dir("redis")?;
    let mut watchdog = Watchdog::spawn(&dir, "TERM")?;
    let mut last = String::new();
    for attempt in 1..=3 {
        let port = free_port()?;
        let mut command = Command::new(&bin);
        command
            .arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .current_dir(&dir);
        let url = redis_private_url(port);
        let log = dir.join(format!("server-{attempt}.log"));
        match start_server(command, &log, &mut watchdog, &mut || {
            redis_answers(&url).is_ok()
        }) {
            Ok(child) => {
                return Ok(Private {
                    pid: child.id(),
                    port,
                    dir,
                    watchdog_pid: watchdog.pid(),
                    _server: Mutex::new(child),
                    _watchdog: Mutex::new(watchdog),
                });
            }
            Err((true, e)) => last = format!("the server on port {port}: {e}"),
            Err((false, e)) => return Err(format!("the server on port {port}: {e}")),
        }
    }
    Err(last)
}
