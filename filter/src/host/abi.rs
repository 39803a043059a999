//! The proxy-wasm host calls the filter makes, through the ABI itself, every status a `Result`.
//!
//! Why not the SDK's `hostcalls`: its wrappers `panic!("unexpected status")` on any status they do
//! not list (most list only `Ok`, some `NotFound`), and a panic is a wasm trap that kills the VM and
//! every request on it. A host may well answer another status: nginx's module refuses calls in a
//! phase it does not allow them in, and a host may answer `Unimplemented` for a call it lacks. (The
//! SDK also declares the status as a Rust enum, so a code outside that enum is not even a valid
//! value.) Here every status is a plain `u32`, and the callers in [`crate::host`] each have a
//! fallback, listed in docs/design/filter.md ("Host-call failures").
//!
//! Every refusal (a status the call does not document as a normal answer) is counted, and published
//! on the next tick as `kvsteer_host_call_refusals`; the first refusal of each call is also logged,
//! once per VM, so a host that refuses a call on every request does not flood the log.
//!
//! One call stays on the SDK: `dispatch_http_call` ([`dispatch_http_call`] says why).
//!
//! Memory: a buffer the host returns (header and property values, buffers, shared data, a foreign
//! function's result) was allocated by the host through the module's `proxy_on_memory_allocate` (the
//! SDK's, a `Vec<u8>` of exactly that capacity, forgotten), so it is taken back as that `Vec`
//! ([`owned`]), as the SDK's own wrappers do.

use proxy_wasm::types::{BufferType, LogLevel, MapType, MetricType, Status};
use std::cell::{Cell, RefCell};
use std::time::Duration;

#[link(wasm_import_module = "env")]
unsafe extern "C" {
    fn proxy_log(level: u32, message: *const u8, message_len: usize) -> u32;
    fn proxy_get_current_time_nanoseconds(time: *mut u64) -> u32;
    fn proxy_set_tick_period_milliseconds(period: u32) -> u32;
    fn proxy_get_buffer_bytes(
        buffer_type: u32,
        start: usize,
        max_size: usize,
        data: *mut *mut u8,
        len: *mut usize,
    ) -> u32;
    fn proxy_set_buffer_bytes(
        buffer_type: u32,
        start: usize,
        size: usize,
        data: *const u8,
        len: usize,
    ) -> u32;
    fn proxy_get_header_map_value(
        map_type: u32,
        key: *const u8,
        key_len: usize,
        value: *mut *mut u8,
        value_len: *mut usize,
    ) -> u32;
    fn proxy_replace_header_map_value(
        map_type: u32,
        key: *const u8,
        key_len: usize,
        value: *const u8,
        value_len: usize,
    ) -> u32;
    fn proxy_remove_header_map_value(map_type: u32, key: *const u8, key_len: usize) -> u32;
    fn proxy_get_property(
        path: *const u8,
        path_len: usize,
        value: *mut *mut u8,
        value_len: *mut usize,
    ) -> u32;
    fn proxy_set_property(
        path: *const u8,
        path_len: usize,
        value: *const u8,
        value_len: usize,
    ) -> u32;
    fn proxy_get_shared_data(
        key: *const u8,
        key_len: usize,
        value: *mut *mut u8,
        value_len: *mut usize,
        cas: *mut u32,
    ) -> u32;
    fn proxy_set_shared_data(
        key: *const u8,
        key_len: usize,
        value: *const u8,
        value_len: usize,
        cas: u32,
    ) -> u32;
    fn proxy_define_metric(metric_type: u32, name: *const u8, name_len: usize, id: *mut u32)
    -> u32;
    fn proxy_increment_metric(id: u32, offset: i64) -> u32;
    fn proxy_record_metric(id: u32, value: u64) -> u32;
    fn proxy_call_foreign_function(
        name: *const u8,
        name_len: usize,
        args: *const u8,
        args_len: usize,
        results: *mut *mut u8,
        results_len: *mut usize,
    ) -> u32;
    #[allow(clippy::too_many_arguments)]
    fn proxy_send_local_response(
        status_code: u32,
        details: *const u8,
        details_len: usize,
        body: *const u8,
        body_len: usize,
        headers: *const u8,
        headers_len: usize,
        grpc_status: i32,
    ) -> u32;
    fn proxy_continue_stream(stream_type: u32) -> u32;
}

