//! The table behind the working set: every sampled block some replica holds, with its holders,
//! one lookup away (the working set's module docs say why this layout).

use hashbrown::hash_table::Entry as TableEntry;
use hashbrown::{DefaultHashBuilder, HashTable};
use std::hash::BuildHasher;

/// Routing units past this many have no bit in [`Slot::masks`].
pub(super) const MASK_REPLICAS: usize = 64;

/// Calls `f` with the index of each bit set in `mask`, lowest first.
pub(super) fn each_bit(mut mask: u64, mut f: impl FnMut(usize)) {
    while mask != 0 {
        f(mask.trailing_zeros() as usize);
        mask &= mask - 1;
    }
}

/// One replica holding a sampled block: when the block was last requested there, and whether it is
/// counted there (asked for before, here or elsewhere).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Holder {
    pub(super) at: u64,
    pub(super) replica: u32,
    pub(super) counted: bool,
}

/// Holders a [`Slot`] keeps inline; more go to the heap. Most sampled blocks are held by one
/// replica, a session's by one or two; a prompt prefix common to every session by many.
const INLINE_HOLDERS: usize = 2;

/// One sampled block: the replicas holding it, each with its time and counted flag, in no
/// particular order. In [`Slots`] only while some replica holds the block (`n > 0`). Everything
/// recording, scoring or expiring a block needs is here, so each is one lookup (the module docs).
#[derive(Clone, Debug, Default)]
pub(super) struct Slot {
    inline: [Holder; INLINE_HOLDERS],
    pub(super) n: u32,
    /// Holders past the inline ones (`n - INLINE_HOLDERS` of them); `None` when there are none.
    /// Boxed: 8 bytes in every slot rather than a `Vec`'s 24, for the few blocks that spill.
    #[allow(clippy::box_collection)]
    more: Option<Box<Vec<Holder>>>,
}

impl Slot {
    pub(super) fn len(&self) -> usize {
        self.n as usize
    }

    pub(super) fn holders(&self) -> impl Iterator<Item = &Holder> {
        self.inline[..self.len().min(INLINE_HOLDERS)]
            .iter()
            .chain(self.more.iter().flat_map(|m| m.iter()))
    }

    /// `replica`'s holder, if it holds the block.
    pub(super) fn find_mut(&mut self, replica: u32) -> Option<&mut Holder> {
        let n = self.len().min(INLINE_HOLDERS);
        if let Some(h) = self.inline[..n].iter_mut().find(|h| h.replica == replica) {
            return Some(h);
        }
        self.more
            .as_mut()?
            .iter_mut()
            .find(|h| h.replica == replica)
    }

    /// `replica`'s place among the holders.
    pub(super) fn position(&self, replica: u32) -> Option<usize> {
        self.holders().position(|h| h.replica == replica)
    }

    fn get(&self, i: usize) -> Option<&Holder> {
        match i.checked_sub(INLINE_HOLDERS) {
            None => self.inline[..self.len().min(INLINE_HOLDERS)].get(i),
            Some(j) => self.more.as_ref()?.get(j),
        }
    }

    fn get_mut(&mut self, i: usize) -> Option<&mut Holder> {
        let n = self.len().min(INLINE_HOLDERS);
        match i.checked_sub(INLINE_HOLDERS) {
            None => self.inline[..n].get_mut(i),
            Some(j) => self.more.as_mut()?.get_mut(j),
        }
    }

    pub(super) fn push(&mut self, h: Holder) {
        let n = self.len();
        match self.inline.get_mut(n) {
            Some(slot) => *slot = h,
            None => self.more.get_or_insert_with(Default::default).push(h),
        }
        self.n += 1;
    }

    /// Removes holder `i` (the last one takes its place).
    fn remove(&mut self, i: usize) -> Option<Holder> {
        let removed = *self.get(i)?;
        let last = self.len() - 1;
        let moved = match last.checked_sub(INLINE_HOLDERS) {
            None => self.inline[last],
            Some(_) => {
                let more = self.more.as_mut()?;
                let h = more.pop()?;
                if more.is_empty() {
                    self.more = None;
                }
                h
            }
        };
        self.n -= 1;
        if i < last
            && let Some(slot) = self.get_mut(i)
        {
            *slot = moved;
        }
        Some(removed)
    }

    /// The bitmasks of the replicas holding the block and of those where it is counted (bit `r`
    /// for replica `r`, for fleets of at most [`MASK_REPLICAS`] replicas).
    pub(super) fn masks(&self) -> (u64, u64) {
        self.holders().fold((0, 0), |(held, counted), h| {
            let b = 1u64 << h.replica;
            (held | b, if h.counted { counted | b } else { counted })
        })
    }
}

/// Slab positions a chunk holds: the slab grows a chunk at a time and never moves what it holds (a
/// `Vec` that doubles would copy megabytes on one request).
const SLAB_CHUNK: usize = 4096;

