//! A worker that does not hold a replica's feed lease follows the holder through shared data
//! ([`crate::worker::relay`]): it applies the batches the holder relays, in order and within its own feed
//! budget, and takes the holder's word on whether the replica is down.

use super::{FeedResult, WorkerState};
use crate::host::store::SharedStore;
use crate::worker::relay;
use kvsteer_core::feed::FeedFrame;
use kvsteer_core::router::FeedOutcome;
use kvsteer_core::router::Membership;

impl WorkerState {
    /// Applies the batches other workers relayed for the feeds this worker does not poll, oldest
    /// first, within this tick's feed budget: a batch that does not fit is finished over the next
    /// ticks, and the relays after it wait until it is.
    pub fn follow_relays(&mut self, store: &dyn SharedStore, now_ms: u64) -> Vec<FeedResult> {
        let mut results = Vec::new();
        for i in 0..self.feeds.len() {
            if self.feeds[i].leased || self.router.membership(i) == Membership::Vacant {
                continue;
            }
            while self.feeds[i].pending.is_none() {
                let (relayed, seen) = relay::next_unseen(
                    store,
                    &self.cfg.shared_key_prefix,
                    i,
                    self.feeds[i].relay_seen,
                );
                self.feeds[i].relay_seen = seen;
                let Some((bytes, polled_ms)) = relayed else {
                    break;
                };
                // The holder relays only what it accepted; the same limits keep a follower safe.
                if bytes.len() > self.cfg.feed_max_bytes {
                    continue;
                }
                let Ok(mut frame) = FeedFrame::parse(bytes) else {
                    continue;
                };
                let rank = kvsteer_core::feed::payload_rank(frame.bytes()).unwrap_or(0);
                if self
                    .cfg
                    .rank_of(i)
                    .is_some_and(|want| want != u32::from(rank))
                {
                    continue;
                }
                if frame.events() > self.cfg.feed_max_events {
                    continue;
                }
                let q = self.router.feed_query(i, self.cfg.feed_max_events);
                if !frame.trim_to_cursor(&q) {
                    continue;
                }
                self.budget.refill(&self.cfg, now_ms);
                let outcome = self.accept_frame(i, frame, polled_ms);
                self.feeds[i].relayed += 1;
                if outcome != FeedOutcome::Gap {
                    self.feed_ok(i, now_ms, false);
                }
                results.push(FeedResult::Applied {
                    replica: i,
                    outcome,
                });
            }
        }
        results
    }

