//! Token ids of recently seen text segments, keyed by content hash, so that a follow-up turn of a long
//! conversation encodes only its new messages: every earlier message renders to the same segment text
//! (between the same special tokens) and is found here.
//!
//! Bounded by the number of token ids held (4 bytes each, plus about 40 bytes of bookkeeping per
//! segment); past the bound the least recently used segments are dropped down to three quarters of it,
//! in one pass, so eviction costs O(n log n) once per quarter of the budget rather than on every insert.

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_128;

/// Segments shorter than this are encoded every time: the hash and the map cost about as much.
pub const MIN_CACHED_BYTES: usize = 256;

struct Entry {
    ids: Box<[u32]>,
    last_use: u64,
}

pub struct SegmentCache {
    /// 128-bit content hash: a collision would silently give a wrong identity, so make it implausible.
    map: HashMap<u128, Entry>,
    max_tokens: usize,
    tokens: usize,
    clock: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
}

impl SegmentCache {
    pub fn new(max_tokens: usize) -> SegmentCache {
        SegmentCache {
            map: HashMap::new(),
            max_tokens,
            tokens: 0,
            clock: 0,
            hits: 0,
            misses: 0,
            evictions: 0,
        }
    }

    /// Token ids held.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn segments(&self) -> usize {
        self.map.len()
    }

    /// Appends the ids of `text` to `out`, from the cache or from `encode` (whose result is kept).
    /// `encode` returning None (it could not encode) is passed on and nothing is cached.
    pub fn encode_into(
        &mut self,
        text: &str,
        out: &mut Vec<u32>,
        encode: impl FnOnce(&str) -> Option<Vec<u32>>,
    ) -> Option<()> {
        if text.len() < MIN_CACHED_BYTES || self.max_tokens == 0 {
            out.extend(encode(text)?);
            return Some(());
        }
        self.clock += 1;
        let key = xxh3_128(text.as_bytes());
        if let Some(e) = self.map.get_mut(&key) {
            e.last_use = self.clock;
            self.hits += 1;
            out.extend_from_slice(&e.ids);
            return Some(());
        }
        self.misses += 1;
        let ids = encode(text)?;
        out.extend_from_slice(&ids);
        // A segment bigger than a quarter of the budget would flush everything else: not kept.
        if ids.len() <= self.max_tokens / 4 {
            self.tokens += ids.len();
            self.map.insert(
                key,
                Entry {
                    ids: ids.into_boxed_slice(),
                    last_use: self.clock,
                },
            );
            if self.tokens > self.max_tokens {
                self.evict();
            }
        }
        Some(())
    }

    fn evict(&mut self) {
        let mut ages: Vec<(u64, u128)> = self.map.iter().map(|(k, e)| (e.last_use, *k)).collect();
        ages.sort_unstable();
        let target = self.max_tokens / 4 * 3;
        for (_, k) in ages {
            if self.tokens <= target {
                break;
            }
            if let Some(e) = self.map.remove(&k) {
                self.tokens -= e.ids.len();
                self.evictions += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake(text: &str) -> Option<Vec<u32>> {
        Some(text.bytes().map(u32::from).collect())
    }

    #[test]
    fn hits_and_bounds() {
        let mut c = SegmentCache::new(1200);
        let a = "a".repeat(300);
        let mut out = Vec::new();
        c.encode_into(&a, &mut out, fake).unwrap();
        c.encode_into(&a, &mut out, |_| panic!("cached")).unwrap();
        assert_eq!(out.len(), 600);
        assert_eq!((c.hits, c.misses), (1, 1));
        // Short segments are not cached.
        c.encode_into("short", &mut out, fake).unwrap();
        assert_eq!(c.segments(), 1);
        // Filling past the bound evicts the least recently used down to 3/4.
        for i in 0..10 {
            let t = format!("{i}{}", "b".repeat(299));
            c.encode_into(&t, &mut out, fake).unwrap();
            assert!(c.tokens() <= 1200);
        }
        assert!(c.evictions > 0);
        // Too big for the budget: encoded, not kept.
        let big = "c".repeat(400);
        c.encode_into(&big, &mut out, fake).unwrap();
        assert!(c.tokens() <= 1200);
        // A failed encode is passed on.
        assert!(
            c.encode_into(&"d".repeat(300), &mut out, |_| None)
                .is_none()
        );
    }
}
