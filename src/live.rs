//! The configuration in force, and its reload without a restart
//! (docs/design.md, "Reloading the configuration").
//!
//! Tenants and their keys, providers, routes and their contracts live in
//! one [`Live`] snapshot. A request takes the snapshot once, when it is
//! admitted, and keeps it to its end: a reload swaps the snapshot whole,
//! so a request sees one configuration, the one it started with, and the
//! next request the new one. What cannot change under a running gateway
//! (the listener, the store, the coalescing backend, the job workers, the
//! logs, the trace exporter) is refused by a reload with a message that it
//! needs a restart.

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use serde::Serialize;

use crate::config::{Config, ConfigError};
use crate::metrics::Metrics;
use crate::providers::{ProviderError, Providers};
use crate::routes::{Route, RouteError, Routes};
use crate::store::Store;
use crate::tenants::Keyring;

/// One configuration in force, ready for the request path.
pub struct Live {
    pub config: Arc<Config>,
    pub keyring: Keyring,
    pub providers: Providers,
    pub routes: Routes,
}

#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    #[error(transparent)]
    Provider(#[from] ProviderError),
    #[error(transparent)]
    Route(#[from] RouteError),
}

impl Live {
    /// Builds the snapshot of `config`. With `before` (the snapshot in
    /// force), what did not change is kept rather than made anew: providers
    /// (their connection pools), circuit breakers and tenants' token
    /// buckets.
    pub fn build(
        config: Arc<Config>,
        metrics: &Metrics,
        before: Option<&Live>,
    ) -> Result<Live, LiveError> {
        let providers = Providers::reusing(&config, before.map(|b| (&*b.config, &b.providers)))?;
        let routes = Routes::reusing(&config, &providers, metrics, before.map(|b| &b.routes))?;
        let keyring = Keyring::reusing(&config, before.map(|b| &b.keyring));
        Ok(Live {
            config,
            keyring,
            providers,
            routes,
        })
    }

    pub fn route(&self, model: &str) -> Option<Arc<Route>> {
        self.routes.get(model)
    }
}

impl AsRef<Routes> for Live {
    fn as_ref(&self) -> &Routes {
        &self.routes
    }
}

/// How a gateway reads its configuration again: the same file and
/// environment it started from.
pub type Loader = Arc<dyn Fn() -> Result<Config, ConfigError> + Send + Sync>;

/// Why a reload was refused; the configuration in force stays.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    #[error("this gateway was not started from a configuration file; there is nothing to reload")]
    NoSource,
    #[error("{0}")]
    Invalid(#[from] ConfigError),
    #[error("{0}")]
    Build(#[from] LiveError),
    #[error(
        "{} changed, and only a restart applies {}; nothing was reloaded",
        list(.0),
        if .0.len() == 1 { "it" } else { "them" }
    )]
    NeedsRestart(Vec<&'static str>),
}

fn list(sections: &[&'static str]) -> String {
    sections
        .iter()
        .map(|s| format!("[{s}]"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The sections a running gateway cannot take anew: each needs a restart.
fn restart_only(old: &Config, new: &Config) -> Vec<&'static str> {
    let mut changed = Vec::new();
    let mut check = |name, same: bool| {
        if !same {
            changed.push(name);
        }
    };
    check("server", Config::same(&old.server, &new.server));
    check("storage", Config::same(&old.storage, &new.storage));
    check("coalescing", Config::same(&old.coalescing, &new.coalescing));
    check("jobs", Config::same(&old.jobs, &new.jobs));
    check("log", Config::same(&old.log, &new.log));
    check("contracts", Config::same(&old.contracts, &new.contracts));
    check("telemetry", Config::same(&old.telemetry, &new.telemetry));
    // The keys' refresh and the ledger's lease and flush run from the
    // start; the rest of `[budgets]` is read per request.
    let (a, b) = (&old.budgets, &new.budgets);
    check(
        "budgets (keys_refresh, lease, flush_interval)",
        a.keys_refresh == b.keys_refresh
            && a.lease == b.lease
            && a.flush_interval == b.flush_interval,
    );
    changed
}

/// What a reload changed, by name.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct Changes {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    pub changed: Vec<String>,
}

impl Changes {
    fn of<T: Serialize>(old: &[T], new: &[T], name: impl Fn(&T) -> &str) -> Changes {
        let names = |items: &[T]| -> BTreeSet<String> {
            items.iter().map(|i| name(i).to_string()).collect()
        };
        let (before, after) = (names(old), names(new));
        let find = |items: &'_ [T], n: &str| items.iter().position(|i| name(i) == n);
        Changes {
            added: after.difference(&before).cloned().collect(),
            removed: before.difference(&after).cloned().collect(),
            changed: after
                .intersection(&before)
                .filter(|n| match (find(old, n), find(new, n)) {
                    (Some(o), Some(n)) => !Config::same(&old[o], &new[n]),
                    _ => false,
                })
                .cloned()
                .collect(),
        }
    }

    fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.changed.is_empty()
    }
}

/// What a reload did.
#[derive(Debug, Default, Serialize, PartialEq, Eq)]
pub struct Reloaded {
    pub tenants: Changes,
    pub providers: Changes,
    pub routes: Changes,
    /// `[admin]` or `[breaker]` changed.
    pub admin: bool,
    pub breaker: bool,
}

impl Reloaded {
    fn between(old: &Config, new: &Config) -> Reloaded {
        Reloaded {
            tenants: Changes::of(&old.tenants, &new.tenants, |t| &t.name),
            providers: Changes::of(&old.providers, &new.providers, |p| &p.name),
            routes: Changes::of(&old.routes, &new.routes, |r| &r.model),
            admin: !Config::same(&old.admin, &new.admin),
            breaker: !Config::same(&old.breaker, &new.breaker),
        }
    }

    /// True when the new configuration is the one in force.
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
            && self.providers.is_empty()
            && self.routes.is_empty()
            && !self.admin
            && !self.breaker
    }
}

/// The snapshot in force and the way to replace it.
pub struct LiveConfig {
    current: ArcSwap<Live>,
    loader: OnceLock<Loader>,
    /// One reload at a time (a signal and an admin call may race).
    reloading: tokio::sync::Mutex<()>,
}

impl LiveConfig {
    pub fn new(live: Live) -> LiveConfig {
        LiveConfig {
            current: ArcSwap::from_pointee(live),
            loader: OnceLock::new(),
            reloading: tokio::sync::Mutex::new(()),
        }
    }

    /// Where a reload reads the configuration (once; a gateway built from
    /// a configuration in memory has none, and refuses reloads).
    pub fn reload_from(&self, loader: Loader) {
        let _ = self.loader.set(loader);
    }

    /// Whether this gateway can reload.
    pub fn can_reload(&self) -> bool {
        self.loader.get().is_some()
    }

    /// The snapshot in force: a request takes it once and keeps it.
    pub fn load(&self) -> Arc<Live> {
        self.current.load_full()
    }

    /// Reads the configuration again and, if it is valid and changes only
    /// what a running gateway can take, puts it in force at once for every
    /// request that starts from now on. Certifications of the new routes
    /// are read from the store first, so a fallback certified before stays
    /// certified. Counted and logged either way.
    pub async fn reload(
        &self,
        metrics: &Metrics,
        store: &dyn Store,
    ) -> Result<Reloaded, ReloadError> {
        let _one = self.reloading.lock().await;
        let outcome = self.try_reload(metrics, store).await;
        metrics.config_reload(outcome.is_ok());
        match &outcome {
            Ok(done) if done.is_empty() => {
                tracing::info!("configuration reloaded: nothing changed");
            }
            Ok(done) => tracing::info!(
                changes = %serde_json::to_string(done).unwrap_or_default(),
                "configuration reloaded"
            ),
            Err(e) => {
                tracing::error!(error = %e, "configuration reload refused; the configuration in force stays")
            }
        }
        outcome
    }

    async fn try_reload(
        &self,
        metrics: &Metrics,
        store: &dyn Store,
    ) -> Result<Reloaded, ReloadError> {
        let loader = self.loader.get().ok_or(ReloadError::NoSource)?;
        let config = loader()?;
        let before = self.load();
        let needs_restart = restart_only(&before.config, &config);
        if !needs_restart.is_empty() {
            return Err(ReloadError::NeedsRestart(needs_restart));
        }
        let done = Reloaded::between(&before.config, &config);
        let live = Live::build(Arc::new(config), metrics, Some(&before))?;
        for warning in live.config.warnings() {
            tracing::warn!(source = %live.config.source, "{warning}");
        }
        if live.keyring.is_open() && !before.keyring.is_open() {
            tracing::warn!(
                "the reloaded configuration has no [[tenants]]: every request is now served as tenant \"{}\"",
                crate::tenants::ANONYMOUS_TENANT
            );
        }
        if let Err(e) = crate::budgets::set_tenant_budgets(store, &live.config).await {
            tracing::warn!(error = %e, "cannot write the tenants' budgets to the store; the budgets written before stay in force");
        }
        if let Err(e) = crate::certification::registry::refresh(store, &live.routes).await {
            tracing::warn!(error = %e, "cannot read certifications for the reloaded routes; no fallback counts as certified until the next refresh");
        }
        metrics.adopt(&live.config);
        self.current.store(Arc::new(live));
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Source;

    fn config(text: &str) -> Config {
        Config::from_toml_str(text, Source::Embedded, false).unwrap()
    }

    #[test]
    fn the_budgets_timers_need_a_restart_and_their_rules_do_not() {
        let old = config(BASE);
        let ruled = config(&format!(
            "[budgets]\ndefault_max_output_tokens = 100\nunpriced = \"allow\"\n{BASE}"
        ));
        assert!(restart_only(&old, &ruled).is_empty());
        for timer in [
            "lease = \"20s\"",
            "keys_refresh = \"1s\"",
            "flush_interval = \"200ms\"",
        ] {
            let timed = config(&format!("[budgets]\n{timer}\n{BASE}"));
            assert_eq!(
                restart_only(&old, &timed),
                ["budgets (keys_refresh, lease, flush_interval)"],
                "{timer}"
            );
        }
    }

    const BASE: &str = r#"
[[tenants]]
name = "a"
api_keys = ["key-aaaaaaaa"]
[[providers]]
name = "p"
kind = "mock"
[[routes]]
model = "m"
targets = [{ provider = "p", model = "x" }]
"#;

    #[test]
    fn sections_a_running_gateway_cannot_take_are_named() {
        let old = config(BASE);
        let moved = config(&format!("[server]\nlisten = \"127.0.0.1:9\"\n{BASE}"));
        assert_eq!(restart_only(&old, &moved), vec!["server"]);
        let stored = config(&format!(
            "[storage]\nurl = \"sqlite://elsewhere.db\"\n[jobs]\nworkers = 3\n{BASE}"
        ));
        assert_eq!(restart_only(&old, &stored), vec!["storage", "jobs"]);
        let e = ReloadError::NeedsRestart(vec!["server", "storage"]);
        assert_eq!(
            e.to_string(),
            "[server], [storage] changed, and only a restart applies them; nothing was reloaded"
        );
        // Tenants, providers and routes are not among them.
        let more = config(&format!(
            "{BASE}\n[[tenants]]\nname = \"b\"\napi_keys = [\"key-bbbbbbbb\"]\n"
        ));
        assert!(restart_only(&old, &more).is_empty());
    }

    #[test]
    fn changes_are_named_by_kind() {
        let old = config(BASE);
        let new = config(
            &BASE
                .replace(
                    "targets = [{ provider = \"p\", model = \"x\" }]",
                    "targets = [{ provider = \"p\", model = \"y\" }]\n[routes.cache]\nttl = \"5s\"",
                )
                .replace("name = \"a\"", "name = \"b\""),
        );
        let done = Reloaded::between(&old, &new);
        assert_eq!(done.tenants.added, vec!["b"]);
        assert_eq!(done.tenants.removed, vec!["a"]);
        assert_eq!(done.routes.changed, vec!["m"]);
        assert!(done.providers.is_empty());
        assert!(Reloaded::between(&old, &old).is_empty());
    }

    #[test]
    fn what_did_not_change_is_kept_and_the_rest_made_anew() {
        let old = config(BASE);
        let metrics = Metrics::new(&old);
        let before = Live::build(Arc::new(old), &metrics, None).unwrap();
        let with_b = format!(
            "{BASE}\n[[providers]]\nname = \"q\"\nkind = \"mock\"\n[[routes]]\nmodel = \"n\"\ntargets = [{{ provider = \"q\", model = \"x\" }}, {{ provider = \"p\", model = \"x\" }}]\n"
        );
        let after = Live::build(Arc::new(config(&with_b)), &metrics, Some(&before)).unwrap();
        let (p0, p1) = (
            before.providers.get("p").unwrap(),
            after.providers.get("p").unwrap(),
        );
        assert!(Arc::ptr_eq(p0, p1), "an unchanged provider is kept");
        assert!(
            std::ptr::eq(
                before.keyring.limits("a").unwrap(),
                after.keyring.limits("a").unwrap()
            ),
            "an unchanged tenant keeps its token bucket"
        );
        let old_breaker = &before.routes.get("m").unwrap().targets[0].breaker;
        let new_route = after.routes.get("n").unwrap();
        assert!(
            Arc::ptr_eq(old_breaker, &new_route.targets[1].breaker),
            "p/x keeps its breaker, on every route that uses it"
        );
        // A provider whose settings change is made anew, and so is its
        // breaker.
        let slower = with_b.replacen("kind = \"mock\"", "kind = \"mock\"\ntimeout = \"7s\"", 1);
        let third = Live::build(Arc::new(config(&slower)), &metrics, Some(&after)).unwrap();
        assert!(!Arc::ptr_eq(p1, third.providers.get("p").unwrap()));
        let limited = slower.replacen(
            "api_keys = [\"key-aaaaaaaa\"]",
            "api_keys = [\"key-aaaaaaaa\"]\nrate_limit = { requests_per_second = 5.0, burst = 5 }",
            1,
        );
        let fourth = Live::build(Arc::new(config(&limited)), &metrics, Some(&third)).unwrap();
        assert!(
            !std::ptr::eq(
                third.keyring.limits("a").unwrap(),
                fourth.keyring.limits("a").unwrap()
            ),
            "a changed rate limit is a new bucket"
        );
        assert!(!Arc::ptr_eq(
            old_breaker,
            &third.routes.get("m").unwrap().targets[0].breaker
        ));
    }
}
