//! The mock's shared state: counters, the last requests, the behaviour,
//! the gate where held and hung requests wait, and the files and batches
//! of the Batch API (kept by `batches`).
//!
//! The hot path (a request that is neither held nor hung) takes one short
//! std `Mutex` (to number and record the request) and otherwise touches only
//! atomics and an `Arc<Behaviour>` clone. No lock is ever held across an
//! `.await`, which is why std locks are used rather than tokio's.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};

use serde_json::Value;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

use super::batches::Store;
use super::{Behaviour, CallOutcome, CallRecord, Endpoint, RecordedRequest, Stats};

/// How many requests `last_requests` keeps.
const RECORDED: usize = 50;

/// How many calls the call log keeps (a few hundred bytes each); later calls
/// are counted but not logged.
const CALL_LOG: usize = 1_000_000;

/// How a held request continues once released.
#[derive(Debug, Clone, Default)]
pub(crate) struct Release {
    /// Answer with this error status instead of the normal answer.
    pub(crate) status: Option<u16>,
    /// Answer with this content instead of the normal one.
    pub(crate) content: Option<String>,
}

/// One arrived request, as numbered by [`Shared::arrive`].
pub(crate) struct Arrival {
    pub(crate) seq: u64,
    /// The reset generation the request arrived in; a reset starts a new one.
    pub(crate) epoch: u64,
    /// Its place in the call log, if it was logged.
    log: Option<usize>,
}

pub(crate) struct Shared {
    /// The behaviour given at start, restored by a reset.
    initial: Behaviour,
    behaviour: RwLock<Arc<Behaviour>>,
    registry: Mutex<Registry>,
    /// Written only under the `registry` lock; read lock-free when counting
    /// outcomes, so that requests from before a reset do not count after it.
    epoch: AtomicU64,
    calls: AtomicU64,
    embedding_calls: AtomicU64,
    embedding_items: AtomicU64,
    /// Provider batches created; counted and zeroed under the `store` lock.
    batches: AtomicU64,
    /// Lines answered inside provider batches (each also among `calls`).
    batch_lines: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    resets: AtomicU64,
    in_flight: AtomicU64,
    /// The Batch API's files and batches. Lock order: `store`, then
    /// `registry` (a batch line arrives under the store lock, so that a
    /// reset, which forgets the batches first, cannot let one through).
    store: Mutex<Store>,
    /// The number of held requests; `/_mock/held` waits on it.
    held: watch::Sender<usize>,
    pub(crate) shutdown: CancellationToken,
}

/// What changes together under one lock: numbering, recording, holding.
#[derive(Default)]
struct Registry {
    next_seq: u64,
    last: VecDeque<Recorded>,
    /// Every call, in arrival order (up to [`CALL_LOG`]).
    log: Vec<CallRecord>,
    /// Held requests by seq, with the epoch they were held in.
    gates: BTreeMap<u64, (u64, oneshot::Sender<Release>)>,
}

struct Recorded {
    seq: u64,
    endpoint: Endpoint,
    body: Arc<Value>,
    sent: Sent,
    stream: bool,
}

/// What a request carried besides its body that a test may want to see:
/// its credentials, versions and, on the Azure routes, the URL's parts.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sent {
    /// `Authorization`.
    pub(crate) authorization: Option<String>,
    /// `x-api-key` (Anthropic's key header).
    pub(crate) x_api_key: Option<String>,
    /// `api-key` (Azure's key header).
    pub(crate) api_key: Option<String>,
    /// `anthropic-version`.
    pub(crate) anthropic_version: Option<String>,
    /// `anthropic-beta`.
    pub(crate) anthropic_beta: Option<String>,
    /// `OpenAI-Beta`.
    pub(crate) openai_beta: Option<String>,
    /// The deployment named by an Azure URL.
    pub(crate) deployment: Option<String>,
    /// `traceparent`: the W3C trace context of the call, if sent.
    pub(crate) traceparent: Option<String>,
    /// The `api-version` query of an Azure URL.
    pub(crate) api_version: Option<String>,
}

/// One request as it arrives, for [`Shared::arrive`].
pub(crate) struct Incoming {
    pub(crate) endpoint: Endpoint,
    /// The body as JSON (a JSON string holding the raw text if it was not JSON).
    pub(crate) body: Arc<Value>,
    pub(crate) sent: Sent,
    pub(crate) stream: bool,
    /// The input items of a valid embeddings request (else 0).
    pub(crate) items: u64,
}

/// The outcome of one answered request, for the counters.
#[derive(Clone, Copy)]
pub(crate) enum Outcome {
    Completed,
    /// A 200 with garbage instead of a chat completion.
    Garbage,
    /// A completion padded to a size.
    Padded,
    /// Answered with this error status.
    Failed(u16),
    Reset,
}

