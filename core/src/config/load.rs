//! The `load` section: how the load table books a request and how a replica's reported load meets
//! those bookings, read by every load-aware policy. Its fields were `kv_load`'s until 0.x; the old
//! names are still read for one release ([`LoadSection::resolve`]), with a warning naming the new
//! place, and a `kv_load.preset` still supplies them unless `load` (or the old name) gives them.

use serde::Deserialize;

use super::pick;

/// The load table's accounting and the reported load's use, for every policy that reads load.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadParams {
    /// How the load a replica reports in its feed combines with this router's own bookings.
    pub reported_load: ReportedLoad,
    /// Book a request's prompt blocks as decode load from admission (Dynamo) rather than from its
    /// first token.
    pub prompt_blocks_at_admission: bool,
    /// Weight a request's own decode blocks by `1 - generated/expected` when it gives
    /// `max_completion_tokens` or `max_tokens` (Ray's decode progress).
    pub use_output_hint: bool,
}

impl Default for LoadParams {
    /// Dynamo's accounting (prompt blocks from admission, no output hint), scored on the router's
    /// own bookings.
    fn default() -> Self {
        Self {
            reported_load: ReportedLoad::Ignore,
            prompt_blocks_at_admission: true,
            use_output_hint: false,
        }
    }
}

/// How a replica's reported load (the feed's `load`) meets the router's own bookings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportedLoad {
    /// Field by field, the larger of the two: the report sees traffic from other proxies, the
    /// bookings are fresher. A report that counts queued prompts whole (cached part included) then
    /// charges the cache holder for tokens it will not compute.
    Max,
    /// Score on the router's own bookings only, as Dynamo and Ray do (right when this proxy, with its
    /// worker VMs, sees all the traffic). The default.
    Ignore,
    /// The replica's report plus this proxy's bookings the report cannot reflect yet (requests it
    /// admitted since the poll that produced the report was sent), field by field: every proxy's
    /// traffic up to the poll, and this proxy's own since, each counted once (docs/design/design.md,
    /// "Many proxies"). For fleets of independent proxies in front of the same replicas.
    Merge,
    /// This proxy's own bookings, as `ignore` scores them, plus the part of each replica's report
    /// that is not this proxy's: the report less this proxy's requests it holds (admitted before the
    /// poll that produced it, as they stood when the report was accepted), field by field, never
    /// below zero. With one proxy the rest is about nothing and the policy scores as `ignore` does (with
    /// Dynamo's accounting of its own requests: shared blocks once, output progress); with several,
    /// the other proxies' load comes from the reports. For fleets of independent proxies.
    Others,
}

/// The `load` section as written: a field left out is taken from its old name under `kv_load`,
/// else from `kv_load.preset`, else the default.
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct LoadSection {
    pub reported_load: Option<ReportedLoad>,
    pub prompt_blocks_at_admission: Option<bool>,
    pub use_output_hint: Option<bool>,
}

impl LoadSection {
    /// The section's values: each field from `load`, else its old name in `old` (noted in
    /// `warnings`), else `base` (the preset's values, or the defaults). The message of a refusal
    /// starts with the field's path.
    pub(super) fn resolve(
        self,
        old: LoadSection,
        base: LoadParams,
        warnings: &mut Vec<String>,
    ) -> Result<LoadParams, String> {
        Ok(LoadParams {
            reported_load: pick(
                "load.reported_load",
                "kv_load.reported_load",
                self.reported_load,
                old.reported_load,
                base.reported_load,
                warnings,
            )?,
            prompt_blocks_at_admission: pick(
                "load.prompt_blocks_at_admission",
                "kv_load.prompt_blocks_at_admission",
                self.prompt_blocks_at_admission,
                old.prompt_blocks_at_admission,
                base.prompt_blocks_at_admission,
                warnings,
            )?,
            use_output_hint: pick(
                "load.use_output_hint",
                "kv_load.use_output_hint",
                self.use_output_hint,
                old.use_output_hint,
                base.use_output_hint,
                warnings,
            )?,
        })
    }
}
