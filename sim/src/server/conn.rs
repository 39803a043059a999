//! Connections: the process's tokio runtime, each replica's accept loop, and the HTTP/1 limits a
//! replica holds to (hyper serves the protocol; these are the simulator's own rules on top).
//!
//! Requests the replica refuses before routing, each with an OpenAI-style error and the connection
//! closed: a request target not in origin form (400), a chunked body (411: a real engine's clients
//! send `Content-Length`), a body over [`MAX_BODY`] (413, refused from the header, the body not
//! read). A head hyper cannot parse, or one over [`MAX_HEAD`], hyper answers itself (400, 431);
//! [`JsonErrors`] gives that answer the same JSON body as every other error. A body cut short by its
//! client gets no answer: the connection just closes.

use super::api::{self, ApiError};
use super::{REPLICA_HEADER, Shared};
use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, Response, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Runtime;
use tower::ServiceExt;

/// Largest request body accepted (larger gets 413).
pub const MAX_BODY: usize = 16 << 20;
/// Largest request head (request line and headers) accepted (larger gets 431).
pub const MAX_HEAD: usize = 64 << 10;
/// How long a connection may take to send a request head, idle keep-alive time included.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Connections served at once; more are answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 1024;
/// Headers a request may carry (more gets 431).
const MAX_HEADERS: usize = 200;

/// The runtime every replica of the process shares: the simulator's replicas are started from plain
/// threads (the binary, tests, the harness), so the runtime is the server's own, made on first use.
fn runtime() -> &'static Runtime {
    static RT: OnceLock<Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("kvsteer-sim-http")
            .enable_all()
            .build()
            .expect("the simulator's tokio runtime starts")
    })
}

/// Starts the replica's accept loop on `listener` (already bound).
pub(super) fn listen(shared: Arc<Shared>, listener: std::net::TcpListener) -> io::Result<()> {
    listener.set_nonblocking(true)?;
    let rt = runtime();
    let listener = {
        let _entered = rt.enter();
        TcpListener::from_std(listener)?
    };
    let app = api::router(shared.clone());
    rt.spawn(accept(shared, listener, app));
    Ok(())
}

async fn accept(shared: Arc<Shared>, listener: TcpListener, app: Router) {
    loop {
        let stream = tokio::select! {
            _ = shared.stop.notified() => return,
            conn = listener.accept() => match conn {
                Ok((stream, _)) => stream,
                Err(_) => {
                    // Out of descriptors or a reset before accept: back off instead of spinning.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        if shared.shutdown.load(Ordering::SeqCst) {
            return;
        }
        let busy = shared.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS;
        let (s, app) = (shared.clone(), app.clone());
        tokio::spawn(async move {
            serve(&s, stream, app, busy).await;
            s.connections.fetch_sub(1, Ordering::SeqCst);
        });
    }
}

/// Why a request gets no answer: its body never arrived whole. Returned to hyper as the service's
/// error, which closes the connection without a response.
#[derive(Debug)]
struct BodyCutShort;

impl std::fmt::Display for BodyCutShort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("request body cut short")
    }
}

impl std::error::Error for BodyCutShort {}

async fn serve(shared: &Arc<Shared>, stream: TcpStream, app: Router, busy: bool) {
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(JsonErrors::new(stream, &shared.name));
    let s = shared.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let (s, app) = (s.clone(), app.clone());
        async move {
            if busy {
                return Ok(closing(
                    ApiError::server(503, "too many connections"),
                    &s.name,
                ));
            }
            handle(&s, app, req).await
        }
    });
    let _ = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(IDLE_TIMEOUT)
        .max_buf_size(MAX_HEAD)
        .max_header_size(MAX_HEAD)
        .max_headers(MAX_HEADERS)
        // One buffer per write, so a head hyper writes itself reaches `JsonErrors` whole.
        .writev(false)
        .serve_connection(io, service)
        .await;
}

