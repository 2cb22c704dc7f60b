//! The result cache: finished answers kept for a short, jittered while after
//! their flight ends, so the next wave of the same prompt costs nothing; and
//! the negative cache, which keeps a provider's failure for a few seconds so
//! waiters never re-attack a failing provider (docs/design.md, "Coalescing and the caches").
//!
//! Entries live in [`moka`] caches with a per-entry expiry. Successes are
//! keyed by fingerprint; failures by fingerprint and target, since a failure
//! belongs to the provider that produced it and the next target may still
//! answer. Both are bounded in entries and in bytes: each entry weighs what
//! its answer holds plus a fixed overhead, so a few large answers cannot
//! take the memory that the entry count was meant to bound. A success may outlive its TTL by `cache.stale_grace` when the
//! route serves stale answers on wait timeouts.
//!
//! moka does its upkeep (expiring and evicting entries) inside whichever
//! cache call comes next, and without an eviction listener it does all of it
//! at once: after a quiet spell, a request would pay for every entry that
//! expired meanwhile (tens of milliseconds for tens of thousands of entries).
//! [`spawn_housekeeper`] does that upkeep on its own thread in small, regular
//! steps instead, so requests find little or nothing left to do.

use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::sync::Cache;
use rand::Rng;

use crate::answer::Answer;
use crate::config::{OnWaitTimeout, RouteConfig};
use crate::fingerprint::{Fingerprint, TableHasher};

#[derive(Clone)]
struct Entry {
    answer: Arc<Answer>,
    stored: Instant,
    fresh_for: Duration,
    /// Total life in the cache (fresh plus stale grace).
    life: Duration,
}

/// What an entry costs beside its answer's bytes: the answer's and the
/// entry's own fields, the key, moka's bookkeeping.
pub const ENTRY_OVERHEAD: u64 = 512;

struct PerEntry;

impl<K> Expiry<K, Entry> for PerEntry {
    fn expire_after_create(&self, _k: &K, v: &Entry, _now: Instant) -> Option<Duration> {
        Some(v.life)
    }

    fn expire_after_update(
        &self,
        _k: &K,
        v: &Entry,
        _now: Instant,
        _left: Option<Duration>,
    ) -> Option<Duration> {
        Some(v.life)
    }
}

/// A cache lookup.
pub enum Lookup {
    /// Within its TTL; `expires_in` is what is left of it.
    Fresh {
        answer: Arc<Answer>,
        age: Duration,
        expires_in: Duration,
    },
    /// Past its TTL but within `stale_grace`.
    Stale {
        answer: Arc<Answer>,
        age: Duration,
    },
    Miss,
}

/// Shards per cache. moka expires per-entry TTLs in buckets of about a
/// second, all of a bucket at once, inside whichever call comes first after
/// it falls due; with the entries spread over shards by fingerprint, that
/// work (and the lock it holds) is this many times smaller.
const SHARDS: usize = 16;

/// One moka cache per shard; an entry's shard is chosen by its fingerprint.
struct Sharded<K> {
    shards: Vec<Cache<K, Entry, TableHasher>>,
}

/// An entry's weight: its answer's bytes plus [`ENTRY_OVERHEAD`], and at
/// least `floor` (see [`Sharded::new`]).
fn weight(entry: &Entry, floor: u64) -> u32 {
    let bytes = u64::try_from(entry.answer.size_bytes()).unwrap_or(u64::MAX);
    let weight = bytes.saturating_add(ENTRY_OVERHEAD).max(floor);
    u32::try_from(weight).unwrap_or(u32::MAX)
}

impl<K: std::hash::Hash + Eq + Send + Sync + 'static> Sharded<K> {
    /// At most `capacity` entries and `max_bytes` bytes. moka bounds one
    /// weight: the bytes, with every entry weighing at least
    /// `max_bytes / capacity`, so that small entries are bounded by their
    /// number as before.
    fn new(capacity: u64, max_bytes: u64) -> Sharded<K> {
        let each = max_bytes.div_ceil(SHARDS as u64).max(1);
        let floor = max_bytes / capacity.max(1);
        Sharded {
            shards: (0..SHARDS)
                .map(|_| {
                    Cache::builder()
                        .max_capacity(each)
                        .weigher(move |_: &K, entry: &Entry| weight(entry, floor))
                        .expire_after(PerEntry)
                        .build_with_hasher(TableHasher::default())
                })
                .collect(),
        }
    }

    fn shard(&self, fp: &Fingerprint) -> &Cache<K, Entry, TableHasher> {
        // A fingerprint is a uniform hash: its first byte spreads evenly.
        &self.shards[usize::from(fp.as_bytes()[0]) % SHARDS]
    }

    fn run_pending_tasks(&self) {
        for shard in &self.shards {
            shard.run_pending_tasks();
        }
    }

    fn run_shard(&self, i: usize) {
        if let Some(shard) = self.shards.get(i) {
            shard.run_pending_tasks();
        }
    }

    fn entry_count(&self) -> u64 {
        self.shards.iter().map(Cache::entry_count).sum()
    }

    fn weighted_size(&self) -> u64 {
        self.shards.iter().map(Cache::weighted_size).sum()
    }
}

