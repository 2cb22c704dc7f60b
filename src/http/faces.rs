//! The faces of the chat path: what the client of each API shape sent, and
//! the shared answer rendered in that shape.
//!
//! `POST /v1/chat/completions`, `POST /v1/messages` (Anthropic's Messages
//! API) and `POST /v1/responses` (OpenAI's Responses API) run the same path
//! (docs/design.md, "Endpoints: one core, several faces"): the request is
//! translated into a chat completion request
//! ([`crate::shapes::messages`], [`crate::shapes::responses`]), the
//! face joins the fingerprint, and the core's answer, a chat completion, is
//! rendered here in the form this asker wants: plain or streamed, in its
//! face's shape. A live stream is
//! translated chunk by chunk as it arrives, so a streamed Messages or
//! Responses client sees the leader's tokens as they come.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use serde_json::{Value, json};

use super::openai::{json_response, sse_response};
use crate::answer::Answer;
use crate::fingerprint::Fingerprint;
use crate::flight::Flight;
use crate::shapes::{messages, responses};
use crate::sse::EventSplitter;

/// The API shape a request came in by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Face {
    Chat,
    Messages,
    Responses,
}

impl Face {
    /// Its name in the request log, `idem analyze` and its span.
    pub fn as_str(self) -> &'static str {
        match self {
            Face::Chat => "chat",
            Face::Messages => "messages",
            Face::Responses => "responses",
        }
    }
}

/// How one asker wants the shared answer, as its request holds it.
pub struct Wants {
    pub face: Face,
    pub stream: bool,
    /// A streamed chat asker's `stream_options.include_usage`.
    pub include_usage: bool,
    /// What a Responses asker adds.
    pub responses: Option<Box<ResponsesAsk>>,
}

impl Wants {
    pub fn asked(&self) -> Asked<'_> {
        asked(
            self.face,
            self.stream,
            self.include_usage,
            self.responses.as_deref(),
        )
    }
}

/// [`Asked`] from its parts (a Responses face without its extras is
/// rendered as Messages never is: it cannot happen, and renders plain chat).
pub fn asked(
    face: Face,
    stream: bool,
    include_usage: bool,
    responses: Option<&ResponsesAsk>,
) -> Asked<'_> {
    match (face, responses) {
        (Face::Messages, _) => Asked::Messages { stream },
        (Face::Responses, Some(r)) => Asked::Responses(r),
        _ => Asked::Chat {
            stream,
            include_usage,
        },
    }
}

/// How one asker wants the shared answer: its face and form.
#[derive(Clone, Copy)]
pub enum Asked<'a> {
    Chat { stream: bool, include_usage: bool },
    Messages { stream: bool },
    Responses(&'a ResponsesAsk),
}

/// What a Responses client asked for beyond its task.
pub struct ResponsesAsk {
    pub stream: bool,
    /// What of the request the response object repeats.
    pub echo: responses::Echo,
    /// `store` (OpenAI's default: true): kept for `GET` and continuation.
    pub store: bool,
    /// The conversation so far and this request's turns, as chat messages:
    /// what a stored response continues from.
    pub turns: Vec<Value>,
}

impl Asked<'_> {
    pub fn stream(&self) -> bool {
        match self {
            Asked::Chat { stream, .. } | Asked::Messages { stream } => *stream,
            Asked::Responses(r) => r.stream,
        }
    }
}

/// The id of the Responses object made of `completion` for the task `fp`:
/// every asker of one shared answer sees the same id, and two tenants'
/// answers never share one (the fingerprint names the tenant).
pub fn response_id(fp: &Fingerprint, completion_id: &str, created: u64) -> String {
    let mut h = blake3::Hasher::new();
    h.update(fp.as_bytes());
    h.update(completion_id.as_bytes());
    h.update(&created.to_le_bytes());
    format!("resp_{}", &h.finalize().to_hex()[..40])
}

/// A completion's `id` and `created`, as its id derivation reads them.
fn identity(completion: &Value) -> (&str, u64) {
    (
        completion.get("id").and_then(Value::as_str).unwrap_or(""),
        completion
            .get("created")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    )
}

/// A successful answer rendered for a Messages or Responses asker (chat
/// askers are rendered by `openai::render`). `None` when the answer's body
/// is not a completion (the completion check keeps such answers out; the
/// caller answers 502).
pub fn render_success(asked: Asked<'_>, fp: &Fingerprint, answer: &Answer) -> Option<Response> {
    let completion = answer.completion_json()?;
    Some(match asked {
        Asked::Chat { .. } => return None,
        Asked::Messages { stream: false } => json(messages::message_from_completion(&completion)),
        Asked::Messages { stream: true } => {
            sse_response(Body::from(messages::stream_from_completion(&completion)))
        }
        Asked::Responses(r) => {
            let (cid, created) = identity(&completion);
            let id = response_id(fp, cid, created);
            if r.stream {
                sse_response(Body::from(responses::stream_from_completion(
                    &completion,
                    &id,
                    created,
                    &r.echo,
                )))
            } else {
                json(responses::response_from_completion(
                    &completion,
                    &id,
                    created,
                    &r.echo,
                ))
            }
        }
    })
}

