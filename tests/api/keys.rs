//! Keys of the store and their budgets (docs/design.md, "Keys and
//! budgets"): managed through the admin API and `idem keys`, in force at
//! once; rate limits, allowlists and expiry refuse before any work; a
//! budget is reserved before a call, so concurrent requests cannot
//! overspend it, and only calls idem made are charged.

use std::time::Duration;

use idem::config::ProviderKind;
use idem::prices::{Price, Tokens};
use serde_json::{Value, json};

use crate::helpers::*;

/// A route `priced` on the primary mock at $1,000 per million tokens in
/// and out: a token costs a millionth of a thousand dollars, 1,000,000
/// nano-dollars, so that budgets are whole numbers of tokens.
pub const PRICED: &str = r#"
[[routes]]
model = "priced"
targets = [{ provider = "primary", model = "gpt-4o-mini", price = { input_per_mtok = 1000, output_per_mtok = 1000 } }]
[[routes]]
model = "unpriced"
targets = [{ provider = "primary", model = "house-model-7" }]
"#;

pub fn price() -> Price {
    Price::of_target(
        Some(&idem::config::PriceConfig {
            input_per_mtok: 1000.0,
            output_per_mtok: 1000.0,
            cached_input_per_mtok: None,
        }),
        ProviderKind::Openai,
        "gpt-4o-mini",
    )
    .unwrap()
}

/// A distinct request of route `priced` (`i` below 1,000: every one the
/// same length, so the same worst case).
pub fn priced(i: usize) -> Value {
    json!({"model": "priced", "messages": [{"role": "user", "content": format!("question {i:03}")}], "max_tokens": 50})
}

/// The most a request of [`priced`] can cost, in nano-dollars.
pub fn worst(i: usize) -> i64 {
    let body = priced(i);
    idem::budgets::worst_case(&price(), body.as_object().unwrap(), false, 4096)
}

/// Nano-dollars as the `budget_usd` the API takes.
pub fn usd(nanos: i64) -> f64 {
    nanos as f64 / 1e9
}

/// What an answer's usage costs at [`price`], in nano-dollars.
pub fn cost_of(answer: &Value) -> i64 {
    let tokens = Tokens::of_usage(&answer["usage"]).expect("an answer with usage");
    idem::budgets::real_cost(&price(), Some(&tokens), 0)
}

/// The cost of the answers among `results` and how many were refused for
/// a budget (429 `budget_exceeded`); any other outcome fails the test.
pub fn tally(results: Vec<(u16, Value)>) -> (i64, usize) {
    let (mut cost, mut refused) = (0, 0);
    for (status, body) in results {
        match status {
            200 => cost += cost_of(&body),
            429 => {
                assert_eq!(body["error"]["code"], "budget_exceeded", "{body}");
                refused += 1;
            }
            other => panic!("{other}: {body}"),
        }
    }
    (cost, refused)
}

/// Makes a key through the admin API at `base`: (id, secret, view).
pub async fn make_key(
    client: &reqwest::Client,
    base: &str,
    spec: Value,
) -> (String, String, Value) {
    let r = client
        .post(format!("{base}/v1/admin/keys"))
        .bearer_auth(ADMIN)
        .json(&spec)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{spec}");
    let v: Value = r.json().await.unwrap();
    (
        v["id"].as_str().unwrap().to_string(),
        v["key"].as_str().unwrap().to_string(),
        v,
    )
}

