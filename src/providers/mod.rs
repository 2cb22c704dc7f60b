//! Providers: the upstream LLM APIs idem calls, last stage of the request
//! path. Each provider kind is an [`Api`]: which dialects it speaks and the
//! HTTP request of a call in one of them (its URL, its key): [`openai`]
//! (any OpenAI-compatible base URL: chat completions, embeddings, and the
//! Responses API with `responses_api`), [`azure`] (Azure OpenAI
//! deployments: chat completions and embeddings) and [`anthropic`] (the
//! Messages API and its token count), and [`batch_api`], an `openai`
//! provider's own Batch API. A body goes as it is and the reply
//! comes back as it is: translating between dialects is `translate`'s, not
//! a provider's. Calls go over a pooled keep-alive HTTP client; kind `mock`
//! answers chat and embeddings in-process (the embedded default and the
//! demo).
//!
//! A provider call sees of the client's headers only those that change the
//! answer in its dialect ([`Forwarded`]: `anthropic-beta`, ...); idem adds
//! its own content type and the provider's own key. Whatever happens is
//! reported as an [`UpstreamReply`] (the provider answered with a status) or
//! a [`CallError`] whose variant says whether the provider may have done the
//! work (docs/design.md, "Jobs and attempts": `failed` versus `unknown`).

