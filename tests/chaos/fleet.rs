//! The clients: tokio tasks that create jobs (with double clicks, retries of
//! the same key, and retries with a changed payload) and send waves of
//! identical chat completions, plain and streamed, for two tenants, through
//! all three replicas. Every request and its answer goes to the recorder.
//!
//! Prompts are built so that the checker can tell answers apart: a job's
//! prompt names its tenant and key, a wave's prompt names the wave, and every
//! request carries its tenant in the `user` field, which idem forwards
//! upstream (it is not part of the fingerprint with `scope = "tenant"`) and
//! the mock logs with each call. Twin waves send the same prompt from both
//! tenants at once: the only thing that keeps them apart is the tenant in
//! the fingerprint.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Directory, REPLICAS};
use crate::helpers::{ACME, BETA};
use crate::history::{Hostile, Op, OpKind, Recorder, Seen, Wave, now_ms};

pub const TENANTS: [&str; 2] = ["acme", "beta"];

fn api_key(tenant: &str) -> &'static str {
    if tenant == "acme" { ACME } else { BETA }
}

/// What the clients share.
#[derive(Clone)]
pub struct Ctx {
    pub directory: Arc<Directory>,
    pub rec: Arc<Recorder>,
    pub client: reqwest::Client,
    pub stop: CancellationToken,
    pub seed: u64,
    pub waves: Arc<AtomicUsize>,
}

impl Ctx {
    /// The base URL of replica `want`, or of the next one that is up.
    fn base(&self, want: usize) -> (usize, Option<String>) {
        for k in 0..REPLICAS {
            let i = (want + k) % REPLICAS;
            if let Some(b) = self.directory.get(i) {
                return (i, Some(b));
            }
        }
        (want, None)
    }
}

/// The OpenAI error code of an error body.
fn code_of(v: &Value) -> Option<String> {
    v["error"]["code"].as_str().map(str::to_owned)
}

/// POSTs `body` to `path` on `base` as `tenant` (with an `Idempotency-Key`
/// when given); a transport failure is recorded on `op`, which is returned.
async fn post(
    ctx: &Ctx,
    base: &str,
    path: &str,
    tenant: &str,
    key: Option<&str>,
    body: &Value,
    op: &mut Op,
) -> Option<reqwest::Response> {
    let mut req = ctx
        .client
        .post(format!("{base}{path}"))
        .bearer_auth(api_key(tenant));
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    match req.json(body).send().await {
        Ok(r) => Some(r),
        Err(e) => {
            op.transport = Some(e.to_string());
            None
        }
    }
}

/// `POST /v1/jobs` once.
pub async fn create_job(
    ctx: &Ctx,
    replica: usize,
    tenant: &'static str,
    key: &str,
    payload: &Value,
    variant: u8,
) -> Op {
    let (replica, base) = ctx.base(replica);
    let mut op = Op::new(OpKind::CreateJob, tenant, replica, payload.clone());
    op.key = Some(key.to_string());
    op.variant = variant;
    let Some(base) = base else {
        op.transport = Some("no replica up".into());
        return op;
    };
    let Some(r) = post(ctx, &base, "/v1/jobs", tenant, Some(key), payload, &mut op).await else {
        return op;
    };
    let status = r.status().as_u16();
    op.replayed = r
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    match r.json::<Value>().await {
        Ok(v) => {
            op.status = status;
            read_job(&mut op, &v);
        }
        Err(e) => op.transport = Some(format!("body: {e}")),
    }
    op
}

/// `POST /v1/chat/completions` with an `Idempotency-Key`: the request runs
/// as a job and the answer is the job's result. `payload` is
/// `{"request": <chat body>}`, as the job stores it.
pub async fn chat_with_key(
    ctx: &Ctx,
    replica: usize,
    tenant: &'static str,
    key: &str,
    payload: &Value,
    variant: u8,
) -> Op {
    let (replica, base) = ctx.base(replica);
    let mut op = Op::new(OpKind::ChatWithKey, tenant, replica, payload.clone());
    op.key = Some(key.to_string());
    op.variant = variant;
    let Some(base) = base else {
        op.transport = Some("no replica up".into());
        return op;
    };
    let body = &payload["request"];
    let stream = body["stream"] == json!(true);
    let Some(r) = post(
        ctx,
        &base,
        "/v1/chat/completions",
        tenant,
        Some(key),
        body,
        &mut op,
    )
    .await
    else {
        return op;
    };
    let status = r.status().as_u16();
    let header = |name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    op.replayed = header("idempotent-replayed").as_deref() == Some("true");
    op.outcome = header("idem-outcome");
    let job_id = header("idem-job-id");
    let fingerprint = header("idem-fingerprint");
    let text = match r.text().await {
        Ok(t) => t,
        Err(e) => {
            op.transport = Some(format!("body: {e}"));
            return op;
        }
    };
    op.status = status;
    if status != 200 {
        op.code = serde_json::from_str::<Value>(&text)
            .ok()
            .as_ref()
            .and_then(code_of);
        return op;
    }
    op.job_id = job_id;
    op.fingerprint = fingerprint;
    op.seen = if stream {
        read_stream(&text)
    } else {
        serde_json::from_str::<Value>(&text)
            .ok()
            .as_ref()
            .and_then(Seen::of_completion)
    };
    if op.seen.is_none() {
        op.transport = Some(format!("unreadable answer: {text}"));
    }
    op
}

