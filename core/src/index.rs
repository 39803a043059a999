//! The KV block index: which replica holds which block, on which tier (docs/design/design.md
//! sections 2 and 4).
//!
//! Layout, chosen for a few tens of bytes per block and no allocation per block:
//! - a slab of 16-byte [`Slot`]s: the sequence hash and up to four holders inline;
//! - a bitset of "referenced" bits, one per slot (kept out of the slot so that it fits 16 bytes);
//! - a `hashbrown::HashTable<u32>` of slab positions (5 bytes a bucket, 7/8 load), keyed by the
//!   sequence hash mixed with a per-index secret (hashes come from replicas, which are not trusted);
//! - holders packed in a `u16`: replica index (13 bits, so up to [`MAX_REPLICAS`]) and a 3-bit tier mask
//!   (a replica can hold the same block on GPU and in host memory at once); a block held by more than
//!   four replicas moves its holder list to an overflow map.
//!
//! Memory (every proxy worker VM holds its own index, and WebAssembly memory never shrinks, so what
//! counts is the peak): the slab grows in chunks of [`SLAB_CHUNK`] slots that are never moved,
//! sized so that the chunks together never exceed the cap, instead of a `Vec` that doubles (a doubling
//! `Vec` holds its old and new copies at once, 1.5x the final size, and leaves the old ones behind as
//! holes). Free slots form a list threaded through their own `key` field, so freeing a replica's
//! million blocks allocates nothing. [`KvIndex::memory_bound`] is the most the index reserves for a cap.
//!
//! The hard cap counts distinct blocks. Eviction is *least recently touched* approximated by CLOCK
//! (second chance): storing or matching a block sets its referenced bit, and the eviction hand clears
//! bits until it finds an unreferenced block.
//!
//! The cap is shared fairly: each replica's *share* is `capacity / replicas` (at least 1). A replica may
//! hold more than its share while the index has room, but once the index is full a store makes room
//! from the replica storing if it is at or over its share, else from the replica furthest over its
//! share; that replica's own least recently touched copy goes (each replica has its own CLOCK hand). So
//! a replica that floods the index evicts only its own blocks, and a replica within its share never
//! loses a block to another's stores. A block held by several replicas counts toward each holder's
//! share and stays while anyone holds it. An exact LRU list would cost three random writes per
//! matched block on the routing path (a 512-block prompt would pay ~1,500 cache misses); CLOCK pays one
//! write to a line the lookup already loaded.

use hashbrown::{HashMap, HashTable};

use crate::approx::PrefixKey;
use crate::feed::Tier;

/// Largest replica count the index can represent (13-bit replica field).
pub const MAX_REPLICAS: usize = 1 << 13;
const INLINE: usize = 4;
/// `Slot::inline` of a block whose holders live in the overflow map: a live inline holder is never 0
/// and inline holders are packed to the front, so `[0, 1, ..]` is no inline holder list.
const OVERFLOW: [u16; INLINE] = [0, 1, 0, 0];
/// End of the free list.
const NO_SLOT: u64 = u64::MAX;
/// The hash table doubles while it holds less than `capacity / TABLE_JUMP` blocks, then grows to
/// the cap's size in one step (see `KvIndex::insert`).
const TABLE_JUMP: usize = 4;
/// Slots per slab chunk (1 MiB of slots): the slab's growth step.
pub const SLAB_CHUNK: usize = 1 << 16;

#[derive(Clone, Copy, Debug)]
struct Slot {
    /// The block's sequence hash; in a free slot, the next free slot (`NO_SLOT`: none).
    key: u64,
    /// Holders packed to the front, 0 past the last: all 0 in a free slot, [`OVERFLOW`] when the
    /// holders are in `KvIndex::overflow`.
    inline: [u16; INLINE],
}

impl Slot {
    #[inline]
    fn live(key: u64) -> Slot {
        Slot {
            key,
            inline: [0; INLINE],
        }
    }
    #[inline]
    fn is_free(&self) -> bool {
        self.inline == [0; INLINE]
    }
    #[inline]
    fn is_overflow(&self) -> bool {
        self.inline == OVERFLOW
    }
    /// Inline holders (not for an overflow slot).
    #[inline]
    fn inline_len(&self) -> usize {
        self.inline.iter().position(|&h| h == 0).unwrap_or(INLINE)
    }
}

/// The slots, in chunks of at most [`SLAB_CHUNK`] that are allocated once, at their final size, and
/// never moved; slot `i` is `chunks[i / SLAB_CHUNK][i % SLAB_CHUNK]`.
#[derive(Clone, Debug, Default)]
struct Slab {
    chunks: Vec<Vec<Slot>>,
    len: usize,
}

