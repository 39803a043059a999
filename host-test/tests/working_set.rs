//! The working-set term's gauges through the real `.wasm` (docs/design.md section 2.6): an operator
//! checks `kvsteer_cache_size_blocks_<replica>` (the cache size the filter learned from the feed, 0
//! while unknown) and `kvsteer_working_set_blocks_<replica>` (the recent working set it estimates)
//! to see whether the term is at work. Four replicas of 2,048 KV blocks, two workers; eight sessions
//! ask for the same 2,048-token context four times each, between distinct 4,096-token prompts that
//! push the caches into eviction. The workers of a proxy share their admissions through shared data,
//! so a session whose turns go through different workers is still seen as reused; separate proxies
//! (no shared data) are not.

mod common;
use common::*;
use kvsteer_host_test::{Harness, HarnessConfig, RequestSpec};
use serde_json::{Value, json};

const REPLICAS: usize = 4;

fn run(routing: Value) -> Harness {
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.routing = routing;
    let mut h = harness_with(cfg);
    let start = h.now_us();
    let mut i = 0u64;
    for round in 0..4u64 {
        let sessions =
            (0..8u64).map(|s| RequestSpec::new(tokens(s, 2_048), 16).session(&format!("s{s}")));
        let distinct =
            (0..8u64).map(|s| RequestSpec::new(tokens(1_000 + round * 8 + s, 4_096), 16));
        for spec in sessions.chain(distinct) {
            h.run_until(start + i * 100_000).unwrap();
            h.send(&spec).unwrap();
            i += 1;
        }
    }
    h.run_until_idle(600_000_000).unwrap();
    h
}

fn gauges(h: &Harness, what: &str) -> Vec<i64> {
    (0..REPLICAS)
        .map(|r| {
            let name = format!("kvsteer_{what}_r{r}");
            h.proxy().metric(&name).map_or(-1, |m| m.value)
        })
        .collect()
}

#[test]
fn the_working_set_gauges_show_the_learned_cache_and_the_working_set() {
    let h = run(json!({"policy": "kv_load", "block_size": 16}));
    assert!(h.records().all(|r| r.released && !r.failed));
    let caps = gauges(&h, "cache_size_blocks");
    let ws = gauges(&h, "working_set_blocks");
    eprintln!("cache sizes {caps:?}, working sets {ws:?}");
    // Every gauge is defined; the caches that evicted have a learned size of at most their 2,048
    // blocks, and at least one did evict.
    assert!(caps.iter().chain(&ws).all(|&v| v >= 0), "{caps:?} {ws:?}");
    assert!(caps.iter().all(|&c| c <= 2_048), "{caps:?}");
    assert!(caps.iter().any(|&c| c > 1_000), "{caps:?}");
    // The sessions' contexts (8 x 128 blocks, asked for four times) are someone's working set.
    assert!(ws.iter().sum::<i64>() >= 128, "{ws:?}");
}

#[test]
fn with_the_term_off_the_working_set_is_zero_and_the_cache_size_still_learned() {
    let h =
        run(json!({"policy": "kv_load", "block_size": 16, "kv_load": {"overflow_weight": 0.0}}));
    let caps = gauges(&h, "cache_size_blocks");
    let ws = gauges(&h, "working_set_blocks");
    assert_eq!(ws, vec![0; REPLICAS]);
    assert!(caps.iter().any(|&c| c > 1_000), "{caps:?}");
}

/// Eight sessions of two 2,048-token turns, the first turn through worker 0 and the second through
/// worker 1, half a second apart: a worker alone sees each session once.
fn split_sessions(proxies: usize, workers: usize) -> Harness {
    let mut cfg = HarnessConfig::small("kv_load");
    (cfg.proxies, cfg.workers) = (proxies, workers);
    let mut h = harness_with(cfg);
    let start = h.now_us();
    for s in 0..8u64 {
        for turn in 0..2 {
            h.run_until(start + s * 200_000 + turn as u64 * 500_000)
                .unwrap();
            let spec = RequestSpec::new(tokens(s, 2_048), 16)
                .session(&format!("s{s}"))
                .worker(turn);
            h.send(&spec).unwrap();
        }
    }
    h.run_until_idle(600_000_000).unwrap();
    h
}

fn working_set_of(h: &Harness, proxy: usize) -> i64 {
    (0..REPLICAS)
        .map(|r| {
            let name = format!("kvsteer_working_set_blocks_r{r}");
            h.proxies()[proxy].metric(&name).map_or(0, |m| m.value)
        })
        .sum()
}

#[test]
fn the_workers_of_a_proxy_share_what_they_admitted() {
    let shared = split_sessions(1, 2);
    assert!(shared.records().all(|r| r.released && !r.failed));
    // Each session's context (128 blocks) was asked for twice, through two workers.
    let ws = working_set_of(&shared, 0);
    assert!(ws >= 8 * 128 * 3 / 4, "{ws}");
    // The same traffic through two proxies of one worker each: neither sees any reuse.
    let apart = split_sessions(2, 1);
    assert_eq!(
        (working_set_of(&apart, 0), working_set_of(&apart, 1)),
        (0, 0)
    );
}
