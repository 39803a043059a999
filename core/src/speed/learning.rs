//! What `kv_time` learns from the requests a router routes: each replica's speed ([`Speeds`]) and the
//! predictions that wait for their request's first token to be learned from.
//!
//! It is held by the `kv_time` policy ([`crate::policy::kv_time::KvTime`]), which calls four hooks as
//! the router reports what became of each request it placed ([`crate::policy::Policy::observe`]),
//! and the router reads one answer:
//!
//! | hook | when |
//! |---|---|
//! | [`Learning::routed`] | the policy's terms now describe a request not admitted yet |
//! | [`Learning::admitted`] | the request was sent: the replica's send is noted and, once per routed request, its prediction kept |
//! | [`Learning::first_token`] | its first token arrived: the observed time against the prediction |
//! | [`Learning::released`] | it ended (a request released before its first token teaches nothing) |
//! | [`Learning::inputs`] | the policy's inputs: factors, their spreads and which are stale |
//!
//! [`Learning::forget`] drops a vacated slot's speed and predictions.

use hashbrown::HashMap;

use super::{SpeedEstimate, SpeedParams, Speeds};

/// Most admitted requests whose first token `kv_time` waits for to learn a speed: past it, new
/// requests are not learned from (a proxy that loses stream ends would otherwise grow it forever).
pub const MAX_PENDING_PREDICTIONS: usize = 1 << 16;

/// A request admitted and not yet at its first token.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Prediction {
    replica: usize,
    /// Predicted time to first token at the profile's speed (s).
    at_profile_s: f64,
    /// Admission time (ms).
    admitted_ms: u64,
}

/// The speed factors learned from times to first token, and the predictions awaiting them.
#[derive(Clone, Debug)]
pub struct Learning {
    /// Whether the policy reads learned speeds: sends are noted and [`Learning::inputs`] given only
    /// then.
    on: bool,
    /// Each replica's learned speed against the engine profile.
    speeds: Speeds,
    /// Per request id: its prediction, until its first token. Bounded by
    /// [`MAX_PENDING_PREDICTIONS`].
    pending: HashMap<u64, Prediction>,
    /// The policy's last terms belong to a request not admitted yet.
    terms_unadmitted: bool,
    /// Time a request spends outside the engine's steps (s; the profile's `request_overhead_us`:
    /// the API server's parsing, the hand-off to the engine, the first token's way back). It is
    /// taken off each observed time to first token before the speed learns from it: the factor
    /// scales the engine's steps, and a constant the factor tried to absorb would make a replica
    /// serving short cached prompts look slow (8 ms on a 5 ms prediction is a factor of 2.6).
    overhead_s: f64,
}

/// `kv_time`'s inputs from what it learned: per replica its speed factor, the factor's
/// uncertainty and whether it is stale.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LearnedInputs {
    pub factors: Vec<f64>,
    pub spreads: Vec<f64>,
    pub stale: Vec<bool>,
}

impl Learning {
    /// `on`: the policy reads learned speeds ([`crate::policy::Needs::speed`]).
    pub fn new(replicas: usize, params: SpeedParams, on: bool) -> Learning {
        Learning {
            on,
            speeds: Speeds::new(replicas, params),
            pending: HashMap::new(),
            terms_unadmitted: false,
            overhead_s: 0.0,
        }
    }

    /// [`Learning::new`] for an engine whose first tokens carry `overhead_s` seconds outside its
    /// steps (`request_overhead_us` of the profile).
    pub fn with_overhead(mut self, overhead_s: f64) -> Learning {
        self.overhead_s = if overhead_s.is_finite() {
            overhead_s.max(0.0)
        } else {
            0.0
        };
        self
    }

    /// The policy's terms now describe a request routed and not admitted yet.
    pub fn routed(&mut self) {
        self.terms_unadmitted = true;
    }

    /// `request_id` was sent to `replica` at `now_ms`; `predicted_ttft_s` is the policy's predicted
    /// time to first token there at the replica's learned speed, if it made one. The prediction is
    /// kept (at the profile's speed, so the observation measures the factor) only for the first
    /// admission after [`Learning::routed`] and while fewer than [`MAX_PENDING_PREDICTIONS`] wait.
    pub fn admitted(
        &mut self,
        request_id: u64,
        replica: usize,
        predicted_ttft_s: Option<f64>,
        now_ms: u64,
    ) {
        if self.on {
            self.speeds.sent(replica, now_ms);
        }
        if let Some(ttft) = predicted_ttft_s
            && std::mem::take(&mut self.terms_unadmitted)
            && self.pending.len() < MAX_PENDING_PREDICTIONS
        {
            let prediction = Prediction {
                replica,
                at_profile_s: ttft / self.speeds.factor(replica),
                admitted_ms: now_ms,
            };
            self.pending.insert(request_id, prediction);
        }
    }

    /// `request_id`'s first token arrived at `now_ms`: its replica's speed learns from the observed
    /// time to first token against the prediction.
    pub fn first_token(&mut self, request_id: u64, now_ms: u64) {
        if let Some(p) = self.pending.remove(&request_id) {
            // An observation the overhead alone explains (or more) teaches nothing: `observe`
            // drops a time that is not positive.
            let observed_s = now_ms.saturating_sub(p.admitted_ms) as f64 / 1e3 - self.overhead_s;
            self.speeds
                .observe(p.replica, p.at_profile_s, observed_s, now_ms);
        }
    }

    /// `request_id` ended: its prediction, if still waiting, is dropped.
    pub fn released(&mut self, request_id: u64) {
        self.pending.remove(&request_id);
    }

    /// The slot's member left: its speed and its requests' predictions are forgotten.
    pub fn forget(&mut self, replica: usize) {
        self.speeds.forget(replica);
        self.pending.retain(|_, p| p.replica != replica);
    }

    /// The policy's inputs at `now_ms`; empty when the policy does not read learned speeds.
    pub fn inputs(&self, now_ms: u64) -> LearnedInputs {
        if !self.on {
            return LearnedInputs::default();
        }
        let (factors, spreads) = self.speeds.factors_and_spreads();
        LearnedInputs {
            factors,
            spreads,
            stale: self.speeds.stale(now_ms),
        }
    }

    /// One replica's learned time factor against the profile (2: twice as slow; 1 unknown).
    pub fn factor(&self, replica: usize) -> f64 {
        self.speeds.factor(replica)
    }

    /// This worker's own estimates of the replicas' speeds, for the proxy's other workers.
    pub fn local(&self) -> Vec<SpeedEstimate> {
        self.speeds.local()
    }

    /// Replaces a peer worker's estimates of the replicas' speeds.
    pub fn set_peer(&mut self, peer: u32, estimates: &[SpeedEstimate]) {
        self.speeds.set_peer(peer, estimates);
    }

    /// Drops a peer worker's estimates.
    pub fn clear_peer(&mut self, peer: u32) {
        self.speeds.clear_peer(peer);
    }

    /// Predictions waiting for their first token.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests;
