//! `KvIndex::match_prefix` at 1,000,000 blocks over 16 replicas, natively, the way the routing path
//! meets it: between two requests the CPU caches are disturbed (a request's body is read in
//! between: 64 KiB touched before an 8K-token prompt's 512 blocks, 1 MiB before a 128K-token
//! prompt's 8,192), each prompt shares all but its last 12 blocks with the one before it (cached on
//! replica 3), and the rest of the index is random blocks. The core bench (`benches/core.rs`)
//! repeats one match in a tight loop instead, with everything in cache.
//!
//! Run: `cargo run --release -p kvsteer-core --example match_bench`. Prints the median and 10th
//! percentile of the match's wall time.

use kvsteer_core::feed::Tier;
use kvsteer_core::index::KvIndex;
use std::hint::black_box;
use std::time::Instant;

fn main() {
    let mut x = 0x1234_5678u64;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut ix = KvIndex::new(1_100_000, 16, 7);
    let prefix: Vec<u64> = (0..8192).map(|_| next()).collect();
    for r in 0..16 {
        let keys: Vec<u64> = (0..62_500).map(|_| next()).collect();
        ix.store(r, Tier::Gpu, &keys);
    }
    ix.store(3, Tier::Gpu, &prefix[..8180]);
    let mut scratch = vec![0u8; 4 << 20];
    let mut out = Vec::new();
    for &(n, disturb) in &[(512usize, 64usize << 10), (8192, 1 << 20)] {
        let mut times = Vec::new();
        for round in 0..2000 / (n / 512).max(1) {
            // A new 12-block tail per request.
            let mut keys = prefix[..n].to_vec();
            for k in keys.iter_mut().skip(n - 12) {
                *k = next();
            }
            let off = (round * 4096) % (scratch.len() - disturb);
            for b in scratch[off..off + disturb].iter_mut().step_by(64) {
                *b = b.wrapping_add(1);
            }
            black_box(&scratch);
            let t = Instant::now();
            ix.match_prefix(black_box(&keys), &mut out);
            times.push(t.elapsed().as_secs_f64() * 1e6);
            black_box(&out);
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{n} blocks ({} matched on replica 3): p50 {:.2} us, p10 {:.2} us",
            out[3][0],
            times[times.len() / 2],
            times[times.len() / 10]
        );
    }
}
