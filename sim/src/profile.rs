//! Step-time model: how long one engine step takes for the work scheduled in it.
//!
//! A decoder step is a roofline: it reads the weights once and the KV of every decoding sequence
//! (memory-bound at small batches) or does the linear-layer arithmetic for every token in the step
//! (compute-bound for prefill and large batches), whichever is slower; prefill attention is added on
//! top because it grows with the context each new token attends to, and a fixed CPU/launch cost and a
//! per-sequence cost (sampling, bookkeeping) are paid every step. Offloaded KV coming back from host
//! memory costs PCIe time per token. The derivation of the default numbers is in docs/simulator.md.

/// The work in one step, as the scheduler planned it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepWork {
    /// Sequences in the step (prefill chunks and decodes).
    pub seqs: u32,
    /// Prompt (or recompute) tokens computed in the step.
    pub prefill_tokens: u64,
    /// Sequences producing one decode token.
    pub decode_seqs: u32,
    /// Context tokens whose KV the decoding sequences read.
    pub decode_kv_tokens: u64,
    /// Causal attention pairs (query token x context token) of the prefill chunks.
    pub prefill_attn_pairs: u64,
    /// Tokens of KV loaded back from the host-memory tier.
    pub host_load_tokens: u64,
}

/// Per-step cost coefficients of one model on one GPU setup, in microseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    pub name: String,
    /// Scheduler, kernel launch and host overhead per step.
    pub step_overhead_us: f64,
    /// Sampling and bookkeeping per sequence in the step.
    pub per_seq_us: f64,
    /// Reading the weights once (the memory-bound floor of any step).
    pub weights_us: f64,
    /// Reading one context token's KV (all layers) during decode.
    pub kv_read_us_per_token: f64,
    /// Linear-layer arithmetic per token computed (prefill or decode).
    pub compute_us_per_token: f64,
    /// Prefill attention arithmetic per (query token, context token) pair.
    pub attn_us_per_pair: f64,
    /// Copying one token's KV back from host memory.
    pub host_load_us_per_token: f64,
    /// Context limit of the model.
    pub max_model_len: u32,
    /// KV blocks of 16 tokens that fit beside the weights (vLLM's `# GPU blocks`, default 0.9 memory).
    pub kv_blocks_16: u32,
}

impl Profile {
    /// Llama-3.1-8B-Instruct, BF16, one H100 SXM 80 GB, vLLM defaults. Derived from the hardware's
    /// published peak figures and the model's shape (docs/simulator.md has the arithmetic and the
    /// comparison with published latencies).
    pub fn llama31_8b_h100() -> Profile {
        Profile {
            name: "llama-3.1-8b-h100".into(),
            step_overhead_us: 300.0,
            per_seq_us: 5.0,
            // 16.06 GB of weights at ~2.68 TB/s (80% of the 3.35 TB/s HBM3 peak).
            weights_us: 6000.0,
            // 128 KiB of KV a token (32 layers x 8 KV heads x 128 dims x 2 (K,V) x 2 bytes).
            kv_read_us_per_token: 0.049,
            // 16.06 GFLOP a token at ~593 TFLOPS (60% of the 989 TFLOPS dense BF16 peak).
            compute_us_per_token: 27.0,
            // 4 x 32 layers x 4096 = 524,288 FLOP a pair at ~494 TFLOPS (50% of peak).
            attn_us_per_pair: 0.00106,
            // 128 KiB a token over PCIe Gen5 x16 at ~40 GB/s.
            host_load_us_per_token: 3.3,
            max_model_len: 131_072,
            // (80 GB x 0.9 - 16 GB weights - ~2 GB activations) / 2 MiB a block.
            kv_blocks_16: 25_600,
        }
    }

    /// Duration of one step in microseconds (before any slowdown fault).
    pub fn step_us(&self, w: &StepWork) -> f64 {
        let tokens = w.prefill_tokens + w.decode_seqs as u64;
        let memory = self.weights_us + self.kv_read_us_per_token * w.decode_kv_tokens as f64;
        let compute = self.compute_us_per_token * tokens as f64;
        self.step_overhead_us
            + self.per_seq_us * w.seqs as f64
            + memory.max(compute)
            + self.attn_us_per_pair * w.prefill_attn_pairs as f64
            + self.host_load_us_per_token * w.host_load_tokens as f64
    }
}

impl Default for Profile {
    fn default() -> Self {
        Profile::llama31_8b_h100()
    }
}

/// Causal attention pairs of a prefill chunk of `n` tokens starting after `ctx` computed tokens.
pub fn attn_pairs(ctx: u64, n: u64) -> u64 {
    n * ctx + n * (n + 1) / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_step_grows_with_kv_read_and_prefill_with_tokens() {
        let p = Profile::default();
        let small = StepWork {
            seqs: 1,
            decode_seqs: 1,
            decode_kv_tokens: 1000,
            ..Default::default()
        };
        let big = StepWork {
            seqs: 64,
            decode_seqs: 64,
            decode_kv_tokens: 64 * 4000,
            ..Default::default()
        };
        assert!(p.step_us(&big) > p.step_us(&small) + 1000.0);
        let pf = |n: u64| StepWork {
            seqs: 1,
            prefill_tokens: n,
            prefill_attn_pairs: attn_pairs(0, n),
            ..Default::default()
        };
        assert!(p.step_us(&pf(8192)) > 2.0 * p.step_us(&pf(2048)));
    }

    #[test]
    fn pairs_are_causal() {
        assert_eq!(attn_pairs(0, 1), 1);
        assert_eq!(attn_pairs(0, 4), 10);
        assert_eq!(attn_pairs(10, 2), 20 + 3);
    }
}
