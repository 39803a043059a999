//! `model-eval`: replays the training and validation cells of docs/reports/model-eval.md for every policy
//! over paired draws, through the compiled filter, and writes every replay's figures as JSON lines
//! (one per replay, appended as they finish, so a long run can be read while it goes and resumed).
//!
//! Usage: model-eval [--set training|validation|all] [--quick] [--seeds N] [--jobs N]
//!                   [--only id,id] [--policies spec,spec] [--out FILE]
//! `scripts/model-eval` runs it and `scripts/report-goals` reads what it wrote.

use kvsteer_host_test::bench::model_eval::{self, Cell, POLICIES, Set};
use kvsteer_host_test::{FilterModule, filter_wasm_path};
use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

struct Args {
    set: String,
    quick: bool,
    seeds: u64,
    jobs: usize,
    only: Option<Vec<String>>,
    policies: Vec<String>,
    out: PathBuf,
    traces: PathBuf,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        set: "all".into(),
        quick: false,
        seeds: 9,
        jobs: 2,
        only: None,
        policies: POLICIES.iter().map(|s| s.to_string()).collect(),
        out: PathBuf::from("out/model-eval/runs.jsonl"),
        traces: PathBuf::from("traces"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--set" => a.set = val()?,
            "--quick" => a.quick = true,
            "--seeds" => a.seeds = val()?.parse().map_err(|e| format!("--seeds: {e}"))?,
            "--jobs" => a.jobs = val()?.parse().map_err(|e| format!("--jobs: {e}"))?,
            "--only" => a.only = Some(val()?.split(',').map(String::from).collect()),
            "--policies" => a.policies = val()?.split(',').map(String::from).collect(),
            "--out" => a.out = PathBuf::from(val()?),
            "--traces" => a.traces = PathBuf::from(val()?),
            other => return Err(format!("unknown flag {other:?}")),
        }
    }
    Ok(a)
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("model-eval: {e}");
            std::process::exit(2);
        }
    };
    let module = filter_wasm_path()
        .and_then(|p| FilterModule::load_unmetered(&p).map_err(|e| e.to_string()))
        .unwrap_or_else(|e| {
            eprintln!("model-eval: {e}");
            std::process::exit(1);
        });
    let mut cells: Vec<Cell> = Vec::new();
    if args.set == "training" || args.set == "all" {
        cells.extend(model_eval::training(args.quick));
    }
    if args.set == "validation" || args.set == "all" {
        cells.extend(model_eval::validation());
    }
    if let Some(only) = &args.only {
        cells.retain(|c| only.contains(&c.id));
    }
    // Replays already in the output (a resumed run) are not redone.
    let done: HashSet<(String, String, u64)> = std::fs::read_to_string(&args.out)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            Some((
                v["cell"].as_str()?.to_string(),
                v["policy"].as_str()?.to_string(),
                v["seed"].as_u64()?,
            ))
        })
        .collect();
    let mut work: Vec<(usize, String, u64)> = Vec::new();
    for seed in 0..args.seeds {
        for (i, c) in cells.iter().enumerate() {
            for p in &args.policies {
                if !done.contains(&(c.id.clone(), p.clone(), seed)) {
                    work.push((i, p.clone(), seed));
                }
            }
        }
    }
    if let Some(dir) = args.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let out = Mutex::new(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&args.out)
            .unwrap_or_else(|e| {
                eprintln!("model-eval: {}: {e}", args.out.display());
                std::process::exit(1);
            }),
    );
    let total = work.len();
    eprintln!(
        "model-eval: {} cells, {} policies, {} seeds: {total} replays to run",
        cells.len(),
        args.policies.len(),
        args.seeds
    );
    let next = AtomicUsize::new(0);
    let failed = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..args.jobs.max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((ci, policy, seed)) = work.get(i) else {
                        break;
                    };
                    let c = &cells[*ci];
                    let started = std::time::Instant::now();
                    match model_eval::replay(&module, &args.traces, c, policy, *seed) {
                        Ok(m) => {
                            let mut v = serde_json::to_value(&m).unwrap_or_default();
                            v["set"] = serde_json::json!(match c.set {
                                Set::Training => "training",
                                Set::Validation => "validation",
                            });
                            let line = format!("{v}\n");
                            if let Ok(mut f) = out.lock() {
                                let _ = f.write_all(line.as_bytes());
                            }
                            eprintln!(
                                "[{}/{total}] {} {policy} seed {seed}: ttft p50 {:.0} p99 {:.0} ms, per replica {:?} ({:.1} s)",
                                i + 1,
                                c.id,
                                m.ttft_p50_ms,
                                m.ttft_p99_ms,
                                m.requests_per_replica,
                                started.elapsed().as_secs_f64()
                            );
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            eprintln!("[{}/{total}] {e}", i + 1);
                        }
                    }
                }
            });
        }
    });
    let failed = failed.into_inner();
    if failed > 0 {
        eprintln!("model-eval: {failed} replays failed");
        std::process::exit(1);
    }
}
