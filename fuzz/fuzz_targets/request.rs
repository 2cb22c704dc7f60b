//! Request parsing on arbitrary bytes: the body of `POST /v1/chat/completions`
//! and of `POST /v1/jobs` goes through `parse_object` (depth scan, then
//! serde), the jobs body through `job_body`, then `chat_request`. None of
//! them may panic, and what they accept must be fingerprintable.
//!
//! Properties checked besides "no panic":
//! - an accepted body is a JSON object no deeper than the limit;
//! - every rejection is a 400 with a machine-readable code;
//! - an accepted chat request keeps its `model`, and its fingerprint is the
//!   same whether it arrives alone or inside a jobs body.

#![no_main]

use idem::config::{Normalize, Scope, TargetConfig};
use idem::fingerprint::{Rules, fingerprint};
use idem::http::error::ApiError;
use idem::http::validate::{Limits, chat_request, exceeds_depth, job_body, parse_object};
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};

const LIMITS: Limits = Limits {
    max_body_bytes: 1 << 20,
    max_json_depth: 16,
    max_messages: 64,
    max_json_values: 100_000,
};

fn is_bad_request(e: &ApiError) -> bool {
    matches!(e, ApiError::BadRequest { code, .. } if !code.is_empty())
}

/// A route target from its config form, so that fields the config gains
/// later (with their defaults) do not break this target.
fn target(v: Value) -> TargetConfig {
    serde_json::from_value(v).expect("a valid target")
}

fn fp_of(body: &Map<String, Value>) -> idem::fingerprint::Fingerprint {
    let targets = [target(
        serde_json::json!({"provider": "primary", "model": "gpt-4o-mini"}),
    )];
    let rules = Rules {
        tenant: "acme",
        route: "bot",
        targets: &targets,
        normalize: Normalize::Whitespace,
        scope: Scope::User,
        ignore_fields: &[],
        kinds: &[],
        contract: None,
        dialect: idem::dialect::Dialect::Chat,
        headers: &idem::dialect::Forwarded::default(),
    };
    fingerprint(body, Some("someone"), &rules)
}

fuzz_target!(|data: &[u8]| {
    // As a chat completion body.
    match parse_object(data, &LIMITS) {
        Ok(map) => {
            assert!(!exceeds_depth(data, LIMITS.max_json_depth));
            let alone = chat_request(map.clone(), &LIMITS);
            // The same body wrapped as a job: the same verdict, the same
            // fingerprint.
            let wrapped = {
                let mut outer = Map::new();
                outer.insert("request".into(), Value::Object(map.clone()));
                outer.insert("metadata".into(), serde_json::json!({"k": "v"}));
                let (request, metadata) = job_body(outer).expect("a well-formed jobs body");
                assert_eq!(metadata, Some(serde_json::json!({"k": "v"})));
                chat_request(request, &LIMITS)
            };
            match (alone, wrapped) {
                (Ok(a), Ok(b)) => {
                    assert_eq!(a.model, map["model"].as_str().unwrap_or_default());
                    assert_eq!(fp_of(&a.body), fp_of(&b.body));
                    assert_eq!(a.stream, b.stream);
                }
                (Err(a), Err(b)) => {
                    assert!(is_bad_request(&a), "{a:?}");
                    assert_eq!(a.to_string(), b.to_string());
                }
                (a, b) => panic!("alone {a:?} but wrapped {b:?}"),
            }
        }
        Err(e) => assert!(is_bad_request(&e), "{e:?}"),
    }
    // As a jobs body: its shape first, then the request inside.
    if let Ok(outer) = parse_object(data, &LIMITS) {
        match job_body(outer) {
            Ok((request, _)) => {
                if let Err(e) = chat_request(request, &LIMITS) {
                    assert!(is_bad_request(&e), "{e:?}");
                }
            }
            Err(e) => assert!(is_bad_request(&e), "{e:?}"),
        }
    }
});
