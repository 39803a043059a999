//! The working-set exchange between proxies (`peers` in the configuration; docs/reports/proxies.md,
//! "Working set across proxies").
//!
//! The workers of one proxy share their working-set journals in shared data ([`crate::worker::share`]);
//! separate proxies share nothing, so each would see a fraction of every replica's working set. With
//! `peers` configured, every worker polls every peer proxy on its tick (one poll per peer in flight,
//! at most every `poll_ms`) with `GET <path>?after=<worker>:<seq>,...` and the shared token; the
//! peer's filter answers locally with its workers' journals as they stand in its shared data, each
//! trimmed to the entries after the asker's mark ([`kvsteer_core::working_set::encode_bundle`]),
//! and the asker applies them as it applies its own proxy's workers' journals. Everything here is
//! off the request path: a poll is a callout from the tick, an answer a local response.
//!
//! Every byte from a peer is hostile: an answer that is not a 200, is over `max_response_bytes`, or
//! does not decode whole is refused whole and counted. A request for the path without the token is
//! refused (403) and counted, and the path is never forwarded whatever the request.

mod polls;

use crate::config::{FilterConfig, PeersSection};
use crate::host::store::SharedStore;
use crate::worker::share;
use kvsteer_core::router::Router;
use kvsteer_core::working_set::{self, encode_bundle, journal_after, parse_after};
use std::collections::HashMap;

/// One peer's poll state.
#[derive(Clone, Copy, Debug, Default)]
struct PeerPoll {
    /// The callout in flight and when it was sent.
    in_flight: Option<(u32, u64)>,
    /// When the next poll is due.
    next_ms: u64,
}

/// A poll to dispatch: peer number, upstream (cluster or address), `:authority`, `:path`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerCall {
    pub peer: usize,
    pub upstream: String,
    pub authority: String,
    pub path: String,
}

/// Counters of the exchange (since start).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExchangeStats {
    /// Polls sent.
    pub polls: u64,
    /// Polls that failed: not dispatched, reset, timed out, or answered with another status.
    pub failed: u64,
    /// Answers refused whole: oversized, or not a bundle this router can apply.
    pub refused: u64,
    /// Peers' journal entries applied.
    pub applied: u64,
    /// Peers' journal entries dropped before this worker read them.
    pub missed: u64,
    /// Requests for the reserved path refused (no or wrong token, another method, a bad query, or
    /// the exchange off).
    pub requests_refused: u64,
    /// Requests for the reserved path answered with a bundle.
    pub served: u64,
}

/// A worker's side of the exchange: its polls in flight and its counters.
#[derive(Debug, Default)]
pub struct Exchange {
    polls: Vec<PeerPoll>,
    calls: HashMap<u32, usize>,
    pub stats: ExchangeStats,
}

/// The answer to a request for the reserved path: status and body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerResponse {
    pub status: u32,
    pub body: Vec<u8>,
}

/// The media type of an answer.
pub const BUNDLE_CONTENT_TYPE: &str = "application/x-kvsteer-working-set";

/// Whether `path` (with its query) asks for the reserved path `reserved`.
pub fn is_reserved(path: &[u8], reserved: &str) -> bool {
    let p = path.split(|&b| b == b'?').next().unwrap_or_default();
    p == reserved.as_bytes()
}

/// Compares the token without an early exit on the first differing byte.
fn token_matches(got: &[u8], want: &str) -> bool {
    let want = want.as_bytes();
    got.len() == want.len() && got.iter().zip(want).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
}

impl Exchange {
    pub fn new(cfg: &FilterConfig) -> Exchange {
        Exchange {
            polls: vec![PeerPoll::default(); cfg.peers.as_ref().map_or(0, |p| p.proxies.len())],
            ..Exchange::default()
        }
    }

