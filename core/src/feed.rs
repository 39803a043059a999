//! The replica feed: what a replica tells the router on each poll (docs/design/design.md section 5;
//! the wire format is specified in docs/reference/feed.md).
//!
//! The router polls `GET /kvsteer/feed?epoch=E&cursor=C&max_events=N` on every replica. The answer is a
//! compact little-endian binary batch ("KVSF" version 1): block identities travel as 8-byte sequence
//! hashes, never as token ids, so a 10K-token prompt costs 5 KB of feed at block size 16 instead of
//! tens of KB of token ids, and a wasm filter polling from a proxy decodes it with no allocation per hash
//! beyond the event's vector.
//!
//! Wire layout (all integers little-endian):
//! ```text
//! header (80 bytes)
//!   magic "KVSF" | version u8 = 1 | flags u8 | dp_rank u16 (was reserved, 0)
//!   epoch u64 | first_seq u64 | next_seq u64
//!   load: running u32 | waiting u32 | prefill_tokens u64 | decode_blocks u64
//!         kv_used_blocks u64 | kv_total_blocks u64 | block_size u32
//!   event_count u32
//! event_count events
//!   kind u8 (1 stored, 2 removed, 3 cleared) | tier u8 (0 gpu, 1 host, 2 disk) | count u32
//!   count x u64 sequence hashes (count is 0 for cleared)
//! ```
//! Flags: bit 0 `RESYNC` (the events are a snapshot of the whole cache, starting with `Cleared`; the
//! router must drop what it holds for this replica first), bit 1 `MORE` (more log entries are waiting
//! past `next_seq`; poll again), bit 2 `ADAPTERS` (an adapter section follows the events, sent only to
//! a router that asks for it: [`AdapterReport`]). Other bits must be zero in version 1.
//!
//! Sequencing: each log event has the sequence number `first_seq + i`; `next_seq` is the cursor for the
//! next poll. In an incremental batch `next_seq == first_seq + event_count`. The replica answers with a
//! resync whenever the router's epoch differs from its own (engine restart, or the router's first poll
//! with epoch 0) or the cursor is outside the log it still retains; in a resync batch `first_seq ==
//! next_seq` because the snapshot is not log entries. The router treats a batch whose `first_seq` is not
//! its cursor as a gap and asks for a resync (epoch 0) on the next poll.

mod adapters;
pub use adapters::{
    ADAPTERS_QUERY, AdapterReport, FLAG_ADAPTERS, MAX_ADAPTER_NAMES, query_adapters,
};

/// Path of the feed endpoint on a replica.
pub const FEED_PATH: &str = "/kvsteer/feed";
pub const FEED_MAGIC: [u8; 4] = *b"KVSF";
pub const FEED_VERSION: u8 = 1;
pub const FLAG_RESYNC: u8 = 1;
pub const FLAG_MORE: u8 = 2;
/// Header length in bytes.
pub const HEADER_LEN: usize = 80;
/// Content type replicas answer with.
pub const FEED_CONTENT_TYPE: &str = "application/x-kvsteer-feed";
/// Default cap on log events per batch.
pub const DEFAULT_MAX_EVENTS: u32 = 4096;

/// Where a replica holds a block. Engines that offload KV keep blocks in host memory or on disk; a hit
/// there is cheaper than recomputing but dearer than a GPU hit.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Tier {
    Gpu = 0,
    Host = 1,
    Disk = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Host, Tier::Disk];

    pub fn from_u8(v: u8) -> Option<Tier> {
        match v {
            0 => Some(Tier::Gpu),
            1 => Some(Tier::Host),
            2 => Some(Tier::Disk),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Gpu => "gpu",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

/// Load as the replica itself reports it.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplicaLoad {
    /// Sequences in the running batch.
    pub running: u32,
    /// Requests queued, not yet scheduled.
    pub waiting: u32,
    /// Prompt tokens admitted but not yet computed (running and waiting).
    pub prefill_tokens: u64,
    /// KV blocks held by sequences that are decoding.
    pub decode_blocks: u64,
    /// GPU KV blocks in use (referenced or cached).
    pub kv_used_blocks: u64,
    /// GPU KV blocks in all.
    pub kv_total_blocks: u64,
    /// The engine's block size in tokens.
    pub block_size: u32,
}

/// One change to a replica's cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FeedEvent {
    Stored { tier: Tier, hashes: Vec<u64> },
    Removed { tier: Tier, hashes: Vec<u64> },
    Cleared,
}

