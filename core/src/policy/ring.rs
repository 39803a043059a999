//! The consistent-hash ring of `session_hash`.

use xxhash_rust::xxh3::xxh3_64_with_seed;

const RING_SEED: u64 = 0x0072_6570_6c69_6361; // "replica"

/// A consistent-hash ring with virtual nodes (Karger et al. 1997; as Ray Serve's ConsistentHashRouter).
/// A point's position depends only on (replica, vnode), so removing a replica moves only the keys that
/// were on its points.
#[derive(Clone, Debug)]
pub struct HashRing {
    points: Vec<(u64, u32)>,
    /// Seed of the key hash (`RING_SEED` xor the configured `ring_seed`).
    key_seed: u64,
}

impl HashRing {
    pub fn new(members: impl IntoIterator<Item = usize>, virtual_nodes: usize) -> Self {
        Self::seeded(members, virtual_nodes, 0)
    }

    /// A ring whose keys hash with `ring_seed` mixed in: the same replicas and points, another draw
    /// of which keys land where.
    pub fn seeded(
        members: impl IntoIterator<Item = usize>,
        virtual_nodes: usize,
        ring_seed: u64,
    ) -> Self {
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
        Self {
            points,
            key_seed: RING_SEED ^ ring_seed,
        }
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
        let h = xxh3_64_with_seed(key, self.key_seed);
        let start = self.points.partition_point(|p| p.0 < h);
        let n = self.points.len();
        (0..n)
            .map(|i| self.points[(start + i) % n].1 as usize)
            .find(|&r| ok(r))
    }
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
    fn a_ring_seed_redraws_the_keys_and_zero_keeps_the_default() {
        let plain = HashRing::new(0..4, 100);
        let zero = HashRing::seeded(0..4, 100, 0);
        let other = HashRing::seeded(0..4, 100, 7);
        let mut moved = 0;
        for i in 0..1000u32 {
            let key = format!("session-{i}");
            assert_eq!(plain.lookup(key.as_bytes()), zero.lookup(key.as_bytes()));
            if plain.lookup(key.as_bytes()) != other.lookup(key.as_bytes()) {
                moved += 1;
            }
        }
        // Another draw over 4 replicas moves about three keys in four.
        assert!((600..900).contains(&moved), "{moved}");
    }
}
