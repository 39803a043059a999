//! `least_load`: the lowest load cost, cache ignored. Also the fallback of `session_hash` without a
//! session key, of `prefix_affinity` below its match threshold, and of requests whose body cannot be
//! read.

use super::{Choice, Input, Policy, pick_lowest};
use crate::config::LeastLoadParams;
use crate::load::LoadTotals;
use crate::rng::SplitMix64;

/// `prefill_scale * (queued prefill blocks + request blocks) + decode blocks + w * active requests`,
/// per replica, with the `least_load` section's weights.
pub fn costs(
    load: &[LoadTotals],
    block_size: f64,
    request_blocks: f64,
    k: &LeastLoadParams,
) -> Vec<f64> {
    load.iter()
        .map(|e| {
            k.prefill_scale * (e.prefill_tokens as f64 / block_size + request_blocks)
                + e.decode_blocks as f64
                + k.active_request_weight * e.active_requests as f64
        })
        .collect()
}

pub fn choose(input: &Input, k: &LeastLoadParams, rng: &mut SplitMix64) -> Choice {
    let costs = costs(input.load, input.block_size, input.request_blocks, k);
    Choice {
        replica: pick_lowest(&costs, input.avoided, rng),
        costs,
        fallback: None,
    }
}

/// `least_load` as a [`Policy`], with its section's weights.
#[derive(Clone, Debug)]
pub struct LeastLoad {
    params: LeastLoadParams,
}

impl LeastLoad {
    pub fn new(params: LeastLoadParams) -> LeastLoad {
        LeastLoad { params }
    }
}

impl Policy for LeastLoad {
    fn choose(&mut self, input: &Input, rng: &mut SplitMix64) -> Choice {
        choose(input, &self.params, rng)
    }
}
