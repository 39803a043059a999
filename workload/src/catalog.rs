//! Workloads by name, with their default parameters, for command lines and harnesses.

use crate::azure::{self, AzureParams};
use crate::error::WorkloadError;
use crate::mooncake::{self, MooncakeParams};
use crate::rl::{self, RlParams};
use crate::session::Workload;
use crate::weka::{self, WekaParams};
use std::path::Path;

/// Names accepted by [`build`].
pub const NAMES: [&str; 5] = ["rl", "rl-small", "weka", "mooncake", "azure"];

/// Default trace directory, relative to the repository root.
pub const DEFAULT_TRACES: &str = "traces";

/// Builds a workload by name with default parameters; trace files are read from `traces_dir`.
pub fn build(name: &str, traces_dir: &Path) -> Result<Workload, WorkloadError> {
    match name {
        "rl" => rl::generate(&RlParams::default()),
        "rl-small" => rl::generate(&RlParams::small()),
        "weka" => weka::read(&WekaParams {
            path: traces_dir.join(weka::FILE),
            ..Default::default()
        }),
        "mooncake" => mooncake::read(&MooncakeParams {
            path: traces_dir.join(mooncake::FILE),
            ..Default::default()
        }),
        "azure" => azure::read(&AzureParams {
            path: traces_dir.join(azure::FILE),
            ..Default::default()
        }),
        other => Err(WorkloadError::Param(format!(
            "unknown workload {other:?} (known: {})",
            NAMES.join(", ")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_are_errors() {
        assert!(matches!(
            build("nope", Path::new(".")),
            Err(WorkloadError::Param(_))
        ));
        assert_eq!(build("rl-small", Path::new(".")).unwrap().name, "rl");
    }
}
