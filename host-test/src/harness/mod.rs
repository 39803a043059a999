//! The local harness: the compiled filter in a [`Proxy`] with several workers, in front of simulated
//! replicas (`kvsteer_sim::Engine`) in virtual time.
//!
//! One event loop drives everything in time order ([`Harness::run_until`]): engine steps (their
//! first-token, token and finish events become response headers and SSE body chunks pushed through the
//! worker that carried the request), worker ticks (`proxy_on_tick` every period the filter asked for),
//! callout answers (a feed callout's `:path` is parsed as a `FeedQuery` and answered with
//! `engine.feed(&q).encode()` at the virtual time it arrives, after `callout_latency_us`), decode-load
//! samples every 0.5 s, and, when a workload runs, the driver's requests.
//!
//! A request goes through a worker (round robin) as a client's would: headers, then the body in
//! `body_chunk_bytes` chunks; once the filter releases it, the replica is read from what it wrote
//! (destination header, cluster header or nginx variable). A request the filter released without a
//! usable destination is sent where the proxy's own load balancer would send it (round robin over the
//! replicas; counted as `fallback`), as Envoy's override_host policy does.

mod callouts;
mod config;
mod event_loop;
mod record;
mod replica;

pub use config::{HARNESS_PEER_TOKEN, HarnessConfig, Output, ProxySpread, peer_cluster};
pub use record::{HarnessStats, RequestRecord, RequestSpec};
pub use replica::{FeedFault, Replica, ResponseFault, flood_hash};

use crate::abi::Action;
use crate::host::{
    CallOutcome, FilterModule, HostError, HostMode, Proxy, ProxyOptions, StreamState, WorkerVm,
};
use crate::openai::{SseWriter, completion_body, error_response, request_headers, sse_headers};
use callouts::PendingCall;
use kvsteer_sim::{Engine, EngineEvent, EngineRequest, FinishReason};
use kvsteer_workload::{Driver, Recorder, Summary};
use replica::{DIRECT_ID_BASE, EndpointDp};
use serde_json::Value;
use std::collections::HashMap;
use std::fmt;

/// Why a harness run stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HarnessError {
    /// The filter trapped, refused its configuration, or the host was misused.
    Host(HostError),
    /// The filter paused a request and never released it (a hang a proxy would time out on).
    Stuck {
        request: u64,
        detail: String,
    },
    /// The filter paused a response chunk (it must pass SSE through for time to first token).
    ResponsePaused {
        request: u64,
    },
    Config(String),
}

impl fmt::Display for HarnessError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HarnessError::Host(e) => write!(f, "{e}"),
            HarnessError::Stuck { request, detail } => {
                write!(f, "request {request} was never released: {detail}")
            }
            HarnessError::ResponsePaused { request } => {
                write!(f, "the filter paused the response of request {request}")
            }
            HarnessError::Config(m) => write!(f, "harness configuration: {m}"),
        }
    }
}

impl std::error::Error for HarnessError {}

impl From<HostError> for HarnessError {
    fn from(e: HostError) -> Self {
        HarnessError::Host(e)
    }
}

struct Flight {
    worker: usize,
    stream: u32,
    prompt_len: u32,
    output: Vec<u32>,
    unsent: usize,
    sse: SseWriter,
    from_driver: bool,
    headers_sent: bool,
}

/// A request the filter has not released yet.
struct Paused {
    id: u64,
    worker: usize,
    stream: u32,
    spec: RequestSpec,
    from_driver: bool,
}

