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

use crate::abi::{Action, Pairs};
use crate::host::{
    CallOutcome, Callout, FilterModule, HostError, HostMode, Proxy, ProxyOptions, StreamState,
    WorkerVm,
};
use crate::openai::{SseWriter, completion_body, error_response, request_headers, sse_headers};
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FEED_PATH, FeedBatch, FeedQuery};
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest, FinishReason};
use kvsteer_workload::{Driver, Recorder, Summary};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::fmt;

/// How the filter hands over its choice.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Output {
    DestinationHeader,
    ClusterHeader,
    NginxVariable,
}

impl Output {
    fn name(self) -> &'static str {
        match self {
            Output::DestinationHeader => "destination_header",
            Output::ClusterHeader => "cluster_header",
            Output::NginxVariable => "nginx_variable",
        }
    }
}

/// What a replica's feed endpoint does when polled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FeedFault {
    /// Answers normally.
    Healthy,
    /// The connection fails (Envoy: `on_http_call_response` with no headers).
    Reset,
    /// Never answers: the callout times out (Envoy delivers a local 504 after the timeout).
    Timeout,
    /// Answers with this HTTP status and a text body.
    Status(u16),
    /// Answers 200 with these bytes (a corrupt or hostile feed).
    Garbage(Vec<u8>),
    /// Answers every poll with a valid snapshot (`RESYNC`, the engine's epoch) of `blocks` made-up
    /// GPU blocks, `8 * blocks` bytes of hashes: a replica flooding the router.
    Snapshot { blocks: u64 },
    /// Answers normally, `delay_us` after the poll; past the callout's timeout the proxy answers its
    /// 504 `upstream request timeout` at the timeout instead (as [`FeedFault::Timeout`]).
    Slow { delay_us: u64 },
}

/// What a replica does with a completion request sent to it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ResponseFault {
    /// Runs it on the engine.
    #[default]
    Healthy,
    /// Fails it at once with this HTTP status and a vLLM-style error object (a replica failing
    /// fast: a broken engine behind a live HTTP server).
    Status(u16),
    /// Answers 200 with an SSE stream holding only an engine error event
    /// (`data: {"error": {...}}`, then `[DONE]`), as vLLM does when generation fails after the
    /// headers went out.
    StreamError,
}

/// The made-up block hashes of a [`FeedFault::Snapshot`] from replica `replica`: `0..blocks` of them.
pub fn flood_hash(replica: usize, i: u64) -> u64 {
    0xF100_D000_0000_0000 | (replica as u64) << 40 | i
}

/// One simulated replica: an engine. With DP ranks ([`HarnessConfig::dp_ranks`]) an endpoint has
/// several, one per rank, sharing its endpoint, feed cluster and cluster.
pub struct Replica {
    pub name: String,
    /// Index of the endpoint (the plugin configuration's replica entry) this engine serves behind.
    pub endpoint_index: usize,
    /// Its DP rank when the endpoint has several (`None` otherwise).
    pub rank: Option<usize>,
    /// `IP:port` the filter writes into the destination header (and, in nginx mode, the feed address).
    pub endpoint: String,
    pub feed_cluster: String,
    pub cluster: String,
    pub engine: Engine,
    pub feed_fault: FeedFault,
    pub response_fault: ResponseFault,
    /// Completion requests failed by `response_fault`.
    pub faulted: u64,
    /// Feed polls answered (any outcome).
    pub polls: u64,
    /// `(:method, :path, :authority)` of the last feed callout.
    pub last_poll: Option<(String, String, String)>,
}

/// The cluster name through which one proxy's filter reaches proxy `q`'s (the working-set exchange,
/// `peers`): the harness answers a callout to it with a request through proxy `q`.
pub fn peer_cluster(q: usize) -> String {
    format!("kvsteer-peer-{q}")
}

/// The shared token [`HarnessConfig::proxy_plugin_config`] gives every proxy.
pub const HARNESS_PEER_TOKEN: &str = "harness-peer-token-0123456789";

/// The proxy a peer cluster ([`peer_cluster`]) names.
fn proxy_of_peer_cluster(upstream: &str) -> Option<usize> {
    upstream.strip_prefix("kvsteer-peer-")?.parse().ok()
}

/// How requests are spread across the proxies when there are several ([`HarnessConfig::proxies`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ProxySpread {
    /// Each request goes to a proxy drawn at random (seeded): a client behind a plain L4 balancer.
    PerRequest,
    /// Every request of a session goes to the same proxy (a hash of the session header; requests
    /// without one are drawn at random): a sidecar per client, or a sticky ingress.
    PerSession,
}

/// More request headers for a driver's request, from its session id ([`HarnessConfig::issue_headers`]).
pub type IssueHeaders = fn(&str) -> Vec<(String, String)>;

