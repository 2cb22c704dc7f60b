//! The mock's Anthropic face as Claude Code uses it: thinking, redacted
//! thinking, server web search with citations, the fields and message
//! roles it sends, `?beta=true`, `HEAD /`.

use serde_json::{Value, json};

use super::tests::{client, start};
use super::tests_anthropic::{KEY, answered, ask, assemble, message, names, streamed};
use super::*;

fn thinking(mut body: Value, thinking: Value) -> Value {
    body["thinking"] = thinking;
    body["max_tokens"] = json!(4096);
    body
}

fn block_types(message: &Value) -> Vec<&str> {
    message["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["type"].as_str().unwrap())
        .collect()
}

fn web_search() -> Value {
    json!({"type": "web_search_20250305", "name": "web_search", "max_uses": 3})
}

#[tokio::test]
async fn thinking_comes_first_and_its_signature_is_accepted_back_only_untampered() {
    let server = start(Behaviour::default()).await;
    let client = client();
    for kind in [
        json!({"type": "enabled", "budget_tokens": 1024}),
        json!({"type": "adaptive"}),
    ] {
        let answer = answered(&client, &server, &thinking(ask("why?"), kind)).await;
        assert_eq!(block_types(&answer), ["thinking", "text"], "{answer}");
        assert!(
            answer["content"][0]["thinking"]
                .as_str()
                .unwrap()
                .starts_with("mock thinking #")
        );
        assert!(answer["content"][0]["signature"].as_str().unwrap().len() > 20);
    }
    let disabled = answered(
        &client,
        &server,
        &thinking(ask("why?"), json!({"type": "disabled"})),
    )
    .await;
    assert_eq!(block_types(&disabled), ["text"]);

    // display: omitted shows the thinking empty, still signed.
    let omitted = answered(
        &client,
        &server,
        &thinking(
            ask("why?"),
            json!({"type": "adaptive", "display": "omitted"}),
        ),
    )
    .await;
    assert_eq!(omitted["content"][0]["thinking"], "");
    let signed = answered(
        &client,
        &server,
        &thinking(ask("why?"), json!({"type": "adaptive"})),
    )
    .await;
    let block = signed["content"][0].clone();

    // Replayed in an assistant turn: as given, or shown empty, accepted;
    // with its thinking or signature changed, Anthropic's 400.
    let replay = |block: Value| {
        let mut body = thinking(ask("x"), json!({"type": "adaptive"}));
        body["messages"] = json!([
            {"role": "user", "content": "why?"},
            {"role": "assistant", "content": [block, {"type": "text", "text": "because"}]},
            {"role": "user", "content": "and?"},
        ]);
        body
    };
    let mut empty = block.clone();
    empty["thinking"] = json!("");
    for good in [block.clone(), empty, omitted["content"][0].clone()] {
        let response = message(&client, &server, &replay(good)).await;
        assert_eq!(response.status(), 200);
    }
    let mut changed = block.clone();
    changed["thinking"] = json!("something else");
    let mut forged = block.clone();
    forged["signature"] = json!("RXJyb25lb3VzU2lnbmF0dXJlRm9yVGVzdGluZ1B1cnBvc2VzT25seQ==");
    for bad in [changed, forged] {
        let response = message(&client, &server, &replay(bad)).await;
        assert_eq!(response.status(), 400);
        let error: Value = response.json().await.unwrap();
        assert_eq!(
            error["error"]["message"],
            "messages.1.content.0: Invalid `signature` in `thinking` block"
        );
    }
    server.shutdown().await;
}

#[tokio::test]
async fn redact_adds_a_redacted_thinking_block() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let body = thinking(
        ask("please REDACT this"),
        json!({"type": "enabled", "budget_tokens": 2000}),
    );
    let answer = answered(&client, &server, &body).await;
    assert_eq!(
        block_types(&answer),
        ["thinking", "redacted_thinking", "text"]
    );
    assert!(answer["content"][1]["data"].as_str().unwrap().len() > 10);
    // Without thinking, no redacted thinking either.
    let plain = answered(&client, &server, &ask("please redact this")).await;
    assert_eq!(block_types(&plain), ["text"]);
    // Sent back, accepted.
    let mut next = body.clone();
    next["messages"] = json!([
        {"role": "user", "content": "please redact this"},
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": "thanks"},
    ]);
    assert_eq!(message(&client, &server, &next).await.status(), 200);
    server.shutdown().await;
}

