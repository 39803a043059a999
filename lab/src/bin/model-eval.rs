//! `model-eval`: replays the training and validation cells of docs/reports/model-eval.md for every
//! policy over paired draws, through the compiled filter, and writes every replay's figures as JSON
//! lines (one per replay, appended as they finish, so a long run can be read while it goes and
//! resumed). `model-eval --help` lists the flags; `scripts/model-eval` runs it and
//! `scripts/model-report` reads what it wrote.

use clap::Parser;
use kvsteer_host_test::{FilterModule, filter_wasm_path};
use kvsteer_lab::bench::args::split_list;
use kvsteer_lab::bench::jsonl::{self, write_requests};
use kvsteer_lab::bench::model_eval::{self, Cell, POLICIES, Set};
use std::path::PathBuf;

/// `model-eval`'s flags.
#[derive(Parser, Debug)]
#[command(
    name = "model-eval",
    about = "Replays the routing model's training and validation cells (docs/reports/model-eval.md) \
             through kvsteer_filter.wasm and appends every replay's figures as JSON lines."
)]
struct Args {
    /// Which cells: training, validation (the first round), validation2 (the second), validation3
    /// (the third), validation4 (the fourth), validation5 (the fifth), all (training and the five
    /// rounds) or weka-validation (the coding-agent validation samples; not in all).
    #[arg(long, default_value = "all", value_parser = ["training", "validation", "validation2", "validation3", "validation4", "validation5", "all", "weka-validation"])]
    set: String,
    /// The training and weka-validation cells at their cut-down size (each coding-agent sample's
    /// first 16 sessions; the same cell ids, so write such replays to another file).
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

/// A validation round: its `--set` name and its cells.
type Round = (&'static str, fn() -> Vec<Cell>);

/// The cells of `set` (a `--set` value).
fn select(set: &str, quick: bool) -> Vec<Cell> {
    if set == "weka-validation" {
        return model_eval::weka_validation(quick);
    }
    let rounds: [Round; 5] = [
        ("validation", model_eval::validation),
        ("validation2", model_eval::validation2),
        ("validation3", model_eval::validation3),
        ("validation4", model_eval::validation4),
        ("validation5", model_eval::validation5),
    ];
    let mut cells = Vec::new();
    if set == "training" || set == "all" {
        cells.extend(model_eval::training(quick));
    }
    for (name, round) in rounds {
        if set == name || set == "all" {
            cells.extend(round());
        }
    }
    cells
}

/// A set's name in the replays' `set` field (the `--set` value that selects it).
fn set_name(set: Set) -> &'static str {
    match set {
        Set::Training => "training",
        Set::Validation => "validation",
        Set::Validation2 => "validation2",
        Set::Validation3 => "validation3",
        Set::Validation4 => "validation4",
        Set::Validation5 => "validation5",
        Set::WekaValidation => "weka-validation",
        Set::Fleet => "fleet",
    }
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
    let mut cells = select(&args.set, args.quick);
    if let Some(only) = &args.only {
        let only = split_list(only);
        cells.retain(|c| only.contains(&c.id));
    }
    // Replays already in the output (a resumed run) are not redone.
    let ids: Vec<&str> = cells.iter().map(|c| c.id.as_str()).collect();
    let work = jsonl::pending(&ids, &policies, args.seeds, &args.out);
    let what = format!(
        "{} cells, {} policies, {} seeds",
        cells.len(),
        policies.len(),
        args.seeds
    );
    let keep = args.requests.is_some();
    let failed = jsonl::run_all("model-eval", &what, &args.out, args.jobs, &work, |item| {
        let (ci, policy, seed) = item;
        let c = &cells[*ci];
        let m = model_eval::replay(&module, &args.traces, c, policy, *seed, keep)?;
        if let Some(dir) = &args.requests {
            write_requests(dir, &c.id, policy, *seed, &m.requests);
        }
        let mut v = serde_json::to_value(&m).unwrap_or_default();
        v["set"] = serde_json::json!(set_name(c.set));
        let msg = format!(
            "{} {policy} seed {seed}: ttft p50 {:.0} p99 {:.0} ms, session p50 {:.0} s, per replica {:?}",
            c.id, m.ttft_p50_ms, m.ttft_p99_ms, m.session_p50_s, m.requests_per_replica,
        );
        Ok((v, msg))
    })
    .unwrap_or_else(|e| {
        eprintln!("model-eval: {e}");
        std::process::exit(1);
    });
    if failed > 0 {
        eprintln!("model-eval: {failed} replays failed");
        std::process::exit(1);
    }
}
