//! The replicas' KV event feeds: the next poll's query, a batch judged against the replica's cursor
//! and applied to the KV index (whole or in slices), each replica's cache size as the feed shows it,
//! and stale feeds.

use super::cache_sizes::CacheSizes;
use super::{FeedOutcome, Router};
use crate::adapters::{AdapterFit, AdapterView, name_hash};
use crate::feed::{
    AdapterReport, CursorVerdict, EventKind, FeedBatch, FeedCursor, FeedEvent, FeedQuery,
    FeedSlice, Tier,
};
use crate::policy::CacheSizing;
use crate::request::RouteRequest;

/// What the replicas' feeds told this router beside the KV index and the load reports: each
/// feed's position, each replica's cache size and its LoRA adapters.
#[derive(Clone, Debug)]
pub(super) struct Feeds {
    /// Per replica: where its feed's log stands (the next poll's query).
    cursors: Vec<FeedCursor>,
    /// Per replica: its cache's size as learned from the feed.
    sizes: CacheSizes,
    /// Per replica: its LoRA adapters as its last feed answer reported them; `None`: not known.
    adapters: Vec<Option<AdapterView>>,
}

impl Feeds {
    pub(super) fn new(replicas: usize) -> Feeds {
        Feeds {
            cursors: vec![FeedCursor::default(); replicas],
            sizes: CacheSizes::new(replicas),
            adapters: vec![None; replicas],
        }
    }

    /// The slot's member left: its feed starts over and its cache size is learned again. Its
    /// adapters stay until the slot's next feed answer replaces them.
    pub(super) fn forget(&mut self, replica: usize) {
        if let Some(c) = self.cursors.get_mut(replica) {
            *c = FeedCursor::default();
        }
        self.sizes.forget(replica);
    }
}

impl Router {
    /// Keeps what `replica`'s latest feed answer said about its LoRA adapters
    /// ([`crate::feed::FeedFrame::adapters`]); `None` (an answer without the section) makes them
    /// unknown again, so a replica downgraded to a feed without adapters gets no adapter term.
    pub fn set_adapters(&mut self, replica: usize, report: Option<&AdapterReport>) {
        if let Some(slot) = self.feeds.adapters.get_mut(replica) {
            *slot = report.map(AdapterView::new);
        }
    }

    /// Per replica, where the request's adapter stands, and the seconds a load takes; empty and 0
    /// when adapters are not configured or the request names none. A stale replica's report is not
    /// trusted: unknown.
    pub(super) fn adapter_fits(&self, req: &RouteRequest) -> (Vec<AdapterFit>, f64) {
        let Some(p) = &self.cfg.adapters else {
            return (Vec::new(), 0.0);
        };
        let Some(name) = p.adapter_of(req.model.as_deref()) else {
            return (Vec::new(), 0.0);
        };
        let h = name_hash(name);
        let fits = (0..self.replicas())
            .map(|r| match &self.feeds.adapters[r] {
                Some(v) if !self.reported.is_stale(r) => v.fit(h),
                _ => AdapterFit::Unknown,
            })
            .collect();
        (fits, p.load_s())
    }

    /// The query for the next poll of `replica` (a snapshot request for an unknown replica index).
    pub fn feed_query(&self, replica: usize, max_events: u32) -> FeedQuery {
        match self.feeds.cursors.get(replica) {
            Some(c) => c.query(max_events),
            None => FeedQuery::resync(max_events),
        }
    }

    /// Applies one decoded feed batch from `replica`.
    pub fn apply_feed(&mut self, replica: usize, batch: &FeedBatch) -> FeedOutcome {
        match self.accept_feed(replica, batch) {
            FeedOutcome::Applied { .. } => FeedOutcome::Applied {
                events: self.apply_events(replica, &batch.events),
            },
            FeedOutcome::Reset { epoch, .. } => FeedOutcome::Reset {
                events: self.apply_events(replica, &batch.events),
                epoch,
            },
            other => other,
        }
    }

