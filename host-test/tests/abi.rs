//! The host runs the real filter through its whole lifecycle, and the filter uses the ABI correctly.

mod common;
use common::*;
use kvsteer_host_test::{HostError, HostMode, Proxy, ProxyOptions, RequestSpec};

#[test]
fn filter_loads_configures_and_ticks() {
    let m = module();
    assert!(m.size() > 10_000);
    let imports = m.imports();
    assert!(
        imports.iter().any(|i| i == "env::proxy_http_call"),
        "{imports:?}"
    );
    let mut h = harness("kv_load");
    for w in h.workers() {
        assert!(w.tick_period_ms() > 0, "the filter must ask for ticks");
    }
    h.run_for(2_000_000).unwrap();
    assert!(h.stats.ticks >= 30, "ticks: {}", h.stats.ticks);
    assert!(h.stats.callouts > 0, "no feed callouts in 2.5 s");
    assert!(
        h.replicas.iter().all(|r| r.polls > 0),
        "every replica's feed is polled"
    );
    for m in h.proxy().metrics() {
        assert!(m.name.starts_with("kvsteer_"), "metric {}", m.name);
    }
    for k in h.proxy().shared_data_keys() {
        assert!(
            k.starts_with(b"kvsteer:"),
            "key {}",
            String::from_utf8_lossy(&k)
        );
    }
    assert_clean(&h);
}

#[test]
fn feed_callouts_carry_the_required_headers() {
    let mut h = harness("kv_load");
    h.run_for(1_000_000).unwrap();
    // The host refuses callouts without :method/:path/:authority or to unknown clusters, as Envoy
    // does (BadArgument); these reached the replicas, and carry a parseable feed query.
    for r in &h.replicas {
        let (method, path, authority) = r.last_poll.clone().expect("polled");
        assert_eq!(method, "GET");
        assert!(path.starts_with("/kvsteer/feed?"), "{path}");
        let q = kvsteer_core::feed::FeedQuery::parse(path.split_once('?').unwrap().1).unwrap();
        assert!(q.epoch == 0 || q.epoch == r.engine.epoch(), "{q:?}");
        assert_eq!(authority, r.endpoint);
    }
    assert_clean(&h);
}

#[test]
fn bad_configurations_are_refused_not_trapped() {
    for cfg in [
        "".to_string(),
        "not json".into(),
        "{}".into(),
        r#"{"replicas": []}"#.into(),
        r#"{"replicas": [{"name": "r0", "endpoint": "127.0.0.1:1"}], "routing": {"policy": "nope"}}"#
            .into(),
        r#"{"replicas": [{"name": "r0", "endpoint": "127.0.0.1:1"}], "typo_field": 1}"#.into(),
        "\u{0}\u{ff}garbage".into(),
    ] {
        let p = Proxy::new(module(), ProxyOptions::new(HostMode::Envoy, cfg.clone()));
        match p.start_worker() {
            Err(HostError::Refused { callback, .. }) => assert_eq!(callback, "proxy_on_configure"),
            Err(e) => panic!("config {cfg:?}: {e}"),
            Ok(_) => panic!("config {cfg:?} was accepted"),
        }
    }
}

#[test]
fn response_chunks_always_continue() {
    let mut h = harness("kv_load");
    let id = h.send(&RequestSpec::new(tokens(1, 600), 200)).unwrap();
    h.run_until_idle(60_000_000).unwrap();
    let r = h.record(id).unwrap();
    assert!(!r.failed, "{r:?}");
    assert_eq!(r.completion_tokens, 200);
    // Every response chunk came through; the harness errors out on a paused chunk.
    assert!(h.stats.response_body_chunks >= 200 / 16);
    assert!(r.downstream_bytes > 200 * 4);
    assert_clean(&h);
}

#[test]
fn non_inference_requests_pass_untouched() {
    let mut h = harness("kv_load");
    // GET /v1/models: continue on headers, no destination written.
    let spec = RequestSpec {
        path: Some("/v1/models".into()),
        raw_body: Some(Vec::new()),
        ..RequestSpec::default()
    };
    let id = h.send(&spec).unwrap();
    let r = h.record(id).unwrap();
    assert!(r.released);
    assert!(r.fallback, "no destination for a non-inference path: {r:?}");
    assert_clean(&h);
}