/// Fills a job operation from a job document (or an error body).
fn read_job(op: &mut Op, v: &Value) {
    if (200..300).contains(&op.status) {
        op.job_id = v["id"].as_str().map(str::to_owned);
        op.fingerprint = v["fingerprint"].as_str().map(str::to_owned);
        op.job_state = v["state"].as_str().map(str::to_owned);
        if v["result"].is_object() {
            op.seen = Seen::of_completion(&v["result"]);
        }
    } else {
        op.code = code_of(v);
    }
}

/// `GET /v1/jobs/{id}`.
pub async fn get_job(
    ctx: &Ctx,
    replica: usize,
    tenant: &'static str,
    id: &str,
    prompt: &str,
) -> Op {
    let (replica, base) = ctx.base(replica);
    let mut op = Op::new(OpKind::GetJob, tenant, replica, Value::Null);
    op.prompt = prompt.to_string();
    op.job_id = Some(id.to_string());
    let Some(base) = base else {
        op.transport = Some("no replica up".into());
        return op;
    };
    let sent = ctx
        .client
        .get(format!("{base}/v1/jobs/{id}"))
        .bearer_auth(api_key(tenant))
        .send()
        .await;
    match sent {
        Ok(r) => {
            let status = r.status().as_u16();
            match r.json::<Value>().await {
                Ok(v) => {
                    op.status = status;
                    read_job(&mut op, &v);
                    op.job_id = Some(id.to_string());
                }
                Err(e) => op.transport = Some(format!("body: {e}")),
            }
        }
        Err(e) => op.transport = Some(e.to_string()),
    }
    op
}

/// `POST /v1/chat/completions`, plain or streamed.
pub async fn chat(
    ctx: &Ctx,
    replica: usize,
    tenant: &'static str,
    prompt: &str,
    stream: bool,
    wave: usize,
) -> Op {
    let mut body = json!({"model": "bot", "user": tenant,
                          "messages": [{"role": "user", "content": prompt}]});
    if stream {
        body["stream"] = json!(true);
    }
    let kind = if stream {
        OpKind::ChatStream
    } else {
        OpKind::Chat
    };
    let (replica, base) = ctx.base(replica);
    let mut op = Op::new(kind, tenant, replica, body.clone());
    op.wave = Some(wave);
    let Some(base) = base else {
        op.transport = Some("no replica up".into());
        return op;
    };
    let Some(r) = post(
        ctx,
        &base,
        "/v1/chat/completions",
        tenant,
        None,
        &body,
        &mut op,
    )
    .await
    else {
        return op;
    };
    let status = r.status().as_u16();
    op.outcome = r
        .headers()
        .get("idem-outcome")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let text = match r.text().await {
        Ok(t) => t,
        Err(e) => {
            op.transport = Some(format!("body: {e}"));
            return op;
        }
    };
    if status != 200 {
        op.status = status;
        op.code = serde_json::from_str::<Value>(&text)
            .ok()
            .as_ref()
            .and_then(code_of);
        return op;
    }
    let seen = if stream {
        read_stream(&text)
    } else {
        serde_json::from_str::<Value>(&text)
            .ok()
            .as_ref()
            .and_then(Seen::of_completion)
    };
    match seen {
        Some(s) => {
            op.status = 200;
            op.seen = Some(s);
        }
        // A 200 whose body is cut off (its replica died while streaming)
        // or unreadable is a failure in transit; the checker treats a 200
        // with an answer it cannot read as a failure of the test.
        None if text.trim_end().ends_with("data: [DONE]") || !stream => {
            op.status = 200;
            op.transport = Some(format!("unreadable answer: {text}"));
        }
        None => op.transport = Some("stream cut off".into()),
    }
    op
}

/// The answer carried by an SSE body that ends with `[DONE]`.
fn read_stream(text: &str) -> Option<Seen> {
    if !text.trim_end().ends_with("data: [DONE]") {
        return None;
    }
    let mut content = String::new();
    let mut model = String::new();
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(data).ok()?;
        if model.is_empty()
            && let Some(m) = v["model"].as_str()
        {
            model = m.to_string();
        }
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            content.push_str(c);
        }
    }
    Seen::of_content(&content, &model)
}

