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
//!
//! By job: `config.rs` (what a harness is built from), `record.rs` (what goes in and comes out per
//! request), `replica.rs` (the simulated replicas, their faults and DP ranks), `request.rs` (a
//! request's phases up to the upstream), `destination.rs` (where a released request goes, per proxy
//! mode), `response.rs` (engine events as the response phase), `callouts.rs` (feed and peer
//! callouts) and `event_loop.rs` (the virtual clock); this file holds the state they share, its
//! construction and the read-only view of it.

mod callouts;
mod config;
mod destination;
mod discovery;
mod event_loop;
mod record;
mod replica;
mod request;
mod response;

pub use config::{
    HARNESS_PEER_TOKEN, HarnessConfig, IssueHeaders, IssueModel, Output, ProxySpread, peer_cluster,
};
pub use discovery::{DISCOVERY_CLUSTER, MEMBER_FEEDS_CLUSTER};
pub use record::{HarnessStats, ProxyAnswer, RequestRecord, RequestSpec};
pub use replica::{FeedFault, Replica, ResponseFault, flood_hash};

use crate::host::{CallOutcome, FilterModule, HostError, HostMode, Proxy, ProxyOptions, WorkerVm};
use callouts::PendingCall;
use kvsteer_sim::EngineEvent;
use kvsteer_workload::{Driver, Recorder, Summary};
use replica::{DIRECT_ID_BASE, EndpointDp};
use request::Paused;
use response::Flight;
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
    /// How the discovery source answers (`discovery`; `None`: 503).
    discovery_answer: Option<CallOutcome>,
    discovery_polls: u64,
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
        let (proxies, workers) = start_proxies(module, &cfg, &specs)?;
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
            discovery_answer: None,
            discovery_polls: 0,
            next_sample_us: 0,
            events: Vec::new(),
            driver: None,
            recorder: Recorder::new(),
            stats: HarnessStats::default(),
        };
        // A member list scheduled from the start answers the first poll, dispatched during
        // configuration, so that a replay's first requests find the fleet already seated.
        if let Some((_, first)) = h.cfg.membership.iter().find(|m| m.0 == 0) {
            let first = first.clone();
            h.set_members(&first);
        }
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

    pub fn summary(&self, label: &str) -> Summary {
        let mut s = self.recorder.summary(label);
        // The recorder counts requests only up to the highest engine that served one; the engines
        // after it served none, and a fleet that left its last engines idle must show them.
        if s.requests_per_replica.len() < self.replicas.len() {
            s.requests_per_replica.resize(self.replicas.len(), 0);
        }
        s
    }
}

/// Starts `cfg.proxies` proxies with `cfg.workers` configured VMs each. Returns the proxies and every
/// worker, proxy by proxy (worker `w` belongs to proxy `w / cfg.workers`).
fn start_proxies(
    module: &FilterModule,
    cfg: &HarnessConfig,
    specs: &[(String, String, String, String)],
) -> Result<(Vec<Proxy>, Vec<WorkerVm>), HarnessError> {
    let mut options = ProxyOptions::new(cfg.mode, cfg.plugin_config().to_string());
    options.clock_ns_per_fuel = cfg.clock_ns_per_fuel;
    options.nginx = cfg.nginx;
    if cfg.mode == HostMode::Envoy {
        options.clusters = Some(
            specs
                .iter()
                .flat_map(|(_, _, feed, cluster)| [feed.clone(), cluster.clone()])
                .chain((0..cfg.proxies).map(peer_cluster))
                // The discovery source and the discovered members' feeds (`discovery`).
                .chain([DISCOVERY_CLUSTER.into(), MEMBER_FEEDS_CLUSTER.into()])
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
    Ok((proxies, workers))
}
