//! `idem demo`: a mock provider and a gateway in one process on free ports,
//! a wave of identical requests, and what happened, in numbers.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::{Value, json};

use crate::app::App;
use crate::config::{Config, Source};
use crate::mock_upstream::{Behaviour, MockServer};

#[derive(clap::Args, Debug, Clone)]
pub struct DemoArgs {
    /// Identical requests in the wave.
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// The mock provider's latency.
    #[arg(long, default_value_t = 400)]
    pub latency_ms: u64,
}

pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    let loopback: SocketAddr = ([127, 0, 0, 1], 0).into();
    let mock = MockServer::start(
        loopback,
        Behaviour {
            latency_ms: args.latency_ms,
            ..Behaviour::default()
        },
    )
    .await
    .context("cannot start the mock provider")?;
    let dir = std::env::temp_dir().join(format!("idem-demo-{}", uuid::Uuid::now_v7().simple()));
    std::fs::create_dir_all(&dir)?;
    let text = format!(
        r#"
[server]
listen = "127.0.0.1:0"
[storage]
url = "sqlite://{db}"
[log]
requests = "off"
[[providers]]
name = "mock"
kind = "openai"
base_url = "{base}"
[[routes]]
model = "support-bot"
targets = [{{ provider = "mock", model = "gpt-4o-mini" }}]
"#,
        db = dir.join("demo.db").display(),
        base = mock.base_url()
    );
    let config = Config::from_toml_str(&text, Source::Embedded, false)?;
    let app = App::build(config).await?;
    let base = format!("http://127.0.0.1:{}", app.port());
    let server = tokio::spawn(app.run(std::future::pending()));

    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(args.requests)
        .build()?;
    let body = json!({
        "model": "support-bot",
        "messages": [{"role": "user", "content": "Where is my order?"}],
        "temperature": 0
    });
    println!(
        "idem demo: a mock provider answering in {} ms, a gateway in front of it\n",
        args.latency_ms
    );

    for (wave, label) in [
        (1, "first wave (nothing cached)"),
        (2, "second wave (within the cache TTL)"),
    ] {
        let before = mock.stats().calls;
        let started = Instant::now();
        let outcomes = fire(&client, &base, &body, args.requests).await;
        let elapsed = started.elapsed();
        let calls = mock.stats().calls - before;
        println!("wave {wave}: {label}");
        println!("  incoming requests : {}", args.requests);
        println!("  upstream calls    : {calls}");
        println!("  outcomes          : {}", render_outcomes(&outcomes));
        println!("  wall time         : {} ms\n", elapsed.as_millis());
    }
    let stats: Value = client
        .get(format!("{base}/v1/stats"))
        .send()
        .await?
        .json()
        .await?;
    let c = &stats["coalescing"];
    println!("gateway figures (/v1/stats):");
    println!(
        "  incoming {} | upstream calls {} | saved {} | duplicate share {:.1}% | follower wait p50 {:.1} ms, p95 {:.1} ms, p99 {:.1} ms",
        c["incoming_requests"],
        c["upstream_calls"],
        c["saved_calls"],
        c["duplicate_share"].as_f64().unwrap_or(0.0) * 100.0,
        c["wait_p50_ms"].as_f64().unwrap_or(0.0),
        c["wait_p95_ms"].as_f64().unwrap_or(0.0),
        c["wait_p99_ms"].as_f64().unwrap_or(0.0),
    );
    server.abort();
    mock.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

async fn fire(
    client: &reqwest::Client,
    base: &str,
    body: &Value,
    n: usize,
) -> BTreeMap<String, usize> {
    let url = format!("{base}/v1/chat/completions");
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (client, url, body) = (client.clone(), url.clone(), body.clone());
            tokio::spawn(async move {
                match client
                    .post(&url)
                    .json(&body)
                    .timeout(Duration::from_secs(60))
                    .send()
                    .await
                {
                    Ok(r) => r
                        .headers()
                        .get("idem-outcome")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("none")
                        .to_string(),
                    Err(_) => "error".to_string(),
                }
            })
        })
        .collect();
    let mut outcomes = BTreeMap::new();
    for t in tasks {
        let o = t.await.unwrap_or_else(|_| "error".into());
        *outcomes.entry(o).or_insert(0) += 1;
    }
    outcomes
}

fn render_outcomes(o: &BTreeMap<String, usize>) -> String {
    o.iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}
