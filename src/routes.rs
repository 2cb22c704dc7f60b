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

use crate::config::{
    Config, MODEL_PLACEHOLDER, MaxWait, ProviderKind, RouteConfig, RouteEndpoint, TargetConfig,
};
use crate::contracts::CertSlot;
use crate::contracts::{Contract, ContractError};
use crate::dialect::Dialect;
use crate::fingerprint::Rules;
use crate::metrics::Metrics;
use crate::prices::Price;
use crate::providers::breaker::Breaker;
use crate::providers::{Provider, Providers};

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
    /// The route's name in metrics and logs: its configured model (for a
    /// pattern route, the pattern).
    pub name: Arc<str>,
    /// The model name a client asks for: the route's name, or for a pattern
    /// route the name it matched (what its fingerprint and its jobs keep).
    pub model: Arc<str>,
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
    /// This pattern route made for the asked `model`: each target's
    /// `{model}` replaced by it, with a breaker and a price of its own.
    fn instance(&self, model: &str) -> Route {
        let targets = self
            .targets
            .iter()
            .map(|t| {
                let upstream = t.model.replace(MODEL_PLACEHOLDER, model);
                let price = self
                    .config
                    .targets
                    .get(t.index)
                    .and_then(|c| c.price.as_ref());
                Target {
                    index: t.index,
                    provider: t.provider.clone(),
                    breaker: if *t.model == *upstream {
                        t.breaker.clone()
                    } else {
                        Arc::new(Breaker::new(t.breaker.settings(), t.breaker.gauge()))
                    },
                    certificate: CertSlot::default(),
                    price: Price::of_target(price, t.provider.kind, &upstream),
                    model: Arc::from(upstream),
                }
            })
            .collect();
        let mut config = self.config.clone();
        for t in &mut config.targets {
            t.model = t.model.replace(MODEL_PLACEHOLDER, model);
        }
        Route {
            name: self.name.clone(),
            model: Arc::from(model),
            config,
            targets,
            latency: LatencyTracker::default(),
            contract: self.contract.clone(),
            shared_delay: self.shared_delay,
            kinds: self.kinds.clone(),
        }
    }

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

    /// Whether this route serves requests of `dialect`: a route that
    /// serves chat completions serves every conversation dialect (Messages,
    /// Responses, token counts), each sent as it is or translated for its
    /// targets.
    pub fn serves(&self, dialect: Dialect) -> bool {
        let wanted = match dialect {
            Dialect::Embeddings => RouteEndpoint::Embeddings,
            _ => RouteEndpoint::Chat,
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
            route: &self.model,
            targets: self.target_configs(),
            kinds: &self.kinds,
            normalize: self.config.normalize,
            scope: self.config.scope,
            ignore_fields: &self.config.ignore_fields,
            contract: self.contract.as_ref().map(|c| c.hash.as_str()),
            dialect: Dialect::Chat,
            headers: &crate::fingerprint::NO_HEADERS,
        }
    }
}

/// All routes by public model name: exact names first, then patterns
/// (`claude-*`), the longest matching one, instantiated for the name asked.
#[derive(Debug, Default)]
pub struct Routes {
    by_model: HashMap<String, Arc<Route>>,
    order: Vec<Arc<Route>>,
    /// Pattern routes, longest pattern first.
    patterns: Vec<Arc<Route>>,
    /// The routes made of patterns for the names asked lately (bounded: a
    /// client may ask any name a pattern matches).
    instances: Instances,
}

/// How many names asked of pattern routes keep their route (its circuit
/// breakers, its observed latency); past it, the least used are made anew.
const INSTANCES: usize = 1024;

struct Instances(quick_cache::sync::Cache<Arc<str>, Arc<Route>>);

impl Default for Instances {
    fn default() -> Self {
        Instances(quick_cache::sync::Cache::new(INSTANCES))
    }
}

impl std::fmt::Debug for Instances {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Instances({})", self.0.len())
    }
}

