//! A batch's input read and checked: each line parsed against the batch
//! (its `custom_id`, method, endpoint and body), and the `validating` pass
//! that fails the batch with OpenAI's errors or moves it to `in_progress`.

use std::collections::HashSet;

use serde_json::{Map, Value, json};

use super::{Driver, MAX_CUSTOM_ID, MAX_ERRORS};
use crate::batches::lines::{Line, LineReader};
use crate::store::{BatchStatus, StoreError, now_ms};

/// A line read from the input file and checked against the batch.
pub(super) struct Parsed {
    pub(super) custom_id: String,
    pub(super) body: Map<String, Value>,
}

/// A line that is not a request of this batch: OpenAI's validation error.
pub(super) struct Bad {
    pub(super) code: &'static str,
    pub(super) message: String,
    pub(super) param: Option<&'static str>,
}

fn bad(code: &'static str, message: impl Into<String>, param: Option<&'static str>) -> Bad {
    Bad {
        code,
        message: message.into(),
        param,
    }
}

/// Reads one line of a batch's input (`endpoint` is the batch's).
pub(super) fn parse_line(line: &[u8], endpoint: &str) -> Result<Parsed, Bad> {
    let Ok(Value::Object(mut obj)) = serde_json::from_slice::<Value>(line) else {
        return Err(bad(
            "invalid_json_line",
            "this line is not a JSON object",
            None,
        ));
    };
    let custom_id = match obj.remove("custom_id") {
        Some(Value::String(c)) if !c.is_empty() && c.len() <= MAX_CUSTOM_ID => c,
        Some(Value::String(_)) => {
            return Err(bad(
                "invalid_custom_id",
                format!("custom_id must be 1 to {MAX_CUSTOM_ID} bytes"),
                Some("custom_id"),
            ));
        }
        _ => {
            return Err(bad(
                "missing_required_parameter",
                "the line has no custom_id string",
                Some("custom_id"),
            ));
        }
    };
    match obj.get("method").and_then(Value::as_str) {
        Some("POST") => {}
        other => {
            return Err(bad(
                "invalid_method",
                format!("method must be \"POST\", not {other:?}"),
                Some("method"),
            ));
        }
    }
    match obj.get("url").and_then(Value::as_str) {
        Some(url) if url == endpoint => {}
        other => {
            return Err(bad(
                "mismatched_endpoint",
                format!("url {other:?} is not the batch's endpoint {endpoint:?}"),
                Some("url"),
            ));
        }
    }
    let Some(Value::Object(body)) = obj.remove("body") else {
        return Err(bad(
            "missing_required_parameter",
            "the line has no body object",
            Some("body"),
        ));
    };
    Ok(Parsed { custom_id, body })
}

/// Whether a line is only white space (skipped, not counted).
pub(super) fn blank(line: &[u8]) -> bool {
    line.iter().all(u8::is_ascii_whitespace)
}

impl Driver {
    /// `validating`: the whole input read once.
    pub(super) async fn validate(&mut self) -> Result<(), StoreError> {
        let max_lines = self.env.live().config.batches.max_lines;
        let mut reader = LineReader::new(self.env.store().clone(), &self.b.input_file_id);
        let mut ids: HashSet<String> = HashSet::new();
        let mut errors: Vec<Value> = Vec::new();
        let error = |errors: &mut Vec<Value>,
                     code: &str,
                     message: String,
                     param: Option<&str>,
                     line: u64| {
            if errors.len() < MAX_ERRORS {
                errors
                    .push(json!({"code": code, "message": message, "param": param, "line": line}));
            }
        };
        let (mut n, mut physical) = (0u64, 0u64);
        while let Some(line) = reader.next().await? {
            physical += 1;
            let text = match line {
                Line::Text(t) if blank(&t) => continue,
                Line::Text(t) => t,
                Line::TooLong => {
                    error(
                        &mut errors,
                        "line_too_long",
                        format!(
                            "the line is longer than {} bytes",
                            crate::batches::lines::MAX_LINE_BYTES
                        ),
                        None,
                        physical,
                    );
                    continue;
                }
            };
            n += 1;
            if n > max_lines {
                error(
                    &mut errors,
                    "too_many_lines",
                    format!("the file has more than {max_lines} lines, the most a batch takes"),
                    None,
                    physical,
                );
                break;
            }
            let parsed = match parse_line(&text, &self.b.endpoint) {
                Ok(p) => p,
                Err(b) => {
                    error(&mut errors, b.code, b.message, b.param, physical);
                    continue;
                }
            };
            if !ids.insert(parsed.custom_id.clone()) {
                error(
                    &mut errors,
                    "duplicate_custom_id",
                    format!(
                        "custom_id {:?} is used by an earlier line",
                        parsed.custom_id
                    ),
                    Some("custom_id"),
                    physical,
                );
                continue;
            }
            if let Err(r) = self.plan(parsed.body)
                && r.fails_batch
            {
                error(
                    &mut errors,
                    &r.code,
                    r.message,
                    r.param.as_deref(),
                    physical,
                );
            }
        }
        if n == 0 && errors.is_empty() {
            error(
                &mut errors,
                "empty_file",
                "the input file has no lines".into(),
                None,
                0,
            );
        }
        let mut next = self.b.clone();
        let now = now_ms();
        if errors.is_empty() {
            next.status = BatchStatus::InProgress;
            next.in_progress_at = Some(now);
            next.counts.total = i64::try_from(n).unwrap_or(i64::MAX);
        } else {
            next.status = BatchStatus::Failed;
            next.failed_at = Some(now);
            next.errors = Some(Value::from(errors).to_string());
        }
        let started = next.status == BatchStatus::InProgress;
        self.fresh = self.save(next).await? && started;
        Ok(())
    }
}
