use super::*;
use crate::encode::{Event, batch};
use kvsteer_core::feed::FeedEvent;

const BS: usize = 4;

/// A view for rank 2 applies rank 2's batches (and unstamped ones), drops another rank's and
/// counts it, and stamps its answers with rank 2.
#[test]
fn a_rank_view_takes_only_its_ranks_batches() {
    let mut s = AdapterState::new(
        StateConfig {
            block_size: Some(BS),
            dp_rank: Some(2),
            ..StateConfig::default()
        },
        7,
    );
    let toks: Vec<u32> = (0..8).collect();
    let other = crate::encode::batch(1.0, &[stored(&[1, 2], None, &toks)], 3);
    s.apply_payload(&other, 0).unwrap();
    assert_eq!(s.blocks(), 0, "rank 3's blocks are not rank 2's");
    let i = BAD_PAYLOAD_LABELS
        .iter()
        .position(|&l| l == "dp_rank")
        .unwrap();
    assert_eq!(s.stats().bad_payloads[i], 1);
    let own = crate::encode::batch(2.0, &[stored(&[1, 2], None, &toks)], 2);
    s.apply_payload(&own, 0).unwrap();
    assert_eq!(s.blocks(), 2);
    let bytes = s.answer_bytes(&FeedQuery::resync(10));
    assert_eq!(kvsteer_core::feed::payload_rank(&bytes), Some(2));
    assert!(kvsteer_core::feed::FeedBatch::decode(&bytes).is_ok());
}

fn state() -> AdapterState {
    AdapterState::new(
        StateConfig {
            block_size: Some(BS),
            ..StateConfig::default()
        },
        7,
    )
}

fn stored<'a>(hashes: &'a [u64], parent: Option<u64>, tokens: &'a [u32]) -> Event<'a> {
    Event::Stored {
        hashes,
        parent,
        token_ids: tokens,
        block_size: BS as u32,
        lora_name: None,
        medium: "GPU",
    }
}

