//! Shedding at saturation (`routing.admission`, docs/design/admission.md): the coding-agent trace
//! over the capacity of 4 replicas, each session given a priority class by a trusted header (about
//! 20% critical, 50% standard, 30% sheddable). With the classes' bounds on, no critical request is
//! refused, sheddable ones are (429s), every 429 carries `Retry-After`, and the filter's bookings
//! balance once the run is over; the critical requests' TTFT p99 is printed against the same fleet
//! with the bounds off and against the same work at 8 sessions in flight, a fleet with room (figures
//! in virtual time; only that the unloaded tail is the lower one is asserted).

mod common;

use kvsteer_host_test::Harness;
use kvsteer_host_test::{HarnessConfig, ProxySpread};
use kvsteer_lab::bench::run;
use kvsteer_lab::bench::scenario::{Scenario, Source};
use kvsteer_workload::{Driver, weka};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;

const HEADER: &str = "x-kvsteer-priority";
const CLASSES: [&str; 3] = ["critical", "standard", "sheddable"];

/// A session's class, from a hash of its id: 2 in 10 critical, 5 standard, 3 sheddable.
fn class_of(session: &str) -> usize {
    let h = session.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    match (h.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % 10 {
        0 | 1 => 0,
        2..=6 => 1,
        _ => 2,
    }
}

fn class_header(session: &str) -> Vec<(String, String)> {
    vec![(HEADER.to_string(), CLASSES[class_of(session)].to_string())]
}

/// The coding-agent trace at 40 sessions in flight on 4 replicas: well past what they serve
/// without queueing (their prefill queues reach tens of seconds).
/// Sessions in flight: the saturated fleet, and the same work on a fleet with room (the unloaded
/// reference the critical class's tail is read against).
const SATURATED: usize = 40;
const UNLOADED: usize = 8;

fn scenario(concurrency: usize) -> Scenario {
    Scenario {
        id: "weka-shed".into(),
        group: "shedding",
        source: Source::Weka {
            concurrency,
            copies: 2,
            max_sessions: Some(40),
            think_jitter: 0.0,
            file: weka::FILE,
        },
        proxies: 1,
        spread: ProxySpread::PerRequest,
        endpoints: 4,
        dp_ranks: 1,
        pd_prefill: 0,
    }
}

struct Run {
    /// Per class: requests, refused with 429, TTFT (ms) of those that got a first token.
    requests: [u64; 3],
    shed: [u64; 3],
    ttft_ms: [Vec<f64>; 3],
    /// 429s without a positive whole `Retry-After`, or without the error body.
    malformed_429: u64,
    bookings: (i64, i64),
    other_failures: u64,
}

fn replay(policy: &str, shedding: bool, concurrency: usize) -> Run {
    let traces = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces");
    let (workload, mode) = scenario(concurrency)
        .build(&traces, 0)
        .unwrap_or_else(|e| panic!("{e}"));
    let mut cfg: HarnessConfig = run::config(policy, workload.block_size, 0, 2);
    let bounds = if shedding {
        json!({"standard": 10, "sheddable": 2})
    } else {
        json!({"standard": null, "sheddable": null})
    };
    cfg.routing["admission"] = json!({
        "priority_header": HEADER,
        "trust_priority_header": true,
        "bounds_s": bounds,
    });
    cfg.issue_headers = Some(class_header);
    let mut h = Harness::new(common::module(), cfg).unwrap_or_else(|e| panic!("{e}"));
    h.run_workload(Driver::new(workload, mode), |_, _| {})
        .unwrap_or_else(|e| panic!("{e}"));
    // Let the workers tick so the counters the router mirrors are published.
    h.run_for(1_000_000).unwrap_or_else(|e| panic!("{e}"));
    common::assert_clean(&h);

    let mut out = Run {
        requests: [0; 3],
        shed: [0; 3],
        ttft_ms: Default::default(),
        malformed_429: 0,
        bookings: (
            h.proxy().metric("kvsteer_bookings").map_or(-1, |m| m.value),
            h.proxy().metric("kvsteer_releases").map_or(-2, |m| m.value),
        ),
        other_failures: 0,
    };
    let sessions: HashMap<u64, String> = h
        .recorder
        .rows()
        .into_iter()
        .map(|r| (r.request_id, r.session_id))
        .collect();
    for rec in h.records() {
        let Some(session) = sessions.get(&rec.id) else {
            continue;
        };
        let c = class_of(session);
        out.requests[c] += 1;
        match rec.local_response {
            Some(429) => out.shed[c] += 1,
            Some(_) => out.other_failures += 1,
            None if rec.failed => out.other_failures += 1,
            None => {}
        }
        if let Some(t) = rec.first_token_us {
            out.ttft_ms[c].push(t.saturating_sub(rec.issued_us) as f64 / 1e3);
        }
    }
    // Every 429's shape, as the client receives it.
    for rec in h.records().filter(|r| r.local_response == Some(429)) {
        let retry = rec
            .local_headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("retry-after"))
            .and_then(|(_, v)| v.parse::<u32>().ok());
        let body: serde_json::Value =
            serde_json::from_slice(&rec.local_body).unwrap_or(serde_json::Value::Null);
        let ok = retry.is_some_and(|r| r >= 1)
            && body["error"]["type"] == "rate_limit_exceeded"
            && body["error"]["message"].is_string();
        if !ok {
            eprintln!("request {}: malformed 429: {retry:?} {body}", rec.id);
            out.malformed_429 += 1;
        }
    }
    out
}

