//! The README's table of `scripts/demo` is what the demo prints: every row is replayed here (the RL
//! straggler workload, 2 worker VMs, the same code path as the demo) and each of its figures must
//! read as the demo formats it. A change to a policy that moves a figure fails this test until the
//! README is regenerated, so the table and its claims cannot go on describing an older build (they
//! did: a review found all five of the default's figures stale).

mod common;

use kvsteer_lab::bench::run::replay;
use kvsteer_workload::rl::{RlParams, generate};

/// The README's rows of the demo table: (policy, its five figure cells as written, bold marks
/// dropped).
fn readme_rows() -> Vec<(String, Vec<String>)> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    let table = readme
        .split("| policy | TTFT p50 / p99 ms | rollout p99 s |")
        .nth(1)
        .expect("the demo table in README.md");
    table
        .lines()
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<String> = l
                .trim_matches('|')
                .split('|')
                .map(|c| c.replace("**", "").trim().to_string())
                .collect();
            let policy = cells[0].split_whitespace().next().unwrap_or("").to_string();
            (policy, cells[1..].to_vec())
        })
        .collect()
}

#[test]
fn the_readme_demo_table_is_what_the_demo_prints() {
    let rows = readme_rows();
    assert_eq!(rows.len(), 7, "{rows:?}");
    let params = RlParams::default();
    let mut stale = Vec::new();
    for (policy, cells) in &rows {
        let workload = generate(&params).unwrap();
        let mode = workload.default_mode;
        let o = replay(
            common::module(),
            workload,
            mode,
            policy,
            params.seed,
            2,
            |_, _| {},
        )
        .unwrap_or_else(|e| panic!("{policy}: {e}"));
        let m = &o.summary;
        let printed = vec![
            format!("{:.0} / {:.0}", m.ttft_ms.p50, m.ttft_ms.p99),
            format!("{:.1}", m.session_e2e_s.p99),
            format!("{:.0}", m.output_tokens_per_s),
            format!("{:.1}%", m.hit_rate * 100.0),
            m.decode_cv.map_or("-".into(), |c| format!("{c:.3}")),
        ];
        if &printed != cells {
            stale.push(format!("{policy}: README {cells:?}, demo {printed:?}"));
        }
    }
    assert!(
        stale.is_empty(),
        "regenerate README.md's table from scripts/demo:\n{}",
        stale.join("\n")
    );
}
