//! What a bench run writes: `results/harness.json` (configuration, seeds, commit, every run's
//! summary), the SVG plots under `results/`, `results.md` (the report: setup, the claims checked,
//! a link to the analysis in `results/notes.md`, a section per scenario group), and the smoke check of them.

use kvsteer_host_test::artifact::{report_path, workspace_root};
use kvsteer_lab::bench::args::POLICIES;
use kvsteer_lab::bench::report::{
    ScenarioRuns, claims, default_policy, hit_cv_plot, limit_gap, scenario_plots, scenario_table,
};
use kvsteer_lab::bench::run::ROUTER_SEED;
use kvsteer_lab::bench::scenario::{Scale, Scenario};
use kvsteer_workload::{Mode, Summary, Workload};
use serde_json::{Value, json};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// What the report says about the run itself.
pub(crate) struct RunMeta<'a> {
    pub(crate) scale: Scale,
    pub(crate) seeds: u64,
    pub(crate) workers: usize,
    pub(crate) wall_s: f64,
    pub(crate) filter: &'a Path,
    pub(crate) filter_bytes: usize,
}

/// A command's trimmed stdout, run in the workspace; `None` when it fails.
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

/// How a workload was driven, for harness.json.
fn mode_json(m: Mode) -> Value {
    match m {
        Mode::Closed { concurrency } => json!({"closed": {"concurrency": concurrency}}),
        Mode::Open => json!("open"),
    }
}

/// Writes into a run's `results/` folder, with paths under the workspace made relative to it so
/// the report does not carry the machine's checkout location.
struct Writer {
    dir: PathBuf,
    root: String,
}

impl Writer {
    fn relative(&self, text: &str) -> String {
        text.replace(&self.root, "")
    }

    fn write(&self, name: &str, text: &str) -> Result<(), String> {
        let p = self.dir.join(name);
        std::fs::write(&p, self.relative(text)).map_err(|e| format!("{}: {e}", p.display()))
    }
}

/// Writes harness.json, the plots and results.md under `out`.
pub(crate) fn write_outputs(
    out: &Path,
    meta: &RunMeta,
    workloads: &[(Workload, Mode)],
    first_workload: &[usize],
    grouped: &[ScenarioRuns],
    policies: &[String],
) -> Result<(), String> {
    let dir = out.join("results");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let w = Writer {
        dir,
        root: format!("{}/", workspace_root().display()),
    };
    let commit = commit();
    let date = command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]).unwrap_or_default();
    let doc = harness_json(
        meta,
        workloads,
        first_workload,
        grouped,
        policies,
        &date,
        &commit,
    );
    w.write(
        "harness.json",
        &serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?,
    )?;
    write_plots(&w, grouped)?;
    let md = report_markdown(
        meta,
        workloads,
        first_workload,
        grouped,
        &w.dir,
        &date,
        &commit,
    );
    std::fs::write(out.join("results.md"), w.relative(&md))
        .map_err(|e| format!("{}: {e}", out.join("results.md").display()))
}

/// The machine-readable results: configuration, workloads, every run's summary.
fn harness_json(
    meta: &RunMeta,
    workloads: &[(Workload, Mode)],
    first_workload: &[usize],
    grouped: &[ScenarioRuns],
    policies: &[String],
    date: &str,
    commit: &str,
) -> Value {
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
    json!({
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
    })
}

/// The TTFT CDFs and decode-load plots of each scenario, and the hit-rate-against-CV plots.
fn write_plots(w: &Writer, grouped: &[ScenarioRuns]) -> Result<(), String> {
    let against = ["session_hash", default_policy()];
    for g in grouped {
        let decode: &[&str] = match g.scenario.group {
            "rl" => &POLICIES,
            "weka" => &against,
            _ => &[],
        };
        for (name, svg) in scenario_plots(g, decode) {
            w.write(&name, &svg)?;
        }
    }
    let rl: Vec<&ScenarioRuns> = grouped
        .iter()
        .filter(|g| g.scenario.group == "rl")
        .collect();
    if !rl.is_empty() {
        w.write("rl_hit_vs_cv.svg", &hit_cv_plot(&rl, &POLICIES, false))?;
    }
    let weka: Vec<&ScenarioRuns> = grouped
        .iter()
        .filter(|g| g.scenario.group == "weka")
        .collect();
    if !weka.is_empty() {
        w.write("weka_hit_vs_cv.svg", &hit_cv_plot(&weka, &against, true))?;
    }
    Ok(())
}

