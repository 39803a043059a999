//! kvsteer-feed: the feed adapter that runs beside a real engine (vLLM, SGLang) and serves kvsteer's
//! replica feed (docs/reference/feed.md) from the engine's ZMQ KV cache events and Prometheus
//! metrics.
//!
//! - [`wire`]: decoding the engine's msgpack event batches;
//! - [`state`]: the pure view (engine hash -> kvsteer hash, tiers, cap, epochs) and the feed it serves;
//! - [`engine_metrics`]: reading the engine's `/metrics` into load fields;
//! - [`run`]: the tasks (ZMQ subscriber with replay, scraper, HTTP server); [`config`]: the flags;
//! - [`obs`]: the adapter's own Prometheus metrics; [`encode`]: vLLM-shaped payloads for tests and bench;
//! - [`bundle`]: the engine's tokenizer files served to routers that fetch them (`--model-dir`).
//!
//! docs/guide/feed-adapter.md has the operator's view.

pub mod bundle;
pub mod config;
pub mod discover;
pub mod encode;
pub mod engine_metrics;
pub mod obs;
pub mod run;
pub mod state;
pub mod wire;
