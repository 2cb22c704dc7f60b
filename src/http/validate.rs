//! Request validation: nothing goes upstream until the body has been read
//! within its size limit, checked for nesting depth, parsed, and its known
//! fields checked for type and range. Each rejection names the offending
//! parameter in the OpenAI error object's `param`.

use std::sync::Arc;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{Map, Value};

use super::error::ApiError;

/// Limits from `[server]`.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_body_bytes: usize,
    pub max_json_depth: usize,
    pub max_messages: usize,
    /// Most JSON values in a body (`server.max_json_values`).
    pub max_json_values: usize,
}

/// Reads a request body, refusing more than `limit` bytes with 413.
pub async fn read_body(
    body: Body,
    content_length: Option<u64>,
    limit: usize,
) -> Result<Bytes, ApiError> {
    if content_length.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(ApiError::PayloadTooLarge { limit })
        }
        Err(_) => Err(ApiError::bad_request(
            "the request body could not be read",
            "invalid_body",
            None,
        )),
    }
}

/// Parses a JSON object body after checking its nesting depth and how
/// many values it holds: what parsing costs is then a small multiple of
/// the body's bytes, whatever it is made of (a body of a million `{"a":1}`
/// would take over 100 times its size).
pub fn parse_object(bytes: &[u8], limits: &Limits) -> Result<Map<String, Value>, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty",
            "invalid_json",
            None,
        ));
    }
    match scan(bytes, limits.max_json_depth, limits.max_json_values) {
        Scan::Fits => {}
        Scan::TooDeep => {
            return Err(ApiError::bad_request(
                format!(
                    "the request body is nested deeper than {} levels (server.max_json_depth)",
                    limits.max_json_depth
                ),
                "nesting_too_deep",
                None,
            ));
        }
        Scan::TooManyValues => {
            return Err(ApiError::bad_request(
                format!(
                    "the request body holds more than {} JSON values (server.max_json_values)",
                    limits.max_json_values
                ),
                "too_many_json_values",
                None,
            ));
        }
    }
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request(
            "the request body must be a JSON object",
            "invalid_type",
            None,
        )),
        Err(e) => Err(ApiError::bad_request(
            format!("the request body is not valid JSON: {e}"),
            "invalid_json",
            None,
        )),
    }
}

/// What [`scan`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    Fits,
    TooDeep,
    TooManyValues,
}

/// True when brackets nest deeper than `max` (strings are skipped).
pub fn exceeds_depth(bytes: &[u8], max: usize) -> bool {
    scan(bytes, max, usize::MAX) == Scan::TooDeep
}

/// One pass over the bytes before the parser, so that a hostile body
/// makes it neither recurse nor allocate: brackets nesting deeper than
/// `max_depth`, or more than `max_values` values (each object, array,
/// string, number and literal, object keys included: a value starts at the
/// first byte after `{`, `[`, `,` or `:` that is not blank or a closing
/// bracket, and at the body's first byte).
pub fn scan(bytes: &[u8], max_depth: usize, max_values: usize) -> Scan {
    let mut depth = 0usize;
    let mut values = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    // The next byte that is not blank starts a value.
    let mut expecting = true;
    for &b in bytes {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        if b.is_ascii_whitespace() {
            continue;
        }
        if expecting && b != b']' && b != b'}' {
            values += 1;
            if values > max_values {
                return Scan::TooManyValues;
            }
        }
        expecting = false;
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max_depth {
                    return Scan::TooDeep;
                }
                expecting = true;
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' | b':' => expecting = true,
            _ => {}
        }
    }
    Scan::Fits
}

/// A checked request of any dialect: what routing, the fingerprint and
/// the rendering of its answer need of it.
#[derive(Debug, Clone)]
pub struct ChatRequest {
    pub body: Arc<Map<String, Value>>,
    pub model: String,
    pub stream: bool,
    /// A streamed chat asker's `stream_options.include_usage`.
    pub include_usage: bool,
}

const ROLES: &[&str] = &[
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
];

