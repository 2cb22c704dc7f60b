//! The batch driver: claims batches with work left and takes each through
//! its statuses (docs/design.md, "Batches").
//!
//! A replica runs up to `batches.drivers` batches at once (none on an
//! API-only replica). A driver holds the batch's claim, renewed while it
//! works; if it dies the claim lapses and another driver resumes, because
//! every step reads what the store already holds:
//!
//! 1. `validating`: the input file is read through once; a line that is
//!    not JSON, lacks a `custom_id` or repeats one, names another method or
//!    endpoint, or a model no route serves (or the key may not use), fails
//!    the batch with OpenAI's errors (a Message Batch's requests each end
//!    on their own instead). Otherwise `in_progress`.
//! 2. `in_progress`, first pass: the first line of each fingerprint
//!    becomes a job (keyed by the batch and its `custom_id`: made once,
//!    whoever makes it), at most `batch.concurrency` of the route in flight
//!    and `batch.rate` started a second; the executor runs it like any job
//!    (after live jobs, in at most `batches.workers` of its slots). One
//!    identical to a line of an earlier batch of the tenant is created
//!    already answered by it. On a route whose first target's provider has
//!    its own Batch API, the lines are held instead and sent to it
//!    together ([`upstream`]).
//! 3. Second pass: every other line is created already answered by the
//!    first line of its fingerprint (succeeded with its answer, or failed
//!    as it failed): one call for all of them.
//! 4. The output and error files are written from the jobs, in the input's
//!    order, and the batch is `completed` (or `cancelled`, `expired`).
//!
//! A cancel starts no new line; lines in flight finish (or stay unknown,
//! as jobs do). Past `expires_at` the same, and the batch is `expired`. A
//! line held by an `unknown` attempt that no call can answer any more is
//! not waited for: it goes to the error file as `unknown`, never run again.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use serde_json::{Map, Value, json};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::lines::{FileWriter, Line, LineReader};
use super::output::{Written, output_line};
use super::{BatchEnv, LineRefusal, Planned, endpoint_dialect, line_key};
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::jobs::{Intent, JobError, Jobs, job_answer, payload_hash};
use crate::outcome::Outcome;
use crate::store::{
    AttemptRecord, AttemptState, BatchRecord, BatchStatus, Created, HELD, JobRecord, JobState,
    LEASE_EXPIRED, NewJob, StoreError, now_ms,
};
use crate::task::{Count, Finish};

/// A shared handle on the gateway for the drivers.
pub type Env = Arc<dyn BatchEnv>;

/// The most validation errors a failed batch reports.
const MAX_ERRORS: usize = 100;

/// The longest `custom_id`.
const MAX_CUSTOM_ID: usize = 512;

/// How often a driver writes its progress (and notices a cancel).
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// Metadata of a line answered without a call: which job answered it and
/// where that one came from.
const ANSWERED_BY: &str = "answered_by";
const SHARED: &str = "shared";

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Starts this replica's batch drivers.
pub fn spawn(env: &Env, shutdown: &CancellationToken, tracker: &TaskTracker) {
    let live = env.live();
    if live.config.jobs.workers == 0 {
        return;
    }
    let drivers = live.config.batches.drivers as usize;
    tracker.spawn(claim_loop(
        env.clone(),
        shutdown.clone(),
        tracker.clone(),
        drivers,
    ));
}

async fn claim_loop(env: Env, shutdown: CancellationToken, tracker: TaskTracker, drivers: usize) {
    let slots = Arc::new(Semaphore::new(drivers));
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => return,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => return,
            },
        };
        let live = env.live();
        let now = now_ms();
        let worker = env.batches().worker_id.clone();
        let lease = ms(live.config.jobs.claim_lease);
        match env.store().claim_batch(&worker, now, now + lease).await {
            Ok(Some(batch)) => {
                let (env, shutdown) = (env.clone(), shutdown.clone());
                tracker.spawn(async move {
                    drive(env, batch, shutdown).await;
                    drop(permit);
                });
            }
            Ok(None) => {
                drop(permit);
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = env.batches().woken() => {}
                    () = tokio::time::sleep(live.config.jobs.poll_interval) => {}
                }
            }
            Err(e) => {
                drop(permit);
                tracing::warn!(error = %e, "cannot claim batches");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(live.config.jobs.poll_interval) => {}
                }
            }
        }
    }
}

