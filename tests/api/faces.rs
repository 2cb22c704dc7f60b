//! The faces (docs/design.md, "Endpoints: one core,
//! several dialects"): Anthropic's Messages API (`POST /v1/messages`) and
//! OpenAI's Responses API (`POST /v1/responses`) on the same core as chat
//! completions, against both of the mock's faces (an OpenAI-compatible
//! target and an Anthropic one): waves coalesce, tenants stay apart,
//! failures are shared and not re-attacked, `Idempotency-Key` makes a job,
//! a timeout is `unknown`, the same question through two faces is two
//! tasks, and stored responses continue per tenant (contract violations
//! and certified failover: `contracts.rs`).

use std::collections::HashSet;
use std::time::Duration;

use idem::config::ProviderKind;
use idem::mock_upstream::Behaviour;
use serde_json::{Value, json};

use crate::helpers::*;

each_way! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_wave_of_500_makes_one_call_and_another_tenant_its_own(way) {
        let face = way.face;
        let app = way.start(holding()).await;
        let body = face.body("Where is my order?");
        let tasks = wave_at(&app, face.path(), ACME, &body, 500).await;
        held(&app.mock, 1).await;
        app.until_followers(499).await;
        release(&app.mock, None).await;
        let results = collect(tasks).await;
        assert_eq!(app.calls(), 1, "a wave of 500 made more than one call");
        assert!(results.iter().all(|(s, _, _)| *s == 200), "{:?}", results[0]);
        let bodies: HashSet<&str> = results.iter().map(|(_, _, b)| b.as_str()).collect();
        assert_eq!(bodies.len(), 1, "followers got different answers");
        let outcomes = count_by(&results, |(_, o, _)| o.clone());
        assert_eq!(outcomes.get("leader"), Some(&1));
        assert_eq!(outcomes.get("follower"), Some(&499));
        let first: Value = serde_json::from_str(&results[0].2).unwrap();
        assert_eq!(face.text(&first), "mock answer #1 to: Where is my order?");

        // The next wave is answered from the cache, plain and streamed.
        let results = collect(wave_at(&app, face.path(), ACME, &body, 100).await).await;
        assert!(results.iter().all(|(s, o, b)| *s == 200 && o == "cache-hit" && bodies.contains(b.as_str())));
        let r = app.ask(face, ACME, &face.streamed("Where is my order?"), &[]).await;
        assert_eq!(r.headers()["idem-outcome"], "cache-hit");
        assert_eq!(r.headers()["content-type"], "text/event-stream");
        assert_eq!(face.stream_text(&r.text().await.unwrap()), "mock answer #1 to: Where is my order?");
        assert_eq!(app.calls(), 1);

        // Another tenant: its own call, never the first tenant's answer.
        let theirs = wave_at(&app, face.path(), BETA, &body, 1).await;
        held(&app.mock, 1).await;
        release(&app.mock, None).await;
        let (status, outcome, _) = collect(theirs).await.remove(0);
        assert_eq!((status, outcome.as_str()), (200, "leader"));
        assert_eq!(app.calls(), 2);
    }
}

each_way! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn streamed_and_plain_followers_of_a_streaming_leader_get_their_own_shape(way) {
        let face = way.face;
        let app = way.start(holding()).await;
        let leader = {
            let (client, url, body) = (app.client.clone(), app.url(face.path()), face.streamed("Summarise this"));
            tokio::spawn(async move {
                let r = client.post(url).bearer_auth(ACME).json(&body).send().await.unwrap();
                (r.headers()["idem-outcome"].to_str().unwrap().to_string(), r.text().await.unwrap())
            })
        };
        held(&app.mock, 1).await;
        let streamed = wave_at(&app, face.path(), ACME, &face.streamed("Summarise this"), 20).await;
        let plain = wave_at(&app, face.path(), ACME, &face.body("Summarise this"), 20).await;
        app.until_followers(40).await;
        release(&app.mock, None).await;
        let (outcome, text) = leader.await.unwrap();
        assert_eq!(outcome, "leader");
        let expected = "mock answer #1 to: Summarise this";
        assert_eq!(face.stream_text(&text), expected);
        for (status, outcome, text) in collect(streamed).await {
            assert_eq!((status, outcome.as_str()), (200, "follower"));
            assert_eq!(face.stream_text(&text), expected);
        }
        for (status, outcome, text) in collect(plain).await {
            assert_eq!((status, outcome.as_str()), (200, "follower"));
            assert_eq!(face.text(&serde_json::from_str(&text).unwrap()), expected);
        }
        assert_eq!(app.calls(), 1);
    }
}

