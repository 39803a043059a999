//! `kv_time`: the cost of sending a request to a replica, in seconds (docs/design/design.md section
//! 2.7). Per candidate replica r, with `s_r` its learned speed factor ([`crate::speed::Speeds`]),
//! `u_r` the request's prompt tokens r does not cache, `c_r` those it does, `n_r` the requests r
//! runs, `K_r` the KV tokens they hold, `o` the expected output tokens and `P` the prompt's tokens:
//!
//! ```text
//! cost_r = wait_r + prefill_r + decode_weight * decode_r + stall_weight * stall_r + evict_weight * evict_r
//!          + later_weight * later_r
//! wait_r    = s_r * work_s(queued prefill work on r)          each booked request priced by its own
//!                                                             uncached tokens and context
//!             + s_r * batch_r(n_r, K_r)                       what r's running decodes add first: the
//!                                                             step in progress (half of one), then
//!                                                             their share of each step that runs the
//!                                                             queued prefill and this one
//!             + memory_r                                      and, when r's KV cache cannot hold the
//!                                                             request beside what runs there, the
//!                                                             time for enough of it to finish
//! prefill_r = s_r * prefill_s(u_r, c_r)                       linear layers + attention + step overhead
//! decode_r  = s_r * o * step_extra(n_r, K_r)                  what r's batch adds to each of the
//!                                                             request's own decode steps
//! stall_r   = n_r * prefill_r + s_r * n_r * o * step_extra(1, P + o/2)
//!                                                             what the requests already on r lose:
//!                                                             the steps this prefill takes, then the
//!                                                             request's KV read at each of its steps
//! evict_r   = s_r * reuse * work_s(tokens pushed out of r's cache)
//!                                                             re-prefill of the contexts the placement
//!                                                             pushes out, times the share that comes back
//! later_r   = (prefill_r - least prefill) * mean wait / mean prefill placed
//!                                                             the delay the extra prefill imposes on
//!                                                             the requests queued behind it ([`later_s`])
//! adapter_r = adapters.load_ms where r must load the request's LoRA adapter (+ s_r * o/2 steps
//!             when every adapter slot holds a running request's adapter), else 0
//!                                                             added to cost_r and to the predicted TTFT
//! ```
//!
//! `wait_r + prefill_r` is the predicted time to first token on r. A replica with nothing queued,
//! nothing running and no cache costs exactly `prefill_s(P, 0)`: whenever the prefill it would do
//! takes less time than the wait elsewhere, it wins: replicas holding a shared prefix cannot keep it
//! idle once their queues cost more than its prefill (at lighter load they rightly may). The weights are an operator's exchange rates (seconds of this request's
//! first token one second of the named delay is worth), not fitted constants.

use super::{
    AdapterFit, CacheSizing, Choice, Input, Needs, Policy, argmin_random_tie, pick_lowest,
};
use crate::config::KvTimeParams;
use crate::rng::SplitMix64;
use crate::speed::EngineProfile;

/// One replica's cost, term by term (seconds; the weights not yet applied).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Terms {
    pub wait: f64,
    pub prefill: f64,
    pub decode: f64,
    pub stall: f64,
    pub evict: f64,
    /// Loading the request's LoRA adapter where the replica lacks it ([`adapter_s`]).
    pub adapter: f64,
    /// What the prefill work this placement adds beyond the least any replica would do delays
    /// the requests that come after it ([`later_s`]).
    pub later: f64,
}

impl Terms {
    /// The cost the policy minimises.
    pub fn cost(&self, k: &KvTimeParams) -> f64 {
        self.wait
            + self.prefill
            + k.decode_weight * self.decode
            + k.stall_weight * self.stall
            + k.evict_weight * self.evict
            + self.adapter
            + k.later_weight * self.later
    }

    /// The predicted time to first token.
    pub fn ttft(&self) -> f64 {
        self.wait + self.prefill + self.adapter
    }
}

/// Which replicas are tied with `lowest` within their learned speeds' uncertainty; `None` when it
/// stands alone (no uncertainty, or no other replica close enough).
fn tied_with(input: &Input, costs: &[f64], lowest: usize) -> Option<Vec<bool>> {
    let spread = |r: usize| input.speed_spread.get(r).copied().unwrap_or(0.0);
    let low = costs.get(lowest).copied()?;
    if input.speed_spread.is_empty() || !(low.is_finite() && low > 0.0) {
        return None;
    }
    let tied: Vec<bool> = costs
        .iter()
        .enumerate()
        .map(|(r, &c)| {
            let avoided = input.avoided.get(r).copied().unwrap_or(false);
            let band = TIE_STANDARD_ERRORS * spread(r).hypot(spread(lowest));
            r == lowest || (!avoided && c.is_finite() && (c / low).ln() <= band)
        })
        .collect();
    (tied.iter().filter(|&&t| t).count() > 1).then_some(tied)
}

