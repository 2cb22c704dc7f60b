//! The store's test suite, written once against [`Store`] and run against
//! both backends: SQLite on a fresh file and PostgreSQL on a fresh schema
//! per test. Races are started together behind barriers, never by sleeps.
//!
//! PostgreSQL is the test process's (`crate::test_services`): the server
//! `IDEM_TEST_DATABASE_URL` names, else the machine's at the default
//! address, else a private one the tests start; when there is none, the
//! PostgreSQL tests fail saying why, they never skip.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use sqlx::Connection;
use tokio::sync::Barrier;

use super::postgres::PgStore;
use super::sqlite::SqliteStore;
use super::{
    AttemptRecord, AttemptResult, AttemptState, AuditEntry, Backend, BudgetRecord, Certification,
    ClaimedJob, Completion, Created, Cursor, JobRecord, JobState, KeyChange, KeyRecord, NewAttempt,
    NewJob, Room, Settlement, StartAttempt, Store, StoredResponse,
};

// ---------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------

const POOL_SIZE: u32 = 8;
/// A fixed clock: tests pass times explicitly, so they never depend on now.
const T0: i64 = 1_700_000_000_000;

type Body = Pin<Box<dyn Future<Output = ()> + Send>>;

fn pg_url() -> String {
    crate::test_services::postgres_url()
}

/// A database that exists for one test and is removed afterwards.
enum Scratch {
    Sqlite(PathBuf),
    Postgres { url: String, schema: String },
}

impl Scratch {
    async fn new(backend: Backend) -> Scratch {
        let id = uuid::Uuid::now_v7().simple().to_string();
        match backend {
            Backend::Sqlite => {
                Scratch::Sqlite(std::env::temp_dir().join(format!("idem-store-test-{id}.db")))
            }
            Backend::Postgres => {
                let url = pg_url();
                let schema = format!("idem_t_{id}");
                let mut admin = pg_admin(&url).await;
                sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
                    .execute(&mut admin)
                    .await
                    .expect("create test schema");
                admin.close().await.ok();
                Scratch::Postgres { url, schema }
            }
        }
    }

    /// The url a store opens: the file, or the server with `search_path`
    /// set to the test's schema (so migrations and queries land there).
    fn url(&self) -> String {
        match self {
            Scratch::Sqlite(path) => format!("sqlite://{}", path.display()),
            Scratch::Postgres { url, schema } => {
                let sep = if url.contains('?') { '&' } else { '?' };
                format!("{url}{sep}options=-c%20search_path%3D{schema}")
            }
        }
    }

    async fn open(&self) -> Arc<dyn Store> {
        let url = self.url();
        match self {
            Scratch::Sqlite(_) => Arc::new(
                SqliteStore::connect(&url, POOL_SIZE)
                    .await
                    .expect("open sqlite store"),
            ),
            Scratch::Postgres { .. } => Arc::new(
                PgStore::connect(&url, POOL_SIZE)
                    .await
                    .expect("open postgres store"),
            ),
        }
    }

    async fn remove(self) {
        match self {
            Scratch::Sqlite(path) => {
                for suffix in ["", "-wal", "-shm"] {
                    let mut p = path.clone().into_os_string();
                    p.push(suffix);
                    std::fs::remove_file(p).ok();
                }
            }
            Scratch::Postgres { url, schema } => {
                let mut admin = pg_admin(&url).await;
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
                    .execute(&mut admin)
                    .await
                    .expect("drop test schema");
                admin.close().await.ok();
            }
        }
    }
}

async fn pg_admin(url: &str) -> sqlx::PgConnection {
    match sqlx::PgConnection::connect(url).await {
        Ok(conn) => conn,
        Err(e) => panic!("PostgreSQL at {url} answered the tests before, but not now: {e}"),
    }
}

/// Runs one test body on a fresh database of `backend`, removes the
/// database whatever happens, then reports the body's panic if any.
async fn run(backend: Backend, body: fn(Arc<dyn Store>) -> Body) {
    let scratch = Scratch::new(backend).await;
    let store = scratch.open().await;
    assert_eq!(store.backend(), backend);
    let outcome = tokio::spawn(body(store)).await;
    scratch.remove().await;
    if let Err(e) = outcome {
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("test task failed: {e}"),
        }
    }
}

/// Generates `on_sqlite::<name>` and `on_postgres::<name>` for each test.
macro_rules! store_tests {
    ($($name:ident),* $(,)?) => {
        mod on_sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::run(super::Backend::Sqlite, |s| Box::pin(super::$name(s))).await;
                }
            )*
        }
        mod on_postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::run(super::Backend::Postgres, |s| Box::pin(super::$name(s))).await;
                }
            )*
        }
    };
}

mod batches;
mod files;

store_tests!(
    ping,
    create_new_existing_and_other_tenant,
    create_concurrent_same_key,
    job_lookup_is_tenant_scoped,
    start_attempt_concurrent,
    attempts_are_numbered_and_hedges_allowed,
    unknown_attempt_blocks_new_attempts,
    closed_jobs_refuse_attempts,
    attempt_transitions,
    first_complete_wins,
    concurrent_complete_one_winner,
    complete_after_cancel_is_lost,
    complete_needs_an_active_attempt,
    cancel_job,
    claim_concurrent_exactly_once,
    claim_respects_not_before_and_order,
    renew_claim_and_attempt,
    requeue_and_fail_refuse_while_attempt_active,
    expire_attempt_leases,
    expire_job_claims,
    list_jobs_pagination,
    list_all_jobs_spans_tenants,
    count_jobs,
    purge_old_terminal_jobs,
    certifications_latest_per_target,
    claim_and_start_starts_where_chosen_and_allowed,
    complete_all_batch_each_as_if_alone,
    complete_all_concurrent_one_winner_per_job,
    responses_are_kept_per_tenant,
    keys_create_list_and_get,
    keys_update_sets_and_clears,
    keys_revoke_and_rotate,
    keys_duplicates_refused,
    keys_version_ignores_touch,
    key_audit_newest_first,
    grant_concurrent_never_exceeds_budget,
    grant_leases_extra_and_release,
    grant_period_rollover,
    grant_unlimited_and_settle_without_row,
);

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn new_job(tenant: &str, key: &str, created_at: i64) -> NewJob {
    NewJob {
        id: uuid::Uuid::now_v7().to_string(),
        tenant: tenant.to_owned(),
        idempotency_key: key.to_owned(),
        payload_hash: format!("hash-{key}"),
        fingerprint: format!("fp-{key}"),
        route: "support-bot".to_owned(),
        request: r#"{"model":"support-bot","messages":[{"role":"user","content":"hi"}]}"#
            .to_owned(),
        metadata: Some(r#"{"order":45}"#.to_owned()),
        dialect: "chat".to_owned(),
        forwarded: None,
        key_id: None,
        batch_id: None,
        created_at,
    }
}

async fn create(s: &dyn Store, tenant: &str, key: &str, created_at: i64) -> JobRecord {
    match s
        .create_job(&new_job(tenant, key, created_at))
        .await
        .unwrap()
    {
        Created::New(job) => job,
        Created::Existing(job) => panic!("expected a new job, got existing {job:?}"),
    }
}

async fn job(s: &dyn Store, id: &str) -> JobRecord {
    s.job(None, id).await.unwrap().expect("job exists")
}

async fn start(s: &dyn Store, job_id: &str, hedge: bool) -> AttemptRecord {
    match s
        .start_attempt(
            job_id,
            "primary",
            "gpt-4o-mini",
            hedge,
            "worker-a",
            T0,
            T0 + 60_000,
        )
        .await
        .unwrap()
    {
        StartAttempt::Started(a) => a,
        other => panic!("expected an attempt to start, got {other:?}"),
    }
}

async fn try_start(s: &dyn Store, job_id: &str, hedge: bool) -> StartAttempt {
    s.start_attempt(
        job_id,
        "primary",
        "gpt-4o-mini",
        hedge,
        "worker-a",
        T0,
        T0 + 60_000,
    )
    .await
    .unwrap()
}

async fn attempt(s: &dyn Store, job_id: &str, n: i32) -> AttemptRecord {
    s.attempts(job_id)
        .await
        .unwrap()
        .into_iter()
        .find(|a| a.n == n)
        .expect("attempt exists")
}

/// Claims up to `limit` jobs due at `now` for `worker` until `until`,
/// starting no attempt.
async fn claim(s: &dyn Store, worker: &str, now: i64, until: i64, limit: u32) -> Vec<JobRecord> {
    let claimed = s
        .claim_and_start(
            worker,
            now,
            until,
            until,
            Room {
                jobs: limit,
                lines: limit,
            },
            &mut |_, _| None,
        )
        .await
        .unwrap();
    claimed
        .into_iter()
        .map(|c| {
            assert_eq!(c.started, None, "no attempt was chosen");
            c.job
        })
        .collect()
}

/// Claims everything due at `now` for `worker` (one job expected).
async fn claim_one(s: &dyn Store, worker: &str, now: i64) -> JobRecord {
    let mut claimed = claim(s, worker, now, now + 30_000, 10).await;
    assert_eq!(
        claimed.len(),
        1,
        "expected exactly one claim, got {claimed:?}"
    );
    claimed.remove(0)
}

// ---------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------

async fn ping(s: Arc<dyn Store>) {
    s.ping().await.unwrap();
}

async fn create_new_existing_and_other_tenant(s: Arc<dyn Store>) {
    let first = new_job("t1", "order-45", T0);
    let created = match s.create_job(&first).await.unwrap() {
        Created::New(j) => j,
        other => panic!("expected New, got {other:?}"),
    };
    assert_eq!(created.id, first.id);
    assert_eq!(created.state, JobState::Queued);
    assert_eq!(created.version, 0);
    assert_eq!(created.completed_by, None);
    assert_eq!(created.not_before, T0);
    assert_eq!(created.created_at, T0);
    assert_eq!(created.updated_at, T0);
    assert_eq!(created.request, first.request);
    assert_eq!(created.metadata, first.metadata);

    // Same key, different payload: the existing row comes back unchanged.
    let mut again = new_job("t1", "order-45", T0 + 5);
    again.payload_hash = "other-hash".to_owned();
    match s.create_job(&again).await.unwrap() {
        Created::Existing(j) => assert_eq!(j, created),
        other => panic!("expected Existing, got {other:?}"),
    }

    // The same key for another tenant is another job.
    let other = new_job("t2", "order-45", T0);
    match s.create_job(&other).await.unwrap() {
        Created::New(j) => {
            assert_eq!(j.id, other.id);
            assert_eq!(j.tenant, "t2");
        }
        other => panic!("expected New, got {other:?}"),
    }
    assert_eq!(
        s.job_by_key("t1", "order-45").await.unwrap().unwrap().id,
        first.id
    );
    assert_eq!(
        s.job_by_key("t2", "order-45").await.unwrap().unwrap().id,
        other.id
    );
    assert_eq!(s.job_by_key("t3", "order-45").await.unwrap(), None);
}

async fn create_concurrent_same_key(s: Arc<dyn Store>) {
    const N: usize = 50;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (s, barrier) = (s.clone(), barrier.clone());
            tokio::spawn(async move {
                let job = new_job("t1", "same-key", T0);
                barrier.wait().await;
                s.create_job(&job).await.unwrap()
            })
        })
        .collect();
    let mut new = Vec::new();
    let mut existing = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            Created::New(j) => new.push(j),
            Created::Existing(j) => existing.push(j),
        }
    }
    assert_eq!(new.len(), 1, "exactly one creator");
    assert_eq!(existing.len(), N - 1);
    assert!(
        existing.iter().all(|j| j.id == new[0].id),
        "every caller sees the winner"
    );
    let all = s.list_jobs("t1", None, None, 1000).await.unwrap();
    assert_eq!(all.len(), 1, "one row");
}

