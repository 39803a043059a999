//! Native cost of exact tokenization per request (the wasm figures come from host-test's
//! `tokenizer-bench`): chat conversations of about 8K, 32K and 128K tokens with the harmony template,
//! first turn (every message new) and follow-up turn (two new messages, the rest from the cache), and
//! the vocabulary load. Run: `cargo bench -p kvsteer-tokenizer`.

use kvsteer_core::request::{ChatTurn, PromptTokenizer};
use kvsteer_tokenizer::sample::{conversation, follow_up, prose};
use kvsteer_tokenizer::{Bpe, TextTokenizer, TokenizerConfig, Vocabulary};
use std::time::Instant;

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
            let mut msgs = conversation(seed, (target / 1000).saturating_sub(1) / 2, words);
            let t = Instant::now();
            n1 = tok.tokenize_chat(&turns(&msgs)).unwrap().len();
            first.push(t.elapsed().as_secs_f64() * 1e3);
            msgs.extend(follow_up(seed));
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