/// The result and negative caches of one gateway (memory backend).
pub struct ResultCache {
    answers: Sharded<Fingerprint>,
    negative: Sharded<(Fingerprint, usize)>,
}

impl ResultCache {
    /// At most `capacity` answers and `max_bytes` bytes of them; the
    /// negative cache holds at most a quarter as many besides (and at
    /// least 256 entries).
    pub fn new(capacity: u64, max_bytes: u64) -> ResultCache {
        ResultCache {
            answers: Sharded::new(capacity, max_bytes),
            negative: Sharded::new(capacity.max(1024) / 4, max_bytes / 4),
        }
    }

    pub fn get(&self, fp: &Fingerprint) -> Lookup {
        let Some(e) = self.answers.shard(fp).get(fp) else {
            return Lookup::Miss;
        };
        let age = e.stored.elapsed();
        if age < e.fresh_for {
            Lookup::Fresh {
                answer: e.answer,
                age,
                expires_in: e.fresh_for - age,
            }
        } else {
            Lookup::Stale {
                answer: e.answer,
                age,
            }
        }
    }

    /// A fresh answer only.
    pub fn fresh(&self, fp: &Fingerprint) -> Option<Arc<Answer>> {
        match self.get(fp) {
            Lookup::Fresh { answer, .. } => Some(answer),
            _ => None,
        }
    }

    /// Stores a success for `ttl` (already jittered); returns the TTL.
    pub fn put(&self, fp: Fingerprint, answer: Arc<Answer>, ttl: Duration, route: &RouteConfig) {
        let grace = if route.coalesce.on_wait_timeout == OnWaitTimeout::Stale {
            route.cache.stale_grace
        } else {
            Duration::ZERO
        };
        let entry = Entry {
            answer,
            stored: Instant::now(),
            fresh_for: ttl,
            life: ttl + grace,
        };
        self.answers.shard(&fp).insert(fp, entry);
    }

    /// Runs both caches' pending upkeep now (expiries, evictions).
    pub fn run_pending_tasks(&self) {
        self.answers.run_pending_tasks();
        self.negative.run_pending_tasks();
    }

    /// Runs the pending upkeep of shard `i` of both caches.
    fn run_shard(&self, i: usize) {
        self.answers.run_shard(i);
        self.negative.run_shard(i);
    }

    /// Entries held (moka's count: exact once upkeep has run).
    pub fn entry_count(&self) -> u64 {
        self.answers.entry_count() + self.negative.entry_count()
    }

    /// The weight of the answers held, in bytes (exact once upkeep has
    /// run).
    pub fn answer_bytes(&self) -> u64 {
        self.answers.weighted_size()
    }

    pub fn negative(&self, fp: &Fingerprint, target: usize) -> Option<(Arc<Answer>, Duration)> {
        let e = self.negative.shard(fp).get(&(*fp, target))?;
        let age = e.stored.elapsed();
        (age < e.fresh_for).then_some((e.answer, age))
    }

    pub fn put_negative(&self, fp: Fingerprint, target: usize, answer: Arc<Answer>, ttl: Duration) {
        let entry = Entry {
            answer,
            stored: Instant::now(),
            fresh_for: ttl,
            life: ttl,
        };
        self.negative.shard(&fp).insert((fp, target), entry);
    }
}

/// How often [`spawn_housekeeper`] runs the caches' upkeep.
pub const HOUSEKEEPING_EVERY: Duration = Duration::from_millis(100);

/// Starts a thread that runs `cache`'s upkeep every `every`, until the cache
/// is dropped (the thread holds only a weak reference). The shards are
/// visited one at a time, `every / SHARDS` apart: when a second's bucket of
/// expiries falls due in every shard at once, the work comes in sixteen
/// small pieces instead of one burst that would hold a core.
pub fn spawn_housekeeper(
    cache: &Arc<ResultCache>,
    every: Duration,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let cache = Arc::downgrade(cache);
    std::thread::Builder::new()
        .name("idem-cache-upkeep".into())
        .spawn(move || {
            let step = every / SHARDS as u32;
            for shard in (0..SHARDS).cycle() {
                std::thread::sleep(step);
                match cache.upgrade() {
                    Some(cache) => cache.run_shard(shard),
                    None => return,
                }
            }
        })
}

