//! kvsteer-host-test: runs the compiled kvsteer filter (`kvsteer_filter.wasm`) the way a proxy would.
//!
//! - [`host`]: the proxy-wasm ABI 0.2.1 host on wasmtime ([`FilterModule`], [`Proxy`], [`WorkerVm`]:
//!   one worker's VM), in Envoy or nginx (ngx_wasm_module) mode, with a virtual clock and
//!   process-wide shared data: the `kvsteer-wasm-host` crate (`wasm-host/`), re-exported.
//! - [`abi`]: the ABI's status codes, enums and header-pair format (the same crate's).
//! - [`harness`]: the filter in front of simulated replicas in virtual time ([`Harness`]): requests as
//!   streams, feed callouts answered by the engines, faults, and workload replay.
//! - [`oracle`]: the benchmark's limit: the harness itself places each request knowing the true
//!   output lengths and the engines' exact state (never part of the filter).
//! - [`openai`]: completions requests and vLLM-shaped SSE responses.
//! - [`artifact`]: where the compiled filter is found.
//! - [`testing`]: the setup the integration tests of this crate and of `kvsteer-lab` share.
//!
//! The point of a second host is to prove, in `cargo test`, that the filter routes correctly and never
//! traps, without an Envoy binary: every call crosses the same ABI boundary a proxy's would.

pub use kvsteer_wasm_host::{abi, host};

pub mod artifact;
pub mod disaggregated_fleet;
pub mod harness;
pub mod openai;
pub mod oracle;
pub mod outcome;
pub mod testing;

pub use abi::{Action, LogLevel, Pairs, Status};
pub use artifact::filter_wasm_path;
pub use harness::{
    DISCOVERY_CLUSTER, FeedFault, HARNESS_PEER_TOKEN, Harness, HarnessConfig, HarnessError,
    HarnessStats, MEMBER_FEEDS_CLUSTER, Output, ProxyAnswer, ProxySpread, RequestRecord,
    RequestSpec, ResponseFault, flood_hash, peer_cluster,
};
pub use host::{
    CallOutcome, Callout, FilterModule, HostError, HostMode, LocalResponse, Proxy, ProxyOptions,
    StreamState, WorkerVm, header_value, pairs,
};