/// Drives one claimed batch as far as it goes, then gives the claim up.
async fn drive(env: Env, batch: BatchRecord, shutdown: CancellationToken) {
    let worker = env.batches().worker_id.clone();
    let id = batch.id.clone();
    tracing::info!(batch = %id, status = batch.status.as_str(), "batch claimed");
    let stop = shutdown.child_token();
    // Keep the claim while driving; a refused renewal (another driver took
    // the batch over) stops this one.
    let keeper = {
        let (store, id, worker, stop) = (
            env.store().clone(),
            id.clone(),
            worker.clone(),
            stop.clone(),
        );
        let lease = env.live().config.jobs.claim_lease;
        tokio::spawn(async move {
            let mut tick = crate::lease::renewals(lease);
            loop {
                tick.tick().await;
                match store.renew_batch(&id, &worker, now_ms() + ms(lease)).await {
                    Ok(true) | Err(_) => {}
                    Ok(false) => {
                        tracing::warn!(batch = %id, "batch claim lost: driver stopped");
                        stop.cancel();
                        return;
                    }
                }
            }
        })
    };
    let mut d = Driver::new(env.clone(), batch, worker.clone(), stop.clone());
    let ran = tokio::select! {
        r = d.run() => r,
        () = stop.cancelled() => Ok(()),
    };
    keeper.abort();
    if let Err(e) = ran {
        tracing::warn!(batch = %id, error = %e, "batch driver stopped");
    }
    if !stop.is_cancelled()
        && let Err(e) = env.store().release_batch(&id, &worker).await
    {
        tracing::warn!(batch = %id, error = %e, "cannot release the batch");
    }
}

/// How a batch's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    Completed,
    Cancelled,
    Expired,
}

/// A line's wait for its job, in the first pass's window.
type Waiting = Pin<Box<dyn Future<Output = (Arc<str>, Result<JobRecord, JobError>)> + Send>>;

struct Driver {
    env: Env,
    b: BatchRecord,
    worker: String,
    stop: CancellationToken,
    dialect: Dialect,
    /// Whether the store's key may use each route (asked once per run).
    allowed: HashMap<Arc<str>, bool>,
    last_progress: Instant,
    /// A cancel or the batch's expiry: no new line starts.
    stopping: Option<Ending>,
    /// This driver moved the batch to `in_progress`: no line of it has a
    /// job yet but those this run makes (each custom_id once), so a line's
    /// job need not be looked for before it is made.
    fresh: bool,
    /// Whether nobody's budget counts the batch's calls (asked once).
    unbudgeted: Option<bool>,
}

impl Driver {
    fn new(env: Env, b: BatchRecord, worker: String, stop: CancellationToken) -> Driver {
        let dialect = endpoint_dialect(&b.endpoint).unwrap_or(Dialect::Chat);
        Driver {
            env,
            b,
            worker,
            stop,
            dialect,
            allowed: HashMap::new(),
            last_progress: Instant::now(),
            stopping: None,
            fresh: false,
            unbudgeted: None,
        }
    }

    async fn run(&mut self) -> Result<(), StoreError> {
        loop {
            if self.stop.is_cancelled() {
                return Ok(());
            }
            match self.b.status {
                BatchStatus::Validating => self.validate().await?,
                BatchStatus::InProgress | BatchStatus::Cancelling => {
                    let ending = self.execute().await?;
                    if self.stop.is_cancelled() {
                        return Ok(());
                    }
                    if ending == Ending::Completed {
                        let mut next = self.b.clone();
                        next.status = BatchStatus::Finalizing;
                        next.finalizing_at = Some(now_ms());
                        if !self.save(next).await? {
                            continue;
                        }
                    }
                    self.finalize(ending).await?;
                }
                BatchStatus::Finalizing => self.finalize(Ending::Completed).await?,
                _ => return Ok(()),
            }
        }
    }

