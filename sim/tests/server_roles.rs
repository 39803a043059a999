//! The server's roles beside a plain OpenAI replica, over real sockets: the peer routers'
//! endpoints (tokenize, render, load), data-parallel ranks picked by header and fed apart, P/D legs
//! and their `kv_transfer_params`, and adapters in the feed.

mod common;
use common::*;
use kvsteer_core::feed::FeedBatch;
use kvsteer_sim::engine::EngineConfig;
use kvsteer_sim::server::{Replica, ReplicaConfig};
use serde_json::{Value, json};
use std::io::Write;
use std::time::Duration;

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
    let rep = replica_with_engine(
        EngineConfig {
            kv_blocks: 2000,
            max_model_len: 4096,
            lora: kvsteer_sim::lora::LoraConfig {
                slots: 3,
                load_us: 1000,
            },
            ..Default::default()
        },
        50.0,
    );
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
