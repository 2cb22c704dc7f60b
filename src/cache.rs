//! The result cache: finished answers kept for a short, jittered while after
//! their flight ends, so the next wave of the same prompt costs nothing; and
//! the negative cache, which keeps a provider's failure for a few seconds so
//! waiters never re-attack a failing provider (SPEC section 4).
//!
//! Entries live in [`moka`] caches with a per-entry expiry. Successes are
//! keyed by fingerprint; failures by fingerprint and target, since a failure
//! belongs to the provider that produced it and the next target may still
//! answer. A success may outlive its TTL by `cache.stale_grace` when the
//! route serves stale answers on wait timeouts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use moka::Expiry;
use moka::sync::Cache;
use rand::Rng;

use crate::answer::Answer;
use crate::config::{OnWaitTimeout, RouteConfig};
use crate::fingerprint::Fingerprint;

#[derive(Clone)]
struct Entry {
    answer: Arc<Answer>,
    stored: Instant,
    fresh_for: Duration,
    /// Total life in the cache (fresh plus stale grace).
    life: Duration,
}

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

/// The result and negative caches of one gateway (memory backend).
pub struct ResultCache {
    answers: Cache<Fingerprint, Entry>,
    negative: Cache<(Fingerprint, usize), Entry>,
}

impl ResultCache {
    pub fn new(capacity: u64) -> ResultCache {
        ResultCache {
            answers: Cache::builder()
                .max_capacity(capacity)
                .expire_after(PerEntry)
                .build(),
            negative: Cache::builder()
                .max_capacity(capacity.max(1024) / 4)
                .expire_after(PerEntry)
                .build(),
        }
    }

    pub fn get(&self, fp: &Fingerprint) -> Lookup {
        let Some(e) = self.answers.get(fp) else {
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
        self.answers.insert(fp, entry);
    }

    pub fn negative(&self, fp: &Fingerprint, target: usize) -> Option<(Arc<Answer>, Duration)> {
        let e = self.negative.get(&(*fp, target))?;
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
        self.negative.insert((fp, target), entry);
    }
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

    #[test]
    fn zero_jitter_is_exact() {
        assert_eq!(
            jittered_ttl(Duration::from_secs(5), 0.0),
            Duration::from_secs(5)
        );
    }
}
