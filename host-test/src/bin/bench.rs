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
//! outputs are well-formed and exits non-zero if not), `--seeds N` (default 3; 1 with --quick/--smoke),
//! `--policies a,b` (names, or variants `kv_load@overlap_credit=2@...` setting numbers in the policy's
//! own section; `oracle` or `oracle@decode=1@stall=1` for the limit), `--only id,group,..` (scenario ids or groups: rl, weka, mooncake, azure; also the
//! many-proxies scenarios, which only `--only` selects: group `proxies` (`rl-p1`, `rl-p2`, `rl-p4`,
//! `weka-c16-p4`, ...: requests spread across 1, 2 or 4 independent proxies at random) and group
//! `proxies-session` (the same ids ending in `s`: each session through one proxy);
//! docs/reports/proxies.md; and group `dp`, 2 endpoints x 4 data-parallel ranks (`dp-rl`,
//! `dp-weka-c32`, `dp-weka-c48`), where a policy spec ending in `@rank_blind` routes to endpoints
//! only; docs/design/dp.md; and group `pd`, 2 prefill + 4 decode engines (`pd-rl`, `pd-weka-c12`,
//! `pd-weka-c24`; group `pd-shape`: `pd-weka-c24-3p3d`, the same 6 engines split 3 + 3), replayed
//! by `kvsteer_host_test::pd` through the filter's two-leg P/D path (one worker VM),
//! `@pd.KEY=NUMBER` setting its coefficients; docs/design/pd.md; and groups `weka-fixed`,
//! `mooncake-fixed`, `azure-fixed` (`weka-c16-fixed`, `mooncake-x1-fixed`, `azure-fixed`, ...): the
//! trace scenarios on their recorded timing, where a seed changes only tie-breaks; the matrix's own
//! coding-agent scenarios draw every think time, and its Mooncake and Azure scenarios every gap
//! between arrivals, within 20% of the recorded one per seed, so that seeds are independent draws
//! for every policy), `--jobs N` (replays in parallel, default: available cores), `--workers N`
//! (proxy worker VMs, 2), `--out DIR` (default: the repository's `docs/reports/` for a full run,
//! `out/bench-<scale>/` otherwise), `--traces DIR` (default `traces`), `--notes-only` (put
//! `DIR/results/notes.md`, the analysis written after looking at a run, into the existing
//! `DIR/results.md`; runs nothing). Writes `DIR/results.md`, `DIR/results/harness.json`
//! (configuration, seeds, commit, every run's summary) and the SVG plots under `DIR/results/`.

use kvsteer_host_test::artifact::{report_path, workspace_root};
use kvsteer_host_test::bench::args::{BenchArgs as Args, POLICIES};
use kvsteer_host_test::bench::progress::run_jobs;
use kvsteer_host_test::bench::report::{
    ScenarioRuns, claims, hit_cv_plot, limit_gap, scenario_plots, scenario_table,
};
use kvsteer_host_test::bench::run::{Outcome, ROUTER_SEED, replay_fleet};
use kvsteer_host_test::bench::scenario::{
    Scale, Scenario, Source, dp_matrix, fixed_matrix, matrix, pd_matrix, proxy_matrix,
};
use kvsteer_host_test::pd::replay_pd_spec;
use kvsteer_host_test::{FilterModule, filter_wasm_path};
use kvsteer_workload::{Mode, Summary, Workload};
use serde_json::{Value, json};
use std::fmt::Write as _;
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
/// (host-test/src/pd.rs), any other through the fleet replay; with `--rows`, its per-request rows
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
        None if args.notes_only => refresh_notes(&args),
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

/// `--notes-only`: puts the current `results/notes.md` (the hand-written analysis, which is written
/// after looking at a run) into the existing `results.md` in place of the analysis it was generated
/// with, exactly where a run puts it; nothing is replayed and no figure changes.
fn refresh_notes(args: &Args) -> Result<(), String> {
    let out = out_dir(args);
    let report = out.join("results.md");
    let notes_path = out.join("results").join("notes.md");
    let md = std::fs::read_to_string(&report).map_err(|e| format!("{}: {e}", report.display()))?;
    let notes = std::fs::read_to_string(&notes_path)
        .map_err(|e| format!("{}: {e}", notes_path.display()))?;
    let md = splice_notes(&md, &notes)
        .ok_or_else(|| format!("{}: no analysis section to replace", report.display()))?;
    std::fs::write(&report, md).map_err(|e| format!("{}: {e}", report.display()))?;
    eprintln!("put {} into {}", notes_path.display(), report.display());
    Ok(())
}

