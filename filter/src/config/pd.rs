//! Prefill/decode disaggregation as configured (docs/design/pd.md): the `pd` section (the prefill
//! leg's limits and the P/D scores' coefficients), the replicas' roles and where a prefill leg is
//! sent.

use super::{ConfigError, FilterConfig, OutputMode, err};
use kvsteer_core::disaggregation::{PdParams, Role};
use serde::Deserialize;

fn d_prefill_timeout() -> u64 {
    60_000
}
fn d_prefill_max_bytes() -> usize {
    1 << 20
}
fn d_pd_queue_weight() -> f64 {
    PdParams::default().prefill_queue_weight
}
fn d_pd_transfer_weight() -> f64 {
    PdParams::default().transfer_weight
}
fn d_pd_active_weight() -> f64 {
    PdParams::default().active_request_weight
}

/// The `pd` section: the prefill leg's limits and the P/D scores' coefficients (docs/design/pd.md).
/// Read only when some replica has a `prefill` or `decode` role.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PdSection {
    /// How long the prefill leg may take, queueing on the prefill replica included. A prefill leg
    /// computes the whole uncached prompt and waits behind every prefill queued there: tens of
    /// seconds on a saturated prefill engine with long prompts (docs/design/pd.md's coding-agent
    /// runs), so the default is generous; past it the client gets a 502.
    #[serde(default = "d_prefill_timeout")]
    pub prefill_timeout_ms: u64,
    /// The prefill answer's body is refused unread over this many bytes (502). Its
    /// `kv_transfer_params` lists a block id per prompt block: about 50 KB for a 128K-token prompt.
    #[serde(default = "d_prefill_max_bytes")]
    pub max_prefill_response_bytes: usize,
    /// A prefill leg that fails with a 5xx or no answer (refused, reset, timed out) is sent once more,
    /// to its side's backup (the next cheapest replica that prefills, on another endpoint when one
    /// is usable), before the client gets a 502: what Envoy's retry policy does for a plain request.
    /// A failed health probe's leg always goes on to the side's own choice, whatever this says.
    #[serde(default = "super::d_true")]
    pub retry_prefill: bool,
    /// `q`: weight of a queued prefill block on a prefill replica against one of the request's own.
    #[serde(default = "d_pd_queue_weight")]
    pub prefill_queue_weight: f64,
    /// `t`: weight of one block the decode replica reads over the link against one decode block.
    #[serde(default = "d_pd_transfer_weight")]
    pub transfer_weight: f64,
    /// `w_a`: weight of an active request on a decode replica, in blocks.
    #[serde(default = "d_pd_active_weight")]
    pub active_request_weight: f64,
}

impl Default for PdSection {
    fn default() -> Self {
        PdSection {
            prefill_timeout_ms: d_prefill_timeout(),
            max_prefill_response_bytes: d_prefill_max_bytes(),
            retry_prefill: true,
            prefill_queue_weight: d_pd_queue_weight(),
            transfer_weight: d_pd_transfer_weight(),
            active_request_weight: d_pd_active_weight(),
        }
    }
}

impl PdSection {
    pub fn params(&self) -> PdParams {
        PdParams {
            prefill_queue_weight: self.prefill_queue_weight,
            transfer_weight: self.transfer_weight,
            active_request_weight: self.active_request_weight,
        }
    }
}

/// Roles parsed, `both` for a value that does not parse (`validate` refuses those).
fn roles_of<'a>(roles: impl Iterator<Item = &'a str>) -> Vec<Role> {
    roles
        .map(|r| Role::parse(r).unwrap_or(Role::Both))
        .collect()
}

impl FilterConfig {
    /// Whether the fleet is disaggregated: some replica has a role other than `both`.
    pub fn disaggregated(&self) -> bool {
        self.replicas.iter().any(|r| r.role != "both")
    }

    /// Every unit's role (`both` for a value that does not parse; `validate` refuses those).
    pub fn roles(&self) -> Vec<Role> {
        roles_of(self.units.iter().map(|u| u.role.as_str()))
    }

    pub(super) fn validate_pd(&self) -> Result<(), ConfigError> {
        let p = &self.pd;
        if !(1..=600_000).contains(&p.prefill_timeout_ms) {
            return err(
                "pd.prefill_timeout_ms",
                format!("must be 1..=600000, got {}", p.prefill_timeout_ms),
            );
        }
        if !(1024..=64 << 20).contains(&p.max_prefill_response_bytes) {
            return err(
                "pd.max_prefill_response_bytes",
                format!(
                    "must be 1024..=67108864, got {}",
                    p.max_prefill_response_bytes
                ),
            );
        }
        for (field, v) in [
            ("prefill_queue_weight", p.prefill_queue_weight),
            ("transfer_weight", p.transfer_weight),
            ("active_request_weight", p.active_request_weight),
        ] {
            if !v.is_finite() || v < 0.0 {
                return err(
                    format!("pd.{field}"),
                    format!("must be a finite number >= 0, got {v}"),
                );
            }
        }
        if !self.disaggregated() {
            return Ok(());
        }
        if self.output == OutputMode::NginxVariable {
            return err(
                "replicas[].role",
                "prefill/decode roles need Envoy (output destination_header or cluster_header); \
                 nginx_variable mode has no prefill leg",
            );
        }
        // The entries as written: the units (built after the checks) carry the same roles.
        let roles = roles_of(self.replicas.iter().map(|r| r.role.as_str()));
        if !roles.iter().any(|r| r.prefills()) {
            return err(
                "replicas[].role",
                "a fleet with roles needs a replica that prefills",
            );
        }
        if !roles.iter().any(|r| r.decodes()) {
            return err(
                "replicas[].role",
                "a fleet with roles needs a replica that decodes",
            );
        }
        Ok(())
    }