/// proxy-wasm's `BufferType::HttpRequestBody` and `StreamType::HttpRequest`.
const HTTP_REQUEST: u32 = 0;

/// proxy-wasm's `Ok`, `NotFound` and `CasMismatch`.
const OK: u32 = 0;
const NOT_FOUND: u32 = 1;
const CAS_MISMATCH: u32 = 8;

thread_local! {
    /// Refusals so far in this VM (one thread: a VM is single-threaded).
    static REFUSALS: Cell<u64> = const { Cell::new(0) };
    /// The calls whose first refusal was logged.
    static LOGGED: RefCell<Vec<&'static str>> = const { RefCell::new(Vec::new()) };
}

/// Counts a refusal of `call` and logs the first one (the first that could be logged: while the
/// proxy refuses log lines too, a later refusal tries again); returns the status for the caller's
/// `Err`.
fn refused(call: &'static str, status: u32) -> u32 {
    REFUSALS.with(|n| n.set(n.get().saturating_add(1)));
    if LOGGED.with(|l| l.borrow().contains(&call)) {
        return status;
    }
    let msg = format!(
        "kvsteer: the proxy refused {call} (status {status}); the filter goes on without it \
         (docs/design/filter.md, host-call failures); further refusals are counted in \
         kvsteer_host_call_refusals"
    );
    if try_log(LogLevel::Warn, &msg) {
        LOGGED.with(|l| l.borrow_mut().push(call));
    }
    status
}

/// Host calls refused so far in this VM ([`refused`]).
pub fn refusals() -> u64 {
    REFUSALS.with(Cell::get)
}

fn status(call: &'static str, s: u32) -> Result<(), u32> {
    if s == OK {
        Ok(())
    } else {
        Err(refused(call, s))
    }
}

/// Takes ownership of a buffer the host returned: it allocated it through the module's
/// `proxy_on_memory_allocate` (the SDK's, a `Vec` of that capacity), as the SDK's wrappers assume.
fn owned(data: *mut u8, len: usize) -> Vec<u8> {
    if data.is_null() {
        Vec::new()
    } else {
        // SAFETY: see above; the host hands the buffer over and keeps no reference.
        unsafe { Vec::from_raw_parts(data, len, len) }
    }
}

/// Writes a log line. A refused log line has nowhere else to go: it is counted, never logged.
pub fn log(level: LogLevel, msg: &str) {
    try_log(level, msg);
}

/// [`log`]; `false` when the proxy refused the line.
fn try_log(level: LogLevel, msg: &str) -> bool {
    // SAFETY: a live slice for the duration of the call.
    let s = unsafe { proxy_log(level as u32, msg.as_ptr(), msg.len()) };
    if s != OK {
        REFUSALS.with(|n| n.set(n.get().saturating_add(1)));
    }
    s == OK
}

/// The proxy's clock, nanoseconds since the Unix epoch.
pub fn now_ns() -> Result<u64, u32> {
    let mut t = 0u64;
    // SAFETY: the out-pointer is a live local.
    let s = unsafe { proxy_get_current_time_nanoseconds(&mut t) };
    status("proxy_get_current_time_nanoseconds", s).map(|()| t)
}

/// Asks for `proxy_on_tick` every `period` (whole milliseconds, as the SDK passes it).
pub fn set_tick_period(period: Duration) -> Result<(), u32> {
    // SAFETY: no pointers.
    let s = unsafe { proxy_set_tick_period_milliseconds(period.as_millis() as u32) };
    status("proxy_set_tick_period_milliseconds", s)
}

/// Up to `max` bytes of a buffer from `start`; `None` when the host has none (`NotFound`, or `Ok`
/// with no data, as the SDK reads it).
pub fn get_buffer(kind: BufferType, start: usize, max: usize) -> Result<Option<Vec<u8>>, u32> {
    let (mut data, mut len) = (core::ptr::null_mut(), 0usize);
    // SAFETY: the out-pointers are live locals.
    let s = unsafe { proxy_get_buffer_bytes(kind as u32, start, max, &mut data, &mut len) };
    match s {
        OK if data.is_null() => Ok(None),
        OK => Ok(Some(owned(data, len))),
        NOT_FOUND => Ok(None),
        e => Err(refused("proxy_get_buffer_bytes", e)),
    }
}