/// A success TTL with random jitter: `ttl * (1 + u)`, `u` uniform in
/// `[-jitter, +jitter]`, so entries written in one wave expire spread out
/// instead of all at once.
pub fn jittered_ttl(ttl: Duration, jitter: f64) -> Duration {
    if jitter <= 0.0 {
        return ttl;
    }
    let u: f64 = rand::rng().random_range(-jitter..=jitter);
    ttl.mul_f64((1.0 + u).max(0.01))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_spreads_expiry_over_the_whole_band() {
        let ttl = Duration::from_secs(30);
        let ttls: Vec<Duration> = (0..1000).map(|_| jittered_ttl(ttl, 0.15)).collect();
        let min = ttls.iter().min().unwrap();
        let max = ttls.iter().max().unwrap();
        assert!(*min >= Duration::from_secs_f64(25.5) && *max <= Duration::from_secs_f64(34.5));
        assert!(
            *max - *min >= Duration::from_secs(8),
            "spread {:?}",
            *max - *min
        );
    }

    fn answer() -> Arc<Answer> {
        Arc::new(Answer::from_failure(
            crate::answer::Failure::Timeout,
            "slow",
            "p".into(),
            "m".into(),
        ))
    }

    #[test]
    fn the_housekeeper_expires_entries_without_any_cache_call_and_stops_with_the_cache() {
        let cache = Arc::new(ResultCache::new(1_000, 1 << 30));
        let fp = crate::fingerprint::Fingerprint::from_bytes([7; 32]);
        cache.put_negative(fp, 0, answer(), Duration::from_millis(30));
        cache.run_pending_tasks();
        assert_eq!(cache.entry_count(), 1);
        // (moka's timer wheel has a resolution of about a second)
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(
            cache.entry_count(),
            1,
            "nothing tidies up without a cache call"
        );
        let upkeep = spawn_housekeeper(&cache, Duration::from_millis(10)).unwrap();
        // No get or insert from here on: only the housekeeper can notice
        // that the entry expired.
        let deadline = Instant::now() + Duration::from_secs(5);
        while cache.entry_count() > 0 {
            assert!(
                Instant::now() < deadline,
                "the expired entry was never removed"
            );
            std::thread::sleep(Duration::from_millis(10));
        }

        drop(cache);
        let deadline = Instant::now() + Duration::from_secs(5);
        while !upkeep.is_finished() {
            assert!(
                Instant::now() < deadline,
                "the housekeeper outlived its cache"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn the_shards_together_keep_to_the_configured_capacity() {
        // (the negative cache holds a quarter of the capacity: 1,000)
        let cache = ResultCache::new(4_000, 1 << 30);
        for i in 0u32..10_000 {
            let mut bytes = [0; 32];
            bytes[..4].copy_from_slice(&i.to_le_bytes());
            let fp = crate::fingerprint::Fingerprint::from_bytes(*blake3::hash(&bytes).as_bytes());
            cache.put_negative(fp, 0, answer(), Duration::from_secs(60));
        }
        cache.run_pending_tasks();
        let held = cache.entry_count();
        // Each shard rounds its share up: at most SHARDS - 1 over.
        assert!((500..1_000 + SHARDS as u64).contains(&held), "held {held}");
    }

    fn fp_of(i: u32) -> Fingerprint {
        Fingerprint::from_bytes(*blake3::hash(&i.to_le_bytes()).as_bytes())
    }

    /// A success whose body is `bytes` long.
    fn answer_of(bytes: usize) -> Arc<Answer> {
        let mut a =
            Answer::from_failure(crate::answer::Failure::Timeout, "", "p".into(), "m".into());
        a.failure = None;
        a.status = reqwest::StatusCode::OK;
        a.body = bytes::Bytes::from(vec![b'x'; bytes]);
        Arc::new(a)
    }

    #[test]
    fn answers_weigh_their_bytes_and_the_cache_keeps_to_its_byte_bound() {
        let route = crate::config::RouteConfig {
            model: "m".into(),
            targets: Vec::new(),
            endpoints: Vec::new(),
            normalize: Default::default(),
            scope: Default::default(),
            contract: None,
            ignore_fields: Vec::new(),
            cache: Default::default(),
            coalesce: Default::default(),
            attempts: Default::default(),
        };
        let ttl = Duration::from_secs(60);
        // 16 shards of 64 KiB; a 10 KiB answer weighs its bytes (the entry
        // count, 10,000, would allow all of them).
        let max_bytes = 1 << 20;
        let cache = ResultCache::new(10_000, max_bytes);
        let one = answer_of(10 * 1024);
        let weight = (one.size_bytes() as u64) + ENTRY_OVERHEAD;
        cache.put(fp_of(0), one, ttl, &route);
        cache.run_pending_tasks();
        assert_eq!(cache.answer_bytes(), weight);
        // 400 of them (4 MiB) do not fit in 1 MiB: evicted down to it.
        for i in 1..400 {
            cache.put(fp_of(i), answer_of(10 * 1024), ttl, &route);
        }
        cache.run_pending_tasks();
        let (held, bytes) = (cache.entry_count(), cache.answer_bytes());
        assert!(bytes <= max_bytes, "{bytes} bytes held");
        assert_eq!(bytes, held * weight);
        assert!((50..=max_bytes / weight).contains(&held), "{held} held");
        // Small answers are still bounded by their number: each weighs at
        // least max_bytes / capacity.
        let cache = ResultCache::new(100, max_bytes);
        for i in 0..1_000 {
            cache.put(fp_of(i), answer_of(10), ttl, &route);
        }
        cache.run_pending_tasks();
        let held = cache.entry_count();
        assert!((50..=100 + SHARDS as u64).contains(&held), "{held} held");
    }

    #[test]
    fn zero_jitter_is_exact() {
        assert_eq!(
            jittered_ttl(Duration::from_secs(5), 0.0),
            Duration::from_secs(5)
        );
    }
}
