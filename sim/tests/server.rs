//! The server over real sockets: streamed and non-streamed round trips, cached tokens, the feed,
//! faults, bad input, and clients that leave. Its other roles (the peer routers' endpoints, data
//! parallel ranks, P/D legs, adapters) are in `server_roles.rs`.

mod common;
use common::*;
use kvsteer_core::feed::{FeedBatch, FeedCursor};
use kvsteer_sim::engine::EngineConfig;
use kvsteer_sim::server::{Replica, ReplicaConfig, start_replicas};
use serde_json::{Value, json};
use std::io::Read;
use std::net::TcpStream;
use std::time::Duration;

#[test]
fn non_streamed_round_trip_and_cached_tokens_on_keep_alive() {
    let rep = replica(2000);
    let mut c = Client::new(&rep);
    let mut a = ids(1, 200);
    a.extend(ids(2, 30));
    let r = c.post(
        "/v1/completions",
        &json!({"model": "m", "prompt": a, "max_tokens": 5, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("x-kvsteer-replica"), Some("t0"));
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "m");
    assert_eq!(v["usage"]["prompt_tokens"], 230);
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        v["choices"][0]["text"].as_str().unwrap().split(' ').count(),
        6
    );
    // Same connection, same 200-token prefix: 12 full blocks of 16 are shared.
    let mut b = ids(1, 200);
    b.extend(ids(3, 30));
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": b, "max_tokens": 2, "return_token_ids": true}),
    );
    let v = r.json();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 192);
    assert!(v["choices"][0]["token_ids"].as_array().unwrap().len() <= 2);
    // Chat, text prompt.
    let r = c.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3,
            "ignore_eos": true}),
    );
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[test]
fn streamed_round_trip_ends_with_usage_and_done() {
    let rep = replica(2000);
    let mut c = Client::new(&rep);
    for path in ["/v1/completions", "/v1/chat/completions"] {
        let body = if path == "/v1/completions" {
            json!({"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 4,
                "ignore_eos": true, "stream": true})
        } else {
            json!({"messages": [{"role": "user", "content": "The quick brown fox"}],
                "max_tokens": 4, "ignore_eos": true, "stream": true,
                "stream_options": {"include_usage": true}})
        };
        let r = c.post(path, &body);
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("text/event-stream"));
        let text = String::from_utf8(r.body).unwrap();
        let events: Vec<&str> = text
            .split("\n\n")
            .filter(|e| !e.is_empty())
            .map(|e| e.strip_prefix("data: ").expect("SSE data line"))
            .collect();
        assert_eq!(*events.last().unwrap(), "[DONE]");
        let usage: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
        assert_eq!(usage["usage"]["completion_tokens"], 4);
        assert!(usage["choices"].as_array().unwrap().is_empty());
        let fin: Value = serde_json::from_str(events[events.len() - 3]).unwrap();
        assert_eq!(fin["choices"][0]["finish_reason"], "length");
        let content = events
            .iter()
            .filter(|e| **e != "[DONE]")
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter(|v| {
                let ch = &v["choices"][0];
                ch["text"].as_str().is_some_and(|t| !t.is_empty())
                    || ch["delta"]["content"]
                        .as_str()
                        .is_some_and(|t| !t.is_empty())
            })
            .count();
        assert_eq!(content, 4, "{path}");
    }
}

