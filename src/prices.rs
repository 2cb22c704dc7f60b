//! What a call costs: a target's price (its own, or the built-in one of a
//! well-known model), the tokens of an answer, and their cost in US
//! dollars (docs/design.md, "Numbers").
//!
//! A target without a price counts tokens and says its cost is unknown;
//! an unknown cost is never shown as zero.

use serde::Serialize;

use crate::config::{PriceConfig, ProviderKind};

/// The date the built-in prices were read from the providers' price
/// pages. Prices change: a target's own `price` overrides these.
pub const BUILT_IN_AS_OF: &str = "2025-06-01";

/// Dollars per million tokens: (model, input, cached input, output).
const OPENAI: &[(&str, f64, f64, f64)] = &[
    ("gpt-4o-mini", 0.15, 0.075, 0.60),
    ("gpt-4o", 2.50, 1.25, 10.00),
    ("gpt-4.1-nano", 0.10, 0.025, 0.40),
    ("gpt-4.1-mini", 0.40, 0.10, 1.60),
    ("gpt-4.1", 2.00, 0.50, 8.00),
    ("o4-mini", 1.10, 0.275, 4.40),
    ("o3-mini", 1.10, 0.55, 4.40),
    ("o3", 2.00, 0.50, 8.00),
    ("o1", 15.00, 7.50, 60.00),
    ("gpt-3.5-turbo", 0.50, 0.50, 1.50),
    ("text-embedding-3-small", 0.02, 0.02, 0.0),
    ("text-embedding-3-large", 0.13, 0.13, 0.0),
    ("text-embedding-ada-002", 0.10, 0.10, 0.0),
];

/// Anthropic's models; the cached input price is that of a cache read.
const ANTHROPIC: &[(&str, f64, f64, f64)] = &[
    ("claude-opus-4", 15.00, 1.50, 75.00),
    ("claude-sonnet-4", 3.00, 0.30, 15.00),
    ("claude-3-7-sonnet", 3.00, 0.30, 15.00),
    ("claude-3-5-sonnet", 3.00, 0.30, 15.00),
    ("claude-3-5-haiku", 0.80, 0.08, 4.00),
    ("claude-3-haiku", 0.25, 0.03, 1.25),
    ("claude-3-opus", 15.00, 1.50, 75.00),
];

/// A price and where it came from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Price {
    pub input_per_mtok: f64,
    pub cached_input_per_mtok: f64,
    pub output_per_mtok: f64,
    /// `config`, or `built-in` (as of [`BUILT_IN_AS_OF`]).
    pub source: &'static str,
}

impl Price {
    /// A target's price: its own, else the built-in one of its model for
    /// its provider kind, else none (the cost is unknown).
    pub fn of_target(
        configured: Option<&PriceConfig>,
        kind: ProviderKind,
        model: &str,
    ) -> Option<Price> {
        if let Some(p) = configured {
            return Some(Price {
                input_per_mtok: p.input_per_mtok,
                cached_input_per_mtok: p.cached_input_per_mtok.unwrap_or(p.input_per_mtok),
                output_per_mtok: p.output_per_mtok,
                source: "config",
            });
        }
        let table = match kind {
            ProviderKind::Openai | ProviderKind::Azure => OPENAI,
            ProviderKind::Anthropic => ANTHROPIC,
            ProviderKind::Mock => return None,
        };
        built_in(table, model)
    }

    /// What `tokens` cost at this price, in US dollars.
    pub fn cost(&self, tokens: &Tokens) -> f64 {
        let cached = tokens.cached_input.min(tokens.input);
        let fresh = tokens.input - cached;
        (fresh as f64 * self.input_per_mtok
            + cached as f64 * self.cached_input_per_mtok
            + tokens.output as f64 * self.output_per_mtok)
            / 1_000_000.0
    }
}

/// The built-in price of a model known by its name only (a log line's
/// `model`): Anthropic's table for `claude-...`, else OpenAI's.
pub fn built_in_by_name(model: &str) -> Option<Price> {
    if model.starts_with("claude") {
        built_in(ANTHROPIC, model)
    } else {
        built_in(OPENAI, model)
    }
}

/// The built-in price of `model`: the longest known name it starts with,
/// followed by nothing, a dated snapshot (`-2024-07-18`, `-20241022`) or
/// `-latest`, so that `gpt-4o-mini-2024-07-18` is `gpt-4o-mini` and never
/// `gpt-4o`.
fn built_in(table: &[(&str, f64, f64, f64)], model: &str) -> Option<Price> {
    table
        .iter()
        .filter(|(name, ..)| {
            model.strip_prefix(name).is_some_and(|rest| {
                rest.is_empty()
                    || rest == "-latest"
                    || rest
                        .strip_prefix('-')
                        .is_some_and(|d| d.starts_with(|c: char| c.is_ascii_digit()))
            })
        })
        .max_by_key(|(name, ..)| name.len())
        .map(|&(_, input, cached, output)| Price {
            input_per_mtok: input,
            cached_input_per_mtok: cached,
            output_per_mtok: output,
            source: "built-in",
        })
}

