//! The accept loop: one connection task per client, HTTP/1.1 or HTTP/2
//! (cleartext, prior knowledge) on the same port, tuned for a gateway whose
//! requests mostly wait (many parked followers, small answers), with
//! graceful shutdown.
//!
//! Why not `axum::serve`: it offers no way to set hyper's connection
//! options, and two of them matter here. While a request waits, hyper by
//! default keeps reading the socket to notice a client that goes away; each
//! such read grows a fresh 8 KiB read buffer next to the one the request
//! still points into, which for a wave of 10,000 parked followers is most of
//! the gateway's memory. `half_close` stops those reads: a client that
//! leaves is noticed when its answer is written (a waiting request is
//! bounded by `max_wait` or the provider timeout anyway, and upstream calls
//! are detached from their clients by design). And a timer bounds how long a
//! client may take to send a request head (slow-loris connections); a
//! keep-alive connection waiting longer than that for its next request is
//! closed.
//!
//! HTTP/2 is for callers that send many requests at once (a proxy such as
//! Envoy in front of idem, a batch client): its requests share one
//! connection and its buffers, so a parked request costs a few hundred
//! bytes of stream state instead of an HTTP/1.1 connection's two 8 KiB
//! buffers, and a wave's answers leave in a few large writes instead of one
//! system call each. A connection speaks HTTP/2 when it opens with the
//! HTTP/2 preface (`PRI * HTTP/2.0`); there is no TLS here, hence no ALPN
//! and no `Upgrade: h2c` (a TLS-terminating proxy in front of idem talks
//! HTTP/2 to it with prior knowledge).
//!
//! A connection that has sent nothing yet costs only its task: hyper (and
//! its buffers) start at the first bytes, which also tell the two protocols
//! apart. A connection silent for as long as a request head may take is
//! closed, and so is an HTTP/2 connection with no stream in progress for
//! that long (with a GOAWAY, so that a request crossing it is retried
//! safely): an HTTP/1.1 keep-alive connection gets the same treatment from
//! the head timeout.
//!
//! A request's body must then arrive within `server.body_timeout` of its
//! head, however steadily it trickles: past it the request is answered 408
//! and its connection closed (on HTTP/2, its stream). And the connections
//! open at once are capped (`server.max_connections`): past the cap a new
//! one gets a 503 and is closed at once, so that a flood of clients costs a
//! counted refusal each instead of the file descriptors that upstream
//! calls, the store and the logs need too.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body as _, Frame, Incoming, SizeHint};
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use metrics::Gauge;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::{Layer, ServiceExt};
use tower_http::catch_panic::CatchPanicLayer;

use super::error::{ApiError, error_body};
use crate::config::{MaxConnections, ServerConfig};
use crate::metrics::ConnectionGauges;

/// How long a client may take to send a request head (or, on a new
/// connection, its first bytes), and how long an HTTP/2 connection may stay
/// without a stream in progress.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Requests one HTTP/2 connection may have in progress at once (hyper's
/// default; a client with more opens more connections).
const MAX_STREAMS_PER_CONNECTION: u32 = 200;

/// The largest request head (request line and headers) a client may send:
/// 32 KiB, nginx's largest default (`large_client_header_buffers 4 8k`).
/// Past it an HTTP/1.1 request gets a 431 and its connection closes; an
/// HTTP/2 request's header list is refused the same way. (It is also
/// HTTP/1.1's read buffer: a body arrives in reads of at most this.)
pub const MAX_HEAD_BYTES: usize = 32 * 1024;
/// How often an HTTP/2 connection is pinged, and how long the answer may
/// take before the connection counts as dead and is closed (HTTP/2 has no
/// per-request idle timeout to find a peer that vanished).
const HTTP2_PING_INTERVAL: Duration = Duration::from_secs(30);
const HTTP2_PING_TIMEOUT: Duration = Duration::from_secs(20);
/// How long to wait for more bytes when a connection has sent a prefix of
/// `PRI` so far (rare: clients send the preface in one write).
const SNIFF_RETRY: Duration = Duration::from_millis(5);
/// Pause after an accept error that is not about one connection (e.g. out
/// of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);
/// `server.max_connections = "auto"` where the open-file limit cannot be
/// read.
const FALLBACK_MAX_CONNECTIONS: usize = 10_000;

