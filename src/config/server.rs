//! `[server]`: the listening address, request limits and timeouts, and the
//! cap on client connections.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use super::{ConfigError, Source};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: String,
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
    pub max_body_bytes: usize,
    /// Deepest JSON nesting accepted in a request body.
    pub max_json_depth: usize,
    /// Most JSON values (objects, arrays, strings, numbers, literals, and
    /// object keys) accepted in a request body: what parsing a body may
    /// cost is a small multiple of this, whatever the body is made of (a
    /// parsed value costs 70 to 180 bytes, an object's hash index
    /// included: 100,000 values are a tree of at most about 18 MiB).
    /// Real requests hold far fewer: a long coding agent's conversation
    /// is a few thousand.
    pub max_json_values: usize,
    /// Bytes of request bodies being read and parsed at once, across all
    /// requests; past it a body waits briefly, then gets a 503 with
    /// `Retry-After`.
    pub max_inflight_body_bytes: usize,
    /// Most `messages` accepted in one chat completion request.
    pub max_messages: usize,
    /// How long a graceful shutdown waits for requests in progress.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Serve without `[[tenants]]` on a non-loopback address (everybody is
    /// tenant `default`). Off by default: an open gateway must be a choice.
    pub allow_anonymous: bool,
    /// How long a request's body may take to arrive, from its head; past it
    /// the answer is 408 and the connection closes (a client trickling a
    /// byte at a time would otherwise hold its request open for ever).
    #[serde(with = "humantime_serde")]
    pub body_timeout: Duration,
    /// Client connections open at once; past it new ones are shed (an
    /// HTTP/1.1 503 and a close) rather than let the process run out of
    /// file descriptors.
    pub max_connections: MaxConnections,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".into(),
            request_timeout: Duration::from_secs(120),
            max_body_bytes: 8 * 1024 * 1024,
            max_json_depth: 64,
            max_json_values: 100_000,
            max_inflight_body_bytes: 64 * 1024 * 1024,
            max_messages: 2048,
            shutdown_grace: Duration::from_secs(10),
            allow_anonymous: false,
            body_timeout: Duration::from_secs(30),
            max_connections: MaxConnections::Auto,
        }
    }
}

impl ServerConfig {
    /// The checks of `[server]` that its types cannot express.
    pub(super) fn validate(&self, source: &Source) -> Result<(), ConfigError> {
        if let Err(e) = self.listen.parse::<SocketAddr>() {
            return Err(source.invalid("server.listen", format!("not an address: {e}")));
        }
        if self.max_body_bytes < 1024 {
            return Err(source.invalid("server.max_body_bytes", "must be at least 1024"));
        }
        if !(2..=512).contains(&self.max_json_depth) {
            return Err(source.invalid("server.max_json_depth", "must be within 2..=512"));
        }
        if self.max_json_values < 1000 {
            return Err(source.invalid("server.max_json_values", "must be at least 1000"));
        }
        if self.max_inflight_body_bytes < self.max_body_bytes
            || self.max_inflight_body_bytes > u32::MAX as usize
        {
            return Err(source.invalid(
                "server.max_inflight_body_bytes",
                "must be at least server.max_body_bytes, and under 4 GiB",
            ));
        }
        if self.request_timeout.is_zero() {
            return Err(source.invalid("server.request_timeout", "must be above zero"));
        }
        if self.body_timeout.is_zero() {
            return Err(source.invalid("server.body_timeout", "must be above zero"));
        }
        if let MaxConnections::Fixed(n) = self.max_connections
            && !(1..=MaxConnections::MOST).contains(&n)
        {
            return Err(source.invalid(
                "server.max_connections",
                format!("must be within 1..={} (or \"auto\")", MaxConnections::MOST),
            ));
        }
        Ok(())
    }
}

/// `server.max_connections`: a number, or `auto` (three quarters of the
/// process's open-file limit, the rest left for upstream calls, storage
/// and logs; 10,000 where the limit cannot be read).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MaxConnections {
    #[default]
    Auto,
    Fixed(usize),
}

impl MaxConnections {
    /// The largest number accepted (far beyond any open-file limit).
    pub const MOST: usize = 1 << 24;
}

impl<'de> Deserialize<'de> for MaxConnections {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = MaxConnections;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("\"auto\" or a number of connections")
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<MaxConnections, E> {
                usize::try_from(n)
                    .map(MaxConnections::Fixed)
                    .map_err(|_| E::custom("too large"))
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<MaxConnections, E> {
                u64::try_from(n)
                    .map_err(|_| E::custom("expected \"auto\" or a positive number"))
                    .and_then(|n| self.visit_u64(n))
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<MaxConnections, E> {
                if s == "auto" {
                    return Ok(MaxConnections::Auto);
                }
                // An environment override arrives as text.
                s.parse::<u64>()
                    .map_err(|_| E::custom("expected \"auto\" or a number of connections"))
                    .and_then(|n| self.visit_u64(n))
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl Serialize for MaxConnections {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            MaxConnections::Auto => s.serialize_str("auto"),
            MaxConnections::Fixed(n) => s.serialize_u64(*n as u64),
        }
    }
}
