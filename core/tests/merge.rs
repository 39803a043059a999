//! `load.reported_load = merge`: a replica's report plus this proxy's bookings since the poll that
//! produced it, each counted once (docs/design/design.md, "Many proxies").

use kvsteer_core::config::{KvLoadParams, LoadParams, ReportedLoad};
use kvsteer_core::feed::{FeedBatch, ReplicaLoad};
use kvsteer_core::{LoadTotals, PolicyKind, RouteRequest, Router, RoutingConfig};

fn cfg(mode: ReportedLoad) -> RoutingConfig {
    RoutingConfig {
        policy: PolicyKind::KvLoad,
        block_size: 4,
        kv_load: KvLoadParams {
            prefill_scale: 1.0,
            overlap_credit: 1.0,
            queue_weight: 1.0,
            time_cost: false,
            ..KvLoadParams::default()
        },
        load: LoadParams {
            reported_load: mode,
            ..LoadParams::default()
        },
        ..RoutingConfig::default()
    }
}

fn body(tokens: &[u32]) -> Vec<u8> {
    format!("{{\"model\":\"m\",\"prompt\":{tokens:?},\"max_tokens\":8}}").into_bytes()
}

fn req(r: &Router, tokens: &[u32]) -> RouteRequest {
    r.read_request("/v1/completions", &body(tokens), None)
        .unwrap()
}

/// An incremental batch with no events carrying `load` (resync first so the cursor accepts it).
fn report(load: ReplicaLoad) -> FeedBatch {
    FeedBatch {
        epoch: 1,
        resync: true,
        more: false,
        first_seq: 0,
        next_seq: 0,
        load: ReplicaLoad {
            block_size: 4,
            ..load
        },
        events: Vec::new(),
    }
}

fn load(prefill: u64, decode: u64, running: u32) -> ReplicaLoad {
    ReplicaLoad {
        running,
        prefill_tokens: prefill,
        decode_blocks: decode,
        ..ReplicaLoad::default()
    }
}

fn totals(prefill: u64, decode: u64, active: u32) -> LoadTotals {
    LoadTotals {
        prefill_tokens: prefill,
        decode_blocks: decode,
        active_requests: active,
    }
}

/// Admits `tokens` on `replica` at `t` (forcing the replica).
fn admit_on(r: &mut Router, id: u64, replica: usize, tokens: &[u32], t: u64) {
    let q = req(r, tokens);
    let d = kvsteer_core::Decision {
        replica,
        ..r.route(&q, t)
    };
    r.admit(id, &q, &d, t);
}

#[test]
fn a_request_admitted_before_the_poll_counts_once_and_one_after_it_is_added() {
    let mut r = Router::new(cfg(ReportedLoad::Merge), 2).unwrap();
    let a: Vec<u32> = (0..40).collect(); // 10 blocks
    admit_on(&mut r, 1, 0, &a, 100);
    // The poll goes out at 200 and the replica reports request 1 (40 tokens to prefill, 1 running).
    r.accept_feed_polled_at(0, &report(load(40, 0, 1)), 200);
    assert_eq!(
        r.effective_load()[0],
        totals(40, 0, 1),
        "the report alone: request 1 is in it, not counted again"
    );
    // Request 2 is admitted at 250: after the poll, so the report cannot hold it.
    let b: Vec<u32> = (1000..1020).collect(); // 5 blocks
    admit_on(&mut r, 2, 0, &b, 250);
    assert_eq!(r.effective_load()[0], totals(40 + 20, 5, 2));
    // Its first token: its prefill is done, its blocks stay.
    r.first_token(2);
    assert_eq!(r.effective_load()[0], totals(40, 5, 2));
    // Released: nothing of it is left (the report never had it).
    assert!(r.release(2));
    assert_eq!(r.effective_load()[0], totals(40, 0, 1));
    // The next report, polled at 300, is the replica's word for everything before 300.
    r.accept_feed_polled_at(0, &report(load(0, 10, 1)), 300);
    assert_eq!(r.effective_load()[0], totals(0, 10, 1));
    // The other replica never reported: its own bookings (none) are its load.
    assert_eq!(r.effective_load()[1], LoadTotals::default());
}

#[test]
fn a_request_admitted_while_the_poll_is_in_flight_is_added_to_its_answer() {
    let mut r = Router::new(cfg(ReportedLoad::Merge), 2).unwrap();
    let a: Vec<u32> = (0..40).collect();
    // Poll sent at 200, request admitted at 210, answer applied at 220 (without the request).
    admit_on(&mut r, 1, 0, &a, 210);
    r.accept_feed_polled_at(0, &report(load(0, 3, 1)), 200);
    assert_eq!(r.effective_load()[0], totals(40, 3 + 10, 2));
    // Applied with `accept_feed` (no poll time): the latest time the router saw stands in.
    let mut r2 = Router::new(cfg(ReportedLoad::Merge), 2).unwrap();
    admit_on(&mut r2, 1, 0, &a, 210);
    r2.accept_feed(0, &report(load(40, 0, 1)));
    assert_eq!(r2.report_polled_ms(0), Some(210));
    assert_eq!(
        r2.effective_load()[0],
        totals(40 + 40, 10, 2),
        "a request admitted at the poll's own millisecond is added (never missed)"
    );
}

