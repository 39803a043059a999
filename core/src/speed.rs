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

/// Shortest predicted time to first token an observation is learned from: below it, what the
/// router cannot see (the network, the API server, the first token's way back) dominates.
pub const MIN_PREDICTED_S: f64 = 0.02;

/// Each replica's speed against its profile, learned from observed times to first token: this
/// worker's own observations, and what the proxy's other workers learned from theirs (each sees a
/// share of the requests, so alone each would learn a slow replica that many times later).
#[derive(Clone, Debug)]
pub struct Speeds {
    /// Per replica: ln(observed / predicted), averaged over this worker's observations.
    log_factor: Vec<f64>,
    observations: Vec<u64>,
    /// Weight of one observation (from the half-life).
    alpha: f64,
    /// ln(bound).
    bound_ln: f64,
    /// Each replica's factor as used: this worker's and the other workers' estimates, each
    /// weighed by its [`SpeedEstimate::weight`].
    combined: Vec<f64>,
    /// The other workers' estimates, by worker number.
    peers: std::collections::BTreeMap<u32, Vec<SpeedEstimate>>,
}

/// One worker's estimate of one replica's speed, as it shares it with the other workers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpeedEstimate {
    /// ln(observed / predicted), bounded by the bound.
    pub log_factor: f64,
    /// Observations it stands on, up to the half-life's window (`1 / alpha`): a worker that has
    /// seen more of a replica's recent requests weighs more, one that saw long ago no more than a
    /// window's worth.
    pub weight: f64,
}

impl SpeedEstimate {
    /// Bytes per estimate in [`SpeedEstimate::encode_all`].
    pub const ENCODED_LEN: usize = 16;

    /// Little-endian `log_factor f64, weight f64` per replica, for shared memory.
    pub fn encode_all(all: &[SpeedEstimate]) -> Vec<u8> {
        let mut out = Vec::with_capacity(all.len() * Self::ENCODED_LEN);
        for e in all {
            out.extend_from_slice(&e.log_factor.to_le_bytes());
            out.extend_from_slice(&e.weight.to_le_bytes());
        }
        out
    }

    /// Reads [`SpeedEstimate::encode_all`]'s bytes; `None` for a length that is not a whole
    /// number of estimates. Values are taken as they are: [`Speeds::set_peer`] discards those it
    /// cannot use.
    pub fn decode_all(bytes: &[u8]) -> Option<Vec<SpeedEstimate>> {
        if !bytes.len().is_multiple_of(Self::ENCODED_LEN) {
            return None;
        }
        let read = |b: &[u8]| f64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        Some(
            bytes
                .chunks_exact(Self::ENCODED_LEN)
                .map(|c| SpeedEstimate {
                    log_factor: read(&c[..8]),
                    weight: read(&c[8..]),
                })
                .collect(),
        )
    }
}

impl Speeds {
    /// `halflife` observations halve an old observation's weight; `bound` (>= 1) caps how far a
    /// factor may go from 1 either way. A half-life of 0 turns learning off (every factor stays 1).
    pub fn new(replicas: usize, halflife: f64, bound: f64) -> Speeds {
        let alpha = if halflife > 0.0 {
            1.0 - 0.5f64.powf(1.0 / halflife)
        } else {
            0.0
        };
        Speeds {
            log_factor: vec![0.0; replicas],
            observations: vec![0; replicas],
            alpha,
            bound_ln: bound.max(1.0).ln(),
            combined: vec![0.0; replicas],
            peers: Default::default(),
        }
    }

    /// The replica's time factor: 2 means it takes twice the profile's time.
    pub fn factor(&self, replica: usize) -> f64 {
        self.combined.get(replica).map_or(1.0, |l| l.exp())
    }

    /// Every replica's factor.
    pub fn factors(&self) -> Vec<f64> {
        self.combined.iter().map(|l| l.exp()).collect()
    }

