//! The fleet as the router addresses it: which slots hold a member ([`Membership`]), which members
//! are down (unreachable, as the filter reports them) and which units share an address (the
//! data-parallel ranks of one endpoint). Health learned from completions (ejections) is kept apart,
//! in [`crate::health::Health`]: the fleet is what the filter tells the router, health what the
//! router learns itself.
//!
//! Every question the policies and the retry backup ask of it ("up?", "avoided?", "which address?")
//! is answered here from these three vectors alone, so the router can borrow the fleet while it
//! borrows health mutably (a probe is taken from health among the slots the fleet calls up).

use super::Membership;

/// Per slot: its membership, whether it is down, and its address group.
#[derive(Clone, Debug)]
pub(super) struct Fleet {
    /// Per slot: whether it holds a member, a draining one or none (`super::membership`).
    members: Vec<Membership>,
    /// Replicas believed unreachable (their feed cannot even be connected to): avoided by every
    /// policy while any other replica is up.
    down: Vec<bool>,
    /// Per unit: the first unit with its address ([`Fleet::set_address_groups`]); empty: each its
    /// own.
    address_groups: Vec<usize>,
}

impl Fleet {
    /// `replicas` slots, each a member, none down, each on its own address.
    pub(super) fn new(replicas: usize) -> Fleet {
        Fleet {
            members: vec![Membership::Member; replicas],
            down: vec![false; replicas],
            address_groups: Vec::new(),
        }
    }

    /// The number of slots (members or not): fixed for the router's life.
    pub(super) fn len(&self) -> usize {
        self.members.len()
    }

    /// A slot's membership (`Vacant` out of range).
    pub(super) fn membership(&self, replica: usize) -> Membership {
        self.members
            .get(replica)
            .copied()
            .unwrap_or(Membership::Vacant)
    }

    /// Whether a slot holds a member that takes new requests (false out of range).
    pub(super) fn is_member(&self, replica: usize) -> bool {
        self.membership(replica) == Membership::Member
    }

    /// Slots that take new requests.
    pub(super) fn member_count(&self) -> usize {
        self.members
            .iter()
            .filter(|&&m| m == Membership::Member)
            .count()
    }

    /// Sets a slot's membership and returns what it was; `None`, nothing changed, out of range.
    pub(super) fn set_membership(&mut self, replica: usize, to: Membership) -> Option<Membership> {
        let slot = self.members.get_mut(replica)?;
        Some(std::mem::replace(slot, to))
    }

    /// Marks a replica down (or up again); false, nothing changed, out of range.
    pub(super) fn set_down(&mut self, replica: usize, down: bool) -> bool {
        match self.down.get_mut(replica) {
            Some(d) => {
                *d = down;
                true
            }
            None => false,
        }
    }

    /// Whether a replica is marked down (false out of range).
    pub(super) fn is_down(&self, replica: usize) -> bool {
        self.down.get(replica).copied().unwrap_or(false)
    }

    /// A member that is not down: what may be routed to unless ejected, and what may take a probe.
    pub(super) fn is_up(&self, replica: usize) -> bool {
        self.is_member(replica) && !self.down.get(replica).copied().unwrap_or(true)
    }

    /// The slot's member left: it is no longer down (its next member starts reachable).
    pub(super) fn forget(&mut self, replica: usize) {
        if let Some(d) = self.down.get_mut(replica) {
            *d = false;
        }
    }

    /// Which units share an address (`groups[unit]` equal). Ignored unless it names every slot.
    pub(super) fn set_address_groups(&mut self, groups: Vec<usize>) {
        if groups.len() == self.len() {
            self.address_groups = groups;
        }
    }

    /// A unit's address group: the first unit with its address (itself without groups).
    pub(super) fn group(&self, replica: usize) -> usize {
        self.address_groups.get(replica).copied().unwrap_or(replica)
    }

    /// The replicas to avoid, as the policies take them, given which are `ejected` for failing:
    /// those not usable (up and not ejected) while some replica is; with none usable, those down
    /// while some member is up (an ejected replica beats a dead one); with every member down, only
    /// the slots without a member. A slot that is not a member (draining or vacant) is avoided
    /// whenever any member exists; with none at all, nothing is.
    pub(super) fn avoided(&self, ejected: impl Fn(usize) -> bool) -> Vec<bool> {
        let n = self.len();
        let usable = |r: usize| self.is_up(r) && !ejected(r);
        let absent = |r: usize| !self.is_member(r);
        if (0..n).any(usable) {
            (0..n).map(|r| !usable(r)).collect()
        } else if (0..n).all(absent) {
            vec![false; n]
        } else if (0..n).all(|r| self.down[r] || absent(r)) {
            (0..n).map(absent).collect()
        } else {
            (0..n).map(|r| self.down[r] || absent(r)).collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NONE_EJECTED: fn(usize) -> bool = |_| false;

    #[test]
    fn down_and_ejected_replicas_are_avoided_while_another_is_usable() {
        let mut f = Fleet::new(3);
        assert_eq!(f.avoided(NONE_EJECTED), vec![false; 3]);
        assert!(f.set_down(0, true));
        assert_eq!(f.avoided(|r| r == 1), vec![true, true, false]);
        // None usable: an ejected replica beats a dead one.
        assert_eq!(f.avoided(|r| r != 0), vec![true, false, false]);
        // Every member down: routing carries on as if none were.
        f.set_down(1, true);
        f.set_down(2, true);
        assert_eq!(f.avoided(NONE_EJECTED), vec![false; 3]);
        assert!(!f.set_down(3, true), "out of range");
        assert!(!f.is_down(3));
    }

    #[test]
    fn slots_without_a_member_are_avoided_whenever_a_member_exists() {
        let mut f = Fleet::new(3);
        assert_eq!(
            f.set_membership(1, Membership::Draining),
            Some(Membership::Member)
        );
        assert_eq!(
            f.set_membership(2, Membership::Vacant),
            Some(Membership::Member)
        );
        assert_eq!(f.set_membership(3, Membership::Vacant), None);
        assert_eq!(f.member_count(), 1);
        assert!(f.is_up(0) && !f.is_up(1) && !f.is_up(2) && !f.is_up(3));
        // Even with the one member down, the others are not routed to.
        f.set_down(0, true);
        assert_eq!(f.avoided(NONE_EJECTED), vec![false, true, true]);
        // With no member at all, nothing is avoided.
        f.set_membership(0, Membership::Vacant);
        assert_eq!(f.avoided(NONE_EJECTED), vec![false; 3]);
        assert_eq!(f.membership(7), Membership::Vacant);
    }

    #[test]
    fn address_groups_name_every_unit_or_are_ignored() {
        let mut f = Fleet::new(3);
        assert_eq!((f.group(0), f.group(2)), (0, 2));
        f.set_address_groups(vec![0, 0]);
        assert_eq!(f.group(1), 1, "a grouping short of a unit is ignored");
        f.set_address_groups(vec![0, 0, 2]);
        assert_eq!((f.group(1), f.group(2), f.group(5)), (0, 2, 5));
    }

    #[test]
    fn a_forgotten_slot_is_no_longer_down() {
        let mut f = Fleet::new(2);
        f.set_down(1, true);
        f.forget(1);
        assert!(!f.is_down(1));
    }
}
