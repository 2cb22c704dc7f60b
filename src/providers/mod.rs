//! Providers: the upstream LLM APIs idem calls, last stage of the request
//! path. The core speaks one wire format, OpenAI's; each provider kind is a
//! [`Dialect`] that turns a call into its own HTTP request and reads its
//! reply back in OpenAI's format: [`openai`] (any OpenAI-compatible base
//! URL), [`azure`] (Azure OpenAI deployments) and [`anthropic`] (the
//! Messages API, translated both ways). Calls go over a pooled keep-alive
//! HTTP client; kind `mock` answers in-process (the embedded default and the
//! demo).
//!
//! A provider call never sees the client's headers: idem sends only the body,
//! its own content type, and the provider's own key. Whatever happens is
//! reported as an [`UpstreamReply`] (the provider answered with a status) or
//! a [`CallError`] whose variant says whether the provider may have done the
//! work (docs/design.md, "Jobs and attempts": `failed` versus `unknown`).

pub mod anthropic;
pub mod azure;
pub mod breaker;
pub mod openai;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures_util::{Stream, StreamExt};
use reqwest::StatusCode;
use reqwest::header::{self, HeaderValue};
use secrecy::SecretString;

use crate::answer::{Answer, Failure};
use crate::config::{Config, ProviderConfig, ProviderKind};

/// A body as it arrives from the provider, chunk by chunk.
pub type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, CallError>> + Send>>;

/// Why a call produced no complete answer.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// The request never reached the provider: the work was certainly not done.
    #[error("cannot connect to provider {provider}: {source}")]
    Connect {
        provider: Arc<str>,
        #[source]
        source: reqwest::Error,
    },
    /// No answer within the timeout after sending: the work may have been done.
    #[error("provider {provider} did not answer within {after:?}")]
    Timeout { provider: Arc<str>, after: Duration },
    /// The connection broke after the request was sent.
    #[error("connection to provider {provider} lost: {source}")]
    Broken {
        provider: Arc<str>,
        #[source]
        source: reqwest::Error,
    },
    /// The request cannot be said in the provider's wire format (a field
    /// its API has no equivalent for): nothing was sent.
    #[error("provider {provider} cannot take this request: {reason}")]
    Untranslatable { provider: Arc<str>, reason: String },
}

impl CallError {
    /// True when the provider certainly did not do the work.
    pub fn definitely_not_done(&self) -> bool {
        matches!(
            self,
            CallError::Connect { .. } | CallError::Untranslatable { .. }
        )
    }

    /// True when a request went out (and is counted as an upstream call).
    pub fn was_sent(&self) -> bool {
        !matches!(self, CallError::Untranslatable { .. })
    }

    /// The answer idem writes for this failure of `provider`'s `model`.
    pub fn answer(&self, provider: Arc<str>, model: Arc<str>) -> Answer {
        let failure = match self {
            CallError::Connect { .. } => Failure::Connect,
            CallError::Timeout { .. } => Failure::Timeout,
            CallError::Broken { .. } => Failure::Broken,
            // Refused before it was sent, as the provider would refuse a
            // request it cannot take: a 400 shared with the flight's
            // followers (their request is the same), never cached.
            CallError::Untranslatable { reason, .. } => {
                let message = format!("provider {provider} cannot take this request: {reason}");
                let body = crate::answer::error_body(
                    &message,
                    "invalid_request_error",
                    "unsupported_by_provider",
                    None,
                );
                let mut answer = Answer::from_failure(Failure::Connect, "", provider, model);
                answer.failure = None;
                answer.status = StatusCode::BAD_REQUEST;
                answer.body = Bytes::from(body.to_string());
                return answer;
            }
        };
        // The client sees which provider failed and how, never addresses.
        let message = match failure {
            Failure::Connect => format!("provider {provider} is unreachable"),
            Failure::Timeout => format!("provider {provider} did not answer in time"),
            _ => format!("the connection to provider {provider} was lost"),
        };
        Answer::from_failure(failure, &message, provider, model)
    }
}

/// The provider's answer head and its body stream.
pub struct UpstreamReply {
    pub status: StatusCode,
    pub content_type: Option<HeaderValue>,
    pub retry_after: Option<Duration>,
    /// True when the body is an SSE stream.
    pub streaming: bool,
    pub body: BodyStream,
}

