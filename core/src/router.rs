//! The router: the KV index, the approximate indexes, the token-load table and the policies together,
//! behind the API the proxy-wasm filter calls (see docs/design/core.md).
//!
//! Effective load of a replica, the input to every load-aware policy, by `kv_load.reported_load`:
//! - `ignore`: the router-tracked totals (this worker's plus its peers');
//! - `max`: those combined with what the replica itself last reported, taking the larger of the two
//!   for prefill tokens, decode blocks and active requests;
//! - `merge`: the report plus the bookings this proxy (this worker and its peers) made since the poll
//!   that produced the report went out ([`LoadTable::since`]), each field added: the report holds
//!   every proxy's traffic up to the poll, the bookings this proxy's since, so nothing counts twice
//!   (docs/design/design.md, "Many proxies");
//! - `others`: the router-tracked totals, as `ignore`, plus the rest of the report: the report less
//!   this proxy's requests it holds ([`LoadTable::held`], as they stood when the report came), so
//!   this proxy's own requests are counted once, by its own accounting, and the other proxies' by
//!   the replica.
//!
//! A *stale* replica (its feed failing) has its report ignored, and so does one that has not reported
//! yet: it is scored on the tracked totals. A stale replica's KV overlap is treated as zero.

use hashbrown::HashMap;

use crate::approx::ApproxIndex;
use crate::block::{SeqHash, TextHash};
use crate::config::{ConfigError, PolicyKind, ReportedLoad, RoutingConfig};
use crate::feed::{
    CursorVerdict, EventKind, FeedBatch, FeedCursor, FeedEvent, FeedQuery, FeedSlice, ReplicaLoad,
    Tier,
};
use crate::health::{Health, HealthCounts, Outcome};
use crate::index::{KvIndex, MAX_REPLICAS, TierCounts};
use crate::load::{Accounting, LoadTable, LoadTotals};
use crate::output::OutputEstimate;
use crate::pd::{self, PdDecision, PdError, PdParams, Role, round_robin_among};
pub use crate::policy::FallbackReason;
use crate::policy::kv_time::{self, Terms};
use crate::policy::{
    Choice, HashRing, Input, argmin_random_tie, kv_affinity, kv_load, least_load, masked,
    pick_lowest, prefix_affinity, round_robin, session_hash,
};
use crate::request::{
    EarlyScan, PromptIdentity, PromptTokenizer, RequestError, RouteRequest, read_request,
    read_request_early, read_request_with,
};
use crate::rng::SplitMix64;
use crate::speed::{EngineProfile, Speeds};
use crate::working_set::{self, WorkingSet};

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

/// Counters for metrics and reports.
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

/// The routing brain of one proxy worker.
#[derive(Clone, Debug)]
pub struct Router {
    cfg: RoutingConfig,
    replicas: usize,
    index: KvIndex,
    approx_seq: ApproxIndex<SeqHash>,
    approx_text: ApproxIndex<TextHash>,
    load: LoadTable,
    /// Output tokens per request, learned from this router's own releases.
    outputs: OutputEstimate,
    /// Per unit: the first unit with its address (`Router::set_address_groups`); empty: each its own.
    address_groups: Vec<usize>,
    peers: HashMap<u32, Vec<LoadTotals>>,
    /// Per peer worker: its bookings since each replica's report was polled, and what it released
    /// since then of requests the report holds (`merge`).
    peers_since: HashMap<u32, (Vec<LoadTotals>, Vec<LoadTotals>)>,
    /// Per peer worker: its requests each replica's current report holds (`others`).
    peers_held: HashMap<u32, Vec<LoadTotals>>,
    /// Per replica: this router's requests its current report holds, as they stood when the report
    /// was accepted (`others` takes them off the report: the report describes them then, not now).
    held_at_report: Vec<LoadTotals>,
    /// Per replica: this router's requests the current report holds (admitted before its poll) and
    /// that have been released since: `merge` takes them off the report.
    released_since: Vec<LoadTotals>,
    reported: Vec<Option<ReplicaLoad>>,
    /// Per replica: when the poll that produced `reported` was sent (router clock, ms).
    report_polled_ms: Vec<u64>,
    /// The latest time this router was given (route, admit): the poll time of a report accepted
    /// without one.
    clock_ms: u64,
    stale: Vec<bool>,
    /// Replicas believed unreachable (their feed cannot even be connected to): avoided by every
    /// policy while any other replica is up.
    down: Vec<bool>,
    /// Health learned from completions: replicas ejected for failing.
    health: Health,
    cursors: Vec<FeedCursor>,
    ring: HashRing,
    rr_next: usize,
    /// Round-robin positions of the P/D sides (prefill, decode): apart from `rr_next`, so a P/D
    /// fleet's two cycles do not disturb each other ([`Router::route_pd`]).
    pd_rr: (usize, usize),
    rng: SplitMix64,
    stats: RouterStats,
    scratch_tiers: Vec<TierCounts>,
    scratch_approx: Vec<u32>,
    /// The request's working-set sample ([`working_set::Sampling`]), kept from route to admit by
    /// [`Router::route_and_admit`] so the blocks are sampled once, in a buffer that is reused.
    scratch_sampled: Vec<u64>,
    /// Recent prompt blocks per replica, kept when `kv_load.overflow_weight` is set.
    working_set: Option<WorkingSet>,
    /// Per replica: its cache's size as learned from the feed.
    cache_blocks: Vec<CacheSize>,
    /// `kv_time`'s engine profile and each replica's learned speed against it.
    profile: EngineProfile,
    speeds: Speeds,
    /// `kv_time`: every replica's cost terms for the last request routed (for the admit that
    /// follows, and for explaining the decision).
    last_terms: Vec<Terms>,
    /// `kv_time`: requests admitted and not yet at their first token: replica, predicted time to
    /// first token at the profile's speed (s), admission time (ms). Bounded by
    /// [`MAX_PENDING_PREDICTIONS`].
    pending: HashMap<u64, (usize, f64, u64)>,
    /// `last_terms` belong to a request not admitted yet.
    terms_unadmitted: bool,
}

/// Most admitted requests whose first token `kv_time` waits for to learn a speed: past it, new
/// requests are not learned from (a proxy that loses stream ends would otherwise grow it forever).
pub const MAX_PENDING_PREDICTIONS: usize = 1 << 16;

/// A replica's cache size as the feed shows it: the most blocks it has held, which is its size once
/// it has evicted (before that, only a lower bound).
#[derive(Clone, Copy, Debug, Default)]
struct CacheSize {
    most_held: u64,
    evicted: bool,
}

