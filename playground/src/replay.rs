//! One policy's replay of a workload through the routing core and simulated engines, in virtual time.
//!
//! The loop does in-process what the proxy-wasm filter and the wasmtime harness do across the ABI:
//! every `feed_period_ms` the router asks each engine for its feed (`Router::feed_query`,
//! `Engine::feed`, `Router::apply_feed`); each request the workload driver issues is routed
//! (`Router::route`), admitted (`Router::admit`) and submitted to the chosen engine; the engine's first
//! token, each further token and the end are reported to the router (`first_token`,
//! `decode_progress`, `release`) and to the workload `Recorder`; per-replica decode blocks are sampled
//! every 0.5 s. No logic of the router, the engines or the measurements is copied here: this module
//! only moves events between them. It is the same code natively and in the page, so a native run
//! (`playground-replay`) gives the page's numbers for the same request.

use std::collections::HashMap;
use std::path::PathBuf;

use kvsteer_core::block::BlockHasher;
use kvsteer_core::request::Endpoint;
use kvsteer_core::{PolicyKind, PromptIdentity, RouteRequest, Router, RoutingConfig};
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest};
use kvsteer_workload::measure::Percentiles;
use kvsteer_workload::{Driver, Issue, Mode, Recorder, Workload, mooncake, rl, weka};
use serde::{Deserialize, Serialize};

/// Which workload to replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum WorkloadChoice {
    /// The RL rollouts with stragglers of docs/design/design.md section 7, scaled: `steps` x 8
    /// rollouts x `turns`.
    Rl {
        steps: usize,
        turns: usize,
        concurrency: usize,
        /// Divides every token count (prompt parts and outputs) of the design's workload; 1 = as
        /// designed.
        scale: usize,
    },
    /// A slice of the coding-agent trace (`weka_cc_sample36.jsonl`; the page loads its first lines).
    Coding {
        sessions: usize,
        concurrency: usize,
        /// Prompts above this are skipped (the trace reader's rule).
        max_prompt_tokens: u32,
    },
    /// A slice of the Mooncake trace, open loop at its arrival times times `speed`.
    Mooncake { requests: usize, speed: f64 },
}

/// What the page asks for: one workload, one routing configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplayRequest {
    pub workload: WorkloadChoice,
    pub replicas: usize,
    /// The routing configuration (the filter's `routing` object: policy and coefficients). Its
    /// `block_size` is set from the workload.
    pub routing: serde_json::Value,
    /// KV cache of each simulated engine, in 16-token blocks (0: the simulator's H100 default).
    #[serde(default)]
    pub kv_blocks_16: u32,
    /// How often the router polls each engine's feed.
    #[serde(default = "default_feed_period_ms")]
    pub feed_period_ms: u64,
    /// Engine seed (the router's seed is in `routing`).
    #[serde(default)]
    pub seed: u64,
}

fn default_feed_period_ms() -> u64 {
    200
}

/// Decode-load sampling period (docs/design/design.md section 7: every 0.5 s).
pub const SAMPLE_US: u64 = 500_000;
/// Points kept for the TTFT CDF drawn in the page.
pub const CDF_POINTS: usize = 200;

/// What the page shows for one policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplayResult {
    pub policy: String,
    pub workload: String,
    pub requests: usize,
    pub failed: usize,
    pub ttft_ms: Stat,
    pub tpot_ms: Stat,
    /// Per session (RL: per rollout) end to end, seconds.
    pub session_e2e_s: Stat,
    pub output_tokens_per_s: f64,
    /// Engine-reported cached prompt tokens / prompt tokens.
    pub hit_rate: f64,
    pub decode_cv: Option<f64>,
    pub requests_per_replica: Vec<u64>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub span_s: f64,
    /// Decode blocks per replica over time: (seconds, per-replica mean of the bin).
    pub decode_series: Vec<(f64, Vec<f64>)>,
    /// TTFT CDF: up to [`CDF_POINTS`] (ms, fraction) points.
    pub ttft_cdf: Vec<(f64, f64)>,
    /// Virtual seconds simulated.
    pub virtual_s: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Stat {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

impl From<&Percentiles> for Stat {
    fn from(p: &Percentiles) -> Stat {
        Stat {
            p50: p.p50,
            p90: p.p90,
            p99: p.p99,
            mean: p.mean,
        }
    }
}

pub fn policy_names() -> Vec<&'static str> {
    PolicyKind::ALL.iter().map(|p| p.name()).collect()
}