each_way! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_failing_provider_is_shared_with_followers_and_not_re_attacked(way) {
        let face = way.face;
        let app = way.start(Spec {
            primary: Behaviour {
                hold: true,
                fail_status: Some(500),
                ..Behaviour::default()
            },
            cache: "server_error_ttl = \"30s\"\n".into(),
            ..Spec::default()
        })
        .await;
        let body = face.body("Is the service up?");
        let tasks = wave_at(&app, face.path(), ACME, &body, 100).await;
        held(&app.mock, 1).await;
        app.until_followers(99).await;
        release(&app.mock, None).await;
        let results = collect(tasks).await;
        assert_eq!(app.calls(), 1);
        let first = &results[0].2;
        for (status, _, b) in &results {
            assert_eq!(*status, 500);
            assert_eq!(b, first, "a follower got another error than its leader");
        }
        let v: Value = serde_json::from_str(first).unwrap();
        let kind = face.error_kind(&v);
        if face == Face::Messages {
            assert_eq!(kind, "api_error");
        }
        // A new wave: the negative cache answers, nobody calls.
        let results = collect(wave_at(&app, face.path(), ACME, &body, 50).await).await;
        assert!(results.iter().all(|(s, o, _)| *s == 500 && o == "negative-hit"));
        assert_eq!(app.calls(), 1, "waiters re-attacked a failing provider");
    }
}

each_way! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn an_idempotency_key_double_click_is_one_job_and_another_payload_409(way) {
        let face = way.face;
        let app = way.start(holding()).await;
        let body = face.body("Refund order 45");
        let key = [("idempotency-key", "refund-45")];
        let clicks: Vec<_> = (0..2)
            .map(|_| {
                let (client, url, body) = (app.client.clone(), app.url(face.path()), body.clone());
                tokio::spawn(async move {
                    let r = client
                        .post(url)
                        .bearer_auth(ACME)
                        .header("idempotency-key", "refund-45")
                        .json(&body)
                        .send()
                        .await
                        .unwrap();
                    let job = r.headers()["idem-job-id"].to_str().unwrap().to_string();
                    (r.status().as_u16(), job, r.text().await.unwrap())
                })
            })
            .collect();
        held(&app.mock, 1).await;
        release(&app.mock, None).await;
        let results = collect(clicks).await;
        assert_eq!(results[0].1, results[1].1, "two jobs for one key");
        for (status, _, text) in &results {
            assert_eq!(*status, 200, "{text}");
            let v: Value = serde_json::from_str(text).unwrap();
            assert_eq!(face.text(&v), "mock answer #1 to: Refund order 45");
        }
        assert_eq!(app.calls(), 1);
        let (_, jobs) = app.get_json(ACME, "/v1/jobs").await;
        assert_eq!(jobs["data"].as_array().unwrap().len(), 1, "{jobs}");

        // A third click later replays; the same key with another payload
        // is a conflict.
        let r = app.ask(face, ACME, &body, &key).await;
        assert_eq!(r.headers()["idempotent-replayed"], "true");
        let r = app.ask(face, ACME, &face.body("Refund order 46"), &key).await;
        assert_eq!(r.status(), 409);
        let v: Value = r.json().await.unwrap();
        let kind = face.error_kind(&v);
        if face == Face::Responses {
            assert_eq!(kind, "idempotency_key_reused");
        }
        // The same key and question through another face is another
        // payload too: the face is part of the intent.
        let (other, body) = match face {
            Face::Chat => (Face::Responses, Face::Responses.body("Refund order 45")),
            _ => (Face::Chat, chat_body("Refund order 45")),
        };
        let r = app.ask(other, ACME, &body, &key).await;
        assert_error(r, 409, "idempotency_key_reused").await;
        assert_eq!(app.calls(), 1);
    }
}

