//! Routing while membership moves (docs/reports/fleet.md, "Churn"): the fleet cells hold their
//! replicas for the whole replay, but an autoscaled fleet does not. This cell replays one workload
//! while the discovery source (docs/design/discovery.md) adds and removes members at a fixed
//! schedule, as an autoscaler would, and beside it the same workload on a fleet that holds the
//! schedule's time-averaged size, so that what routing loses to the moves is the difference.
//!
//! The schedule, over an arrival span of `S` seconds: 8 members from the start, 4 more join at
//! `S/5` (12), 6 leave at `2S/5` (the four newest and two of the first, 6 left), 2 new ones join at
//! `4S/5` (8). Members that leave never come back (an autoscaler's new pods have new names), so
//! every one of them is drained and its slot vacated after the hold. The 12-member phase lasts half
//! as long as the 6-member one and the fleet holds 8 before and after them, so the time-averaged
//! size is 8 whatever the replay's tail: the static comparison is 8 replicas.
//!
//! The workload is chat behind a shared system prompt at a fixed arrival rate (open loop): the
//! load does not follow the fleet, so a shrink really loads the members that stay, and every new
//! member starts without the shared prompt in its cache. The load is the fleet cells' chat load
//! per replica at the average size ([`super::fleet::CHAT_PER_REPLICA_S`] x 8).
//!
//! Both cells find their members through discovery (the static one lists the same 8 throughout),
//! so the only difference between them is the membership moving.

use super::fleet::CHAT_PER_REPLICA_S;
use super::model_eval::{self, Cell, Measured, Set};
use super::scenario::Source;
use kvsteer_host_test::{
    DISCOVERY_CLUSTER, FilterModule, Harness, HarnessConfig, MEMBER_FEEDS_CLUSTER,
};
use kvsteer_workload::chat::ChatParams;
use serde::Serialize;
use serde_json::json;
use std::path::Path;

/// The policies compared (the fleet cells' five).
pub use super::fleet::POLICIES;

/// The fleet size the schedule averages to over time, and the static comparison's size.
pub const AVERAGE: usize = 8;
/// Seconds of arrivals in the bench's cells: long enough for each phase to see thousands of
/// requests' worth of routing (the shortest, 12 members, lasts 8 s), short enough for one draw of
/// both cells and five policies in about 2 minutes on the shared 2-core machine.
pub const SPAN_S: u64 = 40;
/// How often the filter polls the member list in these cells (the filter's default): a change
/// reaches routing within about one period.
pub const PERIOD_MS: u64 = 1000;
/// How long a member that left keeps its slot: longer than any chat generation here, so the
/// bookings of a drained member's last requests are released, not dropped with its slot.
pub const HOLD_MS: u64 = 60_000;

/// One churn cell: a workload on a fleet whose members follow `schedule`.
#[derive(Clone, Debug)]
pub struct ChurnCell {
    /// `cell.replicas` is every engine the schedule names (members come only through discovery).
    pub cell: Cell,
    /// `(from_us, members)`: the member list the discovery source answers from that time on.
    pub schedule: Vec<(u64, Vec<usize>)>,
    /// The span of new sessions' arrivals, us: the members' load is compared over it (after it
    /// only the last sessions' turns and long generations trail on, for minutes).
    pub span_us: u64,
    /// The churn schedule's change times, us, in both cells: the static cell's requests in the same
    /// windows ([`MOVE_WINDOW_US`] after each) are the comparison for what the moves cost.
    pub moves_us: Vec<u64>,
}

