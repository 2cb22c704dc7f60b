//! A fake OpenAI-compatible provider (`idem mock-upstream`), the test double
//! for the LLM provider used by idem's demo, integration tests and benchmarks.
//!
//! It answers `POST /v1/chat/completions` (plain JSON or SSE) with a
//! deterministic answer that names the call number, and `POST /v1/embeddings`
//! with vectors that depend only on each item and the dimensions (see
//! [`embedding_of`]); the same under Azure OpenAI's URLs
//! (`/openai/deployments/{deployment}/...?api-version=V`, with an `api-key`);
//! Anthropic's `POST /v1/messages` (plain or SSE, text, thinking, tool
//! calls, server web search, stop reasons) and
//! `POST /v1/messages/count_tokens`, in Anthropic's shapes; and OpenAI's
//! Responses API, `POST /v1/responses` (reasoning, function, custom and
//! web search items, plain or as typed events), spoken natively. Each face
//! accepts what the real API and its agents (Claude Code, Codex) send and
//! refuses the rest with that API's 400s. OpenAI's Batch API is served on
//! the provider side too: `POST /v1/files`, `POST /v1/batches`, polling and
//! downloading, each line answered as the chat endpoint would (see the
//! `batches` module). All go through the same behaviour: it can be told, by CLI
//! flags at start or by the `/_mock` control API at run time, to be slow, to
//! fail with a chosen status, to drop connections, to answer 200 with
//! garbage or with a padded (large) answer, or to hold requests until a test
//! releases them (in the order the test chooses). It counts every call
//! on arrival, so a test can assert how many upstream calls the gateway made.
//!
//! `answer` builds the chat answers (also used by idem's in-process provider
//! of kind "mock"), `embeddings` the embeddings, `anthropic_request` and
//! `anthropic` the Anthropic face's validation and answers,
//! `responses_request` and `responses` the Responses face's, `seal` the
//! opaque tokens (thinking signatures, encrypted reasoning) the mock checks
//! when they come back, `batches` the Files and Batch endpoints, `state`
//! keeps counters, held requests, files and batches, `routes` is the HTTP
//! surface. None of it uses idem's own request path.

mod answer;
mod anthropic;
mod anthropic_request;
mod batches;
mod embeddings;
mod responses;
mod responses_request;
mod routes;
mod seal;
mod state;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_anthropic;
#[cfg(test)]
mod tests_anthropic_thinking;
#[cfg(test)]
mod tests_azure;
#[cfg(test)]
mod tests_batches;
#[cfg(test)]
mod tests_responses;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::task::JoinHandle;

pub use answer::{completion, completion_chunks};
pub use embeddings::{
    DEFAULT_DIMENSIONS, MAX_DIMENSIONS, MAX_ITEMS, embedding_of, embeddings_answer,
};
use state::Shared;

/// How long [`MockServer::shutdown`] waits for open connections to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Behaviour of the mock, set by CLI flags at start and changeable at run time.
///
/// The order of effects for one request: count and record it; hold it if
/// `hold` or `hang`; sleep `latency_ms` (plus up to `latency_jitter_ms`, plus
/// `stall_ms` with probability `stall_rate`); drop the connection with
/// probability `reset_rate`; fail with `fail_status`; else answer (with
/// `garbage` instead of a chat completion when set, padded to `pad_bytes`
/// when set). Embeddings go through the same steps; `content`, `pad_bytes`
/// and `chunk_delay_ms` do not apply to them. Anthropic's messages go
/// through them too, failing and garbling in Anthropic's shapes, and so do
/// Responses calls, in OpenAI's; token counts too, but `garbage`,
/// `content`, `pad_bytes` and `chunk_delay_ms` do not apply to them.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Behaviour {
    /// Delay before answering (after counting the call and any hold).
    pub latency_ms: u64,
    /// Extra delay, uniform in `0..=latency_jitter_ms`, drawn per call:
    /// concurrent calls then finish in a shuffled (often reversed) order.
    pub latency_jitter_ms: u64,
    /// Probability that a call stalls `stall_ms` longer before answering: a
    /// provider that hangs for a while, then answers.
    pub stall_rate: f64,
    /// How long a stalled call stalls.
    pub stall_ms: u64,
    /// Answer with this status and an error body (OpenAI's, or Anthropic's
    /// on its endpoints) ...
    pub fail_status: Option<u16>,
    /// ... with this probability (0..=1); 0 with `fail_status` set means always.
    pub fail_rate: f64,
    /// Seconds, sent as `Retry-After` on failures.
    pub retry_after: Option<u64>,
    /// Never answer until released by `/_mock/release`, `/_mock/reset` or shutdown.
    pub hang: bool,
    /// Probability to drop the connection without a valid response.
    pub reset_rate: f64,
    /// Fixed assistant content; else `mock answer #<seq> to: <last user message>`.
    pub content: Option<String>,
    /// Delay between SSE chunks when streaming.
    pub chunk_delay_ms: u64,
    /// Hold every request (after counting it) until released; a provider
    /// batch created while it is set (or `hang`) stays `in_progress`, its
    /// lines not run, until released.
    pub hold: bool,
    /// Answer 200 with this kind of garbage instead of a chat completion.
    pub garbage: Option<Garbage>,
    /// Pad the answer's content so that the whole body (the JSON document,
    /// or the whole SSE stream) is at least this many bytes (a few more
    /// than asked, at most about a kilobyte).
    pub pad_bytes: Option<u64>,
}

