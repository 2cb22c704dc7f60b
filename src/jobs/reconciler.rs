//! The reconciler: what happened to work whose replica died.
//!
//! Every `jobs.reconcile_interval`, on every replica: attempts still
//! `starting`/`running` whose lease ran out become `unknown` (never re-run:
//! the provider may have done the work); jobs claimed by a dead worker with
//! no active attempt go back to the queue; `unknown` attempts past a route's
//! `attempts.auto_resolve_unknown_after` are resolved as failed; finished jobs
//! past `storage.idempotency_retention` are purged so their keys may be
//! reused; expired files and uploads abandoned for an hour are deleted; and
//! the `idem_jobs_unknown` gauge is refreshed.

use tokio_util::sync::CancellationToken;

use crate::jobs::{Env, executor};
use crate::store::{AttemptState, Backend, JobState, now_ms};

/// At start-up: with SQLite only this process uses the file, so an attempt
/// still `starting`/`running` was left by a process that is gone.
pub async fn on_startup(app: &Env) {
    if app.store().backend() == Backend::Sqlite {
        match app.store().expire_attempt_leases(i64::MAX, now_ms()).await {
            Ok(left) => {
                for a in &left {
                    tracing::warn!(job = %a.job_id, attempt = a.n, "attempt left in flight by a previous run is now unknown");
                }
            }
            Err(e) => tracing::error!(error = %e, "cannot reconcile attempts at start-up"),
        }
        // Likewise a batch's claim: its driver is gone, and this process's
        // drivers resume the batch at once rather than after the lease.
        match app.store().release_batch_claims().await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(batches = n, "batches left by a previous run are resumed"),
            Err(e) => tracing::error!(error = %e, "cannot release batch claims at start-up"),
        }
    }
    once(app).await;
}

pub async fn run(app: Env, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(app.live().config.jobs.reconcile_interval);
    // After a stall, one pass and then the interval again, not a burst of
    // passes back to back.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => once(&app).await,
        }
    }
}

/// One pass.
pub async fn once(app: &Env) {
    let store = &app.store();
    let now = now_ms();
    match store.expire_attempt_leases(now, now).await {
        Ok(expired) => {
            for a in &expired {
                tracing::warn!(job = %a.job_id, attempt = a.n, owner = ?a.owner, "attempt lease expired: unknown");
                app.metrics()
                    .attempt(&a.provider.as_str().into(), "unknown");
                app.jobs().changed(&a.job_id);
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot expire attempt leases"),
    }
    match store.expire_job_claims(now).await {
        Ok(n) if n > 0 => {
            tracing::warn!(jobs = n, "requeued jobs abandoned by their worker");
            for _ in 0..n {
                app.jobs().wake();
            }
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot expire job claims"),
    }
    auto_resolve(app, now).await;
    let retention = i64::try_from(app.live().config.storage.idempotency_retention.as_millis())
        .unwrap_or(i64::MAX);
    if let Err(e) = store.purge(now.saturating_sub(retention)).await {
        tracing::warn!(error = %e, "cannot purge old jobs");
    }
    if let Err(e) = store.purge_responses(now.saturating_sub(retention)).await {
        tracing::warn!(error = %e, "cannot purge old stored responses");
    }
    let begun = now.saturating_sub(crate::store::ABANDONED_UPLOAD_MS);
    if let Err(e) = store.sweep_files(begun, now).await {
        tracing::warn!(error = %e, "cannot sweep expired files and abandoned uploads");
    }
    match store.unknown_attempts().await {
        Ok(list) => app.metrics().jobs_unknown.set(list.len() as f64),
        Err(e) => tracing::warn!(error = %e, "cannot count unknown attempts"),
    }
    // Counted once the pass is over: whoever watches it knows that what
    // was due before the pass began has been looked at.
    app.metrics().reconciler_passes.increment(1);
}

async fn auto_resolve(app: &Env, now: i64) {
    let Ok(unknown) = app.store().unknown_attempts().await else {
        return;
    };
    for a in unknown {
        let Ok(Some(job)) = app.store().job(None, &a.job_id).await else {
            continue;
        };
        let Some(route) = app.live().route(&job.route) else {
            continue;
        };
        let policy = &route.config.attempts;
        let Some(after) = policy.auto_resolve_unknown_after else {
            continue;
        };
        let since = a.finished_at.unwrap_or(a.started_at);
        if since + i64::try_from(after.as_millis()).unwrap_or(i64::MAX) > now {
            continue;
        }
        let resolved = app
            .store()
            .finish_attempt(
                &a.job_id,
                a.n,
                AttemptState::Failed,
                Some("auto_resolved"),
                now,
            )
            .await;
        if !matches!(resolved, Ok(true)) {
            continue;
        }
        tracing::warn!(job = %a.job_id, attempt = a.n, "unknown attempt auto-resolved as failed");
        let made = app
            .store()
            .attempts(&a.job_id)
            .await
            .map(|v| executor::budgeted(&v))
            .unwrap_or(usize::MAX);
        if job.state == JobState::Running && made < executor::attempt_budget(policy, &job) {
            if let Ok(true) = app.store().requeue(&a.job_id, None, now, false, now).await {
                app.jobs().wake();
            }
        } else {
            let why = format!("attempt {} was unknown and auto-resolved as failed", a.n);
            let _ = app.store().fail_job(&a.job_id, &why, now).await;
        }
        app.jobs().changed(&a.job_id);
    }
}
