//! Load generators: a closed loop (N connections, each sends its next
//! request when the last one is answered: maximum throughput) and an open
//! loop (requests on a fixed timeline, whatever the answers do).
//!
//! The open loop measures each latency from the request's *scheduled* send
//! time, so a slow answer that delays the requests queued behind it counts
//! against the server (no coordinated omission). The timeline is kept by a
//! plain thread with `std::thread::sleep` (about 60 us late at worst), not
//! by tokio's 1 ms timer wheel, which alone would add up to 1 ms to every
//! figure.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use tokio::sync::mpsc;

use crate::http::{Conn, Endpoint, Reply};
use crate::procs::MODEL;

/// Builds the bytes of request number `i` (each one may be unique).
pub type Maker = Arc<dyn Fn(u64) -> Vec<u8> + Send + Sync>;

/// What one or more runs saw.
pub struct Run {
    pub statuses: BTreeMap<u16, u64>,
    /// Requests that got no answer (connection failures).
    pub transport_errors: u64,
    /// Latency of every answered request, in microseconds.
    pub hist: Histogram<u64>,
    /// Time spent running (summed over merged runs).
    pub elapsed: Duration,
    /// The first answer that was not 2xx, or the first transport error.
    pub first_error: Option<String>,
}

impl Run {
    pub fn new() -> anyhow::Result<Run> {
        Ok(Run {
            statuses: BTreeMap::new(),
            transport_errors: 0,
            hist: Histogram::new_with_bounds(1, 300_000_000, 3)
                .context("cannot create a histogram")?,
            elapsed: Duration::ZERO,
            first_error: None,
        })
    }

    fn record(&mut self, reply: &anyhow::Result<Reply>, latency: Duration) {
        match reply {
            Ok(r) => {
                *self.statuses.entry(r.status).or_default() += 1;
                self.hist
                    .saturating_record(u64::try_from(latency.as_micros()).unwrap_or(u64::MAX));
                if !(200..300).contains(&r.status) && self.first_error.is_none() {
                    let body = String::from_utf8_lossy(&r.body);
                    self.first_error = Some(format!(
                        "{} {}",
                        r.status,
                        crate::procs::shorten(body.trim(), 120)
                    ));
                }
            }
            Err(e) => {
                self.transport_errors += 1;
                if self.first_error.is_none() {
                    self.first_error = Some(format!("{e:#}"));
                }
            }
        }
    }

    /// Adds another run's figures (and time) to these.
    pub fn absorb(&mut self, other: Run) -> anyhow::Result<()> {
        for (status, n) in other.statuses {
            *self.statuses.entry(status).or_default() += n;
        }
        self.transport_errors += other.transport_errors;
        self.hist
            .add(&other.hist)
            .context("cannot merge histograms")?;
        self.elapsed += other.elapsed;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
        Ok(())
    }

    /// Requests sent (answered or not).
    pub fn sent(&self) -> u64 {
        self.statuses.values().sum::<u64>() + self.transport_errors
    }

    /// 2xx answers.
    pub fn ok(&self) -> u64 {
        self.statuses
            .iter()
            .filter(|(s, _)| (200..300).contains(*s))
            .map(|(_, n)| n)
            .sum()
    }

    pub fn count(&self, status: u16) -> u64 {
        self.statuses.get(&status).copied().unwrap_or(0)
    }

    /// Everything that was not a 2xx answer.
    pub fn failed(&self) -> u64 {
        self.sent() - self.ok()
    }

    /// 2xx answers per second.
    pub fn rate(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs > 0.0 {
            self.ok() as f64 / secs
        } else {
            0.0
        }
    }

    /// The latency at quantile `q`, in milliseconds.
    pub fn ms(&self, q: f64) -> f64 {
        self.hist.value_at_quantile(q) as f64 / 1000.0
    }
}

/// Sends `request`, reconnecting first if the last answer closed the
/// connection or failed.
async fn exchange(
    conn: &mut Option<Conn>,
    addr: SocketAddr,
    request: &[u8],
) -> anyhow::Result<Reply> {
    let c = match conn {
        Some(c) => c,
        None => conn.insert(Conn::connect(addr).await?),
    };
    let reply = c.call(request).await;
    match &reply {
        Ok(r) if !r.close => {}
        _ => *conn = None,
    }
    reply
}

async fn connect_all(addr: SocketAddr, n: usize) -> anyhow::Result<Vec<Conn>> {
    let mut conns = Vec::with_capacity(n);
    for _ in 0..n {
        conns.push(Conn::connect(addr).await?);
    }
    Ok(conns)
}

/// `conns` connections, each sending request after request for `duration`.
pub async fn closed(
    addr: SocketAddr,
    conns: usize,
    duration: Duration,
    make: Maker,
) -> anyhow::Result<Run> {
    closed_loop(addr, conns, Stop::After(Instant::now() + duration), make).await
}