/// A 200 answer that is not a well-formed chat completion, as a broken
/// provider or an intermediary in front of it sends one (Anthropic's
/// messages and Responses calls have a form of each kind of their own: see
/// the `anthropic` and `responses` modules' `garbage`). For embeddings
/// (which do not stream): `not_json`, `truncated`, `empty` and
/// `error_object` alike, `stream_error` like `error_object`,
/// `empty_choices` a list with `data: []`, `stream_without_done` and
/// `finished_without_done` the answer as one SSE event without `[DONE]`,
/// `done_without_finish` that event followed by `[DONE]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Garbage {
    /// Not JSON: an HTML error page (streamed: an event whose data is not
    /// JSON after a first good chunk).
    NotJson,
    /// The answer cut in the middle: half the JSON document, or half the SSE
    /// stream (ending inside an event, without `[DONE]`).
    Truncated,
    /// An empty body.
    Empty,
    /// A JSON `{"error": ...}` object with the 200 (streamed: a first good
    /// chunk, then `data: {"error": ...}`).
    ErrorObject,
    /// A completion with `choices: []` (streamed: chunks with no choice,
    /// then `[DONE]`).
    EmptyChoices,
    /// An SSE stream (whatever was asked) with the role and content chunks,
    /// then the end of the body: no `finish_reason`, no `[DONE]`.
    StreamWithoutDone,
    /// An SSE stream (whatever was asked) whose every chunk came, finish
    /// reasons included, then the end of the body without `[DONE]`.
    FinishedWithoutDone,
    /// An SSE stream (whatever was asked) with the role and content chunks
    /// and `[DONE]`, but no chunk with a `finish_reason`.
    DoneWithoutFinish,
    /// An error in the stream, as OpenAI sends one on a server error
    /// mid-stream: two chunks, then `data: {"error": ...}`, then `[DONE]`
    /// (plain: like `error_object`).
    StreamError,
}

/// Flags of `idem mock-upstream`.
#[derive(clap::Args, Debug, Clone)]
pub struct MockArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:9001")]
    pub listen: SocketAddr,
    /// Delay before answering, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Extra delay per call, uniform in 0..=N milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_jitter_ms: u64,
    /// Probability that a call stalls `--stall-ms` longer.
    #[arg(long, default_value_t = 0.0)]
    pub stall_rate: f64,
    /// How long a stalled call stalls, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub stall_ms: u64,
    /// Answer with this HTTP status and an error body (OpenAI's, or
    /// Anthropic's on its endpoints).
    #[arg(long)]
    pub fail_status: Option<u16>,
    /// Probability of answering `--fail-status` (0 means always when it is set).
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Seconds sent as `Retry-After` on failures.
    #[arg(long)]
    pub retry_after: Option<u64>,
    /// Never answer (until released through the control API).
    #[arg(long)]
    pub hang: bool,
    /// Probability of dropping the connection without an answer.
    #[arg(long, default_value_t = 0.0)]
    pub reset_rate: f64,
    /// Fixed assistant content instead of the generated one.
    #[arg(long)]
    pub content: Option<String>,
    /// Delay between SSE chunks when streaming, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub chunk_delay_ms: u64,
    /// Hold every request until released through `POST /_mock/release`.
    #[arg(long)]
    pub hold: bool,
    /// Answer 200 with this kind of garbage instead of a chat completion.
    #[arg(long, value_enum)]
    pub garbage: Option<Garbage>,
    /// Pad every answer to at least this many bytes (plain and streamed).
    #[arg(long)]
    pub pad_bytes: Option<u64>,
}

