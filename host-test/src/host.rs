//! A proxy-wasm ABI 0.2.1 host on wasmtime: the second host the filter runs on, besides Envoy/nginx.
//!
//! Shape, as in Envoy: one compiled [`FilterModule`]; a [`Proxy`] (one plugin configuration, one
//! process: shared data, shared queues, metrics and the virtual clock are process-wide); any number of
//! [`Worker`]s started from it, each its own VM (store + instance) with its own root context, as Envoy
//! runs one VM per worker thread. Host calls answer with the status codes Envoy answers (checked against
//! proxy-wasm-cpp-host and Envoy's `Context`), because the Rust SDK panics on any status it does not
//! expect: a host that answered more leniently would hide real traps.
//!
//! Every guest call runs under a fuel budget, so an infinite loop is reported like a trap instead of
//! hanging the test. Any trap (a Rust panic is an `unreachable` trap after the SDK's panic hook logged
//! the message at `critical`) is returned as [`HostError::Trap`] with that message, and the worker is
//! dead afterwards, as the VM would be in a proxy.

use crate::abi::{
    Action, BufferType, LogLevel, MapType, MetricType, Pairs, Status, StreamType, decode_pairs,
    decode_property_path, encode_pairs,
};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use wasmtime::{
    Caller, Config, Engine, Extern, Instance, Linker, Memory, Module, Store, TypedFunc, WasmParams,
};

/// Wall-clock base of the virtual clock (2026-01-01T00:00:00Z): the filter sees plausible timestamps.
pub const CLOCK_BASE_NS: u64 = 1_767_225_600_000_000_000;
/// Fuel per guest callback: far above what any routing decision needs, low enough to stop a runaway
/// loop within a second or two.
pub const FUEL_PER_CALLBACK: u64 = 2_000_000_000;
/// Log lines kept per worker (counts are kept for all).
const LOG_KEEP: usize = 20_000;

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

/// A metric as the proxy holds it (process-wide, like Envoy stats).
#[derive(Clone, Debug, PartialEq)]
pub struct Metric {
    pub name: String,
    pub kind: MetricType,
    /// Counter total or gauge value.
    pub value: i64,
    /// Histogram samples.
    pub samples: Vec<u64>,
}

#[derive(Default)]
struct SharedQueue {
    vm_id: String,
    name: String,
    owner_worker: usize,
    owner_context: u32,
    items: VecDeque<Vec<u8>>,
    notify: bool,
}

/// Shared data: key -> (value, CAS token).
type SharedData = HashMap<Vec<u8>, (Vec<u8>, u32)>;

/// Process-wide state: what Envoy keeps outside the VMs.
struct Shared {
    clock_ns: AtomicU64,
    data: Mutex<SharedData>,
    next_cas: AtomicU64,
    queues: Mutex<Vec<SharedQueue>>,
    metrics: Mutex<Vec<Metric>>,
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
                next_cas: AtomicU64::new(1),
                queues: Mutex::new(Vec::new()),
                metrics: Mutex::new(Vec::new()),
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

    /// Starts a worker VM the way Envoy does: instantiate, `_initialize`, create the root context,
    /// `proxy_on_vm_start`, `proxy_on_configure` with the plugin configuration.
    pub fn start_worker(&self) -> Result<Worker, HostError> {
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
        };
        let mut store = Store::new(&self.module.engine, state);
        if self.module.metered {
            let _ = store.set_fuel(FUEL_PER_CALLBACK);
        }
        let instance = self
            .module
            .linker
            .instantiate(&mut store, &self.module.module)
            .map_err(|e| HostError::Load(format!("instantiate: {e:#}")))?;
        let memory = match instance.get_export(&mut store, "memory") {
            Some(Extern::Memory(m)) => m,
            _ => return Err(HostError::Load("the module exports no memory".into())),
        };
        let allocator = instance
            .get_typed_func::<i32, i32>(&mut store, "proxy_on_memory_allocate")
            .or_else(|_| instance.get_typed_func::<i32, i32>(&mut store, "malloc"))
            .map_err(|_| HostError::Load("the module exports no allocator".into()))?;
        store.data_mut().memory = Some(memory);
        store.data_mut().allocator = Some(allocator);
        let exports = Exports::find(&instance, &mut store);
        let mut worker = Worker {
            store,
            exports,
            index,
            metered: self.module.metered,
            dead: false,
            next_context: ROOT_CONTEXT + 1,
            plugin_config_len: self.options.plugin_config.len(),
            vm_config_len: self.options.vm_config.len(),
        };
        if let Some(init) = worker.exports.initialize.clone() {
            worker.call("_initialize", 0, |s| init.call(s, ()))?;
        }
        if let Some(f) = worker.exports.on_context_create.clone() {
            worker.call("proxy_on_context_create", ROOT_CONTEXT, |s| {
                f.call(s, (ROOT_CONTEXT as i32, 0))
            })?;
        }
        let vm_len = worker.vm_config_len as i32;
        if let Some(f) = worker.exports.on_vm_start.clone()
            && worker.call("proxy_on_vm_start", ROOT_CONTEXT, |s| {
                f.call(s, (ROOT_CONTEXT as i32, vm_len))
            })? == 0
        {
            return Err(HostError::Refused {
                worker: index,
                callback: "proxy_on_vm_start",
            });
        }
        let cfg_len = worker.plugin_config_len as i32;
        if let Some(f) = worker.exports.on_configure.clone()
            && worker.call("proxy_on_configure", ROOT_CONTEXT, |s| {
                f.call(s, (ROOT_CONTEXT as i32, cfg_len))
            })? == 0
        {
            return Err(HostError::Refused {
                worker: index,
                callback: "proxy_on_configure",
            });
        }
        Ok(worker)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means another harness thread panicked; the data is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Context id of every worker's root context (Envoy numbers them per VM too).
pub const ROOT_CONTEXT: u32 = 1;

/// A log line the filter wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    pub worker: usize,
    pub context: u32,
    pub level: LogLevel,
    pub message: String,
}

