//! `fleet-bench`: replays the fleet-size cells (`kvsteer_lab::bench::fleet`: RL, coding
//! agents, chat behind a shared prompt and Mooncake, load growing with the fleet) through the
//! compiled filter for every policy over paired draws, and appends every replay's figures as JSON
//! lines (resumable: replays already in the output are not redone). `scripts/fleet-bench` runs it
//! and `scripts/fleet-report` writes docs/reports/fleet.md from what it wrote. `--churn` replays the
//! churn cells instead (`kvsteer_lab::bench::churn`: members added and removed through the
//! discovery source during the replay, against a static fleet of the average size).

use clap::Parser;
use kvsteer_host_test::{FilterModule, filter_wasm_path};
use kvsteer_lab::bench::args::split_list;
use kvsteer_lab::bench::churn;
use kvsteer_lab::bench::fleet::{self, FLEETS, FleetCell, POLICIES};
use kvsteer_lab::bench::jsonl::{self, write_requests};
use std::path::PathBuf;

/// `fleet-bench`'s flags.
#[derive(Parser, Debug)]
#[command(
    name = "fleet-bench",
    about = "Replays the fleet-size cells (4 to 64 replicas, load per replica fixed) through \
             kvsteer_filter.wasm and appends every replay's figures as JSON lines."
)]
struct Args {
    /// Fleet sizes (replicas).
    #[arg(long, value_name = "n,n", default_value = "4,8,16,32")]
    fleets: String,
    /// Workloads (rl, weka, chat, mooncake; default all).
    #[arg(long, value_name = "w,w")]
    only: Option<String>,
    /// Draws (seeds 0..N) per cell and policy.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// Replays run in parallel.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    jobs: u64,
    /// Policy specs (default: round_robin, least_load, session_hash, kv_load, kv_time).
    #[arg(long, value_name = "spec,spec")]
    policies: Option<String>,
    /// The JSON-lines file replays are appended to (replays already in it are not redone); default
    /// out/fleet/runs.jsonl, or out/fleet/churn.jsonl with --churn.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Replay the churn cells (a fleet whose members move during the replay, and a static fleet of
    /// its average size) instead of the fleet-size cells; --fleets and --only do not apply.
    #[arg(long)]
    churn: bool,
    /// With --churn: seconds of arrivals (the schedule's changes at 1/5, 2/5 and 4/5 of it).
    #[arg(long, default_value_t = churn::SPAN_S, value_parser = clap::value_parser!(u64).range(5..))]
    churn_span: u64,
    /// The traces' folder.
    #[arg(long, default_value = "traces")]
    traces: PathBuf,
    /// Also write each replay's requests as JSON lines to DIR/<cell>.<policy>.<seed>.jsonl.
    #[arg(long, value_name = "DIR")]
    requests: Option<PathBuf>,
}

fn fail(e: impl std::fmt::Display) -> ! {
    eprintln!("fleet-bench: {e}");
    std::process::exit(1);
}

