//! Each replica's speed against its engine profile, learned from observed times to first token.
//!
//! The estimate is a weighted mean of log ratios `x = ln(observed / predicted)` (a median-like
//! estimate that one wild observation cannot move far; each `x` clamped to `ln bound`), with three
//! guards against learning the wrong thing from a few unlucky observations:
//!
//! - **A prior toward the fleet.** A replica starts with `prior` pseudo-observations at the other
//!   replicas' pooled factor (the profile's speed, log factor 0, before they have any): a
//!   replica whose first two or three requests met a cold engine (a warm-up compile, an empty page
//!   cache) is not learned as `bound` times slower at once. The prior halves with every `halflife`
//!   of real evidence, so a well-observed replica's factor is its observations' (within a few
//!   percent). Toward the fleet, not the profile: when every replica runs 30% slower than the
//!   profile says, one with little evidence must not look 30% cheaper than the others.
//! - **Retries of estimates in doubt** (`retry_s`): a replica learned from fewer than a half-life
//!   of observations that a worker has neither observed nor sent a request to for `retry_s` is
//!   stale, and `kv_time` sends it a request it costs nothing known to send there
//!   ([`crate::policy::kv_time::choose`]). An answer that agrees with the estimate doubles the wait
//!   before the next retry; one that does not halves the stale evidence. Without this a replica
//!   learned slow from a cold engine's first requests was locked out for as long as the others
//!   could take the load (60-90 s at 2-6 clients after three slow requests).
//! - **An uncertainty per estimate** ([`Speeds::spreads`]): the spread of the replica's own
//!   observations (held toward the pooled spread), over the evidence behind its estimate. `kv_time` treats two
//!   replicas whose costs differ by less than their estimates' uncertainty as tied
//!   ([`crate::policy::kv_time::choose`]), so estimator noise does not steer every fresh prompt to
//!   whichever replica happens to look 2% faster.
//!
//! Each worker learns from its own share of the requests and takes in the other workers'
//! estimates ([`SpeedEstimate`]), weighed by the evidence behind each.

use crate::record::{Record, f64_at};
use std::collections::BTreeMap;

/// Shortest predicted time to first token an observation is learned from: below it, what the
/// router cannot see (the network, the API server, the first token's way back) dominates.
pub const MIN_PREDICTED_S: f64 = 0.02;

/// The most times the wait before retrying a replica doubles: a replica that really is slow is
/// retried at least once every `2^6 = 64` times `retry_s` (5 minutes and 20 s at the default), so
/// a change is still noticed within minutes.
pub const MAX_RETRY_DOUBLINGS: u32 = 6;

/// How speeds are learned; every field has a unit ([`crate::config::KvTimeParams`] documents the
/// configuration names).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpeedParams {
    /// Observations after which an older one weighs half (requests); 0 turns learning off.
    pub halflife: f64,
    /// How many times faster or slower than its profile a replica may be learned to be (x, >= 1).
    pub bound: f64,
    /// Pseudo-observations at the profile's speed a replica's estimate starts from (requests).
    pub prior: f64,
    /// Seconds without an observation or a request after which a replica's estimate is stale: it
    /// is retried with a request it costs nothing to send there; the wait doubles with each retry
    /// that confirms the estimate, and one that does not halves the stale evidence; 0: never.
    pub retry_s: f64,
}

/// This worker's evidence about one replica: the weighted sum of log ratios and the weights, as of
/// its last observation at `at_ms`.
#[derive(Clone, Copy, Debug, Default)]
struct Evidence {
    sum: f64,
    /// The weighted sum of squared log ratios: with `sum` and `weight`, how far this replica's
    /// own observations disagree with each other.
    sq: f64,
    weight: f64,
    at_ms: u64,
}

/// Each replica's speed against its profile: this worker's own observations, and what the proxy's
/// other workers learned from theirs (each sees a share of the requests, so alone each would learn
/// a slow replica that many times later).
#[derive(Clone, Debug)]
pub struct Speeds {
    own: Vec<Evidence>,
    /// When this worker last sent each replica a request (ms).
    sent_ms: Vec<u64>,
    /// Per replica: how many retries in a row confirmed its estimate (each doubles the wait
    /// before the next), at most [`MAX_RETRY_DOUBLINGS`].
    backoff: Vec<u32>,
    /// Weight an observation loses at each later one (from the half-life); 0: learning off.
    alpha: f64,
    halflife: f64,
    /// ln(bound).
    bound_ln: f64,
    prior: f64,
    retry_ms: f64,
    /// Pooled variance of the observations around their replica's estimate (log units squared),
    /// and how many observations it stands on.
    noise_var: f64,
    noise_n: u64,
    /// The other workers' estimates, by worker number.
    peers: BTreeMap<u32, Vec<SpeedEstimate>>,
}