    /// Writes `next` if the batch is still as this driver read it; if not,
    /// reads it again (a cancel came) and says so.
    async fn save(&mut self, next: BatchRecord) -> Result<bool, StoreError> {
        let store = self.env.store();
        if store.set_batch(&next, &self.worker, self.b.status).await? {
            self.b = next;
            return Ok(true);
        }
        match store.batch(None, &self.b.id).await? {
            Some(now) if now.claimed_by.as_deref() == Some(self.worker.as_str()) => {
                if now.status == BatchStatus::Cancelling {
                    self.stopping.get_or_insert(Ending::Cancelled);
                }
                // The counts are this run's.
                let counts = self.b.counts;
                self.b = now;
                self.b.counts = counts;
            }
            _ => self.stop.cancel(),
        }
        Ok(false)
    }

    /// Checks and routes a line as its endpoint's face would, and whether
    /// the batch's key may use its route.
    fn plan(&mut self, body: Map<String, Value>) -> Result<Planned, LineRefusal> {
        let planned = self
            .env
            .plan_line(&self.b.tenant, self.dialect, body)
            .map_err(|r| self.own(r))?;
        if let Some(key) = self.b.key_id.as_deref() {
            let env = &self.env;
            let allowed = *self
                .allowed
                .entry(planned.route.name.clone())
                .or_insert_with(|| env.key_allows(key, &planned.route.name));
            if !allowed {
                return Err(self.own(LineRefusal {
                    status: 403,
                    code: "model_not_allowed".into(),
                    message: format!(
                        "the batch's API key may not use model `{}`",
                        planned.route.name
                    ),
                    param: Some("body.model".into()),
                    fails_batch: true,
                }));
            }
        }
        Ok(planned)
    }

    /// A refusal as this batch takes it: a Message Batch has no
    /// validation that fails it whole (Anthropic's requests each end on
    /// their own), so every refusal is its line's.
    fn own(&self, mut r: LineRefusal) -> LineRefusal {
        if self.dialect == Dialect::Messages {
            r.fails_batch = false;
        }
        r
    }

    /// Notes a line's end in the progress counts.
    fn count(&mut self, job: &JobRecord) {
        match job.state {
            JobState::Succeeded => self.b.counts.completed += 1,
            JobState::Failed | JobState::Cancelled => self.b.counts.failed += 1,
            JobState::Queued | JobState::Running => {}
        }
    }

    /// Writes the progress counts now and then (and so notices a cancel).
    async fn progress(&mut self, now: bool) -> Result<(), StoreError> {
        if !now && self.last_progress.elapsed() < PROGRESS_EVERY {
            return Ok(());
        }
        self.last_progress = Instant::now();
        if self.stopping.is_none() && now_ms() >= self.b.expires_at {
            self.stopping = Some(Ending::Expired);
        }
        let next = self.b.clone();
        self.save(next).await?;
        Ok(())
    }

    /// The job of a line: its key's (a resumed run), or a new one.
    fn new_job(&self, custom_id: &str, p: &Planned) -> NewJob {
        let forwarded = Forwarded::default();
        let intent = Intent {
            asked: &p.request,
            request: &p.request,
            dialect: self.dialect,
            forwarded: &forwarded,
            fp: &p.fp,
            metadata: None,
            key_id: self.b.key_id.as_deref(),
        };
        NewJob {
            id: uuid::Uuid::now_v7().to_string(),
            tenant: self.b.tenant.clone(),
            idempotency_key: line_key(&self.b.id, custom_id),
            payload_hash: payload_hash(&self.b.tenant, &p.route, &intent),
            fingerprint: p.fp.to_string(),
            route: p.route.model.to_string(),
            request: Value::Object(p.request.clone()).to_string(),
            dialect: self.dialect.as_str().to_string(),
            forwarded: None,
            metadata: None,
            key_id: self.b.key_id.clone(),
            batch_id: Some(self.b.id.clone()),
            created_at: now_ms(),
        }
    }

