//! The dashboard at `/ui` and the admin endpoints it reads: the page is
//! public static text with a strict policy; every figure and every job
//! behind it needs the admin key (no key: 401, a tenant key: 403), while
//! the tenant endpoints stay scoped to their tenant. The page itself is
//! driven in headless Chromium by `tests/ui/` (`.ci/ui-test`).

use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::helpers::*;

async fn get_raw(app: &TestApp, path: &str, key: Option<&str>) -> reqwest::Response {
    let mut r = app.client.get(app.url(path));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    r.send().await.unwrap()
}

async fn create_job(app: &TestApp, key: &str, idem_key: &str, content: &str) -> String {
    let r = app
        .post_json(
            key,
            "/v1/jobs",
            &json!({"request": chat_body(content)}),
            &[("idempotency-key", idem_key)],
        )
        .await;
    assert_eq!(r.status(), 201);
    r.json::<Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Polls the admin's view of a job until `cond` holds.
async fn admin_job_until(app: &TestApp, id: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..1500 {
        let (status, v) = app.get_json(ADMIN, &format!("/v1/admin/jobs/{id}")).await;
        assert_eq!(status, 200, "{v}");
        if cond(&v) {
            return v;
        }
        last = v;
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("job never reached the expected state: {last}");
}

#[tokio::test]
async fn the_page_is_public_static_and_locked_down() {
    let app = TestApp::spawn().await;
    for path in ["/ui", "/ui/"] {
        let r = get_raw(&app, path, None).await;
        assert_eq!(r.status(), 200, "{path}");
        let h = r.headers().clone();
        assert!(h["content-type"].to_str().unwrap().starts_with("text/html"));
        let csp = h["content-security-policy"].to_str().unwrap();
        for directive in [
            "default-src 'none'",
            "script-src 'self'",
            "connect-src 'self'",
            "frame-ancestors 'none'",
        ] {
            assert!(csp.contains(directive), "{csp}");
        }
        assert_eq!(h["x-content-type-options"], "nosniff");
        assert_eq!(h["referrer-policy"], "no-referrer");
        let page = r.text().await.unwrap();
        assert!(page.contains("/ui/app.js"), "{page}");
    }
    for (path, ty) in [
        ("/ui/app.js", "text/javascript"),
        ("/ui/app.css", "text/css"),
    ] {
        let r = get_raw(&app, path, None).await;
        assert_eq!(r.status(), 200, "{path}");
        assert!(
            r.headers()["content-type"]
                .to_str()
                .unwrap()
                .starts_with(ty)
        );
    }
    assert_error(
        get_raw(&app, "/ui/secrets.json", None).await,
        404,
        "not_found",
    )
    .await;
    app.stop().await;
}

#[tokio::test]
async fn admin_job_endpoints_need_the_admin_key() {
    let app = TestApp::spawn().await;
    let id = create_job(&app, ACME, "auth-1", "whose job").await;
    let one = format!("/v1/admin/jobs/{id}");
    for path in [
        "/v1/admin/jobs",
        "/v1/admin/jobs?state=unknown",
        "/v1/admin/jobs?state=queued&tenant=acme",
        one.as_str(),
    ] {
        assert_error(get_raw(&app, path, None).await, 401, "invalid_api_key").await;
        assert_error(
            get_raw(&app, path, Some("not-a-key-at-all")).await,
            401,
            "invalid_api_key",
        )
        .await;
        for tenant in [ACME, BETA] {
            assert_error(
                get_raw(&app, path, Some(tenant)).await,
                403,
                "admin_key_required",
            )
            .await;
        }
        assert_eq!(
            get_raw(&app, path, Some(ADMIN)).await.status(),
            200,
            "{path}"
        );
    }
    // The tenant endpoints stay as they were: scoped to the tenant, and
    // closed to the admin key.
    assert_eq!(app.get_json(ACME, &format!("/v1/jobs/{id}")).await.0, 200);
    assert_eq!(app.get_json(BETA, &format!("/v1/jobs/{id}")).await.0, 404);
    assert_error(
        get_raw(&app, &format!("/v1/jobs/{id}"), Some(ADMIN)).await,
        403,
        "tenant_key_required",
    )
    .await;
    // The admin stats carry the dashboard's extra figures.
    let (status, stats) = app.get_json(ADMIN, "/v1/stats").await;
    assert_eq!(status, 200);
    for field in ["attempt_races", "redis_errors", "unknown_attempts"] {
        assert!(stats[field].is_u64(), "{field}: {stats}");
    }
    let (_, mine) = app.get_json(ACME, "/v1/stats").await;
    assert!(mine.get("attempt_races").is_none(), "{mine}");
    app.stop().await;
}

#[tokio::test]
async fn the_admin_sees_every_tenants_jobs() {
    let app = TestApp::spawn().await;
    let a1 = create_job(&app, ACME, "k-1", "first").await;
    let b1 = create_job(&app, BETA, "k-1", "second").await;
    let a2 = create_job(&app, ACME, "k-2", "third").await;

    let (status, all) = app.get_json(ADMIN, "/v1/admin/jobs").await;
    assert_eq!(status, 200, "{all}");
    let listed: Vec<(&str, &str)> = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| (j["id"].as_str().unwrap(), j["tenant"].as_str().unwrap()))
        .collect();
    assert_eq!(
        listed,
        vec![
            (a2.as_str(), "acme"),
            (b1.as_str(), "beta"),
            (a1.as_str(), "acme")
        ],
        "newest first, every tenant"
    );
    assert_eq!(all["has_more"], false);

    // Pages, and one tenant.
    let (_, page) = app.get_json(ADMIN, "/v1/admin/jobs?limit=2").await;
    assert_eq!(page["data"].as_array().unwrap().len(), 2);
    assert_eq!(page["has_more"], true);
    let cursor = page["next_cursor"].as_str().unwrap();
    let (_, rest) = app
        .get_json(ADMIN, &format!("/v1/admin/jobs?limit=2&after={cursor}"))
        .await;
    assert_eq!(rest["data"][0]["id"], a1.as_str());
    assert_eq!(rest["has_more"], false);
    let (_, acme) = app.get_json(ADMIN, "/v1/admin/jobs?tenant=acme").await;
    assert_eq!(acme["data"].as_array().unwrap().len(), 2);
    let (_, nobody) = app.get_json(ADMIN, "/v1/admin/jobs?tenant=nobody").await;
    assert_eq!(nobody["data"], json!([]));

    // Any tenant's job, with its attempts.
    let done = admin_job_until(&app, &b1, |j| j["state"] == "succeeded").await;
    assert_eq!(done["tenant"], "beta");
    assert_eq!(done["idempotency_key"], "k-1");
    assert_eq!(done["attempts"][0]["state"], "succeeded");
    assert!(done["attempts"][0]["started_at"].is_string());
    assert!(done["attempts"][0]["finished_at"].is_string());
    for id in [&a1, &a2] {
        admin_job_until(&app, id, |j| j["state"] == "succeeded").await;
    }
    let (_, ok) = app.get_json(ADMIN, "/v1/admin/jobs?state=succeeded").await;
    assert_eq!(ok["data"].as_array().unwrap().len(), 3);
    let (_, none) = app.get_json(ADMIN, "/v1/admin/jobs?state=failed").await;
    assert_eq!(none["data"], json!([]));

    // Refusals.
    for (query, param) in [
        ("state=done", "state"),
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=ten", "limit"),
        ("after=nonsense", "after"),
        (
            "state=unknown&after=1_01900000-0000-7000-8000-000000000000",
            "after",
        ),
    ] {
        let r = get_raw(&app, &format!("/v1/admin/jobs?{query}"), Some(ADMIN)).await;
        let v = assert_error(r, 400, "invalid_value").await;
        assert_eq!(v["error"]["param"], param, "{query}: {v}");
    }
    for id in ["00000000-0000-7000-8000-000000000000", "not-a-job"] {
        let r = get_raw(&app, &format!("/v1/admin/jobs/{id}"), Some(ADMIN)).await;
        assert_error(r, 404, "not_found").await;
    }
    app.stop().await;
}

#[tokio::test]
async fn jobs_held_by_unknown_attempts_are_listed_for_the_admin() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            hang: true,
            ..Behaviour::default()
        },
        provider_timeout: "3s".into(),
        attempts: "timeout = \"300ms\"\nmax = 1\n".into(),
        ..Spec::default()
    })
    .await;
    let id = create_job(&app, ACME, "held-1", "never answered").await;
    let j = admin_job_until(&app, &id, |j| j["attempts"][0]["state"] == "unknown").await;
    assert_eq!(j["state"], "running", "{j}");

    let (status, held) = app.get_json(ADMIN, "/v1/admin/jobs?state=unknown").await;
    assert_eq!(status, 200, "{held}");
    let data = held["data"].as_array().unwrap();
    assert_eq!(data.len(), 1, "{held}");
    assert_eq!(data[0]["id"], id.as_str());
    assert_eq!(data[0]["tenant"], "acme");
    assert_eq!(data[0]["unknown_attempts"], json!([1]));
    assert_eq!(held["next_cursor"], Value::Null);
    let (_, other) = app
        .get_json(ADMIN, "/v1/admin/jobs?state=unknown&tenant=beta")
        .await;
    assert_eq!(other["data"], json!([]));

    let (_, stats) = app.get_json(ADMIN, "/v1/stats").await;
    assert_eq!(stats["unknown_attempts"], 1, "{stats}");
    assert_eq!(stats["attempt_races"], 0, "{stats}");
    app.stop().await;
}

