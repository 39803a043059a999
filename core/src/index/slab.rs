//! The index's storage: the slab of 16-byte slots (a block's sequence hash and up to four holders
//! inline), grown in chunks that never move, and the holder packing (replica and tier mask in a
//! `u16`). Kept apart from [`super::KvIndex`]'s lookup and eviction so the layout the memory bound
//! rests on reads in one place.

pub(super) const INLINE: usize = 4;
/// `Slot::inline` of a block whose holders live in the overflow map: a live inline holder is never 0
/// and inline holders are packed to the front, so `[0, 1, ..]` is no inline holder list.
pub(super) const OVERFLOW: [u16; INLINE] = [0, 1, 0, 0];
/// End of the free list.
pub(super) const NO_SLOT: u64 = u64::MAX;
/// Slots per slab chunk (1 MiB of slots): the slab's growth step.
pub const SLAB_CHUNK: usize = 1 << 16;

#[derive(Clone, Copy, Debug)]
pub(super) struct Slot {
    /// The block's sequence hash; in a free slot, the next free slot (`NO_SLOT`: none).
    pub(super) key: u64,
    /// Holders packed to the front, 0 past the last: all 0 in a free slot, [`OVERFLOW`] when the
    /// holders are in `KvIndex::overflow`.
    pub(super) inline: [u16; INLINE],
}

impl Slot {
    #[inline]
    pub(super) fn live(key: u64) -> Slot {
        Slot {
            key,
            inline: [0; INLINE],
        }
    }
    #[inline]
    pub(super) fn is_free(&self) -> bool {
        self.inline == [0; INLINE]
    }
    #[inline]
    pub(super) fn is_overflow(&self) -> bool {
        self.inline == OVERFLOW
    }
    /// Inline holders (not for an overflow slot).
    #[inline]
    pub(super) fn inline_len(&self) -> usize {
        self.inline.iter().position(|&h| h == 0).unwrap_or(INLINE)
    }
}

/// The slots, in chunks of at most [`SLAB_CHUNK`] that are allocated once, at their final size, and
/// never moved; slot `i` is `chunks[i / SLAB_CHUNK][i % SLAB_CHUNK]`.
#[derive(Clone, Debug, Default)]
pub(super) struct Slab {
    chunks: Vec<Vec<Slot>>,
    len: usize,
}

impl Slab {
    pub(super) fn len(&self) -> usize {
        self.len
    }
    /// Appends a slot; a new chunk holds `min(SLAB_CHUNK, cap - len)` slots, so the chunks never
    /// hold more than `cap` slots in all.
    pub(super) fn push(&mut self, slot: Slot, cap: usize) {
        let want = SLAB_CHUNK.min(cap.saturating_sub(self.len - self.len % SLAB_CHUNK).max(1));
        match self.chunks.last_mut() {
            Some(c) if c.len() < SLAB_CHUNK => {
                if c.len() == c.capacity() {
                    // Only after a clone (which allocates just the length) or a cap smaller than
                    // the chunk: grow to the chunk's full size at once.
                    c.reserve_exact(want.max(c.len() + 1) - c.len());
                }
                c.push(slot);
            }
            _ => {
                let mut c = Vec::with_capacity(want);
                c.push(slot);
                self.chunks.push(c);
            }
        }
        self.len += 1;
    }
    pub(super) fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.chunks.iter().flatten()
    }
    pub(super) fn heap_bytes(&self) -> usize {
        self.chunks.capacity() * size_of::<Vec<Slot>>()
            + self
                .chunks
                .iter()
                .map(|c| c.capacity() * size_of::<Slot>())
                .sum::<usize>()
    }
}

impl std::ops::Index<usize> for Slab {
    type Output = Slot;
    #[inline]
    fn index(&self, i: usize) -> &Slot {
        &self.chunks[i / SLAB_CHUNK][i % SLAB_CHUNK]
    }
}

impl std::ops::IndexMut<usize> for Slab {
    #[inline]
    fn index_mut(&mut self, i: usize) -> &mut Slot {
        &mut self.chunks[i / SLAB_CHUNK][i % SLAB_CHUNK]
    }
}

#[inline]
pub(super) fn holder(replica: usize, mask: u8) -> u16 {
    ((replica as u16) << 3) | mask as u16
}
#[inline]
pub(super) fn holder_replica(h: u16) -> usize {
    (h >> 3) as usize
}
#[inline]
pub(super) fn holder_mask(h: u16) -> u8 {
    (h & 7) as u8
}

/// The best tier in a mask: a GPU copy beats a host copy beats a disk copy.
#[inline]
pub(super) fn best_tier(mask: u8) -> usize {
    if mask & 1 != 0 {
        0
    } else if mask & 2 != 0 {
        1
    } else {
        2
    }
}

/// Folded 64x64->128 multiply: a strong enough mix for table placement, and keyed by `secret` so a
/// replica that crafts hashes cannot aim them at one bucket without knowing it. The product is
/// `block::mul_fold64`, inlined on WebAssembly (where a `u128` product is a `__multi3` call).
#[inline]
pub(super) fn mix(key: u64, secret: u64) -> u64 {
    crate::block::mul_fold64(key ^ secret, 0x9E37_79B9_7F4A_7C15)
}
