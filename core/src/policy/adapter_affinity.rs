//! `adapter_affinity`: a baseline, the Gateway API Inference Extension's rule for LoRA requests,
//! so that `kv_time`'s adapter term can be compared with what a Kubernetes gateway does. Among the
//! replicas not avoided: those whose running or waiting requests use the request's adapter (loaded,
//! or being loaded); if none, those with a free adapter slot; if none, all; then the lowest
//! `least_load` cost among them (the shortest queue: GIE orders by waiting requests, then KV use;
//! `least_load` weighs queued prefill and decode blocks and running requests). A request that names
//! no adapter, or a fleet that does not report adapters, is routed by `least_load` alone. The KV
//! cache is ignored, as GIE's LoRA filter ignores it.

use super::{AdapterFit, Choice, Input, Policy, least_load, pick_lowest};
use crate::config::LeastLoadParams;
use crate::rng::SplitMix64;

/// The rule's choice: `least_load`'s costs, with every replica outside the first non-empty tier
/// (holding the adapter, then a free slot, then any) priced out.
pub fn choose(input: &Input, k: &LeastLoadParams, rng: &mut SplitMix64) -> Choice {
    let costs = least_load::costs(input.load, input.block_size, input.request_blocks, k);
    let usable = |r: usize| !input.avoided.get(r).copied().unwrap_or(false);
    let fit = |r: usize| input.adapter.get(r).copied().unwrap_or_default();
    let tiers: [&dyn Fn(AdapterFit) -> bool; 2] =
        [&|f| f == AdapterFit::Held, &|f| f == AdapterFit::FreeSlot];
    let mut avoided: Vec<bool> = (0..costs.len()).map(|r| !usable(r)).collect();
    if let Some(tier) = tiers
        .iter()
        .find(|t| (0..costs.len()).any(|r| usable(r) && t(fit(r))))
    {
        for (r, a) in avoided.iter_mut().enumerate() {
            *a |= !tier(fit(r));
        }
    }
    Choice {
        replica: pick_lowest(&costs, &avoided, rng),
        costs,
        fallback: None,
    }
}

/// `adapter_affinity` as a [`Policy`], with `least_load`'s weights.
#[derive(Clone, Debug)]
pub struct AdapterAffinity {
    params: LeastLoadParams,
}

impl AdapterAffinity {
    pub fn new(params: LeastLoadParams) -> AdapterAffinity {
        AdapterAffinity { params }
    }
}

impl Policy for AdapterAffinity {
    fn choose(&mut self, input: &Input, rng: &mut SplitMix64) -> Choice {
        choose(input, &self.params, rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::LoadTotals;
    use crate::policy::load_only_input;

    fn loaded(prefill: u64) -> LoadTotals {
        LoadTotals {
            prefill_tokens: prefill,
            ..LoadTotals::default()
        }
    }

    #[test]
    fn the_holder_wins_over_a_shorter_queue_then_a_free_slot_then_any() {
        let k = LeastLoadParams::default();
        let mut rng = SplitMix64::new(1);
        let load = [loaded(100), loaded(5000), loaded(0)];
        let mut i = load_only_input(&load, &[false; 3]);
        use AdapterFit::*;
        let fits = [Full, Held, FreeSlot];
        i.adapter = &fits;
        assert_eq!(choose(&i, &k, &mut rng).replica, 1);
        let fits = [Full, Full, FreeSlot];
        i.adapter = &fits;
        assert_eq!(choose(&i, &k, &mut rng).replica, 2);
        let fits = [Full, Full, Full];
        i.adapter = &fits;
        assert_eq!(choose(&i, &k, &mut rng).replica, 2);
        // An avoided holder does not count: the next tier decides.
        let fits = [FreeSlot, Held, Full];
        i.adapter = &fits;
        i.avoided = &[false, true, false];
        assert_eq!(choose(&i, &k, &mut rng).replica, 0);
        // No adapter: least load.
        i.adapter = &[];
        i.avoided = &[false; 3];
        assert_eq!(choose(&i, &k, &mut rng).replica, 2);
    }
}
