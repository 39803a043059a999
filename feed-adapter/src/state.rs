//! The adapter's view of one engine's cache, and the feed it serves from it. Pure: no I/O, no clock.
//!
//! - Identity: each `BlockStored` carries the blocks' token ids; the adapter computes kvsteer's sequence
//!   hashes from them with `kvsteer_core::block` (Dynamo's XXH3 chain), continuing after the parent
//!   block's kvsteer hash, which it finds by the engine's `parent_block_hash` in its map. A block whose
//!   parent it does not know (the adapter started late, or the parent was skipped) cannot be named and
//!   is skipped, and so are its descendants: skipping only under-reports, which costs the router a
//!   missed hit, never a wrong one.
//! - Namespace: a LoRA adapter (`lora_name`) and a cache salt (vLLM's `extra_keys` of a chain's first
//!   block, SGLang's `metadata.cache_salt`) change the seed, as the router does
//!   (`BlockHasher::namespaced`); the seed of a chain is inherited by its descendants. A block whose
//!   `extra_keys` hold anything else (multimodal inputs, prompt embeddings) has no token identity and is
//!   skipped.
//! - Map: engine hash -> kvsteer hash, tiers held, namespace. `BlockRemoved` looks the engine hash up;
//!   `AllBlocksCleared` drops everything. Bounded by `max_blocks`: past it the oldest stored block goes
//!   (and the router is told it was removed).
//! - Feed: changes go to a [`FeedLog`] (shared with the simulator), which answers polls with incremental
//!   batches or, for a new router, an old cursor or another epoch, with a snapshot of the map.
//! - Loss: whatever makes the view uncertain (a sequence gap that replay did not fill, a payload that
//!   cannot be read, a malformed removal, an engine restart) resets the view and starts a new epoch, so
//!   every router's next poll gets a snapshot of what the adapter really knows. Each is counted.

use crate::wire::{DecodeError, EngineBatch, EngineEvent, ExtraKeys, Limits, Medium, Stored};
use hashbrown::HashMap;
use kvsteer_core::block::{BlockHasher, MAX_BLOCK_SIZE, SeqHash, namespace_seed};
use kvsteer_core::feed::log::FeedLog;
use kvsteer_core::feed::{FeedBatch, FeedQuery, ReplicaLoad, Tier};
use std::collections::VecDeque;

/// Default bound on blocks held before the engine's block count is known.
pub const DEFAULT_MAX_BLOCKS: usize = 1 << 20;
/// Blocks kept per GPU block of the engine when the bound is derived (room for host-tier copies).
pub const BLOCKS_PER_ENGINE_BLOCK: usize = 2;
/// Smallest derived bound.
pub const MIN_MAX_BLOCKS: usize = 4096;
/// Default number of hashes the feed log retains for lagging routers.
pub const DEFAULT_LOG_HASHES: usize = 1 << 18;

/// Why the adapter dropped its view and started a new epoch.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ResetReason {
    /// The engine's sequence numbers went backwards, or its process start time changed.
    EngineRestart,
    /// Batches were missed and replay did not bring them back.
    Gap,
    /// A payload or a removal could not be read.
    BadInput,
}

impl ResetReason {
    pub const ALL: [ResetReason; 3] = [
        ResetReason::EngineRestart,
        ResetReason::Gap,
        ResetReason::BadInput,
    ];
    pub fn label(self) -> &'static str {
        match self {
            ResetReason::EngineRestart => "engine_restart",
            ResetReason::Gap => "gap",
            ResetReason::BadInput => "bad_input",
        }
    }
}

/// Why stored blocks were not indexed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    /// The parent block is not in the map.
    Orphan,
    /// The event's block size is not the configured one.
    BlockSize,
    /// `token_ids` is not `block_size` tokens per block.
    TokenCount,
    /// `extra_keys` hold more than a LoRA name and a cache salt.
    Unidentifiable,
    /// A medium the router has no tier for.
    Medium,
    /// Another KV cache group than the one indexed.
    Group,
    /// The namespace table is full.
    Namespaces,
    /// A `BlockStored` whose fields could not be read.
    Malformed,
}