pub mod anthropic;
pub mod azure;
pub mod batch_api;
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
use crate::dialect::{Dialect, Forwarded};

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

    /// This error with every cause under it (`error sending request` says
    /// nothing; `Connection refused`, a DNS failure or a certificate error
    /// does), for the log: the client is told less.
    pub fn with_causes(&self) -> String {
        let mut out = self.to_string();
        // The first source is in the message already.
        let mut next = std::error::Error::source(self).and_then(std::error::Error::source);
        while let Some(cause) = next {
            let text = cause.to_string();
            if !out.contains(&text) {
                out.push_str(": ");
                out.push_str(&text);
            }
            next = cause.source();
        }
        out
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

/// How one kind of provider is spoken to: the dialects its API speaks,
/// and the HTTP request of a call in one of them.
pub trait Api: Send + Sync + std::fmt::Debug {
    fn speaks(&self, dialect: Dialect) -> bool;

    /// The request of a call in `dialect` to the upstream `model` (the body
    /// carries it too), with the client's `forwarded` headers, or why this
    /// kind cannot take it (nothing is sent then).
    fn request(
        &self,
        dialect: Dialect,
        model: &str,
        body: Bytes,
        forwarded: &Forwarded,
    ) -> Result<Outgoing, String>;
}

/// An HTTP request to a provider.
#[derive(Debug)]
pub struct Outgoing {
    pub url: reqwest::Url,
    /// The provider's own headers (its key among them) and the client's
    /// forwarded ones; idem adds the content type.
    pub headers: Vec<(header::HeaderName, HeaderValue)>,
    pub body: Bytes,
}

/// A provider's own headers with the client's forwarded ones: a forwarded
/// header replaces the provider's of the same name (`anthropic-version`).
fn with_forwarded(
    own: &[(header::HeaderName, HeaderValue)],
    forwarded: &Forwarded,
) -> Vec<(header::HeaderName, HeaderValue)> {
    let mut headers: Vec<_> = own
        .iter()
        .filter(|(name, _)| forwarded.get(name.as_str()).is_none())
        .cloned()
        .collect();
    for (name, value) in forwarded.iter() {
        if let Ok(v) = HeaderValue::from_str(value) {
            headers.push((header::HeaderName::from_static(name), v));
        }
    }
    headers
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
    /// `max_tokens` of a request translated for its Messages API, when the
    /// client set none (kind `anthropic`).
    pub default_max_tokens: u32,
    upstream: Upstream,
    client: reqwest::Client,
    /// Its own Batch API (`batch_api = true`).
    batch: Option<batch_api::BatchApi>,
    mock_seq: AtomicU64,
    /// When a refusal of idem's credentials was last logged.
    auth_warned: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How often a provider's refusal of idem's credentials is logged: every
/// request would repeat it, and once a minute is enough to be seen.
pub const AUTH_WARNING_INTERVAL: Duration = Duration::from_secs(60);

impl std::fmt::Debug for Provider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Provider")
            .field("name", &self.name)
            .field("kind", &self.kind)
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

/// Where a provider's calls go.
#[derive(Debug)]
enum Upstream {
    /// `kind = "mock"`: answered in process.
    Mock,
    /// Over HTTP, to this kind's API.
    Http(Box<dyn Api>),
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
        let batch = if config.batch_api {
            let headers = api_key
                .as_ref()
                .map(|k| {
                    openai::secret_header(
                        reqwest::header::AUTHORIZATION,
                        &format!("Bearer {}", secrecy::ExposeSecret::expose_secret(k)),
                    )
                })
                .transpose()
                .map_err(bad)?
                .into_iter()
                .collect();
            Some(
                batch_api::BatchApi::new(&config.base_url, headers, config.batch_poll_interval)
                    .map_err(bad)?,
            )
        } else {
            None
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
            default_max_tokens: config.max_tokens,
            upstream,
            client,
            batch,
            mock_seq: AtomicU64::new(0),
            auth_warned: std::sync::Mutex::new(None),
        })
    }

    /// Its own Batch API and the client to call it with, when it has one
    /// (`batch_api = true`).
    pub fn batch_api(&self) -> Option<(&batch_api::BatchApi, &reqwest::Client)> {
        self.batch.as_ref().map(|b| (b, &self.client))
    }

    /// True when a refusal of idem's credentials by this provider should be
    /// logged now: once per [`AUTH_WARNING_INTERVAL`].
    pub fn auth_warning_due(&self) -> bool {
        let now = std::time::Instant::now();
        let mut last = self
            .auth_warned
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match *last {
            Some(at) if now.duration_since(at) < AUTH_WARNING_INTERVAL => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }

    /// Whether a call in `dialect` goes to this provider as it is (else it
    /// is translated into the provider's own dialect).
    pub fn speaks(&self, dialect: Dialect) -> bool {
        match &self.upstream {
            Upstream::Mock => matches!(dialect, Dialect::Chat | Dialect::Embeddings),
            Upstream::Http(api) => api.speaks(dialect),
        }
    }

    /// Sends a body in `dialect` (already carrying the upstream `model`) and
    /// returns once the provider has answered with a status; the reply is
    /// as the provider wrote it. `timeout` bounds the wait for the head and
    /// every pause between body chunks.
    pub async fn send(
        &self,
        dialect: Dialect,
        model: &str,
        body: Bytes,
        forwarded: &Forwarded,
        timeout: Duration,
        traceparent: Option<&str>,
    ) -> Result<UpstreamReply, CallError> {
        match &self.upstream {
            Upstream::Mock => Ok(self.mock_reply(dialect, &body)),
            Upstream::Http(api) => {
                let mut outgoing =
                    api.request(dialect, model, body, forwarded)
                        .map_err(|reason| CallError::Untranslatable {
                            provider: self.name.clone(),
                            reason,
                        })?;
                // The W3C trace context of the call's span (traces on).
                if let Some(tp) = traceparent.and_then(|t| HeaderValue::from_str(t).ok()) {
                    outgoing
                        .headers
                        .push((header::HeaderName::from_static("traceparent"), tp));
                }
                self.http_send(outgoing, timeout).await
            }
        }
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

    fn mock_reply(&self, dialect: Dialect, body: &[u8]) -> UpstreamReply {
        let seq = self.mock_seq.fetch_add(1, Ordering::Relaxed) + 1;
        let request: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
        if dialect == Dialect::Embeddings {
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
pub fn whole_then(
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
