//! The claim: queued jobs taken for this replica's free slots, each with
//! what its run needs (route, stored request) and its first attempt
//! started in the claim's transaction.

use std::collections::HashMap;
use std::sync::Arc;

use serde_json::{Map, Value};

use super::{attempt_budget, budgeted, ms};
use crate::certification::failover;
use crate::dialect::{Dialect, Forwarded};
use crate::fingerprint::Fingerprint;
use crate::jobs::Env;
use crate::routes::Route;
use crate::store::{AttemptRecord, JobRecord, NewAttempt, Room, StoreError, now_ms};

/// What a job needs to run: its route, its request (in its dialect, with
/// the client's answer-changing headers) and fingerprint.
pub(super) struct Prepared {
    pub(super) route: Arc<Route>,
    pub(super) request: Arc<Map<String, Value>>,
    pub(super) dialect: Dialect,
    pub(super) forwarded: Forwarded,
    pub(super) fp: Fingerprint,
}

/// The route and the stored request of a job, or why it cannot run.
pub(super) fn prepare(app: &Env, job: &JobRecord) -> Result<Prepared, String> {
    let Some(route) = app.live().route(&job.route) else {
        return Err(format!("route {} is no longer configured", job.route));
    };
    let (Ok(Value::Object(request)), Ok(fp), Some(dialect)) = (
        serde_json::from_str::<Value>(&job.request),
        job.fingerprint.parse::<Fingerprint>(),
        Dialect::parse(&job.dialect),
    ) else {
        return Err("the stored request cannot be read".into());
    };
    let stored = job
        .forwarded
        .as_deref()
        .and_then(|f| serde_json::from_str::<Value>(f).ok());
    Ok(Prepared {
        route,
        request: Arc::new(request),
        dialect,
        forwarded: Forwarded::from_json(dialect, stored.as_ref()),
        fp,
    })
}

/// A job the dispatcher claimed, with what it learnt of it meanwhile.
pub(super) struct Claimed {
    pub(super) job: JobRecord,
    pub(super) prepared: Result<Prepared, String>,
    /// The job's attempts before this run.
    pub(super) earlier: Vec<AttemptRecord>,
    /// The first attempt of this run, started with the claim, and its
    /// target.
    pub(super) first: Option<(AttemptRecord, usize)>,
}

/// Claims up to `limit` queued jobs (live ones first, at most `lines`
/// batch lines) and starts the first attempt of each that may make one, in one transaction for the batch: the choice its
/// run would make (budget, then the target walk).
pub(super) async fn claim(
    app: &Env,
    limit: usize,
    lines: usize,
) -> Result<Vec<Claimed>, StoreError> {
    let cfg = &app.live().config.jobs;
    let (store, worker) = (&app.jobs().store, &app.jobs().worker_id);
    let now = now_ms();
    let room = Room {
        jobs: u32::try_from(limit).unwrap_or(u32::MAX),
        lines: u32::try_from(lines).unwrap_or(u32::MAX),
    };
    let mut prepared: HashMap<String, (Result<Prepared, String>, Option<usize>)> = HashMap::new();
    let mut choose = |job: &JobRecord, earlier: &[AttemptRecord]| {
        let p = prepare(app, job);
        let mut pick = None;
        if let Ok(p) = &p {
            let used = budgeted(earlier);
            if used < attempt_budget(&p.route.config.attempts, job)
                && !earlier.iter().any(|a| a.state.is_active())
                && let Ok(target) = failover::Walk::attempt(&p.route, used).first(app.metrics())
                && let Some(t) = p.route.targets.get(target)
            {
                pick = Some((
                    NewAttempt {
                        provider: t.provider.name.to_string(),
                        model: t.model.to_string(),
                    },
                    target,
                ));
            }
        }
        let (to, target) = pick.unzip();
        prepared.insert(job.id.clone(), (p, target));
        to
    };
    let claimed = store
        .claim_and_start(
            worker,
            now,
            now + ms(cfg.claim_lease),
            now + ms(cfg.attempt_lease),
            room,
            &mut choose,
        )
        .await?;
    Ok(claimed
        .into_iter()
        .map(|c| {
            let (prepared, target) = prepared
                .remove(&c.job.id)
                .unwrap_or_else(|| (Err("the claimed job was not prepared".into()), None));
            Claimed {
                first: c.started.zip(target),
                job: c.job,
                prepared,
                earlier: c.earlier,
            }
        })
        .collect())
}
