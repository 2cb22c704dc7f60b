//! Tenants and their API keys: who is asking.
//!
//! Keys are kept only as SHA-256 digests (a plain key in the config is hashed
//! at start-up and the plain text dropped). A presented key is hashed and
//! compared against every stored digest in constant time, without an early
//! exit, so timing tells an attacker nothing about which bytes matched.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::config::{Config, RateLimitConfig};

/// The tenant every request belongs to when no `[[tenants]]` are configured
/// (the embedded default on a loopback address).
pub const ANONYMOUS_TENANT: &str = "default";

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    Tenant(Arc<str>),
    Admin,
}

impl Principal {
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Principal::Tenant(t) => Some(t),
            Principal::Admin => None,
        }
    }
}

struct Entry {
    digest: [u8; 32],
    principal: Principal,
}

/// The key table, built once from the configuration.
pub struct Keyring {
    entries: Vec<Entry>,
    anonymous: Option<Principal>,
    limits: HashMap<String, Arc<TenantLimits>>,
}

/// A tenant's own limits.
pub struct TenantLimits {
    bucket: Option<DefaultDirectRateLimiter>,
    /// The settings `bucket` was made from.
    rate: Option<RateLimitConfig>,
    pub max_body_bytes: Option<usize>,
    /// The tenant's budget of its own (`budget_usd`), in nano-dollars.
    pub budget: Option<i64>,
}

impl TenantLimits {
    /// Takes one token; `Err(wait)` when the bucket is empty.
    pub fn admit(&self) -> Result<(), Duration> {
        match &self.bucket {
            None => Ok(()),
            Some(b) => b
                .check()
                .map_err(|not_until| not_until.wait_time_from(DefaultClock::default().now())),
        }
    }
}

fn bucket(rps: f64, burst: u32) -> Option<DefaultDirectRateLimiter> {
    let period = Duration::from_secs_f64(1.0 / rps);
    let quota = Quota::with_period(period)?.allow_burst(NonZeroU32::new(burst)?);
    Some(RateLimiter::direct(quota))
}

impl Keyring {
    pub fn from_config(config: &Config) -> Keyring {
        Keyring::reusing(config, None)
    }

    /// The key table of `config`, keeping the token buckets of `before`
    /// (the table in force) for the tenants whose rate limit did not
    /// change: a reload neither refills nor empties a bucket.
    pub fn reusing(config: &Config, before: Option<&Keyring>) -> Keyring {
        let mut entries = Vec::new();
        for key in &config.admin.api_keys {
            if let Some(digest) = digest_of_config_key(key) {
                entries.push(Entry {
                    digest,
                    principal: Principal::Admin,
                });
            }
        }
        for tenant in &config.tenants {
            let name: Arc<str> = Arc::from(tenant.name.as_str());
            for key in &tenant.api_keys {
                if let Some(digest) = digest_of_config_key(key) {
                    entries.push(Entry {
                        digest,
                        principal: Principal::Tenant(name.clone()),
                    });
                }
            }
        }
        let anonymous = config
            .tenants
            .is_empty()
            .then(|| Principal::Tenant(Arc::from(ANONYMOUS_TENANT)));
        let limits = config
            .tenants
            .iter()
            .map(|t| {
                let kept = before.and_then(|b| b.limits.get(&t.name)).filter(|old| {
                    old.rate == t.rate_limit
                        && old.max_body_bytes == t.max_body_bytes
                        && old.budget == tenant_budget(t)
                });
                let limits = match kept {
                    Some(old) => old.clone(),
                    None => Arc::new(TenantLimits {
                        bucket: t
                            .rate_limit
                            .and_then(|r| bucket(r.requests_per_second, r.burst)),
                        rate: t.rate_limit,
                        max_body_bytes: t.max_body_bytes,
                        budget: tenant_budget(t),
                    }),
                };
                (t.name.clone(), limits)
            })
            .collect();
        Keyring {
            entries,
            anonymous,
            limits,
        }
    }

    /// A tenant's limits (none configured: `None`).
    pub fn limits(&self, tenant: &str) -> Option<&TenantLimits> {
        self.limits.get(tenant).map(|l| &**l)
    }

    /// True when every request is accepted as the anonymous tenant.
    pub fn is_open(&self) -> bool {
        self.anonymous.is_some()
    }

