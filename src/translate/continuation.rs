//! A Responses answer to a continued conversation, as its client asked
//! for it. idem keeps the responses it serves, so a target that speaks the
//! Responses API is sent the conversation spelled out, without
//! `previous_response_id` and with `store: false` (see `native`); its
//! answer, plain or streamed, then names the `previous_response_id` and
//! the `store` the client sent, and nothing else of it changes.

use bytes::Bytes;
use serde_json::{Map, Value};

use super::Reply;
use crate::sse::EventSplitter;

/// The reply of a continued conversation: the client's two fields put
/// back into every response object of the answer.
pub struct Continuation {
    previous: Value,
    store: Value,
    splitter: EventSplitter,
}

impl Continuation {
    /// For a request that continues a stored response; `None` otherwise
    /// (the answer goes as the provider wrote it).
    pub fn of(request: &Map<String, Value>) -> Option<Continuation> {
        let previous = request
            .get("previous_response_id")
            .filter(|v| v.is_string())?;
        Some(Continuation {
            previous: previous.clone(),
            // OpenAI's default is to store.
            store: Value::Bool(request.get("store").and_then(Value::as_bool) != Some(false)),
            splitter: EventSplitter::new(),
        })
    }

    fn patch(&self, response: &mut Value) {
        if let Some(response) = response.as_object_mut() {
            response.insert("previous_response_id".into(), self.previous.clone());
            response.insert("store".into(), self.store.clone());
        }
    }

    /// One event of the stream, its response object (if it has one)
    /// patched: `event: <type>`, then its data.
    fn event(&self, data: &str, out: &mut Vec<u8>) {
        let Ok(mut event) = serde_json::from_str::<Value>(data) else {
            // Not JSON: on as it came, for the answer's check to refuse.
            out.extend_from_slice(b"data: ");
            out.extend_from_slice(data.as_bytes());
            out.extend_from_slice(b"\n\n");
            return;
        };
        if let Some(response) = event.get_mut("response") {
            self.patch(response);
        }
        if let Some(kind) = event.get("type").and_then(Value::as_str) {
            out.extend_from_slice(b"event: ");
            out.extend_from_slice(kind.as_bytes());
            out.push(b'\n');
        }
        out.extend_from_slice(b"data: ");
        // Serializing a value cannot fail.
        out.extend_from_slice(&serde_json::to_vec(&event).unwrap_or_default());
        out.extend_from_slice(b"\n\n");
    }
}

impl Reply for Continuation {
    fn plain(&mut self, body: &[u8]) -> Option<Bytes> {
        let mut response: Value = serde_json::from_slice(body).ok()?;
        self.patch(&mut response);
        serde_json::to_vec(&response).ok().map(Bytes::from)
    }

    fn push(&mut self, bytes: &[u8]) -> Bytes {
        let mut out = Vec::new();
        for data in self.splitter.push(bytes) {
            self.event(&data, &mut out);
        }
        Bytes::from(out)
    }

    fn finish(&mut self) -> Bytes {
        let mut out = Vec::new();
        if let Some(data) = std::mem::take(&mut self.splitter).finish() {
            self.event(&data, &mut out);
        }
        Bytes::from(out)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn continuing() -> Continuation {
        let request = json!({"model": "m", "input": "go on", "previous_response_id": "resp_1"});
        Continuation::of(request.as_object().unwrap()).unwrap()
    }

    #[test]
    fn only_a_continued_conversation_is_patched() {
        let fresh = json!({"model": "m", "input": "hi"});
        assert!(Continuation::of(fresh.as_object().unwrap()).is_none());
    }

    #[test]
    fn a_plain_answer_names_what_the_client_sent() {
        let answer = json!({"id": "resp_2", "object": "response", "store": false,
            "previous_response_id": null, "output": [{"type": "message"}]});
        let patched = continuing().plain(answer.to_string().as_bytes()).unwrap();
        let patched: Value = serde_json::from_slice(&patched).unwrap();
        assert_eq!(patched["previous_response_id"], "resp_1");
        assert_eq!(patched["store"], true);
        assert_eq!(patched["output"], answer["output"]);
        // Not JSON: passed on as it came.
        assert!(continuing().plain(b"<html>").is_none());
    }

    #[test]
    fn a_stream_names_it_in_each_response_object_whatever_its_cuts() {
        let stream = concat!(
            "event: response.created\n",
            "data: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_2\",\"store\":false,\"previous_response_id\":null}}\n\n",
            "event: response.output_text.delta\n",
            "data: {\"type\":\"response.output_text.delta\",\"delta\":\"Hi\"}\n\n",
            "event: response.completed\n",
            "data: {\"type\":\"response.completed\",\"response\":{\"id\":\"resp_2\",\"store\":false,\"previous_response_id\":null}}\n\n",
        );
        for cut in [1, 40, 100, stream.len() - 1] {
            let mut reply = continuing();
            let mut out = reply.push(&stream.as_bytes()[..cut]).to_vec();
            out.extend_from_slice(&reply.push(&stream.as_bytes()[cut..]));
            out.extend_from_slice(&reply.finish());
            let text = String::from_utf8(out).unwrap();
            let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
            assert_eq!(events.len(), 3, "{text}");
            assert!(events[0].starts_with("event: response.created\ndata: {"));
            assert!(events[1].contains("\"delta\":\"Hi\""));
            for e in [events[0], events[2]] {
                let data: Value = serde_json::from_str(e.split_once("data: ").unwrap().1).unwrap();
                assert_eq!(data["response"]["previous_response_id"], "resp_1", "{e}");
                assert_eq!(data["response"]["store"], true);
            }
        }
    }
}
