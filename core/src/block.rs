//! Block identity (docs/design/design.md section 4).
//!
//! The index speaks NVIDIA Dynamo's language so that any engine-side publisher that follows it can feed
//! kvsteer: a block is `block_size` token ids; its *local hash* is XXH3-64 (seed 1337) over the token ids
//! as little-endian `u32`; its *sequence hash* chains the local hashes so that one value names a whole
//! prefix: `seq[0] = local[0]`, `seq[i] = XXH3-64(LE(seq[i-1]) ++ LE(local[i]))`, same seed.
//! Only full blocks are hashed: a partial tail block is never shared by engines either.
//!
//! Text prompts seen without a tokenizer get a separate, *approximate* identity ([`TextHasher`]) over
//! fixed character chunks. Its values are a different type ([`TextHash`]) and use a different seed, so
//! they can never be confused with engine block hashes in the KV index.

use xxhash_rust::xxh3::xxh3_64_with_seed as xxh3_64_crate;

/// vLLM's default KV block size in tokens.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
/// Dynamo's seed for both the local and the chained hash.
pub const HASH_SEED: u64 = 1337;
/// Largest block size accepted; engines use 16..=512 in practice (Mooncake traces use 512).
pub const MAX_BLOCK_SIZE: usize = 4096;

/// Sequence hash of a full token block: names the block *and* everything before it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqHash(pub u64);

/// Approximate identity of a chunk of prompt text and everything before it. Never an engine block.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TextHash(pub u64);

/// Error for an unusable block size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSizeError(pub usize);

impl core::fmt::Display for BlockSizeError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "block_size must be between 1 and {MAX_BLOCK_SIZE}, got {}",
            self.0
        )
    }
}

fn check_block_size(block_size: usize) -> Result<(), BlockSizeError> {
    if block_size == 0 || block_size > MAX_BLOCK_SIZE {
        Err(BlockSizeError(block_size))
    } else {
        Ok(())
    }
}

/// The seed for a namespace. With neither a LoRA adapter nor a cache salt it is Dynamo's 1337, so plain
/// requests hash exactly as Dynamo does; otherwise the names are hashed into a new seed, so the same
/// tokens under another adapter or salt never match (the engine would not share those blocks either).
pub fn namespace_seed(lora_name: Option<&str>, cache_salt: Option<&str>) -> u64 {
    match (lora_name, cache_salt) {
        (None, None) => HASH_SEED,
        (lora, salt) => {
            let mut buf = Vec::new();
            buf.extend_from_slice(b"lora\0");
            buf.extend_from_slice(lora.unwrap_or("").as_bytes());
            buf.extend_from_slice(b"\0salt\0");
            buf.extend_from_slice(salt.unwrap_or("").as_bytes());
            xxh3_64_with_seed(&buf, HASH_SEED)
        }
    }
}

/// XXH3-64 with a seed: the same function as `xxhash_rust::xxh3::xxh3_64_with_seed` (which handles
/// every length but two), with the two lengths the block chain hashes on every request written out
/// here: 9 to 16 bytes (a chain link is 16) and 17 to 128 bytes (a block of 5 to 32 token ids; 64
/// bytes at the usual block size of 16). Why: WebAssembly has no 64x64->128-bit multiply, and the
/// crate's `u128` product compiles to a call to compiler-builtins' `__multi3` (a full 128x128
/// product), five calls a block and about 6% of an 8K-token request's time in wasmtime; here the
/// product is [`mul_fold64`], four inlined 32x32->64 multiplies on wasm. Checked against the crate
/// for every length 0..=300 and many seeds (tests), and by the block-identity vectors.
#[inline]
pub(crate) fn xxh3_64_with_seed(bytes: &[u8], seed: u64) -> u64 {
    match bytes.len() {
        9..=16 => xxh3_9to16(bytes, seed),
        17..=128 => xxh3_17to128(bytes, seed),
        _ => xxh3_64_crate(bytes, seed),
    }
}

/// XXH3's default secret, the first 128 bytes (all that inputs of up to 128 bytes read).
const SECRET: [u8; 128] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
];

const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;

