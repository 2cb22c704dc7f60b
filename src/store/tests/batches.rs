//! Batches in the store, on both backends: one batch per tenant's key
//! however many create it at once, a claim that one driver at a time
//! holds and that lapses, a status that moves only from the status its
//! driver read (a cancel is never overwritten), lines answered without
//! a call found and created already ended, a claim that takes live jobs
//! before batch lines and no more lines than it is allowed, and a batch
//! deleted only once it has ended.

use std::sync::Arc;

use tokio::sync::Barrier;

use super::super::{
    BatchCounts, BatchCreated, BatchRecord, BatchStatus, Created, JobState, NewJob, Room, Store,
};
use super::{Backend, T0, create, new_job, run};

fn batch(tenant: &str, id: &str, key: Option<&str>, created_at: i64) -> BatchRecord {
    BatchRecord {
        id: id.to_owned(),
        tenant: tenant.to_owned(),
        idempotency_key: key.map(str::to_owned),
        payload_hash: "hash".to_owned(),
        endpoint: "/v1/chat/completions".to_owned(),
        input_file_id: "file-1".to_owned(),
        completion_window: "24h".to_owned(),
        metadata: None,
        key_id: None,
        status: BatchStatus::Validating,
        errors: None,
        output_file_id: None,
        error_file_id: None,
        counts: BatchCounts::default(),
        created_at,
        expires_at: created_at + 86_400_000,
        in_progress_at: None,
        finalizing_at: None,
        completed_at: None,
        failed_at: None,
        expired_at: None,
        cancelling_at: None,
        cancelled_at: None,
        claimed_by: None,
        claim_until: None,
        upstream: None,
    }
}

async fn batches_one_per_key_and_tenant_scoped(s: Arc<dyn Store>) {
    // Eight creations of one key at once: one batch.
    let barrier = Arc::new(Barrier::new(8));
    let mut racers = Vec::new();
    for i in 0..8 {
        let (s, barrier) = (s.clone(), barrier.clone());
        racers.push(tokio::spawn(async move {
            barrier.wait().await;
            s.create_batch(&batch("t1", &format!("batch_{i}"), Some("k"), T0), 100)
                .await
                .unwrap()
        }));
    }
    let mut new = Vec::new();
    let mut ids = Vec::new();
    for r in racers {
        match r.await.unwrap() {
            BatchCreated::New(b) => {
                ids.push(b.id.clone());
                new.push(b);
            }
            BatchCreated::Existing(b) => ids.push(b.id),
            BatchCreated::TooMany => panic!("under the limit"),
        }
    }
    assert_eq!(new.len(), 1, "one creation inserts the batch");
    assert!(
        ids.iter().all(|id| *id == new[0].id),
        "all get the same batch"
    );
    // Without a key, each creation is a batch; another tenant's key is its own.
    for (tenant, id, key) in [
        ("t1", "batch_a", None),
        ("t1", "batch_b", None),
        ("t2", "batch_c", Some("k")),
    ] {
        assert!(matches!(
            s.create_batch(&batch(tenant, id, key, T0 + 1), 100)
                .await
                .unwrap(),
            BatchCreated::New(_)
        ));
    }
    assert!(s.batch(Some("t2"), &new[0].id).await.unwrap().is_none());
    assert!(s.batch(Some("t1"), &new[0].id).await.unwrap().is_some());
    assert!(s.batch(None, "batch_c").await.unwrap().is_some());
    // Newest first, after a cursor; another tenant's cursor gives nothing.
    let listed: Vec<String> = s
        .list_batches("t1", false, None, 10)
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.id)
        .collect();
    assert_eq!(listed, ["batch_b", "batch_a", new[0].id.as_str()]);
    let rest: Vec<String> = s
        .list_batches("t1", false, Some("batch_b"), 1)
        .await
        .unwrap()
        .into_iter()
        .map(|b| b.id)
        .collect();
    assert_eq!(rest, ["batch_a"]);
    assert!(
        s.list_batches("t1", false, Some("batch_c"), 10)
            .await
            .unwrap()
            .is_empty()
    );
    // t1 has three batches with work left: at a limit of three, a fourth
    // is refused, a replay of a key is still its batch, t2 is not counted.
    assert!(matches!(
        s.create_batch(&batch("t1", "batch_d", None, T0 + 2), 3)
            .await
            .unwrap(),
        BatchCreated::TooMany
    ));
    assert!(matches!(
        s.create_batch(&batch("t1", "batch_e", Some("k"), T0 + 2), 3).await.unwrap(),
        BatchCreated::Existing(b) if b.id == new[0].id
    ));
    assert!(matches!(
        s.create_batch(&batch("t2", "batch_f", None, T0 + 2), 3)
            .await
            .unwrap(),
        BatchCreated::New(_)
    ));
}

