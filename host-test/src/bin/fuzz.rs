//! Fuzz campaign of the request reader and the feed decoder through the real `kvsteer_filter.wasm`.
//! Structured random inputs, not coverage-guided: every input is a valid body or feed
//! batch with random mutations, driven by a seeded generator, so a run is reproducible from
//! `(SEED, COUNT)`.
//!
//! - **Request inputs**: `/v1/completions` and `/v1/chat/completions` bodies (token-id prompts, text
//!   prompts, batched prompts, chat messages, content parts), mutated (byte flips, inserts, deletes,
//!   truncation, splices, huge and odd numbers, deep nesting, wrong types, duplicated keys, invalid
//!   UTF-8, escapes, junk inside token-id arrays, whitespace floods), sent in random chunkings with
//!   random headers (spoofed destination and cluster headers, wrong content-length and content-type,
//!   session headers, other methods and paths), sometimes with trailers, sometimes aborted mid-body.
//! - **Feed inputs**: answers to the filter's own feed polls: valid batches for its query (incremental
//!   or resync, random events, tiers and loads) mutated the same way at the byte level plus header
//!   fields (version, flags, counts, block size) set to odd values, with random status codes, content
//!   types and lying content-lengths, some resets and timeouts, sizes up to a little over the
//!   configured `feed_max_bytes`.
//!
//! One worker VM (fuel-metered, so a runaway loop is a trap too) serves every input; it is recreated
//! only after a trap. Every `--check-every` inputs a plain valid request must still be routed to a
//! configured replica. Checked after each request input: no trap, a request that ended was released
//! (or answered locally, counted), and the destination header the upstream sees names only configured
//! replicas. A trap or a violated check is a failure: the seed, index and input are written under
//! `--out` (default `target/fuzz-failures`) and the run goes on with a fresh VM.
//!
//! Usage: `fuzz [--count N] [--seed S] [--check-every N] [--out DIR] [--feed-share PERCENT]
//! [--from INDEX]`. `--feed-share` (default 50) is the percentage of inputs that are feed answers; the
//! kind of each input follows from the counts so far, its content from `(SEED, index)` alone, so
//! `--from INDEX --count 1` with `--feed-share 0` (a request) or `100` (a feed round) regenerates a
//! failure's input exactly on a fresh VM (whose state then differs from the original run's; the
//! written file holds the input itself too).

use kvsteer_core::feed::{
    FEED_CONTENT_TYPE, FeedBatch, FeedEvent, FeedQuery, HEADER_LEN, ReplicaLoad, Tier,
};
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{
    CallOutcome, Callout, FilterModule, HostError, HostMode, Pairs, Proxy, ProxyOptions, WorkerVm,
    filter_wasm_path, header_value,
};
use serde_json::json;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

const REPLICAS: usize = 4;
const FEED_MAX_BYTES: usize = 256 * 1024;
const FEED_MAX_EVENTS: u32 = 64;
const DEST: &str = "x-gateway-destination-endpoint";
const CLUSTER: &str = "x-kvsteer-cluster";

fn endpoint(r: usize) -> String {
    format!("10.0.0.{}:8000", r + 1)
}

/// splitmix64: small, fast, and good enough to drive mutations.
struct Rng(u64);

impl Rng {
    fn for_input(seed: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        r.next();
        r
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

struct Args {
    count: u64,
    seed: u64,
    check_every: u64,
    out: PathBuf,
    feed_share: u64,
    from: u64,
}

fn parse_args() -> Result<Args, String> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("target"));
    let mut a = Args {
        count: 100_000,
        seed: 17,
        check_every: 1000,
        out: target.join("fuzz-failures"),
        feed_share: 50,
        from: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            it.next()
                .and_then(|v| v.replace('_', "").parse().ok())
                .ok_or(format!("{name} needs a number"))
        };
        match arg.as_str() {
            "--count" => a.count = num("--count")?,
            "--seed" => a.seed = num("--seed")?,
            "--check-every" => a.check_every = num("--check-every")?.max(1),
            "--feed-share" => a.feed_share = num("--feed-share")?.min(100),
            "--from" => a.from = num("--from")?,
            "--out" => a.out = PathBuf::from(it.next().ok_or("--out needs a path")?),
            other => {
                return Err(format!(
                    "unknown argument {other:?}; usage: fuzz [--count N] [--seed S] \
                     [--check-every N] [--out DIR] [--feed-share PERCENT] [--from INDEX]"
                ));
            }
        }
    }
    Ok(a)
}

// ---------------------------------------------------------------------------------------------
// Request bodies

const WORDS: [&str; 10] = [
    "route",
    "cache",
    "the ",
    "prefill",
    "décode",
    "🚀",
    "\\n",
    "\\\"q\\\"",
    "\\u00e9",
    "x",
];

fn text(rng: &mut Rng, max_words: usize) -> String {
    let n = rng.below(max_words + 1);
    let mut s = String::new();
    for _ in 0..n {
        let w = WORDS[rng.below(WORDS.len())];
        s.push_str(w);
        s.push(' ');
    }
    s
}

fn ids(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{}", rng.below(150_000));
    }
    s
}

