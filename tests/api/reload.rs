//! Reloading the configuration of a running gateway (SIGHUP and
//! `POST /v1/admin/reload`): requests in progress finish on the
//! configuration they started with, the next ones get the new one, and a
//! configuration that cannot be taken is refused while the gateway keeps
//! serving (docs/design.md, "Reloading the configuration").

use std::time::Duration;

use serde_json::{Value, json};

use crate::helpers::*;

const GAMMA: &str = "sk-gamma-test-1";

/// The tests' default config with the route's cache TTL `ttl` (no
/// jitter, so that the TTL is exact), plus `extra`.
fn config(mocks: &Mocks, db: &str, ttl: &str, extra: &str) -> String {
    let spec = Spec {
        cache: format!("ttl = \"{ttl}\"\njitter = 0.0"),
        ..Spec::default()
    };
    format!("{}{extra}", config_text(&spec, mocks, db, "127.0.0.1:0"))
}

fn gamma() -> String {
    format!("\n[[tenants]]\nname = \"gamma\"\napi_keys = [\"{GAMMA}\"]\n")
}

/// `(status, Idem-Outcome)` of one chat request.
async fn ask(base: &str, key: &str, content: &str) -> (u16, String) {
    let r = client()
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&chat_body(content))
        .send()
        .await
        .unwrap();
    let outcome = r
        .headers()
        .get("idem-outcome")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (r.status().as_u16(), outcome)
}