impl ChurnCell {
    /// When each replica was listed: `(from_us, to_us)` intervals, `to_us` `u64::MAX` while still
    /// listed at the end.
    pub fn presence(&self) -> Vec<Vec<(u64, u64)>> {
        let mut out: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.cell.replicas];
        for (i, (from, members)) in self.schedule.iter().enumerate() {
            let to = self.schedule.get(i + 1).map_or(u64::MAX, |n| n.0);
            for &r in members {
                match out[r].last_mut() {
                    Some(last) if last.1 == *from => last.1 = to,
                    _ => out[r].push((*from, to)),
                }
            }
        }
        out
    }

    /// `(replica, removed_at_us)` for every removal in the schedule.
    pub fn removals(&self) -> Vec<(usize, u64)> {
        self.presence()
            .iter()
            .enumerate()
            .flat_map(|(r, iv)| iv.iter().filter(|i| i.1 != u64::MAX).map(move |i| (r, i.1)))
            .collect()
    }
}

/// The autoscaler's schedule over `span_s` seconds of arrivals (module doc): 8, 12 at `S/5`, 6 at
/// `2S/5`, 8 at `4S/5`, on engines 0-13.
pub fn schedule(span_s: u64) -> Vec<(u64, Vec<usize>)> {
    let at = |fifths: u64| fifths * span_s * 1_000_000 / 5;
    vec![
        (0, (0..8).collect()),
        (at(1), (0..12).collect()),
        (at(2), (0..6).collect()),
        (at(4), (0..6).chain([12, 13]).collect()),
    ]
}

/// The chat workload at the average size's load, `span_s` seconds of arrivals, and its two cells:
/// `churn-chat` (the schedule) and `churn-chat-static8` (8 members throughout).
pub fn cells(span_s: u64) -> Vec<ChurnCell> {
    let rate = CHAT_PER_REPLICA_S * AVERAGE as f64;
    let source = Source::Chat(ChatParams {
        sessions: (rate * span_s as f64).round() as usize,
        sessions_per_s: rate,
        ..ChatParams::default()
    });
    let cell = |id: &str, replicas: usize| Cell {
        id: id.into(),
        set: Set::Fleet,
        source: source.clone(),
        replicas,
        profile: "llama-3.1-8b-h100",
        slowdowns: Vec::new(),
    };
    let schedule = schedule(span_s);
    let moves_us: Vec<u64> = schedule.iter().skip(1).map(|m| m.0).collect();
    let engines = schedule
        .iter()
        .flat_map(|m| m.1.iter().copied())
        .max()
        .map_or(0, |m| m + 1);
    vec![
        ChurnCell {
            cell: cell("churn-chat", engines),
            schedule,
            span_us: span_s * 1_000_000,
            moves_us: moves_us.clone(),
        },
        ChurnCell {
            cell: cell(&format!("churn-chat-static{AVERAGE}"), AVERAGE),
            schedule: vec![(0, (0..AVERAGE).collect())],
            span_us: span_s * 1_000_000,
            moves_us,
        },
    ]
}

/// What a churn replay measured besides the model-eval figures: how evenly the members present
/// were loaded, and whether the moves cost anything the figures hide.
#[derive(Clone, Debug, Serialize)]
pub struct ChurnMeasured {
    #[serde(flatten)]
    pub base: Measured,
    /// Requests issued within the arrival span that each member got, per second it was listed
    /// within the span; the lowest and the highest over the members ever listed. The figure that
    /// compares members present for different spans, and the static fleet's members with them.
    pub member_rate_min: f64,
    pub member_rate_max: f64,
    /// Requests issued within the arrival span that each member got, against its fair share (in
    /// each second it was listed, that second's requests over the members listed then); lowest and
    /// highest over the members ever listed. 1 is an even spread whatever the schedule; rates alone
    /// would rank members by the phases they were present in.
    pub member_share_min: f64,
    pub member_share_max: f64,
    /// Requests each member got over the whole replay, lowest and highest over the members ever
    /// listed (a member listed only in the 12-member phase has fewer by construction).
    pub member_requests_min: u64,
    pub member_requests_max: u64,
    /// Requests placed on a member more than a poll period (plus a margin) after it was removed,
    /// or before it was listed: must be 0. A fallback (the proxy's own pick) counts too, since the
    /// proxy's cluster would not hold a member that is gone.
    pub late_on_removed: usize,
    /// Requests the filter did not route (passed to the proxy's own balancing).
    pub fallbacks: usize,
    /// Bookings dropped with a vacated slot (requests still in flight past the hold).
    pub dropped_bookings: i64,
    /// Time to first token of the requests issued within [`MOVE_WINDOW_US`] after each change of
    /// the churn schedule (the same windows in the static cell), and how many there were.
    pub ttft_moves_p50_ms: f64,
    pub ttft_moves_p99_ms: f64,
    pub moves_requests: usize,
    pub bookings: i64,
    pub releases: i64,
}