async fn batches_at_once_never_pass_the_tenants_limit(s: Arc<dyn Store>) {
    // Twelve creations at once, a limit of five: five batches.
    let barrier = Arc::new(Barrier::new(12));
    let mut racers = Vec::new();
    for i in 0..12 {
        let (s, barrier) = (s.clone(), barrier.clone());
        racers.push(tokio::spawn(async move {
            barrier.wait().await;
            s.create_batch(&batch("t1", &format!("batch_{i}"), None, T0), 5)
                .await
                .unwrap()
        }));
    }
    let mut made = 0;
    for r in racers {
        match r.await.unwrap() {
            BatchCreated::New(_) => made += 1,
            BatchCreated::TooMany => {}
            BatchCreated::Existing(b) => panic!("no key, yet {b:?}"),
        }
    }
    assert_eq!(made, 5);
    assert_eq!(
        s.list_batches("t1", false, None, 100).await.unwrap().len(),
        5
    );
}

async fn batches_claimed_by_one_driver_until_the_claim_lapses(s: Arc<dyn Store>) {
    s.create_batch(&batch("t1", "batch_x", None, T0), 100)
        .await
        .unwrap();
    let barrier = Arc::new(Barrier::new(6));
    let mut racers = Vec::new();
    for i in 0..6 {
        let (s, barrier) = (s.clone(), barrier.clone());
        racers.push(tokio::spawn(async move {
            barrier.wait().await;
            s.claim_batch(&format!("w{i}"), T0, T0 + 1_000)
                .await
                .unwrap()
        }));
    }
    let mut claimed = Vec::new();
    for r in racers {
        claimed.extend(r.await.unwrap());
    }
    assert_eq!(claimed.len(), 1, "exactly one driver claims the batch");
    let holder = claimed[0].claimed_by.clone().unwrap();
    // Live claim: nobody else; renewed by its holder only.
    assert!(
        s.claim_batch("other", T0 + 500, T0 + 1_500)
            .await
            .unwrap()
            .is_none()
    );
    assert!(!s.renew_batch("batch_x", "other", T0 + 5_000).await.unwrap());
    assert!(s.renew_batch("batch_x", &holder, T0 + 2_000).await.unwrap());
    assert!(
        s.claim_batch("other", T0 + 1_500, T0 + 2_500)
            .await
            .unwrap()
            .is_none()
    );
    // Lapsed: another takes it over, and the old holder can write nothing.
    let taken = s
        .claim_batch("other", T0 + 2_001, T0 + 3_000)
        .await
        .unwrap();
    assert_eq!(taken.map(|b| b.claimed_by), Some(Some("other".to_owned())));
    let mut b = s.batch(None, "batch_x").await.unwrap().unwrap();
    b.status = BatchStatus::InProgress;
    assert!(
        !s.set_batch(&b, &holder, BatchStatus::Validating)
            .await
            .unwrap()
    );
    assert!(
        s.set_batch(&b, "other", BatchStatus::Validating)
            .await
            .unwrap()
    );
    // Released: claimable at once; a batch with no work left is not.
    s.release_batch("batch_x", "other").await.unwrap();
    let again = s
        .claim_batch("w9", T0 + 2_002, T0 + 3_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.status, BatchStatus::InProgress);
    b.status = BatchStatus::Completed;
    b.counts.completed = 3;
    assert!(
        s.set_batch(&b, "w9", BatchStatus::InProgress)
            .await
            .unwrap()
    );
    s.release_batch("batch_x", "w9").await.unwrap();
    assert!(
        s.claim_batch("w9", T0 + 9_000, T0 + 10_000)
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(
        s.batch(None, "batch_x")
            .await
            .unwrap()
            .unwrap()
            .counts
            .completed,
        3
    );
}

async fn batch_cancel_is_never_overwritten(s: Arc<dyn Store>) {
    s.create_batch(&batch("t1", "batch_y", None, T0), 100)
        .await
        .unwrap();
    let mut b = s.claim_batch("w", T0, T0 + 1_000).await.unwrap().unwrap();
    b.status = BatchStatus::InProgress;
    assert!(s.set_batch(&b, "w", BatchStatus::Validating).await.unwrap());
    // Another tenant cannot cancel it.
    assert!(
        s.cancel_batch("t2", "batch_y", T0 + 1)
            .await
            .unwrap()
            .is_none()
    );
    let cancelling = s
        .cancel_batch("t1", "batch_y", T0 + 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(cancelling.status, BatchStatus::Cancelling);
    assert_eq!(cancelling.cancelling_at, Some(T0 + 2));
    // The driver's progress, written from the status it read, is refused.
    b.counts.completed = 1;
    assert!(!s.set_batch(&b, "w", BatchStatus::InProgress).await.unwrap());
    b.status = BatchStatus::Cancelled;
    assert!(s.set_batch(&b, "w", BatchStatus::Cancelling).await.unwrap());
    // A finished batch is not cancelled again.
    let done = s
        .cancel_batch("t1", "batch_y", T0 + 3)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(done.status, BatchStatus::Cancelled);
    assert_eq!(done.cancelling_at, Some(T0 + 2));
}

fn line(tenant: &str, key: &str, batch_id: &str, fp: &str, at: i64) -> NewJob {
    NewJob {
        fingerprint: fp.to_owned(),
        batch_id: Some(batch_id.to_owned()),
        ..new_job(tenant, key, at)
    }
}

async fn batch_lines_answered_by_earlier_ones(s: Arc<dyn Store>) {
    // A line of batch 1 that succeeded (one attempt completed it).
    let first = match s
        .create_job(&line("t1", "b1/a", "batch_1", "fp-same", T0))
        .await
        .unwrap()
    {
        Created::New(j) => j,
        Created::Existing(j) => panic!("existing {j:?}"),
    };
    let started = match s
        .start_attempt(&first.id, "openai", "gpt", false, "w", T0, T0 + 1_000)
        .await
        .unwrap()
    {
        super::super::StartAttempt::Started(a) => a,
        other => panic!("{other:?}"),
    };
    s.complete(
        &first.id,
        started.n,
        started.read_version,
        "{\"answer\":1}",
        T0 + 1,
    )
    .await
    .unwrap();
    // A job of its own (no batch), another tenant's line, and a failed
    // line with the same fingerprint are not answers for batch 2.
    let own = NewJob {
        fingerprint: "fp-same".to_owned(),
        ..new_job("t1", "own", T0 + 2)
    };
    s.create_job(&own).await.unwrap();
    s.create_job(&line("t2", "b9/a", "batch_9", "fp-same", T0 + 2))
        .await
        .unwrap();
    let found = s
        .earlier_answer("t1", "fp-same", "batch_2", T0)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(found.id, first.id);
    // Not the batch's own lines, nor older than `since`.
    assert!(
        s.earlier_answer("t1", "fp-same", "batch_1", T0)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        s.earlier_answer("t1", "fp-same", "batch_2", T0 + 1)
            .await
            .unwrap()
            .is_none()
    );
    assert!(
        s.earlier_answer("t2", "fp-same", "batch_2", T0)
            .await
            .unwrap()
            .is_none()
    );

    // A line answered by it: created succeeded, with the result and one
    // attempt naming the job that answered it, on the same target.
    let answered = match s
        .create_answered(
            &line("t1", "b2/x", "batch_2", "fp-same", T0 + 5),
            &found,
            T0 + 5,
        )
        .await
        .unwrap()
    {
        Created::New(j) => j,
        Created::Existing(j) => panic!("existing {j:?}"),
    };
    assert_eq!(answered.state, JobState::Succeeded);
    assert_eq!(answered.result.as_deref(), Some("{\"answer\":1}"));
    assert_eq!(answered.completed_by, Some(1));
    assert_eq!(answered.batch_id.as_deref(), Some("batch_2"));
    let attempts = s.attempts(&answered.id).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].provider, "openai");
    assert_eq!(attempts[0].model, "gpt");
    assert_eq!(
        attempts[0].reason.as_deref(),
        Some(format!("answered by job {}", first.id).as_str())
    );
    // Again: the same job, untouched.
    assert!(matches!(
        s.create_answered(&line("t1", "b2/x", "batch_2", "fp-same", T0 + 6), &found, T0 + 6)
            .await
            .unwrap(),
        Created::Existing(j) if j.id == answered.id
    ));
    // A failed source: the line fails with its error, without an attempt.
    let failing = create(&*s, "t1", "failing", T0 + 7).await;
    assert!(
        s.fail_job(&failing.id, "all 3 attempts failed", T0 + 8)
            .await
            .unwrap()
    );
    let failing = s.job(None, &failing.id).await.unwrap().unwrap();
    let failed = match s
        .create_answered(
            &line("t1", "b2/y", "batch_2", "fp-other", T0 + 9),
            &failing,
            T0 + 9,
        )
        .await
        .unwrap()
    {
        Created::New(j) => j,
        Created::Existing(j) => panic!("existing {j:?}"),
    };
    assert_eq!(failed.state, JobState::Failed);
    assert_eq!(failed.error.as_deref(), Some("all 3 attempts failed"));
    assert!(s.attempts(&failed.id).await.unwrap().is_empty());
}

