//! The feed pollers' state: each unit's [`FeedState`], the callouts out and where a bounded tick's
//! polling resumes. When to poll and what an answer does is [`super::feeds`]'.

use kvsteer_core::feed::FeedFrame;
use std::collections::HashMap;

/// Poll state of one replica's feed. Whether the replica is stale or down is not kept here: the
/// router holds it (`WorkerState::is_stale`, `WorkerState::is_down`), the one place routing reads.
#[derive(Clone, Debug, Default)]
pub struct FeedState {
    pub in_flight: Option<u32>,
    /// When the poll in flight (or the last one) was sent: its answer's load holds every request
    /// admitted before then (`reported_load` `merge`).
    pub polled_ms: u64,
    pub next_poll_ms: u64,
    pub consecutive_failures: u32,
    pub polls: u64,
    pub failures: u64,
    /// Last time a batch for this replica was applied (polled or relayed).
    pub last_ok_ms: Option<u64>,
    /// This worker holds the replica's feed lease and relays what it polls.
    pub leased: bool,
    /// Newest relay number applied from the shared ring.
    pub relay_seen: u64,
    /// Batches applied from other workers' polls.
    pub relayed: u64,
    /// Polls in a row that could not reach the replica at all (connection refused or reset, as
    /// opposed to a slow or oversized answer or an HTTP error from a live server).
    pub consecutive_unreachable: u32,
    /// While the replica cannot be reached: how long after the last poll the next one waits (before
    /// jitter). It doubles with each unreachable poll from the one that marks the replica down, up
    /// to `feed_backoff_max_ms`; 0 once the replica answers ([`FeedState::unreachable`]).
    pub backoff_ms: u64,
    /// Polls that timed out (slow feed).
    pub timeouts: u64,
    /// Answers refused for their size.
    pub oversized: u64,
    /// A batch accepted but not yet wholly applied (applied in slices, `feed_apply_blocks_per_tick`
    /// per tick): this replica is not polled, nor its relay read, until it is done.
    pub pending: Option<FeedFrame>,
    /// Batches that took more than one slice.
    pub deferred: u64,
}

/// The replicas' poll states, the callouts out and where a bounded tick's polling resumes.
#[derive(Clone, Debug, Default)]
pub struct FeedPollers {
    /// Per unit, its poll state.
    states: Vec<FeedState>,
    /// The feed callouts out, by token: the unit polled.
    callouts: HashMap<u32, usize>,
    /// Where the next bounded tick starts looking for a feed to poll, so every replica gets its turn.
    cursor: usize,
    /// The first tick or poll: a feed never applied counts as quiet from then.
    started_ms: Option<u64>,
    /// Feed answers refused for naming another DP rank than the unit polled.
    rank_mismatches: u64,
}

impl FeedPollers {
    pub fn new(units: usize) -> FeedPollers {
        FeedPollers {
            states: vec![FeedState::default(); units],
            ..FeedPollers::default()
        }
    }

    pub fn len(&self) -> usize {
        self.states.len()
    }

    pub fn is_empty(&self) -> bool {
        self.states.is_empty()
    }

    pub fn get(&self, unit: usize) -> Option<&FeedState> {
        self.states.get(unit)
    }

    pub fn get_mut(&mut self, unit: usize) -> Option<&mut FeedState> {
        self.states.get_mut(unit)
    }

