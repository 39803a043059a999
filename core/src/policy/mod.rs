//! The routing policies, one module each, behind one trait, [`Policy`]: a policy is a type holding
//! its own parameters and state (round robin's cursor, `session_hash`'s ring, `kv_time`'s engine
//! profile and last terms), built from the configuration by [`from_config`]. It decides from one
//! shared [`Input`]: the request's size, each replica's effective load, its KV overlap with the
//! request, and which replicas are avoided, plus the optional inputs it asks for with
//! [`Policy::needs`] (gathering them costs time on the request path, so the router gathers only
//! those). [`crate::router::Router::route`] builds the input and calls [`Policy::choose`]; a policy
//! returns its [`Choice`]: the replica, the per-replica costs where it scores, and why it fell back
//! when it did. Each module keeps its decision as a plain function of the input and the policy's
//! parameters too, so each can be read and tested alone.
//!
//! | policy | module | in one line |
//! |---|---|---|
//! | `round_robin` | [`round_robin`] | the next replica up, in turn |
//! | `least_load` | [`least_load`] | lowest load cost, cache ignored |
//! | `session_hash` | [`session_hash`] | consistent hash of the session key; least load without one |
//! | `prefix_affinity` | [`prefix_affinity`] | replica this router last sent the longest prefix to |
//! | `kv_affinity` | [`kv_affinity`] | largest KV overlap reported by the replicas |
//! | `kv_load` | [`kv_load`] | lowest prefill-after-overlap plus decode load in blocks (kvsteer's first default) |
//! | `kv_time` | [`kv_time`] | lowest cost in seconds from each replica's learned speed (docs/design/design.md) |
//! | `adapter_affinity` | [`adapter_affinity`] | baseline: replicas holding the request's LoRA adapter, else a free slot, then least load (GIE's rule) |

pub mod adapter_affinity;
pub mod choose;
pub mod kv_affinity;
pub mod kv_load;
pub mod kv_time;
pub mod least_load;
pub mod prefix_affinity;
pub mod ring;
pub mod round_robin;
pub mod session_hash;

pub use choose::{argmin_random_tie, masked, pick_lowest, softmax_sample};
pub use ring::HashRing;

pub use crate::adapters::AdapterFit;
use crate::config::{PolicyKind, RoutingConfig};
use crate::load::{HeadProgress, LoadTotals};
use crate::rng::SplitMix64;
use crate::speed::Learning;

/// Why a decision did not come from the configured policy's first choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// `session_hash` without a session key: least load.
    NoSessionKey,
    /// `prefix_affinity` with too small a match: least load.
    BelowMatchThreshold,
    /// The body could not be read: least load.
    BodyUnreadable,
}

