//! What the chaos run records, and what the checker reads: every client
//! operation and its answer, the faults injected, and the final state of the
//! database, the mock provider's call log and the replicas.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use idem::mock_upstream::CallRecord;
use serde_json::Value;

/// Milliseconds since the Unix epoch: the clock the replicas write into the
/// database and the mock writes into its call log (one machine, one clock).
pub fn now_ms() -> i64 {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpKind {
    /// `POST /v1/jobs` with an `Idempotency-Key`.
    CreateJob,
    /// `GET /v1/jobs/{id}`.
    GetJob,
    /// `POST /v1/chat/completions`, plain.
    Chat,
    /// `POST /v1/chat/completions` with `"stream": true`.
    ChatStream,
    /// `POST /v1/chat/completions` with an `Idempotency-Key`: a job that
    /// the request waits for.
    ChatWithKey,
}

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::CreateJob => "create_job",
            OpKind::GetJob => "get_job",
            OpKind::Chat => "chat",
            OpKind::ChatStream => "chat_stream",
            OpKind::ChatWithKey => "chat_with_key",
        }
    }

    /// Requests that create (or find) a job by its idempotency key.
    pub fn creates_job(self) -> bool {
        matches!(self, OpKind::CreateJob | OpKind::ChatWithKey)
    }
}

/// An answer as a client received it: the mock's content is
/// `mock answer #<seq> to: <echo>`, so it names the upstream call that
/// produced it and the prompt that call carried.
#[derive(Debug, Clone, PartialEq)]
pub struct Seen {
    pub seq: u64,
    pub echo: String,
    /// The answer's `model` (the upstream model of the target that answered).
    pub model: String,
    pub content: String,
}

impl Seen {
    /// Reads a plain `chat.completion` document.
    pub fn of_completion(v: &Value) -> Option<Seen> {
        let content = v["choices"][0]["message"]["content"].as_str()?;
        Seen::of_content(content, v["model"].as_str().unwrap_or_default())
    }

    pub fn of_content(content: &str, model: &str) -> Option<Seen> {
        let rest = content.strip_prefix("mock answer #")?;
        let (seq, echo) = rest.split_once(" to: ")?;
        Some(Seen {
            seq: seq.parse().ok()?,
            echo: echo.to_string(),
            model: model.to_string(),
            content: content.to_string(),
        })
    }
}

/// One client operation and its outcome.
#[derive(Debug, Clone)]
pub struct Op {
    pub kind: OpKind,
    pub tenant: &'static str,
    /// Which replica (0..3) it was sent to.
    pub replica: usize,
    /// The idempotency key (jobs).
    pub key: Option<String>,
    /// The payload variant: 0 is the intent's own payload, 1 a changed one
    /// (the client reused the key for something else).
    pub variant: u8,
    /// The `POST /v1/jobs` body, or the chat completion body.
    pub payload: Value,
    /// The prompt the request carried (its last user message).
    pub prompt: String,
    /// The chat wave it belongs to.
    pub wave: Option<usize>,
    /// HTTP status; 0 when the request or its body failed in transit.
    pub status: u16,
    /// The OpenAI error code, for errors.
    pub code: Option<String>,
    /// What went wrong in transit, for status 0.
    pub transport: Option<String>,
    pub job_id: Option<String>,
    /// `Idempotent-Replayed: true`.
    pub replayed: bool,
    /// `Idem-Outcome`.
    pub outcome: Option<String>,
    /// The job's fingerprint as the API showed it.
    pub fingerprint: Option<String>,
    /// The job's state as the API showed it.
    pub job_state: Option<String>,
    /// The answer delivered (a chat completion, or a job's result).
    pub seen: Option<Seen>,
    pub start_ms: i64,
    pub end_ms: i64,
}

impl Op {
    pub fn new(kind: OpKind, tenant: &'static str, replica: usize, payload: Value) -> Op {
        let prompt = prompt_of(&payload);
        Op {
            kind,
            tenant,
            replica,
            key: None,
            variant: 0,
            payload,
            prompt,
            wave: None,
            status: 0,
            code: None,
            transport: None,
            job_id: None,
            replayed: false,
            outcome: None,
            fingerprint: None,
            job_state: None,
            seen: None,
            start_ms: now_ms(),
            end_ms: 0,
        }
    }
}

