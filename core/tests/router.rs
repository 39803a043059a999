//! The Router as the filter drives it: read, route, admit, token events, release, feed.

use kvsteer_core::block::BlockHasher;
use kvsteer_core::config::{KvLoadParams, LoadParams, ReportedLoad};
use kvsteer_core::feed::{FeedBatch, FeedEvent, ReplicaLoad, Tier};
use kvsteer_core::record::Record;
use kvsteer_core::{FallbackReason, FeedOutcome, LoadTotals, PolicyKind, Router, RoutingConfig};

/// Dynamo's coefficients (prefill scale 1, credit 1), so the costs below are easy to follow, and the
/// replicas' reports combined by max, so the tests of that path have something to combine.
fn cfg(policy: PolicyKind) -> RoutingConfig {
    RoutingConfig {
        policy,
        block_size: 4,
        kv_load: KvLoadParams {
            prefill_scale: 1.0,
            overlap_credit: 1.0,
            // The plain block formula, so costs below can be counted by hand.
            queue_weight: 1.0,
            time_cost: false,
            ..KvLoadParams::default()
        },
        load: LoadParams {
            reported_load: ReportedLoad::Max,
            ..LoadParams::default()
        },
        ..RoutingConfig::default()
    }
}

fn body(tokens: &[u32]) -> Vec<u8> {
    format!("{{\"model\":\"m\",\"prompt\":{tokens:?},\"max_tokens\":8}}").into_bytes()
}

fn batch(epoch: u64, resync: bool, first: u64, events: Vec<FeedEvent>) -> FeedBatch {
    let n = events.len() as u64;
    FeedBatch {
        epoch,
        resync,
        more: false,
        first_seq: first,
        next_seq: if resync { first } else { first + n },
        load: ReplicaLoad {
            block_size: 4,
            ..ReplicaLoad::default()
        },
        events,
    }
}

fn hashes(tokens: &[u32]) -> Vec<u64> {
    BlockHasher::new(4)
        .unwrap()
        .sequence_hashes(tokens)
        .iter()
        .map(|h| h.0)
        .collect()
}

#[test]
fn kv_load_prefers_the_replica_holding_the_prefix_until_it_is_loaded() {
    let mut r = Router::new(cfg(PolicyKind::KvLoad), 3).unwrap();
    let prompt: Vec<u32> = (0..64).collect();
    let snap = batch(
        7,
        true,
        0,
        vec![
            FeedEvent::Cleared,
            FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: hashes(&prompt),
            },
        ],
    );
    assert_eq!(
        r.apply_feed(2, &snap),
        FeedOutcome::Reset {
            events: 2,
            epoch: 7
        }
    );
    let req = r
        .read_request("/v1/completions", &body(&prompt), None)
        .unwrap();
    let d = r.route(&req, 0);
    assert_eq!(d.replica, 2);
    assert_eq!(d.matched_tokens, vec![0, 0, 64]);
    // Cost = prefill blocks left + the decode blocks the request would add (16 blocks of 4 tokens,
    // none already active anywhere): the holder saves the 16 prefill blocks.
    assert_eq!(d.costs[2], 16.0);
    assert_eq!(d.costs[0], 32.0);
    // Load replica 2 with decode work heavier than the prefill saved: the request goes elsewhere.
    let big: Vec<u32> = (1000..1200).collect();
    let big_req = r
        .read_request("/v1/completions", &body(&big), None)
        .unwrap();
    let forced = kvsteer_core::Decision {
        replica: 2,
        ..r.route(&big_req, 0)
    };
    r.admit(1, &big_req, &forced, 0);
    assert_eq!(
        r.local_load()[2].decode_blocks,
        50,
        "prompt blocks booked from admission"
    );
    r.first_token(1);
    assert_eq!(r.local_load()[2].decode_blocks, 50);
    let d2 = r.route(&req, 0);
    assert_ne!(d2.replica, 2, "costs {:?}", d2.costs);
    assert!(r.release(1));
    assert!(!r.release(1));
    assert_eq!(r.stats().release_anomalies, 1);
    assert_eq!(r.local_load()[2], LoadTotals::default());
}

