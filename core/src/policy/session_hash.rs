//! `session_hash`: consistent hashing of the session key on a ring with virtual nodes (as Ray Serve's
//! ConsistentHashRouter), so a session keeps its replica and its cache; an avoided replica's sessions
//! move to the next replica on the ring, the others stay. Without a session key: least load.

use super::{Choice, FallbackReason, HashRing, Input, Policy, least_load};
use crate::config::LeastLoadParams;
use crate::rng::SplitMix64;

pub fn choose(input: &Input, ring: &HashRing, k: &LeastLoadParams, rng: &mut SplitMix64) -> Choice {
    match input.session_key {
        Some(key) => Choice {
            replica: ring
                .lookup_where(key.as_bytes(), |r| {
                    !input.avoided.get(r).copied().unwrap_or(false)
                })
                .unwrap_or(0),
            costs: Vec::new(),
            fallback: None,
        },
        None => Choice {
            fallback: Some(FallbackReason::NoSessionKey),
            ..least_load::choose(input, k, rng)
        },
    }
}

/// `session_hash` as a [`Policy`]: its ring, and `least_load`'s weights for least load
/// without a session key.
#[derive(Clone, Debug)]
pub struct SessionHash {
    ring: HashRing,
    params: LeastLoadParams,
}

impl SessionHash {
    pub fn new(ring: HashRing, params: LeastLoadParams) -> SessionHash {
        SessionHash { ring, params }
    }
}

impl Policy for SessionHash {
    fn choose(&mut self, input: &Input, rng: &mut SplitMix64) -> Choice {
        choose(input, &self.ring, &self.params, rng)
    }
}