/// One poll's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedBatch {
    pub epoch: u64,
    pub resync: bool,
    pub more: bool,
    pub first_seq: u64,
    pub next_seq: u64,
    pub load: ReplicaLoad,
    pub events: Vec<FeedEvent>,
}

/// Why a feed payload was refused. Every byte from a replica is treated as hostile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FeedError {
    TooShort {
        len: usize,
    },
    BadMagic,
    UnsupportedVersion(u8),
    UnknownFlags(u8),
    BadEventKind {
        index: u32,
        kind: u8,
    },
    BadTier {
        index: u32,
        tier: u8,
    },
    Truncated {
        index: u32,
    },
    TrailingBytes {
        extra: usize,
    },
    /// `next_seq` disagrees with `first_seq + event_count` in an incremental batch.
    InconsistentSequence,
    /// The adapter section ([`AdapterReport`]) is malformed; what is wrong with it.
    BadAdapters(&'static str),
}

impl core::fmt::Display for FeedError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            FeedError::TooShort { len } => write!(f, "feed payload too short ({len} bytes)"),
            FeedError::BadMagic => write!(f, "feed payload does not start with KVSF"),
            FeedError::UnsupportedVersion(v) => write!(f, "unsupported feed version {v}"),
            FeedError::UnknownFlags(v) => write!(f, "unknown feed flags {v:#x}"),
            FeedError::BadEventKind { index, kind } => {
                write!(f, "event {index}: unknown kind {kind}")
            }
            FeedError::BadTier { index, tier } => write!(f, "event {index}: unknown tier {tier}"),
            FeedError::Truncated { index } => write!(f, "event {index}: payload truncated"),
            FeedError::TrailingBytes { extra } => write!(f, "{extra} bytes after the last event"),
            FeedError::InconsistentSequence => {
                write!(f, "next_seq does not equal first_seq + event count")
            }
            FeedError::BadAdapters(what) => write!(f, "adapter section: {what}"),
        }
    }
}

impl FeedBatch {
    /// A resync snapshot: everything the replica held is cleared, then `gpu_hashes` are held on the
    /// GPU tier (no load report, cursor 0).
    pub fn snapshot(epoch: u64, gpu_hashes: Vec<u64>) -> FeedBatch {
        FeedBatch {
            epoch,
            resync: true,
            more: false,
            first_seq: 0,
            next_seq: 0,
            load: ReplicaLoad::default(),
            events: vec![
                FeedEvent::Cleared,
                FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes: gpu_hashes,
                },
            ],
        }
    }

    /// Encodes the batch in the version 1 wire format.
    pub fn encode(&self) -> Vec<u8> {
        let hashes: usize = self
            .events
            .iter()
            .map(|e| match e {
                FeedEvent::Stored { hashes, .. } | FeedEvent::Removed { hashes, .. } => {
                    hashes.len()
                }
                FeedEvent::Cleared => 0,
            })
            .sum();
        let mut out = Vec::with_capacity(HEADER_LEN + self.events.len() * 6 + hashes * 8);
        out.extend_from_slice(&FEED_MAGIC);
        out.push(FEED_VERSION);
        let mut flags = 0;
        if self.resync {
            flags |= FLAG_RESYNC;
        }
        if self.more {
            flags |= FLAG_MORE;
        }
        out.push(flags);
        out.extend_from_slice(&0u16.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.first_seq.to_le_bytes());
        out.extend_from_slice(&self.next_seq.to_le_bytes());
        let l = &self.load;
        out.extend_from_slice(&l.running.to_le_bytes());
        out.extend_from_slice(&l.waiting.to_le_bytes());
        out.extend_from_slice(&l.prefill_tokens.to_le_bytes());
        out.extend_from_slice(&l.decode_blocks.to_le_bytes());
        out.extend_from_slice(&l.kv_used_blocks.to_le_bytes());
        out.extend_from_slice(&l.kv_total_blocks.to_le_bytes());
        out.extend_from_slice(&l.block_size.to_le_bytes());
        out.extend_from_slice(&(self.events.len() as u32).to_le_bytes());
        debug_assert_eq!(out.len(), HEADER_LEN);
        for e in &self.events {
            let (kind, tier, hashes): (u8, Tier, &[u64]) = match e {
                FeedEvent::Stored { tier, hashes } => (1, *tier, hashes),
                FeedEvent::Removed { tier, hashes } => (2, *tier, hashes),
                FeedEvent::Cleared => (3, Tier::Gpu, &[]),
            };
            out.push(kind);
            out.push(tier as u8);
            out.extend_from_slice(&(hashes.len() as u32).to_le_bytes());
            for h in hashes {
                out.extend_from_slice(&h.to_le_bytes());
            }
        }
        out
    }

    /// [`FeedBatch::encode`] with the data-parallel rank the batch describes in header bytes 6-7
    /// (version 1 called them reserved and wrote 0, which is rank 0: a decoder that ignores them, as
    /// every version 1 decoder does, reads the same batch). docs/reference/feed.md, "Data-parallel
    /// ranks".
    pub fn encode_for_rank(&self, rank: u16) -> Vec<u8> {
        let mut out = self.encode();
        out[6..8].copy_from_slice(&rank.to_le_bytes());
        out
    }

    /// Decodes a version 1 payload, refusing anything malformed without panicking.
    pub fn decode(buf: &[u8]) -> Result<FeedBatch, FeedError> {
        let checked = check(buf)?;
        let mut batch = checked.header;
        // Checked: every event is whole, so reading cannot fail. Each event is at least 6 bytes: never
        // reserve more than the payload could hold.
        batch.events = Vec::with_capacity((checked.events as usize).min(buf.len() / 6));
        let mut reader = EventReader::new(checked.events);
        let mut hashes = Vec::new();
        while let Some(FeedSlice { kind, tier, .. }) = reader.next(buf, usize::MAX, &mut hashes) {
            batch.events.push(match kind {
                EventKind::Stored => FeedEvent::Stored {
                    tier,
                    hashes: std::mem::take(&mut hashes),
                },
                EventKind::Removed => FeedEvent::Removed {
                    tier,
                    hashes: std::mem::take(&mut hashes),
                },
                EventKind::Cleared => FeedEvent::Cleared,
            });
        }
        Ok(batch)
    }
}

