//! Cost of exact tokenization inside the filter, in wasmtime (docs/design/tokenizer.md): how big
//! the `.wasm` is, how long a worker VM takes to start with and without a tokenizer configured (the
//! o200k vocabulary is parsed in `on_configure`), how much memory a worker then holds, and the
//! per-request filter path for chat conversations of about 8K, 32K and 128K tokens, first turn
//! (every message new) and follow-up turn (the same conversation plus an assistant reply and a new
//! user message: only those two are tokenized, the rest comes from the per-message cache).
//!
//! The timed span is the guest calls carrying one request (`proxy_on_request_headers` and every
//! `proxy_on_request_body` chunk of 16 KiB): body parse, template render, tokenize, hash, score.
//! Token counts come from the filter's own `kvsteer_prompt_tokens` counter. Memory is the process's
//! resident set growth across starting the VM (the VM's touched linear memory plus wasmtime's state).
//!
//! Usage: `tokenizer-bench [--reps N] [--vocabulary o200k_harmony|o200k_base] [--huggingface DIR]`
//! (`--help` says what each means). `--huggingface` takes a folder holding a model's `tokenizer.json`
//! and `tokenizer_config.json` (`tokenizer/scripts/hf-fetch` puts Llama 3.1's in
//! `target/tokenizers/llama3_1`) and configures that bundle, inline, with its own chat template.

use clap::Parser;
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{
    Action, CallOutcome, FilterModule, HostMode, Proxy, ProxyOptions, WorkerVm, filter_wasm_path,
};
use kvsteer_tokenizer::sample;
use serde_json::{Value, json};
use std::time::Instant;

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4)
}

/// The benchmark conversation ([`kvsteer_tokenizer::sample::conversation`]) as chat messages.
fn conversation(seed: u64, turns: usize, words: usize) -> Vec<Value> {
    sample::conversation(seed, turns, words)
        .into_iter()
        .map(|(role, content)| json!({"role": role, "content": content}))
        .collect()
}

fn body(messages: &[Value]) -> Vec<u8> {
    json!({"model": "gpt-oss-20b", "max_tokens": 256, "messages": messages})
        .to_string()
        .into_bytes()
}

struct Vm {
    proxy: Proxy,
    worker: WorkerVm,
    start_ms: f64,
    rss_mb: f64,
}

fn start(module: &FilterModule, tokenizer: Option<Value>) -> Result<Vm, String> {
    let replicas: Vec<_> = (0..4)
        .map(|i| {
            json!({"name": format!("r{i}"), "endpoint": format!("10.0.0.{}:8000", i + 1),
                        "feed_cluster": format!("feed_r{i}")})
        })
        .collect();
    let mut cfg = json!({
        "replicas": replicas,
        "routing": {"policy": "kv_load", "block_size": 16},
        "feed_period_ms": 3_600_000,
        "tick_ms": 100,
    });
    if let Some(t) = tokenizer {
        cfg["tokenizer"] = t;
    }
    let proxy = Proxy::new(module, ProxyOptions::new(HostMode::Envoy, cfg.to_string()));
    let rss0 = rss_kb();
    let t = Instant::now();
    let worker = proxy.start_worker().map_err(|e| e.to_string())?;
    let start_ms = t.elapsed().as_secs_f64() * 1e3;
    let rss_mb = rss_kb().saturating_sub(rss0) as f64 / 1024.0;
    Ok(Vm {
        proxy,
        worker,
        start_ms,
        rss_mb,
    })
}

