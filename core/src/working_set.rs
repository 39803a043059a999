//! Each replica's recent working set: the distinct prompt blocks this router sent it within a time
//! window that are asked for more than once. An engine's prefix cache evicts least recently used
//! blocks, and LRU keeps almost nothing of a set of sessions that cycle through more context than the
//! cache holds: every session's next turn finds its context evicted by the others. Knowing how much
//! recent context each replica is asked to hold lets `kv_load` avoid pushing a replica whose sessions
//! still fit over its cache (`kv_load.overflow_weight`, docs/design.md section 2.6).
//!
//! A block asked for before (on any replica) within the window counts in full. A block asked for
//! only once so far counts with the probability that such a block is asked for again, learned from
//! the traffic: the share of recently requested blocks that had been requested before. An agent
//! session's first turn is the cache its next turn needs (the share is high, 0.9 and more on the
//! coding-agent trace), while distinct prompts are no cache to protect (the share is near 0): counting
//! them in full made a replica that served distinct prompts look full of live contexts, which it was
//! then kept from receiving (a replica back from an outage did not get its share back).
//!
//! Only a sample of the blocks is kept ([`Sampling`]): those whose hash has its low bits zero (one
//! in `kv_load.working_set_sample`; block hashes are uniform), and counts are scaled back up. A
//! working set is thousands of blocks, so the estimate is within a few percent, and the per-request
//! work (a hash test per block, a map operation per sampled block) and the memory are that fraction
//! of an exact count's. In a proxy the fraction matters most where no request sees it: every worker
//! applies every other worker's sampled admissions on its tick (below).
//!
//! One table over all replicas: sampled block -> its holders, each with the time the block was last
//! requested there and whether it is counted there (asked for before, here or elsewhere); per
//! replica, a queue of (time, block) in request order and its counts. Entries older than the window
//! leave from the queue's front; a block requested again leaves a stale queue entry behind (its time
//! is not the holder's any more), and the queue is compacted when those dominate. The size is
//! bounded: past `max_sampled` entries a replica drops its oldest, so hostile or unusual traffic
//! costs bounded memory: per sampled block 48 bytes in the slab (wasm32; two holders inline, more on
//! the heap) and 10-20 in the hash table, per holder 16 bytes in its queue, up to three times that
//! with stale entries.
//!
//! Scoring a request ([`WorkingSet::added`]) and recording it ask, per sampled block, whether any
//! replica holds it and what each holds: one lookup. Recording a block is one lookup, its expiry
//! one. This layout is the working set's cost in a proxy (docs/envoy.md, "the working set's cost"):
//! with up to a few hundred thousand sampled blocks, every lookup misses the caches, and each
//! worker applies every other worker's admissions on its tick, so the cost per block is the cost
//! of the term. It replaced a map per replica (block -> time, counted) beside a map of holders
//! (block -> bitmasks), where recording a block took three lookups and its expiry three more; it
//! keeps exactly their times, counts, queues and estimates (tested against them), so decisions did
//! not change. A fleet of more than 64 routing units (the filter allows 256 replicas, and
//! data-parallel ranks multiply them) is scored by a pass over every replica per block seen.
//!
//! A proxy runs one router per worker thread, and each sees only the requests its worker admitted:
//! with 8 workers, each would see an eighth of every replica's working set and of its reuse. So the
//! routers share their admissions: with the journal on ([`WorkingSet::start_journal`]), each
//! recorded admission ([`WorkingSet::record`]) is kept, numbered, for a short while; the filter
//! publishes the journal ([`WorkingSet::encode_journal`]) every tick and every other worker applies
//! the entries it has not seen yet ([`WorkingSet::apply_peer`]) as if it had admitted them itself.
//! Each worker's view then lags the others' admissions by about a tick, and converges.

use hashbrown::hash_table::Entry as TableEntry;
use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use std::collections::VecDeque;
use std::hash::BuildHasher;

/// The reuse share's memory: its counts decay by this factor per request (about 50 requests).
const REUSE_DECAY: f64 = 0.98;

/// The journal keeps at most this many sampled keys (about 3,000 coding-agent requests); past it the
/// oldest entries go, and a worker that had not read them yet misses them.
const JOURNAL_MAX_KEYS: usize = 1 << 18;
/// Encoded journal: `published_ms u64, replicas u32, entries u32`, then per entry `seq u64,
/// at_ms u64, replica u32, keys u32, keys x u64`, all little-endian.
const JOURNAL_HEADER: usize = 16;
const ENTRY_HEADER: usize = 24;

/// Routing units past this many have no bit in [`Holders`]' masks.
const MASK_REPLICAS: usize = 64;

/// Calls `f` with the index of each bit set in `mask`, lowest first.
fn each_bit(mut mask: u64, mut f: impl FnMut(usize)) {
    while mask != 0 {
        f(mask.trailing_zeros() as usize);
        mask &= mask - 1;
    }
}

/// Which blocks the working set keeps: one in `2^k`, those whose hash has its low `k` bits zero.
/// Block hashes are uniform, so any one in `2^k` is as good a sample as another, and the samples
/// nest: a block kept at one in 32 is kept at one in 8 too.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sampling {
    mask: u64,
}

impl Sampling {
    /// The coarsest sample allowed: one block in this many.
    pub const MAX_ONE_IN: u64 = 1024;
    /// One block in 8, `kv_load.working_set_sample`'s default.
    pub const DEFAULT: Sampling = Sampling { mask: 7 };

    /// One block in `n`; `None` unless `n` is a power of two from 1 to [`Sampling::MAX_ONE_IN`].
    pub fn one_in(n: u64) -> Option<Sampling> {
        (n.is_power_of_two() && n <= Self::MAX_ONE_IN).then_some(Sampling { mask: n - 1 })
    }

    /// Whether this sample keeps the block `key`.
    pub fn keeps(self, key: u64) -> bool {
        key & self.mask == 0
    }

    /// `n` of one block in `n`: what a sampled count is multiplied by.
    pub fn one_in_n(self) -> u64 {
        self.mask + 1
    }

