//! Feed work bounded whatever a replica sends, through the compiled filter: a huge valid
//! snapshot on every poll is applied in slices across ticks while requests keep flowing, one
//! replica's flood does not evict the others' blocks, an oversized answer is refused unread, and a
//! slow or timed-out feed makes a replica stale, never down.

mod common;
use common::*;
use kvsteer_host_test::{FeedFault, Harness, HarnessConfig, RequestSpec, flood_hash};
use serde_json::json;

const IDLE: u64 = 600_000_000;
/// The slow machine of the time-budget test.
const NS_PER_FUEL: u64 = 1;

fn metric(h: &Harness, name: &str) -> i64 {
    h.proxy().metric(name).map_or(0, |m| m.value)
}

/// One worker (gauges are then this worker's), 4 replicas, `policy`, extra plugin fields.
fn one_worker(policy: &str, extra: serde_json::Value) -> Harness {
    let mut cfg = HarnessConfig::small(policy);
    cfg.workers = 1;
    if let serde_json::Value::Object(m) = extra {
        cfg.filter_extra = m;
    }
    harness_with(cfg)
}

#[test]
fn a_huge_snapshot_every_poll_is_applied_in_slices_and_requests_keep_flowing() {
    let mut h = one_worker(
        "kv_affinity",
        json!({"feed_apply_blocks_per_tick": 8192, "routing": {"policy": "kv_affinity", "block_size": 16, "index_capacity_blocks": 2000000}}),
    );
    let prefix = tokens(5, 2048);
    let id = h.send(&RequestSpec::new(prefix.clone(), 8)).unwrap();
    h.run_until_idle(IDLE).unwrap();
    h.run_for(1_000_000).unwrap();
    let home = h.record(id).unwrap().replica.unwrap();
    let flooder = (home + 1) % 4;
    // 200,000 blocks (1.6 MB) on every poll: 25 ticks of 8,192 each.
    h.set_feed_fault(flooder, FeedFault::Snapshot { blocks: 200_000 });
    let before = metric(&h, "kvsteer_index_blocks");
    let mut peak_pending = 0;
    let mut ids = Vec::new();
    let mut last = before;
    let mut peak = before;
    for step in 0..40u64 {
        h.run_for(100_000).unwrap();
        let blocks = metric(&h, "kvsteer_index_blocks");
        // One budget per tick window, whatever arrived. The gauge is written at the end of a tick,
        // and an answer arriving after it may spend what was left of that tick's budget, so two
        // readings 100 ms apart differ by at most two budgets.
        assert!(
            blocks - last <= 2 * 8192,
            "step {step}: {last} -> {blocks} blocks in one tick"
        );
        assert!(blocks - before <= 8192 * (step as i64 + 2), "step {step}");
        last = blocks;
        peak = peak.max(blocks);
        peak_pending = peak_pending.max(metric(&h, "kvsteer_feed_pending_blocks"));
        // Requests sent meanwhile are routed at once, by the prefix, as before the flood.
        let id = h
            .send(&RequestSpec::new(extend(&prefix, 100 + step, 32), 4))
            .unwrap();
        let r = h.record(id).unwrap();
        assert!(r.released && !r.fallback, "step {step}: {r:?}");
        ids.push(id);
    }
    h.run_until_idle(IDLE).unwrap();
    assert!(
        peak_pending > 100_000,
        "the snapshot waited in slices: {peak_pending}"
    );
    for id in &ids {
        let r = h.record(*id).unwrap();
        assert_eq!(r.replica, Some(home), "{r:?}");
        assert!(!r.failed);
    }
    // The flood got applied (its replica is not stale) and polled again after each one finished.
    assert_eq!(metric(&h, &format!("kvsteer_feed_stale_r{flooder}")), 0);
    assert!(h.replicas[flooder].polls >= 2);
    // Whole snapshots got applied (each poll's snapshot replaces the last one, from empty).
    assert!(peak - before >= 190_000, "{before} -> {peak}");
    assert_clean(&h);
}

