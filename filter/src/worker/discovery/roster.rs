//! The fleet's run-time membership: the discovery document (docs/design/discovery.md) read and
//! checked, and the roster that seats each member in a routing slot.
//!
//! The router is built with a fixed number of slots (`discovery.max_members` of them after the
//! static replicas), and every per-replica structure (the KV index, the load table, the shared
//! load and health records, the feed lease and relay, the metrics) is addressed by slot. So a member
//! keeps its slot for as long as it is a member, a member that leaves keeps it through the hold
//! time (draining: no new requests; back within the hold, it finds its index intact), and only
//! then is the slot vacated and given to the next member that joins. Every worker of a proxy must
//! agree on the seating, because the shared records are per slot: the roster is one shared-data
//! record ([`ROSTER_KEY`]), written with compare-and-swap by whichever worker read a new document
//! and adopted by the others at their next tick.
//!
//! Every byte of a document is hostile: it is parsed by serde into bounded types, every field is
//! checked, and a document refused for any reason leaves the roster as it was.

use crate::config::valid_name;
use kvsteer_core::disaggregation::Role;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// The shared-data key (after `shared_key_prefix` and a dot) of the proxy's roster.
pub const ROSTER_KEY: &str = "roster";

/// One member as the discovery document lists it.
#[derive(Clone, Debug, Deserialize)]
struct DocMember {
    name: String,
    endpoint: String,
    /// The feed's `IP:port`; the serving endpoint when absent (a server that answers its own feed).
    #[serde(default)]
    feed: Option<String>,
    #[serde(default = "one")]
    ranks: u32,
    #[serde(default)]
    role: Option<String>,
}

fn one() -> u32 {
    1
}

#[derive(Clone, Debug, Deserialize)]
struct Document {
    members: Vec<DocMember>,
}

/// Why a discovery answer was refused (each has its own counter and log line).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not the document's JSON shape.
    Malformed(String),
    /// No member listed: far likelier a broken source than a fleet scaled to nothing.
    Empty,
    /// More members (or ranks) than the slots hold.
    TooMany { listed: usize, slots: usize },
    /// A member with a bad name, address, rank count or role.
    BadMember(String),
    /// A name (or serving address) listed twice, or a name the static replicas already use.
    Duplicate(String),
    /// A body over `discovery.max_response_bytes`.
    Oversized(usize),
}

impl Refusal {
    /// The counter's suffix (`kvsteer_discovery_refused_<kind>`).
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Malformed(_) => "malformed",
            Refusal::Empty => "empty",
            Refusal::TooMany { .. } => "too_many",
            Refusal::BadMember(_) => "bad_member",
            Refusal::Duplicate(_) => "duplicate",
            Refusal::Oversized(_) => "oversized",
        }
    }

    /// Every kind, in counter order.
    pub const KINDS: [&'static str; 6] = [
        "malformed",
        "empty",
        "too_many",
        "bad_member",
        "duplicate",
        "oversized",
    ];
}

impl core::fmt::Display for Refusal {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Refusal::Malformed(e) => write!(f, "not a member list: {e}"),
            Refusal::Empty => f.write_str("empty member list"),
            Refusal::TooMany { listed, slots } => {
                write!(f, "{listed} members (ranks counted) for {slots} slots")
            }
            Refusal::BadMember(e) => write!(f, "bad member: {e}"),
            Refusal::Duplicate(e) => write!(f, "duplicate: {e}"),
            Refusal::Oversized(n) => write!(f, "answer of {n} bytes is over the limit"),
        }
    }
}

/// One routing unit of a member: the member itself, or one DP rank of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seat {
    /// The unit's name (`NAME`, or `NAME_dpK` for rank K of a member with several).
    pub name: String,
    pub endpoint: String,
    pub feed: String,
    /// The DP rank, `None` for a member with one rank.
    pub rank: Option<u32>,
    /// When the member left the document (proxy clock, ms); `None` while listed.
    pub leaving_since_ms: Option<u64>,
}

