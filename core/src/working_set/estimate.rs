//! The estimate: per replica, the recent blocks it holds, and what a request would add to them;
//! the reuse share that weighs a block asked for only once.

use super::WorkingSet;
use super::slots::{Holder, MASK_REPLICAS, Slots, each_bit};
use std::collections::VecDeque;

/// The reuse share's memory: its counts decay by this factor per request (about 50 requests).
const REUSE_DECAY: f64 = 0.98;

/// A replica's side of the working set: its blocks' queue of (time, block) in request order
/// (entries older than the window leave from the front; a block requested again leaves a stale
/// entry behind, whose time is not the block's any more), and how many blocks it holds and counts.
#[derive(Clone, Debug, Default)]
pub(super) struct ReplicaSet {
    order: VecDeque<(u64, u64)>,
    len: usize,
    counted: usize,
}

impl ReplicaSet {
    /// Re-touched blocks leave stale queue entries behind; compacts when they dominate.
    fn compact(&mut self, replica: u32, slots: &Slots) {
        if self.order.len() > 2 * self.len + 1024 {
            self.order.retain(|(t, k)| {
                slots
                    .get(*k)
                    .and_then(|s| s.holders().find(|h| h.replica == replica))
                    .is_some_and(|h| h.at == *t)
            });
        }
    }

    /// After blocks joined: [`ReplicaSet::expire`], then [`ReplicaSet::compact`].
    fn settle(&mut self, replica: u32, before_ms: u64, max_sampled: usize, slots: &mut Slots) {
        self.expire(replica, before_ms, max_sampled, slots);
        self.compact(replica, slots);
    }

    /// Drops entries older than `before_ms`, and the oldest past `max_sampled`, from this replica
    /// (number `replica`): its holder leaves the block's slot, and the slot goes with its last.
    fn expire(&mut self, replica: u32, before_ms: u64, max_sampled: usize, slots: &mut Slots) {
        while let Some(&(t, key)) = self.order.front() {
            if t >= before_ms && self.len <= max_sampled {
                break;
            }
            self.order.pop_front();
            // One lookup; nothing for a stale queue entry (the block was requested here again
            // since, or left and came back).
            if let Some(h) = slots.remove_holder(key, replica, t) {
                self.len -= 1;
                self.counted -= h.counted as usize;
            }
        }
    }
}

