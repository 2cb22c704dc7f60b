//! The answers the mock gives: a chat completion, the same completion as SSE
//! chunks, and the OpenAI error object. A request with function tools gets
//! a call when it asks for one (see [`tool_call`]), as the Anthropic face
//! does, so that tool round trips can be tested on both faces. Pure functions of the request, so
//! idem's in-process provider of kind "mock" can answer exactly like the HTTP
//! mock without a socket.

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde_json::{Map, Value, json};

use super::Garbage;

/// Longest part of the last user message echoed in a generated answer.
pub(crate) const ECHO_CHARS: usize = 200;

/// Upper bound on `n`, so a hostile request cannot make the mock build a
/// gigantic answer.
const MAX_CHOICES: u64 = 128;

/// The chat completion answering `request` as call number `seq`.
///
/// `content` fixes the assistant text; without it the text is
/// `mock answer #<seq> to: <last user message, first 200 chars>`.
/// `n > 1` gives `n` identical choices.
pub fn completion(request: &Value, seq: u64, content: Option<&str>) -> Value {
    let answer = Answer::new(request, seq, content);
    let choices: Vec<Value> = (0..answer.choices)
        .map(|index| {
            json!({
                "index": index,
                "message": answer.message(),
                "logprobs": null,
                "finish_reason": answer.finish_reason(),
            })
        })
        .collect();
    json!({
        "id": answer.id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "system_fingerprint": "fp_mock",
        "choices": choices,
        "usage": answer.usage(),
    })
}

/// The same answer as [`completion`], as the JSON payloads of the SSE `data:`
/// events (without the `data: ` prefix and without the final `[DONE]`).
///
/// Per choice: a chunk with the role and empty content, the content split
/// after each space (the deltas concatenate to the content exactly), and a
/// chunk with an empty delta and `finish_reason: "stop"`. When the request
/// sets `stream_options.include_usage`, a last chunk with `choices: []` carries
/// the usage and the other chunks carry `usage: null`, as OpenAI does.
pub fn completion_chunks(request: &Value, seq: u64, content: Option<&str>) -> Vec<String> {
    let answer = Answer::new(request, seq, content);
    let include_usage = request
        .pointer("/stream_options/include_usage")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let chunk = |choices: Value, usage: Option<Value>| -> String {
        let mut chunk = json!({
            "id": answer.id,
            "object": "chat.completion.chunk",
            "created": answer.created,
            "model": answer.model,
            "system_fingerprint": "fp_mock",
            "choices": choices,
        });
        if include_usage {
            chunk["usage"] = usage.unwrap_or(Value::Null);
        }
        chunk.to_string()
    };
    let delta = |index: u64, delta: Value, finish: Option<&str>| -> Value {
        json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": finish}])
    };

    let pieces: Vec<&str> = answer.content.split_inclusive(' ').collect();
    let mut chunks = Vec::with_capacity((pieces.len() + 2) * answer.choices as usize + 1);
    let forced = answer.tool.as_ref().is_some_and(|t| t.forced);
    for index in 0..answer.choices {
        let first = if forced {
            json!({"role": "assistant", "content": null})
        } else {
            json!({"role": "assistant", "content": ""})
        };
        chunks.push(chunk(delta(index, first, None), None));
        if !forced {
            for piece in &pieces {
                chunks.push(chunk(delta(index, json!({"content": piece}), None), None));
            }
        }
        if let Some(call) = &answer.tool {
            // The call's head, then its arguments in pieces, as OpenAI
            // streams them.
            let head = json!({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": ""}}]});
            chunks.push(chunk(delta(index, head, None), None));
            for piece in super::anthropic::json_pieces(&call.arguments) {
                let more = json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]});
                chunks.push(chunk(delta(index, more, None), None));
            }
        }
        chunks.push(chunk(
            delta(index, json!({}), Some(answer.finish_reason())),
            None,
        ));
    }
    if include_usage {
        chunks.push(chunk(json!([]), Some(answer.usage())));
    }
    chunks
}

