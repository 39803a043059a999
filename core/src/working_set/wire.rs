//! The wire format between proxies: a proxy's answer to a peer bundles its workers' journals, each
//! trimmed to what the peer has not applied yet (`after`: the peer's marks per worker).

use super::journal::{ENTRY_HEADER, JOURNAL_HEADER, decode_since};
use super::{Applied, Sampling, WorkingSet};

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

impl WorkingSet {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::working_set::test_keys::*;
    use crate::working_set::*;

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
}
