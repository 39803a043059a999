//! Replica health learned from completions (docs/design/design.md section 2.4): a replica whose
//! requests fail loses its share of traffic within a few failures, and gets it back once it answers
//! again.
//!
//! The filter reports how each request it routed ended ([`Outcome`]): a success (a 2xx answer that
//! ended without an engine error), or a failure (an HTTP 5xx, or an engine error event inside a 200
//! SSE stream, as vLLM sends when generation fails after the headers went out). Client errors and
//! aborts are neither. Per replica the router keeps the successes and failures as exponentially
//! decaying counts (half-life `half_life_ms`), summed over its own observations and those its peer
//! worker VMs publish through shared data, like load. Their ratio is the replica's recent error rate.
//!
//! - A replica is **ejected** when its decayed failures reach `min_failures` and its error rate
//!   reaches `eject_error_rate`, or when `consecutive_failures` requests in a row on it failed (this
//!   worker's own; a replica that starts failing after a long healthy run has many recent successes
//!   that hold its rate down for a while). Every policy then avoids it, as it avoids a replica that is
//!   down, while some other replica is usable (neither down nor ejected).
//! - An ejected replica gets one **probe** request every `probe_interval_ms`: the request is sent there
//!   whatever the policy would have chosen, with the policy's choice as the retry backup, so Envoy's
//!   `retry_on: 5xx` re-sends it elsewhere if the probe fails. The filter claims each probe in shared
//!   data ([`Health::probe_due`], [`Health::probed_elsewhere`]), so that is one probe per interval for
//!   the whole proxy however many worker VMs it runs (one per worker without shared data).
//! - It is **restored** when its error rate is at most `restore_error_rate` and a request on it has
//!   succeeded since it was ejected (on any worker: the combined successes grew since then): probes
//!   that succeed add successes while the old failures decay. Decay alone never restores it (both counts decay alike,
//!   so the rate is unchanged without new outcomes), nor does a peer's record expiring: only
//!   successes do.
//!
//! Everything here is pure: time comes in as milliseconds, shared data goes through
//! [`HealthCounts::encode_all`] / [`HealthCounts::decode_all`].

use serde::Deserialize;

use crate::config::ConfigError;
use crate::record::{Record, f64_at};

/// The `health` section of the routing configuration.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HealthParams {
    /// Learn health from completions and avoid failing replicas. `false`: outcomes are ignored.
    pub enabled: bool,
    /// Half-life of the decaying success and failure counts.
    pub half_life_ms: u64,
    /// Error rate (failures over outcomes, both decayed) at or above which a replica is ejected.
    pub eject_error_rate: f64,
    /// Error rate at or below which an ejected replica is restored.
    pub restore_error_rate: f64,
    /// Decayed failures needed before a replica can be ejected (one failed request is not a trend).
    /// The default, 2.5, takes three failures within about a second (two never reach it).
    pub min_failures: f64,
    /// Requests in a row on a replica that failed (this worker's) that eject it whatever its rate;
    /// 0: never.
    pub consecutive_failures: u32,
    /// How often an ejected replica gets a probe request (for the whole proxy: the filter claims
    /// each probe in shared data; per worker VM without it).
    pub probe_interval_ms: u64,
}

impl Default for HealthParams {
    fn default() -> Self {
        Self {
            enabled: true,
            half_life_ms: 2_000,
            eject_error_rate: 0.5,
            restore_error_rate: 0.2,
            min_failures: 2.5,
            consecutive_failures: 3,
            probe_interval_ms: 1_000,
        }
    }
}