/// One worker's estimate of one replica's speed, as it shares it with the other workers.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpeedEstimate {
    /// ln(observed / predicted): the mean of the worker's own observations (no prior), bounded by
    /// the bound.
    pub log_factor: f64,
    /// The evidence it stands on, in observations, at most the half-life's window (`1 / alpha`):
    /// a worker that has seen more of a replica's requests weighs more.
    pub weight: f64,
}

/// Shared between a proxy's workers as little-endian `log_factor f64 | weight f64` pairs, one
/// per replica ([`crate::record`]). Values are taken as they are: [`Speeds::set_peer`] discards
/// those it cannot use.
impl Record for SpeedEstimate {
    const LEN: usize = 16;

    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.log_factor.to_le_bytes());
        out.extend_from_slice(&self.weight.to_le_bytes());
    }

    fn take(b: &[u8]) -> Option<SpeedEstimate> {
        Some(SpeedEstimate {
            log_factor: f64_at(b, 0),
            weight: f64_at(b, 8),
        })
    }
}

impl Speeds {
    pub fn new(replicas: usize, p: SpeedParams) -> Speeds {
        let alpha = if p.halflife > 0.0 {
            1.0 - 0.5f64.powf(1.0 / p.halflife)
        } else {
            0.0
        };
        let finite_non_negative = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        Speeds {
            own: vec![Evidence::default(); replicas],
            sent_ms: vec![0; replicas],
            backoff: vec![0; replicas],
            alpha,
            halflife: p.halflife,
            bound_ln: p.bound.max(1.0).ln(),
            prior: finite_non_negative(p.prior),
            retry_ms: finite_non_negative(p.retry_s) * 1e3,
            noise_var: 0.0,
            noise_n: 0,
            peers: Default::default(),
        }
    }

    /// The evidence's weight window: at most this many observations count.
    fn window(&self) -> f64 {
        if self.alpha > 0.0 {
            1.0 / self.alpha
        } else {
            0.0
        }
    }

    /// Replica `r`'s own evidence (none for an index out of range).
    fn own_evidence(&self, r: usize) -> Evidence {
        self.own.get(r).copied().unwrap_or_default()
    }

    /// How far replica `r`'s own observations spread around their mean (log units squared), held
    /// toward the pooled spread by `max(prior, 1)` pseudo-observations of it: a replica whose
    /// observations disagree with each other (a cold start, then healthy answers) is uncertain
    /// even when it has several, so it ties with the others sooner and is tried again.
    fn variance(&self, r: usize) -> f64 {
        let e = self.own_evidence(r);
        let ss = if e.weight > 0.0 {
            (e.sq - e.sum * e.sum / e.weight).max(0.0)
        } else {
            0.0
        };
        let k = self.prior.max(1.0);
        (k * self.noise_var.max(0.0) + ss) / (k + e.weight)
    }

    /// Replica `r`'s evidence, its own and the other workers': (sum, weight).
    fn evidence(&self, r: usize) -> (f64, f64) {
        let own = self.own_evidence(r);
        let (mut sum, mut weight) = (own.sum, own.weight);
        for e in self.peers.values().filter_map(|v| v.get(r)) {
            sum += e.log_factor * e.weight;
            weight += e.weight;
        }
        (sum, weight)
    }

    /// Every replica's evidence pooled: (sum, weight). What the others' evidence says
    /// of a replica with little of its own ([`Speeds::estimate`]).
    fn pooled(&self) -> (f64, f64) {
        (0..self.own.len()).fold((0.0, 0.0), |(s, w), r| {
            let (rs, rw) = self.evidence(r);
            (s + rs, w + rw)
        })
    }

