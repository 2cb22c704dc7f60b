//! Anthropic's token count (`POST /v1/messages/count_tokens`) as an answer:
//! `{"input_tokens": N}`, coalesced and cached like any other (a count is
//! the same for the same request and target).

use serde_json::{Value, json};

use super::Unfit;

/// A count's verdict: an object with a whole `input_tokens`.
pub fn check_plain(body: &[u8]) -> Result<Value, Unfit> {
    if body.is_empty() {
        return Err(Unfit::Empty);
    }
    let v: Value = serde_json::from_slice(body).map_err(Unfit::NotJson)?;
    if v.get("type").and_then(Value::as_str) == Some("error") {
        return Err(Unfit::ErrorObject);
    }
    match v.get("input_tokens").and_then(Value::as_u64) {
        Some(_) => Ok(v),
        None => Err(Unfit::NotA("a token count")),
    }
}

/// The answer idem writes for a count it made itself (a target whose API
/// has no count, counted by its model's tokenizer).
pub fn answer(input_tokens: u32) -> Value {
    json!({"input_tokens": input_tokens})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_an_object_with_input_tokens() {
        assert!(check_plain(br#"{"input_tokens": 12}"#).is_ok());
        assert!(check_plain(answer(3).to_string().as_bytes()).is_ok());
        assert!(check_plain(br#"{"input_tokens": "12"}"#).is_err());
        assert!(check_plain(br#"{"type":"error","error":{}}"#).is_err());
        assert!(check_plain(b"").is_err());
    }
}
