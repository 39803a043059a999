//! A replica that only serves a feed holding `BLOCKS` made-up blocks, to fill the filter's block
//! index through a real proxy (issue 17 item 6: each Envoy worker's memory with a full index;
//! `e2e/index_memory_envoy.py` drives it). A real engine or `kvsteer-sim serve` would need millions of
//! prompt tokens sent through it to hold a million blocks.
//!
//! `cargo run --release -p kvsteer-sim --example flood-feed -- PORT BLOCKS REPLICA [--every-poll]`
//!
//! `GET /health` answers 200. `GET /kvsteer/feed` answers a resync snapshot of `BLOCKS` GPU blocks
//! (hashes distinct per `REPLICA`) when the poll's epoch is not this replica's (a router's first
//! poll), else an empty batch that continues the cursor; with `--every-poll`, a snapshot on every
//! poll (a flooding replica: each poll resets and refills its blocks). Prints
//! `ready r<REPLICA>_0 127.0.0.1:PORT` when listening, like `kvsteer-sim serve`.

use kvsteer_core::feed::{FEED_CONTENT_TYPE, FeedBatch, FeedQuery};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

struct Feed {
    epoch: u64,
    snapshot: Vec<u8>,
    every_poll: bool,
}

impl Feed {
    fn answer(&self, query: &str) -> (u16, &'static str, Vec<u8>) {
        let q = match FeedQuery::parse(query) {
            Ok(q) => q,
            Err(e) => return (400, "text/plain", e.into_bytes()),
        };
        if self.every_poll || q.epoch != self.epoch {
            return (200, FEED_CONTENT_TYPE, self.snapshot.clone());
        }
        let mut empty = FeedBatch::snapshot(self.epoch, Vec::new());
        empty.resync = false;
        empty.events.clear();
        empty.first_seq = q.cursor;
        empty.next_seq = q.cursor;
        (200, FEED_CONTENT_TYPE, empty.encode())
    }
}

fn serve(feed: &Feed, stream: TcpStream) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            return Ok(());
        }
        let target = line.split_whitespace().nth(1).unwrap_or("/").to_string();
        let mut body_len = 0usize;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h)? == 0 {
                return Ok(());
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':')
                && k.eq_ignore_ascii_case("content-length")
            {
                body_len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut skip = vec![0u8; body_len];
        std::io::Read::read_exact(&mut reader, &mut skip)?;
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let (status, ctype, body) = match path {
            "/health" => (200, "text/plain", b"ok".to_vec()),
            "/kvsteer/feed" => feed.answer(query),
            _ => (404, "text/plain", b"not found".to_vec()),
        };
        write!(
            out,
            "HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\n\r\n",
            body.len()
        )?;
        out.write_all(&body)?;
        out.flush()?;
    }
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: flood-feed PORT BLOCKS REPLICA [--every-poll]";
    let num = |i: usize| -> Result<u64, String> {
        args.get(i)
            .ok_or(usage)?
            .parse()
            .map_err(|e| format!("{usage}: {e}"))
    };
    let (port, blocks, replica) = (num(0)?, num(1)?, num(2)?);
    let every_poll = args.iter().any(|a| a == "--every-poll");
    let epoch = 1000 + replica;
    let hashes = (0..blocks)
        .map(|i| 0xF100_D000_0000_0000 | replica << 40 | i)
        .collect();
    let feed = Arc::new(Feed {
        epoch,
        snapshot: FeedBatch::snapshot(epoch, hashes).encode(),
        every_poll,
    });
    let listener = TcpListener::bind(("127.0.0.1", port as u16)).map_err(|e| e.to_string())?;
    println!("ready r{replica}_0 127.0.0.1:{port}");
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let feed = feed.clone();
        std::thread::spawn(move || {
            let _ = serve(&feed, stream);
        });
    }
    Ok(())
}
