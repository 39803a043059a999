//! The benchmark behind docs/reports/results.md: every filter policy on the RL straggler workload,
//! the coding-agent traces at 8..40 sessions in flight, Mooncake at its arrival times (and twice as
//! fast) and the Azure no-reuse control, through `kvsteer_filter.wasm` in the wasmtime harness, on
//! four identical simulated replicas in virtual time, over several seeds; and beside them the
//! `oracle`, the limit (the harness places each request from the true output lengths and the
//! engines' exact state: `kvsteer_host_test::oracle`), which the report labels as such and never
//! ranks.
//!
//! `scripts/bench` builds everything and runs this. Options:
//! `--quick` (cut-down workloads, one seed: minutes), `--smoke` (tiny slices, seconds; checks that the
//! outputs are well-formed and exits non-zero if not), `--seeds N` (default 3; 1 with --quick/--smoke) from `--first-seed K` (default 0),
//! `--policies a,b` (names, or variants `kv_load@overlap_credit=2@...` setting numbers in the policy's
//! own section; `oracle` or `oracle@decode=1@stall=1` for the limit), `--only id,group,..` (scenario ids or groups: rl, weka, mooncake, azure; also the
//! many-proxies scenarios, which only `--only` selects: group `proxies` (`rl-p1`, `rl-p2`, `rl-p4`,
//! `weka-c16-p4`, ...: requests spread across 1, 2 or 4 independent proxies at random) and group
//! `proxies-session` (the same ids ending in `s`: each session through one proxy);
//! docs/reports/proxies.md; and group `dp`, 2 endpoints x 4 data-parallel ranks (`dp-rl`,
//! `dp-weka-c32`, `dp-weka-c48`), where a policy spec ending in `@rank_blind` routes to endpoints
//! only; docs/design/dp.md; and group `pd`, 2 prefill + 4 decode engines (`pd-rl`, `pd-weka-c12`,
//! `pd-weka-c24`; group `pd-shape`: `pd-weka-c24-3p3d`, the same 6 engines split 3 + 3), replayed
//! by `kvsteer_host_test::disaggregated_fleet` through the filter's two-leg P/D path (one worker VM),
//! `@pd.KEY=NUMBER` setting its coefficients; docs/design/pd.md; and groups `weka-fixed`,
//! `mooncake-fixed`, `azure-fixed` (`weka-c16-fixed`, `mooncake-x1-fixed`, `azure-fixed`, ...): the
//! trace scenarios on their recorded timing, where a seed changes only tie-breaks; the matrix's own
//! coding-agent scenarios draw every think time, and its Mooncake and Azure scenarios every gap
//! between arrivals, within 20% of the recorded one per seed, so that seeds are independent draws
//! for every policy), `--jobs N` (replays in parallel, default: available cores), `--workers N`
//! (proxy worker VMs, 2), `--out DIR` (default: the repository's `docs/reports/` for a full run,
//! `out/bench-<scale>/` otherwise), `--traces DIR` (default `traces`). Writes `DIR/results.md`, `DIR/results/harness.json`
//! (configuration, seeds, commit, every run's summary) and the SVG plots under `DIR/results/`.

mod report;

use kvsteer_host_test::artifact::workspace_root;
use kvsteer_host_test::{FilterModule, filter_wasm_path};
use kvsteer_lab::bench::args::BenchArgs as Args;
use kvsteer_lab::bench::progress::run_jobs;
use kvsteer_lab::bench::report::{ScenarioRuns, claims, limit_gap, scenario_table};
use kvsteer_lab::bench::run::replay_pd_spec;
use kvsteer_lab::bench::run::{Outcome, replay_fleet};
use kvsteer_lab::bench::scenario::{
    Scale, Scenario, Source, dp_matrix, fixed_matrix, matrix, pd_matrix, proxy_matrix,
};
use kvsteer_workload::{Mode, Workload};
use report::{RunMeta, check_outputs, write_outputs};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// One replay to do.
struct Job {
    scenario: usize,
    /// Index into the built workloads.
    workload: usize,
    policy: String,
    seed: u64,
    requests: u64,
    weight: u64,
}

