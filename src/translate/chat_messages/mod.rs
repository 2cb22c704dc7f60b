//! A chat completions request to an Anthropic target: the request said in
//! the Messages API ([`request`]), the reply read back as a chat
//! completion ([`reply`]) or, streamed, as chat chunks as it arrives
//! ([`stream`]). Errors keep their meaning: a 429 stays a 429, a 529
//! (`overloaded_error`) is a 503 to OpenAI's clients, both with the
//! provider's `retry-after`; an `error` event inside a stream is a failed
//! answer.

pub mod reply;
pub mod request;
pub mod stream;

use bytes::Bytes;
use serde_json::Value;

/// What reading a translated reply needs to know of its request.
#[derive(Debug, Clone, Default)]
pub struct Reading {
    /// The request asked for a stream.
    pub stream: bool,
    /// The stream ends with a usage chunk (a streamed call always asks for
    /// one: each asker of the shared answer gets it or not, as it asked).
    pub include_usage: bool,
    /// The name of the tool that carries a `response_format`'s JSON: its
    /// input is the answer's content.
    pub json_tool: Option<String>,
}

impl Reading {
    /// What a chat request says of its reply's form: whether it streams,
    /// and whether its stream ends with usage (`stream_options`).
    pub fn of_chat(chat: &serde_json::Map<String, Value>) -> Reading {
        let stream = chat.get("stream").and_then(Value::as_bool) == Some(true);
        let include_usage = stream
            && chat
                .get("stream_options")
                .and_then(|o| o.get("include_usage"))
                .and_then(Value::as_bool)
                == Some(true);
        Reading {
            stream,
            include_usage,
            ..Reading::default()
        }
    }
}

/// The chat reading of an Anthropic reply (see [`super::Reply`]).
pub struct Reply {
    reading: Reading,
    stream: Option<stream::Translator>,
}

impl Reply {
    pub fn new(mut reading: Reading) -> Reply {
        reading.include_usage = reading.stream;
        Reply {
            stream: Some(stream::Translator::new(reading.clone())),
            reading,
        }
    }
}

impl super::Reply for Reply {
    fn plain(&mut self, body: &[u8]) -> Option<Bytes> {
        let message: Value = serde_json::from_slice(body).ok()?;
        let completion = reply::completion(&message, &self.reading)?;
        Some(Bytes::from(completion.to_string()))
    }

    fn push(&mut self, bytes: &[u8]) -> Bytes {
        match self.stream.as_mut() {
            Some(t) => Bytes::from(t.feed(bytes)),
            None => Bytes::new(),
        }
    }

    fn finish(&mut self) -> Bytes {
        match self.stream.take() {
            Some(t) => Bytes::from(t.finish()),
            None => Bytes::new(),
        }
    }

    /// Anthropic's error object in OpenAI's shape; 529 (overloaded) is a
    /// 503 in everyone else's words.
    fn error(&self, status: u16, body: &[u8]) -> (u16, Bytes) {
        let status_out = if status == 529 { 503 } else { status };
        if body.is_empty() {
            return (status_out, Bytes::new());
        }
        (
            status_out,
            Bytes::from(reply::error(status, body).to_string()),
        )
    }
}
