//! A whole run through the measurement and report path: a fake two-policy comparison on the small RL
//! workload, with a toy engine whose latency grows with the replica's load. Checks that the recorder and
//! report see what the loop did, not that one policy is better.

use kvsteer_workload::report::{decode_load_svg, hit_cv_scatter_svg, markdown_table, ttft_cdf_svg};
use kvsteer_workload::rl::{RlParams, generate};
use kvsteer_workload::{Driver, Mode, Recorder, Summary};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

const REPLICAS: usize = 3;

fn run(policy: &str) -> (Summary, Recorder) {
    let w = generate(&RlParams::small()).unwrap();
    let mut d = Driver::new(w, Mode::Closed { concurrency: 4 });
    let mut rec = Recorder::new();
    let mut events: BinaryHeap<Reverse<(u64, u8, u64)>> = BinaryHeap::new(); // (t, kind 0 first/1 done, id)
    let mut load = [0u64; REPLICAS];
    let mut where_: std::collections::HashMap<u64, (usize, u64, u64)> = Default::default();
    let mut now = 0u64;
    let mut next_sample = 0u64;
    let mut rr = 0usize;
    let mut buf = vec![];
    while !d.done() {
        buf.clear();
        d.poll(now, &mut buf);
        for i in buf.drain(..) {
            rec.issued_from(&i);
            let r = match policy {
                "round_robin" => {
                    rr += 1;
                    rr % REPLICAS
                }
                _ => (0..REPLICAS).min_by_key(|&r| load[r]).unwrap(),
            };
            rec.routed(i.request_id, r);
            let blocks = (i.prompt.len() as u64).div_ceil(16);
            load[r] += blocks;
            let ttft = 1_000 + 50 * load[r];
            events.push(Reverse((now + ttft, 0, i.request_id)));
            events.push(Reverse((
                now + ttft + 100 * u64::from(i.output_tokens),
                1,
                i.request_id,
            )));
            where_.insert(i.request_id, (r, blocks, i.prompt.len() as u64));
        }
        let next = [events.peek().map(|Reverse(e)| e.0), d.next_wakeup()]
            .into_iter()
            .flatten()
            .min()
            .unwrap();
        while next_sample <= next {
            rec.sample(next_sample, &load);
            next_sample += 250_000;
        }
        now = next;
        while let Some(&Reverse((t, kind, id))) = events.peek() {
            if t > now {
                break;
            }
            events.pop();
            if kind == 0 {
                rec.first_token(id, t);
            } else {
                let (r, blocks, len) = where_[&id];
                load[r] -= blocks;
                rec.finished(id, t, len / 2, 10);
                d.complete(id, t, &[1, 2, 3]).unwrap();
            }
        }
    }
    (rec.summary(policy), rec)
}

#[test]
fn summaries_tables_and_plots_reflect_the_run() {
    let (a, ra) = run("round_robin");
    let (b, rb) = run("least_load");
    let total = generate(&RlParams::small()).unwrap().total_requests();
    for s in [&a, &b] {
        assert_eq!(s.requests, total);
        assert_eq!(s.requests_per_replica.iter().sum::<u64>() as usize, total);
        assert_eq!(s.requests_per_replica.len(), REPLICAS);
        assert!(
            s.ttft_ms.p50 >= 1.0
                && s.ttft_ms.p50 <= s.ttft_ms.p90
                && s.ttft_ms.p90 <= s.ttft_ms.p99
        );
        assert!(s.hit_rate > 0.0 && s.hit_rate <= 0.5 + 1e-9);
        assert!(s.decode_cv.is_some());
        assert_eq!(s.session_e2e_s.count, 16);
        assert_eq!(s.output_tokens, 10 * total as u64);
    }
    // Round robin spreads requests evenly by count.
    let rr = &a.requests_per_replica;
    assert!(rr.iter().max().unwrap() - rr.iter().min().unwrap() <= 1);
    let table = markdown_table(&[a.clone(), b.clone()]);
    assert!(table.contains("| round_robin |") && table.contains("| least_load |"));
    let (ta, tb) = (ra.ttft_ms(), rb.ttft_ms());
    assert_eq!(ta.len(), total);
    let cdf = ttft_cdf_svg(&[("round_robin", &ta), ("least_load", &tb)]);
    assert_eq!(
        cdf.matches(r#"stroke-width="2""#).count(),
        2,
        "one line per policy"
    );
    let series = ra.decode_series();
    assert!(series.iter().all(|(_, v)| v.len() == REPLICAS));
    assert!(decode_load_svg("round_robin", &series).contains("replica 2"));
    let sc = hit_cv_scatter_svg(&[
        ("round_robin", a.hit_rate, a.decode_cv.unwrap()),
        ("least_load", b.hit_rate, b.decode_cv.unwrap()),
    ]);
    assert_eq!(sc.matches("<circle").count(), 2);
    let json = serde_json::to_string(&a).unwrap();
    assert!(json.contains("\"hit_rate\""));
}
