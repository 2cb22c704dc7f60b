//! The chat completions face before an Anthropic target (docs/http-api.md,
//! "What becomes of each field").

use super::*;

fn chat_base() -> Value {
    json!({"model": "bot", "messages": [{"role": "user", "content": "hi"}]})
}

/// A chat request to an Anthropic target, said in the Messages API.
#[test]
fn chat_to_anthropic() {
    let hi = || json!({"role": "user", "content": "hi"});
    let call = || {
        json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]})
    };
    let tool = || json!([{"type": "function", "function": {"name": "f"}}]);
    let cases = [
        case("model", json!({}), vec![At("/model", json!("claude-x"))]),
        case(
            "system",
            json!({"messages": [{"role": "system", "content": "A"}, hi(),
                {"role": "developer", "content": [{"type": "text", "text": "B"}]}]}),
            vec![
                At("/system", json!("A\n\nB")),
                At(
                    "/messages",
                    json!([{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
                ),
            ],
        ),
        case(
            "system-image",
            json!({"messages": [{"role": "system", "content": [
                {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}, hi()]}),
            vec![Refused("messages.0")],
        ),
        case(
            "user",
            json!({"messages": [{"role": "user", "content": "a"},
                {"role": "user", "content": [{"type": "text", "text": "b"}]}]}),
            vec![At(
                "/messages",
                json!([{"role": "user", "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]),
            )],
        ),
        case(
            "assistant",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "text", "text": "x"}, {"type": "refusal", "refusal": "no"}],
                "tool_calls": call()["tool_calls"]}]}),
            vec![At(
                "/messages/1",
                json!({"role": "assistant", "content": [
                    {"type": "text", "text": "x"}, {"type": "text", "text": "no"},
                    {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]}),
            )],
        ),
        case(
            "tool_calls-not-json",
            json!({"messages": [hi(), {"role": "assistant", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "nope"}}]}]}),
            vec![Refused("messages.1")],
        ),
        case(
            "tool",
            json!({"messages": [hi(), call(),
                {"role": "tool", "tool_call_id": "c1", "content": "r"},
                {"role": "user", "content": "thanks"}]}),
            vec![At(
                "/messages/2",
                json!({"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "c1", "content": "r"},
                    {"type": "text", "text": "thanks"}]}),
            )],
        ),
        case(
            "tool-image",
            json!({"messages": [hi(), call(), {"role": "tool", "tool_call_id": "c1", "content": [
                {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}]}),
            vec![Refused("messages.2")],
        ),
        case(
            "function-role",
            json!({"messages": [hi(), {"role": "function", "name": "f", "content": "x"}]}),
            vec![Refused("messages.1")],
        ),
        case(
            "image-data-url",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]}]}),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}),
            )],
        ),
        case(
            "image-url",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}]}]}),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}),
            )],
        ),
        case(
            "image-not-base64",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png,QUJD"}}]}]}),
            vec![Refused("messages.0")],
        ),
        case(
            "input_audio",
            json!({"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": "QUJD", "format": "wav"}}]}]}),
            vec![Refused("messages.0")],
        ),
        case(
            "file",
            json!({"messages": [{"role": "user", "content": [
                {"type": "file", "file": {"file_data": "data:application/pdf;base64,QUJD"}}]}]}),
            vec![Refused("messages.0")],
        ),
        case(
            "max_tokens-default",
            json!({}),
            vec![At("/max_tokens", json!(4096))],
        ),
        case(
            "max_tokens",
            json!({"max_tokens": 50}),
            vec![At("/max_tokens", json!(50))],
        ),
        case(
            "max_completion_tokens",
            json!({"max_tokens": 50, "max_completion_tokens": 70}),
            vec![At("/max_tokens", json!(70))],
        ),
        case(
            "temperature-top_p",
            json!({"temperature": 1.5, "top_p": 0.9}),
            vec![At("/temperature", json!(1.5)), At("/top_p", json!(0.9))],
        ),
        case(
            "stop",
            json!({"stop": "END"}),
            vec![At("/stop_sequences", json!(["END"])), Absent("/stop")],
        ),
        case(
            "stop-list",
            json!({"stop": ["a", "b"]}),
            vec![At("/stop_sequences", json!(["a", "b"]))],
        ),
        case(
            "user",
            json!({"user": "u-1"}),
            vec![At("/metadata", json!({"user_id": "u-1"})), Absent("/user")],
        ),
        case(
            "stream",
            json!({"stream": true, "stream_options": {"include_usage": false}}),
            vec![At("/stream", json!(true)), Absent("/stream_options")],
        ),
        case("n", json!({"n": 2}), vec![Refused("n")]),
        case("n-1", json!({"n": 1}), vec![Same]),
        case(
            "logprobs",
            json!({"logprobs": true}),
            vec![Refused("logprobs")],
        ),
        case(
            "top_logprobs",
            json!({"logprobs": false, "top_logprobs": 3}),
            vec![Same],
        ),
        case(
            "modalities",
            json!({"modalities": ["text", "audio"]}),
            vec![Refused("modalities")],
        ),
        case(
            "audio",
            json!({"audio": {"voice": "alloy", "format": "wav"}}),
            vec![Refused("modalities")],
        ),
        case(
            "tools",
            json!({"tools": [{"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}, "strict": true}},
                {"type": "function", "function": {"name": "g"}}]}),
            vec![At(
                "/tools",
                json!([{"name": "f", "description": "d",
                        "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}},
                       {"name": "g", "input_schema": {"type": "object", "properties": {}}}]),
            )],
        ),
        case(
            "tools-other",
            json!({"tools": [{"type": "function", "function": {"name": "f"}},
                {"type": "custom", "custom": {"name": "g"}}]}),
            vec![Refused("tools.1.type")],
        ),
        case(
            "tool_choice-auto",
            json!({"tools": tool(), "tool_choice": "auto"}),
            vec![At("/tool_choice", json!({"type": "auto"}))],
        ),
        case(
            "tool_choice-none",
            json!({"tools": tool(), "tool_choice": "none"}),
            vec![At("/tool_choice", json!({"type": "none"}))],
        ),
        case(
            "tool_choice-required",
            json!({"tools": tool(), "tool_choice": "required"}),
            vec![At("/tool_choice", json!({"type": "any"}))],
        ),
        case(
            "tool_choice-function",
            json!({"tools": tool(), "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            vec![At("/tool_choice", json!({"type": "tool", "name": "f"}))],
        ),
        case(
            "tool_choice-allowed_tools",
            json!({"tools": tool(), "tool_choice": {"type": "allowed_tools",
                "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}}}),
            vec![Refused("tool_choice")],
        ),
        case(
            "tool_choice-without-tools",
            json!({"tool_choice": "required"}),
            vec![Same],
        ),
        case(
            "parallel_tool_calls",
            json!({"tools": tool(), "parallel_tool_calls": false}),
            vec![At(
                "/tool_choice",
                json!({"type": "auto", "disable_parallel_tool_use": true}),
            )],
        ),
        case(
            "response_format-json_schema",
            json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "object", "required": ["a"]}}}}),
            vec![
                At("/tools/0/name", json!("answer")),
                At(
                    "/tools/0/input_schema",
                    json!({"type": "object", "required": ["a"]}),
                ),
                At("/tool_choice", json!({"type": "tool", "name": "answer"})),
            ],
        ),
        case(
            "response_format-json_object",
            json!({"response_format": {"type": "json_object"}}),
            vec![
                At("/tools/0/name", json!("json_object")),
                At(
                    "/tool_choice",
                    json!({"type": "tool", "name": "json_object"}),
                ),
            ],
        ),
        case(
            "response_format-text",
            json!({"response_format": {"type": "text"}}),
            vec![Same],
        ),
        case(
            "response_format-with-tools",
            json!({"tools": tool(), "response_format": {"type": "json_object"}}),
            vec![Refused("response_format")],
        ),
        case(
            "response_format-other",
            json!({"response_format": {"type": "grammar"}}),
            vec![Refused("response_format.type")],
        ),
        case(
            "reasoning_effort",
            json!({"reasoning_effort": "high"}),
            vec![Same],
        ),
        case(
            "left-out",
            json!({"seed": 7, "frequency_penalty": 1.0, "presence_penalty": 1.0,
                "logit_bias": {"50256": -100}, "service_tier": "flex", "store": true,
                "metadata": {"k": "v"}, "prediction": {"type": "content", "content": "x"},
                "web_search_options": {}, "verbosity": "low", "prompt_cache_key": "k",
                "safety_identifier": "s", "custom_knob": 1}),
            vec![Same],
        ),
        case(
            "functions",
            json!({"functions": [{"name": "f", "parameters": {"type": "object"}}],
                "function_call": {"name": "f"}}),
            vec![Same],
        ),
    ];
    run(
        Dialect::Chat,
        "anthropic",
        Dialect::Messages,
        chat_base(),
        &cases,
    );
}
