//! Prefill/decode disaggregation (docs/design/pd.md): replicas with a role, and the two-sided
//! choice.
//!
//! For one request the router picks a **prefill** replica, which computes the prompt (vLLM: the
//! 1-token request asking for remote decode), and a **decode** replica, which reads that KV and
//! generates. The two sides cost different things, so each has its own score (lower is better):
//!
//! - prefill side: `q * queued prefill blocks + max(request blocks - overlap, 0)`: the prefill work
//!   ahead of this request's first token on that replica, its own uncached part included. `q`
//!   defaults to 1, unlike `kv_load`'s `queue_weight`: a prefill-only engine does nothing but work
//!   through that queue, so every queued block is wait;
//! - decode side: `decode blocks + w_a * active requests + t * max(request blocks - overlap, 0)`:
//!   the KV every decode step reads there (what sets the time per output token) plus the blocks the
//!   decode replica must read over the link (vLLM's NIXL consumer reads only the part of the prompt
//!   it does not already hold in its own prefix cache), weighted by `t`.
//!
//! Under `round_robin` each side is a round robin of its own over the replicas that can take it (what
//! vLLM's example proxies do); every other policy uses the scores.

use crate::load::LoadTotals;

/// What a replica does in a P/D fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    /// Either (a replica of a fleet without disaggregation is this).
    Both,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "prefill" => Some(Role::Prefill),
            "decode" => Some(Role::Decode),
            "both" => Some(Role::Both),
            _ => None,
        }
    }

    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }
}

/// The P/D scores' coefficients.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdParams {
    /// `q`: weight of a queued prefill block on a prefill replica against one of the request's own.
    pub prefill_queue_weight: f64,
    /// `t`: weight of one block read over the link against one decode block held.
    pub transfer_weight: f64,
    /// `w_a`: weight of an active request on a decode replica, in blocks.
    pub active_request_weight: f64,
}

impl Default for PdParams {
    fn default() -> Self {
        PdParams {
            prefill_queue_weight: 1.0,
            transfer_weight: 1.0,
            active_request_weight: 0.0,
        }
    }
}

/// A two-sided decision.
#[derive(Clone, Debug, PartialEq)]
pub struct PdDecision {
    pub prefill: usize,
    pub decode: usize,
    pub prompt_tokens: u64,
    /// Cached prompt tokens on the prefill replica (tier-weighted, from the index).
    pub prefill_matched_tokens: u64,
    /// Prompt tokens the decode replica is expected to read over the link (the prompt less what the
    /// index says it holds).
    pub transfer_tokens: u64,
    /// Per replica (infinite where the side excludes it); empty under round robin.
    pub prefill_costs: Vec<f64>,
    pub decode_costs: Vec<f64>,
    /// Where the prefill leg goes if it fails on `prefill` (a 5xx or no answer), with its cached
    /// prompt tokens: for a probe, the side's own choice; otherwise the next cheapest replica that
    /// prefills (the next one under round robin), never one down or ejected while another is
    /// usable, and on another address (not a rank of the same endpoint) whenever one is usable.
    /// None when no other replica prefills.
    pub prefill_backup: Option<(usize, u64)>,
    /// The prefill side is an ejected replica's health probe (`crate::health`: a replica ejected for
    /// failing gets one request per probe interval, else nothing would ever restore it): `prefill`
    /// is the probed replica and `prefill_backup` the side's own choice.
    pub prefill_probe: bool,
    /// The decode side is a probe: `decode` is the probed replica, this the side's own choice (the
    /// retry backup).
    pub decode_backup: Option<usize>,
}

/// Why no P/D decision can be made.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PdError {
    /// `roles` does not have one entry per replica.
    RolesLength {
        roles: usize,
        replicas: usize,
    },
    NoPrefillReplica,
    NoDecodeReplica,
}

impl core::fmt::Display for PdError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PdError::RolesLength { roles, replicas } => {
                write!(f, "{roles} roles for {replicas} replicas")
            }
            PdError::NoPrefillReplica => write!(f, "no replica has the prefill role"),
            PdError::NoDecodeReplica => write!(f, "no replica has the decode role"),
        }
    }
}

