//! Membership at run time: polling the discovery source, and seating what it lists in the routing
//! slots after the static replicas ([`crate::worker::discovery::roster`]). A member seated in a slot is routed to from
//! its first feed snapshot; one that leaves drains (no new requests, what it has in flight is
//! released as usual) and is vacated after `discovery.hold_ms`, when the router drops its blocks
//! and bookings. A refused answer changes nothing: the last good membership stays.

pub mod roster;

use super::{FeedState, WorkerState};
use crate::config::{DiscoverySection, OutputMode, Unit};
use crate::host::store::SharedStore;
use crate::worker::discovery::roster::{ROSTER_KEY, Refusal, Roster, RosterRules};
use kvsteer_core::router::Membership;

/// Poll state and counters of the discovery source.
#[derive(Clone, Debug, Default)]
pub struct DiscoveryState {
    pub roster: Roster,
    pub in_flight: Option<u32>,
    pub polled_ms: u64,
    pub next_poll_ms: u64,
    pub polls: u64,
    /// Answers that changed the membership.
    pub updates: u64,
    /// Answers refused, by [`Refusal::KINDS`].
    pub refused: [u64; 6],
    /// Polls with no usable answer (HTTP error, unreachable, timed out, not dispatched).
    pub failures: u64,
    /// Units seated, set to draining, and vacated, in this worker.
    pub joined: u64,
    pub left: u64,
    pub vacated: u64,
    /// Bookings dropped because their slot was vacated with them still in flight.
    pub dropped_bookings: u64,
}

impl DiscoveryState {
    /// `slots` empty slots after the static units.
    pub fn new(slots: usize) -> DiscoveryState {
        DiscoveryState {
            roster: Roster::new(slots),
            ..DiscoveryState::default()
        }
    }

    /// A poll out for twice its timeout and a second counts as lost (the proxy answers every
    /// callout, a timeout included).
    fn lost_after(d: &DiscoverySection) -> u64 {
        d.timeout_ms.saturating_mul(2).saturating_add(1_000)
    }

    /// Whether a poll is out and not yet counted lost.
    fn out(&self, d: &DiscoverySection, now_ms: u64) -> bool {
        self.in_flight.is_some() && now_ms.saturating_sub(self.polled_ms) < Self::lost_after(d)
    }

    /// Whether a poll is due: none out and the period passed. A poll out past
    /// [`Self::lost_after`] is counted lost first, so that one never answered cannot stop the
    /// polling for good.
    fn due(&mut self, d: &DiscoverySection, now_ms: u64) -> bool {
        if self.in_flight.is_some() {
            if self.out(d, now_ms) {
                return false;
            }
            self.in_flight = None;
            self.failures += 1;
        }
        self.next_poll_ms <= now_ms
    }

    fn started(&mut self, token: u32, now_ms: u64, period_ms: u64) {
        self.in_flight = Some(token);
        self.polled_ms = now_ms;
        self.polls += 1;
        self.next_poll_ms = now_ms.saturating_add(period_ms);
    }

    fn not_started(&mut self, now_ms: u64, period_ms: u64) {
        self.failures += 1;
        self.next_poll_ms = now_ms.saturating_add(period_ms);
    }

    /// Whether `token` is the poll out; if so it is answered, no longer out.
    fn answered(&mut self, token: u32) -> bool {
        if self.in_flight != Some(token) {
            return false;
        }
        self.in_flight = None;
        true
    }

    fn refuse(&mut self, r: Refusal) -> DiscoveryResult {
        if let Some(i) = Refusal::KINDS.iter().position(|&k| k == r.kind()) {
            self.refused[i] += 1;
        }
        DiscoveryResult::Refused(r)
    }
}

/// A discovery poll to dispatch now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryPoll {
    pub upstream: String,
    pub authority: String,
    pub path: String,
    pub timeout_ms: u64,
}

/// What a discovery answer did, for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiscoveryResult {
    /// The membership changed: units seated, set to draining, vacated.
    Changed {
        joined: usize,
        left: usize,
        vacated: usize,
        members: usize,
    },
    Unchanged,
    Refused(Refusal),
    Failed(String),
    /// Not a discovery poll's token.
    Unknown,
}

/// What adopting a roster did to the slots.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Moves {
    joined: usize,
    left: usize,
    vacated: usize,
}

impl WorkerState {
    /// Whether any unit takes requests (discovery may not have seated anyone yet).
    pub fn has_members(&self) -> bool {
        self.router.member_count() > 0
    }

    pub fn discovery(&self) -> &DiscoveryState {
        &self.discovery
    }

