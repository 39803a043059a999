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
use kvsteer_host_test::bench::run::{ROUTER_SEED, config};
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
    let routing = json!({"policy": policy, "seed": ROUTER_SEED.wrapping_add(SEED)});
    let req = ReplayRequest {
        workload: choice(),
        replicas: 4,
        routing,
        kv_blocks_16: 0,
        feed_period_ms: 200,
        seed: SEED,
    };
    let page = run(&req, "").expect("playground replay");

    let workload = build_workload(&choice(), "").unwrap();
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

#[test]
fn round_robin_makes_the_same_decisions() {
    let (page, h) = both("round_robin");
    assert_eq!(page.requests, h.requests);
    assert_eq!(page.failed, h.failed);
    assert_eq!(page.prompt_tokens, h.prompt_tokens);
    // Round robin does not read load or cache: the same order of arrivals gives the same counts.
    assert_eq!(page.requests_per_replica, h.requests_per_replica);
    close("hit rate", page.hit_rate, h.hit_rate, 0.05);
    close("TTFT p50", page.ttft_ms.p50, h.ttft_ms.p50, 0.25);
    close(
        "output tok/s",
        page.output_tokens_per_s,
        h.output_tokens_per_s,
        0.05,
    );
}

#[test]
fn session_hash_pins_the_same_sessions() {
    let (page, h) = both("session_hash");
    assert_eq!(page.requests, h.requests);
    assert_eq!(page.failed, h.failed);
    // The ring depends only on the session key and the replica list: the same replica per session.
    assert_eq!(page.requests_per_replica, h.requests_per_replica);
    close("hit rate", page.hit_rate, h.hit_rate, 0.05);
    close(
        "output tok/s",
        page.output_tokens_per_s,
        h.output_tokens_per_s,
        0.05,
    );
}

#[test]
fn kv_load_agrees_within_bounds() {
    let (page, h) = both("kv_load");
    assert_eq!(page.requests, h.requests);
    assert_eq!(page.failed, h.failed);
    assert_eq!(page.prompt_tokens, h.prompt_tokens);
    // Load-aware choices see the load through different timing (callouts, chunked progress), so
    // individual decisions may differ; the aggregate must not.
    close("hit rate", page.hit_rate, h.hit_rate, 0.10);
    close("TTFT p50", page.ttft_ms.p50, h.ttft_ms.p50, 0.35);
    close(
        "output tok/s",
        page.output_tokens_per_s,
        h.output_tokens_per_s,
        0.10,
    );
    eprintln!(
        "kv_load: playground hit {:.3} ttft p50 {:.1} tok/s {:.0} per replica {:?}; harness hit {:.3} ttft p50 {:.1} tok/s {:.0} per replica {:?}",
        page.hit_rate,
        page.ttft_ms.p50,
        page.output_tokens_per_s,
        page.requests_per_replica,
        h.hit_rate,
        h.ttft_ms.p50,
        h.output_tokens_per_s,
        h.requests_per_replica
    );
}