#[test]
fn bad_input_gets_openai_errors_and_the_server_survives() {
    let rep = replica(2000);
    let mut c = Client::new(&rep);
    let cases: Vec<(&str, &str, &str, u16)> = vec![
        ("POST", "/v1/completions", "{not json", 400),
        ("POST", "/v1/completions", "[1,2]", 400),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": "many"}"#,
            400,
        ),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "x", "stream": 1}"#,
            400,
        ),
        ("POST", "/v1/completions", r#"{"prompt": [[1],[2]]}"#, 400),
        ("POST", "/v1/completions", r#"{"prompt": [1, -2]}"#, 400),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "x", "max_tokens": 0}"#,
            400,
        ),
        ("POST", "/v1/chat/completions", r#"{"messages": []}"#, 400),
        (
            "POST",
            "/v1/chat/completions",
            r#"{"messages": [{"content": "x"}]}"#,
            400,
        ),
        ("GET", "/v1/completions", "", 405),
        ("GET", "/no/such/path", "", 404),
        ("GET", "/kvsteer/feed?epoch=abc", "", 400),
        ("POST", "/admin/fault", r#"{"slowdown": -1}"#, 400),
        ("POST", "/admin/fault", r#"{"explode": true}"#, 400),
    ];
    for (m, p, b, want) in cases {
        let r = c.call(m, p, b);
        assert_eq!(r.status, want, "{m} {p} {b}");
        let v = r.json();
        assert!(v["error"]["message"].is_string(), "{m} {p} {b}");
        assert_eq!(v["error"]["code"], want);
    }
    // Longer than the context limit (4096).
    let long = "abcd".repeat(5000);
    let r = c.post("/v1/completions", &json!({"prompt": long}));
    assert_eq!(r.status, 400);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("context length")
    );
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": "abcd".repeat(4000), "max_tokens": 200}),
    );
    assert_eq!(r.status, 400);
    // Oversized body: refused from the header, connection closed.
    let mut c2 = Client::new(&rep);
    let r = c2.raw(b"POST /v1/completions HTTP/1.1\r\ncontent-length: 99999999\r\n\r\n");
    assert_eq!(r.status, 413);
    let mut c3 = Client::new(&rep);
    let r = c3.raw(b"GARBAGE\r\n\r\n");
    assert_eq!(r.status, 400);
    // Still serving.
    let r = c.post("/v1/completions", &json!({"prompt": "ok", "max_tokens": 1}));
    assert_eq!(r.status, 200);
    assert_eq!(c.call("GET", "/health", "").status, 200);
}

