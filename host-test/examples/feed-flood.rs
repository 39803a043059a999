//! How long the filter holds a worker thread for feed work while one replica answers every poll with
//! a huge valid snapshot: the longest single `on_tick` or feed answer, in wall time, with
//! and without the flood. Requests that arrive meanwhile wait that long in a real proxy.
//!
//! `cargo run --release -p kvsteer-host-test --example feed-flood -- [BLOCKS] [SECONDS] [EXTRA_JSON]`
//! (BLOCKS of 8 bytes in each snapshot, default 1,000,000, about 8 MB; SECONDS of virtual time,
//! default 5; EXTRA_JSON: plugin configuration fields, e.g. `{"feed_apply_blocks_per_tick":1024}`).
//! Without EXTRA_JSON it uses the default plugin configuration, so it runs against any
//! kvsteer_filter.wasm (`KVSTEER_FILTER_WASM`).

use kvsteer_host_test::{
    FeedFault, FilterModule, Harness, HarnessConfig, RequestSpec, filter_wasm_path,
};

fn run(
    module: &FilterModule,
    blocks: Option<u64>,
    seconds: u64,
    extra: &serde_json::Value,
) -> Result<(u64, u64, usize), String> {
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.workers = 1;
    if let serde_json::Value::Object(m) = extra {
        cfg.filter_extra = m.clone();
    }
    let mut h = Harness::new(module, cfg).map_err(|e| e.to_string())?;
    h.run_for(500_000).map_err(|e| e.to_string())?;
    if let Some(b) = blocks {
        h.set_feed_fault(1, FeedFault::Snapshot { blocks: b });
    }
    let mut worst_request = 0;
    let steps = seconds * 20;
    for i in 0..steps {
        h.run_for(50_000).map_err(|e| e.to_string())?;
        let before = h.stats.request_filter_ns;
        let prompt: Vec<u32> = (0..1024).map(|t| (t * 7 + i as u32) % 50_000).collect();
        h.send(&RequestSpec::new(prompt, 16))
            .map_err(|e| e.to_string())?;
        worst_request = worst_request.max(h.stats.request_filter_ns - before);
    }
    h.run_until_idle(600_000_000).map_err(|e| e.to_string())?;
    Ok((
        h.stats.max_feed_call_ns,
        worst_request,
        h.replicas[1].polls as usize,
    ))
}

/// How long the filter holds a worker thread for feed work while one replica floods it with
/// snapshots, with and without the flood.
#[derive(clap::Parser)]
#[command(name = "feed-flood")]
struct Args {
    /// Blocks in each flooding snapshot (8 bytes each: the default is about 8 MB).
    #[arg(value_name = "BLOCKS", default_value_t = 1_000_000)]
    blocks: u64,
    /// Seconds of virtual time each case runs (20 requests a second).
    #[arg(value_name = "SECONDS", default_value_t = 5)]
    seconds: u64,
    /// Plugin configuration fields added to the default, as a JSON object, e.g.
    /// `{"feed_apply_blocks_per_tick":1024}` (anything but an object is ignored).
    #[arg(value_name = "EXTRA_JSON", value_parser = json)]
    extra: Option<serde_json::Value>,
}

/// `EXTRA_JSON` parsed (clap's default would take the text as a JSON string).
fn json(s: &str) -> Result<serde_json::Value, serde_json::Error> {
    serde_json::from_str(s)
}

fn main() -> Result<(), String> {
    let args: Args = clap::Parser::parse();
    let (blocks, seconds) = (args.blocks, args.seconds);
    let extra = args.extra.unwrap_or(serde_json::Value::Null);
    let path = filter_wasm_path()?;
    let module = FilterModule::load_unmetered(&path).map_err(|e| e.to_string())?;
    println!("filter: {}", path.display());
    println!(
        "case\tlongest tick or feed answer (ms)\tlongest request phase (ms)\tpolls of the flooder"
    );
    for (name, b) in [("no flood", None), ("flood", Some(blocks))] {
        let (feed, req, polls) = run(&module, b, seconds, &extra)?;
        println!(
            "{name}\t{:.2}\t{:.2}\t{polls}",
            feed as f64 / 1e6,
            req as f64 / 1e6
        );
    }
    Ok(())
}
