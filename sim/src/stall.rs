//! Random engine stalls (off by default): moments when a replica runs no step at all, as a real
//! engine does during a host hiccup, a garbage-collection pause in its API server or scheduler, or
//! a slow collective on one of its GPUs. The requests it holds and those that arrive wait; nothing
//! is lost. A router that learns replicas' speeds from their first tokens sees such a replica as
//! slow for a moment, which is what a stall is for: noise in the timings a router learns from.
//!
//! The schedule is a renewal process on the engine's own clock: from the end of one stall to the
//! start of the next is exponentially distributed with mean [`StallConfig::mean_gap_us`], and each
//! stall lasts [`StallConfig::len_us`]. The draws are a hash of the engine's seed and the draw's
//! number, so a run is reproducible for a seed and replicas (which derive their own seeds) stall at
//! different moments; [`StallConfig::seed`] draws another schedule for the same engines. A stall
//! that begins while the engine has nothing to do, or while a step runs and ends before that step
//! does, delays nothing and is not counted.

use crate::output::{mix64, unit};
use std::collections::VecDeque;

/// How many held stalls [`Stalls::held`] remembers (the oldest go first): a bench reading them at
/// a run's end needs a run's worth, and the memory stays a few tens of kilobytes at most.
pub const HELD_LOG_LEN: usize = 4096;

/// When stalls happen and how long they last, in engine (virtual) microseconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StallConfig {
    /// Mean time from the end of one stall to the start of the next (exponentially distributed);
    /// 0: no stalls (the default).
    pub mean_gap_us: u64,
    /// How long each stall lasts (default 1 s).
    pub len_us: u64,
    /// Mixed into the engine's seed for the draws (default 0): another value draws other stall
    /// times for an engine that is otherwise the same.
    pub seed: u64,
}

impl Default for StallConfig {
    fn default() -> Self {
        StallConfig {
            mean_gap_us: 0,
            len_us: 1_000_000,
            seed: 0,
        }
    }
}

impl StallConfig {
    pub fn enabled(&self) -> bool {
        self.mean_gap_us > 0 && self.len_us > 0
    }
}

/// An engine's stall schedule: the current or next stall, drawn lazily as the clock moves.
#[derive(Clone, Debug)]
pub struct Stalls {
    cfg: StallConfig,
    seed: u64,
    draws: u64,
    /// `[start, end)` of the current or next stall; `None` when stalls are off.
    window: Option<(u64, u64)>,
    /// Whether the current window has already held up a step (counted once).
    held: bool,
    /// `[from, end)` of each stall that held up a step, `from` being when the held step would have
    /// started: the engine time the stall took from that engine's requests.
    log: VecDeque<(u64, u64)>,
}

impl Stalls {
    pub fn new(cfg: StallConfig, seed: u64) -> Stalls {
        let mut s = Stalls {
            cfg,
            seed: mix64(seed ^ 0x7374_616c_6c73 ^ cfg.seed.rotate_left(32)),
            draws: 0,
            window: None,
            held: false,
            log: VecDeque::new(),
        };
        if cfg.enabled() {
            s.window = Some(s.after(0));
        }
        s
    }

    /// The stall window that starts an exponential gap after `t_us`.
    fn after(&mut self, t_us: u64) -> (u64, u64) {
        let u = unit(mix64(self.seed ^ self.draws.rotate_left(17)));
        self.draws += 1;
        let gap = (-u.ln() * self.cfg.mean_gap_us as f64).round() as u64;
        let start = t_us.saturating_add(gap);
        (start, start.saturating_add(self.cfg.len_us))
    }

    /// `[start, end)` of the current or next stall in engine microseconds; `None` when off.
    pub fn window(&self) -> Option<(u64, u64)> {
        self.window
    }

    /// The stalls that held up a step, oldest first (the last [`HELD_LOG_LEN`]): `[from, end)` in
    /// engine microseconds, `from` being when the held step would have started. A bench uses them
    /// to tell the time a request spent waiting out a stall from the time routing cost it.
    pub fn held(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.log.iter().copied()
    }

