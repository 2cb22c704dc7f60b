//! The history checker: reads what the chaos run recorded (every client
//! operation and answer, the faults, the database, the mock's call log, what
//! was left once quiet) and lists every violation of idem's promises.
//!
//! Each rule is a function of the [`History`] alone, so the unit tests at the
//! bottom feed it small hand-written histories that break one rule each and
//! assert that the checker flags them (and passes the clean one).
//!
//! The upstream-call bound (docs/design.md, "Coalescing and the caches"), per wave, per tenant (one
//! fingerprint) and per target model: the first call is free; every further
//! call must be paid for by one of
//! - a fault overlapping the wave (from 3 s before it): a Redis outage pays
//!   for one call per replica (each replica coalesces locally while Redis is
//!   unreachable and until it reconnects), a replica kill for one takeover;
//! - a Redis operation that failed on a replica during the wave (from 0.5 s
//!   before it), injected or not (a timeout under load): the replica then
//!   coalesces locally, one call (or one lost completion, hence one takeover);
//! - an earlier call of the same group that did not succeed, once its
//!   negative cache entry has expired: 2 s after a 429 (`rate_limit_ttl`,
//!   raised by a Retry-After of 1 s to no more), 10 s after a 500 or a reset
//!   (`server_error_ttl`), at once for a call that never answered (its
//!   replica died, nothing was cached).
//!
//! Jobs do not share fingerprints with waves (each job's prompt names its
//! key), so their calls are bounded by their attempts instead: at most one
//! upstream call per attempt on that model.

use std::collections::{BTreeMap, HashMap, HashSet};

use idem::mock_upstream::{CallOutcome, CallRecord};
use serde_json::Value;

use crate::cluster::MAX_CONVERSATION_BYTES;
use crate::fleet::TURN_INPUT_BYTES;
use crate::helpers::MEMORY_CEILING;
use crate::history::{AttemptRow, FaultKind, History, JobRow, OpKind, Seen, prompt_of};

/// Tolerance on timestamps taken by different processes (ms).
const CLOCK_SLACK_MS: i64 = 250;
/// A fault this long before a wave still pays for its extra calls: the
/// replicas reconnect to Redis, and a killed leader's lease runs out, within it.
const FAULT_REACH_MS: i64 = 3_000;
/// A Redis error this long before a wave still pays (its request may have
/// been on its way).
const REDIS_ERROR_REACH_MS: i64 = 500;
/// Negative cache lifetimes of the chaos config (`[routes.cache]`).
pub const RATE_LIMIT_TTL_MS: i64 = 2_000;
pub const SERVER_ERROR_TTL_MS: i64 = 10_000;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub rule: &'static str,
    pub detail: String,
}

fn v(rule: &'static str, detail: String) -> Violation {
    Violation { rule, detail }
}

/// Every violation in the history (empty: every promise held).
pub fn check(h: &History) -> Vec<Violation> {
    let mut out = Vec::new();
    let calls: HashMap<u64, &CallRecord> = h.calls.iter().map(|c| (c.seq, c)).collect();
    one_job_per_key(h, &mut out);
    single_winner(h, &mut out);
    result_is_the_winners_answer(h, &calls, &mut out);
    no_overlapping_attempts(h, &mut out);
    conflicts_change_nothing(h, &mut out);
    answers_stay_with_their_tenant(h, &calls, &mut out);
    garbage_is_never_a_success(h, &calls, &mut out);
    nothing_left_behind(h, &mut out);
    upstream_calls_bounded(h, &mut out);
    one_answer_per_flight(h, &mut out);
    job_calls_bounded_by_attempts(h, &mut out);
    memory_bounded(h, &mut out);
    hostile_input_bounded(h, &mut out);
    out
}

/// No replica process ever holds more than the documented ceiling
/// (SECURITY.md, "Bounds"), hostile bodies and long conversations
/// included.
fn memory_bounded(h: &History, out: &mut Vec<Violation>) {
    for m in &h.memory {
        if m.peak >= MEMORY_CEILING {
            out.push(v(
                "memory_bounded",
                format!(
                    "replica {} (pid {}) reached {} MiB at {}, past the {} MiB bound",
                    m.replica,
                    m.pid,
                    m.peak >> 20,
                    m.at_ms,
                    MEMORY_CEILING >> 20
                ),
            ));
        }
    }
}

/// A hostile request is refused by its bound or served, never an internal
/// error: a body past the JSON values budget is never answered 200, and a
/// conversation whose stored turns already pass
/// `responses.max_conversation_bytes` is never continued.
fn hostile_input_bounded(h: &History, out: &mut Vec<Violation>) {
    for r in &h.hostile {
        // A provider's 500 passes through (the nemesis sends them); idem's
        // own internal error is `internal_error`.
        let problem = if r.code.as_deref() == Some("internal_error") {
            Some("an internal error")
        } else if r.what == "values" && r.status == 200 {
            Some("a 200 for a body past the JSON values budget")
        } else if r.what == "turn"
            && r.status == 200
            && (r.turn - 1) * TURN_INPUT_BYTES > MAX_CONVERSATION_BYTES
        {
            Some("a 200 for a conversation past responses.max_conversation_bytes")
        } else {
            None
        };
        if let Some(problem) = problem {
            out.push(v(
                "hostile_input_bounded",
                format!(
                    "{} {} (turn {}): {problem} ({} {:?})",
                    r.path, r.what, r.turn, r.status, r.code
                ),
            ));
        }
    }
}

fn jobs_by_key(h: &History) -> HashMap<(&str, &str), Vec<&JobRow>> {
    let mut m: HashMap<(&str, &str), Vec<&JobRow>> = HashMap::new();
    for j in &h.jobs {
        m.entry((j.tenant.as_str(), j.key.as_str()))
            .or_default()
            .push(j);
    }
    m
}

