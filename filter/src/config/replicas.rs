//! The replica list: each entry's fields and checks, and its expansion into routing units (one per
//! data-parallel rank, docs/design/dp.md).

use super::{ConfigError, FilterConfig, OutputMode, err};
use kvsteer_core::disaggregation::Role;
use serde::Deserialize;

/// Most routing units (replicas, each DP rank counting as one): shared load and health records and
/// the metrics are per unit.
pub const MAX_UNITS: usize = 256;

/// One engine replica.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ReplicaSpec {
    /// Name used in metrics and logs (ASCII letters, digits, `-`, `_`, `.`).
    pub name: String,
    /// `IP:port` written into the destination header; must be in the cluster's endpoint set.
    pub endpoint: String,
    /// Envoy cluster that reaches this replica's feed (a STATIC cluster; never an ORIGINAL_DST one).
    #[serde(default)]
    pub feed_cluster: Option<String>,
    /// `:authority` of feed callouts; defaults to `endpoint`.
    #[serde(default)]
    pub feed_authority: Option<String>,
    /// nginx mode: the feed's `IP:port`, passed to `dispatch_http_call` as the upstream.
    #[serde(default)]
    pub feed_address: Option<String>,
    /// cluster_header mode: this replica's Envoy cluster.
    #[serde(default)]
    pub cluster: Option<String>,
    /// Data-parallel ranks the endpoint serves, each with its own KV cache and queue (vLLM
    /// `--data-parallel-size`); 1 (the default) is an ordinary replica. An entry with N > 1 becomes N
    /// routing units, `NAME_dp0` .. `NAME_dp{N-1}`, at configure time (docs/design/dp.md).
    #[serde(default = "d_one")]
    pub dp_ranks: u32,
    /// What the replica does in a prefill/decode (P/D) fleet (docs/design/pd.md): `prefill`,
    /// `decode` or `both` (the default). A fleet where every replica is `both` routes one request
    /// to one replica, exactly as without the field; any other role makes the filter split each
    /// request into a prefill leg (a callout to a replica that prefills) and a decode leg (the
    /// request itself).
    #[serde(default = "d_role")]
    pub role: String,
    /// P/D: the Envoy cluster the prefill leg is sent to for this replica (`dispatch_http_call` names
    /// a cluster, not an address): a STATIC cluster holding only this replica's serving address.
    /// Required for every replica that prefills in a fleet with roles.
    #[serde(default)]
    pub prefill_cluster: Option<String>,
    /// P/D: `:authority` of the prefill leg; defaults to `endpoint`.
    #[serde(default)]
    pub prefill_authority: Option<String>,
}

/// One routing unit: a replica, one data-parallel rank of a replica, or a discovery slot (a
/// placeholder until a member is seated in it). Its fields are the replica entry's, with the rank's
/// name and number for a rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// `NAME`, `NAME_dpK` for rank K, or `_slotK` for an empty discovery slot.
    pub name: String,
    pub endpoint: String,
    pub feed_cluster: Option<String>,
    pub feed_authority: Option<String>,
    pub feed_address: Option<String>,
    pub cluster: Option<String>,
    pub role: String,
    pub prefill_cluster: Option<String>,
    pub prefill_authority: Option<String>,
    /// This unit's rank, `None` for an endpoint with one rank (no rank header is written and its
    /// feed is polled without a rank).
    pub rank: Option<u32>,
}

impl Unit {
    /// The unit of `spec`'s rank `rank` (`None`: the whole replica), named for it.
    fn of(spec: &ReplicaSpec, rank: Option<u32>) -> Unit {
        Unit {
            name: match rank {
                Some(k) => format!("{}_dp{k}", spec.name),
                None => spec.name.clone(),
            },
            endpoint: spec.endpoint.clone(),
            feed_cluster: spec.feed_cluster.clone(),
            feed_authority: spec.feed_authority.clone(),
            feed_address: spec.feed_address.clone(),
            cluster: spec.cluster.clone(),
            role: spec.role.clone(),
            prefill_cluster: spec.prefill_cluster.clone(),
            prefill_authority: spec.prefill_authority.clone(),
            rank,
        }
    }
}

fn d_one() -> u32 {
    1
}

