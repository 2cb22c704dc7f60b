//! Budgets: what a key, and its tenant, may still spend in US dollars,
//! reserved before a call goes upstream and settled at its real cost when
//! its answer arrives (docs/design.md, "Keys and budgets").
//!
//! Checking a budget and recording a spend as two steps is how concurrent
//! requests overspend one (each checks, all pass, then all spend). Here a
//! call first reserves its worst case; what is reserved is never available
//! to another call, on any replica, until it is settled or released.
//!
//! The store holds, per spender (`key:<id>`, `tenant:<name>`), the limit,
//! the spend of the period, and one grant per replica: money that replica
//! may hand out to its own calls. A grant is taken in one transaction that
//! holds the spender's row and checks `spent + every live grant + asked <=
//! limit` ([`Store::grant`]), so replicas together can never be granted
//! more than the limit. Within its grant a replica reserves in memory
//! ([`Ledger::reserve`] costs a lock, microseconds); it asks the store
//! only when its grant runs short, for what the call needs plus a little
//! more when calls come fast, and gives unused grant back at the next
//! heartbeat. A grant has a lease, renewed by the heartbeat: a replica that
//! dies holding reservations holds them no longer than the lease.
//! Settling adds the real cost to the spend and takes the reservation off
//! the grant: at once in this replica's memory, and in the store before
//! anybody gets the answer, in one transaction with every other
//! settlement ready at that moment (group commit: while one batch is
//! written the next gathers, so a busy replica writes once per batch, not
//! once per call). A process killed after answering has written what the
//! answer cost; one killed before has not, and its grant, which still
//! holds the call's reservation, ends with its lease.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;

use crate::config::Unpriced;
use crate::keys::Key;
use crate::prices::{Price, Tokens, dollars, nanos};
use crate::store::{Settlement, Store, now_ms};

/// Why a call may not go upstream.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BudgetError {
    /// The spender's budget cannot hold the call's worst case.
    #[error("{who} has ${left:.6} of its budget left; this request may cost up to ${need:.6}")]
    Exceeded {
        who: String,
        left: f64,
        need: f64,
        /// Seconds until the budget's period starts again, when it has one.
        retry_after: Option<u64>,
    },
    /// The spender has a budget and the target's price is unknown: the
    /// call's cost could not be counted against it.
    #[error(
        "{who} has a budget and the price of {model} is unknown: set the target's price (`price = {{ input_per_mtok = .., output_per_mtok = .. }}`)"
    )]
    PriceUnknown { who: String, model: String },
    /// The store cannot be reached: a budget that cannot be checked is
    /// not spent.
    #[error("the budget cannot be checked now: {0}")]
    Unavailable(String),
}

/// One spender as this replica holds it.
struct Scope {
    name: String,
    local: Mutex<Local>,
    /// One request to the store at a time per spender on this replica.
    granting: tokio::sync::Mutex<()>,
}

#[derive(Default)]
struct Local {
    /// What the store granted this replica (and has not been settled).
    granted: i64,
    /// Of `granted`, what calls in progress reserved.
    reserved: i64,
    /// Reservations since the last heartbeat (how fast calls come).
    calls: u32,
}

/// This replica's side of every budget.
pub struct Ledger {
    store: Arc<dyn Store>,
    /// This process, as the store's grants name it.
    holder: String,
    lease: Duration,
    scopes: DashMap<String, Arc<Scope>>,
    /// When the grants' leases were last renewed; past the lease, the
    /// store may have released them, and nothing is reserved locally.
    renewed: Mutex<Instant>,
    /// Settlements not yet written.
    pending: Mutex<Pending>,
    /// Every batch below this one was written (or tried, and kept for the
    /// next).
    written: tokio::sync::watch::Sender<u64>,
}

/// Settlements waiting for the store, and whether somebody writes them.
#[derive(Default)]
struct Pending {
    /// By spender.
    by_scope: std::collections::HashMap<String, Unwritten>,
    /// The batch a settlement joins now: the one after what is being
    /// written.
    batch: u64,
    /// A writer is at work: it takes batch after batch until none is left.
    writing: bool,
}

/// A spender's settlements of one batch.
#[derive(Default, Clone, Copy)]
struct Unwritten {
    reserved: i64,
    spent: i64,
    calls: i64,
}

