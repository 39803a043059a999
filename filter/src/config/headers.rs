//! The headers the filter reads and writes, and how the chosen replica is handed to the proxy: a
//! header (the destination or the cluster header, with the data-parallel rank header beside it) or
//! an nginx variable.

use super::{ConfigError, FilterConfig, err};
use serde::Deserialize;

/// How the chosen replica is handed to the proxy.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OutputMode {
    /// Write `IP:port` into the destination header, read by Envoy's `override_host` LB policy.
    #[default]
    DestinationHeader,
    /// Write the replica's cluster name into `cluster_header` and clear the route cache, for users who
    /// keep one Envoy cluster per replica and route with `cluster_header`.
    ClusterHeader,
    /// Write `IP:port` into an nginx variable with `set_property(["ngx", VAR])` (ngx_wasm_module).
    NginxVariable,
}

pub(super) fn d_session_header() -> String {
    "x-session-id".into()
}
pub(super) fn d_destination_header() -> String {
    "x-gateway-destination-endpoint".into()
}
pub(super) fn d_cluster_header() -> String {
    "x-kvsteer-cluster".into()
}
pub(super) fn d_rank_header() -> String {
    kvsteer_core::dp::DEFAULT_RANK_HEADER.into()
}
pub(super) fn d_nginx_variable() -> String {
    "kvsteer_upstream".into()
}

pub(super) fn valid_header(s: &str) -> bool {
    !s.is_empty()
        && !s.starts_with(':')
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl FilterConfig {
    /// The request path's header names (session, destination, cluster, rank) must be lowercase
    /// header names.
    pub(super) fn validate_headers(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("session_header", &self.session_header),
            ("destination_header", &self.destination_header),
            ("cluster_header", &self.cluster_header),
            ("rank_header", &self.rank_header),
        ] {
            if !valid_header(value) {
                return err(field, format!("{value:?} must be a lowercase header name"));
            }
        }
        Ok(())
    }
}
