//! The event loop in virtual time: the clock only moves to the next thing due (an engine step, a
//! worker tick, a callout answer, a load sample, a driven request), so a run takes as long as the
//! filter's work, not as long as the traffic it replays, and repeats exactly.

use super::{Harness, HarnessError, RequestSpec};
use kvsteer_workload::Driver;

impl Harness {
    /// Moves the virtual clock forward to `t` (never back) and tells every proxy, whose filters read
    /// it through the host's clock.
    pub(super) fn set_now(&mut self, t: u64) {
        if t > self.now_us {
            self.now_us = t;
        }
        for p in &self.proxies {
            p.set_now_ns(self.now_us.saturating_mul(1000));
        }
    }

    /// The earliest time anything is due.
    fn next_event_us(&self) -> Option<u64> {
        let mut t: Option<u64> = None;
        let mut take = |v: u64| t = Some(t.map_or(v, |x| x.min(v)));
        for r in &self.replicas {
            if let Some(e) = r.engine.next_event_time() {
                take(e);
            }
        }
        for (i, w) in self.workers.iter().enumerate() {
            if w.tick_period_ms() > 0 {
                take(self.next_tick_us[i]);
            }
        }
        for c in &self.calls {
            take(c.due_us);
        }
        if let Some(d) = &self.driver
            && let Some(wake) = d.next_wakeup()
        {
            take(wake);
        }
        if self.driver.is_some() || !self.flights.is_empty() {
            take(self.next_sample_us);
        }
        t
    }

    /// Processes everything due up to `end_us`, then sets the clock to `end_us`.
    pub fn run_until(&mut self, end_us: u64) -> Result<(), HarnessError> {
        while let Some(t) = self.next_event_us().filter(|t| *t <= end_us) {
            self.set_now(t);
            self.process_due()?;
        }
        self.set_now(end_us);
        Ok(())
    }

    pub fn run_for(&mut self, us: u64) -> Result<(), HarnessError> {
        self.run_until(self.now_us.saturating_add(us))
    }

    /// Runs until no request sent through the filter is in flight (or `limit_us` of virtual time
    /// passed, which is an error naming the first request still open).
    pub fn run_until_idle(&mut self, limit_us: u64) -> Result<(), HarnessError> {
        let end = self.now_us.saturating_add(limit_us);
        while self.in_flight() > 0 {
            match self.next_event_us() {
                Some(t) if t <= end => {
                    self.set_now(t);
                    self.process_due()?;
                }
                _ => {
                    let id = self
                        .flights
                        .keys()
                        .copied()
                        .chain(self.paused.iter().map(|p| p.id))
                        .min()
                        .unwrap_or_default();
                    return Err(HarnessError::Stuck {
                        request: id,
                        detail: format!("still open after {limit_us} us of virtual time"),
                    });
                }
            }
        }
        Ok(())
    }

    /// Does everything due at the current time, always in this order (engine events, callout
    /// answers, worker ticks, the callouts those dispatched, paused requests, the load sample, the
    /// driver's new requests): another order would be as valid but would change every replay.
    fn process_due(&mut self) -> Result<(), HarnessError> {
        self.advance_engines()?;
        self.answer_due_callouts()?;
        self.tick_workers()?;
        self.collect_callouts();
        self.check_paused()?;
        self.sample_decode_load();
        self.issue_driven_requests()
    }

    /// Steps every engine with an event due now and streams what they produced.
    fn advance_engines(&mut self) -> Result<(), HarnessError> {
        let now = self.now_us;
        for r in 0..self.replicas.len() {
            if self.replicas[r]
                .engine
                .next_event_time()
                .is_some_and(|t| t <= now)
            {
                self.replicas[r].engine.advance(now, &mut self.events);
                self.drain_events()?;
            }
        }
        Ok(())
    }

    /// Answers the callouts due now, in dispatch order.
    fn answer_due_callouts(&mut self) -> Result<(), HarnessError> {
        let now = self.now_us;
        let mut due = Vec::new();
        let mut i = 0;
        while i < self.calls.len() {
            if self.calls[i].due_us <= now {
                due.push(self.calls.remove(i));
            } else {
                i += 1;
            }
        }
        for c in due {
            self.answer(c)?;
        }
        Ok(())
    }