#[test]
fn recent_blocks_count_whole_per_request_as_the_engine_reports_them() {
    let mut r = Router::new(cfg(ReportedLoad::Merge), 2).unwrap();
    r.accept_feed_polled_at(0, &report(load(0, 0, 0)), 0);
    // Two requests sharing a 6-block prefix: the table books the prefix once (assume_kv_reuse), the
    // engine holds it per sequence, and so does the merge.
    let shared: Vec<u32> = (0..24).collect();
    let mut p1 = shared.clone();
    p1.extend(100..108);
    let mut p2 = shared.clone();
    p2.extend(200..208);
    admit_on(&mut r, 1, 0, &p1, 10);
    admit_on(&mut r, 2, 0, &p2, 10);
    assert_eq!(r.local_load()[0].decode_blocks, 6 + 2 + 2);
    assert_eq!(r.effective_load()[0].decode_blocks, 8 + 8);
    // Generated tokens add a block per block_size.
    r.first_token(1);
    r.decode_progress(1, 9);
    assert_eq!(r.effective_load()[0].decode_blocks, 8 + 2 + 8);
}

#[test]
fn a_request_the_report_holds_is_taken_off_when_it_finishes() {
    let mut r = Router::new(cfg(ReportedLoad::Merge), 2).unwrap();
    let a: Vec<u32> = (0..40).collect(); // 10 blocks
    admit_on(&mut r, 1, 0, &a, 100);
    r.first_token(1);
    // The report holds request 1 (10 blocks) and another proxy's (20 blocks).
    r.accept_feed_polled_at(0, &report(load(0, 30, 2)), 200);
    assert_eq!(r.effective_load()[0], totals(0, 30, 2));
    assert!(r.release(1));
    assert_eq!(r.effective_load()[0], totals(0, 20, 1), "taken off at once");
    assert_eq!(r.local_released_since()[0], totals(0, 10, 1));
    // The next report no longer has it: nothing is taken off twice.
    r.accept_feed_polled_at(0, &report(load(0, 20, 1)), 300);
    assert_eq!(r.effective_load()[0], totals(0, 20, 1));
    assert_eq!(r.local_released_since()[0], LoadTotals::default());
}

#[test]
fn a_stale_or_silent_replica_is_scored_on_own_bookings() {
    let mut r = Router::new(cfg(ReportedLoad::Merge), 2).unwrap();
    let a: Vec<u32> = (0..40).collect();
    admit_on(&mut r, 1, 0, &a, 100);
    assert_eq!(
        r.effective_load()[0],
        r.local_load()[0],
        "no report yet: own bookings"
    );
    r.accept_feed_polled_at(0, &report(load(4000, 500, 30)), 200);
    assert_eq!(r.effective_load()[0], totals(4000, 500, 30));
    r.set_stale(0, true);
    assert_eq!(r.effective_load()[0], r.local_load()[0]);
    r.set_stale(0, false);
    assert_eq!(r.effective_load()[0], totals(4000, 500, 30));
}

#[test]
fn peers_add_their_bookings_since_the_poll_not_their_whole_table() {
    let mut r = Router::new(cfg(ReportedLoad::Merge), 2).unwrap();
    r.accept_feed_polled_at(0, &report(load(100, 20, 3)), 200);
    // A peer worker of this proxy: 3 requests in all on replica 0, one of them since the poll.
    r.set_peer_load(7, &[totals(300, 60, 3), LoadTotals::default()]);
    r.set_peer_load_since(
        7,
        &[totals(50, 4, 1), LoadTotals::default()],
        &[totals(0, 2, 1), LoadTotals::default()],
    );
    assert_eq!(
        r.effective_load()[0],
        totals(150, 24 - 2, 4 - 1),
        "plus the peer's bookings since, minus what it released of the report's"
    );
    // `max` takes the larger of the report and the whole tracked table instead.
    let mut m = Router::new(cfg(ReportedLoad::Max), 2).unwrap();
    m.accept_feed_polled_at(0, &report(load(100, 20, 3)), 200);
    m.set_peer_load(7, &[totals(300, 60, 3), LoadTotals::default()]);
    assert_eq!(m.effective_load()[0], totals(300, 60, 3));
    r.clear_peer(7);
    assert_eq!(r.effective_load()[0], totals(100, 20, 3));
}

