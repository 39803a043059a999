//! `kvsteer-sim`: simulated vLLM-like replicas behind real HTTP servers.
//!
//! ```text
//! kvsteer-sim serve --replicas N --host 127.0.0.1 --port P [--time-scale X] [--seed S]
//!     [--kv-blocks B] [--block-size 16] [--host-blocks H] [--max-batch-tokens 8192]
//!     [--max-running 256] [--max-model-len L] [--output-mean M] [--model NAME] [--name-prefix r]
//!     [--tokenizer stand_in|o200k_harmony|o200k_base | --huggingface DIR] [--profile FILE.json|NAME] [--dp-ranks 1]
//!     [--max-loras 0] [--lora-load-ms 300] [--stall-every-s 0] [--stall-ms 1000] [--stall-seed 0]
//! ```
//! `--stall-every-s S` makes each replica stall at random, about every S seconds of engine time
//! (exponential gaps, drawn from the replica's seed and `--stall-seed`), for `--stall-ms` each: no
//! step runs during a stall, as in a real engine's host hiccup or GC pause (`kvsteer_sim::stall`);
//! 0, the default, is off. Like every time here they are engine time, divided by `--time-scale` on
//! the wall clock.
//! `--dp-ranks N` puts N data-parallel ranks (N engines) behind each replica's port, chosen by the
//! `x-data-parallel-rank` header or vLLM's internal balancer (docs/design/dp.md).
//! `--profile` replaces the default step-time profile (Llama-3.1-8B on an H100) with one read from
//! JSON, e.g. the one `scripts/fit-profile` fits to a real engine (docs/reports/fidelity.md), or
//! with a built-in one by name (`llama-3.1-70b-h100-tp4`, `llama-3.1-8b-a100-40gb`,
//! `llama-3.1-8b-h100`: the router's `kv_time` profiles of the same names); its
//! `max_model_len` applies unless `--max-model-len` is given, its `kv_blocks_16` unless
//! `--kv-blocks` is.
//! Replica i listens on port P+i and is named `<prefix><i>`; one line `ready <name> <host>:<port>` is
//! printed per replica once it listens. The process runs until killed. `kvsteer-sim serve --help`
//! lists every flag with its unit and default.

use clap::{Args, Parser, Subcommand};
use kvsteer_sim::engine::EngineConfig;
use kvsteer_sim::output::OutputLen;
use kvsteer_sim::server::{ReplicaConfig, start_replicas};
use kvsteer_sim::tokenize::TokenizerKind;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "kvsteer-sim",
    about = "Simulated vLLM-like replicas (engine model in virtual time) behind real \
             OpenAI-compatible HTTP servers."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Start the replicas; prints `ready <name> <host>:<port>` per replica once it listens, then
    /// runs until killed.
    Serve(Serve),
}

