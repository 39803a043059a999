//! How well the winner's predicted first token matched the one the client saw, over a replay's
//! requests (the `explain_header`'s figures): the check that `kv_time`'s seconds are seconds.

use super::median;
use kvsteer_host_test::Harness;
use serde::Serialize;

/// Predicted against realized time to first token over a replay's requests.
#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    pub requests: usize,
    /// Spearman's rank correlation.
    pub rank_correlation: f64,
    pub median_abs_error_ms: f64,
    /// Median of realized / predicted.
    pub median_ratio: f64,
}

/// The explained winner's predicted time to first token in seconds (wait + prefill), from the
/// filter's `explain_header` text (`winner=R; 0: cost=.. wait=.. prefill=..; ...`).
pub fn predicted_ttft_s(explained: &str) -> Option<f64> {
    let mut parts = explained.split("; ");
    let winner = parts.next()?.strip_prefix("winner=")?;
    let own = parts.find(|p| p.split(": ").next() == Some(winner))?;
    let term = |name: &str| -> Option<f64> {
        own.split(' ')
            .find_map(|kv| kv.strip_prefix(name))?
            .parse()
            .ok()
    };
    Some(term("wait=")? + term("prefill=")?)
}

/// Ranks with ties averaged.
fn ranks(v: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    let mut r = vec![0.0; v.len()];
    let mut i = 0;
    while i < idx.len() {
        let mut j = i;
        while j + 1 < idx.len() && v[idx[j + 1]] == v[idx[i]] {
            j += 1;
        }
        for k in i..=j {
            r[idx[k]] = (i + j) as f64 / 2.0;
        }
        i = j + 1;
    }
    r
}

/// Spearman's rank correlation of paired samples (NaN below 3 pairs or without spread).
pub fn rank_correlation(a: &[f64], b: &[f64]) -> f64 {
    if a.len() != b.len() || a.len() < 3 {
        return f64::NAN;
    }
    let (ra, rb) = (ranks(a), ranks(b));
    let mean = (a.len() - 1) as f64 / 2.0;
    let (mut num, mut da, mut db) = (0.0, 0.0, 0.0);
    for (x, y) in ra.iter().zip(&rb) {
        num += (x - mean) * (y - mean);
        da += (x - mean).powi(2);
        db += (y - mean).powi(2);
    }
    num / (da * db).sqrt()
}

pub(super) fn calibration(h: &Harness) -> Option<Calibration> {
    let mut pred = Vec::new();
    let mut real = Vec::new();
    for r in h.records() {
        if let (Some(p), Some(ft)) = (
            r.explained.as_deref().and_then(predicted_ttft_s),
            r.first_token_us,
        ) {
            pred.push(p);
            real.push(ft.saturating_sub(r.issued_us) as f64 / 1e6);
        }
    }
    if pred.is_empty() {
        return None;
    }
    let err: Vec<f64> = pred
        .iter()
        .zip(&real)
        .map(|(p, r)| (p - r).abs() * 1e3)
        .collect();
    let ratio: Vec<f64> = pred
        .iter()
        .zip(&real)
        .filter(|(p, _)| **p > 0.0)
        .map(|(p, r)| r / p)
        .collect();
    Some(Calibration {
        requests: pred.len(),
        rank_correlation: rank_correlation(&pred, &real),
        median_abs_error_ms: median(&err),
        median_ratio: median(&ratio),
    })
}
