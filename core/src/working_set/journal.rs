//! The journal a proxy's workers share: each worker's recent admissions, numbered, published every
//! tick and applied by the others as if admitted there.

use super::{Sampling, WorkingSet};
#[cfg(test)]
use std::collections::VecDeque;

/// The journal keeps at most this many sampled keys (about 3,000 coding-agent requests); past it the
/// oldest entries go, and a worker that had not read them yet misses them.
const JOURNAL_MAX_KEYS: usize = 1 << 18;
/// Encoded journal: `published_ms u64, replicas u32, entries u32`, then per entry `seq u64,
/// at_ms u64, replica u32, keys u32, keys x u64`, all little-endian.
pub(super) use crate::journal::{ENTRY_HEADER, HEADER as JOURNAL_HEADER};

/// One admission in the journal: its number, time, replica and sampled keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) seq: u64,
    pub(super) at_ms: u64,
    pub(super) replica: u32,
    pub(super) keys: Vec<u64>,
}

impl Entry {
    /// The entry as a journal carries it: number, time, replica, key count, keys (little endian).
    pub(super) fn write(&self, out: &mut Vec<u8>) {
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

pub(super) use crate::journal::Journal;

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
        j.push(
            replica as u32,
            sampled_keys.iter().copied(),
            now_ms,
            usize::MAX,
            JOURNAL_MAX_KEYS,
        );
    }

    /// The journal for the other workers, stamped `now_ms`, after dropping entries older than
    /// `keep_ms` (long enough for every worker to read them: the filter keeps a few ticks). `None`
    /// while not sharing.
    pub fn encode_journal(&mut self, now_ms: u64, keep_ms: u64) -> Option<Vec<u8>> {
        let replicas = self.replicas.len();
        Some(self.journal.as_mut()?.encode(now_ms, keep_ms, replicas))
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
    pub(super) fn decode_new(&self, peer: u32, bytes: &[u8]) -> Option<(Vec<Entry>, Option<u64>)> {
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
    pub(super) fn apply_entries(
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

/// The entries of a journal numbered after `after`, checked whole ([`decode_journal`]); when all of
/// its numbers are below `after` the writer restarted and numbers from 1 again (a whole other proxy
/// can; a worker of this one cannot), and all its entries are returned, with `true`.
pub(super) fn decode_since(
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::working_set::test_keys::*;
    use crate::working_set::*;

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
        assert!(j.reclaimed(), "dropped bytes reclaimed");
    }
}
