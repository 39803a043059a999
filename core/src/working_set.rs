//! Each replica's recent working set: the distinct prompt blocks this router sent it within a time
//! window. An engine's prefix cache evicts least recently used blocks, and LRU keeps almost nothing of
//! a set of sessions that cycle through more context than the cache holds: every session's next turn
//! finds its context evicted by the others. Knowing how much recent context each replica is asked to
//! hold lets `kv_load` avoid pushing a replica whose sessions still fit over its cache
//! (`kv_load.replica_cache_tokens`, docs/design.md).
//!
//! Only a sample of the blocks is kept: those whose hash has its low [`SAMPLE_BITS`] bits zero (one
//! in 8; block hashes are uniform), and counts are scaled back up. A working set is thousands of
//! blocks, so the estimate is within a few percent, and the per-request work (a hash test per block,
//! a map operation per sampled block) and the memory are an eighth of an exact count's.
//!
//! Per replica: a map sampled block -> last time requested and a queue of (time, block) in request
//! order; entries older than the window leave from the queue's front. The size is bounded: past
//! `max_sampled` entries a replica drops its oldest, so hostile or unusual traffic costs bounded
//! memory (about 50 bytes an entry at worst, with the queue's stale entries).

use hashbrown::HashMap;
use std::collections::VecDeque;

/// One block in `2^SAMPLE_BITS` is sampled.
pub const SAMPLE_BITS: u32 = 3;
const SAMPLE_MASK: u64 = (1 << SAMPLE_BITS) - 1;

fn sampled(key: &u64) -> bool {
    key & SAMPLE_MASK == 0
}

/// The keys the working set samples, in order.
pub fn sample(keys: impl Iterator<Item = u64>) -> Vec<u64> {
    keys.filter(sampled).collect()
}

#[derive(Clone, Debug, Default)]
struct ReplicaSet {
    last_ms: HashMap<u64, u64>,
    order: VecDeque<(u64, u64)>,
}

impl ReplicaSet {
    fn expire(&mut self, before_ms: u64, max_sampled: usize) {
        while let Some(&(t, key)) = self.order.front() {
            if t >= before_ms && self.last_ms.len() <= max_sampled {
                break;
            }
            self.order.pop_front();
            if self.last_ms.get(&key) == Some(&t) {
                self.last_ms.remove(&key);
            }
        }
    }
}

/// Recent distinct blocks per replica (estimated from a sample).
#[derive(Clone, Debug)]
pub struct WorkingSet {
    window_ms: u64,
    max_sampled: usize,
    replicas: Vec<ReplicaSet>,
}

impl WorkingSet {
    /// `max_blocks`: the most blocks one replica's set describes (it keeps an eighth of that).
    pub fn new(replicas: usize, window_ms: u64, max_blocks: usize) -> WorkingSet {
        WorkingSet {
            window_ms,
            max_sampled: (max_blocks >> SAMPLE_BITS).max(1),
            replicas: vec![ReplicaSet::default(); replicas],
        }
    }

    /// Records that `keys` were requested on `replica` at `now_ms`.
    pub fn touch(&mut self, replica: usize, keys: impl Iterator<Item = u64>, now_ms: u64) {
        let (window, max) = (self.window_ms, self.max_sampled);
        let Some(set) = self.replicas.get_mut(replica) else {
            return;
        };
        for key in keys.filter(sampled) {
            set.last_ms.insert(key, now_ms);
            set.order.push_back((now_ms, key));
        }
        set.expire(now_ms.saturating_sub(window), max);
        // Re-touched blocks leave stale queue entries behind; compact when they dominate.
        if set.order.len() > 2 * set.last_ms.len() + 1024 {
            let last = &set.last_ms;
            set.order.retain(|(t, k)| last.get(k) == Some(t));
        }
    }

    /// Forgets what fell out of the window.
    pub fn expire(&mut self, now_ms: u64) {
        let before = now_ms.saturating_sub(self.window_ms);
        for set in &mut self.replicas {
            set.expire(before, self.max_sampled);
        }
    }