impl Seat {
    /// The same unit of the same engine: a member that comes back under its name with another
    /// address is another engine (a pod rescheduled), which starts from an empty slot.
    fn same_unit(&self, other: &Seat) -> bool {
        self.name == other.name
            && self.endpoint == other.endpoint
            && self.feed == other.feed
            && self.rank == other.rank
    }
}

/// The seating of discovered members in the slots after the static replicas.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Roster {
    /// Bumped by each change, so workers adopt only a newer roster.
    pub version: u64,
    pub seats: Vec<Option<Seat>>,
}

/// Limits and names a document is checked against.
#[derive(Clone, Debug)]
pub struct RosterRules<'a> {
    /// Names the static replicas use (a member may not take one).
    pub static_names: &'a [String],
    pub hold_ms: u64,
}

impl Roster {
    pub fn new(slots: usize) -> Roster {
        Roster {
            version: 0,
            seats: vec![None; slots],
        }
    }

    /// The roster as stored in shared data.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A stored roster, refused unless it has exactly `slots` seats (another configuration's).
    pub fn decode(bytes: &[u8], slots: usize) -> Option<Roster> {
        let r: Roster = serde_json::from_slice(bytes).ok()?;
        (r.seats.len() == slots).then_some(r)
    }

    /// Seated members, leaving or not.
    pub fn seated(&self) -> usize {
        self.seats.iter().flatten().count()
    }

    /// Members listed (not leaving).
    pub fn listed(&self) -> usize {
        self.seats
            .iter()
            .flatten()
            .filter(|s| s.leaving_since_ms.is_none())
            .count()
    }

    /// The roster after a discovery answer `body` read at `now_ms`: members listed keep their seat
    /// (a leaving one comes back), new ones take a free seat (or the one left longest ago when none
    /// is free), members no longer listed start leaving, and those gone past the hold time are
    /// unseated. A refused document changes nothing.
    pub fn apply(&self, body: &[u8], rules: &RosterRules, now_ms: u64) -> Result<Roster, Refusal> {
        let units = read_document(body, rules, self.seats.len())?;
        let mut next = self.clone();
        // Members no longer listed (or listed with another address) start leaving; past the hold,
        // their seat is freed.
        for seat in next.seats.iter_mut() {
            let Some(s) = seat else { continue };
            let listed = units.iter().any(|u| u.same_unit(s));
            if listed {
                s.leaving_since_ms = None;
            } else {
                let since = *s.leaving_since_ms.get_or_insert(now_ms);
                if now_ms.saturating_sub(since) >= rules.hold_ms
                    || units.iter().any(|u| u.name == s.name)
                {
                    // Gone past the hold, or back under its name as another engine.
                    *seat = None;
                }
            }
        }
        for unit in units {
            if next.seats.iter().flatten().any(|s| s.same_unit(&unit)) {
                continue;
            }
            let slot = match next.seats.iter().position(Option::is_none) {
                Some(i) => i,
                None => {
                    // Every seat is taken: the member that left longest ago gives its seat up.
                    let leaving = next
                        .seats
                        .iter()
                        .enumerate()
                        .filter_map(|(i, s)| Some((i, s.as_ref()?.leaving_since_ms?)))
                        .min_by_key(|&(_, since)| since);
                    match leaving {
                        Some((i, _)) => i,
                        None => {
                            return Err(Refusal::TooMany {
                                listed: next.seated() + 1,
                                slots: next.seats.len(),
                            });
                        }
                    }
                }
            };
            next.seats[slot] = Some(unit);
        }
        if next.seats != self.seats {
            next.version = self.version.wrapping_add(1);
        }
        Ok(next)
    }

    /// Unseats members that left more than `hold_ms` before `now_ms` without a document saying so
    /// (the source went quiet): the roster after it, `None` when nothing expired.
    pub fn expire(&self, hold_ms: u64, now_ms: u64) -> Option<Roster> {
        let expired = |s: &Seat| {
            s.leaving_since_ms
                .is_some_and(|t| now_ms.saturating_sub(t) >= hold_ms)
        };
        if !self.seats.iter().flatten().any(expired) {
            return None;
        }
        let mut next = self.clone();
        for seat in next.seats.iter_mut() {
            if seat.as_ref().is_some_and(expired) {
                *seat = None;
            }
        }
        next.version = self.version.wrapping_add(1);
        Some(next)
    }
}