/// One job per (tenant, key); every job a client was told about exists.
fn one_job_per_key(h: &History, out: &mut Vec<Violation>) {
    let by_key = jobs_by_key(h);
    for ((tenant, key), jobs) in &by_key {
        if jobs.len() > 1 {
            out.push(v(
                "one_job_per_key",
                format!("{tenant}/{key}: {} jobs in the database", jobs.len()),
            ));
        }
    }
    let mut acked: BTreeMap<(&str, &str), HashSet<&str>> = BTreeMap::new();
    let mut created: BTreeMap<(&str, &str), usize> = BTreeMap::new();
    for op in h.ops.iter().filter(|o| o.kind.creates_job()) {
        let (Some(key), Some(id)) = (&op.key, &op.job_id) else {
            continue;
        };
        if !(200..300).contains(&op.status) {
            continue;
        }
        acked
            .entry((op.tenant, key.as_str()))
            .or_default()
            .insert(id.as_str());
        if op.status == 201 {
            *created.entry((op.tenant, key.as_str())).or_default() += 1;
        }
    }
    for ((tenant, key), ids) in &acked {
        if ids.len() > 1 {
            out.push(v(
                "one_job_per_key",
                format!(
                    "{tenant}/{key}: clients were given {} job ids: {ids:?}",
                    ids.len()
                ),
            ));
        }
        for id in ids {
            let stored = by_key
                .get(&(*tenant, *key))
                .is_some_and(|jobs| jobs.iter().any(|j| j.id == *id));
            if !stored {
                out.push(v(
                    "acknowledged_job_lost",
                    format!("{tenant}/{key}: job {id} was acknowledged but is not in the database"),
                ));
            }
        }
    }
    for ((tenant, key), n) in created {
        if n > 1 {
            out.push(v(
                "one_job_per_key",
                format!("{tenant}/{key}: {n} answers said 201 Created"),
            ));
        }
    }
}

fn attempts_of(h: &History) -> HashMap<&str, Vec<&AttemptRow>> {
    let mut m: HashMap<&str, Vec<&AttemptRow>> = HashMap::new();
    for a in &h.attempts {
        m.entry(a.job_id.as_str()).or_default().push(a);
    }
    for list in m.values_mut() {
        list.sort_by_key(|a| a.n);
    }
    m
}

/// No job with two completing attempts; `completed_by` names the one.
fn single_winner(h: &History, out: &mut Vec<Violation>) {
    let attempts = attempts_of(h);
    for j in &h.jobs {
        let list = attempts.get(j.id.as_str()).cloned().unwrap_or_default();
        let won: Vec<i32> = list
            .iter()
            .filter(|a| a.state == "succeeded")
            .map(|a| a.n)
            .collect();
        if won.len() > 1 {
            out.push(v(
                "single_winner",
                format!("job {}: attempts {won:?} all succeeded", j.id),
            ));
        }
        match (j.state.as_str(), j.completed_by) {
            ("succeeded", Some(n)) => {
                if won != [n] {
                    out.push(v(
                        "single_winner",
                        format!(
                            "job {}: completed_by {n} but succeeded attempts are {won:?}",
                            j.id
                        ),
                    ));
                }
            }
            ("succeeded", None) => out.push(v(
                "single_winner",
                format!("job {}: succeeded without completed_by", j.id),
            )),
            (state, by) => {
                if by.is_some() || !won.is_empty() {
                    out.push(v(
                        "single_winner",
                        format!(
                            "job {}: state {state}, completed_by {by:?}, succeeded attempts {won:?}",
                            j.id
                        ),
                    ));
                }
            }
        }
    }
}

/// A job's prompt: its request's last user message.
fn job_prompt(j: &JobRow) -> String {
    prompt_of(&j.request)
}

/// Every succeeded job's result is the answer the mock produced for a call
/// of its winning attempt: same prompt, same model, a call that succeeded
/// and arrived before the attempt finished. Every result a client saw is
/// the final one (a result never changes).
fn result_is_the_winners_answer(
    h: &History,
    calls: &HashMap<u64, &CallRecord>,
    out: &mut Vec<Violation>,
) {
    let attempts = attempts_of(h);
    let by_id: HashMap<&str, &JobRow> = h.jobs.iter().map(|j| (j.id.as_str(), j)).collect();
    for j in h.jobs.iter().filter(|j| j.state == "succeeded") {
        let Some(result) = &j.result else {
            out.push(v(
                "result_is_the_winners_answer",
                format!("job {}: succeeded without a result", j.id),
            ));
            continue;
        };
        let Some(seen) = Seen::of_completion(result) else {
            out.push(v(
                "result_is_the_winners_answer",
                format!("job {}: result is not a mock answer: {result}", j.id),
            ));
            continue;
        };
        let winner = attempts
            .get(j.id.as_str())
            .and_then(|l| l.iter().find(|a| Some(a.n) == j.completed_by));
        let Some(winner) = winner else {
            continue; // single_winner reports it
        };
        let prompt = job_prompt(j);
        let problem = match calls.get(&seen.seq) {
            None => Some(format!("call #{} is not in the mock's log", seen.seq)),
            Some(c) if c.outcome != CallOutcome::Completed => {
                Some(format!("call #{} did not succeed ({:?})", c.seq, c.outcome))
            }
            Some(c) if c.prompt != prompt || seen.echo != prompt => Some(format!(
                "call #{} was for {:?}, the job's prompt is {prompt:?}",
                c.seq, c.prompt
            )),
            Some(c) if c.model.as_deref() != Some(winner.model.as_str()) => Some(format!(
                "call #{} went to {:?}, the winning attempt {} to {}",
                c.seq, c.model, winner.n, winner.model
            )),
            Some(_) if seen.model != winner.model => Some(format!(
                "the result names model {}, the winning attempt {} used {}",
                seen.model, winner.n, winner.model
            )),
            Some(c)
                if winner
                    .finished_at
                    .is_some_and(|f| c.at_ms > f + CLOCK_SLACK_MS) =>
            {
                Some(format!(
                    "call #{} arrived after the winning attempt {} finished",
                    c.seq, winner.n
                ))
            }
            Some(c) if c.at_ms + CLOCK_SLACK_MS < j.created_at => Some(format!(
                "call #{} arrived before the job was created",
                c.seq
            )),
            Some(_) => None,
        };
        if let Some(p) = problem {
            out.push(v(
                "result_is_the_winners_answer",
                format!("job {}: {p}", j.id),
            ));
        }
    }
    for op in &h.ops {
        if !matches!(
            op.kind,
            OpKind::GetJob | OpKind::CreateJob | OpKind::ChatWithKey
        ) {
            continue;
        }
        let (Some(id), Some(seen)) = (&op.job_id, &op.seen) else {
            continue;
        };
        let Some(j) = by_id.get(id.as_str()) else {
            continue;
        };
        let final_seen = j.result.as_ref().and_then(Seen::of_completion);
        if final_seen.as_ref() != Some(seen) {
            out.push(v(
                "result_never_changes",
                format!(
                    "job {id}: a client saw {:?}, the final result is {:?}",
                    seen.content,
                    final_seen.map(|s| s.content)
                ),
            ));
        }
    }
}

