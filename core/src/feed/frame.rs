//! Reading a version 1 payload: its structure checked whole, without copying hashes out, then its
//! events read a slice at a time ([`FeedFrame`]), so a large answer can be applied across several
//! ticks; [`super::FeedBatch::decode`] reads one whole through the same checks.

use super::*;

/// A payload's header (events left empty), its event count, its hash count and its adapter section.
pub(super) struct Checked {
    pub(super) header: FeedBatch,
    pub(super) events: u32,
    pub(super) hashes: u64,
    pub(super) adapters: Option<AdapterReport>,
}

/// Checks a whole version 1 payload (header, every event's kind, tier and length, no trailing bytes)
/// without reading its hashes: O(events), whatever the payload's size.
pub(super) fn check(buf: &[u8]) -> Result<Checked, FeedError> {
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
pub(super) struct EventReader {
    pos: usize,
    events_left: u32,
    /// The event being read: its kind, tier and hashes not read yet.
    current: Option<(EventKind, Tier, usize)>,
}

impl EventReader {
    pub(super) fn new(events: u32) -> Self {
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
    pub(super) fn next(&mut self, buf: &[u8], max: usize, out: &mut Vec<u64>) -> Option<FeedSlice> {
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
