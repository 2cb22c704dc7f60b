//! Shared flights and cache across replicas (`coalescing.backend =
//! "redis://..."` for one server, `"redis+cluster://..."` for a Redis
//! Cluster).
//!
//! Each replica still coalesces locally first (its flight table), so only
//! one task per fingerprint per replica ever talks to Redis. That task runs
//! [`RedisFlights::begin`], one Lua script that answers from the shared
//! result or negative cache, or takes the flight, or reports that another
//! replica leads. Every take of a flight gets a generation, a number per
//! fingerprint and target that only grows (`INCR`); the flight key holds
//! `<generation>:<token>` with the lease as its TTL. The leader renews its
//! lease every lease/3 and ends the flight with [`RedisFlights::complete`],
//! which writes the caches and the result, deletes the flight and publishes
//! the completion only while its generation is the flight's newest
//! (fencing): a presumed-dead leader's late answer goes nowhere, whatever
//! is cached. Followers on other replicas wake on the published message; a
//! slow poll is the fallback for a missed one, and a quick poll while the
//! subscription is not known to hear (it probes itself, see [`listen`]). A waiter is done with the
//! result of its generation or of any later one (a take-over's), and takes
//! the flight over only when there is no live flight, no such result and no
//! cached answer: one take-over, one answer for every waiter.
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
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{ProtocolVersion, PushKind, Script};
use tokio::sync::Notify;

use crate::answer::Answer;
use crate::config::SharedBackend;
use crate::fingerprint::Fingerprint;
use crate::metrics::Metrics;

use super::table::FlightKey;

/// One leadership of a shared flight: the generation that took it (a
/// number that only grows per fingerprint and target, so any two leaders
/// of the same flight are ordered) and the taker's random token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub generation: u64,
    pub token: String,
}

impl Lease {
    /// The flight key's value: `<generation>:<token>`.
    fn value(&self) -> String {
        format!("{}:{}", self.generation, self.token)
    }

    /// The generation in a flight key's value.
    fn generation_of(value: &[u8]) -> Option<u64> {
        let text = std::str::from_utf8(value).ok()?;
        text.split_once(':')?.0.parse().ok()
    }
}

/// What [`RedisFlights::begin`] found.
pub enum Begin {
    /// A fresh answer in the shared result cache, and its remaining TTL.
    Hit(Arc<Answer>, Duration),
    /// A failure in the shared negative cache for this target.
    Negative(Arc<Answer>),
    /// This replica now holds the flight, under this generation.
    Lead(u64),
    /// Another replica leads; the generation it holds.
    Follow(u64),
}

/// How waiting on another replica's flight ended.
pub enum Remote {
    /// The answer of the awaited generation or of a later one (a take-over).
    Done(Arc<Answer>),
    /// No live flight and no result: the shared cache had an answer (and
    /// its remaining TTL).
    Hit(Arc<Answer>, Duration),
    /// No live flight, no result, nothing cached: this replica took the
    /// flight over, under this generation.
    Lead(u64),
}

/// What [`RedisFlights::complete`] did.
pub enum Completion {
    /// The answer was written and published: this leader's generation was
    /// still the flight's newest.
    Accepted,
    /// A newer generation took the flight over; nothing was written. The
    /// newer generation still leads ...
    Superseded(u64),
    /// ... or it ended with this answer (`None`: its result has expired).
    Answered(Option<Arc<Answer>>),
}

#[derive(Debug, thiserror::Error)]
pub enum SharedError {
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis is not connected")]
    NotConnected,
    #[error("the coalescing backend is memory: there is no redis to connect to")]
    Memory,
    #[error("unexpected reply from a redis script")]
    Reply,
}

// Keys of one fingerprint and target (one hash tag, one Cluster slot):
// `flight` holds `<generation>:<token>` with the lease as its TTL;
// `generation` counts the takes (INCR: only grows); `result` holds
// `<generation>\n<answer>` for the waiters of a flight that ended; `answer`
// (per fingerprint) and `neg` are the shared result and negative caches.

/// How long a generation counter outlives its last take. Far longer than
/// any result or lease, so a counter never restarts while anything that
/// carries one of its generations is still around.
const GENERATION_TTL_MS: u64 = 24 * 3600 * 1000;

// KEYS: answer, negative, flight, generation.
// ARGV: token, lease_ms, read_cache, read_negative, generation_ttl_ms.
const BEGIN: &str = r"
if ARGV[3] == '1' then
  local a = redis.call('GET', KEYS[1])
  if a then return {'hit', a, tostring(redis.call('PTTL', KEYS[1]))} end
end
if ARGV[4] == '1' then
  local n = redis.call('GET', KEYS[2])
  if n then return {'neg', n} end
