//! The Responses face before OpenAI-compatible and Anthropic targets
//! (docs/http-api.md, "What becomes of each field").

use super::*;

fn responses_base() -> Value {
    json!({"model": "bot", "input": "hi"})
}

/// The cases of a Responses request to a target that speaks chat.
fn responses_to_chat_cases() -> Vec<Case> {
    let hi = || json!({"role": "user", "content": "hi"});
    let user =
        |parts: Value| json!({"input": [{"type": "message", "role": "user", "content": parts}]});
    vec![
        case(
            "model",
            json!({}),
            vec![
                At("/model", json!("gpt-4o")),
                At("/messages", json!([hi()])),
            ],
        ),
        case(
            "input-items",
            json!({"input": [
                {"role": "developer", "content": "D"},
                {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "S"}]},
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "output_text", "text": "b"}]},
                {"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": "x", "annotations": []}, {"type": "output_text", "text": "y"}]}]}),
            vec![At(
                "/messages",
                json!([{"role": "developer", "content": "D"},
                       {"role": "system", "content": [{"type": "text", "text": "S"}]},
                       {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                       {"role": "assistant", "content": "xy"}]),
            )],
        ),
        case(
            "other-role",
            json!({"input": [{"role": "tool", "content": "x"}]}),
            vec![Refused("input.0.role")],
        ),
        case(
            "refusal",
            json!({"input": [hi(), {"type": "message", "role": "assistant", "content": [
                {"type": "refusal", "refusal": "no"}]}]}),
            vec![At(
                "/messages/1",
                json!({"role": "assistant", "content": null, "refusal": "no"}),
            )],
        ),
        case(
            "input_image",
            user(json!([{"type": "input_image", "image_url": "https://x/a.png", "detail": "low"}])),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "image_url", "image_url": {"url": "https://x/a.png", "detail": "low"}}),
            )],
        ),
        case(
            "input_image-file_id",
            user(json!([{"type": "input_image", "file_id": "file-1"}])),
            vec![Refused("input.0.content.0.file_id")],
        ),
        case(
            "input_image-not-user",
            json!({"input": [{"role": "system", "content": [
                {"type": "input_image", "image_url": "https://x/a.png"}]}]}),
            vec![Refused("input.0.content.0.type")],
        ),
        case(
            "input_file",
            user(json!([{"type": "input_file", "filename": "a.pdf",
                         "file_data": "data:application/pdf;base64,JVBE"}])),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "file", "file": {"filename": "a.pdf",
                       "file_data": "data:application/pdf;base64,JVBE"}}),
            )],
        ),
        case(
            "input_file-by-id",
            user(json!([{"type": "input_file", "file_id": "file-1"}])),
            vec![Refused("input.0.content.0.type")],
        ),
        case(
            "other-part",
            user(json!([{"type": "input_audio", "input_audio": {}}])),
            vec![Refused("input.0.content.0.type")],
        ),
        case(
            "function_call",
            json!({"input": [hi(),
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r"},
                {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "s"}]}]}),
            vec![At(
                "/messages",
                json!([hi(),
                    {"role": "assistant", "content": null, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r"},
                    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "s"}]}]),
            )],
        ),
        case(
            "function_call_output-image",
            json!({"input": [{"type": "function_call_output", "call_id": "c1", "output": [
                {"type": "input_image", "image_url": "https://x/a.png"}]}]}),
            vec![Refused("input.0.output.0.type")],
        ),
        case(
            "custom_tool_call",
            json!({"input": [hi(),
                {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin"},
                {"type": "custom_tool_call_output", "call_id": "c1", "output": "done"}]}),
            vec![
                At(
                    "/messages/1/tool_calls/0",
                    json!({"id": "c1", "type": "function", "function":
                        {"name": "apply_patch", "arguments": "{\"input\":\"*** Begin\"}"}}),
                ),
                At(
                    "/messages/2",
                    json!({"role": "tool", "tool_call_id": "c1", "content": "done"}),
                ),
            ],
        ),
        case(
            "reasoning-item",
            json!({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"},
                hi(), {"type": "web_search_call", "id": "ws_1", "status": "completed"}]}),
            vec![Same],
        ),
        case(
            "item_reference",
            json!({"input": [hi(), {"type": "item_reference", "id": "msg_1"}]}),
            vec![Refused("input.1.type")],
        ),
        case(
            "other-item",
            json!({"input": [hi(), {"type": "computer_call_output", "call_id": "c"}]}),
            vec![Refused("input.1.type")],
        ),
        case(
            "instructions",
            json!({"instructions": "Be brief."}),
            vec![At(
                "/messages",
                json!([{"role": "system", "content": "Be brief."}, hi()]),
            )],
        ),
        case(
            "tools-function",
            json!({"tools": [{"type": "function", "name": "f", "description": "d",
                "parameters": {"type": "object"}, "strict": false}, {"type": "function", "name": "g"}]}),
            vec![At(
                "/tools",
                json!([{"type": "function", "function": {"name": "f", "description": "d",
                            "parameters": {"type": "object"}, "strict": false}},
                       {"type": "function", "function": {"name": "g"}}]),
            )],
        ),
        case(
            "tools-custom",
            json!({"tools": [{"type": "custom", "name": "apply_patch", "description": "Patch.",
                "format": {"type": "grammar", "syntax": "lark", "definition": "start: x"}}]}),
            vec![At(
                "/tools/0",
                json!({"type": "function", "function": {"name": "apply_patch",
                    "description": "Patch.\n\nThe input follows this grammar:\nstart: x",
                    "parameters": {"type": "object", "properties": {"input": {"type": "string"}},
                                   "required": ["input"]}}}),
            )],
        ),
        case(
            "tools-namespace",
            json!({"tools": [{"type": "namespace", "name": "fs", "tools": [
                {"type": "function", "name": "read"}, {"type": "custom", "name": "write"}]}]}),
            vec![
                At("/tools/0/function/name", json!("fs__read")),
                At("/tools/1/function/name", json!("fs__write")),
            ],
        ),
        case(
            "additional_tools",
            json!({"tools": [{"type": "function", "name": "f"}], "input": [
                {"type": "additional_tools", "role": "developer", "tools": [
                    {"type": "namespace", "name": "fs", "tools": [{"type": "custom", "name": "write"}]}]},
                hi()]}),
            vec![
                At("/tools/0/function/name", json!("f")),
                At("/tools/1/function/name", json!("fs__write")),
                At("/messages", json!([hi()])),
            ],
        ),
        case(
            "additional_tools-other",
            json!({"input": [{"type": "additional_tools", "tools": [{"type": "shell"}]}, hi()]}),
            vec![Refused("input.0.tools.0.type")],
        ),
        case(
            "tools-hosted",
            json!({"tools": [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]},
                {"type": "code_interpreter"}, {"type": "image_generation"}, {"type": "mcp"},
                {"type": "tool_search"}, {"type": "computer_use_preview"}, {"type": "local_shell"}]}),
            vec![Same],
        ),
        case(
            "tools-other",
            json!({"tools": [{"type": "shell"}]}),
            vec![Refused("tools.0.type")],
        ),
        case(
            "tool_choice-mode",
            json!({"tool_choice": "required"}),
            vec![At("/tool_choice", json!("required"))],
        ),
        case(
            "tool_choice-function",
            json!({"tool_choice": {"type": "custom", "name": "apply_patch"}}),
            vec![At(
                "/tool_choice",
                json!({"type": "function", "function": {"name": "apply_patch"}}),
            )],
        ),
        case(
            "tool_choice-allowed_tools",
            json!({"tool_choice": {"type": "allowed_tools", "mode": "auto",
                "tools": [{"type": "function", "name": "f"}]}}),
            vec![At(
                "/tool_choice",
                json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto",
                    "tools": [{"type": "function", "function": {"name": "f"}}]}}),
            )],
        ),
        case(
            "tool_choice-hosted",
            json!({"tool_choice": {"type": "web_search"}}),
            vec![Refused("tool_choice.type")],
        ),
        case(
            "text-format-json_schema",
            json!({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"},
                "strict": true}, "verbosity": "low"}}),
            vec![
                At(
                    "/response_format",
                    json!({"type": "json_schema", "json_schema":
                        {"name": "a", "schema": {"type": "object"}, "strict": true}}),
                ),
                At("/verbosity", json!("low")),
            ],
        ),
        case(
            "text-format-json_object",
            json!({"text": {"format": {"type": "json_object"}}}),
            vec![At("/response_format", json!({"type": "json_object"}))],
        ),
        case(
            "text-format-text",
            json!({"text": {"format": {"type": "text"}}}),
            vec![Same],
        ),
        case(
            "text-format-other",
            json!({"text": {"format": {"type": "grammar"}}}),
            vec![Refused("text.format.type")],
        ),
        case(
            "reasoning",
            json!({"reasoning": {"effort": "high", "summary": "auto"}}),
            vec![At("/reasoning_effort", json!("high")), Absent("/reasoning")],
        ),
        case(
            "left-out",
            json!({"include": ["reasoning.encrypted_content"], "store": true,
                "previous_response_id": "resp_1", "background": false, "truncation": "auto",
                "service_tier": "flex", "prompt_cache_retention": "24h",
                "client_metadata": {"x": "y"}, "stream_options": {"include_obfuscation": false},
                "max_tool_calls": 3, "metadata": {"k": "v"}, "top_logprobs": 0}),
            vec![Same],
        ),
        case(
            "background",
            json!({"background": true}),
            vec![Refused("background")],
        ),
        case(
            "conversation",
            json!({"conversation": "conv_1"}),
            vec![Refused("conversation")],
        ),
        case(
            "prompt",
            json!({"prompt": {"id": "pmpt_1"}}),
            vec![Refused("prompt")],
        ),
        case(
            "top_logprobs",
            json!({"top_logprobs": 2}),
            vec![Refused("top_logprobs")],
        ),
        case(
            "renamed",
            json!({"max_output_tokens": 500}),
            vec![
                At("/max_completion_tokens", json!(500)),
                Absent("/max_output_tokens"),
            ],
        ),
        case(
            "same-names",
            json!({"temperature": 0.3, "top_p": 0.9, "parallel_tool_calls": false,
                "user": "u", "safety_identifier": "s", "prompt_cache_key": "k"}),
            vec![
                At("/temperature", json!(0.3)),
                At("/top_p", json!(0.9)),
                At("/parallel_tool_calls", json!(false)),
                At("/user", json!("u")),
                At("/safety_identifier", json!("s")),
                At("/prompt_cache_key", json!("k")),
            ],
        ),
        case(
            "stream",
            json!({"stream": true}),
            vec![At("/stream", json!(true))],
        ),
        case(
            "other-fields",
            json!({"seed": 7}),
            vec![At("/seed", json!(7))],
        ),
    ]
}

