use super::*;

#[test]
fn longest_leading_run_per_replica_by_tier() {
    let mut ix = KvIndex::new(100, 3, 9);
    ix.store(0, Tier::Gpu, &[1, 2, 3]);
    ix.store(1, Tier::Gpu, &[1]);
    ix.store(1, Tier::Host, &[2, 3]);
    ix.store(2, Tier::Gpu, &[2, 3]); // no block 1: no leading run
    let mut out = Vec::new();
    ix.match_prefix(&[1, 2, 3, 4], &mut out);
    assert_eq!(out, vec![[3, 0, 0], [1, 2, 0], [0, 0, 0]]);
    // GPU beats host when both hold it.
    ix.store(1, Tier::Gpu, &[2]);
    ix.match_prefix(&[1, 2, 3], &mut out);
    assert_eq!(out[1], [2, 1, 0]);
    ix.check_invariants().unwrap();
}

/// A slot remembered by a match is checked, not trusted: after its block is removed, its slot
/// freed and reused by another block, or its holders changed, matches answer as the table does.
#[test]
fn recently_matched_slots_are_checked_not_trusted() {
    let mut ix = KvIndex::new(100, 2, 3);
    let mut out = Vec::new();
    ix.store(0, Tier::Gpu, &[1, 2, 3]);
    ix.match_prefix(&[1, 2, 3], &mut out);
    assert_eq!(out[0], [3, 0, 0]);
    // Block 2 goes; its slot is reused by block 9 (the free list hands it out first).
    ix.remove(0, Tier::Gpu, &[2]);
    ix.match_prefix(&[1, 2, 3], &mut out);
    assert_eq!(out[0], [1, 0, 0]);
    ix.store(1, Tier::Host, &[9]);
    ix.match_prefix(&[1, 2, 3], &mut out);
    assert_eq!(out[0], [1, 0, 0]);
    ix.match_prefix(&[9], &mut out);
    assert_eq!(out, vec![[0, 0, 0], [0, 1, 0]]);
    // Holders and tiers are read from the slot each time.
    ix.store(0, Tier::Gpu, &[2]);
    ix.store(1, Tier::Host, &[1]);
    ix.match_prefix(&[1, 2, 3], &mut out);
    assert_eq!(out, vec![[3, 0, 0], [0, 1, 0]]);
    ix.remove_replica(0);
    ix.match_prefix(&[1, 2, 3], &mut out);
    assert_eq!(out, vec![[0, 0, 0], [0, 1, 0]]);
    ix.check_invariants().unwrap();
}

/// The recently matched sets answer as the hash table does, whatever pushed entries out of a set
/// or freed and reused their slots: against the same index with the sets emptied before every
/// match (so it asks the table each time), with and without tags, in a small table whose sets
/// overflow.
#[test]
fn recently_matched_sets_answer_as_the_table() {
    for tagged in [true, false] {
        let mut ix = KvIndex::new(300, 3, 11);
        ix.recent_tagged = tagged;
        let mut plain = ix.clone();
        let mut rng = crate::rng::SplitMix64::new(5);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for step in 0..3_000 {
            let r = (rng.next_u64() % 3) as usize;
            let tier = [Tier::Gpu, Tier::Host, Tier::Disk][(rng.next_u64() % 3) as usize];
            let start = rng.next_u64() % 400;
            let keys: Vec<u64> = (start..start + rng.next_u64() % 40).collect();
            match rng.next_u64() % 4 {
                0 => {
                    ix.store(r, tier, &keys);
                    plain.store(r, tier, &keys);
                }
                1 => {
                    ix.remove(r, tier, &keys);
                    plain.remove(r, tier, &keys);
                }
                _ => {
                    plain.recent.fill(0);
                    ix.match_prefix(&keys, &mut a);
                    plain.match_prefix(&keys, &mut b);
                    assert_eq!(a, b, "tagged {tagged}, step {step}");
                }
            }
        }
        assert_eq!(ix.referenced, plain.referenced);
        ix.check_invariants().unwrap();
    }
}

#[test]
fn a_gap_ends_the_run() {
    let mut ix = KvIndex::new(100, 1, 0);
    ix.store(0, Tier::Gpu, &[1, 3]);
    let mut out = Vec::new();
    ix.match_prefix(&[1, 2, 3], &mut out);
    assert_eq!(out[0], [1, 0, 0]);
}

