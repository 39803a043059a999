//! Which replica slots hold a member of the fleet: membership that changes at run time.
//!
//! A router is built with a fixed number of slots and every index keeps its meaning for the
//! router's life: the KV index, the load table, health, speeds and the per-replica vectors are all
//! addressed by slot, so a member that leaves is never removed by shifting the others down (every
//! structure would have to be renumbered at once, and a request in flight would be released against
//! another replica). A member that leaves is *drained* first and its slot *vacated* later; a vacated
//! slot is given to the next member that joins (the filter's roster decides which).
//!
//! | state | routed to | index and bookings |
//! |---|---|---|
//! | [`Membership::Member`] | yes | kept |
//! | [`Membership::Draining`] | no (never, even with every member down) | kept: in-flight requests release normally; a member back within the hold time finds its index intact |
//! | [`Membership::Vacant`] | no | dropped when the slot is vacated |

use super::Router;
use crate::policy::Observation;

/// What a slot holds (see the module's table).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Membership {
    /// A member of the fleet: routed to like any replica.
    #[default]
    Member,
    /// A member that left: no new requests; what it has in flight finishes and is released, and
    /// what it holds stays indexed in case it comes back.
    Draining,
    /// No member: nothing routed, indexed or booked.
    Vacant,
}

/// What [`Router::set_membership`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MembershipChange {
    /// Bookings dropped because the slot was vacated with requests still in flight.
    pub dropped_bookings: usize,
    /// The slot's index, load report and learned state were cleared.
    pub cleared: bool,
}

impl Router {
    /// A slot's membership (`Vacant` out of range).
    pub fn membership(&self, replica: usize) -> Membership {
        self.fleet.membership(replica)
    }

    /// Whether a slot takes new requests.
    pub fn is_member(&self, replica: usize) -> bool {
        self.fleet.is_member(replica)
    }

    /// Slots that take new requests.
    pub fn member_count(&self) -> usize {
        self.fleet.member_count()
    }

    /// Sets a slot's membership. Leaving `Vacant` (a new member in the slot) starts from nothing;
    /// entering `Vacant` drops what the slot's previous member left: its blocks from the KV and
    /// approximate indexes, its bookings from the load table, its load report, feed cursor, health
    /// and learned speed, so the next member of the slot inherits none of it. `Member` and
    /// `Draining` move between each other without touching anything (a member that flaps does not
    /// churn the index). Out of range: counted in `bad_replica`, nothing changes.
    pub fn set_membership(&mut self, replica: usize, to: Membership) -> MembershipChange {
        let from = self.fleet.membership(replica);
        if replica >= self.replicas() {
            self.stats.bad_replica += 1;
            return MembershipChange::default();
        }
        let mut change = MembershipChange::default();
        // Entering `Vacant` drops the member's state; leaving it drops whatever reached the slot
        // while it was empty (a batch relayed late by another worker), so a new member starts clean.
        if (to == Membership::Vacant) != (from == Membership::Vacant) {
            change.dropped_bookings = self.load.drop_replica(replica);
            self.clear_slot(replica);
            change.cleared = true;
        }
        self.fleet.set_membership(replica, to);
        change
    }

    /// Everything the router learned about the slot's member, forgotten.
    fn clear_slot(&mut self, replica: usize) {
        self.index.remove_replica(replica);
        self.approx_seq.remove_replica(replica);
        self.approx_text.remove_replica(replica);
        self.feeds.forget(replica);
        self.reported.forget(replica);
        self.fleet.forget(replica);
        self.health.forget(replica);
        self.decider
            .policy
            .observe(Observation::Vacated { replica });
    }
}