/// Harness configuration. [`HarnessConfig::small`] is sized for tests (runs in seconds).
#[derive(Clone, Debug)]
pub struct HarnessConfig {
    pub mode: HostMode,
    pub output: Output,
    /// Worker VMs per proxy.
    pub workers: usize,
    /// Independent proxies in front of the same replicas (1: the usual single proxy). Each is its own
    /// [`Proxy`] with its own `workers` VMs and its own shared data: nothing passes between proxies
    /// except through the replicas (their feeds).
    pub proxies: usize,
    /// How requests are spread across the proxies.
    pub proxy_spread: ProxySpread,
    pub replicas: usize,
    /// Data-parallel ranks behind each endpoint (1: one engine per endpoint). Each rank is its own
    /// engine; a request's rank comes from the rank header, else from vLLM's internal balancer
    /// ([`kvsteer_sim::dp::DpBalancer`]).
    pub dp_ranks: usize,
    /// With `dp_ranks` > 1: whether the filter is told about the ranks (`dp_ranks` in its replica
    /// entries: it routes to (endpoint, rank) units and writes the rank header). Off, the filter
    /// sees one replica per endpoint, polls its feed without a rank (answered with the union of the
    /// ranks' caches, [`kvsteer_sim::dp::UnionFeed`]) and the endpoint's balancer picks the rank:
    /// rank-blind routing.
    pub rank_aware: bool,
    /// Template for every engine (each gets its own seed).
    pub engine: EngineConfig,
    /// The filter's `routing` section (policy, block size, coefficients).
    pub routing: Value,
    pub feed_period_ms: u64,
    pub tick_ms: u64,
    /// More top-level filter configuration fields (merged over the generated ones).
    pub filter_extra: serde_json::Map<String, Value>,
    pub session_header: String,
    /// Tokens handed to the filter in one body chunk, one SSE event each as engines send them (the
    /// first token always goes alone). Batching only saves harness calls; the filter counts every token.
    pub chunk_tokens: usize,
    /// Request bodies are pushed in chunks of this many bytes (Envoy reads 16 KiB slices).
    pub body_chunk_bytes: usize,
    /// Every n-th response chunk ends inside an SSE event (0: never).
    pub split_every: u64,
    /// Virtual time between a callout and its answer.
    pub callout_latency_us: u64,
    /// Decode-load sampling period.
    pub sample_us: u64,
    /// Envoy with the destination header: a request its replica fails at once with a 5xx
    /// ([`ResponseFault::Status`]) is retried on the second entry of the destination list, as the
    /// shipped envoy.yaml does (`retry_on: 5xx`), and Envoy's `upstream.address` then names that
    /// replica. Off: the 5xx reaches the client.
    pub retry_5xx: bool,
    /// The benchmark's limit (`crate::oracle`): the harness, not the filter, picks every request's
    /// replica from the true output lengths and the engines' exact state. The filter still carries
    /// the request (parsing, streaming, its own bookkeeping on its own choice); only the destination
    /// is overridden, and the filter is not told (`upstream.address` is left unset), so its health
    /// accounting never mistakes the override for a retry. Off everywhere but the bench's `oracle`.
    pub oracle: Option<crate::oracle::Weights>,
    /// A slow machine ([`ProxyOptions::clock_ns_per_fuel`]): the filter's clock runs ahead with the
    /// work it does inside a callback. 0: it stands still during a callback.
    pub clock_ns_per_fuel: u64,
    /// Engines made slower during the run, as a noisy neighbour or a throttled GPU makes a real
    /// one: `(replica, factor, from_us)`, the engine's steps taking `factor` times as long from
    /// `from_us` of virtual time (0: from the start; a heterogeneous fleet).
    pub slowdowns: Vec<(usize, f64, u64)>,
    /// nginx mode: the zone size and connection limit of the nginx imitated.
    pub nginx: crate::host::NginxLimits,
    /// More request headers for each request a workload's driver issues, from its session id
    /// (e.g. a priority class per session); `None`: none.
    pub issue_headers: Option<IssueHeaders>,
}

impl HarnessConfig {
    /// Four replicas of a small engine (2,048 blocks of 16 tokens each), two workers, Envoy mode.
    pub fn small(policy: &str) -> HarnessConfig {
        let engine = EngineConfig {
            kv_blocks: 2048,
            ..EngineConfig::default()
        };
        HarnessConfig {
            mode: HostMode::Envoy,
            output: Output::DestinationHeader,
            workers: 2,
            proxies: 1,
            proxy_spread: ProxySpread::PerRequest,
            replicas: 4,
            dp_ranks: 1,
            rank_aware: true,
            engine,
            routing: json!({"policy": policy, "block_size": 16}),
            feed_period_ms: 200,
            tick_ms: 100,
            filter_extra: serde_json::Map::new(),
            session_header: "x-session-id".into(),
            chunk_tokens: 16,
            body_chunk_bytes: 16 * 1024,
            split_every: 3,
            callout_latency_us: 500,
            sample_us: 500_000,
            retry_5xx: true,
            oracle: None,
            clock_ns_per_fuel: 0,
            slowdowns: Vec::new(),
            nginx: Default::default(),
            issue_headers: None,
        }
    }

