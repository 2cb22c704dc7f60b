//! The endpoints idem serves, as the core sees them: for each API shape,
//! what its upstream call sends and how the answer is read ([`Wire`]), and
//! what it needs of a request beyond the core's task. The core
//! ([`crate::task`], [`crate::flight`]) knows none of these formats; the
//! HTTP faces (`http::openai`, `http::embeddings`) parse requests into
//! tasks with these and render what the core delivers.
//!
//! [`Wire`]: crate::flight::Wire

pub mod chat;
pub mod embeddings;
pub mod messages;
pub mod responses;

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
