//! The request path's own counters: bookings made and released, bodies routed unread and the
//! client headers removed, failed answers held against no replica. Each other part keeps its own
//! (feeds, admission, sharing, discovery).

use super::BodyFallback;

/// Counters of the requests this worker saw, since start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestCounters {
    /// Body fallbacks by reason, in [`BodyFallback`] order.
    body_fallbacks: [u64; 5],
    /// Client-supplied copies of the routing header that were removed.
    spoofed_headers: u64,
    /// Failed answers held against no replica (`health::answer_outcome`).
    failures_not_blamed: u64,
    /// Bookings in the load table (a request, or one leg of a P/D request) made and released by
    /// this worker: their difference is what it has in flight, so a proxy whose counters (summed
    /// over its workers) differ once traffic stops has leaked load.
    bookings: u64,
    releases: u64,
}

impl RequestCounters {
    /// A body routed without being read, for this reason.
    pub fn fallback(&mut self, why: BodyFallback) {
        self.body_fallbacks[why as usize] += 1;
    }

    /// Body fallbacks so far, by reason in [`BodyFallback`] order.
    pub fn body_fallbacks(&self) -> [u64; 5] {
        self.body_fallbacks
    }

    /// `n` bookings made (a request, or each leg of a P/D request).
    pub fn booked(&mut self, n: u64) {
        self.bookings += n;
    }

    /// A release: `released` false for a request not tracked, which counts nothing.
    pub fn released(&mut self, released: bool) {
        self.releases += released as u64;
    }

    /// Whether anything was ever booked.
    pub fn has_booked(&self) -> bool {
        self.bookings > 0
    }

    /// Bookings made and released so far.
    pub fn bookings(&self) -> (u64, u64) {
        (self.bookings, self.releases)
    }

    /// A client's copy of the routing header was removed.
    pub fn spoofed_header_removed(&mut self) {
        self.spoofed_headers += 1;
    }

    pub fn spoofed_headers(&self) -> u64 {
        self.spoofed_headers
    }

    /// A failed answer was not held against any replica.
    pub fn failure_not_blamed(&mut self) {
        self.failures_not_blamed += 1;
    }

    pub fn failures_not_blamed(&self) -> u64 {
        self.failures_not_blamed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_counter_counts_its_own() {
        let mut c = RequestCounters::default();
        assert!(!c.has_booked());
        c.booked(2);
        c.released(true);
        c.released(false);
        assert!(c.has_booked());
        assert_eq!(c.bookings(), (2, 1), "an untracked release counts nothing");
        c.fallback(BodyFallback::TooLarge);
        c.fallback(BodyFallback::HoldLimit);
        c.fallback(BodyFallback::HoldLimit);
        assert_eq!(c.body_fallbacks(), [0, 1, 0, 0, 2]);
        c.spoofed_header_removed();
        c.failure_not_blamed();
        c.failure_not_blamed();
        assert_eq!((c.spoofed_headers(), c.failures_not_blamed()), (1, 2));
    }
}