fn prompt_len(rng: &mut Rng) -> usize {
    match rng.below(100) {
        0..=59 => rng.below(64),
        60..=94 => rng.below(1024),
        _ => rng.below(20_000),
    }
}

fn tail(rng: &mut Rng) -> String {
    let mut s = String::new();
    if rng.chance(70) {
        let _ = write!(s, ",\"max_tokens\":{}", rng.below(4096));
    }
    if rng.chance(60) {
        s.push_str(",\"stream\":true");
    }
    if rng.chance(30) {
        s.push_str(",\"stream_options\":{\"include_usage\":true}");
    }
    if rng.chance(20) {
        s.push_str(",\"ignore_eos\":true,\"temperature\":0.7,\"n\":1");
    }
    s
}

/// A valid body for `path` (the mutations make it invalid).
fn valid_body(rng: &mut Rng, chat: bool) -> String {
    let model = if rng.chance(90) {
        "m"
    } else {
        "meta-llama/Llama-3.1-8B"
    };
    if chat {
        let mut msgs = Vec::new();
        if rng.chance(70) {
            msgs.push(format!(
                "{{\"role\":\"system\",\"content\":\"{}\"}}",
                text(rng, 40)
            ));
        }
        for t in 0..rng.below(6) + 1 {
            let role = if t % 2 == 0 { "user" } else { "assistant" };
            if rng.chance(15) {
                msgs.push(format!(
                    "{{\"role\":\"{role}\",\"content\":[{{\"type\":\"text\",\"text\":\"{}\"}},\
                     {{\"type\":\"image_url\",\"image_url\":{{\"url\":\"data:x\"}}}}]}}",
                    text(rng, 30)
                ));
            } else {
                msgs.push(format!("{{\"role\":\"{role}\",\"content\":\"{}\"}}", {
                    let words = if rng.chance(5) { 2000 } else { 60 };
                    text(rng, words)
                }));
            }
        }
        format!(
            "{{\"model\":\"{model}\",\"messages\":[{}]{}}}",
            msgs.join(","),
            tail(rng)
        )
    } else {
        let prompt = match rng.below(10) {
            0..=5 => {
                let n = prompt_len(rng);
                format!("[{}]", ids(rng, n))
            }
            6..=7 => format!("\"{}\"", text(rng, 200)),
            8 => {
                let a = ids(rng, 30);
                let b = ids(rng, 30);
                format!("[[{a}],[{b}]]")
            }
            _ => format!("[\"{}\",\"{}\"]", text(rng, 20), text(rng, 20)),
        };
        // Field order varies: the reader must not depend on `prompt` coming first.
        let t = tail(rng);
        if rng.chance(50) {
            format!("{{\"model\":\"{model}\",\"prompt\":{prompt}{t}}}")
        } else {
            format!("{{\"model\":\"{model}\"{t},\"prompt\":{prompt}}}")
        }
    }
}

const ODD_NUMBERS: [&str; 16] = [
    "-1",
    "4294967295",
    "4294967296",
    "18446744073709551616",
    "99999999999999999999999999999999999999",
    "1e999",
    "-0",
    "1.5",
    "1E2",
    "0x10",
    "01",
    "+1",
    "NaN",
    "Infinity",
    "-",
    "1e",
];

const ODD_VALUES: [&str; 12] = [
    "null",
    "true",
    "false",
    "{}",
    "[]",
    "\"\"",
    "\"str\"",
    "123",
    "[null]",
    "[[]]",
    "{\"a\":[1,2]}",
    "[1,\"x\",{}]",
];

const JUNK: [&[u8]; 18] = [
    b"\xff",
    b"\xc0\x80",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xe2\x82",
    b"\\u0000",
    b"\\ud800",
    b"\\udfff\\ud800",
    b"\\uZZZZ",
    b"\\",
    b"\"",
    b"\\\"",
    b"\x00",
    b"\t\r\n ",
    b",,",
    b"]]]",
    b"}}}",
    b"\xef\xbb\xbf",
];

/// Positions of the bytes in `b` equal to `c`.
fn positions(b: &[u8], c: u8) -> Vec<usize> {
    b.iter()
        .enumerate()
        .filter(|(_, x)| **x == c)
        .map(|(i, _)| i)
        .collect()
}

/// The start and end of a random run of digits (a number) in `b`, if any.
fn a_number(rng: &mut Rng, b: &[u8]) -> Option<(usize, usize)> {
    if b.is_empty() {
        return None;
    }
    for _ in 0..8 {
        let mut i = rng.below(b.len());
        if !b[i].is_ascii_digit() {
            continue;
        }
        while i > 0 && b[i - 1].is_ascii_digit() {
            i -= 1;
        }
        let mut j = i;
        while j < b.len() && b[j].is_ascii_digit() {
            j += 1;
        }
        return Some((i, j));
    }
    None
}

