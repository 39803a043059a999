//! The main job: replays the RL straggler workload (docs/design/design.md section 7) through the
//! compiled filter, once per policy, in front of four simulated replicas in virtual time, and
//! compares the policies.
//!
//! `scripts/demo` builds the filter and runs this in release. Options:
//! `--small` (the scaled-down workload, seconds), `--policies a,b,..`, `--workers N` (default 2),
//! `--jobs N` (policies run in parallel, default: available cores), `--out DIR` (default `out/demo`).
//! Writes `rl.md` (the table), `rl.json` (summaries, harness counters, wall times) and SVG plots:
//! `rl_ttft_cdf.svg`, `rl_hit_vs_cv.svg`, `rl_decode_<policy>.svg`.

use kvsteer_host_test::{FilterModule, filter_wasm_path};
use kvsteer_lab::bench::args::DemoArgs;
use kvsteer_lab::bench::progress::run_jobs;
use kvsteer_lab::bench::run::{Outcome, replay};
use kvsteer_workload::Summary;
use kvsteer_workload::report::{decode_load_svg, hit_cv_scatter_svg, markdown_table, ttft_cdf_svg};
use kvsteer_workload::rl::{RlParams, generate};
use serde_json::json;
use std::time::Instant;

/// One policy's replay, through the same code path as the bench (`kvsteer_lab::bench::run`).
fn run_policy(
    module: &FilterModule,
    policy: &str,
    params: &RlParams,
    workers: usize,
    tick: &dyn Fn(u64),
) -> Result<Outcome, String> {
    let workload = generate(params).map_err(|e| e.to_string())?;
    let mode = workload.default_mode;
    replay(
        module,
        workload,
        mode,
        policy,
        params.seed,
        workers,
        |done, _| tick(done),
    )
}

