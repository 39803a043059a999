//! Membership that changes at run time: slots that join, drain, flap and are vacated and reused,
//! as the filter's discovery drives them.

use kvsteer_core::block::BlockHasher;
use kvsteer_core::feed::FeedBatch;
use kvsteer_core::{Membership, PolicyKind, Router, RoutingConfig};

fn cfg(policy: PolicyKind) -> RoutingConfig {
    RoutingConfig {
        policy,
        block_size: 4,
        ..RoutingConfig::default()
    }
}

fn body(tokens: &[u32]) -> Vec<u8> {
    format!("{{\"model\":\"m\",\"prompt\":{tokens:?},\"max_tokens\":8}}").into_bytes()
}

/// A resync snapshot holding the blocks of `tokens` (block size 4).
fn snapshot(epoch: u64, tokens: &[u32]) -> FeedBatch {
    let hashes = BlockHasher::new(4).unwrap().sequence_hashes(tokens);
    FeedBatch::snapshot(epoch, hashes.iter().map(|h| h.0).collect())
}

const POLICIES: [PolicyKind; 6] = [
    PolicyKind::RoundRobin,
    PolicyKind::LeastLoad,
    PolicyKind::SessionHash,
    PolicyKind::PrefixAffinity,
    PolicyKind::KvAffinity,
    PolicyKind::KvLoad,
];

#[test]
fn no_policy_routes_to_a_draining_or_vacant_slot_even_when_every_member_is_down() {
    let tokens: Vec<u32> = (0..64).collect();
    for policy in POLICIES {
        let mut r = Router::new(cfg(policy), 4).unwrap();
        // Slot 1 holds the whole prompt: the kv policies would pick it if they could.
        r.apply_feed(1, &snapshot(7, &tokens));
        r.set_membership(1, Membership::Draining);
        r.set_membership(3, Membership::Vacant);
        assert_eq!(r.member_count(), 2);
        for i in 0..40u64 {
            let key = format!("s{i}");
            let req = r
                .read_request("/v1/completions", &body(&tokens), Some(&key))
                .unwrap();
            let d = r.route(&req, i);
            assert!(d.replica == 0 || d.replica == 2, "{policy:?}: {d:?}");
            assert!(d.backup.is_none_or(|b| b == 0 || b == 2), "{policy:?}");
            let f = r.route_fallback(i).replica;
            assert!(f == 0 || f == 2, "{policy:?} fallback chose {f}");
        }
        // Every member down: still never a slot without a member.
        r.set_down(0, true);
        r.set_down(2, true);
        for i in 0..20u64 {
            let req = r
                .read_request("/v1/completions", &body(&tokens), Some(&format!("t{i}")))
                .unwrap();
            let d = r.route(&req, 100 + i);
            assert!(d.replica == 0 || d.replica == 2, "{policy:?}: {d:?}");
        }
    }
}

#[test]
fn a_slot_that_joins_is_routed_to_from_its_first_snapshot() {
    let tokens: Vec<u32> = (0..64).collect();
    let mut r = Router::new(cfg(PolicyKind::KvAffinity), 3).unwrap();
    r.set_membership(2, Membership::Vacant);
    let req = r
        .read_request("/v1/completions", &body(&tokens), None)
        .unwrap();
    assert_ne!(r.route(&req, 0).replica, 2);
    r.set_membership(2, Membership::Member);
    r.apply_feed(2, &snapshot(3, &tokens));
    let d = r.route(&req, 1);
    assert_eq!(d.replica, 2, "the new member holds the prefix: {d:?}");
    assert_eq!(d.matched_tokens[2], 64);
}

#[test]
fn a_drained_member_releases_what_it_has_in_flight_and_keeps_its_index_until_vacated() {
    let tokens: Vec<u32> = (0..64).collect();
    let mut r = Router::new(cfg(PolicyKind::KvLoad), 2).unwrap();
    r.apply_feed(1, &snapshot(5, &tokens));
    let req = r
        .read_request("/v1/completions", &body(&tokens), None)
        .unwrap();
    let d = r.route(&req, 0);
    assert_eq!(d.replica, 1);
    r.admit(10, &req, &d, 0);
    r.admit(11, &req, &d, 0);
    assert_eq!(r.local_load()[1].active_requests, 2);
    r.set_membership(1, Membership::Draining);
    // In flight: released normally, no anomaly.
    assert!(r.release(10));
    assert_eq!(r.local_load()[1].active_requests, 1);
    assert_eq!(r.index().replica_blocks(1), 16, "draining keeps the index");
    // The hold time passed: vacated with one request still booked.
    let change = r.set_membership(1, Membership::Vacant);
    assert_eq!(change.dropped_bookings, 1);
    assert!(change.cleared);
    assert_eq!(r.index().replica_blocks(1), 0, "its blocks left the index");
    assert_eq!(
        r.local_load()[1].active_requests,
        0,
        "its bookings left the load table"
    );
    assert_eq!(r.stats().active_requests, 0);
    // The straggler's release is an anomaly (its booking is gone), not a crash or a negative load.
    assert!(!r.release(11));
    assert_eq!(r.stats().release_anomalies, 1);
    // The slot is reused by another member, which starts from its own snapshot.
    r.set_membership(1, Membership::Member);
    assert_eq!(
        r.feed_query(1, 100).epoch,
        0,
        "the new member is asked for a snapshot"
    );
    let d = r.route(&req, 1);
    assert_eq!(d.matched_tokens[1], 0, "nothing inherited: {d:?}");
}

#[test]
fn a_member_that_flaps_keeps_its_index() {
    let tokens: Vec<u32> = (0..64).collect();
    let mut r = Router::new(cfg(PolicyKind::KvAffinity), 2).unwrap();
    r.apply_feed(0, &snapshot(9, &tokens));
    let before = r.stats().feed_resets;
    for _ in 0..5 {
        assert!(!r.set_membership(0, Membership::Draining).cleared);
        assert!(!r.set_membership(0, Membership::Member).cleared);
    }
    assert_eq!(r.index().replica_blocks(0), 16);
    assert_eq!(r.feed_query(0, 100).epoch, 9, "no resync asked for");
    assert_eq!(r.stats().feed_resets, before);
    let req = r
        .read_request("/v1/completions", &body(&tokens), None)
        .unwrap();
    assert_eq!(r.route(&req, 0).replica, 0);
}

#[test]
fn an_ejected_member_vacated_comes_back_healthy_and_out_of_range_is_counted() {
    let mut r = Router::new(cfg(PolicyKind::RoundRobin), 2).unwrap();
    for t in 0..20 {
        r.record_outcome(0, kvsteer_core::health::Outcome::Failure, t);
    }
    assert!(r.is_ejected(0));
    r.set_down(0, true);
    r.set_membership(0, Membership::Vacant);
    r.set_membership(0, Membership::Member);
    assert!(!r.is_ejected(0));
    assert!(!r.is_down(0));
    let bad = r.stats().bad_replica;
    r.set_membership(7, Membership::Vacant);
    assert_eq!(r.stats().bad_replica, bad + 1);
    assert_eq!(r.membership(7), Membership::Vacant);
}
