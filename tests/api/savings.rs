//! What coalescing saved, in tokens and dollars: a priced route's wave
//! spends one call and saves the others, in `/metrics`, `/v1/stats` and
//! the request log; a route without a price counts tokens and says its
//! cost is unknown, never zero (docs/design.md, "Numbers").

use std::time::Duration;

use serde_json::Value;

use crate::analyze::{gateway_logging_with, log_lines};
use crate::helpers::*;

/// Two more routes on the primary mock: one whose target has a price of
/// its own, one on a model without a built-in price.
const ROUTES: &str = r#"
[[routes]]
model = "priced"
targets = [{ provider = "primary", model = "gpt-4o-mini", price = { input_per_mtok = 2.0, output_per_mtok = 8.0 } }]

[[routes]]
model = "free"
targets = [{ provider = "primary", model = "llama-local" }]
"#;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-9)
}

/// The value of the `/metrics` series `series` (its name and labels), if any.
fn series(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.parse().ok())
}

async fn ask(base: &str, key: &str, model: &str) -> (u16, String, Value) {
    let r = client()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&serde_json::json!({"model": model, "messages": [{"role": "user", "content": "what does this cost?"}]}))
        .send()
        .await
        .unwrap();
    let outcome = r.headers()["idem-outcome"].to_str().unwrap().to_string();
    (r.status().as_u16(), outcome, r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_priced_wave_spends_one_call_and_saves_the_rest_and_an_unpriced_one_says_unknown() {
    let dir = temp_dir();
    let log = dir.join("requests.jsonl");
    let spec = Spec {
        extra: ROUTES.into(),
        ..holding()
    };
    let gw = gateway_logging_with(&spec, &log, false).await;
    let base = gw.base.clone();

    // A wave of 100 on the priced route: one call.
    let wave: Vec<_> = (0..100)
        .map(|_| {
            let base = base.clone();
            tokio::spawn(async move { ask(&base, ACME, "priced").await })
        })
        .collect();
    held(&gw.mocks.primary, 1).await;
    let table = &gw.state.core.coalescer.table;
    eventually(Duration::from_secs(30), || table.followers() >= 99).await;
    gw.mocks.primary.set_behaviour(Default::default());
    release(&gw.mocks.primary, None).await;
    let answers = collect(wave).await;
    assert_eq!(gw.mocks.primary.stats().calls, 1);
    let leader = answers.iter().find(|(_, o, _)| o == "leader").unwrap();
    assert!(answers.iter().all(|(s, _, _)| *s == 200));
    let usage = &leader.2["usage"];
    let (input, output) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(input > 0 && output > 0, "{usage}");
    let one_call = (input as f64 * 2.0 + output as f64 * 8.0) / 1e6;

    let text = get_text(&client(), format!("{base}/metrics")).await;
    let spent = series(
        &text,
        "idem_cost_total{route=\"priced\",provider=\"primary\"}",
    );
    assert!(
        spent.is_some_and(|d| close(d, one_call)),
        "{spent:?} != {one_call}: {text}"
    );
    let saved = series(&text, "idem_saved_cost_total{route=\"priced\"}");
    assert!(
        saved.is_some_and(|d| close(d, 99.0 * one_call)),
        "{saved:?}: {text}"
    );
    assert_eq!(
        series(
            &text,
            "idem_tokens_total{route=\"priced\",provider=\"primary\",kind=\"input\"}"
        ),
        Some(input as f64)
    );
    assert_eq!(
        series(
            &text,
            "idem_saved_tokens_total{route=\"priced\",kind=\"output\"}"
        ),
        Some(99.0 * output as f64)
    );

    let (status, stats) = get_json(&base, ACME, "/v1/stats").await;
    assert_eq!(status, 200);
    let c = &stats["coalescing"];
    assert!(
        close(c["spent_cost_usd"].as_f64().unwrap(), one_call),
        "{c}"
    );
    assert!(
        close(c["saved_cost_usd"].as_f64().unwrap(), 99.0 * one_call),
        "{c}"
    );
    assert_eq!(c["saved_output_tokens"], 99 * output);
    assert_eq!(c["spent_input_tokens"], input);
    assert_eq!(
        (c["unpriced_calls"].as_u64(), c["unpriced_saves"].as_u64()),
        (Some(0), Some(0))
    );

    let lines = log_lines(&log, 100).await;
    let priced: Vec<&Value> = lines.iter().filter(|l| l["route"] == "priced").collect();
    assert_eq!(priced.len(), 100);
    for l in &priced {
        if l["outcome"] == "leader" {
            assert!(close(l["cost"].as_f64().unwrap(), one_call), "{l}");
            assert!(l.get("saved_cost").is_none(), "{l}");
        } else {
            assert!(close(l["saved_cost"].as_f64().unwrap(), one_call), "{l}");
            assert!(l.get("cost").is_none(), "{l}");
        }
    }

    // The route without a price, for beta: one call, three cache hits.
    let (_, first, body) = ask(&base, BETA, "free").await;
    assert_eq!(first, "leader");
    for _ in 0..3 {
        assert_eq!(ask(&base, BETA, "free").await.1, "cache-hit");
    }
    let free_output = body["usage"]["completion_tokens"].as_u64().unwrap();
    let text = get_text(&client(), format!("{base}/metrics")).await;
    assert_eq!(
        series(
            &text,
            "idem_saved_tokens_total{route=\"free\",kind=\"output\"}"
        ),
        Some(3.0 * free_output as f64),
        "tokens are counted without a price"
    );
    assert!(
        !text.contains("idem_cost_total{route=\"free\"")
            && !text.contains("idem_saved_cost_total{route=\"free\""),
        "no price, no dollar series (never a zero): {text}"
    );
    let (_, stats) = get_json(&base, BETA, "/v1/stats").await;
    let c = &stats["coalescing"];
    assert!(
        c["spent_cost_usd"].is_null() && c["saved_cost_usd"].is_null(),
        "{c}"
    );
    assert_eq!(
        (c["unpriced_calls"].as_u64(), c["unpriced_saves"].as_u64()),
        (Some(1), Some(3))
    );
    assert_eq!(c["saved_output_tokens"], 3 * free_output);
    let lines = log_lines(&log, 104).await;
    let free: Vec<&Value> = lines.iter().filter(|l| l["route"] == "free").collect();
    assert_eq!(free.len(), 4);
    for l in free {
        assert!(
            l.get("cost").is_none() && l.get("saved_cost").is_none(),
            "{l}"
        );
        assert!(l["completion_tokens"].as_u64().unwrap() > 0, "{l}");
    }
    gw.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

async fn get_json(base: &str, key: &str, path: &str) -> (u16, Value) {
    let r = client()
        .get(format!("{base}{path}"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}
