//! Reading an OpenAI-style request body into what routing needs: the prompt's block identity, its size,
//! the output-length hint, the session key. Every byte comes from a client: anything malformed,
//! truncated, non-UTF-8 or oversized is a typed [`RequestError`], never a panic.
//!
//! Prompt identity: token-id prompts get the exact (Dynamo) identity and can be matched against the
//! engines' KV feed. Text prompts get the exact identity too when a [`PromptTokenizer`] is given (the
//! `kvsteer-tokenizer` crate renders the chat template and tokenizes as the engine does); without one,
//! or when it declines a prompt, they get the approximate text identity. For
//! `/v1/completions` with a batch of prompts, the identity is the first prompt's and the token count is
//! the sum over all of them. For `/v1/chat/completions` the text is each message's role and text parts,
//! framed so that the same conversation prefix gives the same chunks; non-text parts are skipped.

use serde::Deserialize;

use crate::block::{BlockHasher, SeqHash, TextHash, TextHasher};

/// Which endpoint a request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

/// The prompt's identity for matching.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptIdentity {
    /// Token ids: exact sequence hashes of full blocks.
    Exact(Vec<SeqHash>),
    /// Text: approximate chunk hashes.
    Approximate(Vec<TextHash>),
}

impl PromptIdentity {
    pub fn blocks(&self) -> usize {
        match self {
            PromptIdentity::Exact(v) => v.len(),
            PromptIdentity::Approximate(v) => v.len(),
        }
    }

    /// The `i`-th block hash as a plain integer, for the token-load table's per-replica set of active
    /// blocks (which only needs equality within one identity kind); 0 past the end (callers stay below
    /// `blocks()`; the routing path must not panic).
    pub fn key(&self, i: usize) -> u64 {
        match self {
            PromptIdentity::Exact(v) => v.get(i).map_or(0, |h| h.0),
            PromptIdentity::Approximate(v) => v.get(i).map_or(0, |h| h.0),
        }
    }
}

/// What the router needs from one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens`: the output-length hint.
    pub output_hint: Option<u64>,
    pub session_key: Option<String>,
    /// Prompt tokens (approximate for text: 4 characters a token).
    pub prompt_tokens: u64,
    pub identity: PromptIdentity,
}

/// Why a body could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    TooLarge {
        len: usize,
        max: usize,
    },
    UnsupportedPath(String),
    NotUtf8,
    /// Not JSON of the expected shape; the message is serde_json's (with line and column).
    Json(String),
    /// Neither `prompt` (completions) nor `messages` (chat) is present.
    MissingPrompt,
    /// A prompt list mixing kinds, or an empty one.
    BadPrompt(&'static str),
}

impl core::fmt::Display for RequestError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            RequestError::TooLarge { len, max } => {
                write!(
                    f,
                    "request body of {len} bytes exceeds max_body_bytes {max}"
                )
            }
            RequestError::UnsupportedPath(p) => write!(f, "unsupported path {p:?}"),
            RequestError::NotUtf8 => write!(f, "request body is not UTF-8"),
            RequestError::Json(m) => write!(f, "request body: {m}"),
            RequestError::MissingPrompt => write!(f, "request has no prompt or messages"),
            RequestError::BadPrompt(m) => write!(f, "bad prompt: {m}"),
        }
    }
}

impl std::error::Error for RequestError {}

/// The `prompt` field in its four OpenAI shapes.
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// One element of a prompt list: a token id, a text, or a list of token ids.
enum PromptItem {
    Token(u32),
    Text(String),
    Tokens(Vec<u32>),
}

