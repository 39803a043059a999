//! Data-parallel ranks behind one endpoint (docs/design/dp.md): what a vLLM API server with
//! `--data-parallel-size N` does that a router can see.
//!
//! Each rank is its own [`Engine`] (own KV cache, own queue); the endpoint only decides which rank a
//! request goes to and what its feed says. Two pieces live here so that the harness (virtual time)
//! and the HTTP server (real time) behave the same:
//!
//! - [`DpBalancer`]: the rank for a request that does not name one (no `x-data-parallel-rank`
//!   header), as vLLM's internal balancer picks it: `DPLBAsyncMPClient.get_core_engine_for_request`
//!   in `vllm/v1/engine/core_client.py` scores each engine `4 * waiting + running` from counts the
//!   DP coordinator publishes about every 100 ms, takes the lowest score scanning from the client's
//!   start index (the first wins a tie), and adds the request to the chosen engine's waiting count
//!   locally until the next update. It never looks at the KV cache.
//! - [`UnionFeed`]: the feed a rank-blind router gets for the whole endpoint: a block is held if any
//!   rank holds it (per-rank reference counts, so one rank evicting a block another still holds is
//!   not reported as gone), and the load is the ranks' sum. It is the most a router that cannot
//!   address ranks could know, so it is the fair baseline for rank-aware routing.

use crate::engine::Engine;
use kvsteer_core::feed::log::FeedLog;
use kvsteer_core::feed::{
    CursorVerdict, FeedBatch, FeedCursor, FeedEvent, FeedQuery, ReplicaLoad, Tier,
};
use std::collections::{HashMap, HashSet};

/// How often vLLM's DP coordinator publishes the engines' request counts to the API servers
/// (the 100 ms the comment beside the balancer's local increment names).
pub const STATS_PERIOD_US: u64 = 100_000;

/// vLLM's internal DP load balancer for requests without a rank (see the module documentation).
#[derive(Clone, Debug)]
pub struct DpBalancer {
    /// Per rank `[waiting, running]` as last published, plus local increments since.
    counts: Vec<[u64; 2]>,
    /// When `counts` were last refreshed from the engines (`None`: never).
    refreshed_us: Option<u64>,
    /// The first index scanned (vLLM: the API server's client index modulo the engine count; one
    /// API server is client 0).
    start: usize,
}

impl DpBalancer {
    pub fn new(ranks: usize) -> DpBalancer {
        DpBalancer {
            counts: vec![[0, 0]; ranks.max(1)],
            refreshed_us: None,
            start: 0,
        }
    }

    /// The rank for a request arriving at `now_us`; `load(r)` reads rank `r`'s `(waiting, running)`
    /// when a coordinator update is due.
    pub fn choose(&mut self, now_us: u64, mut load: impl FnMut(usize) -> (u32, u32)) -> usize {
        let due = self
            .refreshed_us
            .is_none_or(|t| now_us.saturating_sub(t) >= STATS_PERIOD_US);
        if due {
            for (r, c) in self.counts.iter_mut().enumerate() {
                let (w, run) = load(r);
                *c = [w as u64, run as u64];
            }
            self.refreshed_us = Some(now_us);
        }
        let n = self.counts.len();
        let mut best = (u64::MAX, 0);
        for i in 0..n {
            let idx = (self.start + i) % n;
            let [w, run] = self.counts[idx];
            let score = w.saturating_mul(4).saturating_add(run);
            if score < best.0 {
                best = (score, idx);
            }
        }
        self.counts[best.1][0] += 1;
        best.1
    }
}

/// The rank-blind feed of an endpoint serving several ranks (see the module documentation).
#[derive(Debug)]
pub struct UnionFeed {
    log: FeedLog,
    cursors: Vec<FeedCursor>,
    /// What each rank holds, as its own feed last said.
    held: Vec<HashSet<(Tier, u64)>>,
    /// How many ranks hold each block.
    refs: HashMap<(Tier, u64), u32>,
}

