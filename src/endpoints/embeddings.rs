//! Embeddings (`POST /v1/embeddings`) as tasks and upstream calls.
//!
//! Each input item is its own task: its own fingerprint (tenant, route,
//! targets, the item, `dimensions`, the user where the route's scope is
//! `user`, and any field idem does not know), its own flight and its own
//! cache entry. The items one request leads share one upstream call, whose
//! answer [`Embeddings::split`] cuts into one answer per item. An item's
//! answer keeps the vector as the provider sent it (a JSON array of
//! numbers), with its share of the call's tokens; `encoding_format` is a
//! rendering of it ([`Vector::render`]), never part of the task.

use std::sync::Arc;

use base64::Engine;
use bytes::Bytes;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::answer::{Answer, Failure};
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::flight::Wire;
use crate::outcome::Outcome;
use crate::prices::Tokens;
use crate::routes::{Route, Target};
use crate::translate::{Prepared, Refusal, Sendable};

/// The most items one request may carry (OpenAI's limit).
pub const MAX_ITEMS: usize = 2048;

/// The largest `dimensions` accepted.
pub const MAX_DIMENSIONS: u64 = 65_536;

/// How the client wants its vectors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// A JSON array of numbers (OpenAI's default).
    Float,
    /// The little-endian f32 bytes, base64 (standard alphabet, padded).
    Base64,
}

/// A request refused before anything is sent: the error object's
/// `message`, `code` and `param`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    pub message: String,
    pub code: &'static str,
    pub param: &'static str,
}

fn invalid(param: &'static str, message: impl Into<String>) -> Invalid {
    Invalid {
        message: message.into(),
        code: "invalid_value",
        param,
    }
}

fn wrong_type(param: &'static str, expected: &str) -> Invalid {
    Invalid {
        message: format!("`{param}` must be {expected}"),
        code: "invalid_type",
        param,
    }
}

/// A valid embeddings request, cut into its items' tasks.
#[derive(Debug)]
pub struct EmbeddingsRequest {
    /// The public model name (a route).
    pub model: String,
    /// Each item's own request: `input` (the item) and every other field of
    /// the request but `model` and `encoding_format`.
    pub items: Vec<Map<String, Value>>,
    pub encoding: Encoding,
    /// The request without `encoding_format`: what the request as a whole
    /// is fingerprinted by (its `Idem-Fingerprint` and log line).
    pub whole: Map<String, Value>,
}

/// Checks an embeddings body as OpenAI does: `input` a non-empty string, an
/// array of non-empty strings, an array of tokens (integers) or an array of
/// such arrays, at most [`MAX_ITEMS`] items; `model` a string; `dimensions`
/// a positive integer; `encoding_format` `float` or `base64`; `user` a
/// string. Other fields pass through (and join each item's task).
pub fn parse(mut body: Map<String, Value>) -> Result<EmbeddingsRequest, Invalid> {
    let model = match body.get("model") {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 256 => s.clone(),
        Some(Value::String(_)) => {
            return Err(invalid("model", "`model` must be 1..256 characters"));
        }
        Some(_) => return Err(wrong_type("model", "a string")),
        None => {
            return Err(Invalid {
                message: "`model` is required".into(),
                code: "missing_required_parameter",
                param: "model",
            });
        }
    };
    let encoding = match body.remove("encoding_format") {
        None | Some(Value::Null) => Encoding::Float,
        Some(Value::String(f)) if f == "float" => Encoding::Float,
        Some(Value::String(f)) if f == "base64" => Encoding::Base64,
        Some(_) => {
            return Err(invalid(
                "encoding_format",
                "`encoding_format` must be \"float\" or \"base64\"",
            ));
        }
    };
    match body.get("dimensions") {
        None | Some(Value::Null) => {}
        Some(v)
            if v.as_u64()
                .is_some_and(|d| (1..=MAX_DIMENSIONS).contains(&d)) => {}
        Some(Value::Number(_)) => {
            return Err(invalid(
                "dimensions",
                format!("`dimensions` must be an integer from 1 to {MAX_DIMENSIONS}"),
            ));
        }
        Some(_) => return Err(wrong_type("dimensions", "an integer")),
    }
    match body.get("user") {
        None | Some(Value::Null | Value::String(_)) => {}
        Some(_) => return Err(wrong_type("user", "a string")),
    }
    let inputs = items_of(body.get("input"))?;
    let mut shared = body.clone();
    shared.remove("model");
    shared.remove("input");
    let items = inputs
        .into_iter()
        .map(|item| {
            let mut one = shared.clone();
            one.insert("input".into(), item);
            one
        })
        .collect();
    Ok(EmbeddingsRequest {
        model,
        items,
        encoding,
        whole: body,
    })
}

