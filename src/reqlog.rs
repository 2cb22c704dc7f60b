//! The request log: one structured line per chat completion and per job
//! creation, written at the end of the handler, after the answer's head is
//! known (docs/design.md, "Numbers").
//!
//! Its fields are a public interface (docs/operations.md, "Request log",
//! lists them, and `idem analyze` reads them back), so they are named once, in
//! [`Line`], and every destination carries the same set. `[log] requests`
//! picks the destination: `stdout` sends each line through `tracing` as an
//! event of target `idem::request` (formatted by `[log] format` like every
//! other log line), `off` drops it, and anything else is a file path that
//! gets JSON lines appended by a writer thread, so a slow disk never holds
//! a request up. Keys never reach this module: an [`Entry`] has no field
//! for headers, and the request's `messages` are copied only when
//! `[log] bodies = true`.

use std::fs::OpenOptions;
use std::io::{BufWriter, Write};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

use serde::Serialize;
use serde_json::{Map, Value};
use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, NonBlockingBuilder, WorkerGuard};

use crate::answer::Answer;
use crate::config::LogConfig;
use crate::fingerprint::Fingerprint;

/// Lines a log writer (this file writer, and the process log on stdout)
/// may hold before it drops new ones rather than make a request wait for
/// the disk or the pipe. Dropped lines are counted
/// (`idem_log_lines_dropped_total`). The queue is allocated, and its slots
/// written, up front: 32 bytes a line, 1 MiB here (the writer library's
/// default, 128,000 lines, kept 4 MiB resident in every gateway).
pub const QUEUED_LINES: usize = 32_768;

/// The `target` of request lines in the process log.
pub const TARGET: &str = "idem::request";

/// The process log's writer, when it writes JSON to stdout (set once, by
/// the logging set-up).
static JSON_STDOUT: OnceLock<NonBlocking> = OnceLock::new();

/// Sends request lines for stdout straight to the JSON process log's
/// `writer`, already in the form its formatter gives an event (`timestamp`,
/// `level`, the fields, `target`), serialized once rather than visited
/// field by field by the formatter. The request log costs about 10 us of a
/// request's 70 us of CPU through the gateway (table 1 of the benchmark,
/// against `requests = "off"`); this saves 3 or 4 of them. `IDEM_LOG`
/// still decides whether they are written. Lines with `messages` still go
/// through the formatter (it writes them as a string of JSON).
pub fn write_json_lines_to(writer: NonBlocking) {
    let _ = JSON_STDOUT.set(writer);
}

/// The request log could not be opened at start-up.
#[derive(Debug, thiserror::Error)]
pub enum RequestLogError {
    #[error("log.requests: cannot open {path} for appending: {source}")]
    Open {
        path: String,
        source: std::io::Error,
    },
}

/// Where request lines go, chosen once at start-up.
pub struct RequestLog {
    sink: Sink,
    bodies: bool,
}

enum Sink {
    Off,
    Tracing,
    /// JSON lines appended by a writer thread. The guard flushes what is
    /// still queued when the gateway's state is dropped.
    File {
        writer: NonBlocking,
        _guard: WorkerGuard,
    },
}

impl std::fmt::Debug for RequestLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sink = match self.sink {
            Sink::Off => "off",
            Sink::Tracing => "stdout",
            Sink::File { .. } => "file",
        };
        f.debug_struct("RequestLog")
            .field("sink", &sink)
            .field("bodies", &self.bodies)
            .finish()
    }
}