    /// Takes the lease holders' word on which replicas are down, for the feeds this worker follows.
    pub fn follow_health(&mut self, store: &dyn SharedStore) {
        for i in 0..self.feeds.len() {
            if self.feeds[i].leased {
                continue;
            }
            if let Some(down) = relay::health(store, &self.cfg.shared_key_prefix, i) {
                self.router.set_down(i, down);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::worker::testing::*;
    use kvsteer_core::feed::{FeedBatch, FeedEvent, ReplicaLoad, Tier};

    #[test]
    fn merge_marks_a_relayed_report_with_the_leaders_poll_time_and_shares_bookings_since() {
        use crate::host::store::tests::MemStore;
        let store = MemStore::default();
        let routing = r#"{"policy":"kv_load","kv_load":{"reported_load":"merge"}}"#;
        let mut lead = worker_routing(routing);
        let mut follow = worker_routing(routing);
        assert_eq!(lead.claim_worker_id(&store), Some(0));
        assert_eq!(follow.claim_worker_id(&store), Some(1));
        let batch = |resync: bool, decode: u64| FeedBatch {
            epoch: 5,
            resync,
            more: false,
            first_seq: 0,
            next_seq: 0,
            load: ReplicaLoad {
                decode_blocks: decode,
                running: 1,
                ..ReplicaLoad::default()
            },
            events: if resync {
                vec![FeedEvent::Cleared]
            } else {
                vec![]
            },
        };
        for (w, base) in [(&mut lead, 100), (&mut follow, 200)] {
            for p in w.plan_polls(Some(&store), 0) {
                let tok = base + p.replica as u32;
                w.poll_started(p.replica, tok, 0);
                let b = batch(true, 0).encode();
                w.on_feed_response(tok, Some(200), Some(&b), Some(&store), 0);
            }
        }
        // The leader polls at 1,000; the follower admits a request at 1,050, while the poll is out;
        // the answer (which cannot hold that request) comes back at 1,100 and is relayed.
        let polls = lead.plan_polls(Some(&store), 1_000);
        assert_eq!(polls.len(), 2);
        for p in &polls {
            lead.poll_started(p.replica, 900 + p.replica as u32, 1_000);
        }
        let body = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#;
        let d = follow.route_body(1, "/v1/completions", body, None, 1_050);
        for p in &polls {
            let b = batch(false, 7).encode();
            let tok = 900 + p.replica as u32;
            lead.on_feed_response(tok, Some(200), Some(&b), Some(&store), 1_100);
        }
        assert_eq!(follow.follow_relays(&store, 1_150).len(), 2);
        assert_eq!(follow.router.report_polled_ms(d.replica), Some(1_000));
        let mine = follow.router.local_load_since()[d.replica];
        assert_eq!(mine.active_requests, 1, "admitted after the poll went out");
        assert_eq!(mine.decode_blocks, 2, "17 tokens: 2 blocks of 16");
        let eff = follow.router.effective_load()[d.replica];
        assert_eq!((eff.decode_blocks, eff.active_requests), (7 + 2, 1 + 1));
        // The leader learns the follower's booking through shared data, and adds it to the report.
        follow.share_load(&store, 1_150);
        lead.share_load(&store, 1_150);
        let eff = lead.router.effective_load()[d.replica];
        assert_eq!((eff.decode_blocks, eff.active_requests), (7 + 2, 1 + 1));
        let other = 1 - d.replica;
        assert_eq!(lead.router.effective_load()[other].decode_blocks, 7);
    }

    #[test]
    fn a_follower_of_an_idle_replica_stays_fresh_and_takes_its_load() {
        use crate::host::store::tests::MemStore;
        let store = MemStore::default();
        // Reports combined by max, so the relayed load shows in what the policies see.
        let routing = r#"{"policy":"kv_load","kv_load":{"reported_load":"max"}}"#;
        let mut lead = worker_routing(routing);
        let mut follow = worker_routing(routing);
        lead.sharing.set_id(Some(0));
        follow.sharing.set_id(Some(1));
        let snap = |epoch| FeedBatch {
            epoch,
            resync: true,
            more: false,
            first_seq: 0,
            next_seq: 0,
            load: ReplicaLoad::default(),
            events: vec![FeedEvent::Cleared],
        };
        // Both start with their own snapshots (no lease needed for a resync).
        for (w, base) in [(&mut lead, 100), (&mut follow, 200)] {
            let due = w.plan_polls(Some(&store), 0);
            assert_eq!(due.len(), 2);
            for p in due {
                let i = p.replica;
                w.poll_started(i, base + i as u32, 0);
                w.on_feed_response(
                    base + i as u32,
                    Some(200),
                    Some(&snap(5).encode()),
                    Some(&store),
                    0,
                );
            }
        }
        // From now on only the lease holder polls; the follower reads the relay.
        let mut t = 0;
        for round in 1..=20u32 {
            t += 200;
            let polls = lead.plan_polls(Some(&store), t);
            assert_eq!(polls.len(), 2, "round {round}: the leader polls both");
            assert!(
                follow.plan_polls(Some(&store), t).is_empty(),
                "follower does not poll"
            );
            for p in polls {
                let i = p.replica;
                let token = 1000 * round + i as u32;
                lead.poll_started(i, token, t);
                let mut idle = snap(5);
                idle.resync = false;
                idle.load.decode_blocks = round as u64;
                idle.events.clear();
                let r =
                    lead.on_feed_response(token, Some(200), Some(&idle.encode()), Some(&store), t);
                assert!(matches!(r, FeedResult::Applied { .. }), "{r:?}");
            }
            let got = follow.follow_relays(&store, t);
            assert_eq!(got.len(), 2, "round {round}: one relayed batch per replica");
            assert!(follow.check_staleness(t).is_empty(), "round {round}");
        }
        assert!(!follow.is_stale(0) && !follow.is_stale(1));
        assert_eq!(
            follow.router.effective_load()[0].decode_blocks,
            20,
            "reported load arrives"
        );
    }

    #[test]
    fn a_follower_applies_relayed_batches_in_slices_and_in_order() {
        use crate::host::store::tests::MemStore;
        let store = MemStore::default();
        let extra = r#", "feed_apply_blocks_per_tick": 500"#;
        let (mut lead, mut follow) = (worker_with(extra), worker_with(extra));
        lead.sharing.set_id(Some(0));
        follow.sharing.set_id(Some(1));
        // Both take their own snapshot of an empty r0, then the leader holds the lease.
        for (w, token) in [(&mut lead, 1), (&mut follow, 2)] {
            w.start_tick(0);
            w.poll_started(0, token, 0);
            w.on_feed_response(
                token,
                Some(200),
                Some(&snapshot(4, 0..0).encode()),
                Some(&store),
                0,
            );
        }
        lead.feeds[0].leased = true;
        // Two incremental batches relayed: 2,000 hashes, then 10.
        let inc = |first: u64, keys: std::ops::Range<u64>| FeedBatch {
            epoch: 4,
            resync: false,
            more: false,
            first_seq: first,
            next_seq: first + 1,
            load: ReplicaLoad::default(),
            events: vec![FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: keys.collect(),
            }],
        };
        lead.start_tick(0);
        for (token, b) in [(3, inc(0, 0..2000)), (4, inc(1, 9000..9010))] {
            lead.poll_started(0, token, 0);
            lead.on_feed_response(token, Some(200), Some(&b.encode()), Some(&store), 0);
            // The leader needs several ticks too; its next poll waits for them.
            while lead.pending_blocks() > 0 {
                lead.start_tick(0);
            }
        }
        assert_eq!(lead.stats().index_blocks, 2010);
        let mut ticks = 0;
        while !follow.index_holds(0, 9009) {
            follow.start_tick(100 * ticks);
            follow.follow_relays(&store, 100 * ticks);
            ticks += 1;
            assert!(follow.stats().index_blocks <= 500 * ticks);
            assert!(ticks < 10);
        }
        assert_eq!(
            ticks, 5,
            "2,000 hashes at 500 a tick, then the second batch"
        );
        assert_eq!(follow.stats().index_blocks, 2010);
        assert_eq!(follow.stats().feed_gaps, 0, "applied in order, no resync");
    }
}