/// A key's view through the admin API.
pub async fn key_view(client: &reqwest::Client, base: &str, id: &str) -> Value {
    let r = client
        .get(format!("{base}/v1/admin/keys/{id}"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// Waits until the store says key `id` spent `expected` nano-dollars, and
/// fails if it does not within 5 s (an answer's spend is written before
/// the answer goes; the wait is for the figures of a key read on another
/// replica, and for reservations ended by a lease).
pub async fn assert_spent(client: &reqwest::Client, base: &str, id: &str, expected: i64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let now = spent(client, base, id).await;
        if now == expected {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "key {id} spent {now}, expected {expected}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What the store says key `id` spent, in nano-dollars.
pub async fn spent(client: &reqwest::Client, base: &str, id: &str) -> i64 {
    let v = key_view(client, base, id).await;
    (v["budget"]["spent_usd"].as_f64().unwrap() * 1e9).round() as i64
}

/// A chat completion as `key` at the gateway at `base`.
async fn chat_at(c: &reqwest::Client, base: &str, key: &str, body: &Value) -> reqwest::Response {
    c.post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

/// `GET path` as `key` at `base`: (status, body).
async fn get_at(c: &reqwest::Client, base: &str, key: &str, path: &str) -> (u16, Value) {
    let r = c
        .get(format!("{base}{path}"))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// `POST path` with a JSON body as `key` at `base`.
async fn post_at(
    c: &reqwest::Client,
    base: &str,
    key: &str,
    path: &str,
    body: &Value,
) -> reqwest::Response {
    c.post(format!("{base}{path}"))
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap()
}

fn with_priced_routes() -> Spec {
    Spec {
        extra: PRICED.into(),
        ..Spec::default()
    }
}

#[tokio::test]
async fn keys_are_managed_through_the_admin_api_audited_and_in_force_at_once() {
    // The real binary, as an operator runs it.
    let mocks = start_mocks(&Spec::default()).await;
    let (proc, dir) = Proc::start_default(&mocks).await;
    let client = client();
    let (c, base) = (&client, proc.base.as_str());
    // Create: the secret is shown once, the view never shows it again.
    let (id, secret, v) = make_key(
        c,
        base,
        json!({"tenant": "acme", "name": "ci", "budget_usd": 5, "budget_period": "30d", "models": ["bot", "priced"], "metadata": {"team": "search"}}),
    )
    .await;
    assert!(secret.starts_with("sk-idem-"), "{secret}");
    assert_eq!(v["state"], "active");
    assert_eq!(v["budget"]["limit_usd"], 5.0);
    assert!(v["budget"]["resets_at"].is_string(), "{v}");
    assert!(
        v["hint"]
            .as_str()
            .unwrap()
            .ends_with(&secret[secret.len() - 4..])
    );
    let shown = key_view(c, base, &id).await;
    assert!(shown.get("key").is_none() && !shown.to_string().contains(&secret));
    // The key works at once, as its tenant.
    let r = chat_at(c, base, &secret, &chat_body("hello")).await;
    assert_eq!(r.status(), 200);
    let (status, mine) = get_at(c, base, &secret, "/v1/key").await;
    assert_eq!(status, 200);
    assert_eq!(mine["tenant"], "acme");
    assert_eq!(mine["key"]["id"], id.as_str());
    assert!(mine["key"].get("metadata").is_none(), "{mine}");
    // Listed, by tenant too.
    let (_, all) = get_at(c, base, ADMIN, "/v1/admin/keys").await;
    assert!(
        all["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|k| k["id"] == id.as_str())
    );
    let (_, beta) = get_at(c, base, ADMIN, "/v1/admin/keys?tenant=beta").await;
    assert!(beta["data"].as_array().unwrap().is_empty());
    // Changed: null clears, the rest stays.
    let r = c
        .patch(format!("{base}/v1/admin/keys/{id}"))
        .bearer_auth(ADMIN)
        .json(&json!({"rpm": 100, "models": null}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["rpm"], 100);
    assert_eq!(v["models"], Value::Null);
    assert_eq!(v["budget"]["limit_usd"], 5.0);
    // A mistake names its field; the tenant cannot change.
    for bad in [
        json!({"rpm": -1}),
        json!({"tenant": "beta"}),
        json!({"colour": "red"}),
    ] {
        let r = c
            .patch(format!("{base}/v1/admin/keys/{id}"))
            .bearer_auth(ADMIN)
            .json(&bad)
            .send()
            .await
            .unwrap();
        assert_error(r, 400, "invalid_key_field").await;
    }
    // Rotated: the old secret stops, the new one works, the spend stays.
    let before = spent(c, base, &id).await;
    let r = post_at(
        c,
        base,
        ADMIN,
        &format!("/v1/admin/keys/{id}/rotate"),
        &json!({}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let rotated: Value = r.json().await.unwrap();
    let fresh = rotated["key"].as_str().unwrap().to_string();
    assert_ne!(fresh, secret);
    assert_eq!(rotated["id"], id.as_str());
    let r = chat_at(c, base, &secret, &chat_body("hello")).await;
    assert_error(r, 401, "invalid_api_key").await;
    assert_eq!(
        chat_at(c, base, &fresh, &chat_body("again")).await.status(),
        200
    );
    assert!(spent(c, base, &id).await >= before);
    // Revoked: refused with a message that says so.
    let r = post_at(
        c,
        base,
        ADMIN,
        &format!("/v1/admin/keys/{id}/revoke"),
        &json!({}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let r = chat_at(c, base, &fresh, &chat_body("hello")).await;
    let e = assert_error(r, 401, "invalid_api_key").await;
    assert!(
        e["error"]["message"].as_str().unwrap().contains("revoked"),
        "{e}"
    );
    assert_eq!(key_view(c, base, &id).await["state"], "revoked");
    // A revoked key cannot be rotated back to life.
    let r = post_at(
        c,
        base,
        ADMIN,
        &format!("/v1/admin/keys/{id}/rotate"),
        &json!({}),
    )
    .await;
    assert_error(r, 409, "key_revoked").await;
    // Audited: who, when, what, newest first.
    let (_, audit) = get_at(c, base, ADMIN, &format!("/v1/admin/keys/{id}/audit")).await;
    let actions: Vec<&str> = audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["revoke", "rotate", "update", "create"]);
    assert!(
        audit["data"][0]["actor"]
            .as_str()
            .unwrap()
            .starts_with("admin key sha256:")
    );
    assert_eq!(audit["data"][2]["change"]["rpm"], 100);
    // Only the admin manages keys.
    let r = post_at(
        c,
        base,
        ACME,
        "/v1/admin/keys",
        &json!({"tenant": "acme", "name": "x"}),
    )
    .await;
    assert_error(r, 403, "admin_key_required").await;
    let r = c.get(format!("{base}/v1/admin/keys")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn a_key_past_its_rate_limit_is_refused_before_the_provider_with_the_headers_clients_know() {
    let app = TestApp::spawn().await;
    let (_, secret, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "slow", "rpm": 2}),
    )
    .await;
    for i in 0..2 {
        assert_eq!(
            app.chat(&secret, &chat_body(&format!("q{i}")))
                .await
                .status(),
            200
        );
    }
    let calls = app.calls();
    let r = app.chat(&secret, &chat_body("one too many")).await;
    let retry: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(r.headers()["x-ratelimit-remaining-requests"], "0");
    assert_error(r, 429, "rate_limit_exceeded").await;
    assert_eq!(app.calls(), calls, "a limited request reached the provider");
    // The tenant's other keys are not limited by this one's.
    assert_eq!(
        app.chat(ACME, &chat_body("the file's key")).await.status(),
        200
    );
}

#[tokio::test]
async fn a_key_uses_only_its_models_and_an_expired_key_says_it_expired() {
    let app = TestApp::with(with_priced_routes()).await;
    let (_, secret, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "narrow", "models": ["priced"]}),
    )
    .await;
    let calls = app.calls();
    let e = assert_error(
        app.chat(&secret, &chat_body("hi")).await,
        403,
        "model_not_allowed",
    )
    .await;
    assert!(
        e["error"]["message"].as_str().unwrap().contains("`priced`"),
        "{e}"
    );
    assert_eq!(app.calls(), calls);
    assert_eq!(app.chat(&secret, &priced(1)).await.status(), 200);
    let (_, gone, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "old", "expires_at": "2001-01-01T00:00:00Z"}),
    )
    .await;
    let e = assert_error(
        app.chat(&gone, &chat_body("hi")).await,
        401,
        "invalid_api_key",
    )
    .await;
    assert!(
        e["error"]["message"].as_str().unwrap().contains("expired"),
        "{e}"
    );
}

/// The overspend test on one gateway: a budget of exactly ten worst
/// cases, 200 distinct requests at once: ten calls, 190 refusals, and the
/// spend within the budget; the answers cost less than their reservations,
/// so once they are settled more calls fit, and still no overspend.
#[tokio::test]
async fn concurrent_requests_never_overspend_a_budget() {
    let app = TestApp::with(Spec {
        extra: PRICED.into(),
        ..holding()
    })
    .await;
    let w = worst(0);
    let budget = 10 * w;
    let (id, secret, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "capped", "budget_usd": usd(budget)}),
    )
    .await;
    let fire = |from: usize, n: usize| {
        (from..from + n)
            .map(|i| {
                let (c, url, key) = (
                    app.client.clone(),
                    app.url("/v1/chat/completions"),
                    secret.clone(),
                );
                tokio::spawn(async move {
                    let r = c
                        .post(url)
                        .bearer_auth(key)
                        .json(&priced(i))
                        .send()
                        .await
                        .unwrap();
                    let status = r.status().as_u16();
                    (status, r.json::<Value>().await.unwrap())
                })
            })
            .collect::<Vec<_>>()
    };
    let first = fire(0, 200);
    // Ten calls reach the provider and are held there; every other request
    // is refused meanwhile, without a call.
    held(&app.mock, 10).await;
    eventually(Duration::from_secs(30), || {
        first.iter().filter(|t| t.is_finished()).count() >= 190
    })
    .await;
    assert_eq!(
        app.calls(),
        10,
        "calls past the budget reached the provider"
    );
    release(&app.mock, None).await;
    let (mut cost, refused) = tally(collect(first).await);
    assert_eq!(refused, 190);
    assert_spent(&app.client, &app.base, &id, cost).await;
    assert!(cost <= budget && cost < 10 * w, "{cost} {budget}");
    // What the answers did not cost is free again: nine more worst cases
    // fit (not ten: ten answers cost something).
    let second = fire(200, 100);
    held(&app.mock, 9).await;
    eventually(Duration::from_secs(30), || {
        second.iter().filter(|t| t.is_finished()).count() >= 91
    })
    .await;
    let calls = app.calls();
    let fit = usize::try_from((budget - cost) / w).unwrap();
    assert_eq!(calls, 10 + fit as u64, "after settlement");
    release(&app.mock, None).await;
    cost += tally(collect(second).await).0;
    assert_spent(&app.client, &app.base, &id, cost).await;
    assert!(cost <= budget, "overspent: {cost} > {budget}");
}

/// A gateway killed right after answering: after a restart on the same
/// store, every answer its clients received is in the key's spend (it is
/// written before the answer goes), and the calls it held when it died
/// are not, their reservations free again once its lease ended.
#[tokio::test]
async fn a_killed_gateway_has_recorded_the_spend_of_every_answer_it_gave() {
    let spec = Spec {
        // The timer that retries refused writes runs every second: the
        // kill comes well before it, so what is in the store is what
        // answering wrote.
        extra: format!("{PRICED}\n[budgets]\nlease = \"3s\"\nflush_interval = \"1s\"\n"),
        ..holding()
    };
    let mocks = start_mocks(&spec).await;
    let dir = temp_dir();
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let config = dir.join("idem.toml");
    std::fs::write(&config, config_text(&spec, &mocks, &db, "127.0.0.1:0")).unwrap();
    let gateway = Proc::start(&config, &[]).await;
    let c = client();
    let w = worst(0);
    let (id, secret, _) = make_key(
        &c,
        &gateway.base,
        json!({"tenant": "acme", "name": "killed", "budget_usd": usd(10 * w)}),
    )
    .await;
    // Ten calls at the provider: five answered, then the process dies
    // holding the other five.
    let tasks: Vec<_> = (0..10)
        .map(|i| {
            let (c, base, key) = (c.clone(), gateway.base.clone(), secret.clone());
            tokio::spawn(async move {
                let r = c
                    .post(format!("{base}/v1/chat/completions"))
                    .bearer_auth(key)
                    .json(&priced(i))
                    .send()
                    .await
                    .ok()?;
                assert_eq!(r.status(), 200);
                r.json::<Value>().await.ok()
            })
        })
        .collect();
    let seqs = held(&mocks.primary, 10).await;
    for s in &seqs[..5] {
        release(&mocks.primary, Some(*s)).await;
    }
    eventually(Duration::from_secs(10), || {
        tasks.iter().filter(|t| t.is_finished()).count() >= 5
    })
    .await;
    gateway.signal("KILL");
    let mut cost = 0;
    let mut answered = 0;
    for t in tasks {
        if let Some(body) = t.await.unwrap() {
            answered += 1;
            cost += cost_of(&body);
        }
    }
    assert_eq!(answered, 5);
    drop(gateway);
    mocks
        .primary
        .set_behaviour(idem::mock_upstream::Behaviour::default());
    release(&mocks.primary, None).await;
    let gateway = Proc::start(&config, &[]).await;
    assert_eq!(
        spent(&c, &gateway.base, &id).await,
        cost,
        "spend lost with the process"
    );
    // The dead process's five reservations end with its lease: then the
    // rest of the budget serves as many worst cases as it holds.
    let fit = usize::try_from((10 * w - cost) / w).unwrap();
    let mut ok = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while ok < fit {
        let r = chat_at(&c, &gateway.base, &secret, &priced(100 + ok)).await;
        if r.status() == 200 {
            cost += cost_of(&r.json().await.unwrap());
            ok += 1;
        } else {
            assert!(
                std::time::Instant::now() < deadline,
                "the dead process's reservations were kept"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    assert_spent(&c, &gateway.base, &id, cost).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A wave of 500 identical requests from one key whose budget holds one
/// call: one call, 500 answers, one call's spend.
#[tokio::test]
async fn a_wave_from_one_key_makes_one_call_and_is_charged_once() {
    let app = TestApp::with(Spec {
        extra: PRICED.into(),
        ..holding()
    })
    .await;
    let (id, secret, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "one-call", "budget_usd": usd(worst(7))}),
    )
    .await;
    let tasks = wave(&app, &secret, &priced(7), 500).await;
    held(&app.mock, 1).await;
    app.until_followers(499).await;
    release(&app.mock, None).await;
    let results = collect(tasks).await;
    let mut one = None;
    for (status, _, body) in &results {
        assert_eq!(*status, 200, "{body}");
        one.get_or_insert_with(|| serde_json::from_str::<Value>(body).unwrap());
    }
    assert_eq!(app.calls(), 1);
    assert_spent(&app.client, &app.base, &id, cost_of(&one.unwrap())).await;
    // The cache answers the next one: nothing more is spent.
    let r = app.chat(&secret, &priced(7)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
    assert_eq!(app.calls(), 1);
}

/// A key of another tenant's wave leads nothing: the tenant is in the
/// fingerprint; a wave shared by two keys of one tenant charges the key
/// that led, and a key whose budget refuses the call does not refuse its
/// followers: one of them leads on its own budget.
#[tokio::test]
async fn a_shared_wave_charges_the_leader_and_a_refused_leader_does_not_refuse_its_followers() {
    let app = TestApp::with(Spec {
        extra: PRICED.into(),
        ..holding()
    })
    .await;
    let (broke_id, broke, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "broke", "budget_usd": 0}),
    )
    .await;
    let (rich_id, rich, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "rich", "budget_usd": 10}),
    )
    .await;
    // The rich key leads; the broke key follows and pays nothing.
    let leader = wave(&app, &rich, &priced(1), 1).await;
    held(&app.mock, 1).await;
    let follower = wave(&app, &broke, &priced(1), 1).await;
    app.until_followers(1).await;
    release(&app.mock, None).await;
    let led = collect(leader).await;
    for (status, _, body) in led.iter().chain(&collect(follower).await) {
        assert_eq!(*status, 200, "{body}");
    }
    let first = cost_of(&serde_json::from_str(&led[0].2).unwrap());
    assert_spent(&app.client, &app.base, &rich_id, first).await;
    assert_spent(&app.client, &app.base, &broke_id, 0).await;
    // The broke key asks first: refused, and the rich key's identical
    // request, which came while it was refused, leads on its own budget.
    let broke_first = wave(&app, &broke, &priced(2), 20).await;
    let rich_after = wave(&app, &rich, &priced(2), 20).await;
    held(&app.mock, 1).await;
    release(&app.mock, None).await;
    for (status, _, body) in collect(broke_first).await {
        // Each broke request either was refused or followed the rich
        // key's call.
        assert!(status == 429 || status == 200, "{status} {body}");
        if status == 429 {
            assert!(body.contains("budget_exceeded"), "{body}");
        }
    }
    let mut second = 0;
    for (status, _, body) in collect(rich_after).await {
        assert_eq!(status, 200, "{body}");
        second = cost_of(&serde_json::from_str(&body).unwrap());
    }
    assert_eq!(app.calls(), 2);
    assert_spent(&app.client, &app.base, &rich_id, first + second).await;
    assert_spent(&app.client, &app.base, &broke_id, 0).await;
}

#[tokio::test]
async fn a_budgeted_key_on_a_target_without_a_price_is_refused_and_another_is_served() {
    let app = TestApp::with(with_priced_routes()).await;
    let (_, budgeted, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "b", "budget_usd": 1}),
    )
    .await;
    let (_, free, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "f"}),
    )
    .await;
    let body = json!({"model": "unpriced", "messages": [{"role": "user", "content": "hi"}]});
    let calls = app.calls();
    let e = assert_error(app.chat(&budgeted, &body).await, 403, "price_unknown").await;
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("house-model-7"),
        "{e}"
    );
    assert_eq!(app.calls(), calls);
    assert_eq!(app.chat(&free, &body).await.status(), 200);
}

