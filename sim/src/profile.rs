//! Step-time model: how long one engine step takes for the work scheduled in it.
//!
//! A decoder step is a roofline: it reads the weights once and the KV of every decoding sequence
//! (memory-bound at small batches) or does the linear-layer arithmetic for every token in the step
//! (compute-bound for prefill and large batches), whichever is slower; prefill attention is added on
//! top because it grows with the context each new token attends to, and a fixed CPU/launch cost and a
//! per-sequence cost (sampling, bookkeeping) are paid every step. Offloaded KV coming back from host
//! memory costs PCIe time per token. The derivation of the default numbers is in
//! docs/design/simulator.md.
//!
//! A profile fitted to a CPU engine (docs/reports/fidelity.md, `scripts/fit-profile`) is
//! `additive`: a CPU has no idle arithmetic units to hide memory reads behind, so the terms add up
//! instead of taking the larger of memory and compute. Profiles load from JSON (`kvsteer-sim serve
//! --profile FILE`).

use serde::{Deserialize, Serialize};

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
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    /// Sum every term (CPU engines) instead of the roofline's max(memory, compute).
    #[serde(default)]
    pub additive: bool,
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
    /// Latency a request spends outside the engine's steps (the API server's parsing and hand-off,
    /// the first token's way back). Only the HTTP server applies it, before submitting; the
    /// virtual-time engine does not.
    #[serde(default)]
    pub request_overhead_us: f64,
    /// Context limit of the model.
    pub max_model_len: u32,
    /// KV blocks of 16 tokens that fit beside the weights (vLLM's `# GPU blocks`, default 0.9 memory).
    pub kv_blocks_16: u32,
}

impl Profile {
    /// Llama-3.1-8B-Instruct, BF16, one H100 SXM 80 GB, vLLM defaults. Derived from the hardware's
    /// published peak figures and the model's shape (docs/design/simulator.md has the arithmetic
    /// and the comparison with published latencies).
    pub fn llama31_8b_h100() -> Profile {
        Profile {
            name: "llama-3.1-8b-h100".into(),
            additive: false,
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
            request_overhead_us: 0.0,
            max_model_len: 131_072,
            // (80 GB x 0.9 - 16 GB weights - ~2 GB activations) / 2 MiB a block.
            kv_blocks_16: 25_600,
        }
    }

    /// A built-in profile by name (`kvsteer_core::speed::PROFILE_NAMES`): the default, Llama-3.1-70B
    /// with tensor parallelism 4 on H100s, or Llama-3.1-8B on a 40 GB A100 (a small cache that
    /// evicts). The coefficients are the router's built-in profiles of the same names
    /// (`kvsteer_core::speed::EngineProfile::named`: one place for the figures), plus what only an
    /// engine needs: the host-memory tier's copy time (PCIe Gen5 for the H100s, Gen4 for the A100),
    /// the context limit, and the cache in 16-token blocks.
    pub fn named(name: &str) -> Option<Profile> {
        let e = kvsteer_core::speed::EngineProfile::named(name)?;
        let base = Profile::llama31_8b_h100();
        Some(Profile {
            name: e.name,
            step_overhead_us: e.step_overhead_us,
            per_seq_us: e.per_seq_us,
            weights_us: e.weights_us,
            kv_read_us_per_token: e.kv_read_us_per_token,
            compute_us_per_token: e.compute_us_per_token,
            attn_us_per_pair: e.attn_us_per_pair,
            host_load_us_per_token: if name.contains("a100") {
                2.0 * base.host_load_us_per_token
            } else {
                base.host_load_us_per_token
            },
            kv_blocks_16: (e.kv_cache_tokens / 16.0) as u32,
            ..base
        })
    }