#[test]
fn admit_charges_only_uncached_prompt_tokens() {
    let mut r = Router::new(cfg(PolicyKind::KvAffinity), 2).unwrap();
    let prompt: Vec<u32> = (0..40).collect();
    r.apply_feed(
        1,
        &batch(
            1,
            true,
            0,
            vec![FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: hashes(&prompt[..24]),
            }],
        ),
    );
    let req = r
        .read_request("/v1/completions", &body(&prompt), None)
        .unwrap();
    let d = r.route(&req, 0);
    assert_eq!(d.replica, 1);
    r.admit(9, &req, &d, 0);
    assert_eq!(r.local_load()[1].prefill_tokens, 16);
    assert_eq!(r.local_load()[1].active_requests, 1);
}

#[test]
fn host_tier_counts_with_credit_and_stale_replicas_count_nothing() {
    let mut c = cfg(PolicyKind::KvLoad);
    c.index.host_tier_credit = 0.5;
    let mut r = Router::new(c, 2).unwrap();
    let prompt: Vec<u32> = (0..32).collect();
    r.apply_feed(
        0,
        &batch(
            1,
            true,
            0,
            vec![FeedEvent::Stored {
                tier: Tier::Host,
                hashes: hashes(&prompt),
            }],
        ),
    );
    let req = r
        .read_request("/v1/completions", &body(&prompt), None)
        .unwrap();
    let d = r.route(&req, 0);
    assert_eq!(d.matched_tokens[0], 16, "8 host blocks at credit 0.5");
    // Prefill left (4 or 8 blocks) + the request's 8 blocks of decode load.
    assert_eq!(d.costs, vec![12.0, 16.0]);
    r.set_stale(0, true);
    let d = r.route(&req, 0);
    assert_eq!(d.matched_tokens[0], 0);
    assert_eq!(d.costs, vec![16.0, 16.0]);
}

#[test]
fn feed_gaps_and_restarts() {
    let mut r = Router::new(cfg(PolicyKind::KvLoad), 2).unwrap();
    let p: Vec<u32> = (0..8).collect();
    let stored = |h| FeedEvent::Stored {
        tier: Tier::Gpu,
        hashes: h,
    };
    assert_eq!(r.feed_query(0, 10).epoch, 0);
    r.apply_feed(0, &batch(5, true, 3, vec![stored(hashes(&p))]));
    assert_eq!(r.feed_query(0, 10).cursor, 3);
    assert_eq!(r.stats().index_blocks, 2);
    assert_eq!(
        r.apply_feed(0, &batch(5, false, 3, vec![FeedEvent::Cleared])),
        FeedOutcome::Applied { events: 1 }
    );
    assert_eq!(r.stats().index_blocks, 0);
    // A batch that skips ahead is a gap; nothing is applied and a snapshot is asked for.
    assert_eq!(
        r.apply_feed(0, &batch(5, false, 10, vec![stored(hashes(&p))])),
        FeedOutcome::Gap
    );
    assert_eq!(r.stats().index_blocks, 0);
    assert_eq!(r.feed_query(0, 10).epoch, 0);
    // Restart: a new epoch's snapshot replaces the replica's blocks.
    r.apply_feed(0, &batch(6, true, 0, vec![stored(hashes(&p))]));
    r.apply_feed(1, &batch(1, true, 0, vec![stored(hashes(&p))]));
    assert_eq!(r.index().replica_blocks(0), 2);
    r.apply_feed(0, &batch(7, true, 0, vec![]));
    assert_eq!(r.index().replica_blocks(0), 0);
    assert_eq!(r.index().replica_blocks(1), 2);
    let s = r.stats();
    assert_eq!((s.feed_gaps, s.feed_resets), (1, 4));
    assert_eq!(
        r.apply_feed(9, &batch(1, true, 0, vec![])),
        FeedOutcome::BadReplica
    );
}

