//! Translation between dialects, and only between them (docs/design.md,
//! "Endpoints: one core, several dialects").
//!
//! A request goes to a target in the request's own dialect whenever the
//! target speaks it: the client's request as sent, with the target's model
//! (and what the call itself needs: a chat stream's usage, `store: false`
//! where idem keeps responses), and the client's answer-changing headers.
//! Only when the target speaks another dialect is the request translated
//! here, and the target's reply translated back into the request's dialect
//! as it arrives, so that everything after the call (the flight, the
//! caches, the checks, every asker) has the answer in the request's
//! dialect. [`prepare`] says which, per target.
//!
//! One folder per pair, each in its request, reply and stream parts:
//! [`chat_messages`] (a chat request to an Anthropic target),
//! [`messages_chat`] (a Messages request to a chat target),
//! [`responses_chat`] (a Responses request to a chat target). A Responses
//! request to an Anthropic target goes through chat both ways. A token
//! count for a target whose API has none is counted here ([`local`]). A
//! Responses answer to a conversation idem spelled out names what the
//! client sent ([`continuation`]).
//! What has a meaning on the other side is translated; what has none is
//! refused with a [`Refusal`] naming the field and the target, before
//! anything is sent. The table of every field is in docs/http-api.md.

pub mod chat_messages;
mod continuation;
mod local;
pub mod messages_chat;
pub mod responses_chat;
#[cfg(test)]
mod table_tests;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use serde_json::{Map, Value};

use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::providers::{BodyStream, UpstreamReply};
use crate::routes::Target;

/// Why a request cannot be said to a target (or, read by a face, at all):
/// the HTTP layer answers 400 `invalid_request_error` with its `param`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// What is wrong, in words the client's developer can act on.
    pub message: String,
    /// The offending field as a dotted path (`messages.2.content.0.type`,
    /// `tools.3.type`), like OpenAI's `param`.
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

    /// The same refusal, saying which target it could not reach.
    fn for_target(self, target: &Target) -> Refusal {
        Refusal {
            message: format!(
                "{} (target {} of provider {}, which speaks {})",
                self.message,
                target.model,
                target.provider.name,
                Dialect::native_to(target.provider.kind).as_str(),
            ),
            param: self.param,
        }
    }
}

/// What one call to a target is made of.
pub enum Prepared {
    /// A request to send.
    Send(Sendable),
    /// An answer idem makes itself, with no call (a token count by the
    /// target model's tokenizer): its body, in the request's dialect.
    Local(Bytes),
}

/// A request to send to a target, and how its reply is read.
pub struct Sendable {
    /// What the target is sent: the request's dialect, or the target's own.
    pub dialect: Dialect,
    pub body: Bytes,
    /// The client's answer-changing headers (only to a target of the
    /// request's dialect).
    pub forwarded: Forwarded,
    /// The reply's translation into the request's dialect (none: the
    /// target speaks it).
    pub reply: Option<Box<dyn Reply>>,
}

/// A reply's translation from a target's dialect into the request's.
pub trait Reply: Send {
    /// A whole 2xx body; `None` when it is not an answer of the target's
    /// dialect (then it is passed on as it came, and the answer's check
    /// refuses it).
    fn plain(&mut self, body: &[u8]) -> Option<Bytes>;
    /// Bytes of a 2xx stream as they arrive: whole events of the request's
    /// dialect out.
    fn push(&mut self, bytes: &[u8]) -> Bytes;
    /// The stream ended: what is still held.
    fn finish(&mut self) -> Bytes;
    /// An error answer in OpenAI's words (the shape idem's own errors
    /// have; the Messages face gives every error Anthropic's shape), with
    /// the status OpenAI's clients know.
    fn error(&self, status: u16, body: &[u8]) -> (u16, Bytes) {
        (status, Bytes::copy_from_slice(body))
    }
}

