//! Routes: a public model name mapped to its ordered targets and policies,
//! resolved once at start-up so the request path never looks a provider up
//! by name. Each route also watches its leaders' latency, from which
//! `coalesce.max_wait = "auto"` is derived, and carries its compiled
//! contract; each target carries its circuit breaker and its latest
//! certification (see [`crate::contracts`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::config::{Config, MaxWait, ProviderKind, RouteConfig, RouteEndpoint, TargetConfig};
use crate::contracts::CertSlot;
use crate::contracts::{Contract, ContractError};
use crate::fingerprint::Rules;
use crate::metrics::Metrics;
use crate::prices::Price;
use crate::providers::breaker::Breaker;
use crate::providers::{Endpoint, Provider, Providers};

/// One target of a route: a provider and the model name it is sent.
#[derive(Debug)]
pub struct Target {
    pub index: usize,
    pub provider: Arc<Provider>,
    pub model: Arc<str>,
    /// The health of this provider + model, shared by every route using it.
    pub breaker: Arc<Breaker>,
    /// The latest certification of this target for the route's contract.
    pub certificate: CertSlot,
    /// What its tokens cost (None: unknown).
    pub price: Option<Price>,
}

/// A route, ready for the request path.
#[derive(Debug)]
pub struct Route {
    pub name: Arc<str>,
    pub config: RouteConfig,
    pub targets: Vec<Target>,
    pub latency: LatencyTracker,
    /// The route's contract: answers are checked against it, and failover
    /// goes only to targets certified for its hash.
    pub contract: Option<Arc<Contract>>,
    /// What a leader may spend on the shared (Redis) layer before it calls
    /// the provider: `coalescing.redis_timeout` with a Redis backend, else
    /// zero. An automatic wait allows for it.
    pub shared_delay: Duration,
    /// Each target's provider kind (for the fingerprint).
    pub kinds: Vec<ProviderKind>,
}

impl Route {
    /// How long a follower waits for its leader's first byte.
    pub fn max_wait(&self) -> Duration {
        match self.config.coalesce.max_wait {
            MaxWait::Fixed(d) => d,
            MaxWait::Auto => {
                let ceiling = self
                    .targets
                    .first()
                    .map(|t| t.provider.timeout)
                    .unwrap_or(Duration::from_secs(30));
                let floor = Duration::from_millis(300).min(ceiling);
                // A leader reaches the provider after its Redis step (up
                // to the Redis timeout when Redis is slow): its followers
                // wait for that too, or a slow Redis would time them out.
                let wait = match self.latency.p99() {
                    // Nothing observed yet: wait as long as a leader may take.
                    None => ceiling,
                    Some(p99) => p99.mul_f64(1.5).clamp(floor, ceiling),
                };
                wait + self.shared_delay
            }
        }
    }

    /// Whether this route serves `endpoint`.
    pub fn serves(&self, endpoint: Endpoint) -> bool {
        let wanted = match endpoint {
            Endpoint::Chat => RouteEndpoint::Chat,
            Endpoint::Embeddings => RouteEndpoint::Embeddings,
        };
        self.config.endpoints.contains(&wanted)
    }

    /// The price of the target whose answer this is (by its provider and
    /// upstream model): what a request answered without a call of its own
    /// saved.
    pub fn price_of(&self, provider: &str, model: &str) -> Option<Price> {
        self.targets
            .iter()
            .find(|t| &*t.provider.name == provider && &*t.model == model)
            .and_then(|t| t.price)
    }

    pub fn target_configs(&self) -> &[TargetConfig] {
        &self.config.targets
    }

    /// What counts as the same task on this route for `tenant`: the one
    /// place the fingerprint's rules are built from a route.
    pub fn rules<'a>(&'a self, tenant: &'a str) -> Rules<'a> {
        Rules {
            tenant,
            route: &self.name,
            targets: self.target_configs(),
            kinds: &self.kinds,
            normalize: self.config.normalize,
            scope: self.config.scope,
            ignore_fields: &self.config.ignore_fields,
            contract: self.contract.as_ref().map(|c| c.hash.as_str()),
            face: None,
        }
    }
}

/// All routes by public model name.
#[derive(Debug, Default)]
pub struct Routes {
    by_model: HashMap<String, Arc<Route>>,
    order: Vec<Arc<Route>>,
}

#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    #[error("route {route}: provider {provider} is not configured")]
    UnknownProvider { route: String, provider: String },
    #[error("route {route}: {source}")]
    Contract {
        route: String,
        #[source]
        source: ContractError,
    },
}

impl Routes {
    /// Resolves every route, loading and compiling its contract (an invalid
    /// contract file is an error naming the file).
    pub fn from_config(
        config: &Config,
        providers: &Providers,
        metrics: &Metrics,
    ) -> Result<Routes, RouteError> {
        Routes::reusing(config, providers, metrics, None)
    }