/// One replay of the matrix through the filter: a P/D fleet through the filter's two-leg path
/// (host-test/src/disaggregated_fleet.rs), any other through the fleet replay; with `--rows`, its per-request rows
/// written under `rows_dir`.
fn replay_job(
    module: &FilterModule,
    sc: &Scenario,
    j: &Job,
    workloads: &[(Workload, Mode)],
    workers: usize,
    rows_dir: Option<&Path>,
    tick: &dyn Fn(u64),
) -> Result<Outcome, String> {
    let (w, mode) = workloads[j.workload].clone();
    let topology = (workers, sc.proxies, sc.spread);
    let fleet = (sc.endpoints, sc.dp_ranks);
    let tick = |done, _| tick(done);
    let mut r = if sc.pd_prefill > 0 {
        let split = (sc.pd_prefill, sc.endpoints - sc.pd_prefill);
        replay_pd_spec(module, w, mode, &j.policy, j.seed, split, tick).map(|(o, st)| {
            eprintln!(
                "pd {} {} seed {}: {} requests, {} failed, decode legs read \
                 {:.1}% of their prompt tokens over the link, {} of them held \
                 part of it",
                sc.id,
                j.policy,
                j.seed,
                st.requests,
                st.failed,
                100.0 * st.transferred_tokens as f64 / st.decode_prompt_tokens.max(1) as f64,
                st.decode_local_hits
            );
            o
        })
    } else {
        replay_fleet(module, w, mode, &j.policy, j.seed, topology, fleet, tick)
    };
    if let Ok(o) = &mut r {
        let rows = std::mem::take(&mut o.rows);
        if let Some(dir) = rows_dir
            && let Err(e) = write_rows(dir, &sc.id, o, &rows)
        {
            eprintln!("--rows: {e}");
        }
    }
    r
}

fn main() {
    let args = Args::parse();
    let r = match &args.export_slice {
        Some(file) => export_slice(&args, file),
        None => run(&args),
    };
    if let Err(e) = r {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}

/// Where a run writes: `--out`, else `docs/reports/` at full scale, else `out/bench-<scale>/`.
fn out_dir(args: &Args) -> PathBuf {
    args.out.clone().unwrap_or_else(|| match args.scale {
        Scale::Full => workspace_root().join("docs/reports"),
        _ => workspace_root().join(format!("out/bench-{}", args.scale.name())),
    })
}

fn run(args: &Args) -> Result<(), String> {
    let started = Instant::now();
    let scale = args.scale;
    let seeds = args
        .seeds
        .unwrap_or(if scale == Scale::Full { 3 } else { 1 });
    let (scenarios, out) = select(args)?;
    let path = filter_wasm_path().map_err(|e| e.to_string())?;
    let module = FilterModule::load_unmetered(&path).map_err(|e| e.to_string())?;

    let (workloads, first_workload, jobs) = plan(&scenarios, args, seeds)?;
    // Heaviest first, so the last replays to finish are short ones.
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].weight));
    let total: u64 = jobs.iter().map(|j| j.requests).sum();
    announce(args, &scenarios, seeds, &jobs, &path, module.size());
    let results = run_jobs(&order, args.jobs, total, |i, tick| {
        let sc = &scenarios[jobs[i].scenario];
        replay_job(
            &module,
            sc,
            &jobs[i],
            &workloads,
            args.workers,
            args.rows.as_deref(),
            tick,
        )
    });
    let wall = started.elapsed().as_secs_f64();
    let (per_scenario, failures) = sort_results(&scenarios, &jobs, results);
    let grouped: Vec<ScenarioRuns> = scenarios
        .iter()
        .zip(&per_scenario)
        .map(|(sc, runs)| ScenarioRuns::group(sc, &args.policies, runs))
        .collect();
    print_report(&grouped, wall);
    let meta = RunMeta {
        scale,
        seeds,
        workers: args.workers,
        wall_s: wall,
        filter: &path,
        filter_bytes: module.size(),
    };
    if failures.len() == jobs.len() {
        // Nothing to report: do not overwrite a committed report with empty tables.
        return Err(format!(
            "every replay failed ({}); nothing written",
            failures.len()
        ));
    }
    write_outputs(
        &out,
        &meta,
        &workloads,
        &first_workload,
        &grouped,
        &args.policies,
    )?;
    eprintln!(
        "wrote {}/results.md and {}/results/ (harness.json, SVG plots)",
        out.display(),
        out.display()
    );
    if scale == Scale::Smoke {
        check_outputs(&out, scenarios.len() * args.policies.len() * seeds as usize)?;
        eprintln!("smoke check passed: every replay finished, outputs well-formed");
    }
    if !failures.is_empty() {
        return Err(format!("{} replays failed", failures.len()));
    }
    Ok(())
}

