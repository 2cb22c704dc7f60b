//! The contract checker: does one assistant answer satisfy a route's
//! contract? Used on every answer of a contract route (before it can
//! complete a job, enter the cache or reach a follower) and by
//! certification, which also compares the case's expected values.
//!
//! The checks run in a fixed order, so the first violation is stable and
//! reports can name it: the content must be JSON; then `required` keys,
//! extra top-level keys, the JSON Schema, the `[checks.<key>]` rules and,
//! for certification, the expectations. A violation carries the JSON
//! pointer of the offending value inside the assistant content (`""` is the
//! whole content).

use std::collections::BTreeSet;
use std::fmt;

use serde::Serialize;
use serde_json::{Map, Value};

/// One way an answer broke a contract.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Violation {
    /// JSON pointer into the assistant content (`""`: the whole content).
    pub path: String,
    /// Which rule: `not_json`, `no_content`, `not_object`, `required`,
    /// `extra_key`, `schema`, `enum`, `max_length`, `pattern`, `expect`.
    pub rule: &'static str,
    pub message: String,
}

impl Violation {
    pub fn new(path: impl Into<String>, rule: &'static str, message: impl Into<String>) -> Self {
        Violation {
            path: path.into(),
            rule,
            message: message.into(),
        }
    }

    fn at_key(key: &str, rule: &'static str, message: impl Into<String>) -> Self {
        Violation::new(pointer(key), rule, message)
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = if self.path.is_empty() {
            "(whole answer)"
        } else {
            &self.path
        };
        write!(f, "{path}: {}", self.message)
    }
}

/// The JSON pointer of a top-level key (RFC 6901 escaping).
fn pointer(key: &str) -> String {
    format!("/{}", key.replace('~', "~0").replace('/', "~1"))
}

/// `[checks.<key>]`.
#[derive(Debug)]
pub(super) struct KeyCheck {
    pub(super) key: String,
    pub(super) allowed: Option<Vec<Value>>,
    pub(super) max_length: Option<usize>,
    pub(super) pattern: Option<regex::Regex>,
}

/// A contract's compiled answer rules.
#[derive(Debug)]
pub(super) struct Rules {
    pub(super) validator: Option<jsonschema::Validator>,
    pub(super) required: Vec<String>,
    /// With `forbid_extra_top_level_keys`: the keys allowed at the top.
    pub(super) forbid_extra: Option<BTreeSet<String>>,
    pub(super) checks: Vec<KeyCheck>,
}

impl Rules {
    /// Checks one assistant content; returns it parsed when it passes.
    pub(super) fn check(&self, content: &str) -> Result<Value, Violation> {
        // The client receives the content as it is: prose around the JSON
        // (or a Markdown fence) would break its parser, so it breaks ours.
        let value: Value = serde_json::from_str(content.trim()).map_err(|e| {
            Violation::new(
                "",
                "not_json",
                format!("the content is not JSON ({e}): {}", preview(content)),
            )
        })?;
        let needs_object =
            !self.required.is_empty() || self.forbid_extra.is_some() || !self.checks.is_empty();
        let object = value.as_object();
        if needs_object && object.is_none() {
            return Err(Violation::new(
                "",
                "not_object",
                format!("expected a JSON object, got {}", kind(&value)),
            ));
        }
        if let Some(obj) = object {
            for key in &self.required {
                if !obj.contains_key(key) {
                    return Err(Violation::at_key(
                        key,
                        "required",
                        format!("required key \"{key}\" is missing"),
                    ));
                }
            }
            if let Some(allowed) = &self.forbid_extra
                && let Some(extra) = obj.keys().find(|k| !allowed.contains(*k))
            {
                return Err(Violation::at_key(
                    extra,
                    "extra_key",
                    format!(
                        "unexpected top-level key \"{extra}\" (the contract forbids extra keys)"
                    ),
                ));
            }
        }
        if let Some(validator) = &self.validator
            && let Some(e) = validator.iter_errors(&value).next()
        {
            return Err(Violation::new(
                e.instance_path().as_str().to_string(),
                "schema",
                e.to_string(),
            ));
        }
        if let Some(obj) = object {
            for c in &self.checks {
                if let Some(v) = obj.get(&c.key) {
                    c.check(v)?;
                }
            }
        }
        Ok(value)
    }
}