#[test]
fn reported_load_is_combined_by_max_and_ignored_when_stale() {
    let mut r = Router::new(cfg(PolicyKind::LeastLoad), 2).unwrap();
    let mut b = batch(1, true, 0, vec![]);
    b.load.prefill_tokens = 400;
    b.load.decode_blocks = 10;
    b.load.running = 3;
    r.apply_feed(0, &b);
    let eff = r.effective_load();
    assert_eq!(
        eff[0],
        LoadTotals {
            prefill_tokens: 400,
            decode_blocks: 10,
            active_requests: 3
        }
    );
    let req = r
        .read_request("/v1/completions", &body(&[1, 2, 3, 4]), None)
        .unwrap();
    assert_eq!(r.route(&req, 0).replica, 1);
    r.set_stale(0, true);
    assert_eq!(r.effective_load()[0], LoadTotals::default());
}

#[test]
fn peers_add_their_tracked_load() {
    let mut r = Router::new(cfg(PolicyKind::LeastLoad), 2).unwrap();
    let peer = vec![LoadTotals {
        prefill_tokens: 100,
        decode_blocks: 5,
        active_requests: 2,
    }];
    r.set_peer_load(
        3,
        &LoadTotals::decode_all(&LoadTotals::encode_all(&peer)).unwrap(),
    );
    assert_eq!(r.effective_load()[0].prefill_tokens, 100);
    let req = r
        .read_request("/v1/completions", &body(&[1, 2, 3, 4]), None)
        .unwrap();
    assert_eq!(r.route(&req, 0).replica, 1);
    r.clear_peer(3);
    assert_eq!(r.effective_load()[0], LoadTotals::default());
}

#[test]
fn session_hash_is_sticky_and_falls_back_without_a_key() {
    let mut r = Router::new(cfg(PolicyKind::SessionHash), 8).unwrap();
    let b = body(&[1, 2, 3, 4]);
    let first = {
        let req = r.read_request("/v1/completions", &b, Some("abc")).unwrap();
        r.route(&req, 0).replica
    };
    for _ in 0..10 {
        let req = r.read_request("/v1/completions", &b, Some("abc")).unwrap();
        assert_eq!(r.route(&req, 0).replica, first);
    }
    let req = r.read_request("/v1/completions", &b, None).unwrap();
    assert_eq!(
        r.route(&req, 0).fallback,
        Some(FallbackReason::NoSessionKey)
    );
    assert_eq!(r.stats().fallback_no_session_key, 1);
}

#[test]
fn prefix_affinity_follows_its_own_decisions_and_expires() {
    let mut c = cfg(PolicyKind::PrefixAffinity);
    c.prefix_affinity.match_threshold = 0.5;
    c.prefix_affinity.ttl_ms = 1000;
    let mut r = Router::new(c, 4).unwrap();
    let prompt: Vec<u32> = (0..32).collect();
    let req = r
        .read_request("/v1/completions", &body(&prompt), None)
        .unwrap();
    let d = r.route(&req, 0);
    assert_eq!(d.fallback, Some(FallbackReason::BelowMatchThreshold));
    r.admit(1, &req, &d, 0);
    r.release(1);
    let mut longer = prompt.clone();
    longer.extend(100..108);
    let req2 = r
        .read_request("/v1/completions", &body(&longer), None)
        .unwrap();
    let d2 = r.route(&req2, 500);
    assert_eq!((d2.replica, d2.fallback), (d.replica, None));
    // Half a match is not enough once the prefix is only a third of the prompt.
    let mut other = prompt[..16].to_vec();
    other.extend(200..232);
    let req3 = r
        .read_request("/v1/completions", &body(&other), None)
        .unwrap();
    assert_eq!(
        r.route(&req3, 500).fallback,
        Some(FallbackReason::BelowMatchThreshold)
    );
    assert_eq!(
        r.route(&req2, 5000).fallback,
        Some(FallbackReason::BelowMatchThreshold)
    );
}

