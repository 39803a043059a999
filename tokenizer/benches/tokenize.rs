//! Native cost of exact tokenization per request (the wasm figures come from host-test's
//! `tokenizer-bench`): chat conversations of about 8K, 32K and 128K tokens with the harmony template,
//! first turn (every message new) and follow-up turn (two new messages, the rest from the cache), and
//! the vocabulary load. Run: `cargo bench -p kvsteer-tokenizer`.

use kvsteer_core::request::{ChatTurn, PromptTokenizer};
use kvsteer_tokenizer::{Bpe, TextTokenizer, TokenizerConfig, Vocabulary};
use std::time::Instant;

const WORDS: [&str; 32] = [
    "the",
    "router",
    "sends",
    "each",
    "request",
    "to",
    "a",
    "replica",
    "that",
    "already",
    "holds",
    "its",
    "prefix,",
    "and",
    "balances",
    "decode",
    "load;",
    "tokens",
    "are",
    "hashed",
    "into",
    "blocks",
    "of",
    "sixteen.",
    "When",
    "cache",
    "misses",
    "happen,",
    "prefill",
    "costs",
    "more",
    "(see 2.1)\n",
];

fn prose(seed: u64, words: usize) -> String {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = format!("[{seed}] ");
    for _ in 0..words {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out.push_str(WORDS[((s >> 33) % WORDS.len() as u64) as usize]);
        out.push(' ');
    }
    out
}

fn turns<'a>(msgs: &'a [(&'static str, String)]) -> Vec<ChatTurn<'a>> {
    msgs.iter()
        .map(|(r, c)| ChatTurn {
            role: Some(r),
            parts: vec![c.as_str()],
            non_text: false,
            tool_calls: false,
        })
        .collect()
}

fn main() {
    let t = Instant::now();
    let _ = Bpe::load(Vocabulary::O200kHarmony);
    println!(
        "o200k_harmony vocabulary load (first in process): {:.0} ms",
        t.elapsed().as_secs_f64() * 1e3
    );
    let mut tok = TextTokenizer::new(&TokenizerConfig::default()).unwrap();
    // ~1,000 tokens a message: calibrate words per message.
    let probe = vec![("user", prose(1, 1000))];
    let n = tok.tokenize_chat(&turns(&probe)).unwrap().len();
    let words = 1000 * 1000 / n.max(1);
    println!();
    println!("| conversation | prompt tokens | turn | ms (median of 5) |");
    println!("|---|---:|---|---:|");
    let mut seed = 10;
    for (label, target) in [("8K", 8_192usize), ("32K", 32_768), ("128K", 131_072)] {
        let (mut first, mut follow, mut n1, mut n2) = (Vec::new(), Vec::new(), 0, 0);
        for _ in 0..5 {
            seed += 1;
            let mut msgs = vec![("system", prose(seed * 1000, words))];
            for t in 0..(target / 1000).saturating_sub(1) / 2 {
                msgs.push(("user", prose(seed * 1000 + 2 * t as u64 + 1, words)));
                msgs.push(("assistant", prose(seed * 1000 + 2 * t as u64 + 2, words)));
            }
            msgs.push(("user", prose(seed * 1000 + 999, 150)));
            let t = Instant::now();
            n1 = tok.tokenize_chat(&turns(&msgs)).unwrap().len();
            first.push(t.elapsed().as_secs_f64() * 1e3);
            msgs.push(("assistant", prose(seed * 7919, 200)));
            msgs.push(("user", prose(seed * 7919 + 1, 150)));
            let t = Instant::now();
            n2 = tok.tokenize_chat(&turns(&msgs)).unwrap().len();
            follow.push(t.elapsed().as_secs_f64() * 1e3);
        }
        first.sort_by(f64::total_cmp);
        follow.sort_by(f64::total_cmp);
        println!("| {label} | {n1} | first | {:.2} |", first[2]);
        println!("| {label} | {n2} | follow-up | {:.2} |", follow[2]);
    }
    let s = tok.stats();
    println!();
    println!(
        "cache: {} hits, {} misses, {} tokens held in {} segments",
        s.cache_hits, s.cache_misses, s.cache_tokens, s.cache_segments
    );
}
