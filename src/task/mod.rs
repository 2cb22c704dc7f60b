//! The core of the request path: a task in, a delivery out (docs/design.md,
//! "The request path"). It knows no HTTP and no wire format.
//!
//! A [`Task`] is what one request wants done, in no endpoint's words: its
//! tenant, its route, its fingerprint, the request its endpoint's [`Wire`]
//! sends, and what the client's cache directives allow. [`Core::obtain`]
//! runs the stages in order, one function each: the result cache
//! ([`Coalescer::cached`]), the route's targets in order ([`Walk`], the one
//! target loop, which the job executor walks too), and on each target its
//! flight ([`Coalescer::via_target`]), whose leader calls the provider.
//! [`Core::obtain_batch`] does the same for tasks that may share an
//! upstream call (the items of an embeddings batch). A job's attempt
//! ([`Core::attempt`]) takes the flight stage on the target its own walk
//! chose. [`Core::finish`] is the one place where a request is counted and
//! written to the request log, whichever way it went.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::task::TaskTracker;

use crate::answer::{Answer, Verdict};
use crate::budgets::Payer;
use crate::certification::failover::{NoTarget, Walk};
use crate::fingerprint::Fingerprint;
use crate::flight::{Ask, Coalescer, Delivery, FlightError, RequestBody, Source, Wire, reported};
use crate::metrics::Metrics;
use crate::outcome::{Outcome, Refusal};
use crate::reqlog::{Cost, Entry, RequestLog};
use crate::routes::{Route, Target};
use crate::telemetry::{Attribute, Kind, Telemetry, Trace, attr, provider_name};

/// Why the core gave a task no answer at all (an answer that is an error
/// is a [`Delivery`] like any other). The faces turn these into their
/// error bodies, in one place each.
#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    /// The flight stage gave up (a follower's wait ran out, ...).
    #[error(transparent)]
    Flight(#[from] FlightError),
    /// No target of the route may take the work now.
    #[error("{0}")]
    NoTarget(NoTarget),
}

/// What a client's cache directives allow for its request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CachePolicy {
    /// Read the result and negative caches (`no-cache` turns it off).
    pub read: bool,
    /// Keep the answer in the caches (`no-store` turns it off).
    pub write: bool,
    /// Share the call with identical requests (`no-store` turns it off).
    pub coalesce: bool,
}

impl Default for CachePolicy {
    fn default() -> CachePolicy {
        CachePolicy {
            read: true,
            write: true,
            coalesce: true,
        }
    }
}

/// What one request wants done, whatever its endpoint.
#[derive(Clone, Copy)]
pub struct Task<'a> {
    pub tenant: &'a Arc<str>,
    pub route: &'a Arc<Route>,
    pub fp: Fingerprint,
    /// The request its endpoint sends (a follower lets its parse go while
    /// it waits).
    pub body: &'a RequestBody,
    /// The endpoint's part of an upstream call.
    pub wire: &'static dyn Wire,
    pub policy: CachePolicy,
    /// The span of the request (or job attempt) the task is for, when
    /// traces are on.
    pub trace: Option<&'a Trace>,
    /// Who pays for a call the task leads (its key and tenant), when
    /// either has a budget or its spend is counted.
    pub payer: Option<&'a Payer>,
}

impl Task<'_> {
    /// The flight stage's rules for a request: the route's switches and
    /// the client's directives.
    fn ask(&self) -> Ask<'_> {
        let cfg = &self.route.config;
        let read = cfg.cache.enabled && self.policy.read;
        Ask {
            tenant: self.tenant,
            route: self.route,
            fp: &self.fp,
            body: self.body,
            wire: self.wire,
            read_cache: read,
            read_negative: read,
            write_cache: self.policy.write,
            coalesce: cfg.coalesce.enabled && self.policy.coalesce,
            pinned: false,
            late: None,
            trace: self.trace,
            payer: self.payer,
        }
    }
}

