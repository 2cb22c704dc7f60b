//! The translations between dialects on arbitrary bytes: a request through
//! each request translator (Messages -> chat, Responses -> chat, chat ->
//! Messages), and the same bytes as a provider's reply through each reply
//! translator, whole and as a stream cut in two. None of them may panic.
//!
//! Properties checked besides "no panic":
//! - a translated request keeps the model it named, and a chat request
//!   made of it is one the chat validation can read (it may still refuse
//!   it, with a 400);
//! - every refusal says what is wrong;
//! - a translated stream is whole SSE events, each `event:` line (where the
//!   dialect has them) naming its data's type.

#![no_main]

use idem::fingerprint::Fingerprint;
use idem::http::error::ApiError;
use idem::http::validate::{Limits, chat_request, parse_object};
use idem::translate::{Reply, chat_messages, messages_chat, responses_chat};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};

const LIMITS: Limits = Limits {
    max_body_bytes: 1 << 20,
    max_json_depth: 16,
    max_messages: 64,
    max_json_values: 100_000,
};

fn checked(chat: Map<String, Value>, model: Option<&Value>) {
    assert_eq!(chat.get("model"), model);
    if let Err(e) = chat_request(chat, &LIMITS) {
        assert!(
            matches!(e, ApiError::BadRequest { code, .. } if !code.is_empty()),
            "{e:?}"
        );
    }
}

/// Whole SSE events; where an `event:` line comes first, it names the
/// `type` of its data.
fn whole_events(sse: &[u8]) {
    let Ok(text) = std::str::from_utf8(sse) else {
        panic!("a translated stream is not UTF-8");
    };
    assert!(text.is_empty() || text.ends_with("\n\n"), "{text}");
    for event in text.split("\n\n").filter(|e| !e.is_empty()) {
        let Some(kind) = event.strip_prefix("event: ") else {
            continue;
        };
        let (kind, data) = kind.split_once('\n').expect("an event and a data line");
        let data = data.strip_prefix("data: ").expect("a data line");
        let data: Value = serde_json::from_str(data).expect("JSON data");
        assert_eq!(data["type"], kind, "{event}");
    }
}

/// `data` through `reply`: whole, then as a stream cut at `cut`.
fn replies(mut whole: Box<dyn Reply>, mut streamed: Box<dyn Reply>, data: &[u8]) {
    let _ = whole.plain(data);
    let _ = whole.error(500, data);
    let cut = data.len() / 2;
    let mut out = streamed.push(&data[..cut]).to_vec();
    out.extend_from_slice(&streamed.push(&data[cut..]));
    out.extend_from_slice(&streamed.finish());
    whole_events(&out);
}

fuzz_target!(|data: &[u8]| {
    let fp = Fingerprint::from_bytes([7; 32]);
    let empty = Map::new();
    let object = parse_object(data, &LIMITS).ok();
    let request = object.as_ref().unwrap_or(&empty);

    // As a request of each dialect, said in another.
    // The model stays the one asked for (the target's is set later; `m`
    // only says which kind of model it is).
    match messages_chat::request::to_chat(request, "m") {
        Ok(chat) => checked(chat, request.get("model").filter(|m| !m.is_null())),
        Err(r) => assert!(!r.message.is_empty()),
    }
    match responses_chat::request::to_chat(request) {
        Ok(chat) => checked(chat, request.get("model")),
        Err(r) => assert!(!r.message.is_empty()),
    }
    match chat_messages::request::translate(request, 1024) {
        Ok((body, _)) => assert_eq!(body.get("model"), request.get("model")),
        Err(r) => assert!(!r.message.is_empty()),
    }

    // As a provider's reply, read back into the request's dialect.
    let reading = || chat_messages::Reading::of_chat(request);
    replies(
        Box::new(chat_messages::Reply::new(reading())),
        Box::new(chat_messages::Reply::new(reading())),
        data,
    );
    replies(
        Box::new(messages_chat::Reply::new()),
        Box::new(messages_chat::Reply::new()),
        data,
    );
    replies(
        Box::new(responses_chat::Reply::new(fp, request)),
        Box::new(responses_chat::Reply::new(fp, request)),
        data,
    );
});