impl Unwritten {
    fn add(&mut self, other: Unwritten) {
        self.reserved += other.reserved;
        self.spent = self.spent.saturating_add(other.spent);
        self.calls += other.calls;
    }
}

/// A spender a call is charged to, and whether it has a limit (one
/// without is only counted).
#[derive(Debug, Clone)]
pub struct Spender {
    pub scope: String,
    pub limited: bool,
    /// The budget, when it has one (nano-dollars): what this replica may
    /// ask for in advance is a sixteenth of it at most.
    pub limit: Option<i64>,
    /// Who the spender is, for messages (`key "ci" of tenant acme`).
    pub who: String,
}

/// A call's reservation: released when dropped unless settled.
pub struct Reservation {
    ledger: Arc<Ledger>,
    parts: Vec<(Arc<Scope>, i64)>,
    /// The count-only spenders, settled too.
    counted: Vec<String>,
    pub amount: i64,
    /// The key whose tokens per minute the call's tokens count against.
    key: Option<Arc<Key>>,
    done: bool,
}

/// Who pays for the calls a request leads: its key and its tenant, as
/// spenders, and the rules of `[budgets]`.
pub struct Payer {
    pub ledger: Arc<Ledger>,
    pub spenders: Vec<Spender>,
    pub key: Option<Arc<Key>>,
    pub default_output: u64,
    pub unpriced: Unpriced,
}

impl Payer {
    /// Who pays for the calls of `tenant`'s requests made with `key` (a
    /// key of the store; none: the configuration's): the key, limited by
    /// its budget or only counted, and the tenant when it has a budget
    /// (`tenant_budget`, nano-dollars); none when neither.
    pub fn of(
        ledger: &Arc<Ledger>,
        tenant: &str,
        key: Option<Arc<Key>>,
        tenant_budget: Option<i64>,
        config: &crate::config::BudgetsConfig,
    ) -> Option<Payer> {
        let mut spenders = Vec::new();
        if let Some(key) = &key {
            spenders.push(Spender {
                scope: key.scope(),
                limited: key.record.budget_nanos.is_some(),
                limit: key.record.budget_nanos,
                who: format!("key \"{}\" of tenant {tenant}", key.record.name),
            });
        }
        if let Some(limit) = tenant_budget {
            spenders.push(Spender {
                scope: format!("tenant:{tenant}"),
                limited: true,
                limit: Some(limit),
                who: format!("tenant {tenant}"),
            });
        }
        if spenders.is_empty() {
            return None;
        }
        Some(Payer {
            ledger: ledger.clone(),
            spenders,
            key,
            default_output: config.default_max_output_tokens,
            unpriced: config.unpriced,
        })
    }

    /// The reservation of a call to a target of price `price` (none:
    /// unknown) for `request`, or why the call may not be made.
    pub async fn reserve(
        &self,
        price: Option<&Price>,
        model: &str,
        request: &Map<String, Value>,
        embeddings: bool,
    ) -> Result<Reservation, BudgetError> {
        let amount = match price {
            Some(p) => worst_case(p, request, embeddings, self.default_output),
            None => match self.spenders.iter().find(|s| s.limited) {
                Some(s) if self.unpriced == Unpriced::Refuse => {
                    return Err(BudgetError::PriceUnknown {
                        who: s.who.clone(),
                        model: model.to_string(),
                    });
                }
                _ => 0,
            },
        };
        let mut r = self.ledger.reserve(&self.spenders, amount).await?;
        r.key = self.key.clone();
        Ok(r)
    }
}

impl Ledger {
    pub fn new(store: Arc<dyn Store>, lease: Duration) -> Arc<Ledger> {
        Arc::new(Ledger {
            store,
            holder: format!("{}", uuid::Uuid::now_v7()),
            lease,
            scopes: DashMap::new(),
            renewed: Mutex::new(Instant::now()),
            pending: Mutex::new(Pending::default()),
            written: tokio::sync::watch::Sender::new(0),
        })
    }

    fn scope(&self, name: &str) -> Arc<Scope> {
        if let Some(s) = self.scopes.get(name) {
            return s.clone();
        }
        self.scopes
            .entry(name.to_string())
            .or_insert_with(|| {
                Arc::new(Scope {
                    name: name.to_string(),
                    local: Mutex::new(Local::default()),
                    granting: tokio::sync::Mutex::new(()),
                })
            })
            .clone()
    }