    /// The replicas' names, endpoints and clusters, as the plugin configuration lists them.
    pub fn replica_specs(&self) -> Vec<(String, String, String, String)> {
        (0..self.replicas)
            .map(|i| {
                (
                    format!("r{i}"),
                    format!("127.0.0.1:{}", 18000 + i),
                    format!("kvsteer_feed_r{i}"),
                    format!("replica_r{i}"),
                )
            })
            .collect()
    }

    /// The plugin configuration JSON the filter receives in `on_configure`.
    /// Proxy `p`'s plugin configuration: [`HarnessConfig::plugin_config`], with the working-set
    /// exchange's `peers` section (from `filter_extra["peers"]`: `"on"` or a section without
    /// `proxies`) completed with every other proxy's peer cluster ([`peer_cluster`]) and a shared
    /// token unless one is given.
    pub fn proxy_plugin_config(&self, p: usize) -> Value {
        let mut cfg = self.plugin_config();
        let Some(section) = self.filter_extra.get("peers") else {
            return cfg;
        };
        let mut section = match section {
            Value::Object(_) => section.clone(),
            _ => json!({}),
        };
        section["proxies"] = (0..self.proxies)
            .filter(|&q| q != p)
            .map(|q| json!({"cluster": peer_cluster(q), "authority": format!("proxy-{q}")}))
            .collect();
        if section.get("token").is_none() {
            section["token"] = json!(HARNESS_PEER_TOKEN);
        }
        cfg["peers"] = section;
        cfg
    }

    pub fn plugin_config(&self) -> Value {
        let replicas: Vec<Value> = self
            .replica_specs()
            .into_iter()
            .map(|(name, endpoint, feed_cluster, cluster)| {
                let mut v = match self.mode {
                    HostMode::Envoy => json!({
                        "name": name, "endpoint": endpoint, "feed_cluster": feed_cluster,
                        "feed_authority": endpoint, "cluster": cluster
                    }),
                    HostMode::Nginx => json!({
                        "name": name, "endpoint": endpoint, "feed_address": endpoint
                    }),
                };
                if self.dp_ranks > 1 && self.rank_aware {
                    v["dp_ranks"] = json!(self.dp_ranks);
                }
                v
            })
            .collect();
        let mut cfg = json!({
            "replicas": replicas,
            "routing": self.routing,
            "feed_period_ms": self.feed_period_ms,
            "tick_ms": self.tick_ms,
            "session_header": self.session_header,
            "output": self.output.name(),
        });
        if let Value::Object(m) = &mut cfg {
            for (k, v) in &self.filter_extra {
                m.insert(k.clone(), v.clone());
            }
        }
        cfg
    }
}

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

/// A request for [`Harness::send`].
#[derive(Clone, Debug, Default)]
pub struct RequestSpec {
    pub session: Option<String>,
    pub prompt: Vec<u32>,
    pub max_tokens: u32,
    /// Worker to use (default: round robin).
    pub worker: Option<usize>,
    /// More request headers (e.g. a spoofed destination header).
    pub headers: Vec<(String, String)>,
    /// Send these bytes instead of a completions body built from `prompt` (malformed-input tests).
    pub raw_body: Option<Vec<u8>>,
    /// Path (default `/v1/completions`).
    pub path: Option<String>,
    /// End the request with these trailers (HTTP/2): end of stream then arrives on
    /// `proxy_on_request_trailers`, not on the last body chunk.
    pub trailers: Option<Vec<(String, String)>>,
}

impl RequestSpec {
    pub fn new(prompt: Vec<u32>, max_tokens: u32) -> RequestSpec {
        RequestSpec {
            prompt,
            max_tokens,
            ..Default::default()
        }
    }

    pub fn session(mut self, s: &str) -> Self {
        self.session = Some(s.to_string());
        self
    }

    pub fn worker(mut self, w: usize) -> Self {
        self.worker = Some(w);
        self
    }

    pub fn header(mut self, k: &str, v: &str) -> Self {
        self.headers.push((k.to_string(), v.to_string()));
        self
    }

    /// Ends the request with a trailer (HTTP/2 request trailers).
    pub fn trailer(mut self, k: &str, v: &str) -> Self {
        self.trailers
            .get_or_insert_with(Vec::new)
            .push((k.to_string(), v.to_string()));
        self
    }
}

