//! The private servers of `services.rs` die with the test process that
//! started them, however it ends, and missing server programs fail every
//! test that needs them at once, with one message.
//!
//! Each test runs this test binary again as a child process (the test
//! itself, selected with `--exact`, told its part by
//! `IDEM_TEST_SERVICES_CHILD`), since what is checked happens when a
//! process ends.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::services;

const CHILD: &str = "IDEM_TEST_SERVICES_CHILD";
const DIE: &str = "private_services::private_servers_die_with_their_test_process";
const MISSING: &str = "private_services::missing_server_programs_fail_every_test_at_once";

/// This test binary as a child running `test` alone, as `part`.
fn child(test: &str, part: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, part)
        .env("IDEM_TEST_SERVICES", "private")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// The child's part: start both private servers, use them, say which they
/// are, then end as `how` says.
fn servers_then_end(how: &str) {
    let pg = services::postgres().unwrap_or_else(|e| panic!("{e}"));
    let redis = services::redis().unwrap_or_else(|e| panic!("{e}"));
    assert!(pg.private.is_some() && redis.private.is_some());
    // Both answer.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use sqlx::Connection;
        let mut c = sqlx::postgres::PgConnection::connect(&pg.url)
            .await
            .unwrap();
        sqlx::query("SELECT 1").execute(&mut c).await.unwrap();
    });
    let mut r = redis::Client::open(redis.url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let pong: String = redis::cmd("PING").query(&mut r).unwrap();
    assert_eq!(pong, "PONG");
    let servers: Vec<Value> = services::private_servers()
        .iter()
        .map(|(name, p)| {
            json!({"name": name, "pid": p.pid, "port": p.port, "dir": p.dir, "watchdog": p.watchdog_pid})
        })
        .collect();
    println!("PRIVATE {}", json!(servers));
    // The parent looks at the servers, then says how to end: a line to
    // exit or panic; nothing for a signal (standard input stays open).
    let mut go = String::new();
    let _ = std::io::stdin().read_line(&mut go);
    match how {
        "exit" => {}
        "panic" => panic!("a test that panics while the private servers run"),
        _ => {
            let _ = std::io::stdin().lines().count();
        }
    }
}

/// Every process whose parent is `pid`, and theirs.
fn descendants(pid: u32) -> Vec<u32> {
    let out = Command::new("ps")
        .args(["-e", "-o", "pid=,ppid="])
        .output()
        .unwrap();
    let pairs: Vec<(u32, u32)> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut it = l.split_whitespace().map(|n| n.parse().ok());
            Some((it.next()??, it.next()??))
        })
        .collect();
    let mut found = vec![pid];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(
            pairs
                .iter()
                .filter(|(_, pp)| *pp == parent)
                .map(|(p, _)| *p),
        );
        i += 1;
    }
    found
}

/// Whether `pid` runs (a zombie, dead but not yet reaped, does not).
fn running(pid: u32) -> bool {
    let out = Command::new("ps")
        .args(["-o", "stat=", "-p", &pid.to_string()])
        .output()
        .unwrap();
    let stat = String::from_utf8_lossy(&out.stdout).trim().to_string();
    !stat.is_empty() && !stat.starts_with('Z')
}

fn signal(sig: &str, target: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), "--", target])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{sig} {target}");
}

