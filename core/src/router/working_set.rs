//! The working-set term's plumbing: what an operator reads of it, and sharing its admissions with the
//! proxy's other workers and with other proxies ([`crate::working_set`]).

use super::Router;
use crate::working_set;

impl Router {
    /// A replica's recent working set in blocks as this router estimates it (0 with the
    /// working-set term off): beside [`Router::cache_size_blocks`], what an operator checks to see
    /// whether the term is at work.
    pub fn working_set_blocks(&self, replica: usize) -> f64 {
        self.working_set
            .as_ref()
            .map_or(0.0, |ws| ws.blocks(replica))
    }

    /// Starts sharing this router's working-set admissions with the proxy's other workers
    /// ([`crate::working_set`]); nothing with the working-set term off.
    pub fn share_working_set(&mut self) {
        if let Some(ws) = &mut self.working_set {
            ws.start_journal();
        }
    }

    /// This router's recent working-set admissions for the other workers, stamped `now_ms`, keeping
    /// the last `keep_ms`; `None` with the term off or before [`Router::share_working_set`].
    pub fn working_set_journal(&mut self, now_ms: u64, keep_ms: u64) -> Option<Vec<u8>> {
        self.working_set.as_mut()?.encode_journal(now_ms, keep_ms)
    }

    /// Applies another worker's working-set journal; `None` for one that is malformed or for
    /// another replica count, or while not sharing.
    pub fn apply_peer_working_set(
        &mut self,
        peer: u32,
        journal: &[u8],
    ) -> Option<working_set::Applied> {
        self.working_set.as_mut()?.apply_peer(peer, journal)
    }

    /// Applies another proxy's answer (its workers' journals, [`working_set::encode_bundle`]) from
    /// its peer number `peer`, at `now_ms`; `None`, nothing applied, for one that is malformed or
    /// for another replica count, or while not sharing ([`working_set::WorkingSet::apply_remote`]).
    pub fn apply_remote_working_set(
        &mut self,
        peer: u32,
        bundle: &[u8],
        now_ms: u64,
    ) -> Option<working_set::Applied> {
        self.working_set
            .as_mut()?
            .apply_remote(peer, bundle, now_ms)
    }

    /// Whether the working-set term is on (kv_load with `overflow_weight` > 0): with it off there
    /// is no working set to share or to take in.
    pub fn has_working_set(&self) -> bool {
        self.working_set.is_some()
    }

    /// What this router has applied from each worker of peer proxy `peer` (its `after` query).
    pub fn remote_working_set_marks(&self, peer: u32) -> Vec<(u32, u64)> {
        self.working_set
            .as_ref()
            .map_or_else(Vec::new, |ws| ws.remote_marks(peer))
    }
}