    /// Distinct blocks requested on `replica` within the window (as of the last `expire`/`touch`),
    /// estimated.
    pub fn blocks(&self, replica: usize) -> usize {
        self.replicas
            .get(replica)
            .map_or(0, |s| s.last_ms.len() << SAMPLE_BITS)
    }

    /// How many of `keys` are not in `replica`'s working set, estimated.
    pub fn new_blocks(&self, replica: usize, keys: impl Iterator<Item = u64>) -> usize {
        let keys: Vec<u64> = sample(keys);
        self.new_sampled(replica, &keys)
    }

    /// [`WorkingSet::new_blocks`] for keys already passed through [`sample`] (one pass over a
    /// request's blocks for all replicas).
    pub fn new_sampled(&self, replica: usize, sampled_keys: &[u64]) -> usize {
        match self.replicas.get(replica) {
            Some(set) => {
                sampled_keys
                    .iter()
                    .filter(|k| !set.last_ms.contains_key(*k))
                    .count()
                    << SAMPLE_BITS
            }
            None => 0,
        }
    }

    /// Sampled entries held over all replicas (for the memory figure).
    pub fn sampled_entries(&self) -> usize {
        self.replicas.iter().map(|s| s.last_ms.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys `0..n` scattered over the hash space like block hashes.
    fn keys(range: std::ops::Range<u64>) -> impl Iterator<Item = u64> {
        range.map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    #[test]
    fn estimates_distinct_blocks_within_the_window() {
        let mut ws = WorkingSet::new(2, 1_000, 1 << 20);
        ws.touch(0, keys(0..4_000), 0);
        ws.touch(0, keys(0..6_000), 500);
        let near = |got: usize, want: f64| (got as f64 - want).abs() < 0.1 * want;
        assert!(near(ws.blocks(0), 6_000.0), "{}", ws.blocks(0));
        assert_eq!(ws.blocks(1), 0);
        assert!(near(ws.new_blocks(0, keys(4_000..8_000)), 2_000.0));
        assert!(near(ws.new_blocks(1, keys(4_000..8_000)), 4_000.0));
        // At 1,200 ms the first touch (0 ms) has left the window, but its blocks were touched again
        // at 500 ms.
        let before = ws.blocks(0);
        ws.expire(1_200);
        assert_eq!(ws.blocks(0), before);
        ws.expire(1_600);
        assert_eq!(ws.blocks(0), 0);
    }

    #[test]
    fn only_one_block_in_eight_is_kept() {
        let mut ws = WorkingSet::new(1, u64::MAX, 1 << 20);
        ws.touch(0, (0..800).map(|i| i * 8), 0);
        ws.touch(0, (0..800).map(|i| i * 8 + 1), 0);
        assert_eq!(ws.sampled_entries(), 800);
        assert_eq!(ws.blocks(0), 6_400);
    }

    #[test]
    fn size_is_bounded_and_out_of_range_replicas_are_ignored() {
        let mut ws = WorkingSet::new(1, u64::MAX, 64 * 8);
        ws.touch(0, (0..1_000).map(|i| i * 8), 5);
        assert_eq!(ws.sampled_entries(), 64);
        assert_eq!(ws.new_blocks(0, (990..1_000).map(|i| i * 8)), 0);
        assert_eq!(ws.new_blocks(0, (0..10).map(|i| i * 8)), 80);
        ws.touch(7, (0..10).map(|i| i * 8), 5);
        assert_eq!(ws.blocks(7), 0);
        assert_eq!(ws.new_blocks(7, (0..10).map(|i| i * 8)), 0);
    }

    #[test]
    fn retouching_does_not_grow_the_queue_without_bound() {
        let mut ws = WorkingSet::new(1, u64::MAX, 1 << 20);
        for t in 0..1_000 {
            ws.touch(0, (0..100).map(|i| i * 8), t);
        }
        assert_eq!(ws.sampled_entries(), 100);
        assert!(ws.replicas[0].order.len() <= 2 * 100 + 1024 + 100);
    }
}