/// Builds the workload. `trace` is the trace text for the trace-based workloads.
pub fn build_workload(choice: &WorkloadChoice, trace: &str) -> Result<Workload, String> {
    match choice {
        WorkloadChoice::Rl {
            steps,
            turns,
            concurrency,
            scale,
        } => {
            let s = (*scale).max(1);
            let d = rl::RlParams::default();
            let p = rl::RlParams {
                steps: (*steps).clamp(1, 10),
                turns: (*turns).clamp(1, 10),
                concurrency: (*concurrency).max(1),
                system_tokens: d.system_tokens / s,
                step_tokens: d.step_tokens / s,
                rollout_tokens: d.rollout_tokens / s,
                env_tokens_min: d.env_tokens_min / s,
                env_tokens_max: d.env_tokens_max / s,
                output_tokens: (d.output_tokens / s as u32).max(1),
                straggler_output_tokens: (d.straggler_output_tokens / s as u32).max(1),
                ..d
            };
            rl::generate(&p).map_err(|e| e.to_string())
        }
        WorkloadChoice::Coding {
            sessions,
            concurrency,
            max_prompt_tokens,
        } => {
            let p = weka::WekaParams {
                path: PathBuf::from("weka_cc_sample36.jsonl"),
                max_sessions: Some((*sessions).max(1)),
                concurrency: (*concurrency).max(1),
                max_prompt_tokens: *max_prompt_tokens,
                ..weka::WekaParams::default()
            };
            weka::parse(trace, &p).map_err(|e| e.to_string())
        }
        WorkloadChoice::Mooncake { requests, speed } => {
            let p = mooncake::MooncakeParams {
                path: PathBuf::from("mooncake_synthetic_trace.jsonl"),
                max_requests: Some((*requests).max(1)),
                speed: if *speed > 0.0 { *speed } else { 1.0 },
                ..mooncake::MooncakeParams::default()
            };
            mooncake::parse(trace, &p).map_err(|e| e.to_string())
        }
    }
}

struct Flight {
    replica: usize,
    generated: u64,
    output: Vec<u32>,
}

/// Runs one replay to the end.
pub fn run(req: &ReplayRequest, trace: &str) -> Result<ReplayResult, String> {
    let mut replay = Replay::new(req, trace)?;
    while let Some(t) = replay.next_time() {
        replay.now = t.max(replay.now);
        replay.advance_engines();
        replay.poll_feeds_when_due();
        replay.sample_when_due();
        replay.issue_due_requests();
    }
    Ok(replay.result())
}

/// One replay in virtual time: the router and the simulated engines it routes to, the workload's
/// driver, and what is recorded.
struct Replay {
    policy: String,
    name: String,
    router: Router,
    hasher: BlockHasher,
    engines: Vec<Engine>,
    driver: Driver,
    recorder: Recorder,
    flights: HashMap<u64, Flight>,
    events: Vec<EngineEvent>,
    issues: Vec<Issue>,
    feed_period_us: u64,
    next_feed: u64,
    next_sample: u64,
    now: u64,
}

impl Replay {
    /// The fleet and the router as the request asks (the workload's block size imposed on the
    /// routing section), nothing run yet.
    fn new(req: &ReplayRequest, trace: &str) -> Result<Replay, String> {
        if req.replicas == 0 || req.replicas > 64 {
            return Err(format!("replicas must be 1..=64, got {}", req.replicas));
        }
        let workload = build_workload(&req.workload, trace)?;
        let block_size = workload.block_size as usize;
        let mut routing = req.routing.clone();
        match &mut routing {
            serde_json::Value::Object(m) => {
                m.insert("block_size".into(), block_size.into());
            }
            _ => return Err("routing must be a JSON object".into()),
        }
        let cfg = RoutingConfig::from_json(&routing.to_string()).map_err(|e| e.to_string())?;
        let policy = cfg.policy.name().to_string();
        let router = Router::new(cfg, req.replicas).map_err(|e| e.to_string())?;
        let hasher = BlockHasher::new(block_size).map_err(|e| e.to_string())?;

        let mut engine_cfg = EngineConfig {
            block_size,
            seed: req.seed,
            ..EngineConfig::default()
        };
        let kv16 = if req.kv_blocks_16 > 0 {
            req.kv_blocks_16
        } else {
            engine_cfg.profile.kv_blocks_16
        };
        engine_cfg.kv_blocks = ((kv16 as u64 * 16) / block_size as u64).max(1) as u32;
        let engines = (0..req.replicas)
            .map(|r| Engine::new(engine_cfg.for_replica(r)))
            .collect();

        let name = workload.name.clone();
        let mode = match (&req.workload, workload.default_mode) {
            (WorkloadChoice::Mooncake { .. }, _) => Mode::Open,
            (_, m) => m,
        };
        Ok(Replay {
            policy,
            name,
            router,
            hasher,
            engines,
            driver: Driver::new(workload, mode),
            recorder: Recorder::new(),
            flights: HashMap::new(),
            events: Vec::new(),
            issues: Vec::new(),
            feed_period_us: req.feed_period_ms.max(1) * 1000,
            next_feed: 0,
            next_sample: 0,
            now: 0,
        })
    }