    fn lease_alive(&self) -> bool {
        let renewed = *self.renewed.lock().unwrap_or_else(|p| p.into_inner());
        // A margin: the store's clock and this one need not agree.
        renewed.elapsed() + self.lease / 4 < self.lease
    }

    /// Reserves `amount` (nano-dollars) against every limited spender, in
    /// order, or none of them: the first that cannot hold it refuses the
    /// call.
    pub async fn reserve(
        self: &Arc<Self>,
        spenders: &[Spender],
        amount: i64,
    ) -> Result<Reservation, BudgetError> {
        let mut r = Reservation {
            ledger: self.clone(),
            parts: Vec::new(),
            counted: Vec::new(),
            amount,
            key: None,
            done: false,
        };
        for s in spenders {
            if !s.limited {
                r.counted.push(s.scope.clone());
                continue;
            }
            let scope = self.scope(&s.scope);
            // Dropping `r` on refusal releases what it already holds.
            self.reserve_in(&scope, s, amount).await?;
            r.parts.push((scope, amount));
        }
        Ok(r)
    }

    async fn reserve_in(
        self: &Arc<Self>,
        scope: &Scope,
        spender: &Spender,
        amount: i64,
    ) -> Result<(), BudgetError> {
        if self.take_local(scope, amount) {
            return Ok(());
        }
        let _one = scope.granting.lock().await;
        if self.take_local(scope, amount) {
            return Ok(());
        }
        let (need, extra) = {
            let mut l = scope.local.lock().unwrap_or_else(|p| p.into_inner());
            if !self.lease_alive() {
                // The store may have let the grant go: ask for what the
                // calls in progress hold too.
                l.granted = 0;
            }
            let need = amount - (l.granted - l.reserved);
            // More when calls come fast (as many worst cases as calls
            // since the last heartbeat, up to 4,096): the next ones then
            // reserve in memory. Only from a budget of a thousand worst
            // cases or more, and never more than a sixteenth of it: a
            // budget of a few calls is granted call by call, so that no
            // replica holds in advance what another needs now. What goes
            // unused goes back at the next idle heartbeat.
            let ahead = amount.saturating_mul(i64::from(l.calls.min(4096)));
            let extra = match spender.limit {
                Some(limit) if amount.saturating_mul(1024) <= limit => ahead.min(limit / 16),
                _ => 0,
            };
            (need, extra)
        };
        // Settlements not yet written would count against this grant as
        // reservations: they are written first.
        self.flush().await;
        let now = now_ms();
        let lease_until = now + i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX);
        let granted = self
            .store
            .grant(&scope.name, &self.holder, need, extra, lease_until, now)
            .await
            .map_err(|e| BudgetError::Unavailable(e.to_string()))?;
        let Some(granted) = granted else {
            // For the message: what is left, and when the period starts
            // again.
            let row = self.store.budget(&scope.name, now).await.ok().flatten();
            let left = row.as_ref().map_or(0, |b| {
                b.limit_nanos.unwrap_or(0) - b.spent_nanos - b.reserved_nanos
            });
            let retry_after = row
                .and_then(|b| b.period_ms.map(|p| b.period_start + p - now))
                .map(|ms| u64::try_from(ms.max(1000) / 1000).unwrap_or(1));
            return Err(BudgetError::Exceeded {
                who: spender.who.clone(),
                left: dollars(left.max(0)),
                need: dollars(amount),
                retry_after,
            });
        };
        let mut l = scope.local.lock().unwrap_or_else(|p| p.into_inner());
        l.granted = granted;
        l.reserved += amount;
        l.calls = l.calls.saturating_add(1);
        Ok(())
    }

    fn take_local(&self, scope: &Scope, amount: i64) -> bool {
        if !self.lease_alive() {
            return false;
        }
        let mut l = scope.local.lock().unwrap_or_else(|p| p.into_inner());
        if l.granted - l.reserved >= amount {
            l.reserved += amount;
            l.calls = l.calls.saturating_add(1);
            true
        } else {
            false
        }
    }

    /// Renews this replica's grants, gives back what went unused since the
    /// last heartbeat, and releases the grants of replicas whose lease
    /// ended.
    pub async fn heartbeat(&self) {
        let now = now_ms();
        let lease_until = now + i64::try_from(self.lease.as_millis()).unwrap_or(i64::MAX);
        let scopes: Vec<Arc<Scope>> = self.scopes.iter().map(|e| e.value().clone()).collect();
        for scope in scopes {
            let surplus = {
                let mut l = scope.local.lock().unwrap_or_else(|p| p.into_inner());
                let idle = l.calls == 0;
                l.calls = 0;
                let surplus = l.granted - l.reserved;
                if idle && surplus > 0 {
                    l.granted -= surplus;
                    surplus
                } else {
                    0
                }
            };
            if surplus > 0
                && let Err(e) = self.store.release(&scope.name, &self.holder, surplus).await
            {
                tracing::debug!(error = %e, scope = %scope.name, "cannot give back an unused grant");
            }
        }
        let holding = self
            .scopes
            .iter()
            .filter(|s| s.local.lock().unwrap_or_else(|p| p.into_inner()).granted > 0)
            .count();
        match self
            .store
            .renew_grants(&self.holder, now, lease_until)
            .await
        {
            Ok(renewed) if usize::try_from(renewed).unwrap_or(0) >= holding => {
                *self.renewed.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
            }
            Ok(_) => {
                // A grant's lease ended before it could be renewed (a
                // stalled process): the store no longer holds it for this
                // replica. What calls in progress reserved is asked for
                // again with the next reservation.
                tracing::warn!(
                    "a budget grant's lease ended before its renewal: asking the store again"
                );
                for s in self.scopes.iter() {
                    s.local.lock().unwrap_or_else(|p| p.into_inner()).granted = 0;
                }
                *self.renewed.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
            }
            Err(e) => tracing::warn!(error = %e, "cannot renew budget grants"),
        }
        if let Err(e) = self.store.expire_grants(now).await {
            tracing::debug!(error = %e, "cannot release expired budget grants");
        }
        // Spenders with nothing granted and nobody using them are
        // forgotten (they come back when next used). One in use stays: a
        // second one for the same spender would not know what the first
        // holds.
        self.scopes.retain(|_, s| {
            let l = s.local.lock().unwrap_or_else(|p| p.into_inner());
            l.granted > 0 || l.reserved > 0 || Arc::strong_count(s) > 1
        });
    }

    /// Writes every settlement not written yet (the timer's retry of a
    /// batch the store refused, and the last write at a stop), and returns
    /// once they were written or tried.
    pub async fn flush(self: &Arc<Self>) {
        let (last, start) = {
            let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            if p.by_scope.is_empty() {
                if !p.writing {
                    return;
                }
                // What is being written: the batch before the gathering one.
                (p.batch.saturating_sub(1), false)
            } else {
                let start = !p.writing;
                p.writing = true;
                (p.batch, start)
            }
        };
        if start {
            self.clone().write_batches().await;
        } else {
            self.written_past(last).await;
        }
    }

    /// Waits until batch `batch` was written or tried; a store that does
    /// not answer is waited for a third of the lease at most (the grant
    /// counts the calls' reservations meanwhile, and the batch stays for
    /// the next try).
    async fn written_past(&self, batch: u64) {
        let mut written = self.written.subscribe();
        let _ = tokio::time::timeout(self.lease / 3, written.wait_for(|w| *w > batch)).await;
    }

    /// The writer: takes the gathered batch, writes it in one transaction,
    /// and goes on while more gathered meanwhile. A batch the store
    /// refuses goes back to the pending settlements and the writer stops:
    /// the next settlement or the timer (`budgets.flush_interval`) tries
    /// again.
    async fn write_batches(self: Arc<Self>) {
        loop {
            let (batch, work) = {
                let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                if p.by_scope.is_empty() {
                    p.writing = false;
                    return;
                }
                let batch = p.batch;
                p.batch += 1;
                (batch, std::mem::take(&mut p.by_scope))
            };
            let settlements: Vec<Settlement> = work
                .iter()
                .map(|(scope, u)| Settlement {
                    scope: scope.clone(),
                    reserved: u.reserved,
                    spent: u.spent,
                    calls: u.calls,
                })
                .collect();
            let refused = self
                .store
                .settle(&self.holder, &settlements, now_ms())
                .await
                .err();
            if let Some(e) = &refused {
                tracing::warn!(error = %e, "cannot record spend yet: tried again shortly");
                let mut p = self.pending.lock().unwrap_or_else(|p| p.into_inner());
                for (scope, u) in work {
                    p.by_scope.entry(scope).or_default().add(u);
                }
                p.writing = false;
            }
            self.written.send_replace(batch + 1);
            if refused.is_some() {
                return;
            }
        }
    }

    /// What this replica holds for `scope` now: (granted, reserved).
    pub fn held(&self, scope: &str) -> (i64, i64) {
        self.scopes.get(scope).map_or((0, 0), |s| {
            let l = s.local.lock().unwrap_or_else(|p| p.into_inner());
            (l.granted, l.reserved)
        })
    }
}