/// What happened to one request.
#[derive(Clone, Debug, Default)]
pub struct RequestRecord {
    pub id: u64,
    pub worker: usize,
    pub issued_us: u64,
    /// The filter let the request go upstream.
    pub released: bool,
    /// The destination the filter chose, as written (header value or nginx variable).
    pub destination: Option<String>,
    /// The replica that served it (chosen by the filter, or by fallback; after a retry, the one
    /// retried on).
    pub replica: Option<usize>,
    /// The filter's choice, when it failed the request at once and the proxy retried elsewhere
    /// ([`HarnessConfig::retry_5xx`]).
    pub retried_from: Option<usize>,
    /// Released without a usable destination: the proxy's own balancing picked the replica.
    pub fallback: bool,
    /// The filter answered locally with this status.
    pub local_response: Option<u32>,
    /// That local answer's headers and body, as the client receives them.
    pub local_headers: Vec<(String, String)>,
    pub local_body: Vec<u8>,
    /// The engine refused the request (400 passed back through the filter).
    pub rejected: Option<String>,
    pub first_token_us: Option<u64>,
    pub finished_us: Option<u64>,
    pub failed: bool,
    /// Prompt tokens the engine reported (0 until the request finishes).
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    /// Request headers as the upstream saw them.
    pub upstream_headers: Vec<(String, String)>,
    /// Response body bytes that reached the client.
    pub downstream_bytes: usize,
    /// The filter's `explain_header` on the response, when configured (the routing cost's terms).
    pub explained: Option<String>,
}

impl RequestRecord {
    pub fn upstream_header(&self, name: &str) -> Option<&str> {
        self.upstream_headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
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

struct PendingCall {
    worker: usize,
    call: Callout,
    due_us: u64,
    outcome: Option<CallOutcome>,
}

/// Counters of what the harness did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HarnessStats {
    /// Wall time of the longest single `proxy_on_tick` or callout answer (`proxy_on_http_call_response`)
    /// in any worker: the longest the filter held a worker thread for feed work (benchmarks read it;
    /// tests never time anything).
    pub max_feed_call_ns: u64,
    pub requests: u64,
    /// Requests retried on the filter's second choice ([`HarnessConfig::retry_5xx`]).
    pub retries: u64,
    pub fallback: u64,
    pub local_responses: u64,
    pub rejected: u64,
    pub failed: u64,
    pub ticks: u64,
    pub callouts: u64,
    pub request_body_chunks: u64,
    pub response_body_chunks: u64,
    /// Wall time spent inside guest callbacks for requests (headers + body), nanoseconds.
    pub request_filter_ns: u64,
    /// Requests the oracle placed ([`HarnessConfig::oracle`]), and of those, how many on another
    /// replica than the filter chose.
    pub oracle_placed: u64,
    pub oracle_moved: u64,
    /// With DP ranks: requests whose rank came from the rank header, and from the endpoint's own
    /// balancer (no header, or not a rank of the endpoint).
    pub rank_from_header: u64,
    pub rank_from_balancer: u64,
    /// Peer polls (the working-set exchange) answered through the peer proxy's filter, and those
    /// the filter let through instead of answering (never: the reserved path is not forwarded).
    pub peer_polls: u64,
    pub peer_polls_forwarded: u64,
    /// Body bytes of the peer polls' answers (what the exchange puts on the wire, headers aside).
    pub peer_answer_bytes: u64,
    /// The filters' own exchange counters over every proxy (`kvsteer_peer_entries_applied`,
    /// `kvsteer_peer_answers_refused`), as of [`Harness::collect_peer_counters`].
    pub peer_entries_applied: u64,
    pub peer_answers_refused: u64,
}

/// Ids of requests submitted straight to an engine (not through the filter) start here.
const DIRECT_ID_BASE: u64 = 1 << 62;

/// An endpoint's ranks, as its API server sees them.
struct EndpointDp {
    units: std::ops::Range<usize>,
    balancer: kvsteer_sim::dp::DpBalancer,
    union: kvsteer_sim::dp::UnionFeed,
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
        let dp = cfg.dp_ranks.max(1);
        let mut replicas = Vec::new();
        let mut endpoints = Vec::new();
        for (e, (name, endpoint, feed_cluster, cluster)) in specs.into_iter().enumerate() {
            let start = replicas.len();
            for r in 0..dp {
                let i = replicas.len();
                replicas.push(Replica {
                    name: if dp > 1 {
                        format!("{name}_dp{r}")
                    } else {
                        name.clone()
                    },
                    endpoint_index: e,
                    rank: (dp > 1).then_some(r),
                    endpoint: endpoint.clone(),
                    feed_cluster: feed_cluster.clone(),
                    cluster: cluster.clone(),
                    engine: Engine::new(cfg.engine.for_replica(i)),
                    feed_fault: FeedFault::Healthy,
                    response_fault: ResponseFault::Healthy,
                    faulted: 0,
                    polls: 0,
                    last_poll: None,
                });
            }
            endpoints.push(EndpointDp {
                units: start..replicas.len(),
                balancer: kvsteer_sim::dp::DpBalancer::new(dp),
                union: kvsteer_sim::dp::UnionFeed::new(
                    dp,
                    0xD0_0000 + e as u64,
                    cfg.engine.feed_log_hashes,
                ),
            });
        }
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