    /// A step about to start at `t_us` that falls inside a stall may start only at the stall's
    /// end: returns that end, and whether this is the first step the stall holds up. `None`: no
    /// stall at `t_us`. Stalls that ended by `t_us` are passed over (`t_us` never goes back).
    pub fn hold(&mut self, t_us: u64) -> Option<(u64, bool)> {
        loop {
            let (start, end) = self.window?;
            if end <= t_us {
                self.window = Some(self.after(end));
                self.held = false;
                continue;
            }
            if t_us < start {
                return None;
            }
            let first = !self.held;
            self.held = true;
            if first {
                if self.log.len() == HELD_LOG_LEN {
                    self.log.pop_front();
                }
                self.log.push_back((t_us, end));
            }
            return Some((end, first));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(gap_ms: u64, len_ms: u64) -> StallConfig {
        StallConfig {
            mean_gap_us: gap_ms * 1000,
            len_us: len_ms * 1000,
            seed: 0,
        }
    }

    /// The windows an engine busy every millisecond for `span_s` seconds meets.
    fn windows(mut s: Stalls, span_s: u64) -> Vec<u64> {
        let mut ends = Vec::new();
        for t in (0..span_s * 1_000_000).step_by(1000) {
            if let Some((end, true)) = s.hold(t) {
                ends.push(end);
            }
        }
        ends
    }

    #[test]
    fn off_holds_nothing() {
        let mut s = Stalls::new(StallConfig::default(), 1);
        assert!(!StallConfig::default().enabled());
        assert!((0..10_000_000).step_by(997).all(|t| s.hold(t).is_none()));
        assert!(windows(Stalls::new(cfg(0, 1000), 1), 10).is_empty());
        assert!(windows(Stalls::new(cfg(1000, 0), 1), 10).is_empty());
    }

    #[test]
    fn stalls_are_reproducible_per_seed_and_differ_across_seeds() {
        let a = windows(Stalls::new(cfg(2000, 100), 7), 200);
        assert_eq!(a, windows(Stalls::new(cfg(2000, 100), 7), 200));
        assert_ne!(a, windows(Stalls::new(cfg(2000, 100), 8), 200));
        let reseeded = StallConfig {
            seed: 1,
            ..cfg(2000, 100)
        };
        assert_ne!(a, windows(Stalls::new(reseeded, 7), 200));
        // About 200 s / (2 s + 0.1 s) of them; well inside 4 standard deviations (~9).
        assert!((60..=130).contains(&a.len()), "{}", a.len());
        assert!(a.windows(2).all(|w| w[1] >= w[0] + 100_000), "{a:?}");
    }

    #[test]
    fn a_step_inside_a_stall_waits_for_its_end_and_is_counted_once() {
        let mut s = Stalls::new(cfg(1000, 500), 3);
        let (start, end) = s.window.expect("on");
        assert_eq!(end - start, 500_000);
        if start > 0 {
            assert_eq!(s.hold(start - 1), None);
        }
        assert_eq!(s.hold(start + 7), Some((end, true)));
        assert_eq!(s.hold(end - 1), Some((end, false)));
        // Logged once, from when the held step would have started.
        assert_eq!(s.held().collect::<Vec<_>>(), vec![(start + 7, end)]);
        // At its end the stall is over and the next one starts later.
        assert_eq!(s.hold(end), None);
        let (next, _) = s.window.unwrap();
        assert!(next >= end);
    }

    #[test]
    fn the_log_keeps_the_latest_held_stalls() {
        let mut s = Stalls::new(cfg(1, 1), 5);
        let mut t = 0;
        let mut held = Vec::new();
        while held.len() < HELD_LOG_LEN + 10 {
            if let Some((end, true)) = s.hold(t) {
                held.push((t, end));
            }
            t += 500;
        }
        let log: Vec<_> = s.held().collect();
        assert_eq!(log.len(), HELD_LOG_LEN);
        assert_eq!(log, held[10..]);
    }
}