/// The little-endian `u64` at `at` (callers stay within the slice: lengths are checked first).
#[inline(always)]
fn le64(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// The 128-bit product of two `u64`, its halves XORed (XXH3's `mul128_fold64`). Natively a `u128`
/// multiply (one instruction on 64-bit CPUs); on WebAssembly, which has no wide multiply, the
/// schoolbook product of 32-bit halves (XXH3's portable `mult64to128`), inlined instead of the
/// `__multi3` call a `u128` product becomes there.
#[inline(always)]
pub(crate) fn mul_fold64(a: u64, b: u64) -> u64 {
    #[cfg(target_family = "wasm")]
    {
        mul_fold64_halves(a, b)
    }
    #[cfg(not(target_family = "wasm"))]
    {
        let p = a as u128 * b as u128;
        (p as u64) ^ ((p >> 64) as u64)
    }
}

/// [`mul_fold64`] from 32-bit halves: `a * b = hh * 2^64 + (hl + lh) * 2^32 + ll`, the middle sum and
/// the low word's addition carried by `overflowing_add`. Written this way, not as XXH3's portable
/// `mult64to128` (which sums the middle terms in 32-bit pieces): LLVM recognises that form as a
/// 64x64->128 multiply and turns it back into the `__multi3` call this function exists to avoid
/// (checked in the `.wasm`: four `i64.mul` and no call).
#[inline(always)]
// Natively only the tests call it (they check it against the `u128` product).
#[cfg_attr(not(target_family = "wasm"), allow(dead_code))]
fn mul_fold64_halves(a: u64, b: u64) -> u64 {
    let (a_lo, a_hi) = (a & 0xFFFF_FFFF, a >> 32);
    let (b_lo, b_hi) = (b & 0xFFFF_FFFF, b >> 32);
    let ll = a_lo * b_lo;
    let hh = a_hi * b_hi;
    let (mid, mid_carry) = (a_hi * b_lo).overflowing_add(a_lo * b_hi);
    let (lower, low_carry) = ll.overflowing_add(mid << 32);
    let upper = hh + (mid >> 32) + ((mid_carry as u64) << 32) + low_carry as u64;
    lower ^ upper
}

#[inline(always)]
fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

#[inline(always)]
fn mix16(b: &[u8], at: usize, secret_at: usize, seed: u64) -> u64 {
    let lo = le64(b, at) ^ le64(&SECRET, secret_at).wrapping_add(seed);
    let hi = le64(b, at + 8) ^ le64(&SECRET, secret_at + 8).wrapping_sub(seed);
    mul_fold64(lo, hi)
}

/// XXH3-64 of 9 to 16 bytes, as the two words it reads.
#[inline(always)]
fn xxh3_9to16_words(len: u64, first: u64, last: u64, seed: u64) -> u64 {
    let flip1 = (le64(&SECRET, 24) ^ le64(&SECRET, 32)).wrapping_add(seed);
    let flip2 = (le64(&SECRET, 40) ^ le64(&SECRET, 48)).wrapping_sub(seed);
    let lo = first ^ flip1;
    let hi = last ^ flip2;
    let acc = len
        .wrapping_add(lo.swap_bytes())
        .wrapping_add(hi)
        .wrapping_add(mul_fold64(lo, hi));
    avalanche(acc)
}

#[inline(always)]
fn xxh3_9to16(b: &[u8], seed: u64) -> u64 {
    xxh3_9to16_words(b.len() as u64, le64(b, 0), le64(b, b.len() - 8), seed)
}

#[inline(always)]
fn xxh3_17to128(b: &[u8], seed: u64) -> u64 {
    let len = b.len();
    let mut acc = (len as u64).wrapping_mul(PRIME64_1);
    if len > 32 {
        if len > 64 {
            if len > 96 {
                acc = acc.wrapping_add(mix16(b, 48, 96, seed));
                acc = acc.wrapping_add(mix16(b, len - 64, 112, seed));
            }
            acc = acc.wrapping_add(mix16(b, 32, 64, seed));
            acc = acc.wrapping_add(mix16(b, len - 48, 80, seed));
        }
        acc = acc.wrapping_add(mix16(b, 16, 32, seed));
        acc = acc.wrapping_add(mix16(b, len - 32, 48, seed));
    }
    acc = acc.wrapping_add(mix16(b, 0, 0, seed));
    acc = acc.wrapping_add(mix16(b, len - 16, 16, seed));
    avalanche(acc)
}

/// Chains a parent sequence hash with a block's local hash: XXH3-64 of `LE(parent) ++ LE(local)`,
/// computed from the two words without building the 16 bytes.
#[inline]
pub fn chain(parent: u64, local: u64, seed: u64) -> u64 {
    xxh3_9to16_words(16, parent, local, seed)
}

/// Computes exact block identities for token-id prompts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: usize,
    seed: u64,
}

