//! What the replicas report about their own load, and the bookings that meet each report: the
//! state behind [`super::Router::effective_load`].
//!
//! Effective load of a replica, the input to every load-aware policy, by `load.reported_load`:
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
//! yet: it is scored on the tracked totals. (The router also treats a stale replica's KV overlap and
//! adapters as unknown.)

use hashbrown::HashMap;

use crate::config::ReportedLoad;
use crate::feed::ReplicaLoad;
use crate::load::{HeadProgress, LoadTable, LoadTotals, PrefillHead, Released};

/// The replicas' load reports, when each was polled, the peer workers' shares that meet them, and
/// which replicas' feeds are stale.
#[derive(Clone, Debug)]
pub(super) struct Reported {
    /// `load.reported_load`: how a report meets the tracked totals.
    mode: ReportedLoad,
    /// The router's block size (a report in another engine block size is converted to it).
    block_size: usize,
    /// Per peer worker: its tracked totals per replica.
    peers: HashMap<u32, Vec<LoadTotals>>,
    /// Per peer worker: its bookings since each replica's report was polled, and what it released
    /// since then of requests the report holds (`merge`).
    peers_since: HashMap<u32, (Vec<LoadTotals>, Vec<LoadTotals>)>,
    /// Per peer worker: its requests each replica's current report holds (`others`).
    peers_held: HashMap<u32, Vec<LoadTotals>>,
    /// Per peer worker: its view of the prefill in progress on each replica ([`PrefillHead`]).
    peers_heads: HashMap<u32, Vec<PrefillHead>>,
    /// Per replica: this router's requests its current report holds, as they stood when the report
    /// was accepted (`others` takes them off the report: the report describes them then, not now).
    held_at_report: Vec<LoadTotals>,
    /// Per replica: this router's requests the current report holds (admitted before its poll) and
    /// that have been released since: `merge` takes them off the report.
    released_since: Vec<LoadTotals>,
    reports: Vec<Option<ReplicaLoad>>,
    /// Per replica: when the poll that produced its report was sent (router clock, ms); `u64::MAX`
    /// before its first report.
    polled_ms: Vec<u64>,
    /// Per replica: its feed is failing; its report is not trusted.
    stale: Vec<bool>,
}

impl Reported {
    pub(super) fn new(replicas: usize, mode: ReportedLoad, block_size: usize) -> Reported {
        Reported {
            mode,
            block_size,
            peers: HashMap::new(),
            peers_since: HashMap::new(),
            peers_held: HashMap::new(),
            peers_heads: HashMap::new(),
            held_at_report: vec![LoadTotals::default(); replicas],
            released_since: vec![LoadTotals::default(); replicas],
            reports: vec![None; replicas],
            polled_ms: vec![u64::MAX; replicas],
            stale: vec![false; replicas],
        }
    }

