//! Where a released request goes, as the proxy decides it: the replica the filter named in the way
//! the output mode says (Envoy's destination or cluster header, or nginx's variable), else the
//! proxy's own balancing; then the endpoint's rank, the oracle's override in the bench's limit, and
//! Envoy's retry on a replica failing fast. Kept apart from the request's phases because this is the
//! part that differs between proxies.

use super::{Harness, Output, RequestSpec, ResponseFault};
use crate::host::{HostError, HostMode, StreamState};
use kvsteer_sim::Engine;
use serde_json::Value;

/// Where a released request was placed, and how.
pub(super) struct Placement {
    /// What the filter wrote (header value or nginx variable), unparsed.
    pub(super) destination: Option<String>,
    /// The engine that serves it.
    pub(super) replica: usize,
    /// The replica first chosen, when it failed the request at once and the proxy retried.
    pub(super) retried_from: Option<usize>,
    /// No usable destination: the proxy's own balancing chose.
    pub(super) fallback: bool,
    /// The oracle placed it ([`super::HarnessConfig::oracle`]): the filter is not told where.
    pub(super) oracle: bool,
}

impl Harness {
    /// Places a released request: the filter's choice (or the proxy's fallback), on the rank its
    /// endpoint gives it, overridden by the oracle when on, and retried per
    /// [`super::HarnessConfig::retry_5xx`]. Counts fallbacks, oracle moves and retries.
    pub(super) fn place(&mut self, id: u64, spec: &RequestSpec, st: &StreamState) -> Placement {
        let (destination, chosen) = self.destination(st);
        let fallback = chosen.is_none();
        let endpoint_replica = match chosen {
            Some(r) => r,
            None => self.fallback_replica(),
        };
        let mut replica = self.engine_for(endpoint_replica, st);
        let oracle = self.cfg.oracle.filter(|_| spec.raw_body.is_none());
        if let Some(weights) = oracle
            && let Some(c) = self.oracle_choice(id, spec, weights)
        {
            self.stats.oracle_placed += 1;
            if c != replica {
                self.stats.oracle_moved += 1;
            }
            replica = c;
        }
        let mut retried_from = None;
        if let Some(b) = self.retry_target(replica, destination.as_deref()) {
            self.replicas[replica].faulted += 1;
            self.stats.retries += 1;
            retried_from = Some(replica);
            replica = self.engine_for(b, st);
        }
        Placement {
            destination,
            replica,
            retried_from,
            fallback,
            oracle: oracle.is_some(),
        }
    }

    /// Where the proxy's own load balancer sends a request the filter gave no usable destination:
    /// round robin over the endpoints (then the endpoint over its ranks), as Envoy's override_host
    /// policy falls back to the cluster's balancing.
    fn fallback_replica(&mut self) -> usize {
        self.stats.fallback += 1;
        let e = self.rr_fallback % self.endpoints.len();
        let r = self.endpoints[e].units.start;
        self.rr_fallback += 1;
        r
    }

    /// Envoy's `retry_on: 5xx`: when `replica` fails requests at once with a 5xx, the next host of
    /// the destination list (override_host's second entry), if that one is not failing too.
    fn retry_target(&self, replica: usize, destination: Option<&str>) -> Option<usize> {
        let retries = self.cfg.retry_5xx
            && self.cfg.mode == HostMode::Envoy
            && self.cfg.output == Output::DestinationHeader;
        let fails_fast =
            matches!(self.replicas[replica].response_fault, ResponseFault::Status(c) if c >= 500);
        if !(retries && fails_fast) {
            return None;
        }
        let b = destination
            .and_then(|d| d.split(',').nth(1))
            .and_then(|e| self.replica_of_endpoint(e.trim()))?;
        (self.replicas[b].response_fault == ResponseFault::Healthy).then_some(b)
    }