#[tokio::test]
async fn a_stream_has_each_block_s_own_event_sequence_and_assembles_to_the_message() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = thinking(
        ask("search for otters and redact"),
        json!({"type": "enabled", "budget_tokens": 1024}),
    );
    body["tools"] = json!([web_search()]);
    let events = streamed(&client, &server, &body).await;
    let by_block = |index: u64| -> Vec<String> {
        events
            .iter()
            .filter(|(_, data)| data["index"] == index)
            .map(|(event, data)| match data["delta"]["type"].as_str() {
                Some(delta) => format!("{event}:{delta}"),
                None => event.clone(),
            })
            .collect()
    };
    // thinking: starts empty, thinking deltas, one signature delta.
    let thinking_events = by_block(0);
    assert_eq!(thinking_events[0], "content_block_start");
    assert_eq!(
        thinking_events[thinking_events.len() - 2..],
        ["content_block_delta:signature_delta", "content_block_stop"]
    );
    assert!(
        thinking_events[1..thinking_events.len() - 2]
            .iter()
            .all(|e| e == "content_block_delta:thinking_delta")
    );
    let start = &events[1].1["content_block"];
    assert_eq!(
        *start,
        json!({"type": "thinking", "thinking": "", "signature": ""})
    );
    // redacted_thinking and the search result start whole, no deltas.
    assert_eq!(by_block(1), ["content_block_start", "content_block_stop"]);
    assert_eq!(by_block(3), ["content_block_start", "content_block_stop"]);
    // server_tool_use: input {} at start, then its JSON in pieces.
    let server_tool = by_block(2);
    assert!(server_tool.len() > 3);
    assert!(
        server_tool[1..server_tool.len() - 1]
            .iter()
            .all(|e| e == "content_block_delta:input_json_delta")
    );
    // text: a citations delta, then text deltas.
    let text_events = by_block(4);
    assert_eq!(text_events[1], "content_block_delta:citations_delta");
    assert!(
        text_events[2..text_events.len() - 1]
            .iter()
            .all(|e| e == "content_block_delta:text_delta")
    );
    let names = names(&events);
    assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);

    let assembled = assemble(&events);
    let mut plain = answered(&client, &server, &body).await;
    // The same answer but for the call number.
    let renumber = |v: &Value| v.to_string().replace("#2", "#1").replace("_2\"", "_1\"");
    plain["id"] = assembled["id"].clone();
    assert_eq!(
        block_types(&assembled),
        [
            "thinking",
            "redacted_thinking",
            "server_tool_use",
            "web_search_tool_result",
            "text"
        ]
    );
    assert_eq!(
        assembled["content"][2]["input"],
        json!({"query": "search for otters and redact"})
    );
    assert_eq!(
        assembled["usage"]["server_tool_use"],
        json!({"web_search_requests": 1})
    );
    let strip_seals = |v: &Value| {
        let mut v = v.clone();
        for block in v["content"].as_array_mut().unwrap() {
            for key in ["signature", "data", "content", "citations"] {
                block.as_object_mut().unwrap().remove(key);
            }
        }
        v.as_object_mut().unwrap().remove("usage");
        renumber(&v)
    };
    assert_eq!(strip_seals(&assembled), strip_seals(&plain));
    server.shutdown().await;
}

#[tokio::test]
async fn a_search_is_a_server_tool_use_a_result_and_a_cited_text() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let mut body = ask("search the news");
    body["tools"] = json!([web_search()]);
    let answer = answered(&client, &server, &body).await;
    assert_eq!(
        block_types(&answer),
        ["server_tool_use", "web_search_tool_result", "text"]
    );
    let call = &answer["content"][0];
    assert_eq!(call["id"], "srvtoolu_mock_1");
    assert_eq!(call["name"], "web_search");
    assert_eq!(call["input"], json!({"query": "search the news"}));
    let result = &answer["content"][1];
    assert_eq!(result["tool_use_id"], "srvtoolu_mock_1");
    let hit = &result["content"][0];
    assert_eq!(hit["type"], "web_search_result");
    for key in ["url", "title", "encrypted_content", "page_age"] {
        assert!(hit[key].is_string(), "{key}: {hit}");
    }
    let citation = &answer["content"][2]["citations"][0];
    assert_eq!(citation["type"], "web_search_result_location");
    assert_eq!(citation["url"], hit["url"]);
    assert_eq!(
        answer["usage"]["server_tool_use"],
        json!({"web_search_requests": 1})
    );
    // The search sent back in the next turn is accepted.
    let mut next = body.clone();
    next["messages"] = json!([
        {"role": "user", "content": "search the news"},
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": "thanks"},
    ]);
    let answer = answered(&client, &server, &next).await;
    assert_eq!(block_types(&answer), ["text"]);
    server.shutdown().await;
}

