//! The usage chunk (`stream_options.include_usage`): a shared stream gets
//! it taken out for a client that did not ask for it, and added for one
//! that did.

use std::ops::Range;

use bytes::Bytes;
use serde_json::{Value, json};

use super::events::{event_data, event_ranges};

/// True when `bytes` may hold a chunk with `"choices": []` (whitespace
/// allowed around the colon and inside the brackets): a quick look before
/// any event is parsed.
fn may_have_empty_choices(bytes: &[u8]) -> bool {
    memchr::memmem::find_iter(bytes, b"\"choices\"").any(|at| {
        let mut rest = bytes[at + 9..]
            .iter()
            .copied()
            .filter(|b| !b.is_ascii_whitespace());
        rest.next() == Some(b':') && rest.next() == Some(b'[') && rest.next() == Some(b']')
    })
}

/// True for the data of a usage chunk: `choices: []` and a `usage`, the
/// last chunk of a stream asked for with `stream_options.include_usage`.
fn is_usage_chunk(data: &str) -> bool {
    serde_json::from_str::<Value>(data).is_ok_and(|v| {
        v.get("choices")
            .and_then(Value::as_array)
            .is_some_and(Vec::is_empty)
            && v.get("usage").is_some_and(|u| !u.is_null())
    })
}

/// The ranges of the usage chunks' events in `stream`.
fn usage_events(stream: &[u8]) -> Vec<Range<usize>> {
    if !may_have_empty_choices(stream) {
        return Vec::new();
    }
    event_ranges(stream)
        .into_iter()
        .filter(|r| {
            let event = &stream[r.clone()];
            may_have_empty_choices(event) && is_usage_chunk(&event_data(event))
        })
        .collect()
}

/// Whether a stream carries a usage chunk.
pub fn has_usage_chunk(stream: &[u8]) -> bool {
    !usage_events(stream).is_empty()
}

/// `stream` (whole events) without its usage chunks, for a client that did
/// not ask for usage: the openai SDKs' usual `chunk.choices[0]` fails on a
/// chunk without choices. `None` when there is none to take out. Every
/// other byte is kept as it is.
pub fn without_usage(stream: &[u8]) -> Option<Bytes> {
    let drop = usage_events(stream);
    if drop.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(stream.len());
    let mut at = 0;
    for r in drop {
        out.extend_from_slice(&stream[at..r.start]);
        at = r.end;
    }
    out.extend_from_slice(&stream[at..]);
    Some(Bytes::from(out))
}

