//! A feed batch applied in slices (`FeedFrame` + `Router::accept_feed` / `apply_feed_slice`, as the
//! filter does across ticks) leaves the router exactly where `apply_feed` of the whole batch does.

use kvsteer_core::config::RoutingConfig;
use kvsteer_core::feed::{EventKind, FeedBatch, FeedEvent, FeedFrame, ReplicaLoad, Tier};
use kvsteer_core::router::{FeedOutcome, Router};
use proptest::prelude::*;

fn snapshot(blocks: u64) -> FeedBatch {
    FeedBatch {
        epoch: 5,
        resync: true,
        more: false,
        first_seq: 0,
        next_seq: 0,
        load: ReplicaLoad::default(),
        events: vec![
            FeedEvent::Cleared,
            FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: (0..blocks).collect(),
            },
            FeedEvent::Stored {
                tier: Tier::Host,
                hashes: (blocks / 2..blocks + 7).collect(),
            },
            FeedEvent::Removed {
                tier: Tier::Gpu,
                hashes: (0..blocks / 3).collect(),
            },
        ],
    }
}

fn sliced(router: &mut Router, replica: usize, batch: &FeedBatch, slice: usize) -> usize {
    let mut frame = FeedFrame::parse(batch.encode()).unwrap();
    let outcome = router.accept_feed(replica, frame.header());
    assert!(matches!(outcome, FeedOutcome::Reset { .. }), "{outcome:?}");
    let mut out = Vec::new();
    let mut slices = 0;
    while let Some(s) = frame.next_slice(slice, &mut out) {
        assert!(out.len() <= slice.max(1));
        router.apply_feed_slice(replica, s, &out);
        slices += 1;
    }
    assert!(frame.is_done() && frame.hashes_left() == 0);
    slices
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn slices_apply_like_the_whole_batch(blocks in 0u64..300, slice in 0usize..64) {
        let batch = snapshot(blocks);
        let mut whole = Router::new(RoutingConfig::default(), 3).unwrap();
        whole.apply_feed(1, &batch);
        let mut parts = Router::new(RoutingConfig::default(), 3).unwrap();
        let slices = sliced(&mut parts, 1, &batch, slice);
        prop_assert!(slices >= 4);
        for key in 0..blocks + 8 {
            for tier in Tier::ALL {
                prop_assert_eq!(whole.index().holds(1, tier, key), parts.index().holds(1, tier, key));
            }
        }
        prop_assert_eq!(whole.index().replica_blocks(1), parts.index().replica_blocks(1));
        prop_assert_eq!(whole.feed_query(1, 10), parts.feed_query(1, 10));
        prop_assert_eq!(whole.stats().feed_events, parts.stats().feed_events);
    }

    /// Any mutation or truncation of a valid payload: the frame refuses exactly what `decode`
    /// refuses, with the same error, never panics, and reads back what `decode` reads, in any
    /// slice size.
    #[test]
    fn frames_agree_with_decode_on_hostile_bytes(
        blocks in 0u64..40,
        pos in 0usize..500,
        byte in any::<u8>(),
        cut in 0usize..600,
        slice in 0usize..9,
    ) {
        let mut b = snapshot(blocks).encode();
        if pos < b.len() {
            b[pos] = byte;
        }
        b.truncate(cut.max(80));
        let decoded = FeedBatch::decode(&b);
        match FeedFrame::parse(b.clone()) {
            Err(e) => prop_assert_eq!(Err(e), decoded),
            Ok(mut frame) => {
                let whole = decoded.unwrap();
                let mut out = Vec::new();
                let mut hashes = Vec::new();
                while let Some(s) = frame.next_slice(slice, &mut out) {
                    prop_assert!(out.len() <= slice.max(1));
                    if s.starts_event {
                        hashes.push((s.kind, s.tier, Vec::new()));
                    }
                    hashes.last_mut().unwrap().2.extend_from_slice(&out);
                }
                let read: Vec<FeedEvent> = hashes
                    .into_iter()
                    .map(|(kind, tier, h)| match kind {
                        EventKind::Stored => FeedEvent::Stored { tier, hashes: h },
                        EventKind::Removed => FeedEvent::Removed { tier, hashes: h },
                        EventKind::Cleared => FeedEvent::Cleared,
                    })
                    .collect();
                prop_assert_eq!(read, whole.events);
            }
        }
    }
}
