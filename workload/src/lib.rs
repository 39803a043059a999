//! Workloads and routing-quality measurement (docs/design/design.md section 7).
//!
//! The crate knows nothing about engines or routers: it deals in token ids, sessions, integer
//! microseconds and replica indices. A [`session::Workload`] is built by a generator ([`rl`]) or a trace
//! reader ([`weka`], [`mooncake`], [`azure`]); a [`driver::Driver`] issues its requests in virtual time as
//! the consumer's event loop reports completions; a [`measure::Recorder`] turns what the consumer saw into
//! a [`measure::Summary`]; [`report`] prints summaries side by side and [`plot`] draws SVG plots.

pub mod arrivals;
pub mod azure;
pub mod catalog;
pub mod chat;
pub mod driver;
pub mod error;
pub mod measure;
pub mod mooncake;
#[cfg(not(target_arch = "wasm32"))]
pub mod plot;
pub mod report;
pub mod rl;
pub mod session;
pub mod token_blocks;
pub mod weka;

pub use driver::{Driver, Issue, Mode, SessionRef};
pub use error::WorkloadError;
pub use measure::{Recorder, RequestRow, Summary};
pub use session::{BlockPrompt, Prompt, Session, Turn, Workload};