    /// Resolves the `Authorization` header value (if any). Admin keys are
    /// recognised in open mode too, so admin endpoints stay protected.
    pub fn authenticate(&self, authorization: Option<&[u8]>) -> Option<Principal> {
        self.authenticate_token(authorization.and_then(bearer_token))
    }

    /// The principal a bare key names (Anthropic's `x-api-key` header), or
    /// the anonymous one when none does.
    pub fn authenticate_token(&self, presented: Option<&[u8]>) -> Option<Principal> {
        let presented = presented.map(<[u8]>::trim_ascii).filter(|t| !t.is_empty());
        if let Some(token) = presented {
            let digest: [u8; 32] = Sha256::digest(token).into();
            let mut found: Option<&Principal> = None;
            for entry in &self.entries {
                // No early exit: every entry is compared.
                let hit: bool = entry.digest.ct_eq(&digest).into();
                if hit {
                    found = Some(&entry.principal);
                }
            }
            if let Some(p) = found {
                return Some(p.clone());
            }
        }
        self.anonymous.clone()
    }
}

/// A tenant's `budget_usd` in nano-dollars.
fn tenant_budget(t: &crate::config::TenantConfig) -> Option<i64> {
    t.budget_usd
        .map(|usd| i64::try_from(crate::prices::nanos(usd)).unwrap_or(i64::MAX))
}

/// `Bearer <token>`, case-insensitive scheme, surrounding spaces ignored.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    if value.len() < 7 || !value[..7].eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = value[7..].trim_ascii();
    (!token.is_empty()).then_some(token)
}

/// A config key is either `sha256:<hex>` or the plain key.
fn digest_of_config_key(key: &str) -> Option<[u8; 32]> {
    if let Some(hex) = key.strip_prefix("sha256:") {
        let bytes = hex::decode(hex).ok()?;
        return bytes.try_into().ok();
    }
    Some(Sha256::digest(key.as_bytes()).into())
}

pub use crate::config::hashed_key;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Source;

    fn keyring(text: &str) -> Keyring {
        let c = Config::from_toml_str(text, Source::Embedded, false).unwrap();
        Keyring::from_config(&c)
    }

    #[test]
    fn plain_and_hashed_keys_resolve_to_their_tenant() {
        let hashed = hashed_key("sk-beta-secret");
        let k = keyring(&format!(
            "[admin]\napi_keys = [\"admin-secret\"]\n[[tenants]]\nname = \"acme\"\napi_keys = [\"sk-acme-1\"]\n[[tenants]]\nname = \"beta\"\napi_keys = [\"{hashed}\"]\n"
        ));
        assert_eq!(
            k.authenticate(Some(b"Bearer sk-acme-1")),
            Some(Principal::Tenant("acme".into()))
        );
        assert_eq!(
            k.authenticate(Some(b"bearer  sk-beta-secret ")),
            Some(Principal::Tenant("beta".into()))
        );
        assert_eq!(
            k.authenticate(Some(b"Bearer admin-secret")),
            Some(Principal::Admin)
        );
        assert_eq!(k.authenticate(Some(b"Bearer sk-acme-2")), None);
        assert_eq!(k.authenticate(Some(b"sk-acme-1")), None);
        assert_eq!(k.authenticate(Some(b"Basic c2stYWNtZS0x")), None);
        assert_eq!(k.authenticate(None), None);
        assert!(!k.is_open());
    }

    #[test]
    fn a_token_bucket_admits_its_burst_then_says_how_long_to_wait() {
        let k = keyring(
            "[[tenants]]\nname = \"acme\"\napi_keys = [\"sk-acme-1\"]\nrate_limit = { requests_per_second = 1, burst = 3 }\n",
        );
        let l = k.limits("acme").unwrap();
        for _ in 0..3 {
            assert!(l.admit().is_ok());
        }
        let wait = l.admit().unwrap_err();
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_secs(1),
            "{wait:?}"
        );
    }

    #[test]
    fn without_tenants_everybody_is_the_default_tenant_but_admin_stays_admin() {
        let k = keyring("[admin]\napi_keys = [\"admin-secret\"]\n");
        assert!(k.is_open());
        let anon = Some(Principal::Tenant(ANONYMOUS_TENANT.into()));
        assert_eq!(k.authenticate(None), anon);
        assert_eq!(k.authenticate(Some(b"Bearer whatever")), anon);
        assert_eq!(
            k.authenticate(Some(b"Bearer admin-secret")),
            Some(Principal::Admin)
        );
    }
}