impl std::error::Error for PdError {}

/// Prefill-side scores; infinite for a replica that cannot prefill. With `queue_in_time` (the
/// attention scale of `kv_load.queue_in_time`, whose queues are booked in time) the request's own
/// uncached blocks are counted in time too ([`crate::load::prefill_work`]), so queue and request
/// are in the same units.
pub fn prefill_costs(
    request_blocks: f64,
    block_size: f64,
    overlap: &[f64],
    load: &[LoadTotals],
    roles: &[Role],
    p: &PdParams,
    queue_in_time: Option<u64>,
) -> Vec<f64> {
    (0..roles.len())
        .map(|r| {
            if !roles[r].prefills() {
                return f64::INFINITY;
            }
            let queued = load.get(r).map_or(0.0, |e| e.prefill_tokens as f64) / block_size;
            let o = overlap.get(r).copied().unwrap_or(0.0);
            let uncached = (request_blocks - o).max(0.0);
            let own = match queue_in_time {
                Some(a) => {
                    let prompt = (request_blocks * block_size) as u64;
                    let work = crate::load::prefill_work(prompt, (uncached * block_size) as u64, a);
                    work as f64 / block_size
                }
                None => uncached,
            };
            p.prefill_queue_weight * queued + own
        })
        .collect()
}

/// Decode-side scores; infinite for a replica that cannot decode.
pub fn decode_costs(
    request_blocks: f64,
    overlap: &[f64],
    load: &[LoadTotals],
    roles: &[Role],
    p: &PdParams,
) -> Vec<f64> {
    (0..roles.len())
        .map(|r| {
            if !roles[r].decodes() {
                return f64::INFINITY;
            }
            let e = load.get(r).copied().unwrap_or_default();
            let o = overlap.get(r).copied().unwrap_or(0.0);
            e.decode_blocks as f64
                + p.active_request_weight * e.active_requests as f64
                + p.transfer_weight * (request_blocks - o).max(0.0)
        })
        .collect()
}