fn p99(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1]
}

/// One policy's pair of runs: the table printed, the properties asserted.
fn check(policy: &str) {
    let off = replay(policy, false, SATURATED);
    let on = replay(policy, true, SATURATED);
    let unloaded = replay(policy, false, UNLOADED);
    println!("coding agent, {SATURATED} sessions in flight, 4 replicas, {policy}:");
    println!(
        "| class | requests | shed with bounds | TTFT p99 ms, bounds off | bounds on | unloaded ({UNLOADED} in flight) |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for (c, name) in CLASSES.iter().enumerate() {
        println!(
            "| {name} | {} | {} ({:.1}%) | {:.0} | {:.0} | {:.0} |",
            on.requests[c],
            on.shed[c],
            100.0 * on.shed[c] as f64 / on.requests[c].max(1) as f64,
            p99(&off.ttft_ms[c]),
            p99(&on.ttft_ms[c]),
            p99(&unloaded.ttft_ms[c]),
        );
    }
    println!(
        "bookings / releases: off {:?}, on {:?}",
        off.bookings, on.bookings
    );

    assert_eq!(
        off.shed, [0; 3],
        "{policy}: nothing is shed with the bounds off"
    );
    assert_eq!(on.shed[0], 0, "{policy}: a critical request was refused");
    assert!(
        on.requests[0] > 0 && on.requests[2] > 0,
        "{policy}: {:?}",
        on.requests
    );
    assert!(
        on.shed[2] > 0,
        "{policy}: no sheddable request was shed: not saturated?"
    );
    assert_eq!(on.malformed_429, 0, "{policy}");
    assert_eq!(on.other_failures, 0, "{policy}: only 429s fail");
    assert_eq!(off.other_failures, 0, "{policy}");
    // No booking leaked: a shed request is never booked, every admitted one is released.
    assert_eq!(
        on.bookings.0, on.bookings.1,
        "{policy}: bookings against releases"
    );
    assert_eq!(off.bookings.0, off.bookings.1, "{policy}");
    assert!(on.bookings.0 > 0, "{policy}");
    // The reference has room: its critical tail is below the saturated one's, shed or not.
    assert_eq!(unloaded.other_failures, 0, "{policy}");
    assert!(
        p99(&unloaded.ttft_ms[0]) < p99(&on.ttft_ms[0]),
        "{policy}: the unloaded fleet's critical TTFT p99 is not below the saturated one's"
    );
}

#[test]
fn kv_load_sheds_sheddable_requests_and_never_critical_ones() {
    check("kv_load");
}

#[test]
fn kv_time_sheds_sheddable_requests_and_never_critical_ones() {
    check("kv_time");
}

/// The priority header as a client sends it: removed before the request goes upstream (and
/// counted) unless the configuration trusts it; trusted, it is kept and its class counted.
#[test]
fn an_untrusted_priority_header_is_removed_and_counted() {
    for trust in [false, true] {
        let mut cfg = HarnessConfig::small("kv_load");
        cfg.routing["admission"] = json!({
            "priority_header": HEADER,
            "trust_priority_header": trust,
        });
        let mut h = common::harness_with(cfg);
        let spec = kvsteer_host_test::RequestSpec::new(common::tokens(1, 64), 4)
            .header(HEADER, "critical");
        let id = h.send(&spec).unwrap_or_else(|e| panic!("{e}"));
        // A request that is not routed (not an inference path) loses its copy too.
        let mut other = kvsteer_host_test::RequestSpec::new(Vec::new(), 0).header(HEADER, "x");
        other.path = Some("/v1/models".into());
        let other = h.send(&other).unwrap_or_else(|e| panic!("{e}"));
        h.run_until_idle(10_000_000)
            .unwrap_or_else(|e| panic!("{e}"));
        h.run_for(500_000).unwrap_or_else(|e| panic!("{e}"));
        common::assert_clean(&h);
        let upstream = h.record(id).and_then(|r| r.upstream_header(HEADER));
        let metric = |name: &str| h.proxy().metric(name).map_or(-1, |m| m.value);
        if trust {
            assert_eq!(upstream, Some("critical"));
            assert_eq!(metric("kvsteer_priority_headers_removed"), 0);
            assert_eq!(metric("kvsteer_admitted_critical"), 1);
        } else {
            assert_eq!(
                upstream, None,
                "a client's priority header reached the replica"
            );
            let other = h.record(other).and_then(|r| r.upstream_header(HEADER));
            assert_eq!(other, None);
            assert_eq!(metric("kvsteer_priority_headers_removed"), 2);
            assert_eq!(metric("kvsteer_admitted_critical"), 0);
            assert_eq!(metric("kvsteer_admitted_standard"), 1, "the default class");
        }
    }
}
