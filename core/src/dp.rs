//! Data-parallel ranks: the routing unit is an (endpoint, rank) pair.
//!
//! One engine endpoint can serve several data-parallel (DP) ranks, each an independent engine with its
//! own KV cache and its own queue (vLLM's `--data-parallel-size` behind one API server: every rank is a
//! separate engine-core process; docs/design/dp.md). A router that sees only the endpoint cannot
//! know which rank holds a session's prefix, and the engine's own balancer (vLLM's
//! `DPLBAsyncMPClient`) picks a rank by queue length alone, so a prefix cached on rank 2 is
//! recomputed on rank 0. Routing to the rank needs the rank to be the unit everything is kept for:
//! its blocks in the index, its load in the load table, its candidacy in every policy.
//!
//! [`Units`] lays the fleet's units out in one index space: endpoint 0's ranks first, then endpoint
//! 1's, and so on. An endpoint with one rank is one unit with no rank ([`Unit::rank`] `None`), so a
//! fleet without DP ranks has exactly the unit indices it had before (unit `i` = endpoint `i`): the
//! [`crate::Router`] is simply built with `units.len()` replicas and nothing in it changes for such a
//! fleet. Every lookup is checked: an out-of-range endpoint or rank (from a configuration, a feed, a
//! header) is `None` or a [`UnitError`], never a panic.

/// The most DP ranks one endpoint may declare. vLLM's widest documented deployments (DeepSeek-style
/// wide expert parallelism) run DP 32-64 per deployment; 256 leaves room while keeping a typo (65536)
/// from allocating a fleet's worth of per-unit state.
pub const MAX_DP_RANKS: u32 = 256;

/// The feed's rank field and the rank header carry ranks as unsigned integers; this is the header
/// vLLM's OpenAI server reads to pin a request to a rank (`X-data-parallel-rank`, read by
/// `_get_data_parallel_rank` in `vllm/entrypoints/openai/engine/serving.py`; header names are
/// case-insensitive, and proxies lower-case them).
pub const DEFAULT_RANK_HEADER: &str = "x-data-parallel-rank";

/// One routing unit: an endpoint and, when the endpoint has several DP ranks, one of them.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// Index of the endpoint in the configuration's list.
    pub endpoint: usize,
    /// The DP rank; `None` for an endpoint declared with one rank (no rank header is written, and its
    /// feed may report any rank: an externally balanced vLLM rank has its own endpoint and reports its
    /// global rank).
    pub rank: Option<u32>,
}

/// Why a fleet layout was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnitError(pub String);

impl core::fmt::Display for UnitError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The fleet's units, in index order (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Units {
    units: Vec<Unit>,
    /// `first[e]`: index of endpoint `e`'s first unit; `first[endpoints]` = `units.len()`.
    first: Vec<usize>,
}

impl Units {
    /// Lays out a fleet from each endpoint's rank count. Refuses an empty fleet, a rank count of 0 or
    /// over [`MAX_DP_RANKS`], and more than `max_units` units in all, naming the endpoint.
    pub fn new(ranks_per_endpoint: &[u32], max_units: usize) -> Result<Units, UnitError> {
        if ranks_per_endpoint.is_empty() {
            return Err(UnitError("at least one endpoint is required".into()));
        }
        let mut units = Vec::new();
        let mut first = Vec::with_capacity(ranks_per_endpoint.len() + 1);
        for (e, &n) in ranks_per_endpoint.iter().enumerate() {
            if n == 0 || n > MAX_DP_RANKS {
                return Err(UnitError(format!(
                    "endpoint {e}: dp_ranks must be 1..={MAX_DP_RANKS}, got {n}"
                )));
            }
            first.push(units.len());
            if n == 1 {
                units.push(Unit {
                    endpoint: e,
                    rank: None,
                });
            } else {
                units.extend((0..n).map(|r| Unit {
                    endpoint: e,
                    rank: Some(r),
                }));
            }
            if units.len() > max_units {
                return Err(UnitError(format!(
                    "endpoint {e}: the fleet would have more than {max_units} routing units \
                     (endpoints x dp_ranks)"
                )));
            }
        }
        first.push(units.len());
        Ok(Units { units, first })
    }

    /// Units in all (what [`crate::Router::new`] is given as its replica count).
    pub fn len(&self) -> usize {
        self.units.len()
    }

    pub fn is_empty(&self) -> bool {
        self.units.is_empty()
    }

    /// Endpoints in all.
    pub fn endpoints(&self) -> usize {
        self.first.len() - 1
    }

    /// Unit `i`, `None` out of range.
    pub fn get(&self, i: usize) -> Option<Unit> {
        self.units.get(i).copied()
    }