    /// The keys this sample keeps, in order.
    pub fn sample(self, keys: impl Iterator<Item = u64>) -> Vec<u64> {
        keys.filter(|&k| self.keeps(k)).collect()
    }
}

/// One replica holding a sampled block: when the block was last requested there, and whether it is
/// counted there (asked for before, here or elsewhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Holder {
    at: u64,
    replica: u32,
    counted: bool,
}

/// Holders a [`Slot`] keeps inline; more go to the heap. Most sampled blocks are held by one
/// replica, a session's by one or two; a prompt prefix common to every session by many.
const INLINE_HOLDERS: usize = 2;

/// One sampled block: the replicas holding it, each with its time and counted flag, in no
/// particular order. In [`Slots`] only while some replica holds the block (`n > 0`). Everything
/// recording, scoring or expiring a block needs is here, so each is one lookup (the module docs).
#[derive(Clone, Debug, Default)]
struct Slot {
    inline: [Holder; INLINE_HOLDERS],
    n: u32,
    /// Holders past the inline ones (`n - INLINE_HOLDERS` of them); `None` when there are none.
    /// Boxed: 8 bytes in every slot rather than a `Vec`'s 24, for the few blocks that spill.
    #[allow(clippy::box_collection)]
    more: Option<Box<Vec<Holder>>>,
}

impl Slot {
    fn len(&self) -> usize {
        self.n as usize
    }

    fn holders(&self) -> impl Iterator<Item = &Holder> {
        self.inline[..self.len().min(INLINE_HOLDERS)]
            .iter()
            .chain(self.more.iter().flat_map(|m| m.iter()))
    }

    /// `replica`'s holder, if it holds the block.
    fn find_mut(&mut self, replica: u32) -> Option<&mut Holder> {
        let n = self.len().min(INLINE_HOLDERS);
        if let Some(h) = self.inline[..n].iter_mut().find(|h| h.replica == replica) {
            return Some(h);
        }
        self.more
            .as_mut()?
            .iter_mut()
            .find(|h| h.replica == replica)
    }

    /// `replica`'s place among the holders.
    fn position(&self, replica: u32) -> Option<usize> {
        self.holders().position(|h| h.replica == replica)
    }

    fn get(&self, i: usize) -> Option<&Holder> {
        match i.checked_sub(INLINE_HOLDERS) {
            None => self.inline[..self.len().min(INLINE_HOLDERS)].get(i),
            Some(j) => self.more.as_ref()?.get(j),
        }
    }

    fn get_mut(&mut self, i: usize) -> Option<&mut Holder> {
        let n = self.len().min(INLINE_HOLDERS);
        match i.checked_sub(INLINE_HOLDERS) {
            None => self.inline[..n].get_mut(i),
            Some(j) => self.more.as_mut()?.get_mut(j),
        }
    }

    fn push(&mut self, h: Holder) {
        let n = self.len();
        match self.inline.get_mut(n) {
            Some(slot) => *slot = h,
            None => self.more.get_or_insert_with(Default::default).push(h),
        }
        self.n += 1;
    }

    /// Removes holder `i` (the last one takes its place).
    fn remove(&mut self, i: usize) -> Option<Holder> {
        let removed = *self.get(i)?;
        let last = self.len() - 1;
        let moved = match last.checked_sub(INLINE_HOLDERS) {
            None => self.inline[last],
            Some(_) => {
                let more = self.more.as_mut()?;
                let h = more.pop()?;
                if more.is_empty() {
                    self.more = None;
                }
                h
            }
        };
        self.n -= 1;
        if i < last
            && let Some(slot) = self.get_mut(i)
        {
            *slot = moved;
        }
        Some(removed)
    }

    /// The bitmasks of the replicas holding the block and of those where it is counted (bit `r`
    /// for replica `r`, for fleets of at most [`MASK_REPLICAS`] replicas).
    fn masks(&self) -> (u64, u64) {
        self.holders().fold((0, 0), |(held, counted), h| {
            let b = 1u64 << h.replica;
            (held | b, if h.counted { counted | b } else { counted })
        })
    }
}

/// Slab positions a chunk holds: the slab grows a chunk at a time and never moves what it holds (a
/// `Vec` that doubles would copy megabytes on one request).
const SLAB_CHUNK: usize = 4096;

/// Every sampled block some replica holds, with its [`Slot`]: a slab of (block, slot) and a hash
/// table of slab positions. The table keeps each block's 32-bit hash beside its position (8-byte
/// buckets: a few megabytes, where buckets holding the slots themselves made tens), so probing and
/// growing it never read the slab. Positions freed by expiry are reused latest first: a request's
/// new blocks are written where the blocks it just expired were (still in cache), not to a cold
/// bucket of a large table.
#[derive(Clone, Debug, Default)]
struct Slots {
    table: HashTable<(u32, u32)>,
    hasher: DefaultHashBuilder,
    chunks: Vec<Box<[(u64, Slot)]>>,
    free: Vec<u32>,
    /// Slab positions ever taken (the next fresh one).
    used: u32,
}

/// The table's hash from a block's 32-bit hash: the low bits pick the bucket, the top ones tag it.
fn wide(h: u32) -> u64 {
    (h as u64) << 32 | h as u64
}

fn slab_at(chunks: &[Box<[(u64, Slot)]>], i: u32) -> &(u64, Slot) {
    &chunks[i as usize / SLAB_CHUNK][i as usize % SLAB_CHUNK]
}

fn slab_at_mut(chunks: &mut [Box<[(u64, Slot)]>], i: u32) -> &mut (u64, Slot) {
    &mut chunks[i as usize / SLAB_CHUNK][i as usize % SLAB_CHUNK]
}

impl Slots {
    /// The block's hash (seeded per instance: blocks come from clients).
    fn hash(&self, key: u64) -> u32 {
        self.hasher.hash_one(key) as u32
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.table.len()
    }

    fn get(&self, key: u64) -> Option<&Slot> {
        let h = self.hash(key);
        let chunks = &self.chunks;
        let &(i, _) = self
            .table
            .find(wide(h), |&(i, hh)| hh == h && slab_at(chunks, i).0 == key)?;
        Some(&slab_at(chunks, i).1)
    }

