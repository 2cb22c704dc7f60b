//! The README's examples as a newcomer copies them: its curl against
//! `idem serve` on the embedded default, and its minimal config, served.

use std::ffi::OsStr;

use crate::helpers::*;

/// The README's fenced blocks of `lang` that contain `needle`.
fn readme_block(lang: &str, needle: &str) -> String {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let fence = format!("```{lang}\n");
    readme
        .split(&fence)
        .skip(1)
        .filter_map(|rest| rest.split_once("\n```").map(|(block, _)| block))
        .find(|block| block.contains(needle))
        .unwrap_or_else(|| panic!("no ```{lang} block with {needle:?} in the README"))
        .to_string()
}

/// Runs a shell snippet; its standard output.
fn sh(script: &str) -> String {
    let out = std::process::Command::new("sh")
        .arg("-c")
        .arg(script)
        .output()
        .unwrap();
    assert!(out.status.success(), "{script}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test]
async fn the_readme_curl_works_against_the_embedded_default() {
    let dir = temp_dir();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    // `idem serve` as the README says, on a free port and a fresh file.
    let mut proc = Proc::start_args(
        &[OsStr::new("serve")],
        &[
            ("IDEM_SERVER__LISTEN", "127.0.0.1:0"),
            ("IDEM_STORAGE__URL", db.as_str()),
        ],
    )
    .await;
    let addr = proc.base.trim_start_matches("http://").to_string();
    let curl = readme_block("sh", "curl -s http://127.0.0.1:8080/v1/chat/completions")
        .replace("127.0.0.1:8080", &addr);
    let out = sh(&curl).to_ascii_lowercase();
    assert!(out.starts_with("http/1.1 200"), "{out}");
    // The headers the README shows.
    for header in [
        "idem-outcome: leader",
        "idem-fingerprint: v1:",
        "idem-provider: builtin-mock",
        "idem-cache-ttl-ms: ",
    ] {
        assert!(out.contains(header), "{header} missing: {out}");
    }
    // Asked again: the answer comes from the cache.
    assert!(sh(&curl).contains("idem-outcome: cache-hit"));
    proc.signal("TERM");
    let _ = proc.child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn the_readme_minimal_config_serves_its_route() {
    let mocks = start_mocks(&Spec::default()).await;
    let dir = temp_dir();
    // As copied, but for the provider's address: OpenAI is out of reach
    // here, so its base URL points at a mock that speaks its API.
    let text = readme_block("toml", "# idem.toml")
        .replace("https://api.openai.com/v1", &mocks.primary.base_url());
    assert!(text.contains(&mocks.primary.base_url()), "{text}");
    let config = dir.join("idem.toml");
    std::fs::write(&config, &text).unwrap();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let mut proc = Proc::start_args(
        &[
            OsStr::new("serve"),
            OsStr::new("--config"),
            config.as_os_str(),
        ],
        &[
            ("IDEM_SERVER__LISTEN", "127.0.0.1:0"),
            ("IDEM_STORAGE__URL", db.as_str()),
            ("OPENAI_API_KEY", "sk-provider-key"),
        ],
    )
    .await;
    // The tenant, key and route of the README's file.
    let r = client()
        .post(format!("{}/v1/chat/completions", proc.base))
        .bearer_auth("sk-acme-1")
        .json(&serde_json::json!({
            "model": "support-bot",
            "messages": [{"role": "user", "content": "Where is my order?"}]
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-provider"], "openai");
    let seen = &mocks.primary.stats().last_requests[0];
    assert_eq!(
        seen.authorization.as_deref(),
        Some("Bearer sk-provider-key")
    );
    assert_eq!(seen.body["model"], "gpt-4o-mini");
    proc.signal("TERM");
    let _ = proc.child.wait().await;
    let _ = std::fs::remove_dir_all(&dir);
}