/// `md` with its `## Analysis` section's body replaced by `notes` (the body runs to the next `## `
/// heading; notes use `###` and below). None when there is no such section.
fn splice_notes(md: &str, notes: &str) -> Option<String> {
    const HEAD: &str = "## Analysis\n\n";
    let start = md.find(HEAD)? + HEAD.len();
    let end = md[start..]
        .find("\n## ")
        .map_or(md.len(), |i| start + i + 1);
    let mut out = String::with_capacity(md.len() + notes.len());
    out.push_str(&md[..start]);
    out.push_str(notes);
    out.push('\n');
    out.push_str(&md[end..]);
    Some(out)
}

fn run(args: &Args) -> Result<(), String> {
    let started = Instant::now();
    let scale = args.scale;
    let seeds = args
        .seeds
        .unwrap_or(if scale == Scale::Full { 3 } else { 1 });
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
    let path = filter_wasm_path().map_err(|e| e.to_string())?;
    let module = FilterModule::load_unmetered(&path).map_err(|e| e.to_string())?;

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
            Source::Rl(_) | Source::Slice(_) => true,
            Source::Weka { think_jitter, .. } => think_jitter > 0.0,
            Source::Mooncake { arrival_jitter, .. } | Source::Azure { arrival_jitter, .. } => {
                arrival_jitter > 0.0
            }
        };
        for seed in 0..seeds {
            if seed == 0 || per_seed {
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
    // Heaviest first, so the last replays to finish are short ones.
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(jobs[i].weight));
    let total: u64 = jobs.iter().map(|j| j.requests).sum();
    let mut fleets: Vec<String> = scenarios.iter().map(|s| s.fleet()).collect();
    fleets.sort();
    fleets.dedup();
    eprintln!(
        "kvsteer bench ({}): {} scenarios x {} policies x {} seeds = {} replays, {} requests, \
         {}, {} workers, filter {} ({} KB), {} threads",
        scale.name(),
        scenarios.len(),
        args.policies.len(),
        seeds,
        jobs.len(),
        total,
        fleets.join(" / "),
        args.workers,
        path.display(),
        module.size() / 1024,
        args.jobs
    );

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
    let grouped: Vec<ScenarioRuns> = scenarios
        .iter()
        .zip(&per_scenario)
        .map(|(sc, runs)| ScenarioRuns::group(sc, &args.policies, runs))
        .collect();
    for g in &grouped {
        println!("\n## {}\n\n{}", g.scenario.id, scenario_table(g));
    }
    println!("{}", claims(&grouped));
    let gap = limit_gap(&grouped);
    if !gap.is_empty() {
        println!("### The default against the limit\n\n{gap}");
    }
    println!("total wall time {wall:.1} s");
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

struct RunMeta<'a> {
    scale: Scale,
    seeds: u64,
    workers: usize,
    wall_s: f64,
    filter: &'a Path,
    filter_bytes: usize,
}

fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let o = std::process::Command::new(cmd)
        .args(args)
        .current_dir(workspace_root())
        .output()
        .ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// The commit the results come from, with `-dirty` when tracked files differ from it.
