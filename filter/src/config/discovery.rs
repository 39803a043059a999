//! The `discovery` section: membership read at run time from a member list the filter polls
//! (docs/design/discovery.md). Discovered members take the routing slots after the static
//! replicas; the two lists add up.

use super::{ConfigError, FilterConfig, MAX_UNITS, OutputMode, Unit};
use serde::Deserialize;

/// The path polled when `discovery.path` is not set (what `kvsteer-feed discover` answers).
pub const DEFAULT_DISCOVERY_PATH: &str = "/kvsteer/members";

/// The name a slot has while no member holds it (and in per-unit metrics, whoever holds it).
pub fn slot_name(k: usize) -> String {
    format!("_slot{k}")
}

fn d_path() -> String {
    DEFAULT_DISCOVERY_PATH.into()
}
fn d_period() -> u64 {
    1_000
}
fn d_timeout() -> u64 {
    1_000
}
fn d_hold() -> u64 {
    10_000
}
fn d_max_members() -> usize {
    64
}
fn d_max_bytes() -> usize {
    1 << 20
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DiscoverySection {
    /// Envoy: the cluster that answers the member list (nginx: its `IP:port`).
    pub cluster: String,
    /// `:authority` of the poll; defaults to `cluster`.
    #[serde(default)]
    pub authority: Option<String>,
    /// The path polled (`GET`).
    #[serde(default = "d_path")]
    pub path: String,
    /// How often the list is polled (ms): a member that joins is routed to within about one period
    /// (plus its first feed poll), one that leaves stops getting requests within one.
    #[serde(default = "d_period")]
    pub period_ms: u64,
    /// How long a poll may take (ms).
    #[serde(default = "d_timeout")]
    pub timeout_ms: u64,
    /// How long a member that left keeps its slot and its index (ms): back within it (a pod that
    /// flaps, a list that missed it once), it is routed to again as it was; past it, its blocks and
    /// bookings are dropped and its slot is free for another member.
    #[serde(default = "d_hold")]
    pub hold_ms: u64,
    /// Slots for discovered members (DP ranks count one each): a list with more is refused whole.
    /// Every slot costs the per-replica state of a configured replica whether or not it is taken.
    #[serde(default = "d_max_members")]
    pub max_members: usize,
    /// A list over this many bytes is refused unread.
    #[serde(default = "d_max_bytes")]
    pub max_response_bytes: usize,
    /// Envoy: the cluster discovered members' feeds are polled through. It must hold every
    /// member's feed address and pick the host with `override_host` from the destination header
    /// (which the filter sets to the member's feed address on each poll). Required with Envoy.
    #[serde(default)]
    pub feed_cluster: Option<String>,
}

/// Refuses the section's `field` (`discovery.FIELD`; the section itself for an empty one).
fn err(field: &str, m: String) -> Result<(), ConfigError> {
    let path = if field.is_empty() {
        "discovery".to_string()
    } else {
        format!("discovery.{field}")
    };
    Err(ConfigError::at(path, m))
}

/// A cluster or authority the filter calls out to: 1-256 printable ASCII characters.
fn printable(s: &str) -> bool {
    !s.is_empty() && s.len() <= 256 && s.bytes().all(|b| b.is_ascii_graphic())
}

impl DiscoverySection {
    pub(super) fn validate(&self, cfg: &FilterConfig) -> Result<(), ConfigError> {
        self.validate_settings(cfg)?;
        self.validate_fit(cfg)
    }

    /// The section's own settings: where and how often the list is polled, how long a member that
    /// left keeps its slot, how many slots (within the units the static replicas leave).
    fn validate_settings(&self, cfg: &FilterConfig) -> Result<(), ConfigError> {
        if !printable(&self.cluster) || !self.authority.as_deref().is_none_or(printable) {
            return err(
                "cluster",
                "cluster and authority must be 1-256 printable ASCII characters".into(),
            );
        }
        if !self.path.starts_with('/')
            || self.path.len() > 256
            || !self.path.bytes().all(|b| b.is_ascii_graphic())
        {
            return err(
                "path",
                format!(
                    "{:?} must start with '/' and be up to 256 printable characters",
                    self.path
                ),
            );
        }
        if self.period_ms < cfg.tick_ms || self.period_ms > 600_000 {
            return err(
                "period_ms",
                format!(
                    "must be tick_ms ({})..=600000, got {}",
                    cfg.tick_ms, self.period_ms
                ),
            );
        }
        if self.timeout_ms == 0 || self.timeout_ms > 60_000 {
            return err(
                "timeout_ms",
                format!("must be 1..=60000, got {}", self.timeout_ms),
            );
        }
        if self.hold_ms > 3_600_000 {
            return err(
                "hold_ms",
                format!("must be at most 3600000, got {}", self.hold_ms),
            );
        }
        let static_units: usize = cfg.replicas.iter().map(|r| r.dp_ranks as usize).sum();
        let room = MAX_UNITS.saturating_sub(static_units);
        if self.max_members == 0 || self.max_members > room {
            return err(
                "max_members",
                format!(
                    "must be 1..={room} (the {MAX_UNITS} routing units less the static \
                     replicas'), got {}",
                    self.max_members
                ),
            );
        }
        if !(64..=64 << 20).contains(&self.max_response_bytes) {
            return err(
                "max_response_bytes",
                format!("must be 64..=67108864, got {}", self.max_response_bytes),
            );
        }
        Ok(())
    }

    /// Discovery against the rest of the configuration: an output mode that can route to a
    /// discovered member (and, with Envoy, the cluster its feed is polled through), no P/D roles,
    /// no static replica named like a slot.
    fn validate_fit(&self, cfg: &FilterConfig) -> Result<(), ConfigError> {
        match cfg.output {
            OutputMode::NginxVariable => {}
            OutputMode::ClusterHeader => {
                return Err(ConfigError::at(
                    "output",
                    "cluster_header mode cannot route to discovered members (one cluster per \
                     replica is configuration, not discovery): use destination_header with a \
                     discovery section",
                ));
            }
            OutputMode::DestinationHeader => {
                if !self.feed_cluster.as_deref().is_some_and(printable) {
                    return err("feed_cluster", "required with Envoy".into());
                }
            }
        }
        if cfg.disaggregated() {
            return err(
                "",
                "prefill/decode roles are configured statically, not discovered".into(),
            );
        }
        if let Some(r) = cfg.replicas.iter().find(|r| r.name.starts_with("_slot")) {
            return Err(ConfigError::at(
                "replicas",
                format!(
                    "{:?}: names starting with _slot are the discovery slots'",
                    r.name
                ),
            ));
        }
        Ok(())
    }
}

impl Unit {
    /// Discovery slot `k` with no member seated: a placeholder named `_slotK`, routed to by
    /// nobody, whose feed is polled through the discovery section's `feed_cluster`.
    pub fn vacant_slot(k: usize, feed_cluster: Option<String>) -> Unit {
        Unit {
            name: slot_name(k),
            endpoint: "0.0.0.0:0".into(),
            feed_cluster,
            feed_authority: None,
            feed_address: None,
            cluster: None,
            role: "both".into(),
            prefill_cluster: None,
            prefill_authority: None,
            rank: None,
        }
    }
}

impl FilterConfig {
    /// The routing units configured statically; discovery's slots follow them.
    pub fn static_units(&self) -> usize {
        match &self.discovery {
            Some(d) => self.units.len().saturating_sub(d.max_members),
            None => self.units.len(),
        }
    }

    /// Appends the discovery slots to the (expanded) static replicas: each a placeholder unit,
    /// vacant until a member is seated in it (`crate::worker::discovery::roster`).
    pub(super) fn add_discovery_slots(&mut self) {
        let Some(d) = &self.discovery else { return };
        if self.units.iter().any(|u| u.name.starts_with("_slot")) {
            return; // already added
        }
        for k in 0..d.max_members {
            self.units
                .push(Unit::vacant_slot(k, d.feed_cluster.clone()));
        }
    }

    /// `:authority` of the discovery poll.
    pub fn discovery_authority(&self) -> &str {
        self.discovery
            .as_ref()
            .map_or("", |d| d.authority.as_deref().unwrap_or(&d.cluster))
    }
}

#[cfg(test)]
mod tests {
    use crate::config::FilterConfig;
    use crate::config::tests::{GOOD, refused};

    fn with_discovery(replicas: &str, discovery: &str, extra: &str) -> String {
        format!(r#"{{"replicas":[{replicas}],"discovery":{discovery}{extra}}}"#)
    }

    #[test]
    fn the_discovery_section_adds_empty_slots_after_the_static_replicas() {
        let c = FilterConfig::from_json(GOOD.as_bytes()).unwrap();
        assert_eq!(c.discovery, None);
        assert_eq!(c.static_units(), 2);
        let json = with_discovery(
            r#"{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0","dp_ranks":2}"#,
            r#"{"cluster":"members","feed_cluster":"member_feeds"}"#,
            "",
        );
        let c = FilterConfig::from_json(json.as_bytes()).unwrap();
        let d = c.discovery.as_ref().unwrap();
        assert_eq!(
            (
                d.path.as_str(),
                d.period_ms,
                d.timeout_ms,
                d.hold_ms,
                d.max_members
            ),
            ("/kvsteer/members", 1_000, 1_000, 10_000, 64)
        );
        assert_eq!(d.max_response_bytes, 1 << 20);
        assert_eq!(c.static_units(), 2, "the two ranks");
        assert_eq!(c.units.len(), 66);
        assert_eq!(c.units[2].name, "_slot0");
        assert_eq!(c.feed_upstream(65), "member_feeds");
        assert_eq!(c.discovery_authority(), "members");
        // Discovery alone: no static replica needed.
        let json = with_discovery(
            "",
            r#"{"cluster":"members","feed_cluster":"mf","max_members":3,"authority":"disco.local"}"#,
            "",
        );
        let c = FilterConfig::from_json(json.as_bytes()).unwrap();
        assert_eq!((c.static_units(), c.units.len()), (0, 3));
        assert_eq!(c.discovery_authority(), "disco.local");
        // nginx: no feed cluster (a callout names the member's address).
        let json = with_discovery(
            "",
            r#"{"cluster":"127.0.0.1:7000"}"#,
            r#","output":"nginx_variable""#,
        );
        assert!(FilterConfig::from_json(json.as_bytes()).is_ok());
    }

    #[test]
    fn the_discovery_section_is_checked() {
        let r0 = r#"{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}"#;
        let ok = r#""cluster":"m","feed_cluster":"mf""#;
        for (discovery, extra, needle) in [
            (
                r#"{"cluster":"m"}"#.to_string(),
                "",
                "discovery.feed_cluster: required with Envoy",
            ),
            (
                format!("{{{ok},\"max_members\":0}}"),
                "",
                "discovery.max_members: must be 1..=255",
            ),
            (
                format!("{{{ok},\"max_members\":256}}"),
                "",
                "discovery.max_members",
            ),
            (
                format!("{{{ok},\"period_ms\":50}}"),
                "",
                "discovery.period_ms",
            ),
            (
                format!("{{{ok},\"timeout_ms\":0}}"),
                "",
                "discovery.timeout_ms",
            ),
            (
                format!("{{{ok},\"hold_ms\":3600001}}"),
                "",
                "discovery.hold_ms",
            ),
            (
                format!("{{{ok},\"path\":\"members\"}}"),
                "",
                "discovery.path",
            ),
            (
                format!("{{{ok},\"max_response_bytes\":10}}"),
                "",
                "discovery.max_response_bytes",
            ),
            (format!("{{{ok},\"typo\":1}}"), "", "unknown field `typo`"),
            (
                r#"{"cluster":"","feed_cluster":"mf"}"#.into(),
                "",
                "discovery.cluster",
            ),
            (
                format!("{{{ok}}}"),
                r#","output":"cluster_header""#,
                "output: cluster_header mode",
            ),
        ] {
            let json = with_discovery(r0, &discovery, extra);
            let e = refused(&json);
            assert!(e.contains(needle), "{discovery} {extra}: {e}");
        }
        let json = with_discovery(
            r#"{"name":"_slot0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}"#,
            &format!("{{{ok}}}"),
            "",
        );
        assert!(refused(&json).contains("_slot"));
        assert!(refused(r#"{"replicas":[]}"#).contains("or a discovery section"));
        assert!(refused("{}").contains("or a discovery section"));
        let absent = r#"{"discovery":{"cluster":"m","feed_cluster":"mf","max_members":2}}"#;
        assert_eq!(
            FilterConfig::from_json(absent.as_bytes())
                .unwrap()
                .units
                .len(),
            2
        );
    }
}