/// The report on stdout: each scenario's table, the claims, the default against the limit.
fn print_report(grouped: &[ScenarioRuns], wall: f64) {
    for g in grouped {
        println!("\n## {}\n\n{}", g.scenario.id, scenario_table(g));
    }
    println!("{}", claims(grouped));
    let gap = limit_gap(grouped);
    if !gap.is_empty() {
        println!("### The default against the limit\n\n{gap}");
    }
    println!("total wall time {wall:.1} s");
}

/// Says on stderr what the run is about to do.
fn announce(
    args: &Args,
    scenarios: &[Scenario],
    seeds: u64,
    jobs: &[Job],
    path: &Path,
    module_bytes: usize,
) {
    let mut fleets: Vec<String> = scenarios.iter().map(|s| s.fleet()).collect();
    fleets.sort();
    fleets.dedup();
    eprintln!(
        "kvsteer bench ({}): {} scenarios x {} policies x {} seeds = {} replays, {} requests, \
         {}, {} workers, filter {} ({} KB), {} threads",
        args.scale.name(),
        scenarios.len(),
        args.policies.len(),
        seeds,
        jobs.len(),
        jobs.iter().map(|j| j.requests).sum::<u64>(),
        fleets.join(" / "),
        args.workers,
        path.display(),
        module_bytes / 1024,
        args.jobs
    );
}

/// The scenarios `--only` picks (the matrix without it; the many-proxies, DP, P/D and
/// recorded-timing scenarios only with it), and where the run writes.
fn select(args: &Args) -> Result<(Vec<Scenario>, PathBuf), String> {
    let scale = args.scale;
    // The many-proxies scenarios are not part of the matrix: only `--only` selects them.
    let extra = if args.only.is_empty() {
        Vec::new()
    } else {
        let mut v = proxy_matrix(scale);
        v.extend(dp_matrix(scale));
        v.extend(pd_matrix(scale));
        v.extend(fixed_matrix(scale));
        v
    };
    let scenarios: Vec<Scenario> = matrix(scale)
        .into_iter()
        .chain(extra)
        .filter(|s| args.only.is_empty() || args.only.iter().any(|o| *o == s.id || *o == s.group))
        .collect();
    if scenarios.is_empty() {
        return Err(format!("--only {:?} matches no scenario", args.only));
    }
    // A run with many-proxies scenarios never writes over the report in docs/ by default.
    let out = if args.out.is_none() && scenarios.iter().any(|s| s.group.starts_with("proxies")) {
        workspace_root().join("out/proxies")
    } else if args.out.is_none() && scenarios.iter().any(|s| s.group == "dp") {
        workspace_root().join("out/dp")
    } else if args.out.is_none() && scenarios.iter().any(|s| s.group.starts_with("pd")) {
        workspace_root().join("out/pd")
    } else if args.out.is_none() && scenarios.iter().any(|s| s.group.ends_with("-fixed")) {
        workspace_root().join("out/fixed")
    } else {
        out_dir(args)
    };
    Ok((scenarios, out))
}

/// The workloads to build and the replays to run: one per scenario, policy and seed. Returns the
/// workloads, each scenario's first workload, and the jobs.
type Plan = (Vec<(Workload, Mode)>, Vec<usize>, Vec<Job>);

fn plan(scenarios: &[Scenario], args: &Args, seeds: u64) -> Result<Plan, String> {
    // Workloads: traces on their recorded timing are built once and cloned per replay; RL and the
    // jittered trace scenarios are built per seed.
    eprintln!("== building {} workloads", scenarios.len());
    let mut workloads: Vec<(Workload, Mode)> = Vec::new();
    let mut first_workload = Vec::new();
    let mut jobs = Vec::new();
    for (si, sc) in scenarios.iter().enumerate() {
        first_workload.push(workloads.len());
        // Workloads the seed reaches are built per seed; recorded-timing replays are the same for every
        // seed.
        let per_seed = match sc.source {
            Source::Rl(_) | Source::Slice(_) | Source::Chat(_) => true,
            Source::Weka { think_jitter, .. } => think_jitter > 0.0,
            Source::Mooncake { arrival_jitter, .. } | Source::Azure { arrival_jitter, .. } => {
                arrival_jitter > 0.0
            }
        };
        let first = args.first_seed;
        for seed in first..first.saturating_add(seeds) {
            if seed == first || per_seed {
                workloads.push(sc.build(&args.traces, seed)?);
            }
            let wi = workloads.len() - 1;
            let w = &workloads[wi].0;
            let st = w.stats();
            for p in &args.policies {
                jobs.push(Job {
                    scenario: si,
                    workload: wi,
                    policy: p.clone(),
                    seed,
                    requests: st.requests as u64,
                    weight: st.fixed_prompt_tokens / 1000 + st.requests as u64 * 20,
                });
            }
        }
    }
    Ok((workloads, first_workload, jobs))
}

