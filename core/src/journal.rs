//! A worker's numbered journal of what it admitted, for the proxy's other workers: entries of
//! `(replica, time, keys)`, each numbered, kept encoded, bounded in keys and dropped oldest first,
//! published every tick; each reader remembers per peer the highest number it applied. The
//! working set ([`crate::working_set`]) journals sampled block keys and the approximate index
//! ([`crate::approx`]) a text prompt's block keys; each decodes and checks a peer's journal its own
//! way (their bounds and key rules differ).
//!
//! Encoded: `published_ms u64, replicas u32, entries u32`, then per entry `seq u64, at_ms u64,
//! replica u32, keys u32, keys x u64`, all little-endian.

use hashbrown::HashMap;
use std::collections::VecDeque;

/// Bytes before the first entry.
pub const HEADER: usize = 16;
/// Bytes of an entry before its keys.
pub const ENTRY_HEADER: usize = 24;

/// This worker's recent entries for the other workers, and how far it applied theirs.
#[derive(Clone, Debug, Default)]
pub struct Journal {
    /// Per entry kept, oldest first: its time, key count and encoded length. The encodings follow
    /// each other in `bytes[start..]`: written once when recorded, so publishing the journal each
    /// tick is one copy of them (encoding every kept entry again each tick was most of the
    /// admitting worker's tick).
    entries: VecDeque<(u64, usize, usize)>,
    bytes: Vec<u8>,
    start: usize,
    keys: usize,
    next_seq: u64,
    /// Per peer worker: the highest entry number applied.
    pub applied: HashMap<u32, u64>,
}

impl Journal {
    /// Journals that `keys` (at most `entry_max_keys` of them are kept) went to `replica` at
    /// `at_ms`, then drops the oldest entries while more than `journal_max_keys` keys are kept. An
    /// entry without keys is not written, and takes no number.
    pub fn push(
        &mut self,
        replica: u32,
        keys: impl Iterator<Item = u64>,
        at_ms: u64,
        entry_max_keys: usize,
        journal_max_keys: usize,
    ) {
        let from = self.bytes.len();
        let seq = self.next_seq + 1;
        self.bytes.extend_from_slice(&seq.to_le_bytes());
        self.bytes.extend_from_slice(&at_ms.to_le_bytes());
        self.bytes.extend_from_slice(&replica.to_le_bytes());
        let count_at = self.bytes.len();
        self.bytes.extend_from_slice(&0u32.to_le_bytes());
        let mut n = 0usize;
        for k in keys.take(entry_max_keys) {
            self.bytes.extend_from_slice(&k.to_le_bytes());
            n += 1;
        }
        if n == 0 {
            self.bytes.truncate(from);
            return;
        }
        self.next_seq = seq;
        self.bytes[count_at..count_at + 4].copy_from_slice(&(n as u32).to_le_bytes());
        self.keys += n;
        self.entries.push_back((at_ms, n, self.bytes.len() - from));
        while self.keys > journal_max_keys && self.drop_oldest() {}
    }

    /// Drops the oldest entry; `false` when there is none. The bytes of dropped entries are
    /// reclaimed once they are half of the buffer (each byte moved once on average).
    fn drop_oldest(&mut self) -> bool {
        let Some((_, keys, len)) = self.entries.pop_front() else {
            return false;
        };
        self.keys -= keys;
        self.start += len;
        if self.start > self.bytes.len() / 2 {
            self.bytes.drain(..self.start);
            self.start = 0;
        }
        true
    }

    /// The journal for the other workers, stamped `now_ms`, for a router of `replicas` replicas,
    /// after dropping entries older than `keep_ms` (long enough for every worker to read them: the
    /// filter keeps a few ticks).
    pub fn encode(&mut self, now_ms: u64, keep_ms: u64, replicas: usize) -> Vec<u8> {
        let from = now_ms.saturating_sub(keep_ms);
        while self.entries.front().is_some_and(|e| e.0 < from) && self.drop_oldest() {}
        let kept = self.bytes.get(self.start..).unwrap_or_default();
        let mut out = Vec::with_capacity(HEADER + kept.len());
        out.extend_from_slice(&now_ms.to_le_bytes());
        out.extend_from_slice(&(replicas as u32).to_le_bytes());
        out.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        out.extend_from_slice(kept);
        out
    }

    /// Whether anything was ever journaled.
    pub fn recorded_any(&self) -> bool {
        self.next_seq > 0
    }

    /// Keys kept.
    #[cfg(test)]
    pub fn keys(&self) -> usize {
        self.keys
    }

    /// Bytes of heap held.
    pub fn heap_bytes(&self) -> usize {
        self.bytes.capacity() + self.entries.capacity() * size_of::<(u64, usize, usize)>()
    }

    /// Whether the bytes of dropped entries were reclaimed (at most half the buffer is dead).
    #[cfg(test)]
    pub fn reclaimed(&self) -> bool {
        self.start <= self.bytes.len() / 2 + 1
    }
}
