//! A replica that only serves a feed holding `BLOCKS` made-up blocks, to fill the filter's block
//! index through a real proxy, or to flood it (`e2e/index_memory_envoy.py`,
//! `e2e/test_feed_flood.py` and `e2e/bench_feed_flood.py` drive it). A real engine or
//! `kvsteer-sim serve` would need millions of prompt tokens sent through it to hold a million blocks.
//!
//! `cargo run --release -p kvsteer-sim --example flood-feed -- PORT BLOCKS REPLICA [--every-poll]
//! [--delay-ms MS]`
//!
//! `GET /health` answers 200. `GET /kvsteer/feed` answers a resync snapshot of `BLOCKS` GPU blocks
//! (hashes distinct per `REPLICA`) when the poll's epoch is not this replica's (a router's first
//! poll), else an empty batch that continues the cursor; with `--every-poll`, a snapshot on every
//! poll (a flooding replica: each poll resets and refills its blocks). With `--delay-ms`, every feed
//! answer waits that long first (a slow feed; `/health` is not delayed). Prints
//! `ready r<REPLICA>_0 127.0.0.1:PORT` when listening, like `kvsteer-sim serve`.
//!
//! The mode can change while it runs (so a test can let the router see a quiet feed first):
//! `POST /admin/mode?blocks=N&every_poll=0|1&delay_ms=MS` (each field optional, the others kept)
//! takes a new epoch, so the router's next poll gets a snapshot of the new blocks. `GET /admin/stats`
//! answers `{"polls":P,"snapshots":S,"snapshot_bytes":B,"blocks":N,"epoch":E}`: what it has served
//! since it started or its mode last changed.

use kvsteer_core::feed::{FEED_CONTENT_TYPE, FeedBatch, FeedQuery};
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the feed answers now.
struct Mode {
    replica: u64,
    epoch: u64,
    blocks: u64,
    snapshot: Arc<Vec<u8>>,
    every_poll: bool,
    delay_ms: u64,
}

impl Mode {
    fn new(replica: u64, epoch: u64, blocks: u64, every_poll: bool, delay_ms: u64) -> Mode {
        let hashes = (0..blocks)
            .map(|i| 0xF100_D000_0000_0000 | replica << 40 | i)
            .collect();
        Mode {
            replica,
            epoch,
            blocks,
            snapshot: Arc::new(FeedBatch::snapshot(epoch, hashes).encode()),
            every_poll,
            delay_ms,
        }
    }
}

struct Feed {
    mode: Mutex<Mode>,
    polls: AtomicU64,
    snapshots: AtomicU64,
    snapshot_bytes: AtomicU64,
}

