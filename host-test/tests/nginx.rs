//! nginx mode (ngx_wasm_module semantics): whole body with end of stream, callouts to addresses, the
//! choice written to an nginx variable.

mod common;
use common::*;
use kvsteer_host_test::{HarnessConfig, HostMode, Output, RequestSpec};

#[test]
fn nginx_mode_sets_the_variable_and_polls_addresses() {
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.mode = HostMode::Nginx;
    cfg.output = Output::NginxVariable;
    let mut h = harness_with(cfg);
    h.run_for(1_000_000).unwrap();
    for r in &h.replicas {
        assert!(r.polls > 0, "{} polled at its address", r.endpoint);
    }
    let prefix = tokens(5, 2048);
    let id = h.send(&RequestSpec::new(prefix.clone(), 8)).unwrap();
    h.run_until_idle(600_000_000).unwrap();
    h.run_for(1_000_000).unwrap();
    let first = h.record(id).unwrap().clone();
    assert!(!first.fallback, "{first:?}");
    let var = first.destination.clone().expect("ngx variable set");
    assert_eq!(h.replica_of_endpoint(&var), first.replica);
    assert!(
        first
            .upstream_header("x-gateway-destination-endpoint")
            .is_none(),
        "nginx mode writes no header"
    );
    let id = h
        .send(&RequestSpec::new(extend(&prefix, 6, 40), 8))
        .unwrap();
    h.run_until_idle(600_000_000).unwrap();
    let second = h.record(id).unwrap();
    assert_eq!(
        second.replica, first.replica,
        "prefix routing works in nginx mode too"
    );
    assert_clean(&h);
}

#[test]
fn cluster_header_mode_names_the_cluster() {
    let mut cfg = HarnessConfig::small("round_robin");
    cfg.output = Output::ClusterHeader;
    let mut h = harness_with(cfg);
    let ids: Vec<u64> = (0..4u64)
        .map(|i| {
            h.send(&RequestSpec::new(tokens(i, 64), 4).worker(0))
                .unwrap()
        })
        .collect();
    h.run_until_idle(600_000_000).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for id in ids {
        let r = h.record(id).unwrap();
        assert!(!r.fallback, "{r:?}");
        let c = r
            .upstream_header("x-kvsteer-cluster")
            .expect("cluster header");
        assert!(c.starts_with("replica_r"), "{c}");
        seen.insert(c.to_string());
    }
    assert_eq!(
        seen.len(),
        4,
        "one worker's round robin covers the 4 clusters"
    );
    assert_clean(&h);
}
