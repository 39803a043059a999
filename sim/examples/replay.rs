//! Virtual-time replay speed: coding-agent sessions from the Weka trace through 4 simulated replicas.
//!
//! `cargo run --release -p kvsteer-sim --example replay -- [--trace PATH] [--requests 2000]
//!  [--replicas 4] [--concurrency 16]`
//!
//! The trace is read by `kvsteer_workload::weka` (the reader every benchmark uses: 64-token blocks
//! namespaced by session, prompts over the context limit truncated here, sub-agents flattened) and
//! issued by `kvsteer_workload::Driver` in a closed loop, `--concurrency` sessions at a time, each
//! session's requests one after another with the trace's think times. Sessions are assigned to replicas
//! round robin: this measures the simulator, not routing. Output lengths are the trace's (`ignore_eos`).
//! Prints the engine-side figures and the wall time.

use clap::{CommandFactory, Parser};
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest};
use kvsteer_workload::weka::{self, OverLong, WekaParams};
use kvsteer_workload::{Driver, Issue, Mode, Workload};
use std::collections::HashMap;
use std::time::Instant;

/// Virtual-time replay speed: coding-agent sessions from the Weka trace through simulated replicas.
#[derive(clap::Parser)]
#[command(name = "replay", args_override_self = true)]
struct Args {
    /// The Weka coding-agent trace, JSON lines (decompressed first when the name ends in `.xz`).
    #[arg(long, value_name = "PATH", default_value = weka::DEFAULT_PATH)]
    trace: String,
    /// Requests replayed, the trace's first in session order.
    #[arg(long = "requests", value_name = "N", default_value_t = 2000, value_parser = positive)]
    limit: usize,
    /// Simulated replicas (engines); sessions are assigned to them round robin.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = positive)]
    replicas: usize,
    /// Sessions in flight at a time (closed loop).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = positive)]
    concurrency: usize,
}

/// A positive count.
fn positive(v: &str) -> Result<usize, String> {
    v.parse()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| "not a positive number".to_string())
}

/// The trace's first `limit` requests in session order.
fn load(a: &Args, engine_cfg: &EngineConfig) -> Workload {
    // Leave room for the longest output in the trace's first requests (the engine refuses a prompt plus
    // output above its context; such a request is counted as refused below).
    let max_prompt = engine_cfg.max_model_len.saturating_sub(32_768);
    let mut workload = weka::read(&WekaParams {
        path: a.trace.clone().into(),
        max_prompt_tokens: max_prompt,
        over_long: OverLong::Truncate,
        concurrency: a.concurrency,
        ..Default::default()
    })
    .unwrap_or_else(|e| {
        Args::command()
            .error(
                clap::error::ErrorKind::Io,
                format!("cannot read {}: {e}", a.trace),
            )
            .exit()
    });
    let mut left = a.limit;
    workload.sessions.retain_mut(|s| {
        s.turns.truncate(left);
        left -= s.turns.len();
        !s.turns.is_empty()
    });
    workload
}

/// What the replay counted.
#[derive(Default)]
struct Counts {
    prompt_tokens: u64,
    out_tokens: u64,
    done: usize,
    refused: usize,
    cached: u64,
    ttft_sum: u64,
    /// The last request's end (virtual us).
    end: u64,
}

fn main() {
    let a = Args::parse();
    let engine_cfg = EngineConfig::default();
    let workload = load(&a, &engine_cfg);
    let total = workload.total_requests();
    let sessions = workload.sessions.len();

    let wall = Instant::now();
    let mut engines: Vec<Engine> = (0..a.replicas)
        .map(|i| {
            Engine::new(EngineConfig {
                seed: i as u64,
                ..engine_cfg.clone()
            })
        })
        .collect();
    let mut driver = Driver::new(
        workload,
        Mode::Closed {
            concurrency: a.concurrency,
        },
    );
    let c = replay(&mut engines, &mut driver, a.replicas);
    let secs = wall.elapsed().as_secs_f64();
    let pre: u64 = engines.iter().map(|e| e.stats().preemptions).sum();
    let steps: u64 = engines.iter().map(|e| e.stats().steps).sum();
    println!("| figure | value |");
    println!("|---|---|");
    println!("| sessions | {sessions} |");
    println!(
        "| requests completed | {} of {total} ({} refused: prompt plus output over the context) |",
        c.done, c.refused
    );
    println!(
        "| replicas, sessions in flight | {}, {} |",
        a.replicas, a.concurrency
    );
    println!("| prompt tokens | {} |", c.prompt_tokens);
    println!("| output (decode) tokens | {} |", c.out_tokens);
    println!("| engine steps | {steps} |");
    println!("| preemptions | {pre} |");
    println!(
        "| prefix-cache hit rate | {:.1}% |",
        100.0 * c.cached as f64 / c.prompt_tokens.max(1) as f64
    );
    println!(
        "| mean TTFT (virtual) | {:.3} s |",
        c.ttft_sum as f64 / c.done.max(1) as f64 / 1e6
    );
    println!("| virtual makespan | {:.1} s |", c.end as f64 / 1e6);
    println!("| wall time of the replay | {secs:.2} s |");
    println!(
        "| decode tokens per wall second | {:.0} |",
        c.out_tokens as f64 / secs
    );
}

/// Runs the driver's requests on the engines until both are done: each session on replica
/// `session % replicas`.
fn replay(engines: &mut [Engine], driver: &mut Driver, replicas: usize) -> Counts {
    let mut c = Counts::default();
    let mut issued: Vec<Issue> = Vec::new();
    let mut arrival: HashMap<u64, u64> = HashMap::new();
    let mut events = Vec::new();
    loop {
        let next_issue = driver.next_wakeup();
        let next_step = engines.iter().filter_map(Engine::next_event_time).min();
        let now = match (next_issue, next_step) {
            (None, None) => break,
            (a, s) => a.unwrap_or(u64::MAX).min(s.unwrap_or(u64::MAX)),
        };
        for e in engines.iter_mut() {
            e.advance(now, &mut events);
        }
        driver.poll(now, &mut issued);
        for r in issued.drain(..) {
            let ei = r.session.session % replicas;
            let req = EngineRequest {
                id: r.request_id,
                prompt: r.prompt.to_vec(),
                max_tokens: r.output_tokens,
                ignore_eos: true,
                min_tokens: 0,
            };
            match engines[ei].submit(now, req) {
                Ok(()) => {
                    arrival.insert(r.request_id, now);
                    c.prompt_tokens += r.prompt.len() as u64;
                    c.out_tokens += u64::from(r.output_tokens);
                }
                Err(_) => {
                    c.refused += 1;
                    driver.fail(r.request_id, now).expect("just issued");
                }
            }
        }
        for ev in events.drain(..) {
            match ev {
                EngineEvent::FirstToken {
                    id,
                    t_us,
                    cached_tokens,
                    ..
                } => {
                    c.cached += u64::from(cached_tokens);
                    c.ttft_sum += t_us - arrival[&id];
                }
                EngineEvent::Finished { id, t_us, .. } => {
                    c.done += 1;
                    c.end = c.end.max(t_us);
                    driver.complete(id, t_us, &[]).expect("issued");
                }
                EngineEvent::Token { .. } => {}
            }
        }
    }
    c
}
