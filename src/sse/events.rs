//! Cutting an SSE byte stream into its events, and how much of a live
//! stream may be handed on before it has ended.

use std::ops::Range;

/// One server-sent event: its `event:` type, if any, and its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Event {
    pub(super) kind: Option<String>,
    pub(super) data: String,
}

/// Incremental splitter used while relaying a live stream: feed arbitrary
/// byte chunks, get complete events' data payloads out.
///
/// It follows the HTML SSE parsing rules: lines end in LF, CRLF or CR (a
/// CRLF split between two pushes is still one line end), `:` lines are
/// comments, `data:` lines of one event are joined with `\n`, one space
/// after the colon is dropped, `id:`/`retry:` and unknown fields are
/// ignored, and an empty line ends an event (an event without data is not
/// one). Bytes are kept until their line is complete, so a multi-byte UTF-8
/// character split between pushes decodes correctly.
#[derive(Debug, Default)]
pub struct EventSplitter {
    /// The current line, not yet terminated.
    line: Vec<u8>,
    /// The data of the event in progress.
    data: String,
    has_data: bool,
    kind: Option<String>,
    /// The previous push ended with CR: an LF at the start of the next one
    /// belongs to it.
    after_cr: bool,
}

impl EventSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the data of every event they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        let mut events = Vec::new();
        self.feed(bytes, &mut events);
        events.into_iter().map(|e| e.data).collect()
    }

    /// Ends the stream: an event cut off without its closing blank line (or
    /// even its line end) is still returned. The SSE rules would drop it,
    /// but providers that forget the last blank line are common, and
    /// [`assemble`](super::assemble) still refuses an answer that is really cut short.
    pub fn finish(self) -> Option<String> {
        self.finish_event().map(|e| e.data)
    }

    pub(super) fn feed(&mut self, bytes: &[u8], events: &mut Vec<Event>) {
        let mut rest = bytes;
        if self.after_cr && !rest.is_empty() {
            self.after_cr = false;
            if rest.first() == Some(&b'\n') {
                rest = &rest[1..];
            }
        }
        while let Some(end) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            if self.line.is_empty() {
                self.line_complete(&rest[..end], events);
            } else {
                let mut line = std::mem::take(&mut self.line);
                line.extend_from_slice(&rest[..end]);
                self.line_complete(&line, events);
                // Keep the allocation for the next split line.
                line.clear();
                self.line = line;
            }
            let crlf = rest[end] == b'\r' && rest.get(end + 1) == Some(&b'\n');
            rest = &rest[end + if crlf { 2 } else { 1 }..];
            if rest.is_empty() && !crlf && bytes.last() == Some(&b'\r') {
                self.after_cr = true;
            }
        }
        self.line.extend_from_slice(rest);
    }

    fn line_complete(&mut self, line: &[u8], events: &mut Vec<Event>) {
        if line.is_empty() {
            if self.has_data {
                events.push(Event {
                    kind: self.kind.take(),
                    data: std::mem::take(&mut self.data),
                });
                self.has_data = false;
            } else {
                self.kind = None;
            }
            return;
        }
        if line.first() == Some(&b':') {
            return;
        }
        let (field, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        match field {
            b"data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&String::from_utf8_lossy(value));
                self.has_data = true;
            }
            b"event" => self.kind = Some(String::from_utf8_lossy(value).into_owned()),
            _ => {}
        }
    }

    pub(super) fn finish_event(mut self) -> Option<Event> {
        let mut events = Vec::new();
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_complete(&line, &mut events);
        }
        self.line_complete(&[], &mut events);
        events.pop()
    }
}

/// How a stream of a dialect ends when its answer is whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Terminal {
    /// A `data: [DONE]` line (chat completions).
    #[default]
    Done,
    /// An event of one of these types: its `event:` line, or the `type` at
    /// the start of its data (the Messages and Responses APIs).
    Event(&'static [&'static str]),
}

/// How much of a live stream a relay may hand on before the stream has
/// ended: whole events, up to and including the last blank line (a line
/// end right after a line end, LF, CRLF or CR alike), and none from the
/// stream's terminal event on (`[DONE]`, `message_stop`,
/// `response.completed`: see [`Terminal`]).
///
/// Whole events, so that whatever follows (the next event, or the error
/// event a client gets when the stream breaks off) starts an event of its
/// own, never half a line; not the terminal event, so that a client reads
/// the end of the stream only once the whole answer is known to be well
/// formed.
///
/// It reads each byte once however the stream is cut: [`RelayPoint::advance`]
/// takes the whole stream so far and carries on where it stopped.
#[derive(Debug, Default)]
pub struct RelayPoint {
    /// What ends the stream.
    terminal: Terminal,
    /// The end of the last blank line: what may be handed on.
    cut: usize,
    /// Where the current line starts.
    line_start: usize,
    /// How far the current line has been searched for its end.
    searched: usize,
    /// The terminal event was found: nothing more may be handed on.
    done: bool,
}

