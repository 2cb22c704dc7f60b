//! The Messages and Responses faces on arbitrary bytes: a request through
//! each face's translation into a chat request, and an upstream answer (a
//! chat completion, or a chunk of one) through each face's rendering.
//! None of them may panic.
//!
//! Properties checked besides "no panic":
//! - a translated request keeps the model it named and is an object the
//!   chat validation can read (it may still refuse it, with a 400);
//! - every refusal names what is wrong;
//! - a rendered answer is a JSON object of the face's shape, and a rendered
//!   stream is whole SSE events, each `event:` line naming its data's type.

#![no_main]

use idem::http::error::ApiError;
use idem::http::validate::{Limits, chat_request, parse_object};
use idem::shapes::{messages, responses};
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};

const LIMITS: Limits = Limits {
    max_body_bytes: 1 << 20,
    max_json_depth: 16,
    max_messages: 64,
};

fn checked(chat: serde_json::Map<String, Value>, model: &str) {
    assert_eq!(chat.get("model").and_then(Value::as_str), Some(model));
    if let Err(e) = chat_request(chat, &LIMITS) {
        assert!(
            matches!(e, ApiError::BadRequest { code, .. } if !code.is_empty()),
            "{e:?}"
        );
    }
}

/// Whole SSE events whose `event:` names the `type` of their data.
fn whole_events(sse: &[u8]) {
    let text = std::str::from_utf8(sse).expect("UTF-8");
    assert!(text.is_empty() || text.ends_with("\n\n"), "{text}");
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let (head, data) = event.split_once('\n').expect("event and data lines");
        let kind = head.strip_prefix("event: ").expect("an event line");
        let data: Value = serde_json::from_str(data.strip_prefix("data: ").expect("a data line"))
            .expect("JSON data");
        assert_eq!(data["type"], kind, "{event}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(object) = parse_object(data, LIMITS.max_json_depth) else {
        return;
    };
    match messages::to_chat(&object) {
        Ok(t) => checked(t.chat, &t.model),
        Err(r) => assert!(!r.message.is_empty()),
    }
    let history = [json!({"role": "user", "content": "earlier"})];
    match responses::to_chat(&object, &history) {
        Ok(t) => checked(t.chat, &t.model),
        Err(r) => assert!(!r.message.is_empty()),
    }

    // The same object as an upstream answer.
    let answer = Value::Object(object);
    assert_eq!(
        messages::message_from_completion(&answer)["type"],
        "message"
    );
    whole_events(&messages::stream_from_completion(&answer));
    let echo = responses::Echo::of(answer.as_object().expect("an object"));
    let response = responses::response_from_completion(&answer, "resp_x", 1, &echo);
    assert_eq!(response["object"], "response");
    whole_events(&responses::stream_from_completion(
        &answer, "resp_x", 1, &echo,
    ));
    // And as one chunk of a live stream, twice, then the end.
    let mut m = messages::StreamTranslator::new();
    let mut r = responses::StreamTranslator::new("resp_x", 1, echo);
    for _ in 0..2 {
        whole_events(&m.push(&answer));
        whole_events(&r.push(&answer));
    }
    whole_events(&m.finish());
    whole_events(&r.finish());
    whole_events(&r.fail("server_error", "cut"));
});
