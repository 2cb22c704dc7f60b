//! The writer of completions: attempts hand their results to it, and it
//! commits those that arrive together in one transaction, each still a
//! compare-and-swap of its own.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{COMPLETIONS_WAITING, MAX_COMPLETIONS, Slot};
use crate::store::{AttemptResult, Completion, Store, now_ms};

/// What the writer of completions answers: the completion, or the store's
/// error as text.
type Reply = oneshot::Sender<Result<Completion, String>>;

/// Hands attempts' results to the writer of completions, which commits
/// those that arrive together in one transaction (a group commit: one
/// database round of locks, updates and commit for many jobs, where each
/// job used to take its own). Every completion is still the job's
/// compare-and-swap, settled as if alone. At most [`COMPLETIONS_WAITING`]
/// wait for the writer: past that, a job keeps its slot until its result
/// finds room, so that a store slower than the provider slows the claims
/// instead of piling results up in memory.
#[derive(Clone)]
pub(super) struct Completer(mpsc::Sender<(AttemptResult, Reply)>);

impl Completer {
    pub(super) fn start(
        store: Arc<dyn Store>,
        shutdown: &CancellationToken,
        tracker: &TaskTracker,
    ) -> Completer {
        let (tx, rx) = mpsc::channel(COMPLETIONS_WAITING);
        tracker.spawn(write_completions(store, rx, shutdown.clone()));
        Completer(tx)
    }

    /// Completes the job with this attempt's result (through the writer,
    /// or directly once it has stopped). The job's slot is given back once
    /// the writer has the result.
    pub(super) async fn complete(
        &self,
        store: &Arc<dyn Store>,
        r: AttemptResult,
        slot: &Slot,
    ) -> Result<Completion, String> {
        let (tx, rx) = oneshot::channel();
        let r = match self.0.send((r, tx)).await {
            Ok(()) => {
                slot.release();
                // Err: the writer stopped (shutdown) before taking it,
                // nothing was written.
                return rx
                    .await
                    .unwrap_or_else(|_| Err("the completion writer stopped".into()));
            }
            Err(mpsc::error::SendError((r, _))) => r,
        };
        store
            .complete(&r.job_id, r.n, r.read_version, &r.result, now_ms())
            .await
            .map_err(|e| e.to_string())
    }
}

/// The writer of completions: takes whatever is waiting (up to
/// [`MAX_COMPLETIONS`]) and writes it in one transaction. A batch the store
/// refuses is tried again one completion at a time, so that one bad entry
/// (or a deadlock the database broke) costs no other job its result.
async fn write_completions(
    store: Arc<dyn Store>,
    mut rx: mpsc::Receiver<(AttemptResult, Reply)>,
    shutdown: CancellationToken,
) {
    let mut batch = Vec::with_capacity(MAX_COMPLETIONS);
    loop {
        let got = tokio::select! {
            () = shutdown.cancelled() => return,
            got = rx.recv_many(&mut batch, MAX_COMPLETIONS) => got,
        };
        if got == 0 {
            return;
        }
        let (results, replies): (Vec<AttemptResult>, Vec<Reply>) = batch.drain(..).unzip();
        match store.complete_all(&results, now_ms()).await {
            Ok(done) if done.len() == results.len() => {
                for (reply, d) in replies.into_iter().zip(done) {
                    let _ = reply.send(Ok(d));
                }
            }
            outcome => {
                if let Err(e) = &outcome {
                    tracing::warn!(error = %e, completions = results.len(), "cannot write completions together: one at a time");
                }
                for (reply, r) in replies.into_iter().zip(results) {
                    let done = store
                        .complete(&r.job_id, r.n, r.read_version, &r.result, now_ms())
                        .await
                        .map_err(|e| e.to_string());
                    let _ = reply.send(done);
                }
            }
        }
    }
}