    /// Effective load per replica: `load`'s tracked totals and the peers', met with the reports
    /// (see the module docs).
    pub(super) fn effective(&self, load: &LoadTable) -> Vec<LoadTotals> {
        let mut eff = load.combined(self.peers.values().map(Vec::as_slice));
        let mode = self.mode;
        if mode == ReportedLoad::Ignore {
            return eff;
        }
        // Per replica, what meets the report: for `merge` this proxy's bookings since the poll
        // (added) and what it released since of the report's requests (taken off); for `others`
        // its requests the report holds, as accepted (taken off).
        let (own, released) = match mode {
            ReportedLoad::Merge => {
                let mut since = load.since(&self.polled_ms);
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
        // Reports, and this proxy's part of them, are in plain tokens; the table may book prefill
        // in time: what the report adds is converted once it is computed.
        let per_token = load.work_per_token();
        for (r, e) in eff.iter_mut().enumerate() {
            if self.stale[r] {
                continue;
            }
            if let Some(rep) = &self.reports[r] {
                let report = self.report_totals(rep);
                if mode == ReportedLoad::Merge {
                    let mut m = report;
                    m.add(&own[r]);
                    m.sub(&released[r]);
                    m.prefill_tokens = in_table_units(m.prefill_tokens, per_token);
                    *e = m;
                } else if mode == ReportedLoad::Others {
                    // Less this proxy's requests the report holds, the rest is the other proxies'
                    // (and what the report counts that the bookings do not).
                    let mut rest = report;
                    rest.sub(&own[r]);
                    rest.prefill_tokens = in_table_units(rest.prefill_tokens, per_token);
                    e.add(&rest);
                } else {
                    let reported = in_table_units(report.prefill_tokens, per_token);
                    e.prefill_tokens = e.prefill_tokens.max(reported);
                    e.decode_blocks = e.decode_blocks.max(report.decode_blocks);
                    e.active_requests = e.active_requests.max(report.active_requests);
                }
            }
        }
        eff
    }

    /// A report as load totals in the router's block size.
    fn report_totals(&self, rep: &ReplicaLoad) -> LoadTotals {
        let decode = if rep.block_size > 0 && rep.block_size as usize != self.block_size {
            (rep.decode_blocks as u128 * rep.block_size as u128 / self.block_size as u128)
                .min(u64::MAX as u128) as u64
        } else {
            rep.decode_blocks
        };
        LoadTotals {
            prefill_tokens: rep.prefill_tokens,
            decode_blocks: decode,
            active_requests: rep.running.saturating_add(rep.waiting),
        }
    }

    /// `replica` reported `report` in answer to a poll sent at `polled_ms`: it replaces the last,
    /// and what this router released of the last one's requests is forgotten. Under `others`, this
    /// router's requests the report holds (`load`'s, admitted before the poll) are kept as they
    /// stand now. `replica` must be in range.
    pub(super) fn accept(
        &mut self,
        replica: usize,
        report: ReplicaLoad,
        polled_ms: u64,
        load: &LoadTable,
    ) {
        self.reports[replica] = Some(report);
        self.polled_ms[replica] = polled_ms;
        self.released_since[replica] = LoadTotals::default();
        if self.mode == ReportedLoad::Others {
            self.held_at_report[replica] = load.held(replica, polled_ms);
        }
    }

    /// A request of this router was released: when its replica's current report holds it
    /// (admitted before the poll), `merge` takes it off the report from now on.
    pub(super) fn released(&mut self, gone: &Released) {
        if gone.admitted_ms < self.polled_ms[gone.replica] {
            self.released_since[gone.replica].add(&gone.share);
        }
    }

    /// The slot's member left: its report, its staleness and the peers' shares on it are
    /// forgotten. `replica` must be in range.
    pub(super) fn forget(&mut self, replica: usize) {
        self.reports[replica] = None;
        self.polled_ms[replica] = u64::MAX;
        self.held_at_report[replica] = LoadTotals::default();
        self.released_since[replica] = LoadTotals::default();
        self.stale[replica] = false;
        for held in self.peers.values_mut() {
            if let Some(t) = held.get_mut(replica) {
                *t = LoadTotals::default();
            }
        }
    }

    /// `replica`'s last report (None before its first, or out of range).
    pub(super) fn report(&self, replica: usize) -> Option<&ReplicaLoad> {
        self.reports.get(replica).and_then(Option::as_ref)
    }

    /// When the poll behind `replica`'s current report was sent (None before its first report).
    pub(super) fn polled_ms(&self, replica: usize) -> Option<u64> {
        self.polled_ms
            .get(replica)
            .copied()
            .filter(|&t| t != u64::MAX)
    }

    /// Marks a replica's feed as failing (or recovered); false for a replica out of range.
    pub(super) fn set_stale(&mut self, replica: usize, stale: bool) -> bool {
        match self.stale.get_mut(replica) {
            Some(s) => {
                *s = stale;
                true
            }
            None => false,
        }
    }

    /// Whether a replica's feed is failing (false out of range).
    pub(super) fn is_stale(&self, replica: usize) -> bool {
        self.stale.get(replica).copied().unwrap_or(false)
    }

    /// Replaces a peer worker's tracked totals (extra replicas are ignored, missing ones count as
    /// zero).
    pub(super) fn set_peer_load(&mut self, peer: u32, totals: &[LoadTotals]) {
        let v = self.per_replica(totals);
        self.peers.insert(peer, v);
    }

    /// Replaces a peer worker's bookings since each report's poll and what it released since of
    /// the reports' requests (`merge`).
    pub(super) fn set_peer_since(
        &mut self,
        peer: u32,
        since: &[LoadTotals],
        released: &[LoadTotals],
    ) {
        let v = self.per_replica(since);
        let g = self.per_replica(released);
        self.peers_since.insert(peer, (v, g));
    }

    /// Replaces a peer worker's requests each replica's current report holds (`others`).
    pub(super) fn set_peer_held(&mut self, peer: u32, held: &[LoadTotals]) {
        let v = self.per_replica(held);
        self.peers_held.insert(peer, v);
    }

    /// Drops everything a peer worker shared.
    pub(super) fn clear_peer(&mut self, peer: u32) {
        self.peers.remove(&peer);
        self.peers_since.remove(&peer);
        self.peers_held.remove(&peer);
        self.peers_heads.remove(&peer);
    }

    /// Replaces a peer worker's view of the prefill in progress on each replica (extra replicas
    /// are ignored, missing ones read as nothing in prefill).
    pub(super) fn set_peer_heads(&mut self, peer: u32, heads: &[PrefillHead]) {
        let v = self.per_replica(heads);
        self.peers_heads.insert(peer, v);
    }

    /// Per replica at `now_ms`: how long the prefill at the head of its queue has run, from this
    /// router's requests and its peers' ([`PrefillHead::merge`]). Only where the effective load
    /// counts the bookings whole (`ignore`, `others`): under `merge` and `max` a report may stand
    /// for them, and it already counts what the head has computed.
    pub(super) fn head_progress(&self, load: &LoadTable, now_ms: u64) -> Vec<HeadProgress> {
        if !matches!(self.mode, ReportedLoad::Ignore | ReportedLoad::Others) {
            return Vec::new();
        }
        let mut heads = load.prefill_heads();
        for p in self.peers_heads.values() {
            for (h, o) in heads.iter_mut().zip(p) {
                *h = h.merge(o);
            }
        }
        heads.iter().map(|h| h.running(now_ms)).collect()
    }

    /// This router's requests each replica's current report holds, as they stood when the report
    /// was accepted (`others`; zero otherwise).
    pub(super) fn local_held(&self) -> Vec<LoadTotals> {
        self.held_at_report.clone()
    }

    /// `load`'s bookings made since each replica's report was polled (`merge`).
    pub(super) fn local_since(&self, load: &LoadTable) -> Vec<LoadTotals> {
        load.since(&self.polled_ms)
    }

    /// What this router released since each replica's report was polled, of requests that report
    /// holds (`merge`).
    pub(super) fn local_released_since(&self) -> Vec<LoadTotals> {
        self.released_since.clone()
    }

    /// `values` cut or padded with zeros to one per replica.
    fn per_replica<T: Clone + Default>(&self, values: &[T]) -> Vec<T> {
        let mut v = values.to_vec();
        v.resize(self.stale.len(), T::default());
        v
    }
}

/// Plain tokens of a report in the load table's unit (`per_token` of it a token,
/// [`LoadTable::work_per_token`]); exact when the table books tokens.
fn in_table_units(tokens: u64, per_token: f64) -> u64 {
    if per_token == 1.0 {
        return tokens;
    }
    // u64::MAX / 8 as in `load::prefill_work`: the table's sums stay far from wrapping.
    (tokens as f64 * per_token).min((u64::MAX / 8) as f64) as u64
}

#[cfg(test)]
mod tests;