/// The lookups of a chunk stop at its first key not found: runs that end at every place in
/// and across chunks, with later keys of the chunk present (a gap), match as a walk of the
/// keys one by one does, cold and with the recent slots warm.
#[test]
fn runs_end_where_the_walk_ends_at_every_place_in_a_chunk() {
    for gap in 0..40u64 {
        let mut ix = KvIndex::new(1000, 2, 5);
        let keys: Vec<u64> = (1..=40).collect();
        let held: Vec<u64> = keys.iter().copied().filter(|&k| k != gap + 1).collect();
        ix.store(0, Tier::Gpu, &held);
        ix.store(1, Tier::Host, &keys[..(gap as usize / 2 + 3).min(40)]);
        let walk = |ix: &KvIndex, r: usize, tier: Tier| {
            keys.iter().take_while(|&&k| ix.holds(r, tier, k)).count() as u32
        };
        let want = vec![
            [walk(&ix, 0, Tier::Gpu), 0, 0],
            [0, walk(&ix, 1, Tier::Host), 0],
        ];
        for _ in 0..2 {
            let mut out = Vec::new();
            ix.match_prefix(&keys, &mut out);
            assert_eq!(out, want, "gap at {gap}");
        }
    }
}

#[test]
fn remove_by_tier_and_replica_reset() {
    let mut ix = KvIndex::new(100, 2, 0);
    ix.store(0, Tier::Gpu, &[1, 2]);
    ix.store(0, Tier::Host, &[1]);
    ix.store(1, Tier::Disk, &[1, 2]);
    ix.remove(0, Tier::Gpu, &[1]);
    assert!(ix.holds(0, Tier::Host, 1));
    assert!(!ix.holds(0, Tier::Gpu, 1));
    assert_eq!(ix.replica_blocks(0), 2);
    ix.remove_replica(1);
    assert_eq!(ix.replica_blocks(1), 0);
    assert!(!ix.holds(1, Tier::Disk, 2));
    ix.remove(0, Tier::Host, &[1]);
    ix.remove(0, Tier::Gpu, &[2, 99]);
    assert!(ix.is_empty());
    ix.check_invariants().unwrap();
}

#[test]
fn many_holders_overflow_and_shrink_back() {
    let mut ix = KvIndex::new(10, 300, 0);
    for r in 0..300 {
        ix.store(r, Tier::Gpu, &[42]);
    }
    let mut out = Vec::new();
    ix.match_prefix(&[42], &mut out);
    assert!(out.iter().all(|c| *c == [1, 0, 0]));
    ix.check_invariants().unwrap();
    for r in 0..298 {
        ix.remove(r, Tier::Gpu, &[42]);
    }
    ix.check_invariants().unwrap();
    assert!(ix.holds(299, Tier::Gpu, 42));
    assert!(ix.overflow.is_empty());
}

#[test]
fn cap_evicts_unreferenced_first() {
    let mut ix = KvIndex::new(4, 1, 0);
    ix.store(0, Tier::Gpu, &[1, 2, 3, 4]);
    // All referenced: first sweep clears bits, then 1 goes.
    ix.store(0, Tier::Gpu, &[5]);
    assert_eq!(ix.len(), 4);
    assert_eq!(ix.evictions(), 1);
    assert!(!ix.holds(0, Tier::Gpu, 1));
    // Touch 2 by matching... it is not a leading block of [2]? It is: a run starting at 2.
    let mut out = Vec::new();
    ix.match_prefix(&[2], &mut out);
    ix.store(0, Tier::Gpu, &[6]);
    assert!(ix.holds(0, Tier::Gpu, 2), "touched block survives");
    assert!(!ix.holds(0, Tier::Gpu, 3), "untouched block goes");
    ix.check_invariants().unwrap();
}

