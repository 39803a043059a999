//! Callouts as the host dispatches and answers them: feed polls to the replicas (answered by their
//! engines, or by the fault a test set), and peer polls between proxies (the working-set exchange,
//! answered by the peer proxy's own filter). A callout is answered `callout_latency_us` after it was
//! dispatched, so the answer reflects the engine's cache at the time it arrives, as a real poll's
//! would.

use super::discovery::{DISCOVERY_CLUSTER, MEMBER_FEEDS_CLUSTER};
use super::{FeedFault, Harness, HarnessError, config::proxy_of_peer_cluster, flood_hash};
use crate::abi::Pairs;
use crate::host::{CallOutcome, Callout, HostMode, StreamState};
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FEED_PATH, FeedBatch, FeedQuery};
use kvsteer_sim::Engine;

/// A callout a worker dispatched and the harness has not answered yet.
pub(super) struct PendingCall {
    worker: usize,
    call: Callout,
    /// When the answer is due, in virtual time.
    pub(super) due_us: u64,
    /// The answer when it was settled at dispatch (a fault); `None`: asked of the upstream when due.
    outcome: Option<CallOutcome>,
}

impl Harness {
    /// Moves callouts the workers dispatched into the pending list, deciding each one's fate.
    pub(super) fn collect_callouts(&mut self) {
        for w in 0..self.workers.len() {
            for call in self.workers[w].take_callouts() {
                self.stats.callouts += 1;
                let (due_us, outcome) = if proxy_of_peer_cluster(&call.upstream).is_some() {
                    // Answered through the peer proxy when due ([`Harness::answer_peer`]).
                    (self.now_us + self.cfg.callout_latency_us, None)
                } else if call.upstream == DISCOVERY_CLUSTER {
                    let answer = self.discovery_outcome();
                    (self.now_us + self.cfg.callout_latency_us, Some(answer))
                } else {
                    self.feed_callout_fate(&call)
                };
                self.calls.push(PendingCall {
                    worker: w,
                    call,
                    due_us,
                    outcome,
                });
            }
        }
    }

    /// When a feed callout is answered, and its answer when the replica's [`FeedFault`] settles it
    /// already (an unknown upstream, a timeout); `None` leaves the answer to the engine at that time,
    /// so that it reflects the cache as it is then, not at dispatch.
    fn feed_callout_fate(&self, call: &Callout) -> (u64, Option<CallOutcome>) {
        let due = self.now_us + self.cfg.callout_latency_us;
        let timeout_us = call.timeout_ms as u64 * 1000;
        match self
            .replica_of_callout(call)
            .map(|r| &self.replicas[r].feed_fault)
        {
            None => (due, Some(no_such_upstream())),
            Some(FeedFault::Timeout) => (self.now_us + timeout_us, Some(CallOutcome::timeout())),
            Some(FeedFault::Slow { delay_us }) if *delay_us >= timeout_us => {
                (self.now_us + timeout_us, Some(CallOutcome::timeout()))
            }
            Some(FeedFault::Slow { delay_us }) => (self.now_us + delay_us, None),
            Some(_) => (due, None),
        }
    }

    /// The engine a feed callout asks: the endpoint's (its first rank's with DP ranks), or with a
    /// `rank` in the query that rank's when the endpoint has it (faults and poll records are per
    /// engine).
    fn replica_of_callout(&self, call: &Callout) -> Option<usize> {
        let first = match self.cfg.mode {
            HostMode::Envoy if call.upstream == MEMBER_FEEDS_CLUSTER => {
                self.member_feed_replica(call)
            }
            HostMode::Envoy => self
                .replicas
                .iter()
                .position(|r| r.feed_cluster == call.upstream),
            HostMode::Nginx => self.replica_of_endpoint(&call.upstream),
        }?;
        let units = &self.endpoints[self.replicas[first].endpoint_index].units;
        let query = call
            .header(":path")
            .and_then(|p| p.split_once('?'))
            .map_or("", |(_, q)| q);
        match kvsteer_core::feed::query_rank(query) {
            Ok(Some(r)) if (r as usize) < units.len() && units.len() > 1 => {
                Some(units.start + r as usize)
            }
            _ => Some(first),
        }
    }

