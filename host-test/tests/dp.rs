//! Data-parallel ranks through the compiled filter (docs/design/dp.md): endpoints serving several
//! ranks, each its own engine. The filter routes to (endpoint, rank) units and writes the rank
//! header; a client's rank header never reaches the engine; a feed answer for the wrong rank is
//! refused and counted, never a trap.

mod common;
use common::*;
use kvsteer_core::feed::FeedBatch;
use kvsteer_host_test::{FeedFault, Harness, HarnessConfig, RequestSpec};

const IDLE: u64 = 600_000_000;
const RANK: &str = "x-data-parallel-rank";

/// 2 endpoints x 4 ranks, one worker, `policy`; rank-aware unless told otherwise.
fn dp_fleet(policy: &str, rank_aware: bool) -> Harness {
    let mut cfg = HarnessConfig::small(policy);
    cfg.workers = 1;
    cfg.replicas = 2;
    cfg.dp_ranks = 4;
    cfg.rank_aware = rank_aware;
    harness_with(cfg)
}

fn rank_headers(h: &Harness, id: u64) -> Vec<String> {
    h.record(id)
        .unwrap()
        .upstream_headers
        .iter()
        .filter(|(k, _)| k == RANK)
        .map(|(_, v)| v.clone())
        .collect()
}

#[test]
fn rank_aware_routing_writes_the_rank_header_and_finds_the_rank_holding_the_prefix() {
    let mut h = dp_fleet("kv_load", true);
    assert_eq!(h.replicas.len(), 8);
    let mut homes = std::collections::BTreeSet::new();
    for doc in 0..6u64 {
        let prefix = tokens(500 + doc, 1024);
        let id = h.send(&RequestSpec::new(prefix.clone(), 4)).unwrap();
        h.run_until_idle(IDLE).unwrap();
        h.run_for(1_000_000).unwrap();
        let home = h.record(id).unwrap().replica.unwrap();
        homes.insert(home);
        let rank = h.replicas[home].rank.unwrap();
        assert_eq!(rank_headers(&h, id), [rank.to_string()], "doc {doc}");
        for q in 0..2u64 {
            let id = h
                .send(&RequestSpec::new(extend(&prefix, 77 * doc + q, 32), 4))
                .unwrap();
            h.run_until_idle(IDLE).unwrap();
            h.run_for(500_000).unwrap();
            let r = h.record(id).unwrap();
            assert_eq!(r.replica, Some(home), "doc {doc} query {q}: {r:?}");
            assert!(
                r.cached_tokens >= 1024,
                "served from the rank's cache: {r:?}"
            );
            let d = r.upstream_header("x-gateway-destination-endpoint").unwrap();
            let mut hosts = d.split(',');
            assert_eq!(hosts.next(), Some(h.replicas[home].endpoint.as_str()));
            // The retry backup is the other endpoint: another rank of this one shares its address,
            // and Envoy would retry the same engine with this request's rank header.
            if let Some(backup) = hosts.next() {
                assert_ne!(backup, h.replicas[home].endpoint, "backup in {d}");
            }
        }
    }
    assert!(
        homes.len() >= 3,
        "fresh prompts spread over ranks: {homes:?}"
    );
    assert_eq!(
        h.stats.rank_from_balancer, 0,
        "every request named its rank"
    );
    assert_eq!(h.stats.rank_from_header, h.stats.requests);
    // Every rank's feed was polled with its rank.
    for r in &h.replicas {
        let path = &r.last_poll.as_ref().expect("polled").1;
        assert!(
            path.ends_with(&format!("&rank={}", r.rank.unwrap())),
            "{path}"
        );
    }
    assert_clean(&h);
}