/// The next replica after `*next` (cyclically) that `eligible` accepts, advancing `*next` past it.
pub fn round_robin_among(
    n: usize,
    next: &mut usize,
    eligible: impl Fn(usize) -> bool,
) -> Option<usize> {
    if n == 0 {
        return None;
    }
    for i in 0..n {
        let r = (*next + i) % n;
        if eligible(r) {
            *next = (r + 1) % n;
            return Some(r);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(prefill: u64, decode: u64) -> LoadTotals {
        LoadTotals {
            prefill_tokens: prefill,
            decode_blocks: decode,
            active_requests: 0,
        }
    }

    const ROLES: [Role; 4] = [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode];

    #[test]
    fn roles_parse_and_gate_the_sides() {
        assert_eq!(Role::parse("prefill"), Some(Role::Prefill));
        assert_eq!(Role::parse("decode"), Some(Role::Decode));
        assert_eq!(Role::parse("both"), Some(Role::Both));
        assert_eq!(Role::parse("Prefill"), None);
        assert!(Role::Both.prefills() && Role::Both.decodes());
        assert!(!Role::Decode.prefills() && !Role::Prefill.decodes());
    }

    #[test]
    fn prefill_side_weighs_the_cached_prefix_against_the_queue() {
        let p = PdParams::default();
        // Replica 0 holds 90 of the 100 blocks but has 50 blocks queued; replica 1 none, nothing.
        let l = [load(800, 0), load(0, 0), load(0, 0), load(0, 0)];
        let c = prefill_costs(100.0, 16.0, &[90.0, 0.0, 0.0, 0.0], &l, &ROLES, &p, None);
        assert_eq!(c[0], 50.0 + 10.0);
        assert_eq!(c[1], 100.0);
        assert!(c[2].is_infinite() && c[3].is_infinite());
        // With 200 blocks queued the empty replica wins.
        let l = [load(3200, 0), load(0, 0), load(0, 0), load(0, 0)];
        let c = prefill_costs(100.0, 16.0, &[90.0, 0.0, 0.0, 0.0], &l, &ROLES, &p, None);
        assert!(c[1] < c[0]);
    }

    #[test]
    fn prefill_side_in_time_counts_the_requests_own_blocks_in_time() {
        let p = PdParams::default();
        // 100 blocks of 16 tokens (1,600), attention scale 1,600 tokens: the 10 uncached blocks at
        // the end of a 90-block cached prefix average 1,520 tokens of context (x 1.95); the 100
        // cold blocks 800 (x 1.5). The queue is taken as booked.
        let l = [load(800, 0), load(0, 0), load(0, 0), load(0, 0)];
        let c = prefill_costs(
            100.0,
            16.0,
            &[90.0, 0.0, 0.0, 0.0],
            &l,
            &ROLES,
            &p,
            Some(1_600),
        );
        assert!((c[0] - (50.0 + 19.5)).abs() < 1e-9, "{c:?}");
        assert!((c[1] - 150.0).abs() < 1e-9, "{c:?}");
    }

    #[test]
    fn decode_side_weighs_decode_load_against_the_transfer() {
        let p = PdParams::default();
        let l = [load(0, 0), load(0, 0), load(0, 1000), load(0, 1050)];
        // Replica 3 holds 80 of 100 blocks: it reads 20 where replica 2 reads 100.
        let c = decode_costs(100.0, &[0.0, 0.0, 0.0, 80.0], &l, &ROLES, &p);
        assert!(c[0].is_infinite() && c[1].is_infinite());
        assert_eq!(c[2], 1100.0);
        assert_eq!(c[3], 1070.0);
        // Without the transfer term the lighter decode load wins.
        let p0 = PdParams {
            transfer_weight: 0.0,
            ..p
        };
        let c = decode_costs(100.0, &[0.0, 0.0, 0.0, 80.0], &l, &ROLES, &p0);
        assert!(c[2] < c[3]);
    }

    #[test]
    fn round_robin_cycles_over_the_eligible_only() {
        let mut next = 0;
        let picks: Vec<usize> = (0..5)
            .map(|_| round_robin_among(4, &mut next, |r| ROLES[r].decodes()).unwrap())
            .collect();
        assert_eq!(picks, vec![2, 3, 2, 3, 2]);
        let mut next = 0;
        assert_eq!(round_robin_among(4, &mut next, |_| false), None);
        assert_eq!(round_robin_among(0, &mut next, |_| true), None);
    }

    mod router {
        use super::*;
        use crate::feed::{FeedBatch, ReplicaLoad};
        use crate::{Router, RoutingConfig};

        fn batch(epoch: u64, hashes: Vec<u64>) -> FeedBatch {
            let mut b = FeedBatch::snapshot(epoch, hashes);
            b.load = ReplicaLoad {
                block_size: 16,
                ..Default::default()
            };
            b
        }

        fn setup(policy: &str) -> (Router, crate::RouteRequest, Vec<u64>) {
            let cfg =
                RoutingConfig::from_json(&format!(r#"{{"policy":"{policy}","block_size":16}}"#))
                    .unwrap();
            let router = Router::new(cfg, 4).unwrap();
            let (req, hashes) = crate::router::token_prompt_request(&router, 1024);
            (router, req, hashes)
        }

        /// The prefix cached on prefill replica 1 draws the prefill there; the one cached on decode
        /// replica 3 (half the prompt) draws the decode there and halves the transfer; decode-only
        /// and prefill-only replicas never take the other side.
        #[test]
        fn kv_load_picks_each_side_by_its_cache_and_load() {
            let (mut router, req, hashes) = setup("kv_load");
            router.apply_feed(1, &batch(7, hashes.clone()));
            router.apply_feed(3, &batch(8, hashes[..32].to_vec()));
            let p = PdParams::default();
            let d = router.route_pd(&req, &ROLES, &p, 0).unwrap();
            assert_eq!((d.prefill, d.decode), (1, 3));
            assert_eq!(d.prefill_matched_tokens, 1024);
            assert_eq!(d.transfer_tokens, 512);
            // Booked decode load on replica 3 beyond the transfer saved sends the next to 2.
            router.admit_pd(10, 11, &req, &d, 0);
            router.first_token(11);
            let load = router.effective_load();
            assert!(load[3].decode_blocks >= 64, "{load:?}");
            assert!(
                load[1].prefill_tokens == 0,
                "the prefill leg was all cached"
            );
            let heavy = PdParams {
                transfer_weight: 0.1,
                ..p
            };
            let d2 = router.route_pd(&req, &ROLES, &heavy, 0).unwrap();
            assert_eq!(d2.decode, 2);
            assert!(router.release(10) && router.release(11));
        }

        #[test]
        fn round_robin_alternates_each_side_alone() {
            let (mut router, req, hashes) = setup("round_robin");
            router.apply_feed(1, &batch(7, hashes));
            let p = PdParams::default();
            let picks: Vec<(usize, usize)> = (0..4)
                .map(|_| {
                    let d = router.route_pd(&req, &ROLES, &p, 0).unwrap();
                    (d.prefill, d.decode)
                })
                .collect();
            assert_eq!(picks, vec![(0, 2), (1, 3), (0, 2), (1, 3)]);
        }

        /// The decode leg as a destination: its backup is another decode replica (never a
        /// prefill-only one); an unreadable request goes whole to a decode replica.
        #[test]
        fn decode_legs_and_unreadable_requests_stay_on_the_decode_side() {
            let (mut router, req, _) = setup("kv_load");
            let p = PdParams::default();
            let d = router.route_pd(&req, &ROLES, &p, 0).unwrap();
            let dd = router.pd_decode_decision(&d, &ROLES);
            assert_eq!(dd.replica, d.decode);
            assert_eq!(dd.backup, Some(5 - d.decode), "{dd:?}");
            let (mut rr, req, _) = setup("round_robin");
            let d = rr.route_pd(&req, &ROLES, &p, 0).unwrap();
            assert_eq!(rr.pd_decode_decision(&d, &ROLES).backup, Some(5 - d.decode));
            // One decode replica: no backup.
            let one = [Role::Prefill, Role::Prefill, Role::Prefill, Role::Decode];
            let d = rr.route_pd(&req, &one, &p, 0).unwrap();
            assert_eq!(rr.pd_decode_decision(&d, &one).backup, None);
            for i in 0..20 {
                let u = router.route_unread_pd(100 + i, 4000, &ROLES, 0);
                assert!(ROLES[u.replica].decodes(), "{u:?}");
                assert!(u.backup.is_none_or(|b| ROLES[b].decodes()), "{u:?}");
                assert!(router.release(100 + i));
            }
        }

        /// A replica ejected for failing gets one leg of its side per probe interval (else nothing
        /// would restore it), with the side's own choice as the backup; a success restores it.
        #[test]
        fn ejected_replicas_are_probed_on_their_own_side() {
            let (mut router, req, _) = setup("round_robin");
            let p = PdParams::default();
            for r in [0, 2] {
                for _ in 0..3 {
                    router.record_outcome(r, crate::health::Outcome::Failure, 10);
                }
            }
            assert!(router.is_ejected(0) && router.is_ejected(2));
            // Before the probe interval: the ejected replicas are avoided.
            for _ in 0..3 {
                let d = router.route_pd(&req, &ROLES, &p, 20).unwrap();
                assert_eq!((d.prefill, d.decode), (1, 3));
                assert_eq!((d.prefill_backup, d.decode_backup), (None, None));
            }
            // A second later both are due: each side's leg probes its ejected replica.
            let d = router.route_pd(&req, &ROLES, &p, 1100).unwrap();
            assert_eq!((d.prefill, d.decode), (0, 2), "{d:?}");
            assert_eq!(d.prefill_backup.map(|b| b.0), Some(1));
            assert!(d.prefill_probe);
            assert_eq!(d.decode_backup, Some(3));
            let dd = router.pd_decode_decision(&d, &ROLES);
            assert!(dd.probe && dd.backup == Some(3));
            // Not again within the interval.
            let d = router.route_pd(&req, &ROLES, &p, 1200).unwrap();
            assert_eq!((d.prefill_backup, d.decode_backup), (None, None));
            // Successes restore them (once the failures have decayed: health's restore rate).
            router.record_outcome(0, crate::health::Outcome::Success, 10_000);
            router.record_outcome(2, crate::health::Outcome::Success, 10_000);
            router.refresh_health(10_000);
            assert!(!router.is_ejected(0) && !router.is_ejected(2));
            // The backup's prefill leg is booked on its own.
            router.admit_prefill_leg(7, &req, 1, 0, 1300);
            assert_eq!(router.local_load()[1].active_requests, 1);
            assert!(router.release(7));
        }

        /// Every prefill leg has a backup on its side for when it fails: the next cheapest replica
        /// that prefills (the next one under round robin), with its cached tokens; never a
        /// decode-only replica, never an ejected one, a rank of another endpoint before one of the
        /// chosen endpoint's own, and none when no other replica prefills.
        #[test]
        fn prefill_legs_get_a_backup_on_their_side() {
            let (mut router, req, hashes) = setup("kv_load");
            router.apply_feed(1, &batch(7, hashes[..32].to_vec()));
            let p = PdParams::default();
            let d = router.route_pd(&req, &ROLES, &p, 0).unwrap();
            assert_eq!(d.prefill, 1);
            assert_eq!(d.prefill_backup, Some((0, 0)));
            assert!(!d.prefill_probe);
            let (mut rr, req, _) = setup("round_robin");
            for want in [(0, Some(1)), (1, Some(0)), (0, Some(1))] {
                let d = rr.route_pd(&req, &ROLES, &p, 0).unwrap();
                assert_eq!((d.prefill, d.prefill_backup.map(|b| b.0)), want);
            }
            // Three replicas prefill; 0 and 1 are ranks of one endpoint: the backup of 0 is 2 even
            // though 1 holds the prompt.
            let three = [Role::Prefill, Role::Prefill, Role::Prefill, Role::Decode];
            let (mut router, req, hashes) = setup("kv_load");
            router.set_address_groups(vec![0, 0, 2, 3]);
            router.apply_feed(0, &batch(7, hashes.clone()));
            router.apply_feed(1, &batch(8, hashes.clone()));
            let d = router.route_pd(&req, &three, &p, 0).unwrap();
            assert_eq!(
                d.prefill_backup.map(|b| b.0),
                Some(if d.prefill == 2 { 0 } else { 2 })
            );
            // Replica 0 ejected, 1 chosen: no other usable replica prefills, so no backup.
            let (mut router, req, _) = setup("kv_load");
            for _ in 0..3 {
                router.record_outcome(0, crate::health::Outcome::Failure, 10);
            }
            let d = router.route_pd(&req, &ROLES, &p, 20).unwrap();
            assert_eq!((d.prefill, d.prefill_backup), (1, None));
            // One replica prefills: no backup.
            let one = [Role::Prefill, Role::Decode, Role::Decode, Role::Decode];
            let d = router.route_pd(&req, &one, &p, 30).unwrap();
            assert_eq!((d.prefill, d.prefill_backup), (0, None));
        }

        #[test]
        fn bad_role_layouts_are_errors_not_panics() {
            let (mut router, req, _) = setup("kv_load");
            let p = PdParams::default();
            assert_eq!(
                router.route_pd(&req, &ROLES[..3], &p, 0),
                Err(PdError::RolesLength {
                    roles: 3,
                    replicas: 4
                })
            );
            assert_eq!(
                router.route_pd(&req, &[Role::Decode; 4], &p, 0),
                Err(PdError::NoPrefillReplica)
            );
            assert_eq!(
                router.route_pd(&req, &[Role::Prefill; 4], &p, 0),
                Err(PdError::NoDecodeReplica)
            );
            // A fleet of `both` works: any replica may take either side.
            let d = router.route_pd(&req, &[Role::Both; 4], &p, 0).unwrap();
            assert!(d.prefill < 4 && d.decode < 4);
            // Out-of-range decisions are counted, not a panic.
            let mut bad = d.clone();
            bad.decode = 9;
            router.admit_pd(1, 2, &req, &bad, 0);
            assert_eq!(router.stats().bad_replica, 1);
        }
    }
}