fn invalid(param: &str, message: String) -> ApiError {
    ApiError::bad_request(message, "invalid_value", Some(param))
}

fn wrong_type(param: &str, expected: &str) -> ApiError {
    ApiError::bad_request(
        format!("`{param}` must be {expected}"),
        "invalid_type",
        Some(param),
    )
}

fn number_in(body: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<(), ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if x.is_finite() && (lo..=hi).contains(&x) {
                Ok(())
            } else {
                Err(invalid(
                    key,
                    format!("`{key}` must be between {lo} and {hi}"),
                ))
            }
        }
        Some(_) => Err(wrong_type(key, "a number")),
    }
}

fn integer_in(body: &Map<String, Value>, key: &str, lo: i64, hi: i64) -> Result<(), ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(x) if (lo..=hi).contains(&x) => Ok(()),
            Some(_) => Err(invalid(
                key,
                format!("`{key}` must be between {lo} and {hi}"),
            )),
            None if n.is_u64() => Err(invalid(
                key,
                format!("`{key}` must be between {lo} and {hi}"),
            )),
            None => Err(wrong_type(key, "an integer")),
        },
        Some(_) => Err(wrong_type(key, "an integer")),
    }
}

fn of_type(
    body: &Map<String, Value>,
    key: &str,
    ok: fn(&Value) -> bool,
    expected: &str,
) -> Result<(), ApiError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(()),
        Some(v) if ok(v) => Ok(()),
        Some(_) => Err(wrong_type(key, expected)),
    }
}

/// Checks a chat completion body. Unknown fields pass through untouched
/// (providers add parameters faster than gateways learn them).
pub fn chat_request(body: Map<String, Value>, limits: &Limits) -> Result<ChatRequest, ApiError> {
    let model = model_of(&body)?;
    let messages = match body.get("messages") {
        Some(Value::Array(m)) => m,
        Some(_) => return Err(wrong_type("messages", "an array")),
        None => {
            return Err(ApiError::bad_request(
                "`messages` is required",
                "missing_required_parameter",
                Some("messages"),
            ));
        }
    };
    if messages.is_empty() {
        return Err(invalid("messages", "`messages` must not be empty".into()));
    }
    if messages.len() > limits.max_messages {
        return Err(invalid(
            "messages",
            format!("`messages` has more than {} entries", limits.max_messages),
        ));
    }
    for (i, m) in messages.iter().enumerate() {
        check_message(i, m)?;
    }
    number_in(&body, "temperature", 0.0, 2.0)?;
    number_in(&body, "top_p", 0.0, 1.0)?;
    number_in(&body, "presence_penalty", -2.0, 2.0)?;
    number_in(&body, "frequency_penalty", -2.0, 2.0)?;
    integer_in(&body, "n", 1, 128)?;
    integer_in(&body, "max_tokens", 1, 100_000_000)?;
    integer_in(&body, "max_completion_tokens", 1, 100_000_000)?;
    integer_in(&body, "top_logprobs", 0, 20)?;
    integer_in(&body, "seed", i64::MIN, i64::MAX)?;
    of_type(&body, "stream", Value::is_boolean, "a boolean")?;
    of_type(&body, "logprobs", Value::is_boolean, "a boolean")?;
    of_type(&body, "store", Value::is_boolean, "a boolean")?;
    of_type(&body, "parallel_tool_calls", Value::is_boolean, "a boolean")?;
    of_type(&body, "stream_options", Value::is_object, "an object")?;
    of_type(&body, "logit_bias", Value::is_object, "an object")?;
    of_type(&body, "response_format", Value::is_object, "an object")?;
    of_type(&body, "metadata", Value::is_object, "an object")?;
    of_type(&body, "tools", Value::is_array, "an array")?;
    of_type(&body, "user", Value::is_string, "a string")?;
    of_type(&body, "reasoning_effort", Value::is_string, "a string")?;
    of_type(&body, "service_tier", Value::is_string, "a string")?;
    of_type(
        &body,
        "tool_choice",
        |v| v.is_string() || v.is_object(),
        "a string or an object",
    )?;
    match body.get("stop") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(Value::Array(a)) if a.len() <= 4 && a.iter().all(Value::is_string) => {}
        Some(_) => {
            return Err(wrong_type(
                "stop",
                "a string or an array of up to 4 strings",
            ));
        }
    }
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    Ok(ChatRequest {
        body: Arc::new(body),
        model,
        stream,
        include_usage,
    })
}

