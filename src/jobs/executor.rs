//! The executor: claims queued jobs and runs their attempts.
//!
//! One dispatcher per replica claims queued jobs in batches (the store
//! hands each queued job to exactly one claimer), as many as there are
//! free slots of `jobs.workers`, and starts their first attempts in the
//! claim's transaction; each job then runs as its own task, holding its
//! slot (a semaphore permit, not a database connection) until its answer
//! is in the hands of the writer of completions, or until it is done
//! otherwise. It makes attempts until one completes the job, the job's budget
//! runs out, or an attempt ends `unknown`, which holds the job (a timeout
//! is never a failure). Completions are written in groups, one transaction
//! for those that arrive together (each still a compare-and-swap of its
//! own). A job created on this replica wakes the dispatcher at once; jobs
//! created elsewhere are found by a poll every `jobs.poll_interval`.
//! Live jobs are claimed before batch lines, and batch lines hold at most
//! `batches.workers` of the slots, so a batch never takes the workers of
//! live jobs.
//!
//! The budget is `attempts.max` (plus one per manual retry) over the job's
//! whole life: it counts the attempt rows in the store (hedges aside), so a
//! job that comes back to the queue (an unknown attempt auto-resolved, an
//! expired claim, a late failure) continues its count instead of starting
//! a new one. Each attempt goes through the coalescing layer on one target,
//! so two jobs with the same payload still make one upstream call (a retry
//! on a target the job already tried makes its own).
//!
//! An attempt past `attempts.timeout` is `unknown`, but its upstream call
//! goes on (the provider's own timeout does not cut it) until
//! `attempts.late_result_window`: a late success completes the job by
//! compare-and-swap, a late failure lets the job try again if its budget
//! allows. An attempt whose lease renewal is refused (another replica
//! declared it unknown while this one stalled) stops at once and completes
//! nothing.
//!
//! With `attempts.hedge_after`, a second attempt starts on the next allowed
//! target while the first is still in flight; whichever finishes first
//! completes the job by compare-and-swap, and the other is discarded.
//! "Allowed" is [`failover`]'s rule: on a route with a contract, failover
//! and hedges go only to targets certified for its current hash, and never
//! to a target whose circuit is open.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::Rng;
use serde_json::{Map, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::answer::{Answer, Verdict};
use crate::certification::failover;
use crate::config::RouteAttempts;
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::flight::{FlightError, RequestBody, Source};
use crate::jobs::Env;
use crate::routes::Route;
use crate::store::{
    AttemptRecord, AttemptResult, AttemptState, Backend, Completion, JobRecord, StartAttempt,
    now_ms,
};
use crate::task::{AttemptRules, CachePolicy, Count, Finish, Task};
use crate::telemetry::{Attribute, EndOnDrop, attr};

/// How an attempt ended, as far as the worker is concerned.
#[derive(Debug, Clone, PartialEq)]
pub enum AttemptEnd {
    /// This attempt completed the job.
    Won,
    /// Another attempt completed the job first; this one is discarded.
    Lost,
    /// The provider certainly did not do the work.
    Failed(String),
    /// idem cannot know; the job is held until the attempt is resolved.
    Unknown(String),
}

/// Aborts a background task when dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Most jobs one claim takes (and first attempts one transaction starts).
const MAX_CLAIM: usize = 128;

/// Claims a dispatcher has out at once on PostgreSQL (`FOR UPDATE SKIP
/// LOCKED` gives each its own jobs).
const CLAIMS_IN_FLIGHT: usize = 2;

/// Most completions one transaction writes.
const MAX_COMPLETIONS: usize = 256;

/// Most completions waiting for the writer (a few transactions' worth).
const COMPLETIONS_WAITING: usize = 4 * MAX_COMPLETIONS;

/// Starts this replica's executor: a dispatcher that runs up to
/// `jobs.workers` jobs at once (none on an API-only replica), and the
/// writer of their completions.
pub fn spawn(app: &Env, shutdown: &CancellationToken, tracker: &TaskTracker) {
    let workers = app.live().config.jobs.workers;
    if workers == 0 {
        return;
    }
    let completer = Completer::start(app.jobs().store.clone(), shutdown, tracker);
    tracker.spawn(dispatch(
        app.clone(),
        shutdown.clone(),
        tracker.clone(),
        completer,
        workers,
    ));
}

/// Claims queued jobs while slots are free and starts a task per job. On
/// PostgreSQL up to [`CLAIMS_IN_FLIGHT`] claims run at once: a slot freed
/// while one is on its way to the database goes into the next, instead of
/// waiting for the first to return.
async fn dispatch(
    app: Env,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    completer: Completer,
    workers: usize,
) {
    let slots = Arc::new(Semaphore::new(workers));
    // The slots batch lines may hold: the others are kept for live jobs
    // (docs/design.md, "Batches").
    let line_slots = Arc::new(Semaphore::new(
        app.live().config.batches.line_workers(workers),
    ));
    // SQLite has one writer: a second claim would only queue behind the
    // first (and the jobs being created) for it.
    let in_flight = match app.jobs().store.backend() {
        Backend::Sqlite => 1,
        Backend::Postgres => CLAIMS_IN_FLIGHT,
    };
    let claims = Arc::new(Semaphore::new(in_flight));
    // Whether the last claim to return found the queue empty (or could
    // not read it): the next waits for news.
    let drained = Arc::new(AtomicBool::new(false));
    loop {
        let turn = tokio::select! {
            () = shutdown.cancelled() => return,
            permit = claims.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        if drained.load(Ordering::Acquire) {
            // A job created on this replica wakes the dispatcher (a wake-up
            // that came while a claim was out is kept for this wait);
            // jobs created elsewhere are found by the poll.
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = app.jobs().woken() => {}
                () = tokio::time::sleep(app.live().config.jobs.poll_interval) => {}
            }
            drained.store(false, Ordering::Release);
        }
        let first = tokio::select! {
            () = shutdown.cancelled() => return,
            permit = slots.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        // Jobs that finished together hand their slots back together: let
        // them, so that one claim fills all of them.
        tokio::task::yield_now().await;
        let mut permits = vec![first];
        while permits.len() < MAX_CLAIM {
            match slots.clone().try_acquire_owned() {
                Ok(p) => permits.push(p),
                Err(_) => break,
            }
        }
        let mut line_permits = Vec::new();
        while line_permits.len() < permits.len() {
            match line_slots.clone().try_acquire_owned() {
                Ok(p) => line_permits.push(p),
                Err(_) => break,
            }
        }
        let (app, tracker, completer, drained) = (
            app.clone(),
            tracker.clone(),
            completer.clone(),
            drained.clone(),
        );
        tracker.clone().spawn(async move {
            let asked = permits.len();
            let claimed = match claim(&app, asked, line_permits.len()).await {
                Ok(claimed) => claimed,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot claim jobs");
                    Vec::new()
                }
            };
            // A full claim: the queue may hold more, claim again as soon
            // as a slot is free.
            drained.store(claimed.len() < asked, Ordering::Release);
            for (job, permit) in claimed.into_iter().zip(permits) {
                let line = if job.job.batch_id.is_some() {
                    line_permits.pop()
                } else {
                    None
                };
                let (app, completer) = (app.clone(), completer.clone());
                tracker.spawn(run_job_in(app, job, completer, Slot::new(permit, line)));
            }
            drop(turn);
        });
    }
}

async fn run_job_in(app: Env, job: Claimed, completer: Completer, slot: Slot) {
    run_job(&app, job, &completer, &slot).await;
    slot.release();
}

/// A job's slot of `jobs.workers`, shared by its run and its attempts. It
/// is given back when the run ends, or as soon as an attempt's answer is
/// handed to the writer of completions: from there on the run makes no
/// provider call (the answer completes the job, loses to another, or,
/// when the store fails, holds it), and the next job need not wait for
/// the database's commit. A batch line's slot also holds one of the
/// slots kept for lines.
#[derive(Clone)]
struct Slot(Arc<std::sync::Mutex<Option<Permits>>>);

type Permits = (OwnedSemaphorePermit, Option<OwnedSemaphorePermit>);

impl Slot {
    fn new(permit: OwnedSemaphorePermit, line: Option<OwnedSemaphorePermit>) -> Slot {
        Slot(Arc::new(std::sync::Mutex::new(Some((permit, line)))))
    }

    /// Gives the slot back (once; later calls do nothing).
    fn release(&self) {
        let permit = match self.0.lock() {
            Ok(mut held) => held.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        drop(permit);
    }
}

/// The targets automatic attempts may use, in order, health aside. The
/// primary is the operator's choice; on a route with a contract the others
/// must be certified for its current hash (see [`failover`]).
pub fn allowed_targets(_app: &Env, route: &Route) -> Vec<usize> {
    failover::failover_set(route)
}

/// How many attempts a job may make in its whole life: the route's
/// `attempts.max`, plus one for each manual retry it was granted.
pub fn attempt_budget(policy: &RouteAttempts, job: &JobRecord) -> usize {
    let retries = usize::try_from(job.retries).unwrap_or(0);
    (policy.max as usize).saturating_add(retries)
}

/// The attempts that count against the budget: every one the job made, on
/// any run, except hedges (the route's explicit extra beside an attempt).
pub fn budgeted(attempts: &[AttemptRecord]) -> usize {
    attempts.iter().filter(|a| !a.hedge).count()
}

/// Runs one claimed job until it is completed, held, or out of attempts.
async fn run_job(app: &Env, claimed: Claimed, completer: &Completer, slot: &Slot) {
    let store = &app.jobs().store;
    let Claimed {
        job,
        prepared,
        earlier,
        first: mut pre,
    } = claimed;
    let mut known = Some(earlier);
    let job_id = job.id.as_str();
    let fail = |reason: String| async move {
        if let Err(e) = app.jobs().store.fail_job(job_id, &reason, now_ms()).await {
            tracing::error!(job = %job_id, error = %e, "cannot fail job");
        }
        app.jobs().changed(job_id);
    };
    let Prepared {
        route,
        request,
        dialect,
        forwarded,
        fp,
    } = match prepared {
        Ok(p) => p,
        Err(reason) => {
            fail(reason).await;
            return;
        }
    };

    // Keep the claim while this worker runs the job.
    let _claim = {
        let store = store.clone();
        let (id, worker) = (job.id.clone(), app.jobs().worker_id.clone());
        let lease = app.live().config.jobs.claim_lease;
        AbortOnDrop(tokio::spawn(async move {
            let mut tick = crate::lease::renewals(lease);
            loop {
                tick.tick().await;
                let _ = store.renew_claim(&id, &worker, now_ms() + ms(lease)).await;
            }
        }))
    };

    let policy = &route.config.attempts;
    let budget = attempt_budget(policy, &job);
    let mut last = String::from("no attempt was made");
    // Rounds of this run that could start no attempt (no target may take
    // it): they start no row, but still use up the budget, or a route
    // whose targets all refuse would be retried for ever.
    let mut refused = 0usize;
    // Failovers that were not allowed, for the job's error.
    let mut blocked: Vec<String> = Vec::new();
    // The pause before the next round, after a failed one.
    let mut pause = None;
    let made = loop {
        // The budget counts the job's attempt rows, whichever run (or
        // replica) made them.
        let earlier = match known.take() {
            Some(attempts) => attempts,
            None => match store.attempts(&job.id).await {
                Ok(attempts) => attempts,
                Err(e) => {
                    // The claim lapses and the reconciler requeues the job.
                    tracing::error!(job = %job.id, error = %e, "cannot count the job's attempts");
                    return;
                }
            },
        };
        // A run that starts with its budget spent (by earlier runs)
        // reports the last of those attempts.
        if pause.is_none()
            && let Some(reason) = earlier.last().and_then(|a| a.reason.clone())
        {
            last = reason;
        }
        let used = budgeted(&earlier).saturating_add(refused);
        if used >= budget {
            break used;
        }
        if let Some(pause) = pause.take() {
            tokio::time::sleep(pause).await;
        }
        // The dispatcher may have started this round's attempt already.
        let chosen = match pre.take() {
            Some((started, target)) => Ok((target, Some(started))),
            None => failover::Walk::attempt(&route, used)
                .first(app.metrics())
                .map(|target| (target, None)),
        };
        let round = match chosen {
            Ok((target, started)) => {
                // Attempt `used` would have gone to target `used` mod n:
                // anything skipped on the way was a refused failover.
                let natural = used % route.targets.len().max(1);
                if target != natural
                    && let Some(t) = route.targets.get(natural)
                    && !failover::certified_for_failover(&route, t)
                {
                    let why = format!(
                        "failover to {}/{} blocked: not certified for the route's contract",
                        t.provider.name, t.model
                    );
                    if !blocked.contains(&why) {
                        blocked.push(why);
                    }
                }
                let round = RoundCtx {
                    app,
                    job: &job,
                    route: &route,
                    request: &request,
                    dialect,
                    forwarded: &forwarded,
                    fp,
                    earlier: &earlier,
                    completer,
                    slot,
                };
                round.run(target, policy.hedge_after, started).await
            }
            Err(none) => {
                tracing::warn!(job = %job.id, route = %route.name, reason = %none, "no target may take the attempt");
                refused += 1;
                Round::Failed(none.to_string())
            }
        };
        match round {
            Round::Completed | Round::Held | Round::Closed => {
                app.jobs().changed(&job.id);
                return;
            }
            Round::Failed(reason) => last = reason,
        }
        // The next round, if the budget allows one, waits a pause that
        // grows with the attempts made so far.
        pause = Some(backoff(
            policy.backoff_base,
            policy.backoff_max,
            u32::try_from(used).unwrap_or(u32::MAX),
        ));
    };
    let mut reason = format!("all {made} attempts failed; last: {last}");
    for b in blocked {
        reason.push_str("; ");
        reason.push_str(&b);
    }
    fail(reason).await;
}

/// Exponential backoff with full jitter: uniform in [0, min(max, base * 2^i)].
pub fn backoff(base: Duration, max: Duration, i: u32) -> Duration {
    backoff_with(&mut rand::rng(), base, max, i)
}

/// [`backoff`] with the random source given (tests seed one).
fn backoff_with(rng: &mut impl Rng, base: Duration, max: Duration, i: u32) -> Duration {
    backoff_cap(base, max, i).mul_f64(rng.random_range(0.0..=1.0))
}

/// The ceiling of the `i`-th backoff: `base * 2^i`, at most `max`.
fn backoff_cap(base: Duration, max: Duration, i: u32) -> Duration {
    base.saturating_mul(1u32 << i.min(20)).min(max)
}

enum Round {
    Completed,
    Held,
    Closed,
    Failed(String),
}

/// What a round of attempts works on.
struct RoundCtx<'a> {
    app: &'a Env,
    job: &'a JobRecord,
    route: &'a Arc<Route>,
    request: &'a Arc<Map<String, Value>>,
    dialect: Dialect,
    forwarded: &'a Forwarded,
    fp: Fingerprint,
    /// The job's attempts before this round.
    earlier: &'a [AttemptRecord],
    completer: &'a Completer,
    slot: &'a Slot,
}

impl RoundCtx<'_> {
    /// One attempt, plus a hedge if the first is still in flight after
    /// `hedge_after`.
    /// `started`: the first attempt's row, if the dispatcher wrote it.
    async fn run(
        &self,
        target: usize,
        hedge_after: Option<Duration>,
        started: Option<AttemptRecord>,
    ) -> Round {
        let (app, job, route) = (self.app, self.job, self.route);
        let first = match self.start(target, false, started).await {
            Ok(rx) => rx,
            Err(round) => return round,
        };
        let Some(after) = hedge_after else {
            return round_of(&[first.await.ok()]);
        };
        let mut first = first;
        let early = tokio::select! {
            end = &mut first => Some(end.ok()),
            () = tokio::time::sleep(after) => None,
        };
        if let Some(end) = early {
            return round_of(&[end]);
        }
        // Chosen only now, so a refused hedge is counted when it would have
        // gone, and a half-open circuit's probe is taken only if used.
        let hedge_target = match failover::Walk::hedge(route, target).first(app.metrics()) {
            Ok(t) => t,
            Err(none) => {
                tracing::info!(job = %job.id, route = %route.name, reason = %none, "first attempt still in flight: no target to hedge to");
                return round_of(&[first.await.ok()]);
            }
        };
        tracing::info!(job = %job.id, route = %route.name, "first attempt still in flight: hedging");
        let second = match self.start(hedge_target, true, None).await {
            Ok(rx) => rx,
            // Could not hedge (job closed meanwhile): wait for the first.
            Err(_) => return round_of(&[first.await.ok()]),
        };
        // The first attempt to complete the job ends the round; a failure
        // waits for the other attempt.
        let mut second = second;
        let (end, other) = tokio::select! {
            e = &mut first => (e.ok(), second),
            e = &mut second => (e.ok(), first),
        };
        if matches!(end, Some(AttemptEnd::Won) | Some(AttemptEnd::Lost)) {
            return Round::Completed;
        }
        let end2 = other.await.ok();
        round_of(&[end, end2])
    }

    /// Writes the attempt row (unless `started` is the row already
    /// written), then runs the attempt in its own task (it may outlive the
    /// round: a hedge's loser finishes and is discarded, an unknown attempt
    /// keeps listening for a late answer).
    async fn start(
        &self,
        target: usize,
        hedge: bool,
        started: Option<AttemptRecord>,
    ) -> Result<oneshot::Receiver<AttemptEnd>, Round> {
        let (app, job, route) = (self.app, self.job, self.route);
        let Some(t) = route.targets.get(target) else {
            return Err(Round::Failed("no such target".into()));
        };
        let started = match started {
            Some(started) => Ok(StartAttempt::Started(started)),
            None => {
                let now = now_ms();
                let lease = app.live().config.jobs.attempt_lease;
                app.jobs()
                    .store
                    .start_attempt(
                        &job.id,
                        &t.provider.name,
                        &t.model,
                        hedge,
                        &app.jobs().worker_id,
                        now,
                        now + ms(lease),
                    )
                    .await
            }
        };
        let attempt = match started {
            Ok(StartAttempt::Started(a)) => a,
            Ok(StartAttempt::Busy) => return Err(Round::Held),
            Ok(StartAttempt::Closed) => return Err(Round::Closed),
            Err(e) => {
                tracing::error!(job = %job.id, error = %e, "cannot start an attempt");
                return Err(Round::Held);
            }
        };
        tracing::info!(job = %job.id, attempt = attempt.n, provider = %t.provider.name, hedge, "attempt started");
        // A retry on a target this job already tried makes its own call:
        // the earlier attempt's call may still be running (an unknown
        // attempt's call lasts its late window, even once the attempt is
        // resolved), and following it would only wait for the answer the
        // retry is there to replace. The first try on a target shares its
        // call with identical work in flight.
        let retry = self
            .earlier
            .iter()
            .any(|e| e.provider == t.provider.name.as_ref() && e.model == t.model.as_ref());
        let (tx, rx) = oneshot::channel();
        let ctx = AttemptCtx {
            app: app.clone(),
            tenant: Arc::from(job.tenant.as_str()),
            payer: app.payer(&job.tenant, job.key_id.as_deref()),
            route: route.clone(),
            request: self.request.clone(),
            dialect: self.dialect,
            forwarded: self.forwarded.clone(),
            fp: self.fp,
            target,
            share: !retry,
            attempt,
            completer: self.completer.clone(),
            slot: self.slot.clone(),
        };
        tokio::spawn(ctx.run(tx));
        Ok(rx)
    }
}