/// How a job attempt runs on its target (see [`Core::attempt`]).
#[derive(Debug, Clone, Copy)]
pub struct AttemptRules {
    /// How long a late answer still counts: the attempt's call (or the
    /// flight it follows) may last that long.
    pub late: Duration,
    /// Share the call with identical work in flight (a retry on a target
    /// the job already tried makes its own).
    pub share: bool,
    /// Take a cached answer of this very target.
    pub read_cache: bool,
}

/// The gateway's handles that the request path uses.
pub struct Core {
    pub coalescer: Coalescer,
    pub metrics: Arc<Metrics>,
    pub reqlog: Arc<RequestLog>,
    /// Work that outlives its request (a streamed answer's log line, written
    /// when the stream ends): the shutdown waits for it within its grace.
    pub background: TaskTracker,
    /// Traces, when `[telemetry]` names a collector.
    pub telemetry: Arc<Telemetry>,
}

impl Core {
    /// The answer for a request: the result cache, then the route's
    /// targets in order, each through its flight. A failure the provider
    /// certainly caused moves everybody on to the next target, where they
    /// coalesce again, if the failover rule lets the work go there
    /// (certified for the route's contract, circuit not open).
    pub async fn obtain(&self, task: &Task<'_>) -> Result<Delivery, TaskError> {
        let ask = task.ask();
        if ask.read_cache {
            let found = self.coalescer.cached(&task.fp);
            if let Some(t) = task.trace {
                let hit = Attribute::new("idem.cache.hit", found.is_some());
                t.child("cache lookup", Kind::Internal, None, vec![], vec![hit])
                    .end();
            }
            if let Some(d) = found {
                return Ok(d);
            }
        }
        let mut walk = Walk::once(task.route);
        let mut last: Option<Delivery> = None;
        while let Some(target) = walk.next(&self.metrics) {
            let d = self.coalescer.via_target(&ask, target).await?;
            let d = match self.settled(task, d).await {
                Settled::Answer(d) => return Ok(d),
                Settled::Failed(d) => d,
            };
            let definite = definite_failure(&d);
            if walk.has_more() && definite {
                tracing::info!(
                    route = %task.route.name,
                    from = %target.provider.name,
                    "failing over to the next target"
                );
                last = Some(d);
                continue;
            }
            return Ok(d);
        }
        last.ok_or_else(|| TaskError::NoTarget(walk.no_target()))
    }

