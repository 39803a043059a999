//! The routing model's judge (docs/reports/model-eval.md): training cells (the matrix the old default was
//! tuned on) and validation cells (fleets, engines and workloads it never saw, fixed before any
//! tuning against them), each replayed for every policy over paired draws; `scripts/model-report`
//! compares them as median ratios with bootstrap 95% intervals beside a no-op change's spread.
//!
//! A draw is one seed: the workload's own draw (RL tokens, think times, arrival gaps, the chat
//! generator), the engines' seeds and the router's tie-breaks. Every policy replays the same draws,
//! so ratios are paired. The no-op change is the candidate again with only its tie-break generator
//! reseeded (`NOOP`): a change that should do nothing, whose spread says how far a ratio moves by
//! chance alone.

use super::run;
use super::scenario::{ARRIVAL_JITTER, Scenario, Source, THINK_JITTER};
use crate::{FilterModule, Harness};
use kvsteer_sim::Profile;
use kvsteer_workload::chat::ChatParams;
use kvsteer_workload::rl::RlParams;
use kvsteer_workload::{Driver, Summary};
use serde::Serialize;
use serde_json::json;
use std::path::Path;

/// Which set a cell belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Set {
    Training,
    Validation,
    /// The second validation round (docs/reports/model-eval.md), written down after the first had
    /// been looked at and before any change it motivated was replayed on these cells.
    Validation2,
    /// The third validation round (docs/reports/model-eval.md), written down after the second had
    /// been looked at and before any change made since was replayed on these cells.
    Validation3,
    /// The fourth validation round (docs/reports/model-eval.md), written down after the third had
    /// been looked at and before any change made since was replayed on these cells.
    Validation4,
    /// The fifth validation round (docs/reports/model-eval.md), written down after the fourth had
    /// been looked at, before any replay of it; its chat cells run long enough that a run's p99 is
    /// not its fleet's first prefills.
    Validation5,
    /// Not a set of this protocol: the fleet-size measurement ([`super::fleet`]) replays its own
    /// cells with the same replay, and its cells say so.
    Fleet,
}

/// One cell: a workload on a fleet.
#[derive(Clone, Debug)]
pub struct Cell {
    pub id: String,
    pub set: Set,
    pub source: Source,
    pub replicas: usize,
    /// The engines' profile (the simulator's and the router's built-in of the same name).
    pub profile: &'static str,
    /// `(replica, factor, from_us)`: engines slower than their profile ([`crate::HarnessConfig::slowdowns`]).
    pub slowdowns: Vec<(usize, f64, u64)>,
}

/// The suffix that makes a policy spec the no-op change: the same policy, its tie-breaks reseeded.
pub const NOOP: &str = "#noop";

/// The policies every cell compares: the baselines of the goals, the old default, the candidate
/// and its no-op twin.
pub const POLICIES: [&str; 7] = [
    "round_robin",
    "least_load",
    "session_hash",
    "kv_load@preset=dynamo",
    "kv_load",
    "kv_time",
    "kv_time#noop",
];

fn cell(id: &str, set: Set, source: Source, replicas: usize, profile: &'static str) -> Cell {
    Cell {
        id: id.into(),
        set,
        source,
        replicas,
        profile,
        slowdowns: Vec::new(),
    }
}

const H100_8B: &str = "llama-3.1-8b-h100";

fn weka(concurrency: usize, copies: usize, max_sessions: Option<usize>) -> Source {
    Source::Weka {
        concurrency,
        copies,
        max_sessions,
        think_jitter: THINK_JITTER,
    }
}

fn rl(concurrency: usize) -> Source {
    Source::Rl(RlParams {
        concurrency,
        ..RlParams::default()
    })
}