/// Events asked of a rank per poll while catching up (a rank answers `MORE` past it).
const CATCH_UP_EVENTS: u32 = 1 << 16;

impl UnionFeed {
    pub fn new(ranks: usize, epoch: u64, max_log_hashes: usize) -> UnionFeed {
        let ranks = ranks.max(1);
        UnionFeed {
            log: FeedLog::new(epoch | 1, max_log_hashes),
            cursors: vec![FeedCursor::default(); ranks],
            held: vec![HashSet::new(); ranks],
            refs: HashMap::new(),
        }
    }

    fn store(&mut self, rank: usize, tier: Tier, h: u64) {
        if self.held[rank].insert((tier, h)) {
            let n = self.refs.entry((tier, h)).or_insert(0);
            *n += 1;
            if *n == 1 {
                self.log.stored(tier, h);
            }
        }
    }

    fn remove(&mut self, rank: usize, tier: Tier, h: u64) {
        if self.held[rank].remove(&(tier, h))
            && let Some(n) = self.refs.get_mut(&(tier, h))
        {
            *n -= 1;
            if *n == 0 {
                self.refs.remove(&(tier, h));
                self.log.removed(tier, h);
            }
        }
    }

    fn clear_rank(&mut self, rank: usize) {
        let mut all: Vec<(Tier, u64)> = self.held[rank].iter().copied().collect();
        all.sort_unstable();
        for (tier, h) in all {
            self.remove(rank, tier, h);
        }
    }

    /// Takes in everything rank `rank`'s engine logged since the last call.
    fn pull(&mut self, rank: usize, engine: &mut Engine) {
        // Bounded: a rank that keeps answering MORE is read again next time.
        for _ in 0..64 {
            let q = self.cursors[rank].query(CATCH_UP_EVENTS);
            let batch = engine.feed(&q);
            match self.cursors[rank].accept(&batch) {
                CursorVerdict::Gap => continue, // the next query asks for a snapshot
                CursorVerdict::ResetThenApply => {
                    self.clear_rank(rank);
                    self.apply(rank, &batch);
                }
                CursorVerdict::Apply => self.apply(rank, &batch),
            }
            if !batch.more {
                break;
            }
        }
    }

    fn apply(&mut self, rank: usize, batch: &FeedBatch) {
        for e in &batch.events {
            match e {
                FeedEvent::Stored { tier, hashes } => {
                    for &h in hashes {
                        self.store(rank, *tier, h);
                    }
                }
                FeedEvent::Removed { tier, hashes } => {
                    for &h in hashes {
                        self.remove(rank, *tier, h);
                    }
                }
                FeedEvent::Cleared => self.clear_rank(rank),
            }
        }
    }

    /// Answers a rank-blind poll of the endpoint: brings the union up to date with every rank, then
    /// answers from its own log; the load is the ranks' sum (block size: the first rank's).
    pub fn answer(&mut self, engines: &mut [&mut Engine], q: &FeedQuery) -> FeedBatch {
        let mut load = ReplicaLoad::default();
        for (r, e) in engines.iter_mut().enumerate().take(self.cursors.len()) {
            self.pull(r, e);
            let l = e.load();
            load.running += l.running;
            load.waiting += l.waiting;
            load.prefill_tokens += l.prefill_tokens;
            load.decode_blocks += l.decode_blocks;
            load.kv_used_blocks += l.kv_used_blocks;
            load.kv_total_blocks += l.kv_total_blocks;
            if load.block_size == 0 {
                load.block_size = l.block_size;
            }
        }
        self.log.publish();
        let refs = &self.refs;
        self.log.answer(q, load, || {
            let mut by_tier: Vec<(Tier, Vec<u64>)> =
                Tier::ALL.iter().map(|t| (*t, Vec::new())).collect();
            for &(t, h) in refs.keys() {
                by_tier[t as usize].1.push(h);
            }
            for (_, v) in &mut by_tier {
                v.sort_unstable();
            }
            by_tier
        })
    }

