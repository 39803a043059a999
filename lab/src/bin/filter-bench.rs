//! Per-request cost of the filter inside wasmtime: wall time of the guest calls that carry one request
//! (`proxy_on_request_headers` + every `proxy_on_request_body` chunk, which includes parsing the body,
//! hashing the prompt, scoring the replicas and writing the destination header), and separately the
//! stream's end (`on_done`/`on_log`/`on_delete`, which releases its load).
//!
//! Setup: one worker VM (compiled without fuel metering, as a proxy runs it), `--replicas` replicas
//! (default 16) whose feeds answer the first poll with a snapshot of `--index-blocks` random blocks in
//! all (default 1,000,000) plus the bench prompts' shared prefix on replica 3, applied in full before
//! the first request (the filter applies a snapshot over several ticks), so every decision runs
//! against a full index and finds a real match. Bodies arrive in 16 KiB chunks, as Envoy delivers them.
//!
//! Sizes: token-id prompts of 1,024, 8,192, 32,768 and 131,072 ids (`/v1/completions`; a shared
//! prefix and a 192-id tail that differs per request) and chat text of about four characters per
//! token of each size (`/v1/chat/completions`). Beside each figure: a plain byte pass over the same
//! body in the same engine (`kvsteer_lab::byte_pass`), timed right after each request, and the
//! ratio of the two medians.
//!
//! "After the last byte": the call that hands over the body's last chunk alone, which is what the
//! filter adds to a request's latency once its body has arrived (with the early body scan, most of
//! the prompt was read during the chunks before it; `--no-early-scan` turns it off for comparison).
//!
//! Requests arrive 1 ms apart in virtual time (1,000 requests/s) and the filter's ticks run between
//! them as they would in a proxy (not timed).
//!
//! Usage: `filter-bench [--requests N] [--replicas R] [--index-blocks B | --blocks-per-replica B]
//! [--policy P] [--kv-load JSON] [--sizes 8192,131072] [--ids-only] [--no-early-scan]`; `--kv-load '{"overflow_weight":0.2}'` sets
//! `routing.kv_load` fields. `--sizes` and `--ids-only` narrow the run to some rows, so that a
//! profile (`KVSTEER_PERFMAP=1 perf record`) shows one path and not the mix of all sizes.
//! `--blocks-per-replica` seeds the index in proportion to the fleet (scripts/fleet-bench sweeps
//! `--replicas` so), because a bigger fleet caches more blocks and the filter's match, scoring and
//! memory grow with both. The VM's linear memory is printed after seeding and after the run: it only
//! grows, so it is the filter's high-water mark. `filter-bench --help` gives each flag's meaning and
//! default.

use clap::Parser;
use kvsteer_core::block::BlockHasher;
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FeedBatch, FeedEvent, FeedQuery, ReplicaLoad, Tier};
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{
    Action, CallOutcome, FilterModule, HostMode, Proxy, ProxyOptions, WorkerVm, filter_wasm_path,
};
use kvsteer_lab::byte_pass::BytePass;
use serde_json::json;
use std::time::Instant;

/// What the run measures, once the flags are read.
struct Args {
    requests: usize,
    replicas: usize,
    index_blocks: usize,
    policy: String,
    kv_load: serde_json::Value,
    /// The prompt sizes to run (all four by default).
    sizes: Vec<usize>,
    /// Token-id rows only (no chat text, no headers-only row).
    ids_only: bool,
    /// `early_body_scan` in the filter's configuration (`--no-early-scan`: false).
    early_scan: bool,
    /// Pools in the configuration (`--pools`): 1, the plain single-fleet configuration.
    pools: usize,
}

