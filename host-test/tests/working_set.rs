//! The working-set term's gauges through the real `.wasm` (docs/design/design.md section 2.6): an
//! operator checks `kvsteer_cache_size_blocks_<replica>` (the cache size the filter learned from
//! the feed, 0 while unknown) and `kvsteer_working_set_blocks_<replica>` (the recent working set it
//! estimates) to see whether the term is at work. Four replicas of 2,048 KV blocks, two workers;
//! eight sessions ask for the same 2,048-token context four times each, between distinct
//! 4,096-token prompts that push the caches into eviction. The workers of a proxy share their
//! admissions through shared data, so a session whose turns go through different workers is still
//! seen as reused; separate proxies (no shared data) are not.

mod common;
use common::*;
use kvsteer_host_test::{
    CallOutcome, HARNESS_PEER_TOKEN, Harness, HarnessConfig, RequestSpec, pairs,
};
use serde_json::{Value, json};

const REPLICAS: usize = 4;

fn run(routing: Value) -> Harness {
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.routing = routing;
    let mut h = harness_with(cfg);
    let start = h.now_us();
    let mut i = 0u64;
    for round in 0..4u64 {
        let sessions =
            (0..8u64).map(|s| RequestSpec::new(tokens(s, 2_048), 16).session(&format!("s{s}")));
        let distinct =
            (0..8u64).map(|s| RequestSpec::new(tokens(1_000 + round * 8 + s, 4_096), 16));
        for spec in sessions.chain(distinct) {
            h.run_until(start + i * 100_000).unwrap();
            h.send(&spec).unwrap();
            i += 1;
        }
    }
    h.run_until_idle(600_000_000).unwrap();
    h
}

fn gauges(h: &Harness, what: &str) -> Vec<i64> {
    (0..REPLICAS)
        .map(|r| {
            let name = format!("kvsteer_{what}_r{r}");
            h.proxy().metric(&name).map_or(-1, |m| m.value)
        })
        .collect()
}

#[test]
fn the_working_set_gauges_show_the_learned_cache_and_the_working_set() {
    let h = run(json!({"policy": "kv_load", "block_size": 16}));
    assert!(h.records().all(|r| r.released && !r.failed));
    let caps = gauges(&h, "cache_size_blocks");
    let ws = gauges(&h, "working_set_blocks");
    eprintln!("cache sizes {caps:?}, working sets {ws:?}");
    // Every gauge is defined; the caches that evicted have a learned size of at most their 2,048
    // blocks, and at least one did evict.
    assert!(caps.iter().chain(&ws).all(|&v| v >= 0), "{caps:?} {ws:?}");
    assert!(caps.iter().all(|&c| c <= 2_048), "{caps:?}");
    assert!(caps.iter().any(|&c| c > 1_000), "{caps:?}");
    // The sessions' contexts (8 x 128 blocks, asked for four times) are someone's working set.
    assert!(ws.iter().sum::<i64>() >= 128, "{ws:?}");
}

#[test]
fn with_the_term_off_the_working_set_is_zero_and_the_cache_size_still_learned() {
    let h =
        run(json!({"policy": "kv_load", "block_size": 16, "kv_load": {"overflow_weight": 0.0}}));
    let caps = gauges(&h, "cache_size_blocks");
    let ws = gauges(&h, "working_set_blocks");
    assert_eq!(ws, vec![0; REPLICAS]);
    assert!(caps.iter().any(|&c| c > 1_000), "{caps:?}");
}

/// Eight sessions of two 2,048-token turns, the first turn through the first worker and the second
/// through the last one, half a second apart: a worker alone sees each session once.
fn split_sessions(proxies: usize, workers: usize) -> Harness {
    split_sessions_with(proxies, workers, None, |_| {})
}

/// [`split_sessions`] with the working-set exchange's `peers` section (`None`: off), and `setup`
/// run on the harness before any request.
fn split_sessions_with(
    proxies: usize,
    workers: usize,
    peers: Option<Value>,
    setup: impl FnOnce(&mut Harness),
) -> Harness {
    let mut cfg = HarnessConfig::small("kv_load");
    (cfg.proxies, cfg.workers) = (proxies, workers);
    if let Some(p) = peers {
        cfg.filter_extra.insert("peers".into(), p);
    }
    let mut h = harness_with(cfg);
    setup(&mut h);
    let start = h.now_us();
    for s in 0..8u64 {
        for turn in 0..2 {
            h.run_until(start + s * 200_000 + turn as u64 * 500_000)
                .unwrap();
            let spec = RequestSpec::new(tokens(s, 2_048), 16)
                .session(&format!("s{s}"))
                .worker(turn * (proxies * workers - 1));
            h.send(&spec).unwrap();
        }
    }
    h.run_until_idle(600_000_000).unwrap();
    h
}

fn working_set_of(h: &Harness, proxy: usize) -> i64 {
    (0..REPLICAS)
        .map(|r| {
            let name = format!("kvsteer_working_set_blocks_r{r}");
            h.proxies()[proxy].metric(&name).map_or(0, |m| m.value)
        })
        .sum()
}