/// How one kind of provider is spoken to: the HTTP request a call makes of
/// idem's request (OpenAI's wire format, carrying the target's model), and
/// the provider's reply read back in OpenAI's wire format, so that nothing
/// after the provider (the flight, the caches, the checks, the renderings)
/// knows which kind answered. Errors keep their meaning across kinds: the
/// status a reply is read back with classifies it as the attempt
/// outcomes of docs/design.md, "Jobs and attempts", do.
pub trait Dialect: Send + Sync + std::fmt::Debug {
    /// The request of a call to `endpoint` for the upstream `model` (the
    /// body carries it too), or why this kind cannot take it (nothing is
    /// sent then).
    fn request(&self, endpoint: Endpoint, model: &str, body: Bytes) -> Result<Outgoing, String>;

    /// The provider's reply to `outgoing`, in OpenAI's wire format. `limit`
    /// is the provider's `max_answer_bytes`: a reply that must be read whole
    /// before it can be translated is read no further than that.
    fn reply(&self, reading: &Reading, reply: UpstreamReply, limit: usize) -> UpstreamReply {
        let _ = (reading, limit);
        reply
    }

    /// The request that counts a chat request's prompt tokens, when the
    /// provider's API has one (certification uses it where idem knows no
    /// tokenizer for the model); its answer is `{"input_tokens": N}`.
    fn count_tokens(&self, model: &str, body: Bytes) -> Option<Result<Outgoing, String>> {
        let _ = (model, body);
        None
    }
}

/// An HTTP request to a provider.
#[derive(Debug)]
pub struct Outgoing {
    pub url: reqwest::Url,
    /// The provider's own headers (its key among them); idem adds the
    /// content type.
    pub headers: Vec<(header::HeaderName, HeaderValue)>,
    pub body: Bytes,
    /// What reading the reply needs to know of the request.
    pub reading: Reading,
}

/// What a dialect's reply translation needs to know of its request.
#[derive(Debug, Clone, Default)]
pub struct Reading {
    /// The request asked for a stream.
    pub stream: bool,
    /// The request asked for a usage chunk at the end of its stream.
    pub include_usage: bool,
    /// The name of the tool that carries a `response_format`'s JSON
    /// (Anthropic): its input is the answer's content.
    pub json_tool: Option<String>,
    /// The call went to a Responses API (`responses_api = true`): its reply
    /// is read back into chat.
    pub responses: bool,
}

impl Reading {
    /// What a chat request says of its reply's form: whether it streams,
    /// and whether its stream ends with usage (`stream_options`).
    pub fn of_chat(chat: &serde_json::Map<String, serde_json::Value>) -> Reading {
        let stream = chat.get("stream").and_then(serde_json::Value::as_bool) == Some(true);
        let include_usage = stream
            && chat
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(serde_json::Value::as_bool)
                == Some(true);
        Reading {
            stream,
            include_usage,
            ..Reading::default()
        }
    }
}

/// One configured provider.
pub struct Provider {
    pub name: Arc<str>,
    pub kind: ProviderKind,
    pub timeout: Duration,
    /// The largest answer taken from it (`max_answer_bytes`).
    pub max_answer_bytes: usize,
    /// Streamed calls ask for usage (`stream_usage`).
    pub stream_usage: bool,
    /// A Responses request of idem's Responses face goes to its Responses
    /// API as the client wrote it (`responses_api`).
    pub responses_api: bool,
    upstream: Upstream,
    client: reqwest::Client,
    mock_seq: AtomicU64,
}

impl std::fmt::Debug for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Provider")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

/// The provider API a call goes to: one per endpoint idem serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// Chat completions (`POST {base_url}/chat/completions` of an
    /// OpenAI-compatible provider).
    Chat,
    /// Embeddings (`POST {base_url}/embeddings`).
    Embeddings,
}

/// Where a provider's calls go.
#[derive(Debug)]
enum Upstream {
    /// `kind = "mock"`: answered in process.
    Mock,
    /// Over HTTP, in this dialect.
    Http(Box<dyn Dialect>),
}