end
local cur = redis.call('GET', KEYS[3])
if cur then return {'follow', cur} end
local g = redis.call('INCR', KEYS[4])
redis.call('PEXPIRE', KEYS[4], ARGV[5])
redis.call('SET', KEYS[3], g .. ':' .. ARGV[1], 'PX', ARGV[2])
return {'lead', tostring(g)}
";

// KEYS: flight. ARGV: `<generation>:<token>`, lease_ms.
const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

// A write is accepted only from the flight's newest generation: the one
// holding the flight, or, once its lease lapsed, the last one that took it
// if nobody took it since. Whatever is cached does not matter.
// KEYS: flight, answer, negative, result, generation.
// ARGV: generation, `<generation>:<token>`, payload, answer_ttl_ms,
//       negative_ttl_ms, result_ttl_ms, channel, message.
const COMPLETE: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[2] then
  if cur then return {'superseded', cur} end
  if redis.call('GET', KEYS[5]) ~= ARGV[1] then
    local r = redis.call('GET', KEYS[4])
    if r then return {'answered', r} end
    return {'answered'}
  end
end
if tonumber(ARGV[4]) > 0 then redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4]) end
if tonumber(ARGV[5]) > 0 then redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[5]) end
redis.call('SET', KEYS[4], ARGV[1] .. '\n' .. ARGV[3], 'PX', ARGV[6])
if cur == ARGV[2] then redis.call('DEL', KEYS[1]) end
redis.call('PUBLISH', ARGV[7], ARGV[8])
return {'ok'}
";

// A waiter of generation g is done with the result of g or of any later
// generation (a take-over's); it waits while a flight is live, whichever
// generation holds it; it takes the flight over only when there is
// neither a live flight nor such a result nor a cached answer.
// KEYS: flight, result, answer, generation.
// ARGV: awaited generation, own token, lease_ms, read_cache,
//       generation_ttl_ms.
const POLL: &str = r"
local r = redis.call('GET', KEYS[2])
if r then
  local nl = string.find(r, '\n', 1, true)
  if nl and tonumber(string.sub(r, 1, nl - 1)) >= tonumber(ARGV[1]) then
    return {'done', string.sub(r, nl + 1)}
  end
end
local cur = redis.call('GET', KEYS[1])
if cur then return {'wait', cur} end
if ARGV[4] == '1' then
  local a = redis.call('GET', KEYS[3])
  if a then return {'hit', a, tostring(redis.call('PTTL', KEYS[3]))} end
end
local g = redis.call('INCR', KEYS[4])
redis.call('PEXPIRE', KEYS[4], ARGV[5])
redis.call('SET', KEYS[1], g .. ':' .. ARGV[2], 'PX', ARGV[3])
return {'lead', tostring(g)}
";

/// The command connection: one server's connection manager, or a cluster
/// connection, which sends each script to the master of its first key's
/// slot (every key of a script is in that slot: one hash tag) and follows
/// the cluster's redirections when slots move.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    /// Records the commands and fails them, so tests can look at what would
    /// be sent.
    #[cfg(test)]
    Recorder(Arc<std::sync::Mutex<Vec<redis::Cmd>>>),
}

impl Conn {
    async fn subscribe(&mut self, channel: &str) -> redis::RedisResult<()> {
        match self {
            Conn::Single(c) => c.subscribe(channel).await,
            Conn::Cluster(c) => c.subscribe(channel).await,
            #[cfg(test)]
            Conn::Recorder(_) => Ok(()),
        }
    }
}

impl redis::aio::ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            #[cfg(test)]
            Conn::Recorder(r) => {
                r.lock().unwrap().push(cmd.clone());
                Box::pin(async { Err((redis::ErrorKind::Io, "recorded").into()) })
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            #[cfg(test)]
            Conn::Recorder(_) => Box::pin(async { Err((redis::ErrorKind::Io, "recorded").into()) }),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            #[cfg(test)]
            Conn::Recorder(_) => 0,
        }
    }
}

type Pushes = tokio::sync::mpsc::UnboundedReceiver<redis::PushInfo>;

/// Bounds a connection attempt: a server that accepts but never answers
/// must not hold the start-up.
async fn within<T>(
    limit: Duration,
    connecting: impl Future<Output = redis::RedisResult<T>>,
) -> Result<T, SharedError> {
    Ok(tokio::time::timeout(limit, connecting)
        .await
        .map_err(|_| SharedError::Timeout(limit))??)
}

/// One server: a command connection and a subscribing one, both managers
/// that reconnect by themselves (the subscriber re-subscribes).
async fn connect_single(url: &str, timeout: Duration) -> Result<(Conn, Conn, Pushes), SharedError> {
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
    let conn = within(
        timeout * 8,
        client.get_connection_manager_with_config(base.clone()),
    )
    .await?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let sub = within(
        timeout * 8,
        client.get_connection_manager_with_config(
            base.set_push_sender(tx).set_automatic_resubscription(),
        ),
    )
    .await?;
    Ok((Conn::Single(conn), Conn::Single(sub), rx))
}