fn main() {
    let args = DemoArgs::parse();
    let path = match filter_wasm_path() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let started = Instant::now();
    let module = match FilterModule::load_unmetered(&path) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    let params = if args.small {
        RlParams::small()
    } else {
        RlParams::default()
    };
    eprintln!(
        "kvsteer demo: RL stragglers ({} steps x {} rollouts x {} turns, {} in flight), 4 replicas, \
         {} workers, filter {} ({} KB), {} policies on {} threads",
        params.steps,
        params.rollouts_per_step,
        params.turns,
        params.concurrency,
        args.workers,
        path.display(),
        module.size() / 1024,
        args.policies.len(),
        args.jobs
    );
    let n = args.policies.len();
    let total = (params.steps * params.rollouts_per_step * params.turns * n) as u64;
    let order: Vec<usize> = (0..n).collect();
    let done = run_jobs(&order, args.jobs, total, |i, tick| {
        run_policy(&module, &args.policies[i], &params, args.workers, tick)
    });
    let mut results: Vec<Option<Result<Outcome, String>>> = (0..n).map(|_| None).collect();
    for (i, r) in done {
        results[i] = Some(r);
    }
    let mut outcomes = Vec::new();
    let mut failed = results.iter().any(Option::is_none);
    for r in results.into_iter().flatten() {
        match r {
            Ok(o) => outcomes.push(o),
            Err(e) => {
                eprintln!("FAILED: {e}");
                failed = true;
            }
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let table = comparison_table(&outcomes);
    println!("\n{table}");
    println!("Full metrics:\n\n{}", markdown_table(&summaries(&outcomes)));
    println!("total wall time {wall:.1} s");
    if let Err(e) = write_outputs(&args, &params, &outcomes, &table, wall) {
        eprintln!("writing results: {e}");
        failed = true;
    }
    if failed {
        std::process::exit(1);
    }
}

fn summaries(outcomes: &[Outcome]) -> Vec<Summary> {
    outcomes.iter().map(|o| o.summary.clone()).collect()
}

/// The headline table: the metrics of docs/design/design.md section 7, one row per policy.
fn comparison_table(outcomes: &[Outcome]) -> String {
    let mut s = String::from(
        "| policy | TTFT p50 / p99 ms | TPOT p50 / p99 ms | rollout p99 s | output tok/s | hit rate \
         | decode CV | requests (failed, fallback) | wall s |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for o in outcomes {
        let m = &o.summary;
        s.push_str(&format!(
            "| {} | {:.0} / {:.0} | {:.1} / {:.1} | {:.1} | {:.0} | {:.1}% | {} | {} ({}, {}) | {:.1} |\n",
            o.policy,
            m.ttft_ms.p50,
            m.ttft_ms.p99,
            m.tpot_ms.p50,
            m.tpot_ms.p99,
            m.session_e2e_s.p99,
            m.output_tokens_per_s,
            m.hit_rate * 100.0,
            m.decode_cv.map_or("-".into(), |c| format!("{c:.3}")),
            m.requests,
            m.failed,
            o.stats.fallback,
            o.wall_s,
        ));
    }
    s
}

fn write_outputs(
    args: &DemoArgs,
    params: &RlParams,
    outcomes: &[Outcome],
    table: &str,
    wall: f64,
) -> std::io::Result<()> {
    std::fs::create_dir_all(&args.out)?;
    let md = format!(
        "# RL straggler workload through kvsteer_filter.wasm\n\n\
         {} steps x {} rollouts x {} turns, {} rollouts in flight, 4 replicas (simulated \
         Llama-3.1-8B on H100), {} proxy workers. Virtual time; wall {:.1} s.\n\n{}\n\
         ## All metrics\n\n{}",
        params.steps,
        params.rollouts_per_step,
        params.turns,
        params.concurrency,
        args.workers,
        wall,
        table,
        markdown_table(&summaries(outcomes))
    );
    std::fs::write(args.out.join("rl.md"), md)?;
    write_plots(&args.out, outcomes)?;
    std::fs::write(
        args.out.join("rl.json"),
        serde_json::to_string_pretty(&rl_json(args, params, outcomes, wall)).unwrap_or_default(),
    )?;
    eprintln!(
        "wrote {}/rl.md, rl.json and rl_*.svg (TTFT CDF, hit rate vs decode CV, decode load)",
        args.out.display()
    );
    Ok(())
}

/// `rl.json`: the workload's parameters and each policy's summary, harness counters and wall time.
fn rl_json(
    args: &DemoArgs,
    params: &RlParams,
    outcomes: &[Outcome],
    wall: f64,
) -> serde_json::Value {
    let runs: Vec<serde_json::Value> = outcomes
        .iter()
        .map(|o| {
            json!({
                "policy": o.policy,
                "summary": o.summary,
                "wall_s": o.wall_s,
                "virtual_s": o.virtual_s,
                "harness": o.harness_json(),
            })
        })
        .collect();
    json!({
        "workload": "rl",
        "params": {
            "steps": params.steps, "rollouts_per_step": params.rollouts_per_step,
            "turns": params.turns, "concurrency": params.concurrency,
            "output_tokens": params.output_tokens,
            "straggler_output_tokens": params.straggler_output_tokens,
        },
        "workers": args.workers,
        "wall_s": wall,
        "runs": runs,
    })
}

/// The plots: TTFT CDFs, hit rate against decode CV, and each policy's decode load per replica.
fn write_plots(out: &std::path::Path, outcomes: &[Outcome]) -> std::io::Result<()> {
    let series: Vec<(&str, &[f64])> = outcomes
        .iter()
        .map(|o| (o.policy.as_str(), o.ttft_ms.as_slice()))
        .collect();
    std::fs::write(out.join("rl_ttft_cdf.svg"), ttft_cdf_svg(&series))?;
    let points: Vec<(&str, f64, f64)> = outcomes
        .iter()
        .map(|o| {
            (
                o.policy.as_str(),
                o.summary.hit_rate,
                o.summary.decode_cv.unwrap_or(0.0),
            )
        })
        .collect();
    std::fs::write(out.join("rl_hit_vs_cv.svg"), hit_cv_scatter_svg(&points))?;
    for o in outcomes {
        let title = format!("{}: KV blocks of decoding requests per replica", o.policy);
        std::fs::write(
            out.join(format!("rl_decode_{}.svg", o.policy)),
            decode_load_svg(&title, &o.decode_series),
        )?;
    }
    Ok(())
}