#[test]
fn text_prompts_use_the_router_own_decisions_as_overlap() {
    let mut r = Router::new(cfg(PolicyKind::KvLoad), 3).unwrap();
    let text = "x".repeat(400);
    let b = format!("{{\"prompt\":\"{text}\"}}").into_bytes();
    let req = r.read_request("/v1/completions", &b, None).unwrap();
    let d = r.route(&req, 0);
    r.admit(1, &req, &d, 0);
    r.release(1);
    let d2 = r.route(&req, 1);
    assert_eq!(d2.replica, d.replica);
    assert_eq!(
        d2.matched_tokens[d.replica], 100,
        "25 chunks of 16 chars = 25 blocks of 4 tokens"
    );
}

#[test]
fn round_robin_cycles_and_fallback_routes_by_load() {
    let mut r = Router::new(cfg(PolicyKind::RoundRobin), 3).unwrap();
    let req = r
        .read_request("/v1/completions", &body(&[1, 2, 3, 4]), None)
        .unwrap();
    let picks: Vec<usize> = (0..6).map(|_| r.route(&req, 0).replica).collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    let d = r.route_fallback(0);
    r.admit_unread(5, &d, 1000);
    let d2 = r.route_fallback(0);
    assert_ne!(d2.replica, d.replica);
    assert_eq!(r.stats().fallback_body_unreadable, 2);
    assert_eq!(r.stats().decisions.iter().sum::<u64>(), 8);
}

#[test]
fn kv_load_softmax_spreads_and_is_reproducible() {
    let mut c = cfg(PolicyKind::KvLoad);
    c.kv_load.temperature = 1.0;
    let run = |c: &RoutingConfig| {
        let mut r = Router::new(c.clone(), 4).unwrap();
        let req = r
            .read_request("/v1/completions", &body(&[1, 2, 3, 4]), None)
            .unwrap();
        (0..50)
            .map(|_| r.route(&req, 0).replica)
            .collect::<Vec<_>>()
    };
    let a = run(&c);
    assert_eq!(a, run(&c), "same seed, same choices");
    let mut distinct = a.clone();
    distinct.sort();
    distinct.dedup();
    assert!(distinct.len() >= 3, "{a:?}");
}

#[test]
fn bad_replica_counts() {
    assert!(Router::new(RoutingConfig::default(), 0).is_err());
    let mut r = Router::new(RoutingConfig::default(), 2).unwrap();
    r.set_stale(5, true);
    r.first_token(77);
    assert_eq!(r.stats().bad_replica, 1);
    assert_eq!(r.stats().release_anomalies, 1);
}

/// The herding docs/design/design.md section 1 describes: pure overlap piles every request sharing
/// a popular prefix onto the replica that caches it; token load spreads them once that replica's
/// load outweighs the prefill it saves.
#[test]
fn kv_load_spreads_what_kv_affinity_herds() {
    let system: Vec<u32> = (0..256).collect();
    let run = |policy: PolicyKind, dynamo_accounting: bool| {
        let mut c = cfg(policy);
        c.load.prompt_blocks_at_admission = dynamo_accounting;
        c.kv_load.assume_kv_reuse = dynamo_accounting;
        let mut r = Router::new(c, 4).unwrap();
        r.apply_feed(
            0,
            &batch(
                1,
                true,
                0,
                vec![FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes: hashes(&system),
                }],
            ),
        );
        let mut per = [0u32; 4];
        for i in 0..40u32 {
            let mut p = system.clone();
            p.extend((0..64).map(|k| 10_000 + i * 64 + k));
            let req = r.read_request("/v1/completions", &body(&p), None).unwrap();
            let d = r.route(&req, i as u64);
            r.admit(i as u64, &req, &d, i as u64);
            r.first_token(i as u64); // long decodes: nobody finishes during the burst
            per[d.replica] += 1;
        }
        per
    };
    assert_eq!(run(PolicyKind::KvAffinity, true)[0], 40);
    // Each request then holds 80 decode blocks (block size 4); the 64 cached blocks cannot outweigh
    // that for long.
    let spread = run(PolicyKind::KvLoad, false);
    assert!(spread.iter().all(|&n| (8..=12).contains(&n)), "{spread:?}");
    // Counting the shared 64-block system prompt once per replica (the default), a request adds only
    // its own 16 blocks where the prompt is already active: the holder gets a little more, and every
    // replica, once it holds the prompt too, is as cheap. Still no herd.
    let spread = run(PolicyKind::KvLoad, true);
    assert!(spread.iter().all(|&n| (7..=13).contains(&n)), "{spread:?}");
}

