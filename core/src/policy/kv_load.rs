//! `kv_load`, the default: token load with KV overlap as an input (docs/design.md section 2). Per
//! replica:
//!
//! `prefill_scale * max(queued prefill blocks + request blocks - credit * overlap, 0)
//!  + decode blocks + new active blocks + w * active requests`
//!
//! where `credit = c / (1 + d * excess / request_blocks)` decays the overlap credit `c` on a replica
//! whose queued prefill exceeds the least-loaded candidate's by `excess` blocks (`d` = 0 keeps it
//! whole), and *new active blocks* are the request's blocks not already active there (with
//! `assume_kv_reuse`: a prefix shared with requests in flight is held once). Argmin with a random
//! tie-break, or softmax sampling at `temperature` > 0 (Dynamo's definition).

use super::{Choice, Input, masked, pick_lowest, softmax_sample};
use crate::config::KvLoadParams;
use crate::rng::SplitMix64;

/// The cost per replica (lower is better).
pub fn costs(input: &Input, k: &KvLoadParams) -> Vec<f64> {
    let queued: Vec<f64> = input
        .load
        .iter()
        .map(|e| e.prefill_tokens as f64 / input.block_size)
        .collect();
    let least_queued = (0..queued.len())
        .filter(|&r| !input.avoided.get(r).copied().unwrap_or(false))
        .map(|r| queued[r])
        .fold(f64::INFINITY, f64::min);
    let request_blocks = input.request_blocks;
    input
        .load
        .iter()
        .zip(input.overlap)
        .enumerate()
        .map(|(r, (e, &o))| {
            let excess = (queued[r] - least_queued).max(0.0);
            let credit = if k.overlap_credit_decay > 0.0 && request_blocks > 0.0 {
                k.overlap_credit / (1.0 + k.overlap_credit_decay * excess / request_blocks)
            } else {
                k.overlap_credit
            };
            let prefill = (queued[r] + request_blocks - credit * o).max(0.0);
            let new_active = if k.assume_kv_reuse {
                let active = input.active_prefix.get(r).copied().unwrap_or(0.0);
                (request_blocks - active).max(0.0)
            } else {
                0.0
            };
            k.prefill_scale * prefill
                + e.decode_blocks as f64
                + new_active
                + k.active_request_weight * e.active_requests as f64
        })
        .collect()
}

pub fn choose(input: &Input, k: &KvLoadParams, rng: &mut SplitMix64) -> Choice {
    let costs = costs(input, k);
    let replica = if k.temperature > 0.0 {
        let priced = masked(&costs, input.avoided);
        let finite: Vec<usize> = (0..priced.len())
            .filter(|&r| priced[r].is_finite())
            .collect();
        let sub: Vec<f64> = finite.iter().map(|&r| priced[r]).collect();
        match softmax_sample(&sub, k.temperature, rng) {
            Some(i) => finite[i],
            None => pick_lowest(&costs, input.avoided, rng),
        }
    } else {
        pick_lowest(&costs, input.avoided, rng)
    };
    Choice {
        replica,
        costs,
        fallback: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KvLoadPreset;
    use crate::load::LoadTotals;

    fn input<'a>(load: &'a [LoadTotals], overlap: &'a [f64], active: &'a [f64]) -> Input<'a> {
        Input {
            request_blocks: 10.0,
            block_size: 16.0,
            load,
            overlap,
            active_prefix: active,
            affinity: &[],
            identity_blocks: 10,
            session_key: None,
            avoided: &[false, false],
        }
    }

    #[test]
    fn overlap_credit_decays_on_a_replica_with_excess_queued_prefill() {
        // Replica 0 holds the whole prefix but has 20 blocks of prefill queued; replica 1 none.
        let load = [
            LoadTotals {
                prefill_tokens: 320,
                ..Default::default()
            },
            LoadTotals::default(),
        ];
        let k = KvLoadParams {
            assume_kv_reuse: false,
            ..KvLoadPreset::Dynamo.params()
        };
        let full = costs(&input(&load, &[10.0, 0.0], &[]), &k);
        assert_eq!(full, vec![20.0, 10.0]);
        // d = 1: credit 1 / (1 + 20/10) = 1/3 on replica 0.
        let decayed = costs(
            &input(&load, &[10.0, 0.0], &[]),
            &KvLoadParams {
                overlap_credit_decay: 1.0,
                ..k.clone()
            },
        );
        assert!(
            (decayed[0] - (30.0 - 10.0 / 3.0)).abs() < 1e-9,
            "{decayed:?}"
        );
        assert_eq!(decayed[1], 10.0);
    }

    #[test]
    fn blocks_already_active_are_not_charged_again() {
        let load = [LoadTotals::default(); 2];
        let k = KvLoadPreset::Dynamo.params();
        let c = costs(&input(&load, &[0.0, 0.0], &[6.0, 0.0]), &k);
        assert_eq!(c, vec![10.0 + 4.0, 10.0 + 10.0]);
    }
}