/// The value span after `"key":` in `b` (up to the next `,` or `}` at the same depth, roughly).
fn value_of(b: &[u8], key: &str) -> Option<(usize, usize)> {
    let pat = format!("\"{key}\":");
    let start = b.windows(pat.len()).position(|w| w == pat.as_bytes())? + pat.len();
    let mut depth = 0i32;
    let mut in_str = false;
    let mut esc = false;
    for (k, &c) in b[start..].iter().enumerate() {
        if in_str {
            match (esc, c) {
                (true, _) => esc = false,
                (false, b'\\') => esc = true,
                (false, b'"') => in_str = false,
                _ => {}
            }
            continue;
        }
        match c {
            b'"' => in_str = true,
            b'[' | b'{' => depth += 1,
            b']' | b'}' if depth == 0 => return Some((start, start + k)),
            b']' | b'}' => depth -= 1,
            b',' if depth == 0 => return Some((start, start + k)),
            _ => {}
        }
    }
    Some((start, b.len()))
}

/// One random mutation of a JSON body (or of any bytes).
fn mutate(rng: &mut Rng, b: &mut Vec<u8>, other: &[u8]) -> &'static str {
    let len = b.len();
    let at = |rng: &mut Rng| rng.below(len + 1);
    match rng.below(15) {
        0 => {
            if len > 0 {
                let i = rng.below(len);
                b[i] = rng.next() as u8;
            }
            "byte flip"
        }
        1 => {
            let i = at(rng);
            b.truncate(i);
            "truncation"
        }
        2 => {
            let i = at(rng);
            let n = rng.below(8) + 1;
            let bytes: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
            b.splice(i..i, bytes);
            "random insert"
        }
        3 => {
            if len > 0 {
                let i = rng.below(len);
                let j = (i + rng.below(64) + 1).min(len);
                b.drain(i..j);
            }
            "delete"
        }
        4 => {
            // Splice: a piece of another body (or of this one) into a random place.
            let src = if rng.chance(50) || other.is_empty() {
                b.clone()
            } else {
                other.to_vec()
            };
            if !src.is_empty() {
                let i = rng.below(src.len());
                let j = (i + rng.below(256) + 1).min(src.len());
                let k = at(rng);
                b.splice(k..k, src[i..j].iter().copied());
            }
            "splice"
        }
        5 => {
            let odd = if rng.chance(20) {
                "9".repeat(rng.below(5000) + 20)
            } else {
                rng.pick(&ODD_NUMBERS).to_string()
            };
            match a_number(rng, b) {
                Some((i, j)) => {
                    b.splice(i..j, odd.bytes());
                }
                None => {
                    let i = at(rng);
                    b.splice(i..i, odd.bytes());
                }
            }
            "odd number"
        }
        6 => {
            let depth = match rng.below(10) {
                0 => rng.below(300_000),
                1..=3 => rng.below(2_000),
                _ => rng.below(100),
            };
            let open = if rng.chance(50) { b'[' } else { b'{' };
            let closing = rng.chance(50);
            let mut ins = vec![open; depth];
            if open == b'{' {
                ins = b"{\"a\":".repeat(depth);
            }
            if closing {
                ins.extend(vec![if open == b'[' { b']' } else { b'}' }; depth]);
            }
            match value_of(b, if rng.chance(50) { "prompt" } else { "messages" }) {
                Some((s, _)) if rng.chance(70) => {
                    b.splice(s..s, ins);
                }
                _ => {
                    let i = at(rng);
                    b.splice(i..i, ins);
                }
            }
            "deep nesting"
        }
        7 => {
            let key = *rng.pick(&[
                "prompt",
                "messages",
                "max_tokens",
                "stream",
                "model",
                "content",
                "role",
                "stream_options",
            ]);
            if let Some((s, e)) = value_of(b, key) {
                let v = rng.pick(&ODD_VALUES).as_bytes().to_vec();
                b.splice(s..e, v);
            }
            "wrong type"
        }
        8 => {
            let dup = match rng.below(4) {
                0 => "\"prompt\":[1,2,3],".to_string(),
                1 => "\"prompt\":\"dup\",".to_string(),
                2 => "\"messages\":[{\"role\":\"user\",\"content\":\"dup\"}],".to_string(),
                _ => "\"model\":null,\"prompt\":null,".to_string(),
            };
            let braces = positions(b, b'{');
            let i = if braces.is_empty() {
                0
            } else {
                rng.pick(&braces) + 1
            };
            b.splice(i..i, dup.into_bytes());
            if rng.chance(30) {
                // And the key again at the end.
                let close = b.iter().rposition(|c| *c == b'}').unwrap_or(b.len());
                b.splice(close..close, b",\"prompt\":[7,8,9]".iter().copied());
            }
            "duplicate key"
        }
        9 | 10 => {
            let j = rng.pick(&JUNK).to_vec();
            let quotes = positions(b, b'"');
            let i = if !quotes.is_empty() && rng.chance(60) {
                rng.pick(&quotes) + 1
            } else {
                at(rng)
            };
            b.splice(i..i, j);
            "invalid utf-8 / escape"
        }
        11 => {
            // Junk inside a token-id array.
            let items: [&[u8]; 14] = [
                b",-1",
                b",1e3",
                b",\"x\"",
                b",,",
                b",4294967296",
                b", 01",
                b",1.0",
                b",null",
                b" , 5 ",
                b",[1]",
                b",{}",
                b",18446744073709551615",
                b",0",
                b",2147483648",
            ];
            let commas = positions(b, b',');
            let i = if commas.is_empty() {
                at(rng)
            } else {
                *rng.pick(&commas)
            };
            for _ in 0..rng.below(3) + 1 {
                b.splice(i..i, rng.pick(&items).iter().copied());
            }
            "token-id junk"
        }
        12 => {
            let max = if rng.chance(5) { 100_000 } else { 200 };
            let n = rng.below(max);
            let i = at(rng);
            let ws = *rng.pick(b" \n\t\r");
            b.splice(i..i, std::iter::repeat_n(ws, n));
            "whitespace"
        }
        13 => {
            // A body that is another JSON document altogether, or two documents.
            let v = rng.pick(&ODD_VALUES).as_bytes().to_vec();
            if rng.chance(50) {
                *b = v;
            } else {
                b.extend_from_slice(&v);
            }
            "other document"
        }
        _ => {
            // A long string value (a key or a prompt far over the usual sizes).
            let n = rng.below(200_000);
            let s = format!("\"{}\"", "a".repeat(n));
            if let Some((st, e)) = value_of(b, "prompt").or_else(|| value_of(b, "content")) {
                b.splice(st..e, s.into_bytes());
            }
            "long string"
        }
    }
}