    /// The polls due at `now_ms` (none unless `peers` lists proxies and this worker shares its
    /// working set: `sharing`).
    pub fn plan(
        &mut self,
        cfg: &FilterConfig,
        router: &Router,
        sharing: bool,
        now_ms: u64,
    ) -> Vec<PeerCall> {
        let Some(p) = &cfg.peers else {
            return Vec::new();
        };
        if !sharing {
            return Vec::new();
        }
        let mut out = Vec::new();
        for (i, (poll, spec)) in self.polls.iter_mut().zip(&p.proxies).enumerate() {
            if let Some((_, sent)) = poll.in_flight {
                // The proxy answers every callout (a timeout is a 504); a poll it somehow never
                // answered is given up well after its timeout, so the peer is not lost for good.
                if now_ms.saturating_sub(sent) < p.timeout_ms.saturating_mul(2) + 1_000 {
                    continue;
                }
                poll.in_flight = None;
                self.calls.retain(|_, &mut v| v != i);
                self.stats.failed += 1;
            }
            if now_ms < poll.next_ms {
                continue;
            }
            let marks = router.remote_working_set_marks(i as u32);
            out.push(PeerCall {
                peer: i,
                upstream: spec.cluster.clone(),
                authority: spec
                    .authority
                    .clone()
                    .unwrap_or_else(|| spec.cluster.clone()),
                path: format!("{}?after={}", p.path, working_set::format_after(&marks)),
            });
        }
        out
    }

    /// Whether a peer poll is out (sent, not answered yet).
    pub fn any_in_flight(&self) -> bool {
        self.polls.iter().any(|p| p.in_flight.is_some())
    }

    pub fn started(&mut self, cfg: &FilterConfig, peer: usize, token: u32, now_ms: u64) {
        if let Some(poll) = self.polls.get_mut(peer) {
            poll.in_flight = Some((token, now_ms));
            poll.next_ms = now_ms + cfg.peers.as_ref().map_or(0, |p| p.poll_ms);
            self.calls.insert(token, peer);
            self.stats.polls += 1;
        }
    }

    pub fn not_started(&mut self, cfg: &FilterConfig, peer: usize, now_ms: u64) {
        if let Some(poll) = self.polls.get_mut(peer) {
            poll.next_ms = now_ms + cfg.peers.as_ref().map_or(0, |p| p.poll_ms);
            self.stats.failed += 1;
        }
    }

    /// Whether `token` is one of this worker's polls (the root's other callouts are feed polls).
    pub fn owns(&self, token: u32) -> bool {
        self.calls.contains_key(&token)
    }

    /// Whether an answer of `body_size` bytes may be read at all.
    pub fn accepts_size(cfg: &FilterConfig, body_size: usize) -> bool {
        cfg.peers
            .as_ref()
            .is_some_and(|p| body_size <= p.max_response_bytes)
    }

    /// A poll's answer: `status` (`None`: reset), the body (`None`: refused unread or absent),
    /// applied to `router` at `now_ms` when it is a 200 carrying a bundle that decodes whole.
    pub fn answered(
        &mut self,
        router: &mut Router,
        token: u32,
        status: Option<u16>,
        body: Option<&[u8]>,
        oversized: bool,
        now_ms: u64,
    ) {
        let Some(peer) = self.calls.remove(&token) else {
            return;
        };
        if let Some(poll) = self.polls.get_mut(peer) {
            poll.in_flight = None;
        }
        if status != Some(200) {
            self.stats.failed += 1;
            return;
        }
        if oversized {
            self.stats.refused += 1;
            return;
        }
        match router.apply_remote_working_set(peer as u32, body.unwrap_or_default(), now_ms) {
            Some(a) => {
                self.stats.applied += a.entries as u64;
                self.stats.missed += a.missed;
            }
            None => self.stats.refused += 1,
        }
    }

    /// Answers a request for the reserved path: `method`, the full `path` with its query, the token
    /// header's value. Only a `GET` with the configured token is served: this proxy's workers'
    /// journals from `store` (none without shared data), each trimmed to what the asker has not
    /// applied, and as many as fit in `max_response_bytes`.
    pub fn serve(
        &mut self,
        cfg: &FilterConfig,
        store: Option<&dyn SharedStore>,
        method: &[u8],
        path: &[u8],
        token: Option<&[u8]>,
        now_ms: u64,
    ) -> PeerResponse {
        let refuse = |s: &mut Self, status: u32, why: &str| {
            s.stats.requests_refused += 1;
            PeerResponse {
                status,
                body: why.as_bytes().to_vec(),
            }
        };
        let Some(p) = &cfg.peers else {
            return refuse(self, 404, "kvsteer: no working-set exchange here\n");
        };
        if !token.is_some_and(|t| token_matches(t, &p.token)) {
            return refuse(self, 403, "kvsteer: forbidden\n");
        }
        if method != b"GET" {
            return refuse(self, 405, "kvsteer: GET only\n");
        }
        let Some(after) = query_after(path) else {
            return refuse(self, 400, "kvsteer: bad after\n");
        };
        self.stats.served += 1;
        PeerResponse {
            status: 200,
            body: bundle(cfg, p, store, &after, now_ms),
        }
    }
}

