//! Fingerprints: what counts as "the same task" (docs/design.md, "What counts as the same task").
//!
//! Every chat completion request is reduced to a [`Fingerprint`] right after
//! routing and before the result cache and the flight table, which are both
//! keyed by it: equal fingerprints share one upstream call and one cached
//! answer. The fingerprint is the BLAKE3 hash of one canonical JSON document,
//! `{"request":{..},"route":..,"targets":[..],"tenant":..,"user":..,"v":1}`,
//! where `request` is the body without its noise fields, with message text
//! normalized as the route asks and inline attachments replaced by their hash.
//! The document is streamed straight into the hasher: this runs on every
//! request, so nothing is cloned and no string of the whole body is built.
//!
//! Changing what this module hashes changes which requests are "the same";
//! such a change must bump [`VERSION`] (printed as `v1:` today), so that old
//! cache entries and flights are simply never found again.

use std::borrow::Cow;
use std::fmt;
use std::io::{self, Write};
use std::str::FromStr;

use serde_json::{Map, Number, Value};

use crate::config::{Normalize, ProviderKind, Scope, TargetConfig};
use crate::dialect::{Dialect, Forwarded};

/// Version of the fingerprint rules; part of both the hashed document and the
/// printed form.
pub const VERSION: u32 = 1;

const PREFIX: &str = "v1:";

/// Top-level fields of a chat request that never join the fingerprint (the
/// noise of every dialect: [`Dialect::noise`]). `model` is not noise in
/// itself, it is replaced by the route and its targets, which say what will
/// really answer. Everything not listed here (or in the route's
/// `ignore_fields`) joins: a field idem does not know may change the answer.
pub fn noise_fields() -> &'static [&'static str] {
    Dialect::Chat.noise()
}

/// Fields of a chat request that name the end user. Noise with
/// `scope = "tenant"`; with `scope = "user"` the first one present is the
/// user (see [`fingerprint`]).
pub const USER_FIELDS: &[&str] = &["user", "safety_identifier"];

/// No forwarded header.
pub static NO_HEADERS: Forwarded = Forwarded::none();

/// What a route contributes to the fingerprint besides the request body.
#[derive(Debug, Clone, Copy)]
pub struct Rules<'a> {
    pub tenant: &'a str,
    /// The public model name.
    pub route: &'a str,
    /// Each target's provider, upstream model and optional version join the
    /// hash, in order: the same prompt sent to another model is another task.
    pub targets: &'a [TargetConfig],
    /// Each target's provider kind, in the same order (empty: unknown, as
    /// `idem analyze` reads a log): the same question to an Anthropic target
    /// and to an OpenAI one is two tasks. `openai` is left out of the hash,
    /// so the fingerprints of OpenAI-compatible targets stay what they were
    /// before kinds existed.
    pub kinds: &'a [ProviderKind],
    pub normalize: Normalize,
    pub scope: Scope,
    /// Top-level request fields the route declares as noise.
    pub ignore_fields: &'a [String],
    /// The hash of the route's contract, if it has one: answers checked
    /// against another contract are another task.
    pub contract: Option<&'a str>,
    /// The request's dialect: the same question asked in another API's
    /// words wants another answer shape, so it is another task
    /// (docs/design.md, "What counts as the same task"). Chat completions
    /// adds nothing, so their fingerprints are what they were before
    /// dialects joined.
    pub dialect: Dialect,
    /// The client's headers that change the answer (`anthropic-beta`, ...).
    pub headers: &'a Forwarded,
}

/// The hasher of the in-memory tables keyed by fingerprint (the result
/// and negative caches, the flight table). A fingerprint is already a
/// uniform hash, so the table's own hash need not be a slow one (SipHash,
/// the standard library's default, was 4-5 % of a unique prompt's CPU:
/// docs/benchmarks.md); it is still keyed, with seeds drawn from the
/// operating system's randomness, so that a client cannot grind prompts
/// whose fingerprints pile into one bucket of a table.
#[derive(Clone, Debug)]
pub struct TableHasher(foldhash::fast::SeedableRandomState);

impl Default for TableHasher {
    fn default() -> Self {
        static SHARED: std::sync::OnceLock<foldhash::SharedSeed> = std::sync::OnceLock::new();
        let shared = SHARED.get_or_init(|| foldhash::SharedSeed::from_u64(rand::random()));
        TableHasher(foldhash::fast::SeedableRandomState::with_seed(
            rand::random(),
            shared,
        ))
    }
}

impl std::hash::BuildHasher for TableHasher {
    type Hasher = foldhash::fast::FoldHasher<'static>;

    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }
}

/// The identity of a task: a BLAKE3 hash, printed `v1:<64 hex digits>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Rebuilds a fingerprint from its raw bytes (e.g. read from a store).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The 64 lower-case hex digits, without the version prefix.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PREFIX)?;
        f.write_str(&blake3::Hash::from_bytes(self.0).to_hex())
    }
}

/// A string that is not a `v1:<64 hex>` fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseFingerprintError {
    #[error("fingerprint must start with \"{PREFIX}\"")]
    Version,
    #[error("fingerprint must have 64 hex digits after \"{PREFIX}\"")]
    Hex,
}

impl FromStr for Fingerprint {
    type Err = ParseFingerprintError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let digits = s
            .strip_prefix(PREFIX)
            .ok_or(ParseFingerprintError::Version)?;
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(digits, &mut bytes).map_err(|_| ParseFingerprintError::Hex)?;
        Ok(Self(bytes))
    }
}

/// Computes the fingerprint of a chat completion request.
///
/// `body` is the parsed request object; `user_header` the `Idem-User` header
/// if any. With `scope = "user"` the end user is the body's `user`, else its
/// `safety_identifier`, else the header; the field that supplied it moves
/// from the request into the document's `user` slot, so the same person sent
/// as a body field or as the header is the same task. With `scope = "tenant"`
/// both fields and the header are ignored.
pub fn fingerprint(
    body: &Map<String, Value>,
    user_header: Option<&str>,
    rules: &Rules,
) -> Fingerprint {
    let mut hasher = blake3::Hasher::new();
    let written = write_document(&mut hasher, body, user_header, rules);
    // `blake3::Hasher` implements `io::Write` without ever failing; the
    // `Result` only exists because the writer is generic.
    debug_assert!(written.is_ok(), "hashing cannot fail: {written:?}");
    Fingerprint(*hasher.finalize().as_bytes())
}