/// The data-parallel rank a payload says it describes (header bytes 6-7; 0 from a replica without
/// ranks). `None` for a payload too short to have a header: [`FeedBatch::decode`] refuses it anyway.
pub fn payload_rank(buf: &[u8]) -> Option<u16> {
    let b = buf.get(6..8)?;
    Some(u16::from_le_bytes([b[0], b[1]]))
}

/// The `rank` parameter of a feed query string: `Ok(None)` when absent (the endpoint's one engine,
/// or for a replica serving several ranks, whatever it serves to a rank-blind router), an error naming
/// the value when it is not a rank (an unsigned integer below 65536).
pub fn query_rank(query: &str) -> Result<Option<u16>, String> {
    let mut rank = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if k == "rank" {
            rank = Some(
                v.parse::<u16>()
                    .map_err(|_| format!("feed query: bad value for rank: {v:?}"))?,
            );
        }
    }
    Ok(rank)
}

/// A payload's header (events left empty), its event count, its hash count and its adapter section.
struct Checked {
    header: FeedBatch,
    events: u32,
    hashes: u64,
    adapters: Option<AdapterReport>,
}

/// Checks a whole version 1 payload (header, every event's kind, tier and length, no trailing bytes)
/// without reading its hashes: O(events), whatever the payload's size.
fn check(buf: &[u8]) -> Result<Checked, FeedError> {
    if buf.len() < HEADER_LEN {
        return Err(FeedError::TooShort { len: buf.len() });
    }
    if buf[..4] != FEED_MAGIC {
        return Err(FeedError::BadMagic);
    }
    if buf[4] != FEED_VERSION {
        return Err(FeedError::UnsupportedVersion(buf[4]));
    }
    let flags = buf[5];
    if flags & !(FLAG_RESYNC | FLAG_MORE | FLAG_ADAPTERS) != 0 {
        return Err(FeedError::UnknownFlags(flags));
    }
    let mut r = Reader { buf, pos: 8 };
    let epoch = r.u64().ok_or(FeedError::TooShort { len: buf.len() })?;
    let first_seq = r.u64().unwrap_or_default();
    let next_seq = r.u64().unwrap_or_default();
    let load = ReplicaLoad {
        running: r.u32().unwrap_or_default(),
        waiting: r.u32().unwrap_or_default(),
        prefill_tokens: r.u64().unwrap_or_default(),
        decode_blocks: r.u64().unwrap_or_default(),
        kv_used_blocks: r.u64().unwrap_or_default(),
        kv_total_blocks: r.u64().unwrap_or_default(),
        block_size: r.u32().unwrap_or_default(),
    };
    let count = r.u32().unwrap_or_default();
    let resync = flags & FLAG_RESYNC != 0;
    if !resync && first_seq.checked_add(count as u64) != Some(next_seq) {
        return Err(FeedError::InconsistentSequence);
    }
    let hashes = check_events(&mut r, count)?;
    let adapters = if flags & FLAG_ADAPTERS != 0 {
        Some(AdapterReport::decode(&buf[r.pos..])?)
    } else if r.remaining() != 0 {
        return Err(FeedError::TrailingBytes {
            extra: r.remaining(),
        });
    } else {
        None
    };
    Ok(Checked {
        adapters,
        header: FeedBatch {
            epoch,
            resync,
            more: flags & FLAG_MORE != 0,
            first_seq,
            next_seq,
            load,
            events: Vec::new(),
        },
        events: count,
        hashes,
    })
}

