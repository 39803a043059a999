//! The benchmark behind docs/reports/results.md (`scripts/bench`, binary `bench`): every filter
//! policy on every workload of docs/design/design.md section 7, through the compiled filter in the
//! wasmtime harness, in virtual time, on identical simulated replicas, over several seeds.
//!
//! - [`scenario`]: the matrix (which workloads at which sizes) and the engine for a block size.
//! - [`run`]: one replay (also what the demo runs).
//! - [`report`]: tables over seeds, the published claims checked, plots.
//! - [`fleet`]: the routing model's replays on fleets of 4 to 64 replicas, load growing with them.
//! - [`churn`]: one workload while discovery adds and removes members, against a static fleet.
//! - [`jsonl`]: replays appended as JSON lines, resumable.
//! - [`args`]: the command lines of the `bench` and `demo` binaries.
//! - [`progress`]: their replays on a few threads, with one progress bar.

pub mod args;
pub mod churn;
pub mod fleet;
pub mod jsonl;
pub mod model_eval;
pub mod progress;
pub mod report;
pub mod run;
pub mod scenario;
