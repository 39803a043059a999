//! What every proxy-wasm context shares: the VM's state (the worker's routing state and the
//! host-facing bits beside it) and the host reads each of them makes, every one with its fallback.

use super::abi;
use super::metrics::Metrics;
use crate::config::GatewayConfig;
use crate::worker::WorkerState;
use proxy_wasm::types::{BufferType, LogLevel, MapType};
use std::cell::RefCell;
use std::rc::Rc;

/// A configured VM: one routing state per pool (one, unnamed, without `pools`) plus the
/// host-facing bits the pools share.
pub(super) struct Vm {
    pub(super) pools: Vec<Pool>,
    /// How a request's model picks its pool (`pools` taken out: they are above).
    pub(super) gateway: GatewayConfig,
    /// Requests answered 404 for a model no pool serves, and 400 for none without a default
    /// pool (defined only with `pools`).
    pub(super) models_unknown: Option<u32>,
    pub(super) models_missing: Option<u32>,
    /// With several pools where a tick's callouts are bounded (nginx): the pool whose turn it is
    /// to send the VM's one callout.
    pub(super) poll_cursor: usize,
    /// Bytes of request bodies this VM's streams hold for the early scan (their buffers'
    /// capacity), kept under `early_body_scan_max_bytes`.
    pub(super) early_held: usize,
    /// Bytes of request bodies the proxy buffers for this VM's streams while they wait for their
    /// route, kept under `body_hold_max_bytes`.
    pub(super) body_held: usize,
}

/// One pool's worker state and metrics: everything a request routed in it, and the ticks, touch.
pub(super) struct Pool {
    /// `None` for the unnamed pool of a configuration without `pools`.
    pub(super) name: Option<String>,
    pub(super) state: WorkerState,
    pub(super) metrics: Metrics,
}

impl Pool {
    /// A replica's name for the log: `<pool>/<replica>` in a named pool (replica names are
    /// unique only within their pool), the replica's name alone without `pools`.
    pub(super) fn replica_name(&self, replica: usize) -> String {
        let name = self.state.replica_name(replica);
        match &self.name {
            Some(pool) => format!("{pool}/{name}"),
            None => name.to_string(),
        }
    }
}

pub(super) type Shared = Rc<RefCell<Vm>>;

/// A log line; one the proxy refuses is only counted ([`abi::log`]).
pub(super) fn log(level: LogLevel, msg: &str) {
    abi::log(level, msg);
}

pub(super) fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
    abi::get_header(map, name).ok().flatten()
}

/// A callout's HTTP status: `None` when the call failed, which hosts report as an answer without
/// headers, or when the status header is unreadable.
pub(super) fn callout_status(num_headers: usize) -> Option<u16> {
    if num_headers == 0 {
        return None;
    }
    header(MapType::HttpCallResponseHeaders, ":status")
        .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok())
}

/// A callout's answer body of `size` bytes: `None` when it is empty or the proxy will not hand it
/// over.
pub(super) fn callout_body(size: usize) -> Option<Vec<u8>> {
    if size == 0 {
        return None;
    }
    abi::get_buffer(BufferType::HttpCallResponseBody, 0, size)
        .ok()
        .flatten()
}