#[test]
fn the_workers_of_a_proxy_share_what_they_admitted() {
    let shared = split_sessions(1, 2);
    assert!(shared.records().all(|r| r.released && !r.failed));
    // Each session's context (128 blocks) was asked for twice, through two workers.
    let ws = working_set_of(&shared, 0);
    assert!(ws >= 8 * 128 * 3 / 4, "{ws}");
    // The same traffic through two proxies of one worker each: neither sees any reuse.
    let apart = split_sessions(2, 1);
    assert_eq!(
        (working_set_of(&apart, 0), working_set_of(&apart, 1)),
        (0, 0)
    );
}

fn counter(h: &Harness, proxy: usize, name: &str) -> i64 {
    h.proxies()[proxy].metric(name).map_or(0, |m| m.value)
}

#[test]
fn proxies_exchanging_journals_see_sessions_whose_turns_they_split() {
    // Two proxies of one worker each, every session's first turn through proxy 0 and its second
    // through proxy 1: with the exchange on, both see the reuse that one proxy alone would.
    let h = split_sessions_with(2, 1, Some(json!("on")), |_| {});
    assert!(h.records().all(|r| r.released && !r.failed));
    let (a, b) = (working_set_of(&h, 0), working_set_of(&h, 1));
    assert!(a >= 8 * 128 * 3 / 4 && b >= 8 * 128 * 3 / 4, "{a} {b}");
    assert!(counter(&h, 0, "kvsteer_peer_entries_applied") > 0);
    assert!(counter(&h, 1, "kvsteer_peer_entries_applied") > 0);
    assert_eq!(counter(&h, 0, "kvsteer_peer_answers_refused"), 0);
    assert_eq!(h.stats.peer_polls_forwarded, 0);
    assert!(h.stats.peer_polls > 0);
    // The same with two workers per proxy: each proxy's answer carries both its workers' journals.
    let h = split_sessions_with(2, 2, Some(json!("on")), |_| {});
    assert!(
        working_set_of(&h, 1) >= 8 * 128 * 3 / 4,
        "{}",
        working_set_of(&h, 1)
    );
}

#[test]
fn a_hostile_peer_answer_is_refused_whole_and_counted() {
    // Proxy 1's answers are garbage, a bundle tag followed by nonsense, or a page over the cap:
    // proxy 0 applies nothing from it and counts each refusal; nothing traps.
    let faults = [
        CallOutcome::ok(200, "text/html", b"<html>hello</html>".to_vec()),
        CallOutcome::ok(200, "application/x-kvsteer-working-set", {
            let mut b = b"kvW1".to_vec();
            b.extend_from_slice(&u32::MAX.to_le_bytes());
            b.extend_from_slice(&[0xff; 64]);
            b
        }),
        CallOutcome::ok(200, "text/plain", vec![b'x'; 2 << 20]),
    ];
    for fault in faults {
        let peers = json!({"max_response_bytes": 1 << 20});
        let h = split_sessions_with(2, 1, Some(peers), |h| h.set_peer_fault(1, Some(fault)));
        assert!(h.records().all(|r| r.released && !r.failed));
        assert!(counter(&h, 0, "kvsteer_peer_answers_refused") > 0);
        assert_eq!(counter(&h, 0, "kvsteer_peer_entries_applied"), 0);
        // Proxy 0 saw each session once: no reuse, no working set, as without the exchange.
        assert_eq!(working_set_of(&h, 0), 0);
        // Proxy 1 (whose own answers are fine) still learns proxy 0's first turns.
        assert!(working_set_of(&h, 1) > 0);
    }
}

#[test]
fn the_reserved_path_is_served_only_with_the_token_and_never_forwarded() {
    let mut h = split_sessions_with(2, 1, Some(json!("on")), |_| {});
    let get = |path: &str, token: Option<&str>| {
        let mut v = vec![(":method", "GET"), (":path", path), (":authority", "x")];
        if let Some(t) = token {
            v.push(("x-kvsteer-peer-token", t));
        }
        pairs(&v)
    };
    let path = "/.kvsteer/working-set?after=";
    for (headers, status) in [
        (get(path, None), 403),
        (get(path, Some("wrong-token-0123456789")), 403),
        (get("/.kvsteer/working-set", Some("x")), 403),
        (
            get("/.kvsteer/working-set?after=zz", Some(HARNESS_PEER_TOKEN)),
            400,
        ),
        (get(path, Some(HARNESS_PEER_TOKEN)), 200),
    ] {
        let st = h.request_through(0, headers).unwrap().unwrap();
        assert!(!st.released, "never forwarded");
        assert_eq!(st.local_response.as_ref().map(|r| r.status), Some(status));
        if status != 200 {
            assert!(st.local_response.unwrap().body.len() < 64, "no journal");
        } else {
            assert!(st.local_response.unwrap().body.len() > 8, "the journal");
        }
    }
    // Counters are brought up to date on the next tick.
    h.run_for(200_000).unwrap();
    assert_eq!(counter(&h, 0, "kvsteer_peer_requests_refused"), 4);
    // A POST with the token is refused too; without the exchange the path is still not forwarded.
    let mut post = get(path, Some(HARNESS_PEER_TOKEN));
    post[0].1 = b"POST".to_vec();
    let st = h.request_through(0, post).unwrap().unwrap();
    assert_eq!(st.local_response.map(|r| r.status), Some(405));
    let mut off = split_sessions(1, 1);
    let st = off
        .request_through(0, get(path, Some(HARNESS_PEER_TOKEN)))
        .unwrap()
        .unwrap();
    assert!(!st.released);
    assert_eq!(st.local_response.map(|r| r.status), Some(404));
}
