//! A proxy-wasm ABI 0.2.1 host on wasmtime: the second host the filter runs on, besides Envoy/nginx.
//!
//! Shape, as in Envoy: one compiled [`FilterModule`]; a [`Proxy`] (one plugin configuration, one
//! process: shared data, shared queues, metrics and the virtual clock are process-wide); any number of
//! [`WorkerVm`]s started from it, each its own VM (store + instance) with its own root context, as
//! Envoy runs one VM per worker thread. Host calls answer with the status codes Envoy answers (checked
//! against proxy-wasm-cpp-host and Envoy's `Context`), because the Rust SDK panics on any status it
//! does not expect: a host that answered more leniently would hide real traps.
//!
//! Every guest call runs under a fuel budget, so an infinite loop is reported like a trap instead of
//! hanging the test. Any trap (a Rust panic is an `unreachable` trap after the SDK's panic hook logged
//! the message at `critical`) is returned as [`HostError::Trap`] with that message, and the worker is
//! dead afterwards, as the VM would be in a proxy.
//!
//! This module holds the host state ([`Proxy`]'s process-wide part, [`VmState`] per VM) and the
//! linking; the `env` imports are defined by area, in the ABI's own grouping, each area's `add_*`
//! function linking its own:
//!
//! | module | imports |
//! |---|---|
//! | `log_time` | `proxy_log`, `proxy_get_log_level`, `proxy_get_current_time_nanoseconds`, `proxy_set_tick_period_milliseconds` |
//! | `buffers` | `proxy_get_buffer_bytes`, `proxy_set_buffer_bytes` |
//! | `headers` | `proxy_{get,set}_header_map_pairs`, `proxy_{get,add,replace,remove}_header_map_value` |
//! | `properties` | `proxy_get_property`, `proxy_set_property` |
//! | `shared` | `proxy_{get,set}_shared_data`, `proxy_{register,resolve,enqueue,dequeue}_shared_queue` |
//! | `streams` | `proxy_continue_stream`, `proxy_close_stream`, `proxy_send_local_response` |
//! | `http_call` | `proxy_http_call`, `proxy_get_status` |
//! | `grpc` | `proxy_grpc_{call,stream,send,cancel,close}` (all `Unimplemented`) |
//! | `metrics` | `proxy_{define,get,record,increment}_metric` |
//! | `context` | `proxy_set_effective_context`, `proxy_done`, `proxy_call_foreign_function` |
//!
//! `memory` reads and writes guest memory; `worker_vm` is the VM the harness drives (the guest's
//! exports and the callbacks Envoy makes). The WASI imports are in `crate::wasi`.

mod buffers;
mod context;
mod grpc;
mod headers;
mod http_call;
mod log_time;
mod memory;
mod metrics;
mod properties;
mod shared;
mod streams;
mod worker_vm;

pub use headers::{header_value, pairs};
pub use http_call::{CallOutcome, Callout};
pub use log_time::LogLine;
pub(crate) use memory::{guest_read, guest_write};
pub use metrics::Metric;
pub use streams::{CallbackRecord, LocalResponse, StreamState};
pub use worker_vm::WorkerVm;

use crate::abi::LogLevel;
use http_call::CallResponseView;
use shared::{SharedData, SharedQueue};
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use wasmtime::{Config, Engine, Linker, Memory, Module, Store, TypedFunc};

/// Wall-clock base of the virtual clock (2026-01-01T00:00:00Z): the filter sees plausible timestamps.
pub const CLOCK_BASE_NS: u64 = 1_767_225_600_000_000_000;
/// Fuel per guest callback: far above what any routing decision needs, low enough to stop a runaway
/// loop within a second or two.
pub const FUEL_PER_CALLBACK: u64 = 2_000_000_000;

/// The import module of every proxy-wasm ABI function.
const ENV: &str = "env";

