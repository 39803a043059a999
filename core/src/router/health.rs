//! Which replicas the policies avoid: down (unreachable) as the filter reports them, ejected for
//! failing as learned from completions (with this worker's peers' counts), and the probes that bring
//! an ejected replica back.

use super::Router;
use crate::health::{Health, HealthCounts, Outcome};

impl Router {
    /// Usable: a member (not draining, not vacant), neither down nor ejected for failing.
    pub(super) fn is_usable(&self, r: usize) -> bool {
        self.fleet.is_up(r) && !self.health.is_ejected(r)
    }

    /// The replicas to avoid, as the policies take them ([`super::fleet::Fleet::avoided`], with
    /// the replicas ejected for failing).
    pub(super) fn avoided(&self) -> Vec<bool> {
        self.fleet.avoided(|r| self.health.is_ejected(r))
    }

    /// Marks a replica unreachable (or reachable again). Every policy avoids a down replica while any
    /// other is up (`session_hash` moves only the down replica's sessions, to the next point on the
    /// ring); with all replicas down, routing carries on as if none were.
    pub fn set_down(&mut self, replica: usize, down: bool) {
        if !self.fleet.set_down(replica, down) {
            self.stats.bad_replica += 1;
        }
    }

    pub fn is_down(&self, replica: usize) -> bool {
        self.fleet.is_down(replica)
    }

    /// Records how a request on `replica` ended (docs/design/design.md section 2.4): failures eject a
    /// replica from every policy's choices until probes succeed again. Out of range: counted.
    pub fn record_outcome(&mut self, replica: usize, outcome: Outcome, now_ms: u64) {
        if replica >= self.replicas() {
            self.stats.bad_replica += 1;
            return;
        }
        self.health.record(replica, outcome, now_ms);
    }

    /// Whether `replica` is ejected for failing requests.
    pub fn is_ejected(&self, replica: usize) -> bool {
        self.health.is_ejected(replica)
    }

    /// The ejected replica whose probe is due at `now_ms` (not down), without taking it: the
    /// filter claims it in shared data first, so that one worker sends it, then routes (which takes
    /// it) or reports [`Router::probed_elsewhere`].
    pub fn probe_due(&mut self, now_ms: u64) -> Option<usize> {
        self.health.refresh(now_ms);
        let fleet = &self.fleet;
        self.health.probe_due(now_ms, |r| fleet.is_up(r))
    }

    /// Another worker sent `replica`'s probe at `at_ms`: this one waits a full interval from then.
    pub fn probed_elsewhere(&mut self, replica: usize, at_ms: u64) {
        self.health.probed_elsewhere(replica, at_ms);
    }

    /// Re-judges every replica's health at `now_ms` (routing does it too).
    pub fn refresh_health(&mut self, now_ms: u64) {
        self.health.refresh(now_ms);
    }

    /// Health as learned from completions (counts, probes, ejections).
    pub fn health(&self) -> &Health {
        &self.health
    }

    /// This router's own outcome counts per replica as of `now_ms` (what a worker publishes).
    pub fn local_health(&self, now_ms: u64) -> Vec<HealthCounts> {
        self.health.local(now_ms)
    }

    /// Replaces a peer worker's outcome counts, published at `published_ms`.
    pub fn set_peer_health(&mut self, peer: u32, published_ms: u64, counts: &[HealthCounts]) {
        self.health.set_peer(peer, published_ms, counts);
    }

    pub fn clear_peer_health(&mut self, peer: u32) {
        self.health.clear_peer(peer);
    }
}
