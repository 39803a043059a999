//! The `index` section: how a block the KV index holds counts for a request, whichever policy
//! scores. Its fields were `kv_load`'s until 0.x; the old names are still read for one release
//! ([`IndexSection::resolve`]), with a warning naming the new place.

use serde::Deserialize;

use super::{ConfigError, err, pick};

/// How much a cached block is worth by the tier it is held on, read wherever the router counts a
/// request's cached prefix (every policy that prices overlap, `kv_time` included).
#[derive(Clone, Debug, PartialEq)]
pub struct IndexParams {
    /// Credit of a block held only in host memory, relative to a GPU block (0..=1).
    pub host_tier_credit: f64,
    /// Credit of a block held only on disk (0..=1).
    pub disk_tier_credit: f64,
}

impl Default for IndexParams {
    fn default() -> Self {
        Self {
            host_tier_credit: 0.75,
            disk_tier_credit: 0.25,
        }
    }
}

impl IndexParams {
    /// Checks ranges that types alone do not.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("index.host_tier_credit", self.host_tier_credit),
            ("index.disk_tier_credit", self.disk_tier_credit),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(err(name, format!("must be between 0 and 1, got {v}")));
            }
        }
        Ok(())
    }
}

/// The `index` section as written: a field left out is taken from its old name under `kv_load`,
/// else the default.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct IndexSection {
    pub host_tier_credit: Option<f64>,
    pub disk_tier_credit: Option<f64>,
}

impl IndexSection {
    /// The section's values: each field from `index`, else its old name in `old` (noted in
    /// `warnings`), else the default. The message of a refusal starts with the field's path.
    pub(super) fn resolve(
        self,
        old: IndexSection,
        warnings: &mut Vec<String>,
    ) -> Result<IndexParams, String> {
        let d = IndexParams::default();
        Ok(IndexParams {
            host_tier_credit: pick(
                "index.host_tier_credit",
                "kv_load.host_tier_credit",
                self.host_tier_credit,
                old.host_tier_credit,
                d.host_tier_credit,
                warnings,
            )?,
            disk_tier_credit: pick(
                "index.disk_tier_credit",
                "kv_load.disk_tier_credit",
                self.disk_tier_credit,
                old.disk_tier_credit,
                d.disk_tier_credit,
                warnings,
            )?,
        })
    }
}
