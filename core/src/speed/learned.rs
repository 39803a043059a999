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
//!   profile says, one whose evidence has faded must not look 30% cheaper than the others.
//! - **Evidence that fades with time** (`memory_s`): an observation `memory_s` seconds old weighs
//!   half. A replica that stopped being chosen because it looked slow sees its old evidence fade
//!   back toward the fleet's, so it is tried again; without this it was locked out for as long as
//!   the others could take the load (60-90 s at 2-6 clients after three slow requests).
//! - **An uncertainty per estimate** ([`Speeds::spreads`]): the pooled spread of the observations
//!   around their replicas' estimates, over the evidence behind each estimate. `kv_time` treats two
//!   replicas whose costs differ by less than their estimates' uncertainty as tied
//!   ([`crate::policy::kv_time::choose`]), so estimator noise does not steer every fresh prompt to
//!   whichever replica happens to look 2% faster.
//!
//! Each worker learns from its own share of the requests and takes in the other workers'
//! estimates ([`SpeedEstimate`]), weighed by the evidence behind each.

use std::collections::BTreeMap;

/// Shortest predicted time to first token an observation is learned from: below it, what the
/// router cannot see (the network, the API server, the first token's way back) dominates.
pub const MIN_PREDICTED_S: f64 = 0.02;

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
    /// Seconds after which an observation weighs half; 0: evidence does not fade with time.
    pub memory_s: f64,
    /// Seconds without an observation or a request after which a replica's estimate is stale: it
    /// is retried with a request it costs nothing to send there, and the evidence the next
    /// observation finds weighs half; 0: never.
    pub retry_s: f64,
}

/// This worker's evidence about one replica: the weighted sum of log ratios and the weights, as of
/// `at_ms` (fading with time is applied when read).
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
    /// Weight an observation loses at each later one (from the half-life); 0: learning off.
    alpha: f64,
    halflife: f64,
    /// ln(bound).
    bound_ln: f64,
    prior: f64,
    memory_ms: f64,
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
    /// The evidence it stands on, in observations, faded with age and at most the half-life's
    /// window (`1 / alpha`): a worker that has seen more of a replica's recent requests weighs
    /// more, one that saw long ago less.
    pub weight: f64,
}

impl SpeedEstimate {
    /// Bytes per estimate in [`SpeedEstimate::encode_all`].
    pub const ENCODED_LEN: usize = 16;

    /// Little-endian `log_factor f64, weight f64` per replica, for shared memory.
    pub fn encode_all(all: &[SpeedEstimate]) -> Vec<u8> {
        let mut out = Vec::with_capacity(all.len() * Self::ENCODED_LEN);
        for e in all {
            out.extend_from_slice(&e.log_factor.to_le_bytes());
            out.extend_from_slice(&e.weight.to_le_bytes());
        }
        out
    }

