//! The approximate index's records shared with the proxy's other workers: each worker journals the
//! blocks it recorded itself (replica, time, the prompt's block keys, numbered), publishes the
//! journal every tick, and applies the entries of the others' journals it has not applied yet
//! ([`super::ApproxIndex::apply_peer`]). Without it a text prompt's follow-up that reaches another
//! worker VM than its first turn finds no record of where the first turn went.
//!
//! Encoded: `published_ms u64, replicas u32, entries u32`, then per entry `seq u64, at_ms u64,
//! replica u32, keys u32, keys x u64`, all little-endian (the working-set journal's layout,
//! `crate::working_set`). Every key of an entry is carried, up to [`ENTRY_MAX_KEYS`]: a match
//! counts a replica's run of leading blocks and stops at the first block it lacks, so a sample
//! would stop it at the first block left out.

use crate::journal::{ENTRY_HEADER, HEADER};
use std::ops::Range;

/// The journal keeps at most this many keys (512 KiB of them; about 140 chat prompts of 30,000
/// characters, 470 blocks each, at block size 16); past it the oldest entries go, and a worker that
/// had not read them yet misses them.
pub const JOURNAL_MAX_KEYS: usize = 1 << 16;
/// An entry carries at most its prompt's first this many blocks (a million characters at block
/// size 16): the leading blocks are the ones a match reads first.
pub const ENTRY_MAX_KEYS: usize = 1 << 14;
/// The largest journal a writer can publish: its keys, and an entry header for each (an entry
/// carries at least one key). Anything longer is refused unread.
pub const JOURNAL_MAX_BYTES: usize = HEADER + JOURNAL_MAX_KEYS * (8 + ENTRY_HEADER);

pub(super) use crate::journal::Journal;

/// One entry of a peer's journal, its keys left where they are in the journal's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Record {
    pub(super) seq: u64,
    pub(super) at_ms: u64,
    pub(super) replica: u16,
    /// Where its keys are in the journal (8 bytes each).
    pub(super) keys: Range<usize>,
}

/// What [`super::ApproxIndex::apply_peer`] did with a peer's journal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Entries applied (new since the last read, within the TTL, for a replica not forgotten since).
    pub entries: u64,
    /// Their blocks.
    pub blocks: u64,
    /// Entries the peer had dropped before this worker read them (its journal overflowed, or this
    /// worker read it too late).
    pub missed: u64,
}

fn u32_at(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from_le_bytes(
        b.get(i..i.checked_add(4)?)?.try_into().ok()?,
    ))
}

fn u64_at(b: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(i..i.checked_add(8)?)?.try_into().ok()?,
    ))
}

/// Decodes a journal for `replicas` replicas, checking it whole: its length within
/// [`JOURNAL_MAX_BYTES`], every entry's length, entries numbered in increasing order, each naming a
/// replica in range and carrying 1 to [`ENTRY_MAX_KEYS`] keys, at most [`JOURNAL_MAX_KEYS`] in all,
/// and nothing after the last. Returns the entries numbered after `after` and the highest number.
fn decode(bytes: &[u8], replicas: usize, after: u64) -> Option<(Vec<Record>, u64)> {
    if bytes.len() > JOURNAL_MAX_BYTES || u32_at(bytes, 8)? as usize != replicas {
        return None;
    }
    let count = u32_at(bytes, 12)? as usize;
    if count > JOURNAL_MAX_KEYS {
        return None;
    }
    let (mut at, mut prev, mut keys) = (HEADER, 0u64, 0usize);
    let mut out = Vec::with_capacity(count.min(bytes.len() / ENTRY_HEADER));
    for _ in 0..count {
        let (seq, at_ms) = (u64_at(bytes, at)?, u64_at(bytes, at + 8)?);
        let (replica, n) = (u32_at(bytes, at + 16)?, u32_at(bytes, at + 20)? as usize);
        at += ENTRY_HEADER;
        let end = at.checked_add(n.checked_mul(8)?)?;
        keys = keys.checked_add(n)?;
        let bad = seq <= prev || replica as usize >= replicas || n == 0 || n > ENTRY_MAX_KEYS;
        if bad || keys > JOURNAL_MAX_KEYS || end > bytes.len() {
            return None;
        }
        if seq > after {
            out.push(Record {
                seq,
                at_ms,
                replica: u16::try_from(replica).ok()?,
                keys: at..end,
            });
        }
        (prev, at) = (seq, end);
    }
    (at == bytes.len()).then_some((out, prev))
}

