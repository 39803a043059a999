//! Routing-quality measurement (docs/design/design.md section 7): the consumer reports each request's life
//! and samples of per-replica decode load; [`Recorder::summary`] reduces them to the published
//! metrics.
//!
//! Definitions (also in `docs/design/workloads.md`):
//! - **TTFT** = first token time - issue time; **TPOT** = (finish - first token) / (completion tokens - 1),
//!   over requests with at least 2 completion tokens; **end-to-end** = finish - issue. Failed requests
//!   are counted but excluded from latencies, throughput and hit rate.
//! - **Session end-to-end** = last finish (or failure) of the session's requests - first issue, over
//!   sessions none of whose requests is still open. For RL this is the rollout latency.
//! - **Percentiles** are nearest-rank: the value at 1-based rank `ceil(p/100 * n)` of the sorted samples
//!   (p50 of [1,2,3,4] is 2); all zero with `count` 0 when there is no sample.
//! - **Output tokens/s** = sum of completion tokens / (last finish - first issue).
//! - **Hit rate** = sum of engine-reported cached prompt tokens / sum of prompt tokens.
//! - **Decode-block CV**: samples are grouped in 0.5 s bins (by `t_us / 500_000`); within a bin each
//!   replica's value is the mean of its samples; the bin's CV is the population standard deviation over
//!   replicas divided by their mean; bins whose mean is 0 are empty and skipped; the result is the mean
//!   over non-empty bins (`None` when there is none).

use crate::driver::Issue;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

/// Width of a decode-load bin.
pub const BIN_US: u64 = 500_000;
/// Replica indices at or above this are ignored (a hostile or buggy index must not allocate gigabytes).
pub const MAX_REPLICAS: usize = 1024;

#[derive(Clone, Debug, Default)]
struct Req {
    session: usize,
    issued_us: u64,
    replica: Option<usize>,
    first_token_us: Option<u64>,
    end_us: Option<u64>,
    failed: bool,
    prompt_tokens: u64,
    cached_tokens: u64,
    completion_tokens: u64,
}

/// Collects what the consumer observed during one run (one policy).
#[derive(Clone, Debug, Default)]
pub struct Recorder {
    requests: HashMap<u64, Req>,
    sessions: HashMap<String, usize>,
    bins: BTreeMap<u64, (u64, Vec<u64>)>,
    unknown_events: u64,
}

/// p50 / p90 / p99 of a sample, with its size and mean.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub count: usize,
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Percentiles {
    pub fn of(values: &[f64]) -> Percentiles {
        let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
        if v.is_empty() {
            return Percentiles::default();
        }
        v.sort_by(f64::total_cmp);
        Percentiles {
            count: v.len(),
            mean: v.iter().sum::<f64>() / v.len() as f64,
            p50: nearest_rank(&v, 50.0),
            p90: nearest_rank(&v, 90.0),
            p99: nearest_rank(&v, 99.0),
        }
    }
}

/// Nearest-rank percentile of sorted, non-empty values.
pub fn nearest_rank(sorted: &[f64], p: f64) -> f64 {
    let n = sorted.len();
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    sorted[rank.clamp(1, n) - 1]
}

/// Population coefficient of variation (std / mean); `None` when the mean is 0 or there is no value.
pub fn coefficient_of_variation(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if mean <= 0.0 {
        return None;
    }
    let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    Some(var.sqrt() / mean)
}

/// The metrics of one run.
/// Serializable both ways, so a report step can read summaries written by earlier runs.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub label: String,
    /// Requests finished successfully.
    pub requests: usize,
    pub failed: usize,
    /// Requests issued but neither finished nor failed when the summary was taken.
    pub open: usize,
    pub ttft_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Per-session (RL: per-rollout) end-to-end, in seconds.
    pub session_e2e_s: Percentiles,
    pub output_tokens_per_s: f64,
    pub span_s: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub output_tokens: u64,
    pub hit_rate: f64,
    pub decode_cv: Option<f64>,
    /// Requests routed to each replica (index = replica).
    pub requests_per_replica: Vec<u64>,
    /// Events about request ids never issued (consumer bugs show up here instead of being lost).
    pub unknown_events: u64,
}

