//! Figures for the bars of docs/design/design.md section 8 (no criterion: plain timing loops that
//! print a table). Run: `cargo bench -p kvsteer-core --bench core` (add `-- --quick` for a short
//! run).

use std::hint::black_box;
use std::time::Instant;

use kvsteer_core::approx::ApproxIndex;
use kvsteer_core::block::{BlockHasher, SeqHash};
use kvsteer_core::feed::{FeedBatch, FeedEvent, ReplicaLoad, Tier};
use kvsteer_core::index::KvIndex;
use kvsteer_core::rng::SplitMix64;
use kvsteer_core::{PolicyKind, Router, RoutingConfig};

const REPLICAS: usize = 16;
const INDEX_BLOCKS: usize = 1_000_000;

fn row(what: &str, value: String, bar: &str) {
    println!("| {what:<58} | {value:>16} | {bar:<28} |");
}

/// Seconds per call: best of 5 rounds after a warm-up (the development machine is shared and noisy;
/// the best round is the least disturbed one).
fn time_per_iter(iters: u32, mut f: impl FnMut()) -> f64 {
    for _ in 0..iters.div_ceil(10) {
        f();
    }
    let per_round = iters.div_ceil(5).max(1);
    (0..5)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..per_round {
                f();
            }
            t.elapsed().as_secs_f64() / per_round as f64
        })
        .fold(f64::INFINITY, f64::min)
}