    /// The block's slot, an empty one (`n == 0`) if no replica holds it: the caller adds a holder.
    fn get_or_insert(&mut self, key: u64) -> &mut Slot {
        let h = self.hash(key);
        let Slots {
            table,
            chunks,
            free,
            used,
            ..
        } = self;
        let i = match table.entry(
            wide(h),
            |&(i, hh)| hh == h && slab_at(chunks, i).0 == key,
            |&(_, hh)| wide(hh),
        ) {
            TableEntry::Occupied(o) => o.get().0,
            TableEntry::Vacant(v) => {
                let i = free.pop().unwrap_or_else(|| {
                    *used += 1;
                    *used - 1
                });
                v.insert((i, h));
                if i as usize / SLAB_CHUNK == chunks.len() {
                    chunks.push(vec![(0, Slot::default()); SLAB_CHUNK].into_boxed_slice());
                }
                *slab_at_mut(chunks, i) = (key, Slot::default());
                i
            }
        };
        &mut slab_at_mut(chunks, i).1
    }

    /// Removes `replica`'s holder of the block if its time is `at` (else the queue entry naming it
    /// is stale), and the block with its last holder.
    fn remove_holder(&mut self, key: u64, replica: u32, at: u64) -> Option<Holder> {
        let h = self.hash(key);
        let Slots {
            table,
            chunks,
            free,
            ..
        } = self;
        let entry = table
            .find_entry(wide(h), |&(i, hh)| hh == h && slab_at(chunks, i).0 == key)
            .ok()?;
        let i = entry.get().0;
        let slot = &mut slab_at_mut(chunks, i).1;
        let pos = slot
            .holders()
            .position(|x| x.replica == replica && x.at == at)?;
        let removed = slot.remove(pos);
        if slot.n == 0 {
            entry.remove();
            free.push(i);
        }
        removed
    }

    #[cfg(test)]
    fn values(&self) -> impl Iterator<Item = &Slot> {
        self.table.iter().map(|&(i, _)| &slab_at(&self.chunks, i).1)
    }
}

/// A replica's side of the working set: its blocks' queue of (time, block) in request order
/// (entries older than the window leave from the front; a block requested again leaves a stale
/// entry behind, whose time is not the block's any more), and how many blocks it holds and counts.
#[derive(Clone, Debug, Default)]
struct ReplicaSet {
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

/// One admission in the journal: its number, time, replica and sampled keys.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    seq: u64,
    at_ms: u64,
    replica: u32,
    keys: Vec<u64>,
}

impl Entry {
    /// The entry as a journal carries it: number, time, replica, key count, keys (little endian).
    fn write(&self, out: &mut Vec<u8>) {
        write_entry(out, self.seq, self.at_ms, self.replica, &self.keys);
    }
}

/// Writes a journal entry: number, time, replica, key count, keys (little endian).
fn write_entry(out: &mut Vec<u8>, seq: u64, at_ms: u64, replica: u32, keys: &[u64]) {
    out.reserve(ENTRY_HEADER + keys.len() * 8);
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&at_ms.to_le_bytes());
    out.extend_from_slice(&replica.to_le_bytes());
    out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        out.extend_from_slice(&k.to_le_bytes());
    }
}

/// This router's recent admissions for the other workers, and how far it read theirs.
#[derive(Clone, Debug, Default)]
struct Journal {
    /// Per entry kept, oldest first: its time, keys and encoded length. The encodings follow each
    /// other in `bytes[start..]`: written once when recorded, so publishing the journal each tick
    /// is one copy of them (encoding every kept entry again each tick was most of the admitting
    /// worker's tick).
    entries: VecDeque<(u64, usize, usize)>,
    bytes: Vec<u8>,
    start: usize,
    keys: usize,
    next_seq: u64,
    /// Per peer worker: the highest entry number applied.
    applied: HashMap<u32, u64>,
}

impl Journal {
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
}

/// Recent distinct blocks per replica (estimated from a sample).
#[derive(Clone, Debug)]
pub struct WorkingSet {
    window_ms: u64,
    sampling: Sampling,
    max_sampled: usize,
    replicas: Vec<ReplicaSet>,
    /// Every block some replica's set holds, with its holders (kept with `replicas`' queues).
    slots: Slots,
    /// Decayed counts of sampled blocks requested, and of those requested before (the reuse share).
    requested: f64,
    reused: f64,
    /// Admissions kept for the proxy's other workers; `None` while not sharing.
    journal: Option<Journal>,
}

/// What [`WorkingSet::apply_peer`] did with a peer's journal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Entries applied (new since the last read).
    pub entries: usize,
    /// Entries the peer had dropped before this worker read them (its journal overflowed, or this
    /// worker read it too late).
    pub missed: u64,
}

impl WorkingSet {
    /// `max_blocks`: the most blocks one replica's set describes (the `sampling`'s share of that is
    /// kept).
    pub fn new(
        replicas: usize,
        window_ms: u64,
        max_blocks: usize,
        sampling: Sampling,
    ) -> WorkingSet {
        WorkingSet {
            window_ms,
            sampling,
            max_sampled: (max_blocks / sampling.one_in_n() as usize).max(1),
            replicas: vec![ReplicaSet::default(); replicas],
            slots: Slots::default(),
            requested: 0.0,
            reused: 0.0,
            journal: None,
        }
    }

    /// Which blocks this working set keeps: a request's keys are sampled by it before
    /// [`WorkingSet::added`] and [`WorkingSet::record`].
    pub fn sampling(&self) -> Sampling {
        self.sampling
    }

    /// Starts keeping recorded admissions for the proxy's other workers (the filter calls it once
    /// the worker has a number in shared data).
    pub fn start_journal(&mut self) {
        self.journal.get_or_insert_with(Journal::default);
    }