    /// [`Core::obtain`] for tasks of one route that may share upstream
    /// calls: on each target, the tasks still without an answer go through
    /// their flights together, and those this request leads make one call.
    /// A task whose failure the provider certainly caused moves on to the
    /// next target with the others like it. The results are in the tasks'
    /// order.
    pub async fn obtain_batch(&self, tasks: &[Task<'_>]) -> Vec<Result<Delivery, TaskError>> {
        let mut out: Vec<Option<Result<Delivery, TaskError>>> =
            std::iter::repeat_with(|| None).take(tasks.len()).collect();
        let mut pending = Vec::new();
        for (i, task) in tasks.iter().enumerate() {
            match task
                .ask()
                .read_cache
                .then(|| self.coalescer.cached(&task.fp))
            {
                Some(Some(d)) => out[i] = Some(Ok(d)),
                _ => pending.push(i),
            }
        }
        let Some(first) = tasks.first() else {
            return Vec::new();
        };
        let mut walk = Walk::once(first.route);
        let mut last: Vec<Option<Delivery>> =
            std::iter::repeat_with(|| None).take(tasks.len()).collect();
        while !pending.is_empty()
            && let Some(target) = walk.next(&self.metrics)
        {
            let asks: Vec<Ask<'_>> = pending.iter().map(|&i| tasks[i].ask()).collect();
            let delivered = self.coalescer.via_target_batch(&asks, target).await;
            let mut next = Vec::new();
            for (&i, d) in pending.iter().zip(delivered) {
                let d = match d {
                    Ok(d) => d,
                    Err(e) => {
                        out[i] = Some(Err(e.into()));
                        continue;
                    }
                };
                match self.settled(&tasks[i], d).await {
                    Settled::Answer(d) => out[i] = Some(Ok(d)),
                    Settled::Failed(d) if walk.has_more() && definite_failure(&d) => {
                        last[i] = Some(d);
                        next.push(i);
                    }
                    Settled::Failed(d) => out[i] = Some(Ok(d)),
                }
            }
            if !next.is_empty() {
                tracing::info!(route = %first.route.name, from = %target.provider.name, tasks = next.len(), "failing over to the next target");
            }
            pending = next;
        }
        let mut no_target = Some(walk.no_target());
        out.into_iter()
            .zip(last)
            .map(|(done, last)| match (done, last) {
                (Some(r), _) => r,
                (None, Some(d)) => Ok(d),
                (None, None) => Err(TaskError::NoTarget(
                    no_target.take().unwrap_or(NoTarget(Vec::new())),
                )),
            })
            .collect()
    }

    /// A delivery once it is known to succeed (a live stream's success head
    /// is enough) or to have failed.
    async fn settled(&self, task: &Task<'_>, mut d: Delivery) -> Settled {
        let answer = match &d.source {
            Source::Done(a) => a.clone(),
            Source::Live(f) => {
                let head = f.head(None).await;
                d.outcome = reported(d.outcome, f);
                match head {
                    Some(h) if h.status.is_success() => return Settled::Answer(d),
                    _ => d.answer().await,
                }
            }
        };
        let success = answer.is_success();
        let d = Delivery {
            source: Source::Done(answer),
            ..d
        };
        if success {
            return Settled::Answer(d);
        }
        if d.outcome == Outcome::Follower {
            self.metrics
                .leader_error_shared(task.tenant, &task.route.name);
        }
        Settled::Failed(d)
    }

    /// One job attempt on the target it names: the flight stage only (the
    /// attempt's walk chose the target, and its own rules replace the
    /// client's: no negative cache, the cache only for an answer of this
    /// target, a call that lives as long as a late answer counts).
    pub async fn attempt(
        &self,
        task: &Task<'_>,
        target: &Target,
        rules: AttemptRules,
    ) -> Result<Delivery, FlightError> {
        self.coalescer
            .via_target(&attempt_ask(task, rules), target)
            .await
    }

    /// One job attempt of an embeddings request on the target it names:
    /// [`Core::attempt`] for its items together (those it leads share one
    /// call), the results in the items' order.
    pub async fn attempt_items(
        &self,
        tasks: &[Task<'_>],
        target: &Target,
        rules: AttemptRules,
    ) -> Vec<Result<Delivery, FlightError>> {
        let asks: Vec<Ask<'_>> = tasks.iter().map(|t| attempt_ask(t, rules)).collect();
        self.coalescer.via_target_batch(&asks, target).await
    }

    /// Counts a request and writes its request-log line: the one place
    /// that does either, once per request, whichever way it went. A line
    /// whose answer is a stream still running is written when the stream
    /// ends (its upstream time and token counts are known then; its latency
    /// stays the time to the answer's head).
    pub fn finish(&self, f: Finish<'_>) {
        // The dashboard's figures: latency, timeouts, contract violations.
        observe(&self.metrics, &f);
        match f.count {
            Some(Count::Answered(outcome)) => {
                if let (Some(tenant), Some(route)) = (f.tenant, f.route) {
                    self.metrics.request(tenant, route, outcome);
                }
            }
            Some(Count::Refused(why)) => {
                self.metrics
                    .refused(f.tenant.map(|t| &**t), f.route.map(|r| &**r), why);
            }
            None => {}
        }
        if let (Some(items), Some(tenant), Some(route)) = (f.items, f.tenant, f.route) {
            self.metrics.embedding_items(
                tenant,
                route,
                items.by_outcome,
                items.saved_tokens,
                items.saved_cost,
            );
        }
        // A chat request answered without a call of its own saved that
        // call: counted once its answer is known (a live stream's at its
        // end). An embeddings request's items are counted above.
        let saver = match f.count {
            Some(Count::Answered(o)) if o.saved_a_call() && f.items.is_none() => Some(o),
            _ => None,
        };
        // An embeddings request's line says what its saved items would
        // have cost (its sent items share calls with other requests).
        let items_cost = f.items.map(|i| i.saved_cost.map(Cost::Saved));
        let (Some(line), Some(tenant), Some(route)) = (f.line, f.tenant, f.route) else {
            if let (Some(a), Some(tenant), Some(route)) = (f.answered, f.tenant, f.route) {
                account(
                    &self.metrics,
                    tenant,
                    route,
                    saver,
                    a,
                    f.priced.map(|r| &**r),
                );
            }
            if let Some(t) = f.trace {
                let outcome = match f.count {
                    Some(Count::Answered(o)) => o.as_str(),
                    Some(Count::Refused(r)) => r.as_str(),
                    None => "",
                };
                let tenant = f.tenant.map(|t| &**t);
                end_span(
                    t,
                    SpanEnd {
                        outcome,
                        tenant,
                        ..SpanEnd::default()
                    },
                );
            }
            return;
        };
        let logged = match line.body {
            Some(body) if self.reqlog.records_bodies() => body.get().ok(),
            _ => None,
        };
        match line.answer {
            Some(Source::Live(flight)) if !flight.is_done() => {
                let head_latency = line.started.elapsed();
                let (tenant, route) = (tenant.clone(), route.clone());
                let (fp, outcome, status, started, endpoint) = (
                    line.fp,
                    line.outcome,
                    line.status,
                    line.started,
                    line.endpoint,
                );
                let reqlog = self.reqlog.clone();
                let (metrics, priced) = (self.metrics.clone(), f.priced.cloned());
                let trace = f.trace.cloned();
                let job = line.job.map(|(id, n)| (id.to_string(), n));
                self.background.spawn(async move {
                    // Every flight ends: its leader's ticket finishes it on drop.
                    let answer = flight.done(None).await;
                    if let Some(t) = &trace {
                        let end = SpanEnd {
                            outcome,
                            tenant: Some(&tenant),
                            fp: Some(&fp),
                            status,
                            job: job.as_ref().map(|(id, n)| (id.as_str(), *n)),
                            answer: answer.as_deref(),
                            route: priced.as_deref(),
                        };
                        end_span(t, end);
                    }
                    let cost = answer.as_deref().and_then(|a| {
                        account(&metrics, &tenant, &route, saver, a, priced.as_deref())
                    });
                    let mut entry = Entry::new(&tenant, &route, &fp, outcome, status, started)
                        .endpoint(endpoint)
                        .answer(answer.as_deref())
                        .body_if(logged.as_deref())
                        .cost(cost);
                    entry.latency = head_latency;
                    reqlog.write(&entry);
                });
            }
            answer => {
                let answer = match answer {
                    Some(Source::Done(done)) => Some(done),
                    Some(Source::Live(f)) => f.answer(),
                    None => line.answer_of_job,
                };
                let cost = match items_cost {
                    Some(cost) => cost,
                    None => answer.as_deref().and_then(|a| {
                        account(
                            &self.metrics,
                            tenant,
                            route,
                            saver,
                            a,
                            f.priced.map(|r| &**r),
                        )
                    }),
                };
                if let Some(t) = f.trace {
                    let end = SpanEnd {
                        outcome: line.outcome,
                        tenant: Some(tenant),
                        fp: Some(&line.fp),
                        status: line.status,
                        job: line.job,
                        answer: answer.as_deref(),
                        route: f.priced.map(|r| &**r),
                    };
                    end_span(t, end);
                }
                let mut entry = Entry::new(
                    tenant,
                    route,
                    &line.fp,
                    line.outcome,
                    line.status,
                    line.started,
                )
                .endpoint(line.endpoint)
                .answer(answer.as_deref())
                .body_if(logged.as_deref())
                .usage(line.usage)
                .cost(cost);
                if let Some((id, attempt)) = line.job {
                    entry = entry.job(id, attempt);
                }
                self.reqlog.write(&entry);
            }
        }
    }
}

/// What a request's span says when it ends.
#[derive(Default)]
struct SpanEnd<'a> {
    outcome: &'a str,
    tenant: Option<&'a str>,
    fp: Option<&'a Fingerprint>,
    status: u16,
    job: Option<(&'a str, Option<i32>)>,
    answer: Option<&'a Answer>,
    route: Option<&'a Route>,
}

/// Ends a request's span with the GenAI conventions' attributes and
/// idem's own.
fn end_span(t: &Trace, e: SpanEnd<'_>) {
    let mut a = vec![Attribute::new(attr::OUTCOME, e.outcome.to_string())];
    if let Some(tenant) = e.tenant {
        a.push(Attribute::new(attr::TENANT, tenant.to_string()));
    }
    if let Some(fp) = e.fp {
        a.push(Attribute::new(attr::FINGERPRINT, fp.to_string()));
    }
    if e.status > 0 {
        a.push(Attribute::new(attr::STATUS, i64::from(e.status)));
    }
    if let Some((id, n)) = e.job {
        a.push(Attribute::new(attr::JOB, id.to_string()));
        if let Some(n) = n {
            a.push(Attribute::new(attr::ATTEMPT, i64::from(n)));
        }
    }
    if let Some(answer) = e.answer {
        a.push(Attribute::new(
            attr::RESPONSE_MODEL,
            answer.model.to_string(),
        ));
        let kind = e.route.and_then(|r| {
            r.targets
                .iter()
                .find(|t| t.provider.name == answer.provider)
                .map(|t| provider_name(t.provider.kind))
        });
        if let Some(kind) = kind {
            a.push(Attribute::new(attr::PROVIDER, kind));
        }
        if let Some(tokens) = answer.tokens() {
            a.push(Attribute::new(attr::INPUT_TOKENS, tokens.input as i64));
            a.push(Attribute::new(attr::OUTPUT_TOKENS, tokens.output as i64));
        }
    }
    t.set(a);
    if e.status >= 400 || e.answer.is_some_and(|a| !a.is_success()) {
        t.fail(format!("{} ({})", e.outcome, e.status));
    }
    t.end();
}

/// What the dashboard's timeline takes from a request's end: its latency
/// (a job's creation is no answer: none), and the answer it was counted
/// with.
fn observe(metrics: &Metrics, f: &Finish<'_>) {
    let Some(route) = f.route else { return };
    let line = f.line.as_ref();
    let latency = line
        .filter(|l| l.outcome != "created")
        .map(|l| l.started.elapsed());
    let outcome = match f.count {
        Some(Count::Answered(o)) => Some(o),
        _ => None,
    };
    let live = match line.and_then(|l| l.answer.as_ref()) {
        Some(Source::Live(flight)) => flight.answer(),
        _ => None,
    };
    let answer = match line {
        Some(l) => match &l.answer {
            Some(Source::Done(a)) => Some(&**a),
            Some(Source::Live(_)) => live.as_deref(),
            None => l.answer_of_job.as_deref(),
        },
        None => f.answered,
    };
    metrics.request_done(route, latency, outcome, answer);
}

/// The money of one request's answer: for a request answered without a
/// call of its own (`saver`), the tokens and cost of the call it did not
/// make, counted as saved; else what its answer's call cost (counted as
/// spent where the call was made, in the flight). `None`: no tokens, or no
/// price (the cost is unknown).
fn account(
    metrics: &Metrics,
    tenant: &str,
    route: &str,
    saver: Option<Outcome>,
    answer: &Answer,
    priced: Option<&Route>,
) -> Option<Cost> {
    let tokens = answer.tokens()?;
    let price = priced.and_then(|r| r.price_of(&answer.provider, &answer.model));
    if saver.is_some() {
        metrics.saved(tenant, route, tokens, price);
    }
    let cost = price?.cost(&tokens);
    Some(if saver.is_some() {
        Cost::Saved(cost)
    } else {
        Cost::Spent(cost)
    })
}

/// Where a delivery stands.
enum Settled {
    /// A success (or a live stream whose head was a success).
    Answer(Delivery),
    /// A failure, finished.
    Failed(Delivery),
}

/// True for a failure the provider certainly caused that the next target
/// might not: not an error the request itself caused.
fn definite_failure(d: &Delivery) -> bool {
    match &d.source {
        Source::Done(a) => matches!(a.verdict(), Verdict::Failed(_)) && !a.is_request_error(),
        Source::Live(_) => false,
    }
}

/// How a request counts in the metrics.
#[derive(Debug, Clone, Copy)]
pub enum Count {
    /// It got an answer, obtained this way.
    Answered(Outcome),
    /// It got an error of idem's own.
    Refused(Refusal),
}

/// How a request ended, for [`Core::finish`].
#[derive(Default)]
pub struct Finish<'a> {
    /// As far as they are known.
    pub tenant: Option<&'a Arc<str>>,
    pub route: Option<&'a Arc<str>>,
    /// `None` when the request is counted elsewhere: a request that created
    /// a job is counted by the job's first attempt (one job, one incoming
    /// request).
    pub count: Option<Count>,
    /// Its request-log line, once it has a fingerprint.
    pub line: Option<Line<'a>>,
    /// An embeddings request's items.
    pub items: Option<Items<'a>>,
    /// The route, for the prices of its targets: what a request's answer
    /// cost or, answered without a call of its own, saved.
    pub priced: Option<&'a Arc<Route>>,
    /// The answer of a request counted without a line (a job's first
    /// attempt), for what it saved.
    pub answered: Option<&'a Answer>,
    /// The request's span (traces on): ended here, with what happened.
    pub trace: Option<&'a Trace>,
}

/// An embeddings request's items: how many were answered each way, the
/// input tokens those not sent saved, and what they would have cost
/// (None: unknown).
#[derive(Clone, Copy)]
pub struct Items<'a> {
    pub by_outcome: &'a [(Outcome, u64)],
    pub saved_tokens: u64,
    pub saved_cost: Option<f64>,
}

