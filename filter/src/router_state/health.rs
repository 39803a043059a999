//! Replica health learned from completions (`kvsteer_core::health`): how a request ended, told
//! apart from a retry elsewhere by the address that answered, and the probe of an ejected replica,
//! claimed once for the whole proxy.

use super::RouterState;
use crate::store::SharedStore;
use crate::workers;
use kvsteer_core::health::{Health, Outcome};

impl RouterState {
    /// How a routed request ended, for the replicas' health (`kvsteer_core::health`). `chosen`: the
    /// replica the filter chose; `served_by`: the upstream address the proxy reports for the answer
    /// (Envoy's `upstream.address`), if any. An answer from another replica means the proxy retried
    /// there, so the first choice's attempt failed: both are recorded.
    pub fn request_outcome(
        &mut self,
        chosen: usize,
        served_by: Option<&[u8]>,
        outcome: Outcome,
        now_ms: u64,
    ) {
        let served = served_by
            .and_then(|a| std::str::from_utf8(a).ok())
            .and_then(|a| {
                let a = a.trim();
                // Several DP ranks share one address: an answer from the chosen unit's own address
                // is the chosen unit's, not a retry to its endpoint's first rank.
                match self.cfg.replicas.get(chosen) {
                    Some(r) if r.endpoint == a => Some(chosen),
                    _ => self.replica_of_address(a),
                }
            });
        match served {
            Some(s) if s != chosen => {
                self.router.record_outcome(chosen, Outcome::Failure, now_ms);
                self.router.record_outcome(s, outcome, now_ms);
            }
            _ => self.router.record_outcome(chosen, outcome, now_ms),
        }
    }

    /// Before routing a request: when an ejected replica's health probe is due, claims it for the
    /// whole proxy in shared data, so one worker sends it per `health.probe_interval_ms` however
    /// many there are; a worker that loses waits a full interval from the winner's probe. Without
    /// shared data (`store` None) each worker probes on its own.
    pub fn claim_probe(&mut self, store: Option<&dyn SharedStore>, now_ms: u64) {
        let Some(store) = store else { return };
        let Some(r) = self.router.probe_due(now_ms) else {
            return;
        };
        let interval = self.cfg.routing.health.probe_interval_ms;
        if let Err(last) =
            workers::claim_probe(store, &self.cfg.shared_key_prefix, r, now_ms, interval)
        {
            self.router.probed_elsewhere(r, last);
        }
    }

    /// The replica whose `endpoint` is `address` (`IP:port`).
    pub fn replica_of_address(&self, address: &str) -> Option<usize> {
        self.cfg.replicas.iter().position(|r| r.endpoint == address)
    }

    /// Whether `replica` is ejected for failing requests.
    pub fn is_ejected(&self, replica: usize) -> bool {
        self.router.is_ejected(replica)
    }

    /// Health as learned from completions.
    pub fn health(&self) -> &Health {
        self.router.health()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router_state::testing::*;

    #[test]
    fn outcomes_are_attributed_through_the_upstream_address() {
        let mut w = worker("round_robin");
        // Envoy answered from r1 although the filter chose r0: r0's attempt failed and was retried.
        for t in 0..3 {
            w.request_outcome(0, Some(b"127.0.0.1:8001"), Outcome::Success, t);
        }
        assert!(w.is_ejected(0), "three failed attempts in a row");
        assert!(!w.is_ejected(1));
        assert_eq!(w.health().failures(), &[3, 0]);
        // No address (nginx, a local reply) or one outside the fleet: the choice itself.
        let mut w = worker("round_robin");
        w.request_outcome(1, None, Outcome::Failure, 0);
        w.request_outcome(1, Some(b"10.9.9.9:1"), Outcome::Failure, 1);
        w.request_outcome(1, Some(&[0xff, 0xfe]), Outcome::Failure, 2);
        assert!(w.is_ejected(1) && !w.is_ejected(0));
        // The same address as the choice: its own outcome, a success.
        w.request_outcome(0, Some(b" 127.0.0.1:8000 "), Outcome::Success, 3);
        assert_eq!(w.health().failures(), &[0, 3]);
        assert!(!w.is_ejected(0));
        // Out of range: ignored, never a panic.
        w.request_outcome(7, Some(b"127.0.0.1:8000"), Outcome::Failure, 4);
    }

    #[test]
    fn health_is_shared_between_workers() {
        let store = crate::store::tests::MemStore::default();
        let mut a = worker("least_load");
        let mut b = worker("least_load");
        a.claim_worker_id(&store);
        b.claim_worker_id(&store);
        for t in 0..3 {
            a.request_outcome(1, None, Outcome::Failure, t);
        }
        assert!(a.is_ejected(1) && !b.is_ejected(1));
        a.share_load(&store, 10);
        b.share_load(&store, 10);
        assert!(b.is_ejected(1), "b learns it from a's record");
        let body = br#"{"prompt":[1,2,3,4,5,6,7,8]}"#;
        for id in 0..20 {
            let d = b.route_body(id, "/v1/completions", body, None, 20);
            assert_eq!(d.replica, 0, "only r0 is usable (no probe due yet)");
            b.release(id);
        }
        // A second later b claims the probe for the proxy and sends it to r1, with r0 as its
        // backup; a, a moment later, finds it claimed and routes as usual.
        b.claim_probe(b.shared(&store), 1_020);
        let d = b.route_body(99, "/v1/completions", body, None, 1_020);
        assert!(d.probe && d.replica == 1 && d.backup == Some(0), "{d:?}");
        assert_eq!(b.destination(&d), "127.0.0.1:8001,127.0.0.1:8000");
        a.claim_probe(a.shared(&store), 1_030);
        let d = a.route_body(100, "/v1/completions", body, None, 1_030);
        assert!(!d.probe && d.replica == 0, "{d:?}");
        a.claim_probe(a.shared(&store), 2_019);
        assert!(
            !a.route_body(101, "/v1/completions", body, None, 2_019)
                .probe
        );
        a.claim_probe(a.shared(&store), 2_020);
        assert!(
            a.route_body(102, "/v1/completions", body, None, 2_020)
                .probe
        );
    }
}
