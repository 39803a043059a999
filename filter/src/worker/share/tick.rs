//! The worker VMs of one proxy: this worker's number, and the load, health, working set and text
//! records it shares with the others each tick through shared data (the records are
//! [`crate::worker::share`]').

use crate::host::store::SharedStore;
use crate::worker::WorkerState;
use crate::worker::share;

/// A worker's working-set journal keeps this many ticks of its admissions for the other workers.
pub const WORKING_SET_KEEP_TICKS: u64 = 4;

/// This worker's place among the proxy's workers: its number, and what it took in of the others'
/// working-set and text-prompt journals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sharing {
    /// This worker's number among the proxy's workers; `None` without shared data.
    id: Option<u32>,
    /// Other workers' working-set entries this worker never read (dropped before it ticked).
    working_set_missed: u64,
    /// Other workers' working-set journals refused as malformed or for another replica count.
    working_set_refused: u64,
    /// Other workers' text-prompt records applied, missed and refused ([`share::TextSharing`]).
    pub(super) text: share::TextSharing,
}

impl Sharing {
    /// This worker's number; `None` until claimed, or without shared data.
    pub fn id(&self) -> Option<u32> {
        self.id
    }

    /// Sets the number (tests make a worker lead or follow without a store).
    #[cfg(test)]
    pub fn set_id(&mut self, id: Option<u32>) {
        self.id = id;
    }

    /// The store, once this worker has a number.
    pub fn store<'a>(&self, store: &'a dyn SharedStore) -> Option<&'a dyn SharedStore> {
        self.id.map(|_| store)
    }

    /// Counts what applying another worker's working-set journal came to (`None`: refused).
    pub fn working_set_applied(&mut self, missed: Option<u64>) {
        match missed {
            Some(missed) => self.working_set_missed += missed,
            None => self.working_set_refused += 1,
        }
    }
}

impl WorkerState {
    /// This worker's number among the proxy's workers; `None` until claimed, or without shared data.
    pub fn worker_id(&self) -> Option<u32> {
        self.sharing.id()
    }

    /// Claims this worker's number from the shared counter ([`share::claim_worker_id`]).
    pub fn claim_worker_id(&mut self, store: &dyn SharedStore) -> Option<u32> {
        self.sharing.id = share::claim_worker_id(store, &self.cfg.shared_key_prefix);
        if self.sharing.id.is_some() {
            self.router.share_working_set();
            self.router.share_text_records();
        }
        self.sharing.id
    }

