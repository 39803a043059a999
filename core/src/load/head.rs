//! The prefill a replica is running now, and for how long it has run.
//!
//! The load table books each request's prefill whole until its first token comes back. The request
//! at the head of a replica's queue has been computing since the request before it returned its
//! first token (or since it reached an empty queue), so a wait predicted from the whole booking is
//! too long by the head's progress. On coding agents at 32 in flight on 4 replicas (the training
//! sample, seed 0) `kv_time`'s realized / predicted time to first token was 1.04 where the head had
//! run under half a second and 0.67 where it had run 4 s or more: busy replicas looked busier the
//! longer their current prefill had run, and later turns moved off their history for waits that
//! were mostly over. `kv_time` reads [`PrefillHead::running`] to take the head's progress off the
//! queue ([`crate::policy::kv_time`]).
//!
//! Each worker knows only the requests it admitted; it publishes its own view per replica and
//! [`PrefillHead::merge`]s the others' (the oldest head wins; the latest first token is the clock).

use crate::record::{Record, u64_at};

/// What a worker knows of the prefill in progress on one replica; also what it publishes to the
/// proxy's other workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillHead {
    /// When the last request that left the head of this worker's queue there returned its first
    /// token (router clock, ms; 0: none seen).
    pub last_first_token_ms: u64,
    /// When this worker's oldest request still in prefill there was admitted ([`Self::NONE`]:
    /// none).
    pub admitted_ms: u64,
    /// That request's booked prefill, in the load table's unit.
    pub work: u64,
}

impl Default for PrefillHead {
    fn default() -> Self {
        PrefillHead {
            last_first_token_ms: 0,
            admitted_ms: Self::NONE,
            work: 0,
        }
    }
}

/// How long one replica's head has been computing, as a policy reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HeadProgress {
    /// Seconds since the head's prefill began (0 where nothing is in prefill).
    pub elapsed_s: f64,
    /// The head's booked prefill, in the load table's unit (0: nothing in prefill).
    pub work: f64,
}

impl PrefillHead {
    /// `admitted_ms` of a replica with nothing in prefill.
    pub const NONE: u64 = u64::MAX;

    /// Both workers' views in one: the older head (requests run in the order they arrived) and the
    /// later first token.
    pub fn merge(&self, o: &PrefillHead) -> PrefillHead {
        let head = if o.admitted_ms < self.admitted_ms {
            o
        } else {
            self
        };
        PrefillHead {
            last_first_token_ms: self.last_first_token_ms.max(o.last_first_token_ms),
            admitted_ms: head.admitted_ms,
            work: head.work,
        }
    }

    /// How long the head has run at `now_ms`: since the later of its admission and the last first
    /// token (the request before it finishing), never negative; nothing where no request is in
    /// prefill.
    pub fn running(&self, now_ms: u64) -> HeadProgress {
        if self.admitted_ms == Self::NONE || self.work == 0 {
            return HeadProgress::default();
        }
        let since = self.admitted_ms.max(self.last_first_token_ms);
        HeadProgress {
            elapsed_s: now_ms.saturating_sub(since) as f64 / 1e3,
            work: self.work as f64,
        }
    }
}

/// Shared between a proxy's workers as `KVPH`, a `u32` count, then `last_first_token_ms u64 |
/// admitted_ms u64 | work u64` per replica ([`crate::record`]).
impl Record for PrefillHead {
    const LEN: usize = 24;
    const MAGIC: Option<[u8; 4]> = Some(*b"KVPH");

    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.last_first_token_ms.to_le_bytes());
        out.extend_from_slice(&self.admitted_ms.to_le_bytes());
        out.extend_from_slice(&self.work.to_le_bytes());
    }

    fn take(b: &[u8]) -> Option<PrefillHead> {
        Some(PrefillHead {
            last_first_token_ms: u64_at(b, 0),
            admitted_ms: u64_at(b, 8),
            work: u64_at(b, 16),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_older_head_and_the_later_first_token_win_a_merge() {
        let a = PrefillHead {
            last_first_token_ms: 100,
            admitted_ms: 50,
            work: 7,
        };
        let b = PrefillHead {
            last_first_token_ms: 300,
            admitted_ms: 200,
            work: 9,
        };
        let m = a.merge(&b);
        assert_eq!((m.last_first_token_ms, m.admitted_ms, m.work), (300, 50, 7));
        assert_eq!(b.merge(&a), m);
        assert_eq!(PrefillHead::default().merge(&b), b);
    }

    #[test]
    fn the_head_runs_from_the_later_of_its_admission_and_the_last_first_token() {
        let h = PrefillHead {
            last_first_token_ms: 1_000,
            admitted_ms: 400,
            work: 5,
        };
        assert_eq!(h.running(3_500).elapsed_s, 2.5);
        assert_eq!(h.running(3_500).work, 5.0);
        assert_eq!(
            h.running(900).elapsed_s,
            0.0,
            "a clock behind is not negative"
        );
        let fresh = PrefillHead {
            admitted_ms: 2_000,
            ..h
        };
        assert_eq!(fresh.running(2_250).elapsed_s, 0.25);
        assert_eq!(
            PrefillHead::default().running(9_999),
            HeadProgress::default()
        );
    }

    #[test]
    fn encoding_round_trips_and_refuses_malformed_bytes() {
        let v = vec![
            PrefillHead::default(),
            PrefillHead {
                last_first_token_ms: 1,
                admitted_ms: 2,
                work: u64::MAX,
            },
        ];
        let bytes = PrefillHead::encode_all(&v);
        assert_eq!(PrefillHead::decode_all(&bytes), Ok(v));
        assert!(PrefillHead::decode_all(&bytes[..bytes.len() - 1]).is_err());
        // Another kind's vector (load totals) is not a head vector.
        assert!(PrefillHead::decode_all(b"KVLT\0\0\0\0").is_err());
        assert!(PrefillHead::decode_all(&[]).is_err());
    }
}
