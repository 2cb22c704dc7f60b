//! The in-process flight table: one [`Flight`] per fingerprint and target in
//! progress, sharded (a [`DashMap`]) so a slow task never delays another.
//!
//! A flight is a small buffer the leader fills (head, body chunks, final
//! [`Answer`]) and any number of followers read, each from the start (replay)
//! and then live. Waking is a `watch` channel: one send wakes every waiter,
//! with no per-follower work on the leader's side.
//!
//! The leader holds a [`LeaderTicket`]; dropping it (success, error, panic,
//! cancellation) runs [`FlightGuard::drop`], which finishes the flight if the
//! leader did not and removes it from the table. That is the only clean-up
//! path: no return statement has to remember it.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use reqwest::StatusCode;
use tokio::sync::watch;

use crate::answer::{Answer, Failure, Form};
use crate::fingerprint::{Fingerprint, TableHasher};
use crate::telemetry::SpanId;

/// A flight is per fingerprint and per target: a failure of one provider
/// must not stop the next target's flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FlightKey {
    pub fp: Fingerprint,
    pub target: usize,
}

/// What followers need before they can start answering their client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub status: StatusCode,
    pub form: Form,
}

#[derive(Default)]
struct Buf {
    head: Option<Head>,
    /// Body chunks of a streamed answer, as they arrived.
    chunks: Vec<Bytes>,
    done: Option<Arc<Answer>>,
}

/// One upstream call in progress and everything it has produced so far.
pub struct Flight {
    pub key: FlightKey,
    pub started: Instant,
    buf: Mutex<Buf>,
    progress: watch::Sender<u64>,
    epoch: Instant,
    lease_until_ms: AtomicU64,
    /// The flight that took this one over (fencing: its answer is this
    /// flight's too).
    successor: OnceLock<Arc<Flight>>,
    followers: AtomicU64,
    origin: AtomicU8,
    /// The span of the provider call that answers this flight, once its
    /// leader has started it (traces on): followers link to it.
    call_span: OnceLock<SpanId>,
    /// Its leader made no call (its budget could not pay for it): the
    /// followers join again rather than take its end as an answer.
    abandoned: std::sync::atomic::AtomicBool,
}

/// Where a flight's answer came from, for the `Idem-Outcome` of the
/// request that started it locally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// This replica called the provider.
    Upstream = 0,
    /// The shared (or a just-written local) result cache.
    Cache = 1,
    /// The shared negative cache.
    Negative = 2,
    /// Another replica's flight.
    Remote = 3,
}

impl std::fmt::Debug for Flight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Flight")
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

impl Flight {
    fn new(key: FlightKey, epoch: Instant, lease: Duration) -> Flight {
        let f = Flight {
            key,
            started: Instant::now(),
            buf: Mutex::new(Buf::default()),
            progress: watch::Sender::new(0),
            epoch,
            lease_until_ms: AtomicU64::new(0),
            successor: OnceLock::new(),
            followers: AtomicU64::new(0),
            origin: AtomicU8::new(Origin::Upstream as u8),
            call_span: OnceLock::new(),
            abandoned: std::sync::atomic::AtomicBool::new(false),
        };
        f.renew(lease);
        f
    }

    fn with_buf<R>(&self, f: impl FnOnce(&mut Buf) -> R) -> R {
        // A poisoned lock only means a panic elsewhere while holding it; the
        // buffer itself is always consistent (each write is one push/set).
        let mut guard = self.buf.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    fn bump(&self) {
        self.progress.send_modify(|v| *v = v.wrapping_add(1));
    }

    pub fn set_head(&self, head: Head) {
        self.with_buf(|b| b.head = Some(head));
        self.bump();
    }

    pub fn push(&self, chunk: Bytes) {
        self.with_buf(|b| b.chunks.push(chunk));
        self.bump();
    }

    /// Ends the flight; the first answer wins, later ones are ignored.
    pub fn finish(&self, answer: Arc<Answer>) -> bool {
        let first = self.with_buf(|b| {
            if b.done.is_some() {
                return false;
            }
            if b.head.is_none() {
                b.head = Some(Head {
                    status: answer.status,
                    form: answer.form,
                });
            }
            // An answer that arrived whole (from a cache or another replica)
            // is relayed to streaming followers as one chunk.
            if b.chunks.is_empty() && answer.form == Form::Stream && answer.is_success() {
                b.chunks.push(answer.body.clone());
            }
            b.done = Some(answer);
            true
        });
        if first {
            self.bump();
        }
        first
    }

    pub fn is_done(&self) -> bool {
        self.with_buf(|b| b.done.is_some())
    }

    pub fn answer(&self) -> Option<Arc<Answer>> {
        self.with_buf(|b| b.done.clone())
    }

    /// Chunks from index `from` on, and the answer if the flight is done.
    pub fn chunks_from(&self, from: usize) -> (Vec<Bytes>, Option<Arc<Answer>>) {
        self.with_buf(|b| {
            let chunks = b
                .chunks
                .get(from..)
                .map(<[Bytes]>::to_vec)
                .unwrap_or_default();
            (chunks, b.done.clone())
        })
    }

    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.progress.subscribe()
    }

