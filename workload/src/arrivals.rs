//! Arrival-time draws for the open-loop traces (Mooncake, Azure).
//!
//! A trace replayed on its recorded timestamps is one draw of its arrival process: every seed of a
//! benchmark then replays the same arrivals and a policy that breaks few ties replays the same run,
//! while policies with a random part (a hash ring, a random spread) draw anew. Jittering each gap
//! between consecutive arrivals within a band, drawn per seed, gives independent draws that keep the
//! trace's rate, its bursts and its order: a gap of 0 (requests recorded at the same instant) stays 0,
//! and the total span moves only by the sum of independent draws.

use crate::error::WorkloadError;
use crate::session::Session;
use crate::token_blocks::{block_key, sub_key};

/// Checks a jitter band: a share of each gap, in `0..=1` (1 lets a gap fall to nothing or double).
pub fn check_jitter(jitter: f64) -> Result<(), WorkloadError> {
    if (0.0..=1.0).contains(&jitter) {
        Ok(())
    } else {
        Err(WorkloadError::Param(format!(
            "arrival_jitter must be in 0..=1, got {jitter}"
        )))
    }
}

/// A factor drawn uniformly in `[1 - jitter, 1 + jitter]` from `key` and `seed`: 53 bits of the key
/// mixed with the seed. The one draw behind every timing jitter of the workloads: the gaps here and
/// the coding-agent trace's think times (`weka::WekaParams::think_jitter`).
pub fn band_factor(key: u64, seed: u64, jitter: f64) -> f64 {
    let u = (sub_key(key, &[seed]) >> 11) as f64 / (1u64 << 53) as f64;
    1.0 + jitter * (2.0 * u - 1.0)
}

/// [`jitter_gaps`] with the draw recorded in the workload's `params` (when there is one), so a
/// report names the jitter and seed a replay used.
pub fn redraw(
    sessions: &mut [Session],
    params: &mut Vec<(String, String)>,
    jitter: f64,
    seed: u64,
    namespace: &str,
) {
    if jitter > 0.0 {
        jitter_gaps(sessions, jitter, seed, namespace);
        params.push(("arrival_jitter".into(), jitter.to_string()));
        params.push(("jitter_seed".into(), seed.to_string()));
    }
}

/// Redraws the arrival times of `sessions` (each turn with an `arrival_us`, in any order): taken in
/// arrival order, each gap to the previous arrival is multiplied by a factor drawn uniformly in
/// `[1 - jitter, 1 + jitter]` from `namespace`, the request's position in the trace and `seed`. The
/// first arrival keeps its time. `jitter` 0 leaves every time as it is.
pub fn jitter_gaps(sessions: &mut [Session], jitter: f64, seed: u64, namespace: &str) {
    if jitter <= 0.0 {
        return;
    }
    let mut slots: Vec<(u64, usize, usize)> = sessions
        .iter()
        .enumerate()
        .flat_map(|(s, session)| {
            session
                .turns
                .iter()
                .enumerate()
                .filter_map(move |(t, turn)| turn.arrival_us.map(|a| (a, s, t)))
        })
        .collect();
    // Stable by recorded time, then by position, so equal times keep their trace order.
    slots.sort();
    let Some(&(first, _, _)) = slots.first() else {
        return;
    };
    let (mut prev_recorded, mut now) = (first, first as f64);
    for (i, &(recorded, s, t)) in slots.iter().enumerate() {
        let gap = (recorded - prev_recorded) as f64;
        prev_recorded = recorded;
        now += gap * band_factor(block_key(namespace, i as u64), seed, jitter);
        sessions[s].turns[t].arrival_us = Some(now.round() as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::BlockPrompt;

    fn trace(times: &[u64]) -> Vec<Session> {
        times
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let prompt = BlockPrompt {
                    keys: vec![],
                    block_size: 16,
                    len: 16,
                    pad_key: i as u64,
                };
                Session::single_request(format!("r{i}"), prompt, 1, t)
            })
            .collect()
    }

    fn times(s: &[Session]) -> Vec<u64> {
        s.iter().map(|s| s.turns[0].arrival_us.unwrap()).collect()
    }

    #[test]
    fn gaps_stay_within_the_band_and_order_and_ties_survive() {
        let recorded = [1_000, 1_000, 3_000, 3_000, 10_000, 11_000, 40_000];
        for seed in 0..20 {
            let mut s = trace(&recorded);
            jitter_gaps(&mut s, 0.2, seed, "test");
            let t = times(&s);
            assert_eq!(t[0], 1_000, "the first arrival keeps its time");
            for i in 1..t.len() {
                let (g, r) = (
                    (t[i] - t[i - 1]) as f64,
                    (recorded[i] - recorded[i - 1]) as f64,
                );
                assert!(
                    g >= 0.8 * r - 1.0 && g <= 1.2 * r + 1.0,
                    "seed {seed}: {t:?}"
                );
                if r == 0.0 {
                    assert_eq!(t[i], t[i - 1], "simultaneous arrivals stay so");
                }
            }
        }
    }

    #[test]
    fn seeds_draw_anew_and_the_same_seed_draws_the_same() {
        let recorded: Vec<u64> = (0..50).map(|i| i * 1_000).collect();
        let draw = |seed| {
            let mut s = trace(&recorded);
            jitter_gaps(&mut s, 0.2, seed, "test");
            times(&s)
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
        assert_ne!(draw(0), recorded);
        let mut s = trace(&recorded);
        jitter_gaps(&mut s, 0.0, 7, "test");
        assert_eq!(times(&s), recorded, "no jitter, recorded times");
    }

    #[test]
    fn unsorted_input_is_jittered_in_arrival_order() {
        let mut s = trace(&[5_000, 0, 2_000]);
        jitter_gaps(&mut s, 0.5, 1, "test");
        let t = times(&s);
        assert_eq!(t[1], 0);
        assert!(t[1] <= t[2] && t[2] <= t[0], "{t:?}");
    }

    #[test]
    fn the_band_is_checked() {
        assert!(check_jitter(0.0).is_ok() && check_jitter(1.0).is_ok());
        assert!(check_jitter(-0.1).is_err());
        assert!(check_jitter(1.5).is_err());
        assert!(check_jitter(f64::NAN).is_err());
    }
}