/// Each scenario's runs in seed order, and the failed replays (printed).
fn sort_results(
    scenarios: &[Scenario],
    jobs: &[Job],
    results: Vec<(usize, Result<Outcome, String>)>,
) -> (Vec<Vec<Outcome>>, Vec<String>) {
    let mut per_scenario: Vec<Vec<Outcome>> = scenarios.iter().map(|_| Vec::new()).collect();
    let mut failures = Vec::new();
    for (i, r) in results {
        match r {
            Ok(o) => per_scenario[jobs[i].scenario].push(o),
            Err(e) => failures.push(format!(
                "{} seed {}: {e}",
                scenarios[jobs[i].scenario].id, jobs[i].seed
            )),
        }
    }
    for f in &failures {
        eprintln!("FAILED: {f}");
    }
    for v in per_scenario.iter_mut() {
        v.sort_by_key(|o| o.seed);
    }
    (per_scenario, failures)
}

/// Writes the slice scenario (seed 0) for the Envoy run: every request written out, as JSON
/// `{name, block_size, concurrency, sessions: [{id, turns: [{prompt, max_tokens, think_us}]}]}`.
/// Writes one replay's requests as `DIR/<scenario>_<policy>_s<seed>.csv` (the policy spec with `@`
/// and `=` kept, so a variant's file names itself).
fn write_rows(
    dir: &Path,
    scenario: &str,
    o: &Outcome,
    rows: &[kvsteer_workload::RequestRow],
) -> Result<(), String> {
    use std::fmt::Write as _;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let file = dir.join(format!("{scenario}_{}_s{}.csv", o.policy, o.seed));
    let mut text = String::from(
        "request_id,session_id,replica,issued_us,first_token_us,end_us,failed,prompt_tokens,\
         cached_tokens,completion_tokens\n",
    );
    let opt = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_default();
    for r in rows {
        let _ = writeln!(
            text,
            "{},{},{},{},{},{},{},{},{},{}",
            r.request_id,
            r.session_id.replace(',', ";"),
            opt(r.replica.map(|v| v as u64)),
            r.issued_us,
            opt(r.first_token_us),
            opt(r.end_us),
            r.failed,
            r.prompt_tokens,
            r.cached_tokens,
            r.completion_tokens
        );
    }
    std::fs::write(&file, text).map_err(|e| format!("{}: {e}", file.display()))
}

fn export_slice(args: &Args, file: &Path) -> Result<(), String> {
    let sc = matrix(args.scale)
        .into_iter()
        .find(|s| s.group == "slice")
        .ok_or("no slice scenario")?;
    let (w, mode) = sc.build(&args.traces, 0)?;
    let concurrency = match mode {
        Mode::Closed { concurrency } => concurrency,
        Mode::Open => 0,
    };
    let sessions: Vec<Value> = w
        .sessions
        .iter()
        .map(|s| {
            let turns: Vec<Value> = s
                .turns
                .iter()
                .map(|t| {
                    let prompt = match &t.prompt {
                        kvsteer_workload::Prompt::Full(p) => p.clone(),
                        kvsteer_workload::Prompt::Blocks(b) => b.tokens(),
                        kvsteer_workload::Prompt::Append(_) => Vec::new(),
                    };
                    json!({"prompt": prompt, "max_tokens": t.output_tokens, "think_us": t.think_us})
                })
                .collect();
            json!({"id": s.id, "turns": turns})
        })
        .collect();
    let doc = json!({
        "scenario": sc.id, "name": w.name, "params": w.params, "block_size": w.block_size,
        "concurrency": concurrency, "sessions": sessions,
    });
    std::fs::write(
        file,
        serde_json::to_string(&doc).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("{}: {e}", file.display()))?;
    eprintln!(
        "wrote {} ({} sessions, {} requests, {} in flight)",
        file.display(),
        w.sessions.len(),
        w.total_requests(),
        concurrency
    );
    Ok(())
}