impl Skip {
    pub const ALL: [Skip; 8] = [
        Skip::Orphan,
        Skip::BlockSize,
        Skip::TokenCount,
        Skip::Unidentifiable,
        Skip::Medium,
        Skip::Group,
        Skip::Namespaces,
        Skip::Malformed,
    ];
    pub fn label(self) -> &'static str {
        match self {
            Skip::Orphan => "orphan",
            Skip::BlockSize => "block_size",
            Skip::TokenCount => "token_count",
            Skip::Unidentifiable => "unidentifiable",
            Skip::Medium => "medium",
            Skip::Group => "group",
            Skip::Namespaces => "namespaces",
            Skip::Malformed => "malformed",
        }
    }
}

/// Counters, all monotonic except where named.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Engine payloads applied (including replayed ones).
    pub batches: u64,
    pub events_stored: u64,
    pub events_removed: u64,
    pub events_cleared: u64,
    /// Events of a type the adapter does not know.
    pub events_unknown: u64,
    /// Blocks newly indexed (or newly held in another tier).
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    /// Stores of a block already held in that tier.
    pub blocks_duplicate: u64,
    /// Blocks not indexed, by [`Skip`] (index = position in `Skip::ALL`).
    pub blocks_skipped: [u64; 8],
    /// Removals of engine hashes the map does not hold in that tier.
    pub removals_unknown: u64,
    /// Blocks dropped to stay under `max_blocks`.
    pub cap_evictions: u64,
    /// An engine hash re-stored with other contents (kept the new one).
    pub hash_conflicts: u64,
    /// Payloads refused: "frames", "topic", "seq", "msgpack", "too_large".
    pub bad_payloads: [u64; 6],
    /// Known events that could not be read (BlockStored, BlockRemoved, or an unreadable event).
    pub bad_events: u64,
    /// Sequence gaps seen, and batches missing in them.
    pub gaps: u64,
    pub gap_batches: u64,
    /// Gaps filled by replay, and batches brought back.
    pub gaps_recovered: u64,
    pub replayed_batches: u64,
    /// Resets, by [`ResetReason`] (index = position in `ResetReason::ALL`).
    pub resets: [u64; 3],
    /// Feed answers: incremental and snapshot.
    pub polls_incremental: u64,
    pub polls_resync: u64,
}

/// Labels of [`Stats::bad_payloads`].
/// `dp_rank`: a batch stamped with another data-parallel rank than the one this view is for (vLLM
/// stamps each batch with its rank, `EventBatch.data_parallel_rank` in `vllm/distributed/kv_events.py`).
pub const BAD_PAYLOAD_LABELS: [&str; 6] =
    ["frames", "topic", "seq", "msgpack", "too_large", "dp_rank"];

/// What the engine's `/metrics` said last.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EngineLoad {
    pub running: u64,
    pub waiting: u64,
    /// Fraction of GPU KV blocks referenced by requests (vLLM's `kv_cache_usage_perc`, 0..=1).
    pub kv_usage: Option<f64>,
    pub num_gpu_blocks: Option<u64>,
    pub block_size: Option<u64>,
    /// `process_start_time_seconds`: a change means the engine restarted.
    pub start_time: Option<f64>,
    /// `vllm:lora_requests_info`: the LoRA adapters of the running and waiting requests and the
    /// adapter slots; `None` when the engine does not export it (LoRA off, or not vLLM).
    pub adapters: Option<kvsteer_core::feed::AdapterReport>,
}

#[derive(Copy, Clone, Debug)]
struct Entry {
    kv: u64,
    stamp: u32,
    ns: u16,
    tiers: u8,
}

/// How a new message's sequence number relates to the last one.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The first message this adapter sees.
    First,
    InOrder,
    /// Batches `from..to` are missing.
    Gap {
        from: u64,
        to: u64,
    },
    /// The number went backwards: the engine restarted (its publisher counts from 0 again).
    Restart,
}