impl Shared {
    pub(crate) fn new(behaviour: Behaviour) -> Shared {
        Shared {
            behaviour: RwLock::new(Arc::new(behaviour.clone())),
            initial: behaviour,
            registry: Mutex::new(Registry::default()),
            epoch: AtomicU64::new(0),
            calls: AtomicU64::new(0),
            embedding_calls: AtomicU64::new(0),
            embedding_items: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batch_lines: AtomicU64::new(0),
            store: Mutex::new(Store::default()),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            held: watch::Sender::new(0),
            shutdown: CancellationToken::new(),
        }
    }

    pub(crate) fn behaviour(&self) -> Arc<Behaviour> {
        Arc::clone(
            &self
                .behaviour
                .read()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }

    pub(crate) fn set_behaviour(&self, behaviour: Behaviour) {
        *self
            .behaviour
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Arc::new(behaviour);
    }

    /// The Batch API's files and batches (see the lock order at `store`).
    pub(crate) fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts a provider batch created; called under the `store` lock.
    pub(crate) fn batch_created(&self) {
        self.batches.fetch_add(1, Ordering::Relaxed);
    }

    fn registry(&self) -> MutexGuard<'_, Registry> {
        // A panic while holding this lock cannot leave the registry
        // half-updated in a way that matters to a test double.
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Numbers, counts and records a request on arrival. The call log's
    /// `model` is the Azure deployment when there is one, else the body's.
    pub(crate) fn arrive(&self, incoming: Incoming) -> Arrival {
        let Incoming {
            endpoint,
            body,
            sent,
            stream,
            items,
        } = incoming;
        // Built before taking the lock; numbered under it.
        let text = |key: &str| body.get(key).and_then(Value::as_str).map(str::to_owned);
        let prompt = match endpoint {
            Endpoint::ChatCompletions | Endpoint::BatchLine => super::answer::echoed(&body),
            Endpoint::Embeddings => super::embeddings::echoed(&body),
            Endpoint::Messages | Endpoint::CountTokens => super::anthropic::echoed(&body),
            Endpoint::Responses => super::responses_request::echoed(&body),
        };
        let mut call = CallRecord {
            seq: 0,
            endpoint,
            at_ms: now_ms(),
            done_ms: None,
            model: sent.deployment.clone().or_else(|| text("model")),
            user: text("user"),
            prompt,
            stream,
            outcome: CallOutcome::Pending,
            status: None,
            traceparent: sent.traceparent.clone(),
        };
        let mut registry = self.registry();
        registry.next_seq += 1;
        let seq = registry.next_seq;
        if registry.last.len() == RECORDED {
            registry.last.pop_front();
        }
        let log = (registry.log.len() < CALL_LOG).then(|| {
            call.seq = seq;
            registry.log.push(call);
            registry.log.len() - 1
        });
        registry.last.push_back(Recorded {
            seq,
            endpoint,
            body,
            sent,
            stream,
        });
        // Counted under the lock so a concurrent reset sees seq and calls agree.
        self.calls.fetch_add(1, Ordering::Relaxed);
        if endpoint == Endpoint::Embeddings {
            self.embedding_calls.fetch_add(1, Ordering::Relaxed);
            self.embedding_items.fetch_add(items, Ordering::Relaxed);
        }
        if endpoint == Endpoint::BatchLine {
            self.batch_lines.fetch_add(1, Ordering::Relaxed);
        }
        Arrival {
            seq,
            epoch: self.epoch.load(Ordering::Relaxed),
            log,
        }
    }

    /// Counts an answer, unless a reset happened since the request arrived.
    pub(crate) fn count(&self, arrival: &Arrival, outcome: Outcome) {
        if self.epoch.load(Ordering::Relaxed) != arrival.epoch {
            return;
        }
        let (counter, logged, status) = match outcome {
            Outcome::Completed => (&self.completed, CallOutcome::Completed, Some(200)),
            Outcome::Garbage => (&self.completed, CallOutcome::Garbage, Some(200)),
            Outcome::Padded => (&self.completed, CallOutcome::Padded, Some(200)),
            Outcome::Failed(status) => (&self.failed, CallOutcome::Failed, Some(status)),
            Outcome::Reset => (&self.resets, CallOutcome::Reset, None),
        };
        counter.fetch_add(1, Ordering::Relaxed);
        if let Some(index) = arrival.log {
            let mut registry = self.registry();
            // Checked again under the lock: a reset empties the log.
            if self.epoch.load(Ordering::Relaxed) == arrival.epoch
                && let Some(call) = registry.log.get_mut(index)
            {
                call.outcome = logged;
                call.status = status;
                call.done_ms = Some(now_ms());
            }
        }
    }

    /// The call log, in arrival order.
    pub(crate) fn calls(&self) -> Vec<CallRecord> {
        self.registry().log.clone()
    }

    /// Counts one request in flight until the returned guard is dropped.
    pub(crate) fn in_flight(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(self))
    }