impl BlockHasher {
    /// A hasher with Dynamo's seed.
    pub fn new(block_size: usize) -> Result<Self, BlockSizeError> {
        check_block_size(block_size)?;
        Ok(Self {
            block_size,
            seed: HASH_SEED,
        })
    }

    /// The same hasher in the namespace of a LoRA adapter and/or cache salt.
    pub fn namespaced(&self, lora_name: Option<&str>, cache_salt: Option<&str>) -> Self {
        Self {
            block_size: self.block_size,
            seed: namespace_seed(lora_name, cache_salt),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Number of full blocks in a prompt of `tokens` tokens.
    pub fn full_blocks(&self, tokens: usize) -> usize {
        tokens / self.block_size
    }

    /// Local hash of one block of token ids (any length; callers pass full blocks).
    pub fn local_hash(&self, block: &[u32]) -> u64 {
        // A block of 16 tokens is 64 bytes: hash from the stack in the common case.
        let mut stack = [0u8; 256];
        if block.len() * 4 <= stack.len() {
            let bytes = &mut stack[..block.len() * 4];
            for (dst, t) in bytes.chunks_exact_mut(4).zip(block) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            xxh3_64_with_seed(bytes, self.seed)
        } else {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            xxh3_64_with_seed(&bytes, self.seed)
        }
    }

    /// An empty [`SequenceBuilder`]: the same hashes as [`BlockHasher::sequence_hashes`], fed one
    /// token id at a time (the request reader hashes each block as its ids are parsed, so the ids
    /// are never stored).
    pub fn builder(&self) -> SequenceBuilder {
        SequenceBuilder {
            seed: self.seed,
            block: vec![[0; 4]; self.block_size].into_boxed_slice(),
            fill: 0,
            prev: None,
            hashes: Vec::new(),
        }
    }

    /// Sequence hashes of every full block of `tokens`.
    pub fn sequence_hashes(&self, tokens: &[u32]) -> Vec<SeqHash> {
        let mut out = Vec::with_capacity(tokens.len() / self.block_size);
        self.extend_sequence(None, tokens, &mut out);
        out
    }

    /// Appends the sequence hashes of the full blocks of `tokens`, continuing after `parent` (the last
    /// sequence hash of the blocks that precede `tokens`, or `None` at the start of a prompt).
    pub fn extend_sequence(&self, parent: Option<SeqHash>, tokens: &[u32], out: &mut Vec<SeqHash>) {
        let mut prev = parent.map(|p| p.0);
        for block in tokens.chunks_exact(self.block_size) {
            let local = self.local_hash(block);
            let seq = match prev {
                None => local,
                Some(p) => chain(p, local, self.seed),
            };
            out.push(SeqHash(seq));
            prev = Some(seq);
        }
    }
}

/// Sequence hashes built one token id at a time ([`BlockHasher::builder`]). The block being filled is
/// kept as the little-endian bytes XXH3 reads, so a full block is hashed where it lies: converting
/// each block's ids into a zeroed stack buffer first (as [`BlockHasher::local_hash`] does for a
/// slice of ids) cost about 15 us of an 8K-token request in wasmtime. The block is a buffer of the
/// block's size with a fill mark, not a `Vec` grown by each push: a push is then one bounds check,
/// a store and an add, without the capacity check and the reserve call the `Vec` kept in the
/// scanner's loop; and the ids pushed are counted from the blocks and the mark, not by each push.
#[derive(Clone, Debug)]
pub struct SequenceBuilder {
    seed: u64,
    /// The block being filled, one little-endian id a slot: the first `fill` slots pushed.
    block: Box<[[u8; 4]]>,
    /// Slots of `block` pushed; below `block.len()` between pushes.
    fill: usize,
    prev: Option<u64>,
    hashes: Vec<SeqHash>,
}

impl SequenceBuilder {
    /// Appends one token id; hashes the block it completes.
    #[inline]
    pub fn push(&mut self, token: u32) {
        let f = self.fill;
        if let Some(slot) = self.block.get_mut(f) {
            *slot = token.to_le_bytes();
        }
        self.fill = f + 1;
        if self.fill >= self.block.len() {
            self.flush();
        }
    }

    /// Appends the ids `next` yields until it yields None; the same as a [`SequenceBuilder::push`]
    /// of each. Why: the scanner's id window hands over its ids here so that the fill mark and the
    /// block's place stay in locals for the run, instead of a load and a store of the mark a push
    /// (the store of the id may alias the builder's fields as far as the compiler knows, so each
    /// push reloaded them, and the mark's store-then-load was a chain from one id to the next).
    #[inline]
    pub fn extend_with(&mut self, mut next: impl FnMut() -> Option<u32>) {
        let Self {
            seed,
            block,
            fill,
            prev,
            hashes,
        } = self;
        let block: &mut [[u8; 4]] = block;
        let mut f = *fill;
        while let Some(token) = next() {
            if let Some(slot) = block.get_mut(f) {
                *slot = token.to_le_bytes();
            }
            f += 1;
            if f >= block.len() {
                f = 0;
                link(block, *seed, prev, hashes);
            }
        }
        *fill = f;
    }

    fn flush(&mut self) {
        link(&self.block, self.seed, &mut self.prev, &mut self.hashes);
        self.fill = 0;
    }

    /// Token ids pushed so far.
    pub fn tokens(&self) -> u64 {
        self.hashes.len() as u64 * self.block.len() as u64 + self.fill as u64
    }

    /// Reserves room for the hashes of `tokens` more token ids.
    pub fn reserve_tokens(&mut self, tokens: usize) {
        self.hashes.reserve(tokens / self.block.len());
    }

    /// The sequence hashes of the full blocks pushed (a partial tail block is not hashed).
    pub fn finish(self) -> Vec<SeqHash> {
        self.hashes
    }
}

/// Hashes a full block and chains it onto the sequence (`prev`: the last sequence hash).
#[inline(never)]
fn link(block: &[[u8; 4]], seed: u64, prev: &mut Option<u64>, hashes: &mut Vec<SeqHash>) {
    let local = xxh3_64_with_seed(block.as_flattened(), seed);
    let seq = match *prev {
        None => local,
        Some(p) => chain(p, local, seed),
    };
    hashes.push(SeqHash(seq));
    *prev = Some(seq);
}

/// Computes approximate identities for text prompts: chained hashes over chunks of
/// `block_size * 4` characters (about `block_size` tokens for English text with BPE tokenizers).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextHasher {
    chars_per_block: usize,
    seed: u64,
}

/// Domain tag mixed into the text seed so text hashes never equal token hashes by construction.
const TEXT_DOMAIN: &[u8] = b"kvsteer/approximate-text-identity/v1";

impl TextHasher {
    pub fn new(block_size: usize) -> Result<Self, BlockSizeError> {
        check_block_size(block_size)?;
        Ok(Self {
            chars_per_block: block_size * 4,
            seed: xxh3_64_with_seed(TEXT_DOMAIN, HASH_SEED),
        })
    }

