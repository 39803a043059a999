//! Membership at run time through the compiled filter (docs/design/discovery.md): members that
//! join are routed to, members that leave drain (their requests in flight finish and are released),
//! a member that flaps keeps its index, and every bad answer of the source is counted and leaves
//! the last good membership in place.

mod common;
use common::*;
use kvsteer_host_test::{
    CallOutcome, DISCOVERY_CLUSTER, Harness, HarnessConfig, MEMBER_FEEDS_CLUSTER, RequestSpec,
};
use serde_json::json;
use std::collections::BTreeSet;

const IDLE: u64 = 600_000_000;
const PERIOD_US: u64 = 200_000;

fn metric(h: &Harness, name: &str) -> i64 {
    h.proxy().metric(name).map_or(0, |m| m.value)
}

/// Four replicas known only through discovery (two workers), the first `members` listed.
fn fleet(policy: &str, members: &[usize]) -> Harness {
    let mut cfg = HarnessConfig::small(policy);
    cfg.filter_extra = json!({
        "replicas": [],
        "discovery": {
            "cluster": DISCOVERY_CLUSTER,
            "feed_cluster": MEMBER_FEEDS_CLUSTER,
            "period_ms": 200,
            "hold_ms": 10000,
            "max_members": 8,
            "max_response_bytes": 65536
        }
    })
    .as_object()
    .unwrap()
    .clone();
    let mut h = Harness::new(module(), cfg).unwrap();
    h.set_members(members);
    h.run_for(3 * PERIOD_US).unwrap();
    h
}

/// Sends `n` requests of distinct prompts one after the other, each finished before the next; the
/// replicas that served them.
fn serve(h: &mut Harness, n: u64, seed: u64) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    for i in 0..n {
        let id = h.send(&RequestSpec::new(tokens(seed + i, 64), 2)).unwrap();
        h.run_until_idle(IDLE).unwrap();
        let r = h.record(id).unwrap();
        assert!(r.released && !r.failed && !r.fallback, "{r:?}");
        out.insert(r.replica.unwrap());
    }
    out
}

#[test]
fn members_that_join_get_traffic_and_members_that_leave_drain_their_requests_in_flight() {
    let mut h = fleet("round_robin", &[0, 1]);
    assert!(h.discovery_polls() > 0);
    assert_eq!(serve(&mut h, 12, 100), BTreeSet::from([0, 1]));
    // Both others join: traffic within a poll and a feed poll.
    h.set_members(&[0, 1, 2, 3]);
    h.run_for(2 * PERIOD_US).unwrap();
    assert_eq!(serve(&mut h, 16, 200), BTreeSet::from([0, 1, 2, 3]));
    assert_eq!(metric(&h, "kvsteer_discovery_members"), 4);
    // Long requests in flight everywhere, then replica 1 leaves.
    let long: Vec<u64> = (0..8)
        .map(|i| {
            // Long generations (ignore_eos), so they are still running when their replica leaves.
            let prompt = tokens(300 + i, 64);
            let body =
                json!({"model": "m", "prompt": prompt, "max_tokens": 1500, "ignore_eos": true});
            let spec = RequestSpec {
                raw_body: Some(serde_json::to_vec(&body).unwrap()),
                ..RequestSpec::new(prompt, 1500)
            };
            h.send(&spec).unwrap()
        })
        .collect();
    h.run_for(10_000).unwrap();
    let on_1: Vec<u64> = long
        .iter()
        .copied()
        .filter(|&id| h.record(id).unwrap().replica == Some(1))
        .collect();
    assert!(!on_1.is_empty(), "round robin spread the long requests");
    h.set_members(&[0, 2, 3]);
    h.run_for(2 * PERIOD_US).unwrap();
    for id in &on_1 {
        assert!(
            h.record(*id).unwrap().finished_us.is_none(),
            "still in flight when it left: {:?} at {}",
            h.record(*id),
            h.now_us()
        );
    }
    let served = serve(&mut h, 16, 400);
    assert!(
        !served.contains(&1),
        "a leaving member got new requests: {served:?}"
    );
    h.run_until_idle(IDLE).unwrap();
    for id in &long {
        let r = h.record(*id).unwrap();
        assert!(r.released && !r.failed && r.completion_tokens > 0, "{r:?}");
    }
    // The counters mirror the workers' totals at their next tick.
    h.run_for(2 * PERIOD_US).unwrap();
    assert_eq!(metric(&h, "kvsteer_discovery_dropped_bookings"), 0);
    assert!(metric(&h, "kvsteer_discovery_left") >= 1);
    // Every booking was released: the proxy's bookings and releases agree.
    assert_eq!(
        metric(&h, "kvsteer_bookings"),
        metric(&h, "kvsteer_releases"),
        "load leaked"
    );
    // Past the hold its slot is vacated.
    h.run_for(10_500_000).unwrap();
    assert!(metric(&h, "kvsteer_discovery_vacated") >= 1);
    assert_clean(&h);
}