/// What every policy decides from. Per-replica slices all have one entry per replica.
/// Over 15 fields: one borrowed view of everything any policy reads, filled once per request.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    /// The prompt in blocks, rounded up (`ceil(prompt_tokens / block_size)`).
    pub request_blocks: f64,
    /// Tokens per block.
    pub block_size: f64,
    /// Effective load (the router's bookings, combined with the replicas' reports as configured).
    pub load: &'a [LoadTotals],
    /// KV overlap in blocks, tier-weighted (0 for a stale replica).
    pub overlap: &'a [f64],
    /// Leading blocks of the request already active on each replica (booked by requests in flight);
    /// empty when the policy does not use it.
    pub active_prefix: &'a [f64],
    /// Leading blocks this router itself last sent to each replica (the approximate index, for
    /// `prefix_affinity`); empty otherwise.
    pub affinity: &'a [u32],
    /// Full blocks of the request's identity.
    pub identity_blocks: usize,
    pub session_key: Option<&'a str>,
    /// Replicas to avoid (down while another is up).
    pub avoided: &'a [bool],
    /// Output tokens the request is expected to generate ([`crate::output::OutputEstimate`]).
    pub expected_output_tokens: f64,
    /// Per replica: its recent working set against its cache ([`crate::working_set`]); empty when
    /// the working-set term is off.
    pub working_set: &'a [CacheFit],
    /// What the working-set term's weight is multiplied by: 1, or with
    /// `kv_load.overflow_reuse_floor` above 0, how far the traffic's reuse share is above the floor
    /// ([`crate::policy::kv_load::reuse_ramp`]).
    pub working_set_scale: f64,
    /// Per replica: its learned time factor against the engine profile (`kv_time`,
    /// [`crate::speed::Speeds`]); empty: 1 for every replica.
    pub speed: &'a [f64],
    /// Per replica: the uncertainty of its learned factor, as the standard error of its log
    /// ([`crate::speed::Speeds::spreads`]); empty: known exactly.
    pub speed_spread: &'a [f64],
    /// Per replica: whether its learned factor is stale and it may be retried
    /// ([`crate::speed::Speeds::stale`]); empty: none is.
    pub speed_stale: &'a [bool],
    /// Share of recently requested prompt blocks that had been requested before (`kv_time`'s chance
    /// that a context pushed out of a cache comes back); 0 when not tracked.
    pub reuse_share: f64,
    /// Per replica: where the request's LoRA adapter stands there ([`crate::adapters`]); empty when
    /// the request names no adapter or adapters are not configured: unknown everywhere.
    pub adapter: &'a [AdapterFit],
    /// Seconds a replica takes to load an adapter it lacks (`adapters.load_ms`); 0 without one.
    pub adapter_load_s: f64,
    /// Per replica: how long the prefill at the head of its queue has run, and its booked work
    /// ([`crate::load::PrefillHead`]); empty: not known, the queue counts whole.
    pub prefill_head: &'a [HeadProgress],
}

/// A policy's decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub replica: usize,
    /// Per replica where the policy scores (lower is better); empty otherwise.
    pub costs: Vec<f64>,
    pub fallback: Option<FallbackReason>,
}

/// A routing policy: its parameters and its state, and the decision it makes from an [`Input`].
/// `Send + Sync` so that a router stays as shareable between threads as its other state.
pub trait Policy: PolicyClone + std::fmt::Debug + Send + Sync {
    /// Which optional inputs the router gathers for this policy. Asked once, when the router is
    /// built: a policy's needs follow from its configuration, fixed for the router's life.
    fn needs(&self) -> Needs {
        Needs::default()
    }

    /// Chooses a replica. `rng` breaks ties and samples; the router's single generator, so the
    /// decisions of a seeded router replay exactly.
    fn choose(&mut self, input: &Input, rng: &mut SplitMix64) -> Choice;

    /// Every replica's cost terms for the last request chosen, for a policy that prices time
    /// (`kv_time`): the router predicts the chosen replica's time to first token from them, and an
    /// operator reads them to see why a replica won. Empty for the others.
    fn last_terms(&self) -> &[kv_time::Terms] {
        &[]
    }

    /// What became of a request the router routed, for a policy that learns from it (`kv_time`
    /// learns each replica's speed from its times to first token); the others ignore it.
    fn observe(&mut self, _event: Observation) {}

    /// What the policy learned of the replicas' speeds, for a policy that reads them
    /// ([`Needs::speed`]: `kv_time`); `None` for the others.
    fn learning(&self) -> Option<&Learning> {
        None
    }

    /// [`Policy::learning`], to take the proxy's other workers' estimates in.
    fn learning_mut(&mut self) -> Option<&mut Learning> {
        None
    }
}

/// What became of a routed request ([`Policy::observe`]), in the order the router sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observation {
    /// The request, as last chosen, was sent to `replica` at `now_ms`.
    Admitted {
        request_id: u64,
        replica: usize,
        now_ms: u64,
    },
    /// Its first token arrived at `now_ms`.
    FirstToken { request_id: u64, now_ms: u64 },
    /// It ended (completed or aborted).
    Released { request_id: u64 },
    /// The slot's member left (vacated): what was learned of it is forgotten.
    Vacated { replica: usize },
}