struct RequestInput {
    path: String,
    headers: Pairs,
    body: Vec<u8>,
    chunks: Vec<usize>,
    trailers: bool,
    abort_after: Option<usize>,
    mutations: Vec<&'static str>,
}

fn header_bytes(rng: &mut Rng) -> Vec<u8> {
    match rng.below(8) {
        0 => Vec::new(),
        1 => vec![b'a'; rng.below(10_000)],
        2 => (0..rng.below(40)).map(|_| rng.next() as u8).collect(),
        3 => b"10.0.0.1:8000, 10.0.0.2:8000".to_vec(),
        4 => b"evil.example:443".to_vec(),
        5 => b"\xff\xfe".to_vec(),
        _ => endpoint(rng.below(REPLICAS + 2)).into_bytes(),
    }
}

fn request_input(rng: &mut Rng) -> RequestInput {
    let chat = rng.chance(50);
    let path = match rng.below(100) {
        0..=91 => {
            if chat {
                "/v1/chat/completions".to_string()
            } else {
                "/v1/completions".to_string()
            }
        }
        92 => "/v1/completions?x=1".into(),
        93 => "/v1/chat/completions/".into(),
        94 => "/v1/embeddings".into(),
        95 => "/".into(),
        96 => "".into(),
        97 => "/V1/COMPLETIONS".into(),
        98 => "/v1/completions#frag".into(),
        _ => "*".into(),
    };
    let mut body = valid_body(rng, chat).into_bytes();
    let other = valid_body(rng, !chat).into_bytes();
    let n = match rng.below(10) {
        0 => 0,
        1..=5 => 1,
        6..=7 => 2,
        _ => rng.below(6) + 1,
    };
    let mut mutations = Vec::new();
    for _ in 0..n {
        mutations.push(mutate(rng, &mut body, &other));
    }
    if rng.chance(2) {
        body.clear();
        mutations.push("empty body");
    }
    let mut extra: Vec<(String, String)> = Vec::new();
    if rng.chance(30) {
        extra.push(("x-session-id".into(), format!("s{}", rng.below(100))));
    }
    let mut headers = request_headers(&path, body.len(), None, &extra);
    if rng.chance(10) {
        let m = rng
            .pick(&["GET", "PUT", "post", "", "OPTIONS"])
            .as_bytes()
            .to_vec();
        headers[0].1 = m;
    }
    if rng.chance(10) {
        headers.retain(|(k, _)| k != b"content-length");
        if rng.chance(50) {
            headers.push((b"content-length".to_vec(), header_bytes(rng)));
        }
    }
    if rng.chance(5) {
        headers.retain(|(k, _)| k != b"content-type");
        if rng.chance(50) {
            headers.push((b"content-type".to_vec(), header_bytes(rng)));
        }
    }
    for _ in 0..rng.below(3) {
        if rng.chance(40) {
            let name = *rng.pick(&[DEST, CLUSTER, "x-session-id", ":path", "x-junk"]);
            headers.push((name.as_bytes().to_vec(), header_bytes(rng)));
        }
    }
    // Chunking: cut points anywhere, empty chunks allowed; at most 16 chunks (each `on_request_body`
    // sees everything buffered so far, as Envoy delivers it).
    let mut chunks = Vec::new();
    let pieces = match rng.below(10) {
        0..=4 => 1,
        5..=7 => rng.below(4) + 2,
        _ => rng.below(16) + 1,
    };
    let mut left = body.len();
    for k in 0..pieces {
        if k + 1 == pieces {
            chunks.push(left);
        } else {
            let c = if rng.chance(10) {
                0
            } else {
                rng.below(left + 1)
            };
            chunks.push(c);
            left -= c;
        }
    }
    let abort_after = if rng.chance(3) {
        Some(rng.below(chunks.len()))
    } else {
        None
    };
    RequestInput {
        path,
        headers,
        body,
        chunks,
        trailers: rng.chance(5),
        abort_after,
        mutations,
    }
}

