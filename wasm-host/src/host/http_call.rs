//! HTTP callouts: `proxy_http_call` (requires `:method`, `:path` and `:authority` and, in Envoy mode,
//! a known cluster; in nginx mode an address) records a [`Callout`] with a token; the harness answers
//! it later with a [`CallOutcome`] through [`super::WorkerVm::answer_callout`]. `proxy_get_status`
//! reports the last callout failure. In nginx mode each callout holds one of the worker's
//! `worker_connections` ([`super::CalloutConnections`]) until its answer, or for good when
//! ngx_wasm_module would leave it open (answered while another callout of the root context was out).

use super::headers::header_value;
use super::memory::{
    HostResult, guest_write, ok, read_or_status, refuse_if_asked, return_bytes, status,
};
use super::{ENV, HostMode, VmState};
use crate::abi::{Pairs, Status, decode_pairs};
use std::sync::atomic::Ordering;
use wasmtime::{Caller, Linker};

/// An HTTP callout the filter dispatched, waiting for the harness to answer it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Callout {
    pub token: u32,
    /// The context that dispatched it (the answer goes back to it).
    pub context: u32,
    /// Cluster name (Envoy) or address (nginx).
    pub upstream: String,
    pub headers: Pairs,
    pub body: Vec<u8>,
    pub trailers: Pairs,
    pub timeout_ms: u32,
    /// Virtual time of dispatch.
    pub sent_ns: u64,
}

impl Callout {
    /// First value of a header, as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        header_value(&self.headers, name)
    }
}

/// How the harness answers a callout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CallOutcome {
    /// The upstream answered (`:status` must be among the headers).
    Response {
        headers: Pairs,
        body: Vec<u8>,
        trailers: Pairs,
    },
    /// The connection failed or was reset: Envoy calls `proxy_on_http_call_response` with zero headers,
    /// zero body and zero trailers, and the response maps are unavailable (reading them is
    /// `BadArgument`, which the SDK turns into a panic: a filter must check `num_headers` first).
    Reset,
}

impl CallOutcome {
    pub fn ok(status: u16, content_type: &str, body: Vec<u8>) -> CallOutcome {
        CallOutcome::Response {
            headers: vec![
                (b":status".to_vec(), status.to_string().into_bytes()),
                (b"content-type".to_vec(), content_type.as_bytes().to_vec()),
                (
                    b"content-length".to_vec(),
                    body.len().to_string().into_bytes(),
                ),
            ],
            body,
            trailers: Vec::new(),
        }
    }

    /// What Envoy's async client delivers when the callout's timeout expires: a local 504.
    pub fn timeout() -> CallOutcome {
        CallOutcome::ok(504, "text/plain", b"upstream request timeout".to_vec())
    }
}

/// The answer to an HTTP callout while `proxy_on_http_call_response` runs.
pub(super) struct CallResponseView {
    pub(super) headers: Option<Pairs>,
    pub(super) body: Option<Vec<u8>>,
    pub(super) trailers: Option<Pairs>,
}

/// `host:port` or `[v6]:port`: what ngx_wasm_module accepts as a callout target.
fn is_address(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok(),
        None => false,
    }
}

/// Links `proxy_http_call` and `proxy_get_status`.
pub(super) fn add_http_call(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    // Kept whole: one registration per host function (the call and its status), a flat list.
    linker.func_wrap(
        ENV,
        "proxy_http_call",
        |mut c: Caller<'_, VmState>,
         uptr: i32,
         ulen: i32,
         hptr: i32,
         hlen: i32,
         bptr: i32,
         blen: i32,
         tptr: i32,
         tlen: i32,
         timeout: i32,
         token_ptr: i32|
         -> HostResult {
            refuse_if_asked!(c, "proxy_http_call");
            let upstream =
                String::from_utf8_lossy(&read_or_status!(&mut c, uptr, ulen)).into_owned();
            let headers = read_or_status!(&mut c, hptr, hlen);
            let body = read_or_status!(&mut c, bptr, blen);
            let trailers = read_or_status!(&mut c, tptr, tlen);
            let (Ok(headers), Ok(trailers)) = (decode_pairs(&headers), decode_pairs(&trailers))
            else {
                return status(Status::BadArgument);
            };
            let st = c.data();
            let known = match st.options.mode {
                HostMode::Envoy => st
                    .options
                    .clusters
                    .as_ref()
                    .is_none_or(|cl| cl.contains(&upstream)),
                HostMode::Nginx => is_address(&upstream),
            };
            // Envoy refuses unknown clusters and calls without the three required pseudo-headers.
            let has = |n: &str| header_value(&headers, n).is_some_and(|v| !v.is_empty());
            if !known || !has(":method") || !has(":path") || !has(":authority") {
                return status(Status::BadArgument);
            }
            let st = c.data_mut();
            if st.options.mode == HostMode::Nginx {
                // Each callout takes one of the worker's connections.
                let conns = &mut st.connections;
                if conns.open as usize >= st.options.nginx.worker_connections {
                    conns.refused += 1;
                    return status(Status::InternalFailure);
                }
                conns.opened += 1;
                conns.open += 1;
            }
            let token = st.next_token;
            st.next_token = st.next_token.wrapping_add(1).max(1);
            if st.options.mode == HostMode::Nginx && st.effective == super::ROOT_CONTEXT {
                st.root_out.insert(token);
            }
            let sent_ns = st.shared().clock_ns.load(Ordering::Relaxed);
            let context = st.effective;
            st.callouts.push(Callout {
                token,
                context,
                upstream,
                headers,
                body,
                trailers,
                timeout_ms: timeout as u32,
                sent_ns,
            });
            match guest_write(&mut c, token_ptr as u32, &token.to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_status",
        |mut c: Caller<'_, VmState>, code_ptr: i32, ptr_ptr: i32, size_ptr: i32| -> HostResult {
            let (code, msg) = c.data().status.clone();
            if guest_write(&mut c, code_ptr as u32, &code.to_le_bytes()).is_err() {
                return status(Status::InvalidMemoryAccess);
            }
            return_bytes(&mut c, &msg, ptr_ptr, size_ptr)
        },
    )?;
    Ok(())
}