fn d_role() -> String {
    "both".into()
}

pub(crate) fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

impl FilterConfig {
    /// The replica list's size and every entry, refused by name (the first bad entry's).
    pub(super) fn validate_replicas(&self) -> Result<(), ConfigError> {
        if let Some((i, r)) = self
            .replicas
            .iter()
            .enumerate()
            .find(|(_, r)| r.dp_ranks == 0 || r.dp_ranks > kvsteer_core::dp::MAX_DP_RANKS)
        {
            return err(
                format!("replicas[{i}].dp_ranks"),
                format!(
                    "must be 1..={}, got {}",
                    kvsteer_core::dp::MAX_DP_RANKS,
                    r.dp_ranks
                ),
            );
        }
        let units: u64 = self.replicas.iter().map(|r| r.dp_ranks as u64).sum();
        if units > MAX_UNITS as u64 {
            return err(
                "replicas",
                format!("at most {MAX_UNITS} routing units (replicas x dp_ranks), got {units}"),
            );
        }
        if self.replicas.len() > 256 {
            return err(
                "replicas",
                format!("at most 256, got {}", self.replicas.len()),
            );
        }
        for (i, r) in self.replicas.iter().enumerate() {
            self.validate_replica(i, r)?;
        }
        Ok(())
    }

    /// One entry of the replica list, at index `i`: its name (unique), endpoint, what reaches its
    /// feed in this output mode, role, prefill cluster and cluster.
    fn validate_replica(&self, i: usize, r: &ReplicaSpec) -> Result<(), ConfigError> {
        if !valid_name(&r.name) {
            return err(
                format!("replicas[{i}].name"),
                format!("{:?} must be 1-64 of [A-Za-z0-9._-]", r.name),
            );
        }
        if self.replicas[..i].iter().any(|o| o.name == r.name) {
            return err(
                format!("replicas[{i}].name"),
                format!("duplicate {:?}", r.name),
            );
        }
        if r.endpoint.parse::<std::net::SocketAddr>().is_err() {
            return err(
                format!("replicas[{i}].endpoint"),
                format!("{:?} is not IP:port", r.endpoint),
            );
        }
        match self.output {
            OutputMode::NginxVariable => {
                if r.feed_address.is_none() {
                    return err(
                        format!("replicas[{i}].feed_address"),
                        "required in nginx_variable mode",
                    );
                }
            }
            _ => {
                if r.feed_cluster.as_deref().is_none_or(str::is_empty) {
                    return err(format!("replicas[{i}].feed_cluster"), "required with Envoy");
                }
            }
        }
        let Some(role) = Role::parse(&r.role) else {
            return err(
                format!("replicas[{i}].role"),
                format!("{:?} must be prefill, decode or both", r.role),
            );
        };
        if self.disaggregated()
            && role.prefills()
            && r.prefill_cluster.as_deref().is_none_or(str::is_empty)
        {
            return err(
                format!("replicas[{i}].prefill_cluster"),
                "required for a replica that prefills in a fleet with roles (the prefill leg \
                 is a callout to this cluster)",
            );
        }
        if self.output == OutputMode::ClusterHeader && r.cluster.is_none() {
            return err(
                format!("replicas[{i}].cluster"),
                "required in cluster_header mode",
            );
        }
        Ok(())
    }

