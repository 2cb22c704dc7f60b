//! What needs no translation: a token count made here, and requests that
//! go to a target of their own dialect as sent.

use super::*;

/// A token count for a target whose API has none: counted here by the
/// model's tokenizer, of the messages the request becomes in chat.
#[test]
fn count_tokens_counted_locally() {
    let targets = Targets::new();
    let count = |route: &str, request: Value| -> Result<u64, Refusal> {
        match send(
            Dialect::CountTokens,
            &request,
            &targets.get(route).targets[0],
        )? {
            Sent::Local(v) => Ok(v["input_tokens"].as_u64().unwrap()),
            other => panic!("{route}: a call was made: {other:?}"),
        }
    };
    let base = json!({"model": "bot", "messages": [{"role": "user", "content": "hello there"}]});
    for route in ["openai", "azure", "responses-api", "mock"] {
        let n = count(route, base.clone()).unwrap();
        assert!(n > 0, "{route}");
        // `system` is counted, as the system message it becomes.
        let with_system = patched(
            &base,
            &json!({"system": "You are a careful assistant who answers briefly."}),
        );
        assert!(count(route, with_system).unwrap() > n, "{route}: system");
        // Tool definitions are not counted.
        let with_tools = patched(
            &base,
            &json!({"tools": [{"name": "lookup", "description": "Looks a long thing up in a big table.",
                               "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}]}),
        );
        assert_eq!(count(route, with_tools).unwrap(), n, "{route}: tools");
        // Nor are images.
        let with_image = patched(
            &base,
            &json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "hello there"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]}]}),
        );
        assert_eq!(count(route, with_image).unwrap(), n, "{route}: images");
        // What the translation refuses, the count refuses.
        let server_tool = patched(
            &base,
            &json!({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
        );
        let r = count(route, server_tool).unwrap_err();
        assert_eq!(r.param.as_deref(), Some("tools.0.type"), "{route}");
    }
    // A model whose tokenizer idem does not know (an Azure deployment
    // named otherwise) cannot be counted.
    let r = count("azure-deployment", base).unwrap_err();
    assert_eq!(r.param.as_deref(), Some("model"));
    assert!(r.message.contains("my-deployment"), "{}", r.message);
}

// ---------------------------------------------------------------------------
// Passed as sent.

/// A target that speaks the request's dialect gets it as its client sent
/// it, with the target's model and the client's answer-changing headers;
/// only what the call itself needs differs.
#[test]
fn native_targets_get_the_request_as_sent() {
    let targets = Targets::new();
    let native = |from: Dialect, route: &str, request: &Value| -> (Value, Forwarded) {
        match send(from, request, &targets.get(route).targets[0]).unwrap() {
            Sent::Native(body, forwarded) => (body, forwarded),
            other => panic!("{route}: not sent as it came: {other:?}"),
        }
    };
    let with_model = |request: &Value, model: &str| patched(request, &json!({"model": model}));

    // Messages to Anthropic: every field and block, cache_control included.
    let messages = json!({"model": "bot", "max_tokens": 100, "stream": true,
        "thinking": {"type": "enabled", "budget_tokens": 2048}, "top_k": 5,
        "context_management": {"edits": []}, "output_config": {"effort": "high"},
        "container": "cntr_1", "mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}],
        "service_tier": "auto", "metadata": {"user_id": "u"}, "custom_knob": 1,
        "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        "messages": [{"role": "system", "content": "T"}, {"role": "user", "content": [
            {"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}}]},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]});
    let (body, forwarded) = native(Dialect::Messages, "anthropic", &messages);
    assert_eq!(body, with_model(&messages, "claude-x"));
    assert_eq!(
        forwarded,
        Forwarded::read(Dialect::Messages, |n| if n == "anthropic-beta" {
            vec!["tools-2099"]
        } else {
            vec![]
        })
    );
    // Its token count too.
    let mut count = object(messages.clone());
    count.remove("max_tokens");
    count.remove("stream");
    let count = Value::Object(count);
    let (body, _) = native(Dialect::CountTokens, "anthropic", &count);
    assert_eq!(body, with_model(&count, "claude-x"));

    // Responses to a provider with `responses_api`: `store: false`, no
    // `previous_response_id` (idem keeps the conversation and spells it
    // out as `input`); everything else as sent.
    let responses = json!({"model": "bot", "input": [{"role": "user", "content": "hi"}],
        "store": true, "previous_response_id": "resp_1", "background": true,
        "conversation": "conv_1", "prompt": {"id": "p"}, "include": ["reasoning.encrypted_content"],
        "tools": [{"type": "custom", "name": "apply_patch"}, {"type": "web_search"}],
        "reasoning": {"effort": "high", "summary": "auto"}, "top_logprobs": 3, "custom_knob": 1});
    let (body, forwarded) = native(Dialect::Responses, "responses-api", &responses);
    let mut want = object(with_model(&responses, "gpt-4o"));
    want.insert("store".into(), json!(false));
    want.remove("previous_response_id");
    assert_eq!(body, Value::Object(want));
    assert!(
        forwarded != Forwarded::default(),
        "OpenAI-Beta is forwarded"
    );

    // Chat to every kind that speaks it: a stream's `stream_options` are
    // idem's own (usage asked for), a plain call carries none.
    let chat = json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}],
        "n": 3, "logprobs": true, "reasoning_effort": "high", "custom_knob": 1,
        "stream_options": {"include_usage": false}});
    for route in ["openai", "azure", "responses-api", "mock"] {
        let (body, _) = native(Dialect::Chat, route, &chat);
        let mut want = object(with_model(&chat, "gpt-4o"));
        want.remove("stream_options");
        assert_eq!(body, Value::Object(want.clone()), "{route}");
        let streamed = patched(&chat, &json!({"stream": true}));
        let (body, _) = native(Dialect::Chat, route, &streamed);
        want.insert("stream".into(), json!(true));
        want.insert("stream_options".into(), json!({"include_usage": true}));
        assert_eq!(body, Value::Object(want), "{route}");
    }
}