/// A Redis Cluster, from its seed nodes: a command connection and a
/// subscribing one. Each keeps a connection per node, reconnects a lost
/// node by itself and refreshes the slot map on a redirection; the
/// subscriber re-subscribes on the node that owns the channel's slot. A
/// PUBLISH on any node reaches the subscribers of every node, so one
/// subscription per replica hears every completion.
async fn connect_cluster(
    nodes: &[String],
    timeout: Duration,
) -> Result<(Conn, Conn, Pushes), SharedError> {
    // Few retries, quickly: the per-operation timeout bounds every call
    // anyway, and a call given up on must not linger in retries behind it.
    let builder = || {
        ClusterClientBuilder::new(nodes.iter().map(String::as_str))
            .use_protocol(ProtocolVersion::RESP3)
            .connection_timeout(timeout.max(Duration::from_millis(500)))
            .response_timeout(timeout)
            .retries(3)
            .min_retry_wait(10)
            .max_retry_wait(ms(timeout).max(20))
    };
    let commands = builder().build()?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let subscriber = builder().push_sender(tx).build()?;
    let conn = within(timeout * 8, commands.get_async_connection()).await?;
    let sub = within(timeout * 8, subscriber.get_async_connection()).await?;
    Ok((Conn::Cluster(conn), Conn::Cluster(sub), rx))
}

/// The Redis side of coalescing for one replica.
pub struct RedisFlights {
    conn: Conn,
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
    /// Whether this replica's subscription is known to hear completions
    /// (see [`listen`]); while it is not, waiters poll quickly.
    listening: AtomicBool,
    /// This replica's own result cache, which another replica's eviction
    /// (see [`RedisFlights::evict`]) empties too.
    local: std::sync::OnceLock<Arc<crate::cache::ResultCache>>,
}

/// The message that tells every replica to forget an answer.
const EVICT: &str = "evict:";

impl RedisFlights {
    /// Connects to one server or to a cluster (command connection and
    /// subscription); both reconnect by themselves after an outage and
    /// re-subscribe.
    pub async fn connect(
        backend: &SharedBackend,
        prefix: &str,
        timeout: Duration,
        poll: Duration,
        metrics: Arc<Metrics>,
    ) -> Result<Arc<RedisFlights>, SharedError> {
        let (conn, mut sub, rx) = match backend {
            SharedBackend::Redis(url) => connect_single(url, timeout).await?,
            SharedBackend::RedisCluster(nodes) => connect_cluster(nodes, timeout).await?,
            SharedBackend::Memory => return Err(SharedError::Memory),
        };
        let shared = Arc::new(RedisFlights::new(conn, prefix, timeout, poll, metrics));
        sub.subscribe(&shared.channel).await?;
        tokio::spawn(listen(Arc::downgrade(&shared), sub, rx));
        Ok(shared)
    }

    fn new(
        conn: Conn,
        prefix: &str,
        timeout: Duration,
        poll: Duration,
        metrics: Arc<Metrics>,
    ) -> RedisFlights {
        RedisFlights {
            conn,
            prefix: prefix.to_string(),
            channel: format!("{prefix}:done"),
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
            listening: AtomicBool::new(true),
            local: std::sync::OnceLock::new(),
        }
    }

    /// The replica's own result cache: evictions announced by any replica
    /// are applied to it.
    pub fn evicts_from(&self, cache: Arc<crate::cache::ResultCache>) {
        let _ = self.local.set(cache);
    }

    /// Forgets the answer of `fp` everywhere: the shared result cache, and
    /// every replica's own (announced on the completion channel; a replica
    /// that misses the message keeps its copy at most until its TTL).
    pub async fn evict(&self, fp: &Fingerprint) -> Result<(), SharedError> {
        let key = FlightKey { fp: *fp, target: 0 };
        let mut conn = self.conn.clone();
        let mut del = redis::cmd("DEL");
        del.arg(self.key(&key, "answer"));
        let mut publish = redis::cmd("PUBLISH");
        publish
            .arg(&self.channel)
            .arg(format!("{EVICT}{}", fp.to_hex()));
        let both = async {
            del.query_async::<i64>(&mut conn).await?;
            publish.query_async::<i64>(&mut conn).await
        };
        match tokio::time::timeout(self.timeout, both).await {
            Ok(r) => r.map(|_| ()).map_err(SharedError::from),
            Err(_) => Err(SharedError::Timeout(self.timeout)),
        }
    }

    fn key(&self, key: &FlightKey, what: &str) -> String {
        format!("{}:{{{}}}:{what}", self.prefix, key.fp.to_hex())
    }