/// No attempt starts while another attempt of its job is `starting`,
/// `running` or `unknown`, except a hedge, which may start while exactly one
/// other attempt is in flight.
fn no_overlapping_attempts(h: &History, out: &mut Vec<Violation>) {
    for (job, list) in attempts_of(h) {
        for (i, a) in list.iter().enumerate() {
            if a.n != i as i32 + 1 {
                out.push(v(
                    "no_overlapping_attempts",
                    format!("job {job}: attempt numbers are not 1..: {}", a.n),
                ));
            }
        }
        for b in &list {
            let live: Vec<i32> = list
                .iter()
                .filter(|a| a.n < b.n && a.started_at <= b.started_at)
                .filter(|a| {
                    // An attempt still active holds the job for ever; a
                    // finished one until its last transition.
                    a.is_active() || a.finished_at.is_none_or(|f| f > b.started_at)
                })
                .map(|a| a.n)
                .collect();
            let allowed = usize::from(b.hedge);
            if live.len() > allowed {
                out.push(v(
                    "no_overlapping_attempts",
                    format!(
                        "job {job}: attempt {}{} started while attempts {live:?} were in flight",
                        b.n,
                        if b.hedge { " (hedge)" } else { "" }
                    ),
                ));
            }
        }
    }
}

/// A 409 `idempotency_key_reused` changes nothing: the job keeps the payload
/// of the request that created it; a changed payload is never accepted.
fn conflicts_change_nothing(h: &History, out: &mut Vec<Violation>) {
    let by_key = jobs_by_key(h);
    for op in h.ops.iter().filter(|o| o.kind.creates_job()) {
        let Some(key) = &op.key else { continue };
        let job = by_key
            .get(&(op.tenant, key.as_str()))
            .and_then(|l| l.first());
        let same = job.is_some_and(|j| same_payload(j, &op.payload));
        match op.status {
            409 => {
                if job.is_none() {
                    out.push(v(
                        "conflict_changes_nothing",
                        format!("{}/{key}: 409 but no job has this key", op.tenant),
                    ));
                } else if same {
                    out.push(v(
                        "conflict_changes_nothing",
                        format!(
                            "{}/{key}: 409 for the job's own payload (variant {})",
                            op.tenant, op.variant
                        ),
                    ));
                }
            }
            200..=299 if !same => out.push(v(
                "conflict_changes_nothing",
                format!(
                    "{}/{key}: a payload (variant {}) was accepted that is not the job's",
                    op.tenant, op.variant
                ),
            )),
            200..=299 => {
                if let (Some(j), Some(fp)) = (job, &op.fingerprint)
                    && j.fingerprint != *fp
                {
                    out.push(v(
                        "conflict_changes_nothing",
                        format!(
                            "{}/{key}: the job's fingerprint changed from {fp} to {}",
                            op.tenant, j.fingerprint
                        ),
                    ));
                }
            }
            _ => {}
        }
    }
    // All the payload hashes one (tenant, key) was answered 2xx with: one job,
    // one hash (a second hash would mean the row was rewritten).
    for ((tenant, key), jobs) in &by_key {
        let hashes: HashSet<&str> = jobs.iter().map(|j| j.payload_hash.as_str()).collect();
        if hashes.len() > 1 {
            out.push(v(
                "conflict_changes_nothing",
                format!("{tenant}/{key}: payload hashes {hashes:?}"),
            ));
        }
    }
}

fn same_payload(j: &JobRow, payload: &Value) -> bool {
    let metadata = match payload.get("metadata") {
        None | Some(Value::Null) => None,
        Some(m) => Some(m.clone()),
    };
    j.request == payload["request"] && j.metadata == metadata
}

/// Every answer a client received was produced for its own request: the
/// call that produced it carried this tenant (`user`) and this prompt.
fn answers_stay_with_their_tenant(
    h: &History,
    calls: &HashMap<u64, &CallRecord>,
    out: &mut Vec<Violation>,
) {
    for op in &h.ops {
        let chat = matches!(op.kind, OpKind::Chat | OpKind::ChatStream);
        if chat && op.status == 200 && op.seen.is_none() {
            out.push(v(
                "answers_stay_with_their_tenant",
                format!(
                    "{} by {} on replica {}: a 200 without a readable answer: {:?}",
                    op.kind.name(),
                    op.tenant,
                    op.replica,
                    op.transport
                ),
            ));
        }
        let Some(seen) = &op.seen else { continue };
        let problem = match calls.get(&seen.seq) {
            None => Some(format!("call #{} is not in the mock's log", seen.seq)),
            Some(c) if c.user.as_deref() != Some(op.tenant) => {
                Some(format!("call #{} was made for tenant {:?}", c.seq, c.user))
            }
            Some(c) if c.prompt != op.prompt || seen.echo != op.prompt => Some(format!(
                "call #{} answered {:?}, the request asked {:?}",
                c.seq, c.prompt, op.prompt
            )),
            // Garbage and oversized answers have a rule of their own.
            Some(c) if is_garbage(c) => None,
            Some(c) if c.outcome != CallOutcome::Completed => {
                Some(format!("call #{} did not succeed ({:?})", c.seq, c.outcome))
            }
            Some(_) => None,
        };
        if let Some(p) = problem {
            out.push(v(
                "answers_stay_with_their_tenant",
                format!(
                    "{} by {} on replica {} at {}: {p}",
                    op.kind.name(),
                    op.tenant,
                    op.replica,
                    op.start_ms
                ),
            ));
        }
    }
}

/// A 200 that was no chat completion, or an answer past the providers'
/// `max_answer_bytes`.
fn is_garbage(c: &CallRecord) -> bool {
    matches!(c.outcome, CallOutcome::Garbage | CallOutcome::Padded)
}

