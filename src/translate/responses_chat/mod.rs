//! A Responses request to a target that speaks chat completions: the
//! request said in chat ([`request`]), the reply read back as a `response`
//! object ([`reply`]) or, streamed, as the Responses API's events as the
//! chunks arrive ([`stream`]).
//!
//! The response's id is made of the task's fingerprint and the
//! completion's own id ([`response_id`]): every asker of one shared answer
//! sees the same id, and two tenants never share one (the fingerprint
//! names the tenant).

pub mod reply;
pub mod request;
pub mod stream;

use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

use crate::fingerprint::Fingerprint;
use crate::sse::EventSplitter;

/// The id of the Responses object made of a completion for the task `fp`.
pub fn response_id(fp: &Fingerprint, completion_id: &str, created: u64) -> String {
    let mut h = blake3::Hasher::new();
    h.update(fp.as_bytes());
    h.update(completion_id.as_bytes());
    h.update(&created.to_le_bytes());
    format!("resp_{}", &h.finalize().to_hex()[..40])
}

/// A completion's (or chunk's) `id` and `created`.
fn identity(completion: &Value) -> (&str, u64) {
    (
        completion.get("id").and_then(Value::as_str).unwrap_or(""),
        completion
            .get("created")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    )
}

/// The Responses reading of a chat reply (see [`super::Reply`]).
pub struct Reply {
    fp: Fingerprint,
    echo: Option<reply::Echo>,
    splitter: EventSplitter,
    /// Started at the first chunk (the response's id is made of its id).
    stream: Option<stream::StreamTranslator>,
    ended: bool,
}

impl Reply {
    /// For the task `fp` of the Responses request `request`.
    pub fn new(fp: Fingerprint, request: &Map<String, Value>) -> Reply {
        Reply {
            fp,
            echo: Some(reply::Echo::of(request)),
            splitter: EventSplitter::new(),
            stream: None,
            ended: false,
        }
    }

    fn started(&mut self, chunk: &Value) -> Option<&mut stream::StreamTranslator> {
        if self.stream.is_none() {
            let (cid, created) = identity(chunk);
            let id = response_id(&self.fp, cid, created);
            let echo = self.echo.take()?;
            self.stream = Some(stream::StreamTranslator::new(&id, created, echo));
        }
        self.stream.as_mut()
    }

    fn event(&mut self, data: &str, out: &mut BytesMut) {
        if self.ended {
            return;
        }
        if data.trim() == "[DONE]" {
            self.ended = true;
            if let Some(t) = self.stream.as_mut() {
                out.extend_from_slice(&t.finish());
            }
            return;
        }
        let Ok(chunk) = serde_json::from_str::<Value>(data) else {
            // Not JSON: the answer ends without `response.completed`.
            self.ended = true;
            return;
        };
        if let Some(error) = chunk.get("error").filter(|e| !e.is_null()) {
            let message = error
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("the provider reported an error");
            let code = error
                .get("code")
                .and_then(Value::as_str)
                .unwrap_or("server_error");
            let failed = match self.started(&chunk) {
                Some(t) => t.fail(code, message),
                None => Bytes::new(),
            };
            out.extend_from_slice(&failed);
            self.ended = true;
            return;
        }
        if let Some(t) = self.started(&chunk) {
            out.extend_from_slice(&t.push(&chunk));
        }
    }
}

impl super::Reply for Reply {
    fn plain(&mut self, body: &[u8]) -> Option<Bytes> {
        let completion: Value = serde_json::from_slice(body).ok()?;
        completion.get("choices")?.as_array()?;
        let (cid, created) = identity(&completion);
        let id = response_id(&self.fp, cid, created);
        let echo = self.echo.take()?;
        let response = reply::response_from_completion(&completion, &id, created, &echo);
        Some(Bytes::from(response.to_string()))
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
        // A chat stream whose choice finished is whole without `[DONE]` (as
        // chat's own assembly takes it).
        if !self.ended
            && let Some(t) = self.stream.as_mut()
            && t.saw_finish()
        {
            self.ended = true;
            out.extend_from_slice(&t.finish());
        }
        out.freeze()
    }
}