/// Bytes of one word of padding (a space, then `x`s): streamed, each is a
/// content chunk of its own.
const PAD_WORD_BYTES: usize = 1024;

/// The content text (from `content`, or the generated one) grown with
/// padding until `size_of` it is at least `pad` bytes (see [`grown`]).
fn padded_text(
    request: &Value,
    seq: u64,
    content: Option<&str>,
    pad: u64,
    size_of: impl Fn(&str) -> usize,
) -> String {
    let answer = Answer::new(request, seq, content);
    grown(answer.content, answer.choices as usize, pad, size_of)
}

/// `text` grown with padding until `size_of` it is at least `pad` bytes;
/// the body holds it `copies` times (once per choice). Whole words first,
/// never more than half the missing bytes' worth (a streamed word also
/// costs its chunk's frame), then single characters for the rest; only
/// the usage's digits can make the result a few bytes longer than asked.
pub(crate) fn grown(
    mut text: String,
    copies: usize,
    pad: u64,
    size_of: impl Fn(&str) -> usize,
) -> String {
    let target = usize::try_from(pad).unwrap_or(usize::MAX);
    let choices = copies.max(1);
    let word: String = std::iter::once(' ')
        .chain(std::iter::repeat_n('x', PAD_WORD_BYTES - 1))
        .collect();
    loop {
        let size = size_of(&text);
        if size >= target {
            return text;
        }
        let missing = (target - size).div_ceil(choices);
        let words = missing / (2 * PAD_WORD_BYTES);
        if words > 0 {
            text.reserve(words * PAD_WORD_BYTES);
            for _ in 0..words {
                text.push_str(&word);
            }
        } else {
            text.extend(std::iter::repeat_n('x', missing));
        }
    }
}

/// The body of a plain answer: [`completion`], its content padded so the
/// body is at least `pad` bytes when `pad` is set.
pub(crate) fn plain_body(
    request: &Value,
    seq: u64,
    content: Option<&str>,
    pad: Option<u64>,
) -> String {
    let Some(pad) = pad else {
        return completion(request, seq, content).to_string();
    };
    let size = |text: &str| completion(request, seq, Some(text)).to_string().len();
    let text = padded_text(request, seq, content, pad, size);
    completion(request, seq, Some(&text)).to_string()
}

/// The SSE frames of a streamed answer, `data: [DONE]` last, its content
/// padded so the whole stream is at least `pad` bytes when `pad` is set.
pub(crate) fn stream_frames(
    request: &Value,
    seq: u64,
    content: Option<&str>,
    pad: Option<u64>,
) -> Vec<Bytes> {
    let frames = |content: Option<&str>| -> Vec<Bytes> {
        completion_chunks(request, seq, content)
            .into_iter()
            .map(|chunk| Bytes::from(format!("data: {chunk}\n\n")))
            .chain(std::iter::once(Bytes::from_static(b"data: [DONE]\n\n")))
            .collect()
    };
    let Some(pad) = pad else {
        return frames(content);
    };
    let size = |text: &str| frames(Some(text)).iter().map(Bytes::len).sum();
    let text = padded_text(request, seq, content, pad, size);
    frames(Some(&text))
}

/// The body of [`html_page`].
pub(crate) const HTML: &str = "<html><head><title>502 Bad Gateway</title></head>\
                    <body><h1>502 Bad Gateway</h1></body></html>";

/// A 200 answer that is not a well-formed answer.
pub(crate) struct Garbled {
    pub(crate) content_type: &'static str,
    pub(crate) frames: Vec<Bytes>,
}

impl Garbled {
    /// True when it goes out as an SSE stream.
    pub(crate) fn is_stream(&self) -> bool {
        self.content_type == "text/event-stream"
    }
}