/// No answer that was garbage (a 200 that is no chat completion) or past
/// the size limit reached a client as a success, or became a job's result.
fn garbage_is_never_a_success(
    h: &History,
    calls: &HashMap<u64, &CallRecord>,
    out: &mut Vec<Violation>,
) {
    for op in h.ops.iter().filter(|o| (200..300).contains(&o.status)) {
        if let Some(c) = op.seen.as_ref().and_then(|s| calls.get(&s.seq))
            && is_garbage(c)
        {
            out.push(v(
                "garbage_is_never_a_success",
                format!(
                    "{} by {} on replica {} at {}: got call #{} ({:?}) as a {}",
                    op.kind.name(),
                    op.tenant,
                    op.replica,
                    op.start_ms,
                    c.seq,
                    c.outcome,
                    op.status
                ),
            ));
        }
    }
    for j in h.jobs.iter().filter(|j| j.state == "succeeded") {
        if let Some(c) = j
            .result
            .as_ref()
            .and_then(Seen::of_completion)
            .and_then(|s| calls.get(&s.seq))
            && is_garbage(c)
        {
            out.push(v(
                "garbage_is_never_a_success",
                format!(
                    "job {}: its result is call #{} ({:?})",
                    j.id, c.seq, c.outcome
                ),
            ));
        }
    }
}

/// Once quiet: no flight record in Redis, no flight in any replica, no
/// attempt `starting`/`running`, and every job settled.
fn nothing_left_behind(h: &History, out: &mut Vec<Violation>) {
    for k in &h.quiet.flight_keys {
        out.push(v("nothing_left_behind", format!("redis flight key {k}")));
    }
    for (i, n) in h.quiet.inflight.iter().enumerate() {
        if *n > 0 {
            out.push(v(
                "nothing_left_behind",
                format!("replica {i}: {n} flights in progress"),
            ));
        }
    }
    for a in &h.attempts {
        if matches!(a.state.as_str(), "starting" | "running") {
            out.push(v(
                "nothing_left_behind",
                format!("job {} attempt {} still {}", a.job_id, a.n, a.state),
            ));
        }
    }
    for j in &h.jobs {
        if matches!(j.state.as_str(), "queued" | "running") {
            out.push(v(
                "nothing_left_behind",
                format!("job {} ({}/{}) still {}", j.id, j.tenant, j.key, j.state),
            ));
        }
    }
}

/// How long a failed call keeps the next one away (its negative cache).
fn negative_ttl(c: &CallRecord) -> i64 {
    match (c.outcome, c.status) {
        (CallOutcome::Failed, Some(429)) => RATE_LIMIT_TTL_MS,
        (CallOutcome::Failed, _) | (CallOutcome::Reset, _) => SERVER_ERROR_TTL_MS,
        // Garbage and oversized answers are cached like a 5xx.
        (CallOutcome::Garbage | CallOutcome::Padded, _) => SERVER_ERROR_TTL_MS,
        // Never answered: its replica died; nothing was cached.
        _ => 0,
    }
}

/// The bound of the module documentation, per wave, tenant and model.
fn upstream_calls_bounded(h: &History, out: &mut Vec<Violation>) {
    for w in &h.waves {
        let mut permits = 0usize;
        let mut why = Vec::new();
        for f in &h.faults {
            let reach = match f.kind {
                FaultKind::RedisErrors { .. } => REDIS_ERROR_REACH_MS,
                _ => FAULT_REACH_MS,
            };
            if f.until_ms < w.from_ms - reach || f.from_ms > w.until_ms {
                continue;
            }
            match &f.kind {
                FaultKind::RedisErrors { replica, count } => {
                    permits += usize::try_from(*count).unwrap_or(usize::MAX);
                    why.push(format!("{count} redis errors on replica {replica}"));
                }
                FaultKind::RedisDown => {
                    permits += h.replicas;
                    why.push("redis down".to_string());
                }
                FaultKind::Kill(r) => {
                    permits += 1;
                    why.push(format!("replica {r} killed"));
                }
                FaultKind::Pause(r) => {
                    permits += 1;
                    why.push(format!("replica {r} paused"));
                }
                FaultKind::PgRestart | FaultKind::Provider(_) => {}
            }
        }
        for tenant in &w.tenants {
            let mut groups: BTreeMap<Option<&str>, Vec<&CallRecord>> = BTreeMap::new();
            for c in h
                .calls
                .iter()
                .filter(|c| c.prompt == w.prompt && c.user.as_deref() == Some(*tenant))
            {
                groups.entry(c.model.as_deref()).or_default().push(c);
            }
            for (model, mut list) in groups {
                list.sort_by_key(|c| c.at_ms);
                let mut fault_permits = permits;
                let mut failed: Vec<&CallRecord> = Vec::new();
                for (i, c) in list.iter().enumerate() {
                    if i > 0 {
                        // Spend an expired negative entry first, then a fault.
                        let paid = failed.iter().position(|f| {
                            let end = f.done_ms.unwrap_or(f.at_ms);
                            c.at_ms + CLOCK_SLACK_MS >= end + negative_ttl(f)
                        });
                        if let Some(p) = paid {
                            failed.remove(p);
                        } else if fault_permits > 0 {
                            fault_permits -= 1;
                        } else {
                            let seqs: Vec<String> = list
                                .iter()
                                .map(|c| format!("#{} {:?}@{}", c.seq, c.outcome, c.at_ms))
                                .collect();
                            out.push(v(
                                "upstream_calls_bounded",
                                format!(
                                    "wave {} ({tenant}, {}): {} calls to {model:?} exceed the bound \
                                     (faults: {why:?}); calls: {}",
                                    w.id,
                                    w.prompt,
                                    list.len(),
                                    seqs.join(", ")
                                ),
                            ));
                            break;
                        }
                    }
                    if c.outcome != CallOutcome::Completed {
                        failed.push(c);
                    }
                }
            }
        }
    }
}

