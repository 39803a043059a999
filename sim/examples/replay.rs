//! Virtual-time replay speed: coding-agent sessions from the Weka trace through 4 simulated replicas.
//!
//! `cargo run --release -p kvsteer-sim --example replay -- [--trace PATH] [--requests 2000]
//!  [--replicas 4] [--concurrency 16]`
//!
//! Each session's main requests are issued one after another (closed loop: the next request goes
//! out `think_time` after the previous one finished), `--concurrency` sessions at a time, sessions
//! assigned to replicas round robin (this measures the simulator, not routing). A trace block id (64
//! tokens, namespaced by session) becomes 64 deterministic token ids; prompts are padded to `in` with
//! request-unique tokens and capped so prompt plus output fit the 131,072-token context. Output lengths
//! are forced to the trace's `out` (`ignore_eos`). Prints the engine-side figures and the wall time.

use kvsteer_sim::output::mix64;
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest};
use serde_json::Value;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

/// A trace request; its prompt is built only when it is issued (the whole trace is ~190M tokens).
struct Req {
    session: u64,
    hash_ids: Vec<u64>,
    len: usize,
    uniq: u64,
    out: u32,
    think_us: u64,
}

impl Req {
    fn prompt(&self) -> Vec<u32> {
        let mut prompt = Vec::with_capacity(self.len + 64);
        for &id in &self.hash_ids {
            if prompt.len() >= self.len {
                break;
            }
            block_tokens(self.session, id, &mut prompt);
        }
        prompt.truncate(self.len);
        let mut k = 0u64;
        while prompt.len() < self.len {
            prompt.push((mix64(self.uniq << 20 ^ k) % 128_000) as u32);
            k += 1;
        }
        prompt
    }
}

fn block_tokens(session: u64, id: u64, out: &mut Vec<u32>) {
    let base = mix64(session.rotate_left(32) ^ id);
    for i in 0..64u64 {
        out.push((mix64(base ^ i) % 128_000) as u32);
    }
}