/// The garbage of `kind` in place of the answer to `request`, in the form
/// it asked for (`stream`), except the stream endings
/// ([`Garbage::StreamWithoutDone`], [`Garbage::FinishedWithoutDone`],
/// [`Garbage::DoneWithoutFinish`]), which always stream.
pub(crate) fn garbage(
    kind: Garbage,
    request: &Value,
    seq: u64,
    content: Option<&str>,
    stream: bool,
) -> Garbled {
    let sse = |frames: Vec<Bytes>| Garbled {
        content_type: "text/event-stream",
        frames,
    };
    let json = garbled_json;
    let frame = |data: &str| Bytes::from(format!("data: {data}\n\n"));
    let chunks = completion_chunks(request, seq, content);
    let first = chunks.first().map(|c| frame(c)).unwrap_or_default();
    let error = server_error();
    match (kind, stream) {
        (Garbage::NotJson, false) => html_page(),
        (Garbage::NotJson, true) => sse(vec![first, frame(HTML), frame("[DONE]")]),
        (Garbage::Truncated, false) => {
            let whole = completion(request, seq, content).to_string();
            json(cut_in_half(&whole).to_owned())
        }
        (Garbage::Truncated, true) => {
            let mut frames = stream_frames(request, seq, content, None);
            // Half the events, then half of the next one: the stream ends
            // inside an event.
            let keep = frames.len() / 2;
            frames.truncate(keep + 1);
            if let Some(last) = frames.last_mut() {
                *last = last.slice(..last.len() / 2);
            }
            sse(frames)
        }
        (Garbage::Empty, false) => json(String::new()),
        (Garbage::Empty, true) => sse(Vec::new()),
        (Garbage::ErrorObject, false) => json(error),
        (Garbage::ErrorObject, true) => sse(vec![first, frame(&error)]),
        (Garbage::StreamError, false) => json(error),
        (Garbage::StreamError, true) => sse(chunks
            .iter()
            .take(2)
            .map(|c| frame(c))
            .chain([frame(&error), frame("[DONE]")])
            .collect()),
        (Garbage::EmptyChoices, false) => {
            let mut answer = completion(request, seq, content);
            answer["choices"] = json!([]);
            json(answer.to_string())
        }
        (Garbage::EmptyChoices, true) => {
            let empty = chunks
                .first()
                .and_then(|c| serde_json::from_str::<Value>(c).ok())
                .map(|mut c| {
                    c["choices"] = json!([]);
                    frame(&c.to_string())
                })
                .unwrap_or_default();
            sse(vec![empty.clone(), empty, frame("[DONE]")])
        }
        (Garbage::StreamWithoutDone, _) => sse(unfinished(&chunks).map(frame).collect()),
        (Garbage::DoneWithoutFinish, _) => sse(unfinished(&chunks)
            .map(frame)
            .chain([frame("[DONE]")])
            .collect()),
        (Garbage::FinishedWithoutDone, _) => sse(chunks.iter().map(|c| frame(c)).collect()),
    }
}

/// The chunks of a stream that carry content and no `finish_reason` (the
/// role and content chunks; not the finish chunk nor the usage chunk).
fn unfinished(chunks: &[String]) -> impl Iterator<Item = &str> {
    chunks.iter().map(String::as_str).filter(|c| {
        serde_json::from_str::<Value>(c).is_ok_and(|c| {
            c["choices"].as_array().is_some_and(|choices| {
                choices.iter().all(|ch| ch["finish_reason"].is_null()) && !choices.is_empty()
            })
        })
    })
}

/// The HTML error page an intermediary sends in place of a JSON answer.
pub(crate) fn html_page() -> Garbled {
    Garbled {
        content_type: "text/html; charset=utf-8",
        frames: vec![Bytes::from_static(HTML.as_bytes())],
    }
}

/// `body`, sent as if it were a JSON answer.
pub(crate) fn garbled_json(body: String) -> Garbled {
    Garbled {
        content_type: "application/json",
        frames: vec![Bytes::from(body)],
    }
}