store_tests!(
    batches_one_per_key_and_tenant_scoped,
    batches_at_once_never_pass_the_tenants_limit,
    batches_claimed_by_one_driver_until_the_claim_lapses,
    batch_cancel_is_never_overwritten,
    batch_lines_answered_by_earlier_ones,
    batch_lines_start_only_while_in_progress,
    claim_takes_live_jobs_first_and_lines_up_to_their_limit,
    batches_deleted_only_once_ended,
    held_lines_are_claimed_only_once_released,
);

async fn batch_lines_start_only_while_in_progress(s: Arc<dyn Store>) {
    s.create_batch(&batch("t1", "batch_z", None, T0), 100)
        .await
        .unwrap();
    let first = line("t1", "batch_z/a", "batch_z", "fp-a", T0);
    // Validating: no line starts yet.
    assert_eq!(s.create_line(&first, false).await.unwrap(), None);
    let mut b = s.claim_batch("w", T0, T0 + 1_000).await.unwrap().unwrap();
    b.status = BatchStatus::InProgress;
    assert!(s.set_batch(&b, "w", BatchStatus::Validating).await.unwrap());
    let made = match s.create_line(&first, false).await.unwrap() {
        Some(Created::New(j)) => j,
        other => panic!("{other:?}"),
    };
    assert_eq!(made.state, JobState::Queued);
    assert_eq!(made.batch_id.as_deref(), Some("batch_z"));
    // Cancelled: a line made before is still found; no new one starts.
    s.cancel_batch("t1", "batch_z", T0 + 1).await.unwrap();
    assert!(matches!(
        s.create_line(&first, false).await.unwrap(),
        Some(Created::Existing(j)) if j.id == made.id
    ));
    let second = line("t1", "batch_z/b", "batch_z", "fp-b", T0);
    assert_eq!(s.create_line(&second, false).await.unwrap(), None);
    assert!(s.job_by_key("t1", "batch_z/b").await.unwrap().is_none());
}

