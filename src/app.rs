//! Start-up and shutdown: [`App::build`] turns a validated [`Config`] into a
//! bound listener and a running gateway; [`App::run`] serves until the
//! shutdown future resolves, then drains.
//!
//! Tests build an `App` on port 0 and read [`App::port`]; `main` does the
//! same with the configured address.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::ResultCache;
use crate::config::{Config, SharedBackend};
use crate::flight::Coalescer;
use crate::flight::redis::RedisFlights;
use crate::http::validate::Limits;
use crate::http::{AppState, Shared, router};
use crate::jobs::{Jobs, executor, reconciler};
use crate::live::{Live, LiveConfig, Loader};
use crate::metrics::Metrics;
use crate::reqlog::RequestLog;
use crate::store::sqlite::ServeLock;
use crate::task::Core;
use crate::telemetry::Telemetry;

/// A gateway ready to serve.
pub struct App {
    listener: TcpListener,
    state: AppState,
    /// This gateway's exclusive use of its SQLite file, held until it stops.
    serve_lock: Option<ServeLock>,
}

impl App {
    /// Opens the store (running migrations), builds the providers and routes,
    /// and binds the listener.
    pub async fn build(config: Config) -> anyhow::Result<App> {
        let addr = config.listen_addr()?;
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("cannot listen on {addr}"))?;
        App::with_listener(config, listener).await
    }

    /// Like [`App::build`] with a listener bound by the caller.
    pub async fn with_listener(config: Config, listener: TcpListener) -> anyhow::Result<App> {
        let config = Arc::new(config);
        let url = &config.storage.url;
        // Before anything reads the file: the start-up reconciler treats
        // every attempt in flight as a dead process's, true only if no
        // other gateway uses the file.
        let serve_lock = if url.starts_with("sqlite:") {
            ServeLock::acquire(url)
                .with_context(|| format!("cannot open storage {}", redact(url)))?
        } else {
            None
        };
        let store = crate::store::connect_with(
            url,
            config.storage.max_connections,
            config.batches.files_dir.as_deref(),
        )
        .await
        .with_context(|| format!("cannot open storage {}", redact(url)))?;
        let metrics = Arc::new(Metrics::new(&config));
        let live = Live::build(config.clone(), &metrics, None)?;
        if let Err(e) = crate::certification::registry::refresh(&*store, &live.routes).await {
            tracing::warn!(error = %e, "cannot read certifications: no fallback counts as certified yet");
        }
        let cache = Arc::new(ResultCache::new(
            config.coalescing.cache_capacity,
            config.coalescing.cache_max_bytes,
        )?);
        crate::cache::spawn_housekeeper(&cache, crate::cache::HOUSEKEEPING_EVERY)
            .context("cannot start the cache upkeep thread")?;
        let coalescer = Coalescer::new(cache, metrics.clone());
        let backend = config
            .coalescing
            .shared_backend()
            .map_err(|m| anyhow::anyhow!("coalescing.backend: {m}"))?;
        if backend != SharedBackend::Memory {
            connect_shared(&config, backend, &coalescer, &metrics).await;
        }
        if live.keyring.is_open() {
            tracing::warn!(
                "no [[tenants]] configured: every request is served as tenant \"{}\"",
                crate::tenants::ANONYMOUS_TENANT
            );
        }
        let limits = Limits {
            max_body_bytes: config.server.max_body_bytes,
            max_json_depth: config.server.max_json_depth,
            max_messages: config.server.max_messages,
            max_json_values: config.server.max_json_values,
        };
        let jobs = Arc::new(Jobs::new(store.clone()));
        let batches = Arc::new(crate::batches::Batches::new(store.clone()));
        let keys = Arc::new(crate::keys::KeyTable::new());
        keys.refresh(&*store, true)
            .await
            .context("cannot read the API keys from the store")?;
        let ledger = crate::budgets::Ledger::new(store.clone(), config.budgets.lease);
        crate::budgets::set_tenant_budgets(&*store, &config)
            .await
            .context("cannot write the tenants' budgets to the store")?;
        let reqlog = RequestLog::from_config(&config.log)?;
        if let Some(dropped) = reqlog.dropped_lines() {
            metrics.watch_log_drops("file", dropped);
        }
        let telemetry = if config.telemetry.otlp_endpoint.is_some() {
            let t = Telemetry::from_config(&config.telemetry, metrics.spans_dropped())?;
            tracing::info!(url = %config.telemetry.traces_url().unwrap_or_default(), "traces: exporting spans over OTLP/HTTP");
            t
        } else {
            Telemetry::off()
        };
        let core = Core {
            telemetry: Arc::new(telemetry),
            coalescer,
            metrics: metrics.clone(),
            reqlog: Arc::new(reqlog),
            background: TaskTracker::new(),
        };
        let state = AppState(Arc::new(Shared {
            live: LiveConfig::new(live),
            core,
            metrics,
            store,
            jobs,
            batches,
            limits,
            intake: crate::http::intake::Intake::new(config.server.max_inflight_body_bytes),
            timeline: crate::timeline::Timeline::new(),
            kept: crate::conversations::Kept::new(),
            keys,
            ledger,
        }));
        Ok(App {
            listener,
            state,
            serve_lock,
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub fn port(&self) -> u16 {
        self.local_addr().map(|a| a.port()).unwrap_or(0)
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Lets this gateway reload its configuration with `loader` (SIGHUP,
    /// `POST /v1/admin/reload`).
    pub fn reload_from(self, loader: Loader) -> App {
        self.state.live.reload_from(loader);
        self
    }

    /// Serves until `shutdown` resolves, then stops accepting, lets requests
    /// in progress finish within `server.shutdown_grace`, and stops the
    /// workers. Attempts that cannot finish are left to the reconciler of
    /// the next start (they become `unknown`, never `failed`).
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let App {
            listener,
            state,
            serve_lock,
        } = self;
        // The server's own settings never change in a reload.
        let started = state.live.load().config.clone();
        let grace = started.server.shutdown_grace;
        let stop = CancellationToken::new();
        // The workers, the reconciler, the registry and what requests leave
        // behind: one tracker, waited for within the grace.
        let tracker = state.core.background.clone();

        let env = state.job_env();
        reconciler::on_startup(&env).await;
        executor::spawn(&env, &stop, &tracker);
        crate::batches::driver::spawn(&state.batch_env(), &stop, &tracker);
        tracker.spawn(reconciler::run(env, stop.clone()));
        // The dashboard's last hour, sampled every 10 s.
        let app = state.clone();
        tracker.spawn(crate::timeline::run(stop.clone(), move || {
            crate::timeline::sample(&app.metrics, &app.timeline, &app.live.load().routes);
        }));
        // The store's keys, read again when they change; the budgets'
        // grants, renewed.
        tracker.spawn(crate::keys::run(
            state.keys.clone(),
            state.store.clone(),
            state.metrics.clone(),
            started.budgets.keys_refresh,
            stop.clone(),
        ));
        tracker.spawn(crate::budgets::run(
            state.ledger.clone(),
            started.budgets.flush_interval,
            stop.clone(),
        ));
        let (app, stop_refresh) = (state.clone(), stop.clone());
        let started_refresh = started.contracts.refresh_interval;
        tracker.spawn(async move {
            let every = started_refresh;
            let routes = || app.live.load();
            crate::certification::registry::run(&*app.store, routes, every, stop_refresh).await;
        });

        if state.live.can_reload() {
            // Listening before the listening line: a SIGHUP from then on
            // reloads, never ends the process (its default action).
            #[cfg(unix)]
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                Ok(hangups) => {
                    tracker.spawn(reload_on_hangup(state.clone(), hangups, stop.clone()));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "cannot listen for SIGHUP: reload with POST /v1/admin/reload");
                }
            }
        }

        let addr = listener.local_addr()?;
        tracing::info!(%addr, source = %started.source, "idem listening");
        say_where_things_are(&started, addr);
        let server_stop = stop.clone();
        let connections = state.metrics.connections.clone();
        let bounds = crate::http::server::Bounds::from_config(&started.server);
        let serve = crate::http::server::serve(
            listener,
            router(state.clone()),
            connections,
            bounds,
            async move {
                shutdown.await;
                tracing::info!("shutting down: no new connections");
                server_stop.cancel();
            },
        );
        let mut server = tokio::spawn(serve);
        // Wait for the signal (or a server failure), then give connections
        // in progress their grace.
        tokio::select! {
            () = stop.cancelled() => {}
            ended = &mut server => {
                stop.cancel();
                tracker.close();
                return ended.context("server task failed");
            }
        }
        tracker.close();
        let drained = tokio::time::timeout(grace, async {
            let served = server.await;
            tracker.wait().await;
            served
        })
        .await;
        // What is still queued goes to the collector, within its timeout,
        // off the runtime's threads.
        let telemetry = state.core.telemetry.clone();
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
        match drained {
            Ok(Ok(())) => tracing::info!("stopped"),
            Ok(Err(e)) => return Err(e).context("server task failed"),
            Err(_) => tracing::warn!(
                ?grace,
                "shutdown grace ran out; unfinished attempts will be unknown"
            ),
        }
        // Held to the end: the next gateway on the file may start now.
        drop(serve_lock);
        Ok(())
    }
}

/// After the listening line: where the dashboard is (and, without an admin
/// key, how to get one: the page cannot be opened without), and where the
/// request log goes, which `idem analyze` reads.
fn say_where_things_are(config: &Config, addr: SocketAddr) {
    // A wildcard address is reached on loopback from this machine.
    let host = match addr.ip() {
        ip if !ip.is_unspecified() => ip,
        std::net::IpAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
        std::net::IpAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
    };
    let url = format!("http://{}/ui", SocketAddr::new(host, addr.port()));
    if config.admin.api_keys.is_empty() {
        tracing::info!(
            %url,
            admin_key = "none configured: set one to sign in, e.g. IDEM_ADMIN__API_KEYS='[\"a-long-random-key\"]', or [admin] api_keys",
            "dashboard"
        );
    } else {
        tracing::info!(%url, admin_key = "configured: sign in with it", "dashboard");
    }
    match config.log.requests.as_str() {
        "stdout" => tracing::info!(
            to = "stdout",
            note = "one line per request among these lines; `idem serve > idem.log`, then `idem analyze idem.log`",
            "request log"
        ),
        "off" => tracing::info!(to = "off", "request log"),
        file => {
            let path = std::path::absolute(file).unwrap_or_else(|_| file.into());
            tracing::info!(to = %path.display(), note = "`idem analyze` reads it", "request log");
        }
    }
}

/// Connects the Redis layer. If Redis is down at start-up the gateway
/// starts anyway (coalescing locally) and keeps trying in the background.
async fn connect_shared(
    config: &Config,
    backend: SharedBackend,
    coalescer: &Coalescer,
    metrics: &Arc<Metrics>,
) {
    let c = &config.coalescing;
    let connect = {
        let (backend, prefix, timeout, poll, metrics) = (
            backend,
            c.redis_prefix.clone(),
            c.redis_timeout,
            c.redis_poll,
            metrics.clone(),
        );
        move || {
            let (backend, prefix, metrics) = (backend.clone(), prefix.clone(), metrics.clone());
            async move { RedisFlights::connect(&backend, &prefix, timeout, poll, metrics).await }
        }
    };
    match connect().await {
        Ok(shared) => {
            shared.evicts_from(coalescer.cache.clone());
            let _ = coalescer.shared.set(shared);
            tracing::info!(backend = %redact(&c.backend), "coalescing across replicas through redis");
        }
        Err(e) => {
            metrics.redis_errors.increment(1);
            tracing::warn!(error = %e, "redis unavailable at start-up: coalescing locally until it answers");
            let slot = coalescer.shared.clone();
            let metrics = metrics.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    match connect().await {
                        Ok(shared) => {
                            let _ = slot.set(shared);
                            tracing::info!("redis answers again: coalescing across replicas");
                            return;
                        }
                        Err(_) => metrics.redis_errors.increment(1),
                    }
                }
            });
        }
    }
}

/// A storage URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let userinfo = &url[s + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{}:***{}", &url[..s + 3], user, &url[at..]),
                None => url.to_string(),
            }
        }
        _ => url.to_string(),
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// Reloads the configuration at each SIGHUP until `stop` (a refused
/// reload is logged and counted by the reload itself).
#[cfg(unix)]
async fn reload_on_hangup(
    state: AppState,
    mut hangups: tokio::signal::unix::Signal,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            got = hangups.recv() => if got.is_none() { return },
        }
        tracing::info!("SIGHUP: reloading the configuration");
        let _ = state.live.reload(&state.metrics, &*state.store).await;
    }
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn passwords_never_reach_messages() {
        assert_eq!(
            redact("postgres://idem:s3cret@db:5432/x"),
            "postgres://idem:***@db:5432/x"
        );
        assert_eq!(redact("sqlite://idem.db"), "sqlite://idem.db");
    }
}