#[derive(Parser, Debug)]
#[command(
    name = "filter-bench",
    about = "Per-request cost of kvsteer_filter.wasm inside wasmtime, against a seeded index.",
    args_override_self = true
)]
struct Cli {
    /// Requests per row (at least 1).
    #[arg(long, value_name = "N", default_value_t = 1000)]
    requests: usize,
    /// Replicas in the filter's configuration (clamped to 1..=256).
    #[arg(long, value_name = "R", default_value_t = 16)]
    replicas: usize,
    /// KV blocks in the seeded index, over all replicas.
    #[arg(long, value_name = "B", default_value_t = 1_000_000)]
    index_blocks: usize,
    /// KV blocks seeded per replica instead (index = B x replicas); overrides --index-blocks.
    #[arg(long, value_name = "B")]
    blocks_per_replica: Option<usize>,
    /// Routing policy (`routing.policy`).
    #[arg(long, value_name = "P", default_value = "kv_load")]
    policy: String,
    /// `routing.kv_load` fields as a JSON object, e.g. '{"overflow_weight":0.2}'.
    #[arg(long, value_name = "JSON", default_value = "{}", value_parser = json_object)]
    kv_load: serde_json::Value,
    /// Prompt sizes to run, in tokens, comma-separated, each one of 1024, 8192, 32768, 131072
    /// (default: all four).
    #[arg(long, value_name = "8192,131072", value_parser = sizes)]
    sizes: Option<Sizes>,
    /// Token-id rows only: no chat text, no headers-only row.
    #[arg(long)]
    ids_only: bool,
    /// Turn the filter's early body scan off (`early_body_scan: false`), for comparison.
    #[arg(long)]
    no_early_scan: bool,
    /// Pools in the configuration (clamped to 1..=64): with more than 1, the benched fleet is
    /// pool `p0` (model `m`) and every other pool has `--replicas` replicas of its own, polled and
    /// answered with empty snapshots, so the request path runs with N pools' state in the VM.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pools: usize,
}

fn json_object(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| e.to_string())
}

/// A `--sizes` list (one value, so a flag given twice keeps its last list).
#[derive(Clone, Debug)]
struct Sizes(Vec<usize>);

fn sizes(s: &str) -> Result<Sizes, String> {
    s.split(',')
        .map(|n| n.trim().parse().ok().filter(|n| SIZES.contains(n)))
        .collect::<Option<_>>()
        .map(Sizes)
        .ok_or(format!("each of {SIZES:?}, comma-separated"))
}

fn parse_args() -> Args {
    let cli = Cli::parse();
    let replicas = cli.replicas.clamp(1, 256);
    Args {
        requests: cli.requests.max(1),
        replicas,
        index_blocks: cli
            .blocks_per_replica
            .map_or(cli.index_blocks, |b| b * replicas),
        policy: cli.policy,
        kv_load: cli.kv_load,
        sizes: cli.sizes.map_or_else(|| SIZES.to_vec(), |s| s.0),
        ids_only: cli.ids_only,
        early_scan: !cli.no_early_scan,
        pools: cli.pools.clamp(1, 64),
    }
}

/// The prompt sizes, in token ids (text: about four characters a token).
const SIZES: [usize; 4] = [1024, 8192, 32768, 131072];

fn lcg(seed: &mut u64) -> u64 {
    *seed = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *seed >> 11
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil().max(1.0) as usize;
    sorted[rank.min(sorted.len()) - 1]
}