/// The entries of a journal numbered after `after`, checked whole ([`decode`]); when all of its
/// numbers are below `after` the writer restarted and numbers from 1 again, and all its entries are
/// returned, with `true`.
pub(super) fn decode_since(
    bytes: &[u8],
    replicas: usize,
    after: u64,
) -> Option<(Vec<Record>, bool)> {
    let (entries, newest) = decode(bytes, replicas, after)?;
    if entries.is_empty() && newest > 0 && newest < after {
        return Some((decode(bytes, replicas, 0)?.0, true));
    }
    Some((entries, false))
}

/// The keys of `r`, read from the journal it was decoded from.
pub(super) fn keys<'a>(bytes: &'a [u8], r: &Record) -> impl Iterator<Item = u64> + 'a {
    bytes
        .get(r.keys.clone())
        .unwrap_or_default()
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::approx::ApproxIndex;
    use crate::block::TextHash;
    use proptest::prelude::*;

    const R: usize = 4;
    const TTL: u64 = 10_000;

    fn keys(v: std::ops::Range<u64>) -> Vec<TextHash> {
        v.map(TextHash).collect()
    }

    fn sharing() -> ApproxIndex<TextHash> {
        let mut ix = ApproxIndex::new(1 << 20, TTL);
        ix.start_journal();
        ix
    }

    fn matched(ix: &ApproxIndex<TextHash>, k: &[TextHash], now_ms: u64) -> Vec<u32> {
        let mut out = Vec::new();
        ix.match_prefix(k, now_ms, R, &mut out);
        out
    }

    /// What a refused journal must leave alone: the blocks, the queue and the marks.
    fn state(ix: &ApproxIndex<TextHash>) -> (usize, usize, Vec<(u32, u64)>) {
        let mut marks: Vec<_> = ix.journal.as_ref().map_or_else(Vec::new, |j| {
            j.applied.iter().map(|(&p, &s)| (p, s)).collect()
        });
        marks.sort();
        (ix.len(), ix.order.len(), marks)
    }

    /// A journal written by hand: `(seq, at_ms, replica, keys)` per entry.
    fn written(replicas: u32, entries: &[(u64, u64, u32, Vec<u64>)]) -> Vec<u8> {
        let mut b = 7u64.to_le_bytes().to_vec();
        b.extend_from_slice(&replicas.to_le_bytes());
        b.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        for (seq, at, r, k) in entries {
            b.extend_from_slice(&seq.to_le_bytes());
            b.extend_from_slice(&at.to_le_bytes());
            b.extend_from_slice(&r.to_le_bytes());
            b.extend_from_slice(&(k.len() as u32).to_le_bytes());
            k.iter().for_each(|k| b.extend_from_slice(&k.to_le_bytes()));
        }
        b
    }

    #[test]
    fn a_worker_finds_where_another_sent_a_text_prompt() {
        let (mut a, mut b) = (sharing(), sharing());
        let first = keys(100..130);
        a.record(2, &first, 10);
        let j = a.encode_journal(20, 400, R).unwrap();
        assert_eq!(matched(&b, &first, 30), vec![0; R], "b alone knows nothing");
        let got = b.apply_peer(0, &j, R, 30).unwrap();
        assert_eq!(
            got,
            Applied {
                entries: 1,
                blocks: 30,
                missed: 0
            }
        );
        // The follow-up: the first turn's blocks and more.
        let follow = keys(100..160);
        assert_eq!(matched(&b, &follow, 40), vec![0, 0, 30, 0]);
        // Read again on the next tick: nothing new, nothing changed.
        let before = state(&b);
        assert_eq!(b.apply_peer(0, &j, R, 130).unwrap(), Applied::default());
        assert_eq!(state(&b), before);
        // b publishes only its own records: nothing applied is echoed back.
        assert_eq!(b.encode_journal(140, 400, R), None);
        b.record(1, &keys(500..510), 150);
        let jb = b.encode_journal(160, 400, R).unwrap();
        assert_eq!(a.apply_peer(1, &jb, R, 170).unwrap().entries, 1);
        assert_eq!(a.len(), 40);
    }

    #[test]
    fn entries_dropped_before_a_read_are_counted_as_missed() {
        let (mut a, mut b) = (sharing(), sharing());
        a.record(0, &keys(0..8), 0);
        a.record(1, &keys(8..16), 50);
        let j = a.encode_journal(60, 100, R).unwrap();
        assert_eq!(b.apply_peer(0, &j, R, 60).unwrap().entries, 2);
        a.record(0, &keys(16..24), 100);
        a.record(0, &keys(24..32), 300);
        let j = a.encode_journal(300, 100, R).unwrap();
        let got = b.apply_peer(0, &j, R, 300).unwrap();
        assert_eq!((got.entries, got.missed), (1, 1));
        // Another peer's first read misses nothing: what it dropped before was never b's to read.
        let got = b.apply_peer(7, &j, R, 300).unwrap();
        assert_eq!((got.entries, got.missed), (1, 0));
        // A writer that restarted numbers from 1 again: its entries are applied from the start.
        let mut again = sharing();
        again.record(3, &keys(40..48), 400);
        let j = again.encode_journal(400, 100, R).unwrap();
        assert_eq!(b.apply_peer(0, &j, R, 400).unwrap().entries, 1);
        assert_eq!(matched(&b, &keys(40..48), 400), vec![0, 0, 0, 8]);
    }

    #[test]
    fn old_future_and_forgotten_records_are_not_applied_as_they_were() {
        let (mut a, mut b) = (sharing(), sharing());
        a.record(0, &keys(0..8), 1_000);
        a.record(1, &keys(8..16), 50_000);
        let j = a.encode_journal(50_000, u64::MAX, R).unwrap();
        // The first is past the TTL at b's clock; the second, stamped ahead of b's clock, counts
        // from b's now, so it cannot outlive the TTL.
        let got = b.apply_peer(0, &j, R, 20_000).unwrap();
        assert_eq!(got.entries, 1);
        assert_eq!(matched(&b, &keys(8..16), 20_000 + TTL), vec![0, 8, 0, 0]);
        assert_eq!(matched(&b, &keys(8..16), 20_001 + TTL), vec![0; R]);
        // A replica forgotten (its engine restarted) after a record was made: the record describes
        // a cache that is gone.
        let mut c = sharing();
        c.record(2, &keys(100..104), 60_000);
        c.remove_replica(1);
        a.record(1, &keys(200..208), 59_000);
        a.record(1, &keys(300..308), 61_000);
        let j = a.encode_journal(61_000, 5_000, R).unwrap();
        assert_eq!(c.apply_peer(0, &j, R, 61_000).unwrap().entries, 1);
        assert_eq!(matched(&c, &keys(200..208), 61_000), vec![0; R]);
        assert_eq!(matched(&c, &keys(300..308), 61_000), vec![0, 8, 0, 0]);
    }

    #[test]
    fn a_peers_older_record_does_not_age_a_newer_one() {
        let (mut a, mut b) = (sharing(), sharing());
        a.record(0, &keys(0..4), 100);
        let j = a.encode_journal(100, 1_000, R).unwrap();
        b.record(0, &keys(0..4), 5_000);
        b.apply_peer(0, &j, R, 5_050).unwrap();
        // b's own record at 5,000 still holds until 5,000 + TTL.
        assert_eq!(matched(&b, &keys(0..4), 5_000 + TTL), vec![4, 0, 0, 0]);
        // A block held by four replicas: an older record of a fifth does not push out a newer one.
        let mut c = sharing();
        for r in 0..4 {
            c.record(r, &keys(0..1), 1_000 + r as u64);
        }
        let mut five = ApproxIndex::new(16, TTL);
        five.start_journal();
        five.record(4, &keys(0..1), 10);
        let j = five.encode_journal(10, 1_000, 5).unwrap();
        assert_eq!(c.apply_peer(3, &j, 5, 1_100).unwrap().entries, 1);
        let mut out = Vec::new();
        c.match_prefix(&keys(0..1), 1_100, 5, &mut out);
        assert_eq!(out, vec![1, 1, 1, 1, 0]);
    }

    #[test]
    fn a_bad_journal_is_refused_whole() {
        let mut a = sharing();
        a.record(0, &keys(0..8), 0);
        a.record(3, &keys(8..20), 1);
        let j = a.encode_journal(1, 100, R).unwrap();
        let mut b = sharing();
        b.record(1, &keys(900..910), 0);
        let mut bad: Vec<Vec<u8>> = (0..j.len()).map(|cut| j[..cut].to_vec()).collect();
        let mut extra = j.clone();
        extra.push(0);
        bad.push(extra);
        let mut replica = j.clone();
        replica[HEADER + 16] = R as u8;
        bad.push(replica);
        let mut huge = j.clone();
        huge[HEADER + 20..HEADER + 24].copy_from_slice(&u32::MAX.to_le_bytes());
        bad.push(huge);
        let mut count = j.clone();
        count[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        bad.push(count);
        bad.push(written(R as u32, &[(2, 0, 0, vec![1]), (2, 0, 0, vec![2])]));
        bad.push(written(R as u32, &[(1, 0, 0, vec![])]));
        let too_many: Vec<u64> = (0..ENTRY_MAX_KEYS as u64 + 1).collect();
        bad.push(written(R as u32, &[(1, 0, 0, too_many)]));
        let full: Vec<u64> = (0..ENTRY_MAX_KEYS as u64).collect();
        let over: Vec<_> = (0..JOURNAL_MAX_KEYS / ENTRY_MAX_KEYS + 1)
            .map(|i| (i as u64 + 1, 0, 0, full.clone()))
            .collect();
        bad.push(written(R as u32, &over));
        bad.push(vec![0; JOURNAL_MAX_BYTES + 1]);
        bad.push(b"kvsteer text records? no".to_vec());
        let mut three = sharing();
        let before = state(&b);
        for x in &bad {
            assert_eq!(b.apply_peer(0, x, R, 2), None, "{} bytes", x.len());
            assert_eq!(state(&b), before);
        }
        assert_eq!(three.apply_peer(0, &j, 3, 2), None, "another replica count");
        let mut quiet = ApproxIndex::<TextHash>::new(100, TTL);
        assert_eq!(quiet.apply_peer(0, &j, R, 2), None, "not sharing");
        assert!(quiet.is_empty());
        // The largest journal a writer can publish is taken.
        let most: Vec<_> = (0..JOURNAL_MAX_KEYS / ENTRY_MAX_KEYS)
            .map(|i| (i as u64 + 1, 0, 0, full.clone()))
            .collect();
        assert!(b.apply_peer(5, &written(R as u32, &most), R, 2).is_some());
        assert_eq!(b.apply_peer(0, &j, R, 2).unwrap().entries, 2);
    }

    #[test]
    fn the_journal_is_bounded_and_a_long_prompt_shares_its_leading_blocks() {
        let mut a = sharing();
        let long = keys(0..ENTRY_MAX_KEYS as u64 + 500);
        a.record(1, &long, 0);
        let mut b = sharing();
        let j = a.encode_journal(0, 100, R).unwrap();
        assert_eq!(
            b.apply_peer(0, &j, R, 0).unwrap().blocks,
            ENTRY_MAX_KEYS as u64
        );
        assert_eq!(matched(&b, &long, 0)[1], ENTRY_MAX_KEYS as u32);
        for t in 0..200u64 {
            a.record((t % 4) as usize, &keys(t * 5_000..t * 5_000 + 3_000), t);
        }
        let j = a.encode_journal(200, u64::MAX, R).unwrap();
        assert!(j.len() <= JOURNAL_MAX_BYTES, "{}", j.len());
        let got = b.apply_peer(0, &j, R, 200).unwrap();
        assert!(
            got.blocks <= JOURNAL_MAX_KEYS as u64 && got.missed > 0,
            "{got:?}"
        );
        let jr = a.journal.as_ref().unwrap();
        assert!(jr.keys() <= JOURNAL_MAX_KEYS);
        assert!(jr.reclaimed(), "dropped bytes reclaimed");
    }

    proptest! {
        /// Random bytes, and a real journal with bytes changed, cut or added: never a panic, and a
        /// journal refused changes nothing.
        #[test]
        fn hostile_journals_never_panic_and_a_refusal_changes_nothing(
            raw in proptest::collection::vec(any::<u8>(), 0..256),
            edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
            cut in any::<usize>(),
            tail in proptest::collection::vec(any::<u8>(), 0..24),
            take_raw in any::<bool>(),
        ) {
            let mut a = sharing();
            a.record(0, &keys(0..5), 3);
            a.record(2, &keys(5..9), 4);
            let mut j = a.encode_journal(5, 100, R).unwrap();
            for (at, v) in edits {
                let n = j.len();
                j[at % n] = v;
            }
            j.truncate(cut % (j.len() + 1));
            j.extend_from_slice(&tail);
            let bytes = if take_raw { raw } else { j };
            let mut b = sharing();
            b.record(1, &keys(100..104), 1);
            let before = state(&b);
            match b.apply_peer(9, &bytes, R, 6) {
                None => prop_assert_eq!(state(&b), before),
                Some(got) => prop_assert!(got.blocks <= JOURNAL_MAX_KEYS as u64),
            }
        }
    }
}