#[test]
fn down_replicas_are_avoided_by_every_policy_until_all_are_down() {
    let tokens: Vec<u32> = (0..64).collect();
    for policy in [
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoad,
        PolicyKind::SessionHash,
        PolicyKind::PrefixAffinity,
        PolicyKind::KvAffinity,
        PolicyKind::KvLoad,
    ] {
        let mut r = Router::new(cfg(policy), 3).unwrap();
        // Replica 1 holds the prefix (kv policies would love it) and was sent it before (prefix
        // affinity would too); then it goes down.
        r.apply_feed(
            1,
            &batch(
                7,
                true,
                0,
                vec![FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes: hashes(&tokens),
                }],
            ),
        );
        let req = r
            .read_request("/v1/completions", &body(&tokens), Some("s"))
            .unwrap();
        let d = r.route(&req, 0);
        r.admit(1, &req, &d, 0);
        r.release(1);
        r.set_down(1, true);
        for i in 0..30u64 {
            let key = format!("session-{i}");
            let req = r
                .read_request("/v1/completions", &body(&tokens), Some(&key))
                .unwrap();
            let d = r.route(&req, 1);
            assert_ne!(d.replica, 1, "{policy:?} chose a down replica");
            assert_ne!(d.backup, Some(1), "{policy:?} offered a down backup");
            assert!(d.backup.is_some_and(|b| b != d.replica), "{policy:?}");
            assert_ne!(r.route_fallback(1).replica, 1, "{policy:?} fallback");
        }
        // Everyone down: route anyway rather than fail.
        r.set_down(0, true);
        r.set_down(2, true);
        let d = r.route(&req, 2);
        assert!(d.replica < 3);
        r.set_down(1, false);
        assert!(!r.is_down(1));
    }
}

#[test]
fn session_hash_moves_only_the_down_replicas_sessions() {
    let mut r = Router::new(cfg(PolicyKind::SessionHash), 4).unwrap();
    let tokens: Vec<u32> = (0..8).collect();
    let route = |r: &mut Router, key: &str| {
        let req = r
            .read_request("/v1/completions", &body(&tokens), Some(key))
            .unwrap();
        r.route(&req, 0).replica
    };
    let keys: Vec<String> = (0..400).map(|i| format!("user-{i}")).collect();
    let before: Vec<usize> = keys.iter().map(|k| route(&mut r, k)).collect();
    r.set_down(2, true);
    let after: Vec<usize> = keys.iter().map(|k| route(&mut r, k)).collect();
    let mut moved = 0;
    for (b, a) in before.iter().zip(&after) {
        if *b == 2 {
            assert_ne!(*a, 2);
            moved += 1;
        } else {
            assert_eq!(a, b, "a session of an up replica moved");
        }
    }
    assert!(moved > 40, "replica 2 owned {moved} of 400 sessions");
    r.set_down(2, false);
    let back: Vec<usize> = keys.iter().map(|k| route(&mut r, k)).collect();
    assert_eq!(back, before, "sessions return when the replica is back");
}

