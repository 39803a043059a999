//! The approximate prefix index behind `prefix_affinity` (and the overlap estimate for text prompts).
//!
//! It is filled only by the router's own decisions, as Ray Serve's PrefixCacheAffinityRouter and
//! SGLang's cache-aware router do: "I sent this prefix to replica r at time t". Entries expire after a
//! TTL (the engine has probably evicted them by then) and the index has a hard cap in blocks, evicting
//! the least recently recorded blocks first. It is generic over the key newtype so token-prompt
//! identities ([`SeqHash`]) and text-prompt identities ([`TextHash`]) live in two separate instances and
//! can never be mixed with each other or with the KV index.
//!
//! Each worker VM of a proxy keeps its own instance; with [`ApproxIndex::start_journal`] an instance
//! also journals its own records for the proxy's other workers and applies theirs
//! ([`ApproxIndex::encode_journal`], [`ApproxIndex::apply_peer`]; the format is in `journal`).

mod journal;

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::block::{SeqHash, TextHash};
pub use journal::{Applied, ENTRY_MAX_KEYS, JOURNAL_MAX_BYTES, JOURNAL_MAX_KEYS};

/// A key type the approximate index can hold.
pub trait PrefixKey: Copy + Eq + core::hash::Hash {
    fn raw(self) -> u64;
    fn from_raw(raw: u64) -> Self;
}
impl PrefixKey for u64 {
    fn raw(self) -> u64 {
        self
    }
    fn from_raw(raw: u64) -> Self {
        raw
    }
}
impl PrefixKey for SeqHash {
    fn raw(self) -> u64 {
        self.0
    }
    fn from_raw(raw: u64) -> Self {
        SeqHash(raw)
    }
}
impl PrefixKey for TextHash {
    fn raw(self) -> u64 {
        self.0
    }
    fn from_raw(raw: u64) -> Self {
        TextHash(raw)
    }
}

/// Most replicas remembered per block; the oldest is forgotten first. Inline, so a block costs no
/// allocation of its own.
const MAX_HOLDERS: usize = 4;

#[derive(Clone, Copy, Debug, Default)]
struct Entry {
    replicas: [u16; MAX_HOLDERS],
    /// Last time each holder was recorded, ms.
    times: [u64; MAX_HOLDERS],
    len: u8,
    /// Time of the latest record for any holder: what expiry is judged by.
    last_ms: u64,
    /// Stamp of the latest record: the queue record carrying it is the live one. A counter, not the
    /// time, so records made within the same millisecond still supersede each other.
    stamp: u64,
}

impl Entry {
    fn holders(&self) -> impl Iterator<Item = (u16, u64)> + '_ {
        (0..self.len as usize).map(|i| (self.replicas[i], self.times[i]))
    }

    /// Records that `r` was sent the block at `at_ms`. Times only move forward: a record another
    /// worker made earlier than this index's own (applied a tick late) does not age a holder, and
    /// on a full block it forgets the oldest holder only if it is newer than that one.
    fn record(&mut self, r: u16, at_ms: u64, stamp: u64) {
        let n = self.len as usize;
        let i = match (0..n).find(|&i| self.replicas[i] == r) {
            Some(i) => i,
            None if n < MAX_HOLDERS => {
                self.len += 1;
                self.times[n] = at_ms;
                n
            }
            // Full: forget the holder recorded longest ago.
            None => match (0..n).min_by_key(|&i| self.times[i]) {
                Some(i) if self.times[i] <= at_ms => {
                    self.times[i] = at_ms;
                    i
                }
                _ => return,
            },
        };
        self.replicas[i] = r;
        self.times[i] = self.times[i].max(at_ms);
        self.last_ms = self.last_ms.max(at_ms);
        self.stamp = stamp;
    }

    fn forget(&mut self, r: u16) {
        let mut n = self.len as usize;
        let mut i = 0;
        while i < n {
            if self.replicas[i] == r {
                n -= 1;
                self.replicas[i] = self.replicas[n];
                self.times[i] = self.times[n];
            } else {
                i += 1;
            }
        }
        self.len = n as u8;
    }
}

/// Approximate prefix index over keys `K`.
#[derive(Clone, Debug)]
pub struct ApproxIndex<K: PrefixKey> {
    map: HashMap<K, Entry>,
    /// Keys in record order with their record stamp; superseded records are skipped on eviction.
    order: VecDeque<(K, u64)>,
    next_stamp: u64,
    capacity: usize,
    ttl_ms: u64,
    evictions: u64,
    /// The latest time this index was given (own records, peers' applied).
    latest_ms: u64,
    /// Per replica: one past `latest_ms` when it was last forgotten ([`ApproxIndex::remove_replica`];
    /// 0: never); a peer's record of it from before then is not applied.
    forgotten_ms: Vec<u64>,
    /// This index's own records for the proxy's other workers; `None` while not sharing.
    journal: Option<journal::Journal>,
}

