//! `kvsteer-sim`: simulated vLLM-like replicas behind real HTTP servers.
//!
//! ```text
//! kvsteer-sim serve --replicas N --host 127.0.0.1 --port P [--time-scale X] [--seed S]
//!     [--kv-blocks B] [--block-size 16] [--host-blocks H] [--max-batch-tokens 8192]
//!     [--max-running 256] [--max-model-len L] [--output-mean M] [--model NAME] [--name-prefix r]
//!     [--tokenizer stand_in|o200k_harmony|o200k_base] [--profile FILE.json] [--dp-ranks 1]
//!     [--max-loras 0] [--lora-load-ms 300]
//! ```
//! `--dp-ranks N` puts N data-parallel ranks (N engines) behind each replica's port, chosen by the
//! `x-data-parallel-rank` header or vLLM's internal balancer (docs/design/dp.md).
//! `--profile` replaces the default step-time profile (Llama-3.1-8B on an H100) with one read from
//! JSON, e.g. the one `scripts/fit-profile` fits to a real engine (docs/reports/fidelity.md); its
//! `max_model_len` applies unless `--max-model-len` is given, its `kv_blocks_16` unless
//! `--kv-blocks` is.
//! Replica i listens on port P+i and is named `<prefix><i>`; one line `ready <name> <host>:<port>` is
//! printed per replica once it listens. The process runs until killed.

use kvsteer_sim::engine::EngineConfig;
use kvsteer_sim::output::OutputLen;
use kvsteer_sim::server::{ReplicaConfig, start_replicas};
use std::io::Write;
use std::process::ExitCode;

const USAGE: &str = "usage: kvsteer-sim serve --replicas N --host 127.0.0.1 --port P [--time-scale X] \
[--seed S] [--kv-blocks B] [--block-size 16] [--host-blocks H] [--max-batch-tokens 8192] \
[--max-running 256] [--max-model-len L] [--output-mean M] [--model NAME] [--name-prefix r] \
[--tokenizer stand_in|o200k_harmony|o200k_base] [--profile FILE.json] [--dp-ranks 1] \
[--max-loras 0] [--lora-load-ms 300]";

fn parse<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
    let v = v.ok_or_else(|| format!("{flag} needs a value"))?;
    v.parse().map_err(|_| format!("{flag}: cannot parse {v:?}"))
}

fn run() -> Result<(), String> {
    // Kept whole: a flat match with one arm per flag, then the checks of what the flags set.
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("serve") => {}
        Some("-h" | "--help") | None => return Err(USAGE.into()),
        Some(other) => return Err(format!("unknown command {other:?}\n{USAGE}")),
    }
    let mut engine = EngineConfig::default();
    let mut cfg = ReplicaConfig {
        name: String::new(),
        host: "127.0.0.1".into(),
        port: 8000,
        time_scale: 1.0,
        model: "llama-3.1-8b-sim".into(),
        engine: EngineConfig::default(),
        dp_ranks: 1,
    };
    let mut replicas = 1usize;
    let mut kv_blocks: Option<u32> = None;
    let mut prefix = "r".to_string();
    let mut max_model_len: Option<u32> = None;
    while let Some(flag) = args.next() {
        let v = args.next();
        match flag.as_str() {
            "--replicas" => replicas = parse(&flag, v)?,
            "--dp-ranks" => cfg.dp_ranks = parse(&flag, v)?,
            "--host" => cfg.host = parse(&flag, v)?,
            "--port" => cfg.port = parse(&flag, v)?,
            "--time-scale" => cfg.time_scale = parse(&flag, v)?,
            "--seed" => engine.seed = parse(&flag, v)?,
            "--kv-blocks" => kv_blocks = Some(parse(&flag, v)?),
            "--block-size" => engine.block_size = parse(&flag, v)?,
            "--host-blocks" => engine.host_blocks = parse(&flag, v)?,
            "--max-batch-tokens" => engine.max_batch_tokens = parse(&flag, v)?,
            "--max-running" => engine.max_running = parse(&flag, v)?,
            // LoRA adapter slots (vLLM `--max-loras`; 0: off) and one load's time (docs/design/simulator.md).
            "--max-loras" => engine.lora.slots = parse(&flag, v)?,
            "--lora-load-ms" => engine.lora.load_us = parse::<u64>(&flag, v)?.saturating_mul(1000),
            "--max-model-len" => max_model_len = Some(parse(&flag, v)?),
            "--profile" => {
                let path: String = parse(&flag, v)?;
                let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
                engine.profile =
                    kvsteer_sim::Profile::from_json(&text).map_err(|e| format!("{path}: {e}"))?;
            }
            "--output-mean" => {
                engine.output_len = OutputLen::Exponential {
                    mean: parse(&flag, v)?,
                }
            }
            "--model" => cfg.model = parse(&flag, v)?,
            "--name-prefix" => prefix = parse(&flag, v)?,
            "--tokenizer" => {
                let kind: kvsteer_sim::tokenize::TokenizerKind =
                    v.ok_or("--tokenizer needs a value")?.parse()?;
                kvsteer_sim::tokenize::select(kind)?;
            }
            _ => return Err(format!("unknown flag {flag:?}\n{USAGE}")),
        }
    }
    if replicas == 0 || replicas > 1024 {
        return Err("--replicas must be between 1 and 1024".into());
    }
    if cfg.dp_ranks == 0 || cfg.dp_ranks > kvsteer_core::dp::MAX_DP_RANKS as usize {
        return Err(format!(
            "--dp-ranks must be between 1 and {}",
            kvsteer_core::dp::MAX_DP_RANKS
        ));
    }
    if engine.block_size == 0 || engine.block_size > kvsteer_core::block::MAX_BLOCK_SIZE {
        return Err(format!(
            "--block-size must be between 1 and {}",
            kvsteer_core::block::MAX_BLOCK_SIZE
        ));
    }
    engine.max_model_len = max_model_len.unwrap_or(engine.profile.max_model_len);
    // The GPU memory is fixed: without --kv-blocks, bigger blocks mean fewer of them.
    engine.kv_blocks = kv_blocks.unwrap_or_else(|| {
        (engine.profile.kv_blocks_16 as usize * 16 / engine.block_size).max(1) as u32
    });
    if engine.kv_blocks == 0 {
        return Err("--kv-blocks must be at least 1".into());
    }
    if !(cfg.time_scale.is_finite() && cfg.time_scale > 0.0) {
        return Err("--time-scale must be a positive number".into());
    }
    cfg.engine = engine;
    let started = start_replicas(&cfg, replicas, &prefix).map_err(|e| format!("bind: {e}"))?;
    let mut out = std::io::stdout().lock();
    for r in &started {
        let _ = writeln!(out, "ready {} {}", r.name(), r.addr());
    }
    let _ = out.flush();
    drop(out);
    loop {
        std::thread::park();
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kvsteer-sim: {e}");
            ExitCode::from(2)
        }
    }
}