fn round_of(ends: &[Option<AttemptEnd>]) -> Round {
    if ends
        .iter()
        .any(|e| matches!(e, Some(AttemptEnd::Won) | Some(AttemptEnd::Lost)))
    {
        return Round::Completed;
    }
    if ends
        .iter()
        .any(|e| matches!(e, Some(AttemptEnd::Unknown(_)) | None))
    {
        return Round::Held;
    }
    let reason = ends
        .iter()
        .rev()
        .find_map(|e| match e {
            Some(AttemptEnd::Failed(r)) => Some(r.clone()),
            _ => None,
        })
        .unwrap_or_default();
    Round::Failed(reason)
}

struct AttemptCtx {
    app: Env,
    tenant: Arc<str>,
    /// Who pays for the attempt's call: the job's key and tenant.
    payer: Option<crate::budgets::Payer>,
    route: Arc<Route>,
    request: Arc<Map<String, Value>>,
    dialect: Dialect,
    forwarded: Forwarded,
    fp: Fingerprint,
    target: usize,
    /// Whether the call may be shared with identical work in flight.
    share: bool,
    attempt: AttemptRecord,
    completer: Completer,
    slot: Slot,
}

impl AttemptCtx {
    async fn run(self, tx: oneshot::Sender<AttemptEnd>) {
        let app = &self.app;
        let a = &self.attempt;
        let policy = &self.route.config.attempts;
        let deadline = Instant::now() + policy.timeout;
        let target = &self.route.targets[self.target];
        // How long a late answer still counts, from the attempt's start:
        // the attempt timeout decides when the attempt becomes unknown,
        // without abandoning the call, which may run (and a follower
        // attempt may wait for its leader) until then.
        let late = policy.late_result_window.max(policy.timeout);
        let body = RequestBody::kept(self.request.clone()).with_forwarded(self.forwarded.clone());
        // The attempt's span (traces on): its provider call is a child.
        let trace = app.core().telemetry.root(
            format!("attempt {}", self.route.name),
            vec![
                Attribute::new(attr::OPERATION, self.dialect.as_str()),
                Attribute::new(attr::REQUEST_MODEL, self.route.name.to_string()),
                Attribute::new(attr::TENANT, self.tenant.to_string()),
                Attribute::new(attr::JOB, a.job_id.to_string()),
                Attribute::new(attr::ATTEMPT, i64::from(a.n)),
                Attribute::new(attr::FINGERPRINT, self.fp.to_string()),
                Attribute::new("idem.provider", target.provider.name.to_string()),
            ],
        );
        let _ends = trace.clone().map(EndOnDrop);
        let task = Task {
            tenant: &self.tenant,
            route: &self.route,
            fp: self.fp,
            body: &body,
            wire: crate::endpoints::wire(self.dialect),
            policy: CachePolicy::default(),
            trace: trace.as_ref(),
            payer: self.payer.as_ref(),
        };
        let rules = AttemptRules {
            late,
            share: self.share,
            read_cache: true,
        };
        let core = app.core();
        let work = async {
            let (outcome, answer) = if self.dialect == Dialect::Embeddings {
                let e = super::items::Embed {
                    tenant: &self.tenant,
                    route: &self.route,
                    request: &self.request,
                    trace: trace.as_ref(),
                    payer: self.payer.as_ref(),
                };
                let (outcome, answer) = super::items::attempt(core, e, target, rules).await?;
                (outcome, Arc::new(answer))
            } else {
                let mut delivery = core.attempt(&task, target, rules).await?;
                // `running`: the provider answered with headers and the
                // body is still coming. An answer that arrives whole goes
                // straight from `starting` to its end, one write fewer.
                if let Source::Live(flight) = &delivery.source
                    && flight.head(None).await.is_some()
                    && !flight.is_done()
                {
                    let _ = app.jobs().store.attempt_running(&a.job_id, a.n).await;
                }
                let mut answer = delivery.answer().await;
                // The attempt row names its target: an answer another
                // target produced (a chat flight this attempt followed was
                // served from the route's cache) is not this attempt's.
                // Ask again, without the cache; the flight it followed has
                // ended.
                if answer.is_success()
                    && (answer.provider != target.provider.name || answer.model != target.model)
                {
                    let fresh = AttemptRules {
                        read_cache: false,
                        ..rules
                    };
                    delivery = core.attempt(&task, target, fresh).await?;
                    answer = delivery.answer().await;
                }
                (delivery.outcome, answer)
            };
            // A job is one incoming request, however it was created: its
            // first attempt counts it, with how its answer was obtained
            // (its own call, another's flight, the cache). Retries and
            // hedges are more calls for the same request.
            if a.n == 1 && !a.hedge {
                core.finish(Finish {
                    tenant: Some(&self.tenant),
                    route: Some(&self.route.name),
                    count: Some(Count::Answered(outcome)),
                    line: None,
                    priced: Some(&self.route),
                    answered: Some(&answer),
                    ..Finish::default()
                });
            }
            Ok::<_, FlightError>(answer)
        };
        tokio::pin!(work);
        let outcome = tokio::select! {
            outcome = tokio::time::timeout_at(deadline.into(), &mut work) => outcome,
            () = self.lease_lost() => {
                // Somebody else ended this attempt (another replica's
                // reconciler declared it unknown while this one stalled):
                // it is no longer this worker's to finish, and whatever its
                // call brings completes nothing.
                tracing::warn!(job = %a.job_id, attempt = a.n, "attempt lease renewal refused: attempt stopped");
                app.metrics().attempt(&target.provider.name, "lease_lost");
                let _ = tx.send(AttemptEnd::Unknown("lease_lost".into()));
                return;
            }
        };
        match outcome {
            Ok(Ok(answer)) => {
                let end = self.settle(&answer).await;
                let _ = tx.send(end);
            }
            Ok(Err(FlightError::WaitTimeout { .. })) => {
                let end = self.settle_unknown("timeout").await;
                let _ = tx.send(end);
            }
            Ok(Err(FlightError::Budget(e))) => {
                // Refused before any call: the provider certainly did no
                // work. The job's budget of attempts and its backoff
                // decide what follows (a budget's period may start again).
                tracing::info!(job = %a.job_id, attempt = a.n, error = %e, "attempt refused by a budget");
                let reason = match e {
                    crate::budgets::BudgetError::Exceeded { .. } => "budget_exceeded",
                    crate::budgets::BudgetError::PriceUnknown { .. } => "price_unknown",
                    crate::budgets::BudgetError::Unavailable(_) => "budget_unavailable",
                };
                let end = self.settle_failed(reason).await;
                let _ = tx.send(end);
            }
            Ok(Err(e)) => {
                tracing::error!(job = %a.job_id, attempt = a.n, error = %e, "attempt could not run");
                let end = self.settle_failed("internal_error").await;
                let _ = tx.send(end);
            }
            Err(_) => {
                // Past the attempt timeout the provider may still be doing
                // the work: unknown, and keep listening for a late answer
                // (the same call, never a new one).
                let end = self.settle_unknown("timeout").await;
                let _ = tx.send(end);
                let window = late.saturating_sub(policy.timeout);
                if let Ok(Ok(answer)) = tokio::time::timeout(window, &mut work).await {
                    self.settle_late(&answer).await;
                }
            }
        }
    }