/// The items of `input`.
fn items_of(input: Option<&Value>) -> Result<Vec<Value>, Invalid> {
    const SHAPE: &str = "`input` must be a non-empty string, an array of non-empty strings, \
                         an array of tokens (integers) or an array of such arrays";
    let input = match input {
        None | Some(Value::Null) => {
            return Err(Invalid {
                message: "`input` is required".into(),
                code: "missing_required_parameter",
                param: "input",
            });
        }
        Some(input) => input,
    };
    let items = match input {
        Value::String(text) if !text.is_empty() => vec![input.clone()],
        Value::Array(values) if !values.is_empty() && values.iter().all(is_token) => {
            vec![input.clone()]
        }
        Value::Array(values) if !values.is_empty() => {
            let strings = values
                .iter()
                .all(|v| v.as_str().is_some_and(|s| !s.is_empty()));
            let token_arrays = values.iter().all(|v| {
                v.as_array()
                    .is_some_and(|tokens| !tokens.is_empty() && tokens.iter().all(is_token))
            });
            if !(strings || token_arrays) {
                return Err(invalid("input", SHAPE));
            }
            values.clone()
        }
        _ => return Err(invalid("input", SHAPE)),
    };
    if items.len() > MAX_ITEMS {
        return Err(invalid(
            "input",
            format!("`input` has more than {MAX_ITEMS} items"),
        ));
    }
    Ok(items)
}

/// A token: a non-negative integer that fits in a u32.
fn is_token(value: &Value) -> bool {
    value.as_u64().is_some_and(|n| u32::try_from(n).is_ok())
}

/// The embeddings wire.
pub struct Embeddings;

/// The one [`Embeddings`] every embeddings flight refers to.
pub static EMBEDDINGS: Embeddings = Embeddings;

/// An upstream embeddings list, read without parsing its numbers.
#[derive(Deserialize)]
struct List<'a> {
    #[serde(borrow)]
    data: Vec<Item<'a>>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Item<'a> {
    #[serde(default)]
    index: Option<usize>,
    #[serde(borrow)]
    embedding: &'a RawValue,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
}

impl List<'_> {
    /// The vectors in the order of the call's items, or why not.
    fn ordered(&self, n: usize) -> Result<Vec<&RawValue>, String> {
        if self.data.len() != n {
            return Err(format!("{} embeddings for {n} items", self.data.len()));
        }
        let mut out: Vec<Option<&RawValue>> = vec![None; n];
        for (position, item) in self.data.iter().enumerate() {
            let i = item.index.unwrap_or(position);
            match out.get_mut(i) {
                Some(slot @ None) => *slot = Some(item.embedding),
                _ => return Err(format!("embedding index {i} is out of place")),
            }
        }
        out.into_iter()
            .map(|v| v.ok_or_else(|| "an item has no embedding".to_string()))
            .collect()
    }
}

impl Wire for Embeddings {
    fn dialect(&self) -> Dialect {
        Dialect::Embeddings
    }

