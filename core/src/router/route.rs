//! Choosing a replica: the `route*` entry points, the policies' input gathered and their choice
//! turned into a [`Decision`] (a due probe, the retry backup, the counters).

use super::{Decision, Router};
use crate::policy::{CacheFit, Choice, FallbackReason, Input, kv_load, least_load, pick_lowest};
use crate::request::{
    EarlyScan, PromptIdentity, PromptTokenizer, RequestError, RouteRequest, read_request_early,
};
use crate::speed::LearnedInputs;

impl Router {
    /// Tier-weighted overlap in blocks per replica for the request's identity.
    pub(super) fn overlap_blocks(&mut self, req: &RouteRequest, now_ms: u64) -> Vec<f64> {
        let k = &self.cfg.index;
        match &req.identity {
            PromptIdentity::Exact(hashes) => {
                let mut tiers = std::mem::take(&mut self.scratch.tiers);
                self.index.match_prefix(hashes, &mut tiers);
                let out = tiers
                    .iter()
                    .enumerate()
                    .map(|(r, c)| {
                        if self.reported.is_stale(r) {
                            0.0
                        } else {
                            c[0] as f64
                                + k.host_tier_credit * c[1] as f64
                                + k.disk_tier_credit * c[2] as f64
                        }
                    })
                    .collect();
                self.scratch.tiers = tiers;
                out
            }
            PromptIdentity::Approximate(hashes) => {
                let mut m = std::mem::take(&mut self.scratch.approx);
                self.approx_text
                    .match_prefix(hashes, now_ms, self.replicas(), &mut m);
                let out = m.iter().map(|&b| b as f64).collect();
                self.scratch.approx = m;
                out
            }
        }
    }

    /// Chooses a replica for a request. Does not admit it: call [`Router::admit`] once the request is
    /// really sent there.
    pub fn route(&mut self, req: &RouteRequest, now_ms: u64) -> Decision {
        let mut sampled = std::mem::take(&mut self.scratch.sampled);
        self.sample_blocks(req, &mut sampled);
        let d = self.route_sampled(req, now_ms, &sampled);
        self.scratch.sampled = sampled;
        d
    }

    /// The request's blocks the working set samples, into `out` (left empty with the term off).
    pub(super) fn sample_blocks(&self, req: &RouteRequest, out: &mut Vec<u64>) {
        out.clear();
        if let Some(ws) = &self.working_set {
            // Over the slice itself: `PromptIdentity::key` would match on the kind at every block.
            let sampling = ws.sampling();
            let keep = |k: &u64| sampling.keeps(*k);
            match &req.identity {
                PromptIdentity::Exact(h) => out.extend(h.iter().map(|h| h.0).filter(keep)),
                PromptIdentity::Approximate(h) => out.extend(h.iter().map(|h| h.0).filter(keep)),
            }
        }
    }

    /// [`Router::route`] with the request's working-set sample taken already.
    pub(super) fn route_sampled(
        &mut self,
        req: &RouteRequest,
        now_ms: u64,
        sampled: &[u64],
    ) -> Decision {
        self.clock_ms = self.clock_ms.max(now_ms);
        let bs = self.cfg.block_size as f64;
        let request_blocks = (req.prompt_tokens as f64 / bs).ceil();
        let overlap = self.overlap_blocks(req, now_ms);
        let eff = self.effective_load();
        self.health.refresh(now_ms);
        let avoided = self.avoided();
        let active_prefix = self.active_prefix(req);
        let mut affinity = std::mem::take(&mut self.scratch.approx);
        self.affinity(req, now_ms, &mut affinity);
        let working_set = self.cache_fits(now_ms, sampled);
        let (speed, speed_spread, speed_stale, reuse_share) = self.learned_speeds(now_ms);
        let floor = self.cfg.kv_load.overflow_reuse_floor;
        let working_set_scale = match &self.working_set {
            Some(ws) if floor > 0.0 => kv_load::reuse_ramp(ws.reuse_share(), floor),
            _ => 1.0,
        };
        let (adapter, adapter_load_s) = self.adapter_fits(req);
        let prefill_head = if self.decider.needs.prefill_head {
            self.prefill_progress(now_ms)
        } else {
            Vec::new()
        };
        let input = Input {
            working_set: &working_set,
            working_set_scale,
            request_blocks,
            block_size: bs,
            load: &eff,
            overlap: &overlap,
            active_prefix: &active_prefix,
            affinity: &affinity,
            identity_blocks: req.identity.blocks(),
            session_key: req.session_key.as_deref(),
            avoided: &avoided,
            expected_output_tokens: self.outputs.expected(),
            speed: &speed,
            speed_spread: &speed_spread,
            speed_stale: &speed_stale,
            reuse_share,
            adapter: &adapter,
            adapter_load_s,
            prefill_head: &prefill_head,
        };
        let Choice {
            replica,
            costs,
            fallback,
        } = self.decider.choose(&input);
        self.scratch.approx = affinity;
        let (replica, probe, probe_backup) = self.probe_or(replica, now_ms);
        let matched_tokens: Vec<u64> = overlap
            .iter()
            .map(|&o| ((o * bs) as u64).min(req.prompt_tokens))
            .collect();
        self.count_decision(
            replica,
            fallback,
            req.prompt_tokens,
            matched_tokens[replica],
        );
        let backup = probe_backup.or_else(|| self.backup_for(replica, &costs));
        Decision {
            replica,
            policy: self.cfg.policy,
            fallback,
            prompt_tokens: req.prompt_tokens,
            matched_tokens,
            costs,
            backup,
            probe: probe.is_some(),
        }
    }