/// Every replica's [`Terms`] for the request.
pub fn terms(input: &Input, profile: &EngineProfile) -> Vec<Terms> {
    let bs = input.block_size;
    let prompt = input.request_blocks * bs;
    let out = input.expected_output_tokens.max(1.0);
    let reuse = input.reuse_share.clamp(0.0, 1.0);
    input
        .load
        .iter()
        .enumerate()
        .map(|(r, e)| {
            let s = input.speed.get(r).copied().unwrap_or(1.0);
            let cached = (input.overlap.get(r).copied().unwrap_or(0.0) * bs)
                .max(0.0)
                .min(prompt);
            let uncached = prompt - cached;
            let n = e.active_requests as f64;
            let context = e.decode_blocks as f64 * bs;
            let queued = e.prefill_tokens as f64;
            let wait = s
                * (profile.work_s(queued) + batch_s(profile, n, context, queued, uncached))
                + memory_wait(
                    profile,
                    kv_tokens(input, profile, r),
                    s,
                    n,
                    context,
                    uncached,
                    out,
                );
            let prefill = s * profile.prefill_s(uncached, cached);
            let decode = s * out * profile.decode_step_extra_s(n, context);
            let stall =
                n * prefill + s * n * out * profile.decode_step_extra_s(1.0, prompt + out / 2.0);
            let evict = match input.working_set.get(r) {
                Some(f) if f.cache > 0.0 => s * reuse * profile.work_s(f.pushed_out() * bs),
                _ => 0.0,
            };
            Terms {
                wait,
                prefill,
                decode,
                stall,
                evict,
                adapter: adapter_s(input, profile, r),
                later: 0.0,
            }
        })
        .collect()
}

/// Every replica's [`Terms`], with [`later_s`] filled in where it is priced (`later_weight` above
/// 0): off, it is neither computed on the decision's path nor shown in the explain header.
fn priced(
    input: &Input,
    k: &KvTimeParams,
    profile: &EngineProfile,
    mean_prefill_s: f64,
) -> Vec<Terms> {
    let mut all = terms(input, profile);
    if k.later_weight > 0.0 {
        let later = later_s(input, &all, mean_prefill_s);
        for (t, l) in all.iter_mut().zip(later) {
            t.later = l;
        }
    }
    all
}

/// Per replica: seconds of delay its placement imposes on the requests that arrive after it, by
/// the prefill work it does beyond the least any replica would (a replica without the cache
/// recomputes what the holder would not). Work added to a fleet that has a backlog is waited for
/// by every request queued behind it before the backlog clears: about as many per replica as are
/// queued now, which is the fleet's mean predicted wait over the mean prefill time of the
/// requests it is sent (`mean_prefill_s`, learned by [`KvTime`]). An idle fleet has no one
/// behind, and the term is 0; at saturation a move that saves this request's first token a few
/// seconds by re-prefilling a long context costs the requests behind it more. Without it a
/// quarter of coding-agent turns at 32-40 sessions in flight moved off their history's replica,
/// the fleet's hit rate fell 3 points, and the short cached turns that make the median queued
/// behind the extra work.
fn later_s(input: &Input, all: &[Terms], mean_prefill_s: f64) -> Vec<f64> {
    let open = |r: usize| !input.avoided.get(r).copied().unwrap_or(false);
    let usable: Vec<&Terms> = all
        .iter()
        .enumerate()
        .filter(|&(r, t)| open(r) && t.wait.is_finite() && t.prefill.is_finite())
        .map(|(_, t)| t)
        .collect();
    if usable.is_empty() || !(mean_prefill_s.is_finite() && mean_prefill_s > 0.0) {
        return vec![0.0; all.len()];
    }
    let mean_wait = usable.iter().map(|t| t.wait.max(0.0)).sum::<f64>() / usable.len() as f64;
    let behind = mean_wait / mean_prefill_s;
    let least = usable
        .iter()
        .map(|t| t.prefill)
        .fold(f64::INFINITY, f64::min);
    all.iter()
        .map(|t| {
            let extra = (t.prefill - least).max(0.0);
            if extra.is_finite() {
                behind * extra
            } else {
                0.0
            }
        })
        .collect()
}