#[test]
fn a_client_rank_header_never_reaches_the_engine() {
    // Rank-aware: the upstream sees exactly the filter's rank, once.
    let mut h = dp_fleet("kv_load", true);
    let mut ids = Vec::new();
    for i in 0..8u64 {
        let spec = RequestSpec::new(tokens(900 + i, 300), 4)
            .header(RANK, "3")
            .header("X-Data-Parallel-Rank", "3");
        ids.push(h.send(&spec).unwrap());
    }
    h.run_until_idle(IDLE).unwrap();
    for &id in &ids {
        let r = h.record(id).unwrap();
        let unit = r.replica.unwrap();
        assert_eq!(
            rank_headers(&h, id),
            [h.replicas[unit].rank.unwrap().to_string()],
            "{r:?}"
        );
    }
    let removed = h
        .proxy()
        .metric("kvsteer_spoofed_headers_removed")
        .map_or(0, |m| m.value);
    assert!(removed >= 8, "{removed}");
    assert_clean(&h);

    // Rank-blind (the filter knows no ranks) and an ordinary fleet: the header is removed all the
    // same, so the engine's balancer, not the client, picks the rank.
    let mut h = dp_fleet("kv_load", false);
    let mut ids = Vec::new();
    for i in 0..8u64 {
        let spec = RequestSpec::new(tokens(950 + i, 300), 4).header(RANK, "3");
        ids.push(h.send(&spec).unwrap());
    }
    h.run_until_idle(IDLE).unwrap();
    for &id in &ids {
        assert!(rank_headers(&h, id).is_empty());
    }
    assert_eq!(h.stats.rank_from_header, 0);
    assert_eq!(h.stats.rank_from_balancer, 8);
    assert_clean(&h);
    let mut h = harness("kv_load");
    let id = h
        .send(&RequestSpec::new(tokens(1, 100), 4).header(RANK, "1"))
        .unwrap();
    h.run_until_idle(IDLE).unwrap();
    assert!(
        rank_headers(&h, id).is_empty(),
        "no ranks configured: none written, none passed"
    );
    assert_clean(&h);
}

/// Rank-blind routing still works end to end: one unit per endpoint, polled without a rank and
/// answered with the union of its ranks' caches; the endpoint's balancer spreads over its ranks.
#[test]
fn rank_blind_routing_sees_endpoints_and_the_union_of_their_ranks() {
    let mut h = dp_fleet("kv_load", false);
    let prefix = tokens(42, 1024);
    let mut ids = Vec::new();
    for q in 0..8u64 {
        ids.push(
            h.send(&RequestSpec::new(extend(&prefix, q, 16), 64))
                .unwrap(),
        );
    }
    h.run_until_idle(IDLE).unwrap();
    let units: std::collections::BTreeSet<usize> = ids
        .iter()
        .map(|&id| h.record(id).unwrap().replica.unwrap())
        .collect();
    assert!(units.len() >= 2, "the balancer spread them: {units:?}");
    for r in &h.replicas {
        if let Some((_, path, _)) = &r.last_poll {
            assert!(!path.contains("rank="), "{path}");
        }
    }
    assert_clean(&h);
}

/// A feed answering for another rank (a misconfigured adapter, or one out of range) is refused
/// and counted; the filter keeps routing and never traps.
#[test]
fn a_feed_answer_for_the_wrong_rank_is_refused_and_counted() {
    let mut h = dp_fleet("kv_load", true);
    let wrong = FeedBatch::snapshot(1, (0..64).collect()).encode_for_rank(9);
    // Unit 0's fault answers every poll to endpoint 0, whatever rank it asks for.
    h.set_feed_fault(0, FeedFault::Garbage(wrong));
    h.run_for(2_000_000).unwrap();
    let refused = h
        .proxy()
        .metric("kvsteer_feed_rank_mismatches")
        .map_or(0, |m| m.value);
    assert!(refused >= 4, "{refused}");
    let id = h.send(&RequestSpec::new(tokens(7, 200), 4)).unwrap();
    h.run_until_idle(IDLE).unwrap();
    assert!(!h.record(id).unwrap().failed);
    assert_clean(&h);
}