    /// Blocks held by at least one rank (tests, diagnostics).
    pub fn held_blocks(&self) -> usize {
        self.refs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{EngineConfig, EngineEvent, EngineRequest};

    #[test]
    fn the_balancer_scores_waiting_four_times_running_and_counts_its_own_choices() {
        let mut b = DpBalancer::new(4);
        // rank 0: 1 waiting (4); rank 1: 3 running (3); rank 2: 2 running (2); rank 3: 2 running (2).
        let loads = [(1, 0), (0, 3), (0, 2), (0, 2)];
        assert_eq!(b.choose(0, |r| loads[r]), 2, "lowest score, first of a tie");
        // Within the stats period the counts are not re-read: the local increment moves it on.
        assert_eq!(b.choose(10, |_| panic!("not due")), 3);
        assert_eq!(b.choose(20, |_| panic!("not due")), 1);
        // A coordinator update replaces the local counts.
        assert_eq!(b.choose(STATS_PERIOD_US, |_| (0, 0)), 0);
    }

    fn engine(seed: u64) -> Engine {
        Engine::new(EngineConfig {
            kv_blocks: 256,
            seed,
            ..EngineConfig::default()
        })
    }

    fn run(e: &mut Engine, id: u64, prompt: Vec<u32>) {
        let t = e.now_us();
        e.submit(
            t,
            EngineRequest {
                id,
                prompt,
                max_tokens: 2,
                ignore_eos: true,
                min_tokens: 0,
            },
        )
        .unwrap();
        let mut out: Vec<EngineEvent> = Vec::new();
        while let Some(t) = e.next_event_time() {
            e.advance(t, &mut out);
        }
    }

    fn held(b: &FeedBatch) -> HashSet<u64> {
        let mut s = HashSet::new();
        for e in &b.events {
            match e {
                FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes,
                } => s.extend(hashes),
                FeedEvent::Removed {
                    tier: Tier::Gpu,
                    hashes,
                } => {
                    for h in hashes {
                        s.remove(h);
                    }
                }
                FeedEvent::Cleared => s.clear(),
                _ => {}
            }
        }
        s
    }

    /// The union holds a block while any rank does, and says it is gone only when the last one
    /// drops it (a restart of one rank clears only that rank's share).
    #[test]
    fn the_union_feed_counts_holders_across_ranks() {
        let (mut a, mut b) = (engine(1), engine(2));
        let shared: Vec<u32> = (0..64).collect();
        run(&mut a, 1, shared.clone());
        run(&mut b, 2, shared.clone());
        let mut only_b = shared.clone();
        only_b.extend(1000..1064);
        run(&mut b, 3, only_b);
        let mut u = UnionFeed::new(2, 5, 1 << 16);
        let snap = u.answer(&mut [&mut a, &mut b], &FeedQuery::resync(4096));
        assert!(snap.resync);
        let first = held(&snap);
        // 4 shared blocks + 4 of b's own (64-token prompts, 16-token blocks; the last block of a
        // prompt is registered once computed).
        assert_eq!(first.len(), u.held_blocks());
        assert!(u.held_blocks() >= 7, "{}", u.held_blocks());
        let load = snap.load;
        assert_eq!(load.kv_total_blocks, 512);
        // Rank b restarts: its own blocks go, the shared ones stay (rank a holds them).
        b.restart(b.now_us());
        let q = FeedQuery {
            epoch: snap.epoch,
            cursor: snap.next_seq,
            max_events: 4096,
        };
        let inc = u.answer(&mut [&mut a, &mut b], &q);
        assert!(!inc.resync);
        let mut after = first.clone();
        for e in &inc.events {
            if let FeedEvent::Removed { hashes, .. } = e {
                for h in hashes {
                    after.remove(h);
                }
            }
        }
        let a_only = u.answer(&mut [&mut a], &FeedQuery::resync(4096));
        assert_eq!(after, held(&a_only), "what is left is exactly rank a's");
        assert!(after.len() < first.len());
    }
}