/// A local response the filter sent instead of proxying.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalResponse {
    pub status: u32,
    pub details: String,
    pub body: Vec<u8>,
    pub headers: Pairs,
}

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
    request_buffer: Vec<u8>,
    response_buffer: Vec<u8>,
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
    pub local_response: Option<LocalResponse>,
    /// The filter called `proxy_close_stream`.
    pub closed: bool,
    /// The filter called the `clear_route_cache` foreign function (Envoy re-selects the route).
    pub route_cache_cleared: bool,
    pub callbacks: Vec<CallbackRecord>,
    /// Properties the filter set during this stream (nginx: `["ngx", VAR]` variables).
    pub properties: HashMap<Vec<String>, Vec<u8>>,
    request_done: bool,
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

/// First value of a header (names compared case-insensitively), as text.
pub fn header_value<'a>(pairs: &'a [(Vec<u8>, Vec<u8>)], name: &str) -> Option<&'a str> {
    pairs
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

/// Builds header pairs from text, lower-casing names as Envoy does.
pub fn pairs(list: &[(&str, &str)]) -> Pairs {
    list.iter()
        .map(|(k, v)| (k.to_ascii_lowercase().into_bytes(), v.as_bytes().to_vec()))
        .collect()
}

/// The answer to an HTTP callout while `proxy_on_http_call_response` runs.
struct CallResponseView {
    headers: Option<Pairs>,
    body: Option<Vec<u8>>,
    trailers: Option<Pairs>,
}

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
        }
    }

    fn shared(&self) -> &Shared {
        self.shared
            .as_deref()
            .expect("host state used before start_worker")
    }

    pub(crate) fn now_ns(&self) -> u64 {
        CLOCK_BASE_NS
            + self
                .shared
                .as_ref()
                .map_or(0, |s| s.clock_ns.load(Ordering::Relaxed))
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

    pub(crate) fn capture_stdio(&mut self, fd: i32, bytes: &[u8]) {
        let slot = if fd == 1 { 0 } else { 1 };
        self.stdio[slot].extend_from_slice(bytes);
        while let Some(pos) = self.stdio[slot].iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.stdio[slot].drain(..=pos).collect();
            let text = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
            let level = if fd == 1 {
                LogLevel::Info
            } else {
                LogLevel::Error
            };
            self.push_log(level, format!("[fd {fd}] {text}"));
        }
    }

    fn push_log(&mut self, level: LogLevel, message: String) {
        self.log_counts[level as usize] += 1;
        if level == LogLevel::Critical {
            self.last_critical = Some(message.clone());
        }
        if self.options.echo_logs {
            eprintln!(
                "[wasm w{} c{} {:?}] {}",
                self.worker, self.effective, level, message
            );
        }
        if self.logs.len() < LOG_KEEP {
            self.logs.push(LogLine {
                worker: self.worker,
                context: self.effective,
                level,
                message,
            });
        }
    }

    fn note(&mut self, what: String) {
        if self.notes.len() < 1000 {
            self.notes.push(what);
        }
    }

    fn stream_mut(&mut self) -> Option<&mut StreamState> {
        let id = self.effective;
        self.streams.get_mut(&id)
    }

    fn map(&self, map: MapType) -> Option<&Pairs> {
        match map {
            MapType::HttpCallResponseHeaders => self.call_response.as_ref()?.headers.as_ref(),
            MapType::HttpCallResponseTrailers => self.call_response.as_ref()?.trailers.as_ref(),
            _ => {
                let s = self.streams.get(&self.effective)?;
                match map {
                    MapType::RequestHeaders => Some(&s.request_headers),
                    MapType::RequestTrailers => s.request_trailers.as_ref(),
                    MapType::ResponseHeaders => s.response_headers.as_ref(),
                    MapType::ResponseTrailers => s.response_trailers.as_ref(),
                    _ => None,
                }
            }
        }
    }

    /// Maps the filter may modify: the call response is read-only in Envoy.
    fn map_mut(&mut self, map: MapType) -> Option<&mut Pairs> {
        let id = self.effective;
        let s = self.streams.get_mut(&id)?;
        match map {
            MapType::RequestHeaders => Some(&mut s.request_headers),
            MapType::RequestTrailers => s.request_trailers.as_mut(),
            MapType::ResponseHeaders => s.response_headers.as_mut(),
            MapType::ResponseTrailers => s.response_trailers.as_mut(),
            _ => None,
        }
    }

    fn buffer(&self, buf: BufferType) -> Option<&[u8]> {
        match buf {
            BufferType::RequestBody => self
                .streams
                .get(&self.effective)
                .map(|s| s.request_buffer.as_slice()),
            BufferType::ResponseBody => self
                .streams
                .get(&self.effective)
                .map(|s| s.response_buffer.as_slice()),
            BufferType::HttpCallResponseBody => self.call_response.as_ref()?.body.as_deref(),
            BufferType::PluginConfiguration => Some(&self.options.plugin_config),
            BufferType::VmConfiguration => Some(&self.options.vm_config),
            _ => None,
        }
    }
}

/// Reads guest memory; out of bounds is `InvalidMemoryAccess`, never a host panic.
pub(crate) fn guest_read(
    c: &mut Caller<'_, VmState>,
    ptr: u32,
    len: u32,
) -> Result<Vec<u8>, Status> {
    let mem = c.data().memory.ok_or(Status::InternalFailure)?;
    let data = mem.data(&*c);
    let start = ptr as usize;
    let end = start
        .checked_add(len as usize)
        .ok_or(Status::InvalidMemoryAccess)?;
    data.get(start..end)
        .map(|s| s.to_vec())
        .ok_or(Status::InvalidMemoryAccess)
}

pub(crate) fn guest_write(
    c: &mut Caller<'_, VmState>,
    ptr: u32,
    bytes: &[u8],
) -> Result<(), Status> {
    let mem = c.data().memory.ok_or(Status::InternalFailure)?;
    let data = mem.data_mut(&mut *c);
    let start = ptr as usize;
    let end = start
        .checked_add(bytes.len())
        .ok_or(Status::InvalidMemoryAccess)?;
    data.get_mut(start..end)
        .ok_or(Status::InvalidMemoryAccess)?
        .copy_from_slice(bytes);
    Ok(())
}

