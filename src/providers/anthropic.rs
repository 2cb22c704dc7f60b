//! Kind `anthropic`: Anthropic's Messages API (`POST {base_url}/v1/messages`
//! and its token count, headers `x-api-key` and `anthropic-version`). It
//! speaks the Messages dialect: a chat or Responses request reaches it
//! translated (`translate::chat_messages`). A 529 (`overloaded_error`) is
//! a retryable failure like a 503. Anthropic has no embeddings API.

use bytes::Bytes;
use reqwest::header::{HeaderName, HeaderValue};
use secrecy::{ExposeSecret, SecretString};

use super::openai::secret_header;
use super::{Api, Outgoing};
use crate::config::{ANTHROPIC_BASE_URL, ANTHROPIC_VERSION, ProviderConfig, chat_url};
use crate::dialect::{Dialect, Forwarded};

/// The Anthropic dialect of one provider.
#[derive(Debug)]
pub struct Anthropic {
    messages: reqwest::Url,
    count_tokens: reqwest::Url,
    headers: Vec<(HeaderName, HeaderValue)>,
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
        })
    }
}

impl Api for Anthropic {
    fn speaks(&self, dialect: Dialect) -> bool {
        matches!(dialect, Dialect::Messages | Dialect::CountTokens)
    }

    /// The client's `anthropic-version` (when it sent one) replaces the
    /// provider's; its `anthropic-beta` goes as it came.
    fn request(
        &self,
        dialect: Dialect,
        _model: &str,
        body: Bytes,
        forwarded: &Forwarded,
    ) -> Result<Outgoing, String> {
        let url = match dialect {
            Dialect::Messages => &self.messages,
            Dialect::CountTokens => &self.count_tokens,
            other => {
                return Err(format!("Anthropic's API does not speak {}", other.as_str()));
            }
        };
        Ok(Outgoing {
            url: url.clone(),
            headers: super::with_forwarded(&self.headers, forwarded),
            body,
        })
    }
}
