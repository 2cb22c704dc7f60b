//! `[[providers]]`: the upstream APIs a route's targets call, of which kind
//! each is (OpenAI-compatible, Anthropic, Azure OpenAI, the built-in mock),
//! and the chat completions URL of an OpenAI-compatible one.

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{BreakerConfig, ConfigError, NAME_RULE, Source, valid_name};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// Any OpenAI-compatible HTTP API.
    Openai,
    /// Anthropic's Messages API (`POST {base_url}/v1/messages`).
    Anthropic,
    /// Azure OpenAI: a target's model names its deployment.
    Azure,
    /// The built-in fake provider, answered in-process (demo and default).
    Mock,
}

impl ProviderKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderKind::Openai => "openai",
            ProviderKind::Anthropic => "anthropic",
            ProviderKind::Azure => "azure",
            ProviderKind::Mock => "mock",
        }
    }
}

/// Anthropic's API host, when an anthropic provider names none.
pub const ANTHROPIC_BASE_URL: &str = "https://api.anthropic.com";

/// The `anthropic-version` idem speaks, unless the provider says otherwise.
pub const ANTHROPIC_VERSION: &str = "2023-06-01";

/// The Azure OpenAI `api-version` idem asks for, unless the provider says
/// otherwise.
pub const AZURE_API_VERSION: &str = "2024-10-21";

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
    /// `anthropic`: the `max_tokens` sent when the client sets none (the
    /// Messages API requires it).
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u32,
    /// `anthropic`: the `anthropic-version` header.
    #[serde(default)]
    pub anthropic_version: Option<String>,
    /// `azure`: the `api-version` query parameter.
    #[serde(default)]
    pub api_version: Option<String>,
    /// `openai`: the provider speaks OpenAI's Responses API
    /// (`{base_url}/responses`): a request of idem's Responses face goes
    /// there as its client wrote it instead of translated to chat.
    #[serde(default)]
    pub responses_api: bool,
    /// `openai`: the provider offers OpenAI's Batch API (`{base_url}/files`,
    /// `{base_url}/batches`), usually at a discount: a batch's unique chat
    /// lines on a route whose first target it is go to it as one provider
    /// batch instead of one call each (docs/design.md, "Batches").
    #[serde(default)]
    pub batch_api: bool,
    /// How often a provider batch is asked whether it has ended.
    #[serde(default = "default_batch_poll", with = "humantime_serde")]
    pub batch_poll_interval: Duration,
}

fn default_batch_poll() -> Duration {
    Duration::from_secs(30)
}

fn default_max_tokens() -> u32 {
    4096
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
        match self.kind {
            ProviderKind::Openai | ProviderKind::Azure => {
                if let Err(reason) = chat_url(&self.base_url) {
                    return Err(source.invalid(at("base_url"), reason));
                }
            }
            ProviderKind::Anthropic if !self.base_url.is_empty() => {
                if let Err(reason) = chat_url(&self.base_url) {
                    return Err(source.invalid(at("base_url"), reason));
                }
            }
            ProviderKind::Anthropic | ProviderKind::Mock => {}
        }
        if self.max_tokens == 0 {
            return Err(source.invalid(at("max_tokens"), "must be above zero"));
        }
        if self.responses_api && self.kind != ProviderKind::Openai {
            return Err(source.invalid(at("responses_api"), "applies to kind = \"openai\" only"));
        }
        if self.batch_api && self.kind != ProviderKind::Openai {
            return Err(source.invalid(at("batch_api"), "applies to kind = \"openai\" only"));
        }
        if self.batch_poll_interval < Duration::from_millis(10) {
            return Err(source.invalid(at("batch_poll_interval"), "expected at least 10ms"));
        }
        if self.api_version.is_some() && self.kind != ProviderKind::Azure {
            return Err(source.invalid(at("api_version"), "applies to kind = \"azure\" only"));
        }
        if self.anthropic_version.is_some() && self.kind != ProviderKind::Anthropic {
            return Err(source.invalid(
                at("anthropic_version"),
                "applies to kind = \"anthropic\" only",
            ));
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
            "{url:?}: a provider needs an http:// or https:// base_url"
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