impl KeyCheck {
    fn check(&self, v: &Value) -> Result<(), Violation> {
        let key = &self.key;
        if let Some(allowed) = &self.allowed
            && !allowed.iter().any(|a| json_eq(a, v))
        {
            let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
            return Err(Violation::at_key(
                key,
                "enum",
                format!("{v} is not one of [{}]", list.join(", ")),
            ));
        }
        if let Some(max) = self.max_length {
            let len = match v {
                Value::String(s) => s.chars().count(),
                Value::Array(a) => a.len(),
                other => {
                    return Err(Violation::at_key(
                        key,
                        "max_length",
                        format!("expected a string or an array, got {}", kind(other)),
                    ));
                }
            };
            if len > max {
                return Err(Violation::at_key(
                    key,
                    "max_length",
                    format!("length {len} is above the maximum {max}"),
                ));
            }
        }
        if let Some(re) = &self.pattern {
            let Value::String(s) = v else {
                return Err(Violation::at_key(
                    key,
                    "pattern",
                    format!("expected a string, got {}", kind(v)),
                ));
            };
            if !re.is_match(s) {
                return Err(Violation::at_key(
                    key,
                    "pattern",
                    format!("{} does not match /{}/", preview(s), re.as_str()),
                ));
            }
        }
        Ok(())
    }
}

/// Every choice of a chat completion must carry content that passes.
pub(super) fn check_completion(rules: &Rules, completion: &Value) -> Result<(), Violation> {
    let choices = completion
        .get("choices")
        .and_then(Value::as_array)
        .filter(|c| !c.is_empty())
        .ok_or_else(|| Violation::new("", "no_content", "the answer has no choices"))?;
    let several = choices.len() > 1;
    for (i, choice) in choices.iter().enumerate() {
        let content = choice
            .pointer("/message/content")
            .and_then(Value::as_str)
            .ok_or_else(|| {
                Violation::new("", "no_content", "the answer has no assistant text content")
            })?;
        rules.check(content).map_err(|mut v| {
            if several {
                v.message = format!("choice {i}: {}", v.message);
            }
            v
        })?;
    }
    Ok(())
}

/// A case's `expect`: each key (or JSON pointer) holds the expected value.
pub(super) fn expectations(expect: &Map<String, Value>, value: &Value) -> Result<(), Violation> {
    for (key, want) in expect {
        let path = if key.starts_with('/') {
            key.clone()
        } else {
            pointer(key)
        };
        match value.pointer(&path) {
            Some(got) if json_eq(got, want) => {}
            Some(got) => {
                return Err(Violation::new(
                    path,
                    "expect",
                    format!("expected {want}, got {got}"),
                ));
            }
            None => {
                return Err(Violation::new(
                    path,
                    "expect",
                    format!("expected {want}, but the key is missing"),
                ));
            }
        }
    }
    Ok(())
}

