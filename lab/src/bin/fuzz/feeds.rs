//! The feed inputs: answers to the filter's own feed polls, valid batches for its query mutated at
//! the byte level and in their header fields, with odd statuses, content types and lengths.

use crate::requests::{header_bytes, mutate};
use crate::{FEED_MAX_BYTES, FEED_MAX_EVENTS, Rng};
use kvsteer_core::feed::{
    FEED_CONTENT_TYPE, FeedBatch, FeedEvent, FeedQuery, HEADER_LEN, ReplicaLoad, Tier,
};
use kvsteer_host_test::{CallOutcome, Callout};

pub(crate) fn odd_u64(rng: &mut Rng) -> u64 {
    match rng.below(8) {
        0 => 0,
        1 => u64::MAX,
        2 => u32::MAX as u64,
        3 => 1 << 63,
        _ => rng.below(10_000) as u64,
    }
}

pub(crate) fn feed_batch(rng: &mut Rng, q: &FeedQuery, epoch: u64) -> FeedBatch {
    let resync = q.epoch != epoch || rng.chance(20);
    let mut events = Vec::new();
    let hashes = |rng: &mut Rng| -> Vec<u64> {
        let n = match rng.below(20) {
            0 if rng.chance(20) => rng.below(20_000),
            0..=4 => rng.below(1000),
            _ => rng.below(40),
        };
        (0..n)
            .map(|_| {
                if rng.chance(90) {
                    rng.below(5000) as u64 + 1
                } else {
                    rng.next()
                }
            })
            .collect()
    };
    if resync {
        events.push(FeedEvent::Cleared);
    }
    for _ in 0..rng.below(6) {
        let tier = *rng.pick(&Tier::ALL);
        events.push(match rng.below(5) {
            0..=2 => FeedEvent::Stored {
                tier,
                hashes: hashes(rng),
            },
            3 => FeedEvent::Removed {
                tier,
                hashes: hashes(rng),
            },
            _ => FeedEvent::Cleared,
        });
    }
    let first_seq = if resync {
        rng.below(100) as u64
    } else if rng.chance(90) {
        q.cursor
    } else {
        odd_u64(rng)
    };
    let next_seq = if resync {
        first_seq
    } else {
        first_seq.wrapping_add(events.len() as u64)
    };
    let load = if rng.chance(70) {
        ReplicaLoad {
            running: rng.below(64) as u32,
            waiting: rng.below(64) as u32,
            prefill_tokens: rng.below(100_000) as u64,
            decode_blocks: rng.below(4096) as u64,
            kv_used_blocks: rng.below(4096) as u64,
            kv_total_blocks: 4096,
            block_size: 16,
        }
    } else {
        ReplicaLoad {
            running: odd_u64(rng) as u32,
            waiting: odd_u64(rng) as u32,
            prefill_tokens: odd_u64(rng),
            decode_blocks: odd_u64(rng),
            kv_used_blocks: odd_u64(rng),
            kv_total_blocks: odd_u64(rng),
            block_size: *rng.pick(&[0, 1, 16, 17, 32, u32::MAX]),
        }
    };
    FeedBatch {
        epoch: if rng.chance(95) { epoch } else { odd_u64(rng) },
        resync,
        more: rng.chance(10),
        first_seq,
        next_seq,
        load,
        events,
    }
}

pub(crate) struct FeedInput {
    pub(crate) outcome: CallOutcome,
    pub(crate) mutations: Vec<&'static str>,
}

pub(crate) fn feed_input(rng: &mut Rng, call: &Callout, epoch: u64) -> FeedInput {
    let q = call
        .header(":path")
        .and_then(|p| p.split_once('?'))
        .and_then(|(_, q)| FeedQuery::parse(q).ok())
        .unwrap_or(FeedQuery::resync(FEED_MAX_EVENTS));
    match rng.below(100) {
        0..=2 => {
            return FeedInput {
                outcome: CallOutcome::Reset,
                mutations: vec!["reset"],
            };
        }
        3..=4 => {
            return FeedInput {
                outcome: CallOutcome::timeout(),
                mutations: vec!["timeout"],
            };
        }
        _ => {}
    }
    let (body, mutations) = mutated_batch(rng, &q, epoch);
    let outcome = feed_answer(rng, body);
    FeedInput { outcome, mutations }
}

/// A valid batch for the query, encoded, with a few mutations (header fields set to odd values,
/// event counts, byte-level ones with pieces of a second batch), sometimes sized near the byte
/// limit; the mutations' names.
fn mutated_batch(rng: &mut Rng, q: &FeedQuery, epoch: u64) -> (Vec<u8>, Vec<&'static str>) {
    let mut mutations = Vec::new();
    let mut body = feed_batch(rng, q, epoch).encode();
    let other = feed_batch(rng, q, epoch).encode();
    let n = match rng.below(10) {
        0..=2 => 0,
        3..=6 => 1,
        _ => rng.below(4) + 1,
    };
    for _ in 0..n {
        if rng.chance(50) && body.len() >= HEADER_LEN {
            // A header field set to an odd value.
            let (off, width, name) = *rng.pick(&[
                (4usize, 1usize, "version"),
                (5, 1, "flags"),
                (6, 2, "reserved"),
                (8, 8, "epoch"),
                (16, 8, "first_seq"),
                (24, 8, "next_seq"),
                (72, 4, "block size"),
                (76, 4, "event count"),
                (0, 4, "magic"),
            ]);
            let v = odd_u64(rng).to_le_bytes();
            body[off..off + width].copy_from_slice(&v[..width]);
            mutations.push(name);
        } else if rng.chance(30) && body.len() > HEADER_LEN + 6 {
            // An event's count, at a random offset past the header (sometimes right on one).
            let i = HEADER_LEN + 2 + rng.below(body.len() - HEADER_LEN - 6);
            let v = odd_u64(rng).to_le_bytes();
            body[i..i + 4].copy_from_slice(&v[..4]);
            mutations.push("event count");
        } else {
            mutations.push(mutate(rng, &mut body, &other));
        }
    }
    if rng.chance(2) {
        // Near or over the byte limit.
        let target = FEED_MAX_BYTES - 64 + rng.below(128);
        body.resize(target, rng.next() as u8);
        mutations.push("near the byte limit");
    }
    (body, mutations)
}

/// The answer carrying `body`: mostly 200 with the feed's content type, sometimes another status or
/// type, a lying or missing header.
fn feed_answer(rng: &mut Rng, body: Vec<u8>) -> CallOutcome {
    let status = if rng.chance(90) {
        200
    } else {
        *rng.pick(&[0u16, 100, 204, 206, 301, 400, 404, 429, 500, 503, 504, 999])
    };
    let ct = match rng.below(20) {
        0 => "text/plain",
        1 => "",
        2 => "application/json",
        _ => FEED_CONTENT_TYPE,
    };
    let mut outcome = CallOutcome::ok(status, ct, body);
    if let CallOutcome::Response { headers, .. } = &mut outcome {
        if rng.chance(5) {
            headers[2].1 = header_bytes(rng);
        }
        if rng.chance(3) {
            headers.retain(|(k, _)| k != b":status");
        }
        if rng.chance(3) {
            headers[0].1 = header_bytes(rng);
        }
    }
    outcome
}
