use super::*;

fn health(replicas: usize) -> Health {
    Health::new(HealthParams::default(), replicas)
}

#[test]
fn defaults_validate_and_bad_values_are_refused_by_name() {
    HealthParams::default().validate().unwrap();
    let bad = [
        (
            HealthParams {
                half_life_ms: 0,
                ..Default::default()
            },
            "health.half_life_ms",
        ),
        (
            HealthParams {
                eject_error_rate: f64::NAN,
                ..Default::default()
            },
            "health.eject_error_rate",
        ),
        (
            HealthParams {
                eject_error_rate: 0.0,
                ..Default::default()
            },
            "health.eject_error_rate",
        ),
        (
            HealthParams {
                restore_error_rate: 0.5,
                ..Default::default()
            },
            "health.restore_error_rate",
        ),
        (
            HealthParams {
                min_failures: -1.0,
                ..Default::default()
            },
            "health.min_failures",
        ),
        (
            HealthParams {
                probe_interval_ms: 0,
                ..Default::default()
            },
            "health.probe_interval_ms",
        ),
    ];
    for (p, field) in bad {
        assert_eq!(p.validate().unwrap_err().field, field, "{p:?}");
    }
}

#[test]
fn counts_halve_every_half_life() {
    let c = HealthCounts { ok: 8.0, err: 4.0 };
    let d = c.decayed(5_000, 5_000);
    assert_eq!(HealthParams::default().half_life_ms, 2_000);
    assert!(
        (d.ok - 4.0).abs() < 1e-9 && (d.err - 2.0).abs() < 1e-9,
        "{d:?}"
    );
    let d = c.decayed(15_000, 5_000);
    assert!((d.ok - 1.0).abs() < 1e-9, "{d:?}");
    assert_eq!(c.decayed(0, 5_000), c);
    assert_eq!(c.error_rate(), 4.0 / 12.0);
    assert_eq!(HealthCounts::default().error_rate(), 0.0);
    // Decay keeps the rate.
    assert!((d.error_rate() - c.error_rate()).abs() < 1e-12);
}

#[test]
fn a_replica_failing_every_request_is_ejected_after_min_failures() {
    let mut h = health(3);
    h.record(1, Outcome::Failure, 0);
    h.record(1, Outcome::Failure, 10);
    assert!(!h.is_ejected(1), "two failures are not a trend");
    h.record(1, Outcome::Failure, 20);
    assert!(h.is_ejected(1));
    assert!(!h.is_ejected(0) && !h.is_ejected(2));
    assert_eq!(h.ejections(), &[0, 1, 0]);
    assert_eq!(h.failures(), &[0, 3, 0]);
}

#[test]
fn failures_in_a_row_eject_a_replica_that_was_healthy_for_long() {
    let mut h = health(2);
    // 30 s of successes at 20 a second: about 58 decayed successes.
    let mut t = 0;
    while t < 30_000 {
        h.record(0, Outcome::Success, t);
        t += 50;
    }
    h.record(0, Outcome::Failure, t);
    h.record(0, Outcome::Failure, t + 50);
    assert!(!h.is_ejected(0));
    h.record(0, Outcome::Failure, t + 100);
    assert!(h.is_ejected(0), "three in a row");
    assert!(h.error_rate(0, t + 100) < 0.1, "while its rate is low");
    // Decay alone does not restore it; its first successful probe does (the rate is low).
    h.refresh(t + 60_000);
    assert!(h.is_ejected(0));
    h.record(0, Outcome::Success, t + 60_000);
    assert!(!h.is_ejected(0));
    // Restored by a peer's successes while this worker sent it nothing: its old run of
    // failures does not eject it again.
    let mut p = health(2);
    for t in 0..3 {
        p.record(1, Outcome::Failure, t);
    }
    assert!(p.is_ejected(1));
    p.set_peer(
        5,
        6_000,
        &[HealthCounts::default(), HealthCounts { ok: 20.0, err: 0.0 }],
    );
    p.refresh(6_000);
    assert!(!p.is_ejected(1));
    p.refresh(6_001);
    assert!(
        !p.is_ejected(1),
        "not re-ejected by the run that ejected it"
    );
    // Nor by failures this worker saw while the replica was ejected (its requests in flight
    // when it died, its own failed probes): they came before the success that restored it.
    let mut q = health(2);
    for t in 0..7 {
        q.record(1, Outcome::Failure, t);
    }
    assert!(q.is_ejected(1));
    q.set_peer(
        5,
        30_000,
        &[HealthCounts::default(), HealthCounts { ok: 1.0, err: 0.0 }],
    );
    q.refresh(30_000);
    assert!(!q.is_ejected(1), "restored by the peer's success");
    q.refresh(30_001);
    assert!(
        !q.is_ejected(1),
        "not re-ejected by failures that came before the success"
    );
    q.record(1, Outcome::Failure, 30_002);
    q.record(1, Outcome::Failure, 30_003);
    assert!(!q.is_ejected(1), "a new run counts from the restore");
    q.record(1, Outcome::Failure, 30_004);
    assert!(q.is_ejected(1), "three in a row after it do eject");
    // A success in between resets the run.
    let mut h = Health::new(
        HealthParams {
            min_failures: 100.0,
            ..Default::default()
        },
        1,
    );
    for (i, o) in [
        Outcome::Failure,
        Outcome::Failure,
        Outcome::Success,
        Outcome::Failure,
    ]
    .into_iter()
    .enumerate()
    {
        h.record(0, o, i as u64);
    }
    assert!(!h.is_ejected(0));
    let mut off = Health::new(
        HealthParams {
            consecutive_failures: 0,
            min_failures: 100.0,
            ..Default::default()
        },
        1,
    );
    for t in 0..50 {
        off.record(0, Outcome::Failure, t);
    }
    assert!(!off.is_ejected(0), "0 turns the rule off");
}

