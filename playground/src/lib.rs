//! kvsteer's browser playground: the routing core (`kvsteer-core`), the simulated engines
//! (`kvsteer-sim`) and the workloads (`kvsteer-workload`) running together in virtual time, compiled to
//! WebAssembly for a static page (`playground/www/`, built by `scripts/playground`).
//!
//! [`replay`] is the whole simulation and is plain Rust: the page calls it through [`web`]
//! (wasm-bindgen), and the native binary `playground-replay` runs the very same code, so the page's
//! numbers can be checked against a native run for the same seed (`scripts/test-playground`).

pub mod replay;

#[cfg(target_arch = "wasm32")]
pub mod web;
