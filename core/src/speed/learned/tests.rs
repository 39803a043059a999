use super::*;

fn params(halflife: f64, prior: f64) -> SpeedParams {
    retrying(halflife, prior, 0.0)
}

fn retrying(halflife: f64, prior: f64, retry_s: f64) -> SpeedParams {
    SpeedParams {
        halflife,
        bound: 4.0,
        prior,
        retry_s,
    }
}

#[test]
fn a_replica_twice_as_slow_is_learned_and_the_bound_holds() {
    let mut s = Speeds::new(2, params(16.0, 2.0));
    for _ in 0..64 {
        s.observe(0, 0.1, 0.2, 0);
        s.observe(1, 0.1, 0.1, 0);
    }
    // The prior (at the other replica's factor), halved by every half-life of evidence, leaves a
    // few percent.
    assert!((s.factor(0) - 2.0).abs() < 0.1, "{}", s.factor(0));
    assert!((s.factor(1) - 1.0).abs() < 0.05, "{}", s.factor(1));
    // Wild observations are clamped to the bound.
    for _ in 0..400 {
        s.observe(1, 0.1, 1e9, 0);
    }
    assert!((s.factor(1) - 4.0).abs() < 0.2, "{}", s.factor(1));
    // Garbage and tiny predictions change nothing; an unknown replica is ignored.
    let before = s.factors();
    s.observe(0, f64::NAN, 1.0, 0);
    s.observe(0, 0.001, 10.0, 0);
    s.observe(0, 0.1, -1.0, 0);
    s.observe(9, 0.1, 0.2, 0);
    assert_eq!(s.factors(), before);
    assert_eq!(s.factor(9), 1.0);
}

/// The cold-engine lock-out: three requests 20x slow. The prior keeps the factor well short of
/// the bound.
#[test]
fn a_few_slow_first_requests_are_not_trusted() {
    let mut s = Speeds::new(2, params(32.0, 2.0));
    for i in 0..3 {
        s.observe(0, 0.1, 2.0, i);
    }
    let early = s.factor(0);
    assert!(early < 2.6 && early > 1.5, "{early}");
}

#[test]
fn estimates_are_uncertain_by_the_noise_over_the_evidence() {
    let mut s = Speeds::new(3, params(32.0, 2.0));
    assert_eq!(
        s.spreads(),
        vec![0.0; 3],
        "nothing observed: nothing uncertain"
    );
    // Replica 0 well observed, replica 1 twice, replica 2 never; the noise is +-10% around 1.
    for i in 0..100 {
        let obs = if i % 2 == 0 { 0.11 } else { 0.09 };
        s.observe(0, 0.1, obs, 0);
    }
    s.observe(1, 0.1, 0.11, 0);
    s.observe(1, 0.1, 0.09, 0);
    let sp = s.spreads();
    assert!(sp[0] > 0.0 && sp[0] < sp[1] && sp[1] < sp[2], "{sp:?}");
    assert!(sp[2] <= 4f64.ln());
    // The pooled spread is about the observations' own (0.1 in log units).
    let sigma = sp[2] * 2f64.sqrt();
    assert!((sigma - 0.1).abs() < 0.03, "{sigma}");
}

#[test]
fn other_workers_estimates_are_weighed_by_their_evidence() {
    let mut a = Speeds::new(2, params(16.0, 0.0));
    let mut b = Speeds::new(2, params(16.0, 0.0));
    // Worker a has seen replica 0 run twice as slow; b has seen nothing of it yet.
    for _ in 0..40 {
        a.observe(0, 0.1, 0.2, 0);
    }
    b.set_peer(0, &a.local());
    assert!((b.factor(0) - 2.0).abs() < 0.01, "{}", b.factor(0));
    // Replica 1, never observed, is taken to be like the rest of the fleet.
    assert!((b.factor(1) - 2.0).abs() < 0.01, "{}", b.factor(1));
    // b's own observations at profile speed count as much as a's, window for window.
    for _ in 0..40 {
        b.observe(0, 0.1, 0.1, 0);
    }
    assert!((b.factor(0) - 2f64.sqrt()).abs() < 0.02, "{}", b.factor(0));
    // A worker that stops publishing is forgotten.
    b.clear_peer(0);
    assert!((b.factor(0) - 1.0).abs() < 1e-9);
    // A record of the wrong length, or with garbage in it, changes nothing or counts as
    // nothing; a factor past the bound is held to it.
    b.set_peer(1, &[SpeedEstimate::default()]);
    assert!((b.factor(0) - 1.0).abs() < 1e-9);
    let bad = |log_factor, weight| SpeedEstimate { log_factor, weight };
    b.set_peer(1, &[bad(f64::NAN, 5.0), bad(1e9, 1e9)]);
    assert!((b.factor(0) - 1.0).abs() < 1e-9);
    assert!((b.factor(1) - 4.0).abs() < 1e-9, "{}", b.factor(1));
    b.set_peer(1, &[bad(1.0, -3.0), bad(1.0, f64::INFINITY)]);
    assert!((b.factor(0) - 1.0).abs() < 1e-9);
    assert_eq!(b.factor(1), 1.0);
}

