//! A finished upstream answer as idem keeps and hands it out: what a flight
//! ends with, what the result cache stores, what a job's attempt reports.
//!
//! An [`Answer`] is immutable and shared behind an `Arc`; it is kept in its
//! request's dialect, as the provider wrote it (translated only when the
//! target speaks another dialect), and remembers the form the provider used
//! (plain JSON or an SSE stream): it renders either form on demand, so a
//! follower gets the answer in the form it asked for.
//! [`Verdict`] classifies it the way docs/design.md, "Jobs and attempts" does (`succeeded`,
//! `failed`: the provider certainly did not do the work, `unknown`: it may
//! have), and [`Answer::negative_ttl`] applies the cache table of section 4.
//! [`Answer::malformed`] says why a provider's 2xx is not a chat completion
//! at all (not JSON, cut short, an error object, no choices): such an answer
//! becomes a failure ([`Answer::into_bad`]) before anybody sees it as a
//! success.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use reqwest::StatusCode;

use serde_json::Value;

use crate::config::RouteCache;
use crate::dialect::{Dialect, Unfit};
use crate::prices::Tokens;
use crate::sse::SseError;

mod probe;

/// An OpenAI error object, `{"error": {"message", "type", "code",
/// "param"}}`: the body of an answer idem writes itself, and of every error
/// the HTTP layer sends.
pub fn error_body(message: &str, kind: &str, code: &str, param: Option<&str>) -> Value {
    serde_json::json!({"error": {"message": message, "type": kind, "code": code, "param": param}})
}

/// The form of a body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    Plain,
    Stream,
}

/// Why no provider answer exists (idem wrote the error body itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Connection refused before sending.
    Connect,
    /// No answer in time after sending.
    Timeout,
    /// Connection lost after sending (or mid-stream).
    Broken,
    /// The leader task ended without an answer (a bug or a panic).
    LeaderLost,
    /// The answer broke the route's contract.
    Contract,
    /// A 2xx whose body is not a well-formed chat completion.
    BadAnswer,
    /// The answer grew past its provider's `max_answer_bytes`.
    TooLarge,
    /// The provider refused idem's own credentials (its 401 or 403): the
    /// operator's key is wrong, not the client's, so the client gets a 502
    /// that says so, never the provider's `invalid_api_key`.
    Credentials,
}