async fn claim_takes_live_jobs_first_and_lines_up_to_their_limit(s: Arc<dyn Store>) {
    let mut lines = Vec::new();
    for i in 0..3 {
        let key = format!("b1/{i}");
        let fp = format!("fp-{i}");
        match s
            .create_job(&line("t1", &key, "batch_1", &fp, T0 + i))
            .await
            .unwrap()
        {
            Created::New(j) => lines.push(j.id),
            other => panic!("{other:?}"),
        }
    }
    // Live jobs created after the lines.
    let live_a = create(&*s, "t1", "live-a", T0 + 10).await;
    let live_b = create(&*s, "t2", "live-b", T0 + 11).await;
    let claim = |limit: u32, allowed: u32| {
        let s = s.clone();
        async move {
            let mut ids = s
                .claim_and_start(
                    "w",
                    T0 + 20,
                    T0 + 30_000,
                    T0 + 60_000,
                    Room {
                        jobs: limit,
                        lines: allowed,
                    },
                    &mut |_, _| None,
                )
                .await
                .unwrap()
                .into_iter()
                .map(|c| c.job.id)
                .collect::<Vec<_>>();
            // They come back oldest first; which were taken is the point.
            ids.sort();
            ids
        }
    };
    let sorted = |mut ids: Vec<String>| {
        ids.sort();
        ids
    };
    // Three workers free, one of them for lines: the live jobs first
    // (though newer), then the oldest line.
    assert_eq!(
        claim(3, 1).await,
        sorted(vec![live_a.id.clone(), live_b.id.clone(), lines[0].clone()])
    );
    // No worker for lines: nothing, though two lines wait.
    assert!(claim(5, 0).await.is_empty());
    // A live job queued now goes before the waiting lines.
    let live_c = create(&*s, "t1", "live-c", T0 + 12).await;
    assert_eq!(claim(1, 1).await, vec![live_c.id.clone()]);
    assert_eq!(
        claim(5, 5).await,
        sorted(vec![lines[1].clone(), lines[2].clone()])
    );
}

