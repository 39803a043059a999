//! The P/D fleet these tests drive: a proxy with one worker VM in front of prefill and decode
//! engines, the filter's prefill callouts answered from the engine they name and the decode legs
//! submitted with remote KV, every request's legs recorded and its load checked released.

use crate::common::*;
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FEED_PATH, FeedQuery};
use kvsteer_core::load::LoadTotals;
use kvsteer_core::record::Record;
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{CallOutcome, Callout, HostMode, Proxy, ProxyOptions, WorkerVm, pairs};
use kvsteer_sim::kv_link::KvLink;
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest};
use serde_json::{Value, json};

pub(crate) const DEST: &str = "x-gateway-destination-endpoint";
pub(crate) const PREFILL: usize = 2;
pub(crate) const REPLICAS: usize = 4;

pub(crate) fn plugin_config(policy: &str, extra: Value) -> String {
    let replicas: Vec<Value> = (0..REPLICAS)
        .map(|i| {
            let mut r = json!({"name": format!("r{i}"), "endpoint": format!("127.0.0.1:{}", 18000 + i),
                "feed_cluster": format!("kvsteer_feed_r{i}")});
            if i < PREFILL {
                r["role"] = json!("prefill");
                r["prefill_cluster"] = json!(format!("prefill_r{i}"));
            } else {
                r["role"] = json!("decode");
            }
            r
        })
        .collect();
    let mut cfg = json!({"replicas": replicas, "routing": {"policy": policy, "block_size": 16},
        "feed_period_ms": 100, "tick_ms": 50, "pd": {"prefill_timeout_ms": 5000,
        "max_prefill_response_bytes": 4096}});
    if let (Value::Object(c), Value::Object(e)) = (&mut cfg, extra) {
        c.extend(e);
    }
    cfg.to_string()
}

/// The replica of a destination header's first entry (`IP:port[,IP:port]`).
pub(crate) fn endpoint_index(e: &str) -> usize {
    let first = e.split(',').next().unwrap();
    let port: usize = first.rsplit(':').next().unwrap().parse().unwrap();
    port - 18000
}

pub(crate) struct Fleet {
    pub(crate) proxy: Proxy,
    pub(crate) w: WorkerVm,
    pub(crate) engines: Vec<Engine>,
    pub(crate) now_us: u64,
    /// Feeds answered with a reset instead of the engine's batch (the replica unreachable).
    pub(crate) unreachable: Vec<bool>,
}

/// What one request through the fleet did.
#[derive(Debug)]
pub(crate) struct Served {
    pub(crate) prefill: usize,
    pub(crate) decode: usize,
    pub(crate) prefill_cached: u32,
    pub(crate) transferred: u64,
}

impl Fleet {
    pub(crate) fn new(options: ProxyOptions) -> Fleet {
        let proxy = Proxy::new(module(), options);
        let w = proxy.start_worker().expect("worker");
        let engines = (0..REPLICAS)
            .map(|i| Engine::new(EngineConfig::default().for_replica(i)))
            .collect();
        let mut f = Fleet {
            proxy,
            w,
            engines,
            now_us: 0,
            unreachable: vec![false; REPLICAS],
        };
        f.poll_feeds();
        f
    }

    pub(crate) fn with(policy: &str) -> Fleet {
        Fleet::new(ProxyOptions::new(
            HostMode::Envoy,
            plugin_config(policy, json!({})),
        ))
    }

    pub(crate) fn advance(&mut self, us: u64) {
        self.now_us += us;
        self.proxy.set_now_ns(self.now_us * 1000);
        let mut ev = Vec::new();
        for e in &mut self.engines {
            e.advance(self.now_us, &mut ev);
        }
    }

    /// Two ticks 150 ms apart, every feed poll answered from its engine: the filter's index and load
    /// views follow the engines.
    pub(crate) fn poll_feeds(&mut self) {
        for _ in 0..2 {
            self.tick(150_000);
        }
    }

    /// Moves time on by `us` and ticks, answering the feed polls the tick sends.
    pub(crate) fn tick(&mut self, us: u64) {
        self.advance(us);
        self.w.tick().expect("tick");
        {
            for call in self.w.take_callouts() {
                let r = call
                    .upstream
                    .strip_prefix("kvsteer_feed_r")
                    .and_then(|s| s.parse::<usize>().ok())
                    .expect("only feed polls outside a request");
                let outcome = if self.unreachable[r] {
                    CallOutcome::Reset
                } else {
                    let path = call.header(":path").unwrap_or("").to_string();
                    let (p, q) = path.split_once('?').unwrap_or((&path, ""));
                    assert!(p.ends_with(FEED_PATH));
                    let q = FeedQuery::parse(q).unwrap();
                    CallOutcome::ok(200, FEED_CONTENT_TYPE, self.engines[r].feed(&q).encode())
                };
                self.w.answer_callout(&call, outcome).expect("feed answer");
            }
        }
    }