/// Cloning a boxed policy, so that a router (which holds one) can be cloned.
pub trait PolicyClone {
    fn clone_box(&self) -> Box<dyn Policy>;
}

impl<T: Policy + Clone + 'static> PolicyClone for T {
    fn clone_box(&self) -> Box<dyn Policy> {
        Box::new(self.clone())
    }
}

impl Clone for Box<dyn Policy> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// The optional parts of [`Input`] a policy reads; what it does not ask for is left empty.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Needs {
    /// [`Input::active_prefix`]: the leading blocks of the request already active on each replica.
    pub active_prefix: bool,
    /// [`Input::affinity`]: the approximate index's matches for the request. A token prompt's
    /// decisions are recorded in that index only for a policy that reads them back.
    pub affinity: bool,
    /// [`Input::working_set`], and how a replica's cache is sized in it; `None`: the working-set
    /// term is off and the router keeps no working set.
    pub working_set: Option<CacheSizing>,
    /// [`Input::speed`] and [`Input::reuse_share`]: each replica's learned speed factor and the
    /// traffic's reuse share.
    pub speed: bool,
    /// [`Input::prefill_head`]: how long each replica's current prefill has run.
    pub prefill_head: bool,
}

/// One replica's recent working set against its prefix cache, in blocks: what the working-set
/// term prices (how much of it a placement would push out of the cache).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CacheFit {
    /// Distinct blocks requested from the replica recently.
    pub working_set: f64,
    /// How many of the request's blocks are not among them (what placing it there adds).
    pub added: f64,
    /// The replica's cache, in blocks; 0 while not known (the term is then off for it).
    pub cache: f64,
}

impl CacheFit {
    /// Blocks the placement would push out of the cache: what it adds beyond the room left,
    /// at most what it adds.
    pub fn pushed_out(&self) -> f64 {
        self.added
            .min((self.working_set + self.added - self.cache).max(0.0))
    }
}

/// How the working-set term sizes a replica's prefix cache (in blocks) in [`Input::working_set`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CacheSizing {
    /// `kv_load.replica_cache_tokens` when set, else as learned from the replica's feed once it
    /// has evicted (the most blocks it held), else the largest another replica has shown
    /// ([`crate::router::Router::cache_size_blocks`]); 0 while none has.
    Configured,
    /// As the feed shows it (the GPU KV blocks its load report gives, else the most it held once
    /// it evicted); before that, `cache_tokens` (tokens, the engine profile's cache) or the
    /// smallest cache another replica has shown, whichever is smaller, and at least what it holds:
    /// a replica that has not shown its size yet is never priced as one with room for everything.
    AtLeast { cache_tokens: f64 },
}

/// The policy `cfg.policy` names, with its parameters from `cfg`, for a router of `replicas`
/// replicas.
pub fn from_config(cfg: &RoutingConfig, replicas: usize) -> Box<dyn Policy> {
    match cfg.policy {
        PolicyKind::RoundRobin => Box::new(round_robin::RoundRobin::default()),
        PolicyKind::LeastLoad => Box::new(least_load::LeastLoad::new(cfg.least_load.clone())),
        PolicyKind::SessionHash => Box::new(session_hash::SessionHash::new(
            HashRing::seeded(
                0..replicas,
                cfg.session_hash.virtual_nodes,
                cfg.session_hash.ring_seed,
            ),
            cfg.least_load.clone(),
        )),
        PolicyKind::PrefixAffinity => Box::new(prefix_affinity::PrefixAffinity::new(
            cfg.prefix_affinity.match_threshold,
            cfg.least_load.clone(),
        )),
        PolicyKind::KvAffinity => Box::new(kv_affinity::KvAffinity),
        PolicyKind::KvLoad => Box::new(kv_load::KvLoad::new(cfg.kv_load.clone())),
        PolicyKind::KvTime => Box::new(kv_time::KvTime::new(
            cfg.kv_time.clone(),
            cfg.kv_time.profile.profile(),
            replicas,
        )),
        PolicyKind::AdapterAffinity => Box::new(adapter_affinity::AdapterAffinity::new(
            cfg.least_load.clone(),
        )),
    }
}