/// A tenant's budget is shared by all its keys, the file's and the
/// store's.
#[tokio::test]
async fn a_tenant_budget_is_shared_by_every_key_of_the_tenant() {
    let w = worst(3);
    let app = TestApp::with(Spec {
        extra: PRICED.into(),
        acme: format!("budget_usd = {}\n", usd(w)),
        ..holding()
    })
    .await;
    let (_, secret, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "k"}),
    )
    .await;
    // The file's key takes the whole budget with one call in progress.
    let first = wave(&app, ACME, &priced(3), 1).await;
    held(&app.mock, 1).await;
    let e = assert_error(app.chat(&secret, &priced(4)).await, 429, "budget_exceeded").await;
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tenant acme"),
        "{e}"
    );
    // Another tenant is not held by it (beta has no budget): its call goes
    // to the provider.
    let beta = wave(&app, BETA, &priced(4), 1).await;
    held(&app.mock, 2).await;
    release(&app.mock, None).await;
    assert_eq!(collect(beta).await[0].0, 200);
    let done = collect(first).await;
    assert_eq!(done[0].0, 200);
    // The tenant's spend, in the stats once written.
    let cost = cost_of(&serde_json::from_str(&done[0].2).unwrap());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (_, stats) = app.get_json(ADMIN, "/v1/stats").await;
        let acme = stats["budgets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["tenant"] == "acme" && b["key"].is_null())
            .cloned()
            .unwrap();
        if (acme["spent_usd"].as_f64().unwrap() * 1e9).round() as i64 == cost {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{stats}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let text = app.metrics().await;
    assert!(
        text.contains("idem_budget_limit_dollars{tenant=\"acme\",key=\"\",name=\"\"}"),
        "{text}"
    );
}

/// `idem keys` manages the keys of the store its config names while a
/// gateway serves from it: a key created, limited, rotated and revoked
/// from the command line is in force within a second.
#[tokio::test]
async fn the_cli_manages_keys_while_the_gateway_serves() {
    let mocks = start_mocks(&Spec::default()).await;
    let (proc, dir) = Proc::start_default(&mocks).await;
    let config = dir.join("idem.toml");
    let idem = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("keys")
            .args(args)
            .arg("--config")
            .arg(&config)
            .env_remove("IDEM_CONFIG")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "idem keys {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let made = idem(&[
        "create",
        "--tenant",
        "acme",
        "--name",
        "from-cli",
        "--budget-usd",
        "2",
        "--budget-period",
        "7d",
        "--rpm",
        "50",
    ]);
    let id = made["id"].as_str().unwrap().to_string();
    let secret = made["key"].as_str().unwrap().to_string();
    assert_eq!(made["rpm"], 50);
    let c = client();
    let chat = |key: String| {
        let (c, url) = (c.clone(), format!("{}/v1/chat/completions", proc.base));
        async move {
            c.post(url)
                .bearer_auth(key)
                .json(&chat_body("from the cli"))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        }
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while chat(secret.clone()).await != 200 {
        assert!(
            std::time::Instant::now() < deadline,
            "the CLI's key was not in force within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let list = idem(&["list", "--tenant", "acme"]);
    assert_eq!(list["data"][0]["id"], id.as_str());
    let updated = idem(&["update", &id, "--rpm", "1", "--clear", "budget_period"]);
    assert_eq!(updated["rpm"], 1);
    assert_eq!(updated["budget"]["period"], Value::Null);
    let rotated = idem(&["rotate", &id]);
    let fresh = rotated["key"].as_str().unwrap().to_string();
    idem(&["revoke", &id]);
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    while chat(fresh.clone()).await != 401 {
        assert!(
            std::time::Instant::now() < deadline,
            "the revocation was not in force within 1 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let shown = idem(&["show", &id]);
    assert_eq!(shown["state"], "revoked");
    let audit = idem(&["audit", &id]);
    let actions: Vec<&str> = audit["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["revoke", "rotate", "update", "create"]);
    assert!(
        audit["data"][0]["actor"]
            .as_str()
            .unwrap()
            .starts_with("cli (")
    );
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A job pays like the request that made it: its attempts' calls are
/// reserved against the key it was created with, a refused attempt is
/// `failed` (`budget_exceeded`) without a call, and a replay spends
/// nothing.
#[tokio::test]
async fn a_jobs_calls_are_charged_to_the_key_that_made_it() {
    let app = TestApp::with(Spec {
        extra: PRICED.into(),
        ..holding()
    })
    .await;
    let (id, secret, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "jobs", "budget_usd": usd(worst(1))}),
    )
    .await;
    let create = |key: &'static str, i: usize| {
        let (c, url, secret) = (app.client.clone(), app.url("/v1/jobs"), secret.clone());
        async move {
            let r = c
                .post(url)
                .bearer_auth(secret)
                .header("idempotency-key", key)
                .json(&json!({"request": priced(i)}))
                .send()
                .await
                .unwrap();
            assert!(r.status().is_success(), "{}", r.status());
            r.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        }
    };
    let job = |jid: String| {
        let (c, url, secret) = (
            app.client.clone(),
            app.url(&format!("/v1/jobs/{jid}")),
            secret.clone(),
        );
        async move {
            c.get(url)
                .bearer_auth(secret)
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        }
    };
    let paid = create("job-a", 1).await;
    held(&app.mock, 1).await;
    // The budget is held by the first job's call: the second job's attempt
    // is refused before the provider.
    let refused = create("job-b", 2).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let j = job(refused.clone()).await;
        if j["attempts"][0]["state"] == "failed" {
            assert_eq!(j["attempts"][0]["reason"], "budget_exceeded", "{j}");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{j}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(app.calls(), 1);
    release(&app.mock, None).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let done = loop {
        let j = job(paid.clone()).await;
        if j["state"] == "succeeded" {
            break j;
        }
        assert!(std::time::Instant::now() < deadline, "{j}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let cost = cost_of(&done["result"]);
    assert_spent(&app.client, &app.base, &id, cost).await;
    // A replay: the job's answer again, nothing spent.
    assert_eq!(create("job-a", 1).await, paid);
    assert_eq!(app.calls(), 1);
    assert_spent(&app.client, &app.base, &id, cost).await;
}

/// On the Messages face a budget's refusal is Anthropic's error shape,
/// and the key is read from `x-api-key` as Anthropic's SDKs send it.
#[tokio::test]
async fn a_budget_refusal_on_the_messages_face_is_an_anthropic_error() {
    let app = TestApp::with(with_priced_routes()).await;
    let (_, secret, _) = make_key(
        &app.client,
        &app.base,
        json!({"tenant": "acme", "name": "claude", "budget_usd": 0}),
    )
    .await;
    let r = app
        .client
        .post(app.url("/v1/messages"))
        .header("x-api-key", &secret)
        .header("anthropic-version", "2023-06-01")
        .json(&json!({"model": "priced", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("budget"),
        "{v}"
    );
    assert_eq!(app.calls(), 0);
}
