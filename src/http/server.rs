//! The accept loop: one HTTP/1.1 connection task per client, tuned for a
//! gateway whose requests mostly wait (many parked followers, small
//! answers), with graceful shutdown.
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
//! A connection that has sent nothing yet costs only its task: hyper (and
//! its buffers) start at the first byte.

use std::future::Future;
use std::io;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// How long a client may take to send a request head.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause after an accept error that is not about one connection (e.g. out
/// of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Serves `router` on `listener` until `shutdown` resolves; then stops
/// accepting, lets each connection finish the request it is serving (idle
/// keep-alive connections close at once) and returns when all have ended.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let mut http = hyper::server::conn::http1::Builder::new();
    http.half_close(true)
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    // Turn every route into its final form once, not per request.
    let router: Router = router.with_state(());
    let graceful = GracefulShutdown::new();
    // Tells connections still waiting for their first bytes to close.
    let closing = CancellationToken::new();
    let mut shutdown = std::pin::pin!(shutdown);
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
        // A clone of the router shares its route table (an `Arc`).
        let service = router
            .clone()
            .map_request(|req: hyper::Request<Incoming>| req.map(Body::new));
        let http = http.clone();
        let (watcher, closing) = (graceful.watcher(), closing.clone());
        tokio::spawn(async move {
            // hyper gives a connection its 8 KiB read buffer at once: wait
            // for the request's first byte (or the end) so that open idle
            // connections cost next to nothing. (`readable` alone may wake
            // spuriously; `peek` waits for a byte.)
            let mut first = [0u8; 1];
            tokio::select! {
                peeked = tcp.peek(&mut first) => if !matches!(peeked, Ok(1..)) { return },
                () = closing.cancelled() => return,
            }
            let conn = http.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(service));
            if let Err(err) = watcher.watch(conn).await {
                tracing::trace!(%err, "connection ended with an error");
            }
        });
    }
    drop(listener);
    closing.cancel();
    graceful.shutdown().await;
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
