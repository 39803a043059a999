//! The simulated fleet behind the proxies: one [`Replica`] (an engine) per endpoint, or per DP rank
//! of an endpoint, and the faults a test can make each one show. Here too is how a request sent to
//! an endpoint lands on one of its engines, since with DP ranks that is the endpoint's choice, not
//! the proxy's.

use super::{Harness, HarnessConfig, HarnessError};
use crate::host::StreamState;
use kvsteer_sim::{Engine, EngineRequest};
use serde_json::Value;

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

/// Ids of requests submitted straight to an engine (not through the filter) start here.
pub(super) const DIRECT_ID_BASE: u64 = 1 << 62;

/// An endpoint's ranks, as its API server sees them.
pub(super) struct EndpointDp {
    pub(super) units: std::ops::Range<usize>,
    pub(super) balancer: kvsteer_sim::dp::DpBalancer,
    pub(super) union: kvsteer_sim::dp::UnionFeed,
}

/// The engines behind the configured endpoints (`specs`, as [`HarnessConfig::replica_specs`] lists
/// them): `dp_ranks` engines per endpoint, each seeded by its index, and each endpoint's view of its
/// ranks.
pub(super) fn fleet(
    cfg: &HarnessConfig,
    specs: Vec<(String, String, String, String)>,
) -> (Vec<Replica>, Vec<EndpointDp>) {
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
    (replicas, endpoints)
}

impl Harness {
    /// Replica index of an `IP:port` endpoint (its first rank's with DP ranks).
    pub fn replica_of_endpoint(&self, endpoint: &str) -> Option<usize> {
        self.replicas.iter().position(|r| r.endpoint == endpoint)
    }

    /// The engine a request sent to `replica`'s endpoint lands on: the endpoint's only engine, or with
    /// DP ranks the rank the request's rank header names (vLLM's `X-data-parallel-rank`), else the
    /// one the endpoint's internal balancer picks (a header that is not a rank of the endpoint is
    /// treated as absent, as vLLM's server ignores a value that is not an integer).
    pub(super) fn engine_for(&mut self, replica: usize, st: &StreamState) -> usize {
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
        self.submit_direct_for(replica, prompt, max_tokens, None)
    }

    /// [`Harness::submit_direct`] for a LoRA adapter (`None`: the base model).
    pub fn submit_direct_for(
        &mut self,
        replica: usize,
        prompt: Vec<u32>,
        max_tokens: u32,
        adapter: Option<&str>,
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
            .submit_with_adapter(self.now_us, req, adapter)
            .map_err(|e| HarnessError::Config(format!("direct submit: {e}")))?;
        Ok(id)
    }
}
