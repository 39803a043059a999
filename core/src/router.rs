//! The router: the KV index, the approximate indexes, the token-load table and the policies together,
//! behind the API the proxy-wasm filter calls (see docs/design/core.md).
//!
//! The router's state is held by small owners, each with its own fields, methods and tests; the
//! router's own fields are those owners, the indexes and the load table, and the configuration:
//!
//! | owner | holds |
//! |---|---|
//! | `fleet::Fleet` | which slots hold members, which are down, which share an address |
//! | [`crate::health::Health`] | replicas ejected for failing, their probes, the peers' outcome counts |
//! | `feed::Feeds` | per replica: its feed's position, its cache size (`cache_sizes`), its adapters |
//! | `reported::Reported` | the replicas' load reports, the peers' shares that meet them, stale feeds |
//! | `Decider` | the policy (with its own state: `kv_time`'s learned speeds, fed by [`Policy::observe`]), its needs, the tie-break generator |
//! | `Scratch` | buffers the request path reuses |
//!
//! Its methods are grouped by concern in the submodules, each an `impl Router` block that calls
//! on the owners, so the public API stays one type:
//!
//! | module | concern |
//! |---|---|
//! | `route` | the `route*` entry points: the policy's input gathered, its choice made a [`Decision`] |
//! | `admit` | a routed request's life: admission, first token, decode progress, release |
//! | `leg_choice` | prefill/decode disaggregation: both legs chosen and booked |
//! | `feed` | the replicas' KV event feeds applied to the index; cache sizes; stale feeds |
//! | `health` | down and ejected replicas, probes, the peers' outcome counts |
//! | `membership` | slots that gain and lose members at run time: drained, vacated, reused |
//! | `load` | effective load (tracked, reported, the peers'), and this worker's share for its peers |
//! | `reported` | the state behind effective load: the replicas' reports, the peers' shares, stale feeds |
//! | `working_set` | the working-set term's plumbing and its sharing between workers and proxies |
//! | `text_share` | the text prompts' records shared with the proxy's other workers |

mod admit;
mod cache_sizes;
mod feed;
mod fleet;
mod health;
mod leg_choice;
mod load;
mod membership;
mod reported;
mod route;
mod text_share;
mod working_set;

use crate::approx::ApproxIndex;
use crate::block::{SeqHash, TextHash};
use crate::config::{ConfigError, PolicyKind, RoutingConfig};
use crate::health::Health;
use crate::index::{KvIndex, MAX_REPLICAS, TierCounts};
use crate::load::{Accounting, LoadTable};
use crate::output::OutputEstimate;
pub use crate::policy::FallbackReason;
use crate::policy::{Choice, Input, Needs, Policy};
use crate::request::{PromptTokenizer, RequestError, RouteRequest, read_request_early};
use crate::rng::SplitMix64;
use crate::working_set::WorkingSet;
use feed::Feeds;
use fleet::Fleet;
pub use membership::{Membership, MembershipChange};
use reported::Reported;

/// A routing decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub replica: usize,
    pub policy: PolicyKind,
    pub fallback: Option<FallbackReason>,
    pub prompt_tokens: u64,
    /// Per replica: cached prompt tokens, tier-weighted (a host-memory block counts
    /// `host_tier_credit` of a GPU block). From the KV index for token prompts, from the approximate
    /// text index for text prompts. Empty for a fallback without a body.
    pub matched_tokens: Vec<u64>,
    /// Per replica where the policy scores (lower is better); empty otherwise.
    pub costs: Vec<f64>,
    /// A second choice for the proxy's retry (Envoy's override_host takes a list): the cheapest other
    /// replica that is up, or the next one up when the policy does not score. None with one replica.
    pub backup: Option<usize>,
    /// The request is a health probe: `replica` is ejected for failing (`crate::health`) and gets
    /// this request whatever the policy chose; the policy's choice is the backup.
    pub probe: bool,
}

/// What applying a feed batch did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedOutcome {
    Applied {
        events: usize,
    },
    /// A snapshot replaced everything indexed for the replica.
    Reset {
        events: usize,
        epoch: u64,
    },
    /// The batch did not continue the cursor: discarded; the next query asks for a snapshot.
    Gap,
    /// The replica index is out of range: ignored.
    BadReplica,
}

/// Counters for metrics and reports. Over 15 fields: one flat record, each field one exported
/// counter, read whole by [`Router::stats`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RouterStats {
    pub policy: Option<PolicyKind>,
    pub decisions: Vec<u64>,
    pub fallback_no_session_key: u64,
    pub fallback_below_match_threshold: u64,
    pub fallback_body_unreadable: u64,
    pub prompt_tokens: u64,
    /// Tier-weighted cached tokens on the chosen replicas.
    pub matched_tokens: u64,
    pub release_anomalies: u64,
    pub active_requests: u64,
    /// Admissions not tracked because the load table was full (see `load::MAX_TRACKED_REQUESTS`).
    pub untracked_requests: u64,
    pub index_blocks: u64,
    pub index_capacity: u64,
    pub index_evictions: u64,
    pub index_heap_bytes: u64,
    pub approx_blocks: u64,
    pub approx_evictions: u64,
    pub feed_events: u64,
    pub feed_gaps: u64,
    pub feed_resets: u64,
    /// Batches whose engine block size differs from the configured one (their hashes cannot match).
    pub feed_block_size_mismatches: u64,
    /// Calls naming a replica index out of range.
    pub bad_replica: u64,
}