impl Slab {
    fn len(&self) -> usize {
        self.len
    }
    /// Appends a slot; a new chunk holds `min(SLAB_CHUNK, cap - len)` slots, so the chunks never
    /// hold more than `cap` slots in all.
    fn push(&mut self, slot: Slot, cap: usize) {
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
    fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.chunks.iter().flatten()
    }
    fn heap_bytes(&self) -> usize {
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
fn holder(replica: usize, mask: u8) -> u16 {
    ((replica as u16) << 3) | mask as u16
}
#[inline]
fn holder_replica(h: u16) -> usize {
    (h >> 3) as usize
}
#[inline]
fn holder_mask(h: u16) -> u8 {
    (h & 7) as u8
}

/// The best tier in a mask: a GPU copy beats a host copy beats a disk copy.
#[inline]
fn best_tier(mask: u8) -> usize {
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
fn mix(key: u64, secret: u64) -> u64 {
    crate::block::mul_fold64(key ^ secret, 0x9E37_79B9_7F4A_7C15)
}

/// Per-replica match of a request: blocks of its leading run, by tier of the best copy.
pub type TierCounts = [u32; 3];

/// The KV block index. See the module docs for layout and eviction.
#[derive(Clone, Debug)]
pub struct KvIndex {
    table: HashTable<u32>,
    slots: Slab,
    /// CLOCK's referenced bit of each slot, 64 to a word.
    referenced: Vec<u64>,
    /// Head of the free list threaded through free slots' keys (`NO_SLOT`: empty).
    free_head: u64,
    overflow: HashMap<u32, Vec<u16>>,
    capacity: usize,
    replicas: usize,
    per_replica: Vec<u64>,
    hand: usize,
    /// Each replica's CLOCK hand for evicting its own copies (fair shares).
    hands: Vec<usize>,
    live: usize,
    evictions: u64,
    secret: u64,
    /// The hash table's capacity when it had no tombstones (the most `capacity()` has been): below
    /// it, a full table is full of tombstones (see `rebuild_table`).
    table_full: usize,
    /// Where recently matched blocks were found: slot + 1 (0: empty) in the low bits, and where slot
    /// numbers leave room (`recent_tagged`) a tag from the block's keyed hash in the top
    /// [`RECENT_TAG_BITS`]; set-associative, [`RECENT_WAYS`] entries a set, the set picked by the
    /// keyed hash; `KvIndex::recent_entries` entries. See `match_slot`.
    recent: Vec<u32>,
    /// `64 - log2(recent.len())`: the product's top bits pick the entry (its set: the entry with
    /// its low bits cleared).
    recent_shift: u32,
    /// Whether every slot number + 1 fits below the tag (caps under 2^24 blocks).
    recent_tagged: bool,
}

/// Most entries of `KvIndex::recent`: 2^16, 256 KiB. Why set-associative: direct-mapped, the blocks
/// that shared an entry pushed each other out, about 12% of a 128K-token prompt's 8,192 matched
/// blocks at 2^16 entries (39% at 2^14; natively, matching them took 55 us against 78 us at 2^14
/// and 82 us without the cache, 1M blocks, 16 replicas), and each of those went to the hash table
/// on every match of the prompt. In sets of four, five blocks must share a set for one to be
/// pushed out.
const RECENT_MAX: usize = 1 << 16;
/// Entries a set of `KvIndex::recent` (fewer where the whole table is smaller).
const RECENT_WAYS: usize = 4;
/// Tag bits of a `KvIndex::recent` entry: a way whose tag differs is skipped without reading its
/// slot (a cache miss in a table of millions of slots); slot numbers keep the other 24 bits.
const RECENT_TAG_BITS: u32 = 8;
const RECENT_SLOT_MASK: u32 = (1 << (32 - RECENT_TAG_BITS)) - 1;

impl KvIndex {
    /// An empty index for `replicas` replicas (clamped to 1..=MAX_REPLICAS) holding at most
    /// `capacity_blocks` distinct blocks (at least 1, at most `u32::MAX`).
    pub fn new(capacity_blocks: usize, replicas: usize, secret: u64) -> Self {
        let replicas = replicas.clamp(1, MAX_REPLICAS);
        let recent = Self::recent_entries(capacity_blocks);
        Self {
            table: HashTable::new(),
            slots: Slab::default(),
            referenced: Vec::new(),
            free_head: NO_SLOT,
            overflow: HashMap::new(),
            capacity: capacity_blocks.clamp(1, u32::MAX as usize),
            replicas,
            per_replica: vec![0; replicas],
            hand: 0,
            hands: vec![0; replicas],
            live: 0,
            evictions: 0,
            secret,
            table_full: 0,
            recent: vec![0; recent],
            recent_shift: 64 - recent.trailing_zeros(),
            recent_tagged: capacity_blocks < RECENT_SLOT_MASK as usize,
        }
    }

    pub fn len(&self) -> usize {
        self.live
    }
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    pub fn replicas(&self) -> usize {
        self.replicas
    }
    /// Blocks evicted by the cap since creation.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
    /// A replica's fair share of the cap: `capacity / replicas`, at least 1 (see the module docs).
    pub fn share(&self) -> usize {
        (self.capacity / self.replicas).max(1)
    }
    /// Blocks a replica holds on any tier.
    pub fn replica_blocks(&self, replica: usize) -> u64 {
        self.per_replica.get(replica).copied().unwrap_or(0)
    }

    /// Bytes of heap this index holds, from the capacities of its containers.
    pub fn heap_bytes(&self) -> usize {
        let overflow: usize = self
            .overflow
            .values()
            .map(|v| v.capacity() * 2 + 24)
            .sum::<usize>()
            + self.overflow.capacity() * (4 + 24 + 1);
        self.slots.heap_bytes()
            + self.recent.capacity() * 4
            + self.referenced.capacity() * 8
            + self.table_bytes()
            + (self.per_replica.capacity() + self.hands.capacity()) * 8
            + overflow
    }

    /// Bytes of the hash table's allocation (its buckets and control bytes).
    fn table_bytes(&self) -> usize {
        self.table.allocation_size()
    }

    /// hashbrown's bucket count for a table of `cap` entries: at least 4, a power of two, at most
    /// 7/8 full.
    fn buckets_for(cap: usize) -> usize {
        if cap < 4 {
            4
        } else if cap < 8 {
            8
        } else {
            (cap * 8).div_ceil(7).next_power_of_two()
        }
    }

    /// The most heap [`KvIndex::heap_bytes`] counts for an index of this cap and replica count, blocks
    /// held by more than four replicas (the overflow map) aside: 16 bytes a slot up to the cap, one
    /// bit a slot, the hash table sized for the cap (5 bytes a bucket, buckets the next power of two
    /// of 8/7 of the cap: 10.5 bytes a block at a cap of 1M, 5.7 at 900k), 16 bytes a replica, and
    /// the recently matched slots (4 bytes an entry, 256 KiB at most). Each worker VM pays it once;
    /// docs/design/filter.md has the figures.
    pub fn memory_bound(capacity_blocks: usize, replicas: usize) -> usize {
        let cap = capacity_blocks.clamp(1, u32::MAX as usize);
        let replicas = replicas.clamp(1, MAX_REPLICAS);
        let chunks = cap.div_ceil(SLAB_CHUNK);
        // Control bytes: one a bucket plus a trailing group (16 bytes at most), and the bucket
        // array's alignment.
        cap * size_of::<Slot>()
            + chunks.next_power_of_two().max(4) * size_of::<Vec<Slot>>()
            + cap.div_ceil(64) * 8
            + Self::buckets_for(cap) * (size_of::<u32>() + 1)
            + 16
            + 8
            + replicas * 16
            + Self::recent_entries(cap) * size_of::<u32>()
    }

    /// Entries of the recently matched slots for a cap: a power of two, at least 2 and at most
    /// 2^16, no more than the cap needs.
    fn recent_entries(capacity_blocks: usize) -> usize {
        capacity_blocks.clamp(2, RECENT_MAX).next_power_of_two()
    }

    #[inline]
    fn find(&self, key: u64) -> Option<u32> {
        let slots = &self.slots;
        self.table
            .find(mix(key, self.secret), |&s| slots[s as usize].key == key)
            .copied()
    }

    /// The slot of a block for `match_prefix`: first where a recent match found it (`recent`),
    /// checked by reading the slot, else the hash table. Exact: keys are unique among live slots,
    /// so a live slot holding `key` is the one the table would return, whatever was freed, reused
    /// or evicted since. Why: the prompts routed one after another share prefixes (a system
    /// prompt, a conversation's earlier turns), and a hit costs a load from a 256 KiB array and
    /// the slot's own load, which the match needs anyway, instead of the keyed mix and the table's
    /// probe (control bytes and bucket in a ~10 MB table at 1M blocks).
    #[inline]
    fn match_slot(&mut self, key: u64) -> Option<u32> {
        let h = (key ^ self.secret).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let ways = RECENT_WAYS.min(self.recent.len());
        let set = (h >> self.recent_shift) as usize & !(ways - 1);
        // Bits 40-47 of the product, below the set's (48 and up at 2^16 entries): a block's tag
        // says nothing about its set.
        let tag = if self.recent_tagged {
            ((h >> 16) as u32) & !RECENT_SLOT_MASK
        } else {
            0
        };
        let (tag_mask, slot_mask) = if self.recent_tagged {
            (!RECENT_SLOT_MASK, RECENT_SLOT_MASK)
        } else {
            (0, u32::MAX)
        };
        let entries = self.recent.get(set..set + ways).unwrap_or(&[]);
        for &e in entries {
            let hint = e & slot_mask;
            if hint != 0 && e & tag_mask == tag {
                let s = (hint - 1) as usize;
                if s < self.slots.len() {
                    let slot = &self.slots[s];
                    if slot.key == key && !slot.is_free() {
                        return Some(s as u32);
                    }
                }
            }
        }
        let found = self.find(key);
        if let Some(s) = found
            && let Some(entries) = self.recent.get_mut(set..set + ways)
        {
            // The set's oldest entry goes.
            entries.copy_within(..ways - 1, 1);
            entries[0] = tag | (s + 1);
        }
        found
    }

    fn holders(&self, slot: u32) -> &[u16] {
        let s = &self.slots[slot as usize];
        if s.is_overflow() {
            self.overflow.get(&slot).map_or(&[], |v| v.as_slice())
        } else {
            &s.inline[..s.inline_len()]
        }
    }

    #[inline]
    fn set_referenced(&mut self, slot: usize) {
        self.referenced[slot / 64] |= 1 << (slot % 64);
    }
    #[inline]
    fn is_referenced(&self, slot: usize) -> bool {
        self.referenced[slot / 64] & (1 << (slot % 64)) != 0
    }
    #[inline]
    fn clear_referenced(&mut self, slot: usize) {
        self.referenced[slot / 64] &= !(1 << (slot % 64));
    }

    /// Records that `replica` stores `keys` on `tier`. Out-of-range replicas are ignored (returns false).
    pub fn store(&mut self, replica: usize, tier: Tier, keys: &[u64]) -> bool {
        if replica >= self.replicas {
            return false;
        }
        let bit = 1u8 << (tier as u8);
        for &key in keys {
            let slot = match self.find(key) {
                Some(s) => s,
                None => self.insert(key, replica),
            };
            self.set_referenced(slot as usize);
            self.add_holder(slot, replica, bit);
        }
        true
    }

    /// Records that `replica` no longer holds `keys` on `tier`. Unknown keys are ignored.
    pub fn remove(&mut self, replica: usize, tier: Tier, keys: &[u64]) -> bool {
        if replica >= self.replicas {
            return false;
        }
        let bit = 1u8 << (tier as u8);
        for &key in keys {
            if let Some(slot) = self.find(key) {
                self.drop_holder(slot, replica, bit);
            }
        }
        true
    }

    /// Drops everything a replica holds (engine restart, `cleared`, or a feed resync). O(indexed blocks),
    /// which is fine for an event that happens on restarts.
    pub fn remove_replica(&mut self, replica: usize) {
        if replica >= self.replicas || self.per_replica[replica] == 0 {
            return;
        }
        for slot in 0..self.slots.len() as u32 {
            if !self.slots[slot as usize].is_free() {
                self.drop_holder(slot, replica, 0b111);
            }
        }
    }

    /// For a request's block hashes, each replica's longest run of leading blocks, split by the tier of
    /// the best copy. `out` is resized to the replica count. Matched blocks count as touched.
    pub fn match_prefix<K: PrefixKey>(&mut self, keys: &[K], out: &mut Vec<TierCounts>) {
        out.clear();
        out.resize(self.replicas, [0; 3]);
        // Look keys up a chunk at a time: the lookups in a chunk are independent, so the CPU overlaps
        // their cache misses; the run logic then walks the chunk in order and stops at the first miss.
        // The lookups stop at the first key not found, where the run ends anyway: the keys after
        // it were looked up for nothing, each a probe of the whole table that usually misses the
        // caches (a prompt that leaves its cached prefix mid-chunk paid up to 15; 12 in
        // filter-bench's requests, about 2 us each). While keys are found the branch is
        // predicted, so the lookups still overlap.
        const CHUNK: usize = 16;
        let mut found = [None::<u32>; CHUNK];
        for (c, chunk) in keys.chunks(CHUNK).enumerate() {
            let mut looked = 0;
            for (f, &key) in found.iter_mut().zip(chunk) {
                *f = self.match_slot(key.raw());
                looked += 1;
                if f.is_none() {
                    break;
                }
            }
            for (j, f) in found[..looked].iter().enumerate() {
                let i = c * CHUNK + j;
                let Some(slot) = *f else { return };
                let mut any = false;
                let s = &self.slots[slot as usize];
                let holders: &[u16] = if s.is_overflow() {
                    self.overflow.get(&slot).map_or(&[], |v| v.as_slice())
                } else {
                    &s.inline[..s.inline_len()]
                };
                for &h in holders {
                    let r = holder_replica(h);
                    let c = &mut out[r];
                    if (c[0] + c[1] + c[2]) as usize == i {
                        c[best_tier(holder_mask(h))] += 1;
                        any = true;
                    }
                }
                if !any {
                    return;
                }
                self.set_referenced(slot as usize);
            }
        }
    }

    /// Whether `replica` holds `key` on `tier` (tests and debugging).
    pub fn holds(&self, replica: usize, tier: Tier, key: u64) -> bool {
        self.find(key).is_some_and(|s| {
            self.holders(s)
                .iter()
                .any(|&h| holder_replica(h) == replica && holder_mask(h) & (1 << tier as u8) != 0)
        })
    }

    fn insert(&mut self, key: u64, for_replica: usize) -> u32 {
        if self.live >= self.capacity {
            self.make_room(for_replica);
        }
        let slot = if self.free_head != NO_SLOT {
            let s = self.free_head as u32;
            self.free_head = self.slots[s as usize].key;
            self.slots[s as usize] = Slot::live(key);
            self.clear_referenced(s as usize);
            s
        } else {
            let s = self.slots.len();
            self.slots.push(Slot::live(key), self.capacity);
            if s / 64 >= self.referenced.len() {
                // One word per 64 slots, grown a chunk's worth at a time.
                let words = self.capacity.div_ceil(64).min(s / 64 + SLAB_CHUNK / 64);
                self.referenced
                    .reserve_exact(words.saturating_sub(self.referenced.len()));
                self.referenced.resize(words.max(s / 64 + 1), 0);
            }
            s as u32
        };
        let secret = self.secret;
        if self.table.len() == self.table.capacity() {
            if self.table.len() < self.table_full {
                self.rebuild_table();
            } else if self.table.len() >= self.capacity / TABLE_JUMP {
                // Past a quarter of the cap, grow straight to the cap's size: doubling would hold
                // the old and new tables at once (1.5x) at each step, and leave the old ones as
                // holes that WebAssembly memory never gives back. Not earlier: an index that stays
                // between a quarter and half full would pay for the whole table (at a 1M cap the
                // step skips the 2^20-bucket table, 5 MB; stepping from an eighth also skipped 2^19
                // and measured 0.6 MiB less per VM when full, but an index of 230k-460k blocks
                // would then hold a 10.5 MB table where doubling holds 2.6 MB, by the sizes).
                let more = self.capacity - self.table.len();
                let slots = &self.slots;
                self.table
                    .reserve(more, |&s| mix(slots[s as usize].key, secret));
            }
        }
        let slots = &self.slots;
        self.table.insert_unique(mix(key, secret), slot, |&s| {
            mix(slots[s as usize].key, secret)
        });
        self.table_full = self.table_full.max(self.table.capacity());
        self.live += 1;
        slot
    }

    /// Empties the hash table in place and inserts every live slot again. hashbrown leaves a
    /// tombstone for some removals, and once tombstones use up the table's room it rehashes in place
    /// only when at most half its capacity is live, otherwise it doubles: an index churning at a cap
    /// of 1M (48% of its 2M buckets) doubled its table to 4M buckets (+10 MB) after about ten million
    /// evictions, measured. The index never holds more than the cap, so the room is there, only
    /// taken by tombstones: clearing them costs one pass, as hashbrown's own rehash would, and no
    /// memory.
    fn rebuild_table(&mut self) {
        self.table.clear();
        let secret = self.secret;
        for s in 0..self.slots.len() {
            let slot = &self.slots[s];
            if slot.is_free() {
                continue;
            }
            let slots = &self.slots;
            self.table
                .insert_unique(mix(slot.key, secret), s as u32, |&i| {
                    mix(slots[i as usize].key, secret)
                });
        }
    }

    /// Frees one slot for a block `storing` is about to add (see the module docs on fair shares).
    fn make_room(&mut self, storing: usize) {
        // Dropping a copy frees a slot only when nobody else holds the block, so this may drop several;
        // each drop undoes one earlier store (amortized O(1) a store). The global hand is left for the
        // degenerate case where nobody is over a share (more replicas than blocks of cap).
        let share = self.share() as u64;
        while self.live >= self.capacity {
            let victim = if self.per_replica[storing] >= share {
                Some(storing)
            } else {
                self.most_over_share(share)
            };
            match victim {
                Some(v) if self.evict_from(v) => {}
                _ => {
                    self.evict_one();
                    return;
                }
            }
        }
    }

    /// The replica holding the most blocks past its share, if any is past it.
    fn most_over_share(&self, share: u64) -> Option<usize> {
        let (r, &n) = self
            .per_replica
            .iter()
            .enumerate()
            .max_by_key(|&(_, &n)| n)?;
        (n > share).then_some(r)
    }

    fn slot_held_by(&self, slot: usize, replica: usize) -> bool {
        self.holders(slot as u32)
            .iter()
            .any(|&h| holder_replica(h) == replica)
    }

    /// Drops `replica`'s copy of its least recently touched block (CLOCK with the replica's own hand);
    /// the block goes when nobody else holds it. False when the replica holds nothing.
    fn evict_from(&mut self, replica: usize) -> bool {
        let n = self.slots.len();
        if n == 0 || self.per_replica[replica] == 0 {
            return false;
        }
        let mut hand = self.hands[replica] % n;
        for _ in 0..=2 * n {
            let s = hand;
            hand = if hand + 1 >= n { 0 } else { hand + 1 };
            if self.slots[s].is_free() || !self.slot_held_by(s, replica) {
                continue;
            }
            if self.is_referenced(s) {
                self.clear_referenced(s);
                continue;
            }
            self.hands[replica] = hand;
            self.drop_holder(s as u32, replica, 0b111);
            self.evictions += 1;
            return true;
        }
        self.hands[replica] = hand;
        false
    }

    fn evict_one(&mut self) {
        let n = self.slots.len();
        // Two sweeps always suffice: the first clears every referenced bit.
        for _ in 0..=2 * n {
            let s = self.hand;
            self.hand = if self.hand + 1 >= n { 0 } else { self.hand + 1 };
            if self.slots[s].is_free() {
                continue;
            }
            if self.is_referenced(s) {
                self.clear_referenced(s);
                continue;
            }
            self.free_slot(s as u32);
            self.evictions += 1;
            return;
        }
    }

    fn free_slot(&mut self, slot: u32) {
        let key = self.slots[slot as usize].key;
        let slots = &self.slots;
        if let Ok(entry) = self
            .table
            .find_entry(mix(key, self.secret), |&s| slots[s as usize].key == key)
        {
            entry.remove();
        }
        let s = self.slots[slot as usize];
        if s.is_overflow() {
            for h in self.overflow.remove(&slot).unwrap_or_default() {
                let r = holder_replica(h);
                self.per_replica[r] = self.per_replica[r].saturating_sub(1);
            }
        } else {
            for &h in &s.inline[..s.inline_len()] {
                let r = holder_replica(h);
                self.per_replica[r] = self.per_replica[r].saturating_sub(1);
            }
        }
        // Pushed on the free list: the slot's key holds the old head.
        self.slots[slot as usize] = Slot {
            key: self.free_head,
            inline: [0; INLINE],
        };
        self.free_head = slot as u64;
        self.clear_referenced(slot as usize);
        self.live -= 1;
    }

    fn add_holder(&mut self, slot: u32, replica: usize, bit: u8) {
        let s = &mut self.slots[slot as usize];
        if s.is_overflow() {
            let v = self.overflow.entry(slot).or_default();
            if let Some(h) = v.iter_mut().find(|h| holder_replica(**h) == replica) {
                *h |= bit as u16;
            } else {
                v.push(holder(replica, bit));
                self.per_replica[replica] += 1;
            }
            return;
        }
        let len = s.inline_len();
        if let Some(h) = s.inline[..len]
            .iter_mut()
            .find(|h| holder_replica(**h) == replica)
        {
            *h |= bit as u16;
            return;
        }
        self.per_replica[replica] += 1;
        if len < INLINE {
            s.inline[len] = holder(replica, bit);
        } else {
            let mut v = Vec::with_capacity(INLINE * 2);
            v.extend_from_slice(&s.inline);
            v.push(holder(replica, bit));
            s.inline = OVERFLOW;
            self.overflow.insert(slot, v);
        }
    }

    /// Clears `bits` of `replica`'s tier mask on a block; frees the block when nobody holds it.
    fn drop_holder(&mut self, slot: u32, replica: usize, bits: u8) {
        let s = &mut self.slots[slot as usize];
        let remaining = if s.is_overflow() {
            let Some(v) = self.overflow.get_mut(&slot) else {
                return;
            };
            let Some(i) = v.iter().position(|h| holder_replica(*h) == replica) else {
                return;
            };
            v[i] &= !(bits as u16);
            if holder_mask(v[i]) == 0 {
                v.swap_remove(i);
                self.per_replica[replica] = self.per_replica[replica].saturating_sub(1);
            }
            if v.len() <= INLINE {
                let n = v.len();
                s.inline = [0; INLINE];
                s.inline[..n].copy_from_slice(v);
                self.overflow.remove(&slot);
            }
            if s.is_overflow() {
                INLINE + 1
            } else {
                s.inline_len()
            }
        } else {
            let len = s.inline_len();
            let Some(i) = s.inline[..len]
                .iter()
                .position(|h| holder_replica(*h) == replica)
            else {
                return;
            };
            s.inline[i] &= !(bits as u16);
            if holder_mask(s.inline[i]) == 0 {
                s.inline[i] = s.inline[len - 1];
                s.inline[len - 1] = 0;
                self.per_replica[replica] = self.per_replica[replica].saturating_sub(1);
            }
            s.inline_len()
        };
        if remaining == 0 {
            self.free_slot(slot);
        }
    }

    /// Checks internal invariants (tests): table and slab agree, counts match, cap holds.
    #[doc(hidden)]
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.live > self.capacity {
            return Err(format!("live {} over cap {}", self.live, self.capacity));
        }
        if self.table.len() != self.live {
            return Err(format!("table {} vs live {}", self.table.len(), self.live));
        }
        let mut per = vec![0u64; self.replicas];
        let mut live = 0;
        let mut free = 0;
        for (i, s) in self.slots.iter().enumerate() {
            if s.is_free() {
                free += 1;
                continue;
            }
            live += 1;
            if self.find(s.key) != Some(i as u32) {
                return Err(format!("slot {i} not findable"));
            }
            for &h in self.holders(i as u32) {
                if holder_mask(h) == 0 {
                    return Err(format!("slot {i} has an empty holder"));
                }
                per[holder_replica(h)] += 1;
            }
            if self.holders(i as u32).is_empty() {
                return Err(format!("slot {i} live without holders"));
            }
        }
        if live != self.live {
            return Err(format!("counted {live} live vs {}", self.live));
        }
        let mut on_list = 0;
        let mut next = self.free_head;
        while next != NO_SLOT {
            if next as usize >= self.slots.len() || !self.slots[next as usize].is_free() {
                return Err(format!("free list reaches slot {next}, not a free slot"));
            }
            on_list += 1;
            if on_list > free {
                return Err("free list longer than the free slots (a cycle)".into());
            }
            next = self.slots[next as usize].key;
        }
        if on_list != free {
            return Err(format!("{free} free slots, {on_list} on the free list"));
        }
        if self.slots.len() > self.capacity {
            return Err(format!(
                "{} slots over cap {}",
                self.slots.len(),
                self.capacity
            ));
        }
        if per != self.per_replica {
            return Err(format!("per replica {per:?} vs {:?}", self.per_replica));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_leading_run_per_replica_by_tier() {
        let mut ix = KvIndex::new(100, 3, 9);
        ix.store(0, Tier::Gpu, &[1, 2, 3]);
        ix.store(1, Tier::Gpu, &[1]);
        ix.store(1, Tier::Host, &[2, 3]);
        ix.store(2, Tier::Gpu, &[2, 3]); // no block 1: no leading run
        let mut out = Vec::new();
        ix.match_prefix(&[1, 2, 3, 4], &mut out);
        assert_eq!(out, vec![[3, 0, 0], [1, 2, 0], [0, 0, 0]]);
        // GPU beats host when both hold it.
        ix.store(1, Tier::Gpu, &[2]);
        ix.match_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out[1], [2, 1, 0]);
        ix.check_invariants().unwrap();
    }

    /// A slot remembered by a match is checked, not trusted: after its block is removed, its slot
    /// freed and reused by another block, or its holders changed, matches answer as the table does.
    #[test]
    fn recently_matched_slots_are_checked_not_trusted() {
        let mut ix = KvIndex::new(100, 2, 3);
        let mut out = Vec::new();
        ix.store(0, Tier::Gpu, &[1, 2, 3]);
        ix.match_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out[0], [3, 0, 0]);
        // Block 2 goes; its slot is reused by block 9 (the free list hands it out first).
        ix.remove(0, Tier::Gpu, &[2]);
        ix.match_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out[0], [1, 0, 0]);
        ix.store(1, Tier::Host, &[9]);
        ix.match_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out[0], [1, 0, 0]);
        ix.match_prefix(&[9], &mut out);
        assert_eq!(out, vec![[0, 0, 0], [0, 1, 0]]);
        // Holders and tiers are read from the slot each time.
        ix.store(0, Tier::Gpu, &[2]);
        ix.store(1, Tier::Host, &[1]);
        ix.match_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out, vec![[3, 0, 0], [0, 1, 0]]);
        ix.remove_replica(0);
        ix.match_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out, vec![[0, 0, 0], [0, 1, 0]]);
        ix.check_invariants().unwrap();
    }

    /// The recently matched sets answer as the hash table does, whatever pushed entries out of a set
    /// or freed and reused their slots: against the same index with the sets emptied before every
    /// match (so it asks the table each time), with and without tags, in a small table whose sets
    /// overflow.
    #[test]
    fn recently_matched_sets_answer_as_the_table() {
        for tagged in [true, false] {
            let mut ix = KvIndex::new(300, 3, 11);
            ix.recent_tagged = tagged;
            let mut plain = ix.clone();
            let mut rng = crate::rng::SplitMix64::new(5);
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for step in 0..3_000 {
                let r = (rng.next_u64() % 3) as usize;
                let tier = [Tier::Gpu, Tier::Host, Tier::Disk][(rng.next_u64() % 3) as usize];
                let start = rng.next_u64() % 400;
                let keys: Vec<u64> = (start..start + rng.next_u64() % 40).collect();
                match rng.next_u64() % 4 {
                    0 => {
                        ix.store(r, tier, &keys);
                        plain.store(r, tier, &keys);
                    }
                    1 => {
                        ix.remove(r, tier, &keys);
                        plain.remove(r, tier, &keys);
                    }
                    _ => {
                        plain.recent.fill(0);
                        ix.match_prefix(&keys, &mut a);
                        plain.match_prefix(&keys, &mut b);
                        assert_eq!(a, b, "tagged {tagged}, step {step}");
                    }
                }
            }
            assert_eq!(ix.referenced, plain.referenced);
            ix.check_invariants().unwrap();
        }
    }

    #[test]
    fn a_gap_ends_the_run() {
        let mut ix = KvIndex::new(100, 1, 0);
        ix.store(0, Tier::Gpu, &[1, 3]);
        let mut out = Vec::new();
        ix.match_prefix(&[1, 2, 3], &mut out);
        assert_eq!(out[0], [1, 0, 0]);
    }

    /// The lookups of a chunk stop at its first key not found: runs that end at every place in
    /// and across chunks, with later keys of the chunk present (a gap), match as a walk of the
    /// keys one by one does, cold and with the recent slots warm.
    #[test]
    fn runs_end_where_the_walk_ends_at_every_place_in_a_chunk() {
        for gap in 0..40u64 {
            let mut ix = KvIndex::new(1000, 2, 5);
            let keys: Vec<u64> = (1..=40).collect();
            let held: Vec<u64> = keys.iter().copied().filter(|&k| k != gap + 1).collect();
            ix.store(0, Tier::Gpu, &held);
            ix.store(1, Tier::Host, &keys[..(gap as usize / 2 + 3).min(40)]);
            let walk = |ix: &KvIndex, r: usize, tier: Tier| {
                keys.iter().take_while(|&&k| ix.holds(r, tier, k)).count() as u32
            };
            let want = vec![
                [walk(&ix, 0, Tier::Gpu), 0, 0],
                [0, walk(&ix, 1, Tier::Host), 0],
            ];
            for _ in 0..2 {
                let mut out = Vec::new();
                ix.match_prefix(&keys, &mut out);
                assert_eq!(out, want, "gap at {gap}");
            }
        }
    }

    #[test]
    fn remove_by_tier_and_replica_reset() {
        let mut ix = KvIndex::new(100, 2, 0);
        ix.store(0, Tier::Gpu, &[1, 2]);
        ix.store(0, Tier::Host, &[1]);
        ix.store(1, Tier::Disk, &[1, 2]);
        ix.remove(0, Tier::Gpu, &[1]);
        assert!(ix.holds(0, Tier::Host, 1));
        assert!(!ix.holds(0, Tier::Gpu, 1));
        assert_eq!(ix.replica_blocks(0), 2);
        ix.remove_replica(1);
        assert_eq!(ix.replica_blocks(1), 0);
        assert!(!ix.holds(1, Tier::Disk, 2));
        ix.remove(0, Tier::Host, &[1]);
        ix.remove(0, Tier::Gpu, &[2, 99]);
        assert!(ix.is_empty());
        ix.check_invariants().unwrap();
    }

    #[test]
    fn many_holders_overflow_and_shrink_back() {
        let mut ix = KvIndex::new(10, 300, 0);
        for r in 0..300 {
            ix.store(r, Tier::Gpu, &[42]);
        }
        let mut out = Vec::new();
        ix.match_prefix(&[42], &mut out);
        assert!(out.iter().all(|c| *c == [1, 0, 0]));
        ix.check_invariants().unwrap();
        for r in 0..298 {
            ix.remove(r, Tier::Gpu, &[42]);
        }
        ix.check_invariants().unwrap();
        assert!(ix.holds(299, Tier::Gpu, 42));
        assert!(ix.overflow.is_empty());
    }

    #[test]
    fn cap_evicts_unreferenced_first() {
        let mut ix = KvIndex::new(4, 1, 0);
        ix.store(0, Tier::Gpu, &[1, 2, 3, 4]);
        // All referenced: first sweep clears bits, then 1 goes.
        ix.store(0, Tier::Gpu, &[5]);
        assert_eq!(ix.len(), 4);
        assert_eq!(ix.evictions(), 1);
        assert!(!ix.holds(0, Tier::Gpu, 1));
        // Touch 2 by matching... it is not a leading block of [2]? It is: a run starting at 2.
        let mut out = Vec::new();
        ix.match_prefix(&[2], &mut out);
        ix.store(0, Tier::Gpu, &[6]);
        assert!(ix.holds(0, Tier::Gpu, 2), "touched block survives");
        assert!(!ix.holds(0, Tier::Gpu, 3), "untouched block goes");
        ix.check_invariants().unwrap();
    }

    #[test]
    fn a_flood_from_one_replica_evicts_only_its_own_blocks() {
        let mut ix = KvIndex::new(1000, 4, 5);
        assert_eq!(ix.share(), 250);
        let kept: Vec<Vec<u64>> = (1..4u64)
            .map(|r| (0..200).map(|i| r << 32 | i).collect())
            .collect();
        for (r, keys) in kept.iter().enumerate() {
            ix.store(r + 1, Tier::Gpu, keys);
        }
        // Replica 0 reports a million blocks: it may use the room left, then evicts its own.
        let flood: Vec<u64> = (0..1_000_000u64).map(|i| 9 << 40 | i).collect();
        for chunk in flood.chunks(4096) {
            ix.store(0, Tier::Gpu, chunk);
        }
        assert_eq!(ix.len(), 1000);
        assert_eq!(ix.replica_blocks(0), 400, "the room the others left");
        for (r, keys) in kept.iter().enumerate() {
            assert_eq!(ix.replica_blocks(r + 1), 200);
            let mut out = Vec::new();
            ix.match_prefix(keys, &mut out);
            assert_eq!(out[r + 1], [200, 0, 0], "replica {} lost blocks", r + 1);
        }
        // Its newest blocks are the ones it keeps.
        assert!(ix.holds(0, Tier::Gpu, *flood.last().unwrap()));
        assert!(!ix.holds(0, Tier::Gpu, flood[0]));
        // A replica under its share that stores more takes the room back from the one over it.
        let more: Vec<u64> = (200..300).map(|i| 1 << 32 | i).collect();
        ix.store(1, Tier::Gpu, &more);
        assert_eq!(ix.replica_blocks(1), 250, "up to its share, and no further");
        assert_eq!(ix.replica_blocks(0), 350);
        assert_eq!(ix.replica_blocks(2), 200);
        assert_eq!(ix.len(), 1000);
        ix.check_invariants().unwrap();
    }

    #[test]
    fn shared_blocks_count_for_each_holder_and_stay_while_held() {
        let mut ix = KvIndex::new(10, 2, 0);
        assert_eq!(ix.share(), 5);
        ix.store(0, Tier::Gpu, &[1, 2, 3, 4, 5]);
        ix.store(1, Tier::Gpu, &[1, 2, 3, 4, 5]);
        // Replica 1 floods: its copies of the shared blocks may go, the blocks stay for replica 0.
        ix.store(1, Tier::Gpu, &(100..200).collect::<Vec<u64>>());
        for k in 1..=5 {
            assert!(ix.holds(0, Tier::Gpu, k), "block {k}");
        }
        assert_eq!(ix.replica_blocks(0), 5);
        assert!(ix.len() <= 10);
        ix.check_invariants().unwrap();
        // More replicas than blocks of cap: shares are one block, the cap still holds.
        let mut tiny = KvIndex::new(2, 4, 0);
        for r in 0..4 {
            tiny.store(r, Tier::Gpu, &[r as u64 * 10, r as u64 * 10 + 1]);
        }
        assert_eq!(tiny.share(), 1);
        assert!(tiny.len() <= 2);
        tiny.check_invariants().unwrap();
    }

    /// The index never reserves more than `memory_bound` for its cap, however it is filled, flooded,
    /// reset and churned: the slab's chunks stop at the cap, and tombstones never make the table
    /// grow past the size the cap needs (hashbrown doubled it under churn before `rebuild_table`).
    #[test]
    fn memory_stays_within_the_bound_for_the_cap() {
        for (cap, replicas) in [(1, 1), (7, 2), (1000, 4), (70_000, 3), (200_000, 16)] {
            let mut ix = KvIndex::new(cap, replicas, 3);
            let bound = KvIndex::memory_bound(cap, replicas);
            let mut peak = 0;
            let mut x = 0x9E37_79B9u64 ^ cap as u64;
            // Five caps' worth of random blocks from random replicas (churn at the cap), with a
            // replica reset every cap's worth.
            for i in 0..5 * cap.max(64) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                ix.store((x % replicas as u64) as usize, Tier::Gpu, &[x]);
                if (i + 1) % cap.max(64) == 0 {
                    ix.remove_replica((x >> 8) as usize % replicas);
                }
                peak = peak.max(ix.heap_bytes());
            }
            assert!(ix.overflow.is_empty());
            assert!(
                peak <= bound,
                "cap {cap}: {peak} bytes reserved, bound {bound}"
            );
            ix.check_invariants().unwrap();
            // And the bound is tight enough to mean something: a full index uses most of it.
            for r in 0..replicas {
                let keys: Vec<u64> = (0..cap as u64).map(|k| (r as u64) << 40 | k).collect();
                ix.store(r, Tier::Gpu, &keys);
            }
            assert_eq!(ix.len(), cap);
            if cap >= 1000 {
                assert!(
                    ix.heap_bytes() * 10 >= bound * 9,
                    "cap {cap}: {} of {bound}",
                    ix.heap_bytes()
                );
            }
        }
        // At the default cap, the figure docs/design/filter.md and docs/reference/configuration.md
        // quote. 16 MB of slots, 16 chunk handles, 125 KB of bits, 2^21 buckets, 16 replicas, the
        // recently matched slots.
        assert_eq!(
            KvIndex::memory_bound(1_000_000, 16),
            16_000_000 + 16 * 24 + 125_000 + (1 << 21) * 5 + 24 + 16 * 16 + (1 << 16) * 4
        );
    }

    #[test]
    fn the_table_grows_to_the_caps_size_in_one_step_after_a_quarter() {
        let cap = 100_000;
        let mut ix = KvIndex::new(cap, 1, 0);
        let keys: Vec<u64> = (0..cap as u64).collect();
        ix.store(0, Tier::Gpu, &keys[..cap / 16]);
        assert!(ix.table.capacity() < cap / 4, "doubling while small");
        // The first growth at or past cap / 4 (here at 28,672 blocks, 2^15 buckets' worth).
        ix.store(0, Tier::Gpu, &keys[..cap / 2]);
        assert!(ix.table.capacity() >= cap, "{}", ix.table.capacity());
        let at_jump = ix.table.allocation_size();
        ix.store(0, Tier::Gpu, &keys);
        assert_eq!(
            ix.table.allocation_size(),
            at_jump,
            "no growth after the jump"
        );
        assert_eq!(
            at_jump,
            KvIndex::buckets_for(cap) * 5 + 16,
            "the cap's size, not more"
        );
    }

    #[test]
    fn a_full_index_churning_keeps_its_table_size() {
        // 900k of cap: 86% of the 1M (2^20 * 7/8 = 917,504) buckets' room, over the half at which
        // hashbrown stops rehashing in place and doubles.
        let cap = 900_000;
        let mut ix = KvIndex::new(cap, 2, 1);
        let mut x = 77u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let keys: Vec<u64> = (0..cap).map(|_| next()).collect();
        ix.store(0, Tier::Gpu, &keys);
        let full = ix.heap_bytes();
        for _ in 0..4 * cap {
            let k = next();
            ix.store(1, Tier::Gpu, &[k]);
        }
        assert_eq!(ix.len(), cap);
        assert_eq!(
            ix.heap_bytes(),
            full,
            "the index grew while churning at its cap"
        );
        ix.check_invariants().unwrap();
    }

    #[test]
    fn out_of_range_replica_is_ignored() {
        let mut ix = KvIndex::new(4, 2, 0);
        assert!(!ix.store(2, Tier::Gpu, &[1]));
        assert!(!ix.remove(5, Tier::Gpu, &[1]));
        ix.remove_replica(7);
        assert!(ix.is_empty());
    }
}
