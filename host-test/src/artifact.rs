//! Where the compiled filter is: the harness never builds it (no build.rs), it only finds it.

use std::path::PathBuf;

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
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => PathBuf::from(t),
        None => workspace_root().join("target"),
    };
    let target = if target.is_relative() {
        workspace_root().join(target)
    } else {
        target
    };
    let p = target.join("wasm32-wasip1/release/kvsteer_filter.wasm");
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

/// The workspace root: this crate's parent directory.
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}
