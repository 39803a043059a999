//! A deterministic stand-in tokenizer, used until a real one lands: text is cut into chunks of 4 bytes
//! (about the 4 bytes a token of English text costs with BPE tokenizers) and each chunk is hashed to an
//! id. It is *not* a real tokenizer: counts are approximate and ids mean nothing. What it keeps is the
//! property routing depends on: prompts that share a text prefix share a token prefix (every whole
//! chunk before the first differing byte), so prefix caching and KV-aware routing behave as with a real
//! tokenizer. Output ids are rendered back to text by [`detokenize`] as short pseudo-words.

use crate::output::{VOCAB, mix64};

/// Bytes per token of the stand-in.
pub const BYTES_PER_TOKEN: usize = 4;

/// Token ids of `text`.
pub fn tokenize(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len().div_ceil(BYTES_PER_TOKEN));
    for chunk in text.as_bytes().chunks(BYTES_PER_TOKEN) {
        let mut v = [0u8; 8];
        v[..chunk.len()].copy_from_slice(chunk);
        v[7] = chunk.len() as u8;
        out.push((mix64(u64::from_le_bytes(v)) % VOCAB as u64) as u32);
    }
    out
}

const SYLLABLES: [&str; 16] = [
    "ka", "lo", "mi", "ne", "ru", "ta", "vo", "zen", "pa", "shi", "do", "ri", "bu", "ge", "fa",
    "yo",
];

/// Text of one output token: a space and a two-syllable pseudo-word.
pub fn token_text(id: u32, out: &mut String) {
    out.push(' ');
    out.push_str(SYLLABLES[(id & 15) as usize]);
    out.push_str(SYLLABLES[((id >> 4) & 15) as usize]);
}

/// Text of a run of output tokens.
pub fn detokenize(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 5);
    for &id in ids {
        token_text(id, &mut s);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_text_prefix_shares_tokens() {
        let a = tokenize("You are a helpful assistant. Question one?");
        let b = tokenize("You are a helpful assistant. Question two!");
        assert_eq!(a.len(), 11);
        let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert!(shared >= 8, "{shared}");
        assert_ne!(a, b);
        assert_eq!(tokenize("abcd"), tokenize("abcd"));
        assert_ne!(tokenize("abc"), tokenize("abc\0"));
        assert!(tokenize("").is_empty());
    }

    #[test]
    fn detokenize_is_plain_text() {
        let s = detokenize(&[0, 17, 255]);
        assert_eq!(s, " kaka lolo yoyo");
    }
}