    /// Creates a line's job already ended as `from` ended, counting what
    /// it saved (once, when it is made).
    async fn answered(
        &mut self,
        mut job: NewJob,
        from: &JobRecord,
        route: &Arc<crate::routes::Route>,
        shared: &'static str,
    ) -> Result<JobRecord, StoreError> {
        job.metadata = Some(json!({ANSWERED_BY: from.id, SHARED: shared}).to_string());
        let store = self.env.store().clone();
        match store.create_answered(&job, from, now_ms()).await? {
            Created::New(j) => {
                if j.state == JobState::Succeeded {
                    let attempts = store.attempts(&from.id).await.unwrap_or_default();
                    let answer = job_answer(from, route, &attempts);
                    let tenant: Arc<str> = Arc::from(self.b.tenant.as_str());
                    let outcome = if shared == "batch" {
                        Outcome::Follower
                    } else {
                        Outcome::CacheHit
                    };
                    self.env.core().finish(Finish {
                        tenant: Some(&tenant),
                        route: Some(&route.name),
                        count: Some(Count::Answered(outcome)),
                        priced: Some(route),
                        answered: Some(&answer),
                        ..Finish::default()
                    });
                }
                Ok(j)
            }
            Created::Existing(j) => Ok(j),
        }
    }

    /// `in_progress` (or `cancelling`): the two passes. Returns how the
    /// run ended.
    async fn execute(&mut self) -> Result<Ending, StoreError> {
        if self.b.status == BatchStatus::Cancelling {
            self.stopping = Some(Ending::Cancelled);
        }
        let store = self.env.store().clone();
        let tenant = self.b.tenant.clone();
        // Counted again from the start: a resumed run meets the lines
        // already done.
        self.b.counts.completed = 0;
        self.b.counts.failed = 0;
        self.b.counts.deduplicated = 0;
        self.b.counts.reused = 0;
        // The first line of each fingerprint: its number and custom_id.
        let mut firsts: HashMap<Fingerprint, (u64, String)> = HashMap::new();
        let mut pending: FuturesUnordered<Waiting> = FuturesUnordered::new();
        let mut upstream = upstream::Groups::default();
        let mut in_flight: HashMap<Arc<str>, usize> = HashMap::new();
        let deadline = Instant::now()
            + Duration::from_millis(u64::try_from(self.b.expires_at - now_ms()).unwrap_or(0));

        // First pass: the first line of each fingerprint.
        let mut reader = LineReader::new(store.clone(), &self.b.input_file_id);
        let mut n = 0u64;
        while let Some(line) = reader.next().await? {
            let Line::Text(text) = line else { continue };
            if blank(&text) {
                continue;
            }
            n += 1;
            let Ok(parsed) = parse_line(&text, &self.b.endpoint) else {
                continue;
            };
            let Ok(p) = self.plan(parsed.body) else {
                // In the error file as its face would have refused it.
                self.b.counts.failed += 1;
                continue;
            };
            if firsts.contains_key(&p.fp) {
                continue;
            }
            firsts.insert(p.fp, (n, parsed.custom_id.clone()));
            self.progress(false).await?;
            let key = line_key(&self.b.id, &parsed.custom_id);
            let made = if self.fresh {
                None
            } else {
                store.job_by_key(&tenant, &key).await?
            };
            let job = match made {
                // Held for a provider batch by an earlier run.
                Some(j) if j.not_before == HELD && j.state == JobState::Queued => {
                    self.hold(&mut upstream, &j, &p).await?;
                    continue;
                }
                Some(j) => j,
                None if self.stopping.is_some() => continue,
                None => {
                    let reuse = p.route.config.batch.reuse;
                    let earlier = if reuse.is_zero() {
                        None
                    } else {
                        store
                            .earlier_answer(
                                &tenant,
                                &p.fp.to_string(),
                                &self.b.id,
                                now_ms() - ms(reuse),
                            )
                            .await?
                    };
                    let new = self.new_job(&parsed.custom_id, &p);
                    match earlier {
                        Some(e) => self.answered(new, &e, &p.route, "earlier_batch").await?,
                        // Sent with the others in a provider batch.
                        None if self.sends_upstream(&p) => {
                            match store.create_line(&new, true).await? {
                                Some(Created::New(j) | Created::Existing(j))
                                    if j.not_before == HELD && j.state == JobState::Queued =>
                                {
                                    self.hold(&mut upstream, &j, &p).await?;
                                    continue;
                                }
                                Some(Created::New(j) | Created::Existing(j)) => j,
                                None => {
                                    self.progress(true).await?;
                                    self.stopping.get_or_insert(Ending::Cancelled);
                                    continue;
                                }
                            }
                        }
                        None => {
                            // The route's window: wait for a line of it to end.
                            let limit = p.route.config.batch.concurrency as usize;
                            while in_flight.get(&p.route.name).copied().unwrap_or(0) >= limit {
                                self.settle_next(&mut pending, &mut in_flight).await?;
                            }
                            self.env.batches().pace(&p.route).await;
                            if self.stopping.is_some() {
                                continue;
                            }
                            match store.create_line(&new, false).await? {
                                Some(Created::New(j) | Created::Existing(j)) => {
                                    self.env.jobs().wake();
                                    j
                                }
                                // Cancelled meanwhile: no line starts.
                                None => {
                                    self.progress(true).await?;
                                    self.stopping.get_or_insert(Ending::Cancelled);
                                    continue;
                                }
                            }
                        }
                    }
                }
            };
            if job.state.is_final() || job.state == JobState::Failed {
                self.count(&job);
                if job
                    .metadata
                    .as_deref()
                    .is_some_and(|m| m.contains("earlier_batch"))
                {
                    self.b.counts.reused += 1;
                }
                continue;
            }
            *in_flight.entry(p.route.name.clone()).or_default() += 1;
            pending.push(self.waiting(&p.route, job.id.clone(), deadline));
        }
        // The lines held for providers' Batch APIs: sent, waited for; those
        // given back to the job workers are waited for as the others.
        if !upstream.is_empty() {
            for (route, id) in self.send_upstream(upstream).await? {
                *in_flight.entry(route.name.clone()).or_default() += 1;
                pending.push(self.waiting(&route, id, deadline));
            }
        }
        while !pending.is_empty() {
            self.settle_next(&mut pending, &mut in_flight).await?;
        }

        // Second pass: every other line, answered by the first of its
        // fingerprint.
        let mut reader = LineReader::new(store.clone(), &self.b.input_file_id);
        let mut n = 0u64;
        while let Some(line) = reader.next().await? {
            let Line::Text(text) = line else { continue };
            if blank(&text) {
                continue;
            }
            n += 1;
            let Ok(parsed) = parse_line(&text, &self.b.endpoint) else {
                continue;
            };
            let Ok(p) = self.plan(parsed.body) else {
                continue;
            };
            let Some((first, first_id)) = firsts.get(&p.fp) else {
                continue;
            };
            if *first == n {
                continue;
            }
            self.progress(false).await?;
            let key = line_key(&self.b.id, &parsed.custom_id);
            let made = if self.fresh {
                None
            } else {
                store.job_by_key(&tenant, &key).await?
            };
            let job = match made {
                Some(j) => j,
                None => {
                    let from = store
                        .job_by_key(&tenant, &line_key(&self.b.id, first_id))
                        .await?;
                    // A first line that never ran or has not ended (the
                    // batch was cancelled or expired): this one is not run
                    // either.
                    let Some(from) = from.filter(|j| {
                        matches!(
                            j.state,
                            JobState::Succeeded | JobState::Failed | JobState::Cancelled
                        )
                    }) else {
                        continue;
                    };
                    let new = self.new_job(&parsed.custom_id, &p);
                    self.answered(new, &from, &p.route, "batch").await?
                }
            };
            self.count(&job);
            self.b.counts.deduplicated += 1;
        }
        self.progress(true).await?;
        // Another pass (after a cancel) meets the jobs this one made.
        self.fresh = false;
        Ok(self.stopping.unwrap_or(Ending::Completed))
    }

