//! Certified failover: the one rule that decides whether automatic work
//! (a failover, a retry on another target, a hedge) may go to a target.
//!
//! - The primary (the first target) is the operator's explicit choice and
//!   needs no certificate.
//! - On a route with a contract, every other target must hold a passed
//!   certification for the contract's current hash; an uncertified target is
//!   skipped, counted (`idem_failover_blocked_total{route}`) and logged.
//! - On a route without a contract, any target may take the work (today's
//!   behaviour: nothing says its answers differ).
//! - A target whose circuit breaker is open is skipped (not counted as a
//!   blocked failover: it is a health decision, not a safety one).
//!
//! [`Walk`] is the one target loop: a request's failover walks the route's
//! targets once, in order; a job's attempt `i` starts its walk at target
//! `i` mod n and a hedge at the target after its attempt's, each taking the
//! first target the rule admits.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::metrics::Metrics;
use crate::providers::breaker::Admit;
use crate::routes::{Route, Target};

/// Why a target was passed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Not certified for the route's current contract hash.
    Uncertified { contract: String },
    /// Its circuit is open; a probe may go after `retry_in`.
    CircuitOpen { retry_in: Duration },
}

/// A target that was passed over, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    pub index: usize,
    pub provider: Arc<str>,
    pub model: Arc<str>,
    pub skip: Skip,
}

impl fmt::Display for Skipped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (p, m) = (&self.provider, &self.model);
        match &self.skip {
            Skip::Uncertified { contract } => write!(
                f,
                "failover to {p}/{m} blocked: not certified for the route's contract {}",
                crate::contracts::short_hash(contract)
            ),
            Skip::CircuitOpen { retry_in } => write!(
                f,
                "{p}/{m} skipped: circuit open (a probe may go in {}s)",
                retry_in.as_secs().max(1)
            ),
        }
    }
}

/// No target may take the work now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoTarget(pub Vec<Skipped>);

impl fmt::Display for NoTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("no target may take this request")?;
        for (i, s) in self.0.iter().enumerate() {
            f.write_str(if i == 0 { ": " } else { "; " })?;
            write!(f, "{s}")?;
        }
        Ok(())
    }
}

impl NoTarget {
    /// Seconds until the first open circuit lets a probe through.
    pub fn retry_after(&self) -> Option<u64> {
        self.0
            .iter()
            .filter_map(|s| match s.skip {
                Skip::CircuitOpen { retry_in } => Some(retry_in.as_secs().max(1)),
                Skip::Uncertified { .. } => None,
            })
            .min()
    }
}

/// May failover work go to `target` at all (ignoring its health)? The
/// primary always; on a contract route only a target certified for the
/// contract's current hash.
pub fn certified_for_failover(route: &Route, target: &Target) -> bool {
    match &route.contract {
        None => true,
        Some(_) if target.index == 0 => true,
        Some(c) => target.certificate.valid_for(&c.hash),
    }
}

/// May automatic work go to `target` now? Certification first (a blocked
/// failover is counted and logged), then the breaker, which hands out its
/// probe when half-open: call this only for the target about to be used.
pub fn admit(metrics: &Metrics, route: &Route, target: &Target) -> Result<(), Skipped> {
    let skipped = |skip| Skipped {
        index: target.index,
        provider: target.provider.name.clone(),
        model: target.model.clone(),
        skip,
    };
    if !certified_for_failover(route, target) {
        let contract = route
            .contract
            .as_ref()
            .map(|c| c.hash.clone())
            .unwrap_or_default();
        metrics.failover_blocked(&route.name);
        tracing::warn!(
            route = %route.name,
            provider = %target.provider.name,
            model = %target.model,
            contract = crate::contracts::short_hash(&contract),
            "failover blocked: the target is not certified for the route's contract"
        );
        return Err(skipped(Skip::Uncertified { contract }));
    }
    match target.breaker.admit() {
        Admit::Yes => Ok(()),
        Admit::Probe => {
            tracing::info!(route = %route.name, provider = %target.provider.name, model = %target.model, "circuit half-open: sending the probe");
            Ok(())
        }
        Admit::No { retry_in } => {
            tracing::info!(route = %route.name, provider = %target.provider.name, model = %target.model, "circuit open: target skipped");
            Err(skipped(Skip::CircuitOpen { retry_in }))
        }
    }
}

/// The targets automatic attempts may use on `route`, in order (health
/// aside): the primary, then the certified ones.
pub fn failover_set(route: &Route) -> Vec<usize> {
    route
        .targets
        .iter()
        .filter(|t| certified_for_failover(route, t))
        .map(|t| t.index)
        .collect()
}

/// The targets of a route in the order work may go to them: `count`
/// positions from `start`, wrapping around, each taken only if [`admit`]
/// lets the work go there. What it passed over is kept, for the error when
/// nothing may take the work.
pub struct Walk<'r> {
    route: &'r Route,
    start: usize,
    count: usize,
    k: usize,
    skipped: Vec<Skipped>,
}

impl<'r> Walk<'r> {
    fn new(route: &'r Route, start: usize, count: usize) -> Walk<'r> {
        Walk {
            route,
            start,
            count,
            k: 0,
            skipped: Vec::new(),
        }
    }

    /// A request's failover: every target once, from the primary.
    pub fn once(route: &'r Route) -> Walk<'r> {
        Walk::new(route, 0, route.targets.len())
    }

    /// A job's automatic attempt number `i` (from 0): the route's targets
    /// take turns (`i` mod their number); a target that may not take the
    /// work is skipped for the next one, wrapping around.
    pub fn attempt(route: &'r Route, i: usize) -> Walk<'r> {
        let n = route.targets.len();
        Walk::new(route, i % n.max(1), n)
    }

    /// A hedge beside an attempt on `first`: the targets after it, never
    /// `first` itself.
    pub fn hedge(route: &'r Route, first: usize) -> Walk<'r> {
        let n = route.targets.len();
        Walk::new(route, first + 1, n.saturating_sub(1))
    }

    /// The next target that may take the work now, or `None` when the walk
    /// is over. Ask only when about to use the target: a half-open
    /// circuit hands out its probe here.
    pub fn next(&mut self, metrics: &Metrics) -> Option<&'r Target> {
        let n = self.route.targets.len();
        while self.k < self.count {
            let t = self.route.targets.get((self.start + self.k) % n.max(1))?;
            self.k += 1;
            match admit(metrics, self.route, t) {
                Ok(()) => return Some(t),
                Err(s) => self.skipped.push(s),
            }
        }
        None
    }

    /// True while positions are left to try.
    pub fn has_more(&self) -> bool {
        self.k < self.count
    }

    /// Why nothing (more) could take the work.
    pub fn no_target(self) -> NoTarget {
        NoTarget(self.skipped)
    }

    /// The first target that may take the work, or why none may.
    pub fn first(mut self, metrics: &Metrics) -> Result<usize, NoTarget> {
        match self.next(metrics) {
            Some(t) => Ok(t.index),
            None => Err(self.no_target()),
        }
    }
}
