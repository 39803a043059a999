//! SVG plots of a run, drawn with `plotters` (its SVG backend only: no font files, the viewer lays
//! the text out). Native builds only: the playground's wasm build has no use for them.

use plotters::coord::Shift;
use plotters::coord::ranged1d::{AsRangedCoord, Ranged};
use plotters::prelude::*;
use std::error::Error;
use std::ops::Range;

const PALETTE: [RGBColor; 10] = [
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0x8c, 0x56, 0x4b),
    RGBColor(0xe3, 0x77, 0xc2),
    RGBColor(0x7f, 0x7f, 0x7f),
    RGBColor(0xbc, 0xbd, 0x22),
    RGBColor(0x17, 0xbe, 0xcf),
];

fn color(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Tick labels and axis descriptions (plotters draws text at about 0.8 of the size asked).
const LABELS: (&str, u32) = ("sans-serif", 15);

/// The size every plot is drawn at, in pixels.
const SIZE: (u32, u32) = (720, 420);

/// Draws one plot into an SVG string. Drawing into a string cannot fail for I/O; a plotting error
/// (none is expected with finite ranges) leaves the plot drawn so far rather than failing a report.
fn svg(draw: impl FnOnce(DrawingArea<SVGBackend, Shift>) -> Result<(), Box<dyn Error>>) -> String {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, SIZE).into_drawing_area();
        let _ = root.fill(&WHITE);
        let _ = draw(root.clone());
        let _ = root.present();
    }
    if !out.ends_with('\n') {
        out.push('\n');
    }
    out
}

/// A range a chart can be built on: finite and not empty.
fn fix_range((a, b): (f64, f64)) -> Range<f64> {
    let (a, b) = if a.is_finite() && b.is_finite() {
        (a, b)
    } else {
        (0.0, 1.0)
    };
    if b > a { a..b } else { a - 0.5..a + 0.5 }
}

/// Axis labels short enough for the narrow margin: 12k, 340, 2.5, 0.25.
fn tick(v: &f64) -> String {
    let (v, a) = (*v, v.abs());
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

/// The title, the axes' descriptions and the legend, the same on every plot.
type Chart<'a, X, Y> = ChartContext<
    'a,
    SVGBackend<'a>,
    Cartesian2d<<X as AsRangedCoord>::CoordDescType, <Y as AsRangedCoord>::CoordDescType>,
>;

fn chart<'a, X: AsRangedCoord, Y: AsRangedCoord>(
    root: &DrawingArea<SVGBackend<'a>, Shift>,
    title: &str,
    x: X,
    y: Y,
) -> Result<Chart<'a, X, Y>, Box<dyn Error>> {
    Ok(ChartBuilder::on(root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(x, y)?)
}

fn legend<'a, X: Ranged, Y: Ranged>(
    c: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<X, Y>>,
) -> Result<(), Box<dyn Error>> {
    c.configure_series_labels()
        .label_font(LABELS)
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    Ok(())
}

/// A series' legend mark: a filled square in its colour, at the legend entry's anchor.
fn swatch((x, y): (i32, i32), style: ShapeStyle) -> Rectangle<(i32, i32)> {
    Rectangle::new([(x, y - 5), (x + 12, y + 5)], style)
}

/// CDF of TTFT per policy, on a log10 time axis (tails span orders of magnitude).
pub fn ttft_cdf_svg(series: &[(&str, &[f64])]) -> String {
    let positive = |v: &&f64| v.is_finite() && **v > 0.0;
    let lo = series
        .iter()
        .flat_map(|s| s.1.iter().filter(positive))
        .fold(f64::INFINITY, |a, b| a.min(*b));
    let hi = series
        .iter()
        .flat_map(|s| s.1.iter().filter(positive))
        .fold(0.0f64, |a, b| a.max(*b));
    // Whole decades, so the axis starts and ends on a labelled power of ten.
    let decades = if lo.is_finite() {
        fix_range((lo.log10().floor(), hi.log10().ceil()))
    } else {
        0.0..1.0
    };
    let x = (10f64.powf(decades.start)..10f64.powf(decades.end)).log_scale();
    svg(|root| {
        let mut c = chart(&root, "TTFT CDF", x, 0.0..1.0)?;
        c.configure_mesh()
            .x_desc("TTFT (ms, log scale)")
            .y_desc("fraction of requests")
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .label_style(LABELS)
            .axis_desc_style(LABELS)
            .draw()?;
        for (i, (label, vals)) in series.iter().enumerate() {
            let mut v: Vec<f64> = vals.iter().copied().filter(|x| positive(&x)).collect();
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
            let style = color(i).stroke_width(2);
            c.draw_series(LineSeries::new(pts, style))?
                .label(*label)
                .legend(move |at| swatch(at, style.filled()));
        }
        legend(&mut c)
    })
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
    svg(|root| {
        let mut c = chart(&root, title, fix_range((t_lo, t_hi)), 0.0..y_hi.max(1.0))?;
        c.configure_mesh()
            .x_desc("time (s)")
            .y_desc("decode KV blocks")
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .label_style(LABELS)
            .axis_desc_style(LABELS)
            .draw()?;
        for r in 0..replicas {
            let pts = series
                .iter()
                .map(|(t, v)| (*t, v.get(r).copied().unwrap_or(0.0)));
            let style = color(r).stroke_width(2);
            c.draw_series(LineSeries::new(pts, style))?
                .label(format!("replica {r}"))
                .legend(move |at| swatch(at, style.filled()));
        }
        legend(&mut c)
    })
}

/// Hit rate (x) against decode-block CV (y), one point per policy.
pub fn hit_cv_scatter_svg(points: &[(&str, f64, f64)]) -> String {
    let y_hi = points
        .iter()
        .map(|p| p.2)
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    svg(|root| {
        let mut c = chart(
            &root,
            "hit rate vs decode-load CV",
            0.0..1.0,
            0.0..(y_hi * 1.1).max(0.1),
        )?;
        c.configure_mesh()
            .x_desc("prefix-cache hit rate")
            .y_desc("decode-block CV")
            .x_label_formatter(&tick)
            .y_label_formatter(&tick)
            .label_style(LABELS)
            .axis_desc_style(LABELS)
            .draw()?;
        for (i, (label, hit, cv)) in points.iter().enumerate() {
            if !(hit.is_finite() && cv.is_finite()) {
                continue;
            }
            let style = color(i).filled();
            c.draw_series(std::iter::once(Circle::new((*hit, *cv), 6, style)))?
                .label(*label)
                .legend(move |at| swatch(at, style));
        }
        legend(&mut c)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How a data line is drawn (the axes and grid are thinner).
    const SERIES_LINE: &str = r#"stroke-width="2""#;

    #[test]
    fn svgs_are_well_formed_enough() {
        let v = [1.0, 10.0, 100.0];
        let s = ttft_cdf_svg(&[("a<b", &v), ("c", &[])]);
        assert!(s.starts_with("<svg") && s.ends_with("</svg>\n"));
        // Labels are escaped; an empty series is in the legend but draws no line.
        assert!(s.contains("a&lt;b") && s.contains(">\nc\n</text>"));
        assert_eq!(s.matches(SERIES_LINE).count(), 1);
        let d = decode_load_svg("load", &[(0.0, vec![1.0, 2.0]), (0.5, vec![3.0, 0.0])]);
        assert_eq!(d.matches(SERIES_LINE).count(), 2);
        let sc = hit_cv_scatter_svg(&[("a", 0.5, 0.2), ("b", f64::NAN, 0.1)]);
        assert_eq!(sc.matches("<circle").count(), 1);
        assert!(!sc.contains("NaN"));
    }
}