    /// Replica `r`'s estimate, given every replica's evidence `pooled`: (log factor,
    /// the evidence's weight with the prior's). The prior sits at the other replicas' pooled
    /// factor (the profile's, 0, before they have any): when the whole fleet runs slower or faster
    /// than the profile (another GPU clock, a model the profile fits loosely), a replica with little
    /// evidence is priced like the others, not at the profile's speed, which would make
    /// it look cheaper than the replicas just observed and draw their sessions away. The others',
    /// not its own: a replica's few slow requests must not set its own prior.
    fn estimate(&self, r: usize, pooled: (f64, f64)) -> (f64, f64) {
        if self.alpha == 0.0 {
            return (0.0, 0.0);
        }
        let (sum, weight) = self.evidence(r);
        let (others_sum, others_weight) = (pooled.0 - sum, pooled.1 - weight);
        let fleet = if others_weight > 1e-9 {
            (others_sum / others_weight).clamp(-self.bound_ln, self.bound_ln)
        } else {
            0.0
        };
        // The prior halves with every half-life's worth of evidence.
        let prior = self.prior * 0.5f64.powf(weight / self.halflife);
        let all = prior + weight;
        let l = if all > 0.0 {
            (sum + prior * fleet) / all
        } else {
            fleet
        };
        (l.clamp(-self.bound_ln, self.bound_ln), all)
    }

    /// The replica's time factor: 2 means it takes twice the profile's time; 1 for a
    /// replica index out of range.
    pub fn factor(&self, replica: usize) -> f64 {
        if replica >= self.own.len() {
            return 1.0;
        }
        self.estimate(replica, self.pooled()).0.exp()
    }

    /// Every replica's factor.
    pub fn factors(&self) -> Vec<f64> {
        self.factors_and_spreads().0
    }

    /// Every replica's uncertainty ([`Speeds::factors_and_spreads`]).
    pub fn spreads(&self) -> Vec<f64> {
        self.factors_and_spreads().1
    }

    /// Every replica's factor and its uncertainty: the standard error of its log
    /// factor (the pooled spread of observations around their estimates over the square root of
    /// the evidence, prior included), at most `ln bound`; 0 before any observation (every factor is
    /// then 1 and exact) or with learning off. One pass, for the request path.
    pub fn factors_and_spreads(&self) -> (Vec<f64>, Vec<f64>) {
        let pooled = self.pooled();
        (0..self.own.len())
            .map(|r| {
                let (l, all) = self.estimate(r, pooled);
                let var = self.variance(r);
                let spread = if var == 0.0 {
                    0.0
                } else if all > 0.0 {
                    (var / all).sqrt().min(self.bound_ln)
                } else {
                    self.bound_ln
                };
                (l.exp(), spread)
            })
            .unzip()
    }

    /// How long replica `r` may go unobserved before its estimate is stale: `retry_s`, doubled for
    /// each retry in a row that confirmed the estimate; infinite when retrying is off.
    fn retry_after_ms(&self, r: usize) -> f64 {
        if self.retry_ms == 0.0 {
            return f64::INFINITY;
        }
        let doublings = self.backoff.get(r).copied().unwrap_or(0);
        self.retry_ms * f64::from(1u32 << doublings)
    }

    /// This worker sent replica `r` a request at `now_ms`: its estimate is not stale before
    /// `retry_s` has passed again.
    pub fn sent(&mut self, r: usize, now_ms: u64) {
        if let Some(t) = self.sent_ms.get_mut(r) {
            *t = (*t).max(now_ms);
        }
    }

    /// Which replicas' estimates are stale at `now_ms`: in doubt (learned from fewer than a
    /// half-life of observations, by this worker and the others), and this worker has neither
    /// observed them nor sent them a request for `retry_s` (doubled per confirming retry). Empty
    /// when learning or retrying is off.
    pub fn stale(&self, now_ms: u64) -> Vec<bool> {
        if self.alpha == 0.0 || self.retry_ms == 0.0 {
            return Vec::new();
        }
        (0..self.own.len())
            .map(|r| {
                // In doubt: something was learned, but less than a half-life of it. A replica
                // learned slow from a half-life of consistent answers is not retried: on fleets
                // whose slow replicas really were slow, retrying them placed coding sessions there
                // (TTFT p50 1.08-1.10x); a busy fleet still tries it by cost.
                let w = self.evidence(r).1;
                let learned = w > 0.0 && w < self.halflife;
                let last = self.own[r].at_ms.max(self.sent_ms[r]);
                learned && now_ms.saturating_sub(last) as f64 >= self.retry_after_ms(r)
            })
            .collect()
    }

