//! What one replay measured: the figures the bench, the demo and the P/D replay
//! ([`crate::disaggregated_fleet`]) all return.

use crate::HarnessStats;
use kvsteer_workload::{RequestRow, Summary};
use serde_json::{Value, json};

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
    /// Every request as recorded (replica, times, cached tokens), for `bench --rows`.
    pub rows: Vec<RequestRow>,
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
            "oracle_placed": s.oracle_placed,
            "oracle_moved": s.oracle_moved,
            "response_body_chunks": s.response_body_chunks,
            "peer_polls": s.peer_polls,
            "peer_polls_forwarded": s.peer_polls_forwarded,
            "peer_answer_bytes": s.peer_answer_bytes,
            "peer_entries_applied": s.peer_entries_applied,
            "peer_answers_refused": s.peer_answers_refused,
            "request_filter_us_mean": if s.requests > 0 {
                s.request_filter_ns as f64 / s.requests as f64 / 1e3
            } else {
                0.0
            },
        })
    }
}
