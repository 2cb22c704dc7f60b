//! Kind `openai`: any OpenAI-compatible API (OpenAI, vLLM, Ollama, Groq,
//! Gemini's OpenAI-compatible endpoint, OpenRouter...). A request goes as
//! it is to `{base_url}/chat/completions` or `{base_url}/embeddings`, and
//! with `responses_api = true` a Responses request to `{base_url}/responses`,
//! with the key as a bearer token; the reply comes back as it is.

use bytes::Bytes;
use reqwest::header::{self, HeaderName, HeaderValue};
use secrecy::{ExposeSecret, SecretString};

use super::{Api, Outgoing};
use crate::config::chat_url;
use crate::dialect::{Dialect, Forwarded};

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

impl Api for OpenAi {
    fn speaks(&self, dialect: Dialect) -> bool {
        match dialect {
            Dialect::Chat | Dialect::Embeddings => true,
            Dialect::Responses => self.responses.is_some(),
            Dialect::Messages | Dialect::CountTokens => false,
        }
    }

    fn request(
        &self,
        dialect: Dialect,
        _model: &str,
        body: Bytes,
        forwarded: &Forwarded,
    ) -> Result<Outgoing, String> {
        let url = match (dialect, &self.responses) {
            (Dialect::Chat, _) => &self.chat,
            (Dialect::Embeddings, _) => &self.embeddings,
            (Dialect::Responses, Some(url)) => url,
            (other, _) => {
                return Err(format!(
                    "this provider does not speak {} (`responses_api` turns the Responses API on)",
                    other.as_str()
                ));
            }
        };
        Ok(Outgoing {
            url: url.clone(),
            headers: super::with_forwarded(&self.headers, forwarded),
            body,
        })
    }
}
