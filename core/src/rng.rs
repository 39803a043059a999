//! A tiny seeded generator for tie-breaks and softmax sampling.
//!
//! Routing needs randomness only to break ties and to sample at a temperature, and it must be
//! reproducible for a seed (the harness replays workloads and compares policies), so the core carries
//! SplitMix64 (Steele, Lea and Flood, 2014; the seeding generator of Java's `SplittableRandom`) instead
//! of depending on `rand`.

/// The tie-break seed of one proxy: `seed` (the configured `routing.seed`) with the proxy's identity
/// mixed in, or `seed` itself when the identity is empty.
///
/// Why: every proxy in front of a fleet is deployed with the same configuration, so with the seed
/// alone independent proxies draw the same tie-break sequence and, facing the same state (every
/// proxy polls the same feeds), break the same ties the same way at the same moment: correlated
/// choices that herd. Mixing in something that differs per proxy (the filter passes Envoy's node id)
/// decorrelates them. An empty identity keeps the configured seed, so a single proxy without one
/// routes exactly as before and a fixed seed still reproduces a run.
pub fn proxy_seed(seed: u64, identity: &[u8]) -> u64 {
    if identity.is_empty() {
        return seed;
    }
    // XXH3 spreads any identity over 64 bits; one SplitMix64 step keeps ids that differ in a byte from
    // giving seeds that differ in few bits (SplitMix64 streams from nearby seeds are independent, but
    // this costs nothing).
    let h = xxhash_rust::xxh3::xxh3_64(identity);
    seed ^ SplitMix64::new(h).next_u64()
}

/// SplitMix64: 64 bits of state, passes BigCrush, one multiply-xorshift chain per draw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits of precision.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n`; `n == 0` yields 0. Uses Lemire's multiply-shift (bias below 2^-32 for the
    /// small `n` a router sees).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_known_first_value() {
        let mut a = SplitMix64::new(1234567);
        let mut b = SplitMix64::new(1234567);
        for _ in 0..100 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        // Reference value of SplitMix64 for seed 0 (first output), from the published algorithm.
        assert_eq!(SplitMix64::new(0).next_u64(), 0xE220_A839_7B1D_CDAF);
    }

    #[test]
    fn proxy_seed_keeps_the_seed_without_identity_and_differs_per_identity() {
        assert_eq!(proxy_seed(42, b""), 42);
        let ids: [&[u8]; 4] = [
            b"proxy-0",
            b"proxy-1",
            b"proxy-2",
            b"sidecar~10.0.0.1~a.ns~ns.svc",
        ];
        let seeds: Vec<u64> = ids.iter().map(|id| proxy_seed(42, id)).collect();
        for (i, a) in seeds.iter().enumerate() {
            assert_ne!(*a, 42, "{:?}", ids[i]);
            assert_eq!(*a, proxy_seed(42, ids[i]), "deterministic");
            for b in &seeds[i + 1..] {
                assert_ne!(a, b);
            }
        }
        // Different identities give different tie-break streams, not just different first values.
        let mut x = SplitMix64::new(seeds[0]);
        let mut y = SplitMix64::new(seeds[1]);
        let same = (0..64).filter(|_| x.below(4) == y.below(4)).count();
        assert!(same < 40, "{same} of 64 draws equal");
    }

    #[test]
    fn below_is_in_range_and_covers_it() {
        let mut r = SplitMix64::new(7);
        let mut seen = [0u32; 5];
        for _ in 0..5000 {
            seen[r.below(5)] += 1;
        }
        assert!(seen.iter().all(|&c| c > 800), "{seen:?}");
        assert_eq!(r.below(0), 0);
        let f = r.next_f64();
        assert!((0.0..1.0).contains(&f));
    }
}