// ---------------------------------------------------------------------------------------------
// Feed answers

fn odd_u64(rng: &mut Rng) -> u64 {
    match rng.below(8) {
        0 => 0,
        1 => u64::MAX,
        2 => u32::MAX as u64,
        3 => 1 << 63,
        _ => rng.below(10_000) as u64,
    }
}

fn feed_batch(rng: &mut Rng, q: &FeedQuery, epoch: u64) -> FeedBatch {
    let resync = q.epoch != epoch || rng.chance(20);
    let mut events = Vec::new();
    let hashes = |rng: &mut Rng| -> Vec<u64> {
        let n = match rng.below(20) {
            0 if rng.chance(20) => rng.below(20_000),
            0..=4 => rng.below(1000),
            _ => rng.below(40),
        };
        (0..n)
            .map(|_| {
                if rng.chance(90) {
                    rng.below(5000) as u64 + 1
                } else {
                    rng.next()
                }
            })
            .collect()
    };
    if resync {
        events.push(FeedEvent::Cleared);
    }
    for _ in 0..rng.below(6) {
        let tier = *rng.pick(&Tier::ALL);
        events.push(match rng.below(5) {
            0..=2 => FeedEvent::Stored {
                tier,
                hashes: hashes(rng),
            },
            3 => FeedEvent::Removed {
                tier,
                hashes: hashes(rng),
            },
            _ => FeedEvent::Cleared,
        });
    }
    let first_seq = if resync {
        rng.below(100) as u64
    } else if rng.chance(90) {
        q.cursor
    } else {
        odd_u64(rng)
    };
    let next_seq = if resync {
        first_seq
    } else {
        first_seq.wrapping_add(events.len() as u64)
    };
    let load = if rng.chance(70) {
        ReplicaLoad {
            running: rng.below(64) as u32,
            waiting: rng.below(64) as u32,
            prefill_tokens: rng.below(100_000) as u64,
            decode_blocks: rng.below(4096) as u64,
            kv_used_blocks: rng.below(4096) as u64,
            kv_total_blocks: 4096,
            block_size: 16,
        }
    } else {
        ReplicaLoad {
            running: odd_u64(rng) as u32,
            waiting: odd_u64(rng) as u32,
            prefill_tokens: odd_u64(rng),
            decode_blocks: odd_u64(rng),
            kv_used_blocks: odd_u64(rng),
            kv_total_blocks: odd_u64(rng),
            block_size: *rng.pick(&[0, 1, 16, 17, 32, u32::MAX]),
        }
    };
    FeedBatch {
        epoch: if rng.chance(95) { epoch } else { odd_u64(rng) },
        resync,
        more: rng.chance(10),
        first_seq,
        next_seq,
        load,
        events,
    }
}

struct FeedInput {
    outcome: CallOutcome,
    mutations: Vec<&'static str>,
}

fn feed_input(rng: &mut Rng, call: &Callout, epoch: u64) -> FeedInput {
    let q = call
        .header(":path")
        .and_then(|p| p.split_once('?'))
        .and_then(|(_, q)| FeedQuery::parse(q).ok())
        .unwrap_or(FeedQuery::resync(FEED_MAX_EVENTS));
    let mut mutations = Vec::new();
    match rng.below(100) {
        0..=2 => {
            return FeedInput {
                outcome: CallOutcome::Reset,
                mutations: vec!["reset"],
            };
        }
        3..=4 => {
            return FeedInput {
                outcome: CallOutcome::timeout(),
                mutations: vec!["timeout"],
            };
        }
        _ => {}
    }
    let mut body = feed_batch(rng, &q, epoch).encode();
    let other = feed_batch(rng, &q, epoch).encode();
    let n = match rng.below(10) {
        0..=2 => 0,
        3..=6 => 1,
        _ => rng.below(4) + 1,
    };
    for _ in 0..n {
        if rng.chance(50) && body.len() >= HEADER_LEN {
            // A header field set to an odd value.
            let (off, width, name) = *rng.pick(&[
                (4usize, 1usize, "version"),
                (5, 1, "flags"),
                (6, 2, "reserved"),
                (8, 8, "epoch"),
                (16, 8, "first_seq"),
                (24, 8, "next_seq"),
                (72, 4, "block size"),
                (76, 4, "event count"),
                (0, 4, "magic"),
            ]);
            let v = odd_u64(rng).to_le_bytes();
            body[off..off + width].copy_from_slice(&v[..width]);
            mutations.push(name);
        } else if rng.chance(30) && body.len() > HEADER_LEN + 6 {
            // An event's count, at a random offset past the header (sometimes right on one).
            let i = HEADER_LEN + 2 + rng.below(body.len() - HEADER_LEN - 6);
            let v = odd_u64(rng).to_le_bytes();
            body[i..i + 4].copy_from_slice(&v[..4]);
            mutations.push("event count");
        } else {
            mutations.push(mutate(rng, &mut body, &other));
        }
    }
    if rng.chance(2) {
        // Near or over the byte limit.
        let target = FEED_MAX_BYTES - 64 + rng.below(128);
        body.resize(target, rng.next() as u8);
        mutations.push("near the byte limit");
    }
    let status = if rng.chance(90) {
        200
    } else {
        *rng.pick(&[0u16, 100, 204, 206, 301, 400, 404, 429, 500, 503, 504, 999])
    };
    let ct = match rng.below(20) {
        0 => "text/plain",
        1 => "",
        2 => "application/json",
        _ => FEED_CONTENT_TYPE,
    };
    let mut outcome = CallOutcome::ok(status, ct, body);
    if let CallOutcome::Response { headers, .. } = &mut outcome {
        if rng.chance(5) {
            headers[2].1 = header_bytes(rng);
        }
        if rng.chance(3) {
            headers.retain(|(k, _)| k != b":status");
        }
        if rng.chance(3) {
            headers[0].1 = header_bytes(rng);
        }
    }
    FeedInput { outcome, mutations }
}