/// How a request of dialect `from` reaches `target`: as sent, or
/// translated, or answered here. `fp` names the task (a translated
/// Responses answer's id is made of it, so every asker sees one id and no
/// two tenants share one).
pub fn prepare(
    from: Dialect,
    request: &Map<String, Value>,
    forwarded: &Forwarded,
    target: &Target,
    fp: &Fingerprint,
) -> Result<Prepared, Refusal> {
    let provider = &target.provider;
    if provider.speaks(from) {
        let body = native(from, request, target);
        // A continued conversation was sent spelled out: its answer names
        // what the client sent. Any other goes as the provider wrote it.
        let reply = match from {
            Dialect::Responses => {
                continuation::Continuation::of(request).map(|c| Box::new(c) as Box<dyn Reply>)
            }
            _ => None,
        };
        return Ok(Prepared::Send(Sendable {
            dialect: from,
            body,
            forwarded: forwarded.clone(),
            reply,
        }));
    }
    let to = Dialect::native_to(provider.kind);
    let refused = |r: Refusal| r.for_target(target);
    let send = |dialect, body: Map<String, Value>, reply: Box<dyn Reply>| {
        Ok(Prepared::Send(Sendable {
            dialect,
            body: to_bytes(&body),
            forwarded: Forwarded::default(),
            reply: Some(reply),
        }))
    };
    match (from, to) {
        (Dialect::Chat, Dialect::Messages) => {
            let (body, reading) = chat_messages::request::translate(
                &with_model(request, target),
                provider.default_max_tokens,
            )
            .map_err(refused)?;
            send(
                Dialect::Messages,
                body,
                Box::new(chat_messages::Reply::new(reading)),
            )
        }
        (Dialect::Messages, Dialect::Chat) => {
            let chat = messages_chat::request::to_chat(request, &target.model).map_err(refused)?;
            let body = chat_body(target, chat);
            send(Dialect::Chat, body, Box::<messages_chat::Reply>::default())
        }
        (Dialect::Responses, Dialect::Chat) => {
            let chat = responses_chat::request::to_chat(request).map_err(refused)?;
            let body = chat_body(target, chat);
            let reply = responses_chat::Reply::new(*fp, request);
            send(Dialect::Chat, body, Box::new(reply))
        }
        (Dialect::Responses, Dialect::Messages) => {
            let chat = responses_chat::request::to_chat(request).map_err(refused)?;
            let (body, reading) = chat_messages::request::translate(
                &with_model(&chat_with_stream(chat), target),
                provider.default_max_tokens,
            )
            .map_err(refused)?;
            let reply = Chain(
                Box::new(chat_messages::Reply::new(reading)),
                Box::new(responses_chat::Reply::new(*fp, request)),
            );
            send(Dialect::Messages, body, Box::new(reply))
        }
        (Dialect::CountTokens, _) => local::count(request, target)
            .map(Prepared::Local)
            .map_err(refused),
        _ => Err(Refusal::at(
            "model",
            format!(
                "a {} request cannot be translated for this target",
                from.as_str()
            ),
        )
        .for_target(target)),
    }
}

/// A request as its client sent it, made this call's: the target's model,
/// and what the call itself needs.
fn native(dialect: Dialect, request: &Map<String, Value>, target: &Target) -> Bytes {
    match dialect {
        Dialect::Chat => to_bytes(&chat_body(target, request.clone())),
        Dialect::Responses => {
            let mut body = with_model(request, target);
            // idem keeps the responses it serves (`store`), per tenant; the
            // conversation a request continues is in its `input` already.
            body.insert("store".into(), Value::Bool(false));
            body.remove("previous_response_id");
            to_bytes(&body)
        }
        _ => to_bytes(&with_model(request, target)),
    }
}