    /// Answers a callout at the current virtual time: with the outcome settled at dispatch, through
    /// the peer proxy, or from the replica's engine.
    pub(super) fn answer(&mut self, p: PendingCall) -> Result<(), HarnessError> {
        let peer = match (&p.outcome, proxy_of_peer_cluster(&p.call.upstream)) {
            (None, Some(q)) => Some(self.answer_peer(q, &p.call)?),
            _ => None,
        };
        let outcome = match p.outcome.or(peer) {
            Some(o) => o,
            None => match self.replica_of_callout(&p.call) {
                None => no_such_upstream(),
                Some(r) => self.poll_replica(r, &p.call),
            },
        };
        if self.workers[p.worker].is_dead() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        self.workers[p.worker].answer_callout(&p.call, outcome)?;
        let ns = started.elapsed().as_nanos() as u64;
        self.stats.max_feed_call_ns = self.stats.max_feed_call_ns.max(ns);
        Ok(())
    }

    /// Replica `r`'s feed endpoint answering a poll now, as its [`FeedFault`] says (the poll is
    /// counted and kept for tests, whatever the answer).
    fn poll_replica(&mut self, r: usize, call: &Callout) -> CallOutcome {
        let rep = &mut self.replicas[r];
        rep.polls += 1;
        let h = |n: &str| call.header(n).unwrap_or("").to_string();
        rep.last_poll = Some((h(":method"), h(":path"), h(":authority")));
        match rep.feed_fault.clone() {
            FeedFault::Reset => CallOutcome::Reset,
            FeedFault::Timeout => CallOutcome::timeout(),
            FeedFault::Status(s) => CallOutcome::ok(s, "text/plain", b"feed unavailable".to_vec()),
            FeedFault::Garbage(bytes) => CallOutcome::ok(200, FEED_CONTENT_TYPE, bytes),
            FeedFault::Snapshot { blocks } => {
                let snap = FeedBatch::snapshot(
                    rep.engine.epoch(),
                    (0..blocks).map(|i| flood_hash(r, i)).collect(),
                );
                CallOutcome::ok(200, FEED_CONTENT_TYPE, snap.encode())
            }
            FeedFault::Healthy | FeedFault::Slow { .. } => {
                let e = rep.endpoint_index;
                let ep = &mut self.endpoints[e];
                if ep.units.len() <= 1 {
                    feed_answer(&mut rep.engine, call)
                } else {
                    let mut engines: Vec<&mut Engine> = self.replicas[ep.units.clone()]
                        .iter_mut()
                        .map(|r| &mut r.engine)
                        .collect();
                    dp_feed_answer(&mut engines, &mut ep.union, call)
                }
            }
        }
    }

    /// A peer poll to proxy `q`: the callout's request goes through one of `q`'s workers (round
    /// robin) and its filter's local response is the answer; a request the filter let through
    /// (it must not) is counted and answered 502, as an upstream with no such path would.
    fn answer_peer(&mut self, q: usize, call: &Callout) -> Result<CallOutcome, HarnessError> {
        if q >= self.proxies.len() {
            return Ok(CallOutcome::ok(
                503,
                "text/plain",
                b"no such proxy".to_vec(),
            ));
        }
        self.stats.peer_polls += 1;
        if let Some(fault) = self.peer_faults.get(q).cloned().flatten() {
            return Ok(fault);
        }
        let Some(st) = self.request_through(q, call.headers.clone())? else {
            return Ok(CallOutcome::Reset);
        };
        if st.released {
            self.stats.peer_polls_forwarded += 1;
            return Ok(CallOutcome::ok(502, "text/plain", b"forwarded".to_vec()));
        }
        Ok(match st.local_response {
            Some(r) => {
                self.stats.peer_answer_bytes += r.body.len() as u64;
                let ct = r
                    .headers
                    .iter()
                    .find(|(k, _)| k.eq_ignore_ascii_case(b"content-type"))
                    .map_or("application/octet-stream".into(), |(_, v)| {
                        String::from_utf8_lossy(v).into_owned()
                    });
                CallOutcome::ok(r.status as u16, &ct, r.body)
            }
            None => CallOutcome::ok(502, "text/plain", b"no answer".to_vec()),
        })
    }

