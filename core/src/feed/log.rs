//! The replica's side of the feed (docs/reference/feed.md): a bounded, sequenced log of cache
//! changes that answers the router's polls, with a snapshot whenever the router's epoch or cursor
//! cannot be served. Pure (no I/O): the simulator (`kvsteer-sim`) and the feed adapter beside real
//! engines (`kvsteer-feed`) both serve `/kvsteer/feed` from it.
//!
//! Changes are first gathered in a *pending* list where consecutive changes of the same kind and tier
//! merge into one event; [`FeedLog::publish`] gives them sequence numbers. Merging never touches a
//! published event, so a router that already read an event never misses hashes appended later.

use crate::feed::{FeedBatch, FeedEvent, FeedQuery, ReplicaLoad, Tier};
use std::collections::VecDeque;

/// Sequenced log of feed events with a bound on the hashes it retains.
#[derive(Debug)]
pub struct FeedLog {
    epoch: u64,
    /// Sequence number of `entries[0]`.
    first_seq: u64,
    entries: VecDeque<FeedEvent>,
    retained_hashes: usize,
    max_hashes: usize,
    pending: Vec<FeedEvent>,
}

fn hash_count(e: &FeedEvent) -> usize {
    match e {
        FeedEvent::Stored { hashes, .. } | FeedEvent::Removed { hashes, .. } => hashes.len(),
        FeedEvent::Cleared => 0,
    }
}

