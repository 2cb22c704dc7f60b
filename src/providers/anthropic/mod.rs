//! Kind `anthropic`: Anthropic's Messages API (`POST {base_url}/v1/messages`,
//! headers `x-api-key` and `anthropic-version`), spoken in both directions:
//! idem's chat request is translated into a Messages request
//! ([`request`]), and the reply back into a chat completion, a stream of
//! chunks or an OpenAI error ([`reply`], [`stream`]), so that a route may
//! hold Anthropic targets beside OpenAI-compatible ones and fail over
//! between them. Errors keep their meaning: a 429 stays a 429, a 529
//! (`overloaded_error`) is read as a 503, both with the provider's
//! `retry-after`; a 4xx is the request's fault; an `error` event inside a
//! stream is a failed answer. Anthropic has no embeddings API.

pub mod reply;
pub mod request;
pub mod stream;

/// The key of a chat request under which idem's Messages face keeps its
/// client's own Messages request: sent as written ([`request::as_sent`])
/// instead of translated. Other kinds never see it.
pub use crate::shapes::messages::ORIGINAL;

use bytes::Bytes;
use futures_util::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{HeaderName, HeaderValue};
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value};

use super::openai::secret_header;
use super::{BodyStream, Dialect, Endpoint, Outgoing, Reading, UpstreamReply, whole_then};
use crate::config::{ANTHROPIC_BASE_URL, ANTHROPIC_VERSION, ProviderConfig, chat_url};

/// The Anthropic dialect of one provider.
#[derive(Debug)]
pub struct Anthropic {
    messages: reqwest::Url,
    count_tokens: reqwest::Url,
    headers: Vec<(HeaderName, HeaderValue)>,
    /// `max_tokens` when the client sets none.
    max_tokens: u32,
}

impl Anthropic {
    pub fn new(config: &ProviderConfig, key: Option<SecretString>) -> Result<Anthropic, String> {
        let base = if config.base_url.is_empty() {
            ANTHROPIC_BASE_URL
        } else {
            config.base_url.trim_end_matches('/')
        };
        chat_url(base)?;
        let url = |path: &str| {
            reqwest::Url::parse(&format!("{base}{path}"))
                .map_err(|e| format!("{base:?} is not a URL: {e}"))
        };
        let messages = url("/v1/messages")?;
        let count_tokens = url("/v1/messages/count_tokens")?;
        let version = config
            .anthropic_version
            .as_deref()
            .unwrap_or(ANTHROPIC_VERSION);
        let mut headers = vec![(
            HeaderName::from_static("anthropic-version"),
            HeaderValue::from_str(version)
                .map_err(|_| "anthropic_version cannot be an HTTP header".to_string())?,
        )];
        if let Some(k) = key {
            headers.push(secret_header(
                HeaderName::from_static("x-api-key"),
                k.expose_secret(),
            )?);
        }
        Ok(Anthropic {
            messages,
            count_tokens,
            headers,
            max_tokens: config.max_tokens,
        })
    }
}

impl Dialect for Anthropic {
    fn request(&self, endpoint: Endpoint, _model: &str, body: Bytes) -> Result<Outgoing, String> {
        if endpoint == Endpoint::Embeddings {
            return Err("Anthropic's API has no embeddings".into());
        }
        let mut chat: Map<String, Value> = serde_json::from_slice(&body)
            .map_err(|e| format!("the request is not a JSON object: {e}"))?;
        let (messages, reading) = match chat.remove(ORIGINAL) {
            Some(Value::Object(original)) => request::as_sent(original, &chat),
            _ => request::translate(&chat, self.max_tokens)?,
        };
        Ok(Outgoing {
            url: self.messages.clone(),
            headers: self.headers.clone(),
            body: Bytes::from(serde_json::to_vec(&messages).unwrap_or_default()),
            reading,
        })
    }

    /// `POST /v1/messages/count_tokens` with the translated request's
    /// model, system, messages and tools (the only fields it takes).
    fn count_tokens(&self, model: &str, body: Bytes) -> Option<Result<Outgoing, String>> {
        let counted = self
            .request(Endpoint::Chat, model, body)
            .and_then(|mut outgoing| {
                let mut m: Map<String, Value> = serde_json::from_slice(&outgoing.body)
                    .map_err(|e| format!("cannot read the translated request: {e}"))?;
                m.retain(|k, _| {
                    matches!(
                        k.as_str(),
                        "model" | "system" | "messages" | "tools" | "tool_choice"
                    )
                });
                outgoing.url = self.count_tokens.clone();
                outgoing.body = Bytes::from(serde_json::to_vec(&m).unwrap_or_default());
                Ok(outgoing)
            });
        Some(counted)
    }

    fn reply(&self, reading: &Reading, reply: UpstreamReply, limit: usize) -> UpstreamReply {
        let status = reply.status;
        if status.is_success() && reply.streaming {
            return UpstreamReply {
                body: translated(reply.body, reading.clone()),
                ..reply
            };
        }
        let reading = reading.clone();
        let (status, body) = if status.is_success() {
            let body = whole_then(reply.body, limit, move |bytes| {
                match serde_json::from_slice::<Value>(&bytes)
                    .ok()
                    .and_then(|m| reply::completion(&m, &reading))
                {
                    Some(c) => Bytes::from(c.to_string()),
                    // Not a message: as it came, and the answer's check
                    // refuses it.
                    None => bytes,
                }
            });
            (status, body)
        } else {
            let code = status.as_u16();
            let body = whole_then(reply.body, limit, move |bytes| {
                Bytes::from(reply::error(code, &bytes).to_string())
            });
            // 529: Anthropic overloaded, a 503 in everyone else's words.
            let status = if code == 529 {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                status
            };
            (status, body)
        };
        UpstreamReply {
            status,
            content_type: Some(HeaderValue::from_static("application/json")),
            streaming: false,
            body,
            ..reply
        }
    }
}

/// A stream translated event by event, as it arrives.
fn translated(body: BodyStream, reading: Reading) -> BodyStream {
    let translator = stream::Translator::new(reading);
    Box::pin(futures_util::stream::unfold(
        (body, Some(translator)),
        |(mut body, translator)| async move {
            let mut t = translator?;
            loop {
                match body.next().await {
                    Some(Ok(bytes)) => {
                        let out = t.feed(&bytes);
                        if !out.is_empty() {
                            return Some((Ok(Bytes::from(out)), (body, Some(t))));
                        }
                    }
                    Some(Err(e)) => return Some((Err(e), (body, None))),
                    None => {
                        let out = t.finish();
                        return (!out.is_empty()).then(|| (Ok(Bytes::from(out)), (body, None)));
                    }
                }
            }
        },
    ))
}
