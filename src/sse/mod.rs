//! Streaming: a chat completion in its SSE form and in its plain JSON form.
//!
//! A flight has one upstream call but followers that may want either form
//! (docs/design.md, "The request path" and "Coalescing and the caches"): a leader that streamed must still give a
//! non-streaming follower, the result cache and the job store one plain
//! `chat.completion` ([`assemble`]), and a plain answer from the cache or a
//! non-streaming leader must reach a streaming client as a stream it cannot
//! tell from a live one ([`synthesize`]). While a live stream is relayed,
//! [`EventSplitter`] cuts the bytes as they arrive into whole events, so a
//! follower joining late replays complete events, never half a line.
//!
//! `events` cuts the bytes into events and knows how far a live stream may
//! be relayed, `assembly` and `synthesis` go from one form to the other,
//! and `usage` gives each asker the usage chunk it asked for.

mod assembly;
mod events;
mod synthesis;
mod usage;

use serde_json::Value;

pub use assembly::assemble;
pub use events::{EventSplitter, RelayPoint, Terminal};
pub use synthesis::synthesize;
pub use usage::{has_usage_chunk, with_usage, without_usage};

/// Why a byte stream could not be assembled into a completion.
#[derive(Debug, thiserror::Error)]
pub enum SseError {
    /// The provider sent an error inside the stream (`data: {"error": ...}`
    /// or an `event: error`); the value is its error object.
    #[error("the provider reported an error in the stream")]
    Upstream(Value),
    /// An event's data is neither JSON nor `[DONE]`.
    #[error("event {event} is not JSON: {source}")]
    Json {
        event: usize,
        #[source]
        source: serde_json::Error,
    },
    /// An event's data is JSON but not a chunk object.
    #[error("event {event} is not a chat completion chunk")]
    NotAChunk { event: usize },
    /// The stream carried no chunk at all.
    #[error("the stream carried no chunk")]
    Empty,
    /// The stream stopped before `[DONE]` and before every choice had a
    /// `finish_reason`: the answer may be cut short, so it must not be
    /// cached or stored as a result.
    #[error("the stream ended before [DONE] and before every choice finished")]
    Truncated,
}

/// The size of the pieces, in bytes, that a replayed answer's text and
/// tool arguments are cut into: a live stream sends a token or so per
/// chunk; a replay has the whole answer at hand and sends it in a few
/// chunks, still small enough that a client renders it progressively.
pub const PIECE_BYTES: usize = 256;

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
mod pieces_tests {
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

// Last, so that the layout test, which reads a file only up to its first
// test module, sees all of the code above.
#[cfg(test)]
mod fixtures;