/// Index growth per 100 ms tick while replica 1 answers every poll with a 20,000-block snapshot, on
/// a proxy whose clock advances `ns_per_fuel` per unit of work inside a callback (a slow machine),
/// with `feed_apply_us_per_tick` = `us`: (growth per tick, the most blocks the index held above its
/// start, slices cut by the time budget). Requests sent meanwhile must all be routed.
fn flood_on_a_slow_clock(ns_per_fuel: u64, us: u32, ticks: u64) -> (Vec<i64>, i64, i64) {
    let mut cfg = HarnessConfig::small("kv_affinity");
    cfg.workers = 1;
    cfg.clock_ns_per_fuel = ns_per_fuel;
    if let serde_json::Value::Object(m) = json!({
        "feed_apply_blocks_per_tick": 8192,
        "feed_apply_us_per_tick": us,
        "routing": {"policy": "kv_affinity", "block_size": 16, "index_capacity_blocks": 2000000}
    }) {
        cfg.filter_extra = m;
    }
    let mut h = harness_with(cfg);
    h.set_feed_fault(1, FeedFault::Snapshot { blocks: 20_000 });
    let before = metric(&h, "kvsteer_index_blocks");
    let mut last = before;
    let mut growth = Vec::new();
    let mut peak = 0;
    for step in 0..ticks {
        h.run_for(100_000).unwrap();
        let blocks = metric(&h, "kvsteer_index_blocks");
        growth.push(blocks - last);
        last = blocks;
        peak = peak.max(blocks - before);
        let id = h
            .send(&RequestSpec::new(tokens(900 + step, 256), 4))
            .unwrap();
        let r = h.record(id).unwrap();
        assert!(r.released && !r.fallback, "step {step}: {r:?}");
    }
    h.run_until_idle(IDLE).unwrap();
    assert_clean(&h);
    (growth, peak, metric(&h, "kvsteer_feed_apply_time_cuts"))
}

#[test]
fn on_a_slow_machine_feed_slices_stop_at_their_time_budget_and_still_finish() {
    // Control: the same slow clock (applying a block costs about 0.5 us of it) without the time
    // bound: whole block budgets of 8,192 a tick, about 4 ms of the worker's clock each.
    let (growth, _, cuts) = flood_on_a_slow_clock(NS_PER_FUEL, 0, 12);
    assert!(growth.iter().any(|&g| g >= 8192), "{growth:?}");
    assert_eq!(cuts, 0);
    // The shipped 500 us a tick: about 1,000 blocks a tick (a tick's slices, plus an answer's first
    // slice when one arrives between ticks), whole snapshots still applied one after another.
    let (growth, peak, cuts) = flood_on_a_slow_clock(NS_PER_FUEL, 500, 40);
    assert!(
        growth.iter().all(|&g| g <= 2048),
        "a tick overran its time budget: {growth:?}"
    );
    assert!(cuts >= 20, "{cuts} slices cut by the clock");
    // Progress every tick (at least the first slice of 256), and the snapshot completed: the index
    // held all 20,000 blocks, then the next snapshot replaced them (a drop).
    assert!(
        growth.iter().filter(|&&g| g >= 0).all(|&g| g >= 256),
        "{growth:?}"
    );
    assert!(peak >= 20_000, "{peak}");
    assert!(growth.iter().any(|&g| g < 0), "{growth:?}");
}

#[test]
fn one_replica_flooding_the_index_does_not_evict_another_replicas_prefix() {
    // Cap 40,000 blocks over 4 replicas: 10,000 each. Replica `flooder` reports 200,000.
    let mut h = one_worker(
        "kv_affinity",
        json!({"routing": {"policy": "kv_affinity", "block_size": 16, "index_capacity_blocks": 40000}}),
    );
    let prefix = tokens(21, 4096);
    let id = h.send(&RequestSpec::new(prefix.clone(), 8)).unwrap();
    h.run_until_idle(IDLE).unwrap();
    h.run_for(1_000_000).unwrap();
    let home = h.record(id).unwrap().replica.unwrap();
    let flooder = (home + 2) % 4;
    h.set_feed_fault(flooder, FeedFault::Snapshot { blocks: 200_000 });
    h.run_for(10_000_000).unwrap();
    assert!(metric(&h, "kvsteer_index_evictions") > 100_000);
    assert!(metric(&h, "kvsteer_index_blocks") <= 40_000);
    for q in 0..4u64 {
        let id = h
            .send(&RequestSpec::new(extend(&prefix, 700 + q, 32), 8))
            .unwrap();
        h.run_until_idle(IDLE).unwrap();
        let r = h.record(id).unwrap();
        assert_eq!(r.replica, Some(home), "the prefix's holder lost it: {r:?}");
        assert!(r.cached_tokens >= 4096 - 16, "{r:?}");
    }
    assert_clean(&h);
    let _ = flood_hash(flooder, 0);
}

