//! The bound on feed work per tick: an accepted batch is applied in slices, within a block budget
//! (`feed_apply_blocks_per_tick`) and a time budget (`feed_apply_us_per_tick`) per tick, so that a
//! replica's large snapshot cannot hold a worker's requests for long; what does not fit waits, pending,
//! for the next ticks.

use super::WorkerState;
use crate::config::FilterConfig;
use kvsteer_core::feed::FeedFrame;
use kvsteer_core::router::{FeedOutcome, Router};

/// Feed work (block hashes and events) applied between two reads of the clock, and the least a
/// batch with work left gets per tick whatever the time budget says. Applying 256 blocks takes tens
/// of microseconds; a clock read is one host call.
pub const FEED_MIN_SLICE: u64 = 256;

/// One tick's budgets: the feed work this worker may still do (blocks and time), and in nginx mode
/// the callouts it has planned.
#[derive(Clone, Debug)]
pub struct TickBudget {
    /// Feed work (block hashes and events) this worker may still do in this tick.
    blocks_left: u64,
    /// When this tick's budget was granted (`None`: never).
    from_ms: Option<u64>,
    /// Nanoseconds of feed work this worker may still spend in this tick
    /// (`feed_apply_us_per_tick`; `u64::MAX` without a time bound).
    time_left_ns: u64,
    /// The proxy's clock in nanoseconds, read between feed slices. Unit tests keep the default,
    /// which never moves (only the block budget then bounds a tick), or install their own.
    clock: fn() -> u64,
    /// Feed slices cut short by the time budget (the block budget had room left).
    time_cuts: u64,
    /// The hashes of the slice being applied, kept between slices.
    scratch: Vec<u64>,
    /// Callouts (feed and peer polls) planned in this tick, counted only where a tick's callouts are
    /// bounded ([`WorkerState::callouts_per_tick`]).
    callouts: usize,
}

impl Default for TickBudget {
    fn default() -> TickBudget {
        TickBudget {
            blocks_left: 0,
            from_ms: None,
            time_left_ns: 0,
            clock: || 0,
            time_cuts: 0,
            scratch: Vec::new(),
            callouts: 0,
        }
    }
}

impl TickBudget {
    /// A new tick: its callouts start at none and its feed budgets are granted.
    pub fn start(&mut self, cfg: &FilterConfig, now_ms: u64) {
        self.callouts = 0;
        self.grant(cfg, now_ms);
    }

    /// Grants a new tick's feed budget when a tick period has passed since the last grant.
    pub fn refill(&mut self, cfg: &FilterConfig, now_ms: u64) {
        let due = self
            .from_ms
            .is_none_or(|from| now_ms >= from.saturating_add(cfg.tick_ms));
        if due {
            self.grant(cfg, now_ms);
        }
    }

    fn grant(&mut self, cfg: &FilterConfig, now_ms: u64) {
        self.blocks_left = cfg.feed_apply_blocks_per_tick as u64;
        self.time_left_ns = match cfg.feed_apply_us_per_tick {
            0 => u64::MAX,
            us => u64::from(us) * 1000,
        };
        self.from_ms = Some(now_ms);
    }

    /// Feed work (blocks and events) left in this tick.
    pub fn blocks_left(&self) -> u64 {
        self.blocks_left
    }

    /// Callouts planned in this tick.
    pub fn callouts(&self) -> usize {
        self.callouts
    }

    /// `n` more callouts planned in this tick.
    pub fn plan_callouts(&mut self, n: usize) {
        self.callouts += n;
    }

    /// Applies up to `allowance` units (a block hash or an event each) of `frame`, a batch of
    /// `replica`'s, within what is left of the tick's block budget, in slices of at most
    /// [`FEED_MIN_SLICE`] with the clock read after each: it stops once the tick's time budget is
    /// spent, but only after `floor` units (the progress owed to this batch whatever the clock
    /// says).
    pub fn drain(
        &mut self,
        router: &mut Router,
        replica: usize,
        frame: &mut FeedFrame,
        allowance: u64,
        floor: u64,
    ) {
        let allow = allowance.min(self.blocks_left);
        if allow == 0 || (self.time_left_ns == 0 && floor == 0) {
            return;
        }
        let timed = self.time_left_ns != u64::MAX;
        let started = if timed { (self.clock)() } else { 0 };
        let mut spent = 0u64;
        let mut out = std::mem::take(&mut self.scratch);
        let mut used = 0u64;
        while used < allow {
            if timed && used >= floor && spent >= self.time_left_ns {
                self.time_cuts += 1;
                break;
            }
            let room = (allow - used).min(FEED_MIN_SLICE) as usize;
            let Some(slice) = frame.next_slice(room, &mut out) else {
                break;
            };
            router.apply_feed_slice(replica, slice, &out);
            used += (out.len() as u64).max(1);
            if timed {
                // The proxy's clock is wall time (Envoy) and may step back: never negative.
                spent = (self.clock)().saturating_sub(started);
            }
        }
        self.scratch = out;
        self.blocks_left = self.blocks_left.saturating_sub(used);
        if timed {
            self.time_left_ns = self.time_left_ns.saturating_sub(spent);
        }
    }
}

