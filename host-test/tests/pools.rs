//! Pools (docs/design/pools.md) in the compiled filter: one gateway, two fleets, the request's
//! `model` choosing. Each model lands only in its pool; a model no pool serves is answered 404 by
//! the filter and never goes upstream; a body without a model goes to the default pool or gets
//! 400; an unread body follows the operator's model header; one pool's traffic leaves the other's
//! decisions unchanged; metrics and the explain header name the pool; feed answers reach the pool
//! that polled.

mod common;

use common::module;
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{Action, HostMode, Proxy, ProxyOptions, WorkerVm};
use serde_json::{Value, json};

const EXPLAIN: &str = "x-kvsteer-explain";
const DEST: &str = "x-gateway-destination-endpoint";

fn pool(name: &str, models: &[&str], net: u8, block: u32) -> Value {
    let replicas: Vec<_> = (0..2)
        .map(|i| {
            json!({"name": format!("r{i}"), "endpoint": format!("10.0.{net}.{}:8000", i + 1),
                   "feed_cluster": format!("feed_{name}_r{i}")})
        })
        .collect();
    json!({"name": name, "models": models, "replicas": replicas,
           "routing": {"block_size": block}})
}

/// Two pools: `chat` (models `llama-8b`, `sql-lora`; 10.0.0.x; blocks of 16) and `big`
/// (`llama-70b`; 10.0.1.x; blocks of 32), `kv_time`, the explain header on.
fn gateway(default_pool: Option<&str>) -> Value {
    let mut cfg = json!({
        "routing": {"policy": "kv_time", "max_body_bytes": 4096},
        "feed_period_ms": 3_600_000, "tick_ms": 100,
        "explain_header": EXPLAIN,
        "model_header": "x-gateway-model-name",
        "pools": [pool("chat", &["llama-8b", "sql-lora"], 0, 16),
                  pool("big", &["llama-70b"], 1, 32)]});
    if let Some(d) = default_pool {
        cfg["default_pool"] = json!(d);
    }
    cfg
}

fn proxy(cfg: &Value) -> Proxy {
    Proxy::new(
        module(),
        ProxyOptions::new(HostMode::Envoy, cfg.to_string()),
    )
}

/// What became of one request.
struct Sent {
    /// The destination the upstream saw; `None` when it never went upstream.
    destination: Option<String>,
    explain: Option<String>,
    /// The filter's own answer: status and body.
    local: Option<(u32, String)>,
}

fn header(pairs: &[(Vec<u8>, Vec<u8>)], name: &str) -> Option<String> {
    pairs
        .iter()
        .find(|(k, _)| k == name.as_bytes())
        .map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}

fn send(w: &mut WorkerVm, body: &str, extra: &[(String, String)]) -> Sent {
    let id = w.new_stream().unwrap();
    let mut last = w
        .request_headers(
            id,
            request_headers("/v1/completions", body.len(), None, extra),
            body.is_empty(),
        )
        .unwrap();
    if !body.is_empty()
        && let Some(a) = w.request_body(id, body.as_bytes(), true).unwrap()
    {
        last = a;
    }
    let local = w
        .stream(id)
        .and_then(|s| s.local_response.as_ref())
        .map(|l| (l.status, String::from_utf8_lossy(&l.body).into_owned()));
    if local.is_none() {
        assert_eq!(last, Action::Continue, "{body}");
        w.response_headers(id, vec![(b":status".to_vec(), b"200".to_vec())], true)
            .unwrap();
    }
    let st = w.end_stream(id).unwrap();
    Sent {
        destination: st.upstream_headers.as_deref().and_then(|h| header(h, DEST)),
        explain: st
            .response_headers
            .as_deref()
            .and_then(|h| header(h, EXPLAIN)),
        local,
    }
}

fn completion(model: &str, seed: u32) -> String {
    let prompt: Vec<u32> = (0..200).map(|i| seed * 1000 + i).collect();
    json!({"model": model, "prompt": prompt, "max_tokens": 4}).to_string()
}

fn metric(p: &Proxy, name: &str) -> i64 {
    p.metric(name).map_or(-1, |m| m.value)
}

