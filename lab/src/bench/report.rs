//! The benchmark report: per-scenario tables over seeds (median with min-max), the published claims
//! checked against the measurements, plots, and the machine-readable results.
//!
//! Everything here is computed from the runs; the hand-written analysis lives in
//! `results/notes.md` and is included verbatim, so regenerating never loses it (its figures may go
//! stale, which is why the claim checks are recomputed on every run).

use super::run::{Outcome, is_oracle};
use super::scenario::Scenario;
use kvsteer_host_test::oracle::ORACLE_NOTE;
use kvsteer_workload::Summary;
use kvsteer_workload::report::{decode_load_svg, hit_cv_scatter_svg, ttft_cdf_svg};
use std::fmt::Write as _;

/// Every run of one (scenario, policy) pair, one per seed.
pub struct Cell<'a> {
    pub policy: &'a str,
    pub runs: Vec<&'a Outcome>,
}

/// The runs of one scenario, grouped by policy in the order policies were given.
pub struct ScenarioRuns<'a> {
    pub scenario: &'a Scenario,
    pub cells: Vec<Cell<'a>>,
}

impl<'a> ScenarioRuns<'a> {
    pub fn group(scenario: &'a Scenario, policies: &'a [String], runs: &'a [Outcome]) -> Self {
        let cells = policies
            .iter()
            .map(|p| Cell {
                policy: p.as_str(),
                runs: runs.iter().filter(|o| &o.policy == p).collect(),
            })
            .filter(|c| !c.runs.is_empty())
            .collect();
        ScenarioRuns { scenario, cells }
    }

    pub fn cell(&self, policy: &str) -> Option<&Cell<'a>> {
        self.cells.iter().find(|c| c.policy == policy)
    }

    /// The policies a user could deploy: every cell but the oracle's (the limit is never ranked
    /// among them).
    pub fn deployable(&self) -> impl Iterator<Item = &Cell<'a>> {
        self.cells.iter().filter(|c| !is_oracle(c.policy))
    }

    /// The oracle's cell: `oracle` itself, else the first oracle variant run.
    pub fn oracle(&self) -> Option<&Cell<'a>> {
        self.cell(kvsteer_host_test::oracle::ORACLE)
            .or_else(|| self.cells.iter().find(|c| is_oracle(c.policy)))
    }
}

/// A policy as a table row names it: the oracle's rows say that they are the limit.
pub fn row_label(policy: &str) -> String {
    if is_oracle(policy) {
        format!("{policy} ({ORACLE_NOTE})")
    } else {
        policy.to_string()
    }
}

/// Minimum, median (lower middle for an even count) and maximum over seeds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Spread {
    pub min: f64,
    pub median: f64,
    pub max: f64,
}

impl Cell<'_> {
    pub fn spread(&self, f: impl Fn(&Summary) -> f64) -> Spread {
        let mut v: Vec<f64> = self.runs.iter().map(|o| f(&o.summary)).collect();
        v.sort_by(f64::total_cmp);
        if v.is_empty() {
            return Spread {
                min: f64::NAN,
                median: f64::NAN,
                max: f64::NAN,
            };
        }
        Spread {
            min: v[0],
            median: v[(v.len() - 1) / 2],
            max: v[v.len() - 1],
        }
    }

    pub fn median(&self, f: impl Fn(&Summary) -> f64) -> f64 {
        self.spread(f).median
    }
}

/// `median (min-max)`, or just the median when every seed agrees at this precision.
fn show(s: Spread, decimals: usize) -> String {
    let m = format!("{:.*}", decimals, s.median);
    let lo = format!("{:.*}", decimals, s.min);
    let hi = format!("{:.*}", decimals, s.max);
    if lo == hi {
        m
    } else {
        format!("{m} ({lo}-{hi})")
    }
}

/// The least and the most requests any of the fleet's `units` replicas was sent over a run (a
/// replica sent none counts 0): a policy that leaves a replica idle shows it here.
fn requests_per_replica(s: &Summary, units: usize) -> (f64, f64) {
    let got = |r: usize| s.requests_per_replica.get(r).copied().unwrap_or(0) as f64;
    let n = units.max(s.requests_per_replica.len());
    let counts = (0..n).map(got);
    let min = counts.clone().fold(f64::INFINITY, f64::min);
    let max = counts.fold(0.0, f64::max);
    (if min.is_finite() { min } else { 0.0 }, max)
}

