//! Native cost of exact tokenization per request (the wasm figures come from host-test's
//! `tokenizer-bench`): chat conversations of about 8K, 32K and 128K tokens with the harmony template,
//! first turn (every message new) and follow-up turn (two new messages, the rest from the cache), and
//! the vocabulary load. Then, when `tokenizer/scripts/hf-fetch` has fetched it, the same for a
//! Hugging Face bundle with a 128K vocabulary (Llama 3.1, its own template) at 1K, 8K and 32K tokens,
//! with the memory the loaded tokenizer holds, counted by a counting global allocator.
//! Run: `cargo bench -p kvsteer-tokenizer`.

use kvsteer_core::request::{ChatTurn, PromptTokenizer};
use kvsteer_tokenizer::sample::{conversation, follow_up, prose};
use kvsteer_tokenizer::{Bpe, TextTokenizer, TokenizerConfig, Vocabulary};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

/// The system allocator, counting the bytes live now and the most live at once.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let now = LIVE.fetch_add(l.size(), Relaxed) + l.size();
        PEAK.fetch_max(now, Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_sub(l.size(), Relaxed);
        let now = LIVE.fetch_add(new, Relaxed) + new;
        PEAK.fetch_max(now, Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

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
        let pairs = (target / 1000).saturating_sub(1) / 2;
        let (n1, n2, first, follow) = time_turns(&mut tok, &mut seed, pairs, words);
        println!("| {label} | {n1} | first | {first:.2} |");
        println!("| {label} | {n2} | follow-up | {follow:.2} |");
    }
    let s = tok.stats();
    println!();
    println!(
        "cache: {} hits, {} misses, {} tokens held in {} segments",
        s.cache_hits, s.cache_misses, s.cache_tokens, s.cache_segments
    );
    hf_bench();
}

/// Five conversations of `pairs` exchanges of `words`-word messages, each tokenized whole and then
/// with a follow-up: the last one's prompt tokens at each turn, and each turn's median time (ms).
fn time_turns(
    tok: &mut TextTokenizer,
    seed: &mut u64,
    pairs: usize,
    words: usize,
) -> (usize, usize, f64, f64) {
    let (mut first, mut follow, mut n1, mut n2) = (Vec::new(), Vec::new(), 0, 0);
    for _ in 0..5 {
        *seed += 1;
        let mut msgs = conversation(*seed, pairs, words);
        let t = Instant::now();
        n1 = tok.tokenize_chat(&turns(&msgs)).unwrap().len();
        first.push(t.elapsed().as_secs_f64() * 1e3);
        msgs.extend(follow_up(*seed));
        let t = Instant::now();
        n2 = tok.tokenize_chat(&turns(&msgs)).unwrap().len();
        follow.push(t.elapsed().as_secs_f64() * 1e3);
    }
    (n1, n2, median(first), median(follow))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Llama 3.1's bundle (128,256 tokens): load time and memory, then chats of about 1K, 8K and 32K
/// tokens through its own template, first turn with an empty cache and follow-up turn.
fn hf_bench() {
    let dir = std::env::var_os("KVSTEER_HF_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/tokenizers").into())
        .join("llama3_1");
    let (Ok(json), Ok(config)) = (
        std::fs::read(dir.join("tokenizer.json")),
        std::fs::read(dir.join("tokenizer_config.json")),
    ) else {
        println!(
            "\nno Hugging Face bundle in {} (run tokenizer/scripts/hf-fetch): skipped",
            dir.display()
        );
        return;
    };
    let cfg = TokenizerConfig::default();
    let (before, t) = (LIVE.load(Relaxed), Instant::now());
    PEAK.store(before, Relaxed);
    let mut tok = TextTokenizer::with_huggingface(&cfg, &json, Some(&config)).unwrap();
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    let (held, peak) = (LIVE.load(Relaxed) - before, PEAK.load(Relaxed) - before);
    let h = tok.huggingface().unwrap();
    println!();
    println!(
        "llama3_1 bundle ({} tokens, {} merges, tokenizer.json {:.1} MB): load {load_ms:.0} ms, \
         {:.1} MB held after load, {:.1} MB peak while loading",
        h.vocab_size(),
        h.merge_count(),
        json.len() as f64 / 1e6,
        held as f64 / 1e6,
        peak as f64 / 1e6
    );
    let (merges, words) = h.table_bytes();
    println!(
        "of which the merge table {:.1} MB, the vocabulary index kept for ignore_merges {:.1} MB",
        merges as f64 / 1e6,
        words as f64 / 1e6
    );
    drop((json, config));
    let probe = vec![("user", prose(1, 1000))];
    let words = 1000 * 1000 / tok.tokenize_chat(&turns(&probe)).unwrap().len().max(1);
    println!();
    println!("| conversation | prompt tokens | turn | ms (median of 5) |");
    println!("|---|---:|---|---:|");
    let mut seed = 100;
    for (label, target, pairs) in [
        ("1K", 1_024usize, 1usize),
        ("8K", 8_192, 3),
        ("32K", 32_768, 15),
    ] {
        let per_msg = words * target / 1000 / (2 * pairs + 2);
        let (n1, n2, first, follow) = time_turns(&mut tok, &mut seed, pairs, per_msg);
        println!("| {label} | {n1} | first | {first:.2} |");
        println!("| {label} | {n2} | follow-up | {follow:.2} |");
    }
    let s = tok.stats();
    println!(
        "cache after the runs: {:.1} MB of ids in {} segments",
        s.cache_tokens as f64 * 4e-6,
        s.cache_segments
    );
}