async fn job_lookup_is_tenant_scoped(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    assert_eq!(s.job(Some("t1"), &j.id).await.unwrap().as_ref(), Some(&j));
    assert_eq!(s.job(None, &j.id).await.unwrap().as_ref(), Some(&j));
    assert_eq!(s.job(Some("t2"), &j.id).await.unwrap(), None);
    assert_eq!(s.job(None, "no-such-job").await.unwrap(), None);
    // Another tenant cannot cancel it either.
    assert_eq!(s.cancel_job("t2", &j.id, T0 + 1).await.unwrap(), None);
    assert_eq!(job(&*s, &j.id).await, j);
}

async fn start_attempt_concurrent(s: Arc<dyn Store>) {
    const N: usize = 20;
    let j = create(&*s, "t1", "k", T0).await;
    let barrier = Arc::new(Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let (s, barrier, id) = (s.clone(), barrier.clone(), j.id.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                s.start_attempt(&id, "primary", "m", false, &format!("w{i}"), T0, T0 + 1000)
                    .await
                    .unwrap()
            })
        })
        .collect();
    let mut started = 0;
    for t in tasks {
        match t.await.unwrap() {
            StartAttempt::Started(a) => {
                started += 1;
                assert_eq!(a.n, 1);
            }
            StartAttempt::Busy => {}
            StartAttempt::Closed => panic!("job is open"),
        }
    }
    assert_eq!(started, 1, "exactly one attempt starts");
    assert_eq!(s.attempts(&j.id).await.unwrap().len(), 1);
}