/// One request through the VM; returns (microseconds, prompt tokens the filter counted).
fn request(vm: &mut Vm, body: &[u8]) -> Result<(f64, u64), String> {
    let metric = |p: &Proxy, n: &str| p.metric(n).map_or(0, |m| m.value.max(0) as u64);
    let before = metric(&vm.proxy, "kvsteer_prompt_tokens");
    let now = vm.proxy.now_ns() + 1_000_000;
    vm.proxy.set_now_ns(now);
    let w = &mut vm.worker;
    w.tick().map_err(|e| e.to_string())?;
    for call in w.take_callouts() {
        w.answer_callout(&call, CallOutcome::timeout())
            .map_err(|e| e.to_string())?;
    }
    let headers = request_headers("/v1/chat/completions", body.len(), None, &[]);
    let t = Instant::now();
    let id = w.new_stream().map_err(|e| e.to_string())?;
    let mut last = w
        .request_headers(id, headers, false)
        .map_err(|e| e.to_string())?;
    let mut chunks = body.chunks(16 * 1024).peekable();
    while let Some(c) = chunks.next() {
        if let Some(a) = w
            .request_body(id, c, chunks.peek().is_none())
            .map_err(|e| e.to_string())?
        {
            last = a;
        }
    }
    let us = t.elapsed().as_secs_f64() * 1e6;
    if last != Action::Continue {
        return Err(format!("request not released ({last:?})"));
    }
    w.end_stream(id).map_err(|e| e.to_string())?;
    let after = metric(&vm.proxy, "kvsteer_prompt_tokens");
    Ok((us, after - before))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("tokenizer-bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let (reps, vocabulary, huggingface) = parse_args();
    let path = filter_wasm_path()?;
    let t = Instant::now();
    let module = FilterModule::load_unmetered(&path).map_err(|e| e.to_string())?;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    println!(
        "filter: {} ({:.0} KB), compiled by wasmtime in {compile_ms:.0} ms",
        path.display(),
        module.size() as f64 / 1024.0
    );
    let (tok_cfg, label) = match huggingface {
        Some(dir) => {
            let read = |f: &str| {
                std::fs::read_to_string(dir.join(f))
                    .map_err(|e| format!("{}: {e}", dir.join(f).display()))
            };
            let cfg = json!({"huggingface": {"tokenizer_json": read("tokenizer.json")?,
                "tokenizer_config_json": read("tokenizer_config.json")?}});
            (cfg, format!("bundle {}", dir.display()))
        }
        None => (
            json!({"vocabulary": vocabulary, "chat_template": "harmony"}),
            vocabulary,
        ),
    };
    let (mut plain, mut tok) = start_vms(&module, tok_cfg, &label)?;

    // Words per message so that 8K, 32K, 128K tokens take 8, 32, 128 messages of ~1K tokens: calibrate.
    let probe = body(&conversation(1, 0, 1000));
    let (_, probe_tokens) = request(&mut tok, &probe)?;
    // The probe is a 1,000-word system message and a 150-word user message.
    let words = (1000.0 * 1150.0 / probe_tokens.max(1) as f64) as usize;

    println!();
    println!(
        "| conversation | prompt tokens | body KB | turn | tokenizer p50 ms | min ms | no tokenizer (approximate) p50 ms |"
    );
    println!("|---|---:|---:|---|---:|---:|---:|");
    let mut seed = 100u64;
    for (label, target) in [("8K", 8_192usize), ("32K", 32_768), ("128K", 131_072)] {
        let n = if target > 100_000 {
            reps.div_ceil(2)
        } else {
            reps
        };
        conversation_rows(&mut tok, &mut plain, label, target, n, words, &mut seed)?;
    }
    tok.worker.tick().map_err(|e| e.to_string())?;
    let m = |n: &str| tok.proxy.metric(n).map_or(0, |m| m.value);
    println!();
    println!(
        "tokenizer counters: exact {}, cache hits {}, misses {}, cached tokens {}, fallbacks (template {}, too_large {})",
        m("kvsteer_tokenizer_exact"),
        m("kvsteer_tokenizer_cache_hits"),
        m("kvsteer_tokenizer_cache_misses"),
        m("kvsteer_tokenizer_cache_tokens"),
        m("kvsteer_tokenizer_fallback_template"),
        m("kvsteer_tokenizer_fallback_too_large"),
    );
    println!(
        "resident set of this process now: {:.0} MB",
        rss_kb() as f64 / 1024.0
    );
    if tok.worker.is_dead() || !tok.worker.notes().is_empty() {
        return Err(format!("the filter misbehaved: {:?}", tok.worker.notes()));
    }
    Ok(())
}

#[derive(Parser, Debug)]
#[command(
    name = "tokenizer-bench",
    about = "Cost of exact tokenization inside kvsteer_filter.wasm: VM start, memory and the \
             per-request path for chat conversations of 8K, 32K and 128K tokens.",
    args_override_self = true
)]
struct Cli {
    /// Timed requests per row (at least 1; half of them for the 128K rows).
    #[arg(long, value_name = "N", default_value_t = 5)]
    reps: usize,
    /// The filter's tokenizer vocabulary: o200k_harmony or o200k_base.
    #[arg(long, value_name = "V", default_value = "o200k_harmony")]
    vocabulary: String,
    /// A Hugging Face bundle instead: a folder with tokenizer.json and tokenizer_config.json.
    #[arg(long, value_name = "DIR")]
    huggingface: Option<std::path::PathBuf>,
}

