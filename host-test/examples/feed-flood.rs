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

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let blocks: u64 = args
        .first()
        .map_or(Ok(1_000_000), |s| s.parse())
        .map_err(|e| format!("BLOCKS: {e}"))?;
    let seconds: u64 = args
        .get(1)
        .map_or(Ok(5), |s| s.parse())
        .map_err(|e| format!("SECONDS: {e}"))?;
    let extra: serde_json::Value = match args.get(2) {
        Some(j) => serde_json::from_str(j).map_err(|e| format!("EXTRA_JSON: {e}"))?,
        None => serde_json::Value::Null,
    };
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