/// The document's members, checked, as seats (one per rank, not leaving).
fn read_document(body: &[u8], rules: &RosterRules, slots: usize) -> Result<Vec<Seat>, Refusal> {
    let doc: Document =
        serde_json::from_slice(body).map_err(|e| Refusal::Malformed(e.to_string()))?;
    if doc.members.is_empty() {
        return Err(Refusal::Empty);
    }
    if doc.members.len() > slots {
        return Err(Refusal::TooMany {
            listed: doc.members.len(),
            slots,
        });
    }
    let mut units: Vec<Seat> = Vec::new();
    for (i, m) in doc.members.iter().enumerate() {
        let bad = |what: String| Err(Refusal::BadMember(format!("members[{i}]: {what}")));
        let (endpoint, feed) = check_member(i, m, &doc.members[..i], rules)?;
        for rank in 0..m.ranks {
            if units.len() >= slots {
                return Err(Refusal::TooMany {
                    listed: doc.members.iter().map(|m| m.ranks as usize).sum(),
                    slots,
                });
            }
            let (name, rank) = if m.ranks == 1 {
                (m.name.clone(), None)
            } else {
                (format!("{}_dp{rank}", m.name), Some(rank))
            };
            if !valid_name(&name) {
                return bad(format!(
                    "{name:?} with its rank suffix is over 64 characters"
                ));
            }
            units.push(Seat {
                name,
                endpoint: endpoint.to_string(),
                feed: feed.to_string(),
                rank,
                leaving_since_ms: None,
            });
        }
    }
    Ok(units)
}

/// Checks member `i` of a discovery document on its own and against the `earlier` ones (a name
/// and endpoint listed once, no static replica's name); its serving and feed addresses.
fn check_member(
    i: usize,
    m: &DocMember,
    earlier: &[DocMember],
    rules: &RosterRules,
) -> Result<(SocketAddr, SocketAddr), Refusal> {
    let bad = |what: String| Err(Refusal::BadMember(format!("members[{i}]: {what}")));
    if !valid_name(&m.name) {
        return bad(format!("name {:?} must be 1-64 of [A-Za-z0-9._-]", m.name));
    }
    let Ok(endpoint) = m.endpoint.parse::<SocketAddr>() else {
        return bad(format!("endpoint {:?} is not IP:port", m.endpoint));
    };
    let feed = match &m.feed {
        Some(f) => match f.parse::<SocketAddr>() {
            Ok(a) => a,
            Err(_) => return bad(format!("feed {f:?} is not IP:port")),
        },
        None => endpoint,
    };
    if endpoint.port() == 0 || feed.port() == 0 || endpoint.ip().is_unspecified() {
        return bad(format!("{} has no routable address", m.name));
    }
    if m.ranks == 0 || m.ranks > kvsteer_core::dp::MAX_DP_RANKS {
        return bad(format!("ranks must be 1..=256, got {}", m.ranks));
    }
    match m.role.as_deref().map(Role::parse) {
        None | Some(Some(Role::Both)) => {}
        Some(_) => {
            return bad(format!(
                "role {:?}: discovered members serve both phases (prefill/decode fleets are \
                 configured statically)",
                m.role.as_deref().unwrap_or_default()
            ));
        }
    }
    if rules.static_names.contains(&m.name) {
        return Err(Refusal::Duplicate(format!(
            "members[{i}]: {:?} is a static replica's name",
            m.name
        )));
    }
    if earlier.iter().any(|o| o.name == m.name) {
        return Err(Refusal::Duplicate(format!(
            "members[{i}]: name {:?} listed twice",
            m.name
        )));
    }
    if earlier.iter().any(|o| {
        o.endpoint
            .parse::<SocketAddr>()
            .is_ok_and(|e| e == endpoint)
    }) {
        return Err(Refusal::Duplicate(format!(
            "members[{i}]: endpoint {endpoint} listed twice"
        )));
    }
    Ok((endpoint, feed))
}

#[cfg(test)]
mod tests;