    /// Adds `n` to the one-minute window `name` of minute `minute` (a
    /// count every replica shares: a key's requests or tokens per minute)
    /// and returns the window's count after it; the window expires two
    /// minutes later. `n = 0` reads it.
    pub async fn count_window(&self, name: &str, minute: u64, n: u64) -> Result<u64, SharedError> {
        let key = format!("{}:{{rl:{name}}}:{minute}", self.prefix);
        let mut conn = self.conn.clone();
        let mut pipe = redis::pipe();
        pipe.cmd("INCRBY")
            .arg(&key)
            .arg(n)
            .cmd("EXPIRE")
            .arg(&key)
            .arg(120)
            .ignore();
        let r =
            match tokio::time::timeout(self.timeout, pipe.query_async::<(u64,)>(&mut conn)).await {
                Ok(r) => r.map(|(count,)| count).map_err(SharedError::from),
                Err(_) => Err(SharedError::Timeout(self.timeout)),
            };
        match &r {
            Ok(_) => self.healthy.store(true, Ordering::Relaxed),
            Err(e) => self.failed("rate window", e),
        }
        r
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

    /// Whether the subscription is known to hear completion messages: its
    /// last probe came back and no disconnection was seen since.
    pub fn listening(&self) -> bool {
        self.listening.load(Ordering::Relaxed)
    }

    /// Marks the subscription deaf or hearing; going deaf wakes every
    /// waiter, so each polls for what it may have missed and then polls
    /// quickly until the subscription hears again.
    fn set_listening(&self, on: bool) {
        let was = self.listening.swap(on, Ordering::Relaxed);
        if was && !on {
            for w in self.waiters.iter() {
                w.value().notify_waiters();
            }
        }
    }

    /// How long a waiter sleeps between polls when no message wakes it.
    fn poll_interval(&self) -> Duration {
        if self.listening() {
            self.poll
        } else {
            self.poll.min(DEAF_POLL)
        }
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
            .key(self.target_key(key, "generation"))
            .arg(token)
            .arg(ms(lease))
            .arg(flag(read_cache))
            .arg(flag(read_negative))
            .arg(GENERATION_TTL_MS);
        let reply: Vec<Vec<u8>> = self.run(inv).await?;
        match reply.first().map(Vec::as_slice) {
            Some(b"hit") => {
                let (a, left) = hit(&reply)?;
                Ok(Begin::Hit(a, left))
            }
            Some(b"neg") => Ok(Begin::Negative(answer_at(&reply, 1)?)),
            Some(b"lead") => Ok(Begin::Lead(number_at(&reply, 1)?)),
            Some(b"follow") => Ok(Begin::Follow(
                reply
                    .get(1)
                    .and_then(|v| Lease::generation_of(v))
                    .ok_or(SharedError::Reply)?,
            )),
            _ => Err(SharedError::Reply),
        }
    }

    /// Extends the leader's lease; false if this replica no longer holds it.
    pub async fn renew(
        &self,
        key: &FlightKey,
        lease: &Lease,
        ttl: Duration,
    ) -> Result<bool, SharedError> {
        let mut inv = self.renew.prepare_invoke();
        inv.key(self.target_key(key, "flight"))
            .arg(lease.value())
            .arg(ms(ttl));
        let n: i64 = self.run(inv).await?;
        Ok(n == 1)
    }

    /// Ends the flight: caches, result, delete, publish; fenced by the
    /// lease's generation (see [`Completion`]).
    pub async fn complete(
        &self,
        key: &FlightKey,
        lease: &Lease,
        answer: &Answer,
        answer_ttl: Option<Duration>,
        negative_ttl: Option<Duration>,
        result_ttl: Duration,
    ) -> Result<Completion, SharedError> {
        let mut inv = self.complete.prepare_invoke();
        inv.key(self.target_key(key, "flight"))
            .key(self.key(key, "answer"))
            .key(self.target_key(key, "neg"))
            .key(self.target_key(key, "result"))
            .key(self.target_key(key, "generation"))
            .arg(lease.generation)
            .arg(lease.value())
            .arg(answer.to_wire())
            .arg(answer_ttl.map(ms).unwrap_or(0))
            .arg(negative_ttl.map(ms).unwrap_or(0))
            .arg(ms(result_ttl))
            .arg(&self.channel)
            .arg(Self::flight_id(key));
        let reply: Vec<Vec<u8>> = self.run(inv).await?;
        match reply.first().map(Vec::as_slice) {
            Some(b"ok") => Ok(Completion::Accepted),
            Some(b"superseded") => Ok(Completion::Superseded(
                reply
                    .get(1)
                    .and_then(|v| Lease::generation_of(v))
                    .ok_or(SharedError::Reply)?,
            )),
            Some(b"answered") => match reply.get(1) {
                None => Ok(Completion::Answered(None)),
                Some(r) => Ok(Completion::Answered(Some(result_answer(r)?))),
            },
            _ => Err(SharedError::Reply),
        }
    }

    /// Waits for the flight of generation `awaited`, which another replica
    /// leads, until its answer or a later generation's arrives, or nobody
    /// leads any more and this replica finds the answer cached or takes the
    /// flight over. It waits as long as some replica holds the flight's
    /// lease, so a long but healthy answer is waited for; the caller's own
    /// bounds (its followers' `max_wait`) decide how long that may be.
    pub async fn wait_remote(
        &self,
        key: &FlightKey,
        awaited: u64,
        token: &str,
        lease: Duration,
        read_cache: bool,
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
                    .key(self.key(key, "answer"))
                    .key(self.target_key(key, "generation"))
                    .arg(awaited)
                    .arg(token)
                    .arg(ms(lease))
                    .arg(flag(read_cache))
                    .arg(GENERATION_TTL_MS);
                let reply: Vec<Vec<u8>> = self.run(inv).await?;
                match reply.first().map(Vec::as_slice) {
                    Some(b"done") => return Ok(Remote::Done(answer_at(&reply, 1)?)),
                    Some(b"hit") => {
                        let (a, left) = hit(&reply)?;
                        return Ok(Remote::Hit(a, left));
                    }
                    Some(b"lead") => return Ok(Remote::Lead(number_at(&reply, 1)?)),
                    Some(b"wait") => {}
                    _ => return Err(SharedError::Reply),
                }
                tokio::select! {
                    () = &mut notified => {}
                    () = tokio::time::sleep(self.poll_interval()) => {}
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

/// How often a hearing subscription is probed.
const PROBE_EVERY: Duration = Duration::from_secs(2);
/// How often a deaf subscription is re-subscribed and probed.
const DEAF_PROBE_EVERY: Duration = Duration::from_millis(250);
/// A waiter's poll interval while the subscription is deaf.
const DEAF_POLL: Duration = Duration::from_millis(100);

/// The subscription's task. A completion message wakes the local waiter of
/// that flight. Whether the subscription still hears is not left to the
/// client library's resubscription after an outage (on a Redis Cluster it
/// may come back silently without the channel): the task publishes a probe
/// of its own every [`PROBE_EVERY`] and counts the subscription deaf when a
/// disconnection is pushed or a probe does not come back in time. While
/// deaf, waiters poll every [`DEAF_POLL`] and the task subscribes again and
/// probes every [`DEAF_PROBE_EVERY`] until a probe comes back.
async fn listen(shared: std::sync::Weak<RedisFlights>, mut sub: Conn, mut rx: Pushes) {
    let nonce = uuid::Uuid::now_v7().simple().to_string();
    let mut seq = 0u64;
    // Any probe of this task that comes back proves the subscription hears.
    let mine = format!("probe:{nonce}:");
    // When the oldest unanswered probe was sent.
    let mut probe: Option<Instant> = None;
    let mut last_heard = Instant::now();
    let mut tick = tokio::time::interval(DEAF_PROBE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            push = rx.recv() => {
                let Some(push) = push else { break };
                let Some(me) = shared.upgrade() else { break };
                match push.kind {
                    PushKind::Message => {
                        let Some(redis::Value::BulkString(m)) = push.data.get(1) else {
                            continue;
                        };
                        if m.starts_with(mine.as_bytes()) {
                            probe = None;
                            last_heard = Instant::now();
                            me.set_listening(true);
                        } else if let Some(hex) = m.strip_prefix(EVICT.as_bytes()) {
                            let fp = std::str::from_utf8(hex)
                                .ok()
                                .and_then(|h| format!("v1:{h}").parse::<Fingerprint>().ok());
                            if let (Some(fp), Some(cache)) = (fp, me.local.get()) {
                                cache.remove(&fp);
                            }
                        } else if let Ok(id) = std::str::from_utf8(m)
                            && let Some(n) = me.waiters.get(id)
                        {
                            n.notify_waiters();
                        }
                    }
                    PushKind::Disconnection => me.set_listening(false),
                    _ => {}
                }
            }
            _ = tick.tick() => {
                let Some(me) = shared.upgrade() else { break };
                let deadline = (me.timeout * 4).max(Duration::from_secs(1));
                if me.listening()
                    && probe.is_some_and(|sent| sent.elapsed() > deadline)
                {
                    me.set_listening(false);
                }
                let due = if me.listening() {
                    probe.is_none() && last_heard.elapsed() >= PROBE_EVERY
                } else {
                    true
                };
                if !due {
                    continue;
                }
                if !me.listening() {
                    // Subscribing again is harmless on a live subscription
                    // and makes a dropped connection reconnect.
                    let _ = tokio::time::timeout(me.timeout, sub.subscribe(&me.channel)).await;
                }
                seq += 1;
                let message = format!("{mine}{seq}");
                let mut conn = me.conn.clone();
                let sent = Instant::now();
                let mut publish = redis::cmd("PUBLISH");
                publish.arg(&me.channel).arg(&message);
                let publish = publish.query_async::<i64>(&mut conn);
                if let Ok(Ok(_)) = tokio::time::timeout(me.timeout, publish).await {
                    probe.get_or_insert(sent);
                }
            }
        }
    }
}

fn flag(on: bool) -> &'static str {
    if on { "1" } else { "0" }
}

fn answer_at(reply: &[Vec<u8>], i: usize) -> Result<Arc<Answer>, SharedError> {
    reply
        .get(i)
        .and_then(|b| Answer::from_wire(b))
        .map(Arc::new)
        .ok_or(SharedError::Reply)
}

fn number_at(reply: &[Vec<u8>], i: usize) -> Result<u64, SharedError> {
    reply
        .get(i)
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|t| t.parse().ok())
        .ok_or(SharedError::Reply)
}

/// A `{'hit', answer, pttl}` reply.
fn hit(reply: &[Vec<u8>]) -> Result<(Arc<Answer>, Duration), SharedError> {
    let a = answer_at(reply, 1)?;
    // PTTL is -1 (no expiry) or -2 (just gone): no time left to cache it.
    let left = number_at(reply, 2).unwrap_or(0);
    Ok((a, Duration::from_millis(left)))
}

/// The answer in a `result` key's value (`<generation>\n<answer>`).
fn result_answer(value: &[u8]) -> Result<Arc<Answer>, SharedError> {
    let nl = value
        .iter()
        .position(|b| *b == b'\n')
        .ok_or(SharedError::Reply)?;
    Answer::from_wire(&value[nl + 1..])
        .map(Arc::new)
        .ok_or(SharedError::Reply)
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
        crate::test_services::redis_url()
    }

