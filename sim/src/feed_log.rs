//! The replica's side of the feed now lives in the core (`kvsteer_core::feed_log`), shared with the
//! feed adapter for real engines (`kvsteer-feed`); re-exported here under its old path.

pub use kvsteer_core::feed_log::FeedLog;
