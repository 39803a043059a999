//! kvsteer's routing core: everything the router decides, with no proxy dependency.
//!
//! The proxy-wasm filter, the component and the browser playground are thin adapters around this crate;
//! the replica simulator shares its block identity and feed format.

pub mod approx;
pub mod block;
pub mod config;
pub mod feed;
pub mod index;
pub mod load;
pub mod request;
pub mod rng;