#[test]
fn feed_serves_snapshots_increments_outages_and_restarts() {
    let rep = replica(2000);
    let mut c = Client::new(&rep);
    let mut cursor = FeedCursor::default();
    let poll = |c: &mut Client, cursor: &mut FeedCursor| {
        let r = c.call("GET", &cursor.query(4096).to_path(), "");
        assert_eq!(r.status, 200);
        assert_eq!(r.header("content-type"), Some("application/x-kvsteer-feed"));
        let b = FeedBatch::decode(&r.body).expect("valid feed batch");
        cursor.accept(&b);
        b
    };
    let first = poll(&mut c, &mut cursor);
    assert!(first.resync);
    assert_eq!(first.load.kv_total_blocks, 2000);
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": ids(5, 64), "max_tokens": 1}),
    );
    assert_eq!(r.status, 200);
    let inc = poll(&mut c, &mut cursor);
    assert!(!inc.resync);
    let stored: usize = inc
        .events
        .iter()
        .map(|e| match e {
            kvsteer_core::feed::FeedEvent::Stored { hashes, .. } => hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(stored, 4);
    let r = c.post("/admin/fault", &json!({"feed_outage": true}));
    assert_eq!(r.status, 200);
    assert_eq!(c.call("GET", "/kvsteer/feed", "").status, 503);
    c.post(
        "/admin/fault",
        &json!({"feed_outage": false, "restart": true}),
    );
    let after = poll(&mut c, &mut cursor);
    assert!(after.resync, "a restart changes the epoch");
    assert_ne!(after.epoch, first.epoch);
    assert_eq!(after.events, vec![kvsteer_core::feed::FeedEvent::Cleared]);
    let m = String::from_utf8(c.call("GET", "/metrics", "").body).unwrap();
    for name in [
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"2000\"",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_count",
    ] {
        assert!(m.contains(name), "{name} missing");
    }
}

#[test]
fn a_client_that_leaves_mid_stream_does_not_leak_its_request() {
    let rep = replica(2000);
    {
        let mut s = TcpStream::connect(rep.addr()).unwrap();
        post_raw(
            &mut s,
            &json!({"prompt": "go on", "max_tokens": 3000, "ignore_eos": true, "stream": true}),
        );
        let mut buf = [0u8; 512];
        let _ = s.read(&mut buf).unwrap();
    }
    let mut c = Client::new(&rep);
    assert_eq!(
        running_after_abort(&mut c, 200),
        0.0,
        "the abandoned request was aborted"
    );
}

#[test]
fn several_replicas_start_from_one_call_and_name_themselves() {
    let base = ReplicaConfig {
        name: String::new(),
        host: "127.0.0.1".into(),
        port: 0,
        time_scale: 50.0,
        model: "sim".into(),
        engine: EngineConfig {
            kv_blocks: 500,
            ..Default::default()
        },
        dp_ranks: 1,
    };
    let reps = start_replicas(&base, 3, "rep").unwrap();
    for (i, r) in reps.iter().enumerate() {
        let mut c = Client::new(r);
        let resp = c.call("GET", "/health", "");
        assert_eq!(
            resp.header("x-kvsteer-replica"),
            Some(format!("rep{i}").as_str())
        );
    }
}

#[test]
fn a_non_streamed_client_that_gives_up_does_not_leak_its_request() {
    // Slow enough that the request cannot finish before the server notices.
    let rep = replica_at(2000, 2.0);
    {
        let mut s = TcpStream::connect(rep.addr()).unwrap();
        post_raw(
            &mut s,
            &json!({"prompt": "wait for me", "max_tokens": 3000, "ignore_eos": true}),
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut c = Client::new(&rep);
    assert_eq!(
        running_after_abort(&mut c, 100),
        0.0,
        "the abandoned request was aborted"
    );
    let m = String::from_utf8(c.call("GET", "/metrics", "").body).unwrap();
    assert!(m.contains("finished_reason=\"abort\"} 1"), "{m}");
}

#[test]
fn a_queued_streaming_client_that_leaves_is_dropped_from_the_queue() {
    let rep = Replica::start(ReplicaConfig {
        name: "q0".into(),
        host: "127.0.0.1".into(),
        port: 0,
        time_scale: 2.0,
        model: "sim".into(),
        engine: EngineConfig {
            kv_blocks: 2000,
            max_running: 1,
            max_model_len: 4096,
            ..Default::default()
        },
        dp_ranks: 1,
    })
    .unwrap();
    let send = |s: &mut TcpStream| {
        post_raw(
            s,
            &json!({"prompt": "long one", "max_tokens": 3000, "ignore_eos": true, "stream": true}),
        );
    };
    let mut holder = TcpStream::connect(rep.addr()).unwrap();
    send(&mut holder);
    std::thread::sleep(Duration::from_millis(50));
    {
        let mut leaver = TcpStream::connect(rep.addr()).unwrap();
        send(&mut leaver);
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut c = Client::new(&rep);
    let gauge = |m: &str, name: &str| -> f64 {
        m.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap()
    };
    let mut waiting = 1.0;
    for _ in 0..100 {
        let m = String::from_utf8(c.call("GET", "/metrics", "").body).unwrap();
        waiting = gauge(&m, "vllm:num_requests_waiting{");
        if waiting == 0.0 {
            assert_eq!(gauge(&m, "vllm:num_requests_running{"), 1.0);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        waiting, 0.0,
        "the queued request of the client that left was aborted"
    );
    drop(holder);
}

#[test]
fn admin_stalls_lists_the_stalls_that_held_a_step_on_the_wall_clock() {
    let calm = replica(2000);
    let v = Client::new(&calm).call("GET", "/admin/stalls", "").json();
    assert_eq!(v["ranks"], json!([[]]));
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as f64;
    let started = v["clock_start_unix_us"].as_f64().unwrap();
    assert!((now_us - started).abs() < 60e6, "{started} vs {now_us}");
    assert_eq!(v["time_scale"], 50.0);

    // A 50 ms stall after gaps of about 1 ms of engine time: a busy engine meets several.
    let rep = replica_with_engine(
        EngineConfig {
            kv_blocks: 2000,
            max_model_len: 4096,
            stall: kvsteer_sim::stall::StallConfig {
                mean_gap_us: 1_000,
                len_us: 50_000,
                seed: 0,
            },
            ..Default::default()
        },
        50.0,
    );
    let mut c = Client::new(&rep);
    let r = c.post(
        "/v1/completions",
        &json!({"prompt": ids(1, 2000), "max_tokens": 8, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200);
    let v = c.call("GET", "/admin/stalls", "").json();
    let held = v["ranks"][0].as_array().expect("one rank");
    assert!(!held.is_empty(), "{v}");
    for w in held {
        let (from, end) = (w[0].as_u64().unwrap(), w[1].as_u64().unwrap());
        assert!(from < end && end - from <= 50_000, "{w}");
    }
}
