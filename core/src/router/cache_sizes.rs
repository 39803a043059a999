//! Each replica's prefix-cache size as its KV event feed shows it, for the working-set term: the
//! most blocks the index has held for it, which is its size once it has evicted (before that, only
//! a lower bound), and the largest size any replica has shown, what a replica that has not evicted
//! yet is priced as.

/// A replica's cache size as the feed shows it: the most blocks it has held, which is its size once
/// it has evicted (before that, only a lower bound).
#[derive(Clone, Copy, Debug, Default)]
struct CacheSize {
    most_held: u64,
    evicted: bool,
}

/// Per replica its [`CacheSize`], and the largest any has shown by evicting.
#[derive(Clone, Debug)]
pub(super) struct CacheSizes {
    sizes: Vec<CacheSize>,
    /// The largest cache any replica has shown by evicting (blocks; 0: none has yet). Kept as
    /// feeds change it, so that routing does not scan every replica's size for each replica it
    /// prices.
    largest_shown: u64,
}

impl CacheSizes {
    pub(super) fn new(replicas: usize) -> CacheSizes {
        CacheSizes {
            sizes: vec![CacheSize::default(); replicas],
            largest_shown: 0,
        }
    }

    /// The index now holds `held` blocks of `replica`'s after a feed event, which `evicted` from
    /// its GPU cache or not. Nothing held (cleared: an engine restart, perhaps with another cache
    /// size): the size is learned again.
    pub(super) fn note(&mut self, replica: usize, held: u64, evicted: bool) {
        if held == 0 {
            self.forget(replica);
            return;
        }
        if let Some(c) = self.sizes.get_mut(replica) {
            c.most_held = c.most_held.max(held);
            c.evicted |= evicted;
            if c.evicted {
                self.largest_shown = self.largest_shown.max(c.most_held);
            }
        }
    }

    /// The replica's size is not known any more (its view cleared, its slot vacated).
    pub(super) fn forget(&mut self, replica: usize) {
        if let Some(c) = self.sizes.get_mut(replica) {
            *c = CacheSize::default();
        }
        // The largest may have gone with it: scanned afresh.
        self.largest_shown = self
            .sizes
            .iter()
            .filter(|c| c.evicted)
            .map(|c| c.most_held)
            .max()
            .unwrap_or(0);
    }

    /// The replica's size once it has evicted (the most blocks it held); `None` before.
    pub(super) fn shown(&self, replica: usize) -> Option<u64> {
        match self.sizes.get(replica) {
            Some(c) if c.evicted => Some(c.most_held),
            _ => None,
        }
    }

    /// The most blocks the replica has held (0 out of range).
    pub(super) fn most_held(&self, replica: usize) -> u64 {
        self.sizes.get(replica).map_or(0, |c| c.most_held)
    }

    /// The replica's size as learned: shown by evicting, else priced like the largest cache
    /// another replica has shown (at least what it holds itself); 0 while no replica has shown
    /// its size ([`super::Router::cache_size_blocks`] says why).
    pub(super) fn learned_blocks(&self, replica: usize) -> f64 {
        match self.shown(replica) {
            Some(shown) => shown as f64,
            None if self.largest_shown == 0 => 0.0,
            None => self.largest_shown.max(self.most_held(replica)) as f64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_is_shown_by_evicting_and_lends_itself_to_the_others() {
        let mut c = CacheSizes::new(3);
        c.note(0, 100, false);
        assert_eq!((c.shown(0), c.learned_blocks(0)), (None, 0.0));
        c.note(0, 90, true);
        assert_eq!(c.shown(0), Some(100));
        // Replica 1 has not evicted: priced like the largest shown, at least what it holds.
        c.note(1, 40, false);
        assert_eq!(c.learned_blocks(1), 100.0);
        c.note(1, 140, false);
        assert_eq!(c.learned_blocks(1), 140.0);
        assert_eq!(c.learned_blocks(2), 100.0);
        assert_eq!(
            c.learned_blocks(7),
            100.0,
            "out of range: the largest shown"
        );
    }

    #[test]
    fn a_cleared_or_forgotten_replica_learns_its_size_again() {
        let mut c = CacheSizes::new(2);
        c.note(0, 100, true);
        c.note(1, 50, true);
        c.note(0, 0, false);
        assert_eq!((c.shown(0), c.most_held(0)), (None, 0));
        assert_eq!(c.learned_blocks(0), 50.0, "the largest left is replica 1's");
        c.forget(1);
        assert_eq!(c.learned_blocks(0), 0.0);
    }
}
