//! `kv_load`, the default: token load with KV overlap as an input (docs/design/design.md section 2). Per
//! replica:
//!
//! `weight * max(q * queued prefill blocks + request blocks - credit * overlap, 0)
//!  + overflow_weight * weight * (kept(ws) - kept(ws + added))
//!  + decode blocks + new active blocks + w * active requests`
//!
//! where the middle term is the working-set term: `ws` the replica's recent working set, `added` the
//! request's blocks not in it, `kept` what an LRU cache of the replica's size keeps of a working set
//! ([`resident_value`]); 0 while the replica's cache size is unknown; with `overflow_reuse_floor` its
//! weight is scaled by how much of the traffic comes back ([`reuse_ramp`]).
//!
//! where `weight` is `prefill_scale`, or with `time_cost` (the default) `prefill_scale` scaled by what a
//! prefill block costs against a decode block for this request ([`prefill_weight`]), and `q` discounts
//! the prefill already queued on the replica against the request's own uncached blocks (with
//! `queue_in_time` the queue is booked in time, [`crate::load::prefill_work`], and taken out of this
//! request's attention factor);
//! where `credit = c / (1 + d * excess / request_blocks)` decays the overlap credit `c` on a replica
//! whose queued prefill exceeds the least-loaded candidate's by `excess` blocks (`d` = 0 keeps it
//! whole), and *new active blocks* are the request's blocks not already active there (with
//! `assume_kv_reuse`: a prefix shared with requests in flight is held once). Argmin with a random
//! tie-break, or softmax sampling at `temperature` > 0 (Dynamo's definition).

use super::{CacheSizing, Choice, Input, Needs, Policy, masked, pick_lowest, softmax_sample};
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
    let prefill_scale = prefill_weight(input, k);
    let queue_weight = queue_weight(input, k);
    // With `queue_in_time` the queue is booked in time already (`load::prefill_work`), and
    // `prefill_scale` below carries this request's attention: the queue is taken out of it.
    let queue_attention = if k.queue_in_time_active() {
        attention_factor(input, k)
    } else {
        1.0
    };
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
            let queue = queued[r] / queue_attention;
            let prefill = (queue_weight * queue + request_blocks - credit * o).max(0.0);
            let new_active = if k.assume_kv_reuse {
                let active = input.active_prefix.get(r).copied().unwrap_or(0.0);
                (request_blocks - active).max(0.0)
            } else {
                0.0
            };
            let overflow = match input.working_set.get(r) {
                Some(f) if f.cache > 0.0 => {
                    let kept = |w: f64| resident_value(w, f.cache, k.overflow_softness);
                    input.working_set_scale
                        * k.overflow_weight
                        * prefill_scale
                        * (kept(f.working_set) - kept(f.working_set + f.added)).max(0.0)
                }
                _ => 0.0,
            };
            prefill_scale * prefill
                + overflow
                + e.decode_blocks as f64
                + new_active
                + k.active_request_weight * e.active_requests as f64
        })
        .collect()
}

/// The queue's weight for this request: `queue_weight`, or with `cold_queue_weight` set, rising
/// towards it as the best-placed replica's share of the request falls (a request nothing is cached
/// for has no cache to protect by staying behind a queue); then, with `short_queue_weight` set,
/// moved towards that for a short prompt (it pushes little out of a destination's cache, and its
/// time to first token is mostly its wait).
pub fn queue_weight(input: &Input, k: &KvLoadParams) -> f64 {
    let base = match k.cold_queue_weight {
        Some(cold) if input.request_blocks > 0.0 => {
            let best = (0..input.overlap.len())
                .filter(|&r| !input.avoided.get(r).copied().unwrap_or(false))
                .map(|r| input.overlap[r])
                .fold(0.0, f64::max);
            let held = (best / input.request_blocks).clamp(0.0, 1.0);
            k.queue_weight + (cold - k.queue_weight) * (1.0 - held)
        }
        _ => k.queue_weight,
    };
    match k.short_queue_weight {
        Some(short) if k.short_prompt_tokens > 0.0 => {
            let tokens = input.request_blocks * input.block_size;
            // 1 up to `short_prompt_tokens`, 0 from twice that.
            let shortness = (2.0 - tokens / k.short_prompt_tokens).clamp(0.0, 1.0);
            base + (short - base) * shortness
        }
        _ => base,
    }
}

