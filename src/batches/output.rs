//! The lines of a batch's output and error files, in OpenAI's shape: a
//! line's answer (its job succeeded), or why it has none (refused as its
//! endpoint would refuse it, failed, not run, or unknown).

use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use super::LineRefusal;
use super::driver::Ending;
use crate::store::{JobRecord, JobState};

/// An output or error file line.
pub(super) enum Written {
    Output(String),
    Error(String),
}

#[derive(Serialize)]
struct OutLine<'a> {
    id: String,
    custom_id: &'a str,
    response: Option<Response<'a>>,
    error: Option<Value>,
}

#[derive(Serialize)]
struct Response<'a> {
    status_code: u16,
    request_id: Option<&'a str>,
    body: &'a RawValue,
}

fn request_id(job: Option<&JobRecord>) -> String {
    match job {
        Some(j) => format!("batch_req_{}", j.id.replace('-', "")),
        None => format!("batch_req_{}", uuid::Uuid::now_v7().simple()),
    }
}

/// The line of `custom_id` in the output file (its job succeeded) or in
/// the error file (with why).
pub(super) fn output_line(
    custom_id: &str,
    refused: Option<&LineRefusal>,
    job: Option<&JobRecord>,
    ending: Ending,
) -> Written {
    let error = |code: &str, message: String| {
        let line = OutLine {
            id: request_id(job),
            custom_id,
            response: None,
            error: Some(json!({"code": code, "message": message})),
        };
        Written::Error(serde_json::to_string(&line).unwrap_or_default())
    };
    if let Some(r) = refused {
        let body = json!({"error": {
            "message": r.message,
            "type": "invalid_request_error",
            "param": r.param,
            "code": r.code,
        }});
        let raw = serde_json::value::to_raw_value(&body).ok();
        let line = OutLine {
            id: request_id(None),
            custom_id,
            response: raw.as_deref().map(|body| Response {
                status_code: r.status,
                request_id: None,
                body,
            }),
            error: None,
        };
        return Written::Error(serde_json::to_string(&line).unwrap_or_default());
    }
    let Some(j) = job else {
        return match ending {
            Ending::Expired => error(
                "batch_expired",
                "This line was not run before the batch expired.".into(),
            ),
            // In a batch run to its end, a line is left without a job only
            // when the identical line whose answer it shares is held
            // unknown.
            Ending::Completed => error(
                "unknown",
                "This line was not run: it shares the call of an identical line of this batch \
                 whose outcome is unknown (idem cannot tell whether the provider did the work); \
                 that line's error names its job"
                    .into(),
            ),
            Ending::Cancelled => error(
                "batch_cancelled",
                "This line was not run: the batch was cancelled.".into(),
            ),
        };
    };
    match j.state {
        JobState::Succeeded => {
            let raw = j
                .result
                .as_deref()
                .and_then(|r| serde_json::from_str::<&RawValue>(r).ok());
            match raw {
                Some(body) => {
                    let line = OutLine {
                        id: request_id(job),
                        custom_id,
                        response: Some(Response {
                            status_code: 200,
                            request_id: Some(&j.id),
                            body,
                        }),
                        error: None,
                    };
                    Written::Output(serde_json::to_string(&line).unwrap_or_default())
                }
                None => error(
                    "internal_error",
                    format!("job {}'s stored answer cannot be read", j.id),
                ),
            }
        }
        JobState::Failed => error(
            "request_failed",
            j.error.clone().unwrap_or_else(|| "the line failed".into()),
        ),
        JobState::Cancelled => error(
            "batch_cancelled",
            j.error
                .clone()
                .unwrap_or_else(|| "This line's job was cancelled.".into()),
        ),
        JobState::Queued | JobState::Running => error(
            "unknown",
            format!(
                "job {} of this line has not ended (an attempt may be unknown: idem cannot \
                 tell whether the provider did the work); GET /v1/jobs/{} tells how it ends",
                j.id, j.id
            ),
        ),
    }
}
