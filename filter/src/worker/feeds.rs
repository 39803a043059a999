//! Polling the replicas' feeds: when each is due (and, in nginx mode, the one callout a tick), and
//! the answers. The poll state kept per replica is [`super::pollers`]'; what a failed poll means
//! (stale, down) is in [`super::failures`]; applying an accepted batch within the tick's budget in
//! [`super::budget`]; the batches other workers relay are read in [`super::follow`].

use super::{FeedFailure, FeedState, WorkerState, proxy_could_not_connect, proxy_timed_out};
use crate::config::OutputMode;
use crate::host::store::SharedStore;
use crate::worker::relay;
use kvsteer_core::feed::FeedFrame;
use kvsteer_core::router::FeedOutcome;

/// A feed poll to dispatch now: `GET path` to `upstream` (cluster or address) with `:authority`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedPoll {
    pub replica: usize,
    pub upstream: String,
    pub authority: String,
    pub path: String,
    /// This VM has just taken the replica's lease from no one or from another VM (worth a log line:
    /// it happens once per replica at start and at each handover).
    pub took_lease: bool,
    /// A discovered member's feed address, for the destination header of its poll (the
    /// `discovery.feed_cluster`'s `override_host` picks the host from it); `None` otherwise.
    pub destination: Option<String>,
}

/// What a feed answer did, for logs and metrics.
#[derive(Clone, Debug, PartialEq)]
pub enum FeedResult {
    Applied {
        replica: usize,
        outcome: FeedOutcome,
    },
    Failed {
        replica: usize,
        cause: FeedFailure,
        reason: String,
        became_stale: bool,
        became_down: bool,
    },
    /// A response for a token this worker does not know (late after reconfiguration): ignored.
    Unknown,
}

impl WorkerState {
    /// A replica's poll state.
    pub fn feed(&self, replica: usize) -> Option<&FeedState> {
        self.feeds.get(replica)
    }

    /// Whether the replica's feed is stale: its index and reported load are not trusted.
    pub fn is_stale(&self, replica: usize) -> bool {
        self.router.is_stale(replica)
    }

    /// Whether the replica is believed down: policies avoid it while another replica is up.
    pub fn is_down(&self, replica: usize) -> bool {
        self.router.is_down(replica)
    }

    /// Feed answers refused because they named another DP rank than the unit polled.
    pub fn rank_mismatches(&self) -> u64 {
        self.feeds.rank_mismatches()
    }

    /// Replicas whose feed this worker should poll now, with the query path. With shared data, a
    /// replica is polled only by the worker holding its lease (the others follow the relay), except
    /// that a worker needing a snapshot polls for it itself. Marks nothing in flight until
    /// [`WorkerState::poll_started`] or [`WorkerState::poll_not_started`] is called for each.
    ///
    /// In nginx mode at most [`WorkerState::callouts_per_tick`] polls a tick, and none while a
    /// callout is out ([`WorkerState::callout_out`]), taken in turn from where the last bounded tick
    /// stopped; a replica over the bound is not examined (no lease is taken for a poll that is not
    /// sent) and waits for a later tick.
    pub fn plan_polls(&mut self, store: Option<&dyn SharedStore>, now_ms: u64) -> Vec<FeedPoll> {
        self.feeds.started_ms(now_ms);
        let period_hold = self.cfg.feed_period_ms.saturating_mul(3);
        let mut out = Vec::new();
        let limit = self.callouts_per_tick();
        let bounded = limit != usize::MAX;
        if bounded && self.callout_out(now_ms) {
            return out;
        }
        let n = self.feeds.len();
        let start = if bounded && n > 0 {
            self.feeds.cursor(n)
        } else {
            0
        };
        for k in 0..n {
            if bounded && self.budget.callouts() + out.len() >= limit {
                break;
            }
            let i = (start + k) % n;
            let f = &self.feeds[i];
            if f.in_flight.is_some() || f.pending.is_some() || f.next_poll_ms > now_ms {
                continue;
            }
            if self.router.membership(i) == kvsteer_core::router::Membership::Vacant {
                continue; // an empty discovery slot: nobody to poll
            }
            let q = self.router.feed_query(i, self.cfg.feed_max_events);
            let mut took_lease = false;
            let poll = match (store, self.sharing.id()) {
                (Some(s), Some(me)) if q.epoch != 0 => {
                    // A holder backing off from a dead replica keeps the lease through its next
                    // (doubled) wait, or another worker would take it and start polling afresh.
                    let hold = period_hold
                        .saturating_add(self.feeds[i].backoff_ms.saturating_mul(2))
                        .min(period_hold.saturating_add(self.cfg.feed_backoff_max_ms));
                    let prefix = &self.cfg.shared_key_prefix;
                    let routing = self.has_routed();
                    let got = relay::try_lease(s, prefix, i, me, now_ms, hold, routing);
                    took_lease = got && !self.feeds[i].leased;
                    self.feeds[i].leased = got;
                    got
                }
                _ => {
                    self.feeds[i].leased = false;
                    true
                }
            };
            if poll {
                out.push(FeedPoll {
                    replica: i,
                    upstream: self.cfg.feed_upstream(i).to_string(),
                    authority: self.cfg.feed_authority(i).to_string(),
                    path: match self.cfg.rank_of(i) {
                        Some(r) => format!("{}{}&rank={r}", self.cfg.feed_path_prefix, q.to_path()),
                        None => format!("{}{}", self.cfg.feed_path_prefix, q.to_path()),
                    },
                    took_lease,
                    destination: self.feed_destination(i).map(str::to_string),
                });
                if bounded {
                    self.feeds.polled_in_turn(i);
                }
            } else {
                self.feeds[i].next_poll_ms = now_ms.saturating_add(self.cfg.feed_period_ms);
            }
        }
        if bounded {
            self.budget.plan_callouts(out.len());
        }
        out
    }

