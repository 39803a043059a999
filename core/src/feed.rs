//! The replica feed: what a replica tells the router on each poll (docs/design.md section 5; the
//! wire format is specified in docs/feed.md).
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
//!   magic "KVSF" | version u8 = 1 | flags u8 | reserved u16 = 0
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
//! past `next_seq`; poll again). Other bits must be zero in version 1.
//!
//! Sequencing: each log event has the sequence number `first_seq + i`; `next_seq` is the cursor for the
//! next poll. In an incremental batch `next_seq == first_seq + event_count`. The replica answers with a
//! resync whenever the router's epoch differs from its own (engine restart, or the router's first poll
//! with epoch 0) or the cursor is outside the log it still retains; in a resync batch `first_seq ==
//! next_seq` because the snapshot is not log entries. The router treats a batch whose `first_seq` is not
//! its cursor as a gap and asks for a resync (epoch 0) on the next poll.

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
        }
    }
}

impl FeedBatch {
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

    /// Decodes a version 1 payload, refusing anything malformed without panicking.
    pub fn decode(buf: &[u8]) -> Result<FeedBatch, FeedError> {
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
        if flags & !(FLAG_RESYNC | FLAG_MORE) != 0 {
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
        // Each event is at least 6 bytes: never reserve more than the payload could hold.
        let max_events = (buf.len() - HEADER_LEN) / 6;
        let mut events = Vec::with_capacity((count as usize).min(max_events));
        for index in 0..count {
            let kind = r.u8().ok_or(FeedError::Truncated { index })?;
            let tier_raw = r.u8().ok_or(FeedError::Truncated { index })?;
            let n = r.u32().ok_or(FeedError::Truncated { index })? as usize;
            if kind == 3 {
                if n != 0 {
                    return Err(FeedError::Truncated { index });
                }
                events.push(FeedEvent::Cleared);
                continue;
            }
            if kind != 1 && kind != 2 {
                return Err(FeedError::BadEventKind { index, kind });
            }
            let tier = Tier::from_u8(tier_raw).ok_or(FeedError::BadTier {
                index,
                tier: tier_raw,
            })?;
            if n > r.remaining() / 8 {
                return Err(FeedError::Truncated { index });
            }
            let mut hashes = Vec::with_capacity(n);
            for _ in 0..n {
                hashes.push(r.u64().ok_or(FeedError::Truncated { index })?);
            }
            events.push(if kind == 1 {
                FeedEvent::Stored { tier, hashes }
            } else {
                FeedEvent::Removed { tier, hashes }
            });
        }
        if r.remaining() != 0 {
            return Err(FeedError::TrailingBytes {
                extra: r.remaining(),
            });
        }
        Ok(FeedBatch {
            epoch,
            resync,
            more: flags & FLAG_MORE != 0,
            first_seq,
            next_seq,
            load,
            events,
        })
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

    /// The request path, e.g. `/kvsteer/feed?epoch=7&cursor=120&max_events=4096`.
    pub fn to_path(&self) -> String {
        format!(
            "{FEED_PATH}?epoch={}&cursor={}&max_events={}",
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
mod tests {
    use super::*;

    fn sample() -> FeedBatch {
        FeedBatch {
            epoch: 42,
            resync: false,
            more: true,
            first_seq: 10,
            next_seq: 13,
            load: ReplicaLoad {
                running: 3,
                waiting: 1,
                prefill_tokens: 5000,
                decode_blocks: 700,
                kv_used_blocks: 900,
                kv_total_blocks: 10_000,
                block_size: 16,
            },
            events: vec![
                FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes: vec![1, 2, u64::MAX],
                },
                FeedEvent::Removed {
                    tier: Tier::Host,
                    hashes: vec![2],
                },
                FeedEvent::Cleared,
            ],
        }
    }

    #[test]
    fn round_trip() {
        let b = sample();
        let bytes = b.encode();
        assert_eq!(bytes.len(), HEADER_LEN + 3 * 6 + 4 * 8);
        assert_eq!(FeedBatch::decode(&bytes).unwrap(), b);
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let bytes = sample().encode();
        for cut in 0..bytes.len() {
            assert!(FeedBatch::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn hostile_counts_are_refused() {
        let mut bytes = sample().encode();
        // event_count claims 4 billion events.
        bytes[76..80].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(FeedBatch::decode(&bytes).is_err());
        let mut bytes = sample().encode();
        // first event claims 4 billion hashes.
        bytes[HEADER_LEN + 2..HEADER_LEN + 6].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            FeedBatch::decode(&bytes),
            Err(FeedError::Truncated { index: 0 })
        ));
    }

    #[test]
    fn bad_fields_are_named() {
        let mut b = sample().encode();
        b[0] = b'X';
        assert_eq!(FeedBatch::decode(&b), Err(FeedError::BadMagic));
        let mut b = sample().encode();
        b[4] = 2;
        assert_eq!(FeedBatch::decode(&b), Err(FeedError::UnsupportedVersion(2)));
        let mut b = sample().encode();
        b[5] = 0x80;
        assert_eq!(FeedBatch::decode(&b), Err(FeedError::UnknownFlags(0x80)));
        let mut b = sample().encode();
        b[HEADER_LEN + 1] = 9;
        assert_eq!(
            FeedBatch::decode(&b),
            Err(FeedError::BadTier { index: 0, tier: 9 })
        );
        let mut b = sample().encode();
        b[HEADER_LEN] = 7;
        assert_eq!(
            FeedBatch::decode(&b),
            Err(FeedError::BadEventKind { index: 0, kind: 7 })
        );
        let mut b = sample().encode();
        b.push(0);
        assert_eq!(
            FeedBatch::decode(&b),
            Err(FeedError::TrailingBytes { extra: 1 })
        );
        let mut s = sample();
        s.next_seq = 99;
        assert_eq!(
            FeedBatch::decode(&s.encode()),
            Err(FeedError::InconsistentSequence)
        );
    }

    #[test]
    fn query_round_trip_and_errors() {
        let q = FeedQuery {
            epoch: 5,
            cursor: 77,
            max_events: 100,
        };
        let path = q.to_path();
        let (p, qs) = path.split_once('?').unwrap();
        assert_eq!(p, FEED_PATH);
        assert_eq!(FeedQuery::parse(qs).unwrap(), q);
        assert_eq!(
            FeedQuery::parse("").unwrap(),
            FeedQuery::resync(DEFAULT_MAX_EVENTS)
        );
        let err = FeedQuery::parse("epoch=x").unwrap_err();
        assert!(err.contains("epoch"), "{err}");
    }

    #[test]
    fn cursor_detects_gaps_and_epoch_changes() {
        let mut c = FeedCursor::default();
        assert_eq!(c.query(10).epoch, 0);
        let mut snap = sample();
        snap.resync = true;
        snap.first_seq = 10;
        snap.next_seq = 10;
        assert_eq!(c.accept(&snap), CursorVerdict::ResetThenApply);
        assert_eq!(
            c.query(10),
            FeedQuery {
                epoch: 42,
                cursor: 10,
                max_events: 10
            }
        );
        assert_eq!(c.accept(&sample()), CursorVerdict::Apply);
        assert_eq!(c.next_seq, 13);
        // Same batch again: its first_seq no longer matches the cursor.
        assert_eq!(c.accept(&sample()), CursorVerdict::Gap);
        assert!(c.query(10).epoch == 0, "a gap asks for a resync");
        // A new epoch without a snapshot is also a gap.
        let mut c2 = FeedCursor {
            epoch: 42,
            next_seq: 10,
            want_resync: false,
        };
        let mut other = sample();
        other.epoch = 43;
        assert_eq!(c2.accept(&other), CursorVerdict::Gap);
    }
}
