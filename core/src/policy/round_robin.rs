//! `round_robin`: the next replica that is not avoided, in turn. The baseline every load-aware policy
//! must beat on tail latency.

use super::{Choice, Input, Policy};
use crate::rng::SplitMix64;

/// Chooses the replica at `next` (or the first not avoided after it) and moves `next` past it.
pub fn choose(input: &Input, next: &mut usize) -> Choice {
    let n = input.load.len().max(1);
    let avoided = |r: usize| input.avoided.get(r).copied().unwrap_or(false);
    let mut r = *next % n;
    for _ in 0..n {
        if !avoided(r) {
            break;
        }
        r = (r + 1) % n;
    }
    *next = (r + 1) % n;
    Choice {
        replica: r,
        costs: Vec::new(),
        fallback: None,
    }
}

/// `round_robin` as a [`Policy`]: its cursor, the next replica in turn.
#[derive(Clone, Debug, Default)]
pub struct RoundRobin {
    next: usize,
}

impl Policy for RoundRobin {
    fn choose(&mut self, input: &Input, _rng: &mut SplitMix64) -> Choice {
        choose(input, &mut self.next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::LoadTotals;
    use crate::policy::load_only_input;

    #[test]
    fn cycles_and_skips_avoided_replicas() {
        let load = [LoadTotals::default(); 3];
        let avoided = [false, true, false];
        let input = load_only_input(&load, &avoided);
        let mut next = 0;
        let picks: Vec<usize> = (0..4).map(|_| choose(&input, &mut next).replica).collect();
        assert_eq!(picks, vec![0, 2, 0, 2]);
    }
}