impl WorkerState {
    /// Installs the proxy's clock (nanoseconds; any epoch), read between feed slices to bound the
    /// time a tick spends applying feed batches (`feed_apply_us_per_tick`).
    pub fn set_clock(&mut self, clock: fn() -> u64) {
        self.budget.clock = clock;
    }

    /// Feed slices cut short by the time budget while the block budget had room left.
    pub fn feed_time_cuts(&self) -> u64 {
        self.budget.time_cuts
    }

    /// Starts a tick's feed budgets (`feed_apply_blocks_per_tick`, `feed_apply_us_per_tick`) and
    /// spends them on the batches still being applied: first an even split among them, each getting
    /// at least a first slice of [`FEED_MIN_SLICE`] whatever the clock says (so every batch
    /// completes, however slow the machine), then what is left in replica order.
    pub fn start_tick(&mut self, now_ms: u64) {
        self.budget.start(&self.cfg, now_ms);
        let waiting = self.feeds.waiting();
        if waiting.is_empty() {
            return;
        }
        let fair = (self.budget.blocks_left() / waiting.len() as u64).max(1);
        for &i in &waiting {
            self.drain(i, fair, FEED_MIN_SLICE);
        }
        for &i in &waiting {
            self.drain(i, u64::MAX, 0);
        }
    }

    /// Whether the index holds `key` for `replica` on the GPU tier (tests).
    #[cfg(test)]
    pub(super) fn index_holds(&self, replica: usize, key: u64) -> bool {
        self.router
            .index()
            .holds(replica, kvsteer_core::feed::Tier::Gpu, key)
    }

    /// Block hashes accepted and not yet applied, all replicas together.
    pub fn pending_blocks(&self) -> u64 {
        self.feeds.pending_blocks()
    }

    /// Accepts a checked batch (cursor, reset for a snapshot) and applies what this tick's budget
    /// allows; the rest stays pending. The outcome counts the batch's events.
    pub(super) fn accept_frame(
        &mut self,
        replica: usize,
        frame: FeedFrame,
        polled_ms: u64,
    ) -> FeedOutcome {
        let events = frame.events() as usize;
        // The adapters describe the replica now, like its load, whatever the log position.
        self.router.set_adapters(replica, frame.adapters());
        let outcome = match self
            .router
            .accept_feed_polled_at(replica, frame.header(), polled_ms)
        {
            FeedOutcome::Applied { .. } => FeedOutcome::Applied { events },
            FeedOutcome::Reset { epoch, .. } => FeedOutcome::Reset { events, epoch },
            other => return other,
        };
        if !frame.is_done() {
            self.feeds[replica].pending = Some(frame);
            // A small batch (the usual incremental answer) is applied at once even when another
            // replica's flood spent this tick's time.
            self.drain(replica, u64::MAX, FEED_MIN_SLICE);
            if self.feeds[replica].pending.is_some() {
                self.feeds[replica].deferred += 1;
            }
        }
        outcome
    }

