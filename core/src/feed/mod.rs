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
mod cursor;
mod frame;
pub mod log;

pub use adapters::{
    ADAPTERS_QUERY, AdapterReport, FLAG_ADAPTERS, MAX_ADAPTER_NAMES, query_adapters,
};
pub use cursor::{CursorVerdict, FeedCursor, FeedQuery};
pub use frame::{EventKind, FeedFrame, FeedSlice};
use frame::{EventReader, check};

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

#[cfg(test)]
mod tests;
