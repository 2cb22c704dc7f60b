//! The API dialects idem speaks, as the core knows them (docs/design.md,
//! "Endpoints: one core, several dialects").
//!
//! A request keeps its own [`Dialect`] from the face that read it to the
//! target that answers it, and its answer is kept in that dialect: chat
//! completions, Anthropic's Messages API (and its token count), OpenAI's
//! Responses API, embeddings. Where a target speaks the request's dialect
//! the request goes as its client sent it and the answer comes back as the
//! provider wrote it; `translate` works only between two dialects.
//!
//! This module holds what the rest of the core needs to know of each
//! dialect's wire format, as pure functions over bytes and JSON: which of a
//! request's fields are noise, which carry text a route may normalize, the
//! headers of a client that change its answer ([`Forwarded`]), and for the
//! answers of the Messages and Responses dialects ([`messages`],
//! [`responses`], [`count`]) what a whole, well-formed answer is, its token
//! counts, its plain form made of a stream and its stream made of a plain
//! answer. Chat completions' own are in `answer` and `sse`.

pub mod count;
pub mod messages;
pub mod responses;

use serde_json::{Map, Value};

/// The wire format of a request and of its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// OpenAI's chat completions (`/v1/chat/completions`).
    Chat,
    /// Anthropic's Messages API (`/v1/messages`).
    Messages,
    /// Anthropic's token count of a Messages request
    /// (`/v1/messages/count_tokens`): `{"input_tokens": N}`.
    CountTokens,
    /// OpenAI's Responses API (`/v1/responses`).
    Responses,
    /// Embeddings (`/v1/embeddings`).
    Embeddings,
}

impl Dialect {
    /// Its name in the request log, metrics, traces and the store.
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Chat => "chat",
            Dialect::Messages => "messages",
            Dialect::CountTokens => "count_tokens",
            Dialect::Responses => "responses",
            Dialect::Embeddings => "embeddings",
        }
    }

    pub fn parse(name: &str) -> Option<Dialect> {
        [
            Dialect::Chat,
            Dialect::Messages,
            Dialect::CountTokens,
            Dialect::Responses,
            Dialect::Embeddings,
        ]
        .into_iter()
        .find(|d| d.as_str() == name)
    }

    /// Top-level request fields that never change the answer: the
    /// fingerprint leaves them out (docs/design.md, "What counts as the
    /// same task"). `model` is not noise in itself: the route and its
    /// targets stand for it.
    pub fn noise(self) -> &'static [&'static str] {
        const COMMON: &[&str] = &[
            "model",
            "stream",
            "stream_options",
            "request_id",
            "trace_id",
            "traceparent",
            "x_request_id",
            "timestamp",
            "nonce",
        ];
        COMMON
    }

    /// The fields that name the end user: noise with `scope = "tenant"`,
    /// the user with `scope = "user"` (the first one present). Anthropic's
    /// `metadata` holds only its `user_id`.
    pub fn user_fields(self) -> &'static [&'static str] {
        match self {
            Dialect::Messages | Dialect::CountTokens => &["metadata"],
            _ => &["user", "safety_identifier"],
        }
    }

    /// The top-level fields whose text a route's `normalize` applies to:
    /// the conversation and the standing instructions, never tool data.
    pub fn text_fields(self) -> &'static [&'static str] {
        match self {
            Dialect::Chat => &["messages"],
            Dialect::Messages | Dialect::CountTokens => &["messages", "system"],
            Dialect::Responses => &["input", "instructions"],
            Dialect::Embeddings => &[],
        }
    }

    /// The headers of a request in this dialect that change its answer on
    /// a target of the same dialect (lower case): forwarded there, and part
    /// of the fingerprint.
    pub fn answer_headers(self) -> &'static [&'static str] {
        match self {
            Dialect::Messages | Dialect::CountTokens => &["anthropic-beta", "anthropic-version"],
            Dialect::Chat | Dialect::Responses | Dialect::Embeddings => &["openai-beta"],
        }
    }

    /// The dialect of a provider kind's own API for conversations (a
    /// provider may speak more: an OpenAI-compatible one with
    /// `responses_api`, the Responses API too).
    pub fn native_to(kind: crate::config::ProviderKind) -> Dialect {
        match kind {
            crate::config::ProviderKind::Anthropic => Dialect::Messages,
            _ => Dialect::Chat,
        }
    }

    /// The event that ends a successful stream of this dialect: a relay
    /// hands it on only once the whole answer is known to be well formed.
    pub fn terminal(self) -> Terminal {
        match self {
            Dialect::Messages | Dialect::CountTokens => Terminal::Event(&["message_stop"]),
            Dialect::Responses => Terminal::Event(&[
                "response.completed",
                "response.incomplete",
                "response.failed",
            ]),
            Dialect::Chat | Dialect::Embeddings => Terminal::Done,
        }
    }
}

pub use crate::sse::Terminal;

