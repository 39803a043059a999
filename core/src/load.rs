//! The token-load table (docs/design/design.md section 2): the work each replica still has to do, tracked
//! through every request's life as this router sees it.
//!
//! Transitions (with the default [`Accounting`], Dynamo's):
//! - **admit**: the prompt tokens the chosen replica does not already cache become prefill load, and
//!   the prompt's KV blocks become decode load at once (a prefix block already booked on that replica
//!   by another active request is not counted again);
//! - **first token**: that prefill load is done (with `prompt_blocks_at_admission` off, the prompt's
//!   blocks are booked only now);
//! - **decode progress**: one more block at each block boundary of the output; with an output-length
//!   hint (and `use_output_hint`) the request's own blocks are weighted by `1 - generated/expected`,
//!   so a request about to finish weighs little;
//! - **complete or abort** (`release`): everything the request contributes is removed, shared blocks
//!   when their last holder goes. Releasing an unknown request (double release, or one admitted by
//!   another worker) does nothing and is counted.

mod head;

pub use head::{HeadProgress, PrefillHead};

use crate::record::{Record, u32_at, u64_at};
use hashbrown::HashMap;
use std::collections::VecDeque;

/// Router-tracked totals for one replica; also what a worker publishes to its peers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadTotals {
    pub prefill_tokens: u64,
    pub decode_blocks: u64,
    pub active_requests: u32,
}

/// Queued prefill in time, counted in tokens of a short prompt (the linear layers' cost per token):
/// each of the `uncached` tokens at the end of a `prompt`-token prompt also attends to its context,
/// costing `context / attention_context_tokens` more (the time-cost model, docs/design/design.md section
/// 2), and the uncached tokens' contexts average the cached part plus half the uncached part. A
/// queue of long cold prefills takes several times its token count to clear, which counting tokens
/// hides. Saturates for hostile sizes; `attention_context_tokens` 0 counts plain tokens.
pub fn prefill_work(prompt: u64, uncached: u64, attention_context_tokens: u64) -> u64 {
    let uncached = uncached.min(prompt);
    if attention_context_tokens == 0 {
        return uncached;
    }
    let mid_context = (prompt - uncached) as f64 + uncached as f64 / 2.0;
    let work = uncached as f64 * (1.0 + mid_context / attention_context_tokens as f64);
    // u64::MAX / 8 keeps the table's sums (saturating) far from wrapping in f64 round trips.
    work.min((u64::MAX / 8) as f64) as u64
}

/// Most requests tracked at once. A proxy that loses completions (a bug, or a host that never calls
/// `on_done`) would otherwise grow the table forever; past this, new requests are routed but not
/// tracked, and counted.
pub const MAX_TRACKED_REQUESTS: usize = 1 << 20;

/// A request [`LoadTable::release_entry`] took off the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Released {
    /// Output tokens it had generated.
    pub generated: u64,
    pub replica: usize,
    /// When it was admitted (router clock, ms).
    pub admitted_ms: u64,
    /// What it contributed to its replica's load, in the report's units (as [`LoadTable::since`]
    /// counts it).
    pub share: LoadTotals,
}

impl LoadTotals {
    /// Takes `o` off field by field (saturating at zero).
    pub fn sub(&mut self, o: &LoadTotals) {
        self.prefill_tokens = self.prefill_tokens.saturating_sub(o.prefill_tokens);
        self.decode_blocks = self.decode_blocks.saturating_sub(o.decode_blocks);
        self.active_requests = self.active_requests.saturating_sub(o.active_requests);
    }

    /// Adds `o` field by field (saturating).
    pub fn add(&mut self, o: &LoadTotals) {
        self.prefill_tokens = self.prefill_tokens.saturating_add(o.prefill_tokens);
        self.decode_blocks = self.decode_blocks.saturating_add(o.decode_blocks);
        self.active_requests = self.active_requests.saturating_add(o.active_requests);
    }

