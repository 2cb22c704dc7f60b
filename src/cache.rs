//! The result cache: finished answers kept for a short, jittered while after
//! their flight ends, so the next wave of the same prompt costs nothing; and
//! the negative cache, which keeps a provider's failure for a few seconds so
//! waiters never re-attack a failing provider (docs/design.md, "Coalescing and the caches").
//!
//! Entries live in [`quick_cache`] caches. Successes are keyed by
//! fingerprint; failures by fingerprint and target, since a failure belongs
//! to the provider that produced it and the next target may still answer.
//! Both are bounded in entries and in bytes: each entry weighs what its
//! answer holds plus a fixed overhead, so a few large answers cannot take
//! the memory that the entry count was meant to bound. A success may
//! outlive its TTL by `cache.stale_grace` when the route serves stale
//! answers on wait timeouts.
//!
//! Why quick_cache: under unique prompts every request misses and every
//! answer is stored, so what the cache costs per miss and per insert is paid
//! by every request. quick_cache's policy (CLOCK-Pro, close to S3-FIFO) is
//! scan resistant like moka's TinyLFU, for about a tenth of the work per
//! miss and insert; it keeps no expiry timers, so each entry carries its own
//! life: a lookup treats an entry past it as absent, and [`spawn_housekeeper`]
//! sweeps such entries out, one shard at a time, so that they neither hold
//! memory nor crowd out live answers (docs/design.md, "Coalescing and the
//! caches").

use std::sync::Arc;
use std::time::{Duration, Instant};

use quick_cache::sync::Cache;
use quick_cache::{OptionsBuilder, Weighter};
use rand::Rng;

use crate::answer::Answer;
use crate::config::{OnWaitTimeout, RouteConfig};
use crate::fingerprint::{Fingerprint, TableHasher};

#[derive(Clone)]
struct Entry {
    answer: Arc<Answer>,
    /// The answer's bytes when it came in. Its weight must not change
    /// while it is held (the cache subtracts on removal what it added on
    /// insertion), and an answer's renderings are made, and counted by
    /// `size_bytes`, as askers want them, after it is cached.
    bytes: u64,
    stored: Instant,
    fresh_for: Duration,
    /// Total life in the cache (fresh plus stale grace).
    life: Duration,
}

impl Entry {
    fn new(answer: Arc<Answer>, fresh_for: Duration, life: Duration) -> Entry {
        Entry {
            bytes: u64::try_from(answer.size_bytes()).unwrap_or(u64::MAX),
            answer,
            stored: Instant::now(),
            fresh_for,
            life,
        }
    }

    /// Past its life at `now`: never served, swept out.
    fn dead(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.stored) >= self.life
    }
}

/// What an entry costs beside its answer's bytes: the answer's and the
/// entry's own fields, the key, the cache's bookkeeping.
pub const ENTRY_OVERHEAD: u64 = 512;

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

/// Shards per cache, each with its own lock and its own share of the bounds.
/// The housekeeper sweeps one shard at a time, so the lock it holds is this
/// many times shorter than a sweep of the whole cache.
const SHARDS: usize = 16;

/// The share of each shard's room for answers asked for more than once. The
/// rest (a tenth) is where a new answer waits to be asked again: once a
/// shard is full, a new answer can be evicted only after that many newer ones
/// came in, so a retry or a double click soon after the answer still finds
/// it, while a flood of one-off prompts cannot push out answers in use.
const REUSED_SHARE: f64 = 0.9;

/// An entry's weight: its answer's bytes plus [`ENTRY_OVERHEAD`], and at
/// least `floor` (see [`Sharded::new`]).
#[derive(Clone)]
struct Weight {
    floor: u64,
}

impl<K> Weighter<K, Entry> for Weight {
    fn weight(&self, _key: &K, entry: &Entry) -> u64 {
        entry.bytes.saturating_add(ENTRY_OVERHEAD).max(self.floor)
    }
}

/// A cache that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error("cannot build the result cache: {0}")]
    Options(String),
}

/// One cache per shard; an entry's shard is chosen by its fingerprint.
struct Sharded<K> {
    shards: Vec<Cache<K, Entry, Weight, TableHasher>>,
}

