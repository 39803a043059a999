//! Prints what each workload is: sessions, requests, tokens, and the prompt hit rate an infinite prefix
//! cache would reach (an upper bound for every routing policy's hit rate).
//!
//! Usage (from the repository root): `cargo run --release -p kvsteer-workload --bin workload-stats --
//! [--traces DIR] [rl|rl-small|weka|mooncake|azure ...]` (default: all; DIR defaults to
//! `traces`).
//!
//! The infinite cache is replayed serially in workload order: every issued prompt's full blocks are
//! looked up (longest cached run of leading blocks counts as hit tokens), then the prompt and its output
//! are inserted. Outputs are deterministic stand-ins derived from the request id, as an engine's output
//! would be request-specific.

use clap::Parser;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kvsteer_workload::catalog;
use kvsteer_workload::token_blocks::{block_key, tokens};
use kvsteer_workload::{Driver, Mode, Workload};
use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Instant;
use xxhash_rust::xxh3::xxh3_64_with_seed;

struct Row {
    name: String,
    sessions: usize,
    requests: usize,
    prompt_tokens: u64,
    output_tokens: u64,
    hit_tokens: u64,
    build_s: f64,
    replay_s: f64,
    notes: String,
}

fn chain_hashes(tokens: &[u32], block: usize) -> Vec<u64> {
    let mut prev = 0u64;
    let mut buf = Vec::with_capacity(block * 4 + 8);
    tokens
        .chunks_exact(block)
        .map(|c| {
            buf.clear();
            buf.extend_from_slice(&prev.to_le_bytes());
            for t in c {
                buf.extend_from_slice(&t.to_le_bytes());
            }
            prev = xxh3_64_with_seed(&buf, 1337);
            prev
        })
        .collect()
}

/// The replay's bar of requests done, on stderr; hidden unless stderr is a terminal, so a run whose
/// output goes to a file or a log gets no `\r` redraws.
fn bar(label: &str, total: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
    if let Ok(style) =
        ProgressStyle::with_template("{prefix} [{bar:30}] {percent:>3}% {pos}/{len} {elapsed}")
    {
        bar.set_style(style.progress_chars("#."));
    }
    bar.set_prefix(label.to_string());
    bar
}

fn replay(w: Workload, build_s: f64) -> Row {
    let name = w.name.clone();
    let notes = w
        .notes
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(k, n)| format!("{k}: {n}"))
        .collect::<Vec<_>>()
        .join("; ");
    let block = w.block_size as usize;
    let sessions = w.sessions.len();
    let t0 = Instant::now();
    let mut d = Driver::new(w, Mode::Closed { concurrency: 1 });
    let (_, total) = d.progress();
    let bar = bar(&format!("{name:>9}"), total as u64);
    let mut cache: HashSet<u64> = HashSet::new();
    let (mut prompt_tokens, mut output_tokens, mut hit_tokens) = (0u64, 0u64, 0u64);
    let mut now = 0u64;
    let mut out = vec![];
    while !d.done() {
        now = now.max(d.next_wakeup().unwrap_or(now));
        out.clear();
        d.poll(now, &mut out);
        for i in out.drain(..) {
            let hashes = chain_hashes(&i.prompt, block);
            let hit = hashes.iter().take_while(|h| cache.contains(h)).count();
            hit_tokens += (hit * block) as u64;
            prompt_tokens += i.prompt.len() as u64;
            output_tokens += u64::from(i.output_tokens);
            let output = tokens(
                block_key("stats-output", i.request_id),
                i.output_tokens as usize,
            );
            let mut full = i.prompt.to_vec();
            full.extend_from_slice(&output);
            cache.extend(chain_hashes(&full, block));
            d.complete(i.request_id, now, &output)
                .expect("issued by this driver");
            bar.set_position(d.progress().0 as u64);
        }
    }
    bar.finish();
    Row {
        name,
        sessions,
        requests: total,
        prompt_tokens,
        output_tokens,
        hit_tokens,
        build_s,
        replay_s: t0.elapsed().as_secs_f64(),
        notes,
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "workload-stats",
    about = "What each workload is (sessions, requests, tokens) and the prompt hit rate an infinite \
             prefix cache would reach, as a markdown table.",
    args_override_self = true
)]
struct Cli {
    /// The traces' folder.
    #[arg(long, value_name = "DIR", default_value = catalog::DEFAULT_TRACES)]
    traces: PathBuf,
    /// Workloads to measure, of rl, rl-small, weka, mooncake, azure (default: rl weka mooncake
    /// azure).
    #[arg(value_name = "WORKLOAD")]
    names: Vec<String>,
}

fn main() {
    let cli = Cli::parse();
    let dir = cli.traces;
    let mut names = cli.names;
    if names.is_empty() {
        names = ["rl", "weka", "mooncake", "azure"]
            .map(String::from)
            .to_vec();
    }
    let mut rows = vec![];
    for n in &names {
        let t = Instant::now();
        match catalog::build(n, &dir) {
            Ok(w) => rows.push(replay(w, t.elapsed().as_secs_f64())),
            Err(e) => {
                eprintln!("{n}: {e}");
                std::process::exit(1);
            }
        }
    }
    println!(
        "| workload | sessions | requests | prompt tokens | mean prompt | output tokens | infinite-cache hit | build s | replay s | notes |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
    for r in rows {
        println!(
            "| {} | {} | {} | {} | {:.0} | {} | {:.1}% | {:.2} | {:.2} | {} |",
            r.name,
            r.sessions,
            r.requests,
            r.prompt_tokens,
            r.prompt_tokens as f64 / r.requests.max(1) as f64,
            r.output_tokens,
            100.0 * r.hit_tokens as f64 / r.prompt_tokens.max(1) as f64,
            r.build_s,
            r.replay_s,
            r.notes
        );
    }
}