#[test]
fn output_hint_weights_a_requests_own_blocks_through_the_router() {
    let run = |hint: bool| {
        let mut c = cfg(PolicyKind::KvLoad);
        c.load.use_output_hint = hint;
        let mut r = Router::new(c, 2).unwrap();
        let prompt: Vec<u32> = (0..64).collect();
        // max_tokens 8 in `body`: the output hint.
        let req = r
            .read_request("/v1/completions", &body(&prompt), None)
            .unwrap();
        assert_eq!(req.output_hint, Some(8));
        let d = r.route_and_admit(1, &req, 0);
        r.decode_progress(1, 8);
        r.local_load()[d.replica].decode_blocks
    };
    // 16 prompt blocks shared (booked once) + 2 own output blocks; done generating, the own blocks
    // weigh nothing with the hint.
    assert_eq!(run(false), 18);
    assert_eq!(run(true), 16);
}

#[test]
fn released_requests_teach_the_expected_output() {
    let mut r = Router::new(cfg(PolicyKind::KvLoad), 2).unwrap();
    assert_eq!(
        r.expected_output_tokens(),
        kvsteer_core::output::PRIOR_TOKENS
    );
    let prompt: Vec<u32> = (0..32).collect();
    let req = r
        .read_request("/v1/completions", &body(&prompt), None)
        .unwrap();
    for (id, out) in [(1, 1000), (2, 3000)] {
        let d = r.route(&req, 0);
        r.admit(id, &req, &d, 0);
        r.first_token(id);
        r.decode_progress(id, out);
        assert!(r.release(id));
    }
    assert_eq!(r.expected_output_tokens(), 2000.0);
    // A request released before its first token teaches nothing.
    let d = r.route(&req, 0);
    r.admit(3, &req, &d, 0);
    assert!(r.release(3));
    assert_eq!(r.expected_output_tokens(), 2000.0);
}

/// The router of [`working_set_term_keeps_a_fitting_replica_under_its_learned_cache`] before replica
/// 0 evicts (A's context asked for twice there, C's once), with `overflow_reuse_floor` `floor`, and C's
/// request.
fn two_sessions_on_replica_0(floor: f64) -> (Router, kvsteer_core::request::RouteRequest) {
    let mut c = cfg(PolicyKind::KvLoad);
    c.kv_load.overflow_weight = 1.0;
    c.kv_load.overflow_softness = 0.0;
    c.kv_load.overflow_reuse_floor = floor;
    c.load.reported_load = ReportedLoad::Ignore;
    let mut r = Router::new(c, 2).unwrap();
    let a: Vec<u32> = (0..4_800).collect();
    let s: Vec<u32> = (100_000..103_200).collect();
    let mut stored = hashes(&s);
    stored.extend(hashes(&filler()));
    r.apply_feed(
        0,
        &batch(
            1,
            true,
            0,
            vec![FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: stored,
            }],
        ),
    );
    let req_a = r.read_request("/v1/completions", &body(&a), None).unwrap();
    let req_c = r.read_request("/v1/completions", &body(&s), None).unwrap();
    for (id, req) in [(1, &req_a), (2, &req_a), (3, &req_c)] {
        let mut d = r.route(req, 1_000);
        d.replica = 0;
        r.admit(id, req, &d, 1_000);
        assert!(r.release(id));
    }
    (r, req_c)
}

/// Blocks replica 0 caches besides the sessions' (so that it has a size to learn once it evicts).
fn filler() -> Vec<u32> {
    (200_000..204_000).collect()
}

/// Replica 0's feed reports one block evicted: it held 1,800, so that is its cache size.
fn evict_one_on_replica_0(r: &mut Router) {
    let evicted = hashes(&filler())[..1].to_vec();
    r.apply_feed(
        0,
        &batch(
            1,
            false,
            0,
            vec![FeedEvent::Removed {
                tier: Tier::Gpu,
                hashes: evicted,
            }],
        ),
    );
}