/// Polls and answers until every replica's snapshot is applied.
fn seed_index(
    proxy: &Proxy,
    worker: &mut WorkerVm,
    args: &Args,
    warm: &[u64],
) -> Result<(), String> {
    let per = args.index_blocks / args.replicas;
    let mut rng = 0x5eed_u64;
    let mut answered = vec![false; args.replicas];
    let mut now_ms = 0u64;
    for _ in 0..100 {
        now_ms += worker.tick_period_ms().max(1) as u64;
        proxy.set_now_ns(now_ms * 1_000_000);
        worker.tick().map_err(|e| e.to_string())?;
        for call in worker.take_callouts() {
            let q = call
                .header(":path")
                .and_then(|p| p.split_once('?'))
                .map(|(_, q)| FeedQuery::parse(q))
                .ok_or("callout without a feed query")??;
            if call.upstream.starts_with("other_") {
                // Another pool's replica: an empty cache, so it stays healthy and polled.
                let batch = feed_answer(7, &q, Vec::new());
                worker
                    .answer_callout(
                        &call,
                        CallOutcome::ok(200, FEED_CONTENT_TYPE, batch.encode()),
                    )
                    .map_err(|e| e.to_string())?;
                continue;
            }
            let r: usize = call
                .upstream
                .strip_prefix("feed_r")
                .and_then(|n| n.parse().ok())
                .ok_or(format!("unexpected upstream {}", call.upstream))?;
            let mut hashes: Vec<u64> = (0..per).map(|_| lcg(&mut rng)).collect();
            if r == 3 {
                hashes.extend_from_slice(warm);
            }
            let batch = feed_answer(1000 + r as u64, &q, hashes);
            answered[r] |= batch.resync;
            worker
                .answer_callout(
                    &call,
                    CallOutcome::ok(200, FEED_CONTENT_TYPE, batch.encode()),
                )
                .map_err(|e| e.to_string())?;
        }
        if answered.iter().all(|a| *a) {
            break;
        }
    }
    if !answered.iter().all(|a| *a) {
        return Err("the filter did not poll every replica".into());
    }
    apply_snapshots(
        proxy,
        worker,
        now_ms,
        &metric_name(args, "kvsteer_feed_pending_blocks"),
    )
}

/// The benched fleet's metric `name`: pool `p0`'s with `--pools` over 1.
fn metric_name(args: &Args, name: &str) -> String {
    match name.strip_prefix("kvsteer_") {
        Some(rest) if args.pools > 1 => format!("kvsteer_pool_p0_{rest}"),
        _ => name.to_string(),
    }
}

/// A replica's answer to a feed poll: nothing new once the filter holds `epoch`, else a snapshot of
/// `hashes` (a resync).
fn feed_answer(epoch: u64, q: &FeedQuery, hashes: Vec<u64>) -> FeedBatch {
    let load = ReplicaLoad {
        block_size: 16,
        kv_total_blocks: 1 << 20,
        ..Default::default()
    };
    if q.epoch == epoch {
        return FeedBatch {
            epoch,
            resync: false,
            more: false,
            first_seq: q.cursor,
            next_seq: q.cursor,
            load,
            events: Vec::new(),
        };
    }
    FeedBatch {
        epoch,
        resync: true,
        more: false,
        first_seq: 1,
        next_seq: 1,
        load: ReplicaLoad {
            kv_used_blocks: hashes.len() as u64,
            ..load
        },
        events: vec![
            FeedEvent::Cleared,
            FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes,
            },
        ],
    }
}

/// The filter applies `feed_apply_blocks_per_tick` hashes a tick: ticks until it has applied all.
fn apply_snapshots(
    proxy: &Proxy,
    worker: &mut WorkerVm,
    mut now_ms: u64,
    pending: &str,
) -> Result<(), String> {
    for _ in 0..100_000 {
        now_ms += worker.tick_period_ms().max(1) as u64;
        proxy.set_now_ns(now_ms * 1_000_000);
        worker.tick().map_err(|e| e.to_string())?;
        let _ = worker.take_callouts();
        if proxy.metric(pending).is_some_and(|m| m.value == 0) {
            return Ok(());
        }
    }
    Err("the filter did not apply the snapshots".into())
}

struct Measured {
    request_us: Vec<f64>,
    /// The last body chunk's call alone (the one that ends the stream): what the filter adds after
    /// the request's last byte has arrived.
    last_us: Vec<f64>,
    end_us: Vec<f64>,
    /// The plain byte pass over the same body, right after the request.
    pass_us: Vec<f64>,
    body_bytes: usize,
    destinations: std::collections::BTreeMap<String, usize>,
    /// The ticks that ran between the row's requests (`proxy_on_tick` alone: sharing load with
    /// the other workers, the feeds' bookkeeping, the gauges; with `--pools`, every pool's).
    tick_us: Vec<f64>,
}

