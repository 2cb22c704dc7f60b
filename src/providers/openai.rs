//! Kind `openai`: any OpenAI-compatible API (OpenAI, vLLM, Ollama, Groq,
//! Gemini's OpenAI-compatible endpoint, OpenRouter...). idem's request goes
//! as it is to `{base_url}/chat/completions` or `{base_url}/embeddings`,
//! with the key as a bearer token; the reply comes back as it is.
//!
//! With `responses_api = true`, a request of idem's Responses face goes to
//! `{base_url}/responses` as its client wrote it (the conversation it
//! continues spelled out, `store: false`: idem keeps responses itself), and
//! the reply is read back into chat ([`crate::shapes::responses_api`]).

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use reqwest::header::{self, HeaderName, HeaderValue};
use secrecy::{ExposeSecret, SecretString};
use serde_json::{Map, Value, json};

use super::{BodyStream, Dialect, Endpoint, Outgoing, Reading, UpstreamReply, whole_then};
use crate::config::chat_url;
use crate::shapes::responses::ORIGINAL;
use crate::shapes::responses_api::{ChunkTranslator, completion_from_response};
use crate::sse::EventSplitter;

/// The OpenAI-compatible dialect of one provider.
#[derive(Debug)]
pub struct OpenAi {
    chat: reqwest::Url,
    embeddings: reqwest::Url,
    /// `{base_url}/responses`, with `responses_api = true`.
    responses: Option<reqwest::Url>,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl OpenAi {
    /// Its URLs under `base_url` (parsed once, not per call) and its key.
    pub fn new(
        base_url: &str,
        key: Option<SecretString>,
        responses_api: bool,
    ) -> Result<OpenAi, String> {
        let chat = chat_url(base_url)?;
        let base = base_url.trim_end_matches('/');
        let url = |path: &str| {
            reqwest::Url::parse(&format!("{base}{path}"))
                .map_err(|e| format!("{base:?} is not a URL: {e}"))
        };
        let embeddings = url("/embeddings")?;
        let responses = responses_api.then(|| url("/responses")).transpose()?;
        let headers = key
            .map(|k| {
                secret_header(
                    header::AUTHORIZATION,
                    &format!("Bearer {}", k.expose_secret()),
                )
            })
            .transpose()?
            .into_iter()
            .collect();
        Ok(OpenAi {
            chat,
            embeddings,
            responses,
            headers,
        })
    }
}

/// A header that carries a secret: never shown in debug output.
pub(super) fn secret_header(
    name: HeaderName,
    value: &str,
) -> Result<(HeaderName, HeaderValue), String> {
    let mut value = HeaderValue::from_str(value)
        .map_err(|_| "the key has characters an HTTP header cannot carry".to_string())?;
    value.set_sensitive(true);
    Ok((name, value))
}

impl Dialect for OpenAi {
    fn request(&self, endpoint: Endpoint, _model: &str, body: Bytes) -> Result<Outgoing, String> {
        if let (Endpoint::Chat, Some(url)) = (endpoint, &self.responses)
            && let Some((body, reading)) = native(&body)
        {
            return Ok(Outgoing {
                url: url.clone(),
                headers: self.headers.clone(),
                body,
                reading,
            });
        }
        let url = match endpoint {
            Endpoint::Chat => &self.chat,
            Endpoint::Embeddings => &self.embeddings,
        };
        Ok(Outgoing {
            url: url.clone(),
            headers: self.headers.clone(),
            body,
            reading: Reading::default(),
        })
    }

    /// A Responses API's reply read back into chat: a `response` object as a
    /// chat completion, its events as chunks; errors are OpenAI's already.
    fn reply(&self, reading: &Reading, reply: UpstreamReply, limit: usize) -> UpstreamReply {
        if !reading.responses || !reply.status.is_success() {
            return reply;
        }
        if reply.streaming {
            return UpstreamReply {
                body: chunks(reply.body, reading.include_usage),
                ..reply
            };
        }
        let body = whole_then(reply.body, limit, |bytes| {
            match serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|r| completion_from_response(&r))
            {
                Some(c) => Bytes::from(c.to_string()),
                // Not a response: as it came, and the answer's check
                // refuses it.
                None => bytes,
            }
        });
        UpstreamReply { body, ..reply }
    }
}

/// The Responses request a chat request of idem's Responses face carries
/// ([`ORIGINAL`]), made this call's: the target's model, the call's stream
/// and usage, `store: false`. `None` for any other chat request.
fn native(body: &[u8]) -> Option<(Bytes, Reading)> {
    // Most requests are not: a look at the bytes before a parse.
    let key = format!("\"{ORIGINAL}\"");
    if !body.windows(key.len()).any(|w| w == key.as_bytes()) {
        return None;
    }
    let mut chat: Map<String, Value> = serde_json::from_slice(body).ok()?;
    let Value::Object(mut request) = chat.remove(ORIGINAL)? else {
        return None;
    };
    let reading = Reading {
        responses: true,
        ..Reading::of_chat(&chat)
    };
    if let Some(model) = chat.remove("model") {
        request.insert("model".into(), model);
    }
    request.insert("store".into(), json!(false));
    if reading.stream {
        request.insert("stream".into(), json!(true));
    }
    let body = serde_json::to_vec(&request).ok()?;
    Some((Bytes::from(body), reading))
}

/// A Responses event stream read as chat chunks, as it arrives.
fn chunks(body: BodyStream, include_usage: bool) -> BodyStream {
    let state = (
        body,
        EventSplitter::new(),
        ChunkTranslator::new(include_usage),
    );
    Box::pin(futures_util::stream::unfold(
        Some(state),
        |state| async move {
            let (mut body, mut events, mut translator) = state?;
            loop {
                match body.next().await {
                    Some(Ok(bytes)) => {
                        let mut out = BytesMut::new();
                        for data in events.push(&bytes) {
                            if let Ok(event) = serde_json::from_str::<Value>(&data) {
                                out.extend_from_slice(&translator.push(&event));
                            }
                        }
                        if !out.is_empty() {
                            return Some((Ok(out.freeze()), Some((body, events, translator))));
                        }
                    }
                    Some(Err(e)) => return Some((Err(e), None)),
                    None => {
                        // An event cut off without its blank line.
                        let last = events
                            .finish()
                            .and_then(|data| serde_json::from_str::<Value>(&data).ok())
                            .map(|event| translator.push(&event))
                            .unwrap_or_default();
                        return (!last.is_empty()).then_some((Ok(last), None));
                    }
                }
            }
        },
    ))
}