/// The training matrix: docs/reports/results.md's cells (4 replicas of Llama-3.1-8B on H100s). `quick`
/// cuts the coding-agent trace to 16 sessions and the open traces to their first rows.
pub fn training(quick: bool) -> Vec<Cell> {
    let t = Set::Training;
    let (copies, max) = if quick { (1, Some(16)) } else { (2, None) };
    let mut v = vec![cell("rl", t, rl(16), 4, H100_8B)];
    for c in [8, 16, 24, 32, 40] {
        v.push(cell(
            &format!("weka-c{c}"),
            t,
            weka(c, copies, max),
            4,
            H100_8B,
        ));
    }
    for speed in [1.0, 2.0] {
        let src = Source::Mooncake {
            speed,
            max_requests: quick.then_some(600),
            arrival_jitter: ARRIVAL_JITTER,
        };
        v.push(cell(&format!("mooncake-x{speed}"), t, src, 4, H100_8B));
    }
    let az = Source::Azure {
        speed: 1.0,
        max_rows: quick.then_some(2000),
        arrival_jitter: ARRIVAL_JITTER,
    };
    v.push(cell("azure", t, az, 4, H100_8B));
    v
}

/// The validation set, as written in docs/reports/model-eval.md before any tuning against it: other fleet
/// sizes, two other engines, heterogeneous fleets and the shared-system-prompt chat workload.
pub fn validation() -> Vec<Cell> {
    let v = Set::Validation;
    let chat = |sessions_per_s: f64| {
        Source::Chat(ChatParams {
            sessions_per_s,
            ..ChatParams::default()
        })
    };
    let slow_half = |mut c: Cell| {
        c.slowdowns = (c.replicas / 2..c.replicas).map(|r| (r, 2.0, 0)).collect();
        c
    };
    let slow_mid = |mut c: Cell| {
        c.slowdowns = vec![(0, 2.0, 60_000_000)];
        c
    };
    vec![
        cell("v-chat-4", v, chat(4.0), 4, H100_8B),
        cell("v-chat-8", v, chat(8.0), 8, H100_8B),
        cell("v-rl-2", v, rl(8), 2, H100_8B),
        cell("v-rl-8", v, rl(32), 8, H100_8B),
        cell("v-weka-c32-8", v, weka(32, 1, Some(24)), 8, H100_8B),
        cell(
            "v-mooncake-x4-16",
            v,
            Source::Mooncake {
                speed: 4.0,
                max_requests: Some(2000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            16,
            H100_8B,
        ),
        cell(
            "v-70b-weka-c24",
            v,
            weka(24, 1, Some(16)),
            4,
            "llama-3.1-70b-h100-tp4",
        ),
        cell("v-70b-rl", v, rl(16), 4, "llama-3.1-70b-h100-tp4"),
        cell(
            "v-a100-weka-c16",
            v,
            weka(16, 1, Some(16)),
            4,
            "llama-3.1-8b-a100-40gb",
        ),
        cell("v-a100-chat", v, chat(4.0), 4, "llama-3.1-8b-a100-40gb"),
        slow_half(cell(
            "v-half-slow-weka-c24",
            v,
            weka(24, 1, Some(16)),
            4,
            H100_8B,
        )),
        slow_half(cell("v-half-slow-rl", v, rl(16), 4, H100_8B)),
        slow_mid(cell("v-slows-mid-rl", v, rl(16), 4, H100_8B)),
    ]
}

/// The second validation round, fixed in docs/reports/model-eval.md before any replay of it: the
/// first round was looked into (its chat cells' TTFT tail), so it judges no change made after that.
/// Fleet sizes, engines, rates and slowdowns that neither the training set nor the first round has.
pub fn validation2() -> Vec<Cell> {
    let v = Set::Validation2;
    let chat = |sessions_per_s: f64, long_output_share: f64| {
        Source::Chat(ChatParams {
            sessions_per_s,
            long_output_share,
            ..ChatParams::default()
        })
    };
    let slow = |mut c: Cell, slowdowns: Vec<(usize, f64, u64)>| {
        c.slowdowns = slowdowns;
        c
    };
    vec![
        cell(
            "w-chat-6-70b",
            v,
            chat(3.0, 0.1),
            6,
            "llama-3.1-70b-h100-tp4",
        ),
        cell("w-chat-12", v, chat(10.0, 0.2), 12, H100_8B),
        slow(
            cell(
                "w-chat-3-a100-slow",
                v,
                chat(3.0, 0.1),
                3,
                "llama-3.1-8b-a100-40gb",
            ),
            vec![(2, 1.5, 0)],
        ),
        cell("w-rl-6-a100", v, rl(24), 6, "llama-3.1-8b-a100-40gb"),
        cell(
            "w-weka-c20-6-70b",
            v,
            weka(20, 1, Some(16)),
            6,
            "llama-3.1-70b-h100-tp4",
        ),
        slow(
            cell("w-weka-c24-slows-mid", v, weka(24, 1, Some(16)), 4, H100_8B),
            vec![(1, 3.0, 30_000_000)],
        ),
        cell(
            "w-mooncake-x3-8",
            v,
            Source::Mooncake {
                speed: 3.0,
                max_requests: Some(2000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            8,
            H100_8B,
        ),
        cell(
            "w-azure-x4-8",
            v,
            Source::Azure {
                speed: 4.0,
                max_rows: Some(4000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            8,
            H100_8B,
        ),
    ]
}

/// The third validation round, fixed in docs/reports/model-eval.md before any replay of it: the
/// second was looked into (its chat tail again), so it judges no change made after that. Fleet
/// sizes, rates, prompt shapes and slowdowns that neither the training set nor the first two rounds
/// have.
pub fn validation3() -> Vec<Cell> {
    let v = Set::Validation3;
    let slow = |mut c: Cell, slowdowns: Vec<(usize, f64, u64)>| {
        c.slowdowns = slowdowns;
        c
    };
    vec![
        cell(
            "x-chat-16",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 12.0,
                long_output_share: 0.15,
                ..ChatParams::default()
            }),
            16,
            H100_8B,
        ),
        cell(
            "x-chat-5-a100-short-system",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 5.0,
                system_tokens: 2048,
                user_tokens_min: 128,
                user_tokens_max: 1024,
                ..ChatParams::default()
            }),
            5,
            "llama-3.1-8b-a100-40gb",
        ),
        cell(
            "x-chat-4-70b-long",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 2.0,
                long_output_share: 0.3,
                ..ChatParams::default()
            }),
            4,
            "llama-3.1-70b-h100-tp4",
        ),
        cell("x-rl-12", v, rl(48), 12, H100_8B),
        slow(
            cell("x-rl-4-70b-slows", v, rl(12), 4, "llama-3.1-70b-h100-tp4"),
            vec![(0, 2.5, 20_000_000)],
        ),
        cell("x-weka-c28-6", v, weka(28, 1, Some(20)), 6, H100_8B),
        cell(
            "x-weka-c12-3-a100",
            v,
            weka(12, 1, Some(12)),
            3,
            "llama-3.1-8b-a100-40gb",
        ),
        cell(
            "x-mooncake-x2-12",
            v,
            Source::Mooncake {
                speed: 2.0,
                max_requests: Some(2000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            12,
            H100_8B,
        ),
        cell(
            "x-azure-x6-12",
            v,
            Source::Azure {
                speed: 6.0,
                max_rows: Some(4000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            12,
            H100_8B,
        ),
    ]
}

/// The fourth validation round, fixed in docs/reports/model-eval.md before any replay of it: the
/// third was looked into (its chat tail), so it judges no change made after that. Fleet sizes (7 and
/// 10) no earlier set has, and combinations of engine, rate, prompt shape and slowdown none has.
pub fn validation4() -> Vec<Cell> {
    // Kept whole: a data list, one cell per line of the round as it was fixed in advance.
    let v = Set::Validation4;
    let slow = |mut c: Cell, slowdowns: Vec<(usize, f64, u64)>| {
        c.slowdowns = slowdowns;
        c
    };
    vec![
        cell(
            "y-chat-10",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 8.0,
                system_tokens: 3072,
                long_output_share: 0.12,
                ..ChatParams::default()
            }),
            10,
            H100_8B,
        ),
        cell(
            "y-chat-7-a100-long",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 4.0,
                long_output_share: 0.25,
                ..ChatParams::default()
            }),
            7,
            "llama-3.1-8b-a100-40gb",
        ),
        cell(
            "y-chat-3-70b-long-system",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 1.5,
                system_tokens: 6144,
                ..ChatParams::default()
            }),
            3,
            "llama-3.1-70b-h100-tp4",
        ),
        slow(
            cell(
                "y-chat-6-slows",
                v,
                Source::Chat(ChatParams {
                    sessions_per_s: 6.0,
                    user_tokens_min: 256,
                    user_tokens_max: 2048,
                    ..ChatParams::default()
                }),
                6,
                H100_8B,
            ),
            vec![(2, 2.0, 15_000_000)],
        ),
        cell("y-rl-10", v, rl(40), 10, H100_8B),
        cell("y-rl-7-a100", v, rl(21), 7, "llama-3.1-8b-a100-40gb"),
        cell("y-weka-c36-10", v, weka(36, 1, Some(24)), 10, H100_8B),
        slow(
            cell(
                "y-weka-c16-4-70b-slows",
                v,
                weka(16, 1, Some(16)),
                4,
                "llama-3.1-70b-h100-tp4",
            ),
            vec![(3, 2.0, 10_000_000)],
        ),
        cell(
            "y-mooncake-x3-10",
            v,
            Source::Mooncake {
                speed: 3.0,
                max_requests: Some(2000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            10,
            H100_8B,
        ),
        cell(
            "y-azure-x5-7",
            v,
            Source::Azure {
                speed: 5.0,
                max_rows: Some(4000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            7,
            H100_8B,
        ),
    ]
}

/// The fifth validation round, as written in docs/reports/model-eval.md before any replay of it:
/// fleet sizes 5, 9 and 14, new combinations of workload, engine, rate and slowdown, and chat
/// cells of 900 sessions (about 3,100 requests, so a run's p99 is about its 31st slowest request,
/// not one of the fleet's first prefills of the shared prompt).
pub fn validation5() -> Vec<Cell> {
    // Kept whole: a data list, one cell per line of the round as it was fixed in advance.
    let v = Set::Validation5;
    let slow = |mut c: Cell, slowdowns: Vec<(usize, f64, u64)>| {
        c.slowdowns = slowdowns;
        c
    };
    let chat = |p: ChatParams| Source::Chat(ChatParams { sessions: 900, ..p });
    vec![
        cell(
            "z-chat-9",
            v,
            chat(ChatParams {
                sessions_per_s: 6.0,
                ..ChatParams::default()
            }),
            9,
            H100_8B,
        ),
        cell(
            "z-chat-14-long",
            v,
            chat(ChatParams {
                sessions_per_s: 10.0,
                long_output_share: 0.15,
                ..ChatParams::default()
            }),
            14,
            H100_8B,
        ),
        cell(
            "z-chat-5-70b",
            v,
            chat(ChatParams {
                sessions_per_s: 2.5,
                system_tokens: 5120,
                ..ChatParams::default()
            }),
            5,
            "llama-3.1-70b-h100-tp4",
        ),
        slow(
            cell(
                "z-chat-9-a100-slows",
                v,
                chat(ChatParams {
                    sessions_per_s: 5.0,
                    user_tokens_min: 128,
                    user_tokens_max: 768,
                    ..ChatParams::default()
                }),
                9,
                "llama-3.1-8b-a100-40gb",
            ),
            vec![(4, 1.5, 60_000_000)],
        ),
        cell("z-rl-9", v, rl(30), 9, H100_8B),
        cell("z-rl-14-a100", v, rl(56), 14, "llama-3.1-8b-a100-40gb"),
        cell("z-weka-c32-9", v, weka(32, 1, Some(24)), 9, H100_8B),
        cell(
            "z-weka-c20-5-a100",
            v,
            weka(20, 1, Some(16)),
            5,
            "llama-3.1-8b-a100-40gb",
        ),
        cell(
            "z-mooncake-x4-14",
            v,
            Source::Mooncake {
                speed: 4.0,
                max_requests: Some(3000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            14,
            H100_8B,
        ),
        slow(
            cell(
                "z-azure-x3-9-slows",
                v,
                Source::Azure {
                    speed: 3.0,
                    max_rows: Some(4000),
                    arrival_jitter: ARRIVAL_JITTER,
                },
                9,
                H100_8B,
            ),
            vec![(1, 2.0, 20_000_000)],
        ),
    ]
}

/// What one replay measured, as the goals read it.
#[derive(Clone, Debug, Serialize)]
pub struct Measured {
    pub cell: String,
    pub policy: String,
    pub seed: u64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub tpot_p99_ms: f64,
    pub output_tok_s: f64,
    pub session_p99_s: f64,
    pub hit_rate: f64,
    pub failed: usize,
    pub requests_per_replica: Vec<u64>,
    /// `kv_time` only: its predicted time to first token against the realized one, per request.
    pub calibration: Option<Calibration>,
    /// One row per request when the replay was asked to keep them (`model-eval --requests`): for
    /// looking into a figure, not part of the figures.
    #[serde(skip)]
    pub requests: Vec<serde_json::Value>,
}

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

fn calibration(h: &Harness) -> Option<Calibration> {
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

impl Measured {
    fn from(cell: &str, policy: &str, seed: u64, s: &Summary) -> Measured {
        Measured {
            cell: cell.into(),
            policy: policy.into(),
            seed,
            ttft_p50_ms: s.ttft_ms.p50,
            ttft_p99_ms: s.ttft_ms.p99,
            tpot_p99_ms: s.tpot_ms.p99,
            output_tok_s: s.output_tokens_per_s,
            session_p99_s: s.session_e2e_s.p99,
            hit_rate: s.hit_rate,
            failed: s.failed,
            requests_per_replica: s.requests_per_replica.clone(),
            calibration: None,
            requests: Vec::new(),
        }
    }
}

/// One request of a replay as a row: when it was issued, where it ran, its prompt and what of it
/// was cached, its time to first token, and the decision's explanation when there is one.
fn request_row(r: &crate::RequestRecord) -> serde_json::Value {
    json!({
        "id": r.id,
        "issued_ms": r.issued_us as f64 / 1e3,
        "session": r.upstream_header("x-session-id"),
        "replica": r.replica,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "completion_tokens": r.completion_tokens,
        "ttft_ms": r.first_token_us.map(|t| t.saturating_sub(r.issued_us) as f64 / 1e3),
        "explained": r.explained,
    })
}

/// Replays one cell under one policy spec for one seed; `keep_requests` keeps a row per request in
/// [`Measured::requests`].
pub fn replay(
    module: &FilterModule,
    traces: &Path,
    c: &Cell,
    spec: &str,
    seed: u64,
    keep_requests: bool,
) -> Result<Measured, String> {
    replay_shaped(module, traces, c, spec, seed, keep_requests, &|_| {})
}

/// [`replay`] with the built workload passed through `shape` before it is driven: the fleet bench
/// (`bench::fleet`) cuts its traces to a number of sessions and turns there, which a [`Source`]
/// cannot say, so that its largest fleets replay in seconds.
pub fn replay_shaped(
    module: &FilterModule,
    traces: &Path,
    c: &Cell,
    spec: &str,
    seed: u64,
    keep_requests: bool,
    shape: &dyn Fn(&mut kvsteer_workload::Workload),
) -> Result<Measured, String> {
    replay_configured(module, traces, c, spec, seed, keep_requests, shape, &|_| {}).map(|(m, _)| m)
}

/// [`replay_shaped`] with the harness configuration passed through `configure` before the harness
/// starts, and the harness returned after the replay: the churn bench (`bench::churn`) adds a
/// discovery source and its membership schedule there, and reads which member served what from
/// the harness's records afterwards.
#[allow(clippy::too_many_arguments)]
pub fn replay_configured(
    module: &FilterModule,
    traces: &Path,
    c: &Cell,
    spec: &str,
    seed: u64,
    keep_requests: bool,
    shape: &dyn Fn(&mut kvsteer_workload::Workload),
    configure: &dyn Fn(&mut crate::HarnessConfig),
) -> Result<(Measured, Harness), String> {
    let scenario = Scenario {
        id: c.id.clone(),
        group: "eval",
        source: c.source.clone(),
        proxies: 1,
        spread: crate::ProxySpread::PerRequest,
        endpoints: c.replicas,
        dp_ranks: 1,
        pd_prefill: 0,
    };
    let (mut workload, mode) = scenario.build(traces, seed)?;
    shape(&mut workload);
    let (policy, noop) = match spec.strip_suffix(NOOP) {
        Some(p) => (p, true),
        None => (spec, false),
    };
    let mut cfg = run::config(policy, workload.block_size, seed, 2);
    cfg.replicas = c.replicas;
    cfg.engine = Scenario::engine_for(
        Profile::named(c.profile).unwrap_or_default(),
        workload.block_size,
        seed,
    );
    cfg.slowdowns = c.slowdowns.clone();
    if policy.starts_with("kv_time") {
        // The operator names the engine the fleet runs, as the configuration reference says.
        if !cfg.routing["kv_time"].is_object() {
            cfg.routing["kv_time"] = json!({});
        }
        cfg.routing["kv_time"]["profile"] = json!(c.profile);
        // Each response then carries the prediction the request was routed on.
        cfg.filter_extra
            .insert("explain_header".into(), json!(EXPLAIN_HEADER));
    }
    if noop {
        let s = cfg.routing["seed"].as_u64().unwrap_or(0);
        cfg.routing["seed"] = json!(s ^ 0x5EED_0000_0000);
    }
    configure(&mut cfg);
    let mut h = Harness::new(module, cfg).map_err(|e| format!("{}: {spec}: {e}", c.id))?;
    h.run_workload(Driver::new(workload, mode), |_, _| {})
        .map_err(|e| format!("{}: {spec}: {e}", c.id))?;
    let s = h.summary(spec);
    let mut m = Measured::from(&c.id, spec, seed, &s);
    m.calibration = calibration(&h);
    if keep_requests {
        m.requests = h.records().map(request_row).collect();
    }
    Ok((m, h))
}

/// The response header `kv_time` replays carry their predictions in.
pub const EXPLAIN_HEADER: &str = "x-kvsteer-explain";

/// The median of `v` (NaN for an empty slice).
pub fn median(v: &[f64]) -> f64 {
    let mut s: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
    if s.is_empty() {
        return f64::NAN;
    }
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predictions_are_read_from_the_explanation_and_ranks_correlate() {
        let text = "winner=1; 0: cost=0.5 wait=0.1 prefill=0.2 decode=0 stall=0 evict=0; \
                    1: cost=0.3 wait=0.05 prefill=0.1 decode=0 stall=0 evict=0";
        assert!((predicted_ttft_s(text).unwrap() - 0.15).abs() < 1e-12);
        assert_eq!(
            predicted_ttft_s("winner=7; 0: cost=1 wait=0 prefill=1"),
            None
        );
        assert_eq!(predicted_ttft_s("garbage"), None);
        assert!(
            (rank_correlation(&[1.0, 2.0, 3.0, 4.0], &[10.0, 20.0, 30.0, 40.0]) - 1.0).abs()
                < 1e-12
        );
        assert!(
            (rank_correlation(&[1.0, 2.0, 3.0, 4.0], &[4.0, 3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12
        );
        assert!(rank_correlation(&[1.0], &[1.0]).is_nan());
    }

    #[test]
    fn cells_are_unique_and_the_sets_apart() {
        let mut ids: Vec<String> = training(false)
            .into_iter()
            .chain(validation())
            .chain(validation2())
            .chain(validation3())
            .chain(validation4())
            .chain(validation5())
            .map(|c| c.id)
            .collect();
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n);
        assert!(validation().iter().all(|c| c.set == Set::Validation));
        assert!(validation2().iter().all(|c| c.set == Set::Validation2));
        assert!(validation3().iter().all(|c| c.set == Set::Validation3));
        assert!(validation4().iter().all(|c| c.set == Set::Validation4));
        assert!(validation5().iter().all(|c| c.set == Set::Validation5));
        for c in validation()
            .into_iter()
            .chain(validation2())
            .chain(validation3())
            .chain(validation4())
            .chain(validation5())
        {
            assert!(Profile::named(c.profile).is_some(), "{}", c.profile);
            assert!(
                c.slowdowns
                    .iter()
                    .all(|&(r, f, _)| r < c.replicas && f >= 1.0)
            );
        }
    }
}