/// `stream` with a usage chunk for `completion`'s usage before its
/// `[DONE]` (or at its end), for a client that asked for usage of a stream
/// that carried none as a chunk of its own. `None` when it has one already
/// or the usage is not known.
pub fn with_usage(stream: &[u8], completion: &Value) -> Option<Bytes> {
    let usage = completion.get("usage").filter(|u| u.is_object())?;
    if has_usage_chunk(stream) {
        return None;
    }
    let field = |key: &str| completion.get(key).cloned().unwrap_or(Value::Null);
    let chunk = json!({
        "id": field("id"),
        "object": "chat.completion.chunk",
        "created": field("created"),
        "model": field("model"),
        "system_fingerprint": field("system_fingerprint"),
        "choices": [],
        "usage": usage,
    });
    let event = format!("data: {chunk}\n\n");
    let ranges = event_ranges(stream);
    let done = ranges
        .iter()
        .rev()
        .find(|r| event_data(&stream[(*r).clone()]).trim() == "[DONE]")
        .map(|r| r.start);
    let mut out = Vec::with_capacity(stream.len() + event.len() + 2);
    match done {
        Some(at) => {
            out.extend_from_slice(&stream[..at]);
            out.extend_from_slice(event.as_bytes());
            out.extend_from_slice(&stream[at..]);
        }
        None => {
            out.extend_from_slice(stream);
            // A last event without its blank line gets one first.
            if ranges.last().is_some_and(|r| r.end == stream.len())
                && !(stream.ends_with(b"\n\n")
                    || stream.ends_with(b"\r\n\r\n")
                    || stream.ends_with(b"\r\r"))
            {
                out.extend_from_slice(b"\n\n");
            }
            out.extend_from_slice(event.as_bytes());
        }
    }
    Some(Bytes::from(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::fixtures::{TOOL_STREAM, events_of, text_completion};
    use crate::sse::{assemble, synthesize};

    /// A client that did not ask for usage gets a tool stream without its
    /// usage chunk, every other byte as it was (CRLF events, comments and
    /// `event:` lines included), and it assembles to the same completion
    /// but for the usage; one that asked gets it as it was.
    #[test]
    fn the_usage_chunk_is_taken_out_for_a_client_that_did_not_ask() {
        let stream = TOOL_STREAM.as_bytes();
        assert!(has_usage_chunk(stream));
        let fewer = without_usage(stream).expect("a usage chunk to take out");
        assert!(!has_usage_chunk(&fewer));
        let usage_event = TOOL_STREAM
            .split("\n\n")
            .find(|e| e.contains("\"choices\":[]"))
            .unwrap();
        assert_eq!(
            std::str::from_utf8(&fewer).unwrap(),
            TOOL_STREAM.replace(&format!("{usage_event}\n\n"), "")
        );
        let mut whole = assemble(stream).unwrap();
        let assembled = assemble(&fewer).unwrap();
        assert!(assembled["usage"].is_null());
        whole["usage"] = Value::Null;
        assert_eq!(assembled, whole);
        // Nothing to take out: nothing is made.
        assert!(without_usage(&fewer).is_none());
        // With usage asked for and present, nothing is added.
        assert!(with_usage(stream, &assemble(stream).unwrap()).is_none());
    }

    /// `"choices": []` spelled with spaces, and over CRLF lines, is found;
    /// a chunk without choices that carries no usage (Azure's prompt
    /// filter results) is left alone.
    #[test]
    fn usage_chunks_are_found_however_they_are_spaced() {
        let spaced = "data: {\"id\":\"x\",\"choices\": [ ],\"usage\": {\"prompt_tokens\": 1, \"completion_tokens\": 2}}\r\n\r\ndata: [DONE]\r\n\r\n";
        assert_eq!(
            without_usage(spaced.as_bytes()).as_deref(),
            Some(&b"data: [DONE]\r\n\r\n"[..])
        );
        let filter = "data: {\"id\":\"x\",\"choices\":[],\"prompt_filter_results\":[]}\n\n";
        assert!(without_usage(filter.as_bytes()).is_none());
        let null = "data: {\"id\":\"x\",\"choices\":[],\"usage\":null}\n\n";
        assert!(without_usage(null.as_bytes()).is_none());
    }

    /// A client that asked for usage of a stream that carried none as a
    /// chunk of its own gets one before `[DONE]` when the usage is known
    /// (here on the last content chunk), and nothing made up when not.
    #[test]
    fn a_usage_chunk_is_added_for_a_client_that_asked() {
        let completion = text_completion();
        let plain = synthesize(&completion, false);
        assert!(!has_usage_chunk(&plain));
        let more = with_usage(&plain, &completion).expect("a usage chunk to add");
        assert!(more.ends_with(b"data: [DONE]\n\n"));
        let events = events_of(&more);
        let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(usage["usage"], completion["usage"]);
        assert_eq!(usage["id"], completion["id"]);
        assert_eq!(assemble(&more).unwrap(), completion);
        // Without a [DONE] (every choice finished), at the end.
        let cut = &plain[..plain.len() - b"data: [DONE]\n\n".len()];
        let more = with_usage(cut, &completion).unwrap();
        assert!(has_usage_chunk(&more) && more.ends_with(b"}\n\n"));
        let mut unknown = completion.clone();
        unknown["usage"] = Value::Null;
        assert!(with_usage(&plain, &unknown).is_none());
    }
}
