//! The faces of the conversation path: how one asker wants the shared
//! answer ([`Asked`]), and that answer rendered for it, plain or streamed,
//! live or finished (docs/design.md, "Endpoints: one core, several
//! dialects").
//!
//! The answer is kept in the asker's own dialect (a flight's askers share
//! its fingerprint, which names the dialect), so rendering is the same for
//! every face: a stream as it came (a live one relayed event by event), a
//! plain answer as it came, and the other form made of it where the asker
//! wants the other form than the leader's call. A chat asker gets a usage
//! chunk exactly when it asked for one. Errors are OpenAI's error objects,
//! or Anthropic's on the Messages face ([`anthropic_error`]).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use serde_json::Value;

use super::openai::{json_response, sse_response};
use crate::answer::{Answer, Form};
use crate::dialect::{Dialect, messages};
use crate::flight::Flight;

/// How one asker wants the shared answer.
#[derive(Debug, Clone, Copy)]
pub struct Asked {
    pub dialect: Dialect,
    pub stream: bool,
    /// A streamed chat asker's `stream_options.include_usage`.
    pub include_usage: bool,
}

/// A finished answer in the form the asker wants.
pub fn render(answer: &Answer, asked: Asked) -> Response {
    if !answer.is_success() {
        // Errors are JSON whatever the client asked for, as OpenAI does
        // (the Messages face gives them Anthropic's shape on the way out).
        return json_response(answer.body.clone(), answer.status, answer.retry_after);
    }
    if asked.stream {
        return sse_response(Body::from(answer.stream_body(asked.include_usage)));
    }
    match answer.plain_body() {
        Ok(plain) => json_response(plain, StatusCode::OK, None),
        // A success whose stream cannot be assembled is no answer for a
        // plain request (the answer check keeps such answers out; this is
        // its last line): a 502, never a 200 with an error body.
        Err(error) => json_response(error, StatusCode::BAD_GATEWAY, None),
    }
}

/// True once `flight`'s provider answered with a streamed success.
pub async fn flight_streams(flight: &Flight) -> bool {
    flight
        .head(None)
        .await
        .is_some_and(|h| h.form == Form::Stream && h.status.is_success())
}

/// Relays a streaming flight: everything buffered so far, then live, event
/// by event as the provider (or the translation) wrote it. The leader's
/// call asked for usage (see `translate::chat_body`); a chat client that
/// did not ask for it gets the stream without its usage chunk. A stream
/// that breaks after it began ends with an error event in the asker's
/// dialect, as providers end theirs, instead of a silent cut.
pub fn live_response(flight: Arc<Flight>, asked: Asked) -> Response {
    let rx = flight.subscribe();
    let state = Relay {
        flight,
        rx,
        next: 0,
        events: 0,
        ended: false,
    };
    let stream = futures_util::stream::unfold(state, move |mut s| async move {
        if s.ended {
            return None;
        }
        loop {
            let (chunks, done) = s.flight.chunks_from(s.next);
            if !chunks.is_empty() {
                s.next += chunks.len();
                let mut bytes = concat(chunks);
                if asked.dialect == Dialect::Chat
                    && !asked.include_usage
                    && let Some(fewer) = crate::sse::without_usage(&bytes)
                {
                    bytes = fewer;
                }
                s.events += memchr::memmem::find_iter(&bytes, b"\n\n").count() as u64;
                return Some((Ok::<_, Infallible>(bytes), s));
            }
            if let Some(answer) = done {
                s.ended = true;
                if answer.is_success() {
                    return None;
                }
                let event = error_event(asked.dialect, &answer, s.events);
                return Some((Ok(event), s));
            }
            if s.rx.changed().await.is_err() {
                return None;
            }
        }
    });
    sse_response(Body::from_stream(stream))
}

/// A live relay's state.
struct Relay {
    flight: Arc<Flight>,
    rx: tokio::sync::watch::Receiver<u64>,
    /// The next chunk of the flight to hand on.
    next: usize,
    /// How many events were handed on (a Responses error event is numbered
    /// after them).
    events: u64,
    ended: bool,
}

/// The event that tells a streaming client its answer broke off: `answer`
/// is the failure idem wrote (an OpenAI error object).
fn error_event(dialect: Dialect, answer: &Answer, seq: u64) -> Bytes {
    let (message, code) = openai_error(&answer.body);
    match dialect {
        Dialect::Messages | Dialect::CountTokens => {
            messages::error_event(messages::error_kind(answer.status.as_u16()), &message)
        }
        Dialect::Responses => crate::dialect::responses::error_event(&code, &message, seq),
        Dialect::Chat | Dialect::Embeddings => Bytes::from(format!(
            "data: {}\n\n",
            String::from_utf8_lossy(&answer.body)
        )),
    }
}

fn concat(chunks: Vec<Bytes>) -> Bytes {
    if chunks.len() == 1 {
        return chunks.into_iter().next().unwrap_or_default();
    }
    let mut buf = BytesMut::with_capacity(chunks.iter().map(Bytes::len).sum());
    for c in chunks {
        buf.extend_from_slice(&c);
    }
    buf.freeze()
}

/// The message and code of an OpenAI error body (what idem and its
/// translations write).
fn openai_error(body: &[u8]) -> (String, String) {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let e = v.get("error").unwrap_or(&Value::Null);
    let text = |k: &str| e.get(k).and_then(Value::as_str).map(str::to_string);
    (
        text("message").unwrap_or_else(|| "the upstream answer broke off".into()),
        text("code")
            .or_else(|| text("type"))
            .unwrap_or_else(|| "server_error".into()),
    )
}

/// An error answer of a Messages request in Anthropic's shape
/// (`{"type": "error", "error": {"type", "message"}}`): idem's own errors
/// and those of a target of another dialect are turned into it; an
/// Anthropic target's own error goes as Anthropic wrote it. The one place
/// the Messages face's errors are made.
pub async fn anthropic_error(resp: Response) -> Response {
    let status = resp.status();
    if status.is_success() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    // idem's own error bodies are small; a provider's is within its limit.
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    if messages::is_error_body(&bytes) {
        return Response::from_parts(parts, Body::from(bytes));
    }
    let (message, _) = openai_error(&bytes);
    let kind = messages::error_kind(status.as_u16());
    let body = messages::error_body(kind, &message).to_string();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body))
}