/// `conns` connections, each sending request after request until `total`
/// have been sent between them: a fixed amount of work, whatever the
/// machine's speed.
pub async fn closed_count(
    addr: SocketAddr,
    conns: usize,
    total: u64,
    make: Maker,
) -> anyhow::Result<Run> {
    closed_loop(addr, conns, Stop::Sent(total), make).await
}

/// When a closed loop stops.
#[derive(Clone, Copy)]
enum Stop {
    After(Instant),
    Sent(u64),
}

async fn closed_loop(
    addr: SocketAddr,
    conns: usize,
    stop: Stop,
    make: Maker,
) -> anyhow::Result<Run> {
    let connections = connect_all(addr, conns).await?;
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(conns);
    for conn in connections {
        let (next, make) = (Arc::clone(&next), Arc::clone(&make));
        tasks.push(tokio::spawn(async move {
            let mut run = Run::new()?;
            let mut conn = Some(conn);
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let done = match stop {
                    Stop::After(deadline) => Instant::now() >= deadline,
                    Stop::Sent(total) => i >= total,
                };
                if done {
                    break;
                }
                let request = make(i);
                let sent = Instant::now();
                let reply = exchange(&mut conn, addr, &request).await;
                run.record(&reply, sent.elapsed());
            }
            anyhow::Ok(run)
        }));
    }
    let mut total = Run::new()?;
    for task in tasks {
        total.absorb(task.await??)?;
    }
    total.elapsed = start.elapsed();
    Ok(total)
}

/// `rate` requests per second for `duration`, spread round-robin over
/// `conns` connections; latency counted from each scheduled send time.
pub async fn open(
    addr: SocketAddr,
    rate: u32,
    duration: Duration,
    conns: usize,
    make: Maker,
) -> anyhow::Result<Run> {
    let connections = connect_all(addr, conns).await?;
    let total_requests = (f64::from(rate) * duration.as_secs_f64()).round() as u64;
    let mut senders = Vec::with_capacity(conns);
    let mut tasks = Vec::with_capacity(conns);
    for conn in connections {
        let (tx, mut rx) = mpsc::unbounded_channel::<(u64, Instant)>();
        senders.push(tx);
        let make = Arc::clone(&make);
        tasks.push(tokio::spawn(async move {
            let mut run = Run::new()?;
            let mut conn = Some(conn);
            while let Some((i, scheduled)) = rx.recv().await {
                let request = make(i);
                let reply = exchange(&mut conn, addr, &request).await;
                run.record(&reply, scheduled.elapsed());
            }
            anyhow::Ok(run)
        }));
    }
    // The timeline starts a little later, so the first sends are on time.
    let start = Instant::now() + Duration::from_millis(20);
    let nanos_per_request = 1_000_000_000 / u64::from(rate.max(1));
    let dispatcher = std::thread::spawn(move || {
        for i in 0..total_requests {
            let at = start + Duration::from_nanos(i * nanos_per_request);
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            let slot = usize::try_from(i).unwrap_or(0) % senders.len();
            if senders[slot].send((i, at)).is_err() {
                return;
            }
        }
    });
    let mut total = Run::new()?;
    for task in tasks {
        total.absorb(task.await??)?;
    }
    total.elapsed = start.elapsed();
    tokio::task::spawn_blocking(move || dispatcher.join())
        .await?
        .map_err(|_| anyhow::anyhow!("the dispatcher thread panicked"))?;
    Ok(total)
}

/// Chat completions with a prompt unique to this maker and to `i`: nothing
/// is ever coalesced or served from the cache.
pub fn unique_chats(endpoint: &Endpoint) -> Maker {
    let endpoint = endpoint.clone();
    let tag = uuid::Uuid::now_v7().simple().to_string();
    Arc::new(move |i| {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"{tag} {i}: summarise Hamlet in one line"}}]}}"#
        );
        endpoint.post("/v1/chat/completions", &[], body.as_bytes())
    })
}

/// `POST /v1/jobs` with an `Idempotency-Key`: each key new, or (`repeat`)
/// every key sent twice in a row with the same payload, so half of the
/// requests are repeats, often racing their twin on another connection.
pub fn jobs(endpoint: &Endpoint, repeat: bool) -> Maker {
    jobs_on(endpoint, MODEL, repeat)
}

/// [`jobs`] on the route `model`.
pub fn jobs_on(endpoint: &Endpoint, model: &'static str, repeat: bool) -> Maker {
    let endpoint = endpoint.clone();
    let tag = uuid::Uuid::now_v7().simple().to_string();
    Arc::new(move |i| {
        let k = if repeat { i / 2 } else { i };
        let key = format!("{tag}-{k}");
        let body = format!(
            r#"{{"request":{{"model":"{model}","messages":[{{"role":"user","content":"job {tag} {k}: file the report"}}]}}}}"#
        );
        endpoint.post("/v1/jobs", &[("idempotency-key", &key)], body.as_bytes())
    })
}