/// One tick of the proxy's timer, its callouts timed out; its wall time (us), timed apart from
/// the requests: ticks run on the timer, not on a request's path.
fn tick(worker: &mut WorkerVm) -> Result<f64, String> {
    let t = Instant::now();
    worker.tick().map_err(|e| e.to_string())?;
    let us = t.elapsed().as_secs_f64() * 1e6;
    for call in worker.take_callouts() {
        worker
            .answer_callout(&call, CallOutcome::timeout())
            .map_err(|e| e.to_string())?;
    }
    Ok(us)
}

/// Virtual time per request: the bench runs at this request rate, with the filter's ticks in between.
const REQUEST_GAP_US: u64 = 1000;

fn bench(
    proxy: &Proxy,
    worker: &mut WorkerVm,
    pass: &mut BytePass,
    n: usize,
    path: &str,
    body_of: &dyn Fn(usize) -> Vec<u8>,
) -> Result<Measured, String> {
    let mut m = Measured {
        request_us: Vec::with_capacity(n),
        last_us: Vec::with_capacity(n),
        end_us: Vec::with_capacity(n),
        pass_us: Vec::with_capacity(n),
        body_bytes: 0,
        destinations: Default::default(),
        tick_us: Vec::new(),
    };
    let mut next_tick = proxy.now_ns() / 1000;
    for i in 0..n {
        let now_us = proxy.now_ns() / 1000 + REQUEST_GAP_US;
        proxy.set_now_ns(now_us * 1000);
        if now_us >= next_tick {
            m.tick_us.push(tick(worker)?);
            next_tick = now_us + worker.tick_period_ms().max(1) as u64 * 1000;
        }
        let body = body_of(i);
        let session = format!("bench-{}", i % 64);
        let headers = request_headers(path, body.len(), Some(("x-session-id", &session)), &[]);
        let t = Instant::now();
        let id = worker.new_stream().map_err(|e| e.to_string())?;
        let a = worker
            .request_headers(id, headers, body.is_empty())
            .map_err(|e| e.to_string())?;
        let mut last = a;
        let mut last_us = 0.0;
        let mut chunks = body.chunks(16 * 1024).peekable();
        while let Some(c) = chunks.next() {
            let ends = chunks.peek().is_none();
            let tc = Instant::now();
            if let Some(x) = worker
                .request_body(id, c, ends)
                .map_err(|e| e.to_string())?
            {
                last = x;
            }
            if ends {
                last_us = tc.elapsed().as_secs_f64() * 1e6;
            }
        }
        let req = t.elapsed().as_secs_f64() * 1e6;
        m.last_us.push(last_us);
        if last != Action::Continue {
            return Err(format!(
                "request {i} was not released ({last:?}; {})",
                answered(worker, id)
            ));
        }
        let dest = worker
            .stream(id)
            .and_then(|s| s.upstream_header("x-gateway-destination-endpoint"))
            .unwrap_or("(none)")
            .to_string();
        *m.destinations.entry(dest).or_insert(0) += 1;
        let t = Instant::now();
        worker.end_stream(id).map_err(|e| e.to_string())?;
        m.end_us.push(t.elapsed().as_secs_f64() * 1e6);
        m.request_us.push(req);
        let (_, d) = pass.run(&body)?;
        m.pass_us.push(d.as_secs_f64() * 1e6);
        m.body_bytes = body.len();
    }
    Ok(m)
}

/// What the filter answered a stream itself, if it did.
fn answered(worker: &WorkerVm, id: u32) -> String {
    match worker.stream(id).and_then(|s| s.local_response.as_ref()) {
        Some(l) => format!("answered {} {}", l.status, String::from_utf8_lossy(&l.body)),
        None => "no local answer".into(),
    }
}