/// Checks `count` events from the reader's position on (each one's kind, tier and length, its hashes
/// skipped, not read) and returns how many hashes they hold.
fn check_events(r: &mut Reader<'_>, count: u32) -> Result<u64, FeedError> {
    let mut hashes = 0u64;
    for index in 0..count {
        let kind = r.u8().ok_or(FeedError::Truncated { index })?;
        let tier_raw = r.u8().ok_or(FeedError::Truncated { index })?;
        let n = r.u32().ok_or(FeedError::Truncated { index })? as usize;
        if kind == 3 {
            if n != 0 {
                return Err(FeedError::Truncated { index });
            }
            continue;
        }
        if kind != 1 && kind != 2 {
            return Err(FeedError::BadEventKind { index, kind });
        }
        if Tier::from_u8(tier_raw).is_none() {
            return Err(FeedError::BadTier {
                index,
                tier: tier_raw,
            });
        }
        if n > r.remaining() / 8 {
            return Err(FeedError::Truncated { index });
        }
        r.pos += n * 8;
        hashes += n as u64;
    }
    Ok(hashes)
}

/// What a slice of an event does.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum EventKind {
    Stored,
    Removed,
    Cleared,
}

/// One slice of a feed event read from a [`FeedFrame`]; its hashes are handed over beside it.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FeedSlice {
    pub kind: EventKind,
    pub tier: Tier,
    /// The first slice of its event.
    pub starts_event: bool,
}

/// Reads the events of a checked payload a slice at a time.
#[derive(Clone, Debug)]
struct EventReader {
    pos: usize,
    events_left: u32,
    /// The event being read: its kind, tier and hashes not read yet.
    current: Option<(EventKind, Tier, usize)>,
}

impl EventReader {
    fn new(events: u32) -> Self {
        EventReader {
            pos: HEADER_LEN,
            events_left: events,
            current: None,
        }
    }

    fn done(&self) -> bool {
        self.current.is_none() && self.events_left == 0
    }

    /// Starts the next event: its kind, tier and hash count. `None` past the last (or on bytes that
    /// were not checked, which cannot happen for a checked payload).
    fn start_event(&mut self, buf: &[u8]) -> Option<(EventKind, Tier, usize)> {
        if self.events_left == 0 {
            return None;
        }
        let head = buf.get(self.pos..self.pos.checked_add(6)?)?;
        let n = u32::from_le_bytes(head[2..6].try_into().ok()?) as usize;
        let kind = match head[0] {
            1 => EventKind::Stored,
            2 => EventKind::Removed,
            3 => EventKind::Cleared,
            _ => return None,
        };
        let tier = if kind == EventKind::Cleared {
            Tier::Gpu
        } else {
            Tier::from_u8(head[1])?
        };
        self.pos += 6;
        self.events_left -= 1;
        Some((kind, tier, if kind == EventKind::Cleared { 0 } else { n }))
    }