/// Everything that can go wrong running the filter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostError {
    /// The module could not be read, compiled or linked.
    Load(String),
    /// The guest trapped (a panic, an out-of-bounds access, fuel exhaustion, `proc_exit`).
    Trap {
        worker: usize,
        callback: &'static str,
        context: u32,
        trap: String,
        /// The panic message the SDK's panic hook logged, when there was one.
        panic: Option<String>,
    },
    /// The worker trapped earlier; a proxy would have torn the VM down.
    Dead { worker: usize },
    /// `proxy_on_vm_start` or `proxy_on_configure` returned false.
    Refused {
        worker: usize,
        callback: &'static str,
    },
    /// The harness asked for something impossible (unknown stream or token).
    Usage(String),
}

impl fmt::Display for HostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostError::Load(m) => write!(f, "loading the filter: {m}"),
            HostError::Trap {
                worker,
                callback,
                context,
                trap,
                panic,
            } => {
                write!(
                    f,
                    "the filter trapped in {callback} (worker {worker}, context {context}): {trap}"
                )?;
                if let Some(p) = panic {
                    write!(f, "; panic: {p}")?;
                }
                Ok(())
            }
            HostError::Dead { worker } => {
                write!(f, "worker {worker} is dead after an earlier trap")
            }
            HostError::Refused { worker, callback } => {
                write!(
                    f,
                    "the filter refused its configuration in {callback} (worker {worker})"
                )
            }
            HostError::Usage(m) => write!(f, "harness misuse: {m}"),
        }
    }
}

impl std::error::Error for HostError {}

/// Which proxy the host imitates.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum HostMode {
    /// Envoy: body chunks delivered as they arrive, `proxy_http_call` to named clusters.
    Envoy,
    /// Kong's ngx_wasm_module: the request body is read whole and delivered once with end of stream;
    /// `proxy_http_call` goes to an address (`host:port`), not a cluster; the filter picks the upstream by
    /// `set_property(["ngx", VAR])`.
    Nginx,
}

/// The configuration of one plugin in one proxy process.
#[derive(Clone, Debug)]
pub struct ProxyOptions {
    pub mode: HostMode,
    pub plugin_config: Vec<u8>,
    pub vm_config: Vec<u8>,
    pub vm_id: String,
    pub plugin_name: String,
    pub log_level: LogLevel,
    /// Envoy mode: the cluster names `proxy_http_call` accepts (others get `BadArgument`, as in Envoy).
    /// `None` accepts any name.
    pub clusters: Option<Vec<String>>,
    /// Copy the filter's log lines to stderr as they come.
    pub echo_logs: bool,
    /// Seed of `random_get`.
    pub seed: u64,
    /// The `xds.node.id` property, Envoy's node id (`--service-node`); `None` answers `NotFound`, as
    /// a host without one would. The filter mixes it into its tie-break seed.
    pub node_id: Option<String>,
    /// A slow machine: the clock the filter reads runs ahead by this many nanoseconds per unit of
    /// fuel (about one WebAssembly operator) the VM has spent in the current callback, so work done
    /// inside one callback takes visible time, as on a real proxy's wall clock. 0 (the default):
    /// the virtual clock stands still during a callback. Needs the metered module.
    pub clock_ns_per_fuel: u64,
    /// nginx mode: the limits of the nginx the host imitates ([`NginxLimits`]).
    pub nginx: NginxLimits,
}

/// What an nginx with ngx_wasm_module bounds, as `nginx/nginx.conf` sets it (nginx mode only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NginxLimits {
    /// Size of the `shm_kv` zone holding the shared data (`shm_kv * 16m`). A write that does not fit
    /// evicts the least recently used entries first, as the module's default `eviction=slru` does.
    pub shm_kv_bytes: usize,
    /// `worker_connections`: connections one worker may hold; a callout past it is refused
    /// (`InternalFailure`), as the module answers when nginx has no free connection.
    pub worker_connections: usize,
}

impl Default for NginxLimits {
    fn default() -> Self {
        NginxLimits {
            shm_kv_bytes: 16 << 20,
            worker_connections: 4096,
        }
    }
}

/// A worker's callout connections (nginx mode): opened, closed, and open now. ngx_wasm_module
/// releases a root context's callout connections only when none of its callouts is left out, and
/// then only the last one answered: a callout answered while another is still out keeps its
/// connection for good (at 3bed2783: 4 callouts a tick took 4 connections and gave 1 back).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CalloutConnections {
    pub opened: u64,
    pub closed: u64,
    pub open: u64,
    /// Callouts refused because `worker_connections` were all held.
    pub refused: u64,
}

