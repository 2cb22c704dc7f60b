//! The certification registry: each target's latest certification, kept in
//! memory next to the target so the request path asks a lock-light slot,
//! never the store.
//!
//! The store is the truth (`idem certify` may run in another process, or on
//! another replica); [`refresh`] copies it into the slots at start-up,
//! every `contracts.refresh_interval`, and right after an admin certify. A
//! certification counts only for the contract hash it was made for, so an
//! edited contract (or schema) voids it at once, without any store write.

use serde::Serialize;
use serde_json::Value;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

use crate::routes::Routes;
use crate::store::{Certification, Store, StoreError};

/// A target's certification state for the route's current contract.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CertView {
    /// `certified`, `failed` (this contract), `stale` (an older contract's
    /// certificate: it does not count) or `never`.
    pub state: &'static str,
    pub contract_hash: Option<String>,
    pub certified_at: Option<String>,
    pub failures: Value,
}

impl CertView {
    pub fn of(cert: Option<&Certification>, current_hash: &str) -> CertView {
        let Some(c) = cert else {
            return CertView {
                state: "never",
                contract_hash: None,
                certified_at: None,
                failures: Value::Array(vec![]),
            };
        };
        let state = match (c.contract_hash == current_hash, c.passed) {
            (true, true) => "certified",
            (true, false) => "failed",
            (false, _) => "stale",
        };
        CertView {
            state,
            contract_hash: Some(c.contract_hash.clone()),
            certified_at: Some(crate::store::rfc3339(c.certified_at)),
            failures: serde_json::from_str(&c.failures).unwrap_or(Value::Array(vec![])),
        }
    }
}

/// Copies the latest certifications of every contract route from the store
/// into its targets' slots.
pub async fn refresh(store: &dyn Store, routes: &Routes) -> Result<(), StoreError> {
    for route in routes.iter().filter(|r| r.contract.is_some()) {
        let certs = store.certifications(&route.name).await?;
        for t in &route.targets {
            let latest = certs
                .iter()
                .find(|c| c.provider == *t.provider.name && c.model == *t.model)
                .cloned();
            t.certificate.set(latest);
        }
    }
    Ok(())
}

/// Refreshes every `every` (`contracts.refresh_interval`) until `stop`.
/// `routes` gives the routes in force at each refresh (a reload may have
/// replaced them).
pub async fn run<R>(
    store: &dyn Store,
    routes: impl Fn() -> R,
    every: Duration,
    stop: CancellationToken,
) where
    R: std::ops::Deref,
    R::Target: AsRef<Routes>,
{
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let current = routes();
        if let Err(e) = refresh(store, (*current).as_ref()).await {
            tracing::warn!(error = %e, "cannot refresh certifications; keeping the last known");
        }
    }
}