/// Sleeps unless the run stops first; false when it stopped.
async fn pause(ctx: &Ctx, ms: u64) -> bool {
    tokio::select! {
        () = ctx.stop.cancelled() => false,
        () = tokio::time::sleep(Duration::from_millis(ms)) => true,
    }
}

/// One job client: intent after intent until the run stops.
pub async fn job_client(ctx: Ctx, id: usize) {
    let mut intent = 0u64;
    while !ctx.stop.is_cancelled() {
        intent += 1;
        let mut rng = StdRng::seed_from_u64(ctx.seed ^ ((id as u64) << 40) ^ intent);
        one_intent(&ctx, &mut rng, id, intent).await;
        if !pause(&ctx, rng.random_range(20..120)).await {
            break;
        }
    }
}

async fn one_intent(ctx: &Ctx, rng: &mut StdRng, id: usize, intent: u64) {
    let tenant = TENANTS[rng.random_range(0..2)];
    let key = format!("intent-{id}-{intent}");
    let route = if rng.random_bool(0.25) {
        "hedged"
    } else {
        "bot"
    };
    let prompt = format!("job {key} for {tenant}");
    // Most intents use the jobs API; some send a chat completion with the
    // key and wait for the answer (the same job machinery).
    let as_chat = rng.random_bool(0.15);
    let payload = if as_chat {
        let mut request = json!({"model": route, "user": tenant,
                                 "messages": [{"role": "user", "content": prompt}]});
        if rng.random_bool(0.3) {
            request["stream"] = json!(true);
        }
        json!({"request": request})
    } else {
        json!({
            "request": {"model": route, "user": tenant,
                        "messages": [{"role": "user", "content": prompt}]},
            "metadata": {"intent": key},
        })
    };
    let send = |replica: usize, payload: &Value, variant: u8| {
        let (key, payload) = (key.clone(), payload.clone());
        async move {
            if as_chat {
                chat_with_key(ctx, replica, tenant, &key, &payload, variant).await
            } else {
                create_job(ctx, replica, tenant, &key, &payload, variant).await
            }
        }
    };
    let first = rng.random_range(0..REPLICAS);
    // A double click: the same request two or three times at once, to
    // different replicas.
    let clicks = if rng.random_bool(0.2) {
        rng.random_range(2..=3)
    } else {
        1
    };
    let sends = (0..clicks).map(|k| send(first + k, &payload, 0));
    let mut job_id = None;
    for op in futures_util::future::join_all(sends).await {
        if (200..300).contains(&op.status) {
            job_id = op.job_id.clone();
        }
        ctx.rec.op(op);
    }
    // A client that got no answer retries the same key (its answer may
    // have been lost); some retry even after an answer.
    let mut tries = 0;
    while (job_id.is_none() && tries < 8) || (tries == 0 && rng.random_bool(0.2)) {
        tries += 1;
        if !pause(ctx, rng.random_range(50..400)).await {
            return;
        }
        let op = send(rng.random_range(0..REPLICAS), &payload, 0).await;
        if (200..300).contains(&op.status) {
            job_id = op.job_id.clone();
        }
        ctx.rec.op(op);
    }
    // Sometimes the same key is reused for something else: 409, and the
    // job must not change.
    if rng.random_bool(0.1) {
        let mut changed = payload.clone();
        if as_chat || rng.random_bool(0.5) {
            changed["request"]["messages"][0]["content"] = json!(format!("{prompt}, changed"));
        } else {
            changed["metadata"]["intent"] = json!(format!("{key}, changed"));
        }
        let op = send(rng.random_range(0..REPLICAS), &changed, 1).await;
        ctx.rec.op(op);
    }
    // Look at the job once in a while (the answer it shows is checked).
    if let Some(id) = job_id
        && rng.random_bool(0.3)
        && pause(ctx, rng.random_range(100..600)).await
    {
        let op = get_job(ctx, rng.random_range(0..REPLICAS), tenant, &id, &prompt).await;
        ctx.rec.op(op);
    }
}