    /// This worker's own estimates, for the other workers.
    pub fn local(&self) -> Vec<SpeedEstimate> {
        let window = self.window();
        (0..self.own.len())
            .map(|r| {
                let Evidence { sum, weight, .. } = self.own_evidence(r);
                SpeedEstimate {
                    log_factor: if weight > 0.0 {
                        (sum / weight).clamp(-self.bound_ln, self.bound_ln)
                    } else {
                        0.0
                    },
                    weight: weight.min(window),
                }
            })
            .collect()
    }

    /// Replaces worker `peer`'s estimates. Ignored when learning is off or the count is not the
    /// replica count; values that are not finite, or weights below 0, count as no observation,
    /// and factors are held within the bound (the record comes from shared memory).
    pub fn set_peer(&mut self, peer: u32, estimates: &[SpeedEstimate]) {
        if self.alpha == 0.0 || estimates.len() != self.own.len() {
            return;
        }
        let window = self.window();
        let clean = estimates
            .iter()
            .map(|e| {
                if e.log_factor.is_finite() && e.weight.is_finite() && e.weight > 0.0 {
                    SpeedEstimate {
                        log_factor: e.log_factor.clamp(-self.bound_ln, self.bound_ln),
                        weight: e.weight.min(window),
                    }
                } else {
                    SpeedEstimate::default()
                }
            })
            .collect();
        self.peers.insert(peer, clean);
    }

    /// Forgets worker `peer`'s estimates (it stopped publishing).
    pub fn clear_peer(&mut self, peer: u32) {
        self.peers.remove(&peer);
    }

    /// Forgets a replica's learned factor (its slot now holds another engine).
    pub fn forget(&mut self, replica: usize) {
        if let Some(e) = self.own.get_mut(replica) {
            *e = Evidence::default();
        }
        if let Some(b) = self.backoff.get_mut(replica) {
            *b = 0;
        }
    }

    /// A request's observed time to first token against the profile's prediction at factor 1,
    /// at `now_ms`. Ignored when either is not a positive finite number or the prediction is
    /// below [`MIN_PREDICTED_S`].
    pub fn observe(&mut self, replica: usize, predicted_s: f64, observed_s: f64, now_ms: u64) {
        if self.alpha == 0.0
            || replica >= self.own.len()
            || !(predicted_s.is_finite() && observed_s.is_finite())
            || predicted_s < MIN_PREDICTED_S
            || observed_s <= 0.0
        {
            return;
        }
        let x = (observed_s / predicted_s)
            .ln()
            .clamp(-self.bound_ln, self.bound_ln);
        // The spread around the estimate as it stood: a running mean at first, then an
        // exponential one over the half-life's window.
        let (before, _) = self.estimate(replica, self.pooled());
        let spread = self.variance(replica).sqrt();
        self.noise_n = self.noise_n.saturating_add(1);
        let w = self.alpha.max(1.0 / self.noise_n as f64);
        self.noise_var += w * ((x - before).powi(2) - self.noise_var);
        let e = self.own[replica];
        // An observation after the replica's estimate went stale (a retry's, usually) either
        // agrees with it, within two of its observations' spread, and the next retry waits twice
        // as long; or shows the replica changed (a cold engine warmed up), and the stale evidence
        // weighs half (only half, however long the pause) and retries start over.
        let gap = now_ms.saturating_sub(e.at_ms) as f64;
        let mut stale = 1.0;
        if e.weight > 0.0 && gap >= self.retry_after_ms(replica) {
            if (x - before).abs() <= 2.0 * spread {
                self.backoff[replica] = (self.backoff[replica] + 1).min(MAX_RETRY_DOUBLINGS);
            } else {
                self.backoff[replica] = 0;
                stale = 0.5;
            }
        }
        let keep = (1.0 - self.alpha) * stale;
        self.own[replica] = Evidence {
            sum: e.sum * keep + x,
            sq: e.sq * keep + x * x,
            weight: e.weight * keep + 1.0,
            at_ms: now_ms,
        };
    }
}

#[cfg(test)]
mod tests;