    /// The wait for line job `id` of `route` to end.
    fn waiting(&self, route: &Arc<crate::routes::Route>, id: String, deadline: Instant) -> Waiting {
        let (jobs, tenant, name) = (
            self.env.jobs().clone(),
            self.b.tenant.clone(),
            route.name.clone(),
        );
        let late = {
            let a = &route.config.attempts;
            a.late_result_window.max(a.timeout)
        };
        Box::pin(async move {
            (
                name,
                line_settled(&jobs, &tenant, &id, deadline, late).await,
            )
        })
    }

    /// Waits for the next line in flight to end (writing progress while it
    /// waits), and counts it.
    async fn settle_next(
        &mut self,
        pending: &mut FuturesUnordered<Waiting>,
        in_flight: &mut HashMap<Arc<str>, usize>,
    ) -> Result<(), StoreError> {
        loop {
            let tick = tokio::time::sleep(PROGRESS_EVERY);
            tokio::select! {
                next = pending.next() => {
                    let Some((route, ended)) = next else { return Ok(()) };
                    if let Some(n) = in_flight.get_mut(&route) {
                        *n = n.saturating_sub(1);
                    }
                    match ended {
                        Ok(job) => self.count(&job),
                        // Not ended by the batch's deadline (or held by an
                        // unknown attempt): the error file says so.
                        Err(JobError::InProgress { .. }) => {
                            self.stopping.get_or_insert(Ending::Expired);
                        }
                        Err(JobError::Store(e)) => return Err(e),
                        Err(e) => tracing::warn!(batch = %self.b.id, error = %e, "cannot wait for a line"),
                    }
                    return Ok(());
                }
                () = tick => self.progress(true).await?,
            }
        }
    }