/// Why a provider's 2xx answer is not a well-formed chat completion.
#[derive(Debug, thiserror::Error)]
pub enum Malformed {
    #[error("the body is empty")]
    Empty,
    #[error("the body is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("the body is not a JSON object")]
    NotAnObject,
    #[error("the body is an error object")]
    ErrorObject,
    #[error("the answer has no choices")]
    NoChoices,
    #[error("choice {0} has no message")]
    NoMessage(usize),
    #[error("the stream is not a whole chat completion: {0}")]
    Stream(#[source] SseError),
    /// Not a whole answer of the Messages or Responses dialect.
    #[error("{0}")]
    Dialect(#[from] Unfit),
}

/// Checks the shape every chat completion has: an object without an
/// `error`, with at least one choice, each with a message.
fn check_completion(v: &Value) -> Result<(), Malformed> {
    let object = v.as_object().ok_or(Malformed::NotAnObject)?;
    if object.get("error").is_some_and(|e| !e.is_null()) {
        return Err(Malformed::ErrorObject);
    }
    let choices = object
        .get("choices")
        .and_then(Value::as_array)
        .filter(|c| !c.is_empty())
        .ok_or(Malformed::NoChoices)?;
    match choices
        .iter()
        .position(|c| !c.get("message").is_some_and(Value::is_object))
    {
        Some(i) => Err(Malformed::NoMessage(i)),
        None => Ok(()),
    }
}

/// [`check_completion`] on a plain body's [`probe::Shape`]: the same
/// verdicts in the same order.
fn check_shape(shape: &probe::Shape) -> Result<(), Malformed> {
    if shape.error {
        return Err(Malformed::ErrorObject);
    }
    match shape.choices {
        probe::Choices::Absent | probe::Choices::Empty => Err(Malformed::NoChoices),
        probe::Choices::Array { first_bad: Some(i) } => Err(Malformed::NoMessage(i)),
        probe::Choices::Array { first_bad: None } => Ok(()),
    }
}

/// How an attempt ended (docs/design.md, "Jobs and attempts").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Succeeded,
    /// The provider certainly did not do the work.
    Failed(&'static str),
    /// idem cannot know whether the provider did the work.
    Unknown(&'static str),
}

/// One finished answer.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The dialect of its body (its request's).
    pub dialect: Dialect,
    pub status: StatusCode,
    pub form: Form,
    /// The complete body: the JSON document, or the whole SSE byte stream.
    pub body: Bytes,
    pub retry_after: Option<Duration>,
    pub failure: Option<Failure>,
    pub provider: Arc<str>,
    pub model: Arc<str>,
    pub created_at: SystemTime,
    /// How long the upstream call took.
    pub upstream_latency: Duration,
    /// The TTL the result cache gave this answer (None: not cached).
    pub cache_ttl: Option<Duration>,
    /// The other forms of the body, rendered once and shared by every
    /// follower and cache hit that asks for them.
    pub rendered: Rendered,
}

#[cfg(test)]
impl Answer {
    /// A plain 200 answer from `provider`'s `model`, for tests.
    pub fn test_ok(provider: &str, model: &str) -> Answer {
        Answer {
            dialect: Dialect::Chat,
            status: StatusCode::OK,
            form: Form::Plain,
            body: Bytes::from_static(b"{}"),
            retry_after: None,
            failure: None,
            provider: provider.into(),
            model: model.into(),
            created_at: SystemTime::now(),
            upstream_latency: Duration::from_millis(5),
            cache_ttl: None,
            rendered: Default::default(),
        }
    }
}

/// Lazily rendered forms of an answer's body.
#[derive(Debug, Clone, Default)]
pub struct Rendered {
    plain: OnceLock<Result<Bytes, Bytes>>,
    stream: OnceLock<Bytes>,
    stream_with_usage: OnceLock<Bytes>,
    tokens: OnceLock<Option<Tokens>>,
}

impl Answer {
    /// An answer idem writes itself when the provider gave none.
    pub fn from_failure(
        failure: Failure,
        message: &str,
        provider: Arc<str>,
        model: Arc<str>,
    ) -> Answer {
        let (status, code) = match failure {
            Failure::Connect => (StatusCode::BAD_GATEWAY, "upstream_unreachable"),
            Failure::Timeout => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
            Failure::Broken => (StatusCode::BAD_GATEWAY, "upstream_connection_lost"),
            Failure::LeaderLost => (StatusCode::BAD_GATEWAY, "leader_lost"),
            Failure::Contract => (StatusCode::BAD_GATEWAY, "contract_violation"),
            Failure::BadAnswer => (StatusCode::BAD_GATEWAY, "bad_upstream_answer"),
            Failure::TooLarge => (StatusCode::BAD_GATEWAY, "upstream_answer_too_large"),
            Failure::Credentials => (StatusCode::BAD_GATEWAY, "provider_auth_failed"),
        };
        let body = error_body(message, "upstream_error", code, None);
        Answer {
            dialect: Dialect::Chat,
            status,
            form: Form::Plain,
            body: Bytes::from(body.to_string()),
            retry_after: None,
            failure: Some(failure),
            provider,
            model,
            created_at: SystemTime::now(),
            upstream_latency: Duration::ZERO,
            cache_ttl: None,
            rendered: Default::default(),
        }
    }

    pub fn is_success(&self) -> bool {
        self.failure.is_none() && self.status.is_success()
    }

    /// Why this success is not a well-formed chat completion, or `None`
    /// (also for anything that is not a success: an error body need not be
    /// a completion). A streamed answer is assembled here once, and its
    /// plain form kept for whoever asks for it next.
    pub fn malformed(&self) -> Option<Malformed> {
        if !self.is_success() {
            return None;
        }
        let (tokens, plain) = match (self.dialect, self.form) {
            (Dialect::Chat | Dialect::Embeddings, Form::Plain) if self.body.is_empty() => {
                return Some(Malformed::Empty);
            }
            // Read without building the document (this runs for every
            // answer a provider gives).
            (Dialect::Chat | Dialect::Embeddings, Form::Plain) => {
                match serde_json::from_slice::<probe::Top>(&self.body) {
                    Ok(probe::Top::Object(shape)) => {
                        if let Err(why) = check_shape(&shape) {
                            return Some(why);
                        }
                        (shape.usage.as_ref().and_then(Tokens::of_usage), None)
                    }
                    Ok(probe::Top::NotAnObject) => return Some(Malformed::NotAnObject),
                    Err(e) => return Some(Malformed::NotJson(e)),
                }
            }
            (Dialect::Chat | Dialect::Embeddings, Form::Stream) => {
                let completion = match crate::sse::assemble(&self.body) {
                    Ok(v) => v,
                    Err(e) => return Some(Malformed::Stream(e)),
                };
                if let Err(why) = check_completion(&completion) {
                    return Some(why);
                }
                let tokens = completion.get("usage").and_then(Tokens::of_usage);
                (tokens, Some(Bytes::from(completion.to_string())))
            }
            (Dialect::Messages, form) => {
                let message = match form {
                    Form::Plain => crate::dialect::messages::check_plain(&self.body),
                    Form::Stream => crate::dialect::messages::assemble(&self.body),
                };
                match message {
                    Ok(m) => {
                        let plain = (form == Form::Stream).then(|| Bytes::from(m.to_string()));
                        (crate::dialect::messages::tokens(&m), plain)
                    }
                    Err(why) => return Some(why.into()),
                }
            }
            (Dialect::Responses, form) => {
                let response = match form {
                    Form::Plain => crate::dialect::responses::check_plain(&self.body),
                    Form::Stream => crate::dialect::responses::assemble(&self.body),
                };
                match response {
                    Ok(r) => {
                        let plain = (form == Form::Stream).then(|| Bytes::from(r.to_string()));
                        (crate::dialect::responses::tokens(&r), plain)
                    }
                    Err(why) => return Some(why.into()),
                }
            }
            (Dialect::CountTokens, _) => match crate::dialect::count::check_plain(&self.body) {
                // A count spends no tokens.
                Ok(_) => (None, None),
                Err(why) => return Some(why.into()),
            },
        };
        let _ = self.rendered.tokens.set(tokens);
        if let Some(plain) = plain {
            let _ = self.rendered.plain.set(Ok(plain));
        }
        None
    }

    /// This answer replaced by a [`Failure::BadAnswer`] that says `why`.
    pub fn into_bad(self, why: &Malformed) -> Answer {
        let what = match self.dialect {
            Dialect::Chat => "a chat completion",
            Dialect::Messages => "a whole message",
            Dialect::Responses => "a completed response",
            Dialect::CountTokens => "a token count",
            Dialect::Embeddings => "an embeddings list",
        };
        let message = match why {
            // The provider's own words, as far as they go.
            Malformed::Stream(SseError::Upstream(error))
            | Malformed::Dialect(Unfit::Failed(error)) => {
                let said = error
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("no message");
                let said: String = said.chars().take(500).collect();
                format!(
                    "provider {} reported an error in its stream: {said}",
                    self.provider
                )
            }
            _ => format!(
                "provider {} answered with something that is not {what}: {why}",
                self.provider
            ),
        };
        let mut bad = Answer::from_failure(Failure::BadAnswer, &message, self.provider, self.model);
        bad.upstream_latency = self.upstream_latency;
        bad
    }

    /// The bytes this answer holds: its body, the forms rendered so far,
    /// its names. What the result cache weighs it by (plus its own
    /// bookkeeping).
    pub fn size_bytes(&self) -> usize {
        let rendered = [
            self.rendered.plain.get().and_then(|p| p.as_ref().ok()),
            self.rendered.stream.get(),
            self.rendered.stream_with_usage.get(),
        ]
        .into_iter()
        .flatten()
        // A rendering that is the body itself costs nothing more.
        .filter(|b| b.as_ptr() != self.body.as_ptr())
        .map(Bytes::len)
        .sum::<usize>();
        self.body.len() + rendered + self.provider.len() + self.model.len()
    }

    /// docs/design.md, "Jobs and attempts"'s classification of an attempt's outcome.
    pub fn verdict(&self) -> Verdict {
        match self.failure {
            Some(Failure::Connect) => return Verdict::Failed("connect_error"),
            Some(Failure::Timeout) => return Verdict::Unknown("timeout"),
            Some(Failure::Broken) => return Verdict::Unknown("connection_lost"),
            Some(Failure::LeaderLost) => return Verdict::Unknown("leader_lost"),
            Some(Failure::Contract) => return Verdict::Failed("contract_violation"),
            // The provider answered, and its answer cannot be used: a
            // retry (or the next target) is the only way to a result.
            Some(Failure::BadAnswer) => return Verdict::Failed("bad_upstream_answer"),
            Some(Failure::TooLarge) => return Verdict::Failed("upstream_answer_too_large"),
            Some(Failure::Credentials) => return Verdict::Failed("provider_auth_failed"),
            None => {}
        }
        match self.status.as_u16() {
            200..=299 => Verdict::Succeeded,
            // An intermediary's 502/504 says nothing about the provider.
            502 | 504 => Verdict::Unknown("intermediary_error"),
            429 => Verdict::Failed("rate_limited"),
            400..=499 => Verdict::Failed("request_rejected"),
            _ => Verdict::Failed("provider_error"),
        }
    }

    /// True for a 4xx the request itself caused: shared with the flight's
    /// followers (their request is identical) but never cached.
    pub fn is_request_error(&self) -> bool {
        self.failure.is_none()
            && self.status.is_client_error()
            && self.status != StatusCode::TOO_MANY_REQUESTS
    }

    /// How long this failure is negatively cached, or `None` if it is not.
    pub fn negative_ttl(&self, policy: &RouteCache) -> Option<Duration> {
        if self.is_success() || self.is_request_error() {
            return None;
        }
        let rate_limited = || {
            let raised = self
                .retry_after
                .unwrap_or(Duration::ZERO)
                .max(policy.rate_limit_ttl);
            Some(raised.min(policy.rate_limit_ttl_max))
        };
        match self.failure {
            Some(Failure::Timeout) => rate_limited(),
            // A provider that answers garbage, or an answer that large, is
            // likely to do so again at once: kept like a 5xx, so waiters
            // do not pay for it again and again.
            Some(
                Failure::Broken
                | Failure::Connect
                | Failure::BadAnswer
                | Failure::TooLarge
                | Failure::Credentials,
            ) => Some(policy.server_error_ttl),
            // idem's own trouble is not the provider's: never cached.
            Some(Failure::LeaderLost) | Some(Failure::Contract) => None,
            None => match self.status.as_u16() {
                429 | 504 => rate_limited(),
                _ => Some(policy.server_error_ttl),
            },
        }
    }

    /// The body as a plain document of its dialect (a `chat.completion`, a
    /// `message`, a `response`), or, for a stream that cannot be assembled
    /// into one, an OpenAI error body (a success in name only: never to be
    /// sent with a 2xx).
    pub fn plain_body(&self) -> Result<Bytes, Bytes> {
        match self.form {
            Form::Plain => Ok(self.body.clone()),
            Form::Stream => self.rendered.plain.get_or_init(|| self.assemble()).clone(),
        }
    }

    fn assemble(&self) -> Result<Bytes, Bytes> {
        let assembled = match self.dialect {
            Dialect::Messages => {
                crate::dialect::messages::assemble(&self.body).map_err(|e| e.to_string())
            }
            Dialect::Responses => {
                crate::dialect::responses::assemble(&self.body).map_err(|e| e.to_string())
            }
            _ => crate::sse::assemble(&self.body).map_err(|e| e.to_string()),
        };
        match assembled {
            Ok(v) => Ok(Bytes::from(v.to_string())),
            Err(e) => {
                tracing::warn!(error = %e, "cannot assemble a streamed answer");
                Err(Bytes::from(
                    error_body(
                        "the provider's stream could not be assembled",
                        "upstream_error",
                        "bad_upstream_stream",
                        None,
                    )
                    .to_string(),
                ))
            }
        }
    }

    /// The body as an SSE stream (only meaningful for a success), rendered
    /// for the asker: a stream the provider wrote goes as it came; a plain
    /// answer is rendered as the stream that would have carried it. A chat
    /// asker gets a usage chunk when it asked for one
    /// (`stream_options.include_usage`) and the usage is known, and none
    /// when it did not, whatever the leader's request asked. Each rendering
    /// is made once and shared.
    pub fn stream_body(&self, include_usage: bool) -> Bytes {
        let slot = if include_usage {
            &self.rendered.stream_with_usage
        } else {
            &self.rendered.stream
        };
        slot.get_or_init(|| match (self.dialect, self.form) {
            (Dialect::Messages | Dialect::Responses | Dialect::CountTokens, Form::Stream) => {
                self.body.clone()
            }
            (Dialect::Messages, Form::Plain) => self
                .plain_json()
                .map(|m| crate::dialect::messages::synthesize(&m))
                .unwrap_or_else(|| self.body.clone()),
            (Dialect::Responses, Form::Plain) => self
                .plain_json()
                .map(|r| crate::dialect::responses::synthesize(&r))
                .unwrap_or_else(|| self.body.clone()),
            (Dialect::CountTokens, Form::Plain) => self.body.clone(),
            (_, Form::Stream) if include_usage => self
                .plain_json()
                .and_then(|c| crate::sse::with_usage(&self.body, &c))
                .unwrap_or_else(|| self.body.clone()),
            (_, Form::Stream) => {
                crate::sse::without_usage(&self.body).unwrap_or_else(|| self.body.clone())
            }
            (_, Form::Plain) => match serde_json::from_slice::<serde_json::Value>(&self.body) {
                Ok(v) => crate::sse::synthesize(&v, include_usage),
                Err(_) => self.body.clone(),
            },
        })
        .clone()
    }

    /// The answer as one plain document of its dialect, parsed.
    pub fn plain_json(&self) -> Option<serde_json::Value> {
        match self.form {
            Form::Plain => serde_json::from_slice(&self.body).ok(),
            Form::Stream => match self.plain_body() {
                Ok(plain) => serde_json::from_slice(&plain).ok(),
                Err(_) => None,
            },
        }
    }

    /// The answer's text, for contracts: a chat completion's first choice's
    /// content, a message's text blocks, a response's output text.
    pub fn text(&self) -> Option<String> {
        let plain = self.plain_json()?;
        match self.dialect {
            Dialect::Messages => crate::dialect::messages::text(&plain),
            Dialect::Responses => crate::dialect::responses::text(&plain),
            _ => plain
                .pointer("/choices/0/message/content")
                .and_then(serde_json::Value::as_str)
                .map(str::to_string),
        }
    }

    /// Prompt and completion token counts reported by the provider, if
    /// any (parsed once).
    pub fn usage(&self) -> Option<(u64, u64)> {
        self.tokens().map(|t| (t.input, t.output))
    }

    /// Records the tokens of this answer's call, read by whoever parsed its
    /// body already (a first reading wins).
    pub fn set_tokens(&self, tokens: Option<Tokens>) {
        let _ = self.rendered.tokens.set(tokens);
    }

    /// The tokens the provider reported for this answer's call, if any
    /// (parsed once, shared by everyone this answer serves).
    pub fn tokens(&self) -> Option<Tokens> {
        if !self.is_success() {
            return None;
        }
        *self.rendered.tokens.get_or_init(|| {
            let plain = self.plain_json()?;
            match self.dialect {
                Dialect::Messages => crate::dialect::messages::tokens(&plain),
                Dialect::Responses => crate::dialect::responses::tokens(&plain),
                Dialect::CountTokens => None,
                _ => Tokens::of_usage(plain.get("usage")?),
            }
        })
    }
}

/// How an answer travels between replicas (the Redis backend): one line of
/// JSON metadata, a newline, then the body bytes as they are.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct WireMeta {
    /// Absent in an older replica's answers: chat.
    #[serde(default)]
    dialect: Option<String>,
    status: u16,
    stream: bool,
    retry_after_ms: Option<u64>,
    failure: Option<String>,
    provider: String,
    model: String,
    created_ms: u64,
    upstream_ms: u64,
    cache_ttl_ms: Option<u64>,
}

fn ms_u64(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Failure {
    fn as_str(self) -> &'static str {
        match self {
            Failure::Connect => "connect",
            Failure::Timeout => "timeout",
            Failure::Broken => "broken",
            Failure::LeaderLost => "leader_lost",
            Failure::Contract => "contract",
            Failure::BadAnswer => "bad_answer",
            Failure::TooLarge => "too_large",
            Failure::Credentials => "credentials",
        }
    }

    fn parse(s: &str) -> Option<Failure> {
        [
            Failure::Connect,
            Failure::Timeout,
            Failure::Broken,
            Failure::LeaderLost,
            Failure::Contract,
            Failure::BadAnswer,
            Failure::TooLarge,
            Failure::Credentials,
        ]
        .into_iter()
        .find(|f| f.as_str() == s)
    }
}

impl Answer {
    /// The wire form (see [`Answer::from_wire`]).
    pub fn to_wire(&self) -> Vec<u8> {
        let meta = WireMeta {
            dialect: Some(self.dialect.as_str().to_string()),
            status: self.status.as_u16(),
            stream: self.form == Form::Stream,
            retry_after_ms: self.retry_after.map(ms_u64),
            failure: self.failure.map(|f| f.as_str().to_string()),
            provider: self.provider.to_string(),
            model: self.model.to_string(),
            created_ms: ms_u64(
                self.created_at
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default(),
            ),
            upstream_ms: ms_u64(self.upstream_latency),
            cache_ttl_ms: self.cache_ttl.map(ms_u64),
        };
        let mut out = serde_json::to_vec(&meta).unwrap_or_default();
        out.push(b'\n');
        out.extend_from_slice(&self.body);
        out
    }