    pub fn iter(&self) -> std::slice::Iter<'_, FeedState> {
        self.states.iter()
    }

    pub fn iter_mut(&mut self) -> std::slice::IterMut<'_, FeedState> {
        self.states.iter_mut()
    }

    /// When polling started (set by the first call, at `now_ms`).
    pub fn started_ms(&mut self, now_ms: u64) -> u64 {
        *self.started_ms.get_or_insert(now_ms)
    }

    /// Where a bounded tick starts looking among `n` units.
    pub fn cursor(&self, n: usize) -> usize {
        self.cursor % n
    }

    /// A bounded tick polled `unit`: the next one starts after it.
    pub fn polled_in_turn(&mut self, unit: usize) {
        self.cursor = unit + 1;
    }

    /// A poll of `unit` went out under `token` at `now_ms`; the next is due a `period_ms` later.
    pub fn started(&mut self, unit: usize, token: u32, now_ms: u64, period_ms: u64) {
        if let Some(f) = self.states.get_mut(unit) {
            f.in_flight = Some(token);
            f.polled_ms = now_ms;
            f.polls += 1;
            f.next_poll_ms = now_ms.saturating_add(period_ms);
            self.callouts.insert(token, unit);
        }
    }

    /// Whether `token` is a feed poll of these units that is still out.
    pub fn owns(&self, token: u32) -> bool {
        self.callouts.contains_key(&token)
    }

    /// The unit whose poll `token` answers, no longer in flight; `None` for an unknown token.
    pub fn answered(&mut self, token: u32) -> Option<usize> {
        let unit = self.callouts.remove(&token)?;
        if let Some(f) = self.states.get_mut(unit) {
            f.in_flight = None;
        }
        Some(unit)
    }

    /// Whether a poll is out that was sent less than `lost_after` ms ago.
    pub fn any_out(&self, now_ms: u64, lost_after: u64) -> bool {
        self.states
            .iter()
            .any(|f| f.in_flight.is_some() && now_ms.saturating_sub(f.polled_ms) < lost_after)
    }

    /// The units with a batch still being applied.
    pub fn waiting(&self) -> Vec<usize> {
        (0..self.states.len())
            .filter(|&i| self.states[i].pending.is_some())
            .collect()
    }

    /// Block hashes accepted and not yet applied, all units together.
    pub fn pending_blocks(&self) -> u64 {
        self.states
            .iter()
            .filter_map(|f| f.pending.as_ref())
            .map(FeedFrame::hashes_left)
            .sum()
    }

    /// A batch of `unit`'s was applied at `now_ms` (`more`: its log has more entries waiting, polled
    /// again at once); `false` for an unknown unit.
    pub fn ok(&mut self, unit: usize, now_ms: u64, more: bool) -> bool {
        let Some(f) = self.states.get_mut(unit) else {
            return false;
        };
        f.consecutive_failures = 0;
        f.last_ok_ms = Some(now_ms);
        if more {
            // More log entries wait: poll again at the next tick instead of a whole period later.
            f.next_poll_ms = now_ms;
        }
        true
    }

    /// An answer named another DP rank than the unit polled.
    pub fn rank_mismatch(&mut self) {
        self.rank_mismatches += 1;
    }

    pub fn rank_mismatches(&self) -> u64 {
        self.rank_mismatches
    }
}

impl std::ops::Index<usize> for FeedPollers {
    type Output = FeedState;
    fn index(&self, unit: usize) -> &FeedState {
        &self.states[unit]
    }
}

impl std::ops::IndexMut<usize> for FeedPollers {
    fn index_mut(&mut self, unit: usize) -> &mut FeedState {
        &mut self.states[unit]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pollers alone: a poll started is out until answered (or lost), an unknown token is
    /// nobody's, an applied batch clears the failures and with more to come is due at once.
    #[test]
    fn pollers_track_their_callouts() {
        let mut p = FeedPollers::new(2);
        assert_eq!((p.len(), p.is_empty()), (2, false));
        assert_eq!(p.started_ms(5), 5);
        assert_eq!(p.started_ms(9), 5, "set once");
        p.started(1, 42, 100, 200);
        p.started(7, 43, 100, 200);
        assert_eq!(
            (p[1].in_flight, p[1].polls, p[1].next_poll_ms),
            (Some(42), 1, 300)
        );
        assert!(
            p.any_out(150, 100) && !p.any_out(200, 100),
            "lost after 100 ms"
        );
        assert_eq!(p.answered(43), None, "no such unit: never out");
        assert_eq!(p.answered(42), Some(1));
        assert_eq!(p.answered(42), None);
        assert!(p[1].in_flight.is_none() && !p.any_out(150, 100));
        p[0].consecutive_failures = 3;
        assert!(p.ok(0, 400, true));
        assert_eq!((p[0].consecutive_failures, p[0].last_ok_ms), (0, Some(400)));
        assert_eq!(p[0].next_poll_ms, 400);
        assert!(!p.ok(2, 400, false));
        assert_eq!(p.cursor(2), 0);
        p.polled_in_turn(1);
        assert_eq!(p.cursor(2), 0, "wraps");
        p.polled_in_turn(0);
        assert_eq!(p.cursor(2), 1);
        assert!(p.waiting().is_empty() && p.pending_blocks() == 0);
        p.rank_mismatch();
        assert_eq!(p.rank_mismatches(), 1);
    }
}