    /// Renews the attempt's lease every third of it while the attempt
    /// runs; resolves when a renewal is refused: the attempt is no longer
    /// `starting`/`running` under this owner. A renewal that fails (the
    /// database is unreachable) is tried again at the next tick: the
    /// lease covers a few of them.
    async fn lease_lost(&self) {
        let (app, a) = (&self.app, &self.attempt);
        let lease = app.live().config.jobs.attempt_lease;
        let mut tick = crate::lease::renewals(lease);
        loop {
            tick.tick().await;
            let renewed = app
                .jobs()
                .store
                .renew_attempt(&a.job_id, a.n, &app.jobs().worker_id, now_ms() + ms(lease))
                .await;
            match renewed {
                Ok(true) => {}
                Ok(false) => return,
                Err(e) => {
                    tracing::warn!(job = %a.job_id, attempt = a.n, error = %e, "cannot renew the attempt's lease")
                }
            }
        }
    }

    async fn settle(&self, answer: &Answer) -> AttemptEnd {
        match answer.verdict() {
            Verdict::Succeeded => self.complete(answer).await,
            Verdict::Failed(reason) => self.settle_failed(reason).await,
            Verdict::Unknown(reason) => self.settle_unknown(reason).await,
        }
    }

    async fn complete(&self, answer: &Answer) -> AttemptEnd {
        let (app, a) = (&self.app, &self.attempt);
        // A success passed the completion check, so its stream assembles;
        // one that does not is no result.
        let Ok(plain) = answer.plain_body() else {
            return self.settle_failed("bad_upstream_answer").await;
        };
        let result = AttemptResult {
            job_id: a.job_id.clone(),
            n: a.n,
            read_version: a.read_version,
            result: String::from_utf8_lossy(&plain).into_owned(),
        };
        match self
            .completer
            .complete(&app.jobs().store, result, &self.slot)
            .await
        {
            Ok(Completion::Won(_)) => {
                app.metrics().attempt(&answer.provider, "succeeded");
                tracing::info!(job = %a.job_id, attempt = a.n, "attempt completed the job");
                app.jobs().changed(&a.job_id);
                AttemptEnd::Won
            }
            Ok(Completion::Lost) => {
                app.metrics().attempt(&answer.provider, "discarded");
                app.metrics().attempt_race(&self.route.name);
                tracing::warn!(
                    job = %a.job_id,
                    attempt = a.n,
                    "attempt finished after the job was completed: result discarded"
                );
                AttemptEnd::Lost
            }
            Err(e) => {
                tracing::error!(job = %a.job_id, attempt = a.n, error = %e, "cannot complete the job");
                self.settle_unknown("store_error").await
            }
        }
    }