    /// `{"model": <the target's>, "input": [the items...], "encoding_format":
    /// "float", ...}` with the fields the items share (they come from one
    /// request). Always floats upstream: every provider speaks them, and the
    /// cached vector serves either rendering.
    fn prepare(
        &self,
        _route: &Route,
        target: &Target,
        requests: &[Arc<Map<String, Value>>],
        forwarded: &Forwarded,
        _fp: &Fingerprint,
    ) -> Result<Prepared, Refusal> {
        if !target.provider.speaks(Dialect::Embeddings) {
            return Err(Refusal::at(
                "model",
                format!(
                    "provider {} ({}) has no embeddings API",
                    target.provider.name,
                    target.provider.kind.as_str()
                ),
            ));
        }
        let Some(first) = requests.first() else {
            return Err(Refusal::at("input", "no item to embed"));
        };
        let mut body = (**first).clone();
        let inputs: Vec<Value> = requests
            .iter()
            .map(|r| r.get("input").cloned().unwrap_or(Value::Null))
            .collect();
        body.insert("model".into(), Value::String(target.model.to_string()));
        body.insert("input".into(), Value::Array(inputs));
        body.insert("encoding_format".into(), json!("float"));
        Ok(Prepared::Send(Sendable {
            dialect: Dialect::Embeddings,
            // Serializing a Map of Values cannot fail.
            body: Bytes::from(serde_json::to_vec(&body).unwrap_or_default()),
            forwarded: forwarded.clone(),
            reply: None,
        }))
    }

    /// A 2xx must be an embeddings list with one vector per item.
    fn check(
        &self,
        answer: Answer,
        requests: &[Arc<Map<String, Value>>],
    ) -> Result<Answer, Box<Answer>> {
        let why = match serde_json::from_slice::<List<'_>>(&answer.body) {
            Ok(list) => match list.ordered(requests.len()) {
                Ok(vectors) => match vectors.iter().find_map(|v| Vector::read(v).err()) {
                    None => {
                        // Read here, where the list is parsed anyway: what
                        // the call spent.
                        answer.set_tokens(list.usage.as_ref().map(|u| Tokens {
                            input: u.prompt_tokens,
                            ..Tokens::default()
                        }));
                        return Ok(answer);
                    }
                    Some(why) => why,
                },
                Err(why) => why,
            },
            Err(e) => format!("not an embeddings list: {e}"),
        };
        tracing::warn!(provider = %answer.provider, why = %why, "upstream answer is not an embeddings list");
        let message = format!(
            "provider {} answered with something that is not an embeddings list: {why}",
            answer.provider
        );
        let mut bad = Answer::from_failure(
            Failure::BadAnswer,
            &message,
            answer.provider.clone(),
            answer.model.clone(),
        );
        bad.upstream_latency = answer.upstream_latency;
        Err(Box::new(bad))
    }

    /// One answer per item: its vector (see [`ItemAnswer`]) and its share
    /// of the call's tokens.
    fn split(&self, answer: Answer, requests: &[Arc<Map<String, Value>>]) -> Vec<Answer> {
        let Ok(list) = serde_json::from_slice::<List<'_>>(&answer.body) else {
            return vec![answer; requests.len()];
        };
        let Ok(vectors) = list.ordered(requests.len()) else {
            return vec![answer; requests.len()];
        };
        let total = list.usage.as_ref().map_or(0, |u| u.prompt_tokens);
        let weights: Vec<u64> = requests.iter().map(|r| weight(r.get("input"))).collect();
        let tokens = apportion(total, &weights);
        vectors
            .into_iter()
            .zip(tokens)
            .map(|(vector, tokens)| {
                let floats = match Vector::read(vector) {
                    Ok(Vector::Floats(text)) => Bytes::copy_from_slice(text.as_bytes()),
                    Ok(Vector::Base64(bytes)) => floats_text(&bytes),
                    Err(_) => Bytes::from_static(b"[]"),
                };
                let mut one = answer.clone();
                one.body = ItemAnswer::body(tokens, &floats);
                one.rendered = Default::default();
                one
            })
            .collect()
    }
}