    /// The cluster a replica's prefill leg is sent to (empty when not configured).
    pub fn prefill_upstream(&self, i: usize) -> &str {
        self.units
            .get(i)
            .and_then(|r| r.prefill_cluster.as_deref())
            .unwrap_or("")
    }

    /// `:authority` of a replica's prefill leg.
    pub fn prefill_authority(&self, i: usize) -> &str {
        self.units.get(i).map_or("", |r| {
            r.prefill_authority.as_deref().unwrap_or(&r.endpoint)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::{GOOD, refused};

    const PD: &str = r#"{"replicas":[
        {"name":"p0","endpoint":"127.0.0.1:8000","feed_cluster":"f0","role":"prefill","prefill_cluster":"c0"},
        {"name":"d0","endpoint":"127.0.0.1:8001","feed_cluster":"f1","role":"decode"}]}"#;

    /// Without roles nothing changes (every replica `both`, not disaggregated); with roles each
    /// replica that prefills needs its prefill cluster, the fleet needs both sides, and every bad
    /// value is refused by name.
    #[test]
    fn pd_roles_and_their_settings() {
        let plain = FilterConfig::from_json(GOOD.as_bytes()).unwrap();
        assert!(!plain.disaggregated());
        assert_eq!(plain.roles(), [Role::Both, Role::Both]);
        assert_eq!(plain.pd, PdSection::default());
        assert_eq!(plain.pd.prefill_timeout_ms, 60_000);
        assert_eq!(plain.pd.max_prefill_response_bytes, 1 << 20);
        assert!(plain.pd.retry_prefill);
        assert_eq!(plain.pd.params(), PdParams::default());

        let c = FilterConfig::from_json(PD.as_bytes()).unwrap();
        assert!(c.disaggregated());
        assert_eq!(c.roles(), [Role::Prefill, Role::Decode]);
        assert_eq!(c.prefill_upstream(0), "c0");
        assert_eq!(c.prefill_upstream(1), "");
        assert_eq!(c.prefill_upstream(9), "");
        assert_eq!(c.prefill_authority(0), "127.0.0.1:8000");

        let bad_role = PD.replacen(r#""role":"decode""#, r#""role":"Decode""#, 1);
        assert!(refused(&bad_role).starts_with("replicas[1].role"));
        let no_cluster = PD.replacen(r#","prefill_cluster":"c0""#, "", 1);
        assert!(refused(&no_cluster).starts_with("replicas[0].prefill_cluster"));
        // A `both` replica prefills too, so in a fleet with roles it needs a prefill cluster.
        let both = PD.replacen(r#""role":"decode""#, r#""role":"both""#, 1);
        assert!(refused(&both).starts_with("replicas[1].prefill_cluster"));
        let all_prefill = PD.replacen(
            r#""role":"decode""#,
            r#""role":"prefill","prefill_cluster":"c1""#,
            1,
        );
        assert!(refused(&all_prefill).contains("needs a replica that decodes"));
        let all_decode = PD.replacen(r#""role":"prefill""#, r#""role":"decode""#, 1);
        assert!(refused(&all_decode).contains("needs a replica that prefills"));
        let nginx = PD
            .replacen(
                "{\"replicas\"",
                "{\"output\":\"nginx_variable\",\"replicas\"",
                1,
            )
            .replace(
                r#""feed_cluster":"f0""#,
                r#""feed_address":"127.0.0.1:8000""#,
            )
            .replace(
                r#""feed_cluster":"f1""#,
                r#""feed_address":"127.0.0.1:8001""#,
            );
        assert!(refused(&nginx).contains("nginx_variable"));
        for (field, bad) in [
            ("prefill_timeout_ms", "0"),
            ("prefill_timeout_ms", "600001"),
            ("max_prefill_response_bytes", "10"),
            ("transfer_weight", "-1"),
            ("prefill_queue_weight", "-0.5"),
        ] {
            let json = PD.replacen(
                "{\"replicas\"",
                &format!("{{\"pd\":{{\"{field}\":{bad}}},\"replicas\""),
                1,
            );
            assert!(
                refused(&json).starts_with(&format!("pd.{field}")),
                "{field} = {bad}"
            );
        }
        let typo = PD.replacen("{\"replicas\"", "{\"pd\":{\"timeout\":1},\"replicas\"", 1);
        assert!(refused(&typo).contains("timeout"));
        let tuned = PD.replacen(
            "{\"replicas\"",
            "{\"pd\":{\"transfer_weight\":0.25,\"prefill_timeout_ms\":5000,\"retry_prefill\":false},\"replicas\"",
            1,
        );
        let c = FilterConfig::from_json(tuned.as_bytes()).unwrap();
        assert_eq!(c.pd.params().transfer_weight, 0.25);
        assert!(!c.pd.retry_prefill);
        assert_eq!(c.pd.prefill_timeout_ms, 5000);
        // DP ranks copy the role and prefill cluster to every rank.
        let dp = PD.replacen(
            r#""prefill_cluster":"c0""#,
            r#""prefill_cluster":"c0","dp_ranks":2"#,
            1,
        );
        let c = FilterConfig::from_json(dp.as_bytes()).unwrap();
        assert_eq!(c.roles(), [Role::Prefill, Role::Prefill, Role::Decode]);
        assert_eq!(c.prefill_upstream(1), "c0");
    }
}