/// The `{"error": ...}` object OpenAI sends on a server error.
pub(crate) fn server_error() -> String {
    json!({"error": {
        "message": "The server had an error while processing your request.",
        "type": "server_error", "param": null, "code": null,
    }})
    .to_string()
}

/// The first half of `text`, cut on a character boundary.
pub(crate) fn cut_in_half(text: &str) -> &str {
    let mut end = text.len() / 2;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The OpenAI error object for a mock failure with this HTTP status; `param`
/// names the request field at fault, if one is.
pub(crate) fn error_body(status: u16, message: &str, param: Option<&str>) -> Value {
    let (kind, code) = match status {
        400 | 413 | 422 => ("invalid_request_error", Value::Null),
        401 => ("authentication_error", json!("invalid_api_key")),
        403 => ("permission_error", Value::Null),
        404 => ("invalid_request_error", json!("model_not_found")),
        408 | 504 => ("timeout_error", Value::Null),
        429 => ("rate_limit_error", json!("rate_limit_exceeded")),
        _ => ("server_error", Value::Null),
    };
    json!({"error": {"message": message, "type": kind, "code": code, "param": param}})
}

/// What every form of one answer shares.
struct Answer {
    id: String,
    created: u64,
    model: Value,
    content: String,
    choices: u64,
    prompt_tokens: u64,
    /// The tool call the request asks for, if any (see [`tool_call`]).
    tool: Option<ToolCall>,
}

/// A function call in a generated answer.
struct ToolCall {
    id: String,
    name: String,
    /// The arguments, as the JSON text OpenAI sends.
    arguments: String,
    /// Forced by `tool_choice` (the answer has no text then), rather than
    /// chosen by the `call tool` marker (text, then the call).
    forced: bool,
}

/// The function call `request` asks for: `tool_choice` naming a function
/// (that one) or `required` (the first), or, when it is `auto` or absent,
/// a last user message containing `call tool` (the function named by the
/// next word, or the first). The arguments follow [`tool_input`] on the
/// function's `parameters`.
fn tool_call(request: &Value, seq: u64) -> Option<ToolCall> {
    let tools: Vec<&Value> = request
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t.get("function"))
        .filter(|f| f.get("name").is_some_and(Value::is_string))
        .collect();
    let named = |name: &str| {
        tools
            .iter()
            .copied()
            .find(|f| f.get("name").and_then(Value::as_str) == Some(name))
    };
    let choice = request.get("tool_choice");
    let last = echoed(request);
    let (function, forced, given) = match choice {
        Some(Value::String(c)) if c == "none" => return None,
        Some(Value::String(c)) if c == "required" => (*tools.first()?, true, None),
        Some(Value::Object(c)) => (
            named(c.get("function")?.get("name")?.as_str()?)?,
            true,
            None,
        ),
        _ => {
            let marked = marked_tool(&last_user_text(request))?;
            let function = named(&marked.name).or_else(|| tools.first().copied())?;
            (function, false, marked.input.filter(Value::is_object))
        }
    };
    let arguments = given.unwrap_or_else(|| tool_input(function.get("parameters"), &last));
    Some(ToolCall {
        id: format!("call_mock_{seq}"),
        name: function.get("name")?.as_str()?.to_owned(),
        arguments: arguments.to_string(),
        forced,
    })
}

/// What in the last user text makes an `auto` tool choice call a tool.
pub(crate) const TOOL_MARKER: &str = "call tool";

/// A tool call asked for by the marker.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Marked {
    /// The word after the marker (letters, digits, `_`, `-`, `.`; maybe
    /// empty): the tool's name, if the request has a tool of that name.
    pub(crate) name: String,
    /// The JSON value written after the name, if one is: an object is the
    /// call's input, a string a custom tool's input.
    pub(crate) input: Option<Value>,
}

