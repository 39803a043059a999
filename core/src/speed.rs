//! How fast a replica computes, in seconds: the engine profile `kv_time` prices a request with, and
//! each replica's learned speed against it.
//!
//! A profile holds the same physical coefficients as the simulator's and `scripts/fit-profile`'s
//! (microseconds per step, per sequence, per token, per attention pair), so a fitted profile can be
//! given as it is. The router uses it for three things: the time to prefill `u` uncached tokens on top
//! of `c` cached ones, the time a decode step grows by per sequence and per context token beside it,
//! and the size of a replica's KV cache before the feed has shown it.
//!
//! No profile is exact for a real replica (another GPU, a noisy neighbour, thermal throttling), so
//! [`Speeds`] learns one factor per replica from what the router already sees: each request's time to
//! first token against the profile's prediction for it. The factor is an exponential average in log
//! space (a median-like estimate that one wild observation cannot move far), each observation clamped
//! to `[1/bound, bound]` and the factor with it: a replica is never trusted to be more than `bound`
//! times faster or slower than its profile, whatever it shows.

use serde::Deserialize;

/// An engine's speed, in the simulator's units (microseconds).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineProfile {
    #[serde(default)]
    pub name: String,
    /// Scheduler, kernel launch and host overhead per step.
    pub step_overhead_us: f64,
    /// Sampling and bookkeeping per sequence in a step.
    pub per_seq_us: f64,
    /// Reading the weights once: the floor of any step.
    pub weights_us: f64,
    /// Reading one context token's KV during decode.
    pub kv_read_us_per_token: f64,
    /// Linear layers per token computed.
    pub compute_us_per_token: f64,
    /// Prefill attention per (query token, context token) pair.
    pub attn_us_per_pair: f64,
    /// Tokens of prefill per step (vLLM's `max_num_batched_tokens`).
    #[serde(default = "default_chunk_tokens")]
    pub chunk_tokens: f64,
    /// The replica's prefix cache in tokens (vLLM's GPU blocks x block size).
    pub kv_cache_tokens: f64,
    // Fields of the simulator's profile form the router has no use for; accepted so that a fitted
    // profile can be pasted as it is.
    #[serde(default)]
    pub additive: bool,
    #[serde(default)]
    pub host_load_us_per_token: f64,
    /// Time a request spends outside the engine's steps (the API server), which `kv_time` takes
    /// off each observed first token before learning a replica's speed from it.
    #[serde(default)]
    pub request_overhead_us: f64,
    #[serde(default)]
    pub max_model_len: f64,
    #[serde(default)]
    pub kv_blocks_16: f64,
}

fn default_chunk_tokens() -> f64 {
    8192.0
}

/// Names of the built-in profiles, for errors and docs.
pub const PROFILE_NAMES: [&str; 3] = [
    "llama-3.1-8b-h100",
    "llama-3.1-70b-h100-tp4",
    "llama-3.1-8b-a100-40gb",
];

impl EngineProfile {
    /// A built-in profile by name. The coefficients are derived from each GPU's published peak
    /// figures and the model's shape, at the same efficiencies as the simulator's default
    /// (docs/design/simulator.md): 80% of memory bandwidth, 60% of dense BF16 for linear layers, 50% for
    /// attention.
    pub fn named(name: &str) -> Option<EngineProfile> {
        let p = |name: &str, overhead, weights, kv_read, compute, attn, kv_tokens| EngineProfile {
            name: name.to_string(),
            step_overhead_us: overhead,
            per_seq_us: 5.0,
            weights_us: weights,
            kv_read_us_per_token: kv_read,
            compute_us_per_token: compute,
            attn_us_per_pair: attn,
            chunk_tokens: default_chunk_tokens(),
            kv_cache_tokens: kv_tokens,
            additive: false,
            host_load_us_per_token: 0.0,
            request_overhead_us: 0.0,
            max_model_len: 0.0,
            kv_blocks_16: 0.0,
        };
        match name {
            // 16 GB of weights at 2.68 TB/s; 16 GFLOP a token at 593 TFLOPS; 128 KiB of KV a token.
            "llama-3.1-8b-h100" => Some(p(name, 300.0, 6000.0, 0.049, 27.0, 0.00106, 409_600.0)),
            // 140 GB of weights over 4 GPUs (35 GB each at 2.68 TB/s, plus the all-reduces in the
            // step overhead); 140 GFLOP a token over 4 x 593 TFLOPS; 320 KiB of KV a token spread
            // over 4 GPUs; about 35 GB of KV per GPU.
            "llama-3.1-70b-h100-tp4" => {
                Some(p(name, 600.0, 13_000.0, 0.031, 59.0, 0.00133, 430_000.0))
            }
            // 16 GB of weights at 1.24 TB/s (80% of 1.55); 16 GFLOP a token at 187 TFLOPS; about
            // 18 GB left for KV: 147K tokens, a cache that evicts under multi-turn traffic.
            "llama-3.1-8b-a100-40gb" => {
                Some(p(name, 300.0, 12_900.0, 0.106, 86.0, 0.00336, 147_000.0))
            }
            _ => None,
        }
    }