    /// Writes the output and error files from the lines' jobs, in the
    /// input's order, and ends the batch.
    async fn finalize(&mut self, ending: Ending) -> Result<(), StoreError> {
        let store = self.env.store().clone();
        let live = self.env.live();
        let expires = now_ms() + ms(live.config.batches.file_retention);
        let mut out = FileWriter::new(
            store.clone(),
            &self.b.tenant,
            format!("{}_output.jsonl", self.b.id),
            expires,
        );
        let mut err = FileWriter::new(
            store.clone(),
            &self.b.tenant,
            format!("{}_error.jsonl", self.b.id),
            expires,
        );
        let mut counts = self.b.counts;
        counts.completed = 0;
        counts.failed = 0;
        counts.deduplicated = 0;
        counts.reused = 0;
        counts.not_run = 0;
        let mut reader = LineReader::new(store.clone(), &self.b.input_file_id);
        while let Some(line) = reader.next().await? {
            if self.stop.is_cancelled() {
                return Ok(());
            }
            let Line::Text(text) = line else { continue };
            if blank(&text) {
                continue;
            }
            let Ok(parsed) = parse_line(&text, &self.b.endpoint) else {
                continue;
            };
            let custom_id = parsed.custom_id.clone();
            let refused = self.plan(parsed.body).err();
            let job = match &refused {
                Some(_) => None,
                None => {
                    store
                        .job_by_key(&self.b.tenant, &line_key(&self.b.id, &custom_id))
                        .await?
                }
            };
            if let Some(j) = &job
                && let Some(m) = j.metadata.as_deref()
                && j.batch_id.as_deref() == Some(self.b.id.as_str())
            {
                if m.contains("\"earlier_batch\"") {
                    counts.reused += 1;
                } else if m.contains(&format!("\"{SHARED}\":\"batch\"")) {
                    counts.deduplicated += 1;
                }
            }
            if job.is_none() && refused.is_none() && ending != Ending::Completed {
                counts.not_run += 1;
            }
            let written = output_line(&custom_id, refused.as_ref(), job.as_ref(), ending);
            match written {
                Written::Output(text) => {
                    counts.completed += 1;
                    out.line(text.as_bytes()).await?;
                }
                Written::Error(text) => {
                    counts.failed += 1;
                    err.line(text.as_bytes()).await?;
                }
            }
        }
        let mut next = self.b.clone();
        next.counts = counts;
        let (output_file_id, error_file_id) = (out.finish().await?, err.finish().await?);
        next.output_file_id.clone_from(&output_file_id);
        next.error_file_id.clone_from(&error_file_id);
        let now = now_ms();
        match ending {
            Ending::Completed => {
                next.status = BatchStatus::Completed;
                next.completed_at = Some(now);
            }
            Ending::Cancelled => {
                next.status = BatchStatus::Cancelled;
                next.cancelled_at = Some(now);
            }
            Ending::Expired => {
                next.status = BatchStatus::Expired;
                next.expired_at = Some(now);
            }
        }
        if !self.save(next).await? && self.b.status == BatchStatus::Cancelling {
            // Cancelled while the files were written: they hold every line
            // as it ended; the batch is cancelled with them.
            let mut again = self.b.clone();
            again.counts = counts;
            again.output_file_id = output_file_id;
            again.error_file_id = error_file_id;
            again.status = BatchStatus::Cancelled;
            again.cancelled_at = Some(now_ms());
            self.save(again).await?;
        }
        Ok(())
    }
}