// ---------------------------------------------------------------------------------------------
// Driving the VM

struct Vm {
    proxy: Proxy,
    worker: WorkerVm,
    now_us: u64,
}

fn plugin_config() -> serde_json::Value {
    let replicas: Vec<_> = (0..REPLICAS)
        .map(|i| json!({"name": format!("r{i}"), "endpoint": endpoint(i), "feed_cluster": format!("feed_r{i}")}))
        .collect();
    json!({
        "replicas": replicas,
        "routing": {"policy": "kv_load", "block_size": 16, "index_capacity_blocks": 200_000},
        "feed_period_ms": 1,
        "tick_ms": 1,
        "feed_max_bytes": FEED_MAX_BYTES,
        "feed_max_events": FEED_MAX_EVENTS,
    })
}

fn new_vm(module: &FilterModule) -> Result<Vm, String> {
    let mut opts = ProxyOptions::new(HostMode::Envoy, plugin_config().to_string());
    opts.log_level = kvsteer_host_test::LogLevel::Warn;
    opts.echo_logs = false;
    let proxy = Proxy::new(module, opts);
    let worker = proxy.start_worker().map_err(|e| e.to_string())?;
    Ok(Vm {
        proxy,
        worker,
        now_us: 0,
    })
}

#[derive(Default)]
struct Totals {
    requests: u64,
    feeds: u64,
    traps: u64,
    violations: u64,
    released: u64,
    local: u64,
    aborted: u64,
    checks: u64,
    mutations: BTreeMap<&'static str, u64>,
    feed_status: BTreeMap<u16, u64>,
    metrics: BTreeMap<String, u64>,
    vms: u64,
}

enum Failure {
    Trap(HostError),
    Violation(String),
}

impl From<HostError> for Failure {
    fn from(e: HostError) -> Self {
        Failure::Trap(e)
    }
}

fn destination_ok(value: Option<&str>) -> Result<(), String> {
    let Some(v) = value else {
        return Ok(());
    };
    for e in v.split(',') {
        let e = e.trim();
        if !(0..REPLICAS).any(|r| endpoint(r) == e) {
            return Err(format!(
                "upstream destination {v:?} names no configured replica"
            ));
        }
    }
    Ok(())
}

fn run_request(vm: &mut Vm, inp: &RequestInput, t: &mut Totals) -> Result<(), Failure> {
    let w = &mut vm.worker;
    let id = w.new_stream()?;
    let mut ended = inp.body.is_empty() && !inp.trailers;
    let mut last = w.request_headers(id, inp.headers.clone(), ended)?;
    let mut off = 0;
    let mut aborted = false;
    if !inp.body.is_empty() || inp.trailers {
        for (k, &c) in inp.chunks.iter().enumerate() {
            if inp.abort_after == Some(k) {
                aborted = true;
                break;
            }
            let eos = k + 1 == inp.chunks.len() && !inp.trailers;
            if let Some(a) = w.request_body(id, &inp.body[off..off + c], eos)? {
                last = a;
            }
            off += c;
        }
        if !aborted && inp.trailers {
            last = w.request_trailers(id, vec![(b"x-t".to_vec(), b"1".to_vec())])?;
        }
        ended = !aborted;
    }
    let _ = last;
    let s = w
        .stream(id)
        .ok_or_else(|| Failure::Violation("stream vanished".into()))?;
    let check = if ended {
        if s.local_response.is_some() {
            t.local += 1;
            Ok(())
        } else if !s.released {
            Err(format!("a complete request was never released ({last:?})"))
        } else {
            t.released += 1;
            let up = s.upstream_headers.as_ref().unwrap_or(&s.request_headers);
            destination_ok(header_value(up, DEST))
        }
    } else {
        t.aborted += 1;
        Ok(())
    };
    w.end_stream(id)?;
    check.map_err(Failure::Violation)
}