impl RequestLog {
    /// `[log] requests`: `stdout`, `off`, or a file path (relative to the
    /// working directory), opened for appending and created if missing.
    pub fn from_config(config: &LogConfig) -> Result<RequestLog, RequestLogError> {
        let sink = match config.requests.as_str() {
            "off" => Sink::Off,
            "stdout" => Sink::Tracing,
            path => {
                let file = OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)
                    .map_err(|source| RequestLogError::Open {
                        path: path.to_string(),
                        source,
                    })?;
                // The worker flushes whenever its queue runs dry, so the
                // buffer only batches bursts into fewer writes.
                let (writer, guard) = NonBlockingBuilder::default()
                    .lossy(true)
                    .buffered_lines_limit(QUEUED_LINES)
                    .thread_name("idem-request-log")
                    .finish(BufWriter::with_capacity(64 * 1024, file));
                Sink::File {
                    writer,
                    _guard: guard,
                }
            }
        };
        Ok(RequestLog {
            sink,
            bodies: config.bodies,
        })
    }

    /// The file writer's count of dropped lines (none for the other sinks:
    /// stdout lines are counted by the process log's writer).
    pub fn dropped_lines(&self) -> Option<ErrorCounter> {
        match &self.sink {
            Sink::File { writer, .. } => Some(writer.error_counter()),
            Sink::Off | Sink::Tracing => None,
        }
    }

    /// A log that writes nothing.
    pub fn off() -> RequestLog {
        RequestLog {
            sink: Sink::Off,
            bodies: false,
        }
    }

    /// Writes one request's line. Never blocks on I/O: the file writer
    /// queues the line (and drops it if its queue is full).
    /// True when lines carry the request's messages (`log.bodies`), so a
    /// line's entry needs the parsed body.
    pub fn records_bodies(&self) -> bool {
        self.bodies && !matches!(self.sink, Sink::Off)
    }

    pub fn write(&self, entry: &Entry<'_>) {
        match &self.sink {
            Sink::Off => {}
            Sink::Tracing => {
                // `IDEM_LOG` decides, whichever way the line then goes.
                if !tracing::enabled!(target: TARGET, tracing::Level::INFO) {
                    return;
                }
                let line = Line::new(entry, self.bodies);
                match JSON_STDOUT.get() {
                    Some(out) if line.messages.is_none() => {
                        if let Some(bytes) = json_event(&line, SystemTime::now()) {
                            // One write call is one queued message.
                            let _ = out.clone().write_all(&bytes);
                        }
                    }
                    _ => event(&line),
                }
            }
            Sink::File { writer, .. } => {
                let line = Line::new(entry, self.bodies);
                let mut bytes = Vec::with_capacity(320);
                if serde_json::to_writer(&mut bytes, &line).is_ok() {
                    bytes.push(b'\n');
                    // One write call is one queued message, so lines from
                    // concurrent requests never interleave.
                    let _ = writer.clone().write_all(&bytes);
                }
            }
        }
    }
}

/// A request line as a `tracing` event of target [`TARGET`].
pub fn event(line: &Line<'_>) {
    let messages = line
        .messages
        .map(|m| serde_json::to_string(m).unwrap_or_default());
    tracing::info!(
        target: TARGET,
        time = %line.time,
        tenant = line.tenant,
        route = line.route,
        endpoint = line.endpoint,
        fingerprint = %line.fingerprint,
        outcome = line.outcome,
        job = line.job,
        attempt = line.attempt,
        provider = line.provider,
        model = line.model,
        status = line.status,
        latency_ms = line.latency_ms,
        upstream_ms = line.upstream_ms,
        prompt_tokens = line.prompt_tokens,
        completion_tokens = line.completion_tokens,
        cost = line.cost,
        saved_cost = line.saved_cost,
        messages = messages.as_deref(),
    );
}

/// A request line (without `messages`) as the JSON process log writes the
/// event [`event`] makes: `timestamp` (when it is written, microseconds),
/// `level`, the line's fields, `target`; newline-terminated.
pub fn json_event(line: &Line<'_>, now: SystemTime) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(448);
    out.extend_from_slice(b"{\"timestamp\":\"");
    let _ = write!(out, "{}", humantime::format_rfc3339_micros(now));
    out.extend_from_slice(b"\",\"level\":\"INFO\",");
    let fields = out.len();
    serde_json::to_writer(&mut out, line).ok()?;
    // The line's own braces go: its fields sit between level and target.
    out.remove(fields);
    out.pop();
    out.extend_from_slice(b",\"target\":\"");
    out.extend_from_slice(TARGET.as_bytes());
    out.extend_from_slice(b"\"}\n");
    Some(out)
}

/// What one request did, as its handler knows it. Build it with
/// [`Entry::new`] and the optional parts.
#[derive(Debug, Clone)]
pub struct Entry<'a> {
    /// When the request arrived (not when the line is written).
    pub arrived: SystemTime,
    pub tenant: &'a str,
    pub route: &'a str,
    /// The endpoint it came in by (see [`Line::endpoint`]).
    pub endpoint: &'a str,
    pub fingerprint: &'a Fingerprint,
    pub outcome: &'a str,
    pub job: Option<&'a str>,
    pub attempt: Option<i32>,
    pub status: u16,
    pub latency: Duration,
    /// The answer the request received, if any (for its upstream duration
    /// and token counts).
    pub answer: Option<&'a Answer>,
    /// The request body (only its `messages`, and only with `bodies`).
    pub body: Option<&'a Map<String, Value>>,
    /// Token counts when the answer's own do not say them (an embeddings
    /// request's items, each with its share).
    pub usage: Option<(u64, u64)>,
    /// What the call this request made cost, or what the call it did not
    /// make would have cost (US dollars; None: unknown, or no call).
    pub cost: Option<Cost>,
}

