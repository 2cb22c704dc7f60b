//! nginx as a plain reverse proxy in front of the mock: the baseline of
//! what one proxy hop costs on this machine (table 1). Found on `PATH` or in
//! the usual `sbin` folders; when it is missing and this process may run
//! `apt-get` (root, Debian), Debian's `nginx-light` is installed, and the
//! table says which of the two happened. Keepalive on both sides, no access
//! log, one worker process per core (idem's runtime has one worker thread
//! per core too); its CPU is the master's plus the workers'.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::procs::{Proc, Workdir, cpu_of, stat_field};

/// How long nginx may take to listen with all its workers.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// Set to `0` to forbid the bench to install nginx.
const INSTALL_ENV: &str = "IDEM_BENCH_INSTALL_NGINX";

/// The nginx binary, and how the bench came by it.
pub struct Found {
    pub path: PathBuf,
    /// `nginx version: nginx/1.22.1` without the prefix.
    pub version: String,
    /// "found" or "installed nginx-light with apt-get".
    pub how: &'static str,
}

impl Found {
    /// What the table's note says of the baseline.
    pub fn describe(&self) -> String {
        format!("{} ({}, {})", self.version, self.path.display(), self.how)
    }
}

/// nginx on this machine, installed first if it is missing and allowed;
/// else why there is none.
pub fn find_or_install() -> Result<Found, String> {
    if let Some(path) = locate() {
        return found(path, "found");
    }
    let allowed = std::env::var(INSTALL_ENV).map_or(true, |v| v.trim() != "0");
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0");
    let apt = Path::new("/usr/bin/apt-get").exists();
    if !(allowed && root && apt) {
        return Err(format!(
            "nginx not found (install it: apt-get install nginx-light{})",
            if allowed {
                ""
            } else {
                "; this run forbids installing it"
            }
        ));
    }
    println!("  nginx not found: installing nginx-light with apt-get (the baseline of table 1)");
    let installed = Command::new("apt-get")
        .args(["install", "-y", "-q", "nginx-light"])
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    match locate() {
        Some(path) if installed => found(path, "installed nginx-light with apt-get"),
        _ => Err("nginx not found, and apt-get install nginx-light failed".into()),
    }
}

fn locate() -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    on_path
        .into_iter()
        .chain(["/usr/sbin", "/usr/local/sbin", "/usr/local/nginx/sbin"].map(PathBuf::from))
        .map(|dir| dir.join("nginx"))
        .find(|p| p.is_file())
}

fn found(path: PathBuf, how: &'static str) -> Result<Found, String> {
    // `nginx -v` prints to stderr.
    let out = Command::new(&path)
        .arg("-v")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", path.display()))?;
    let text = String::from_utf8_lossy(&out.stderr);
    let version = text
        .trim()
        .strip_prefix("nginx version: ")
        .unwrap_or(text.trim())
        .to_string();
    Ok(Found { path, version, how })
}

/// A running nginx; stopped (master and workers) when dropped.
pub struct Nginx {
    proc: Proc,
    pub addr: SocketAddr,
    workers: Vec<u32>,
}

impl Nginx {
    /// nginx proxying every request to `upstream`, on a free loopback port.
    pub async fn start(
        dir: &Workdir,
        nginx: &Found,
        upstream: SocketAddr,
    ) -> anyhow::Result<Nginx> {
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get());
        // A port the kernel just handed out and took back: free unless
        // another process grabs it in the next instant.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        let d = dir.path.display();
        let config = format!(
            "daemon off;\n\
             master_process on;\n\
             worker_processes {workers};\n\
             pid {d}/nginx.pid;\n\
             error_log {d}/nginx-error.log warn;\n\
             events {{ worker_connections 4096; }}\n\
             http {{\n\
             \x20 access_log off;\n\
             \x20 client_body_temp_path {d}/nginx-body;\n\
             \x20 proxy_temp_path {d}/nginx-proxy;\n\
             \x20 fastcgi_temp_path {d}/nginx-fastcgi;\n\
             \x20 uwsgi_temp_path {d}/nginx-uwsgi;\n\
             \x20 scgi_temp_path {d}/nginx-scgi;\n\
             \x20 keepalive_requests 10000000;\n\
             \x20 upstream provider {{ server {upstream}; keepalive 64; keepalive_requests 10000000; }}\n\
             \x20 server {{\n\
             \x20   listen {addr} backlog=4096;\n\
             \x20   location / {{\n\
             \x20     proxy_pass http://provider;\n\
             \x20     proxy_http_version 1.1;\n\
             \x20     proxy_set_header Connection \"\";\n\
             \x20   }}\n\
             \x20 }}\n\
             }}\n"
        );
        let conf = dir.file("nginx.conf");
        std::fs::write(&conf, config)
            .with_context(|| format!("cannot write {}", conf.display()))?;
        let conf = conf
            .to_str()
            .context("the work folder's path is not UTF-8")?;
        let prefix = dir
            .path
            .to_str()
            .context("the work folder's path is not UTF-8")?;
        let early_log = dir.file("nginx-early.log");
        let early_log = early_log
            .to_str()
            .context("the work folder's path is not UTF-8")?;
        let mut proc = Proc::spawn_program(
            &nginx.path,
            "nginx",
            &["-p", prefix, "-c", conf, "-e", early_log],
            dir.file("nginx.log"),
        )?;
        let deadline = Instant::now() + START_TIMEOUT;
        let master = proc.pid();
        loop {
            if let Some(status) = proc.exited()? {
                let log = std::fs::read_to_string(dir.file("nginx-error.log"))
                    .or_else(|_| std::fs::read_to_string(dir.file("nginx-early.log")))
                    .unwrap_or_default();
                bail!(
                    "nginx exited ({status}): {}",
                    log.lines().last().unwrap_or("(no log)")
                );
            }
            let children = children_of(master);
            if children.len() >= workers && tokio::net::TcpStream::connect(addr).await.is_ok() {
                return Ok(Nginx {
                    proc,
                    addr,
                    workers: children,
                });
            }
            if Instant::now() > deadline {
                bail!(
                    "nginx did not listen on {addr} with {workers} workers within {START_TIMEOUT:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// CPU of the master and its workers so far.
    pub fn cpu(&self) -> anyhow::Result<Duration> {
        let mut total = self.proc.cpu()?;
        for pid in &self.workers {
            total += cpu_of(*pid)?;
        }
        Ok(total)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // Killing the master alone would leave its workers serving: ask it
        // to stop them (TERM is nginx's fast shutdown), then make sure.
        let signal = |sig: &str, pid: u32| {
            let _ = Command::new("kill")
                .args([sig, &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        };
        signal("-TERM", self.proc.pid());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && !matches!(self.proc.exited(), Ok(Some(_))) {
            std::thread::sleep(Duration::from_millis(20));
        }
        for pid in &self.workers {
            if Path::new(&format!("/proc/{pid}")).exists() {
                signal("-KILL", *pid);
            }
        }
    }
}

/// The processes whose parent is `pid`, from `/proc/*/stat`.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        // Field 4: the parent's pid.
        .filter(|child| stat_field::<u32>(*child, 4).ok() == Some(pid))
        .collect()
}
