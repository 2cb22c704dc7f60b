//! Chat completions (`POST /v1/chat/completions`) as an upstream call: the
//! client's body with the target's model and idem's own stream options,
//! answered by one chat completion, plain or streamed.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Map, Value};

use crate::answer::Answer;
use crate::config::ProviderKind;
use crate::flight::Wire;
use crate::providers::Endpoint;
use crate::routes::{Route, Target};

/// The chat completions wire.
pub struct Chat;

/// The one [`Chat`] every chat flight refers to.
pub static CHAT: Chat = Chat;

impl Wire for Chat {
    fn endpoint(&self) -> Endpoint {
        Endpoint::Chat
    }

    /// The client's body with `model` set to the target's upstream model. A
    /// streamed call's `stream_options` are idem's own, not the client's:
    /// they are rendering options, which each client of a shared answer
    /// gets as it asked (see `Answer::stream_body`), so the call asks for
    /// usage (unless the provider's `stream_usage` is off), and nothing
    /// else. Every other field as the client sent it.
    fn body(&self, _route: &Route, target: &Target, requests: &[Arc<Map<String, Value>>]) -> Bytes {
        let Some(request) = requests.first() else {
            return Bytes::new();
        };
        body_for(target, request)
    }

    /// A 2xx must be a chat completion (a streamed one must assemble into
    /// one), else it is a `bad_upstream_answer`.
    fn check(
        &self,
        answer: Answer,
        _requests: &[Arc<Map<String, Value>>],
    ) -> Result<Answer, Box<Answer>> {
        match answer.malformed() {
            None => Ok(answer),
            Some(why) => {
                tracing::warn!(provider = %answer.provider, why = %why, "upstream answer is not a chat completion");
                Err(Box::new(answer.into_bad(&why)))
            }
        }
    }

    /// One call, one completion: a chat call answers one task.
    fn split(&self, answer: Answer, _requests: &[Arc<Map<String, Value>>]) -> Vec<Answer> {
        vec![answer]
    }
}

/// The upstream body of a chat request for `target` (see [`Chat::body`]).
pub fn body_for(target: &Target, request: &Map<String, Value>) -> Bytes {
    let mut body = request.clone();
    // A Messages request's own form is for Anthropic targets only, a
    // Responses request's for providers that speak the Responses API.
    if target.provider.kind != ProviderKind::Anthropic {
        body.remove(crate::shapes::messages::ORIGINAL);
    }
    if !target.provider.responses_api {
        body.remove(crate::shapes::responses::ORIGINAL);
    }
    body.insert("model".into(), Value::String(target.model.to_string()));
    if body.get("stream") == Some(&Value::Bool(true)) && target.provider.stream_usage {
        body.insert(
            "stream_options".into(),
            serde_json::json!({"include_usage": true}),
        );
    } else {
        body.remove("stream_options");
    }
    // Serializing a Map of Values cannot fail.
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}
