//! Reports: a markdown table of summaries (one row per policy) and hand-written SVG plots. No
//! plotting crate: three plots do not justify the build time.

use crate::measure::Summary;
use std::fmt::Write as _;

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

const PALETTE: [&str; 10] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
];

fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A plot area with linear (or log10) axes.
struct Frame {
    w: f64,
    h: f64,
    left: f64,
    right: f64,
    top: f64,
    bottom: f64,
    x: (f64, f64),
    y: (f64, f64),
    log_x: bool,
    svg: String,
}

impl Frame {
    fn new(
        title: &str,
        x_label: &str,
        y_label: &str,
        x: (f64, f64),
        y: (f64, f64),
        log_x: bool,
    ) -> Frame {
        let (w, h) = (720.0, 420.0);
        let mut f = Frame {
            w,
            h,
            left: 70.0,
            right: 170.0,
            top: 40.0,
            bottom: 50.0,
            x: fix_range(x),
            y: fix_range(y),
            log_x,
            svg: String::new(),
        };
        let _ = write!(
            f.svg,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/><text x="{}" y="22" text-anchor="middle" font-size="15">{}</text>"#,
            w / 2.0,
            escape(title)
        );
        let (x0, y0, x1, y1) = (f.left, f.h - f.bottom, f.w - f.right, f.top);
        let _ = write!(
            f.svg,
            r##"<rect x="{x0}" y="{y1}" width="{}" height="{}" fill="none" stroke="#333"/>"##,
            x1 - x0,
            y0 - y1
        );
        f.grid();
        let _ = write!(
            f.svg,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text x="16" y="{}" text-anchor="middle" transform="rotate(-90 16 {})">{}</text>"#,
            (x0 + x1) / 2.0,
            f.h - 12.0,
            escape(x_label),
            (y0 + y1) / 2.0,
            (y0 + y1) / 2.0,
            escape(y_label)
        );
        f
    }

    /// The grid: five horizontal lines with the y values, and the x ticks (powers of ten on a log
    /// axis, six even steps otherwise) with their vertical lines.
    fn grid(&mut self) {
        let (x0, y0, x1, y1) = (
            self.left,
            self.h - self.bottom,
            self.w - self.right,
            self.top,
        );
        for i in 0..=4 {
            let fy = self.y.0 + (self.y.1 - self.y.0) * f64::from(i) / 4.0;
            let py = self.py(fy);
            let _ = write!(
                self.svg,
                r##"<line x1="{x0}" y1="{py:.1}" x2="{x1}" y2="{py:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                x0 - 6.0,
                py + 4.0,
                tick(fy)
            );
        }
        let xticks: Vec<f64> = if self.log_x {
            let (a, b) = (self.x.0.floor() as i32, self.x.1.ceil() as i32);
            (a..=b)
                .map(f64::from)
                .filter(|e| *e >= self.x.0 && *e <= self.x.1)
                .collect()
        } else {
            (0..=5)
                .map(|i| self.x.0 + (self.x.1 - self.x.0) * f64::from(i) / 5.0)
                .collect()
        };
        for fx in xticks {
            let px = x0 + (fx - self.x.0) / (self.x.1 - self.x.0) * (x1 - x0);
            let label = if self.log_x {
                tick(10f64.powf(fx))
            } else {
                tick(fx)
            };
            let _ = write!(
                self.svg,
                r##"<line x1="{px:.1}" y1="{y0}" x2="{px:.1}" y2="{y1}" stroke="#eee"/><text x="{px:.1}" y="{}" text-anchor="middle">{label}</text>"##,
                y0 + 16.0
            );
        }
    }

    fn px(&self, x: f64) -> f64 {
        let x = if self.log_x { x.max(1e-9).log10() } else { x };
        self.left + (x - self.x.0) / (self.x.1 - self.x.0) * (self.w - self.left - self.right)
    }

    fn py(&self, y: f64) -> f64 {
        let b = self.h - self.bottom;
        b - (y - self.y.0) / (self.y.1 - self.y.0) * (b - self.top)
    }

    fn polyline(&mut self, pts: &[(f64, f64)], color: &str) {
        let mut s = String::new();
        for (x, y) in pts {
            let _ = write!(s, "{:.1},{:.1} ", self.px(*x), self.py(*y));
        }
        let _ = write!(
            self.svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{s}"/>"#
        );
    }

    fn legend(&mut self, i: usize, label: &str) {
        let x = self.w - self.right + 12.0;
        let y = self.top + 8.0 + 18.0 * i as f64;
        let _ = write!(
            self.svg,
            r#"<rect x="{x}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            y - 10.0,
            color(i),
            x + 18.0,
            y,
            escape(label)
        );
    }

    fn finish(mut self) -> String {
        self.svg.push_str("</svg>\n");
        self.svg
    }
}