/// The `model` of a request of any dialect.
fn model_of(body: &Map<String, Value>) -> Result<String, ApiError> {
    match body.get("model") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => Ok(s.clone()),
        Some(Value::String(_)) => Err(invalid("model", "`model` must be 1..256 characters".into())),
        Some(_) => Err(wrong_type("model", "a string")),
        None => Err(ApiError::bad_request(
            "`model` is required",
            "missing_required_parameter",
            Some("model"),
        )),
    }
}

/// Checks a request of Anthropic's Messages API (or of its token count)
/// as far as a gateway must before it routes, fingerprints and forwards
/// it: `model`, `messages` (a non-empty array within the limit),
/// `max_tokens` (a positive integer; a count takes none), `stream` (a
/// boolean). Everything else goes to the target as it came, whose API
/// judges it (a target of another dialect: its translation).
pub fn messages_request(
    body: Map<String, Value>,
    count: bool,
    limits: &Limits,
) -> Result<ChatRequest, ApiError> {
    let model = model_of(&body)?;
    match body.get("messages") {
        Some(Value::Array(m)) if m.is_empty() => {
            return Err(invalid("messages", "`messages` must not be empty".into()));
        }
        Some(Value::Array(m)) if m.len() > limits.max_messages => {
            return Err(invalid(
                "messages",
                format!("`messages` has more than {} entries", limits.max_messages),
            ));
        }
        Some(Value::Array(_)) => {}
        Some(_) => return Err(wrong_type("messages", "an array")),
        None => {
            return Err(ApiError::bad_request(
                "`messages` is required",
                "missing_required_parameter",
                Some("messages"),
            ));
        }
    }
    if !count {
        match body.get("max_tokens") {
            Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n > 0) => {}
            Some(_) => {
                return Err(invalid(
                    "max_tokens",
                    "`max_tokens` must be a positive integer".into(),
                ));
            }
            None => {
                return Err(ApiError::bad_request(
                    "`max_tokens` is required",
                    "missing_required_parameter",
                    Some("max_tokens"),
                ));
            }
        }
    }
    of_type(&body, "stream", Value::is_boolean, "a boolean")?;
    let stream = !count && body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    Ok(ChatRequest {
        body: Arc::new(body),
        model,
        stream,
        include_usage: false,
    })
}

/// Checks a request of OpenAI's Responses API as far as a gateway must:
/// `model`, `input` (a string, or an array of items within the limit;
/// optional when it continues a stored response), `stream` and `store`
/// (booleans), `previous_response_id` (a string), and the ranges and types
/// of the sampling and shape fields, each named as the client wrote it.
pub fn responses_request(
    body: Map<String, Value>,
    limits: &Limits,
) -> Result<ChatRequest, ApiError> {
    let model = model_of(&body)?;
    let continues = !matches!(body.get("previous_response_id"), None | Some(Value::Null));
    match body.get("input") {
        Some(Value::String(_)) => {}
        Some(Value::Array(items)) if items.len() > limits.max_messages => {
            return Err(invalid(
                "input",
                format!("`input` has more than {} items", limits.max_messages),
            ));
        }
        Some(Value::Array(_)) => {}
        None | Some(Value::Null) if continues => {}
        None | Some(Value::Null) => {
            return Err(ApiError::bad_request(
                "`input` is required",
                "missing_required_parameter",
                Some("input"),
            ));
        }
        Some(_) => return Err(wrong_type("input", "a string or an array of items")),
    }
    // Checked here, under the Responses names the client wrote, never as
    // the chat fields a translation would make of them.
    number_in(&body, "temperature", 0.0, 2.0)?;
    number_in(&body, "top_p", 0.0, 1.0)?;
    integer_in(&body, "max_output_tokens", 1, 100_000_000)?;
    integer_in(&body, "top_logprobs", 0, 20)?;
    of_type(&body, "stream", Value::is_boolean, "a boolean")?;
    of_type(&body, "store", Value::is_boolean, "a boolean")?;
    of_type(&body, "parallel_tool_calls", Value::is_boolean, "a boolean")?;
    of_type(&body, "previous_response_id", Value::is_string, "a string")?;
    of_type(
        &body,
        "instructions",
        |v| v.is_string() || v.is_array(),
        "a string or an array of items",
    )?;
    of_type(&body, "tools", Value::is_array, "an array")?;
    of_type(&body, "metadata", Value::is_object, "an object")?;
    of_type(&body, "text", Value::is_object, "an object")?;
    of_type(&body, "reasoning", Value::is_object, "an object")?;
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    Ok(ChatRequest {
        body: Arc::new(body),
        model,
        stream,
        include_usage: false,
    })
}