    async fn shared() -> Arc<RedisFlights> {
        shared_polling(Duration::from_millis(50)).await
    }

    async fn shared_polling(poll: Duration) -> Arc<RedisFlights> {
        let config = Config::from_toml_str("", Source::Embedded, false).unwrap();
        let metrics = Arc::new(Metrics::new(&config));
        let prefix = format!("idem-unit-{}", uuid::Uuid::now_v7().simple());
        let url = redis_url();
        let backend = SharedBackend::Redis(url.clone());
        match RedisFlights::connect(&backend, &prefix, Duration::from_secs(1), poll, metrics).await
        {
            Ok(s) => s,
            Err(e) => panic!("Redis at {url} answered the tests before, but not now: {e}"),
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

    const LEASE: Duration = Duration::from_millis(300);
    const KEEP: Duration = Duration::from_secs(5);

    fn lease(generation: u64, token: &str) -> Lease {
        Lease {
            generation,
            token: token.into(),
        }
    }

    async fn lead(s: &RedisFlights, k: &FlightKey, token: &str) -> Lease {
        match s.begin(k, token, LEASE, true, true).await.unwrap() {
            Begin::Lead(g) => lease(g, token),
            _ => panic!("{token} did not lead"),
        }
    }

    async fn follow(s: &RedisFlights, k: &FlightKey, token: &str) -> u64 {
        match s.begin(k, token, LEASE, true, true).await.unwrap() {
            Begin::Follow(g) => g,
            _ => panic!("{token} did not follow"),
        }
    }

    /// Waits until the awaited leader's lease lapses and `token` takes over.
    async fn take_over(s: &RedisFlights, k: &FlightKey, awaited: u64, token: &str) -> Lease {
        match s.wait_remote(k, awaited, token, LEASE, true).await.unwrap() {
            Remote::Lead(g) => lease(g, token),
            _ => panic!("{token} did not take over"),
        }
    }

    async fn complete(s: &RedisFlights, k: &FlightKey, l: &Lease, text: &str) -> Completion {
        s.complete(k, l, &answer(text), Some(KEEP), None, KEEP)
            .await
            .unwrap()
    }

    /// A Redis Cluster runs a script only when all its keys are in one slot.
    /// The cluster client sends an EVALSHA to the master of its first key
    /// (the argument after the key count), so it must carry its keys.
    #[tokio::test]
    async fn every_script_keeps_to_one_slot_and_names_its_keys() {
        use redis::cluster_routing::Slot;
        let recorded = Arc::new(std::sync::Mutex::new(Vec::new()));
        let config = Config::from_toml_str("", Source::Embedded, false).unwrap();
        let s = RedisFlights::new(
            Conn::Recorder(recorded.clone()),
            "idem",
            Duration::from_secs(1),
            Duration::from_millis(50),
            Arc::new(Metrics::new(&config)),
        );
        let k = key();
        let l = lease(1, "a");
        assert!(s.begin(&k, "a", LEASE, true, true).await.is_err());
        assert!(s.renew(&k, &l, LEASE).await.is_err());
        let a = answer("x");
        assert!(
            s.complete(&k, &l, &a, Some(KEEP), Some(KEEP), KEEP)
                .await
                .is_err()
        );
        assert!(s.wait_remote(&k, 1, "b", LEASE, true).await.is_err());
        let commands = recorded.lock().unwrap();
        assert_eq!(commands.len(), 4);
        let tag = format!("{{{}}}", k.fp.to_hex());
        for cmd in commands.iter() {
            let args: Vec<Vec<u8>> = cmd
                .args_iter()
                .map(|a| match a {
                    redis::Arg::Simple(b) => b.to_vec(),
                    _ => panic!("a script call with a cursor"),
                })
                .collect();
            assert_eq!(args[0], b"EVALSHA");
            let n: usize = std::str::from_utf8(&args[2]).unwrap().parse().unwrap();
            let keys = &args[3..3 + n];
            assert!(n >= 1);
            let slot = Slot::for_key(&keys[0]);
            for key in keys {
                let text = std::str::from_utf8(key).unwrap();
                assert!(text.starts_with("idem:") && text.contains(&tag), "{text}");
                assert_eq!(Slot::for_key(key), slot, "{text} is in another slot");
            }
        }
    }

    #[tokio::test]
    async fn one_leader_then_a_fenced_takeover() {
        let s = shared().await;
        let k = key();
        let a = lead(&s, &k, "a").await;
        assert_eq!(follow(&s, &k, "b").await, a.generation);
        // A renews while alive; B cannot renew A's lease.
        assert!(s.renew(&k, &a, LEASE).await.unwrap());
        assert!(!s.renew(&k, &lease(a.generation, "b"), LEASE).await.unwrap());
        // A stops renewing (it died): B notices the expiry and takes over
        // under a newer generation, and only B (a third waiter follows B).
        let b = take_over(&s, &k, a.generation, "b").await;
        assert!(b.generation > a.generation);
        assert_eq!(follow(&s, &k, "c").await, b.generation);
        // A's late answer must not be written over B's flight.
        assert!(matches!(
            complete(&s, &k, &a, "from A").await,
            Completion::Superseded(g) if g == b.generation
        ));
        assert!(matches!(
            complete(&s, &k, &b, "from B").await,
            Completion::Accepted
        ));
        let Begin::Hit(hit, left) = s.begin(&k, "d", LEASE, true, true).await.unwrap() else {
            panic!("no shared answer")
        };
        assert_eq!(&hit.body[..], b"from B");
        assert!(left > Duration::ZERO && left <= KEEP);
        // The waiter that followed B gets B's answer.
        let Remote::Done(got) = s
            .wait_remote(&k, b.generation, "c", LEASE, true)
            .await
            .unwrap()
        else {
            panic!("the waiter did not get the answer")
        };
        assert_eq!(&got.body[..], b"from B");
    }

    #[tokio::test]
    async fn a_waiter_of_a_dead_leader_gets_the_takeovers_answer() {
        let s = shared().await;
        let k = key();
        let a = lead(&s, &k, "a").await;
        let b = take_over(&s, &k, a.generation, "b").await;
        // B's call answers before C looks again: C still awaits A.
        assert!(matches!(
            complete(&s, &k, &b, "from B").await,
            Completion::Accepted
        ));
        for read_cache in [true, false] {
            let Remote::Done(got) = s
                .wait_remote(&k, a.generation, "c", LEASE, read_cache)
                .await
                .unwrap()
            else {
                panic!("C led again after B had answered")
            };
            assert_eq!(&got.body[..], b"from B");
        }
    }

    #[tokio::test]
    async fn a_late_write_after_an_uncached_takeover_goes_nowhere() {
        let s = shared().await;
        let k = key();
        let a = lead(&s, &k, "a").await;
        let b = take_over(&s, &k, a.generation, "b").await;
        // B's answer is not cached (an error, or the cache is off): only its
        // result says the flight ended.
        let uncached = s
            .complete(&k, &b, &answer("from B"), None, None, KEEP)
            .await
            .unwrap();
        assert!(matches!(uncached, Completion::Accepted));
        let Completion::Answered(Some(theirs)) = complete(&s, &k, &a, "from A").await else {
            panic!("A's late write was accepted")
        };
        assert_eq!(&theirs.body[..], b"from B");
        // Nothing of A's reached the cache or the result.
        assert!(matches!(
            s.begin(&k, "d", LEASE, true, true).await.unwrap(),
            Begin::Lead(_)
        ));
    }

    #[tokio::test]
    async fn a_leader_whose_lease_lapsed_unnoticed_may_still_complete() {
        let s = shared().await;
        let k = key();
        let a = lead(&s, &k, "a").await;
        tokio::time::sleep(LEASE * 2).await;
        // Nobody took over: A is still the newest generation, its waiters
        // are waiting for exactly this answer.
        assert!(matches!(
            complete(&s, &k, &a, "from A").await,
            Completion::Accepted
        ));
        let Remote::Done(got) = s
            .wait_remote(&k, a.generation, "b", LEASE, true)
            .await
            .unwrap()
        else {
            panic!("no answer")
        };
        assert_eq!(&got.body[..], b"from A");
    }

    #[tokio::test]
    async fn a_waiter_that_would_lead_takes_a_cached_answer_instead() {
        let s = shared().await;
        let k = key();
        let a = lead(&s, &k, "a").await;
        // Another flight of the same fingerprint (another target, a bypass)
        // filled the shared cache; A's flight itself vanished (its lease).
        let other = FlightKey { target: 1, ..k };
        let o = lead(&s, &other, "o").await;
        assert!(matches!(
            complete(&s, &other, &o, "cached").await,
            Completion::Accepted
        ));
        tokio::time::sleep(LEASE * 2).await;
        let Remote::Hit(got, left) = s
            .wait_remote(&k, a.generation, "b", LEASE, true)
            .await
            .unwrap()
        else {
            panic!("the waiter led although an answer was cached")
        };
        assert_eq!(&got.body[..], b"cached");
        assert!(left > Duration::ZERO);
    }

    #[tokio::test]
    async fn a_published_completion_wakes_the_waiter_before_its_poll() {
        let s = shared_polling(Duration::from_secs(30)).await;
        let k = key();
        let a = match s
            .begin(&k, "a", Duration::from_secs(10), true, true)
            .await
            .unwrap()
        {
            Begin::Lead(g) => lease(g, "a"),
            _ => panic!("no lead"),
        };
        let waiter = {
            let s = s.clone();
            let g = a.generation;
            tokio::spawn(async move {
                // A poll interval far longer than the test: only the message can wake it.
                let started = Instant::now();
                let r = s
                    .wait_remote(&k, g, "b", Duration::from_secs(10), true)
                    .await;
                (r, started.elapsed())
            })
        };
        // Let the waiter arm itself, then complete.
        while s.waiters.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(matches!(
            s.complete(&k, &a, &answer("done"), None, None, KEEP)
                .await
                .unwrap(),
            Completion::Accepted
        ));
        let (r, took) = waiter.await.unwrap();
        assert!(matches!(r.unwrap(), Remote::Done(_)));
        assert!(took < Duration::from_secs(5));
    }

    /// A subscription that lost its channel without a disconnection (as a
    /// cluster client's resubscription may) is found deaf by its probe: the
    /// waiter it left asleep is woken to poll, and subscribing again makes
    /// it hear. Without the probe the waiter sleeps its whole 30 s poll.
    #[tokio::test]
    async fn a_silently_deaf_subscription_is_found_and_heals() {
        let config = Config::from_toml_str("", Source::Embedded, false).unwrap();
        let timeout = Duration::from_millis(250);
        let url = redis_url();
        let (conn, sub, rx) = connect_single(&url, timeout)
            .await
            .unwrap_or_else(|e| panic!("Redis at {url}: {e}"));
        let prefix = format!("idem-unit-{}", uuid::Uuid::now_v7().simple());
        let s = Arc::new(RedisFlights::new(
            conn,
            &prefix,
            timeout,
            Duration::from_secs(30),
            Arc::new(Metrics::new(&config)),
        ));
        // Never subscribed: deaf, though nothing says so.
        tokio::spawn(listen(Arc::downgrade(&s), sub, rx));
        assert!(s.listening());
        let k = key();
        let a = match s.begin(&k, "a", KEEP, true, true).await.unwrap() {
            Begin::Lead(g) => lease(g, "a"),
            _ => panic!("no lead"),
        };
        let waiter = {
            let s = s.clone();
            let g = a.generation;
            tokio::spawn(async move {
                let started = Instant::now();
                let r = s.wait_remote(&k, g, "b", KEEP, true).await;
                (r, started.elapsed())
            })
        };
        while s.waiters.is_empty() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(matches!(
            complete(&s, &k, &a, "done").await,
            Completion::Accepted
        ));
        let (r, took) = waiter.await.unwrap();
        assert!(matches!(r.unwrap(), Remote::Done(_)));
        assert!(took < Duration::from_secs(10), "the waiter slept {took:?}");
        let healed = Instant::now();
        while !s.listening() {
            assert!(
                healed.elapsed() < Duration::from_secs(10),
                "the subscription never heard again"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
