//! The early body scan (docs/design/filter.md, "The body as it arrives"): the filter reads each
//! slice of a request body as the host hands it over and follows a token-id prompt's ids as they
//! come. It must route every request exactly as reading the body once it has all arrived does,
//! whatever the slice size, and a body it does not follow (text, odd whitespace, a salt after the
//! prompt) must be read as before.

mod common;
use common::*;
use kvsteer_host_test::{Harness, HarnessConfig, RequestSpec};

const IDLE: u64 = 600_000_000;

/// A request's replica, the tokens its engine found cached, and the destination header written.
type Routed = (Option<usize>, u32, Option<String>);

/// Sends the same sessions (shared prefixes, follow-ups, bodies of several shapes) through a harness
/// with `early_body_scan` set as asked and bodies in `chunk`-byte slices; returns each request's
/// replica, cached tokens and destination, in order.
fn replay(early: bool, chunk: usize, held_max: Option<usize>) -> (Vec<Routed>, Harness) {
    let mut cfg = HarnessConfig::small("kv_load");
    cfg.body_chunk_bytes = chunk;
    cfg.filter_extra
        .insert("early_body_scan".into(), serde_json::json!(early));
    if let Some(m) = held_max {
        cfg.filter_extra
            .insert("early_body_scan_max_bytes".into(), serde_json::json!(m));
    }
    let mut h = harness_with(cfg);
    let mut ids = Vec::new();
    for s in 0..6u64 {
        let prefix = tokens(40 + s, 1500 + 700 * s as usize);
        for turn in 0..3u64 {
            let prompt = extend(&prefix, 100 * s + turn, 64 * (turn as usize + 1));
            // The same prompt spelled as a hand-made body: `head` before it, `sep` between ids.
            let spelled = |head: &str, sep: &str| {
                let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
                RequestSpec {
                    raw_body: Some(
                        format!("{{{head}\"prompt\":[{}],\"max_tokens\":16}}", ids.join(sep))
                            .into_bytes(),
                    ),
                    ..RequestSpec::new(prompt.clone(), 16)
                }
            };
            let spec = match (s + turn) % 4 {
                // Compact ids: `[1,2,3]`.
                0 => spelled("\"model\":\"m\",", ","),
                // A salt before the prompt (its own namespace).
                1 => spelled(&format!("\"cache_salt\":\"t{s}\","), ", "),
                // Newlines between the ids: followed too.
                2 => spelled("", ",\n  "),
                // The harness's own body.
                _ => RequestSpec::new(prompt.clone(), 16),
            }
            .session(&format!("s{s}"));
            ids.push(h.send(&spec).unwrap());
            h.run_until_idle(IDLE).unwrap();
            h.run_for(400_000).unwrap();
        }
    }
    let out = ids
        .iter()
        .map(|id| {
            let r = h.record(*id).unwrap();
            assert!(r.released && !r.fallback && !r.failed, "{r:?}");
            (
                r.replica,
                r.cached_tokens,
                r.upstream_header("x-gateway-destination-endpoint")
                    .map(str::to_string),
            )
        })
        .collect();
    (out, h)
}

#[test]
fn the_early_scan_routes_every_request_as_reading_the_whole_body_does() {
    let (whole, _) = replay(false, 16 * 1024, None);
    assert!(
        whole.iter().filter(|(_, cached, _)| *cached > 0).count() >= 8,
        "the follow-ups find their prefixes: {whole:?}"
    );
    // The last: a VM share for held bodies (512 bytes) smaller than one slice, so every body is
    // then read at the end (the scan holds only the part it has not read, about a slice).
    for (chunk, held_max) in [(16 * 1024, None), (997, None), (64, None), (997, Some(512))] {
        let (early, h) = replay(true, chunk, held_max);
        assert_eq!(early, whole, "slices of {chunk} bytes, share {held_max:?}");
        let metric = |n: &str| h.proxy().metric(n).map_or(0, |m| m.value);
        assert_eq!(metric("kvsteer_fallbacks"), 0);
        // Bodies over the VM's share are read at the end instead (and counted), the others early.
        assert_eq!(
            metric("kvsteer_early_scan_declined") > 0,
            held_max.is_some(),
            "share {held_max:?}"
        );
        assert_clean(&h);
    }
}

/// `body_hold_max_bytes`: a body the proxy would hold past the VM's bound is routed by load at once,
/// unread, counted, and completes; each routed body gives its share back, so one bound a little
/// over the largest body takes every body of a sequential run.
#[test]
fn a_body_past_the_hold_bound_is_routed_by_load_unread_and_shares_come_back() {
    let run = |hold_max: usize| {
        let mut cfg = HarnessConfig::small("kv_load");
        cfg.body_chunk_bytes = 997;
        cfg.filter_extra
            .insert("body_hold_max_bytes".into(), serde_json::json!(hold_max));
        let mut h = harness_with(cfg);
        let mut ids = Vec::new();
        let mut largest = 0;
        for s in 0..4u64 {
            let prompt = tokens(s + 7, 600 + 200 * s as usize);
            let spec = RequestSpec::new(prompt.clone(), 8).session(&format!("s{s}"));
            largest = largest.max(kvsteer_host_test::openai::completion_body(&prompt, 8).len());
            for _ in 0..2 {
                ids.push(h.send(&spec).unwrap());
                h.run_until_idle(IDLE).unwrap();
            }
        }
        for id in &ids {
            let r = h.record(*id).unwrap();
            // Routed by the filter (by load, when unread) and completed either way.
            assert!(
                r.released && !r.failed && !r.fallback && r.replica.is_some(),
                "{r:?}"
            );
        }
        let metric = |n: &str| h.proxy().metric(n).map_or(0, |m| m.value);
        let fallbacks = metric("kvsteer_body_hold_fallbacks") as usize;
        assert_eq!(metric("kvsteer_fallbacks") as usize, fallbacks);
        assert_clean(&h);
        (fallbacks, ids.len(), largest)
    };
    let (_, _, largest) = run(1 << 30);
    // Under the smallest body: every request is routed before its body is held.
    let (fallbacks, n, _) = run(1000);
    assert_eq!(fallbacks, n);
    // Over the largest: none is, the shares of the earlier ones having come back.
    let (fallbacks, _, _) = run(largest + 100);
    assert_eq!(fallbacks, 0);
}
