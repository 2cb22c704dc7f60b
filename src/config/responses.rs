//! `[responses]`: the Responses API's stored conversations.

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ResponsesConfig {
    /// The largest conversation a request may continue by
    /// `previous_response_id`, in bytes of its stored turns (input and
    /// output items): past it the request is refused with a 400 that says
    /// so. The default is `server.max_body_bytes`'s: what a client could
    /// have sent as one request.
    pub max_conversation_bytes: usize,
}

impl Default for ResponsesConfig {
    fn default() -> Self {
        Self {
            max_conversation_bytes: 8 * 1024 * 1024,
        }
    }
}

impl ResponsesConfig {
    /// The checks of `[responses]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if self.max_conversation_bytes == 0 {
            return Err(source.invalid(
                "responses.max_conversation_bytes",
                "expected a positive number of bytes",
            ));
        }
        Ok(())
    }
}
