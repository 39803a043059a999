//! The proxy's clock, read through the ABI, which must never run backwards for the router.

use super::abi;
use std::cell::Cell;

pub(super) fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

thread_local! {
    /// The last time the proxy's clock was read ([`now_ns`]).
    static LAST_NS: Cell<u64> = const { Cell::new(0) };
}

/// The proxy's clock in nanoseconds (Envoy: the system clock, read afresh on every call, nanosecond
/// resolution), for the feed's time budget. A refused read answers the last time read (0 before
/// any): the clock stands still for a moment rather than jumping back to 1970, which would make
/// every deadline and age in the router look expired or fresh at once.
pub(super) fn now_ns() -> u64 {
    match abi::now_ns() {
        Ok(t) => {
            LAST_NS.set(t);
            t
        }
        Err(_) => LAST_NS.get(),
    }
}
