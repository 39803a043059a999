//! What a harness is built from: the proxies, the replicas and the plugin configuration each
//! proxy's filter receives. Kept apart from the harness itself so a test or a bench can read and
//! tweak a configuration (and the plugin JSON it yields) without starting a VM.

use crate::host::HostMode;
use kvsteer_sim::EngineConfig;
use serde_json::{Value, json};

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

/// The cluster name through which one proxy's filter reaches proxy `q`'s (the working-set exchange,
/// `peers`): the harness answers a callout to it with a request through proxy `q`.
pub fn peer_cluster(q: usize) -> String {
    format!("kvsteer-peer-{q}")
}

/// The shared token [`HarnessConfig::proxy_plugin_config`] gives every proxy.
pub const HARNESS_PEER_TOKEN: &str = "harness-peer-token-0123456789";

/// The proxy a peer cluster ([`peer_cluster`]) names.
pub(super) fn proxy_of_peer_cluster(upstream: &str) -> Option<usize> {
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

/// The OpenAI `model` of a driver's request, from its session id ([`HarnessConfig::issue_model`]).
pub type IssueModel = fn(&str) -> Option<String>;

/// Harness configuration. [`HarnessConfig::small`] is sized for tests (runs in seconds).
#[derive(Clone, Debug)]
pub struct HarnessConfig {
    pub mode: HostMode,
    pub output: Output,
    /// Worker VMs per proxy.
    pub workers: usize,
    /// Independent proxies in front of the same replicas (1: the usual single proxy). Each is its own
    /// [`Proxy`](crate::host::Proxy) with its own `workers` VMs and its own shared data: nothing
    /// passes between proxies except through the replicas (their feeds).
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
    /// ([`ResponseFault::Status`](super::ResponseFault::Status)) is retried on the second entry of
    /// the destination list, as the shipped envoy.yaml does (`retry_on: 5xx`), and Envoy's
    /// `upstream.address` then names that replica. Off: the 5xx reaches the client.
    pub retry_5xx: bool,
    /// The benchmark's limit (`crate::oracle`): the harness, not the filter, picks every request's
    /// replica from the true output lengths and the engines' exact state. The filter still carries
    /// the request (parsing, streaming, its own bookkeeping on its own choice); only the destination
    /// is overridden, and the filter is not told (`upstream.address` is left unset), so its health
    /// accounting never mistakes the override for a retry. Off everywhere but the bench's `oracle`.
    pub oracle: Option<crate::oracle::Weights>,
    /// A slow machine
    /// ([`ProxyOptions::clock_ns_per_fuel`](crate::host::ProxyOptions::clock_ns_per_fuel)): the
    /// filter's clock runs ahead with the work it does inside a callback. 0: it stands still during
    /// a callback.
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
    /// The `model` of each request a workload's driver issues, from its session id (a LoRA
    /// adapter per session); `None`, or `None` from it: the simulator's served name.
    pub issue_model: Option<IssueModel>,
    /// The discovery source's member list over a workload's replay, as an autoscaler moves it:
    /// `(from_us, replicas listed)`, each list answered from its virtual time on (the filter sees it
    /// at its next poll). Empty: the answer a test sets with
    /// [`Harness::set_members`](crate::Harness::set_members) stays. Only meaningful with a
    /// `discovery` section in `filter_extra`.
    pub membership: Vec<(u64, Vec<usize>)>,
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
            issue_model: None,
            membership: Vec::new(),
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