/// Settings of the view.
#[derive(Clone, Debug)]
pub struct StateConfig {
    /// Tokens per block; `None` learns it from the engine (metrics, else the first stored event).
    pub block_size: Option<usize>,
    /// Bound on blocks held; `None` derives it from the engine's block count.
    pub max_blocks: Option<usize>,
    /// Hashes the feed log retains.
    pub log_hashes: usize,
    /// KV cache group indexed (events of other groups are skipped).
    pub group_idx: i64,
    pub limits: Limits,
    /// The data-parallel rank this view is for (`None`: a single engine, rank 0 in the feed): batches
    /// stamped with another rank are dropped and counted, never applied to this rank's cache, and
    /// feed answers carry the rank (docs/reference/feed.md).
    pub dp_rank: Option<u32>,
}

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            block_size: None,
            max_blocks: None,
            log_hashes: DEFAULT_LOG_HASHES,
            group_idx: 0,
            limits: Limits::default(),
            dp_rank: None,
        }
    }
}

/// The adapter's view of one engine.
pub struct AdapterState {
    cfg: StateConfig,
    block_size: Option<usize>,
    max_blocks: usize,
    /// Namespace table: index -> hasher; seed -> index.
    hashers: Vec<BlockHasher>,
    ns_by_seed: HashMap<u64, u16>,
    map: HashMap<u64, Entry>,
    /// Store order for the cap: (engine hash, stamp); entries whose stamp no longer matches are stale.
    fifo: VecDeque<(u64, u32)>,
    stamp: u32,
    /// Entries holding each tier (index = `Tier as usize`).
    tier_counts: [usize; 3],
    log: FeedLog,
    expected_seq: Option<u64>,
    /// Sequence number of the last payload applied.
    applied_seq: Option<u64>,
    load: EngineLoad,
    stats: Stats,
    scratch: Vec<SeqHash>,
}