impl FeedLog {
    /// A log for `epoch` retaining at most `max_hashes` hashes (older events are dropped; a router
    /// that falls that far behind gets a snapshot).
    pub fn new(epoch: u64, max_hashes: usize) -> Self {
        Self {
            epoch,
            first_seq: 0,
            entries: VecDeque::new(),
            retained_hashes: 0,
            max_hashes: max_hashes.max(1),
            pending: Vec::new(),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The sequence number the next published event gets.
    pub fn next_seq(&self) -> u64 {
        self.first_seq + self.entries.len() as u64
    }

    /// Sequence number of the oldest retained event.
    pub fn first_retained_seq(&self) -> u64 {
        self.first_seq
    }

    /// Starts a new epoch with an empty log (engine restart).
    pub fn reset(&mut self, epoch: u64) {
        self.epoch = epoch;
        self.entries.clear();
        self.pending.clear();
        self.retained_hashes = 0;
    }

    fn push(&mut self, stored: bool, tier: Tier, hash: u64) {
        if let Some(last) = self.pending.last_mut() {
            match last {
                FeedEvent::Stored { tier: t, hashes } if stored && *t == tier => {
                    hashes.push(hash);
                    return;
                }
                FeedEvent::Removed { tier: t, hashes } if !stored && *t == tier => {
                    hashes.push(hash);
                    return;
                }
                _ => {}
            }
        }
        let hashes = vec![hash];
        self.pending.push(if stored {
            FeedEvent::Stored { tier, hashes }
        } else {
            FeedEvent::Removed { tier, hashes }
        });
    }

    pub fn stored(&mut self, tier: Tier, hash: u64) {
        self.push(true, tier, hash);
    }

    pub fn removed(&mut self, tier: Tier, hash: u64) {
        self.push(false, tier, hash);
    }

    /// The whole cache was dropped (the engine's `AllBlocksCleared`): a `Cleared` event, never merged.
    pub fn cleared(&mut self) {
        self.pending.push(FeedEvent::Cleared);
    }

    /// Hashes held by published events (bounded by `max_hashes`, give or take the newest event).
    pub fn retained_hashes(&self) -> usize {
        self.retained_hashes
    }

    /// Gives the pending changes sequence numbers and trims the log to its bound.
    pub fn publish(&mut self) {
        for e in self.pending.drain(..) {
            self.retained_hashes += hash_count(&e);
            self.entries.push_back(e);
        }
        while self.retained_hashes > self.max_hashes && self.entries.len() > 1 {
            if let Some(e) = self.entries.pop_front() {
                self.retained_hashes -= hash_count(&e);
                self.first_seq += 1;
            }
        }
    }

    /// Answers a poll. `snapshot` lists what the replica caches now, per tier; it is called only when
    /// a resync is needed. Publish pending changes first.
    pub fn answer(
        &self,
        q: &FeedQuery,
        load: ReplicaLoad,
        snapshot: impl FnOnce() -> Vec<(Tier, Vec<u64>)>,
    ) -> FeedBatch {
        let next = self.next_seq();
        let servable = q.epoch == self.epoch && q.cursor >= self.first_seq && q.cursor <= next;
        if !servable {
            let mut events = vec![FeedEvent::Cleared];
            for (tier, hashes) in snapshot() {
                if !hashes.is_empty() {
                    events.push(FeedEvent::Stored { tier, hashes });
                }
            }
            return FeedBatch {
                epoch: self.epoch,
                resync: true,
                more: false,
                first_seq: next,
                next_seq: next,
                load,
                events,
            };
        }
        let start = (q.cursor - self.first_seq) as usize;
        let n = (self.entries.len() - start).min(q.max_events.max(1) as usize);
        let events: Vec<FeedEvent> = self.entries.range(start..start + n).cloned().collect();
        FeedBatch {
            epoch: self.epoch,
            resync: false,
            more: start + n < self.entries.len(),
            first_seq: q.cursor,
            next_seq: q.cursor + n as u64,
            load,
            events,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(epoch: u64, cursor: u64, max: u32) -> FeedQuery {
        FeedQuery {
            epoch,
            cursor,
            max_events: max,
        }
    }

    #[test]
    fn pending_merges_but_published_events_stay_put() {
        let mut log = FeedLog::new(7, 100);
        log.stored(Tier::Gpu, 1);
        log.stored(Tier::Gpu, 2);
        log.removed(Tier::Gpu, 3);
        log.publish();
        assert_eq!(log.next_seq(), 2);
        log.removed(Tier::Gpu, 4);
        log.publish();
        let b = log.answer(&q(7, 0, 10), ReplicaLoad::default(), Vec::new);
        assert!(!b.resync);
        assert_eq!(b.events.len(), 3);
        assert_eq!(log.retained_hashes(), 4);
        assert_eq!(
            b.events[0],
            FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: vec![1, 2]
            }
        );
        let b = log.answer(&q(7, 1, 1), ReplicaLoad::default(), Vec::new);
        assert!(b.more);
        assert_eq!((b.first_seq, b.next_seq), (1, 2));
    }

    #[test]
    fn stale_cursor_or_epoch_gets_a_snapshot() {
        let mut log = FeedLog::new(7, 2);
        for h in 0..5 {
            log.stored(Tier::Gpu, h);
            log.removed(Tier::Host, h);
        }
        log.publish();
        assert!(log.first_retained_seq() > 0);
        let snap = || vec![(Tier::Gpu, vec![9])];
        let b = log.answer(&q(7, 0, 10), ReplicaLoad::default(), snap);
        assert!(b.resync);
        assert_eq!(b.events[0], FeedEvent::Cleared);
        assert_eq!(b.first_seq, b.next_seq);
        let b = log.answer(&q(8, log.next_seq(), 10), ReplicaLoad::default(), snap);
        assert!(b.resync);
        let b = log.answer(&q(7, log.next_seq() + 1, 10), ReplicaLoad::default(), snap);
        assert!(b.resync, "a cursor from the future is not served");
        let b = log.answer(&q(7, log.next_seq(), 10), ReplicaLoad::default(), snap);
        assert!(!b.resync && b.events.is_empty());
    }

    #[test]
    fn cleared_is_an_event_of_its_own() {
        let mut log = FeedLog::new(3, 100);
        log.stored(Tier::Gpu, 1);
        log.cleared();
        log.cleared();
        log.stored(Tier::Gpu, 2);
        log.publish();
        let b = log.answer(&q(3, 0, 10), ReplicaLoad::default(), Vec::new);
        assert_eq!(
            b.events,
            vec![
                FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes: vec![1]
                },
                FeedEvent::Cleared,
                FeedEvent::Cleared,
                FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes: vec![2]
                },
            ]
        );
        assert_eq!((b.first_seq, b.next_seq), (0, 4));
    }
}
