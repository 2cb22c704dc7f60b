//! A finished upstream answer as idem keeps and hands it out: what a flight
//! ends with, what the result cache stores, what a job's attempt reports.
//!
//! An [`Answer`] is immutable and shared behind an `Arc`; it remembers the
//! form the provider used (plain JSON or an SSE stream) and renders either
//! form on demand, so a follower gets the answer in the form it asked for.
//! [`Verdict`] classifies it the way SPEC section 5 does (`succeeded`,
//! `failed`: the provider certainly did not do the work, `unknown`: it may
//! have), and [`Answer::negative_ttl`] applies the cache table of section 4.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use reqwest::StatusCode;

use crate::config::RouteCache;
use crate::http::error::error_body;
use crate::providers::CallError;

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
}

/// How an attempt ended (SPEC section 5).
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

/// Lazily rendered forms of an answer's body.
#[derive(Debug, Clone, Default)]
pub struct Rendered {
    plain: OnceLock<Bytes>,
    stream: OnceLock<Bytes>,
    stream_with_usage: OnceLock<Bytes>,
    usage: OnceLock<Option<(u64, u64)>>,
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
        };
        let body = error_body(message, "upstream_error", code, None);
        Answer {
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

    pub fn from_call_error(e: &CallError, provider: Arc<str>, model: Arc<str>) -> Answer {
        let failure = match e {
            CallError::Connect { .. } => Failure::Connect,
            CallError::Timeout { .. } => Failure::Timeout,
            CallError::Broken { .. } => Failure::Broken,
        };
        // The client sees which provider failed and how, never addresses.
        let message = match failure {
            Failure::Connect => format!("provider {provider} is unreachable"),
            Failure::Timeout => format!("provider {provider} did not answer in time"),
            _ => format!("the connection to provider {provider} was lost"),
        };
        Answer::from_failure(failure, &message, provider, model)
    }

    pub fn is_success(&self) -> bool {
        self.failure.is_none() && self.status.is_success()
    }

    /// SPEC section 5's classification of an attempt's outcome.
    pub fn verdict(&self) -> Verdict {
        match self.failure {
            Some(Failure::Connect) => return Verdict::Failed("connect_error"),
            Some(Failure::Timeout) => return Verdict::Unknown("timeout"),
            Some(Failure::Broken) => return Verdict::Unknown("connection_lost"),
            Some(Failure::LeaderLost) => return Verdict::Unknown("leader_lost"),
            Some(Failure::Contract) => return Verdict::Failed("contract_violation"),
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
            Some(Failure::Broken) | Some(Failure::Connect) => Some(policy.server_error_ttl),
            // idem's own trouble is not the provider's: never cached.
            Some(Failure::LeaderLost) | Some(Failure::Contract) => None,
            None => match self.status.as_u16() {
                429 | 504 => rate_limited(),
                _ => Some(policy.server_error_ttl),
            },
        }
    }

    /// The body as a plain `chat.completion` JSON document.
    pub fn plain_body(&self) -> Bytes {
        match self.form {
            Form::Plain => self.body.clone(),
            Form::Stream => self.rendered.plain.get_or_init(|| self.assemble()).clone(),
        }
    }

    fn assemble(&self) -> Bytes {
        match crate::sse::assemble(&self.body) {
            Ok(v) => Bytes::from(v.to_string()),
            Err(e) => {
                tracing::warn!(error = %e, "cannot assemble a streamed answer");
                Bytes::from(
                    error_body(
                        "the provider's stream could not be assembled",
                        "upstream_error",
                        "bad_upstream_stream",
                        None,
                    )
                    .to_string(),
                )
            }
        }
    }

    /// The body as an SSE stream (only meaningful for a success).
    pub fn stream_body(&self, include_usage: bool) -> Bytes {
        if self.form == Form::Stream {
            return self.body.clone();
        }
        let slot = if include_usage {
            &self.rendered.stream_with_usage
        } else {
            &self.rendered.stream
        };
        slot.get_or_init(
            || match serde_json::from_slice::<serde_json::Value>(&self.body) {
                Ok(v) => crate::sse::synthesize(&v, include_usage),
                Err(_) => self.body.clone(),
            },
        )
        .clone()
    }

    /// The assistant content of the first choice, for contracts and logs.
    pub fn completion_json(&self) -> Option<serde_json::Value> {
        match self.form {
            Form::Plain => serde_json::from_slice(&self.body).ok(),
            Form::Stream => crate::sse::assemble(&self.body).ok(),
        }
    }

    /// Token counts reported by the provider, if any (parsed once).
    pub fn usage(&self) -> Option<(u64, u64)> {
        *self.rendered.usage.get_or_init(|| {
            let v = self.completion_json()?;
            let u = v.get("usage")?;
            Some((
                u.get("prompt_tokens")?.as_u64()?,
                u.get("completion_tokens")?.as_u64()?,
            ))
        })
    }
}

/// How an answer travels between replicas (the Redis backend): one line of
/// JSON metadata, a newline, then the body bytes as they are.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct WireMeta {
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
        }
    }

    fn parse(s: &str) -> Option<Failure> {
        [
            Failure::Connect,
            Failure::Timeout,
            Failure::Broken,
            Failure::LeaderLost,
            Failure::Contract,
        ]
        .into_iter()
        .find(|f| f.as_str() == s)
    }
}

impl Answer {
    /// The wire form (see [`Answer::from_wire`]).
    pub fn to_wire(&self) -> Vec<u8> {
        let meta = WireMeta {
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
        Some(Answer {
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
