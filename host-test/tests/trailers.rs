//! HTTP/2 requests that end with trailers: end of stream arrives on `proxy_on_request_trailers`, not on
//! the last body chunk. They must be routed, admitted and counted like any other request, not
//! kept paused until the trailers and then let go with no decision.

mod common;
use common::*;
use kvsteer_host_test::{HarnessConfig, RequestSpec};

const IDLE: u64 = 600_000_000;

fn metric(h: &kvsteer_host_test::Harness, name: &str) -> i64 {
    h.proxy().metric(name).map_or(0, |m| m.value)
}

#[test]
fn a_request_ending_with_trailers_is_routed_by_its_prefix() {
    let mut h = single_worker("kv_load");
    let prefix = tokens(7, 2048);
    // Warm one replica with the prefix (plain request), let the feed report it.
    let first = h.send(&RequestSpec::new(prefix.clone(), 8)).unwrap();
    h.run_until_idle(IDLE).unwrap();
    h.run_for(1_000_000).unwrap();
    let home = h.record(first).unwrap().replica.unwrap();
    for q in 0..4u64 {
        let spec = RequestSpec::new(extend(&prefix, 100 + q, 64), 8).trailer("x-checksum", "abc");
        let id = h.send(&spec).unwrap();
        h.run_until_idle(IDLE).unwrap();
        h.run_for(500_000).unwrap();
        let r = h.record(id).unwrap();
        assert!(r.released && !r.fallback && !r.failed, "{r:?}");
        assert!(
            r.upstream_header("x-gateway-destination-endpoint")
                .is_some(),
            "the filter wrote its choice: {r:?}"
        );
        assert_eq!(r.replica, Some(home), "query {q} goes to the holder: {r:?}");
        assert!(r.cached_tokens >= 2048, "{r:?}");
    }
    assert_eq!(metric(&h, "kvsteer_requests_routed"), 5);
    assert_eq!(metric(&h, "kvsteer_fallbacks"), 0);
    assert_eq!(h.stats.fallback, 0, "nothing left to the proxy's balancing");
    assert_clean(&h);
}

#[test]
fn trailers_with_many_body_chunks_two_workers_and_streamed_load() {
    // Small body chunks (Envoy hands the filter several before the trailers), two workers: every
    // request is decided and its load tracked and released (no anomaly, nothing left active).
    let mut cfg = HarnessConfig::small("least_load");
    cfg.body_chunk_bytes = 512;
    let mut h = harness_with(cfg);
    let mut ids = Vec::new();
    for i in 0..16u64 {
        ids.push(
            h.send(&RequestSpec::new(tokens(1000 + i, 600), 32).trailer("grpc-status", "0"))
                .unwrap(),
        );
    }
    h.run_until_idle(IDLE).unwrap();
    let mut per = [0u32; 4];
    for id in &ids {
        let r = h.record(*id).unwrap();
        assert!(r.released && !r.fallback && !r.failed, "{r:?}");
        per[r.replica.unwrap()] += 1;
    }
    // least_load spreads 16 concurrent requests: every replica gets some.
    assert!(per.iter().all(|&n| n >= 2), "{per:?}");
    assert_eq!(metric(&h, "kvsteer_requests_routed"), 16);
    assert_eq!(metric(&h, "kvsteer_fallbacks"), 0);
    assert_clean(&h);
}

#[test]
fn trailers_without_a_body_or_over_the_limit_are_routed_by_load() {
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.routing =
        serde_json::json!({"policy": "kv_load", "block_size": 16, "max_body_bytes": 4096});
    let mut h = harness_with(cfg);
    let empty = RequestSpec {
        raw_body: Some(Vec::new()),
        ..RequestSpec::default()
    }
    .trailer("x-end", "1");
    // 2,000 token ids are about 12 KB of JSON: over the 4 KiB limit.
    let big = RequestSpec::new(tokens(3, 2000), 4).trailer("x-end", "1");
    let ids = [h.send(&empty).unwrap(), h.send(&big).unwrap()];
    h.run_until_idle(IDLE).unwrap();
    for id in ids {
        let r = h.record(id).unwrap();
        assert!(r.released && !r.fallback, "decided by the filter: {r:?}");
        assert!(
            r.upstream_header("x-gateway-destination-endpoint")
                .is_some(),
            "{r:?}"
        );
    }
    assert_eq!(metric(&h, "kvsteer_requests_routed"), 2);
    assert_eq!(metric(&h, "kvsteer_fallbacks"), 2);
    assert_clean(&h);
}
