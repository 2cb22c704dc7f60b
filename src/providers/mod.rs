//! Providers: the upstream LLM APIs idem calls, last stage of the request
//! path. Kind `openai` speaks to any OpenAI-compatible base URL over a pooled
//! keep-alive HTTP client; kind `mock` answers in-process (the embedded
//! default and the demo).
//!
//! A provider call never sees the client's headers: idem sends only the body,
//! its own content type, and the provider's own key. Whatever happens is
//! reported as an [`UpstreamReply`] (the provider answered with a status) or
//! a [`CallError`] whose variant says whether the provider may have done the
//! work (SPEC section 5: `failed` versus `unknown`).

pub mod breaker;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use reqwest::StatusCode;
use reqwest::header::{self, HeaderValue};
use secrecy::{ExposeSecret, SecretString};

use crate::answer::{Answer, Failure};
use crate::config::{Config, ProviderConfig, ProviderKind, chat_url};

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
}

impl CallError {
    /// True when the provider certainly did not do the work.
    pub fn definitely_not_done(&self) -> bool {
        matches!(self, CallError::Connect { .. })
    }

    /// The answer idem writes for this failure of `provider`'s `model`.
    pub fn answer(&self, provider: Arc<str>, model: Arc<str>) -> Answer {
        let failure = match self {
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

/// One configured provider.
pub struct Provider {
    pub name: Arc<str>,
    pub kind: ProviderKind,
    pub timeout: Duration,
    /// The largest answer taken from it (`max_answer_bytes`).
    pub max_answer_bytes: usize,
    /// Streamed calls ask for usage (`stream_usage`).
    pub stream_usage: bool,
    upstream: Upstream,
    api_key: Option<SecretString>,
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
    /// `POST {base_url}/chat/completions`.
    Chat,
    /// `POST {base_url}/embeddings`.
    Embeddings,
}

/// Where a provider's calls go.
#[derive(Debug)]
enum Upstream {
    /// `kind = "mock"`: answered in process.
    Mock,
    /// The URLs of an OpenAI-compatible provider, parsed once at start-up
    /// rather than on every call.
    Http {
        chat: reqwest::Url,
        embeddings: reqwest::Url,
    },
}

/// True when `Authorization: Bearer <key>` is a valid header value.
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
        let upstream = match config.kind {
            ProviderKind::Mock => Upstream::Mock,
            ProviderKind::Openai => {
                let bad = |reason| ProviderError::BaseUrl {
                    provider: config.name.clone(),
                    reason,
                };
                let chat = chat_url(&config.base_url).map_err(bad)?;
                let base = config.base_url.trim_end_matches('/');
                let embeddings = reqwest::Url::parse(&format!("{base}/embeddings"))
                    .map_err(|e| bad(format!("{base:?} is not a URL: {e}")))?;
                Upstream::Http { chat, embeddings }
            }
        };
        Ok(Provider {
            name: Arc::from(config.name.as_str()),
            kind: config.kind,
            timeout: config.timeout,
            max_answer_bytes: config.max_answer_bytes,
            stream_usage: config.stream_usage,
            upstream,
            api_key,
            client,
            mock_seq: AtomicU64::new(0),
        })
    }

    /// Sends a body (already carrying the upstream model) to `endpoint` and
    /// returns once the provider has answered with a status. `timeout`
    /// bounds the wait for the head and every pause between body chunks.
    pub async fn send(
        &self,
        endpoint: Endpoint,
        body: Bytes,
        timeout: Duration,
    ) -> Result<UpstreamReply, CallError> {
        match &self.upstream {
            Upstream::Mock => Ok(self.mock_reply(endpoint, &body)),
            Upstream::Http { chat, embeddings } => {
                let url = match endpoint {
                    Endpoint::Chat => chat,
                    Endpoint::Embeddings => embeddings,
                };
                self.http_send(url, body, timeout).await
            }
        }
    }

    async fn http_send(
        &self,
        url: &reqwest::Url,
        body: Bytes,
        timeout: Duration,
    ) -> Result<UpstreamReply, CallError> {
        let mut req = self
            .client
            .post(url.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(key) = &self.api_key {
            req = req.bearer_auth(key.expose_secret());
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
        let mut by_name = HashMap::new();
        for p in &config.providers {
            by_name.insert(p.name.clone(), Arc::new(Provider::new(p)?));
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