/// One request as recorded, for per-request dumps (JSON lines, CSV).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRow {
    pub request_id: u64,
    pub session_id: String,
    pub replica: Option<usize>,
    pub issued_us: u64,
    pub first_token_us: Option<u64>,
    pub end_us: Option<u64>,
    pub failed: bool,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

impl Recorder {
    pub fn new() -> Recorder {
        Recorder::default()
    }

    /// A request was sent.
    pub fn issued(&mut self, request_id: u64, session_id: &str, t_us: u64, prompt_tokens: u64) {
        let n = self.sessions.len();
        let session = *self.sessions.entry(session_id.to_string()).or_insert(n);
        self.requests.insert(
            request_id,
            Req {
                session,
                issued_us: t_us,
                prompt_tokens,
                ..Default::default()
            },
        );
    }

    /// Shorthand for [`Recorder::issued`] from a driver issue.
    pub fn issued_from(&mut self, issue: &Issue) {
        self.issued(
            issue.request_id,
            &issue.session_id,
            issue.issued_us,
            issue.prompt.len() as u64,
        );
    }

    fn get(&mut self, request_id: u64) -> Option<&mut Req> {
        let r = self.requests.get_mut(&request_id);
        if r.is_none() {
            self.unknown_events += 1;
        }
        r
    }

    /// The router sent the request to `replica`.
    pub fn routed(&mut self, request_id: u64, replica: usize) {
        if let Some(r) = self.get(request_id)
            && replica < MAX_REPLICAS
        {
            r.replica = Some(replica);
        }
    }

    /// The first output token arrived (later calls are ignored).
    pub fn first_token(&mut self, request_id: u64, t_us: u64) {
        if let Some(r) = self.get(request_id) {
            r.first_token_us.get_or_insert(t_us);
        }
    }

    /// The request finished; `cached_tokens` is what the engine reported as prefix-cache hits.
    pub fn finished(
        &mut self,
        request_id: u64,
        t_us: u64,
        cached_tokens: u64,
        completion_tokens: u64,
    ) {
        if let Some(r) = self.get(request_id) {
            r.end_us = Some(t_us);
            r.cached_tokens = cached_tokens.min(r.prompt_tokens);
            r.completion_tokens = completion_tokens;
            r.failed = false;
        }
    }

    pub fn failed(&mut self, request_id: u64, t_us: u64) {
        if let Some(r) = self.get(request_id) {
            r.end_us = Some(t_us);
            r.failed = true;
        }
    }

    /// Per-replica KV blocks held by decoding requests at `t_us` (call about every 0.5 s, or more often).
    pub fn sample(&mut self, t_us: u64, decode_blocks: &[u64]) {
        let n = decode_blocks.len().min(MAX_REPLICAS);
        let bin = self.bins.entry(t_us / BIN_US).or_insert((0, Vec::new()));
        bin.0 += 1;
        if bin.1.len() < n {
            bin.1.resize(n, 0);
        }
        for (acc, v) in bin.1.iter_mut().zip(decode_blocks) {
            *acc = acc.saturating_add(*v);
        }
    }

    /// Per-bin mean decode blocks: (bin start in seconds, one value per replica).
    pub fn decode_series(&self) -> Vec<(f64, Vec<f64>)> {
        let width = self.bins.values().map(|b| b.1.len()).max().unwrap_or(0);
        self.bins
            .iter()
            .map(|(bin, (n, sums))| {
                let mut v: Vec<f64> = sums.iter().map(|s| *s as f64 / *n as f64).collect();
                v.resize(width, 0.0);
                ((*bin * BIN_US) as f64 / 1e6, v)
            })
            .collect()
    }