/// True when `Authorization: Bearer <key>` is a valid header value (and so
/// is the key in a header of its own).
fn can_be_bearer(key: &str) -> bool {
    HeaderValue::from_str(&format!("Bearer {key}")).is_ok()
}

/// Provider set-up failures (at start-up only).
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    #[error("provider {provider}: environment variable {var} (api_key_env) is not set")]
    MissingKey { provider: String, var: String },
    #[error("provider {provider}: cannot build HTTP client: {source}")]
    Client {
        provider: String,
        #[source]
        source: reqwest::Error,
    },
    #[error(
        "provider {provider}: the key in {var} (api_key_env) has characters an HTTP header cannot carry (a line break or a control character)"
    )]
    UnsendableKey { provider: String, var: String },
    #[error("provider {provider}: base_url: {reason}")]
    BaseUrl { provider: String, reason: String },
}

/// A provider's key, from the environment variable its `api_key_env`
/// names (none without one).
fn read_key(config: &ProviderConfig) -> Result<Option<SecretString>, ProviderError> {
    let Some(var) = &config.api_key_env else {
        return Ok(None);
    };
    match std::env::var(var) {
        // A key an HTTP header cannot carry would fail every call after it
        // was counted as sent: refuse it here.
        Ok(v) if !v.is_empty() && !can_be_bearer(&v) => Err(ProviderError::UnsendableKey {
            provider: config.name.clone(),
            var: var.clone(),
        }),
        Ok(v) if !v.is_empty() => Ok(Some(SecretString::from(v))),
        _ => Err(ProviderError::MissingKey {
            provider: config.name.clone(),
            var: var.clone(),
        }),
    }
}

/// The provider keys this environment lacks, or has in a form no HTTP
/// header can carry: each would stop `idem serve` here. (`idem check`
/// reports them without failing: a config is often checked where the
/// secrets are not.)
pub fn key_problems(config: &Config) -> Vec<ProviderError> {
    config
        .providers
        .iter()
        .filter_map(|p| read_key(p).err())
        .collect()
}