fn fix_range((a, b): (f64, f64)) -> (f64, f64) {
    let (a, b) = if a.is_finite() && b.is_finite() {
        (a, b)
    } else {
        (0.0, 1.0)
    };
    if b > a { (a, b) } else { (a - 0.5, a + 0.5) }
}

fn tick(v: f64) -> String {
    let a = v.abs();
    if a >= 10_000.0 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 10.0 || a == 0.0 {
        format!("{v:.0}")
    } else if a >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// CDF of TTFT per policy, on a log10 time axis (tails span orders of magnitude).
pub fn ttft_cdf_svg(series: &[(&str, &[f64])]) -> String {
    let finite = |v: &&f64| v.is_finite() && **v > 0.0;
    let lo = series
        .iter()
        .flat_map(|s| s.1.iter().filter(finite))
        .fold(f64::INFINITY, |a, b| a.min(*b));
    let hi = series
        .iter()
        .flat_map(|s| s.1.iter().filter(finite))
        .fold(0.0f64, |a, b| a.max(*b));
    let (lo, hi) = if lo.is_finite() {
        (lo.log10().floor(), hi.log10().ceil())
    } else {
        (0.0, 1.0)
    };
    let mut f = Frame::new(
        "TTFT CDF",
        "TTFT (ms, log scale)",
        "fraction of requests",
        (lo, hi),
        (0.0, 1.0),
        true,
    );
    for (i, (label, vals)) in series.iter().enumerate() {
        let mut v: Vec<f64> = vals
            .iter()
            .copied()
            .filter(|x| x.is_finite() && *x > 0.0)
            .collect();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        // At most ~400 points per line: enough for a smooth step, small files.
        let step = (v.len() / 400).max(1);
        let mut pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .step_by(step)
            .map(|(k, x)| (*x, (k + 1) as f64 / n))
            .collect();
        if let Some(last) = v.last() {
            pts.push((*last, 1.0));
        }
        f.polyline(&pts, color(i));
        f.legend(i, label);
    }
    f.finish()
}

/// Per-replica decode load over time, from [`crate::measure::Recorder::decode_series`].
pub fn decode_load_svg(title: &str, series: &[(f64, Vec<f64>)]) -> String {
    let t_hi = series.last().map_or(1.0, |s| s.0);
    let t_lo = series.first().map_or(0.0, |s| s.0);
    let y_hi = series
        .iter()
        .flat_map(|s| s.1.iter())
        .fold(0.0f64, |a, b| a.max(*b));
    let replicas = series.iter().map(|s| s.1.len()).max().unwrap_or(0);
    let mut f = Frame::new(
        title,
        "time (s)",
        "decode KV blocks",
        (t_lo, t_hi),
        (0.0, y_hi.max(1.0)),
        false,
    );
    for r in 0..replicas {
        let pts: Vec<(f64, f64)> = series
            .iter()
            .map(|(t, v)| (*t, v.get(r).copied().unwrap_or(0.0)))
            .collect();
        f.polyline(&pts, color(r));
        f.legend(r, &format!("replica {r}"));
    }
    f.finish()
}

/// Hit rate (x) against decode-block CV (y), one point per policy.
pub fn hit_cv_scatter_svg(points: &[(&str, f64, f64)]) -> String {
    let y_hi = points
        .iter()
        .map(|p| p.2)
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let mut f = Frame::new(
        "hit rate vs decode-load CV",
        "prefix-cache hit rate",
        "decode-block CV",
        (0.0, 1.0),
        (0.0, (y_hi * 1.1).max(0.1)),
        false,
    );
    for (i, (label, hit, cv)) in points.iter().enumerate() {
        if !(hit.is_finite() && cv.is_finite()) {
            continue;
        }
        let _ = write!(
            f.svg,
            r#"<circle cx="{:.1}" cy="{:.1}" r="6" fill="{}"/>"#,
            f.px(*hit),
            f.py(*cv),
            color(i)
        );
        f.legend(i, label);
    }
    f.finish()
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

    #[test]
    fn svgs_are_well_formed_enough() {
        let v = [1.0, 10.0, 100.0];
        let s = ttft_cdf_svg(&[("a<b", &v), ("c", &[])]);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        assert!(s.contains("a&lt;b"));
        assert_eq!(s.matches("<polyline").count(), 2);
        let d = decode_load_svg("load", &[(0.0, vec![1.0, 2.0]), (0.5, vec![3.0, 0.0])]);
        assert_eq!(d.matches("<polyline").count(), 2);
        let sc = hit_cv_scatter_svg(&[("a", 0.5, 0.2), ("b", f64::NAN, 0.1)]);
        assert_eq!(sc.matches("<circle").count(), 1);
        assert!(!sc.contains("NaN"));
    }
}