    /// Reads [`SpeedEstimate::encode_all`]'s bytes; `None` for a length that is not a whole
    /// number of estimates. Values are taken as they are: [`Speeds::set_peer`] discards those it
    /// cannot use.
    pub fn decode_all(bytes: &[u8]) -> Option<Vec<SpeedEstimate>> {
        if !bytes.len().is_multiple_of(Self::ENCODED_LEN) {
            return None;
        }
        let read = |b: &[u8]| f64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        Some(
            bytes
                .chunks_exact(Self::ENCODED_LEN)
                .map(|c| SpeedEstimate {
                    log_factor: read(&c[..8]),
                    weight: read(&c[8..]),
                })
                .collect(),
        )
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
            alpha,
            halflife: p.halflife,
            bound_ln: p.bound.max(1.0).ln(),
            prior: finite_non_negative(p.prior),
            memory_ms: finite_non_negative(p.memory_s) * 1e3,
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

    /// What is left at `now_ms` of a weight last updated at `at_ms`.
    fn fade(&self, at_ms: u64, now_ms: u64) -> f64 {
        if self.memory_ms > 0.0 && now_ms > at_ms {
            0.5f64.powf((now_ms - at_ms) as f64 / self.memory_ms)
        } else {
            1.0
        }
    }

    /// Replica `r`'s own evidence faded to `now_ms`: (sum, weight).
    fn own_at(&self, r: usize, now_ms: u64) -> (f64, f64) {
        let e = self.own_faded(r, now_ms);
        (e.sum, e.weight)
    }

    /// Replica `r`'s own evidence faded to `now_ms`, whole.
    fn own_faded(&self, r: usize, now_ms: u64) -> Evidence {
        self.own.get(r).map_or(Evidence::default(), |e| {
            let d = self.fade(e.at_ms, now_ms);
            Evidence {
                sum: e.sum * d,
                sq: e.sq * d,
                weight: e.weight * d,
                at_ms: e.at_ms,
            }
        })
    }

    /// How far replica `r`'s own observations spread around their mean (log units squared), held
    /// toward the pooled spread by `max(prior, 1)` pseudo-observations of it: a replica whose
    /// observations disagree with each other (a cold start, then healthy answers) is uncertain
    /// even when it has several, so it ties with the others sooner and is tried again.
    fn variance(&self, r: usize, now_ms: u64) -> f64 {
        let e = self.own_faded(r, now_ms);
        let ss = if e.weight > 0.0 {
            (e.sq - e.sum * e.sum / e.weight).max(0.0)
        } else {
            0.0
        };
        let k = self.prior.max(1.0);
        (k * self.noise_var.max(0.0) + ss) / (k + e.weight)
    }

    /// Replica `r`'s evidence at `now_ms`, its own and the other workers': (sum, weight).
    fn evidence(&self, r: usize, now_ms: u64) -> (f64, f64) {
        let (mut sum, mut weight) = self.own_at(r, now_ms);
        for e in self.peers.values().filter_map(|v| v.get(r)) {
            sum += e.log_factor * e.weight;
            weight += e.weight;
        }
        (sum, weight)
    }

    /// Every replica's evidence at `now_ms` pooled: (sum, weight). What the others' evidence says
    /// of a replica with little of its own ([`Speeds::estimate`]).
    fn pooled(&self, now_ms: u64) -> (f64, f64) {
        (0..self.own.len()).fold((0.0, 0.0), |(s, w), r| {
            let (rs, rw) = self.evidence(r, now_ms);
            (s + rs, w + rw)
        })
    }

    /// Replica `r`'s estimate at `now_ms`, given every replica's evidence `pooled`: (log factor,
    /// the evidence's weight with the prior's). The prior sits at the other replicas' pooled
    /// factor (the profile's, 0, before they have any): when the whole fleet runs slower or faster
    /// than the profile (another GPU clock, a model the profile fits loosely), a replica whose
    /// evidence has faded is priced like the others, not at the profile's speed, which would make
    /// it look cheaper than the replicas just observed and draw their sessions away. The others',
    /// not its own: a replica's few slow requests must not set its own prior.
    fn estimate(&self, r: usize, now_ms: u64, pooled: (f64, f64)) -> (f64, f64) {
        if self.alpha == 0.0 {
            return (0.0, 0.0);
        }
        let (sum, weight) = self.evidence(r, now_ms);
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

    /// The replica's time factor at `now_ms`: 2 means it takes twice the profile's time; 1 for a
    /// replica index out of range.
    pub fn factor(&self, replica: usize, now_ms: u64) -> f64 {
        if replica >= self.own.len() {
            return 1.0;
        }
        self.estimate(replica, now_ms, self.pooled(now_ms)).0.exp()
    }

    /// Every replica's factor at `now_ms`.
    pub fn factors(&self, now_ms: u64) -> Vec<f64> {
        self.factors_and_spreads(now_ms).0
    }

    /// Every replica's uncertainty at `now_ms` ([`Speeds::factors_and_spreads`]).
    pub fn spreads(&self, now_ms: u64) -> Vec<f64> {
        self.factors_and_spreads(now_ms).1
    }

    /// Every replica's factor at `now_ms`, and its uncertainty: the standard error of its log
    /// factor (the pooled spread of observations around their estimates over the square root of
    /// the evidence, prior included), at most `ln bound`; 0 before any observation (every factor is
    /// then 1 and exact) or with learning off. One pass, for the request path.
    pub fn factors_and_spreads(&self, now_ms: u64) -> (Vec<f64>, Vec<f64>) {
        let pooled = self.pooled(now_ms);
        (0..self.own.len())
            .map(|r| {
                let (l, all) = self.estimate(r, now_ms, pooled);
                let var = self.variance(r, now_ms);
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

    /// This worker sent replica `r` a request at `now_ms`: its estimate is not stale before
    /// `retry_s` has passed again.
    pub fn sent(&mut self, r: usize, now_ms: u64) {
        if let Some(t) = self.sent_ms.get_mut(r) {
            *t = (*t).max(now_ms);
        }
    }

    /// Which replicas' estimates are stale at `now_ms`: something was learned of them (by this
    /// worker or another), and this worker has neither observed them nor sent them a request for
    /// `retry_s`. Empty when learning or retrying is off.
    pub fn stale(&self, now_ms: u64) -> Vec<bool> {
        if self.alpha == 0.0 || self.retry_ms == 0.0 {
            return Vec::new();
        }
        (0..self.own.len())
            .map(|r| {
                let learned = self.evidence(r, now_ms).1 > 0.0;
                let last = self.own[r].at_ms.max(self.sent_ms[r]);
                learned && now_ms.saturating_sub(last) as f64 >= self.retry_ms
            })
            .collect()
    }

    /// This worker's own estimates at `now_ms`, for the other workers.
    pub fn local(&self, now_ms: u64) -> Vec<SpeedEstimate> {
        let window = self.window();
        (0..self.own.len())
            .map(|r| {
                let (sum, weight) = self.own_at(r, now_ms);
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
        let (before, _) = self.estimate(replica, now_ms, self.pooled(now_ms));
        self.noise_n = self.noise_n.saturating_add(1);
        let w = self.alpha.max(1.0 / self.noise_n as f64);
        self.noise_var += w * ((x - before).powi(2) - self.noise_var);
        let mut e = self.own_faded(replica, now_ms);
        // Evidence the replica has gone `retry_s` without is stale: the replica may have changed
        // (a cold engine warmed up), so it weighs half. Only half, however long the pause: a
        // replica that really is slow keeps most of what was learned of it.
        let gap = now_ms.saturating_sub(e.at_ms) as f64;
        let stale = if self.retry_ms > 0.0 && e.weight > 0.0 && gap >= self.retry_ms {
            0.5
        } else {
            1.0
        };
        let keep = (1.0 - self.alpha) * stale;
        e = Evidence {
            sum: e.sum * keep + x,
            sq: e.sq * keep + x * x,
            weight: e.weight * keep + 1.0,
            at_ms: now_ms,
        };
        self.own[replica] = e;
    }
}

#[cfg(test)]
mod tests;
