//! A client's field is the client's: whatever its name, it is part of the
//! request (fingerprinted, and forwarded or refused by its face's rules)
//! or refused outright. It never reaches anything idem uses internally:
//! a field named like a key idem once kept inside its own chat requests
//! (for the Messages and Responses forms) made a target obey the smuggled form while
//! the fingerprint ignored it, so two requests that differ only there
//! shared one cached answer.
//!
//! The names tried are every identifier-like string literal in idem's own
//! source that contains `idem`, so a new internal name cannot be missed.

use std::path::Path;
use std::time::Duration;

use idem::config::ProviderKind;
use serde_json::{Value, json};

use crate::helpers::*;

/// Every string literal of `src/` that looks like a JSON field name and
/// contains `idem`.
fn names_in_the_source() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let p = entry.path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|e| e == "rs") {
                out.push(p);
            }
        }
    }
    let mut files = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut files,
    );
    let literal = regex::Regex::new(r#""([a-z_]*idem[a-z0-9_]*)""#).unwrap();
    let mut names: Vec<String> = files
        .iter()
        .flat_map(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            literal
                .captures_iter(&text)
                .map(|c| c[1].to_string())
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The four ways a request enters, each with a request of route `bot`
/// that asks `prompt` and carries `field: value`.
#[derive(Debug, Clone, Copy)]
enum Entry {
    Chat,
    Messages,
    Responses,
    Jobs,
}

impl Entry {
    fn path(self) -> &'static str {
        match self {
            Entry::Chat => "/v1/chat/completions",
            Entry::Messages => "/v1/messages",
            Entry::Responses => "/v1/responses",
            Entry::Jobs => "/v1/jobs",
        }
    }

    fn body(self, prompt: &str, field: &str, value: &Value) -> Value {
        let mut b = match self {
            Entry::Chat | Entry::Jobs => chat_body(prompt),
            Entry::Messages => json!({"model": "bot", "max_tokens": 64,
                "messages": [{"role": "user", "content": prompt}]}),
            Entry::Responses => json!({"model": "bot", "input": prompt, "store": false}),
        };
        b[field] = value.clone();
        match self {
            Entry::Jobs => json!({"request": b}),
            _ => b,
        }
    }
}

/// What one request came to: its status, its fingerprint, and the text of
/// its answer (a job's: its result once it ended).
struct Seen {
    status: u16,
    fp: String,
    text: String,
}

async fn send(app: &TestApp, entry: Entry, body: &Value, key: &str) -> Seen {
    let headers: &[(&str, &str)] = match entry {
        Entry::Jobs => &[("idempotency-key", key)],
        _ => &[],
    };
    let r = app.post_json(ACME, entry.path(), body, headers).await;
    let status = r.status().as_u16();
    let fp = r
        .headers()
        .get("idem-fingerprint")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let mut text = r.text().await.unwrap();
    if let (Entry::Jobs, 201) = (entry, status) {
        let job: Value = serde_json::from_str(&text).unwrap();
        let id = job["id"].as_str().unwrap().to_string();
        let path = format!("/v1/jobs/{id}");
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let (_, job) = app.get_json(ACME, &path).await;
            let state = job["state"].as_str().unwrap_or_default().to_string();
            if ["succeeded", "failed", "cancelled"].contains(&state.as_str()) {
                text = job.to_string();
                return Seen {
                    status,
                    fp: job["fingerprint"].as_str().unwrap_or_default().to_string(),
                    text,
                };
            }
            assert!(
                std::time::Instant::now() < deadline,
                "job {id} did not end: {job}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Seen { status, fp, text }
}

/// A form of a request (any face's) that asks something else.
fn smuggled(tag: &str) -> Value {
    json!({"model": "gpt-4o-mini", "max_tokens": 16, "stream": false,
        "messages": [{"role": "user", "content": format!("SMUGGLED {tag}")}],
        "input": format!("SMUGGLED {tag}")})
}

/// Two requests that differ only in one field named like something of
/// idem's: both refused naming the field with nothing sent upstream, or
/// both treated as requests of their own (two fingerprints, neither
/// answering the smuggled question), on every way in and against each
/// kind of target (OpenAI-compatible, Anthropic, a Responses API).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_client_field_reaches_what_idem_uses_internally() {
    let names = names_in_the_source();
    assert!(
        names.iter().any(|n| n == "idem_requests_total"),
        "the source scan found nothing: {names:?}"
    );
    let mut failures = Vec::new();
    let kinds = [
        (ProviderKind::Openai, ""),
        (ProviderKind::Anthropic, ""),
        (ProviderKind::Openai, "responses_api = true\n"),
    ];
    for (k, (kind, extra)) in kinds.into_iter().enumerate() {
        let app = TestApp::with(Spec {
            primary_kind: kind,
            provider_extra: extra.into(),
            ..Spec::default()
        })
        .await;
        for entry in [Entry::Chat, Entry::Messages, Entry::Responses, Entry::Jobs] {
            for (i, name) in names.iter().enumerate() {
                let prompt = format!("real question {i} of {entry:?}");
                let calls = app.calls();
                let a = entry.body(&prompt, name, &smuggled("A"));
                let b = entry.body(&prompt, name, &smuggled("B"));
                let key = |tag: &str| format!("{k}-{entry:?}-{name}-{tag}");
                let a = send(&app, entry, &a, &key("a")).await;
                let refused = a.status == 400 && app.calls() == calls;
                let b = send(&app, entry, &b, &key("b")).await;
                let case = format!("{kind:?} {extra:?} {entry:?} `{name}`");
                if refused {
                    // Refused by idem before any work: by name, and again.
                    if !a.text.contains(name.as_str()) || b.status != 400 || app.calls() != calls {
                        failures.push(format!(
                            "{case}: refused without naming the field, or not twice ({}): {}",
                            b.status, a.text
                        ));
                    }
                    continue;
                }
                for (tag, seen) in [("A", &a), ("B", &b)] {
                    if seen.text.contains("SMUGGLED") {
                        failures.push(format!(
                            "{case}: {tag} answered the smuggled question: {}",
                            seen.text
                        ));
                    }
                }
                if a.fp.is_empty() || a.fp == b.fp {
                    failures.push(format!(
                        "{case}: the field is not in the fingerprint ({} / {}; statuses {} {})",
                        a.fp, b.fp, a.status, b.status
                    ));
                }
            }
        }
        app.stop().await;
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