/// Sums a figure over the timeline's samples.
fn summed(timeline: &Value, f: impl Fn(&Value) -> u64) -> u64 {
    timeline["samples"].as_array().unwrap().iter().map(f).sum()
}

#[tokio::test]
async fn the_timeline_is_the_admins_and_samples_a_scripted_run() {
    let app = TestApp::spawn().await;
    let path = "/v1/admin/timeline";
    assert_error(get_raw(&app, path, None).await, 401, "invalid_api_key").await;
    assert_error(
        get_raw(&app, path, Some(ACME)).await,
        403,
        "admin_key_required",
    )
    .await;
    let (status, empty) = app.get_json(ADMIN, path).await;
    assert_eq!(status, 200, "{empty}");
    assert_eq!(empty["interval_seconds"], 10);
    assert_eq!(empty["capacity"], 360);
    assert_eq!(empty["last_hour"]["counts"]["requests"], 0);
    assert_eq!(
        empty["last_hour"]["counts"]["spent_cost_usd"],
        Value::Null,
        "nothing priced yet: unknown, not 0"
    );

    // The route's target is gpt-4o-mini (a built-in price): a leader, then
    // a cache hit that saves its call.
    for outcome in ["leader", "cache-hit"] {
        let r = app.chat(ACME, &chat_body("timeline: priced")).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["idem-outcome"], outcome);
    }
    // An error burst: the provider answers 500 until its circuit opens
    // (5 failures), then the route has no target.
    app.mock.set_behaviour(Behaviour {
        fail_status: Some(500),
        ..Behaviour::default()
    });
    for i in 0..5 {
        let r = app
            .chat(ACME, &chat_body(&format!("timeline: burst {i}")))
            .await;
        assert!(r.status().is_server_error(), "{}", r.status());
    }
    let r = app
        .chat(ACME, &chat_body("timeline: after the burst"))
        .await;
    assert_eq!(r.status(), 503);
    // A rejection: no such model.
    let r = app
        .chat(
            ACME,
            &json!({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(r.status(), 404);

    let s = &app.state;
    idem::timeline::sample(&s.metrics, &s.timeline, &s.live.load().routes);
    let (_, t) = app.get_json(ADMIN, path).await;
    let n = |key: &'static str| summed(&t, move |s| s[key].as_u64().unwrap());
    assert!(!t["samples"].as_array().unwrap().is_empty(), "{t}");
    assert_eq!(n("requests"), 9, "{t}");
    assert_eq!((n("leaders"), n("cache_hits"), n("saved_calls")), (6, 1, 1));
    assert_eq!((n("upstream_calls"), n("provider_errors")), (6, 5));
    assert_eq!((n("rejections"), n("no_target"), n("timeouts")), (1, 1, 0));
    assert_eq!(n("contract_violations"), 0);
    // Every request with an answer or a refusal after routing has a
    // latency on its route (the unknown model has no route).
    let bot = summed(&t, |s| s["routes"]["bot"]["count"].as_u64().unwrap_or(0));
    assert_eq!(bot, 8, "{t}");
    let calls = summed(&t, |s| {
        s["providers"]["primary"]["calls"].as_u64().unwrap_or(0)
    });
    let errors = summed(&t, |s| {
        s["providers"]["primary"]["errors"].as_u64().unwrap_or(0)
    });
    assert_eq!((calls, errors), (6, 5));
    let last = t["samples"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["targets"][0]["provider"], "primary");
    assert_eq!(last["targets"][0]["circuit"], "open", "{last}");
    // Only the successful call has an upstream latency.
    let answered = summed(&t, |s| {
        s["targets"][0]["latency"]["count"].as_u64().unwrap()
    });
    assert_eq!(answered, 1);

    // Money: the saved call cost what the spent one did (the same answer).
    let (_, stats) = app.get_json(ADMIN, "/v1/stats").await;
    let hour = &t["last_hour"]["counts"];
    let spent = hour["spent_cost_usd"].as_f64().unwrap();
    let saved = hour["saved_cost_usd"].as_f64().unwrap();
    assert!(spent > 0.0, "{hour}");
    assert!((spent - stats["coalescing"]["spent_cost_usd"].as_f64().unwrap()).abs() < 1e-9);
    assert!((saved - spent).abs() < 1e-9, "{hour}");
    assert_eq!(hour["saved_calls"], 1);
    assert_eq!(hour["requests"], 9);
    assert_eq!(t["since_start"]["counts"]["requests"], 9);
    assert!(hour["saved_input_tokens"].as_u64().unwrap() > 0, "{hour}");

    // Each target with its health.
    let target = &t["targets"][0];
    assert_eq!(target["route"], "bot");
    assert_eq!(target["circuit"]["state"], "open");
    assert_eq!(target["priced"], true);
    assert_eq!(target["provider_calls"]["last_hour"]["calls"], 6);
    let share = target["provider_calls"]["error_share_last_hour"]
        .as_f64()
        .unwrap();
    assert!((share - 5.0 / 6.0).abs() < 1e-9, "{target}");
    assert_eq!(target["latency"]["total"]["count"], 1);
    assert!(
        t["since_start"]["routes"]["bot"]["p99_ms"]
            .as_f64()
            .unwrap()
            > 0.0
    );
    app.stop().await;
}
