//! The `kv_time` section: the engine profile predictions start from and the cost's weights, each
//! with its unit.

use serde::Deserialize;

use super::{ConfigError, err, non_negative};

/// The engine profile `kv_time` starts from: a built-in name or the coefficients themselves.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum ProfileSpec {
    Named(String),
    Custom(crate::speed::EngineProfile),
}

impl ProfileSpec {
    /// The profile (the default for an unknown name, which [`KvTimeParams::validate`] refuses).
    pub fn profile(&self) -> crate::speed::EngineProfile {
        match self {
            ProfileSpec::Named(n) => crate::speed::EngineProfile::named(n).unwrap_or_default(),
            ProfileSpec::Custom(p) => p.clone(),
        }
    }
}

/// The `kv_time` section: the cost in seconds (docs/design/design.md section 2.7;
/// [`crate::policy::kv_time`]). Eight tunables, each with its unit, and one switch.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KvTimeParams {
    /// The engine profile predictions start from: `llama-3.1-8b-h100` (the default),
    /// `llama-3.1-70b-h100-tp4`, `llama-3.1-8b-a100-40gb`, or an object with the coefficients
    /// (`scripts/fit-profile`'s output).
    pub profile: ProfileSpec,
    /// Seconds of this request's time to first token that one second of delay to the requests
    /// already running on a replica is worth (s/s).
    pub stall_weight: f64,
    /// Seconds of this request's time to first token that one second of re-prefill of the contexts
    /// a placement pushes out of a cache (times the share that comes back) is worth (s/s).
    pub evict_weight: f64,
    /// Seconds of this request's time to first token that one second more of its own decode time
    /// is worth (s/s).
    pub decode_weight: f64,
    /// Observed first tokens after which an older observation of a replica's speed weighs half
    /// (requests); 0: speeds are not learned.
    pub speed_halflife: f64,
    /// How many times faster or slower than its profile a replica may be learned to be (x, >= 1).
    pub speed_bound: f64,
    /// Pseudo-observations at the other replicas' pooled speed (the profile's before they have
    /// any) each replica's learned speed starts from (requests): a replica's first few slow
    /// requests (a cold engine) move its factor only part of the way. Halves with every
    /// `speed_halflife` of real evidence.
    pub speed_prior: f64,
    /// Seconds a worker goes without observing or sending a request to a replica it has learned
    /// something of before that estimate is stale (s); 0: never. A stale replica priced slower than
    /// the one chosen is sent the request instead when its cost at the profile's speed is no
    /// higher (so the retry gives up no cache and no queue position), and the evidence its next
    /// observation finds weighs half. This is what keeps
    /// a replica whose first requests met a cold engine from being locked out, at a bounded price
    /// on a replica that really is slow: at most one request per `speed_retry_s` per worker.
    pub speed_retry_s: f64,
    /// Seconds of this request's time to first token that one second of delay to the requests
    /// arriving after it is worth (s/s): the delay its extra prefill work (over the least any
    /// replica would do) imposes while the fleet has a backlog. 0 (off) by default: at 1 it
    /// lowered coding agents' TTFT median at saturation by 8-38% and raised their p99 by 4-8%
    /// at 32 sessions in flight on 4 replicas (docs/reports/notebook/saturation.md).
    pub later_weight: f64,
    /// Take the progress of the prefill running at the head of each replica's queue off its
    /// predicted wait (the load table books each prefill whole until its first token). Off by
    /// default: on, the busy replicas' predicted waits at 32-40 coding-agent sessions in flight
    /// went from 9-17% too long to within 4%, the TTFT median fell 5-19% and the p99 rose up to
    /// 5%; chat's and A100 fleets' TTFT p99 rose up to 1.17x (docs/reports/notebook/prefill-head.md).
    pub head_progress: bool,
}

impl Default for KvTimeParams {
    fn default() -> Self {
        Self {
            profile: ProfileSpec::Named(crate::speed::PROFILE_NAMES[0].to_string()),
            stall_weight: 0.1,
            evict_weight: 1.0,
            decode_weight: 0.1,
            speed_halflife: 32.0,
            speed_bound: 4.0,
            speed_prior: 2.0,
            speed_retry_s: 5.0,
            later_weight: 0.0,
            head_progress: false,
        }
    }
}

impl KvTimeParams {
    pub fn validate(&self) -> Result<(), ConfigError> {
        match &self.profile {
            ProfileSpec::Named(n) if crate::speed::EngineProfile::named(n).is_none() => {
                return Err(err(
                    "kv_time.profile",
                    format!(
                        "unknown profile {n:?} (known: {})",
                        crate::speed::PROFILE_NAMES.join(", ")
                    ),
                ));
            }
            ProfileSpec::Custom(p) => p.validate().map_err(|m| err("kv_time.profile", m))?,
            _ => {}
        }
        for (name, v) in [
            ("kv_time.stall_weight", self.stall_weight),
            ("kv_time.evict_weight", self.evict_weight),
            ("kv_time.decode_weight", self.decode_weight),
            ("kv_time.speed_halflife", self.speed_halflife),
            ("kv_time.speed_prior", self.speed_prior),
            ("kv_time.speed_retry_s", self.speed_retry_s),
            ("kv_time.later_weight", self.later_weight),
        ] {
            non_negative(name, v)?;
        }
        if !(self.speed_bound.is_finite() && self.speed_bound >= 1.0) {
            return Err(err(
                "kv_time.speed_bound",
                format!("must be a finite number >= 1, got {}", self.speed_bound),
            ));
        }
        Ok(())
    }

    /// How speeds are learned, from this section.
    pub fn speed_params(&self) -> crate::speed::SpeedParams {
        crate::speed::SpeedParams {
            halflife: self.speed_halflife,
            bound: self.speed_bound,
            prior: self.speed_prior,
            retry_s: self.speed_retry_s,
        }
    }
}