#[test]
fn an_oversized_answer_is_refused_unread_and_the_replica_stays_up() {
    // 64 KiB cap; replica 1 answers 800 KB snapshots.
    let mut h = one_worker("least_load", json!({"feed_max_bytes": 65536}));
    h.set_feed_fault(1, FeedFault::Snapshot { blocks: 100_000 });
    let before = metric(&h, "kvsteer_index_blocks");
    h.run_for(3_000_000).unwrap();
    assert!(metric(&h, "kvsteer_feed_oversized_r1") >= 3);
    assert_eq!(metric(&h, "kvsteer_feed_stale_r1"), 1);
    assert_eq!(
        metric(&h, "kvsteer_down_r1"),
        0,
        "a replica that answers is up"
    );
    assert_eq!(metric(&h, "kvsteer_feed_oversized_r0"), 0);
    assert!(
        metric(&h, "kvsteer_index_blocks") - before < 1000,
        "nothing of it applied"
    );
    // It still gets its share of traffic, by load.
    let ids: Vec<u64> = (0..12u64)
        .map(|i| {
            h.send(&RequestSpec::new(tokens(400 + i, 300), 400))
                .unwrap()
        })
        .collect();
    h.run_until_idle(IDLE).unwrap();
    let on_r1 = ids
        .iter()
        .filter(|id| h.record(**id).unwrap().replica == Some(1))
        .count();
    assert!(
        on_r1 >= 2,
        "{on_r1} of 12 on the replica with the oversized feed"
    );
    // Back to normal answers: fresh again.
    h.set_feed_fault(1, FeedFault::Healthy);
    h.run_for(1_000_000).unwrap();
    assert_eq!(metric(&h, "kvsteer_feed_stale_r1"), 0);
    assert_clean(&h);
}

#[test]
fn a_slow_feed_is_stale_not_down_and_a_reset_one_is_down() {
    let mut h = harness("least_load");
    // r0: never answers within the timeout. r1: answers, slowly (800 ms of a 1,000 ms timeout).
    // r2: connections reset.
    h.set_feed_fault(0, FeedFault::Timeout);
    h.set_feed_fault(1, FeedFault::Slow { delay_us: 800_000 });
    h.set_feed_fault(2, FeedFault::Reset);
    h.run_for(8_000_000).unwrap();
    assert!(metric(&h, "kvsteer_feed_timeouts_r0") >= 3);
    assert_eq!(metric(&h, "kvsteer_feed_stale_r0"), 1);
    assert_eq!(metric(&h, "kvsteer_down_r0"), 0, "slow is not down");
    assert_eq!(metric(&h, "kvsteer_feed_timeouts_r1"), 0);
    assert_eq!(metric(&h, "kvsteer_down_r1"), 0);
    assert_eq!(metric(&h, "kvsteer_down_r2"), 1, "refused or reset is down");
    assert_eq!(metric(&h, "kvsteer_feed_timeouts_r2"), 0);
    let ids: Vec<u64> = (0..16u64)
        .map(|i| {
            h.send(&RequestSpec::new(tokens(600 + i, 300), 400))
                .unwrap()
        })
        .collect();
    h.run_until_idle(IDLE).unwrap();
    let mut per = [0; 4];
    for id in &ids {
        let r = h.record(*id).unwrap();
        assert!(r.released && !r.failed, "{r:?}");
        per[r.replica.unwrap()] += 1;
    }
    assert!(per[0] >= 2, "the slow replica still gets traffic: {per:?}");
    assert_eq!(per[2], 0, "the unreachable one does not: {per:?}");
    assert_clean(&h);
}
