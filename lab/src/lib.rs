//! kvsteer-lab: the experiments run on the harness (`kvsteer-host-test`), which runs the compiled
//! filter on the proxy-wasm host (`kvsteer-wasm-host`).
//!
//! - [`bench`]: the benchmark behind docs/reports/results.md, the demo's replay, the routing
//!   model's judge (`model_eval`, its five validation rounds as data files in `lab/rounds/`), the fleet
//!   and churn measurements.
//! - [`byte_pass`]: filter-bench's baseline, a module that only passes bytes.
//!
//! The binaries: `bench`, `demo`, `model-eval`, `fleet-bench`, `filter-bench`, `tokenizer-bench`,
//! `fuzz`.

pub mod bench;
pub mod byte_pass;