/// A private PostgreSQL and Redis started by a test process are gone once
/// that process has ended, whether it exited, a test panicked, it was
/// interrupted as Ctrl-C does (SIGINT to its whole process group) or
/// killed: no server process, none of their children, no watchdog, no
/// folder, nothing on their ports.
#[test]
fn private_servers_die_with_their_test_process() {
    if let Ok(how) = std::env::var(CHILD) {
        return servers_then_end(&how);
    }
    for how in ["exit", "panic", "interrupt", "kill"] {
        let mut cmd = child(DIE, how);
        // Its own group, as a test run in a terminal has.
        cmd.process_group(0);
        let mut proc = cmd.spawn().unwrap();
        let stdout = proc.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut said = Vec::new();
        let servers: Vec<Value> = loop {
            match rx.recv_timeout(Duration::from_secs(120)) {
                // libtest prints the test's name on the line before its output.
                Ok(line) => match line.split_once("PRIVATE ").map(|(_, v)| v) {
                    Some(v) => {
                        break serde_json::from_str::<Value>(v)
                            .unwrap()
                            .as_array()
                            .unwrap()
                            .clone();
                    }
                    None => said.push(line),
                },
                Err(e) => {
                    let _ = proc.kill();
                    let out = proc.wait_with_output().unwrap();
                    panic!(
                        "{how}: the child never named its servers ({e}): {said:?} {}",
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            }
        };
        assert_eq!(servers.len(), 2, "{servers:?}");
        let mut pids = Vec::new();
        let mut dirs = Vec::new();
        let mut ports = Vec::new();
        for s in &servers {
            let pid = s["pid"].as_u64().unwrap() as u32;
            pids.extend(descendants(pid));
            pids.push(s["watchdog"].as_u64().unwrap() as u32);
            dirs.push(PathBuf::from(s["dir"].as_str().unwrap()));
            ports.push(s["port"].as_u64().unwrap() as u16);
            assert!(running(pid), "{how}: {} is not running", s["name"]);
        }
        // The server's own children too (PostgreSQL's checkpointer...).
        assert!(pids.len() > 4, "{how}: {pids:?}");
        match how {
            "interrupt" => signal("INT", &format!("-{}", proc.id())),
            "kill" => signal("KILL", &proc.id().to_string()),
            _ => writeln!(proc.stdin.as_mut().unwrap(), "go").unwrap(),
        }
        let status = proc.wait().unwrap();
        match how {
            "exit" => assert!(status.success(), "{how}: {status}"),
            "panic" => assert_eq!(status.code(), Some(101), "{how}: {status}"),
            "interrupt" => assert_eq!(status.signal(), Some(2), "{how}: {status}"),
            _ => assert_eq!(status.signal(), Some(9), "{how}: {status}"),
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left: Vec<u32> = pids.iter().copied().filter(|p| running(*p)).collect();
            let kept: Vec<&PathBuf> = dirs.iter().filter(|d| d.exists()).collect();
            if left.is_empty() && kept.is_empty() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{how}: 60 s after the test process ended, processes {left:?} still run and \
                 folders {kept:?} remain"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        for port in ports {
            assert!(
                std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
                "{how}: something still answers on port {port}"
            );
        }
    }
}

/// The child's part: the server programs are nowhere to be found; every
/// ask fails with the same message naming the packages, and every ask
/// after the first at once.
fn missing_then_ask() {
    for (name, ask, packages) in [
        (
            "PostgreSQL",
            services::postgres as fn() -> Result<&'static services::Service, String>,
            ["apt-get install postgresql", "brew install postgresql"],
        ),
        (
            "Redis",
            services::redis,
            ["apt-get install redis-server", "brew install redis"],
        ),
    ] {
        let first = ask()
            .err()
            .unwrap_or_else(|| panic!("{name}: a server without its programs"));
        for p in packages {
            assert!(first.contains(p), "{name}: {first}");
        }
        // The other tests, asking at once from threads of their own.
        let asks: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(move || {
                    let t = Instant::now();
                    (ask().err(), t.elapsed())
                })
            })
            .collect();
        for a in asks {
            let (again, took) = a.join().unwrap();
            assert_eq!(again.as_deref(), Some(first.as_str()), "{name}");
            assert!(took < Duration::from_millis(100), "{name}: {took:?}");
        }
        println!("MESSAGE {first}");
    }
}

/// Without the server programs (`IDEM_TEST_SERVER_BINS` names an empty
/// folder), the first test that needs PostgreSQL or Redis fails with one
/// message naming the packages to install, and every other test fails at
/// once with the same message, not after a timeout.
#[test]
fn missing_server_programs_fail_every_test_at_once() {
    if std::env::var(CHILD).is_ok() {
        return missing_then_ask();
    }
    let empty = crate::helpers::temp_dir();
    let out = child(MISSING, "missing")
        .env("IDEM_TEST_SERVER_BINS", &empty)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&empty);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let messages: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.split_once("MESSAGE ").map(|(_, m)| m))
        .collect();
    assert_eq!(messages.len(), 2, "{stdout}");
    assert!(
        messages[0].contains("PostgreSQL") && messages[0].contains("initdb"),
        "{}",
        messages[0]
    );
    assert!(messages[1].contains("redis-server"), "{}", messages[1]);
}