/// A [`CacheFit`] from its three figures, for the tests.
#[cfg(test)]
pub(crate) fn fit(working_set: f64, added: f64, cache: f64) -> CacheFit {
    CacheFit {
        working_set,
        added,
        cache,
    }
}

/// An input with load and avoided replicas only, every optional part empty: for the tests of the
/// policies that read no more.
#[cfg(test)]
pub(crate) fn load_only_input<'a>(load: &'a [LoadTotals], avoided: &'a [bool]) -> Input<'a> {
    Input {
        request_blocks: 1.0,
        block_size: 16.0,
        load,
        overlap: &[],
        active_prefix: &[],
        affinity: &[],
        identity_blocks: 1,
        session_key: None,
        avoided,
        expected_output_tokens: 256.0,
        working_set: &[],
        working_set_scale: 1.0,
        speed: &[],
        speed_spread: &[],
        speed_stale: &[],
        reuse_share: 0.0,
        adapter: &[],
        adapter_load_s: 0.0,
        prefill_head: &[],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each policy asks the router to gather: the optional inputs follow from its own
    /// parameters, and a policy that does not read an input never asks for it.
    #[test]
    fn each_policy_asks_for_what_it_reads() {
        let needs = |policy: PolicyKind, edit: &dyn Fn(&mut RoutingConfig)| {
            let mut cfg = RoutingConfig {
                policy,
                ..RoutingConfig::default()
            };
            edit(&mut cfg);
            from_config(&cfg, 4).needs()
        };
        let none = |_: &mut RoutingConfig| {};
        for p in [
            PolicyKind::RoundRobin,
            PolicyKind::LeastLoad,
            PolicyKind::SessionHash,
            PolicyKind::KvAffinity,
            PolicyKind::AdapterAffinity,
        ] {
            assert_eq!(needs(p, &none), Needs::default(), "{p:?}");
        }
        let affinity = needs(PolicyKind::PrefixAffinity, &none);
        assert!(affinity.affinity && !affinity.speed && affinity.working_set.is_none());

        let kv_load = needs(PolicyKind::KvLoad, &|c| {
            c.kv_load.assume_kv_reuse = true;
            c.kv_load.overflow_weight = 1.0;
        });
        assert!(kv_load.active_prefix && !kv_load.affinity && !kv_load.speed);
        assert_eq!(kv_load.working_set, Some(CacheSizing::Configured));
        let kv_load = needs(PolicyKind::KvLoad, &|c| {
            c.kv_load.assume_kv_reuse = false;
            c.kv_load.overflow_weight = 0.0;
        });
        assert_eq!(kv_load, Needs::default());

        let kv_time = needs(PolicyKind::KvTime, &|c| c.kv_time.evict_weight = 1.0);
        assert!(kv_time.speed && !kv_time.active_prefix && !kv_time.affinity);
        assert!(matches!(
            kv_time.working_set,
            Some(CacheSizing::AtLeast { cache_tokens }) if cache_tokens > 0.0
        ));
        let kv_time = needs(PolicyKind::KvTime, &|c| c.kv_time.evict_weight = 0.0);
        assert!(kv_time.speed && kv_time.working_set.is_none());
    }

    /// A cloned policy carries its state: round robin's clone continues from the same cursor.
    #[test]
    fn a_cloned_policy_keeps_its_state() {
        let cfg = RoutingConfig {
            policy: PolicyKind::RoundRobin,
            ..RoutingConfig::default()
        };
        let mut p = from_config(&cfg, 3);
        let load = [LoadTotals::default(); 3];
        let input = load_only_input(&load, &[false; 3]);
        let mut rng = SplitMix64::new(1);
        assert_eq!(p.choose(&input, &mut rng).replica, 0);
        let mut q = p.clone();
        assert_eq!(p.choose(&input, &mut rng).replica, 1);
        assert_eq!(q.choose(&input, &mut rng).replica, 1);
    }
}