// Hand-written visitors instead of `#[serde(untagged)]`: untagged enums buffer the whole value into
// serde's generic `Content` first, which made an 8K-token-id body five times slower to read.
impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
                f.write_str("a token id (u32), a string, or a list of token ids")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom(format!("token id {v} out of range")))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<PromptItem, E> {
                Err(E::custom(format!("token id {v} out of range")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<PromptItem, A::Error> {
                let mut v = Vec::with_capacity(a.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(t) = a.next_element::<u32>()? {
                    v.push(t);
                }
                Ok(PromptItem::Tokens(v))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
                f.write_str("a string, a list of token ids, a list of strings, or a list of lists")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Prompt, A::Error> {
                use serde::de::Error;
                let mixed = || A::Error::custom("prompt list mixes token ids, strings and lists");
                let Some(first) = a.next_element::<PromptItem>()? else {
                    return Ok(Prompt::Tokens(Vec::new()));
                };
                let hint = a.size_hint().unwrap_or(0).min(1 << 16);
                Ok(match first {
                    PromptItem::Token(t) => {
                        let mut v = Vec::with_capacity(hint + 1);
                        v.push(t);
                        while let Some(t) = a.next_element::<u32>()? {
                            v.push(t);
                        }
                        Prompt::Tokens(v)
                    }
                    PromptItem::Text(s) => {
                        let mut v = vec![s];
                        while let Some(item) = a.next_element::<PromptItem>()? {
                            match item {
                                PromptItem::Text(s) => v.push(s),
                                _ => return Err(mixed()),
                            }
                        }
                        Prompt::Texts(v)
                    }
                    PromptItem::Tokens(t) => {
                        let mut v = vec![t];
                        while let Some(item) = a.next_element::<PromptItem>()? {
                            match item {
                                PromptItem::Tokens(t) => v.push(t),
                                _ => return Err(mixed()),
                            }
                        }
                        Prompt::TokenLists(v)
                    }
                })
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
    /// Only its presence matters: a tokenizer cannot render tool calls it does not read.
    #[serde(default)]
    tool_calls: Option<serde::de::IgnoredAny>,
}

/// One chat message as a [`PromptTokenizer`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatTurn<'a> {
    pub role: Option<&'a str>,
    /// The text (a string content is one part; text parts of a list in order).
    pub parts: Vec<&'a str>,
    /// The content had parts that are not text (images, audio): the engine's tokens for them are unknown.
    pub non_text: bool,
    /// The message carries `tool_calls`.
    pub tool_calls: bool,
}

/// Turns text prompts into the engine's token ids. Returning None means "cannot do it exactly": the
/// request then gets the approximate identity (the implementation counts why).
pub trait PromptTokenizer {
    /// A `/v1/completions` text prompt.
    fn tokenize_text(&mut self, text: &str) -> Option<Vec<u32>>;
    /// A `/v1/chat/completions` conversation, chat template included.
    fn tokenize_chat(&mut self, turns: &[ChatTurn<'_>]) -> Option<Vec<u32>>;
}

/// The fields read; everything else in the body is ignored (clients send many more).
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    /// Kept raw: a flat token-id array is scanned by [`scan_token_ids`], anything else goes to serde.
    #[serde(default, borrow)]
    prompt: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    /// vLLM's per-request cache salt: blocks under another salt are never shared.
    #[serde(default)]
    cache_salt: Option<String>,
}

/// Endpoint for a `:path` (query string allowed).
pub fn endpoint(path: &str) -> Result<Endpoint, RequestError> {
    let p = path.split(['?', '#']).next().unwrap_or("");
    match p.trim_end_matches('/') {
        "/v1/completions" => Ok(Endpoint::Completions),
        "/v1/chat/completions" => Ok(Endpoint::ChatCompletions),
        _ => Err(RequestError::UnsupportedPath(
            path.chars().take(200).collect(),
        )),
    }
}

/// Reads a request body. `block_size` must be valid (the router checked it at configuration).
pub fn read_request(
    path: &str,
    body: &[u8],
    session_key: Option<&str>,
    block_size: usize,
    max_body_bytes: usize,
) -> Result<RouteRequest, RequestError> {
    read_request_with(path, body, session_key, block_size, max_body_bytes, None)
}

/// [`read_request`] with a tokenizer for text prompts.
pub fn read_request_with(
    path: &str,
    body: &[u8],
    session_key: Option<&str>,
    block_size: usize,
    max_body_bytes: usize,
    mut tokenizer: Option<&mut dyn PromptTokenizer>,
) -> Result<RouteRequest, RequestError> {
    if body.len() > max_body_bytes {
        return Err(RequestError::TooLarge {
            len: body.len(),
            max: max_body_bytes,
        });
    }
    let endpoint = endpoint(path)?;
    let text = core::str::from_utf8(body).map_err(|_| RequestError::NotUtf8)?;
    let json = |e: serde_json::Error| RequestError::Json(e.to_string());
    // Fast path for the common large body, a top-level token-id array: scan it directly and let serde
    // parse only the rest (with `"prompt": null`). Anything unusual takes the general path.
    let fast = match endpoint {
        Endpoint::Completions => split_token_prompt(text),
        Endpoint::ChatCompletions => None,
    };
    let rest_text;
    let (b, prompt): (Body, Option<Prompt>) = match fast {
        Some((tokens, rest)) => {
            rest_text = rest;
            let b: Body = serde_json::from_str(&rest_text).map_err(json)?;
            if b.prompt.is_some() {
                return Err(RequestError::Json("duplicate field `prompt`".into()));
            }
            (b, Some(Prompt::Tokens(tokens)))
        }
        None => {
            let b: Body = serde_json::from_str(text).map_err(json)?;
            let p = match b.prompt {
                Some(raw) => Some(parse_prompt(raw.get())?),
                None => None,
            };
            (b, p)
        }
    };
    let bad_size = |_| RequestError::BadPrompt("invalid block size");
    let (prompt_tokens, identity) = match (endpoint, prompt, b.messages) {
        (Endpoint::Completions, Some(p), _) => {
            let hasher = BlockHasher::new(block_size)
                .map_err(bad_size)?
                .namespaced(None, b.cache_salt.as_deref());
            let texter = TextHasher::new(block_size).map_err(bad_size)?;
            let mut exact_text = |s: &str| {
                tokenizer
                    .as_deref_mut()
                    .and_then(|t| t.tokenize_text(s))
                    .map(|ids| (ids.len() as u64, hasher.sequence_hashes(&ids)))
            };
            match p {
                Prompt::Text(s) => match exact_text(&s) {
                    Some((n, h)) => (n, PromptIdentity::Exact(h)),
                    None => text_identity(&texter, &[s.as_str()]),
                },
                Prompt::Texts(v) => {
                    let first = v
                        .first()
                        .ok_or(RequestError::BadPrompt("empty prompt list"))?;
                    if let Some((n, h)) = exact_text(first) {
                        // The batch's size is the first prompt's exact count plus the rest estimated.
                        let rest: usize = v[1..].iter().map(|s| s.chars().count()).sum();
                        return Ok(finish(
                            endpoint,
                            b.model,
                            b.stream,
                            b.max_completion_tokens.or(b.max_tokens),
                            session_key,
                            n + TextHasher::approx_tokens(rest) as u64,
                            PromptIdentity::Exact(h),
                        ));
                    }
                    let (_, id) = text_identity(&texter, &[first.as_str()]);
                    let chars: usize = v.iter().map(|s| s.chars().count()).sum();
                    (TextHasher::approx_tokens(chars) as u64, id)
                }
                Prompt::Tokens(t) => (
                    t.len() as u64,
                    PromptIdentity::Exact(hasher.sequence_hashes(&t)),
                ),
                Prompt::TokenLists(v) => {
                    let first = v
                        .first()
                        .ok_or(RequestError::BadPrompt("empty prompt list"))?;
                    let total: usize = v.iter().map(Vec::len).sum();
                    (
                        total as u64,
                        PromptIdentity::Exact(hasher.sequence_hashes(first)),
                    )
                }
            }
        }
        (Endpoint::ChatCompletions, _, Some(msgs)) if tokenizer.is_some() => {
            let turns: Vec<ChatTurn> = msgs.iter().map(chat_turn).collect();
            let exact = tokenizer.and_then(|t| t.tokenize_chat(&turns));
            match exact {
                Some(ids) => {
                    let hasher = BlockHasher::new(block_size)
                        .map_err(bad_size)?
                        .namespaced(None, b.cache_salt.as_deref());
                    (
                        ids.len() as u64,
                        PromptIdentity::Exact(hasher.sequence_hashes(&ids)),
                    )
                }
                None => chat_text_identity(block_size, &msgs)?,
            }
        }
        (Endpoint::ChatCompletions, _, Some(msgs)) => chat_text_identity(block_size, &msgs)?,
        _ => return Err(RequestError::MissingPrompt),
    };
    Ok(finish(
        endpoint,
        b.model,
        b.stream,
        b.max_completion_tokens.or(b.max_tokens),
        session_key,
        prompt_tokens,
        identity,
    ))
}

fn finish(
    endpoint: Endpoint,
    model: Option<String>,
    stream: Option<bool>,
    output_hint: Option<u64>,
    session_key: Option<&str>,
    prompt_tokens: u64,
    identity: PromptIdentity,
) -> RouteRequest {
    RouteRequest {
        endpoint,
        model,
        stream: stream.unwrap_or(false),
        output_hint,
        session_key: session_key.map(str::to_string),
        prompt_tokens,
        identity,
    }
}

fn chat_turn(m: &Message) -> ChatTurn<'_> {
    let mut parts = Vec::new();
    let mut non_text = false;
    match &m.content {
        Some(Content::Text(s)) => parts.push(s.as_str()),
        Some(Content::Parts(ps)) => {
            for p in ps {
                match (p.kind.as_deref(), &p.text) {
                    (None | Some("text"), Some(t)) => parts.push(t.as_str()),
                    _ => non_text = true,
                }
            }
        }
        None => {}
    }
    ChatTurn {
        role: m.role.as_deref(),
        parts,
        non_text,
        tool_calls: m.tool_calls.is_some(),
    }
}

/// The approximate identity of a conversation: each message's role and text parts, framed.
fn chat_text_identity(
    block_size: usize,
    msgs: &[Message],
) -> Result<(u64, PromptIdentity), RequestError> {
    let texter =
        TextHasher::new(block_size).map_err(|_| RequestError::BadPrompt("invalid block size"))?;
    let mut parts: Vec<&str> = Vec::with_capacity(msgs.len() * 4);
    for m in msgs {
        parts.push("<|");
        parts.push(m.role.as_deref().unwrap_or(""));
        parts.push("|>");
        match &m.content {
            Some(Content::Text(s)) => parts.push(s),
            Some(Content::Parts(ps)) => {
                for p in ps {
                    if p.kind.as_deref().is_none_or(|k| k == "text")
                        && let Some(t) = &p.text
                    {
                        parts.push(t);
                    }
                }
            }
            None => {}
        }
        parts.push("\n");
    }
    Ok(text_identity(&texter, &parts))
}

/// Finds a top-level `"prompt"` whose value is a flat array of token ids. Returns the ids and the body
/// with that array replaced by `null`, or None when the body has any other shape (an escaped key, a
/// prompt of another kind, two prompts, structural oddities): the general parser then handles it,
/// errors included. Only the prompt array is interpreted here; the rest is validated by serde.
fn split_token_prompt(text: &str) -> Option<(Vec<u32>, String)> {
    let b = text.as_bytes();
    let ws = |i: &mut usize| {
        while *i < b.len() && matches!(b[*i], b' ' | b'\n' | b'\r' | b'\t') {
            *i += 1;
        }
    };
    let mut i = 0;
    ws(&mut i);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut found: Option<(usize, usize, Vec<u32>)> = None;
    loop {
        ws(&mut i);
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_start = i + 1;
        let key_len = b
            .get(key_start..)?
            .iter()
            .position(|&c| c == b'"' || c == b'\\')?;
        let key_end = key_start + key_len;
        if b[key_end] != b'"' {
            return None; // an escaped key: leave it to serde
        }
        i = key_end + 1;
        ws(&mut i);
        if b.get(i) != Some(&b':') {
            return None;
        }
        i += 1;
        ws(&mut i);
        let start = i;
        if &b[key_start..key_end] == b"prompt" {
            if found.is_some() {
                return None;
            }
            // One pass reads the ids and finds the end of the array.
            let (tokens, end) = scan_token_ids_at(b, i)?;
            i = end;
            found = Some((start, end, tokens));
        } else {
            i = skip_value(b, i)?;
        }
        ws(&mut i);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b'}') => {
                i += 1;
                break;
            }
            _ => return None,
        }
    }
    ws(&mut i);
    if i != b.len() {
        return None;
    }
    let (s, e, tokens) = found?;
    let mut rest = String::with_capacity(b.len() - (e - s) + 4);
    rest.push_str(&text[..s]);
    rest.push_str("null");
    rest.push_str(&text[e..]);
    Some((tokens, rest))
}

/// Index just past the JSON value starting at `i` (structure only: strings with escapes, nesting,
/// scalars up to a delimiter). None at end of input.
fn skip_value(b: &[u8], mut i: usize) -> Option<usize> {
    let skip_string = |mut i: usize| -> Option<usize> {
        i += 1;
        loop {
            match *b.get(i)? {
                b'"' => return Some(i + 1),
                b'\\' => i += 2,
                _ => i += 1,
            }
        }
    };
    match *b.get(i)? {
        b'"' => skip_string(i),
        b'[' | b'{' => {
            let mut depth = 0usize;
            loop {
                match *b.get(i)? {
                    b'"' => {
                        i = skip_string(i)?;
                        continue;
                    }
                    b'[' | b'{' => depth += 1,
                    b']' | b'}' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
        }
        _ => {
            let start = i;
            while i < b.len() && !matches!(b[i], b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')
            {
                i += 1;
            }
            (i > start).then_some(i)
        }
    }
}

/// The `prompt` value: the flat token-id array fast path, else serde (which also words the errors).
fn parse_prompt(raw: &str) -> Result<Prompt, RequestError> {
    if let Some(tokens) = scan_token_ids(raw.as_bytes()) {
        return Ok(Prompt::Tokens(tokens));
    }
    serde_json::from_str(raw).map_err(|e| RequestError::Json(format!("prompt: {e}")))
}

/// Scans a JSON array of plain non-negative integers that fit in `u32` (`[1, 2,3 ]`). Returns None for
/// anything else (signs, fractions, exponents, nesting, strings, overflow, bad syntax), leaving the
/// general parser to accept or word the error. serde_json spends most of an 8K-token body on its
/// general number parsing; this loop is a few instructions a byte.
fn scan_token_ids(b: &[u8]) -> Option<Vec<u32>> {
    let ws = |c: u8| matches!(c, b' ' | b'\n' | b'\r' | b'\t');
    let mut i = 0;
    while i < b.len() && ws(b[i]) {
        i += 1;
    }
    let (out, mut i) = scan_token_ids_at(b, i)?;
    while i < b.len() && ws(b[i]) {
        i += 1;
    }
    (i == b.len()).then_some(out)
}

/// Reads a flat token-id array starting at `b[i] == '['`; returns the ids and the index past `]`.
fn scan_token_ids_at(b: &[u8], mut i: usize) -> Option<(Vec<u32>, usize)> {
    let ws = |c: u8| matches!(c, b' ' | b'\n' | b'\r' | b'\t');
    if b.get(i) != Some(&b'[') {
        return None;
    }
    i += 1;
    // A token id is at least 2 bytes with its comma: never reserve more than the text could hold.
    let mut out = Vec::with_capacity((b.len() - i) / 2);
    loop {
        while i < b.len() && ws(b[i]) {
            i += 1;
        }
        if b.get(i) == Some(&b']') && out.is_empty() {
            i += 1;
            break;
        }
        let start = i;
        let mut v: u64 = 0;
        while let Some(&c) = b.get(i) {
            if !c.is_ascii_digit() {
                break;
            }
            v = v * 10 + (c - b'0') as u64;
            if v > u32::MAX as u64 {
                return None;
            }
            i += 1;
        }
        let digits = i - start;
        // JSON forbids leading zeros ("01").
        if digits == 0 || (digits > 1 && b[start] == b'0') {
            return None;
        }
        out.push(v as u32);
        while i < b.len() && ws(b[i]) {
            i += 1;
        }
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b']') => {
                i += 1;
                break;
            }
            _ => return None,
        }
    }
    Some((out, i))
}

/// Approximate identity of the concatenation of `parts` (without building it when it is one part).
fn text_identity(texter: &TextHasher, parts: &[&str]) -> (u64, PromptIdentity) {
    let joined;
    let text: &str = if parts.len() == 1 {
        parts[0]
    } else {
        joined = parts.concat();
        &joined
    };
    let mut out = Vec::new();
    let chars = texter.extend(None, text, &mut out);
    (
        TextHasher::approx_tokens(chars) as u64,
        PromptIdentity::Approximate(out),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(path: &str, body: &str) -> Result<RouteRequest, RequestError> {
        read_request(path, body.as_bytes(), Some("s1"), 4, 1 << 20)
    }

    #[test]
    fn token_prompt_is_exact() {
        let r = read(
            "/v1/completions?x=1",
            r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9],"max_tokens":7,"stream":true,"extra":{"a":[1]}}"#,
        )
        .unwrap();
        assert_eq!(r.prompt_tokens, 9);
        assert_eq!(r.output_hint, Some(7));
        assert!(r.stream);
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.session_key.as_deref(), Some("s1"));
        let h = BlockHasher::new(4).unwrap();
        assert_eq!(
            r.identity,
            PromptIdentity::Exact(h.sequence_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]))
        );
    }

    #[test]
    fn prompt_lists_and_text() {
        let r = read("/v1/completions", r#"{"prompt":[[1,2,3,4],[5,6]]}"#).unwrap();
        assert_eq!(r.prompt_tokens, 6);
        assert_eq!(r.identity.blocks(), 1);
        let r = read("/v1/completions", r#"{"prompt":"abcdefghijklmnopq"}"#).unwrap();
        assert_eq!(r.prompt_tokens, 5);
        assert!(matches!(r.identity, PromptIdentity::Approximate(ref v) if v.len() == 1));
        let r = read("/v1/completions", r#"{"prompt":["abcd","ef"]}"#).unwrap();
        assert_eq!(r.prompt_tokens, 2);
        // cache_salt changes the exact identity.
        let a = read("/v1/completions", r#"{"prompt":[1,2,3,4]}"#).unwrap();
        let b = read(
            "/v1/completions",
            r#"{"prompt":[1,2,3,4],"cache_salt":"x"}"#,
        )
        .unwrap();
        assert_ne!(a.identity, b.identity);
    }

    #[test]
    fn chat_messages_share_prefixes() {
        let a = read(
            "/v1/chat/completions",
            r#"{"messages":[{"role":"system","content":"You are a helpful assistant, always."},
                {"role":"user","content":[{"type":"text","text":"hello"},{"type":"image_url","image_url":{"url":"x"}}]}],
                "max_completion_tokens":5,"max_tokens":9}"#,
        )
        .unwrap();
        let b = read(
            "/v1/chat/completions",
            r#"{"messages":[{"role":"system","content":"You are a helpful assistant, always."},
                {"role":"user","content":"something else entirely"}]}"#,
        )
        .unwrap();
        assert_eq!(a.output_hint, Some(5));
        let (PromptIdentity::Approximate(x), PromptIdentity::Approximate(y)) =
            (&a.identity, &b.identity)
        else {
            panic!("text prompts are approximate")
        };
        assert!(x.len() >= 2 && y.len() >= 2);
        assert_eq!(x[0], y[0]);
    }

    #[test]
    fn token_scanner_agrees_with_serde_or_defers() {
        for s in [
            "[]",
            "[ ]",
            "[0]",
            " [1,2 ,3]\n",
            "[4294967295]",
            "[4294967296]",
            "[01]",
            "[-1]",
            "[1.0]",
            "[1e3]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[\"a\"]",
            "[[1]]",
            "[1]x",
            "",
            "[",
            "[1,2",
        ] {
            let fast = scan_token_ids(s.as_bytes());
            let slow: Option<Vec<u32>> = serde_json::from_str(s).ok();
            if let Some(f) = &fast {
                assert_eq!(Some(f), slow.as_ref(), "{s:?}");
            }
        }
        assert_eq!(scan_token_ids(b"[7, 8]"), Some(vec![7, 8]));
        assert_eq!(scan_token_ids(b"[4294967296]"), None);
    }

    #[test]
    fn bad_bodies_are_typed_errors() {
        assert!(matches!(
            read_request("/v1/completions", &[b'{'; 100], None, 4, 10),
            Err(RequestError::TooLarge { len: 100, max: 10 })
        ));
        assert!(matches!(
            read("/v1/embeddings", "{}"),
            Err(RequestError::UnsupportedPath(_))
        ));
        assert!(matches!(
            read_request("/v1/completions", b"{\"prompt\":\"\xff\"}", None, 4, 100),
            Err(RequestError::NotUtf8)
        ));
        assert!(matches!(
            read("/v1/completions", "{\"prompt\":[1,2"),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            read("/v1/completions", "{}"),
            Err(RequestError::MissingPrompt)
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":[]}"#),
            Ok(RouteRequest {
                prompt_tokens: 0,
                ..
            })
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":[1,"a"]}"#),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":["a",[1]]}"#),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":[-1]}"#),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":[4294967296]}"#),
            Err(RequestError::Json(_))
        ));
        let deep = "[".repeat(10_000);
        assert!(read("/v1/completions", &format!("{{\"prompt\":{deep}")).is_err());
        assert!(matches!(
            read("/v1/chat/completions", r#"{"prompt":"x"}"#),
            Err(RequestError::MissingPrompt)
        ));
    }
}