/// The report's pointer to its analysis: `results/notes.md` is written by hand after looking at a
/// run and is long, so the report links it with its sections listed instead of carrying it (a
/// reader finds the figures here and the reasoning there).
pub(crate) fn analysis_section(notes: &str) -> String {
    let mut md = String::from(
        "## Analysis\n\nWritten by hand after looking at a run, in \
         [results/notes.md](results/notes.md):\n\n",
    );
    for title in notes.lines().filter_map(|l| l.strip_prefix("## ")) {
        let _ = writeln!(md, "- {}", title.trim());
    }
    md.push('\n');
    md
}

/// The report's Markdown: title, how to read it, setup, the claims checked, the analysis's link
/// (`results/notes.md` in `dir`), a section per scenario group, and the Envoy slice when present.
fn report_markdown(
    meta: &RunMeta,
    workloads: &[(Workload, Mode)],
    first_workload: &[usize],
    grouped: &[ScenarioRuns],
    dir: &Path,
    date: &str,
    commit: &str,
) -> String {
    let engine = Scenario::engine(16, 0);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Results: routing quality by policy, workload and concurrency\n\n\
         Generated by `scripts/bench{}` on {date} from commit `{commit}` ({} seeds, wall time \
         {:.0} s). Do not edit by hand: the analysis is in `docs/reports/results/notes.md` (linked \
         below); every figure comes from `docs/reports/results/harness.json`.\n",
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
    scenario_list(&mut md, workloads, first_workload, grouped);
    md.push_str("\n## The published claims, checked\n\n");
    md.push_str(&claims(grouped));
    let gap = limit_gap(grouped);
    if !gap.is_empty() {
        md.push_str("## The default against the limit (the oracle)\n\n");
        md.push_str(&gap);
        md.push('\n');
    }
    if let Ok(notes) = std::fs::read_to_string(dir.join("notes.md")) {
        md.push_str(&analysis_section(&notes));
    }
    for (group, title) in GROUPS {
        group_section(&mut md, grouped, group, title);
    }
    if let Ok(envoy) = std::fs::read_to_string(dir.join("envoy.md")) {
        md.push_str(&envoy);
        md.push('\n');
    }
    md
}

/// The setup's list of scenarios: each one's workload, size and how it is driven.
fn scenario_list(
    md: &mut String,
    workloads: &[(Workload, Mode)],
    first_workload: &[usize],
    grouped: &[ScenarioRuns],
) {
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
}

/// The report's scenario groups, in order, with their section titles.
const GROUPS: [(&str, &str); 11] = [
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
];

/// One group's section: each scenario's table and TTFT CDF, and the group's own plots.
fn group_section(md: &mut String, grouped: &[ScenarioRuns], group: &str, title: &str) {
    let gs: Vec<&ScenarioRuns> = grouped
        .iter()
        .filter(|g| g.scenario.group == group)
        .collect();
    if gs.is_empty() {
        return;
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
            let _ = write!(
                md,
                "Hit rate against decode-block CV across concurrency ({} and \
                 session_hash, medians over seeds):\n\n\
                 ![hit rate vs CV across concurrency](results/weka_hit_vs_cv.svg)\n\n",
                default_policy()
            );
            if let Some(last) = gs.last() {
                for p in ["session_hash", default_policy()] {
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
  against the limit\" gives the default policy's distance to it.\n\
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
pub(crate) fn check_outputs(out: &Path, expected_runs: usize) -> Result<(), String> {
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
    use super::analysis_section;

    #[test]
    fn the_analysis_is_linked_with_its_sections_listed() {
        let notes = "# The analysis\n\n## Choices\n\ntext\n### detail\n## Reading the results \n";
        assert_eq!(
            analysis_section(notes),
            "## Analysis\n\nWritten by hand after looking at a run, in \
             [results/notes.md](results/notes.md):\n\n- Choices\n- Reading the results\n\n"
        );
    }
}