/// A Responses request to each kind that speaks chat and not Responses.
#[test]
fn responses_to_chat() {
    for route in ["openai", "azure", "mock"] {
        run(
            Dialect::Responses,
            route,
            Dialect::Chat,
            responses_base(),
            &responses_to_chat_cases(),
        );
    }
}

/// A Responses request to an Anthropic target: said in chat, then in the
/// Messages API.
#[test]
fn responses_to_anthropic() {
    let hi = || json!({"role": "user", "content": "hi"});
    let text = |t: &str| json!({"type": "text", "text": t});
    let cases = [
        case(
            "model",
            json!({}),
            vec![
                At("/model", json!("claude-x")),
                At(
                    "/messages",
                    json!([{"role": "user", "content": [text("hi")]}]),
                ),
                At("/max_tokens", json!(4096)),
            ],
        ),
        case(
            "instructions",
            json!({"instructions": "I", "input": [{"role": "developer", "content": "D"}, hi(),
                {"role": "system", "content": "S"}]}),
            vec![
                At("/system", json!("I\n\nD\n\nS")),
                At(
                    "/messages",
                    json!([{"role": "user", "content": [text("hi")]}]),
                ),
            ],
        ),
        case(
            "input_image",
            json!({"input": [{"role": "user", "content": [
                {"type": "input_image", "image_url": "data:image/png;base64,QUJD"}]}]}),
            vec![At(
                "/messages/0/content/0",
                json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}),
            )],
        ),
        case(
            "input_file",
            json!({"input": [hi(), {"role": "user", "content": [{"type": "input_file",
                "filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBE"}]}]}),
            vec![Refused("messages.1")],
        ),
        case(
            "function_call",
            json!({"input": [hi(),
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\":1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r"}]}),
            vec![At(
                "/messages",
                json!([{"role": "user", "content": [text("hi")]},
                       {"role": "assistant", "content": [
                           {"type": "tool_use", "id": "c1", "name": "f", "input": {"a": 1}}]},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": "c1", "content": "r"}]}]),
            )],
        ),
        case(
            "custom_tool_call",
            json!({"input": [hi(),
                {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": "*** Begin"}]}),
            vec![At(
                "/messages/1/content/0",
                json!({"type": "tool_use", "id": "c1", "name": "apply_patch", "input": {"input": "*** Begin"}}),
            )],
        ),
        case(
            "refusal",
            json!({"input": [hi(), {"type": "message", "role": "assistant", "content": [
                {"type": "refusal", "refusal": "no"}]}, {"role": "user", "content": "again"}]}),
            vec![At(
                "/messages",
                json!([{"role": "user", "content": [text("hi"), text("again")]}]),
            )],
        ),
        case(
            "reasoning-item",
            json!({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA"}, hi()]}),
            vec![Same],
        ),
        case(
            "tools-custom",
            json!({"tools": [{"type": "custom", "name": "apply_patch"},
                {"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read"}]},
                {"type": "web_search"}]}),
            vec![At(
                "/tools",
                json!([{"name": "apply_patch", "description": "",
                        "input_schema": {"type": "object", "properties": {"input": {"type": "string"}},
                                         "required": ["input"]}},
                       {"name": "fs__read", "input_schema": {"type": "object", "properties": {}}}]),
            )],
        ),
        case(
            "tool_choice",
            json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
                   "parallel_tool_calls": false}),
            vec![At(
                "/tool_choice",
                json!({"type": "any", "disable_parallel_tool_use": true}),
            )],
        ),
        case(
            "tool_choice-allowed_tools",
            json!({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools",
                "mode": "auto", "tools": [{"type": "function", "name": "f"}]}}),
            vec![Refused("tool_choice")],
        ),
        case(
            "text-format",
            json!({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}}),
            vec![
                At("/tools/0/name", json!("a")),
                At("/tool_choice", json!({"type": "tool", "name": "a"})),
            ],
        ),
        case(
            "text-format-with-tools",
            json!({"tools": [{"type": "function", "name": "f"}],
                   "text": {"format": {"type": "json_object"}}}),
            vec![Refused("response_format")],
        ),
        case(
            "max_output_tokens",
            json!({"max_output_tokens": 300}),
            vec![At("/max_tokens", json!(300))],
        ),
        case(
            "user",
            json!({"user": "u", "safety_identifier": "s"}),
            vec![At("/metadata", json!({"user_id": "u"}))],
        ),
        case(
            "left-out",
            json!({"reasoning": {"effort": "high", "summary": "auto"}, "text": {"verbosity": "low"},
                   "safety_identifier": "s", "prompt_cache_key": "k", "seed": 7,
                   "include": ["reasoning.encrypted_content"], "store": true, "metadata": {"k": "v"}}),
            vec![Same],
        ),
        case(
            "temperature",
            json!({"temperature": 1.5, "top_p": 0.5}),
            vec![At("/temperature", json!(1.5)), At("/top_p", json!(0.5))],
        ),
        case(
            "stream",
            json!({"stream": true}),
            vec![At("/stream", json!(true))],
        ),
        case(
            "refusals",
            json!({"conversation": "conv_1"}),
            vec![Refused("conversation")],
        ),
    ];
    run(
        Dialect::Responses,
        "anthropic",
        Dialect::Messages,
        responses_base(),
        &cases,
    );
}