fn commit() -> String {
    let head = command_output("git", &["rev-parse", "--short=12", "HEAD"]);
    let dirty = command_output("git", &["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|s| !s.is_empty());
    match head {
        Some(h) if dirty => format!("{h}-dirty"),
        Some(h) => h,
        None => "unknown".into(),
    }
}

fn mode_json(m: Mode) -> Value {
    match m {
        Mode::Closed { concurrency } => json!({"closed": {"concurrency": concurrency}}),
        Mode::Open => json!("open"),
    }
}

fn write_outputs(
    out: &Path,
    meta: &RunMeta,
    workloads: &[(Workload, Mode)],
    first_workload: &[usize],
    grouped: &[ScenarioRuns],
    policies: &[String],
) -> Result<(), String> {
    let dir = out.join("results");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // Paths under the workspace are written relative to it, so the report does not carry the
    // machine's checkout location.
    let root = format!("{}/", workspace_root().display());
    let relative = |text: &str| text.replace(&root, "");
    let write = |name: &str, text: &str| -> Result<(), String> {
        let p = dir.join(name);
        std::fs::write(&p, relative(text)).map_err(|e| format!("{}: {e}", p.display()))
    };
    let commit = commit();
    let date = command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default();

    // Machine-readable results.
    let scen_json: Vec<Value> = grouped
        .iter()
        .zip(first_workload)
        .map(|(g, wi)| {
            let sc = g.scenario;
            json!({"id": sc.id, "group": sc.group, "source": format!("{:?}", sc.source),
                   "proxies": sc.proxies, "spread": format!("{:?}", sc.spread),
                   "endpoints": sc.endpoints, "dp_ranks": sc.dp_ranks,
                   "pd_prefill": sc.pd_prefill, "fleet": sc.fleet(),
                   "workload": wi})
        })
        .collect();
    let workloads_json: Vec<Value> = workloads
        .iter()
        .map(|(w, m)| {
            let st = w.stats();
            json!({
                "name": w.name, "params": w.params, "block_size": w.block_size,
                "mode": mode_json(*m), "sessions": st.sessions, "requests": st.requests,
                "notes": w.notes,
            })
        })
        .collect();
    let runs_json: Vec<Value> = grouped
        .iter()
        .flat_map(|g| {
            g.cells.iter().flat_map(move |c| {
                c.runs.iter().map(move |o| {
                    json!({
                        "scenario": g.scenario.id, "policy": o.policy, "seed": o.seed,
                        "router_seed": ROUTER_SEED.wrapping_add(o.seed),
                        "summary": o.summary, "harness": o.harness_json(),
                        "wall_s": o.wall_s, "virtual_s": o.virtual_s,
                    })
                })
            })
        })
        .collect();
    let engine = Scenario::engine(16, 0);
    let doc = json!({
        "generated": date,
        "commit": commit,
        "scale": meta.scale.name(),
        "seeds": meta.seeds,
        "policies": policies,
        // The matrix's fleet; a scenario with another (DP ranks, P/D roles) says so in its `fleet`.
        "replicas": 4,
        "proxy_workers": meta.workers,
        "engine": {
            "profile": engine.profile.name, "kv_tokens": engine.kv_blocks as u64 * 16,
            "max_batch_tokens": engine.max_batch_tokens, "max_running": engine.max_running,
            "max_model_len": engine.max_model_len,
        },
        "filter": {"path": report_path(meta.filter), "bytes": meta.filter_bytes},
        "wall_s": meta.wall_s,
        "scenarios": scen_json,
        "workloads": workloads_json,
        "runs": runs_json,
    });
    write(
        "harness.json",
        &serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?,
    )?;

    // Plots.
    for g in grouped {
        let decode: &[&str] = match g.scenario.group {
            "rl" => &POLICIES,
            "weka" => &["session_hash", "kv_load"],
            _ => &[],
        };
        for (name, svg) in scenario_plots(g, decode) {
            write(&name, &svg)?;
        }
    }
    let rl: Vec<&ScenarioRuns> = grouped
        .iter()
        .filter(|g| g.scenario.group == "rl")
        .collect();
    if !rl.is_empty() {
        write("rl_hit_vs_cv.svg", &hit_cv_plot(&rl, &POLICIES, false))?;
    }
    let weka: Vec<&ScenarioRuns> = grouped
        .iter()
        .filter(|g| g.scenario.group == "weka")
        .collect();
    if !weka.is_empty() {
        write(
            "weka_hit_vs_cv.svg",
            &hit_cv_plot(&weka, &["session_hash", "kv_load"], true),
        )?;
    }

    // The report.
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Results: routing quality by policy, workload and concurrency\n\n\
         Generated by `scripts/bench{}` on {date} from commit `{commit}` ({} seeds, wall time \
         {:.0} s). Do not edit by hand: the analysis is in `docs/reports/results/notes.md` and is \
         included below; every figure comes from `docs/reports/results/harness.json`.\n",
        match meta.scale {
            Scale::Full => "",
            Scale::Quick => " --quick",
            Scale::Smoke => " --smoke",
        },
        meta.seeds,
        meta.wall_s
    );
    md.push_str(HOW_TO_READ);
    let _ = writeln!(
        md,
        "## Setup\n\n4 identical simulated replicas ({}, {} KV tokens each, at most {} batched tokens \
         a step), {} proxy worker VMs running `kvsteer_filter.wasm` ({} KB) in the wasmtime \
         harness, virtual time. The engines' KV block size and the filter's `routing.block_size` \
         follow each workload (16 for RL and Azure, 64 for the coding-agent trace, 512 for \
         Mooncake); the KV memory is the same at every block size. Seed `s` sets the engines' seeds, \
         the router's tie-break seed (`routing.seed` = default + s), for RL every token and for \
         the coding-agent trace every think time (each drawn within 20% of the recorded one, so \
         every policy gets independent draws); the traces' structure does not depend on it.\n",
        engine.profile.name,
        engine.kv_blocks as u64 * 16,
        engine.max_batch_tokens,
        meta.workers,
        meta.filter_bytes / 1024
    );
    md.push_str("| scenario | workload | requests | sessions | driven | notes |\n|---|---|---:|---:|---|---|\n");
    for (g, &wi) in grouped.iter().zip(first_workload) {
        let (w, m) = &workloads[wi];
        let st = w.stats();
        let notes: Vec<String> = w.notes.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        let _ = writeln!(
            md,
            "| `{}` | {} ({}) | {} | {} | {} | {} |",
            g.scenario.id,
            w.name,
            w.params
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", "),
            st.requests,
            st.sessions,
            match m {
                Mode::Closed { concurrency } => format!("closed loop, {concurrency} in flight"),
                Mode::Open => "open loop, trace arrival times".into(),
            },
            notes.join("; ")
        );
    }
    md.push_str("\n## The published claims, checked\n\n");
    md.push_str(&claims(grouped));
    let gap = limit_gap(grouped);
    if !gap.is_empty() {
        md.push_str("## The default against the limit (the oracle)\n\n");
        md.push_str(&gap);
        md.push('\n');
    }
    let notes_path = dir.join("notes.md");
    if let Ok(notes) = std::fs::read_to_string(&notes_path) {
        md.push_str("## Analysis\n\n");
        md.push_str(&notes);
        md.push('\n');
    }
    for (group, title) in [
        ("rl", "RL rollouts with stragglers"),
        (
            "weka",
            "Coding-agent traces (weka_cc_sample36; each seed draws every think time within 20% \
             of the recorded one)",
        ),
        (
            "weka-fixed",
            "Coding-agent traces on the recorded timing (a seed changes tie-breaks only)",
        ),
        (
            "mooncake",
            "Mooncake (each seed draws every gap between arrivals within 20% of the recorded one)",
        ),
        (
            "mooncake-fixed",
            "Mooncake on the recorded arrival times (a seed changes tie-breaks only)",
        ),
        (
            "azure",
            "Azure conversations (no-reuse control; each seed draws every gap between arrivals \
             within 20% of the recorded one)",
        ),
        (
            "azure-fixed",
            "Azure conversations on the recorded arrival times (a seed changes tie-breaks only)",
        ),
        ("slice", "The Envoy slice, in the harness"),
        (
            "dp",
            "Data-parallel fleet: 2 endpoints x 4 ranks (docs/design/dp.md; `@rank_blind`: the router \
             sees endpoints, vLLM's internal balancer picks the rank)",
        ),
        (
            "pd",
            "P/D fleet: 2 prefill + 4 decode engines (docs/design/pd.md; through the filter's two-leg \
             path, one worker VM; the hit rate is the prefill side's)",
        ),
        (
            "pd-shape",
            "P/D fleet split 3 prefill + 3 decode (docs/design/pd.md)",
        ),
    ] {
        let gs: Vec<&ScenarioRuns> = grouped
            .iter()
            .filter(|g| g.scenario.group == group)
            .collect();
        if gs.is_empty() {
            continue;
        }
        let _ = writeln!(md, "## {title}\n");
        for g in &gs {
            let _ = writeln!(
                md,
                "### `{}`\n\n{}\n![TTFT CDF, {}](results/{}_ttft_cdf.svg)\n",
                g.scenario.id,
                scenario_table(g),
                g.scenario.id,
                g.scenario.id
            );
        }
        match group {
            "rl" => {
                md.push_str(
                    "Hit rate against decode-block CV, and each policy's per-replica decode load \
                     (seed 0): herding shows as one replica far above the others, straggler \
                     collisions as two 8,192-token tails on the same replica.\n\n\
                     ![hit rate vs CV](results/rl_hit_vs_cv.svg)\n\n",
                );
                for p in POLICIES {
                    if gs.iter().any(|g| g.cell(p).is_some()) {
                        let _ = writeln!(md, "![decode load, {p}](results/rl_decode_{p}.svg)");
                    }
                }
                md.push('\n');
            }
            "weka" => {
                md.push_str(
                    "Hit rate against decode-block CV across concurrency (kv_load and \
                     session_hash, medians over seeds):\n\n\
                     ![hit rate vs CV across concurrency](results/weka_hit_vs_cv.svg)\n\n",
                );
                if let Some(last) = gs.last() {
                    for p in ["session_hash", "kv_load"] {
                        if last.cell(p).is_some() {
                            let _ = writeln!(
                                md,
                                "![decode load, {p}, {id}](results/{id}_decode_{p}.svg)",
                                id = last.scenario.id
                            );
                        }
                    }
                }
                md.push('\n');
            }
            _ => {}
        }
    }
    if let Ok(envoy) = std::fs::read_to_string(dir.join("envoy.md")) {
        md.push_str(&envoy);
        md.push('\n');
    }
    std::fs::write(out.join("results.md"), relative(&md))
        .map_err(|e| format!("{}: {e}", out.join("results.md").display()))
}