/// Calls of one wave, tenant and model that overlapped in time (the later
/// one started before the earlier one answered) belong to one flight: the
/// later one is a take-over of a leader that died or paused. Unless Redis
/// failed around the wave (each replica then coalesces on its own, and
/// may answer with its own call), clients of that flight all get one
/// answer: at most one of those calls may reach any client.
fn one_answer_per_flight(h: &History, out: &mut Vec<Violation>) {
    for w in &h.waves {
        let degraded = h.faults.iter().any(|f| {
            let reach = match f.kind {
                FaultKind::RedisErrors { .. } => REDIS_ERROR_REACH_MS,
                FaultKind::RedisDown => FAULT_REACH_MS,
                _ => return false,
            };
            f.until_ms >= w.from_ms - reach && f.from_ms <= w.until_ms
        });
        if degraded {
            continue;
        }
        for tenant in &w.tenants {
            let mut groups: BTreeMap<Option<&str>, Vec<&CallRecord>> = BTreeMap::new();
            for c in h.calls.iter().filter(|c| {
                c.prompt == w.prompt
                    && c.user.as_deref() == Some(*tenant)
                    && c.outcome == CallOutcome::Completed
            }) {
                groups.entry(c.model.as_deref()).or_default().push(c);
            }
            for (model, mut list) in groups {
                list.sort_by_key(|c| c.at_ms);
                // Runs of overlapping calls: one flight each.
                let mut flights: Vec<(i64, Vec<u64>)> = Vec::new();
                for c in list {
                    let end = c.done_ms.unwrap_or(i64::MAX);
                    match flights.last_mut() {
                        Some((until, seqs)) if c.at_ms < *until => {
                            *until = (*until).max(end);
                            seqs.push(c.seq);
                        }
                        _ => flights.push((end, vec![c.seq])),
                    }
                }
                for (_, seqs) in flights.iter().filter(|(_, s)| s.len() > 1) {
                    let reached: BTreeMap<u64, usize> = h
                        .ops
                        .iter()
                        .filter(|o| o.tenant == *tenant && o.prompt == w.prompt)
                        .filter_map(|o| o.seen.as_ref().map(|s| s.seq))
                        .filter(|s| seqs.contains(s))
                        .fold(BTreeMap::new(), |mut m, s| {
                            *m.entry(s).or_default() += 1;
                            m
                        });
                    if reached.len() > 1 {
                        out.push(v(
                            "one_answer_per_flight",
                            format!(
                                "wave {} ({tenant}, {model:?}): the overlapping calls {seqs:?} of \
                                 one flight all reached clients (call: clients) {reached:?}",
                                w.id
                            ),
                        ));
                    }
                }
            }
        }
    }
}

/// A job's upstream calls (its prompt is its own) are at most one per
/// attempt on each model.
fn job_calls_bounded_by_attempts(h: &History, out: &mut Vec<Violation>) {
    let attempts = attempts_of(h);
    let mut calls_by_prompt: HashMap<(&str, Option<&str>), usize> = HashMap::new();
    for c in &h.calls {
        *calls_by_prompt
            .entry((c.prompt.as_str(), c.model.as_deref()))
            .or_default() += 1;
    }
    for j in &h.jobs {
        let prompt = job_prompt(j);
        let list = attempts.get(j.id.as_str()).cloned().unwrap_or_default();
        let models: HashSet<&str> = list.iter().map(|a| a.model.as_str()).collect();
        for model in models {
            let tries = list.iter().filter(|a| a.model == model).count();
            let made = calls_by_prompt
                .get(&(prompt.as_str(), Some(model)))
                .copied()
                .unwrap_or(0);
            if made > tries {
                out.push(v(
                    "job_calls_bounded_by_attempts",
                    format!("job {}: {made} calls to {model} for {tries} attempts", j.id),
                ));
            }
        }
    }
}

/// What the run got done: without progress, "no violation" proves nothing
/// (a run where every request failed and no fault happened breaks no rule).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Progress {
    /// Jobs in the database that ended `succeeded`.
    pub jobs_succeeded: usize,
    pub jobs: usize,
    /// Waves at least one of whose requests got a 200 with an answer.
    pub waves_answered: usize,
    pub waves: usize,
    /// Infrastructure faults the nemesis injected (kills, pauses, Redis and
    /// PostgreSQL restarts), against the schedule's.
    pub faults_injected: usize,
    pub faults_scheduled: usize,
    /// Hostile requests refused by a bound (the values budget, the
    /// conversation bound, the intake's 503), of all hostile requests.
    pub hostile_refused: usize,
    pub hostile: usize,
    /// Replica processes whose memory was watched.
    pub memory_watched: usize,
}

impl Progress {
    pub fn of(h: &History, faults_scheduled: usize) -> Progress {
        let answered: HashSet<usize> = h
            .ops
            .iter()
            .filter(|o| o.status == 200 && o.seen.is_some())
            .filter_map(|o| o.wave)
            .collect();
        Progress {
            jobs_succeeded: h.jobs.iter().filter(|j| j.state == "succeeded").count(),
            jobs: h.jobs.len(),
            waves_answered: h.waves.iter().filter(|w| answered.contains(&w.id)).count(),
            waves: h.waves.len(),
            faults_injected: h
                .faults
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind,
                        FaultKind::Kill(_)
                            | FaultKind::Pause(_)
                            | FaultKind::RedisDown
                            | FaultKind::PgRestart
                    )
                })
                .count(),
            faults_scheduled,
            hostile_refused: h
                .hostile
                .iter()
                .filter(|r| {
                    matches!(
                        r.code.as_deref(),
                        Some("too_many_json_values" | "conversation_too_long" | "server_busy")
                    )
                })
                .count(),
            hostile: h.hostile.len(),
            memory_watched: h.memory.len(),
        }
    }

    /// What is missing for the run to count: no job succeeded, no wave was
    /// answered, fewer faults than scheduled, no hostile request refused by a
    /// bound, no memory watched.
    pub fn shortfalls(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.jobs_succeeded == 0 {
            out.push(format!("no job succeeded (of {})", self.jobs));
        }
        if self.waves_answered == 0 {
            out.push(format!("no wave was answered (of {})", self.waves));
        }
        if self.hostile_refused == 0 {
            out.push(format!(
                "no hostile request was refused by a bound (of {})",
                self.hostile
            ));
        }
        if self.memory_watched == 0 {
            out.push("no replica's memory was watched".to_string());
        }
        if self.faults_injected < self.faults_scheduled {
            out.push(format!(
                "{} faults injected, {} scheduled",
                self.faults_injected, self.faults_scheduled
            ));
        }
        out
    }
}

impl std::fmt::Display for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} of {} jobs succeeded, {} of {} waves answered, {} of {} scheduled faults injected, \
             {} of {} hostile requests refused by a bound, {} replica processes' memory watched",
            self.jobs_succeeded,
            self.jobs,
            self.waves_answered,
            self.waves,
            self.faults_injected,
            self.faults_scheduled,
            self.hostile_refused,
            self.hostile,
            self.memory_watched
        )
    }
}

#[cfg(test)]
mod tests {
    //! The checker checked: a clean history passes, and each hand-made
    //! violation is flagged by its rule.

    use idem::mock_upstream::Endpoint;
    use serde_json::json;

