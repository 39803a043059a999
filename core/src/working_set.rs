//! Each replica's recent working set: the distinct prompt blocks this router sent it within a time
//! window that are asked for more than once. An engine's prefix cache evicts least recently used
//! blocks, and LRU keeps almost nothing of a set of sessions that cycle through more context than the
//! cache holds: every session's next turn finds its context evicted by the others. Knowing how much
//! recent context each replica is asked to hold lets `kv_load` avoid pushing a replica whose sessions
//! still fit over its cache (`kv_load.overflow_weight`, docs/design.md section 2.6).
//!
//! A block asked for before (on any replica) within the window counts in full. A block asked for
//! only once so far counts with the probability that such a block is asked for again, learned from
//! the traffic: the share of recently requested blocks that had been requested before. An agent
//! session's first turn is the cache its next turn needs (the share is high, 0.9 and more on the
//! coding-agent trace), while distinct prompts are no cache to protect (the share is near 0): counting
//! them in full made a replica that served distinct prompts look full of live contexts, which it was
//! then kept from receiving (a replica back from an outage did not get its share back).
//!
//! Only a sample of the blocks is kept: those whose hash has its low [`SAMPLE_BITS`] bits zero (one
//! in 8; block hashes are uniform), and counts are scaled back up. A working set is thousands of
//! blocks, so the estimate is within a few percent, and the per-request work (a hash test per block,
//! a map operation per sampled block and replica) and the memory are an eighth of an exact count's.
//!
//! Per replica: a map sampled block -> (last time requested, counted) and a queue of (time, block)
//! in request order; entries older than the window leave from the queue's front. The size is
//! bounded: past `max_sampled` entries a replica drops its oldest, so hostile or unusual traffic
//! costs bounded memory (about 50 bytes an entry at worst, with the queue's stale entries).

use hashbrown::HashMap;
use std::collections::VecDeque;

/// One block in `2^SAMPLE_BITS` is sampled.
pub const SAMPLE_BITS: u32 = 3;
/// The reuse share's memory: its counts decay by this factor per request (about 50 requests).
const REUSE_DECAY: f64 = 0.98;
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
    /// Sampled block -> (last requested, counted: asked for before, here or elsewhere).
    entries: HashMap<u64, (u64, bool)>,
    order: VecDeque<(u64, u64)>,
    counted: usize,
}

