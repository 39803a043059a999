//! kvsteer's proxy-wasm filter: sits in a proxy (Envoy, Istio's sidecar, nginx with ngx_wasm_module)
//! and routes each inference request with the routing core.
//!
//! Per VM (one per Envoy worker) the root context ([`host`], the guest side of the proxy-wasm ABI)
//! owns one [`WorkerState`] ([`worker`]): the core `Router` (block index, token-load table, policy), the feed
//! pollers, the lease and relay, and the load shared with other workers, all free of host calls so they
//! are tested natively. Stream contexts borrow it to route a request and to follow its response
//! through prefill, decode and release. The VM is single-threaded, so an `Rc<RefCell<_>>` is all the
//! sharing needed; borrows never cross a host call that could re-enter.
//!
//! Nothing here may panic: a panic is a wasm trap that kills the VM and every request on it. Host calls
//! go through the ABI itself (`abi`: the SDK's `hostcalls` wrappers panic on any status they do not
//! expect), with bytes, so a non-UTF-8 header cannot trip a conversion; every error has a fallback
//! (docs/design/filter.md, "Host-call failures"); request and feed bytes go through the core's
//! typed parsers. What the SDK itself can still panic on (its dispatcher, on host input the filter
//! never sees) is listed there too.

pub mod config;
pub mod host;
pub mod sse;
pub mod worker;

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    // No host call: it installs the SDK's logger and its panic hook (which logs a panic's message at
    // `critical` before the trap).
    proxy_wasm::set_log_level(proxy_wasm::types::LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn proxy_wasm::traits::RootContext> {
        Box::new(host::Root::default())
    });
}}

pub use worker::{INFERENCE_PATHS, WorkerState, is_inference_path};