fn tier_bit(t: Tier) -> u8 {
    1 << (t as u8)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A new epoch: nonzero, different from `prev`, derived from `entropy` (the caller mixes in the clock
/// and process id so an adapter restart gets a new one too).
pub fn next_epoch(prev: u64, entropy: u64) -> u64 {
    let mut e = splitmix(prev ^ splitmix(entropy)) | 1;
    if e == prev {
        e = splitmix(e) | 1;
    }
    e
}

impl AdapterState {
    pub fn new(cfg: StateConfig, epoch: u64) -> Self {
        let block_size = cfg.block_size.filter(|&b| b > 0 && b <= MAX_BLOCK_SIZE);
        let max_blocks = cfg.max_blocks.unwrap_or(DEFAULT_MAX_BLOCKS).max(1);
        let log = FeedLog::new(epoch.max(1), cfg.log_hashes);
        Self {
            cfg,
            block_size,
            max_blocks,
            hashers: Vec::new(),
            ns_by_seed: HashMap::new(),
            map: HashMap::new(),
            fifo: VecDeque::new(),
            stamp: 0,
            tier_counts: [0; 3],
            log,
            expected_seq: None,
            applied_seq: None,
            load: EngineLoad::default(),
            stats: Stats::default(),
            scratch: Vec::new(),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.log.epoch()
    }
    pub fn stats(&self) -> &Stats {
        &self.stats
    }
    pub fn stats_mut(&mut self) -> &mut Stats {
        &mut self.stats
    }
    pub fn limits(&self) -> &Limits {
        &self.cfg.limits
    }
    /// Engine blocks held in a tier.
    pub fn blocks_in(&self, t: Tier) -> usize {
        self.tier_counts[t as usize]
    }

    /// Engine blocks held (any tier).
    pub fn blocks(&self) -> usize {
        self.map.len()
    }
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }
    pub fn block_size(&self) -> Option<usize> {
        self.block_size
    }
    pub fn log_hashes(&self) -> usize {
        self.log.retained_hashes()
    }
    pub fn expected_seq(&self) -> Option<u64> {
        self.expected_seq
    }
    /// Sequence number of the last engine payload applied (replayed ones included).
    pub fn applied_seq(&self) -> Option<u64> {
        self.applied_seq
    }
    pub fn set_applied_seq(&mut self, seq: u64) {
        self.applied_seq = Some(seq);
    }
    pub fn engine_load(&self) -> &EngineLoad {
        &self.load
    }

    /// The kvsteer hash the adapter holds for an engine hash, and in which tiers.
    pub fn lookup(&self, engine_hash: u64) -> Option<(u64, Vec<Tier>)> {
        self.map.get(&engine_hash).map(|e| {
            let tiers = Tier::ALL
                .into_iter()
                .filter(|&t| e.tiers & tier_bit(t) != 0)
                .collect();
            (e.kv, tiers)
        })
    }

    /// Sets the block size if it is not known yet; returns false (and changes nothing) if it differs
    /// from the one in use.
    pub fn learn_block_size(&mut self, bs: u64) -> bool {
        match self.block_size {
            Some(cur) => cur as u64 == bs,
            None if bs > 0 && bs as usize <= MAX_BLOCK_SIZE => {
                self.block_size = Some(bs as usize);
                self.hashers.clear();
                self.ns_by_seed.clear();
                true
            }
            None => false,
        }
    }

    /// Drops the view and starts a new epoch (see the module docs). `entropy` feeds the new epoch.
    pub fn reset(&mut self, reason: ResetReason, entropy: u64) {
        let idx = ResetReason::ALL
            .iter()
            .position(|&r| r == reason)
            .unwrap_or(0);
        self.stats.resets[idx] += 1;
        self.map.clear();
        self.fifo.clear();
        self.tier_counts = [0; 3];
        self.hashers.clear();
        self.ns_by_seed.clear();
        let epoch = next_epoch(self.log.epoch(), entropy);
        self.log.reset(epoch);
    }

    /// Judges a sequence number and records it as the last seen.
    pub fn check_seq(&mut self, seq: u64) -> SeqVerdict {
        let v = match self.expected_seq {
            None => SeqVerdict::First,
            Some(e) if seq == e => SeqVerdict::InOrder,
            Some(e) if seq > e => SeqVerdict::Gap { from: e, to: seq },
            Some(_) => SeqVerdict::Restart,
        };
        self.expected_seq = Some(seq.wrapping_add(1));
        v
    }

    /// Records a sequence number without judging it (replayed batches).
    pub fn set_expected_seq(&mut self, next: u64) {
        self.expected_seq = Some(next);
    }

    /// Counts a refused payload by label (one of [`BAD_PAYLOAD_LABELS`]).
    pub fn count_bad_payload(&mut self, label: &str) {
        let i = BAD_PAYLOAD_LABELS
            .iter()
            .position(|&l| l == label)
            .unwrap_or(0);
        self.stats.bad_payloads[i] += 1;
    }

    /// Decodes and applies one payload. A payload that cannot be decoded resets the view (what it held
    /// is lost); the error is returned for logging.
    pub fn apply_payload(&mut self, payload: &[u8], entropy: u64) -> Result<(), DecodeError> {
        match crate::wire::decode_batch(payload, &self.cfg.limits) {
            Ok(batch) => {
                if let (Some(want), Some(got)) = (self.cfg.dp_rank, batch.dp_rank)
                    && got != i64::from(want)
                {
                    // Another rank's events (a miswired port): its blocks are not in this cache.
                    self.count_bad_payload("dp_rank");
                    return Ok(());
                }
                self.apply_batch(&batch, entropy);
                Ok(())
            }
            Err(e) => {
                self.count_bad_payload(e.label());
                self.reset(ResetReason::BadInput, entropy);
                Err(e)
            }
        }
    }

    /// Applies a decoded batch and publishes its changes to the feed log.
    pub fn apply_batch(&mut self, batch: &EngineBatch, entropy: u64) {
        self.stats.batches += 1;
        let mut lost = false;
        for ev in &batch.events {
            match ev {
                EngineEvent::Stored(st) => {
                    self.stats.events_stored += 1;
                    self.apply_stored(st);
                }
                EngineEvent::Removed {
                    hashes,
                    medium,
                    group_idx,
                } => {
                    self.stats.events_removed += 1;
                    self.apply_removed(hashes, medium.as_ref(), *group_idx);
                }
                EngineEvent::Cleared => {
                    self.stats.events_cleared += 1;
                    self.map.clear();
                    self.fifo.clear();
                    self.tier_counts = [0; 3];
                    self.log.cleared();
                }
                EngineEvent::Unknown(_) => self.stats.events_unknown += 1,
                EngineEvent::Malformed { kind, .. } => {
                    self.stats.bad_events += 1;
                    if *kind == "BlockStored" {
                        // Skipping a store only under-reports.
                        self.stats.blocks_skipped[7] += 1;
                    } else {
                        // A removal (or an event of unknown shape) was lost: blocks could be advertised
                        // that the engine no longer holds.
                        lost = true;
                    }
                }
            }
        }
        if lost {
            self.reset(ResetReason::BadInput, entropy);
        }
        self.log.publish();
    }

    fn skip(&mut self, why: Skip, blocks: usize) {
        let i = Skip::ALL.iter().position(|&s| s == why).unwrap_or(0);
        self.stats.blocks_skipped[i] += blocks as u64;
    }

    fn tier_of(&mut self, medium: Option<&Medium>) -> Option<Tier> {
        match medium {
            None | Some(Medium::Gpu) => Some(Tier::Gpu),
            Some(Medium::Host) => Some(Tier::Host),
            Some(Medium::Disk) => Some(Tier::Disk),
            Some(Medium::Other(_)) => None,
        }
    }

    fn group_ok(&self, g: Option<i64>) -> bool {
        g.is_none_or(|g| g == self.cfg.group_idx)
    }

    /// The namespace index for a LoRA name and cache salt.
    fn namespace(&mut self, bs: usize, lora: Option<&str>, salt: Option<&str>) -> Option<u16> {
        let seed = namespace_seed(lora, salt);
        if let Some(&i) = self.ns_by_seed.get(&seed) {
            return Some(i);
        }
        if self.hashers.len() >= u16::MAX as usize {
            return None;
        }
        let base = BlockHasher::new(bs).ok()?;
        let h = base.namespaced(lora, salt);
        debug_assert_eq!(h.seed(), seed);
        let i = self.hashers.len() as u16;
        self.hashers.push(h);
        self.ns_by_seed.insert(seed, i);
        Some(i)
    }

    fn apply_stored(&mut self, st: &Stored) {
        let n = st.hashes.len();
        if n == 0 {
            return;
        }
        let Some(tier) = self.tier_of(st.medium.as_ref()) else {
            return self.skip(Skip::Medium, n);
        };
        if !self.group_ok(st.group_idx) {
            return self.skip(Skip::Group, n);
        }
        if st.token_ids.is_empty() {
            // A copy to another tier that names its blocks by engine hash only (vLLM's CPU offload):
            // the blocks must already be known.
            for &h in &st.hashes {
                match self.map.get(&h).copied() {
                    Some(e) => self.insert(h, e.kv, e.ns, tier),
                    None => self.skip(Skip::Orphan, 1),
                }
            }
            return;
        }
        if !self.learn_block_size(st.block_size) {
            return self.skip(Skip::BlockSize, n);
        }
        let bs = self.block_size.unwrap_or(0);
        if st.token_ids.len() != n.saturating_mul(bs) {
            return self.skip(Skip::TokenCount, n);
        }
        let lora = st.lora_name.as_deref();
        let extra = |i: usize| st.extra_keys.as_ref().and_then(|v| v.get(i));
        // Namespace and the parent's kvsteer hash.
        let (ns, parent_kv) = match st.parent {
            Some(p) => match self.map.get(&p) {
                Some(e) => (e.ns, Some(SeqHash(e.kv))),
                None => return self.skip(Skip::Orphan, n),
            },
            None => {
                let salt: Option<String> = match extra(0) {
                    None | Some(ExtraKeys::None) => st.cache_salt.clone(),
                    Some(ExtraKeys::Strings(v)) => match (lora, v.as_slice()) {
                        (Some(l), [a]) if a == l => st.cache_salt.clone(),
                        (Some(l), [a, s]) if a == l => Some(s.clone()),
                        (None, [s]) => Some(s.clone()),
                        _ => return self.skip(Skip::Unidentifiable, n),
                    },
                    Some(ExtraKeys::Opaque) => return self.skip(Skip::Unidentifiable, n),
                };
                match self.namespace(bs, lora, salt.as_deref()) {
                    Some(ns) => (ns, None),
                    None => return self.skip(Skip::Namespaces, n),
                }
            }
        };
        let usable = usable_blocks(st, lora);
        if usable < n {
            self.skip(Skip::Unidentifiable, n - usable);
        }
        if usable == 0 {
            return;
        }
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        self.hashers[ns as usize].extend_sequence(
            parent_kv,
            &st.token_ids[..usable * bs],
            &mut out,
        );
        for (i, kv) in out.iter().enumerate() {
            self.insert(st.hashes[i], kv.0, ns, tier);
        }
        self.scratch = out;
    }

    fn insert(&mut self, h: u64, kv: u64, ns: u16, tier: Tier) {
        let bit = tier_bit(tier);
        if let Some(e) = self.map.get_mut(&h) {
            if e.kv != kv {
                self.stats.hash_conflicts += 1;
                for t in Tier::ALL {
                    if e.tiers & tier_bit(t) != 0 {
                        self.log.removed(t, e.kv);
                        self.tier_counts[t as usize] -= 1;
                    }
                }
                e.kv = kv;
                e.ns = ns;
                e.tiers = 0;
            }
            if e.tiers & bit == 0 {
                e.tiers |= bit;
                self.tier_counts[tier as usize] += 1;
                self.log.stored(tier, kv);
                self.stats.blocks_stored += 1;
            } else {
                self.stats.blocks_duplicate += 1;
            }
            return;
        }
        self.stamp = self.stamp.wrapping_add(1);
        self.map.insert(
            h,
            Entry {
                kv,
                stamp: self.stamp,
                ns,
                tiers: bit,
            },
        );
        self.fifo.push_back((h, self.stamp));
        self.tier_counts[tier as usize] += 1;
        self.log.stored(tier, kv);
        self.stats.blocks_stored += 1;
        self.enforce_cap();
    }

    fn enforce_cap(&mut self) {
        while self.map.len() > self.max_blocks {
            let Some((h, stamp)) = self.fifo.pop_front() else {
                break;
            };
            if let Some(e) = self.map.get(&h).copied()
                && e.stamp == stamp
            {
                self.map.remove(&h);
                for t in Tier::ALL {
                    if e.tiers & tier_bit(t) != 0 {
                        self.log.removed(t, e.kv);
                        self.tier_counts[t as usize] -= 1;
                    }
                }
                self.stats.cap_evictions += 1;
            }
        }
        // Stale FIFO entries (blocks removed by the engine) are dropped once they outnumber live ones.
        if self.fifo.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.fifo
                .retain(|(h, s)| map.get(h).is_some_and(|e| e.stamp == *s));
        }
    }

    fn apply_removed(&mut self, hashes: &[u64], medium: Option<&Medium>, group: Option<i64>) {
        if !self.group_ok(group) {
            return;
        }
        let Some(tier) = self.tier_of(medium) else {
            // Never stored under that medium either.
            return;
        };
        let bit = tier_bit(tier);
        for h in hashes {
            match self.map.get_mut(h) {
                Some(e) if e.tiers & bit != 0 => {
                    e.tiers &= !bit;
                    self.tier_counts[tier as usize] -= 1;
                    let (kv, empty) = (e.kv, e.tiers == 0);
                    if empty {
                        self.map.remove(h);
                    }
                    self.log.removed(tier, kv);
                    self.stats.blocks_removed += 1;
                }
                _ => self.stats.removals_unknown += 1,
            }
        }
    }

    /// Records what the engine's `/metrics` said. The bound on blocks follows the engine's block count
    /// unless it was set; the block size is learned if it was not set.
    pub fn set_engine_load(&mut self, load: EngineLoad, entropy: u64) {
        if let (Some(prev), Some(now)) = (self.load.start_time, load.start_time)
            && prev != now
        {
            self.reset(ResetReason::EngineRestart, entropy);
            self.expected_seq = None;
        }
        if let Some(bs) = load.block_size {
            self.learn_block_size(bs);
        }
        if self.cfg.max_blocks.is_none()
            && let Some(n) = load.num_gpu_blocks
        {
            self.max_blocks = (n as usize)
                .saturating_mul(BLOCKS_PER_ENGINE_BLOCK)
                .max(MIN_MAX_BLOCKS);
            self.enforce_cap();
            self.log.publish();
        }
        self.load = load;
    }

    /// The load part of a feed answer (docs/guide/feed-adapter.md says what an engine cannot give).
    pub fn replica_load(&self) -> ReplicaLoad {
        let total = self.load.num_gpu_blocks.unwrap_or(0);
        let referenced = match (self.load.kv_usage, total) {
            (Some(u), t) if t > 0 && u.is_finite() => (u.clamp(0.0, 1.0) * t as f64).round() as u64,
            _ => 0,
        };
        ReplicaLoad {
            running: self.load.running.min(u32::MAX as u64) as u32,
            waiting: self.load.waiting.min(u32::MAX as u64) as u32,
            prefill_tokens: 0,
            decode_blocks: referenced,
            kv_used_blocks: referenced,
            kv_total_blocks: total,
            block_size: self.block_size.unwrap_or(0) as u32,
        }
    }

    /// Answers a poll of `/kvsteer/feed`.
    /// The data-parallel rank the feed answers carry (0 without one).
    pub fn dp_rank(&self) -> u16 {
        self.cfg
            .dp_rank
            .map_or(0, |r| r.min(u16::MAX as u32) as u16)
    }

    /// [`AdapterState::answer`], encoded with this view's rank.
    pub fn answer_bytes(&mut self, q: &FeedQuery) -> Vec<u8> {
        self.answer_bytes_for(q, false)
    }

    /// [`AdapterState::answer_bytes`], with the engine's LoRA adapters appended when the router
    /// asked for them (`adapters=1`) and the engine exports them (docs/reference/feed.md,
    /// "Adapters").
    pub fn answer_bytes_for(&mut self, q: &FeedQuery, with_adapters: bool) -> Vec<u8> {
        let rank = self.dp_rank();
        let mut body = self.answer(q).encode_for_rank(rank);
        if with_adapters && let Some(a) = &self.load.adapters {
            a.append_to(&mut body);
        }
        body
    }

    pub fn answer(&mut self, q: &FeedQuery) -> FeedBatch {
        self.log.publish();
        let load = self.replica_load();
        let map = &self.map;
        let batch = self.log.answer(q, load, || {
            Tier::ALL
                .into_iter()
                .map(|t| {
                    let bit = tier_bit(t);
                    let hashes: Vec<u64> = map
                        .values()
                        .filter(|e| e.tiers & bit != 0)
                        .map(|e| e.kv)
                        .collect();
                    (t, hashes)
                })
                .collect()
        });
        if batch.resync {
            self.stats.polls_resync += 1;
        } else {
            self.stats.polls_incremental += 1;
        }
        batch
    }
}

/// How many leading blocks of a stored batch kvsteer can identify: blocks after the first (or
/// every block when chained to a parent) may carry only the LoRA name as extra keys.
fn usable_blocks(st: &Stored, lora: Option<&str>) -> usize {
    let n = st.hashes.len();
    let extra = |i: usize| st.extra_keys.as_ref().and_then(|v| v.get(i));
    let first_checked = usize::from(st.parent.is_none());
    let mut usable = n;
    for i in first_checked..n {
        let ok = match extra(i) {
            None | Some(ExtraKeys::None) => true,
            Some(ExtraKeys::Strings(v)) => {
                matches!((lora, v.as_slice()), (Some(l), [a]) if a == l)
            }
            Some(ExtraKeys::Opaque) => false,
        };
        if !ok {
            usable = i;
            break;
        }
    }
    usable
}

#[cfg(test)]
mod tests;