    /// Sends a client request up to the end of its body; returns the stream and the prefill
    /// callout the filter dispatched (None when it dispatched none).
    pub(crate) fn send(
        &mut self,
        body: &Value,
        extra: &[(String, String)],
    ) -> (u32, Option<Callout>) {
        let bytes = body.to_string().into_bytes();
        let id = self.w.new_stream().unwrap();
        self.w
            .request_headers(
                id,
                request_headers("/v1/completions", bytes.len(), None, extra),
                false,
            )
            .unwrap();
        self.w.request_body(id, &bytes, true).unwrap();
        let calls = self.w.take_callouts();
        assert!(calls.len() <= 1, "{calls:?}");
        (id, calls.into_iter().next())
    }

    /// Asserts that stream `id` was released to a decode replica, not answered by the filter;
    /// returns the body that replica received.
    pub(crate) fn released_to_decode(&self, id: u32) -> &[u8] {
        let st = self.w.stream(id).unwrap();
        assert!(st.released && st.local_response.is_none());
        assert!(endpoint_index(st.upstream_header(DEST).unwrap()) >= PREFILL);
        &st.upstream_body
    }

    /// Ends stream `id` with its upstream's answer: headers only, with `status`.
    pub(crate) fn finish(&mut self, id: u32, status: &str) {
        self.w
            .response_headers(id, pairs(&[(":status", status)]), true)
            .unwrap();
        self.w.end_stream(id).unwrap();
    }

    /// Runs engine `e` until request `id` finishes; its cached prompt tokens and output length.
    pub(crate) fn run_to_end(&mut self, e: usize, id: u64) -> (u32, u32) {
        let mut ev = Vec::new();
        loop {
            let next = self.engines[e]
                .next_event_time()
                .expect("the engine has work");
            self.engines[e].advance(next, &mut ev);
            for x in ev.drain(..) {
                if let EngineEvent::Finished {
                    id: i,
                    cached_tokens,
                    completion_tokens,
                    ..
                } = x
                    && i == id
                {
                    return (cached_tokens, completion_tokens);
                }
            }
        }
    }

    /// Plays the prefill engine: checks the leg is vLLM's prefill request, runs it as a 1-token
    /// request, answers as the NIXL producer does. Returns the answer and the cached prompt tokens.
    pub(crate) fn prefill_answer(&mut self, call: &Callout, rid: u64) -> (CallOutcome, usize, u32) {
        let p = call
            .upstream
            .strip_prefix("prefill_r")
            .and_then(|s| s.parse::<usize>().ok())
            .expect("a prefill cluster");
        assert!(p < PREFILL, "the prefill leg went to a prefill replica");
        assert_eq!(call.header(":method"), Some("POST"));
        assert_eq!(call.header(":path"), Some("/v1/completions"));
        assert_eq!(call.header(":authority").map(endpoint_index), Some(p));
        assert_eq!(call.header("content-type"), Some("application/json"));
        assert_eq!(call.timeout_ms, 5000);
        let body: Value = serde_json::from_slice(&call.body).unwrap();
        assert_eq!(
            call.header("content-length"),
            Some(call.body.len().to_string().as_str())
        );
        assert_eq!(body["stream"], json!(false));
        assert_eq!(body["max_tokens"], json!(1));
        assert!(body.get("stream_options").is_none());
        assert_eq!(body["kv_transfer_params"]["do_remote_decode"], json!(true));
        let prompt: Vec<u32> = serde_json::from_value(body["prompt"].clone()).unwrap();
        let now = self.engines[p].now_us();
        self.engines[p]
            .submit(
                now,
                EngineRequest {
                    id: rid,
                    prompt: prompt.clone(),
                    max_tokens: 1,
                    ignore_eos: true,
                    min_tokens: 0,
                },
            )
            .unwrap();
        let (cached, out) = self.run_to_end(p, rid);
        assert_eq!(out, 1);
        let blocks: Vec<usize> = (0..prompt.len() / 16).collect();
        let answer = json!({"id": format!("cmpl-{rid}"), "object": "text_completion",
            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
            "kv_transfer_params": {"do_remote_prefill": true, "do_remote_decode": false,
                "remote_block_ids": blocks, "remote_engine_id": format!("r{p}"),
                "remote_request_id": call.header("x-request-id"), "remote_host": null,
                "remote_port": null, "tp_size": 1}});
        (
            CallOutcome::ok(200, "application/json", answer.to_string().into_bytes()),
            p,
            cached,
        )
    }