/// A request-log line's parts.
pub struct Line<'a> {
    pub fp: Fingerprint,
    /// The endpoint the request came in by (`chat`, `messages`,
    /// `responses`, `embeddings`, `jobs`): the log's `endpoint`.
    pub endpoint: &'static str,
    /// The log's `outcome`: an [`Outcome`] or [`Refusal`] name, or on the
    /// jobs API `created`.
    pub outcome: &'static str,
    pub status: u16,
    pub started: Instant,
    /// The job and the attempt that completed it, on the job path.
    pub job: Option<(&'a str, Option<i32>)>,
    /// The request (its messages are logged with `log.bodies`).
    pub body: Option<&'a RequestBody>,
    /// Where the answer came from.
    pub answer: Option<Source>,
    /// A job's answer, when there is no flight's.
    pub answer_of_job: Option<Arc<Answer>>,
    /// Token counts, when the answer's own do not say them.
    pub usage: Option<(u64, u64)>,
}

/// A job attempt's ask: its own rules replace the client's.
fn attempt_ask<'a>(task: &'a Task<'_>, rules: AttemptRules) -> Ask<'a> {
    let cfg = &task.route.config;
    Ask {
        read_cache: cfg.cache.enabled && rules.read_cache,
        read_negative: false,
        write_cache: true,
        coalesce: cfg.coalesce.enabled && rules.share,
        pinned: true,
        late: Some(rules.late),
        ..task.ask()
    }
}
