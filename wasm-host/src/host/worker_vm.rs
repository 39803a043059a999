//! One worker VM ([`WorkerVm`]): the filter's exports the host calls, the VM's lifecycle as Envoy
//! runs it (start, ticks, streams, callouts, queues, shutdown), and traps turned into
//! [`HostError`]s.

use super::http_call::{CallOutcome, CallResponseView, Callout};
use super::log_time::LogLine;
use super::streams::{CallbackRecord, StreamState, release_request, release_response};
use super::{FUEL_PER_CALLBACK, FilterModule, HostError, HostMode, ROOT_CONTEXT, VmState, lock};
use crate::abi::{Action, Pairs, Status};
use wasmtime::{Extern, Instance, Store, TypedFunc, WasmParams};

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
pub struct WorkerVm {
    store: Store<VmState>,
    exports: Exports,
    index: usize,
    metered: bool,
    dead: bool,
    next_context: u32,
    plugin_config_len: usize,
    vm_config_len: usize,
}

impl WorkerVm {
    /// Instantiates the module on `state` (a fresh worker's host state) and starts it the way Envoy
    /// does: `_initialize`, create the root context, `proxy_on_vm_start`, `proxy_on_configure` with
    /// the plugin configuration.
    pub(super) fn start(module: &FilterModule, state: VmState) -> Result<WorkerVm, HostError> {
        let index = state.worker;
        let plugin_config_len = state.options.plugin_config.len();
        let vm_config_len = state.options.vm_config.len();
        let mut store = Store::new(&module.engine, state);
        if module.metered {
            let _ = store.set_fuel(FUEL_PER_CALLBACK);
        }
        let instance = module
            .linker
            .instantiate(&mut store, &module.module)
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
        let mut worker = WorkerVm {
            store,
            exports,
            index,
            metered: module.metered,
            dead: false,
            next_context: ROOT_CONTEXT + 1,
            plugin_config_len,
            vm_config_len,
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

    pub fn index(&self) -> usize {
        self.index
    }

    /// Size of the VM's linear memory in bytes. WebAssembly memory only grows, so this is the most
    /// the VM ever held at once (its peak), which is what a proxy keeps per worker.
    pub fn memory_bytes(&self) -> usize {
        self.store
            .data()
            .memory
            .map_or(0, |m| m.data_size(&self.store))
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

    /// This worker's callout connections (nginx mode; all zero in Envoy mode).
    pub fn callout_connections(&self) -> super::CalloutConnections {
        self.store.data().connections
    }

    /// Callouts dispatched and not yet answered; the harness answers them with
    /// [`WorkerVm::answer_callout`].
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
        {
            // ngx_wasm_module: a root callout answered while another is still out keeps its
            // connection; the last one answered gives its own back.
            let st = self.store.data_mut();
            if st.options.mode == HostMode::Nginx {
                let root = st.root_out.remove(&call.token);
                if !root || st.root_out.is_empty() {
                    st.connections.open = st.connections.open.saturating_sub(1);
                    st.connections.closed += 1;
                }
            }
        }
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

    /// Sets a property the proxy answers for this stream (e.g. Envoy's `["upstream", "address"]`
    /// once it has picked the upstream host).
    pub fn set_stream_property(
        &mut self,
        id: u32,
        path: &[&str],
        value: &[u8],
    ) -> Result<(), HostError> {
        let key = path.iter().map(|p| p.to_string()).collect();
        self.stream_mut(id)?.properties.insert(key, value.to_vec());
        Ok(())
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
        if self.store.data().options.mode == HostMode::Nginx {
            return self.nginx_request_headers(id, n, end_of_stream, f);
        }
        self.stream_callback(
            id,
            "proxy_on_request_headers",
            f,
            (id as i32, n as i32, end_of_stream as i32),
            Some(release_request),
        )
    }

    /// ngx_wasm_module's request headers: the callback runs in nginx's rewrite phase, always
    /// without end of stream. A pause parks the request there until the filter itself resumes it
    /// (nothing else will: the module reads the body only in the content phase, after the rewrite
    /// phase). On Continue a request without a body goes upstream now; one with a body waits for
    /// the body callback.
    fn nginx_request_headers(
        &mut self,
        id: u32,
        n: usize,
        end_of_stream: bool,
        f: Option<F3r>,
    ) -> Result<Action, HostError> {
        let on_continue: Option<fn(&mut StreamState)> = if end_of_stream {
            Some(release_request)
        } else {
            None
        };
        let action = self.stream_callback(
            id,
            "proxy_on_request_headers",
            f,
            (id as i32, n as i32, 0),
            on_continue,
        )?;
        let s = self.stream_mut(id)?;
        if action != Action::Continue && s.local_response.is_none() && !s.released {
            s.parked = true;
        }
        Ok(action)
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
        if nginx && (!end_of_stream || self.stream_mut(id)?.parked) {
            // A request parked in the rewrite phase never gets to read its body.
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