/// How often a line in flight is looked at for an `unknown` attempt no
/// answer can end any more.
const HELD_CHECK: Duration = Duration::from_secs(1);

/// Waits for a line's job to end, or to be held by an `unknown` attempt
/// that nothing can end but an operator (docs/design.md, "Batches"): the
/// job is returned as it is, and its line goes to the error file as
/// `unknown` rather than holding the whole batch.
async fn line_settled(
    jobs: &Jobs,
    tenant: &str,
    id: &str,
    deadline: Instant,
    late: Duration,
) -> Result<JobRecord, JobError> {
    loop {
        let next = deadline.min(Instant::now() + HELD_CHECK);
        match jobs.wait(tenant, id, next).await {
            Err(JobError::InProgress { .. }) if Instant::now() < deadline => {
                let attempts = jobs.store.attempts(id).await?;
                if held_for_good(&attempts, late, now_ms()) {
                    return jobs
                        .store
                        .job(Some(tenant), id)
                        .await?
                        .ok_or(JobError::NotFound);
                }
            }
            other => return other,
        }
    }
}

/// Whether a job is held by an `unknown` attempt whose call no longer
/// listens for an answer: its process died (the lease expired) or its
/// late window (`late`, from its start) has passed; and no attempt runs.
fn held_for_good(attempts: &[AttemptRecord], late: Duration, now: i64) -> bool {
    let running = attempts
        .iter()
        .any(|a| matches!(a.state, AttemptState::Starting | AttemptState::Running));
    let dead = attempts.iter().any(|a| {
        a.state == AttemptState::Unknown
            && (a.reason.as_deref() == Some(LEASE_EXPIRED) || now >= a.started_at + ms(late))
    });
    dead && !running
}

#[cfg(test)]
mod tests;
mod upstream;
mod validate;

use validate::{blank, parse_line};

pub use upstream::provider_batches;
