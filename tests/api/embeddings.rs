//! `POST /v1/embeddings`: each input item is its own task. A batch sends
//! upstream only the items nobody has answered or is answering, in one
//! call, and gets every item's vector back in the caller's order; waves
//! and batches that share items share their calls; failures are shared
//! and negatively cached per item; across replicas through Redis.

use base64::Engine;
use idem::mock_upstream::{Behaviour, RecordedRequest, embedding_of};
use serde_json::{Value, json};

use crate::helpers::*;

/// The test gateway's route `bot`, serving embeddings too.
fn spec() -> Spec {
    Spec {
        route: "endpoints = [\"chat\", \"embeddings\"]\n".into(),
        ..Spec::default()
    }
}

fn held_spec() -> Spec {
    Spec {
        primary: Behaviour {
            hold: true,
            ..Behaviour::default()
        },
        ..spec()
    }
}

/// An answer: status, `Idem-*` headers that matter here, body.
pub struct Embedded {
    pub status: u16,
    pub outcome: String,
    sent: Option<u64>,
    saved: Option<u64>,
    pub body: Value,
}

async fn embed_at(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> Embedded {
    let mut r = client
        .post(format!("{base}/v1/embeddings"))
        .bearer_auth(key)
        .json(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap();
    let header = |name: &str| {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let (outcome, sent, saved) = (
        header("idem-outcome").unwrap_or_default(),
        header("idem-items-sent").map(|v| v.parse().unwrap()),
        header("idem-items-saved").map(|v| v.parse().unwrap()),
    );
    let status = r.status().as_u16();
    Embedded {
        status,
        outcome,
        sent,
        saved,
        body: r.json().await.unwrap_or(Value::Null),
    }
}

pub async fn embed(app: &TestApp, key: &str, body: &Value) -> Embedded {
    embed_at(&app.client, &app.base, key, body, &[]).await
}

/// The items `prefix-0 ..`.
fn items(prefix: &str, range: std::ops::Range<usize>) -> Vec<Value> {
    range.map(|i| json!(format!("{prefix}-{i}"))).collect()
}

/// A vector in either encoding, as f32s.
fn floats(v: &Value) -> Vec<f32> {
    match v {
        Value::Array(xs) => xs.iter().map(|x| x.as_f64().unwrap() as f32).collect(),
        Value::String(b64) => base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        other => panic!("not a vector: {other}"),
    }
}

/// Every vector is its own item's (by the mock's derivation), in order.
pub fn assert_vectors(body: &Value, inputs: &[Value], dimensions: usize) {
    let data = body["data"].as_array().unwrap_or_else(|| panic!("{body}"));
    assert_eq!(data.len(), inputs.len(), "{body}");
    for (i, (d, item)) in data.iter().zip(inputs).enumerate() {
        assert_eq!(d["index"], i, "{d}");
        assert_eq!(d["object"], "embedding");
        assert_eq!(
            floats(&d["embedding"]),
            embedding_of(item, dimensions),
            "item {i}: {item}"
        );
    }
}

/// The embeddings requests the mock received, oldest first (its last 50).
fn embedding_calls(app: &TestApp) -> Vec<RecordedRequest> {
    app.mock
        .stats()
        .last_requests
        .into_iter()
        .filter(|r| r.endpoint == idem::mock_upstream::Endpoint::Embeddings)
        .collect()
}

/// The mock's own usage for these items.
fn mock_tokens(inputs: &[Value]) -> u64 {
    let (_, body) = idem::mock_upstream::embeddings_answer(&json!({"model": "m", "input": inputs}));
    let v: Value = serde_json::from_str(&body).unwrap();
    v["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test]
async fn a_batch_sends_only_the_items_not_cached_in_one_call_and_answers_in_order() {
    let app = TestApp::with(spec()).await;
    let all = items("chunk", 0..64);
    // 40 of the 64, spread through the batch, are cached first.
    let cached: Vec<Value> = all
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 8 < 5)
        .map(|(_, v)| v.clone())
        .collect();
    let others: Vec<Value> = all
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 8 >= 5)
        .map(|(_, v)| v.clone())
        .collect();
    assert_eq!((cached.len(), others.len()), (40, 24));
    let first = embed(&app, ACME, &json!({"model": "bot", "input": cached})).await;
    assert_eq!(first.status, 200, "{}", first.body);
    assert_eq!((first.sent, first.saved), (Some(40), Some(0)));

    let batch = embed(&app, ACME, &json!({"model": "bot", "input": all})).await;
    assert_eq!(batch.status, 200, "{}", batch.body);
    assert_eq!(batch.outcome, "leader");
    assert_eq!((batch.sent, batch.saved), (Some(24), Some(40)));
    assert_vectors(&batch.body, &all, 8);
    // One more call, carrying exactly the 24 others, in order.
    let calls = embedding_calls(&app);
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[1].body["input"], json!(others));
    assert_eq!(calls[1].body["model"], "gpt-4o-mini");
    assert_eq!(calls[1].body["encoding_format"], "float");
    // The usage is what was sent.
    assert_eq!(batch.body["usage"]["prompt_tokens"], mock_tokens(&others));
    assert_eq!(batch.body["usage"]["total_tokens"], mock_tokens(&others));
    assert_eq!(batch.body["object"], "list");
    assert_eq!(batch.body["model"], "gpt-4o-mini");

    // Everything cached now: no call, a cache hit, no usage.
    let again = embed(&app, ACME, &json!({"model": "bot", "input": all})).await;
    assert_eq!(again.outcome, "cache-hit");
    assert_eq!((again.sent, again.saved), (Some(0), Some(64)));
    assert_eq!(again.body["usage"]["prompt_tokens"], 0);
    assert_vectors(&again.body, &all, 8);
    assert_eq!(app.mock.stats().embedding_calls, 2);
    assert_eq!(app.mock.stats().embedding_items, 64);

    // Counted as items, and the tokens the saved items did not cost.
    let (_, stats) = app.get_json(ACME, "/v1/stats").await;
    let c = &stats["coalescing"];
    assert_eq!(c["embedding_items"], 40 + 64 + 64, "{stats}");
    assert_eq!(c["embedding_items_sent"], 64);
    assert_eq!(c["embedding_items_saved"], 40 + 64);
    assert_eq!(
        c["saved_input_tokens"],
        mock_tokens(&cached) + mock_tokens(&all),
        "{stats}"
    );
    let metrics = app.metrics().await;
    assert!(
        metrics.contains("idem_embedding_items_total{route=\"bot\",outcome=\"leader\"} 64"),
        "{metrics}"
    );
    assert!(
        metrics.contains("idem_embedding_items_total{route=\"bot\",outcome=\"cache-hit\"} 104"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_concurrent_batches_that_share_items_send_them_once() {
    let app = TestApp::with(held_spec()).await;
    let a = items("doc", 0..50);
    // 30 of A's items and 20 of its own.
    let own = items("other", 0..20);
    let b: Vec<Value> = a[10..40].iter().chain(&own).cloned().collect();
    let first = {
        let (client, base, body) = (
            app.client.clone(),
            app.base.clone(),
            json!({"model": "bot", "input": a}),
        );
        tokio::spawn(async move { embed_at(&client, &base, ACME, &body, &[]).await })
    };
    held(&app.mock, 1).await;
    let second = {
        let (client, base, body) = (
            app.client.clone(),
            app.base.clone(),
            json!({"model": "bot", "input": b}),
        );
        tokio::spawn(async move { embed_at(&client, &base, ACME, &body, &[]).await })
    };
    // B's own call is held beside A's: it carries only B's 20 items.
    held(&app.mock, 2).await;
    app.until_followers(30).await;
    let calls = embedding_calls(&app);
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].body["input"], json!(a));
    assert_eq!(calls[1].body["input"], json!(own));
    release(&app.mock, None).await;
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!((first.status, second.status), (200, 200));
    assert_vectors(&first.body, &a, 8);
    assert_vectors(&second.body, &b, 8);
    assert_eq!((second.sent, second.saved), (Some(20), Some(30)));
    assert_eq!(second.outcome, "leader");
    assert_eq!(app.mock.stats().embedding_items, 70);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_thousand_identical_requests_make_one_call_and_another_tenant_its_own() {
    let app = TestApp::with(held_spec()).await;
    let body = json!({"model": "bot", "input": "the same chunk"});
    let tasks: Vec<_> = (0..1000)
        .map(|_| {
            let (client, base, body) = (app.client.clone(), app.base.clone(), body.clone());
            tokio::spawn(async move { embed_at(&client, &base, ACME, &body, &[]).await })
        })
        .collect();
    held(&app.mock, 1).await;
    app.until_followers(999).await;
    release(&app.mock, None).await;
    let answers = collect(tasks).await;
    assert!(answers.iter().all(|a| a.status == 200));
    let leaders = answers.iter().filter(|a| a.outcome == "leader").count();
    let followers = answers.iter().filter(|a| a.outcome == "follower").count();
    assert_eq!((leaders, followers), (1, 999));
    for a in &answers {
        assert_vectors(&a.body, &[json!("the same chunk")], 8);
    }
    assert_eq!(app.mock.stats().embedding_calls, 1);
    // Another tenant's identical request is another task.
    let other = {
        let (client, base, body) = (app.client.clone(), app.base.clone(), body.clone());
        tokio::spawn(async move { embed_at(&client, &base, BETA, &body, &[]).await })
    };
    held(&app.mock, 1).await;
    release(&app.mock, None).await;
    let other = other.await.unwrap();
    assert_eq!(other.outcome, "leader");
    assert_eq!(app.mock.stats().embedding_calls, 2);
}

#[tokio::test]
async fn dimensions_make_other_tasks_and_encodings_are_renderings_of_one() {
    let app = TestApp::with(spec()).await;
    let item = json!("one item");
    let small = embed(
        &app,
        ACME,
        &json!({"model": "bot", "input": item, "dimensions": 256}),
    )
    .await;
    let large = embed(
        &app,
        ACME,
        &json!({"model": "bot", "input": item, "dimensions": 512}),
    )
    .await;
    assert_eq!(
        (small.outcome.as_str(), large.outcome.as_str()),
        ("leader", "leader")
    );
    assert_vectors(&small.body, std::slice::from_ref(&item), 256);
    assert_vectors(&large.body, std::slice::from_ref(&item), 512);
    assert_eq!(app.mock.stats().embedding_calls, 2);

    let float = embed(
        &app,
        ACME,
        &json!({"model": "bot", "input": "two forms", "encoding_format": "float"}),
    )
    .await;
    let b64 = embed(
        &app,
        ACME,
        &json!({"model": "bot", "input": "two forms", "encoding_format": "base64"}),
    )
    .await;
    assert_eq!(float.outcome, "leader");
    assert_eq!(b64.outcome, "cache-hit");
    assert!(float.body["data"][0]["embedding"].is_array());
    assert!(b64.body["data"][0]["embedding"].is_string());
    assert_vectors(&float.body, &[json!("two forms")], 8);
    assert_vectors(&b64.body, &[json!("two forms")], 8);
    assert_eq!(app.mock.stats().embedding_calls, 3);
    // The same item as a token array is another item.
    let tokens = embed(&app, ACME, &json!({"model": "bot", "input": [[1, 2, 3]]})).await;
    assert_eq!(tokens.outcome, "leader");
    assert_vectors(&tokens.body, &[json!([1, 2, 3])], 8);
}

#[tokio::test]
async fn a_failing_item_fails_the_request_and_a_retry_within_the_negative_ttl_sends_nothing() {
    let app = TestApp::with(Spec {
        primary: Behaviour {
            fail_status: Some(503),
            ..Behaviour::default()
        },
        cache: "server_error_ttl = \"30s\"\n".into(),
        ..spec()
    })
    .await;
    let body = json!({"model": "bot", "input": ["x", "y"]});
    let failed = embed(&app, ACME, &body).await;
    assert_eq!(failed.status, 503, "{}", failed.body);
    assert!(
        failed.body["error"]["message"].is_string(),
        "{}",
        failed.body
    );
    assert_eq!(failed.outcome, "leader");
    assert_eq!(app.mock.stats().embedding_calls, 1);
    let again = embed(&app, ACME, &body).await;
    assert_eq!(again.status, 503);
    assert_eq!(again.outcome, "negative-hit");
    assert_eq!((again.sent, again.saved), (Some(0), Some(2)));
    // One of the failed items in another batch: that item alone is not sent.
    app.mock.set_behaviour(Behaviour::default());
    let mixed = embed(
        &app,
        ACME,
        &json!({"model": "bot", "input": ["fresh", "y"]}),
    )
    .await;
    assert_eq!(mixed.status, 503);
    assert_eq!(app.mock.stats().embedding_calls, 2);
    assert_eq!(embedding_calls(&app)[1].body["input"], json!(["fresh"]));
}

#[tokio::test]
async fn cache_control_applies_per_item() {
    let app = TestApp::with(spec()).await;
    let body = json!({"model": "bot", "input": ["p", "q"]});
    assert_eq!(embed(&app, ACME, &body).await.outcome, "leader");
    // no-cache: the cache is not read, the items are sent again.
    let fresh = embed_at(
        &app.client,
        &app.base,
        ACME,
        &body,
        &[("cache-control", "no-cache")],
    )
    .await;
    assert_eq!(fresh.outcome, "leader");
    assert_eq!(fresh.sent, Some(2));
    // no-store: sent, not shared, not kept.
    let private = embed_at(
        &app.client,
        &app.base,
        ACME,
        &json!({"model": "bot", "input": ["r"]}),
        &[("cache-control", "no-store")],
    )
    .await;
    assert_eq!(private.outcome, "bypass");
    let after = embed(&app, ACME, &json!({"model": "bot", "input": ["r"]})).await;
    assert_eq!(after.outcome, "leader", "a no-store answer was cached");
    assert_eq!(app.mock.stats().embedding_calls, 4);
}

#[tokio::test]
async fn what_openai_refuses_never_goes_upstream_and_routes_say_what_they_serve() {
    let app = TestApp::with(Spec {
        extra: "[[routes]]\nmodel = \"chat-only\"\ntargets = [{ provider = \"primary\", model = \"m\" }]\n".into(),
        ..spec()
    })
    .await;
    for (body, param) in [
        (json!({"model": "bot"}), "input"),
        (json!({"model": "bot", "input": ""}), "input"),
        (json!({"model": "bot", "input": [1, "a"]}), "input"),
        (
            json!({"model": "bot", "input": "x", "dimensions": 0}),
            "dimensions",
        ),
        (
            json!({"model": "bot", "input": "x", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"input": "x"}), "model"),
    ] {
        let r = embed(&app, ACME, &body).await;
        assert_eq!(r.status, 400, "{body}");
        assert_eq!(r.body["error"]["param"], param, "{}", r.body);
        assert_eq!(r.outcome, "rejected");
    }
    let unknown = embed(&app, ACME, &json!({"model": "nope", "input": "x"})).await;
    assert_eq!(unknown.status, 404);
    let chat_only = embed(&app, ACME, &json!({"model": "chat-only", "input": "x"})).await;
    assert_eq!(chat_only.status, 400);
    assert_eq!(chat_only.body["error"]["code"], "model_not_supported");
    let no_key = embed(&app, "wrong-key", &json!({"model": "bot", "input": "x"})).await;
    assert_eq!(no_key.status, 401);
    assert_eq!(app.mock.stats().calls, 0);
    // /v1/models says which route serves what.
    let (_, models) = app.get_json(ACME, "/v1/models").await;
    let endpoints = |id: &str| {
        models["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["id"] == id)
            .map(|m| m["endpoints"].clone())
            .unwrap()
    };
    assert_eq!(
        endpoints("bot"),
        json!(["chat.completions", "messages", "responses", "embeddings"])
    );
    assert_eq!(
        endpoints("chat-only"),
        json!(["chat.completions", "messages", "responses"])
    );
    let (_, stats) = app.get_json(ACME, "/v1/stats").await;
    assert_eq!(stats["coalescing"]["rejected"], 8, "{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicas_share_item_flights_and_the_item_cache_through_redis() {
    let redis = crate::replicas::redis_url();
    let cluster = crate::replicas::Cluster::start(2, held_spec(), &redis).await;
    let (client, a, b) = (
        cluster.client.clone(),
        cluster.base(0).to_string(),
        cluster.base(1).to_string(),
    );
    let shared = items("shared", 0..10);
    // Replica A leads the items; replica B's batch of the same items and
    // two more follows A's flights and sends only its two.
    let first = {
        let (client, a, body) = (
            client.clone(),
            a.clone(),
            json!({"model": "bot", "input": shared}),
        );
        tokio::spawn(async move { embed_at(&client, &a, ACME, &body, &[]).await })
    };
    held(&cluster.mocks.primary, 1).await;
    let more: Vec<Value> = shared
        .iter()
        .cloned()
        .chain(items("b-only", 0..2))
        .collect();
    let second = {
        let (client, b, body) = (
            client.clone(),
            b.clone(),
            json!({"model": "bot", "input": more}),
        );
        tokio::spawn(async move { embed_at(&client, &b, ACME, &body, &[]).await })
    };
    held(&cluster.mocks.primary, 2).await;
    release(&cluster.mocks.primary, None).await;
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    assert_eq!((first.status, second.status), (200, 200), "{}", second.body);
    assert_vectors(&second.body, &more, 8);
    assert_eq!((second.sent, second.saved), (Some(2), Some(10)));
    let stats = cluster.mocks.primary.stats();
    assert_eq!((stats.embedding_calls, stats.embedding_items), (2, 12));
    // The shared cache answers replica B for items replica A embedded.
    let cached = embed_at(
        &client,
        &b,
        ACME,
        &json!({"model": "bot", "input": shared}),
        &[],
    )
    .await;
    assert_eq!(cached.status, 200);
    assert_eq!(cached.sent, Some(0));
    assert_vectors(&cached.body, &shared, 8);
    assert_eq!(cluster.mocks.primary.stats().embedding_calls, 2);
}