async fn attempts_are_numbered_and_hedges_allowed(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    let a1 = start(&*s, &j.id, false).await;
    assert_eq!(a1.n, 1);
    assert_eq!(a1.state, AttemptState::Starting);
    assert_eq!(a1.read_version, j.version);
    assert_eq!(a1.owner.as_deref(), Some("worker-a"));
    assert_eq!(a1.started_at, T0);
    assert_eq!(a1.lease_until, Some(T0 + 60_000));
    assert!(!a1.hedge);
    // Starting an attempt does not bump the job's version.
    assert_eq!(job(&*s, &j.id).await.version, j.version);

    assert_eq!(try_start(&*s, &j.id, false).await, StartAttempt::Busy);
    assert!(s.attempt_running(&j.id, 1).await.unwrap());
    assert_eq!(try_start(&*s, &j.id, false).await, StartAttempt::Busy);

    // A hedge may start while attempt 1 is in flight, at the same version.
    let a2 = start(&*s, &j.id, true).await;
    assert_eq!(a2.n, 2);
    assert!(a2.hedge);
    assert_eq!(a2.read_version, a1.read_version);

    assert!(
        s.finish_attempt(&j.id, 1, AttemptState::Failed, Some("http_429"), T0 + 1)
            .await
            .unwrap()
    );
    assert_eq!(
        try_start(&*s, &j.id, false).await,
        StartAttempt::Busy,
        "the hedge is still active"
    );
    assert!(
        s.finish_attempt(&j.id, 2, AttemptState::Failed, Some("http_500"), T0 + 2)
            .await
            .unwrap()
    );
    let a3 = start(&*s, &j.id, false).await;
    assert_eq!(a3.n, 3);

    let all = s.attempts(&j.id).await.unwrap();
    assert_eq!(all.iter().map(|a| a.n).collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(all[0].state, AttemptState::Failed);
    assert_eq!(all[0].reason.as_deref(), Some("http_429"));
    assert_eq!(all[0].finished_at, Some(T0 + 1));
}

async fn unknown_attempt_blocks_new_attempts(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    start(&*s, &j.id, false).await;
    assert!(
        s.finish_attempt(&j.id, 1, AttemptState::Unknown, Some("timeout"), T0 + 1)
            .await
            .unwrap()
    );
    assert_eq!(attempt(&*s, &j.id, 1).await.state, AttemptState::Unknown);
    assert_eq!(try_start(&*s, &j.id, false).await, StartAttempt::Busy);
    assert_eq!(s.unknown_attempts().await.unwrap().len(), 1);

    // Resolved out of band: the job is free again.
    assert!(
        s.finish_attempt(&j.id, 1, AttemptState::Cancelled, Some("operator"), T0 + 2)
            .await
            .unwrap()
    );
    assert_eq!(s.unknown_attempts().await.unwrap(), vec![]);
    assert_eq!(start(&*s, &j.id, false).await.n, 2);
}

async fn closed_jobs_refuse_attempts(s: Arc<dyn Store>) {
    assert_eq!(
        try_start(&*s, "no-such-job", false).await,
        StartAttempt::Closed
    );

    let failed = create(&*s, "t1", "failed", T0).await;
    assert!(s.fail_job(&failed.id, "no provider", T0 + 1).await.unwrap());
    assert_eq!(
        try_start(&*s, &failed.id, false).await,
        StartAttempt::Closed
    );
    assert_eq!(try_start(&*s, &failed.id, true).await, StartAttempt::Closed);

    let cancelled = create(&*s, "t1", "cancelled", T0).await;
    s.cancel_job("t1", &cancelled.id, T0 + 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        try_start(&*s, &cancelled.id, false).await,
        StartAttempt::Closed
    );

    let done = create(&*s, "t1", "done", T0).await;
    let a = start(&*s, &done.id, false).await;
    assert!(matches!(
        s.complete(&done.id, a.n, a.read_version, "{}", T0 + 1)
            .await
            .unwrap(),
        Completion::Won(_)
    ));
    assert_eq!(try_start(&*s, &done.id, false).await, StartAttempt::Closed);
    assert_eq!(try_start(&*s, &done.id, true).await, StartAttempt::Closed);
}

async fn attempt_transitions(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    start(&*s, &j.id, false).await;
    assert!(s.attempt_running(&j.id, 1).await.unwrap());
    assert!(
        !s.attempt_running(&j.id, 1).await.unwrap(),
        "only from starting"
    );
    assert!(
        !s.attempt_running(&j.id, 9).await.unwrap(),
        "no such attempt"
    );
    // Succeeded and discarded are reached only through `complete`.
    assert!(
        !s.finish_attempt(&j.id, 1, AttemptState::Succeeded, None, T0)
            .await
            .unwrap()
    );
    assert!(
        !s.finish_attempt(&j.id, 1, AttemptState::Discarded, None, T0)
            .await
            .unwrap()
    );
    assert!(
        !s.finish_attempt(&j.id, 1, AttemptState::Running, None, T0)
            .await
            .unwrap()
    );
    assert_eq!(attempt(&*s, &j.id, 1).await.state, AttemptState::Running);
    // running -> unknown -> failed, then nothing more.
    assert!(
        s.finish_attempt(&j.id, 1, AttemptState::Unknown, Some("timeout"), T0 + 1)
            .await
            .unwrap()
    );
    assert!(
        s.finish_attempt(&j.id, 1, AttemptState::Failed, Some("late_error"), T0 + 2)
            .await
            .unwrap()
    );
    assert!(
        !s.finish_attempt(&j.id, 1, AttemptState::Cancelled, None, T0 + 3)
            .await
            .unwrap()
    );
    let a = attempt(&*s, &j.id, 1).await;
    assert_eq!(a.state, AttemptState::Failed);
    assert_eq!(a.reason.as_deref(), Some("late_error"));
    assert_eq!(a.finished_at, Some(T0 + 2));
}

async fn first_complete_wins(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    let claimed = claim_one(&*s, "w", T0).await;
    let a1 = start(&*s, &j.id, false).await;
    let a2 = start(&*s, &j.id, true).await;
    assert_eq!(a1.read_version, claimed.version);
    assert_eq!(a2.read_version, claimed.version);

    // The hedge finishes first and wins, although attempt 1 is the primary.
    let winner = r#"{"id":"chatcmpl-WINNER","object":"chat.completion"}"#;
    let loser = r#"{"id":"chatcmpl-LOSER-7f3a","object":"chat.completion"}"#;
    let won = match s
        .complete(&j.id, a2.n, a2.read_version, winner, T0 + 10)
        .await
        .unwrap()
    {
        Completion::Won(job) => job,
        Completion::Lost => panic!("the first to complete wins"),
    };
    assert_eq!(won.state, JobState::Succeeded);
    assert_eq!(won.version, claimed.version + 1);
    assert_eq!(won.completed_by, Some(a2.n));
    assert_eq!(won.result.as_deref(), Some(winner));
    assert_eq!(won.updated_at, T0 + 10);

    assert_eq!(
        s.complete(&j.id, a1.n, a1.read_version, loser, T0 + 11)
            .await
            .unwrap(),
        Completion::Lost
    );

    let after = job(&*s, &j.id).await;
    assert_eq!(after, won, "the loser changed nothing");
    let attempts = s.attempts(&j.id).await.unwrap();
    assert_eq!(attempts[0].state, AttemptState::Discarded);
    assert_eq!(attempts[0].finished_at, Some(T0 + 11));
    assert_eq!(attempts[1].state, AttemptState::Succeeded);
    assert_eq!(attempts[1].finished_at, Some(T0 + 10));
    // The loser's answer is stored nowhere.
    let everything = format!(
        "{after:?} {attempts:?} {:?}",
        s.list_jobs("t1", None, None, 100).await.unwrap()
    );
    assert!(
        !everything.contains("LOSER-7f3a"),
        "loser's result leaked: {everything}"
    );
}

async fn concurrent_complete_one_winner(s: Arc<dyn Store>) {
    const N: i32 = 4;
    let j = create(&*s, "t1", "k", T0).await;
    let first = start(&*s, &j.id, false).await;
    for _ in 1..N {
        start(&*s, &j.id, true).await;
    }
    let barrier = Arc::new(Barrier::new(N as usize));
    let tasks: Vec<_> = (1..=N)
        .map(|n| {
            let (s, barrier, id) = (s.clone(), barrier.clone(), j.id.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let c = s
                    .complete(
                        &id,
                        n,
                        first.read_version,
                        &format!("result-of-{n}"),
                        T0 + 1,
                    )
                    .await
                    .unwrap();
                (n, c)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for t in tasks {
        if let (n, Completion::Won(_)) = t.await.unwrap() {
            winners.push(n);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one winner: {winners:?}");
    let after = job(&*s, &j.id).await;
    assert_eq!(after.completed_by, Some(winners[0]));
    assert_eq!(after.result, Some(format!("result-of-{}", winners[0])));
    for a in s.attempts(&j.id).await.unwrap() {
        let expected = if a.n == winners[0] {
            AttemptState::Succeeded
        } else {
            AttemptState::Discarded
        };
        assert_eq!(a.state, expected, "attempt {}", a.n);
    }
}

async fn complete_after_cancel_is_lost(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    let a = start(&*s, &j.id, false).await;
    let cancelled = s.cancel_job("t1", &j.id, T0 + 1).await.unwrap().unwrap();
    assert_eq!(cancelled.state, JobState::Cancelled);
    assert_eq!(cancelled.version, j.version + 1);
    assert_eq!(
        s.complete(&j.id, a.n, a.read_version, "late-result-93c1", T0 + 2)
            .await
            .unwrap(),
        Completion::Lost
    );
    let after = job(&*s, &j.id).await;
    assert_eq!(after, cancelled);
    assert_eq!(after.result, None);
    assert_eq!(
        attempt(&*s, &j.id, a.n).await.state,
        AttemptState::Discarded
    );
}

async fn complete_needs_an_active_attempt(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    // No such attempt: nothing changes.
    assert_eq!(
        s.complete(&j.id, 1, j.version, "ghost", T0).await.unwrap(),
        Completion::Lost
    );
    assert_eq!(job(&*s, &j.id).await, j);
    assert_eq!(
        s.complete("no-such-job", 1, 0, "ghost", T0).await.unwrap(),
        Completion::Lost
    );

    // A repeated completion of the winner does not turn it into a loser.
    let a = start(&*s, &j.id, false).await;
    let won = match s
        .complete(&j.id, a.n, a.read_version, "first", T0 + 1)
        .await
        .unwrap()
    {
        Completion::Won(job) => job,
        Completion::Lost => panic!("should win"),
    };
    assert_eq!(
        s.complete(&j.id, a.n, a.read_version, "second", T0 + 2)
            .await
            .unwrap(),
        Completion::Lost
    );
    assert_eq!(
        attempt(&*s, &j.id, a.n).await.state,
        AttemptState::Succeeded
    );
    assert_eq!(job(&*s, &j.id).await, won);

    // An `unknown` attempt may still complete (a late response).
    let k = create(&*s, "t1", "k2", T0).await;
    let b = start(&*s, &k.id, false).await;
    assert!(
        s.finish_attempt(&k.id, b.n, AttemptState::Unknown, Some("timeout"), T0 + 1)
            .await
            .unwrap()
    );
    assert!(matches!(
        s.complete(&k.id, b.n, b.read_version, "late", T0 + 2)
            .await
            .unwrap(),
        Completion::Won(_)
    ));
    assert_eq!(
        attempt(&*s, &k.id, b.n).await.state,
        AttemptState::Succeeded
    );
}

async fn cancel_job(s: Arc<dyn Store>) {
    assert_eq!(s.cancel_job("t1", "no-such-job", T0).await.unwrap(), None);

    let queued = create(&*s, "t1", "queued", T0).await;
    let c = s
        .cancel_job("t1", &queued.id, T0 + 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (c.state, c.version, c.updated_at),
        (JobState::Cancelled, queued.version + 1, T0 + 1)
    );
    // Cancelling again changes nothing.
    assert_eq!(
        s.cancel_job("t1", &queued.id, T0 + 2).await.unwrap(),
        Some(c)
    );

    let running = create(&*s, "t1", "running", T0).await;
    let claimed = claim_one(&*s, "w", T0).await;
    assert_eq!(claimed.id, running.id);
    let c = s
        .cancel_job("t1", &running.id, T0 + 1)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (c.state, c.version),
        (JobState::Cancelled, claimed.version + 1)
    );
    assert_eq!((c.claimed_by, c.claim_until), (None, None));

    let failed = create(&*s, "t1", "failed", T0).await;
    assert!(s.fail_job(&failed.id, "no provider", T0 + 1).await.unwrap());
    let c = s
        .cancel_job("t1", &failed.id, T0 + 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(c.state, JobState::Cancelled);

    let done = create(&*s, "t1", "done", T0).await;
    let a = start(&*s, &done.id, false).await;
    let Completion::Won(won) = s
        .complete(&done.id, a.n, a.read_version, "{}", T0 + 1)
        .await
        .unwrap()
    else {
        panic!("should win");
    };
    assert_eq!(
        s.cancel_job("t1", &done.id, T0 + 2).await.unwrap(),
        Some(won),
        "succeeded stays succeeded"
    );
}

async fn claim_concurrent_exactly_once(s: Arc<dyn Store>) {
    const JOBS: i64 = 100;
    const CLAIMERS: usize = 4;
    for i in 0..JOBS {
        create(&*s, "t1", &format!("job-{i}"), T0 + i).await;
    }
    let barrier = Arc::new(Barrier::new(CLAIMERS));
    let tasks: Vec<_> = (0..CLAIMERS)
        .map(|w| {
            let (s, barrier) = (s.clone(), barrier.clone());
            tokio::spawn(async move {
                let worker = format!("worker-{w}");
                let mut mine = Vec::new();
                barrier.wait().await;
                loop {
                    // Each claim starts the first attempt of every job it
                    // takes, in the same transaction.
                    let batch = s
                        .claim_and_start(
                            &worker,
                            T0 + JOBS,
                            T0 + 99_999,
                            T0 + 60_000,
                            Room {
                                jobs: 10,
                                lines: 10,
                            },
                            &mut |_, _| Some(target()),
                        )
                        .await
                        .unwrap();
                    if batch.is_empty() {
                        return mine;
                    }
                    assert!(batch.len() <= 10);
                    for ClaimedJob {
                        job: j,
                        earlier,
                        started,
                    } in batch
                    {
                        assert_eq!(j.state, JobState::Running);
                        assert_eq!(j.claimed_by.as_deref(), Some(worker.as_str()));
                        assert_eq!(j.claim_until, Some(T0 + 99_999));
                        assert_eq!(j.version, 1);
                        assert_eq!(earlier, vec![]);
                        let a = started.expect("an attempt started with the claim");
                        assert_eq!((a.job_id.as_str(), a.n), (j.id.as_str(), 1));
                        assert_eq!(a.owner.as_deref(), Some(worker.as_str()));
                        assert_eq!(a.read_version, 1, "the claim's version");
                        mine.push(j.id);
                    }
                }
            })
        })
        .collect();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for t in tasks {
        for id in t.await.unwrap() {
            *seen.entry(id).or_default() += 1;
        }
    }
    assert_eq!(seen.len() as i64, JOBS, "every job claimed");
    assert!(seen.values().all(|&c| c == 1), "no job claimed twice");
    let counts: HashMap<JobState, i64> = s.count_jobs(None).await.unwrap().into_iter().collect();
    assert_eq!(counts[&JobState::Running], JOBS);
    assert_eq!(counts[&JobState::Queued], 0);
    for id in seen.keys() {
        let attempts = s.attempts(id).await.unwrap();
        assert_eq!(attempts.len(), 1, "job {id}: one attempt, {attempts:?}");
    }
}

async fn claim_respects_not_before_and_order(s: Arc<dyn Store>) {
    let old = create(&*s, "t1", "old", T0).await;
    let mid = create(&*s, "t2", "mid", T0 + 1).await;
    let new = create(&*s, "t1", "new", T0 + 2).await;
    let future = create(&*s, "t1", "future", T0 + 3).await;
    // Only `old` is due at T0 (a job is due from its creation).
    assert_eq!(claim_one(&*s, "w", T0).await.id, old.id);
    assert!(s.requeue(&old.id, Some("w"), T0, false, T0).await.unwrap());
    let first = claim(&*s, "w", T0 + 3, T0 + 100, 10).await;
    assert_eq!(
        first.iter().map(|j| j.id.as_str()).collect::<Vec<_>>(),
        vec![
            old.id.as_str(),
            mid.id.as_str(),
            new.id.as_str(),
            future.id.as_str()
        ],
        "oldest first, all tenants"
    );
    // A retry backoff: `future` is not claimable before T0 + 1000.
    assert!(
        s.requeue(&future.id, Some("w"), T0 + 1000, false, T0 + 4)
            .await
            .unwrap()
    );
    assert_eq!(claim(&*s, "w", T0 + 999, T0 + 2000, 10).await, vec![]);
    let later = claim(&*s, "w", T0 + 1000, T0 + 2000, 10).await;
    assert_eq!(later.len(), 1);
    assert_eq!(later[0].id, future.id);

    // The limit is respected, oldest first.
    for i in 0..5 {
        create(&*s, "t3", &format!("batch-{i}"), T0 + 10 + i).await;
    }
    let two = claim(&*s, "w", T0 + 100, T0 + 200, 2).await;
    assert_eq!(
        two.iter()
            .map(|j| j.idempotency_key.as_str())
            .collect::<Vec<_>>(),
        vec!["batch-0", "batch-1"]
    );
}

async fn renew_claim_and_attempt(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    assert!(
        !s.renew_claim(&j.id, "w", T0 + 500).await.unwrap(),
        "not claimed yet"
    );
    let claimed = claim_one(&*s, "w", T0).await;
    assert!(!s.renew_claim(&j.id, "other", T0 + 500).await.unwrap());
    assert!(s.renew_claim(&j.id, "w", T0 + 500).await.unwrap());
    let after = job(&*s, &j.id).await;
    assert_eq!(after.claim_until, Some(T0 + 500));
    assert_eq!(
        after.version, claimed.version,
        "renewing does not bump the version"
    );

    let a = start(&*s, &j.id, false).await;
    assert!(
        !s.renew_attempt(&j.id, a.n, "other", T0 + 90_000)
            .await
            .unwrap()
    );
    assert!(
        s.renew_attempt(&j.id, a.n, "worker-a", T0 + 90_000)
            .await
            .unwrap()
    );
    assert_eq!(
        attempt(&*s, &j.id, a.n).await.lease_until,
        Some(T0 + 90_000)
    );
    // Once the lease has run out, the owner learns it cannot renew.
    assert_eq!(
        s.expire_attempt_leases(T0 + 90_001, T0 + 90_001)
            .await
            .unwrap()
            .len(),
        1
    );
    assert!(
        !s.renew_attempt(&j.id, a.n, "worker-a", T0 + 200_000)
            .await
            .unwrap()
    );
    assert_eq!(job(&*s, &j.id).await.version, claimed.version);
}

async fn requeue_and_fail_refuse_while_attempt_active(s: Arc<dyn Store>) {
    let j = create(&*s, "t1", "k", T0).await;
    let claimed = claim_one(&*s, "w", T0).await;
    let a = start(&*s, &j.id, false).await;
    assert!(
        !s.requeue(&j.id, Some("w"), T0, false, T0 + 1)
            .await
            .unwrap(),
        "attempt starting"
    );
    assert!(
        !s.fail_job(&j.id, "give up", T0 + 1).await.unwrap(),
        "attempt starting"
    );
    assert!(
        s.finish_attempt(&j.id, a.n, AttemptState::Unknown, Some("timeout"), T0 + 1)
            .await
            .unwrap()
    );
    assert!(
        !s.requeue(&j.id, None, T0, false, T0 + 1).await.unwrap(),
        "attempt unknown"
    );
    assert!(
        !s.fail_job(&j.id, "give up", T0 + 1).await.unwrap(),
        "attempt unknown"
    );
    assert!(
        s.finish_attempt(&j.id, a.n, AttemptState::Failed, Some("http_503"), T0 + 2)
            .await
            .unwrap()
    );
    assert_eq!(job(&*s, &j.id).await, claimed, "refusals changed nothing");

    // Only the claim holder (or anyone, without a worker) may requeue.
    assert!(
        !s.requeue(&j.id, Some("other"), T0 + 50, false, T0 + 3)
            .await
            .unwrap()
    );
    assert!(
        s.requeue(&j.id, Some("w"), T0 + 50, false, T0 + 3)
            .await
            .unwrap()
    );
    let q = job(&*s, &j.id).await;
    assert_eq!(
        (q.state, q.version, q.not_before),
        (JobState::Queued, claimed.version + 1, T0 + 50)
    );
    assert_eq!(
        (q.claimed_by, q.claim_until, q.updated_at),
        (None, None, T0 + 3)
    );
    assert!(
        !s.requeue(&j.id, None, T0, false, T0 + 4).await.unwrap(),
        "queued is not running"
    );

    let again = claim_one(&*s, "w2", T0 + 50).await;
    assert_eq!(again.version, q.version + 1);
    assert!(
        s.fail_job(&j.id, "all providers failed", T0 + 60)
            .await
            .unwrap()
    );
    let f = job(&*s, &j.id).await;
    assert_eq!((f.state, f.version), (JobState::Failed, again.version + 1));
    assert_eq!(f.error.as_deref(), Some("all providers failed"));
    assert_eq!((f.claimed_by, f.claim_until), (None, None));
    assert!(
        !s.fail_job(&j.id, "again", T0 + 61).await.unwrap(),
        "already failed"
    );

    // A failed job is reopened only on request (a manual retry).
    assert!(
        !s.requeue(&j.id, None, T0 + 70, false, T0 + 70)
            .await
            .unwrap()
    );
    assert!(
        s.requeue(&j.id, None, T0 + 70, true, T0 + 70)
            .await
            .unwrap()
    );
    let r = job(&*s, &j.id).await;
    assert_eq!(
        (r.state, r.version, r.not_before),
        (JobState::Queued, f.version + 1, T0 + 70)
    );
    assert_eq!(r.error, None);
    // Only the reopening grants an attempt: the earlier requeues of a
    // running job did not.
    assert_eq!((claimed.retries, q.retries, r.retries), (0, 0, 1));
    assert!(!s.requeue("no-such-job", None, T0, true, T0).await.unwrap());
    assert!(!s.fail_job("no-such-job", "x", T0).await.unwrap());

    // A queued job can fail directly (no attempt active).
    assert!(s.fail_job(&j.id, "expired", T0 + 80).await.unwrap());
}

async fn expire_attempt_leases(s: Arc<dyn Store>) {
    let lease = |s: Arc<dyn Store>, key: &'static str, until: i64, running: bool| async move {
        let j = create(&*s, "t1", key, T0).await;
        match s
            .start_attempt(&j.id, "p", "m", false, "w", T0, until)
            .await
            .unwrap()
        {
            StartAttempt::Started(a) => {
                if running {
                    assert!(s.attempt_running(&j.id, a.n).await.unwrap());
                }
                j.id
            }
            other => panic!("{other:?}"),
        }
    };
    let starting_expired = lease(s.clone(), "a", T0 + 100, false).await;
    let running_expired = lease(s.clone(), "b", T0 + 150, true).await;
    let running_alive = lease(s.clone(), "c", T0 + 300, true).await;
    let at_the_edge = lease(s.clone(), "d", T0 + 200, true).await;
    let finished = lease(s.clone(), "e", T0 + 100, true).await;
    assert!(
        s.finish_attempt(
            &finished,
            1,
            AttemptState::Failed,
            Some("http_400"),
            T0 + 50
        )
        .await
        .unwrap()
    );

    let expired = s.expire_attempt_leases(T0 + 200, T0 + 200).await.unwrap();
    let ids: HashSet<&str> = expired.iter().map(|a| a.job_id.as_str()).collect();
    assert_eq!(
        ids,
        HashSet::from([starting_expired.as_str(), running_expired.as_str()])
    );
    for a in &expired {
        assert_eq!(a.state, AttemptState::Unknown);
        assert_eq!(a.reason.as_deref(), Some("lease_expired"));
    }
    assert_eq!(
        attempt(&*s, &running_alive, 1).await.state,
        AttemptState::Running
    );
    assert_eq!(
        attempt(&*s, &at_the_edge, 1).await.state,
        AttemptState::Running,
        "lease ends at, not before, now"
    );
    assert_eq!(attempt(&*s, &finished, 1).await.state, AttemptState::Failed);
    let mut unknown: Vec<String> = s
        .unknown_attempts()
        .await
        .unwrap()
        .into_iter()
        .map(|a| a.job_id)
        .collect();
    unknown.sort();
    let mut expected = vec![starting_expired.clone(), running_expired.clone()];
    expected.sort();
    assert_eq!(unknown, expected);
    // Nothing is re-run and a second pass finds nothing new.
    assert_eq!(
        s.expire_attempt_leases(T0 + 200, T0 + 200).await.unwrap(),
        vec![]
    );
    assert_eq!(s.attempts(&starting_expired).await.unwrap().len(), 1);
}

async fn expire_job_claims(s: Arc<dyn Store>) {
    let free = create(&*s, "t1", "free", T0).await;
    let busy = create(&*s, "t1", "busy", T0 + 1).await;
    let alive = create(&*s, "t1", "alive", T0 + 2).await;
    let claimed = claim(&*s, "w", T0 + 2, T0 + 100, 2).await;
    assert_eq!(claimed.len(), 2);
    assert_eq!(claim(&*s, "w", T0 + 2, T0 + 500, 1).await[0].id, alive.id);
    start(&*s, &busy.id, false).await;
    let queued = create(&*s, "t1", "queued", T0 + 3).await;

    assert_eq!(
        s.expire_job_claims(T0 + 100).await.unwrap(),
        0,
        "claims end at, not before, now"
    );
    assert_eq!(s.expire_job_claims(T0 + 101).await.unwrap(), 1);
    let f = job(&*s, &free.id).await;
    assert_eq!(
        (f.state, f.version),
        (JobState::Queued, claimed[0].version + 1)
    );
    assert_eq!((f.claimed_by, f.claim_until), (None, None));
    assert_eq!(
        job(&*s, &busy.id).await.state,
        JobState::Running,
        "an attempt is active"
    );
    assert_eq!(
        job(&*s, &alive.id).await.state,
        JobState::Running,
        "claim still valid"
    );
    assert_eq!(job(&*s, &queued.id).await, queued);
    assert_eq!(s.expire_job_claims(T0 + 101).await.unwrap(), 0);
}

async fn list_jobs_pagination(s: Arc<dyn Store>) {
    // Seven jobs for t1, three of them at the same millisecond (the id
    // breaks the tie), and some for t2 that must never show up.
    let mut mine = Vec::new();
    for (i, at) in [0, 1, 2, 2, 2, 3, 4].into_iter().enumerate() {
        mine.push(create(&*s, "t1", &format!("k{i}"), T0 + at).await);
    }
    for i in 0..3 {
        create(&*s, "t2", &format!("k{i}"), T0 + 2).await;
    }
    mine.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));

    let mut pages = Vec::new();
    let mut cursor: Option<Cursor> = None;
    loop {
        let page = s.list_jobs("t1", None, cursor.as_ref(), 3).await.unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 3);
        let last = page.last().unwrap();
        cursor = Some(Cursor {
            created_at: last.created_at,
            id: last.id.clone(),
        });
        pages.push(page);
    }
    assert_eq!(
        pages.iter().map(Vec::len).collect::<Vec<_>>(),
        vec![3, 3, 1]
    );
    let listed: Vec<JobRecord> = pages.into_iter().flatten().collect();
    assert_eq!(listed, mine, "newest first, each job once");

    // State filter, still tenant-scoped and paginated.
    for j in &mine[..3] {
        s.cancel_job("t1", &j.id, T0 + 10).await.unwrap().unwrap();
    }
    let cancelled = s
        .list_jobs("t1", Some(JobState::Cancelled), None, 10)
        .await
        .unwrap();
    assert_eq!(
        cancelled.iter().map(|j| &j.id).collect::<Vec<_>>(),
        mine[..3].iter().map(|j| &j.id).collect::<Vec<_>>()
    );
    let after_first = Cursor {
        created_at: mine[0].created_at,
        id: mine[0].id.clone(),
    };
    let rest = s
        .list_jobs("t1", Some(JobState::Cancelled), Some(&after_first), 10)
        .await
        .unwrap();
    assert_eq!(rest.len(), 2);
    assert_eq!(
        s.list_jobs("t1", Some(JobState::Queued), None, 10)
            .await
            .unwrap()
            .len(),
        4
    );
    assert_eq!(
        s.list_jobs("t2", Some(JobState::Cancelled), None, 10)
            .await
            .unwrap(),
        vec![]
    );
    assert_eq!(s.list_jobs("t2", None, None, 10).await.unwrap().len(), 3);
    assert_eq!(s.list_jobs("t3", None, None, 10).await.unwrap(), vec![]);
    assert_eq!(s.list_jobs("t1", None, None, 0).await.unwrap(), vec![]);
}

async fn list_all_jobs_spans_tenants(s: Arc<dyn Store>) {
    let mut all = Vec::new();
    for (i, (tenant, at)) in [("t1", 0), ("t2", 1), ("t1", 2), ("t3", 2), ("t2", 3)]
        .into_iter()
        .enumerate()
    {
        all.push(create(&*s, tenant, &format!("k{i}"), T0 + at).await);
    }
    all.sort_by(|a, b| (b.created_at, &b.id).cmp(&(a.created_at, &a.id)));

    let mut listed = Vec::new();
    let mut cursor: Option<Cursor> = None;
    loop {
        let page = s.list_all_jobs(None, cursor.as_ref(), 2).await.unwrap();
        if page.is_empty() {
            break;
        }
        assert!(page.len() <= 2);
        let last = page.last().unwrap();
        cursor = Some(Cursor {
            created_at: last.created_at,
            id: last.id.clone(),
        });
        listed.extend(page);
    }
    assert_eq!(listed, all, "newest first, every tenant, each job once");

    s.cancel_job("t2", &all[0].id, T0 + 10)
        .await
        .unwrap()
        .unwrap();
    let cancelled = s
        .list_all_jobs(Some(JobState::Cancelled), None, 10)
        .await
        .unwrap();
    assert_eq!(cancelled.len(), 1);
    assert_eq!(cancelled[0].id, all[0].id);
    assert_eq!(
        s.list_all_jobs(Some(JobState::Queued), None, 10)
            .await
            .unwrap()
            .len(),
        4
    );
    assert_eq!(s.list_all_jobs(None, None, 0).await.unwrap(), vec![]);
}

async fn count_jobs(s: Arc<dyn Store>) {
    let zeros: Vec<(JobState, i64)> = JobState::ALL.iter().map(|st| (*st, 0)).collect();
    assert_eq!(s.count_jobs(None).await.unwrap(), zeros);
    for i in 0..3 {
        create(&*s, "t1", &format!("k{i}"), T0 + i).await;
    }
    let j = create(&*s, "t2", "k", T0 + 5).await;
    claim_one(&*s, "w", T0).await;
    s.cancel_job("t2", &j.id, T0 + 1).await.unwrap().unwrap();

    let t1: HashMap<JobState, i64> = s
        .count_jobs(Some("t1"))
        .await
        .unwrap()
        .into_iter()
        .collect();
    let t2: HashMap<JobState, i64> = s
        .count_jobs(Some("t2"))
        .await
        .unwrap()
        .into_iter()
        .collect();
    let all: HashMap<JobState, i64> = s.count_jobs(None).await.unwrap().into_iter().collect();
    assert_eq!(
        (
            t1[&JobState::Running],
            t1[&JobState::Queued],
            t1.values().sum::<i64>()
        ),
        (1, 2, 3)
    );
    assert_eq!((t2[&JobState::Cancelled], t2.values().sum::<i64>()), (1, 1));
    for st in JobState::ALL {
        assert_eq!(all[&st], t1[&st] + t2[&st], "{st:?}");
    }
    assert_eq!(s.count_jobs(Some("t9")).await.unwrap(), zeros);
}

async fn purge_old_terminal_jobs(s: Arc<dyn Store>) {
    let cutoff = T0 + 1000;
    let old_done = create(&*s, "t1", "old-done", T0).await;
    let a = start(&*s, &old_done.id, false).await;
    assert!(matches!(
        s.complete(&old_done.id, a.n, a.read_version, "{}", T0 + 1)
            .await
            .unwrap(),
        Completion::Won(_)
    ));
    let old_failed = create(&*s, "t1", "old-failed", T0).await;
    assert!(s.fail_job(&old_failed.id, "x", T0 + 1).await.unwrap());
    let old_cancelled = create(&*s, "t1", "old-cancelled", T0).await;
    s.cancel_job("t1", &old_cancelled.id, T0 + 1)
        .await
        .unwrap()
        .unwrap();
    let old_running = create(&*s, "t1", "old-running", T0 + 2).await;
    assert_eq!(claim_one(&*s, "w", T0 + 2).await.id, old_running.id);
    let old_queued = create(&*s, "t1", "old-queued", T0 + 1).await;
    let new_done = create(&*s, "t1", "new-done", cutoff).await;
    s.cancel_job("t1", &new_done.id, cutoff + 1)
        .await
        .unwrap()
        .unwrap();

    assert_eq!(s.purge(cutoff).await.unwrap(), 3);
    for gone in [&old_done, &old_failed, &old_cancelled] {
        assert_eq!(
            s.job(None, &gone.id).await.unwrap(),
            None,
            "{}",
            gone.idempotency_key
        );
    }
    assert_eq!(
        s.attempts(&old_done.id).await.unwrap(),
        vec![],
        "attempts go with their job"
    );
    assert_eq!(job(&*s, &old_queued.id).await.state, JobState::Queued);
    assert_eq!(job(&*s, &old_running.id).await.state, JobState::Running);
    assert_eq!(job(&*s, &new_done.id).await.state, JobState::Cancelled);
    assert_eq!(s.purge(cutoff).await.unwrap(), 0);

    // The purged key is free again; the live ones are not.
    let reused = create(&*s, "t1", "old-done", cutoff + 5).await;
    assert_ne!(reused.id, old_done.id);
    assert!(matches!(
        s.create_job(&new_job("t1", "old-queued", cutoff + 5)).await.unwrap(),
        Created::Existing(j) if j.id == old_queued.id
    ));
}

async fn certifications_latest_per_target(s: Arc<dyn Store>) {
    let cert = |route: &str, provider: &str, model: &str, passed: bool, at: i64, hash: &str| {
        Certification {
            route: route.to_owned(),
            provider: provider.to_owned(),
            model: model.to_owned(),
            contract_hash: hash.to_owned(),
            passed,
            failures: if passed {
                "[]".to_owned()
            } else {
                r#"[{"case":"json_mode"}]"#.to_owned()
            },
            certified_at: at,
        }
    };
    assert_eq!(s.certifications("support-bot").await.unwrap(), vec![]);
    let history = [
        cert("support-bot", "primary", "gpt-4o-mini", false, T0, "h1"),
        cert("support-bot", "primary", "gpt-4o-mini", true, T0 + 10, "h2"),
        cert(
            "support-bot",
            "fallback",
            "llama-3.1-8b",
            true,
            T0 + 5,
            "h1",
        ),
        cert(
            "support-bot",
            "fallback",
            "llama-3.1-8b",
            false,
            T0 + 20,
            "h2",
        ),
        cert("support-bot", "primary", "gpt-4o", true, T0, "h1"),
        // Same time as the previous one: the later record wins.
        cert("support-bot", "primary", "gpt-4o", false, T0, "h3"),
        cert("other-route", "primary", "gpt-4o-mini", false, T0 + 99, "x"),
    ];
    for c in &history {
        s.record_certification(c).await.unwrap();
    }
    let latest = s.certifications("support-bot").await.unwrap();
    assert_eq!(
        latest,
        vec![history[3].clone(), history[5].clone(), history[1].clone()]
    );
    assert_eq!(
        s.certifications("other-route").await.unwrap(),
        vec![history[6].clone()]
    );
}

// ---------------------------------------------------------------------------
// Batches: the executor claims, starts and completes many jobs at a time
// ---------------------------------------------------------------------------

fn target() -> NewAttempt {
    NewAttempt {
        provider: "primary".to_owned(),
        model: "gpt-4o-mini".to_owned(),
    }
}

fn result_of(a: &AttemptRecord, text: &str) -> AttemptResult {
    AttemptResult {
        job_id: a.job_id.clone(),
        n: a.n,
        read_version: a.read_version,
        result: text.to_owned(),
    }
}

async fn claim_and_start_starts_where_chosen_and_allowed(s: Arc<dyn Store>) {
    // again: back in the queue after a failed attempt.
    let again = create(&*s, "t1", "again", T0 + 2).await;
    claim_one(&*s, "w0", T0 + 2).await;
    let failed = start(&*s, &again.id, false).await;
    assert!(
        s.finish_attempt(&again.id, 1, AttemptState::Failed, Some("http_500"), T0 + 3)
            .await
            .unwrap()
    );
    assert!(
        s.requeue(&again.id, Some("w0"), T0 + 3, false, T0 + 3)
            .await
            .unwrap()
    );
    // fresh: no attempt yet, one is chosen. skipped: none is chosen.
    let fresh = create(&*s, "t1", "fresh", T0).await;
    let skipped = create(&*s, "t1", "skipped", T0 + 1).await;
    // busy: still queued, but an attempt of it is running (a manual start):
    // the store refuses a second, whatever the chooser says.
    let busy = create(&*s, "t1", "busy", T0 + 4).await;
    let running = start(&*s, &busy.id, false).await;
    let last = create(&*s, "t1", "last", T0 + 5).await;

    let mut seen: Vec<(String, Vec<i32>)> = Vec::new();
    let claimed = s
        .claim_and_start(
            "w1",
            T0 + 10,
            T0 + 30_000,
            T0 + 60_000,
            Room { jobs: 4, lines: 4 },
            &mut |job, earlier| {
                seen.push((job.id.clone(), earlier.iter().map(|a| a.n).collect()));
                (job.id != skipped.id).then(target)
            },
        )
        .await
        .unwrap();
    let ids = |list: &[ClaimedJob]| list.iter().map(|c| c.job.id.clone()).collect::<Vec<_>>();
    let order = vec![
        fresh.id.clone(),
        skipped.id.clone(),
        again.id.clone(),
        busy.id.clone(),
    ];
    assert_eq!(ids(&claimed), order, "oldest first, up to the limit");
    assert_eq!(
        seen,
        vec![
            (fresh.id.clone(), vec![]),
            (skipped.id.clone(), vec![]),
            (again.id.clone(), vec![1]),
            (busy.id.clone(), vec![1]),
        ],
        "the chooser sees each job once, with its earlier attempts"
    );
    for c in &claimed {
        assert_eq!(c.job.state, JobState::Running);
        assert_eq!(c.job.claimed_by.as_deref(), Some("w1"));
        assert_eq!(c.job.claim_until, Some(T0 + 30_000));
    }
    let started = |i: usize| claimed[i].started.clone().expect("started");
    let (f1, a2) = (started(0), started(2));
    assert_eq!((f1.job_id.as_str(), f1.n), (fresh.id.as_str(), 1));
    assert_eq!(
        (a2.job_id.as_str(), a2.n),
        (again.id.as_str(), 2),
        "numbering goes on"
    );
    for (a, job) in [(&f1, &claimed[0].job), (&a2, &claimed[2].job)] {
        assert_eq!(a.state, AttemptState::Starting);
        assert!(!a.hedge);
        assert_eq!(a.owner.as_deref(), Some("w1"));
        assert_eq!((a.started_at, a.lease_until), (T0 + 10, Some(T0 + 60_000)));
        assert_eq!(a.read_version, job.version, "the claim's version");
        assert_eq!(
            (a.provider.as_str(), a.model.as_str()),
            ("primary", "gpt-4o-mini")
        );
        assert_eq!(s.attempts(&a.job_id).await.unwrap().last(), Some(a));
    }
    assert_eq!(claimed[1].started, None, "not chosen: not started");
    assert_eq!(claimed[3].started, None, "an active attempt: not started");
    assert_eq!(claimed[2].earlier, vec![attempt(&*s, &again.id, 1).await]);
    assert_eq!(claimed[2].earlier[0].n, failed.n);
    assert_eq!(claimed[3].earlier, vec![running.clone()]);
    assert!(s.attempts(&skipped.id).await.unwrap().is_empty());
    assert_eq!(s.attempts(&busy.id).await.unwrap(), vec![running]);
    // What is left: the last job, once; then nothing.
    let rest = s
        .claim_and_start(
            "w1",
            T0 + 10,
            T0 + 30_000,
            T0 + 60_000,
            Room { jobs: 4, lines: 4 },
            &mut |_, _| Some(target()),
        )
        .await
        .unwrap();
    assert_eq!(ids(&rest), vec![last.id.clone()]);
    assert!(claim(&*s, "w1", T0 + 10, T0 + 30_000, 4).await.is_empty());
}

async fn complete_all_batch_each_as_if_alone(s: Arc<dyn Store>) {
    // Job a: its attempt and a hedge, both in the batch: the first wins.
    let a = create(&*s, "t1", "a", T0).await;
    let a1 = start(&*s, &a.id, false).await;
    let a2 = start(&*s, &a.id, true).await;
    // Job b: one attempt, completes.
    let b = create(&*s, "t1", "b", T0 + 1).await;
    let b1 = start(&*s, &b.id, false).await;
    // Job c: its attempt already failed: left alone.
    let c = create(&*s, "t1", "c", T0 + 2).await;
    let c1 = start(&*s, &c.id, false).await;
    assert!(
        s.finish_attempt(&c.id, c1.n, AttemptState::Failed, Some("429"), T0)
            .await
            .unwrap()
    );
    // Job d: claimed after its attempt read the version: discarded.
    let d = create(&*s, "t1", "d", T0 + 3).await;
    let d1 = start(&*s, &d.id, false).await;
    s.cancel_job("t1", &d.id, T0).await.unwrap();
    let batch = [
        result_of(&a1, "a-first"),
        result_of(&b1, "b-only"),
        result_of(&a2, "a-hedge"),
        result_of(&c1, "c-late"),
        result_of(&d1, "d-after-cancel"),
        result_of(&a1, "a-again"),
        AttemptResult {
            job_id: "no-such-job".into(),
            n: 1,
            read_version: 0,
            result: "x".into(),
        },
    ];
    let out = s.complete_all(&batch, T0 + 5).await.unwrap();
    assert_eq!(out.len(), batch.len());
    match &out[0] {
        Completion::Won(j) => {
            assert_eq!(j.id, a.id);
            assert_eq!(j.state, JobState::Succeeded);
            assert_eq!(j.completed_by, Some(a1.n));
            assert_eq!(j.result.as_deref(), Some("a-first"));
            assert_eq!(j.version, a.version + 1);
        }
        other => panic!("a's first attempt should win: {other:?}"),
    }
    assert!(matches!(&out[1], Completion::Won(j) if j.id == b.id));
    for (i, o) in out.iter().enumerate().skip(2) {
        assert_eq!(*o, Completion::Lost, "entry {i}");
    }
    let state = |v: &[AttemptRecord], n: i32| v.iter().find(|x| x.n == n).map(|x| x.state);
    let aa = s.attempts(&a.id).await.unwrap();
    assert_eq!(state(&aa, a1.n), Some(AttemptState::Succeeded));
    assert_eq!(state(&aa, a2.n), Some(AttemptState::Discarded));
    assert!(aa.iter().all(|x| x.finished_at == Some(T0 + 5)));
    let bb = s.attempts(&b.id).await.unwrap();
    assert_eq!(state(&bb, b1.n), Some(AttemptState::Succeeded));
    let cc = s.attempts(&c.id).await.unwrap();
    assert_eq!(state(&cc, c1.n), Some(AttemptState::Failed), "left alone");
    let dd = s.attempts(&d.id).await.unwrap();
    assert_eq!(state(&dd, d1.n), Some(AttemptState::Discarded));
    assert_eq!(job(&*s, &b.id).await.result.as_deref(), Some("b-only"));
    assert_eq!(job(&*s, &c.id).await.state, JobState::Queued);
    let d_after = job(&*s, &d.id).await;
    assert_eq!(d_after.state, JobState::Cancelled);
    assert_eq!(d_after.result, None);
    assert!(s.complete_all(&[], T0).await.unwrap().is_empty());
    // A result is stored exactly as given, escapes and all.
    let e = create(&*s, "t1", "e", T0 + 4).await;
    let e1 = start(&*s, &e.id, false).await;
    let text = "{\"content\":\"caf\\u00e9 \u{e9}\\n\\\"quoted\\\" \u{1F600}\"}";
    let out = s
        .complete_all(&[result_of(&e1, text)], T0 + 6)
        .await
        .unwrap();
    assert!(matches!(&out[0], Completion::Won(j) if j.result.as_deref() == Some(text)));
    assert_eq!(job(&*s, &e.id).await.result.as_deref(), Some(text));
}

async fn complete_all_concurrent_one_winner_per_job(s: Arc<dyn Store>) {
    const JOBS: usize = 20;
    const WRITERS: usize = 4;
    let mut attempts = Vec::new();
    for i in 0..JOBS {
        let j = create(&*s, "t1", &format!("job-{i}"), T0 + i as i64).await;
        let first = start(&*s, &j.id, false).await;
        let hedge = start(&*s, &j.id, true).await;
        attempts.push((first, hedge));
    }
    let barrier = Arc::new(Barrier::new(WRITERS));
    let tasks: Vec<_> = (0..WRITERS)
        .map(|w| {
            let (s, barrier) = (s.clone(), barrier.clone());
            // Writer w sends, for every job, one of its two attempts, in
            // its own order.
            let mut batch: Vec<AttemptResult> = attempts
                .iter()
                .map(|(first, hedge)| {
                    let a = if w % 2 == 0 { first } else { hedge };
                    result_of(a, &format!("{}-{}-by-{w}", a.job_id, a.n))
                })
                .collect();
            batch.rotate_left(w * JOBS / WRITERS);
            tokio::spawn(async move {
                barrier.wait().await;
                let mut won = Vec::new();
                for chunk in batch.chunks(5) {
                    let out = s.complete_all(chunk, T0 + 1).await.unwrap();
                    for (r, o) in chunk.iter().zip(out) {
                        if let Completion::Won(j) = o {
                            assert_eq!(j.result.as_deref(), Some(r.result.as_str()));
                            won.push((r.job_id.clone(), r.n, r.result.clone()));
                        }
                    }
                }
                won
            })
        })
        .collect();
    let mut winners: HashMap<String, (i32, String)> = HashMap::new();
    for t in tasks {
        for (id, n, result) in t.await.unwrap() {
            assert!(
                winners.insert(id.clone(), (n, result)).is_none(),
                "job {id} completed twice"
            );
        }
    }
    assert_eq!(winners.len(), JOBS, "every job completed once");
    for (first, _) in &attempts {
        let (n, result) = &winners[&first.job_id];
        let after = job(&*s, &first.job_id).await;
        assert_eq!(after.state, JobState::Succeeded);
        assert_eq!(after.completed_by, Some(*n));
        assert_eq!(after.result.as_ref(), Some(result));
        assert_eq!(after.version, first.read_version + 1);
        for a in s.attempts(&first.job_id).await.unwrap() {
            let expected = if a.n == *n {
                AttemptState::Succeeded
            } else {
                AttemptState::Discarded
            };
            assert_eq!(a.state, expected, "job {} attempt {}", a.job_id, a.n);
        }
    }
}

// ---------------------------------------------------------------------------
// Backend-specific
// ---------------------------------------------------------------------------

/// Several replicas starting together migrate the same database at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_concurrent_migrations() {
    const REPLICAS: usize = 4;
    let scratch = Scratch::new(Backend::Postgres).await;
    let url = scratch.url();
    let barrier = Arc::new(Barrier::new(REPLICAS));
    let tasks: Vec<_> = (0..REPLICAS)
        .map(|_| {
            let (url, barrier) = (url.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                PgStore::connect(&url, 2).await.map_err(|e| e.to_string())
            })
        })
        .collect();
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.map_err(|e| e.to_string()).and_then(|r| r));
    }
    let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    let failures = format!("{failures:?}");
    let migrated = match results.first() {
        Some(Ok(store)) => store
            .attempts("none")
            .await
            .map(|a| a.is_empty())
            .unwrap_or(false),
        _ => false,
    };
    drop(results);
    scratch.remove().await;
    assert_eq!(failures, "[]", "every replica migrates");
    assert!(migrated, "the tables exist");
}