fn cv(s: &Summary) -> f64 {
    s.decode_cv.unwrap_or(f64::NAN)
}

/// The per-scenario table: one row per policy, medians over seeds, ranges on the headline columns.
pub fn scenario_table(sr: &ScenarioRuns) -> String {
    let rl = matches!(sr.scenario.source, crate::bench::scenario::Source::Rl(_));
    let session_col = if rl { "rollout p99 s" } else { "session p99 s" };
    let mut s = format!(
        "| policy | TTFT p50 / p90 ms | TTFT p99 ms | TPOT p50 / p90 ms | TPOT p99 ms | e2e p50 / p99 s \
         | {session_col} | output tok/s | hit rate % | decode CV | requests per replica min / max | failed |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    let units = sr.scenario.endpoints * sr.scenario.dp_ranks.max(1);
    for c in &sr.cells {
        let _ = writeln!(
            s,
            "| {} | {:.0} / {:.0} | {} | {:.1} / {:.1} | {} | {:.1} / {:.1} | {} | {} | {} | {} | {:.0} / {:.0} | {} |",
            row_label(c.policy),
            c.median(|m| m.ttft_ms.p50),
            c.median(|m| m.ttft_ms.p90),
            show(c.spread(|m| m.ttft_ms.p99), 0),
            c.median(|m| m.tpot_ms.p50),
            c.median(|m| m.tpot_ms.p90),
            show(c.spread(|m| m.tpot_ms.p99), 1),
            c.median(|m| m.e2e_ms.p50) / 1e3,
            c.median(|m| m.e2e_ms.p99) / 1e3,
            show(c.spread(|m| m.session_e2e_s.p99), 1),
            show(c.spread(|m| m.output_tokens_per_s), 0),
            show(c.spread(|m| m.hit_rate * 100.0), 1),
            show(c.spread(cv), 3),
            c.median(|m| requests_per_replica(m, units).0),
            c.median(|m| requests_per_replica(m, units).1),
            c.runs.iter().map(|o| o.summary.failed).max().unwrap_or(0),
        );
    }
    if sr.oracle().is_some() {
        s.push_str(
            "\nThe oracle row is the limit, not a policy: the harness places each request itself, \
             knowing every request's true output length and the simulated engines' exact state \
             (queues, remaining tokens, KV cache contents), greedily, one request at a time \
             (docs/design/harness.md, \"The oracle\"). No router can know either; it is left out wherever \
             policies are ranked.\n",
        );
    }
    s
}

/// The policy the claims and the distance to the limit are about: the default, whichever it is
/// when the report is generated.
pub fn default_policy() -> &'static str {
    kvsteer_core::PolicyKind::default().name()
}

/// Better-or-worse verdict text.
fn mark(ok: bool) -> &'static str {
    if ok { "yes" } else { "**no**" }
}

/// The published claims, checked on the medians. Returns markdown.
pub fn claims(all: &[ScenarioRuns]) -> String {
    let mut s = String::new();
    if let Some(rl) = all.iter().find(|r| r.scenario.group == "rl") {
        rl_claims(&mut s, rl);
    }
    let weka: Vec<&ScenarioRuns> = all.iter().filter(|r| r.scenario.group == "weka").collect();
    if !weka.is_empty() {
        weka_claims(&mut s, &weka);
    }
    for r in all.iter().filter(|r| r.scenario.group == "azure") {
        control_claims(&mut s, r);
    }
    s
}

