//! The server's own overhead: keep-alive clients hammer one replica with 1-token completions at a
//! high time scale, so the figure is HTTP + JSON + scheduling hand-off, not simulated GPU time.
//!
//! `cargo run --release -p kvsteer-sim --example http_load -- [--clients 8] [--seconds 5]
//!  [--prompt-tokens 256] [--stream false]`

use kvsteer_sim::engine::EngineConfig;
use kvsteer_sim::server::{Replica, ReplicaConfig};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn one(r: &mut BufReader<TcpStream>, req: &[u8]) -> bool {
    if r.get_mut().write_all(req).is_err() {
        return false;
    }
    let mut chunked = false;
    let mut len = 0usize;
    let mut line = String::new();
    if r.read_line(&mut line).is_err() || !line.starts_with("HTTP/1.1 200") {
        return false;
    }
    loop {
        line.clear();
        if r.read_line(&mut line).is_err() {
            return false;
        }
        let l = line.trim_end().to_ascii_lowercase();
        if l.is_empty() {
            break;
        }
        if let Some(v) = l.strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        if l == "transfer-encoding: chunked" {
            chunked = true;
        }
    }
    if !chunked {
        let mut body = vec![0; len];
        return r.read_exact(&mut body).is_ok();
    }
    loop {
        line.clear();
        if r.read_line(&mut line).is_err() {
            return false;
        }
        let n = usize::from_str_radix(line.trim(), 16).unwrap_or(0);
        let mut chunk = vec![0; n + 2];
        if r.read_exact(&mut chunk).is_err() {
            return false;
        }
        if n == 0 {
            return true;
        }
    }
}

/// The server's own overhead: keep-alive clients hammer one replica with 1-token completions.
#[derive(clap::Parser)]
#[command(name = "http_load", args_override_self = true)]
struct Args {
    /// Keep-alive client connections, each sending one request at a time (at least 1).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 8,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    clients: usize,
    /// Wall-clock seconds the clients send for (at least 1).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 5,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    seconds: u64,
    /// Prompt length of each request, in tokens (distinct per request).
    #[arg(long, value_name = "N", default_value_t = 256)]
    prompt_tokens: usize,
    /// Ask for streamed (SSE) answers: `true` or `false`.
    #[arg(long, value_name = "BOOL", default_value_t = false, action = clap::ArgAction::Set)]
    stream: bool,
}

fn main() {
    let Args {
        clients,
        seconds,
        prompt_tokens,
        stream,
    } = clap::Parser::parse();
    let rep = Replica::start(ReplicaConfig {
        name: "load0".into(),
        host: "127.0.0.1".into(),
        port: 0,
        time_scale: 1e6,
        model: "sim".into(),
        engine: EngineConfig::default(),
        dp_ranks: 1,
    })
    .expect("replica starts");
    let addr = rep.addr();
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let handles: Vec<_> = (0..clients)
        .map(|c| {
            std::thread::spawn(move || {
                let s = TcpStream::connect(addr).expect("connect");
                s.set_nodelay(true).ok();
                let mut r = BufReader::new(s);
                let mut lat = Vec::new();
                let mut i = 0u32;
                while Instant::now() < deadline {
                    // Distinct prompts so every request does a lookup and a prefill.
                    let ids: Vec<String> = (0..prompt_tokens)
                        .map(|k| {
                            ((c as u32 * 1_000_003 + i * 7_919 + k as u32) % 128_000).to_string()
                        })
                        .collect();
                    let body = format!(
                        "{{\"prompt\":[{}],\"max_tokens\":1,\"stream\":{stream}}}",
                        ids.join(",")
                    );
                    let req = format!(
                        "POST /v1/completions HTTP/1.1\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    let t = Instant::now();
                    assert!(one(&mut r, req.as_bytes()), "request failed");
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                    i += 1;
                }
                lat
            })
        })
        .collect();
    let mut lat: Vec<f64> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("client thread"))
        .collect();
    lat.sort_by(|a, b| a.total_cmp(b));
    let q = |p: f64| lat[((lat.len() as f64 - 1.0) * p) as usize];
    println!("| clients | prompt tokens | stream | requests/s | p50 us | p99 us |");
    println!("|---|---|---|---|---|---|");
    println!(
        "| {clients} | {prompt_tokens} | {stream} | {:.0} | {:.0} | {:.0} |",
        lat.len() as f64 / seconds as f64,
        q(0.5),
        q(0.99)
    );
}