const HOW_TO_READ: &str = "## How to read this\n\n\
- Each table is one workload configuration; each row one routing policy of the filter. Cells are \
  the **median over seeds**; where seeds disagree at the shown precision, `(min-max)` follows.\n\
- **TTFT** is time to first token, **TPOT** time per output token after the first, **e2e** a \
  request's end-to-end time, **rollout / session p99** the 99th percentile of a whole session \
  (RL: a rollout's 10 turns, the RL headline). **output tok/s** is all generated tokens over the \
  run's span. **hit rate** is engine-reported cached prompt tokens over prompt tokens. **decode \
  CV** is the spread of KV blocks held by decoding requests across replicas (0: perfectly even; \
  docs/design/design.md section 7). Lower is better except tok/s and hit rate.\n\
- The `oracle` row of a table is **the limit, not a policy**: the harness places each request \
  itself, knowing every request's true output length and the simulated engines' exact state (queues, \
  remaining tokens, KV cache contents), which no router can know (docs/design/harness.md, \"The oracle\"). \
  It is left out wherever policies are ranked (the claims, the goals), and the section \"The default \
  against the limit\" gives `kv_load`'s distance to it.\n\
- A high hit rate is not the goal: a policy can hit the cache every time by sending everything to \
  one replica. The claims below are about trading hit rate for even decode load.\n\
- Everything runs in virtual time: the engines are a model of vLLM on an H100 \
  (`docs/design/simulator.md`), the filter is the real `.wasm`. Absolute figures are the model's; the \
  comparison between policies is the point.\n\
- Commands: `scripts/bench` (everything: the Envoy slice 3 times per configuration, this full \
  matrix with 3 seeds and every trace whole, then the sensitivity runs in `docs/reports/sensitivity/`; \
  about 45 minutes on 2 cores, of which the matrix is about 25), `scripts/bench --quick` \
  (minutes, writes `out/bench-quick/`), `scripts/bench --smoke` (seconds, the CI check), \
  `scripts/bench-envoy-slice` (the Envoy slice alone). `--only` and `--policies` run part of the \
  matrix and skip the Envoy slice and the sensitivity runs unless `--envoy` / `--sensitivity` ask \
  for them; `scripts/bench` lists what it runs and skips, and why, before and after. \
  `target/release/bench ... --rows DIR` also writes every replay's requests (replica, issue, first \
  token and end times, prompt and cached tokens) as `DIR/<scenario>_<policy>_s<seed>.csv`.\n\n";

