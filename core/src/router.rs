//! The router: the KV index, the approximate indexes, the token-load table and the policies together,
//! behind the API the proxy-wasm filter calls (see docs/core.md).
//!
//! Effective load of a replica, the input to every load-aware policy: the router-tracked totals (this
//! worker's plus its peers') combined with what the replica itself last reported, taking the larger of
//! the two for prefill tokens, decode blocks and active requests: the report sees traffic from other
//! proxies, the tracked figure is fresher. A *stale* replica (its feed failing) has its report ignored
//! and its KV overlap treated as zero.

use hashbrown::HashMap;

use crate::approx::ApproxIndex;
use crate::block::{SeqHash, TextHash};
use crate::config::{ConfigError, PolicyKind, ReportedLoad, RoutingConfig};
use crate::feed::{CursorVerdict, FeedBatch, FeedCursor, FeedEvent, FeedQuery, ReplicaLoad};
use crate::index::{KvIndex, MAX_REPLICAS, TierCounts};
use crate::load::{Accounting, LoadTable, LoadTotals};
use crate::policy::{HashRing, argmin_random_tie, softmax_sample};
use crate::request::{
    PromptIdentity, PromptTokenizer, RequestError, RouteRequest, read_request, read_request_with,
};
use crate::rng::SplitMix64;

