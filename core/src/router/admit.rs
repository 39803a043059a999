//! Tracking a routed request through its life: admission (its uncached prompt becomes prefill load,
//! its prefix goes to the approximate index), first token (where `kv_time` learns a replica's speed),
//! decode progress and release.

use super::{Decision, Router};
use crate::policy::Observation;
use crate::policy::kv_time::Terms;
use crate::request::{PromptIdentity, RouteRequest};
use crate::speed::SpeedEstimate;

impl Router {
    /// Starts tracking a request sent where `d` says: its uncached prompt tokens become prefill load,
    /// and its prefix is recorded in the approximate index (a token prompt's only under
    /// `prefix_affinity`, the one reader of those records; a text prompt's always, as the overlap
    /// estimate of text prompts).
    pub fn admit(&mut self, request_id: u64, req: &RouteRequest, d: &Decision, now_ms: u64) {
        let mut sampled = std::mem::take(&mut self.scratch.sampled);
        self.sample_blocks(req, &mut sampled);
        self.admit_sampled(request_id, req, d, now_ms, &sampled);
        self.scratch.sampled = sampled;
    }

    /// [`Router::admit`] with the request's working-set sample taken already.
    pub(super) fn admit_sampled(
        &mut self,
        request_id: u64,
        req: &RouteRequest,
        d: &Decision,
        now_ms: u64,
        sampled: &[u64],
    ) {
        if d.replica >= self.replicas() {
            self.stats.bad_replica += 1;
            return;
        }
        self.clock_ms = self.clock_ms.max(now_ms);
        if let Some(ws) = &mut self.working_set {
            ws.record(d.replica, sampled, now_ms);
        }
        self.decider.policy.observe(Observation::Admitted {
            request_id,
            replica: d.replica,
            now_ms,
        });
        let matched = d.matched_tokens.get(d.replica).copied().unwrap_or(0);
        let uncached = req.prompt_tokens.saturating_sub(matched);

        self.load.admit_at(
            request_id,
            d.replica,
            req.prompt_tokens,
            uncached,
            req.output_hint,
            (0..req.identity.blocks()).map(|i| req.identity.key(i)),
            now_ms,
        );
        match &req.identity {
            // Token prompts' own decisions are read back only by a policy that asks for affinity
            // (`prefix_affinity`; the others take a token prompt's overlap from the KV index), and
            // the policy is fixed for the router's life, so under any other policy recording them
            // is pure cost: a third of an 8K-token request's admit and ~10% of its whole filter
            // path in wasm.
            PromptIdentity::Exact(h) => {
                if self.decider.needs.affinity {
                    self.approx_seq.record(d.replica, h, now_ms)
                }
            }
            PromptIdentity::Approximate(h) => self.approx_text.record(d.replica, h, now_ms),
        }
    }

    /// Starts tracking a request routed by [`Router::route_fallback`], whose prompt size is only
    /// estimated (e.g. body bytes / 4).
    pub fn admit_unread(&mut self, request_id: u64, d: &Decision, estimated_prompt_tokens: u64) {
        if d.replica >= self.replicas() {
            self.stats.bad_replica += 1;
            return;
        }
        self.load.admit_at(
            request_id,
            d.replica,
            estimated_prompt_tokens,
            estimated_prompt_tokens,
            None,
            [],
            self.clock_ms,
        );
    }

    pub fn first_token(&mut self, request_id: u64) {
        self.load.first_token(request_id);
    }

    /// The first token arrived at `now_ms`: [`Router::first_token`], and `kv_time` learns the
    /// replica's speed from it (observed time to first token against the prediction at admission).
    pub fn first_token_at(&mut self, request_id: u64, now_ms: u64) {
        self.load.first_token_at(request_id, now_ms);
        self.clock_ms = self.clock_ms.max(now_ms);
        self.decider
            .policy
            .observe(Observation::FirstToken { request_id, now_ms });
    }

    /// `kv_time`: every replica's cost terms for the last request routed (empty under another
    /// policy): what an operator reads to see why a replica won.
    pub fn last_terms(&self) -> &[Terms] {
        self.decider.policy.last_terms()
    }

    /// `kv_time`: one replica's learned time factor against the profile (2: twice as slow; 1 for an
    /// unknown replica or under another policy).
    pub fn speed_factor(&self, replica: usize) -> f64 {
        self.decider
            .policy
            .learning()
            .map_or(1.0, |l| l.factor(replica))
    }

    /// This worker's own estimates of the replicas' speeds, for the proxy's other workers.
    pub fn local_speeds(&self) -> Vec<SpeedEstimate> {
        match self.decider.policy.learning() {
            Some(l) => l.local(),
            // Nothing learned: each replica's estimate stands on no evidence.
            None => vec![SpeedEstimate::default(); self.replicas()],
        }
    }

    /// Replaces a peer worker's estimates of the replicas' speeds.
    pub fn set_peer_speeds(&mut self, peer: u32, estimates: &[SpeedEstimate]) {
        if let Some(l) = self.decider.policy.learning_mut() {
            l.set_peer(peer, estimates);
        }
    }

    pub fn clear_peer_speeds(&mut self, peer: u32) {
        if let Some(l) = self.decider.policy.learning_mut() {
            l.clear_peer(peer);
        }
    }

    /// `generated_tokens`: cumulative output tokens so far.
    pub fn decode_progress(&mut self, request_id: u64, generated_tokens: u64) {
        self.load.decode_progress(request_id, generated_tokens);
    }

    /// Output tokens the next request is expected to generate, learned from released requests.
    pub fn expected_output_tokens(&self) -> f64 {
        self.outputs.expected()
    }

    /// Completion or abort. False (and counted) for an unknown or already released request.
    pub fn release(&mut self, request_id: u64) -> bool {
        self.decider
            .policy
            .observe(Observation::Released { request_id });
        let Some(gone) = self.load.release_entry(request_id) else {
            return false;
        };
        self.outputs.observe(gone.generated);
        // Where the current report holds it (admitted before its poll), `merge` takes it off.
        self.reported.released(&gone);
        true
    }
}
