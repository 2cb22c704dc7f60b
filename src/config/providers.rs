//! `[[providers]]`: the upstream APIs a route's targets call, and the chat
//! completions URL of an OpenAI-compatible one.

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{BreakerConfig, ConfigError, NAME_RULE, Source, valid_name};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// Any OpenAI-compatible HTTP API.
    Openai,
    /// The built-in fake provider, answered in-process (demo and default).
    Mock,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    pub name: String,
    pub kind: ProviderKind,
    #[serde(default)]
    pub base_url: String,
    #[serde(default)]
    pub api_key_env: Option<String>,
    #[serde(default = "default_provider_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// Most idle keep-alive connections kept per host.
    #[serde(default = "default_pool_idle")]
    pub pool_max_idle: usize,
    /// The context window (tokens) of this provider's models, when the
    /// model family's default is wrong or unknown; a target's own
    /// `context_window` wins.
    #[serde(default)]
    pub context_window: Option<u32>,
    /// This provider's circuit breaker, instead of `[breaker]`.
    #[serde(default)]
    pub breaker: Option<BreakerConfig>,
    /// The largest answer (body bytes, plain or the whole stream) taken
    /// from this provider; past it the call is a failed attempt and the
    /// rest of the body is not read.
    #[serde(default = "default_max_answer_bytes")]
    pub max_answer_bytes: usize,
    /// Ask for usage on streamed calls (`stream_options.include_usage`),
    /// whatever the client asked, so that every client of a shared stream
    /// can be given its token counts; off for an OpenAI-compatible server
    /// that refuses `stream_options`.
    #[serde(default = "default_true")]
    pub stream_usage: bool,
}

fn default_provider_timeout() -> Duration {
    Duration::from_secs(30)
}

fn default_true() -> bool {
    true
}

fn default_max_answer_bytes() -> usize {
    8 * 1024 * 1024
}

fn default_pool_idle() -> usize {
    256
}

impl ProviderConfig {
    /// The checks of provider `p` of `[[providers]]`; `names` holds the
    /// names of the providers before it (this one's is added).
    pub(super) fn validate<'a>(
        &'a self,
        p: usize,
        names: &mut HashSet<&'a str>,
        source: &Source,
    ) -> Result<(), ConfigError> {
        let at = |k: &str| format!("providers[{p}].{k}");
        if !valid_name(&self.name) {
            return Err(source.invalid(at("name"), NAME_RULE));
        }
        if !names.insert(self.name.as_str()) {
            return Err(source.invalid(at("name"), "duplicate provider name"));
        }
        if self.kind == ProviderKind::Openai
            && let Err(reason) = chat_url(&self.base_url)
        {
            return Err(source.invalid(at("base_url"), reason));
        }
        if self.timeout.is_zero() {
            return Err(source.invalid(at("timeout"), "must be above zero"));
        }
        if self.max_answer_bytes == 0 {
            return Err(source.invalid(at("max_answer_bytes"), "must be above zero"));
        }
        if self.context_window == Some(0) {
            return Err(source.invalid(at("context_window"), "must be above zero"));
        }
        if let Some(b) = &self.breaker {
            b.validate(&at("breaker"), source)?;
        }
        Ok(())
    }
}

/// The chat completions URL under an OpenAI-compatible `base_url`.
pub fn chat_url(base_url: &str) -> Result<reqwest::Url, String> {
    let url = format!("{}/chat/completions", base_url.trim_end_matches('/'));
    let parsed = reqwest::Url::parse(&url).map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    match parsed.scheme() {
        "http" | "https" => Ok(parsed),
        _ => Err(format!(
            "{url:?}: an openai provider needs an http:// or https:// base_url"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chat_url_is_joined_once_whatever_the_trailing_slash() {
        for base in ["http://127.0.0.1:9001/v1", "http://127.0.0.1:9001/v1/"] {
            let url = chat_url(base).unwrap();
            assert_eq!(url.as_str(), "http://127.0.0.1:9001/v1/chat/completions");
        }
        let err = chat_url("http://exa mple.com").unwrap_err();
        assert!(err.contains("not a URL"), "{err}");
        let err = chat_url("file:///v1").unwrap_err();
        assert!(err.contains("http:// or https://"), "{err}");
    }
}