    pub fn chars_per_block(&self) -> usize {
        self.chars_per_block
    }

    /// Approximate tokens a text of `chars` characters stands for (4 characters a token).
    pub fn approx_tokens(chars: usize) -> usize {
        chars.div_ceil(4)
    }

    /// Chained hashes of every full chunk of `text`; `parent` continues an earlier part of the prompt.
    /// Returns the characters in `text`.
    ///
    /// A chunk of all-ASCII bytes is exactly `chars_per_block` bytes, found with one word-wise
    /// check; only chunks holding multi-byte characters are walked character by character.
    pub fn extend(&self, parent: Option<TextHash>, text: &str, out: &mut Vec<TextHash>) -> usize {
        let cpb = self.chars_per_block;
        let bytes = text.as_bytes();
        let mut prev = parent.map(|p| p.0);
        let mut start = 0usize;
        let mut chars = 0usize;
        while start < bytes.len() {
            if let Some(chunk) = bytes.get(start..start + cpb)
                && chunk.is_ascii()
            {
                prev = Some(self.push_chunk(prev, chunk, out));
                start += cpb;
                chars += cpb;
                continue;
            }
            let mut n = 0usize;
            let mut end = bytes.len();
            for (off, _) in text[start..].char_indices() {
                if n == cpb {
                    end = start + off;
                    break;
                }
                n += 1;
            }
            chars += n;
            if n == cpb {
                prev = Some(self.push_chunk(prev, &bytes[start..end], out));
            }
            start = end;
        }
        chars
    }

    fn push_chunk(&self, prev: Option<u64>, chunk: &[u8], out: &mut Vec<TextHash>) -> u64 {
        let local = xxh3_64_with_seed(chunk, self.seed);
        let h = match prev {
            None => local,
            Some(p) => chain(p, local, self.seed),
        };
        out.push(TextHash(h));
        h
    }

