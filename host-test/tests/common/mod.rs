//! Shared setup of the integration tests: the crate's own (`kvsteer_host_test::testing`, which the
//! lab's tests use too) and the helpers only these tests need.
#![allow(dead_code, unused_imports)]

pub mod hf;

pub use kvsteer_host_test::testing::{assert_clean, harness_with, module, tokens};
use kvsteer_host_test::{Harness, HarnessConfig, RequestSpec};
use std::collections::BTreeSet;

/// A harness with the small config and `policy`, after its first feed polls.
pub fn harness(policy: &str) -> Harness {
    harness_with(HarnessConfig::small(policy))
}

/// A harness with one worker: for tests of the index itself (prefix landing, restarts, recovery).
/// How followers share the index is tested on its own, with two workers.
pub fn single_worker(policy: &str) -> Harness {
    let mut cfg = HarnessConfig::small(policy);
    cfg.workers = 1;
    harness_with(cfg)
}

/// `prefix` followed by `n` fresh tokens.
pub fn extend(prefix: &[u32], seed: u64, n: usize) -> Vec<u32> {
    let mut p = prefix.to_vec();
    p.extend(tokens(seed, n));
    p
}

/// Load shared between workers, in the host mode `config` sets up (it makes a config from a policy):
/// worker 0 sends three long requests, which `least_load` spreads; worker 1 must then pick the
/// fourth replica. Feeds are polled once at start, so replica-reported load cannot leak what worker 0
/// did: worker 1 can only learn it through shared data, where each worker publishes its load every
/// tick under one key (so the newest record must be the one read, not the first one written). Four
/// routing seeds, so a blind worker 1 (a random pick among four tied replicas) passes by luck with
/// probability 1/256. `settle_us` of virtual time runs before the first request.
pub fn check_workers_see_each_others_load(config: fn(&str) -> HarnessConfig, settle_us: u64) {
    for seed in 1..=4u64 {
        let mut cfg = config("least_load");
        cfg.feed_period_ms = 3_600_000;
        cfg.routing = serde_json::json!({"policy": "least_load", "block_size": 16, "seed": seed});
        let mut h = harness_with(cfg);
        if settle_us > 0 {
            h.run_for(settle_us).unwrap();
        }
        let mut busy = BTreeSet::new();
        for i in 0..3u64 {
            let id = h
                .send(&RequestSpec::new(tokens(40 + i, 1024), 4000).worker(0))
                .unwrap();
            busy.insert(h.record(id).unwrap().replica.unwrap());
        }
        assert_eq!(
            busy.len(),
            3,
            "least_load spreads worker 0's requests: {busy:?}"
        );
        h.run_for(300_000).unwrap();
        let id = h
            .send(&RequestSpec::new(tokens(99, 1024), 4000).worker(1))
            .unwrap();
        let r = h.record(id).unwrap().replica.unwrap();
        assert!(
            !busy.contains(&r),
            "seed {seed}: worker 1 picked busy replica {r} (busy: {busy:?})"
        );
        h.run_until_idle(600_000_000).unwrap();
        assert_clean(&h);
    }
}