pub struct Harness {
    cfg: HarnessConfig,
    /// `cfg.proxies` proxies; worker `w` (in `workers`) belongs to proxy `w / cfg.workers`.
    proxies: Vec<Proxy>,
    workers: Vec<WorkerVm>,
    pub replicas: Vec<Replica>,
    /// Per endpoint: its engines' indices in `replicas`, its internal DP balancer and its rank-blind
    /// feed (both used only with DP ranks).
    endpoints: Vec<EndpointDp>,
    now_us: u64,
    next_tick_us: Vec<u64>,
    calls: Vec<PendingCall>,
    flights: HashMap<u64, Flight>,
    paused: Vec<Paused>,
    records: HashMap<u64, RequestRecord>,
    next_id: u64,
    next_direct: u64,
    /// Per proxy: the next worker (round robin within the proxy).
    rr_worker: Vec<usize>,
    /// Draws the proxy of each request (seeded, so runs repeat).
    proxy_rng: u64,
    rr_fallback: usize,
    /// Per proxy: the next worker a peer poll goes to (round robin, apart from the requests').
    rr_peer: Vec<usize>,
    /// Per proxy: how peer polls to it are answered instead of through it ([`Harness::set_peer_fault`]).
    peer_faults: Vec<Option<CallOutcome>>,
    next_sample_us: u64,
    events: Vec<EngineEvent>,
    driver: Option<Driver>,
    pub recorder: Recorder,
    pub stats: HarnessStats,
}