    /// Chained hashes of every full chunk of one text.
    pub fn hashes(&self, text: &str) -> Vec<TextHash> {
        let mut out = Vec::new();
        self.extend(None, text, &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The XXH3 written out here is the crate's function at every length (the two written out and
    /// the ones passed through) and seed, including the chain's two-word form.
    #[test]
    fn xxh3_matches_the_crate_at_every_length() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let bytes: Vec<u8> = (0..300).map(|_| next() as u8).collect();
        let seeds = [0, 1, HASH_SEED, u64::MAX, 1 << 63, next(), next(), next()];
        for len in 0..=bytes.len() {
            for start in [0, 1, 7] {
                let Some(b) = bytes.get(start..start + len) else {
                    continue;
                };
                for &seed in &seeds {
                    assert_eq!(
                        xxh3_64_with_seed(b, seed),
                        xxh3_64_crate(b, seed),
                        "len {len} seed {seed}"
                    );
                }
            }
        }
        for _ in 0..10_000 {
            let (p, l, seed) = (next(), next(), next());
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&p.to_le_bytes());
            buf[8..].copy_from_slice(&l.to_le_bytes());
            assert_eq!(chain(p, l, seed), xxh3_64_crate(&buf, seed));
        }
    }

    /// The WebAssembly product (32-bit halves) equals the `u128` one, edge values included.
    #[test]
    fn the_product_from_halves_is_the_wide_product() {
        let wide = |a: u64, b: u64| {
            let p = a as u128 * b as u128;
            (p as u64) ^ ((p >> 64) as u64)
        };
        let edges = [
            0,
            1,
            2,
            u32::MAX as u64,
            1 << 32,
            u64::MAX,
            u64::MAX - 1,
            1 << 63,
        ];
        for &a in &edges {
            for &b in &edges {
                assert_eq!(mul_fold64_halves(a, b), wide(a, b), "{a} x {b}");
            }
        }
        let mut x = 88172645463325252u64;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let a = x;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            assert_eq!(mul_fold64_halves(a, x), wide(a, x));
            assert_eq!(mul_fold64(a, x), wide(a, x));
        }
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let h = BlockHasher::new(16).unwrap();
        assert_eq!(h.sequence_hashes(&[1; 15]).len(), 0);
        assert_eq!(h.sequence_hashes(&[1; 16]).len(), 1);
        assert_eq!(h.sequence_hashes(&[1; 47]).len(), 2);
    }

    #[test]
    fn first_sequence_hash_is_local_hash_and_chain_follows() {
        let h = BlockHasher::new(4).unwrap();
        let toks = [1u32, 2, 3, 4, 5, 6, 7, 8];
        let seq = h.sequence_hashes(&toks);
        let l0 = h.local_hash(&toks[..4]);
        let l1 = h.local_hash(&toks[4..]);
        assert_eq!(seq[0].0, l0);
        assert_eq!(seq[1].0, chain(l0, l1, HASH_SEED));
    }

    #[test]
    fn shared_prefix_shares_hashes_and_diverges_after() {
        let h = BlockHasher::new(2).unwrap();
        let a = h.sequence_hashes(&[1, 2, 3, 4, 5, 6]);
        let b = h.sequence_hashes(&[1, 2, 3, 4, 9, 9]);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        // Same block content after a different prefix gets a different sequence hash.
        let c = h.sequence_hashes(&[7, 7, 3, 4]);
        assert_ne!(a[1], c[1]);
    }

    #[test]
    fn incremental_extension_equals_whole() {
        let h = BlockHasher::new(16).unwrap();
        let toks: Vec<u32> = (0..100).collect();
        let whole = h.sequence_hashes(&toks);
        let mut part = h.sequence_hashes(&toks[..32]);
        let last = part.last().copied();
        h.extend_sequence(last, &toks[32..], &mut part);
        assert_eq!(whole, part);
    }

    #[test]
    fn large_blocks_hash_like_small_path() {
        // 512-token blocks take the heap path; the result must equal hashing the same bytes directly.
        let h = BlockHasher::new(512).unwrap();
        let toks: Vec<u32> = (0..512).collect();
        let bytes: Vec<u8> = toks.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(h.local_hash(&toks), xxh3_64_crate(&bytes, HASH_SEED));
    }