impl MockArgs {
    /// The behaviour these flags ask for.
    pub fn behaviour(&self) -> Behaviour {
        Behaviour {
            latency_ms: self.latency_ms,
            latency_jitter_ms: self.latency_jitter_ms,
            stall_rate: self.stall_rate,
            stall_ms: self.stall_ms,
            fail_status: self.fail_status,
            fail_rate: self.fail_rate,
            retry_after: self.retry_after,
            hang: self.hang,
            reset_rate: self.reset_rate,
            content: self.content.clone(),
            chunk_delay_ms: self.chunk_delay_ms,
            hold: self.hold,
            garbage: self.garbage,
            pad_bytes: self.pad_bytes,
        }
    }
}

/// What the mock has seen, as `GET /_mock/stats` returns it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// Requests to the provider endpoints (OpenAI's and Azure's chat
    /// completions and embeddings, Anthropic's messages and token counts,
    /// the Responses API) that arrived (counted on arrival, before any hold,
    /// latency or failure; invalid bodies and refused credentials
    /// included), and the lines of provider batches answered (see
    /// `batch_lines`). Uploads, batch creations and polls are not calls.
    pub calls: u64,
    /// The embeddings requests among `calls`.
    #[serde(default)]
    pub embedding_calls: u64,
    /// The input items of the valid embeddings requests among them (a string
    /// or a token array is one item).
    #[serde(default)]
    pub embedding_items: u64,
    /// Provider batches created (`POST /v1/batches` answered 200).
    #[serde(default)]
    pub batches: u64,
    /// The lines of provider batches answered, each a call among `calls`
    /// (endpoint `batch_line`), whatever its answer's status; a line that
    /// cannot be read as a request (no JSON object, no `custom_id`, another
    /// method or URL) is not a call and is not counted here.
    #[serde(default)]
    pub batch_lines: u64,
    /// Requests answered with a 2xx status (counted when the answer starts).
    pub completed: u64,
    /// Requests answered with an error status.
    pub failed: u64,
    /// Connections dropped on purpose (`reset_rate`).
    pub resets: u64,
    /// Requests being handled now, streams until their last chunk. A gauge:
    /// a reset does not zero it.
    pub in_flight: u64,
    /// Requests held or hung now.
    pub held: u64,
    /// The last 50 requests, oldest first.
    pub last_requests: Vec<RecordedRequest>,
}

/// One request as the mock received it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedRequest {
    /// Call number, from 1 (again from 1 after a reset).
    pub seq: u64,
    /// The endpoint it was sent to.
    #[serde(default)]
    pub endpoint: Endpoint,
    /// The JSON body (a JSON string holding the raw text if it was not JSON).
    pub body: Value,
    /// The `Authorization` header, if any.
    pub authorization: Option<String>,
    /// The `x-api-key` header (Anthropic's), if any.
    #[serde(default)]
    pub x_api_key: Option<String>,
    /// The `api-key` header (Azure's), if any.
    #[serde(default)]
    pub api_key: Option<String>,
    /// The `anthropic-version` header, if any.
    #[serde(default)]
    pub anthropic_version: Option<String>,
    /// The `anthropic-beta` header, if any.
    #[serde(default)]
    pub anthropic_beta: Option<String>,
    /// The `OpenAI-Beta` header, if any.
    #[serde(default)]
    pub openai_beta: Option<String>,
    /// The deployment named by the URL, on the Azure routes.
    #[serde(default)]
    pub deployment: Option<String>,
    /// The `api-version` query, on the Azure routes (none if it was missing).
    #[serde(default)]
    pub api_version: Option<String>,
    /// Whether the request asked for `"stream": true`.
    pub stream: bool,
}

/// One call in the mock's call log (`GET /_mock/calls`,
/// [`MockServer::calls`]). Unlike `last_requests` the log keeps every call
/// (up to a million), so a test can count upstream calls per prompt and
/// find which call produced an answer (its `seq` is in the answer's
/// content and id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    /// Call number, as in the answer (`mock answer #<seq> ...`); chat
    /// completions and embeddings share the numbering.
    pub seq: u64,
    /// The endpoint it was sent to.
    #[serde(default)]
    pub endpoint: Endpoint,
    /// Arrival, in milliseconds since the Unix epoch.
    pub at_ms: i64,
    /// When the answer (or failure) started, if it did.
    pub done_ms: Option<i64>,
    /// The request's `model`.
    pub model: Option<String>,
    /// The request's `user` field.
    pub user: Option<String>,
    /// The last user message's text, as echoed in the generated answer
    /// (embeddings: the first input item, a token array as its JSON; its
    /// first 200 characters).
    pub prompt: String,
    pub stream: bool,
    /// `pending` (no answer: held, in its latency, or its client left),
    /// `completed`, `failed`, `reset`, `garbage` (a 200 that is no chat
    /// completion or embeddings list) or `padded` (a completion padded to
    /// `pad_bytes`).
    pub outcome: CallOutcome,
    /// The status answered, for `completed` and `failed`.
    pub status: Option<u16>,
    /// The call's `traceparent` header (the caller's trace context), if
    /// it sent one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
}

