//! Effective load, and the load shared with the proxy's other workers.
//!
//! Effective load of a replica is the input to every load-aware policy: the router-tracked totals
//! (this worker's plus its peers'), met with what the replica itself last reported as
//! `load.reported_load` says (`ignore`, `max`, `merge`, `others`: see [`super::reported`], which
//! keeps the reports and the peers' shares).
//!
//! Each worker publishes its own share (`local_*`) and takes its peers' (`set_peer_*`).

use super::Router;
use crate::load::{HeadProgress, LoadTotals, PrefillHead};

impl Router {
    /// Effective load per replica (see the module docs).
    pub fn effective_load(&self) -> Vec<LoadTotals> {
        self.reported.effective(&self.load)
    }

    /// This router's tracked totals per replica (what a worker publishes to its peers).
    pub fn local_load(&self) -> Vec<LoadTotals> {
        self.load.totals().to_vec()
    }

    /// Replaces a peer worker's contribution (extra replicas are ignored, missing ones count as zero).
    pub fn set_peer_load(&mut self, peer: u32, totals: &[LoadTotals]) {
        self.reported.set_peer_load(peer, totals);
    }

    /// Replaces a peer worker's bookings made since each replica's report was polled, and what it
    /// released since of requests the report holds (what its [`Router::local_load_since`] and
    /// [`Router::local_released_since`] say), for `reported_load` `merge`.
    pub fn set_peer_load_since(
        &mut self,
        peer: u32,
        since: &[LoadTotals],
        released: &[LoadTotals],
    ) {
        self.reported.set_peer_since(peer, since, released);
    }

    /// Replaces a peer worker's requests each replica's current report holds (what its
    /// [`Router::local_held`] says), for `reported_load` `others`.
    pub fn set_peer_held(&mut self, peer: u32, held: &[LoadTotals]) {
        self.reported.set_peer_held(peer, held);
    }

    /// Whether this router keeps and reads the prefill in progress on each replica (its policy
    /// asks for it: `kv_time.head_progress`): only then is there a view to share with the workers.
    pub fn tracks_prefill_heads(&self) -> bool {
        self.decider.needs.prefill_head
    }

    /// This router's view of the prefill in progress on each replica (what a worker publishes for
    /// its peers: [`crate::load::LoadTable::prefill_heads`]).
    pub fn local_prefill_heads(&self) -> Vec<PrefillHead> {
        self.load.prefill_heads()
    }

    /// Per replica at `now_ms`: how long the prefill at the head of its queue has run, from this
    /// worker's requests and its peers' (empty under `reported_load` `merge` and `max`, whose
    /// reports already count it): what `kv_time` takes off the queue.
    pub fn prefill_progress(&self, now_ms: u64) -> Vec<HeadProgress> {
        self.reported.head_progress(&self.load, now_ms)
    }

    /// Replaces a peer worker's view of the prefill in progress on each replica.
    pub fn set_peer_prefill_heads(&mut self, peer: u32, heads: &[PrefillHead]) {
        self.reported.set_peer_heads(peer, heads);
    }

    pub fn clear_peer(&mut self, peer: u32) {
        self.reported.clear_peer(peer);
    }

    /// This router's requests each replica's current report holds (admitted before its poll), in
    /// the report's units ([`LoadTable::held`]) as they stood when the report was accepted; zero
    /// for a replica that has not reported, and while `reported_load` is not `others`. What a
    /// worker publishes for its peers' `others`.
    ///
    /// [`LoadTable::held`]: crate::load::LoadTable::held
    pub fn local_held(&self) -> Vec<LoadTotals> {
        self.reported.local_held()
    }

    /// This router's bookings made since each replica's report was polled, in the report's units
    /// ([`LoadTable::since`]); zero for a replica that has not reported. What a worker publishes
    /// beside [`Router::local_load`] for its peers' `merge`.
    ///
    /// [`LoadTable::since`]: crate::load::LoadTable::since
    pub fn local_load_since(&self) -> Vec<LoadTotals> {
        self.reported.local_since(&self.load)
    }

    /// What this router released since each replica's report was polled, of requests that report
    /// holds (admitted before its poll), in the report's units: `merge` takes it off the report.
    pub fn local_released_since(&self) -> Vec<LoadTotals> {
        self.reported.local_released_since()
    }

    /// When the poll behind `replica`'s current report was sent (None before its first report).
    pub fn report_polled_ms(&self, replica: usize) -> Option<u64> {
        self.reported.polled_ms(replica)
    }
}
