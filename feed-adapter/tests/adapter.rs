//! End to end inside one process: the adapter's server on 127.0.0.1, an in-process ZMQ PUB socket
//! publishing vLLM-shaped events (connecting to the adapter's SUB socket as vLLM does with an endpoint
//! without `*`), a ROUTER socket answering replay requests, a fake engine `/metrics`, and a plain HTTP
//! client polling `/kvsteer/feed`, decoded with `kvsteer_core::feed::FeedBatch::decode`.

use bytes::Bytes;
use clap::Parser;
use kvsteer_core::block::BlockHasher;
use kvsteer_core::feed::{FeedBatch, FeedEvent, FeedQuery, Tier};
use kvsteer_feed::config::Args;
use kvsteer_feed::encode::{Event, batch};
use kvsteer_feed::run::{Running, start};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BS: usize = 16;

/// A plain HTTP/1.1 GET: status and body.
async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, Vec<u8>) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let split = buf.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8_lossy(&buf[..split]).to_string();
    let status: u16 = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut body = buf[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    (status, body)
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let nl = b.windows(2).position(|w| w == b"\r\n").unwrap();
        let n = usize::from_str_radix(std::str::from_utf8(&b[..nl]).unwrap().trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.extend_from_slice(&b[nl + 2..nl + 2 + n]);
        b = &b[nl + 2 + n + 2..];
    }
}

async fn poll(r: &Running, q: FeedQuery) -> FeedBatch {
    let (status, body) = get(r.http_addr, &q.to_path()).await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    FeedBatch::decode(&body).expect("a valid KVSF batch")
}

async fn health(r: &Running) -> String {
    String::from_utf8(get(r.http_addr, "/health").await.1).unwrap()
}

struct Engine {
    pub_: PubSocket,
    seq: u64,
}

impl Engine {
    async fn send(&mut self, payload: Vec<u8>) {
        let mut m = ZmqMessage::from(Bytes::from_static(b"kv-events"));
        m.push_back(Bytes::copy_from_slice(&self.seq.to_be_bytes()));
        m.push_back(Bytes::from(payload));
        self.pub_.send(m).await.unwrap();
        self.seq += 1;
    }

    /// Publishes empty batches until the adapter has seen one (PUB/SUB drops messages until the
    /// subscription has reached the publisher).
    async fn warm_up(&mut self, r: &Running) {
        let t0 = Instant::now();
        loop {
            self.send(batch(0.0, &[], 0)).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            if !health(r).await.contains("\"applied_seq\":null") {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "no batch reached the adapter"
            );
        }
    }