fn main() {
    if let Err(e) = run() {
        eprintln!("filter-bench: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let args = parse_args();
    let path = filter_wasm_path()?;
    let t = Instant::now();
    let module = FilterModule::load_unmetered(&path).map_err(|e| e.to_string())?;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let cfg = filter_config(&args);
    let proxy = Proxy::new(&module, ProxyOptions::new(HostMode::Envoy, cfg.to_string()));
    let mut worker = proxy.start_worker().map_err(|e| e.to_string())?;

    let prompts = Prompts::new();
    let warm: Vec<u64> = BlockHasher::new(16)
        .map_err(|e| e.to_string())?
        .sequence_hashes(&prompts.prefix)
        .into_iter()
        .map(|h| h.0)
        .collect();
    let t = Instant::now();
    seed_index(&proxy, &mut worker, &args, &warm)?;
    let seed_ms = t.elapsed().as_secs_f64() * 1e3;
    let seeded_memory = worker.memory_bytes();
    let index_metric = metric_name(&args, "kvsteer_index_blocks");
    let index_blocks = proxy.metric(&index_metric).map_or(0, |m| m.value);
    // One tick publishes the index gauges.
    worker.tick().map_err(|e| e.to_string())?;
    let _ = worker.take_callouts();
    let index_blocks = proxy
        .metric(&index_metric)
        .map_or(index_blocks, |m| m.value);
    let rows = measure_rows(&proxy, &mut worker, &args, &prompts)?;

    println!(
        "filter: {} ({:.0} KB), compiled in {compile_ms:.0} ms; {} replicas, index seeded with {} \
         blocks in {seed_ms:.0} ms (filter reports {index_blocks}); policy {}; {} requests each; \
         early body scan {}; {} pools ({} replicas in all)",
        path.display(),
        module.size() as f64 / 1024.0,
        args.replicas,
        args.index_blocks,
        args.policy,
        args.requests,
        if args.early_scan { "on" } else { "off" },
        args.pools,
        args.pools * args.replicas
    );
    println!();
    print_rows(&rows);
    println!();
    for (name, m) in &rows {
        if name.starts_with("8192 ") {
            println!("destinations (8K-token requests): {:?}", m.destinations);
        } else if name.starts_with("chat text, ~8192 ") {
            println!("destinations (text requests): {:?}", m.destinations);
        }
    }
    print_ticks(&rows);
    worker.tick().map_err(|e| e.to_string())?;
    let metric = |n: &str| proxy.metric(&metric_name(&args, n)).map_or(0, |m| m.value);
    println!(
        "after the run: index {} blocks, {} evictions, {} release anomalies",
        metric("kvsteer_index_blocks"),
        metric("kvsteer_index_evictions"),
        metric("kvsteer_release_anomalies")
    );
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    println!(
        "VM linear memory: {:.1} MiB after seeding, {:.1} MiB after the run",
        mib(seeded_memory),
        mib(worker.memory_bytes())
    );
    if worker.is_dead() || !worker.notes().is_empty() {
        return Err(format!("the filter misbehaved: {:?}", worker.notes()));
    }
    Ok(())
}

/// The filter's configuration: `--replicas` replicas with a feed each, polled once an hour so that
/// only [`seed_index`]'s polls fill the index.
fn filter_config(args: &Args) -> serde_json::Value {
    let replicas: Vec<_> = (0..args.replicas)
        .map(|i| {
            json!({"name": format!("r{i}"), "endpoint": format!("10.0.{}.{}:8000", i / 250, i % 250 + 1),
                   "feed_cluster": format!("feed_r{i}")})
        })
        .collect();
    let mut cfg = json!({
        "replicas": replicas,
        "routing": {"policy": args.policy, "block_size": 16,
                    "index_capacity_blocks": (args.index_blocks + 100_000).max(1_000_000),
                    "kv_load": args.kv_load},
        "feed_period_ms": 3_600_000,
        "tick_ms": 100,
    });
    // Only when turned off, so that a filter from before the option can be measured by default.
    if !args.early_scan {
        cfg["early_body_scan"] = json!(false);
    }
    if args.pools > 1 {
        // The benched fleet becomes pool p0 (its index capacity its own, as above); every other
        // pool has as many replicas, on addresses of their own, and the default index share.
        let obj = cfg.as_object_mut().expect("an object");
        let replicas = obj.remove("replicas").unwrap_or_default();
        let capacity = cfg["routing"]["index_capacity_blocks"].clone();
        let mut pools = vec![json!({"name": "p0", "models": ["m"], "replicas": replicas,
                                    "routing": {"index_capacity_blocks": capacity}})];
        for k in 1..args.pools {
            let others: Vec<_> = (0..args.replicas)
                .map(|i| {
                    json!({"name": format!("r{i}"),
                           "endpoint": format!("10.{}.{}.{}:8000", k, i / 250, i % 250 + 1),
                           "feed_cluster": format!("other_p{k}_r{i}")})
                })
                .collect();
            pools.push(json!({"name": format!("p{k}"), "models": [format!("m{k}")],
                              "replicas": others}));
        }
        cfg["pools"] = json!(pools);
        // The headers-only row's requests have no body, so no model: the default pool takes them.
        cfg["default_pool"] = json!("p0");
        cfg["routing"]
            .as_object_mut()
            .expect("an object")
            .remove("index_capacity_blocks");
    }
    cfg
}

/// Ids of a prompt's tail, which differs per request.
const TAIL: usize = 192;

/// The bench's prompts: a shared prefix (cached on replica 3) and a [`TAIL`]-id tail that differs
/// per request. Bodies are the fixed part, built once per size, plus the part that differs.
struct Prompts {
    prefix: Vec<u32>,
    /// Per size: a token-id body up to its tail.
    id_heads: Vec<String>,
    /// Per size: chat text of about four characters a token.
    texts: Vec<String>,
}

impl Prompts {
    fn new() -> Prompts {
        let mut seed = 42u64;
        let prefix: Vec<u32> = (0..SIZES[3] - TAIL)
            .map(|_| (lcg(&mut seed) % 128_000) as u32)
            .collect();
        let id_heads = SIZES
            .iter()
            .map(|&n| {
                let mut s = String::from("{\"model\":\"m\",\"prompt\":[");
                for t in &prefix[..n - TAIL] {
                    s.push_str(&t.to_string());
                    s.push(',');
                }
                s
            })
            .collect();
        let texts = SIZES
            .iter()
            .map(|&n| {
                let words = [
                    "routing ", "tokens ", "cache ", "replica ", "prefill ", "decode ",
                ];
                let mut text = String::with_capacity(4 * n);
                let mut s = 7u64;
                while text.len() < 4 * n - 64 {
                    text.push_str(words[(lcg(&mut s) % 6) as usize]);
                }
                text
            })
            .collect();
        Prompts {
            prefix,
            id_heads,
            texts,
        }
    }

    /// Request `i`'s `/v1/completions` body of size index `size`.
    fn token_body(&self, size: usize, i: usize) -> Vec<u8> {
        let mut body = self.id_heads[size].clone();
        let mut s = i as u64 + 1;
        let tail: Vec<String> = (0..TAIL)
            .map(|_| (lcg(&mut s) % 128_000).to_string())
            .collect();
        body.push_str(&tail.join(","));
        body.push_str(
            "],\"max_tokens\":256,\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
        );
        body.into_bytes()
    }

    /// Request `i`'s `/v1/chat/completions` body of size index `size`.
    fn text_body(&self, size: usize, i: usize) -> Vec<u8> {
        json!({"model": "m", "stream": true, "max_tokens": 256,
               "messages": [{"role": "system", "content": "You are a coding agent."},
                            {"role": "user", "content": format!("{}question {i}", self.texts[size])}]})
        .to_string()
        .into_bytes()
    }
}

/// A warm-up, then every row the arguments chose: token ids per size, chat text per size, headers
/// only.
fn measure_rows(
    proxy: &Proxy,
    worker: &mut WorkerVm,
    args: &Args,
    prompts: &Prompts,
) -> Result<Vec<(String, Measured)>, String> {
    let mut pass = BytePass::new()?;
    // Warm-up (first-call costs: lazy allocations in the guest, wasmtime's lazy init).
    bench(proxy, worker, &mut pass, 50, "/v1/completions", &|i| {
        prompts.token_body(1, i)
    })?;
    let mut rows: Vec<(String, Measured)> = Vec::new();
    let chosen = |n: &usize| args.sizes.contains(n);
    for (k, &n) in SIZES.iter().enumerate().filter(|(_, n)| chosen(n)) {
        let m = bench(
            proxy,
            worker,
            &mut pass,
            args.requests,
            "/v1/completions",
            &|i| prompts.token_body(k, i),
        )?;
        rows.push((format!("{n} token ids (/v1/completions)"), m));
    }
    for (k, &n) in SIZES
        .iter()
        .enumerate()
        .filter(|(_, n)| chosen(n) && !args.ids_only)
    {
        let m = bench(
            proxy,
            worker,
            &mut pass,
            args.requests,
            "/v1/chat/completions",
            &|i| prompts.text_body(k, i),
        )?;
        rows.push((format!("chat text, ~{n} tokens (/v1/chat/completions)"), m));
    }
    if !args.ids_only {
        let empty = bench(
            proxy,
            worker,
            &mut pass,
            args.requests,
            "/v1/completions",
            &|_| Vec::new(),
        )?;
        rows.push(("headers only, no body (fallback path)".into(), empty));
    }
    Ok(rows)
}

/// The ticks of every row together: what the proxy's timer costs the worker per tick.
fn print_ticks(rows: &[(String, Measured)]) {
    let mut ticks: Vec<f64> = rows
        .iter()
        .flat_map(|(_, m)| m.tick_us.iter().copied())
        .collect();
    ticks.sort_by(f64::total_cmp);
    println!(
        "ticks between the requests: p50 {:.1} us, p99 {:.1} us ({} ticks)",
        percentile(&ticks, 50.0),
        percentile(&ticks, 99.0),
        ticks.len()
    );
}

/// The table of figures, one line per row.
fn print_rows(rows: &[(String, Measured)]) {
    println!(
        "| request | body | headers+body+decision p50 us | p99 us | mean us | byte pass p50 us | p50 / byte pass | after the last byte p50 us | p99 us | stream end p50 us | p99 us |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (name, m) in rows {
        let sorted = |v: &[f64]| {
            let mut v = v.to_vec();
            v.sort_by(f64::total_cmp);
            v
        };
        let (r, e, p) = (sorted(&m.request_us), sorted(&m.end_us), sorted(&m.pass_us));
        let l = sorted(&m.last_us);
        let mean = r.iter().sum::<f64>() / r.len().max(1) as f64;
        let p50 = percentile(&r, 50.0);
        let pass50 = percentile(&p, 50.0);
        let ratio = if m.body_bytes > 0 && pass50 > 0.0 {
            format!("{:.1}x", p50 / pass50)
        } else {
            "-".into()
        };
        println!(
            "| {name} | {:.1} KB | {p50:.1} | {:.1} | {mean:.1} | {pass50:.1} | {ratio} | {:.1} | {:.1} | {:.1} | {:.1} |",
            m.body_bytes as f64 / 1024.0,
            percentile(&r, 99.0),
            percentile(&l, 50.0),
            percentile(&l, 99.0),
            percentile(&e, 50.0),
            percentile(&e, 99.0)
        );
    }
}
