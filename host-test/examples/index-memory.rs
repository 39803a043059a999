//! Memory one filter VM holds with a full KV block index: every proxy worker (and
//! Envoy's main thread) runs its own VM with its own index, so this is paid once per VM.
//!
//! `cargo run --release -p kvsteer-host-test --example index-memory -- [CAP] [REPLICAS,...] [WORKERS]`
//! (CAP: `index_capacity_blocks`, default 1,000,000; REPLICAS: replica counts to try, default `4,16`;
//! WORKERS: worker VMs, default 2). Uses `KVSTEER_FILTER_WASM` or the release build.
//!
//! For each replica count it prints each worker VM's linear memory (WebAssembly memory never
//! shrinks, so this is the peak the VM ever held, which is what the proxy keeps) at three points:
//! - `start`: configured, index empty;
//! - `full`: every replica sent one snapshot of its fair share (`CAP / replicas` blocks), so the index
//!   holds exactly CAP blocks;
//! - `flood`: then every replica answers every poll with a snapshot of twice its share, for two
//!   rounds: each poll resets that replica's blocks and stores them again, evicting at the cap.
//!
//! Not a timed test: the figures are bytes, and the same on every run for the same `.wasm`.

use kvsteer_host_test::{FeedFault, FilterModule, Harness, HarnessConfig, filter_wasm_path};
use serde_json::json;

fn metric(h: &Harness, name: &str) -> i64 {
    h.proxy().metric(name).map_or(0, |m| m.value)
}

fn mb(bytes: usize) -> String {
    format!("{:.1}", bytes as f64 / (1024.0 * 1024.0))
}

/// Runs virtual time in 1 s steps until no worker has feed work pending and the index gauge is
/// `want` (or `max_s` passed). Returns the seconds run.
fn settle(h: &mut Harness, want: i64, max_s: u64) -> Result<u64, String> {
    for s in 1..=max_s {
        h.run_for(1_000_000).map_err(|e| e.to_string())?;
        if metric(h, "kvsteer_feed_pending_blocks") == 0
            && metric(h, "kvsteer_index_blocks") == want
        {
            return Ok(s);
        }
    }
    Err(format!(
        "not settled after {max_s} s: index {} of {want}, pending {}",
        metric(h, "kvsteer_index_blocks"),
        metric(h, "kvsteer_feed_pending_blocks")
    ))
}

fn memories(h: &Harness) -> String {
    h.workers()
        .iter()
        .map(|w| mb(w.memory_bytes()))
        .collect::<Vec<_>>()
        .join(" / ")
}

fn run(module: &FilterModule, cap: u64, replicas: usize, workers: usize) -> Result<(), String> {
    let share = cap / replicas as u64;
    // Snapshots up to 8 bytes a block plus framing: allow the flood's.
    let max_bytes = (2 * share * 8 + 4096).max(8 << 20);
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.workers = workers;
    cfg.replicas = replicas;
    cfg.routing = json!({"policy": "kv_load", "block_size": 16, "index_capacity_blocks": cap});
    // One poll a minute: `full` sees exactly one snapshot per replica.
    cfg.feed_period_ms = 60_000;
    cfg.filter_extra = json!({"feed_max_bytes": max_bytes})
        .as_object()
        .cloned()
        .unwrap_or_default();
    let mut h = Harness::new(module, cfg).map_err(|e| e.to_string())?;
    h.run_for(500_000).map_err(|e| e.to_string())?;
    println!(
        "| {replicas} | start | {} | {} |",
        metric(&h, "kvsteer_index_blocks"),
        memories(&h)
    );
    // Budget per tick per VM is 8,192 hashes (the default): CAP / 8,192 ticks of 100 ms, per worker
    // in turn at worst; plus a minute for the first poll.
    let max_s = 60 + 2 * cap / 8192 * workers as u64 / 10 + 60;
    for r in 0..replicas {
        h.set_feed_fault(r, FeedFault::Snapshot { blocks: share });
    }
    let s = settle(&mut h, (share * replicas as u64) as i64, max_s)?;
    // Every worker applies the relayed batches too; give the last ones time.
    h.run_for(10_000_000).map_err(|e| e.to_string())?;
    println!(
        "| {replicas} | full ({s} s) | {} | {} |",
        metric(&h, "kvsteer_index_blocks"),
        memories(&h)
    );
    for r in 0..replicas {
        h.set_feed_fault(r, FeedFault::Snapshot { blocks: 2 * share });
    }
    // Two rounds of polls (one a minute), each applied in full.
    let mut ran = 0;
    for _ in 0..2 {
        h.run_for(60_000_000).map_err(|e| e.to_string())?;
        ran += 60 + settle(&mut h, (share * replicas as u64) as i64, 2 * max_s)?;
        h.run_for(10_000_000).map_err(|e| e.to_string())?;
    }
    println!(
        "| {replicas} | flood ({ran} s) | {} | {} |",
        metric(&h, "kvsteer_index_blocks"),
        memories(&h)
    );
    Ok(())
}

/// Memory one filter VM holds with a full KV block index, and under a flood of snapshots.
#[derive(clap::Parser)]
#[command(name = "index-memory")]
struct Args {
    /// The index's capacity in blocks (`index_capacity_blocks`).
    #[arg(value_name = "CAP", default_value_t = 1_000_000)]
    cap: u64,
    /// Replica counts to try, comma-separated, one table block each (each at least 1).
    #[arg(value_name = "REPLICAS,...", default_value = "4,16", value_parser = replica_counts)]
    replicas: ReplicaCounts,
    /// Worker VMs (proxy worker threads), each with its own index.
    #[arg(value_name = "WORKERS", default_value_t = 2)]
    workers: usize,
}

/// The replica counts of `REPLICAS,...`.
#[derive(Clone)]
struct ReplicaCounts(Vec<usize>);

fn replica_counts(s: &str) -> Result<ReplicaCounts, String> {
    s.split(',')
        .map(|n| match n.parse() {
            Ok(0) => Err("a replica count is 0".to_string()),
            Ok(n) => Ok(n),
            Err(e) => Err(format!("{n:?}: {e}")),
        })
        .collect::<Result<_, _>>()
        .map(ReplicaCounts)
}

fn main() -> Result<(), String> {
    let Args {
        cap,
        replicas: ReplicaCounts(replicas),
        workers,
    } = clap::Parser::parse();
    let path = filter_wasm_path()?;
    let module = FilterModule::load_unmetered(&path).map_err(|e| e.to_string())?;
    println!("filter: {}", path.display());
    println!("index_capacity_blocks {cap}, {workers} worker VMs");
    println!();
    println!(
        "| replicas | point (virtual time) | index blocks | linear memory per worker VM (MiB) |"
    );
    println!("|---:|---|---:|---|");
    for r in replicas {
        run(&module, cap, r, workers)?;
    }
    Ok(())
}