/// `serve`'s flags. A flag given twice keeps its last value; the engine defaults come from
/// `EngineConfig::default()`.
#[derive(Args, Debug)]
#[command(args_override_self = true)]
struct Serve {
    /// Replicas to start (1 to 1024), each an HTTP server on its own port.
    #[arg(long, value_name = "N", default_value_t = 1)]
    replicas: usize,
    /// Data-parallel ranks (engines) behind each replica's port, picked by the
    /// `x-data-parallel-rank` header or vLLM's internal balancer (docs/design/dp.md).
    #[arg(long, value_name = "N", default_value_t = 1)]
    dp_ranks: usize,
    /// Address the replicas listen on.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    host: String,
    /// TCP port of replica 0; replica i listens on PORT+i (0 picks free ports).
    #[arg(long, value_name = "P", default_value_t = 8000)]
    port: u16,
    /// Virtual seconds per wall-clock second (10: the simulated GPU runs ten times faster).
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    time_scale: f64,
    /// Seed of the engines' sampling (output lengths and ids); each replica derives its own.
    #[arg(long, value_name = "S", default_value_t = EngineConfig::default().seed)]
    seed: u64,
    /// GPU KV-cache blocks per engine (default: the profile's `kv_blocks_16` scaled to the block
    /// size, the same GPU memory).
    #[arg(long, value_name = "B")]
    kv_blocks: Option<u32>,
    /// Tokens per KV block.
    #[arg(long, value_name = "TOKENS", default_value_t = EngineConfig::default().block_size)]
    block_size: usize,
    /// Host-memory (CPU offload) KV blocks per engine; 0: no host tier.
    #[arg(long, value_name = "H", default_value_t = EngineConfig::default().host_blocks)]
    host_blocks: u32,
    /// Token budget of one engine step (vLLM `max_num_batched_tokens`), in tokens.
    #[arg(long, value_name = "TOKENS", default_value_t = EngineConfig::default().max_batch_tokens)]
    max_batch_tokens: u32,
    /// Most sequences running at once (vLLM `max_num_seqs`).
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().max_running)]
    max_running: u32,
    /// LoRA adapters resident on the GPU at once (vLLM `--max-loras`); 0: LoRA off.
    #[arg(long, value_name = "N", default_value_t = EngineConfig::default().lora.slots)]
    max_loras: u32,
    /// Time one adapter load adds to the step that admits its request, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = EngineConfig::default().lora.load_us / 1000)]
    lora_load_ms: u64,
    /// Mean engine-time seconds from the end of one random stall to the start of the next, per
    /// replica (exponential gaps drawn from the replica's seed); 0: no stalls. During a stall the
    /// engine runs no step, as a real one during a host hiccup, a GC pause or a slow collective.
    #[arg(long, value_name = "S", default_value_t = 0.0)]
    stall_every_s: f64,
    /// Engine-time length of each random stall (`--stall-every-s`), in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = EngineConfig::default().stall.len_us / 1000)]
    stall_ms: u64,
    /// Mixed into each replica's seed for its stall draws: another value, other stall times for
    /// otherwise the same replicas.
    #[arg(long, value_name = "N", default_value_t = 0)]
    stall_seed: u64,
    /// Context limit in tokens, prompt plus `max_tokens` (default: the profile's `max_model_len`).
    #[arg(long, value_name = "TOKENS")]
    max_model_len: Option<u32>,
    /// Step-time profile instead of the default (Llama-3.1-8B on an H100): a built-in one by name
    /// (llama-3.1-70b-h100-tp4, llama-3.1-8b-a100-40gb, llama-3.1-8b-h100) or a JSON file (e.g.
    /// from `scripts/fit-profile`); its `max_model_len` and `kv_blocks_16` apply unless
    /// `--max-model-len` and `--kv-blocks` are given.
    #[arg(long, value_name = "FILE.json|NAME")]
    profile: Option<PathBuf>,
    /// Mean output length in tokens of requests that do not set `ignore_eos` (exponentially
    /// distributed; default 256).
    #[arg(long, value_name = "TOKENS")]
    output_mean: Option<f64>,
    /// Served model name (requests may name any model; it is echoed back).
    #[arg(long, value_name = "NAME", default_value = "llama-3.1-8b-sim")]
    model: String,
    /// Replica i is named `<PREFIX><i>`.
    #[arg(long = "name-prefix", value_name = "PREFIX", default_value = "r")]
    prefix: String,
    /// How prompt text becomes token ids: stand_in, o200k_harmony or o200k_base (real BPE, the
    /// filter's own code).
    #[arg(long, value_name = "KIND", default_value = "stand_in")]
    tokenizer: TokenizerKind,
    /// A model folder with a Hugging Face bundle (`tokenizer.json`, `tokenizer_config.json`):
    /// prompts are tokenized and chats rendered with it, as an engine serving that model does
    /// (instead of `--tokenizer`).
    #[arg(long, value_name = "DIR", conflicts_with = "tokenizer")]
    huggingface: Option<PathBuf>,
}