    async fn settle_failed(&self, reason: &str) -> AttemptEnd {
        self.finish(AttemptState::Failed, reason).await;
        AttemptEnd::Failed(reason.to_string())
    }

    async fn settle_unknown(&self, reason: &str) -> AttemptEnd {
        self.finish(AttemptState::Unknown, reason).await;
        tracing::warn!(job = %self.attempt.job_id, attempt = self.attempt.n, reason, "attempt outcome unknown: job held");
        AttemptEnd::Unknown(reason.to_string())
    }

    async fn finish(&self, to: AttemptState, reason: &str) {
        let (app, a) = (&self.app, &self.attempt);
        app.metrics()
            .attempt(&self.route.targets[self.target].provider.name, to.as_str());
        if let Err(e) = app
            .jobs()
            .store
            .finish_attempt(&a.job_id, a.n, to, Some(reason), now_ms())
            .await
        {
            tracing::error!(job = %a.job_id, attempt = a.n, error = %e, "cannot record the attempt's end");
        }
    }

    /// An answer that arrived after the attempt was declared unknown.
    async fn settle_late(&self, answer: &Answer) {
        let (app, a) = (&self.app, &self.attempt);
        match answer.verdict() {
            Verdict::Succeeded => {
                self.complete(answer).await;
            }
            Verdict::Failed(reason) => {
                let late = format!("late_{reason}");
                let finished = app
                    .jobs()
                    .store
                    .finish_attempt(&a.job_id, a.n, AttemptState::Failed, Some(&late), now_ms())
                    .await;
                // Resolved by somebody else meanwhile: theirs is the say.
                if !matches!(finished, Ok(true)) {
                    return;
                }
                app.metrics()
                    .attempt(&self.route.targets[self.target].provider.name, "failed");
                let why = format!("attempt {} failed after its timeout: {reason}", a.n);
                self.after_late_failure(&why).await;
                app.jobs().changed(&a.job_id);
            }
            Verdict::Unknown(_) => {}
        }
    }