/// An item's weight in its call's token count: a token array's length, a
/// string's characters (a fair share when the provider reports only the
/// call's total).
fn weight(input: Option<&Value>) -> u64 {
    match input {
        Some(Value::String(s)) => s.chars().count() as u64,
        Some(Value::Array(tokens)) => tokens.len() as u64,
        _ => 0,
    }
}

/// `total` split in proportion to `weights`, in whole tokens that add up
/// to `total` (largest remainders first).
pub fn apportion(total: u64, weights: &[u64]) -> Vec<u64> {
    let sum: u128 = weights.iter().map(|&w| u128::from(w)).sum();
    if sum == 0 {
        let n = weights.len().max(1) as u64;
        return (0..weights.len() as u64)
            .map(|i| total / n + u64::from(i < total % n))
            .collect();
    }
    let exact: Vec<(u64, u128)> = weights
        .iter()
        .map(|&w| {
            let share = u128::from(total) * u128::from(w);
            (u64::try_from(share / sum).unwrap_or(u64::MAX), share % sum)
        })
        .collect();
    let mut out: Vec<u64> = exact.iter().map(|(q, _)| *q).collect();
    let given: u64 = out.iter().sum();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| exact[b].1.cmp(&exact[a].1).then(a.cmp(&b)));
    for &i in order.iter().take(total.saturating_sub(given) as usize) {
        out[i] += 1;
    }
    out
}

/// A vector as a provider sent it.
enum Vector<'a> {
    /// A JSON array of numbers, its text as it came.
    Floats(&'a str),
    /// A base64 string, decoded.
    Base64(Vec<u8>),
}

impl<'a> Vector<'a> {
    fn read(raw: &'a RawValue) -> Result<Vector<'a>, String> {
        let text = raw.get();
        if text.starts_with('[') {
            // Checked once here, so a rendering never meets anything else.
            let numbers: Vec<f64> = serde_json::from_str(text)
                .map_err(|_| "an embedding is not an array of numbers".to_string())?;
            if numbers.is_empty() {
                return Err("an embedding is empty".into());
            }
            return Ok(Vector::Floats(text));
        }
        let encoded: String =
            serde_json::from_str(text).map_err(|_| "an embedding is neither".to_string())?;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_bytes())
            .map_err(|_| "an embedding is not base64".to_string())?;
        if bytes.is_empty() || bytes.len() % 4 != 0 {
            return Err("a base64 embedding is not a whole number of f32s".into());
        }
        Ok(Vector::Base64(bytes))
    }

    /// The vector as the client asked for it: the JSON array, or the
    /// base64 of its little-endian f32s.
    pub fn render(floats: &str, encoding: Encoding) -> Bytes {
        match encoding {
            Encoding::Float => Bytes::copy_from_slice(floats.as_bytes()),
            Encoding::Base64 => {
                let numbers: Vec<f64> = serde_json::from_str(floats).unwrap_or_default();
                let bytes: Vec<u8> = numbers
                    .iter()
                    .flat_map(|x| (*x as f32).to_le_bytes())
                    .collect();
                let text = base64::engine::general_purpose::STANDARD.encode(bytes);
                Bytes::from(Value::String(text).to_string())
            }
        }
    }
}

/// Little-endian f32 bytes as a JSON array of numbers.
fn floats_text(bytes: &[u8]) -> Bytes {
    let numbers: Vec<Value> = bytes
        .chunks_exact(4)
        .map(|c| {
            let x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            json!(x)
        })
        .collect();
    Bytes::from(Value::Array(numbers).to_string())
}

/// An item's answer body, as idem keeps it (in the caches, in Redis):
/// `{"tokens": <its share>, "embedding": [<numbers as the provider sent
/// them>]}`.
#[derive(Deserialize)]
pub struct ItemAnswer<'a> {
    pub tokens: u64,
    #[serde(borrow)]
    pub embedding: &'a RawValue,
}