    /// The first half of [`Router::apply_feed`], for a batch applied in slices: takes the batch's
    /// load, judges its position against the replica's cursor and, for a snapshot, drops what the
    /// replica held. Ignores `batch.events`; unless the outcome is a gap or a bad replica, the caller
    /// then applies the events in order with [`Router::apply_feed_slice`]. The outcomes' event counts
    /// are 0.
    pub fn accept_feed(&mut self, replica: usize, batch: &FeedBatch) -> FeedOutcome {
        self.accept_feed_polled_at(replica, batch, self.clock_ms)
    }

    /// [`Router::accept_feed`] for a batch whose poll was sent at `polled_ms` (this router's clock):
    /// its load describes the replica with every request this proxy admitted before then, and none it
    /// admitted after (`reported_load` `merge` adds those). [`Router::accept_feed`] takes the latest
    /// time the router was given instead.
    pub fn accept_feed_polled_at(
        &mut self,
        replica: usize,
        batch: &FeedBatch,
        polled_ms: u64,
    ) -> FeedOutcome {
        if replica >= self.replicas() {
            self.stats.bad_replica += 1;
            return FeedOutcome::BadReplica;
        }
        if batch.load.block_size != 0 && batch.load.block_size as usize != self.cfg.block_size {
            self.stats.feed_block_size_mismatches += 1;
        }
        let prev_epoch = self.feeds.cursors[replica].epoch;
        // The load figures describe the replica now, whatever the log position: keep them.
        self.reported
            .accept(replica, batch.load, polled_ms, &self.load);
        match self.feeds.cursors[replica].accept(batch) {
            CursorVerdict::Gap => {
                self.stats.feed_gaps += 1;
                FeedOutcome::Gap
            }
            CursorVerdict::ResetThenApply => {
                self.index.remove_replica(replica);
                if prev_epoch != 0 && prev_epoch != batch.epoch {
                    // The engine restarted: what this router sent there is gone too.
                    self.approx_seq.remove_replica(replica);
                    self.approx_text.remove_replica(replica);
                }
                self.stats.feed_resets += 1;
                FeedOutcome::Reset {
                    events: 0,
                    epoch: batch.epoch,
                }
            }
            CursorVerdict::Apply => FeedOutcome::Applied { events: 0 },
        }
    }

    /// Applies one slice of a feed event (part of a `stored` or `removed` event's hashes, or a whole
    /// `cleared`) of a batch accepted by [`Router::accept_feed`]; events are counted in
    /// `stats().feed_events` by their first slice.
    pub fn apply_feed_slice(&mut self, replica: usize, slice: FeedSlice, hashes: &[u64]) {
        if replica >= self.replicas() {
            self.stats.bad_replica += 1;
            return;
        }
        let FeedSlice {
            kind,
            tier,
            starts_event,
        } = slice;
        match kind {
            EventKind::Stored => {
                self.index.store(replica, tier, hashes);
                self.note_stored(replica, tier, hashes);
            }
            EventKind::Removed => {
                self.index.remove(replica, tier, hashes);
            }
            EventKind::Cleared => self.index.remove_replica(replica),
        }
        self.note_cache_size(replica, kind == EventKind::Removed && tier == Tier::Gpu);
        self.stats.feed_events += starts_event as u64;
    }

    pub(super) fn apply_events(&mut self, replica: usize, events: &[FeedEvent]) -> usize {
        for e in events {
            match e {
                FeedEvent::Stored { tier, hashes } => {
                    self.index.store(replica, *tier, hashes);
                    self.note_stored(replica, *tier, hashes);
                }
                FeedEvent::Removed { tier, hashes } => {
                    self.index.remove(replica, *tier, hashes);
                }
                FeedEvent::Cleared => self.index.remove_replica(replica),
            }
            let evicted = matches!(
                e,
                FeedEvent::Removed {
                    tier: Tier::Gpu,
                    ..
                }
            );
            self.note_cache_size(replica, evicted);
        }
        self.stats.feed_events += events.len() as u64;
        events.len()
    }

    /// Counts a replica's stored GPU blocks in its working set (`working_set.from_feed`).
    pub(super) fn note_stored(&mut self, replica: usize, tier: Tier, hashes: &[u64]) {
        if tier == Tier::Gpu
            && self.cfg.working_set.from_feed
            && let Some(ws) = &mut self.working_set
        {
            ws.stored(replica, hashes, self.clock_ms);
        }
    }