type Answer = (u16, &'static str, Arc<Vec<u8>>);

fn text(status: u16, msg: String) -> Answer {
    (status, "text/plain", Arc::new(msg.into_bytes()))
}

fn params(query: &str) -> impl Iterator<Item = (&str, &str)> {
    query
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
}

impl Feed {
    fn answer(&self, query: &str) -> Answer {
        self.polls.fetch_add(1, Ordering::Relaxed);
        let q = match FeedQuery::parse(query) {
            Ok(q) => q,
            Err(e) => return text(400, e),
        };
        let (epoch, snapshot, every_poll, delay_ms) = {
            let m = self.mode.lock().unwrap();
            (m.epoch, m.snapshot.clone(), m.every_poll, m.delay_ms)
        };
        if delay_ms > 0 {
            std::thread::sleep(Duration::from_millis(delay_ms));
        }
        if every_poll || q.epoch != epoch {
            self.snapshots.fetch_add(1, Ordering::Relaxed);
            self.snapshot_bytes
                .fetch_add(snapshot.len() as u64, Ordering::Relaxed);
            return (200, FEED_CONTENT_TYPE, snapshot);
        }
        let mut empty = FeedBatch::snapshot(epoch, Vec::new());
        empty.resync = false;
        empty.events.clear();
        empty.first_seq = q.cursor;
        empty.next_seq = q.cursor;
        (200, FEED_CONTENT_TYPE, Arc::new(empty.encode()))
    }

    /// `POST /admin/mode?...`: a new mode under a new epoch.
    fn set_mode(&self, query: &str) -> Answer {
        let mut m = self.mode.lock().unwrap();
        let (mut blocks, mut every_poll, mut delay_ms) = (m.blocks, m.every_poll, m.delay_ms);
        for (k, v) in params(query) {
            let n: u64 = match v.parse() {
                Ok(n) => n,
                Err(_) => return text(400, format!("bad {k}")),
            };
            match k {
                "blocks" => blocks = n,
                "every_poll" => every_poll = n != 0,
                "delay_ms" => delay_ms = n,
                _ => return text(400, format!("unknown {k}")),
            }
        }
        *m = Mode::new(m.replica, m.epoch + 1, blocks, every_poll, delay_ms);
        for c in [&self.polls, &self.snapshots, &self.snapshot_bytes] {
            c.store(0, Ordering::Relaxed);
        }
        text(200, "ok".into())
    }

    fn stats(&self) -> Answer {
        let (blocks, epoch) = {
            let m = self.mode.lock().unwrap();
            (m.blocks, m.epoch)
        };
        let body = format!(
            r#"{{"polls":{},"snapshots":{},"snapshot_bytes":{},"blocks":{blocks},"epoch":{epoch}}}"#,
            self.polls.load(Ordering::Relaxed),
            self.snapshots.load(Ordering::Relaxed),
            self.snapshot_bytes.load(Ordering::Relaxed),
        );
        (200, "application/json", Arc::new(body.into_bytes()))
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
        let mut words = line.split_whitespace();
        let method = words.next().unwrap_or("GET").to_string();
        let target = words.next().unwrap_or("/").to_string();
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
        let (status, ctype, body) = match (method.as_str(), path) {
            (_, "/health") => (200, "text/plain", Arc::new(b"ok".to_vec())),
            (_, "/kvsteer/feed") => feed.answer(query),
            ("POST", "/admin/mode") => feed.set_mode(query),
            (_, "/admin/stats") => feed.stats(),
            _ => (404, "text/plain", Arc::new(b"not found".to_vec())),
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

/// A replica that only serves a feed of made-up blocks (the filter's block index filled or
/// flooded through a real proxy).
#[derive(clap::Parser)]
#[command(name = "flood-feed", args_override_self = true)]
struct Args {
    /// TCP port to listen on, on 127.0.0.1.
    #[arg(value_name = "PORT")]
    port: u16,
    /// GPU blocks in each snapshot (8 bytes each on the wire).
    #[arg(value_name = "BLOCKS")]
    blocks: u64,
    /// Replica index: makes the block hashes and the epoch distinct per replica, and names the
    /// replica `r<REPLICA>_0` in the ready line.
    #[arg(value_name = "REPLICA")]
    replica: u64,
    /// Answer every poll with a snapshot (a flooding replica), not only a router's first poll.
    #[arg(long)]
    every_poll: bool,
    /// Milliseconds every feed answer waits first (a slow feed; `/health` is not delayed).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    delay_ms: u64,
}

fn main() -> Result<(), String> {
    let Args {
        port,
        blocks,
        replica,
        every_poll,
        delay_ms,
    } = clap::Parser::parse();
    let feed = Arc::new(Feed {
        mode: Mutex::new(Mode::new(
            replica,
            1000 + replica,
            blocks,
            every_poll,
            delay_ms,
        )),
        polls: AtomicU64::new(0),
        snapshots: AtomicU64::new(0),
        snapshot_bytes: AtomicU64::new(0),
    });
    let listener = TcpListener::bind(("127.0.0.1", port)).map_err(|e| e.to_string())?;
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