    /// A profile from its JSON form (every field but `additive` and `request_overhead_us` required,
    /// unknown fields refused), checked: coefficients finite and not negative, a context limit.
    pub fn from_json(text: &str) -> Result<Profile, String> {
        let p: Profile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let coefficients = [
            ("step_overhead_us", p.step_overhead_us),
            ("per_seq_us", p.per_seq_us),
            ("weights_us", p.weights_us),
            ("kv_read_us_per_token", p.kv_read_us_per_token),
            ("compute_us_per_token", p.compute_us_per_token),
            ("attn_us_per_pair", p.attn_us_per_pair),
            ("host_load_us_per_token", p.host_load_us_per_token),
            ("request_overhead_us", p.request_overhead_us),
        ];
        for (name, v) in coefficients {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{name} must be a finite number >= 0, not {v}"));
            }
        }
        if p.max_model_len == 0 {
            return Err("max_model_len must be at least 1".into());
        }
        Ok(p)
    }

    /// Duration of one step in microseconds (before any slowdown fault).
    pub fn step_us(&self, w: &StepWork) -> f64 {
        let tokens = w.prefill_tokens + w.decode_seqs as u64;
        let memory = self.weights_us + self.kv_read_us_per_token * w.decode_kv_tokens as f64;
        let compute = self.compute_us_per_token * tokens as f64;
        let body = if self.additive {
            memory + compute
        } else {
            memory.max(compute)
        };
        self.step_overhead_us
            + self.per_seq_us * w.seqs as f64
            + body
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
    fn named_profiles_are_the_routers_and_the_default_is_unchanged() {
        assert_eq!(
            Profile::named("llama-3.1-8b-h100"),
            Some(Profile::llama31_8b_h100())
        );
        for n in kvsteer_core::speed::PROFILE_NAMES {
            let p = Profile::named(n).unwrap();
            let e = kvsteer_core::speed::EngineProfile::named(n).unwrap();
            assert_eq!(
                (p.compute_us_per_token, p.weights_us),
                (e.compute_us_per_token, e.weights_us)
            );
            assert_eq!(p.kv_blocks_16 as f64, (e.kv_cache_tokens / 16.0).floor());
        }
        assert!(Profile::named("nope").is_none());
    }

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
    fn additive_profile_sums_memory_and_compute_and_loads_from_json() {
        let json = r#"{"name": "cpu", "additive": true, "step_overhead_us": 3000,
            "per_seq_us": 100, "weights_us": 0, "kv_read_us_per_token": 0.01,
            "compute_us_per_token": 20, "attn_us_per_pair": 0.02, "host_load_us_per_token": 0,
            "request_overhead_us": 5000, "max_model_len": 8192, "kv_blocks_16": 32768}"#;
        let p = Profile::from_json(json).unwrap();
        assert!(p.additive);
        assert_eq!(p.request_overhead_us, 5000.0);
        let w = StepWork {
            seqs: 2,
            prefill_tokens: 10,
            decode_seqs: 1,
            decode_kv_tokens: 1000,
            prefill_attn_pairs: 55,
            host_load_tokens: 0,
        };
        let want = 3000.0 + 200.0 + 0.01 * 1000.0 + 20.0 * 11.0 + 0.02 * 55.0;
        assert!((p.step_us(&w) - want).abs() < 1e-9);
        let rt = Profile::from_json(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(rt, p);
        // The roofline takes the larger of memory and compute instead.
        let gpu = Profile::default();
        let gpu_json = serde_json::to_string(&gpu).unwrap();
        assert_eq!(Profile::from_json(&gpu_json).unwrap(), gpu);
        assert!(Profile::from_json(&json.replace("20,", "-1,")).is_err());
        assert!(Profile::from_json(&json.replace("\"name\"", "\"nome\"")).is_err());
        assert!(Profile::from_json(r#"{"name": "x"}"#).is_err());
    }

    #[test]
    fn pairs_are_causal() {
        assert_eq!(attn_pairs(0, 1), 1);
        assert_eq!(attn_pairs(0, 4), 10);
        assert_eq!(attn_pairs(10, 2), 20 + 3);
    }
}