#[test]
fn each_model_lands_in_its_own_pool_and_is_named_there() {
    let p = proxy(&gateway(Some("chat")));
    let mut workers = [p.start_worker().unwrap(), p.start_worker().unwrap()];
    let mut chat = 0;
    for i in 0..24u32 {
        let model = ["llama-8b", "llama-70b", "sql-lora"][i as usize % 3];
        let w = &mut workers[i as usize % 2];
        let s = send(w, &completion(model, i), &[]);
        let dest = s.destination.expect("routed upstream");
        let (net, name) = if model == "llama-70b" {
            ("10.0.1.", "big")
        } else {
            chat += 1;
            ("10.0.0.", "chat")
        };
        assert!(dest.starts_with(net), "{model} went to {dest}");
        let explain = s.explain.expect("explained");
        assert!(
            explain.starts_with(&format!("pool={name}; winner=")),
            "{explain}"
        );
    }
    assert_eq!(metric(&p, "kvsteer_pool_chat_requests_routed"), chat);
    assert_eq!(metric(&p, "kvsteer_pool_big_requests_routed"), 24 - chat);
    assert!(p.metric("kvsteer_pool_big_decisions_kv_time_r1").is_some());
    assert!(p.metric("kvsteer_requests_routed").is_none());
    assert_eq!(metric(&p, "kvsteer_models_unknown"), 0);
}

#[test]
fn unknown_and_missing_models_are_answered_by_the_filter() {
    for default in [None, Some("big")] {
        let p = proxy(&gateway(default));
        let mut w = p.start_worker().unwrap();
        let s = send(&mut w, &completion("gpt-4", 1), &[]);
        let (status, body) = s.local.expect("answered by the filter");
        assert_eq!(status, 404);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "model_not_found", "{body}");
        assert!(body.contains("gpt-4"), "{body}");
        assert_eq!(s.destination, None);
        assert_eq!(metric(&p, "kvsteer_models_unknown"), 1);
        let no_model = json!({"prompt": [1, 2, 3], "max_tokens": 4}).to_string();
        let s = send(&mut w, &no_model, &[]);
        match default {
            None => {
                assert_eq!(s.local.as_ref().map(|l| l.0), Some(400));
                assert_eq!(s.destination, None);
                assert_eq!(metric(&p, "kvsteer_models_missing"), 1);
            }
            Some(_) => {
                assert!(s.local.is_none());
                let dest = s.destination.expect("routed in the default pool");
                assert!(dest.starts_with("10.0.1."), "{dest}");
            }
        }
        // Nothing refused was booked: the pools' bookings equal their releases and count only
        // what went upstream.
        w.tick().unwrap();
        let routed = metric(&p, "kvsteer_pool_big_requests_routed").max(0)
            + metric(&p, "kvsteer_pool_chat_requests_routed").max(0);
        assert_eq!(routed, i64::from(default.is_some()));
        for pool in ["chat", "big"] {
            assert_eq!(
                metric(&p, &format!("kvsteer_pool_{pool}_bookings")),
                metric(&p, &format!("kvsteer_pool_{pool}_releases")),
                "{pool}"
            );
        }
    }
}

#[test]
fn an_unread_body_follows_the_model_header_or_is_refused() {
    let p = proxy(&gateway(None));
    let mut w = p.start_worker().unwrap();
    // Over routing.max_body_bytes (4096): routed unread.
    let big_body = completion("llama-8b", 7).repeat(4);
    let to_big = [("x-gateway-model-name".to_string(), "llama-70b".to_string())];
    let s = send(&mut w, &big_body, &to_big);
    let dest = s.destination.expect("routed by load in the header's pool");
    assert!(dest.starts_with("10.0.1."), "{dest}");
    let s = send(&mut w, &big_body, &[]);
    assert_eq!(s.local.map(|l| l.0), Some(413));
    assert_eq!(s.destination, None);
    assert_eq!(metric(&p, "kvsteer_models_missing"), 1);
    // An empty body has no model either: 400, counted the same.
    let s = send(&mut w, "", &[]);
    assert_eq!(s.local.map(|l| l.0), Some(400));
    assert_eq!(metric(&p, "kvsteer_models_missing"), 2);
    // A readable body's model wins over the header.
    let s = send(&mut w, &completion("llama-8b", 8), &to_big);
    assert!(s.destination.unwrap().starts_with("10.0.0."));
}

