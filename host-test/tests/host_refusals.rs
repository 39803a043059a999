//! A proxy may refuse any host call: nginx's module refuses calls in a phase it does not allow them
//! in, and a host may lack one (`Unimplemented`). The SDK's `hostcalls` wrappers panic on a status
//! they do not expect, which traps the VM; the filter calls the ABI itself and falls back instead
//! (docs/design/filter.md, "Host-call failures"). Here the host refuses the filter's calls with
//! statuses the SDK does not expect, through the real `.wasm`: nothing traps, every request is
//! still answered, and the same VMs route normally once the host accepts the calls again.

mod common;
use common::*;
use kvsteer_host_test::{HostError, HostMode, Proxy, ProxyOptions, RequestSpec};

/// proxy-wasm's `Unimplemented`: outside the SDK's `Status` enum, so no wrapper expects it.
const UNIMPLEMENTED: u32 = 12;
/// proxy-wasm's `InternalFailure`.
const INTERNAL_FAILURE: u32 = 10;

/// Every host call the filter makes on the request and tick paths but the header calls and the
/// callout (the SDK's wrapper sends callouts: it must learn the token, see `abi::dispatch_http_call`).
const REFUSED: &[&str] = &[
    "proxy_log",
    "proxy_get_current_time_nanoseconds",
    "proxy_get_buffer_bytes",
    "proxy_set_buffer_bytes",
    "proxy_get_property",
    "proxy_set_property",
    "proxy_get_shared_data",
    "proxy_set_shared_data",
    "proxy_increment_metric",
    "proxy_record_metric",
    "proxy_call_foreign_function",
];

#[test]
fn refused_host_calls_fall_back_and_the_vm_lives_on() {
    let mut h = harness("kv_load");
    for call in REFUSED {
        h.proxy().refuse_host_call(call, UNIMPLEMENTED);
    }
    // The one status set the SDK's callout wrapper does handle: feed polls are not sent.
    h.proxy()
        .refuse_host_call("proxy_http_call", INTERNAL_FAILURE);
    h.run_for(500_000).unwrap(); // the polls in flight are answered
    let polls: Vec<u64> = h.replicas.iter().map(|r| r.polls).collect();
    let prompt = tokens(7, 600);
    // The body cannot be read: routed by load, and answered in full (response chunks unread).
    let id = h.send(&RequestSpec::new(prompt.clone(), 64)).unwrap();
    h.run_until_idle(60_000_000).unwrap();
    h.run_for(1_000_000).unwrap(); // ticks: clock, shared data, metrics, polls all refused
    let r = h.record(id).unwrap().clone();
    assert!(r.released && !r.failed, "{r:?}");
    assert!(r.destination.is_some(), "a destination by load: {r:?}");
    assert_eq!(r.completion_tokens, 64, "{r:?}");
    assert_eq!(
        h.replicas.iter().map(|r| r.polls).collect::<Vec<_>>(),
        polls,
        "no feed poll was sent"
    );
    for w in h.workers() {
        assert!(!w.is_dead(), "worker {} died", w.index());
    }

    // Log lines accepted again: the first refusal of each call still refused is logged, once.
    h.proxy().accept_host_call("proxy_log");
    h.run_for(500_000).unwrap();
    for w in h.workers() {
        let logged = |call: &str| {
            let needle = format!("the proxy refused {call} (status 12)");
            w.logs()
                .iter()
                .filter(|l| l.message.contains(&needle))
                .count()
        };
        assert_eq!(logged("proxy_get_shared_data"), 1, "{:?}", w.logs());
        assert_eq!(logged("proxy_record_metric"), 1, "{:?}", w.logs());
    }

    // The host accepts again: the same VMs poll and route by the body, and count what was refused.
    for call in REFUSED.iter().chain(&["proxy_http_call"]) {
        h.proxy().accept_host_call(call);
    }
    h.run_for(1_000_000).unwrap();
    assert!(
        h.replicas.iter().zip(&polls).all(|(r, p)| r.polls > *p),
        "polls resumed"
    );
    let again = h.send(&RequestSpec::new(prompt, 64)).unwrap();
    h.run_until_idle(60_000_000).unwrap();
    h.run_for(500_000).unwrap();
    let r2 = h.record(again).unwrap();
    assert!(r2.released && !r2.failed, "{r2:?}");
    assert_eq!(r2.completion_tokens, 64, "{r2:?}");
    let refusals = h
        .proxy()
        .metric("kvsteer_host_call_refusals")
        .map_or(0, |m| m.value);
    assert!(refusals > 0, "refusals counted: {refusals}");
    assert_clean(&h);
}

#[test]
fn a_client_header_the_host_will_not_remove_gets_a_500_and_the_vm_lives_on() {
    let mut h = harness("kv_load");
    h.proxy()
        .refuse_host_call("proxy_remove_header_map_value", UNIMPLEMENTED);
    let id = h
        .send(&RequestSpec::new(tokens(3, 300), 16).header("x-gateway-destination-endpoint", "x"))
        .unwrap();
    h.run_until_idle(60_000_000).unwrap();
    let r = h.record(id).unwrap();
    assert_eq!(r.local_response, Some(500), "{r:?}");
    assert!(!r.released, "{r:?}");
    h.proxy().accept_host_call("proxy_remove_header_map_value");
    let next = h.send(&RequestSpec::new(tokens(3, 300), 16)).unwrap();
    h.run_until_idle(60_000_000).unwrap();
    let r = h.record(next).unwrap();
    assert!(r.released && !r.failed, "{r:?}");
    assert_clean(&h);
}

fn options() -> ProxyOptions {
    let cfg = kvsteer_host_test::HarnessConfig::small("kv_load").plugin_config();
    ProxyOptions::new(HostMode::Envoy, serde_json::to_vec(&cfg).unwrap())
}

#[test]
fn a_configuration_the_host_will_not_hand_over_is_refused_not_trapped() {
    let p = Proxy::new(module(), options());
    p.refuse_host_call("proxy_get_buffer_bytes", UNIMPLEMENTED);
    match p.start_worker() {
        Err(HostError::Refused { callback, .. }) => assert_eq!(callback, "proxy_on_configure"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("configured without a configuration"),
    }
}

#[test]
fn refused_metrics_and_tick_period_still_configure() {
    let p = Proxy::new(module(), options());
    p.refuse_host_call("proxy_define_metric", UNIMPLEMENTED);
    p.refuse_host_call("proxy_set_tick_period_milliseconds", UNIMPLEMENTED);
    p.refuse_host_call("proxy_get_current_time_nanoseconds", UNIMPLEMENTED);
    let w = p.start_worker().unwrap_or_else(|e| panic!("{e}"));
    assert!(!w.is_dead());
    assert_eq!(w.tick_period_ms(), 0);
    assert!(
        w.logs()
            .iter()
            .any(|l| l.message.contains("refused a tick period")),
        "{:?}",
        w.logs()
    );
    assert!(p.metrics().is_empty(), "no metric defined");
}