    /// The next slice: the current event's kind and tier, with at most `max` (at least 1) of its hashes
    /// in `out` (cleared first). An event is returned whole when it has no more than `max` hashes.
    fn next(&mut self, buf: &[u8], max: usize, out: &mut Vec<u64>) -> Option<FeedSlice> {
        out.clear();
        let starts_event = self.current.is_none();
        let (kind, tier, left) = match self.current.take() {
            Some(c) => c,
            None => self.start_event(buf)?,
        };
        let take = left.min(max.max(1));
        let bytes = buf.get(self.pos..self.pos.checked_add(take.checked_mul(8)?)?)?;
        out.reserve(take);
        out.extend(
            bytes
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())),
        );
        self.pos += take * 8;
        if left > take {
            self.current = Some((kind, tier, left - take));
        }
        Some(FeedSlice {
            kind,
            tier,
            starts_event,
        })
    }

    /// Skips the next `n` events (or what is left of the current one, which counts as one); returns
    /// the hashes skipped.
    fn skip(&mut self, buf: &[u8], n: u64) -> u64 {
        let mut skipped = 0u64;
        for _ in 0..n {
            let left = match self.current.take() {
                Some((_, _, left)) => left,
                None => match self.start_event(buf) {
                    Some((_, _, left)) => left,
                    None => break,
                },
            };
            self.pos = self.pos.saturating_add(left.saturating_mul(8));
            skipped += left as u64;
        }
        skipped
    }
}

/// A feed answer whose structure was checked whole (header, every event's kind, tier and length, no
/// trailing bytes) without copying its hashes out, read afterwards a slice at a time: the filter
/// applies a large answer across several ticks instead of stalling requests behind it. Checking is
/// O(events); reading is O(hashes read).
#[derive(Clone, Debug)]
pub struct FeedFrame {
    bytes: Vec<u8>,
    adapters: Option<AdapterReport>,
    header: FeedBatch,
    events: u32,
    hashes_left: u64,
    reader: EventReader,
}

impl FeedFrame {
    /// Checks a payload, refusing it with the error [`FeedBatch::decode`] would give.
    pub fn parse(bytes: Vec<u8>) -> Result<FeedFrame, FeedError> {
        let c = check(&bytes)?;
        Ok(FeedFrame {
            adapters: c.adapters,
            bytes,
            header: c.header,
            events: c.events,
            hashes_left: c.hashes,
            reader: EventReader::new(c.events),
        })
    }

    /// The payload as received.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The batch's header fields (epoch, flags, sequence numbers, load); its `events` are empty.
    pub fn header(&self) -> &FeedBatch {
        &self.header
    }

    /// The replica's adapter section; `None` when it sent none (its adapters are not known).
    pub fn adapters(&self) -> Option<&AdapterReport> {
        self.adapters.as_ref()
    }

    /// Events in the payload.
    pub fn events(&self) -> u32 {
        self.events
    }

    /// Hashes not read yet.
    pub fn hashes_left(&self) -> u64 {
        self.hashes_left
    }

    /// Whether every event has been read.
    pub fn is_done(&self) -> bool {
        self.reader.done()
    }

    /// The next slice of events: the kind and tier of the current event, with at most `max_hashes`
    /// (at least 1) of its hashes in `out`. `None` when every event has been read.
    pub fn next_slice(&mut self, max_hashes: usize, out: &mut Vec<u64>) -> Option<FeedSlice> {
        let r = self.reader.next(&self.bytes, max_hashes, out);
        self.hashes_left = self.hashes_left.saturating_sub(out.len() as u64);
        r
    }

    /// Cuts the events a router at `q` already applied from the front of an incremental batch of
    /// its epoch (a relayed batch that overlaps what a follower applied), before any is read. `false`
    /// for a batch that ends before the cursor (nothing new, older than what was applied). A batch
    /// that ends exactly at the cursor becomes an empty continuation (alive, with current load).
    /// Snapshots and batches of another epoch or not overlapping the cursor are left whole.
    pub fn trim_to_cursor(&mut self, q: &FeedQuery) -> bool {
        let h = &mut self.header;
        if h.resync || q.epoch == 0 || h.epoch != q.epoch {
            return true;
        }
        if h.next_seq < q.cursor {
            return false;
        }
        if h.first_seq < q.cursor {
            let skip = q.cursor - h.first_seq;
            h.first_seq = q.cursor;
            let skipped = self.reader.skip(&self.bytes, skip);
            self.hashes_left = self.hashes_left.saturating_sub(skipped);
        }
        true
    }