impl Reservation {
    /// Settles the call at its real cost (nano-dollars): off this
    /// replica's grants at once, into every spender's spend in the store
    /// before it returns (with the other settlements ready at that
    /// moment). Dropped while it waits, the write still happens.
    pub async fn settle(mut self, cost: i64, tokens: Option<&Tokens>) {
        self.done = true;
        let now = now_ms();
        if let (Some(key), Some(t)) = (&self.key, tokens)
            && let Some(w) = &key.tokens
        {
            w.add(t.input.saturating_add(t.output), now);
        }
        let (batch, start) = {
            let mut p = self
                .ledger
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            for (scope, amount) in &self.parts {
                {
                    let mut l = scope.local.lock().unwrap_or_else(|p| p.into_inner());
                    l.reserved -= amount;
                    l.granted = (l.granted - amount).max(0);
                }
                p.by_scope
                    .entry(scope.name.clone())
                    .or_default()
                    .add(Unwritten {
                        reserved: *amount,
                        spent: cost,
                        calls: 1,
                    });
            }
            for scope in &self.counted {
                p.by_scope.entry(scope.clone()).or_default().add(Unwritten {
                    reserved: 0,
                    spent: cost,
                    calls: 1,
                });
            }
            let start = !p.writing;
            p.writing = true;
            (p.batch, start)
        };
        if start {
            tokio::spawn(self.ledger.clone().write_batches());
        }
        self.ledger.written_past(batch).await;
    }
}

