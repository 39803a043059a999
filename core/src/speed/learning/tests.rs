use super::*;

fn learning(replicas: usize, on: bool) -> Learning {
    let params = SpeedParams {
        halflife: 16.0,
        bound: 4.0,
        prior: 0.0,
        retry_s: 0.0,
    };
    Learning::new(replicas, params, on)
}

/// Routes and admits `id` on `replica` at `at_ms` with a prediction of 100 ms at the profile's speed
/// (made, as the policy makes it, at the replica's learned speed), and its first token `ttft_ms`
/// later.
fn request(l: &mut Learning, id: u64, replica: usize, at_ms: u64, ttft_ms: u64) {
    l.routed();
    l.admitted(id, replica, Some(0.1 * l.factor(replica)), at_ms);
    l.first_token(id, at_ms + ttft_ms);
}

#[test]
fn a_first_token_twice_as_late_as_predicted_teaches_a_factor_of_two() {
    let mut l = learning(2, true);
    for i in 0..32 {
        request(&mut l, i, 0, i * 1000, 200);
        request(&mut l, 100 + i, 1, i * 1000, 100);
    }
    assert!((l.factor(0) - 2.0).abs() < 0.05, "{}", l.factor(0));
    assert!((l.factor(1) - 1.0).abs() < 0.05, "{}", l.factor(1));
    assert_eq!(l.pending(), 0);
    let inputs = l.inputs(32_000);
    assert_eq!(inputs.factors.len(), 2);
    assert_eq!(inputs.spreads.len(), 2);
    // Retries off: nothing is ever stale.
    assert!(inputs.stale.is_empty());
}

#[test]
fn a_send_freshens_an_estimate_in_doubt() {
    let params = SpeedParams {
        halflife: 16.0,
        bound: 4.0,
        prior: 0.0,
        retry_s: 1.0,
    };
    let mut l = Learning::new(2, params, true);
    request(&mut l, 1, 0, 0, 200);
    assert_eq!(l.inputs(5_000).stale, vec![true, false]);
    l.admitted(2, 0, None, 5_000);
    assert_eq!(l.inputs(5_000).stale, vec![false, false]);
}

#[test]
fn one_prediction_per_routed_request_and_none_without_terms() {
    let mut l = learning(2, true);
    // No terms (another policy): nothing kept, and the routed request stays unadmitted.
    l.routed();
    l.admitted(1, 0, None, 0);
    assert_eq!(l.pending(), 0);
    l.admitted(2, 0, Some(0.1), 0);
    assert_eq!(l.pending(), 1);
    // A second admission of the same routing (terms already used) is not learned from.
    l.admitted(3, 0, Some(0.1), 0);
    assert_eq!(l.pending(), 1);
}

#[test]
fn a_released_request_and_a_forgotten_replica_teach_nothing() {
    let mut l = learning(2, true);
    l.routed();
    l.admitted(1, 0, Some(0.1), 0);
    l.released(1);
    l.first_token(1, 400);
    assert_eq!(l.factor(0), 1.0);

    l.routed();
    l.admitted(2, 0, Some(0.1), 0);
    l.routed();
    l.admitted(3, 1, Some(0.1), 0);
    l.forget(0);
    assert_eq!(l.pending(), 1);
    l.first_token(2, 400);
    assert_eq!(l.factor(0), 1.0);
    l.first_token(3, 400);
    assert!(l.factor(1) > 1.5, "{}", l.factor(1));
}

#[test]
fn predictions_are_bounded() {
    let mut l = learning(1, true);
    for i in 0..MAX_PENDING_PREDICTIONS as u64 + 10 {
        l.routed();
        l.admitted(i, 0, Some(0.1), 0);
    }
    assert_eq!(l.pending(), MAX_PENDING_PREDICTIONS);
}

#[test]
fn off_it_gives_no_inputs_and_still_learns_from_predictions() {
    let mut l = learning(2, false);
    assert_eq!(l.inputs(0), LearnedInputs::default());
    request(&mut l, 1, 0, 0, 400);
    assert!(l.factor(0) > 1.5, "{}", l.factor(0));
}

/// A replica as fast as its profile whose every first token also carries the API server's 40 ms
/// (the profile's `request_overhead_us`): with the overhead known its factor stays 1, as its
/// neighbour's does; not knowing it, the speed takes the constant for slowness (1.4 on a 100 ms
/// prediction, and worse the shorter the prompt).
#[test]
fn the_overhead_outside_the_engine_is_not_taken_for_slowness() {
    let params = SpeedParams {
        halflife: 16.0,
        bound: 4.0,
        prior: 0.0,
        retry_s: 0.0,
    };
    let mut known = Learning::new(1, params, true).with_overhead(0.040);
    let mut unknown = Learning::new(1, params, true);
    for i in 0..32 {
        request(&mut known, i, 0, i * 1000, 140);
        request(&mut unknown, i, 0, i * 1000, 140);
    }
    assert!((known.factor(0) - 1.0).abs() < 0.02, "{}", known.factor(0));
    assert!(
        (unknown.factor(0) - 1.4).abs() < 0.05,
        "{}",
        unknown.factor(0)
    );
    // A first token the overhead alone explains teaches nothing.
    let mut quick = Learning::new(1, params, true).with_overhead(0.040);
    request(&mut quick, 1, 0, 0, 30);
    assert_eq!(quick.factor(0), 1.0);
    // A hostile value is no overhead.
    let nan = Learning::new(1, params, true).with_overhead(f64::NAN);
    assert_eq!(nan.overhead_s, 0.0);
}
