//! Each replica's recent working set: the distinct prompt blocks this router sent it within a time
//! window that are asked for more than once. An engine's prefix cache evicts least recently used
//! blocks, and LRU keeps almost nothing of a set of sessions that cycle through more context than the
//! cache holds: every session's next turn finds its context evicted by the others. Knowing how much
//! recent context each replica is asked to hold lets `kv_load` avoid pushing a replica whose sessions
//! still fit over its cache (`kv_load.overflow_weight`, docs/design/design.md section 2.6).
//!
//! A block asked for before (on any replica) within the window counts in full. A block asked for
//! only once so far counts with the probability that such a block is asked for again, learned from
//! the traffic: the share of recently requested blocks that had been requested before. An agent
//! session's first turn is the cache its next turn needs (the share is high, 0.9 and more on the
//! coding-agent trace), while distinct prompts are no cache to protect (the share is near 0): counting
//! them in full made a replica that served distinct prompts look full of live contexts, which it was
//! then kept from receiving (a replica back from an outage did not get its share back).
//!
//! Only a sample of the blocks is kept ([`Sampling`]): those whose hash has its low bits zero (one
//! in `working_set.sample`; block hashes are uniform), and counts are scaled back up. A
//! working set is thousands of blocks, so the estimate is within a few percent, and the per-request
//! work (a hash test per block, a map operation per sampled block) and the memory are that fraction
//! of an exact count's. In a proxy the fraction matters most where no request sees it: every worker
//! applies every other worker's sampled admissions on its tick (below).
//!
//! One table over all replicas: sampled block -> its holders, each with the time the block was last
//! requested there and whether it is counted there (asked for before, here or elsewhere); per
//! replica, a queue of (time, block) in request order and its counts. Entries older than the window
//! leave from the queue's front; a block requested again leaves a stale queue entry behind (its time
//! is not the holder's any more), and the queue is compacted when those dominate. The size is
//! bounded: past `max_sampled` entries a replica drops its oldest, so hostile or unusual traffic
//! costs bounded memory: per sampled block 48 bytes in the slab (wasm32; two holders inline, more on
//! the heap) and 10-20 in the hash table, per holder 16 bytes in its queue, up to three times that
//! with stale entries.
//!
//! Scoring a request ([`WorkingSet::added`]) and recording it ask, per sampled block, whether any
//! replica holds it and what each holds: one lookup. Recording a block is one lookup, its expiry
//! one. This layout is the working set's cost in a proxy (docs/reports/notebook/envoy-latency.md, "the
//! working set's cost"): with up to a few hundred thousand sampled blocks, every lookup misses the caches, and
//! each worker applies every other worker's admissions on its tick, so the cost per block is the
//! cost of the term. It replaced a map per replica (block -> time, counted) beside a map of holders
//! (block -> bitmasks), where recording a block took three lookups and its expiry three more; it
//! keeps exactly their times, counts, queues and estimates (tested against them), so decisions did
//! not change. A fleet of more than 64 routing units (the filter allows 256 replicas, and
//! data-parallel ranks multiply them) is scored by a pass over every replica per block seen.
//!
//! A proxy runs one router per worker thread, and each sees only the requests its worker admitted:
//! with 8 workers, each would see an eighth of every replica's working set and of its reuse. So the
//! routers share their admissions: with the journal on ([`WorkingSet::start_journal`]), each
//! recorded admission ([`WorkingSet::record`]) is kept, numbered, for a short while; the filter
//! publishes the journal ([`WorkingSet::encode_journal`]) every tick and every other worker applies
//! the entries it has not seen yet ([`WorkingSet::apply_peer`]) as if it had admitted them itself.
//! Each worker's view then lags the others' admissions by about a tick, and converges.
//!
//! The parts: `estimate.rs` (the estimator over the recorded blocks: what a request adds, what a
//! replica holds), `slots.rs` (the table of sampled blocks and their holders), `journal.rs` (the
//! admissions shared between a proxy's workers) and `wire.rs` (the bundles exchanged between
//! proxies).

mod estimate;
mod journal;
mod slots;
mod wire;

pub use journal::Applied;
pub use wire::{
    MAX_BUNDLE_PARTS, MAX_REMOTE_PEERS, decode_bundle, encode_bundle, format_after, journal_after,
    parse_after,
};

use estimate::ReplicaSet;
use journal::Journal;
use slots::Slots;

/// Which blocks the working set keeps: one in `2^k`, those whose hash has its low `k` bits zero.
/// Block hashes are uniform, so any one in `2^k` is as good a sample as another, and the samples
/// nest: a block kept at one in 32 is kept at one in 8 too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sampling {
    mask: u64,
}

impl Sampling {
    /// The coarsest sample allowed: one block in this many.
    pub const MAX_ONE_IN: u64 = 1024;
    /// One block in 8, `working_set.sample`'s default.
    pub const DEFAULT: Sampling = Sampling { mask: 7 };

    /// One block in `n`; `None` unless `n` is a power of two from 1 to [`Sampling::MAX_ONE_IN`].
    pub fn one_in(n: u64) -> Option<Sampling> {
        (n.is_power_of_two() && n <= Self::MAX_ONE_IN).then(|| Sampling { mask: n - 1 })
    }

    /// Whether this sample keeps the block `key`.
    pub fn keeps(self, key: u64) -> bool {
        key & self.mask == 0
    }

    /// `n` of one block in `n`: what a sampled count is multiplied by.
    pub fn one_in_n(self) -> u64 {
        self.mask + 1
    }

    /// The keys this sample keeps, in order.
    pub fn sample(self, keys: impl Iterator<Item = u64>) -> Vec<u64> {
        keys.filter(|&k| self.keeps(k)).collect()
    }
}

/// Recent distinct blocks per replica (estimated from a sample).
#[derive(Clone, Debug)]
pub struct WorkingSet {
    window_ms: u64,
    sampling: Sampling,
    max_sampled: usize,
    replicas: Vec<ReplicaSet>,
    /// Every block some replica's set holds, with its holders (kept with `replicas`' queues).
    slots: Slots,
    /// Decayed counts of sampled blocks requested, and of those requested before (the reuse share).
    requested: f64,
    reused: f64,
    /// Admissions kept for the proxy's other workers; `None` while not sharing.
    journal: Option<Journal>,
}

impl WorkingSet {
    /// `max_blocks`: the most blocks one replica's set describes (the `sampling`'s share of that is
    /// kept).
    pub fn new(
        replicas: usize,
        window_ms: u64,
        max_blocks: usize,
        sampling: Sampling,
    ) -> WorkingSet {
        WorkingSet {
            window_ms,
            sampling,
            max_sampled: (max_blocks / sampling.one_in_n() as usize).max(1),
            replicas: vec![ReplicaSet::default(); replicas],
            slots: Slots::default(),
            requested: 0.0,
            reused: 0.0,
            journal: None,
        }
    }

    /// Which blocks this working set keeps: a request's keys are sampled by it before
    /// [`WorkingSet::added`] and [`WorkingSet::record`].
    pub fn sampling(&self) -> Sampling {
        self.sampling
    }
}

#[cfg(test)]
mod test_keys {
    use super::Sampling;

    /// Keys `0..n` scattered over the hash space like block hashes, sampled.
    pub(super) fn keys(range: std::ops::Range<u64>) -> Vec<u64> {
        Sampling::DEFAULT.sample(range.map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    }

    pub(super) fn near(got: f64, want: f64) -> bool {
        (got - want).abs() <= 0.1 * want
    }
}
