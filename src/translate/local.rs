//! A token count idem makes itself: for a target whose API has no count
//! (every kind but Anthropic), its model's tokenizer counts the chat
//! messages the Messages request becomes, when idem knows that tokenizer
//! (OpenAI's model families); else the count is refused.

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::{Refusal, messages_chat};
use crate::contracts::tokens::ModelLimits;
use crate::routes::Target;

/// `{"input_tokens": N}` for the Messages request `request` on `target`.
pub fn count(request: &Map<String, Value>, target: &Target) -> Result<Bytes, Refusal> {
    // A count takes no `max_tokens`; the translation wants one.
    let mut request = request.clone();
    request.entry("max_tokens").or_insert_with(|| json!(1));
    let chat = messages_chat::request::to_chat(&request, &target.model)?;
    let messages = match chat.get("messages") {
        Some(Value::Array(m)) => m.as_slice(),
        _ => &[],
    };
    let n = ModelLimits::of(&target.model, None, None)
        .count(&target.model, messages)
        .ok_or_else(|| {
            Refusal::at(
                "model",
                format!(
                    "idem cannot count tokens for model `{}`: its provider has no token count \
                     API and its tokenizer is unknown",
                    target.model
                ),
            )
        })?;
    Ok(Bytes::from(crate::dialect::count::answer(n).to_string()))
}
