//! Prefill/decode disaggregation through the compiled filter (docs/design/pd.md): a fleet of 2
//! prefill and 2 decode simulated engines. The host answers the filter's prefill callout from a
//! prefill engine (a 1-token request, answering `kv_transfer_params` in the NIXL producer's shape)
//! and sends the decode leg the filter released to the decode engine it names, with remote KV
//! ([`kvsteer_sim::Engine::submit_remote`]). Hostile prefill answers (not JSON, oversized, without
//! `kv_transfer_params`, a 500, a reset, a timeout), a callout that cannot be sent, every prefill
//! replica down and a client leaving mid-prefill never trap and leave no load booked.

#[path = "../common/mod.rs"]
mod common;
mod fleet;
use common::*;
use fleet::*;
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{CallOutcome, HostMode, Proxy, ProxyOptions, pairs};
use serde_json::{Value, json};

/// Sessions of growing turns: each turn's prefill leg goes to the prefill replica whose cache holds
/// the session (learned from the feeds), the decode leg to the decode replica that already holds
/// the earlier turns, which reads only the new part over the link. Every leg's load is released.
#[test]
fn kv_load_serves_both_legs_and_keeps_sessions_on_their_caches() {
    let mut f = Fleet::with("kv_load");
    let mut rid = 1;
    for s in 0..4u64 {
        let mut prompt = tokens(900 + s, 640);
        let mut first: Option<Served> = None;
        for turn in 0..3u64 {
            let served = f.serve(&prompt, rid);
            rid += 1;
            if let Some(first) = &first {
                assert_eq!(served.prefill, first.prefill, "session {s} turn {turn}");
                assert!(
                    served.prefill_cached as usize >= prompt.len() - 160,
                    "session {s} turn {turn}: prefill hit {served:?}"
                );
                assert_eq!(served.decode, first.decode, "session {s} turn {turn}");
                assert!(
                    (served.transferred as usize) < prompt.len() / 2,
                    "session {s} turn {turn}: the decode replica reads only the new part: {served:?}"
                );
            } else {
                assert_eq!(served.transferred as usize, prompt.len(), "{served:?}");
                first = Some(served);
            }
            f.poll_feeds();
            prompt = extend(&prompt, 77 * s + turn, 128);
        }
    }
    assert_eq!(f.booked(), 0, "every leg released");
    assert_eq!(f.counter("kvsteer_pd_requests"), 12);
    assert_eq!(f.counter("kvsteer_pd_prefill_failures"), 0);
    assert!(f.counter("kvsteer_spoofed_headers_removed") >= 12);
    f.assert_clean();
    assert_eq!(f.counter("kvsteer_bookings"), 24, "two legs a request");
}

/// Round robin alternates each side on its own, over its own replicas.
#[test]
fn round_robin_alternates_each_side() {
    let mut f = Fleet::with("round_robin");
    let picks: Vec<(usize, usize)> = (0..4)
        .map(|i| {
            let s = f.serve(&tokens(300 + i, 200), 10 + i);
            (s.prefill, s.decode)
        })
        .collect();
    assert_eq!(picks, [(0, 2), (1, 3), (0, 2), (1, 3)]);
    assert_eq!(f.booked(), 0);
    f.assert_clean();
}