/// Replaces the buffered request body (`size`: the bytes it had) with `data`.
pub fn set_request_body(size: usize, data: &[u8]) -> Result<(), u32> {
    // SAFETY: the pointers and lengths describe live slices for the duration of the call.
    let s = unsafe { proxy_set_buffer_bytes(HTTP_REQUEST, 0, size, data.as_ptr(), data.len()) };
    status("proxy_set_buffer_bytes", s)
}

/// A header's value; `None` when absent.
pub fn get_header(map_type: MapType, name: &str) -> Result<Option<Vec<u8>>, u32> {
    let (mut data, mut len) = (core::ptr::null_mut(), 0usize);
    // SAFETY: the name is a live slice; the out-pointers are live locals.
    let s = unsafe {
        proxy_get_header_map_value(
            map_type as u32,
            name.as_ptr(),
            name.len(),
            &mut data,
            &mut len,
        )
    };
    match s {
        OK => Ok(Some(owned(data, len))),
        NOT_FOUND => Ok(None),
        e => Err(refused("proxy_get_header_map_value", e)),
    }
}

/// Sets (replaces) a header.
pub fn set_header(map_type: MapType, name: &str, value: &[u8]) -> Result<(), u32> {
    // SAFETY: live slices for the duration of the call.
    let s = unsafe {
        proxy_replace_header_map_value(
            map_type as u32,
            name.as_ptr(),
            name.len(),
            value.as_ptr(),
            value.len(),
        )
    };
    status("proxy_replace_header_map_value", s)
}

/// Removes a header (absent is not an error).
pub fn remove_header(map_type: MapType, name: &str) -> Result<(), u32> {
    // SAFETY: a live slice for the duration of the call.
    match unsafe { proxy_remove_header_map_value(map_type as u32, name.as_ptr(), name.len()) } {
        OK | NOT_FOUND => Ok(()),
        e => Err(refused("proxy_remove_header_map_value", e)),
    }
}

/// proxy-wasm's property path encoding: the segments joined by NUL.
fn path(segments: &[&str]) -> Vec<u8> {
    segments.join("\0").into_bytes()
}

/// A property's value; `None` when absent or empty.
pub fn get_property(segments: &[&str]) -> Result<Option<Vec<u8>>, u32> {
    let p = path(segments);
    let (mut data, mut len) = (core::ptr::null_mut(), 0usize);
    // SAFETY: as for `get_header`.
    let s = unsafe { proxy_get_property(p.as_ptr(), p.len(), &mut data, &mut len) };
    match s {
        OK => Ok(Some(owned(data, len)).filter(|v| !v.is_empty())),
        NOT_FOUND => Ok(None),
        e => Err(refused("proxy_get_property", e)),
    }
}

pub fn set_property(segments: &[&str], value: &[u8]) -> Result<(), u32> {
    let p = path(segments);
    // SAFETY: live slices for the duration of the call.
    let s = unsafe { proxy_set_property(p.as_ptr(), p.len(), value.as_ptr(), value.len()) };
    status("proxy_set_property", s)
}

/// A shared-data entry and its CAS value; `None` when absent (or present without a value, as the
/// SDK reads it).
pub fn get_shared_data(key: &str) -> Result<Option<(Vec<u8>, u32)>, u32> {
    let (mut data, mut len, mut cas) = (core::ptr::null_mut(), 0usize, 0u32);
    // SAFETY: the key is a live slice; the out-pointers are live locals.
    let s =
        unsafe { proxy_get_shared_data(key.as_ptr(), key.len(), &mut data, &mut len, &mut cas) };
    match s {
        OK if data.is_null() => Ok(None),
        OK => Ok(Some((owned(data, len), cas))),
        NOT_FOUND => Ok(None),
        e => Err(refused("proxy_get_shared_data", e)),
    }
}