/// Checks the shape of a `POST /v1/jobs` body, `{"request": {..},
/// "metadata": {..}}`: returns the chat completion body (still to be checked
/// by [`chat_request`]) and the metadata, if any. Unknown fields are refused.
pub fn job_body(
    mut outer: Map<String, Value>,
) -> Result<(Map<String, Value>, Option<Value>), ApiError> {
    let request = match outer.remove("request") {
        Some(Value::Object(r)) => r,
        Some(_) => return Err(wrong_type("request", "an object")),
        None => {
            return Err(ApiError::bad_request(
                "`request` (a chat completion body) is required",
                "missing_required_parameter",
                Some("request"),
            ));
        }
    };
    let metadata = match outer.remove("metadata") {
        None | Some(Value::Null) => None,
        Some(m @ Value::Object(_)) => Some(m),
        Some(_) => return Err(wrong_type("metadata", "an object")),
    };
    if let Some(extra) = outer.keys().next() {
        return Err(ApiError::bad_request(
            format!("unknown field `{extra}`"),
            "unknown_parameter",
            Some(extra),
        ));
    }
    Ok((request, metadata))
}

fn check_message(i: usize, m: &Value) -> Result<(), ApiError> {
    let at = |k: &str| format!("messages[{i}].{k}");
    let Value::Object(m) = m else {
        return Err(wrong_type(&format!("messages[{i}]"), "an object"));
    };
    match m.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => {}
        Some(Value::String(r)) => {
            let p = at("role");
            return Err(invalid(
                &p,
                format!("`{p}` must be one of {}, not {r:?}", ROLES.join(", ")),
            ));
        }
        Some(_) => return Err(wrong_type(&at("role"), "a string")),
        None => {
            return Err(ApiError::bad_request(
                format!("`{}` is required", at("role")),
                "missing_required_parameter",
                Some(&at("role")),
            ));
        }
    }
    match m.get("content") {
        None | Some(Value::Null) | Some(Value::String(_)) => {}
        Some(Value::Array(parts)) => {
            for (j, part) in parts.iter().enumerate() {
                let ok = part
                    .as_object()
                    .and_then(|p| p.get("type"))
                    .is_some_and(Value::is_string);
                if !ok {
                    return Err(wrong_type(
                        &format!("messages[{i}].content[{j}]"),
                        "an object with a string `type`",
                    ));
                }
            }
        }
        Some(_) => {
            return Err(wrong_type(
                &at("content"),
                "a string, an array of parts, or null",
            ));
        }
    }
    if let Some(v) = m.get("name")
        && !v.is_string()
    {
        return Err(wrong_type(&at("name"), "a string"));
    }
    if let Some(v) = m.get("tool_calls")
        && !v.is_array()
    {
        return Err(wrong_type(&at("tool_calls"), "an array"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_body_bytes: 1 << 20,
        max_json_depth: 64,
        max_messages: 100,
        max_json_values: 1000,
    };

    fn check(text: &str) -> Result<ChatRequest, ApiError> {
        chat_request(parse_object(text.as_bytes(), &LIMITS)?, &LIMITS)
    }

    fn param_of(r: Result<ChatRequest, ApiError>) -> (String, Option<String>) {
        match r {
            Err(ApiError::BadRequest { code, param, .. }) => (code.to_string(), param),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn depth_scan_ignores_brackets_in_strings() {
        assert!(!exceeds_depth(br#"{"a": "[[[[[[[[[[[[[[[[[[[[[[[["}"#, 3));
        assert!(exceeds_depth(b"[[[[]]]]", 3));
        assert!(!exceeds_depth(br#"{"a":"\"[[[[["}"#, 2));
        let deep = "[".repeat(10_000);
        assert!(exceeds_depth(deep.as_bytes(), 64));
    }

    /// Every value counts once, keys included, whatever the spacing; what
    /// is inside a string does not count; empty containers count once.
    #[test]
    fn the_scan_counts_every_value_and_key() {
        let count = |text: &str| {
            (1..100)
                .find(|&n| scan(text.as_bytes(), 64, n) == Scan::Fits)
                .unwrap()
        };
        assert_eq!(count(r#"{}"#), 1);
        assert_eq!(count(r#"{"a":1}"#), 3);
        assert_eq!(
            count(r#" { "a" : [ 1 , "x,y:{" , true , null , { } , [ ] ] } "#),
            9
        );
        assert_eq!(count(r#"{"a":"\"{[,:","b":-1.5e3}"#), 5);
        assert_eq!(count(r#"[[],[[]]]"#), 4);
        // Past the budget: refused with a 400 naming the setting.
        let body = format!("{{\"x\":[{}1]}}", "{\"a\":1},".repeat(400));
        match parse_object(body.as_bytes(), &LIMITS) {
            Err(ApiError::BadRequest { code, message, .. }) => {
                assert_eq!(code, "too_many_json_values");
                assert!(message.contains("server.max_json_values"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let body = format!("{{\"x\":[{}1]}}", "{\"a\":1},".repeat(300));
        assert!(parse_object(body.as_bytes(), &LIMITS).is_ok());
    }

    #[test]
    fn a_good_request_passes_and_unknown_fields_stay() {
        let r = check(r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true},"x_vendor":1}"#).unwrap();
        assert!(r.stream && r.include_usage);
        assert_eq!(r.body["x_vendor"], 1);
    }

    #[test]
    fn bad_requests_name_their_parameter() {
        let cases = [
            (
                r#"{"messages":[{"role":"user","content":"x"}]}"#,
                "missing_required_parameter",
                Some("model"),
            ),
            (
                r#"{"model":1,"messages":[]}"#,
                "invalid_type",
                Some("model"),
            ),
            (
                r#"{"model":"m","messages":[]}"#,
                "invalid_value",
                Some("messages"),
            ),
            (
                r#"{"model":"m","messages":"hi"}"#,
                "invalid_type",
                Some("messages"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"king","content":"x"}]}"#,
                "invalid_value",
                Some("messages[0].role"),
            ),
            (
                r#"{"model":"m","messages":[{"content":"x"}]}"#,
                "missing_required_parameter",
                Some("messages[0].role"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":5}]}"#,
                "invalid_type",
                Some("messages[0].content"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":-1}"#,
                "invalid_value",
                Some("temperature"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
                "invalid_type",
                Some("temperature"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":0}"#,
                "invalid_value",
                Some("n"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":1.5}"#,
                "invalid_type",
                Some("n"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
                "invalid_type",
                Some("stream"),
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":[1]}"#,
                "invalid_type",
                Some("stop"),
            ),
            (r#"[1,2]"#, "invalid_type", None),
            (r#"{"model":"m""#, "invalid_json", None),
            ("", "invalid_json", None),
        ];
        for (text, code, param) in cases {
            let (c, p) = param_of(check(text));
            assert_eq!((c.as_str(), p.as_deref()), (code, param), "{text}");
        }
    }
}