/// What the server holds its clients to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    /// How long a new connection may take to send its first bytes, a
    /// request its head, and how long a connection may stay idle.
    pub head_timeout: Duration,
    /// How long a request's body may take to arrive, from its head.
    pub body_timeout: Duration,
    /// Client connections open at once; more are shed.
    pub max_connections: usize,
}

impl Bounds {
    /// The bounds of `[server]` (`max_connections = "auto"` resolved here).
    pub fn from_config(server: &ServerConfig) -> Bounds {
        let max_connections = match server.max_connections {
            MaxConnections::Fixed(n) => n,
            MaxConnections::Auto => auto_max_connections(open_file_limit()),
        };
        Bounds {
            head_timeout: HEADER_READ_TIMEOUT,
            body_timeout: server.body_timeout,
            max_connections,
        }
    }
}

/// Three quarters of the open-file limit: the other quarter is for upstream
/// calls, the store, Redis and the logs.
fn auto_max_connections(open_files: Option<u64>) -> usize {
    open_files
        .map_or(FALLBACK_MAX_CONNECTIONS, |n| {
            usize::try_from(n / 4 * 3).unwrap_or(MaxConnections::MOST)
        })
        .clamp(1, MaxConnections::MOST)
}

/// The soft limit on open files of this process (Linux: `/proc`), if it
/// has one and it can be read.
fn open_file_limit() -> Option<u64> {
    soft_open_file_limit(&std::fs::read_to_string("/proc/self/limits").ok()?)
}

/// The soft limit in the text of `/proc/self/limits`: the line is
/// "Max open files  <soft>  <hard>  files", and "unlimited" is no limit.
fn soft_open_file_limit(limits: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.trim_start_matches("Max open files")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Serves `router` on `listener` until `shutdown` resolves; then stops
/// accepting, lets each connection finish the request it is serving (idle
/// keep-alive connections close at once) and returns when all have ended.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    connections: ConnectionGauges,
    bounds: Bounds,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    tracing::debug!(
        max_connections = bounds.max_connections,
        body_timeout = ?bounds.body_timeout,
        "client bounds"
    );
    let mut h1 = http1::Builder::new();
    h1.half_close(true)
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.head_timeout)
        .max_buf_size(MAX_HEAD_BYTES);
    let mut h2 = http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .max_header_list_size(MAX_HEAD_BYTES as u32)
        .keep_alive_interval(HTTP2_PING_INTERVAL)
        .keep_alive_timeout(HTTP2_PING_TIMEOUT);
    let common = Arc::new(Common {
        // Every route in its final form once, not per request.
        router: router.with_state(()),
        h1,
        h2,
        connections,
        bounds,
        open: AtomicUsize::new(0),
        shed_answer: shed_answer(),
    });
    // Every connection's task, waited for after the listener closes.
    let tasks = TaskTracker::new();
    // Tells connections to finish the request they serve and close.
    let closing = CancellationToken::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _peer)) => tcp,
                Err(err) if is_connection_error(&err) => continue,
                Err(err) => {
                    tracing::warn!(%err, "cannot accept a connection");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        let Some(admitted) = Admitted::new(&common) else {
            shed(tcp, &common);
            continue;
        };
        // Answers and stream chunks are small: send each at once, never
        // held back by Nagle's algorithm waiting for the client's ACK.
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(%err, "cannot set TCP_NODELAY on a client connection");
        }
        let closing = closing.clone();
        tasks.spawn(async move {
            // hyper gives an HTTP/1.1 connection its 8 KiB read buffer at
            // once: wait for the first bytes (or the end) so that open idle
            // connections cost next to nothing.
            let protocol = tokio::select! {
                sniffed = tokio::time::timeout(admitted.bounds.head_timeout, sniff(&tcp)) => match sniffed {
                    Ok(Ok(Some(protocol))) => protocol,
                    Ok(Ok(None) | Err(_)) | Err(_) => return,
                },
                () = closing.cancelled() => return,
            };
            let _open = Open::count(match protocol {
                Protocol::Http1 => admitted.connections.http1.clone(),
                Protocol::Http2 => admitted.connections.http2.clone(),
            });
            let io = TokioIo::new(tcp);
            let Common { h1, h2, .. } = &*admitted;
            let service = Requests(Arc::clone(&admitted.0));
            let ended = match protocol {
                Protocol::Http1 => {
                    let conn = pin!(h1.serve_connection(io, TowerToHyperService::new(service)));
                    let stop = pin!(closing.cancelled());
                    until_closed(conn, http1::Connection::graceful_shutdown, stop).await
                }
                // Boxed: an HTTP/2 connection is larger than an HTTP/1.1
                // one, and few connections are HTTP/2.
                Protocol::Http2 => {
                    let streams = Arc::new(watch::Sender::new(0usize));
                    let service = TowerToHyperService::new(counted(service, Arc::clone(&streams)));
                    let conn = Box::pin(h2.serve_connection(io, service));
                    let stop = pin!(async {
                        tokio::select! {
                            () = closing.cancelled() => {}
                            () = idle(&streams, admitted.bounds.head_timeout) => {}
                        }
                    });
                    until_closed(conn, http2::Connection::graceful_shutdown, stop).await
                }
            };
            if let Err(err) = ended {
                tracing::trace!(%err, "connection ended with an error");
            }
        });
    }
    drop(listener);
    closing.cancel();
    tasks.close();
    tasks.wait().await;
}