/// Two proxies in front of the same two replicas. Proxy A sends a long request to replica 0; the
/// replica's next report carries it; proxy B, which never saw it, then steers away from replica 0
/// under `merge` (and `max`), but not under `ignore`.
#[test]
fn another_proxys_long_request_steers_this_proxy_away_once_reported() {
    let long: Vec<u32> = (5000..5000 + 4096).collect();
    let short: Vec<u32> = (0..32).collect();
    for (mode, avoids) in [
        (ReportedLoad::Merge, true),
        (ReportedLoad::Max, true),
        (ReportedLoad::Ignore, false),
    ] {
        let mut a = Router::new(cfg(mode), 2).unwrap();
        let mut b = Router::new(cfg(mode), 2).unwrap();
        admit_on(&mut a, 1, 0, &long, 0);
        a.first_token(1);
        // Replica 0 decodes it: 1,024 blocks; replica 1 is idle. Both proxies poll both at 200.
        for p in [&mut a, &mut b] {
            p.accept_feed_polled_at(0, &report(load(0, 1024, 1)), 200);
            p.accept_feed_polled_at(1, &report(load(0, 0, 0)), 200);
        }
        let mut on_0 = 0;
        for i in 0..8 {
            let q = req(&b, &short);
            let d = b.route(&q, 300 + i);
            b.admit(100 + i, &q, &d, 300 + i);
            on_0 += (d.replica == 0) as u32;
        }
        if avoids {
            assert_eq!(on_0, 0, "{mode:?}: B avoids the replica A loaded");
        } else {
            assert!(on_0 >= 3, "{mode:?}: B alone balances its own 8: {on_0}");
        }
    }
}

/// `others`: this proxy's own requests by its own bookings, and of the report only what is not this
/// proxy's, so nothing counts twice and one proxy alone scores as `ignore` does.
#[test]
fn others_adds_only_the_part_of_the_report_that_is_not_this_proxys() {
    let mut r = Router::new(cfg(ReportedLoad::Others), 2).unwrap();
    let shared: Vec<u32> = (0..24).collect();
    let mut p1 = shared.clone();
    p1.extend(100..108);
    let mut p2 = shared.clone();
    p2.extend(200..208);
    admit_on(&mut r, 1, 0, &p1, 100);
    admit_on(&mut r, 2, 0, &p2, 100);
    let own = r.local_load()[0];
    assert_eq!(
        own.decode_blocks,
        6 + 2 + 2,
        "the shared prefix booked once"
    );
    // The replica reports exactly these two (32 + 32 tokens to prefill, 8 + 8 blocks, 2 running).
    r.accept_feed_polled_at(0, &report(load(64, 16, 2)), 200);
    assert_eq!(r.local_held()[0], totals(64, 16, 2));
    assert_eq!(
        r.effective_load()[0],
        own,
        "one proxy: the report is all this proxy's, the bookings stand"
    );
    // Another proxy's request in the next report: 40 tokens, 10 blocks, 1 running.
    r.accept_feed_polled_at(0, &report(load(64 + 40, 16 + 10, 3)), 300);
    let mut want = own;
    want.add(&totals(40, 10, 1));
    assert_eq!(r.effective_load()[0], want);
    // This proxy's request 1 ends: off its bookings and off the report's rest at once.
    r.first_token(1);
    r.first_token(2);
    assert!(r.release(1));
    let mut want = r.local_load()[0];
    want.add(&totals(40, 10, 1));
    assert_eq!(r.effective_load()[0], want);
    // A request admitted after the poll is this proxy's bookings alone (the report cannot hold it).
    let c: Vec<u32> = (500..520).collect();
    admit_on(&mut r, 3, 0, &c, 350);
    let mut want = r.local_load()[0];
    want.add(&totals(40, 10, 1));
    assert_eq!(r.effective_load()[0], want);
    // The next report no longer holds request 1, and holds requests 2 and 3 as they are now.
    assert_eq!(r.local_held()[0], totals(64, 16, 2), "as accepted at 300");
    let now = r.local_load()[0];
    r.accept_feed_polled_at(0, &report(load(20 + 40, 8 + 5 + 10, 3)), 400);
    assert_eq!(r.local_held()[0], totals(20, 8 + 5, 2));
    let mut want = now;
    want.add(&totals(40, 10, 1));
    assert_eq!(r.effective_load()[0], want);
    // A peer worker's requests the report holds are taken off it too.
    r.set_peer_load(7, &[totals(0, 6, 1), LoadTotals::default()]);
    r.set_peer_held(7, &[totals(0, 6, 1), LoadTotals::default()]);
    let mut want = r.local_load()[0];
    want.add(&totals(0, 6, 1));
    want.add(&totals(40, 10 - 6, 0));
    assert_eq!(r.effective_load()[0], want);
    // A report below this proxy's own share leaves nothing for the others (never below zero).
    r.accept_feed_polled_at(0, &report(load(0, 0, 0)), 500);
    let mut want = r.local_load()[0];
    want.add(&totals(0, 6, 1));
    assert_eq!(r.effective_load()[0], want);
}
