//! Prompt rendering check for certification: does a case's prompt, plus the
//! answer it may ask for (`max_tokens`), fit the target model's context
//! window, counted by the model's own tokenizer?
//!
//! Tokenizers are known for OpenAI model families (through `tiktoken-rs`,
//! which ships the encodings, so nothing is downloaded). For any other
//! model the count is unknown and the check is skipped, never failed: the
//! report says so. Context windows come from the target's `context_window`,
//! else its provider's, else the model family's default.

use serde::Serialize;
use serde_json::Value;
use tiktoken_rs::ChatCompletionRequestMessage;

/// What idem knows about a target model's prompt capacity.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelLimits {
    /// The tokenizer's name (`o200k_base`, `cl100k_base`...), if known.
    pub tokenizer: Option<String>,
    /// Context window in tokens, if configured or known for the family.
    pub context_window: Option<u32>,
    /// Where the window came from: `target`, `provider` or `model family`.
    pub window_source: Option<&'static str>,
}

impl ModelLimits {
    /// The limits of `model`, with the configured windows (target first).
    pub fn of(model: &str, target_window: Option<u32>, provider_window: Option<u32>) -> Self {
        let tokenizer = chat_tokenizer(model).map(|t| format!("{t:?}"));
        let family = tiktoken_rs::model::get_context_size(model)
            .filter(|_| tokenizer.is_some())
            .and_then(|n| u32::try_from(n).ok());
        let (context_window, window_source) = match (target_window, provider_window, family) {
            (Some(w), _, _) => (Some(w), Some("target")),
            (None, Some(w), _) => (Some(w), Some("provider")),
            (None, None, Some(w)) => (Some(w), Some("model family")),
            _ => (None, None),
        };
        ModelLimits {
            tokenizer: tokenizer.map(|t| snake(&t)),
            context_window,
            window_source,
        }
    }

    /// The prompt's token count, or `None` when the tokenizer is unknown.
    pub fn count(&self, model: &str, messages: &[Value]) -> Option<u32> {
        self.tokenizer.as_ref()?;
        let messages: Vec<ChatCompletionRequestMessage> = messages.iter().map(to_message).collect();
        let n = tiktoken_rs::num_tokens_from_messages(model, &messages).ok()?;
        u32::try_from(n).ok()
    }
}

/// Only tokenizers whose chat framing `tiktoken-rs` can count.
fn chat_tokenizer(model: &str) -> Option<tiktoken_rs::tokenizer::Tokenizer> {
    use tiktoken_rs::tokenizer::Tokenizer;
    match tiktoken_rs::tokenizer::get_tokenizer(model)? {
        t @ (Tokenizer::Cl100kBase | Tokenizer::O200kBase | Tokenizer::O200kHarmony) => Some(t),
        _ => None,
    }
}

/// `O200kBase` -> `o200k_base`.
fn snake(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// A chat message in the form `tiktoken-rs` counts: text content (text
/// parts joined), name, tool calls.
fn to_message(m: &Value) -> ChatCompletionRequestMessage {
    let content = match m.get("content") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(parts)) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect::<Vec<_>>()
                .join("\n"),
        ),
        _ => None,
    };
    let tool_calls = m
        .get("tool_calls")
        .and_then(Value::as_array)
        .map(|calls| {
            calls
                .iter()
                .map(|c| tiktoken_rs::FunctionCall {
                    name: c
                        .pointer("/function/name")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                    arguments: c
                        .pointer("/function/arguments")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_string(),
                })
                .collect()
        })
        .unwrap_or_default();
    ChatCompletionRequestMessage {
        role: m
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("user")
            .to_string(),
        content,
        name: m.get("name").and_then(Value::as_str).map(str::to_string),
        tool_calls,
        ..ChatCompletionRequestMessage::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn openai_families_have_tokenizers_and_windows() {
        let l = ModelLimits::of("gpt-4o-mini", None, None);
        assert_eq!(l.tokenizer.as_deref(), Some("o200k_base"));
        assert_eq!(l.context_window, Some(128_000));
        assert_eq!(l.window_source, Some("model family"));
        let l = ModelLimits::of("gpt-4", None, None);
        assert_eq!(l.tokenizer.as_deref(), Some("cl100k_base"));
        assert_eq!(l.context_window, Some(8192));
    }

    #[test]
    fn configured_windows_win_target_first() {
        let l = ModelLimits::of("gpt-4o-mini", Some(64), Some(1000));
        assert_eq!(
            (l.context_window, l.window_source),
            (Some(64), Some("target"))
        );
        let l = ModelLimits::of("gpt-4o-mini", None, Some(1000));
        assert_eq!(
            (l.context_window, l.window_source),
            (Some(1000), Some("provider"))
        );
    }

    #[test]
    fn other_models_are_unknown_not_guessed() {
        let l = ModelLimits::of("llama-3.1-8b", None, None);
        assert_eq!(l.tokenizer, None);
        assert_eq!(l.context_window, None);
        assert_eq!(
            l.count("llama-3.1-8b", &[json!({"role": "user", "content": "hi"})]),
            None
        );
        // A configured window is kept, but nothing can be counted.
        let l = ModelLimits::of("llama-3.1-8b", Some(8192), None);
        assert_eq!(l.context_window, Some(8192));
        assert_eq!(l.tokenizer, None);
    }

    #[test]
    fn counts_grow_with_the_prompt() {
        let l = ModelLimits::of("gpt-4o-mini", None, None);
        let short = l
            .count(
                "gpt-4o-mini",
                &[json!({"role": "user", "content": "Where is my order?"})],
            )
            .unwrap();
        assert!((5..30).contains(&short), "{short}");
        let long = l
            .count(
                "gpt-4o-mini",
                &[json!({"role": "user", "content": "order ".repeat(500)})],
            )
            .unwrap();
        assert!(long > 400, "{long}");
    }
}
