//! Shared flights and cache across replicas (`coalescing.backend =
//! "redis://..."`, SPEC sections 4 and 9).
//!
//! Each replica still coalesces locally first (its flight table), so only
//! one task per fingerprint per replica ever talks to Redis. That task runs
//! [`RedisFlights::begin`], one Lua script that answers from the shared
//! result or negative cache, or takes the flight (`SET NX PX` with an owner
//! token), or reports that another replica leads. The leader renews its
//! lease every lease/3 and ends the flight with [`RedisFlights::complete`],
//! which writes the caches and the result, deletes the flight and publishes
//! the completion, all fenced by the token: a presumed-dead leader's late
//! answer never overwrites a newer one. Followers on other replicas wake on
//! the published message; a slow poll is the fallback for a missed one, and
//! it is also how a waiter notices a dead leader: when the lease has expired,
//! exactly one waiter's `SET NX` takes the lead.
//!
//! Every key of a fingerprint carries it as a hash tag (`{<hex>}`), so each
//! script touches one Redis Cluster slot. Every operation has a timeout; on
//! any Redis error the caller counts it (`idem_redis_errors_total`) and
//! falls back to local coalescing: Redis is never a single point of failure
//! for requests.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ProtocolVersion, PushKind, Script};
use tokio::sync::Notify;

use crate::answer::Answer;
use crate::metrics::Metrics;

use super::table::FlightKey;

/// What [`RedisFlights::begin`] found.
pub enum Begin {
    /// A fresh answer in the shared result cache, and its remaining TTL.
    Hit(Arc<Answer>, Duration),
    /// A failure in the shared negative cache for this target.
    Negative(Arc<Answer>),
    /// This replica now holds the flight.
    Lead,
    /// Another replica leads; its token.
    Follow(String),
}

/// How waiting on another replica's flight ended.
pub enum Remote {
    Done(Arc<Answer>),
    /// The leader's lease expired and this replica took the flight over.
    Lead,
}

#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis is not connected")]
    NotConnected,
    #[error("unexpected reply from a redis script")]
    Reply,
    #[error("the remote leader did not finish in time")]
    Deadline,
}

const BEGIN: &str = r"
if ARGV[3] == '1' then
  local a = redis.call('GET', KEYS[1])
  if a then return {'hit', a, tostring(redis.call('PTTL', KEYS[1]))} end
end
if ARGV[4] == '1' then
  local n = redis.call('GET', KEYS[2])
  if n then return {'neg', n} end
end
if redis.call('SET', KEYS[3], ARGV[1], 'NX', 'PX', ARGV[2]) then return {'lead'} end
return {'follow', redis.call('GET', KEYS[3])}
";

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

// KEYS: flight, answer, negative, result.
// ARGV: token, payload, answer_ttl_ms, negative_ttl_ms, result_ttl_ms, channel, message.
const COMPLETE: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then
  if cur or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
end
if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3]) end
if tonumber(ARGV[4]) > 0 then redis.call('SET', KEYS[3], ARGV[2], 'PX', ARGV[4]) end
redis.call('SET', KEYS[4], ARGV[1] .. '\n' .. ARGV[2], 'PX', ARGV[5])
if cur == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('PUBLISH', ARGV[6], ARGV[7])
return 1
";

// KEYS: flight, result. ARGV: awaited token, own token, lease_ms.
const POLL: &str = r"
local r = redis.call('GET', KEYS[2])
if r then
  local nl = string.find(r, '\n', 1, true)
  if nl and string.sub(r, 1, nl - 1) == ARGV[1] then
    return {'done', string.sub(r, nl + 1)}
  end
end
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then return {'wait'} end
if not cur then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return {'lead'}
end
return {'moved', cur}
";

/// The Redis side of coalescing for one replica.
pub struct RedisFlights {
    conn: ConnectionManager,
    prefix: String,
    channel: String,
    timeout: Duration,
    poll: Duration,
    waiters: DashMap<String, Arc<Notify>>,
    metrics: Arc<Metrics>,
    begin: Script,
    renew: Script,
    complete: Script,
    poll_script: Script,
    last_error_log: AtomicU64,
    started: Instant,
    healthy: AtomicBool,
}

