//! Choosing among scored replicas: argmin with a seeded random tie-break, or softmax sampling at a
//! temperature, with avoided (down) replicas priced out.

use crate::rng::SplitMix64;

/// Costs with avoided replicas priced out (infinite).
pub fn masked(costs: &[f64], avoided: &[bool]) -> Vec<f64> {
    costs
        .iter()
        .enumerate()
        .map(|(r, &c)| {
            if avoided.get(r).copied().unwrap_or(false) {
                f64::INFINITY
            } else {
                c
            }
        })
        .collect()
}

/// The lowest cost among replicas not avoided, ties broken at random (replica 0 for no costs).
pub fn pick_lowest(costs: &[f64], avoided: &[bool], rng: &mut SplitMix64) -> usize {
    argmin_random_tie(&masked(costs, avoided), rng).unwrap_or(0)
}

/// Index of the lowest cost; ties (within 1e-9 relative) broken uniformly at random. None if empty.
pub fn argmin_random_tie(costs: &[f64], rng: &mut SplitMix64) -> Option<usize> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    if !min.is_finite() {
        return if costs.is_empty() {
            None
        } else {
            Some(rng.below(costs.len()))
        };
    }
    let tol = 1e-9 * (1.0 + min.abs());
    let ties = costs.iter().filter(|&&c| c - min <= tol).count();
    let mut pick = rng.below(ties);
    for (i, &c) in costs.iter().enumerate() {
        if c - min <= tol {
            if pick == 0 {
                return Some(i);
            }
            pick -= 1;
        }
    }
    None
}

/// Softmax sampling at temperature `t > 0` as Dynamo defines it:
/// `p_i ~ exp(-(cost_i - cost_min) / ((cost_max - cost_min) * t))`; all costs equal: uniform.
pub fn softmax_sample(costs: &[f64], t: f64, rng: &mut SplitMix64) -> Option<usize> {
    if costs.is_empty() {
        return None;
    }
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let span = (max - min) * t;
    if !(span.is_finite() && span > 0.0) {
        return Some(rng.below(costs.len()));
    }
    let weights: Vec<f64> = costs.iter().map(|&c| (-(c - min) / span).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.next_f64() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return Some(i);
        }
        x -= w;
    }
    Some(costs.len() - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmin_breaks_ties_randomly_and_only_among_ties() {
        let mut rng = SplitMix64::new(1);
        let costs = [3.0, 1.0, 2.0, 1.0];
        let mut seen = [0; 4];
        for _ in 0..1000 {
            seen[argmin_random_tie(&costs, &mut rng).unwrap()] += 1;
        }
        assert_eq!(seen[0] + seen[2], 0);
        assert!(seen[1] > 400 && seen[3] > 400, "{seen:?}");
        assert_eq!(argmin_random_tie(&[], &mut rng), None);
    }

    #[test]
    fn softmax_prefers_cheap_and_handles_equal_costs() {
        let mut rng = SplitMix64::new(2);
        let costs = [0.0, 10.0];
        let mut low = 0;
        for _ in 0..2000 {
            if softmax_sample(&costs, 0.5, &mut rng) == Some(0) {
                low += 1;
            }
        }
        // p0 = 1 / (1 + e^-2) = 0.881
        assert!((1650..1880).contains(&low), "{low}");
        let mut seen = [0; 3];
        for _ in 0..900 {
            seen[softmax_sample(&[5.0, 5.0, 5.0], 1.0, &mut rng).unwrap()] += 1;
        }
        assert!(seen.iter().all(|&c| c > 200), "{seen:?}");
    }
}
