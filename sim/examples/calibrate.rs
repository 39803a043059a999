//! Prints the simulator's latency shape for the default profile (Llama-3.1-8B, one H100), for the
//! calibration table in docs/design/simulator.md.
//!
//! `cargo run --release -p kvsteer-sim --example calibrate`

use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest};

fn prompt(tag: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| tag.wrapping_mul(7_919) ^ (i * 31))
        .collect()
}

fn run(batch: u64, prompt_len: usize, out: u32) -> (f64, f64) {
    let mut e = Engine::new(EngineConfig::default());
    for id in 0..batch {
        let r = EngineRequest {
            id,
            prompt: prompt(id as u32 + 1, prompt_len),
            max_tokens: out,
            ignore_eos: true,
            min_tokens: 0,
        };
        e.submit(0, r).expect("fits");
    }
    let mut ev = Vec::new();
    while let Some(t) = e.next_event_time() {
        e.advance(t, &mut ev);
    }
    // TTFT of request 0 (alone in the first step); ITL as the median gap between its tokens, so the
    // few steps it shares with the other requests' prefill chunks do not count.
    let times: Vec<u64> = ev
        .iter()
        .filter_map(|x| match *x {
            EngineEvent::FirstToken { id: 0, t_us, .. }
            | EngineEvent::Token { id: 0, t_us, .. } => Some(t_us),
            _ => None,
        })
        .collect();
    let mut gaps: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    gaps.sort_unstable();
    let itl = gaps.get(gaps.len() / 2).copied().unwrap_or(0) as f64 / 1e3;
    (times[0] as f64 / 1e3, itl)
}

fn main() {
    println!("TTFT of one request alone (no cache), ms:");
    println!("| prompt tokens | TTFT ms | prefill tokens/s |");
    println!("|---|---|---|");
    for len in [128usize, 512, 1024, 2048, 4096, 8192, 32768, 131_000] {
        let (ttft, _) = run(1, len, 1);
        println!("| {len} | {ttft:.1} | {:.0} |", len as f64 / ttft * 1e3);
    }
    println!();
    println!(
        "Inter-token latency with a batch decoding together (1,024-token prompts, 128 output tokens):"
    );
    println!("| batch | ITL ms (median) | output tokens/s |");
    println!("|---|---|---|");
    for b in [1u64, 8, 32, 64, 128, 256] {
        let (_, itl) = run(b, 1024, 128);
        println!("| {b} | {itl:.2} | {:.0} |", b as f64 / itl * 1e3);
    }
}
