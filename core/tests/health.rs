//! Health from completions through the Router (docs/design/design.md section 2.5): every policy
//! stops choosing a replica whose requests fail, except for one probe per interval, and takes it
//! back once its probes succeed.

use kvsteer_core::health::Outcome;
use kvsteer_core::{PolicyKind, Router, RoutingConfig};

fn body(tokens: &[u32]) -> Vec<u8> {
    format!("{{\"model\":\"m\",\"prompt\":{tokens:?},\"max_tokens\":8}}").into_bytes()
}

fn router(policy: PolicyKind) -> Router {
    let cfg = RoutingConfig {
        policy,
        block_size: 4,
        ..RoutingConfig::default()
    };
    Router::new(cfg, 4).unwrap()
}

/// Routes one request at `now` (session `s`), releases it at once, reports its outcome: failures on
/// `bad`, successes elsewhere. Returns the decision's replica and whether it was a probe.
fn one(r: &mut Router, id: u64, now: u64, bad: Option<usize>) -> (usize, bool) {
    // Distinct prompts: no policy sticks to a replica for its cache or prefix.
    let prompt: Vec<u32> = (0..32).map(|i| id as u32 * 100 + i).collect();
    let session = format!("s{}", id % 13);
    let req = r
        .read_request("/v1/completions", &body(&prompt), Some(&session))
        .unwrap();
    let d = r.route_and_admit(id, &req, now);
    assert!(r.release(id));
    let outcome = if Some(d.replica) == bad {
        Outcome::Failure
    } else {
        Outcome::Success
    };
    r.record_outcome(d.replica, outcome, now);
    if d.probe {
        assert_ne!(d.backup, Some(d.replica), "a probe's backup is elsewhere");
        assert!(d.backup.is_some());
    }
    (d.replica, d.probe)
}

#[test]
fn every_policy_sheds_a_failing_replica_then_takes_it_back() {
    for policy in PolicyKind::ALL {
        let mut r = router(policy);
        // 50 requests a second. Replica 1 fails everything for 20 s, then recovers.
        let mut to_bad = [0u32; 2];
        let mut requests = [0u32; 2];
        let mut probes = 0;
        let mut restored_at = None;
        for i in 0..3_000u64 {
            let now = i * 20;
            let failing = now < 20_000;
            let (rep, probe) = one(&mut r, i, now, failing.then_some(1));
            // Share in the second half of the failing period, and 30 s after recovery.
            let window = match now {
                10_000..20_000 => Some(0),
                50_000.. => Some(1),
                _ => None,
            };
            if let Some(w) = window {
                requests[w] += 1;
                to_bad[w] += (rep == 1) as u32;
            }
            probes += (probe && failing) as u32;
            if !failing && restored_at.is_none() && !r.is_ejected(1) {
                restored_at = Some(now);
            }
        }
        let failing_share = to_bad[0] as f64 / requests[0] as f64;
        assert!(
            failing_share < 0.05,
            "{policy:?}: failing replica got {failing_share:.3} of requests 10-20 s in"
        );
        assert!(
            to_bad[0] >= 8,
            "{policy:?}: probes went out ({to_bad:?}, {probes})"
        );
        let restored_at = restored_at.unwrap_or_else(|| panic!("{policy:?}: never restored"));
        assert!(
            restored_at - 20_000 <= 30_000,
            "{policy:?}: restored {} ms after recovery",
            restored_at - 20_000
        );
        let recovered_share = to_bad[1] as f64 / requests[1] as f64;
        assert!(
            recovered_share > 0.10,
            "{policy:?}: recovered replica got {recovered_share:.3}"
        );
    }
}

#[test]
fn with_every_replica_failing_routing_goes_on_and_a_dead_one_stays_avoided() {
    let mut r = router(PolicyKind::LeastLoad);
    for rep in 0..4 {
        for t in 0..3 {
            r.record_outcome(rep, Outcome::Failure, t);
        }
    }
    r.set_down(3, true);
    let mut seen = [0u32; 4];
    for i in 0..200u64 {
        let req = r
            .read_request("/v1/completions", &body(&[1, 2, 3, 4]), None)
            .unwrap();
        let d = r.route_and_admit(i, &req, 10);
        assert!(r.release(i));
        seen[d.replica] += 1;
    }
    assert_eq!(seen[3], 0, "down beats ejected: {seen:?}");
    assert!(seen[..3].iter().all(|&n| n > 20), "{seen:?}");
}

#[test]
fn an_ejected_replica_is_avoided_by_the_fallback_and_as_a_backup() {
    let mut r = router(PolicyKind::KvLoad);
    for t in 0..3 {
        r.record_outcome(2, Outcome::Failure, t);
    }
    assert!(r.is_ejected(2));
    for i in 0..100u64 {
        let d = r.route_unread(i, 400, 10);
        assert_ne!(d.replica, 2);
        assert_ne!(d.backup, Some(2));
        assert!(!d.probe);
        assert!(r.release(i));
    }
    // Out of range: ignored, counted.
    r.record_outcome(9, Outcome::Failure, 0);
    assert_eq!(r.stats().bad_replica, 1);
}

#[test]
fn health_shared_by_peers_ejects_on_their_word() {
    let mut a = router(PolicyKind::RoundRobin);
    let mut b = router(PolicyKind::RoundRobin);
    for t in 0..3 {
        b.record_outcome(0, Outcome::Failure, t);
    }
    assert!(b.is_ejected(0) && !a.is_ejected(0));
    a.set_peer_health(1, 3, &b.local_health(3));
    a.refresh_health(3);
    assert!(a.is_ejected(0));
    // A peer that went away leaves it ejected: only successes (probes) restore a replica.
    a.clear_peer_health(1);
    a.refresh_health(3);
    assert!(a.is_ejected(0));
    a.record_outcome(0, kvsteer_core::health::Outcome::Success, 4);
    assert!(!a.is_ejected(0));
}