    /// Calls `proxy_on_tick` on every worker whose period is up, timing each (the longest is the
    /// longest a worker thread was held for feed work).
    fn tick_workers(&mut self) -> Result<(), HarnessError> {
        let now = self.now_us;
        for w in 0..self.workers.len() {
            let period = self.workers[w].tick_period_ms() as u64 * 1000;
            if period > 0 && self.next_tick_us[w] <= now {
                let started = std::time::Instant::now();
                self.workers[w].tick()?;
                let ns = started.elapsed().as_nanos() as u64;
                self.stats.max_feed_call_ns = self.stats.max_feed_call_ns.max(ns);
                self.stats.ticks += 1;
                self.next_tick_us[w] = now + period;
            }
        }
        Ok(())
    }

    /// Records every engine's decode load when a sample is due.
    fn sample_decode_load(&mut self) {
        let now = self.now_us;
        if now >= self.next_sample_us {
            let blocks: Vec<u64> = self
                .replicas
                .iter()
                .map(|r| r.engine.decode_blocks())
                .collect();
            self.recorder.sample(now, &blocks);
            self.next_sample_us = now + self.cfg.sample_us.max(1);
        }
    }

    /// Sends the requests the workload's driver issues now through the filter.
    fn issue_driven_requests(&mut self) -> Result<(), HarnessError> {
        let mut issues = Vec::new();
        match self.driver.as_mut() {
            Some(d) => d.poll(self.now_us, &mut issues),
            None => return Ok(()),
        }
        for issue in issues {
            self.recorder.issued_from(&issue);
            let spec = RequestSpec {
                session: Some(issue.session_id.clone()),
                prompt: issue.prompt.to_vec(),
                max_tokens: issue.output_tokens,
                headers: self
                    .cfg
                    .issue_headers
                    .map(|f| f(&issue.session_id))
                    .unwrap_or_default(),
                model: self.cfg.issue_model.and_then(|f| f(&issue.session_id)),
                ..Default::default()
            };
            self.send_with_id(issue.request_id, &spec, true)?;
        }
        Ok(())
    }

    /// Replays a workload: the driver issues requests in virtual time, each goes through the filter to
    /// the replica it picks. `progress(done, total)` is called as requests finish.
    pub fn run_workload(
        &mut self,
        driver: Driver,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<(), HarnessError> {
        let total = driver.workload().total_requests() as u64;
        self.driver = Some(driver);
        let mut slowdowns = self.cfg.slowdowns.clone();
        slowdowns.sort_by_key(|s| std::cmp::Reverse(s.2));
        let mut membership = self.cfg.membership.clone();
        membership.sort_by_key(|m| std::cmp::Reverse(m.0));
        loop {
            self.apply_slowdowns(&mut slowdowns);
            self.apply_membership(&mut membership);
            let done = self.stats.requests - self.in_flight() as u64;
            progress(done, total);
            let driver_idle = self
                .driver
                .as_ref()
                .is_none_or(|d| d.next_wakeup().is_none());
            if driver_idle && self.in_flight() == 0 {
                break;
            }
            match self.next_event_us() {
                Some(t) => {
                    self.set_now(t);
                    self.process_due()?;
                }
                None => break,
            }
            if driver_idle && self.in_flight() > 0 && self.flights.is_empty() {
                let id = self.paused.first().map_or(0, |p| p.id);
                return Err(HarnessError::Stuck {
                    request: id,
                    detail: "paused by the filter with nothing left that could resume it".into(),
                });
            }
        }
        self.driver = None;
        Ok(())
    }

    /// Answers the member list whose time (`membership`, latest first) has come, and drops those
    /// from the list. The discovery polls are timer events, so a change is applied at the first
    /// event at or after its time, well within a poll period.
    fn apply_membership(&mut self, membership: &mut Vec<(u64, Vec<usize>)>) {
        while membership.last().is_some_and(|m| m.0 <= self.now_us()) {
            let (_, members) = membership.pop().unwrap_or_default();
            self.set_members(&members);
        }
    }

    /// Slows the engines whose slowdown (`slowdowns`, latest first) starts by now, and drops those
    /// from the list.
    fn apply_slowdowns(&mut self, slowdowns: &mut Vec<(usize, f64, u64)>) {
        while slowdowns.last().is_some_and(|s| s.2 <= self.now_us()) {
            let (r, factor, _) = slowdowns.pop().unwrap_or_default();
            if let Some(rep) = self.replicas.get_mut(r) {
                rep.engine.set_slowdown(factor);
            }
        }
    }
}