/// The smoke check: the JSON parses, has every replay with requests and no failures, every summary is
/// well-formed, the report has a table per scenario and the plots are SVG.
fn check_outputs(out: &Path, expected_runs: usize) -> Result<(), String> {
    let dir = out.join("results");
    let text = std::fs::read_to_string(dir.join("harness.json")).map_err(|e| e.to_string())?;
    let doc: Value = serde_json::from_str(&text).map_err(|e| format!("harness.json: {e}"))?;
    let runs = doc["runs"].as_array().ok_or("harness.json: no runs")?;
    if runs.len() != expected_runs {
        return Err(format!(
            "harness.json has {} runs, expected {expected_runs}",
            runs.len()
        ));
    }
    if doc["commit"].as_str().is_none_or(str::is_empty) {
        return Err("harness.json: no commit".into());
    }
    for r in runs {
        let s: Summary = serde_json::from_value(r["summary"].clone())
            .map_err(|e| format!("a run's summary does not parse: {e}"))?;
        let what = format!("{} {} seed {}", r["scenario"], r["policy"], r["seed"]);
        if s.requests == 0 || s.failed > 0 || s.open > 0 {
            return Err(format!(
                "{what}: {} finished, {} failed, {} open",
                s.requests, s.failed, s.open
            ));
        }
        let plausible = (0.0..=1.0).contains(&s.hit_rate)
            && s.ttft_ms.p50 > 0.0
            && s.ttft_ms.p50 <= s.ttft_ms.p99
            && s.output_tokens_per_s > 0.0;
        if !plausible {
            return Err(format!("{what}: implausible summary {s:?}"));
        }
    }
    let md = std::fs::read_to_string(out.join("results.md")).map_err(|e| e.to_string())?;
    let tables = md.matches("| policy | TTFT p50 / p90 ms").count();
    let scenarios = doc["scenarios"].as_array().map_or(0, Vec::len);
    if tables != scenarios || scenarios == 0 {
        return Err(format!(
            "results.md has {tables} tables for {scenarios} scenarios"
        ));
    }
    let mut svgs = 0;
    for e in std::fs::read_dir(&dir).map_err(|e| e.to_string())? {
        let p = e.map_err(|e| e.to_string())?.path();
        if p.extension().is_some_and(|x| x == "svg") {
            let t = std::fs::read_to_string(&p).map_err(|e| e.to_string())?;
            if !(t.starts_with("<svg") && t.trim_end().ends_with("</svg>")) {
                return Err(format!("{} is not a complete SVG", p.display()));
            }
            svgs += 1;
        }
    }
    for l in md.lines().filter(|l| l.starts_with("![")) {
        let Some(target) = l.split("](").nth(1).and_then(|t| t.strip_suffix(')')) else {
            continue;
        };
        if !out.join(target).is_file() {
            return Err(format!("results.md links a missing plot {target}"));
        }
    }
    if svgs < scenarios {
        return Err(format!("{svgs} SVG plots for {scenarios} scenarios"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::splice_notes;

    #[test]
    fn notes_replace_only_the_analysis_body() {
        let md = "# R\n\n## Claims\n\nc\n## Analysis\n\nold\n### x\nold too\n\n## RL\n\ntable\n";
        let out = splice_notes(md, "new\n### y\n").unwrap();
        assert_eq!(
            out,
            "# R\n\n## Claims\n\nc\n## Analysis\n\nnew\n### y\n\n## RL\n\ntable\n"
        );
        assert_eq!(splice_notes("# no analysis\n", "n"), None);
        // At the end of the report.
        assert_eq!(
            splice_notes("## Analysis\n\nold\n", "new\n").unwrap(),
            "## Analysis\n\nnew\n\n"
        );
    }
}