    /// [`TickBudget::drain`] on a replica's pending batch, which stays pending until it is done.
    fn drain(&mut self, replica: usize, allowance: u64, floor: u64) {
        let Some(mut frame) = self.feeds.get_mut(replica).and_then(|f| f.pending.take()) else {
            return;
        };
        self.budget
            .drain(&mut self.router, replica, &mut frame, allowance, floor);
        if !frame.is_done() {
            self.feeds[replica].pending = Some(frame);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::testing::*;

    /// The budget alone: granted once a tick (again only a tick period later), with no time bound
    /// at 0 us; a batch drained within the blocks left and, past its floor, the time left.
    #[test]
    fn the_budget_is_granted_per_tick_and_spent_by_draining() {
        let mut w = worker_with(
            r#", "feed_apply_blocks_per_tick": 600, "feed_apply_us_per_tick": 0, "tick_ms": 100"#,
        );
        let cfg = w.config().clone();
        let mut b = TickBudget::default();
        assert_eq!(b.blocks_left(), 0);
        b.start(&cfg, 0);
        assert_eq!((b.blocks_left(), b.time_left_ns), (600, u64::MAX));
        b.plan_callouts(2);
        assert_eq!(b.callouts(), 2);
        let mut frame = FeedFrame::parse(snapshot(1, 0..1_000).encode()).unwrap();
        w.router.accept_feed_polled_at(0, frame.header(), 0);
        b.drain(&mut w.router, 0, &mut frame, 500, 0);
        // The cleared event and 499 hashes.
        assert_eq!((b.blocks_left(), w.stats().index_blocks), (100, 499));
        b.refill(&cfg, 99);
        assert_eq!(b.blocks_left(), 100, "not a tick yet");
        b.drain(&mut w.router, 0, &mut frame, u64::MAX, 0);
        assert_eq!((b.blocks_left(), w.stats().index_blocks), (0, 599));
        b.drain(&mut w.router, 0, &mut frame, u64::MAX, FEED_MIN_SLICE);
        assert_eq!(w.stats().index_blocks, 599, "nothing left to spend");
        b.refill(&cfg, 100);
        assert_eq!(b.blocks_left(), 600);
        b.drain(&mut w.router, 0, &mut frame, u64::MAX, 0);
        assert!(frame.is_done());
        assert_eq!((b.blocks_left(), w.stats().index_blocks), (199, 1_000));
        assert_eq!(b.time_cuts, 0);
        b.start(&cfg, 150);
        assert_eq!((b.callouts(), b.blocks_left()), (0, 600));
    }

    #[test]
    fn on_a_clock_that_runs_out_at_once_each_tick_still_applies_a_first_slice() {
        // Every read of this clock is 1 ms after the last: the 500 us budget is spent by the first
        // slice, so a tick applies exactly the first slice owed to each batch with work left.
        fn slow_clock() -> u64 {
            thread_local!(static T: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });
            T.with(|t| {
                t.set(t.get() + 1_000_000);
                t.get()
            })
        }
        let mut w = worker_with("");
        w.set_clock(slow_clock);
        w.start_tick(0);
        for p in w.plan_polls(None, 0) {
            w.poll_started(p.replica, 10 + p.replica as u32, 0);
        }
        let big = snapshot(1, 0..10_000).encode();
        w.on_feed_response(10, Some(200), Some(&big), None, 0);
        // The cleared event (one unit, short of the first slice's 256) and 256 hashes, not the
        // 8,192 of the block budget.
        assert_eq!(w.stats().index_blocks, 256);
        let mut ticks = 0;
        while w.pending_blocks() > 0 {
            let before = w.stats().index_blocks;
            ticks += 1;
            w.start_tick(ticks * 100);
            assert_eq!(
                w.stats().index_blocks - before,
                w.stats().index_blocks.min(before + 256) - before
            );
            assert!(ticks < 100, "the batch never completed");
        }
        assert_eq!(w.stats().index_blocks, 10_000);
        assert_eq!(ticks, 39, "(10,000 - 256) / 256 rounded up");
        assert!(w.feed_time_cuts() >= 39);
    }

    #[test]
    fn a_large_snapshot_is_applied_in_slices_across_ticks() {
        let mut w = worker_with(r#", "feed_apply_blocks_per_tick": 1000"#);
        w.start_tick(0);
        for p in w.plan_polls(None, 0) {
            w.poll_started(p.replica, 10 + p.replica as u32, 0);
        }
        // r0: 10,000 blocks. At most 1,000 units (hashes or events) per tick.
        let big = snapshot(1, 0..10_000).encode();
        let r = w.on_feed_response(10, Some(200), Some(&big), None, 0);
        assert!(
            matches!(
                r,
                FeedResult::Applied {
                    outcome: FeedOutcome::Reset { events: 2, .. },
                    ..
                }
            ),
            "{r:?}"
        );
        assert_eq!(
            w.stats().index_blocks,
            999,
            "the cleared event and 999 hashes"
        );
        assert_eq!(w.pending_blocks(), 9001);
        // r1's small batch arrives in the same tick: the budget is spent, it waits for the next.
        let small = snapshot(1, 50_000..50_010).encode();
        w.on_feed_response(11, Some(200), Some(&small), None, 10);
        assert_eq!(w.pending_blocks(), 9011);
        assert!(!w.index_holds(1, 50_000));
        // Neither is polled while its batch is pending; neither goes stale.
        let mut ticks = 0;
        let mut t = 0;
        while w.pending_blocks() > 0 {
            t += 100;
            let before = w.stats().index_blocks;
            w.start_tick(t);
            ticks += 1;
            assert!(w.stats().index_blocks - before <= 1000, "tick {ticks}");
            if ticks == 1 {
                assert!(w.index_holds(1, 50_009), "the even split serves r1 at once");
            }
            let polls = w.plan_polls(None, t);
            assert!(
                w.pending_blocks() == 0 || polls.iter().all(|p| p.replica != 0),
                "no poll of a replica still applying"
            );
            // r1 is not polled again here, so it may go quiet; r0 is busy, not quiet.
            w.check_staleness(t);
            assert!(w.pending_blocks() == 0 || !w.is_stale(0), "tick {ticks}");
            assert!(ticks < 20);
        }
        assert_eq!(ticks, 10);
        assert_eq!(w.stats().index_blocks, 10_010);
        assert!(w.index_holds(0, 9_999));
        assert_eq!(w.feed(0).unwrap().deferred, 1);
        assert!(
            w.plan_polls(None, t).iter().any(|p| p.replica == 0),
            "polled again once done"
        );
    }
}
