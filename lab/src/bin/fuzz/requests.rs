//! The request inputs: valid `/v1/completions` and `/v1/chat/completions` bodies, their mutations
//! (byte-level and JSON-aware), and the headers, chunking, trailers and aborts they are sent with.

use crate::{CLUSTER, DEST, REPLICAS, Rng, endpoint};
use kvsteer_host_test::Pairs;
use kvsteer_host_test::openai::request_headers;
use std::fmt::Write as _;

pub(crate) const WORDS: [&str; 10] = [
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

pub(crate) fn text(rng: &mut Rng, max_words: usize) -> String {
    let n = rng.below(max_words + 1);
    let mut s = String::new();
    for _ in 0..n {
        let w = WORDS[rng.below(WORDS.len())];
        s.push_str(w);
        s.push(' ');
    }
    s
}

pub(crate) fn ids(rng: &mut Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{}", rng.below(150_000));
    }
    s
}

pub(crate) fn prompt_len(rng: &mut Rng) -> usize {
    match rng.below(100) {
        0..=59 => rng.below(64),
        60..=94 => rng.below(1024),
        _ => rng.below(20_000),
    }
}

pub(crate) fn tail(rng: &mut Rng) -> String {
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
pub(crate) fn valid_body(rng: &mut Rng, chat: bool) -> String {
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

pub(crate) const ODD_NUMBERS: [&str; 16] = [
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

pub(crate) const ODD_VALUES: [&str; 12] = [
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

pub(crate) const JUNK: [&[u8]; 18] = [
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
pub(crate) fn positions(b: &[u8], c: u8) -> Vec<usize> {
    b.iter()
        .enumerate()
        .filter(|(_, x)| **x == c)
        .map(|(i, _)| i)
        .collect()
}

/// The start and end of a random run of digits (a number) in `b`, if any.
pub(crate) fn a_number(rng: &mut Rng, b: &[u8]) -> Option<(usize, usize)> {
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
pub(crate) fn value_of(b: &[u8], key: &str) -> Option<(usize, usize)> {
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
pub(crate) fn mutate(rng: &mut Rng, b: &mut Vec<u8>, other: &[u8]) -> &'static str {
    // Kept whole: one arm per mutation kind.
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

pub(crate) struct RequestInput {
    pub(crate) path: String,
    pub(crate) headers: Pairs,
    pub(crate) body: Vec<u8>,
    pub(crate) chunks: Vec<usize>,
    pub(crate) trailers: bool,
    pub(crate) abort_after: Option<usize>,
    pub(crate) mutations: Vec<&'static str>,
}

pub(crate) fn header_bytes(rng: &mut Rng) -> Vec<u8> {
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

pub(crate) fn request_input(rng: &mut Rng) -> RequestInput {
    let chat = rng.chance(50);
    let path = request_path(rng, chat);
    let (body, mutations) = mutated_body(rng, chat);
    let headers = fuzzed_headers(rng, &path, body.len());
    let chunks = chunking(rng, body.len());
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

/// The request's path: mostly the body's own endpoint, sometimes one the filter must not take for it.
fn request_path(rng: &mut Rng, chat: bool) -> String {
    match rng.below(100) {
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
    }
}

/// A valid body of the kind `chat` says with a few mutations (pieces spliced in from a body of the
/// other kind), sometimes emptied; the mutations' names.
fn mutated_body(rng: &mut Rng, chat: bool) -> (Vec<u8>, Vec<&'static str>) {
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
    (body, mutations)
}

/// A client's headers for the body, sometimes with another method, a missing or lying
/// content-length or content-type, or spoofed routing headers.
fn fuzzed_headers(rng: &mut Rng, path: &str, body_len: usize) -> Pairs {
    let mut extra: Vec<(String, String)> = Vec::new();
    if rng.chance(30) {
        extra.push(("x-session-id".into(), format!("s{}", rng.below(100))));
    }
    let mut headers = request_headers(path, body_len, None, &extra);
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
    headers
}

/// Chunking: cut points anywhere, empty chunks allowed; at most 16 chunks (each `on_request_body`
/// sees everything buffered so far, as Envoy delivers it).
fn chunking(rng: &mut Rng, body_len: usize) -> Vec<usize> {
    let mut chunks = Vec::new();
    let pieces = match rng.below(10) {
        0..=4 => 1,
        5..=7 => rng.below(4) + 2,
        _ => rng.below(16) + 1,
    };
    let mut left = body_len;
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
    chunks
}
