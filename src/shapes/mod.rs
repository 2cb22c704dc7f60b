//! The API shapes idem speaks besides chat completions, and their
//! translation to and from the chat form the core knows: Anthropic's
//! Messages API ([`messages`]) and OpenAI's Responses API ([`responses`]),
//! as the faces of the chat path read and render them. Pure functions over
//! JSON: no I/O, no HTTP, nothing of idem's core, so that every layer that
//! speaks a shape (the faces, the providers, the mock) shares one reading
//! of it.

pub mod messages;
pub mod responses;
pub mod responses_api;

/// Why a request of a face other than chat completions cannot be served:
/// it says something a chat request cannot (the HTTP layer answers 400
/// `invalid_request_error`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// What is wrong, in words the client's developer can act on.
    pub message: String,
    /// The offending field as a dotted path (`messages.2.content.0.type`,
    /// `input.3.type`), like OpenAI's `param`.
    pub param: Option<String>,
}

impl Refusal {
    /// A refusal of the field at `param`.
    pub fn at(param: impl Into<String>, message: impl Into<String>) -> Self {
        Refusal {
            message: message.into(),
            param: Some(param.into()),
        }
    }
}