    /// Whether a feed or peer poll of this worker is out. A feed poll out for more than twice its
    /// timeout and a second counts as lost (the proxy answers every callout, a timeout included), so
    /// that one never answered cannot stop the polling for good.
    pub fn callout_out(&self, now_ms: u64) -> bool {
        let lost_after = self
            .cfg
            .feed_timeout_ms
            .saturating_mul(2)
            .saturating_add(1_000);
        self.exchange.any_in_flight()
            || self.discovery_out(now_ms)
            || self.feeds.any_out(now_ms, lost_after)
    }

    /// Callouts this worker has planned in the current tick.
    pub fn callouts_planned(&self) -> usize {
        self.budget.callouts()
    }

    /// The rest of this tick's callouts are spent elsewhere: with several pools in an nginx VM,
    /// another pool sent the tick's one callout or has one out (the bound is the VM's). Nothing
    /// changes where callouts are not bounded.
    pub fn hold_callouts(&mut self) {
        let limit = self.callouts_per_tick();
        if limit != usize::MAX {
            let left = limit.saturating_sub(self.budget.callouts());
            self.budget.plan_callouts(left);
        }
    }

    /// Callouts one tick may dispatch: one in nginx mode, since ngx_wasm_module leaves the
    /// connection of every callout a tick dispatches but the last open for good (a worker runs out
    /// of `worker_connections` within minutes of polling 4 replicas); no bound elsewhere. Counted
    /// from [`WorkerState::start_tick`].
    ///
    /// The module's rule is in fact wider: a callout answered while another one of the VM is still
    /// out keeps its connection (the module releases them only when none is left), so in nginx mode
    /// no callout is sent while one is out either ([`WorkerState::callout_out`]).
    pub fn callouts_per_tick(&self) -> usize {
        if self.cfg.output == OutputMode::NginxVariable {
            1
        } else {
            usize::MAX
        }
    }

    pub(super) fn feed_ok(&mut self, replica: usize, now_ms: u64, more: bool) {
        if self.feeds.ok(replica, now_ms, more) {
            self.router.set_stale(replica, false);
        }
    }

    pub fn poll_started(&mut self, replica: usize, token: u32, now_ms: u64) {
        let period = self.cfg.feed_period_ms;
        self.feeds.started(replica, token, now_ms, period);
    }

    /// Whether `token` is one of this worker's callouts still out (a feed, discovery, peer or
    /// tokenizer-bundle poll): with several pools in a VM, the answer goes to the pool that
    /// sent it.
    pub fn owns_callout(&self, token: u32) -> bool {
        let bundle = {
            #[cfg(feature = "tokenizer")]
            {
                self.is_bundle_fetch(token)
            }
            #[cfg(not(feature = "tokenizer"))]
            {
                false
            }
        };
        self.feeds.owns(token)
            || self.is_discovery_poll(token)
            || self.is_peer_poll(token)
            || bundle
    }

    /// The host refused to dispatch (unknown cluster, no resolver...): a failure like any other.
    pub fn poll_not_started(&mut self, replica: usize, reason: &str, now_ms: u64) -> FeedResult {
        if let Some(f) = self.feeds.get_mut(replica) {
            f.next_poll_ms = now_ms.saturating_add(self.cfg.feed_period_ms);
        }
        self.fail(
            replica,
            FeedFailure::NotDispatched,
            format!("dispatch refused: {reason}"),
        )
    }