/// The endpoint a call was sent to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// `POST /v1/chat/completions`, or Azure's
    /// `POST /openai/deployments/{deployment}/chat/completions`.
    #[default]
    ChatCompletions,
    /// `POST /v1/embeddings`, or Azure's
    /// `POST /openai/deployments/{deployment}/embeddings`.
    Embeddings,
    /// Anthropic's `POST /v1/messages`.
    Messages,
    /// Anthropic's `POST /v1/messages/count_tokens`.
    CountTokens,
    /// OpenAI's Responses API, `POST /v1/responses`.
    Responses,
    /// One line of a provider batch (`POST /v1/batches`), answered as
    /// `POST /v1/chat/completions` answers its body.
    BatchLine,
}

/// How a logged call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CallOutcome {
    Pending,
    Completed,
    Failed,
    Reset,
    /// A 200 that is no chat completion or embeddings list (`garbage`).
    Garbage,
    /// A completion padded to `pad_bytes`.
    Padded,
}

/// A running mock upstream, serving in a background tokio task.
pub struct MockServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl MockServer {
    /// Binds `addr` (port 0 allowed) and serves in a background tokio task.
    pub async fn start(addr: SocketAddr, behaviour: Behaviour) -> std::io::Result<MockServer> {
        use axum::serve::ListenerExt;

        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared::new(behaviour));
        let app = routes::router(Arc::clone(&shared));
        let stop = shared.shutdown.clone();
        // Small answers must not wait for Nagle: the mock is a latency baseline.
        let listener = listener.tap_io(|tcp| {
            if let Err(err) = tcp.set_nodelay(true) {
                tracing::debug!(%err, "mock upstream: cannot set TCP_NODELAY");
            }
        });
        let task = tokio::spawn(async move {
            axum::serve(listener, app.into_make_service())
                .with_graceful_shutdown(stop.cancelled_owned())
                .await
        });
        Ok(MockServer {
            addr,
            shared,
            task: Some(task),
        })
    }

    /// The address it listens on (with the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/v1`, the base URL an OpenAI client is given.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The same as `GET /_mock/stats`.
    pub fn stats(&self) -> Stats {
        self.shared.stats()
    }

    /// Every call since the start or the last reset, in arrival order (the
    /// same as `GET /_mock/calls`).
    pub fn calls(&self) -> Vec<CallRecord> {
        self.shared.calls()
    }

    /// Every provider batch since the start or the last reset, oldest
    /// first, as `GET /v1/batches/{id}` shows it now.
    pub fn batches(&self) -> Vec<Value> {
        batches::objects(&self.shared)
    }

    /// Replaces the behaviour; requests already held keep waiting (release them).
    pub fn set_behaviour(&self, b: Behaviour) {
        self.shared.set_behaviour(b);
    }

    /// Stops accepting, releases held and hung requests (they answer
    /// normally, without the remaining latency or chunk delays), and waits up
    /// to 5 s for open connections to finish.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.cancel();
        if let Some(mut task) = self.task.take() {
            match tokio::time::timeout(SHUTDOWN_GRACE, &mut task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(err))) => tracing::warn!(%err, "mock upstream: serve failed"),
                Ok(Err(err)) => tracing::warn!(%err, "mock upstream: serve task failed"),
                Err(_) => {
                    tracing::warn!("mock upstream: connections still open after shutdown grace");
                    task.abort();
                }
            }
        }
    }
}

impl Drop for MockServer {
    /// A server dropped without `shutdown` still stops serving.
    fn drop(&mut self) {
        self.shared.shutdown.cancel();
    }
}

/// CLI entry: serve until SIGINT/SIGTERM, printing the listening address on
/// start as one line `mock-upstream listening on http://ADDR/v1` on stdout.
pub async fn run(args: MockArgs) -> anyhow::Result<()> {
    let server = MockServer::start(args.listen, args.behaviour())
        .await
        .map_err(|err| anyhow::anyhow!("mock-upstream: cannot listen on {}: {err}", args.listen))?;
    // Tests and scripts parse this line; stdout is line-buffered.
    println!("mock-upstream listening on {}", server.base_url());
    tracing::info!(addr = %server.addr(), behaviour = ?args.behaviour(), "mock upstream started");
    let signal = stop_signal().await;
    server.shutdown().await;
    signal
}

/// Resolves on SIGINT or (on Unix) SIGTERM.
async fn stop_signal() -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            result = tokio::signal::ctrl_c() => result?,
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    tokio::signal::ctrl_c().await?;
    Ok(())
}
