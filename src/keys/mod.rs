//! The API keys kept in the store (virtual keys): each one a tenant's, with
//! its own expiry, route allowlist, rate limits and budget, managed through
//! the admin API or `idem keys` without a restart (docs/design.md, "Keys
//! and budgets").
//!
//! Every replica holds the whole table in memory ([`KeyTable`]), keyed by
//! the SHA-256 digest of the secret: authenticating a request is a hash
//! and a map lookup, never a database round trip. The table is read again
//! when the store says it changed ([`run`] polls a two-number version,
//! row count and sum of row versions, every `keys.refresh_interval`), so a
//! key created, revoked or limited on one replica is in force on every
//! replica within that interval. A secret is stored only as its digest; a
//! lookup by digest tells a timing observer nothing about the secret
//! (finding a secret from its digest is a preimage search).

pub mod manage;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use dashmap::DashMap;
use rand::RngCore;
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;

use crate::metrics::{BudgetLine, Metrics};
use crate::store::{KeyRecord, Store, StoreError};

/// The prefix of every secret idem makes.
pub const PREFIX: &str = "sk-idem-";

/// A new secret: the plain text (shown once), its digest (stored) and the
/// hint that names it in listings.
pub struct Secret {
    pub plain: String,
    pub digest: String,
    pub hint: String,
}

/// A fresh secret: `sk-idem-` and 32 random bytes in hex.
pub fn new_secret() -> Secret {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let plain = format!("{PREFIX}{}", hex::encode(bytes));
    let digest = hex::encode(Sha256::digest(plain.as_bytes()));
    let hint = format!("{PREFIX}...{}", &plain[plain.len() - 4..]);
    Secret {
        plain,
        digest,
        hint,
    }
}

/// A key as the request path sees it: its row, and its rate windows.
pub struct Key {
    pub id: Arc<str>,
    pub tenant: Arc<str>,
    pub record: KeyRecord,
    /// Requests this minute (`rpm`), in this process.
    pub requests: Option<Window>,
    /// Tokens this minute (`tpm`), in this process.
    pub tokens: Option<Window>,
}

impl Key {
    fn new(record: KeyRecord, before: Option<&Key>) -> Key {
        // A key whose limits did not change keeps its windows (a refresh
        // neither refills nor empties them).
        let keep = |w: Option<&Window>, limit: Option<i64>| match (w, limit) {
            (Some(w), Some(l)) if i64::try_from(w.limit).ok() == Some(l) => Some(w.clone_state()),
            (_, Some(l)) => Some(Window::new(u64::try_from(l).unwrap_or(0))),
            _ => None,
        };
        Key {
            id: Arc::from(record.id.as_str()),
            tenant: Arc::from(record.tenant.as_str()),
            requests: keep(before.and_then(|b| b.requests.as_ref()), record.rpm),
            tokens: keep(before.and_then(|b| b.tokens.as_ref()), record.tpm),
            record,
        }
    }

    /// The budget's scope in the store (`key:<id>`).
    pub fn scope(&self) -> String {
        format!("key:{}", self.id)
    }

    /// Whether the key may use `route` (its allowlist; none: every route).
    pub fn allows(&self, route: &str) -> bool {
        self.record
            .models
            .as_ref()
            .is_none_or(|m| m.iter().any(|r| r == route))
    }
}

/// What a presented secret names.
pub enum Found {
    Live(Arc<Key>),
    Revoked(Arc<Key>),
    Expired(Arc<Key>),
}

/// A fixed one-minute window of a rate limit, in this process.
pub struct Window {
    pub limit: u64,
    state: Arc<Mutex<(u64, u64)>>,
}

impl Window {
    fn new(limit: u64) -> Window {
        Window {
            limit,
            state: Arc::new(Mutex::new((0, 0))),
        }
    }

    fn clone_state(&self) -> Window {
        Window {
            limit: self.limit,
            state: self.state.clone(),
        }
    }

