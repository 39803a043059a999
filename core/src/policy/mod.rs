//! The routing policies, one module each, as functions of one shared [`Input`]: the request's size,
//! each replica's effective load, its KV overlap with the request, and which replicas are avoided.
//! [`crate::router::Router::route`] builds the input (querying the KV index, the approximate index and
//! the load table) and dispatches on the configured [`PolicyKind`](crate::config::PolicyKind); a
//! policy returns its [`Choice`]: the replica, the per-replica costs where it scores, and why it fell
//! back when it did. Policies hold no state of their own beyond what is passed in (the round-robin
//! cursor, the hash ring, the tie-break generator), so each can be read and tested alone.
//!
//! | policy | module | in one line |
//! |---|---|---|
//! | `round_robin` | [`round_robin`] | the next replica up, in turn |
//! | `least_load` | [`least_load`] | lowest load cost, cache ignored |
//! | `session_hash` | [`session_hash`] | consistent hash of the session key; least load without one |
//! | `prefix_affinity` | [`prefix_affinity`] | replica this router last sent the longest prefix to |
//! | `kv_affinity` | [`kv_affinity`] | largest KV overlap reported by the replicas |
//! | `kv_load` | [`kv_load`] | lowest prefill-after-overlap plus decode load in blocks (kvsteer's first default) |
//! | `kv_time` | [`kv_time`] | lowest cost in seconds from each replica's learned speed (docs/design/design.md) |

pub mod choose;
pub mod kv_affinity;
pub mod kv_load;
pub mod kv_time;
pub mod least_load;
pub mod prefix_affinity;
pub mod ring;
pub mod round_robin;
pub mod session_hash;

pub use choose::{argmin_random_tie, masked, pick_lowest, softmax_sample};
pub use ring::HashRing;

use crate::load::LoadTotals;

/// Why a decision did not come from the configured policy's first choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FallbackReason {
    /// `session_hash` without a session key: least load.
    NoSessionKey,
    /// `prefix_affinity` with too small a match: least load.
    BelowMatchThreshold,
    /// The body could not be read: least load.
    BodyUnreadable,
}

/// What every policy decides from. Per-replica slices all have one entry per replica.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a> {
    /// The prompt in blocks, rounded up (`ceil(prompt_tokens / block_size)`).
    pub request_blocks: f64,
    /// Tokens per block.
    pub block_size: f64,
    /// Effective load (the router's bookings, combined with the replicas' reports as configured).
    pub load: &'a [LoadTotals],
    /// KV overlap in blocks, tier-weighted (0 for a stale replica).
    pub overlap: &'a [f64],
    /// Leading blocks of the request already active on each replica (booked by requests in flight);
    /// empty when the policy does not use it.
    pub active_prefix: &'a [f64],
    /// Leading blocks this router itself last sent to each replica (the approximate index, for
    /// `prefix_affinity`); empty otherwise.
    pub affinity: &'a [u32],
    /// Full blocks of the request's identity.
    pub identity_blocks: usize,
    pub session_key: Option<&'a str>,
    /// Replicas to avoid (down while another is up).
    pub avoided: &'a [bool],
    /// Output tokens the request is expected to generate ([`crate::output::OutputEstimate`]).
    pub expected_output_tokens: f64,
    /// Per replica: distinct blocks in its recent working set, how many of the request's blocks it
    /// would add, and its cache's size in blocks (0: not known yet) ([`crate::working_set`]); empty
    /// when the working-set term is off.
    pub working_set: &'a [(f64, f64, f64)],
    /// What the working-set term's weight is multiplied by: 1, or with
    /// `kv_load.overflow_reuse_floor` above 0, how far the traffic's reuse share is above the floor
    /// ([`crate::policy::kv_load::reuse_ramp`]).
    pub working_set_scale: f64,
    /// Per replica: its learned time factor against the engine profile (`kv_time`,
    /// [`crate::speed::Speeds`]); empty: 1 for every replica.
    pub speed: &'a [f64],
    /// Share of recently requested prompt blocks that had been requested before (`kv_time`'s chance
    /// that a context pushed out of a cache comes back); 0 when not tracked.
    pub reuse_share: f64,
}

/// A policy's decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub replica: usize,
    /// Per replica where the policy scores (lower is better); empty otherwise.
    pub costs: Vec<f64>,
    pub fallback: Option<FallbackReason>,
}