/// Writes the canonical JSON of a value: object keys sorted by their UTF-8
/// bytes, no whitespace, one escaping rule for strings and one spelling per
/// number (see [`write_number`]). Used for fingerprints, the jobs payload
/// hash and `idem analyze`.
pub fn write_canonical(value: &Value, out: &mut impl Write) -> io::Result<()> {
    match value {
        Value::Null => out.write_all(b"null"),
        Value::Bool(true) => out.write_all(b"true"),
        Value::Bool(false) => out.write_all(b"false"),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_str(s, out),
        Value::Array(items) => {
            out.write_all(b"[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_canonical(item, out)?;
            }
            out.write_all(b"]")
        }
        Value::Object(map) => {
            write_object(out, map, |_| false, |out, _, v| write_canonical(v, out))
        }
    }
}

/// Normalizes message text for a route (docs/design.md, "What counts as the same task").
///
/// `None` returns the text unchanged. `Whitespace` trims and collapses every
/// run of whitespace (newlines included) to one space, except inside fenced
/// code blocks (from a line starting with ```` ``` ```` to the next such line,
/// or to the end of the text), whose lines are kept verbatim; the blocks are
/// joined with `\n`, so only line endings change inside a fence (carriage
/// returns at the end of a line count as its line ending, which keeps the
/// normal form normal: normalizing twice changes nothing). `Casefold`
/// also lower-cases (Unicode) the text outside fences. Text that is already
/// normal is borrowed, not copied.
pub fn normalize_text(text: &str, mode: Normalize) -> Cow<'_, str> {
    let fold = match mode {
        Normalize::None => return Cow::Borrowed(text),
        Normalize::Whitespace => false,
        Normalize::Casefold => true,
    };
    if is_normal(text, fold) {
        return Cow::Borrowed(text);
    }

    let mut out = String::with_capacity(text.len());
    let mut prose = String::new();
    let mut in_fence = false;
    for line in text.lines() {
        // `lines` strips one "\r" before a "\n"; strip them all, or
        // "x\r\r\n" would become "x\r\n", then "x\n" (found by fuzzing).
        let line = line.trim_end_matches('\r');
        let is_fence = line.trim_start().starts_with("```");
        if in_fence {
            out.push('\n');
            out.push_str(line);
            in_fence = !is_fence;
        } else if is_fence {
            flush_prose(&mut out, &mut prose, fold);
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(line);
            in_fence = true;
        } else {
            for word in line.split_whitespace() {
                if !prose.is_empty() {
                    prose.push(' ');
                }
                prose.push_str(word);
            }
        }
    }
    if in_fence {
        // Blank lines that end an unclosed fence are the message's trailing
        // whitespace, which is trimmed like any other.
        let kept = out.trim_end_matches('\n').len();
        out.truncate(kept);
    }
    flush_prose(&mut out, &mut prose, fold);
    Cow::Owned(out)
}

/// Appends a finished run of text outside fences as its own block.
fn flush_prose(out: &mut String, prose: &mut String, fold: bool) {
    if prose.is_empty() {
        return;
    }
    if !out.is_empty() {
        out.push('\n');
    }
    if fold {
        // `str::to_lowercase` rather than per-char: it knows the Greek final
        // sigma.
        out.push_str(&prose.to_lowercase());
    } else {
        out.push_str(prose);
    }
    prose.clear();
}

/// The fast path of [`normalize_text`]: most prompts are already single-spaced,
/// trimmed and fence-free, and need no copy.
fn is_normal(text: &str, fold: bool) -> bool {
    if text.contains("```") {
        return false;
    }
    let mut after_space = true;
    for c in text.chars() {
        if c.is_whitespace() {
            if c != ' ' || after_space {
                return false;
            }
            after_space = true;
        } else {
            if fold {
                let mut lower = c.to_lowercase();
                if lower.next() != Some(c) || lower.next().is_some() {
                    return false;
                }
            }
            after_space = false;
        }
    }
    // A trailing space fails; the empty text is normal.
    !after_space || text.is_empty()
}

/// Where the end user of a `scope = "user"` request came from.
enum User<'a> {
    None,
    Field(&'static str, &'a Value),
    Header(&'a str),
}