    /// The job's next step once its unknown attempt turned out failed: back
    /// to the queue (after a backoff) while its budget allows another
    /// attempt, else failed.
    async fn after_late_failure(&self, why: &str) {
        let (app, a) = (&self.app, &self.attempt);
        let store = &app.jobs().store;
        let policy = &self.route.config.attempts;
        let (job, made) = match (
            store.job(None, &a.job_id).await,
            store.attempts(&a.job_id).await,
        ) {
            (Ok(Some(job)), Ok(attempts)) => (job, budgeted(&attempts)),
            (Ok(None), _) => return,
            (Err(e), _) | (_, Err(e)) => {
                // The reconciler requeues the job once its claim lapses;
                // the next run counts the attempts again.
                tracing::error!(job = %a.job_id, error = %e, "cannot read the job after a late failure");
                return;
            }
        };
        let now = now_ms();
        if made < attempt_budget(policy, &job) {
            let i = u32::try_from(made.saturating_sub(1)).unwrap_or(u32::MAX);
            let not_before = now + ms(backoff(policy.backoff_base, policy.backoff_max, i));
            match store.requeue(&a.job_id, None, not_before, false, now).await {
                Ok(true) => {
                    tracing::info!(job = %a.job_id, attempt = a.n, "late failure: the job goes back to the queue");
                    app.jobs().wake();
                }
                Ok(false) => {}
                Err(e) => tracing::error!(job = %a.job_id, error = %e, "cannot requeue the job"),
            }
        } else if let Err(e) = store.fail_job(&a.job_id, why, now).await {
            tracing::error!(job = %a.job_id, error = %e, "cannot fail job");
        }
    }
}

