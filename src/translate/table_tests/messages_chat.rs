//! The Messages face before OpenAI-compatible targets (docs/http-api.md,
//! "What becomes of each field").

use super::*;

fn messages_base() -> Value {
    json!({"model": "bot", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]})
}

/// The cases of a Messages request to a chat target whose model does not
/// reason.
fn messages_to_chat_cases() -> Vec<Case> {
    let hi = || json!({"role": "user", "content": "hi"});
    let png = || json!({"type": "base64", "media_type": "image/png", "data": "QUJD"});
    let asks = || {
        json!({"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]})
    };
    let asked = || {
        json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]})
    };
    let tool = || json!({"name": "f", "input_schema": {"type": "object"}});
    vec![
        case("model", json!({}), vec![At("/model", json!("gpt-4o"))]),
        case(
            "max_tokens",
            json!({}),
            vec![
                At("/max_tokens", json!(100)),
                Absent("/max_completion_tokens"),
            ],
        ),
        case(
            "roles",
            json!({"messages": [hi(), {"role": "assistant", "content": "yo"}, hi()]}),
            vec![At(
                "/messages",
                json!([hi(), {"role": "assistant", "content": "yo"}, hi()]),
            )],
        ),
        case(
            "system-turn",
            json!({"messages": [{"role": "system", "content": [{"type": "text", "text": "S"}]}, hi()]}),
            vec![At("/messages/0", json!({"role": "system", "content": "S"}))],
        ),
        case(
            "other-role",
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            vec![Refused("messages.0.role")],
        ),
        case(
            "text",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                "cache_control": {"type": "ephemeral"}, "citations": []}]}]}),
            vec![Same],
        ),
        case(
            "text-blocks",
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}),
            vec![At(
                "/messages/0/content",
                json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
            )],
        ),
        case(
            "image",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": png()},
                {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}]}]}),
            vec![At(
                "/messages/0/content",
                json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                       {"type": "image_url", "image_url": {"url": "https://x/a.png"}}]),
            )],
        ),
        case(
            "image-file",
            json!({"messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "file", "file_id": "f"}}]}]}),
            vec![Refused("messages.0.content.0.source.type")],
        ),
        case(
            "document",
            json!({"messages": [{"role": "user", "content": [
                {"type": "document", "title": "spec.pdf", "source":
                    {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain"}}]}]}),
            vec![At(
                "/messages/0/content",
                json!([{"type": "file", "file": {"filename": "spec.pdf",
                            "file_data": "data:application/pdf;base64,JVBE"}},
                       {"type": "text", "text": "plain"}]),
            )],
        ),
        case(
            "document-url",
            json!({"messages": [{"role": "user", "content": [
                {"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}}]}]}),
            vec![Refused("messages.0.content.0.source.type")],
        ),
        case(
            "search_result",
            json!({"messages": [{"role": "user", "content": [{"type": "search_result",
                "title": "T", "source": "https://x", "content": [{"type": "text", "text": "body"}]}]}]}),
            vec![At("/messages/0/content", json!("T\nhttps://x\nbody"))],
        ),
        case(
            "tool_use",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "text", "text": "Let me see."},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]}]}),
            vec![At(
                "/messages/1",
                json!({"role": "assistant", "content": "Let me see.",
                       "tool_calls": asked()["tool_calls"]}),
            )],
        ),
        case(
            "tool_use-in-user",
            json!({"messages": [{"role": "user", "content": [
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]}),
            vec![Refused("messages.0.content.0.type")],
        ),
        case(
            "tool_result",
            json!({"messages": [hi(), asks(), {"role": "user", "content": [
                {"type": "text", "text": "thanks"},
                {"type": "tool_result", "tool_use_id": "t1", "is_error": true, "content": [
                    {"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                    {"type": "image", "source": png()}]}]}]}),
            vec![At(
                "/messages",
                json!([hi(), asked(),
                    {"role": "tool", "tool_call_id": "t1", "content": "Error: a\n\nb"},
                    {"role": "user", "content": [
                        {"type": "text", "text": "The tool results' images:"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]},
                    {"role": "user", "content": "thanks"}]),
            )],
        ),
        case(
            "tool_result-in-assistant",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]}),
            vec![Refused("messages.1.content.0.type")],
        ),
        case(
            "thinking",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "redacted_thinking", "data": "xx"},
                {"type": "server_tool_use", "id": "s1", "name": "web_search", "input": {"query": "q"}},
                {"type": "web_search_tool_result", "tool_use_id": "s1", "content": []},
                {"type": "text", "text": "yo"}]}]}),
            vec![At(
                "/messages",
                json!([hi(), {"role": "assistant", "content": "yo"}]),
            )],
        ),
        case(
            "other-block",
            json!({"messages": [{"role": "user", "content": [
                {"type": "container_upload", "file_id": "f"}]}]}),
            vec![Refused("messages.0.content.0.type")],
        ),
        case(
            "other-server-result",
            json!({"messages": [hi(), {"role": "assistant", "content": [
                {"type": "web_fetch_tool_result", "tool_use_id": "s1", "content": {}}]}]}),
            vec![Refused("messages.1.content.0.type")],
        ),
        case(
            "empty-content",
            json!({"messages": [{"role": "user", "content": []}]}),
            vec![Refused("messages.0.content")],
        ),
        case(
            "empty-final-assistant",
            json!({"messages": [hi(), {"role": "assistant", "content": []}]}),
            vec![Same],
        ),
        case(
            "system",
            json!({"system": [{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                              {"type": "text", "text": "B"}]}),
            vec![At(
                "/messages/0",
                json!({"role": "system", "content": "A\n\nB"}),
            )],
        ),
        case(
            "system-image",
            json!({"system": [{"type": "image", "source": png()}]}),
            vec![Refused("system.0.type")],
        ),
        case(
            "temperature-top_p",
            json!({"temperature": 0.5, "top_p": 0.9}),
            vec![At("/temperature", json!(0.5)), At("/top_p", json!(0.9))],
        ),
        case(
            "temperature-range",
            json!({"temperature": 1.5}),
            vec![Refused("temperature")],
        ),
        case("top_k", json!({"top_k": 40}), vec![At("/top_k", json!(40))]),
        case(
            "stop_sequences",
            json!({"stop_sequences": ["a", "b"]}),
            vec![At("/stop", json!(["a", "b"])), Absent("/stop_sequences")],
        ),
        case(
            "stream",
            json!({"stream": true}),
            vec![At("/stream", json!(true))],
        ),
        case(
            "metadata",
            json!({"metadata": {"user_id": "u-1", "other": 1}}),
            vec![At("/user", json!("u-1")), Absent("/metadata")],
        ),
        case(
            "tools",
            json!({"tools": [
                {"name": "f", "description": "d", "input_schema": {"type": "object"},
                 "cache_control": {"type": "ephemeral"}, "strict": true},
                {"type": "custom", "name": "g", "input_schema": {"type": "object"}}]}),
            vec![At(
                "/tools",
                json!([{"type": "function", "function": {"name": "f", "description": "d",
                            "parameters": {"type": "object"}, "strict": true}},
                       {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}]),
            )],
        ),
        case(
            "server-tools",
            json!({"tools": [tool(), {"type": "web_search_20250305", "name": "web_search"}]}),
            vec![Refused("tools.1.type")],
        ),
        case(
            "tool_choice-auto",
            json!({"tools": [tool()], "tool_choice": {"type": "auto"}}),
            vec![
                At("/tool_choice", json!("auto")),
                Absent("/parallel_tool_calls"),
            ],
        ),
        case(
            "tool_choice-any",
            json!({"tools": [tool()], "tool_choice": {"type": "any"}}),
            vec![At("/tool_choice", json!("required"))],
        ),
        case(
            "tool_choice-none",
            json!({"tools": [tool()], "tool_choice": {"type": "none"}}),
            vec![At("/tool_choice", json!("none"))],
        ),
        case(
            "tool_choice-tool",
            json!({"tools": [tool()], "tool_choice": {"type": "tool", "name": "f"}}),
            vec![At(
                "/tool_choice",
                json!({"type": "function", "function": {"name": "f"}}),
            )],
        ),
        case(
            "disable_parallel_tool_use",
            json!({"tools": [tool()], "tool_choice": {"type": "any", "disable_parallel_tool_use": true}}),
            vec![
                At("/tool_choice", json!("required")),
                At("/parallel_tool_calls", json!(false)),
            ],
        ),
        case(
            "thinking-plain-model",
            json!({"thinking": {"type": "enabled", "budget_tokens": 20000}}),
            vec![Same],
        ),
        case(
            "thinking-disabled",
            json!({"thinking": {"type": "disabled"}}),
            vec![Same],
        ),
        case(
            "thinking-no-budget",
            json!({"thinking": {"type": "enabled"}}),
            vec![Refused("thinking.budget_tokens")],
        ),
        case(
            "thinking-other",
            json!({"thinking": {"type": "sometimes"}}),
            vec![Refused("thinking.type")],
        ),
        case(
            "output_config-effort-plain-model",
            json!({"output_config": {"effort": "high"}}),
            vec![Same],
        ),
        case(
            "output_config-format",
            json!({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}),
            vec![At(
                "/response_format",
                json!({"type": "json_schema", "json_schema":
                    {"name": "output", "schema": {"type": "object"}, "strict": true}}),
            )],
        ),
        case(
            "output_config-format-other",
            json!({"output_config": {"format": {"type": "text"}}}),
            vec![Refused("output_config.format.type")],
        ),
        case(
            "left-out",
            json!({"context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
                   "service_tier": "auto", "mcp_servers": []}),
            vec![Same],
        ),
        case(
            "mcp_servers",
            json!({"mcp_servers": [{"type": "url", "url": "https://x", "name": "x"}]}),
            vec![Refused("mcp_servers")],
        ),
        case(
            "container",
            json!({"container": "cntr_1"}),
            vec![Refused("container")],
        ),
        case(
            "other-fields",
            json!({"custom_knob": {"a": 1}}),
            vec![At("/custom_knob", json!({"a": 1}))],
        ),
    ]
}

/// A Messages request to each kind that speaks chat, said in chat.
#[test]
fn messages_to_chat() {
    for route in ["openai", "azure", "responses-api", "mock"] {
        run(
            Dialect::Messages,
            route,
            Dialect::Chat,
            messages_base(),
            &messages_to_chat_cases(),
        );
    }
}

/// A Messages request to a chat target whose model reasons (`o1`, `o3`,
/// `o4`, `gpt-5`): thinking and effort as `reasoning_effort`.
#[test]
fn messages_to_chat_reasoning_model() {
    let cases = [
        case(
            "max_tokens",
            json!({}),
            vec![
                At("/max_completion_tokens", json!(100)),
                Absent("/max_tokens"),
            ],
        ),
        case(
            "thinking-small-budget",
            json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
            vec![At("/reasoning_effort", json!("low")), Absent("/thinking")],
        ),
        case(
            "thinking-medium-budget",
            json!({"thinking": {"type": "enabled", "budget_tokens": 4096}}),
            vec![At("/reasoning_effort", json!("medium"))],
        ),
        case(
            "thinking-large-budget",
            json!({"thinking": {"type": "enabled", "budget_tokens": 16384}}),
            vec![At("/reasoning_effort", json!("high"))],
        ),
        case(
            "thinking-adaptive",
            json!({"thinking": {"type": "adaptive"}}),
            vec![At("/reasoning_effort", json!("medium"))],
        ),
        case(
            "thinking-disabled",
            json!({"thinking": {"type": "disabled"}}),
            vec![Absent("/reasoning_effort")],
        ),
        case(
            "output_config-effort",
            json!({"output_config": {"effort": "max"},
                   "thinking": {"type": "enabled", "budget_tokens": 1024}}),
            vec![
                At("/reasoning_effort", json!("high")),
                Absent("/output_config"),
            ],
        ),
        case(
            "output_config-effort-low",
            json!({"output_config": {"effort": "low"}}),
            vec![At("/reasoning_effort", json!("low"))],
        ),
    ];
    run(
        Dialect::Messages,
        "openai-reasoning",
        Dialect::Chat,
        messages_base(),
        &cases,
    );
}