    /// Adds `other`'s per-replica totals to `totals`, replica by replica (extra entries of either
    /// side are left alone).
    pub fn add_each(totals: &mut [LoadTotals], other: &[LoadTotals]) {
        for (o, t) in totals.iter_mut().zip(other) {
            o.add(t);
        }
    }
}

/// Shared between a proxy's workers as `KVLT`, a `u32` count, then `prefill_tokens u64 |
/// decode_blocks u64 | active_requests u32` per replica ([`crate::record`]).
impl Record for LoadTotals {
    const LEN: usize = 20;
    const MAGIC: Option<[u8; 4]> = Some(*b"KVLT");

    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.prefill_tokens.to_le_bytes());
        out.extend_from_slice(&self.decode_blocks.to_le_bytes());
        out.extend_from_slice(&self.active_requests.to_le_bytes());
    }

    fn take(b: &[u8]) -> Option<LoadTotals> {
        Some(LoadTotals {
            prefill_tokens: u64_at(b, 0),
            decode_blocks: u64_at(b, 8),
            active_requests: u32_at(b, 16),
        })
    }
}

/// How the table books a request's blocks. The defaults follow NVIDIA Dynamo's KV router (1.6): a
/// request's prompt blocks count from the moment it is admitted (its KV is allocated as its prefill
/// starts, and a prefill-phase request occupies the batch too), and a prefix block active on a replica
/// counts once however many requests share it (`router_assume_kv_reuse`: the engine's prefix cache
/// holds one copy). kvsteer's earlier accounting (prompt blocks from the first token, every request's
/// prompt counted whole) stays available for comparison (docs/reference/configuration.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Accounting {
    /// Charge a request's prompt blocks as decode load from admission rather than from its first token.
    pub prompt_blocks_at_admission: bool,
    /// Count a prompt block once per replica however many active requests share it.
    pub assume_kv_reuse: bool,
    /// Weight a request's own blocks by `1 - generated/expected` when it gives an output-length hint
    /// (Ray Serve LLM's decode progress): a request about to finish weighs little. With
    /// `assume_kv_reuse` only its exclusive blocks (not the shared prefix) are weighted.
    pub use_output_hint: bool,
    /// With `Some(a)`, queued prefill is booked in time rather than tokens ([`prefill_work`] with
    /// `attention_context_tokens` = `a`: `kv_load.queue_in_time`); `None`: in tokens.
    pub prefill_in_time: Option<u64>,
}

impl Default for Accounting {
    fn default() -> Self {
        Accounting {
            prompt_blocks_at_admission: true,
            assume_kv_reuse: true,
            use_output_hint: false,
            prefill_in_time: None,
        }
    }
}

#[derive(Clone, Debug)]
struct Tracked {
    replica: usize,
    /// Uncached prompt tokens charged as prefill until the first token (in time, as
    /// [`prefill_work`] counts them, when the [`Accounting`] books prefill in time).
    prefill_tokens: u64,
    /// The same prefill in plain uncached tokens, the unit a replica reports: what
    /// [`LoadTable::held`] and [`LoadTable::since`] count, so that a report and this table's part of
    /// it are subtracted in one unit.
    report_prefill: u64,
    /// Blocks of the whole prompt (cached or not): read at every decode step.
    prompt_blocks: u64,
    /// With `assume_kv_reuse`: the prompt's full-block hashes, counted in the replica's shared set
    /// once `prompt_charged`. Empty otherwise.
    shared: Vec<u64>,
    expected_output: Option<u64>,
    /// The prompt's blocks are booked as decode load (from admission or from the first token).
    prompt_charged: bool,
    decoding: bool,
    /// Output tokens generated so far.
    generated: u64,
    /// Blocks charged to the replica for this request alone (beyond the shared set).
    charged_blocks: u64,
    /// When it was admitted (the router's clock, ms): [`LoadTable::since`] counts it for a replica
    /// whose last report was polled at or before this.
    admitted_ms: u64,
}

