//! How a request ended, for its replica's health (docs/design/design.md, section 2.4): who produced
//! the response, and the outcome reported once against the replica that answered, or settled as
//! counting for none.

use super::Stream;
use crate::config::OutputMode;
use crate::host::abi;
use crate::host::clock::now_ms;
use crate::host::metrics::inc;
use crate::worker::Origin;
use kvsteer_core::health::Outcome;

impl Stream {
    /// Reports how the request ended for its replica's health, once: the replica the proxy says
    /// answered (`upstream.address`, Envoy) tells a retry elsewhere from the first choice's answer.
    /// A request whose failures do not count (an oversized body) blames no retry either.
    pub(super) fn report_outcome(&mut self, outcome: Outcome) {
        if self.outcome_reported {
            return;
        }
        let (Some(replica), Some(vm)) = (self.replica, self.vm.as_ref()) else {
            return;
        };
        self.outcome_reported = true;
        let served = abi::get_property(&["upstream", "address"]).ok().flatten();
        vm.borrow_mut().pools[self.pool].state.request_outcome(
            replica,
            served.as_deref(),
            outcome,
            !self.oversized,
            now_ms(),
        );
    }

    /// Settles the request's outcome as counting for no replica (at most once); `failed`: the client
    /// got a failure (a 5xx, a failed attempt, an engine error), counted in
    /// `kvsteer_failures_not_blamed`.
    pub(super) fn settle_unblamed(&mut self, failed: bool) {
        if self.outcome_reported || self.replica.is_none() {
            return;
        }
        self.outcome_reported = true;
        if failed && let Some(vm) = &self.vm {
            let mut vm = vm.borrow_mut();
            vm.pools[self.pool].state.failure_not_blamed();
            inc(vm.pools[self.pool].metrics.failures_not_blamed, 1);
        }
    }

    /// Who produced the response ([`Origin`]). Envoy: `response.code_details`; a host without them
    /// (or refusing the call) falls back to whether an upstream was reached at all
    /// (`upstream.address`). nginx: `$upstream_status`, read through ngx_wasm_module's `ngx.*`
    /// properties; without it, the proxy's (nothing counts: conservative where nginx cannot tell).
    pub(super) fn answer_origin(&self) -> Origin {
        let nginx = self.vm.as_ref().is_some_and(|vm| {
            vm.borrow().pools[self.pool].state.config().output == OutputMode::NginxVariable
        });
        if nginx {
            return match abi::get_property(&["ngx", "upstream_status"]) {
                Ok(Some(v)) => Origin::from_nginx_upstream_status(&v),
                _ => Origin::Proxy,
            };
        }
        match abi::get_property(&["response", "code_details"]) {
            Ok(Some(d)) => Origin::from_envoy_details(&d),
            _ => match abi::get_property(&["upstream", "address"]) {
                Ok(Some(_)) => Origin::Replica,
                _ => Origin::Proxy,
            },
        }
    }
}