    /// Replica index of an `IP:port` endpoint (its first rank's with DP ranks).
    pub fn replica_of_endpoint(&self, endpoint: &str) -> Option<usize> {
        self.replicas.iter().position(|r| r.endpoint == endpoint)
    }

    /// The engine a request sent to `replica`'s endpoint lands on: the endpoint's only engine, or with
    /// DP ranks the rank the request's rank header names (vLLM's `X-data-parallel-rank`), else the
    /// one the endpoint's internal balancer picks (a header that is not a rank of the endpoint is
    /// treated as absent, as vLLM's server ignores a value that is not an integer).
    fn engine_for(&mut self, replica: usize, st: &StreamState) -> usize {
        let e = self.replicas[replica].endpoint_index;
        let units = self.endpoints[e].units.clone();
        if units.len() <= 1 {
            return replica;
        }
        let name = self
            .cfg
            .filter_extra
            .get("rank_header")
            .and_then(Value::as_str)
            .unwrap_or(kvsteer_core::dp::DEFAULT_RANK_HEADER)
            .to_string();
        if let Some(r) = st
            .upstream_header(&name)
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&r| r < units.len())
        {
            self.stats.rank_from_header += 1;
            return units.start + r;
        }
        self.stats.rank_from_balancer += 1;
        let now = self.now_us;
        let engines = &self.replicas[units.clone()];
        let r = self.endpoints[e].balancer.choose(now, |r| {
            let l = engines[r].engine.load();
            (l.waiting, l.running)
        });
        units.start + r
    }

    pub fn set_feed_fault(&mut self, replica: usize, fault: FeedFault) {
        self.replicas[replica].feed_fault = fault;
    }

    /// What `replica` does with the completion requests sent to it from now on.
    pub fn set_response_fault(&mut self, replica: usize, fault: ResponseFault) {
        self.replicas[replica].response_fault = fault;
    }

    /// Restarts a replica's engine: requests in flight there fail, its cache is empty, and its feed
    /// starts a new epoch.
    pub fn restart_replica(&mut self, replica: usize) -> Result<(), HarnessError> {
        let now = self.now_us;
        self.replicas[replica].engine.restart(now);
        self.drain_engine(replica)
    }

    /// Submits a request straight to an engine, bypassing the filter (to set up cache or load state the
    /// filter can only learn from the feed). Returns the engine request id.
    pub fn submit_direct(
        &mut self,
        replica: usize,
        prompt: Vec<u32>,
        max_tokens: u32,
    ) -> Result<u64, HarnessError> {
        let id = self.next_direct;
        self.next_direct += 1;
        let req = EngineRequest {
            id,
            prompt,
            max_tokens,
            ignore_eos: true,
            min_tokens: 0,
        };
        self.replicas[replica]
            .engine
            .submit(self.now_us, req)
            .map_err(|e| HarnessError::Config(format!("direct submit: {e}")))?;
        Ok(id)
    }