each_way! {
    #[tokio::test]
    async fn a_timeout_is_unknown_and_the_key_makes_no_new_attempt(way) {
        let face = way.face;
        let app = way.start(Spec {
            primary: Behaviour {
                hang: true,
                ..Behaviour::default()
            },
            provider_timeout: "3s".into(),
            attempts: "timeout = \"300ms\"\nmax = 3\n".into(),
            server: "request_timeout = \"1s\"\n".into(),
            ..Spec::default()
        })
        .await;
        let body = face.body("will hang");
        let key = [("idempotency-key", "slow-1")];
        let r = app.ask(face, ACME, &body, &key).await;
        // Not done within the request's time: 504, and the job's id to
        // follow it by.
        let id = r.headers()["idem-job-id"].to_str().unwrap().to_string();
        assert_eq!(r.status(), 504);
        let v: Value = r.json().await.unwrap();
        let kind = face.error_kind(&v);
        if face == Face::Messages {
            assert_eq!(kind, "timeout_error");
        }
        let mut job = Value::Null;
        for _ in 0..500 {
            job = app.get_json(ACME, &format!("/v1/jobs/{id}")).await.1;
            if job["attempts"][0]["state"] == "unknown" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(job["attempts"][0]["state"], "unknown", "{job}");
        assert_eq!(job["attempts"][0]["reason"], "timeout", "{job}");
        assert_eq!(job["state"], "running", "an unknown attempt holds the job");
        // Asking again with the key makes no new attempt.
        let r = app.ask(face, ACME, &body, &key).await;
        assert_eq!(r.status(), 504);
        assert_eq!(r.headers()["idem-job-id"].to_str().unwrap(), id);
        let job = app.get_json(ACME, &format!("/v1/jobs/{id}")).await.1;
        assert_eq!(job["attempts"].as_array().unwrap().len(), 1, "{job}");
        assert_eq!(app.calls(), 1);
    }
}

/// The same question through chat completions, Messages and Responses is
/// three tasks (three answer shapes); through one face, one.
#[tokio::test]
async fn the_same_question_through_two_faces_is_two_tasks() {
    let app = TestApp::spawn().await;
    let fps: Vec<String> = {
        let mut fps = Vec::new();
        let r = app.chat(ACME, &chat_body("What is idem?")).await;
        assert_eq!(r.status(), 200);
        fps.push(
            r.headers()["idem-fingerprint"]
                .to_str()
                .unwrap()
                .to_string(),
        );
        for face in [Face::Messages, Face::Responses] {
            let r = app.ask(face, ACME, &face.body("What is idem?"), &[]).await;
            assert_eq!(r.status(), 200);
            assert_eq!(r.headers()["idem-outcome"], "leader");
            fps.push(
                r.headers()["idem-fingerprint"]
                    .to_str()
                    .unwrap()
                    .to_string(),
            );
            let again = app.ask(face, ACME, &face.body("What is idem?"), &[]).await;
            assert_eq!(again.headers()["idem-outcome"], "cache-hit");
        }
        fps
    };
    assert_eq!(fps.iter().collect::<HashSet<_>>().len(), 3, "{fps:?}");
    assert_eq!(app.calls(), 3);
}

#[tokio::test]
async fn messages_take_x_api_key_and_answer_errors_in_anthropics_shape() {
    let app = TestApp::spawn().await;
    let body = Face::Messages.body("hello");
    let r = app
        .client
        .post(app.url("/v1/messages"))
        .header("x-api-key", ACME)
        .header("anthropic-version", "2023-06-01")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(Face::Messages.text(&v), "mock answer #1 to: hello");
    assert_eq!(v["stop_reason"], "end_turn");
    assert!(v["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert!(v["usage"]["input_tokens"].as_u64().unwrap() > 0, "{v}");

    let r = app
        .client
        .post(app.url("/v1/messages"))
        .header("x-api-key", "sk-wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(
        Face::Messages.error_kind(&r.json().await.unwrap()),
        "authentication_error"
    );
    // A request Anthropic would refuse: no max_tokens.
    let r = app
        .ask(
            Face::Messages,
            ACME,
            &json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}]}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(Face::Messages.error_kind(&v), "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_tokens"),
        "{v}"
    );
    // An unknown model: Anthropic's not_found_error.
    let mut other = body.clone();
    other["model"] = json!("nope");
    let r = app.ask(Face::Messages, ACME, &other, &[]).await;
    assert_eq!(r.status(), 404);
    assert_eq!(
        Face::Messages.error_kind(&r.json().await.unwrap()),
        "not_found_error"
    );
    assert_eq!(app.calls(), 1);
}