/// The last user message of a chat body or of a jobs body's request.
pub fn prompt_of(payload: &Value) -> String {
    let body = if payload.get("request").is_some() {
        &payload["request"]
    } else {
        payload
    };
    body["messages"]
        .as_array()
        .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_string()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultKind {
    /// SIGKILL of a replica, until its restart.
    Kill(usize),
    /// SIGSTOP of a replica past its leases, until its SIGCONT.
    Pause(usize),
    /// Redis stopped, until it was started again.
    RedisDown,
    /// PostgreSQL restarted (down for the interval).
    PgRestart,
    /// The mock provider misbehaving in one way for the interval.
    Provider(String),
    /// Not injected: Redis operations that failed on a replica (its
    /// `idem_redis_errors_total` grew by this much in the interval), for
    /// example timeouts under load. Each made that replica coalesce locally
    /// once, as docs/design.md says it must.
    RedisErrors { replica: usize, count: u64 },
}

/// One fault the nemesis injected, with its interval.
#[derive(Debug, Clone)]
pub struct Fault {
    pub kind: FaultKind,
    pub from_ms: i64,
    pub until_ms: i64,
}

/// One wave of identical chat completions (per tenant: its own fingerprint).
#[derive(Debug, Clone)]
pub struct Wave {
    pub id: usize,
    pub tenants: Vec<&'static str>,
    pub prompt: String,
    pub from_ms: i64,
    pub until_ms: i64,
}

/// A job row, as the checker reads it from the database.
#[derive(Debug, Clone)]
pub struct JobRow {
    pub id: String,
    pub tenant: String,
    pub key: String,
    pub payload_hash: String,
    pub fingerprint: String,
    pub request: Value,
    pub metadata: Option<Value>,
    pub state: String,
    pub completed_by: Option<i32>,
    pub result: Option<Value>,
    pub created_at: i64,
}

/// An attempt row.
#[derive(Debug, Clone)]
pub struct AttemptRow {
    pub job_id: String,
    pub n: i32,
    pub model: String,
    pub state: String,
    pub reason: Option<String>,
    pub hedge: bool,
    pub started_at: i64,
    pub finished_at: Option<i64>,
}

impl AttemptRow {
    /// `starting`, `running` and `unknown` hold the job (docs/design.md, "Jobs and attempts").
    pub fn is_active(&self) -> bool {
        matches!(self.state.as_str(), "starting" | "running" | "unknown")
    }
}

/// What was left once the run was quiet.
#[derive(Debug, Clone, Default)]
pub struct Quiet {
    /// `*:flight:*` keys under the run's Redis prefix.
    pub flight_keys: Vec<String>,
    /// `inflight_flights` per replica.
    pub inflight: Vec<u64>,
}

/// Everything the checker reads.
#[derive(Debug, Clone, Default)]
pub struct History {
    pub ops: Vec<Op>,
    pub faults: Vec<Fault>,
    pub waves: Vec<Wave>,
    pub jobs: Vec<JobRow>,
    pub attempts: Vec<AttemptRow>,
    pub calls: Vec<CallRecord>,
    pub quiet: Quiet,
    /// Replicas in the cluster (the bound on local leaders in an outage).
    pub replicas: usize,
    /// Each replica process's highest resident memory.
    pub memory: Vec<Memory>,
    /// The hostile client's requests.
    pub hostile: Vec<Hostile>,
}

/// A replica process's highest resident memory seen (`VmHWM`).
#[derive(Debug, Clone)]
pub struct Memory {
    pub replica: usize,
    pub pid: u32,
    pub peak: u64,
    /// When that peak was first seen.
    pub at_ms: i64,
}

/// One request of the hostile client: a worst-case body or a turn of a
/// long conversation, and what it got.
#[derive(Debug, Clone)]
pub struct Hostile {
    pub path: &'static str,
    /// `values` (past the JSON values budget), `parsed` (just under it) or
    /// `turn` (of a conversation).
    pub what: &'static str,
    /// The turn of a conversation (1: its first request), else 0.
    pub turn: usize,
    /// 0: a transport error (a replica killed, a refused body's connection
    /// closed before it was all sent).
    pub status: u16,
    pub code: Option<String>,
}

/// The shared recorder the fleet and the nemesis write into.
#[derive(Default)]
pub struct Recorder {
    pub ops: Mutex<Vec<Op>>,
    pub faults: Mutex<Vec<Fault>>,
    pub waves: Mutex<Vec<Wave>>,
    pub memory: Mutex<Vec<Memory>>,
    pub hostile: Mutex<Vec<Hostile>>,
}

impl Recorder {
    pub fn op(&self, mut op: Op) {
        op.end_ms = now_ms();
        self.ops.lock().unwrap().push(op);
    }

    pub fn fault(&self, f: Fault) {
        self.faults.lock().unwrap().push(f);
    }

    pub fn wave(&self, w: Wave) {
        self.waves.lock().unwrap().push(w);
    }

    pub fn memory(&self, m: Memory) {
        self.memory.lock().unwrap().push(m);
    }

    pub fn hostile(&self, h: Hostile) {
        self.hostile.lock().unwrap().push(h);
    }
}