async fn admin_stats(base: &str) -> Value {
    client()
        .get(format!("{base}/v1/stats"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Waits until `/metrics` counts `n` reloads with `result`.
async fn until_reloads(proc: &Proc, result: &str, n: u64) {
    let line = format!("idem_config_reloads_total{{result=\"{result}\"}} {n}");
    eventually_async(Duration::from_secs(20), || {
        let line = line.clone();
        async move { proc.metrics().await.lines().any(|l| l == line) }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sighup_during_a_wave_adds_a_tenant_and_a_ttl_for_the_requests_after_it() {
    let mocks = start_mocks(&holding()).await;
    let dir = temp_dir();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let file = dir.join("idem.toml");
    std::fs::write(&file, config(&mocks, &db, "300s", "")).unwrap();
    let mut proc = Proc::start(&file, &[]).await;
    let base = proc.base.clone();

    // A wave is in flight: one call held by the provider, 19 followers
    // waiting on it.
    let wave: Vec<_> = (0..20)
        .map(|_| {
            let base = base.clone();
            tokio::spawn(async move { ask(&base, ACME, "before the reload").await })
        })
        .collect();
    held(&mocks.primary, 1).await;
    eventually_async(Duration::from_secs(20), || {
        let base = base.clone();
        async move { admin_stats(&base).await["waiting_followers"] == 19 }
    })
    .await;
    assert_eq!(
        ask(&base, GAMMA, "who am i").await.0,
        401,
        "gamma is no tenant yet"
    );

    // The new file: a tenant more, and the route's TTL down to 1 s.
    std::fs::write(&file, config(&mocks, &db, "1s", &gamma())).unwrap();
    proc.signal("HUP");
    until_reloads(&proc, "ok", 1).await;
    let log = proc.drain().join("\n");
    assert!(log.contains("configuration reloaded"), "{log}");

    // The new tenant is served at once, while the wave still waits.
    let models = client()
        .get(format!("{base}/v1/models"))
        .bearer_auth(GAMMA)
        .send()
        .await
        .unwrap();
    assert_eq!(models.status(), 200);
    assert_eq!(
        admin_stats(&base).await["waiting_followers"],
        19,
        "the reload did not disturb the wave"
    );

    // The wave completes on one call.
    mocks.primary.set_behaviour(Default::default());
    release(&mocks.primary, None).await;
    let answers = collect(wave).await;
    let by_outcome = count_by(&answers, |(s, o)| (*s, o.clone()));
    assert_eq!(
        by_outcome.get(&(200, "leader".into())),
        Some(&1),
        "{answers:?}"
    );
    assert_eq!(
        by_outcome.get(&(200, "follower".into())),
        Some(&19),
        "{answers:?}"
    );
    assert_eq!(mocks.primary.stats().calls, 1);

    // A request after the reload: the new TTL.
    assert_eq!(
        ask(&base, GAMMA, "after the reload").await,
        (200, "leader".into())
    );
    assert_eq!(
        ask(&base, GAMMA, "after the reload").await,
        (200, "cache-hit".into()),
        "cached, for now"
    );
    tokio::time::sleep(Duration::from_millis(1600)).await;
    // The wave's leader started before the reload: its answer keeps the
    // old TTL (300 s), past the new one.
    assert_eq!(
        ask(&base, ACME, "before the reload").await,
        (200, "cache-hit".into()),
        "the answer of a leader that started before the reload keeps the TTL it started with"
    );
    assert_eq!(
        ask(&base, GAMMA, "after the reload").await,
        (200, "leader".into()),
        "1 s later, the new TTL has run out"
    );

    // An invalid file is refused; the gateway keeps the configuration in
    // force and keeps serving.
    std::fs::write(
        &file,
        config(&mocks, &db, "1s", &gamma())
            .replace("[routes.cache]", "[routes.cache]\nttl_typo = 1"),
    )
    .unwrap();
    proc.signal("HUP");
    until_reloads(&proc, "refused", 1).await;
    assert!(
        proc.metrics()
            .await
            .contains("idem_config_last_reload_successful 0")
    );
    let log = proc.drain().join("\n");
    assert!(log.contains("configuration reload refused"), "{log}");
    assert!(log.contains("ttl_typo"), "the refusal says why: {log}");
    assert_eq!(ask(&base, GAMMA, "still here").await.0, 200);
    assert_eq!(ask(&base, ACME, "still here").await.0, 200);

    // The admin call says why, as a 409 with the message of `idem check`.
    let r = client()
        .post(format!("{base}/v1/admin/reload"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    let err = assert_error(r, 409, "invalid_config").await;
    let message = err["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("ttl_typo") && message.contains("line"),
        "{message}"
    );

    drop(proc);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn the_admin_reload_answers_what_changed_and_refuses_what_needs_a_restart() {
    let mocks = start_mocks(&Spec::default()).await;
    let dir = temp_dir();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let file = dir.join("idem.toml");
    let first = config(&mocks, &db, "300s", "");
    std::fs::write(&file, &first).unwrap();
    let proc = Proc::start(&file, &[]).await;
    let reload = |key: &'static str| {
        client()
            .post(format!("{}/v1/admin/reload", proc.base))
            .bearer_auth(key)
            .send()
    };

    // Only the admin may reload.
    assert_error(reload(ACME).await.unwrap(), 403, "admin_key_required").await;

    // Nothing changed: nothing to say.
    let r = reload(ADMIN).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["changes"]["tenants"]["added"], json!([]));

    // A tenant more, beta's key gone (beta removed), the route changed.
    let second = config(&mocks, &db, "5s", &gamma()).replace(
        &format!("[[tenants]]\nname = \"beta\"\napi_keys = [\"{BETA}\"]\n"),
        "",
    );
    std::fs::write(&file, &second).unwrap();
    let v: Value = reload(ADMIN).await.unwrap().json().await.unwrap();
    assert_eq!(v["changes"]["tenants"]["added"], json!(["gamma"]));
    assert_eq!(v["changes"]["tenants"]["removed"], json!(["beta"]));
    assert_eq!(v["changes"]["routes"]["changed"], json!(["bot"]));
    assert_eq!(ask(&proc.base, GAMMA, "hello").await.0, 200);
    assert_eq!(
        ask(&proc.base, BETA, "hello").await.0,
        401,
        "a removed key no longer opens"
    );

    // The listener and the store need a restart: refused, nothing taken
    // (gamma stays, the new route does not come).
    let moved = second
        .replace("listen = \"127.0.0.1:0\"", "listen = \"127.0.0.1:1\"")
        .replace(&db, &format!("{db}-other"))
        + "\n[[routes]]\nmodel = \"late\"\ntargets = [{ provider = \"primary\", model = \"x\" }]\n";
    std::fs::write(&file, &moved).unwrap();
    let err = assert_error(reload(ADMIN).await.unwrap(), 409, "restart_required").await;
    let message = err["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("[server]")
            && message.contains("[storage]")
            && message.contains("restart"),
        "{message}"
    );
    assert_eq!(ask(&proc.base, GAMMA, "hello").await.0, 200);
    let late = client()
        .post(format!("{}/v1/chat/completions", proc.base))
        .bearer_auth(GAMMA)
        .json(&json!({"model": "late", "messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(late.status(), 404);
    let text = proc.metrics().await;
    assert!(
        text.contains("idem_config_reloads_total{result=\"ok\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("idem_config_reloads_total{result=\"refused\"} 1"),
        "{text}"
    );

    drop(proc);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_gateway_built_from_a_config_in_memory_has_nothing_to_reload() {
    let app = TestApp::spawn().await;
    let r = app
        .post_json(ADMIN, "/v1/admin/reload", &json!({}), &[])
        .await;
    assert_error(r, 409, "reload_unavailable").await;
    app.stop().await;
}