/// What every connection's task shares: in one `Arc` rather than in each
/// task's state, which stays within 1 KiB (the cell tokio allocates for it
/// would otherwise be 1,152 bytes, and jemalloc's next size class 1,280).
struct Common {
    router: Router,
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
    connections: ConnectionGauges,
    bounds: Bounds,
    /// Connections admitted and not yet ended.
    open: AtomicUsize,
    /// What a shed connection is sent.
    shed_answer: Bytes,
}

/// A connection counted against `max_connections` from its accept until
/// its task ends (however it ends). It is the task's handle on [`Common`]
/// too, so the count costs the task no room.
struct Admitted(Arc<Common>);

impl Admitted {
    /// Admits one more connection, or none past the cap.
    fn new(common: &Arc<Common>) -> Option<Admitted> {
        let before = common.open.fetch_add(1, Ordering::AcqRel);
        if before >= common.bounds.max_connections {
            common.open.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(Admitted(Arc::clone(common)))
    }
}

impl std::ops::Deref for Admitted {
    type Target = Common;
    fn deref(&self) -> &Common {
        &self.0
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The whole HTTP/1.1 answer a shed connection gets: 503 with an OpenAI
/// error object, `Retry-After` and `Connection: close`.
fn shed_answer() -> Bytes {
    let body = error_body(
        "too many open connections; retry later",
        "server_error",
        "too_many_connections",
        None,
    )
    .to_string();
    Bytes::from(format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
         retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    ))
}

/// Sheds a connection past the cap, without a task and without reading
/// it: the answer is written at once (a fresh socket's send buffer holds
/// it; if it does not, the client gets the close alone), the sending side
/// is shut so that the client reads the answer and its end even if the
/// close then resets the connection over an unread request, and the socket
/// is closed.
fn shed(tcp: TcpStream, common: &Common) {
    common.connections.shed.increment(1);
    tracing::debug!(
        max_connections = common.bounds.max_connections,
        "connection shed: too many open"
    );
    let _ = tcp.try_write(&common.shed_answer);
    if let Ok(tcp) = tcp.into_std() {
        let _ = tcp.shutdown(std::net::Shutdown::Write);
    }
}

/// The service of one connection: the router, each request's body bound
/// to arrive within `server.body_timeout` of its head (a request whose
/// body did not is answered 408, whatever its handler made of the body's
/// error, and its connection closed).
///
/// A handler's panic is caught here, around the router, rather than by a
/// router layer: that would box every request's future once more (a
/// 384-byte allocation for each waiting request), where this wraps it
/// inside the connection's task at no cost in its size. The service itself
/// is one `Arc` (hyper keeps it in the connection's task, and clones it
/// for each request); the router's clone for a request shares its route
/// table.
#[derive(Clone)]
struct Requests(Arc<Common>);

/// A handler's answer (or a 500 for its panic), before the body check.
type Answer = tower_http::catch_panic::ResponseFuture<
    axum::routing::future::RouteFuture<Infallible>,
    PanicAnswer,
>;

impl tower::Service<hyper::Request<Incoming>> for Requests {
    type Response = Response;
    type Error = Infallible;
    type Future = Deadlined;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // A router is always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: hyper::Request<Incoming>) -> Deadlined {
        // hyper stops reading a head at about twice its buffer; the cap
        // itself is exact here.
        if head_bytes(&req) > MAX_HEAD_BYTES {
            return Deadlined {
                answer: None,
                ready: Some(
                    ApiError::HeadTooLarge {
                        limit: MAX_HEAD_BYTES,
                    }
                    .into_response(),
                ),
                clock: None,
            };
        }
        let mut router = CatchPanicLayer::custom(PanicAnswer).layer(self.0.router.clone());
        // A request without a body (or whose body is all in) has nothing to
        // wait for: no clock.
        if req.body().is_end_stream() {
            return Deadlined {
                answer: Some(router.call(req.map(Body::new))),
                ready: None,
                clock: None,
            };
        }
        let limit = self.0.bounds.body_timeout;
        let clock = Arc::new(BodyClock {
            deadline: Instant::now() + limit,
            limit,
            expired: AtomicBool::new(false),
        });
        let req = req.map(|inner| {
            Body::new(TimedBody {
                inner: Some(inner),
                timer: None,
                clock: Arc::clone(&clock),
            })
        });
        Deadlined {
            answer: Some(router.call(req)),
            ready: None,
            clock: Some(clock),
        }
    }
}

/// The size of a request's head as the client sent it (about: the request
/// line and each header's name, value and separators).
fn head_bytes<B>(req: &hyper::Request<B>) -> usize {
    let uri = req.uri();
    let line = req.method().as_str().len()
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.path_and_query().map_or(0, |p| p.as_str().len())
        + 12;
    req.headers().iter().fold(line, |n, (name, value)| {
        n + name.as_str().len() + value.len() + 4
    })
}

/// The answer to a request whose handler panicked: a 500 with an OpenAI
/// error object.
#[derive(Clone, Copy)]
struct PanicAnswer;

impl tower_http::catch_panic::ResponseForPanic for PanicAnswer {
    type ResponseBody = Body;