    /// The next moment something happens (a feed poll, a sample, the workload, an engine step);
    /// `None` once the workload is done and nothing is in flight.
    fn next_time(&self) -> Option<u64> {
        let driver_wake = self.driver.next_wakeup();
        if driver_wake.is_none() && self.flights.is_empty() {
            return None;
        }
        let mut t = self.next_feed.min(self.next_sample);
        if let Some(w) = driver_wake {
            t = t.min(w);
        }
        for e in &self.engines {
            if let Some(x) = e.next_event_time() {
                t = t.min(x);
            }
        }
        Some(t)
    }

    /// Every engine whose next event is due steps, and its events reach the router, the recorder
    /// and the driver.
    fn advance_engines(&mut self) {
        for (r, engine) in self.engines.iter_mut().enumerate() {
            if engine.next_event_time().is_some_and(|x| x <= self.now) {
                engine.advance(self.now, &mut self.events);
                for ev in self.events.drain(..) {
                    handle_event(
                        r,
                        ev,
                        &mut self.router,
                        &mut self.recorder,
                        &mut self.driver,
                        &mut self.flights,
                    );
                }
            }
        }
    }

    /// Every feed polled and applied, once a feed period.
    fn poll_feeds_when_due(&mut self) {
        if self.now < self.next_feed {
            return;
        }
        for (r, engine) in self.engines.iter_mut().enumerate() {
            let q = self
                .router
                .feed_query(r, kvsteer_core::feed::DEFAULT_MAX_EVENTS);
            let batch = engine.feed(&q);
            self.router.apply_feed(r, &batch);
        }
        self.next_feed = self.now + self.feed_period_us;
    }

    /// The engines' decode blocks sampled for the page's series.
    fn sample_when_due(&mut self) {
        if self.now < self.next_sample {
            return;
        }
        let blocks: Vec<u64> = self.engines.iter().map(Engine::decode_blocks).collect();
        self.recorder.sample(self.now, &blocks);
        self.next_sample = self.now + SAMPLE_US;
    }

    /// The requests the workload issues now, each routed, admitted and submitted to its engine.
    fn issue_due_requests(&mut self) {
        let now = self.now;
        // Taken out and put back so its capacity is reused on every poll.
        let mut issues = std::mem::take(&mut self.issues);
        self.driver.poll(now, &mut issues);
        for issue in issues.drain(..) {
            self.recorder.issued_from(&issue);
            let hashes = self.hasher.sequence_hashes(&issue.prompt);
            let route_req = RouteRequest {
                endpoint: Endpoint::Completions,
                model: None,
                stream: true,
                output_hint: Some(issue.output_tokens as u64),
                session_key: Some(issue.session_id.clone()),
                prompt_tokens: issue.prompt.len() as u64,
                identity: PromptIdentity::Exact(hashes),
            };
            let d = self
                .router
                .route_and_admit(issue.request_id, &route_req, now / 1000);
            self.recorder.routed(issue.request_id, d.replica);
            let submitted = self.engines[d.replica].submit(
                now,
                EngineRequest {
                    id: issue.request_id,
                    prompt: issue.prompt.to_vec(),
                    max_tokens: issue.output_tokens,
                    ignore_eos: true,
                    min_tokens: 0,
                },
            );
            match submitted {
                Ok(()) => {
                    let flight = Flight {
                        replica: d.replica,
                        generated: 0,
                        output: Vec::new(),
                    };
                    self.flights.insert(issue.request_id, flight);
                }
                Err(_) => {
                    // The engine refused it (too long for the context or the cache): failed, as a
                    // 400 would be; the session moves on.
                    self.router.release(issue.request_id);
                    self.recorder.failed(issue.request_id, now);
                    let _ = self.driver.fail(issue.request_id, now);
                }
            }
        }
        self.issues = issues;
    }

    /// The figures the page shows.
    fn result(self) -> ReplayResult {
        let s = self.recorder.summary(&self.policy);
        let mut ttft = self.recorder.ttft_ms();
        ttft.sort_by(f64::total_cmp);
        ReplayResult {
            policy: self.policy,
            workload: self.name,
            requests: s.requests,
            failed: s.failed,
            ttft_ms: (&s.ttft_ms).into(),
            tpot_ms: (&s.tpot_ms).into(),
            session_e2e_s: (&s.session_e2e_s).into(),
            output_tokens_per_s: s.output_tokens_per_s,
            hit_rate: s.hit_rate,
            decode_cv: s.decode_cv,
            requests_per_replica: s.requests_per_replica,
            prompt_tokens: s.prompt_tokens,
            cached_tokens: s.cached_tokens,
            span_s: s.span_s,
            decode_series: self.recorder.decode_series(),
            ttft_cdf: cdf(&ttft),
            virtual_s: self.now as f64 / 1e6,
        }
    }
}

