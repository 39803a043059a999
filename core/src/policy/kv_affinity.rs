//! `kv_affinity`: the largest KV overlap the replicas report, load ignored: pure cache chasing, kept
//! to show how it herds.

use super::{Choice, Input, Policy, pick_lowest};
use crate::rng::SplitMix64;

pub fn choose(input: &Input, rng: &mut SplitMix64) -> Choice {
    let neg: Vec<f64> = input.overlap.iter().map(|o| -o).collect();
    Choice {
        replica: pick_lowest(&neg, input.avoided, rng),
        costs: Vec::new(),
        fallback: None,
    }
}

/// `kv_affinity` as a [`Policy`]: no parameters, no state.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvAffinity;

impl Policy for KvAffinity {
    fn choose(&mut self, input: &Input, rng: &mut SplitMix64) -> Choice {
        choose(input, rng)
    }
}