/// Seconds replica `r` makes the request wait for its LoRA adapter before its first token: 0 where
/// r holds it (a running or waiting request uses it) or its adapters are not known (a feed without
/// them, or a request for none); the load time where a slot is free; and where every slot holds a
/// running request's adapter, the load time plus the wait for a slot, since the engine admits the
/// request only once one of those adapters has no request left: with their remaining outputs spread
/// evenly over `0..out` tokens, about `out / 2` of r's current steps. Without that wait a replica
/// full of other adapters looks as cheap as one with a free slot, and draws the requests that then
/// queue behind its decodes. The load itself is not scaled by r's speed: it is a copy to the GPU.
pub fn adapter_s(input: &Input, profile: &EngineProfile, r: usize) -> f64 {
    let load = input.adapter_load_s;
    let load = if load.is_finite() { load.max(0.0) } else { 0.0 };
    match input.adapter.get(r) {
        Some(AdapterFit::FreeSlot) => load,
        Some(AdapterFit::Full) => {
            let s = input.speed.get(r).copied().unwrap_or(1.0);
            let e = input.load.get(r).copied().unwrap_or_default();
            let out = input.expected_output_tokens.max(1.0);
            let context = e.decode_blocks as f64 * input.block_size;
            let wait = s * out / 2.0 * profile.step_s(e.active_requests as f64, context);
            load + if wait.is_finite() { wait } else { 0.0 }
        }
        _ => 0.0,
    }
}

/// Seconds a replica's `n` running requests (holding `context` tokens of KV) add before a request's
/// first token: the step in progress when it arrives (half of one, on average), then their share of
/// every step that runs the prefill queued before it (`queued` tokens of work) and its own
/// (`uncached` tokens, at least the one step that samples its first token). Chunked prefill shares
/// each step with the decodes, so a short prefill behind a large batch takes about one of the
/// batch's steps: without this a busy cache holder's first token was predicted 1.3-1.6x too soon
/// on chat and RL work, and an idle replica without the cache looked dearer than it is. 0 where
/// nothing runs. Unscaled by the replica's speed (the caller scales it).
fn batch_s(profile: &EngineProfile, n: f64, context: f64, queued: f64, uncached: f64) -> f64 {
    if n <= 0.0 {
        return 0.0;
    }
    let in_progress = 0.5 * profile.step_s(n, context);
    let mut shared = 0.0;
    for (work, min_steps) in [(queued, 0.0), (uncached, 1.0)] {
        let steps = profile.prefill_steps(work, min_steps);
        if steps > 0.0 {
            shared += steps * profile.mixed_step_extra_s(n, context, work.max(0.0) / steps);
        }
    }
    in_progress + shared
}

/// Replica `r`'s KV cache in tokens: as the router sizes it for the working-set term (the size the
/// feed reports, [`crate::router::Router::priced_cache_blocks`]) where that is known, else the
/// profile's.
fn kv_tokens(input: &Input, profile: &EngineProfile, r: usize) -> f64 {
    match input.working_set.get(r) {
        Some(f) if f.cache > 0.0 => f.cache * input.block_size,
        _ => profile.kv_cache_tokens,
    }
}

/// Seconds a request needing `uncached` tokens of new KV waits for room on a replica whose `n`
/// running requests hold `context` tokens of a `kv_tokens` cache: nothing while it
/// fits; past that, the engine admits it only as running requests finish and free their blocks,
/// and with their remaining outputs spread evenly over `0..out` tokens, a share `f` of their KV is
/// free after about `f * out` steps of r's current step time (`f = excess / context`, at most 1). Without it a replica whose cache is full of decodes looks as cheap as its prefill
/// queue, and draws the requests that then wait behind its decodes.
fn memory_wait(
    profile: &EngineProfile,
    kv_tokens: f64,
    s: f64,
    n: f64,
    context: f64,
    uncached: f64,
    out: f64,
) -> f64 {
    let excess = context + uncached - kv_tokens;
    if excess <= 0.0 || context <= 0.0 {
        return 0.0;
    }
    let step = profile.step_s(n, context);
    s * (excess / context).min(1.0) * out * step
}

