//! A minimal HTTP/1.1 keep-alive client over a raw `TcpStream`, and an
//! HTTP/2 one (hyper's, prior knowledge) for the wave over HTTP/2.
//!
//! Why not reqwest: the load generator shares two cores with the gateway and
//! the mock, so it must cost little per request, and the wave (table 2)
//! must know the moment each request has left (its bytes are written) on a
//! connection opened beforehand. A request is a prebuilt byte string; an
//! answer is read by `Content-Length` or chunked encoding. Only what the
//! suite needs: no redirects, no TLS, no `Expect: 100-continue`.

use std::net::SocketAddr;

use anyhow::{Context, bail};
use bytes::{Buf, Bytes, BytesMut};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A response head larger than this is an error, not a reason to buffer on.
const MAX_HEAD: usize = 64 * 1024;

/// Where requests go, and the API key they carry.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub addr: SocketAddr,
    key: Option<String>,
}

impl Endpoint {
    pub fn new(addr: SocketAddr, key: Option<&str>) -> Endpoint {
        Endpoint {
            addr,
            key: key.map(str::to_string),
        }
    }

    /// The bytes of `POST path` with a JSON body and extra headers.
    pub fn post(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
        let mut head = format!(
            "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
            self.addr,
            body.len()
        );
        if let Some(key) = &self.key {
            head.push_str(&format!("authorization: Bearer {key}\r\n"));
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(body);
        bytes
    }
}

/// One answer: what the suite looks at.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    /// The `Idem-Outcome` header (leader, follower, cache-hit, ...).
    pub outcome: Option<String>,
    /// The server will close the connection after this answer.
    pub close: bool,
    pub body: Bytes,
}

/// One keep-alive connection.
pub struct Conn {
    stream: TcpStream,
    buf: BytesMut,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<Conn> {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("cannot connect to {addr}"))?;
        // Small requests must not wait for Nagle's algorithm.
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream,
            buf: BytesMut::with_capacity(2 * 1024),
        })
    }

    /// Writes a whole request; when this returns, it is in the kernel.
    pub async fn send(&mut self, request: &[u8]) -> anyhow::Result<()> {
        self.stream
            .write_all(request)
            .await
            .context("cannot write the request")
    }

    /// Reads one whole answer.
    pub async fn receive(&mut self) -> anyhow::Result<Reply> {
        let head_end = loop {
            if let Some(i) = find(&self.buf, b"\r\n\r\n") {
                break i;
            }
            if self.buf.len() > MAX_HEAD {
                bail!("response head larger than {MAX_HEAD} bytes");
            }
            self.fill().await?;
        };
        let head = self.buf.split_to(head_end + 4).freeze();
        let text = std::str::from_utf8(&head).context("response head is not UTF-8")?;
        let mut lines = text.split("\r\n");
        let status_line = lines.next().unwrap_or_default();
        let status: u16 = status_line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("bad status line {status_line:?}"))?;
        let (mut length, mut chunked, mut outcome, mut close) = (None, false, None, false);
        for line in lines {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            if name.eq_ignore_ascii_case("content-length") {
                length = Some(value.parse::<usize>().context("bad content-length")?);
            } else if name.eq_ignore_ascii_case("transfer-encoding") {
                chunked = value.to_ascii_lowercase().contains("chunked");
            } else if name.eq_ignore_ascii_case("idem-outcome") {
                outcome = Some(value.to_string());
            } else if name.eq_ignore_ascii_case("connection") {
                close = value.eq_ignore_ascii_case("close");
            }
        }
        let body = if chunked {
            self.chunked_body().await?
        } else {
            let length = length.unwrap_or(0);
            while self.buf.len() < length {
                self.fill().await?;
            }
            self.buf.split_to(length).freeze()
        };
        Ok(Reply {
            status,
            outcome,
            close,
            body,
        })
    }

    /// `send` then `receive`.
    pub async fn call(&mut self, request: &[u8]) -> anyhow::Result<Reply> {
        self.send(request).await?;
        self.receive().await
    }

    async fn fill(&mut self) -> anyhow::Result<()> {
        if self.buf.capacity() - self.buf.len() < 1024 {
            self.buf.reserve(4 * 1024);
        }
        let n = self
            .stream
            .read_buf(&mut self.buf)
            .await
            .context("cannot read the response")?;
        if n == 0 {
            bail!("the server closed the connection");
        }
        Ok(())
    }

    async fn line(&mut self) -> anyhow::Result<usize> {
        loop {
            if let Some(i) = find(&self.buf, b"\r\n") {
                return Ok(i);
            }
            self.fill().await?;
        }
    }

    async fn chunked_body(&mut self) -> anyhow::Result<Bytes> {
        let mut body = BytesMut::new();
        loop {
            let end = self.line().await?;
            let size_line = std::str::from_utf8(&self.buf[..end]).context("bad chunk size")?;
            let size_text = size_line.split(';').next().unwrap_or_default().trim();
            let size = usize::from_str_radix(size_text, 16)
                .with_context(|| format!("bad chunk size {size_text:?}"))?;
            self.buf.advance(end + 2);
            if size == 0 {
                // Trailers, up to an empty line.
                loop {
                    let end = self.line().await?;
                    self.buf.advance(end + 2);
                    if end == 0 {
                        return Ok(body.freeze());
                    }
                }
            }
            while self.buf.len() < size + 2 {
                self.fill().await?;
            }
            body.extend_from_slice(&self.buf[..size]);
            self.buf.advance(size + 2);
        }
    }
}

/// One HTTP/2 connection (cleartext, prior knowledge): clones share it,
/// each request is a stream of it.
#[derive(Clone)]
pub struct H2Conn {
    sender: hyper::client::conn::http2::SendRequest<Full<Bytes>>,
}

impl H2Conn {
    pub async fn connect(addr: SocketAddr) -> anyhow::Result<H2Conn> {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("cannot connect to {addr}"))?;
        stream.set_nodelay(true)?;
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .with_context(|| format!("no HTTP/2 handshake with {addr}"))?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                eprintln!("bench: HTTP/2 connection failed: {e}");
            }
        });
        Ok(H2Conn { sender })
    }

    /// Hands `request` to the connection at once; the returned future is
    /// its answer.
    pub fn send(
        &self,
        request: hyper::Request<Full<Bytes>>,
    ) -> impl std::future::Future<Output = anyhow::Result<Reply>> + use<> {
        let mut sender = self.sender.clone();
        let answer = sender.send_request(request);
        async move {
            let r = answer.await.context("no HTTP/2 answer")?;
            let status = r.status().as_u16();
            let outcome = r
                .headers()
                .get("idem-outcome")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = r
                .into_body()
                .collect()
                .await
                .context("cannot read an HTTP/2 answer")?
                .to_bytes();
            Ok(Reply {
                status,
                outcome,
                close: false,
                body,
            })
        }
    }
}

impl Endpoint {
    /// `POST path` with a JSON body, as an HTTP/2 request.
    pub fn post_h2(&self, path: &str, body: Bytes) -> anyhow::Result<hyper::Request<Full<Bytes>>> {
        let mut request = hyper::Request::post(format!("http://{}{path}", self.addr))
            .header("content-type", "application/json");
        if let Some(key) = &self.key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        request
            .body(Full::new(body))
            .context("cannot build a request")
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}
