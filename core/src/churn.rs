//! How much of each replica's cache is earning hits lately: the fraction of the prompt tokens this
//! router sent to a replica that were already cached there, over its last requests (an exponential
//! window counted in requests, so a slow replica's figure is not forgotten faster than a busy one's).
//!
//! `kv_load.cache_protect` uses it to price the cache a request would evict. A prefill of `u`
//! uncached blocks inserts `u` blocks into a full cache and evicts about as many; on a replica whose
//! recent requests found `h` of their prompt cached, those evictions cost other sessions about
//! `u * h` blocks of prefill later. When the fleet's working set outgrows its memory, spreading cold
//! prefills evenly makes every replica thrash a little (LRU under a cyclic access pattern keeps
//! nothing); pricing the damage sends them where the cache is churning anyway, so the other replicas
//! keep their sessions' contexts whole.

/// Per replica: hit and prompt tokens, decayed per request admitted there.
#[derive(Clone, Debug)]
pub struct CacheChurn {
    hits: Vec<f64>,
    prompts: Vec<f64>,
    /// `1 - 1 / window`.
    keep: f64,
}

impl CacheChurn {
    /// `window` requests per replica (below 1, or not a number, counts as 1).
    pub fn new(replicas: usize, window: f64) -> Self {
        let window = if window >= 1.0 { window } else { 1.0 };
        CacheChurn {
            hits: vec![0.0; replicas],
            prompts: vec![0.0; replicas],
            keep: 1.0 - 1.0 / window,
        }
    }

    /// A request of `prompt_tokens` went to `replica` with `cached_tokens` of them cached there.
    pub fn record(&mut self, replica: usize, prompt_tokens: u64, cached_tokens: u64) {
        if let (Some(h), Some(p)) = (self.hits.get_mut(replica), self.prompts.get_mut(replica)) {
            *h = *h * self.keep + cached_tokens.min(prompt_tokens) as f64;
            *p = *p * self.keep + prompt_tokens as f64;
        }
    }

    /// The recent hit fraction of `replica` in [0, 1]; 0 before it has taken any prompt.
    pub fn hit_rate(&self, replica: usize) -> f64 {
        match (self.hits.get(replica), self.prompts.get(replica)) {
            (Some(&h), Some(&p)) if p > 0.0 => (h / p).clamp(0.0, 1.0),
            _ => 0.0,
        }
    }

    /// [`CacheChurn::hit_rate`] of every replica.
    pub fn hit_rates(&self) -> Vec<f64> {
        (0..self.hits.len()).map(|r| self.hit_rate(r)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recent_requests_weigh_most() {
        let mut c = CacheChurn::new(2, 4.0);
        assert_eq!(c.hit_rate(0), 0.0);
        for _ in 0..20 {
            c.record(0, 1000, 1000);
        }
        assert!((c.hit_rate(0) - 1.0).abs() < 1e-12);
        // Four misses in a window of four: well below half.
        for _ in 0..4 {
            c.record(0, 1000, 0);
        }
        assert!(c.hit_rate(0) < 0.35, "{}", c.hit_rate(0));
        assert_eq!(c.hit_rate(1), 0.0, "replica 1 took nothing");
        // Out of range and over-counted input are absorbed.
        c.record(9, 10, 10);
        c.record(1, 10, 50);
        assert_eq!(c.hit_rate(1), 1.0);
        assert_eq!(c.hit_rates().len(), 2);
    }
}
