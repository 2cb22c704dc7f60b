//! The endpoints idem serves, as the core sees them: for each dialect, what
//! its upstream call sends and how the answer is read ([`Wire`]). The core
//! ([`crate::task`], [`crate::flight`]) knows none of these formats; the
//! HTTP faces parse requests into tasks with these and render what the
//! core delivers.
//!
//! A conversation (chat completions, Messages, Responses, a Messages token
//! count) is one request and one answer per call ([`Conversation`]); the
//! items of an embeddings request share calls ([`embeddings`]).
//!
//! [`Wire`]: crate::flight::Wire

pub mod embeddings;

use std::sync::Arc;

use serde_json::{Map, Value};

use crate::answer::Answer;
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::flight::Wire;
use crate::routes::{Route, Target};
use crate::translate::{Prepared, Refusal};

/// The wire of a dialect whose call carries one request and answers it.
pub struct Conversation(pub Dialect);

pub static CHAT: Conversation = Conversation(Dialect::Chat);
pub static MESSAGES: Conversation = Conversation(Dialect::Messages);
pub static COUNT_TOKENS: Conversation = Conversation(Dialect::CountTokens);
pub static RESPONSES: Conversation = Conversation(Dialect::Responses);

/// The wire of `dialect`'s requests.
pub fn wire(dialect: Dialect) -> &'static dyn Wire {
    match dialect {
        Dialect::Chat => &CHAT,
        Dialect::Messages => &MESSAGES,
        Dialect::CountTokens => &COUNT_TOKENS,
        Dialect::Responses => &RESPONSES,
        Dialect::Embeddings => &embeddings::EMBEDDINGS,
    }
}

impl Wire for Conversation {
    fn dialect(&self) -> Dialect {
        self.0
    }

    /// The request as its client sent it when the target speaks its
    /// dialect, else translated (see `translate::prepare`).
    fn prepare(
        &self,
        _route: &Route,
        target: &Target,
        requests: &[Arc<Map<String, Value>>],
        forwarded: &Forwarded,
        fp: &Fingerprint,
    ) -> Result<Prepared, Refusal> {
        let Some(request) = requests.first() else {
            return Err(Refusal::at("model", "no request to send"));
        };
        crate::translate::prepare(self.0, request, forwarded, target, fp)
    }

    /// A 2xx must be a whole answer of the dialect (a streamed one must
    /// assemble into one), else it is a `bad_upstream_answer`.
    fn check(
        &self,
        answer: Answer,
        _requests: &[Arc<Map<String, Value>>],
    ) -> Result<Answer, Box<Answer>> {
        match answer.malformed() {
            None => Ok(answer),
            Some(why) => {
                tracing::warn!(provider = %answer.provider, dialect = self.0.as_str(), why = %why, "upstream answer is not whole and well formed");
                Err(Box::new(answer.into_bad(&why)))
            }
        }
    }

    /// One call, one answer.
    fn split(&self, answer: Answer, _requests: &[Arc<Map<String, Value>>]) -> Vec<Answer> {
        vec![answer]
    }
}