    /// The shared store, for the operations that need one, once this worker has a number: without one
    /// (no shared data) feeds are polled and load is kept per worker.
    pub fn shared<'a>(&self, store: &'a dyn SharedStore) -> Option<&'a dyn SharedStore> {
        self.sharing.store(store)
    }

    /// Publishes this worker's in-flight load and takes in the other workers' (records older than
    /// `peer_ttl_ms` are dropped): the exchange each tick makes. Nothing without a worker number.
    pub fn share_load(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let Some(me) = self.sharing.id() else {
            return;
        };
        let prefix = &self.cfg.shared_key_prefix;
        let rec = share::WorkerLoad {
            totals: self.router.local_load(),
            since: self.router.local_load_since(),
            released: self.router.local_released_since(),
            held: self.router.local_held(),
        };
        share::publish(store, prefix, me, now_ms, &rec);
        share::publish_records(store, prefix, me, now_ms, &self.router.local_health(now_ms));
        if self.cfg.routing.policy == kvsteer_core::PolicyKind::KvTime {
            share::publish_records(store, prefix, me, now_ms, &self.router.local_speeds());
        }
        let heads = self.router.tracks_prefill_heads();
        if heads {
            let own = self.router.local_prefill_heads();
            share::publish_records(store, prefix, me, now_ms, &own);
        }
        // Kept for a few ticks, so every worker reads each entry at least once (ticks drift), and
        // with peer proxies for a few of their polls too (they read the same records).
        let poll_ms = self.cfg.peers.as_ref().map_or(0, |p| p.poll_ms);
        let keep = self
            .cfg
            .tick_ms
            .max(poll_ms)
            .saturating_mul(WORKING_SET_KEEP_TICKS);
        if let Some(journal) = self.router.working_set_journal(now_ms, keep) {
            share::publish_working_set(store, prefix, me, &journal);
        }
        let count = share::worker_count(store, prefix);
        let replicas = self.cfg.units.len();
        let ttl = self.cfg.peer_ttl_ms;
        for peer in (0..count).filter(|&p| p != me) {
            match share::read_fresh(store, prefix, peer, replicas, now_ms, ttl) {
                Some(rec) => {
                    self.router.set_peer_load(peer, &rec.totals);
                    self.router
                        .set_peer_load_since(peer, &rec.since, &rec.released);
                    self.router.set_peer_held(peer, &rec.held);
                }
                None => self.router.clear_peer(peer),
            }
            match share::read_records_fresh(store, prefix, peer, replicas, now_ms, ttl) {
                Some((at, counts)) => self.router.set_peer_health(peer, at, &counts),
                None => self.router.clear_peer_health(peer),
            }
            if self.cfg.routing.policy == kvsteer_core::PolicyKind::KvTime {
                match share::read_records_fresh(store, prefix, peer, replicas, now_ms, ttl) {
                    Some((_, estimates)) => self.router.set_peer_speeds(peer, &estimates),
                    None => self.router.clear_peer_speeds(peer),
                }
            }
            if heads {
                // A peer without a fresh record holds no head: nothing of its view is kept.
                let theirs = share::read_records_fresh(store, prefix, peer, replicas, now_ms, ttl);
                let peer_heads = theirs.map(|(_, h)| h).unwrap_or_default();
                self.router.set_peer_prefill_heads(peer, &peer_heads);
            }
            // A VM that has routed nothing yet needs no working set: Envoy's main thread runs one
            // (it gets ticks and callouts, never a stream), and a worker whose connections are all
            // elsewhere is another. Applying every other worker's admissions costs each such VM as
            // much as a routing one (docs/guide/envoy.md, "Where the p99 goes"); a worker starts with its
            // first request, from what the journals still hold (a few ticks' worth), and its
            // estimate fills in over the window. (Peer proxies' working sets are still polled from
            // the start: `plan_peer_polls`.)
            if !self.has_routed() {
                continue;
            }
            if let Some(journal) = share::read_working_set_fresh(store, prefix, peer, now_ms, ttl) {
                let applied = self.router.apply_peer_working_set(peer, &journal);
                self.sharing.working_set_applied(applied.map(|a| a.missed));
            }
        }
        self.share_text_records(store, me, count, now_ms);
        self.router.refresh_health(now_ms);
    }

    /// Other workers' working-set entries missed and journals refused (counters since start).
    pub fn working_set_sharing(&self) -> (u64, u64) {
        (
            self.sharing.working_set_missed,
            self.sharing.working_set_refused,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::testing::*;

    #[test]
    fn a_number_opens_the_store_and_journals_are_counted() {
        let store = crate::host::store::tests::MemStore::default();
        let mut s = Sharing::default();
        assert!(s.store(&store).is_none(), "no number, no shared data");
        s.set_id(Some(3));
        assert_eq!(s.id(), Some(3));
        assert!(s.store(&store).is_some());
        s.working_set_applied(Some(2));
        s.working_set_applied(None);
        s.working_set_applied(Some(0));
        assert_eq!((s.working_set_missed, s.working_set_refused), (2, 1));
    }

    #[test]
    fn a_worker_applies_the_others_working_sets_from_its_first_request() {
        let store = crate::host::store::tests::MemStore::default();
        let (mut a, mut b) = (worker("kv_load"), worker("kv_load"));
        a.claim_worker_id(&store);
        b.claim_worker_id(&store);
        let ids: Vec<String> = (0..4_000).map(|i| i.to_string()).collect();
        let body = format!(r#"{{"prompt":[{}]}}"#, ids.join(","));
        for id in 0..2 {
            a.route_body(id, "/v1/completions", body.as_bytes(), Some("s"), 5);
            a.release(id);
        }
        let held = |w: &WorkerState| w.working_set(0).0 + w.working_set(1).0;
        assert!(held(&a) > 0.0, "a asked for its prompt twice");
        a.share_load(&store, 10);
        b.share_load(&store, 10);
        assert_eq!(held(&b), 0.0, "b has routed nothing: it applies nothing");
        b.route_body(1, "/v1/completions", br#"{"prompt":[7,8,9]}"#, None, 15);
        b.share_load(&store, 20);
        assert_eq!(
            held(&b),
            held(&a),
            "from its first request on, b applies a's journal"
        );
    }

    /// `kv_time`: a replica one worker has seen run slow is slow for the others too, from the next
    /// exchange, and no longer once that worker's record is past `peer_ttl_ms`.
    #[test]
    fn workers_share_what_they_learned_of_the_replicas_speeds() {
        let store = crate::host::store::tests::MemStore::default();
        let (mut a, mut b) = (worker("kv_time"), worker("kv_time"));
        a.claim_worker_id(&store);
        b.claim_worker_id(&store);
        let ids: Vec<String> = (0..2_000).map(|i| i.to_string()).collect();
        let body = format!(r#"{{"prompt":[{}]}}"#, ids.join(","));
        // Each request's first token on r1 comes a second after it was sent, far slower than the
        // profile predicts for 2,000 tokens; on r0 about on time.
        let mut now = 0;
        for id in 0..40 {
            let d = a.route_body(id, "/v1/completions", body.as_bytes(), None, now);
            let late = if d.replica == 1 { 1_000 } else { 60 };
            a.first_token(id, now + late);
            a.release(id);
            now += 2_000;
        }
        assert!(a.speed_factor(1) > 2.0, "{}", a.speed_factor(1));
        assert_eq!(b.speed_factor(1), 1.0);
        a.share_load(&store, now);
        b.share_load(&store, now);
        assert!(
            (b.speed_factor(1) - a.speed_factor(1)).abs() < 1e-9,
            "b has no observations of its own: a's estimate is its"
        );
        let ttl = b.config().peer_ttl_ms;
        b.share_load(&store, now + ttl + 1);
        assert_eq!(b.speed_factor(1), 1.0, "a went quiet");
    }

    /// `kv_time`: the head of a replica's queue may be another worker's request; every worker
    /// sees how long it has run from the next exchange, and that it ended once its first token came.
    #[test]
    fn workers_share_the_prefill_in_progress() {
        let store = crate::host::store::tests::MemStore::default();
        let routing = r#"{"policy":"kv_time","kv_time":{"head_progress":true}}"#;
        let (mut a, mut b) = (worker_routing(routing), worker_routing(routing));
        a.claim_worker_id(&store);
        b.claim_worker_id(&store);
        let ids: Vec<String> = (0..4_000).map(|i| i.to_string()).collect();
        let body = format!(r#"{{"prompt":[{}]}}"#, ids.join(","));
        let d = a.route_body(1, "/v1/completions", body.as_bytes(), None, 1_000);
        let r = d.replica;
        assert_eq!(b.router.prefill_progress(1_500)[r].work, 0.0);
        a.share_load(&store, 1_100);
        b.share_load(&store, 1_100);
        let seen = b.router.prefill_progress(1_500)[r];
        assert_eq!(seen, a.router.prefill_progress(1_500)[r], "b sees a's head");
        assert!(
            seen.work > 0.0 && (seen.elapsed_s - 0.5).abs() < 1e-9,
            "{seen:?}"
        );
        a.first_token(1, 1_600);
        a.share_load(&store, 1_700);
        b.share_load(&store, 1_700);
        assert_eq!(
            b.router.prefill_progress(1_800)[r].work,
            0.0,
            "its first token came"
        );
    }

    #[test]
    fn workers_share_their_load_through_the_store_and_forget_silent_ones() {
        use crate::host::store::tests::MemStore;
        let store = MemStore::default();
        let (mut a, mut b) = (worker("least_load"), worker("least_load"));
        let mut lone = worker("least_load");
        lone.share_load(&store, 0);
        assert!(
            store.0.borrow().is_empty(),
            "nothing shared without a worker number"
        );
        assert_eq!(a.claim_worker_id(&store), Some(0));
        assert_eq!(b.claim_worker_id(&store), Some(1));
        assert!(a.shared(&store).is_some() && lone.shared(&store).is_none());
        let body = br#"{"prompt":[1,2,3,4,5,6,7,8]}"#;
        let d = a.route_body(1, "/v1/completions", body, None, 0);
        a.share_load(&store, 0);
        b.share_load(&store, 0);
        let seen = b.router.effective_load()[d.replica];
        assert_eq!(seen, a.router.local_load()[d.replica], "b sees a's request");
        assert_eq!(seen.active_requests, 1);
        // b's own admission lands elsewhere: least_load counts a's request.
        assert_ne!(
            b.route_body(2, "/v1/completions", body, None, 0).replica,
            d.replica
        );
        // a goes quiet: past peer_ttl_ms its record is dropped.
        let ttl = b.config().peer_ttl_ms;
        b.share_load(&store, ttl + 1);
        assert_eq!(b.router.effective_load()[d.replica].active_requests, 0);
        assert!(a.release(1));
    }
}