    /// `kv_time`'s inputs from what it learned: each replica's speed factor, its uncertainty and
    /// whether it is stale at `now_ms`, and the traffic's reuse share; empty and 0 for a policy
    /// that does not price time.
    fn learned_speeds(&self, now_ms: u64) -> (Vec<f64>, Vec<f64>, Vec<bool>, f64) {
        if !self.decider.needs.speed {
            return (Vec::new(), Vec::new(), Vec::new(), 0.0);
        }
        let LearnedInputs {
            factors,
            spreads,
            stale,
        } = self
            .decider
            .policy
            .learning()
            .map(|l| l.inputs(now_ms))
            .unwrap_or_default();
        let reuse_share = self.working_set.as_ref().map_or(0.0, |ws| ws.reuse_share());
        (factors, spreads, stale, reuse_share)
    }

    /// Leading blocks of the request already booked on each replica by requests in flight (the
    /// policy's `active_prefix`); empty unless the policy asks for it.
    fn active_prefix(&self, req: &RouteRequest) -> Vec<f64> {
        if self.decider.needs.active_prefix {
            let (n, id) = (req.identity.blocks(), &req.identity);
            (0..self.replicas())
                .map(|r| self.load.active_prefix_by(r, n, |i| id.key(i)) as f64)
                .collect()
        } else {
            Vec::new()
        }
    }

    /// Leading blocks this router itself last sent to each replica (the approximate index, the
    /// policy's `affinity`), into `out`: cleared, and left empty unless the policy asks for it.
    fn affinity(&mut self, req: &RouteRequest, now_ms: u64, out: &mut Vec<u32>) {
        out.clear();
        if self.decider.needs.affinity {
            match &req.identity {
                PromptIdentity::Exact(h) => {
                    self.approx_seq
                        .match_prefix(h, now_ms, self.replicas(), out)
                }
                PromptIdentity::Approximate(h) => {
                    self.approx_text
                        .match_prefix(h, now_ms, self.replicas(), out)
                }
            }
        }
    }