fn main() {
    let mut trace = "../shared/traces/weka_cc_sample36.jsonl".to_string();
    let mut limit = 2000usize;
    let mut replicas = 4usize;
    let mut concurrency = 16usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_default();
        match a.as_str() {
            "--trace" => trace = v,
            "--requests" => limit = v.parse().expect("--requests N"),
            "--replicas" => replicas = v.parse().expect("--replicas N"),
            "--concurrency" => concurrency = v.parse().expect("--concurrency N"),
            _ => panic!("unknown flag {a}"),
        }
    }
    let text = std::fs::read_to_string(&trace)
        .or_else(|_| std::fs::read_to_string(format!("../{trace}")))
        .unwrap_or_else(|e| panic!("read {trace}: {e}"));
    let max_len = EngineConfig::default().max_model_len as usize;
    let mut sessions: Vec<Vec<Req>> = Vec::new();
    let mut capped = 0usize;
    let mut total = 0usize;
    for (si, line) in text.lines().enumerate() {
        let v: Value = serde_json::from_str(line).expect("trace line is JSON");
        let mut reqs = Vec::new();
        for r in v["requests"].as_array().into_iter().flatten() {
            if total >= limit || r.get("requests").is_some() {
                continue;
            }
            let inp = r["in"].as_u64().unwrap_or(1).max(1) as usize;
            let out = r["out"].as_u64().unwrap_or(1).clamp(1, 32_768) as u32;
            let hash_ids: Vec<u64> = r["hash_ids"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|id| id.as_u64().unwrap_or(0))
                .collect();
            let cap = max_len - out as usize - 1;
            if inp > cap {
                capped += 1;
            }
            let think = r["think_time"].as_f64().unwrap_or(0.0).clamp(0.0, 600.0);
            reqs.push(Req {
                session: si as u64,
                hash_ids,
                len: inp.min(cap),
                uniq: total as u64,
                out,
                think_us: (think * 1e6) as u64,
            });
            total += 1;
        }
        if !reqs.is_empty() {
            sessions.push(reqs);
        }
    }
    let prompt_tokens: usize = sessions.iter().flatten().map(|r| r.len).sum();
    let out_tokens: u64 = sessions.iter().flatten().map(|r| r.out as u64).sum();

    let wall = Instant::now();
    let mut engines: Vec<Engine> = (0..replicas)
        .map(|i| {
            Engine::new(EngineConfig {
                seed: i as u64,
                ..Default::default()
            })
        })
        .collect();
    // (time, session, request index)
    let mut ready: BinaryHeap<Reverse<(u64, usize, usize)>> = BinaryHeap::new();
    let mut next_session = 0usize;
    while next_session < sessions.len().min(concurrency) {
        ready.push(Reverse((0, next_session, 0)));
        next_session += 1;
    }
    let mut owner: Vec<(usize, usize)> = Vec::new(); // request id -> (session, index)
    let mut events = Vec::new();
    let (mut done, mut cached, mut ttft_sum, mut end) = (0usize, 0u64, 0u64, 0u64);
    let mut arrival: Vec<u64> = Vec::new();
    loop {
        let next_arrival = ready.peek().map(|r| r.0.0);
        let next_step = engines
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.next_event_time().map(|t| (t, i)))
            .min();
        let arrival_first = match (next_arrival, next_step) {
            (None, None) => break,
            (Some(a), Some((s, _))) => a <= s,
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        let (t, ei) = if arrival_first {
            let Reverse((t, s, i)) = ready.pop().expect("peeked");
            let ei = s % replicas;
            let id = owner.len() as u64;
            owner.push((s, i));
            arrival.push(t);
            let r = &sessions[s][i];
            engines[ei].advance(t, &mut events);
            engines[ei]
                .submit(
                    t,
                    EngineRequest {
                        id,
                        prompt: r.prompt(),
                        max_tokens: r.out,
                        ignore_eos: true,
                        min_tokens: 0,
                    },
                )
                .expect("trace request fits");
            (t, ei)
        } else {
            let (t, ei) = next_step.expect("a step is due");
            engines[ei].advance(t, &mut events);
            (t, ei)
        };
        let _ = ei;
        for ev in events.drain(..) {
            match ev {
                EngineEvent::FirstToken {
                    id,
                    t_us,
                    cached_tokens,
                    ..
                } => {
                    cached += cached_tokens as u64;
                    ttft_sum += t_us - arrival[id as usize];
                }
                EngineEvent::Finished { id, t_us, .. } => {
                    done += 1;
                    end = end.max(t_us);
                    let (s, i) = owner[id as usize];
                    if i + 1 < sessions[s].len() {
                        let at = t_us + sessions[s][i + 1].think_us;
                        ready.push(Reverse((at, s, i + 1)));
                    } else if next_session < sessions.len() {
                        ready.push(Reverse((t.max(t_us), next_session, 0)));
                        next_session += 1;
                    }
                }
                EngineEvent::Token { .. } => {}
            }
        }
    }
    let secs = wall.elapsed().as_secs_f64();
    let pre: u64 = engines.iter().map(|e| e.stats().preemptions).sum();
    let steps: u64 = engines.iter().map(|e| e.stats().steps).sum();
    println!("| figure | value |");
    println!("|---|---|");
    println!("| sessions | {} |", sessions.len());
    println!("| requests completed | {done} of {total} ({capped} capped to the context limit) |");
    println!("| replicas, sessions in flight | {replicas}, {concurrency} |");
    println!("| prompt tokens | {prompt_tokens} |");
    println!("| output (decode) tokens | {out_tokens} |");
    println!("| engine steps | {steps} |");
    println!("| preemptions | {pre} |");
    println!(
        "| prefix-cache hit rate | {:.1}% |",
        100.0 * cached as f64 / prompt_tokens.max(1) as f64
    );
    println!(
        "| mean TTFT (virtual) | {:.3} s |",
        ttft_sum as f64 / done.max(1) as f64 / 1e6
    );
    println!("| virtual makespan | {:.1} s |", end as f64 / 1e6);
    println!("| wall time of the replay | {secs:.2} s |");
    println!(
        "| decode tokens per wall second | {:.0} |",
        out_tokens as f64 / secs
    );
}
