//! The text form of a request-log line (`log.format = "text"`, the
//! default), read back as the JSON object its JSON form would be, so that
//! `idem analyze` reads what an out-of-the-box gateway writes.
//!
//! A text line is `<timestamp>  INFO idem::request: key=value key=value
//! ...`: strings quoted with Rust's escapes (`tenant="acme"`), everything
//! else bare (`status=200`, `time=2025-...Z`, `fingerprint=v1:...`).

use serde_json::{Map, Number, Value};

use crate::reqlog::TARGET;

/// What a line of the text log is.
#[derive(Debug, PartialEq)]
pub enum TextLine {
    /// A request line: its fields, as its JSON form has them.
    Request(Map<String, Value>),
    /// Another event of the process log (`idem listening`, a warning).
    Other,
}

/// A line of the text log, or None when the line is not one (a JSON line,
/// a raw body, a broken request line).
pub fn parse(line: &[u8]) -> Option<TextLine> {
    let line = std::str::from_utf8(line).ok()?.trim_end();
    // `<RFC 3339 timestamp> <spaces><LEVEL> <target>: ...`
    let (stamp, rest) = line.split_once(' ')?;
    humantime::parse_rfc3339(stamp).ok()?;
    let (level, rest) = rest.trim_start().split_once(' ')?;
    if !matches!(level, "TRACE" | "DEBUG" | "INFO" | "WARN" | "ERROR") {
        return None;
    }
    // With spans enabled (`IDEM_LOG=debug`), their names come between the
    // level and the target (and their fields after the event's).
    let marker = format!("{TARGET}: ");
    let pairs = match rest.strip_prefix(&marker) {
        Some(pairs) => Some(pairs),
        None => rest
            .find(&format!(" {marker}"))
            .map(|at| &rest[at + 1 + marker.len()..]),
    };
    match pairs {
        Some(pairs) => fields(pairs).map(TextLine::Request),
        None => Some(TextLine::Other),
    }
}

/// `key=value` pairs separated by single spaces.
fn fields(mut rest: &str) -> Option<Map<String, Value>> {
    let mut out = Map::new();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let key = &rest[..eq];
        if key.is_empty() || key.contains(' ') {
            return None;
        }
        rest = &rest[eq + 1..];
        let value = if let Some(quoted) = rest.strip_prefix('"') {
            let (text, after) = unquote(quoted)?;
            rest = after;
            Value::String(text)
        } else {
            let end = rest.find(' ').unwrap_or(rest.len());
            let bare = &rest[..end];
            rest = &rest[end..];
            bare_value(bare)
        };
        out.insert(key.to_string(), value);
        rest = rest.strip_prefix(' ').unwrap_or(rest);
    }
    Some(out)
}

/// A bare value: a number when it reads as one (`200`, `0.125`), else the
/// text (an RFC 3339 time, a fingerprint).
fn bare_value(bare: &str) -> Value {
    if let Ok(n) = bare.parse::<u64>() {
        return Value::Number(n.into());
    }
    if let Ok(n) = bare.parse::<i64>() {
        return Value::Number(n.into());
    }
    match bare.parse::<f64>().ok().and_then(Number::from_f64) {
        Some(n)
            if bare
                .bytes()
                .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b)) =>
        {
            Value::Number(n)
        }
        _ => Value::String(bare.to_string()),
    }
}

/// A string after its opening quote, as Rust's `Debug` escapes it: the
/// text and what follows the closing quote.
fn unquote(s: &str) -> Option<(String, &str)> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Some((out, &s[i + 1..])),
            '\\' => {
                let (_, e) = chars.next()?;
                match e {
                    'n' => out.push('\n'),
                    'r' => out.push('\r'),
                    't' => out.push('\t'),
                    '0' => out.push('\0'),
                    '\\' | '"' | '\'' => out.push(e),
                    'u' => {
                        // \u{1f600}
                        let (_, open) = chars.next()?;
                        if open != '{' {
                            return None;
                        }
                        let mut hex = String::new();
                        loop {
                            let (_, h) = chars.next()?;
                            if h == '}' {
                                break;
                            }
                            hex.push(h);
                        }
                        out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                    }
                    _ => return None,
                }
            }
            c => out.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_text_request_line_reads_as_its_json_form() {
        let line = r#"2026-12-02T11:34:16.340072Z  INFO idem::request: time=2026-12-02T11:34:16.339Z tenant="acme \"q\"\n \u{1b} \\ é" route="bot" fingerprint=v1:09 outcome="cache-hit" job="j1" attempt=2 provider="primary" model="gpt-4o-mini" status=200 latency_ms=0.001 upstream_ms=5.0 prompt_tokens=0 completion_tokens=0"#;
        let Some(TextLine::Request(fields)) = parse(line.as_bytes()) else {
            panic!("not read as a request line")
        };
        let v = Value::Object(fields);
        assert_eq!(
            v,
            json!({
                "time": "2026-12-02T11:34:16.339Z",
                "tenant": "acme \"q\"\n \u{1b} \\ é",
                "route": "bot",
                "fingerprint": "v1:09",
                "outcome": "cache-hit",
                "job": "j1",
                "attempt": 2,
                "provider": "primary",
                "model": "gpt-4o-mini",
                "status": 200,
                "latency_ms": 0.001,
                "upstream_ms": 5.0,
                "prompt_tokens": 0,
                "completion_tokens": 0,
            })
        );
    }

    #[test]
    fn a_request_line_inside_spans_is_read() {
        // As the compact formatter writes it: the span's name before the
        // target, its fields after the event's.
        let line = br#"2026-12-02T12:20:13.001691Z  INFO request: idem::request: tenant="acme" fingerprint=v1:09 outcome="leader" status=200 method="POST" uri="/v1/chat/completions""#;
        let Some(TextLine::Request(fields)) = parse(line) else {
            panic!("not read as a request line")
        };
        assert_eq!(fields["tenant"], "acme");
        assert_eq!(fields["status"], 200);
    }

    #[test]
    fn other_lines_are_not_request_lines() {
        let other =
            b"2026-12-02T11:34:16.340072Z  INFO idem::app: idem listening addr=127.0.0.1:8080";
        assert_eq!(parse(other), Some(TextLine::Other));
        for line in [
            &br#"{"time":"x","message":"idem::request: a=1"}"#[..],
            br#"2026-12-02T11:34:16Z  INFO idem::request: tenant="unterminated"#,
            b"2026-12-02T11:34:16Z  INFO idem::request: no pairs here",
            b"yesterday INFO idem::request: tenant=\"a\"",
            b"\xff\xfe",
        ] {
            assert_eq!(parse(line), None, "{}", String::from_utf8_lossy(line));
        }
    }
}