#[test]
fn estimates_survive_their_encoding_and_odd_lengths_do_not_decode() {
    let all = [
        SpeedEstimate {
            log_factor: -0.5,
            weight: 12.0,
        },
        SpeedEstimate::default(),
    ];
    let bytes = SpeedEstimate::encode_all(&all);
    assert_eq!(bytes.len(), 2 * SpeedEstimate::LEN);
    assert_eq!(SpeedEstimate::decode_all(&bytes).unwrap(), all);
    assert!(SpeedEstimate::decode_all(&bytes[1..]).is_err());
    assert_eq!(SpeedEstimate::decode_all(&[]).unwrap(), vec![]);
}

#[test]
fn a_zero_halflife_learns_nothing() {
    let mut s = Speeds::new(1, params(0.0, 2.0));
    s.observe(0, 0.1, 0.4, 0);
    assert_eq!(s.factor(0), 1.0);
    s.set_peer(
        1,
        &[SpeedEstimate {
            log_factor: 1.0,
            weight: 8.0,
        }],
    );
    assert_eq!(s.factor(0), 1.0);
    assert_eq!(s.spreads(), vec![0.0]);
}

/// A replica this worker has not observed or sent anything to for `retry_s` is stale; sending it a
/// request makes it fresh again; one nothing was learned of is never stale.
#[test]
fn an_estimate_goes_stale_without_observations_or_requests() {
    let mut s = Speeds::new(3, retrying(32.0, 2.0, 5.0));
    assert!(s.stale(60_000).iter().all(|&x| !x), "nothing learned yet");
    s.observe(0, 0.1, 2.0, 1_000);
    s.observe(1, 0.1, 0.1, 1_000);
    assert_eq!(s.stale(5_999), vec![false; 3]);
    assert_eq!(s.stale(6_000), vec![true, true, false]);
    s.sent(0, 6_000);
    assert_eq!(s.stale(10_999), vec![false, true, false]);
    assert_eq!(s.stale(11_000), vec![true, true, false]);
    // Learned from a half-life of answers or more: not in doubt, not retried.
    for i in 0..64 {
        s.observe(2, 0.1, 0.2, 12_000 + i);
    }
    assert!(!s.stale(600_000)[2]);
    // Off: never stale.
    let mut off = Speeds::new(1, retrying(32.0, 2.0, 0.0));
    off.observe(0, 0.1, 2.0, 0);
    assert!(off.stale(1_000_000).is_empty());
}

/// The cold-engine case: three requests 20x slow, then healthy answers after a pause of
/// `retry_s`. The stale evidence weighs half at the first healthy answer, and the replica's
/// observations disagreeing with each other make its estimate uncertain, so a few answers bring
/// it within its uncertainty of the fleet.
#[test]
fn a_healthy_answer_after_a_pause_outweighs_stale_slow_evidence() {
    let mut s = Speeds::new(2, retrying(32.0, 2.0, 5.0));
    for i in 0..20 {
        s.observe(1, 0.1, if i % 2 == 0 { 0.105 } else { 0.095 }, i * 100);
    }
    for i in 0..3 {
        s.observe(0, 0.1, 2.0, 2_000 + i);
    }
    let cold = s.factor(0);
    s.observe(0, 0.1, 0.1, 7_003);
    let (f, spread) = s.factors_and_spreads();
    assert!(f[0] < cold.sqrt() * 1.05, "{cold} then {}", f[0]);
    // Within two standard errors of the healthy replica: a tie in `kv_time`.
    let band = 2.0 * spread[0].hypot(spread[1]);
    assert!((f[0] / f[1]).ln() <= band, "{f:?} {spread:?}");
    // Without retrying, the same answer moves it far less and it stands apart.
    let mut held = Speeds::new(2, retrying(32.0, 2.0, 0.0));
    for i in 0..20 {
        held.observe(1, 0.1, if i % 2 == 0 { 0.105 } else { 0.095 }, i * 100);
    }
    for i in 0..3 {
        held.observe(0, 0.1, 2.0, 2_000 + i);
    }
    held.observe(0, 0.1, 0.1, 7_003);
    assert!(held.factor(0) > f[0] * 1.2);
}

/// A replica that really is slow stays priced slow after a retry: the fresh observation agrees
/// with the stale evidence, which keeps its weight, and the next retry waits twice as long.
#[test]
fn a_retry_of_a_really_slow_replica_keeps_it_slow() {
    let mut s = Speeds::new(2, retrying(32.0, 2.0, 5.0));
    for i in 0..40 {
        s.observe(0, 0.1, 0.2, i * 100);
        s.observe(1, 0.1, 0.1, i * 100);
    }
    assert_eq!(s.stale(60_000), vec![true, true]);
    s.observe(0, 0.1, 0.2, 60_000);
    let f = s.factor(0);
    assert!((f - 2.0).abs() < 0.1, "{f}");
    assert!(!s.stale(69_999)[0] && s.stale(70_000)[0]);
    // Confirmed again: twice as long again, up to the cap.
    s.observe(0, 0.1, 0.2, 70_000);
    assert!(!s.stale(89_999)[0] && s.stale(90_000)[0]);
}