/// Why a provider's 2xx is not a whole, well-formed answer of its dialect
/// (the Messages and Responses dialects; chat completions' reasons are
/// `answer::Malformed`'s own).
#[derive(Debug, thiserror::Error)]
pub enum Unfit {
    #[error("the body is empty")]
    Empty,
    #[error("the body is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("the body is not {0}")]
    NotA(&'static str),
    #[error("the body is an error object")]
    ErrorObject,
    /// The provider reported an error inside its stream (its error object).
    #[error("the provider reported an error in its stream")]
    Failed(Value),
    /// A response that did not complete (`incomplete`, `failed`, ...).
    #[error("the response ended {0}")]
    Status(String),
    /// The stream ended without the event that ends a whole answer.
    #[error("the stream ended before {0}")]
    Unfinished(&'static str),
    /// An event's data is not a JSON object.
    #[error("event {0} of the stream is not a JSON object")]
    BadEvent(usize),
}

/// The data of each event of a whole stream, parsed (an event cut off
/// without its blank line included), or the first that is not an object.
pub(crate) fn stream_events(sse: &[u8]) -> Result<Vec<Map<String, Value>>, Unfit> {
    let mut splitter = crate::sse::EventSplitter::new();
    let mut data = splitter.push(sse);
    data.extend(splitter.finish());
    data.iter()
        .enumerate()
        .map(|(n, d)| match serde_json::from_str::<Value>(d) {
            Ok(Value::Object(m)) => Ok(m),
            _ => Err(Unfit::BadEvent(n)),
        })
        .collect()
}

/// The headers of a client's request that change its answer, as they
/// came (names in lower case, several values of one name joined with
/// commas), in name order: sent on to a target of the request's dialect,
/// and hashed into its fingerprint.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Forwarded(Vec<(&'static str, String)>);

impl Forwarded {
    /// No header.
    pub const fn none() -> Forwarded {
        Forwarded(Vec::new())
    }

    /// The headers `dialect` forwards, read with `get` (all the values of
    /// one header name).
    pub fn read<'a>(dialect: Dialect, get: impl Fn(&str) -> Vec<&'a str>) -> Forwarded {
        let mut out = Vec::new();
        for &name in dialect.answer_headers() {
            let values = get(name);
            if !values.is_empty() {
                out.push((name, values.join(",")));
            }
        }
        Forwarded(out)
    }

    /// From a stored map (a job's), keeping only names `dialect` forwards.
    pub fn from_json(dialect: Dialect, stored: Option<&Value>) -> Forwarded {
        let map = stored.and_then(Value::as_object);
        let mut out = Vec::new();
        for &name in dialect.answer_headers() {
            if let Some(v) = map.and_then(|m| m.get(name)).and_then(Value::as_str) {
                out.push((name, v.to_string()));
            }
        }
        Forwarded(out)
    }

    /// As a JSON object (for the store and the fingerprint).
    pub fn to_json(&self) -> Map<String, Value> {
        self.0
            .iter()
            .map(|(k, v)| ((*k).to_string(), Value::String(v.clone())))
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &str)> {
        self.0.iter().map(|(k, v)| (*k, v.as_str()))
    }

    /// The value of one header, if the client sent it.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The `type` of a typed stream's event (Messages and Responses).
pub(crate) fn event_type(data: &Map<String, Value>) -> &str {
    data.get("type").and_then(Value::as_str).unwrap_or("")
}

/// One `event: <type>` frame of a typed stream.
pub(crate) fn frame(out: &mut Vec<u8>, kind: &str, data: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\ndata: ");
    // Writing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut *out, data);
    out.extend_from_slice(b"\n\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dialects_are_named_once() {
        for d in [
            Dialect::Chat,
            Dialect::Messages,
            Dialect::CountTokens,
            Dialect::Responses,
            Dialect::Embeddings,
        ] {
            assert_eq!(Dialect::parse(d.as_str()), Some(d));
        }
        assert_eq!(Dialect::parse("mystery"), None);
    }

    #[test]
    fn forwarded_headers_keep_their_dialects_names_only_joined_in_order() {
        let got = |name: &str| match name {
            "anthropic-beta" => vec!["a-2025", "b-2025"],
            "anthropic-version" => vec!["2023-06-01"],
            "openai-beta" => vec!["assistants=v2"],
            _ => vec![],
        };
        let m = Forwarded::read(Dialect::Messages, got);
        assert_eq!(
            m.iter().collect::<Vec<_>>(),
            [
                ("anthropic-beta", "a-2025,b-2025"),
                ("anthropic-version", "2023-06-01")
            ]
        );
        let r = Forwarded::read(Dialect::Responses, got);
        assert_eq!(
            r.iter().collect::<Vec<_>>(),
            [("openai-beta", "assistants=v2")]
        );
        let stored = Value::Object(m.to_json());
        assert_eq!(Forwarded::from_json(Dialect::Messages, Some(&stored)), m);
        assert!(Forwarded::from_json(Dialect::Chat, Some(&stored)).is_empty());
    }
}