impl<K: PrefixKey> ApproxIndex<K> {
    pub fn new(capacity_blocks: usize, ttl_ms: u64) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            next_stamp: 0,
            capacity: capacity_blocks.max(1),
            ttl_ms,
            evictions: 0,
            latest_ms: 0,
            forgotten_ms: Vec::new(),
            journal: None,
        }
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Bytes of heap held, from container capacities.
    pub fn heap_bytes(&self) -> usize {
        self.map.capacity() * (size_of::<K>() + size_of::<Entry>() + 1)
            + self.order.capacity() * size_of::<(K, u64)>()
            + self
                .journal
                .as_ref()
                .map_or(0, journal::Journal::heap_bytes)
    }

    /// Records that the blocks `keys` were sent to `replica` at `now_ms` (and journals it for the
    /// other workers while sharing).
    pub fn record(&mut self, replica: usize, keys: &[K], now_ms: u64) {
        let r = replica.min(u16::MAX as usize) as u16;
        self.insert(r, keys.iter().copied(), now_ms, now_ms);
        if let Some(j) = &mut self.journal {
            j.push(
                u32::from(r),
                keys.iter().map(|k| k.raw()),
                now_ms,
                journal::ENTRY_MAX_KEYS,
                journal::JOURNAL_MAX_KEYS,
            );
        }
    }

    /// Records `keys` for `r` at `at_ms`, then enforces the TTL and the cap as of `now_ms`.
    fn insert(&mut self, r: u16, keys: impl Iterator<Item = K>, at_ms: u64, now_ms: u64) {
        for k in keys {
            self.next_stamp += 1;
            let stamp = self.next_stamp;
            self.map.entry(k).or_default().record(r, at_ms, stamp);
            self.order.push_back((k, stamp));
        }
        self.latest_ms = self.latest_ms.max(now_ms);
        self.enforce_cap(self.latest_ms);
    }

    /// Starts journaling this index's own records for the proxy's other workers, and applying
    /// theirs ([`ApproxIndex::apply_peer`]).
    pub fn start_journal(&mut self) {
        self.journal.get_or_insert_with(journal::Journal::default);
    }

    /// This index's records of the last `keep_ms` for the other workers, stamped `now_ms`, for a
    /// router of `replicas` replicas; `None` while not sharing, and before anything was recorded.
    pub fn encode_journal(
        &mut self,
        now_ms: u64,
        keep_ms: u64,
        replicas: usize,
    ) -> Option<Vec<u8>> {
        let j = self.journal.as_mut()?;
        // A worker that never recorded a text prompt publishes nothing.
        j.recorded_any()
            .then(|| j.encode(now_ms, keep_ms, replicas))
    }

    /// Applies the entries of worker `peer`'s journal (from [`ApproxIndex::encode_journal`]) that
    /// this index has not applied yet, as if it had recorded them itself, at their own time (at most
    /// `now_ms`; an entry already past the TTL, or for a replica forgotten since, is skipped). `None`,
    /// and nothing changed, while not sharing and for a journal that is malformed, over the bounds
    /// or for another replica count: it is checked whole before any of it is applied.
    pub fn apply_peer(
        &mut self,
        peer: u32,
        bytes: &[u8],
        replicas: usize,
        now_ms: u64,
    ) -> Option<Applied> {
        let last = self.journal.as_ref()?.applied.get(&peer).copied();
        let (records, restarted) = journal::decode_since(bytes, replicas, last.unwrap_or(0))?;
        // `None` until this index has seen one of the peer's entries: what the peer dropped before
        // then was never this worker's to miss; after a restart its numbers start over.
        let last = if restarted { None } else { last };
        let mut applied = Applied::default();
        let mut newest = last.unwrap_or(0);
        for (i, rec) in records.iter().enumerate() {
            if i == 0 {
                applied.missed = last.map_or(0, |l| rec.seq - l - 1);
            }
            newest = rec.seq;
            let at = rec.at_ms.min(now_ms);
            let forgotten = self.forgotten_ms.get(rec.replica as usize);
            if now_ms - at > self.ttl_ms || forgotten.is_some_and(|&f| at < f) {
                continue;
            }
            let keys = journal::keys(bytes, rec).map(K::from_raw);
            self.insert(rec.replica, keys, at, now_ms);
            applied.entries += 1;
            applied.blocks += (rec.keys.len() / 8) as u64;
        }
        if let Some(j) = &mut self.journal
            && newest > 0
        {
            j.applied.insert(peer, newest);
        }
        Some(applied)
    }

    fn enforce_cap(&mut self, now_ms: u64) {
        // Drop expired and over-cap blocks from the old end; skip queue records superseded by a later
        // record of the same key (their stamp no longer matches the entry's).
        while let Some(&(k, stamp)) = self.order.front() {
            let Some(last_ms) = self
                .map
                .get(&k)
                .filter(|e| e.stamp == stamp)
                .map(|e| e.last_ms)
            else {
                self.order.pop_front();
                continue;
            };
            let expired = now_ms.saturating_sub(last_ms) > self.ttl_ms;
            if self.map.len() > self.capacity || expired {
                self.map.remove(&k);
                self.order.pop_front();
                if !expired {
                    self.evictions += 1;
                }
                continue;
            }
            break;
        }
        // Re-recording the same keys grows the queue with superseded records; compact it so it stays
        // proportional to the map.
        if self.order.len() > 2 * self.capacity + 64 {
            let map = &self.map;
            self.order
                .retain(|(k, stamp)| map.get(k).is_some_and(|e| e.stamp == *stamp));
        }
    }

    /// Each replica's run of leading blocks recorded within the TTL. `out` is resized to `replicas`.
    pub fn match_prefix(&self, keys: &[K], now_ms: u64, replicas: usize, out: &mut Vec<u32>) {
        out.clear();
        out.resize(replicas, 0);
        for (i, k) in keys.iter().enumerate() {
            let Some(e) = self.map.get(k) else { break };
            let mut any = false;
            for (r, t) in e.holders() {
                let r = r as usize;
                if r < replicas && out[r] as usize == i && now_ms.saturating_sub(t) <= self.ttl_ms {
                    out[r] += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
    }

    /// Forgets a replica everywhere (it restarted or left).
    pub fn remove_replica(&mut self, replica: usize) {
        let Ok(r) = u16::try_from(replica) else {
            return;
        };
        if self.forgotten_ms.len() <= replica {
            self.forgotten_ms.resize(replica + 1, 0);
        }
        self.forgotten_ms[replica] = self.latest_ms.saturating_add(1);
        self.map.retain(|_, e| {
            e.forget(r);
            e.len > 0
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: &[u64]) -> Vec<SeqHash> {
        v.iter().map(|&x| SeqHash(x)).collect()
    }

    #[test]
    fn records_match_and_expire() {
        let mut ix = ApproxIndex::new(100, 1000);
        ix.record(1, &keys(&[1, 2, 3]), 0);
        ix.record(0, &keys(&[1]), 500);
        let mut out = Vec::new();
        ix.match_prefix(&keys(&[1, 2, 3, 4]), 900, 2, &mut out);
        assert_eq!(out, vec![1, 3]);
        ix.match_prefix(&keys(&[1, 2, 3]), 1200, 2, &mut out);
        assert_eq!(out, vec![1, 0], "replica 1's record is older than the TTL");
    }

    #[test]
    fn cap_holds_and_rerecording_refreshes() {
        let mut ix = ApproxIndex::new(3, 1_000_000);
        ix.record(0, &keys(&[1, 2, 3]), 1);
        ix.record(0, &keys(&[1]), 2);
        ix.record(0, &keys(&[4]), 3);
        assert_eq!(ix.len(), 3);
        assert_eq!(ix.evictions(), 1);
        let mut out = Vec::new();
        ix.match_prefix(&keys(&[1]), 3, 1, &mut out);
        assert_eq!(out, vec![1], "re-recorded block 1 survived, block 2 went");
        ix.match_prefix(&keys(&[2]), 3, 1, &mut out);
        assert_eq!(out, vec![0]);
        for t in 0..10_000u64 {
            ix.record(0, &keys(&[t % 2]), 10 + t);
        }
        assert!(ix.order.len() <= 2 * 3 + 64 + 1);
    }

    #[test]
    fn rerecording_within_one_millisecond_keeps_the_queue_bounded() {
        // A burst of requests sharing a prefix in the same millisecond (a frozen clock) must not let
        // the queue of superseded records grow until compaction runs on every record.
        let mut ix = ApproxIndex::new(64, 1_000_000);
        let prefix: Vec<u64> = (0..32).collect();
        for _ in 0..5_000 {
            ix.record(1, &keys(&prefix), 7);
        }
        assert_eq!(ix.len(), 32);
        assert!(
            ix.order.len() <= 32 + 1,
            "queue holds {} records",
            ix.order.len()
        );
    }

    #[test]
    fn a_full_block_forgets_its_oldest_holder() {
        let mut ix = ApproxIndex::new(10, 1000);
        for r in 0..5 {
            ix.record(r, &keys(&[1]), r as u64);
        }
        let mut out = Vec::new();
        ix.match_prefix(&keys(&[1]), 10, 5, &mut out);
        assert_eq!(out, vec![0, 1, 1, 1, 1]);
        ix.remove_replica(3);
        ix.match_prefix(&keys(&[1]), 10, 5, &mut out);
        assert_eq!(out, vec![0, 1, 1, 0, 1]);
    }

    #[test]
    fn text_and_seq_instances_are_separate_types() {
        let mut t: ApproxIndex<TextHash> = ApproxIndex::new(10, 10);
        t.record(0, &[TextHash(1)], 0);
        t.remove_replica(0);
        assert!(t.is_empty());
    }
}
