//! Effective load, and the load shared with the proxy's other workers.
//!
//! Effective load of a replica, the input to every load-aware policy, by `kv_load.reported_load`:
//! - `ignore`: the router-tracked totals (this worker's plus its peers');
//! - `max`: those combined with what the replica itself last reported, taking the larger of the two
//!   for prefill tokens, decode blocks and active requests;
//! - `merge`: the report plus the bookings this proxy (this worker and its peers) made since the poll
//!   that produced the report went out ([`LoadTable::since`]), each field added: the report holds
//!   every proxy's traffic up to the poll, the bookings this proxy's since, so nothing counts twice
//!   (docs/design/design.md, "Many proxies");
//! - `others`: the router-tracked totals, as `ignore`, plus the rest of the report: the report less
//!   this proxy's requests it holds ([`LoadTable::held`], as they stood when the report came), so
//!   this proxy's own requests are counted once, by its own accounting, and the other proxies' by
//!   the replica.
//!
//! A *stale* replica (its feed failing) has its report ignored, and so does one that has not reported
//! yet: it is scored on the tracked totals. A stale replica's KV overlap is treated as zero.
//!
//! Each worker publishes its own share (`local_*`) and takes its peers' (`set_peer_*`).
//!
//! [`LoadTable::since`]: crate::load::LoadTable::since
//! [`LoadTable::held`]: crate::load::LoadTable::held

use super::Router;
use crate::config::ReportedLoad;
use crate::load::LoadTotals;

impl Router {
    /// Effective load per replica (see the module docs).
    pub fn effective_load(&self) -> Vec<LoadTotals> {
        let mut eff = self.load.combined(self.peers.values().map(Vec::as_slice));
        let mode = self.cfg.kv_load.reported_load;
        if mode == ReportedLoad::Ignore {
            return eff;
        }
        // Per replica, what meets the report: for `merge` this proxy's bookings since the poll
        // (added) and what it released since of the report's requests (taken off); for `others`
        // its requests the report holds, as accepted (taken off).
        let (own, released) = match mode {
            ReportedLoad::Merge => {
                let mut since = self.load.since(&self.report_polled_ms);
                let mut gone = self.released_since.clone();
                for (p, g) in self.peers_since.values() {
                    LoadTotals::add_each(&mut since, p);
                    LoadTotals::add_each(&mut gone, g);
                }
                (since, gone)
            }
            ReportedLoad::Others => {
                let mut held = self.held_at_report.clone();
                for p in self.peers_held.values() {
                    LoadTotals::add_each(&mut held, p);
                }
                (held, Vec::new())
            }
            _ => (Vec::new(), Vec::new()),
        };
        for (r, e) in eff.iter_mut().enumerate() {
            if self.stale[r] {
                continue;
            }
            if let Some(rep) = &self.reported[r] {
                let decode = if rep.block_size > 0 && rep.block_size as usize != self.cfg.block_size
                {
                    (rep.decode_blocks as u128 * rep.block_size as u128
                        / self.cfg.block_size as u128)
                        .min(u64::MAX as u128) as u64
                } else {
                    rep.decode_blocks
                };
                let active = rep.running.saturating_add(rep.waiting);
                let report = LoadTotals {
                    prefill_tokens: rep.prefill_tokens,
                    decode_blocks: decode,
                    active_requests: active,
                };
                if mode == ReportedLoad::Merge {
                    let mut m = report;
                    m.add(&own[r]);
                    m.sub(&released[r]);
                    *e = m;
                } else if mode == ReportedLoad::Others {
                    // Less this proxy's requests the report holds, the rest is the other proxies'
                    // (and what the report counts that the bookings do not).
                    let mut rest = report;
                    rest.sub(&own[r]);
                    e.add(&rest);
                } else {
                    e.prefill_tokens = e.prefill_tokens.max(rep.prefill_tokens);
                    e.decode_blocks = e.decode_blocks.max(decode);
                    e.active_requests = e.active_requests.max(active);
                }
            }
        }
        eff
    }

    /// This router's tracked totals per replica (what a worker publishes to its peers).
    pub fn local_load(&self) -> Vec<LoadTotals> {
        self.load.totals().to_vec()
    }

    /// Replaces a peer worker's contribution (extra replicas are ignored, missing ones count as zero).
    pub fn set_peer_load(&mut self, peer: u32, totals: &[LoadTotals]) {
        let mut v = totals.to_vec();
        v.resize(self.replicas, LoadTotals::default());
        self.peers.insert(peer, v);
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
        let mut v = since.to_vec();
        v.resize(self.replicas, LoadTotals::default());
        let mut g = released.to_vec();
        g.resize(self.replicas, LoadTotals::default());
        self.peers_since.insert(peer, (v, g));
    }

    /// Replaces a peer worker's requests each replica's current report holds (what its
    /// [`Router::local_held`] says), for `reported_load` `others`.
    pub fn set_peer_held(&mut self, peer: u32, held: &[LoadTotals]) {
        let mut v = held.to_vec();
        v.resize(self.replicas, LoadTotals::default());
        self.peers_held.insert(peer, v);
    }

    pub fn clear_peer(&mut self, peer: u32) {
        self.peers.remove(&peer);
        self.peers_since.remove(&peer);
        self.peers_held.remove(&peer);
    }

    /// This router's requests each replica's current report holds (admitted before its poll), in
    /// the report's units ([`LoadTable::held`]) as they stood when the report was accepted; zero
    /// for a replica that has not reported, and while `reported_load` is not `others`. What a
    /// worker publishes for its peers' `others`.
    ///
    /// [`LoadTable::held`]: crate::load::LoadTable::held
    pub fn local_held(&self) -> Vec<LoadTotals> {
        self.held_at_report.clone()
    }

    /// This router's bookings made since each replica's report was polled, in the report's units
    /// ([`LoadTable::since`]); zero for a replica that has not reported. What a worker publishes
    /// beside [`Router::local_load`] for its peers' `merge`.
    ///
    /// [`LoadTable::since`]: crate::load::LoadTable::since
    pub fn local_load_since(&self) -> Vec<LoadTotals> {
        self.load.since(&self.report_polled_ms)
    }

    /// What this router released since each replica's report was polled, of requests that report
    /// holds (admitted before its poll), in the report's units: `merge` takes it off the report.
    pub fn local_released_since(&self) -> Vec<LoadTotals> {
        self.released_since.clone()
    }

    /// When the poll behind `replica`'s current report was sent (None before its first report).
    pub fn report_polled_ms(&self, replica: usize) -> Option<u64> {
        self.report_polled_ms
            .get(replica)
            .copied()
            .filter(|&t| t != u64::MAX)
    }
}
