//! A wave: N identical requests sent at once on connections opened
//! beforehand, spread round-robin over one or more gateways, while the
//! provider holds the first upstream call. Over HTTP/1.1 each request has a
//! connection of its own; over HTTP/2 the requests are streams of a few
//! connections.
//!
//! The steps: open every connection; fire (each connection writes its
//! request as soon as a shared flag flips); wait until every request is
//! written, the mock holds a call, and every gateway has gone quiet (no CPU
//! used for 200 ms: all requests read and parked as followers); read their
//! memory; send the same request to the mock directly (the *probe*, held
//! too); release the mock, which then answers every held call after its
//! latency; collect the answers with their times counted from the release.
//! Connections stay open until the last answer is in, as a client's pool
//! keeps them. Then the *burst*: the same request again on every one of
//! them at once, each now a cache hit: the baseline of what answering that
//! many requests costs when nobody waits. The connections are closed after.
//!
//! The probe is the baseline: the upstream's own latency after the release,
//! as a client talking to the provider directly sees it, measured in the
//! same instant as the leader's call.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::sync::watch;

use crate::http::{Conn, Endpoint, H2Conn};
use crate::procs::{Gateway, KEY, MODEL, Mem, Mock, mem_of};

/// How long each phase may take before the wave is given up.
const PHASE_LIMIT: Duration = Duration::from_secs(90);
/// Connections opened at once (stays well under the listen backlog).
const CONNECT_BATCH: usize = 200;

/// How the wave's requests travel.
#[derive(Clone, Copy, Debug)]
pub enum Transport {
    /// One HTTP/1.1 connection per request.
    Http1,
    /// HTTP/2 with prior knowledge: this many connections (spread over the
    /// gateways), the requests spread over them as streams.
    Http2 { connections: usize },
}

impl Transport {
    /// The connections a wave of `n` opens.
    pub fn connections(self, n: usize) -> usize {
        match self {
            Transport::Http1 => n,
            Transport::Http2 { connections } => connections.min(n),
        }
    }
}

/// One client side of the wave: a request's own connection, or a stream of
/// a shared one.
enum Client {
    H1(Conn),
    H2(H2Conn),
}

/// One request of the wave, ready to go.
enum Call {
    H1(Conn, Arc<Vec<u8>>),
    H2(H2Conn, hyper::Request<http_body_util::Full<bytes::Bytes>>),
}

impl Call {
    /// The wave's request on `client`, a connection to gateway `g`.
    fn new(
        client: Client,
        g: usize,
        requests: &[Arc<Vec<u8>>],
        endpoints: &[Endpoint],
        body: &bytes::Bytes,
    ) -> anyhow::Result<Call> {
        Ok(match client {
            Client::H1(conn) => Call::H1(conn, Arc::clone(&requests[g])),
            Client::H2(conn) => Call::H2(
                conn,
                endpoints[g].post_h2("/v1/chat/completions", body.clone())?,
            ),
        })
    }
}

/// One request of the wave.
pub struct Answer {
    /// Which gateway it went to.
    pub gateway: usize,
    /// Status and `Idem-Outcome`, or why there was no answer.
    pub reply: Result<(u16, Option<String>), String>,
    /// From the release of the upstream call to the answer; `None` if it
    /// came before the release.
    pub after_release: Option<Duration>,
}

/// What a wave measured; per-gateway vectors follow the gateways' order.
pub struct Wave {
    pub answers: Vec<Answer>,
    /// Before the connections were opened.
    pub idle_mem: Vec<Mem>,
    /// With every connection open, before any request.
    pub connected_mem: Vec<Mem>,
    /// With every request parked, before the release.
    pub parked_mem: Vec<Mem>,
    /// Highest resident size sampled every 10 ms during the wave.
    pub sampled_peak_kib: Vec<u64>,
    /// VmHWM after the wave.
    pub final_mem: Vec<Mem>,
    /// CPU used from the fire to the quiet point (reading the requests).
    pub cpu_intake: Vec<Duration>,
    /// CPU used from the release to the last answer (answering them; the
    /// connections are closed after it).
    pub cpu_answer: Vec<Duration>,
    pub fire_to_sent: Duration,
    pub fire_to_parked: Duration,
    /// Every gateway went quiet before the release.
    pub quiet: bool,
    /// The mock held a call before the release.
    pub held: bool,
    /// Answers that came before the release (none is expected).
    pub answered_early: usize,
    pub release_to_last: Duration,
    /// The probe's latency after the release (the upstream alone).
    pub probe: Option<Duration>,
    /// The burst of cache hits on the same connections after the wave.
    pub burst: Burst,
    /// Upstream calls the gateways made (the probe not counted).
    pub upstream_calls: u64,
}

/// The same requests again on the wave's connections, all at once, after
/// the wave: every one a cache hit.
pub struct Burst {
    /// From the fire to the last answer.
    pub elapsed: Duration,
    /// CPU of each gateway over that time.
    pub cpu: Vec<Duration>,
    /// Answers with `Idem-Outcome: cache-hit`.
    pub cache_hits: usize,
    /// Requests sent.
    pub sent: usize,
}

