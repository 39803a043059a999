//! `explain_header`: with it configured, a request `kv_time` routes comes back with every candidate's
//! cost terms and the winner in that response header; without it, or under another policy, no such
//! header; an upstream's header of the same name is replaced, so a replica cannot forge one.

mod common;

use common::module;
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{Action, HostMode, Proxy, ProxyOptions};
use serde_json::json;

const HEADER: &str = "x-kvsteer-explain";

fn explained(policy: &str, explain: bool, upstream_forgery: bool) -> Option<String> {
    let replicas: Vec<_> = (0..3)
        .map(|i| {
            json!({"name": format!("r{i}"), "endpoint": format!("10.0.0.{}:8000", i + 1),
                   "feed_cluster": format!("feed_r{i}")})
        })
        .collect();
    let mut cfg = json!({"replicas": replicas, "routing": {"policy": policy, "block_size": 16},
                         "feed_period_ms": 3_600_000, "tick_ms": 100});
    if explain {
        cfg["explain_header"] = json!(HEADER);
    }
    let proxy = Proxy::new(
        module(),
        ProxyOptions::new(HostMode::Envoy, cfg.to_string()),
    );
    let mut w = proxy.start_worker().unwrap();
    let body = json!({"model": "m", "prompt": (0..300).collect::<Vec<u32>>(), "max_tokens": 4})
        .to_string();
    let id = w.new_stream().unwrap();
    let mut last = w
        .request_headers(
            id,
            request_headers("/v1/completions", body.len(), None, &[]),
            false,
        )
        .unwrap();
    if let Some(a) = w.request_body(id, body.as_bytes(), true).unwrap() {
        last = a;
    }
    assert_eq!(last, Action::Continue);
    let mut answer = vec![(b":status".to_vec(), b"200".to_vec())];
    if upstream_forgery {
        answer.push((HEADER.as_bytes().to_vec(), b"winner=2; forged".to_vec()));
    }
    w.response_headers(id, answer, true).unwrap();
    let st = w.end_stream(id).unwrap();
    st.response_headers?
        .into_iter()
        .find(|(k, _)| k == HEADER.as_bytes())
        .map(|(_, v)| String::from_utf8_lossy(&v).into_owned())
}

#[test]
fn kv_time_explains_its_decision_only_when_configured() {
    let text = explained("kv_time", true, false).expect("the header");
    assert!(text.starts_with("winner="), "{text}");
    for r in 0..3 {
        assert!(text.contains(&format!("; {r}: cost=")), "{text}");
    }
    for term in ["wait=", "prefill=", "decode=", "stall=", "evict="] {
        assert!(text.contains(term), "{text}");
    }
    assert_eq!(explained("kv_time", false, false), None);
    assert_eq!(explained("kv_load", true, false), None);
    let replaced = explained("kv_time", true, true).expect("the header");
    assert!(!replaced.contains("forged"), "{replaced}");
}