/// The `after` marks of a request's query (none when absent); `None` when malformed.
fn query_after(path: &[u8]) -> Option<Vec<(u32, u64)>> {
    let path = std::str::from_utf8(path).ok()?;
    let Some((_, query)) = path.split_once('?') else {
        return Some(Vec::new());
    };
    match query.split('&').find_map(|kv| kv.strip_prefix("after=")) {
        Some(v) => parse_after(v),
        None => Some(Vec::new()),
    }
}

/// This proxy's workers' journals as they stand in shared data, fresh ones only, trimmed by
/// `after`, up to `max_response_bytes` in all.
fn bundle(
    cfg: &FilterConfig,
    p: &PeersSection,
    store: Option<&dyn SharedStore>,
    after: &[(u32, u64)],
    now_ms: u64,
) -> Vec<u8> {
    let mut parts: Vec<(u32, Vec<u8>)> = Vec::new();
    if let Some(store) = store {
        let prefix = &cfg.shared_key_prefix;
        let replicas = cfg.units.len();
        let mut size = 8;
        for w in 0..share::worker_count(store, prefix) {
            let Some(j) = share::read_working_set_fresh(store, prefix, w, now_ms, cfg.peer_ttl_ms)
            else {
                continue;
            };
            let mark = after.iter().find(|&&(x, _)| x == w).map_or(0, |&(_, s)| s);
            let Some(t) = journal_after(&j, replicas, mark, cfg.routing.working_set.sampling())
            else {
                continue;
            };
            // A journal that does not fit now is sent on a later poll (the asker's mark stays).
            if size + 8 + t.len() > p.max_response_bytes {
                continue;
            }
            size += 8 + t.len();
            parts.push((w, t));
        }
    }
    encode_bundle(parts.iter().map(|(w, j)| (*w, j.as_slice())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::store::tests::MemStore;
    use kvsteer_core::config::RoutingConfig;
    use kvsteer_core::working_set::{Sampling, WorkingSet, decode_bundle};

    const TOKEN: &str = "0123456789abcdef";

    fn cfg(peers: bool) -> FilterConfig {
        let mut json = serde_json::json!({"replicas": [
            {"name": "r0", "endpoint": "127.0.0.1:8000", "feed_cluster": "f0"},
            {"name": "r1", "endpoint": "127.0.0.1:8001", "feed_cluster": "f1"}]});
        if peers {
            json["peers"] = serde_json::json!({"proxies": [{"cluster": "b"}, {"cluster": "c",
                "authority": "c.local"}], "token": TOKEN, "poll_ms": 200});
        }
        FilterConfig::from_json(json.to_string().as_bytes()).unwrap()
    }

    fn router() -> Router {
        let mut r = Router::new(RoutingConfig::default(), 2).unwrap();
        r.share_working_set();
        r
    }

    #[test]
    fn polls_each_peer_once_per_period_with_one_in_flight() {
        let (c, mut r) = (cfg(true), router());
        let mut x = Exchange::new(&c);
        assert!(x.plan(&c, &r, false, 0).is_empty(), "not sharing yet");
        let calls = x.plan(&c, &r, true, 0);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].authority, "c.local");
        assert_eq!(calls[0].path, "/.kvsteer/working-set?after=");
        x.started(&c, 0, 7, 0);
        x.not_started(&c, 1, 0);
        assert!(x.plan(&c, &r, true, 100).is_empty(), "in flight / not due");
        assert!(x.owns(7) && !x.owns(8));
        // Peer 0 answers with a journal of one entry; its mark goes into the next poll's query.
        let mut peer = WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT);
        peer.start_journal();
        peer.record(1, &[8, 16, 24], 50);
        let j = peer.encode_journal(60, 1_000).unwrap();
        let bundle = encode_bundle([(3, &j[..])]);
        x.answered(&mut r, 7, Some(200), Some(&bundle), false, 150);
        assert_eq!(x.stats.applied, 1);
        let calls = x.plan(&c, &r, true, 200);
        assert_eq!(calls[0].path, "/.kvsteer/working-set?after=3:1");
        // Refusals: another status, oversized, garbage; a late answer for an unknown token.
        x.started(&c, 0, 8, 200);
        x.answered(&mut r, 8, Some(503), None, false, 210);
        x.started(&c, 0, 9, 400);
        x.answered(&mut r, 9, Some(200), None, true, 410);
        x.started(&c, 0, 10, 600);
        x.answered(&mut r, 10, Some(200), Some(b"garbage"), false, 610);
        x.answered(&mut r, 99, Some(200), Some(&bundle), false, 620);
        assert_eq!((x.stats.failed, x.stats.refused), (2, 2));
        // A poll the proxy never answers is given up after twice its timeout and a second.
        x.started(&c, 1, 11, 1_000);
        assert!(x.plan(&c, &r, true, 1_500).iter().all(|p| p.peer != 1));
        assert!(x.plan(&c, &r, true, 4_000).iter().any(|p| p.peer == 1));
        assert!(!x.owns(11));
    }

    #[test]
    fn serves_its_workers_journals_to_the_token_only() {
        let (c, _) = (cfg(true), ());
        let store = MemStore::default();
        let mut w = [
            WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT),
            WorkingSet::new(2, 10_000, 1 << 20, Sampling::DEFAULT),
        ];
        for (i, ws) in w.iter_mut().enumerate() {
            ws.start_journal();
            ws.record(i, &[8, 16], 10);
            ws.record(i, &[32], 20);
            share::claim_worker_id(&store, "kvsteer");
            let j = ws.encode_journal(30, 1_000).unwrap();
            share::publish_working_set(&store, "kvsteer", i as u32, &j);
        }
        let mut x = Exchange::new(&c);
        let path = b"/.kvsteer/working-set?after=1:1";
        let tok = Some(TOKEN.as_bytes());
        for (method, token, status) in [
            (&b"GET"[..], None, 403),
            (b"GET", Some(&b"0123456789abcdeF"[..]), 403),
            (b"GET", Some(&b"0123456789abcde"[..]), 403),
            (b"POST", tok, 405),
        ] {
            let r = x.serve(&c, Some(&store), method, path, token, 40);
            assert_eq!(r.status, status);
            assert!(decode_bundle(&r.body).is_none(), "no journal");
        }
        let bad = x.serve(
            &c,
            Some(&store),
            b"GET",
            b"/.kvsteer/working-set?after=1",
            tok,
            40,
        );
        assert_eq!(bad.status, 400);
        assert_eq!(x.stats.requests_refused, 5);
        let r = x.serve(&c, Some(&store), b"GET", path, tok, 40);
        assert_eq!(r.status, 200);
        let parts = decode_bundle(&r.body).unwrap();
        assert_eq!(parts.len(), 2);
        assert!(
            parts[1].1.len() < parts[0].1.len(),
            "worker 1 trimmed after 1"
        );
        // Without shared data: an empty bundle; without the section: 404.
        let r = x.serve(&c, None, b"GET", path, tok, 40);
        assert_eq!(decode_bundle(&r.body), Some(vec![]));
        let off = cfg(false);
        assert_eq!(
            x.serve(&off, Some(&store), b"GET", path, tok, 40).status,
            404
        );
        assert!(is_reserved(
            b"/.kvsteer/working-set",
            "/.kvsteer/working-set"
        ));
        assert!(is_reserved(
            b"/.kvsteer/working-set?x",
            "/.kvsteer/working-set"
        ));
        assert!(!is_reserved(
            b"/.kvsteer/working-setx",
            "/.kvsteer/working-set"
        ));
        assert!(!is_reserved(b"/v1/completions", "/.kvsteer/working-set"));
    }
}
