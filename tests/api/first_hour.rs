//! A newcomer's first hour, against the real binary: `idem serve` says
//! where the dashboard and the request log are; the dashboard's sign-in
//! card knows whether the gateway has an admin key; the commands read the
//! `./idem.toml` that `idem init` wrote; a closed pipe ends a command
//! quietly; `idem hash-key -` reads the key from standard input.

use std::ffi::OsStr;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;

use crate::helpers::*;

/// `idem` with these arguments in `dir`, without the caller's `IDEM_*`
/// configuration, `stdin` written to its standard input.
fn idem_in(dir: &Path, args: &[&str], envs: &[(&str, &str)], stdin: &[u8]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem"));
    cmd.current_dir(dir)
        .args(args)
        .env_remove("IDEM_CONFIG")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    child.wait_with_output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The next line the process prints that contains `needle`.
async fn line_with(proc: &mut Proc, needle: &str) -> String {
    tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(line) = proc.lines.recv().await {
            if line.contains(needle) {
                return line;
            }
        }
        panic!("idem exited without printing {needle:?}");
    })
    .await
    .unwrap_or_else(|_| panic!("no line with {needle:?} within 10 s"))
}

/// On the embedded default, `idem serve` prints the dashboard's URL, that
/// no admin key is set and how to set one, and that the request log goes
/// to standard output; with a config file, that an admin key is set and
/// the request log's file. The URL printed serves the page.
#[tokio::test]
async fn serve_says_where_the_dashboard_and_the_request_log_are() {
    let dir = temp_dir();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let mut proc = Proc::start_in(
        Some(&dir),
        &[OsStr::new("serve")],
        &[
            ("IDEM_SERVER__LISTEN", "127.0.0.1:0"),
            ("IDEM_STORAGE__URL", db.as_str()),
        ],
    )
    .await;
    let line = line_with(&mut proc, "dashboard").await;
    let url = format!("{}/ui", proc.base);
    assert!(line.contains(&format!("url={url}")), "{line}");
    assert!(
        line.contains("none configured") && line.contains("IDEM_ADMIN__API_KEYS"),
        "{line}"
    );
    let line = line_with(&mut proc, "request log").await;
    assert!(
        line.contains("to=\"stdout\"") && line.contains("idem analyze"),
        "{line}"
    );
    let page = client().get(&url).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("idem · live dashboard"));
    proc.signal("TERM");
    let _ = proc.child.wait().await;

    // A file with an admin key and a request log file (JSON lines).
    let mocks = start_mocks(&Spec::default()).await;
    let log = dir.join("requests.log");
    let config = dir.join("with-admin.toml");
    let mut text = config_text(&Spec::default(), &mocks, &db, "127.0.0.1:0");
    text = text.replace(
        "[log]\n",
        &format!("[log]\nrequests = \"{}\"\n", log.display()),
    );
    std::fs::write(&config, text).unwrap();
    let mut proc = Proc::start(&config, &[]).await;
    let line = line_with(&mut proc, "\"dashboard\"").await;
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["url"], format!("{}/ui", proc.base));
    assert!(
        v["admin_key"].as_str().unwrap().starts_with("configured"),
        "{v}"
    );
    let line = line_with(&mut proc, "\"request log\"").await;
    let v: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(v["to"], log.display().to_string());
    proc.signal("TERM");
    let _ = proc.child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The sign-in card asks `/ui/sign-in` whether the gateway has an admin key:
/// the embedded default has none (and refuses every key on the admin
/// endpoints, so the card says how to set one); a gateway with one says so.
#[tokio::test]
async fn the_sign_in_card_learns_whether_an_admin_key_exists() {
    let dir = temp_dir();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let mut proc = Proc::start_in(
        Some(&dir),
        &[OsStr::new("serve")],
        &[
            ("IDEM_SERVER__LISTEN", "127.0.0.1:0"),
            ("IDEM_STORAGE__URL", db.as_str()),
        ],
    )
    .await;
    let c = client();
    let r = c
        .get(format!("{}/ui/sign-in", proc.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["cache-control"], "no-store");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v, serde_json::json!({"admin_key_configured": false}));
    let r = c
        .get(format!("{}/v1/admin/routes", proc.base))
        .bearer_auth("any-key-at-all")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403, "no key is an admin key");
    proc.signal("TERM");
    let _ = proc.child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);

    let app = TestApp::spawn().await;
    let (status, v) = app.get_json("", "/ui/sign-in").await;
    assert_eq!(status, 200);
    assert_eq!(v, serde_json::json!({"admin_key_configured": true}));
    app.stop().await;
}