fn handle_event(
    replica: usize,
    ev: EngineEvent,
    router: &mut Router,
    recorder: &mut Recorder,
    driver: &mut Driver,
    flights: &mut HashMap<u64, Flight>,
) {
    match ev {
        EngineEvent::FirstToken {
            id, t_us, token, ..
        } => {
            router.first_token(id);
            recorder.first_token(id, t_us);
            if let Some(f) = flights.get_mut(&id) {
                f.generated = 1;
                f.output.push(token);
                router.decode_progress(id, 1);
            }
        }
        EngineEvent::Token { id, token, .. } => {
            if let Some(f) = flights.get_mut(&id) {
                f.generated += 1;
                f.output.push(token);
                router.decode_progress(id, f.generated);
            }
        }
        EngineEvent::Finished {
            id,
            t_us,
            cached_tokens,
            completion_tokens,
            reason,
            ..
        } => {
            router.release(id);
            let flight = flights.remove(&id);
            debug_assert!(flight.as_ref().is_none_or(|f| f.replica == replica));
            if reason == kvsteer_sim::FinishReason::Abort {
                recorder.failed(id, t_us);
                let _ = driver.fail(id, t_us);
            } else {
                recorder.finished(id, t_us, cached_tokens as u64, completion_tokens as u64);
                let output = flight.map(|f| f.output).unwrap_or_default();
                let _ = driver.complete(id, t_us, &output);
            }
        }
    }
}

/// At most [`CDF_POINTS`] points of the empirical CDF of sorted values.
fn cdf(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(CDF_POINTS).max(1);
    let mut out: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (sorted[i], (i + 1) as f64 / n as f64))
        .collect();
    if out.last().is_some_and(|p| p.1 < 1.0) {
        out.push((sorted[n - 1], 1.0));
    }
    out
}

/// [`run`] with the result as JSON (the page's entry point uses this).
pub fn run_json(req: &ReplayRequest, trace: &str) -> Result<String, String> {
    let r = run(req, trace)?;
    serde_json::to_string(&r).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small_rl(policy: &str) -> ReplayRequest {
        ReplayRequest {
            workload: WorkloadChoice::Rl {
                steps: 1,
                turns: 3,
                concurrency: 4,
                scale: 8,
            },
            replicas: 2,
            routing: serde_json::json!({ "policy": policy }),
            kv_blocks_16: 2048,
            feed_period_ms: 200,
            seed: 1,
        }
    }

    #[test]
    fn a_small_rl_replay_finishes_every_request_and_is_deterministic() {
        let a = run(&small_rl("kv_load"), "").unwrap();
        assert_eq!(a.requests, 8 * 3, "{a:?}");
        assert_eq!(a.failed, 0);
        assert_eq!(a.requests_per_replica.iter().sum::<u64>(), 24);
        assert!(a.hit_rate > 0.0 && a.hit_rate < 1.0, "{}", a.hit_rate);
        assert!(!a.decode_series.is_empty());
        assert_eq!(a.ttft_cdf.last().map(|p| p.1), Some(1.0));
        let b = run(&small_rl("kv_load"), "").unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn policies_differ_on_the_same_workload() {
        let rr = run(&small_rl("round_robin"), "").unwrap();
        assert_eq!(rr.requests_per_replica, vec![12, 12]);
        let aff = run(&small_rl("kv_affinity"), "").unwrap();
        assert!(
            aff.hit_rate >= rr.hit_rate,
            "{} vs {}",
            aff.hit_rate,
            rr.hit_rate
        );
    }

    #[test]
    fn bad_requests_are_errors() {
        let mut r = small_rl("kv_load");
        r.replicas = 0;
        assert!(run(&r, "").is_err());
        let mut r = small_rl("nope");
        r.replicas = 2;
        assert!(run(&r, "").unwrap_err().contains("policy"));
        let r = ReplayRequest {
            workload: WorkloadChoice::Mooncake {
                requests: 5,
                speed: 1.0,
            },
            ..small_rl("kv_load")
        };
        assert!(run(&r, "not a trace").is_err());
    }

    #[test]
    fn cdf_is_monotone_and_ends_at_one() {
        let v: Vec<f64> = (0..1000).map(f64::from).collect();
        let c = cdf(&v);
        assert!(c.len() <= CDF_POINTS + 1);
        assert!(c.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
        assert_eq!(c.last().unwrap().1, 1.0);
    }
}