/// The response object a stored response keeps, and the conversation it
/// continues: what `store: true` writes once the answer is whole.
pub fn stored(
    asked: &ResponsesAsk,
    fp: &Fingerprint,
    answer: &Answer,
) -> Option<(String, Value, Vec<Value>)> {
    if !answer.is_success() {
        return None;
    }
    let completion = answer.completion_json()?;
    let (cid, created) = identity(&completion);
    let id = response_id(fp, cid, created);
    let body = responses::response_from_completion(&completion, &id, created, &asked.echo);
    let mut turns = asked.turns.clone();
    turns.extend(responses::answer_turns(&completion));
    Some((id, body, turns))
}

/// One face's live translation: chat chunks in, its events out.
trait Translate: Send + 'static {
    fn push(&mut self, chunk: &Value) -> Bytes;
    fn finish(&mut self) -> Bytes;
    /// The stream broke after it began: `body` is the error idem wrote.
    fn fail(&mut self, status: StatusCode, body: &[u8]) -> Bytes;
}

impl Translate for messages::StreamTranslator {
    fn push(&mut self, chunk: &Value) -> Bytes {
        messages::StreamTranslator::push(self, chunk)
    }
    fn finish(&mut self) -> Bytes {
        messages::StreamTranslator::finish(self)
    }
    fn fail(&mut self, status: StatusCode, body: &[u8]) -> Bytes {
        // Anthropic's own streams end in an `error` event when they break.
        let (message, _) = openai_error(body);
        let event = messages::error_body(messages::error_kind(status.as_u16()), &message);
        Bytes::from(format!("event: error\ndata: {event}\n\n"))
    }
}

/// The Responses translator, started at the first chunk (the response's id
/// is made of the completion's).
struct ResponsesRelay {
    fp: Fingerprint,
    echo: Option<responses::Echo>,
    inner: Option<responses::StreamTranslator>,
}

impl ResponsesRelay {
    fn started(&mut self, chunk: &Value) -> Option<&mut responses::StreamTranslator> {
        if self.inner.is_none() {
            let (cid, created) = identity(chunk);
            let id = response_id(&self.fp, cid, created);
            let echo = self.echo.take()?;
            self.inner = Some(responses::StreamTranslator::new(&id, created, echo));
        }
        self.inner.as_mut()
    }
}

impl Translate for ResponsesRelay {
    fn push(&mut self, chunk: &Value) -> Bytes {
        match self.started(chunk) {
            Some(t) => t.push(chunk),
            None => Bytes::new(),
        }
    }
    fn finish(&mut self) -> Bytes {
        match self.inner.as_mut() {
            Some(t) => t.finish(),
            None => Bytes::new(),
        }
    }
    fn fail(&mut self, _status: StatusCode, body: &[u8]) -> Bytes {
        let (message, code) = openai_error(body);
        match self.inner.as_mut() {
            Some(t) => t.fail(&code, &message),
            None => {
                let event = json!({"type": "error", "code": code, "message": message, "param": null, "sequence_number": 0});
                Bytes::from(format!("event: error\ndata: {event}\n\n"))
            }
        }
    }
}

/// The message and code of an OpenAI error body (what idem and its
/// dialects write).
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

/// Relays a streaming flight to a Messages or Responses asker, translating
/// the chat chunks as they arrive. `None` for a chat asker.
pub fn live_response(asked: Asked<'_>, fp: &Fingerprint, flight: Arc<Flight>) -> Option<Response> {
    let translator: Box<dyn Translate> = match asked {
        Asked::Chat { .. } => return None,
        Asked::Messages { .. } => Box::new(messages::StreamTranslator::new()),
        Asked::Responses(r) => Box::new(ResponsesRelay {
            fp: *fp,
            echo: Some(r.echo.clone()),
            inner: None,
        }),
    };
    let rx = flight.subscribe();
    let state = Relay {
        flight,
        rx,
        next: 0,
        splitter: EventSplitter::new(),
        translator,
        ended: false,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        if s.ended {
            return None;
        }
        loop {
            let (chunks, done) = s.flight.chunks_from(s.next);
            if !chunks.is_empty() {
                s.next += chunks.len();
                let mut out = BytesMut::new();
                for c in chunks {
                    for data in s.splitter.push(&c) {
                        if data == "[DONE]" {
                            out.extend_from_slice(&s.translator.finish());
                        } else if let Ok(chunk) = serde_json::from_str::<Value>(&data) {
                            out.extend_from_slice(&s.translator.push(&chunk));
                        }
                    }
                }
                if !out.is_empty() {
                    return Some((Ok::<_, Infallible>(out.freeze()), s));
                }
                continue;
            }
            if let Some(answer) = done {
                s.ended = true;
                let last = if answer.failure.is_some() || !answer.is_success() {
                    s.translator.fail(answer.status, &answer.body)
                } else {
                    // The chat stream always ends in `[DONE]`, which
                    // finished the translation; this is a no-op then.
                    s.translator.finish()
                };
                return (!last.is_empty()).then_some((Ok(last), s));
            }
            if s.rx.changed().await.is_err() {
                return None;
            }
        }
    });
    Some(sse_response(Body::from_stream(stream)))
}

/// A live relay's state.
struct Relay {
    flight: Arc<Flight>,
    rx: tokio::sync::watch::Receiver<u64>,
    next: usize,
    splitter: EventSplitter,
    translator: Box<dyn Translate>,
    ended: bool,
}

/// An error answer of a Messages request in Anthropic's shape
/// (`{"type": "error", "error": {"type", "message"}}`), whatever idem or
/// the provider wrote: the one place the Messages face's errors are made.
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

/// A 200 with a JSON body.
fn json(v: Value) -> Response {
    json_response(Bytes::from(v.to_string()), StatusCode::OK, None)
}
