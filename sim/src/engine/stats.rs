//! What an engine counts for its `/metrics` page: vLLM's counters and its latency histograms,
//! kept across restarts.

/// Prometheus-style histogram with fixed upper bounds (seconds).
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    /// Count per bucket (non-cumulative); one extra for +Inf.
    pub counts: Vec<u64>,
    pub sum: f64,
    pub count: u64,
}

/// vLLM's `time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's `inter_token_latency_seconds` buckets.
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        let i = self.bounds.partition_point(|b| *b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }
}

/// Counters the engine keeps for `/metrics` (cumulative across restarts).
#[derive(Clone, Debug, PartialEq)]
pub struct EngineStats {
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    /// Prompt tokens looked up in the prefix cache (vLLM `prefix_cache_queries`).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found (vLLM `prefix_cache_hits`), host-tier hits included.
    pub prefix_cache_hits: u64,
    pub preemptions: u64,
    pub steps: u64,
    pub finished_length: u64,
    pub finished_stop: u64,
    pub finished_abort: u64,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// Requests submitted with remote KV ([`Engine::submit_remote`]) and the prompt tokens read for
    /// them over the link.
    pub remote_prefill_requests: u64,
    pub remote_prefill_tokens: u64,
    /// Random stalls ([`crate::stall`]) that held up a step, and the engine time they held it.
    pub stalls: u64,
    pub stalled_us: u64,
}

impl Default for EngineStats {
    fn default() -> Self {
        Self {
            prompt_tokens: 0,
            generation_tokens: 0,
            prefix_cache_queries: 0,
            prefix_cache_hits: 0,
            preemptions: 0,
            steps: 0,
            finished_length: 0,
            finished_stop: 0,
            finished_abort: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            remote_prefill_requests: 0,
            remote_prefill_tokens: 0,
            stalls: 0,
            stalled_us: 0,
        }
    }
}