impl ProxyOptions {
    pub fn new(mode: HostMode, plugin_config: impl Into<Vec<u8>>) -> Self {
        ProxyOptions {
            mode,
            plugin_config: plugin_config.into(),
            vm_config: Vec::new(),
            vm_id: String::new(),
            plugin_name: "kvsteer".into(),
            log_level: LogLevel::Info,
            clusters: None,
            echo_logs: std::env::var_os("KVSTEER_HOST_LOG").is_some(),
            seed: 0x006b_7673_7465_6572,
            node_id: None,
            clock_ns_per_fuel: 0,
            nginx: NginxLimits::default(),
        }
    }
}

/// The compiled filter, shared by every proxy and worker of one run.
#[derive(Clone)]
pub struct FilterModule {
    engine: Engine,
    module: Module,
    linker: Arc<Linker<VmState>>,
    metered: bool,
    size: usize,
}

impl FilterModule {
    /// Compiles the filter with fuel metering (tests: a hang becomes a reported trap).
    pub fn load(path: &Path) -> Result<Self, HostError> {
        Self::load_with(path, true)
    }

    /// Compiles the filter without fuel metering, as a proxy runs it (benchmarks).
    pub fn load_unmetered(path: &Path) -> Result<Self, HostError> {
        Self::load_with(path, false)
    }

    fn load_with(path: &Path, metered: bool) -> Result<Self, HostError> {
        let bytes =
            std::fs::read(path).map_err(|e| HostError::Load(format!("{}: {e}", path.display())))?;
        Self::from_bytes(&bytes, metered)
    }

    /// Compiles a module from its bytes and checks that the host provides every import.
    pub fn from_bytes(bytes: &[u8], metered: bool) -> Result<Self, HostError> {
        let mut config = Config::new();
        config.consume_fuel(metered);
        // `KVSTEER_PERFMAP=1`: wasmtime writes /tmp/perf-<pid>.map so that `perf record` names the
        // guest's functions (how the filter path was profiled; docs/design/harness.md).
        if std::env::var_os("KVSTEER_PERFMAP").is_some() {
            config.profiler(wasmtime::ProfilingStrategy::PerfMap);
        }
        if cfg!(debug_assertions) {
            // A debug build of Cranelift takes ~17 s on the 500 KB filter at full optimization; tests
            // need the filter's behaviour, not its speed (bench and demo are release builds).
            config.cranelift_opt_level(wasmtime::OptLevel::None);
        }
        let engine = Engine::new(&config).map_err(|e| HostError::Load(format!("{e:#}")))?;
        let module = crate::module_cache::compile(&engine, bytes)
            .map_err(|e| HostError::Load(format!("compile: {e:#}")))?;
        let mut linker = Linker::new(&engine);
        add_proxy_abi(&mut linker).map_err(|e| HostError::Load(format!("{e:#}")))?;
        crate::wasi::add_to_linker(&mut linker).map_err(|e| HostError::Load(format!("{e:#}")))?;
        let mut missing = Vec::new();
        let mut probe = Store::new(&engine, VmState::placeholder());
        for import in module.imports() {
            if linker.get_by_import(&mut probe, &import).is_none() {
                missing.push(format!("{}::{}", import.module(), import.name()));
            }
        }
        if !missing.is_empty() {
            return Err(HostError::Load(format!(
                "the module imports functions this host does not provide: {}",
                missing.join(", ")
            )));
        }
        let exports: Vec<String> = module.exports().map(|e| e.name().to_string()).collect();
        if !exports.iter().any(|e| e == "proxy_abi_version_0_2_1") {
            return Err(HostError::Load(format!(
                "not a proxy-wasm 0.2.1 module (exports: {})",
                exports.join(", ")
            )));
        }
        Ok(FilterModule {
            engine,
            module,
            linker: Arc::new(linker),
            metered,
            size: bytes.len(),
        })
    }

    /// Size of the `.wasm` in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// `module::name` of every import, for reports.
    pub fn imports(&self) -> Vec<String> {
        self.module
            .imports()
            .map(|i| format!("{}::{}", i.module(), i.name()))
            .collect()
    }
}