    fn set_now(&mut self, t: u64) {
        if t > self.now_us {
            self.now_us = t;
        }
        for p in &self.proxies {
            p.set_now_ns(self.now_us.saturating_mul(1000));
        }
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
            rec.local_headers = lr
                .headers
                .iter()
                .map(|(k, v)| {
                    (
                        String::from_utf8_lossy(k).into_owned(),
                        String::from_utf8_lossy(v).into_owned(),
                    )
                })
                .collect();
            rec.local_body = lr.body.clone();
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

    /// The earliest time anything is due.
    fn next_event_us(&self) -> Option<u64> {
        let mut t: Option<u64> = None;
        let mut take = |v: u64| t = Some(t.map_or(v, |x| x.min(v)));
        for r in &self.replicas {
            if let Some(e) = r.engine.next_event_time() {
                take(e);
            }
        }
        for (i, w) in self.workers.iter().enumerate() {
            if w.tick_period_ms() > 0 {
                take(self.next_tick_us[i]);
            }
        }
        for c in &self.calls {
            take(c.due_us);
        }
        if let Some(d) = &self.driver
            && let Some(wake) = d.next_wakeup()
        {
            take(wake);
        }
        if self.driver.is_some() || !self.flights.is_empty() {
            take(self.next_sample_us);
        }
        t
    }

    /// Processes everything due up to `end_us`, then sets the clock to `end_us`.
    pub fn run_until(&mut self, end_us: u64) -> Result<(), HarnessError> {
        while let Some(t) = self.next_event_us().filter(|t| *t <= end_us) {
            self.set_now(t);
            self.process_due()?;
        }
        self.set_now(end_us);
        Ok(())
    }

    pub fn run_for(&mut self, us: u64) -> Result<(), HarnessError> {
        self.run_until(self.now_us.saturating_add(us))
    }

    /// Runs until no request sent through the filter is in flight (or `limit_us` of virtual time
    /// passed, which is an error naming the first request still open).
    pub fn run_until_idle(&mut self, limit_us: u64) -> Result<(), HarnessError> {
        let end = self.now_us.saturating_add(limit_us);
        while self.in_flight() > 0 {
            match self.next_event_us() {
                Some(t) if t <= end => {
                    self.set_now(t);
                    self.process_due()?;
                }
                _ => {
                    let id = self
                        .flights
                        .keys()
                        .copied()
                        .chain(self.paused.iter().map(|p| p.id))
                        .min()
                        .unwrap_or_default();
                    return Err(HarnessError::Stuck {
                        request: id,
                        detail: format!("still open after {limit_us} us of virtual time"),
                    });
                }
            }
        }
        Ok(())
    }

    fn process_due(&mut self) -> Result<(), HarnessError> {
        let now = self.now_us;
        for r in 0..self.replicas.len() {
            if self.replicas[r]
                .engine
                .next_event_time()
                .is_some_and(|t| t <= now)
            {
                self.replicas[r].engine.advance(now, &mut self.events);
                self.drain_events()?;
            }
        }
        // Callouts due now, in dispatch order.
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.calls.len() {
            if self.calls[i].due_us <= now {
                due.push(self.calls.remove(i));
            } else {
                i += 1;
            }
        }
        for c in due {
            self.answer(c)?;
        }
        for w in 0..self.workers.len() {
            let period = self.workers[w].tick_period_ms() as u64 * 1000;
            if period > 0 && self.next_tick_us[w] <= now {
                let started = std::time::Instant::now();
                self.workers[w].tick()?;
                let ns = started.elapsed().as_nanos() as u64;
                self.stats.max_feed_call_ns = self.stats.max_feed_call_ns.max(ns);
                self.stats.ticks += 1;
                self.next_tick_us[w] = now + period;
            }
        }
        self.collect_callouts();
        self.check_paused()?;
        if now >= self.next_sample_us {
            let blocks: Vec<u64> = self
                .replicas
                .iter()
                .map(|r| r.engine.decode_blocks())
                .collect();
            self.recorder.sample(now, &blocks);
            self.next_sample_us = now + self.cfg.sample_us.max(1);
        }
        if self.driver.is_some() {
            let mut issues = Vec::new();
            if let Some(d) = self.driver.as_mut() {
                d.poll(now, &mut issues);
            }
            for issue in issues {
                self.recorder.issued_from(&issue);
                let spec = RequestSpec {
                    session: Some(issue.session_id.clone()),
                    prompt: issue.prompt.to_vec(),
                    max_tokens: issue.output_tokens,
                    headers: self
                        .cfg
                        .issue_headers
                        .map(|f| f(&issue.session_id))
                        .unwrap_or_default(),
                    ..Default::default()
                };
                self.send_with_id(issue.request_id, &spec, true)?;
            }
        }
        Ok(())
    }

    /// Moves callouts the workers dispatched into the pending list, deciding each one's fate.
    fn collect_callouts(&mut self) {
        for w in 0..self.workers.len() {
            for call in self.workers[w].take_callouts() {
                self.stats.callouts += 1;
                if proxy_of_peer_cluster(&call.upstream).is_some() {
                    // Answered through the peer proxy when due ([`Harness::answer_peer`]).
                    self.calls.push(PendingCall {
                        worker: w,
                        call,
                        due_us: self.now_us + self.cfg.callout_latency_us,
                        outcome: None,
                    });
                    continue;
                }
                let replica = self.replica_of_callout(&call);
                let mut due = self.now_us + self.cfg.callout_latency_us;
                let mut outcome = None;
                match replica.map(|r| &self.replicas[r].feed_fault) {
                    None => {
                        outcome = Some(CallOutcome::ok(
                            404,
                            "text/plain",
                            b"no such upstream".to_vec(),
                        ))
                    }
                    Some(FeedFault::Timeout) => {
                        due = self.now_us + call.timeout_ms as u64 * 1000;
                        outcome = Some(CallOutcome::timeout());
                    }
                    Some(FeedFault::Slow { delay_us }) => {
                        let timeout_us = call.timeout_ms as u64 * 1000;
                        if *delay_us >= timeout_us {
                            due = self.now_us + timeout_us;
                            outcome = Some(CallOutcome::timeout());
                        } else {
                            due = self.now_us + delay_us;
                        }
                    }
                    Some(_) => {}
                }
                self.calls.push(PendingCall {
                    worker: w,
                    call,
                    due_us: due,
                    outcome,
                });
            }
        }
    }

    /// The engine a feed callout asks: the endpoint's (its first rank's with DP ranks), or with a
    /// `rank` in the query that rank's when the endpoint has it (faults and poll records are per
    /// engine).
    fn replica_of_callout(&self, call: &Callout) -> Option<usize> {
        let first = match self.cfg.mode {
            HostMode::Envoy => self
                .replicas
                .iter()
                .position(|r| r.feed_cluster == call.upstream),
            HostMode::Nginx => self.replica_of_endpoint(&call.upstream),
        }?;
        let units = &self.endpoints[self.replicas[first].endpoint_index].units;
        let query = call
            .header(":path")
            .and_then(|p| p.split_once('?'))
            .map_or("", |(_, q)| q);
        match kvsteer_core::feed::query_rank(query) {
            Ok(Some(r)) if (r as usize) < units.len() && units.len() > 1 => {
                Some(units.start + r as usize)
            }
            _ => Some(first),
        }
    }

    /// Answers a callout from the replica's engine at the current virtual time.
    fn answer(&mut self, p: PendingCall) -> Result<(), HarnessError> {
        let peer = match (&p.outcome, proxy_of_peer_cluster(&p.call.upstream)) {
            (None, Some(q)) => Some(self.answer_peer(q, &p.call)?),
            _ => None,
        };
        let outcome = match p.outcome.or(peer) {
            Some(o) => o,
            None => match self.replica_of_callout(&p.call) {
                None => CallOutcome::ok(404, "text/plain", b"no such upstream".to_vec()),
                Some(r) => {
                    let rep = &mut self.replicas[r];
                    rep.polls += 1;
                    let h = |n: &str| p.call.header(n).unwrap_or("").to_string();
                    rep.last_poll = Some((h(":method"), h(":path"), h(":authority")));
                    match rep.feed_fault.clone() {
                        FeedFault::Reset => CallOutcome::Reset,
                        FeedFault::Timeout => CallOutcome::timeout(),
                        FeedFault::Status(s) => {
                            CallOutcome::ok(s, "text/plain", b"feed unavailable".to_vec())
                        }
                        FeedFault::Garbage(bytes) => CallOutcome::ok(200, FEED_CONTENT_TYPE, bytes),
                        FeedFault::Snapshot { blocks } => {
                            let snap = FeedBatch::snapshot(
                                rep.engine.epoch(),
                                (0..blocks).map(|i| flood_hash(r, i)).collect(),
                            );
                            CallOutcome::ok(200, FEED_CONTENT_TYPE, snap.encode())
                        }
                        FeedFault::Healthy | FeedFault::Slow { .. } => {
                            let e = rep.endpoint_index;
                            let ep = &mut self.endpoints[e];
                            if ep.units.len() <= 1 {
                                feed_answer(&mut rep.engine, &p.call)
                            } else {
                                let mut engines: Vec<&mut Engine> = self.replicas[ep.units.clone()]
                                    .iter_mut()
                                    .map(|r| &mut r.engine)
                                    .collect();
                                dp_feed_answer(&mut engines, &mut ep.union, &p.call)
                            }
                        }
                    }
                }
            },
        };
        if self.workers[p.worker].is_dead() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        self.workers[p.worker].answer_callout(&p.call, outcome)?;
        let ns = started.elapsed().as_nanos() as u64;
        self.stats.max_feed_call_ns = self.stats.max_feed_call_ns.max(ns);
        Ok(())
    }

    /// A peer poll to proxy `q`: the callout's request goes through one of `q`'s workers (round
    /// robin) and its filter's local response is the answer; a request the filter let through
    /// (it must not) is counted and answered 502, as an upstream with no such path would.
    fn answer_peer(&mut self, q: usize, call: &Callout) -> Result<CallOutcome, HarnessError> {
        if q >= self.proxies.len() {
            return Ok(CallOutcome::ok(
                503,
                "text/plain",
                b"no such proxy".to_vec(),
            ));
        }
        self.stats.peer_polls += 1;
        if let Some(fault) = self.peer_faults.get(q).cloned().flatten() {
            return Ok(fault);
        }
        let Some(st) = self.request_through(q, call.headers.clone())? else {
            return Ok(CallOutcome::Reset);
        };
        if st.released {
            self.stats.peer_polls_forwarded += 1;
            return Ok(CallOutcome::ok(502, "text/plain", b"forwarded".to_vec()));
        }
        Ok(match st.local_response {
            Some(r) => {
                self.stats.peer_answer_bytes += r.body.len() as u64;
                let ct = r
                    .headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(b"content-type"))
                    .map_or("application/octet-stream".into(), |(_, v)| {
                        String::from_utf8_lossy(v).into_owned()
                    });
                CallOutcome::ok(r.status as u16, &ct, r.body)
            }
            None => CallOutcome::ok(502, "text/plain", b"no answer".to_vec()),
        })
    }