    /// Handles a feed callout's answer. `status` is the HTTP status (None when the call failed,
    /// which hosts report as a response with no headers); `body` the whole body.
    pub fn on_feed_response(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: Option<&[u8]>,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        self.on_feed_answer(token, status, body.map(<[u8]>::to_vec), store, now_ms)
    }

    /// [`WorkerState::on_feed_response`] taking the body the host handed over, without copying it.
    pub fn on_feed_answer(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: Option<Vec<u8>>,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        let Some(replica) = self.feeds.answered(token) else {
            return FeedResult::Unknown;
        };
        if let Some(failed) = self.status_failure(replica, status, body.as_deref(), store, now_ms) {
            return failed;
        }
        let body = body.unwrap_or_default();
        let body_len = body.len();
        if body_len > self.cfg.feed_max_bytes {
            return self.oversized_body(replica, body_len, store, now_ms);
        }
        let frame = match FeedFrame::parse(body) {
            Ok(f) => f,
            Err(e) => {
                return self.fail(replica, FeedFailure::Malformed, format!("bad payload: {e}"));
            }
        };
        if let Some(want) = self.cfg.rank_of(replica) {
            let reported = kvsteer_core::feed::payload_rank(frame.bytes()).unwrap_or(0);
            if u32::from(reported) != want {
                self.feeds.rank_mismatch();
                return self.fail(
                    replica,
                    FeedFailure::WrongRank { reported },
                    format!("answer for DP rank {reported}, polled rank {want}: refused"),
                );
            }
        }
        if frame.events() > self.cfg.feed_max_events {
            return self.oversized(
                replica,
                format!(
                    "{} events, over feed_max_events {}",
                    frame.events(),
                    self.cfg.feed_max_events
                ),
                store,
                now_ms,
            );
        }
        let more = frame.header().more;
        let polled_ms = self.feeds[replica].polled_ms;
        if let (Some(store), true) = (store, self.feeds[replica].leased) {
            let prefix = &self.cfg.shared_key_prefix;
            let n = relay::publish(store, prefix, replica, frame.bytes(), polled_ms);
            // Our own batch: followers apply it, we apply it below.
            self.feeds[replica].relay_seen = n;
        }
        self.budget.refill(&self.cfg, now_ms);
        let outcome = self.accept_frame(replica, frame, polled_ms);
        self.feed_ok(replica, now_ms, more);
        self.set_down(replica, false, store, now_ms);
        FeedResult::Applied { replica, outcome }
    }