impl ItemAnswer<'_> {
    fn body(tokens: u64, floats: &[u8]) -> Bytes {
        let mut out = Vec::with_capacity(floats.len() + 32);
        out.extend_from_slice(b"{\"tokens\":");
        out.extend_from_slice(tokens.to_string().as_bytes());
        out.extend_from_slice(b",\"embedding\":");
        out.extend_from_slice(floats);
        out.push(b'}');
        Bytes::from(out)
    }

    /// Reads an item's answer body.
    pub fn read(body: &[u8]) -> Option<ItemAnswer<'_>> {
        serde_json::from_slice(body).ok()
    }
}

/// The response to a request: `{"object": "list", "data": [...], "model",
/// "usage"}`, one embedding per item in the caller's order, each rendered
/// as the caller asked; `usage` counts the tokens of the items this
/// request's own call sent.
pub fn render(items: &[&Answer], encoding: Encoding, model: &str, sent_tokens: u64) -> Bytes {
    let mut out = Vec::with_capacity(64 + items.iter().map(|a| a.body.len() + 48).sum::<usize>());
    out.extend_from_slice(b"{\"object\":\"list\",\"data\":[");
    for (i, answer) in items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"object\":\"embedding\",\"index\":");
        out.extend_from_slice(i.to_string().as_bytes());
        out.extend_from_slice(b",\"embedding\":");
        let floats = ItemAnswer::read(&answer.body).map_or("[]", |a| a.embedding.get());
        out.extend_from_slice(&Vector::render(floats, encoding));
        out.push(b'}');
    }
    out.extend_from_slice(b"],\"model\":");
    out.extend_from_slice(Value::String(model.to_string()).to_string().as_bytes());
    out.extend_from_slice(b",\"usage\":");
    out.extend_from_slice(
        json!({"prompt_tokens": sent_tokens, "total_tokens": sent_tokens})
            .to_string()
            .as_bytes(),
    );
    out.push(b'}');
    Bytes::from(out)
}

/// A whole request's answer from its items' answers (each with how it
/// was obtained), as its client gets it: the first failed item's answer,
/// or the list ([`render`]) with `usage` counting the tokens of the items
/// sent by this request's own call.
pub fn whole(items: &[(Outcome, Arc<Answer>)], encoding: Encoding) -> Answer {
    if let Some((_, failed)) = items.iter().find(|(_, a)| !a.is_success()) {
        return (**failed).clone();
    }
    let answers: Vec<&Answer> = items.iter().map(|(_, a)| &**a).collect();
    let sent_tokens = items
        .iter()
        .filter(|(o, _)| !o.saved_a_call())
        .map(|(_, a)| tokens_of(a))
        .sum();
    let Some(first) = answers.first() else {
        return Answer::from_failure(
            Failure::BadAnswer,
            "no item to embed",
            Arc::from("idem"),
            Arc::from(""),
        );
    };
    let mut out = (*first).clone();
    out.body = render(&answers, encoding, &first.model, sent_tokens);
    out.rendered = Default::default();
    out
}

/// A request's outcome from its items': `leader` if anything was sent (`bypass` if what was
/// sent was not shared), else `follower` if an item waited for another
/// request's call, else `negative-hit` if an item's failure came from the
/// cache, else `cache-hit`.
pub fn outcome_of(items: impl Iterator<Item = Outcome> + Clone) -> Outcome {
    let any = |o: Outcome| items.clone().any(|i| i == o);
    if any(Outcome::Leader) {
        Outcome::Leader
    } else if any(Outcome::Bypass) {
        Outcome::Bypass
    } else if any(Outcome::Follower) {
        Outcome::Follower
    } else if any(Outcome::NegativeHit) {
        Outcome::NegativeHit
    } else {
        Outcome::CacheHit
    }
}