#[test]
fn a_flood_from_one_replica_evicts_only_its_own_blocks() {
    let mut ix = KvIndex::new(1000, 4, 5);
    assert_eq!(ix.share(), 250);
    let kept: Vec<Vec<u64>> = (1..4u64)
        .map(|r| (0..200).map(|i| r << 32 | i).collect())
        .collect();
    for (r, keys) in kept.iter().enumerate() {
        ix.store(r + 1, Tier::Gpu, keys);
    }
    // Replica 0 reports a million blocks: it may use the room left, then evicts its own.
    let flood: Vec<u64> = (0..1_000_000u64).map(|i| 9 << 40 | i).collect();
    for chunk in flood.chunks(4096) {
        ix.store(0, Tier::Gpu, chunk);
    }
    assert_eq!(ix.len(), 1000);
    assert_eq!(ix.replica_blocks(0), 400, "the room the others left");
    for (r, keys) in kept.iter().enumerate() {
        assert_eq!(ix.replica_blocks(r + 1), 200);
        let mut out = Vec::new();
        ix.match_prefix(keys, &mut out);
        assert_eq!(out[r + 1], [200, 0, 0], "replica {} lost blocks", r + 1);
    }
    // Its newest blocks are the ones it keeps.
    assert!(ix.holds(0, Tier::Gpu, *flood.last().unwrap()));
    assert!(!ix.holds(0, Tier::Gpu, flood[0]));
    // A replica under its share that stores more takes the room back from the one over it.
    let more: Vec<u64> = (200..300).map(|i| 1 << 32 | i).collect();
    ix.store(1, Tier::Gpu, &more);
    assert_eq!(ix.replica_blocks(1), 250, "up to its share, and no further");
    assert_eq!(ix.replica_blocks(0), 350);
    assert_eq!(ix.replica_blocks(2), 200);
    assert_eq!(ix.len(), 1000);
    ix.check_invariants().unwrap();
}

#[test]
fn shared_blocks_count_for_each_holder_and_stay_while_held() {
    let mut ix = KvIndex::new(10, 2, 0);
    assert_eq!(ix.share(), 5);
    ix.store(0, Tier::Gpu, &[1, 2, 3, 4, 5]);
    ix.store(1, Tier::Gpu, &[1, 2, 3, 4, 5]);
    // Replica 1 floods: its copies of the shared blocks may go, the blocks stay for replica 0.
    ix.store(1, Tier::Gpu, &(100..200).collect::<Vec<u64>>());
    for k in 1..=5 {
        assert!(ix.holds(0, Tier::Gpu, k), "block {k}");
    }
    assert_eq!(ix.replica_blocks(0), 5);
    assert!(ix.len() <= 10);
    ix.check_invariants().unwrap();
    // More replicas than blocks of cap: shares are one block, the cap still holds.
    let mut tiny = KvIndex::new(2, 4, 0);
    for r in 0..4 {
        tiny.store(r, Tier::Gpu, &[r as u64 * 10, r as u64 * 10 + 1]);
    }
    assert_eq!(tiny.share(), 1);
    assert!(tiny.len() <= 2);
    tiny.check_invariants().unwrap();
}

/// The index never reserves more than `memory_bound` for its cap, however it is filled, flooded,
/// reset and churned: the slab's chunks stop at the cap, and tombstones never make the table
/// grow past the size the cap needs (hashbrown doubled it under churn before `rebuild_table`).
#[test]
fn memory_stays_within_the_bound_for_the_cap() {
    for (cap, replicas) in [(1, 1), (7, 2), (1000, 4), (70_000, 3), (200_000, 16)] {
        let mut ix = KvIndex::new(cap, replicas, 3);
        let bound = KvIndex::memory_bound(cap, replicas);
        let mut peak = 0;
        let mut x = 0x9E37_79B9u64 ^ cap as u64;
        // Five caps' worth of random blocks from random replicas (churn at the cap), with a
        // replica reset every cap's worth.
        for i in 0..5 * cap.max(64) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ix.store((x % replicas as u64) as usize, Tier::Gpu, &[x]);
            if (i + 1) % cap.max(64) == 0 {
                ix.remove_replica((x >> 8) as usize % replicas);
            }
            peak = peak.max(ix.heap_bytes());
        }
        assert!(ix.overflow.is_empty());
        assert!(
            peak <= bound,
            "cap {cap}: {peak} bytes reserved, bound {bound}"
        );
        ix.check_invariants().unwrap();
        // And the bound is tight enough to mean something: a full index uses most of it.
        for r in 0..replicas {
            let keys: Vec<u64> = (0..cap as u64).map(|k| (r as u64) << 40 | k).collect();
            ix.store(r, Tier::Gpu, &keys);
        }
        assert_eq!(ix.len(), cap);
        if cap >= 1000 {
            assert!(
                ix.heap_bytes() * 10 >= bound * 9,
                "cap {cap}: {} of {bound}",
                ix.heap_bytes()
            );
        }
    }
    // At the default cap, the figure docs/design/filter.md and docs/reference/configuration.md
    // quote. 16 MB of slots, 16 chunk handles, 125 KB of bits, 2^21 buckets, 16 replicas, the
    // recently matched slots.
    assert_eq!(
        KvIndex::memory_bound(1_000_000, 16),
        16_000_000 + 16 * 24 + 125_000 + (1 << 21) * 5 + 24 + 16 * 16 + (1 << 16) * 4
    );
}