/// Blocks of a replica's working set `ws` its LRU cache of `cap` blocks keeps for their next use:
/// all of it while it fits; past the cache, a cyclic working set keeps nothing (`softness` 0) or,
/// with `softness` s > 0, `cap * exp(-(ws - cap) / (s * cap))`: falling fastest just past the cache,
/// so adding to the replica most over its cache harms least and the overflow gathers there.
pub fn resident_value(ws: f64, cap: f64, softness: f64) -> f64 {
    if ws <= cap {
        ws
    } else if softness > 0.0 && cap > 0.0 {
        cap * (-(ws - cap) / (softness * cap)).exp()
    } else {
        0.0
    }
}

/// The working-set term's share of its weight at reuse share `share` with `kv_load.overflow_reuse_floor`
/// `floor`: none at or below the floor, rising linearly to all of it when every block recently asked
/// for had been asked for before. Below the floor most of what is asked for is asked for once, and
/// what comes back is a few shared prefixes that every replica keeps hot whatever the placement:
/// protecting working sets there gains no cache and only unbalances the fleet.
pub fn reuse_ramp(share: f64, floor: f64) -> f64 {
    if share >= 1.0 {
        1.0
    } else if share > floor {
        (share - floor) / (1.0 - floor)
    } else {
        0.0
    }
}

/// Output tokens at which the time cost's prefill weight equals `prefill_scale` (for a short context).
pub const REFERENCE_OUTPUT_TOKENS: f64 = 256.0;

/// The weight of a prefill block against a decode block for this request: `prefill_scale`, or with
/// `time_cost` the ratio of what each costs in engine time. A prefill token costs its linear layers
/// plus attention over its context (`1 + context / attention_context_tokens` in units of the linear
/// part); a decode block beside the request costs its KV read at every step the request decodes, so
/// for `expected_output` steps. Expected outputs below 16 tokens count as 16, so a one-token request
/// does not make prefill infinitely dear.
pub fn prefill_weight(input: &Input, k: &KvLoadParams) -> f64 {
    if !k.time_cost {
        return k.prefill_scale;
    }
    let output = input.expected_output_tokens.max(16.0);
    k.prefill_scale * attention_factor(input, k) * REFERENCE_OUTPUT_TOKENS / output
}