    /// Waits until the adapter has applied every batch sent so far (replayed ones included).
    async fn settle(&self, r: &Running) {
        let want = format!("\"applied_seq\":{}", self.seq - 1);
        let t0 = Instant::now();
        while !health(r).await.contains(&want) {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "adapter stuck: {}",
                health(r).await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn adapter(extra: &[&str]) -> (Running, Engine) {
    let mut argv = vec![
        "kvsteer-feed",
        "--listen",
        "127.0.0.1:0",
        "--zmq-endpoint",
        "tcp://127.0.0.1:0",
        "--topic",
        "kv-events",
        "--block-size",
        "16",
    ];
    argv.extend_from_slice(extra);
    let r = start(Args::parse_from(argv)).await.expect("adapter starts");
    let mut pub_ = PubSocket::new();
    pub_.connect(r.zmq_bound.as_deref().unwrap()).await.unwrap();
    let mut e = Engine { pub_, seq: 40 };
    e.warm_up(&r).await;
    e.settle(&r).await;
    (r, e)
}

fn hashes(tokens: &[u32]) -> Vec<u64> {
    BlockHasher::new(BS)
        .unwrap()
        .sequence_hashes(tokens)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

fn stored<'a>(h: &'a [u64], parent: Option<u64>, toks: &'a [u32]) -> Event<'a> {
    Event::Stored {
        hashes: h,
        parent,
        token_ids: toks,
        block_size: BS as u32,
        lora_name: None,
        medium: "GPU",
    }
}

fn snapshot_hashes(b: &FeedBatch) -> Vec<u64> {
    assert!(b.resync);
    assert_eq!(b.events[0], FeedEvent::Cleared);
    let mut out: Vec<u64> = b.events[1..]
        .iter()
        .flat_map(|e| match e {
            FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes,
            } => hashes.clone(),
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    out.sort();
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_blocks_reach_the_feed_with_kvsteer_hashes() {
    let (r, mut e) = adapter(&[]).await;
    let toks: Vec<u32> = (0..80).map(|i| 1000 + i * 7).collect(); // 5 blocks
    e.send(batch(1.0, &[stored(&[11, 12], None, &toks[..32])], 0))
        .await;
    e.send(batch(
        2.0,
        &[stored(&[13, 14, 15], Some(12), &toks[32..])],
        0,
    ))
    .await;
    e.settle(&r).await;

    let snap = poll(&r, FeedQuery::resync(4096)).await;
    let mut want = hashes(&toks);
    assert_eq!(want.len(), 5);
    want.sort();
    assert_eq!(snapshot_hashes(&snap), want);
    assert_eq!(snap.load.block_size, 16);

    // Incremental: a removal and a clear arrive in order after the cursor.
    e.send(batch(
        3.0,
        &[Event::Removed {
            hashes: &[15],
            medium: "GPU",
        }],
        0,
    ))
    .await;
    e.send(batch(4.0, &[Event::Cleared], 0)).await;
    e.settle(&r).await;
    let b = poll(
        &r,
        FeedQuery {
            epoch: snap.epoch,
            cursor: snap.next_seq,
            max_events: 4096,
        },
    )
    .await;
    assert!(!b.resync);
    assert_eq!(b.first_seq, snap.next_seq);
    assert_eq!(
        b.events,
        vec![
            FeedEvent::Removed {
                tier: Tier::Gpu,
                hashes: vec![hashes(&toks)[4]]
            },
            FeedEvent::Cleared
        ]
    );
    // A malformed query is refused, naming the field.
    let (status, body) = get(r.http_addr, "/kvsteer/feed?epoch=x").await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("epoch"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_without_replay_resets_the_epoch_and_is_counted() {
    let (r, mut e) = adapter(&[]).await;
    let toks: Vec<u32> = (0..32).collect();
    e.send(batch(1.0, &[stored(&[1, 2], None, &toks)], 0)).await;
    e.settle(&r).await;
    let snap = poll(&r, FeedQuery::resync(100)).await;
    assert_eq!(snapshot_hashes(&snap).len(), 2);
    e.seq += 3; // three batches lost
    e.send(batch(2.0, &[stored(&[3], None, &toks[..16])], 0))
        .await;
    e.settle(&r).await;
    let b = poll(
        &r,
        FeedQuery {
            epoch: snap.epoch,
            cursor: snap.next_seq,
            max_events: 100,
        },
    )
    .await;
    assert!(b.resync, "the old epoch is gone");
    assert_ne!(b.epoch, snap.epoch);
    // Only what arrived after the gap is known.
    assert_eq!(snapshot_hashes(&b), vec![hashes(&toks[..16])[0]]);
    let m = String::from_utf8(get(r.http_addr, "/metrics").await.1).unwrap();
    assert!(m.contains("kvsteer_feed_seq_gaps_total 1"), "{m}");
    assert!(m.contains("kvsteer_feed_seq_gap_batches_total 3"), "{m}");
    assert!(
        m.contains("kvsteer_feed_resets_total{reason=\"gap\"} 1"),
        "{m}"
    );
    // Garbage from the engine is counted, never fatal.
    e.send(b"\xc1 not msgpack".to_vec()).await;
    e.settle(&r).await;
    let m = String::from_utf8(get(r.http_addr, "/metrics").await.1).unwrap();
    assert!(
        m.contains("kvsteer_feed_bad_payloads_total{reason=\"msgpack\"} 1"),
        "{m}"
    );
    // An engine restart (sequence back to 0) starts a new epoch too.
    let epoch = poll(&r, FeedQuery::resync(10)).await.epoch;
    e.seq = 0;
    e.send(batch(0.0, &[], 0)).await;
    e.settle(&r).await;
    assert_ne!(poll(&r, FeedQuery::resync(10)).await.epoch, epoch);
}

/// Batches an engine keeps for replay: (sequence number, payload).
type Recorded = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// Serves vLLM's replay protocol from a list of recorded batches. Replies carry the topic frame
/// (`delimiter, topic, seq, payload`; the end marker's topic is empty) as vLLM 0.32 sends them, or
/// not (`delimiter, seq, payload`) as SGLang and older vLLM releases do.
async fn replay_server(
    recorded: Recorded,
    topic: Option<&'static str>,
) -> (String, tokio::task::JoinHandle<()>) {
    let mut router = RouterSocket::new();
    let ep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let task = tokio::spawn(async move {
        loop {
            let Ok(req) = router.recv().await else { return };
            let frames = req.into_vec();
            let id = frames[0].clone();
            let start = u64::from_be_bytes(frames.last().unwrap()[..8].try_into().unwrap());
            let batches = recorded.lock().unwrap().clone();
            for (seq, payload) in &batches {
                if *seq >= start {
                    let mut m = ZmqMessage::from(id.clone());
                    m.push_back(Bytes::new());
                    if let Some(t) = topic {
                        m.push_back(Bytes::from_static(t.as_bytes()));
                    }
                    m.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                    m.push_back(Bytes::from(payload.clone()));
                    router.send(m).await.unwrap();
                }
            }
            let mut end = ZmqMessage::from(id.clone());
            end.push_back(Bytes::new());
            if topic.is_some() {
                end.push_back(Bytes::new());
            }
            end.push_back(Bytes::copy_from_slice(&(-1i64).to_be_bytes()));
            end.push_back(Bytes::new());
            router.send(end).await.unwrap();
        }
    });
    (ep, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_from_the_replay_endpoint() {
    gap_filled_by_replay(None).await;
}

/// vLLM 0.32's replies carry the topic (the adapter once refused them: "replay reply with 4
/// frames", found by e2e/test_real_vllm.py).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_filled_from_replies_that_carry_the_topic() {
    gap_filled_by_replay(Some("kv-events")).await;
}

async fn gap_filled_by_replay(topic: Option<&'static str>) {
    let toks: Vec<u32> = (500..564).collect(); // 4 blocks
    let recorded = Arc::new(Mutex::new(Vec::new()));
    let (ep, _task) = replay_server(recorded.clone(), topic).await;
    let (r, mut e) = adapter(&["--replay-endpoint", &ep]).await;
    let snap = poll(&r, FeedQuery::resync(100)).await;
    // The engine's buffer holds the two batches the adapter misses.
    let s = e.seq;
    *recorded.lock().unwrap() = vec![
        (s, batch(1.0, &[stored(&[1, 2], None, &toks[..32])], 0)),
        (
            s + 1,
            batch(2.0, &[stored(&[3], Some(2), &toks[32..48])], 0),
        ),
    ];
    e.seq += 2; // dropped on the way
    e.send(batch(3.0, &[stored(&[4], Some(3), &toks[48..])], 0))
        .await;
    e.settle(&r).await;
    let b = poll(
        &r,
        FeedQuery {
            epoch: snap.epoch,
            cursor: snap.next_seq,
            max_events: 100,
        },
    )
    .await;
    assert!(!b.resync, "recovered: same epoch, incremental");
    let got: Vec<u64> = b
        .events
        .iter()
        .flat_map(|e| match e {
            FeedEvent::Stored { hashes, .. } => hashes.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    let m = String::from_utf8(get(r.http_addr, "/metrics").await.1).unwrap();
    assert_eq!(got, hashes(&toks), "{b:?}\n{m}");
    assert!(m.contains("kvsteer_feed_seq_gaps_recovered_total 1"), "{m}");
    assert!(m.contains("kvsteer_feed_replayed_batches_total 2"), "{m}");
    assert!(
        m.contains("kvsteer_feed_resets_total{reason=\"gap\"} 0"),
        "{m}"
    );
}

/// A fake engine `/metrics` on a raw socket.
async fn fake_metrics(text: &'static str) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let _ = s.read(&mut buf).await;
                let resp = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_comes_from_the_engine_metrics() {
    let addr = fake_metrics(
        "vllm:num_requests_running{engine=\"0\"} 5.0\nvllm:num_requests_waiting{engine=\"0\"} 2.0\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.5\nvllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"1000\"} 1.0\n",
    )
    .await;
    let url = format!("http://{addr}/metrics");
    let (r, _e) = adapter(&["--metrics-url", &url, "--scrape-interval-ms", "50"]).await;
    let t0 = Instant::now();
    loop {
        let b = poll(&r, FeedQuery::resync(10)).await;
        if b.load.running == 5 {
            assert_eq!(b.load.waiting, 2);
            assert_eq!(b.load.kv_total_blocks, 1000);
            assert_eq!(b.load.decode_blocks, 500);
            assert_eq!(b.load.kv_used_blocks, 500);
            assert_eq!(b.load.prefill_tokens, 0);
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "no scrape");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = String::from_utf8(get(r.http_addr, "/metrics").await.1).unwrap();
    assert!(m.contains("kvsteer_feed_max_blocks 4096"), "{m}");
}

/// Two ports in a row that are free now (vLLM's rank R publishes on the base port plus R).
fn free_port_pair() -> u16 {
    for _ in 0..50 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = l.local_addr().unwrap().port();
        if p < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
    panic!("no two free ports in a row");
}

/// `--dp-ranks 2`: one view per rank, each fed by its own port (base + rank), each answering
/// `?rank=R` with its own blocks and its rank in the header; a batch stamped with the other rank is
/// dropped; a poll without a rank, or for a rank the engine lacks, is a 400 naming the problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_ranks_are_served_apart() {
    let base = free_port_pair();
    let endpoint = format!("tcp://127.0.0.1:{base}");
    let argv = [
        "kvsteer-feed",
        "--listen",
        "127.0.0.1:0",
        "--zmq-endpoint",
        endpoint.as_str(),
        "--topic",
        "kv-events",
        "--block-size",
        "16",
        "--dp-ranks",
        "2",
    ];
    let r = start(Args::parse_from(argv)).await.expect("adapter starts");
    assert_eq!(r.ranks.len(), 2);
    let mut engines = Vec::new();
    for rank in 0..2u16 {
        let mut pub_ = PubSocket::new();
        pub_.connect(&format!("tcp://127.0.0.1:{}", base + rank))
            .await
            .unwrap();
        engines.push(Engine { pub_, seq: 0 });
    }
    // Warm up each rank's socket until its view has applied a batch.
    for (rank, e) in engines.iter_mut().enumerate() {
        let t0 = Instant::now();
        loop {
            e.send(batch(0.0, &[], rank as u32)).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            let h = String::from_utf8(get(r.http_addr, &format!("/health?rank={rank}")).await.1)
                .unwrap();
            if !h.contains("\"applied_seq\":null") {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "rank {rank}: {h}");
        }
    }
    let a: Vec<u32> = (0..32).collect();
    let b: Vec<u32> = (500..532).collect();
    engines[0]
        .send(batch(1.0, &[stored(&[1, 2], None, &a)], 0))
        .await;
    engines[1]
        .send(batch(1.0, &[stored(&[3, 4], None, &b)], 1))
        .await;
    // Miswired: rank 0's stamp on rank 1's port.
    engines[1]
        .send(batch(2.0, &[stored(&[5, 6], None, &a)], 0))
        .await;
    for (rank, e) in engines.iter().enumerate() {
        let want = format!("\"applied_seq\":{}", e.seq - 1);
        let t0 = Instant::now();
        loop {
            let h = String::from_utf8(get(r.http_addr, &format!("/health?rank={rank}")).await.1)
                .unwrap();
            if h.contains(&want) {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "rank {rank}: {h}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for (rank, toks) in [(0u16, &a), (1, &b)] {
        let path = format!("{}&rank={rank}", FeedQuery::resync(4096).to_path());
        let (status, body) = get(r.http_addr, &path).await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert_eq!(kvsteer_core::feed::payload_rank(&body), Some(rank));
        let mut want = hashes(toks);
        want.sort();
        assert_eq!(
            snapshot_hashes(&FeedBatch::decode(&body).unwrap()),
            want,
            "rank {rank} holds its own blocks only"
        );
    }
    let (status, body) = get(r.http_addr, &FeedQuery::resync(10).to_path()).await;
    assert_eq!(status, 400);
    assert!(String::from_utf8_lossy(&body).contains("rank="));
    let (status, _) = get(
        r.http_addr,
        &format!("{}&rank=2", FeedQuery::resync(10).to_path()),
    )
    .await;
    assert_eq!(status, 400);
    let m = String::from_utf8(get(r.http_addr, "/metrics?rank=1").await.1).unwrap();
    assert!(
        m.contains("kvsteer_feed_bad_payloads_total{reason=\"dp_rank\"} 1"),
        "{m}"
    );
}

/// `--model-dir`: the model folder's tokenizer files, framed with `--model-name`, at
/// `/kvsteer/tokenizer`; without it a 404 says how to turn it on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serves_the_tokenizer_bundle_from_the_model_folder() {
    let (r, _e) = adapter(&[]).await;
    let (status, body) = get(r.http_addr, "/kvsteer/tokenizer").await;
    assert_eq!(status, 404);
    assert!(String::from_utf8_lossy(&body).contains("--model-dir"));
    let dir = std::env::temp_dir().join(format!("kvsteer-model-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        "{\"model\": {\"type\": \"BPE\"}}",
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        "{\"bos_token\": \"<s>\"}",
    )
    .unwrap();
    let d = dir.to_str().unwrap();
    let (r, _e) = adapter(&["--model-dir", d, "--model-name", "tiny"]).await;
    let (status, body) = get(r.http_addr, "/kvsteer/tokenizer").await;
    assert_eq!(status, 200);
    let b = kvsteer_core::bundle::decode(&body).unwrap();
    assert_eq!(b.model, Some("tiny"));
    assert_eq!(b.tokenizer_json, b"{\"model\": {\"type\": \"BPE\"}}");
    assert_eq!(
        b.tokenizer_config_json,
        Some(&b"{\"bos_token\": \"<s>\"}"[..])
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