impl RelayPoint {
    /// A relay point for a stream that ends as `terminal` says.
    pub fn new(terminal: Terminal) -> RelayPoint {
        RelayPoint {
            terminal,
            ..RelayPoint::default()
        }
    }

    /// `stream` is everything received so far (each call's a prefix of the
    /// next one's); returns how many of its bytes may be handed on.
    pub fn advance(&mut self, stream: &[u8]) -> usize {
        while !self.done {
            let Some(offset) = stream[self.searched..]
                .iter()
                .position(|&b| b == b'\n' || b == b'\r')
            else {
                self.searched = stream.len();
                break;
            };
            let end = self.searched + offset;
            if stream[end] == b'\r' && end + 1 == stream.len() {
                // The first half of a CRLF, perhaps: wait for the next byte.
                self.searched = end;
                break;
            }
            let line = &stream[self.line_start..end];
            if is_terminal_line(line, self.terminal) {
                self.done = true;
                break;
            }
            let crlf = stream[end] == b'\r' && stream.get(end + 1) == Some(&b'\n');
            let next = end + if crlf { 2 } else { 1 };
            if line.is_empty() {
                self.cut = next;
            }
            self.line_start = next;
            self.searched = next;
        }
        self.cut
    }
}

/// True for the line that starts a stream's terminal event: `data: [DONE]`
/// (chat), or an `event:` line naming a terminal type, or a `data:` line
/// whose JSON starts with that `type` (without its line end).
fn is_terminal_line(line: &[u8], terminal: Terminal) -> bool {
    match terminal {
        Terminal::Done => is_done_line(line),
        Terminal::Event(types) => {
            if let Some(name) = line.strip_prefix(b"event:") {
                let name = name.trim_ascii();
                return types.iter().any(|t| name == t.as_bytes());
            }
            let Some(data) = line.strip_prefix(b"data:") else {
                return false;
            };
            let data = data.trim_ascii_start();
            types.iter().any(|t| {
                let typed = format!("{{\"type\":\"{t}\"");
                data.starts_with(typed.as_bytes())
            })
        }
    }
}

/// True for a `data: [DONE]` line (without its line end).
fn is_done_line(line: &[u8]) -> bool {
    line.strip_prefix(b"data:")
        .is_some_and(|value| value.trim_ascii() == b"[DONE]")
}

/// The byte ranges of the events of `stream`, each with the blank line
/// that ends it (a last event without one runs to the end of the stream).
/// Blank lines between events belong to no range.
pub(super) fn event_ranges(stream: &[u8]) -> Vec<Range<usize>> {
    let mut ranges = Vec::new();
    let (mut start, mut line_start, mut i) = (0, 0, 0);
    while let Some(offset) = stream[i..].iter().position(|&b| b == b'\n' || b == b'\r') {
        let end = i + offset;
        let crlf = stream[end] == b'\r' && stream.get(end + 1) == Some(&b'\n');
        let next = end + if crlf { 2 } else { 1 };
        if end == line_start {
            if line_start > start {
                ranges.push(start..next);
            }
            start = next;
        }
        line_start = next;
        i = next;
    }
    if start < stream.len() {
        ranges.push(start..stream.len());
    }
    ranges
}