#[test]
fn the_table_grows_to_the_caps_size_in_one_step_after_a_quarter() {
    let cap = 100_000;
    let mut ix = KvIndex::new(cap, 1, 0);
    let keys: Vec<u64> = (0..cap as u64).collect();
    ix.store(0, Tier::Gpu, &keys[..cap / 16]);
    assert!(ix.table.capacity() < cap / 4, "doubling while small");
    // The first growth at or past cap / 4 (here at 28,672 blocks, 2^15 buckets' worth).
    ix.store(0, Tier::Gpu, &keys[..cap / 2]);
    assert!(ix.table.capacity() >= cap, "{}", ix.table.capacity());
    let at_jump = ix.table.allocation_size();
    ix.store(0, Tier::Gpu, &keys);
    assert_eq!(
        ix.table.allocation_size(),
        at_jump,
        "no growth after the jump"
    );
    assert_eq!(
        at_jump,
        KvIndex::buckets_for(cap) * 5 + 16,
        "the cap's size, not more"
    );
}

#[test]
fn a_full_index_churning_keeps_its_table_size() {
    // 900k of cap: 86% of the 1M (2^20 * 7/8 = 917,504) buckets' room, over the half at which
    // hashbrown stops rehashing in place and doubles.
    let cap = 900_000;
    let mut ix = KvIndex::new(cap, 2, 1);
    let mut x = 77u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let keys: Vec<u64> = (0..cap).map(|_| next()).collect();
    ix.store(0, Tier::Gpu, &keys);
    let full = ix.heap_bytes();
    for _ in 0..4 * cap {
        let k = next();
        ix.store(1, Tier::Gpu, &[k]);
    }
    assert_eq!(ix.len(), cap);
    assert_eq!(
        ix.heap_bytes(),
        full,
        "the index grew while churning at its cap"
    );
    ix.check_invariants().unwrap();
}

#[test]
fn out_of_range_replica_is_ignored() {
    let mut ix = KvIndex::new(4, 2, 0);
    assert!(!ix.store(2, Tier::Gpu, &[1]));
    assert!(!ix.remove(5, Tier::Gpu, &[1]));
    ix.remove_replica(7);
    assert!(ix.is_empty());
}

/// A prefix every replica holds (the system prompt of a large fleet) costs each extra holder a
/// couple of bytes (its packed `u16` in the block's overflow list, the list's spare capacity and
/// its share of the list's header), not a copy of the block: measured from the index's own
/// accounting, which the filter's memory bound is built on.
#[test]
fn a_prefix_held_by_128_replicas_costs_a_few_bytes_per_holder() {
    let blocks: Vec<u64> = (1..=1_000).collect();
    let mut one = KvIndex::new(10_000, 128, 5);
    let empty = one.heap_bytes();
    one.store(0, Tier::Gpu, &blocks);
    let held_once = one.heap_bytes() - empty;
    let mut all = KvIndex::new(10_000, 128, 5);
    for r in 0..128 {
        all.store(r, Tier::Gpu, &blocks);
    }
    all.check_invariants().unwrap();
    let extra = all.heap_bytes() - empty - held_once;
    let per_holder = extra as f64 / (127.0 * blocks.len() as f64);
    eprintln!(
        "128-way prefix of {} blocks: {} bytes once, {} bytes for the 127 other holders, {per_holder:.2} bytes a holder",
        blocks.len(),
        held_once,
        extra
    );
    assert!(per_holder <= 4.0, "{per_holder:.2} bytes a holder");
    assert_eq!(all.len(), blocks.len());
}