impl Harness {
    /// Starts the proxies (one VM per worker, each configured) in front of fresh replicas.
    pub fn new(module: &FilterModule, cfg: HarnessConfig) -> Result<Harness, HarnessError> {
        if cfg.workers == 0 || cfg.replicas == 0 || cfg.proxies == 0 {
            return Err(HarnessError::Config(
                "workers, proxies and replicas must be at least 1".into(),
            ));
        }
        let specs = cfg.replica_specs();
        let mut options = ProxyOptions::new(cfg.mode, cfg.plugin_config().to_string());
        options.clock_ns_per_fuel = cfg.clock_ns_per_fuel;
        options.nginx = cfg.nginx;
        if cfg.mode == HostMode::Envoy {
            options.clusters = Some(
                specs
                    .iter()
                    .flat_map(|(_, _, feed, cluster)| [feed.clone(), cluster.clone()])
                    .chain((0..cfg.proxies).map(peer_cluster))
                    .collect(),
            );
        }
        let mut proxies = Vec::new();
        let mut workers = Vec::new();
        for p in 0..cfg.proxies {
            let mut o = options.clone();
            o.plugin_config = cfg.proxy_plugin_config(p).to_string().into_bytes();
            // Each proxy's VMs draw their own random bytes, as separate processes would.
            o.seed = options.seed ^ (p as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
            // With several proxies each has its own node id, as separate Envoys would (Istio names
            // every pod's), so their tie-breaks differ; a lone proxy has none and keeps `routing.seed`
            // exactly, so 1-proxy runs route as they did before node ids existed.
            if cfg.proxies > 1 {
                o.node_id = Some(format!("proxy-{p}"));
            }
            let proxy = Proxy::new(module, o);
            for _ in 0..cfg.workers {
                workers.push(proxy.start_worker()?);
            }
            proxies.push(proxy);
        }
        let (replicas, endpoints) = replica::fleet(&cfg, specs);
        let next_tick_us = workers
            .iter()
            .map(|w| w.tick_period_ms() as u64 * 1000)
            .collect();
        let proxy_count = cfg.proxies;
        let mut h = Harness {
            cfg,
            proxies,
            workers,
            replicas,
            endpoints,
            now_us: 0,
            next_tick_us,
            calls: Vec::new(),
            flights: HashMap::new(),
            paused: Vec::new(),
            records: HashMap::new(),
            next_id: 0,
            next_direct: DIRECT_ID_BASE,
            rr_worker: vec![0; proxy_count],
            proxy_rng: 0x9E37_79B9_7F4A_7C15,
            rr_fallback: 0,
            rr_peer: vec![0; proxy_count],
            peer_faults: vec![None; proxy_count],
            next_sample_us: 0,
            events: Vec::new(),
            driver: None,
            recorder: Recorder::new(),
            stats: HarnessStats::default(),
        };
        // Callouts dispatched during configuration (a first poll) are answered like any other.
        h.collect_callouts();
        Ok(h)
    }

    pub fn config(&self) -> &HarnessConfig {
        &self.cfg
    }

    /// The first proxy (the only one unless [`HarnessConfig::proxies`] says otherwise).
    pub fn proxy(&self) -> &Proxy {
        &self.proxies[0]
    }

    /// Every proxy, in order.
    pub fn proxies(&self) -> &[Proxy] {
        &self.proxies
    }

    /// The proxy worker `w` (an index into [`Harness::workers`]) belongs to.
    pub fn proxy_of_worker(&self, w: usize) -> usize {
        w / self.cfg.workers
    }

    pub fn worker(&self, i: usize) -> &WorkerVm {
        &self.workers[i]
    }

    pub fn workers(&self) -> &[WorkerVm] {
        &self.workers
    }

    pub fn now_us(&self) -> u64 {
        self.now_us
    }

    /// The configured `explain_header` as the client got it on a finished stream.
    fn explained(&self, st: &crate::host::StreamState) -> Option<String> {
        let name = self.cfg.filter_extra.get("explain_header")?.as_str()?;
        st.response_headers
            .as_ref()?
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name.as_bytes()))
            .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
    }

    pub fn record(&self, id: u64) -> Option<&RequestRecord> {
        self.records.get(&id)
    }

    pub fn records(&self) -> impl Iterator<Item = &RequestRecord> {
        self.records.values()
    }

    /// Requests sent through the filter and not finished.
    pub fn in_flight(&self) -> usize {
        self.flights.len() + self.paused.len()
    }

    /// Sends a request through the filter at the current virtual time. Returns its id.
    pub fn send(&mut self, spec: &RequestSpec) -> Result<u64, HarnessError> {
        let id = self.next_id;
        self.next_id += 1;
        self.send_with_id(id, spec, false)?;
        Ok(id)
    }

    fn send_with_id(
        &mut self,
        id: u64,
        spec: &RequestSpec,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        self.set_now(self.now_us);
        let w = match spec.worker {
            Some(w) if w < self.workers.len() => w,
            Some(w) => return Err(HarnessError::Config(format!("no worker {w}"))),
            None => {
                let p = self.pick_proxy(spec.session.as_deref());
                let w = p * self.cfg.workers + self.rr_worker[p] % self.cfg.workers;
                self.rr_worker[p] += 1;
                w
            }
        };
        self.stats.requests += 1;
        let body = match &spec.raw_body {
            Some(b) => b.clone(),
            None => completion_body(&spec.prompt, spec.max_tokens),
        };
        let path = spec.path.as_deref().unwrap_or("/v1/completions");
        let session = spec
            .session
            .as_deref()
            .map(|s| (self.cfg.session_header.as_str(), s));
        let headers = request_headers(path, body.len(), session, &spec.headers);
        let session_label = spec
            .session
            .clone()
            .unwrap_or_else(|| format!("request-{id}"));
        if !from_driver {
            self.recorder
                .issued(id, &session_label, self.now_us, spec.prompt.len() as u64);
        }
        self.records.insert(
            id,
            RequestRecord {
                id,
                worker: w,
                issued_us: self.now_us,
                ..Default::default()
            },
        );
        let started = std::time::Instant::now();
        let worker = &mut self.workers[w];
        let stream = worker.new_stream()?;
        let trailers = spec.trailers.as_ref();
        worker.request_headers(stream, headers, body.is_empty() && trailers.is_none())?;
        if !body.is_empty() {
            let n = self.cfg.body_chunk_bytes.max(1);
            let mut chunks = body.chunks(n).peekable();
            while let Some(c) = chunks.next() {
                let last = chunks.peek().is_none() && trailers.is_none();
                worker.request_body(stream, c, last)?;
                self.stats.request_body_chunks += 1;
            }
        }
        if let Some(t) = trailers {
            let pairs = t
                .iter()
                .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
                .collect();
            worker.request_trailers(stream, pairs)?;
        }
        self.stats.request_filter_ns += started.elapsed().as_nanos() as u64;
        self.after_request_phase(id, w, stream, spec, from_driver)
    }

    /// The proxy a request without a chosen worker goes through ([`ProxySpread`]).
    fn pick_proxy(&mut self, session: Option<&str>) -> usize {
        let n = self.cfg.proxies;
        if n == 1 {
            return 0;
        }
        if let (ProxySpread::PerSession, Some(s)) = (self.cfg.proxy_spread, session) {
            // FNV-1a of the session id, finished with a multiply so nearby ids spread.
            let h = s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
            });
            return (h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % n;
        }
        // xorshift64*
        let mut x = self.proxy_rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.proxy_rng = x;
        (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 32) as usize % n
    }

    /// Routes a request whose request phase ran: released → engine; local response → failed; else paused.
    fn after_request_phase(
        &mut self,
        id: u64,
        w: usize,
        stream: u32,
        spec: &RequestSpec,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        let st = self.workers[w]
            .stream(stream)
            .ok_or_else(|| HostError::Usage(format!("stream {stream} vanished")))?
            .clone();
        if let Some(lr) = &st.local_response {
            self.stats.local_responses += 1;
            let rec = self.records.get_mut(&id).expect("record inserted at send");
            rec.local_response = Some(lr.status);
            rec.failed = true;
            self.workers[w].end_stream(stream)?;
            self.fail_request(id, from_driver);
            return Ok(());
        }
        if !st.released {
            // The filter may still release it (proxy_continue_stream after a callout).
            self.paused.push(Paused {
                id,
                worker: w,
                stream,
                spec: spec.clone(),
                from_driver,
            });
            return Ok(());
        }
        let (destination, replica) = self.destination(&st);
        let fallback = replica.is_none();
        let replica = match replica {
            Some(r) => r,
            None => {
                self.stats.fallback += 1;
                // The proxy's own balancing spreads over endpoints (then the endpoint over its ranks).
                let e = self.rr_fallback % self.endpoints.len();
                let r = self.endpoints[e].units.start;
                self.rr_fallback += 1;
                r
            }
        };
        let mut replica = self.engine_for(replica, &st);
        let oracle = self.cfg.oracle.filter(|_| spec.raw_body.is_none());
        if let Some(weights) = oracle
            && let Some(c) = self.oracle_choice(id, spec, weights)
        {
            self.stats.oracle_placed += 1;
            if c != replica {
                self.stats.oracle_moved += 1;
            }
            replica = c;
        }
        // Envoy's retry_on 5xx: a replica failing the request at once sends it to the next listed
        // host (override_host), if that one is not failing too.
        let mut retried_from = None;
        if self.cfg.retry_5xx
            && self.cfg.mode == HostMode::Envoy
            && self.cfg.output == Output::DestinationHeader
            && matches!(self.replicas[replica].response_fault, ResponseFault::Status(c) if c >= 500)
            && let Some(b) = destination
                .as_deref()
                .and_then(|d| d.split(',').nth(1))
                .and_then(|e| self.replica_of_endpoint(e.trim()))
            && self.replicas[b].response_fault == ResponseFault::Healthy
        {
            self.replicas[replica].faulted += 1;
            self.stats.retries += 1;
            retried_from = Some(replica);
            replica = self.engine_for(b, &st);
        }
        if self.cfg.mode == HostMode::Envoy && oracle.is_none() {
            let endpoint = self.replicas[replica].endpoint.clone();
            self.workers[w].set_stream_property(
                stream,
                &["upstream", "address"],
                endpoint.as_bytes(),
            )?;
        }
        {
            let rec = self.records.get_mut(&id).expect("record inserted at send");
            rec.released = true;
            rec.destination = destination;
            rec.replica = Some(replica);
            rec.retried_from = retried_from;
            rec.fallback = fallback;
            rec.upstream_headers = st
                .upstream_headers
                .as_ref()
                .map(|h| {
                    h.iter()
                        .map(|(k, v)| {
                            (
                                String::from_utf8_lossy(k).into_owned(),
                                String::from_utf8_lossy(v).into_owned(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default();
        }
        self.recorder.routed(id, replica);
        if self.replicas[replica].response_fault != ResponseFault::Healthy {
            return self.answer_with_fault(id, w, stream, replica, from_driver);
        }
        let req = EngineRequest {
            id,
            prompt: spec.prompt.clone(),
            max_tokens: spec.max_tokens,
            ignore_eos: true,
            min_tokens: 0,
        };
        let submit = if spec
            .raw_body
            .as_deref()
            .is_some_and(|b| !carries_prompt(b, &spec.prompt))
        {
            // A hand-made body that is not a completions request for the spec's prompt is not a
            // prompt the engine could run: the upstream refuses it.
            Err("the request body is not a completions request".to_string())
        } else {
            self.replicas[replica]
                .engine
                .submit(self.now_us, req)
                .map_err(|e| e.to_string())
        };
        match submit {
            Ok(()) => {
                self.flights.insert(
                    id,
                    Flight {
                        worker: w,
                        stream,
                        prompt_len: spec.prompt.len() as u32,
                        output: Vec::new(),
                        unsent: 0,
                        sse: SseWriter::new(id, self.now_us / 1_000_000, self.cfg.split_every),
                        from_driver,
                        headers_sent: false,
                    },
                );
            }
            Err(message) => {
                self.stats.rejected += 1;
                let (headers, body) = error_response(&message);
                let worker = &mut self.workers[w];
                worker.response_headers(stream, headers, false)?;
                worker.response_body(stream, &body, true)?;
                let st = worker.end_stream(stream)?;
                let rec = self.records.get_mut(&id).expect("record inserted at send");
                rec.rejected = Some(message);
                rec.failed = true;
                rec.downstream_bytes = st.downstream_body.len();
                self.fail_request(id, from_driver);
            }
        }
        Ok(())
    }

    /// The oracle's replica for a request ([`crate::oracle::choose`]): replicas failing requests
    /// ([`ResponseFault`] other than healthy) are down to it. `None` when no replica would take it.
    fn oracle_choice(
        &self,
        id: u64,
        spec: &RequestSpec,
        weights: crate::oracle::Weights,
    ) -> Option<usize> {
        let engines: Vec<&Engine> = self.replicas.iter().map(|r| &r.engine).collect();
        let usable: Vec<bool> = self
            .replicas
            .iter()
            .map(|r| r.response_fault == ResponseFault::Healthy)
            .collect();
        let req = crate::oracle::OracleRequest {
            id,
            prompt: &spec.prompt,
            output_tokens: spec.max_tokens,
        };
        crate::oracle::choose(self.now_us, &engines, &usable, &req, weights).map(|c| c.replica)
    }

    /// Fails a request the way the replica's [`ResponseFault`] says, at once.
    fn answer_with_fault(
        &mut self,
        id: u64,
        w: usize,
        stream: u32,
        replica: usize,
        from_driver: bool,
    ) -> Result<(), HarnessError> {
        self.replicas[replica].faulted += 1;
        let worker = &mut self.workers[w];
        match self.replicas[replica].response_fault {
            ResponseFault::Healthy => unreachable!("only faults are answered here"),
            ResponseFault::Status(code) => {
                let (headers, body) = crate::openai::engine_error_response(code, "engine failed");
                worker.response_headers(stream, headers, false)?;
                worker.response_body(stream, &body, true)?;
            }
            ResponseFault::StreamError => {
                worker.response_headers(stream, sse_headers(), false)?;
                worker.response_body(
                    stream,
                    &crate::openai::sse_error_event("engine failed"),
                    false,
                )?;
                worker.response_body(stream, b"data: [DONE]\n\n", true)?;
            }
        }
        let st = worker.end_stream(stream)?;
        let rec = self.records.get_mut(&id).expect("record inserted at send");
        rec.downstream_bytes = st.downstream_body.len();
        self.fail_request(id, from_driver);
        Ok(())
    }

    fn fail_request(&mut self, id: u64, from_driver: bool) {
        self.stats.failed += 1;
        self.recorder.failed(id, self.now_us);
        if let Some(rec) = self.records.get_mut(&id) {
            rec.failed = true;
            rec.finished_us = Some(self.now_us);
        }
        if from_driver && let Some(d) = self.driver.as_mut() {
            let _ = d.fail(id, self.now_us);
        }
    }

    /// The replica the filter chose, from what it wrote for the configured output mode.
    fn destination(&self, st: &StreamState) -> (Option<String>, Option<usize>) {
        let cfg_str = |key: &str, default: &str| -> String {
            self.cfg
                .filter_extra
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or(default)
                .to_string()
        };
        match self.cfg.output {
            Output::DestinationHeader => {
                let name = cfg_str("destination_header", "x-gateway-destination-endpoint");
                let v = st.upstream_header(&name).map(str::to_string);
                // override_host takes the first entry of a comma-separated list.
                let r = v
                    .as_deref()
                    .and_then(|v| v.split(',').next())
                    .and_then(|e| self.replica_of_endpoint(e.trim()));
                (v, r)
            }
            Output::ClusterHeader => {
                let name = cfg_str("cluster_header", "x-kvsteer-cluster");
                let v = st.upstream_header(&name).map(str::to_string);
                let r = v
                    .as_deref()
                    .and_then(|c| self.replicas.iter().position(|r| r.cluster == c));
                (v, r)
            }
            Output::NginxVariable => {
                let var = cfg_str("nginx_variable", "kvsteer_upstream");
                let v = st.property(&["ngx", &var]).map(str::to_string);
                let r = v.as_deref().and_then(|e| self.replica_of_endpoint(e));
                (v, r)
            }
        }
    }

    /// Requests the filter paused: released since? local response? Still paused is fine until the run
    /// ends; [`Harness::run_until_idle`] reports them as stuck.
    fn check_paused(&mut self) -> Result<(), HarnessError> {
        if self.paused.is_empty() {
            return Ok(());
        }
        let waiting = std::mem::take(&mut self.paused);
        for p in waiting {
            let st = self.workers[p.worker].stream(p.stream);
            let progressed = st.is_some_and(|s| s.released || s.local_response.is_some());
            if progressed {
                self.after_request_phase(p.id, p.worker, p.stream, &p.spec, p.from_driver)?;
            } else {
                self.paused.push(p);
            }
        }
        Ok(())
    }

    fn drain_engine(&mut self, replica: usize) -> Result<(), HarnessError> {
        let now = self.now_us;
        self.replicas[replica].engine.advance(now, &mut self.events);
        self.drain_events()
    }

    fn drain_events(&mut self) -> Result<(), HarnessError> {
        let events = std::mem::take(&mut self.events);
        for ev in &events {
            self.on_engine_event(ev)?;
        }
        let mut events = events;
        events.clear();
        self.events = events;
        Ok(())
    }

    fn flush_tokens(&mut self, id: u64) -> Result<(), HarnessError> {
        let Some(f) = self.flights.get_mut(&id) else {
            return Ok(());
        };
        if f.unsent == 0 {
            return Ok(());
        }
        let start = f.output.len() - f.unsent;
        f.unsent = 0;
        let chunk = f.sse.tokens(&f.output[start..]);
        let (w, stream) = (f.worker, f.stream);
        let action = self.workers[w].response_body(stream, &chunk, false)?;
        self.stats.response_body_chunks += 1;
        if action != Action::Continue {
            return Err(HarnessError::ResponsePaused { request: id });
        }
        Ok(())
    }

    fn on_engine_event(&mut self, ev: &EngineEvent) -> Result<(), HarnessError> {
        let id = ev.id();
        if !self.flights.contains_key(&id) {
            return Ok(()); // a direct submission, or a request already failed
        }
        match ev {
            EngineEvent::FirstToken { t_us, token, .. } => {
                let f = self.flights.get_mut(&id).expect("checked above");
                f.output.push(*token);
                f.unsent += 1;
                let (w, stream) = (f.worker, f.stream);
                if !f.headers_sent {
                    f.headers_sent = true;
                    self.workers[w].response_headers(stream, sse_headers(), false)?;
                }
                if let Some(r) = self.records.get_mut(&id) {
                    r.first_token_us.get_or_insert(*t_us);
                }
                self.recorder.first_token(id, *t_us);
                self.flush_tokens(id)?;
            }
            EngineEvent::Token { token, .. } => {
                let f = self.flights.get_mut(&id).expect("checked above");
                f.output.push(*token);
                f.unsent += 1;
                if f.unsent >= self.cfg.chunk_tokens.max(1) {
                    self.flush_tokens(id)?;
                }
            }
            EngineEvent::Finished {
                t_us,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                ..
            } => {
                let f = self.flights.remove(&id).expect("checked above");
                let (w, stream) = (f.worker, f.stream);
                if *reason == FinishReason::Abort {
                    // The upstream connection dies mid-stream: the proxy ends the stream without eos.
                    let st = self.workers[w].end_stream(stream)?;
                    if let Some(r) = self.records.get_mut(&id) {
                        r.downstream_bytes = st.downstream_body.len();
                    }
                    self.fail_request(id, f.from_driver);
                    return Ok(());
                }
                let mut f = f;
                let start = f.output.len() - f.unsent;
                let chunk = f.sse.finish(
                    &f.output[start..],
                    reason.as_str(),
                    *prompt_tokens,
                    *completion_tokens,
                    *cached_tokens,
                );
                if !f.headers_sent {
                    self.workers[w].response_headers(stream, sse_headers(), false)?;
                }
                let action = self.workers[w].response_body(stream, &chunk, true)?;
                self.stats.response_body_chunks += 1;
                if action != Action::Continue {
                    return Err(HarnessError::ResponsePaused { request: id });
                }
                let st = self.workers[w].end_stream(stream)?;
                let explained = self.explained(&st);
                if let Some(r) = self.records.get_mut(&id) {
                    r.explained = explained;
                    r.finished_us = Some(*t_us);
                    r.prompt_tokens = *prompt_tokens;
                    r.cached_tokens = *cached_tokens;
                    r.completion_tokens = *completion_tokens;
                    r.downstream_bytes = st.downstream_body.len();
                }
                debug_assert_eq!(f.prompt_len, *prompt_tokens);
                self.recorder
                    .finished(id, *t_us, *cached_tokens as u64, *completion_tokens as u64);
                if f.from_driver
                    && let Some(d) = self.driver.as_mut()
                {
                    let _ = d.complete(id, *t_us, &f.output);
                }
            }
        }
        Ok(())
    }

    pub fn summary(&self, label: &str) -> Summary {
        self.recorder.summary(label)
    }
}

/// Whether a hand-made body is a completions request whose `prompt` is exactly `prompt`'s token ids
/// (another spelling of the body the harness would build): the engine runs it as that prompt.
fn carries_prompt(body: &[u8], prompt: &[u32]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    v.get("prompt")
        .and_then(Value::as_array)
        .is_some_and(|ids| {
            ids.len() == prompt.len()
                && ids
                    .iter()
                    .zip(prompt)
                    .all(|(a, &b)| a.as_u64() == Some(u64::from(b)))
        })
}
