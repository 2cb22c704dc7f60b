//! Provider contracts, certification and certified failover
//! (docs/design.md, "Providers and certified failover"), against the real gateway and mock providers that misbehave on
//! purpose: a hallucinated top-level key, prose instead of JSON, a wrong
//! enum value, a dead primary, a slow primary, a prompt too long for the
//! target's context window.

use std::path::{Path, PathBuf};
use std::time::Duration;

use idem::app::App;
use idem::config::{Config, Source};
use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::helpers::*;

const GOOD: &str = r#"{"answer": "Order 1234 left the warehouse today.", "category": "delivery"}"#;
const EXTRA_KEY: &str = r#"{"answer": "Order 1234 left the warehouse today.", "category": "delivery", "confidence": 0.93}"#;
const PROSE: &str = "Sure! Your order 1234 left the warehouse today.";
const WRONG_ENUM: &str =
    r#"{"answer": "Order 1234 left the warehouse today.", "category": "shipping"}"#;

/// The example contract of the repository (two cases, three runs each).
fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/contracts/support.toml")
}

/// The example contract and its schema, copied where a test may edit them.
fn example_copy(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/contracts");
    for f in ["support.toml", "support_reply.schema.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    dir.join("support.toml")
}

fn answering(content: &str) -> Behaviour {
    Behaviour {
        content: Some(content.into()),
        ..Behaviour::default()
    }
}

fn failing(status: u16) -> Behaviour {
    Behaviour {
        fail_status: Some(status),
        ..Behaviour::default()
    }
}

/// Route `bot` (primary gpt-4o-mini, fallback llama-3.1-8b) under
/// `contract`, two attempts per job with a short backoff.
fn contracted(contract: &Path, primary: Behaviour, fallback: Behaviour) -> Spec {
    Spec {
        primary,
        fallback: Some(fallback),
        route: format!("contract = {:?}\n", contract.display().to_string()),
        attempts: "max = 2\nbackoff_base = \"10ms\"\nbackoff_max = \"20ms\"\n".into(),
        ..Spec::default()
    }
}

async fn certify(app: &TestApp, route: &str, target: &str) -> Value {
    let r = app
        .post_json(
            ADMIN,
            "/v1/admin/certify",
            &json!({"route": route, "target": target}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

async fn create_job(app: &TestApp, key: &str, content: &str) -> String {
    let body = json!({"request": chat_body(content)});
    let r = app
        .post_json(ACME, "/v1/jobs", &body, &[("idempotency-key", key)])
        .await;
    assert_eq!(r.status(), 201);
    let v: Value = r.json().await.unwrap();
    v["id"].as_str().unwrap().to_string()
}

async fn job_until(app: &TestApp, id: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let mut last = Value::Null;
    for _ in 0..1500 {
        let (status, v) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
        assert_eq!(status, 200, "{v}");
        if cond(&v) {
            return v;
        }
        last = v;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the job never reached the expected state: {last}");
}

fn settled(j: &Value) -> bool {
    j["state"] == "succeeded" || j["state"] == "failed"
}

/// The value of one metric line (`name{labels}`), 0 when absent.
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

const BLOCKED: &str = "idem_failover_blocked_total{route=\"bot\"} ";

fn fallback_calls(app: &TestApp) -> u64 {
    app.fallback.as_ref().unwrap().stats().calls
}

async fn routes(app: &TestApp) -> Value {
    let (status, v) = app.get_json(ADMIN, "/v1/admin/routes").await;
    assert_eq!(status, 200, "{v}");
    v
}

fn target<'a>(routes: &'a Value, route: &str, index: usize) -> &'a Value {
    let r = routes["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["route"] == route)
        .unwrap();
    &r["targets"][index]
}

/// A target whose answers break the contract fails certification with the
/// violation named; at run time (on the primary, which needs no
/// certificate) every such answer is a failed attempt, never a success,
/// never cached, never streamed.
async fn misbehaving(bad: &str, path: &str, rule: &str) {
    let app = TestApp::with(contracted(&example(), answering(bad), answering(bad))).await;

    let v = certify(&app, "bot", "fallback").await;
    assert_eq!(v["passed"], false, "{v}");
    let report = &v["reports"][0];
    assert_eq!(report["provider"], "fallback");
    let failures = report["failures"].as_array().unwrap();
    assert_eq!(failures.len(), 6, "every run of both cases fails: {report}");
    assert_eq!(failures[0]["path"], path, "{report}");
    assert_eq!(failures[0]["rule"], rule, "{report}");
    let run = &report["cases"][0]["runs"][0];
    assert_eq!(run["passed"], false);
    assert_eq!(run["violation"]["path"], path);
    assert_eq!(
        fallback_calls(&app),
        6,
        "certification calls the provider directly"
    );
    let listed = routes(&app).await;
    assert_eq!(
        target(&listed, "bot", 1)["certification"]["state"],
        "failed"
    );
    assert_eq!(target(&listed, "bot", 1)["failover_allowed"], false);

    // Plain requests: a 502 contract_violation, not cached, not shared.
    let body = chat_body("Where is my order 1234?");
    for n in 1..=2 {
        let r = app.chat(ACME, &body).await;
        assert_eq!(r.headers()["idem-outcome"], "leader", "never a cache hit");
        let e = assert_error(r, 502, "contract_violation").await;
        let msg = e["error"]["message"].as_str().unwrap();
        assert!(msg.contains("contract") && msg.contains(path), "{msg}");
        assert_eq!(app.calls(), n);
    }
    // A streamed request on a contract route is buffered and checked: the
    // client gets the error, not a stream of the bad answer.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let r = app.chat(ACME, &streamed).await;
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_error(r, 502, "contract_violation").await;
    assert_eq!(app.calls(), 3);

    // A job: each answer is a failed attempt; the uncertified fallback
    // gets no failover.
    let id = create_job(&app, "bad-1", "Where is my order 1234?").await;
    let j = job_until(&app, &id, settled).await;
    assert_eq!(j["state"], "failed", "{j}");
    assert_eq!(j["result"], Value::Null);
    for a in j["attempts"].as_array().unwrap() {
        assert_eq!(a["state"], "failed", "{j}");
        assert_eq!(a["reason"], "contract_violation", "{j}");
        assert_eq!(a["provider"], "primary", "{j}");
    }
    assert!(
        j["error"].as_str().unwrap().contains("not certified"),
        "{j}"
    );
    assert_eq!(fallback_calls(&app), 6, "no failover to the failed target");
    assert_eq!(metric(&app.metrics().await, BLOCKED), 4.0);
}

#[tokio::test]
async fn a_hallucinated_top_level_key_fails_certification_and_every_answer() {
    misbehaving(EXTRA_KEY, "/confidence", "extra_key").await;
}

#[tokio::test]
async fn prose_instead_of_json_fails_certification_and_every_answer() {
    misbehaving(PROSE, "", "not_json").await;
}

#[tokio::test]
async fn a_wrong_enum_value_fails_certification_and_every_answer() {
    misbehaving(WRONG_ENUM, "/category", "enum").await;
}

#[tokio::test]
async fn a_failed_primary_fails_over_to_a_certified_fallback_as_attempt_2() {
    certified_failover(contracted(&example(), failing(500), answering(GOOD))).await;
}

#[tokio::test]
async fn a_failed_primary_fails_over_to_a_certified_fallback_on_postgres() {
    certified_failover(Spec {
        postgres: true,
        ..contracted(&example(), failing(500), answering(GOOD))
    })
    .await;
}

async fn certified_failover(spec: Spec) {
    let app = TestApp::with(spec).await;
    let v = certify(&app, "bot", "fallback").await;
    assert_eq!(v["passed"], true, "{v}");
    let report = &v["reports"][0];
    assert_eq!(report["failures"], json!([]));
    // llama's tokenizer is unknown: lengths are not checked, not failed.
    assert_eq!(report["tokenizer"], Value::Null);
    assert_eq!(report["cases"][0]["fits"], Value::Null);
    assert_eq!(report["cases"][0]["runs"].as_array().unwrap().len(), 3);
    let listed = routes(&app).await;
    let fallback = target(&listed, "bot", 1);
    assert_eq!(fallback["certification"]["state"], "certified");
    assert_eq!(fallback["failover_allowed"], true);
    assert_eq!(target(&listed, "bot", 0)["primary"], true);

    let id = create_job(&app, "fo-1", "Where is my order 1234?").await;
    let j = job_until(&app, &id, settled).await;
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["completed_by"], 2);
    assert_eq!(j["attempts"][0]["provider"], "primary");
    assert_eq!(j["attempts"][0]["state"], "failed");
    assert_eq!(j["attempts"][0]["reason"], "provider_error");
    assert_eq!(j["attempts"][1]["provider"], "fallback");
    assert_eq!(j["attempts"][1]["state"], "succeeded");
    assert_eq!(content_of(&j["result"]), GOOD);

    // Plain chat completions fail over by the same rule.
    let r = app.chat(ACME, &chat_body("Where is parcel 77?")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-provider"], "fallback");
    assert_eq!(metric(&app.metrics().await, BLOCKED), 0.0);
}

#[tokio::test]
async fn an_uncertified_fallback_gets_no_failover_and_the_block_is_counted() {
    let app = TestApp::with(contracted(&example(), failing(500), answering(GOOD))).await;
    let listed = routes(&app).await;
    assert_eq!(target(&listed, "bot", 1)["certification"]["state"], "never");
    assert_eq!(target(&listed, "bot", 1)["failover_allowed"], false);

    let id = create_job(&app, "nofo-1", "Where is my order 1234?").await;
    let j = job_until(&app, &id, settled).await;
    assert_eq!(j["state"], "failed", "{j}");
    let error = j["error"].as_str().unwrap();
    assert!(
        error.contains("failover to fallback/llama-3.1-8b blocked: not certified"),
        "{error}"
    );
    let providers: Vec<&str> = j["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["provider"].as_str().unwrap())
        .collect();
    assert_eq!(providers, vec!["primary", "primary"]);
    assert_eq!(fallback_calls(&app), 0);
    assert_eq!(metric(&app.metrics().await, BLOCKED), 1.0);

    let r = app.chat(ACME, &chat_body("Where is parcel 77?")).await;
    assert_eq!(r.status(), 500, "the primary's own error");
    assert_eq!(fallback_calls(&app), 0);
    assert_eq!(metric(&app.metrics().await, BLOCKED), 2.0);
}

#[tokio::test]
async fn routes_without_a_contract_fail_over_to_any_target() {
    let app = TestApp::with(Spec {
        primary: failing(500),
        fallback: Some(answering(PROSE)),
        ..Spec::default()
    })
    .await;
    let r = app.chat(ACME, &chat_body("anything")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-provider"], "fallback");
    let listed = routes(&app).await;
    assert_eq!(target(&listed, "bot", 1)["failover_allowed"], true);
    assert_eq!(target(&listed, "bot", 1)["certification"], Value::Null);
}

#[tokio::test]
async fn editing_the_contract_voids_the_old_certificate_until_it_passes_again() {
    let dir = temp_dir();
    let contract = example_copy(&dir);
    let db = format!("sqlite://{}", dir.join("idem.db").display());
    let spec = Spec {
        storage_url: Some(db),
        ..contracted(&contract, failing(500), answering(GOOD))
    };

    let app = TestApp::with(spec.clone()).await;
    assert_eq!(certify(&app, "bot", "fallback").await["passed"], true);
    let old_hash = routes(&app).await["data"][0]["contract"]["hash"].clone();
    app.stop().await;

    // Editing the schema file alone changes the contract hash.
    let schema = dir.join("support_reply.schema.json");
    let text = std::fs::read_to_string(&schema).unwrap();
    std::fs::write(
        &schema,
        text.replace("\"minLength\": 1", "\"minLength\": 1, \"maxLength\": 500"),
    )
    .unwrap();

    let app = TestApp::with(spec).await;
    let listed = routes(&app).await;
    assert_ne!(listed["data"][0]["contract"]["hash"], old_hash);
    let fallback = target(&listed, "bot", 1);
    assert_eq!(fallback["certification"]["state"], "stale", "{fallback}");
    assert_eq!(fallback["certification"]["contract_hash"], old_hash);
    assert_eq!(fallback["failover_allowed"], false);

    let id = create_job(&app, "edit-1", "Where is my order 1234?").await;
    let j = job_until(&app, &id, settled).await;
    assert_eq!(j["state"], "failed", "{j}");
    assert_eq!(
        fallback_calls(&app),
        0,
        "the old certificate must not count"
    );
    assert_eq!(metric(&app.metrics().await, BLOCKED), 1.0);

    // Certified again for the new hash: failover works at once.
    assert_eq!(certify(&app, "bot", "fallback").await["passed"], true);
    let id = create_job(&app, "edit-2", "Where is my order 1234?").await;
    let j = job_until(&app, &id, settled).await;
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["completed_by"], 2);
    assert_eq!(j["attempts"][1]["provider"], "fallback");
    app.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

fn hedging(fallback: Behaviour) -> Spec {
    Spec {
        attempts: "max = 1\nhedge_after = \"100ms\"\n".into(),
        ..contracted(
            &example(),
            Behaviour {
                hold: true,
                content: Some(GOOD.into()),
                ..Behaviour::default()
            },
            fallback,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hedge_goes_to_a_certified_fallback_which_wins_and_the_primary_is_discarded() {
    let app = TestApp::with(hedging(answering(GOOD))).await;
    assert_eq!(certify(&app, "bot", "fallback").await["passed"], true);
    let certification_calls = fallback_calls(&app);

    let id = create_job(&app, "hedge-1", "Where is my order 1234?").await;
    let a = held(&app.mock, 1).await;
    let j = job_until(&app, &id, |j| j["state"] == "succeeded").await;
    assert_eq!(j["completed_by"], 2, "{j}");
    assert_eq!(j["attempts"][1]["provider"], "fallback");
    assert_eq!(j["attempts"][1]["hedge"], true);
    assert_eq!(fallback_calls(&app), certification_calls + 1);
    let version = j["version"].clone();

    // The primary's late (and valid) answer loses the compare-and-swap.
    release(&app.mock, Some(a[0])).await;
    let j = job_until(&app, &id, |j| j["attempts"][0]["state"] == "discarded").await;
    assert_eq!(j["completed_by"], 2);
    assert_eq!(j["version"], version);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_hedge_is_sent_to_an_uncertified_fallback() {
    let app = TestApp::with(hedging(answering(GOOD))).await;
    let id = create_job(&app, "hedge-2", "Where is my order 1234?").await;
    held(&app.mock, 1).await;
    // The hedge timer fired and the hedge was refused: counted, not sent.
    let metrics_url = app.url("/metrics");
    eventually_async(Duration::from_secs(10), || {
        let url = metrics_url.clone();
        async move {
            let text = reqwest::get(url).await.unwrap().text().await.unwrap();
            metric(&text, BLOCKED) >= 1.0
        }
    })
    .await;
    assert_eq!(
        fallback_calls(&app),
        0,
        "a hedge reached an uncertified target"
    );
    release(&app.mock, None).await;
    let j = job_until(&app, &id, settled).await;
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["completed_by"], 1);
    assert_eq!(j["attempts"].as_array().unwrap().len(), 1);
    assert_eq!(fallback_calls(&app), 0);
    assert_eq!(metric(&app.metrics().await, BLOCKED), 1.0);
}

#[tokio::test]
async fn a_prompt_longer_than_the_context_window_fails_certification_with_its_token_count() {
    let dir = temp_dir();
    let long = "Please check the status of every order I ever placed. ".repeat(20);
    let contract = dir.join("tiny.toml");
    std::fs::write(
        &contract,
        format!(
            "required = [\"answer\"]\nmax_tokens = 16\n\
             [[cases]]\nname = \"long\"\nmessages = [{{role = \"user\", content = {long:?}}}]\n\
             [[cases]]\nname = \"short\"\nmessages = [{{role = \"user\", content = \"Hi\"}}]\n"
        ),
    )
    .unwrap();
    let app = TestApp::with(Spec {
        fallback: Some(answering(r#"{"answer": "ok"}"#)),
        extra: format!(
            "[[routes]]\nmodel = \"tiny\"\ncontract = {:?}\ntargets = [\
             {{ provider = \"primary\", model = \"gpt-4o-mini\" }}, \
             {{ provider = \"fallback\", model = \"gpt-4o-mini\", context_window = 64 }}]\n",
            contract.display().to_string()
        ),
        ..Spec::default()
    })
    .await;
    let v = certify(&app, "tiny", "fallback").await;
    assert_eq!(v["passed"], false, "{v}");
    let report = &v["reports"][0];
    assert_eq!(report["tokenizer"], "o200k_base");
    assert_eq!(report["context_window"], 64);
    assert_eq!(report["context_window_source"], "target");
    let case = &report["cases"][0];
    let tokens = case["prompt_tokens"].as_u64().unwrap();
    assert!(tokens > 64, "{case}");
    assert_eq!(case["fits"], false);
    assert_eq!(
        case["runs"],
        json!([]),
        "a prompt that cannot fit is not sent"
    );
    let error = case["error"].as_str().unwrap();
    assert!(
        error.contains(&format!("the prompt is {tokens} tokens")) && error.contains("64"),
        "{error}"
    );
    assert_eq!(report["failures"][0]["rule"], "context_window");
    // The short case fits and passes.
    assert_eq!(report["cases"][1]["fits"], true);
    assert_eq!(report["cases"][1]["passed"], true);
    assert_eq!(fallback_calls(&app), 1);
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn a_dead_primary_opens_its_circuit_and_work_goes_to_the_certified_fallback() {
    let app = TestApp::with(Spec {
        extra: "[breaker]\nfailures = 2\ncooldown = \"1h\"\n\
                [[routes]]\nmodel = \"solo\"\ntargets = [{ provider = \"primary\", model = \"gpt-4o-mini\" }]\n"
            .into(),
        ..contracted(&example(), failing(500), answering(GOOD))
    })
    .await;
    assert_eq!(certify(&app, "bot", "fallback").await["passed"], true);
    for (n, text) in ["first", "second"].iter().enumerate() {
        let r = app.chat(ACME, &chat_body(text)).await;
        assert_eq!(r.status(), 200);
        assert_eq!(r.headers()["idem-provider"], "fallback");
        assert_eq!(app.calls(), n as u64 + 1);
    }
    // Two consecutive failures: the primary's circuit is open and plain
    // requests skip it.
    let primary = target(&routes(&app).await, "bot", 0).clone();
    assert_eq!(primary["circuit"]["state"], "open", "{primary}");
    assert_eq!(primary["circuit"]["consecutive_failures"], 2);
    let r = app.chat(ACME, &chat_body("third")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["idem-provider"], "fallback");
    assert_eq!(app.calls(), 2, "an open circuit was called");
    let m = app.metrics().await;
    assert!(
        m.lines().any(|l| l.starts_with("idem_circuit_state{")
            && l.contains("provider=\"primary\"")
            && l.ends_with(" 2")),
        "{m}"
    );
    // So do jobs: the first attempt goes straight to the fallback.
    let id = create_job(&app, "cb-1", "fourth").await;
    let j = job_until(&app, &id, settled).await;
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["completed_by"], 1);
    assert_eq!(j["attempts"][0]["provider"], "fallback");
    assert_eq!(app.calls(), 2);
    // A route with nowhere else to go answers at once, with Retry-After.
    let mut body = chat_body("fifth");
    body["model"] = json!("solo");
    let r = app.chat(ACME, &body).await;
    assert!(r.headers().contains_key("retry-after"));
    let e = assert_error(r, 503, "no_target_available").await;
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("circuit open"),
        "{e}"
    );
    assert_eq!(app.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_streamed_answer_on_a_contract_route_reaches_followers_only_after_it_passed() {
    let app = TestApp::with(contracted(
        &example(),
        Behaviour {
            hold: true,
            content: Some(GOOD.into()),
            ..Behaviour::default()
        },
        answering(GOOD),
    ))
    .await;
    let mut body = chat_body("Where is my order 1234?");
    body["stream"] = json!(true);
    let tasks = wave(&app, ACME, &body, 5).await;
    held(&app.mock, 1).await;
    app.until_followers(4).await;
    release(&app.mock, None).await;
    for (status, _, text) in collect(tasks).await {
        assert_eq!(status, 200);
        assert_eq!(sse_content(&text), GOOD);
    }
    assert_eq!(app.calls(), 1);
    // The checked answer entered the cache.
    let r = app.chat(ACME, &chat_body("Where is my order 1234?")).await;
    assert_eq!(r.headers()["idem-outcome"], "cache-hit");
}

#[tokio::test]
async fn an_invalid_contract_file_stops_start_up_naming_the_file() {
    let dir = temp_dir();
    let contract = dir.join("broken.toml");
    std::fs::write(&contract, "schema = \"nowhere.json\"\nrequird = [\"x\"]\n").unwrap();
    let text = format!(
        "[[providers]]\nname = \"p\"\nkind = \"mock\"\n[[routes]]\nmodel = \"m\"\n\
         targets = [{{ provider = \"p\", model = \"x\" }}]\ncontract = {:?}\n\
         [storage]\nurl = \"sqlite://{}\"\n",
        contract.display().to_string(),
        dir.join("idem.db").display()
    );
    let config = Config::from_toml_str(&text, Source::Embedded, false).unwrap();
    let err = match App::build(Config {
        server: idem::config::ServerConfig {
            listen: "127.0.0.1:0".into(),
            ..config.server.clone()
        },
        ..config
    })
    .await
    {
        Ok(_) => panic!("an invalid contract must stop start-up"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("broken.toml") && err.contains("requird"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A config file for the command line, on the running app's database and
/// mocks.
fn cli_config(app: &TestApp, dir: &Path, contract: &Path) -> PathBuf {
    let path = dir.join("idem.toml");
    std::fs::write(
        &path,
        format!(
            "[storage]\nurl = {:?}\n\
             [[providers]]\nname = \"primary\"\nkind = \"openai\"\nbase_url = {:?}\n\
             [[providers]]\nname = \"fallback\"\nkind = \"openai\"\nbase_url = {:?}\n\
             [[routes]]\nmodel = \"bot\"\ncontract = {:?}\ntargets = [\
             {{ provider = \"primary\", model = \"gpt-4o-mini\" }}, \
             {{ provider = \"fallback\", model = \"llama-3.1-8b\" }}]\n",
            app.state.live.load().config.storage.url,
            app.mock.base_url(),
            app.fallback.as_ref().unwrap().base_url(),
            contract.display().to_string(),
        ),
    )
    .unwrap();
    path
}

fn idem(args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(args)
        .env_remove("IDEM_CONFIG")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idem_certify_and_idem_routes_reach_a_running_gateway_without_restart() {
    let dir = temp_dir();
    let app = TestApp::with(Spec {
        storage_url: Some(format!("sqlite://{}", dir.join("idem.db").display())),
        extra: "[contracts]\nrefresh_interval = \"100ms\"\n".into(),
        ..contracted(&example(), failing(500), answering(GOOD))
    })
    .await;
    let config = cli_config(&app, &dir, &example());
    let cfg = config.to_str().unwrap();

    let (ok, out) = idem(&["routes", "--config", cfg]);
    assert!(ok, "{out}");
    assert!(out.contains("route bot: contract"), "{out}");
    assert!(out.contains("never certified"), "{out}");

    let (ok, out) = tokio::task::spawn_blocking({
        let cfg = cfg.to_string();
        move || idem(&["certify", "--route", "bot", "--config", &cfg])
    })
    .await
    .unwrap();
    assert!(ok, "{out}");
    assert!(
        out.contains("certify route bot -> fallback/llama-3.1-8b"),
        "{out}"
    );
    assert!(out.contains("tokenizer unknown for llama-3.1-8b"), "{out}");
    assert!(out.contains("run 3/3: ok"), "{out}");
    assert!(out.contains("CERTIFIED"), "{out}");

    // The running gateway sees it at its next refresh, without a restart.
    let route = app.state.live.load().route("bot").unwrap();
    let hash = route.contract.as_ref().unwrap().hash.clone();
    eventually(Duration::from_secs(10), || {
        route.targets[1].certificate.valid_for(&hash)
    })
    .await;
    let id = create_job(&app, "cli-1", "Where is my order 1234?").await;
    let j = job_until(&app, &id, settled).await;
    assert_eq!(j["state"], "succeeded", "{j}");
    assert_eq!(j["completed_by"], 2);

    let (ok, out) = idem(&["routes", "--config", cfg]);
    assert!(ok, "{out}");
    assert!(
        out.contains("fallback/llama-3.1-8b") && out.contains("certified at"),
        "{out}"
    );

    // A failing target: a readable report and a non-zero exit.
    app.fallback
        .as_ref()
        .unwrap()
        .set_behaviour(answering(WRONG_ENUM));
    let (ok, out) = tokio::task::spawn_blocking({
        let cfg = cfg.to_string();
        move || {
            idem(&[
                "certify", "--route", "bot", "--target", "fallback", "--config", &cfg,
            ])
        }
    })
    .await
    .unwrap();
    assert!(!ok, "{out}");
    assert!(
        out.contains("FAIL at /category: \"shipping\" is not one of"),
        "{out}"
    );
    assert!(
        out.contains("certification failed for fallback/llama-3.1-8b"),
        "{out}"
    );
    eventually(Duration::from_secs(10), || {
        !route.targets[1].certificate.valid_for(&hash)
    })
    .await;
    let (_, out) = idem(&["routes", "--config", cfg]);
    assert!(out.contains("failover blocked; failed"), "{out}");
    app.stop().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test]
async fn the_admin_endpoints_need_the_admin_key() {
    let app = TestApp::with(contracted(&example(), answering(GOOD), answering(GOOD))).await;
    let certify = json!({"route": "bot", "target": "fallback"});
    let r = app
        .post_json(ACME, "/v1/admin/certify", &certify, &[])
        .await;
    assert_error(r, 403, "admin_key_required").await;
    let (status, v) = app.get_json(ACME, "/v1/admin/routes").await;
    assert_eq!(status, 403, "{v}");
    let r = app
        .client
        .get(app.url("/v1/admin/routes"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        fallback_calls(&app),
        0,
        "a refused certify called a provider"
    );
    // Admin mistakes are request errors, not internal ones.
    let r = app
        .post_json(ADMIN, "/v1/admin/certify", &json!({"route": "nope"}), &[])
        .await;
    assert_error(r, 404, "model_not_found").await;
    let r = app
        .post_json(
            ADMIN,
            "/v1/admin/certify",
            &json!({"route": "bot", "target": "nobody"}),
            &[],
        )
        .await;
    assert_error(r, 400, "cannot_certify").await;
}

/// The Messages and Responses faces run the same contract: an answer that
/// breaks it is a failed attempt and an error in the face's shape, never a
/// success; a failed primary fails over to the certified fallback.
#[tokio::test]
async fn each_face_gets_contract_checks_and_certified_failover() {
    for face in [Face::Messages, Face::Responses] {
        // A primary whose answers break the contract; a fallback that keeps
        // it, certified.
        let app = TestApp::with(contracted(
            &example(),
            answering(EXTRA_KEY),
            answering(GOOD),
        ))
        .await;
        // Before certification: a plain request gets the violation.
        let r = app
            .ask(face, ACME, &face.body("Where is my order 1234?"), &[])
            .await;
        assert_eq!(r.status(), 502, "{face:?}");
        let v: Value = r.json().await.unwrap();
        let kind = face.error_kind(&v);
        if face == Face::Responses {
            assert_eq!(kind, "contract_violation");
        }
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("contract"), "{v}");
        assert_eq!(
            fallback_calls(&app),
            0,
            "no failover to an uncertified target"
        );

        let v = certify(&app, "bot", "fallback").await;
        assert_eq!(v["passed"], true, "{v}");
        // A job through the face: attempt 1 breaks the contract on the
        // primary, attempt 2 succeeds on the certified fallback.
        let r = app
            .ask(
                face,
                ACME,
                &face.body("Where is parcel 77?"),
                &[("idempotency-key", "contract-1")],
            )
            .await;
        assert_eq!(r.status(), 200, "{face:?}");
        assert_eq!(r.headers()["idem-provider"], "fallback");
        assert_eq!(r.headers()["idem-attempt"], "2");
        let id = r.headers()["idem-job-id"].to_str().unwrap().to_string();
        let v: Value = r.json().await.unwrap();
        assert_eq!(face.text(&v), GOOD, "{v}");
        let (_, j) = app.get_json(ACME, &format!("/v1/jobs/{id}")).await;
        assert_eq!(j["attempts"][0]["state"], "failed", "{j}");
        assert_eq!(j["attempts"][0]["reason"], "contract_violation", "{j}");
        assert_eq!(j["attempts"][1]["provider"], "fallback", "{j}");
        assert_eq!(j["attempts"][1]["state"], "succeeded", "{j}");
        app.stop().await;
    }
}
