//! The driver under a fake engine: closed-loop concurrency and think times.

use kvsteer_workload::rl::{RlParams, generate};
use kvsteer_workload::{Driver, Issue, Mode, Recorder, Workload};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Runs a workload against an engine whose service time is `1 ms + 1 us per prompt token + 10 us per
/// output token`, checking invariants at every event. Returns the issues and their completion times.
fn run(w: Workload, mode: Mode, max_open: usize) -> (Vec<Issue>, HashMap<u64, u64>, Recorder) {
    let mut d = Driver::new(w, mode);
    let mut pending: BinaryHeap<Reverse<(u64, u64)>> = BinaryHeap::new();
    let mut issued = vec![];
    let mut done_at = HashMap::new();
    let mut rec = Recorder::new();
    let mut now = 0u64;
    let mut buf = vec![];
    let mut steps = 0;
    while !d.done() {
        steps += 1;
        assert!(steps < 1_000_000, "driver does not make progress");
        buf.clear();
        d.poll(now, &mut buf);
        for i in buf.drain(..) {
            assert!(d.open_sessions() <= max_open);
            rec.issued_from(&i);
            rec.routed(i.request_id, (i.request_id % 3) as usize);
            let svc = 1_000 + i.prompt.len() as u64 + 10 * u64::from(i.output_tokens);
            pending.push(Reverse((now + svc, i.request_id)));
            issued.push(i);
        }
        let next_done = pending.peek().map(|Reverse((t, _))| *t);
        let next = match (next_done, d.next_wakeup()) {
            (Some(a), Some(b)) => a.min(b),
            (Some(a), None) => a,
            (None, Some(b)) => b,
            (None, None) => panic!("not done, but nothing in flight or waiting"),
        };
        now = now.max(next);
        while let Some(&Reverse((t, id))) = pending.peek() {
            if t > now {
                break;
            }
            pending.pop();
            let out = issued
                .iter()
                .find(|i| i.request_id == id)
                .unwrap()
                .output_tokens;
            rec.first_token(id, t - 10 * u64::from(out));
            rec.finished(id, t, 0, u64::from(out));
            d.complete(id, t, &vec![5; out as usize]).unwrap();
            done_at.insert(id, t);
            assert!(d.open_sessions() <= max_open);
        }
    }
    assert_eq!(d.progress(), (issued.len(), issued.len()));
    (issued, done_at, rec)
}

#[test]
fn closed_loop_never_exceeds_concurrency_and_respects_think_time() {
    let think = 777;
    let w = generate(&RlParams {
        think_us: think,
        ..RlParams::small()
    })
    .unwrap();
    let total = w.total_requests();
    let n = 4;
    let mut d_peak = 0;
    let (issued, done_at, rec) = run(w.clone(), Mode::Closed { concurrency: n }, n);
    assert_eq!(issued.len(), total);
    // Each turn after the first issues exactly think_us after its predecessor completed.
    let mut last: HashMap<usize, u64> = HashMap::new();
    for i in &issued {
        if i.session.turn > 0 {
            let prev = last[&i.session.session];
            assert_eq!(i.issued_us, done_at[&prev] + think, "{:?}", i.session);
        }
        last.insert(i.session.session, i.request_id);
    }
    // Count sessions open at each issue instant, from the issue log alone.
    let mut spans: Vec<(u64, u64)> = vec![];
    for s in 0..w.sessions.len() {
        let ids: Vec<&Issue> = issued.iter().filter(|i| i.session.session == s).collect();
        let start = ids.iter().map(|i| i.issued_us).min().unwrap();
        let end = ids.iter().map(|i| done_at[&i.request_id]).max().unwrap();
        spans.push((start, end));
    }
    for &(t, _) in &spans {
        let sessions_in_flight = spans.iter().filter(|(a, b)| *a <= t && t < *b).count();
        d_peak = d_peak.max(sessions_in_flight);
    }
    assert!(d_peak <= n, "peak {d_peak}");
    assert_eq!(d_peak, n, "the loop keeps {n} sessions busy");
    let s = rec.summary("fake");
    assert_eq!(s.requests, total);
    assert_eq!(s.session_e2e_s.count, w.sessions.len());
    assert_eq!(s.requests_per_replica.iter().sum::<u64>() as usize, total);
}

#[test]
fn sessions_run_their_turns_in_order() {
    let w = generate(&RlParams::small()).unwrap();
    let (issued, done_at, _) = run(w, Mode::Closed { concurrency: 3 }, 3);
    let mut next: HashMap<usize, usize> = HashMap::new();
    for i in &issued {
        let e = next.entry(i.session.session).or_default();
        assert_eq!(i.session.turn, *e);
        *e += 1;
    }
    assert_eq!(done_at.len(), issued.len());
}

#[test]
fn open_loop_issues_at_arrivals() {
    let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.0,40,4\n2023-11-16 18:15:46.5,40,3\n2023-11-16 18:15:49.0,10,2\n";
    let w = kvsteer_workload::azure::parse(text, &Default::default()).unwrap();
    let (issued, _, _) = run(w, Mode::Open, usize::MAX);
    let at: Vec<u64> = issued.iter().map(|i| i.issued_us).collect();
    assert_eq!(at, vec![0, 500_000, 3_000_000]);
}

/// Completions and failures in a scrambled order, with bogus ids mixed in: the driver never panics, never
/// loses a request, and never exceeds the concurrency.
#[test]
fn scrambled_completions_and_failures() {
    let w = generate(&RlParams::small()).unwrap();
    let total = w.total_requests();
    let mut d = Driver::new(w, Mode::Closed { concurrency: 5 });
    let mut in_flight: Vec<u64> = vec![];
    let mut state = 12345u64;
    let mut rnd = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut now = 0;
    let mut buf = vec![];
    let mut seen = 0;
    let mut failed = 0;
    for _ in 0..100_000 {
        if d.done() {
            break;
        }
        if let Some(t) = d.next_wakeup() {
            now = now.max(t);
        }
        buf.clear();
        d.poll(now, &mut buf);
        seen += buf.len();
        in_flight.extend(buf.iter().map(|i| i.request_id));
        assert!(d.open_sessions() <= 5);
        assert!(d.complete(u64::MAX - rnd() % 10, now, &[]).is_err());
        if !in_flight.is_empty() {
            let k = (rnd() % in_flight.len() as u64) as usize;
            let id = in_flight.swap_remove(k);
            now += rnd() % 1000;
            if rnd() % 4 == 0 {
                d.fail(id, now).unwrap();
                failed += 1;
            } else {
                d.complete(id, now, &[7; 3]).unwrap();
            }
            assert!(d.fail(id, now).is_err(), "a request ends once");
        }
    }
    assert!(d.done());
    assert_eq!(seen, total);
    assert_eq!(d.failed(), failed);
    assert_eq!(d.progress(), (total, total));
}