    /// The failure a feed answer other than a 200 counts as (the proxy's own answer when it could
    /// not reach the replica or gave up waiting, the replica's HTTP status, no answer at all), with
    /// what it does to the replica's state; `None` for a 200.
    fn status_failure(
        &mut self,
        replica: usize,
        status: Option<u16>,
        body: Option<&[u8]>,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> Option<FeedResult> {
        match status {
            Some(200) => None,
            Some(s) if proxy_could_not_connect(s, body) => {
                let r = self.fail(
                    replica,
                    FeedFailure::Unreachable,
                    format!("HTTP {s} from the proxy: replica unreachable"),
                );
                Some(self.unreachable(replica, r, store, now_ms))
            }
            Some(s) if proxy_timed_out(s, body) => {
                self.feeds[replica].timeouts += 1;
                Some(self.fail(
                    replica,
                    FeedFailure::Slow,
                    format!(
                        "no answer within {} ms: slow feed",
                        self.cfg.feed_timeout_ms
                    ),
                ))
            }
            Some(s) => Some(self.fail(replica, FeedFailure::Http(s), format!("HTTP {s}"))),
            None => {
                let r = self.fail(
                    replica,
                    FeedFailure::Unreachable,
                    "connection refused or reset".into(),
                );
                Some(self.unreachable(replica, r, store, now_ms))
            }
        }
    }

    /// A feed answer whose body is over `feed_max_bytes`, refused before it is read (the proxy
    /// reports the body's size first). An answer that is not a 200 is judged by its status alone.
    pub fn on_feed_response_oversized(
        &mut self,
        token: u32,
        status: Option<u16>,
        body_len: usize,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        if status != Some(200) {
            return self.on_feed_response(token, status, None, store, now_ms);
        }
        let Some(replica) = self.feeds.answered(token) else {
            return FeedResult::Unknown;
        };
        self.oversized_body(replica, body_len, store, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::FilterConfig;
    use crate::worker::testing::*;
    use kvsteer_core::feed::{FeedEvent, ReplicaLoad, Tier};
    use kvsteer_core::health::Outcome;

    /// nginx mode: one feed poll a tick, the replicas in turn; Envoy: every due replica at once.
    #[test]
    fn nginx_mode_sends_one_callout_a_tick_in_turn() {
        let json = |output: &str| {
            format!(
                r#"{{"replicas":[
                {{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0","feed_address":"127.0.0.1:8000"}},
                {{"name":"r1","endpoint":"127.0.0.1:8001","feed_cluster":"f1","feed_address":"127.0.0.1:8001"}},
                {{"name":"r2","endpoint":"127.0.0.1:8002","feed_cluster":"f2","feed_address":"127.0.0.1:8002"}}],
               "output":"{output}","feed_period_ms":100,"tick_ms":100,"feed_timeout_ms":500}}"#
            )
        };
        let mut envoy = WorkerState::new(
            FilterConfig::from_json(json("destination_header").as_bytes()).unwrap(),
        )
        .unwrap();
        envoy.start_tick(0);
        assert_eq!(envoy.plan_polls(None, 0).len(), 3);
        let mut w =
            WorkerState::new(FilterConfig::from_json(json("nginx_variable").as_bytes()).unwrap())
                .unwrap();
        assert_eq!(w.callouts_per_tick(), 1);
        let mut order = Vec::new();
        for tick in 0..6u64 {
            let now = tick * 100;
            w.start_tick(now);
            let due = w.plan_polls(None, now);
            assert_eq!(due.len(), 1, "tick {tick}");
            assert!(
                w.plan_polls(None, now).is_empty(),
                "the tick's callout is spent"
            );
            order.push(due[0].replica);
            w.poll_not_started(due[0].replica, "refused", now);
        }
        assert_eq!(order, [0, 1, 2, 0, 1, 2]);
        // While a poll is out, no other is sent (the module would keep the connection of one
        // answered meanwhile), until it is answered, or counts as lost.
        w.start_tick(600);
        let due = w.plan_polls(None, 600);
        assert_eq!(due.len(), 1);
        w.poll_started(due[0].replica, 7, 600);
        for now in [700, 800, 2_500] {
            w.start_tick(now);
            assert!(w.plan_polls(None, now).is_empty(), "at {now}: one is out");
        }
        w.start_tick(2_601);
        assert_eq!(
            w.plan_polls(None, 2_601).len(),
            1,
            "the one out counts as lost"
        );
        w.on_feed_response(7, None, None, None, 3_001);
        w.start_tick(3_100);
        assert_eq!(w.plan_polls(None, 3_100).len(), 1);
        assert!(!w.callout_out(3_100));
    }

    /// One endpoint with 4 DP ranks beside a plain replica: five units, the ranks polled with their
    /// rank, an answer for another rank (or an out-of-range one) refused and counted, the rank's own
    /// answer applied to that rank alone, and the decision carrying the rank header's value.
    #[test]
    fn dp_ranks_are_units_with_their_own_feed_and_rank_header() {
        let json = r#"{"replicas":[
            {"name":"e0","endpoint":"127.0.0.1:8000","feed_cluster":"f0","dp_ranks":4},
            {"name":"e1","endpoint":"127.0.0.1:8001","feed_cluster":"f1"}],
           "routing":{"policy":"kv_load","block_size":4}}"#;
        let mut w = WorkerState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap();
        assert_eq!(w.replicas(), 5);
        assert_eq!(w.replica_name(2), "e0_dp2");
        assert_eq!(w.replica_name(4), "e1");
        let due = w.plan_polls(None, 0);
        assert_eq!(due.len(), 5);
        assert!(due[2].path.ends_with("&rank=2"), "{}", due[2].path);
        assert_eq!(due[2].upstream, "f0");
        assert!(!due[4].path.contains("rank"), "{}", due[4].path);
        for (i, p) in due.iter().enumerate() {
            w.poll_started(p.replica, 10 + i as u32, 0);
        }
        let prompt = br#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#;
        let req = w
            .router
            .read_request("/v1/completions", prompt, None)
            .unwrap();
        let hashes: Vec<u64> = match &req.identity {
            kvsteer_core::PromptIdentity::Exact(h) => h.iter().map(|h| h.0).collect(),
            other => panic!("{other:?}"),
        };
        let snap = FeedBatch::snapshot(3, hashes.clone());
        // Rank 2's poll answered by rank 1, then by rank 900: refused, counted, nothing stored.
        for (token, bad) in [(12, 1u16), (10, 900)] {
            let r = w.on_feed_response(token, Some(200), Some(&snap.encode_for_rank(bad)), None, 5);
            assert!(
                matches!(r, FeedResult::Failed { cause: FeedFailure::WrongRank { reported }, .. } if reported == bad),
                "{r:?}"
            );
        }
        assert_eq!(w.rank_mismatches(), 2);
        assert_eq!(w.stats().index_blocks, 0);
        w.poll_started(2, 30, 300);
        let r = w.on_feed_response(30, Some(200), Some(&snap.encode_for_rank(2)), None, 300);
        assert!(matches!(r, FeedResult::Applied { replica: 2, .. }), "{r:?}");
        assert!(w.index_holds(2, hashes[0]));
        assert!(!w.index_holds(1, hashes[0]) && !w.index_holds(3, hashes[0]));
        // The plain replica takes an answer whatever rank it names (an externally balanced rank).
        let r = w.on_feed_response(14, Some(200), Some(&snap.encode_for_rank(7)), None, 300);
        assert!(matches!(r, FeedResult::Applied { replica: 4, .. }), "{r:?}");
        w.poll_started(4, 31, 600);
        // The request goes to rank 2 of e0 (its prefix is there; e1's copy ties, then rank 2 wins on
        // nothing else: make e1 busy first).
        let busy = br#"{"prompt":[99,98,97,96,95,94,93,92]}"#;
        for id in 0..4 {
            let d = w.route_body(id, "/v1/completions", busy, None, 600);
            if d.replica != 4 {
                w.release(id);
            }
        }
        let d = w.route_body(50, "/v1/completions", prompt, None, 600);
        assert_eq!(d.replica, 2, "{d:?}");
        assert_eq!(w.rank_value(&d), Some("2"));
        assert_eq!(w.destination(&d).split(',').next(), Some("127.0.0.1:8000"));
        let mut plain = d.clone();
        plain.replica = 4;
        assert_eq!(w.rank_value(&plain), None);
        plain.replica = 99;
        assert_eq!(
            w.rank_value(&plain),
            None,
            "out of range: no header, no panic"
        );
        // An answer from the chosen rank's own address is its own, not a retry to rank 0.
        for t in 0..3 {
            w.request_outcome(2, Some(b"127.0.0.1:8000"), Outcome::Failure, true, 700 + t);
        }
        assert!(w.is_ejected(2) && !w.is_ejected(0));
    }