impl<K: std::hash::Hash + Eq + Clone> Sharded<K> {
    /// At most `capacity` entries and `max_bytes` bytes. The cache bounds one
    /// weight: the bytes, with every entry weighing at least
    /// `max_bytes / capacity`, so that small entries are bounded by their
    /// number.
    fn new(capacity: u64, max_bytes: u64) -> Result<Sharded<K>, CacheError> {
        let each = max_bytes.div_ceil(SHARDS as u64).max(1);
        let floor = max_bytes / capacity.max(1);
        let items = usize::try_from(capacity.div_ceil(SHARDS as u64)).unwrap_or(usize::MAX);
        let options = OptionsBuilder::new()
            .shards(1)
            .estimated_items_capacity(items.max(1))
            .weight_capacity(each)
            .hot_allocation(REUSED_SHARE)
            .build()
            .map_err(|e| CacheError::Options(e.to_string()))?;
        let shards = (0..SHARDS)
            .map(|_| {
                Cache::with_options(
                    options.clone(),
                    Weight { floor },
                    TableHasher::default(),
                    Default::default(),
                )
            })
            .collect();
        Ok(Sharded { shards })
    }

    fn shard(&self, fp: &Fingerprint) -> &Cache<K, Entry, Weight, TableHasher> {
        // A fingerprint is a uniform hash: its first byte spreads evenly.
        &self.shards[usize::from(fp.as_bytes()[0]) % SHARDS]
    }

    /// Removes the entries past their life from shard `i`.
    fn sweep_shard(&self, i: usize) {
        if let Some(shard) = self.shards.get(i) {
            let now = Instant::now();
            shard.retain(|_, entry| !entry.dead(now));
        }
    }

    fn entry_count(&self) -> u64 {
        self.shards.iter().map(|s| s.len() as u64).sum()
    }

