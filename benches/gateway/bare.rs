//! The floor of table 1: a bare reverse proxy on the same libraries idem
//! serves and calls with (tokio's multi-thread runtime, hyper's HTTP/1.1
//! server and hyper-util's pooled client), and nothing else: it reads the
//! request whole, sends it to the provider on a keepalive connection, reads
//! the answer whole and sends it back. What idem costs beyond it is idem's
//! own work; what it costs beyond nginx is the libraries'.
//!
//! It runs as this bench's own executable started again with
//! [`UPSTREAM_ENV`] set (see `main`), so that its CPU is a process's own.

use std::net::SocketAddr;
use std::process::{Command, ExitCode};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};

use crate::procs::{Proc, Workdir};

/// Set to the provider's address, the bench runs as the bare proxy.
pub const UPSTREAM_ENV: &str = "IDEM_BENCH_BARE_PROXY_UPSTREAM";

/// What the proxy prints once it listens.
const LISTENING: &str = "bare proxy listening on ";

/// The bare proxy in this process, if [`UPSTREAM_ENV`] asks for it; its
/// exit code when it stops.
pub fn serve_if_asked() -> Option<ExitCode> {
    let upstream = std::env::var(UPSTREAM_ENV).ok()?;
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bare proxy: cannot start the runtime: {e}");
            return Some(ExitCode::FAILURE);
        }
    };
    Some(match runtime.block_on(serve(&upstream)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bare proxy: {e:#}");
            ExitCode::FAILURE
        }
    })
}

async fn serve(upstream: &str) -> anyhow::Result<()> {
    let upstream: SocketAddr = upstream.parse().context("the upstream address")?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("{LISTENING}{}", listener.local_addr()?);
    loop {
        let (socket, _) = listener.accept().await?;
        let _ = socket.set_nodelay(true);
        let client = client.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                forward(client.clone(), upstream, request)
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(socket), service)
                .await;
        });
    }
}

type Pool = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

/// One request there and its answer back, both read whole, headers as they
/// came (but `host`).
async fn forward(
    client: Pool,
    upstream: SocketAddr,
    request: hyper::Request<hyper::body::Incoming>,
) -> anyhow::Result<hyper::Response<Full<Bytes>>> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    let mut call = hyper::Request::builder()
        .method(parts.method)
        .uri(format!("http://{upstream}{}", parts.uri.path()));
    for (name, value) in &parts.headers {
        if name != hyper::header::HOST {
            call = call.header(name, value);
        }
    }
    let answer = client.request(call.body(Full::new(body))?).await?;
    let (parts, body) = answer.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(hyper::Response::from_parts(parts, Full::new(body)))
}

/// A running bare proxy; killed when dropped.
pub struct Bare {
    pub proc: Proc,
    pub addr: SocketAddr,
}

impl Bare {
    pub async fn start(dir: &Workdir, upstream: SocketAddr) -> anyhow::Result<Bare> {
        let exe = std::env::current_exe().context("the bench's own executable")?;
        let mut command = Command::new(exe);
        command.env(UPSTREAM_ENV, upstream.to_string());
        let mut proc = Proc::spawn_command(command, "bare proxy", dir.file("bare.log"))?;
        let addr = proc
            .wait_for("listening", |line| {
                line.strip_prefix(LISTENING).map(str::to_string)
            })
            .await?;
        Ok(Bare {
            proc,
            addr: addr.parse().context("the bare proxy's address")?,
        })
    }
}