    use super::*;
    use crate::history::{Fault, Hostile, Memory, Op, Quiet, Wave};

    const T0: i64 = 1_000_000;

    fn answer(seq: u64, prompt: &str, model: &str) -> Value {
        json!({"object": "chat.completion", "model": model, "choices": [
            {"index": 0, "message": {"role": "assistant",
             "content": format!("mock answer #{seq} to: {prompt}")}}]})
    }

    fn call(seq: u64, at: i64, user: &str, prompt: &str, model: &str) -> CallRecord {
        CallRecord {
            seq,
            endpoint: Endpoint::ChatCompletions,
            at_ms: at,
            done_ms: Some(at + 50),
            model: Some(model.into()),
            user: Some(user.into()),
            prompt: prompt.into(),
            stream: false,
            outcome: CallOutcome::Completed,
            status: Some(200),
            traceparent: None,
        }
    }

    fn payload(prompt: &str) -> Value {
        json!({"request": {"model": "bot", "user": "acme",
               "messages": [{"role": "user", "content": prompt}]},
               "metadata": {"intent": prompt}})
    }

    fn attempt(n: i32, state: &str, from: i64, to: Option<i64>) -> AttemptRow {
        AttemptRow {
            job_id: "j1".into(),
            n,
            model: "gpt-4o-mini".into(),
            state: state.into(),
            reason: None,
            hedge: false,
            started_at: from,
            finished_at: to,
        }
    }

    fn create(status: u16, variant: u8, prompt: &str) -> Op {
        let mut op = Op::new(OpKind::CreateJob, "acme", 0, payload(prompt));
        op.key = Some("k1".into());
        op.variant = variant;
        op.status = status;
        if (200..300).contains(&status) {
            op.job_id = Some("j1".into());
            op.fingerprint = Some("v1:aa".into());
        }
        op
    }

    fn chat(tenant: &'static str, prompt: &str, seen: Option<Seen>) -> Op {
        let body = json!({"model": "bot", "user": tenant,
                          "messages": [{"role": "user", "content": prompt}]});
        let mut op = Op::new(OpKind::Chat, tenant, 1, body);
        op.wave = Some(1);
        op.status = 200;
        op.seen = seen;
        op
    }

    fn seen(seq: u64, prompt: &str) -> Seen {
        Seen::of_completion(&answer(seq, prompt, "gpt-4o-mini")).unwrap()
    }

    /// One job that failed once and then succeeded, a double click, a
    /// rejected changed payload, and one wave of two identical chats.
    fn clean() -> History {
        let p = "job k1 for acme";
        let job = JobRow {
            id: "j1".into(),
            tenant: "acme".into(),
            key: "k1".into(),
            payload_hash: "p1:x".into(),
            fingerprint: "v1:aa".into(),
            request: payload(p)["request"].clone(),
            metadata: Some(payload(p)["metadata"].clone()),
            state: "succeeded".into(),
            completed_by: Some(2),
            result: Some(answer(2, p, "gpt-4o-mini")),
            created_at: T0,
        };
        let mut failed = call(1, T0 + 10, "acme", p, "gpt-4o-mini");
        failed.outcome = CallOutcome::Failed;
        failed.status = Some(500);
        let mut get = Op::new(OpKind::GetJob, "acme", 2, Value::Null);
        get.prompt = p.into();
        get.job_id = Some("j1".into());
        get.status = 200;
        get.seen = Some(seen(2, p));
        History {
            ops: vec![
                create(201, 0, p),
                create(200, 0, p),
                create(409, 1, "job k1 for acme, changed"),
                get,
                chat("acme", "wave 1", Some(seen(3, "wave 1"))),
                chat("acme", "wave 1", Some(seen(3, "wave 1"))),
            ],
            faults: vec![],
            waves: vec![Wave {
                id: 1,
                tenants: vec!["acme"],
                prompt: "wave 1".into(),
                from_ms: T0 + 1000,
                until_ms: T0 + 2000,
            }],
            jobs: vec![job],
            attempts: vec![
                attempt(1, "failed", T0 + 5, Some(T0 + 60)),
                attempt(2, "succeeded", T0 + 300, Some(T0 + 400)),
            ],
            calls: vec![
                failed,
                call(2, T0 + 310, "acme", p, "gpt-4o-mini"),
                call(3, T0 + 1010, "acme", "wave 1", "gpt-4o-mini"),
            ],
            quiet: Quiet {
                flight_keys: vec![],
                inflight: vec![0, 0, 0],
            },
            replicas: 3,
            memory: vec![Memory {
                replica: 0,
                pid: 7,
                peak: 100 << 20,
                at_ms: T0,
            }],
            hostile: vec![
                hostile("values", 0, 400, "too_many_json_values"),
                hostile("parsed", 0, 200, ""),
                hostile("turn", 1, 200, ""),
                hostile("turn", 7, 400, "conversation_too_long"),
            ],
        }
    }

    fn hostile(what: &'static str, turn: usize, status: u16, code: &str) -> Hostile {
        Hostile {
            path: "/v1/responses",
            what,
            turn,
            status,
            code: (!code.is_empty()).then(|| code.to_string()),
        }
    }

    /// A replica past the memory ceiling is flagged.
    #[test]
    fn a_replica_past_the_memory_ceiling_is_flagged() {
        let mut h = clean();
        h.memory[0].peak = MEMORY_CEILING;
        assert_eq!(rules(&h), vec!["memory_bounded"]);
    }

    /// An internal error, a 200 past the values budget and a 200 for a
    /// conversation past its bound are each flagged.
    #[test]
    fn hostile_requests_past_their_bounds_are_flagged() {
        for bad in [
            hostile("parsed", 0, 500, "internal_error"),
            hostile("values", 0, 200, ""),
            hostile("turn", 7, 200, ""),
        ] {
            let mut h = clean();
            h.hostile.push(bad.clone());
            assert_eq!(rules(&h), vec!["hostile_input_bounded"], "{bad:?}");
        }
        // The first turns of a conversation, and a provider's 500 passed
        // through, are no violation.
        let mut h = clean();
        h.hostile.push(hostile("turn", 2, 200, ""));
        h.hostile.push(hostile("turn", 3, 500, ""));
        assert_eq!(rules(&h), Vec::<&str>::new());
    }