    /// Waits until the request is released (by seq or all), a reset, or
    /// shutdown. Returns at once if a reset happened since it arrived.
    pub(crate) async fn hold(&self, arrival: &Arrival) -> Release {
        let receiver = {
            let mut registry = self.registry();
            if self.epoch.load(Ordering::Relaxed) != arrival.epoch {
                return Release::default();
            }
            let (sender, receiver) = oneshot::channel();
            registry.gates.insert(arrival.seq, (arrival.epoch, sender));
            self.held.send_replace(registry.gates.len());
            receiver
        };
        // Removes the gate if the client goes away while held.
        let _gate = Gate {
            shared: self,
            seq: arrival.seq,
            epoch: arrival.epoch,
        };
        tokio::select! {
            release = receiver => release.unwrap_or_default(),
            () = self.shutdown.cancelled() => Release::default(),
        }
    }

    /// Releases the request `seq`, or every held request, with `release`.
    /// Returns the released seqs, ascending.
    pub(crate) fn release(&self, seq: Option<u64>, release: &Release) -> Vec<u64> {
        let mut registry = self.registry();
        let gates = match seq {
            Some(seq) => registry
                .gates
                .remove(&seq)
                .into_iter()
                .map(|g| (seq, g))
                .collect(),
            None => std::mem::take(&mut registry.gates),
        };
        self.held.send_replace(registry.gates.len());
        drop(registry);
        gates
            .into_iter()
            .map(|(seq, (_, sender))| {
                // The receiver is gone only if the client left; nothing to do then.
                let _ = sender.send(release.clone());
                seq
            })
            .collect()
    }

    /// Zeroes the counters, forgets the recorded requests, the files and the
    /// batches (a held batch's task then ends without running a line),
    /// releases every held request and restores the behaviour given at start.
    pub(crate) fn reset(&self) {
        {
            let mut store = self.store();
            store.forget();
            self.batches.store(0, Ordering::Relaxed);
        }
        let mut registry = self.registry();
        self.epoch.fetch_add(1, Ordering::Relaxed);
        registry.next_seq = 0;
        registry.last.clear();
        registry.log.clear();
        let gates = std::mem::take(&mut registry.gates);
        self.held.send_replace(0);
        for counter in [
            &self.calls,
            &self.embedding_calls,
            &self.embedding_items,
            &self.batch_lines,
            &self.completed,
            &self.failed,
            &self.resets,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        self.set_behaviour(self.initial.clone());
        drop(registry);
        for (_, sender) in gates.into_values() {
            let _ = sender.send(Release::default());
        }
    }

    /// The held seqs, ascending.
    pub(crate) fn held(&self) -> Vec<u64> {
        self.registry().gates.keys().copied().collect()
    }

    /// Waits until at least `at_least` requests are held; false on shutdown.
    pub(crate) async fn wait_held(&self, at_least: usize) -> bool {
        let mut held = self.held.subscribe();
        tokio::select! {
            result = held.wait_for(|n| *n >= at_least) => result.is_ok(),
            () = self.shutdown.cancelled() => false,
        }
    }

    pub(crate) fn stats(&self) -> Stats {
        let registry = self.registry();
        let last_requests = registry
            .last
            .iter()
            .map(|r| RecordedRequest {
                seq: r.seq,
                endpoint: r.endpoint,
                body: Value::clone(&r.body),
                authorization: r.sent.authorization.clone(),
                x_api_key: r.sent.x_api_key.clone(),
                api_key: r.sent.api_key.clone(),
                anthropic_version: r.sent.anthropic_version.clone(),
                anthropic_beta: r.sent.anthropic_beta.clone(),
                openai_beta: r.sent.openai_beta.clone(),
                deployment: r.sent.deployment.clone(),
                api_version: r.sent.api_version.clone(),
                stream: r.stream,
            })
            .collect();
        Stats {
            calls: self.calls.load(Ordering::Relaxed),
            embedding_calls: self.embedding_calls.load(Ordering::Relaxed),
            embedding_items: self.embedding_items.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            batch_lines: self.batch_lines.load(Ordering::Relaxed),
            completed: self.completed.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            resets: self.resets.load(Ordering::Relaxed),
            in_flight: self.in_flight.load(Ordering::Relaxed),
            held: registry.gates.len() as u64,
            last_requests,
        }
    }
}

fn now_ms() -> i64 {
    crate::store::now_ms()
}

/// Keeps `in_flight` counted while alive (for streams: until the last chunk).
pub(crate) struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Removes a held request's gate when its handler stops waiting for any reason.
struct Gate<'a> {
    shared: &'a Shared,
    seq: u64,
    epoch: u64,
}

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        let mut registry = self.shared.registry();
        // After a reset the same seq may belong to a newer request: only
        // remove the gate if it is still ours.
        if registry
            .gates
            .get(&self.seq)
            .is_some_and(|(epoch, _)| *epoch == self.epoch)
        {
            registry.gates.remove(&self.seq);
            self.shared.held.send_replace(registry.gates.len());
        }
    }
}