/// The tool call `text` asks for: `call tool` (any case), the tool's name,
/// then maybe its input as JSON (`call tool Read {"file_path": "/x"}`).
pub(crate) fn marked_tool(text: &str) -> Option<Marked> {
    let at = text.to_ascii_lowercase().find(TOOL_MARKER)?;
    let rest = text.get(at + TOOL_MARKER.len()..)?.trim_start();
    let name: String = rest
        .chars()
        .take_while(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.'))
        .collect();
    let after = rest.get(name.len()..).unwrap_or_default().trim_start();
    let input = if after.starts_with(['{', '"']) {
        serde_json::Deserializer::from_str(after)
            .into_iter::<Value>()
            .next()
            .and_then(Result::ok)
    } else {
        None
    };
    let name = name.trim_end_matches('.').to_owned();
    Some(Marked { name, input })
}

impl Answer {
    fn new(request: &Value, seq: u64, content: Option<&str>) -> Answer {
        let messages = request
            .get("messages")
            .and_then(Value::as_array)
            .map(Vec::as_slice)
            .unwrap_or_default();
        let content = match content {
            Some(content) => content.to_owned(),
            None => formatted(
                request.get("response_format"),
                format!("mock answer #{seq} to: {}", echoed(request)),
            ),
        };
        let prompt_chars = messages
            .iter()
            .map(|m| message_text(m).chars().count())
            .sum();
        Answer {
            id: format!("chatcmpl-mock-{seq}"),
            created: now_secs(),
            model: request.get("model").cloned().unwrap_or(json!("mock")),
            content,
            choices: request
                .get("n")
                .and_then(Value::as_u64)
                .unwrap_or(1)
                .clamp(1, MAX_CHOICES),
            prompt_tokens: estimate_tokens(prompt_chars),
            tool: tool_call(request, seq),
        }
    }

    /// The finish reason of each choice.
    fn finish_reason(&self) -> &'static str {
        if self.tool.is_some() {
            "tool_calls"
        } else {
            "stop"
        }
    }

    /// The message of each choice.
    fn message(&self) -> Value {
        match &self.tool {
            None => json!({"role": "assistant", "content": self.content}),
            Some(call) => json!({
                "role": "assistant",
                "content": if call.forced { Value::Null } else { json!(self.content) },
                "tool_calls": [{"id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}],
            }),
        }
    }

    fn usage(&self) -> Value {
        let completion_tokens = estimate_tokens(self.content.chars().count()) * self.choices;
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }
}

/// What a generated answer echoes: the last user message's text, its first
/// 200 characters.
pub(crate) fn echoed(request: &Value) -> String {
    last_user_text(request).chars().take(ECHO_CHARS).collect()
}

/// The last user message's text (whole).
fn last_user_text(request: &Value) -> String {
    request
        .get("messages")
        .and_then(Value::as_array)
        .and_then(|messages| {
            messages
                .iter()
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("user"))
        })
        .map(message_text)
        .unwrap_or_default()
}

/// The text of a message: a string content, or its text parts joined by spaces.
fn message_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A rough token count (about four characters per token), at least 1.
pub(crate) fn estimate_tokens(chars: usize) -> u64 {
    (chars as u64 / 4).max(1)
}

/// The input of a call to a tool whose JSON Schema is `schema`, on both of
/// the mock's faces: each `required` property gets its first `enum` value or
/// its `const`, else by `type` 1 (integer, number), true, `[]`, `{}`, null,
/// or `echo` (string, or no type); a schema without required properties
/// gives `{"q": echo}`.
pub(crate) fn tool_input(schema: Option<&Value>, echo: &str) -> Value {
    let required: Vec<&str> = schema
        .and_then(|s| s.get("required"))
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect();
    if required.is_empty() {
        return json!({"q": echo});
    }
    let properties = schema.and_then(|s| s.get("properties"));
    let input: Map<String, Value> = required
        .into_iter()
        .map(|name| {
            let property = properties.and_then(|p| p.get(name));
            (name.to_owned(), placeholder(property, echo))
        })
        .collect();
    Value::Object(input)
}

fn placeholder(schema: Option<&Value>, echo: &str) -> Value {
    let Some(schema) = schema else {
        return json!(echo);
    };
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|values| values.first())
    {
        return first.clone();
    }
    if let Some(constant) = schema.get("const") {
        return constant.clone();
    }
    let kind = match schema.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        Some(Value::Array(kinds)) => kinds
            .iter()
            .filter_map(Value::as_str)
            .find(|kind| *kind != "null")
            .unwrap_or("null"),
        _ => "string",
    };
    match kind {
        "integer" | "number" => json!(1),
        "boolean" => json!(true),
        "array" => json!([]),
        "object" => json!({}),
        "null" => Value::Null,
        _ => json!(echo),
    }
}