/// What a token of this request's prefill costs against a short prompt's: its linear layers plus
/// attention over the request's context.
fn attention_factor(input: &Input, k: &KvLoadParams) -> f64 {
    1.0 + input.request_blocks * input.block_size / k.attention_context_tokens
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

/// `kv_load` as a [`Policy`]: its parameters.
#[derive(Clone, Debug)]
pub struct KvLoad {
    params: KvLoadParams,
}

impl KvLoad {
    pub fn new(params: KvLoadParams) -> KvLoad {
        KvLoad { params }
    }
}

impl Policy for KvLoad {
    fn needs(&self) -> Needs {
        Needs {
            // A prefix shared with running requests is counted once (`assume_kv_reuse`).
            active_prefix: self.params.assume_kv_reuse,
            working_set: (self.params.overflow_weight > 0.0).then_some(CacheSizing::Configured),
            ..Needs::default()
        }
    }

    fn choose(&mut self, input: &Input, rng: &mut SplitMix64) -> Choice {
        choose(input, &self.params, rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KvLoadPreset;
    use crate::load::LoadTotals;
    use crate::policy::{fit, load_only_input};

    fn input<'a>(load: &'a [LoadTotals], overlap: &'a [f64], active: &'a [f64]) -> Input<'a> {
        Input {
            request_blocks: 10.0,
            overlap,
            active_prefix: active,
            identity_blocks: 10,
            ..load_only_input(load, &[false, false])
        }
    }

    #[test]
    fn resident_value_keeps_what_fits_and_falls_fastest_just_past_the_cache() {
        assert_eq!(resident_value(80.0, 100.0, 0.0), 80.0);
        assert_eq!(resident_value(100.0, 100.0, 0.5), 100.0);
        assert_eq!(resident_value(101.0, 100.0, 0.0), 0.0);
        let v = |w| resident_value(w, 100.0, 0.5);
        assert!(v(110.0) < 100.0 && v(110.0) > 0.0);
        // Adding 10 blocks costs more just past the cache than far past it.
        assert!(v(110.0) - v(120.0) > v(200.0) - v(210.0));
        assert!(resident_value(1e300, 100.0, 0.5) >= 0.0);
        assert_eq!(resident_value(5.0, 0.0, 0.5), 0.0);
    }

    #[test]
    fn the_working_set_term_prices_the_cache_a_placement_overflows() {
        let load = [LoadTotals::default(); 2];
        let k = KvLoadParams {
            time_cost: false,
            prefill_scale: 1.0,
            assume_kv_reuse: false,
            overflow_weight: 2.0,
            overflow_softness: 0.0,
            ..KvLoadParams::default()
        };
        let mut i = input(&load, &[0.0, 0.0], &[]);
        // Replica 0: 95 of 100 blocks requested recently, the request adds 10 (over); replica 1:
        // 50, adds 10 (fits).
        let ws = [fit(95.0, 10.0, 100.0), fit(50.0, 10.0, 100.0)];
        i.working_set = &ws;
        assert_eq!(costs(&i, &k), vec![10.0 + 2.0 * 95.0, 10.0]);
        // An unknown cache size (0) or a zero weight turns it off.
        let unknown = [fit(95.0, 10.0, 0.0), fit(50.0, 10.0, 0.0)];
        i.working_set = &unknown;
        assert_eq!(costs(&i, &k), vec![10.0, 10.0]);
        i.working_set = &ws;
        let off = KvLoadParams {
            overflow_weight: 0.0,
            ..k.clone()
        };
        assert_eq!(costs(&i, &off), vec![10.0, 10.0]);
        // The reuse floor's scale multiplies the term: half of it, or none.
        i.working_set_scale = 0.5;
        assert_eq!(costs(&i, &k), vec![10.0 + 95.0, 10.0]);
        i.working_set_scale = 0.0;
        assert_eq!(costs(&i, &k), vec![10.0, 10.0]);
    }

    #[test]
    fn the_reuse_ramp_rises_from_the_floor_to_the_whole_weight() {
        assert_eq!(reuse_ramp(0.3, 0.5), 0.0);
        assert_eq!(reuse_ramp(0.5, 0.5), 0.0);
        assert_eq!(reuse_ramp(0.75, 0.5), 0.5);
        assert_eq!(reuse_ramp(1.0, 0.5), 1.0);
        assert_eq!(reuse_ramp(0.2, 0.0), 0.2);
        // A floor of 1 leaves the term on only when everything was asked for before.
        assert_eq!(reuse_ramp(0.99, 1.0), 0.0);
        assert_eq!(reuse_ramp(1.0, 1.0), 1.0);
        assert_eq!(reuse_ramp(f64::NAN, 0.5), 0.0);
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

    /// With `queue_in_time` the queue is booked in time, so this request's own attention no longer
    /// multiplies it: a long request sees the same queue as a short one.
    #[test]
    fn a_queue_in_time_is_not_weighted_by_the_requests_attention() {
        let load = [
            LoadTotals {
                prefill_tokens: 16_000,
                ..Default::default()
            },
            LoadTotals::default(),
        ];
        let k = KvLoadParams {
            assume_kv_reuse: false,
            overflow_weight: 0.0,
            ..KvLoadParams::default()
        };
        let timed = KvLoadParams {
            queue_in_time: true,
            ..k.clone()
        };
        let mut i = input(&load, &[0.0, 0.0], &[]);
        // 4,000 blocks of context: attention factor 1 + 64,000 / 25,000 = 3.56.
        i.request_blocks = 4_000.0;
        let gap = |k: &KvLoadParams| {
            let c = costs(&i, k);
            c[0] - c[1]
        };
        let att = 1.0 + 64_000.0 / 25_000.0;
        let ratio = gap(&k) / gap(&timed);
        assert!((ratio - att).abs() < 1e-9, "{ratio}");
        // Without the time cost the option changes nothing.
        let blocks = KvLoadParams {
            time_cost: false,
            ..k.clone()
        };
        let blocks_timed = KvLoadParams {
            queue_in_time: true,
            ..blocks.clone()
        };
        assert_eq!(costs(&i, &blocks), costs(&i, &blocks_timed));
    }

    #[test]
    fn blocks_already_active_are_not_charged_again() {
        let load = [LoadTotals::default(); 2];
        let k = KvLoadPreset::Dynamo.params();
        let c = costs(&input(&load, &[0.0, 0.0], &[6.0, 0.0]), &k);
        assert_eq!(c, vec![10.0 + 4.0, 10.0 + 10.0]);
    }

    #[test]
    fn time_cost_weighs_prefill_by_context_and_expected_output() {
        let load = [LoadTotals::default(); 2];
        let k = KvLoadParams::default();
        assert!(k.time_cost);
        let mut i = input(&load, &[0.0, 0.0], &[]);
        // 10 blocks of 16 tokens, 256 expected output tokens: about prefill_scale.
        let short = prefill_weight(&i, &k);
        assert!((short - k.prefill_scale * (1.0 + 160.0 / 25_000.0)).abs() < 1e-9);
        // A 100K-token context: attention makes each prefill block 5x dearer.
        i.request_blocks = 100_000.0 / 16.0;
        let long = prefill_weight(&i, &k);
        assert!((long / k.prefill_scale - 5.0).abs() < 1e-9, "{long}");
        // Expecting 8x the output: decode blocks matter 8x more, so prefill weighs 8x less.
        i.expected_output_tokens = 2048.0;
        assert!((prefill_weight(&i, &k) * 8.0 - long).abs() < 1e-9);
        // Tiny expected outputs are floored at 16 tokens.
        i.expected_output_tokens = 0.0;
        assert!(prefill_weight(&i, &k).is_finite());
        let off = KvLoadParams {
            time_cost: false,
            ..k.clone()
        };
        assert_eq!(prefill_weight(&i, &off), off.prefill_scale);
    }

    #[test]
    fn a_cold_request_can_weigh_the_queue_in_full() {
        let load = [
            LoadTotals {
                prefill_tokens: 4 * 16,
                ..Default::default()
            },
            LoadTotals::default(),
        ];
        let k = KvLoadParams {
            time_cost: false,
            assume_kv_reuse: false,
            prefill_scale: 1.0,
            overflow_weight: 0.0,
            cold_queue_weight: Some(1.0),
            ..KvLoadParams::default()
        };
        // Nothing held anywhere: the whole queue counts (4 + 10 against 10).
        assert_eq!(queue_weight(&input(&load, &[0.0, 0.0], &[]), &k), 1.0);
        assert_eq!(costs(&input(&load, &[0.0, 0.0], &[]), &k), vec![14.0, 10.0]);
        // All held on replica 0: the configured quarter (1 + 0 against 10).
        assert_eq!(queue_weight(&input(&load, &[10.0, 0.0], &[]), &k), 0.25);
        // Half held: half way between.
        assert!((queue_weight(&input(&load, &[5.0, 0.0], &[]), &k) - 0.625).abs() < 1e-12);
        // Unset: queue_weight for every request.
        let unset = KvLoadParams {
            cold_queue_weight: None,
            ..k.clone()
        };
        assert_eq!(queue_weight(&input(&load, &[0.0, 0.0], &[]), &unset), 0.25);
    }

    #[test]
    fn a_short_prompt_can_weigh_the_queue_more() {
        let load = [LoadTotals::default(); 2];
        let k = KvLoadParams {
            short_queue_weight: Some(0.5),
            short_prompt_tokens: 1_000.0,
            ..KvLoadParams::default()
        };
        let mut i = input(&load, &[0.0, 0.0], &[]);
        let at = |i: &mut Input, tokens: f64| {
            i.request_blocks = tokens / 16.0;
            queue_weight(i, &k)
        };
        // In full up to the threshold, half way at 1.5x, the configured weight from 2x.
        assert_eq!(at(&mut i, 160.0), 0.5);
        assert_eq!(at(&mut i, 1_000.0), 0.5);
        assert!((at(&mut i, 1_500.0) - 0.375).abs() < 1e-12);
        assert_eq!(at(&mut i, 2_000.0), 0.25);
        assert_eq!(at(&mut i, 100_000.0), 0.25);
        // It blends with the cold request's weight rather than replacing it.
        let cold = KvLoadParams {
            cold_queue_weight: Some(1.0),
            ..k.clone()
        };
        i.request_blocks = 1_500.0 / 16.0;
        assert!((queue_weight(&i, &cold) - 0.75).abs() < 1e-12);
        // Unset: no change.
        i.request_blocks = 10.0;
        assert_eq!(queue_weight(&i, &KvLoadParams::default()), 0.25);
    }

    #[test]
    fn queue_weight_makes_a_move_save_more_than_it_adds() {
        // Replica 0 holds 8 of the 10 blocks with 4 blocks queued; replica 1 holds nothing, queue 0.
        let load = [
            LoadTotals {
                prefill_tokens: 4 * 16,
                ..Default::default()
            },
            LoadTotals::default(),
        ];
        let base = KvLoadParams {
            time_cost: false,
            assume_kv_reuse: false,
            prefill_scale: 1.0,
            ..KvLoadParams::default()
        };
        let even = KvLoadParams {
            queue_weight: 1.0,
            ..base.clone()
        };
        // Whole queue: 4 + 2 = 6 on the holder against 10 elsewhere.
        assert_eq!(
            costs(&input(&load, &[8.0, 0.0], &[]), &even),
            vec![6.0, 10.0]
        );
        // A quarter: 1 + 2 = 3.
        assert_eq!(
            costs(&input(&load, &[8.0, 0.0], &[]), &base),
            vec![3.0, 10.0]
        );
    }
}