impl HealthParams {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| {
            Err(ConfigError::routing(format!("health.{field}"), message))
        };
        if !(1..=3_600_000).contains(&self.half_life_ms) {
            return err(
                "half_life_ms",
                format!("must be 1..=3600000, got {}", self.half_life_ms),
            );
        }
        let e = self.eject_error_rate;
        if !(e.is_finite() && e > 0.0 && e <= 1.0) {
            return err("eject_error_rate", format!("must be in (0, 1], got {e}"));
        }
        let r = self.restore_error_rate;
        if !(r.is_finite() && r >= 0.0 && r < e) {
            return err(
                "restore_error_rate",
                format!("must be >= 0 and below eject_error_rate ({e}), got {r}"),
            );
        }
        let m = self.min_failures;
        if !(m.is_finite() && (0.0..=1e6).contains(&m)) {
            return err("min_failures", format!("must be 0..=1000000, got {m}"));
        }
        if !(1..=3_600_000).contains(&self.probe_interval_ms) {
            return err(
                "probe_interval_ms",
                format!("must be 1..=3600000, got {}", self.probe_interval_ms),
            );
        }
        Ok(())
    }
}

/// How a routed request ended, as far as its replica's health goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A 2xx answer that ended without an engine error.
    Success,
    /// An HTTP 5xx, or an engine error event in the stream.
    Failure,
}

/// Largest decayed count kept: bounds the sums whatever peers publish.
const MAX_COUNT: f64 = 1e9;

/// Decayed successes and failures of one replica, as of some time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HealthCounts {
    pub ok: f64,
    pub err: f64,
}

impl HealthCounts {
    /// The counts `elapsed_ms` later: both halve every `half_life_ms`.
    pub fn decayed(self, elapsed_ms: u64, half_life_ms: u64) -> HealthCounts {
        if elapsed_ms == 0 {
            return self;
        }
        let f = (-(elapsed_ms as f64) / half_life_ms.max(1) as f64).exp2();
        HealthCounts {
            ok: self.ok * f,
            err: self.err * f,
        }
    }

    /// Failures over outcomes; 0 without any.
    pub fn error_rate(self) -> f64 {
        let total = self.ok + self.err;
        if total > 0.0 { self.err / total } else { 0.0 }
    }

    fn add(self, o: HealthCounts) -> HealthCounts {
        HealthCounts {
            ok: (self.ok + o.ok).min(MAX_COUNT),
            err: (self.err + o.err).min(MAX_COUNT),
        }
    }
}

/// Shared between a proxy's workers as little-endian `ok f64 | err f64` pairs, one per replica
/// ([`crate::record`]); a count that is not a finite number in `0..=1e9` is refused.
impl Record for HealthCounts {
    const LEN: usize = 16;

    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.ok.to_le_bytes());
        out.extend_from_slice(&self.err.to_le_bytes());
    }

    fn take(b: &[u8]) -> Option<HealthCounts> {
        let count = |v: f64| (v.is_finite() && (0.0..=MAX_COUNT).contains(&v)).then_some(v);
        Some(HealthCounts {
            ok: count(f64_at(b, 0))?,
            err: count(f64_at(b, 8))?,
        })
    }
}

/// Counts with the time they are as of.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Stamped {
    counts: HealthCounts,
    at_ms: u64,
}

impl Stamped {
    fn at(self, now_ms: u64, half_life_ms: u64) -> HealthCounts {
        self.counts
            .decayed(now_ms.saturating_sub(self.at_ms), half_life_ms)
    }
}

/// Health of every replica, as one router sees it.
#[derive(Clone, Debug)]
pub struct Health {
    params: HealthParams,
    own: Vec<Stamped>,
    /// Per peer worker: its published counts and when it published them.
    peers: Vec<(u32, Vec<Stamped>)>,
    ejected: Vec<bool>,
    /// This worker's requests in a row that failed, per replica.
    consecutive: Vec<u32>,
    /// Combined successes (own and peers') when the replica was ejected, and when: restoring it
    /// needs a success since (a count above this, decayed to now), whichever worker saw it.
    ok_at_ejection: Vec<Stamped>,
    /// When each replica last got a probe (or was ejected).
    last_probe_ms: Vec<u64>,
    ejections: Vec<u64>,
    probes: Vec<u64>,
    failures: Vec<u64>,
}

