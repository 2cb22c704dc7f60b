//! A Messages request to a target that speaks chat completions: the
//! request said in chat ([`request`]), the reply read back as an Anthropic
//! `message` ([`reply`]) or, streamed, as Anthropic's events as the chunks
//! arrive ([`stream`]). Errors stay in OpenAI's words here; the Messages
//! face gives every error Anthropic's shape.

pub mod reply;
pub mod request;
pub mod stream;

use bytes::{Bytes, BytesMut};
use serde_json::Value;

use crate::sse::EventSplitter;

/// The Messages reading of a chat reply (see [`super::Reply`]).
pub struct Reply {
    splitter: EventSplitter,
    stream: stream::StreamTranslator,
    ended: bool,
}

impl Reply {
    pub fn new() -> Reply {
        Reply {
            splitter: EventSplitter::new(),
            stream: stream::StreamTranslator::new(),
            ended: false,
        }
    }

    fn event(&mut self, data: &str, out: &mut BytesMut) {
        if self.ended {
            return;
        }
        if data.trim() == "[DONE]" {
            self.ended = true;
            out.extend_from_slice(&self.stream.finish());
            return;
        }
        match serde_json::from_str::<Value>(data) {
            // A chat error event: passed on as an Anthropic error event, and
            // the stream is a failed answer.
            Ok(v) if v.get("error").is_some_and(|e| !e.is_null()) => {
                let message = v
                    .pointer("/error/message")
                    .and_then(Value::as_str)
                    .unwrap_or("the provider reported an error");
                out.extend_from_slice(&crate::dialect::messages::error_event("api_error", message));
                self.ended = true;
            }
            Ok(chunk) => out.extend_from_slice(&self.stream.push(&chunk)),
            // Not JSON: nothing a Messages client could read; the answer
            // ends without `message_stop` and fails its check.
            Err(_) => self.ended = true,
        }
    }
}

impl Default for Reply {
    fn default() -> Self {
        Reply::new()
    }
}

impl super::Reply for Reply {
    fn plain(&mut self, body: &[u8]) -> Option<Bytes> {
        let completion: Value = serde_json::from_slice(body).ok()?;
        completion.get("choices")?.as_array()?;
        Some(Bytes::from(
            reply::message_from_completion(&completion).to_string(),
        ))
    }

    fn push(&mut self, bytes: &[u8]) -> Bytes {
        let mut out = BytesMut::new();
        for data in self.splitter.push(bytes) {
            self.event(&data, &mut out);
        }
        out.freeze()
    }

    fn finish(&mut self) -> Bytes {
        let mut out = BytesMut::new();
        let splitter = std::mem::take(&mut self.splitter);
        if let Some(data) = splitter.finish() {
            self.event(&data, &mut out);
        }
        // A chat stream whose choice finished is whole without its
        // `[DONE]` (as chat's own assembly takes it); one cut short before
        // that ends without `message_stop`, and fails its check.
        if !self.ended && self.stream.saw_finish() {
            self.ended = true;
            out.extend_from_slice(&self.stream.finish());
        }
        out.freeze()
    }
}
