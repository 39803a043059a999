//! The `working_set` section: the per-replica working set every policy with a cache term keeps
//! ([`crate::working_set`]). Its fields were `kv_load`'s until 0.x (`working_set_window_ms`,
//! `working_set_sample`, `working_set_from_feed`); the old names are still read for one release
//! ([`WorkingSetSection::resolve`]), with a warning naming the new place.

use serde::Deserialize;

use super::{ConfigError, err, non_negative, pick};
use crate::working_set::Sampling;

/// The working set's window, sample and sources.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkingSetParams {
    /// The working set's window: prompt blocks requested on a replica within this many ms.
    pub window_ms: f64,
    /// The working set keeps one prompt block in this many (a power of two, 1 to 1,024) and scales
    /// its counts back up ([`Sampling`]). Every worker applies every other worker's sampled
    /// admissions on its tick, so this sets the term's cost in a proxy; every proxy exchanging
    /// working sets must use the same value.
    pub sample: u64,
    /// Also count the blocks each replica's feed reports stored (GPU tier) in its working set, as
    /// asked for once: what other proxies send it, which this proxy cannot see otherwise (and the
    /// blocks of generated outputs). For several proxies in front of one fleet (docs/reports/proxies.md).
    pub from_feed: bool,
}

impl Default for WorkingSetParams {
    fn default() -> Self {
        Self {
            window_ms: 120_000.0,
            sample: 8,
            from_feed: false,
        }
    }
}

impl WorkingSetParams {
    /// The working set's sample (`sample`; a value the config check would refuse falls back to one
    /// in 8).
    pub fn sampling(&self) -> Sampling {
        Sampling::one_in(self.sample).unwrap_or(Sampling::DEFAULT)
    }

    /// Checks ranges that types alone do not.
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("working_set.window_ms", self.window_ms)?;
        if Sampling::one_in(self.sample).is_none() {
            return Err(err(
                "working_set.sample",
                format!(
                    "must be a power of two from 1 to {}, got {}",
                    Sampling::MAX_ONE_IN,
                    self.sample
                ),
            ));
        }
        Ok(())
    }
}

/// The `working_set` section as written: a field left out is taken from its old name under
/// `kv_load`, else the default (the presets never set these).
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct WorkingSetSection {
    pub window_ms: Option<f64>,
    pub sample: Option<u64>,
    pub from_feed: Option<bool>,
}

impl WorkingSetSection {
    /// The section's values: each field from `working_set`, else its old name in `old` (noted in
    /// `warnings`), else the default. The message of a refusal starts with the field's path.
    pub(super) fn resolve(
        self,
        old: WorkingSetSection,
        warnings: &mut Vec<String>,
    ) -> Result<WorkingSetParams, String> {
        let d = WorkingSetParams::default();
        Ok(WorkingSetParams {
            window_ms: pick(
                "working_set.window_ms",
                "kv_load.working_set_window_ms",
                self.window_ms,
                old.window_ms,
                d.window_ms,
                warnings,
            )?,
            sample: pick(
                "working_set.sample",
                "kv_load.working_set_sample",
                self.sample,
                old.sample,
                d.sample,
                warnings,
            )?,
            from_feed: pick(
                "working_set.from_feed",
                "kv_load.working_set_from_feed",
                self.from_feed,
                old.from_feed,
                d.from_feed,
                warnings,
            )?,
        })
    }
}
