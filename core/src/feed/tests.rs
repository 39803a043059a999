use super::*;

/// The rank travels in the header's former reserved bytes: a batch encoded for a rank decodes to
/// the same batch (version 1 decoders ignore the bytes), and the rank reads back.
#[test]
fn the_rank_rides_in_the_reserved_bytes() {
    let b = sample();
    let plain = b.encode();
    assert_eq!(payload_rank(&plain), Some(0));
    let ranked = b.encode_for_rank(513);
    assert_eq!(payload_rank(&ranked), Some(513));
    assert_eq!(FeedBatch::decode(&ranked).unwrap(), b);
    assert_eq!(plain[..6], ranked[..6]);
    assert_eq!(plain[8..], ranked[8..]);
    assert_eq!(payload_rank(&ranked[..7]), None);
    assert_eq!(query_rank("epoch=0&cursor=0&max_events=10"), Ok(None));
    assert_eq!(query_rank("epoch=0&rank=3"), Ok(Some(3)));
    assert!(query_rank("rank=-1").unwrap_err().contains("rank"));
    assert!(query_rank("rank=70000").is_err());
    assert!(query_rank("rank=").is_err());
    // The rank does not disturb the other fields' parsing.
    assert_eq!(
        FeedQuery::parse("epoch=5&cursor=2&rank=3").unwrap().epoch,
        5
    );
}

fn sample() -> FeedBatch {
    FeedBatch {
        epoch: 42,
        resync: false,
        more: true,
        first_seq: 10,
        next_seq: 13,
        load: ReplicaLoad {
            running: 3,
            waiting: 1,
            prefill_tokens: 5000,
            decode_blocks: 700,
            kv_used_blocks: 900,
            kv_total_blocks: 10_000,
            block_size: 16,
        },
        events: vec![
            FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: vec![1, 2, u64::MAX],
            },
            FeedEvent::Removed {
                tier: Tier::Host,
                hashes: vec![2],
            },
            FeedEvent::Cleared,
        ],
    }
}