/// Process-wide state: what Envoy keeps outside the VMs.
struct Shared {
    clock_ns: AtomicU64,
    data: Mutex<SharedData>,
    /// nginx mode: the `shm_kv` zone's use and recency ([`shared::ShmZone`]).
    zone: Mutex<shared::ShmZone>,
    next_cas: AtomicU64,
    queues: Mutex<Vec<SharedQueue>>,
    metrics: Mutex<Vec<Metric>>,
    /// Imports the host refuses, with the status it answers ([`Proxy::refuse_host_call`]).
    refusals: Mutex<HashMap<String, u32>>,
}

/// A proxy process with one plugin configuration. Cheap to clone (a handle).
#[derive(Clone)]
pub struct Proxy {
    module: FilterModule,
    shared: Arc<Shared>,
    options: Arc<ProxyOptions>,
    next_worker: Arc<AtomicU64>,
}

impl Proxy {
    pub fn new(module: &FilterModule, options: ProxyOptions) -> Proxy {
        Proxy {
            module: module.clone(),
            shared: Arc::new(Shared {
                clock_ns: AtomicU64::new(0),
                data: Mutex::new(HashMap::new()),
                zone: Mutex::new(shared::ShmZone::default()),
                next_cas: AtomicU64::new(1),
                queues: Mutex::new(Vec::new()),
                metrics: Mutex::new(Vec::new()),
                refusals: Mutex::new(HashMap::new()),
            }),
            options: Arc::new(options),
            next_worker: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn options(&self) -> &ProxyOptions {
        &self.options
    }

    /// Virtual time since the start of the run, in nanoseconds.
    pub fn now_ns(&self) -> u64 {
        self.shared.clock_ns.load(Ordering::Relaxed)
    }

    /// Moves the virtual clock; it never goes backwards.
    pub fn set_now_ns(&self, ns: u64) {
        self.shared.clock_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// nginx mode: shared-data entries the `shm_kv` zone evicted to make room, so far.
    pub fn shm_evictions(&self) -> u64 {
        lock(&self.shared.zone).evictions
    }

    /// A shared-data entry and its CAS value.
    pub fn shared_data(&self, key: &[u8]) -> Option<(Vec<u8>, u32)> {
        lock(&self.shared.data).get(key).cloned()
    }

    /// Every shared-data key, sorted.
    pub fn shared_data_keys(&self) -> Vec<Vec<u8>> {
        let mut keys: Vec<Vec<u8>> = lock(&self.shared.data).keys().cloned().collect();
        keys.sort();
        keys
    }

    pub fn metrics(&self) -> Vec<Metric> {
        lock(&self.shared.metrics).clone()
    }

    pub fn metric(&self, name: &str) -> Option<Metric> {
        lock(&self.shared.metrics)
            .iter()
            .find(|m| m.name == name)
            .cloned()
    }

    /// Makes every worker's host answer `import` (an `env` function's name, e.g.
    /// `proxy_get_buffer_bytes`) with `status` and do nothing else, until
    /// [`Proxy::accept_host_call`]: a proxy refusing a call in a phase it does not allow it in (as
    /// nginx's module does), or a call it lacks (`Unimplemented`, 12). Any code may be given, also
    /// one outside the ABI's list. Supported for the calls the filter makes (`refuse_if_asked!`).
    pub fn refuse_host_call(&self, import: &str, status: u32) {
        lock(&self.shared.refusals).insert(import.to_string(), status);
    }

    /// Undoes [`Proxy::refuse_host_call`].
    pub fn accept_host_call(&self, import: &str) {
        lock(&self.shared.refusals).remove(import);
    }

    /// Starts a worker VM the way Envoy does: instantiate, `_initialize`, create the root context,
    /// `proxy_on_vm_start`, `proxy_on_configure` with the plugin configuration.
    pub fn start_worker(&self) -> Result<WorkerVm, HostError> {
        let index = self.next_worker.fetch_add(1, Ordering::Relaxed) as usize;
        let state = VmState {
            shared: Some(self.shared.clone()),
            options: self.options.clone(),
            worker: index,
            memory: None,
            allocator: None,
            effective: ROOT_CONTEXT,
            tick_period_ms: 0,
            streams: HashMap::new(),
            call_response: None,
            callouts: Vec::new(),
            next_token: 1,
            logs: Vec::new(),
            log_counts: [0; 6],
            last_critical: None,
            stdio: [Vec::new(), Vec::new()],
            root_properties: HashMap::new(),
            rng: self.options.seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1,
            notes: Vec::new(),
            done_called: false,
            status: (0, Vec::new()),
            connections: CalloutConnections::default(),
            root_out: Default::default(),
        };
        WorkerVm::start(&self.module, state)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means another harness thread panicked; the data is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Context id of every worker's root context (Envoy numbers them per VM too).
pub const ROOT_CONTEXT: u32 = 1;

/// Per-VM host state (the wasmtime store's data).
pub struct VmState {
    shared: Option<Arc<Shared>>,
    options: Arc<ProxyOptions>,
    worker: usize,
    memory: Option<Memory>,
    allocator: Option<TypedFunc<i32, i32>>,
    effective: u32,
    tick_period_ms: u32,
    streams: HashMap<u32, StreamState>,
    call_response: Option<CallResponseView>,
    callouts: Vec<Callout>,
    next_token: u32,
    logs: Vec<LogLine>,
    log_counts: [u64; 6],
    last_critical: Option<String>,
    stdio: [Vec<u8>; 2],
    root_properties: HashMap<Vec<String>, Vec<u8>>,
    rng: u64,
    /// ABI misuse the host noticed (bad pointers, unknown enum values); tests assert it stays empty.
    notes: Vec<String>,
    done_called: bool,
    /// `proxy_get_status`: code and message of the last callout failure.
    status: (u32, Vec<u8>),
    /// nginx mode: this worker's callout connections ([`CalloutConnections`]).
    connections: CalloutConnections,
    /// nginx mode: the callouts of the root context not answered yet.
    root_out: std::collections::HashSet<u32>,
}

impl VmState {
    fn placeholder() -> VmState {
        VmState {
            shared: None,
            options: Arc::new(ProxyOptions::new(HostMode::Envoy, Vec::new())),
            worker: 0,
            memory: None,
            allocator: None,
            effective: 0,
            tick_period_ms: 0,
            streams: HashMap::new(),
            call_response: None,
            callouts: Vec::new(),
            next_token: 1,
            logs: Vec::new(),
            log_counts: [0; 6],
            last_critical: None,
            stdio: [Vec::new(), Vec::new()],
            root_properties: HashMap::new(),
            rng: 1,
            notes: Vec::new(),
            done_called: false,
            status: (0, Vec::new()),
            connections: CalloutConnections::default(),
            root_out: Default::default(),
        }
    }

    /// The status a test made the host refuse `import` with ([`Proxy::refuse_host_call`]).
    fn refusal(&self, import: &str) -> Option<u32> {
        let shared = self.shared.as_deref()?;
        lock(&shared.refusals).get(import).copied()
    }

    fn shared(&self) -> &Shared {
        self.shared
            .as_deref()
            .expect("host state used before start_worker")
    }

    /// xorshift64*: deterministic bytes for `random_get` (HashMap seeds inside the filter).
    pub(crate) fn random_bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            self.rng ^= self.rng >> 12;
            self.rng ^= self.rng << 25;
            self.rng ^= self.rng >> 27;
            let v = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.truncate(len);
        out
    }

    fn note(&mut self, what: String) {
        if self.notes.len() < 1000 {
            self.notes.push(what);
        }
    }
}

/// Defines every `env` import of proxy-wasm ABI 0.2.1, area by area.
fn add_proxy_abi(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    log_time::add_log_time(linker)?;
    buffers::add_buffers(linker)?;
    headers::add_headers(linker)?;
    properties::add_properties(linker)?;
    shared::add_shared_data(linker)?;
    shared::add_shared_queues(linker)?;
    streams::add_stream_control(linker)?;
    http_call::add_http_call(linker)?;
    grpc::add_grpc(linker)?;
    context::add_context(linker)?;
    metrics::add_metrics(linker)?;
    Ok(())
}
