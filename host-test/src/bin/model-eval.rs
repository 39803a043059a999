//! `model-eval`: replays the training and validation cells of docs/reports/model-eval.md for every
//! policy over paired draws, through the compiled filter, and writes every replay's figures as JSON
//! lines (one per replay, appended as they finish, so a long run can be read while it goes and
//! resumed). `model-eval --help` lists the flags; `scripts/model-eval` runs it and
//! `scripts/model-report` reads what it wrote.

use clap::Parser;
use kvsteer_host_test::bench::args::split_list;
use kvsteer_host_test::bench::model_eval::{self, Cell, POLICIES, Set};
use kvsteer_host_test::{FilterModule, filter_wasm_path};
use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `model-eval`'s flags.
#[derive(Parser, Debug)]
#[command(
    name = "model-eval",
    about = "Replays the routing model's training and validation cells (docs/reports/model-eval.md) \
             through kvsteer_filter.wasm and appends every replay's figures as JSON lines."
)]
struct Args {
    /// Which cells: training, validation (the first round), validation2 (the second) or all.
    #[arg(long, default_value = "all", value_parser = ["training", "validation", "validation2", "all"])]
    set: String,
    /// The training cells at their cut-down size (the coding-agent trace's first 16 sessions).
    #[arg(long)]
    quick: bool,
    /// Draws (seeds 0..N) per cell and policy.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// Replays run in parallel.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    jobs: u64,
    /// Cell ids (default: every cell of the set).
    #[arg(long, value_name = "id,id")]
    only: Option<String>,
    /// Policy specs (default: the baselines, kv_load, kv_time and its no-op twin).
    #[arg(long, value_name = "spec,spec")]
    policies: Option<String>,
    /// The JSON-lines file replays are appended to (replays already in it are not redone).
    #[arg(long, default_value = "out/model-eval/runs.jsonl")]
    out: PathBuf,
    /// The traces' folder.
    #[arg(long, default_value = "traces")]
    traces: PathBuf,
    /// Also write each replay's requests (issued, replica, prompt, cached, TTFT, the decision's
    /// explanation) as JSON lines to `DIR/<cell>.<policy>.<seed>.jsonl`, for looking into a figure.
    #[arg(long, value_name = "DIR")]
    requests: Option<PathBuf>,
}

fn main() {
    let args = Args::parse();
    let policies: Vec<String> = match &args.policies {
        Some(list) => split_list(list),
        None => POLICIES.iter().map(|s| s.to_string()).collect(),
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
    if args.set == "validation2" || args.set == "all" {
        cells.extend(model_eval::validation2());
    }
    if let Some(only) = &args.only {
        let only = split_list(only);
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
            for p in &policies {
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
        policies.len(),
        args.seeds
    );
    let next = AtomicUsize::new(0);
    let failed = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..args.jobs {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((ci, policy, seed)) = work.get(i) else {
                        break;
                    };
                    let c = &cells[*ci];
                    let started = std::time::Instant::now();
                    match model_eval::replay(
                        &module,
                        &args.traces,
                        c,
                        policy,
                        *seed,
                        args.requests.is_some(),
                    ) {
                        Ok(m) => {
                            if let Some(dir) = &args.requests {
                                write_requests(dir, c, policy, *seed, &m.requests);
                            }
                            let mut v = serde_json::to_value(&m).unwrap_or_default();
                            v["set"] = serde_json::json!(match c.set {
                                Set::Training => "training",
                                Set::Validation => "validation",
                                Set::Validation2 => "validation2",
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

/// Writes one replay's request rows; a failure is reported and the replay's figures kept.
fn write_requests(
    dir: &std::path::Path,
    c: &Cell,
    policy: &str,
    seed: u64,
    rows: &[serde_json::Value],
) {
    let path = dir.join(format!(
        "{}.{}.{seed}.jsonl",
        c.id,
        policy.replace(['/', '@', '#', '='], "_")
    ));
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    if let Err(e) = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, text)) {
        eprintln!("model-eval: {}: {e}", path.display());
    }
}
