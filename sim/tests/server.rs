//! The server over real sockets: streamed and non-streamed round trips, cached tokens, the feed,
//! faults, and bad input.

use kvsteer_core::feed::{FeedBatch, FeedCursor};
use kvsteer_sim::engine::EngineConfig;
use kvsteer_sim::server::{Replica, ReplicaConfig, start_replicas};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

fn replica(kv_blocks: u32) -> Replica {
    replica_at(kv_blocks, 50.0)
}

fn replica_at(kv_blocks: u32, time_scale: f64) -> Replica {
    let cfg = ReplicaConfig {
        name: "t0".into(),
        host: "127.0.0.1".into(),
        port: 0,
        time_scale,
        model: "sim".into(),
        engine: EngineConfig {
            kv_blocks,
            max_model_len: 4096,
            ..Default::default()
        },
        dp_ranks: 1,
    };
    Replica::start(cfg).expect("replica starts")
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

fn read_resp(r: &mut BufReader<TcpStream>) -> Resp {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').unwrap();
        headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let mut body = Vec::new();
    let get = |k: &str| headers.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    if get("transfer-encoding").as_deref() == Some("chunked") {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).unwrap();
            let n = usize::from_str_radix(size.trim(), 16).unwrap();
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).unwrap();
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        let n: usize = get("content-length").unwrap().parse().unwrap();
        body = vec![0; n];
        r.read_exact(&mut body).unwrap();
    }
    Resp {
        status,
        headers,
        body,
    }
}

struct Client {
    r: BufReader<TcpStream>,
}

