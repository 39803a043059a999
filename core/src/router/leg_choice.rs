//! Prefill/decode disaggregation (crate::disaggregation, docs/design/pd.md): both legs of a request chosen,
//! the decode leg as a proxy's destination, a body that cannot be split, and both legs booked.

use super::{Decision, Router};
use crate::config::PolicyKind;
use crate::disaggregation::{self, PdDecision, PdError, PdParams, Role, round_robin_among};
use crate::policy::{argmin_random_tie, least_load, masked, pick_lowest};
use crate::request::RouteRequest;

impl Router {
    /// Chooses both ends of a P/D request (crate::disaggregation, docs/design/pd.md): a prefill replica among those
    /// whose role prefills, a decode replica among those whose role decodes. Replicas down or
    /// ejected are avoided while the side has another. Does not admit: call [`Router::admit_pd`].
    pub fn route_pd(
        &mut self,
        req: &RouteRequest,
        roles: &[Role],
        params: &PdParams,
        now_ms: u64,
    ) -> Result<PdDecision, PdError> {
        check_roles(roles, self.replicas())?;
        self.clock_ms = self.clock_ms.max(now_ms);
        let bs = self.cfg.block_size as f64;
        let request_blocks = (req.prompt_tokens as f64 / bs).ceil();
        let overlap = self.overlap_blocks(req, now_ms);
        self.health.refresh(now_ms);
        let (p_avoided, d_avoided) = self.sides_avoided(roles);
        let (prefill, decode, prefill_costs, decode_costs) = if self.cfg.policy
            == PolicyKind::RoundRobin
        {
            let n = self.replicas();
            let p = round_robin_among(n, &mut self.decider.pd_rr.0, |r| !p_avoided[r]);
            let d = round_robin_among(n, &mut self.decider.pd_rr.1, |r| !d_avoided[r]);
            (p, d, Vec::new(), Vec::new())
        } else {
            let eff = self.effective_load();
            let in_time = self.load.accounting().prefill_in_time;
            let pc = disaggregation::prefill_costs(
                request_blocks,
                bs,
                &overlap,
                &eff,
                roles,
                params,
                in_time,
            );
            let dc = disaggregation::decode_costs(request_blocks, &overlap, &eff, roles, params);
            let p = argmin_random_tie(&masked(&pc, &p_avoided), &mut self.decider.rng);
            let d = argmin_random_tie(&masked(&dc, &d_avoided), &mut self.decider.rng);
            (p, d, pc, dc)
        };
        // Both sides have an eligible replica (checked above), so neither is None; stay total anyway.
        let prefill = prefill.ok_or(PdError::NoPrefillReplica)?;
        let decode = decode.ok_or(PdError::NoDecodeReplica)?;
        let matched = |r: usize| ((overlap[r] * bs) as u64).min(req.prompt_tokens);
        // An ejected replica's probe, when one is due, takes its side's leg; the side's own choice
        // becomes the backup. One probe per side and request, never the same replica for both.
        let fleet = &self.fleet;
        let up = |r: usize| fleet.is_up(r);
        let p_probe = self
            .health
            .take_probe(now_ms, |r| roles[r].prefills() && up(r))
            .filter(|&p| p != prefill);
        let (prefill, prefill_backup, prefill_probe) = match p_probe {
            Some(p) => (p, Some(prefill), true),
            None => {
                let retry = self.backup_among(prefill, &prefill_costs, |r| roles[r].prefills());
                (prefill, retry, false)
            }
        };
        let prefill_backup = prefill_backup.map(|b| (b, matched(b)));
        let (decode, decode_backup) = self.probe_decode(roles, prefill, decode, now_ms);
        let prefill_matched_tokens = matched(prefill);
        self.count_decision(prefill, None, req.prompt_tokens, prefill_matched_tokens);
        Ok(PdDecision {
            prefill,
            decode,
            prompt_tokens: req.prompt_tokens,
            prefill_matched_tokens,
            transfer_tokens: req.prompt_tokens - matched(decode),
            prefill_costs,
            decode_costs,
            prefill_backup,
            prefill_probe,
            decode_backup,
        })
    }

    /// A due probe of a replica that decodes takes the decode leg (never on `prefill`, the prefill
    /// leg's replica); the side's own choice, `decode`, becomes its backup.
    fn probe_decode(
        &mut self,
        roles: &[Role],
        prefill: usize,
        decode: usize,
        now_ms: u64,
    ) -> (usize, Option<usize>) {
        let fleet = &self.fleet;
        let up = |r: usize| fleet.is_up(r);
        let d_probe = self
            .health
            .take_probe(now_ms, |r| roles[r].decodes() && up(r) && r != prefill)
            .filter(|&d| d != decode);
        match d_probe {
            Some(d) => (d, Some(decode)),
            None => (decode, None),
        }
    }

    /// The replicas each side of a P/D request avoids (prefill, decode): those not in its role or
    /// not present, and unusable ones unless the side has no usable one.
    fn sides_avoided(&self, roles: &[Role]) -> (Vec<bool>, Vec<bool>) {
        let usable: Vec<bool> = (0..self.replicas()).map(|r| self.is_usable(r)).collect();
        // A side avoids unusable replicas unless it has no usable one.
        let side_avoided = |takes: &dyn Fn(Role) -> bool| -> Vec<bool> {
            let any = (0..roles.len()).any(|r| takes(roles[r]) && usable[r]);
            (0..roles.len())
                .map(|r| !takes(roles[r]) || !self.fleet.is_member(r) || (any && !usable[r]))
                .collect()
        };
        (
            side_avoided(&|r: Role| r.prefills()),
            side_avoided(&|r: Role| r.decodes()),
        )
    }