/// `--reps` (at least 1), `--vocabulary` and `--huggingface`.
fn parse_args() -> (usize, String, Option<std::path::PathBuf>) {
    let cli = Cli::parse();
    (cli.reps.max(1), cli.vocabulary, cli.huggingface)
}

/// VM start and memory, without and with the tokenizer (each VM parses its own vocabulary): the
/// table, and the VM without a tokenizer and the last one with.
fn start_vms(module: &FilterModule, tok_cfg: Value, label: &str) -> Result<(Vm, Vm), String> {
    println!();
    println!("| worker VM | start (on_vm_start + on_configure) ms | resident memory growth MB |");
    println!("|---|---:|---:|");
    let plain = start(module, None)?;
    println!(
        "| no tokenizer | {:.1} | {:.1} |",
        plain.start_ms, plain.rss_mb
    );
    let mut vms = Vec::new();
    for i in 0..2 {
        let vm = start(module, Some(tok_cfg.clone()))?;
        println!(
            "| tokenizer {label}, worker {} | {:.1} | {:.1} |",
            i + 1,
            vm.start_ms,
            vm.rss_mb
        );
        vms.push(vm);
    }
    let tok = vms.pop().ok_or("no vm")?;
    drop(vms);
    Ok((plain, tok))
}

/// The two rows of one conversation size: `n` conversations of about `target` tokens, each sent
/// as a first turn and then a follow-up, through the tokenizer VM and the plain one.
fn conversation_rows(
    tok: &mut Vm,
    plain: &mut Vm,
    label: &str,
    target: usize,
    n: usize,
    words: usize,
    seed: &mut u64,
) -> Result<(), String> {
    let turns = (target / 1000).saturating_sub(1) / 2;
    let (mut first, mut follow, mut plain_first, mut plain_follow) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut tokens1, mut tokens2, mut kb1, mut kb2) = (0, 0, 0.0, 0.0);
    for _ in 0..n {
        *seed += 1;
        let mut convo = conversation(*seed, turns, words);
        let b1 = body(&convo);
        let (us, n1) = request(tok, &b1)?;
        first.push(us / 1e3);
        plain_first.push(request(plain, &b1)?.0 / 1e3);
        for (role, content) in sample::follow_up(*seed) {
            convo.push(json!({"role": role, "content": content}));
        }
        let b2 = body(&convo);
        let (us, n2) = request(tok, &b2)?;
        follow.push(us / 1e3);
        plain_follow.push(request(plain, &b2)?.0 / 1e3);
        (tokens1, tokens2) = (n1, n2);
        (kb1, kb2) = (b1.len() as f64 / 1024.0, b2.len() as f64 / 1024.0);
    }
    let min = |v: &[f64]| v.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "| {label} | {tokens1} | {kb1:.0} | first | {:.2} | {:.2} | {:.2} |",
        median(first.clone()),
        min(&first),
        median(plain_first)
    );
    println!(
        "| {label} | {tokens2} | {kb2:.0} | follow-up | {:.2} | {:.2} | {:.2} |",
        median(follow.clone()),
        min(&follow),
        median(plain_follow)
    );
    Ok(())
}
