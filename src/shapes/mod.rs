//! The API shapes idem speaks besides chat completions, and their
//! translation to and from the chat form the core knows: Anthropic's
//! Messages API ([`messages`]) and OpenAI's Responses API ([`responses`]),
//! as the faces of the chat path read and render them. Pure functions over
//! JSON: no I/O, no HTTP, nothing of idem's core, so that every layer that
//! speaks a shape (the faces, the providers, the mock) shares one reading
//! of it.

/// The size of the pieces, in bytes, that a replayed answer's text and
/// tool arguments are cut into: a live stream sends a token or so per
/// chunk; a replay has the whole answer at hand and sends it in a few
/// chunks, still small enough that a client renders it progressively.
pub const PIECE_BYTES: usize = 256;

pub mod messages;
pub mod responses;
pub mod responses_api;

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

/// `text` cut into pieces of at most `max` bytes (more only for a single
/// character that is longer), on character boundaries: what every replayed
/// stream (chat, Messages, Responses) sends its text in.
pub fn pieces(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len().min(max);
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        if end == 0 {
            end = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        let (piece, tail) = rest.split_at(end);
        rest = tail;
        Some(piece)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cut(text: &str, max: usize) -> Vec<&str> {
        pieces(text, max).collect()
    }

    #[test]
    fn pieces_respect_char_boundaries() {
        assert!(cut("", 4).is_empty());
        assert_eq!(cut("abcdef", 4), ["abcd", "ef"]);
        assert_eq!(cut("aé€", 3), ["aé", "€"]);
        assert_eq!(cut("🦀x", 2), ["🦀", "x"]);
    }
}