/// Per replica: whether its estimate is stale and it is priced slower than `chosen`, the replicas
/// a retry may go to; `None` when there are none.
fn stale_slower(input: &Input, chosen: usize) -> Option<Vec<bool>> {
    let factor = |r: usize| input.speed.get(r).copied().unwrap_or(1.0);
    let slower: Vec<bool> = (0..input.load.len())
        .map(|r| {
            input.speed_stale.get(r).copied().unwrap_or(false)
                && !input.avoided.get(r).copied().unwrap_or(false)
                && factor(r) > factor(chosen)
        })
        .collect();
    slower.contains(&true).then_some(slower)
}

/// The replica of lowest `cost` among those `kept`, ties at random; `None` when no kept replica
/// has a finite cost.
fn cheapest_of(cost: &[f64], kept: &[bool], rng: &mut SplitMix64) -> Option<usize> {
    let base: Vec<f64> = cost
        .iter()
        .zip(kept)
        .map(|(&c, &k)| if k { c } else { f64::INFINITY })
        .collect();
    if base.iter().all(|c| !c.is_finite()) {
        return None;
    }
    argmin_random_tie(&base, rng)
}

/// A stale replica priced slower than `chosen` whose cost at the profile's speed is no higher
/// than `chosen`'s: sending it the request gives up no cache and no queue position, only the
/// learned speed, which is what is in doubt. The retry is bounded by the staleness itself: once
/// sent a request, a replica is not stale again for `speed_retry_s`.
fn retry_instead(
    input: &Input,
    at_profile: &[f64],
    chosen: usize,
    rng: &mut SplitMix64,
) -> Option<usize> {
    let limit = at_profile.get(chosen).copied()?;
    let kept: Vec<bool> = stale_slower(input, chosen)?
        .iter()
        .zip(at_profile)
        .map(|(&s, &c)| s && c <= limit)
        .collect();
    cheapest_of(at_profile, &kept, rng)
}

/// How far apart two replicas' costs must be, in standard errors of the difference of their
/// learned log factors, before the cheaper one is trusted to be cheaper: 2, about a 95% interval.
pub const TIE_STANDARD_ERRORS: f64 = 2.0;

/// The lowest cost; also returns every replica's terms. Replicas whose cost is above the lowest
/// by less than their learned speeds' uncertainty ([`Input::speed_spread`], times
/// [`TIE_STANDARD_ERRORS`]) are tied with it, and among the tied the cost at the profile's speed
/// decides (what is known: cache, queue, batch), then chance. Without this a fleet of alike
/// replicas whose factors differ by estimator noise sent every fresh prompt to the one that
/// happened to look fastest (40 of 40 at factors 1-6% apart), and a replica learned
/// slow from a few unlucky requests was never tried again.
pub fn choose(
    input: &Input,
    k: &KvTimeParams,
    profile: &EngineProfile,
    mean_prefill_s: f64,
    rng: &mut SplitMix64,
) -> (Choice, Vec<Terms>) {
    let all = priced(input, k, profile, mean_prefill_s);
    let costs: Vec<f64> = all.iter().map(|t| t.cost(k)).collect();
    let lowest = pick_lowest(&costs, input.avoided, rng);
    let tied = tied_with(input, &costs, lowest);
    let any_stale = input.speed_stale.contains(&true);
    let replica = if tied.is_none() && !any_stale {
        lowest
    } else {
        // What is known without the learned speeds: cache, queue, batch.
        let at_profile: Vec<f64> = priced(
            &Input {
                speed: &[],
                ..*input
            },
            k,
            profile,
            mean_prefill_s,
        )
        .iter()
        .map(|t| t.cost(k))
        .collect();
        let chosen = tied
            .and_then(|tied| cheapest_of(&at_profile, &tied, rng))
            .unwrap_or(lowest);
        // Only where the replica chosen would start the request at once: the fleet has room, so
        // all that is at stake is the retried replica's speed. A busy fleet tries a slow replica
        // by itself once its queues cost more than the slowness; retrying there moved coding
        // sessions, which then stayed, onto replicas that really were slow.
        let idle = all.get(chosen).is_some_and(|t| t.wait <= 0.0);
        if idle {
            retry_instead(input, &at_profile, chosen, rng).unwrap_or(chosen)
        } else {
            chosen
        }
    };
    (
        Choice {
            replica,
            costs,
            fallback: None,
        },
        all,
    )
}