/// The working-set term (`kv_load.overflow_weight`). Session A's context (1,200 blocks) has been
/// asked for twice on replica 0, so it is replica 0's working set; session C's (800 blocks) was asked
/// for once there and is cached there, counted with the reuse share (about 0.38: 150 of the 400
/// sampled blocks requested were requested before). Once replica 0's feed shows it evicting, its
/// cache size is known (1,800 blocks here), and C's next turn, which would grow that working set to
/// 2,000 blocks, goes to the empty replica instead, although replica 0 holds all of C's prompt.
#[test]
fn working_set_term_keeps_a_fitting_replica_under_its_learned_cache() {
    let (mut r, req_c) = two_sessions_on_replica_0(0.0);
    // Replica 0 has not evicted yet, so its size is unknown and the term is off: C's cache wins
    // (replica 0: 0 uncached + 800 new active = 800; replica 1: 800 + 800 = 1,600).
    let d = r.route(&req_c, 1_000);
    assert_eq!((d.replica, d.costs.clone()), (0, vec![800.0, 1_600.0]));
    // The engine evicts one block: it held 1,800, so that is its size. C's 800 blocks would join
    // the 1,200 of A's in full, and the whole working set (about 1,200 + 0.38 * 800 = 1,500 blocks
    // now) would stop fitting: about 800 + 1,500.
    evict_one_on_replica_0(&mut r);
    let d = r.route(&req_c, 1_000);
    assert_eq!(d.replica, 1, "{:?}", d.costs);
    assert!((2_100.0..2_500.0).contains(&d.costs[0]), "{:?}", d.costs);
    assert_eq!(d.costs[1], 1_600.0);
    // Outside the window (120 s by default) nothing is in the working set, and C goes home.
    assert_eq!(r.route(&req_c, 200_000).replica, 0);
}

/// `overflow_reuse_floor`: the same traffic has a reuse share of about 0.38. Above a floor of 0.5 it
/// is not, so the term weighs nothing and C stays where its cache is; with a floor of 0.2 the term
/// weighs (0.38 - 0.2) / 0.8 of itself, about a quarter of the 1,500 blocks it charged above.
#[test]
fn the_reuse_floor_turns_the_working_set_term_down_for_traffic_that_rarely_comes_back() {
    let (mut r, req_c) = two_sessions_on_replica_0(0.5);
    evict_one_on_replica_0(&mut r);
    let d = r.route(&req_c, 1_000);
    assert_eq!((d.replica, d.costs.clone()), (0, vec![800.0, 1_600.0]));
    let (mut r, req_c) = two_sessions_on_replica_0(0.2);
    evict_one_on_replica_0(&mut r);
    let d = r.route(&req_c, 1_000);
    assert_eq!(d.replica, 0, "{:?}", d.costs);
    assert!((1_050.0..1_300.0).contains(&d.costs[0]), "{:?}", d.costs);
}

