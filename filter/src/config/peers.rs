//! The working-set exchange with other proxies as configured: the `peers` section, its defaults,
//! its refusals and the reserved path and token header it gives the filter.

use super::headers::valid_header;
use super::{ConfigError, FilterConfig, err};
use serde::Deserialize;

/// The path a proxy answers its peers on when `peers.path` is not set; reserved either way: a
/// request for it is answered by the filter and never forwarded.
pub const DEFAULT_PEER_PATH: &str = "/.kvsteer/working-set";

fn d_peer_path() -> String {
    DEFAULT_PEER_PATH.into()
}
/// The header a peer's poll carries the token in when `peers.token_header` is not set.
pub const DEFAULT_PEER_TOKEN_HEADER: &str = "x-kvsteer-peer-token";

fn d_peer_token_header() -> String {
    DEFAULT_PEER_TOKEN_HEADER.into()
}
fn d_peer_poll() -> u64 {
    100
}
fn d_peer_timeout() -> u64 {
    1000
}
fn d_peer_max_bytes() -> usize {
    4 << 20
}

/// One peer proxy: how a callout reaches its filter.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeerSpec {
    /// Envoy: the cluster that reaches the peer proxy's listener; nginx: its `IP:port`.
    pub cluster: String,
    /// `:authority` of the callout; defaults to `cluster`.
    #[serde(default)]
    pub authority: Option<String>,
}

/// The `peers` section: other proxies in front of the same replicas, polled for their working-set
/// journals off the request path (docs/reports/proxies.md, "Working set across proxies").
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct PeersSection {
    /// The other proxies (not this one). Empty: this proxy polls nobody but answers its peers.
    #[serde(default)]
    pub proxies: Vec<PeerSpec>,
    /// The reserved path peers poll (`GET PATH?after=...`).
    #[serde(default = "d_peer_path")]
    pub path: String,
    /// The shared secret every proxy of the fleet sends and requires in `token_header`: a request
    /// for the path without it is refused (403), and an answer is only asked for with it.
    pub token: String,
    #[serde(default = "d_peer_token_header")]
    pub token_header: String,
    /// How often each peer is polled (at most one poll per peer in flight).
    #[serde(default = "d_peer_poll")]
    pub poll_ms: u64,
    #[serde(default = "d_peer_timeout")]
    pub timeout_ms: u64,
    /// A peer's answer over this many bytes is refused unread; this proxy's own answers stay under
    /// it too (a worker's journal that does not fit waits for the next poll).
    #[serde(default = "d_peer_max_bytes")]
    pub max_response_bytes: usize,
}

impl PeersSection {
    pub(super) fn validate(&self, tick_ms: u64) -> Result<(), ConfigError> {
        if self.proxies.len() > 64 {
            return err(
                "peers.proxies",
                format!("at most 64, got {}", self.proxies.len()),
            );
        }
        for (i, p) in self.proxies.iter().enumerate() {
            let printable = |s: &str| {
                !s.is_empty() && s.len() <= 256 && s.bytes().all(|b| b.is_ascii_graphic())
            };
            if !printable(&p.cluster) || !p.authority.as_deref().is_none_or(printable) {
                return err(
                    format!("peers.proxies[{i}]"),
                    "cluster and authority must be 1-256 printable ASCII characters",
                );
            }
        }
        if !self.path.starts_with('/')
            || self.path.len() > 256
            || !self
                .path
                .bytes()
                .all(|b| b.is_ascii_graphic() && b != b'?' && b != b'#')
        {
            return err(
                "peers.path",
                format!(
                    "{:?} must start with '/' and be up to 256 printable characters without '?' or '#'",
                    self.path
                ),
            );
        }
        if self.token.len() < 16
            || self.token.len() > 256
            || !self.token.bytes().all(|b| b.is_ascii_graphic())
        {
            return err("peers.token", "must be 16-256 printable ASCII characters");
        }
        if !valid_header(&self.token_header) {
            return err(
                "peers.token_header",
                format!("{:?} must be a lowercase header name", self.token_header),
            );
        }
        if self.poll_ms < tick_ms || self.poll_ms > 60_000 {
            return err(
                "peers.poll_ms",
                format!("must be tick_ms ({tick_ms})..=60000, got {}", self.poll_ms),
            );
        }
        if self.timeout_ms == 0 {
            return err("peers.timeout_ms", "must be positive");
        }
        if !(64..=1 << 30).contains(&self.max_response_bytes) {
            return err(
                "peers.max_response_bytes",
                format!("must be 64..=1073741824, got {}", self.max_response_bytes),
            );
        }
        Ok(())
    }
}

impl FilterConfig {
    /// The reserved path peers poll (answered by the filter, never forwarded).
    pub fn peer_path(&self) -> &str {
        self.peers.as_ref().map_or(DEFAULT_PEER_PATH, |p| &p.path)
    }

    /// The header a peer's poll carries the shared token in.
    pub fn peer_token_header(&self) -> &str {
        self.peers
            .as_ref()
            .map_or(DEFAULT_PEER_TOKEN_HEADER, |p| &p.token_header)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::FilterConfig;
    use crate::config::tests::{GOOD, refused};

    fn with_peers(peers: &str) -> String {
        format!(
            r#"{{"replicas":[{{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f"}}],"peers":{peers}}}"#
        )
    }

    #[test]
    fn the_peers_section_is_off_by_default_and_checked() {
        let c = FilterConfig::from_json(GOOD.as_bytes()).unwrap();
        assert_eq!(c.peers, None);
        assert_eq!(c.peer_path(), "/.kvsteer/working-set");
        let ok = with_peers(r#"{"proxies":[{"cluster":"peer_b"}],"token":"0123456789abcdef"}"#);
        let c = FilterConfig::from_json(ok.as_bytes()).unwrap();
        let p = c.peers.unwrap();
        assert_eq!(
            (p.poll_ms, p.timeout_ms, p.max_response_bytes),
            (100, 1000, 4 << 20)
        );
        assert_eq!(p.token_header, "x-kvsteer-peer-token");
        assert_eq!(p.path, "/.kvsteer/working-set");
        for (bad, field) in [
            (r#"{"proxies":[]}"#, "token"),
            (r#"{"token":"short"}"#, "peers.token"),
            (r#"{"token":"0123456789abcdef","path":"x"}"#, "peers.path"),
            (
                r#"{"token":"0123456789abcdef","path":"/a?b"}"#,
                "peers.path",
            ),
            (
                r#"{"token":"0123456789abcdef","poll_ms":10}"#,
                "peers.poll_ms",
            ),
            (
                r#"{"token":"0123456789abcdef","timeout_ms":0}"#,
                "peers.timeout_ms",
            ),
            (
                r#"{"token":"0123456789abcdef","max_response_bytes":1}"#,
                "peers.max_response_bytes",
            ),
            (
                r#"{"token":"0123456789abcdef","token_header":"X Y"}"#,
                "peers.token_header",
            ),
            (
                r#"{"token":"0123456789abcdef","proxies":[{"cluster":""}]}"#,
                "peers.proxies[0]",
            ),
            (r#"{"token":"0123456789abcdef","typo":1}"#, "typo"),
        ] {
            let e = refused(&with_peers(bad));
            assert!(e.contains(field), "{bad}: {e}");
        }
    }
}