/// The RL straggler claims: the default policy has the best rollout p99 despite a lower hit rate than
/// `session_hash`, and over every seed.
fn rl_claims(s: &mut String, rl: &ScenarioRuns) {
    let d = default_policy();
    let _ = writeln!(s, "### RL stragglers (`{}`)\n", rl.scenario.id);
    let best = rl
        .deployable()
        .map(|c| (c.policy, c.median(|m| m.session_e2e_s.p99)))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    if let (Some((bp, bv)), Some(kv), Some(sh)) = (best, rl.cell(d), rl.cell("session_hash")) {
        let kv_p99 = kv.median(|m| m.session_e2e_s.p99);
        let (kv_hit, sh_hit) = (kv.median(|m| m.hit_rate), sh.median(|m| m.hit_rate));
        let _ = writeln!(
            s,
            "| claim | measured (median over seeds) | holds |\n|---|---|---|\n\
             | `{d}` has the best p99 rollout latency | {d} {kv_p99:.1} s; best is {bp} {bv:.1} s | {} |\n\
             | ... despite a lower hit rate than `session_hash` | {d} {:.1}% vs session_hash {:.1}% | {} |\n",
            mark(bp == d),
            kv_hit * 100.0,
            sh_hit * 100.0,
            mark(kv_hit < sh_hit),
        );
        let kv_max = kv.spread(|m| m.session_e2e_s.p99).max;
        let others_min = rl
            .deployable()
            .filter(|c| c.policy != d)
            .map(|c| c.spread(|m| m.session_e2e_s.p99).min)
            .fold(f64::INFINITY, f64::min);
        let _ = writeln!(
            s,
            "Over every seed: {d}'s worst rollout p99 is {kv_max:.1} s, the best any other \
             policy reached on any seed is {others_min:.1} s ({}).\n",
            if kv_max < others_min {
                format!("{d} wins on every seed")
            } else {
                "the ranges overlap".to_string()
            }
        );
    }
}

/// The coding-agent traces: the default policy over `session_hash` per concurrency.
fn weka_claims(s: &mut String, weka: &[&ScenarioRuns]) {
    let d = default_policy();
    let _ = writeln!(
        s,
        "### Coding-agent traces: `{d}` against `session_hash` by concurrency\n\n\
         Ratios are {d} / session_hash (medians over seeds); below 1 is better for latency, \
         above 1 for throughput.\n\n\
         | sessions in flight | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | output tok/s | hit rate {d} / session_hash | decode CV {d} / session_hash | {d} better on TTFT, TPOT and tok/s |\n\
         |---:|---:|---:|---:|---:|---:|---:|---:|---|"
    );
    for r in weka {
        let (Some(kv), Some(sh)) = (r.cell(d), r.cell("session_hash")) else {
            continue;
        };
        let ratio = |f: &dyn Fn(&Summary) -> f64| kv.median(f) / sh.median(f);
        let (t50, t99) = (ratio(&|m| m.ttft_ms.p50), ratio(&|m| m.ttft_ms.p99));
        let (p50, p99) = (ratio(&|m| m.tpot_ms.p50), ratio(&|m| m.tpot_ms.p99));
        let tput = ratio(&|m| m.output_tokens_per_s);
        let level = r.scenario.id.trim_start_matches("weka-c");
        let _ = writeln!(
            s,
            "| {level} | {t50:.2} | {t99:.2} | {p50:.2} | {p99:.2} | {tput:.2} | {:.1}% / {:.1}% | {:.3} / {:.3} | {} |",
            kv.median(|m| m.hit_rate) * 100.0,
            sh.median(|m| m.hit_rate) * 100.0,
            kv.median(cv),
            sh.median(cv),
            mark(t50 < 1.0 && p50 < 1.0 && tput > 1.0),
        );
    }
    s.push('\n');
}

/// The no-reuse control: cache-aware policies against the best load-only one on TTFT p99.
fn control_claims(s: &mut String, r: &ScenarioRuns) {
    let _ = writeln!(
        s,
        "### No-reuse control (`{}`): cache-aware must not lose to load-only\n\n\
         | policy | TTFT p99 ms | e2e p99 s | output tok/s | vs best load-only (least_load, round_robin) on TTFT p99 |\n\
         |---|---:|---:|---:|---|",
        r.scenario.id
    );
    let load_only = ["least_load", "round_robin"];
    let best_lo = r
        .cells
        .iter()
        .filter(|c| load_only.contains(&c.policy))
        .map(|c| c.median(|m| m.ttft_ms.p99))
        .fold(f64::INFINITY, f64::min);
    for c in r.cells.iter() {
        let t = c.median(|m| m.ttft_ms.p99);
        let verdict = if load_only.contains(&c.policy) {
            "(load-only)".to_string()
        } else if !best_lo.is_finite() {
            "-".to_string()
        } else {
            format!("{:+.1}%", (t / best_lo - 1.0) * 100.0)
        };
        let _ = writeln!(
            s,
            "| {} | {:.0} | {:.1} | {:.0} | {} |",
            row_label(c.policy),
            t,
            c.median(|m| m.e2e_ms.p99) / 1e3,
            c.median(|m| m.output_tokens_per_s),
            verdict
        );
    }
    s.push('\n');
}

