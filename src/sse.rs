//! Streaming: a chat completion in its SSE form and in its plain JSON form.
//!
//! A flight has one upstream call but followers that may want either form
//! (SPEC sections 2 and 4): a leader that streamed must still give a
//! non-streaming follower, the result cache and the job store one plain
//! `chat.completion` ([`assemble`]), and a plain answer from the cache or a
//! non-streaming leader must reach a streaming client as a stream it cannot
//! tell from a live one ([`synthesize`]). While a live stream is relayed,
//! [`EventSplitter`] cuts the bytes as they arrive into whole events, so a
//! follower joining late replays complete events, never half a line.

use std::collections::BTreeMap;
use std::ops::Range;

use bytes::Bytes;
use serde_json::{Map, Value, json};

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

/// One server-sent event: its `event:` type, if any, and its data.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Event {
    kind: Option<String>,
    data: String,
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
    /// [`assemble`] still refuses an answer that is really cut short.
    pub fn finish(self) -> Option<String> {
        self.finish_event().map(|e| e.data)
    }

    fn feed(&mut self, bytes: &[u8], events: &mut Vec<Event>) {
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

    fn finish_event(mut self) -> Option<Event> {
        let mut events = Vec::new();
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            self.line_complete(&line, &mut events);
        }
        self.line_complete(&[], &mut events);
        events.pop()
    }
}

/// How much of a live stream a relay may hand on before the stream has
/// ended: whole events, up to and including the last blank line (a line
/// end right after a line end, LF, CRLF or CR alike), and none from the
/// `[DONE]` event on.
///
/// Whole events, so that whatever follows (the next event, or the error
/// event a client gets when the stream breaks off) starts an event of its
/// own, never half a line; no `[DONE]`, so that a client reads the end of
/// the stream only once the whole answer is known to be a completion.
///
/// It reads each byte once however the stream is cut: [`RelayPoint::advance`]
/// takes the whole stream so far and carries on where it stopped.
#[derive(Debug, Default)]
pub struct RelayPoint {
    /// The end of the last blank line: what may be handed on.
    cut: usize,
    /// Where the current line starts.
    line_start: usize,
    /// How far the current line has been searched for its end.
    searched: usize,
    /// A `[DONE]` line was found: nothing more may be handed on.
    done: bool,
}