/// Writes a shared-data entry, with `cas` only if it is unchanged since read: `Ok(false)` when it
/// was not (`CasMismatch`, a normal answer, not a refusal).
pub fn set_shared_data(key: &str, value: &[u8], cas: Option<u32>) -> Result<bool, u32> {
    // SAFETY: live slices for the duration of the call.
    let s = unsafe {
        proxy_set_shared_data(
            key.as_ptr(),
            key.len(),
            value.as_ptr(),
            value.len(),
            cas.unwrap_or(0),
        )
    };
    match s {
        OK => Ok(true),
        CAS_MISMATCH => Ok(false),
        e => Err(refused("proxy_set_shared_data", e)),
    }
}

pub fn define_metric(kind: MetricType, name: &str) -> Result<u32, u32> {
    let mut id = 0u32;
    // SAFETY: the name is a live slice; the out-pointer is a live local.
    let s = unsafe { proxy_define_metric(kind as u32, name.as_ptr(), name.len(), &mut id) };
    status("proxy_define_metric", s).map(|()| id)
}

pub fn increment_metric(id: u32, by: i64) -> Result<(), u32> {
    // SAFETY: no pointers.
    status("proxy_increment_metric", unsafe {
        proxy_increment_metric(id, by)
    })
}

pub fn record_metric(id: u32, value: u64) -> Result<(), u32> {
    // SAFETY: no pointers.
    status("proxy_record_metric", unsafe {
        proxy_record_metric(id, value)
    })
}

/// Calls a host's foreign function with no arguments; its result, if any, is dropped (freed).
pub fn call_foreign_function(name: &str) -> Result<(), u32> {
    let (mut data, mut len) = (core::ptr::null_mut(), 0usize);
    // SAFETY: the name is a live slice; a null argument pointer with length 0 is what the SDK
    // passes for no arguments; the out-pointers are live locals.
    let s = unsafe {
        proxy_call_foreign_function(
            name.as_ptr(),
            name.len(),
            core::ptr::null(),
            0,
            &mut data,
            &mut len,
        )
    };
    match s {
        OK => {
            drop(owned(data, len));
            Ok(())
        }
        e => Err(refused("proxy_call_foreign_function", e)),
    }
}

/// proxy-wasm's header map encoding: the pair count, each name's and value's length, then each
/// name and value followed by a NUL.
fn encode_pairs(pairs: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(pairs.len() as u32).to_le_bytes());
    for (k, v) in pairs {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
    }
    for (k, v) in pairs {
        out.extend_from_slice(k.as_bytes());
        out.push(0);
        out.extend_from_slice(v.as_bytes());
        out.push(0);
    }
    out
}

pub fn send_local_response(
    status_code: u32,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<(), u32> {
    let h = encode_pairs(headers);
    // SAFETY: as above; a null details pointer with length 0 is what the SDK passes.
    let s = unsafe {
        proxy_send_local_response(
            status_code,
            core::ptr::null(),
            0,
            body.as_ptr(),
            body.len(),
            h.as_ptr(),
            h.len(),
            -1,
        )
    };
    status("proxy_send_local_response", s)
}

pub fn resume_request() -> Result<(), u32> {
    // SAFETY: no pointers.
    status("proxy_continue_stream", unsafe {
        proxy_continue_stream(HTTP_REQUEST)
    })
}

/// An HTTP callout: its token, or why the host would not send it.
///
/// The one host call left on the SDK's wrapper, because the SDK must learn the token: its
/// `proxy_on_http_call_response` export looks the token up in the callouts its `dispatch_http_call`
/// registered (`dispatcher::register_callout`, private to the SDK) and panics on one it does not
/// know, so a callout sent through the ABI directly would trap the VM when its answer came. The
/// wrapper panics on a status other than `Ok`, `BadArgument` and `InternalFailure`; Envoy answers
/// only those (an unknown cluster or missing pseudo-header is `BadArgument`). A host that answers
/// anything else here still traps the VM, which the filter cannot prevent (docs/design/filter.md).
pub fn dispatch_http_call(
    upstream: &str,
    headers: Vec<(&str, &str)>,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<u32, Status> {
    proxy_wasm::hostcalls::dispatch_http_call(upstream, headers, body, vec![], timeout).inspect_err(
        |e| {
            refused("proxy_http_call", *e as u32);
        },
    )
}