    /// Waits until `ready` returns something or `deadline` passes.
    async fn wait_for<T>(
        &self,
        deadline: Option<Instant>,
        ready: impl Fn(&Buf) -> Option<T>,
    ) -> Option<T> {
        // Subscribe before looking, so a change between the look and the
        // wait is not missed.
        let mut rx = self.subscribe();
        loop {
            if let Some(v) = self.with_buf(|b| ready(b)) {
                return Some(v);
            }
            let changed = rx.changed();
            match deadline {
                None => {
                    if changed.await.is_err() {
                        return self.with_buf(|b| ready(b));
                    }
                }
                Some(d) => match tokio::time::timeout_at(d.into(), changed).await {
                    Err(_) => return self.with_buf(|b| ready(b)),
                    Ok(Err(_)) => return self.with_buf(|b| ready(b)),
                    Ok(Ok(())) => {}
                },
            }
        }
    }

    /// The head, once the provider has answered (or the flight ended).
    pub fn head(&self, deadline: Option<Instant>) -> impl Future<Output = Option<Head>> + '_ {
        self.wait_for(deadline, |b| b.head)
    }

    /// The final answer.
    pub fn done(
        &self,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Option<Arc<Answer>>> + '_ {
        self.wait_for(deadline, |b| b.done.clone())
    }

    /// Extends the lease; called by the live leader every lease/3.
    pub fn renew(&self, lease: Duration) {
        let until = self.epoch.elapsed() + lease;
        self.lease_until_ms.store(
            u64::try_from(until.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    pub fn lease_expired(&self) -> bool {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        now >= self.lease_until_ms.load(Ordering::Relaxed)
    }

    /// Records the span of the provider call that answers this flight.
    pub fn set_call_span(&self, span: SpanId) {
        let _ = self.call_span.set(span);
    }

    /// The span of the provider call that answers this flight, if traced.
    pub fn call_span(&self) -> Option<SpanId> {
        self.call_span.get().cloned()
    }

    pub fn set_origin(&self, origin: Origin) {
        self.origin.store(origin as u8, Ordering::Release);
    }

    pub fn origin(&self) -> Origin {
        match self.origin.load(Ordering::Acquire) {
            1 => Origin::Cache,
            2 => Origin::Negative,
            3 => Origin::Remote,
            _ => Origin::Upstream,
        }
    }

    /// Whether its leader gave it up without a call (see
    /// [`LeaderTicket::abandon`]).
    pub fn abandoned(&self) -> bool {
        self.abandoned.load(Ordering::Acquire)
    }

    /// The flight that took this one over, once another leader did: this
    /// flight's late answer must go nowhere, the newer one's is shared
    /// (fencing).
    pub fn successor(&self) -> Option<Arc<Flight>> {
        self.successor.get().cloned()
    }
}

/// The result of joining the table.
pub enum Joined {
    Leader(LeaderTicket),
    Follower(Arc<Flight>),
}

/// The leader's right and duty to finish a flight.
pub struct LeaderTicket {
    pub flight: Arc<Flight>,
    pub guard: FlightGuard,
}

impl LeaderTicket {
    /// Gives the flight up without a call: it leaves the table first, then
    /// ends marked abandoned, so that its followers join again (a new
    /// flight, which one of them leads) instead of taking its end as their
    /// answer.
    pub fn abandon(self) {
        self.flight.abandoned.store(true, Ordering::Release);
        if self.guard.listed {
            let key = self.flight.key;
            self.guard
                .table
                .map
                .remove_if(&key, |_, v| Arc::ptr_eq(v, &self.flight));
        }
        drop(self);
    }
}

/// Finishes and removes its flight when dropped.
pub struct FlightGuard {
    table: Arc<FlightTable>,
    flight: Arc<Flight>,
    listed: bool,
}

impl Drop for FlightGuard {
    fn drop(&mut self) {
        if !self.flight.is_done() {
            let answer = Answer::from_failure(
                Failure::LeaderLost,
                "the call for this request ended without an answer",
                "idem".into(),
                "".into(),
            );
            self.flight.finish(Arc::new(answer));
        }
        if self.listed {
            let key = self.flight.key;
            self.table
                .map
                .remove_if(&key, |_, v| Arc::ptr_eq(v, &self.flight));
        }
        self.table.on_end();
    }
}

/// The flights of one process.
pub struct FlightTable {
    map: DashMap<FlightKey, Arc<Flight>, TableHasher>,
    epoch: Instant,
    inflight: AtomicU64,
    on_change: Box<dyn Fn(u64) + Send + Sync>,
}

impl FlightTable {
    /// `on_change` receives the number of flights in progress (the
    /// `idem_inflight_flights` gauge).
    pub fn new(on_change: impl Fn(u64) + Send + Sync + 'static) -> Arc<FlightTable> {
        Arc::new(FlightTable {
            map: DashMap::with_hasher(TableHasher::default()),
            epoch: Instant::now(),
            inflight: AtomicU64::new(0),
            on_change: Box::new(on_change),
        })
    }

    fn on_start(&self) {
        let n = self.inflight.fetch_add(1, Ordering::AcqRel) + 1;
        (self.on_change)(n);
    }

    fn on_end(&self) {
        let n = self
            .inflight
            .fetch_sub(1, Ordering::AcqRel)
            .saturating_sub(1);
        (self.on_change)(n);
    }

    /// Upstream calls in progress (listed and private).
    pub fn inflight(&self) -> u64 {
        self.inflight.load(Ordering::Acquire)
    }

    /// Flights listed in the table.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Becomes the leader of `key`, or a follower of its flight in progress.
    pub fn join(self: &Arc<Self>, key: FlightKey, lease: Duration) -> Joined {
        match self.map.entry(key) {
            Entry::Occupied(e) => {
                e.get().followers.fetch_add(1, Ordering::Relaxed);
                Joined::Follower(e.get().clone())
            }
            Entry::Vacant(v) => {
                let flight = Arc::new(Flight::new(key, self.epoch, lease));
                v.insert(flight.clone());
                self.on_start();
                Joined::Leader(self.ticket(flight, true))
            }
        }
    }

    /// A flight nobody else can join (coalescing off for this request).
    pub fn private(self: &Arc<Self>, key: FlightKey, lease: Duration) -> LeaderTicket {
        let flight = Arc::new(Flight::new(key, self.epoch, lease));
        self.on_start();
        self.ticket(flight, false)
    }

    fn ticket(self: &Arc<Self>, flight: Arc<Flight>, listed: bool) -> LeaderTicket {
        LeaderTicket {
            guard: FlightGuard {
                table: self.clone(),
                flight: flight.clone(),
                listed,
            },
            flight,
        }
    }

    /// Takes the lead from `stale` if it is still the listed flight and its
    /// lease has expired. Atomic: of many waiters, exactly one succeeds.
    pub fn take_over(
        self: &Arc<Self>,
        stale: &Arc<Flight>,
        lease: Duration,
    ) -> Option<LeaderTicket> {
        let mut slot = self.map.get_mut(&stale.key)?;
        if !Arc::ptr_eq(slot.value(), stale) || !stale.lease_expired() {
            return None;
        }
        let flight = Arc::new(Flight::new(stale.key, self.epoch, lease));
        let _ = stale.successor.set(flight.clone());
        *slot.value_mut() = flight.clone();
        drop(slot);
        self.on_start();
        Some(self.ticket(flight, true))
    }

    /// Followers that joined the flights listed now (for observing a wave).
    pub fn followers(&self) -> u64 {
        self.map
            .iter()
            .map(|e| e.value().followers.load(Ordering::Relaxed))
            .sum()
    }

    /// The flight listed for `key`, if any.
    pub fn current(&self, key: &FlightKey) -> Option<Arc<Flight>> {
        self.map.get(key).map(|e| e.value().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    fn key(n: u8) -> FlightKey {
        let hex: String = std::iter::repeat_n(format!("{n:02x}"), 32).collect();
        FlightKey {
            fp: Fingerprint::from_str(&format!("v1:{hex}")).unwrap(),
            target: 0,
        }
    }

    fn ok_answer() -> Arc<Answer> {
        Arc::new(Answer {
            dialect: crate::dialect::Dialect::Chat,
            status: StatusCode::OK,
            form: Form::Plain,
            body: Bytes::from_static(b"{\"ok\":true}"),
            retry_after: None,
            failure: None,
            provider: "p".into(),
            model: "m".into(),
            created_at: std::time::SystemTime::now(),
            upstream_latency: Duration::ZERO,
            cache_ttl: None,
            rendered: Default::default(),
        })
    }

    #[tokio::test]
    async fn one_leader_many_followers_and_cleanup_on_success() {
        let table = FlightTable::new(|_| {});
        let Joined::Leader(ticket) = table.join(key(1), Duration::from_secs(3)) else {
            panic!("first joiner must lead")
        };
        let mut followers = Vec::new();
        for _ in 0..100 {
            match table.join(key(1), Duration::from_secs(3)) {
                Joined::Follower(f) => followers.push(f),
                Joined::Leader(_) => panic!("a second leader"),
            }
        }
        assert_eq!(table.inflight(), 1);
        let waiters: Vec<_> = followers
            .into_iter()
            .map(|f| tokio::spawn(async move { f.done(None).await }))
            .collect();
        ticket.flight.finish(ok_answer());
        drop(ticket);
        for w in waiters {
            assert!(w.await.unwrap().unwrap().is_success());
        }
        assert_eq!(table.inflight(), 0);
        assert!(table.is_empty());
    }

    #[tokio::test]
    async fn a_panicking_leader_still_releases_followers_and_the_table() {
        let table = FlightTable::new(|_| {});
        let Joined::Leader(ticket) = table.join(key(2), Duration::from_secs(3)) else {
            panic!()
        };
        let Joined::Follower(f) = table.join(key(2), Duration::from_secs(3)) else {
            panic!()
        };
        let leader = tokio::spawn(async move {
            let _t = ticket;
            panic!("leader task bug");
        });
        assert!(leader.await.is_err());
        let answer = f
            .done(Some(Instant::now() + Duration::from_secs(5)))
            .await
            .unwrap();
        assert_eq!(answer.failure, Some(Failure::LeaderLost));
        assert!(table.is_empty());
        assert_eq!(table.inflight(), 0);
    }

    #[tokio::test]
    async fn a_cancelled_leader_releases_the_table() {
        let table = FlightTable::new(|_| {});
        let Joined::Leader(ticket) = table.join(key(3), Duration::from_secs(3)) else {
            panic!()
        };
        let task = tokio::spawn(async move {
            let _t = ticket;
            std::future::pending::<()>().await;
        });
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        assert!(table.is_empty());
        assert_eq!(table.inflight(), 0);
    }

    #[tokio::test]
    async fn exactly_one_waiter_takes_over_an_expired_lease() {
        let table = FlightTable::new(|_| {});
        let Joined::Leader(old) = table.join(key(4), Duration::from_millis(300)) else {
            panic!()
        };
        let Joined::Follower(seen) = table.join(key(4), Duration::from_millis(300)) else {
            panic!()
        };
        // A live lease cannot be taken.
        assert!(table.take_over(&seen, Duration::from_secs(3)).is_none());
        // The old leader stops renewing (it hangs); let the lease run out.
        tokio::time::sleep(Duration::from_millis(350)).await;
        let winners: Vec<_> = (0..50)
            .filter_map(|_| table.take_over(&seen, Duration::from_secs(3)))
            .collect();
        assert_eq!(winners.len(), 1);
        assert!(old.flight.successor().is_some());
        // The old leader's late end must not remove the new flight.
        drop(old);
        assert_eq!(table.len(), 1);
        drop(winners);
        assert!(table.is_empty());
        assert_eq!(table.inflight(), 0);
    }

    #[tokio::test]
    async fn streamed_chunks_replay_then_go_live() {
        let table = FlightTable::new(|_| {});
        let Joined::Leader(t) = table.join(key(5), Duration::from_secs(3)) else {
            panic!()
        };
        t.flight.set_head(Head {
            status: StatusCode::OK,
            form: Form::Stream,
        });
        t.flight.push(Bytes::from_static(b"a"));
        let (early, done) = t.flight.chunks_from(0);
        assert_eq!(early.len(), 1);
        assert!(done.is_none());
        t.flight.push(Bytes::from_static(b"b"));
        let (rest, _) = t.flight.chunks_from(1);
        assert_eq!(rest, vec![Bytes::from_static(b"b")]);
    }
}
