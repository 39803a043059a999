//! Replica health learned from completions (`kvsteer_core::health`): who produced a request's answer
//! (the replica, the proxy because the replica failed, or the proxy on its own account), how the
//! request ended, told apart from a retry elsewhere by the address that answered, and the probe of an
//! ejected replica, claimed once for the whole proxy.

use super::WorkerState;
use crate::host::store::SharedStore;
use crate::worker::share;
use kvsteer_core::health::{Health, Outcome};

/// Who produced the response a routed request got, as the proxy tells it. Only a replica's own
/// failures may count against it: a client can make the proxy answer for it at will (a body over a
/// buffer limit, a reset, a timeout of the proxy's own), and if those answers counted, a few such
/// requests would eject healthy replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The replica answered: its status is its own.
    Replica,
    /// The proxy answered because the replica failed the attempt: the connection was refused or
    /// cut, the stream reset, the answer timed out.
    ReplicaFailed,
    /// The proxy answered on its own account (a limit of its own, a refused body, a client gone, a
    /// filter's local reply): it says nothing about the replica.
    Proxy,
}

impl Origin {
    /// Envoy's `response.code_details`: `via_upstream` for the upstream's own answer; a reset before
    /// the response (`upstream_reset_before_response_started{reason|transport detail}`) whose reason
    /// is the remote's (`remote_*`, `connection_*`: refused, cut, timed out connecting;
    /// `protocol_error`: it spoke broken HTTP) or an upstream timeout is the replica's failure;
    /// every other detail (Envoy's local replies, a local reset, `overflow` of the proxy's own
    /// circuit breakers, another filter's answer) is the proxy's. The value is hostile in the sense
    /// that any filter may set any details: unknown ones are the proxy's.
    pub fn from_envoy_details(details: &[u8]) -> Origin {
        const RESET: &[u8] = b"upstream_reset_before_response_started";
        match details {
            b"via_upstream" => Origin::Replica,
            b"upstream_response_timeout"
            | b"upstream_per_try_timeout"
            | b"upstream_per_try_idle_timeout" => Origin::ReplicaFailed,
            d if d.starts_with(RESET) => {
                let reason = d[RESET.len()..]
                    .strip_prefix(b"{")
                    .unwrap_or_default()
                    .split(|&b| b == b'|' || b == b'}')
                    .next()
                    .unwrap_or_default();
                let remote = reason.starts_with(b"remote_")
                    || reason.starts_with(b"connection_")
                    || reason == b"protocol_error";
                if remote {
                    Origin::ReplicaFailed
                } else {
                    Origin::Proxy
                }
            }
            _ => Origin::Proxy,
        }
    }

    /// nginx (ngx_wasm_module) has no such details; its `$upstream_status` is empty for an answer
    /// nginx made without an upstream (a refused body, a limit, a local reply) and lists each
    /// attempt's status otherwise (nginx writes 502/504 for an attempt that failed to connect or
    /// timed out). Conservatively: a non-empty, well-formed list means a replica was reached or
    /// failed, and the status decides; anything else is the proxy's.
    pub fn from_nginx_upstream_status(status: &[u8]) -> Origin {
        let well_formed = !status.is_empty()
            && status.len() <= 256
            && status
                .iter()
                .all(|b| b.is_ascii_digit() || matches!(b, b' ' | b',' | b':' | b'-'))
            && status.iter().any(u8::is_ascii_digit);
        if well_formed {
            Origin::Replica
        } else {
            Origin::Proxy
        }
    }
}

/// What a routed request's answer means for its replica's health, from the response status, who
/// produced it ([`Origin`]) and whether the filter routed the body unread for being over
/// `max_body_bytes`. `None`: nothing to count. A failure is only ever the replica's own: a 5xx it
/// sent, or an attempt it failed (`ReplicaFailed`); 4xx and the proxy's own answers count for
/// nothing. An oversized body's failures do not count either: a replica (or a proxy's retry
/// buffer) may refuse such a body by cutting the connection, which looks like a replica failure
/// but is the client's doing, and any client can send one.
pub fn answer_outcome(status: u16, origin: Origin, oversized: bool) -> Option<Outcome> {
    let outcome = match origin {
        Origin::Proxy => return None,
        Origin::ReplicaFailed => Outcome::Failure,
        Origin::Replica if status >= 500 => Outcome::Failure,
        Origin::Replica if (200..300).contains(&status) => Outcome::Success,
        Origin::Replica => return None,
    };
    match outcome {
        Outcome::Failure if oversized => None,
        o => Some(o),
    }
}