/// Result of a host call: a status for the guest, or a trap (the guest allocator trapped).
type HostResult = wasmtime::Result<i32>;

/// Copies bytes into memory the guest allocated and writes the pointer and size to the guest's out
/// pointers, like proxy-wasm-cpp-host's `copyToPointerSize`: an empty value is a null pointer and size 0.
fn return_bytes(
    c: &mut Caller<'_, VmState>,
    bytes: &[u8],
    ptr_ptr: i32,
    size_ptr: i32,
) -> HostResult {
    let mut ptr = 0u32;
    if !bytes.is_empty() {
        let alloc = c
            .data()
            .allocator
            .clone()
            .ok_or_else(|| wasmtime::format_err!("no guest allocator"))?;
        let Ok(len) = i32::try_from(bytes.len()) else {
            return Ok(Status::InternalFailure.code());
        };
        ptr = alloc.call(&mut *c, len)? as u32;
        if ptr == 0 {
            return Ok(Status::InternalFailure.code());
        }
        if let Err(s) = guest_write(c, ptr, bytes) {
            return Ok(s.code());
        }
    }
    if guest_write(c, ptr_ptr as u32, &ptr.to_le_bytes()).is_err()
        || guest_write(c, size_ptr as u32, &(bytes.len() as u32).to_le_bytes()).is_err()
    {
        c.data_mut().note("out pointer outside guest memory".into());
        return Ok(Status::InvalidMemoryAccess.code());
    }
    Ok(Status::Ok.code())
}

/// Reads `(ptr, len)` from the guest or returns the status the host answers for bad memory.
macro_rules! read_or_status {
    ($c:expr, $ptr:expr, $len:expr) => {
        match guest_read($c, $ptr as u32, $len as u32) {
            Ok(v) => v,
            Err(s) => {
                $c.data_mut()
                    .note(format!("read outside guest memory at {}+{}", $ptr, $len));
                return Ok(s.code());
            }
        }
    };
}

fn ok() -> HostResult {
    Ok(Status::Ok.code())
}

fn status(s: Status) -> HostResult {
    Ok(s.code())
}

