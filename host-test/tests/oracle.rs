//! The oracle (`kvsteer_host_test::oracle`) in the harness: the harness, not the filter, places every
//! request, from the engines' exact state; the filter still carries the request.

mod common;
use common::*;
use kvsteer_host_test::oracle::Weights;
use kvsteer_host_test::{HarnessConfig, RequestSpec, ResponseFault};
use std::collections::BTreeSet;

const IDLE: u64 = 600_000_000;

fn oracle_harness() -> kvsteer_host_test::Harness {
    let mut cfg = HarnessConfig::small("round_robin");
    cfg.oracle = Some(Weights::default());
    harness_with(cfg)
}

#[test]
fn the_oracle_overrides_the_filter_toward_the_cache_and_away_from_a_down_replica() {
    let mut h = oracle_harness();
    // Replica 3 holds a prefix the filter has never seen (submitted straight to the engine): round
    // robin cannot know it, the oracle reads the engine's cache.
    let prefix = tokens(7, 4096);
    h.submit_direct(3, prefix.clone(), 2).unwrap();
    h.run_for(2_000_000).unwrap();
    // Replica 1 fails every request: down to the oracle.
    h.set_response_fault(1, ResponseFault::Status(503));
    for q in 0..8u64 {
        let id = h
            .send(&RequestSpec::new(extend(&prefix, q, 64), 16))
            .unwrap();
        h.run_until_idle(IDLE).unwrap();
        let r = h.record(id).unwrap();
        assert!(!r.failed && r.retried_from.is_none(), "{r:?}");
        assert_ne!(r.replica, Some(1), "{r:?}");
        // One at a time on an idle fleet: the holder is always the fastest.
        assert_eq!(r.replica, Some(3), "query {q}: {r:?}");
        assert!(r.cached_tokens >= 4096, "{r:?}");
    }
    // The filter chose by round robin, so the oracle moved most of them.
    assert_eq!(h.stats.oracle_placed, 8);
    assert!(h.stats.oracle_moved >= 4, "{:?}", h.stats);
    assert_eq!(
        h.replicas[1].faulted, 0,
        "no request reached the down replica"
    );
    // A burst of fresh prompts spreads over the three replicas that are up.
    let ids: Vec<u64> = (0..9u64)
        .map(|i| {
            h.send(&RequestSpec::new(tokens(100 + i, 3000), 64))
                .unwrap()
        })
        .collect();
    h.run_until_idle(IDLE).unwrap();
    let spread: BTreeSet<usize> = ids
        .iter()
        .map(|id| h.record(*id).unwrap().replica.unwrap())
        .collect();
    assert_eq!(spread, BTreeSet::from([0, 2, 3]));
    assert_clean(&h);
}
