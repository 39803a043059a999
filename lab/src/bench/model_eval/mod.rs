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

mod calibration;
mod rounds;

pub use calibration::{Calibration, predicted_ttft_s, rank_correlation};
pub use rounds::{
    WEKA_SAMPLES, WEKA_VALIDATION_FLEETS, WEKA_VALIDATION_LEVELS, WEKA_VALIDATION_QUICK_SESSIONS,
    training, validation, validation2, validation3, validation4, validation5, weka_validation,
};

use super::run;
use super::scenario::{Scenario, Source};
use kvsteer_host_test::{FilterModule, Harness};
use kvsteer_sim::Profile;
use kvsteer_workload::{Driver, Summary};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::path::Path;

/// Which set a cell belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
    /// The coding-agent validation samples (docs/reports/model-eval.md): three more
    /// samples of the coding-agent corpus beside the training one, replayed whole on 4 and 9
    /// replicas, written down before any replay of them.
    WekaValidation,
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
    /// `(replica, factor, from_us)`: engines slower than their profile ([`kvsteer_host_test::HarnessConfig::slowdowns`]).
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

/// What one replay measured, as the goals read it.
#[derive(Clone, Debug, Serialize)]
pub struct Measured {
    pub cell: String,
    pub policy: String,
    pub seed: u64,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub tpot_p99_ms: f64,
    pub output_tok_s: f64,
    /// A session's wall time (its first request issued to its last request's completion), over
    /// the sessions of the run: what a coding agent's user waits for the whole task.
    pub session_p50_s: f64,
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

impl Measured {
    fn from(cell: &str, policy: &str, seed: u64, s: &Summary) -> Measured {
        Measured {
            cell: cell.into(),
            policy: policy.into(),
            seed,
            ttft_mean_ms: s.ttft_ms.mean,
            ttft_p50_ms: s.ttft_ms.p50,
            ttft_p99_ms: s.ttft_ms.p99,
            tpot_p99_ms: s.tpot_ms.p99,
            output_tok_s: s.output_tokens_per_s,
            session_p50_s: s.session_e2e_s.p50,
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
fn request_row(r: &kvsteer_host_test::RequestRecord) -> serde_json::Value {
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
    configure: &dyn Fn(&mut kvsteer_host_test::HarnessConfig),
) -> Result<(Measured, Harness), String> {
    let (mut workload, mode) = scenario(c).build(traces, seed)?;
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
    m.calibration = calibration::calibration(&h);
    if keep_requests {
        m.requests = h.records().map(request_row).collect();
    }
    Ok((m, h))
}

/// The scenario a cell replays: its workload on its fleet, one proxy.
pub fn scenario(c: &Cell) -> Scenario {
    Scenario {
        id: c.id.clone(),
        group: "eval",
        source: c.source.clone(),
        proxies: 1,
        spread: kvsteer_host_test::ProxySpread::PerRequest,
        endpoints: c.replicas,
        dp_ranks: 1,
        pd_prefill: 0,
    }
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
            .chain(weka_validation(false))
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

    /// The coding-agent validation set: 4 samples x 4 levels x 2 fleets, ids naming all three, each
    /// sample's own file, replayed whole once (the first 16 sessions at `--quick`), 8B on H100s.
    #[test]
    fn weka_validation_has_32_cells_over_the_four_samples() {
        let files = [
            ("train", "weka_cc_sample36.jsonl.xz"),
            ("v1", "weka_cc_validation_v1.jsonl.xz"),
            ("v2", "weka_cc_validation_v2.jsonl.xz"),
            ("v3", "weka_cc_validation_v3.jsonl.xz"),
        ];
        for quick in [false, true] {
            let cells = weka_validation(quick);
            assert_eq!(cells.len(), 32);
            let mut expected = Vec::new();
            for (name, file) in files {
                for replicas in [4, 9] {
                    for c in [16, 24, 32, 40] {
                        expected.push((format!("wv-{name}-c{c}-{replicas}"), file, c, replicas));
                    }
                }
            }
            for (cell, (id, file, c, replicas)) in cells.iter().zip(expected) {
                assert_eq!(cell.id, id);
                assert_eq!(cell.set, Set::WekaValidation);
                assert_eq!(cell.replicas, replicas, "{id}");
                assert_eq!(cell.profile, "llama-3.1-8b-h100", "{id}");
                assert!(cell.slowdowns.is_empty(), "{id}");
                let Source::Weka {
                    concurrency,
                    copies,
                    max_sessions,
                    think_jitter,
                    file: f,
                } = cell.source
                else {
                    panic!("{id}: not a coding-agent cell")
                };
                assert_eq!(
                    (f, concurrency, copies),
                    (file, c, rounds::WEKA_VALIDATION_COPIES),
                    "{id}"
                );
                assert_eq!(max_sessions, quick.then_some(16), "{id}");
                assert_eq!(think_jitter, crate::bench::scenario::THINK_JITTER, "{id}");
            }
        }
    }

    /// Each sample's cells load: the scenario reads the sample's own file (the sessions it keeps
    /// under the 128K cap, or its first 16 at `--quick`), and two seeds draw different think times.
    #[test]
    fn weka_validation_cells_read_their_own_sample() {
        let traces = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces");
        let kept = [("train", 28), ("v1", 27), ("v2", 28), ("v3", 32)];
        for c in weka_validation(false)
            .iter()
            .filter(|c| c.id.ends_with("-c16-4"))
        {
            let (w, _) = scenario(c).build(&traces, 0).unwrap();
            let want = kept.iter().find(|(n, _)| c.id == format!("wv-{n}-c16-4"));
            let copies = rounds::WEKA_VALIDATION_COPIES;
            assert_eq!(w.sessions.len(), want.unwrap().1 * copies, "{}", c.id);
            let second = w.sessions.iter().filter(|s| s.id.contains('#')).count();
            assert_eq!(second, want.unwrap().1 * (copies - 1), "{}", c.id);
        }
        let quick = &weka_validation(true)[8];
        assert_eq!(quick.id, "wv-v1-c16-4");
        let (a, _) = scenario(quick).build(&traces, 0).unwrap();
        let (b, _) = scenario(quick).build(&traces, 1).unwrap();
        assert!(a.sessions.len() <= 16 * rounds::WEKA_VALIDATION_COPIES && !a.sessions.is_empty());
        let think = |w: &kvsteer_workload::Workload| -> Vec<u64> {
            w.sessions
                .iter()
                .flat_map(|s| &s.turns)
                .map(|t| t.think_us)
                .collect()
        };
        assert_ne!(think(&a), think(&b));
    }
}