fn run() -> Result<(), String> {
    let Command::Serve(args) = Cli::parse().command;
    let mut engine = EngineConfig {
        seed: args.seed,
        block_size: args.block_size,
        host_blocks: args.host_blocks,
        max_batch_tokens: args.max_batch_tokens,
        max_running: args.max_running,
        ..EngineConfig::default()
    };
    engine.lora.slots = args.max_loras;
    engine.lora.load_us = args.lora_load_ms.saturating_mul(1000);
    engine.stall = stall_config(&args)?;
    if let Some(path) = &args.profile {
        engine.profile = load_profile(path)?;
    }
    if let Some(mean) = args.output_mean {
        engine.output_len = OutputLen::Exponential { mean };
    }
    kvsteer_sim::tokenize::select(args.tokenizer)?;
    if let Some(dir) = &args.huggingface {
        kvsteer_sim::tokenize::select_huggingface(dir)?;
    }
    let mut cfg = ReplicaConfig {
        name: String::new(),
        host: args.host,
        port: args.port,
        time_scale: args.time_scale,
        model: args.model,
        engine: EngineConfig::default(),
        dp_ranks: args.dp_ranks,
    };
    let (replicas, kv_blocks, max_model_len, prefix) = (
        args.replicas,
        args.kv_blocks,
        args.max_model_len,
        args.prefix,
    );
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

/// `--stall-every-s`, `--stall-ms` and `--stall-seed`, engine time in seconds and milliseconds.
fn stall_config(args: &Serve) -> Result<kvsteer_sim::stall::StallConfig, String> {
    if !(args.stall_every_s.is_finite() && args.stall_every_s >= 0.0) {
        return Err("--stall-every-s must be a number of seconds, 0 or more".into());
    }
    Ok(kvsteer_sim::stall::StallConfig {
        mean_gap_us: (args.stall_every_s * 1e6).round() as u64,
        len_us: args.stall_ms.saturating_mul(1000),
        seed: args.stall_seed,
    })
}

/// `--profile`: a built-in profile's name, else a JSON file's path.
fn load_profile(arg: &std::path::Path) -> Result<kvsteer_sim::Profile, String> {
    if let Some(p) = arg.to_str().and_then(kvsteer_sim::Profile::named) {
        return Ok(p);
    }
    let text = std::fs::read_to_string(arg).map_err(|e| format!("{}: {e}", arg.display()))?;
    kvsteer_sim::Profile::from_json(&text).map_err(|e| format!("{}: {e}", arg.display()))
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn defaults_and_the_last_of_a_repeated_flag() {
        let cli = Cli::try_parse_from(["kvsteer-sim", "serve", "--port", "1", "--port", "2"]);
        let Command::Serve(a) = cli.expect("parses").command;
        assert_eq!((a.replicas, a.dp_ranks, a.port), (1, 1, 2));
        assert_eq!(
            (a.host.as_str(), a.model.as_str()),
            ("127.0.0.1", "llama-3.1-8b-sim")
        );
        assert_eq!(
            (a.block_size, a.max_batch_tokens, a.max_running),
            (16, 8192, 256)
        );
        assert_eq!(
            (a.max_loras, a.lora_load_ms, a.prefix.as_str()),
            (0, 300, "r")
        );
        assert_eq!((a.stall_every_s, a.stall_ms, a.stall_seed), (0.0, 1000, 0));
        let cli = Cli::try_parse_from(["kvsteer-sim", "serve", "--stall-every-s", "30"]);
        let Command::Serve(a) = cli.expect("parses").command;
        assert_eq!((a.stall_every_s, a.stall_ms), (30.0, 1000));
        let stall = stall_config(&a).expect("valid");
        assert_eq!((stall.mean_gap_us, stall.len_us), (30_000_000, 1_000_000));
        let a = Serve {
            stall_every_s: f64::NAN,
            ..a
        };
        assert!(stall_config(&a).is_err());
        assert_eq!(a.tokenizer, TokenizerKind::StandIn);
        assert!(a.kv_blocks.is_none() && a.max_model_len.is_none() && a.output_mean.is_none());
    }

    #[test]
    fn a_profile_by_name_or_by_file() {
        let named = load_profile(std::path::Path::new("llama-3.1-70b-h100-tp4")).expect("built in");
        assert_eq!(
            named,
            kvsteer_sim::Profile::named("llama-3.1-70b-h100-tp4").unwrap()
        );
        assert_ne!(named, kvsteer_sim::Profile::llama31_8b_h100());
        let dir = std::env::temp_dir().join(format!("kvsteer-sim-profile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("p.json");
        let mut fitted = kvsteer_sim::Profile::llama31_8b_h100();
        fitted.name = "fitted".into();
        std::fs::write(&file, serde_json::to_string(&fitted).unwrap()).unwrap();
        assert_eq!(load_profile(&file), Ok(fitted));
        let missing = load_profile(&dir.join("nope.json")).expect_err("no such file or name");
        assert!(missing.contains("nope.json"), "{missing}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_values_are_usage_errors() {
        for bad in [
            &["kvsteer-sim"][..],
            &["kvsteer-sim", "serve", "--replicas"],
            &["kvsteer-sim", "serve", "--tokenizer", "gpt2"],
            &["kvsteer-sim", "serve", "--port", "x"],
            &["kvsteer-sim", "serve", "--nope", "1"],
            &["kvsteer-sim", "serve", "--stall-every-s", "often"],
            &["kvsteer-sim", "serve", "--stall-ms", "-5"],
        ] {
            let e = Cli::try_parse_from(bad).expect_err("rejected");
            assert_eq!(e.exit_code(), 2, "{bad:?}");
        }
    }
}
