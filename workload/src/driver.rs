//! A virtual-time request issuer driven by the consumer's event loop.
//!
//! The driver never sleeps and owns no clock: the consumer asks when something is next ready
//! ([`Driver::next_wakeup`]), advances its own (virtual or real) clock, collects what is ready
//! ([`Driver::poll`]) and reports completions ([`Driver::complete`], [`Driver::fail`]). Times are integer
//! microseconds from the run's start (0 unless [`Driver::starting_at`] says otherwise).
//!
//! - **Closed loop** (`Mode::Closed { concurrency }`): at most `concurrency` sessions are open at once.
//!   Sessions open in workload order as slots free up; a session holds its slot from its first turn's
//!   think time until its last turn completes. A turn is ready `think_us` after the previous turn
//!   completed (the first turn: after the session opened). Arrival times are ignored.
//! - **Open loop** (`Mode::Open`): every session opens at the start; a turn is ready at the later of its
//!   arrival time and (previous completion + think time). Nothing limits how many are in flight.
//!
//! A failed request ([`Driver::fail`]) is counted and its session **moves on** to its next turn as if the
//! failed turn had produced no output (an `Append` prompt then carries the failed turn's prompt only), so
//! one error never stalls a closed-loop slot or loses the rest of a session's requests.

use crate::session::{Prompt, Workload};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Arc;

/// How sessions are admitted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Mode {
    /// At most `concurrency` sessions open at once (a value of 0 is treated as 1).
    Closed { concurrency: usize },
    /// Turns issue at their arrival times.
    Open,
}

/// Which session and turn a request belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub struct SessionRef {
    /// Index of the session in the workload.
    pub session: usize,
    /// Index of the turn in the session.
    pub turn: usize,
}

/// A request ready to be sent.
#[derive(Clone, Debug)]
pub struct Issue {
    /// Unique in this driver, increasing in issue order.
    pub request_id: u64,
    pub session: SessionRef,
    /// The session id (send it as the session header).
    pub session_id: String,
    pub prompt: Arc<[u32]>,
    /// Tokens to generate (send with `ignore_eos`).
    pub output_tokens: u32,
    pub issued_us: u64,
    /// Block size the workload intends.
    pub block_size: u32,
}

/// Error for a completion the driver did not issue (or already saw).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownRequest(pub u64);

impl std::fmt::Display for UnknownRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "request {} is not in flight", self.0)
    }
}

impl std::error::Error for UnknownRequest {}

#[derive(Default)]
struct SessionState {
    next_turn: usize,
    /// Prompt of the previous turn followed by its output, kept only while a later turn appends to it.
    context: Vec<u32>,
    opened_us: u64,
}

struct InFlight {
    session: usize,
    turn: usize,
    prompt: Arc<[u32]>,
}

pub struct Driver {
    workload: Workload,
    mode: Mode,
    start_us: u64,
    states: Vec<SessionState>,
    /// (ready time, session index), earliest first; ties go to the lower session index.
    ready: BinaryHeap<Reverse<(u64, usize)>>,
    next_admit: usize,
    open_sessions: usize,
    in_flight: HashMap<u64, InFlight>,
    next_id: u64,
    completed: usize,
    failed: usize,
    total: usize,
    /// Most sessions ever open at once (closed-loop check).
    peak_open: usize,
}

impl Driver {
    pub fn new(workload: Workload, mode: Mode) -> Driver {
        Self::starting_at(workload, mode, 0)
    }

    /// A driver whose clock starts at `start_us` (for consumers whose clock does not start at 0).
    pub fn starting_at(workload: Workload, mode: Mode, start_us: u64) -> Driver {
        let mode = match mode {
            Mode::Closed { concurrency } => Mode::Closed {
                concurrency: concurrency.max(1),
            },
            m => m,
        };
        let total = workload.total_requests();
        let states = workload
            .sessions
            .iter()
            .map(|_| SessionState::default())
            .collect();
        let mut d = Driver {
            workload,
            mode,
            start_us,
            states,
            ready: BinaryHeap::new(),
            next_admit: 0,
            open_sessions: 0,
            in_flight: HashMap::new(),
            next_id: 0,
            completed: 0,
            failed: 0,
            total,
            peak_open: 0,
        };
        d.admit(start_us);
        d
    }

