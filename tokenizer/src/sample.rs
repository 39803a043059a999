//! Synthetic chat conversations for the tokenizer benchmarks: the native bench
//! (`cargo bench -p kvsteer-tokenizer`) and the wasm one (host-test's `tokenizer-bench`) build the very
//! same text from one generator, so their figures compare like for like. English-like words,
//! punctuation and newlines, so the BPE sees ordinary pieces rather than one long run; every message
//! differs by seed, so nothing is shared by accident between conversations.

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

/// A message of `words` words (after a `[seed]` tag), the same for the same seed.
pub fn prose(seed: u64, words: usize) -> String {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = format!("[{seed}] ");
    for _ in 0..words {
        // Knuth's MMIX LCG; the high bits are the well-mixed ones.
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out.push_str(WORDS[((s >> 11) % WORDS.len() as u64) as usize]);
        out.push(' ');
    }
    out
}

/// A first turn as (role, content): a system message, `turns` user/assistant pairs of `words` words,
/// and a closing 150-word user message.
pub fn conversation(seed: u64, turns: usize, words: usize) -> Vec<(&'static str, String)> {
    let mut m = vec![("system", prose(seed * 1000, words))];
    for t in 0..turns as u64 {
        m.push(("user", prose(seed * 1000 + 2 * t + 1, words)));
        m.push(("assistant", prose(seed * 1000 + 2 * t + 2, words)));
    }
    m.push(("user", prose(seed * 1000 + 999, 150)));
    m
}

/// What the follow-up turn appends to [`conversation`]`(seed, ..)`: the assistant's 200-word reply
/// and a new 150-word user message.
pub fn follow_up(seed: u64) -> [(&'static str, String); 2] {
    [
        ("assistant", prose(seed * 7919, 200)),
        ("user", prose(seed * 7919 + 1, 150)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_text_other_seed_other_text() {
        assert_eq!(prose(7, 50), prose(7, 50));
        assert_ne!(prose(7, 50), prose(8, 50));
        assert_eq!(prose(7, 50).split(' ').count(), 52);
        let c = conversation(3, 2, 10);
        let roles: Vec<&str> = c.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            roles,
            ["system", "user", "assistant", "user", "assistant", "user"]
        );
        assert_ne!(follow_up(3)[0].1, follow_up(4)[0].1);
    }
}
