//! What a failed feed poll means for its replica: every kind of failure counts toward its feed being
//! stale (its index and reported load not trusted), only an unreachable replica toward its being
//! down (avoided), which the lease holder tells the other workers; a feed that goes quiet is stale
//! too.

use super::{FeedResult, FeedState, WorkerState};
use crate::config::FilterConfig;
use crate::host::store::SharedStore;
use crate::worker::relay;

/// Whether a callout's answer is the proxy saying it could not reach the replica, rather than the
/// replica answering. Envoy 1.40 reports a refused or reset connection to a `dispatch_http_call` as
/// its own 503 (`upstream connect error or disconnect/reset before headers ...`, which covers a
/// connect timeout too) and a cluster without a healthy host as 503 `no healthy upstream`; a live
/// replica's own errors never start with these phrases. A feed that answers too slowly is not this
/// ([`proxy_timed_out`]).
pub fn proxy_could_not_connect(status: u16, body: Option<&[u8]>) -> bool {
    const MARKERS: [&[u8]; 2] = [b"upstream connect error", b"no healthy upstream"];
    status == 503 && body.is_some_and(|b| MARKERS.iter().any(|m| b.starts_with(m)))
}

/// Whether a callout's answer is the proxy saying the replica did not answer within the callout's
/// timeout (Envoy: its own 504 `upstream request timeout`). The replica was reached: its feed is slow,
/// which makes the feed stale but does not mark the replica down.
pub fn proxy_timed_out(status: u16, body: Option<&[u8]>) -> bool {
    status == 504 && body.is_some_and(|b| b.starts_with(b"upstream request timeout"))
}

/// Why a feed poll failed. Only [`FeedFailure::Unreachable`] counts toward marking a replica down;
/// every kind counts toward making its feed stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedFailure {
    /// The connection was refused or reset (or the proxy had no healthy host for it).
    Unreachable,
    /// No answer within `feed_timeout_ms`.
    Slow,
    /// The answer was over `feed_max_bytes`, or held more events than `feed_max_events`: refused
    /// unread.
    Oversized,
    /// The replica answered with an HTTP error.
    Http(u16),
    /// The answer was not a feed batch.
    Malformed,
    /// The proxy refused to dispatch the callout.
    NotDispatched,
    /// The answer describes another data-parallel rank than the unit polled (or one the endpoint
    /// does not have): refused whole, its blocks would be booked on the wrong cache.
    WrongRank { reported: u16 },
}

impl WorkerState {
    /// Marks replicas stale whose feed has not been applied for `stale_after_failures + 1` periods
    /// (a follower learns of a failing poller this way). Returns the replicas that just became stale.
    pub fn check_staleness(&mut self, now_ms: u64) -> Vec<usize> {
        let started = self.feeds.started_ms(now_ms);
        let limit = self
            .cfg
            .feed_period_ms
            .saturating_mul(self.cfg.stale_after_failures as u64 + 1);
        let mut out = Vec::new();
        for (i, f) in self.feeds.iter().enumerate() {
            let last = f.last_ok_ms.unwrap_or(started);
            // A replica whose batch is still being applied has not gone quiet: this worker is busy.
            if f.pending.is_none()
                && !self.router.is_stale(i)
                && now_ms.saturating_sub(last) > limit
            {
                self.router.set_stale(i, true);
                out.push(i);
            }
        }
        out
    }

    /// [`Self::oversized`] for an answer of `body_len` bytes, over `feed_max_bytes`.
    pub(super) fn oversized_body(
        &mut self,
        replica: usize,
        body_len: usize,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        let why = format!(
            "{body_len} bytes, over feed_max_bytes {}",
            self.cfg.feed_max_bytes
        );
        self.oversized(replica, why, store, now_ms)
    }

    /// An answer refused for its size: the replica answered, so it is up, but its feed is not
    /// applied (stale after `stale_after_failures` in a row).
    pub(super) fn oversized(
        &mut self,
        replica: usize,
        reason: String,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        if let Some(f) = self.feeds.get_mut(replica) {
            f.oversized += 1;
        }
        self.set_down(replica, false, store, now_ms);
        self.fail(replica, FeedFailure::Oversized, reason)
    }