    #[test]
    fn namespaces_change_hashes() {
        let h = BlockHasher::new(4).unwrap();
        let toks = [1u32, 2, 3, 4];
        let plain = h.sequence_hashes(&toks);
        assert_eq!(h.namespaced(None, None).sequence_hashes(&toks), plain);
        let lora = h.namespaced(Some("adapter-a"), None).sequence_hashes(&toks);
        let salt = h.namespaced(None, Some("adapter-a")).sequence_hashes(&toks);
        assert_ne!(lora, plain);
        assert_ne!(salt, plain);
        assert_ne!(lora, salt);
    }

    #[test]
    fn bad_block_sizes_are_refused() {
        assert!(BlockHasher::new(0).is_err());
        assert!(BlockHasher::new(MAX_BLOCK_SIZE + 1).is_err());
        assert!(TextHasher::new(0).is_err());
    }

    #[test]
    fn text_chunks_are_characters_not_bytes() {
        let t = TextHasher::new(1).unwrap(); // 4 characters a chunk
        let mut out = Vec::new();
        let chars = t.extend(None, "ééééaaaab", &mut out);
        assert_eq!(chars, 9);
        assert_eq!(out.len(), 2);
        let again = t.hashes("ééééaaaac");
        assert_eq!(out, again);
        assert_ne!(t.hashes("éééé")[0], t.hashes("aaaa")[0]);
    }

    /// The character-by-character chunking `extend` had before its ASCII fast path: the reference.
    fn extend_by_chars(t: &TextHasher, text: &str) -> (Vec<TextHash>, usize) {
        let mut out = Vec::new();
        let mut prev = None;
        let (mut start, mut count, mut chars) = (0usize, 0usize, 0usize);
        for (i, _) in text.char_indices() {
            if count == t.chars_per_block {
                prev = Some(t.push_chunk(prev, &text.as_bytes()[start..i], &mut out));
                start = i;
                count = 0;
            }
            count += 1;
            chars += 1;
        }
        if count == t.chars_per_block {
            t.push_chunk(prev, &text.as_bytes()[start..], &mut out);
        }
        (out, chars)
    }

    #[test]
    fn text_chunking_matches_the_character_walk() {
        let pieces = ["a", "bc", "é", "日本", "🦀", " ", "\n", "xyzw"];
        let mut seed = 9u64;
        for block_size in [1, 2, 3, 16] {
            let t = TextHasher::new(block_size).unwrap();
            for len in 0..200 {
                let mut text = String::new();
                for _ in 0..len {
                    seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
                    text.push_str(pieces[(seed >> 33) as usize % pieces.len()]);
                }
                let mut out = Vec::new();
                let chars = t.extend(None, &text, &mut out);
                assert_eq!((out, chars), extend_by_chars(&t, &text), "{text:?}");
            }
        }
    }

    #[test]
    fn builder_matches_sequence_hashes() {
        for block_size in [1, 4, 16, 64, 512] {
            let h = BlockHasher::new(block_size)
                .unwrap()
                .namespaced(None, Some("salt"));
            for n in [
                0usize,
                1,
                block_size - 1,
                block_size,
                3 * block_size + 1,
                2000,
            ] {
                let toks: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2654435761)).collect();
                let mut b = h.builder();
                for &t in &toks {
                    b.push(t);
                }
                assert_eq!(b.tokens(), n as u64);
                assert_eq!(b.finish(), h.sequence_hashes(&toks));
            }
        }
    }

    /// Runs handed over with `extend_with`, of every length and mixed with single pushes (as the
    /// scanner mixes its id window and its one-id-at-a-time path), give what pushes give.
    #[test]
    fn runs_extend_like_pushes() {
        for block_size in [1, 3, 16, 17, 64] {
            let h = BlockHasher::new(block_size).unwrap();
            let toks: Vec<u32> = (0..700u32).map(|i| i.wrapping_mul(2654435761)).collect();
            for run in [1usize, 2, 5, 15, 16, 33] {
                let mut b = h.builder();
                let mut i = 0;
                while i < toks.len() {
                    let end = (i + run).min(toks.len());
                    let mut it = toks[i..end].iter().copied();
                    b.extend_with(|| it.next());
                    i = end;
                    if let Some(&t) = toks.get(i) {
                        b.push(t);
                        i += 1;
                    }
                    assert_eq!(b.tokens(), i as u64);
                }
                assert_eq!(b.finish(), h.sequence_hashes(&toks), "{block_size} {run}");
            }
        }
    }

    #[test]
    fn text_and_token_identities_use_different_seeds() {
        let t = TextHasher::new(16).unwrap();
        assert_ne!(t.seed, HASH_SEED);
    }
}
