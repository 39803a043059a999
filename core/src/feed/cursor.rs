//! The router's side of the feed's sequencing: the query it sends (its epoch, cursor and limits)
//! and what it does with a decoded batch given where it stands with the replica.

use super::*;

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