/// `store: true` keeps a response for its tenant: `GET` returns it (a
/// streamed one too, once whole), `previous_response_id` continues it with
/// the earlier turns sent upstream, another tenant gets 404 for both, and
/// `DELETE` removes it.
#[tokio::test]
async fn stored_responses_continue_per_tenant() {
    let app = TestApp::spawn().await;
    let r = app
        .ask(
            Face::Responses,
            ACME,
            &json!({"model": "bot", "input": "My name is Ada.", "instructions": "Be brief."}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    let first: Value = r.json().await.unwrap();
    let id = first["id"].as_str().unwrap().to_string();
    assert_eq!(first["store"], true, "store defaults to true: {first}");
    let (status, got) = app.get_json(ACME, &format!("/v1/responses/{id}")).await;
    assert_eq!(status, 200);
    assert_eq!(got, first);
    let (status, _) = app.get_json(BETA, &format!("/v1/responses/{id}")).await;
    assert_eq!(status, 404, "another tenant's response");

    // Continued, streamed: the earlier turns go upstream, before the new one.
    let next = json!({"model": "bot", "input": "What is my name?", "previous_response_id": id, "stream": true});
    let r = app.ask(Face::Responses, ACME, &next, &[]).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert_eq!(
        Face::Responses.stream_text(&text),
        "mock answer #2 to: What is my name?"
    );
    let sent = app.mock.stats().last_requests.pop().unwrap().body;
    let roles: Vec<&str> = sent["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["role"].as_str().unwrap())
        .collect();
    assert_eq!(roles, ["user", "assistant", "user"], "{sent}");
    assert_eq!(sent["messages"][0]["content"], "My name is Ada.");
    assert_eq!(
        sent["messages"][1]["content"],
        "mock answer #1 to: My name is Ada."
    );
    let (_, done) = events(&text).pop().unwrap();
    let second = done["response"]["id"].as_str().unwrap().to_string();
    assert_eq!(done["response"]["previous_response_id"], id.as_str());
    // The streamed one is kept once whole; it continues in turn.
    let mut kept = (0, Value::Null);
    for _ in 0..200 {
        kept = app.get_json(ACME, &format!("/v1/responses/{second}")).await;
        if kept.0 == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(kept.0, 200, "the streamed response was not kept");
    assert_eq!(kept.1, done["response"]);

    // The continuation is part of the task: the same input without it is
    // another task, and another tenant cannot continue it.
    let r = app
        .ask(
            Face::Responses,
            ACME,
            &json!({"model": "bot", "input": "What is my name?"}),
            &[],
        )
        .await;
    assert_eq!(r.headers()["idem-outcome"], "leader");
    let r = app
        .ask(
            Face::Responses,
            BETA,
            &json!({"model": "bot", "input": "go on", "previous_response_id": id}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 404);
    let calls = app.calls();

    // Deleted: gone for GET and for continuation; a second DELETE is 404.
    let del = |key: &'static str| {
        app.client
            .delete(app.url(&format!("/v1/responses/{id}")))
            .bearer_auth(key)
            .send()
    };
    assert_eq!(del(BETA).await.unwrap().status(), 404);
    let r = del(ACME).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v,
        json!({"id": id, "object": "response.deleted", "deleted": true})
    );
    assert_eq!(del(ACME).await.unwrap().status(), 404);
    let (status, _) = app.get_json(ACME, &format!("/v1/responses/{id}")).await;
    assert_eq!(status, 404);
    let r = app
        .ask(
            Face::Responses,
            ACME,
            &json!({"model": "bot", "input": "again", "previous_response_id": id}),
            &[],
        )
        .await;
    assert_eq!(r.status(), 404);
    assert_eq!(
        app.calls(),
        calls,
        "nothing is sent for a missing conversation"
    );
    // `store: false` keeps nothing.
    let r = app
        .ask(
            Face::Responses,
            ACME,
            &json!({"model": "bot", "input": "forget me", "store": false}),
            &[],
        )
        .await;
    let v: Value = r.json().await.unwrap();
    let (status, _) = app
        .get_json(
            ACME,
            &format!("/v1/responses/{}", v["id"].as_str().unwrap()),
        )
        .await;
    assert_eq!(status, 404);
}

/// A Messages request reaches an Anthropic target as its client wrote it
/// (its `cache_control` blocks, its system blocks), with the target's
/// model; an OpenAI-compatible target gets the chat translation and
/// nothing of that form.
#[tokio::test]
async fn messages_reach_an_anthropic_target_as_sent_and_others_translated() {
    let request = json!({
        "model": "bot",
        "max_tokens": 100,
        "system": [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "A long shared preamble.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Where is my order?"}
        ]}],
        "metadata": {"user_id": "u-1"},
        "stream": true,
    });
    for kind in [ProviderKind::Anthropic, ProviderKind::Openai] {
        let app = TestApp::with(Spec {
            primary_kind: kind,
            ..Spec::default()
        })
        .await;
        let r = app.ask(Face::Messages, ACME, &request, &[]).await;
        assert_eq!(r.status(), 200);
        let text = Face::Messages.stream_text(&r.text().await.unwrap());
        assert!(text.ends_with("Where is my order?"), "{text}");
        let sent = app.mock.stats().last_requests.pop().unwrap().body;
        let body = sent.to_string();
        assert!(
            !body.contains("\"idem_"),
            "no key of idem's goes upstream: {sent}"
        );
        match kind {
            ProviderKind::Anthropic => {
                let mut expected = request.clone();
                expected["model"] = json!("gpt-4o-mini");
                assert_eq!(sent, expected, "not as the client sent it");
            }
            _ => {
                assert!(!body.contains("cache_control"), "{sent}");
                assert_eq!(sent["messages"][0]["role"], "system", "{sent}");
                assert_eq!(sent["model"], "gpt-4o-mini");
            }
        }
        app.stop().await;
    }
}