/// The routing brain of one proxy worker. Over 30 methods: it is the one API the filter, the
/// harness and the component call, each method a thin step onto the owners above.
#[derive(Clone, Debug)]
pub struct Router {
    cfg: RoutingConfig,
    index: KvIndex,
    approx_seq: ApproxIndex<SeqHash>,
    approx_text: ApproxIndex<TextHash>,
    load: LoadTable,
    /// Output tokens per request, learned from this router's own releases.
    outputs: OutputEstimate,
    /// The replicas' load reports, the peer workers' shares that meet them, and stale feeds
    /// (`reported`).
    reported: Reported,
    /// The latest time this router was given (route, admit): the poll time of a report accepted
    /// without one.
    clock_ms: u64,
    /// The slots' membership, which are down, which share an address (`fleet`).
    fleet: Fleet,
    /// Health learned from completions: replicas ejected for failing.
    health: Health,
    /// Per replica: its feed's position, its cache size and its adapters as the feed shows them.
    feeds: Feeds,
    /// The configured policy, what it needs gathered, and the generator its ties are broken with.
    decider: Decider,
    stats: RouterStats,
    /// Buffers the request path reuses ([`Scratch`]).
    scratch: Scratch,
    /// Recent prompt blocks per replica, kept when the policy's working-set term is on
    /// ([`Needs::working_set`]).
    working_set: Option<WorkingSet>,
}

pub use crate::speed::MAX_PENDING_PREDICTIONS;

/// What makes the decisions: the configured policy, what it asked the router to gather for it,
/// and the one generator that breaks every tie (the policy's and the P/D legs'), so that a seeded
/// router replays its decisions exactly.
#[derive(Clone, Debug)]
struct Decider {
    /// The configured policy, with its parameters and state ([`crate::policy::from_config`]).
    policy: Box<dyn Policy>,
    /// What the policy asked the router to gather for it ([`Policy::needs`]), asked once.
    needs: Needs,
    /// Round-robin positions of the P/D sides (prefill, decode): apart from round robin's own
    /// cursor, so a P/D fleet's two cycles do not disturb each other ([`Router::route_pd`]).
    pd_rr: (usize, usize),
    rng: SplitMix64,
}

impl Decider {
    /// The policy's choice from `input`, its ties broken by the router's generator.
    fn choose(&mut self, input: &Input) -> Choice {
        self.policy.choose(input, &mut self.rng)
    }
}

/// Buffers the request path takes, fills and puts back (`std::mem::take`), so that routing a
/// request allocates no per-replica vectors of its own: no state, only capacity kept between calls.
#[derive(Clone, Debug, Default)]
struct Scratch {
    /// The KV index's per-replica tier counts for a token prompt ([`KvIndex::match_prefix`]).
    tiers: Vec<TierCounts>,
    /// The approximate index's per-replica matches (overlap of a text prompt, or the affinity).
    approx: Vec<u32>,
    /// The request's working-set sample ([`crate::working_set::Sampling`]), kept from route to
    /// admit by [`Router::route_and_admit`] so the blocks are sampled once.
    sampled: Vec<u64>,
}

/// The token-load table, accounting as the configured policy reads load: queued prefill booked in
/// time for `kv_load` with `queue_in_time` and for `kv_time`, and no prefix counted as shared for
/// `kv_time`.
fn load_table(cfg: &RoutingConfig, replicas: usize) -> LoadTable {
    let in_time = match cfg.policy {
        PolicyKind::KvLoad if cfg.kv_load.queue_in_time_active() => {
            Some(cfg.kv_load.attention_context_tokens as u64)
        }
        PolicyKind::KvTime => {
            let profile = cfg.kv_time.profile.profile();
            Some(profile.attention_context_tokens().min(1e15) as u64)
        }
        _ => None,
    };
    LoadTable::new(
        replicas,
        cfg.block_size,
        Accounting {
            prompt_blocks_at_admission: cfg.load.prompt_blocks_at_admission,
            // kv_time reads decode load as the KV its steps read: every sequence reads its
            // whole context, a prefix shared with others included, so nothing is counted once.
            assume_kv_reuse: cfg.kv_load.assume_kv_reuse && cfg.policy != PolicyKind::KvTime,
            use_output_hint: cfg.load.use_output_hint,
            prefill_in_time: in_time,
        },
    )
}