#[tokio::test]
async fn claude_code_s_requests_are_accepted() {
    let server = start(Behaviour::default()).await;
    let client = client();
    // The shape Claude Code 2.1 sends, in short.
    let body = json!({
        "model": "claude-opus-4-8", "max_tokens": 32000, "stream": false,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "metadata": {"user_id": "{\"device_id\":\"d\"}"},
        "system": [{"type": "text", "text": "You are Claude Code.",
            "cache_control": {"type": "ephemeral"}}],
        "tools": [
            {"name": "Read", "description": "Read a file", "input_schema": {"type": "object",
                "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}},
            {"name": "Deferred", "description": "d", "defer_loading": true,
                "input_schema": {"type": "object"}},
            {"type": "bash_20250124", "name": "bash"},
            {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>x</system-reminder>"},
                {"type": "text", "text": "call tool Read {\"file_path\": \"/tmp/a\"}"},
                {"type": "image", "source": {"type": "url", "url": "https://x.invalid/a.png"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                    "data": "doc"}},
                {"type": "search_result", "source": "s", "title": "t",
                    "content": [{"type": "text", "text": "c"}]},
            ]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment",
                "cache_control": {"type": "ephemeral"}}], "output_config": {"effort": "medium"}},
        ],
    });
    let url = format!("http://{}/v1/messages?beta=true", server.addr());
    let response = client
        .post(&url)
        .header("x-api-key", KEY)
        .header(
            "anthropic-beta",
            "claude-code-20250219,interleaved-thinking-2025-05-14",
        )
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(block_types(&answer), ["thinking", "text", "tool_use"]);
    assert_eq!(
        answer["content"][2]["input"],
        json!({"file_path": "/tmp/a"})
    );
    assert_eq!(answer["stop_reason"], "tool_use");
    let stats = server.stats();
    assert_eq!(
        stats.last_requests[0].anthropic_beta.as_deref(),
        Some("claude-code-20250219,interleaved-thinking-2025-05-14")
    );

    // The tool result, with images in its content, comes back.
    let mut next = body.clone();
    next["messages"] = json!([
        body["messages"][0],
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_mock_1",
            "content": [{"type": "text", "text": "file body"}, {"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
    ]);
    let answer = answered(&client, &server, &next).await;
    assert_eq!(block_types(&answer), ["thinking", "text"]);
    assert!(
        answer["content"][1]["text"]
            .as_str()
            .unwrap()
            .ends_with("to: file body")
    );

    // Token counting takes the same request (less what it does not have).
    let mut count = body.clone();
    for key in ["max_tokens", "stream", "metadata"] {
        count.as_object_mut().unwrap().remove(key);
    }
    let response = client
        .post(format!(
            "http://{}/v1/messages/count_tokens?beta=true",
            server.addr()
        ))
        .header("x-api-key", KEY)
        .json(&count)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let counted: Value = response.json().await.unwrap();
    assert_eq!(
        counted["input_tokens"],
        anthropic::input_tokens(&body),
        "{counted}"
    );

    // HEAD / and GET / answer 200 and are no calls.
    let root = format!("http://{}/", server.addr());
    assert_eq!(client.head(&root).send().await.unwrap().status(), 200);
    assert_eq!(client.get(&root).send().await.unwrap().status(), 200);
    assert_eq!(server.stats().calls, 3);
    server.shutdown().await;
}

#[tokio::test]
async fn thinking_and_tools_are_refused_as_anthropic_refuses_them() {
    let server = start(Behaviour::default()).await;
    let client = client();
    let cases = [
        (
            thinking(ask("x"), json!({"type": "enabled", "budget_tokens": 100})),
            "greater than or equal to 1024",
        ),
        (
            thinking(ask("x"), json!({"type": "enabled", "budget_tokens": 4096})),
            "`max_tokens` must be greater than `thinking.budget_tokens`",
        ),
        (
            thinking(ask("x"), json!({"type": "enabled"})),
            "thinking.enabled.budget_tokens: Field required",
        ),
        (thinking(ask("x"), json!({"type": "sometimes"})), "thinking"),
        (
            {
                let mut body = thinking(ask("x"), json!({"type": "adaptive"}));
                body["tools"] = json!([{"name": "t", "input_schema": {"type": "object"}}]);
                body["tool_choice"] = json!({"type": "any"});
                body
            },
            "Thinking may not be enabled when tool_choice forces tool use.",
        ),
        (
            {
                let mut body = ask("x");
                body["tools"] = json!([{"type": "teleport_20250101", "name": "t"}]);
                body
            },
            "tools.0",
        ),
        (
            {
                let mut body = ask("x");
                body["messages"] = json!([{"role": "user", "content": [
                    {"type": "thinking", "thinking": "t"}]}]);
                body
            },
            "messages.0.content.0.signature: Field required",
        ),
        (
            {
                let mut body = ask("x");
                body["messages"] = json!([{"role": "user", "content": [
                    {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]);
                body
            },
            "messages.0.content.0.source.media_type",
        ),
    ];
    for (body, says) in &cases {
        let response = message(&client, &server, body).await;
        assert_eq!(response.status(), 400, "{body}");
        let error: Value = response.json().await.unwrap();
        let text = error["error"]["message"].as_str().unwrap();
        assert!(text.contains(says), "{body}: {text}");
    }
    // tool_choice none is fine, and answers no call.
    let mut body = ask("call tool t");
    body["tools"] = json!([{"name": "t", "input_schema": {"type": "object"}}]);
    body["tool_choice"] = json!({"type": "none"});
    let answer = answered(&client, &server, &body).await;
    assert_eq!(block_types(&answer), ["text"]);
    server.shutdown().await;
}
