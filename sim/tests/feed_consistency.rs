//! Randomized runs: a router that applies the feed incrementally (with small batches, so `MORE` is
//! exercised, and across restarts) always ends up with exactly what a snapshot says the replica caches,
//! and every request is reported finished exactly once with all its tokens.

use hashbrown::{HashMap, HashSet};
use kvsteer_core::feed::{CursorVerdict, FeedBatch, FeedCursor, FeedEvent, FeedQuery, Tier};
use kvsteer_sim::output::mix64;
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest, OutputLen};

#[derive(Default)]
struct RouterView {
    cursor: FeedCursor,
    held: HashSet<(Tier, u64)>,
    removed: usize,
}

impl RouterView {
    fn apply(&mut self, b: &FeedBatch) {
        match self.cursor.accept(b) {
            CursorVerdict::Gap => return,
            CursorVerdict::ResetThenApply => self.held.clear(),
            CursorVerdict::Apply => {}
        }
        for e in &b.events {
            match e {
                FeedEvent::Cleared => self.held.clear(),
                FeedEvent::Stored { tier, hashes } => {
                    for h in hashes {
                        assert!(
                            self.held.insert((*tier, *h)),
                            "stored twice without removal"
                        );
                    }
                }
                FeedEvent::Removed { tier, hashes } => {
                    self.removed += hashes.len();
                    for h in hashes {
                        assert!(
                            self.held.remove(&(*tier, *h)),
                            "removed a block never stored"
                        );
                    }
                }
            }
        }
    }

    fn sync(&mut self, e: &mut Engine, max_events: u32) {
        for _ in 0..10_000 {
            let b = e.feed(&self.cursor.query(max_events));
            let more = b.more;
            self.apply(&b);
            if !more && !self.cursor.want_resync {
                return;
            }
        }
        panic!("feed never caught up");
    }
}

fn truth(e: &mut Engine) -> HashSet<(Tier, u64)> {
    let b = e.feed(&FeedQuery::resync(1));
    let mut s = HashSet::new();
    for ev in b.events {
        if let FeedEvent::Stored { tier, hashes } = ev {
            s.extend(hashes.into_iter().map(|h| (tier, h)));
        }
    }
    s
}

/// Returns (preemptions, removals seen in the feed), to show the run exercised both.
fn run(seed: u64) -> (u64, usize) {
    let mut rng = seed;
    let mut next = move || {
        rng = mix64(rng);
        rng
    };
    let mut e = Engine::new(EngineConfig {
        kv_blocks: 48,
        host_blocks: if seed.is_multiple_of(2) { 24 } else { 0 },
        max_batch_tokens: 96,
        max_running: 6,
        output_len: OutputLen::Exponential { mean: 20.0 },
        seed,
        ..Default::default()
    });
    let mut view = RouterView::default();
    let mut out = Vec::new();
    let mut generated: HashMap<u64, u32> = HashMap::new();
    let mut finished: HashMap<u64, u32> = HashMap::new();
    let mut submitted = HashSet::new();
    let mut t = 0u64;
    for id in 0..300u64 {
        t += next() % 40_000;
        e.advance(t, &mut out);
        let prefix = (next() % 4) as u32;
        let mut prompt: Vec<u32> = (0..(next() % 100) as u32 + 16)
            .map(|i| prefix * 1000 + i)
            .collect();
        prompt.extend((0..(next() % 60) as u32).map(|i| 900_000 + id as u32 * 100 + i));
        let r = EngineRequest {
            id,
            prompt,
            max_tokens: (next() % 120) as u32 + 1,
            ignore_eos: next().is_multiple_of(3),
            min_tokens: (next() % 5) as u32,
        };
        if e.submit(t, r).is_ok() {
            submitted.insert(id);
        }
        match next() % 20 {
            0 => {
                e.abort(t, next() % (id + 1));
            }
            1 if next().is_multiple_of(10) => e.restart(t),
            2..=6 => view.sync(&mut e, (next() % 3) as u32 + 1),
            _ => {}
        }
        for ev in out.drain(..) {
            match ev {
                EngineEvent::FirstToken { id, .. } | EngineEvent::Token { id, .. } => {
                    assert!(!finished.contains_key(&id), "token after finish");
                    *generated.entry(id).or_default() += 1;
                }
                EngineEvent::Finished {
                    id,
                    completion_tokens,
                    ..
                } => {
                    assert!(
                        finished.insert(id, completion_tokens).is_none(),
                        "finished twice"
                    );
                }
            }
        }
        let load = e.load();
        assert!(load.kv_used_blocks <= load.kv_total_blocks);
    }
    while let Some(nt) = e.next_event_time() {
        e.advance(nt, &mut out);
    }
    e.advance(e.now_us(), &mut out);
    for ev in out.drain(..) {
        match ev {
            EngineEvent::FirstToken { id, .. } | EngineEvent::Token { id, .. } => {
                *generated.entry(id).or_default() += 1;
            }
            EngineEvent::Finished {
                id,
                completion_tokens,
                ..
            } => {
                assert!(
                    finished.insert(id, completion_tokens).is_none(),
                    "finished twice"
                );
            }
        }
    }
    assert_eq!(
        finished.len(),
        submitted.len(),
        "every request finished once"
    );
    for (id, n) in &finished {
        assert_eq!(
            generated.get(id).copied().unwrap_or(0),
            *n,
            "tokens of {id}"
        );
    }
    assert_eq!(e.load().running, 0);
    assert_eq!(e.decode_blocks(), 0);
    assert_eq!(e.kv_usage(), 0.0, "no block stays referenced");
    view.sync(&mut e, 2);
    assert_eq!(view.held, truth(&mut e), "seed {seed}");
    (e.stats().preemptions, view.removed)
}

#[test]
fn incremental_feed_matches_snapshot_across_random_runs() {
    let (mut preemptions, mut removed) = (0, 0);
    for seed in 0..24 {
        let (p, r) = run(seed);
        preemptions += p;
        removed += r;
    }
    assert!(preemptions > 0, "the runs preempt");
    assert!(removed > 0, "the runs evict");
}
