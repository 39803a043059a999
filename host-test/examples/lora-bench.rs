//! LoRA adapters over a shared fleet, through the compiled filter: requests for many adapters with
//! Zipf popularity, open loop, over replicas with few adapter slots each, routed by `kv_time` with
//! its adapter term, by `kv_time` and `kv_load` adapter-blind, and by `adapter_affinity` (the
//! Gateway API Inference Extension's rule). Every policy replays the same requests for a seed
//! (paired draws). Prints one JSON line per run and a Markdown table (docs/reports/lora.md).
//!
//! `cargo run --release -p kvsteer-host-test --example lora-bench -- [KEY=VALUE ...]`, keys (defaults):
//! `seeds=5 replicas=6 slots=4 adapters=48 zipf=1.0 rate=12 seconds=60 load_ms=300 prefix=1024
//! unique=512 output=128`: requests a second (Poisson), seconds of arrivals, tokens of each
//! adapter's shared prompt prefix, of each request's own part, and generated.

use kvsteer_core::rng::SplitMix64;
use kvsteer_host_test::{FilterModule, Harness, HarnessConfig, filter_wasm_path};
use kvsteer_sim::EngineConfig;
use kvsteer_sim::lora::LoraConfig;
use kvsteer_workload::{Driver, Mode, Prompt, Session, Turn, Workload};
use serde_json::json;
use std::collections::BTreeMap;

/// LoRA adapters over a shared fleet, through the compiled filter: policies with and without the
/// adapter term on the same Zipf-popular requests.
#[derive(Clone, Debug, clap::Parser)]
#[command(
    name = "lora-bench",
    args_override_self = true,
    after_help = "Every flag may also be given as KEY=VALUE, e.g. `seeds=5 load_ms=300` \
                  (the form docs/reports/lora.md uses)."
)]
struct Params {
    /// Seeds run, 1 to SEEDS; every policy replays the same requests for a seed.
    #[arg(long, value_name = "N", default_value_t = 5)]
    seeds: u64,
    /// Replicas in the fleet (at least 1).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 6,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    replicas: usize,
    /// Adapter slots of each replica: adapters it holds loaded at once.
    #[arg(long, value_name = "N", default_value_t = 4)]
    slots: u32,
    /// Distinct adapters requested (at least 1).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 48,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    adapters: usize,
    /// Zipf exponent of the adapters' popularity: adapter k drawn with weight 1 / (k + 1)^zipf.
    #[arg(long, value_name = "S", default_value_t = 1.0)]
    zipf: f64,
    /// Requests a second (Poisson arrivals, open loop; positive).
    #[arg(long, value_name = "PER_S", default_value_t = 12.0, value_parser = positive)]
    rate: f64,
    /// Seconds of arrivals, in virtual time.
    #[arg(long, value_name = "S", default_value_t = 60.0)]
    seconds: f64,
    /// Milliseconds to load an adapter into a slot (the engine's cost and the policies' estimate).
    #[arg(long, value_name = "MS", default_value_t = 300)]
    load_ms: u64,
    /// Tokens of each adapter's shared prompt prefix.
    #[arg(long, value_name = "TOKENS", default_value_t = 1024)]
    prefix: usize,
    /// Tokens of each request's own part of the prompt, after the prefix.
    #[arg(long, value_name = "TOKENS", default_value_t = 512)]
    unique: usize,
    /// Tokens generated per request.
    #[arg(long, value_name = "TOKENS", default_value_t = 128)]
    output: u32,
}

/// A positive rate.
fn positive(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x > 0.0 => Ok(x),
        Ok(_) => Err("must be positive".into()),
        Err(e) => Err(e.to_string()),
    }
}

impl Params {
    /// The command line: `KEY=VALUE` arguments (the older form, still what callers use) read as
    /// `--KEY=VALUE`, an underscore in KEY as a dash.
    fn from_args() -> Params {
        clap::Parser::parse_from(std::env::args().enumerate().map(
            |(i, a)| match a.split_once('=') {
                Some((k, v)) if i > 0 && !k.starts_with('-') => {
                    format!("--{}={v}", k.replace('_', "-"))
                }
                _ => a,
            },
        ))
    }
}

/// The adapter a session's requests use: its id is `lora-<k>-<n>`.
fn adapter_of(session: &str) -> Option<String> {
    let rest = session.strip_prefix("lora-")?;
    let (k, _) = rest.split_once('-')?;
    Some(format!("lora-{k}"))
}

fn tokens(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % 100_000) as u32).collect()
}