fn apply(s: &mut AdapterState, events: &[Event<'_>]) {
    s.apply_payload(&batch(0.0, events, 0), 1).unwrap();
}

/// Everything the feed says from a fresh snapshot, as (tier, hash) pairs sorted.
fn snapshot(s: &mut AdapterState) -> Vec<(Tier, u64)> {
    let b = s.answer(&FeedQuery::resync(1000));
    assert!(b.resync);
    assert_eq!(b.events[0], FeedEvent::Cleared);
    let mut out = Vec::new();
    for e in &b.events[1..] {
        match e {
            FeedEvent::Stored { tier, hashes } => out.extend(hashes.iter().map(|&h| (*tier, h))),
            other => panic!("snapshot holds {other:?}"),
        }
    }
    out.sort();
    out
}

fn seq(tokens: &[u32]) -> Vec<u64> {
    BlockHasher::new(BS)
        .unwrap()
        .sequence_hashes(tokens)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

#[test]
fn chained_events_hash_like_the_router() {
    let toks: Vec<u32> = (100..120).collect(); // 5 blocks
    let mut s = state();
    apply(&mut s, &[stored(&[1, 2], None, &toks[..8])]);
    apply(&mut s, &[stored(&[3, 4, 5], Some(2), &toks[8..20])]);
    let want = seq(&toks);
    let mut got: Vec<u64> = (1..=5).map(|h| s.lookup(h).unwrap().0).collect();
    assert_eq!(got, want);
    got.sort();
    let snap: Vec<u64> = snapshot(&mut s).into_iter().map(|(_, h)| h).collect();
    assert_eq!(snap, got);
    assert_eq!(s.stats().blocks_stored, 5);
    assert_eq!(s.blocks_in(Tier::Gpu), 5);
}

#[test]
fn lora_and_cache_salt_namespaces() {
    let toks: Vec<u32> = (0..8).collect();
    let base = BlockHasher::new(BS).unwrap();
    let ns = |l: Option<&str>, salt: Option<&str>| -> Vec<u64> {
        base.namespaced(l, salt)
            .sequence_hashes(&toks)
            .into_iter()
            .map(|h| h.0)
            .collect()
    };
    // LoRA: every block's extra keys name the adapter.
    let mut s = state();
    apply(
        &mut s,
        &[Event::Stored {
            hashes: &[1, 2],
            parent: None,
            token_ids: &toks,
            block_size: BS as u32,
            lora_name: Some("ad"),
            medium: "GPU",
        }],
    );
    assert_eq!(
        vec![s.lookup(1).unwrap().0, s.lookup(2).unwrap().0],
        ns(Some("ad"), None)
    );
    // Cache salt on the first block only (vLLM): the whole chain, across events, is salted.
    let mut s = state();
    let st = Stored {
        hashes: vec![1],
        parent: None,
        token_ids: toks[..4].to_vec(),
        block_size: BS as u64,
        extra_keys: Some(vec![ExtraKeys::Strings(vec!["salt".into()])]),
        ..Stored::default()
    };
    let child = Stored {
        hashes: vec![2],
        parent: Some(1),
        token_ids: toks[4..].to_vec(),
        block_size: BS as u64,
        extra_keys: Some(vec![ExtraKeys::None]),
        ..Stored::default()
    };
    let b = EngineBatch {
        ts: 0.0,
        events: vec![EngineEvent::Stored(st), EngineEvent::Stored(child)],
        dp_rank: None,
    };
    s.apply_batch(&b, 1);
    assert_eq!(
        vec![s.lookup(1).unwrap().0, s.lookup(2).unwrap().0],
        ns(None, Some("salt"))
    );
}

#[test]
fn unidentifiable_blocks_and_their_descendants_are_skipped() {
    let toks: Vec<u32> = (0..12).collect();
    let mut s = state();
    // Block 0 plain, block 1 carries a multimodal key, block 2 follows it.
    let st = Stored {
        hashes: vec![1, 2, 3],
        parent: None,
        token_ids: toks.clone(),
        block_size: BS as u64,
        extra_keys: Some(vec![
            ExtraKeys::None,
            ExtraKeys::Strings(vec!["mm-hash".into()]),
            ExtraKeys::None,
        ]),
        ..Stored::default()
    };
    s.apply_batch(
        &EngineBatch {
            ts: 0.0,
            events: vec![EngineEvent::Stored(st)],
            dp_rank: None,
        },
        1,
    );
    assert!(s.lookup(1).is_some());
    assert!(s.lookup(2).is_none() && s.lookup(3).is_none());
    assert_eq!(s.stats().blocks_skipped[3], 2);
    // A later child of block 3 is an orphan.
    apply(&mut s, &[stored(&[4], Some(3), &toks[..4])]);
    assert!(s.lookup(4).is_none());
    assert_eq!(s.stats().blocks_skipped[0], 1);
}

#[test]
fn removal_and_clear_reach_the_feed() {
    let toks: Vec<u32> = (0..8).collect();
    let want = seq(&toks);
    let mut s = state();
    let snap = s.answer(&FeedQuery::resync(100));
    let (epoch, mut cursor) = (snap.epoch, snap.next_seq);
    apply(&mut s, &[stored(&[1, 2], None, &toks)]);
    apply(
        &mut s,
        &[
            Event::Removed {
                hashes: &[2, 99],
                medium: "GPU",
            },
            Event::Removed {
                hashes: &[1],
                medium: "CPU",
            },
        ],
    );
    assert_eq!(s.stats().removals_unknown, 2, "99 unknown, 1 not on CPU");
    apply(&mut s, &[Event::Cleared]);
    let q = FeedQuery {
        epoch,
        cursor,
        max_events: 100,
    };
    let b = s.answer(&q);
    assert!(!b.resync);
    assert_eq!(
        b.events,
        vec![
            FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: want.clone()
            },
            FeedEvent::Removed {
                tier: Tier::Gpu,
                hashes: vec![want[1]]
            },
            FeedEvent::Cleared,
        ]
    );
    cursor = b.next_seq;
    assert_eq!(s.blocks(), 0);
    assert_eq!(s.blocks_in(Tier::Gpu), 0);
    let b = s.answer(&FeedQuery {
        epoch,
        cursor,
        max_events: 100,
    });
    assert!(b.events.is_empty() && !b.resync);
}

#[test]
fn host_tier_copies_without_tokens() {
    let toks: Vec<u32> = (0..4).collect();
    let mut s = state();
    apply(&mut s, &[stored(&[1], None, &toks)]);
    apply(
        &mut s,
        &[
            Event::Stored {
                hashes: &[1, 2],
                parent: None,
                token_ids: &[],
                block_size: BS as u32,
                lora_name: None,
                medium: "CPU",
            },
            Event::Removed {
                hashes: &[1],
                medium: "GPU",
            },
        ],
    );
    let kv = seq(&toks)[0];
    assert_eq!(s.lookup(1), Some((kv, vec![Tier::Host])));
    assert_eq!(s.stats().blocks_skipped[0], 1, "hash 2 was never seen");
    assert_eq!(snapshot(&mut s), vec![(Tier::Host, kv)]);
}

#[test]
fn bad_stores_are_counted_not_applied() {
    let toks: Vec<u32> = (0..8).collect();
    let mut s = state();
    apply(
        &mut s,
        &[
            Event::Stored {
                hashes: &[1],
                parent: None,
                token_ids: &toks[..8],
                block_size: 8,
                lora_name: None,
                medium: "GPU",
            },
            stored(&[2], None, &toks[..5]),
            Event::Stored {
                hashes: &[3],
                parent: None,
                token_ids: &toks[..4],
                block_size: BS as u32,
                lora_name: None,
                medium: "LMCACHE",
            },
        ],
    );
    assert_eq!(s.blocks(), 0);
    let sk = s.stats().blocks_skipped;
    assert_eq!((sk[1], sk[2], sk[4]), (1, 1, 1));
    assert_eq!(s.stats().resets, [0, 0, 0], "skipped stores need no reset");
    // Another KV cache group is skipped too.
    let st = Stored {
        hashes: vec![5],
        token_ids: toks[..4].to_vec(),
        block_size: BS as u64,
        group_idx: Some(1),
        ..Stored::default()
    };
    s.apply_batch(
        &EngineBatch {
            ts: 0.0,
            events: vec![EngineEvent::Stored(st)],
            dp_rank: None,
        },
        1,
    );
    assert_eq!(s.stats().blocks_skipped[5], 1);
}

#[test]
fn bad_payloads_and_lost_removals_reset_the_epoch() {
    let toks: Vec<u32> = (0..4).collect();
    let mut s = state();
    apply(&mut s, &[stored(&[1], None, &toks)]);
    let e0 = s.epoch();
    assert!(s.apply_payload(b"\xc1garbage", 2).is_err());
    assert_ne!(s.epoch(), e0);
    assert_eq!(s.blocks(), 0);
    assert_eq!(s.stats().bad_payloads[3], 1);
    assert_eq!(s.stats().resets[2], 1);
    // A router on the old epoch gets a snapshot of the (empty) view.
    let b = s.answer(&FeedQuery {
        epoch: e0,
        cursor: 1,
        max_events: 10,
    });
    assert!(b.resync);
    assert_eq!(b.events, vec![FeedEvent::Cleared]);
    // A malformed removal is lost information: reset.
    apply(&mut s, &[stored(&[1], None, &toks)]);
    let e1 = s.epoch();
    s.apply_batch(
        &EngineBatch {
            ts: 0.0,
            events: vec![EngineEvent::Malformed {
                kind: "BlockRemoved",
                why: "test",
            }],
            dp_rank: None,
        },
        3,
    );
    assert_ne!(s.epoch(), e1);
    assert_eq!(s.blocks(), 0);
    // An unknown event type is counted and skipped.
    s.apply_batch(
        &EngineBatch {
            ts: 0.0,
            events: vec![EngineEvent::Unknown("BlockUpdated".into())],
            dp_rank: None,
        },
        4,
    );
    assert_eq!(s.stats().events_unknown, 1);
    assert_eq!(s.stats().resets[2], 2);
}

#[test]
fn sequence_numbers_gaps_and_restarts() {
    let mut s = state();
    assert_eq!(s.check_seq(41), SeqVerdict::First);
    assert_eq!(s.check_seq(42), SeqVerdict::InOrder);
    assert_eq!(s.check_seq(45), SeqVerdict::Gap { from: 43, to: 45 });
    assert_eq!(s.check_seq(46), SeqVerdict::InOrder);
    assert_eq!(s.check_seq(0), SeqVerdict::Restart);
    assert_eq!(s.check_seq(1), SeqVerdict::InOrder);
    let e = s.epoch();
    s.reset(ResetReason::Gap, 9);
    assert_ne!(s.epoch(), e);
    assert_eq!(s.stats().resets[1], 1);
    // The engine's process start time changing is a restart too.
    let mut load = EngineLoad {
        start_time: Some(100.0),
        ..EngineLoad::default()
    };
    s.set_engine_load(load.clone(), 1);
    let e = s.epoch();
    s.set_engine_load(load.clone(), 1);
    assert_eq!(s.epoch(), e);
    load.start_time = Some(200.0);
    s.set_engine_load(load, 1);
    assert_ne!(s.epoch(), e);
    assert_eq!(s.stats().resets[0], 1);
    assert_eq!(s.expected_seq(), None);
}

#[test]
fn the_cap_evicts_the_oldest_and_tells_the_router() {
    let toks: Vec<u32> = (0..16).collect();
    let want = seq(&toks);
    let mut s = AdapterState::new(
        StateConfig {
            block_size: Some(BS),
            max_blocks: Some(3),
            ..StateConfig::default()
        },
        7,
    );
    let snap = s.answer(&FeedQuery::resync(10));
    apply(&mut s, &[stored(&[1, 2, 3, 4], None, &toks)]);
    assert_eq!(s.blocks(), 3);
    assert_eq!(s.stats().cap_evictions, 1);
    assert!(s.lookup(1).is_none());
    let b = s.answer(&FeedQuery {
        epoch: snap.epoch,
        cursor: snap.next_seq,
        max_events: 10,
    });
    assert_eq!(
        b.events,
        vec![
            FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: want[..4].to_vec()
            },
            FeedEvent::Removed {
                tier: Tier::Gpu,
                hashes: vec![want[0]]
            },
        ]
    );
    // Stale FIFO entries never evict a live block: with room for one more, churn far past the cap.
    apply(
        &mut s,
        &[Event::Removed {
            hashes: &[2],
            medium: "GPU",
        }],
    );
    for round in 0..5000u64 {
        let h = 100 + round;
        apply(&mut s, &[stored(&[h], None, &toks[..4])]);
        apply(
            &mut s,
            &[Event::Removed {
                hashes: &[h],
                medium: "GPU",
            }],
        );
    }
    assert_eq!(s.blocks(), 2);
    assert_eq!(s.stats().cap_evictions, 1);
    assert!(
        s.fifo.len() < 2 * 2 + 1024 + 2,
        "stale entries are compacted"
    );
}