    /// This worker's own estimates, for the other workers.
    pub fn local(&self) -> Vec<SpeedEstimate> {
        let window = if self.alpha > 0.0 {
            1.0 / self.alpha
        } else {
            0.0
        };
        self.log_factor
            .iter()
            .zip(&self.observations)
            .map(|(&log_factor, &n)| SpeedEstimate {
                log_factor,
                weight: (n as f64).min(window),
            })
            .collect()
    }

    /// Replaces worker `peer`'s estimates. Ignored when learning is off or the count is not the
    /// replica count; values that are not finite, or weights below 0, count as no observation,
    /// and factors are held within the bound (the record comes from shared memory).
    pub fn set_peer(&mut self, peer: u32, estimates: &[SpeedEstimate]) {
        if self.alpha == 0.0 || estimates.len() != self.log_factor.len() {
            return;
        }
        let window = 1.0 / self.alpha;
        let clean = estimates
            .iter()
            .map(|e| {
                if e.log_factor.is_finite() && e.weight.is_finite() && e.weight > 0.0 {
                    SpeedEstimate {
                        log_factor: e.log_factor.clamp(-self.bound_ln, self.bound_ln),
                        weight: e.weight.min(window),
                    }
                } else {
                    SpeedEstimate::default()
                }
            })
            .collect();
        self.peers.insert(peer, clean);
        self.combine_all();
    }

    /// Forgets worker `peer`'s estimates (it stopped publishing).
    pub fn clear_peer(&mut self, peer: u32) {
        if self.peers.remove(&peer).is_some() {
            self.combine_all();
        }
    }

    fn combine_all(&mut self) {
        for r in 0..self.combined.len() {
            self.combine(r);
        }
    }

    /// The weighted mean of this worker's and the others' estimates of replica `r` (this
    /// worker's alone while no other has observed it).
    fn combine(&mut self, r: usize) {
        let own = self.local().get(r).copied().unwrap_or_default();
        let mut sum = own.log_factor * own.weight;
        let mut weight = own.weight;
        for e in self.peers.values().filter_map(|v| v.get(r)) {
            sum += e.log_factor * e.weight;
            weight += e.weight;
        }
        if let Some(c) = self.combined.get_mut(r) {
            *c = if weight > 0.0 {
                (sum / weight).clamp(-self.bound_ln, self.bound_ln)
            } else {
                0.0
            };
        }
    }

    pub fn observations(&self, replica: usize) -> u64 {
        self.observations.get(replica).copied().unwrap_or(0)
    }

    /// Forgets a replica's learned factor (its slot now holds another engine).
    pub fn forget(&mut self, replica: usize) {
        if let (Some(l), Some(n)) = (
            self.log_factor.get_mut(replica),
            self.observations.get_mut(replica),
        ) {
            *l = 0.0;
            *n = 0;
        }
    }