/// The data of one event's bytes (its `data:` lines joined by `\n`).
pub(super) fn event_data(event: &[u8]) -> String {
    let mut splitter = EventSplitter::new();
    let mut events = Vec::new();
    splitter.feed(event, &mut events);
    events.extend(splitter.finish_event());
    events
        .into_iter()
        .map(|e| e.data)
        .next()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sse::fixtures::{TEXT_STREAM, TOOL_STREAM, events_of};

    #[test]
    fn splitting_at_any_byte_changes_nothing() {
        let mixed = format!("{TOOL_STREAM}{TEXT_STREAM}").replace("data: [DONE]\n\n", "");
        let cr_only = TEXT_STREAM.replace('\n', "\r");
        for stream in [TOOL_STREAM, TEXT_STREAM, mixed.as_str(), cr_only.as_str()] {
            let bytes = stream.as_bytes();
            let whole = events_of(bytes);
            assert!(whole.len() > 3);
            for cut in 0..=bytes.len() {
                let mut splitter = EventSplitter::new();
                let mut events = splitter.push(&bytes[..cut]);
                events.extend(splitter.push(&bytes[cut..]));
                events.extend(splitter.finish());
                assert_eq!(events, whole, "split at byte {cut}");
            }
            let mut splitter = EventSplitter::new();
            let mut events: Vec<String> = bytes.iter().flat_map(|b| splitter.push(&[*b])).collect();
            events.extend(splitter.finish());
            assert_eq!(events, whole, "one byte at a time");
        }
        assert_eq!(events_of(TOOL_STREAM.as_bytes()).len(), 10);
    }

    fn relayable_len(stream: &[u8]) -> usize {
        RelayPoint::default().advance(stream)
    }

    #[test]
    fn a_relay_hands_on_whole_events_and_nothing_from_done_on() {
        assert_eq!(relayable_len(b""), 0);
        assert_eq!(relayable_len(b"data: a"), 0);
        assert_eq!(relayable_len(b"data: a\n"), 0);
        assert_eq!(relayable_len(b"data: a\n\n"), 9);
        assert_eq!(relayable_len(b"data: a\n\ndata: b\n"), 9);
        assert_eq!(relayable_len(b"data: a\n\ndata: b\n\ndata: {\"c"), 18);
        assert_eq!(relayable_len(b"data: a\r\n\r\ndata: b"), 11);
        assert_eq!(relayable_len(b"data: a\r\rdata: b"), 9);
        // A CR at the end may be half a CRLF: the event waits for it.
        assert_eq!(relayable_len(b"data: a\r\n\r"), 0);
        assert_eq!(relayable_len(b"data: a\r\n\r\n"), 11);
        assert_eq!(relayable_len(b"event: x\ndata: a\n\n"), 18);
        // A blank line at the start ends nothing, but is whole.
        assert_eq!(relayable_len(b"\ndata: a"), 1);
        // `[DONE]`, however spelled, waits, and so does all after it.
        assert_eq!(relayable_len(b"data: a\n\ndata: [DONE]\n\n"), 9);
        assert_eq!(
            relayable_len(b"data: a\n\ndata:[DONE]\r\n\r\ndata: b\n\n"),
            9
        );
        assert_eq!(relayable_len(b"data: [DONE]\n\n"), 0);
        assert_eq!(relayable_len(b"data: [DONE] x\n\n"), 16);

        // Every cut of a real stream: the prefix ends where an event of the
        // whole stream ends, the splitter reads the same events from it as
        // from the whole stream up to there, and a relay fed the stream in
        // pieces finds the same as one that sees the prefix at once.
        let stream = TOOL_STREAM.as_bytes();
        let all = events_of(stream);
        let before_done = stream.len() - "data: [DONE]\n\n".len();
        let mut fed = RelayPoint::default();
        for cut in 0..=stream.len() {
            let n = relayable_len(&stream[..cut]);
            assert_eq!(fed.advance(&stream[..cut]), n, "cut at {cut}");
            assert!(n <= cut.min(before_done), "cut at {cut}");
            let prefix = events_of(&stream[..n]);
            assert_eq!(prefix[..], all[..prefix.len()], "cut at {cut}");
            // Nothing past it completes an event yet (but [DONE], and an
            // event whose last CR may be the first half of a CRLF).
            if cut < before_done && !stream[..cut].ends_with(b"\r") {
                let mut splitter = EventSplitter::new();
                splitter.push(&stream[..n]);
                assert!(splitter.push(&stream[n..cut]).is_empty(), "cut at {cut}");
            }
        }
        assert_eq!(relayable_len(stream), before_done);
    }

    #[test]
    fn splitter_follows_the_sse_rules() {
        let mut s = EventSplitter::new();
        assert_eq!(
            s.push(b": comment\n\ndata: a\ndata:b\ndata:  c\n"),
            Vec::<String>::new()
        );
        assert_eq!(
            s.push(b"\nevent: ping\nid: 7\nretry: 10\n\n"),
            vec!["a\nb\n c".to_string()]
        );
        assert_eq!(s.push(b"data\n\ndata: tail"), vec![String::new()]);
        assert_eq!(s.finish(), Some("tail".to_string()));
        assert_eq!(EventSplitter::new().finish(), None);
    }
}