    /// The discovery poll to send now, if one is due (and, in nginx mode, if the tick's one
    /// callout is free).
    pub fn plan_discovery_poll(&mut self, now_ms: u64) -> Option<DiscoveryPoll> {
        let d = self.cfg.discovery.as_ref()?;
        if !self.discovery.due(d, now_ms) {
            return None;
        }
        let limit = self.callouts_per_tick();
        if limit != usize::MAX {
            if self.callout_out(now_ms) || self.budget.callouts() >= limit {
                return None;
            }
            self.budget.plan_callouts(1);
        }
        Some(DiscoveryPoll {
            upstream: d.cluster.clone(),
            authority: self.cfg.discovery_authority().to_string(),
            path: d.path.clone(),
            timeout_ms: d.timeout_ms,
        })
    }

    /// Whether the discovery poll is out (and not yet counted lost): nginx sends no other callout
    /// meanwhile ([`WorkerState::callout_out`]).
    pub(super) fn discovery_out(&self, now_ms: u64) -> bool {
        let Some(d) = self.cfg.discovery.as_ref() else {
            return false;
        };
        self.discovery.out(d, now_ms)
    }

    pub fn discovery_poll_started(&mut self, token: u32, now_ms: u64) {
        let period = self.cfg.discovery.as_ref().map_or(0, |d| d.period_ms);
        self.discovery.started(token, now_ms, period);
    }

    pub fn discovery_poll_not_started(&mut self, now_ms: u64) {
        let period = self.cfg.discovery.as_ref().map_or(0, |d| d.period_ms);
        self.discovery.not_started(now_ms, period);
    }

    pub fn is_discovery_poll(&self, token: u32) -> bool {
        self.discovery.in_flight == Some(token)
    }

    /// The discovery poll answered with a body over `discovery.max_response_bytes`, left unread.
    pub fn on_discovery_oversized(&mut self, token: u32, body_size: usize) -> DiscoveryResult {
        if !self.discovery.answered(token) {
            return DiscoveryResult::Unknown;
        }
        self.discovery.refuse(Refusal::Oversized(body_size))
    }