/// How long after each change of the schedule its requests count as routed "while membership
/// moves": the poll that brings the change, the joiners' first snapshots and the shrink's backlog
/// on the members that stay all fall within it.
pub const MOVE_WINDOW_US: u64 = 4_000_000;

/// The `q` quantile of `v` by nearest rank (NaN when empty).
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[i]
}

/// How long after a removal a request may still have been routed to the member: one poll period,
/// the workers' adoption of the roster at their next tick, and a margin for the callout.
pub const REMOVAL_GRACE_US: u64 = PERIOD_MS * 1000 + 500_000;

/// The discovery section and the schedule, on a harness configuration built for the cell.
fn configure(cfg: &mut HarnessConfig, c: &ChurnCell) {
    cfg.filter_extra.insert("replicas".into(), json!([]));
    cfg.filter_extra.insert(
        "discovery".into(),
        json!({
            "cluster": DISCOVERY_CLUSTER,
            "feed_cluster": MEMBER_FEEDS_CLUSTER,
            "period_ms": PERIOD_MS,
            "hold_ms": HOLD_MS,
            "max_members": 16,
        }),
    );
    cfg.membership = c.schedule.clone();
}

fn metric(h: &Harness, name: &str) -> i64 {
    h.proxy().metric(name).map_or(0, |m| m.value)
}

/// Replays one churn cell under one policy spec for one seed; the harness comes back too, for
/// tests that look at single requests.
pub fn replay(
    module: &FilterModule,
    traces: &Path,
    c: &ChurnCell,
    spec: &str,
    seed: u64,
    keep_requests: bool,
) -> Result<(ChurnMeasured, Harness), String> {
    let (base, h) = model_eval::replay_configured(
        module,
        traces,
        &c.cell,
        spec,
        seed,
        keep_requests,
        &|_| {},
        &|cfg| configure(cfg, c),
    )?;
    let presence = c.presence();
    let mut counts = vec![0u64; c.cell.replicas];
    let mut late = 0;
    let mut fallbacks = 0;
    for r in h.records() {
        fallbacks += usize::from(r.fallback);
        let Some(rep) = r.replica else { continue };
        if r.issued_us < c.span_us {
            counts[rep] += 1;
        }
        let listed = presence[rep].iter().any(|&(from, to)| {
            r.issued_us >= from && r.issued_us < to.saturating_add(REMOVAL_GRACE_US)
        });
        late += usize::from(!listed);
    }
    let shares = fair_shares(&h, c, &presence, &counts);
    let ever: Vec<u64> = (0..c.cell.replicas)
        .filter(|&r| !presence[r].is_empty())
        .map(|r| base.requests_per_replica.get(r).copied().unwrap_or(0))
        .collect();
    let rates = member_rates(c, &presence, &counts);
    let mut moves = move_ttfts_ms(&h, c);
    let m = ChurnMeasured {
        ttft_moves_p50_ms: quantile(&mut moves, 0.5),
        ttft_moves_p99_ms: quantile(&mut moves, 0.99),
        moves_requests: moves.len(),
        member_rate_min: rates.iter().copied().fold(f64::INFINITY, f64::min),
        member_rate_max: rates.iter().copied().fold(0.0, f64::max),
        member_share_min: shares.iter().copied().fold(f64::INFINITY, f64::min),
        member_share_max: shares.iter().copied().fold(0.0, f64::max),
        member_requests_min: ever.iter().copied().min().unwrap_or(0),
        member_requests_max: ever.iter().copied().max().unwrap_or(0),
        late_on_removed: late,
        fallbacks,
        dropped_bookings: metric(&h, "kvsteer_discovery_dropped_bookings"),
        bookings: metric(&h, "kvsteer_bookings"),
        releases: metric(&h, "kvsteer_releases"),
        base,
    };
    Ok((m, h))
}