    fn rules(h: &History) -> Vec<&'static str> {
        let mut r: Vec<&'static str> = check(h).into_iter().map(|v| v.rule).collect();
        r.dedup();
        r
    }

    /// The clean history's wave, its leader paused: a take-over (call 4)
    /// started before the paused leader's call 3 answered.
    fn taken_over() -> History {
        let mut h = clean();
        h.faults.push(Fault {
            kind: FaultKind::Pause(1),
            from_ms: T0 + 1000,
            until_ms: T0 + 4000,
        });
        let mut late = call(3, T0 + 1010, "acme", "wave 1", "gpt-4o-mini");
        late.done_ms = Some(T0 + 3500);
        h.calls[2] = late;
        h.calls
            .push(call(4, T0 + 3100, "acme", "wave 1", "gpt-4o-mini"));
        h.ops[4].seen = Some(seen(4, "wave 1"));
        h.ops[5].seen = Some(seen(4, "wave 1"));
        h
    }

    #[test]
    fn a_takeover_whose_answer_is_everyones_passes() {
        assert_eq!(check(&taken_over()), vec![]);
    }

    #[test]
    fn a_late_leaders_answer_beside_the_takeovers_is_flagged() {
        let mut h = taken_over();
        h.ops[5].seen = Some(seen(3, "wave 1"));
        assert_eq!(rules(&h), vec!["one_answer_per_flight"]);
        // Around a Redis outage each replica may answer on its own.
        h.faults.push(Fault {
            kind: FaultKind::RedisDown,
            from_ms: T0 + 500,
            until_ms: T0 + 900,
        });
        assert_eq!(check(&h), vec![]);
    }

    #[test]
    fn a_garbage_answer_served_as_a_success_is_flagged() {
        for outcome in [CallOutcome::Garbage, CallOutcome::Padded] {
            let mut h = clean();
            h.calls[2].outcome = outcome;
            assert_eq!(rules(&h), vec!["garbage_is_never_a_success"], "{outcome:?}");
            let mut h = clean();
            h.calls[1].outcome = outcome;
            assert!(
                rules(&h).contains(&"garbage_is_never_a_success"),
                "{outcome:?}"
            );
        }
    }

    #[test]
    fn a_clean_history_passes() {
        assert_eq!(check(&clean()), vec![]);
    }

    /// The clean history made progress: its job succeeded and its wave was
    /// answered; with a fault scheduled and none injected, it falls short.
    #[test]
    fn progress_counts_what_got_done() {
        let mut h = clean();
        let p = Progress::of(&h, 0);
        assert_eq!(
            (p.jobs_succeeded, p.jobs, p.waves_answered, p.waves),
            (1, 1, 1, 1)
        );
        assert_eq!(p.shortfalls(), Vec::<String>::new());
        assert_eq!(
            Progress::of(&h, 1).shortfalls(),
            vec!["0 faults injected, 1 scheduled"]
        );
        h.faults.push(Fault {
            kind: FaultKind::PgRestart,
            from_ms: T0,
            until_ms: T0 + 100,
        });
        // Provider phases are not infrastructure faults.
        h.faults.push(Fault {
            kind: FaultKind::Provider("500s".into()),
            from_ms: T0,
            until_ms: T0 + 100,
        });
        assert_eq!(Progress::of(&h, 1).faults_injected, 1);
        assert_eq!(Progress::of(&h, 2).shortfalls().len(), 1);
        // No hostile request refused, no memory watched: no progress.
        h.hostile.retain(|r| r.code.is_none());
        h.memory.clear();
        assert_eq!(
            Progress::of(&h, 1).shortfalls(),
            vec![
                "no hostile request was refused by a bound (of 2)",
                "no replica's memory was watched"
            ]
        );
    }

    /// A run where every request failed breaks no rule, and shows no
    /// progress: no job succeeded, no wave answered.
    #[test]
    fn a_run_that_did_nothing_shows_no_progress() {
        let mut h = clean();
        h.jobs[0].state = "failed".into();
        h.jobs[0].completed_by = None;
        h.jobs[0].result = None;
        h.attempts[1].state = "failed".into();
        for op in &mut h.ops {
            op.status = 500;
            op.seen = None;
        }
        h.calls.clear();
        let p = Progress::of(&h, 4);
        assert_eq!(
            p.shortfalls(),
            vec![
                "no job succeeded (of 1)",
                "no wave was answered (of 1)",
                "0 faults injected, 4 scheduled"
            ]
        );
    }

    #[test]
    fn two_jobs_for_one_key_are_flagged() {
        let mut h = clean();
        let mut twin = h.jobs[0].clone();
        twin.id = "j2".into();
        twin.state = "failed".into();
        twin.completed_by = None;
        twin.result = None;
        h.jobs.push(twin);
        let mut second = create(201, 0, "job k1 for acme");
        second.job_id = Some("j2".into());
        h.ops.push(second);
        let r = rules(&h);
        assert!(r.contains(&"one_job_per_key"), "{r:?}");
    }

    #[test]
    fn an_acknowledged_job_missing_from_the_database_is_flagged() {
        let mut h = clean();
        h.ops[1].job_id = Some("j-lost".into());
        assert!(rules(&h).contains(&"acknowledged_job_lost"));
    }

    #[test]
    fn two_succeeded_attempts_are_flagged() {
        let mut h = clean();
        h.attempts[0].state = "succeeded".into();
        assert!(rules(&h).contains(&"single_winner"));
        let mut h = clean();
        h.jobs[0].completed_by = Some(1);
        assert!(rules(&h).contains(&"single_winner"));
    }

    #[test]
    fn a_result_from_another_attempt_or_prompt_is_flagged() {
        // The result is the failed call's (#1), not the winner's.
        let mut h = clean();
        h.jobs[0].result = Some(answer(1, "job k1 for acme", "gpt-4o-mini"));
        assert!(rules(&h).contains(&"result_is_the_winners_answer"));
        // The result is another job's answer.
        let mut h = clean();
        h.jobs[0].result = Some(answer(3, "wave 1", "gpt-4o-mini"));
        assert!(rules(&h).contains(&"result_is_the_winners_answer"));
        // The result's call went to another model than the winner's.
        let mut h = clean();
        h.attempts[1].model = "llama-3.1-8b".into();
        assert!(rules(&h).contains(&"result_is_the_winners_answer"));
        // The call came after the winning attempt had finished.
        let mut h = clean();
        h.attempts[1].finished_at = Some(T0 + 301);
        h.calls[1].at_ms = T0 + 900;
        assert!(rules(&h).contains(&"result_is_the_winners_answer"));
    }

    #[test]
    fn a_result_that_changed_after_a_client_saw_it_is_flagged() {
        let mut h = clean();
        h.ops[3].seen = Some(seen(7, "job k1 for acme"));
        assert!(rules(&h).contains(&"result_never_changes"));
    }

    #[test]
    fn a_chat_with_a_key_counts_as_a_job_request() {
        let p = "job k1 for acme";
        let mut h = clean();
        let mut op = create(200, 0, p);
        op.kind = OpKind::ChatWithKey;
        op.seen = Some(seen(2, p));
        h.ops.push(op);
        assert_eq!(check(&h), vec![]);
        // Its answer is not the job's result.
        h.ops.last_mut().unwrap().seen = Some(seen(1, p));
        assert!(rules(&h).contains(&"result_never_changes"));
        // It was given another job.
        let last = h.ops.last_mut().unwrap();
        last.seen = Some(seen(2, p));
        last.job_id = Some("j9".into());
        assert!(rules(&h).contains(&"one_job_per_key"));
    }

    #[test]
    fn an_attempt_started_while_another_is_in_flight_is_flagged() {
        // Attempt 2 starts while attempt 1 is unknown.
        let mut h = clean();
        h.attempts[0].state = "unknown".into();
        assert!(rules(&h).contains(&"no_overlapping_attempts"));
        // Attempt 2 starts before attempt 1 finished.
        let mut h = clean();
        h.attempts[0].finished_at = Some(T0 + 350);
        assert!(rules(&h).contains(&"no_overlapping_attempts"));
        // The same overlap as a hedge is allowed.
        h.attempts[1].hedge = true;
        assert_eq!(check(&h), vec![]);
        // But not a hedge beside two attempts in flight.
        let mut third = h.attempts[1].clone();
        third.n = 3;
        third.started_at = T0 + 320;
        third.state = "discarded".into();
        h.attempts.push(third);
        assert!(rules(&h).contains(&"no_overlapping_attempts"));
    }

    #[test]
    fn a_conflict_that_changed_the_job_is_flagged() {
        // The changed payload was written into the job.
        let mut h = clean();
        h.jobs[0].request["messages"][0]["content"] = json!("job k1 for acme, changed");
        assert!(rules(&h).contains(&"conflict_changes_nothing"));
        // The changed payload was accepted.
        let mut h = clean();
        h.ops[2].status = 200;
        h.ops[2].job_id = Some("j1".into());
        assert!(rules(&h).contains(&"conflict_changes_nothing"));
        // A 409 for the job's own payload.
        let mut h = clean();
        h.ops[1].status = 409;
        assert!(rules(&h).contains(&"conflict_changes_nothing"));
    }

    #[test]
    fn an_answer_delivered_to_another_tenant_is_flagged() {
        let mut h = clean();
        h.calls[2].user = Some("beta".into());
        assert!(rules(&h).contains(&"answers_stay_with_their_tenant"));
        let mut h = clean();
        h.ops[4].seen = Some(seen(2, "job k1 for acme"));
        assert!(rules(&h).contains(&"answers_stay_with_their_tenant"));
        let mut h = clean();
        h.ops[5].tenant = "beta";
        assert!(rules(&h).contains(&"answers_stay_with_their_tenant"));
    }

    #[test]
    fn leftovers_once_quiet_are_flagged() {
        let mut h = clean();
        h.quiet.flight_keys.push("idem:{ab}:flight:0".into());
        assert!(rules(&h).contains(&"nothing_left_behind"));
        let mut h = clean();
        h.quiet.inflight[1] = 1;
        assert!(rules(&h).contains(&"nothing_left_behind"));
        let mut h = clean();
        h.attempts[1].state = "running".into();
        h.attempts[1].finished_at = None;
        assert!(rules(&h).contains(&"nothing_left_behind"));
    }

    #[test]
    fn a_second_call_for_a_wave_needs_a_fault_or_an_expired_negative_entry() {
        let mut h = clean();
        h.calls
            .push(call(4, T0 + 1100, "acme", "wave 1", "gpt-4o-mini"));
        assert_eq!(rules(&h), vec!["upstream_calls_bounded"]);
        // The same calls under a Redis outage are within the bound.
        h.faults.push(Fault {
            kind: FaultKind::RedisDown,
            from_ms: T0 + 900,
            until_ms: T0 + 1500,
        });
        assert_eq!(check(&h), vec![]);
        // A 429 pays for one more call, once its 2 s negative entry expired.
        let mut h = clean();
        h.calls[2].outcome = CallOutcome::Failed;
        h.calls[2].status = Some(429);
        h.calls
            .push(call(4, T0 + 1500, "acme", "wave 1", "gpt-4o-mini"));
        h.ops[4].seen = Some(seen(4, "wave 1"));
        h.ops[5].seen = Some(seen(4, "wave 1"));
        assert_eq!(rules(&h), vec!["upstream_calls_bounded"]);
        h.calls[3].at_ms = T0 + 1060 + RATE_LIMIT_TTL_MS;
        assert_eq!(check(&h), vec![]);
        // So do Redis errors a replica reported during the wave.
        let mut h = clean();
        h.calls
            .push(call(4, T0 + 1100, "acme", "wave 1", "gpt-4o-mini"));
        h.faults.push(Fault {
            kind: FaultKind::RedisErrors {
                replica: 2,
                count: 1,
            },
            from_ms: T0 + 800,
            until_ms: T0 + 1000,
        });
        assert_eq!(check(&h), vec![]);
        h.calls
            .push(call(5, T0 + 1200, "acme", "wave 1", "gpt-4o-mini"));
        assert_eq!(rules(&h), vec!["upstream_calls_bounded"]);
        // Another tenant's identical prompt is another fingerprint.
        let mut h = clean();
        h.waves[0].tenants.push("beta");
        h.calls
            .push(call(4, T0 + 1020, "beta", "wave 1", "gpt-4o-mini"));
        assert_eq!(check(&h), vec![]);
    }

    #[test]
    fn more_job_calls_than_attempts_are_flagged() {
        let mut h = clean();
        h.calls
            .push(call(4, T0 + 320, "acme", "job k1 for acme", "gpt-4o-mini"));
        assert_eq!(rules(&h), vec!["job_calls_bounded_by_attempts"]);
    }
}