    /// Handles the discovery poll's answer: a good list becomes the proxy's roster (written to
    /// shared data for the other workers when there is a store); anything else is refused and
    /// counted, and the membership stays as it was.
    pub fn on_discovery_answer(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: Option<&[u8]>,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> DiscoveryResult {
        if !self.discovery.answered(token) {
            return DiscoveryResult::Unknown;
        }
        let Some(d) = self.cfg.discovery.as_ref() else {
            return DiscoveryResult::Unknown;
        };
        let body = match (status, body) {
            (Some(200), b) => b.unwrap_or_default(),
            (Some(s), _) => {
                self.discovery.failures += 1;
                return DiscoveryResult::Failed(format!("HTTP {s}"));
            }
            (None, _) => {
                self.discovery.failures += 1;
                return DiscoveryResult::Failed("no answer (refused, reset or timed out)".into());
            }
        };
        let refuse = DiscoveryState::refuse;
        if body.len() > d.max_response_bytes {
            return refuse(&mut self.discovery, Refusal::Oversized(body.len()));
        }
        let static_names: Vec<String> = self.cfg.units[..self.cfg.static_units()]
            .iter()
            .map(|r| r.name.clone())
            .collect();
        let rules = RosterRules {
            static_names: &static_names,
            hold_ms: d.hold_ms,
        };
        // Start from the proxy's roster (another worker may have moved it on), else this one's.
        let (base, cas) = self
            .shared_roster(store)
            .unwrap_or_else(|| (self.discovery.roster.clone(), None));
        let next = match base.apply(body, &rules, now_ms) {
            Ok(next) => next,
            Err(r) => return refuse(&mut self.discovery, r),
        };
        if next.version != base.version
            && let Some(s) = store
        {
            // Lost to another worker's write: adopt theirs at the next tick, this answer is
            // not lost (the next poll says the same).
            let key = self.roster_key();
            if !s.set(&key, &next.encode(), cas) {
                return DiscoveryResult::Unchanged;
            }
        }
        self.adopt_roster(next, now_ms)
    }

    /// Each tick: adopts a newer roster another worker wrote, and vacates members gone past the
    /// hold time when the source has gone quiet (no answer has done it).
    pub fn sync_roster(&mut self, store: Option<&dyn SharedStore>, now_ms: u64) {
        let Some(hold) = self.cfg.discovery.as_ref().map(|d| d.hold_ms) else {
            return;
        };
        let mut current = self.discovery.roster.clone();
        let mut cas = None;
        if let Some((shared, c)) = self.shared_roster(store)
            && shared.version != current.version
        {
            current = shared;
            cas = c;
        }
        if let Some(expired) = current.expire(hold, now_ms) {
            let written = match store {
                Some(s) => s.set(&self.roster_key(), &expired.encode(), cas),
                None => true,
            };
            if written {
                current = expired;
            }
        }
        if current.version != self.discovery.roster.version {
            self.adopt_roster(current, now_ms);
        }
    }

    fn roster_key(&self) -> String {
        format!("{}.{ROSTER_KEY}", self.cfg.shared_key_prefix)
    }

    /// The proxy's roster in shared data, with its CAS token; `None` without a store or a valid
    /// record (the first answer creates it).
    fn shared_roster(&self, store: Option<&dyn SharedStore>) -> Option<(Roster, Option<u32>)> {
        let slots = self.discovery.roster.seats.len();
        let (bytes, cas) = store?.get(&self.roster_key())?;
        Some((Roster::decode(&bytes, slots)?, Some(cas)))
    }

    /// Makes `next` this worker's membership: slots whose member changed are vacated (the router
    /// drops what the old one left) and given their new member; a member that left or came back
    /// only changes between draining and member.
    fn adopt_roster(&mut self, next: Roster, now_ms: u64) -> DiscoveryResult {
        let base = self.cfg.static_units();
        let mut moves = Moves::default();
        let slots = next.seats.len().min(self.discovery.roster.seats.len());
        for k in 0..slots {
            let unit = base + k;
            let old = self.discovery.roster.seats[k].clone();
            let new = next.seats[k].clone();
            let same = match (&old, &new) {
                (Some(o), Some(n)) => {
                    o.name == n.name
                        && o.endpoint == n.endpoint
                        && o.feed == n.feed
                        && o.rank == n.rank
                }
                _ => false,
            };
            if !same && old.is_some() {
                let change = self.router.set_membership(unit, Membership::Vacant);
                self.discovery.dropped_bookings += change.dropped_bookings as u64;
                self.discovery.vacated += 1;
                moves.vacated += 1;
                self.seat_unit(unit, k, None);
            }
            let Some(n) = new else { continue };
            let to = if n.leaving_since_ms.is_some() {
                Membership::Draining
            } else {
                Membership::Member
            };
            if !same {
                self.seat_unit(unit, k, Some(&n));
                self.feeds[unit].next_poll_ms = now_ms;
                self.discovery.joined += 1;
                moves.joined += 1;
            } else if to == Membership::Draining && self.router.is_member(unit) {
                self.discovery.left += 1;
                moves.left += 1;
            }
            self.router.set_membership(unit, to);
        }
        self.discovery.roster = next;
        if moves == Moves::default() {
            return DiscoveryResult::Unchanged;
        }
        self.discovery.updates += 1;
        self.refresh_units();
        DiscoveryResult::Changed {
            joined: moves.joined,
            left: moves.left,
            vacated: moves.vacated,
            members: self.discovery.roster.listed(),
        }
    }

    /// Writes a slot's member (or the placeholder of an empty slot) where the filter reads a unit's
    /// name, addresses and rank, and starts its feed afresh. The relay position is kept: relayed
    /// batches already seen belong to the slot's previous member.
    fn seat_unit(
        &mut self,
        unit: usize,
        k: usize,
        seat: Option<&crate::worker::discovery::roster::Seat>,
    ) {
        let nginx = self.cfg.output == OutputMode::NginxVariable;
        let Some(spec) = self.cfg.units.get_mut(unit) else {
            return;
        };
        match seat {
            Some(s) => {
                spec.name = s.name.clone();
                spec.endpoint = s.endpoint.clone();
                spec.feed_authority = Some(s.feed.clone());
                spec.feed_address = nginx.then(|| s.feed.clone());
                spec.rank = s.rank;
            }
            None => *spec = Unit::vacant_slot(k, spec.feed_cluster.take()),
        }
        if let Some(f) = self.feeds.get_mut(unit) {
            let relay_seen = f.relay_seen;
            *f = FeedState {
                relay_seen,
                ..FeedState::default()
            };
        }
        // The unit's rank header value is formatted again with the destinations
        // ([`Self::refresh_units`], which follows every seating).
    }

    /// What is formatted once per membership: the destination and rank values and the address
    /// groups.
    fn refresh_units(&mut self) {
        self.destinations = super::Destinations::new(&self.cfg);
        self.router
            .set_address_groups(super::address_groups(&self.cfg.units));
    }

    /// The feed address a discovered unit's poll is steered to through `discovery.feed_cluster`
    /// (its `override_host` reads the destination header); `None` for a static replica.
    pub fn feed_destination(&self, unit: usize) -> Option<&str> {
        if unit < self.cfg.static_units() || self.cfg.output != OutputMode::DestinationHeader {
            return None;
        }
        self.cfg.units.get(unit)?.feed_authority.as_deref()
    }
}

#[cfg(test)]
mod tests;
