//! How long the next request's output will be, learned from the outputs this router has seen.
//!
//! Clients rarely say: `max_tokens` is a cap (coding agents set tens of thousands and stop after a few
//! hundred), so the router watches instead. Every released request that generated tokens adds its
//! count; the estimate is their running mean over the first [`WINDOW`] samples, then an exponential
//! average with the same weight (about the last [`WINDOW`] requests), so it follows a workload that
//! changes. Before any sample it is [`PRIOR_TOKENS`].
//!
//! The estimate decides how a block of prefill weighs against a block of decode load in `kv_load`'s
//! time cost: a request that will decode for long is slowed by every decode block it shares a replica
//! with, step after step, while its prefill is paid once.

/// Output tokens assumed before the first request finishes.
pub const PRIOR_TOKENS: f64 = 256.0;
/// Requests the estimate roughly remembers.
pub const WINDOW: u64 = 64;

/// A running estimate of output tokens per request.
#[derive(Clone, Debug, Default)]
pub struct OutputEstimate {
    mean: f64,
    samples: u64,
}

impl OutputEstimate {
    pub fn new() -> Self {
        Self::default()
    }

    /// One finished request's generated tokens (0 is ignored: an abort before the first token says
    /// nothing about output length).
    pub fn observe(&mut self, generated: u64) {
        if generated == 0 {
            return;
        }
        self.samples = self.samples.saturating_add(1);
        let w = 1.0 / self.samples.min(WINDOW) as f64;
        self.mean += (generated as f64 - self.mean) * w;
    }

    /// Expected output tokens of the next request.
    pub fn expected(&self) -> f64 {
        if self.samples == 0 {
            PRIOR_TOKENS
        } else {
            self.mean
        }
    }

    pub fn samples(&self) -> u64 {
        self.samples
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prior_then_mean_then_follows_a_change() {
        let mut e = OutputEstimate::new();
        assert_eq!(e.expected(), PRIOR_TOKENS);
        e.observe(0);
        assert_eq!(e.samples(), 0);
        for n in [100, 300] {
            e.observe(n);
        }
        assert_eq!(e.expected(), 200.0);
        for _ in 0..1000 {
            e.observe(2000);
        }
        assert!((e.expected() - 2000.0).abs() < 1.0, "{}", e.expected());
        // A new regime moves the estimate within a few windows.
        for _ in 0..(4 * WINDOW) {
            e.observe(100);
        }
        assert!(e.expected() < 150.0, "{}", e.expected());
    }

    #[test]
    fn huge_counts_stay_finite() {
        let mut e = OutputEstimate::new();
        for _ in 0..10 {
            e.observe(u64::MAX);
        }
        assert!(e.expected().is_finite());
    }
}