    /// The decode leg of a P/D decision as a [`Decision`] (what a proxy writes as the destination),
    /// with a retry backup among the other replicas that decode: the cheapest by the decode score,
    /// or the next one under round robin, skipping replicas down or ejected while another decodes.
    /// Any decode replica can take a decode leg: the prefill answer's `kv_transfer_params` name the
    /// producer, not the consumer.
    pub fn pd_decode_decision(&self, d: &PdDecision, roles: &[Role]) -> Decision {
        let decodes = |r: usize| roles.get(r).is_some_and(|x| x.decodes());
        let n = self.replicas();
        let candidates = |usable_only: bool| {
            (1..n).map(move |i| (d.decode + i) % n).filter(move |&r| {
                decodes(r) && self.is_member(r) && (!usable_only || self.is_usable(r))
            })
        };
        let cheapest = |usable_only: bool| {
            if d.decode_costs.len() == n {
                candidates(usable_only)
                    .min_by(|&a, &b| d.decode_costs[a].total_cmp(&d.decode_costs[b]))
            } else {
                candidates(usable_only).next()
            }
        };
        let backup = d
            .decode_backup
            .or_else(|| cheapest(true))
            .or_else(|| cheapest(false));
        Decision {
            replica: d.decode,
            policy: self.cfg.policy,
            fallback: None,
            prompt_tokens: d.prompt_tokens,
            matched_tokens: Vec::new(),
            costs: d.decode_costs.clone(),
            backup,
            probe: d.decode_backup.is_some(),
        }
    }

    /// [`Router::route_unread`] in a P/D fleet: a request whose body cannot be split into two legs
    /// goes whole, by load, to a replica that decodes (it computes the prompt itself), never to a
    /// prefill-only one. Replicas down or ejected are avoided while another decodes.
    pub fn route_unread_pd(
        &mut self,
        request_id: u64,
        body_bytes: usize,
        roles: &[Role],
        now_ms: u64,
    ) -> Decision {
        self.clock_ms = self.clock_ms.max(now_ms);
        let eff = self.effective_load();
        self.health.refresh(now_ms);
        let costs = least_load::costs(&eff, self.cfg.block_size as f64, 0.0, &self.cfg.least_load);
        let decodes = |r: usize| roles.get(r).is_none_or(|x| x.decodes());
        let base = self.avoided();
        let any = (0..self.replicas()).any(|r| decodes(r) && !base[r]);
        let avoided: Vec<bool> = (0..self.replicas())
            .map(|r| !decodes(r) || (any && base[r]))
            .collect();
        let replica = pick_lowest(&costs, &avoided, &mut self.decider.rng);
        let backup = (0..self.replicas())
            .filter(|&r| r != replica && !avoided[r])
            .min_by(|&a, &b| costs[a].total_cmp(&costs[b]));
        let d = self.unread_decision(replica, costs, backup);
        self.admit_unread(request_id, &d, (body_bytes / 4) as u64);
        d
    }

    /// Starts tracking both legs of a P/D request: the prefill leg under `prefill_id` on the prefill
    /// replica (its uncached prompt as prefill load, one output token), the decode leg under
    /// `decode_id` on the decode replica (the prompt's blocks as its KV; one token of prefill, the
    /// last prompt token it computes itself). Release each leg when it ends.
    pub fn admit_pd(
        &mut self,
        prefill_id: u64,
        decode_id: u64,
        req: &RouteRequest,
        d: &PdDecision,
        now_ms: u64,
    ) {
        if d.prefill >= self.replicas() || d.decode >= self.replicas() {
            self.stats.bad_replica += 1;
            return;
        }
        self.admit_prefill_leg(prefill_id, req, d.prefill, d.prefill_matched_tokens, now_ms);
        let keys = || (0..req.identity.blocks()).map(|i| req.identity.key(i));
        self.load.admit_at(
            decode_id,
            d.decode,
            req.prompt_tokens,
            1,
            req.output_hint,
            keys(),
            now_ms,
        );
    }

    /// Books a P/D request's prefill leg alone under `prefill_id` on `replica` (its uncached prompt
    /// as prefill load, one output token): [`Router::admit_pd`]'s first half, and how a prefill leg
    /// moved to the backup after a failed probe is booked again.
    pub fn admit_prefill_leg(
        &mut self,
        prefill_id: u64,
        req: &RouteRequest,
        replica: usize,
        matched_tokens: u64,
        now_ms: u64,
    ) {
        if replica >= self.replicas() {
            self.stats.bad_replica += 1;
            return;
        }
        self.clock_ms = self.clock_ms.max(now_ms);
        let uncached = req.prompt_tokens.saturating_sub(matched_tokens);
        self.load.admit_at(
            prefill_id,
            replica,
            req.prompt_tokens,
            uncached,
            Some(1),
            (0..req.identity.blocks()).map(|i| req.identity.key(i)),
            now_ms,
        );
    }
}

/// A P/D request needs one role per replica, and at least one replica on each side.
fn check_roles(roles: &[Role], replicas: usize) -> Result<(), PdError> {
    if roles.len() != replicas {
        return Err(PdError::RolesLength {
            roles: roles.len(),
            replicas,
        });
    }
    if !roles.iter().any(|r| r.prefills()) {
        return Err(PdError::NoPrefillReplica);
    }
    if !roles.iter().any(|r| r.decodes()) {
        return Err(PdError::NoDecodeReplica);
    }
    Ok(())
}
