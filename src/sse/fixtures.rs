//! Streams and completions that the tests of more than one part of the
//! module share.

use serde_json::{Value, json};

use super::EventSplitter;

/// A tool-calling stream as OpenAI sends it (`stream_options:
/// {"include_usage": true}`), with the argument fragments split
/// mid-token, two parallel calls, CRLF line ends on some events, a
/// keep-alive comment, `event:`/`id:` lines and a final usage chunk.
pub(super) const TOOL_STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_Wq1","type":"function","function":{"name":"get_weather","arguments":""}}],"refusal":null},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\n\n",
    ": keep-alive\n\n",
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"ci"}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\r\n\r\n",
    "event: message\r\nid: 3\r\n",
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"ty\": \"Paris, "}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\r\n\r\n",
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"Île-de-France\"}"}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_Xy2","type":"function","function":{"name":"get_time","arguments":""}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"{\"tz\":"}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":" \"Europe/Paris\"}"}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls"}],"usage":null}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[],"usage":{"prompt_tokens":82,"completion_tokens":47,"total_tokens":129,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

/// A plain text answer, without usage, sent as OpenAI does: a role
/// chunk with `content: ""`, token chunks, then the finish chunk.
pub(super) const TEXT_STREAM: &str = concat!(
    r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{"content":"Your order"},"logprobs":null,"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{"content":" ships to"},"logprobs":null,"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{"content":" Zürich 🚚."},"logprobs":null,"finish_reason":null}]}"#,
    "\n\n",
    r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}"#,
    "\n\n",
    "data: [DONE]\n\n",
);

pub(super) fn text_completion() -> Value {
    json!({
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1745000000,
        "model": "gpt-4o-mini-2024-07-18",
        "choices": [{"index": 0, "message": {"role": "assistant",
            "content": "Your parcel left the depot this morning.",
            "refusal": null, "annotations": []},
            "logprobs": null, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29},
        "service_tier": "default",
        "system_fingerprint": "fp_1"
    })
}

pub(super) fn events_of(stream: &[u8]) -> Vec<String> {
    let mut splitter = EventSplitter::new();
    let mut events = splitter.push(stream);
    events.extend(splitter.finish());
    events
}