/// A replica that has not evicted yet is priced like the largest cache another replica has shown
/// (at least what it holds), not as free: otherwise it draws every fresh prompt while the others'
/// working sets overflow theirs. Before any replica has shown its size, the term is off for all.
#[test]
fn a_replica_whose_cache_size_is_unknown_is_priced_like_the_others() {
    let mut r = Router::new(cfg(PolicyKind::KvLoad), 3).unwrap();
    let stored = |tokens: std::ops::Range<u32>| FeedEvent::Stored {
        tier: Tier::Gpu,
        hashes: hashes(&tokens.collect::<Vec<u32>>()),
    };
    // Replica 0 holds 300 blocks and has not evicted; nobody has shown a size: unknown for all.
    r.apply_feed(0, &batch(1, true, 0, vec![stored(0..1_200)]));
    assert_eq!(r.cache_size_blocks(0), 0.0);
    // Replica 1 holds 1,000 blocks and evicts one: its size is 1,000, and replica 0 (and replica 2,
    // which has reported nothing) are priced like it.
    r.apply_feed(1, &batch(1, true, 0, vec![stored(10_000..14_000)]));
    let one = hashes(&(10_000..14_000).collect::<Vec<u32>>())[..1].to_vec();
    r.apply_feed(
        1,
        &batch(
            1,
            false,
            0,
            vec![FeedEvent::Removed {
                tier: Tier::Gpu,
                hashes: one,
            }],
        ),
    );
    assert_eq!(r.cache_size_blocks(1), 1_000.0);
    assert_eq!(r.cache_size_blocks(0), 1_000.0);
    assert_eq!(r.cache_size_blocks(2), 1_000.0);
    // Replica 0 grows past that without evicting: what it holds is a lower bound on its size.
    r.apply_feed(0, &batch(1, false, 0, vec![stored(20_000..26_000)]));
    assert_eq!(r.cache_size_blocks(0), 1_800.0);
    // Replica 1 restarts (a new epoch, nothing held): no replica has shown a size any more.
    r.apply_feed(1, &batch(2, true, 0, vec![FeedEvent::Cleared]));
    assert_eq!(r.cache_size_blocks(1), 0.0);
    assert_eq!(r.cache_size_blocks(0), 0.0);
}

/// `kv_time` prices a replica's cache with the size its feed reports (the load report's GPU KV
/// blocks, in the router's block size); one that has reported none is priced like the smallest
/// another has shown, never as the profile's far larger cache (35 of 40 fresh prompts
/// went to the one replica whose size was not known yet, its evictions priced 0).
#[test]
fn kv_time_prices_the_reported_cache_and_never_an_unknown_one_as_free() {
    let mut r = Router::new(cfg(PolicyKind::KvTime), 3).unwrap();
    let profile_blocks = kvsteer_core::speed::EngineProfile::default().kv_cache_tokens / 4.0;
    // Nothing shown: the profile's cache for every replica.
    assert_eq!(r.priced_cache_blocks(0), profile_blocks);
    let stored = |tokens: std::ops::Range<u32>| FeedEvent::Stored {
        tier: Tier::Gpu,
        hashes: hashes(&tokens.collect::<Vec<u32>>()),
    };
    // Replica 1 reports 250 blocks of 16 tokens: 1,000 of the router's 4-token blocks.
    let mut b = batch(1, true, 0, vec![]);
    b.load.kv_total_blocks = 250;
    b.load.block_size = 16;
    r.apply_feed(1, &b);
    assert_eq!(r.priced_cache_blocks(1), 1_000.0);
    // Replica 0 reports no size and holds 300 blocks: priced like the smallest shown.
    r.apply_feed(0, &batch(1, true, 0, vec![stored(0..1_200)]));
    assert_eq!(r.priced_cache_blocks(0), 1_000.0);
    assert_eq!(r.priced_cache_blocks(2), 1_000.0);
    // What it holds is a lower bound on its size.
    r.apply_feed(0, &batch(1, false, 0, vec![stored(20_000..26_000)]));
    assert_eq!(r.priced_cache_blocks(0), 1_800.0);
    // Replica 0's reports carry 0 blocks: they say nothing; replica 2's real one is taken.
    let mut b = batch(1, false, 0, vec![]);
    b.load.kv_total_blocks = 4_000;
    r.apply_feed(2, &b);
    assert_eq!(r.priced_cache_blocks(2), 4_000.0);
    assert_eq!(r.priced_cache_blocks(0), 1_800.0);
    // `kv_load` keeps its own sizing (the term's configured or learned size).
    let k = Router::new(cfg(PolicyKind::KvLoad), 1).unwrap();
    assert_eq!(k.priced_cache_blocks(0), k.cache_size_blocks(0));
}
