//! `prefix_affinity`: the replica this router itself last sent the longest prefix of the request to
//! (its approximate index, as Ray Serve's PrefixCacheAffinityRouter and SGLang's cache-aware router
//! keep), the least loaded among equal matches; least load when the best match covers less than
//! `match_threshold` of the request.

use super::{Choice, FallbackReason, Input, Needs, Policy, least_load, pick_lowest};
use crate::config::LeastLoadParams;
use crate::rng::SplitMix64;

pub fn choose(
    input: &Input,
    match_threshold: f64,
    k: &LeastLoadParams,
    rng: &mut SplitMix64,
) -> Choice {
    let matched: Vec<u32> = input
        .affinity
        .iter()
        .enumerate()
        .map(|(r, &b)| {
            if input.avoided.get(r).copied().unwrap_or(false) {
                0
            } else {
                b
            }
        })
        .collect();
    let best = matched.iter().copied().max().unwrap_or(0);
    let rate = if input.identity_blocks == 0 {
        0.0
    } else {
        best as f64 / input.identity_blocks as f64
    };
    let costs = least_load::costs(input.load, input.block_size, input.request_blocks, k);
    if best > 0 && rate >= match_threshold {
        let among_best: Vec<f64> = costs
            .iter()
            .zip(&matched)
            .map(|(&c, &b)| if b == best { c } else { f64::INFINITY })
            .collect();
        Choice {
            replica: pick_lowest(&among_best, input.avoided, rng),
            costs,
            fallback: None,
        }
    } else {
        Choice {
            replica: pick_lowest(&costs, input.avoided, rng),
            costs,
            fallback: Some(FallbackReason::BelowMatchThreshold),
        }
    }
}

/// `prefix_affinity` as a [`Policy`]: the share of the request the best match must cover (0..=1),
/// and `least_load`'s weights for the least-load choice.
#[derive(Clone, Debug)]
pub struct PrefixAffinity {
    match_threshold: f64,
    params: LeastLoadParams,
}

impl PrefixAffinity {
    pub fn new(match_threshold: f64, params: LeastLoadParams) -> PrefixAffinity {
        PrefixAffinity {
            match_threshold,
            params,
        }
    }
}

impl Policy for PrefixAffinity {
    fn needs(&self) -> Needs {
        Needs {
            affinity: true,
            ..Needs::default()
        }
    }

    fn choose(&mut self, input: &Input, rng: &mut SplitMix64) -> Choice {
        choose(input, self.match_threshold, &self.params, rng)
    }
}