fn main() {
    let args = Args::parse();
    if args.churn {
        return run_churn(&args);
    }
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| "out/fleet/runs.jsonl".into());
    let fleets: Vec<usize> = split_list(&args.fleets)
        .iter()
        .map(|n| n.parse().ok().filter(|n| (1..=256).contains(n)))
        .collect::<Option<_>>()
        .unwrap_or_else(|| fail(format!("--fleets: replica counts 1-256, e.g. {FLEETS:?}")));
    let policies: Vec<String> = match &args.policies {
        Some(list) => split_list(list),
        None => POLICIES.iter().map(|s| s.to_string()).collect(),
    };
    let mut cells: Vec<FleetCell> = fleet::fleet_scale(&fleets);
    if let Some(only) = &args.only {
        let only = split_list(only);
        cells.retain(|c| only.iter().any(|w| w == c.workload));
    }
    let module = filter_wasm_path()
        .and_then(|p| FilterModule::load_unmetered(&p).map_err(|e| e.to_string()))
        .unwrap_or_else(|e| fail(e));
    let ids: Vec<&str> = cells.iter().map(|c| c.cell.id.as_str()).collect();
    let work = jsonl::pending(&ids, &policies, args.seeds, &out);
    let what = format!(
        "{} cells (fleets {fleets:?}), {} policies, {} seeds",
        cells.len(),
        policies.len(),
        args.seeds
    );
    let keep_requests = args.requests.is_some();
    let failed = jsonl::run_all("fleet-bench", &what, &out, args.jobs, &work, |w| {
        let c = &cells[w.0];
        let (policy, seed) = (&w.1, w.2);
        let m = fleet::replay(&module, &args.traces, c, policy, seed, keep_requests)?;
        if let Some(dir) = &args.requests {
            write_requests(dir, &c.cell.id, policy, seed, &m.requests);
        }
        let requests: u64 = m.requests_per_replica.iter().sum();
        let mut v = serde_json::to_value(&m).unwrap_or_default();
        v["set"] = serde_json::json!("fleet");
        v["workload"] = serde_json::json!(c.workload);
        v["replicas"] = serde_json::json!(c.cell.replicas);
        let (lo, hi) = (
            m.requests_per_replica.iter().min().copied().unwrap_or(0),
            m.requests_per_replica.iter().max().copied().unwrap_or(0),
        );
        let msg = format!(
            "{} {policy} seed {seed}: {requests} requests, ttft p50 {:.0} p99 {:.0} ms, per replica {lo}-{hi}",
            c.cell.id, m.ttft_p50_ms, m.ttft_p99_ms,
        );
        Ok((v, msg))
    })
    .unwrap_or_else(|e| fail(e));
    if failed > 0 {
        fail(format!("{failed} replays failed"));
    }
}

/// `--churn`: both churn cells for every policy and draw, each replay's figures with the members'
/// spread and the checks (late requests on removed members, fallbacks, dropped bookings).
fn run_churn(args: &Args) {
    let out = args
        .out
        .clone()
        .unwrap_or_else(|| "out/fleet/churn.jsonl".into());
    let policies: Vec<String> = match &args.policies {
        Some(list) => split_list(list),
        None => churn::POLICIES.iter().map(|s| s.to_string()).collect(),
    };
    let cells = churn::cells(args.churn_span);
    let module = filter_wasm_path()
        .and_then(|p| FilterModule::load_unmetered(&p).map_err(|e| e.to_string()))
        .unwrap_or_else(|e| fail(e));
    let ids: Vec<&str> = cells.iter().map(|c| c.cell.id.as_str()).collect();
    let work = jsonl::pending(&ids, &policies, args.seeds, &out);
    let what = format!(
        "{} churn cells ({} s of arrivals), {} policies, {} seeds",
        cells.len(),
        args.churn_span,
        policies.len(),
        args.seeds
    );
    let keep_requests = args.requests.is_some();
    let failed = jsonl::run_all("fleet-bench", &what, &out, args.jobs, &work, |w| {
        let c = &cells[w.0];
        let (policy, seed) = (&w.1, w.2);
        let (m, _) = churn::replay(&module, &args.traces, c, policy, seed, keep_requests)?;
        if let Some(dir) = &args.requests {
            write_requests(dir, &c.cell.id, policy, seed, &m.base.requests);
        }
        let requests: u64 = m.base.requests_per_replica.iter().sum();
        let mut v = serde_json::to_value(&m).unwrap_or_default();
        v["set"] = serde_json::json!("churn");
        v["span_s"] = serde_json::json!(args.churn_span);
        v["schedule"] = serde_json::json!(c
            .schedule
            .iter()
            .map(|(t, members)| serde_json::json!({"from_s": *t as f64 / 1e6, "members": members}))
            .collect::<Vec<_>>());
        let msg = format!(
            "{} {policy} seed {seed}: {requests} requests ({} failed, {} late on removed), ttft p50 {:.0} p99 {:.0} ms, per member {:.2}-{:.2} of a fair share",
            c.cell.id,
            m.base.failed,
            m.late_on_removed,
            m.base.ttft_p50_ms,
            m.base.ttft_p99_ms,
            m.member_share_min,
            m.member_share_max,
        );
        Ok((v, msg))
    })
    .unwrap_or_else(|e| fail(e));
    if failed > 0 {
        fail(format!("{failed} replays failed"));
    }
}
