//! Output lengths and output token ids: deterministic per (seed, request id, position), so a virtual
//! replay is reproducible and a workload can append a turn's output to the next prompt without asking
//! the engine ([`output_token`]).

/// Vocabulary size of the stand-in (Llama 3's, 128,256 ids).
pub const VOCAB: u32 = 128_256;

/// SplitMix64: a tiny, well-mixed hash/generator; enough for a simulator's draws.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A uniform draw in (0, 1] from a hash value.
#[inline]
pub fn unit(h: u64) -> f64 {
    ((h >> 11) as f64 + 1.0) / (1u64 << 53) as f64
}

/// The token id the engine generates at `position` (0-based within the output) of request `id`.
#[inline]
pub fn output_token(seed: u64, id: u64, position: u32) -> u32 {
    let h = mix64(mix64(seed ^ 0x6f75_7470_7574) ^ mix64(id) ^ (position as u64).rotate_left(32));
    (h % VOCAB as u64) as u32
}

/// How many tokens a request generates when it does not force its length with `ignore_eos`.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputLen {
    /// Always `max_tokens` (as if every request set `ignore_eos`).
    Max,
    /// A fixed length.
    Fixed(u32),
    /// Uniform in `min..=max`.
    Uniform { min: u32, max: u32 },
    /// Exponential with this mean (many short answers, a long tail), at least 1.
    Exponential { mean: f64 },
}

impl Default for OutputLen {
    fn default() -> Self {
        OutputLen::Exponential { mean: 256.0 }
    }
}

impl OutputLen {
    /// The natural ("EOS") length of request `id`, before `min_tokens` and `max_tokens` apply.
    pub fn draw(&self, seed: u64, id: u64, max_tokens: u32) -> u32 {
        let h = mix64(mix64(seed ^ 0x6c65_6e67_7468) ^ id);
        match *self {
            OutputLen::Max => max_tokens,
            OutputLen::Fixed(n) => n,
            OutputLen::Uniform { min, max } => {
                let (lo, hi) = (min.min(max), min.max(max));
                lo + (h % (hi as u64 - lo as u64 + 1)) as u32
            }
            OutputLen::Exponential { mean } => {
                let v = -mean.max(1.0) * unit(h).ln();
                (v.ceil() as u64).clamp(1, u32::MAX as u64) as u32
            }
        }
    }

    /// The length the engine will generate: `max_tokens` when `ignore_eos`, otherwise the drawn length
    /// clamped to `[max(min_tokens, 1), max_tokens]` (vLLM's `min_tokens` suppresses EOS until then).
    pub fn target(
        &self,
        seed: u64,
        id: u64,
        max_tokens: u32,
        ignore_eos: bool,
        min_tokens: u32,
    ) -> u32 {
        let max_tokens = max_tokens.max(1);
        if ignore_eos {
            return max_tokens;
        }
        self.draw(seed, id, max_tokens)
            .max(min_tokens)
            .max(1)
            .min(max_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_respect_knobs() {
        let d = OutputLen::Exponential { mean: 100.0 };
        for id in 0..500 {
            assert_eq!(d.target(1, id, 64, true, 0), 64);
            let t = d.target(1, id, 300, false, 20);
            assert!((20..=300).contains(&t), "{t}");
        }
        let mean: f64 = (0..5000).map(|i| d.draw(3, i, 0) as f64).sum::<f64>() / 5000.0;
        assert!((80.0..120.0).contains(&mean), "{mean}");
        assert_eq!(OutputLen::Fixed(7).target(0, 0, 5, false, 0), 5);
    }

    #[test]
    fn tokens_are_deterministic_and_spread() {
        assert_eq!(output_token(1, 2, 3), output_token(1, 2, 3));
        assert_ne!(output_token(1, 2, 3), output_token(1, 2, 4));
        assert_ne!(output_token(1, 2, 3), output_token(2, 2, 3));
        assert!((0..1000).all(|p| output_token(9, 9, p) < VOCAB));
    }
}