/// Each member's requests over its fair share, for the members that had one: each second's requests
/// split over the members listed at its middle.
fn fair_shares(
    h: &Harness,
    c: &ChurnCell,
    presence: &[Vec<(u64, u64)>],
    counts: &[u64],
) -> Vec<f64> {
    let seconds = c.span_us.div_ceil(1_000_000) as usize;
    let mut per_second = vec![0u64; seconds];
    for r in h
        .records()
        .filter(|r| r.replica.is_some() && r.issued_us < c.span_us)
    {
        per_second[(r.issued_us / 1_000_000) as usize] += 1;
    }
    let listed_at = |rep: usize, t: u64| presence[rep].iter().any(|&(f, to)| t >= f && t < to);
    let mut fair = vec![0.0f64; c.cell.replicas];
    for (sec, &n) in per_second.iter().enumerate() {
        let mid = sec as u64 * 1_000_000 + 500_000;
        let listed: Vec<usize> = (0..c.cell.replicas)
            .filter(|&r| listed_at(r, mid))
            .collect();
        for &r in &listed {
            fair[r] += n as f64 / listed.len() as f64;
        }
    }
    (0..c.cell.replicas)
        .filter(|&r| fair[r] > 0.0)
        .map(|r| counts[r] as f64 / fair[r])
        .collect()
}

/// Requests per second each member got while it was listed (within the span), for the members
/// that ever were.
fn member_rates(c: &ChurnCell, presence: &[Vec<(u64, u64)>], counts: &[u64]) -> Vec<f64> {
    presence
        .iter()
        .zip(counts)
        .filter_map(|(iv, &n)| {
            let listed_us: u64 = iv
                .iter()
                .map(|&(from, to)| to.min(c.span_us).saturating_sub(from))
                .sum();
            (listed_us > 0).then(|| n as f64 / (listed_us as f64 / 1e6))
        })
        .collect()
}

/// TTFTs (ms) of the requests issued within [`MOVE_WINDOW_US`] after a membership move.
fn move_ttfts_ms(h: &Harness, c: &ChurnCell) -> Vec<f64> {
    h.records()
        .filter(|r| {
            c.moves_us
                .iter()
                .any(|&t| r.issued_us >= t && r.issued_us < t + MOVE_WINDOW_US)
        })
        .filter_map(|r| {
            r.first_token_us
                .map(|f| f.saturating_sub(r.issued_us) as f64 / 1e3)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_averages_to_the_static_size() {
        for c in cells(SPAN_S) {
            let p = c.presence();
            assert_eq!(p.len(), c.cell.replicas);
            // Over any end at or past the last change, the member-seconds average to 8.
            let last = c.schedule.last().unwrap().0;
            for end in [last, last + 7_000_000, last + 30_000_000] {
                let member_us: u64 = p
                    .iter()
                    .flatten()
                    .map(|&(from, to)| to.min(end) - from)
                    .sum();
                assert_eq!(member_us, AVERAGE as u64 * end, "{} to {end}", c.cell.id);
            }
        }
        let churn = &cells(SPAN_S)[0];
        let sizes: Vec<usize> = churn.schedule.iter().map(|m| m.1.len()).collect();
        assert_eq!(sizes, [8, 12, 6, 8]);
        // The four joiners and two of the first leave at 2S/5; nobody comes back.
        let mut removed: Vec<usize> = churn.removals().iter().map(|r| r.0).collect();
        removed.sort();
        assert_eq!(removed, [6, 7, 8, 9, 10, 11]);
        assert!(churn.presence().iter().all(|iv| iv.len() <= 1));
        assert!(cells(SPAN_S)[1].removals().is_empty());
    }
}
