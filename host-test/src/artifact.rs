//! Where the compiled filter is: the harness never builds it (no build.rs), it only finds it.

use std::path::{Path, PathBuf};

/// Environment variable that names the `.wasm` explicitly.
pub const FILTER_WASM_ENV: &str = "KVSTEER_FILTER_WASM";

/// The command that builds the filter.
pub const BUILD_HINT: &str = "cargo build -p kvsteer-filter --target wasm32-wasip1 --release";

/// Path of the filter: `$KVSTEER_FILTER_WASM`, else
/// `<target dir>/wasm32-wasip1/release/kvsteer_filter.wasm`, the target dir being `$CARGO_TARGET_DIR`
/// or the workspace's `target/`. An error (with the build command) when the file does not exist.
pub fn filter_wasm_path() -> Result<PathBuf, String> {
    if let Some(p) = std::env::var_os(FILTER_WASM_ENV) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!(
                "{FILTER_WASM_ENV}={} does not exist; build the filter with `{BUILD_HINT}`",
                p.display()
            ))
        };
    }
    let p = target_dir().join("wasm32-wasip1/release/kvsteer_filter.wasm");
    if p.is_file() {
        Ok(p)
    } else {
        Err(format!(
            "the filter is not built: {} is missing. Build it with `{BUILD_HINT}` \
             (same CARGO_TARGET_DIR), or point {FILTER_WASM_ENV} at a kvsteer_filter.wasm",
            p.display()
        ))
    }
}

/// The cargo target dir: `$CARGO_TARGET_DIR` (relative to the workspace when relative), else the
/// workspace's `target/`.
fn target_dir() -> PathBuf {
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => PathBuf::from(t),
        None => workspace_root().join("target"),
    };
    if target.is_relative() {
        workspace_root().join(target)
    } else {
        target
    }
}

/// How a report names a file it used, so committed reports carry no machine's paths: relative to
/// the repository; a build output under `$CARGO_TARGET_DIR` as the same path under `target/`;
/// anything else by its file name alone.
pub fn report_path(p: &Path) -> String {
    report_path_in(p, &workspace_root(), &target_dir())
}

fn report_path_in(p: &Path, root: &Path, target: &Path) -> String {
    if let Ok(rel) = p.strip_prefix(target) {
        return Path::new("target").join(rel).display().to_string();
    }
    if let Ok(rel) = p.strip_prefix(root) {
        return rel.display().to_string();
    }
    if p.is_relative() {
        return p.display().to_string();
    }
    p.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// The workspace root: this crate's parent directory.
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_paths_name_no_machine() {
        let (root, target) = (Path::new("/r/kvsteer"), Path::new("/elsewhere/tgt"));
        let name = |p: &str| report_path_in(Path::new(p), root, target);
        assert_eq!(
            name("/elsewhere/tgt/wasm32-wasip1/release/kvsteer_filter.wasm"),
            "target/wasm32-wasip1/release/kvsteer_filter.wasm"
        );
        assert_eq!(
            name("/r/kvsteer/target/release/kvsteer-sim"),
            "target/release/kvsteer-sim"
        );
        assert_eq!(name("/r/kvsteer/docs/x.json"), "docs/x.json");
        assert_eq!(name("/tmp/kv/full.wasm"), "full.wasm");
        assert_eq!(name("out/lean.wasm"), "out/lean.wasm");
        // The target dir inside the repository, as it is by default.
        assert_eq!(
            report_path_in(
                Path::new("/r/kvsteer/target/x.wasm"),
                root,
                Path::new("/r/kvsteer/target")
            ),
            "target/x.wasm"
        );
    }
}
