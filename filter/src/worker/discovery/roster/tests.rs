use super::*;

fn rules(hold_ms: u64) -> RosterRules<'static> {
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    RosterRules {
        static_names: NAMES.get_or_init(|| vec!["static-0".to_string()]),
        hold_ms,
    }
}

fn doc(members: &[(&str, u16)]) -> Vec<u8> {
    let list: Vec<String> = members
        .iter()
        .map(|(n, p)| format!(r#"{{"name":"{n}","endpoint":"127.0.0.1:{p}"}}"#))
        .collect();
    format!(r#"{{"members":[{}]}}"#, list.join(",")).into_bytes()
}

fn names(r: &Roster) -> Vec<Option<&str>> {
    r.seats
        .iter()
        .map(|s| s.as_ref().map(|s| s.name.as_str()))
        .collect()
}

#[test]
fn members_keep_their_seat_and_new_ones_take_free_seats() {
    let r0 = Roster::new(3);
    let r1 = r0
        .apply(&doc(&[("a", 1), ("b", 2)]), &rules(1000), 0)
        .unwrap();
    assert_eq!(names(&r1), [Some("a"), Some("b"), None]);
    assert_eq!(r1.version, 1);
    assert_eq!(r1.seats[0].as_ref().unwrap().feed, "127.0.0.1:1");
    // The list reordered and c added: a and b stay where they sit.
    let r2 = r1
        .apply(&doc(&[("c", 3), ("b", 2), ("a", 1)]), &rules(1000), 10)
        .unwrap();
    assert_eq!(names(&r2), [Some("a"), Some("b"), Some("c")]);
    // Nothing changed: the version stays, so no worker re-applies it.
    let r3 = r2
        .apply(&doc(&[("a", 1), ("b", 2), ("c", 3)]), &rules(1000), 20)
        .unwrap();
    assert_eq!(r3.version, r2.version);
}

#[test]
fn a_member_that_leaves_is_held_then_unseated_and_one_that_flaps_keeps_its_seat() {
    let r = Roster::new(2)
        .apply(&doc(&[("a", 1), ("b", 2)]), &rules(1000), 0)
        .unwrap();
    let gone = r.apply(&doc(&[("a", 1)]), &rules(1000), 100).unwrap();
    assert_eq!(gone.seats[1].as_ref().unwrap().leaving_since_ms, Some(100));
    assert_eq!(gone.listed(), 1);
    // Back within the hold: the same seat, listed again.
    let back = gone
        .apply(&doc(&[("a", 1), ("b", 2)]), &rules(1000), 900)
        .unwrap();
    assert_eq!(back.seats, r.seats);
    // Gone past the hold: unseated.
    let gone = back.apply(&doc(&[("a", 1)]), &rules(1000), 1000).unwrap();
    let later = gone.apply(&doc(&[("a", 1)]), &rules(1000), 2000).unwrap();
    assert_eq!(names(&later), [Some("a"), None]);
    // expire() does the same when the source goes quiet.
    assert_eq!(gone.expire(1000, 1999), None);
    assert_eq!(names(&gone.expire(1000, 2000).unwrap()), [Some("a"), None]);
}

#[test]
fn a_full_roster_gives_the_longest_gone_seat_to_a_new_member() {
    let r = Roster::new(2)
        .apply(&doc(&[("a", 1), ("b", 2)]), &rules(60_000), 0)
        .unwrap();
    let r = r.apply(&doc(&[("b", 2)]), &rules(60_000), 10).unwrap();
    let r = r
        .apply(&doc(&[("b", 2), ("c", 3)]), &rules(60_000), 20)
        .unwrap();
    assert_eq!(names(&r), [Some("c"), Some("b")]);
    // Full of listed members: one more is refused and the roster is kept by the caller.
    assert_eq!(
        r.apply(&doc(&[("b", 2), ("c", 3), ("d", 4)]), &rules(60_000), 30),
        Err(Refusal::TooMany {
            listed: 3,
            slots: 2
        })
    );
}

#[test]
fn a_member_back_under_its_name_at_another_address_is_another_engine() {
    let r = Roster::new(2)
        .apply(&doc(&[("a", 1)]), &rules(60_000), 0)
        .unwrap();
    let moved = r.apply(&doc(&[("a", 7)]), &rules(60_000), 10).unwrap();
    let seats: Vec<_> = moved.seats.iter().flatten().collect();
    assert_eq!(
        seats.len(),
        1,
        "the old engine is unseated at once: {moved:?}"
    );
    assert_eq!(seats[0].endpoint, "127.0.0.1:7");
}

#[test]
fn every_bad_answer_is_refused_with_its_kind() {
    let r = Roster::new(4);
    let (twice_named, twice_addressed) = (doc(&[("a", 1), ("a", 2)]), doc(&[("a", 1), ("b", 1)]));
    let cases: Vec<(&[u8], &str)> = vec![
        (b"", "malformed"),
        (b"\xff\xfe garbage", "malformed"),
        (b"{\"members\":", "malformed"),
        (b"[1,2,3]", "malformed"),
        (br#"{"members":[{"name":"a"}]}"#, "malformed"),
        (br#"{"members":[]}"#, "empty"),
        (
            br#"{"members":[{"name":"a b","endpoint":"127.0.0.1:1"}]}"#,
            "bad_member",
        ),
        (
            br#"{"members":[{"name":"a","endpoint":"localhost:1"}]}"#,
            "bad_member",
        ),
        (
            br#"{"members":[{"name":"a","endpoint":"127.0.0.1:0"}]}"#,
            "bad_member",
        ),
        (
            br#"{"members":[{"name":"a","endpoint":"0.0.0.0:80"}]}"#,
            "bad_member",
        ),
        (
            br#"{"members":[{"name":"a","endpoint":"127.0.0.1:1","feed":"x"}]}"#,
            "bad_member",
        ),
        (
            br#"{"members":[{"name":"a","endpoint":"127.0.0.1:1","ranks":0}]}"#,
            "bad_member",
        ),
        (
            br#"{"members":[{"name":"a","endpoint":"127.0.0.1:1","role":"prefill"}]}"#,
            "bad_member",
        ),
        (
            br#"{"members":[{"name":"a","endpoint":"127.0.0.1:1","ranks":5}]}"#,
            "too_many",
        ),
        (
            br#"{"members":[{"name":"static-0","endpoint":"127.0.0.1:1"}]}"#,
            "duplicate",
        ),
        (&twice_named, "duplicate"),
        (&twice_addressed, "duplicate"),
    ];
    for (body, kind) in cases {
        let got = r.apply(body, &rules(1000), 0);
        assert_eq!(
            got.as_ref().map_err(Refusal::kind),
            Err(kind),
            "{:?}",
            String::from_utf8_lossy(body)
        );
        assert!(!got.unwrap_err().to_string().is_empty());
    }
    let thousand: Vec<(String, u16)> = (0..1000).map(|i| (format!("m{i}"), i as u16 + 1)).collect();
    let refs: Vec<(&str, u16)> = thousand.iter().map(|(n, p)| (n.as_str(), *p)).collect();
    assert_eq!(
        r.apply(&doc(&refs), &rules(1000), 0).map_err(|e| e.kind()),
        Err("too_many")
    );
    // Deeply nested JSON: refused, not a stack overflow.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    assert_eq!(
        r.apply(deep.as_bytes(), &rules(1000), 0)
            .map_err(|e| e.kind()),
        Err("malformed")
    );
}

#[test]
fn ranks_take_one_seat_each_and_the_roster_round_trips_through_shared_data() {
    let body = br#"{"members":[{"name":"dp","endpoint":"10.0.0.1:8000","feed":"10.0.0.1:9000","ranks":2,"role":"both","zone":"ignored"}]}"#;
    let r = Roster::new(3).apply(body, &rules(1000), 0).unwrap();
    assert_eq!(names(&r), [Some("dp_dp0"), Some("dp_dp1"), None]);
    assert_eq!(r.seats[1].as_ref().unwrap().rank, Some(1));
    assert_eq!(r.seats[1].as_ref().unwrap().feed, "10.0.0.1:9000");
    assert_eq!(Roster::decode(&r.encode(), 3), Some(r.clone()));
    assert_eq!(
        Roster::decode(&r.encode(), 4),
        None,
        "another configuration's"
    );
    assert_eq!(Roster::decode(b"\x00junk", 3), None);
}

/// Hostile bytes: mutations of a good document (bytes flipped, cut, duplicated) never panic, and
/// whatever is accepted keeps the roster's invariants: within its slots, no name seated twice, every
/// seat's endpoint an address.
#[test]
fn mutated_documents_never_panic_and_accepted_ones_keep_the_invariants() {
    let good = br#"{"members":[{"name":"a","endpoint":"10.0.0.1:8000","feed":"10.0.0.1:9000","ranks":2},{"name":"b","endpoint":"[fd00::2]:8000"},{"name":"c","endpoint":"10.0.0.3:8000","role":"both"}]}"#;
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n.max(1) as u64) as usize
    };
    let mut roster = Roster::new(4);
    let mut accepted = 0;
    for step in 0..20_000u64 {
        let mut body = good.to_vec();
        for _ in 0..1 + next(4) {
            let i = next(body.len());
            match next(4) {
                0 => body[i] = next(256) as u8,
                1 => body.truncate(i),
                2 => {
                    let b = body[i];
                    body.insert(i, b);
                }
                _ => {
                    body.remove(i.min(body.len().saturating_sub(1)));
                }
            }
            if body.is_empty() {
                break;
            }
        }
        if let Ok(next_roster) = roster.apply(&body, &rules(500), step * 100) {
            accepted += 1;
            let seats: Vec<&Seat> = next_roster.seats.iter().flatten().collect();
            assert_eq!(next_roster.seats.len(), 4);
            for (i, s) in seats.iter().enumerate() {
                assert!(
                    seats[..i].iter().all(|o| o.name != s.name),
                    "{next_roster:?}"
                );
                assert!(s.endpoint.parse::<std::net::SocketAddr>().is_ok());
            }
            roster = next_roster;
        }
    }
    assert!(accepted > 100, "some mutations stay valid: {accepted}");
}