/// True when `name` matches `pattern`, whose `*` stand for any text.
pub fn matches_pattern(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    for (i, part) in parts.iter().enumerate() {
        if i + 1 == parts.len() {
            return rest.ends_with(part);
        }
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.is_empty()
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
                model: Arc::from(rc.model.as_str()),
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
            if rc.is_pattern() {
                routes.patterns.push(route.clone());
            } else {
                routes.by_model.insert(rc.model.clone(), route.clone());
            }
            routes.order.push(route);
        }
        // The longest pattern wins (`claude-opus-*` over `claude-*`).
        routes
            .patterns
            .sort_by_key(|r| std::cmp::Reverse(r.name.len()));
        Ok(routes)
    }

    /// The route of model `model`: the route that names it, else the
    /// longest pattern that matches it, made for it (the asked name goes on
    /// to each target whose model is `{model}`).
    pub fn get(&self, model: &str) -> Option<Arc<Route>> {
        if let Some(r) = self.by_model.get(model) {
            return Some(r.clone());
        }
        let template = self
            .patterns
            .iter()
            .find(|r| matches_pattern(&r.name, model))?;
        // Each reload builds new routes, with an empty set of instances.
        if let Some(made) = self.instances.0.get(model) {
            return Some(made);
        }
        let made = Arc::new(template.instance(model));
        self.instances.0.insert(Arc::from(model), made.clone());
        Some(made)
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
    use crate::config::Source;
    use crate::providers::Providers;

    fn routes(toml: &str) -> Routes {
        let config = Config::from_toml_str(toml, Source::Embedded, false).unwrap();
        let metrics = Metrics::new(&config);
        let providers = Providers::from_config(&config).unwrap();
        Routes::from_config(&config, &providers, &metrics).unwrap()
    }

    const PATTERNS: &str = r#"
[[providers]]
name = "p"
kind = "mock"

[[routes]]
model = "claude-*"
targets = [{ provider = "p", model = "{model}" }]

[[routes]]
model = "claude-opus-*"
targets = [{ provider = "p", model = "opus-{model}" }, { provider = "p", model = "fixed" }]

[[routes]]
model = "claude-opus-4-8"
targets = [{ provider = "p", model = "exact" }]

[[routes]]
model = "*-mini"
targets = [{ provider = "p", model = "{model}" }]
"#;

    #[test]
    fn a_pattern_matches_any_text_for_each_star() {
        for (pattern, name, hit) in [
            ("claude-*", "claude-haiku-4-5-20251001", true),
            ("claude-*", "claude-", true),
            ("claude-*", "gpt-4o", false),
            ("*-mini", "gpt-4o-mini", true),
            ("*-mini", "gpt-4o-mini-2", false),
            ("a*b*c", "a-x-b-y-c", true),
            ("a*b*c", "a-x-c", false),
            ("a*a", "a", false),
            ("*", "", true),
        ] {
            assert_eq!(matches_pattern(pattern, name), hit, "{pattern} ~ {name}");
        }
    }

    /// An exact route wins over a pattern, the longest pattern over a
    /// shorter one; the asked name goes on where a target says `{model}`,
    /// and the route keeps it (what the fingerprint and jobs use), while its
    /// name in metrics stays the pattern (bounded, whatever clients ask).
    #[test]
    fn exact_names_win_then_the_longest_pattern_made_for_the_name() {
        let routes = routes(PATTERNS);
        let exact = routes.get("claude-opus-4-8").unwrap();
        assert_eq!(&*exact.name, "claude-opus-4-8");
        assert_eq!(&*exact.targets[0].model, "exact");

        let opus = routes.get("claude-opus-5").unwrap();
        assert_eq!(&*opus.name, "claude-opus-*");
        assert_eq!(&*opus.model, "claude-opus-5");
        let models: Vec<&str> = opus.targets.iter().map(|t| &*t.model).collect();
        assert_eq!(models, ["opus-claude-opus-5", "fixed"]);
        assert_eq!(opus.config.targets[0].model, "opus-claude-opus-5");

        let haiku = routes.get("claude-haiku-4-5-20251001").unwrap();
        assert_eq!(&*haiku.name, "claude-*");
        assert_eq!(&*haiku.targets[0].model, "claude-haiku-4-5-20251001");
        let rules = haiku.rules("acme");
        assert_eq!(rules.route, "claude-haiku-4-5-20251001");

        assert_eq!(&*routes.get("gpt-4o-mini").unwrap().name, "*-mini");
        assert!(routes.get("gpt-4o").is_none());
    }

    /// A name asked again gets the same route (its breakers and latency);
    /// a target whose model does not depend on the name shares the
    /// pattern's breaker, one that does has its own.
    #[test]
    fn a_name_asked_again_keeps_its_route_and_its_breakers() {
        let routes = routes(PATTERNS);
        let a = routes.get("claude-opus-5").unwrap();
        let b = routes.get("claude-opus-5").unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        let other = routes.get("claude-opus-6").unwrap();
        assert!(!Arc::ptr_eq(
            &a.targets[0].breaker,
            &other.targets[0].breaker
        ));
        assert!(Arc::ptr_eq(
            &a.targets[1].breaker,
            &other.targets[1].breaker
        ));
    }

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