/// The engine's adapters ride in the answer only for a router that asks, and only once the
/// engine has exported them.
#[test]
fn adapters_are_answered_when_asked_and_known() {
    use kvsteer_core::feed::{AdapterReport, FeedFrame};
    let mut s = AdapterState::new(StateConfig::default(), 7);
    let q = FeedQuery::resync(10);
    let read = |b: Vec<u8>| FeedFrame::parse(b).unwrap().adapters().cloned();
    assert_eq!(read(s.answer_bytes_for(&q, true)), None, "not exported yet");
    let report = AdapterReport {
        slots: 2,
        running: vec!["sql".into()],
        waiting: vec![],
    };
    s.set_engine_load(
        EngineLoad {
            adapters: Some(report.clone()),
            ..EngineLoad::default()
        },
        1,
    );
    assert_eq!(read(s.answer_bytes_for(&q, true)), Some(report));
    assert_eq!(read(s.answer_bytes_for(&q, false)), None);
    assert_eq!(read(s.answer_bytes(&q)), None);
}

#[test]
fn derived_cap_and_load_fields() {
    let mut s = AdapterState::new(StateConfig::default(), 7);
    assert_eq!(s.max_blocks(), DEFAULT_MAX_BLOCKS);
    s.set_engine_load(
        EngineLoad {
            running: 3,
            waiting: 2,
            kv_usage: Some(0.25),
            num_gpu_blocks: Some(10_000),
            block_size: Some(32),
            start_time: None,
            adapters: None,
        },
        1,
    );
    assert_eq!(s.max_blocks(), 20_000);
    assert_eq!(s.block_size(), Some(32));
    let l = s.replica_load();
    assert_eq!(
        (l.running, l.waiting, l.prefill_tokens, l.decode_blocks),
        (3, 2, 0, 2500)
    );
    assert_eq!(
        (l.kv_used_blocks, l.kv_total_blocks, l.block_size),
        (2500, 10_000, 32)
    );
    // A stored event in another block size is refused once the size is known.
    assert!(!s.learn_block_size(16));
}