impl WorkerState {
    /// How a routed request ended, for the replicas' health (`kvsteer_core::health`). `chosen`: the
    /// replica the filter chose; `served_by`: the upstream address the proxy reports for the answer
    /// (Envoy's `upstream.address`), if any. An answer from another replica means the proxy retried
    /// there, so the first choice's attempt failed: both are recorded, unless `blame_retry` is false
    /// (a request whose failures do not count, [`answer_outcome`]: the retry may be its own doing).
    pub fn request_outcome(
        &mut self,
        chosen: usize,
        served_by: Option<&[u8]>,
        outcome: Outcome,
        blame_retry: bool,
        now_ms: u64,
    ) {
        let served = served_by
            .and_then(|a| std::str::from_utf8(a).ok())
            .and_then(|a| {
                let a = a.trim();
                // Several DP ranks share one address: an answer from the chosen unit's own address
                // is the chosen unit's, not a retry to its endpoint's first rank.
                match self.cfg.units.get(chosen) {
                    Some(r) if r.endpoint == a => Some(chosen),
                    _ => self.replica_of_address(a),
                }
            });
        match served {
            Some(s) if s != chosen => {
                if blame_retry {
                    self.router.record_outcome(chosen, Outcome::Failure, now_ms);
                }
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
            share::claim_probe(store, &self.cfg.shared_key_prefix, r, now_ms, interval)
        {
            self.router.probed_elsewhere(r, last);
        }
    }

    /// The replica whose `endpoint` is `address` (`IP:port`).
    pub fn replica_of_address(&self, address: &str) -> Option<usize> {
        self.cfg.units.iter().position(|r| r.endpoint == address)
    }

    /// A failed answer was not held against any replica ([`answer_outcome`]).
    pub fn failure_not_blamed(&mut self) {
        self.counters.failure_not_blamed();
    }

    /// Failed answers not held against any replica so far.
    pub fn failures_not_blamed(&self) -> u64 {
        self.counters.failures_not_blamed()
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
    use crate::worker::testing::*;

    #[test]
    fn envoy_details_tell_the_replica_from_the_proxy() {
        use Origin::*;
        let cases: &[(&[u8], Origin)] = &[
            (b"via_upstream", Replica),
            // What Envoy 1.40 answers an oversized body with, after the filter released it.
            (b"request_payload_exceeded_retry_buffer_limit", Proxy),
            (b"request_payload_too_large", Proxy),
            (b"upstream_reset_before_response_started{connection_termination}", ReplicaFailed),
            (
                b"upstream_reset_before_response_started{remote_connection_failure|delayed_connect_error:_Connection_refused}",
                ReplicaFailed,
            ),
            (b"upstream_reset_before_response_started{remote_reset}", ReplicaFailed),
            (b"upstream_reset_before_response_started{protocol_error}", ReplicaFailed),
            (b"upstream_reset_before_response_started{overflow}", Proxy),
            (b"upstream_reset_before_response_started{local_reset}", Proxy),
            (b"upstream_reset_before_response_started", Proxy),
            (b"upstream_reset_before_response_started{", Proxy),
            (b"upstream_response_timeout", ReplicaFailed),
            (b"upstream_per_try_timeout", ReplicaFailed),
            (b"upstream_max_stream_duration_reached", Proxy),
            (b"stream_idle_timeout", Proxy),
            (b"downstream_remote_disconnect", Proxy),
            (b"direct_response", Proxy),
            (b"via_upstream ", Proxy),
            (b"VIA_UPSTREAM", Proxy),
            (b"", Proxy),
            (&[0xff, 0x00, b'{'], Proxy),
        ];
        for (d, want) in cases {
            assert_eq!(
                Origin::from_envoy_details(d),
                *want,
                "{}",
                String::from_utf8_lossy(d)
            );
        }
    }

    #[test]
    fn nginx_upstream_status_tells_a_reached_replica() {
        use Origin::*;
        for (v, want) in [
            (&b"500"[..], Replica),
            (b"502, 200", Replica),
            (b"502 : 504", Replica),
            (b"200", Replica),
            (b"", Proxy),
            (b"-", Proxy),
            (b"abc", Proxy),
            (&[b'5'; 300][..], Proxy),
        ] {
            assert_eq!(Origin::from_nginx_upstream_status(v), want);
        }
    }

    #[test]
    fn only_the_replicas_own_failures_count() {
        use Origin::*;
        let f = Some(Outcome::Failure);
        let ok = Some(Outcome::Success);
        // The replica's own answers: 5xx fails, 2xx succeeds, 4xx (the client's fault) is neither.
        assert_eq!(answer_outcome(500, Replica, false), f);
        assert_eq!(answer_outcome(503, Replica, false), f);
        assert_eq!(answer_outcome(200, Replica, false), ok);
        assert_eq!(answer_outcome(413, Replica, false), None);
        assert_eq!(answer_outcome(429, Replica, false), None);
        assert_eq!(answer_outcome(0, Replica, false), None);
        // An attempt the replica failed, whatever status the proxy wrote for it.
        assert_eq!(answer_outcome(503, ReplicaFailed, false), f);
        // The proxy's own answers never count, success or failure.
        for status in [200, 413, 503, 507, 0, 999] {
            assert_eq!(answer_outcome(status, Proxy, false), None);
            assert_eq!(answer_outcome(status, Proxy, true), None);
        }
        // An oversized body's failures are the client's doing; its successes still count.
        assert_eq!(answer_outcome(503, ReplicaFailed, true), None);
        assert_eq!(answer_outcome(500, Replica, true), None);
        assert_eq!(answer_outcome(200, Replica, true), ok);
    }

    #[test]
    fn an_unblamed_retry_records_only_the_answer() {
        let mut w = worker("round_robin");
        for t in 0..5 {
            w.request_outcome(0, Some(b"127.0.0.1:8001"), Outcome::Success, false, t);
        }
        assert_eq!(w.health().failures(), &[0, 0]);
        assert!(!w.is_ejected(0));
    }

    #[test]
    fn outcomes_are_attributed_through_the_upstream_address() {
        let mut w = worker("round_robin");
        // Envoy answered from r1 although the filter chose r0: r0's attempt failed and was retried.
        for t in 0..3 {
            w.request_outcome(0, Some(b"127.0.0.1:8001"), Outcome::Success, true, t);
        }
        assert!(w.is_ejected(0), "three failed attempts in a row");
        assert!(!w.is_ejected(1));
        assert_eq!(w.health().failures(), &[3, 0]);
        // No address (nginx, a local reply) or one outside the fleet: the choice itself.
        let mut w = worker("round_robin");
        w.request_outcome(1, None, Outcome::Failure, true, 0);
        w.request_outcome(1, Some(b"10.9.9.9:1"), Outcome::Failure, true, 1);
        w.request_outcome(1, Some(&[0xff, 0xfe]), Outcome::Failure, true, 2);
        assert!(w.is_ejected(1) && !w.is_ejected(0));
        // The same address as the choice: its own outcome, a success.
        w.request_outcome(0, Some(b" 127.0.0.1:8000 "), Outcome::Success, true, 3);
        assert_eq!(w.health().failures(), &[0, 3]);
        assert!(!w.is_ejected(0));
        // Out of range: ignored, never a panic.
        w.request_outcome(7, Some(b"127.0.0.1:8000"), Outcome::Failure, true, 4);
    }

    #[test]
    fn health_is_shared_between_workers() {
        let store = crate::host::store::tests::MemStore::default();
        let mut a = worker("least_load");
        let mut b = worker("least_load");
        a.claim_worker_id(&store);
        b.claim_worker_id(&store);
        for t in 0..3 {
            a.request_outcome(1, None, Outcome::Failure, true, t);
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