/// The destinations `big` chooses for a fixed sequence, with or without `chat` traffic between,
/// and `big`'s own counters and gauges after it.
fn big_decisions(with_chat_flood: bool) -> (Vec<String>, Vec<(String, i64)>) {
    let p = proxy(&gateway(Some("chat")));
    p.set_now_ns(1_000_000_000);
    let mut w = p.start_worker().unwrap();
    let mut out = Vec::new();
    for i in 0..12u32 {
        if with_chat_flood {
            for k in 0..5 {
                let s = send(&mut w, &completion("llama-8b", 100 + i * 5 + k), &[]);
                assert!(s.destination.unwrap().starts_with("10.0.0."));
            }
        }
        // Half the requests repeat an earlier prompt, so the index matters.
        let s = send(&mut w, &completion("llama-70b", i % 6), &[]);
        out.push(s.destination.unwrap());
        w.tick().unwrap();
    }
    let mut own: Vec<(String, i64)> = p
        .metrics()
        .into_iter()
        .filter(|m| m.name.starts_with("kvsteer_pool_big_"))
        .map(|m| (m.name, m.value))
        .collect();
    own.sort();
    (out, own)
}

#[test]
fn one_pools_traffic_leaves_the_others_decisions_alone() {
    let (quiet, quiet_metrics) = big_decisions(false);
    assert!(quiet.iter().all(|d| d.starts_with("10.0.1.")));
    assert!(
        quiet_metrics
            .iter()
            .any(|(n, v)| n == "kvsteer_pool_big_requests_routed" && *v == 12),
        "{quiet_metrics:?}"
    );
    let (flooded, flooded_metrics) = big_decisions(true);
    assert_eq!(flooded, quiet);
    // Every metric of big's (bookings, index, load, speeds, failures) reads the same.
    assert_eq!(flooded_metrics, quiet_metrics);
}

#[test]
fn feed_polls_go_out_per_pool_and_answers_reach_the_pool_that_polled() {
    let mut cfg = gateway(Some("chat"));
    cfg["feed_period_ms"] = json!(1000);
    let p = proxy(&cfg);
    let mut w = p.start_worker().unwrap();
    p.set_now_ns(5_000_000_000);
    w.tick().unwrap();
    let calls = w.take_callouts();
    let mut upstreams: Vec<&str> = calls.iter().map(|c| c.upstream.as_str()).collect();
    upstreams.sort();
    assert_eq!(
        upstreams,
        ["feed_big_r0", "feed_big_r1", "feed_chat_r0", "feed_chat_r1"]
    );
    // Every poll answered with a server error: each pool counts its own replicas' failures.
    for c in &calls {
        w.answer_callout(
            c,
            kvsteer_host_test::CallOutcome::Response {
                headers: vec![(b":status".to_vec(), b"503".to_vec())],
                body: Vec::new(),
                trailers: Vec::new(),
            },
        )
        .unwrap();
    }
    for pool in ["chat", "big"] {
        for r in 0..2 {
            assert_eq!(
                metric(&p, &format!("kvsteer_pool_{pool}_feed_errors_r{r}")),
                1,
                "{pool} r{r}"
            );
        }
    }
    // Each pool's shared records live under its own key prefix.
    let keys: Vec<String> = p
        .shared_data_keys()
        .iter()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .collect();
    for pool in ["chat", "big"] {
        assert!(
            keys.iter()
                .any(|k| k.starts_with(&format!("kvsteer/{pool}:"))),
            "{keys:?}"
        );
    }
}

/// A proxy in nginx mode with `cfg`: the choice written to the nginx variable, each feed reached
/// at its address (the endpoint's port 9000).
fn nginx_proxy(mut cfg: Value) -> Proxy {
    cfg["output"] = json!("nginx_variable");
    for p in cfg["pools"].as_array_mut().unwrap() {
        for r in p["replicas"].as_array_mut().unwrap() {
            let feed = r["endpoint"].as_str().unwrap().replace(":8000", ":9000");
            let o = r.as_object_mut().unwrap();
            o.remove("feed_cluster");
            o.insert("feed_address".into(), json!(feed));
        }
    }
    Proxy::new(
        module(),
        ProxyOptions::new(HostMode::Nginx, cfg.to_string()),
    )
}

