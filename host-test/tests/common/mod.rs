//! Shared setup of the integration tests: the compiled filter, loaded once per test binary.
#![allow(dead_code)]

pub mod hf;

use kvsteer_host_test::{FilterModule, Harness, HarnessConfig, RequestSpec, filter_wasm_path};
use std::collections::BTreeSet;
use std::sync::OnceLock;

/// The real filter (`kvsteer_filter.wasm`). Panics with the build command when it is not built.
pub fn module() -> &'static FilterModule {
    static M: OnceLock<FilterModule> = OnceLock::new();
    M.get_or_init(|| {
        let path = filter_wasm_path().unwrap_or_else(|e| panic!("{e}"));
        FilterModule::load(&path).unwrap_or_else(|e| panic!("{e}"))
    })
}

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

pub fn harness_with(cfg: HarnessConfig) -> Harness {
    let mut h = Harness::new(module(), cfg).unwrap_or_else(|e| panic!("{e}"));
    h.run_for(500_000).unwrap_or_else(|e| panic!("{e}"));
    h
}

/// `n` pseudo-random token ids from `seed` (distinct seeds share no block).
pub fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 100_000) as u32
        })
        .collect()
}

/// `prefix` followed by `n` fresh tokens.
pub fn extend(prefix: &[u32], seed: u64, n: usize) -> Vec<u32> {
    let mut p = prefix.to_vec();
    p.extend(tokens(seed, n));
    p
}

/// Asserts that no worker trapped, the host noticed no ABI misuse, nothing was logged at `critical`,
/// and the filter's load accounting found no request it could not release.
pub fn assert_clean(h: &Harness) {
    let anomalies = h
        .proxy()
        .metric("kvsteer_release_anomalies")
        .map_or(0, |m| m.value);
    assert_eq!(anomalies, 0, "release anomalies");
    for w in h.workers() {
        assert!(!w.is_dead(), "worker {} died", w.index());
        assert!(w.notes().is_empty(), "ABI misuse: {:?}", w.notes());
        let counts = w.log_counts();
        assert_eq!(counts[5], 0, "critical logs: {:?}", w.logs());
    }
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