    /// A poll that could not reach the replica: after `stale_after_failures` in a row it is down, and
    /// the lease holder tells the other workers through shared data.
    pub(super) fn unreachable(
        &mut self,
        replica: usize,
        mut result: FeedResult,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        let worker = self.sharing.id();
        let Some(f) = self.feeds.get_mut(replica) else {
            return result;
        };
        let limit_reached = f.unreachable(&self.cfg, worker, replica, now_ms);
        if limit_reached && !self.router.is_down(replica) {
            self.set_down(replica, true, store, now_ms);
            if let FeedResult::Failed { became_down, .. } = &mut result {
                *became_down = true;
            }
        }
        result
    }

    pub(super) fn set_down(
        &mut self,
        replica: usize,
        down: bool,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) {
        let Some(f) = self.feeds.get_mut(replica) else {
            return;
        };
        if !down {
            f.reachable();
        }
        let leased = f.leased;
        self.router.set_down(replica, down);
        if let (Some(store), true) = (store, leased) {
            relay::publish_health(store, &self.cfg.shared_key_prefix, replica, down, now_ms);
        }
    }

    pub(super) fn fail(
        &mut self,
        replica: usize,
        cause: FeedFailure,
        reason: String,
    ) -> FeedResult {
        let limit = self.cfg.stale_after_failures;
        let Some(f) = self.feeds.get_mut(replica) else {
            return FeedResult::Unknown;
        };
        let limit_reached = f.failed(limit);
        let became_stale = !self.router.is_stale(replica) && limit_reached;
        if became_stale {
            self.router.set_stale(replica, true);
        }
        FeedResult::Failed {
            replica,
            cause,
            reason,
            became_stale,
            became_down: false,
        }
    }
}

impl FeedState {
    /// A failed poll of any kind; whether `limit` (`stale_after_failures`) have failed in a row.
    pub(super) fn failed(&mut self, limit: u32) -> bool {
        self.failures += 1;
        self.consecutive_failures = self.consecutive_failures.saturating_add(1);
        self.consecutive_failures >= limit
    }

    /// A poll that could not reach the replica (of `worker`'s unit `unit`) at `now_ms`; whether
    /// `stale_after_failures` have in a row. From then on, when `feed_backoff_max_ms` is longer than
    /// the period, the next poll waits twice as long as the last (jittered), up to that longest
    /// wait.
    pub(super) fn unreachable(
        &mut self,
        cfg: &FilterConfig,
        worker: Option<u32>,
        unit: usize,
        now_ms: u64,
    ) -> bool {
        self.consecutive_unreachable = self.consecutive_unreachable.saturating_add(1);
        let reached = self.consecutive_unreachable >= cfg.stale_after_failures;
        if reached && cfg.feed_backoff_max_ms > cfg.feed_period_ms {
            // Down (or about to be): stop knocking every period. The verdict itself still comes
            // after `stale_after_failures` polls, as before; only the polls after it are spaced.
            self.backoff_ms = self
                .backoff_ms
                .max(cfg.feed_period_ms)
                .saturating_mul(2)
                .min(cfg.feed_backoff_max_ms);
            let wait = jittered(self.backoff_ms, worker, unit, now_ms);
            self.next_poll_ms = self.next_poll_ms.max(now_ms.saturating_add(wait));
        }
        reached
    }

    /// The replica answered (or is up): no unreachable polls in a row, no backoff.
    pub(super) fn reachable(&mut self) {
        self.consecutive_unreachable = 0;
        self.backoff_ms = 0;
    }
}

