//! kvsteer's routing core: everything the router decides, with no proxy dependency.
//!
//! The proxy-wasm filter, the component and the browser playground are thin adapters around this crate;
//! the replica simulator shares its block identity and feed format.

pub mod block;
pub mod feed;