/// The tokens of one upstream call, as its answer's `usage` says.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tokens {
    /// Every input token, those read from the provider's cache included.
    pub input: u64,
    /// Of `input`, those read from the provider's prompt cache.
    pub cached_input: u64,
    pub output: u64,
}

impl Tokens {
    /// From an OpenAI-style `usage` object (every provider's answer is read
    /// in that form): `prompt_tokens` (required), `completion_tokens`
    /// (absent for embeddings), `prompt_tokens_details.cached_tokens`.
    pub fn of_usage(usage: &serde_json::Value) -> Option<Tokens> {
        let n = |v: Option<&serde_json::Value>| v.and_then(serde_json::Value::as_u64);
        Some(Tokens {
            input: n(usage.get("prompt_tokens"))?,
            cached_input: n(usage
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens")))
            .unwrap_or(0),
            output: n(usage.get("completion_tokens")).unwrap_or(0),
        })
    }
}

/// Dollars as whole nano-dollars, for counters that add them up exactly.
pub fn nanos(dollars: f64) -> u64 {
    if dollars.is_finite() && dollars > 0.0 {
        (dollars * 1e9).round() as u64
    } else {
        0
    }
}

/// Nano-dollars as dollars.
pub fn dollars(n: i64) -> f64 {
    n as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dated_snapshot_has_its_models_price_and_never_a_shorter_names() {
        let p = |m| Price::of_target(None, ProviderKind::Openai, m).map(|p| p.input_per_mtok);
        assert_eq!(p("gpt-4o-mini"), Some(0.15));
        assert_eq!(p("gpt-4o-mini-2024-07-18"), Some(0.15));
        assert_eq!(p("gpt-4o-2024-08-06"), Some(2.50));
        assert_eq!(p("gpt-4.1-nano"), Some(0.10));
        assert_eq!(p("o3-mini-2025-01-31"), Some(1.10));
        assert_eq!(p("gpt-4o-audio-preview"), None, "another model");
        assert_eq!(p("llama-3.1-8b"), None);
        let a = |m| Price::of_target(None, ProviderKind::Anthropic, m).map(|p| p.output_per_mtok);
        assert_eq!(a("claude-3-5-haiku-20241022"), Some(4.00));
        assert_eq!(a("claude-3-5-sonnet-latest"), Some(15.00));
        assert_eq!(a("claude-sonnet-4-20250514"), Some(15.00));
        assert_eq!(a("gpt-4o-mini"), None, "each kind has its own table");
        assert_eq!(
            Price::of_target(None, ProviderKind::Mock, "gpt-4o-mini"),
            None
        );
    }

    #[test]
    fn a_targets_own_price_wins_and_cached_input_defaults_to_input() {
        let own = PriceConfig {
            input_per_mtok: 1.0,
            output_per_mtok: 2.0,
            cached_input_per_mtok: None,
        };
        let p = Price::of_target(Some(&own), ProviderKind::Openai, "gpt-4o").unwrap();
        assert_eq!(
            (
                p.input_per_mtok,
                p.cached_input_per_mtok,
                p.output_per_mtok,
                p.source
            ),
            (1.0, 1.0, 2.0, "config")
        );
    }

    #[test]
    fn cost_prices_cached_input_apart() {
        let p = Price::of_target(None, ProviderKind::Openai, "gpt-4o-mini").unwrap();
        let t = Tokens {
            input: 1_000_000,
            cached_input: 400_000,
            output: 100_000,
        };
        // 600k x 0.15 + 400k x 0.075 + 100k x 0.60, per million.
        let expected = 0.09 + 0.03 + 0.06;
        assert!((p.cost(&t) - expected).abs() < 1e-12, "{}", p.cost(&t));
        assert_eq!(nanos(p.cost(&t)), 180_000_000);
        assert_eq!(nanos(f64::NAN), 0);
    }

    #[test]
    fn tokens_are_read_from_any_answers_usage() {
        let chat = serde_json::json!({"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 3}});
        assert_eq!(
            Tokens::of_usage(&chat),
            Some(Tokens {
                input: 10,
                cached_input: 3,
                output: 4
            })
        );
        let embeddings = serde_json::json!({"prompt_tokens": 8, "total_tokens": 8});
        assert_eq!(
            Tokens::of_usage(&embeddings).map(|t| (t.input, t.output)),
            Some((8, 0))
        );
        assert_eq!(Tokens::of_usage(&serde_json::json!({})), None);
    }
}
