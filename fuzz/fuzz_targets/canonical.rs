//! The fingerprint canonicaliser on arbitrary JSON.
//!
//! Properties checked besides "no panic":
//! - `write_canonical` writes valid JSON, and writing what it wrote again
//!   gives the same bytes (the canonical form is stable under re-parse);
//! - the fingerprint of an object equals the fingerprint of its canonical
//!   form re-parsed (only the canonical form counts, not the spelling);
//! - message text normalization is idempotent, for every mode.
//!
//! Inputs that are not JSON are used as message text for the last property.

#![no_main]

use idem::config::{Normalize, Scope, TargetConfig};
use idem::fingerprint::{Rules, fingerprint, normalize_text, write_canonical};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fn canonical(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    write_canonical(v, &mut out).expect("writing to a Vec cannot fail");
    out
}

/// A route target from its config form, so that fields the config gains
/// later (with their defaults) do not break this target.
fn target(v: Value) -> TargetConfig {
    serde_json::from_value(v).expect("a valid target")
}

fn check_fingerprints(original: &Value, reparsed: &Value) {
    let (Value::Object(a), Value::Object(b)) = (original, reparsed) else {
        return;
    };
    let targets = [target(
        serde_json::json!({"provider": "p", "model": "m", "version": "1"}),
    )];
    for normalize in [Normalize::None, Normalize::Whitespace, Normalize::Casefold] {
        for scope in [Scope::Tenant, Scope::User] {
            let rules = Rules {
                tenant: "t",
                route: "r",
                targets: &targets,
                normalize,
                scope,
                ignore_fields: &[],
                kinds: &[],
                contract: None,
                dialect: idem::dialect::Dialect::Chat,
                headers: &idem::dialect::Forwarded::default(),
            };
            assert_eq!(
                fingerprint(a, None, &rules),
                fingerprint(b, None, &rules),
                "{normalize:?} {scope:?}: the canonical form changed the fingerprint"
            );
        }
    }
}

fn check_normalization(text: &str) {
    for mode in [Normalize::None, Normalize::Whitespace, Normalize::Casefold] {
        let once = normalize_text(text, mode);
        let twice = normalize_text(&once, mode);
        assert_eq!(once, twice, "{mode:?} is not idempotent on {text:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<Value>(data) else {
        if let Ok(text) = std::str::from_utf8(data) {
            check_normalization(text);
        }
        return;
    };
    let first = canonical(&value);
    let reparsed: Value = serde_json::from_slice(&first).unwrap_or_else(|e| {
        panic!(
            "canonical form is not JSON ({e}): {}",
            String::from_utf8_lossy(&first)
        )
    });
    let second = canonical(&reparsed);
    assert_eq!(
        first,
        second,
        "canonical form not stable under re-parse: {} then {}",
        String::from_utf8_lossy(&first),
        String::from_utf8_lossy(&second)
    );
    check_fingerprints(&value, &reparsed);
    if let Value::String(text) = &value {
        check_normalization(text);
    }
});