impl ReplicaSet {
    fn expire(&mut self, before_ms: u64, max_sampled: usize) {
        while let Some(&(t, key)) = self.order.front() {
            if t >= before_ms && self.entries.len() <= max_sampled {
                break;
            }
            self.order.pop_front();
            if let Some(&(last, counted)) = self.entries.get(&key)
                && last == t
            {
                self.entries.remove(&key);
                self.counted -= counted as usize;
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
    /// Decayed counts of sampled blocks requested, and of those requested before (the reuse share).
    requested: f64,
    reused: f64,
}

impl WorkingSet {
    /// `max_blocks`: the most blocks one replica's set describes (an eighth of that is kept).
    pub fn new(replicas: usize, window_ms: u64, max_blocks: usize) -> WorkingSet {
        WorkingSet {
            window_ms,
            max_sampled: (max_blocks >> SAMPLE_BITS).max(1),
            replicas: vec![ReplicaSet::default(); replicas],
            requested: 0.0,
            reused: 0.0,
        }
    }

    /// The share of recently requested blocks that had been requested before: how likely a block
    /// asked for once is to be asked for again. 0 before any request.
    pub fn reuse_share(&self) -> f64 {
        if self.requested > 0.0 {
            (self.reused / self.requested).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    fn seen(&self, key: &u64) -> bool {
        self.replicas.iter().any(|s| s.entries.contains_key(key))
    }

    /// Records that `sampled_keys` (from [`sample`]) were requested on `replica` at `now_ms`.
    pub fn touch(&mut self, replica: usize, sampled_keys: &[u64], now_ms: u64) {
        if replica >= self.replicas.len() {
            return;
        }
        let mut reused = 0usize;
        for &key in sampled_keys {
            let seen = self.seen(&key);
            reused += seen as usize;
            let set = &mut self.replicas[replica];
            let was = set.entries.insert(key, (now_ms, seen));
            set.counted += seen as usize;
            set.counted -= was.is_some_and(|(_, c)| c) as usize;
            set.order.push_back((now_ms, key));
        }
        self.requested = self.requested * REUSE_DECAY + sampled_keys.len() as f64;
        self.reused = self.reused * REUSE_DECAY + reused as f64;
        let (window, max) = (self.window_ms, self.max_sampled);
        let set = &mut self.replicas[replica];
        set.expire(now_ms.saturating_sub(window), max);
        // Re-touched blocks leave stale queue entries behind; compact when they dominate.
        if set.order.len() > 2 * set.entries.len() + 1024 {
            let entries = &set.entries;
            set.order
                .retain(|(t, k)| entries.get(k).is_some_and(|&(last, _)| last == *t));
        }
    }

    /// Forgets what fell out of the window.
    pub fn expire(&mut self, now_ms: u64) {
        let before = now_ms.saturating_sub(self.window_ms);
        for set in &mut self.replicas {
            set.expire(before, self.max_sampled);
        }
    }

    /// Blocks in `replica`'s working set (as of the last `expire`/`touch`), estimated: those asked
    /// for before in full, those asked for once weighted by the reuse share.
    pub fn blocks(&self, replica: usize) -> f64 {
        self.replicas.get(replica).map_or(0.0, |s| {
            let once = s.entries.len() - s.counted;
            (s.counted as f64 + self.reuse_share() * once as f64) * (1u64 << SAMPLE_BITS) as f64
        })
    }

    /// Per replica, how much the request's blocks (`sampled_keys`, from [`sample`]) would grow its
    /// working set, estimated: a block asked for before joins in full where it is not held yet, and
    /// completes its weight where it is held as asked for once; a block never seen joins with the
    /// reuse share's weight.
    pub fn added(&self, sampled_keys: &[u64]) -> Vec<f64> {
        let p = self.reuse_share();
        let mut added = vec![0.0f64; self.replicas.len()];
        for k in sampled_keys {
            if !self.seen(k) {
                added.iter_mut().for_each(|a| *a += p);
                continue;
            }
            for (a, set) in added.iter_mut().zip(&self.replicas) {
                *a += match set.entries.get(k) {
                    Some(&(_, true)) => 0.0,
                    Some(&(_, false)) => 1.0 - p,
                    None => 1.0,
                };
            }
        }
        let scale = (1u64 << SAMPLE_BITS) as f64;
        added.into_iter().map(|a| a * scale).collect()
    }

    /// Sampled entries held over all replicas (for the memory figure).
    pub fn sampled_entries(&self) -> usize {
        self.replicas.iter().map(|s| s.entries.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys `0..n` scattered over the hash space like block hashes, sampled.
    fn keys(range: std::ops::Range<u64>) -> Vec<u64> {
        sample(range.map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    }

    fn near(got: f64, want: f64) -> bool {
        (got - want).abs() <= 0.1 * want
    }

    #[test]
    fn estimates_the_working_set_within_the_window() {
        let mut ws = WorkingSet::new(2, 1_000, 1 << 20);
        ws.touch(0, &keys(0..4_000), 0);
        // Nothing was asked for twice yet: no reuse, no working set.
        assert_eq!((ws.reuse_share(), ws.blocks(0)), (0.0, 0.0));
        ws.touch(0, &keys(0..6_000), 500);
        // 4,000 of the 6,000 were asked for before: they count in full, the 2,000 new ones with the
        // reuse share (4,000 of about 10,000 blocks requested, decayed).
        let p = ws.reuse_share();
        assert!((0.35..0.45).contains(&p), "{p}");
        assert!(
            near(ws.blocks(0), 4_000.0 + p * 2_000.0),
            "{}",
            ws.blocks(0)
        );
        assert_eq!(ws.blocks(1), 0.0);
        // Of 4,000..8,000: the 2,000 held once on replica 0 complete their weight there and join
        // replica 1 in full; the 2,000 never seen join either with the reuse share.
        let added = ws.added(&keys(4_000..8_000));
        assert!(
            near(added[0], 2_000.0 * (1.0 - p) + 2_000.0 * p),
            "{added:?}"
        );
        assert!(near(added[1], 2_000.0 + 2_000.0 * p), "{added:?}");
        assert_eq!(ws.added(&keys(0..4_000))[0], 0.0);
        // At 1,200 ms the first touch (0 ms) has left the window, but its blocks were touched again
        // at 500 ms.
        let before = ws.blocks(0);
        ws.expire(1_200);
        assert_eq!(ws.blocks(0), before);
        ws.expire(1_600);
        assert_eq!(ws.blocks(0), 0.0);
        assert_eq!(ws.sampled_entries(), 0);
    }

    #[test]
    fn distinct_prompts_make_no_working_set() {
        let mut ws = WorkingSet::new(2, u64::MAX, 1 << 22);
        for i in 0..100 {
            ws.touch(
                i % 2,
                &keys(i as u64 * 1_000..(i as u64 + 1) * 1_000),
                i as u64,
            );
        }
        assert_eq!(ws.reuse_share(), 0.0);
        assert_eq!((ws.blocks(0), ws.blocks(1)), (0.0, 0.0));
        assert_eq!(ws.added(&keys(500_000..501_000)), vec![0.0, 0.0]);
    }

    #[test]
    fn a_session_that_moves_counts_where_it_is_asked_for() {
        let mut ws = WorkingSet::new(3, 10_000, 1 << 20);
        let session = keys(0..8_000);
        ws.touch(0, &session, 0);
        ws.touch(0, &session, 5);
        assert!(near(ws.blocks(0), 8_000.0));
        // The session moves to replica 1: seen before, it counts there at once; replica 0 keeps it
        // until the window forgets it (its cache still holds it).
        ws.touch(1, &session, 10);
        assert!(near(ws.blocks(0), 8_000.0) && near(ws.blocks(1), 8_000.0));
        let n = (session.len() << SAMPLE_BITS) as f64;
        assert_eq!(ws.added(&session), vec![0.0, 0.0, n]);
    }

    #[test]
    fn only_one_block_in_eight_is_kept() {
        let mut ws = WorkingSet::new(1, u64::MAX, 1 << 20);
        let all: Vec<u64> = (0..6_400).collect();
        assert_eq!(sample(all.iter().copied()).len(), 800);
        let k = sample(all.into_iter());
        ws.touch(0, &k, 0);
        ws.touch(0, &k, 1);
        assert_eq!(ws.sampled_entries(), 800);
        assert_eq!(ws.blocks(0), 6_400.0);
    }

    #[test]
    fn size_is_bounded_and_out_of_range_replicas_are_ignored() {
        let mut ws = WorkingSet::new(2, u64::MAX, 64 * 8);
        let k: Vec<u64> = (0..1_000).map(|i| i * 8).collect();
        ws.touch(0, &k, 5);
        ws.touch(0, &k, 6);
        assert_eq!(ws.sampled_entries(), 64);
        assert_eq!(ws.blocks(0), 64.0 * 8.0);
        assert_eq!(ws.added(&k[990..]), vec![0.0, 80.0]);
        ws.touch(7, &k, 5);
        assert_eq!(ws.blocks(7), 0.0);
        assert_eq!(ws.sampled_entries(), 64);
    }

    #[test]
    fn retouching_does_not_grow_the_queue_without_bound() {
        let mut ws = WorkingSet::new(1, u64::MAX, 1 << 20);
        let k: Vec<u64> = (0..100).map(|i| i * 8).collect();
        for t in 0..1_000 {
            ws.touch(0, &k, t);
        }
        assert_eq!(ws.sampled_entries(), 100);
        assert_eq!(ws.blocks(0), 800.0);
        assert!(ws.replicas[0].order.len() <= 2 * 100 + 1024 + 100);
    }
}