    /// TTFT of every finished request, in ms (for CDF plots).
    pub fn ttft_ms(&self) -> Vec<f64> {
        self.requests
            .values()
            .filter(|r| !r.failed && r.end_us.is_some())
            .filter_map(|r| {
                r.first_token_us
                    .map(|f| f.saturating_sub(r.issued_us) as f64 / 1e3)
            })
            .collect()
    }

    /// Every recorded request, in request-id order.
    pub fn rows(&self) -> Vec<RequestRow> {
        let mut names = vec![""; self.sessions.len()];
        for (name, &i) in &self.sessions {
            names[i] = name;
        }
        let mut rows: Vec<RequestRow> = self
            .requests
            .iter()
            .map(|(&id, r)| RequestRow {
                request_id: id,
                session_id: names[r.session].to_string(),
                replica: r.replica,
                issued_us: r.issued_us,
                first_token_us: r.first_token_us,
                end_us: r.end_us,
                failed: r.failed,
                prompt_tokens: r.prompt_tokens,
                cached_tokens: r.cached_tokens,
                completion_tokens: r.completion_tokens,
            })
            .collect();
        rows.sort_by_key(|r| r.request_id);
        rows
    }

    pub fn summary(&self, label: &str) -> Summary {
        let mut s = Summary {
            label: label.to_string(),
            unknown_events: self.unknown_events,
            ..Default::default()
        };
        let (mut ttft, mut tpot, mut e2e) = (vec![], vec![], vec![]);
        let mut span: Option<(u64, u64)> = None;
        // Per session: (first issue, last end, any request open).
        let mut sess: HashMap<usize, (u64, u64, bool)> = HashMap::new();
        for r in self.requests.values() {
            if let Some(rep) = r.replica {
                if s.requests_per_replica.len() <= rep {
                    s.requests_per_replica.resize(rep + 1, 0);
                }
                s.requests_per_replica[rep] += 1;
            }
            let e = sess.entry(r.session).or_insert((u64::MAX, 0, false));
            e.0 = e.0.min(r.issued_us);
            match r.end_us {
                None => {
                    s.open += 1;
                    e.2 = true;
                    continue;
                }
                Some(end) => e.1 = e.1.max(end),
            }
            if r.failed {
                s.failed += 1;
                continue;
            }
            let end = r.end_us.unwrap_or(r.issued_us);
            s.requests += 1;
            s.prompt_tokens += r.prompt_tokens;
            s.cached_tokens += r.cached_tokens;
            s.output_tokens += r.completion_tokens;
            e2e.push(end.saturating_sub(r.issued_us) as f64 / 1e3);
            if let Some(f) = r.first_token_us {
                ttft.push(f.saturating_sub(r.issued_us) as f64 / 1e3);
                if r.completion_tokens >= 2 {
                    tpot.push(
                        end.saturating_sub(f) as f64 / 1e3 / (r.completion_tokens - 1) as f64,
                    );
                }
            }
            span = Some(match span {
                None => (r.issued_us, end),
                Some((a, b)) => (a.min(r.issued_us), b.max(end)),
            });
        }
        // Spans start at the first issue of any request, finished or not.
        if let Some((a, b)) = span {
            let first = self
                .requests
                .values()
                .map(|r| r.issued_us)
                .min()
                .unwrap_or(a);
            s.span_s = b.saturating_sub(first) as f64 / 1e6;
        }
        if s.span_s > 0.0 {
            s.output_tokens_per_s = s.output_tokens as f64 / s.span_s;
        }
        if s.prompt_tokens > 0 {
            s.hit_rate = s.cached_tokens as f64 / s.prompt_tokens as f64;
        }
        let sess_e2e: Vec<f64> = sess
            .values()
            .filter(|(_, _, open)| !open)
            .map(|(a, b, _)| b.saturating_sub(*a) as f64 / 1e6)
            .collect();
        s.ttft_ms = Percentiles::of(&ttft);
        s.tpot_ms = Percentiles::of(&tpot);
        s.e2e_ms = Percentiles::of(&e2e);
        s.session_e2e_s = Percentiles::of(&sess_e2e);
        s.decode_cv = self.mean_decode_cv();
        s
    }