    /// Reads the wire form; `None` if it is not one.
    pub fn from_wire(bytes: &[u8]) -> Option<Answer> {
        let nl = bytes.iter().position(|b| *b == b'\n')?;
        let meta: WireMeta = serde_json::from_slice(&bytes[..nl]).ok()?;
        let failure = match &meta.failure {
            Some(f) => Some(Failure::parse(f)?),
            None => None,
        };
        let dialect = match &meta.dialect {
            Some(d) => Dialect::parse(d)?,
            None => Dialect::Chat,
        };
        Some(Answer {
            dialect,
            status: StatusCode::from_u16(meta.status).ok()?,
            form: if meta.stream {
                Form::Stream
            } else {
                Form::Plain
            },
            body: Bytes::copy_from_slice(&bytes[nl + 1..]),
            retry_after: meta.retry_after_ms.map(Duration::from_millis),
            failure,
            provider: meta.provider.into(),
            model: meta.model.into(),
            created_at: std::time::UNIX_EPOCH + Duration::from_millis(meta.created_ms),
            upstream_latency: Duration::from_millis(meta.upstream_ms),
            cache_ttl: meta.cache_ttl_ms.map(Duration::from_millis),
            rendered: Default::default(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, failure: Option<Failure>, retry: Option<u64>) -> Answer {
        Answer {
            dialect: Dialect::Chat,
            status: StatusCode::from_u16(status).unwrap(),
            form: Form::Plain,
            body: Bytes::from_static(b"{}"),
            retry_after: retry.map(Duration::from_secs),
            failure,
            provider: "p".into(),
            model: "m".into(),
            created_at: SystemTime::now(),
            upstream_latency: Duration::ZERO,
            cache_ttl: None,
            rendered: Default::default(),
        }
    }

    #[test]
    fn negative_cache_follows_the_spec_table() {
        let p = RouteCache::default();
        assert_eq!(answer(200, None, None).negative_ttl(&p), None);
        assert_eq!(answer(400, None, None).negative_ttl(&p), None);
        assert_eq!(answer(413, None, None).negative_ttl(&p), None);
        assert_eq!(answer(422, None, None).negative_ttl(&p), None);
        assert_eq!(
            answer(429, None, None).negative_ttl(&p),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            answer(429, None, Some(5)).negative_ttl(&p),
            Some(Duration::from_secs(5))
        );
        assert_eq!(
            answer(429, None, Some(3600)).negative_ttl(&p),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            answer(504, Some(Failure::Timeout), None).negative_ttl(&p),
            Some(Duration::from_secs(2))
        );
        for s in [500, 502, 503] {
            assert_eq!(
                answer(s, None, None).negative_ttl(&p),
                Some(Duration::from_secs(10)),
                "{s}"
            );
        }
        assert_eq!(
            answer(502, Some(Failure::LeaderLost), None).negative_ttl(&p),
            None
        );
    }

    #[test]
    fn the_wire_form_round_trips() {
        let mut a = answer(429, None, Some(5));
        a.body = Bytes::from_static(b"{\"x\":\"line\\nbreak\"}\n\x00\xff");
        a.cache_ttl = Some(Duration::from_millis(1234));
        let b = Answer::from_wire(&a.to_wire()).unwrap();
        assert_eq!(
            (b.status, b.form, &b.body, b.retry_after, b.cache_ttl),
            (a.status, a.form, &a.body, a.retry_after, a.cache_ttl)
        );
        let f = Answer::from_failure(Failure::Timeout, "t", "p".into(), "m".into());
        assert_eq!(
            Answer::from_wire(&f.to_wire()).unwrap().failure,
            Some(Failure::Timeout)
        );
        assert!(Answer::from_wire(b"garbage").is_none());
    }

    fn success(form: Form, body: &str) -> Answer {
        let mut a = answer(200, None, None);
        a.form = form;
        a.body = Bytes::from(body.to_string());
        a
    }

    const GOOD: &str = r#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#;

    /// What parsing a plain body into a `Value` said before the probe: the
    /// verdict and the tokens.
    fn verdict_of_the_tree(body: &[u8]) -> (String, Option<Tokens>) {
        if body.is_empty() {
            return (format!("{:?}", Some(Malformed::Empty)), None);
        }
        match serde_json::from_slice::<Value>(body) {
            Err(e) => (format!("{:?}", Some(Malformed::NotJson(e))), None),
            Ok(v) => match check_completion(&v) {
                Err(why) => (format!("{:?}", Some(why)), None),
                Ok(()) => (
                    format!("{:?}", None::<Malformed>),
                    v.get("usage").and_then(Tokens::of_usage),
                ),
            },
        }
    }

    #[test]
    fn the_probe_gives_the_verdicts_of_the_whole_document_on_odd_answers() {
        let mut deep = String::new();
        for _ in 0..200 {
            deep.push('[');
        }
        for _ in 0..200 {
            deep.push(']');
        }
        let bodies: Vec<Vec<u8>> = [
            GOOD,
            "",
            " ",
            "null",
            "true",
            "\"choices\"",
            "12",
            "[]",
            "[{\"choices\": []}]",
            "{}",
            // a key given twice counts by its last value
            r#"{"choices": [], "choices": [{"message": {}}]}"#,
            r#"{"choices": [{"message": {}}], "choices": []}"#,
            r#"{"error": {"x": 1}, "error": null, "choices": [{"message": {}}]}"#,
            r#"{"error": null, "error": 0, "choices": [{"message": {}}]}"#,
            r#"{"choices": [{"message": {}, "message": "x"}]}"#,
            r#"{"choices": [{"message": "x", "message": {}}]}"#,
            r#"{"usage": {"prompt_tokens": 1}, "choices": [{"message": {}}], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}"#,
            r#"{"usage": {"prompt_tokens": 1}, "choices": [{"message": {}}], "usage": null}"#,
            // escaped keys are the same keys
            r#"{"ch\u006fices": [{"m\u0065ssage": {}}], "\u0065rror": null}"#,
            r#"{"\u0065rror": false, "choices": [{"message": {}}]}"#,
            // every kind of error member, choices and choice
            r#"{"error": "", "choices": [{"message": {}}]}"#,
            r#"{"error": [], "choices": [{"message": {}}]}"#,
            r#"{"choices": {"0": {"message": {}}}}"#,
            r#"{"choices": "x"}"#,
            r#"{"choices": null}"#,
            r#"{"choices": [null]}"#,
            r#"{"choices": [[{"message": {}}]]}"#,
            r#"{"choices": ["x", 1, true]}"#,
            r#"{"choices": [{"message": null}]}"#,
            r#"{"choices": [{"message": []}]}"#,
            r#"{"choices": [{"message": {}}, {"message": 1}, {}]}"#,
            r#"{"choices": [{"message": {"content": [1, {"a": [null]}]}}], "x": [[[]]]}"#,
            // not JSON, wherever it hides
            r#"{"x": 1e999, "choices": [{"message": {}}]}"#,
            r#"{"x": -1e999, "choices": [{"message": {}}]}"#,
            r#"{"x": 123456789012345678901234567890, "choices": [{"message": {}}]}"#,
            r#"{"x": "\ud800", "choices": [{"message": {}}]}"#,
            r#"{"x": "\udc00\ud800", "choices": [{"message": {}}]}"#,
            r#"{"x": "\q", "choices": [{"message": {}}]}"#,
            r#"{"x": 01, "choices": [{"message": {}}]}"#,
            r#"{"x": 1., "choices": [{"message": {}}]}"#,
            r#"{"x": [1,], "choices": [{"message": {}}]}"#,
            r#"{"x": {"a": 1,}, "choices": [{"message": {}}]}"#,
            r#"{"choices": [{"message": {}}]} x"#,
            r#"{"choices": [{"message": {}}]}  "#,
            "{\"choices\": [{\"message\": {}}], \"x\": \"tab\there\"}",
        ]
        .iter()
        .map(|b| b.as_bytes().to_vec())
        .chain([
            b"{\"x\": \"\xff\", \"choices\": [{\"message\": {}}]}".to_vec(),
            b"\xef\xbb\xbf{\"choices\": [{\"message\": {}}]}".to_vec(),
            format!(r#"{{"x": {deep}, "choices": [{{"message": {{}}}}]}}"#).into_bytes(),
            format!(r#"{{"choices": [{{"message": {{"content": {deep}}}}}]}}"#).into_bytes(),
            GOOD.as_bytes()[..GOOD.len() - 1].to_vec(),
        ])
        .collect();
        for body in bodies {
            let answer = success(Form::Plain, "");
            let answer = Answer {
                body: Bytes::from(body.clone()),
                ..answer
            };
            let probed = (
                format!("{:?}", answer.malformed()),
                answer.rendered.tokens.get().copied().flatten(),
            );
            assert_eq!(
                probed,
                verdict_of_the_tree(&body),
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
    }

    #[test]
    fn a_success_that_is_no_chat_completion_is_malformed() {
        assert!(success(Form::Plain, GOOD).malformed().is_none());
        let plain = |body: &str| success(Form::Plain, body).malformed();
        assert!(matches!(plain(""), Some(Malformed::Empty)));
        assert!(matches!(
            plain("<html>502</html>"),
            Some(Malformed::NotJson(_))
        ));
        assert!(matches!(
            plain(&GOOD[..GOOD.len() / 2]),
            Some(Malformed::NotJson(_))
        ));
        assert!(matches!(plain("[1, 2]"), Some(Malformed::NotAnObject)));
        assert!(matches!(
            plain(r#"{"error": {"message": "overloaded", "type": "server_error"}}"#),
            Some(Malformed::ErrorObject)
        ));
        assert!(matches!(
            plain(r#"{"object": "chat.completion", "choices": []}"#),
            Some(Malformed::NoChoices)
        ));
        assert!(matches!(
            plain(r#"{"object": "chat.completion"}"#),
            Some(Malformed::NoChoices)
        ));
        assert!(matches!(
            plain(r#"{"choices": [{"index": 0, "text": "legacy"}]}"#),
            Some(Malformed::NoMessage(0))
        ));
        // `"error": null` is no error.
        let with_null_error = GOOD.replacen('{', r#"{"error":null,"#, 1);
        assert!(plain(&with_null_error).is_none());

        let stream = |body: &str| success(Form::Stream, body).malformed();
        let chunk = |delta: &str, finish: &str| {
            format!(
                "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{delta},\"finish_reason\":{finish}}}]}}\n\n"
            )
        };
        let whole = format!(
            "{}{}{}data: [DONE]\n\n",
            chunk(r#"{"role":"assistant","content":""}"#, "null"),
            chunk(r#"{"content":"hi"}"#, "null"),
            chunk("{}", "\"stop\"")
        );
        let ok = success(Form::Stream, &whole);
        assert!(ok.malformed().is_none());
        // The plain form was assembled once, on the way.
        assert!(ok.rendered.plain.get().is_some());
        assert_eq!(
            ok.plain_json().unwrap()["choices"][0]["message"]["content"],
            "hi"
        );
        let without_done = format!(
            "{}{}",
            chunk(r#"{"role":"assistant","content":""}"#, "null"),
            chunk(r#"{"content":"hi"}"#, "null")
        );
        assert!(matches!(
            stream(&without_done),
            Some(Malformed::Stream(SseError::Truncated))
        ));
        assert!(matches!(
            stream(""),
            Some(Malformed::Stream(SseError::Empty))
        ));
        let no_choices = "data: {\"id\":\"c\",\"choices\":[]}\n\ndata: [DONE]\n\n";
        assert!(matches!(stream(no_choices), Some(Malformed::NoChoices)));
        let error = format!(
            "{}data: {{\"error\":{{\"message\":\"x\"}}}}\n\n",
            chunk("{}", "null")
        );
        assert!(matches!(
            stream(&error),
            Some(Malformed::Stream(SseError::Upstream(_)))
        ));

        // Errors are not checked: their body need not be a completion.
        let mut e = answer(500, None, None);
        e.body = Bytes::from_static(b"<html>oops</html>");
        assert!(e.malformed().is_none());
    }

    #[test]
    fn a_bad_answer_is_a_failed_attempt_cached_like_a_5xx() {
        let p = RouteCache::default();
        let bad = success(Form::Plain, "<html>").into_bad(&Malformed::Empty);
        assert_eq!(bad.status, StatusCode::BAD_GATEWAY);
        assert!(!bad.is_success() && !bad.is_request_error());
        assert_eq!(bad.verdict(), Verdict::Failed("bad_upstream_answer"));
        assert_eq!(bad.negative_ttl(&p), Some(p.server_error_ttl));
        let body: Value = serde_json::from_slice(&bad.body).unwrap();
        assert_eq!(body["error"]["code"], "bad_upstream_answer");
        assert_eq!(body["error"]["type"], "upstream_error");
        let big = Answer::from_failure(Failure::TooLarge, "big", "p".into(), "m".into());
        assert_eq!(big.status, StatusCode::BAD_GATEWAY);
        assert_eq!(big.verdict(), Verdict::Failed("upstream_answer_too_large"));
        assert_eq!(big.negative_ttl(&p), Some(p.server_error_ttl));
        let body: Value = serde_json::from_slice(&big.body).unwrap();
        assert_eq!(body["error"]["code"], "upstream_answer_too_large");
        // Both cross replicas as what they are.
        for f in [Failure::BadAnswer, Failure::TooLarge] {
            let a = Answer::from_failure(f, "x", "p".into(), "m".into());
            assert_eq!(Answer::from_wire(&a.to_wire()).unwrap().failure, Some(f));
        }
    }

    #[test]
    fn an_answer_weighs_its_body_and_its_rendered_forms() {
        let a = success(Form::Plain, GOOD);
        let bare = a.size_bytes();
        assert_eq!(bare, GOOD.len() + 2);
        let stream = a.stream_body(false);
        assert_eq!(a.size_bytes(), bare + stream.len());
    }

    #[test]
    fn timeouts_are_unknown_never_failed() {
        assert_eq!(
            answer(504, Some(Failure::Timeout), None).verdict(),
            Verdict::Unknown("timeout")
        );
        assert_eq!(
            answer(502, Some(Failure::Broken), None).verdict(),
            Verdict::Unknown("connection_lost")
        );
        assert_eq!(
            answer(502, None, None).verdict(),
            Verdict::Unknown("intermediary_error")
        );
        assert_eq!(
            answer(504, None, None).verdict(),
            Verdict::Unknown("intermediary_error")
        );
        assert_eq!(
            answer(502, Some(Failure::Connect), None).verdict(),
            Verdict::Failed("connect_error")
        );
        assert_eq!(
            answer(500, None, None).verdict(),
            Verdict::Failed("provider_error")
        );
        assert_eq!(
            answer(429, None, None).verdict(),
            Verdict::Failed("rate_limited")
        );
        assert_eq!(
            answer(400, None, None).verdict(),
            Verdict::Failed("request_rejected")
        );
        assert_eq!(answer(200, None, None).verdict(), Verdict::Succeeded);
    }
}