/// Why a decision did not come from the configured policy's first choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// `session_hash` without a session key: least load.
    NoSessionKey,
    /// `prefix_affinity` with too small a match: least load.
    BelowMatchThreshold,
    /// The body could not be read: least load.
    BodyUnreadable,
}

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
    peers: HashMap<u32, Vec<LoadTotals>>,
    reported: Vec<Option<ReplicaLoad>>,
    stale: Vec<bool>,
    /// Replicas believed unreachable (their feed cannot even be connected to): avoided by every
    /// policy while any other replica is up.
    down: Vec<bool>,
    cursors: Vec<FeedCursor>,
    ring: HashRing,
    rr_next: usize,
    rng: SplitMix64,
    stats: RouterStats,
    scratch_tiers: Vec<TierCounts>,
    scratch_approx: Vec<u32>,
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
        Ok(Router {
            index: KvIndex::new(cfg.index_capacity_blocks, replicas, cfg.seed ^ 0xA5A5_5A5A),
            approx_seq: ApproxIndex::new(pa.capacity_blocks, pa.ttl_ms),
            approx_text: ApproxIndex::new(pa.capacity_blocks, pa.ttl_ms),
            load: LoadTable::new(
                replicas,
                cfg.block_size,
                Accounting {
                    prompt_blocks_at_admission: cfg.kv_load.prompt_blocks_at_admission,
                    assume_kv_reuse: cfg.kv_load.assume_kv_reuse,
                    use_output_hint: cfg.kv_load.use_output_hint,
                },
            ),
            peers: HashMap::new(),
            reported: vec![None; replicas],
            stale: vec![false; replicas],
            down: vec![false; replicas],
            cursors: vec![FeedCursor::default(); replicas],
            ring: HashRing::new(0..replicas, cfg.session_hash.virtual_nodes),
            rr_next: 0,
            rng: SplitMix64::new(cfg.seed),
            stats: RouterStats {
                policy: Some(cfg.policy),
                decisions: vec![0; replicas],
                ..RouterStats::default()
            },
            scratch_tiers: Vec::new(),
            scratch_approx: Vec::new(),
            replicas,
            cfg,
        })
    }

    pub fn config(&self) -> &RoutingConfig {
        &self.cfg
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
        if self.cfg.kv_load.reported_load == ReportedLoad::Ignore {
            return eff;
        }
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
                e.prefill_tokens = e.prefill_tokens.max(rep.prefill_tokens);
                e.decode_blocks = e.decode_blocks.max(decode);
                e.active_requests = e
                    .active_requests
                    .max(rep.running.saturating_add(rep.waiting));
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

    fn least_load_costs(&self, eff: &[LoadTotals], request_blocks: f64) -> Vec<f64> {
        let k = &self.cfg.kv_load;
        let bs = self.cfg.block_size as f64;
        eff.iter()
            .map(|e| {
                k.prefill_scale * (e.prefill_tokens as f64 / bs + request_blocks)
                    + e.decode_blocks as f64
                    + k.active_request_weight * e.active_requests as f64
            })
            .collect()
    }

    /// The `kv_load` cost per replica (docs/design.md section 2):
    /// `prefill_scale * max(queued prefill + request blocks - credit * overlap, 0) + decode blocks
    /// (+ the request's blocks not already active there, with assume_kv_reuse) + w * active requests`,
    /// the credit `c`, decayed by `d` on replicas whose queued prefill exceeds the least-loaded
    /// candidate's.
    fn kv_load_costs(
        &self,
        req: &RouteRequest,
        eff: &[LoadTotals],
        overlap: &[f64],
        request_blocks: f64,
    ) -> Vec<f64> {
        let k = &self.cfg.kv_load;
        let bs = self.cfg.block_size as f64;
        let queued: Vec<f64> = eff.iter().map(|e| e.prefill_tokens as f64 / bs).collect();
        let least_queued = (0..queued.len())
            .filter(|&r| !self.is_avoided(r))
            .map(|r| queued[r])
            .fold(f64::INFINITY, f64::min);
        let keys = if k.assume_kv_reuse {
            req.identity.keys()
        } else {
            Vec::new()
        };
        eff.iter()
            .zip(overlap)
            .enumerate()
            .map(|(r, (e, &o))| {
                let excess = (queued[r] - least_queued).max(0.0);
                let credit = if k.overlap_credit_decay > 0.0 && request_blocks > 0.0 {
                    k.overlap_credit / (1.0 + k.overlap_credit_decay * excess / request_blocks)
                } else {
                    k.overlap_credit
                };
                let prefill = (queued[r] + request_blocks - credit * o).max(0.0);
                let new_active = if k.assume_kv_reuse {
                    (request_blocks - self.load.active_prefix(r, &keys) as f64).max(0.0)
                } else {
                    0.0
                };
                k.prefill_scale * prefill
                    + e.decode_blocks as f64
                    + new_active
                    + k.active_request_weight * e.active_requests as f64
            })
            .collect()
    }

    /// Chooses a replica for a request. Does not admit it: call [`Router::admit`] once the request is
    /// really sent there.
    pub fn route(&mut self, req: &RouteRequest, now_ms: u64) -> Decision {
        let bs = self.cfg.block_size as f64;
        let request_blocks = (req.prompt_tokens as f64 / bs).ceil();
        let overlap = self.overlap_blocks(req, now_ms);
        let eff = self.effective_load();
        let policy = self.cfg.policy;
        let mut fallback = None;
        let mut costs = Vec::new();
        let replica = match policy {
            PolicyKind::RoundRobin => {
                let mut r = self.rr_next % self.replicas;
                for _ in 0..self.replicas {
                    if !self.is_avoided(r) {
                        break;
                    }
                    r = (r + 1) % self.replicas;
                }
                self.rr_next = (r + 1) % self.replicas;
                r
            }
            PolicyKind::LeastLoad => {
                costs = self.least_load_costs(&eff, request_blocks);
                self.pick_lowest(&costs)
            }
            PolicyKind::SessionHash => match req.session_key.as_deref() {
                Some(key) => {
                    let down = &self.down;
                    let all_down = down.iter().all(|&d| d);
                    self.ring
                        .lookup_where(key.as_bytes(), |r| all_down || !down[r])
                        .unwrap_or(0)
                }
                None => {
                    fallback = Some(FallbackReason::NoSessionKey);
                    costs = self.least_load_costs(&eff, request_blocks);
                    self.pick_lowest(&costs)
                }
            },
            PolicyKind::PrefixAffinity => {
                let mut m = std::mem::take(&mut self.scratch_approx);
                match &req.identity {
                    PromptIdentity::Exact(h) => {
                        self.approx_seq
                            .match_prefix(h, now_ms, self.replicas, &mut m)
                    }
                    PromptIdentity::Approximate(h) => {
                        self.approx_text
                            .match_prefix(h, now_ms, self.replicas, &mut m)
                    }
                }
                let blocks = req.identity.blocks();
                for (r, b) in m.iter_mut().enumerate() {
                    if self.is_avoided(r) {
                        *b = 0;
                    }
                }
                let best = m.iter().copied().max().unwrap_or(0);
                let rate = if blocks == 0 {
                    0.0
                } else {
                    best as f64 / blocks as f64
                };
                let load_costs = self.least_load_costs(&eff, request_blocks);
                let r = if best > 0 && rate >= self.cfg.prefix_affinity.match_threshold {
                    // Among the replicas with the best match, the least loaded.
                    let masked: Vec<f64> = load_costs
                        .iter()
                        .zip(&m)
                        .map(|(&c, &b)| if b == best { c } else { f64::INFINITY })
                        .collect();
                    self.pick_lowest(&masked)
                } else {
                    fallback = Some(FallbackReason::BelowMatchThreshold);
                    self.pick_lowest(&load_costs)
                };
                self.scratch_approx = m;
                costs = load_costs;
                r
            }
            PolicyKind::KvAffinity => {
                let neg: Vec<f64> = overlap.iter().map(|o| -o).collect();
                self.pick_lowest(&neg)
            }
            PolicyKind::KvLoad => {
                costs = self.kv_load_costs(req, &eff, &overlap, request_blocks);
                let t = self.cfg.kv_load.temperature;
                if t > 0.0 {
                    let masked = self.masked(&costs);
                    let finite: Vec<usize> = (0..masked.len())
                        .filter(|&r| masked[r].is_finite())
                        .collect();
                    let sub: Vec<f64> = finite.iter().map(|&r| masked[r]).collect();
                    match softmax_sample(&sub, t, &mut self.rng) {
                        Some(i) => finite[i],
                        None => self.pick_lowest(&costs),
                    }
                } else {
                    self.pick_lowest(&costs)
                }
            }
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
        let backup = self.backup_for(replica, &costs);
        Decision {
            replica,
            policy,
            fallback,
            prompt_tokens: req.prompt_tokens,
            matched_tokens,
            costs,
            backup,
        }
    }

    /// Avoided: down while some other replica is up.
    fn is_avoided(&self, r: usize) -> bool {
        self.down.get(r).copied().unwrap_or(false) && !self.down.iter().all(|&d| d)
    }

    /// Costs with avoided replicas priced out.
    fn masked(&self, costs: &[f64]) -> Vec<f64> {
        costs
            .iter()
            .enumerate()
            .map(|(r, &c)| if self.is_avoided(r) { f64::INFINITY } else { c })
            .collect()
    }

    /// The lowest cost among replicas not avoided, ties broken at random.
    fn pick_lowest(&mut self, costs: &[f64]) -> usize {
        let masked = self.masked(costs);
        argmin_random_tie(&masked, &mut self.rng).unwrap_or(0)
    }

    fn backup_for(&self, chosen: usize, costs: &[f64]) -> Option<usize> {
        let candidates = (0..self.replicas).filter(|&r| r != chosen && !self.is_avoided(r));
        if costs.len() == self.replicas {
            candidates.min_by(|&a, &b| costs[a].total_cmp(&costs[b]))
        } else {
            (1..self.replicas)
                .map(|i| (chosen + i) % self.replicas)
                .find(|&r| !self.is_avoided(r))
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

    /// A load-only choice for a request whose body could not be read (too large, not JSON, ...).
    pub fn route_fallback(&mut self, _now_ms: u64) -> Decision {
        let eff = self.effective_load();
        let costs = self.least_load_costs(&eff, 0.0);
        let replica = self.pick_lowest(&costs);
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
        }
    }

    /// Starts tracking a request sent where `d` says: its uncached prompt tokens become prefill load,
    /// and its prefix is recorded in the approximate index (for `prefix_affinity`, and as the overlap
    /// estimate of text prompts).
    pub fn admit(&mut self, request_id: u64, req: &RouteRequest, d: &Decision, now_ms: u64) {
        if d.replica >= self.replicas {
            self.stats.bad_replica += 1;
            return;
        }
        let matched = d.matched_tokens.get(d.replica).copied().unwrap_or(0);
        let uncached = req.prompt_tokens.saturating_sub(matched);
        self.load.admit(
            request_id,
            d.replica,
            req.prompt_tokens,
            uncached,
            req.output_hint,
            &req.identity.keys(),
        );
        match &req.identity {
            PromptIdentity::Exact(h) => self.approx_seq.record(d.replica, h, now_ms),
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
        self.load.admit(
            request_id,
            d.replica,
            estimated_prompt_tokens,
            estimated_prompt_tokens,
            None,
            &[],
        );
    }

    pub fn first_token(&mut self, request_id: u64) {
        self.load.first_token(request_id);
    }

    /// `generated_tokens`: cumulative output tokens so far.
    pub fn decode_progress(&mut self, request_id: u64, generated_tokens: u64) {
        self.load.decode_progress(request_id, generated_tokens);
    }

    /// Completion or abort. False (and counted) for an unknown or already released request.
    pub fn release(&mut self, request_id: u64) -> bool {
        self.load.release(request_id)
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
                let events = self.apply_events(replica, &batch.events);
                FeedOutcome::Reset {
                    events,
                    epoch: batch.epoch,
                }
            }
            CursorVerdict::Apply => FeedOutcome::Applied {
                events: self.apply_events(replica, &batch.events),
            },
        }
    }

    fn apply_events(&mut self, replica: usize, events: &[FeedEvent]) -> usize {
        for e in events {
            match e {
                FeedEvent::Stored { tier, hashes } => {
                    self.index.store(replica, *tier, hashes);
                }
                FeedEvent::Removed { tier, hashes } => {
                    self.index.remove(replica, *tier, hashes);
                }
                FeedEvent::Cleared => self.index.remove_replica(replica),
            }
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

    pub fn clear_peer(&mut self, peer: u32) {
        self.peers.remove(&peer);
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