    /// Records that this router sent `sampled_keys` (from [`Sampling::sample`]) to `replica` at
    /// `now_ms`: [`WorkingSet::touch`], and a journal entry when sharing.
    pub fn record(&mut self, replica: usize, sampled_keys: &[u64], now_ms: u64) {
        self.touch(replica, sampled_keys, now_ms);
        let Some(j) = &mut self.journal else {
            return;
        };
        if replica >= self.replicas.len() || sampled_keys.is_empty() {
            return;
        }
        j.next_seq += 1;
        j.keys += sampled_keys.len();
        let len = j.bytes.len();
        write_entry(
            &mut j.bytes,
            j.next_seq,
            now_ms,
            replica as u32,
            sampled_keys,
        );
        j.entries
            .push_back((now_ms, sampled_keys.len(), j.bytes.len() - len));
        while j.keys > JOURNAL_MAX_KEYS && j.drop_oldest() {}
    }

    /// The journal for the other workers, stamped `now_ms`, after dropping entries older than
    /// `keep_ms` (long enough for every worker to read them: the filter keeps a few ticks). `None`
    /// while not sharing.
    pub fn encode_journal(&mut self, now_ms: u64, keep_ms: u64) -> Option<Vec<u8>> {
        let j = self.journal.as_mut()?;
        let from = now_ms.saturating_sub(keep_ms);
        while j.entries.front().is_some_and(|e| e.0 < from) && j.drop_oldest() {}
        let kept = j.bytes.get(j.start..).unwrap_or_default();
        let mut out = Vec::with_capacity(JOURNAL_HEADER + kept.len());
        out.extend_from_slice(&now_ms.to_le_bytes());
        out.extend_from_slice(&(self.replicas.len() as u32).to_le_bytes());
        out.extend_from_slice(&(j.entries.len() as u32).to_le_bytes());
        out.extend_from_slice(kept);
        Some(out)
    }

    /// Applies the entries of worker `peer`'s journal (from [`WorkingSet::encode_journal`]) that this
    /// router has not applied yet, as if it had admitted them itself. `None`, and nothing applied,
    /// for a malformed journal or one for another replica count (a worker on another
    /// configuration); the journal is checked whole before any of it is applied.
    pub fn apply_peer(&mut self, peer: u32, bytes: &[u8]) -> Option<Applied> {
        let (entries, last) = self.decode_new(peer, bytes)?;
        Some(self.apply_entries(peer, last, entries, None))
    }

    /// A peer's entries this router has not applied yet, and the peer's mark before them, checked
    /// whole; `None` for a malformed journal or while not sharing.
    fn decode_new(&self, peer: u32, bytes: &[u8]) -> Option<(Vec<Entry>, Option<u64>)> {
        // `None` until this router has seen one of the peer's entries: what the peer dropped before
        // then (before this worker started, say) was never this worker's to miss.
        let last = self.journal.as_ref()?.applied.get(&peer).copied();
        let (entries, restarted) =
            decode_since(bytes, self.replicas.len(), last.unwrap_or(0), self.sampling)?;
        // After a restart the peer's numbers start over: so does this router's mark.
        Some((entries, if restarted { None } else { last }))
    }

    /// Applies decoded entries of `peer` as [`WorkingSet::apply_peer`] does; with `now_ms` (a
    /// peer on another clock: another proxy) each entry's time is clamped to at most `now_ms`, and
    /// one already out of the window is skipped, so a peer's clock ahead of this one's cannot make
    /// entries outlive the window or expire this router's own.
    fn apply_entries(
        &mut self,
        peer: u32,
        last: Option<u64>,
        entries: Vec<Entry>,
        now_ms: Option<u64>,
    ) -> Applied {
        let mut newest = last.unwrap_or(0);
        let mut applied = Applied::default();
        let from = now_ms.map_or(0, |n| n.saturating_sub(self.window_ms));
        for (i, e) in entries.iter().enumerate() {
            if i == 0 {
                applied.missed = last.map_or(0, |l| e.seq - l - 1);
            }
            newest = e.seq;
            let at = now_ms.map_or(e.at_ms, |n| e.at_ms.min(n));
            if at < from {
                continue;
            }
            self.touch(e.replica as usize, &e.keys, at);
            applied.entries += 1;
        }
        if let Some(j) = &mut self.journal
            && newest > 0
        {
            j.applied.insert(peer, newest);
        }
        applied
    }

    /// Applies another proxy's answer ([`encode_bundle`]: its workers' journals) from peer proxy
    /// number `peer` (its place in this proxy's configuration, below [`MAX_REMOTE_PEERS`]), at
    /// `now_ms` on this router's clock. The whole answer is checked before any of it is applied:
    /// `None`, nothing applied, for a malformed bundle or journal, one for another replica count,
    /// or while not sharing. Each remote worker's entries are kept apart by [`remote_key`].
    pub fn apply_remote(&mut self, peer: u32, bundle: &[u8], now_ms: u64) -> Option<Applied> {
        if peer >= MAX_REMOTE_PEERS {
            return None;
        }
        let mut decoded = Vec::new();
        for (worker, journal) in decode_bundle(bundle)? {
            let key = remote_key(peer, worker);
            let (entries, last) = self.decode_new(key, journal)?;
            decoded.push((key, last, entries));
        }
        let mut total = Applied::default();
        for (key, last, entries) in decoded {
            let a = self.apply_entries(key, last, entries, Some(now_ms));
            total.entries += a.entries;
            total.missed += a.missed;
        }
        Some(total)
    }

    /// The highest entry number applied from each worker of peer proxy `peer`, for its `after`
    /// query ([`format_after`]): what it need not send again.
    pub fn remote_marks(&self, peer: u32) -> Vec<(u32, u64)> {
        let Some(j) = &self.journal else {
            return Vec::new();
        };
        let mut out: Vec<(u32, u64)> = j
            .applied
            .iter()
            .filter(|&(&k, _)| k >= REMOTE_BASE && (k - REMOTE_BASE) >> WORKER_BITS == peer)
            .map(|(&k, &seq)| ((k - REMOTE_BASE) & ((1 << WORKER_BITS) - 1), seq))
            .collect();
        out.sort_unstable();
        out
    }