/// A prefill leg answered 500 goes once more, to the other prefill replica, with the same body and
/// request id and its booking moved there; the client's request then goes on to its decode replica
/// as if nothing had failed. With `pd.retry_prefill` off the client gets the 502 at once.
#[test]
fn a_failed_prefill_leg_is_sent_once_more_to_the_other_prefill_replica() {
    let mut f = Fleet::with("kv_load");
    let body = json!({"prompt": tokens(900, 300), "max_tokens": 4});
    let (id, call) = f.send(&body, &[]);
    let call = call.unwrap();
    f.w.answer_callout(&call, bad(503, b"")).unwrap();
    let st = f.w.stream(id).unwrap();
    assert!(st.local_response.is_none() && !st.released);
    let retry = f.w.take_callouts();
    assert_eq!(retry.len(), 1);
    let other = if call.upstream == "prefill_r0" {
        "prefill_r1"
    } else {
        "prefill_r0"
    };
    assert_eq!(retry[0].upstream, other);
    assert_eq!(retry[0].body, call.body);
    assert_eq!(retry[0].header("x-request-id"), call.header("x-request-id"));
    let p_other = endpoint_index(retry[0].header(":authority").unwrap());
    let loads = f.loads();
    let p_first = endpoint_index(call.header(":authority").unwrap());
    assert_eq!(
        loads[p_other].active_requests, 1,
        "booked on the backup: {loads:?}"
    );
    assert_eq!(
        loads[p_first].active_requests, 0,
        "released where it failed: {loads:?}"
    );
    assert_eq!(f.booked(), 2, "the prefill leg moved, not doubled");
    let (answer, _, _) = f.prefill_answer(&retry[0], 1);
    f.w.answer_callout(&retry[0], answer).unwrap();
    let up: Value = serde_json::from_slice(f.released_to_decode(id)).unwrap();
    assert_eq!(up["kv_transfer_params"]["do_remote_prefill"], json!(true));
    f.finish(id, "200");
    assert_eq!(f.counter("kvsteer_pd_prefill_retries"), 1);
    assert_eq!(f.counter("kvsteer_pd_prefill_failures"), 0);
    assert_eq!(f.booked(), 0);
    f.assert_clean();

    let mut f = Fleet::new(ProxyOptions::new(
        HostMode::Envoy,
        plugin_config(
            "kv_load",
            json!({"pd": {"prefill_timeout_ms": 5000, "max_prefill_response_bytes": 4096,
                "retry_prefill": false}}),
        ),
    ));
    let (id, call) = f.send(&body, &[]);
    f.w.answer_callout(&call.unwrap(), bad(503, b"")).unwrap();
    assert!(f.w.take_callouts().is_empty(), "no retry when it is off");
    let st = f.w.stream(id).unwrap();
    assert_eq!(st.local_response.as_ref().unwrap().status, 502);
    f.w.end_stream(id).unwrap();
    assert_eq!(f.counter("kvsteer_pd_prefill_retries"), 0);
    assert_eq!(f.counter("kvsteer_pd_prefill_failures"), 1);
    assert_eq!(f.booked(), 0);
    f.assert_clean();
}

fn bad(status: u16, body: &[u8]) -> CallOutcome {
    CallOutcome::ok(status, "application/json", body.to_vec())
}

