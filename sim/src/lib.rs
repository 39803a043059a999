//! kvsteer-sim: a simulated vLLM-like engine replica (docs/design/simulator.md;
//! docs/design/design.md sections 5 and 6).
//!
//! The [`engine`] model runs in virtual time for the local harness (fast and deterministic for a seed)
//! and behind the OpenAI-compatible [`server`] in real, optionally scaled, time. It shares block
//! identity and the feed format with the routing core (`kvsteer_core::block`, `kvsteer_core::feed`).
//! docs/design/simulator.md describes the model, its parameters and their sources.

pub mod dp;
pub mod engine;
pub mod kv;
pub mod kv_link;
pub mod lora;
pub mod output;
pub mod profile;
pub mod stall;
pub mod tokenize;

pub use engine::{
    Engine, EngineConfig, EngineEvent, EngineRequest, EngineStats, FinishReason, SeqView,
    SubmitError,
};
pub use output::{OutputLen, output_token};
pub use profile::{Profile, StepWork};
pub mod metrics;
#[cfg(not(target_arch = "wasm32"))]
pub mod server;