    /// A request's observed time to first token against the profile's prediction at factor 1.
    /// Ignored when either is not a positive finite number or the prediction is below
    /// [`MIN_PREDICTED_S`]. Until a replica has a few observations, each weighs more (a running
    /// mean), so a fresh replica's factor forms quickly.
    pub fn observe(&mut self, replica: usize, predicted_s: f64, observed_s: f64) {
        if self.alpha == 0.0
            || !(predicted_s.is_finite() && observed_s.is_finite())
            || predicted_s < MIN_PREDICTED_S
            || observed_s <= 0.0
        {
            return;
        }
        let (Some(l), Some(n)) = (
            self.log_factor.get_mut(replica),
            self.observations.get_mut(replica),
        ) else {
            return;
        };
        let x = (observed_s / predicted_s)
            .ln()
            .clamp(-self.bound_ln, self.bound_ln);
        *n = n.saturating_add(1);
        let w = self.alpha.max(1.0 / *n as f64);
        *l = (*l + (x - *l) * w).clamp(-self.bound_ln, self.bound_ln);
        self.combine(replica);
    }
}

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

    #[test]
    fn a_replica_twice_as_slow_is_learned_and_the_bound_holds() {
        let mut s = Speeds::new(2, 16.0, 4.0);
        for _ in 0..64 {
            s.observe(0, 0.1, 0.2);
            s.observe(1, 0.1, 0.1);
        }
        assert!((s.factor(0) - 2.0).abs() < 0.01, "{}", s.factor(0));
        assert!((s.factor(1) - 1.0).abs() < 1e-9);
        // Wild observations are clamped to the bound.
        for _ in 0..200 {
            s.observe(1, 0.1, 1e9);
        }
        assert!((s.factor(1) - 4.0).abs() < 1e-3);
        // Garbage and tiny predictions change nothing; an unknown replica is ignored.
        let before = s.factors();
        s.observe(0, f64::NAN, 1.0);
        s.observe(0, 0.001, 10.0);
        s.observe(0, 0.1, -1.0);
        s.observe(9, 0.1, 0.2);
        assert_eq!(s.factors(), before);
        assert_eq!(s.factor(9), 1.0);
    }

    #[test]
    fn other_workers_estimates_are_weighed_by_their_observations() {
        let mut a = Speeds::new(2, 16.0, 4.0);
        let mut b = Speeds::new(2, 16.0, 4.0);
        // Worker a has seen replica 0 run twice as slow; b has seen nothing of it yet.
        for _ in 0..40 {
            a.observe(0, 0.1, 0.2);
        }
        b.set_peer(0, &a.local());
        assert!((b.factor(0) - 2.0).abs() < 0.01, "{}", b.factor(0));
        assert_eq!(b.factor(1), 1.0);
        // b's own observations at profile speed count as much as a's, window for window.
        for _ in 0..40 {
            b.observe(0, 0.1, 0.1);
        }
        assert!((b.factor(0) - 2f64.sqrt()).abs() < 0.01, "{}", b.factor(0));
        // A worker that stops publishing is forgotten.
        b.clear_peer(0);
        assert!((b.factor(0) - 1.0).abs() < 1e-9);
        // A record of the wrong length, or with garbage in it, changes nothing or counts as
        // nothing; a factor past the bound is held to it.
        b.set_peer(1, &[SpeedEstimate::default()]);
        assert!((b.factor(0) - 1.0).abs() < 1e-9);
        let bad = |log_factor, weight| SpeedEstimate { log_factor, weight };
        b.set_peer(1, &[bad(f64::NAN, 5.0), bad(1e9, 1e9)]);
        assert!((b.factor(0) - 1.0).abs() < 1e-9);
        assert!((b.factor(1) - 4.0).abs() < 1e-9, "{}", b.factor(1));
        b.set_peer(1, &[bad(1.0, -3.0), bad(1.0, f64::INFINITY)]);
        assert!((b.factor(0) - 1.0).abs() < 1e-9);
        assert_eq!(b.factor(1), 1.0);
    }

    #[test]
    fn estimates_survive_their_encoding_and_odd_lengths_do_not_decode() {
        let all = [
            SpeedEstimate {
                log_factor: -0.5,
                weight: 12.0,
            },
            SpeedEstimate::default(),
        ];
        let bytes = SpeedEstimate::encode_all(&all);
        assert_eq!(bytes.len(), 2 * SpeedEstimate::ENCODED_LEN);
        assert_eq!(SpeedEstimate::decode_all(&bytes).unwrap(), all);
        assert!(SpeedEstimate::decode_all(&bytes[1..]).is_none());
        assert_eq!(SpeedEstimate::decode_all(&[]).unwrap(), vec![]);
    }

    #[test]
    fn a_zero_halflife_learns_nothing() {
        let mut s = Speeds::new(1, 0.0, 4.0);
        s.observe(0, 0.1, 0.4);
        assert_eq!(s.factor(0), 1.0);
        s.set_peer(
            1,
            &[SpeedEstimate {
                log_factor: 1.0,
                weight: 8.0,
            }],
        );
        assert_eq!(s.factor(0), 1.0);
    }
}