#[test]
fn occasional_failures_among_successes_do_not_eject() {
    let mut h = health(2);
    // One request in five fails, 50 requests a second for 20 s.
    for i in 0..1000u64 {
        let o = if i % 5 == 0 {
            Outcome::Failure
        } else {
            Outcome::Success
        };
        h.record(0, o, i * 20);
    }
    assert!(!h.is_ejected(0));
    let rate = h.error_rate(0, 20_000);
    assert!((0.15..0.25).contains(&rate), "{rate}");
}

#[test]
fn probes_are_due_once_per_interval_and_only_for_ejected_replicas() {
    let mut h = health(3);
    assert_eq!(h.take_probe(5_000, |_| true), None, "nothing ejected");
    for t in 0..3 {
        h.record(2, Outcome::Failure, 1_000 + t);
    }
    assert!(h.is_ejected(2));
    assert_eq!(h.take_probe(1_500, |_| true), None, "a full interval first");
    assert_eq!(h.take_probe(2_002, |_| true), Some(2));
    assert_eq!(h.take_probe(2_500, |_| true), None);
    assert_eq!(h.take_probe(3_100, |r| r != 2), None, "not eligible");
    assert_eq!(h.take_probe(3_100, |_| true), Some(2));
    assert_eq!(h.probes(), &[0, 0, 2]);
}

#[test]
fn successful_probes_restore_a_replica_and_decay_alone_does_not() {
    let mut h = health(2);
    // Fails everything for 10 s at 20 requests a second, then is ejected and probed once a
    // second (failing).
    let mut t = 0;
    while !h.is_ejected(1) {
        h.record(1, Outcome::Failure, t);
        t += 50;
    }
    let ejected_at = t;
    while t < 10_000 {
        if h.take_probe(t, |_| true) == Some(1) {
            h.record(1, Outcome::Failure, t);
        }
        t += 50;
    }
    assert!(h.is_ejected(1));
    // An hour without outcomes: still ejected (the rate has not moved).
    h.refresh(3_600_000);
    assert!(h.is_ejected(1));
    assert!(
        ejected_at <= 150,
        "ejected after three failures, at {ejected_at} ms"
    );
    // Recovered: its probes now succeed. Before: 50 failures in 2.5 s (as if several workers
    // had sent it traffic before they heard), then failing probes until 10 s.
    let mut h = health(2);
    let mut t = 0;
    for _ in 0..50 {
        h.record(1, Outcome::Failure, t);
        t += 50;
    }
    while t < 10_000 {
        if h.take_probe(t, |_| true) == Some(1) {
            h.record(1, Outcome::Failure, t);
        }
        t += 50;
    }
    assert!(h.is_ejected(1));
    let recovered_at = t;
    while h.is_ejected(1) {
        assert!(t - recovered_at < 30_000, "not restored within 30 s");
        if h.take_probe(t, |_| true) == Some(1) {
            h.record(1, Outcome::Success, t);
        }
        t += 50;
    }
    let took = t - recovered_at;
    // About 4 decayed failures left at 10 s (half-life 2 s); one success a second restores it
    // once the rate is 0.2: a few seconds, never at the first success.
    assert!((2_000..15_000).contains(&took), "restored after {took} ms");
}

