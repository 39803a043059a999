//! Prefill/decode disaggregation (docs/design/pd.md): a request split into a prefill and a decode
//! leg, each booked on its own replica; the bodies themselves are [`crate::worker::leg_bodies`]'s.

use super::{BodyFallback, WorkerState};
use crate::config::FilterConfig;
use kvsteer_core::disaggregation::{PdParams, Role};
use kvsteer_core::request::RouteRequest;
use kvsteer_core::router::Decision;

/// How a request in a P/D fleet goes (docs/design/pd.md), from [`WorkerState::route_pd`].
#[derive(Clone, Debug, PartialEq)]
pub enum PdRoute {
    /// Both legs booked, the prefill leg under `prefill_id`, the decode leg under `decode_id`: send
    /// `prefill_body` to `prefill`, then the client's request (with the answer's
    /// `kv_transfer_params`) where `decode` says.
    Legs {
        prefill: usize,
        decode: Decision,
        client: serde_json::Map<String, serde_json::Value>,
        prefill_body: Vec<u8>,
        prefill_matched_tokens: u64,
        /// Where to send the prefill leg if it fails with a 5xx or no answer (the side's backup, its
        /// cached prompt tokens) and the request, to book it there
        /// ([`WorkerState::rebook_prefill`]): for a health probe the side's own choice, otherwise
        /// the next cheapest replica that prefills when `pd.retry_prefill` is on.
        prefill_backup: Option<(usize, u64, Box<RouteRequest>)>,
    },
    /// The body is not a request the filter can split (too large, not JSON, no prompt): sent whole,
    /// by load, to a replica that decodes, booked under `decode_id`. `body`: the body to send
    /// instead of the client's when it was a JSON object carrying its own `kv_transfer_params`
    /// (dropped: only the filter may set them in a P/D fleet).
    Whole {
        decision: Decision,
        body: Option<Vec<u8>>,
    },
    /// No prefill replica can take it (the chosen one is down: every one that prefills is): nothing
    /// booked; the client gets a 503.
    Unavailable { replica: Option<usize>, why: String },
}

/// The fleet's P/D roles and parameters, and the request ids of the P/D requests this VM sends.
#[derive(Clone, Debug)]
pub struct PdLegs {
    /// Every replica's P/D role; `disaggregated` when some role is not `both`.
    roles: Vec<Role>,
    disaggregated: bool,
    params: PdParams,
    /// The P/D requests' `x-request-id`: this VM's random nonce and a counter.
    nonce: u64,
    requests: u64,
}

impl PdLegs {
    pub fn new(cfg: &FilterConfig) -> PdLegs {
        PdLegs {
            roles: cfg.roles(),
            disaggregated: cfg.disaggregated(),
            params: cfg.pd.params(),
            nonce: 0,
            requests: 0,
        }
    }

    /// Whether requests are split into a prefill and a decode leg: some replica's role is not `both`.
    pub fn disaggregated(&self) -> bool {
        self.disaggregated
    }

    /// Every replica's role.
    pub fn roles(&self) -> &[Role] {
        &self.roles
    }

    pub fn params(&self) -> &PdParams {
        &self.params
    }

    /// Seeds the request ids with a value of this VM's own.
    pub fn set_nonce(&mut self, nonce: u64) {
        self.nonce = nonce;
    }

    /// A fresh `x-request-id` for both legs of one P/D request.
    pub fn next_request_id(&mut self) -> String {
        self.requests += 1;
        crate::worker::leg_bodies::request_id(self.nonce, self.requests)
    }
}

impl WorkerState {
    /// Whether requests are split into a prefill and a decode leg: some replica's role is not `both`.
    pub fn disaggregated(&self) -> bool {
        self.pd.disaggregated()
    }

    /// Seeds the P/D request ids with a value of this VM's own (random at configure time).
    pub fn set_pd_nonce(&mut self, nonce: u64) {
        self.pd.set_nonce(nonce);
    }

    /// A fresh `x-request-id` for both legs of one P/D request.
    pub fn next_pd_request_id(&mut self) -> String {
        self.pd.next_request_id()
    }

    /// Routes a P/D request: reads it, picks both ends (`Router::route_pd`) and books both legs, or
    /// sends it whole to a decode replica when it cannot be split, or gives up when no replica that
    /// prefills is up.
    pub fn route_pd(
        &mut self,
        prefill_id: u64,
        decode_id: u64,
        path: &str,
        body: &[u8],
        session: Option<&str>,
        now_ms: u64,
    ) -> PdRoute {
        let whole = |s: &mut Self, why: BodyFallback| {
            let decision = s.route_fallback(decode_id, why, body.len(), now_ms);
            let body = crate::worker::leg_bodies::client_request(body)
                .filter(|m| m.contains_key(crate::worker::leg_bodies::KV_TRANSFER_PARAMS))
                .map(|m| crate::worker::leg_bodies::decode_body(m, None));
            PdRoute::Whole { decision, body }
        };
        if body.len() > self.cfg.routing.max_body_bytes {
            return whole(self, BodyFallback::TooLarge);
        }
        let tok = self.prompts.tokenizer();
        let req = match self.router.read_request_with(path, body, session, tok) {
            Ok(r) => r,
            Err(_) => return whole(self, BodyFallback::Unreadable),
        };
        let Some(client) = crate::worker::leg_bodies::client_request(body) else {
            return whole(self, BodyFallback::Unreadable);
        };
        let d = match self
            .router
            .route_pd(&req, self.pd.roles(), self.pd.params(), now_ms)
        {
            Ok(d) => d,
            Err(e) => {
                return PdRoute::Unavailable {
                    replica: None,
                    why: e.to_string(),
                };
            }
        };
        if self.router.is_down(d.prefill) {
            // route_pd keeps to replicas that are up while its side has one: every one is down.
            return PdRoute::Unavailable {
                replica: Some(d.prefill),
                why: "is down, as is every replica that prefills".into(),
            };
        }
        self.router
            .admit_pd(prefill_id, decode_id, &req, &d, now_ms);
        self.counters.booked(2);
        let decode = self.router.pd_decode_decision(&d, self.pd.roles());
        PdRoute::Legs {
            prefill: d.prefill,
            decode,
            prefill_body: crate::worker::leg_bodies::prefill_body(&client),
            client,
            prefill_matched_tokens: d.prefill_matched_tokens,
            prefill_backup: d
                .prefill_backup
                .filter(|_| d.prefill_probe || self.cfg.pd.retry_prefill)
                .map(|(r, matched)| (r, matched, Box::new(req))),
        }
    }