/// A provider that speaks the Responses API (`responses_api = true`) is
/// sent a Responses request as its client wrote it (the conversation it
/// continues spelled out, `store: false`), plain and streamed, and its
/// answers come back right; chat and Messages requests still go to its chat
/// completions.
#[tokio::test]
async fn a_responses_api_provider_gets_responses_requests_as_sent() {
    use idem::mock_upstream::Endpoint;
    let app = TestApp::with(Spec {
        provider_extra: "responses_api = true\n".into(),
        ..Spec::default()
    })
    .await;
    let last = || app.mock.stats().last_requests.pop().unwrap();
    let request = json!({"model": "bot", "input": "My name is Ada.", "instructions": "Be brief.",
        "metadata": {"k": "v"}, "prompt_cache_key": "ada"});
    let r = app.ask(Face::Responses, ACME, &request, &[]).await;
    assert_eq!(r.status(), 200);
    let first: Value = r.json().await.unwrap();
    assert_eq!(
        Face::Responses.text(&first),
        "mock answer #1 to: My name is Ada."
    );
    let sent = last();
    assert_eq!(sent.endpoint, Endpoint::Responses);
    assert_eq!(
        sent.body,
        json!({"model": "gpt-4o-mini", "input": "My name is Ada.", "instructions": "Be brief.",
            "metadata": {"k": "v"}, "prompt_cache_key": "ada", "store": false}),
        "as the client sent it, but the model and idem's `store: false`"
    );

    // Continued and streamed: the earlier turns go as input items.
    let next = json!({"model": "bot", "input": "What is my name?",
        "previous_response_id": first["id"], "stream": true});
    let r = app.ask(Face::Responses, ACME, &next, &[]).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert_eq!(
        Face::Responses.stream_text(&text),
        "mock answer #2 to: What is my name?"
    );
    // The answer names what the client sent, not what idem sent on.
    let (_, done) = events(&text).pop().unwrap();
    assert_eq!(
        done["response"]["previous_response_id"], first["id"],
        "{text}"
    );
    assert_eq!(done["response"]["store"], true, "{text}");
    let sent = last();
    assert_eq!(sent.endpoint, Endpoint::Responses);
    assert_eq!(sent.body["stream"], true);
    assert_eq!(sent.body.get("previous_response_id"), None);
    let input = sent.body["input"].as_array().unwrap();
    assert_eq!(input.len(), 3, "{}", sent.body);
    assert_eq!(input[0]["role"], "user");
    assert_eq!(input[1]["role"], "assistant");
    assert_eq!(
        input[2],
        json!({"role": "user", "content": "What is my name?"})
    );

    // A function call, natively.
    let tools = json!({"model": "bot", "input": "where is 1234", "store": false,
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object",
            "properties": {"order": {"type": "string"}}, "required": ["order"]}}],
        "tool_choice": "required"});
    let r: Value = app
        .ask(Face::Responses, ACME, &tools, &[])
        .await
        .json()
        .await
        .unwrap();
    let call = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap_or_else(|| panic!("{r}"));
    assert_eq!(call["name"], "lookup");
    assert_eq!(last().endpoint, Endpoint::Responses);

    // The other faces go to chat completions, without the Responses form.
    let r = app.chat(ACME, &chat_body("My name is Ada.")).await;
    assert_eq!(r.status(), 200);
    let sent = last();
    assert_eq!(sent.endpoint, Endpoint::ChatCompletions);
    assert!(!sent.body.to_string().contains("\"idem_"), "{}", sent.body);
    let r = app
        .ask(
            Face::Messages,
            ACME,
            &Face::Messages.body("My name is Ada."),
            &[],
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(last().endpoint, Endpoint::ChatCompletions);
}