impl RelayPoint {
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
            if is_done_line(line) {
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

/// True for a `data: [DONE]` line (without its line end).
fn is_done_line(line: &[u8]) -> bool {
    line.strip_prefix(b"data:")
        .is_some_and(|value| value.trim_ascii() == b"[DONE]")
}

/// The byte ranges of the events of `stream`, each with the blank line
/// that ends it (a last event without one runs to the end of the stream).
/// Blank lines between events belong to no range.
fn event_ranges(stream: &[u8]) -> Vec<Range<usize>> {
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
fn event_data(event: &[u8]) -> String {
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

/// Parses an OpenAI chat completion SSE byte stream and assembles the
/// equivalent non-streaming `chat.completion` object.
///
/// The stream is complete but may have been received in arbitrary pieces;
/// it has `data:` lines, optional `event:`/`id:`/comment lines, CRLF or LF,
/// and ends with `data: [DONE]`; one without it, or with a choice that
/// never got a `finish_reason`, is [`SseError::Truncated`]. The result has `id`, `object`, `created`,
/// `model`, `system_fingerprint`, `service_tier` (if the stream has one),
/// `choices` ordered by index, and `usage` (from the chunk that carries it,
/// else null). Each choice has `index`, `finish_reason`, `logprobs` (the
/// `content`/`refusal` arrays concatenated, or null) and a `message` with
/// `role`, `content` (the deltas concatenated; null if there never was any),
/// `tool_calls` merged by their index (first `id`, `type` and
/// `function.name`; `function.arguments` concatenated), and any other delta
/// field (`refusal`, `annotations`, `reasoning_content`...) merged: strings
/// and arrays concatenated, other values replaced by the latest non-null.
pub fn assemble(sse: &[u8]) -> Result<Value, SseError> {
    let mut splitter = EventSplitter::new();
    let mut events = Vec::new();
    splitter.feed(sse, &mut events);
    events.extend(splitter.finish_event());

    let mut assembly = Assembly::default();
    let mut done = false;
    for (n, event) in events.into_iter().enumerate() {
        let data = event.data.trim();
        if data == "[DONE]" {
            done = true;
            break;
        }
        if data.is_empty() {
            continue;
        }
        let value: Value =
            serde_json::from_str(data).map_err(|source| SseError::Json { event: n, source })?;
        let Value::Object(mut chunk) = value else {
            if event.kind.as_deref() == Some("error") {
                return Err(SseError::Upstream(value));
            }
            return Err(SseError::NotAChunk { event: n });
        };
        let error = chunk.remove("error").filter(|e| !e.is_null());
        match error {
            Some(error) => return Err(SseError::Upstream(error)),
            None if event.kind.as_deref() == Some("error") => {
                return Err(SseError::Upstream(Value::Object(chunk)));
            }
            None => assembly.add(chunk),
        }
    }
    assembly.finish(done)
}

#[derive(Default)]
struct Assembly {
    chunks: usize,
    id: Option<Value>,
    created: Option<Value>,
    model: Option<Value>,
    system_fingerprint: Option<Value>,
    service_tier: Option<Value>,
    usage: Option<Value>,
    choices: BTreeMap<u64, ChoiceAssembly>,
}

#[derive(Default)]
struct ChoiceAssembly {
    role: Option<Value>,
    content: Option<String>,
    /// Other delta fields, merged by [`merge`], in first-seen order.
    other: Map<String, Value>,
    tool_calls: BTreeMap<u64, ToolCallAssembly>,
    function_call: Option<FunctionAssembly>,
    logprobs: Option<LogprobsAssembly>,
    finish_reason: Option<Value>,
}

#[derive(Default)]
struct ToolCallAssembly {
    id: Option<Value>,
    kind: Option<Value>,
    function: Option<FunctionAssembly>,
    other: Map<String, Value>,
}

#[derive(Default)]
struct FunctionAssembly {
    name: Option<String>,
    arguments: String,
}

#[derive(Default)]
struct LogprobsAssembly {
    content: Option<Vec<Value>>,
    refusal: Option<Vec<Value>>,
}

/// Takes a field for a slot that keeps the latest non-null value (or null
/// if that is all there ever was).
fn keep(slot: &mut Option<Value>, value: Option<Value>) {
    if let Some(value) = value
        && (slot.is_none() || !value.is_null())
    {
        *slot = Some(value);
    }
}

/// Merges one delta field into what the earlier deltas built: streamed
/// strings and arrays arrive in pieces, anything else whole.
fn merge(map: &mut Map<String, Value>, key: String, value: Value) {
    match (map.get_mut(&key), value) {
        (None, value) => {
            map.insert(key, value);
        }
        (Some(_), Value::Null) => {}
        (Some(Value::String(so_far)), Value::String(piece)) => so_far.push_str(&piece),
        (Some(Value::Array(so_far)), Value::Array(piece)) => so_far.extend(piece),
        (Some(slot), value) => *slot = value,
    }
}

impl FunctionAssembly {
    fn add(&mut self, mut function: Map<String, Value>) {
        // A name is one identifier, sent once; some providers repeat it in
        // every chunk, so it is taken, never concatenated.
        if let Some(Value::String(name)) = function.remove("name")
            && !name.is_empty()
            && self.name.is_none()
        {
            self.name = Some(name);
        }
        if let Some(Value::String(piece)) = function.remove("arguments") {
            self.arguments.push_str(&piece);
        }
    }

    fn finish(self) -> Value {
        json!({"name": self.name.unwrap_or_default(), "arguments": self.arguments})
    }
}

impl Assembly {
    fn add(&mut self, mut chunk: Map<String, Value>) {
        self.chunks += 1;
        keep(&mut self.id, chunk.remove("id"));
        keep(&mut self.created, chunk.remove("created"));
        keep(&mut self.model, chunk.remove("model"));
        keep(
            &mut self.system_fingerprint,
            chunk.remove("system_fingerprint"),
        );
        keep(&mut self.service_tier, chunk.remove("service_tier"));
        keep(&mut self.usage, chunk.remove("usage"));
        let Some(Value::Array(choices)) = chunk.remove("choices") else {
            return;
        };
        for (position, choice) in choices.into_iter().enumerate() {
            let Value::Object(mut choice) = choice else {
                continue;
            };
            let index = choice
                .get("index")
                .and_then(Value::as_u64)
                .unwrap_or(position as u64);
            let acc = self.choices.entry(index).or_default();
            if let Some(Value::Object(delta)) = choice.remove("delta") {
                acc.add_delta(delta);
            }
            if let Some(Value::Object(mut logprobs)) = choice.remove("logprobs") {
                let lp = acc.logprobs.get_or_insert_with(Default::default);
                for (key, slot) in [("content", &mut lp.content), ("refusal", &mut lp.refusal)] {
                    if let Some(Value::Array(items)) = logprobs.remove(key) {
                        slot.get_or_insert_with(Vec::new).extend(items);
                    }
                }
            }
            keep(&mut acc.finish_reason, choice.remove("finish_reason"));
        }
    }

    fn finish(self, done: bool) -> Result<Value, SseError> {
        if self.chunks == 0 {
            return Err(SseError::Empty);
        }
        let all_finished = self
            .choices
            .values()
            .all(|c| c.finish_reason.as_ref().is_some_and(|r| !r.is_null()));
        // Ended as a success: every choice finished *and* `[DONE]` came.
        // Either alone may be a stream that stopped short, and a shared
        // answer must be whole. (A stream of no choice at all assembles into
        // a completion without choices, which its reader refuses as such.)
        if !done || !all_finished {
            return Err(SseError::Truncated);
        }
        let choices: Vec<Value> = self
            .choices
            .into_iter()
            .map(|(index, choice)| choice.finish(index))
            .collect();

        // OpenAI's own key order, so the assembled body looks like theirs.
        let mut out = Map::new();
        out.insert("id".into(), self.id.unwrap_or(Value::Null));
        out.insert("object".into(), json!("chat.completion"));
        out.insert("created".into(), self.created.unwrap_or(Value::Null));
        out.insert("model".into(), self.model.unwrap_or(Value::Null));
        out.insert("choices".into(), Value::Array(choices));
        out.insert("usage".into(), self.usage.unwrap_or(Value::Null));
        if let Some(tier) = self.service_tier {
            out.insert("service_tier".into(), tier);
        }
        out.insert(
            "system_fingerprint".into(),
            self.system_fingerprint.unwrap_or(Value::Null),
        );
        Ok(Value::Object(out))
    }
}

impl ChoiceAssembly {
    fn add_delta(&mut self, delta: Map<String, Value>) {
        for (key, value) in delta {
            match (key.as_str(), value) {
                ("role", role) => keep(&mut self.role, Some(role)),
                ("content", Value::String(piece)) => {
                    self.content
                        .get_or_insert_with(String::new)
                        .push_str(&piece);
                }
                ("content", _) => {}
                ("tool_calls", Value::Array(calls)) => {
                    for (position, call) in calls.into_iter().enumerate() {
                        if let Value::Object(call) = call {
                            let index = call
                                .get("index")
                                .and_then(Value::as_u64)
                                .unwrap_or(position as u64);
                            self.tool_calls.entry(index).or_default().add(call);
                        }
                    }
                }
                ("function_call", Value::Object(function)) => {
                    self.function_call
                        .get_or_insert_with(Default::default)
                        .add(function);
                }
                ("tool_calls" | "function_call", _) => {}
                (_, value) => merge(&mut self.other, key, value),
            }
        }
    }

    fn finish(self, index: u64) -> Value {
        let mut message = Map::new();
        message.insert(
            "role".into(),
            self.role
                .filter(|r| !r.is_null())
                .unwrap_or_else(|| json!("assistant")),
        );
        message.insert(
            "content".into(),
            self.content.map(Value::String).unwrap_or(Value::Null),
        );
        message.extend(self.other);
        if !self.tool_calls.is_empty() {
            let calls = self.tool_calls.into_values().map(ToolCallAssembly::finish);
            message.insert("tool_calls".into(), Value::Array(calls.collect()));
        }
        if let Some(function) = self.function_call {
            message.insert("function_call".into(), function.finish());
        }
        let logprobs = self.logprobs.map_or(
            Value::Null,
            |lp| json!({"content": lp.content, "refusal": lp.refusal}),
        );
        json!({
            "index": index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": self.finish_reason.unwrap_or(Value::Null),
        })
    }
}

impl ToolCallAssembly {
    fn add(&mut self, call: Map<String, Value>) {
        for (key, value) in call {
            match (key.as_str(), value) {
                ("index", _) => {}
                ("id", Value::String(id)) if id.is_empty() => {}
                ("id", id) => keep(&mut self.id, Some(id)),
                ("type", kind) => keep(&mut self.kind, Some(kind)),
                ("function", Value::Object(function)) => {
                    self.function
                        .get_or_insert_with(Default::default)
                        .add(function);
                }
                (_, value) => merge(&mut self.other, key, value),
            }
        }
    }

    fn finish(self) -> Value {
        let mut call = Map::new();
        call.insert("id".into(), self.id.unwrap_or(Value::Null));
        call.insert(
            "type".into(),
            self.kind.unwrap_or_else(|| json!("function")),
        );
        if let Some(function) = self.function {
            call.insert("function".into(), function.finish());
        }
        call.extend(self.other);
        Value::Object(call)
    }
}

/// Largest piece of text (content, refusal, tool arguments) sent in one
/// synthesized chunk. A live stream sends a token or so per chunk; a replay
/// has the whole answer at hand and sends it in a few chunks, still small
/// enough that a client renders it progressively.
const PIECE_BYTES: usize = 256;

/// Renders a plain `chat.completion` as an SSE byte stream a client cannot
/// tell from a real one.
///
/// Per choice: a first chunk with the role (and `content: ""`, or null when
/// the message has no content) plus the message's non-text fields such as
/// `refusal: null` or `annotations`; then text fields such as
/// `reasoning_content` or `refusal`; then the content in one or a few
/// chunks (one chunk per token when `logprobs` has the tokens, each with its
/// logprob entry, as a live stream does); then each tool call (id, type and
/// name, then the arguments in pieces); then a chunk with the
/// `finish_reason`. Then, when `include_usage`, a chunk with `choices: []`
/// and the usage (every other chunk then carries `usage: null`, as OpenAI's
/// do); then `data: [DONE]`. Every event is `data: <json>\n\n`.
/// [`assemble`] turns the result back into the same completion.
pub fn synthesize(completion: &Value, include_usage: bool) -> Bytes {
    let field = |key: &str| completion.get(key).cloned().unwrap_or(Value::Null);
    let mut header = Map::new();
    header.insert("id".into(), field("id"));
    header.insert("object".into(), json!("chat.completion.chunk"));
    header.insert("created".into(), field("created"));
    header.insert("model".into(), field("model"));
    if let Some(tier) = completion.get("service_tier") {
        header.insert("service_tier".into(), tier.clone());
    }
    header.insert("system_fingerprint".into(), field("system_fingerprint"));

    let mut stream = Stream {
        out: Vec::with_capacity(1024),
        // Every chunk starts with the same header; it is serialized once and
        // the chunk's choices are appended after it. The header always has
        // "object", so the text ends in `}` after a value.
        prefix: {
            let mut text = Value::Object(header).to_string();
            text.pop();
            text.push_str(",\"choices\":");
            text
        },
        suffix: if include_usage {
            ",\"usage\":null}"
        } else {
            "}"
        },
    };

    let no_choices = Vec::new();
    let choices = completion
        .get("choices")
        .and_then(Value::as_array)
        .unwrap_or(&no_choices);
    for (position, choice) in choices.iter().enumerate() {
        synthesize_choice(&mut stream, choice, position);
    }
    if include_usage {
        stream.out.extend_from_slice(b"data: ");
        stream.out.extend_from_slice(stream.prefix.as_bytes());
        stream.out.extend_from_slice(b"[],\"usage\":");
        stream
            .out
            .extend_from_slice(field("usage").to_string().as_bytes());
        stream.out.extend_from_slice(b"}\n\n");
    }
    stream.out.extend_from_slice(b"data: [DONE]\n\n");
    Bytes::from(stream.out)
}

struct Stream {
    out: Vec<u8>,
    prefix: String,
    suffix: &'static str,
}

impl Stream {
    /// Writes one chunk event with one choice.
    fn chunk(&mut self, index: &Value, delta: Value, logprobs: Value, finish_reason: Value) {
        let choice = json!([{
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }]);
        self.out.extend_from_slice(b"data: ");
        self.out.extend_from_slice(self.prefix.as_bytes());
        self.out.extend_from_slice(choice.to_string().as_bytes());
        self.out.extend_from_slice(self.suffix.as_bytes());
        self.out.extend_from_slice(b"\n\n");
    }

    fn delta(&mut self, index: &Value, delta: Value) {
        self.chunk(index, delta, Value::Null, Value::Null);
    }
}

/// Message fields with their own chunks; the others ride in the first one.
const STREAMED_FIELDS: &[&str] = &["role", "content", "tool_calls", "function_call"];

fn synthesize_choice(stream: &mut Stream, choice: &Value, position: usize) {
    let index = choice
        .get("index")
        .cloned()
        .unwrap_or_else(|| json!(position));
    let empty = Map::new();
    let message = choice
        .get("message")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let content = message.get("content").and_then(Value::as_str);
    let logprobs = choice.get("logprobs").and_then(Value::as_object);

    // The first chunk. When logprobs were asked for, it says so with empty
    // arrays (or null, as in the completion), so the assembled logprobs have
    // the completion's shape even when there is no token at all.
    let mut first = Map::new();
    first.insert(
        "role".into(),
        message
            .get("role")
            .cloned()
            .unwrap_or_else(|| json!("assistant")),
    );
    first.insert(
        "content".into(),
        if content.is_some() {
            json!("")
        } else {
            Value::Null
        },
    );
    let mut text_fields = Vec::new();
    for (key, value) in message {
        if STREAMED_FIELDS.contains(&key.as_str()) {
            continue;
        }
        match value {
            Value::String(text) => {
                // `null` first, the text in its own chunks, as a live
                // stream sends a refusal.
                first.insert(key.clone(), Value::Null);
                text_fields.push((key, text));
            }
            other => {
                first.insert(key.clone(), other.clone());
            }
        }
    }
    let logprobs_shape = |key: &str| match logprobs.and_then(|lp| lp.get(key)) {
        Some(Value::Array(_)) => json!([]),
        _ => Value::Null,
    };
    let first_logprobs = match logprobs {
        Some(_) => {
            json!({"content": logprobs_shape("content"), "refusal": logprobs_shape("refusal")})
        }
        None => Value::Null,
    };
    stream.chunk(&index, Value::Object(first), first_logprobs, Value::Null);

    let entries = |key: &str| {
        logprobs
            .and_then(|lp| lp.get(key))
            .and_then(Value::as_array)
            .filter(|items| !items.is_empty())
    };
    for (key, text) in text_fields {
        let mut lp = if key == "refusal" {
            entries("refusal")
        } else {
            None
        };
        for piece in pieces(text) {
            let logprobs = lp.take().map_or(
                Value::Null,
                |items| json!({"content": null, "refusal": items}),
            );
            stream.chunk(&index, json!({ key: piece }), logprobs, Value::Null);
        }
        if let Some(items) = lp {
            // The text was empty but had logprobs.
            stream.chunk(
                &index,
                json!({}),
                json!({"content": null, "refusal": items}),
                Value::Null,
            );
        }
    }

    if let Some(text) = content {
        let tokens = entries("content");
        fn token_text(entry: &Value) -> Option<&str> {
            entry.get("token").and_then(Value::as_str)
        }
        match tokens {
            // One chunk per token, each with its own logprob, as OpenAI
            // streams them, when the tokens spell the content.
            Some(items)
                if items.iter().all(|e| token_text(e).is_some())
                    && items.iter().filter_map(token_text).collect::<String>() == text =>
            {
                for entry in items {
                    let token = token_text(entry).unwrap_or_default();
                    stream.chunk(
                        &index,
                        json!({ "content": token }),
                        json!({"content": [entry], "refusal": null}),
                        Value::Null,
                    );
                }
            }
            _ => {
                let mut lp = tokens;
                for piece in pieces(text) {
                    let logprobs = lp.take().map_or(
                        Value::Null,
                        |items| json!({"content": items, "refusal": null}),
                    );
                    stream.chunk(&index, json!({ "content": piece }), logprobs, Value::Null);
                }
                if let Some(items) = lp {
                    stream.chunk(
                        &index,
                        json!({}),
                        json!({"content": items, "refusal": null}),
                        Value::Null,
                    );
                }
            }
        }
    }

    if let Some(Value::Array(calls)) = message.get("tool_calls") {
        for (i, call) in calls.iter().enumerate() {
            let Some(call) = call.as_object() else {
                continue;
            };
            let mut head = Map::new();
            head.insert("index".into(), json!(i));
            let mut arguments = "";
            for (key, value) in call {
                match (key.as_str(), value) {
                    ("index", _) => {}
                    ("function", Value::Object(function)) => {
                        arguments = function
                            .get("arguments")
                            .and_then(Value::as_str)
                            .unwrap_or("");
                        let mut f = function.clone();
                        f.insert("arguments".into(), json!(""));
                        head.insert(key.clone(), Value::Object(f));
                    }
                    _ => {
                        head.insert(key.clone(), value.clone());
                    }
                }
            }
            stream.delta(&index, json!({"tool_calls": [head]}));
            for piece in pieces(arguments) {
                stream.delta(
                    &index,
                    json!({"tool_calls": [{"index": i, "function": {"arguments": piece}}]}),
                );
            }
        }
    }

    if let Some(Value::Object(function)) = message.get("function_call") {
        let name = function.get("name").cloned().unwrap_or_else(|| json!(""));
        stream.delta(
            &index,
            json!({"function_call": {"name": name, "arguments": ""}}),
        );
        let arguments = function
            .get("arguments")
            .and_then(Value::as_str)
            .unwrap_or("");
        for piece in pieces(arguments) {
            stream.delta(&index, json!({"function_call": {"arguments": piece}}));
        }
    }

    let finish_reason = choice.get("finish_reason").cloned().unwrap_or(Value::Null);
    stream.chunk(&index, json!({}), Value::Null, finish_reason);
}

/// Splits text into pieces of at most [`PIECE_BYTES`] (more only for a
/// single character that is longer), on character boundaries.
fn pieces(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut end = rest.len().min(PIECE_BYTES);
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

    /// A tool-calling stream as OpenAI sends it (`stream_options:
    /// {"include_usage": true}`), with the argument fragments split
    /// mid-token, two parallel calls, CRLF line ends on some events, a
    /// keep-alive comment, `event:`/`id:` lines and a final usage chunk.
    const TOOL_STREAM: &str = concat!(
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_Wq1","type":"function","function":{"name":"get_weather","arguments":""}}],"refusal":null},"logprobs":null,"finish_reason":null}],"usage":null}"#,
        "\n\n",
        ": keep-alive\n\n",
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"ci"}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
        "\r\n\r\n",
        "event: message\r\nid: 3\r\n",
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"ty\": \"Paris, "}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
        "\r\n\r\n",
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"Île-de-France\"}"}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_Xy2","type":"function","function":{"name":"get_time","arguments":""}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":"{\"tz\":"}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"function":{"arguments":" \"Europe/Paris\"}"}}]},"logprobs":null,"finish_reason":null}],"usage":null}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"tool_calls"}],"usage":null}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-BQ1xq","object":"chat.completion.chunk","created":1745001234,"model":"gpt-4o-mini-2024-07-18","service_tier":"default","system_fingerprint":"fp_0392822090","choices":[],"usage":{"prompt_tokens":82,"completion_tokens":47,"total_tokens":129,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}}}"#,
        "\n\n",
        "data: [DONE]\n\n",
    );

    /// A plain text answer, without usage, sent as OpenAI does: a role
    /// chunk with `content: ""`, token chunks, then the finish chunk.
    const TEXT_STREAM: &str = concat!(
        r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}]}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{"content":"Your order"},"logprobs":null,"finish_reason":null}]}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{"content":" ships to"},"logprobs":null,"finish_reason":null}]}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{"content":" Zürich 🚚."},"logprobs":null,"finish_reason":null}]}"#,
        "\n\n",
        r#"data: {"id":"chatcmpl-C7a","object":"chat.completion.chunk","created":1745009999,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_a1","choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}"#,
        "\n\n",
        "data: [DONE]\n\n",
    );

    #[test]
    fn assembles_a_tool_call_stream() {
        let assembled = assemble(TOOL_STREAM.as_bytes()).unwrap();
        let expected = json!({
            "id": "chatcmpl-BQ1xq",
            "object": "chat.completion",
            "created": 1745001234,
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": null,
                    "refusal": null,
                    "tool_calls": [
                        {"id": "call_Wq1", "type": "function", "function": {
                            "name": "get_weather",
                            "arguments": "{\"city\": \"Paris, Île-de-France\"}"}},
                        {"id": "call_Xy2", "type": "function", "function": {
                            "name": "get_time",
                            "arguments": "{\"tz\": \"Europe/Paris\"}"}}
                    ]
                },
                "logprobs": null,
                "finish_reason": "tool_calls"
            }],
            "usage": {"prompt_tokens": 82, "completion_tokens": 47, "total_tokens": 129,
                "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                    "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}},
            "service_tier": "default",
            "system_fingerprint": "fp_0392822090"
        });
        assert_eq!(assembled, expected);
        // The arguments are the JSON the model wrote.
        let args = assembled["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(args).unwrap()["city"],
            "Paris, Île-de-France"
        );
    }

    #[test]
    fn assembles_a_text_stream() {
        let assembled = assemble(TEXT_STREAM.as_bytes()).unwrap();
        assert_eq!(
            assembled,
            json!({
                "id": "chatcmpl-C7a",
                "object": "chat.completion",
                "created": 1745009999,
                "model": "gpt-4o-2024-08-06",
                "choices": [{"index": 0, "message": {"role": "assistant",
                    "content": "Your order ships to Zürich 🚚.", "refusal": null},
                    "logprobs": null, "finish_reason": "stop"}],
                "usage": null,
                "system_fingerprint": "fp_a1"
            })
        );
        // No `service_tier` in the stream, none in the answer.
        assert!(assembled.get("service_tier").is_none());
    }

    fn text_completion() -> Value {
        json!({
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1745000000,
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{"index": 0, "message": {"role": "assistant",
                "content": "Your parcel left the depot this morning.",
                "refusal": null, "annotations": []},
                "logprobs": null, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29},
            "service_tier": "default",
            "system_fingerprint": "fp_1"
        })
    }

    fn tool_completion() -> Value {
        json!({
            "id": "chatcmpl-2",
            "object": "chat.completion",
            "created": 1745000001,
            "model": "gpt-4o-mini-2024-07-18",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": null,
                "refusal": null,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "lookup_order",
                        "arguments": format!("{{\"id\": \"{}\"}}", "4".repeat(700))}},
                    {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": ""}}
                ]},
                "logprobs": null, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 30, "total_tokens": 80},
            "system_fingerprint": null
        })
    }

    fn two_choices() -> Value {
        // Long multi-byte content, split into several chunks on character
        // boundaries.
        let long = "Grüße aus Zürich! 🚚 ".repeat(40);
        json!({
            "id": "chatcmpl-3",
            "object": "chat.completion",
            "created": 1745000002,
            "model": "llama-3.1-8b",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": long},
                    "logprobs": null, "finish_reason": "length"},
                {"index": 1, "message": {"role": "assistant", "content": "",
                    "reasoning_content": "Nothing to add."},
                    "logprobs": null, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 400, "total_tokens": 405},
            "system_fingerprint": "fp_3"
        })
    }

    fn logprobs_completion() -> Value {
        let entry = |t: &str, lp: f64| json!({"token": t, "logprob": lp, "bytes": t.as_bytes(), "top_logprobs": []});
        json!({
            "id": "chatcmpl-4",
            "object": "chat.completion",
            "created": 1745000003,
            "model": "gpt-4o-mini",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "Yes, it is.", "refusal": null},
                    "logprobs": {"content": [entry("Yes", -0.01), entry(",", -0.2),
                        entry(" it", -0.3), entry(" is", -0.1), entry(".", -0.0)], "refusal": null},
                    "finish_reason": "stop"},
                {"index": 1, "message": {"role": "assistant", "content": null,
                    "refusal": "I can't help with that."},
                    "logprobs": {"content": null, "refusal": [entry("I", -0.5)]},
                    "finish_reason": "stop"},
                {"index": 2, "message": {"role": "assistant", "content": "no tokens match"},
                    "logprobs": {"content": [entry("x", -1.0)], "refusal": null},
                    "finish_reason": "stop"}
            ],
            "usage": null,
            "system_fingerprint": null
        })
    }

    fn events_of(stream: &[u8]) -> Vec<String> {
        let mut splitter = EventSplitter::new();
        let mut events = splitter.push(stream);
        events.extend(splitter.finish());
        events
    }

    #[test]
    fn synthesize_then_assemble_is_identity() {
        for completion in [
            text_completion(),
            tool_completion(),
            two_choices(),
            logprobs_completion(),
        ] {
            let stream = synthesize(&completion, true);
            assert_eq!(
                assemble(&stream).unwrap(),
                completion,
                "{}",
                String::from_utf8_lossy(&stream)
            );
        }
        // Without usage in the stream, the assembled usage is null.
        let mut no_usage = text_completion();
        no_usage["usage"] = Value::Null;
        assert_eq!(
            assemble(&synthesize(&text_completion(), false)).unwrap(),
            no_usage
        );
        // And a real stream survives the trip the other way.
        for fixture in [TOOL_STREAM, TEXT_STREAM] {
            let once = assemble(fixture.as_bytes()).unwrap();
            let include_usage = !once["usage"].is_null();
            assert_eq!(assemble(&synthesize(&once, include_usage)).unwrap(), once);
        }
    }

    #[test]
    fn synthesized_stream_looks_like_openai() {
        let completion = two_choices();
        let stream = synthesize(&completion, true);
        let text = std::str::from_utf8(&stream).unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"));
        let events = events_of(&stream);
        assert_eq!(text.matches("\n\n").count(), events.len());
        assert!(
            text.split_terminator("\n\n")
                .all(|e| e.starts_with("data: ") && !e.contains('\n'))
        );
        let (done, chunks) = events.split_last().unwrap();
        assert_eq!(done, "[DONE]");
        let chunks: Vec<Value> = chunks
            .iter()
            .map(|c| serde_json::from_str(c).unwrap())
            .collect();
        for chunk in &chunks {
            assert_eq!(chunk["object"], "chat.completion.chunk");
            assert_eq!(chunk["id"], "chatcmpl-3");
            assert_eq!(chunk["model"], "llama-3.1-8b");
            assert!(
                chunk.get("usage").is_some(),
                "include_usage: every chunk has usage"
            );
        }
        // Per choice: the role first, with an empty content.
        let first = &chunks[0]["choices"][0];
        assert_eq!(first["index"], 0);
        assert_eq!(first["delta"], json!({"role": "assistant", "content": ""}));
        // The long content comes in a few chunks, not one per character.
        let content_chunks = chunks
            .iter()
            .filter(|c| {
                c["choices"][0]["index"] == 0
                    && c["choices"][0]["delta"]["content"]
                        .as_str()
                        .is_some_and(|s| !s.is_empty())
            })
            .count();
        assert!(
            (2..=10).contains(&content_chunks),
            "{content_chunks} content chunks"
        );
        // The last chunk before [DONE] carries the usage and no choice.
        let last = chunks.last().unwrap();
        assert_eq!(last["choices"], json!([]));
        assert_eq!(last["usage"], completion["usage"]);
        // Without include_usage there is no usage anywhere.
        let bare = synthesize(&completion, false);
        assert!(!String::from_utf8_lossy(&bare).contains("usage"));
    }

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

    #[test]
    fn error_events_are_upstream_errors() {
        let error = json!({"message": "The server had an error", "type": "server_error", "param": null, "code": null});
        let stream = format!(
            "{}data: {}\n\n",
            &TEXT_STREAM[..TEXT_STREAM.find("\n\n").unwrap() + 2],
            json!({ "error": error })
        );
        match assemble(stream.as_bytes()) {
            Err(SseError::Upstream(e)) => assert_eq!(e, error),
            other => panic!("expected an upstream error, got {other:?}"),
        }
        let typed = "event: error\ndata: {\"message\": \"overloaded\"}\n\n";
        match assemble(typed.as_bytes()) {
            Err(SseError::Upstream(e)) => assert_eq!(e, json!({"message": "overloaded"})),
            other => panic!("expected an upstream error, got {other:?}"),
        }
    }

    #[test]
    fn broken_streams_are_refused() {
        // Cut before the finish chunk and [DONE].
        let cut = &TEXT_STREAM[..TEXT_STREAM.find("Zürich").unwrap()];
        let cut = &cut[..cut.rfind("\n\n").unwrap() + 2];
        assert!(matches!(assemble(cut.as_bytes()), Err(SseError::Truncated)));
        // Every choice finished but no [DONE]: not ended as a success.
        let no_done = TEXT_STREAM.replace("data: [DONE]\n\n", "");
        assert!(matches!(
            assemble(no_done.as_bytes()),
            Err(SseError::Truncated)
        ));
        // [DONE], but a choice never finished.
        let unfinished =
            TEXT_STREAM.replace("\"finish_reason\":\"stop\"", "\"finish_reason\":null");
        assert_ne!(unfinished, TEXT_STREAM);
        assert!(matches!(
            assemble(unfinished.as_bytes()),
            Err(SseError::Truncated)
        ));
        assert!(matches!(
            assemble(b"data: [DONE]\n\n"),
            Err(SseError::Empty)
        ));
        assert!(matches!(assemble(b""), Err(SseError::Empty)));
        assert!(matches!(
            assemble(b"data: {oops\n\n"),
            Err(SseError::Json { event: 0, .. })
        ));
        assert!(matches!(
            assemble(b"data: [1]\n\n"),
            Err(SseError::NotAChunk { event: 0 })
        ));
    }

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