    /// A prefill leg failed (a health probe, or a leg retried on its side's backup): it is released
    /// there and booked again under the same id on `replica`, where it is sent next.
    pub fn rebook_prefill(
        &mut self,
        prefill_id: u64,
        req: &RouteRequest,
        replica: usize,
        matched_tokens: u64,
        now_ms: u64,
    ) {
        self.release(prefill_id);
        self.router
            .admit_prefill_leg(prefill_id, req, replica, matched_tokens, now_ms);
        self.counters.booked(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::testing::*;

    /// The roles come from the configuration; the ids are the nonce's and count up.
    #[test]
    fn legs_know_the_roles_and_number_their_requests() {
        let json = r#"{"replicas":[
            {"name":"p0","endpoint":"10.0.0.1:8000","feed_cluster":"f0","role":"prefill","prefill_cluster":"c0"},
            {"name":"d0","endpoint":"10.0.0.3:8000","feed_cluster":"f2","role":"decode"}]}"#;
        let mut legs = PdLegs::new(&FilterConfig::from_json(json.as_bytes()).unwrap());
        assert!(legs.disaggregated());
        assert_eq!(legs.roles(), &[Role::Prefill, Role::Decode]);
        legs.set_nonce(7);
        let first = legs.next_request_id();
        assert_eq!(first, crate::worker::leg_bodies::request_id(7, 1));
        assert_ne!(legs.next_request_id(), first);
        let plain = worker("kv_load");
        assert!(!PdLegs::new(plain.config()).disaggregated());
    }

    fn pd_worker() -> WorkerState {
        let json = r#"{"replicas":[
            {"name":"p0","endpoint":"10.0.0.1:8000","feed_cluster":"f0","role":"prefill","prefill_cluster":"c0"},
            {"name":"p1","endpoint":"10.0.0.2:8000","feed_cluster":"f1","role":"prefill","prefill_cluster":"c1"},
            {"name":"d0","endpoint":"10.0.0.3:8000","feed_cluster":"f2","role":"decode"},
            {"name":"d1","endpoint":"10.0.0.4:8000","feed_cluster":"f3","role":"decode"}]}"#;
        WorkerState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
    }

    /// A readable request is split into two booked legs (prefill side, decode side), each released
    /// apart; one that cannot be split goes whole to a decode replica without the client's
    /// `kv_transfer_params`; with every prefill replica down nothing is booked.
    #[test]
    fn pd_requests_are_split_sent_whole_or_refused() {
        let mut w = pd_worker();
        assert!(w.disaggregated() && !worker("kv_load").disaggregated());
        let body = br#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":9,"stream":true}"#;
        let PdRoute::Legs {
            prefill,
            decode,
            client,
            prefill_body,
            ..
        } = w.route_pd(1 << 32 | 5, 5, "/v1/completions", body, None, 0)
        else {
            panic!("two legs expected");
        };
        assert!(
            prefill < 2 && (2..4).contains(&decode.replica),
            "{prefill} {decode:?}"
        );
        assert!(decode.backup.is_some_and(|b| (2..4).contains(&b)));
        assert_eq!(client["max_tokens"], 9);
        let pb: serde_json::Value = serde_json::from_slice(&prefill_body).unwrap();
        assert_eq!(pb["max_tokens"], 1);
        assert_eq!(w.router.local_load()[prefill].active_requests, 1);
        assert_eq!(w.router.local_load()[decode.replica].active_requests, 1);
        assert_eq!(w.bookings(), (2, 0));
        assert!(w.release(1 << 32 | 5) && w.release(5));
        assert!(!w.release(5), "each leg is booked once");
        assert_eq!(w.bookings(), (2, 2));

        for (bad, stripped) in [
            (
                &br#"{"max_tokens":9,"kv_transfer_params":{"remote_host":"x"}}"#[..],
                true,
            ),
            (b"not json", false),
        ] {
            let PdRoute::Whole { decision, body } =
                w.route_pd(1 << 32 | 6, 6, "/v1/completions", bad, None, 0)
            else {
                panic!("whole expected");
            };
            assert!((2..4).contains(&decision.replica));
            assert_eq!(body.is_some(), stripped);
            if let Some(b) = body {
                assert!(!String::from_utf8(b).unwrap().contains("kv_transfer_params"));
            }
            assert!(w.release(6));
            assert!(!w.release(1 << 32 | 6), "nothing booked for a prefill leg");
        }

        w.router.set_down(0, true);
        w.router.set_down(1, true);
        let r = w.route_pd(1 << 32 | 7, 7, "/v1/completions", body, None, 0);
        assert!(
            matches!(
                r,
                PdRoute::Unavailable {
                    replica: Some(0 | 1),
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(!w.release(7) && !w.release(1 << 32 | 7), "nothing booked");
        assert_eq!(w.bookings(), (4, 4));
        assert_ne!(w.next_pd_request_id(), w.next_pd_request_id());
    }
}