/// One replica's active prompt blocks: block hash -> active requests holding it. A block whose last
/// holder is released stays in the map with a count of zero (idle) until there are many such, and
/// is then swept out with the others: the next request usually books the same prefix again (a
/// shared system prompt, a conversation's history), which finds the idle entry and counts it up
/// instead of inserting it anew, and a release decrements in place instead of removing (the
/// stream's end of filter-bench's 131,072-token request, mostly this release, went from about 140
/// to 90 us p50; admission did not change measurably). Idle entries never count: a block is active
/// iff its count is above zero, exactly as when it was removed.
#[derive(Clone, Debug, Default)]
struct ActiveBlocks {
    counts: HashMap<u64, u32>,
    /// Blocks with a count above zero.
    live: usize,
    /// The most live blocks since the last sweep: the map may hold twice that (plus a floor)
    /// before idle entries are swept, so it stays in proportion to what was really active.
    peak: usize,
}

impl ActiveBlocks {
    /// Idle entries always allowed before a sweep, so that a small set is not swept on every
    /// release.
    const IDLE_FLOOR: usize = 4096;

    fn contains(&self, h: u64) -> bool {
        self.counts.get(&h).is_some_and(|&n| n > 0)
    }

    fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// One more holder of `h`; true when it was not active before.
    fn book(&mut self, h: u64) -> bool {
        let n = self.counts.entry(h).or_insert(0);
        *n += 1;
        let new = *n == 1;
        self.live += new as usize;
        new
    }

    fn note_peak(&mut self) {
        self.peak = self.peak.max(self.live);
    }

    /// One holder of `h` fewer; true when that was its last (a block not booked is left alone).
    fn unbook(&mut self, h: u64) -> bool {
        match self.counts.get_mut(&h) {
            Some(n) if *n > 0 => {
                *n -= 1;
                let gone = *n == 0;
                self.live -= gone as usize;
                gone
            }
            _ => false,
        }
    }

    /// Sweeps the idle entries out once the map holds more than twice the peak of live ones (plus
    /// the floor).
    fn tidy(&mut self) {
        if self.counts.len() > 2 * self.peak + Self::IDLE_FLOOR {
            self.counts.retain(|_, n| *n > 0);
            self.peak = self.live;
        }
    }
}

/// Per-replica tracked load and the requests behind it.
#[derive(Clone, Debug)]
pub struct LoadTable {
    block_size: u64,
    accounting: Accounting,
    totals: Vec<LoadTotals>,
    /// Per replica, with `assume_kv_reuse`: the prompt blocks active requests hold. The set is
    /// closed under prefixes (a sequence hash names its whole prefix, and every request books all
    /// its leading blocks), which lets [`LoadTable::active_prefix`] binary-search it.
    active_blocks: Vec<ActiveBlocks>,
    requests: HashMap<u64, Tracked>,
    release_anomalies: u64,
    untracked: u64,
    /// Prefill booked since the table was made, in the table's unit and in plain tokens: their
    /// ratio converts a report's plain tokens into the table's unit ([`LoadTable::work_per_token`]).
    booked_work: f64,
    booked_tokens: f64,
    /// Per replica, this table's requests still in prefill in the order they were admitted (id,
    /// admission ms; entries of requests that left out of order are dropped once they reach the
    /// front): the front is the head of [`LoadTable::prefill_heads`].
    in_prefill: Vec<VecDeque<(u64, u64)>>,
    /// Per replica, when the last request that left the front of `in_prefill` returned its first
    /// token (ms; 0: none yet).
    last_first_token_ms: Vec<u64>,
    /// Whether `in_prefill` is kept ([`LoadTable::with_prefill_heads`]): only a policy that reads
    /// the heads pays for them on every admission.
    track_heads: bool,
}

impl LoadTable {
    /// How this table books load.
    pub fn accounting(&self) -> &Accounting {
        &self.accounting
    }

    pub fn new(replicas: usize, block_size: usize, accounting: Accounting) -> Self {
        Self {
            block_size: block_size.max(1) as u64,
            accounting,
            totals: vec![LoadTotals::default(); replicas],
            active_blocks: vec![ActiveBlocks::default(); replicas],
            requests: HashMap::new(),
            release_anomalies: 0,
            untracked: 0,
            booked_work: 0.0,
            booked_tokens: 0.0,
            in_prefill: vec![VecDeque::new(); replicas],
            last_first_token_ms: vec![0; replicas],
            track_heads: false,
        }
    }

