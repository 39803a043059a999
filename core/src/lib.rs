//! kvsteer's routing core: everything the router decides, with no proxy dependency.
//!
//! The proxy-wasm filter, the component and the browser playground are built around this crate; the
//! replica simulator shares its block identity and feed format.

pub mod adapters;
pub mod admission;
pub mod approx;
pub mod block;
pub mod bundle;
pub mod config;
pub mod disaggregation;
pub mod dp;
pub mod feed;
pub mod health;
pub mod index;
mod journal;
pub mod load;
pub mod output;
pub mod policy;
pub mod record;
pub mod request;
pub mod rng;
pub mod router;
pub mod speed;
pub mod working_set;

pub use config::{ConfigError, PolicyKind, RoutingConfig};
pub use load::LoadTotals;
pub use request::{
    ChatTurn, EarlyScan, PromptIdentity, PromptTokenizer, RequestError, RouteRequest,
};
pub use router::{
    Decision, FallbackReason, FeedOutcome, Membership, MembershipChange, Router, RouterStats,
};