    pub fn workload(&self) -> &Workload {
        &self.workload
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// Opens sessions while the mode allows.
    fn admit(&mut self, now_us: u64) {
        let limit = match self.mode {
            Mode::Closed { concurrency } => concurrency,
            Mode::Open => usize::MAX,
        };
        while self.open_sessions < limit && self.next_admit < self.workload.sessions.len() {
            let s = self.next_admit;
            self.next_admit += 1;
            if self.workload.sessions[s].turns.is_empty() {
                continue;
            }
            self.open_sessions += 1;
            self.peak_open = self.peak_open.max(self.open_sessions);
            self.states[s].opened_us = now_us;
            self.schedule(s, now_us);
        }
    }

    /// Puts session `s`'s next turn on the ready queue, `base_us` being when its wait began.
    fn schedule(&mut self, s: usize, base_us: u64) {
        let turn = &self.workload.sessions[s].turns[self.states[s].next_turn];
        let mut at = base_us.saturating_add(turn.think_us);
        if let (Mode::Open, Some(arrival)) = (self.mode, turn.arrival_us) {
            at = at.max(self.start_us.saturating_add(arrival));
        }
        self.ready.push(Reverse((at, s)));
    }

    /// Earliest time something becomes ready, or `None` when nothing is waiting (all issued requests may
    /// still be in flight).
    pub fn next_wakeup(&self) -> Option<u64> {
        self.ready.peek().map(|Reverse((t, _))| *t)
    }

    /// Appends every request ready at `now_us` to `out`.
    pub fn poll(&mut self, now_us: u64, out: &mut Vec<Issue>) {
        while let Some(&Reverse((t, s))) = self.ready.peek() {
            if t > now_us {
                break;
            }
            self.ready.pop();
            out.push(self.issue(s, now_us));
        }
    }

    fn issue(&mut self, s: usize, now_us: u64) -> Issue {
        let session = &self.workload.sessions[s];
        let ti = self.states[s].next_turn;
        let turn = &session.turns[ti];
        let prompt: Arc<[u32]> = match &turn.prompt {
            Prompt::Append(new) => {
                let ctx = std::mem::take(&mut self.states[s].context);
                let mut p = ctx;
                p.extend_from_slice(new);
                p.into()
            }
            Prompt::Full(t) => t.as_slice().into(),
            Prompt::Blocks(b) => b.tokens().into(),
        };
        let id = self.next_id;
        self.next_id += 1;
        self.in_flight.insert(
            id,
            InFlight {
                session: s,
                turn: ti,
                prompt: prompt.clone(),
            },
        );
        Issue {
            request_id: id,
            session: SessionRef {
                session: s,
                turn: ti,
            },
            session_id: session.id.clone(),
            prompt,
            output_tokens: turn.output_tokens,
            issued_us: now_us,
            block_size: self.workload.block_size,
        }
    }

    /// Reports a finished request with the token ids it generated (used by `Append` prompts; pass what
    /// the engine returned, an empty slice if it returned none).
    pub fn complete(
        &mut self,
        request_id: u64,
        now_us: u64,
        output: &[u32],
    ) -> Result<(), UnknownRequest> {
        let f = self
            .in_flight
            .remove(&request_id)
            .ok_or(UnknownRequest(request_id))?;
        self.completed += 1;
        self.advance(f, now_us, output);
        Ok(())
    }

    /// Reports a failed request: counted, and its session moves on to its next turn.
    pub fn fail(&mut self, request_id: u64, now_us: u64) -> Result<(), UnknownRequest> {
        let f = self
            .in_flight
            .remove(&request_id)
            .ok_or(UnknownRequest(request_id))?;
        self.failed += 1;
        self.advance(f, now_us, &[]);
        Ok(())
    }

    fn advance(&mut self, f: InFlight, now_us: u64, output: &[u32]) {
        let s = f.session;
        let turns = &self.workload.sessions[s].turns;
        let next = f.turn + 1;
        self.states[s].next_turn = next;
        if next < turns.len() {
            if matches!(turns[next].prompt, Prompt::Append(_)) {
                let mut ctx = Vec::with_capacity(f.prompt.len() + output.len());
                ctx.extend_from_slice(&f.prompt);
                ctx.extend_from_slice(output);
                self.states[s].context = ctx;
            }
            self.schedule(s, now_us);
        } else {
            self.open_sessions -= 1;
            self.admit(now_us);
        }
    }

    /// True when every request has completed or failed.
    pub fn done(&self) -> bool {
        self.completed + self.failed == self.total
    }

    /// (requests completed or failed, total requests).
    pub fn progress(&self) -> (usize, usize) {
        (self.completed + self.failed, self.total)
    }

    pub fn failed(&self) -> usize {
        self.failed
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Sessions open now (closed loop: never above the concurrency).
    pub fn open_sessions(&self) -> usize {
        self.open_sessions
    }

    /// Most sessions ever open at once.
    pub fn peak_open_sessions(&self) -> usize {
        self.peak_open
    }

    /// When session `s` opened (its first turn's think time counts from here).
    pub fn session_opened_us(&self, s: usize) -> Option<u64> {
        self.states.get(s).map(|st| st.opened_us)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{Session, Turn};

    fn wl(sessions: Vec<Vec<(u64, Option<u64>)>>) -> Workload {
        Workload {
            name: "t".into(),
            params: vec![],
            block_size: 4,
            default_mode: Mode::Open,
            sessions: sessions
                .into_iter()
                .enumerate()
                .map(|(i, turns)| Session {
                    id: format!("s{i}"),
                    turns: turns
                        .into_iter()
                        .map(|(think_us, arrival_us)| Turn {
                            prompt: Prompt::Append(vec![i as u32 + 1]),
                            output_tokens: 2,
                            think_us,
                            arrival_us,
                        })
                        .collect(),
                })
                .collect(),
            notes: vec![],
        }
    }

    #[test]
    fn append_carries_prompt_and_output() {
        let mut d = Driver::new(
            wl(vec![vec![(0, None), (5, None)]]),
            Mode::Closed { concurrency: 1 },
        );
        let mut out = vec![];
        d.poll(0, &mut out);
        assert_eq!(&*out[0].prompt, &[1]);
        d.complete(out[0].request_id, 10, &[7, 8]).unwrap();
        out.clear();
        d.poll(14, &mut out);
        assert!(out.is_empty(), "think time not yet over");
        assert_eq!(d.next_wakeup(), Some(15));
        d.poll(15, &mut out);
        assert_eq!(&*out[0].prompt, &[1, 7, 8, 1]);
        assert!(d.complete(out[0].request_id, 20, &[]).is_ok());
        assert!(d.done());
        assert_eq!(
            d.complete(out[0].request_id, 20, &[]),
            Err(UnknownRequest(out[0].request_id))
        );
    }

    #[test]
    fn failure_moves_session_on() {
        let mut d = Driver::new(wl(vec![vec![(0, None), (0, None)]]), Mode::Open);
        let mut out = vec![];
        d.poll(0, &mut out);
        d.fail(out[0].request_id, 3).unwrap();
        out.clear();
        d.poll(3, &mut out);
        assert_eq!(&*out[0].prompt, &[1, 1]);
        d.complete(out[0].request_id, 4, &[]).unwrap();
        assert!(d.done());
        assert_eq!(d.failed(), 1);
        assert_eq!(d.progress(), (2, 2));
    }

    #[test]
    fn open_loop_waits_for_arrivals() {
        let mut d = Driver::new(
            wl(vec![vec![(0, Some(100))], vec![(0, Some(50))]]),
            Mode::Open,
        );
        assert_eq!(d.next_wakeup(), Some(50));
        let mut out = vec![];
        d.poll(60, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].session_id, "s1");
    }
}