/// `kv_time` as a [`Policy`]: its weights, the engine profile its times are priced against, and
/// every replica's terms for the last request chosen.
#[derive(Clone, Debug)]
pub struct KvTime {
    params: KvTimeParams,
    profile: EngineProfile,
    last_terms: Vec<Terms>,
    /// Mean predicted prefill time of the requests this worker placed (s), over about the last
    /// [`PREFILL_MEMORY`] of them; 0 before the first.
    mean_prefill_s: f64,
}

/// Requests over which [`KvTime`]'s mean prefill time is taken (an exponential average whose
/// older half weighs this many requests): long enough that one long prompt does not swing the
/// count of requests queued, short enough to follow a change of traffic within a minute.
pub const PREFILL_MEMORY: f64 = 32.0;

impl KvTime {
    pub fn new(params: KvTimeParams, profile: EngineProfile) -> KvTime {
        KvTime {
            params,
            profile,
            last_terms: Vec::new(),
            mean_prefill_s: 0.0,
        }
    }
}

impl Policy for KvTime {
    fn needs(&self) -> Needs {
        Needs {
            speed: true,
            working_set: (self.params.evict_weight > 0.0).then_some(CacheSizing::AtLeast {
                cache_tokens: self.profile.kv_cache_tokens,
            }),
            ..Needs::default()
        }
    }

    fn choose(&mut self, input: &Input, rng: &mut SplitMix64) -> Choice {
        let (c, terms) = choose(input, &self.params, &self.profile, self.mean_prefill_s, rng);
        if let Some(p) = terms.get(c.replica).map(|t| t.prefill)
            && p.is_finite()
            && p >= 0.0
        {
            self.mean_prefill_s = if self.mean_prefill_s > 0.0 {
                let a = 1.0 - 0.5f64.powf(1.0 / PREFILL_MEMORY);
                self.mean_prefill_s + a * (p - self.mean_prefill_s)
            } else {
                p
            };
        }
        self.last_terms = terms;
        c
    }