fn write_document<W: Write>(
    out: &mut W,
    body: &Map<String, Value>,
    user_header: Option<&str>,
    rules: &Rules,
) -> io::Result<()> {
    let user_fields = rules.dialect.user_fields();
    let user = match rules.scope {
        Scope::Tenant => User::None,
        Scope::User => user_fields
            .iter()
            .find_map(|&name| body.get(name).map(|v| User::Field(name, v)))
            .or_else(|| user_header.map(User::Header))
            .unwrap_or(User::None),
    };
    let noise = rules.dialect.noise();
    let skip = |key: &str| {
        noise.contains(&key)
            || rules.ignore_fields.iter().any(|f| f == key)
            || match (&rules.scope, &user) {
                (Scope::Tenant, _) => user_fields.contains(&key),
                (Scope::User, User::Field(promoted, _)) => key == *promoted,
                (Scope::User, _) => false,
            }
    };
    let texts = rules.dialect.text_fields();

    // The document's own keys are written in sorted order, so the whole
    // document is canonical JSON: every field is delimited and named, which
    // keeps tenant "a" + route "bc" apart from tenant "ab" + route "c".
    out.write_all(b"{")?;
    if let Some(contract) = rules.contract {
        out.write_all(b"\"contract\":")?;
        write_str(contract, out)?;
        out.write_all(b",")?;
    }
    if rules.dialect != Dialect::Chat {
        out.write_all(b"\"face\":")?;
        write_str(rules.dialect.as_str(), out)?;
        out.write_all(b",")?;
    }
    if !rules.headers.is_empty() {
        out.write_all(b"\"headers\":")?;
        write_canonical(&Value::Object(rules.headers.to_json()), out)?;
        out.write_all(b",")?;
    }
    out.write_all(b"\"request\":")?;
    write_object(out, body, skip, |out, key, value| {
        if !texts.contains(&key) {
            return write_canonical(value, out);
        }
        match value {
            // `system`, `instructions`, a Responses `input` given as text.
            Value::String(text) => write_str(&normalize_text(text, rules.normalize), out),
            // `system` as blocks.
            Value::Array(parts) if key == "system" => write_parts(out, parts, rules.normalize),
            // `messages`, a Responses `input` as items.
            _ => write_messages(out, value, rules.normalize),
        }
    })?;
    out.write_all(b",\"route\":")?;
    write_str(rules.route, out)?;
    out.write_all(b",\"targets\":[")?;
    for (i, target) in rules.targets.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        out.write_all(b"{")?;
        if let Some(kind) = rules.kinds.get(i).filter(|k| **k != ProviderKind::Openai) {
            out.write_all(b"\"kind\":")?;
            write_str(kind.as_str(), out)?;
            out.write_all(b",")?;
        }
        out.write_all(b"\"model\":")?;
        write_str(&target.model, out)?;
        out.write_all(b",\"provider\":")?;
        write_str(&target.provider, out)?;
        out.write_all(b",\"version\":")?;
        match &target.version {
            Some(version) => write_str(version, out)?,
            None => out.write_all(b"null")?,
        }
        out.write_all(b"}")?;
    }
    out.write_all(b"],\"tenant\":")?;
    write_str(rules.tenant, out)?;
    out.write_all(b",\"user\":")?;
    match user {
        User::None => out.write_all(b"null")?,
        User::Field(_, value) => write_canonical(value, out)?,
        User::Header(name) => write_str(name, out)?,
    }
    write!(out, ",\"v\":{VERSION}}}")
}

/// `messages` is canonical JSON too, except for message text (normalized) and
/// inline attachments (hashed). Anything that is not shaped like a message is
/// written as it is: validation is not this module's job, and an odd shape
/// still deserves a stable fingerprint.
fn write_messages<W: Write>(out: &mut W, messages: &Value, mode: Normalize) -> io::Result<()> {
    let Value::Array(messages) = messages else {
        return write_canonical(messages, out);
    };
    out.write_all(b"[")?;
    for (i, message) in messages.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        let Value::Object(message) = message else {
            write_canonical(message, out)?;
            continue;
        };
        // A tool's answer is data (usually JSON), not prose: normalizing it
        // could merge two different results.
        let mode = match message.get("role").and_then(Value::as_str) {
            Some("tool" | "function") => Normalize::None,
            _ => mode,
        };
        write_object(
            out,
            message,
            |_| false,
            |out, key, value| match (key, value) {
                ("content", Value::String(text)) => write_str(&normalize_text(text, mode), out),
                ("content", Value::Array(parts)) => write_parts(out, parts, mode),
                _ => write_canonical(value, out),
            },
        )?;
    }
    out.write_all(b"]")
}

fn write_parts<W: Write>(out: &mut W, parts: &[Value], mode: Normalize) -> io::Result<()> {
    out.write_all(b"[")?;
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.write_all(b",")?;
        }
        let Value::Object(part) = part else {
            write_canonical(part, out)?;
            continue;
        };
        let is_text = matches!(
            part.get("type").and_then(Value::as_str),
            Some("text" | "input_text" | "output_text")
        );
        write_object(
            out,
            part,
            |_| false,
            |out, key, value| match (key, value) {
                ("text", Value::String(text)) if is_text => {
                    write_str(&normalize_text(text, mode), out)
                }
                ("image_url", Value::String(url)) => write_image_url(out, url),
                // A Responses file part's inline data.
                ("file_data", Value::String(data)) => write_inline(out, "", data),
                // An Anthropic image or document given inline.
                ("source", Value::Object(source)) => write_object(
                    out,
                    source,
                    |_| false,
                    |out, key, value| match (key, value) {
                        ("data", Value::String(data)) => write_inline(out, "", data),
                        _ => write_canonical(value, out),
                    },
                ),
                ("image_url", Value::Object(image)) => write_object(
                    out,
                    image,
                    |_| false,
                    |out, key, value| match (key, value) {
                        ("url", Value::String(url)) => write_image_url(out, url),
                        _ => write_canonical(value, out),
                    },
                ),
                ("input_audio", Value::Object(audio)) => write_object(
                    out,
                    audio,
                    |_| false,
                    |out, key, value| match (key, value) {
                        ("data", Value::String(data)) => write_inline(out, "", data),
                        _ => write_canonical(value, out),
                    },
                ),
                ("file", Value::Object(file)) => write_object(
                    out,
                    file,
                    |_| false,
                    |out, key, value| match (key, value) {
                        ("file_data", Value::String(data)) => write_inline(out, "", data),
                        _ => write_canonical(value, out),
                    },
                ),
                _ => write_canonical(value, out),
            },
        )?;
    }
    out.write_all(b"]")
}

/// A `data:` URL joins as the hash of the whole URL (media type included),
/// any other URL as itself. The hashed form keeps the `data:` prefix, and any
/// string starting with `data:` is hashed, so no URL can spell a hash.
fn write_image_url<W: Write>(out: &mut W, url: &str) -> io::Result<()> {
    if url.starts_with("data:") {
        write_inline(out, "data:", url)
    } else {
        write_str(url, out)
    }
}

/// Writes inline data as the string `<prefix>blake3:<hex>`: a megabyte image
/// costs one hash pass instead of being escaped into the document, and data
/// that differs by one byte still differs.
fn write_inline<W: Write>(out: &mut W, prefix: &str, data: &str) -> io::Result<()> {
    let hash = blake3::hash(data.as_bytes());
    out.write_all(b"\"")?;
    out.write_all(prefix.as_bytes())?;
    out.write_all(b"blake3:")?;
    out.write_all(hash.to_hex().as_bytes())?;
    out.write_all(b"\"")
}