    #[test]
    fn feed_applies_and_staleness_comes_and_goes() {
        let mut w = worker("kv_load");
        let due = w.plan_polls(None, 0);
        assert_eq!(due.len(), 2);
        assert!(due[0].path.starts_with("/kvsteer/feed?epoch=0"));
        assert_eq!(
            (due[1].upstream.as_str(), due[1].authority.as_str()),
            ("f1", "127.0.0.1:8001")
        );
        w.poll_started(0, 7, 0);
        w.poll_started(1, 8, 0);
        assert!(
            w.plan_polls(None, 0).is_empty(),
            "one poll in flight per replica"
        );
        let snap = FeedBatch {
            epoch: 3,
            resync: true,
            more: false,
            first_seq: 5,
            next_seq: 5,
            load: ReplicaLoad::default(),
            events: vec![
                FeedEvent::Cleared,
                FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes: vec![1, 2, 3],
                },
            ],
        };
        let r = w.on_feed_response(7, Some(200), Some(&snap.encode()), None, 10);
        assert!(matches!(r, FeedResult::Applied { replica: 0, .. }), "{r:?}");
        assert_eq!(w.stats().index_blocks, 3);
        // Replica 1 fails twice: stale after the second.
        let r = w.on_feed_response(8, None, None, None, 10);
        assert!(matches!(
            r,
            FeedResult::Failed {
                became_stale: false,
                ..
            }
        ));
        w.poll_started(1, 9, 300);
        let r = w.on_feed_response(9, Some(200), Some(b"garbage"), None, 300);
        assert!(
            matches!(
                r,
                FeedResult::Failed {
                    became_stale: true,
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(w.is_stale(1) && w.router.is_stale(1));
        w.poll_started(1, 10, 600);
        let mut ok = snap.clone();
        ok.events.clear();
        w.on_feed_response(10, Some(200), Some(&ok.encode()), None, 600);
        assert!(!w.is_stale(1), "recovers when the feed returns");
        assert_eq!(
            w.on_feed_response(999, Some(200), None, None, 0),
            FeedResult::Unknown
        );
    }
}
