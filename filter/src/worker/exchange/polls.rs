//! The working-set exchange with other proxies (the `peers` section, [`crate::worker::exchange`]): the
//! polls this worker sends, the answers it applies and the reserved path it serves.

use crate::host::store::SharedStore;
use crate::worker::WorkerState;
use crate::worker::exchange::{Exchange, ExchangeStats, PeerCall, PeerResponse};

impl WorkerState {
    /// The peer polls due at `now_ms` (none without `peers`, or while this worker has no working
    /// set to share: before it has a number in shared data, or with the term off).
    pub fn plan_peer_polls(&mut self, now_ms: u64) -> Vec<PeerCall> {
        // From the start, unlike the other workers' journals (`share_load`): a proxy that takes
        // traffic later needs what the others served before, and their journals keep only a few
        // polls' worth.
        let sharing = self.sharing.id().is_some() && self.router.has_working_set();
        let busy = self.callout_out(now_ms);
        let mut calls = self.exchange.plan(&self.cfg, &self.router, sharing, now_ms);
        let limit = self.callouts_per_tick();
        if limit != usize::MAX {
            if busy {
                calls.clear();
            }
            // Over the tick's bound (feed polls come first): planning marks nothing, so a peer
            // left out is due again next tick.
            calls.truncate(limit.saturating_sub(self.budget.callouts()));
            self.budget.plan_callouts(calls.len());
        }
        calls
    }

    pub fn peer_poll_started(&mut self, peer: usize, token: u32, now_ms: u64) {
        self.exchange.started(&self.cfg, peer, token, now_ms);
    }

    pub fn peer_poll_not_started(&mut self, peer: usize, now_ms: u64) {
        self.exchange.not_started(&self.cfg, peer, now_ms);
    }

    /// Whether a callout's answer is a peer poll's (not a feed's).
    pub fn is_peer_poll(&self, token: u32) -> bool {
        self.exchange.owns(token)
    }

    /// Whether a peer's answer of `body_size` bytes may be read.
    pub fn peer_answer_fits(&self, body_size: usize) -> bool {
        Exchange::accepts_size(&self.cfg, body_size)
    }

    /// A peer poll's answer ([`Exchange::answered`]).
    pub fn on_peer_answer(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: Option<&[u8]>,
        oversized: bool,
        now_ms: u64,
    ) {
        self.exchange
            .answered(&mut self.router, token, status, body, oversized, now_ms);
    }

    /// Whether a request's path is the reserved one peers poll: the filter answers it and never
    /// forwards it.
    pub fn is_peer_path(&self, path: &[u8]) -> bool {
        crate::worker::exchange::is_reserved(path, self.cfg.peer_path())
    }

    /// The header a peer's poll carries the shared token in.
    pub fn peer_token_header(&self) -> &str {
        self.cfg.peer_token_header()
    }

    /// Answers a request for the reserved path ([`Exchange::serve`]).
    pub fn serve_peer(
        &mut self,
        store: &dyn SharedStore,
        method: &[u8],
        path: &[u8],
        token: Option<&[u8]>,
        now_ms: u64,
    ) -> PeerResponse {
        let store = self.sharing.store(store);
        self.exchange
            .serve(&self.cfg, store, method, path, token, now_ms)
    }

    /// The exchange's counters since start.
    pub fn exchange_stats(&self) -> ExchangeStats {
        self.exchange.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FilterConfig;

    #[test]
    fn peers_are_polled_only_with_a_working_set_to_share() {
        let with = |policy: &str| {
            let json = format!(
                r#"{{"replicas":[{{"name":"r0","endpoint":"10.0.0.1:8000","feed_cluster":"f0"}}],
                    "routing":{{"policy":"{policy}"}},
                    "peers":{{"proxies":[{{"cluster":"b"}}],"token":"0123456789abcdef"}}}}"#
            );
            WorkerState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
        };
        let store = crate::host::store::tests::MemStore::default();
        let mut kv = with("kv_load");
        assert!(kv.plan_peer_polls(0).is_empty(), "no worker number yet");
        kv.claim_worker_id(&store);
        assert_eq!(kv.plan_peer_polls(0).len(), 1, "before any request too");
        // Without the working-set term there is nothing to exchange: no polls, no empty answers
        // counted as refused.
        let mut rr = with("round_robin");
        rr.claim_worker_id(&store);
        assert!(rr.plan_peer_polls(0).is_empty());
    }
}