impl Client {
    fn new(rep: &Replica) -> Client {
        let s = TcpStream::connect(rep.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Client {
            r: BufReader::new(s),
        }
    }
    fn raw(&mut self, bytes: &[u8]) -> Resp {
        self.r.get_mut().write_all(bytes).unwrap();
        read_resp(&mut self.r)
    }
    fn call(&mut self, method: &str, path: &str, body: &str) -> Resp {
        let req = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        self.raw(req.as_bytes())
    }
    fn post(&mut self, path: &str, v: &Value) -> Resp {
        self.call("POST", path, &v.to_string())
    }
}

fn ids(tag: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| tag * 10_000 + i).collect()
}

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
        let body = json!({"prompt": "go on", "max_tokens": 3000, "ignore_eos": true,
            "stream": true})
        .to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut buf = [0u8; 512];
        let _ = s.read(&mut buf).unwrap();
    }
    let mut c = Client::new(&rep);
    let mut running = 1.0;
    for _ in 0..200 {
        let m = String::from_utf8(c.call("GET", "/metrics", "").body).unwrap();
        running = m
            .lines()
            .find(|l| l.starts_with("vllm:num_requests_running{"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap();
        if running == 0.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(running, 0.0, "the abandoned request was aborted");
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
        let body =
            json!({"prompt": "wait for me", "max_tokens": 3000, "ignore_eos": true}).to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut c = Client::new(&rep);
    let mut running = 1.0;
    for _ in 0..100 {
        let m = String::from_utf8(c.call("GET", "/metrics", "").body).unwrap();
        running = m
            .lines()
            .find(|l| l.starts_with("vllm:num_requests_running{"))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap();
        if running == 0.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(running, 0.0, "the abandoned request was aborted");
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
        let body = json!({"prompt": "long one", "max_tokens": 3000, "ignore_eos": true,
            "stream": true})
        .to_string();
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
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
fn peer_router_endpoints_tokenize_render_and_report_load() {
    let rep = replica(2000);
    let mut c = Client::new(&rep);
    // Text and token-id prompts tokenize to what generation computes.
    let r = c.post(
        "/tokenize",
        &json!({"model": "m", "prompt": "hello world, again"}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    let tokens = v["tokens"].as_array().unwrap().clone();
    assert!(!tokens.is_empty());
    assert_eq!(v["count"], tokens.len());
    assert_eq!(v["max_model_len"], 4096);
    let g = c.post(
        "/v1/completions",
        &json!({"prompt": "hello world, again", "max_tokens": 1}),
    );
    assert_eq!(g.json()["usage"]["prompt_tokens"], tokens.len());
    let r = c.post("/tokenize", &json!({"prompt": [5, 6, 7]}));
    assert_eq!(r.json()["tokens"], json!([5, 6, 7]));
    let chat = json!({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3});
    let r = c.post("/tokenize", &chat);
    assert_eq!(r.status, 200);
    let chat_ids = r.json()["tokens"].clone();

    // Render: a list of one token-in request for completions, the object itself for chat.
    let r = c.post(
        "/v1/completions/render",
        &json!({"model": "m", "prompt": "hello world, again", "max_tokens": 9}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v.as_array().unwrap().len(), 1);
    assert_eq!(v[0]["token_ids"], json!(tokens));
    assert_eq!(v[0]["model"], "m");
    assert_eq!(v[0]["sampling_params"]["max_tokens"], 9);
    assert!(v[0]["request_id"].as_str().unwrap().starts_with("cmpl-"));
    let r = c.post("/v1/chat/completions/render", &chat);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["token_ids"], chat_ids);
    assert_eq!(r.json()["model"], "sim");

    // Bad input gets an OpenAI error; the wrong method a 405.
    assert_eq!(c.post("/tokenize", &json!({"prompt": 3})).status, 400);
    assert_eq!(c.call("POST", "/v1/completions/render", "[1]").status, 400);
    assert_eq!(c.call("GET", "/tokenize", "").status, 405);
    assert_eq!(c.call("POST", "/get_load", "").status, 405);

    // SGLang's discovery endpoints, new and old names.
    for path in ["/server_info", "/get_server_info"] {
        let r = c.call("GET", path, "");
        assert_eq!(r.status, 200, "{path}");
        let v = r.json();
        assert_eq!(v["served_model_name"], "sim");
        assert_eq!(v["dp_size"], 1);
        assert!(v["max_total_tokens"].as_u64().unwrap() > 0);
        assert!(v.get("model_path").is_none());
    }
    for path in ["/model_info", "/get_model_info"] {
        let r = c.call("GET", path, "");
        assert_eq!(r.status, 200, "{path}");
        assert_eq!(r.json()["is_generation"], true);
        assert_eq!(r.json()["tokenizer_path"], Value::Null);
    }

    // Load: idle, then with a long request decoding.
    let r = c.call("GET", "/get_load", "");
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v[0]["dp_rank"], 0);
    assert_eq!(v[0]["num_reqs"], 0);
    assert_eq!(v[0]["num_tokens"], 0);
    let mut busy = Client::new(&rep);
    let body = json!({"prompt": ids(7, 320), "max_tokens": 2000, "ignore_eos": true,
        "stream": true})
    .to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    busy.r.get_mut().write_all(req.as_bytes()).unwrap();
    let mut seen = Value::Null;
    for _ in 0..200 {
        seen = c.call("GET", "/get_load", "").json();
        if seen[0]["num_reqs"] == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(seen[0]["num_reqs"], 1, "{seen}");
    assert!(seen[0]["num_tokens"].as_u64().unwrap() >= 320, "{seen}");
}

/// `dp_ranks: 2`: the rank header picks the engine (its cache answers the repeat), each rank's feed
/// is its own and says so, a poll without a rank gets the union, an unknown rank is a 400; without a
/// header the balancer spreads requests over both ranks.
#[test]
fn dp_ranks_are_picked_by_header_and_fed_apart() {
    let rep = Replica::start(ReplicaConfig {
        name: "dp".into(),
        host: "127.0.0.1".into(),
        port: 0,
        // Real time: the balancer's load figures refresh every 100 ms of engine time, and it spreads
        // back-to-back requests only while they arrive within one period (its local increments).
        // At time scale 100 that period was 1 ms of wall time, shorter than one HTTP round trip on
        // a loaded CI machine, and every request then saw both ranks idle and went to rank 0.
        time_scale: 1.0,
        model: "sim".into(),
        engine: EngineConfig {
            kv_blocks: 1000,
            max_model_len: 4096,
            ..Default::default()
        },
        dp_ranks: 2,
    })
    .unwrap();
    let mut c = Client::new(&rep);
    let body = json!({"prompt": ids(7, 160), "max_tokens": 2, "ignore_eos": true}).to_string();
    let send = |c: &mut Client, rank: Option<u32>| {
        let extra = rank.map_or(String::new(), |r| format!("X-Data-Parallel-Rank: {r}\r\n"));
        let req = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\n{extra}content-length: {}\r\n\r\n{body}",
            body.len()
        );
        let r = c.raw(req.as_bytes());
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0)
    };
    assert_eq!(send(&mut c, Some(1)), 0);
    assert!(send(&mut c, Some(1)) >= 144, "rank 1 caches its own prefix");
    assert_eq!(
        send(&mut c, Some(0)),
        0,
        "rank 0 shares no cache with rank 1"
    );
    let snapshot = |c: &mut Client, q: &str| {
        let r = c.call("GET", &format!("/kvsteer/feed?epoch=0{q}"), "");
        (r.status, r.body)
    };
    let (status, b1) = snapshot(&mut c, "&rank=1");
    assert_eq!(status, 200);
    assert_eq!(kvsteer_core::feed::payload_rank(&b1), Some(1));
    let (_, b0) = snapshot(&mut c, "&rank=0");
    let (_, all) = snapshot(&mut c, "");
    let count = |b: &[u8]| -> usize {
        FeedBatch::decode(b)
            .unwrap()
            .events
            .iter()
            .map(|e| match e {
                kvsteer_core::feed::FeedEvent::Stored { hashes, .. } => hashes.len(),
                _ => 0,
            })
            .sum()
    };
    assert!(count(&b1) >= 10 && count(&b0) >= 10);
    assert_eq!(
        count(&all),
        count(&b1),
        "the same prompt on both ranks: the union holds it once"
    );
    assert_eq!(snapshot(&mut c, "&rank=2").0, 400);
    assert_eq!(snapshot(&mut c, "&rank=x").0, 400);
    // No header (or a value that is not a rank): vLLM's balancer spreads back-to-back requests.
    let load = c.call("GET", "/get_load", "");
    let v: Value = serde_json::from_slice(&load.body).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    let info: Value = serde_json::from_slice(&c.call("GET", "/server_info", "").body).unwrap();
    assert_eq!(info["dp_size"], 2);
    for _ in 0..4 {
        send(&mut c, None);
    }
    let served = |c: &mut Client, r: u32| {
        let m = String::from_utf8(c.call("GET", &format!("/metrics?rank={r}"), "").body).unwrap();
        m.lines()
            .filter(|l| l.starts_with("vllm:request_success_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    let (s0, s1) = (served(&mut c, 0), served(&mut c, 1));
    assert_eq!(s0 + s1, 7.0, "{s0} + {s1}");
    assert!(s0 >= 2.0 && s1 >= 3.0, "{s0} {s1}");
}

/// vLLM's P/D protocol over HTTP (docs/design/pd.md): a prefill leg asking for remote decode
/// answers with `kv_transfer_params` in the NIXL producer's shape; a decode leg carrying them reads
/// its prompt over the modelled link (counted in `/metrics`) instead of computing it, and caches
/// it; a request without the params gets none back; malformed params are refused.
#[test]
fn pd_legs_answer_and_honour_kv_transfer_params() {
    let (pre, dec) = (replica(4096), replica(4096));
    let (mut cp, mut cd) = (Client::new(&pre), Client::new(&dec));
    let prompt = ids(7, 1000);
    let r = cp.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1, "stream": false,
            "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                "remote_engine_id": null, "remote_block_ids": null,
                "remote_host": null, "remote_port": null}}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    let kv = v["kv_transfer_params"].clone();
    assert_eq!(kv["do_remote_prefill"], json!(true));
    assert_eq!(kv["do_remote_decode"], json!(false));
    assert_eq!(
        kv["remote_block_ids"].as_array().map(Vec::len),
        Some(1000 / 16)
    );
    assert!(kv["remote_engine_id"].is_string() && kv["remote_request_id"].is_string());
    assert_eq!(v["usage"]["completion_tokens"], json!(1));

    let r = cd.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "ignore_eos": true,
            "kv_transfer_params": kv}),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["usage"]["completion_tokens"], json!(8));
    assert!(v.get("kv_transfer_params").is_none());
    let m = String::from_utf8(cd.call("GET", "/metrics", "").body).unwrap();
    let read = m
        .lines()
        .find(|l| l.starts_with("kvsteer_sim:remote_prefill_tokens_total"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|x| x.parse::<u64>().ok());
    assert_eq!(read, Some(1000), "{m}");
    // The read blocks are in the decode replica's cache now: a plain repeat hits them.
    let r = cd.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(992)
    );
    // No params asked, none answered; malformed params refused, the server still serves.
    let r = cp.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 1}),
    );
    assert!(r.json().get("kv_transfer_params").is_none());
    for bad in [json!(3), json!({"do_remote_prefill": "yes"}), json!([true])] {
        let r = cd.post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": bad}),
        );
        assert_eq!(r.status, 400, "{bad}");
    }
    let r = cd.post("/v1/completions", &json!({"prompt": "ok", "max_tokens": 1}));
    assert_eq!(r.status, 200);
}