    /// Checks every coefficient is a finite number >= 0 and the sizes are at least 1.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("step_overhead_us", self.step_overhead_us),
            ("per_seq_us", self.per_seq_us),
            ("weights_us", self.weights_us),
            ("kv_read_us_per_token", self.kv_read_us_per_token),
            ("compute_us_per_token", self.compute_us_per_token),
            ("attn_us_per_pair", self.attn_us_per_pair),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be a finite number >= 0, got {v}"));
            }
        }
        for (name, v) in [
            ("chunk_tokens", self.chunk_tokens),
            ("kv_cache_tokens", self.kv_cache_tokens),
        ] {
            if !(v.is_finite() && v >= 1.0) {
                return Err(format!("{name} must be a finite number >= 1, got {v}"));
            }
        }
        if self.compute_us_per_token <= 0.0 {
            return Err("compute_us_per_token must be above 0".into());
        }
        Ok(())
    }

    /// The context length at which a prefill token's attention costs as much as its linear layers:
    /// the unit the load table books queued prefill in ([`crate::load::prefill_work`]).
    pub fn attention_context_tokens(&self) -> f64 {
        if self.attn_us_per_pair > 0.0 {
            (self.compute_us_per_token / self.attn_us_per_pair).max(1.0)
        } else {
            f64::MAX
        }
    }

    /// Seconds of prefill work booked as `work` tokens of a short prompt ([`crate::load::prefill_work`]).
    pub fn work_s(&self, work: f64) -> f64 {
        work * self.compute_us_per_token * 1e-6
    }

    /// Chunked-prefill steps `tokens` of prompt take (`chunk_tokens` a step), at least `min_steps`:
    /// the one count every prefill and mixed-step estimate uses.
    pub fn prefill_steps(&self, tokens: f64, min_steps: f64) -> f64 {
        (tokens.max(0.0) / self.chunk_tokens.max(1.0))
            .ceil()
            .max(min_steps)
    }

    /// Seconds to prefill `uncached` tokens after `cached` ones on an otherwise idle replica: linear
    /// layers (or the weights' read, whichever is longer, per chunk), attention over each token's
    /// context, and a step's overhead per chunk.
    pub fn prefill_s(&self, uncached: f64, cached: f64) -> f64 {
        let u = uncached.max(0.0);
        let c = cached.max(0.0);
        let chunks = self.prefill_steps(u, 1.0);
        let linear = (self.compute_us_per_token * u).max(self.weights_us * chunks);
        let attention = self.attn_us_per_pair * u * (c + u / 2.0);
        (linear + attention + self.step_overhead_us * chunks) * 1e-6
    }

    /// Seconds of one decode step of `seqs` sequences holding `context_tokens` of KV: overhead,
    /// sampling, and the weights' and the KV's read (decode is bound by memory).
    pub fn step_s(&self, seqs: f64, context_tokens: f64) -> f64 {
        self.step_overhead_us * 1e-6
            + self.weights_us * 1e-6
            + self.decode_step_extra_s(seqs, context_tokens)
    }

    /// Seconds a prefill step of `prefill_tokens` grows by when `seqs` decoding sequences holding
    /// `context_tokens` of KV share it (chunked prefill runs both in one step): their sampling, and
    /// their KV read and their tokens where those outlast the prefill's own arithmetic. A long chunk
    /// hides the decodes' reads under its compute; a short one does not, so a short prefill on a
    /// replica with a large batch takes about a decode step, not its own few microseconds.
    pub fn mixed_step_extra_s(&self, seqs: f64, context_tokens: f64, prefill_tokens: f64) -> f64 {
        let n = seqs.max(0.0);
        let read = self.kv_read_us_per_token * context_tokens.max(0.0);
        let p = prefill_tokens.max(0.0);
        let body = if self.additive {
            read + self.compute_us_per_token * n
        } else {
            (self.weights_us + read).max(self.compute_us_per_token * (p + n))
                - self.weights_us.max(self.compute_us_per_token * p)
        };
        (self.per_seq_us * n + body) * 1e-6
    }

    /// Seconds a decode step grows by for `seqs` sequences holding `context_tokens` of KV beside a
    /// request: their sampling and their KV read.
    pub fn decode_step_extra_s(&self, seqs: f64, context_tokens: f64) -> f64 {
        (self.per_seq_us * seqs.max(0.0) + self.kv_read_us_per_token * context_tokens.max(0.0))
            * 1e-6
    }
}

impl Default for EngineProfile {
    fn default() -> Self {
        EngineProfile::named(PROFILE_NAMES[0]).expect("built-in profile")
    }
}

mod learned;
mod learning;
pub use learned::{MIN_PREDICTED_S, SpeedEstimate, SpeedParams, Speeds};
pub use learning::{LearnedInputs, Learning, MAX_PENDING_PREDICTIONS};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_profile_is_valid_and_unknown_names_are_none() {
        for n in PROFILE_NAMES {
            let p = EngineProfile::named(n).unwrap();
            p.validate().unwrap();
            assert_eq!(p.name, n);
        }
        assert!(EngineProfile::named("gpt-5").is_none());
    }

    #[test]
    fn prefill_grows_with_tokens_and_with_context() {
        let p = EngineProfile::default();
        // 8,192 cold tokens: 221 ms of linear layers plus 36 ms of attention plus one overhead.
        let t = p.prefill_s(8192.0, 0.0);
        assert!((t - (8192.0 * 27.0 + 0.00106 * 8192.0 * 4096.0 + 300.0) * 1e-6).abs() < 1e-9);
        assert!(p.prefill_s(8192.0, 100_000.0) > 2.0 * t);
        // A tiny prefill costs a step bounded below by the weights' read.
        assert!((p.prefill_s(1.0, 0.0) - 6.3e-3).abs() < 1e-5);
        assert!(p.prefill_s(-5.0, f64::NAN).is_finite() || p.prefill_s(-5.0, 0.0) > 0.0);
    }
}