#[test]
fn peers_counts_add_up_and_decay_from_their_publication() {
    let mut a = health(2);
    let mut b = health(2);
    for t in 0..2 {
        a.record(0, Outcome::Failure, t);
        b.record(0, Outcome::Failure, t);
    }
    assert!(!a.is_ejected(0), "two failures each");
    a.set_peer(1, 1, &b.local(1));
    a.refresh(1);
    assert!(a.is_ejected(0), "four together");
    assert!((a.counts(0, 1).err - 4.0).abs() < 1e-2);
    // The peer's record decays from when it was published.
    let later = a.counts(0, 2_001);
    assert!((later.err - 2.0).abs() < 1e-2, "{later:?}");
    a.clear_peer(1);
    assert!((a.counts(0, 1).err - 2.0).abs() < 1e-2);
    // Extra replicas are ignored, missing ones count as none, hostile values clamp.
    a.set_peer(
        2,
        0,
        &[HealthCounts {
            ok: f64::INFINITY,
            err: -5.0,
        }],
    );
    assert_eq!(a.counts(1, 0), HealthCounts::default());
    assert!(a.counts(0, 0).ok <= MAX_COUNT && a.counts(0, 0).err >= 0.0);
    a.set_peer(3, 0, &[HealthCounts::default(); 5]);
}

#[test]
fn a_probe_another_worker_sent_restores_this_one_and_delays_its_own() {
    let mut a = health(2);
    let mut b = health(2);
    for t in 0..3 {
        a.record(1, Outcome::Failure, t);
        b.record(1, Outcome::Failure, t);
    }
    assert!(a.is_ejected(1) && b.is_ejected(1));
    // b's probe is due a second later; a claimed it in shared data at 1,000: b waits.
    assert_eq!(b.probe_due(1_002, |_| true), Some(1));
    b.probed_elsewhere(1, 1_000);
    assert_eq!(b.probe_due(1_500, |_| true), None);
    assert_eq!(b.probe_due(2_000, |_| true), Some(1));
    // a's probe succeeded; b never probed but hears of it through a's record.
    for t in 1..=8 {
        a.record(1, Outcome::Success, t * 1_000);
    }
    assert!(!a.is_ejected(1));
    b.refresh(8_000);
    assert!(b.is_ejected(1), "before it hears of them");
    b.set_peer(0, 8_000, &a.local(8_000));
    b.refresh(8_000);
    assert!(!b.is_ejected(1), "restored on a's successes");
}

#[test]
fn encoding_round_trips_and_refuses_bad_bytes() {
    let v = vec![
        HealthCounts { ok: 1.5, err: 0.0 },
        HealthCounts { ok: 0.0, err: 1e9 },
    ];
    let b = HealthCounts::encode_all(&v);
    assert_eq!(HealthCounts::decode_all(&b), Ok(v));
    for cut in 1..b.len() {
        if !cut.is_multiple_of(HealthCounts::LEN) {
            assert!(HealthCounts::decode_all(&b[..cut]).is_err());
        }
    }
    for bad in [f64::NAN, f64::INFINITY, -1.0, 2e9] {
        let b = HealthCounts::encode_all(&[HealthCounts { ok: bad, err: 0.0 }]);
        assert!(HealthCounts::decode_all(&b).is_err(), "{bad}");
    }
    assert_eq!(HealthCounts::decode_all(&[]), Ok(vec![]));
}

#[test]
fn disabled_health_ignores_outcomes() {
    let mut h = Health::new(
        HealthParams {
            enabled: false,
            ..Default::default()
        },
        1,
    );
    for t in 0..100 {
        h.record(0, Outcome::Failure, t);
    }
    assert!(!h.is_ejected(0));
    assert_eq!(h.take_probe(10_000, |_| true), None);
    h.record(7, Outcome::Failure, 0);
}