impl Reservation {
    /// The key whose tokens per minute the call counts against.
    pub fn key(&self) -> Option<&Arc<Key>> {
        self.key.as_ref()
    }

    /// One reservation for two (the tasks of one call).
    pub fn join(mut self, mut other: Reservation) -> Reservation {
        self.amount += other.amount;
        for (scope, amount) in other.parts.drain(..) {
            match self.parts.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &scope)) {
                Some((_, mine)) => *mine += amount,
                None => self.parts.push((scope, amount)),
            }
        }
        other.done = true;
        self
    }
}

impl Drop for Reservation {
    /// No call was made: the reservation goes back to this replica's
    /// grants (given back to the store at the next idle heartbeat).
    fn drop(&mut self) {
        if self.done {
            return;
        }
        for (scope, amount) in &self.parts {
            let mut l = scope.local.lock().unwrap_or_else(|p| p.into_inner());
            l.reserved -= amount;
        }
    }
}

/// Writes each tenant's budget of `config` (`budget_usd`,
/// `budget_period`) to the store, where its spend is kept.
pub async fn set_tenant_budgets(
    store: &dyn Store,
    config: &crate::config::Config,
) -> Result<(), crate::store::StoreError> {
    let now = now_ms();
    for t in &config.tenants {
        if let Some(usd) = t.budget_usd {
            let limit = i64::try_from(nanos(usd)).unwrap_or(i64::MAX);
            let period = t.budget_period.as_deref().and_then(crate::store::period_ms);
            store
                .set_budget(&format!("tenant:{}", t.name), Some(limit), period, now)
                .await?;
        }
    }
    Ok(())
}

