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

use std::future::Future;
use std::io;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use metrics::Gauge;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::{Layer, ServiceExt};
use tower_http::catch_panic::CatchPanicLayer;

use crate::metrics::ConnectionGauges;

/// How long a client may take to send a request head (or, on a new
/// connection, its first bytes), and how long an HTTP/2 connection may stay
/// without a stream in progress.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Requests one HTTP/2 connection may have in progress at once (hyper's
/// default; a client with more opens more connections).
const MAX_STREAMS_PER_CONNECTION: u32 = 200;
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

/// Serves `router` on `listener` until `shutdown` resolves; then stops
/// accepting, lets each connection finish the request it is serving (idle
/// keep-alive connections close at once) and returns when all have ended.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    connections: ConnectionGauges,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    serve_with(listener, router, connections, shutdown, HEADER_READ_TIMEOUT).await;
}

/// [`serve`] with another bound on a new connection's first bytes, on a
/// request head and on an idle HTTP/2 connection (the tests' way to see it
/// work without waiting 30 s).
async fn serve_with(
    listener: TcpListener,
    router: Router,
    connections: ConnectionGauges,
    shutdown: impl Future<Output = ()> + Send + 'static,
    header_read_timeout: Duration,
) {
    let mut h1 = http1::Builder::new();
    h1.half_close(true)
        .timer(TokioTimer::new())
        .header_read_timeout(header_read_timeout);
    let mut h2 = http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .keep_alive_interval(HTTP2_PING_INTERVAL)
        .keep_alive_timeout(HTTP2_PING_TIMEOUT);
    let common = Arc::new(Common {
        h1,
        h2,
        connections,
        header_read_timeout,
    });
    // Turn every route into its final form once, not per request.
    let router: Router = router.with_state(());
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
        // Answers and stream chunks are small: send each at once, never
        // held back by Nagle's algorithm waiting for the client's ACK.
        if let Err(err) = tcp.set_nodelay(true) {
            tracing::debug!(%err, "cannot set TCP_NODELAY on a client connection");
        }
        // A clone of the router shares its route table (an `Arc`). A
        // handler's panic is caught here, around the router, rather than by
        // a router layer: that would box every request's future once more
        // (a 384-byte allocation for each waiting request), where this
        // wraps it inside the connection's task at no cost in its size.
        let service = CatchPanicLayer::custom(super::panic_response)
            .layer(router.clone())
            .map_request(|req: hyper::Request<Incoming>| req.map(Body::new))
            .map_response(axum_body);
        let common = Arc::clone(&common);
        let closing = closing.clone();
        tasks.spawn(async move {
            // hyper gives an HTTP/1.1 connection its 8 KiB read buffer at
            // once: wait for the first bytes (or the end) so that open idle
            // connections cost next to nothing.
            let protocol = tokio::select! {
                sniffed = tokio::time::timeout(common.header_read_timeout, sniff(&tcp)) => match sniffed {
                    Ok(Ok(Some(protocol))) => protocol,
                    Ok(Ok(None) | Err(_)) | Err(_) => return,
                },
                () = closing.cancelled() => return,
            };
            let _open = Open::count(match protocol {
                Protocol::Http1 => common.connections.http1.clone(),
                Protocol::Http2 => common.connections.http2.clone(),
            });
            let io = TokioIo::new(tcp);
            let Common { h1, h2, .. } = &*common;
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
                            () = idle(&streams, common.header_read_timeout) => {}
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

/// A response with its body as axum's (the panic catcher gives its own).
fn axum_body(
    resp: hyper::Response<tower_http::body::UnsyncBoxBody<bytes::Bytes, axum::BoxError>>,
) -> hyper::Response<Body> {
    resp.map(Body::new)
}

/// What every connection's task shares: in one `Arc` rather than in each
/// task's state, which stays within 1 KiB (the cell tokio allocates for it
/// would otherwise be 1,152 bytes, and jemalloc's next size class 1,280).
struct Common {
    h1: http1::Builder,
    h2: http2::Builder<TokioExecutor>,
    connections: ConnectionGauges,
    header_read_timeout: Duration,
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
        let server = tokio::spawn(serve_with(
            listener,
            router,
            ConnectionGauges::noop(),
            async move {
                let _ = stopped.await;
            },
            limit,
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