/// One round of feed polls: advance the clock a tick, tick, answer every callout with a fuzzed
/// answer. Returns the answers delivered.
fn run_feed_round(
    vm: &mut Vm,
    rng: &mut Rng,
    t: &mut Totals,
    last_input: &mut Vec<(Callout, CallOutcome, Vec<&'static str>)>,
) -> Result<u64, Failure> {
    vm.now_us += 1000;
    vm.proxy.set_now_ns(vm.now_us * 1000);
    vm.worker.tick()?;
    let calls = vm.worker.take_callouts();
    let mut n = 0;
    for call in &calls {
        let r = call
            .upstream
            .strip_prefix("feed_r")
            .and_then(|x| x.parse::<u64>().ok())
            .unwrap_or(0);
        let inp = feed_input(rng, call, 100 + r);
        for m in &inp.mutations {
            *t.mutations.entry(m).or_insert(0) += 1;
        }
        if let CallOutcome::Response { headers, .. } = &inp.outcome {
            let st = header_value(headers, ":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            *t.feed_status.entry(st).or_insert(0) += 1;
        }
        last_input.push((call.clone(), inp.outcome.clone(), inp.mutations.clone()));
        vm.worker.answer_callout(call, inp.outcome)?;
        n += 1;
    }
    Ok(n)
}

fn describe_feed(answers: &[(Callout, CallOutcome, Vec<&'static str>)]) -> String {
    let mut out = String::new();
    for (call, outcome, mutations) in answers {
        match outcome {
            CallOutcome::Response { headers, body, .. } => {
                let _ = writeln!(
                    out,
                    "feed answer to {} ({}): mutations {:?}, {} body bytes\nheaders {:?}\nbody (hex) {}",
                    call.upstream,
                    call.header(":path").unwrap_or(""),
                    mutations,
                    body.len(),
                    headers
                        .iter()
                        .map(|(k, v)| (
                            String::from_utf8_lossy(k).to_string(),
                            String::from_utf8_lossy(v).to_string()
                        ))
                        .collect::<Vec<_>>(),
                    hex(body)
                );
            }
            CallOutcome::Reset => {
                let _ = writeln!(out, "feed answer to {}: reset", call.upstream);
            }
        }
    }
    out
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

fn plain_check(vm: &mut Vm) -> Result<(), Failure> {
    let body =
        br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":8}"#;
    let w = &mut vm.worker;
    let id = w.new_stream()?;
    let headers = request_headers("/v1/completions", body.len(), None, &[]);
    w.request_headers(id, headers, false)?;
    w.request_body(id, body, true)?;
    let s = w
        .stream(id)
        .ok_or_else(|| Failure::Violation("stream vanished".into()))?;
    let up = s.upstream_headers.clone();
    let released = s.released;
    w.end_stream(id)?;
    if !released {
        return Err(Failure::Violation(
            "the plain request was not released".into(),
        ));
    }
    let dest = up.as_ref().and_then(|h| header_value(h, DEST));
    if dest.is_none() {
        return Err(Failure::Violation(
            "the plain request has no destination".into(),
        ));
    }
    destination_ok(dest).map_err(Failure::Violation)?;
    if !vm.worker.notes().is_empty() {
        return Err(Failure::Violation(format!(
            "ABI misuse: {:?}",
            vm.worker.notes()
        )));
    }
    Ok(())
}

fn add_metrics(vm: &Vm, t: &mut Totals) {
    for m in vm.proxy.metrics() {
        let key = if m.name.starts_with("kvsteer_feed_errors_") {
            "kvsteer_feed_errors (all replicas)".to_string()
        } else if m.name.starts_with("kvsteer_feed_oversized_") {
            "kvsteer_feed_oversized (all replicas)".to_string()
        } else if m.name.starts_with("kvsteer_feed_timeouts_") {
            "kvsteer_feed_timeouts (all replicas)".to_string()
        } else if [
            "kvsteer_fallbacks",
            "kvsteer_requests_routed",
            "kvsteer_spoofed_headers_removed",
            "kvsteer_feed_resets",
            "kvsteer_release_anomalies",
            "kvsteer_early_scan_bodies",
            "kvsteer_early_scan_declined",
        ]
        .contains(&m.name.as_str())
        {
            m.name.clone()
        } else {
            continue;
        };
        *t.metrics.entry(key).or_insert(0) += m.value.max(0) as u64;
    }
}

fn write_failure(
    args: &Args,
    index: u64,
    what: &str,
    input: &str,
    body: Option<&[u8]>,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
    let base = args.out.join(format!("seed{}-input{index}", args.seed));
    let txt = base.with_extension("txt");
    std::fs::write(
        &txt,
        format!(
            "seed {} index {index}\nreplay: fuzz --seed {} --from {index} --count 1\n{what}\n\n{input}\n",
            args.seed, args.seed
        ),
    )
    .map_err(|e| e.to_string())?;
    if let Some(b) = body {
        std::fs::write(base.with_extension("body"), b).map_err(|e| e.to_string())?;
    }
    Ok(txt)
}

fn describe_request(inp: &RequestInput) -> String {
    format!(
        "request {} mutations {:?} chunks {:?} trailers {} abort_after {:?}\nheaders {:?}",
        inp.path,
        inp.mutations,
        inp.chunks,
        inp.trailers,
        inp.abort_after,
        inp.headers
            .iter()
            .map(|(k, v)| (
                String::from_utf8_lossy(k).to_string(),
                String::from_utf8_lossy(v).to_string()
            ))
            .collect::<Vec<_>>()
    )
}

fn main() {
    match run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("fuzz: {e}");
            std::process::exit(2);
        }
    }
}

fn run() -> Result<bool, String> {
    let args = parse_args()?;
    let path = filter_wasm_path()?;
    let module = FilterModule::load(&path).map_err(|e| e.to_string())?;
    println!(
        "fuzz: {} ({:.0} KB), seed {}, {} inputs from index {}, {}% feed answers, check every {}",
        path.display(),
        module.size() as f64 / 1024.0,
        args.seed,
        args.count,
        args.from,
        args.feed_share,
        args.check_every
    );
    let mut vm = new_vm(&module)?;
    let mut t = Totals {
        vms: 1,
        ..Default::default()
    };
    let start = Instant::now();
    let mut last_report = Instant::now();
    let mut failures: Vec<String> = Vec::new();
    let mut index = args.from;
    let end = args.from + args.count;
    let mut next_check = args.from + args.check_every;
    while index < end {
        let mut rng = Rng::for_input(args.seed, index);
        // Keep the kinds at `feed_share` percent of the inputs (a feed round answers every replica
        // the filter polled, usually all four).
        let feed = t.feeds * (100 - args.feed_share) < t.requests * args.feed_share
            || args.feed_share == 100;
        let result;
        let mut answers = Vec::new();
        let mut request = None;
        let mut note = "";
        let before = index;
        if feed {
            result = run_feed_round(&mut vm, &mut rng, &mut t, &mut answers);
            let n = *result.as_ref().unwrap_or(&1);
            t.feeds += n;
            index += n.max(1);
        } else {
            let inp = request_input(&mut rng);
            for m in &inp.mutations {
                *t.mutations.entry(m).or_insert(0) += 1;
            }
            result = run_request(&mut vm, &inp, &mut t).map(|_| 1);
            request = Some(inp);
            t.requests += 1;
            index += 1;
        }
        let mut result = result.map(|_| ());
        if result.is_ok() && index >= next_check {
            next_check = index + args.check_every;
            t.checks += 1;
            result = plain_check(&mut vm);
            if result.is_err() {
                note = "(the plain-request check after this input failed)\n";
            }
        }
        if let Err(f) = result {
            let (what, trap) = match &f {
                Failure::Trap(e) => (format!("TRAP: {e}"), true),
                Failure::Violation(v) => (format!("VIOLATION: {v}"), false),
            };
            if trap {
                t.traps += 1;
            } else {
                t.violations += 1;
            }
            let descr = match &request {
                Some(r) => format!(
                    "kind: request body (replay with --feed-share 0)\n{}",
                    describe_request(r)
                ),
                None => format!(
                    "kind: feed round (replay with --feed-share 100; the cause may be an earlier \
                     round's answer, still being applied)\n{}",
                    describe_feed(&answers)
                ),
            };
            let file = write_failure(
                &args,
                before,
                &what,
                &format!("{note}{descr}"),
                request.as_ref().map(|r| r.body.as_slice()),
            )?;
            let line = format!(
                "input {before} (seed {}): {} -> {}",
                args.seed,
                what.lines().next().unwrap_or(""),
                file.display()
            );
            println!("{line}");
            failures.push(line);
            add_metrics(&vm, &mut t);
            vm = new_vm(&module)?;
            t.vms += 1;
        }
        if last_report.elapsed().as_secs() >= 10 {
            last_report = Instant::now();
            let done = index - args.from;
            println!(
                "  {done} inputs ({} requests, {} feed answers), {} traps, {} violations, {:.0} inputs/s",
                t.requests,
                t.feeds,
                t.traps,
                t.violations,
                done as f64 / start.elapsed().as_secs_f64()
            );
        }
    }
    // A last check, then the filter's own counters.
    if let Err(f) = plain_check(&mut vm) {
        let what = match f {
            Failure::Trap(e) => format!("TRAP in the final check: {e}"),
            Failure::Violation(v) => format!("VIOLATION in the final check: {v}"),
        };
        println!("{what}");
        failures.push(what);
        t.violations += 1;
    }
    add_metrics(&vm, &mut t);
    let secs = start.elapsed().as_secs_f64();
    let total = t.requests + t.feeds;
    println!();
    println!(
        "| seed | inputs | request bodies | feed answers | traps | violations | plain checks | VMs | wall s | inputs/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {total} | {} | {} | {} | {} | {} | {} | {secs:.0} | {:.0} |",
        args.seed,
        t.requests,
        t.feeds,
        t.traps,
        t.violations,
        t.checks,
        t.vms,
        total as f64 / secs
    );
    println!();
    println!(
        "requests that ended: {} released, {} answered locally; {} aborted mid-body",
        t.released, t.local, t.aborted
    );
    println!("feed answers by status: {:?}", t.feed_status);
    println!("the filter's counters (summed over the VMs):");
    for (k, v) in &t.metrics {
        println!("  {k}: {v}");
    }
    println!("mutations applied:");
    for (k, v) in &t.mutations {
        println!("  {k}: {v}");
    }
    if !failures.is_empty() {
        println!("{} failures:", failures.len());
        for f in &failures {
            println!("  {f}");
        }
    }
    Ok(failures.is_empty())
}