/// Runs the ledger until `stop`: every `flush`, a retry of settlements the
/// store refused; every lease/3, its heartbeat; at `stop`, a last flush.
pub async fn run(ledger: Arc<Ledger>, flush: Duration, stop: CancellationToken) {
    let mut beat = tokio::time::interval((ledger.lease / 3).max(Duration::from_millis(50)));
    beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut write = tokio::time::interval(flush);
    write.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => {
                ledger.flush().await;
                return;
            }
            _ = write.tick() => ledger.flush().await,
            _ = beat.tick() => {
                ledger.flush().await;
                ledger.heartbeat().await;
            }
        }
    }
}

/// The most a request can cost at `price`, in nano-dollars: every byte of
/// its text a token (a token is at least one byte), one more per JSON
/// value of its structure, 1,600 per image, and the output it allows
/// (`max_completion_tokens`, `max_tokens` or `max_output_tokens`, times
/// `n`), else `default_output` (docs/design.md, "Keys and budgets").
pub fn worst_case(
    price: &Price,
    request: &Map<String, Value>,
    embeddings: bool,
    default_output: u64,
) -> i64 {
    let mut input = 0u64;
    for (k, v) in request {
        input = input.saturating_add(k.len() as u64 + 1);
        input = input.saturating_add(text_tokens(v));
    }
    let output = if embeddings {
        0
    } else {
        let asked = ["max_completion_tokens", "max_tokens", "max_output_tokens"]
            .iter()
            .find_map(|f| request.get(*f).and_then(Value::as_u64))
            .unwrap_or(default_output);
        let n = request.get("n").and_then(Value::as_u64).unwrap_or(1).max(1);
        asked.saturating_mul(n)
    };
    let tokens = Tokens {
        input,
        cached_input: 0,
        output,
    };
    i64::try_from(nanos(price.cost(&tokens))).unwrap_or(i64::MAX)
}

/// What a call's answer cost, in nano-dollars; an answer that says
/// nothing of its tokens costs its whole reservation.
pub fn real_cost(price: &Price, tokens: Option<&Tokens>, reserved: i64) -> i64 {
    match tokens {
        Some(t) => i64::try_from(nanos(price.cost(t))).unwrap_or(i64::MAX),
        None => reserved,
    }
}

