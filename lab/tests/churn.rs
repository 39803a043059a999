//! A replay while the discovery source adds and removes members at a fixed schedule
//! (`bench::churn`, docs/reports/fleet.md "Churn"), through the compiled filter: no request fails
//! or falls back, a removed member gets no request issued after its removal has had a poll to
//! reach the filter, the requests it had in flight finish on it, and joiners are routed to.

mod common;
use common::*;
use kvsteer_lab::bench::churn::{self, REMOVAL_GRACE_US};
use std::path::Path;

/// Seconds of arrivals: the schedule's changes at 2, 4 and 8 s, about 550 requests.
const SPAN_S: u64 = 10;

fn check(policy: &str, joiners_routed: bool) {
    let cells = churn::cells(SPAN_S);
    let c = &cells[0];
    let (m, mut h) = churn::replay(module(), Path::new("traces"), c, policy, 1, false)
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        m.base.requests_per_replica.iter().sum::<u64>() > 300,
        "{m:?}"
    );
    assert_eq!(m.base.failed, 0, "{policy}: failed requests");
    assert_eq!(m.fallbacks, 0, "{policy}: requests not routed");
    for r in h.records() {
        assert!(
            r.finished_us.is_some() && !r.failed && r.completion_tokens > 0,
            "{policy}: {r:?}"
        );
    }
    let removals = c.removals();
    assert_eq!(removals.len(), 6);
    let mut drained_in_flight = 0;
    for &(gone, at) in &removals {
        for r in h.records().filter(|r| r.replica == Some(gone)) {
            assert!(
                r.issued_us < at + REMOVAL_GRACE_US,
                "{policy}: member {gone} removed at {at} us got request {} issued at {} us",
                r.id,
                r.issued_us
            );
            // Requests in flight when their member left finish there.
            if r.issued_us < at && r.finished_us.unwrap_or(0) > at {
                drained_in_flight += 1;
            }
        }
    }
    assert_eq!(m.late_on_removed, 0, "{policy}");
    if joiners_routed {
        for r in [8, 9, 10, 11, 12, 13] {
            assert!(
                m.base.requests_per_replica[r] > 0,
                "{policy}: joiner {r} got nothing: {:?}",
                m.base.requests_per_replica
            );
        }
        assert!(
            drained_in_flight > 0,
            "{policy}: no request was in flight on a member when it left"
        );
    }
    // Every booking was released (the drained members' included), none dropped with a slot.
    h.run_for(2 * churn::PERIOD_MS * 1000).unwrap();
    let metric = |n: &str| h.proxy().metric(n).map_or(0, |m| m.value);
    assert_eq!(metric("kvsteer_discovery_dropped_bookings"), 0, "{policy}");
    assert_eq!(
        metric("kvsteer_bookings"),
        metric("kvsteer_releases"),
        "{policy}: load leaked"
    );
    assert!(metric("kvsteer_discovery_left") >= 6, "{policy}");
    assert_clean(&h);
}

#[test]
fn round_robin_drains_removed_members_and_routes_to_joiners() {
    check("round_robin", true);
}

#[test]
fn kv_time_replay_with_churn_has_no_failures_and_nothing_new_on_removed_members() {
    check("kv_time", false);
}
