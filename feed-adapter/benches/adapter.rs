//! `cargo bench -p kvsteer-feed --bench adapter [-- --quick]`: engine events decoded and applied per
//! second on one core, and heap bytes per block held. Prints a table (docs/guide/feed-adapter.md
//! records it).

use kvsteer_core::feed::FeedQuery;
use kvsteer_feed::encode::{Event, batch};
use kvsteer_feed::state::{AdapterState, StateConfig};
use kvsteer_feed::wire::{Limits, decode_batch};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::time::Instant;

/// Counts live heap bytes.
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        LIVE.fetch_add(n as isize - l.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static A: Counting = Counting;

const BS: u32 = 16;

/// Payloads of one workload: `events` BlockStored events of `blocks` blocks each (fresh prompts, so
/// every block is new), each batch followed by a batch removing the blocks stored `lag` batches
/// earlier, as an engine at steady state evicts about as much as it stores.
fn workload(events: usize, blocks: usize, per_batch: usize, lag: usize) -> (Vec<Vec<u8>>, u64) {
    let mut out = Vec::new();
    let mut next_hash = 1u64;
    let mut token = 0u32;
    let mut stored: Vec<Vec<u64>> = Vec::new();
    let mut n_events = 0u64;
    let mut i = 0;
    while i < events {
        let k = per_batch.min(events - i);
        let mut toks: Vec<Vec<u32>> = Vec::new();
        let mut hs: Vec<Vec<u64>> = Vec::new();
        for _ in 0..k {
            let h: Vec<u64> = (0..blocks as u64).map(|j| next_hash + j).collect();
            next_hash += blocks as u64;
            let t: Vec<u32> = (0..blocks * BS as usize)
                .map(|_| {
                    token = token.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    token >> 8
                })
                .collect();
            toks.push(t);
            hs.push(h);
        }
        let evs: Vec<Event<'_>> = hs
            .iter()
            .zip(&toks)
            .map(|(h, t)| Event::Stored {
                hashes: h,
                parent: None,
                token_ids: t,
                block_size: BS,
                lora_name: None,
                medium: "GPU",
            })
            .collect();
        out.push(batch(0.0, &evs, 0));
        n_events += k as u64;
        stored.extend(hs);
        if stored.len() > lag {
            let old: Vec<Vec<u64>> = stored.drain(..stored.len() - lag).collect();
            let evs: Vec<Event<'_>> = old
                .iter()
                .map(|h| Event::Removed {
                    hashes: h,
                    medium: "GPU",
                })
                .collect();
            n_events += evs.len() as u64;
            out.push(batch(0.0, &evs, 0));
        }
        i += k;
    }
    (out, n_events)
}

fn best_of<F: FnMut() -> f64>(rounds: usize, mut f: F) -> f64 {
    (0..rounds).map(|_| f()).fold(f64::MAX, f64::min)
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 10 } else { 1 };
    println!(
        "| workload | payload MB | decode only: events/s (blocks/s, stored + removed) | decode + apply: events/s (blocks/s) |"
    );
    println!("|---|---:|---:|---:|");
    for (name, events, blocks, per_batch) in [
        (
            "1 block/event (SGLang-like, decode-time stores)",
            200_000 / scale,
            1,
            16,
        ),
        (
            "32 blocks/event (vLLM, 512-token prompt chunks)",
            20_000 / scale,
            32,
            4,
        ),
        (
            "512 blocks/event (8,192-token prompts)",
            1_000 / scale,
            512,
            1,
        ),
    ] {
        let (payloads, n_events) = workload(events, blocks, per_batch, 64);
        let bytes: usize = payloads.iter().map(|p| p.len()).sum();
        let n_blocks = 2 * events as u64 * blocks as u64; // stored, then removed
        let lim = Limits::default();
        let dec = best_of(3, || {
            let t = Instant::now();
            let mut n = 0usize;
            for p in &payloads {
                n += decode_batch(p, &lim).unwrap().events.len();
            }
            assert_eq!(n as u64, n_events);
            t.elapsed().as_secs_f64()
        });
        let app = best_of(3, || {
            let mut st = AdapterState::new(
                StateConfig {
                    block_size: Some(BS as usize),
                    ..StateConfig::default()
                },
                1,
            );
            let t = Instant::now();
            for p in &payloads {
                st.apply_payload(p, 0).unwrap();
            }
            let secs = t.elapsed().as_secs_f64();
            assert_eq!(st.stats().blocks_stored, events as u64 * blocks as u64);
            secs
        });
        println!(
            "| {name} | {:.1} | {:.2} M ({:.2} M) | {:.2} M ({:.2} M) |",
            bytes as f64 / 1e6,
            n_events as f64 / dec / 1e6,
            n_blocks as f64 / dec / 1e6,
            n_events as f64 / app / 1e6,
            n_blocks as f64 / app / 1e6,
        );
    }

    // Memory: hold N blocks (nothing removed); the feed log keeps only a small window.
    let n_blocks: usize = if quick { 100_000 } else { 1_000_000 };
    let (payloads, _) = workload(n_blocks / 32, 32, 64, usize::MAX);
    let before = LIVE.load(Ordering::Relaxed);
    let mut st = AdapterState::new(
        StateConfig {
            block_size: Some(BS as usize),
            max_blocks: Some(n_blocks),
            log_hashes: 4096,
            ..StateConfig::default()
        },
        1,
    );
    for p in &payloads {
        st.apply_payload(p, 0).unwrap();
    }
    let _ = st.answer(&FeedQuery::resync(1)); // publish
    let held = LIVE.load(Ordering::Relaxed) - before;
    println!();
    println!(
        "heap per block held: {:.1} B ({} blocks, {:.1} MB; feed log capped at 4,096 hashes; the log adds 8 B per retained hash)",
        held as f64 / n_blocks as f64,
        st.blocks(),
        held as f64 / 1e6
    );
    // Snapshot cost: what a router's first poll costs at this size.
    let t = Instant::now();
    let b = st.answer(&FeedQuery::resync(1));
    let enc = b.encode();
    println!(
        "snapshot of {} blocks: {:.1} ms, {:.1} MB encoded",
        st.blocks(),
        t.elapsed().as_secs_f64() * 1e3,
        enc.len() as f64 / 1e6
    );
}
