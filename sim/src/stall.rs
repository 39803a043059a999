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
}

impl Stalls {
    pub fn new(cfg: StallConfig, seed: u64) -> Stalls {
        let mut s = Stalls {
            cfg,
            seed: mix64(seed ^ 0x7374_616c_6c73 ^ cfg.seed.rotate_left(32)),
            draws: 0,
            window: None,
            held: false,
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
        assert_eq!(s.hold(start), Some((end, true)));
        assert_eq!(s.hold(end - 1), Some((end, false)));
        // At its end the stall is over and the next one starts later.
        assert_eq!(s.hold(end), None);
        let (next, _) = s.window.unwrap();
        assert!(next >= end);
    }
}