/// Defines every `env` import of proxy-wasm ABI 0.2.1.
fn add_proxy_abi(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    const ENV: &str = "env";
    linker.func_wrap(
        ENV,
        "proxy_log",
        |mut c: Caller<'_, VmState>, level: i32, ptr: i32, len: i32| -> HostResult {
            let msg = read_or_status!(&mut c, ptr, len);
            let Some(level) = LogLevel::from_raw(level) else {
                c.data_mut().note(format!("proxy_log with level {level}"));
                return status(Status::BadArgument);
            };
            let msg = String::from_utf8_lossy(&msg).into_owned();
            c.data_mut().push_log(level, msg);
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_log_level",
        |mut c: Caller<'_, VmState>, out: i32| -> HostResult {
            let level = c.data().options.log_level as u32;
            match guest_write(&mut c, out as u32, &level.to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_current_time_nanoseconds",
        |mut c: Caller<'_, VmState>, out: i32| -> HostResult {
            let now = c.data().now_ns();
            match guest_write(&mut c, out as u32, &now.to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_tick_period_milliseconds",
        |mut c: Caller<'_, VmState>, period: i32| -> HostResult {
            c.data_mut().tick_period_ms = period as u32;
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_buffer_bytes",
        |mut c: Caller<'_, VmState>,
         kind: i32,
         start: i32,
         max: i32,
         ptr_ptr: i32,
         size_ptr: i32|
         -> HostResult {
            let Some(kind) = BufferType::from_raw(kind) else {
                return status(Status::BadArgument);
            };
            let Some(buf) = c.data().buffer(kind) else {
                return status(Status::NotFound);
            };
            let (start, max) = (start as u32 as usize, max as u32 as usize);
            if start.checked_add(max).is_none() {
                return status(Status::BadArgument);
            }
            let end = (start + max).min(buf.len());
            let slice = buf.get(start.min(end)..end).unwrap_or(&[]).to_vec();
            if slice.is_empty() {
                // proxy-wasm-cpp-host returns Ok without touching the out pointers.
                return ok();
            }
            return_bytes(&mut c, &slice, ptr_ptr, size_ptr)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_buffer_bytes",
        |mut c: Caller<'_, VmState>,
         kind: i32,
         start: i32,
         size: i32,
         ptr: i32,
         len: i32|
         -> HostResult {
            let data = read_or_status!(&mut c, ptr, len);
            let (start, size) = (start as u32 as usize, size as u32 as usize);
            let Some(kind) = BufferType::from_raw(kind) else {
                return status(Status::BadArgument);
            };
            let Some(s) = c.data_mut().stream_mut() else {
                return status(Status::NotFound);
            };
            let buf = match kind {
                BufferType::RequestBody => &mut s.request_buffer,
                BufferType::ResponseBody => &mut s.response_buffer,
                _ => return status(Status::BadArgument),
            };
            // Envoy's Buffer::copyFrom: start 0 drains `size` bytes and prepends; start at or past the
            // end appends; anything in between is refused.
            if start == 0 {
                let drain = size.min(buf.len());
                buf.drain(..drain);
                buf.splice(0..0, data);
            } else if start >= buf.len() {
                buf.extend_from_slice(&data);
            } else {
                return status(Status::BadArgument);
            }
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_pairs",
        |mut c: Caller<'_, VmState>, map: i32, ptr_ptr: i32, size_ptr: i32| -> HostResult {
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data().map(map) else {
                return status(Status::BadArgument);
            };
            let bytes = encode_pairs(pairs);
            return_bytes(&mut c, &bytes, ptr_ptr, size_ptr)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_header_map_pairs",
        |mut c: Caller<'_, VmState>, map: i32, ptr: i32, len: i32| -> HostResult {
            let raw = read_or_status!(&mut c, ptr, len);
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Ok(new) = decode_pairs(&raw) else {
                c.data_mut().note("malformed header pairs".into());
                return status(Status::BadArgument);
            };
            let Some(target) = c.data_mut().map_mut(map) else {
                return status(Status::BadArgument);
            };
            *target = new
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect();
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_header_map_value",
        |mut c: Caller<'_, VmState>,
         map: i32,
         kptr: i32,
         klen: i32,
         ptr_ptr: i32,
         size_ptr: i32|
         -> HostResult {
            let key = read_or_status!(&mut c, kptr, klen);
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data().map(map) else {
                return status(Status::BadArgument);
            };
            let Some(value) = pairs
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(&key))
                .map(|(_, v)| v.clone())
            else {
                return status(Status::NotFound);
            };
            return_bytes(&mut c, &value, ptr_ptr, size_ptr)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_replace_header_map_value",
        |mut c: Caller<'_, VmState>,
         map: i32,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32|
         -> HostResult {
            let key = read_or_status!(&mut c, kptr, klen).to_ascii_lowercase();
            let value = read_or_status!(&mut c, vptr, vlen);
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data_mut().map_mut(map) else {
                return status(Status::BadArgument);
            };
            match pairs.iter().position(|(k, _)| *k == key) {
                Some(i) => {
                    pairs[i].1 = value;
                    let mut j = i + 1;
                    while j < pairs.len() {
                        if pairs[j].0 == key {
                            pairs.remove(j);
                        } else {
                            j += 1;
                        }
                    }
                }
                None => pairs.push((key, value)),
            }
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_remove_header_map_value",
        |mut c: Caller<'_, VmState>, map: i32, kptr: i32, klen: i32| -> HostResult {
            let key = read_or_status!(&mut c, kptr, klen).to_ascii_lowercase();
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data_mut().map_mut(map) else {
                return status(Status::BadArgument);
            };
            pairs.retain(|(k, _)| *k != key);
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_add_header_map_value",
        |mut c: Caller<'_, VmState>,
         map: i32,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32|
         -> HostResult {
            let key = read_or_status!(&mut c, kptr, klen).to_ascii_lowercase();
            let value = read_or_status!(&mut c, vptr, vlen);
            let Some(map) = MapType::from_raw(map) else {
                return status(Status::BadArgument);
            };
            let Some(pairs) = c.data_mut().map_mut(map) else {
                return status(Status::BadArgument);
            };
            pairs.push((key, value));
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_property",
        |mut c: Caller<'_, VmState>,
         pptr: i32,
         plen: i32,
         ptr_ptr: i32,
         size_ptr: i32|
         -> HostResult {
            let path = decode_property_path(&read_or_status!(&mut c, pptr, plen));
            let value = {
                let st = c.data();
                let stream_prop = st
                    .streams
                    .get(&st.effective)
                    .and_then(|s| s.properties.get(&path));
                stream_prop
                    .or_else(|| st.root_properties.get(&path))
                    .cloned()
                    .or_else(|| builtin_property(st, &path))
            };
            match value {
                Some(v) => return_bytes(&mut c, &v, ptr_ptr, size_ptr),
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_property",
        |mut c: Caller<'_, VmState>, pptr: i32, plen: i32, vptr: i32, vlen: i32| -> HostResult {
            let path = decode_property_path(&read_or_status!(&mut c, pptr, plen));
            let value = read_or_status!(&mut c, vptr, vlen);
            let st = c.data_mut();
            let id = st.effective;
            match st.streams.get_mut(&id) {
                Some(s) => {
                    s.properties.insert(path, value);
                }
                None => {
                    st.root_properties.insert(path, value);
                }
            }
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_shared_data",
        |mut c: Caller<'_, VmState>,
         kptr: i32,
         klen: i32,
         ptr_ptr: i32,
         size_ptr: i32,
         cas_ptr: i32|
         -> HostResult {
            let key = read_or_status!(&mut c, kptr, klen);
            // Copied on every read, as in Envoy.
            let entry = lock(&c.data().shared().data).get(&key).cloned();
            let Some((value, cas)) = entry else {
                return status(Status::NotFound);
            };
            if guest_write(&mut c, cas_ptr as u32, &cas.to_le_bytes()).is_err() {
                return status(Status::InvalidMemoryAccess);
            }
            return_bytes(&mut c, &value, ptr_ptr, size_ptr)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_set_shared_data",
        |mut c: Caller<'_, VmState>,
         kptr: i32,
         klen: i32,
         vptr: i32,
         vlen: i32,
         cas: i32|
         -> HostResult {
            let key = read_or_status!(&mut c, kptr, klen);
            let value = read_or_status!(&mut c, vptr, vlen);
            let shared = c.data().shared();
            let mut data = lock(&shared.data);
            if cas != 0
                && let Some((_, current)) = data.get(&key)
                && *current != cas as u32
            {
                return status(Status::CasMismatch);
            }
            let next = shared.next_cas.fetch_add(1, Ordering::Relaxed) as u32;
            let next = if next == 0 {
                shared.next_cas.fetch_add(1, Ordering::Relaxed) as u32
            } else {
                next
            };
            data.insert(key, (value, next));
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_register_shared_queue",
        |mut c: Caller<'_, VmState>, nptr: i32, nlen: i32, id_ptr: i32| -> HostResult {
            let name = String::from_utf8_lossy(&read_or_status!(&mut c, nptr, nlen)).into_owned();
            let (vm_id, worker, ctx) = {
                let st = c.data();
                (st.options.vm_id.clone(), st.worker, st.effective)
            };
            let id = {
                let mut queues = lock(&c.data().shared().queues);
                match queues
                    .iter()
                    .position(|q| q.vm_id == vm_id && q.name == name)
                {
                    Some(i) => {
                        queues[i].owner_worker = worker;
                        queues[i].owner_context = ctx;
                        i + 1
                    }
                    None => {
                        queues.push(SharedQueue {
                            vm_id,
                            name,
                            owner_worker: worker,
                            owner_context: ctx,
                            ..Default::default()
                        });
                        queues.len()
                    }
                }
            };
            match guest_write(&mut c, id_ptr as u32, &(id as u32).to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_resolve_shared_queue",
        |mut c: Caller<'_, VmState>,
         vptr: i32,
         vlen: i32,
         nptr: i32,
         nlen: i32,
         id_ptr: i32|
         -> HostResult {
            let vm_id = String::from_utf8_lossy(&read_or_status!(&mut c, vptr, vlen)).into_owned();
            let name = String::from_utf8_lossy(&read_or_status!(&mut c, nptr, nlen)).into_owned();
            let found = lock(&c.data().shared().queues)
                .iter()
                .position(|q| q.vm_id == vm_id && q.name == name);
            match found {
                Some(i) => {
                    match guest_write(&mut c, id_ptr as u32, &(i as u32 + 1).to_le_bytes()) {
                        Ok(()) => ok(),
                        Err(s) => status(s),
                    }
                }
                None => status(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_dequeue_shared_queue",
        |mut c: Caller<'_, VmState>, id: i32, ptr_ptr: i32, size_ptr: i32| -> HostResult {
            let item = {
                let mut queues = lock(&c.data().shared().queues);
                match queues.get_mut((id as u32 as usize).wrapping_sub(1)) {
                    None => return status(Status::NotFound),
                    Some(q) => q.items.pop_front(),
                }
            };
            match item {
                None => status(Status::Empty),
                Some(v) => return_bytes(&mut c, &v, ptr_ptr, size_ptr),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_enqueue_shared_queue",
        |mut c: Caller<'_, VmState>, id: i32, vptr: i32, vlen: i32| -> HostResult {
            let value = read_or_status!(&mut c, vptr, vlen);
            let mut queues = lock(&c.data().shared().queues);
            match queues.get_mut((id as u32 as usize).wrapping_sub(1)) {
                None => status(Status::NotFound),
                Some(q) => {
                    q.items.push_back(value);
                    q.notify = true;
                    ok()
                }
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_continue_stream",
        |mut c: Caller<'_, VmState>, kind: i32| -> HostResult {
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
            let token = st.next_token;
            st.next_token = st.next_token.wrapping_add(1).max(1);
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
    // gRPC is not offered (ngx_wasm_module has none either); Envoy-only filters would get Unimplemented.
    linker.func_wrap(
        ENV,
        "proxy_grpc_call",
        |_: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> i32 { Status::Unimplemented.code() },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_grpc_stream",
        |_: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32, _: i32| -> i32 {
            Status::Unimplemented.code()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_grpc_send",
        |_: i32, _: i32, _: i32, _: i32| -> i32 { Status::Unimplemented.code() },
    )?;
    linker.func_wrap(ENV, "proxy_grpc_cancel", |_: i32| -> i32 {
        Status::Unimplemented.code()
    })?;
    linker.func_wrap(ENV, "proxy_grpc_close", |_: i32| -> i32 {
        Status::Unimplemented.code()
    })?;
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
    linker.func_wrap(
        ENV,
        "proxy_set_effective_context",
        |mut c: Caller<'_, VmState>, ctx: i32| -> HostResult {
            let st = c.data_mut();
            let ctx = ctx as u32;
            if ctx == ROOT_CONTEXT || st.streams.contains_key(&ctx) {
                st.effective = ctx;
                ok()
            } else {
                status(Status::BadArgument)
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_call_foreign_function",
        |mut c: Caller<'_, VmState>,
         nptr: i32,
         nlen: i32,
         _: i32,
         _: i32,
         _: i32,
         _: i32|
         -> HostResult {
            let name = read_or_status!(&mut c, nptr, nlen);
            // Envoy registers `clear_route_cache` (re-run route selection after a header changed);
            // nginx has no foreign functions.
            if name == b"clear_route_cache" && c.data().options.mode == HostMode::Envoy {
                if let Some(s) = c.data_mut().stream_mut() {
                    s.route_cache_cleared = true;
                }
                return ok();
            }
            status(Status::NotFound)
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_done",
        |mut c: Caller<'_, VmState>| -> HostResult {
            c.data_mut().done_called = true;
            ok()
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_define_metric",
        |mut c: Caller<'_, VmState>, kind: i32, nptr: i32, nlen: i32, id_ptr: i32| -> HostResult {
            let name = String::from_utf8_lossy(&read_or_status!(&mut c, nptr, nlen)).into_owned();
            let Some(kind) = MetricType::from_raw(kind) else {
                return status(Status::BadArgument);
            };
            let id = {
                let mut metrics = lock(&c.data().shared().metrics);
                match metrics.iter().position(|m| m.name == name) {
                    Some(i) if metrics[i].kind == kind => i,
                    Some(_) => return status(Status::BadArgument),
                    None => {
                        metrics.push(Metric {
                            name,
                            kind,
                            value: 0,
                            samples: Vec::new(),
                        });
                        metrics.len() - 1
                    }
                }
            };
            match guest_write(&mut c, id_ptr as u32, &(id as u32 + 1).to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_get_metric",
        |mut c: Caller<'_, VmState>, id: i32, out: i32| -> HostResult {
            let value = {
                let metrics = lock(&c.data().shared().metrics);
                match metrics.get((id as u32 as usize).wrapping_sub(1)) {
                    None => return status(Status::NotFound),
                    Some(m) if m.kind == MetricType::Histogram => {
                        return status(Status::BadArgument);
                    }
                    Some(m) => m.value as u64,
                }
            };
            match guest_write(&mut c, out as u32, &value.to_le_bytes()) {
                Ok(()) => ok(),
                Err(s) => status(s),
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_record_metric",
        |c: Caller<'_, VmState>, id: i32, value: i64| -> HostResult {
            let mut metrics = lock(&c.data().shared().metrics);
            match metrics.get_mut((id as u32 as usize).wrapping_sub(1)) {
                None => status(Status::NotFound),
                Some(m) => {
                    match m.kind {
                        MetricType::Counter => m.value = m.value.wrapping_add(value),
                        MetricType::Gauge => m.value = value,
                        MetricType::Histogram => {
                            if m.samples.len() < 1_000_000 {
                                m.samples.push(value as u64)
                            }
                        }
                    }
                    ok()
                }
            }
        },
    )?;
    linker.func_wrap(
        ENV,
        "proxy_increment_metric",
        |c: Caller<'_, VmState>, id: i32, offset: i64| -> HostResult {
            let mut metrics = lock(&c.data().shared().metrics);
            match metrics.get_mut((id as u32 as usize).wrapping_sub(1)) {
                None => status(Status::NotFound),
                Some(m) => match m.kind {
                    MetricType::Counter if offset < 0 => status(Status::BadArgument),
                    MetricType::Counter | MetricType::Gauge => {
                        m.value = m.value.wrapping_add(offset);
                        ok()
                    }
                    MetricType::Histogram => status(Status::BadArgument),
                },
            }
        },
    )?;
    Ok(())
}

/// `host:port` or `[v6]:port`: what ngx_wasm_module accepts as a callout target.
fn is_address(s: &str) -> bool {
    match s.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok(),
        None => false,
    }
}

/// Properties a proxy answers by itself (a small subset of Envoy's attributes).
fn builtin_property(st: &VmState, path: &[String]) -> Option<Vec<u8>> {
    let p: Vec<&str> = path.iter().map(String::as_str).collect();
    match p.as_slice() {
        ["plugin_name"] => Some(st.options.plugin_name.clone().into_bytes()),
        ["plugin_vm_id"] => Some(st.options.vm_id.clone().into_bytes()),
        ["plugin_root_id"] => Some(Vec::new()),
        ["request", "path"] | ["request", "method"] => {
            let s = st.streams.get(&st.effective)?;
            let name = if p[1] == "path" { ":path" } else { ":method" };
            header_value(&s.request_headers, name).map(|v| v.as_bytes().to_vec())
        }
        _ => None,
    }
}

/// Lets the request go upstream: snapshot of the headers, and the body buffered so far.
fn release_request(s: &mut StreamState) {
    if !s.released {
        s.released = true;
        s.upstream_headers = Some(s.request_headers.clone());
    }
    let buffered = std::mem::take(&mut s.request_buffer);
    s.upstream_body.extend_from_slice(&buffered);
}

/// Lets the response body buffered so far go downstream.
fn release_response(s: &mut StreamState) {
    let buffered = std::mem::take(&mut s.response_buffer);
    s.downstream_body.extend_from_slice(&buffered);
}

type F1 = TypedFunc<i32, ()>;
type F1r = TypedFunc<i32, i32>;
type F2 = TypedFunc<(i32, i32), ()>;
type F2r = TypedFunc<(i32, i32), i32>;
type F3r = TypedFunc<(i32, i32, i32), i32>;
type F5 = TypedFunc<(i32, i32, i32, i32, i32), ()>;

/// The filter's exports the host calls (all optional: a missing one is a no-op, as in Envoy).
struct Exports {
    initialize: Option<TypedFunc<(), ()>>,
    on_context_create: Option<F2>,
    on_vm_start: Option<F2r>,
    on_configure: Option<F2r>,
    on_tick: Option<F1>,
    on_queue_ready: Option<F2>,
    on_done: Option<F1r>,
    on_log: Option<F1>,
    on_delete: Option<F1>,
    on_request_headers: Option<F3r>,
    on_request_body: Option<F3r>,
    on_request_trailers: Option<F2r>,
    on_response_headers: Option<F3r>,
    on_response_body: Option<F3r>,
    on_response_trailers: Option<F2r>,
    on_http_call_response: Option<F5>,
}

impl Exports {
    fn find(instance: &Instance, store: &mut Store<VmState>) -> Exports {
        macro_rules! f {
            ($name:expr) => {
                instance.get_typed_func(&mut *store, $name).ok()
            };
        }
        Exports {
            initialize: f!("_initialize"),
            on_context_create: f!("proxy_on_context_create"),
            on_vm_start: f!("proxy_on_vm_start"),
            on_configure: f!("proxy_on_configure"),
            on_tick: f!("proxy_on_tick"),
            on_queue_ready: f!("proxy_on_queue_ready"),
            on_done: f!("proxy_on_done"),
            on_log: f!("proxy_on_log"),
            on_delete: f!("proxy_on_delete"),
            on_request_headers: f!("proxy_on_request_headers"),
            on_request_body: f!("proxy_on_request_body"),
            on_request_trailers: f!("proxy_on_request_trailers"),
            on_response_headers: f!("proxy_on_response_headers"),
            on_response_body: f!("proxy_on_response_body"),
            on_response_trailers: f!("proxy_on_response_trailers"),
            on_http_call_response: f!("proxy_on_http_call_response"),
        }
    }
}

fn trap_error(
    worker: usize,
    callback: &'static str,
    context: u32,
    err: &wasmtime::Error,
    panic: Option<String>,
) -> HostError {
    HostError::Trap {
        worker,
        callback,
        context,
        trap: format!("{err:#}"),
        panic,
    }
}

/// One worker: a VM with its root context, like one Envoy worker thread's copy of the plugin.
pub struct Worker {
    store: Store<VmState>,
    exports: Exports,
    index: usize,
    metered: bool,
    dead: bool,
    next_context: u32,
    plugin_config_len: usize,
    vm_config_len: usize,
}

impl Worker {
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether an earlier trap killed this VM.
    pub fn is_dead(&self) -> bool {
        self.dead
    }

    /// The tick period the filter asked for (0: no ticks).
    pub fn tick_period_ms(&self) -> u32 {
        self.store.data().tick_period_ms
    }

    /// Runs one guest callback with `context` as the effective context, turning a trap into a
    /// [`HostError::Trap`] that carries the panic message when the SDK logged one.
    fn call<R>(
        &mut self,
        callback: &'static str,
        context: u32,
        f: impl FnOnce(&mut Store<VmState>) -> wasmtime::Result<R>,
    ) -> Result<R, HostError> {
        if self.dead {
            return Err(HostError::Dead { worker: self.index });
        }
        self.store.data_mut().effective = context;
        self.store.data_mut().last_critical = None;
        if self.metered {
            let _ = self.store.set_fuel(FUEL_PER_CALLBACK);
        }
        match f(&mut self.store) {
            Ok(r) => Ok(r),
            Err(e) => {
                self.dead = true;
                let panic = self.store.data_mut().last_critical.take();
                Err(trap_error(self.index, callback, context, &e, panic))
            }
        }
    }

    /// `proxy_on_tick` on the root context.
    pub fn tick(&mut self) -> Result<(), HostError> {
        if let Some(f) = self.exports.on_tick.clone() {
            self.call("proxy_on_tick", ROOT_CONTEXT, |s| {
                f.call(s, ROOT_CONTEXT as i32)
            })?;
        }
        Ok(())
    }

    /// Callouts dispatched and not yet answered; the harness answers them with
    /// [`Worker::answer_callout`].
    pub fn take_callouts(&mut self) -> Vec<Callout> {
        std::mem::take(&mut self.store.data_mut().callouts)
    }

    /// Delivers a callout's outcome through `proxy_on_http_call_response`.
    pub fn answer_callout(
        &mut self,
        call: &Callout,
        outcome: CallOutcome,
    ) -> Result<(), HostError> {
        let (view, nh, nb, nt) = match outcome {
            CallOutcome::Response {
                headers,
                body,
                trailers,
            } => {
                let (nh, nb, nt) = (headers.len(), body.len(), trailers.len());
                self.store.data_mut().status = (200, Vec::new());
                (
                    CallResponseView {
                        headers: Some(headers),
                        body: Some(body),
                        trailers: Some(trailers),
                    },
                    nh,
                    nb,
                    nt,
                )
            }
            CallOutcome::Reset => {
                self.store.data_mut().status = (Status::BrokenConnection as u32, b"reset".to_vec());
                (
                    CallResponseView {
                        headers: None,
                        body: None,
                        trailers: None,
                    },
                    0,
                    0,
                    0,
                )
            }
        };
        let Some(f) = self.exports.on_http_call_response.clone() else {
            return Ok(());
        };
        self.store.data_mut().call_response = Some(view);
        let ctx = call.context;
        let token = call.token;
        let r = self.call("proxy_on_http_call_response", ctx, |s| {
            f.call(
                s,
                (ctx as i32, token as i32, nh as i32, nb as i32, nt as i32),
            )
        });
        self.store.data_mut().call_response = None;
        r
    }

    /// Delivers `proxy_on_queue_ready` for queues this worker registered that got items.
    pub fn deliver_queue_ready(&mut self) -> Result<usize, HostError> {
        let ready: Vec<(u32, u32)> = {
            let st = self.store.data();
            let mut queues = lock(&st.shared().queues);
            queues
                .iter_mut()
                .enumerate()
                .filter(|(_, q)| q.notify && q.owner_worker == self.index)
                .map(|(i, q)| {
                    q.notify = false;
                    (q.owner_context, i as u32 + 1)
                })
                .collect()
        };
        let Some(f) = self.exports.on_queue_ready.clone() else {
            return Ok(0);
        };
        for (ctx, id) in &ready {
            let (ctx, id) = (*ctx, *id);
            self.call("proxy_on_queue_ready", ctx, |s| {
                f.call(s, (ctx as i32, id as i32))
            })?;
        }
        Ok(ready.len())
    }

    /// Creates an HTTP stream context (`proxy_on_context_create(stream, root)`).
    pub fn new_stream(&mut self) -> Result<u32, HostError> {
        let id = self.next_context;
        self.next_context += 1;
        self.store.data_mut().streams.insert(
            id,
            StreamState {
                id,
                ..Default::default()
            },
        );
        if let Some(f) = self.exports.on_context_create.clone() {
            self.call("proxy_on_context_create", id, |s| {
                f.call(s, (id as i32, ROOT_CONTEXT as i32))
            })?;
        }
        Ok(id)
    }

    fn stream_mut(&mut self, id: u32) -> Result<&mut StreamState, HostError> {
        self.store
            .data_mut()
            .streams
            .get_mut(&id)
            .ok_or_else(|| HostError::Usage(format!("no stream {id}")))
    }

    pub fn stream(&self, id: u32) -> Option<&StreamState> {
        self.store.data().streams.get(&id)
    }

    fn record(&mut self, id: u32, callback: &'static str, action: Action) {
        if let Some(s) = self.store.data_mut().streams.get_mut(&id) {
            s.callbacks.push(CallbackRecord { callback, action });
        }
    }

    /// Runs one HTTP stream callback the way Envoy does, so the six `proxy_on_request_*` /
    /// `proxy_on_response_*` methods differ only in how they stage the stream and which export they
    /// name: the answer becomes an [`Action`] (a filter without the export gets Continue, as in
    /// Envoy), every answer is recorded on the stream, and on Continue `on_continue` lets the
    /// buffered bytes through (`None` for callbacks that buffer nothing).
    fn stream_callback<P: WasmParams>(
        &mut self,
        id: u32,
        callback: &'static str,
        func: Option<TypedFunc<P, i32>>,
        params: P,
        on_continue: Option<fn(&mut StreamState)>,
    ) -> Result<Action, HostError> {
        let action = match func {
            Some(f) => Action::from_raw(self.call(callback, id, |s| f.call(s, params))?),
            None => Action::Continue,
        };
        self.record(id, callback, action);
        if let (Action::Continue, Some(release)) = (action, on_continue) {
            release(self.stream_mut(id)?);
        }
        Ok(action)
    }

    /// Request headers arrive (`proxy_on_request_headers`). Returns what the filter answered.
    pub fn request_headers(
        &mut self,
        id: u32,
        headers: Pairs,
        end_of_stream: bool,
    ) -> Result<Action, HostError> {
        let n = headers.len();
        {
            let s = self.stream_mut(id)?;
            s.request_headers = headers
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect();
            s.request_done = end_of_stream;
        }
        let f = self.exports.on_request_headers.clone();
        self.stream_callback(
            id,
            "proxy_on_request_headers",
            f,
            (id as i32, n as i32, end_of_stream as i32),
            Some(release_request),
        )
    }

    /// A request body chunk arrives. Envoy calls `proxy_on_request_body` per chunk, with the size of
    /// everything buffered so far while the filter keeps answering StopIterationAndBuffer; in nginx mode
    /// the body is collected and delivered once, whole, with end of stream (then `None` is returned for
    /// the chunks that caused no callback).
    pub fn request_body(
        &mut self,
        id: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<Option<Action>, HostError> {
        let nginx = self.store.data().options.mode == HostMode::Nginx;
        let size = {
            let s = self.stream_mut(id)?;
            s.request_buffer.extend_from_slice(chunk);
            s.request_done = end_of_stream;
            s.request_buffer.len()
        };
        if nginx && !end_of_stream {
            return Ok(None);
        }
        let f = self.exports.on_request_body.clone();
        self.stream_callback(
            id,
            "proxy_on_request_body",
            f,
            (id as i32, size as i32, end_of_stream as i32),
            Some(release_request),
        )
        .map(Some)
    }

    /// Request trailers arrive (the end of the request).
    pub fn request_trailers(&mut self, id: u32, trailers: Pairs) -> Result<Action, HostError> {
        let n = trailers.len();
        {
            let s = self.stream_mut(id)?;
            s.request_trailers = Some(trailers);
            s.request_done = true;
        }
        let f = self.exports.on_request_trailers.clone();
        self.stream_callback(
            id,
            "proxy_on_request_trailers",
            f,
            (id as i32, n as i32),
            Some(release_request),
        )
    }

    /// Response headers arrive from the upstream.
    pub fn response_headers(
        &mut self,
        id: u32,
        headers: Pairs,
        end_of_stream: bool,
    ) -> Result<Action, HostError> {
        let n = headers.len();
        self.stream_mut(id)?.response_headers = Some(
            headers
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect(),
        );
        let f = self.exports.on_response_headers.clone();
        self.stream_callback(
            id,
            "proxy_on_response_headers",
            f,
            (id as i32, n as i32, end_of_stream as i32),
            None,
        )
    }

    /// A response body chunk arrives; on Continue the buffered bytes go downstream.
    pub fn response_body(
        &mut self,
        id: u32,
        chunk: &[u8],
        end_of_stream: bool,
    ) -> Result<Action, HostError> {
        let size = {
            let s = self.stream_mut(id)?;
            s.response_buffer.extend_from_slice(chunk);
            s.response_buffer.len()
        };
        let f = self.exports.on_response_body.clone();
        self.stream_callback(
            id,
            "proxy_on_response_body",
            f,
            (id as i32, size as i32, end_of_stream as i32),
            Some(release_response),
        )
    }

    /// Response trailers arrive (the end of the response).
    pub fn response_trailers(&mut self, id: u32, trailers: Pairs) -> Result<Action, HostError> {
        let n = trailers.len();
        self.stream_mut(id)?.response_trailers = Some(trailers);
        let f = self.exports.on_response_trailers.clone();
        self.stream_callback(
            id,
            "proxy_on_response_trailers",
            f,
            (id as i32, n as i32),
            None,
        )
    }

    /// Ends a stream as Envoy does: `proxy_on_done`, `proxy_on_log`, `proxy_on_delete`. Returns the
    /// stream's final record.
    pub fn end_stream(&mut self, id: u32) -> Result<StreamState, HostError> {
        if !self.store.data().streams.contains_key(&id) {
            return Err(HostError::Usage(format!("no stream {id}")));
        }
        if let Some(f) = self.exports.on_done.clone() {
            self.call("proxy_on_done", id, |s| f.call(s, id as i32))?;
        }
        if let Some(f) = self.exports.on_log.clone() {
            self.call("proxy_on_log", id, |s| f.call(s, id as i32))?;
        }
        if let Some(f) = self.exports.on_delete.clone() {
            self.call("proxy_on_delete", id, |s| f.call(s, id as i32))?;
        }
        let st = self.store.data_mut();
        st.effective = ROOT_CONTEXT;
        st.streams
            .remove(&id)
            .ok_or_else(|| HostError::Usage(format!("stream {id} vanished")))
    }

    /// Log lines kept so far (the first 20,000).
    pub fn logs(&self) -> &[LogLine] {
        &self.store.data().logs
    }

    /// Number of log lines at each level (trace..critical), including those not kept.
    pub fn log_counts(&self) -> [u64; 6] {
        self.store.data().log_counts
    }

    /// ABI misuse the host noticed (bad pointers, unknown enum values, continue on the root context).
    pub fn notes(&self) -> &[String] {
        &self.store.data().notes
    }

    /// Whether the root context called `proxy_done`.
    pub fn done_called(&self) -> bool {
        self.store.data().done_called
    }

    /// A property the filter set on its root context, as bytes.
    pub fn root_property(&self, path: &[&str]) -> Option<&[u8]> {
        let key: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        self.store
            .data()
            .root_properties
            .get(&key)
            .map(Vec::as_slice)
    }

    /// Shuts the VM down like a proxy draining: `proxy_on_done` then `proxy_on_delete` on the root.
    pub fn shutdown(mut self) -> Result<bool, HostError> {
        let mut done = true;
        if let Some(f) = self.exports.on_done.clone() {
            done = self.call("proxy_on_done", ROOT_CONTEXT, |s| {
                f.call(s, ROOT_CONTEXT as i32)
            })? != 0;
        }
        if let Some(f) = self.exports.on_delete.clone() {
            self.call("proxy_on_delete", ROOT_CONTEXT, |s| {
                f.call(s, ROOT_CONTEXT as i32)
            })?;
        }
        Ok(done)
    }
}
