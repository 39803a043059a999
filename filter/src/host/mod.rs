//! The host side: the proxy-wasm contexts and everything that calls the proxy. All host calls are
//! made here (through `abi.rs`, each with a fallback), all decisions in [`crate::worker`]. The root
//! context (`Root`, `root.rs`) configures the VM and runs its tick; a stream context (`stream.rs`)
//! follows one request, and, in a prefill/decode fleet, its prefill leg (`prefill.rs`); the
//! metrics are `metrics.rs`'. What they share: the VM's state and the host reads (`vm.rs`), the
//! clock (`clock.rs`) and the proxy's shared data ([`store`], whose trait is built natively too, so
//! the worker's shared records are tested against an in-memory store).

pub mod store;

#[cfg(target_arch = "wasm32")]
mod abi;
#[cfg(all(target_arch = "wasm32", feature = "tokenizer"))]
mod bundle;
#[cfg(target_arch = "wasm32")]
mod clock;
#[cfg(target_arch = "wasm32")]
mod metrics;
#[cfg(target_arch = "wasm32")]
mod prefill;
#[cfg(target_arch = "wasm32")]
mod root;
#[cfg(target_arch = "wasm32")]
mod stream;
#[cfg(target_arch = "wasm32")]
mod vm;

#[cfg(target_arch = "wasm32")]
pub use root::Root;