/// An item's share of its call's tokens (0 for an answer that is none).
pub fn tokens_of(answer: &Answer) -> u64 {
    ItemAnswer::read(&answer.body).map_or(0, |a| a.tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_a_leader_if_any_item_was_sent() {
        use Outcome::*;
        let of = |v: &[Outcome]| outcome_of(v.iter().copied());
        assert_eq!(of(&[CacheHit, Leader, Follower]), Leader);
        assert_eq!(of(&[CacheHit, Bypass]), Bypass);
        assert_eq!(of(&[CacheHit, Follower]), Follower);
        assert_eq!(of(&[CacheHit, NegativeHit]), NegativeHit);
        assert_eq!(of(&[CacheHit, CacheHit]), CacheHit);
    }

    fn body(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => panic!("not an object"),
        }
    }

    #[test]
    fn each_shape_of_input_is_cut_into_items() {
        let one = parse(body(json!({"model": "e", "input": "hello"}))).unwrap();
        assert_eq!(one.items.len(), 1);
        assert_eq!(one.items[0]["input"], "hello");
        assert!(!one.items[0].contains_key("model"));
        let many = parse(body(json!({"model": "e", "input": ["a", "b"], "dimensions": 4, "user": "u", "encoding_format": "base64"}))).unwrap();
        assert_eq!(many.items.len(), 2);
        assert_eq!(
            many.items[1],
            body(json!({"input": "b", "dimensions": 4, "user": "u"}))
        );
        assert_eq!(many.encoding, Encoding::Base64);
        assert!(!many.whole.contains_key("encoding_format"));
        let tokens = parse(body(json!({"model": "e", "input": [1, 2, 3]}))).unwrap();
        assert_eq!(tokens.items.len(), 1);
        assert_eq!(tokens.items[0]["input"], json!([1, 2, 3]));
        let arrays = parse(body(json!({"model": "e", "input": [[1], [2, 3]]}))).unwrap();
        assert_eq!(arrays.items.len(), 2);
        assert_eq!(arrays.items[1]["input"], json!([2, 3]));
    }

    #[test]
    fn what_openai_refuses_is_refused_naming_the_param() {
        let refused = |v: Value| parse(body(v)).unwrap_err();
        assert_eq!(refused(json!({"input": "x"})).param, "model");
        assert_eq!(
            refused(json!({"model": "e"})).code,
            "missing_required_parameter"
        );
        for input in [
            json!(""),
            json!([]),
            json!([""]),
            json!(["a", 1]),
            json!([[1], ["a"]]),
            json!([-1]),
            json!({"a": 1}),
            json!([[]]),
        ] {
            assert_eq!(
                refused(json!({"model": "e", "input": input})).param,
                "input",
                "{input}"
            );
        }
        let too_many: Vec<String> = (0..=MAX_ITEMS).map(|i| i.to_string()).collect();
        assert_eq!(
            refused(json!({"model": "e", "input": too_many})).param,
            "input"
        );
        assert_eq!(
            refused(json!({"model": "e", "input": "x", "dimensions": 0})).param,
            "dimensions"
        );
        assert_eq!(
            refused(json!({"model": "e", "input": "x", "dimensions": "8"})).code,
            "invalid_type"
        );
        assert_eq!(
            refused(json!({"model": "e", "input": "x", "encoding_format": "int8"})).param,
            "encoding_format"
        );
        assert_eq!(
            refused(json!({"model": "e", "input": "x", "user": 7})).param,
            "user"
        );
    }

    #[test]
    fn tokens_are_shared_in_proportion_and_add_up() {
        assert_eq!(apportion(10, &[1, 1]), [5, 5]);
        assert_eq!(apportion(10, &[1, 2, 2]), [2, 4, 4]);
        assert_eq!(apportion(7, &[1, 1, 1]), [3, 2, 2]);
        assert_eq!(apportion(3, &[0, 0]), [2, 1]);
        assert_eq!(apportion(0, &[5, 5]), [0, 0]);
        let shares = apportion(1_000, &[3, 7, 11, 13, 17]);
        assert_eq!(shares.iter().sum::<u64>(), 1_000);
    }

    fn answer_of(body: &str) -> Answer {
        let mut a = Answer::from_failure(Failure::Timeout, "x", "p".into(), "m".into());
        a.failure = None;
        a.status = reqwest::StatusCode::OK;
        a.body = Bytes::from(body.to_string());
        a
    }

    fn requests(inputs: &[&str]) -> Vec<Arc<Map<String, Value>>> {
        inputs
            .iter()
            .map(|i| Arc::new(body(json!({"input": i}))))
            .collect()
    }

    #[test]
    fn an_answer_is_split_in_item_order_with_the_vectors_as_sent() {
        let upstream = r#"{"object":"list","data":[{"object":"embedding","index":1,"embedding":[0.5,-0.25]},{"object":"embedding","index":0,"embedding":[0.125,1e-3]}],"model":"m","usage":{"prompt_tokens":6,"total_tokens":6}}"#;
        let reqs = requests(&["ab", "abcd"]);
        let checked = EMBEDDINGS.check(answer_of(upstream), &reqs).unwrap();
        let items = EMBEDDINGS.split(checked, &reqs);
        let first = ItemAnswer::read(&items[0].body).unwrap();
        assert_eq!(first.embedding.get(), "[0.125,1e-3]");
        assert_eq!(first.tokens, 2);
        let second = ItemAnswer::read(&items[1].body).unwrap();
        assert_eq!(second.embedding.get(), "[0.5,-0.25]");
        assert_eq!(second.tokens, 4);
        // Rendered as asked: the numbers as sent, or their f32 bytes.
        let plain = render(&[&items[0], &items[1]], Encoding::Float, "e", 6);
        let v: Value = serde_json::from_slice(&plain).unwrap();
        assert_eq!(v["data"][0]["embedding"], json!([0.125, 0.001]));
        assert_eq!(v["data"][1]["index"], 1);
        assert_eq!(v["usage"]["prompt_tokens"], 6);
        let b64 = render(&[&items[1]], Encoding::Base64, "e", 0);
        let v: Value = serde_json::from_slice(&b64).unwrap();
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(v["data"][0]["embedding"].as_str().unwrap())
            .unwrap();
        let floats: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(floats, [0.5, -0.25]);
    }

    #[test]
    fn what_is_no_embeddings_list_for_the_call_is_a_bad_answer() {
        let reqs = requests(&["a", "b"]);
        for body in [
            "<html>",
            r#"{"data":[]}"#,
            r#"{"data":[{"embedding":[1.0]}]}"#,
            r#"{"data":[{"index":0,"embedding":[1.0]},{"index":0,"embedding":[2.0]}]}"#,
            r#"{"data":[{"embedding":[1.0]},{"embedding":"not base64!"}]}"#,
            r#"{"data":[{"embedding":[1.0]},{"embedding":[]}]}"#,
            r#"{"data":[{"embedding":[1.0]},{"embedding":["x"]}]}"#,
        ] {
            let bad = EMBEDDINGS.check(answer_of(body), &reqs).unwrap_err();
            assert_eq!(bad.failure, Some(Failure::BadAnswer), "{body}");
        }
        // A provider that answers base64 anyway is read, and kept as floats.
        let b64 = base64::engine::general_purpose::STANDARD.encode(
            [1.5f32, -2.0]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<u8>>(),
        );
        let body = format!(r#"{{"data":[{{"embedding":"{b64}"}},{{"embedding":[3]}}]}}"#);
        let checked = EMBEDDINGS.check(answer_of(&body), &reqs).unwrap();
        let items = EMBEDDINGS.split(checked, &reqs);
        assert_eq!(
            ItemAnswer::read(&items[0].body).unwrap().embedding.get(),
            "[1.5,-2.0]"
        );
    }
}
