//! Shared setup of the server tests: a replica on a free port, a blocking HTTP/1.1 client over a
//! real socket, and prompts.
#![allow(dead_code)]

use kvsteer_sim::engine::EngineConfig;
use kvsteer_sim::server::{Replica, ReplicaConfig};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub fn replica(kv_blocks: u32) -> Replica {
    replica_at(kv_blocks, 50.0)
}

pub fn replica_at(kv_blocks: u32, time_scale: f64) -> Replica {
    replica_with_engine(
        EngineConfig {
            kv_blocks,
            max_model_len: 4096,
            ..Default::default()
        },
        time_scale,
    )
}

/// A replica named `t0` with this engine configuration, at `time_scale`.
pub fn replica_with_engine(engine: EngineConfig, time_scale: f64) -> Replica {
    let cfg = ReplicaConfig {
        name: "t0".into(),
        host: "127.0.0.1".into(),
        port: 0,
        time_scale,
        model: "sim".into(),
        engine,
        dp_ranks: 1,
    };
    Replica::start(cfg).expect("replica starts")
}

pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

pub fn read_resp(r: &mut BufReader<TcpStream>) -> Resp {
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

pub struct Client {
    pub r: BufReader<TcpStream>,
}

impl Client {
    pub fn new(rep: &Replica) -> Client {
        let s = TcpStream::connect(rep.addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        Client {
            r: BufReader::new(s),
        }
    }
    pub fn raw(&mut self, bytes: &[u8]) -> Resp {
        self.r.get_mut().write_all(bytes).unwrap();
        read_resp(&mut self.r)
    }
    pub fn call(&mut self, method: &str, path: &str, body: &str) -> Resp {
        let req = format!(
            "{method} {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        self.raw(req.as_bytes())
    }
    pub fn post(&mut self, path: &str, v: &Value) -> Resp {
        self.call("POST", path, &v.to_string())
    }
}

pub fn ids(tag: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| tag * 10_000 + i).collect()
}

/// Polls `/metrics` up to `tries` times, 20 ms apart, until no request is running; the last count
/// read (0 once an abandoned request was aborted).
pub fn running_after_abort(c: &mut Client, tries: usize) -> f64 {
    let mut running = 1.0;
    for _ in 0..tries {
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
    running
}

/// Writes a POST of `body` to `/v1/completions` on a raw socket and reads nothing back: the start
/// of a client that leaves.
pub fn post_raw(s: &mut TcpStream, body: &Value) {
    let body = body.to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
}
