//! kvsteer-wasm-host: a proxy-wasm ABI 0.2.1 host on wasmtime, for testing a compiled proxy-wasm
//! HTTP filter in `cargo test` without Envoy or nginx. It knows nothing of kvsteer: any filter
//! built for `wasm32-wasip1` with a proxy-wasm SDK loads.
//!
//! - [`host`]: the host. [`FilterModule`] (one compiled `.wasm`), [`Proxy`] (one plugin
//!   configuration in one proxy process: shared data, shared queues, metrics and a virtual clock),
//!   [`WorkerVm`] (one worker's VM, driven callback by callback), in Envoy or nginx
//!   (ngx_wasm_module) mode ([`HostMode`]). Host calls answer with the status codes Envoy answers.
//! - [`abi`]: the ABI's status codes, enums and header-pair format.
//!
//! Loading a filter and driving one request through it:
//!
//! ```no_run
//! use kvsteer_wasm_host::{Action, FilterModule, HostMode, Proxy, ProxyOptions, pairs};
//!
//! # fn main() -> Result<(), kvsteer_wasm_host::HostError> {
//! let module = FilterModule::load(std::path::Path::new("my_filter.wasm"))?;
//! // The plugin configuration the filter's `on_configure` reads.
//! let proxy = Proxy::new(&module, ProxyOptions::new(HostMode::Envoy, br#"{"key":1}"#.to_vec()));
//! let mut worker = proxy.start_worker()?; // instantiate, vm_start, configure
//! let id = worker.new_stream()?;
//! let headers = pairs(&[(":method", "GET"), (":path", "/"), (":authority", "example")]);
//! let action = worker.request_headers(id, headers, true)?;
//! if action == Action::Continue {
//!     // The request went upstream: answer it as the upstream would.
//!     worker.response_headers(id, pairs(&[(":status", "200")]), false)?;
//!     worker.response_body(id, b"hello", true)?;
//! }
//! let stream = worker.end_stream(id)?; // what the filter did: headers, bodies, local response
//! println!("{:?} {:?}", stream.upstream_headers, stream.local_response);
//! # Ok(())
//! # }
//! ```
//!
//! Time is virtual: [`Proxy::set_now_ns`] moves the clock the filter reads and [`WorkerVm::tick`]
//! fires its timer; [`WorkerVm::take_callouts`] and [`WorkerVm::answer_callout`] serve its
//! `proxy_http_call`s. Every guest callback runs under a fuel budget, so a runaway loop is reported
//! as a trap ([`HostError::Trap`]), like a panic, and the worker is dead afterwards. Compiled modules
//! are cached on disk under `$KVSTEER_MODULE_CACHE`, else `<target dir>/kvsteer-module-cache/`.
//! Environment: `KVSTEER_HOST_LOG` copies the filter's log lines to stderr; `KVSTEER_PERFMAP=1`
//! makes wasmtime write a perf map.

pub mod abi;
pub mod host;
mod module_cache;
mod wasi;

pub use abi::{Action, LogLevel, Pairs, Status};
pub use host::{
    CallOutcome, Callout, FilterModule, HostError, HostMode, LocalResponse, Proxy, ProxyOptions,
    StreamState, WorkerVm, header_value, pairs,
};