/// How deep [`schema_value`] follows nested objects and `$ref`s.
const MAX_SCHEMA_DEPTH: usize = 16;

/// The generated `text` in the form `response_format` asks: as it is
/// (none, or `text`), `{"answer": text}` (`json_object`), or a JSON object
/// that satisfies `json_schema.schema` (see [`schema_value`]).
pub(crate) fn formatted(format: Option<&Value>, text: String) -> String {
    match format.and_then(|f| f.get("type")).and_then(Value::as_str) {
        Some("json_object") => json!({"answer": text}).to_string(),
        Some("json_schema") => {
            let schema = format
                .and_then(|f| f.pointer("/json_schema/schema"))
                .unwrap_or(&Value::Null);
            let value = schema_value(schema, schema, &text, 0);
            if value.is_object() {
                value.to_string()
            } else {
                json!({"answer": text}).to_string()
            }
        }
        _ => text,
    }
}

/// A value of JSON Schema `schema` (`root` is the whole schema, for
/// `$ref`s to `#/$defs/...` or `#/definitions/...`): its `const` or first
/// `enum` value, the first branch of `anyOf` / `oneOf` / `allOf`, else by
/// `type` `text` (string), 1 (number, integer), true, `[]`, null, or an
/// object holding each `required` property (an object is also what a
/// schema with `properties` and no type gives).
pub(crate) fn schema_value(schema: &Value, root: &Value, text: &str, depth: usize) -> Value {
    if depth > MAX_SCHEMA_DEPTH {
        return Value::Null;
    }
    if let Some(target) = schema.get("$ref").and_then(Value::as_str) {
        let pointer = target.strip_prefix('#').unwrap_or(target);
        return match root.pointer(pointer) {
            Some(schema) => schema_value(schema, root, text, depth + 1),
            None => json!(text),
        };
    }
    if let Some(constant) = schema.get("const") {
        return constant.clone();
    }
    if let Some(first) = schema
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|values| values.first())
    {
        return first.clone();
    }
    for key in ["anyOf", "oneOf", "allOf"] {
        if let Some(first) = schema
            .get(key)
            .and_then(Value::as_array)
            .and_then(|branches| branches.first())
        {
            return schema_value(first, root, text, depth + 1);
        }
    }
    let kind = match schema.get("type") {
        Some(Value::String(kind)) => kind.as_str(),
        Some(Value::Array(kinds)) => kinds
            .iter()
            .filter_map(Value::as_str)
            .find(|kind| *kind != "null")
            .unwrap_or("null"),
        _ if schema.get("properties").is_some() => "object",
        _ => "string",
    };
    match kind {
        "integer" | "number" => json!(1),
        "boolean" => json!(true),
        "array" => json!([]),
        "null" => Value::Null,
        "object" => {
            let properties = schema.get("properties");
            let object: Map<String, Value> = schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(|name| {
                    let property = properties.and_then(|p| p.get(name)).unwrap_or(&Value::Null);
                    (
                        name.to_owned(),
                        schema_value(property, root, text, depth + 1),
                    )
                })
                .collect();
            Value::Object(object)
        }
        _ => json!(text),
    }
}