    /// The working-set term's input (section 2.6), after what has aged out expires: per replica
    /// its working set, what `sampled` adds to it and the cache it must fit; empty unless the
    /// policy asks for it.
    fn cache_fits(&mut self, now_ms: u64, sampled: &[u64]) -> Vec<CacheFit> {
        // The router keeps a working set only when the policy asks for one (`Router::new`).
        if let Some(ws) = &mut self.working_set {
            ws.expire(now_ms);
        }
        match (&self.working_set, self.decider.needs.working_set) {
            (Some(ws), Some(sizing)) => {
                let added = ws.added(sampled);
                let smallest = self.smallest_shown_cache();
                (0..self.replicas())
                    .map(|r| CacheFit {
                        working_set: ws.blocks(r),
                        added: added.get(r).copied().unwrap_or(0.0),
                        cache: self.cache_blocks_by(r, sizing, smallest),
                    })
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    /// An ejected replica's probe, when one is due, takes this request; the policy's `choice`
    /// becomes its backup (Envoy retries a failed probe there). Returns the replica the request
    /// goes to, the probed replica if any, and the backup the probe leaves.
    fn probe_or(&mut self, choice: usize, now_ms: u64) -> (usize, Option<usize>, Option<usize>) {
        let fleet = &self.fleet;
        let probe = self.health.take_probe(now_ms, |r| fleet.is_up(r));
        match probe {
            Some(p) if p != choice => (p, probe, Some(choice)),
            _ => (choice, probe, None),
        }
    }

    /// Routes a read request and admits it under `request_id`: "route then admit" in one step, as the
    /// filter, the component and the playground all do it (a decision that is not admitted leaves the
    /// load table blind to the request).
    pub fn route_and_admit(
        &mut self,
        request_id: u64,
        req: &RouteRequest,
        now_ms: u64,
    ) -> Decision {
        let mut sampled = std::mem::take(&mut self.scratch.sampled);
        self.sample_blocks(req, &mut sampled);
        let d = self.route_sampled(req, now_ms, &sampled);
        self.admit_sampled(request_id, req, &d, now_ms, &sampled);
        self.scratch.sampled = sampled;
        d
    }

    /// Routes a request whose body was not read (absent, too large, refused by the host) by load
    /// alone, and admits it with its prompt estimated at 4 body bytes a token (the ratio of the
    /// approximate text identity).
    pub fn route_unread(&mut self, request_id: u64, body_bytes: usize, now_ms: u64) -> Decision {
        let d = self.route_fallback(now_ms);
        self.admit_unread(request_id, &d, (body_bytes / 4) as u64);
        d
    }

    /// Reads a body and routes it, admitting it under `request_id`; a body the parser refuses (too
    /// large, not JSON, no prompt, ...) is routed by [`Router::route_unread`] instead, and the error
    /// comes back beside the decision so the caller can count it. Never fails to decide.
    pub fn route_body(
        &mut self,
        request_id: u64,
        path: &str,
        body: &[u8],
        session_key: Option<&str>,
        tokenizer: Option<&mut dyn PromptTokenizer>,
        now_ms: u64,
    ) -> (Decision, Option<RequestError>) {
        self.route_body_early(request_id, path, body, session_key, tokenizer, None, now_ms)
    }

    /// [`Router::route_body`] for a body an [`EarlyScan`] followed as it arrived (the same decision;
    /// the ids the scan read are not read again).
    #[allow(clippy::too_many_arguments)]
    pub fn route_body_early(
        &mut self,
        request_id: u64,
        path: &str,
        body: &[u8],
        session_key: Option<&str>,
        tokenizer: Option<&mut dyn PromptTokenizer>,
        early: Option<EarlyScan>,
        now_ms: u64,
    ) -> (Decision, Option<RequestError>) {
        let read = read_request_early(
            path,
            body,
            session_key,
            self.cfg.block_size,
            self.cfg.max_body_bytes,
            tokenizer,
            early,
            self.cfg.adapters.as_ref(),
        );
        match read {
            Ok(req) => (self.route_and_admit(request_id, &req, now_ms), None),
            Err(e) => (self.route_unread(request_id, body.len(), now_ms), Some(e)),
        }
    }

    /// A load-only choice for a request whose body could not be read (too large, not JSON, ...).
    pub fn route_fallback(&mut self, now_ms: u64) -> Decision {
        self.clock_ms = self.clock_ms.max(now_ms);
        let eff = self.effective_load();
        self.health.refresh(now_ms);
        let costs = least_load::costs(&eff, self.cfg.block_size as f64, 0.0, &self.cfg.least_load);
        let replica = pick_lowest(&costs, &self.avoided(), &mut self.decider.rng);
        let backup = self.backup_for(replica, &costs);
        self.unread_decision(replica, costs, backup)
    }

    /// The decision for a request whose body was not read, routed by load (`costs`), counted as
    /// such: no prompt, nothing matched.
    pub(super) fn unread_decision(
        &mut self,
        replica: usize,
        costs: Vec<f64>,
        backup: Option<usize>,
    ) -> Decision {
        self.count_decision(replica, Some(FallbackReason::BodyUnreadable), 0, 0);
        Decision {
            replica,
            policy: self.cfg.policy,
            fallback: Some(FallbackReason::BodyUnreadable),
            prompt_tokens: 0,
            matched_tokens: Vec::new(),
            costs,
            backup,
            probe: false,
        }
    }

    /// Tells the router which units share an address (`groups[unit]` equal): the data-parallel ranks
    /// of one endpoint. A retry goes to an address with the first choice's headers, so a backup on
    /// the chosen unit's own address would retry the same engine; the backup is taken from another
    /// address whenever one is usable. Ignored unless it names every unit.
    pub fn set_address_groups(&mut self, groups: Vec<usize>) {
        self.fleet.set_address_groups(groups);
    }

    pub(super) fn backup_for(&self, chosen: usize, costs: &[f64]) -> Option<usize> {
        self.backup_among(chosen, costs, |_| true)
    }

    /// The backup for `chosen` among the replicas `eligible` accepts: the cheapest by `costs` (the
    /// next one cyclically when there are no costs, as under round robin), never an avoided one,
    /// and on another address whenever one is usable.
    pub(super) fn backup_among(
        &self,
        chosen: usize,
        costs: &[f64],
        eligible: impl Fn(usize) -> bool,
    ) -> Option<usize> {
        let avoided = self.avoided();
        let group = |r: usize| self.fleet.group(r);
        let ok = |r: usize| r != chosen && !avoided[r] && eligible(r);
        let elsewhere = (0..self.replicas()).any(|r| ok(r) && group(r) != group(chosen));
        let fits = |r: usize| ok(r) && (!elsewhere || group(r) != group(chosen));
        if costs.len() == self.replicas() {
            (0..self.replicas())
                .filter(|&r| fits(r))
                .min_by(|&a, &b| costs[a].total_cmp(&costs[b]))
        } else {
            (1..self.replicas())
                .map(|i| (chosen + i) % self.replicas())
                .find(|&r| fits(r))
        }
    }

    pub(super) fn count_decision(
        &mut self,
        replica: usize,
        fallback: Option<FallbackReason>,
        prompt: u64,
        matched: u64,
    ) {
        self.stats.decisions[replica] += 1;
        self.stats.prompt_tokens += prompt;
        self.stats.matched_tokens += matched;
        match fallback {
            Some(FallbackReason::NoSessionKey) => self.stats.fallback_no_session_key += 1,
            Some(FallbackReason::BelowMatchThreshold) => {
                self.stats.fallback_below_match_threshold += 1
            }
            Some(FallbackReason::BodyUnreadable) => self.stats.fallback_body_unreadable += 1,
            None => {}
        }
    }
}

#[cfg(test)]
mod address_group_tests {
    use super::*;
    use crate::config::{PolicyKind, RoutingConfig};

    fn decide(groups: Option<Vec<usize>>, policy: PolicyKind) -> Vec<(usize, Option<usize>)> {
        let cfg = RoutingConfig {
            policy,
            block_size: 4,
            ..RoutingConfig::default()
        };
        let mut r = Router::new(cfg, 4).unwrap();
        if let Some(g) = groups {
            r.set_address_groups(g);
        }
        (0..8u64)
            .map(|id| {
                let prompt: Vec<u32> = (0..32).map(|i| id as u32 * 100 + i).collect();
                let body = format!("{{\"prompt\":{prompt:?},\"max_tokens\":8}}");
                let req = r
                    .read_request("/v1/completions", body.as_bytes(), None)
                    .unwrap();
                let d = r.route_and_admit(id, &req, id);
                (d.replica, d.backup)
            })
            .collect()
    }

    #[test]
    fn a_backup_is_taken_from_another_address() {
        // Units 0-2 are three ranks of one endpoint, unit 3 another endpoint.
        for policy in [PolicyKind::RoundRobin, PolicyKind::KvLoad] {
            let grouped = decide(Some(vec![0, 0, 0, 3]), policy);
            for &(chosen, backup) in &grouped {
                let backup = backup.expect("a backup");
                if chosen < 3 {
                    assert_eq!(backup, 3, "{policy:?}: {grouped:?}");
                } else {
                    assert!(backup < 3, "{policy:?}: {grouped:?}");
                }
            }
        }
        // Without groups round robin's backup is the next unit, a rank of the same endpoint.
        let plain = decide(None, PolicyKind::RoundRobin);
        assert!(
            plain.iter().any(|&(c, b)| c < 2 && b == Some(c + 1)),
            "{plain:?}"
        );
        // A grouping that does not name every unit is ignored.
        assert_eq!(decide(Some(vec![0, 0]), PolicyKind::RoundRobin), plain);
    }
}