/// The default policy against the limit: per scenario, the default policy's figures beside the oracle's on
/// TTFT p50 and p99, TPOT p99, output tokens a second and the rollout (RL) or session p99 (medians
/// over seeds), their ratio, and the
/// best deployable policy on each, so the report says how much room routing has left and where.
/// Generated, never hand-written: the figures change with every run. Empty when no scenario ran both.
pub fn limit_gap(all: &[ScenarioRuns]) -> String {
    let d = default_policy();
    type Metric = (&'static str, fn(&Summary) -> f64, bool, usize);
    const METRICS: [Metric; 5] = [
        ("TTFT p50 ms", |m| m.ttft_ms.p50, true, 0),
        ("TTFT p99 ms", |m| m.ttft_ms.p99, true, 0),
        ("TPOT p99 ms", |m| m.tpot_ms.p99, true, 1),
        ("output tok/s", |m| m.output_tokens_per_s, false, 0),
        ("rollout / session p99 s", |m| m.session_e2e_s.p99, true, 1),
    ];
    let mut rows = String::new();
    let mut beaten = Vec::new();
    for r in all {
        let (Some(kv), Some(or)) = (r.cell(d), r.oracle()) else {
            continue;
        };
        let mut cols = Vec::new();
        for (name, f, lower_better, d) in METRICS {
            let (k, o) = (kv.median(f), or.median(f));
            let best = r
                .deployable()
                .map(|c| (c.policy, c.median(f)))
                .filter(|(_, v)| v.is_finite())
                .min_by(|a, b| {
                    if lower_better {
                        a.1.total_cmp(&b.1)
                    } else {
                        b.1.total_cmp(&a.1)
                    }
                });
            let best = best.map_or("-".into(), |(p, v)| format!("{p} {v:.d$}"));
            let ratio = k / o;
            cols.push(format!("{k:.d$} / {o:.d$} = {ratio:.2}x; best {best}"));
            // Beaten when the shown ratio says so (a tie at 1.00x is not listed).
            if (lower_better && ratio < 0.995) || (!lower_better && ratio > 1.005) {
                beaten.push(format!("`{}` {name}", r.scenario.id));
            }
        }
        let _ = writeln!(rows, "| `{}` | {} |", r.scenario.id, cols.join(" | "));
    }
    if rows.is_empty() {
        return String::new();
    }
    let mut s = format!(
        "How far the default is from the limit: `{d}` / `oracle` (medians over seeds) and their \
         ratio (above 1 on latency, below 1 on tok/s: the distance left to the limit; the other way: \
         `{d}` did better than the oracle), then the best deployable policy on that figure. The \
         oracle knows every request's true output \
         length and the engines' exact state and places greedily, one request at a time, by its own \
         time to first token and the stall its prefill puts on others; it is a reference point, not \
         an optimum: it does not know what arrives next, and a policy that keeps room for later \
         requests can beat it.\n\n\
         | scenario | TTFT p50 ms | TTFT p99 ms | TPOT p99 ms | output tok/s | rollout / session p99 s |\n\
         |---|---|---|---|---|---|\n",
    );
    s.push_str(&rows);
    if beaten.is_empty() {
        let _ = writeln!(
            s,
            "\nThe oracle is as good as `{d}` or better on every figure above (within 0.5%, the \
             shown ratio's rounding, counts as a tie)."
        );
    } else {
        let _ = writeln!(
            s,
            "\n`{d}` beats the greedy oracle on: {}.",
            beaten.join(", ")
        );
    }
    s
}

/// Averages consecutive bins so a plot has at most `max_points` points (hour-long runs have 7,200
/// half-second bins; drawn raw, one SVG would be megabytes).
pub fn downsample(series: &[(f64, Vec<f64>)], max_points: usize) -> Vec<(f64, Vec<f64>)> {
    let k = series.len().div_ceil(max_points.max(1)).max(1);
    series
        .chunks(k)
        .map(|ch| {
            let width = ch.iter().map(|x| x.1.len()).max().unwrap_or(0);
            let mut sums = vec![0.0; width];
            for (_, v) in ch {
                for (i, x) in v.iter().enumerate() {
                    sums[i] += x;
                }
            }
            let n = ch.len() as f64;
            (ch[0].0, sums.into_iter().map(|x| x / n).collect())
        })
        .collect()
}

/// The plots of one scenario: TTFT CDF (seeds pooled), and for chosen policies the first seed's
/// per-replica decode load. Returns (file name, SVG text) pairs.
pub fn scenario_plots(sr: &ScenarioRuns, decode_policies: &[&str]) -> Vec<(String, String)> {
    let id = &sr.scenario.id;
    let pooled: Vec<(&str, Vec<f64>)> = sr
        .cells
        .iter()
        .map(|c| {
            let v: Vec<f64> = c
                .runs
                .iter()
                .flat_map(|o| o.ttft_ms.iter().copied())
                .collect();
            (c.policy, v)
        })
        .collect();
    let series: Vec<(&str, &[f64])> = pooled.iter().map(|(p, v)| (*p, v.as_slice())).collect();
    let mut out = vec![(format!("{id}_ttft_cdf.svg"), ttft_cdf_svg(&series))];
    for c in &sr.cells {
        if !decode_policies.contains(&c.policy) {
            continue;
        }
        if let Some(o) = c.runs.iter().min_by_key(|o| o.seed) {
            let title = format!(
                "{id}, {}: KV blocks of decoding requests per replica (seed {})",
                c.policy, o.seed
            );
            out.push((
                format!("{id}_decode_{}.svg", c.policy),
                decode_load_svg(&title, &downsample(&o.decode_series, 600)),
            ));
        }
    }
    out
}

/// Hit rate against decode-block CV: one point per (scenario, policy) given, medians over seeds.
pub fn hit_cv_plot(all: &[&ScenarioRuns], policies: &[&str], label_scenario: bool) -> String {
    let mut labels = Vec::new();
    let mut vals = Vec::new();
    for r in all {
        for c in &r.cells {
            if !policies.contains(&c.policy) {
                continue;
            }
            labels.push(if label_scenario {
                format!("{} {}", c.policy, r.scenario.id)
            } else {
                c.policy.to_string()
            });
            vals.push((c.median(|m| m.hit_rate), c.median(cv)));
        }
    }
    let points: Vec<(&str, f64, f64)> = labels
        .iter()
        .zip(&vals)
        .map(|(l, (h, c))| (l.as_str(), *h, *c))
        .collect();
    hit_cv_scatter_svg(&points)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsteer_host_test::HarnessStats;

    fn outcome(policy: &str, seed: u64, ttft_p99: f64) -> Outcome {
        let mut summary = Summary::default();
        summary.ttft_ms.p99 = ttft_p99;
        summary.hit_rate = 0.5;
        Outcome {
            policy: policy.into(),
            seed,
            summary,
            ttft_ms: vec![1.0, 2.0],
            decode_series: vec![(0.0, vec![1.0, 3.0]), (0.5, vec![3.0, 5.0])],
            rows: Vec::new(),
            stats: HarnessStats::default(),
            wall_s: 0.0,
            virtual_s: 1.0,
        }
    }

    #[test]
    fn spread_is_min_median_max_over_seeds() {
        let runs = [
            outcome("a", 0, 30.0),
            outcome("a", 1, 10.0),
            outcome("a", 2, 20.0),
        ];
        let cell = Cell {
            policy: "a",
            runs: runs.iter().collect(),
        };
        let s = cell.spread(|m| m.ttft_ms.p99);
        assert_eq!((s.min, s.median, s.max), (10.0, 20.0, 30.0));
        assert_eq!(show(s, 0), "20 (10-30)");
        assert_eq!(
            show(
                Spread {
                    min: 1.0,
                    median: 1.0,
                    max: 1.0
                },
                1
            ),
            "1.0"
        );
    }

    /// An outcome with the figures the ranking tests read.
    fn ranked(policy: &str, ttft_p99: f64, rollout_p99: f64, tok_s: f64) -> Outcome {
        let mut o = outcome(policy, 0, ttft_p99);
        o.summary.ttft_ms.p50 = ttft_p99 / 10.0;
        o.summary.tpot_ms.p99 = 10.0;
        o.summary.session_e2e_s.p99 = rollout_p99;
        o.summary.output_tokens_per_s = tok_s;
        o
    }

    fn rl_scenario() -> Scenario {
        crate::bench::scenario::matrix(crate::bench::scenario::Scale::Smoke)
            .into_iter()
            .find(|s| s.group == "rl")
            .unwrap()
    }

    #[test]
    fn the_oracle_is_labelled_and_never_ranked_among_the_policies() {
        let d = default_policy();
        let sc = rl_scenario();
        let policies: Vec<String> = ["session_hash", d, "oracle"].map(String::from).to_vec();
        // The oracle is best on rollout p99 and TTFT p99; the default is best among the policies.
        let runs = [
            ranked("session_hash", 80.0, 12.0, 900.0),
            ranked(d, 100.0, 10.0, 1000.0),
            ranked("oracle", 50.0, 5.0, 950.0),
        ];
        let sr = ScenarioRuns::group(&sc, &policies, &runs);
        let names: Vec<&str> = sr.deployable().map(|c| c.policy).collect();
        assert_eq!(names, ["session_hash", d]);
        assert_eq!(sr.oracle().map(|c| c.policy), Some("oracle"));
        let table = scenario_table(&sr);
        assert!(
            table.contains(&format!("| oracle ({ORACLE_NOTE}) |")),
            "{table}"
        );
        assert!(table.contains(&format!("| {} |", row_label(d))), "{table}");
        let c = claims(std::slice::from_ref(&sr));
        assert!(
            c.contains(&format!("best is {d} 10.0 s | yes")),
            "the oracle must not take the best-policy claim: {c}"
        );
        assert!(c.contains(&format!("{d} wins on every seed")), "{c}");
        let gap = limit_gap(std::slice::from_ref(&sr));
        // TTFT p99: the default's 100 against the oracle's 50, and the best policy is session_hash, not
        // the oracle.
        assert!(
            gap.contains("100 / 50 = 2.00x; best session_hash 80"),
            "{gap}"
        );
        // Throughput: the default beats the oracle, and the report says so; TPOT (equal) is not listed.
        assert!(
            gap.contains(&format!("1000 / 950 = 1.05x; best {d} 1000")),
            "{gap}"
        );
        assert!(
            gap.contains("beats the greedy oracle on: `rl` output tok/s."),
            "{gap}"
        );
    }

    #[test]
    fn no_gap_section_without_both_the_default_and_the_oracle() {
        let d = default_policy();
        let sc = rl_scenario();
        let policies: Vec<String> = [d, "session_hash"].map(String::from).to_vec();
        let runs = [
            ranked(d, 100.0, 10.0, 1000.0),
            ranked("session_hash", 80.0, 12.0, 900.0),
        ];
        let sr = ScenarioRuns::group(&sc, &policies, &runs);
        assert_eq!(limit_gap(std::slice::from_ref(&sr)), "");
        assert!(!scenario_table(&sr).contains("limit"));
        // A variant of the oracle counts as the limit too.
        let policies: Vec<String> = [d, "oracle@decode=1"].map(String::from).to_vec();
        let runs = [
            ranked(d, 100.0, 10.0, 1000.0),
            ranked("oracle@decode=1", 90.0, 9.0, 1100.0),
        ];
        let sr = ScenarioRuns::group(&sc, &policies, &runs);
        assert_eq!(sr.oracle().map(|c| c.policy), Some("oracle@decode=1"));
        let gap = limit_gap(std::slice::from_ref(&sr));
        assert!(
            gap.contains(&format!("as good as `{d}` or better on every figure")),
            "{gap}"
        );
    }

    #[test]
    fn downsampling_averages_and_bounds_the_points() {
        let series: Vec<(f64, Vec<f64>)> = (0..1000).map(|i| (i as f64, vec![i as f64])).collect();
        let d = downsample(&series, 100);
        assert_eq!(d.len(), 100);
        assert_eq!(d[0].0, 0.0);
        assert!((d[0].1[0] - 4.5).abs() < 1e-9);
        assert_eq!(downsample(&[], 10).len(), 0);
    }
}