    /// One whole P/D request: prefill leg on its engine, decode leg with remote KV on the engine the
    /// destination names, the answer back through the filter, the stream ended.
    pub(crate) fn serve(&mut self, prompt: &[u32], rid: u64) -> Served {
        let body = json!({"prompt": prompt, "max_tokens": 8, "stream": true,
            "stream_options": {"include_usage": true}, "kv_transfer_params": {"remote_host": "10.6.6.6"}});
        // A client naming a replica itself: never obeyed.
        let spoof = [(DEST.to_string(), "127.0.0.1:18000".to_string())];
        let (id, call) = self.send(&body, &spoof);
        let call = call.expect("a prefill callout");
        let st = self.w.stream(id).unwrap();
        assert!(!st.released, "held while the prefill leg is out");
        let (answer, prefill, prefill_cached) = self.prefill_answer(&call, rid);
        let sent_params: Value = match &answer {
            CallOutcome::Response { body, .. } => {
                serde_json::from_slice::<Value>(body).unwrap()["kv_transfer_params"].clone()
            }
            CallOutcome::Reset => unreachable!(),
        };
        self.w.answer_callout(&call, answer).unwrap();
        let st = self.w.stream(id).unwrap();
        assert!(st.local_response.is_none(), "{:?}", st.local_response);
        assert!(st.resumed_by_filter && st.released);
        let dest = st.upstream_header(DEST).expect("destination");
        let decode = endpoint_index(dest.split(',').next().unwrap());
        assert!(
            decode >= PREFILL,
            "the decode leg went to a decode replica: {dest}"
        );
        if let Some(b) = dest.split(',').nth(1) {
            assert!(
                endpoint_index(b) >= PREFILL,
                "retry backup on the decode side: {dest}"
            );
        }
        assert_eq!(
            st.upstream_header("x-request-id"),
            call.header("x-request-id"),
            "both legs carry one request id"
        );
        let up: Value = serde_json::from_slice(&st.upstream_body).unwrap();
        assert_eq!(
            st.upstream_header("content-length"),
            Some(st.upstream_body.len().to_string().as_str())
        );
        assert_eq!(
            up["kv_transfer_params"], sent_params,
            "the answer's object verbatim"
        );
        assert_eq!(up["stream"], json!(true));
        assert_eq!(up["max_tokens"], json!(8));
        assert_eq!(up["stream_options"], json!({"include_usage": true}));
        assert_eq!(up["kv_transfer_params"]["do_remote_prefill"], json!(true));
        let now = self.engines[decode].now_us();
        let transferred = self.engines[decode]
            .submit_remote(
                now,
                EngineRequest {
                    id: rid,
                    prompt: prompt.to_vec(),
                    max_tokens: 8,
                    ignore_eos: true,
                    min_tokens: 0,
                },
                &KvLink::default(),
            )
            .unwrap();
        let (_, out) = self.run_to_end(decode, rid);
        assert_eq!(out, 8);
        let answer = json!({"choices": [{"text": "12345678", "finish_reason": "length"}]});
        self.w
            .response_headers(
                id,
                pairs(&[(":status", "200"), ("content-type", "application/json")]),
                false,
            )
            .unwrap();
        self.w
            .response_body(id, answer.to_string().as_bytes(), true)
            .unwrap();
        self.w.end_stream(id).unwrap();
        Served {
            prefill,
            decode,
            prefill_cached,
            transferred,
        }
    }

    /// The filter's bookings per replica, as it published them at a tick it is given now.
    pub(crate) fn loads(&mut self) -> Vec<LoadTotals> {
        self.tick(60_000);
        let (bytes, _) = self
            .proxy
            .shared_data(b"kvsteer:load:0")
            .expect("the filter publishes its load");
        LoadTotals::decode_front(&bytes[8..]).unwrap().0
    }

    /// Requests the filter has booked, all replicas together.
    pub(crate) fn booked(&mut self) -> u64 {
        self.loads().iter().map(|t| t.active_requests as u64).sum()
    }

    pub(crate) fn counter(&self, name: &str) -> u64 {
        self.proxy.metric(name).map_or(0, |m| m.value as u64)
    }

    pub(crate) fn assert_clean(&mut self) {
        // Every booking released, as the metrics say (they follow at the next tick).
        self.tick(60_000);
        assert_eq!(
            self.counter("kvsteer_bookings"),
            self.counter("kvsteer_releases")
        );
        assert!(!self.w.is_dead(), "the worker trapped");
        assert!(
            self.w.notes().is_empty(),
            "ABI misuse: {:?}",
            self.w.notes()
        );
        assert_eq!(self.counter("kvsteer_release_anomalies"), 0);
        assert_eq!(self.w.log_counts()[5], 0, "critical: {:?}", self.w.logs());
    }
}