    /// The decode-block CV (docs/design/design.md section 7): the mean over the decode series of
    /// their coefficients of variation; `None` when no series has one.
    fn mean_decode_cv(&self) -> Option<f64> {
        let cvs: Vec<f64> = self
            .decode_series()
            .iter()
            .filter_map(|(_, v)| coefficient_of_variation(v))
            .collect();
        if cvs.is_empty() {
            None
        } else {
            Some(cvs.iter().sum::<f64>() / cvs.len() as f64)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_by_hand() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        let p = Percentiles::of(&v);
        assert_eq!((p.p50, p.p90, p.p99), (5.0, 9.0, 10.0));
        assert_eq!(p.mean, 5.5);
        let p = Percentiles::of(&[4.0, 1.0, 3.0, 2.0]);
        assert_eq!(p.p50, 2.0);
        assert_eq!(p.p90, 4.0);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = Percentiles::of(&hundred);
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(Percentiles::of(&[]).count, 0);
    }

    #[test]
    fn cv_by_hand() {
        // values 2, 4, 4, 4, 5, 5, 7, 9: mean 5, population std 2.
        let cv = coefficient_of_variation(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]).unwrap();
        assert!((cv - 0.4).abs() < 1e-12);
        assert_eq!(coefficient_of_variation(&[0.0, 0.0]), None);
        assert_eq!(coefficient_of_variation(&[3.0, 3.0]), Some(0.0));
    }

    #[test]
    fn summary_by_hand() {
        let mut r = Recorder::new();
        r.issued(1, "a", 0, 100);
        r.routed(1, 0);
        r.first_token(1, 10_000);
        r.finished(1, 110_000, 40, 11); // ttft 10 ms, tpot 10 ms, e2e 110 ms
        r.issued(2, "a", 200_000, 100);
        r.routed(2, 1);
        r.first_token(2, 230_000);
        r.finished(2, 1_000_000, 60, 1); // ttft 30 ms, no tpot
        r.issued(3, "b", 0, 50);
        r.routed(3, 1);
        r.failed(3, 500_000);
        r.finished(99, 1, 1, 1); // unknown
        // Bin 0: replicas [2, 6] (cv 0.5); bin 1: two samples averaging [3, 3] (cv 0); bin 2 empty.
        r.sample(0, &[2, 6]);
        r.sample(600_000, &[2, 4]);
        r.sample(900_000, &[4, 2]);
        r.sample(1_100_000, &[0, 0]);
        let s = r.summary("x");
        assert_eq!((s.requests, s.failed, s.open), (2, 1, 0));
        assert_eq!(s.ttft_ms.p50, 10.0);
        assert_eq!(s.ttft_ms.p99, 30.0);
        assert_eq!(s.tpot_ms.count, 1);
        assert_eq!(s.tpot_ms.p50, 10.0);
        assert_eq!(s.e2e_ms.p99, 800.0);
        assert_eq!(s.hit_rate, 0.5);
        assert_eq!(s.span_s, 1.0);
        assert_eq!(s.output_tokens_per_s, 12.0);
        assert_eq!(s.requests_per_replica, vec![1, 2]);
        assert_eq!(s.session_e2e_s.count, 2);
        assert_eq!(s.session_e2e_s.p99, 1.0);
        assert_eq!(s.unknown_events, 1);
        assert!((s.decode_cv.unwrap() - 0.25).abs() < 1e-12);
        let back: Summary = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
        let rows = r.rows();
        assert_eq!(
            rows.iter().map(|r| r.request_id).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(rows[2].session_id, "b");
        assert!(rows[2].failed);
        assert_eq!(rows[0].cached_tokens, 40);
    }
}