impl Provider {
    pub fn new(config: &ProviderConfig) -> Result<Provider, ProviderError> {
        let api_key = read_key(config)?;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(config.pool_max_idle)
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true)
            .connect_timeout(config.timeout.min(Duration::from_secs(10)))
            .build()
            .map_err(|e| ProviderError::Client {
                provider: config.name.clone(),
                source: e,
            })?;
        let bad = |reason| ProviderError::BaseUrl {
            provider: config.name.clone(),
            reason,
        };
        let upstream = match config.kind {
            ProviderKind::Mock => Upstream::Mock,
            ProviderKind::Openai => Upstream::Http(Box::new(
                openai::OpenAi::new(&config.base_url, api_key, config.responses_api)
                    .map_err(bad)?,
            )),
            ProviderKind::Azure => {
                Upstream::Http(Box::new(azure::Azure::new(config, api_key).map_err(bad)?))
            }
            ProviderKind::Anthropic => Upstream::Http(Box::new(
                anthropic::Anthropic::new(config, api_key).map_err(bad)?,
            )),
        };
        Ok(Provider {
            name: Arc::from(config.name.as_str()),
            kind: config.kind,
            timeout: config.timeout,
            max_answer_bytes: config.max_answer_bytes,
            stream_usage: config.stream_usage,
            responses_api: config.responses_api,
            upstream,
            client,
            mock_seq: AtomicU64::new(0),
        })
    }

    /// Sends a body (already carrying the upstream `model`) to `endpoint` and
    /// returns once the provider has answered with a status, in OpenAI's
    /// wire format whatever its kind. `timeout` bounds the wait for the head
    /// and every pause between body chunks.
    pub async fn send(
        &self,
        endpoint: Endpoint,
        model: &str,
        body: Bytes,
        timeout: Duration,
        traceparent: Option<&str>,
    ) -> Result<UpstreamReply, CallError> {
        match &self.upstream {
            Upstream::Mock => Ok(self.mock_reply(endpoint, &body)),
            Upstream::Http(dialect) => {
                let mut outgoing = dialect.request(endpoint, model, body).map_err(|reason| {
                    CallError::Untranslatable {
                        provider: self.name.clone(),
                        reason,
                    }
                })?;
                // The W3C trace context of the call's span (traces on).
                if let Some(tp) = traceparent.and_then(|t| HeaderValue::from_str(t).ok()) {
                    outgoing
                        .headers
                        .push((header::HeaderName::from_static("traceparent"), tp));
                }
                let reading = outgoing.reading.clone();
                let reply = self.http_send(outgoing, timeout).await?;
                Ok(dialect.reply(&reading, reply, self.max_answer_bytes))
            }
        }
    }

    /// The prompt tokens of a chat request (`body`, carrying the upstream
    /// model) as the provider counts them, when its API can: `None` when it
    /// cannot, else the count or why there is none.
    pub async fn count_tokens(&self, model: &str, body: Bytes) -> Option<Result<u32, String>> {
        let Upstream::Http(dialect) = &self.upstream else {
            return None;
        };
        let outgoing = match dialect.count_tokens(model, body)? {
            Ok(o) => o,
            Err(e) => return Some(Err(e)),
        };
        Some(self.read_count(outgoing).await)
    }

    async fn read_count(&self, outgoing: Outgoing) -> Result<u32, String> {
        let reply = self
            .http_send(outgoing, self.timeout)
            .await
            .map_err(|e| e.to_string())?;
        let mut whole = Vec::new();
        let mut body = reply.body;
        while let Some(chunk) = body.next().await {
            whole.extend_from_slice(&chunk.map_err(|e| e.to_string())?);
            if whole.len() > 64 * 1024 {
                return Err("the token count's answer is too large".into());
            }
        }
        if !reply.status.is_success() {
            return Err(format!(
                "the token count answered HTTP {}",
                reply.status.as_u16()
            ));
        }
        serde_json::from_slice::<serde_json::Value>(&whole)
            .ok()
            .and_then(|v| v.get("input_tokens")?.as_u64())
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| "the token count's answer has no input_tokens".to_string())
    }

    async fn http_send(
        &self,
        outgoing: Outgoing,
        timeout: Duration,
    ) -> Result<UpstreamReply, CallError> {
        let mut req = self
            .client
            .post(outgoing.url)
            .header(header::CONTENT_TYPE, "application/json")
            .body(outgoing.body);
        for (name, value) in outgoing.headers {
            req = req.header(name, value);
        }
        let resp = match tokio::time::timeout(timeout, req.send()).await {
            Err(_) => {
                return Err(CallError::Timeout {
                    provider: self.name.clone(),
                    after: timeout,
                });
            }
            Ok(Err(e)) if e.is_connect() => {
                return Err(CallError::Connect {
                    provider: self.name.clone(),
                    source: e,
                });
            }
            Ok(Err(e)) if e.is_timeout() => {
                return Err(CallError::Timeout {
                    provider: self.name.clone(),
                    after: timeout,
                });
            }
            Ok(Err(e)) => {
                return Err(CallError::Broken {
                    provider: self.name.clone(),
                    source: e,
                });
            }
            Ok(Ok(resp)) => resp,
        };
        let status = resp.status();
        let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
        let streaming = content_type
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let retry_after = resp
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let provider = self.name.clone();
        let body = idle_bounded(resp.bytes_stream(), timeout, provider);
        Ok(UpstreamReply {
            status,
            content_type,
            retry_after,
            streaming,
            body,
        })
    }

    fn mock_reply(&self, endpoint: Endpoint, body: &[u8]) -> UpstreamReply {
        let seq = self.mock_seq.fetch_add(1, Ordering::Relaxed) + 1;
        let request: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        if endpoint == Endpoint::Embeddings {
            // The mock provider's own answer, or its 400 for a request
            // OpenAI would refuse.
            let (status, text) = crate::mock_upstream::embeddings_answer(&request);
            return UpstreamReply {
                status,
                content_type: Some(HeaderValue::from_static("application/json")),
                retry_after: None,
                streaming: false,
                body: Box::pin(futures_util::stream::iter([Ok(Bytes::from(text))])),
            };
        }
        let stream = request
            .get("stream")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        if stream {
            let chunks = crate::mock_upstream::completion_chunks(&request, seq, None);
            let events = chunks
                .into_iter()
                .map(|c| Ok(Bytes::from(format!("data: {c}\n\n"))))
                .chain(std::iter::once(Ok(Bytes::from_static(b"data: [DONE]\n\n"))));
            UpstreamReply {
                status: StatusCode::OK,
                content_type: Some(HeaderValue::from_static("text/event-stream")),
                retry_after: None,
                streaming: true,
                body: Box::pin(futures_util::stream::iter(events)),
            }
        } else {
            let completion = crate::mock_upstream::completion(&request, seq, None);
            let bytes = Bytes::from(completion.to_string());
            UpstreamReply {
                status: StatusCode::OK,
                content_type: Some(HeaderValue::from_static("application/json")),
                retry_after: None,
                streaming: false,
                body: Box::pin(futures_util::stream::iter([Ok(bytes)])),
            }
        }
    }
}

