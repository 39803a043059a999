//! On-disk cache of compiled filter modules, so each test binary does not pay Cranelift again.
//!
//! Key: a hash of the `.wasm` bytes and of the engine's compatibility hash (wasmtime version, target,
//! and every setting that changes code, fuel metering included). Entries live under
//! `$KVSTEER_MODULE_CACHE`, else `<target dir>/kvsteer-module-cache/` (`$CARGO_TARGET_DIR`, else the
//! `target/` beside this crate's folder: a workspace member's). A cache that cannot be read or
//! written is skipped silently: compiling is always correct, the cache only saves time.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::PathBuf;
use wasmtime::{Engine, Module};

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("KVSTEER_MODULE_CACHE") {
        return PathBuf::from(d);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"));
    target.join("kvsteer-module-cache")
}

/// This crate's parent folder: the workspace root when the crate is a member at the top level.
fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// Compiles `bytes`, or loads the result of an identical earlier compilation.
pub(crate) fn compile(engine: &Engine, bytes: &[u8]) -> wasmtime::Result<Module> {
    let mut h = DefaultHasher::new();
    bytes.hash(&mut h);
    engine.precompile_compatibility_hash().hash(&mut h);
    let path = cache_dir().join(format!("{:016x}.cwasm", h.finish()));
    if let Ok(compiled) = std::fs::read(&path) {
        // SAFETY: the file was written by `Module::serialize` of this same engine configuration (the
        // key covers the wasm bytes and the engine's compatibility hash), in a directory only this
        // harness writes; wasmtime still checks the header and refuses an incompatible artifact.
        if let Ok(m) = unsafe { Module::deserialize(engine, &compiled) } {
            return Ok(m);
        }
    }
    let module = Module::new(engine, bytes)?;
    if let Ok(serialized) = module.serialize() {
        let _ = std::fs::create_dir_all(cache_dir());
        // Write then rename, so a concurrent reader never sees half a file.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, serialized).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }
    Ok(module)
}
