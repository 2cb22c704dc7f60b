//! The operator files in `ops/` (Grafana dashboard, Prometheus alerts) only
//! name metrics that a running gateway exports, so a renamed metric breaks
//! this test rather than a dashboard in production. (Their PromQL is parsed
//! by `promtool` in CI: `.ci/check-metrics`.)

use std::collections::BTreeSet;

use serde_json::Value;

use crate::helpers::*;

/// Every `idem_...` name in `text`, with histogram suffixes removed.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(at) = text[i..].find("idem_") {
        let start = i + at;
        let before_ok =
            start == 0 || !(bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if before_ok {
            let name = &text[start..end];
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|s| name.strip_suffix(s).filter(|b| b.ends_with("_seconds")))
                .unwrap_or(name);
            names.insert(base.to_string());
        }
        i = end.max(start + 1);
    }
    names
}

fn repo_file(path: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

#[tokio::test]
async fn the_dashboard_and_the_alerts_name_only_exported_metrics() {
    // `idem serve` itself: some metrics (its log writer's) exist only there.
    let mocks = start_mocks(&Spec::default()).await;
    let (proc, dir) = Proc::start_default(&mocks).await;
    // One job, so that the metrics registered on first use exist too.
    let r = client()
        .post(format!("{}/v1/chat/completions", proc.base))
        .bearer_auth(ACME)
        .header("Idempotency-Key", "ops-1")
        .json(&chat_body("metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let exported: BTreeSet<String> = proc
        .metrics()
        .await
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    assert!(exported.contains("idem_attempts_total"), "{exported:?}");

    let dashboard = repo_file("ops/grafana/idem-dashboard.json");
    let v: Value = serde_json::from_str(&dashboard).unwrap();
    let exprs: Vec<&str> = v["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().into_iter().flatten())
        .filter_map(|t| t["expr"].as_str())
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");
    let alerts = repo_file("ops/prometheus/alerts.yml");
    for (file, text) in [("dashboard", exprs.join("\n")), ("alerts.yml", alerts)] {
        let used = metric_names(&text);
        assert!(!used.is_empty(), "{file} names no metric");
        let unknown: Vec<&String> = used.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics idem does not export: {unknown:?}"
        );
    }
    // The panels and alerts the operator guide promises.
    let all = metric_names(&exprs.join("\n"));
    for m in [
        "idem_saved_upstream_calls_total",
        "idem_requests_total",
        "idem_upstream_calls_total",
        "idem_coalesce_wait_seconds",
        "idem_coalesce_wait_timeouts_total",
        "idem_jobs_unknown",
        "idem_failover_blocked_total",
        "idem_redis_errors_total",
    ] {
        assert!(all.contains(m), "the dashboard has no panel on {m}");
    }
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_served_gateway_reports_the_lines_its_log_writers_drop() {
    // Both writers: the process log on stdout and a request log file.
    let mocks = start_mocks(&Spec::default()).await;
    let (proc, dir) = Proc::start_default_with(&mocks, |dir| {
        let requests = dir.join("requests.jsonl");
        vec![("IDEM_LOG__REQUESTS", requests.display().to_string())]
    })
    .await;
    let r = client()
        .post(format!("{}/v1/chat/completions", proc.base))
        .bearer_auth(ACME)
        .json(&chat_body("a line for the file"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = proc.metrics().await;
    for sink in ["stdout", "file"] {
        assert!(
            text.contains(&format!(
                "idem_log_lines_dropped_total{{sink=\"{sink}\"}} 0"
            )),
            "{sink}: {text}"
        );
    }
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Breaks the store under a running gateway: SQLite loses its tables,
/// PostgreSQL its schema. The database itself still answers `SELECT 1`.
async fn break_store(app: &TestApp, postgres: Option<&str>) {
    match postgres {
        None => {
            let url = format!("sqlite://{}", app.dir.join("idem.db").display());
            let db = sqlx::sqlite::SqlitePoolOptions::new()
                .max_connections(1)
                .connect(&url)
                .await
                .unwrap();
            for table in ["attempts", "certifications", "jobs"] {
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {table}")))
                    .execute(&db)
                    .await
                    .unwrap();
            }
        }
        Some(url) => {
            let schema = url.rsplit("search_path%3D").next().unwrap().to_string();
            let db = sqlx::postgres::PgPoolOptions::new()
                .max_connections(1)
                .connect(&pg_url())
                .await
                .unwrap();
            sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                .execute(&db)
                .await
                .unwrap();
        }
    }
}

/// `/readyz` runs real queries: a store whose tables are gone (a SQLite
/// file whose tables were dropped, a PostgreSQL schema dropped under the
/// gateway) is not ready, though its database still answers `SELECT 1`.
/// And `/v1/stats` says which figures it could not read (null, and named
/// in `unreadable`) instead of showing zeros.
#[tokio::test]
async fn a_broken_store_is_not_ready_and_stats_say_what_they_could_not_read() {
    for postgres in [false, true] {
        let storage_url = if postgres {
            Some(pg_schema().await)
        } else {
            None
        };
        let app = TestApp::with(Spec {
            storage_url: storage_url.clone(),
            ..Spec::default()
        })
        .await;
        let r = app.client.get(app.url("/readyz")).send().await.unwrap();
        assert_eq!(r.status(), 200, "postgres: {postgres}");
        let (_, stats) = app.get_json(ACME, "/v1/stats").await;
        assert_eq!(stats["jobs"]["queued"], 0, "{stats}");
        assert_eq!(stats["unreadable"], serde_json::json!([]), "{stats}");

        break_store(&app, storage_url.as_deref()).await;
        let r = app.client.get(app.url("/readyz")).send().await.unwrap();
        assert_eq!(
            r.status(),
            503,
            "postgres: {postgres}: ready with a broken store"
        );
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["status"], "unavailable", "{v}");
        assert_eq!(v["storage"], "broken", "{v}");

        let (status, stats) = app.get_json(ACME, "/v1/stats").await;
        assert_eq!(status, 200, "{stats}");
        assert!(stats["jobs"].is_null(), "{stats}");
        // The jobs cannot be read; the budgets, read from the same broken
        // store, may fail too, and are then named as well.
        let unreadable = stats["unreadable"].as_array().unwrap();
        assert_eq!(
            unreadable[0],
            serde_json::json!({"figure": "jobs", "reason": "storage error"}),
            "{stats}"
        );
        for f in &unreadable[1..] {
            assert_eq!(
                f,
                &serde_json::json!({"figure": "budgets", "reason": "storage error"}),
                "{stats}"
            );
            assert!(stats["budgets"].is_null(), "{stats}");
        }
        // The coalescing figures are the gateway's own: still there.
        assert!(stats["coalescing"]["incoming_requests"].is_u64(), "{stats}");
        let (status, stats) = app.get_json(ADMIN, "/v1/stats").await;
        assert_eq!(status, 200, "{stats}");
        assert!(stats["jobs"].is_null(), "{stats}");
        assert!(stats["unknown_attempts"].is_null(), "{stats}");
        let figures: Vec<&str> = stats["unreadable"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["figure"].as_str().unwrap())
            .collect();
        assert!(figures.starts_with(&["jobs"]), "{stats}");
        assert!(figures.contains(&"unknown_attempts"), "{stats}");
        assert!(
            figures
                .iter()
                .all(|f| ["jobs", "budgets", "unknown_attempts"].contains(f)),
            "{stats}"
        );
        // No SQL, table or host names reach the client.
        let text = stats.to_string();
        assert!(
            !text.contains("no such table") && !text.contains("does not exist"),
            "{text}"
        );
        app.stop().await;
    }
}