impl WorkingSet {
    /// The share of recently requested blocks that had been requested before: how likely a block
    /// asked for once is to be asked for again. 0 before any request.
    pub fn reuse_share(&self) -> f64 {
        if self.requested > 0.0 {
            (self.reused / self.requested).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// Records that `sampled_keys` (from [`super::Sampling::sample`]) were requested on `replica` at
    /// `now_ms`.
    pub fn touch(&mut self, replica: usize, sampled_keys: &[u64], now_ms: u64) {
        if replica >= self.replicas.len() {
            return;
        }
        let r = replica as u32;
        let set = &mut self.replicas[replica];
        let mut reused = 0usize;
        for &key in sampled_keys {
            // One lookup answers whether any replica holds the block (asked for before) and what
            // this one holds, and keeps both current.
            let slot = self.slots.get_or_insert(key);
            let seen = slot.n > 0;
            reused += seen as usize;
            // A peer's entry can be older than what this router recorded since: keep the newest.
            let at = match slot.find_mut(r) {
                Some(h) => {
                    h.at = h.at.max(now_ms);
                    set.counted -= h.counted as usize;
                    h.counted = seen;
                    h.at
                }
                None => {
                    slot.push(Holder {
                        at: now_ms,
                        replica: r,
                        counted: seen,
                    });
                    set.len += 1;
                    now_ms
                }
            };
            set.counted += seen as usize;
            set.order.push_back((at, key));
        }
        self.requested = self.requested * REUSE_DECAY + sampled_keys.len() as f64;
        self.reused = self.reused * REUSE_DECAY + reused as f64;
        set.settle(
            r,
            now_ms.saturating_sub(self.window_ms),
            self.max_sampled,
            &mut self.slots,
        );
    }

    /// Records blocks `replica` stored (its feed, `working_set.from_feed`): those another
    /// proxy sent it, which this router cannot see otherwise, and the blocks of generated outputs.
    /// Each sampled key the replica's set does not hold yet joins as asked for once, at `now_ms`
    /// (blocks this router sent there are held already: their store follows the admission). The
    /// reuse share is left alone: a store is not a request.
    pub fn stored(&mut self, replica: usize, keys: &[u64], now_ms: u64) {
        if replica >= self.replicas.len() {
            return;
        }
        let r = replica as u32;
        let set = &mut self.replicas[replica];
        for &key in keys.iter().filter(|&&k| self.sampling.keeps(k)) {
            let slot = self.slots.get_or_insert(key);
            if slot.position(r).is_some() {
                continue;
            }
            slot.push(Holder {
                at: now_ms,
                replica: r,
                counted: false,
            });
            set.len += 1;
            set.order.push_back((now_ms, key));
        }
        set.settle(
            r,
            now_ms.saturating_sub(self.window_ms),
            self.max_sampled,
            &mut self.slots,
        );
    }

    /// Forgets what fell out of the window.
    pub fn expire(&mut self, now_ms: u64) {
        let before = now_ms.saturating_sub(self.window_ms);
        for (r, set) in self.replicas.iter_mut().enumerate() {
            set.expire(r as u32, before, self.max_sampled, &mut self.slots);
        }
    }

    /// Blocks in `replica`'s working set (as of the last `expire`/`touch`), estimated: those asked
    /// for before in full, those asked for once weighted by the reuse share.
    pub fn blocks(&self, replica: usize) -> f64 {
        self.replicas.get(replica).map_or(0.0, |s| {
            let once = s.len - s.counted;
            (s.counted as f64 + self.reuse_share() * once as f64) * self.sampling.one_in_n() as f64
        })
    }

    /// Per replica, how much the request's blocks (`sampled_keys`, from [`super::Sampling::sample`]) would
    /// grow its working set, estimated: a block asked for before joins in full where it is not held
    /// yet, and completes its weight where it is held as asked for once; a block never seen joins
    /// with the reuse share's weight.
    pub fn added(&self, sampled_keys: &[u64]) -> Vec<f64> {
        let p = self.reuse_share();
        let scale = self.sampling.one_in_n() as f64;
        if self.replicas.len() > MASK_REPLICAS {
            return self.added_by_replica(sampled_keys, p, scale);
        }
        // Each replica's sum takes its terms in key order, as it always has, so that the scores, and
        // the decisions, stay bit for bit what they were. A replica that holds none of the request's
        // blocks so far has taken the same terms as every other such replica (the reuse share for a
        // block never seen, 1 for one seen elsewhere): `absent` is that sum, computed once, and a
        // replica gets a sum of its own from the first block it holds (starting from `absent`
        // before that block). Most replicas hold none of a request's blocks, so the work per block
        // is one lookup and a few additions, not one addition per replica.
        let mut absent = 0.0f64;
        let mut own = [0.0f64; MASK_REPLICAS];
        let mut active = 0u64;
        for k in sampled_keys {
            let Some(slot) = self.slots.get(*k) else {
                absent += p;
                each_bit(active, |r| own[r] += p);
                continue;
            };
            let (held, counted) = slot.masks();
            each_bit(held & !active, |r| own[r] = absent);
            active |= held;
            absent += 1.0;
            each_bit(active, |r| {
                own[r] += if held >> r & 1 == 0 {
                    1.0
                } else if counted >> r & 1 == 1 {
                    0.0
                } else {
                    1.0 - p
                }
            });
        }
        (0..self.replicas.len())
            .map(|r| if active >> r & 1 == 1 { own[r] } else { absent } * scale)
            .collect()
    }

    /// [`WorkingSet::added`] for a fleet too wide for bitmasks: per block, every replica takes its
    /// term (1 where it does not hold the block), in key order as in [`WorkingSet::added`].
    fn added_by_replica(&self, sampled_keys: &[u64], p: f64, scale: f64) -> Vec<f64> {
        let mut added = vec![0.0f64; self.replicas.len()];
        let mut terms = vec![1.0f64; self.replicas.len()];
        for k in sampled_keys {
            let Some(slot) = self.slots.get(*k) else {
                added.iter_mut().for_each(|a| *a += p);
                continue;
            };
            for h in slot.holders() {
                terms[h.replica as usize] = if h.counted { 0.0 } else { 1.0 - p };
            }
            added.iter_mut().zip(&terms).for_each(|(a, t)| *a += t);
            for h in slot.holders() {
                terms[h.replica as usize] = 1.0;
            }
        }
        added.into_iter().map(|a| a * scale).collect()
    }

    /// Sampled entries held over all replicas (for the memory figure).
    pub fn sampled_entries(&self) -> usize {
        self.replicas.iter().map(|s| s.len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::super::slots::Slot;
    use super::*;
    use crate::working_set::test_keys::*;
    use crate::working_set::*;
    use hashbrown::HashMap;

    #[test]
    fn estimates_the_working_set_within_the_window() {
        let mut ws = WorkingSet::new(2, 1_000, 1 << 20, Sampling::DEFAULT);
        ws.touch(0, &keys(0..4_000), 0);
        // Nothing was asked for twice yet: no reuse, no working set.
        assert_eq!((ws.reuse_share(), ws.blocks(0)), (0.0, 0.0));
        ws.touch(0, &keys(0..6_000), 500);
        // 4,000 of the 6,000 were asked for before: they count in full, the 2,000 new ones with the
        // reuse share (4,000 of about 10,000 blocks requested, decayed).
        let p = ws.reuse_share();
        assert!((0.35..0.45).contains(&p), "{p}");
        assert!(
            near(ws.blocks(0), 4_000.0 + p * 2_000.0),
            "{}",
            ws.blocks(0)
        );
        assert_eq!(ws.blocks(1), 0.0);
        // Of 4,000..8,000: the 2,000 held once on replica 0 complete their weight there and join
        // replica 1 in full; the 2,000 never seen join either with the reuse share.
        let added = ws.added(&keys(4_000..8_000));
        assert!(
            near(added[0], 2_000.0 * (1.0 - p) + 2_000.0 * p),
            "{added:?}"
        );
        assert!(near(added[1], 2_000.0 + 2_000.0 * p), "{added:?}");
        assert_eq!(ws.added(&keys(0..4_000))[0], 0.0);
        // At 1,200 ms the first touch (0 ms) has left the window, but its blocks were touched again
        // at 500 ms.
        let before = ws.blocks(0);
        ws.expire(1_200);
        assert_eq!(ws.blocks(0), before);
        ws.expire(1_600);
        assert_eq!(ws.blocks(0), 0.0);
        assert_eq!(ws.sampled_entries(), 0);
    }

    #[test]
    fn distinct_prompts_make_no_working_set() {
        let mut ws = WorkingSet::new(2, u64::MAX, 1 << 22, Sampling::DEFAULT);
        for i in 0..100 {
            ws.touch(
                i % 2,
                &keys(i as u64 * 1_000..(i as u64 + 1) * 1_000),
                i as u64,
            );
        }
        assert_eq!(ws.reuse_share(), 0.0);
        assert_eq!((ws.blocks(0), ws.blocks(1)), (0.0, 0.0));
        assert_eq!(ws.added(&keys(500_000..501_000)), vec![0.0, 0.0]);
    }

    #[test]
    fn samples_are_powers_of_two_that_nest_and_scale_back_up() {
        for bad in [0, 3, 12, 2_048, u64::MAX] {
            assert_eq!(Sampling::one_in(bad), None, "{bad}");
        }
        assert_eq!(Sampling::one_in(8), Some(Sampling::DEFAULT));
        assert!(Sampling::one_in(1).unwrap().keeps(12_345));
        let (eighth, coarse) = (Sampling::DEFAULT, Sampling::one_in(32).unwrap());
        let all: Vec<u64> = (0..64_000u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let fine = eighth.sample(all.iter().copied());
        let few = coarse.sample(all.iter().copied());
        assert_eq!((fine.len(), few.len()), (8_000, 2_000));
        assert!(
            few.iter().all(|&k| eighth.keeps(k)),
            "one in 32 is within one in 8"
        );
        // Either sample estimates the same working set: 20,000 blocks asked for twice.
        for s in [eighth, coarse] {
            let mut ws = WorkingSet::new(1, u64::MAX, 1 << 20, s);
            let session = s.sample(all[..20_000].iter().copied());
            ws.touch(0, &session, 0);
            ws.touch(0, &session, 1);
            assert!(near(ws.blocks(0), 20_000.0), "{s:?}: {}", ws.blocks(0));
        }
        // A journal carries the keys its writer sampled: one written at one in 8 has keys one in
        // 32 does not keep, and a reader sampling one in 32 refuses it whole (a misconfigured fleet
        // shows in the refusal counters rather than in skewed estimates).
        let mut writer = WorkingSet::new(1, 10_000, 1 << 20, eighth);
        writer.start_journal();
        writer.record(0, &fine[..64], 5);
        let j = writer.encode_journal(10, 1_000).unwrap();
        let mut reader = WorkingSet::new(1, 10_000, 1 << 20, coarse);
        reader.start_journal();
        assert_eq!(reader.apply_peer(1, &j), None);
        let mut same = WorkingSet::new(1, 10_000, 1 << 20, eighth);
        same.start_journal();
        assert_eq!(same.apply_peer(1, &j).map(|a| a.entries), Some(1));
    }

    #[test]
    fn a_session_that_moves_counts_where_it_is_asked_for() {
        let mut ws = WorkingSet::new(3, 10_000, 1 << 20, Sampling::DEFAULT);
        let session = keys(0..8_000);
        ws.touch(0, &session, 0);
        ws.touch(0, &session, 5);
        assert!(near(ws.blocks(0), 8_000.0));
        // The session moves to replica 1: seen before, it counts there at once; replica 0 keeps it
        // until the window forgets it (its cache still holds it).
        ws.touch(1, &session, 10);
        assert!(near(ws.blocks(0), 8_000.0) && near(ws.blocks(1), 8_000.0));
        let n = (session.len() << 3) as f64;
        assert_eq!(ws.added(&session), vec![0.0, 0.0, n]);
    }

    #[test]
    fn only_one_block_in_eight_is_kept() {
        let mut ws = WorkingSet::new(1, u64::MAX, 1 << 20, Sampling::DEFAULT);
        let all: Vec<u64> = (0..6_400).collect();
        assert_eq!(Sampling::DEFAULT.sample(all.iter().copied()).len(), 800);
        let k = Sampling::DEFAULT.sample(all.into_iter());
        ws.touch(0, &k, 0);
        ws.touch(0, &k, 1);
        assert_eq!(ws.sampled_entries(), 800);
        assert_eq!(ws.blocks(0), 6_400.0);
    }

    #[test]
    fn size_is_bounded_and_out_of_range_replicas_are_ignored() {
        let mut ws = WorkingSet::new(2, u64::MAX, 64 * 8, Sampling::DEFAULT);
        let k: Vec<u64> = (0..1_000).map(|i| i * 8).collect();
        ws.touch(0, &k, 5);
        ws.touch(0, &k, 6);
        assert_eq!(ws.sampled_entries(), 64);
        assert_eq!(ws.blocks(0), 64.0 * 8.0);
        assert_eq!(ws.added(&k[990..]), vec![0.0, 80.0]);
        ws.touch(7, &k, 5);
        assert_eq!(ws.blocks(7), 0.0);
        assert_eq!(ws.sampled_entries(), 64);
    }

    #[test]
    fn stored_blocks_join_as_asked_for_once() {
        let mut ws = WorkingSet::new(2, 1_000, 1 << 20, Sampling::DEFAULT);
        // Some reuse, so blocks asked for once weigh something.
        ws.touch(0, &keys(0..800), 0);
        ws.touch(0, &keys(0..800), 1);
        let p = ws.reuse_share();
        assert!(p > 0.3, "{p}");
        let before = ws.blocks(0);
        // Replica 1 stores what another proxy sent it: joins with the reuse share's weight; the
        // reuse share itself does not move (a store is not a request).
        ws.stored(
            1,
            &(0..80_000)
                .map(|i: u64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) + 1_000_000)
                .collect::<Vec<_>>(),
            2,
        );
        assert_eq!(ws.reuse_share(), p);
        assert!(
            ws.blocks(1) > 0.0 && ws.blocks(1) < 80_000.0,
            "{}",
            ws.blocks(1)
        );
        // Blocks replica 0 holds already (this router sent them) are left as they are.
        ws.stored(0, &keys(0..800), 3);
        assert_eq!(ws.blocks(0), before);
        // A stored block a request then asks for counts as asked for before.
        let k = keys(2_000..2_800);
        ws.stored(1, &k, 4);
        let once = ws.added(&k)[1];
        ws.touch(1, &k, 5);
        assert!(once > 0.0 && ws.added(&k)[1] == 0.0);
        // Out of range: ignored; out of the window: forgotten.
        ws.stored(9, &k, 6);
        ws.expire(2_000);
        assert_eq!(ws.sampled_entries(), 0);
    }

    #[test]
    fn retouching_does_not_grow_the_queue_without_bound() {
        let mut ws = WorkingSet::new(1, u64::MAX, 1 << 20, Sampling::DEFAULT);
        let k: Vec<u64> = (0..100).map(|i| i * 8).collect();
        for t in 0..1_000 {
            ws.touch(0, &k, t);
        }
        assert_eq!(ws.sampled_entries(), 100);
        assert_eq!(ws.blocks(0), 800.0);
        assert!(ws.replicas[0].order.len() <= 2 * 100 + 1024 + 100);
    }

    /// The working set as it was before its one map of slots: a map per replica (block -> last
    /// requested, counted) beside the queues, scored by a lookup in every replica's map. The slots
    /// must agree with it bit for bit (times, counts, queues, estimates), so that decisions do not
    /// change.
    /// A replica's map (block -> last requested, counted), queue and count of counted blocks.
    type RefSet = (HashMap<u64, (u64, bool)>, VecDeque<(u64, u64)>, usize);

    struct Reference {
        window_ms: u64,
        max_sampled: usize,
        sets: Vec<RefSet>,
        requested: f64,
        reused: f64,
    }

    impl Reference {
        fn new(replicas: usize, window_ms: u64, max_blocks: usize) -> Reference {
            Reference {
                window_ms,
                max_sampled: (max_blocks >> 3).max(1),
                sets: vec![Default::default(); replicas],
                requested: 0.0,
                reused: 0.0,
            }
        }

        fn reuse_share(&self) -> f64 {
            if self.requested > 0.0 {
                (self.reused / self.requested).clamp(0.0, 1.0)
            } else {
                0.0
            }
        }

        fn touch(&mut self, r: usize, sampled_keys: &[u64], now_ms: u64) {
            if r >= self.sets.len() {
                return;
            }
            let mut reused = 0;
            for &key in sampled_keys {
                let seen = self.sets.iter().any(|s| s.0.contains_key(&key));
                reused += seen as usize;
                let (entries, order, counted) = &mut self.sets[r];
                let at = match entries.get_mut(&key) {
                    Some(e) => {
                        let at = e.0.max(now_ms);
                        *counted -= e.1 as usize;
                        *e = (at, seen);
                        at
                    }
                    None => {
                        entries.insert(key, (now_ms, seen));
                        now_ms
                    }
                };
                *counted += seen as usize;
                order.push_back((at, key));
            }
            self.requested = self.requested * REUSE_DECAY + sampled_keys.len() as f64;
            self.reused = self.reused * REUSE_DECAY + reused as f64;
            self.settle(r, now_ms);
        }

        fn stored(&mut self, r: usize, keys: &[u64], now_ms: u64) {
            if r >= self.sets.len() {
                return;
            }
            let (entries, order, _) = &mut self.sets[r];
            for &key in keys.iter().filter(|&&k| Sampling::DEFAULT.keeps(k)) {
                if entries.contains_key(&key) {
                    continue;
                }
                entries.insert(key, (now_ms, false));
                order.push_back((now_ms, key));
            }
            self.settle(r, now_ms);
        }

        fn settle(&mut self, r: usize, now_ms: u64) {
            self.expire_one(r, now_ms);
            let (entries, order, _) = &mut self.sets[r];
            if order.len() > 2 * entries.len() + 1024 {
                order.retain(|(t, k)| entries.get(k).is_some_and(|&(last, _)| last == *t));
            }
        }

        fn expire_one(&mut self, r: usize, now_ms: u64) {
            let before = now_ms.saturating_sub(self.window_ms);
            let (entries, order, counted) = &mut self.sets[r];
            while let Some(&(t, key)) = order.front() {
                if t >= before && entries.len() <= self.max_sampled {
                    break;
                }
                order.pop_front();
                if let Some(&(last, c)) = entries.get(&key)
                    && last == t
                {
                    entries.remove(&key);
                    *counted -= c as usize;
                }
            }
        }

        fn expire(&mut self, now_ms: u64) {
            (0..self.sets.len()).for_each(|r| self.expire_one(r, now_ms));
        }

        fn blocks(&self, r: usize) -> f64 {
            let (entries, _, counted) = &self.sets[r];
            let once = entries.len() - counted;
            (*counted as f64 + self.reuse_share() * once as f64) * 8.0
        }

        /// [`WorkingSet::added`] as it was before the holders map: a lookup in every replica's map.
        fn added(&self, sampled_keys: &[u64]) -> Vec<f64> {
            let p = self.reuse_share();
            let mut added = vec![0.0f64; self.sets.len()];
            for k in sampled_keys {
                if !self.sets.iter().any(|s| s.0.contains_key(k)) {
                    added.iter_mut().for_each(|a| *a += p);
                    continue;
                }
                for (a, set) in added.iter_mut().zip(&self.sets) {
                    *a += match set.0.get(k) {
                        Some(&(_, true)) => 0.0,
                        Some(&(_, false)) => 1.0 - p,
                        None => 1.0,
                    };
                }
            }
            added.into_iter().map(|a| a * 8.0).collect()
        }

        /// Asserts that `ws` holds what this reference holds, and estimates the same to the bit.
        fn check(&self, ws: &WorkingSet, probe: &[u64], what: &str) {
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ws.added(probe)), bits(&self.added(probe)), "{what}");
            let blocks = |f: &dyn Fn(usize) -> f64| (0..self.sets.len()).map(f).collect::<Vec<_>>();
            assert_eq!(
                bits(&blocks(&|r| ws.blocks(r))),
                bits(&blocks(&|r| self.blocks(r))),
                "{what}"
            );
            assert_eq!(ws.reuse_share().to_bits(), self.reuse_share().to_bits());
            let mut held = 0;
            for (r, (entries, order, counted)) in self.sets.iter().enumerate() {
                let set = &ws.replicas[r];
                assert_eq!((set.len, set.counted), (entries.len(), *counted), "{what}");
                assert_eq!(&set.order, order, "{what}: replica {r}'s queue");
                for (k, &(at, c)) in entries {
                    let h = ws
                        .slots
                        .get(*k)
                        .unwrap()
                        .holders()
                        .find(|h| h.replica == r as u32)
                        .copied();
                    let want = Holder {
                        at,
                        replica: r as u32,
                        counted: c,
                    };
                    assert_eq!(h, Some(want), "{what}: replica {r}, block {k}");
                }
                held += entries.len();
            }
            // Nothing else: no holder the reference lacks, no empty slot.
            let slots: usize = ws.slots.values().map(Slot::len).sum();
            assert_eq!(slots, held, "{what}");
            assert!(ws.slots.values().all(|s| s.n > 0), "{what}");
        }
    }

    #[test]
    fn the_slots_agree_with_per_replica_maps() {
        // Random touches (a small key space, so blocks recur on several replicas, and queues fill
        // with stale entries until compacted), stores, peers' entries older than what was recorded,
        // expiry by time and by size (a long window: by size only, and the queues compacted);
        // fleets under and over the masks' 64 replicas.
        let fleets = [1, 2, 3, 16, 64, 65, 200];
        for (replicas, window) in fleets
            .map(|r| (r, 50))
            .into_iter()
            .chain([(1, 1 << 40), (3, 1 << 40)])
        {
            let mut ws = WorkingSet::new(replicas, window, 300 * 8, Sampling::DEFAULT);
            let mut reference = Reference::new(replicas, window, 300 * 8);
            let mut peer = WorkingSet::new(replicas, window, 300 * 8, Sampling::DEFAULT);
            peer.start_journal();
            ws.start_journal();
            let mut rng = crate::rng::SplitMix64::new(replicas as u64);
            let mut now = 0u64;
            let steps = if replicas > 16 { 600 } else { 2_000 };
            for step in 0..steps {
                now += rng.next_u64() % 4;
                let r = (rng.next_u64() % (replicas as u64 + 1)) as usize;
                let n = (rng.next_u64() % 40) as usize;
                // Phases of few blocks (retouched: stale queue entries) and of many (expiry by size).
                let space = if (step / 250) % 2 == 0 { 100 } else { 800 };
                let k: Vec<u64> = (0..n).map(|_| (rng.next_u64() % space) * 8).collect();
                match step % 5 {
                    0 => {
                        let at = now.saturating_sub(30);
                        peer.record(r, &k, at);
                        let j = peer.encode_journal(now, 1_000).unwrap();
                        ws.apply_peer(9, &j).unwrap();
                        // Journalled (so applied) when it names a replica and carries blocks.
                        if r < replicas && !k.is_empty() {
                            reference.touch(r, &k, at);
                        }
                    }
                    1 => {
                        let mut all = k.clone();
                        all.extend(k.iter().map(|x| x + 1));
                        ws.stored(r, &all, now);
                        reference.stored(r, &all, now);
                    }
                    _ => {
                        reference.check(&ws, &k, &format!("{replicas} replicas, step {step}"));
                        ws.touch(r, &k, now);
                        reference.touch(r, &k, now);
                    }
                }
                if step % 7 == 0 {
                    ws.expire(now);
                    reference.expire(now);
                }
                reference.check(&ws, &k, &format!("{replicas} replicas, step {step}"));
            }
            assert!(ws.sampled_entries() > 0);
            ws.expire(now + window + 1);
            assert!(ws.slots.len() == 0 && ws.sampled_entries() == 0);
        }
    }
}
