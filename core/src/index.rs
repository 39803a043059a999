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

mod slab;

pub use slab::SLAB_CHUNK;
use slab::{
    INLINE, NO_SLOT, OVERFLOW, Slab, Slot, best_tier, holder, holder_mask, holder_replica, mix,
};

/// Largest replica count the index can represent (13-bit replica field).
pub const MAX_REPLICAS: usize = 1 << 13;
/// The hash table doubles while it holds less than `capacity / TABLE_JUMP` blocks, then grows to
/// the cap's size in one step (see `KvIndex::insert`).
const TABLE_JUMP: usize = 4;

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
mod tests;