    /// Like [`Routes::from_config`], keeping the circuit breakers of
    /// `before` (the routes in force) for each provider + model whose
    /// provider was kept and whose breaker settings did not change: a
    /// reload does not close an open circuit.
    pub fn reusing(
        config: &Config,
        providers: &Providers,
        metrics: &Metrics,
        before: Option<&Routes>,
    ) -> Result<Routes, RouteError> {
        let mut routes = Routes::default();
        let mut breakers: HashMap<(String, String), Arc<Breaker>> = HashMap::new();
        for t in before
            .iter()
            .flat_map(|r| r.iter())
            .flat_map(|r| &r.targets)
        {
            let kept = providers
                .get(&t.provider.name)
                .is_some_and(|p| Arc::ptr_eq(p, &t.provider))
                && t.breaker.settings() == config.breaker_for(&t.provider.name);
            if kept {
                breakers.insert(
                    (t.provider.name.to_string(), t.model.to_string()),
                    t.breaker.clone(),
                );
            }
        }
        for rc in &config.routes {
            let mut targets = Vec::new();
            for (index, t) in rc.targets.iter().enumerate() {
                let provider =
                    providers
                        .get(&t.provider)
                        .ok_or_else(|| RouteError::UnknownProvider {
                            route: rc.model.clone(),
                            provider: t.provider.clone(),
                        })?;
                let breaker = breakers
                    .entry((t.provider.clone(), t.model.clone()))
                    .or_insert_with(|| {
                        Arc::new(Breaker::new(
                            config.breaker_for(&t.provider),
                            metrics.circuit_gauge(&t.provider, &t.model),
                        ))
                    })
                    .clone();
                targets.push(Target {
                    index,
                    provider: provider.clone(),
                    model: Arc::from(t.model.as_str()),
                    breaker,
                    certificate: CertSlot::default(),
                    price: Price::of_target(t.price.as_ref(), provider.kind, &t.model),
                });
            }
            let contract = match &rc.contract {
                None => None,
                Some(path) => Some(Arc::new(Contract::load(path).map_err(|source| {
                    RouteError::Contract {
                        route: rc.model.clone(),
                        source,
                    }
                })?)),
            };
            let kinds = targets.iter().map(|t| t.provider.kind).collect();
            let route = Arc::new(Route {
                name: Arc::from(rc.model.as_str()),
                config: rc.clone(),
                kinds,
                targets,
                latency: LatencyTracker::default(),
                contract,
                shared_delay: match config.coalescing.backend.as_str() {
                    "memory" => Duration::ZERO,
                    _ => config.coalescing.redis_timeout,
                },
            });
            routes.by_model.insert(rc.model.clone(), route.clone());
            routes.order.push(route);
        }
        Ok(routes)
    }

    pub fn get(&self, model: &str) -> Option<&Arc<Route>> {
        self.by_model.get(model)
    }

    /// Routes in configuration order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<Route>> {
        self.order.iter()
    }
}

const WINDOW: usize = 256;
const RECOMPUTE_EVERY: u64 = 16;

/// The recent leader latencies of a route and their p99.
///
/// A short std `Mutex` guards the sample ring: it is taken once per
/// upstream call (never per follower) and never across an await; the p99
/// that followers read is a lock-free atomic.
#[derive(Debug, Default)]
pub struct LatencyTracker {
    ring: Mutex<Vec<u64>>,
    recorded: AtomicU64,
    p99_us: AtomicU64,
}

impl LatencyTracker {
    pub fn record(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let n = self.recorded.fetch_add(1, Ordering::Relaxed);
        let Ok(mut ring) = self.ring.lock() else {
            return;
        };
        if ring.len() < WINDOW {
            ring.push(us);
        } else {
            let slot = usize::try_from(n % WINDOW as u64).unwrap_or(0);
            ring[slot] = us;
        }
        if n < RECOMPUTE_EVERY || n.is_multiple_of(RECOMPUTE_EVERY) {
            let mut sorted = ring.clone();
            drop(ring);
            sorted.sort_unstable();
            let idx = (sorted.len() * 99).div_ceil(100).saturating_sub(1);
            self.p99_us.store(sorted[idx].max(1), Ordering::Relaxed);
        }
    }

    pub fn p99(&self) -> Option<Duration> {
        match self.p99_us.load(Ordering::Relaxed) {
            0 => None,
            us => Some(Duration::from_micros(us)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p99_follows_the_window() {
        let t = LatencyTracker::default();
        assert_eq!(t.p99(), None);
        for _ in 0..99 {
            t.record(Duration::from_millis(100));
        }
        t.record(Duration::from_millis(900));
        let p = t.p99().unwrap();
        assert!(
            p >= Duration::from_millis(100) && p <= Duration::from_millis(900),
            "{p:?}"
        );
        for _ in 0..2 * WINDOW {
            t.record(Duration::from_millis(10));
        }
        assert_eq!(t.p99(), Some(Duration::from_millis(10)));
    }
}