/// `wait_ms` spread over 80-120%, so that the workers of one proxy (and several proxies) backing off
/// from the same dead replica do not knock in step; the same inputs give the same wait.
fn jittered(wait_ms: u64, worker: Option<u32>, replica: usize, now_ms: u64) -> u64 {
    let seed =
        now_ms ^ (replica as u64).rotate_left(40) ^ u64::from(worker.unwrap_or(0)).rotate_left(20);
    let u = kvsteer_core::rng::SplitMix64::new(seed).next_f64();
    (wait_ms as f64 * (0.8 + 0.4 * u)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::testing::*;
    use kvsteer_core::feed::{FeedEvent, ReplicaLoad};

    /// One unit's failure counts alone: stale after `stale_after_failures` failures in a row,
    /// down after as many unreachable polls, from which each wait doubles (jittered) up to the
    /// longest; an answer clears the backoff.
    #[test]
    fn a_feed_state_counts_failures_and_backs_off() {
        let w = worker_with(r#", "feed_period_ms": 200, "feed_backoff_max_ms": 1000"#);
        let cfg = w.config();
        let mut f = FeedState::default();
        assert!(!f.failed(2) && f.failed(2) && f.failed(2));
        assert_eq!((f.failures, f.consecutive_failures), (3, 3));
        assert!(!f.unreachable(cfg, None, 0, 0));
        assert_eq!(
            (f.backoff_ms, f.next_poll_ms),
            (0, 0),
            "not yet down: no backoff"
        );
        let mut waits = Vec::new();
        for now in [200, 400, 600, 800] {
            assert!(f.unreachable(cfg, Some(1), 0, now));
            waits.push(f.backoff_ms);
            let jitter = f.next_poll_ms - now;
            assert!(jitter * 10 >= f.backoff_ms * 8 && jitter * 10 <= f.backoff_ms * 12);
        }
        assert_eq!(waits, [400, 800, 1000, 1000]);
        f.reachable();
        assert_eq!((f.consecutive_unreachable, f.backoff_ms), (0, 0));
    }

    /// A replica with nothing listening is polled every period until it is down, then at waits
    /// doubling up to `feed_backoff_max_ms` (jittered 80-120%), and is noticed again within one
    /// longest wait of coming back. Over a virtual minute: 300 polls at the 200 ms period before
    /// the backoff; here at most 30.
    #[test]
    fn a_dead_replica_is_polled_ever_less_often_and_noticed_when_back() {
        let mut w = worker("kv_load");
        let empty = FeedBatch::snapshot(1, Vec::new()).encode();
        let mut token = 0;
        let (mut dead_polls, mut back_at, mut up_at) = (0u32, None, None);
        for tick in 0..900u64 {
            let t = tick * 100;
            // Replica 0 is dead for the first minute, then answers; replica 1 always answers.
            if t >= 60_000 {
                back_at.get_or_insert(t);
            }
            for p in w.plan_polls(None, t) {
                token += 1;
                w.poll_started(p.replica, token, t);
                let alive = p.replica == 1 || back_at.is_some();
                if p.replica == 0 && back_at.is_none() {
                    dead_polls += 1;
                }
                let (status, body) = if alive {
                    (Some(200), Some(empty.as_slice()))
                } else {
                    (None, None)
                };
                w.on_feed_response(token, status, body, None, t);
            }
            if back_at.is_some() && up_at.is_none() && !w.is_down(0) {
                up_at = Some(t);
            }
            if t == 59_900 {
                assert!(w.is_down(0), "down after stale_after_failures polls");
                assert!(w.feeds[0].backoff_ms <= w.config().feed_backoff_max_ms);
            }
        }
        let noticed = up_at.expect("noticed again") - back_at.unwrap();
        eprintln!("dead replica: {dead_polls} polls in a minute, noticed back after {noticed} ms");
        assert!(
            (8..=30).contains(&dead_polls),
            "{dead_polls} polls in a minute"
        );
        let longest = w.config().feed_backoff_max_ms * 6 / 5;
        assert!(noticed <= longest, "back after {noticed} ms");
        assert_eq!(w.feeds[0].backoff_ms, 0, "reset once it answers");
        // Replica 1, always answering, was polled every period.
        assert!(w.feeds[1].polls >= 440, "{}", w.feeds[1].polls);
    }

    /// At or below the period, the longest wait means no backoff: every period, as before.
    #[test]
    fn no_backoff_when_the_longest_wait_is_the_period() {
        let mut w = worker_with(r#", "feed_backoff_max_ms": 0"#);
        let mut token = 0;
        for tick in 0..100u64 {
            let t = tick * 100;
            for p in w.plan_polls(None, t) {
                token += 1;
                w.poll_started(p.replica, token, t);
                w.on_feed_response(token, None, None, None, t);
            }
        }
        assert!(w.is_down(0));
        assert_eq!(w.feeds[0].polls, 50, "every 200 ms period over 10 s");
    }

    #[test]
    fn the_longest_wait_is_bounded() {
        let json = |max: u64| {
            format!(
                r#"{{"replicas":[{{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}}],
                    "feed_backoff_max_ms":{max}}}"#
            )
        };
        let e = FilterConfig::from_json(json(3_600_001).as_bytes()).unwrap_err();
        assert!(e.to_string().contains("feed_backoff_max_ms"), "{e}");
        assert!(FilterConfig::from_json(json(0).as_bytes()).is_ok());
        assert!(FilterConfig::from_json(json(3_600_000).as_bytes()).is_ok());
    }

    #[test]
    fn unreachable_replicas_go_down_http_errors_only_stale() {
        use crate::host::store::tests::MemStore;
        let store = MemStore::default();
        let mut w = worker("kv_load");
        let mut follower = worker("kv_load");
        w.sharing.set_id(Some(0));
        follower.sharing.set_id(Some(1));
        // Make worker 0 the lease holder of both feeds.
        for f in w.feeds.iter_mut() {
            f.leased = true;
        }
        let mut token = 0;
        let mut poll = |w: &mut WorkerState, replica: usize, status: Option<u16>, t: u64| {
            token += 1;
            w.poll_started(replica, token, t);
            w.on_feed_response(token, status, None, Some(&store), t)
        };
        // Replica 1 answers HTTP 503 (feed outage on a live server): stale, never down.
        for t in 0..4 {
            poll(&mut w, 1, Some(503), t * 200);
        }
        assert!(w.is_stale(1) && !w.is_down(1));
        // Replica 0 cannot be reached: down after two (stale_after_failures) in a row.
        let r = poll(&mut w, 0, None, 0);
        assert!(matches!(
            r,
            FeedResult::Failed {
                became_down: false,
                ..
            }
        ));
        let r = poll(&mut w, 0, None, 200);
        assert!(
            matches!(
                r,
                FeedResult::Failed {
                    became_down: true,
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(w.router.is_down(0));
        for id in 0..20 {
            let d = w.route_body(id, "/v1/completions", br#"{"prompt":[1,2,3]}"#, None, 300);
            assert_eq!(d.replica, 1, "the down replica is avoided");
            assert_eq!(
                w.destination(&d),
                "127.0.0.1:8001",
                "no down backup offered"
            );
        }
        // The follower learns it from shared data.
        follower.follow_health(&store);
        assert!(follower.router.is_down(0) && !follower.router.is_down(1));
        // Back: one good answer brings it up, for both.
        let mut snap = FeedBatch {
            epoch: 1,
            resync: true,
            more: false,
            first_seq: 0,
            next_seq: 0,
            load: ReplicaLoad::default(),
            events: vec![FeedEvent::Cleared],
        };
        snap.events.clear();
        w.poll_started(0, 99, 400);
        w.on_feed_response(99, Some(200), Some(&snap.encode()), Some(&store), 400);
        assert!(!w.router.is_down(0));
        follower.follow_health(&store);
        assert!(!follower.router.is_down(0));
    }

    #[test]
    fn envoy_local_replies_for_unreachable_hosts_mean_down() {
        let envoy_503 = b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
        assert!(proxy_could_not_connect(503, Some(envoy_503)));
        assert!(proxy_could_not_connect(503, Some(b"no healthy upstream")));
        // A timeout is a slow feed, not an unreachable replica.
        assert!(!proxy_could_not_connect(
            504,
            Some(b"upstream request timeout")
        ));
        assert!(proxy_timed_out(504, Some(b"upstream request timeout")));
        assert!(!proxy_timed_out(
            504,
            Some(b"gateway timeout from the replica")
        ));
        assert!(!proxy_timed_out(503, Some(envoy_503)));
        // The replica's own feed outage: stale, not down.
        assert!(!proxy_could_not_connect(
            503,
            Some(br#"{"error":{"message":"feed outage"}}"#)
        ));
        assert!(!proxy_could_not_connect(500, Some(envoy_503)));
        assert!(!proxy_could_not_connect(503, None));

        let mut w = worker("kv_load");
        for t in 0..2 {
            w.poll_started(0, 50 + t, t as u64 * 200);
            w.on_feed_response(50 + t, Some(503), Some(envoy_503), None, t as u64 * 200);
        }
        assert!(w.is_down(0));
    }

    #[test]
    fn slow_and_oversized_feeds_go_stale_but_never_down() {
        let mut w = worker_with(r#", "feed_max_bytes": 1000, "feed_max_events": 4"#);
        let timeout = b"upstream request timeout".as_slice();
        let mut token = 0;
        let mut poll = |w: &mut WorkerState, replica: usize, status, body: Option<&[u8]>, t| {
            token += 1;
            w.poll_started(replica, token, t);
            w.on_feed_response(token, status, body, None, t)
        };
        // r0 times out, again and again: stale after two, never down.
        for n in 0..6u64 {
            let r = poll(&mut w, 0, Some(504), Some(timeout), n * 200);
            assert!(
                matches!(
                    r,
                    FeedResult::Failed {
                        cause: FeedFailure::Slow,
                        became_down: false,
                        ..
                    }
                ),
                "{r:?}"
            );
        }
        assert!(w.is_stale(0) && !w.is_down(0));
        assert_eq!(w.feed(0).unwrap().timeouts, 6);
        // r1 answers 200 with a valid snapshot over the byte cap, then one with too many events.
        let big = snapshot(3, 0..200).encode();
        assert!(big.len() > 1000);
        let r = poll(&mut w, 1, Some(200), Some(&big), 0);
        assert!(
            matches!(
                r,
                FeedResult::Failed {
                    cause: FeedFailure::Oversized,
                    ..
                }
            ),
            "{r:?}"
        );
        let mut many = snapshot(3, 0..1);
        many.events = vec![FeedEvent::Cleared; 5];
        let r = poll(&mut w, 1, Some(200), Some(&many.encode()), 200);
        assert!(
            matches!(
                r,
                FeedResult::Failed {
                    cause: FeedFailure::Oversized,
                    became_stale: true,
                    became_down: false,
                    ..
                }
            ),
            "{r:?}"
        );
        assert_eq!(w.stats().index_blocks, 0, "nothing of either was applied");
        assert_eq!(w.feed(1).unwrap().oversized, 2);
        // The proxy reports the size first: refused unread, same verdict.
        w.poll_started(1, 900, 400);
        let r = w.on_feed_response_oversized(900, Some(200), 50 << 20, None, 400);
        assert!(matches!(
            r,
            FeedResult::Failed {
                cause: FeedFailure::Oversized,
                became_down: false,
                ..
            }
        ));
        assert_eq!(w.feed(1).unwrap().oversized, 3);
        assert!(w.feed(1).unwrap().in_flight.is_none());
        // Both still get traffic (by load): neither is avoided.
        let mut seen = [false; 2];
        for id in 0..20 {
            let d = w.route_body(id, "/v1/completions", br#"{"prompt":[1,2,3]}"#, None, 500);
            seen[d.replica] = true;
        }
        assert_eq!(seen, [true, true]);
        // A reset connection, on the other hand, is unreachable: down after two.
        for n in 0..2u64 {
            poll(&mut w, 0, None, None, 1000 + n * 200);
        }
        assert!(w.is_down(0));
        // And a timeout after that neither adds to nor clears it.
        poll(&mut w, 0, Some(504), Some(timeout), 1400);
        assert!(w.is_down(0));
    }
}