/// One request as ngx_wasm_module hands it over: headers without end of stream, then the whole
/// body; the stream as the filter left it.
fn send_nginx(w: &mut WorkerVm, body: &str) -> kvsteer_host_test::StreamState {
    let id = w.new_stream().unwrap();
    w.request_headers(
        id,
        request_headers("/v1/completions", body.len(), None, &[]),
        false,
    )
    .unwrap();
    w.request_body(id, body.as_bytes(), true).unwrap();
    w.end_stream(id).unwrap()
}

/// nginx mode (ngx_wasm_module's phases: headers let through, the body handed over whole, the
/// choice written to a variable, callouts to addresses): each model's choice is its pool's, and an
/// unknown model is answered by the filter.
#[test]
fn nginx_mode_routes_each_model_in_its_pool() {
    let p = nginx_proxy(gateway(Some("chat")));
    let mut w = p.start_worker().unwrap();
    for (i, (model, net)) in [("llama-8b", "10.0.0."), ("llama-70b", "10.0.1.")]
        .iter()
        .cycle()
        .take(8)
        .enumerate()
    {
        let st = send_nginx(&mut w, &completion(model, i as u32));
        let var = st
            .properties
            .get(&vec!["ngx".to_string(), "kvsteer_upstream".to_string()])
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .expect("the variable set");
        assert!(var.starts_with(net), "{model} -> {var}");
    }
    let st = send_nginx(&mut w, &completion("gpt-4", 1));
    assert_eq!(st.local_response.map(|l| l.status), Some(404));
    assert!(st.properties.is_empty(), "{:?}", st.properties);
}

/// nginx mode keeps the connection of a callout answered while another of the VM's is out, so the
/// filter sends one callout a tick and none while one is out: with pools that bound is the VM's,
/// not each pool's (a worker polling both pools' feeds kept half its connections and ran out of
/// `worker_connections` in a real nginx). Every feed is still polled, in turn.
#[test]
fn nginx_mode_sends_one_callout_at_a_time_across_pools() {
    use kvsteer_core::feed::{FEED_CONTENT_TYPE, FeedBatch, FeedQuery, ReplicaLoad};
    let mut cfg = gateway(Some("chat"));
    cfg["feed_period_ms"] = json!(200);
    let p = nginx_proxy(cfg);
    let mut w = p.start_worker().unwrap();
    let mut polls: std::collections::BTreeMap<String, u32> = Default::default();
    for tick in 1..=300u64 {
        p.set_now_ns(tick * 100_000_000);
        w.tick().unwrap();
        let calls = w.take_callouts();
        assert!(calls.len() <= 1, "tick {tick}: {} callouts", calls.len());
        for c in &calls {
            *polls.entry(c.upstream.clone()).or_default() += 1;
            let q = c
                .header(":path")
                .and_then(|p| p.split_once('?'))
                .map(|(_, q)| FeedQuery::parse(q).unwrap())
                .unwrap();
            let batch = FeedBatch {
                epoch: 1,
                resync: q.epoch != 1,
                more: false,
                first_seq: q.cursor,
                next_seq: q.cursor,
                load: ReplicaLoad {
                    block_size: 16,
                    kv_total_blocks: 1 << 16,
                    ..Default::default()
                },
                events: Vec::new(),
            };
            w.answer_callout(
                c,
                kvsteer_host_test::CallOutcome::ok(200, FEED_CONTENT_TYPE, batch.encode()),
            )
            .unwrap();
        }
        let c = w.callout_connections();
        assert!(c.open <= 1 && c.refused == 0, "tick {tick}: {c:?}");
    }
    // 30 s: each of the 4 feeds polled in turn, about once every 400 ms.
    assert_eq!(polls.len(), 4, "{polls:?}");
    assert!(polls.values().all(|&n| n >= 60), "{polls:?}");
}