    /// Takes `n` from this minute's allowance if it is not spent yet (a
    /// token window admits a request while any allowance is left; its
    /// tokens are counted when known): `Ok(remaining)`, or `Err(seconds
    /// until the next minute)`.
    pub fn take(&self, n: u64, now_ms: i64) -> Result<u64, u64> {
        let now = u64::try_from(now_ms).unwrap_or(0);
        let minute = now / 60_000;
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.0 != minute {
            *s = (minute, 0);
        }
        if s.1 >= self.limit || (n > 0 && s.1 + n > self.limit) {
            let next = (minute + 1) * 60_000;
            return Err((next - now).div_ceil(1000).max(1));
        }
        s.1 += n;
        Ok(self.limit - s.1)
    }

    /// Counts `n` more (tokens known after the call), past the limit too.
    pub fn add(&self, n: u64, now_ms: i64) {
        let minute = u64::try_from(now_ms).unwrap_or(0) / 60_000;
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.0 != minute {
            *s = (minute, 0);
        }
        s.1 = s.1.saturating_add(n);
    }

    /// What is left of this minute's allowance.
    pub fn remaining(&self, now_ms: i64) -> u64 {
        let minute = u64::try_from(now_ms).unwrap_or(0) / 60_000;
        let s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.0 != minute {
            return self.limit;
        }
        self.limit.saturating_sub(s.1)
    }
}

/// The store's keys, as this replica holds them.
pub struct KeyTable {
    by_digest: ArcSwap<HashMap<[u8; 32], Arc<Key>>>,
    /// The store's version last read: (rows, sum of row versions).
    seen: Mutex<Option<(i64, i64)>>,
    /// When each key was last used, not yet written to the store.
    used: DashMap<Arc<str>, i64>,
    /// How many times the table was read again.
    pub reloads: AtomicU64,
}

impl Default for KeyTable {
    fn default() -> Self {
        KeyTable::new()
    }
}

impl KeyTable {
    pub fn new() -> KeyTable {
        KeyTable {
            by_digest: ArcSwap::from_pointee(HashMap::new()),
            seen: Mutex::new(None),
            used: DashMap::new(),
            reloads: AtomicU64::new(0),
        }
    }

    /// The key a presented secret names, at `now` (ms).
    pub fn find(&self, presented: &[u8], now: i64) -> Option<Found> {
        if self.by_digest.load().is_empty() {
            return None;
        }
        let digest: [u8; 32] = Sha256::digest(presented).into();
        let key = self.by_digest.load().get(&digest)?.clone();
        Some(if key.record.revoked_at.is_some() {
            Found::Revoked(key)
        } else if key.record.expires_at.is_some_and(|t| t <= now) {
            Found::Expired(key)
        } else {
            Found::Live(key)
        })
    }

    /// Every key held, revoked ones too.
    pub fn all(&self) -> Vec<Arc<Key>> {
        let mut keys: Vec<Arc<Key>> = self.by_digest.load().values().cloned().collect();
        keys.sort_by(|a, b| {
            (a.record.created_at, &a.record.id).cmp(&(b.record.created_at, &b.record.id))
        });
        keys
    }

    /// The key with this id, if held.
    pub fn by_id(&self, id: &str) -> Option<Arc<Key>> {
        self.by_digest
            .load()
            .values()
            .find(|k| &*k.id == id)
            .cloned()
    }

    /// Notes a use of `key` (written to the store by the next refresh).
    pub fn used(&self, key: &Key, now: i64) {
        self.used.insert(key.id.clone(), now);
    }