    fn response_for_panic(&mut self, err: Box<dyn std::any::Any + Send + 'static>) -> Response {
        super::panic_response(err)
    }
}

/// The deadline of one request's body, shared by the body and the answer.
struct BodyClock {
    deadline: Instant,
    limit: Duration,
    /// Set by the body when it failed for want of time.
    expired: AtomicBool,
}

/// A request's answer, replaced by a 408 if its body ran out of time (or
/// an answer ready at once: the head was too large).
struct Deadlined {
    answer: Option<Answer>,
    ready: Option<Response>,
    clock: Option<Arc<BodyClock>>,
}

impl Future for Deadlined {
    type Output = Result<Response, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some(ready) = this.ready.take() {
            return Poll::Ready(Ok(ready));
        }
        let Some(answer) = this.answer.as_mut() else {
            // Polled again after its answer: never, by hyper.
            return Poll::Pending;
        };
        let answer = ready!(Pin::new(answer).poll(cx))?;
        Poll::Ready(Ok(match &this.clock {
            // `Connection: close` (hyper drops it on HTTP/2, where the
            // stream ends instead) tells an HTTP/1.1 client not to reuse a
            // connection whose request was not read to its end.
            Some(c) if c.expired.load(Ordering::Acquire) => {
                ApiError::BodyTimeout { limit: c.limit }.into_response()
            }
            _ => answer.map(Body::new),
        }))
    }
}