    /// The share of recently requested blocks that had been requested before: how likely a block
    /// asked for once is to be asked for again. 0 before any request.
    pub fn reuse_share(&self) -> f64 {
        if self.requested > 0.0 {
            (self.reused / self.requested).clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// Records that `sampled_keys` (from [`Sampling::sample`]) were requested on `replica` at
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

    /// Records blocks `replica` stored (its feed, `kv_load.working_set_from_feed`): those another
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

    /// Per replica, how much the request's blocks (`sampled_keys`, from [`Sampling::sample`]) would
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

/// Decodes a journal for `replicas` replicas, checking every length; entries must be numbered in
/// increasing order, name a replica in range, and carry only keys `sampling` keeps (a journal
/// written with a finer sample, by a proxy configured otherwise, is refused). The whole journal is
/// checked, but only the entries numbered after `after` are returned (the rest were applied on an
/// earlier tick, and their keys are not copied again).
fn decode_journal(
    bytes: &[u8],
    replicas: usize,
    after: u64,
    sampling: Sampling,
) -> Option<(Vec<Entry>, u64)> {
    let u32_at = |b: &[u8], i: usize| -> Option<u32> {
        Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?))
    };
    let u64_at = |b: &[u8], i: usize| -> Option<u64> {
        Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
    };
    if u32_at(bytes, 8)? as usize != replicas {
        return None;
    }
    let count = u32_at(bytes, 12)? as usize;
    let mut at = JOURNAL_HEADER;
    let mut out = Vec::with_capacity(count.min(bytes.len() / ENTRY_HEADER));
    let mut prev = 0u64;
    for _ in 0..count {
        let (seq, at_ms) = (u64_at(bytes, at)?, u64_at(bytes, at + 8)?);
        let (replica, n) = (u32_at(bytes, at + 16)?, u32_at(bytes, at + 20)? as usize);
        at += ENTRY_HEADER;
        let body = bytes.get(at..at.checked_add(n.checked_mul(8)?)?)?;
        at += body.len();
        let keys = body
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([1; 8])));
        if seq <= prev || replica as usize >= replicas || !keys.clone().all(|k| sampling.keeps(k)) {
            return None;
        }
        prev = seq;
        if seq <= after {
            continue;
        }
        let keys = keys.collect();
        out.push(Entry {
            seq,
            at_ms,
            replica,
            keys,
        });
    }
    (at == bytes.len()).then_some((out, prev))
}

/// Worker numbers of a proxy fit in this many bits (a proxy counts at most 1,024 workers).
const WORKER_BITS: u32 = 10;
/// Peer keys of other proxies' workers start here; a proxy's own workers number below it.
const REMOTE_BASE: u32 = 1 << 31;
/// The most peer proxies one proxy reads from.
pub const MAX_REMOTE_PEERS: u32 = 1 << 16;
/// An answer carries at most this many workers' journals.
pub const MAX_BUNDLE_PARTS: usize = 1 << WORKER_BITS;
/// Tags a bundle ("kvWS" plus a version), so that another answer from the peer's path (an error
/// page, a proxy in between) is refused for what it is.
const BUNDLE_MAGIC: u32 = u32::from_le_bytes(*b"kvW1");

/// The applied-mark key of worker `worker` of peer proxy `peer`: apart from this proxy's own
/// workers (below [`REMOTE_BASE`]) and from every other peer's.
fn remote_key(peer: u32, worker: u32) -> u32 {
    REMOTE_BASE | peer << WORKER_BITS | worker
}

/// A proxy's answer to a peer: its workers' journals, each as that worker published it (or trimmed
/// by [`journal_after`]). Layout: `magic u32, parts u32`, then per part `worker u32, len u32,
/// len bytes`, all little-endian.
pub fn encode_bundle<'a>(parts: impl IntoIterator<Item = (u32, &'a [u8])>) -> Vec<u8> {
    let mut out = BUNDLE_MAGIC.to_le_bytes().to_vec();
    out.extend_from_slice(&0u32.to_le_bytes());
    let mut n = 0u32;
    for (worker, journal) in parts {
        out.extend_from_slice(&worker.to_le_bytes());
        out.extend_from_slice(&(journal.len() as u32).to_le_bytes());
        out.extend_from_slice(journal);
        n += 1;
    }
    out[4..8].copy_from_slice(&n.to_le_bytes());
    out
}

/// Splits a bundle into `(worker, journal)` parts, checking every length and that workers are
/// distinct, below 1,024, and at most [`MAX_BUNDLE_PARTS`]; `None` for anything else (the journals
/// themselves are checked when applied).
pub fn decode_bundle(bytes: &[u8]) -> Option<Vec<(u32, &[u8])>> {
    let u32_at = |i: usize| -> Option<u32> {
        Some(u32::from_le_bytes(bytes.get(i..i + 4)?.try_into().ok()?))
    };
    if u32_at(0)? != BUNDLE_MAGIC {
        return None;
    }
    let n = u32_at(4)? as usize;
    if n > MAX_BUNDLE_PARTS {
        return None;
    }
    let mut at = 8;
    let mut out: Vec<(u32, &[u8])> = Vec::with_capacity(n);
    for _ in 0..n {
        let (worker, len) = (u32_at(at)?, u32_at(at + 4)? as usize);
        at += 8;
        let journal = bytes.get(at..at.checked_add(len)?)?;
        at += len;
        if worker >= 1 << WORKER_BITS || out.iter().any(|&(w, _)| w == worker) {
            return None;
        }
        out.push((worker, journal));
    }
    (at == bytes.len()).then_some(out)
}

/// The entries of a journal numbered after `after`, checked whole ([`decode_journal`]); when all of
/// its numbers are below `after` the writer restarted and numbers from 1 again (a whole other proxy
/// can; a worker of this one cannot), and all its entries are returned, with `true`.
fn decode_since(
    bytes: &[u8],
    replicas: usize,
    after: u64,
    sampling: Sampling,
) -> Option<(Vec<Entry>, bool)> {
    let (entries, newest) = decode_journal(bytes, replicas, after, sampling)?;
    if entries.is_empty() && newest > 0 && newest < after {
        return Some((decode_journal(bytes, replicas, 0, sampling)?.0, true));
    }
    Some((entries, false))
}