/// LoRA over HTTP: a request whose `model` is not the served name runs with that adapter, and the
/// feed carries the adapter section only to a poll that asks for it (`adapters=1`).
#[test]
fn the_feed_reports_adapters_only_when_asked() {
    use kvsteer_core::feed::FeedFrame;
    let cfg = ReplicaConfig {
        name: "t0".into(),
        host: "127.0.0.1".into(),
        port: 0,
        time_scale: 50.0,
        model: "sim".into(),
        engine: EngineConfig {
            kv_blocks: 2000,
            max_model_len: 4096,
            lora: kvsteer_sim::lora::LoraConfig {
                slots: 3,
                load_us: 1000,
            },
            ..Default::default()
        },
        dp_ranks: 1,
    };
    let rep = Replica::start(cfg).expect("replica starts");
    let mut c = Client::new(&rep);
    let adapters = |c: &mut Client, path: &str| {
        let r = c.call("GET", path, "");
        assert_eq!(r.status, 200);
        FeedFrame::parse(r.body).unwrap().adapters().cloned()
    };
    let asked = "/kvsteer/feed?epoch=0&adapters=1";
    let report = adapters(&mut c, asked).expect("a report when LoRA is on");
    assert_eq!(report.slots, 3);
    assert!(report.running.is_empty() && report.waiting.is_empty());
    assert_eq!(adapters(&mut c, "/kvsteer/feed?epoch=0"), None);
    for model in ["sim", "sql-lora"] {
        let r = c.post(
            "/v1/completions",
            &json!({"model": model, "prompt": ids(9, 64), "max_tokens": 1}),
        );
        assert_eq!(r.status, 200);
    }
    // The finished request's adapter is no longer running: only in flight counts, as in vLLM.
    let report = adapters(&mut c, asked).unwrap();
    assert!(report.running.is_empty(), "{report:?}");
}
