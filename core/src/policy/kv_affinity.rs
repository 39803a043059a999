//! `kv_affinity`: the largest KV overlap the replicas report, load ignored: pure cache chasing, kept
//! to show how it herds.

use super::{Choice, Input, pick_lowest};
use crate::rng::SplitMix64;

pub fn choose(input: &Input, rng: &mut SplitMix64) -> Choice {
    let neg: Vec<f64> = input.overlap.iter().map(|o| -o).collect();
    Choice {
        replica: pick_lowest(&neg, input.avoided, rng),
        costs: Vec::new(),
        fallback: None,
    }
}