    /// Reads the table again if the store's version moved (or `force`);
    /// returns whether it did. Writes the uses noted since the last call.
    pub async fn refresh(&self, store: &dyn Store, force: bool) -> Result<bool, StoreError> {
        let used: Vec<(String, i64)> = self
            .used
            .iter()
            .map(|e| (e.key().to_string(), *e.value()))
            .collect();
        if !used.is_empty() {
            for (id, _) in &used {
                self.used.remove(id.as_str());
            }
            store.touch_keys(&used).await?;
        }
        let version = store.keys_version().await?;
        let seen = *self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if !force && seen == Some(version) {
            return Ok(false);
        }
        let rows = store.keys(None).await?;
        self.install(rows);
        *self.seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(version);
        self.reloads.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Makes `rows` the table, keeping the rate windows of the keys whose
    /// limits did not change.
    pub fn install(&self, rows: Vec<KeyRecord>) {
        let before = self.by_digest.load();
        let by_id: HashMap<&str, &Arc<Key>> = before.values().map(|k| (&*k.id, k)).collect();
        let mut next = HashMap::with_capacity(rows.len());
        for row in rows {
            let Some(digest) = hex::decode(&row.digest)
                .ok()
                .and_then(|d| <[u8; 32]>::try_from(d).ok())
            else {
                tracing::warn!(key = %row.id, "a key's digest is not 64 hex digits: ignored");
                continue;
            };
            let old = by_id.get(row.id.as_str()).map(|k| &***k);
            next.insert(digest, Arc::new(Key::new(row, old)));
        }
        self.by_digest.store(Arc::new(next));
    }
}

/// Refreshes `table` from `store` every `every` until `stop` (a failed
/// read is logged and tried again at the next tick), and about once a
/// second gives `metrics` the budgets as the store has them.
pub async fn run(
    table: Arc<KeyTable>,
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    every: Duration,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    let mut budgets_read: Option<std::time::Instant> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        match table.refresh(&*store, false).await {
            Ok(_) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "cannot read the keys: the table in force stays");
            }
            Err(_) => {}
        }
        if budgets_read.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            budgets_read = Some(std::time::Instant::now());
            if let Ok(rows) = store.budgets(crate::store::now_ms()).await {
                metrics.set_budgets(budget_lines(&table, &rows));
            }
        }
    }
}

/// The store's budget rows as `/metrics` lines, each key named by the
/// table.
pub fn budget_lines(table: &KeyTable, rows: &[crate::store::BudgetRecord]) -> Vec<BudgetLine> {
    let keys: HashMap<String, Arc<Key>> = table
        .all()
        .into_iter()
        .map(|k| (k.id.to_string(), k))
        .collect();
    rows.iter()
        .filter_map(|b| {
            let (tenant, key, name) = if let Some(id) = b.scope.strip_prefix("key:") {
                let k = keys.get(id)?;
                (k.tenant.to_string(), id.to_string(), k.record.name.clone())
            } else {
                let t = b.scope.strip_prefix("tenant:")?;
                (t.to_string(), String::new(), String::new())
            };
            Some(BudgetLine {
                tenant,
                key,
                name,
                limit: b.limit_nanos.map(crate::prices::dollars),
                spent: crate::prices::dollars(b.spent_nanos),
                reserved: crate::prices::dollars(b.reserved_nanos),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_prefixed_random_and_its_hint_shows_its_end() {
        let a = new_secret();
        let b = new_secret();
        assert!(a.plain.starts_with(PREFIX) && a.plain.len() == PREFIX.len() + 64);
        assert_ne!(a.plain, b.plain);
        assert_eq!(a.digest, hex::encode(Sha256::digest(a.plain.as_bytes())));
        assert!(a.hint.ends_with(&a.plain[a.plain.len() - 4..]));
        assert!(!a.hint.contains(&a.plain[PREFIX.len()..PREFIX.len() + 8]));
    }

    #[test]
    fn a_window_admits_its_limit_per_minute_then_says_how_long_to_wait() {
        let w = Window::new(3);
        let t = 60_000 * 1000 + 59_500;
        assert_eq!(w.take(1, t), Ok(2));
        assert_eq!(w.take(1, t), Ok(1));
        assert_eq!(w.take(1, t), Ok(0));
        assert_eq!(w.take(1, t), Err(1));
        // The next minute starts afresh.
        assert_eq!(w.take(1, t + 600), Ok(2));
        // Tokens counted after the call may pass the limit; then nothing
        // more is admitted this minute.
        w.add(10, t + 600);
        assert_eq!(w.remaining(t + 600), 0);
        assert!(w.take(0, t + 600).is_err());
    }
}