/// JSON equality where `1` equals `1.0`.
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_i64(), y.as_i64()) {
            (Some(i), Some(j)) => i == j,
            _ => match (x.as_u64(), y.as_u64()) {
                (Some(i), Some(j)) => i == j,
                _ => x.as_f64() == y.as_f64(),
            },
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(a, b)| json_eq(a, b))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The first 60 characters of a text, quoted, for messages.
fn preview(s: &str) -> String {
    let mut out: String = s.chars().take(60).collect();
    if s.chars().count() > 60 {
        out.push('…');
    }
    format!("{out:?}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rules(
        schema: Option<Value>,
        required: &[&str],
        forbid: bool,
        checks: Vec<KeyCheck>,
    ) -> Rules {
        let mut known: BTreeSet<String> = required.iter().map(|s| s.to_string()).collect();
        known.extend(checks.iter().map(|c| c.key.clone()));
        if let Some(p) = schema.as_ref().and_then(|s| s["properties"].as_object()) {
            known.extend(p.keys().cloned());
        }
        Rules {
            validator: schema.map(|s| jsonschema::validator_for(&s).unwrap()),
            required: required.iter().map(|s| s.to_string()).collect(),
            forbid_extra: forbid.then_some(known),
            checks,
        }
    }

    fn check(key: &str) -> KeyCheck {
        KeyCheck {
            key: key.into(),
            allowed: None,
            max_length: None,
            pattern: None,
        }
    }

    fn support() -> Rules {
        rules(
            Some(json!({
                "type": "object",
                "properties": {
                    "answer": {"type": "string", "minLength": 1},
                    "category": {"type": "string"},
                    "tags": {"type": "array", "items": {"type": "string"}}
                }
            })),
            &["answer", "category"],
            true,
            vec![KeyCheck {
                allowed: Some(vec![json!("billing"), json!("delivery"), json!("other")]),
                ..check("category")
            }],
        )
    }

    #[test]
    fn a_good_answer_passes() {
        let v = support()
            .check(r#" {"answer": "on its way", "category": "delivery"} "#)
            .unwrap();
        assert_eq!(v["category"], "delivery");
    }

    #[test]
    fn prose_is_not_json() {
        let e = support()
            .check("Sure! Your order 1234 is on its way.")
            .unwrap_err();
        assert_eq!((e.path.as_str(), e.rule), ("", "not_json"));
        assert!(e.message.contains("Sure!"), "{e}");
        let fenced = support()
            .check("```json\n{\"answer\": \"a\", \"category\": \"other\"}\n```")
            .unwrap_err();
        assert_eq!(fenced.rule, "not_json");
        let e = support().check("[1, 2]").unwrap_err();
        assert_eq!(e.rule, "not_object");
    }

    #[test]
    fn required_keys_are_named() {
        let e = support().check(r#"{"answer": "x"}"#).unwrap_err();
        assert_eq!((e.path.as_str(), e.rule), ("/category", "required"));
    }

    #[test]
    fn an_extra_top_level_key_is_named() {
        let e = support()
            .check(r#"{"answer": "x", "category": "other", "confidence": 0.9}"#)
            .unwrap_err();
        assert_eq!((e.path.as_str(), e.rule), ("/confidence", "extra_key"));
        // Without the rule, extra keys pass.
        let lax = rules(None, &["answer"], false, vec![]);
        assert!(lax.check(r#"{"answer": "x", "confidence": 0.9}"#).is_ok());
    }

    #[test]
    fn the_schema_violation_carries_its_json_path() {
        let e = support()
            .check(r#"{"answer": "x", "category": "other", "tags": ["a", 7]}"#)
            .unwrap_err();
        assert_eq!((e.path.as_str(), e.rule), ("/tags/1", "schema"));
        let e = support()
            .check(r#"{"answer": "", "category": "other"}"#)
            .unwrap_err();
        assert_eq!(e.path, "/answer");
    }

    #[test]
    fn enum_values_are_checked() {
        let e = support()
            .check(r#"{"answer": "x", "category": "refund"}"#)
            .unwrap_err();
        assert_eq!((e.path.as_str(), e.rule), ("/category", "enum"));
        assert!(
            e.message.contains("\"refund\"") && e.message.contains("\"billing\""),
            "{e}"
        );
        let numbers = rules(
            None,
            &[],
            false,
            vec![KeyCheck {
                allowed: Some(vec![json!(1), json!(2)]),
                ..check("level")
            }],
        );
        assert!(numbers.check(r#"{"level": 1.0}"#).is_ok(), "1.0 == 1");
        assert!(numbers.check(r#"{"level": 3}"#).is_err());
    }

    #[test]
    fn max_length_counts_characters_and_items() {
        let r = rules(
            None,
            &[],
            false,
            vec![
                KeyCheck {
                    max_length: Some(5),
                    ..check("answer")
                },
                KeyCheck {
                    max_length: Some(1),
                    ..check("tags")
                },
            ],
        );
        assert!(r.check(r#"{"answer": "héllo"}"#).is_ok(), "5 characters");
        let e = r.check(r#"{"answer": "héllo!"}"#).unwrap_err();
        assert_eq!((e.path.as_str(), e.rule), ("/answer", "max_length"));
        assert!(e.message.contains('6'), "{e}");
        assert_eq!(
            r.check(r#"{"tags": ["a", "b"]}"#).unwrap_err().path,
            "/tags"
        );
        assert_eq!(r.check(r#"{"answer": 5}"#).unwrap_err().rule, "max_length");
    }

    #[test]
    fn patterns_search_the_string() {
        let r = rules(
            None,
            &[],
            false,
            vec![KeyCheck {
                pattern: Some(regex::Regex::new(r"^ORD-\d{4}$").unwrap()),
                ..check("order")
            }],
        );
        assert!(r.check(r#"{"order": "ORD-1234"}"#).is_ok());
        let e = r.check(r#"{"order": "order 1234"}"#).unwrap_err();
        assert_eq!((e.path.as_str(), e.rule), ("/order", "pattern"));
        assert_eq!(r.check(r#"{"order": 1234}"#).unwrap_err().rule, "pattern");
    }

    #[test]
    fn the_first_violation_follows_the_documented_order() {
        // Missing key, extra key, schema and enum all broken: `required` is
        // reported first, then extra keys, then the schema, then checks.
        let r = support();
        let all = r#"{"answer": 5, "confidence": 1, "category": "refund"}"#;
        assert_eq!(r.check(all).unwrap_err().rule, "extra_key");
        let no_extra = r#"{"answer": 5, "category": "refund"}"#;
        assert_eq!(r.check(no_extra).unwrap_err().rule, "schema");
        let missing = r#"{"confidence": 1}"#;
        assert_eq!(r.check(missing).unwrap_err().rule, "required");
    }

    #[test]
    fn keys_with_slashes_are_escaped_in_paths() {
        let r = rules(None, &["a/b"], false, vec![]);
        assert_eq!(r.check("{}").unwrap_err().path, "/a~1b");
    }

    #[test]
    fn every_choice_must_pass() {
        let r = support();
        let completion = |contents: &[&str]| {
            let choices: Vec<Value> = contents
                .iter()
                .map(|c| json!({"message": {"role": "assistant", "content": c}}))
                .collect();
            json!({"choices": choices})
        };
        let good = r#"{"answer": "a", "category": "other"}"#;
        let bad = r#"{"answer": "a", "category": "nope"}"#;
        assert!(check_completion(&r, &completion(&[good, good])).is_ok());
        let e = check_completion(&r, &completion(&[good, bad])).unwrap_err();
        assert!(e.message.starts_with("choice 1:"), "{e}");
        let tool_call = json!({"choices": [{"message": {"role": "assistant", "content": null}}]});
        assert_eq!(
            check_completion(&r, &tool_call).unwrap_err().rule,
            "no_content"
        );
        assert_eq!(
            check_completion(&r, &json!({})).unwrap_err().rule,
            "no_content"
        );
    }

    #[test]
    fn expectations_compare_values_by_key_or_pointer() {
        let v = json!({"category": "delivery", "order": {"id": 1234}});
        let mut expect = Map::new();
        expect.insert("category".into(), json!("delivery"));
        expect.insert("/order/id".into(), json!(1234.0));
        assert!(expectations(&expect, &v).is_ok());
        expect.insert("category".into(), json!("billing"));
        let e = expectations(&expect, &v).unwrap_err();
        assert_eq!((e.path.as_str(), e.rule), ("/category", "expect"));
        assert!(e.message.contains("\"billing\"") && e.message.contains("\"delivery\""));
        let mut missing = Map::new();
        missing.insert("urgency".into(), json!("high"));
        assert!(
            expectations(&missing, &v)
                .unwrap_err()
                .message
                .contains("missing")
        );
    }
}