    /// Learns a replica's cache size from what the index holds for it (`kv_load.overflow_weight`).
    pub(super) fn note_cache_size(&mut self, replica: usize, evicted: bool) {
        let held = self.index.replica_blocks(replica);
        self.feeds.sizes.note(replica, held, evicted);
    }

    /// A replica's prefix-cache size in blocks for the working-set term: `replica_cache_tokens` when
    /// set, else as learned from its feed (the most blocks it held once it evicted). A replica that
    /// has not evicted yet is priced like the largest cache another replica has shown (at least what
    /// it holds itself): replicas of one fleet are alike until shown otherwise, and pricing it as
    /// unbounded would make it look free to the very working sets that overflow the others, so it
    /// would draw every fresh prompt. 0 (the term off) only while no replica has shown its size.
    pub fn cache_size_blocks(&self, replica: usize) -> f64 {
        let configured = self.cfg.kv_load.replica_cache_tokens / self.cfg.block_size as f64;
        if configured > 0.0 {
            return configured;
        }
        self.feeds.sizes.learned_blocks(replica)
    }

    /// A replica's prefix-cache size in blocks for the working-set term, sized as the policy asks
    /// ([`CacheSizing`]); `smallest` is [`Router::smallest_shown_cache`] (taken once per request).
    pub(super) fn cache_blocks_by(
        &self,
        replica: usize,
        sizing: CacheSizing,
        smallest: f64,
    ) -> f64 {
        let CacheSizing::AtLeast { cache_tokens } = sizing else {
            return self.cache_size_blocks(replica);
        };
        if let Some(shown) = self.shown_cache_blocks(replica) {
            return shown;
        }
        // Not shown yet: never priced as free. The profile's cache, or the smallest another
        // replica of the fleet has shown where that is smaller, at least what it holds (with
        // a profile 25x the real caches, the one replica not yet evicting drew 35 of 40 fresh
        // prompts, its evictions priced 0).
        let held = self.feeds.sizes.most_held(replica) as f64;
        (cache_tokens / self.cfg.block_size as f64)
            .min(smallest)
            .max(held)
    }

    /// A replica's cache in blocks as its feed shows it: the GPU KV blocks its load report gives
    /// (in the router's block size), else the most blocks it held once it evicted; `None` before
    /// either.
    pub(super) fn shown_cache_blocks(&self, replica: usize) -> Option<f64> {
        let bs = self.cfg.block_size as f64;
        if let Some(l) = self.reported.report(replica)
            && l.kv_total_blocks > 0
        {
            let engine_bs = if l.block_size > 0 {
                l.block_size as f64
            } else {
                bs
            };
            return Some(l.kv_total_blocks as f64 * engine_bs / bs);
        }
        self.feeds.sizes.shown(replica).map(|b| b as f64)
    }

    /// The smallest cache any replica's feed has shown, in blocks (infinite before any has).
    pub(super) fn smallest_shown_cache(&self) -> f64 {
        (0..self.replicas())
            .filter_map(|r| self.shown_cache_blocks(r))
            .fold(f64::INFINITY, f64::min)
    }

    /// A replica's cache in blocks as the policy prices it: [`Router::cache_size_blocks`] under a
    /// policy that does not size caches itself, the working-set term's size under `kv_time` (the
    /// feed's, else never more than the smallest shown). What the `cache_size_blocks` gauge shows.
    pub fn priced_cache_blocks(&self, replica: usize) -> f64 {
        match self.decider.needs.working_set {
            Some(sizing) => self.cache_blocks_by(replica, sizing, self.smallest_shown_cache()),
            None => self.cache_size_blocks(replica),
        }
    }

    /// Marks a replica's feed as failing (or recovered). Stale: its index and reported load are not
    /// trusted; it is routed by tracked load only.
    pub fn set_stale(&mut self, replica: usize, stale: bool) {
        if !self.reported.set_stale(replica, stale) {
            self.stats.bad_replica += 1;
        }
    }

    pub fn is_stale(&self, replica: usize) -> bool {
        self.reported.is_stale(replica)
    }
}