    /// Reads what is left into a batch (tests; small batches).
    pub fn into_batch(mut self) -> FeedBatch {
        let mut out = Vec::new();
        let mut batch = self.header.clone();
        while let Some(FeedSlice { kind, tier, .. }) = self.next_slice(usize::MAX, &mut out) {
            batch.events.push(match kind {
                EventKind::Stored => FeedEvent::Stored {
                    tier,
                    hashes: std::mem::take(&mut out),
                },
                EventKind::Removed => FeedEvent::Removed {
                    tier,
                    hashes: std::mem::take(&mut out),
                },
                EventKind::Cleared => FeedEvent::Cleared,
            });
        }
        batch
    }
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let s = self.buf.get(self.pos..self.pos.checked_add(N)?)?;
        self.pos += N;
        s.try_into().ok()
    }
    fn u8(&mut self) -> Option<u8> {
        self.take::<1>().map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take::<4>().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take::<8>().map(u64::from_le_bytes)
    }
}

/// The query a router sends: its view of the replica's epoch and log position.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct FeedQuery {
    /// The epoch the router last saw; 0 asks for a resync.
    pub epoch: u64,
    /// The `next_seq` of the router's last applied batch.
    pub cursor: u64,
    pub max_events: u32,
}

impl FeedQuery {
    /// A query that asks for a full snapshot.
    pub fn resync(max_events: u32) -> Self {
        Self {
            epoch: 0,
            cursor: 0,
            max_events,
        }
    }

    /// The request path, e.g. `/kvsteer/feed?epoch=7&cursor=120&max_events=4096&adapters=1`. It
    /// always asks for the adapter section: a replica that has none ignores the parameter.
    pub fn to_path(&self) -> String {
        format!(
            "{FEED_PATH}?epoch={}&cursor={}&max_events={}&{ADAPTERS_QUERY}",
            self.epoch, self.cursor, self.max_events
        )
    }

    /// Parses the query string part (after `?`). Missing fields ask for a resync with default limits;
    /// a malformed value is an error naming the field.
    pub fn parse(query: &str) -> Result<Self, String> {
        let mut q = FeedQuery::resync(DEFAULT_MAX_EVENTS);
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let bad = || format!("feed query: bad value for {k}: {v:?}");
            match k {
                "epoch" => q.epoch = v.parse().map_err(|_| bad())?,
                "cursor" => q.cursor = v.parse().map_err(|_| bad())?,
                "max_events" => q.max_events = v.parse().map_err(|_| bad())?,
                _ => {}
            }
        }
        if q.max_events == 0 {
            q.max_events = DEFAULT_MAX_EVENTS;
        }
        Ok(q)
    }
}

/// What the router should do with a decoded batch, given where it stands with this replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CursorVerdict {
    /// Apply the events on top of what is indexed.
    Apply,
    /// Drop this replica's blocks, then apply the snapshot.
    ResetThenApply,
    /// The batch does not continue the router's log position (a gap, or an epoch change without a
    /// snapshot): discard it and ask for a resync.
    Gap,
}

/// The router's position in one replica's feed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FeedCursor {
    /// 0 until the first snapshot is applied.
    pub epoch: u64,
    pub next_seq: u64,
    /// Set when the next poll must ask for a snapshot.
    pub want_resync: bool,
}

impl FeedCursor {
    /// The query for the next poll.
    pub fn query(&self, max_events: u32) -> FeedQuery {
        if self.epoch == 0 || self.want_resync {
            FeedQuery::resync(max_events)
        } else {
            FeedQuery {
                epoch: self.epoch,
                cursor: self.next_seq,
                max_events,
            }
        }
    }

    /// Judges a batch and advances the cursor when it is usable.
    pub fn accept(&mut self, batch: &FeedBatch) -> CursorVerdict {
        if batch.resync {
            self.epoch = batch.epoch;
            self.next_seq = batch.next_seq;
            self.want_resync = false;
            return CursorVerdict::ResetThenApply;
        }
        if self.want_resync
            || self.epoch == 0
            || batch.epoch != self.epoch
            || batch.first_seq != self.next_seq
        {
            self.want_resync = true;
            return CursorVerdict::Gap;
        }
        self.next_seq = batch.next_seq;
        CursorVerdict::Apply
    }
}

#[cfg(test)]
mod tests;