impl Router {
    pub fn new(cfg: RoutingConfig, replicas: usize) -> Result<Router, ConfigError> {
        cfg.validate()?;
        if replicas == 0 || replicas > MAX_REPLICAS {
            return Err(ConfigError::routing(
                "replicas",
                format!("must be 1..={MAX_REPLICAS}, got {replicas}"),
            ));
        }
        let pa = &cfg.prefix_affinity;
        let policy = crate::policy::from_config(&cfg, replicas);
        let needs = policy.needs();
        Ok(Router {
            index: KvIndex::new(cfg.index_capacity_blocks, replicas, cfg.seed ^ 0xA5A5_5A5A),
            approx_seq: ApproxIndex::new(pa.capacity_blocks, pa.ttl_ms),
            approx_text: ApproxIndex::new(pa.capacity_blocks, pa.ttl_ms),
            load: if needs.prefill_head {
                load_table(&cfg, replicas).with_prefill_heads()
            } else {
                load_table(&cfg, replicas)
            },
            outputs: OutputEstimate::new(),
            reported: Reported::new(replicas, cfg.load.reported_load, cfg.block_size),
            clock_ms: 0,
            fleet: Fleet::new(replicas),
            health: Health::new(cfg.health.clone(), replicas),
            feeds: Feeds::new(replicas),
            decider: Decider {
                policy,
                needs,
                pd_rr: (0, 0),
                rng: SplitMix64::new(cfg.seed),
            },
            stats: RouterStats {
                policy: Some(cfg.policy),
                decisions: vec![0; replicas],
                ..RouterStats::default()
            },
            scratch: Scratch::default(),
            working_set: needs.working_set.is_some().then(|| {
                // A working set is described up to twice the index's share of a replica (the
                // index holds no more of its cache): a quarter of the index's entries in all,
                // being sampled.
                let max_blocks = 2 * (cfg.index_capacity_blocks / replicas).max(1024);
                WorkingSet::new(
                    replicas,
                    cfg.working_set.window_ms as u64,
                    max_blocks,
                    cfg.working_set.sampling(),
                )
            }),
            cfg,
        })
    }

    pub fn config(&self) -> &RoutingConfig {
        &self.cfg
    }

    /// Restarts the tie-break / softmax generator from `routing.seed` mixed with this proxy's
    /// identity ([`crate::rng::proxy_seed`]), so that independent proxies with the same configuration
    /// do not break ties identically. Only the generator changes (the KV index keeps its seed); call
    /// it before routing. An empty identity restores the configured seed's stream.
    pub fn set_proxy_identity(&mut self, identity: &[u8]) {
        self.decider.rng = SplitMix64::new(crate::rng::proxy_seed(self.cfg.seed, identity));
    }

    pub fn replicas(&self) -> usize {
        self.fleet.len()
    }

    /// Reads a request body with this router's block size and body limit.
    pub fn read_request(
        &self,
        path: &str,
        body: &[u8],
        session_key: Option<&str>,
    ) -> Result<RouteRequest, RequestError> {
        self.read_request_with(path, body, session_key, None)
    }

    /// [`Router::read_request`] with a tokenizer for text prompts (exact identity when it can). A
    /// request for a LoRA adapter (`routing.adapters`) is hashed in the adapter's namespace.
    pub fn read_request_with(
        &self,
        path: &str,
        body: &[u8],
        session_key: Option<&str>,
        tokenizer: Option<&mut dyn PromptTokenizer>,
    ) -> Result<RouteRequest, RequestError> {
        read_request_early(
            path,
            body,
            session_key,
            self.cfg.block_size,
            self.cfg.max_body_bytes,
            tokenizer,
            None,
            self.cfg.adapters.as_ref(),
        )
    }

    pub fn stats(&self) -> RouterStats {
        let mut s = self.stats.clone();
        s.release_anomalies = self.load.release_anomalies();
        s.active_requests = self.load.active() as u64;
        s.untracked_requests = self.load.untracked();
        s.index_blocks = self.index.len() as u64;
        s.index_capacity = self.index.capacity() as u64;
        s.index_evictions = self.index.evictions();
        s.index_heap_bytes = self.index.heap_bytes() as u64;
        s.approx_blocks = (self.approx_seq.len() + self.approx_text.len()) as u64;
        s.approx_evictions = self.approx_seq.evictions() + self.approx_text.evictions();
        s
    }

    /// The KV index (read-only; benches and tests).
    pub fn index(&self) -> &KvIndex {
        &self.index
    }
}

/// For the crate's tests: a completions request whose prompt is the tokens `0..tokens`, as `router`
/// reads it, and its blocks' hashes (what a feed reports for a replica that caches it).
#[cfg(test)]
pub(crate) fn token_prompt_request(
    router: &Router,
    tokens: u32,
) -> (crate::RouteRequest, Vec<u64>) {
    let prompt: Vec<u32> = (0..tokens).collect();
    let body = format!(
        r#"{{"prompt":{},"max_tokens":8}}"#,
        serde_json::to_string(&prompt).unwrap()
    );
    let req = router
        .read_request("/v1/completions", body.as_bytes(), None)
        .unwrap();
    let hashes = match &req.identity {
        crate::PromptIdentity::Exact(h) => h.iter().map(|h| h.0).collect(),
        other => panic!("token prompt expected, got {other:?}"),
    };
    (req, hashes)
}
