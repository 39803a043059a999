//! A worker VM's memory with a full block index, through the compiled filter: every
//! proxy worker holds its own index, and WebAssembly memory never shrinks, so what a VM ever held at
//! once is what the proxy keeps per worker. It must stay within the index's bound for the cap
//! (`KvIndex::memory_bound`) plus the feed answers it was handed, with no room for the doubling
//! copies and holes the index's containers used to leave (the `.wasm` before the chunked slab and the
//! table's single step grew 12.1 MiB here, against 6.4 MiB now; the bound is 4.5 MiB plus 1.6 MiB of
//! snapshots, and 2 MiB of slack for the allocator and the rest of the filter).

mod common;
use common::*;
use kvsteer_core::index::KvIndex;
use kvsteer_host_test::{FeedFault, Harness, HarnessConfig};
use serde_json::json;

fn metric(h: &Harness, name: &str) -> i64 {
    h.proxy().metric(name).map_or(0, |m| m.value)
}

#[test]
fn a_full_index_costs_a_worker_its_bound_and_the_snapshots_no_more() {
    const CAP: u64 = 200_000;
    const REPLICAS: usize = 4;
    let share = CAP / REPLICAS as u64;
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.replicas = REPLICAS;
    cfg.routing = json!({"policy": "kv_load", "block_size": 16, "index_capacity_blocks": CAP});
    // One poll a minute: each replica's snapshot arrives once.
    cfg.feed_period_ms = 60_000;
    let mut h = harness_with(cfg);
    let start: Vec<usize> = h.workers().iter().map(|w| w.memory_bytes()).collect();
    for r in 0..REPLICAS {
        h.set_feed_fault(r, FeedFault::Snapshot { blocks: share });
    }
    // The next polls (at 60 s) bring the snapshots; 200k blocks at 8,192 a tick take 2.5 s, and the
    // follower applies the relayed batches after the lease holder.
    h.run_for(80_000_000).unwrap();
    assert_eq!(metric(&h, "kvsteer_index_blocks"), CAP as i64, "index full");
    assert_eq!(metric(&h, "kvsteer_feed_pending_blocks"), 0);
    // Each snapshot: the 80-byte header, two event headers, 8 bytes a block.
    let snapshots = REPLICAS * (80 + 12 + share as usize * 8);
    let bound = KvIndex::memory_bound(CAP as usize, REPLICAS) + snapshots + (2 << 20);
    for (w, vm) in h.workers().iter().enumerate() {
        let grew = vm.memory_bytes() - start[w];
        assert!(
            grew <= bound,
            "worker {w}: linear memory grew {grew} bytes, over {bound} (index bound, snapshots, 2 MiB)"
        );
        // Not vacuous: the slots alone are 16 bytes a block.
        assert!(grew >= 16 * CAP as usize, "worker {w}: grew only {grew}");
    }
}
