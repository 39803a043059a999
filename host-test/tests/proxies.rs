//! Several independent proxies in front of the same replicas: each its own VMs and shared
//! data, so one proxy learns another's traffic only from the replicas' feeds.

mod common;
use common::*;
use kvsteer_host_test::{HarnessConfig, ProxySpread, RequestSpec};
use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};

fn two_proxies(reported_load: &str) -> HarnessConfig {
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.replicas = 2;
    cfg.proxies = 2;
    cfg.workers = 2;
    cfg.routing = json!({
        "policy": "kv_load", "block_size": 16,
        "load": {"reported_load": reported_load}
    });
    cfg
}

/// A long decode sent through proxy 0; then four short requests through proxy 1 (two per worker, at
/// the same instant). Under `merge`, `others` (and `max`) proxy 1 learns the long decode from the
/// replica's report and keeps all four off that replica; under `ignore` it sees only its own
/// bookings and balances its four across both replicas.
#[test]
fn a_long_decode_through_one_proxy_steers_the_other_away_once_reported() {
    for (mode, avoids) in [
        ("merge", true),
        ("others", true),
        ("max", true),
        ("ignore", false),
    ] {
        let mut h = harness_with(two_proxies(mode));
        assert_eq!(h.workers().len(), 4);
        assert_eq!(h.proxy_of_worker(3), 1);
        let long = h
            .send(&RequestSpec::new(tokens(1, 4096), 4000).worker(0))
            .unwrap();
        // Past its first token and two feed periods: every proxy has polled the replica since.
        h.run_for(1_000_000).unwrap();
        let busy = h.record(long).unwrap().replica.unwrap();
        assert!(h.record(long).unwrap().first_token_us.is_some());
        let mut on_busy = 0;
        let mut ids = Vec::new();
        for i in 0..4u64 {
            let spec = RequestSpec::new(tokens(100 + i, 64), 8).worker(2 + (i as usize % 2));
            ids.push(h.send(&spec).unwrap());
        }
        for id in &ids {
            let r = h.record(*id).unwrap();
            assert!(!r.fallback, "{r:?}");
            on_busy += (r.replica == Some(busy)) as usize;
        }
        if avoids {
            assert_eq!(on_busy, 0, "{mode}: proxy 1 keeps off replica {busy}");
        } else {
            assert!(on_busy >= 1, "{mode}: proxy 1 cannot see proxy 0's decode");
        }
        h.run_until_idle(600_000_000).unwrap();
        assert_clean(&h);
        for p in h.proxies() {
            assert_eq!(
                p.metric("kvsteer_release_anomalies").map_or(0, |m| m.value),
                0
            );
        }
    }
}

/// Per request, requests go to every proxy; per session, each session stays on one proxy.
#[test]
fn requests_spread_across_proxies_per_request_or_per_session() {
    for spread in [ProxySpread::PerRequest, ProxySpread::PerSession] {
        let mut cfg = HarnessConfig::small("kv_load");
        cfg.proxies = 4;
        cfg.workers = 1;
        cfg.proxy_spread = spread;
        let mut h = harness_with(cfg);
        let mut by_session: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
        let mut used = BTreeSet::new();
        for i in 0..48u64 {
            let session = format!("s{}", i % 12);
            let spec = RequestSpec::new(tokens(i, 32), 4).session(&session);
            let id = h.send(&spec).unwrap();
            let p = h.proxy_of_worker(h.record(id).unwrap().worker);
            used.insert(p);
            by_session.entry(session).or_default().insert(p);
        }
        assert_eq!(used.len(), 4, "{spread:?}: every proxy used");
        let sticky = by_session.values().all(|s| s.len() == 1);
        assert_eq!(sticky, spread == ProxySpread::PerSession, "{by_session:?}");
        h.run_until_idle(600_000_000).unwrap();
        assert_clean(&h);
    }
}

/// Requests through proxy 0 and proxy 1 in turn (each prompt its own, nothing cached in common, each
/// run to completion before the next), so every decision is a tie across four idle replicas, settled
/// by the proxy's tie-break generator. Two lone proxies (no node id) are two copies of the same
/// configuration and make the same choices in the same order: the correlation that herds. Two proxies
/// of one fleet have distinct node ids (`proxy-0`, `proxy-1`), which the filter mixes into its
/// tie-break seed, so their choices differ.
#[test]
fn proxies_with_distinct_node_ids_break_ties_differently() {
    const N: u64 = 16;
    let fleet_cfg = |proxies: usize| {
        let mut cfg = HarnessConfig::small("kv_load");
        cfg.replicas = 4;
        cfg.proxies = proxies;
        cfg.workers = 1;
        cfg
    };
    // One proxy's choices, request by request, for prompts drawn from `base`.
    let choose = |h: &mut kvsteer_host_test::Harness, worker: usize, base: u64, i: u64| {
        let id = h
            .send(&RequestSpec::new(tokens(base + i, 64), 4).worker(worker))
            .unwrap();
        h.run_until_idle(600_000_000).unwrap();
        let r = h.record(id).unwrap();
        assert!(!r.fallback, "{r:?}");
        r.replica.unwrap()
    };
    let (mut lone_a, mut lone_b) = (harness_with(fleet_cfg(1)), harness_with(fleet_cfg(1)));
    let mut fleet = harness_with(fleet_cfg(2));
    assert_eq!(fleet.proxy_of_worker(1), 1);
    let (mut a, mut b, mut f0, mut f1) = (vec![], vec![], vec![], vec![]);
    for i in 0..N {
        a.push(choose(&mut lone_a, 0, 1_000, i));
        b.push(choose(&mut lone_b, 0, 2_000, i));
        f0.push(choose(&mut fleet, 0, 1_000, i));
        f1.push(choose(&mut fleet, 1, 2_000, i));
    }
    assert_eq!(a, b, "same configuration, no node id: the same tie-breaks");
    assert!(
        a.iter().collect::<BTreeSet<_>>().len() > 1,
        "ties are broken at random, not always the same way: {a:?}"
    );
    let same = f0.iter().zip(&f1).filter(|(x, y)| x == y).count();
    // Independent uniform choices over 4 replicas agree 4 times in 16 on average; all 16 agree with
    // probability 4^-16.
    assert!(
        same < N as usize,
        "distinct node ids, yet the same choices: {f0:?} {f1:?}"
    );
    for h in [&lone_a, &lone_b, &fleet] {
        assert_clean(h);
    }
}
