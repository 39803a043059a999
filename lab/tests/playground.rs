//! The browser playground's replay (`kvsteer_playground::replay`: the routing core called in-process)
//! against the harness running the compiled filter (`kvsteer_filter.wasm` in wasmtime), for the same
//! workload, fleet, routing configuration and seed.
//!
//! `scripts/test-playground` checks that the page shows exactly what the native build of the replay
//! computes; this test closes the loop to the harness. The two cannot agree to the microsecond: the
//! harness moves through the proxy-wasm ABI with a callout latency, ticks, chunked SSE bodies (decode
//! progress every `chunk_tokens`) and a per-worker feed schedule, where the playground hands events to
//! the router directly. So the test pins what must be equal (requests, failures, prompt tokens, the
//! decisions of the policies that do not look at timing) and bounds the rest.

mod common;

use common::module;
use kvsteer_host_test::Harness;
use kvsteer_lab::bench::run::{ROUTER_SEED, config};
use kvsteer_playground::replay::{
    ReplayRequest, ReplayResult, WorkloadChoice, build_workload, run,
};
use kvsteer_sim::EngineConfig;
use kvsteer_workload::{Driver, Mode, Summary};
use serde_json::json;

const SEED: u64 = 3;

fn choice() -> WorkloadChoice {
    WorkloadChoice::Rl {
        steps: 2,
        turns: 4,
        concurrency: 8,
        scale: 4,
    }
}

fn both(policy: &str) -> (ReplayResult, Summary) {
    // The bench's routing section for this policy and seed (its tie-break seed, block size and, for
    // session_hash, the ring draw), so both sides route alike.
    let workload = build_workload(&choice(), "").unwrap();
    let routing = config(policy, workload.block_size, SEED, 1).routing;
    assert_eq!(routing["seed"], json!(ROUTER_SEED.wrapping_add(SEED)));
    let req = ReplayRequest {
        workload: choice(),
        replicas: 4,
        routing,
        kv_blocks_16: 0,
        feed_period_ms: 200,
        seed: SEED,
    };
    let page = run(&req, "").expect("playground replay");

    let mode = workload.default_mode;
    assert!(matches!(mode, Mode::Closed { .. }));
    // The bench's harness configuration for this policy and seed, one worker, and the playground's
    // fleet: the simulator's default engine (`kv_blocks_16: 0`) at the workload's block size.
    let mut cfg = config(policy, workload.block_size, SEED, 1);
    cfg.engine = EngineConfig {
        block_size: workload.block_size as usize,
        seed: SEED,
        ..EngineConfig::default()
    };
    let mut h = Harness::new(module(), cfg).expect("harness");
    h.run_workload(Driver::new(workload, mode), |_, _| {})
        .expect("harness replay");
    (page, h.summary(policy))
}

fn close(what: &str, page: f64, harness: f64, rel: f64) {
    let tol = rel * harness.abs().max(page.abs());
    assert!(
        (page - harness).abs() <= tol,
        "{what}: playground {page:.3} vs harness {harness:.3} (allowed {:.0}%)",
        rel * 100.0
    );
}

/// What every policy must reproduce: the same requests served, none failed in one and not the other,
/// the same prompt tokens; then hit rate, TTFT p50 and throughput within `hit`, `ttft`, `rate`.
fn agree(page: &ReplayResult, h: &Summary, hit: f64, ttft: f64, rate: f64) {
    assert_eq!(page.requests, h.requests);
    assert_eq!(page.failed, h.failed);
    assert_eq!(page.prompt_tokens, h.prompt_tokens);
    close("hit rate", page.hit_rate, h.hit_rate, hit);
    close("TTFT p50", page.ttft_ms.p50, h.ttft_ms.p50, ttft);
    let (p, q) = (page.output_tokens_per_s, h.output_tokens_per_s);
    close("output tok/s", p, q, rate);
    eprintln!(
        "{}: playground hit {:.3} ttft p50 {:.1} tok/s {p:.0} per replica {:?}; \
         harness hit {:.3} ttft p50 {:.1} tok/s {q:.0} per replica {:?}",
        page.policy,
        page.hit_rate,
        page.ttft_ms.p50,
        page.requests_per_replica,
        h.hit_rate,
        h.ttft_ms.p50,
        h.requests_per_replica
    );
}

#[test]
fn round_robin_makes_the_same_decisions() {
    let (page, h) = both("round_robin");
    agree(&page, &h, 0.01, 0.05, 0.01);
    // Round robin does not read load or cache: the same order of arrivals gives the same counts.
    assert_eq!(page.requests_per_replica, h.requests_per_replica);
}

#[test]
fn session_hash_pins_the_same_sessions() {
    let (page, h) = both("session_hash");
    agree(&page, &h, 0.01, 0.05, 0.01);
    // The ring depends only on the session key and the replica list: the same replica per session.
    assert_eq!(page.requests_per_replica, h.requests_per_replica);
}

#[test]
fn kv_load_agrees_within_bounds() {
    // Load-aware choices see the load through different timing (callouts, chunked progress), so
    // individual decisions may differ; the aggregate must not.
    let (page, h) = both("kv_load");
    agree(&page, &h, 0.10, 0.35, 0.10);
}