/// A chat request for `target`: its model, and a streamed call's
/// `stream_options` made idem's own. Those are rendering options, which
/// each asker of a shared answer gets as it asked (see
/// `Answer::stream_body`): the call asks for usage (unless the provider's
/// `stream_usage` is off) and nothing else. Every other field as it came.
pub fn chat_body(target: &Target, mut body: Map<String, Value>) -> Map<String, Value> {
    body.insert("model".into(), Value::String(target.model.to_string()));
    if body.get("stream") == Some(&Value::Bool(true)) && target.provider.stream_usage {
        body.insert(
            "stream_options".into(),
            serde_json::json!({"include_usage": true}),
        );
    } else {
        body.remove("stream_options");
    }
    body
}

fn with_model(request: &Map<String, Value>, target: &Target) -> Map<String, Value> {
    let mut body = request.clone();
    body.insert("model".into(), Value::String(target.model.to_string()));
    body
}

/// A chat request that streams asks for its usage: the pivot of a
/// two-step translation must carry it to the far side.
fn chat_with_stream(mut chat: Map<String, Value>) -> Map<String, Value> {
    if chat.get("stream") == Some(&Value::Bool(true)) {
        chat.insert(
            "stream_options".into(),
            serde_json::json!({"include_usage": true}),
        );
    }
    chat
}

fn to_bytes(body: &Map<String, Value>) -> Bytes {
    // Serializing a map of values cannot fail.
    Bytes::from(serde_json::to_vec(body).unwrap_or_default())
}

/// Two translations one after the other (through chat).
struct Chain(Box<dyn Reply>, Box<dyn Reply>);

impl Reply for Chain {
    fn plain(&mut self, body: &[u8]) -> Option<Bytes> {
        let middle = self.0.plain(body)?;
        self.1.plain(&middle)
    }

    fn push(&mut self, bytes: &[u8]) -> Bytes {
        let middle = self.0.push(bytes);
        self.1.push(&middle)
    }

    fn finish(&mut self) -> Bytes {
        let middle = self.0.finish();
        let mut out = BytesMut::from(&self.1.push(&middle)[..]);
        out.extend_from_slice(&self.1.finish());
        out.freeze()
    }

    fn error(&self, status: u16, body: &[u8]) -> (u16, Bytes) {
        let (status, middle) = self.0.error(status, body);
        self.1.error(status, &middle)
    }
}

/// A provider's reply translated by `reply` into the request's dialect: a
/// stream as it arrives, a plain answer or an error once read whole (no
/// further than `limit`: past it, what was read goes on untranslated and
/// the reader's own limit refuses it).
pub fn translated(
    reply: UpstreamReply,
    mut translator: Box<dyn Reply>,
    limit: usize,
) -> UpstreamReply {
    let status = reply.status;
    if status.is_success() && reply.streaming {
        let body: BodyStream = Box::pin(futures_util::stream::unfold(
            (reply.body, Some(translator)),
            |(mut body, translator)| async move {
                let mut t = translator?;
                loop {
                    match body.next().await {
                        Some(Ok(bytes)) => {
                            let out = t.push(&bytes);
                            if !out.is_empty() {
                                return Some((Ok(out), (body, Some(t))));
                            }
                        }
                        Some(Err(e)) => return Some((Err(e), (body, None))),
                        None => {
                            let out = t.finish();
                            return (!out.is_empty()).then_some((Ok(out), (body, None)));
                        }
                    }
                }
            },
        ));
        return UpstreamReply { body, ..reply };
    }
    let code = status.as_u16();
    let new_status = if status.is_success() {
        status
    } else {
        let (translated, _) = translator.error(code, b"");
        reqwest::StatusCode::from_u16(translated).unwrap_or(status)
    };
    let body = crate::providers::whole_then(reply.body, limit, move |bytes| {
        if status.is_success() {
            translator.plain(&bytes).unwrap_or(bytes)
        } else {
            translator.error(code, &bytes).1
        }
    });
    UpstreamReply {
        status: new_status,
        streaming: false,
        body,
        ..reply
    }
}