/// Every hostile prefill answer: no trap, a 502 naming the prefill leg, both legs released, the
/// failure counted. An answer without `kv_transfer_params` is not a failure: the decode leg goes
/// as a plain request without the client's own params.
#[test]
fn hostile_prefill_answers_never_trap_and_release_everything() {
    let mut f = Fleet::with("kv_load");
    let huge = vec![b' '; 5000];
    let cases: Vec<(&str, CallOutcome)> = vec![
        ("not json", bad(200, b"<html>oops</html>")),
        ("a JSON array", bad(200, b"[1,2,3]")),
        (
            "truncated",
            bad(200, br#"{"kv_transfer_params": {"do_remote"#),
        ),
        ("oversized", bad(200, &huge)),
        ("empty", bad(200, b"")),
        ("500", bad(500, br#"{"error": "boom"}"#)),
        ("429", bad(429, b"")),
        ("reset", CallOutcome::Reset),
        ("timeout", CallOutcome::timeout()),
    ];
    let n = cases.len() as u64;
    for (i, (what, outcome)) in cases.into_iter().enumerate() {
        let body = json!({"prompt": tokens(40 + i as u64, 100), "max_tokens": 4});
        let (id, call) = f.send(&body, &[]);
        let call = call.unwrap_or_else(|| panic!("{what}: a prefill callout"));
        assert_eq!(
            f.booked(),
            2,
            "{what}: both legs booked while the prefill leg is out"
        );
        f.w.answer_callout(&call, outcome.clone()).unwrap();
        // A 5xx or no answer is sent once more, to the other prefill replica, under the same
        // request id; it fails there too.
        let retried = matches!(what, "500" | "reset" | "timeout");
        let retry = f.w.take_callouts();
        assert_eq!(retry.len(), retried as usize, "{what}: {retry:?}");
        if let Some(again) = retry.first() {
            assert_ne!(again.upstream, call.upstream, "{what}");
            assert!(again.upstream.starts_with("prefill_r"), "{what}");
            assert_eq!(again.header("x-request-id"), call.header("x-request-id"));
            assert_eq!(again.body, call.body, "{what}: the same prefill leg");
            assert_eq!(f.booked(), 2, "{what}: the prefill leg moved, not doubled");
            f.w.answer_callout(again, outcome).unwrap();
        }
        let st = f.w.stream(id).unwrap();
        let local = st
            .local_response
            .as_ref()
            .unwrap_or_else(|| panic!("{what}: the client gets an answer"));
        assert_eq!(local.status, 502, "{what}");
        let err: Value = serde_json::from_slice(&local.body).unwrap();
        assert_eq!(err["error"]["leg"], json!("prefill"), "{what}");
        assert!(!st.released, "{what}: nothing goes upstream");
        f.w.end_stream(id).unwrap();
        assert_eq!(f.booked(), 0, "{what}: both legs released");
    }
    assert_eq!(f.counter("kvsteer_pd_prefill_failures"), n);
    assert_eq!(f.counter("kvsteer_pd_prefill_retries"), 3);

    // A 2xx JSON answer without (or with a non-object) kv_transfer_params: plain decode leg.
    for answer in [&br#"{"choices": []}"#[..], br#"{"kv_transfer_params": 7}"#] {
        let body = json!({"prompt": tokens(70, 100), "max_tokens": 4,
            "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.6.6.6"}});
        let (id, call) = f.send(&body, &[]);
        f.w.answer_callout(&call.unwrap(), bad(200, answer))
            .unwrap();
        let up: Value = serde_json::from_slice(f.released_to_decode(id)).unwrap();
        assert!(
            up.get("kv_transfer_params").is_none(),
            "the client's own params never pass: {up}"
        );
        f.finish(id, "200");
    }
    assert_eq!(f.counter("kvsteer_pd_plain_decodes"), 2);
    assert_eq!(f.booked(), 0);
    f.assert_clean();
}

/// A client that leaves while the prefill leg is out releases both legs; the late answer finds no
/// stream and changes nothing. Answers to two waiting streams each reach their own.
#[test]
fn a_late_prefill_answer_for_a_finished_stream_is_ignored() {
    let mut f = Fleet::with("kv_load");
    let body = json!({"prompt": tokens(5, 300), "max_tokens": 4});
    let (id, call) = f.send(&body, &[]);
    let call = call.unwrap();
    f.w.end_stream(id).unwrap();
    assert_eq!(f.booked(), 0, "released when the client left");
    let (answer, _, _) = f.prefill_answer(&call, 99);
    f.w.answer_callout(&call, answer).unwrap();
    assert_eq!(f.booked(), 0);

    // Two streams waiting, answered in the other order: each answer goes to its own stream (the
    // first one's failure does not touch the second).
    let (a, call_a) = f.send(&body, &[]);
    let (id, call) = f.send(&body, &[]);
    let (call_a, call) = (call_a.unwrap(), call.unwrap());
    let (answer, _, _) = f.prefill_answer(&call, 100);
    f.w.answer_callout(&call, answer).unwrap();
    assert!(f.w.stream(id).unwrap().released);
    assert!(!f.w.stream(a).unwrap().released);
    f.w.answer_callout(&call_a, bad(200, b"<html>oops</html>"))
        .unwrap();
    assert_eq!(
        f.w.stream(a)
            .unwrap()
            .local_response
            .as_ref()
            .unwrap()
            .status,
        502
    );
    assert!(f.w.stream(id).unwrap().local_response.is_none());
    f.w.end_stream(a).unwrap();
    f.finish(id, "200");
    assert_eq!(f.booked(), 0);
    f.assert_clean();
}

/// No prefill replica up (their feeds unreachable): a 503 naming the prefill leg, nothing booked.
/// A prefill cluster the proxy does not know: a 502, nothing booked. A body that cannot be split goes
/// whole to a decode replica.
#[test]
fn unavailable_prefill_unsendable_callouts_and_unsplittable_bodies() {
    let mut f = Fleet::with("kv_load");
    f.unreachable[0] = true;
    f.unreachable[1] = true;
    for _ in 0..3 {
        f.poll_feeds();
    }
    let (id, call) = f.send(&json!({"prompt": tokens(8, 100), "max_tokens": 4}), &[]);
    assert!(call.is_none(), "no callout to a replica that is down");
    let local = f.w.stream(id).unwrap().local_response.clone().unwrap();
    assert_eq!(local.status, 503);
    let err: Value = serde_json::from_slice(&local.body).unwrap();
    assert_eq!(err["error"]["leg"], json!("prefill"));
    f.w.end_stream(id).unwrap();
    assert_eq!(f.counter("kvsteer_pd_unavailable"), 1);
    assert_eq!(f.booked(), 0);
    f.assert_clean();

    let mut options = ProxyOptions::new(HostMode::Envoy, plugin_config("kv_load", json!({})));
    options.clusters = Some(
        (0..REPLICAS)
            .map(|i| format!("kvsteer_feed_r{i}"))
            .collect(),
    );
    let mut f = Fleet::new(options);
    let (id, call) = f.send(&json!({"prompt": tokens(9, 100), "max_tokens": 4}), &[]);
    assert!(call.is_none());
    assert_eq!(
        f.w.stream(id)
            .unwrap()
            .local_response
            .as_ref()
            .unwrap()
            .status,
        502
    );
    f.w.end_stream(id).unwrap();
    assert_eq!(f.booked(), 0);
    assert_eq!(f.counter("kvsteer_pd_prefill_failures"), 1);

    // Not a request the core can read: whole, to a decode replica, no callout.
    for body in [json!({"max_tokens": 4}), json!([1, 2])] {
        let (id, call) = f.send(&body, &[]);
        assert!(call.is_none());
        f.released_to_decode(id);
        f.finish(id, "400");
    }
    assert_eq!(f.counter("kvsteer_pd_whole_requests"), 2);
    assert_eq!(f.booked(), 0);
    f.assert_clean();
}

/// A body over `routing.max_body_bytes` is not read, so it could carry a client's own
/// `kv_transfer_params` (naming the host a decode engine would pull KV from): in a P/D fleet it is
/// refused with a 413, nothing booked, no callout, instead of being forwarded unchecked.
#[test]
fn an_unread_body_is_refused_not_forwarded_unchecked() {
    let options = ProxyOptions::new(
        HostMode::Envoy,
        plugin_config(
            "kv_load",
            json!({"routing": {"policy": "kv_load", "block_size": 16, "max_body_bytes": 2048}}),
        ),
    );
    let mut f = Fleet::new(options);
    f.poll_feeds();
    let body = json!({"prompt": tokens(11, 1_000), "max_tokens": 4,
        "kv_transfer_params": {"do_remote_prefill": true, "remote_host": "10.9.9.9", "remote_port": 1}});
    let (id, call) = f.send(&body, &[]);
    assert!(call.is_none());
    let st = f.w.stream(id).unwrap();
    let local = st.local_response.clone().expect("refused");
    assert_eq!(local.status, 413);
    assert!(st.upstream_header(DEST).is_none(), "not routed anywhere");
    let err: Value = serde_json::from_slice(&local.body).unwrap();
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_body_bytes"),
        "{err}"
    );
    f.w.end_stream(id).unwrap();
    assert_eq!(f.booked(), 0);
    // A body under the limit still splits as usual.
    let (_, call) = f.send(&json!({"prompt": tokens(12, 100), "max_tokens": 4}), &[]);
    assert!(call.is_some());
}

/// Without roles the same fleet routes one request to one replica, no callout: today's behaviour.
#[test]
fn a_fleet_without_roles_makes_no_prefill_callout() {
    let cfg = plugin_config("kv_load", json!({}))
        .replace("\"prefill\"", "\"both\"")
        .replace("\"decode\"", "\"both\"");
    let mut f = Fleet::new(ProxyOptions::new(HostMode::Envoy, cfg));
    let (id, call) = f.send(&json!({"prompt": tokens(3, 100), "max_tokens": 4}), &[]);
    assert!(call.is_none());
    assert!(f.w.stream(id).unwrap().released);
    assert_eq!(f.counter("kvsteer_pd_requests"), 0);
    f.w.end_stream(id).unwrap();
    f.assert_clean();
}

/// A prefill replica that keeps failing is ejected (its failures count against its health) and then
/// probed once per probe interval. Its failed legs, the probe's among them, go on to the other
/// prefill replica, so no client sees them; a successful probe restores the replica.
#[test]
fn a_failing_prefill_replica_is_ejected_probed_and_a_failed_probe_costs_nothing() {
    let mut f = Fleet::with("round_robin");
    let body = |i: u64| json!({"prompt": tokens(600 + i, 100), "max_tokens": 4});
    // Round robin alternates r0, r1; r0 answers 500 three times in a row: ejected. Each of its
    // failed legs goes on to r1, so no client sees them.
    let mut r0_failures = 0;
    for i in 0..6 {
        let (id, call) = f.send(&body(i), &[]);
        let call = call.unwrap();
        if call.upstream == "prefill_r0" {
            f.w.answer_callout(&call, bad(500, b"")).unwrap();
            let st = f.w.stream(id).unwrap();
            assert!(st.local_response.is_none() && !st.released);
            let retry = f.w.take_callouts();
            assert_eq!(retry.len(), 1);
            assert_eq!(retry[0].upstream, "prefill_r1");
            let (answer, _, _) = f.prefill_answer(&retry[0], 500 + i);
            f.w.answer_callout(&retry[0], answer).unwrap();
            assert!(f.w.stream(id).unwrap().released);
            f.finish(id, "200");
            r0_failures += 1;
        } else {
            let (answer, _, _) = f.prefill_answer(&call, 1000 + i);
            f.w.answer_callout(&call, answer).unwrap();
            f.finish(id, "200");
        }
    }
    assert_eq!(r0_failures, 3);
    f.tick(10_000);
    assert_eq!(
        f.counter("kvsteer_ejected_r0"),
        1,
        "the gauge follows at the tick"
    );
    assert_eq!(f.counter("kvsteer_pd_prefill_failures"), 0);
    assert_eq!(f.counter("kvsteer_pd_prefill_retries"), 3);
    // Ejected: every prefill leg goes to r1 until a probe is due.
    for i in 6..9 {
        let (id, call) = f.send(&body(i), &[]);
        let call = call.unwrap();
        assert_eq!(call.upstream, "prefill_r1", "r0 is ejected");
        let (answer, _, _) = f.prefill_answer(&call, 1000 + i);
        f.w.answer_callout(&call, answer).unwrap();
        f.finish(id, "200");
    }
    // A probe interval later the next prefill leg probes r0; it fails, and the leg goes on to r1.
    f.tick(1_100_000);
    let (id, call) = f.send(&body(20), &[]);
    let probe = call.unwrap();
    assert_eq!(probe.upstream, "prefill_r0", "the probe");
    assert_eq!(f.booked(), 2);
    f.w.answer_callout(&probe, bad(500, b"")).unwrap();
    let st = f.w.stream(id).unwrap();
    assert!(
        st.local_response.is_none() && !st.released,
        "{:?}",
        st.local_response
    );
    let retry = f.w.take_callouts();
    assert_eq!(retry.len(), 1);
    assert_eq!(retry[0].upstream, "prefill_r1");
    assert_eq!(
        retry[0].header("x-request-id"),
        probe.header("x-request-id")
    );
    assert_eq!(f.booked(), 2, "the prefill leg moved, not doubled");
    let (answer, _, _) = f.prefill_answer(&retry[0], 2000);
    f.w.answer_callout(&retry[0], answer).unwrap();
    let st = f.w.stream(id).unwrap();
    assert!(st.released && st.local_response.is_none());
    f.finish(id, "200");
    assert_eq!(
        f.counter("kvsteer_pd_prefill_failures"),
        0,
        "the failed probe is not a failure"
    );
    assert_eq!(f.counter("kvsteer_pd_prefill_retries"), 4);
    // Later, a probe that succeeds restores r0 (once its failures have decayed).
    f.tick(9_000_000);
    let (id, call) = f.send(&body(30), &[]);
    let call = call.unwrap();
    assert_eq!(call.upstream, "prefill_r0", "the next probe");
    let (answer, _, _) = f.prefill_answer(&call, 3000);
    f.w.answer_callout(&call, answer).unwrap();
    f.finish(id, "200");
    let ups: Vec<String> = (0..4)
        .map(|i| {
            let (id, call) = f.send(&body(40 + i), &[]);
            let call = call.unwrap();
            let (answer, _, _) = f.prefill_answer(&call, 4000 + i);
            f.w.answer_callout(&call, answer).unwrap();
            f.finish(id, "200");
            call.upstream
        })
        .collect();
    assert!(
        ups.iter().any(|u| u == "prefill_r0"),
        "r0 restored: {ups:?}"
    );
    assert_eq!(f.booked(), 0);
    f.assert_clean();
}

/// A prefill replica with data-parallel ranks (docs/design/dp.md): each rank is a prefill unit of
/// its own, its leg carries the rank header, and a failed leg is sent on to another endpoint, not
/// to another rank of the same engine (whose address is the same). Round robin over the prefill
/// units r0 rank 0, r0 rank 1, r1; every first leg answers 500.
#[test]
fn prefill_ranks_carry_the_rank_header_and_retry_on_another_endpoint() {
    let mut cfg: Value = serde_json::from_str(&plugin_config("round_robin", json!({}))).unwrap();
    cfg["replicas"][0]["dp_ranks"] = json!(2);
    let proxy = Proxy::new(
        module(),
        ProxyOptions::new(HostMode::Envoy, cfg.to_string()),
    );
    let mut w = proxy.start_worker().expect("worker");
    let rank = "x-data-parallel-rank";
    // (first leg's cluster, its rank header, the retry's cluster, its rank header)
    let want = [
        ("prefill_r0", Some("0"), "prefill_r1", None),
        ("prefill_r0", Some("1"), "prefill_r1", None),
        ("prefill_r1", None, "prefill_r0", Some("0")),
    ];
    for (i, (first, first_rank, second, second_rank)) in want.into_iter().enumerate() {
        let bytes = json!({"prompt": tokens(950 + i as u64, 64), "max_tokens": 2})
            .to_string()
            .into_bytes();
        let id = w.new_stream().unwrap();
        let client_rank = [(rank.to_string(), "1".to_string())];
        w.request_headers(
            id,
            request_headers("/v1/completions", bytes.len(), None, &client_rank),
            false,
        )
        .unwrap();
        w.request_body(id, &bytes, true).unwrap();
        let calls = w.take_callouts();
        assert_eq!(calls.len(), 1, "request {i}: {calls:?}");
        assert_eq!(calls[0].upstream, first, "request {i}");
        assert_eq!(calls[0].header(rank), first_rank, "request {i}");
        w.answer_callout(&calls[0], bad(500, b"")).unwrap();
        let retry = w.take_callouts();
        assert_eq!(retry.len(), 1, "request {i}: {retry:?}");
        assert_eq!(retry[0].upstream, second, "request {i}");
        assert_eq!(retry[0].header(rank), second_rank, "request {i}");
        let params = json!({"kv_transfer_params": {"do_remote_prefill": true,
            "remote_engine_id": "e", "remote_block_ids": [1, 2, 3, 4]}});
        w.answer_callout(&retry[0], bad(200, params.to_string().as_bytes()))
            .unwrap();
        let st = w.stream(id).unwrap();
        assert!(st.released && st.local_response.is_none(), "request {i}");
        assert!(endpoint_index(st.upstream_header(DEST).unwrap()) >= PREFILL);
        assert_eq!(
            st.upstream_header(rank),
            None,
            "request {i}: the decode replicas have no ranks, and the client's header is gone"
        );
        w.response_headers(id, pairs(&[(":status", "200")]), true)
            .unwrap();
        w.end_stream(id).unwrap();
    }
    assert_eq!(
        proxy
            .metric("kvsteer_pd_prefill_retries")
            .map_or(0, |m| m.value as u64),
        3
    );
}