impl Health {
    pub fn new(params: HealthParams, replicas: usize) -> Health {
        Health {
            params,
            own: vec![Stamped::default(); replicas],
            peers: Vec::new(),
            ejected: vec![false; replicas],
            consecutive: vec![0; replicas],
            ok_at_ejection: vec![Stamped::default(); replicas],
            last_probe_ms: vec![0; replicas],
            ejections: vec![0; replicas],
            probes: vec![0; replicas],
            failures: vec![0; replicas],
        }
    }

    pub fn params(&self) -> &HealthParams {
        &self.params
    }

    /// Forgets what this worker learned of `replica` (its slot now holds another member, which
    /// starts healthy). Peers' counts for it are replaced by their next publication.
    pub fn forget(&mut self, replica: usize) {
        if replica >= self.ejected.len() {
            return;
        }
        self.own[replica] = Stamped::default();
        self.ejected[replica] = false;
        self.consecutive[replica] = 0;
        self.ok_at_ejection[replica] = Stamped::default();
        self.last_probe_ms[replica] = 0;
        for (_, counts) in &mut self.peers {
            if let Some(c) = counts.get_mut(replica) {
                *c = Stamped::default();
            }
        }
    }

    /// Records how a request on `replica` ended (this worker's own observation) and re-judges it.
    /// Ignored when disabled or for a replica out of range.
    pub fn record(&mut self, replica: usize, outcome: Outcome, now_ms: u64) {
        if !self.params.enabled {
            return;
        }
        let hl = self.params.half_life_ms;
        let Some(s) = self.own.get_mut(replica) else {
            return;
        };
        let mut c = s.at(now_ms, hl);
        match outcome {
            Outcome::Success => {
                c.ok = (c.ok + 1.0).min(MAX_COUNT);
                self.consecutive[replica] = 0;
            }
            Outcome::Failure => {
                c.err = (c.err + 1.0).min(MAX_COUNT);
                self.failures[replica] += 1;
                self.consecutive[replica] = self.consecutive[replica].saturating_add(1);
            }
        }
        *s = Stamped {
            counts: c,
            at_ms: now_ms.max(s.at_ms),
        };
        self.judge(replica, now_ms);
    }

    /// This worker's own counts as of `now_ms`, for its peers.
    pub fn local(&self, now_ms: u64) -> Vec<HealthCounts> {
        let hl = self.params.half_life_ms;
        self.own.iter().map(|s| s.at(now_ms, hl)).collect()
    }

    /// Replaces peer worker `peer`'s contribution, published at `published_ms` (extra replicas are
    /// ignored, missing ones count as none).
    pub fn set_peer(&mut self, peer: u32, published_ms: u64, counts: &[HealthCounts]) {
        let mut v: Vec<Stamped> = counts
            .iter()
            .take(self.own.len())
            .map(|&c| Stamped {
                counts: HealthCounts {
                    ok: c.ok.clamp(0.0, MAX_COUNT),
                    err: c.err.clamp(0.0, MAX_COUNT),
                },
                at_ms: published_ms,
            })
            .collect();
        v.resize(self.own.len(), Stamped::default());
        match self.peers.iter_mut().find(|(p, _)| *p == peer) {
            Some((_, old)) => *old = v,
            None => self.peers.push((peer, v)),
        }
    }

    pub fn clear_peer(&mut self, peer: u32) {
        self.peers.retain(|(p, _)| *p != peer);
    }

    /// Own and peers' counts for `replica` as of `now_ms`.
    pub fn counts(&self, replica: usize, now_ms: u64) -> HealthCounts {
        let hl = self.params.half_life_ms;
        let own = self
            .own
            .get(replica)
            .map_or(HealthCounts::default(), |s| s.at(now_ms, hl));
        self.peers
            .iter()
            .filter_map(|(_, v)| v.get(replica))
            .fold(own, |acc, s| acc.add(s.at(now_ms, hl)))
    }

