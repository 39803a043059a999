//! Reports: a markdown table of summaries, one row per policy. The SVG plots are in
//! [`crate::plot`], re-exported here for the report writers that use both.

use crate::measure::Summary;
use std::fmt::Write as _;

#[cfg(not(target_arch = "wasm32"))]
pub use crate::plot::{decode_load_svg, hit_cv_scatter_svg, ttft_cdf_svg};

/// One markdown table, one row per summary.
pub fn markdown_table(summaries: &[Summary]) -> String {
    let mut s = String::new();
    s.push_str("| policy | requests | failed | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | E2E p50 / p99 s | session E2E p50 / p99 s | output tok/s | hit rate | decode CV | requests per replica |\n");
    s.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for m in summaries {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.0} / {:.0} / {:.0} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} | {:.1} / {:.1} | {:.0} | {:.1}% | {} | {} |",
            m.label,
            m.requests,
            m.failed,
            m.ttft_ms.p50,
            m.ttft_ms.p90,
            m.ttft_ms.p99,
            m.tpot_ms.p50,
            m.tpot_ms.p90,
            m.tpot_ms.p99,
            m.e2e_ms.p50 / 1e3,
            m.e2e_ms.p99 / 1e3,
            m.session_e2e_s.p50,
            m.session_e2e_s.p99,
            m.output_tokens_per_s,
            m.hit_rate * 100.0,
            m.decode_cv.map_or("-".to_string(), |c| format!("{c:.3}")),
            m.requests_per_replica
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" / "),
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_one_row_per_summary() {
        let a = Summary {
            label: "kv_load".into(),
            requests_per_replica: vec![3, 4],
            decode_cv: Some(0.25),
            ..Default::default()
        };
        let b = Summary {
            label: "round_robin".into(),
            ..Default::default()
        };
        let t = markdown_table(&[a, b]);
        assert_eq!(t.lines().count(), 4);
        assert!(t.contains("| kv_load |"));
        assert!(t.contains("3 / 4"));
        assert!(t.contains("0.250"));
    }
}