    /// The oracle's replica for a request ([`crate::oracle::choose`]): replicas failing requests
    /// ([`ResponseFault`] other than healthy) are down to it. `None` when no replica would take it.
    fn oracle_choice(
        &self,
        id: u64,
        spec: &RequestSpec,
        weights: crate::oracle::Weights,
    ) -> Option<usize> {
        let engines: Vec<&Engine> = self.replicas.iter().map(|r| &r.engine).collect();
        let usable: Vec<bool> = self
            .replicas
            .iter()
            .map(|r| r.response_fault == ResponseFault::Healthy)
            .collect();
        let req = crate::oracle::OracleRequest {
            id,
            prompt: &spec.prompt,
            output_tokens: spec.max_tokens,
        };
        crate::oracle::choose(self.now_us, &engines, &usable, &req, weights).map(|c| c.replica)
    }

    /// Envoy mode: sets `upstream.address` to the endpoint the request went to, as Envoy does once
    /// it picked a host; the filter reads it to tell a retry from its own choice.
    pub(super) fn tell_upstream_address(
        &mut self,
        w: usize,
        stream: u32,
        replica: usize,
    ) -> Result<(), HostError> {
        if self.cfg.mode != HostMode::Envoy {
            return Ok(());
        }
        let endpoint = self.replicas[replica].endpoint.clone();
        self.workers[w].set_stream_property(stream, &["upstream", "address"], endpoint.as_bytes())
    }

    /// Tells the filter a replica produced the answer about to come, as the proxy does: Envoy's
    /// `response.code_details` `via_upstream`; nginx's `$upstream_status` (ngx_wasm_module's
    /// `ngx.upstream_status` property) with the replica's status.
    pub(super) fn tell_answered_by_replica(
        &mut self,
        w: usize,
        stream: u32,
        status: u16,
    ) -> Result<(), HostError> {
        match self.cfg.mode {
            HostMode::Envoy => self.workers[w].set_stream_property(
                stream,
                &["response", "code_details"],
                b"via_upstream",
            ),
            HostMode::Nginx => self.workers[w].set_stream_property(
                stream,
                &["ngx", "upstream_status"],
                status.to_string().as_bytes(),
            ),
        }
    }

    /// Tells the filter the proxy produced the answer about to come ([`super::ProxyAnswer`]):
    /// Envoy's `response.code_details` as given; nginx leaves `$upstream_status` empty.
    pub(super) fn tell_proxy_answered(
        &mut self,
        w: usize,
        stream: u32,
        details: &str,
    ) -> Result<(), HostError> {
        match self.cfg.mode {
            HostMode::Envoy => self.workers[w].set_stream_property(
                stream,
                &["response", "code_details"],
                details.as_bytes(),
            ),
            HostMode::Nginx => Ok(()),
        }
    }

    /// The replica the filter chose, from what it wrote for the configured output mode.
    fn destination(&self, st: &StreamState) -> (Option<String>, Option<usize>) {
        let cfg_str = |key: &str, default: &str| -> String {
            self.cfg
                .filter_extra
                .get(key)
                .and_then(Value::as_str)
                .unwrap_or(default)
                .to_string()
        };
        match self.cfg.output {
            Output::DestinationHeader => {
                let name = cfg_str("destination_header", "x-gateway-destination-endpoint");
                let v = st.upstream_header(&name).map(str::to_string);
                // override_host takes the first entry of a comma-separated list.
                let r = v
                    .as_deref()
                    .and_then(|v| v.split(',').next())
                    .and_then(|e| self.replica_of_endpoint(e.trim()));
                (v, r)
            }
            Output::ClusterHeader => {
                let name = cfg_str("cluster_header", "x-kvsteer-cluster");
                let v = st.upstream_header(&name).map(str::to_string);
                let r = v
                    .as_deref()
                    .and_then(|c| self.replicas.iter().position(|r| r.cluster == c));
                (v, r)
            }
            Output::NginxVariable => {
                let var = cfg_str("nginx_variable", "kvsteer_upstream");
                let v = st.property(&["ngx", &var]).map(str::to_string);
                let r = v.as_deref().and_then(|e| self.replica_of_endpoint(e));
                (v, r)
            }
        }
    }
}