/// The one body every request of a wave sends (unique to this wave).
pub fn body() -> String {
    format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"wave {}: what is the capital of France?"}}]}}"#,
        uuid::Uuid::now_v7().simple()
    )
}

/// Opens `n` connections (connection `i` to gateway `i % addrs.len()`).
async fn connect_many(
    addrs: &[SocketAddr],
    n: usize,
    transport: Transport,
) -> anyhow::Result<Vec<(usize, Client)>> {
    let mut conns = Vec::with_capacity(n);
    let mut next = 0;
    while next < n {
        let batch: Vec<usize> = (next..n.min(next + CONNECT_BATCH)).collect();
        next += batch.len();
        let opened = futures_util::future::try_join_all(batch.into_iter().map(|i| {
            let g = i % addrs.len();
            async move {
                let client = match transport {
                    Transport::Http1 => Client::H1(Conn::connect(addrs[g]).await?),
                    Transport::Http2 { .. } => Client::H2(H2Conn::connect(addrs[g]).await?),
                };
                Ok::<_, anyhow::Error>((g, client))
            }
        }))
        .await?;
        conns.extend(opened);
    }
    Ok(conns)
}

fn mems(gateways: &[&Gateway]) -> anyhow::Result<Vec<Mem>> {
    gateways.iter().map(|g| g.proc.mem()).collect()
}

fn cpus(gateways: &[&Gateway]) -> anyhow::Result<Vec<Duration>> {
    gateways.iter().map(|g| g.proc.cpu()).collect()
}