mod claim;
mod completer;

use claim::{Claimed, Prepared, claim};
use completer::Completer;

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    #[test]
    fn backoff_is_a_uniform_draw_under_a_cap_that_doubles_up_to_the_max() {
        let base = Duration::from_millis(100);
        let max = Duration::from_secs(1);
        let caps: Vec<u128> = (0..7)
            .map(|i| backoff_cap(base, max, i).as_millis())
            .collect();
        assert_eq!(caps, [100, 200, 400, 800, 1000, 1000, 1000]);
        assert_eq!(backoff_cap(base, max, 63), max, "no overflow past 2^20");
        let mut rng = StdRng::seed_from_u64(18);
        for i in [0, 2, 5] {
            let cap = backoff_cap(base, max, i).as_secs_f64();
            let draws: Vec<f64> = (0..4000)
                .map(|_| backoff_with(&mut rng, base, max, i).as_secs_f64() / cap)
                .collect();
            assert!(draws.iter().all(|d| (0.0..=1.0).contains(d)), "{i}");
            // Full jitter uses the whole of [0, cap] evenly: every tenth of
            // it holds about a tenth of the draws (400 +/- 5 sigma), the
            // lowest as much as the highest.
            let mut tenths = [0usize; 10];
            for d in &draws {
                tenths[((d * 10.0) as usize).min(9)] += 1;
            }
            for (k, n) in tenths.iter().enumerate() {
                assert!((300..=500).contains(n), "{i}: tenth {k} has {n} of 4000");
            }
            let mean = draws.iter().sum::<f64>() / draws.len() as f64;
            assert!((mean - 0.5).abs() < 0.03, "{i}: mean {mean}");
        }
    }

    #[test]
    fn the_budget_is_max_plus_one_per_manual_retry() {
        let policy = RouteAttempts {
            max: 3,
            ..RouteAttempts::default()
        };
        let job = |retries| JobRecord {
            id: "j".into(),
            tenant: "t".into(),
            idempotency_key: "k".into(),
            payload_hash: "h".into(),
            fingerprint: "f".into(),
            route: "r".into(),
            request: "{}".into(),
            dialect: "chat".into(),
            forwarded: None,
            metadata: None,
            state: crate::store::JobState::Running,
            version: 1,
            completed_by: None,
            result: None,
            error: None,
            not_before: 0,
            claimed_by: None,
            claim_until: None,
            retries,
            key_id: None,
            batch_id: None,
            created_at: 0,
            updated_at: 0,
        };
        assert_eq!(attempt_budget(&policy, &job(0)), 3);
        assert_eq!(attempt_budget(&policy, &job(2)), 5);
        assert_eq!(
            attempt_budget(&policy, &job(-1)),
            3,
            "a corrupt count grants nothing"
        );
    }

    #[test]
    fn a_round_with_any_unknown_holds_the_job() {
        assert!(matches!(
            round_of(&[
                Some(AttemptEnd::Failed("x".into())),
                Some(AttemptEnd::Unknown("t".into()))
            ]),
            Round::Held
        ));
        assert!(matches!(
            round_of(&[Some(AttemptEnd::Unknown("t".into())), Some(AttemptEnd::Won)]),
            Round::Completed
        ));
        assert!(matches!(
            round_of(&[Some(AttemptEnd::Failed("a".into())), Some(AttemptEnd::Failed("b".into()))]),
            Round::Failed(r) if r == "b"
        ));
    }
}
