//! `kv_time`: the cost of sending a request to a replica, in seconds (docs/design/design.md section
//! 2.7). Per candidate replica r, with `s_r` its learned speed factor ([`crate::speed::Speeds`]),
//! `u_r` the request's prompt tokens r does not cache, `c_r` those it does, `n_r` the requests r
//! runs, `K_r` the KV tokens they hold, `o` the expected output tokens and `P` the prompt's tokens:
//!
//! ```text
//! cost_r = wait_r + prefill_r + decode_weight * decode_r + stall_weight * stall_r + evict_weight * evict_r
//!          + later_weight * later_r
//! wait_r    = s_r * work_s(queued prefill work on r)          each booked request priced by its own
//!                                                             uncached tokens and context, less
//!                                                             what the running head has done
//!                                                             (`head_done`, with `head_progress`)
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
    AdapterFit, CacheSizing, Choice, Input, Needs, Observation, Policy, argmin_random_tie,
    pick_lowest,
};
use crate::config::KvTimeParams;
use crate::rng::SplitMix64;
use crate::speed::{EngineProfile, Learning};

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
            let queued = (e.prefill_tokens as f64
                - head_done(profile, s, n, context, input.prefill_head.get(r)))
            .max(0.0);
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

/// The booked prefill work (the load table's unit) the head of a replica's queue has done: its work
/// times the share of its predicted time (its prefill and the batch's share of its steps, at the
/// replica's speed `s`) that has passed, at most all of it. The table books each request whole until
/// its first token; without this a busy replica's wait was predicted too long by however far its
/// current prefill had got (realized / predicted 0.67 where it had run 4 s or more, on coding
/// agents at 32 in flight), and sessions moved off their history for waits mostly over. A head past
/// its predicted time counts as done but no more: a replica that has stalled is not credited beyond
/// the one prefill.
fn head_done(
    profile: &EngineProfile,
    s: f64,
    n: f64,
    context: f64,
    head: Option<&crate::load::HeadProgress>,
) -> f64 {
    let Some(h) = head else {
        return 0.0;
    };
    if !(h.work > 0.0 && h.elapsed_s > 0.0) {
        return 0.0;
    }
    let takes = s * (profile.work_s(h.work) + batch_s(profile, n, context, 0.0, h.work));
    if !(takes.is_finite() && takes > 0.0) {
        return 0.0;
    }
    h.work * (h.elapsed_s / takes).min(1.0)
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

/// `kv_time` as a [`Policy`]: its weights, the engine profile its times are priced against,
/// every replica's terms for the last request chosen, and each replica's speed as learned from the
/// requests it placed ([`Policy::observe`]).
#[derive(Clone, Debug)]
pub struct KvTime {
    params: KvTimeParams,
    profile: EngineProfile,
    last_terms: Vec<Terms>,
    /// Each replica's learned speed against the profile, and the predictions awaiting their first
    /// token: the router reads the speeds into [`Input::speed`] and reports what became of each
    /// request placed.
    learning: Learning,
    /// Mean predicted prefill time of the requests this worker placed (s), over about the last
    /// [`PREFILL_MEMORY`] of them; 0 before the first.
    mean_prefill_s: f64,
}

/// Requests over which [`KvTime`]'s mean prefill time is taken (an exponential average whose
/// older half weighs this many requests): long enough that one long prompt does not swing the
/// count of requests queued, short enough to follow a change of traffic within a minute.
pub const PREFILL_MEMORY: f64 = 32.0;

impl KvTime {
    /// The policy for `replicas` replicas, their speeds not learned yet.
    pub fn new(params: KvTimeParams, profile: EngineProfile, replicas: usize) -> KvTime {
        KvTime {
            learning: Learning::new(replicas, params.speed_params(), true)
                .with_overhead(profile.request_overhead_us / 1e6),
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
            prefill_head: self.params.head_progress,
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
        // The terms now describe this request, not admitted yet.
        self.learning.routed();
        c
    }

    fn last_terms(&self) -> &[Terms] {
        &self.last_terms
    }

    fn observe(&mut self, event: Observation) {
        match event {
            Observation::Admitted {
                request_id,
                replica,
                now_ms,
            } => {
                let predicted = self.last_terms.get(replica).map(Terms::ttft);
                self.learning
                    .admitted(request_id, replica, predicted, now_ms);
            }
            Observation::FirstToken { request_id, now_ms } => {
                self.learning.first_token(request_id, now_ms)
            }
            Observation::Released { request_id } => self.learning.released(request_id),
            Observation::Vacated { replica } => self.learning.forget(replica),
        }
    }

    fn learning(&self) -> Option<&Learning> {
        Some(&self.learning)
    }

    fn learning_mut(&mut self) -> Option<&mut Learning> {
        Some(&mut self.learning)
    }
}

#[cfg(test)]
mod tests;