/// A request's money: spent on its own call, or saved by not making one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cost {
    Spent(f64),
    Saved(f64),
}

impl<'a> Entry<'a> {
    /// A request that started at `started` and ends now.
    pub fn new(
        tenant: &'a str,
        route: &'a str,
        fingerprint: &'a Fingerprint,
        outcome: &'a str,
        status: u16,
        started: Instant,
    ) -> Entry<'a> {
        let latency = started.elapsed();
        let now = SystemTime::now();
        Entry {
            arrived: now.checked_sub(latency).unwrap_or(now),
            tenant,
            route,
            endpoint: "chat",
            fingerprint,
            outcome,
            job: None,
            attempt: None,
            status,
            latency,
            answer: None,
            body: None,
            usage: None,
            cost: None,
        }
    }

    /// The endpoint it came in by (`chat` unless said).
    pub fn endpoint(mut self, endpoint: &'a str) -> Self {
        self.endpoint = endpoint;
        self
    }

    /// The job path: the job and the attempt that completed it, if any.
    pub fn job(mut self, id: &'a str, attempt: Option<i32>) -> Self {
        self.job = Some(id);
        self.attempt = attempt;
        self
    }

    pub fn answer(mut self, answer: Option<&'a Answer>) -> Self {
        self.answer = answer;
        self
    }

    pub fn body(mut self, body: &'a Map<String, Value>) -> Self {
        self.body = Some(body);
        self
    }

    pub fn body_if(mut self, body: Option<&'a Map<String, Value>>) -> Self {
        self.body = body;
        self
    }

    pub fn usage(mut self, usage: Option<(u64, u64)>) -> Self {
        self.usage = usage;
        self
    }

    pub fn cost(mut self, cost: Option<Cost>) -> Self {
        self.cost = cost;
        self
    }
}

/// One line of the request log: the stable field names, in order.
#[derive(Debug, Serialize)]
pub struct Line<'a> {
    /// Arrival time, RFC 3339 in UTC with milliseconds.
    pub time: String,
    pub tenant: &'a str,
    pub route: &'a str,
    /// The endpoint the request came in by: `chat` (chat completions),
    /// `messages` (Anthropic's Messages API), `responses` (OpenAI's
    /// Responses API), `embeddings`, or `jobs` (`POST /v1/jobs`).
    pub endpoint: &'a str,
    /// `v1:<64 hex>`.
    pub fingerprint: String,
    /// `leader`, `follower`, `cache-hit`, `negative-hit`, `bypass`,
    /// `replay`; for `POST /v1/jobs`: `created` or `replay`.
    pub outcome: &'a str,
    /// Job id, on the job path only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<&'a str>,
    /// The attempt that completed the job, on the job path only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attempt: Option<i32>,
    /// The provider whose answer this request received (the leader's for
    /// followers and cache hits), and the model it was asked for there;
    /// absent when none answered (a request refused before any call).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub provider: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<&'a str>,
    /// HTTP status of the answer.
    pub status: u16,
    /// From arrival until the answer's head was ready.
    pub latency_ms: f64,
    /// The upstream call whose answer this request received (the leader's
    /// call for followers and cache hits); 0 without one.
    pub upstream_ms: f64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// US dollars its own upstream call cost (leaders, bypasses, jobs),
    /// when the target has a price.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
    /// US dollars the call it did not make would have cost (followers,
    /// cache hits, replays), when that call's target has a price.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saved_cost: Option<f64>,
    /// The request's `messages`, only with `[log] bodies = true`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub messages: Option<&'a Value>,
}