/// Open-loop single requests: Poisson arrivals, adapter `k` drawn with probability proportional to
/// `1 / (k + 1)^zipf`, each prompt the adapter's shared prefix and a part of its own.
fn workload(p: &Params, seed: u64) -> Workload {
    let mut rng = SplitMix64::new(seed ^ 0x6c6f_7261);
    let weights: Vec<f64> = (0..p.adapters)
        .map(|k| 1.0 / ((k + 1) as f64).powf(p.zipf))
        .collect();
    let total: f64 = weights.iter().sum();
    let prefixes: Vec<Vec<u32>> = (0..p.adapters)
        .map(|k| tokens(&mut SplitMix64::new(seed ^ (k as u64 + 1) << 20), p.prefix))
        .collect();
    let mut sessions = Vec::new();
    let mut t = 0.0f64;
    let end = p.seconds;
    let mut n = 0;
    loop {
        t += -(1.0 - rng.next_f64()).ln() / p.rate;
        if t >= end {
            break;
        }
        let mut x = rng.next_f64() * total;
        let k = weights
            .iter()
            .position(|w| {
                x -= w;
                x < 0.0
            })
            .unwrap_or(p.adapters - 1);
        let mut prompt = prefixes[k].clone();
        prompt.extend(tokens(&mut rng, p.unique));
        sessions.push(Session {
            id: format!("lora-{k}-{n}"),
            turns: vec![Turn {
                prompt: Prompt::Full(prompt),
                output_tokens: p.output,
                think_us: 0,
                arrival_us: Some((t * 1e6) as u64),
            }],
        });
        n += 1;
    }
    Workload {
        name: "lora".into(),
        params: vec![("seed".into(), seed.to_string())],
        block_size: 16,
        default_mode: Mode::Open,
        sessions,
        notes: Vec::new(),
    }
}

/// The compared policies: a label and the filter's `routing` section.
fn policies(p: &Params) -> Vec<(&'static str, serde_json::Value)> {
    let adapters = json!({"base_models": [kvsteer_host_test::openai::MODEL], "load_ms": p.load_ms});
    vec![
        (
            "kv_time + adapter term",
            json!({"policy": "kv_time", "block_size": 16, "adapters": adapters}),
        ),
        (
            "kv_time, adapter-blind",
            json!({"policy": "kv_time", "block_size": 16}),
        ),
        (
            "kv_load, adapter-blind",
            json!({"policy": "kv_load", "block_size": 16}),
        ),
        (
            "adapter_affinity (GIE rule)",
            json!({"policy": "adapter_affinity", "block_size": 16, "adapters": adapters}),
        ),
    ]
}

struct RunResult {
    ttft_p50_ms: f64,
    ttft_p99_ms: f64,
    loads_per_min: f64,
    requests: usize,
    failed: usize,
}

fn run(
    module: &FilterModule,
    p: &Params,
    routing: &serde_json::Value,
    seed: u64,
) -> Result<RunResult, String> {
    let mut cfg = HarnessConfig::small("kv_time");
    cfg.replicas = p.replicas;
    cfg.engine = EngineConfig {
        seed,
        lora: LoraConfig {
            slots: p.slots,
            load_us: p.load_ms * 1000,
        },
        ..EngineConfig::default()
    };
    cfg.routing = routing.clone();
    cfg.routing["seed"] = json!(seed);
    cfg.issue_model = Some(adapter_of);
    let mut h = Harness::new(module, cfg).map_err(|e| e.to_string())?;
    h.run_for(500_000).map_err(|e| e.to_string())?;
    let start_us = h.now_us();
    h.run_workload(Driver::new(workload(p, seed), Mode::Open), |_, _| {})
        .map_err(|e| e.to_string())?;
    let minutes = (h.now_us() - start_us) as f64 / 60e6;
    let loads: u64 = h.replicas.iter().map(|r| r.engine.adapter_loads()).sum();
    let s = h.summary("lora");
    Ok(RunResult {
        ttft_p50_ms: s.ttft_ms.p50,
        ttft_p99_ms: s.ttft_ms.p99,
        loads_per_min: loads as f64 / minutes.max(1e-9),
        requests: s.requests,
        failed: s.failed,
    })
}

fn main() -> Result<(), String> {
    let p = Params::from_args();
    let module = FilterModule::load(&filter_wasm_path()?).map_err(|e| e.to_string())?;
    let policies = policies(&p);
    let mut by_policy: BTreeMap<usize, Vec<RunResult>> = BTreeMap::new();
    for seed in 1..=p.seeds {
        for (i, (label, routing)) in policies.iter().enumerate() {
            let r = run(&module, &p, routing, seed)?;
            println!(
                "{}",
                json!({"policy": label, "seed": seed, "ttft_p50_ms": r.ttft_p50_ms,
                    "ttft_p99_ms": r.ttft_p99_ms, "adapter_loads_per_min": r.loads_per_min,
                    "requests": r.requests, "failed": r.failed})
            );
            by_policy.entry(i).or_default().push(r);
        }
    }
    println!("\n{p:?}\n");
    println!(
        "| policy | TTFT p50 (ms) | TTFT p99 (ms) | adapter loads / min | p99 better than kv_time + adapter term |"
    );
    println!("|---|---|---|---|---|");
    let base: Vec<f64> = by_policy[&0].iter().map(|r| r.ttft_p99_ms).collect();
    for (i, (label, _)) in policies.iter().enumerate() {
        let rs = &by_policy[&i];
        let stat = |f: &dyn Fn(&RunResult) -> f64| {
            let v: Vec<f64> = rs.iter().map(f).collect();
            let mean = v.iter().sum::<f64>() / v.len() as f64;
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{mean:.0} ({lo:.0}-{hi:.0})")
        };
        let wins = if i == 0 {
            "-".to_string()
        } else {
            let w = rs
                .iter()
                .zip(&base)
                .filter(|(r, b)| r.ttft_p99_ms < **b)
                .count();
            format!("{w} of {}", rs.len())
        };
        println!(
            "| {label} | {} | {} | {} | {wins} |",
            stat(&|r| r.ttft_p50_ms),
            stat(&|r| r.ttft_p99_ms),
            stat(&|r| r.loads_per_min),
        );
    }
    Ok(())
}