/// Every sampled block some replica holds, with its [`Slot`]: a slab of (block, slot) and a hash
/// table of slab positions. The table keeps each block's 32-bit hash beside its position (8-byte
/// buckets: a few megabytes, where buckets holding the slots themselves made tens), so probing and
/// growing it never read the slab. Positions freed by expiry are reused latest first: a request's
/// new blocks are written where the blocks it just expired were (still in cache), not to a cold
/// bucket of a large table.
#[derive(Clone, Debug, Default)]
pub(super) struct Slots {
    table: HashTable<(u32, u32)>,
    hasher: DefaultHashBuilder,
    chunks: Vec<Box<[(u64, Slot)]>>,
    free: Vec<u32>,
    /// Slab positions ever taken (the next fresh one).
    used: u32,
}

/// The table's hash from a block's 32-bit hash: the low bits pick the bucket, the top ones tag it.
fn wide(h: u32) -> u64 {
    (h as u64) << 32 | h as u64
}

fn slab_at(chunks: &[Box<[(u64, Slot)]>], i: u32) -> &(u64, Slot) {
    &chunks[i as usize / SLAB_CHUNK][i as usize % SLAB_CHUNK]
}

fn slab_at_mut(chunks: &mut [Box<[(u64, Slot)]>], i: u32) -> &mut (u64, Slot) {
    &mut chunks[i as usize / SLAB_CHUNK][i as usize % SLAB_CHUNK]
}

impl Slots {
    /// The block's hash (seeded per instance: blocks come from clients).
    fn hash(&self, key: u64) -> u32 {
        self.hasher.hash_one(key) as u32
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn get(&self, key: u64) -> Option<&Slot> {
        let h = self.hash(key);
        let chunks = &self.chunks;
        let &(i, _) = self
            .table
            .find(wide(h), |&(i, hh)| hh == h && slab_at(chunks, i).0 == key)?;
        Some(&slab_at(chunks, i).1)
    }

    /// The block's slot, an empty one (`n == 0`) if no replica holds it: the caller adds a holder.
    pub(super) fn get_or_insert(&mut self, key: u64) -> &mut Slot {
        let h = self.hash(key);
        let Slots {
            table,
            chunks,
            free,
            used,
            ..
        } = self;
        let i = match table.entry(
            wide(h),
            |&(i, hh)| hh == h && slab_at(chunks, i).0 == key,
            |&(_, hh)| wide(hh),
        ) {
            TableEntry::Occupied(o) => o.get().0,
            TableEntry::Vacant(v) => {
                let i = free.pop().unwrap_or_else(|| {
                    *used += 1;
                    *used - 1
                });
                v.insert((i, h));
                if i as usize / SLAB_CHUNK == chunks.len() {
                    chunks.push(vec![(0, Slot::default()); SLAB_CHUNK].into_boxed_slice());
                }
                *slab_at_mut(chunks, i) = (key, Slot::default());
                i
            }
        };
        &mut slab_at_mut(chunks, i).1
    }

    /// Removes `replica`'s holder of the block if its time is `at` (else the queue entry naming it
    /// is stale), and the block with its last holder.
    pub(super) fn remove_holder(&mut self, key: u64, replica: u32, at: u64) -> Option<Holder> {
        let h = self.hash(key);
        let Slots {
            table,
            chunks,
            free,
            ..
        } = self;
        let entry = table
            .find_entry(wide(h), |&(i, hh)| hh == h && slab_at(chunks, i).0 == key)
            .ok()?;
        let i = entry.get().0;
        let slot = &mut slab_at_mut(chunks, i).1;
        let pos = slot
            .holders()
            .position(|x| x.replica == replica && x.at == at)?;
        let removed = slot.remove(pos);
        if slot.n == 0 {
            entry.remove();
            free.push(i);
        }
        removed
    }

    #[cfg(test)]
    pub(super) fn values(&self) -> impl Iterator<Item = &Slot> {
        self.table.iter().map(|&(i, _)| &slab_at(&self.chunks, i).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_keeps_any_number_of_holders() {
        let mut s = Slot::default();
        let h = |r: u32| Holder {
            at: r as u64 * 10,
            replica: r,
            counted: r.is_multiple_of(2),
        };
        for r in 0..6 {
            s.push(h(r));
        }
        assert_eq!(s.len(), 6);
        assert_eq!(s.masks(), (0b111111, 0b010101));
        // Removing from the inline ones, the spilled ones and the last; each place taken by the last.
        for (r, left) in [(0, 5), (4, 4), (3, 3), (1, 2), (5, 1), (2, 0)] {
            let i = s.position(r).unwrap();
            assert_eq!(s.remove(i), Some(h(r)));
            assert_eq!(s.len(), left);
            assert_eq!(s.position(r), None);
            assert_eq!(s.holders().count(), left);
            assert!(s.holders().all(|x| *x == h(x.replica)));
            assert_eq!(s.more.is_some(), left > INLINE_HOLDERS);
        }
        assert_eq!(s.remove(0), None);
    }
}