impl<'a> Line<'a> {
    pub fn new(e: &Entry<'a>, bodies: bool) -> Line<'a> {
        let (upstream, (prompt_tokens, completion_tokens)) = match e.answer {
            Some(a) => (
                a.upstream_latency,
                e.usage.or_else(|| a.usage()).unwrap_or((0, 0)),
            ),
            None => (Duration::ZERO, e.usage.unwrap_or((0, 0))),
        };
        Line {
            time: humantime::format_rfc3339_millis(e.arrived).to_string(),
            tenant: e.tenant,
            route: e.route,
            endpoint: e.endpoint,
            fingerprint: e.fingerprint.to_string(),
            outcome: e.outcome,
            job: e.job,
            attempt: e.attempt,
            provider: e.answer.map(|a| &*a.provider),
            model: e.answer.map(|a| &*a.model),
            status: e.status,
            latency_ms: millis(e.latency),
            upstream_ms: millis(upstream),
            prompt_tokens,
            completion_tokens,
            cost: match e.cost {
                Some(Cost::Spent(d)) => Some(d),
                _ => None,
            },
            saved_cost: match e.cost {
                Some(Cost::Saved(d)) => Some(d),
                _ => None,
            },
            messages: if bodies {
                e.body.and_then(|b| b.get("messages"))
            } else {
                None
            },
        }
    }
}

/// Milliseconds with microsecond precision (three decimals).
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 1_000_000.0).round() / 1000.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn body() -> Map<String, Value> {
        match json!({"model": "m", "messages": [{"role": "user", "content": "secret plan"}]}) {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_line_has_the_stable_fields_and_no_contents_by_default() {
        let fp = Fingerprint::from_bytes([7; 32]);
        let b = body();
        let e = Entry::new("acme", "bot", &fp, "leader", 200, Instant::now()).body(&b);
        let v = serde_json::to_value(Line::new(&e, false)).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            [
                "time",
                "tenant",
                "route",
                "endpoint",
                "fingerprint",
                "outcome",
                "status",
                "latency_ms",
                "upstream_ms",
                "prompt_tokens",
                "completion_tokens"
            ]
        );
        assert!(!v.to_string().contains("secret plan"));
        let time = v["time"].as_str().unwrap();
        assert!(humantime::parse_rfc3339(time).is_ok(), "{time}");
        assert_eq!(time.len(), "2025-01-01T00:00:00.000Z".len(), "{time}");
        assert_eq!(v["fingerprint"], fp.to_string());
    }

    #[test]
    fn the_job_path_and_bodies_add_their_fields() {
        let fp = Fingerprint::from_bytes([1; 32]);
        let b = body();
        let e = Entry::new("acme", "bot", &fp, "created", 201, Instant::now())
            .job("0193-job", Some(2))
            .body(&b);
        let v = serde_json::to_value(Line::new(&e, true)).unwrap();
        assert_eq!(v["job"], "0193-job");
        assert_eq!(v["attempt"], 2);
        assert_eq!(v["messages"][0]["content"], "secret plan");
    }

    #[test]
    fn an_answered_request_names_its_provider_and_model() {
        let fp = Fingerprint::from_bytes([2; 32]);
        let answer = Answer::test_ok("primary", "gpt-4o-mini");
        let e =
            Entry::new("acme", "bot", &fp, "follower", 200, Instant::now()).answer(Some(&answer));
        let v = serde_json::to_value(Line::new(&e, false)).unwrap();
        assert_eq!(v["provider"], "primary");
        assert_eq!(v["model"], "gpt-4o-mini");
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        let at = |k: &str| keys.iter().position(|x| *x == k).unwrap();
        assert!(
            at("outcome") < at("provider") && at("model") < at("status"),
            "{keys:?}"
        );
    }

    #[test]
    fn a_file_destination_appends_json_lines() {
        let dir = std::env::temp_dir().join(format!("idem-reqlog-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("requests.jsonl");
        std::fs::write(&path, "{\"earlier\":true}\n").unwrap();
        let config = LogConfig {
            requests: path.display().to_string(),
            ..LogConfig::default()
        };
        let log = RequestLog::from_config(&config).unwrap();
        let fp = Fingerprint::from_bytes([2; 32]);
        for _ in 0..3 {
            log.write(&Entry::new(
                "acme",
                "bot",
                &fp,
                "cache-hit",
                200,
                Instant::now(),
            ));
        }
        drop(log); // the guard flushes the queue
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        for l in &lines[1..] {
            let v: Value = serde_json::from_str(l).unwrap();
            assert_eq!(v["outcome"], "cache-hit");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unopenable_file_names_the_key() {
        let config = LogConfig {
            requests: "/nonexistent-dir/for/idem/requests.jsonl".into(),
            ..LogConfig::default()
        };
        let e = RequestLog::from_config(&config).unwrap_err();
        assert!(e.to_string().starts_with("log.requests:"), "{e}");
    }
}