async fn batches_deleted_only_once_ended(s: Arc<dyn Store>) {
    s.create_batch(&batch("t1", "batch_d", None, T0), 100)
        .await
        .unwrap();
    assert_eq!(
        s.delete_batch("t1", "batch_d").await.unwrap(),
        None,
        "validating"
    );
    let mut b = s.claim_batch("w", T0, T0 + 1_000).await.unwrap().unwrap();
    b.status = BatchStatus::Completed;
    b.completed_at = Some(T0 + 1);
    assert!(s.set_batch(&b, "w", BatchStatus::Validating).await.unwrap());
    assert_eq!(
        s.delete_batch("t2", "batch_d").await.unwrap(),
        None,
        "another tenant's"
    );
    let gone = s
        .delete_batch("t1", "batch_d")
        .await
        .unwrap()
        .expect("deleted");
    assert_eq!(
        (gone.id.as_str(), gone.status),
        ("batch_d", BatchStatus::Completed)
    );
    assert!(s.batch(None, "batch_d").await.unwrap().is_none());
    assert_eq!(s.delete_batch("t1", "batch_d").await.unwrap(), None, "once");
}

async fn held_lines_are_claimed_only_once_released(s: Arc<dyn Store>) {
    s.create_batch(&batch("t1", "batch_h", None, T0), 100)
        .await
        .unwrap();
    let mut b = s.claim_batch("w", T0, T0 + 1_000).await.unwrap().unwrap();
    b.status = BatchStatus::InProgress;
    b.upstream = Some(r#"[{"provider":"p","model":"m","batch":"batch_up_1"}]"#.into());
    assert!(s.set_batch(&b, "w", BatchStatus::Validating).await.unwrap());
    assert_eq!(
        s.batch(None, "batch_h").await.unwrap().unwrap().upstream,
        b.upstream,
        "the provider batches are kept"
    );
    let held = match s
        .create_line(&line("t1", "batch_h/a", "batch_h", "fp-a", T0), true)
        .await
        .unwrap()
    {
        Some(Created::New(j)) => j,
        other => panic!("{other:?}"),
    };
    let room = Room {
        jobs: 10,
        lines: 10,
    };
    let claimed = s
        .claim_and_start(
            "x",
            T0 + 1_000_000,
            T0 + 2_000_000,
            T0 + 2_000_000,
            room,
            &mut |_, _| None,
        )
        .await
        .unwrap();
    assert!(claimed.is_empty(), "a held line is nobody's to claim");
    assert!(s.release_line(&held.id, T0 + 5).await.unwrap());
    assert!(!s.release_line(&held.id, T0 + 6).await.unwrap(), "once");
    let claimed = s
        .claim_and_start("x", T0 + 5, T0 + 2_000, T0 + 2_000, room, &mut |_, _| None)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].job.id, held.id);
}