/// A request body that must end by its clock's deadline. Past it, while
/// the client still has not sent it all, it fails (and says so on the
/// clock). A timer is armed only if the body is not all in at the first
/// read.
struct TimedBody {
    inner: Option<Incoming>,
    timer: Option<Pin<Box<Sleep>>>,
    clock: Arc<BodyClock>,
}

/// The error a [`TimedBody`] ends with past its deadline.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive in time")]
struct BodyTimedOut;

impl hyper::body::Body for TimedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let TimedBody {
            inner,
            timer,
            clock,
        } = self.get_mut();
        let Some(body) = inner else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(frame) = Pin::new(body).poll_frame(cx) {
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        let timer = timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(clock.deadline)));
        ready!(timer.as_mut().poll(cx));
        clock.expired.store(true, Ordering::Release);
        // Read no further: the answer is a 408 and the connection closes.
        *inner = None;
        Poll::Ready(Some(Err(BodyTimedOut.into())))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Incoming::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Incoming::size_hint)
    }
}

/// Drives a connection to its end; once `stop` resolves, asks it to finish
/// gracefully (the requests in progress are answered, then it closes; an
/// HTTP/2 peer gets a GOAWAY).
///
/// `stop` is pinned by the caller: moved in, it would take its room in the
/// connection's state twice (the argument's slot, then `select!`'s).
async fn until_closed<C, T, S>(
    mut conn: Pin<C>,
    graceful_shutdown: impl FnOnce(Pin<&mut T>),
    mut stop: Pin<&mut S>,
) -> T::Output
where
    C: std::ops::DerefMut<Target = T>,
    T: Future + ?Sized,
    S: Future<Output = ()> + ?Sized,
{
    tokio::select! {
        ended = conn.as_mut() => return ended,
        () = stop.as_mut() => graceful_shutdown(conn.as_mut()),
    }
    conn.await
}

/// The service of one HTTP/2 connection, counting its streams in progress
/// in `streams`: from the request until its answer's body is dropped (sent
/// in full, or the stream reset), so that a long answer still streaming
/// keeps the connection busy.
fn counted<S>(
    service: S,
    streams: Arc<watch::Sender<usize>>,
) -> impl tower::Service<
    hyper::Request<Incoming>,
    Response = axum::response::Response,
    Error = S::Error,
    Future = impl Future<Output = Result<axum::response::Response, S::Error>> + Send,
> + Clone
+ Send
where
    S: tower::Service<
            hyper::Request<Incoming>,
            Response = axum::response::Response,
            Future: Send + 'static,
        > + Clone
        + Send,
{
    service.map_future(move |answer| {
        let stream = Stream::open(&streams);
        async move {
            let resp = answer.await?;
            Ok(resp.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _open = &stream;
                    frame
                }))
            }))
        }
    })
}

/// One HTTP/2 stream in progress, until dropped.
struct Stream(Arc<watch::Sender<usize>>);