    /// A bodiless request with `headers` through one of proxy `q`'s workers (round robin, apart from
    /// the driven requests'), ended at once: the stream's record (`released`: the filter let it go
    /// upstream; `local_response`: it answered itself). `None` when that worker is dead.
    pub fn request_through(
        &mut self,
        q: usize,
        headers: Pairs,
    ) -> Result<Option<StreamState>, HarnessError> {
        let n = self.cfg.workers;
        let w = q * n + self.rr_peer[q] % n;
        self.rr_peer[q] += 1;
        let worker = &mut self.workers[w];
        if worker.is_dead() {
            return Ok(None);
        }
        let stream = worker.new_stream()?;
        worker.request_headers(stream, headers, true)?;
        Ok(Some(worker.end_stream(stream)?))
    }

    /// Makes every peer poll to proxy `q` be answered with `fault` instead of through its filter
    /// (`None`: through the filter again): a hostile or broken peer.
    pub fn set_peer_fault(&mut self, q: usize, fault: Option<CallOutcome>) {
        if let Some(f) = self.peer_faults.get_mut(q) {
            *f = fault;
        }
    }

    /// Sums the filters' exchange counters over the proxies into [`HarnessStats`](super::HarnessStats).
    pub fn collect_peer_counters(&mut self) {
        let sum = |name: &str| -> u64 {
            self.proxies
                .iter()
                .filter_map(|p| p.metric(name))
                .map(|m| m.value.max(0) as u64)
                .sum()
        };
        self.stats.peer_entries_applied = sum("kvsteer_peer_entries_applied");
        self.stats.peer_answers_refused = sum("kvsteer_peer_answers_refused");
    }
}

/// The answer to a callout whose upstream no replica is.
fn no_such_upstream() -> CallOutcome {
    CallOutcome::ok(404, "text/plain", b"no such upstream".to_vec())
}

/// The feed's answer of an endpoint with DP ranks: with `rank=R` rank R's own feed, carrying its rank
/// (an unknown rank is a 400 naming it); without, the union of every rank's cache (rank-blind).
fn dp_feed_answer(
    engines: &mut [&mut Engine],
    union: &mut kvsteer_sim::dp::UnionFeed,
    call: &Callout,
) -> CallOutcome {
    let path = call.header(":path").unwrap_or("");
    let (p, query) = path.split_once('?').unwrap_or((path, ""));
    if !p.ends_with(FEED_PATH) {
        return CallOutcome::ok(404, "text/plain", format!("no route {p}").into_bytes());
    }
    let q = match FeedQuery::parse(query) {
        Ok(q) => q,
        Err(e) => return CallOutcome::ok(400, "text/plain", e.into_bytes()),
    };
    match kvsteer_core::feed::query_rank(query) {
        Err(e) => CallOutcome::ok(400, "text/plain", e.into_bytes()),
        Ok(Some(r)) => match engines.get_mut(r as usize) {
            Some(e) => CallOutcome::ok(200, FEED_CONTENT_TYPE, e.feed_answer(&q, query, Some(r))),
            None => CallOutcome::ok(
                400,
                "text/plain",
                format!("feed query: no DP rank {r} here ({} ranks)", engines.len()).into_bytes(),
            ),
        },
        Ok(None) => CallOutcome::ok(200, FEED_CONTENT_TYPE, union.answer(engines, &q).encode()),
    }
}

/// The feed's answer to a callout, as the simulator's HTTP server gives it.
fn feed_answer(engine: &mut Engine, call: &Callout) -> CallOutcome {
    let path = call.header(":path").unwrap_or("");
    let (p, query) = path.split_once('?').unwrap_or((path, ""));
    if !p.ends_with(FEED_PATH) {
        return CallOutcome::ok(404, "text/plain", format!("no route {p}").into_bytes());
    }
    match FeedQuery::parse(query) {
        Ok(q) => CallOutcome::ok(200, FEED_CONTENT_TYPE, engine.feed_answer(&q, query, None)),
        Err(e) => CallOutcome::ok(400, "text/plain", e.into_bytes()),
    }
}