#[test]
fn round_trip() {
    let b = sample();
    let bytes = b.encode();
    assert_eq!(bytes.len(), HEADER_LEN + 3 * 6 + 4 * 8);
    assert_eq!(FeedBatch::decode(&bytes).unwrap(), b);
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = sample().encode();
    for cut in 0..bytes.len() {
        assert!(FeedBatch::decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn hostile_counts_are_refused() {
    let mut bytes = sample().encode();
    // event_count claims 4 billion events.
    bytes[76..80].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(FeedBatch::decode(&bytes).is_err());
    let mut bytes = sample().encode();
    // first event claims 4 billion hashes.
    bytes[HEADER_LEN + 2..HEADER_LEN + 6].copy_from_slice(&u32::MAX.to_le_bytes());
    assert!(matches!(
        FeedBatch::decode(&bytes),
        Err(FeedError::Truncated { index: 0 })
    ));
}

#[test]
fn bad_fields_are_named() {
    let mut b = sample().encode();
    b[0] = b'X';
    assert_eq!(FeedBatch::decode(&b), Err(FeedError::BadMagic));
    let mut b = sample().encode();
    b[4] = 2;
    assert_eq!(FeedBatch::decode(&b), Err(FeedError::UnsupportedVersion(2)));
    let mut b = sample().encode();
    b[5] = 0x80;
    assert_eq!(FeedBatch::decode(&b), Err(FeedError::UnknownFlags(0x80)));
    let mut b = sample().encode();
    b[HEADER_LEN + 1] = 9;
    assert_eq!(
        FeedBatch::decode(&b),
        Err(FeedError::BadTier { index: 0, tier: 9 })
    );
    let mut b = sample().encode();
    b[HEADER_LEN] = 7;
    assert_eq!(
        FeedBatch::decode(&b),
        Err(FeedError::BadEventKind { index: 0, kind: 7 })
    );
    let mut b = sample().encode();
    b.push(0);
    assert_eq!(
        FeedBatch::decode(&b),
        Err(FeedError::TrailingBytes { extra: 1 })
    );
    let mut s = sample();
    s.next_seq = 99;
    assert_eq!(
        FeedBatch::decode(&s.encode()),
        Err(FeedError::InconsistentSequence)
    );
}

#[test]
fn query_round_trip_and_errors() {
    let q = FeedQuery {
        epoch: 5,
        cursor: 77,
        max_events: 100,
    };
    let path = q.to_path();
    let (p, qs) = path.split_once('?').unwrap();
    assert_eq!(p, FEED_PATH);
    assert_eq!(FeedQuery::parse(qs).unwrap(), q);
    assert_eq!(
        FeedQuery::parse("").unwrap(),
        FeedQuery::resync(DEFAULT_MAX_EVENTS)
    );
    let err = FeedQuery::parse("epoch=x").unwrap_err();
    assert!(err.contains("epoch"), "{err}");
}

#[test]
fn cursor_detects_gaps_and_epoch_changes() {
    let mut c = FeedCursor::default();
    assert_eq!(c.query(10).epoch, 0);
    let mut snap = sample();
    snap.resync = true;
    snap.first_seq = 10;
    snap.next_seq = 10;
    assert_eq!(c.accept(&snap), CursorVerdict::ResetThenApply);
    assert_eq!(
        c.query(10),
        FeedQuery {
            epoch: 42,
            cursor: 10,
            max_events: 10
        }
    );
    assert_eq!(c.accept(&sample()), CursorVerdict::Apply);
    assert_eq!(c.next_seq, 13);
    // Same batch again: its first_seq no longer matches the cursor.
    assert_eq!(c.accept(&sample()), CursorVerdict::Gap);
    assert!(c.query(10).epoch == 0, "a gap asks for a resync");
    // A new epoch without a snapshot is also a gap.
    let mut c2 = FeedCursor {
        epoch: 42,
        next_seq: 10,
        want_resync: false,
    };
    let mut other = sample();
    other.epoch = 43;
    assert_eq!(c2.accept(&other), CursorVerdict::Gap);
}

#[test]
fn a_frame_checks_like_decode_and_reads_in_slices() {
    let b = sample();
    let bytes = b.encode();
    for cut in 0..bytes.len() {
        assert_eq!(
            FeedFrame::parse(bytes[..cut].to_vec()).err(),
            FeedBatch::decode(&bytes[..cut]).err(),
            "cut at {cut}"
        );
    }
    let mut f = FeedFrame::parse(bytes.clone()).unwrap();
    assert_eq!((f.events(), f.hashes_left()), (3, 4));
    assert_eq!(f.header().epoch, 42);
    assert!(f.header().events.is_empty());
    let mut out = Vec::new();
    // Two hashes at most per slice: the first event comes in two slices.
    let slice = |kind, tier, starts_event| {
        Some(FeedSlice {
            kind,
            tier,
            starts_event,
        })
    };
    assert_eq!(
        f.next_slice(2, &mut out),
        slice(EventKind::Stored, Tier::Gpu, true)
    );
    assert_eq!(out, vec![1, 2]);
    assert_eq!(f.hashes_left(), 2);
    assert_eq!(
        f.next_slice(2, &mut out),
        slice(EventKind::Stored, Tier::Gpu, false)
    );
    assert_eq!(out, vec![u64::MAX]);
    assert_eq!(
        f.next_slice(0, &mut out),
        slice(EventKind::Removed, Tier::Host, true),
        "0 reads one hash anyway"
    );
    assert_eq!(out, vec![2]);
    assert!(!f.is_done());
    assert_eq!(
        f.next_slice(2, &mut out),
        slice(EventKind::Cleared, Tier::Gpu, true)
    );
    assert!(out.is_empty() && f.is_done() && f.hashes_left() == 0);
    assert_eq!(f.next_slice(2, &mut out), None);
    assert_eq!(FeedFrame::parse(bytes).unwrap().into_batch(), b);
}

#[test]
fn a_frame_trims_what_a_follower_applied() {
    let q = |cursor| FeedQuery {
        epoch: 42,
        cursor,
        max_events: 10,
    };
    let frame = || FeedFrame::parse(sample().encode()).unwrap();
    // Events 10, 11, 12: a follower at 11 keeps 11 and 12.
    let mut f = frame();
    assert!(f.trim_to_cursor(&q(11)));
    assert_eq!(f.header().first_seq, 11);
    assert_eq!(f.hashes_left(), 1);
    let rest = f.into_batch();
    assert_eq!(rest.events, sample().events[1..].to_vec());
    // Ending exactly at the cursor: an empty continuation; before it: nothing to apply.
    let mut f = frame();
    assert!(f.trim_to_cursor(&q(13)));
    assert!(f.into_batch().events.is_empty());
    assert!(!frame().trim_to_cursor(&q(14)));
    // Another epoch is left to the cursor check.
    let mut f = frame();
    assert!(f.trim_to_cursor(&FeedQuery { epoch: 7, ..q(12) }));
    assert_eq!(f.hashes_left(), 4);
}