    /// A bodiless request with `headers` through one of proxy `q`'s workers (round robin, apart from
    /// the driven requests'), ended at once: the stream's record (`released`: the filter let it go
    /// upstream; `local_response`: it answered itself). `None` when that worker is dead.
    pub fn request_through(
        &mut self,
        q: usize,
        headers: Pairs,
    ) -> Result<Option<StreamState>, HarnessError> {
        let n = self.cfg.workers;
        let w = q * n + self.rr_peer[q] % n;
        self.rr_peer[q] += 1;
        let worker = &mut self.workers[w];
        if worker.is_dead() {
            return Ok(None);
        }
        let stream = worker.new_stream()?;
        worker.request_headers(stream, headers, true)?;
        Ok(Some(worker.end_stream(stream)?))
    }

    /// Makes every peer poll to proxy `q` be answered with `fault` instead of through its filter
    /// (`None`: through the filter again): a hostile or broken peer.
    pub fn set_peer_fault(&mut self, q: usize, fault: Option<CallOutcome>) {
        if let Some(f) = self.peer_faults.get_mut(q) {
            *f = fault;
        }
    }

    /// Sums the filters' exchange counters over the proxies into [`HarnessStats`].
    pub fn collect_peer_counters(&mut self) {
        let sum = |name: &str| -> u64 {
            self.proxies
                .iter()
                .filter_map(|p| p.metric(name))
                .map(|m| m.value.max(0) as u64)
                .sum()
        };
        self.stats.peer_entries_applied = sum("kvsteer_peer_entries_applied");
        self.stats.peer_answers_refused = sum("kvsteer_peer_answers_refused");
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

    /// Replays a workload: the driver issues requests in virtual time, each goes through the filter to
    /// the replica it picks. `progress(done, total)` is called as requests finish.
    pub fn run_workload(
        &mut self,
        driver: Driver,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<(), HarnessError> {
        let total = driver.workload().total_requests() as u64;
        self.driver = Some(driver);
        let mut slowdowns = self.cfg.slowdowns.clone();
        slowdowns.sort_by_key(|s| std::cmp::Reverse(s.2));
        loop {
            while slowdowns.last().is_some_and(|s| s.2 <= self.now_us()) {
                let (r, factor, _) = slowdowns.pop().unwrap_or_default();
                if let Some(rep) = self.replicas.get_mut(r) {
                    rep.engine.set_slowdown(factor);
                }
            }
            let done = self.stats.requests - self.in_flight() as u64;
            progress(done, total);
            let driver_idle = self
                .driver
                .as_ref()
                .is_none_or(|d| d.next_wakeup().is_none());
            if driver_idle && self.in_flight() == 0 {
                break;
            }
            match self.next_event_us() {
                Some(t) => {
                    self.set_now(t);
                    self.process_due()?;
                }
                None => break,
            }
            if driver_idle && self.in_flight() > 0 && self.flights.is_empty() {
                let id = self.paused.first().map_or(0, |p| p.id);
                return Err(HarnessError::Stuck {
                    request: id,
                    detail: "paused by the filter with nothing left that could resume it".into(),
                });
            }
        }
        self.driver = None;
        Ok(())
    }

    pub fn summary(&self, label: &str) -> Summary {
        self.recorder.summary(label)
    }
}

/// The feed's answer of an endpoint with DP ranks: with `rank=R` rank R's own feed, carrying its rank
/// (an unknown rank is a 400 naming it); without, the union of every rank's cache (rank-blind).
fn dp_feed_answer(
    engines: &mut [&mut Engine],
    union: &mut kvsteer_sim::dp::UnionFeed,
    call: &Callout,
) -> CallOutcome {
    let path = call.header(":path").unwrap_or("");
    let (p, query) = path.split_once('?').unwrap_or((path, ""));
    if !p.ends_with(FEED_PATH) {
        return CallOutcome::ok(404, "text/plain", format!("no route {p}").into_bytes());
    }
    let q = match FeedQuery::parse(query) {
        Ok(q) => q,
        Err(e) => return CallOutcome::ok(400, "text/plain", e.into_bytes()),
    };
    match kvsteer_core::feed::query_rank(query) {
        Err(e) => CallOutcome::ok(400, "text/plain", e.into_bytes()),
        Ok(Some(r)) => match engines.get_mut(r as usize) {
            Some(e) => CallOutcome::ok(200, FEED_CONTENT_TYPE, e.feed(&q).encode_for_rank(r)),
            None => CallOutcome::ok(
                400,
                "text/plain",
                format!("feed query: no DP rank {r} here ({} ranks)", engines.len()).into_bytes(),
            ),
        },
        Ok(None) => CallOutcome::ok(200, FEED_CONTENT_TYPE, union.answer(engines, &q).encode()),
    }
}

/// The feed's answer to a callout, as the simulator's HTTP server gives it.
fn feed_answer(engine: &mut Engine, call: &Callout) -> CallOutcome {
    let path = call.header(":path").unwrap_or("");
    let (p, query) = path.split_once('?').unwrap_or((path, ""));
    if !p.ends_with(FEED_PATH) {
        return CallOutcome::ok(404, "text/plain", format!("no route {p}").into_bytes());
    }
    match FeedQuery::parse(query) {
        Ok(q) => CallOutcome::ok(200, FEED_CONTENT_TYPE, engine.feed(&q).encode()),
        Err(e) => CallOutcome::ok(400, "text/plain", e.into_bytes()),
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
