//! A small HTTP/1.1 server core on `std::net`: request parsing with hard limits, keep-alive, plain
//! responses with `Content-Length`, and chunked responses for SSE. Written by hand to keep tokio and
//! hyper out of the build (2-core CI); the simulator needs correctness and bounded resources here, not
//! throughput.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// Largest request body accepted (larger gets 413).
pub const MAX_BODY: usize = 16 << 20;
/// Largest request head (request line and headers) accepted (larger gets 431).
pub const MAX_HEAD: usize = 64 << 10;
/// How long an idle keep-alive connection is kept.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: String,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    pub keep_alive: bool,
}

impl Request {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Why a request could not be read; each maps to a status, after which the connection is closed.
#[derive(Debug)]
pub enum HttpError {
    /// The peer closed or timed out; nothing to answer.
    Closed,
    BadRequest(&'static str),
    HeadTooLarge,
    BodyTooLarge(usize),
    ChunkedBody,
}

impl HttpError {
    pub fn status(&self) -> u16 {
        match self {
            HttpError::Closed => 0,
            HttpError::BadRequest(_) => 400,
            HttpError::HeadTooLarge => 431,
            HttpError::BodyTooLarge(_) => 413,
            HttpError::ChunkedBody => 411,
        }
    }

    pub fn message(&self) -> String {
        match self {
            HttpError::Closed => "closed".into(),
            HttpError::BadRequest(m) => format!("malformed HTTP request: {m}"),
            HttpError::HeadTooLarge => format!("request head larger than {MAX_HEAD} bytes"),
            HttpError::BodyTooLarge(n) => {
                format!("request body of {n} bytes is larger than the {MAX_BODY}-byte limit")
            }
            HttpError::ChunkedBody => {
                "chunked request bodies are not supported: send Content-Length".into()
            }
        }
    }
}

/// Reads one line (up to `budget` bytes) ending in LF; strips CRLF.
fn read_line(r: &mut BufReader<TcpStream>, budget: &mut usize) -> Result<String, HttpError> {
    let mut line = Vec::new();
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(HttpError::Closed),
        };
        if buf.is_empty() {
            return Err(HttpError::Closed);
        }
        let (take, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => (buf.len(), false),
        };
        if take > *budget {
            return Err(HttpError::HeadTooLarge);
        }
        *budget -= take;
        line.extend_from_slice(&buf[..take]);
        r.consume(take);
        if done {
            break;
        }
    }
    while matches!(line.last(), Some(b'\n' | b'\r')) {
        line.pop();
    }
    String::from_utf8(line).map_err(|_| HttpError::BadRequest("non-UTF-8 request head"))
}

/// Reads the next request on a keep-alive connection. `Err(Closed)` on a clean EOF or idle timeout.
/// Answers `Expect: 100-continue` before reading the body.
pub fn read_request(r: &mut BufReader<TcpStream>) -> Result<Request, HttpError> {
    let mut budget = MAX_HEAD;
    let mut line = read_line(r, &mut budget)?;
    // Tolerate stray empty lines between requests (RFC 9112 section 2.2).
    while line.is_empty() {
        line = read_line(r, &mut budget)?;
    }
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::BadRequest("request line"));
    };
    if !version.starts_with("HTTP/1.") || method.is_empty() || !target.starts_with('/') {
        return Err(HttpError::BadRequest("request line"));
    }
    let mut headers = Vec::new();
    loop {
        let h = read_line(r, &mut budget)?;
        if h.is_empty() {
            break;
        }
        let Some((k, v)) = h.split_once(':') else {
            return Err(HttpError::BadRequest("header line"));
        };
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        if headers.len() > 200 {
            return Err(HttpError::HeadTooLarge);
        }
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut req = Request {
        method: method.to_string(),
        path: path.to_string(),
        query: query.to_string(),
        headers,
        body: Vec::new(),
        keep_alive: version != "HTTP/1.0",
    };
    if let Some(c) = req.header("connection") {
        let c = c.to_ascii_lowercase();
        if c.contains("close") {
            req.keep_alive = false;
        } else if c.contains("keep-alive") {
            req.keep_alive = true;
        }
    }
    if req
        .header("transfer-encoding")
        .is_some_and(|t| !t.eq_ignore_ascii_case("identity"))
    {
        return Err(HttpError::ChunkedBody);
    }
    let len = match req.header("content-length") {
        None => 0,
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| HttpError::BadRequest("content-length"))?,
    };
    if len > MAX_BODY {
        return Err(HttpError::BodyTooLarge(len));
    }
    if len > 0 {
        if req
            .header("expect")
            .is_some_and(|e| e.eq_ignore_ascii_case("100-continue"))
        {
            let s = r.get_mut();
            s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
                .map_err(|_| HttpError::Closed)?;
        }
        req.body = vec![0; len];
        r.read_exact(&mut req.body).map_err(|_| HttpError::Closed)?;
    }
    Ok(req)
}

pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// Writes a whole response with `Content-Length`.
pub fn write_response(
    w: &mut impl Write,
    status: u16,
    content_type: &str,
    extra: &[(&str, &str)],
    body: &[u8],
    keep_alive: bool,
) -> io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n",
        reason(status),
        body.len()
    );
    for (k, v) in extra {
        head.push_str(k);
        head.push_str(": ");
        head.push_str(v);
        head.push_str("\r\n");
    }
    head.push_str(if keep_alive {
        "connection: keep-alive\r\n\r\n"
    } else {
        "connection: close\r\n\r\n"
    });
    let mut out = head.into_bytes();
    out.extend_from_slice(body);
    w.write_all(&out)?;
    w.flush()
}

/// A chunked response in progress (server-sent events).
pub struct Chunked<'a, W: Write> {
    w: &'a mut W,
}

impl<'a, W: Write> Chunked<'a, W> {
    pub fn start(
        w: &'a mut W,
        content_type: &str,
        extra: &[(&str, &str)],
        keep_alive: bool,
    ) -> io::Result<Self> {
        let mut head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n"
        );
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(if keep_alive {
            "connection: keep-alive\r\n\r\n"
        } else {
            "connection: close\r\n\r\n"
        });
        w.write_all(head.as_bytes())?;
        w.flush()?;
        Ok(Self { w })
    }

    /// Sends one chunk and flushes it, so each SSE event leaves at once.
    pub fn send(&mut self, data: &[u8]) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let mut out = format!("{:x}\r\n", data.len()).into_bytes();
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
        self.w.write_all(&out)?;
        self.w.flush()
    }

    /// The underlying writer (to check on the peer between events).
    pub fn stream(&self) -> &W {
        self.w
    }

    pub fn finish(self) -> io::Result<()> {
        self.w.write_all(b"0\r\n\r\n")?;
        self.w.flush()
    }
}
