//! nginx mode (ngx_wasm_module semantics, as measured in a real nginx 1.22.1 with the module at
//! 3bed2783): request headers in the rewrite phase without end of stream, a paused request parked
//! there for good, the body handed over whole with end of stream, callouts to addresses, the choice
//! written to an nginx variable, shared data under the module's CAS rule (no token writes only a new
//! key) and eviction, and the connection of every callout a tick dispatches but the last left open.

mod common;
use common::*;
use kvsteer_host_test::host::NginxLimits;
use kvsteer_host_test::{FeedFault, HarnessConfig, HostMode, Output, RequestSpec};

const IDLE: u64 = 600_000_000;

fn nginx(policy: &str) -> HarnessConfig {
    let mut cfg = HarnessConfig::small(policy);
    cfg.mode = HostMode::Nginx;
    cfg.output = Output::NginxVariable;
    cfg
}

#[test]
fn nginx_mode_sets_the_variable_and_polls_addresses() {
    let mut h = harness_with(nginx("kv_load"));
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

/// The module parks a request whose headers callback paused until the filter resumes it, and reads
/// the body only after that phase: the filter must let the headers through and route on the body.
#[test]
fn requests_are_not_parked_in_the_headers() {
    let mut h = harness_with(nginx("kv_load"));
    let mut ids = Vec::new();
    for i in 0..8u64 {
        ids.push(h.send(&RequestSpec::new(tokens(300 + i, 600), 4)).unwrap());
    }
    // A request the filter paused for good is reported as stuck here.
    h.run_until_idle(IDLE).unwrap();
    for id in ids {
        let r = h.record(id).unwrap();
        assert!(r.released && !r.fallback && !r.failed, "{r:?}");
        assert!(r.finished_us.is_some(), "{r:?}");
    }
    for w in h.workers() {
        assert!(
            w.logs().iter().all(|l| !l.message.contains("resume")),
            "nothing to resume"
        );
    }
    assert_clean(&h);
}

/// Each worker learns the other's polls through the relay ring in shared data, whose slots are
/// written again and again: under the module's CAS rule a write without a token would land once and
/// never again, and the followers would stop learning after the ring's first lap.
#[test]
fn workers_share_the_index_across_laps_of_the_relay_ring() {
    let mut h = harness_with(nginx("kv_affinity"));
    // Several laps of the 8-slot ring on every replica.
    h.run_for(6_000_000).unwrap();
    let mut wrong = Vec::new();
    for doc in 0..6u64 {
        let prefix = tokens(700 + doc, 2048);
        let id = h
            .send(&RequestSpec::new(prefix.clone(), 4).worker((doc % 2) as usize))
            .unwrap();
        h.run_until_idle(IDLE).unwrap();
        h.run_for(1_500_000).unwrap();
        let home = h.record(id).unwrap().replica.unwrap();
        for w in 0..2 {
            let id = h
                .send(&RequestSpec::new(extend(&prefix, 800 + doc, 64), 4).worker(w))
                .unwrap();
            h.run_until_idle(IDLE).unwrap();
            let r = h.record(id).unwrap();
            if r.replica != Some(home) {
                wrong.push((doc, w, home, r.replica));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "follow-ups not sent to the replica holding their prefix (doc, worker, home, chosen): {wrong:?}"
    );
    assert_clean(&h);
}

/// Load shared between workers (`check_workers_see_each_others_load`) under the module's shared
/// data rules, after two seconds of feed polls.
#[test]
fn workers_see_each_others_load() {
    check_workers_see_each_others_load(nginx, 2_000_000);
}

/// Feed polling for 20 minutes (virtual) at the shipped tick: the module leaves open the connection
/// of every callout a tick sends but the last, so a filter sending one a tick holds at most one
/// connection per replica it is waiting on, and never runs out of `worker_connections`.
#[test]
fn feed_polling_keeps_no_connections_open() {
    let mut cfg = nginx("kv_load");
    cfg.nginx = NginxLimits {
        worker_connections: 1024,
        ..NginxLimits::default()
    };
    let replicas = cfg.replicas as u64;
    let mut h = harness_with(cfg);
    let minute = 60_000_000;
    let mut polls_before = 0;
    for m in 0..20 {
        if m == 19 {
            polls_before = h.replicas.iter().map(|r| r.polls).sum::<u64>();
        }
        h.run_for(minute).unwrap();
        for w in h.workers() {
            let c = w.callout_connections();
            assert!(
                c.open <= replicas && c.refused == 0,
                "minute {m}, worker {}: {c:?}",
                w.index()
            );
        }
    }
    let polls_last_minute = h.replicas.iter().map(|r| r.polls).sum::<u64>() - polls_before;
    // 4 replicas every 200 ms would be 1,200 polls a minute; two workers sending one a tick (100 ms)
    // each poll every replica at least every 400 ms.
    assert!(polls_last_minute >= 600, "{polls_last_minute}");
    let opened: u64 = h
        .workers()
        .iter()
        .map(|w| w.callout_connections().opened)
        .sum();
    assert!(opened > 10_000, "{opened}");
    for w in h.workers() {
        assert!(
            w.logs().iter().all(|l| !l.message.contains("stale")
                && !l.message.contains("unreachable")
                && !l.message.contains("refused")),
            "worker {}: {:?}",
            w.index(),
            w.logs()
                .iter()
                .filter(|l| l.message.contains("kvsteer:"))
                .take(5)
                .collect::<Vec<_>>()
        );
    }
    // And still routing by prefix after all that.
    let prefix = tokens(77, 2048);
    let id = h.send(&RequestSpec::new(prefix.clone(), 4)).unwrap();
    h.run_until_idle(IDLE).unwrap();
    h.run_for(1_000_000).unwrap();
    let home = h.record(id).unwrap().replica;
    let id = h
        .send(&RequestSpec::new(extend(&prefix, 78, 64), 4))
        .unwrap();
    h.run_until_idle(IDLE).unwrap();
    assert_eq!(h.record(id).unwrap().replica, home);
    assert_clean(&h);
}

/// A slow feed (answers after 2.5 ticks): the module keeps the connection of a callout answered
/// while another of the worker's is still out, so the filter must not send one then.
#[test]
fn a_slow_feed_keeps_no_connections_open() {
    let mut h = harness_with(nginx("kv_load"));
    h.replicas[2].feed_fault = FeedFault::Slow { delay_us: 250_000 };
    let replicas = h.replicas.len() as u64;
    h.run_for(120_000_000).unwrap();
    for w in h.workers() {
        let c = w.callout_connections();
        assert!(
            c.open <= replicas && c.refused == 0,
            "worker {}: {c:?}",
            w.index()
        );
    }
    let opened: u64 = h
        .workers()
        .iter()
        .map(|w| w.callout_connections().opened)
        .sum();
    assert!(opened > 300, "{opened}");
    for w in h.workers() {
        assert!(
            w.logs().iter().all(|l| !l.message.contains("stale")),
            "worker {}: the other feeds are polled in time",
            w.index()
        );
    }
    assert_clean(&h);
}

/// A replica whose feed never answers (each poll times out), at the shipped nginx settings: while
/// its poll is out no other is sent, and the other feeds must still be polled often enough not to
/// go stale.
#[test]
fn a_hung_feed_does_not_make_the_others_stale() {
    let mut cfg = nginx("kv_load");
    cfg.filter_extra
        .insert("feed_timeout_ms".into(), serde_json::json!(400));
    let mut h = harness_with(cfg);
    h.replicas[2].feed_fault = FeedFault::Timeout;
    h.run_for(120_000_000).unwrap();
    for w in h.workers() {
        let c = w.callout_connections();
        assert!(c.open <= 1 && c.refused == 0, "worker {}: {c:?}", w.index());
        let stale: Vec<_> = w
            .logs()
            .iter()
            .filter(|l| {
                (l.message.contains("is stale") || l.message.contains("lately"))
                    && !l.message.contains(" r2")
            })
            .map(|l| l.message.clone())
            .collect();
        assert!(stale.is_empty(), "worker {}: {stale:?}", w.index());
    }
    assert_clean(&h);
}

/// A zone too small for the filter's records: the module evicts the least recently used entries
/// of the written entry's size class. The filter must survive losing any record (a lease, a relay
/// slot or head, a worker's load) and keep routing.
#[test]
fn a_full_shm_zone_evicts_and_the_filter_keeps_routing() {
    let mut cfg = nginx("kv_affinity");
    cfg.nginx = NginxLimits {
        shm_kv_bytes: 8 << 10,
        ..NginxLimits::default()
    };
    let mut h = harness_with(cfg);
    h.run_for(3_000_000).unwrap();
    let mut homes = Vec::new();
    for doc in 0..4u64 {
        let prefix = tokens(900 + doc, 2048);
        let id = h
            .send(&RequestSpec::new(prefix.clone(), 4).worker(0))
            .unwrap();
        h.run_until_idle(IDLE).unwrap();
        h.run_for(1_000_000).unwrap();
        homes.push((prefix, h.record(id).unwrap().replica.unwrap()));
    }
    assert!(
        h.proxy().shm_evictions() > 0,
        "the zone filled up: {} entries",
        h.proxy().shared_data_keys().len()
    );
    for (doc, (prefix, home)) in homes.iter().enumerate() {
        let id = h
            .send(&RequestSpec::new(extend(prefix, 950 + doc as u64, 64), 4).worker(0))
            .unwrap();
        h.run_until_idle(IDLE).unwrap();
        let r = h.record(id).unwrap();
        assert!(!r.failed && !r.fallback, "{r:?}");
        assert_eq!(r.replica, Some(*home), "worker 0 routed doc {doc} itself");
    }
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
