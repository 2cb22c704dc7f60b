//! `[coalescing]`: where replicas share flights and the result cache, and
//! the in-process cache's bounds.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{ConfigError, Source};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct CoalescingConfig {
    /// `memory`, a `redis://` URL (one server) or
    /// `redis+cluster://host:port,host:port,...` (a Redis Cluster): see
    /// [`CoalescingConfig::shared_backend`].
    pub backend: String,
    /// Prefix of every Redis key idem writes.
    pub redis_prefix: String,
    /// Most entries the in-process result cache holds.
    pub cache_capacity: u64,
    /// Most bytes the in-process result cache holds: each answer weighs its
    /// body (and the other forms rendered from it) plus a fixed overhead.
    pub cache_max_bytes: u64,
    /// Timeout of each Redis operation; past it idem coalesces locally.
    #[serde(with = "humantime_serde")]
    pub redis_timeout: Duration,
    /// How often a replica waiting on another replica's flight looks at it
    /// (completion messages wake it at once; this is the fallback, and how
    /// an expired lease is noticed).
    #[serde(with = "humantime_serde")]
    pub redis_poll: Duration,
}

/// Where replicas share flights and the result cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SharedBackend {
    /// No sharing: this process alone.
    Memory,
    /// One Redis server (a `redis://` or `rediss://` URL, as given).
    Redis(String),
    /// A Redis Cluster: one `redis://` URL per seed node (the cluster's
    /// other nodes are learned from them), each with the credentials given.
    RedisCluster(Vec<String>),
}

/// The scheme of a Redis Cluster backend.
const CLUSTER_SCHEME: &str = "redis+cluster://";

impl CoalescingConfig {
    /// The backend that `backend` names, or why it names none.
    pub fn shared_backend(&self) -> Result<SharedBackend, String> {
        let b = self.backend.as_str();
        if b == "memory" {
            Ok(SharedBackend::Memory)
        } else if b.starts_with("redis://") || b.starts_with("rediss://") {
            Ok(SharedBackend::Redis(b.to_string()))
        } else if let Some(rest) = b.strip_prefix(CLUSTER_SCHEME) {
            cluster_nodes(rest).map(SharedBackend::RedisCluster)
        } else {
            Err(format!(
                "expected \"memory\", a redis:// URL or {CLUSTER_SCHEME}host:port,host:port,..."
            ))
        }
    }

    /// The checks of `[coalescing]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if self.cache_max_bytes == 0 {
            return Err(source.invalid("coalescing.cache_max_bytes", "must be above zero"));
        }
        self.shared_backend()
            .map_err(|m| source.invalid("coalescing.backend", m))?;
        Ok(())
    }
}

/// The seed nodes of `[user[:password]@]host:port,host:port,...[/]`, as
/// `redis://` URLs that all carry the credentials. A cluster has one
/// database and no per-node options, so a path or a query is refused
/// rather than silently dropped.
fn cluster_nodes(rest: &str) -> Result<Vec<String>, String> {
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (userinfo, hosts) = match rest.rsplit_once('@') {
        Some((u, h)) => (format!("{u}@"), h),
        None => (String::new(), rest),
    };
    if hosts.contains(['/', '?', '#']) {
        return Err(format!(
            "a {CLUSTER_SCHEME} URL is a list of host:port and takes no path, database or options"
        ));
    }
    let mut nodes = Vec::new();
    for node in hosts.split(',') {
        let port = node.rsplit_once(':').and_then(|(host, port)| {
            let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
            let plain = !host.is_empty() && !host.contains([':', '[', ']', '@']);
            (bracketed || plain).then_some(port)
        });
        match port.map(str::parse::<u16>) {
            Some(Ok(p)) if p > 0 => nodes.push(format!("redis://{userinfo}{node}")),
            _ => {
                return Err(format!(
                    "{node:?} is not host:port (a {CLUSTER_SCHEME} URL lists the seed nodes, \
                     e.g. {CLUSTER_SCHEME}redis-a:7000,redis-b:7000)"
                ));
            }
        }
    }
    Ok(nodes)
}

impl Default for CoalescingConfig {
    fn default() -> Self {
        Self {
            backend: "memory".into(),
            redis_prefix: "idem".into(),
            cache_capacity: 100_000,
            cache_max_bytes: 256 * 1024 * 1024,
            redis_timeout: Duration::from_millis(250),
            redis_poll: Duration::from_millis(500),
        }
    }
}
