use super::*;
use crate::config::FilterConfig;
use crate::host::store::tests::MemStore;
use crate::worker::testing::*;

/// One static replica and four discovery slots, round robin (every member gets its turn), a hold
/// of 1 s.
fn worker() -> WorkerState {
    let json = r#"{"replicas":[{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}],
        "routing":{"policy":"round_robin"},
        "discovery":{"cluster":"members","period_ms":500,"hold_ms":1000,"max_members":4,
                     "feed_cluster":"member_feeds"}}"#;
    WorkerState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
}

fn doc(ports: &[u16]) -> Vec<u8> {
    let list: Vec<String> = ports
        .iter()
        .map(|p| {
            format!(
                r#"{{"name":"m{p}","endpoint":"127.0.0.1:{p}","feed":"127.0.0.1:{}"}}"#,
                p + 1000
            )
        })
        .collect();
    format!(r#"{{"members":[{}]}}"#, list.join(",")).into_bytes()
}

/// Polls the source at `now` and answers it with `body`.
fn answer(
    w: &mut WorkerState,
    store: Option<&dyn SharedStore>,
    body: &[u8],
    now: u64,
) -> DiscoveryResult {
    let poll = w.plan_discovery_poll(now).expect("a poll is due");
    assert_eq!(poll.upstream, "members");
    assert_eq!(poll.path, "/kvsteer/members");
    w.discovery_poll_started(42, now);
    w.on_discovery_answer(42, Some(200), Some(body), store, now)
}

/// The units requests go to, over `n` requests routed (and released) at `now`.
fn routed(w: &mut WorkerState, n: u64, now: u64) -> Vec<usize> {
    let mut out: Vec<usize> = (0..n)
        .map(|i| {
            let d = w.route_body(
                1_000 + i,
                "/v1/completions",
                br#"{"prompt":"x"}"#,
                None,
                now,
            );
            assert!(w.release(1_000 + i));
            d.replica
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[test]
fn members_that_join_are_polled_through_the_feed_cluster_and_routed_to() {
    let mut w = worker();
    assert_eq!(w.replicas(), 5, "one static unit and four slots");
    assert!(w.has_members());
    assert_eq!(routed(&mut w, 8, 0), [0], "empty slots take nothing");
    w.start_tick(0);
    assert_eq!(w.plan_polls(None, 0).len(), 1, "empty slots are not polled");
    let r = answer(&mut w, None, &doc(&[9001, 9002]), 10);
    assert_eq!(
        r,
        DiscoveryResult::Changed {
            joined: 2,
            left: 0,
            vacated: 0,
            members: 2
        }
    );
    assert_eq!(w.replica_name(1), "m9001");
    w.start_tick(20);
    let polls = w.plan_polls(None, 20);
    let mine: Vec<_> = polls.iter().filter(|p| p.replica >= 1).collect();
    assert_eq!(mine.len(), 2, "{polls:?}");
    assert_eq!(mine[0].upstream, "member_feeds");
    assert_eq!(mine[0].destination.as_deref(), Some("127.0.0.1:10001"));
    assert_eq!(
        polls.iter().find(|p| p.replica == 0).unwrap().destination,
        None
    );
    assert_eq!(routed(&mut w, 9, 30), [0, 1, 2]);
    // The destination written for a member is its serving endpoint.
    let d = w.route_body(7, "/v1/completions", br#"{"prompt":"x"}"#, None, 40);
    let d = Decision {
        replica: 2,
        backup: None,
        ..d
    };
    assert_eq!(w.destination(&d), "127.0.0.1:9002");
    assert!(w.release(7));
    // No new poll before the period.
    assert!(w.plan_discovery_poll(100).is_none());
    assert!(w.plan_discovery_poll(510).is_some());
}

#[test]
fn a_member_that_leaves_drains_then_its_slot_is_vacated_and_reused() {
    let mut w = worker();
    answer(&mut w, None, &doc(&[9001, 9002]), 0);
    // Member 9002 holds blocks and has a request in flight.
    w.router.apply_feed(2, &snapshot(5, 0..16));
    // Round robin: one of the next three requests goes to it; the others are released.
    let on_2 = (1..=3)
        .find(|&id| {
            let d = w.route_body(id, "/v1/completions", br#"{"prompt":"x"}"#, None, 1);
            d.replica == 2 || !w.release(id)
        })
        .unwrap();
    let r = answer(&mut w, None, &doc(&[9001]), 600);
    assert!(
        matches!(
            r,
            DiscoveryResult::Changed {
                left: 1,
                vacated: 0,
                ..
            }
        ),
        "{r:?}"
    );
    assert_eq!(
        routed(&mut w, 12, 610),
        [0, 1],
        "no new request to a draining member"
    );
    assert_eq!(
        w.router.index().replica_blocks(2),
        16,
        "its index is kept while it drains"
    );
    assert!(
        w.release(on_2),
        "its request in flight finishes and is released"
    );
    assert_eq!(w.router.local_load()[2].active_requests, 0);
    // Past the hold (no answer needed: the tick expires it).
    w.sync_roster(None, 1_700);
    assert_eq!(
        w.router.index().replica_blocks(2),
        0,
        "its blocks left the index"
    );
    assert_eq!(w.replica_name(2), "_slot1");
    assert_eq!(w.discovery().vacated, 1);
    assert_eq!(w.discovery().dropped_bookings, 0);
    // A new member takes the free slot, from an empty index.
    answer(&mut w, None, &doc(&[9001, 9003]), 1_800);
    assert_eq!(w.replica_name(2), "m9003");
    assert_eq!(w.router.feed_query(2, 10).epoch, 0, "asked for a snapshot");
    assert_eq!(routed(&mut w, 9, 1_810), [0, 1, 2]);
}

#[test]
fn a_member_vacated_with_requests_in_flight_loses_their_bookings_not_the_proxy() {
    let mut w = worker();
    answer(&mut w, None, &doc(&[9001]), 0);
    let mut on_member = Vec::new();
    for id in 0..6 {
        let d = w.route_body(id, "/v1/completions", br#"{"prompt":"x"}"#, None, 1);
        if d.replica == 1 {
            on_member.push(id);
        } else {
            assert!(w.release(id));
        }
    }
    assert_eq!(on_member.len(), 3);
    answer(&mut w, None, &doc(&[9005]), 600);
    answer(&mut w, None, &doc(&[9005]), 1_700);
    assert_eq!(w.discovery().dropped_bookings, 3);
    assert_eq!(w.router.local_load()[1].active_requests, 0);
    for id in on_member {
        assert!(!w.release(id), "its booking went with the slot");
    }
}

#[test]
fn a_member_that_flaps_within_the_hold_keeps_its_slot_and_index() {
    let mut w = worker();
    answer(&mut w, None, &doc(&[9001]), 0);
    w.router.apply_feed(1, &snapshot(5, 0..16));
    let resets = w.stats().feed_resets;
    for k in 0..4u64 {
        answer(&mut w, None, &doc(&[9002]), 600 + k * 1_000);
        answer(&mut w, None, &doc(&[9001, 9002]), 1_100 + k * 1_000);
    }
    assert_eq!(w.replica_name(1), "m9001");
    assert_eq!(w.router.index().replica_blocks(1), 16);
    assert_eq!(w.stats().feed_resets, resets);
    assert_eq!(w.router.feed_query(1, 10).epoch, 5, "no snapshot asked for");
    assert_eq!(w.discovery().vacated, 0);
}

#[test]
fn bad_answers_are_counted_and_leave_the_last_good_membership() {
    let mut w = worker();
    answer(&mut w, None, &doc(&[9001, 9002]), 0);
    let before = w.discovery().roster.clone();
    let thousand: Vec<u16> = (0..1000).map(|i| 10_000 + i).collect();
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"\x00\xffnot json at all".to_vec(), "malformed"),
        (br#"{"members":[]}"#.to_vec(), "empty"),
        (doc(&thousand), "too_many"),
        (
            br#"{"members":[{"name":"a","endpoint":"999.1.1.1:80"}]}"#.to_vec(),
            "bad_member",
        ),
        (doc(&[9001, 9001]), "duplicate"),
        (
            br#"{"members":[{"name":"r0","endpoint":"127.0.0.1:1"}]}"#.to_vec(),
            "duplicate",
        ),
    ];
    let mut now = 500;
    for (body, kind) in cases {
        let i = crate::worker::discovery::roster::Refusal::KINDS
            .iter()
            .position(|&k| k == kind)
            .unwrap();
        let counted = w.discovery().refused[i];
        let r = answer(&mut w, None, &body, now);
        assert!(
            matches!(&r, DiscoveryResult::Refused(why) if why.kind() == kind),
            "{kind}: {r:?}"
        );
        assert_eq!(w.discovery().refused[i], counted + 1, "{kind}");
        assert_eq!(w.discovery().roster, before, "{kind}");
        assert_eq!(routed(&mut w, 9, now), [0, 1, 2], "{kind}");
        now += 500;
    }
    // Too large: refused unread.
    w.plan_discovery_poll(now).unwrap();
    w.discovery_poll_started(43, now);
    assert!(matches!(
        w.on_discovery_oversized(43, 2 << 20),
        DiscoveryResult::Refused(_)
    ));
    assert_eq!(w.discovery().refused[5], 1);
    // HTTP errors and no answer: failures, nothing changes.
    now += 500;
    w.plan_discovery_poll(now).unwrap();
    w.discovery_poll_started(44, now);
    assert!(matches!(
        w.on_discovery_answer(44, Some(503), None, None, now),
        DiscoveryResult::Failed(_)
    ));
    now += 500;
    w.plan_discovery_poll(now).unwrap();
    w.discovery_poll_started(45, now);
    assert!(matches!(
        w.on_discovery_answer(45, None, None, None, now),
        DiscoveryResult::Failed(_)
    ));
    assert_eq!(w.discovery().failures, 2);
    assert_eq!(w.discovery().roster, before);
    // A stray token is nobody's.
    assert_eq!(
        w.on_discovery_answer(99, Some(200), Some(&doc(&[1])), None, now),
        DiscoveryResult::Unknown
    );
}

#[test]
fn workers_of_one_proxy_agree_on_the_seating_through_shared_data() {
    let store = MemStore::default();
    let mut a = worker();
    let mut b = worker();
    answer(&mut a, Some(&store), &doc(&[9001, 9002]), 0);
    // b never polled: it adopts a's roster at its tick.
    b.sync_roster(Some(&store), 10);
    assert_eq!(b.discovery().roster, a.discovery().roster);
    assert_eq!(b.replica_name(2), "m9002");
    // b polls next and sees 9002 gone and 9003 new; a follows.
    answer(&mut b, Some(&store), &doc(&[9001, 9003]), 600);
    a.sync_roster(Some(&store), 610);
    assert_eq!(a.discovery().roster, b.discovery().roster);
    assert_eq!(a.replica_name(3), "m9003");
    assert_eq!(a.router.membership(2), Membership::Draining);
}

/// nginx: a callout names an address, so a member's feed is polled at its feed address, without a
/// destination header; the discovery poll takes the tick's one callout like any other.
#[test]
fn in_nginx_mode_members_are_polled_at_their_feed_address_one_callout_a_tick() {
    let json = r#"{"replicas":[], "output":"nginx_variable",
        "discovery":{"cluster":"127.0.0.1:7000","period_ms":500,"max_members":2}}"#;
    let mut w = WorkerState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap();
    assert!(
        !w.has_members(),
        "nobody to route to before the first answer"
    );
    w.start_tick(0);
    let poll = w.plan_discovery_poll(0).unwrap();
    assert_eq!(poll.upstream, "127.0.0.1:7000");
    w.discovery_poll_started(1, 0);
    assert!(
        w.plan_polls(None, 0).is_empty(),
        "the tick's one callout is spent"
    );
    w.start_tick(100);
    assert!(
        w.plan_polls(None, 100).is_empty(),
        "the discovery poll is out"
    );
    w.on_discovery_answer(1, Some(200), Some(&doc(&[9001])), None, 110);
    assert!(w.has_members());
    w.start_tick(200);
    let polls = w.plan_polls(None, 200);
    assert_eq!(polls.len(), 1);
    assert_eq!(polls[0].upstream, "127.0.0.1:10001");
    assert_eq!(polls[0].destination, None);
    assert_eq!(polls[0].authority, "127.0.0.1:10001");
    w.poll_started(polls[0].replica, 2, 200);
    w.start_tick(600);
    assert!(w.plan_discovery_poll(600).is_none(), "a feed poll is out");
}

/// The poll's own state: due once a period, out until answered or lost (twice the timeout and a
/// second), a lost or unsent poll counted as a failure, an answer matched by its token.
#[test]
fn the_poll_state_is_due_out_and_lost_on_its_own() {
    let w = worker();
    let d = w.config().discovery.clone().unwrap();
    let lost = 2 * d.timeout_ms + 1_000;
    let mut s = DiscoveryState::new(4);
    assert_eq!(s.roster.seats.len(), 4);
    assert!(s.due(&d, 0) && !s.out(&d, 0));
    s.started(7, 0, d.period_ms);
    assert_eq!((s.polls, s.next_poll_ms), (1, d.period_ms));
    assert!(s.out(&d, lost - 1) && !s.due(&d, lost - 1));
    assert!(!s.answered(8), "another token");
    assert!(!s.out(&d, lost), "lost now");
    assert!(s.due(&d, lost) && s.in_flight.is_none());
    assert_eq!(s.failures, 1);
    s.started(9, lost, d.period_ms);
    assert!(s.answered(9) && !s.answered(9));
    s.not_started(lost + 10, d.period_ms);
    assert_eq!(s.failures, 2);
    assert!(!s.due(&d, lost + 10) && s.due(&d, lost + 10 + d.period_ms));
}