/// The tokens a value's text may be, at most.
fn text_tokens(v: &Value) -> u64 {
    match v {
        Value::String(s) => s.len() as u64 + 1,
        Value::Array(a) => a.iter().map(text_tokens).fold(1, u64::saturating_add),
        Value::Object(o) => {
            let image = matches!(
                o.get("type").and_then(Value::as_str),
                Some("image" | "image_url" | "input_image")
            );
            let own = if image { 1_600 } else { 1 };
            o.iter()
                .map(|(k, v)| k.len() as u64 + text_tokens(v))
                .fold(own, u64::saturating_add)
        }
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn price() -> Price {
        Price {
            input_per_mtok: 1.0,
            cached_input_per_mtok: 1.0,
            output_per_mtok: 2.0,
            source: "config",
        }
    }

    #[test]
    fn the_worst_case_counts_every_byte_and_the_output_allowed() {
        let req = |v: Value| v.as_object().cloned().unwrap();
        let small = req(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}),
        );
        let big = req(
            json!({"model": "m", "messages": [{"role": "user", "content": "hi".repeat(500)}], "max_tokens": 10}),
        );
        let a = worst_case(&price(), &small, false, 4096);
        let b = worst_case(&price(), &big, false, 4096);
        // 998 more bytes of text: 998 more tokens at most, each $1/Mtok
        // (1,000 nano-dollars).
        assert_eq!(b - a, 998 * 1_000, "{a} {b}");
        // The output: 10 tokens at $2/Mtok, or the default when unasked
        // (the field's own 12 tokens of input gone too).
        let mut open = small.clone();
        open.remove("max_tokens");
        assert_eq!(
            worst_case(&price(), &open, false, 4096) - a,
            (4096 - 10) * 2_000 - 12 * 1_000
        );
        let mut twice = small.clone();
        twice.insert("n".into(), json!(2));
        assert_eq!(
            worst_case(&price(), &twice, false, 4096) - a,
            10 * 2_000 + 3 * 1_000
        );
        // An image is 1,600 tokens at most.
        let image = req(
            json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}], "max_tokens": 10}),
        );
        assert!(worst_case(&price(), &image, false, 4096) - a >= 1_600 * 1_000);
        // Embeddings have no output.
        assert!(worst_case(&price(), &small, true, 4096) < a);
    }

    async fn store() -> (Arc<dyn Store>, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("idem-budgets-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let url = format!("sqlite://{}", dir.join("b.db").display());
        (crate::store::connect(&url, 4).await.unwrap(), dir)
    }

    fn spender(scope: &str) -> Spender {
        Spender {
            scope: scope.into(),
            limited: true,
            limit: None,
            who: scope.into(),
        }
    }

    /// A heartbeat in the middle of a reservation forgets nothing in use:
    /// a spender forgotten while a call holds part of its grant, then made
    /// anew, would take that part for free.
    #[tokio::test]
    async fn a_heartbeat_never_forgets_a_spender_in_use() {
        let (s, dir) = store().await;
        s.set_budget("key:k", Some(2_000), None, now_ms())
            .await
            .unwrap();
        let ledger = Ledger::new(s.clone(), Duration::from_secs(10));
        // A reservation that has its spender and waits for the store (a
        // grant in progress, nothing held yet) when the heartbeat comes.
        let pending = ledger.scope("key:k");
        ledger.heartbeat().await;
        assert!(
            Arc::ptr_eq(&pending, &ledger.scope("key:k")),
            "a spender in use was forgotten"
        );
        drop(pending);
        let who = [spender("key:k")];
        let first = ledger.reserve(&who, 1_000).await.unwrap();
        ledger.heartbeat().await;
        let second = ledger.reserve(&who, 1_000).await.unwrap();
        ledger.heartbeat().await;
        let third = ledger.reserve(&who, 1_000).await;
        assert!(
            matches!(third, Err(BudgetError::Exceeded { .. })),
            "a third reservation fit a budget of two"
        );
        // Settled below its reservation: in the store when settling
        // returns, and the difference is free again.
        first.settle(400, None).await;
        let b = s.budget("key:k", now_ms()).await.unwrap().unwrap();
        assert_eq!((b.spent_nanos, b.calls), (400, 1));
        assert!(ledger.reserve(&who, 1_000).await.is_err(), "600 left");
        drop(second);
        let again = ledger.reserve(&who, 1_000).await.unwrap();
        assert!(ledger.reserve(&who, 1_000).await.is_err(), "600 left");
        drop(again);
        // Released, not settled: nothing was spent for them.
        let b = s.budget("key:k", now_ms()).await.unwrap().unwrap();
        assert_eq!(b.spent_nanos, 400);
        let _ = std::fs::remove_dir_all(dir);
    }

    /// Two ledgers (two replicas) on one store are never granted more
    /// together than the budget, and a dead one's grant goes back when its
    /// lease ends.
    #[tokio::test]
    async fn replicas_share_a_budget_and_a_dead_ones_grant_expires() {
        let (s, dir) = store().await;
        s.set_budget("key:k", Some(10_000), None, now_ms())
            .await
            .unwrap();
        let a = Ledger::new(s.clone(), Duration::from_millis(400));
        let b = Ledger::new(s.clone(), Duration::from_millis(400));
        let who = [spender("key:k")];
        let mut held = Vec::new();
        let mut fits = 0;
        for i in 0..40 {
            let l = if i % 2 == 0 { &a } else { &b };
            if let Ok(r) = l.reserve(&who, 1_000).await {
                held.push(r);
                fits += 1;
            }
        }
        assert_eq!(fits, 10);
        // `a` dies with its reservations: forget them without releasing.
        let (from_a, from_b): (Vec<_>, Vec<_>) =
            held.into_iter().partition(|r| Arc::ptr_eq(&r.ledger, &a));
        std::mem::forget(from_a);
        assert!(b.reserve(&who, 1_000).await.is_err());
        tokio::time::sleep(Duration::from_millis(500)).await;
        b.heartbeat().await;
        let mut after = 0;
        let mut kept = Vec::new();
        while let Ok(r) = b.reserve(&who, 1_000).await {
            kept.push(r);
            after += 1;
        }
        assert_eq!(after, 10 - from_b.len());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn an_answer_without_usage_costs_its_reservation() {
        let t = Tokens {
            input: 1_000,
            cached_input: 0,
            output: 500,
        };
        assert_eq!(real_cost(&price(), Some(&t), 99), 2_000_000);
        assert_eq!(real_cost(&price(), None, 99), 99);
    }
}
