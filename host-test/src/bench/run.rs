//! One replay: a workload through the compiled filter, one policy, one seed, four identical simulated
//! replicas in virtual time. The demo and the bench both call [`replay`], so a figure in the README
//! and one in docs/results.md come from the same code path.

use crate::{FilterModule, Harness, HarnessConfig, HarnessStats};
use kvsteer_workload::{Driver, Mode, Summary, Workload};
use serde_json::{Value, json};
use std::time::Instant;

/// The filter's default `routing.seed` (docs/configuration.md).
pub const ROUTER_SEED: u64 = 0x006B_7673_7465_6572;

/// What one replay measured.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub policy: String,
    pub seed: u64,
    pub summary: Summary,
    /// TTFT of every finished request (ms), for CDFs.
    pub ttft_ms: Vec<f64>,
    /// Per-replica decode blocks over time (0.5 s bins), for the herding plots.
    pub decode_series: Vec<(f64, Vec<f64>)>,
    pub stats: HarnessStats,
    pub wall_s: f64,
    pub virtual_s: f64,
}

impl Outcome {
    /// The harness counters as JSON (the summary is serialized separately).
    pub fn harness_json(&self) -> Value {
        let s = &self.stats;
        json!({
            "requests": s.requests,
            "fallback": s.fallback,
            "local_responses": s.local_responses,
            "rejected": s.rejected,
            "failed": s.failed,
            "ticks": s.ticks,
            "callouts": s.callouts,
            "request_body_chunks": s.request_body_chunks,
            "response_body_chunks": s.response_body_chunks,
            "request_filter_us_mean": if s.requests > 0 {
                s.request_filter_ns as f64 / s.requests as f64 / 1e3
            } else {
                0.0
            },
        })
    }
}

/// The harness configuration of a replay: `policy` with the workload's block size in the filter, and
/// engines of the same block size (`crate::bench::scenario::Scenario::engine`), seeded with `seed`;
/// the router's tie-break generator gets [`ROUTER_SEED`] plus `seed` (seed 0 is the filter's default).
pub fn config(policy: &str, block_size: u32, seed: u64, workers: usize) -> HarnessConfig {
    let mut cfg = HarnessConfig::small(policy);
    cfg.workers = workers;
    cfg.engine = super::scenario::Scenario::engine(block_size, seed);
    cfg.routing =
        json!({"policy": policy, "block_size": block_size, "seed": ROUTER_SEED.wrapping_add(seed)});
    cfg
}

/// Replays `workload` driven by `mode` through the filter under `policy`; `progress(done, total)` is
/// called as requests finish.
pub fn replay(
    module: &FilterModule,
    workload: Workload,
    mode: Mode,
    policy: &str,
    seed: u64,
    workers: usize,
    progress: impl FnMut(u64, u64),
) -> Result<Outcome, String> {
    let started = Instant::now();
    let cfg = config(policy, workload.block_size, seed, workers);
    let mut h = Harness::new(module, cfg).map_err(|e| format!("{policy}: {e}"))?;
    h.run_workload(Driver::new(workload, mode), progress)
        .map_err(|e| format!("{policy}: {e}"))?;
    Ok(Outcome {
        policy: policy.to_string(),
        seed,
        summary: h.summary(policy),
        ttft_ms: h.recorder.ttft_ms(),
        decode_series: h.recorder.decode_series(),
        stats: h.stats.clone(),
        wall_s: started.elapsed().as_secs_f64(),
        virtual_s: h.now_us() as f64 / 1e6,
    })
}