/// Runs a wave of `n` identical requests over `gateways` (round-robin);
/// `mock` must be holding requests.
pub async fn run(
    gateways: &[&Gateway],
    n: usize,
    transport: Transport,
    mock: &Mock,
) -> anyhow::Result<Wave> {
    let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.addr).collect();
    let body = body();
    let endpoints: Vec<Endpoint> = addrs.iter().map(|a| Endpoint::new(*a, Some(KEY))).collect();
    let requests: Vec<Arc<Vec<u8>>> = endpoints
        .iter()
        .map(|e| Arc::new(e.post("/v1/chat/completions", &[], body.as_bytes())))
        .collect();
    let body = bytes::Bytes::from(body);

    let calls_before = mock.calls().await?;
    let idle_mem = mems(gateways)?;
    let opened = connect_many(&addrs, transport.connections(n), transport).await?;
    // Request `i` on connection `i % connections`: HTTP/1.1 connections are
    // taken one per request, HTTP/2 ones shared.
    let mut conns = Vec::with_capacity(n);
    let mut shared = Vec::new();
    for (g, client) in opened {
        match client {
            Client::H1(conn) => conns.push((g, Client::H1(conn))),
            Client::H2(conn) => shared.push((g, conn)),
        }
    }
    for i in 0..n.saturating_sub(conns.len()) {
        if let Some((g, conn)) = shared.get(i % shared.len().max(1)) {
            conns.push((*g, Client::H2(conn.clone())));
        }
    }
    drop(shared);
    let connected_mem = mems(gateways)?;

    // Resident memory sampled all along, for the peak.
    let stop = Arc::new(AtomicBool::new(false));
    let pids: Vec<u32> = gateways.iter().map(|g| g.proc.pid()).collect();
    let sampler = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            let mut peak = vec![0u64; pids.len()];
            while !stop.load(Ordering::Relaxed) {
                for (i, pid) in pids.iter().enumerate() {
                    if let Ok(m) = mem_of(*pid) {
                        peak[i] = peak[i].max(m.rss_kib);
                    }
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            peak
        }
    });

    let (go, ready) = watch::channel(false);
    let sent = Arc::new(AtomicUsize::new(0));
    let answered = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::with_capacity(n);
    for (g, client) in conns {
        let mut ready = ready.clone();
        let (sent, answered) = (Arc::clone(&sent), Arc::clone(&answered));
        let call = Call::new(client, g, &requests, &endpoints, &body)?;
        tasks.push(tokio::spawn(async move {
            let fired = ready.wait_for(|go| *go).await.is_ok();
            // The connection is handed back with the answer and closed only
            // once the whole wave is in, as a client's pool keeps its
            // connections: a close per answer would put 10,000 teardowns
            // in the middle of the fan-out being measured.
            let (reply, keep) = if fired {
                match call {
                    Call::H1(mut conn, request) => {
                        let written = conn.send(&request).await;
                        sent.fetch_add(1, Ordering::SeqCst);
                        let reply = match written {
                            Ok(()) => conn.receive().await,
                            Err(e) => Err(e),
                        };
                        (reply, Some(Client::H1(conn)))
                    }
                    Call::H2(conn, request) => {
                        // Queued on the connection once `send` returns.
                        let answer = conn.send(request);
                        sent.fetch_add(1, Ordering::SeqCst);
                        (answer.await, Some(Client::H2(conn)))
                    }
                }
            } else {
                sent.fetch_add(1, Ordering::SeqCst);
                (Err(anyhow::anyhow!("never fired")), None)
            };
            answered.fetch_add(1, Ordering::SeqCst);
            (g, reply, Instant::now(), keep)
        }));
    }

    let cpu_fired = cpus(gateways)?;
    let fired = Instant::now();
    go.send(true).context("no request task is listening")?;
    while sent.load(Ordering::SeqCst) < n {
        if fired.elapsed() > PHASE_LIMIT {
            bail!(
                "only {} of {n} requests written within {PHASE_LIMIT:?}",
                sent.load(Ordering::SeqCst)
            );
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let fire_to_sent = fired.elapsed();
    let mut held = mock.held(1, PHASE_LIMIT).await?;
    let mut quiet = true;
    for g in gateways {
        quiet &= g.proc.until_quiet(PHASE_LIMIT).await?;
    }
    let fire_to_parked = fired.elapsed();
    let parked_mem = mems(gateways)?;
    let answered_early = answered.load(Ordering::SeqCst);

    // The probe: held like the leader's call, released with it.
    let mut probe = Conn::connect(mock.addr).await?;
    probe
        .send(&Endpoint::new(mock.addr, Some(KEY)).post("/v1/chat/completions", &[], &body))
        .await?;
    let probe = tokio::spawn(async move { probe.receive().await.map(|_| Instant::now()) });
    held &= mock.held(2, PHASE_LIMIT).await?;
    let cpu_parked = cpus(gateways)?;

    let released_at = Instant::now();
    mock.release().await?;
    let mut answers = Vec::with_capacity(n);
    let mut last = released_at;
    let mut kept = Vec::with_capacity(n);
    for task in tasks {
        let (gateway, reply, done, conn) = task.await?;
        kept.extend(conn.map(|c| (gateway, c)));
        last = last.max(done);
        answers.push(Answer {
            gateway,
            reply: reply
                .map(|r| (r.status, r.outcome))
                .map_err(|e| format!("{e:#}")),
            after_release: done.checked_duration_since(released_at),
        });
    }
    let release_to_last = last - released_at;
    let cpu_answered = cpus(gateways)?;
    let probe = probe
        .await?
        .ok()
        .and_then(|done| done.checked_duration_since(released_at));
    let upstream_calls = (mock.calls().await? - calls_before).saturating_sub(1);
    stop.store(true, Ordering::Relaxed);
    let sampled_peak_kib = sampler.await?;
    let final_mem = mems(gateways)?;
    for g in gateways {
        g.proc.until_quiet(PHASE_LIMIT).await?;
    }
    let burst = burst(gateways, kept, &requests, &endpoints, &body).await?;

    let diff = |a: &[Duration], b: &[Duration]| -> Vec<Duration> {
        a.iter().zip(b).map(|(a, b)| a.saturating_sub(*b)).collect()
    };
    Ok(Wave {
        answers,
        idle_mem,
        connected_mem,
        parked_mem,
        sampled_peak_kib,
        final_mem,
        cpu_intake: diff(&cpu_parked, &cpu_fired),
        cpu_answer: diff(&cpu_answered, &cpu_parked),
        fire_to_sent,
        fire_to_parked,
        quiet,
        held,
        answered_early,
        release_to_last,
        probe,
        burst,
        upstream_calls,
    })
}

/// The wave's request again on every connection `kept` (with the gateway
/// each leads to), all at once; closes them after.
async fn burst(
    gateways: &[&Gateway],
    kept: Vec<(usize, Client)>,
    requests: &[Arc<Vec<u8>>],
    endpoints: &[Endpoint],
    body: &bytes::Bytes,
) -> anyhow::Result<Burst> {
    let (go, ready) = watch::channel(false);
    let sent = kept.len();
    let mut tasks = Vec::with_capacity(sent);
    for (g, client) in kept {
        let mut ready = ready.clone();
        let call = Call::new(client, g, requests, endpoints, body)?;
        tasks.push(tokio::spawn(async move {
            if ready.wait_for(|go| *go).await.is_err() {
                return (None, Instant::now(), None);
            }
            // As in the wave, connections are closed once all are answered.
            let (reply, conn) = match call {
                Call::H1(mut conn, request) => {
                    let reply = match conn.send(&request).await {
                        Ok(()) => conn.receive().await,
                        Err(e) => Err(e),
                    };
                    (reply, Some(conn))
                }
                Call::H2(conn, request) => (conn.send(request).await, None),
            };
            (reply.ok().and_then(|r| r.outcome), Instant::now(), conn)
        }));
    }
    let cpu_before = cpus(gateways)?;
    let fired = Instant::now();
    go.send(true).context("no burst task is listening")?;
    let (mut cache_hits, mut last) = (0, fired);
    let mut open = Vec::with_capacity(sent);
    for task in tasks {
        let (outcome, done, conn) = task.await?;
        cache_hits += usize::from(outcome.as_deref() == Some("cache-hit"));
        last = last.max(done);
        open.extend(conn);
    }
    let cpu_after = cpus(gateways)?;
    drop(open);
    Ok(Burst {
        elapsed: last - fired,
        cpu: cpu_after
            .iter()
            .zip(&cpu_before)
            .map(|(a, b)| a.saturating_sub(*b))
            .collect(),
        cache_hits,
        sent,
    })
}