impl Router {
    pub fn new(cfg: RoutingConfig, replicas: usize) -> Result<Router, ConfigError> {
        cfg.validate()?;
        if replicas == 0 || replicas > MAX_REPLICAS {
            return Err(ConfigError {
                field: "replicas".into(),
                message: format!("must be 1..={MAX_REPLICAS}, got {replicas}"),
            });
        }
        let pa = &cfg.prefix_affinity;
        let profile = cfg.kv_time.profile.profile();
        let in_time = match cfg.policy {
            PolicyKind::KvLoad if cfg.kv_load.queue_in_time_active() => {
                Some(cfg.kv_load.attention_context_tokens as u64)
            }
            PolicyKind::KvTime => Some(profile.attention_context_tokens().min(1e15) as u64),
            _ => None,
        };
        let working_set_on = match cfg.policy {
            PolicyKind::KvLoad => cfg.kv_load.overflow_weight > 0.0,
            PolicyKind::KvTime => cfg.kv_time.evict_weight > 0.0,
            _ => false,
        };
        Ok(Router {
            speeds: Speeds::new(
                replicas,
                cfg.kv_time.speed_halflife,
                cfg.kv_time.speed_bound,
            ),
            profile,
            last_terms: Vec::new(),
            terms_unadmitted: false,
            pending: HashMap::new(),
            index: KvIndex::new(cfg.index_capacity_blocks, replicas, cfg.seed ^ 0xA5A5_5A5A),
            approx_seq: ApproxIndex::new(pa.capacity_blocks, pa.ttl_ms),
            approx_text: ApproxIndex::new(pa.capacity_blocks, pa.ttl_ms),
            load: LoadTable::new(
                replicas,
                cfg.block_size,
                Accounting {
                    prompt_blocks_at_admission: cfg.kv_load.prompt_blocks_at_admission,
                    // kv_time reads decode load as the KV its steps read: every sequence reads its
                    // whole context, a prefix shared with others included, so nothing is counted once.
                    assume_kv_reuse: cfg.kv_load.assume_kv_reuse
                        && cfg.policy != PolicyKind::KvTime,
                    use_output_hint: cfg.kv_load.use_output_hint,
                    prefill_in_time: in_time,
                },
            ),
            outputs: OutputEstimate::new(),
            address_groups: Vec::new(),
            peers: HashMap::new(),
            peers_since: HashMap::new(),
            peers_held: HashMap::new(),
            held_at_report: vec![LoadTotals::default(); replicas],
            reported: vec![None; replicas],
            report_polled_ms: vec![u64::MAX; replicas],
            released_since: vec![LoadTotals::default(); replicas],
            clock_ms: 0,
            stale: vec![false; replicas],
            down: vec![false; replicas],
            health: Health::new(cfg.health.clone(), replicas),
            cursors: vec![FeedCursor::default(); replicas],
            ring: HashRing::seeded(
                0..replicas,
                cfg.session_hash.virtual_nodes,
                cfg.session_hash.ring_seed,
            ),
            rr_next: 0,
            pd_rr: (0, 0),
            rng: SplitMix64::new(cfg.seed),
            stats: RouterStats {
                policy: Some(cfg.policy),
                decisions: vec![0; replicas],
                ..RouterStats::default()
            },
            scratch_tiers: Vec::new(),
            scratch_approx: Vec::new(),
            scratch_sampled: Vec::new(),
            cache_blocks: vec![CacheSize::default(); replicas],
            working_set: working_set_on.then(|| {
                // A working set is described up to twice the index's share of a replica (the
                // index holds no more of its cache): a quarter of the index's entries in all,
                // being sampled.
                let max_blocks = 2 * (cfg.index_capacity_blocks / replicas).max(1024);
                WorkingSet::new(
                    replicas,
                    cfg.kv_load.working_set_window_ms as u64,
                    max_blocks,
                    cfg.kv_load.sampling(),
                )
            }),
            replicas,
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
        self.rng = SplitMix64::new(crate::rng::proxy_seed(self.cfg.seed, identity));
    }
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// Reads a request body with this router's block size and body limit.
    pub fn read_request(
        &self,
        path: &str,
        body: &[u8],
        session_key: Option<&str>,
    ) -> Result<RouteRequest, RequestError> {
        read_request(
            path,
            body,
            session_key,
            self.cfg.block_size,
            self.cfg.max_body_bytes,
        )
    }

    /// [`Router::read_request`] with a tokenizer for text prompts (exact identity when it can).
    pub fn read_request_with(
        &self,
        path: &str,
        body: &[u8],
        session_key: Option<&str>,
        tokenizer: Option<&mut dyn PromptTokenizer>,
    ) -> Result<RouteRequest, RequestError> {
        read_request_with(
            path,
            body,
            session_key,
            self.cfg.block_size,
            self.cfg.max_body_bytes,
            tokenizer,
        )
    }

    /// Effective load per replica (see the module docs).
    pub fn effective_load(&self) -> Vec<LoadTotals> {
        let mut eff = self.load.combined(self.peers.values().map(Vec::as_slice));
        let mode = self.cfg.kv_load.reported_load;
        if mode == ReportedLoad::Ignore {
            return eff;
        }
        // Per replica, what meets the report: for `merge` this proxy's bookings since the poll
        // (added) and what it released since of the report's requests (taken off); for `others`
        // its requests the report holds, as accepted (taken off).
        let (own, released) = match mode {
            ReportedLoad::Merge => {
                let mut since = self.load.since(&self.report_polled_ms);
                let mut gone = self.released_since.clone();
                for (p, g) in self.peers_since.values() {
                    LoadTotals::add_each(&mut since, p);
                    LoadTotals::add_each(&mut gone, g);
                }
                (since, gone)
            }
            ReportedLoad::Others => {
                let mut held = self.held_at_report.clone();
                for p in self.peers_held.values() {
                    LoadTotals::add_each(&mut held, p);
                }
                (held, Vec::new())
            }
            _ => (Vec::new(), Vec::new()),
        };
        for (r, e) in eff.iter_mut().enumerate() {
            if self.stale[r] {
                continue;
            }
            if let Some(rep) = &self.reported[r] {
                let decode = if rep.block_size > 0 && rep.block_size as usize != self.cfg.block_size
                {
                    (rep.decode_blocks as u128 * rep.block_size as u128
                        / self.cfg.block_size as u128)
                        .min(u64::MAX as u128) as u64
                } else {
                    rep.decode_blocks
                };
                let active = rep.running.saturating_add(rep.waiting);
                let report = LoadTotals {
                    prefill_tokens: rep.prefill_tokens,
                    decode_blocks: decode,
                    active_requests: active,
                };
                if mode == ReportedLoad::Merge {
                    let mut m = report;
                    m.add(&own[r]);
                    m.sub(&released[r]);
                    *e = m;
                } else if mode == ReportedLoad::Others {
                    // Less this proxy's requests the report holds, the rest is the other proxies'
                    // (and what the report counts that the bookings do not).
                    let mut rest = report;
                    rest.sub(&own[r]);
                    e.add(&rest);
                } else {
                    e.prefill_tokens = e.prefill_tokens.max(rep.prefill_tokens);
                    e.decode_blocks = e.decode_blocks.max(decode);
                    e.active_requests = e.active_requests.max(active);
                }
            }
        }
        eff
    }

    /// Tier-weighted overlap in blocks per replica for the request's identity.
    fn overlap_blocks(&mut self, req: &RouteRequest, now_ms: u64) -> Vec<f64> {
        let k = &self.cfg.kv_load;
        match &req.identity {
            PromptIdentity::Exact(hashes) => {
                let mut tiers = std::mem::take(&mut self.scratch_tiers);
                self.index.match_prefix(hashes, &mut tiers);
                let out = tiers
                    .iter()
                    .enumerate()
                    .map(|(r, c)| {
                        if self.stale[r] {
                            0.0
                        } else {
                            c[0] as f64
                                + k.host_tier_credit * c[1] as f64
                                + k.disk_tier_credit * c[2] as f64
                        }
                    })
                    .collect();
                self.scratch_tiers = tiers;
                out
            }
            PromptIdentity::Approximate(hashes) => {
                let mut m = std::mem::take(&mut self.scratch_approx);
                self.approx_text
                    .match_prefix(hashes, now_ms, self.replicas, &mut m);
                let out = m.iter().map(|&b| b as f64).collect();
                self.scratch_approx = m;
                out
            }
        }
    }

    /// Chooses a replica for a request. Does not admit it: call [`Router::admit`] once the request is
    /// really sent there.
    pub fn route(&mut self, req: &RouteRequest, now_ms: u64) -> Decision {
        let mut sampled = std::mem::take(&mut self.scratch_sampled);
        self.sample_blocks(req, &mut sampled);
        let d = self.route_sampled(req, now_ms, &sampled);
        self.scratch_sampled = sampled;
        d
    }

    /// The request's blocks the working set samples, into `out` (left empty with the term off).
    fn sample_blocks(&self, req: &RouteRequest, out: &mut Vec<u64>) {
        out.clear();
        if let Some(ws) = &self.working_set {
            // Over the slice itself: `PromptIdentity::key` would match on the kind at every block.
            let sampling = ws.sampling();
            let keep = |k: &u64| sampling.keeps(*k);
            match &req.identity {
                PromptIdentity::Exact(h) => out.extend(h.iter().map(|h| h.0).filter(keep)),
                PromptIdentity::Approximate(h) => out.extend(h.iter().map(|h| h.0).filter(keep)),
            }
        }
    }

    /// [`Router::route`] with the request's working-set sample taken already.
    fn route_sampled(&mut self, req: &RouteRequest, now_ms: u64, sampled: &[u64]) -> Decision {
        self.clock_ms = self.clock_ms.max(now_ms);
        let bs = self.cfg.block_size as f64;
        let request_blocks = (req.prompt_tokens as f64 / bs).ceil();
        let overlap = self.overlap_blocks(req, now_ms);
        let eff = self.effective_load();
        self.health.refresh(now_ms);
        let avoided = self.avoided();
        let policy = self.cfg.policy;
        let active_prefix: Vec<f64> =
            if policy == PolicyKind::KvLoad && self.cfg.kv_load.assume_kv_reuse {
                let (n, id) = (req.identity.blocks(), &req.identity);
                (0..self.replicas)
                    .map(|r| self.load.active_prefix_by(r, n, |i| id.key(i)) as f64)
                    .collect()
            } else {
                Vec::new()
            };
        let mut affinity = std::mem::take(&mut self.scratch_approx);
        affinity.clear();
        if policy == PolicyKind::PrefixAffinity {
            match &req.identity {
                PromptIdentity::Exact(h) => {
                    self.approx_seq
                        .match_prefix(h, now_ms, self.replicas, &mut affinity)
                }
                PromptIdentity::Approximate(h) => {
                    self.approx_text
                        .match_prefix(h, now_ms, self.replicas, &mut affinity)
                }
            }
        }
        if let Some(ws) = &mut self.working_set {
            ws.expire(now_ms);
        }
        let working_set: Vec<(f64, f64, f64)> = match &self.working_set {
            Some(ws) => {
                let added = ws.added(sampled);
                (0..self.replicas)
                    .map(|r| {
                        let add = added.get(r).copied().unwrap_or(0.0);
                        let cap = if policy == PolicyKind::KvTime {
                            self.kv_time_cache_blocks(r)
                        } else {
                            self.cache_size_blocks(r)
                        };
                        (ws.blocks(r), add, cap)
                    })
                    .collect()
            }
            _ => Vec::new(),
        };
        let (speed, reuse_share) = match (policy, &self.working_set) {
            (PolicyKind::KvTime, Some(ws)) => (self.speeds.factors(), ws.reuse_share()),
            (PolicyKind::KvTime, None) => (self.speeds.factors(), 0.0),
            _ => (Vec::new(), 0.0),
        };
        let floor = self.cfg.kv_load.overflow_reuse_floor;
        let working_set_scale = match &self.working_set {
            Some(ws) if floor > 0.0 => kv_load::reuse_ramp(ws.reuse_share(), floor),
            _ => 1.0,
        };
        let input = Input {
            working_set: &working_set,
            working_set_scale,
            request_blocks,
            block_size: bs,
            load: &eff,
            overlap: &overlap,
            active_prefix: &active_prefix,
            affinity: &affinity,
            identity_blocks: req.identity.blocks(),
            session_key: req.session_key.as_deref(),
            avoided: &avoided,
            expected_output_tokens: self.outputs.expected(),
            speed: &speed,
            reuse_share,
        };
        let k = &self.cfg.kv_load;
        let rng = &mut self.rng;
        let Choice {
            replica,
            costs,
            fallback,
        } = match policy {
            PolicyKind::RoundRobin => round_robin::choose(&input, &mut self.rr_next),
            PolicyKind::LeastLoad => least_load::choose(&input, k, rng),
            PolicyKind::SessionHash => session_hash::choose(&input, &self.ring, k, rng),
            PolicyKind::PrefixAffinity => {
                prefix_affinity::choose(&input, self.cfg.prefix_affinity.match_threshold, k, rng)
            }
            PolicyKind::KvAffinity => kv_affinity::choose(&input, rng),
            PolicyKind::KvLoad => kv_load::choose(&input, k, rng),
            PolicyKind::KvTime => {
                let (c, terms) = kv_time::choose(&input, &self.cfg.kv_time, &self.profile, rng);
                self.last_terms = terms;
                self.terms_unadmitted = true;
                c
            }
        };
        self.scratch_approx = affinity;
        // An ejected replica's probe, when one is due, takes this request; the policy's choice
        // becomes its backup (Envoy retries a failed probe there).
        let down = &self.down;
        let probe = self
            .health
            .take_probe(now_ms, |r| !down.get(r).copied().unwrap_or(true));
        let (replica, probe_backup) = match probe {
            Some(p) if p != replica => (p, Some(replica)),
            _ => (replica, None),
        };
        let matched_tokens: Vec<u64> = overlap
            .iter()
            .map(|&o| ((o * bs) as u64).min(req.prompt_tokens))
            .collect();
        self.count_decision(
            replica,
            fallback,
            req.prompt_tokens,
            matched_tokens[replica],
        );
        let backup = probe_backup.or_else(|| self.backup_for(replica, &costs));
        Decision {
            replica,
            policy,
            fallback,
            prompt_tokens: req.prompt_tokens,
            matched_tokens,
            costs,
            backup,
            probe: probe.is_some(),
        }
    }

    /// Chooses both ends of a P/D request (crate::pd, docs/design/pd.md): a prefill replica among those
    /// whose role prefills, a decode replica among those whose role decodes. Replicas down or
    /// ejected are avoided while the side has another. Does not admit: call [`Router::admit_pd`].
    pub fn route_pd(
        &mut self,
        req: &RouteRequest,
        roles: &[Role],
        params: &PdParams,
        now_ms: u64,
    ) -> Result<PdDecision, PdError> {
        if roles.len() != self.replicas {
            return Err(PdError::RolesLength {
                roles: roles.len(),
                replicas: self.replicas,
            });
        }
        if !roles.iter().any(|r| r.prefills()) {
            return Err(PdError::NoPrefillReplica);
        }
        if !roles.iter().any(|r| r.decodes()) {
            return Err(PdError::NoDecodeReplica);
        }
        self.clock_ms = self.clock_ms.max(now_ms);
        let bs = self.cfg.block_size as f64;
        let request_blocks = (req.prompt_tokens as f64 / bs).ceil();
        let overlap = self.overlap_blocks(req, now_ms);
        self.health.refresh(now_ms);
        let usable: Vec<bool> = (0..self.replicas).map(|r| self.is_usable(r)).collect();
        // A side avoids unusable replicas unless it has no usable one.
        let side_avoided = |takes: &dyn Fn(Role) -> bool| -> Vec<bool> {
            let any = (0..roles.len()).any(|r| takes(roles[r]) && usable[r]);
            (0..roles.len())
                .map(|r| !takes(roles[r]) || (any && !usable[r]))
                .collect()
        };
        let p_avoided = side_avoided(&|r: Role| r.prefills());
        let d_avoided = side_avoided(&|r: Role| r.decodes());
        let (prefill, decode, prefill_costs, decode_costs) = if self.cfg.policy
            == PolicyKind::RoundRobin
        {
            let n = self.replicas;
            let p = round_robin_among(n, &mut self.pd_rr.0, |r| !p_avoided[r]);
            let d = round_robin_among(n, &mut self.pd_rr.1, |r| !d_avoided[r]);
            (p, d, Vec::new(), Vec::new())
        } else {
            let eff = self.effective_load();
            let in_time = self.load.accounting().prefill_in_time;
            let pc = pd::prefill_costs(request_blocks, bs, &overlap, &eff, roles, params, in_time);
            let dc = pd::decode_costs(request_blocks, &overlap, &eff, roles, params);
            let p = argmin_random_tie(&masked(&pc, &p_avoided), &mut self.rng);
            let d = argmin_random_tie(&masked(&dc, &d_avoided), &mut self.rng);
            (p, d, pc, dc)
        };
        // Both sides have an eligible replica (checked above), so neither is None; stay total anyway.
        let prefill = prefill.ok_or(PdError::NoPrefillReplica)?;
        let decode = decode.ok_or(PdError::NoDecodeReplica)?;
        let matched = |r: usize| ((overlap[r] * bs) as u64).min(req.prompt_tokens);
        // An ejected replica's probe, when one is due, takes its side's leg; the side's own choice
        // becomes the backup. One probe per side and request, never the same replica for both.
        let down = &self.down;
        let up = |r: usize| !down.get(r).copied().unwrap_or(true);
        let p_probe = self
            .health
            .take_probe(now_ms, |r| roles[r].prefills() && up(r))
            .filter(|&p| p != prefill);
        let (prefill, prefill_backup, prefill_probe) = match p_probe {
            Some(p) => (p, Some(prefill), true),
            None => {
                let retry = self.backup_among(prefill, &prefill_costs, |r| roles[r].prefills());
                (prefill, retry, false)
            }
        };
        let prefill_backup = prefill_backup.map(|b| (b, matched(b)));
        let d_probe = self
            .health
            .take_probe(now_ms, |r| roles[r].decodes() && up(r) && r != prefill)
            .filter(|&d| d != decode);
        let (decode, decode_backup) = match d_probe {
            Some(d) => (d, Some(decode)),
            None => (decode, None),
        };
        let prefill_matched_tokens = matched(prefill);
        self.count_decision(prefill, None, req.prompt_tokens, prefill_matched_tokens);
        Ok(PdDecision {
            prefill,
            decode,
            prompt_tokens: req.prompt_tokens,
            prefill_matched_tokens,
            transfer_tokens: req.prompt_tokens - matched(decode),
            prefill_costs,
            decode_costs,
            prefill_backup,
            prefill_probe,
            decode_backup,
        })
    }

    /// The decode leg of a P/D decision as a [`Decision`] (what a proxy writes as the destination),
    /// with a retry backup among the other replicas that decode: the cheapest by the decode score,
    /// or the next one under round robin, skipping replicas down or ejected while another decodes.
    /// Any decode replica can take a decode leg: the prefill answer's `kv_transfer_params` name the
    /// producer, not the consumer.
    pub fn pd_decode_decision(&self, d: &PdDecision, roles: &[Role]) -> Decision {
        let decodes = |r: usize| roles.get(r).is_some_and(|x| x.decodes());
        let n = self.replicas;
        let candidates = |usable_only: bool| {
            (1..n)
                .map(move |i| (d.decode + i) % n)
                .filter(move |&r| decodes(r) && (!usable_only || self.is_usable(r)))
        };
        let cheapest = |usable_only: bool| {
            if d.decode_costs.len() == n {
                candidates(usable_only)
                    .min_by(|&a, &b| d.decode_costs[a].total_cmp(&d.decode_costs[b]))
            } else {
                candidates(usable_only).next()
            }
        };
        let backup = d
            .decode_backup
            .or_else(|| cheapest(true))
            .or_else(|| cheapest(false));
        Decision {
            replica: d.decode,
            policy: self.cfg.policy,
            fallback: None,
            prompt_tokens: d.prompt_tokens,
            matched_tokens: Vec::new(),
            costs: d.decode_costs.clone(),
            backup,
            probe: d.decode_backup.is_some(),
        }
    }

    /// [`Router::route_unread`] in a P/D fleet: a request whose body cannot be split into two legs
    /// goes whole, by load, to a replica that decodes (it computes the prompt itself), never to a
    /// prefill-only one. Replicas down or ejected are avoided while another decodes.
    pub fn route_unread_pd(
        &mut self,
        request_id: u64,
        body_bytes: usize,
        roles: &[Role],
        now_ms: u64,
    ) -> Decision {
        self.clock_ms = self.clock_ms.max(now_ms);
        let eff = self.effective_load();
        self.health.refresh(now_ms);
        let costs = least_load::costs(&eff, self.cfg.block_size as f64, 0.0, &self.cfg.kv_load);
        let decodes = |r: usize| roles.get(r).is_none_or(|x| x.decodes());
        let base = self.avoided();
        let any = (0..self.replicas).any(|r| decodes(r) && !base[r]);
        let avoided: Vec<bool> = (0..self.replicas)
            .map(|r| !decodes(r) || (any && base[r]))
            .collect();
        let replica = pick_lowest(&costs, &avoided, &mut self.rng);
        let backup = (0..self.replicas)
            .filter(|&r| r != replica && !avoided[r])
            .min_by(|&a, &b| costs[a].total_cmp(&costs[b]));
        self.count_decision(replica, Some(FallbackReason::BodyUnreadable), 0, 0);
        let d = Decision {
            replica,
            policy: self.cfg.policy,
            fallback: Some(FallbackReason::BodyUnreadable),
            prompt_tokens: 0,
            matched_tokens: Vec::new(),
            costs,
            backup,
            probe: false,
        };
        self.admit_unread(request_id, &d, (body_bytes / 4) as u64);
        d
    }

    /// Starts tracking both legs of a P/D request: the prefill leg under `prefill_id` on the prefill
    /// replica (its uncached prompt as prefill load, one output token), the decode leg under
    /// `decode_id` on the decode replica (the prompt's blocks as its KV; one token of prefill, the
    /// last prompt token it computes itself). Release each leg when it ends.
    pub fn admit_pd(
        &mut self,
        prefill_id: u64,
        decode_id: u64,
        req: &RouteRequest,
        d: &PdDecision,
        now_ms: u64,
    ) {
        if d.prefill >= self.replicas || d.decode >= self.replicas {
            self.stats.bad_replica += 1;
            return;
        }
        self.admit_prefill_leg(prefill_id, req, d.prefill, d.prefill_matched_tokens, now_ms);
        let keys = || (0..req.identity.blocks()).map(|i| req.identity.key(i));
        self.load.admit_at(
            decode_id,
            d.decode,
            req.prompt_tokens,
            1,
            req.output_hint,
            keys(),
            now_ms,
        );
    }

    /// Books a P/D request's prefill leg alone under `prefill_id` on `replica` (its uncached prompt
    /// as prefill load, one output token): [`Router::admit_pd`]'s first half, and how a prefill leg
    /// moved to the backup after a failed probe is booked again.
    pub fn admit_prefill_leg(
        &mut self,
        prefill_id: u64,
        req: &RouteRequest,
        replica: usize,
        matched_tokens: u64,
        now_ms: u64,
    ) {
        if replica >= self.replicas {
            self.stats.bad_replica += 1;
            return;
        }
        self.clock_ms = self.clock_ms.max(now_ms);
        let uncached = req.prompt_tokens.saturating_sub(matched_tokens);
        self.load.admit_at(
            prefill_id,
            replica,
            req.prompt_tokens,
            uncached,
            Some(1),
            (0..req.identity.blocks()).map(|i| req.identity.key(i)),
            now_ms,
        );
    }

    /// Usable: neither down nor ejected for failing.
    fn is_usable(&self, r: usize) -> bool {
        !self.down.get(r).copied().unwrap_or(true) && !self.health.is_ejected(r)
    }

    /// The replicas to avoid, as the policies take them: those not usable while some replica is;
    /// with none usable, those down while some replica is up (an ejected replica beats a dead one);
    /// with all down, none.
    fn avoided(&self) -> Vec<bool> {
        if (0..self.replicas).any(|r| self.is_usable(r)) {
            (0..self.replicas).map(|r| !self.is_usable(r)).collect()
        } else if self.down.iter().all(|&d| d) {
            vec![false; self.replicas]
        } else {
            self.down.clone()
        }
    }

    /// Tells the router which units share an address (`groups[unit]` equal): the data-parallel ranks
    /// of one endpoint. A retry goes to an address with the first choice's headers, so a backup on
    /// the chosen unit's own address would retry the same engine; the backup is taken from another
    /// address whenever one is usable. Ignored unless it names every unit.
    pub fn set_address_groups(&mut self, groups: Vec<usize>) {
        if groups.len() == self.replicas {
            self.address_groups = groups;
        }
    }

    fn backup_for(&self, chosen: usize, costs: &[f64]) -> Option<usize> {
        self.backup_among(chosen, costs, |_| true)
    }

    /// The backup for `chosen` among the replicas `eligible` accepts: the cheapest by `costs` (the
    /// next one cyclically when there are no costs, as under round robin), never an avoided one,
    /// and on another address whenever one is usable.
    fn backup_among(
        &self,
        chosen: usize,
        costs: &[f64],
        eligible: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let avoided = self.avoided();
        let group = |r: usize| self.address_groups.get(r).copied().unwrap_or(r);
        let ok = |r: usize| r != chosen && !avoided[r] && eligible(r);
        let elsewhere = (0..self.replicas).any(|r| ok(r) && group(r) != group(chosen));
        let fits = |r: usize| ok(r) && (!elsewhere || group(r) != group(chosen));
        if costs.len() == self.replicas {
            (0..self.replicas)
                .filter(|&r| fits(r))
                .min_by(|&a, &b| costs[a].total_cmp(&costs[b]))
        } else {
            (1..self.replicas)
                .map(|i| (chosen + i) % self.replicas)
                .find(|&r| fits(r))
        }
    }

    fn count_decision(
        &mut self,
        replica: usize,
        fallback: Option<FallbackReason>,
        prompt: u64,
        matched: u64,
    ) {
        self.stats.decisions[replica] += 1;
        self.stats.prompt_tokens += prompt;
        self.stats.matched_tokens += matched;
        match fallback {
            Some(FallbackReason::NoSessionKey) => self.stats.fallback_no_session_key += 1,
            Some(FallbackReason::BelowMatchThreshold) => {
                self.stats.fallback_below_match_threshold += 1
            }
            Some(FallbackReason::BodyUnreadable) => self.stats.fallback_body_unreadable += 1,
            None => {}
        }
    }

    /// Routes a read request and admits it under `request_id`: "route then admit" in one step, as the
    /// filter, the component and the playground all do it (a decision that is not admitted leaves the
    /// load table blind to the request).
    pub fn route_and_admit(
        &mut self,
        request_id: u64,
        req: &RouteRequest,
        now_ms: u64,
    ) -> Decision {
        let mut sampled = std::mem::take(&mut self.scratch_sampled);
        self.sample_blocks(req, &mut sampled);
        let d = self.route_sampled(req, now_ms, &sampled);
        self.admit_sampled(request_id, req, &d, now_ms, &sampled);
        self.scratch_sampled = sampled;
        d
    }

    /// Routes a request whose body was not read (absent, too large, refused by the host) by load
    /// alone, and admits it with its prompt estimated at 4 body bytes a token (the ratio of the
    /// approximate text identity).
    pub fn route_unread(&mut self, request_id: u64, body_bytes: usize, now_ms: u64) -> Decision {
        let d = self.route_fallback(now_ms);
        self.admit_unread(request_id, &d, (body_bytes / 4) as u64);
        d
    }

    /// Reads a body and routes it, admitting it under `request_id`; a body the parser refuses (too
    /// large, not JSON, no prompt, ...) is routed by [`Router::route_unread`] instead, and the error
    /// comes back beside the decision so the caller can count it. Never fails to decide.
    pub fn route_body(
        &mut self,
        request_id: u64,
        path: &str,
        body: &[u8],
        session_key: Option<&str>,
        tokenizer: Option<&mut dyn PromptTokenizer>,
        now_ms: u64,
    ) -> (Decision, Option<RequestError>) {
        self.route_body_early(request_id, path, body, session_key, tokenizer, None, now_ms)
    }

    /// [`Router::route_body`] for a body an [`EarlyScan`] followed as it arrived (the same decision;
    /// the ids the scan read are not read again).
    #[allow(clippy::too_many_arguments)]
    pub fn route_body_early(
        &mut self,
        request_id: u64,
        path: &str,
        body: &[u8],
        session_key: Option<&str>,
        tokenizer: Option<&mut dyn PromptTokenizer>,
        early: Option<EarlyScan>,
        now_ms: u64,
    ) -> (Decision, Option<RequestError>) {
        let read = read_request_early(
            path,
            body,
            session_key,
            self.cfg.block_size,
            self.cfg.max_body_bytes,
            tokenizer,
            early,
        );
        match read {
            Ok(req) => (self.route_and_admit(request_id, &req, now_ms), None),
            Err(e) => (self.route_unread(request_id, body.len(), now_ms), Some(e)),
        }
    }

    /// A load-only choice for a request whose body could not be read (too large, not JSON, ...).
    pub fn route_fallback(&mut self, now_ms: u64) -> Decision {
        self.clock_ms = self.clock_ms.max(now_ms);
        let eff = self.effective_load();
        self.health.refresh(now_ms);
        let costs = least_load::costs(&eff, self.cfg.block_size as f64, 0.0, &self.cfg.kv_load);
        let replica = pick_lowest(&costs, &self.avoided(), &mut self.rng);
        let backup = self.backup_for(replica, &costs);
        self.count_decision(replica, Some(FallbackReason::BodyUnreadable), 0, 0);
        Decision {
            replica,
            policy: self.cfg.policy,
            fallback: Some(FallbackReason::BodyUnreadable),
            prompt_tokens: 0,
            matched_tokens: Vec::new(),
            costs,
            backup,
            probe: false,
        }
    }

    /// Starts tracking a request sent where `d` says: its uncached prompt tokens become prefill load,
    /// and its prefix is recorded in the approximate index (a token prompt's only under
    /// `prefix_affinity`, the one reader of those records; a text prompt's always, as the overlap
    /// estimate of text prompts).
    pub fn admit(&mut self, request_id: u64, req: &RouteRequest, d: &Decision, now_ms: u64) {
        let mut sampled = std::mem::take(&mut self.scratch_sampled);
        self.sample_blocks(req, &mut sampled);
        self.admit_sampled(request_id, req, d, now_ms, &sampled);
        self.scratch_sampled = sampled;
    }

    /// [`Router::admit`] with the request's working-set sample taken already.
    fn admit_sampled(
        &mut self,
        request_id: u64,
        req: &RouteRequest,
        d: &Decision,
        now_ms: u64,
        sampled: &[u64],
    ) {
        if d.replica >= self.replicas {
            self.stats.bad_replica += 1;
            return;
        }
        self.clock_ms = self.clock_ms.max(now_ms);
        if let Some(ws) = &mut self.working_set {
            ws.record(d.replica, sampled, now_ms);
        }
        let matched = d.matched_tokens.get(d.replica).copied().unwrap_or(0);
        let uncached = req.prompt_tokens.saturating_sub(matched);
        if let Some(t) = self.last_terms.get(d.replica)
            && std::mem::take(&mut self.terms_unadmitted)
            && self.pending.len() < MAX_PENDING_PREDICTIONS
        {
            // The prediction at the profile's speed, so the observation measures the factor.
            let at_profile = t.ttft() / self.speeds.factor(d.replica);
            self.pending
                .insert(request_id, (d.replica, at_profile, now_ms));
        }

        self.load.admit_at(
            request_id,
            d.replica,
            req.prompt_tokens,
            uncached,
            req.output_hint,
            (0..req.identity.blocks()).map(|i| req.identity.key(i)),
            now_ms,
        );
        match &req.identity {
            // Token prompts' own decisions are read back only by `prefix_affinity` (`route`; the
            // other policies take a token prompt's overlap from the KV index), and the policy is
            // fixed for the router's life, so under any other policy recording them is pure cost:
            // a third of an 8K-token request's admit and ~10% of its whole filter path in wasm.
            PromptIdentity::Exact(h) => {
                if self.cfg.policy == PolicyKind::PrefixAffinity {
                    self.approx_seq.record(d.replica, h, now_ms)
                }
            }
            PromptIdentity::Approximate(h) => self.approx_text.record(d.replica, h, now_ms),
        }
    }

    /// Starts tracking a request routed by [`Router::route_fallback`], whose prompt size is only
    /// estimated (e.g. body bytes / 4).
    pub fn admit_unread(&mut self, request_id: u64, d: &Decision, estimated_prompt_tokens: u64) {
        if d.replica >= self.replicas {
            self.stats.bad_replica += 1;
            return;
        }
        self.load.admit_at(
            request_id,
            d.replica,
            estimated_prompt_tokens,
            estimated_prompt_tokens,
            None,
            [],
            self.clock_ms,
        );
    }

    pub fn first_token(&mut self, request_id: u64) {
        self.load.first_token(request_id);
    }

    /// The first token arrived at `now_ms`: [`Router::first_token`], and `kv_time` learns the
    /// replica's speed from it (observed time to first token against the prediction at admission).
    pub fn first_token_at(&mut self, request_id: u64, now_ms: u64) {
        self.load.first_token(request_id);
        if let Some((replica, predicted_s, admitted_ms)) = self.pending.remove(&request_id) {
            let observed_s = now_ms.saturating_sub(admitted_ms) as f64 / 1e3;
            self.speeds.observe(replica, predicted_s, observed_s);
        }
    }

    /// `kv_time`: every replica's cost terms for the last request routed (empty under another
    /// policy): what an operator reads to see why a replica won.
    pub fn last_terms(&self) -> &[Terms] {
        &self.last_terms
    }

    /// `kv_time`: one replica's learned time factor against the profile (2: twice as slow; 1 for an
    /// unknown replica or under another policy).
    pub fn speed_factor(&self, replica: usize) -> f64 {
        self.speeds.factor(replica)
    }

    /// `kv_time`'s view of a replica's cache in blocks: as learned from its feed once it has evicted,
    /// else the larger of what it has held and the profile's cache (a replica that has not shown
    /// its size yet is priced like one of its profile, not as one with room for everything).
    fn kv_time_cache_blocks(&self, replica: usize) -> f64 {
        let profile = self.profile.kv_cache_tokens / self.cfg.block_size as f64;
        match self.cache_blocks.get(replica) {
            Some(c) if c.evicted => c.most_held as f64,
            Some(c) => profile.max(c.most_held as f64),
            None => profile,
        }
    }

    /// `generated_tokens`: cumulative output tokens so far.
    pub fn decode_progress(&mut self, request_id: u64, generated_tokens: u64) {
        self.load.decode_progress(request_id, generated_tokens);
    }

    /// Output tokens the next request is expected to generate, learned from released requests.
    pub fn expected_output_tokens(&self) -> f64 {
        self.outputs.expected()
    }

    /// Completion or abort. False (and counted) for an unknown or already released request.
    pub fn release(&mut self, request_id: u64) -> bool {
        self.pending.remove(&request_id);
        let Some(gone) = self.load.release_entry(request_id) else {
            return false;
        };
        self.outputs.observe(gone.generated);
        if gone.admitted_ms < self.report_polled_ms[gone.replica] {
            // The current report holds it (admitted before its poll): `merge` takes it off.
            self.released_since[gone.replica].add(&gone.share);
        }
        true
    }

    /// The query for the next poll of `replica` (a snapshot request for an unknown replica index).
    pub fn feed_query(&self, replica: usize, max_events: u32) -> FeedQuery {
        match self.cursors.get(replica) {
            Some(c) => c.query(max_events),
            None => FeedQuery::resync(max_events),
        }
    }

    /// Applies one decoded feed batch from `replica`.
    pub fn apply_feed(&mut self, replica: usize, batch: &FeedBatch) -> FeedOutcome {
        match self.accept_feed(replica, batch) {
            FeedOutcome::Applied { .. } => FeedOutcome::Applied {
                events: self.apply_events(replica, &batch.events),
            },
            FeedOutcome::Reset { epoch, .. } => FeedOutcome::Reset {
                events: self.apply_events(replica, &batch.events),
                epoch,
            },
            other => other,
        }
    }

    /// The first half of [`Router::apply_feed`], for a batch applied in slices: takes the batch's
    /// load, judges its position against the replica's cursor and, for a snapshot, drops what the
    /// replica held. Ignores `batch.events`; unless the outcome is a gap or a bad replica, the caller
    /// then applies the events in order with [`Router::apply_feed_slice`]. The outcomes' event counts
    /// are 0.
    pub fn accept_feed(&mut self, replica: usize, batch: &FeedBatch) -> FeedOutcome {
        self.accept_feed_polled_at(replica, batch, self.clock_ms)
    }

    /// [`Router::accept_feed`] for a batch whose poll was sent at `polled_ms` (this router's clock):
    /// its load describes the replica with every request this proxy admitted before then, and none it
    /// admitted after (`reported_load` `merge` adds those). [`Router::accept_feed`] takes the latest
    /// time the router was given instead.
    pub fn accept_feed_polled_at(
        &mut self,
        replica: usize,
        batch: &FeedBatch,
        polled_ms: u64,
    ) -> FeedOutcome {
        if replica >= self.replicas {
            self.stats.bad_replica += 1;
            return FeedOutcome::BadReplica;
        }
        if batch.load.block_size != 0 && batch.load.block_size as usize != self.cfg.block_size {
            self.stats.feed_block_size_mismatches += 1;
        }
        let prev_epoch = self.cursors[replica].epoch;
        // The load figures describe the replica now, whatever the log position: keep them.
        self.reported[replica] = Some(batch.load);
        self.report_polled_ms[replica] = polled_ms;
        self.released_since[replica] = LoadTotals::default();
        if self.cfg.kv_load.reported_load == ReportedLoad::Others {
            self.held_at_report[replica] = self.load.held(replica, polled_ms);
        }
        match self.cursors[replica].accept(batch) {
            CursorVerdict::Gap => {
                self.stats.feed_gaps += 1;
                FeedOutcome::Gap
            }
            CursorVerdict::ResetThenApply => {
                self.index.remove_replica(replica);
                if prev_epoch != 0 && prev_epoch != batch.epoch {
                    // The engine restarted: what this router sent there is gone too.
                    self.approx_seq.remove_replica(replica);
                    self.approx_text.remove_replica(replica);
                }
                self.stats.feed_resets += 1;
                FeedOutcome::Reset {
                    events: 0,
                    epoch: batch.epoch,
                }
            }
            CursorVerdict::Apply => FeedOutcome::Applied { events: 0 },
        }
    }

    /// Applies one slice of a feed event (part of a `stored` or `removed` event's hashes, or a whole
    /// `cleared`) of a batch accepted by [`Router::accept_feed`]; events are counted in
    /// `stats().feed_events` by their first slice.
    pub fn apply_feed_slice(&mut self, replica: usize, slice: FeedSlice, hashes: &[u64]) {
        if replica >= self.replicas {
            self.stats.bad_replica += 1;
            return;
        }
        let FeedSlice {
            kind,
            tier,
            starts_event,
        } = slice;
        match kind {
            EventKind::Stored => {
                self.index.store(replica, tier, hashes);
                self.note_stored(replica, tier, hashes);
            }
            EventKind::Removed => {
                self.index.remove(replica, tier, hashes);
            }
            EventKind::Cleared => self.index.remove_replica(replica),
        }
        self.note_cache_size(replica, kind == EventKind::Removed && tier == Tier::Gpu);
        self.stats.feed_events += starts_event as u64;
    }

    /// A replica's prefix-cache size in blocks for the working-set term: `replica_cache_tokens` when
    /// set, else as learned from its feed (the most blocks it held once it evicted), else 0 (unknown:
    /// the term is off for it).
    pub fn cache_size_blocks(&self, replica: usize) -> f64 {
        let configured = self.cfg.kv_load.replica_cache_tokens / self.cfg.block_size as f64;
        match self.cache_blocks.get(replica) {
            _ if configured > 0.0 => configured,
            Some(c) if c.evicted => c.most_held as f64,
            _ => 0.0,
        }
    }

    /// A replica's recent working set in blocks as this router estimates it (0 with the
    /// working-set term off): beside [`Router::cache_size_blocks`], what an operator checks to see
    /// whether the term is at work.
    pub fn working_set_blocks(&self, replica: usize) -> f64 {
        self.working_set
            .as_ref()
            .map_or(0.0, |ws| ws.blocks(replica))
    }

    /// Starts sharing this router's working-set admissions with the proxy's other workers
    /// ([`crate::working_set`]); nothing with the working-set term off.
    pub fn share_working_set(&mut self) {
        if let Some(ws) = &mut self.working_set {
            ws.start_journal();
        }
    }

    /// This router's recent working-set admissions for the other workers, stamped `now_ms`, keeping
    /// the last `keep_ms`; `None` with the term off or before [`Router::share_working_set`].
    pub fn working_set_journal(&mut self, now_ms: u64, keep_ms: u64) -> Option<Vec<u8>> {
        self.working_set.as_mut()?.encode_journal(now_ms, keep_ms)
    }

    /// Applies another worker's working-set journal; `None` for one that is malformed or for
    /// another replica count, or while not sharing.
    pub fn apply_peer_working_set(
        &mut self,
        peer: u32,
        journal: &[u8],
    ) -> Option<working_set::Applied> {
        self.working_set.as_mut()?.apply_peer(peer, journal)
    }

    /// Applies another proxy's answer (its workers' journals, [`working_set::encode_bundle`]) from
    /// its peer number `peer`, at `now_ms`; `None`, nothing applied, for one that is malformed or
    /// for another replica count, or while not sharing ([`working_set::WorkingSet::apply_remote`]).
    pub fn apply_remote_working_set(
        &mut self,
        peer: u32,
        bundle: &[u8],
        now_ms: u64,
    ) -> Option<working_set::Applied> {
        self.working_set
            .as_mut()?
            .apply_remote(peer, bundle, now_ms)
    }

    /// Whether the working-set term is on (kv_load with `overflow_weight` > 0): with it off there
    /// is no working set to share or to take in.
    pub fn has_working_set(&self) -> bool {
        self.working_set.is_some()
    }

    /// What this router has applied from each worker of peer proxy `peer` (its `after` query).
    pub fn remote_working_set_marks(&self, peer: u32) -> Vec<(u32, u64)> {
        self.working_set
            .as_ref()
            .map_or_else(Vec::new, |ws| ws.remote_marks(peer))
    }

    /// Counts a replica's stored GPU blocks in its working set (`kv_load.working_set_from_feed`).
    fn note_stored(&mut self, replica: usize, tier: Tier, hashes: &[u64]) {
        if tier == Tier::Gpu
            && self.cfg.kv_load.working_set_from_feed
            && let Some(ws) = &mut self.working_set
        {
            ws.stored(replica, hashes, self.clock_ms);
        }
    }

    /// Learns a replica's cache size from what the index holds for it (`kv_load.overflow_weight`).
    fn note_cache_size(&mut self, replica: usize, evicted: bool) {
        if self.index.replica_blocks(replica) == 0 {
            // Cleared (an engine restart, perhaps with another cache size): learn it again.
            if let Some(c) = self.cache_blocks.get_mut(replica) {
                *c = CacheSize::default();
            }
            return;
        }
        let held = self.index.replica_blocks(replica);
        if let Some(c) = self.cache_blocks.get_mut(replica) {
            c.most_held = c.most_held.max(held);
            c.evicted |= evicted;
        }
    }

    fn apply_events(&mut self, replica: usize, events: &[FeedEvent]) -> usize {
        for e in events {
            match e {
                FeedEvent::Stored { tier, hashes } => {
                    self.index.store(replica, *tier, hashes);
                    self.note_stored(replica, *tier, hashes);
                }
                FeedEvent::Removed { tier, hashes } => {
                    self.index.remove(replica, *tier, hashes);
                }
                FeedEvent::Cleared => self.index.remove_replica(replica),
            }
            let evicted = matches!(
                e,
                FeedEvent::Removed {
                    tier: Tier::Gpu,
                    ..
                }
            );
            self.note_cache_size(replica, evicted);
        }
        self.stats.feed_events += events.len() as u64;
        events.len()
    }

    /// Marks a replica's feed as failing (or recovered). Stale: its index and reported load are not
    /// trusted; it is routed by tracked load only.
    pub fn set_stale(&mut self, replica: usize, stale: bool) {
        match self.stale.get_mut(replica) {
            Some(s) => *s = stale,
            None => self.stats.bad_replica += 1,
        }
    }

    pub fn is_stale(&self, replica: usize) -> bool {
        self.stale.get(replica).copied().unwrap_or(false)
    }

    /// Marks a replica unreachable (or reachable again). Every policy avoids a down replica while any
    /// other is up (`session_hash` moves only the down replica's sessions, to the next point on the
    /// ring); with all replicas down, routing carries on as if none were.
    pub fn set_down(&mut self, replica: usize, down: bool) {
        match self.down.get_mut(replica) {
            Some(d) => *d = down,
            None => self.stats.bad_replica += 1,
        }
    }

    pub fn is_down(&self, replica: usize) -> bool {
        self.down.get(replica).copied().unwrap_or(false)
    }

    /// Records how a request on `replica` ended (docs/design/design.md section 2.4): failures eject a
    /// replica from every policy's choices until probes succeed again. Out of range: counted.
    pub fn record_outcome(&mut self, replica: usize, outcome: Outcome, now_ms: u64) {
        if replica >= self.replicas {
            self.stats.bad_replica += 1;
            return;
        }
        self.health.record(replica, outcome, now_ms);
    }

    /// Whether `replica` is ejected for failing requests.
    pub fn is_ejected(&self, replica: usize) -> bool {
        self.health.is_ejected(replica)
    }

    /// The ejected replica whose probe is due at `now_ms` (not down), without taking it: the
    /// filter claims it in shared data first, so that one worker sends it, then routes (which takes
    /// it) or reports [`Router::probed_elsewhere`].
    pub fn probe_due(&mut self, now_ms: u64) -> Option<usize> {
        self.health.refresh(now_ms);
        let down = &self.down;
        self.health
            .probe_due(now_ms, |r| !down.get(r).copied().unwrap_or(true))
    }

    /// Another worker sent `replica`'s probe at `at_ms`: this one waits a full interval from then.
    pub fn probed_elsewhere(&mut self, replica: usize, at_ms: u64) {
        self.health.probed_elsewhere(replica, at_ms);
    }

    /// Re-judges every replica's health at `now_ms` (routing does it too).
    pub fn refresh_health(&mut self, now_ms: u64) {
        self.health.refresh(now_ms);
    }

    /// Health as learned from completions (counts, probes, ejections).
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// This router's own outcome counts per replica as of `now_ms` (what a worker publishes).
    pub fn local_health(&self, now_ms: u64) -> Vec<HealthCounts> {
        self.health.local(now_ms)
    }

    /// Replaces a peer worker's outcome counts, published at `published_ms`.
    pub fn set_peer_health(&mut self, peer: u32, published_ms: u64, counts: &[HealthCounts]) {
        self.health.set_peer(peer, published_ms, counts);
    }

    pub fn clear_peer_health(&mut self, peer: u32) {
        self.health.clear_peer(peer);
    }

    /// This router's tracked totals per replica (what a worker publishes to its peers).
    pub fn local_load(&self) -> Vec<LoadTotals> {
        self.load.totals().to_vec()
    }

    /// Replaces a peer worker's contribution (extra replicas are ignored, missing ones count as zero).
    pub fn set_peer_load(&mut self, peer: u32, totals: &[LoadTotals]) {
        let mut v = totals.to_vec();
        v.resize(self.replicas, LoadTotals::default());
        self.peers.insert(peer, v);
    }

    /// Replaces a peer worker's bookings made since each replica's report was polled, and what it
    /// released since of requests the report holds (what its [`Router::local_load_since`] and
    /// [`Router::local_released_since`] say), for `reported_load` `merge`.
    pub fn set_peer_load_since(
        &mut self,
        peer: u32,
        since: &[LoadTotals],
        released: &[LoadTotals],
    ) {
        let mut v = since.to_vec();
        v.resize(self.replicas, LoadTotals::default());
        let mut g = released.to_vec();
        g.resize(self.replicas, LoadTotals::default());
        self.peers_since.insert(peer, (v, g));
    }

    /// Replaces a peer worker's requests each replica's current report holds (what its
    /// [`Router::local_held`] says), for `reported_load` `others`.
    pub fn set_peer_held(&mut self, peer: u32, held: &[LoadTotals]) {
        let mut v = held.to_vec();
        v.resize(self.replicas, LoadTotals::default());
        self.peers_held.insert(peer, v);
    }

    pub fn clear_peer(&mut self, peer: u32) {
        self.peers.remove(&peer);
        self.peers_since.remove(&peer);
        self.peers_held.remove(&peer);
    }

    /// This router's requests each replica's current report holds (admitted before its poll), in
    /// the report's units ([`LoadTable::held`]) as they stood when the report was accepted; zero
    /// for a replica that has not reported, and while `reported_load` is not `others`. What a
    /// worker publishes for its peers' `others`.
    pub fn local_held(&self) -> Vec<LoadTotals> {
        self.held_at_report.clone()
    }

    /// This router's bookings made since each replica's report was polled, in the report's units
    /// ([`LoadTable::since`]); zero for a replica that has not reported. What a worker publishes
    /// beside [`Router::local_load`] for its peers' `merge`.
    pub fn local_load_since(&self) -> Vec<LoadTotals> {
        self.load.since(&self.report_polled_ms)
    }

    /// What this router released since each replica's report was polled, of requests that report
    /// holds (admitted before its poll), in the report's units: `merge` takes it off the report.
    pub fn local_released_since(&self) -> Vec<LoadTotals> {
        self.released_since.clone()
    }

    /// When the poll behind `replica`'s current report was sent (None before its first report).
    pub fn report_polled_ms(&self, replica: usize) -> Option<u64> {
        self.report_polled_ms
            .get(replica)
            .copied()
            .filter(|&t| t != u64::MAX)
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

#[cfg(test)]
mod address_group_tests {
    use super::*;
    use crate::config::RoutingConfig;

    fn decide(groups: Option<Vec<usize>>, policy: PolicyKind) -> Vec<(usize, Option<usize>)> {
        let cfg = RoutingConfig {
            policy,
            block_size: 4,
            ..RoutingConfig::default()
        };
        let mut r = Router::new(cfg, 4).unwrap();
        if let Some(g) = groups {
            r.set_address_groups(g);
        }
        (0..8u64)
            .map(|id| {
                let prompt: Vec<u32> = (0..32).map(|i| id as u32 * 100 + i).collect();
                let body = format!("{{\"prompt\":{prompt:?},\"max_tokens\":8}}");
                let req = r
                    .read_request("/v1/completions", body.as_bytes(), None)
                    .unwrap();
                let d = r.route_and_admit(id, &req, id);
                (d.replica, d.backup)
            })
            .collect()
    }

    #[test]
    fn a_backup_is_taken_from_another_address() {
        // Units 0-2 are three ranks of one endpoint, unit 3 another endpoint.
        for policy in [PolicyKind::RoundRobin, PolicyKind::KvLoad] {
            let grouped = decide(Some(vec![0, 0, 0, 3]), policy);
            for &(chosen, backup) in &grouped {
                let backup = backup.expect("a backup");
                if chosen < 3 {
                    assert_eq!(backup, 3, "{policy:?}: {grouped:?}");
                } else {
                    assert!(backup < 3, "{policy:?}: {grouped:?}");
                }
            }
        }
        // Without groups round robin's backup is the next unit, a rank of the same endpoint.
        let plain = decide(None, PolicyKind::RoundRobin);
        assert!(
            plain.iter().any(|&(c, b)| c < 2 && b == Some(c + 1)),
            "{plain:?}"
        );
        // A grouping that does not name every unit is ignored.
        assert_eq!(decide(Some(vec![0, 0]), PolicyKind::RoundRobin), plain);
    }
}