/// `idem init` writes `./idem.toml`; `idem check`, `idem config` and `idem
/// serve` then use it without `--config`, and say so on standard error.
/// Without the file they use the embedded default; `--config` wins.
#[tokio::test]
async fn commands_use_the_idem_toml_of_the_current_folder() {
    let dir = temp_dir();
    let keys = [
        ("OPENAI_API_KEY", "sk-test"),
        ("ANTHROPIC_API_KEY", "sk-test"),
    ];
    // Without a file: the embedded default, nothing said.
    let out = idem_in(&dir, &["check"], &keys, b"");
    assert!(out.status.success(), "{out:?}");
    assert!(
        text(&out.stdout).starts_with("<embedded default>: ok"),
        "{out:?}"
    );
    assert!(!text(&out.stderr).contains("idem.toml"), "{out:?}");

    let out = idem_in(&dir, &["init"], &keys, b"");
    assert!(out.status.success(), "{out:?}");
    assert!(dir.join("idem.toml").is_file());
    let said = "using ./idem.toml";

    let out = idem_in(&dir, &["check"], &keys, b"");
    assert!(out.status.success(), "{out:?}");
    assert!(text(&out.stdout).starts_with("idem.toml: ok"), "{out:?}");
    assert!(text(&out.stdout).contains("route chat"), "{out:?}");
    assert!(text(&out.stderr).contains(said), "{out:?}");

    let out = idem_in(&dir, &["config"], &keys, b"");
    assert!(out.status.success(), "{out:?}");
    assert!(
        text(&out.stdout).starts_with("# the effective configuration of idem.toml"),
        "{out:?}"
    );
    assert!(text(&out.stderr).contains(said), "{out:?}");

    // --config names another file: that one, nothing said.
    std::fs::write(dir.join("other.toml"), "").unwrap();
    let out = idem_in(&dir, &["check", "--config", "other.toml"], &keys, b"");
    assert!(text(&out.stdout).starts_with("other.toml: ok"), "{out:?}");
    assert!(!text(&out.stderr).contains(said), "{out:?}");

    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let mut proc = Proc::start_in(
        Some(&dir),
        &[OsStr::new("serve")],
        &[
            ("IDEM_SERVER__LISTEN", "127.0.0.1:0"),
            ("IDEM_STORAGE__URL", db.as_str()),
            ("OPENAI_API_KEY", "sk-test"),
            ("ANTHROPIC_API_KEY", "sk-test"),
        ],
    )
    .await;
    // The starter's routes, not the embedded default's `mock`.
    let r = client()
        .get(format!("{}/v1/models", proc.base))
        .bearer_auth(
            toml::from_str::<toml::Value>(&std::fs::read_to_string(dir.join("idem.toml")).unwrap())
                .unwrap()["tenants"][0]["api_keys"][0]
                .as_str()
                .unwrap(),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let models: Value = r.json().await.unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&"chat") && !ids.contains(&"mock"), "{ids:?}");
    proc.signal("TERM");
    let _ = proc.child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A reader that stopped reading (`idem config | head`) ends a command
/// quietly, successfully and without a panic, whether the command writes
/// through the CLI's own output or prints as it goes (`idem demo`).
#[test]
fn a_closed_pipe_ends_a_command_quietly() {
    let dir = temp_dir();
    for args in [
        &["config"][..],
        &["check"],
        &["hash-key", "sk-some-key"],
        &["demo", "--requests", "5", "--latency-ms", "10"],
    ] {
        // A pipe whose reading end is closed: the first write fails.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .current_dir(&dir)
            .args(args)
            .env_remove("IDEM_CONFIG")
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert!(out.status.success(), "{args:?}: {} {err}", out.status);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("Broken pipe"), "{args:?}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `idem hash-key -` reads the key from standard input (one line, its line
/// ending not part of it) and prints what `idem hash-key KEY` prints; an
/// empty input or several lines are refused.
#[test]
fn hash_key_reads_the_key_from_standard_input() {
    let dir = temp_dir();
    let direct = idem_in(&dir, &["hash-key", "sk-acme-secret"], &[], b"");
    assert!(direct.status.success(), "{direct:?}");
    let expected = text(&direct.stdout);
    assert!(
        expected.starts_with("sha256:") && expected.len() == 7 + 64 + 1,
        "{expected}"
    );
    for input in [
        &b"sk-acme-secret\n"[..],
        b"sk-acme-secret\r\n",
        b"sk-acme-secret",
    ] {
        let out = idem_in(&dir, &["hash-key", "-"], &[], input);
        assert!(out.status.success(), "{out:?}");
        assert_eq!(text(&out.stdout), expected, "{input:?}");
    }
    // Not the hash of "-".
    let dash = idem_in(&dir, &["hash-key", "--", "-"], &[], b"sk-acme-secret\n");
    assert_eq!(text(&dash.stdout), expected);
    for (input, says) in [
        (&b""[..], "no key"),
        (b"\n", "no key"),
        (b"a\nb\n", "more than one line"),
    ] {
        let out = idem_in(&dir, &["hash-key", "-"], &[], input);
        assert!(!out.status.success(), "{input:?}: {out:?}");
        assert!(text(&out.stderr).contains(says), "{input:?}: {out:?}");
        assert!(out.stdout.is_empty());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