#[test]
fn every_bad_answer_is_counted_and_keeps_the_last_good_membership() {
    let mut h = fleet("round_robin", &[0, 1]);
    let thousand: Vec<serde_json::Value> = (0..1000)
        .map(|i| json!({"name": format!("m{i}"), "endpoint": format!("10.0.{}.{}:8000", i / 250, i % 250 + 1)}))
        .collect();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("malformed", b"\x00\x9f{{{ not json".to_vec()),
        ("malformed", br#"{"members": [{"name": "r2", "#.to_vec()),
        ("empty", br#"{"members": []}"#.to_vec()),
        ("too_many", serde_json::to_vec(&json!({ "members": thousand })).unwrap()),
        (
            "bad_member",
            br#"{"members": [{"name": "r0", "endpoint": "127.0.0.1:18000"}, {"name": "r2", "endpoint": "not-an-address"}]}"#.to_vec(),
        ),
        (
            "duplicate",
            br#"{"members": [{"name": "r0", "endpoint": "127.0.0.1:18000"}, {"name": "r0", "endpoint": "127.0.0.1:18002"}]}"#.to_vec(),
        ),
        ("oversized", vec![b' '; 70_000]),
    ];
    let mut seed = 1_000;
    for (kind, body) in cases {
        let name = format!("kvsteer_discovery_refused_{kind}");
        let before = metric(&h, &name);
        h.set_discovery_answer(Some(CallOutcome::ok(200, "application/json", body)));
        h.run_for(2 * PERIOD_US).unwrap();
        assert!(metric(&h, &name) > before, "{kind} not counted");
        assert_eq!(serve(&mut h, 6, seed), BTreeSet::from([0, 1]), "{kind}");
        seed += 100;
    }
    // The source failing outright: counted, membership kept.
    let failures = metric(&h, "kvsteer_discovery_poll_failures");
    h.set_discovery_answer(None);
    h.run_for(2 * PERIOD_US).unwrap();
    h.set_discovery_answer(Some(CallOutcome::Reset));
    h.run_for(2 * PERIOD_US).unwrap();
    assert!(metric(&h, "kvsteer_discovery_poll_failures") >= failures + 2);
    assert_eq!(serve(&mut h, 6, 5_000), BTreeSet::from([0, 1]));
    // Long past the hold, nobody was vacated: a refused answer never reads as members leaving.
    h.run_for(11_000_000).unwrap();
    assert_eq!(metric(&h, "kvsteer_discovery_vacated"), 0);
    assert_eq!(metric(&h, "kvsteer_discovery_left"), 0);
    // A good answer again applies.
    h.set_members(&[0, 1, 2]);
    h.run_for(2 * PERIOD_US).unwrap();
    assert!(serve(&mut h, 12, 6_000).contains(&2));
    assert_clean(&h);
}

#[test]
fn a_member_that_flaps_within_the_hold_keeps_its_cache_in_the_index() {
    let mut h = fleet("kv_affinity", &[0, 1, 2]);
    let prefix = tokens(77, 256);
    let id = h.send(&RequestSpec::new(prefix.clone(), 2)).unwrap();
    h.run_until_idle(IDLE).unwrap();
    let home = h.record(id).unwrap().replica.unwrap();
    h.run_for(2 * PERIOD_US).unwrap();
    let others: Vec<usize> = (0..3).filter(|&r| r != home).collect();
    let resets = metric(&h, "kvsteer_feed_resets");
    for _ in 0..3 {
        h.set_members(&others);
        h.run_for(2 * PERIOD_US).unwrap();
        h.set_members(&[0, 1, 2]);
        h.run_for(2 * PERIOD_US).unwrap();
    }
    assert_eq!(
        metric(&h, "kvsteer_feed_resets"),
        resets,
        "no snapshot asked for"
    );
    assert_eq!(metric(&h, "kvsteer_discovery_vacated"), 0);
    let id = h
        .send(&RequestSpec::new(extend(&prefix, 5, 32), 2))
        .unwrap();
    h.run_until_idle(IDLE).unwrap();
    let r = h.record(id).unwrap();
    assert_eq!(
        r.replica,
        Some(home),
        "the prefix is still indexed on its home: {r:?}"
    );
    assert!(r.cached_tokens >= 256, "{r:?}");
    assert_clean(&h);
}

/// Hostile answers through the compiled filter: 300 mutations of a good list (bytes flipped, cut,
/// repeated), with requests between them. No worker traps, every request is served by a replica
/// some good list named, and the last good list applies again at the end.
#[test]
fn mutated_member_lists_never_trap_the_filter() {
    let mut h = fleet("round_robin", &[0, 1]);
    let good = h.member_list(&[0, 1, 2]);
    let mut x: u64 = 0x2545_F491_4F6C_DD1D;
    let mut next = |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n.max(1) as u64) as usize
    };
    for round in 0..300u64 {
        let mut body = good.clone();
        for _ in 0..1 + next(3) {
            if body.is_empty() {
                break;
            }
            let i = next(body.len());
            match next(3) {
                0 => body[i] = next(256) as u8,
                1 => body.truncate(i),
                _ => {
                    let b = body[i];
                    body.insert(i, b);
                }
            }
        }
        h.set_discovery_answer(Some(CallOutcome::ok(200, "application/json", body)));
        h.run_for(PERIOD_US).unwrap();
        if round % 30 == 0 {
            let id = h
                .send(&RequestSpec::new(tokens(9_000 + round, 64), 2))
                .unwrap();
            h.run_until_idle(IDLE).unwrap();
            let r = h.record(id).unwrap();
            assert!(r.finished_us.is_some() && !r.failed, "{r:?}");
        }
    }
    h.set_members(&[0, 1, 2]);
    h.run_for(2 * PERIOD_US).unwrap();
    assert_eq!(serve(&mut h, 9, 20_000), BTreeSet::from([0, 1, 2]));
    assert_clean(&h);
}