impl Stream {
    fn open(streams: &Arc<watch::Sender<usize>>) -> Stream {
        streams.send_modify(|n| *n += 1);
        Stream(Arc::clone(streams))
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// Resolves once a connection has had no stream in progress for `limit`.
async fn idle(streams: &watch::Sender<usize>, limit: Duration) {
    let mut open = streams.subscribe();
    loop {
        let busy = *open.borrow_and_update() > 0;
        if busy {
            // The sender lives as long as the connection: no error here.
            let _ = open.changed().await;
        } else if tokio::time::timeout(limit, open.changed()).await.is_err() {
            return;
        }
    }
}

/// One open connection on its protocol's gauge, until dropped (however the
/// connection's task ends).
struct Open(Gauge);

impl Open {
    fn count(gauge: Gauge) -> Open {
        gauge.increment(1.0);
        Open(gauge)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// The protocol a connection speaks, told by its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    Http1,
    Http2,
}

/// The start of the HTTP/2 connection preface (`PRI` is no HTTP/1.1
/// method: RFC 9113 reserves it for the preface); hyper checks the rest.
const PREFACE_START: &[u8] = b"PRI";

/// Waits for a connection's first bytes and tells its protocol from them,
/// without consuming them; `None` if the client closed without a byte.
/// (`peek` waits for data; `readable` alone may wake spuriously.)
async fn sniff(tcp: &tokio::net::TcpStream) -> io::Result<Option<Protocol>> {
    let mut first = [0u8; PREFACE_START.len()];
    loop {
        let n = tcp.peek(&mut first).await?;
        let got = first.get(..n).unwrap_or_default();
        if n == 0 {
            return Ok(None);
        }
        if !PREFACE_START.starts_with(got) {
            return Ok(Some(Protocol::Http1));
        }
        if n == PREFACE_START.len() {
            return Ok(Some(Protocol::Http2));
        }
        // A prefix of `PRI` so far: peeking again would return the same
        // bytes at once, so wait a moment for the rest.
        tokio::time::sleep(SNIFF_RETRY).await;
    }
}

/// Errors that concern one connection only (the client gave up before we
/// accepted it): accept the next one at once.
fn is_connection_error(err: &io::Error) -> bool {
    matches!(
        err.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    use super::*;

    /// A connected pair: (client side, server side).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (server, _) = listener.accept().await.unwrap();
        (client, server)
    }

    #[tokio::test]
    async fn the_first_bytes_tell_the_protocol_and_stay_unread() {
        for (sent, expected) in [
            (
                &b"POST /v1/chat/completions HTTP/1.1\r\n"[..],
                Protocol::Http1,
            ),
            (b"GET /healthz HTTP/1.1\r\n", Protocol::Http1),
            (b"PUT /x HTTP/1.1\r\n", Protocol::Http1),
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", Protocol::Http2),
        ] {
            let (mut client, server) = pair().await;
            client.write_all(sent).await.unwrap();
            assert_eq!(sniff(&server).await.unwrap(), Some(expected), "{sent:?}");
            // Peeked, not read: hyper still sees every byte.
            let mut all = vec![0u8; sent.len()];
            server.peek(&mut all).await.unwrap();
            assert_eq!(all, sent);
        }
    }

    #[tokio::test]
    async fn a_prefix_of_the_preface_waits_for_the_byte_that_decides() {
        let (mut client, server) = pair().await;
        client.write_all(b"PR").await.unwrap();
        let sniffing = tokio::spawn(async move { sniff(&server).await.unwrap() });
        tokio::time::sleep(SNIFF_RETRY * 4).await;
        assert!(!sniffing.is_finished(), "decided on an ambiguous prefix");
        client.write_all(b"I * HTTP/2.0\r\n").await.unwrap();
        assert_eq!(sniffing.await.unwrap(), Some(Protocol::Http2));

        let (mut client, server) = pair().await;
        client.write_all(b"P").await.unwrap();
        let sniffing = tokio::spawn(async move { sniff(&server).await.unwrap() });
        client.write_all(b"OST / HTTP/1.1\r\n").await.unwrap();
        assert_eq!(sniffing.await.unwrap(), Some(Protocol::Http1));
    }

    /// How long a test waits for the gateway to close a connection.
    const PATIENCE: Duration = Duration::from_secs(5);

    /// Reads until the server closes; how long that took.
    async fn until_closed(mut tcp: TcpStream) -> (Duration, String) {
        use tokio::io::AsyncReadExt;
        let started = std::time::Instant::now();
        let mut got = Vec::new();
        tokio::time::timeout(PATIENCE, tcp.read_to_end(&mut got))
            .await
            .expect("the connection was not closed")
            .unwrap();
        (
            started.elapsed(),
            String::from_utf8_lossy(&got).into_owned(),
        )
    }

    /// Serves `router` on a free port with `limit` as the head and idle
    /// timeout; sending on the returned channel shuts it down.
    async fn start(
        router: Router,
        limit: Duration,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let bounds = Bounds {
            head_timeout: limit,
            body_timeout: limit,
            max_connections: 100,
        };
        let server = tokio::spawn(serve(
            listener,
            router,
            ConnectionGauges::noop(),
            bounds,
            async move {
                let _ = stopped.await;
            },
        ));
        (addr, stop, server)
    }

    /// Slow-loris defences: a connection that sends nothing, one that sends
    /// half a request head, and an idle keep-alive one are each closed once
    /// the head timeout has passed (and not before), while a request that
    /// arrives in time is served.
    #[tokio::test]
    async fn silent_slow_and_idle_connections_are_closed_after_the_head_timeout() {
        const LIMIT: Duration = Duration::from_millis(300);
        let router = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let (addr, stop, server) = start(router, LIMIT).await;

        let silent = TcpStream::connect(addr).await.unwrap();
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: idem\r\n")
            .await
            .unwrap();
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: idem\r\n\r\n")
            .await
            .unwrap();
        let (silent, slow, idle) =
            tokio::join!(until_closed(silent), until_closed(slow), until_closed(idle));
        for (what, (took, _)) in [("silent", &silent), ("slow", &slow), ("idle", &idle)] {
            assert!(
                *took >= LIMIT / 2,
                "{what} closed after {took:?}, before its time"
            );
        }
        assert!(
            slow.1.is_empty() || slow.1.starts_with("HTTP/1.1 408"),
            "{}",
            slow.1
        );
        assert!(idle.1.starts_with("HTTP/1.1 200"), "{}", idle.1);
        assert!(idle.1.ends_with("ok"), "{}", idle.1);

        let _ = stop.send(());
        tokio::time::timeout(PATIENCE, server)
            .await
            .unwrap()
            .unwrap();
    }

    #[test]
    fn auto_max_connections_leaves_a_quarter_of_the_open_file_limit() {
        assert_eq!(auto_max_connections(Some(1024)), 768);
        assert_eq!(auto_max_connections(Some(20_000)), 15_000);
        assert_eq!(auto_max_connections(Some(1)), 1);
        assert_eq!(auto_max_connections(Some(u64::MAX)), MaxConnections::MOST);
        assert_eq!(auto_max_connections(None), FALLBACK_MAX_CONNECTIONS);
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             127431               127431               processes \n\
                      Max open files            20000                1048576              files     \n";
        assert_eq!(soft_open_file_limit(limits), Some(20_000));
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(soft_open_file_limit(unlimited), None);
        assert_eq!(soft_open_file_limit(""), None);
        #[cfg(target_os = "linux")]
        assert!(open_file_limit().is_some(), "/proc/self/limits unread");
    }

    #[tokio::test]
    async fn a_connection_closed_before_its_first_byte_has_no_protocol() {
        let (client, server) = pair().await;
        drop(client);
        assert_eq!(sniff(&server).await.unwrap(), None);
    }

    /// An HTTP/2 connection (prior knowledge) to `addr`, driven by a task
    /// that ends when the connection does.
    async fn h2_connect(
        addr: std::net::SocketAddr,
    ) -> (
        hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>>,
        tokio::task::JoinHandle<hyper::Result<()>>,
    ) {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        (sender, tokio::spawn(conn))
    }

    fn get(path: &str) -> hyper::Request<http_body_util::Full<bytes::Bytes>> {
        hyper::Request::get(format!("http://idem{path}"))
            .body(http_body_util::Full::default())
            .unwrap()
    }

    /// How long a connection's task took to end from now (it must end).
    async fn ends_in(conn: tokio::task::JoinHandle<hyper::Result<()>>) -> Duration {
        let started = std::time::Instant::now();
        tokio::time::timeout(PATIENCE, conn)
            .await
            .expect("the connection was not closed")
            .unwrap()
            .expect("the connection ended with an error, not a GOAWAY");
        started.elapsed()
    }

    /// A handler that panics: its request gets a 500 with an OpenAI error
    /// body, and its connection goes on serving, over HTTP/1.1 and HTTP/2.
    #[tokio::test]
    async fn a_panicking_handler_answers_500_and_its_connection_goes_on() {
        let router = Router::new()
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            .route(
                "/boom",
                axum::routing::get(|| async {
                    if true {
                        panic!("a handler's bug");
                    }
                    "unreachable"
                }),
            );
        let (addr, stop, server) = start(router, PATIENCE).await;

        let http1 = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()
            .unwrap();
        for _ in 0..2 {
            let r = http1
                .get(format!("http://{addr}/boom"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 500);
            let body: serde_json::Value = r.json().await.unwrap();
            assert_eq!(body["error"]["code"], "internal_error", "{body}");
            let r = http1
                .get(format!("http://{addr}/healthz"))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
        }

        let (mut sender, conn) = h2_connect(addr).await;
        let r = sender.send_request(get("/boom")).await.unwrap();
        assert_eq!(r.status(), 500);
        let r = sender.send_request(get("/healthz")).await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(!conn.is_finished());

        drop(sender);
        stop.send(()).unwrap();
        server.await.unwrap();
    }

    /// An HTTP/2 connection is closed (GOAWAY) once it has had no stream
    /// in progress for the limit, and not while a request waits for its
    /// answer or an answer's body is still being sent.
    #[tokio::test]
    async fn an_idle_http2_connection_is_closed_and_a_busy_one_is_not() {
        const LIMIT: Duration = Duration::from_millis(300);
        let gate = Arc::new(tokio::sync::Notify::new());
        let slow = {
            let gate = Arc::clone(&gate);
            move || async move {
                // The answer's head waits for the gate, then its body waits
                // for it again between two chunks.
                gate.notified().await;
                let chunks = futures_util::stream::unfold(0, move |step| {
                    let gate = Arc::clone(&gate);
                    async move {
                        match step {
                            0 => Some((Ok::<_, io::Error>("a"), 1)),
                            1 => {
                                gate.notified().await;
                                Some((Ok("b"), 2))
                            }
                            _ => None,
                        }
                    }
                });
                Body::from_stream(chunks)
            }
        };
        let router = Router::new()
            .route("/healthz", axum::routing::get(|| async { "ok" }))
            .route("/slow", axum::routing::get(slow));
        let (addr, stop, server) = start(router, LIMIT).await;

        // Served, then idle: closed after the limit, not before.
        let (mut sender, conn) = h2_connect(addr).await;
        let r = sender.send_request(get("/healthz")).await.unwrap();
        assert_eq!(r.status(), 200);
        let took = ends_in(conn).await;
        assert!(took >= LIMIT / 2, "closed after {took:?}, before its time");

        // Busy: a request waiting for its answer, then a body in progress.
        let (sender, conn) = h2_connect(addr).await;
        // A clone sends: the client's end of the connection stays open as
        // long as one `SendRequest` lives.
        let mut sending = sender.clone();
        let answer = tokio::spawn(async move { sending.send_request(get("/slow")).await });
        tokio::time::sleep(LIMIT * 3).await;
        assert!(!conn.is_finished(), "closed while a request waited");
        gate.notify_one();
        let mut body = answer.await.unwrap().unwrap().into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(&first[..], b"a");
        tokio::time::sleep(LIMIT * 3).await;
        assert!(!conn.is_finished(), "closed while an answer was being sent");
        gate.notify_one();
        let rest = body.collect().await.unwrap().to_bytes();
        assert_eq!(&rest[..], b"b");
        let took = ends_in(conn).await;
        drop(sender);
        // Closed at once would mean the idle clock ran (and a GOAWAY went
        // out) while the request or its answer was in progress.
        assert!(
            took >= LIMIT / 2,
            "closed {took:?} after the answer ended: counted idle while busy"
        );

        let _ = stop.send(());
        tokio::time::timeout(PATIENCE, server)
            .await
            .unwrap()
            .unwrap();
    }
}