    fn last_terms(&self) -> &[Terms] {
        &self.last_terms
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::LoadTotals;
    use crate::policy::{fit, load_only_input};

    fn input<'a>(load: &'a [LoadTotals], overlap: &'a [f64], avoided: &'a [bool]) -> Input<'a> {
        Input {
            request_blocks: 256.0,
            overlap,
            identity_blocks: 256,
            ..load_only_input(load, avoided)
        }
    }

    fn busy(prefill_work: u64, running: u32, context_tokens: u64) -> LoadTotals {
        LoadTotals {
            prefill_tokens: prefill_work,
            decode_blocks: context_tokens / 16,
            active_requests: running,
        }
    }

    #[test]
    fn an_idle_cold_replica_costs_exactly_its_prefill() {
        let p = EngineProfile::default();
        let load = [LoadTotals::default(), busy(50_000, 20, 200_000)];
        let t = terms(&input(&load, &[0.0, 256.0], &[false; 2]), &p);
        assert_eq!(
            t[0].cost(&KvTimeParams::default()),
            p.prefill_s(4096.0, 0.0)
        );
        assert_eq!(t[0].wait + t[0].decode + t[0].stall + t[0].evict, 0.0);
    }

    /// Issue-42's shape: three replicas hold a shared prefix and queue work; the fourth holds
    /// nothing and is idle. When its prefill takes less time than the others' wait, it wins.
    #[test]
    fn a_replica_without_the_shared_prefix_wins_once_the_holders_queue_up() {
        let p = EngineProfile::default();
        let k = KvTimeParams::default();
        let overlap = [0.0, 250.0, 250.0, 250.0];
        let mut rng = SplitMix64::new(1);
        // Holders idle: the cached prefix wins.
        let idle = [LoadTotals::default(); 4];
        let (c, _) = choose(&input(&idle, &overlap, &[false; 4]), &k, &p, 0.0, &mut rng);
        assert_ne!(c.replica, 0);
        // Holders each with more queued prefill than the cold prefill takes: replica 0 wins.
        let cold = p.prefill_s(4096.0, 0.0);
        let queued = (cold / p.work_s(1.0) * 1.5) as u64;
        let load = [
            LoadTotals::default(),
            busy(queued, 0, 0),
            busy(queued, 0, 0),
            busy(queued, 0, 0),
        ];
        let (c, t) = choose(&input(&load, &overlap, &[false; 4]), &k, &p, 0.0, &mut rng);
        assert_eq!(c.replica, 0, "{t:?}");
    }

    /// At saturation a move's extra prefill is priced for the requests queued behind it: the
    /// holder of the prompt's cache, busier than the rest, keeps the request once every replica
    /// has a backlog of requests like it; with no record of what requests cost, or with an idle
    /// fleet, the move is made as before.
    #[test]
    fn a_backlogged_fleet_prices_a_moves_extra_prefill_for_the_requests_behind() {
        let p = EngineProfile::default();
        let k = KvTimeParams {
            later_weight: 1.0,
            ..KvTimeParams::default()
        };
        let overlap = [250.0, 0.0, 0.0, 0.0];
        let cold = p.prefill_s(4096.0, 0.0);
        let queue = |waits: f64| (cold * waits / p.work_s(1.0)) as u64;
        let load = [
            busy(queue(2.0), 0, 0),
            busy(queue(0.5), 0, 0),
            busy(queue(0.5), 0, 0),
            busy(queue(0.5), 0, 0),
        ];
        let i = input(&load, &overlap, &[false; 4]);
        let mut rng = SplitMix64::new(1);
        let (moved, t) = choose(&i, &k, &p, 0.0, &mut rng);
        assert_ne!(moved.replica, 0, "{t:?}");
        assert!(t.iter().all(|t| t.later == 0.0));
        let (kept, t) = choose(&i, &k, &p, cold, &mut rng);
        assert_eq!(kept.replica, 0, "{t:?}");
        assert_eq!(t[0].later, 0.0, "the holder adds the least work");
        assert!(t[1].later > 0.5 * cold, "{t:?}");
        let off = KvTimeParams::default();
        assert_eq!(off.later_weight, 0.0, "off by default");
        let (c, t) = choose(&i, &off, &p, cold, &mut rng);
        assert_ne!(c.replica, 0);
        assert!(
            t.iter().all(|t| t.later == 0.0),
            "off: not priced, not shown"
        );
        // Idle: nobody is behind.
        let idle = [LoadTotals::default(); 4];
        let (_, t) = choose(&input(&idle, &overlap, &[false; 4]), &k, &p, cold, &mut rng);
        assert!(t.iter().all(|t| t.later == 0.0), "{t:?}");
    }

    /// The mean prefill the count of requests behind is taken in starts at the first request's
    /// and moves a share of the way toward each next one, never by more than its difference.
    #[test]
    fn the_policy_learns_the_mean_prefill_of_what_it_places() {
        let p = EngineProfile::default();
        let mut kt = KvTime::new(KvTimeParams::default(), p.clone());
        let idle = [LoadTotals::default(); 2];
        let mut rng = SplitMix64::new(3);
        let first = input(&idle, &[0.0, 0.0], &[false; 2]);
        kt.choose(&first, &mut rng);
        let cold = p.prefill_s(4096.0, 0.0);
        assert!((kt.mean_prefill_s - cold).abs() < 1e-12);
        let hot = input(&idle, &[250.0, 250.0], &[false; 2]);
        kt.choose(&hot, &mut rng);
        let warm = p.prefill_s(96.0, 4000.0);
        assert!(kt.mean_prefill_s < cold && kt.mean_prefill_s > warm);
        let step = (cold - kt.mean_prefill_s) / (cold - warm);
        assert!((step - (1.0 - 0.5f64.powf(1.0 / PREFILL_MEMORY))).abs() < 1e-9);
    }

    #[test]
    fn a_slower_replica_costs_more_for_the_same_work() {
        let p = EngineProfile::default();
        let load = [busy(1000, 4, 10_000); 2];
        let mut i = input(&load, &[0.0, 0.0], &[false; 2]);
        let speed = [2.0, 1.0];
        i.speed = &speed;
        let t = terms(&i, &p);
        assert!((t[0].ttft() - 2.0 * t[1].ttft()).abs() < 1e-12);
        assert!(t[0].cost(&KvTimeParams::default()) > t[1].cost(&KvTimeParams::default()));
    }

    /// The noise case: alike idle replicas whose learned factors differ by estimator noise
    /// (1-6%) share fresh prompts; the same differences known exactly send every prompt to the
    /// fastest.
    #[test]
    fn factors_apart_by_less_than_their_uncertainty_are_ties() {
        let p = EngineProfile::default();
        let k = KvTimeParams::default();
        let load = [LoadTotals::default(); 4];
        let speed = [1.0, 1.02, 1.04, 1.06];
        let mut rng = SplitMix64::new(7);
        let mut count = |spread: f64| {
            let spreads = [spread; 4];
            let mut i = input(&load, &[0.0; 4], &[false; 4]);
            i.speed = &speed;
            i.speed_spread = &spreads;
            let mut n = [0u32; 4];
            for _ in 0..400 {
                n[choose(&i, &k, &p, 0.0, &mut rng).0.replica] += 1;
            }
            n
        };
        let noisy = count(0.05);
        assert!(noisy.iter().all(|&c| c > 60), "{noisy:?}");
        assert_eq!(count(0.001), [400, 0, 0, 0]);
        assert_eq!(count(0.0), [400, 0, 0, 0]);
    }

    /// A stale replica learned slow is retried with a request it would serve as well at the
    /// profile's speed (idle, no cache elsewhere), never with one that gives up a cache hit or a
    /// shorter queue, and never when it is avoided.
    #[test]
    fn a_stale_replica_is_retried_only_where_it_costs_nothing_known() {
        let p = EngineProfile::default();
        let k = KvTimeParams::default();
        let load = [LoadTotals::default(); 3];
        let speed = [2.5, 1.0, 1.0];
        let mut rng = SplitMix64::new(3);
        let stale = [true, false, false];
        let mut i = input(&load, &[0.0; 3], &[false; 3]);
        i.speed = &speed;
        assert_ne!(
            choose(&i, &k, &p, 0.0, &mut rng).0.replica,
            0,
            "fresh: priced slow"
        );
        i.speed_stale = &stale;
        assert_eq!(
            choose(&i, &k, &p, 0.0, &mut rng).0.replica,
            0,
            "stale: retried"
        );
        // Replica 1 holds half the prompt: the retry would give that up.
        let overlap = [0.0, 128.0, 0.0];
        let mut cached = input(&load, &overlap, &[false; 3]);
        cached.speed = &speed;
        cached.speed_stale = &stale;
        assert_eq!(choose(&cached, &k, &p, 0.0, &mut rng).0.replica, 1);
        // Replica 0 queues work: the retry would wait behind it.
        let queued = [
            busy(4096, 0, 0),
            LoadTotals::default(),
            LoadTotals::default(),
        ];
        let mut waits = input(&queued, &[0.0; 3], &[false; 3]);
        waits.speed = &speed;
        waits.speed_stale = &stale;
        assert_ne!(choose(&waits, &k, &p, 0.0, &mut rng).0.replica, 0);
        // Avoided (unhealthy, draining): never.
        let mut avoided = input(&load, &[0.0; 3], &[true, false, false]);
        avoided.speed = &speed;
        avoided.speed_stale = &stale;
        assert_ne!(choose(&avoided, &k, &p, 0.0, &mut rng).0.replica, 0);
    }

    /// Among tied replicas what is known decides: the one holding the prompt's cache keeps it,
    /// even where its learned factor is a little higher; an avoided replica never ties.
    #[test]
    fn among_ties_the_cost_at_the_profiles_speed_decides() {
        let p = EngineProfile::default();
        let k = KvTimeParams::default();
        let load = [LoadTotals::default(); 3];
        // Replica 1 holds an eighth of the prompt and looks 30% slow; the uncertainty covers that.
        let overlap = [0.0, 32.0, 0.0];
        let speed = [1.0, 1.3, 1.0];
        let spreads = [0.2; 3];
        let mut i = input(&load, &overlap, &[true, false, false]);
        i.speed = &speed;
        i.speed_spread = &spreads;
        let mut rng = SplitMix64::new(3);
        for _ in 0..50 {
            let (c, _) = choose(&i, &k, &p, 0.0, &mut rng);
            assert_eq!(c.replica, 1, "{:?}", c.costs);
        }
        // Known exactly, 30% slower outweighs an eighth of the prompt: replica 2 (0 avoided).
        i.speed_spread = &[];
        assert_eq!(choose(&i, &k, &p, 0.0, &mut rng).0.replica, 2);
    }

    #[test]
    fn eviction_is_priced_only_past_the_cache_and_by_the_share_that_returns() {
        let p = EngineProfile::default();
        let load = [LoadTotals::default(); 2];
        let mut i = input(&load, &[0.0, 0.0], &[false; 2]);
        // Replica 0: 95 of 100 blocks, adds 10 (5 pushed out); replica 1: fits.
        let ws = [fit(95.0, 10.0, 100.0), fit(50.0, 10.0, 100.0)];
        i.working_set = &ws;
        i.reuse_share = 0.5;
        let t = terms(&i, &p);
        assert!((t[0].evict - 0.5 * p.work_s(5.0 * 16.0)).abs() < 1e-15);
        assert_eq!(t[1].evict, 0.0);
        i.reuse_share = 0.0;
        assert_eq!(terms(&i, &p)[0].evict, 0.0);
    }

    #[test]
    fn running_decodes_delay_the_first_token_by_their_share_of_the_steps() {
        let p = EngineProfile::default();
        // 100 decodes over 200K tokens of KV: a memory-bound step of about 16 ms.
        let batch = busy(0, 100, 200_000);
        let t = terms(
            &input(&[batch, LoadTotals::default()], &[0.0; 2], &[false; 2]),
            &p,
        );
        assert_eq!(t[1].wait, 0.0, "nothing runs on replica 1");
        // A 4,096-token prefill: half the step in progress, then one step whose compute (4,196
        // tokens) outlasts the batch's read, so the batch adds its tokens and sampling only.
        let step = p.step_s(100.0, 200_000.0);
        let shared = (5.0 * 100.0 + 27.0 * 100.0) * 1e-6;
        assert!((t[0].wait - (0.5 * step + shared)).abs() < 1e-12, "{t:?}");
        // A 16-token prefill (the rest cached) is bound by the batch's read: about a whole step.
        let one = [batch];
        let t = terms(&input(&one, &[255.0], &[false]), &p);
        let own = p.prefill_s(16.0, 4080.0);
        assert!(t[0].wait > step, "{t:?}");
        assert!(t[0].ttft() > own + step, "{t:?}");
    }

    #[test]
    fn a_replica_whose_cache_is_full_of_decodes_waits_for_room() {
        let p = EngineProfile::default();
        // Both idle in prefill; replica 0's running requests fill its cache, replica 1's half of it.
        let full = busy(0, 100, p.kv_cache_tokens as u64);
        let half = busy(0, 50, p.kv_cache_tokens as u64 / 2);
        let t = terms(&input(&[full, half], &[0.0, 0.0], &[false; 2]), &p);
        // Beyond what their running decodes add to the steps, only the full one waits for room.
        let batch = |n: f64, k: f64| batch_s(&p, n, k, 0.0, 4096.0);
        assert!(t[0].wait - batch(100.0, p.kv_cache_tokens) > 0.05, "{t:?}");
        assert_eq!(
            t[1].wait,
            batch(50.0, (p.kv_cache_tokens as u64 / 2) as f64)
        );
    }

    #[test]
    fn a_replica_lacking_the_adapter_costs_the_load_time_more() {
        use crate::adapters::AdapterFit::{FreeSlot, Full, Held, Unknown};
        let p = EngineProfile::default();
        let k = KvTimeParams::default();
        let load = [busy(1000, 4, 10_000); 4];
        let mut i = input(&load, &[0.0; 4], &[false; 4]);
        let fits = [Held, FreeSlot, Full, Unknown];
        i.adapter = &fits;
        i.adapter_load_s = 0.3;
        let t = terms(&i, &p);
        for (r, extra) in [(1, 0.3), (3, 0.0)] {
            assert!((t[r].cost(&k) - t[0].cost(&k) - extra).abs() < 1e-12, "{r}");
            assert!((t[r].ttft() - t[0].ttft() - extra).abs() < 1e-12, "{r}");
        }
        // Every slot taken: the load, then about half an output of steps for a slot to free.
        let slot_wait = 256.0 / 2.0 * p.step_s(4.0, 10_000.0);
        assert!((t[2].adapter - 0.3 - slot_wait).abs() < 1e-12, "{t:?}");
        let mut rng = SplitMix64::new(5);
        assert_eq!(choose(&i, &k, &p, 0.0, &mut rng).0.replica, 0);
        i.adapter_load_s = f64::NAN;
        let t = terms(&i, &p);
        assert_eq!((t[0].adapter, t[1].adapter, t[3].adapter), (0.0, 0.0, 0.0));
    }

    #[test]
    fn hostile_loads_give_finite_costs() {
        let p = EngineProfile::default();
        let load = [busy(u64::MAX, u32::MAX, u64::MAX), LoadTotals::default()];
        let mut i = input(&load, &[f64::MAX, -3.0], &[false; 2]);
        i.expected_output_tokens = f64::NAN;
        let mut rng = SplitMix64::new(3);
        let (c, t) = choose(&i, &KvTimeParams::default(), &p, 0.0, &mut rng);
        assert!(t.iter().all(|t| !t.cost(&KvTimeParams::default()).is_nan()));
        assert_eq!(c.replica, 1);
    }
}