/// `POST /v1/messages/count_tokens`: an Anthropic target counts with its
/// own API (sent the request as written); an OpenAI model is counted by its
/// tokenizer; a model neither can count is a 400; errors are Anthropic's.
#[tokio::test]
async fn messages_count_tokens_by_the_target_or_its_tokenizer() {
    use idem::mock_upstream::Endpoint;
    let request = json!({"model": "bot", "system": "Be brief.",
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Where is my order 1234?", "cache_control": {"type": "ephemeral"}}]}]});
    let count = |app: &TestApp, body: Value| {
        app.client
            .post(app.url("/v1/messages/count_tokens"))
            .header("x-api-key", ACME)
            .json(&body)
            .send()
    };

    let app = TestApp::with(Spec {
        primary_kind: ProviderKind::Anthropic,
        ..Spec::default()
    })
    .await;
    let r = count(&app, request.clone()).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    let sent = app.mock.stats().last_requests.pop().unwrap();
    assert_eq!(sent.endpoint, Endpoint::CountTokens);
    assert_eq!(
        sent.body,
        json!({"model": "gpt-4o-mini", "system": "Be brief.", "messages": request["messages"]}),
        "the request as its client wrote it"
    );
    // The mock counts four characters a token, as its answers do.
    assert!(v["input_tokens"].as_u64().unwrap() > 0, "{v}");
    let mut unknown = request.clone();
    unknown["model"] = json!("nope");
    let r = count(&app, unknown).await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(
        Face::Messages.error_kind(&r.json().await.unwrap()),
        "not_found_error"
    );
    app.stop().await;

    // An OpenAI model: its tokenizer counts, nothing is sent.
    let app = TestApp::spawn().await;
    let r = count(&app, request.clone()).await.unwrap();
    assert_eq!(r.status(), 200);
    let short: Value = r.json().await.unwrap();
    let mut longer = request.clone();
    longer["messages"][0]["content"][0]["text"] =
        json!("Where is my order 1234? It was due last week.");
    let long: Value = count(&app, longer).await.unwrap().json().await.unwrap();
    assert!(
        long["input_tokens"].as_u64().unwrap() > short["input_tokens"].as_u64().unwrap(),
        "{short} {long}"
    );
    assert_eq!(app.calls(), 0);
    app.stop().await;

    // A model idem has no tokenizer for, on a provider without a count API.
    let app = TestApp::with(Spec {
        extra: "[[routes]]\nmodel = \"llama\"\ntargets = [{ provider = \"primary\", model = \"llama-3.1-8b\" }]\n".into(),
        ..Spec::default()
    })
    .await;
    let mut other = request.clone();
    other["model"] = json!("llama");
    let r = count(&app, other).await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(Face::Messages.error_kind(&v), "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cannot count"),
        "{v}"
    );
}

/// `HEAD /` (Claude Code's preconnect, without a key) answers 200 with no
/// body; so does `GET /`.
#[tokio::test]
async fn head_of_the_root_answers_200() {
    let app = TestApp::spawn().await;
    let r = app.client.head(app.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.bytes().await.unwrap().is_empty());
    let r = app.client.get(app.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    app.stop().await;
}