impl RedisFlights {
    /// Connects (command connection and subscription). The connection
    /// manager reconnects by itself after an outage and re-subscribes.
    pub async fn connect(
        url: &str,
        prefix: &str,
        timeout: Duration,
        poll: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<RedisFlights>, SharedError> {
        let info = redis::IntoConnectionInfo::into_connection_info(url)?;
        let settings = info
            .redis_settings()
            .clone()
            .set_protocol(ProtocolVersion::RESP3);
        let client = redis::Client::open(info.set_redis_settings(settings))?;
        let base = ConnectionManagerConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(timeout.max(Duration::from_millis(500))))
            .set_max_delay(Duration::from_secs(2))
            .set_number_of_retries(1);
        let conn = tokio::time::timeout(
            timeout * 8,
            client.get_connection_manager_with_config(base.clone()),
        )
        .await
        .map_err(|_| SharedError::Timeout(timeout * 8))??;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut sub = tokio::time::timeout(
            timeout * 8,
            client.get_connection_manager_with_config(
                base.set_push_sender(tx).set_automatic_resubscription(),
            ),
        )
        .await
        .map_err(|_| SharedError::Timeout(timeout * 8))??;
        let channel = format!("{prefix}:done");
        sub.subscribe(&channel).await?;
        let shared = Arc::new(RedisFlights {
            conn,
            prefix: prefix.to_string(),
            channel,
            timeout,
            poll,
            waiters: DashMap::new(),
            metrics,
            begin: Script::new(BEGIN),
            renew: Script::new(RENEW),
            complete: Script::new(COMPLETE),
            poll_script: Script::new(POLL),
            last_error_log: AtomicU64::new(0),
            started: Instant::now(),
            healthy: AtomicBool::new(true),
        });
        // Completion messages wake the local waiter of that flight; a
        // disconnection wakes them all, so they poll for what they missed,
        // and a ping until it answers makes the manager reconnect (and
        // re-subscribe) even though nothing else is sent on it.
        let weak = Arc::downgrade(&shared);
        tokio::spawn(async move {
            let mut disconnected = false;
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    push = rx.recv() => {
                        let Some(push) = push else { break };
                        let Some(me) = weak.upgrade() else { break };
                        match push.kind {
                            PushKind::Message => {
                                if let Some(redis::Value::BulkString(m)) = push.data.get(1)
                                    && let Ok(id) = std::str::from_utf8(m)
                                    && let Some(n) = me.waiters.get(id)
                                {
                                    n.notify_waiters();
                                }
                            }
                            PushKind::Disconnection => {
                                disconnected = true;
                                for w in me.waiters.iter() {
                                    w.value().notify_waiters();
                                }
                            }
                            _ => {}
                        }
                    }
                    _ = tick.tick(), if disconnected => {
                        if weak.strong_count() == 0 {
                            break;
                        }
                        let ping: Result<String, _> = redis::cmd("PING").query_async(&mut sub).await;
                        if ping.is_ok() {
                            disconnected = false;
                        }
                    }
                }
            }
        });
        Ok(shared)
    }

    fn key(&self, key: &FlightKey, what: &str) -> String {
        format!("{}:{{{}}}:{what}", self.prefix, key.fp.to_hex())
    }

    fn target_key(&self, key: &FlightKey, what: &str) -> String {
        format!(
            "{}:{{{}}}:{what}:{}",
            self.prefix,
            key.fp.to_hex(),
            key.target
        )
    }

    fn flight_id(key: &FlightKey) -> String {
        format!("{}:{}", key.fp.to_hex(), key.target)
    }

    /// Counts a Redis failure and logs it (at most once per second).
    pub fn failed(&self, what: &str, e: &SharedError) {
        if matches!(e, SharedError::Deadline) {
            return;
        }
        self.healthy.store(false, Ordering::Relaxed);
        self.metrics.redis_errors.increment(1);
        let now = self.started.elapsed().as_secs();
        let last = self.last_error_log.swap(now, Ordering::Relaxed);
        if last != now {
            tracing::warn!(op = what, error = %e, "redis unavailable: coalescing locally on this replica");
        }
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<T, SharedError> {
        let mut conn = self.conn.clone();
        let r = match tokio::time::timeout(self.timeout, inv.invoke_async(&mut conn)).await {
            Ok(r) => r.map_err(SharedError::from),
            Err(_) => Err(SharedError::Timeout(self.timeout)),
        };
        if r.is_ok() {
            self.healthy.store(true, Ordering::Relaxed);
        }
        r
    }

    /// Whether the last Redis operation succeeded.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Shared cache, then the flight: see the module documentation.
    pub async fn begin(
        &self,
        key: &FlightKey,
        token: &str,
        lease: Duration,
        read_cache: bool,
        read_negative: bool,
    ) -> Result<Begin, SharedError> {
        let mut inv = self.begin.prepare_invoke();
        inv.key(self.key(key, "answer"))
            .key(self.target_key(key, "neg"))
            .key(self.target_key(key, "flight"))
            .arg(token)
            .arg(ms(lease))
            .arg(if read_cache { "1" } else { "0" })
            .arg(if read_negative { "1" } else { "0" });
        let reply: Vec<Vec<u8>> = self.run(inv).await?;
        let answer = |b: &[u8]| Answer::from_wire(b).map(Arc::new).ok_or(SharedError::Reply);
        match reply.first().map(Vec::as_slice) {
            Some(b"hit") => {
                let a = answer(reply.get(1).ok_or(SharedError::Reply)?)?;
                let left = reply
                    .get(2)
                    .and_then(|b| std::str::from_utf8(b).ok())
                    .and_then(|t| t.parse::<u64>().ok())
                    .unwrap_or(0);
                Ok(Begin::Hit(a, Duration::from_millis(left)))
            }
            Some(b"neg") => Ok(Begin::Negative(answer(
                reply.get(1).ok_or(SharedError::Reply)?,
            )?)),
            Some(b"lead") => Ok(Begin::Lead),
            Some(b"follow") => Ok(Begin::Follow(
                String::from_utf8_lossy(reply.get(1).ok_or(SharedError::Reply)?).into_owned(),
            )),
            _ => Err(SharedError::Reply),
        }
    }

    /// Extends the leader's lease; false if this replica no longer holds it.
    pub async fn renew(
        &self,
        key: &FlightKey,
        token: &str,
        lease: Duration,
    ) -> Result<bool, SharedError> {
        let mut inv = self.renew.prepare_invoke();
        inv.key(self.target_key(key, "flight"))
            .arg(token)
            .arg(ms(lease));
        let n: i64 = self.run(inv).await?;
        Ok(n == 1)
    }

    /// Ends the flight: caches, result, delete, publish; fenced by `token`.
    /// Returns false when a newer leader holds the flight (nothing written).
    pub async fn complete(
        &self,
        key: &FlightKey,
        token: &str,
        answer: &Answer,
        answer_ttl: Option<Duration>,
        negative_ttl: Option<Duration>,
        result_ttl: Duration,
    ) -> Result<bool, SharedError> {
        let mut inv = self.complete.prepare_invoke();
        inv.key(self.target_key(key, "flight"))
            .key(self.key(key, "answer"))
            .key(self.target_key(key, "neg"))
            .key(self.target_key(key, "result"))
            .arg(token)
            .arg(answer.to_wire())
            .arg(answer_ttl.map(ms).unwrap_or(0))
            .arg(negative_ttl.map(ms).unwrap_or(0))
            .arg(ms(result_ttl))
            .arg(&self.channel)
            .arg(Self::flight_id(key));
        let n: i64 = self.run(inv).await?;
        Ok(n == 1)
    }

    /// Waits for the flight another replica leads (token `leader`), until its
    /// answer arrives, its lease expires and this replica takes over, or
    /// `deadline`.
    pub async fn wait_remote(
        &self,
        key: &FlightKey,
        mut leader: String,
        token: &str,
        lease: Duration,
        deadline: Instant,
    ) -> Result<Remote, SharedError> {
        let id = Self::flight_id(key);
        let notify = self.waiters.entry(id.clone()).or_default().clone();
        let result = async {
            loop {
                // Arm the wake-up before looking, so a message published
                // between the look and the wait is not lost.
                let notified = notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                let mut inv = self.poll_script.prepare_invoke();
                inv.key(self.target_key(key, "flight"))
                    .key(self.target_key(key, "result"))
                    .arg(&leader)
                    .arg(token)
                    .arg(ms(lease));
                let reply: Vec<Vec<u8>> = self.run(inv).await?;
                match reply.first().map(Vec::as_slice) {
                    Some(b"done") => {
                        let a = reply
                            .get(1)
                            .and_then(|b| Answer::from_wire(b))
                            .ok_or(SharedError::Reply)?;
                        return Ok(Remote::Done(Arc::new(a)));
                    }
                    Some(b"lead") => return Ok(Remote::Lead),
                    Some(b"moved") => {
                        leader = String::from_utf8_lossy(reply.get(1).ok_or(SharedError::Reply)?)
                            .into_owned();
                        continue;
                    }
                    Some(b"wait") => {}
                    _ => return Err(SharedError::Reply),
                }
                let now = Instant::now();
                if now >= deadline {
                    return Err(SharedError::Deadline);
                }
                let nap = self.poll.min(deadline - now);
                tokio::select! {
                    () = &mut notified => {}
                    () = tokio::time::sleep(nap) => {}
                }
            }
        }
        .await;
        drop(notify);
        self.waiters
            .remove_if(&id, |_, n| Arc::strong_count(n) == 1);
        result
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::answer::Failure;
    use crate::config::{Config, Source};
    use std::str::FromStr;

    fn redis_url() -> String {
        std::env::var("IDEM_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    async fn shared() -> Arc<RedisFlights> {
        shared_polling(Duration::from_millis(50)).await
    }

    async fn shared_polling(poll: Duration) -> Arc<RedisFlights> {
        let config = Config::from_toml_str("", Source::Embedded, false).unwrap();
        let metrics = Arc::new(Metrics::new(&config));
        let prefix = format!("idem-unit-{}", uuid::Uuid::now_v7().simple());
        let url = redis_url();
        match RedisFlights::connect(&url, &prefix, Duration::from_secs(1), poll, metrics).await {
            Ok(s) => s,
            Err(e) => panic!(
                "Redis not reachable at {url}: {e}. Start it with: redis-server --daemonize yes \
                 --bind 127.0.0.1 -::1 --port 6379 --save \"\" --appendonly no"
            ),
        }
    }

    fn key() -> FlightKey {
        let hex = blake3::hash(uuid::Uuid::now_v7().as_bytes())
            .to_hex()
            .to_string();
        FlightKey {
            fp: crate::fingerprint::Fingerprint::from_str(&format!("v1:{hex}")).unwrap(),
            target: 0,
        }
    }

    fn answer(text: &str) -> Answer {
        let mut a = Answer::from_failure(Failure::Timeout, "x", "p".into(), "m".into());
        a.failure = None;
        a.status = reqwest::StatusCode::OK;
        a.body = bytes::Bytes::from(text.to_string());
        a
    }

    #[tokio::test]
    async fn one_leader_then_a_fenced_takeover() {
        let s = shared().await;
        let k = key();
        let lease = Duration::from_millis(300);
        assert!(matches!(
            s.begin(&k, "a", lease, true, true).await.unwrap(),
            Begin::Lead
        ));
        let Begin::Follow(leader) = s.begin(&k, "b", lease, true, true).await.unwrap() else {
            panic!("a second leader")
        };
        assert_eq!(leader, "a");
        // A renews while alive; B cannot renew A's lease.
        assert!(s.renew(&k, "a", lease).await.unwrap());
        assert!(!s.renew(&k, "b", lease).await.unwrap());
        // A stops renewing (it died): B notices the expiry and takes over,
        // and only B (a third waiter keeps waiting on B).
        let deadline = Instant::now() + Duration::from_secs(5);
        assert!(matches!(
            s.wait_remote(&k, "a".into(), "b", lease, deadline)
                .await
                .unwrap(),
            Remote::Lead
        ));
        let Begin::Follow(now) = s.begin(&k, "c", lease, true, true).await.unwrap() else {
            panic!("a third leader")
        };
        assert_eq!(now, "b");
        // A's late answer must not be written over B's flight.
        let late = answer("from A");
        assert!(
            !s.complete(
                &k,
                "a",
                &late,
                Some(Duration::from_secs(5)),
                None,
                Duration::from_secs(5)
            )
            .await
            .unwrap()
        );
        let fresh = answer("from B");
        assert!(
            s.complete(
                &k,
                "b",
                &fresh,
                Some(Duration::from_secs(5)),
                None,
                Duration::from_secs(5)
            )
            .await
            .unwrap()
        );
        let Begin::Hit(hit, left) = s.begin(&k, "d", lease, true, true).await.unwrap() else {
            panic!("no shared answer")
        };
        assert_eq!(&hit.body[..], b"from B");
        assert!(left > Duration::ZERO && left <= Duration::from_secs(5));
        // The waiter that followed B gets B's answer.
        let Remote::Done(got) = s
            .wait_remote(&k, "b".into(), "c", lease, deadline)
            .await
            .unwrap()
        else {
            panic!("the waiter did not get the answer")
        };
        assert_eq!(&got.body[..], b"from B");
    }

    #[tokio::test]
    async fn a_published_completion_wakes_the_waiter_before_its_poll() {
        let s = shared_polling(Duration::from_secs(30)).await;
        let k = key();
        let lease = Duration::from_secs(10);
        assert!(matches!(
            s.begin(&k, "a", lease, true, true).await.unwrap(),
            Begin::Lead
        ));
        let waiter = {
            let s = s.clone();
            tokio::spawn(async move {
                // A poll interval far longer than the test: only the message can wake it.
                let started = Instant::now();
                let r = s
                    .wait_remote(
                        &k,
                        "a".into(),
                        "b",
                        lease,
                        Instant::now() + Duration::from_secs(20),
                    )
                    .await;
                (r, started.elapsed())
            })
        };
        // Let the waiter arm itself, then complete.
        while s.waiters.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(
            s.complete(&k, "a", &answer("done"), None, None, Duration::from_secs(5))
                .await
                .unwrap()
        );
        let (r, took) = waiter.await.unwrap();
        assert!(matches!(r.unwrap(), Remote::Done(_)));
        assert!(took < Duration::from_secs(5));
    }
}