/// A worker's published journal with only the entries numbered after `after` (what the asking
/// proxy has applied already), for `replicas` replicas and this proxy's `sampling`; `None` for a
/// journal that does not decode. An `after` beyond the journal's newest entry means the asker's
/// mark is from before this worker restarted: the whole journal is returned, and the asker starts
/// over ([`WorkingSet::apply_remote`]).
pub fn journal_after(
    bytes: &[u8],
    replicas: usize,
    after: u64,
    sampling: Sampling,
) -> Option<Vec<u8>> {
    let (entries, _) = decode_since(bytes, replicas, after, sampling)?;
    let keys: usize = entries.iter().map(|e| e.keys.len()).sum();
    let mut out = Vec::with_capacity(JOURNAL_HEADER + entries.len() * ENTRY_HEADER + keys * 8);
    out.extend_from_slice(bytes.get(..12)?);
    out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    entries.iter().for_each(|e| e.write(&mut out));
    Some(out)
}

/// The `after` query value: `worker:seq` pairs joined by `,` (empty for none).
pub fn format_after(marks: &[(u32, u64)]) -> String {
    let parts: Vec<String> = marks.iter().map(|(w, s)| format!("{w}:{s}")).collect();
    parts.join(",")
}

/// Reads an `after` query value ([`format_after`]); `None` for anything malformed, a worker number
/// of 1,024 or more, or more than [`MAX_BUNDLE_PARTS`] pairs. An empty value is no marks.
pub fn parse_after(v: &str) -> Option<Vec<(u32, u64)>> {
    if v.is_empty() {
        return Some(Vec::new());
    }
    let mut out = Vec::new();
    for part in v.split(',') {
        let (w, s) = part.split_once(':')?;
        let w: u32 = w.parse().ok()?;
        if w >= 1 << WORKER_BITS || out.len() >= MAX_BUNDLE_PARTS {
            return None;
        }
        out.push((w, s.parse().ok()?));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys `0..n` scattered over the hash space like block hashes, sampled.
    fn keys(range: std::ops::Range<u64>) -> Vec<u64> {
        Sampling::DEFAULT.sample(range.map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
    }

    fn near(got: f64, want: f64) -> bool {
        (got - want).abs() <= 0.1 * want
    }

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
    fn workers_sharing_their_journals_see_what_one_router_sees() {
        let session = |i: u64| keys(i * 10_000..i * 10_000 + 3_000);
        let mut one = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        let mut w = [
            WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT),
            WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT),
        ];
        w.iter_mut().for_each(WorkingSet::start_journal);
        // Two sessions, two turns each; the turns of each session alternate between the workers.
        for (t, (s, r)) in [(0, 0), (1, 1), (0, 0), (1, 1)].into_iter().enumerate() {
            let t = t as u64 * 10;
            one.touch(r, &session(s), t);
            w[t as usize / 10 % 2].record(r, &session(s), t);
            let [a, b] = &mut w;
            let ja = a.encode_journal(t, 1_000).unwrap();
            let jb = b.encode_journal(t, 1_000).unwrap();
            a.apply_peer(1, &jb).unwrap();
            b.apply_peer(0, &ja).unwrap();
        }
        for r in 0..2 {
            assert!(one.blocks(r) > 2_000.0, "{}", one.blocks(r));
            for x in &w {
                assert!(
                    near(x.blocks(r), one.blocks(r)),
                    "{} {}",
                    x.blocks(r),
                    one.blocks(r)
                );
            }
        }
        // Alone, each worker sees each session once: no reuse, no working set.
        let mut alone = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        alone.touch(0, &session(0), 0);
        alone.touch(1, &session(1), 10);
        assert_eq!(alone.blocks(0) + alone.blocks(1), 0.0);
    }

    #[test]
    fn a_journal_is_applied_once_and_dropped_entries_are_counted() {
        let mut a = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        let mut b = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        assert_eq!(a.encode_journal(0, 100), None, "not sharing");
        a.start_journal();
        b.start_journal();
        a.record(0, &keys(0..800), 0);
        a.record(1, &keys(800..1_600), 50);
        let j = a.encode_journal(60, 100).unwrap();
        assert_eq!(b.apply_peer(0, &j).unwrap().entries, 2);
        assert_eq!(
            b.apply_peer(0, &j).unwrap(),
            Applied::default(),
            "nothing new"
        );
        // Entries older than what is kept are dropped; a reader that comes too late misses them.
        a.record(0, &keys(1_600..2_400), 100);
        a.record(0, &keys(2_400..3_200), 300);
        let j = a.encode_journal(300, 100).unwrap();
        assert_eq!(
            b.apply_peer(0, &j).unwrap(),
            Applied {
                entries: 1,
                missed: 1
            }
        );
        // Another peer's numbers are its own, and a first read misses nothing: what the peer
        // dropped before this worker first read it was never this worker's to read.
        assert_eq!(
            b.apply_peer(7, &j).unwrap(),
            Applied {
                entries: 1,
                missed: 0
            }
        );
        assert_eq!(
            b.sampled_entries(),
            a.sampled_entries() - keys(1_600..2_400).len()
        );
        // A first read of an empty journal sets no mark either.
        let mut late = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        late.start_journal();
        let empty = a.encode_journal(10_000, 100).unwrap();
        assert_eq!(late.apply_peer(0, &empty).unwrap(), Applied::default());
        a.record(1, &keys(3_200..4_000), 10_001);
        let j = a.encode_journal(10_001, 100).unwrap();
        assert_eq!(
            late.apply_peer(0, &j).unwrap(),
            Applied {
                entries: 1,
                missed: 0
            }
        );
    }

    #[test]
    fn a_bad_journal_is_refused_whole() {
        let mut a = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        a.start_journal();
        a.record(0, &keys(0..800), 0);
        a.record(1, &keys(800..1_600), 1);
        let j = a.encode_journal(1, 100).unwrap();
        let mut b = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        assert_eq!(b.apply_peer(0, &j), None, "not sharing: nothing applied");
        b.start_journal();
        let mut bad = vec![j[..j.len() - 1].to_vec(), j[..20].to_vec(), Vec::new()];
        let mut extra = j.clone();
        extra.push(0);
        bad.push(extra);
        let mut unsampled = j.clone();
        unsampled[JOURNAL_HEADER + ENTRY_HEADER] |= 1;
        bad.push(unsampled);
        let mut replica = j.clone();
        replica[JOURNAL_HEADER + 16] = 2;
        bad.push(replica);
        let mut huge = j.clone();
        huge[JOURNAL_HEADER + 20..JOURNAL_HEADER + 24].copy_from_slice(&u32::MAX.to_le_bytes());
        bad.push(huge);
        for b_ in &bad {
            assert_eq!(b.apply_peer(0, b_), None);
        }
        let mut three = WorkingSet::new(3, 10_000, 1 << 20, Sampling::DEFAULT);
        three.start_journal();
        assert_eq!(three.apply_peer(0, &j), None, "another replica count");
        assert_eq!(b.sampled_entries(), 0);
        assert_eq!(b.apply_peer(0, &j).unwrap().entries, 2);
    }

    #[test]
    fn the_journal_is_bounded() {
        let mut a = WorkingSet::new(1, u64::MAX, 1 << 24, Sampling::DEFAULT);
        a.start_journal();
        let k = keys(0..8_000);
        for t in 0..(2 * JOURNAL_MAX_KEYS / k.len()) as u64 {
            a.record(0, &k, t);
        }
        let j = a.encode_journal(u64::MAX / 2, u64::MAX).unwrap();
        assert!(j.len() <= JOURNAL_MAX_KEYS * 8 + 16_384, "{}", j.len());
    }

    #[test]
    fn the_journal_publishes_its_entries_as_recorded() {
        // Against the kept entries encoded one by one at each publication (as the journal did
        // before it kept them encoded), through drops by age and by size and the reclaiming of
        // dropped bytes.
        let mut a = WorkingSet::new(3, u64::MAX, 1 << 24, Sampling::DEFAULT);
        a.start_journal();
        let mut kept: VecDeque<Entry> = VecDeque::new();
        let mut rng = crate::rng::SplitMix64::new(5);
        let mut seq = 0;
        for t in 0..300u64 {
            let n = rng.next_u64() % if t % 50 < 10 { 1_000_000 } else { 3_000 };
            let k = keys(t * 1_000_000..t * 1_000_000 + n);
            let r = (rng.next_u64() % 4) as usize;
            a.record(r, &k, t);
            if r < 3 && !k.is_empty() {
                seq += 1;
                kept.push_back(Entry {
                    seq,
                    at_ms: t,
                    replica: r as u32,
                    keys: k,
                });
                while kept.iter().map(|e| e.keys.len()).sum::<usize>() > JOURNAL_MAX_KEYS {
                    kept.pop_front();
                }
            }
            if t % 3 == 0 {
                let keep = rng.next_u64() % 40;
                kept.retain(|e| e.at_ms >= t.saturating_sub(keep));
                let mut want = t.to_le_bytes().to_vec();
                want.extend_from_slice(&3u32.to_le_bytes());
                want.extend_from_slice(&(kept.len() as u32).to_le_bytes());
                kept.iter().for_each(|e| e.write(&mut want));
                assert_eq!(a.encode_journal(t, keep).unwrap(), want, "at {t}");
            }
        }
        let j = a.journal.as_ref().unwrap();
        assert!(j.start <= j.bytes.len() / 2 + 1, "dropped bytes reclaimed");
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

    #[test]
    fn a_slot_keeps_any_number_of_holders() {
        let mut s = Slot::default();
        let h = |r: u32| Holder {
            at: r as u64 * 10,
            replica: r,
            counted: r.is_multiple_of(2),
        };
        for r in 0..6 {
            s.push(h(r));
        }
        assert_eq!(s.len(), 6);
        assert_eq!(s.masks(), (0b111111, 0b010101));
        // Removing from the inline ones, the spilled ones and the last; each place taken by the last.
        for (r, left) in [(0, 5), (4, 4), (3, 3), (1, 2), (5, 1), (2, 0)] {
            let i = s.position(r).unwrap();
            assert_eq!(s.remove(i), Some(h(r)));
            assert_eq!(s.len(), left);
            assert_eq!(s.position(r), None);
            assert_eq!(s.holders().count(), left);
            assert!(s.holders().all(|x| *x == h(x.replica)));
            assert_eq!(s.more.is_some(), left > INLINE_HOLDERS);
        }
        assert_eq!(s.remove(0), None);
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
    fn proxies_exchanging_bundles_see_each_others_sessions() {
        let session = |i: u64| keys(i * 10_000..i * 10_000 + 3_000);
        // Proxy A's two workers publish journals; proxy B applies A's bundle.
        let mut a = [
            WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT),
            WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT),
        ];
        a.iter_mut().for_each(WorkingSet::start_journal);
        let mut b = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        b.start_journal();
        a[0].record(0, &session(0), 100);
        a[1].record(1, &session(1), 110);
        let j0 = a[0].encode_journal(120, 1_000).unwrap();
        let j1 = a[1].encode_journal(120, 1_000).unwrap();
        let bundle = encode_bundle([(0, &j0[..]), (1, &j1[..])]);
        assert_eq!(b.remote_marks(3), vec![]);
        assert_eq!(b.apply_remote(3, &bundle, 130).unwrap().entries, 2);
        assert_eq!(b.remote_marks(3), vec![(0, 1), (1, 1)]);
        assert_eq!(b.remote_marks(2), vec![], "per peer proxy");
        // Each session's second turn, through B: both count as reused.
        b.record(0, &session(0), 200);
        b.record(1, &session(1), 210);
        assert!(near(b.blocks(0), 3_000.0), "{}", b.blocks(0));
        assert!(near(b.blocks(1), 3_000.0), "{}", b.blocks(1));
        // Applied once: the same bundle again applies nothing.
        assert_eq!(b.apply_remote(3, &bundle, 220).unwrap(), Applied::default());
        // Trimmed by `after`: only what B has not applied; the trimmed journal still applies.
        a[0].record(1, &session(2), 300);
        let j0 = a[0].encode_journal(300, 1_000).unwrap();
        let after = parse_after(&format_after(&b.remote_marks(3))).unwrap();
        assert_eq!(after, vec![(0, 1), (1, 1)]);
        let t0 = journal_after(&j0, 2, 1, Sampling::DEFAULT).unwrap();
        assert!(t0.len() < j0.len());
        let t1 = journal_after(&j1, 2, 1, Sampling::DEFAULT).unwrap();
        assert_eq!(t1.len(), JOURNAL_HEADER, "nothing new");
        let bundle = encode_bundle([(0, &t0[..]), (1, &t1[..])]);
        assert_eq!(b.apply_remote(3, &bundle, 310).unwrap().entries, 1);
        // A mark past the journal's newest: the asker's mark is from before a restart: all of it.
        assert_eq!(journal_after(&j0, 2, 99, Sampling::DEFAULT).unwrap(), j0);
    }

    #[test]
    fn a_restarted_peer_proxy_is_read_from_its_new_numbers() {
        let mut b = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        b.start_journal();
        let mut a = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        a.start_journal();
        for t in 0..5 {
            a.record(0, &keys(t * 1_000..t * 1_000 + 800), t);
        }
        let j = a.encode_journal(10, 1_000).unwrap();
        assert_eq!(
            b.apply_remote(0, &encode_bundle([(0, &j[..])]), 10)
                .unwrap()
                .entries,
            5
        );
        let mut again = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        again.start_journal();
        again.record(1, &keys(50_000..50_800), 20);
        let j = again.encode_journal(20, 1_000).unwrap();
        let got = b
            .apply_remote(0, &encode_bundle([(0, &j[..])]), 20)
            .unwrap();
        assert_eq!(
            got,
            Applied {
                entries: 1,
                missed: 0
            }
        );
        assert_eq!(b.remote_marks(0), vec![(0, 1)]);
    }

    #[test]
    fn a_peer_proxys_clock_cannot_reach_past_this_ones() {
        let mut b = WorkingSet::new(1, 1_000, 1 << 20, Sampling::DEFAULT);
        b.start_journal();
        b.record(0, &keys(0..800), 5_000);
        b.record(0, &keys(0..800), 5_001);
        let mine = b.blocks(0);
        let mut a = WorkingSet::new(1, 1_000, 1 << 20, Sampling::DEFAULT);
        a.start_journal();
        // Far in the future (would expire everything B holds), and far in the past (out of the window).
        a.record(0, &keys(800..1_600), u64::MAX / 2);
        let j = a.encode_journal(u64::MAX / 2, 1_000).unwrap();
        assert_eq!(
            b.apply_remote(0, &encode_bundle([(0, &j[..])]), 5_002)
                .unwrap()
                .entries,
            1
        );
        assert!(b.blocks(0) >= mine, "{} {mine}", b.blocks(0));
        b.expire(7_000);
        assert_eq!(
            b.sampled_entries(),
            0,
            "clamped to now: expires with the window"
        );
        let mut old = WorkingSet::new(1, 1_000, 1 << 20, Sampling::DEFAULT);
        old.start_journal();
        old.record(0, &keys(0..800), 1);
        let j = old.encode_journal(1, 1_000).unwrap();
        let got = b
            .apply_remote(1, &encode_bundle([(0, &j[..])]), 9_000)
            .unwrap();
        assert_eq!((got.entries, b.sampled_entries()), (0, 0));
        assert_eq!(b.remote_marks(1), vec![(0, 1)], "read, not applied");
    }

    #[test]
    fn a_bad_bundle_is_refused_whole() {
        let mut a = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        a.start_journal();
        a.record(0, &keys(0..800), 0);
        let good = a.encode_journal(1, 100).unwrap();
        let mut bad_journal = good.clone();
        bad_journal.push(0);
        let mut b = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        assert_eq!(
            b.apply_remote(0, &encode_bundle([(0, &good[..])]), 1),
            None,
            "not sharing"
        );
        b.start_journal();
        let bundle = encode_bundle([(0, &good[..]), (1, &good[..])]);
        let mut cases = vec![
            encode_bundle([(0, &good[..]), (1, &bad_journal[..])]),
            encode_bundle([(0, &good[..]), (0, &good[..])]),
            encode_bundle([(1024, &good[..])]),
            b"<html>502 Bad Gateway</html>".to_vec(),
            Vec::new(),
        ];
        for cut in [1, 8, 12, bundle.len() - 1] {
            cases.push(bundle[..cut].to_vec());
        }
        let mut extra = bundle.clone();
        extra.push(0);
        cases.push(extra);
        let mut huge = bundle.clone();
        huge[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        cases.push(huge);
        let mut long = bundle.clone();
        long[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        cases.push(long);
        for (i, c) in cases.iter().enumerate() {
            assert_eq!(b.apply_remote(0, c, 1), None, "case {i}");
        }
        assert_eq!(b.apply_remote(MAX_REMOTE_PEERS, &bundle, 1), None);
        assert_eq!(b.sampled_entries(), 0, "nothing applied");
        assert_eq!(b.apply_remote(0, &bundle, 1).unwrap().entries, 2);
        assert_eq!(decode_bundle(&encode_bundle([])), Some(vec![]));
        for q in ["x", "1", "1:", ":1", "1:2,", "1024:1", "-1:2", "1:2:3"] {
            assert_eq!(parse_after(q), None, "{q}");
        }
        assert_eq!(parse_after("1:2,3:4"), Some(vec![(1, 2), (3, 4)]));
        let many = vec!["1:1"; MAX_BUNDLE_PARTS + 1].join(",");
        assert_eq!(parse_after(&many), None);
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
}