    /// Turns every replica entry with `dp_ranks` > 1 into one entry per rank (same endpoint, feed and
    /// cluster; `rank` set; name `NAME_dp<r>`), so that everything per replica (the router's units,
    /// feeds, metrics, shared load) is per (endpoint, rank) with no other change, and a configuration
    /// without ranks is left exactly as it was. Refuses more than 256 units in all, and a generated
    /// name that another entry already has.
    /// The routing units of the static list: one per replica, or one per rank of a replica with
    /// `dp_ranks` > 1 (`NAME_dp0` ..), refused when a rank's name is too long or clashes with
    /// another unit's. Built once: a configuration that has its units keeps them.
    pub(super) fn build_units(&mut self) -> Result<(), ConfigError> {
        if !self.units.is_empty() || self.replicas.is_empty() {
            return Ok(()); // built already, or discovery alone (its slots are added after)
        }
        let ranks: Vec<u32> = self.replicas.iter().map(|r| r.dp_ranks).collect();
        let layout = kvsteer_core::dp::Units::new(&ranks, MAX_UNITS)
            .map_err(|e| ConfigError::at("replicas", e.to_string()))?;
        let mut units = Vec::with_capacity(layout.len());
        for u in layout.iter() {
            let unit = Unit::of(&self.replicas[u.endpoint], u.rank);
            if !valid_name(&unit.name) {
                return err(
                    format!("replicas[{}].name", u.endpoint),
                    format!("{:?} with its rank suffix is over 64 characters", unit.name),
                );
            }
            units.push(unit);
        }
        for (i, u) in units.iter().enumerate() {
            if units[..i].iter().any(|o| o.name == u.name) {
                return err(
                    "replicas",
                    format!(
                        "the name {:?} is given twice once DP ranks are expanded",
                        u.name
                    ),
                );
            }
        }
        self.units = units;
        Ok(())
    }

    /// Unit `i`'s data-parallel rank (`None`: a whole replica, or no such unit).
    pub fn rank_of(&self, i: usize) -> Option<u32> {
        self.units.get(i).and_then(|u| u.rank)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::FilterConfig;
    use crate::config::tests::{GOOD, refused};

    /// `dp_ranks` expands an entry into one unit per rank; without it the configuration is exactly
    /// what it was; bad counts, too many units and clashing generated names are refused by name.
    #[test]
    fn dp_ranks_expand_into_units() {
        let plain = FilterConfig::from_json(GOOD.as_bytes()).unwrap();
        assert_eq!(plain.units.len(), 2);
        assert!(plain.units.iter().all(|u| u.rank.is_none()));
        let names: Vec<&str> = plain.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["r0", "r1"]);
        assert_eq!(plain.rank_header, "x-data-parallel-rank");
        let dp = GOOD.replacen(
            r#""feed_cluster":"feed_r0""#,
            r#""feed_cluster":"feed_r0","dp_ranks":3"#,
            1,
        );
        let c = FilterConfig::from_json(dp.as_bytes()).unwrap();
        let names: Vec<&str> = c.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["r0_dp0", "r0_dp1", "r0_dp2", "r1"]);
        // The list as written is kept: the ranks are the units', not rewritten entries.
        assert_eq!(c.replicas.len(), 2);
        assert_eq!(
            (c.replicas[0].name.as_str(), c.replicas[0].dp_ranks),
            ("r0", 3)
        );
        assert_eq!(c.rank_of(1), Some(1));
        assert_eq!(c.rank_of(3), None);
        assert_eq!(c.rank_of(9), None);
        assert_eq!(c.feed_upstream(2), "feed_r0");
        assert_eq!(c.feed_authority(2), "127.0.0.1:8000");
        assert!(c.units[..3].iter().all(|u| u.endpoint == "127.0.0.1:8000"));
        for bad in ["0", "257"] {
            let j = GOOD.replacen(
                r#""feed_cluster":"feed_r0""#,
                &format!(r#""feed_cluster":"feed_r0","dp_ranks":{bad}"#),
                1,
            );
            assert!(refused(&j).starts_with("replicas[0].dp_ranks"), "{bad}");
        }
        let many = GOOD
            .replacen(
                r#""feed_cluster":"feed_r0""#,
                r#""feed_cluster":"feed_r0","dp_ranks":200"#,
                1,
            )
            .replacen(
                r#""feed_cluster":"feed_r1""#,
                r#""feed_cluster":"feed_r1","dp_ranks":100"#,
                1,
            );
        assert!(refused(&many).contains("at most 256 routing units"));
        let clash = r#"{"replicas":[{"name":"a","endpoint":"1.2.3.4:5","feed_cluster":"f","dp_ranks":2},
                                   {"name":"a_dp1","endpoint":"1.2.3.4:6","feed_cluster":"g"}]}"#;
        assert!(refused(clash).contains("a_dp1"));
        let bad_header = GOOD.replacen(
            "{\"replicas\"",
            "{\"rank_header\":\"X-Rank\",\"replicas\"",
            1,
        );
        assert!(refused(&bad_header).starts_with("rank_header"));
    }
}
