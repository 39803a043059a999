//! The proxy-wasm contexts: all host calls are made here (through [`crate::abi`], each with a
//! fallback), all decisions in [`crate::router_state`]. The root context ([`Root`], `root.rs`)
//! configures the VM and runs its tick; a stream context (`stream.rs`) follows one request, and, in
//! a prefill/decode fleet, its prefill leg (`prefill.rs`); the metrics are `metrics.rs`'. What they
//! share (the VM's state, the clock, the proxy's shared data) is here.

mod metrics;
mod prefill;
mod root;
mod stream;

pub use root::Root;

use crate::abi;
use crate::config::{FilterConfig, OutputMode};
use crate::router_state::RouterState;
use crate::store::SharedStore;
use metrics::Metrics;
use proxy_wasm::types::{BufferType, LogLevel, MapType};
use std::cell::{Cell, RefCell};
use std::rc::Rc;

fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

thread_local! {
    /// The last time the proxy's clock was read ([`now_ns`]).
    static LAST_NS: Cell<u64> = const { Cell::new(0) };
}

/// The proxy's clock in nanoseconds (Envoy: the system clock, read afresh on every call, nanosecond
/// resolution), for the feed's time budget. A refused read answers the last time read (0 before
/// any): the clock stands still for a moment rather than jumping back to 1970, which would make
/// every deadline and age in the router look expired or fresh at once.
fn now_ns() -> u64 {
    match abi::now_ns() {
        Ok(t) => {
            LAST_NS.set(t);
            t
        }
        Err(_) => LAST_NS.get(),
    }
}

/// A log line; one the proxy refuses is only counted ([`abi::log`]).
fn log(level: LogLevel, msg: &str) {
    abi::log(level, msg);
}

fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
    abi::get_header(map, name).ok().flatten()
}

/// A callout's HTTP status: `None` when the call failed, which hosts report as an answer without
/// headers, or when the status header is unreadable.
fn callout_status(num_headers: usize) -> Option<u16> {
    if num_headers == 0 {
        return None;
    }
    header(MapType::HttpCallResponseHeaders, ":status")
        .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok())
}

/// A callout's answer body of `size` bytes: `None` when it is empty or the proxy will not hand it
/// over.
fn callout_body(size: usize) -> Option<Vec<u8>> {
    if size == 0 {
        return None;
    }
    abi::get_buffer(BufferType::HttpCallResponseBody, 0, size)
        .ok()
        .flatten()
}

/// The proxy's shared data, for the feed lease and relay, worker numbers and shared load. A read the
/// proxy refuses reads as absent and a refused write did not happen ([`SharedStore`]'s "absent or
/// unavailable" and `false`), as a lost CAS race does: the lease, relay and peer records already
/// treat both as normal (another worker got there first, or nothing is shared yet).
struct HostStore {
    /// The host writes a key without a CAS token only if it does not exist yet (ngx_wasm_module),
    /// so a record is replaced by reading its token first ([`SharedStore::overwrite`]). Envoy writes
    /// such a key whatever it holds, in one call, as the filter always has there.
    cas_zero_creates: bool,
}

static ENVOY_STORE: HostStore = HostStore {
    cas_zero_creates: false,
};
static NGX_STORE: HostStore = HostStore {
    cas_zero_creates: true,
};

/// The shared data of the proxy this configuration is for (nginx mode: ngx_wasm_module's CAS rule).
fn host_store(cfg: &FilterConfig) -> &'static HostStore {
    if cfg.output == OutputMode::NginxVariable {
        &NGX_STORE
    } else {
        &ENVOY_STORE
    }
}

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        abi::get_shared_data(key).ok().flatten()
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        matches!(abi::set_shared_data(key, value, cas), Ok(true))
    }
    fn overwrite(&self, key: &str, value: &[u8]) -> bool {
        if self.cas_zero_creates {
            crate::store::overwrite_by_cas(self, key, value)
        } else {
            self.set(key, value, None)
        }
    }
}

/// A configured VM: the worker's routing state plus its host-facing bits.
struct Vm {
    state: RouterState,
    metrics: Metrics,
    /// Bytes of request bodies this VM's streams hold for the early scan (their buffers'
    /// capacity), kept under `early_body_scan_max_bytes`.
    early_held: usize,
    /// Bytes of request bodies the proxy buffers for this VM's streams while they wait for their
    /// route, kept under `body_hold_max_bytes`.
    body_held: usize,
}

type Shared = Rc<RefCell<Vm>>;