/// An error answer after which the connection closes.
fn closing(e: ApiError, replica: &str) -> Response<Body> {
    let mut r = e.response(replica);
    r.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The simulator's refusals, then the whole body read (bounded), then the routes.
async fn handle(
    shared: &Shared,
    app: Router,
    req: Request<Incoming>,
) -> Result<Response<Body>, BodyCutShort> {
    if let Some(e) = refusal(&req) {
        return Ok(closing(e, &shared.name));
    }
    let (parts, body) = req.into_parts();
    let bytes = match http_body_util::Limited::new(body, MAX_BODY).collect().await {
        Ok(c) => c.to_bytes(),
        Err(_) => return Err(BodyCutShort),
    };
    let routed = app
        .oneshot(Request::from_parts(parts, Body::from(bytes)))
        .await;
    Ok(routed.unwrap_or_else(|never| match never {}))
}

/// A request the replica refuses from its head alone.
fn refusal(req: &Request<Incoming>) -> Option<ApiError> {
    let bad = |status, message: String| {
        Some(ApiError::new(
            status,
            "invalid_request_error",
            message,
            None,
        ))
    };
    let target = req.uri();
    if target.scheme().is_some() || target.authority().is_some() || !target.path().starts_with('/')
    {
        return bad(400, "malformed HTTP request: request line".into());
    }
    let h = req.headers();
    if h.get(header::TRANSFER_ENCODING)
        .is_some_and(|t| !t.as_bytes().eq_ignore_ascii_case(b"identity"))
    {
        return bad(
            411,
            "chunked request bodies are not supported: send Content-Length".into(),
        );
    }
    let len = h
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    if len > MAX_BODY {
        return bad(
            413,
            format!("request body of {len} bytes is larger than the {MAX_BODY}-byte limit"),
        );
    }
    None
}

/// The connection's socket, with hyper's own answers to heads it cannot parse (an empty-bodied
/// 400 or 431, the last thing on a connection) replaced by the replica's OpenAI-style JSON error.
/// A response head without the replica's header can only be hyper's: every answer from the routes
/// and from [`handle`] carries it.
struct JsonErrors {
    inner: TcpStream,
    replica: String,
    /// A replacement answer still to write (written before anything else, and before flushing).
    pending: Vec<u8>,
}

impl JsonErrors {
    fn new(inner: TcpStream, replica: &str) -> Self {
        Self {
            inner,
            replica: replica.to_string(),
            pending: Vec::new(),
        }
    }

    /// Writes what is pending; ready once nothing is.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.pending.is_empty() {
            let n = std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pending.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for JsonErrors {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for JsonErrors {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        std::task::ready!(self.poll_pending(cx))?;
        if buf.starts_with(b"HTTP/1.1 4")
            && let Some(answer) = replacement(buf, &self.replica)
        {
            self.pending = answer;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        std::task::ready!(self.poll_pending(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The JSON answer replacing `buf`, if `buf` is exactly one of hyper's own error answers: a
/// 4xx head with an empty body and no replica header.
fn replacement(buf: &[u8], replica: &str) -> Option<Vec<u8>> {
    let head = std::str::from_utf8(buf).ok()?.strip_suffix("\r\n\r\n")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next()?;
    let status: u16 = status_line
        .strip_prefix("HTTP/1.1 ")?
        .get(..3)?
        .parse()
        .ok()?;
    let (mut ours, mut empty) = (false, false);
    for l in lines {
        let l = l.to_ascii_lowercase();
        ours |= l.starts_with(REPLICA_HEADER);
        empty |= l == "content-length: 0";
    }
    if ours || !empty || !(400..500).contains(&status) {
        return None;
    }
    let message = match status {
        431 => format!("request head larger than {MAX_HEAD} bytes"),
        _ => "malformed HTTP request".to_string(),
    };
    let body = ApiError::new(status, "invalid_request_error", message, None).json();
    Some(
        format!(
            "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             {REPLICA_HEADER}: {}\r\nconnection: close\r\n\r\n{body}",
            body.len(),
            replica
        )
        .into_bytes(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hyper_error_heads_become_json_errors() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\n\
                     date: Thu, 01 Jan 2026 00:00:00 GMT\r\n\r\n";
        let out = String::from_utf8(replacement(head, "r7").expect("replaced")).unwrap();
        let (h, body) = out.split_once("\r\n\r\n").unwrap();
        assert!(
            h.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{h}"
        );
        assert!(h.contains("\r\nx-kvsteer-replica: r7\r\n"), "{h}");
        assert!(
            h.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
            "{h}"
        );
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], 431);
        assert_eq!(
            v["error"]["message"],
            "request head larger than 65536 bytes"
        );
    }

    #[test]
    fn the_replicas_own_answers_pass_untouched() {
        // Named by the replica (an error from the routes), or a body after the head, or not a 4xx.
        let ours =
            b"HTTP/1.1 400 Bad Request\r\nx-kvsteer-replica: r0\r\ncontent-length: 0\r\n\r\n";
        let with_body = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}";
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
        let server = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n";
        let sized = b"HTTP/1.1 400 Bad Request\r\ncontent-length: 10\r\n\r\n";
        for buf in [&ours[..], with_body, ok, server, sized] {
            assert!(
                replacement(buf, "r0").is_none(),
                "{}",
                String::from_utf8_lossy(buf)
            );
        }
    }
}