/// Wraps a body stream so that a pause longer than `idle` ends it with a
/// timeout, and transport errors become [`CallError::Broken`].
fn idle_bounded(
    inner: impl Stream<Item = Result<Bytes, reqwest::Error>> + Send + 'static,
    idle: Duration,
    provider: Arc<str>,
) -> BodyStream {
    let inner = Box::pin(inner);
    Box::pin(futures_util::stream::unfold(
        (inner, provider, false),
        move |(mut inner, provider, ended)| async move {
            if ended {
                return None;
            }
            match tokio::time::timeout(idle, inner.next()).await {
                Err(_) => {
                    let e = CallError::Timeout {
                        provider: provider.clone(),
                        after: idle,
                    };
                    Some((Err(e), (inner, provider, true)))
                }
                Ok(None) => None,
                Ok(Some(Ok(b))) => Some((Ok(b), (inner, provider, false))),
                Ok(Some(Err(e))) => {
                    let err = if e.is_timeout() {
                        CallError::Timeout {
                            provider: provider.clone(),
                            after: idle,
                        }
                    } else {
                        CallError::Broken {
                            provider: provider.clone(),
                            source: e,
                        }
                    };
                    Some((Err(err), (inner, provider, true)))
                }
            }
        },
    ))
}

/// Every configured provider by name.
#[derive(Debug, Default)]
pub struct Providers {
    by_name: HashMap<String, Arc<Provider>>,
}

impl Providers {
    pub fn from_config(config: &Config) -> Result<Providers, ProviderError> {
        Providers::reusing(config, None)
    }

    /// The providers of `config`, keeping those of `before` (the
    /// configuration in force and its providers) whose settings did not
    /// change: their connection pools stay warm across a reload.
    pub fn reusing(
        config: &Config,
        before: Option<(&Config, &Providers)>,
    ) -> Result<Providers, ProviderError> {
        let mut by_name = HashMap::new();
        for p in &config.providers {
            let kept = before.and_then(|(old, providers)| {
                let same = old.provider(&p.name).is_some_and(|o| Config::same(o, p));
                same.then(|| providers.get(&p.name).cloned()).flatten()
            });
            let provider = match kept {
                Some(provider) => provider,
                None => Arc::new(Provider::new(p)?),
            };
            by_name.insert(p.name.clone(), provider);
        }
        Ok(Providers { by_name })
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Provider>> {
        self.by_name.get(name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Provider>> {
        self.by_name.values()
    }
}

/// The body read whole (no further than `limit`: past it, what was read is
/// handed on untranslated and the reader's own limit refuses it), then
/// `translate`d.
pub(crate) fn whole_then(
    body: BodyStream,
    limit: usize,
    translate: impl FnOnce(Bytes) -> Bytes + Send + 'static,
) -> BodyStream {
    Box::pin(futures_util::stream::once(async move {
        let mut body = body;
        let mut buf = BytesMut::new();
        while let Some(chunk) = body.next().await {
            buf.extend_from_slice(&chunk?);
            if buf.len() > limit {
                return Ok(buf.freeze());
            }
        }
        Ok(translate(buf.freeze()))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_with_a_line_break_cannot_be_a_bearer_token() {
        assert!(can_be_bearer("sk-abc_DEF-123"));
        assert!(!can_be_bearer("sk-abc\n"));
        assert!(!can_be_bearer("sk-\u{7f}abc"));
    }
}