    pub fn iter(&self) -> impl Iterator<Item = Unit> + '_ {
        self.units.iter().copied()
    }

    /// Ranks endpoint `e` declared (1 for an endpoint without DP ranks; 0 for an unknown endpoint).
    pub fn ranks_of(&self, e: usize) -> u32 {
        match (self.first.get(e), self.first.get(e + 1)) {
            (Some(a), Some(b)) => (b - a) as u32,
            _ => 0,
        }
    }

    /// The unit indices of endpoint `e` (empty for an unknown endpoint).
    pub fn units_of(&self, e: usize) -> core::ops::Range<usize> {
        match (self.first.get(e), self.first.get(e + 1)) {
            (Some(&a), Some(&b)) => a..b,
            _ => 0..0,
        }
    }

    /// The unit of endpoint `e` at `rank`: for an endpoint with DP ranks, `rank` must be one of its
    /// ranks; for one without, only `None` names it (a rank there is not a unit of this fleet).
    pub fn unit_of(&self, e: usize, rank: Option<u32>) -> Option<usize> {
        let range = self.units_of(e);
        if range.is_empty() {
            return None;
        }
        match (self.ranks_of(e), rank) {
            (1, None) => Some(range.start),
            (1, Some(_)) | (_, None) => None,
            (n, Some(r)) if r < n => Some(range.start + r as usize),
            _ => None,
        }
    }

    /// Whether a feed answer that says it comes from `reported` may be applied to unit `i`: a unit
    /// with a rank takes only its own rank's answers (another rank's blocks would be booked on the
    /// wrong cache; an out-of-range rank is malformed); a unit without one takes any (an externally
    /// balanced rank reports its global rank from its own endpoint). `false` for an unknown unit.
    pub fn accepts_feed_rank(&self, i: usize, reported: u32) -> bool {
        match self.get(i) {
            Some(Unit { rank: Some(r), .. }) => r == reported,
            Some(Unit { rank: None, .. }) => true,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::{FeedBatch, FeedEvent, ReplicaLoad, Tier};
    use crate::{Router, RoutingConfig};

    #[test]
    fn a_fleet_without_ranks_keeps_its_indices() {
        let u = Units::new(&[1, 1, 1], 256).unwrap();
        assert_eq!(u.len(), 3);
        for i in 0..3 {
            assert_eq!(
                u.get(i),
                Some(Unit {
                    endpoint: i,
                    rank: None
                })
            );
            assert_eq!(u.unit_of(i, None), Some(i));
            assert_eq!(
                u.unit_of(i, Some(0)),
                None,
                "no rank units on a rankless endpoint"
            );
        }
    }

    #[test]
    fn ranks_are_laid_out_endpoint_by_endpoint() {
        let u = Units::new(&[4, 1, 2], 256).unwrap();
        assert_eq!(u.len(), 7);
        assert_eq!(u.endpoints(), 3);
        assert_eq!(u.units_of(0), 0..4);
        assert_eq!(u.units_of(1), 4..5);
        assert_eq!(u.units_of(2), 5..7);
        assert_eq!(u.units_of(3), 0..0);
        assert_eq!(u.unit_of(0, Some(3)), Some(3));
        assert_eq!(u.unit_of(0, Some(4)), None, "out of range");
        assert_eq!(u.unit_of(0, None), None, "a DP endpoint needs a rank");
        assert_eq!(u.unit_of(1, None), Some(4));
        assert_eq!(u.unit_of(2, Some(1)), Some(6));
        assert_eq!(u.unit_of(9, None), None);
        assert_eq!(
            u.get(6),
            Some(Unit {
                endpoint: 2,
                rank: Some(1)
            })
        );
        assert_eq!(u.get(7), None);
        assert!(u.accepts_feed_rank(2, 2));
        assert!(!u.accepts_feed_rank(2, 1));
        assert!(!u.accepts_feed_rank(2, 60_000));
        assert!(
            u.accepts_feed_rank(4, 17),
            "a rankless endpoint takes any rank"
        );
        assert!(!u.accepts_feed_rank(99, 0));
    }

    #[test]
    fn bad_layouts_are_refused_by_name() {
        assert!(Units::new(&[], 256).is_err());
        assert!(
            Units::new(&[1, 0], 256)
                .unwrap_err()
                .0
                .contains("endpoint 1")
        );
        assert!(Units::new(&[MAX_DP_RANKS + 1], 100_000).is_err());
        assert!(Units::new(&[200, 100], 256).unwrap_err().0.contains("256"));
        assert!(Units::new(&[128, 128], 256).is_ok());
    }

    fn batch(epoch: u64, hashes: Vec<u64>) -> FeedBatch {
        let mut b = FeedBatch::snapshot(epoch, hashes);
        b.load = ReplicaLoad {
            block_size: 16,
            ..Default::default()
        };
        b
    }

    /// The router keeps each rank's cache and load apart: a prefix cached on rank 2 of endpoint 0
    /// draws the request to that rank, not to the endpoint's other ranks, and load booked on one
    /// rank leaves the others' untouched.
    #[test]
    fn the_router_treats_each_rank_as_its_own_unit() {
        let units = Units::new(&[4, 4], 256).unwrap();
        let cfg = RoutingConfig::from_json(r#"{"policy":"kv_load","block_size":16}"#).unwrap();
        let mut router = Router::new(cfg, units.len()).unwrap();
        let (req, hashes) = crate::router::token_prompt_request(&router, 1024);
        let target = units.unit_of(0, Some(2)).unwrap();
        router.apply_feed(target, &batch(7, hashes.clone()));
        let d = router.route(&req, 0);
        assert_eq!(
            units.get(d.replica),
            Some(Unit {
                endpoint: 0,
                rank: Some(2)
            })
        );
        assert_eq!(d.matched_tokens[target], 1024);
        for (i, m) in d.matched_tokens.iter().enumerate() {
            if i != target {
                assert_eq!(*m, 0, "unit {i} shares no cache with rank 2");
            }
        }
        router.admit(1, &req, &d, 0);
        let load = router.effective_load();
        assert!(load[target].active_requests > 0);
        for (i, l) in load.iter().enumerate() {
            if i != target {
                assert_eq!(
                    l.active_requests, 0,
                    "unit {i} carries none of rank 2's load"
                );
            }
        }
        // A feed event naming a stored block on another rank is that rank's alone.
        let other = units.unit_of(1, Some(0)).unwrap();
        let mut inc = FeedBatch::snapshot(9, Vec::new());
        inc.events.push(FeedEvent::Stored {
            tier: Tier::Gpu,
            hashes: hashes[..8].to_vec(),
        });
        router.apply_feed(other, &inc);
        let d = router.route(&req, 0);
        assert_eq!(d.matched_tokens[other], 128);
        assert_eq!(d.matched_tokens[target], 1024);
    }
}
