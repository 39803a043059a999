//! Policy building blocks: the consistent-hash ring of `session_hash`, and choosing among scored
//! replicas (argmin with a seeded random tie-break, or softmax sampling at a temperature).
//!
//! The policies themselves are assembled in [`crate::router`], where the index, the approximate index
//! and the load table meet; this module holds what is pure arithmetic so it can be tested alone.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::rng::SplitMix64;

const RING_SEED: u64 = 0x0072_6570_6c69_6361; // "replica"

/// A consistent-hash ring with virtual nodes (Karger et al. 1997; as Ray Serve's ConsistentHashRouter).
/// A point's position depends only on (replica, vnode), so removing a replica moves only the keys that
/// were on its points.
#[derive(Clone, Debug)]
pub struct HashRing {
    points: Vec<(u64, u32)>,
}

impl HashRing {
    pub fn new(members: impl IntoIterator<Item = usize>, virtual_nodes: usize) -> Self {
        let mut points = Vec::new();
        for r in members {
            for v in 0..virtual_nodes as u64 {
                let mut b = [0u8; 16];
                b[..8].copy_from_slice(&(r as u64).to_le_bytes());
                b[8..].copy_from_slice(&v.to_le_bytes());
                points.push((xxh3_64_with_seed(&b, RING_SEED), r as u32));
            }
        }
        points.sort_unstable();
        Self { points }
    }

    /// The replica owning `key`, or None for an empty ring.
    pub fn lookup(&self, key: &[u8]) -> Option<usize> {
        self.lookup_where(key, |_| true)
    }

    /// The first replica accepted by `ok` clockwise from `key`'s point: when a replica is skipped,
    /// only the keys it owned move, each to the next accepted replica on the ring.
    pub fn lookup_where(&self, key: &[u8], ok: impl Fn(usize) -> bool) -> Option<usize> {
        if self.points.is_empty() {
            return None;
        }
        let h = xxh3_64_with_seed(key, RING_SEED);
        let start = self.points.partition_point(|p| p.0 < h);
        let n = self.points.len();
        (0..n)
            .map(|i| self.points[(start + i) % n].1 as usize)
            .find(|&r| ok(r))
    }
}

/// Index of the lowest cost; ties (within 1e-9 relative) broken uniformly at random. None if empty.
pub fn argmin_random_tie(costs: &[f64], rng: &mut SplitMix64) -> Option<usize> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    if !min.is_finite() {
        return if costs.is_empty() {
            None
        } else {
            Some(rng.below(costs.len()))
        };
    }
    let tol = 1e-9 * (1.0 + min.abs());
    let ties = costs.iter().filter(|&&c| c - min <= tol).count();
    let mut pick = rng.below(ties);
    for (i, &c) in costs.iter().enumerate() {
        if c - min <= tol {
            if pick == 0 {
                return Some(i);
            }
            pick -= 1;
        }
    }
    None
}

/// Softmax sampling at temperature `t > 0` as Dynamo defines it:
/// `p_i ~ exp(-(cost_i - cost_min) / ((cost_max - cost_min) * t))`; all costs equal: uniform.
pub fn softmax_sample(costs: &[f64], t: f64, rng: &mut SplitMix64) -> Option<usize> {
    if costs.is_empty() {
        return None;
    }
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let span = (max - min) * t;
    if !(span.is_finite() && span > 0.0) {
        return Some(rng.below(costs.len()));
    }
    let weights: Vec<f64> = costs.iter().map(|&c| (-(c - min) / span).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return Some(i);
        }
        x -= w;
    }
    Some(costs.len() - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_is_stable_when_a_replica_leaves() {
        let all = HashRing::new(0..8, 100);
        let without3 = HashRing::new((0..8).filter(|&r| r != 3), 100);
        let mut moved = 0;
        let mut on3 = 0;
        let mut per = [0u32; 8];
        for i in 0..10_000u32 {
            let key = format!("session-{i}");
            let a = all.lookup(key.as_bytes()).unwrap();
            let b = without3.lookup(key.as_bytes()).unwrap();
            per[a] += 1;
            if a == 3 {
                on3 += 1;
                assert_ne!(b, 3);
            } else {
                assert_eq!(a, b, "only replica 3's sessions may move");
            }
            if a != b {
                moved += 1;
            }
        }
        assert_eq!(moved, on3);
        // 100 virtual nodes spread keys within a factor ~1.5 of fair.
        assert!(per.iter().all(|&c| (800..1800).contains(&c)), "{per:?}");
        assert_eq!(HashRing::new(0..0, 100).lookup(b"x"), None);
    }

    #[test]
    fn argmin_breaks_ties_randomly_and_only_among_ties() {
        let mut rng = SplitMix64::new(1);
        let costs = [3.0, 1.0, 2.0, 1.0];
        let mut seen = [0; 4];
        for _ in 0..1000 {
            seen[argmin_random_tie(&costs, &mut rng).unwrap()] += 1;
        }
        assert_eq!(seen[0] + seen[2], 0);
        assert!(seen[1] > 400 && seen[3] > 400, "{seen:?}");
        assert_eq!(argmin_random_tie(&[], &mut rng), None);
    }

    #[test]
    fn softmax_prefers_cheap_and_handles_equal_costs() {
        let mut rng = SplitMix64::new(2);
        let costs = [0.0, 10.0];
        let mut low = 0;
        for _ in 0..2000 {
            if softmax_sample(&costs, 0.5, &mut rng) == Some(0) {
                low += 1;
            }
        }
        // p0 = 1 / (1 + e^-2) = 0.881
        assert!((1650..1880).contains(&low), "{low}");
        let mut seen = [0; 3];
        for _ in 0..900 {
            seen[softmax_sample(&[5.0, 5.0, 5.0], 1.0, &mut rng).unwrap()] += 1;
        }
        assert!(seen.iter().all(|&c| c > 200), "{seen:?}");
    }
}