fn snapshot(epoch: u64, hashes: Vec<u64>) -> FeedBatch {
    FeedBatch {
        epoch,
        resync: true,
        more: false,
        first_seq: 0,
        next_seq: 0,
        load: ReplicaLoad {
            block_size: 16,
            ..ReplicaLoad::default()
        },
        events: hashes
            .chunks(64)
            .map(|c| FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: c.to_vec(),
            })
            .collect(),
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let scale = if quick { 10 } else { 1 };
    let mut rng = SplitMix64::new(42);
    let hasher = BlockHasher::new(16).unwrap();
    let prompt: Vec<u32> = (0..8192)
        .map(|_| (rng.next_u64() % 150_000) as u32)
        .collect();
    let prompt_hashes: Vec<u64> = hasher
        .sequence_hashes(&prompt)
        .iter()
        .map(|h| h.0)
        .collect();
    let token_body =
        format!("{{\"model\":\"m\",\"max_tokens\":1024,\"stream\":true,\"prompt\":{prompt:?}}}");
    let text: String = (0..32_000 - 100)
        .map(|_| (b'a' + (rng.next_u64() % 26) as u8) as char)
        .enumerate()
        .map(|(i, c)| if i % 7 == 6 { ' ' } else { c })
        .collect();
    let text_body =
        format!("{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"{text}\"}}]}}");

    println!(
        "kvsteer-core bench ({} mode)",
        if quick { "quick" } else { "full" }
    );
    println!(
        "| {:<58} | {:>16} | {:<28} |",
        "measure", "value", "bar (docs/design/design.md s.8)"
    );
    println!("|{:-<60}|{:-<18}|{:-<30}|", "", "", "");

    // Stored-event apply throughput, straight into the index.
    let total = INDEX_BLOCKS / scale;
    let fresh: Vec<u64> = (0..total).map(|_| rng.next_u64()).collect();
    let mut ix = KvIndex::new(total, REPLICAS, 7);
    let t = Instant::now();
    for (i, chunk) in fresh.chunks(64).enumerate() {
        ix.store(i % REPLICAS, Tier::Gpu, chunk);
    }
    let secs = t.elapsed().as_secs_f64();
    row(
        &format!("index.store: {total} new blocks, 64 per event"),
        format!("{:.1} M blocks/s", total as f64 / secs / 1e6),
        "millions of events/s",
    );
    row(
        "heap bytes per indexed block (1 holder each)",
        format!("{:.1} B", ix.heap_bytes() as f64 / ix.len() as f64),
        "a few tens of bytes",
    );
    // Re-storing (same blocks on a second replica / tier) and removal.
    let t = Instant::now();
    for (i, chunk) in fresh.chunks(64).enumerate() {
        ix.store((i + 1) % REPLICAS, Tier::Host, chunk);
    }
    let secs = t.elapsed().as_secs_f64();
    row(
        "index.store: existing blocks, second holder",
        format!("{:.1} M blocks/s", total as f64 / secs / 1e6),
        "",
    );
    row(
        "heap bytes per indexed block (2 holders each)",
        format!("{:.1} B", ix.heap_bytes() as f64 / ix.len() as f64),
        "a few tens of bytes",
    );
    // Eviction pressure: a full index taking another `total` new blocks.
    let more: Vec<u64> = (0..total).map(|_| rng.next_u64()).collect();
    let t = Instant::now();
    for (i, chunk) in more.chunks(64).enumerate() {
        ix.store(i % REPLICAS, Tier::Gpu, chunk);
    }
    let secs = t.elapsed().as_secs_f64();
    row(
        "index.store at the cap (each insert evicts)",
        format!("{:.1} M blocks/s", total as f64 / secs / 1e6),
        "",
    );
    let t = Instant::now();
    for (i, chunk) in more.chunks(64).enumerate() {
        ix.remove(i % REPLICAS, Tier::Gpu, chunk);
    }
    let secs = t.elapsed().as_secs_f64();
    row(
        "index.remove",
        format!("{:.1} M blocks/s", total as f64 / secs / 1e6),
        "",
    );
    drop(ix);

    // Router with 1M blocks over 16 replicas; the 8K-token request matches 512 blocks on replica 0,
    // 256 on replica 1, and a 64-block shared prefix on every other replica.
    let cfg = RoutingConfig {
        policy: PolicyKind::KvLoad,
        index_capacity_blocks: INDEX_BLOCKS,
        ..RoutingConfig::default()
    };
    let mut router = Router::new(cfg, REPLICAS).unwrap();
    let per_replica = total / REPLICAS;
    let t = Instant::now();
    for r in 0..REPLICAS {
        let mut hashes: Vec<u64> = match r {
            0 => prompt_hashes.clone(),
            1 => prompt_hashes[..256].to_vec(),
            _ => prompt_hashes[..64].to_vec(),
        };
        while hashes.len() < per_replica {
            hashes.push(rng.next_u64());
        }
        router.apply_feed(r, &snapshot(1, hashes));
    }
    let secs = t.elapsed().as_secs_f64();
    row(
        &format!(
            "Router::apply_feed: {} blocks in snapshots",
            router.stats().index_blocks
        ),
        format!(
            "{:.1} M blocks/s",
            router.stats().index_blocks as f64 / secs / 1e6
        ),
        "millions of events/s",
    );
    let req = router
        .read_request("/v1/completions", token_body.as_bytes(), None)
        .unwrap();
    let iters = 20_000 / scale as u32;
    let d = router.route(&req, 0);
    assert_eq!(d.replica, 0, "the full match wins on an idle fleet");
    let s = time_per_iter(iters, || {
        black_box(router.route(black_box(&req), 0));
    });
    row(
        "route kv_load: 8,192 tokens (512 blocks) vs 1M blocks/16 reps",
        format!("{:.2} us", s * 1e6),
        "a few us",
    );
    let keys = prompt_hashes.clone();
    let mut out = Vec::new();
    let mut ix = KvIndex::new(INDEX_BLOCKS, REPLICAS, 7);
    for r in 0..REPLICAS {
        let n = match r {
            0 => 512,
            1 => 256,
            _ => 64,
        };
        ix.store(r, Tier::Gpu, &keys[..n]);
    }
    let filler: Vec<u64> = (0..total - 512).map(|_| rng.next_u64()).collect();
    for (i, c) in filler.chunks(64).enumerate() {
        ix.store(i % REPLICAS, Tier::Gpu, c);
    }
    let s = time_per_iter(iters, || {
        ix.match_prefix(black_box(&keys), &mut out);
        black_box(&out);
    });
    row(
        "index.match_prefix alone (same request and index)",
        format!("{:.2} us", s * 1e6),
        "",
    );
    drop(ix);
    for policy in PolicyKind::ALL {
        let mut cfg = router.config().clone();
        cfg.policy = policy;
        let mut r2 = Router::new(cfg, REPLICAS).unwrap();
        let s = time_per_iter(iters, || {
            black_box(r2.route(black_box(&req), 0));
        });
        row(
            &format!("route {} (8K tokens, empty index)", policy.name()),
            format!("{:.2} us", s * 1e6),
            "",
        );
    }

    // Approximate index: the router's own decisions, one 512-block prompt a record.
    let cap = 131_072 / scale;
    let mut ax: ApproxIndex<SeqHash> = ApproxIndex::new(cap, u64::MAX);
    let prompts: Vec<Vec<SeqHash>> = (0..cap / 512)
        .map(|_| (0..512).map(|_| SeqHash(rng.next_u64())).collect())
        .collect();
    let t = Instant::now();
    for (i, p) in prompts.iter().enumerate() {
        ax.record(i % REPLICAS, p, i as u64);
    }
    let secs = t.elapsed().as_secs_f64();
    row(
        &format!("approx.record: {} blocks", ax.len()),
        format!("{:.1} M blocks/s", ax.len() as f64 / secs / 1e6),
        "",
    );
    row(
        "approx heap bytes per block",
        format!("{:.1} B", ax.heap_bytes() as f64 / ax.len() as f64),
        "",
    );
    drop(ax);

    // Request reading: JSON parse + block hashing.
    let iters = 2_000 / scale as u32;
    let s = time_per_iter(iters, || {
        black_box(
            router
                .read_request("/v1/completions", black_box(token_body.as_bytes()), None)
                .unwrap(),
        );
    });
    row(
        &format!(
            "read_request: 8,192 token ids ({} KB body)",
            token_body.len() / 1024
        ),
        format!("{:.1} us", s * 1e6),
        "filter path << 100 us (wasm)",
    );
    let s = time_per_iter(iters, || {
        black_box(
            kvsteer_core::request::read_request_reference(
                "/v1/completions",
                black_box(token_body.as_bytes()),
                None,
                16,
                1 << 24,
                None,
            )
            .unwrap(),
        );
    });
    row(
        "the same through the general serde_json reader",
        format!("{:.1} us", s * 1e6),
        "",
    );
    let s = time_per_iter(iters, || {
        let mut acc = 0u32;
        for &b in black_box(token_body.as_bytes()) {
            acc = black_box(acc.wrapping_add(b as u32));
        }
        black_box(acc);
    });
    row(
        "reference: one plain pass over the same body's bytes",
        format!("{:.1} us", s * 1e6),
        "(machine speed reference)",
    );
    let s = time_per_iter(iters, || {
        black_box(
            router
                .read_request(
                    "/v1/chat/completions",
                    black_box(text_body.as_bytes()),
                    None,
                )
                .unwrap(),
        );
    });
    row(
        &format!(
            "read_request: chat text ({} KB body)",
            text_body.len() / 1024
        ),
        format!("{:.1} us", s * 1e6),
        "filter path << 100 us (wasm)",
    );
    let ids = format!("{prompt:?}");
    let s = time_per_iter(iters, || {
        black_box(serde_json::from_str::<Vec<u32>>(black_box(&ids)).unwrap());
    });
    row(
        "reference: serde_json::from_str::<Vec<u32>> of the same ids",
        format!("{:.1} us", s * 1e6),
        "(machine speed reference)",
    );
    let s = time_per_iter(iters, || {
        black_box(hasher.sequence_hashes(black_box(&prompt)));
    });
    row(
        "block hashing alone: 8,192 tokens",
        format!("{:.1} us", s * 1e6),
        "",
    );
}