    /// The replica's recent error rate (own and peers' outcomes), 0 without any.
    pub fn error_rate(&self, replica: usize, now_ms: u64) -> f64 {
        self.counts(replica, now_ms).error_rate()
    }

    /// Re-judges every replica at `now_ms` (after peers' counts changed, or before routing).
    pub fn refresh(&mut self, now_ms: u64) {
        for r in 0..self.own.len() {
            self.judge(r, now_ms);
        }
    }

    fn judge(&mut self, r: usize, now_ms: u64) {
        if !self.params.enabled {
            self.ejected[r] = false;
            return;
        }
        let c = self.counts(r, now_ms);
        let rate = c.error_rate();
        if !self.ejected[r] {
            let by_rate = c.err >= self.params.min_failures && rate >= self.params.eject_error_rate;
            let n = self.params.consecutive_failures;
            let in_a_row = n > 0 && self.consecutive[r] >= n;
            if by_rate || in_a_row {
                self.ejected[r] = true;
                self.ejections[r] += 1;
                self.ok_at_ejection[r] = Stamped {
                    counts: c,
                    at_ms: now_ms,
                };
                // The run did its work; a new one counts from here (else a worker that sees no
                // request on the replica while it is ejected would eject it again the moment it
                // is restored).
                self.consecutive[r] = 0;
                // The first probe waits a full interval.
                self.last_probe_ms[r] = now_ms;
            }
        } else if c.ok
            > self.ok_at_ejection[r]
                .at(now_ms, self.params.half_life_ms)
                .ok
                + 0.5
            && rate <= self.params.restore_error_rate
        {
            // Only successes restore: without outcomes both counts decay alike (and, after long
            // enough, to nothing), which is no news about the replica.
            self.ejected[r] = false;
            // The success that restores it ends this worker's run of failures, even when another
            // worker saw it: failures counted while it was ejected (requests in flight when it
            // died, probes that failed) would otherwise eject it again at the next judgement, for
            // a full probe interval, on this worker alone.
            self.consecutive[r] = 0;
        }
    }

    pub fn is_ejected(&self, replica: usize) -> bool {
        self.ejected.get(replica).copied().unwrap_or(false)
    }

    /// The ejected replica (among those `eligible`) whose probe is due at `now_ms`, the longest
    /// waiting first; `None` when no probe is due. Does not take it ([`Health::take_probe`]).
    pub fn probe_due(&self, now_ms: u64, eligible: impl Fn(usize) -> bool) -> Option<usize> {
        let interval = self.params.probe_interval_ms;
        (0..self.own.len())
            .filter(|&r| self.ejected[r] && eligible(r))
            .filter(|&r| now_ms.saturating_sub(self.last_probe_ms[r]) >= interval)
            .min_by_key(|&r| self.last_probe_ms[r])
    }

    /// [`Health::probe_due`], marking it probed.
    pub fn take_probe(&mut self, now_ms: u64, eligible: impl Fn(usize) -> bool) -> Option<usize> {
        let r = self.probe_due(now_ms, eligible)?;
        self.last_probe_ms[r] = now_ms;
        self.probes[r] += 1;
        Some(r)
    }

    /// Another worker probed `replica` at `at_ms` (the proxy-wide probe claim in shared data): this
    /// one waits a full interval from then.
    pub fn probed_elsewhere(&mut self, replica: usize, at_ms: u64) {
        if let Some(t) = self.last_probe_ms.get_mut(replica) {
            *t = (*t).max(at_ms);
        }
    }

    /// Times each replica was ejected.
    pub fn ejections(&self) -> &[u64] {
        &self.ejections
    }

    /// Probe requests sent to each replica.
    pub fn probes(&self) -> &[u64] {
        &self.probes
    }

    /// Failures this worker observed on each replica.
    pub fn failures(&self) -> &[u64] {
        &self.failures
    }
}

#[cfg(test)]
mod tests;