    /// This table, keeping each replica's requests in prefill in arrival order for
    /// [`LoadTable::prefill_heads`] (`kv_time.head_progress`); without it every head reads as none.
    pub fn with_prefill_heads(mut self) -> Self {
        self.track_heads = true;
        self
    }

    pub fn totals(&self) -> &[LoadTotals] {
        &self.totals
    }
    pub fn active(&self) -> usize {
        self.requests.len()
    }
    /// Releases or progress reports for requests this table does not know.
    pub fn release_anomalies(&self) -> u64 {
        self.release_anomalies
    }
    /// Admissions refused because [`MAX_TRACKED_REQUESTS`] were already tracked.
    pub fn untracked(&self) -> u64 {
        self.untracked
    }

    /// How many leading blocks of `blocks` are already booked on `replica` by active requests (0
    /// without `assume_kv_reuse`): routing the request there adds only the rest to its decode load.
    pub fn active_prefix(&self, replica: usize, blocks: &[u64]) -> usize {
        self.active_prefix_by(replica, blocks.len(), |i| blocks[i])
    }

    /// [`LoadTable::active_prefix`] for a request of `n` blocks whose `i`-th hash is `key(i)`, so the
    /// routing path need not copy the hashes.
    pub fn active_prefix_by(&self, replica: usize, n: usize, key: impl Fn(usize) -> u64) -> usize {
        let Some(set) = self.active_blocks.get(replica) else {
            return 0;
        };
        if set.is_empty() {
            return 0;
        }
        // Prefix-closed set: "block i is active" is true then false along the request, so the first
        // inactive block is found by binary search.
        let (mut lo, mut hi) = (0, n);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if set.contains(key(mid)) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Starts tracking a request routed to `replica` with `uncached_tokens` of `prompt_tokens` to
    /// prefill; `blocks` are its full-block hashes, read (and kept) only with `assume_kv_reuse`.
    /// Re-admitting a known id first releases the old one. Returns false for a bad replica.
    pub fn admit(
        &mut self,
        request_id: u64,
        replica: usize,
        prompt_tokens: u64,
        uncached_tokens: u64,
        expected_output: Option<u64>,
        blocks: impl IntoIterator<Item = u64>,
    ) -> bool {
        self.admit_at(
            request_id,
            replica,
            prompt_tokens,
            uncached_tokens,
            expected_output,
            blocks,
            0,
        )
    }

    /// [`LoadTable::admit`] stamped with the admission time `admitted_ms` (for [`LoadTable::since`]).
    #[allow(clippy::too_many_arguments)]
    pub fn admit_at(
        &mut self,
        request_id: u64,
        replica: usize,
        prompt_tokens: u64,
        uncached_tokens: u64,
        expected_output: Option<u64>,
        blocks: impl IntoIterator<Item = u64>,
        admitted_ms: u64,
    ) -> bool {
        if replica >= self.totals.len() {
            return false;
        }
        if self.requests.contains_key(&request_id) {
            self.release(request_id);
        } else if self.requests.len() >= MAX_TRACKED_REQUESTS {
            self.untracked += 1;
            return false;
        }
        let t = &mut self.totals[replica];
        let uncached = uncached_tokens.min(prompt_tokens);
        let prefill = match self.accounting.prefill_in_time {
            Some(a) => prefill_work(prompt_tokens, uncached, a),
            None => uncached,
        };
        t.prefill_tokens = t.prefill_tokens.saturating_add(prefill);
        t.active_requests = t.active_requests.saturating_add(1);
        self.booked_work += prefill as f64;
        self.booked_tokens += uncached as f64;
        let prompt_blocks = prompt_tokens.div_ceil(self.block_size);
        let shared = if self.accounting.assume_kv_reuse {
            // An approximate (text) identity may count more chunks than token blocks: never book more
            // shared blocks than the prompt has.
            blocks.into_iter().take(prompt_blocks as usize).collect()
        } else {
            Vec::new()
        };
        let mut r = Tracked {
            replica,
            prefill_tokens: prefill,
            report_prefill: uncached,
            prompt_blocks,
            shared,
            expected_output: expected_output.filter(|&e| e > 0),
            prompt_charged: false,
            decoding: false,
            generated: 0,
            charged_blocks: 0,
            admitted_ms,
        };
        if self.accounting.prompt_blocks_at_admission {
            let t = &mut self.totals[replica];
            Self::book_prompt(&mut self.active_blocks[replica], t, &mut r);
            Self::recharge(t, &mut r, self.block_size, self.accounting.use_output_hint);
        }
        self.requests.insert(request_id, r);
        if prefill > 0 && self.track_heads {
            let q = &mut self.in_prefill[replica];
            q.push_back((request_id, admitted_ms));
            // Entries that left out of order wait behind the head; a head that never leaves (a
            // completion the host lost) would keep them forever, so past twice what the table
            // tracks they are swept (amortised: the next sweep is that many pushes away).
            if q.len() > 2 * self.requests.len() + 1024 {
                let requests = &self.requests;
                q.retain(|&e| in_prefill(requests, replica, e).is_some());
            }
        }
        true
    }

    /// Books the request's shared prompt blocks on its replica through the replica's set (each
    /// counted once), once; its own blocks are booked by [`LoadTable::recharge`].
    fn book_prompt(set: &mut ActiveBlocks, t: &mut LoadTotals, r: &mut Tracked) {
        if r.prompt_charged {
            return;
        }
        r.prompt_charged = true;
        for &h in &r.shared {
            if set.book(h) {
                t.decode_blocks = t.decode_blocks.saturating_add(1);
            }
        }
        set.note_peak();
    }

    /// The first output token arrived: prefill load becomes decode load.
    pub fn first_token(&mut self, request_id: u64) {
        self.progress(request_id, None, None);
    }

    /// [`LoadTable::first_token`] at `now_ms`: where the request was the head of its replica's
    /// prefill queue, the next one starts now ([`LoadTable::prefill_heads`]).
    pub fn first_token_at(&mut self, request_id: u64, now_ms: u64) {
        self.progress(request_id, None, Some(now_ms));
    }

    /// A request on `replica` admitted at `admitted_ms` left prefill (its first token, at `now_ms`
    /// where known): where it was the head, the next one starts now; then the entries in front that
    /// are no longer in prefill are dropped, so the front is the head again.
    fn left_prefill(
        &mut self,
        request_id: u64,
        replica: usize,
        admitted_ms: u64,
        now_ms: Option<u64>,
    ) {
        let Some(q) = self.in_prefill.get_mut(replica) else {
            return;
        };
        if let Some(now) = now_ms
            && q.front() == Some(&(request_id, admitted_ms))
        {
            let last = &mut self.last_first_token_ms[replica];
            *last = (*last).max(now);
        }
        while let Some(&e) = q.front() {
            if in_prefill(&self.requests, replica, e).is_some() {
                break;
            }
            q.pop_front();
        }
    }

    /// Per replica: this table's view of the prefill in progress there (its oldest request still in
    /// prefill, and the last first token that ended a head), what a worker publishes to its peers.
    pub fn prefill_heads(&self) -> Vec<PrefillHead> {
        self.in_prefill
            .iter()
            .zip(&self.last_first_token_ms)
            .enumerate()
            .map(|(replica, (q, &last))| {
                let head = q.front().and_then(|&(id, admitted_ms)| {
                    in_prefill(&self.requests, replica, (id, admitted_ms))
                        .map(|r| (admitted_ms, r.prefill_tokens))
                });
                let (admitted_ms, work) = head.unwrap_or((PrefillHead::NONE, 0));
                PrefillHead {
                    last_first_token_ms: last,
                    admitted_ms,
                    work,
                }
            })
            .collect()
    }

    /// `generated` output tokens so far (cumulative). Implies the first token.
    pub fn decode_progress(&mut self, request_id: u64, generated: u64) {
        self.progress(request_id, Some(generated), None);
    }

    /// One lookup per stream event: the first call turns the request's prefill load into decode load
    /// (booking its prompt if that waited for the first token); `generated` moves its own blocks.
    /// `now_ms`, where known, is when the first token came (for [`LoadTable::prefill_heads`]).
    fn progress(&mut self, request_id: u64, generated: Option<u64>, now_ms: Option<u64>) {
        let Some(r) = self.requests.get_mut(&request_id) else {
            self.release_anomalies += 1;
            return;
        };
        let t = &mut self.totals[r.replica];
        let mut left = None;
        if !r.decoding {
            left = Some((r.replica, r.admitted_ms));
            r.decoding = true;
            r.generated = r.generated.max(1);
            t.prefill_tokens = t.prefill_tokens.saturating_sub(r.prefill_tokens);
            r.prefill_tokens = 0;
            r.report_prefill = 0;
            Self::book_prompt(&mut self.active_blocks[r.replica], t, r);
        } else if generated.is_none() {
            return;
        }
        if let Some(g) = generated {
            r.generated = g;
        }
        Self::recharge(t, r, self.block_size, self.accounting.use_output_hint);
        if let Some((replica, admitted_ms)) = left {
            self.left_prefill(request_id, replica, admitted_ms, now_ms);
        }
    }

    /// Re-books the request's own blocks: the prompt blocks not in the shared set (all of them without
    /// `assume_kv_reuse`) plus one block per `block_size` generated tokens, weighted by the output
    /// hint when enabled. Nothing before the prompt is charged.
    fn recharge(t: &mut LoadTotals, r: &mut Tracked, bs: u64, hint: bool) {
        if !r.prompt_charged {
            return;
        }
        let blocks = r.prompt_blocks - r.shared.len() as u64 + r.generated / bs;
        let charged = match (hint, r.expected_output) {
            (true, Some(expected)) => {
                let w = 1.0 - (r.generated as f64 / expected as f64).min(1.0);
                (blocks as f64 * w).ceil() as u64
            }
            _ => blocks,
        };
        t.decode_blocks = t
            .decode_blocks
            .saturating_sub(r.charged_blocks)
            .saturating_add(charged);
        r.charged_blocks = charged;
    }

    /// Forgets every booking on `replica` (a member that left the fleet: its slot may be given to
    /// another). A later release of one of them counts as an anomaly, as for any unknown request.
    /// Returns how many requests were dropped. O(tracked requests), which is fine for a membership
    /// change.
    pub fn drop_replica(&mut self, replica: usize) -> usize {
        let before = self.requests.len();
        self.requests.retain(|_, r| r.replica != replica);
        if let Some(t) = self.totals.get_mut(replica) {
            *t = LoadTotals::default();
        }
        if let Some(b) = self.active_blocks.get_mut(replica) {
            *b = ActiveBlocks::default();
        }
        if let Some(q) = self.in_prefill.get_mut(replica) {
            q.clear();
        }
        before - self.requests.len()
    }

    /// Completion or abort: removes everything the request contributes. False (and counted) when the
    /// request is unknown.
    pub fn release(&mut self, request_id: u64) -> bool {
        self.release_entry(request_id).is_some()
    }

    /// [`LoadTable::release`], returning what the request was (its output so far and its share in
    /// the report's units) from the one lookup that removes it.
    pub fn release_entry(&mut self, request_id: u64) -> Option<Released> {
        let Some(r) = self.requests.remove(&request_id) else {
            self.release_anomalies += 1;
            return None;
        };
        let released = Released {
            generated: r.generated,
            replica: r.replica,
            admitted_ms: r.admitted_ms,
            share: self.share_of(&r),
        };
        let t = &mut self.totals[r.replica];
        t.prefill_tokens = t.prefill_tokens.saturating_sub(r.prefill_tokens);
        t.decode_blocks = t.decode_blocks.saturating_sub(r.charged_blocks);
        t.active_requests = t.active_requests.saturating_sub(1);
        if r.prompt_charged {
            let set = &mut self.active_blocks[r.replica];
            for &h in &r.shared {
                if set.unbook(h) {
                    t.decode_blocks = t.decode_blocks.saturating_sub(1);
                }
            }
            set.tidy();
        }
        self.left_prefill(request_id, r.replica, r.admitted_ms, None);
        Some(released)
    }

    /// What this table's requests admitted at or after `marks[replica]` (ms) add to their replica, in
    /// the units a replica reports its own load (docs/reference/feed.md), for `reported_load` `merge`: their
    /// uncached prompt tokens still to compute, in plain tokens even where the table books prefill
    /// in time (zero once the first token came), their blocks counted whole,
    /// as the engine counts each sequence's blocks (prompt blocks plus one per `block_size` generated
    /// tokens, no sharing discount, no output-hint weight; booked from admission or from the first
    /// token as the [`Accounting`] says), and one active request each. A replica whose mark is
    /// `u64::MAX` (or missing) gets nothing. O(tracked requests).
    pub fn since(&self, marks: &[u64]) -> Vec<LoadTotals> {
        let mut out = vec![LoadTotals::default(); self.totals.len()];
        for r in self.requests.values() {
            let mark = marks.get(r.replica).copied().unwrap_or(u64::MAX);
            if r.admitted_ms >= mark {
                out[r.replica].add(&self.share_of(r));
            }
        }
        out
    }

    /// What this table's requests on `replica` admitted before `mark` (ms), and still tracked, add to
    /// it in the report's units (as [`LoadTable::since`] counts them): this table's part of a report
    /// produced by a poll sent at `mark` (`reported_load` `others`). O(tracked requests).
    pub fn held(&self, replica: usize, mark: u64) -> LoadTotals {
        let mut out = LoadTotals::default();
        for r in self.requests.values() {
            if r.replica == replica && r.admitted_ms < mark {
                out.add(&self.share_of(r));
            }
        }
        out
    }

    /// A tracked request's share of load in the units a replica reports (as [`LoadTable::since`]
    /// and [`LoadTable::held`] count it).
    fn share_of(&self, r: &Tracked) -> LoadTotals {
        let blocks = if r.prompt_charged {
            r.prompt_blocks + r.generated / self.block_size
        } else {
            0
        };
        LoadTotals {
            prefill_tokens: r.report_prefill,
            decode_blocks: blocks,
            active_requests: 1,
        }
    }

    /// The table's prefill unit per plain uncached token, over everything it has booked: 1 when
    /// prefill is booked in tokens, above 1 when it is booked in time (each token also attends to
    /// its context, [`prefill_work`]). A replica reports its queued prefill in plain tokens, which
    /// hides how long a long context's prefill takes; a report read beside this table's bookings
    /// is converted by this ratio, on the assumption that the other proxies' traffic is like this
    /// one's (`reported_load` `others` with several proxies in front of one fleet). 1 before any
    /// booking.
    pub fn work_per_token(&self) -> f64 {
        if self.booked_tokens > 0.0 {
            (self.booked_work / self.booked_tokens).max(1.0)
        } else {
            1.0
        }
    }

    /// Sum of this table and the given peer contributions, per replica.
    pub fn combined<'a>(&self, peers: impl Iterator<Item = &'a [LoadTotals]>) -> Vec<LoadTotals> {
        let mut out = self.totals.clone();
        for p in peers {
            LoadTotals::add_each(&mut out, p);
        }
        out
    }
}

/// The tracked request an `in_prefill` entry `(id, admitted_ms)` of `replica` stands for, while it
/// is still in prefill there (not answered, released, or re-admitted since).
fn in_prefill(
    requests: &HashMap<u64, Tracked>,
    replica: usize,
    (id, admitted_ms): (u64, u64),
) -> Option<&Tracked> {
    requests
        .get(&id)
        .filter(|r| r.replica == replica && r.admitted_ms == admitted_ms && !r.decoding)
}

#[cfg(test)]
mod tests;