/// Opening an existing file runs no migration twice and keeps the data.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_reopen_keeps_data() {
    let scratch = Scratch::new(Backend::Sqlite).await;
    let id = {
        let s = scratch.open().await;
        create(&*s, "t1", "k", T0).await.id
    };
    let s = scratch.open().await;
    let found = s.job(None, &id).await;
    drop(s);
    scratch.remove().await;
    assert_eq!(found.unwrap().map(|j| j.id), Some(id));
}

async fn responses_are_kept_per_tenant(s: Arc<dyn Store>) {
    let kept = |tenant: &str, id: &str, body: &str, at: i64| StoredResponse {
        tenant: tenant.into(),
        id: id.into(),
        body: body.into(),
        turns: "[]".into(),
        created_at: at,
        format: 2,
        previous_id: None,
        fingerprint: None,
    };
    let first = kept("t1", "resp_a", r#"{"n":1}"#, T0);
    s.put_response(&first).await.unwrap();
    // The same id again is the same answer: the first write stays.
    s.put_response(&kept("t1", "resp_a", r#"{"n":2}"#, T0 + 1))
        .await
        .unwrap();
    assert_eq!(s.response("t1", "resp_a").await.unwrap(), Some(first));
    // Another tenant sees nothing by that id, and may keep its own.
    assert_eq!(s.response("t2", "resp_a").await.unwrap(), None);
    assert!(!s.delete_response("t2", "resp_a").await.unwrap());
    let theirs = kept("t2", "resp_a", r#"{"n":3}"#, T0 + 10);
    s.put_response(&theirs).await.unwrap();
    assert_eq!(s.response("t2", "resp_a").await.unwrap(), Some(theirs));

    assert!(s.delete_response("t1", "resp_a").await.unwrap());
    assert!(!s.delete_response("t1", "resp_a").await.unwrap());
    assert_eq!(s.response("t1", "resp_a").await.unwrap(), None);

    s.put_response(&kept("t1", "resp_old", "{}", T0))
        .await
        .unwrap();
    assert_eq!(s.purge_responses(T0 + 5).await.unwrap(), 1);
    assert_eq!(s.response("t1", "resp_old").await.unwrap(), None);
    assert!(s.response("t2", "resp_a").await.unwrap().is_some());
}

// ---------------------------------------------------------------------------
// Keys and budgets
// ---------------------------------------------------------------------------

const DAY: i64 = 86_400_000;

fn settlement(scope: &str, reserved: i64, spent: i64, calls: i64) -> Settlement {
    Settlement {
        scope: scope.to_owned(),
        reserved,
        spent,
        calls,
    }
}

fn key_record(id: &str, tenant: &str, created_at: i64) -> KeyRecord {
    KeyRecord {
        id: id.to_owned(),
        tenant: tenant.to_owned(),
        name: format!("{id} name"),
        digest: format!("digest-{id}"),
        hint: format!("sk-idem-...{id}"),
        expires_at: None,
        models: None,
        rpm: None,
        tpm: None,
        budget_nanos: None,
        budget_period: None,
        metadata: None,
        created_at,
        revoked_at: None,
        rotated_at: None,
        last_used_at: None,
        version: 1,
    }
}

fn audit(action: &str, key: &KeyRecord, at: i64) -> AuditEntry {
    AuditEntry {
        at,
        actor: "admin".to_owned(),
        action: action.to_owned(),
        key_id: key.id.clone(),
        tenant: key.tenant.clone(),
        detail: serde_json::json!({ "at": at }).to_string(),
    }
}

async fn create_key(s: &dyn Store, key: &KeyRecord) {
    s.create_key(key, &audit("create", key, key.created_at))
        .await
        .unwrap();
}

async fn budget(s: &dyn Store, scope: &str, now: i64) -> BudgetRecord {
    s.budget(scope, now).await.unwrap().expect("budget exists")
}

async fn keys_create_list_and_get(s: Arc<dyn Store>) {
    let mut a = key_record("key_a", "t1", T0);
    a.expires_at = Some(T0 + DAY);
    a.models = Some(vec!["support-bot".to_owned(), "summarize".to_owned()]);
    a.rpm = Some(60);
    a.tpm = Some(10_000);
    a.budget_nanos = Some(5_000_000_000);
    a.budget_period = Some("1d".to_owned());
    a.metadata = Some(r#"{"team":"support"}"#.to_owned());
    let mut b = key_record("key_b", "t2", T0 + 1);
    // No route at all is not every route.
    b.models = Some(vec![]);
    let c = key_record("key_c", "t1", T0 + 2);
    for k in [&a, &b, &c] {
        create_key(&*s, k).await;
    }

    assert_eq!(
        s.keys(None).await.unwrap(),
        vec![a.clone(), b.clone(), c.clone()]
    );
    assert_eq!(
        s.keys(Some("t1")).await.unwrap(),
        vec![a.clone(), c.clone()]
    );
    assert_eq!(s.keys(Some("t3")).await.unwrap(), vec![]);
    assert_eq!(s.key("key_b").await.unwrap(), Some(b.clone()));
    assert_eq!(s.key("key_none").await.unwrap(), None);

    // Each key has its budget row: a's with its limit and period, the
    // others without a limit (their spend is counted all the same).
    assert_eq!(
        budget(&*s, "key:key_a", T0 + 5).await,
        BudgetRecord {
            scope: "key:key_a".to_owned(),
            limit_nanos: Some(5_000_000_000),
            period_ms: Some(DAY),
            period_start: T0,
            spent_nanos: 0,
            total_nanos: 0,
            calls: 0,
            reserved_nanos: 0,
        }
    );
    let c_budget = budget(&*s, "key:key_c", T0 + 5).await;
    assert_eq!(
        (
            c_budget.limit_nanos,
            c_budget.period_ms,
            c_budget.period_start
        ),
        (None, None, T0 + 2)
    );
    let scopes: Vec<String> = s
        .budgets(T0 + 5)
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.scope)
        .collect();
    assert_eq!(scopes, ["key:key_a", "key:key_b", "key:key_c"]);
    assert_eq!(s.keys_version().await.unwrap(), (3, 3));
}

async fn keys_update_sets_and_clears(s: Arc<dyn Store>) {
    let mut k = key_record("key_a", "t1", T0);
    k.rpm = Some(60);
    k.metadata = Some(r#"{"team":"support"}"#.to_owned());
    k.budget_nanos = Some(1_000);
    create_key(&*s, &k).await;
    s.settle("gw-1", &[settlement("key:key_a", 0, 300, 1)], T0 + 1)
        .await
        .unwrap();

    // Set some fields; the others stay.
    let change = KeyChange {
        name: Some("renamed".to_owned()),
        models: Some(Some(vec!["support-bot".to_owned()])),
        tpm: Some(Some(5_000)),
        budget_nanos: Some(Some(2_000)),
        budget_period: Some(Some("7d".to_owned())),
        ..KeyChange::default()
    };
    let updated = s
        .update_key("key_a", &change, &audit("update", &k, T0 + 2))
        .await
        .unwrap()
        .expect("the key exists");
    let mut expected = k.clone();
    expected.name = "renamed".to_owned();
    expected.models = Some(vec!["support-bot".to_owned()]);
    expected.tpm = Some(5_000);
    expected.budget_nanos = Some(2_000);
    expected.budget_period = Some("7d".to_owned());
    expected.version = 2;
    assert_eq!(updated, expected);
    assert_eq!(s.key("key_a").await.unwrap(), Some(expected.clone()));
    // The budget row follows; its spend and period start stay.
    let b = budget(&*s, "key:key_a", T0 + 3).await;
    assert_eq!(
        (
            b.limit_nanos,
            b.period_ms,
            b.period_start,
            b.spent_nanos,
            b.calls
        ),
        (Some(2_000), Some(7 * DAY), T0, 300, 1)
    );

    // Clear some: `Some(None)`.
    let change = KeyChange {
        rpm: Some(None),
        models: Some(None),
        metadata: Some(None),
        budget_nanos: Some(None),
        budget_period: Some(None),
        ..KeyChange::default()
    };
    let cleared = s
        .update_key("key_a", &change, &audit("update", &k, T0 + 4))
        .await
        .unwrap()
        .expect("the key exists");
    expected.rpm = None;
    expected.models = None;
    expected.metadata = None;
    expected.budget_nanos = None;
    expected.budget_period = None;
    expected.version = 3;
    assert_eq!(cleared, expected);
    let b = budget(&*s, "key:key_a", T0 + 5).await;
    assert_eq!(
        (b.limit_nanos, b.period_ms, b.spent_nanos, b.total_nanos),
        (None, None, 300, 300)
    );

    // An empty change is still a change (an audited one).
    let same = s
        .update_key("key_a", &KeyChange::default(), &audit("update", &k, T0 + 6))
        .await
        .unwrap()
        .expect("the key exists");
    assert_eq!(same.version, 4);

    // A period other than 1d, 7d, 30d is refused and changes nothing.
    let bad = KeyChange {
        budget_period: Some(Some("1h".to_owned())),
        ..KeyChange::default()
    };
    assert!(
        s.update_key("key_a", &bad, &audit("update", &k, T0 + 7))
            .await
            .is_err()
    );
    assert_eq!(s.key("key_a").await.unwrap(), Some(same.clone()));

    // No such key: None, and no audit entry.
    let ghost = key_record("key_none", "t1", T0);
    assert_eq!(
        s.update_key("key_none", &change, &audit("update", &ghost, T0 + 8))
            .await
            .unwrap(),
        None
    );
    assert_eq!(s.audit_log(Some("key_none"), 10).await.unwrap(), vec![]);
    assert_eq!(s.audit_log(Some("key_a"), 10).await.unwrap().len(), 4);

    // A revoked key may still be updated.
    s.revoke_key("key_a", T0 + 9, &audit("revoke", &k, T0 + 9))
        .await
        .unwrap();
    let renamed = s
        .update_key(
            "key_a",
            &KeyChange {
                name: Some("retired".to_owned()),
                ..KeyChange::default()
            },
            &audit("update", &k, T0 + 10),
        )
        .await
        .unwrap()
        .expect("the key exists");
    assert_eq!(
        (renamed.name.as_str(), renamed.revoked_at, renamed.version),
        ("retired", Some(T0 + 9), 6)
    );
}

async fn keys_revoke_and_rotate(s: Arc<dyn Store>) {
    let mut k = key_record("key_a", "t1", T0);
    k.budget_nanos = Some(1_000);
    create_key(&*s, &k).await;
    s.settle("gw-1", &[settlement("key:key_a", 0, 250, 1)], T0 + 1)
        .await
        .unwrap();

    // Rotation: same id, new secret, spend kept.
    let rotated = s
        .rotate_key(
            "key_a",
            "digest-new",
            "sk-idem-...new",
            T0 + 2,
            &audit("rotate", &k, T0 + 2),
        )
        .await
        .unwrap()
        .expect("the key exists");
    let mut expected = k.clone();
    expected.digest = "digest-new".to_owned();
    expected.hint = "sk-idem-...new".to_owned();
    expected.rotated_at = Some(T0 + 2);
    expected.version = 2;
    assert_eq!(rotated, expected);
    let b = budget(&*s, "key:key_a", T0 + 3).await;
    assert_eq!(
        (b.limit_nanos, b.spent_nanos, b.calls),
        (Some(1_000), 250, 1)
    );

    // Revocation, once.
    let revoked = s
        .revoke_key("key_a", T0 + 4, &audit("revoke", &k, T0 + 4))
        .await
        .unwrap()
        .expect("the key exists");
    expected.revoked_at = Some(T0 + 4);
    expected.version = 3;
    assert_eq!(revoked, expected);
    let again = s
        .revoke_key("key_a", T0 + 5, &audit("revoke", &k, T0 + 5))
        .await
        .unwrap();
    assert_eq!(again, Some(expected.clone()), "revoked already: unchanged");

    // A revoked key is never rotated back to life.
    assert_eq!(
        s.rotate_key(
            "key_a",
            "digest-3",
            "sk-idem-...3",
            T0 + 6,
            &audit("rotate", &k, T0 + 6)
        )
        .await
        .unwrap(),
        None
    );
    assert_eq!(s.key("key_a").await.unwrap(), Some(expected));

    // No such key.
    let ghost = key_record("key_none", "t1", T0);
    assert_eq!(
        s.revoke_key("key_none", T0 + 7, &audit("revoke", &ghost, T0 + 7))
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        s.rotate_key(
            "key_none",
            "d",
            "h",
            T0 + 7,
            &audit("rotate", &ghost, T0 + 7)
        )
        .await
        .unwrap(),
        None
    );
    let actions: Vec<String> = s
        .audit_log(None, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.action)
        .collect();
    assert_eq!(actions, ["revoke", "rotate", "create"]);
}

async fn keys_duplicates_refused(s: Arc<dyn Store>) {
    let a = key_record("key_a", "t1", T0);
    let b = key_record("key_b", "t1", T0 + 1);
    create_key(&*s, &a).await;
    create_key(&*s, &b).await;
    let before = s.keys_version().await.unwrap();

    // Another id with a's digest.
    let mut same_digest = key_record("key_c", "t2", T0 + 2);
    same_digest.digest = a.digest.clone();
    assert!(
        s.create_key(&same_digest, &audit("create", &same_digest, T0 + 2))
            .await
            .is_err()
    );
    // a's id again, with a digest of its own.
    let mut same_id = key_record("key_a", "t2", T0 + 3);
    same_id.digest = "digest-other".to_owned();
    assert!(
        s.create_key(&same_id, &audit("create", &same_id, T0 + 3))
            .await
            .is_err()
    );
    // Nothing of either was written: no key, no budget, no audit entry.
    assert_eq!(s.keys_version().await.unwrap(), before);
    assert_eq!(s.key("key_c").await.unwrap(), None);
    assert_eq!(s.budget("key:key_c", T0 + 4).await.unwrap(), None);
    assert_eq!(s.audit_log(None, 10).await.unwrap().len(), 2);

    // A rotation to another key's digest is refused too.
    assert!(
        s.rotate_key(
            "key_b",
            &a.digest,
            "h",
            T0 + 5,
            &audit("rotate", &b, T0 + 5)
        )
        .await
        .is_err()
    );
    assert_eq!(s.key("key_b").await.unwrap(), Some(b));
    assert_eq!(s.keys_version().await.unwrap(), before);
}

async fn keys_version_ignores_touch(s: Arc<dyn Store>) {
    assert_eq!(s.keys_version().await.unwrap(), (0, 0));
    let a = key_record("key_a", "t1", T0);
    let b = key_record("key_b", "t1", T0 + 1);
    create_key(&*s, &a).await;
    let mut seen = vec![s.keys_version().await.unwrap()];
    create_key(&*s, &b).await;
    seen.push(s.keys_version().await.unwrap());
    s.update_key("key_a", &KeyChange::default(), &audit("update", &a, T0 + 2))
        .await
        .unwrap();
    seen.push(s.keys_version().await.unwrap());
    s.rotate_key(
        "key_a",
        "digest-2",
        "h",
        T0 + 3,
        &audit("rotate", &a, T0 + 3),
    )
    .await
    .unwrap();
    seen.push(s.keys_version().await.unwrap());
    s.revoke_key("key_b", T0 + 4, &audit("revoke", &b, T0 + 4))
        .await
        .unwrap();
    seen.push(s.keys_version().await.unwrap());
    assert_eq!(seen, vec![(1, 1), (2, 2), (2, 3), (2, 4), (2, 5)]);

    // Uses are recorded without a version: the later time wins, per key,
    // whatever the order; unknown keys are ignored.
    let touched = |id: &str, t: i64| (id.to_owned(), t);
    s.touch_keys(&[
        touched("key_a", T0 + 20),
        touched("key_a", T0 + 30),
        touched("key_a", T0 + 10),
        touched("key_b", T0 + 15),
        touched("key_none", T0 + 15),
    ])
    .await
    .unwrap();
    s.touch_keys(&[touched("key_b", T0 + 5)]).await.unwrap();
    s.touch_keys(&[]).await.unwrap();
    assert_eq!(s.keys_version().await.unwrap(), (2, 5));
    let a_now = s.key("key_a").await.unwrap().unwrap();
    let b_now = s.key("key_b").await.unwrap().unwrap();
    assert_eq!((a_now.last_used_at, a_now.version), (Some(T0 + 30), 3));
    assert_eq!((b_now.last_used_at, b_now.version), (Some(T0 + 15), 2));
}

async fn key_audit_newest_first(s: Arc<dyn Store>) {
    let a = key_record("key_a", "t1", T0);
    let b = key_record("key_b", "t2", T0 + 1);
    create_key(&*s, &a).await;
    create_key(&*s, &b).await;
    s.update_key(
        "key_a",
        &KeyChange {
            rpm: Some(Some(10)),
            ..KeyChange::default()
        },
        &audit("update", &a, T0 + 2),
    )
    .await
    .unwrap();
    s.rotate_key(
        "key_a",
        "digest-2",
        "h",
        T0 + 3,
        &audit("rotate", &a, T0 + 3),
    )
    .await
    .unwrap();
    s.revoke_key("key_a", T0 + 4, &audit("revoke", &a, T0 + 4))
        .await
        .unwrap();

    let of_a = s.audit_log(Some("key_a"), 10).await.unwrap();
    assert_eq!(
        of_a,
        vec![
            audit("revoke", &a, T0 + 4),
            audit("rotate", &a, T0 + 3),
            audit("update", &a, T0 + 2),
            audit("create", &a, T0),
        ]
    );
    let all: Vec<(String, String)> = s
        .audit_log(None, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.key_id, e.action))
        .collect();
    let pair = |k: &str, a: &str| (k.to_owned(), a.to_owned());
    assert_eq!(
        all,
        vec![
            pair("key_a", "revoke"),
            pair("key_a", "rotate"),
            pair("key_a", "update"),
            pair("key_b", "create"),
            pair("key_a", "create"),
        ]
    );
    assert_eq!(s.audit_log(None, 2).await.unwrap().len(), 2);
    assert_eq!(
        s.audit_log(Some("key_b"), 10).await.unwrap(),
        vec![audit("create", &b, T0 + 1)]
    );
}

async fn grant_concurrent_never_exceeds_budget(s: Arc<dyn Store>) {
    const UNIT: i64 = 100;
    const CALLS: usize = 50;
    const HOLDERS: usize = 5;
    const LEASE: i64 = T0 + 60_000;
    let scope = "tenant:t1";
    s.set_budget(scope, Some(10 * UNIT), None, T0)
        .await
        .unwrap();
    let barrier = Arc::new(Barrier::new(CALLS));
    let tasks: Vec<_> = (0..CALLS)
        .map(|i| {
            let (s, barrier) = (s.clone(), barrier.clone());
            tokio::spawn(async move {
                let holder = format!("gw-{}", i % HOLDERS);
                barrier.wait().await;
                let granted = s.grant(scope, &holder, UNIT, 0, LEASE, T0).await.unwrap();
                (holder, granted)
            })
        })
        .collect();
    let mut by_holder: HashMap<String, Vec<i64>> = HashMap::new();
    for t in tasks {
        let (holder, granted) = t.await.unwrap();
        if let Some(amount) = granted {
            by_holder.entry(holder).or_default().push(amount);
        }
    }
    let granted: usize = by_holder.values().map(Vec::len).sum();
    assert_eq!(granted, 10, "exactly the budget is granted: {by_holder:?}");
    // Each holder's grants come back as its running total: 1, 2, ... units.
    let mut total = 0;
    for amounts in by_holder.values_mut() {
        amounts.sort_unstable();
        let expected: Vec<i64> = (1..=amounts.len() as i64).map(|n| n * UNIT).collect();
        assert_eq!(*amounts, expected);
        total += amounts.last().copied().unwrap_or(0);
    }
    assert_eq!(total, 10 * UNIT);
    assert_eq!(budget(&*s, scope, T0).await.reserved_nanos, 10 * UNIT);
    assert_eq!(
        s.grant(scope, "gw-new", 1, 0, LEASE, T0).await.unwrap(),
        None
    );

    // Four calls settle for less than they reserved: what they did not
    // spend is free again, for anyone.
    // Each settles a unit its holder was granted: a holder that got one
    // unit settles once (the grants fall on the holders at random).
    let units: Vec<&String> = by_holder
        .iter()
        .flat_map(|(holder, amounts)| std::iter::repeat_n(holder, amounts.len()))
        .collect();
    for holder in units.iter().take(4) {
        s.settle(holder, &[settlement(scope, UNIT, 40, 1)], T0 + 1)
            .await
            .unwrap();
    }
    let b = budget(&*s, scope, T0 + 1).await;
    assert_eq!(
        (b.spent_nanos, b.total_nanos, b.calls, b.reserved_nanos),
        (160, 160, 4, 6 * UNIT)
    );
    // 1000 - 160 - 600 = 240 left: two more units, not three.
    assert!(
        s.grant(scope, "gw-new", UNIT, 0, LEASE, T0 + 2)
            .await
            .unwrap()
            .is_some()
    );
    assert!(
        s.grant(scope, "gw-0", UNIT, 0, LEASE, T0 + 2)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(
        s.grant(scope, "gw-1", UNIT, 0, LEASE, T0 + 2)
            .await
            .unwrap(),
        None
    );
    // A call that cost more than it reserved is counted in full.
    s.settle("gw-new", &[settlement(scope, UNIT, 150, 1)], T0 + 3)
        .await
        .unwrap();
    let b = budget(&*s, scope, T0 + 3).await;
    assert_eq!(
        (b.spent_nanos, b.calls, b.reserved_nanos),
        (310, 5, 7 * UNIT)
    );
}

async fn grant_leases_extra_and_release(s: Arc<dyn Store>) {
    let scope = "key:key_a";
    s.set_budget(scope, Some(1_000), None, T0).await.unwrap();
    // At most need + extra, as much of the extra as is left.
    assert_eq!(
        s.grant(scope, "gw-a", 100, 500, T0 + 1_000, T0)
            .await
            .unwrap(),
        Some(600)
    );
    assert_eq!(
        s.grant(scope, "gw-b", 300, 500, T0 + 60_000, T0)
            .await
            .unwrap(),
        Some(400)
    );
    assert_eq!(
        s.grant(scope, "gw-b", 1, 0, T0 + 60_000, T0).await.unwrap(),
        None
    );
    assert_eq!(budget(&*s, scope, T0).await.reserved_nanos, 1_000);

    // gw-a's lease lapses: its grant no longer counts for others, even
    // before it is removed.
    let later = T0 + 2_000;
    assert_eq!(budget(&*s, scope, later).await.reserved_nanos, 400);
    assert_eq!(
        s.grant(scope, "gw-b", 100, 0, T0 + 60_000, later)
            .await
            .unwrap(),
        Some(500)
    );
    // ... but it still counts for gw-a itself: 1000 - 500 - 600 < 100.
    assert_eq!(
        s.grant(scope, "gw-a", 100, 0, T0 + 60_000, later)
            .await
            .unwrap(),
        None
    );
    assert_eq!(s.expire_grants(later).await.unwrap(), 1);
    assert_eq!(s.expire_grants(later).await.unwrap(), 0);
    assert_eq!(
        s.grant(scope, "gw-a", 100, 1_000, T0 + 60_000, later)
            .await
            .unwrap(),
        Some(500)
    );
    assert_eq!(budget(&*s, scope, later).await.reserved_nanos, 1_000);

    // A release gives back part of a grant; a grant given back in full is
    // gone.
    s.release(scope, "gw-a", 200).await.unwrap();
    assert_eq!(budget(&*s, scope, later).await.reserved_nanos, 800);
    s.release(scope, "gw-a", 1_000).await.unwrap();
    assert_eq!(budget(&*s, scope, later).await.reserved_nanos, 500);
    // Renewal: every live grant of the holder, and only its; a grant whose
    // lease ended is not revived (its room may be someone else's now).
    assert_eq!(
        s.renew_grants("gw-b", later, T0 + 120_000).await.unwrap(),
        1
    );
    assert_eq!(
        s.renew_grants("gw-a", later, T0 + 120_000).await.unwrap(),
        0
    );
    let other = "key:key_b";
    s.set_budget(other, Some(1_000), None, T0).await.unwrap();
    assert!(
        s.grant(other, "gw-c", 10, 0, T0 + 10, T0)
            .await
            .unwrap()
            .is_some()
    );
    assert_eq!(
        s.renew_grants("gw-c", T0 + 11, T0 + 60_000).await.unwrap(),
        0
    );
    assert_eq!(budget(&*s, other, T0 + 11).await.reserved_nanos, 0);
    assert_eq!(s.expire_grants(T0 + 11).await.unwrap(), 1);
    assert_eq!(s.expire_grants(T0 + 100_000).await.unwrap(), 0);
    assert_eq!(budget(&*s, scope, T0 + 100_000).await.reserved_nanos, 500);
    assert_eq!(s.expire_grants(T0 + 120_000).await.unwrap(), 1);
    assert_eq!(budget(&*s, scope, T0 + 100_000).await.reserved_nanos, 0);
}

async fn grant_period_rollover(s: Arc<dyn Store>) {
    let scope = "tenant:t1";
    let lease = T0 + 10 * DAY;
    s.set_budget(scope, Some(1_000), Some(DAY), T0)
        .await
        .unwrap();
    assert_eq!(
        s.grant(scope, "gw", 600, 0, lease, T0).await.unwrap(),
        Some(600)
    );
    s.settle("gw", &[settlement(scope, 600, 600, 1)], T0 + 10)
        .await
        .unwrap();
    assert_eq!(
        s.grant(scope, "gw", 500, 0, lease, T0 + 20).await.unwrap(),
        None
    );

    // The next day reads as a new period, without a write.
    let next = budget(&*s, scope, T0 + DAY).await;
    assert_eq!((next.period_start, next.spent_nanos), (T0 + DAY, 0));
    assert_eq!((next.total_nanos, next.calls), (600, 1));
    let stored = budget(&*s, scope, T0 + 20).await;
    assert_eq!((stored.period_start, stored.spent_nanos), (T0, 600));

    // Two days and a bit later a reservation moves the period on by whole
    // days: spend from 0, the total kept.
    let day3 = T0 + 2 * DAY + 5;
    assert_eq!(
        s.grant(scope, "gw", 500, 0, lease, day3).await.unwrap(),
        Some(500)
    );
    let b = budget(&*s, scope, day3).await;
    assert_eq!(
        (
            b.period_start,
            b.spent_nanos,
            b.total_nanos,
            b.calls,
            b.reserved_nanos
        ),
        (T0 + 2 * DAY, 0, 600, 1, 500)
    );
    // A settlement moves it on too.
    s.settle("gw", &[settlement(scope, 500, 100, 1)], T0 + 3 * DAY + 1)
        .await
        .unwrap();
    let b = budget(&*s, scope, T0 + 3 * DAY + 2).await;
    assert_eq!(
        (
            b.period_start,
            b.spent_nanos,
            b.total_nanos,
            b.calls,
            b.reserved_nanos
        ),
        (T0 + 3 * DAY, 100, 700, 2, 0)
    );

    // A new limit and period keep the spend.
    s.set_budget(scope, Some(5_000), Some(7 * DAY), T0 + 3 * DAY + 3)
        .await
        .unwrap();
    let b = budget(&*s, scope, T0 + 3 * DAY + 4).await;
    assert_eq!(
        (
            b.limit_nanos,
            b.period_ms,
            b.period_start,
            b.spent_nanos,
            b.total_nanos
        ),
        (Some(5_000), Some(7 * DAY), T0 + 3 * DAY, 100, 700)
    );
}

async fn grant_unlimited_and_settle_without_row(s: Arc<dyn Store>) {
    let lease = T0 + 60_000;
    // No budget row: no budget, and nothing written.
    for _ in 0..2 {
        assert_eq!(
            s.grant("key:free", "gw", 1_000_000, 5, lease, T0)
                .await
                .unwrap(),
            Some(1_000_005)
        );
    }
    assert_eq!(s.budget("key:free", T0).await.unwrap(), None);
    assert_eq!(s.budgets(T0).await.unwrap(), vec![]);

    // A settlement creates the row, without a limit, and counts the spend.
    s.settle("gw", &[settlement("key:free", 1_000_005, 70, 1)], T0 + 1)
        .await
        .unwrap();
    // A batch settles every spender in it: here the key and its tenant.
    s.settle(
        "gw",
        &[
            settlement("tenant:free", 0, 30, 1),
            settlement("key:free", 0, 30, 1),
        ],
        T0 + 2,
    )
    .await
    .unwrap();
    assert_eq!(budget(&*s, "tenant:free", T0 + 3).await.spent_nanos, 30);
    assert_eq!(
        budget(&*s, "key:free", T0 + 3).await,
        BudgetRecord {
            scope: "key:free".to_owned(),
            limit_nanos: None,
            period_ms: None,
            period_start: T0 + 1,
            spent_nanos: 100,
            total_nanos: 100,
            calls: 2,
            reserved_nanos: 0,
        }
    );

    // A row without a limit grants whatever is asked, and records it.
    s.set_budget("tenant:t1", None, Some(DAY), T0)
        .await
        .unwrap();
    s.settle("gw", &[settlement("tenant:t1", 0, i64::MAX / 4, 1)], T0)
        .await
        .unwrap();
    assert_eq!(
        s.grant("tenant:t1", "gw", 1_000, 500, lease, T0)
            .await
            .unwrap(),
        Some(1_500)
    );
    assert_eq!(
        s.grant("tenant:t1", "gw", 1_000, 0, lease, T0)
            .await
            .unwrap(),
        Some(2_500)
    );
    assert_eq!(budget(&*s, "tenant:t1", T0).await.reserved_nanos, 2_500);
    let scopes: Vec<String> = s
        .budgets(T0)
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.scope)
        .collect();
    assert_eq!(scopes, ["key:free", "tenant:free", "tenant:t1"]);
}