/// Writes an object with its keys sorted by UTF-8 bytes, skipping `skip`ped
/// keys, each value written by `value`.
fn write_object<W: Write>(
    out: &mut W,
    map: &Map<String, Value>,
    skip: impl Fn(&str) -> bool,
    mut value: impl FnMut(&mut W, &str, &Value) -> io::Result<()>,
) -> io::Result<()> {
    let mut entry = |out: &mut W, first: &mut bool, key: &str, v: &Value| {
        if skip(key) {
            return Ok(());
        }
        if !*first {
            out.write_all(b",")?;
        }
        *first = false;
        write_str(key, out)?;
        out.write_all(b":")?;
        value(out, key, v)
    };
    out.write_all(b"{")?;
    let mut first = true;
    // Clients usually send keys in one fixed order, often already sorted;
    // sorting only when needed spares an allocation on most objects.
    if map.keys().is_sorted() {
        for (key, v) in map {
            entry(out, &mut first, key, v)?;
        }
    } else {
        let mut entries: Vec<(&String, &Value)> = map.iter().collect();
        // `str`'s order is the order of its UTF-8 bytes.
        entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (key, v) in entries {
            entry(out, &mut first, key, v)?;
        }
    }
    out.write_all(b"}")
}

/// The one spelling of a number: integers (from u64 or i64, or integral f64
/// within the u64/i64 range, `-0.0` included) as plain decimal integers;
/// other f64 as the shortest decimal that round-trips, without exponent
/// for 1e-7 <= |x| < 1e21 and in `<digits>e<exp>` form outside that range.
/// So `1`, `1.0`, `1e0` and `10e-1` all spell `1`, and `-0` spells `0`.
fn write_number(n: &Number, out: &mut impl Write) -> io::Result<()> {
    if let Some(u) = n.as_u64() {
        return write!(out, "{u}");
    }
    if let Some(i) = n.as_i64() {
        return write!(out, "{i}");
    }
    let Some(x) = n.as_f64() else {
        // Without serde_json's `arbitrary_precision` every number is one of
        // the three; keep the original spelling rather than fail.
        return write!(out, "{n}");
    };
    // 2^64 and -2^63 are exact in f64; every integral f64 strictly inside
    // these bounds converts to u64/i64 without loss.
    const U64_END: f64 = 18_446_744_073_709_551_616.0;
    const I64_START: f64 = -9_223_372_036_854_775_808.0;
    if x.fract() == 0.0 {
        if (0.0..U64_END).contains(&x) {
            return write!(out, "{}", x as u64);
        }
        if (I64_START..0.0).contains(&x) {
            return write!(out, "{}", x as i64);
        }
    }
    let magnitude = x.abs();
    if (1e-7..1e21).contains(&magnitude) {
        // `Display` for f64 is the shortest round-trip form, never with an
        // exponent.
        write!(out, "{x}")
    } else {
        write!(out, "{x:e}")
    }
}

/// Writes a JSON string: `"` and `\` escaped with a backslash, control
/// characters as `\b \f \n \r \t` or `\u00XX`, everything else (including
/// non-ASCII) as raw UTF-8.
fn write_str(s: &str, out: &mut impl Write) -> io::Result<()> {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.write_all(b"\"")?;
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => &[
                b'\\',
                b'u',
                b'0',
                b'0',
                HEX[(b >> 4) as usize],
                HEX[(b & 0xf) as usize],
            ],
            _ => continue,
        };
        out.write_all(&bytes[start..i])?;
        out.write_all(escape)?;
        start = i + 1;
    }
    out.write_all(&bytes[start..])?;
    out.write_all(b"\"")
}

