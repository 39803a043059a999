//! HTTP streams: what the host records about each one ([`StreamState`]) and the calls that control it,
//! `proxy_continue_stream`, `proxy_close_stream` and `proxy_send_local_response`.

use super::headers::header_value;
use super::memory::{HostResult, ok, read_or_status, refuse_if_asked, status};
use super::{ENV, VmState};
use crate::abi::{Action, Pairs, Status, StreamType, decode_pairs};
use std::collections::HashMap;
use wasmtime::{Caller, Linker};

/// A local response the filter sent instead of proxying.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub details: String,
    pub body: Vec<u8>,
    pub headers: Pairs,
}

/// One callback the host made on a stream and what the filter answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallbackRecord {
    pub callback: &'static str,
    pub action: Action,
}

/// Everything the host knows about one HTTP stream.
#[derive(Clone, Debug, Default)]
pub struct StreamState {
    pub id: u32,
    /// Request headers as the filter left them.
    pub request_headers: Pairs,
    pub request_trailers: Option<Pairs>,
    pub response_headers: Option<Pairs>,
    pub response_trailers: Option<Pairs>,
    /// Body bytes the filter has buffered (StopIterationAndBuffer) and can read.
    pub(super) request_buffer: Vec<u8>,
    pub(super) response_buffer: Vec<u8>,
    /// True once the request went upstream (headers released).
    pub released: bool,
    /// The request headers at the moment they were released: what the upstream sees.
    pub upstream_headers: Option<Pairs>,
    /// Request body bytes passed upstream.
    pub upstream_body: Vec<u8>,
    /// Response body bytes passed downstream.
    pub downstream_body: Vec<u8>,
    /// The filter called `proxy_continue_stream(HttpRequest)` on this stream.
    pub resumed_by_filter: bool,
    /// nginx mode: the filter paused the request headers, and ngx_wasm_module holds the request in
    /// the rewrite phase until the filter resumes it; its body callback never comes.
    pub parked: bool,
    pub local_response: Option<LocalResponse>,
    /// The filter called `proxy_close_stream`.
    pub closed: bool,
    /// The filter called the `clear_route_cache` foreign function (Envoy re-selects the route).
    pub route_cache_cleared: bool,
    pub callbacks: Vec<CallbackRecord>,
    /// Properties the filter set during this stream (nginx: `["ngx", VAR]` variables).
    pub properties: HashMap<Vec<String>, Vec<u8>>,
    pub(super) request_done: bool,
}

impl StreamState {
    /// A header of the request as the upstream received it (None if not released).
    pub fn upstream_header(&self, name: &str) -> Option<&str> {
        self.upstream_headers
            .as_ref()
            .and_then(|h| header_value(h, name))
    }

    /// A property the filter set on this stream, as text.
    pub fn property(&self, path: &[&str]) -> Option<&str> {
        let key: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        self.properties
            .get(&key)
            .and_then(|v| std::str::from_utf8(v).ok())
    }

    /// Whether any response body callback paused (buffering an SSE stream kills time to first token).
    pub fn response_paused(&self) -> bool {
        self.callbacks
            .iter()
            .any(|c| c.callback == "proxy_on_response_body" && c.action != Action::Continue)
    }
}

impl VmState {
    pub(super) fn stream_mut(&mut self) -> Option<&mut StreamState> {
        let id = self.effective;
        self.streams.get_mut(&id)
    }
}

/// Lets the request go upstream: snapshot of the headers, and the body buffered so far.
pub(super) fn release_request(s: &mut StreamState) {
    if !s.released {
        s.released = true;
        s.upstream_headers = Some(s.request_headers.clone());
    }
    let buffered = std::mem::take(&mut s.request_buffer);
    s.upstream_body.extend_from_slice(&buffered);
}

/// Lets the response body buffered so far go downstream.
pub(super) fn release_response(s: &mut StreamState) {
    let buffered = std::mem::take(&mut s.response_buffer);
    s.downstream_body.extend_from_slice(&buffered);
}

/// Links the stream-control calls.
pub(super) fn add_stream_control(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        ENV,
        "proxy_continue_stream",
        |mut c: Caller<'_, VmState>, kind: i32| -> HostResult {
            refuse_if_asked!(c, "proxy_continue_stream");
            let st = c.data_mut();
            let id = st.effective;
            let Some(s) = st.streams.get_mut(&id) else {
                // Envoy: the root context has no stream to continue; the call is a silent no-op.
                st.note(format!(
                    "proxy_continue_stream({kind}) on a context without a stream"
                ));
                return ok();
            };
            match StreamType::from_raw(kind) {
                Some(StreamType::HttpRequest) => {
                    s.resumed_by_filter = true;
                    s.parked = false;
                    release_request(s);
                    ok()
                }
                Some(StreamType::HttpResponse) => ok(),
                _ => status(Status::BadArgument),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_close_stream",
        |mut c: Caller<'_, VmState>, _kind: i32| -> HostResult {
            if let Some(s) = c.data_mut().stream_mut() {
                s.closed = true;
            }
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_send_local_response",
        |mut c: Caller<'_, VmState>,
         code: i32,
         dptr: i32,
         dlen: i32,
         bptr: i32,
         blen: i32,
         hptr: i32,
         hlen: i32,
         _grpc: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_send_local_response");
            let details = read_or_status!(&mut c, dptr, dlen);
            let body = read_or_status!(&mut c, bptr, blen);
            let headers = read_or_status!(&mut c, hptr, hlen);
            let Ok(headers) = decode_pairs(&headers) else {
                return status(Status::BadArgument);
            };
            let Some(s) = c.data_mut().stream_mut() else {
                return status(Status::NotFound);
            };
            s.local_response = Some(LocalResponse {
                status: code as u32,
                details: String::from_utf8_lossy(&details).into_owned(),
                body,
                headers,
            });
            ok()
        },
    )?;
    Ok(())
}
