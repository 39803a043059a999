//! Property tests for the KV index's invariants, checked against a plain model.

use std::collections::{BTreeMap, BTreeSet};

use kvsteer_core::feed::Tier;
use kvsteer_core::index::KvIndex;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Store(usize, u8, Vec<u64>),
    Remove(usize, u8, Vec<u64>),
    Reset(usize),
    Match(Vec<u64>),
}

fn tier(t: u8) -> Tier {
    Tier::from_u8(t % 3).unwrap()
}

fn op() -> impl Strategy<Value = Op> {
    // Small key space so operations collide; replica 5 is out of range for a 5-replica index.
    let keys = prop::collection::vec(0u64..40, 0..12);
    prop_oneof![
        4 => (0usize..6, 0u8..3, keys.clone()).prop_map(|(r, t, k)| Op::Store(r, t, k)),
        3 => (0usize..6, 0u8..3, keys.clone()).prop_map(|(r, t, k)| Op::Remove(r, t, k)),
        1 => (0usize..6).prop_map(Op::Reset),
        2 => keys.prop_map(Op::Match),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Without eviction pressure the index equals a model: (key, replica) -> tier set.
    #[test]
    fn index_matches_model(ops in prop::collection::vec(op(), 0..80)) {
        let mut ix = KvIndex::new(10_000, 5, 3);
        let mut model: BTreeMap<(u64, usize), BTreeSet<u8>> = BTreeMap::new();
        for o in &ops {
            match o {
                Op::Store(r, t, k) => {
                    ix.store(*r, tier(*t), k);
                    if *r < 5 { for &key in k { model.entry((key, *r)).or_default().insert(*t % 3); } }
                }
                Op::Remove(r, t, k) => {
                    ix.remove(*r, tier(*t), k);
                    for &key in k {
                        if let Some(s) = model.get_mut(&(key, *r)) { s.remove(&(*t % 3)); if s.is_empty() { model.remove(&(key, *r)); } }
                    }
                }
                Op::Reset(r) => {
                    ix.remove_replica(*r);
                    model.retain(|(_, rr), _| rr != r);
                }
                Op::Match(k) => {
                    let mut out = Vec::new();
                    ix.match_prefix(k, &mut out);
                    for (r, c) in out.iter().enumerate() {
                        let run = k.iter().take_while(|&&key| model.contains_key(&(key, r))).count();
                        prop_assert_eq!((c[0] + c[1] + c[2]) as usize, run);
                        prop_assert!(run <= k.len(), "a match never exceeds the request's blocks");
                        let gpu = k[..run].iter().filter(|&&key| model[&(key, r)].contains(&0)).count();
                        prop_assert_eq!(c[0] as usize, gpu);
                    }
                }
            }
            ix.check_invariants().map_err(TestCaseError::fail)?;
        }
        let keys: BTreeSet<u64> = model.keys().map(|k| k.0).collect();
        prop_assert_eq!(ix.len(), keys.len());
        for r in 0..5 {
            let n = model.keys().filter(|k| k.1 == r).count() as u64;
            prop_assert_eq!(ix.replica_blocks(r), n);
        }
    }

    /// Storing then removing the same blocks on every tier leaves nothing.
    #[test]
    fn stored_then_removed_leaves_nothing(r in 0usize..4, keys in prop::collection::vec(any::<u64>(), 0..200), t in 0u8..3) {
        let mut ix = KvIndex::new(1000, 4, 0);
        ix.store(r, tier(t), &keys);
        ix.store(r, tier(t + 1), &keys);
        ix.remove(r, tier(t), &keys);
        ix.remove(r, tier(t + 1), &keys);
        prop_assert!(ix.is_empty());
        prop_assert_eq!(ix.replica_blocks(r), 0);
        ix.check_invariants().map_err(TestCaseError::fail)?;
    }

    /// A replica reset leaves no trace of it, and the others are untouched.
    #[test]
    fn reset_leaves_no_trace(ops in prop::collection::vec(op(), 0..60), victim in 0usize..5) {
        let mut ix = KvIndex::new(10_000, 5, 1);
        for o in &ops {
            match o {
                Op::Store(r, t, k) => { ix.store(*r, tier(*t), k); }
                Op::Remove(r, t, k) => { ix.remove(*r, tier(*t), k); }
                _ => {}
            }
        }
        let others: Vec<u64> = (0..5).map(|r| ix.replica_blocks(r)).collect();
        ix.remove_replica(victim);
        prop_assert_eq!(ix.replica_blocks(victim), 0);
        for key in 0..40u64 {
            for t in Tier::ALL { prop_assert!(!ix.holds(victim, t, key)); }
        }
        for r in (0..5).filter(|&r| r != victim) { prop_assert_eq!(ix.replica_blocks(r), others[r]); }
        ix.check_invariants().map_err(TestCaseError::fail)?;
    }

    /// The cap holds under any sequence of events, and evictions are counted.
    #[test]
    fn cap_holds(cap in 1usize..30, ops in prop::collection::vec(op(), 0..120)) {
        let mut ix = KvIndex::new(cap, 5, 2);
        let mut inserted_before_full = 0u64;
        for o in &ops {
            match o {
                Op::Store(r, t, k) => { ix.store(*r, tier(*t), k); }
                Op::Remove(r, t, k) => { ix.remove(*r, tier(*t), k); }
                Op::Reset(r) => ix.remove_replica(*r),
                Op::Match(k) => { let mut out = Vec::new(); ix.match_prefix(k, &mut out); }
            }
            prop_assert!(ix.len() <= cap);
            ix.check_invariants().map_err(TestCaseError::fail)?;
            inserted_before_full = inserted_before_full.max(ix.len() as u64);
        }
        prop_assert!(inserted_before_full <= cap as u64);
    }

    /// Fair shares: a replica that stays within its share of the cap never loses a block, whatever
    /// the other replicas store, remove or match (they may share its keys).
    #[test]
    fn a_replica_within_its_share_keeps_its_blocks(
        cap in 8usize..60,
        own in prop::collection::vec(0u64..200, 0..30),
        ops in prop::collection::vec(op(), 0..150),
    ) {
        let mut ix = KvIndex::new(cap, 5, 4);
        let share = ix.share();
        let own: Vec<u64> = own.into_iter().map(|k| k + 1000).take(share).collect();
        ix.store(0, Tier::Gpu, &own);
        for o in &ops {
            match o {
                Op::Store(r, t, k) if *r != 0 => {
                    // Widen the others' key space so the index fills; keep some keys in common.
                    let k: Vec<u64> = k.iter().map(|&x| if x % 5 == 0 { 1000 + x } else { x * 7 + *r as u64 * 1_000_000 }).collect();
                    ix.store(*r, tier(*t), &k);
                }
                Op::Remove(r, t, k) if *r != 0 => { ix.remove(*r, tier(*t), k); }
                Op::Reset(r) if *r != 0 => ix.remove_replica(*r),
                Op::Match(k) => { let mut out = Vec::new(); ix.match_prefix(k, &mut out); }
                _ => {}
            }
            prop_assert!(ix.len() <= cap);
            for &key in &own {
                prop_assert!(ix.holds(0, Tier::Gpu, key), "lost {} (cap {}, share {})", key, cap, share);
            }
        }
        ix.check_invariants().map_err(TestCaseError::fail)?;
    }
}
