//! Kind `openai`: any OpenAI-compatible API (OpenAI, vLLM, Ollama, Groq,
//! Gemini's OpenAI-compatible endpoint, OpenRouter...). idem's request goes
//! as it is to `{base_url}/chat/completions` or `{base_url}/embeddings`,
//! with the key as a bearer token; the reply comes back as it is.

use bytes::Bytes;
use reqwest::header::{self, HeaderName, HeaderValue};
use secrecy::{ExposeSecret, SecretString};

use super::{Dialect, Endpoint, Outgoing, Reading};
use crate::config::chat_url;

/// The OpenAI-compatible dialect of one provider.
#[derive(Debug)]
pub struct OpenAi {
    chat: reqwest::Url,
    embeddings: reqwest::Url,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl OpenAi {
    /// Its URLs under `base_url` (parsed once, not per call) and its key.
    pub fn new(base_url: &str, key: Option<SecretString>) -> Result<OpenAi, String> {
        let chat = chat_url(base_url)?;
        let base = base_url.trim_end_matches('/');
        let embeddings = reqwest::Url::parse(&format!("{base}/embeddings"))
            .map_err(|e| format!("{base:?} is not a URL: {e}"))?;
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
}