#[cfg(test)]
// `allow`, not `expect`: it must stay quiet once a `clippy.toml` sets
// `allow-unwrap-in-tests`.
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn table_hashers_are_keyed_each_with_its_own_seed() {
        use std::hash::BuildHasher;
        let fp = Fingerprint([7; 32]);
        let (a, b) = (TableHasher::default(), TableHasher::default());
        // The same hasher gives the same hash (a table can find its keys)...
        assert_eq!(a.hash_one(fp), a.hash_one(fp));
        // ...and another one another hash: the seeds are random, not fixed
        // (equal by chance once in 2^64).
        assert_ne!(a.hash_one(fp), b.hash_one(fp));
    }

    fn targets() -> Vec<TargetConfig> {
        vec![TargetConfig {
            provider: "primary".into(),
            model: "gpt-4o-mini".into(),
            version: None,
            context_window: None,
            price: None,
        }]
    }

    fn rules<'a>(targets: &'a [TargetConfig], ignore: &'a [String]) -> Rules<'a> {
        Rules {
            tenant: "acme",
            route: "support-bot",
            targets,
            kinds: &[],
            normalize: Normalize::None,
            scope: Scope::Tenant,
            ignore_fields: ignore,
            contract: None,
            dialect: Dialect::Chat,
            headers: &NO_HEADERS,
        }
    }

    fn obj(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            other => panic!("not an object: {other}"),
        }
    }

    fn fp(body: Value) -> Fingerprint {
        let t = targets();
        fingerprint(&obj(body), None, &rules(&t, &[]))
    }

    fn canonical(v: &Value) -> String {
        let mut out = Vec::new();
        write_canonical(v, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    fn chat(content: &str) -> Value {
        json!({"model": "support-bot", "messages": [{"role": "user", "content": content}]})
    }

    #[test]
    fn display_and_parse_round_trip() {
        let f = fp(chat("hi"));
        let s = f.to_string();
        assert!(s.starts_with("v1:"));
        assert_eq!(s.len(), 3 + 64);
        assert_eq!(&s[3..], f.to_hex());
        assert_eq!(s.parse::<Fingerprint>(), Ok(f));
        assert_eq!(Fingerprint::from_bytes(*f.as_bytes()), f);
        assert_eq!(
            f.to_hex().parse::<Fingerprint>(),
            Err(ParseFingerprintError::Version)
        );
        assert_eq!(
            "v1:abc".parse::<Fingerprint>(),
            Err(ParseFingerprintError::Hex)
        );
    }

    #[test]
    fn temperature_changes_the_task() {
        let mut a = chat("hi");
        let mut b = chat("hi");
        a["temperature"] = json!(0);
        b["temperature"] = json!(0.8);
        assert_ne!(fp(a.clone()), fp(b));
        let mut c = chat("hi");
        c["temperature"] = json!(0.0);
        assert_eq!(fp(a), fp(c));
    }

    #[test]
    fn the_route_contract_changes_the_task() {
        let t = targets();
        let body = obj(json!({"model": "x", "messages": [{"role": "user", "content": "hi"}]}));
        let mut r = rules(&t, &[]);
        let none = fingerprint(&body, None, &r);
        r.contract = Some("c1:aaaa");
        let a = fingerprint(&body, None, &r);
        r.contract = Some("c1:bbbb");
        let b = fingerprint(&body, None, &r);
        assert_ne!(none, a);
        assert_ne!(a, b);
    }

    #[test]
    fn the_dialect_and_the_answer_headers_change_the_task_and_chat_has_none() {
        let t = targets();
        let body = obj(json!({"model": "x", "messages": [{"role": "user", "content": "hi"}]}));
        let mut r = rules(&t, &[]);
        let chat = fingerprint(&body, None, &r);
        // Chat completions add nothing: fingerprints from before dialects
        // hold.
        let doc = String::from_utf8(canonical_doc(&body, &r)).unwrap();
        assert!(doc.starts_with("{\"request\":"), "{doc}");
        r.dialect = Dialect::Messages;
        let a = fingerprint(&body, None, &r);
        r.dialect = Dialect::Responses;
        let b = fingerprint(&body, None, &r);
        r.dialect = Dialect::CountTokens;
        let c = fingerprint(&body, None, &r);
        assert_ne!(chat, a);
        assert_ne!(a, b);
        assert_ne!(b, c);
        // `anthropic-beta` changes what Anthropic answers.
        r.dialect = Dialect::Messages;
        let beta = Forwarded::read(Dialect::Messages, |n| match n {
            "anthropic-beta" => vec!["context-management-2025-06-27"],
            _ => vec![],
        });
        r.headers = &beta;
        assert_ne!(a, fingerprint(&body, None, &r));
    }

    /// A Messages request and a Responses request normalize their text as
    /// the route says (their system prompt and instructions too), hash
    /// their inline data, and count every other field.
    #[test]
    fn each_dialects_text_normalizes_and_the_rest_counts() {
        let t = targets();
        let mut r = Rules {
            normalize: Normalize::Casefold,
            dialect: Dialect::Messages,
            ..rules(&t, &[])
        };
        let message = |text: &str, extra: Value| {
            let mut m = json!({"model": "x", "max_tokens": 9, "system": [{"type": "text", "text": text}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": text},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"}}]}]});
            m.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            obj(m)
        };
        let a = fingerprint(&message("Hello", json!({})), None, &r);
        assert_eq!(a, fingerprint(&message("hello", json!({})), None, &r));
        assert_ne!(
            a,
            fingerprint(&message("hello", json!({"top_k": 5})), None, &r)
        );
        assert_ne!(
            a,
            fingerprint(
                &message("hello", json!({"thinking": {"type": "adaptive"}})),
                None,
                &r
            )
        );
        // The user's `metadata` is noise on a tenant-scoped route.
        assert_eq!(
            a,
            fingerprint(
                &message(
                    "hello",
                    json!({"metadata": {"user_id": "u1"}, "stream": true})
                ),
                None,
                &r
            )
        );
        // Inline image data joins by its hash.
        let doc = String::from_utf8(canonical_doc(&message("hi", json!({})), &r)).unwrap();
        assert!(doc.contains("blake3:"), "{doc}");
        assert!(!doc.contains("QUJD"), "{doc}");
        r.dialect = Dialect::Responses;
        let response = |text: &str| {
            obj(json!({"model": "x", "instructions": text, "input": [
                {"role": "user", "content": [{"type": "input_text", "text": text}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{\"A\": 1}"}],
                "prompt_cache_key": "k"}))
        };
        assert_eq!(
            fingerprint(&response("Hello"), None, &r),
            fingerprint(&response("hello"), None, &r)
        );
        let plain = obj(json!({"model": "x", "input": "Hello"}));
        let folded = obj(json!({"model": "x", "input": "hello"}));
        assert_eq!(
            fingerprint(&plain, None, &r),
            fingerprint(&folded, None, &r)
        );
    }

    /// The document a fingerprint hashes, as bytes.
    fn canonical_doc(body: &Map<String, Value>, rules: &Rules) -> Vec<u8> {
        let mut out = Vec::new();
        write_document(&mut out, body, None, rules).unwrap();
        out
    }

    #[test]
    fn targets_and_versions_change_the_task() {
        let body = obj(chat("hi"));
        let base = targets();
        let mut other_model = targets();
        other_model[0].model = "gpt-4o".into();
        let mut versioned = targets();
        versioned[0].version = Some("2024-07-18".into());
        let mut two = targets();
        two.push(TargetConfig {
            provider: "fallback".into(),
            model: "llama".into(),
            version: None,
            context_window: None,
            price: None,
        });
        let all = [&base, &other_model, &versioned, &two]
            .map(|t| fingerprint(&body, None, &rules(t, &[])));
        for i in 0..all.len() {
            for j in i + 1..all.len() {
                assert_ne!(all[i], all[j], "targets {i} and {j}");
            }
        }
        // A target's provider kind: openai is what a fingerprint without
        // kinds always meant; another kind is another task.
        let openai = Rules {
            kinds: &[ProviderKind::Openai],
            ..rules(&base, &[])
        };
        assert_eq!(fingerprint(&body, None, &openai), all[0]);
        for kind in [ProviderKind::Anthropic, ProviderKind::Azure] {
            let other = Rules {
                kinds: &[kind],
                ..rules(&base, &[])
            };
            assert_ne!(fingerprint(&body, None, &other), all[0], "{kind:?}");
        }
        // The client's `model` is replaced by the route and its targets.
        let mut renamed = chat("hi");
        renamed["model"] = json!("something-else");
        assert_eq!(fingerprint(&obj(renamed), None, &rules(&base, &[])), all[0]);
        let mut other_route = rules(&base, &[]);
        other_route.route = "faq";
        assert_ne!(fingerprint(&body, None, &other_route), all[0]);
    }

    fn image(url: &str) -> Value {
        json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": url, "detail": "high"}}
        ]}]})
    }

    #[test]
    fn attachments_join_by_content_hash_or_url() {
        let a = fp(image("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAE="));
        let b = fp(image("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAF="));
        assert_ne!(a, b);
        assert_eq!(
            a,
            fp(image("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAE="))
        );
        assert_ne!(
            fp(image("https://x.test/a.png")),
            fp(image("https://x.test/b.png"))
        );

        // A URL cannot impersonate the hash of inline data.
        let data = "data:image/png;base64,AAAA";
        let spelled = format!("data:blake3:{}", blake3::hash(data.as_bytes()).to_hex());
        assert_ne!(fp(image(data)), fp(image(&spelled)));

        let audio = |d: &str| {
            json!({"messages": [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": d, "format": "wav"}}]}]})
        };
        assert_ne!(fp(audio("UklGRg==")), fp(audio("UklGRh==")));
        let file = |d: &str| {
            json!({"messages": [{"role": "user", "content": [
                {"type": "file", "file": {"file_data": d, "filename": "a.pdf"}}]}]})
        };
        assert_ne!(
            fp(file("data:application/pdf;base64,JVBE")),
            fp(file("data:application/pdf;base64,JVBF"))
        );
    }

    #[test]
    fn inline_data_is_hashed_not_copied() {
        let big = format!("data:image/png;base64,{}", "A".repeat(100_000));
        let t = targets();
        let mut doc = Vec::new();
        write_document(&mut doc, &obj(image(&big)), None, &rules(&t, &[])).unwrap();
        assert!(doc.len() < 1_000, "document is {} bytes", doc.len());
    }

    #[test]
    fn stream_and_ids_are_noise() {
        let base = fp(chat("hi"));
        let mut noisy = chat("hi");
        for (k, v) in [
            ("stream", json!(true)),
            ("stream_options", json!({"include_usage": true})),
            ("request_id", json!("r-1")),
            ("trace_id", json!("t-1")),
            ("traceparent", json!("00-abc-def-01")),
            ("x_request_id", json!("x")),
            ("timestamp", json!(1_700_000_000)),
            ("nonce", json!("n")),
            ("user", json!("alice")),
            ("safety_identifier", json!("hash-of-alice")),
        ] {
            noisy[k] = v;
            assert_eq!(fp(noisy.clone()), base, "{k}");
        }
    }

    #[test]
    fn ignore_fields_are_noise_for_that_route_only() {
        let t = targets();
        let ignore = vec!["metadata".to_string()];
        let mut with = chat("hi");
        with["metadata"] = json!({"ticket": 42});
        let plain = obj(chat("hi"));
        let with = obj(with);
        assert_eq!(
            fingerprint(&with, None, &rules(&t, &ignore)),
            fingerprint(&plain, None, &rules(&t, &ignore))
        );
        assert_ne!(
            fingerprint(&with, None, &rules(&t, &[])),
            fingerprint(&plain, None, &rules(&t, &[]))
        );
    }

    #[test]
    fn unknown_fields_count() {
        let mut a = chat("hi");
        a["x_vendor_knob"] = json!(1);
        assert_ne!(fp(a.clone()), fp(chat("hi")));
        let mut b = chat("hi");
        b["x_vendor_knob"] = json!(2);
        assert_ne!(fp(a), fp(b));
    }

    #[test]
    fn scope_user_joins_the_user() {
        let t = targets();
        let mut r = rules(&t, &[]);
        r.scope = Scope::User;
        let with_user = |user: &str| {
            let mut b = chat("hi");
            b["user"] = json!(user);
            obj(b)
        };
        let plain = obj(chat("hi"));

        let alice = fingerprint(&with_user("alice"), None, &r);
        assert_ne!(alice, fingerprint(&with_user("bob"), None, &r));
        assert_ne!(alice, fingerprint(&plain, None, &r));
        // The same person by body field, by safety_identifier or by header.
        assert_eq!(alice, fingerprint(&plain, Some("alice"), &r));
        let mut safety = chat("hi");
        safety["safety_identifier"] = json!("alice");
        assert_eq!(alice, fingerprint(&obj(safety), None, &r));
        assert_ne!(
            fingerprint(&plain, Some("alice"), &r),
            fingerprint(&plain, Some("bob"), &r)
        );
        // The body wins over the header.
        assert_eq!(alice, fingerprint(&with_user("alice"), Some("bob"), &r));

        // With scope tenant, none of it matters.
        let tenant = rules(&t, &[]);
        let base = fingerprint(&plain, None, &tenant);
        assert_eq!(base, fingerprint(&with_user("alice"), None, &tenant));
        assert_eq!(base, fingerprint(&plain, Some("bob"), &tenant));
    }

    #[test]
    fn whitespace_normalization_spares_fences() {
        let w = Normalize::Whitespace;
        assert_eq!(normalize_text("  Hello \t\n  World  ", w), "Hello World");
        assert!(matches!(normalize_text("Hello World", w), Cow::Borrowed(_)));
        assert_eq!(normalize_text("  a  b ", Normalize::None), "  a  b ");

        let text = "Fix   this:\n```python\ndef f():\n    return  1\n```\n\n  please  ";
        assert_eq!(
            normalize_text(text, w),
            "Fix this:\n```python\ndef f():\n    return  1\n```\nplease"
        );
        // CRLF and LF texts are the same, inside fences too.
        assert_eq!(
            normalize_text(&text.replace('\n', "\r\n"), w),
            normalize_text(text, w)
        );
        // An unclosed fence runs to the end.
        assert_eq!(normalize_text("x\n```\n  a  b", w), "x\n```\n  a  b");
    }

    #[test]
    fn casefold_spares_fences() {
        let c = Normalize::Casefold;
        assert_eq!(
            normalize_text("  WHERE is MY Order? ", c),
            "where is my order?"
        );
        assert_eq!(normalize_text("ΟΔΟΣ", c), "οδος");
        assert_eq!(
            normalize_text("Run THIS\n```sql\nSELECT Name FROM T\n```", c),
            "run this\n```sql\nSELECT Name FROM T\n```"
        );
        assert!(matches!(
            normalize_text("already folded", c),
            Cow::Borrowed(_)
        ));
    }

    #[test]
    fn normalization_applies_to_message_text_only() {
        let t = targets();
        let mut r = rules(&t, &[]);
        r.normalize = Normalize::Casefold;
        let f = |v: Value| fingerprint(&obj(v), None, &r);

        assert_eq!(
            f(chat("Where is  my order?")),
            f(chat("where is my order?"))
        );
        let parts = |s: &str| json!({"messages": [{"role": "user", "content": [{"type": "text", "text": s}]}]});
        assert_eq!(f(parts(" HI ")), f(parts("hi")));
        // Fenced code, tool results, tool-call arguments and other fields
        // keep their case and spaces.
        assert_ne!(f(chat("```\nSELECT 1\n```")), f(chat("```\nselect 1\n```")));
        let tool =
            |s: &str| json!({"messages": [{"role": "tool", "tool_call_id": "c1", "content": s}]});
        assert_ne!(f(tool("{\"Id\": 1}")), f(tool("{\"id\": 1}")));
        let call = |args: &str| {
            json!({"messages": [{"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]}]})
        };
        assert_ne!(f(call("{\"A\":1}")), f(call("{\"a\":1}")));
        let mut stop_a = chat("hi");
        stop_a["stop"] = json!(["END"]);
        let mut stop_b = chat("hi");
        stop_b["stop"] = json!(["end"]);
        assert_ne!(f(stop_a), f(stop_b));
    }

    #[test]
    fn canonical_numbers_and_strings() {
        let cases: &[(&str, &str)] = &[
            ("1", "1"),
            ("1.0", "1"),
            ("1e0", "1"),
            ("10e-1", "1"),
            ("-0", "0"),
            ("-0.0", "0"),
            ("0.8", "0.8"),
            ("-2.5", "-2.5"),
            ("1e300", "1e300"),
            ("1.5e-9", "1.5e-9"),
            ("18446744073709551615", "18446744073709551615"),
            ("-9223372036854775808", "-9223372036854775808"),
            ("1e20", "100000000000000000000"),
            ("{\"b\":1,\"a\":[true,null]}", "{\"a\":[true,null],\"b\":1}"),
            (
                "\"q\\\" \\\\ \\n \\u0001 \\u001f é \\u2028\"",
                "\"q\\\" \\\\ \\n \\u0001 \\u001f é \u{2028}\"",
            ),
        ];
        for (input, expected) in cases {
            let v: Value = serde_json::from_str(input).unwrap();
            assert_eq!(&canonical(&v), expected, "{input}");
        }
        assert_eq!(canonical(&json!(2f64.powi(60))), "1152921504606846976");
        assert_eq!(canonical(&json!(-(2f64.powi(63)))), "-9223372036854775808");
        assert_eq!(canonical(&json!(2f64.powi(64))), "18446744073709552000");
        // Keys sort by UTF-8 bytes: "Z" < "a" < "é".
        let v = json!({"é": 1, "a": 2, "Z": 3});
        assert_eq!(canonical(&v), "{\"Z\":3,\"a\":2,\"é\":1}");
    }

    #[test]
    fn tenant_and_route_do_not_run_together() {
        let t = targets();
        let body = obj(chat("hi"));
        let mut a = rules(&t, &[]);
        a.tenant = "a";
        a.route = "bc";
        let mut b = rules(&t, &[]);
        b.tenant = "ab";
        b.route = "c";
        assert_ne!(fingerprint(&body, None, &a), fingerprint(&body, None, &b));
    }

    // ---- property tests ----

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            // Dyadic fractions, which serde_json's (fast, not always
            // correctly rounded) float parser reads back exactly.
            (-1_000_000i64..1_000_000).prop_map(|k| Value::from(k as f64 / 64.0)),
            "[a-zA-Z \n\"\\\\é]{0,10}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 32, 5, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::btree_map("[a-zA-Z_]{1,6}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// The same value with the key order of every object rotated by `by`.
    fn rotated(v: &Value, by: usize) -> Value {
        match v {
            Value::Array(items) => Value::Array(items.iter().map(|i| rotated(i, by)).collect()),
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                if !entries.is_empty() {
                    let n = by % entries.len();
                    entries.rotate_left(n);
                    entries.reverse();
                }
                Value::Object(
                    entries
                        .into_iter()
                        .map(|(k, v)| (k.clone(), rotated(v, by)))
                        .collect(),
                )
            }
            other => other.clone(),
        }
    }

    /// Every integer spelled as a float, recursively.
    fn as_floats(v: &Value) -> Value {
        match v {
            Value::Number(n) => match n.as_i64() {
                Some(i) if i.unsigned_abs() < 1 << 53 => Value::from(i as f64),
                _ => v.clone(),
            },
            Value::Array(items) => Value::Array(items.iter().map(as_floats).collect()),
            Value::Object(map) => {
                Value::Object(map.iter().map(|(k, v)| (k.clone(), as_floats(v))).collect())
            }
            other => other.clone(),
        }
    }

    fn arb_body() -> impl Strategy<Value = Map<String, Value>> {
        (
            prop::collection::vec(("(system|user|assistant)", "[a-zA-Z ]{0,20}"), 1..4),
            prop::collection::btree_map(
                "(temperature|top_p|seed|n|stop|tools|x_[a-z]{1,5})",
                arb_json(),
                0..5,
            ),
        )
            .prop_map(|(messages, params)| {
                let mut body = Map::new();
                body.insert("model".into(), json!("support-bot"));
                body.insert(
                    "messages".into(),
                    Value::Array(
                        messages
                            .into_iter()
                            .map(|(role, content)| json!({"role": role, "content": content}))
                            .collect(),
                    ),
                );
                body.extend(params);
                body
            })
    }

    fn body_fp(body: &Map<String, Value>) -> Fingerprint {
        let t = targets();
        fingerprint(body, None, &rules(&t, &[]))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]

        #[test]
        fn key_order_never_matters(body in arb_body(), by in 0usize..7) {
            let permuted = rotated(&Value::Object(body.clone()), by);
            let Value::Object(permuted) = permuted else { unreachable!() };
            prop_assert_eq!(body_fp(&body), body_fp(&permuted));
        }

        #[test]
        fn canonical_form_is_stable(v in arb_json(), by in 0usize..7) {
            let text = canonical(&v);
            prop_assert_eq!(&text, &canonical(&rotated(&v, by)));
            // It is JSON, and a fixed point.
            let reparsed: Value = serde_json::from_str(&text).unwrap();
            prop_assert_eq!(&text, &canonical(&reparsed));
        }

        #[test]
        fn float_spelling_round_trips(x in any::<f64>().prop_filter("finite", |x| x.is_finite())) {
            let Some(n) = Number::from_f64(x) else { unreachable!() };
            let mut out = Vec::new();
            write_number(&n, &mut out).unwrap();
            let text = String::from_utf8(out).unwrap();
            let back: f64 = text.parse().unwrap();
            prop_assert!(back == x, "{x} spelled {text}");
        }

        #[test]
        fn number_spelling_never_matters(i in -(1i64 << 49)..(1i64 << 49), body in arb_body()) {
            let spellings = [format!("{i}"), format!("{i}.0"), format!("{i}e0"), format!("{}e-1", i as i128 * 10)];
            let mut prints = spellings.iter().map(|s| {
                let mut b = body.clone();
                b.insert("temperature".into(), serde_json::from_str(s).unwrap());
                body_fp(&b)
            });
            let first = prints.next().unwrap();
            prop_assert!(prints.all(|p| p == first));
            let Value::Object(floats) = as_floats(&Value::Object(body.clone())) else { unreachable!() };
            prop_assert_eq!(body_fp(&body), body_fp(&floats));
        }

        #[test]
        fn noise_never_matters(
            body in arb_body(),
            noise in prop::collection::vec((0..noise_fields().len() + USER_FIELDS.len() + 1, arb_json()), 1..5),
        ) {
            let t = targets();
            let ignore = vec!["metadata".to_string()];
            let r = rules(&t, &ignore);
            let mut noisy = body.clone();
            for (which, value) in noise {
                let key = noise_fields().iter().chain(USER_FIELDS).nth(which).copied().unwrap_or("metadata");
                noisy.insert(key.into(), value);
            }
            prop_assert_eq!(fingerprint(&body, None, &r), fingerprint(&noisy, None, &r));
        }

        #[test]
        fn changing_a_message_always_matters(body in arb_body(), pick in any::<prop::sample::Index>(), text in "[a-zA-Z ]{0,20}") {
            let mut changed = body.clone();
            let messages = changed["messages"].as_array_mut().unwrap();
            let m = pick.index(messages.len());
            prop_assume!(messages[m]["content"] != json!(text));
            messages[m]["content"] = json!(text);
            prop_assert_ne!(body_fp(&body), body_fp(&changed));
        }

        #[test]
        fn changing_a_parameter_always_matters(
            body in arb_body(),
            key in "(temperature|max_tokens|response_format|x_[a-z]{1,5})",
            a in arb_json(),
            b in arb_json(),
        ) {
            prop_assume!(canonical(&a) != canonical(&b));
            let mut with_a = body.clone();
            with_a.insert(key.clone(), a);
            let mut with_b = body;
            with_b.insert(key, b);
            prop_assert_ne!(body_fp(&with_a), body_fp(&with_b));
        }

        #[test]
        fn tenants_never_collide(body in arb_body(), a in ".{0,8}", b in ".{0,8}") {
            prop_assume!(a != b);
            let t = targets();
            let mut ra = rules(&t, &[]);
            ra.tenant = &a;
            let mut rb = rules(&t, &[]);
            rb.tenant = &b;
            prop_assert_ne!(fingerprint(&body, None, &ra), fingerprint(&body, None, &rb));
        }

        #[test]
        fn normalization_is_idempotent(text in "([aB \t\n]|```|\r\n|É){0,40}", fold in any::<bool>()) {
            let mode = if fold { Normalize::Casefold } else { Normalize::Whitespace };
            let once = normalize_text(&text, mode).into_owned();
            prop_assert_eq!(normalize_text(&once, mode), once.as_str());
        }
    }

    /// Found by the `canonical` fuzz target: an integer too large for u64
    /// is a float whose shortest spelling must parse back to the same
    /// float (serde_json's `float_roundtrip`), or the canonical form of a
    /// re-parsed request would differ from the original's.
    #[test]
    fn canonical_numbers_survive_a_reparse() {
        for text in [
            "1844674407373709551609551616",
            "1.8446744073737094e27",
            "2.2250738585072011e-308",
            "9007199254740993",
            "0.30000000000000004",
        ] {
            let v: Value = serde_json::from_str(text).unwrap();
            let mut first = Vec::new();
            write_canonical(&v, &mut first).unwrap();
            let again: Value = serde_json::from_slice(&first).unwrap();
            let mut second = Vec::new();
            write_canonical(&again, &mut second).unwrap();
            assert_eq!(
                String::from_utf8(first).unwrap(),
                String::from_utf8(second).unwrap(),
                "{text}"
            );
        }
    }

    /// Found by the `canonical` fuzz target: carriage returns at the end of
    /// a fenced line were stripped one per pass.
    #[test]
    fn normalizing_fenced_carriage_returns_twice_changes_nothing() {
        for text in ["```\n.\r\r\r\n[", "```\r\nx\r\n\r\n```\r\n", "```\nx\r"] {
            for mode in [Normalize::Whitespace, Normalize::Casefold] {
                let once = normalize_text(text, mode).into_owned();
                assert_eq!(normalize_text(&once, mode), once.as_str(), "{text:?}");
            }
        }
        assert_eq!(
            normalize_text("```\n.\r\r\r\n[", Normalize::Whitespace),
            "```\n.\n["
        );
    }
}
