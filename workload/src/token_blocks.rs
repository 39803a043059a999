//! Deterministic token ids for trace block ids and synthetic text.
//!
//! Traces name KV blocks by ids, not tokens. A replayer must turn an id into real token ids so that the
//! engine's prefix cache and the router's block index see exactly the sharing the trace recorded: the same
//! `(namespace, id)` always yields the same tokens, and different keys yield (with overwhelming
//! probability) different tokens. Ids come from a hash of the key, expanded by SplitMix64, in the
//! vocabulary `1..=VOCAB` (0 is avoided because some tokenizers reserve it for padding).

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Largest token id produced; ids are in `1..=VOCAB`.
pub const VOCAB: u32 = 100_000;

/// Seed for key derivation, distinct from the block-hash seed so keys never look like block hashes.
const KEY_SEED: u64 = 0x6b76_7374_6565_7221;

/// Namespace of blocks shared by every session of a trace (Mooncake's global ids, the coding-agent
/// tool+system prefix).
pub const GLOBAL_NAMESPACE: &str = "global";

/// A 64-bit key naming one block of tokens (or one padding run) in one namespace.
pub fn block_key(namespace: &str, id: u64) -> u64 {
    let mut buf = Vec::with_capacity(namespace.len() + 9);
    buf.extend_from_slice(namespace.as_bytes());
    buf.push(0);
    buf.extend_from_slice(&id.to_le_bytes());
    xxh3_64_with_seed(&buf, KEY_SEED)
}

/// Mixes a key with further integers (step, rollout, turn...) into a new key.
pub fn sub_key(key: u64, parts: &[u64]) -> u64 {
    let mut buf = Vec::with_capacity(8 * (parts.len() + 1));
    buf.extend_from_slice(&key.to_le_bytes());
    for p in parts {
        buf.extend_from_slice(&p.to_le_bytes());
    }
    xxh3_64_with_seed(&buf, KEY_SEED)
}

/// SplitMix64 step: a fast, well-mixed stream from one 64-bit state.
#[inline]
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Appends `n` token ids determined by `key` alone.
pub fn extend_tokens(key: u64, n: usize, out: &mut Vec<u32>) {
    let mut state = key;
    out.reserve(n);
    for _ in 0..n {
        out.push(1 + (splitmix(&mut state) % u64::from(VOCAB)) as u32);
    }
}

/// `n` token ids determined by `key` alone.
pub fn tokens(key: u64, n: usize) -> Vec<u32> {
    let mut v = Vec::with_capacity(n);
    extend_tokens(key, n, &mut v);
    v
}

/// A value in `lo..=hi` determined by `key` (for deterministic per-turn choices).
pub fn pick(key: u64, lo: u64, hi: u64) -> u64 {
    let mut s = key;
    lo + splitmix(&mut s) % (hi - lo + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_key_same_tokens_and_in_vocabulary() {
        let k = block_key("s1", 7);
        let a = tokens(k, 64);
        assert_eq!(a, tokens(k, 64));
        assert!(a.iter().all(|&t| (1..=VOCAB).contains(&t)));
        // A prefix of the stream is the shorter stream.
        assert_eq!(&a[..10], &tokens(k, 10)[..]);
    }

    #[test]
    fn namespaces_and_ids_separate_keys() {
        assert_ne!(block_key("s1", 1), block_key("s2", 1));
        assert_ne!(block_key("s1", 1), block_key("s1", 2));
        assert_ne!(
            tokens(block_key("s1", 1), 16),
            tokens(block_key("s2", 1), 16)
        );
        assert_ne!(sub_key(1, &[2, 3]), sub_key(1, &[3, 2]));
    }

    #[test]
    fn pick_stays_in_range() {
        for k in 0..1000 {
            let v = pick(k, 128, 256);
            assert!((128..=256).contains(&v));
        }
    }
}