    fn weighted_size(&self) -> u64 {
        self.shards.iter().map(Cache::weight).sum()
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
    pub fn new(capacity: u64, max_bytes: u64) -> Result<ResultCache, CacheError> {
        Ok(ResultCache {
            answers: Sharded::new(capacity, max_bytes)?,
            negative: Sharded::new(capacity.max(1024) / 4, max_bytes / 4)?,
        })
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
        } else if age < e.life {
            Lookup::Stale {
                answer: e.answer,
                age,
            }
        } else {
            Lookup::Miss
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
        let entry = Entry::new(answer, ttl, ttl + grace);
        self.answers.shard(&fp).insert(fp, entry);
    }

    /// Forgets the answer of `fp` (a stored response deleted by its owner:
    /// no later request may be served it).
    pub fn remove(&self, fp: &Fingerprint) {
        self.answers.shard(fp).remove(fp);
    }

    /// Removes every entry past its life, from both caches, now.
    pub fn sweep(&self) {
        for i in 0..SHARDS {
            self.sweep_shard(i);
        }
    }

    /// Removes the entries past their life from shard `i` of both caches.
    fn sweep_shard(&self, i: usize) {
        self.answers.sweep_shard(i);
        self.negative.sweep_shard(i);
    }

    /// Entries held, including those past their life that no sweep has
    /// removed yet.
    pub fn entry_count(&self) -> u64 {
        self.answers.entry_count() + self.negative.entry_count()
    }

    /// The weight of the answers held, in bytes.
    pub fn answer_bytes(&self) -> u64 {
        self.answers.weighted_size()
    }

    pub fn negative(&self, fp: &Fingerprint, target: usize) -> Option<(Arc<Answer>, Duration)> {
        let e = self.negative.shard(fp).get(&(*fp, target))?;
        let age = e.stored.elapsed();
        (age < e.fresh_for).then_some((e.answer, age))
    }

    pub fn put_negative(&self, fp: Fingerprint, target: usize, answer: Arc<Answer>, ttl: Duration) {
        let entry = Entry::new(answer, ttl, ttl);
        self.negative.shard(&fp).insert((fp, target), entry);
    }
}

/// How often [`spawn_housekeeper`] sweeps the whole cache. Lookups never
/// serve an entry past its life, so this bounds only how long such an entry
/// holds memory: at 100,000 entries a sweep of one shard takes about a
/// quarter of a millisecond.
pub const HOUSEKEEPING_EVERY: Duration = Duration::from_secs(1);

/// Starts a thread that sweeps `cache`'s dead entries out every `every`,
/// until the cache is dropped (the thread holds only a weak reference). The
/// shards are visited one at a time, `every / SHARDS` apart, so the work
/// comes in sixteen small pieces instead of one that would hold every lock.
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
                    Some(cache) => cache.sweep_shard(shard),
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
    fn the_housekeeper_sweeps_dead_entries_without_any_cache_call_and_stops_with_the_cache() {
        let cache = Arc::new(ResultCache::new(1_000, 1 << 30).unwrap());
        let fp = crate::fingerprint::Fingerprint::from_bytes([7; 32]);
        cache.put_negative(fp, 0, answer(), Duration::from_millis(30));
        cache.put_negative(fp, 1, answer(), Duration::from_secs(600));
        assert_eq!(cache.entry_count(), 2);
        let dead_at = Instant::now() + Duration::from_millis(30);
        while Instant::now() < dead_at + Duration::from_millis(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            cache.negative(&fp, 0).is_none(),
            "a dead entry is never served"
        );
        assert!(cache.negative(&fp, 1).is_some());
        assert_eq!(cache.entry_count(), 2, "nothing tidies up without a sweep");
        let upkeep = spawn_housekeeper(&cache, Duration::from_millis(10)).unwrap();
        // No get or insert from here on: only the housekeeper can remove
        // the dead entry, and it must keep the live one.
        let deadline = Instant::now() + Duration::from_secs(5);
        while cache.entry_count() > 1 {
            assert!(
                Instant::now() < deadline,
                "the expired entry was never removed"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            cache.negative(&fp, 1).is_some(),
            "the sweep kept the live entry"
        );

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
        let cache = ResultCache::new(4_000, 1 << 30).unwrap();
        for i in 0u32..10_000 {
            let mut bytes = [0; 32];
            bytes[..4].copy_from_slice(&i.to_le_bytes());
            let fp = crate::fingerprint::Fingerprint::from_bytes(*blake3::hash(&bytes).as_bytes());
            cache.put_negative(fp, 0, answer(), Duration::from_secs(60));
        }
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

    fn route() -> RouteConfig {
        RouteConfig {
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
            batch: Default::default(),
        }
    }

    #[test]
    fn an_answer_is_fresh_then_stale_within_its_grace_then_gone() {
        let mut route = route();
        route.coalesce.on_wait_timeout = OnWaitTimeout::Stale;
        // (wide margins: each check must fall in its window even on a
        // loaded machine)
        route.cache.stale_grace = Duration::from_millis(400);
        let cache = ResultCache::new(100, 1 << 20).unwrap();
        cache.put(fp_of(1), answer_of(10), Duration::from_millis(200), &route);
        assert!(matches!(cache.get(&fp_of(1)), Lookup::Fresh { .. }));
        let stored = Instant::now();
        while stored.elapsed() < Duration::from_millis(250) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(matches!(cache.get(&fp_of(1)), Lookup::Stale { .. }));
        assert!(cache.fresh(&fp_of(1)).is_none());
        while stored.elapsed() < Duration::from_millis(650) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(
            matches!(cache.get(&fp_of(1)), Lookup::Miss),
            "past TTL and grace, before any sweep"
        );
    }

    #[test]
    fn answers_in_use_and_new_answers_asked_again_soon_survive_a_flood_of_one_off_prompts() {
        let route = route();
        let ttl = Duration::from_secs(600);
        let capacity = 16_000;
        let cache = ResultCache::new(capacity, 1 << 30).unwrap();
        // Full of one-off answers (twice over, so that every shard is full),
        // then a hundred answers that are asked for again.
        for i in 0..2 * capacity as u32 {
            cache.put(fp_of(i), answer_of(10), ttl, &route);
        }
        for i in 0..100 {
            cache.put(fp_of(5_000_000 + i), answer_of(10), ttl, &route);
            assert!(cache.fresh(&fp_of(5_000_000 + i)).is_some());
        }
        // A new answer, then as many newer one-off answers as a twentieth
        // of the cache before it is asked again (a client's retry).
        let retried = fp_of(10_000_000);
        cache.put(retried, answer_of(10), ttl, &route);
        for i in 0..(capacity / 20) as u32 {
            cache.put(fp_of(1_000_000 + i), answer_of(10), ttl, &route);
        }
        assert!(cache.fresh(&retried).is_some(), "the retry missed");
        // Then a flood of one-off prompts, ten times the cache.
        for i in 0..(capacity * 10) as u32 {
            cache.put(fp_of(2_000_000 + i), answer_of(10), ttl, &route);
        }
        let kept = (0..100)
            .filter(|&i| cache.fresh(&fp_of(5_000_000 + i)).is_some())
            .count();
        assert_eq!(
            kept, 100,
            "answers in use were pushed out by one-off prompts"
        );
        assert!(cache.fresh(&retried).is_some());
        assert!(cache.entry_count() <= capacity + SHARDS as u64);
    }

    #[test]
    fn answers_weigh_their_bytes_and_the_cache_keeps_to_its_byte_bound() {
        let route = route();
        let ttl = Duration::from_secs(60);
        // 16 shards of 64 KiB; a 10 KiB answer weighs its bytes (the entry
        // count, 10,000, would allow all of them).
        let max_bytes = 1 << 20;
        let cache = ResultCache::new(10_000, max_bytes).unwrap();
        let one = answer_of(10 * 1024);
        let weight = (one.size_bytes() as u64) + ENTRY_OVERHEAD;
        cache.put(fp_of(0), one, ttl, &route);
        assert_eq!(cache.answer_bytes(), weight);
        // 400 of them (4 MiB) do not fit in 1 MiB: evicted down to it.
        for i in 1..400 {
            cache.put(fp_of(i), answer_of(10 * 1024), ttl, &route);
        }
        let (held, bytes) = (cache.entry_count(), cache.answer_bytes());
        assert!(bytes <= max_bytes, "{bytes} bytes held");
        assert_eq!(bytes, held * weight);
        assert!((50..=max_bytes / weight).contains(&held), "{held} held");
        // Small answers are still bounded by their number: each weighs at
        // least max_bytes / capacity.
        let cache = ResultCache::new(100, max_bytes).unwrap();
        for i in 0..1_000 {
            cache.put(fp_of(i), answer_of(10), ttl, &route);
        }
        let held = cache.entry_count();
        assert!((50..=100 + SHARDS as u64).contains(&held), "{held} held");
    }

    /// An answer rendered after it is cached (a streamed asker of a plain
    /// answer) grows, but its entry keeps the weight it came in with: its
    /// removal subtracts what its insertion added (before, the cache's
    /// upkeep panicked on the subtraction, found by the chaos test).
    #[test]
    fn an_answer_rendered_after_it_is_cached_keeps_its_weight() {
        // Room for many entries: no weight floor hides the growth.
        let cache = ResultCache::new(100_000, 1 << 20).unwrap();
        let mut a =
            Answer::from_failure(crate::answer::Failure::Timeout, "", "p".into(), "m".into());
        a.failure = None;
        a.status = reqwest::StatusCode::OK;
        a.body = bytes::Bytes::from_static(
            br#"{"id":"c1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}"#,
        );
        let answer = Arc::new(a);
        cache.put(fp_of(0), answer.clone(), Duration::from_secs(60), &route());
        let held = cache.answer_bytes();
        let before = answer.size_bytes();
        let _ = answer.stream_body(false);
        assert!(answer.size_bytes() > before, "no rendering was kept");
        assert_eq!(cache.answer_bytes(), held);
        cache.remove(&fp_of(0));
        assert_eq!(cache.answer_bytes(), 0);
    }

    #[test]
    fn an_answer_over_nine_tenths_of_a_shard_is_not_cached() {
        // (docs/configuration.md: "over 5.6 % of cache_max_bytes"): here
        // 16 shards of 1 MiB, so at most 0.9 MiB an answer.
        let route = route();
        let ttl = Duration::from_secs(60);
        let cache = ResultCache::new(100, 16 << 20).unwrap();
        let limit = (1u64 << 20) * 9 / 10;
        let weight_of = |a: &Arc<Answer>| a.size_bytes() as u64 + ENTRY_OVERHEAD;
        let under = answer_of(900 * 1024);
        assert!(weight_of(&under) <= limit);
        cache.put(fp_of(1), under, ttl, &route);
        assert!(cache.fresh(&fp_of(1)).is_some());
        let over = answer_of(930 * 1024);
        assert!(weight_of(&over) > limit);
        cache.put(fp_of(2), over, ttl, &route);
        assert!(cache.fresh(&fp_of(2)).is_none());
    }

    #[test]
    fn zero_jitter_is_exact() {
        assert_eq!(
            jittered_ttl(Duration::from_secs(5), 0.0),
            Duration::from_secs(5)
        );
    }
}