/// One wave sender: waves of identical requests until the run stops.
pub async fn wave_client(ctx: Ctx, id: usize, wave_size: usize) {
    let mut n = 0u64;
    while !ctx.stop.is_cancelled() {
        n += 1;
        let mut rng = StdRng::seed_from_u64(ctx.seed ^ (0xa5a5 << 48) ^ ((id as u64) << 40) ^ n);
        let w = ctx.waves.fetch_add(1, Ordering::Relaxed) + 1;
        let twin = rng.random_bool(0.5);
        let (tenants, prompt) = if twin {
            (
                TENANTS.to_vec(),
                format!("wave {w}: the same question for everyone"),
            )
        } else {
            let t = TENANTS[rng.random_range(0..2)];
            (vec![t], format!("wave {w}: a question from {t}"))
        };
        let from_ms = now_ms();
        let mut tasks = Vec::new();
        for &tenant in &tenants {
            for j in 0..wave_size {
                let ctx2 = ctx.clone();
                let prompt = prompt.clone();
                let replica = (j + rng.random_range(0..REPLICAS)) % REPLICAS;
                let stream = rng.random_bool(0.3);
                let stagger = rng.random_range(0..300);
                tasks.push(tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_millis(stagger)).await;
                    let op = chat(&ctx2, replica, tenant, &prompt, stream, w).await;
                    ctx2.rec.op(op);
                }));
            }
        }
        for t in tasks {
            let _ = t.await;
        }
        ctx.rec.wave(Wave {
            id: w,
            tenants,
            prompt,
            from_ms,
            until_ms: now_ms(),
        });
        if !pause(&ctx, rng.random_range(50..300)).await {
            break;
        }
    }
}

/// The hostile client: among the normal traffic, bursts of four worst-case
/// bodies at once to one replica (each face's smallest JSON values, past
/// the values budget or just under it), and now and then a conversation
/// continued turn after turn across the replicas until it passes
/// `responses.max_conversation_bytes`. What each request got is recorded;
/// the replicas' memory is watched beside it (`cluster::watch_memory`).
pub async fn hostile_client(ctx: Ctx) {
    const PATHS: [&str; 4] = [
        "/v1/chat/completions",
        "/v1/messages",
        "/v1/responses",
        "/v1/embeddings",
    ];
    let mut n = 0usize;
    while !ctx.stop.is_cancelled() {
        n += 1;
        let path = PATHS[n % PATHS.len()];
        let (what, bytes) = if n.is_multiple_of(2) {
            ("values", 8 * 1024 * 1024 - 4096)
        } else {
            ("parsed", crate::helpers::just_under_the_values_budget(path))
        };
        let (_, base) = ctx.base(n % REPLICAS);
        if let Some(base) = base {
            let body = crate::helpers::worst_body(path, bytes, &format!("hostile {n}"));
            let sends = (0..4).map(|_| hostile_post(&ctx, &base, path, body.clone()));
            for (status, code) in futures_util::future::join_all(sends).await {
                ctx.rec.hostile(Hostile {
                    path,
                    what,
                    turn: 0,
                    status,
                    code,
                });
            }
        }
        if n % 4 == 1 {
            conversation(&ctx, n).await;
        }
        if !pause(&ctx, 200).await {
            break;
        }
    }
}

/// The input of each turn of a hostile conversation, at least (bytes).
pub const TURN_INPUT_BYTES: usize = 200_000;

/// A conversation continued turn after turn (each turn
/// [`TURN_INPUT_BYTES`] of input and more, each on the next replica) until
/// a turn is refused or eight turns were made.
async fn conversation(ctx: &Ctx, n: usize) {
    let mut previous: Option<String> = None;
    for turn in 1..=8 {
        let (_, Some(base)) = ctx.base(n + turn) else {
            return;
        };
        let mut body = json!({
            "model": "bot",
            "input": format!("hostile chain {n} turn {turn}: {}", "word ".repeat(TURN_INPUT_BYTES / 5)),
        });
        if let Some(p) = &previous {
            body["previous_response_id"] = json!(p);
        }
        let bytes = serde_json::to_vec(&body).unwrap_or_default();
        let (status, code, id) = hostile_send(ctx, &base, "/v1/responses", bytes).await;
        ctx.rec.hostile(Hostile {
            path: "/v1/responses",
            what: "turn",
            turn,
            status,
            code,
        });
        match (status, id) {
            (200, Some(id)) => previous = Some(id),
            _ => return,
        }
    }
}

async fn hostile_post(ctx: &Ctx, base: &str, path: &str, body: Vec<u8>) -> (u16, Option<String>) {
    let (status, code, _) = hostile_send(ctx, base, path, body).await;
    (status, code)
}

/// Sends `body` as tenant `acme`: its status, error code and `id`.
async fn hostile_send(
    ctx: &Ctx,
    base: &str,
    path: &str,
    body: Vec<u8>,
) -> (u16, Option<String>, Option<String>) {
    let sent = ctx
        .client
        .post(format!("{base}{path}"))
        .bearer_auth(ACME)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    let Ok(r) = sent else {
        return (0, None, None);
    };
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    let id = v["id"].as_str().map(str::to_owned);
    (status, code_of(&v), id)
}
