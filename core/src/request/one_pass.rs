//! The one-pass request reader: finds the fields routing needs and reads the prompt in a single pass
//! over the body, without building a JSON tree. Token ids are parsed as they go by, a 64-byte window
//! at a time ([`token_ids::token_id_window`]), and each block is hashed as soon as its last id is
//! read, so the list of ids is never stored; text is borrowed from the body unless it has escapes
//! ([`escapes`] where it has).
//!
//! It reads the shapes clients send: a top-level object whose known fields (`model`, `stream`,
//! `max_tokens`, `max_completion_tokens`, `cache_salt`, `prompt`, `messages`, `tools`) hold the values
//! their types allow, and every other field any valid JSON value, which is validated as it is
//! skipped. For anything else it answers None, and the general serde_json reader (`general`) reads
//! the body instead: a body that is not an object, an escaped key, a known field twice, a number
//! with a sign, fraction or exponent where an integer belongs, a lone surrogate escape, any
//! malformed or truncated JSON, invalid UTF-8. So it never has to word an error, and on every body
//! it either gives the general reader's result or leaves the body to it (property tests in
//! `core/tests/request_props.rs` check both, against the general reader).
//!
//! Hostile bytes: every index is checked (no panics), each byte is looked at a bounded number of
//! times (a token-id prompt twice at most, when its `cache_salt` comes after it; the bytes of the id
//! at a window's edge are classified again by the next window), and nesting
//! deeper than [`MAX_DEPTH`] is left to serde_json, whose recursion limit (128) then applies.

use std::borrow::Cow;

use super::early::Resume;
use super::{
    ChatTurn, Endpoint, PromptRead, PromptTokenizer, RequestError, RouteRequest, finish, identify,
};
use crate::block::{BlockHasher, SeqHash, SequenceBuilder};

mod escapes;
mod token_ids;

use escapes::{hex_escape, unescape};
pub(super) use token_ids::{IdStop, id_run};
use token_ids::{token_id, word};

/// Nesting the one-pass reader follows; deeper bodies go to serde_json (below its limit of 128, so
/// the two never disagree on where nesting becomes an error).
const MAX_DEPTH: usize = 64;

const ONES: u64 = 0x0101_0101_0101_0101;
const HIGH: u64 = 0x8080_8080_8080_8080;

/// Reads `body`; None leaves it to the general reader (see the module docs).
pub(super) fn read(
    endpoint: Endpoint,
    body: &[u8],
    session_key: Option<&str>,
    block_size: usize,
    tokenizer: Option<&mut dyn PromptTokenizer>,
    early: Option<Resume>,
    adapters: Option<&crate::adapters::AdapterParams>,
) -> Option<Result<RouteRequest, RequestError>> {
    let plain = BlockHasher::new(block_size).ok()?;
    let mut s = Scanner {
        b: body,
        i: 0,
        early,
    };
    let f = s.body(&plain)?;
    let salt = f.cache_salt.flatten();
    let model = f.model.flatten();
    let lora = adapters.and_then(|a| a.adapter_of(model.as_deref()));
    let hasher = plain.namespaced(lora, salt.as_deref());
    let mut prompt = final_prompt(body, f.prompt.flatten(), &hasher)?;
    let read = prompt.as_mut().map(|p| match p {
        Final::Text(t) => PromptRead::Text(t),
        Final::Texts { first, rest_chars } => PromptRead::Texts {
            first: Some(&**first),
            rest_chars: *rest_chars,
        },
        Final::Tokens { count, hashes } => PromptRead::Tokens {
            count: *count,
            hashes: std::mem::take(hashes),
        },
    });
    let messages = f.messages.flatten();
    let turns: Option<Vec<ChatTurn>> = messages.as_ref().map(|ms| {
        ms.iter()
            .map(|m| ChatTurn {
                role: m.role.as_deref(),
                parts: m.parts.iter().map(|p| p.as_ref()).collect(),
                non_text: m.non_text,
                tool_calls: m.tool_calls,
            })
            .collect()
    });
    let identity = identify(
        endpoint,
        read,
        (turns.as_deref(), f.tools.flatten()),
        (lora, salt.as_deref()),
        block_size,
        tokenizer,
    );
    Some(identity.map(|(prompt_tokens, identity)| {
        finish(
            endpoint,
            model.clone().map(Cow::into_owned),
            f.stream.flatten(),
            f.max_completion_tokens.flatten().or(f.max_tokens.flatten()),
            session_key,
            prompt_tokens,
            identity,
        )
    }))
}

/// The prompt once its hashes are final (a batch of token-id lists is identified and sized as
/// [`PromptRead::Tokens`] would be: the first list's hashes, the ids of all).
enum Final<'a> {
    Text(Cow<'a, str>),
    Texts {
        first: Cow<'a, str>,
        rest_chars: usize,
    },
    Tokens {
        count: u64,
        hashes: Vec<SeqHash>,
    },
}

/// The prompt as the request's namespace (its salt and adapter) identifies it: token ids hashed
/// before that namespace was known are read again under it. `None`: a re-read failed (the bytes
/// changed), left to the general reader.
fn final_prompt<'a>(
    body: &[u8],
    scan: Option<PromptScan<'a>>,
    hasher: &BlockHasher,
) -> Option<Option<Final<'a>>> {
    Some(match scan {
        None => None,
        Some(PromptScan::Text(t)) => Some(Final::Text(t)),
        Some(PromptScan::Texts { first, rest_chars }) => Some(Final::Texts { first, rest_chars }),
        // Hashed before the salt or the adapter was known: read the array again under the
        // request's namespace.
        Some(PromptScan::Tokens { at, ids }) => {
            let ids = if ids.seed != hasher.seed() {
                rehash(body, at, hasher, false)?
            } else {
                ids.builder
            };
            Some(Final::Tokens {
                count: ids.tokens(),
                hashes: ids.finish(),
            })
        }
        Some(PromptScan::TokenLists { at, count, first }) => {
            let first = if first.seed != hasher.seed() {
                rehash(body, at, hasher, true)?
            } else {
                first.builder
            };
            Some(Final::Tokens {
                count,
                hashes: first.finish(),
            })
        }
    })
}

/// Hashes the token ids of the array at `at` (the first inner array when `first_list`) again under
/// `hasher`; the bytes were read once already, so this cannot fail unless they changed.
fn rehash(
    body: &[u8],
    at: usize,
    hasher: &BlockHasher,
    first_list: bool,
) -> Option<SequenceBuilder> {
    let mut s = Scanner {
        b: body,
        i: at,
        early: None,
    };
    if first_list {
        s.i += 1;
        s.ws();
    }
    s.token_ids(hasher.builder())
}

/// Token ids with the seed they were hashed under.
struct Hashed {
    seed: u64,
    builder: SequenceBuilder,
}

/// The `prompt` as scanned.
enum PromptScan<'a> {
    Text(Cow<'a, str>),
    Texts {
        first: Cow<'a, str>,
        rest_chars: usize,
    },
    /// A flat array of token ids starting at byte `at`.
    Tokens {
        at: usize,
        ids: Hashed,
    },
    /// A batch of token-id lists starting at byte `at`: the ids in all, the first list hashed.
    TokenLists {
        at: usize,
        count: u64,
        first: Hashed,
    },
}

/// One chat message as scanned.
struct Message<'a> {
    role: Option<Cow<'a, str>>,
    parts: Vec<Cow<'a, str>>,
    non_text: bool,
    tool_calls: bool,
}

/// The fields read. The outer Option is "present" (a second occurrence is serde's duplicate-field
/// error, so it is left to serde), the inner one is JSON `null`.
#[derive(Default)]
struct Fields<'a> {
    model: Option<Option<Cow<'a, str>>>,
    stream: Option<Option<bool>>,
    max_tokens: Option<Option<u64>>,
    max_completion_tokens: Option<Option<u64>>,
    cache_salt: Option<Option<Cow<'a, str>>>,
    prompt: Option<Option<PromptScan<'a>>>,
    messages: Option<Option<Vec<Message<'a>>>>,
    /// `tools`: the raw JSON text of the value, validated as it was skipped.
    tools: Option<Option<&'a str>>,
}

/// Sets a field seen for the first time; None (leave it to serde) when it was seen already.
fn once<T>(slot: &mut Option<T>, value: T) -> Option<()> {
    if slot.is_some() {
        return None;
    }
    *slot = Some(value);
    Some(())
}

fn is_ws(c: u8) -> bool {
    matches!(c, b' ' | b'\n' | b'\r' | b'\t')
}

/// Where a string's bytes end: the first `"`, `\` or control character among the eight bytes of
/// `w` (as a mask with the high bit of each such byte; the lowest set bit is exact).
#[inline]
fn string_stops(w: u64) -> u64 {
    let quote = w ^ (b'"' as u64 * ONES);
    let backslash = w ^ (b'\\' as u64 * ONES);
    let zero = |v: u64| v.wrapping_sub(ONES) & !v;
    (zero(quote) | zero(backslash) | w.wrapping_sub(0x20 * ONES) & !w) & HIGH
}

pub(super) struct Scanner<'a> {
    pub(super) b: &'a [u8],
    pub(super) i: usize,
    /// What an early scan read of the prompt's token ids while the body arrived, taken by the
    /// prompt it belongs to ([`super::early`]).
    pub(super) early: Option<Resume>,
}

impl<'a> Scanner<'a> {
    pub(super) fn ws(&mut self) {
        while self.b.get(self.i).is_some_and(|&c| is_ws(c)) {
            self.i += 1;
        }
    }

    pub(super) fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    /// After a member or element: `,` (true: another follows) or `close` (false).
    pub(super) fn next_or_close(&mut self, close: u8) -> Option<bool> {
        self.ws();
        match self.peek()? {
            b',' => {
                self.i += 1;
                self.ws();
                Some(true)
            }
            c if c == close => {
                self.i += 1;
                Some(false)
            }
            _ => None,
        }
    }

    /// The top-level object.
    fn body(&mut self, plain: &BlockHasher) -> Option<Fields<'a>> {
        let mut f = Fields::default();
        self.ws();
        if self.peek()? != b'{' {
            return None;
        }
        self.i += 1;
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
        } else {
            loop {
                let key = self.key()?;
                match key {
                    b"model" => {
                        let v = self.nullable(|s| s.string())?;
                        once(&mut f.model, v)?
                    }
                    b"stream" => {
                        let v = self.nullable(|s| s.boolean())?;
                        once(&mut f.stream, v)?
                    }
                    b"max_tokens" => {
                        let v = self.nullable(|s| s.unsigned())?;
                        once(&mut f.max_tokens, v)?
                    }
                    b"max_completion_tokens" => {
                        let v = self.nullable(|s| s.unsigned())?;
                        once(&mut f.max_completion_tokens, v)?
                    }
                    b"cache_salt" => {
                        let v = self.nullable(|s| s.string())?;
                        once(&mut f.cache_salt, v)?
                    }
                    b"prompt" => {
                        if f.prompt.is_some() {
                            return None;
                        }
                        // Hash under the namespace known so far; `read` hashes again if a
                        // `cache_salt` comes later.
                        let salt = f.cache_salt.as_ref().and_then(|s| s.as_deref());
                        let hasher = plain.namespaced(None, salt);
                        let v = self.nullable(|s| s.prompt(&hasher))?;
                        once(&mut f.prompt, v)?
                    }
                    b"messages" => {
                        let v = self.nullable(|s| s.messages())?;
                        once(&mut f.messages, v)?
                    }
                    b"tools" => once(&mut f.tools, self.nullable(|s| s.raw())?)?,
                    _ => self.skip(1)?,
                }
                if !self.next_or_close(b'}')? {
                    break;
                }
            }
        }
        self.ws();
        (self.i == self.b.len()).then_some(f)
    }

    /// An object key without escapes and the `:` after it; returns the key's bytes.
    pub(super) fn key(&mut self) -> Option<&'a [u8]> {
        if self.peek()? != b'"' {
            return None;
        }
        let (start, end, escaped) = self.string_span(true)?;
        if escaped {
            return None;
        }
        self.ws();
        if self.peek()? != b':' {
            return None;
        }
        self.i += 1;
        self.ws();
        self.b.get(start..end)
    }

    /// `null` (Some(None)) or what `value` reads.
    pub(super) fn nullable<T>(
        &mut self,
        value: impl FnOnce(&mut Self) -> Option<T>,
    ) -> Option<Option<T>> {
        if self.peek()? == b'n' {
            self.literal(b"null")?;
            return Some(None);
        }
        value(self).map(Some)
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i.checked_add(word.len())?;
        if self.b.get(self.i..end)? != word {
            return None;
        }
        self.i = end;
        Some(())
    }

    fn boolean(&mut self) -> Option<bool> {
        match self.peek()? {
            b't' => self.literal(b"true").map(|_| true),
            b'f' => self.literal(b"false").map(|_| false),
            _ => None,
        }
    }

    /// A JSON integer that fits in `u64` (what serde reads into one; anything else is its error).
    fn unsigned(&mut self) -> Option<u64> {
        let start = self.i;
        let mut v: u64 = 0;
        while let Some(c) = self.peek().filter(u8::is_ascii_digit) {
            v = v.checked_mul(10)?.checked_add((c - b'0') as u64)?;
            self.i += 1;
        }
        let digits = self.i - start;
        if digits == 0 || (digits > 1 && self.b.get(start) == Some(&b'0')) {
            return None;
        }
        // A fraction or exponent makes it a float, which serde refuses for an integer field.
        if matches!(self.peek(), Some(b'.' | b'e' | b'E')) {
            return None;
        }
        Some(v)
    }

    /// A string at `"`: the span of its raw bytes (between the quotes) and whether it has escapes.
    /// Validates it as serde_json does (escapes well formed, no control characters); with
    /// `utf8_checked` its bytes are checked as UTF-8 here when they are not all ASCII (a caller
    /// that turns the span into a `str` checks them itself).
    fn string_span(&mut self, utf8_checked: bool) -> Option<(usize, usize, bool)> {
        let b = self.b;
        let start = self.i + 1;
        let mut i = start;
        let mut escaped = false;
        // The OR of the bytes looked at: its high bits say whether any was not ASCII.
        let mut high = 0u64;
        loop {
            while let Some(w) = word(b, i) {
                let stops = string_stops(w);
                if stops != 0 {
                    let n = stops.trailing_zeros() / 8;
                    high |= w & ((1u64 << (8 * n)) - 1);
                    i += n as usize;
                    break;
                }
                high |= w;
                i += 8;
            }
            let c = *b.get(i)?;
            match c {
                b'"' => break,
                b'\\' => {
                    escaped = true;
                    match *b.get(i + 1)? {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => i += 2,
                        b'u' => {
                            // A surrogate must come as a pair, high then low, as serde_json reads
                            // it into a string (a skipped string too: the general reader builds
                            // every value).
                            match hex_escape(b, i)? {
                                0xD800..=0xDBFF => match hex_escape(b, i + 6)? {
                                    0xDC00..=0xDFFF => i += 12,
                                    _ => return None,
                                },
                                0xDC00..=0xDFFF => return None,
                                _ => i += 6,
                            }
                        }
                        _ => return None,
                    }
                }
                0..0x20 => return None,
                _ => {
                    high |= c as u64;
                    i += 1;
                }
            }
        }
        if utf8_checked && high & HIGH != 0 {
            core::str::from_utf8(b.get(start..i)?).ok()?;
        }
        self.i = i + 1;
        Some((start, i, escaped))
    }

    /// A string's value: borrowed from the body when it has no escapes.
    pub(super) fn string(&mut self) -> Option<Cow<'a, str>> {
        if self.peek()? != b'"' {
            return None;
        }
        let (start, end, escaped) = self.string_span(false)?;
        let raw = core::str::from_utf8(self.b.get(start..end)?).ok()?;
        if !escaped {
            return Some(Cow::Borrowed(raw));
        }
        unescape(raw).map(Cow::Owned)
    }

    /// The `prompt` in one of its four shapes.
    fn prompt(&mut self, hasher: &BlockHasher) -> Option<PromptScan<'a>> {
        match self.peek()? {
            b'"' => return self.string().map(PromptScan::Text),
            b'[' => {}
            _ => return None,
        }
        let at = self.i;
        self.i += 1;
        self.ws();
        match self.peek()? {
            b']' | b'0'..=b'9' => {
                self.i = at;
                if let Some(r) = self
                    .early
                    .take_if(|r| r.at == at && r.seed == hasher.seed())
                {
                    let ids = match r.stop {
                        IdStop::Closed(end) => {
                            self.i = end;
                            r.builder
                        }
                        IdStop::Paused(i) => self.ids_from(i, r.builder)?,
                    };
                    return Some(PromptScan::Tokens {
                        at,
                        ids: Hashed {
                            seed: hasher.seed(),
                            builder: ids,
                        },
                    });
                }
                let mut ids = hasher.builder();
                // Room for the hashes of ids of four bytes or more, at most 2^18 ids' worth: enough
                // for most prompts without one regrowth, and a body of anything else (4 MiB of
                // other fields, block size 1) cannot make the VM's memory grow much for nothing.
                ids.reserve_tokens(((self.b.len() - at) / 4).min(1 << 18));
                let ids = self.token_ids(ids)?;
                Some(PromptScan::Tokens {
                    at,
                    ids: Hashed {
                        seed: hasher.seed(),
                        builder: ids,
                    },
                })
            }
            b'"' => {
                let first = self.string()?;
                let mut rest_chars = 0usize;
                while self.next_or_close(b']')? {
                    rest_chars += self.string()?.chars().count();
                }
                Some(PromptScan::Texts { first, rest_chars })
            }
            b'[' => {
                let first = self.token_ids(hasher.builder())?;
                let mut count = first.tokens();
                while self.next_or_close(b']')? {
                    if self.peek()? != b'[' {
                        return None;
                    }
                    count += self.count_token_ids()?;
                }
                Some(PromptScan::TokenLists {
                    at,
                    count,
                    first: Hashed {
                        seed: hasher.seed(),
                        builder: first,
                    },
                })
            }
            _ => None,
        }
    }

    /// A flat array of token ids at `[`, each pushed into `ids` (so hashed block by block).
    fn token_ids(&mut self, ids: SequenceBuilder) -> Option<SequenceBuilder> {
        self.i += 1;
        self.ws();
        if self.peek()? == b']' {
            self.i += 1;
            return Some(ids);
        }
        self.ids_from(self.i, ids)
    }

    /// The id loop ([`id_run`]) from `i` to the array's end, which it leaves the scanner past.
    fn ids_from(&mut self, i: usize, ids: SequenceBuilder) -> Option<SequenceBuilder> {
        match id_run::<false>(self.b, i, ids, usize::MAX)? {
            (ids, IdStop::Closed(end)) => {
                self.i = end;
                Some(ids)
            }
            // Never without a pause mark.
            (_, IdStop::Paused(_)) => None,
        }
    }

    /// A flat array of token ids, counted (a batch's later prompts are sized, not hashed).
    fn count_token_ids(&mut self) -> Option<u64> {
        self.i += 1;
        self.ws();
        if self.peek()? == b']' {
            self.i += 1;
            return Some(0);
        }
        let mut n = 0u64;
        loop {
            let (_, next) = token_id(self.b, self.i)?;
            self.i = next;
            n += 1;
            if !self.next_or_close(b']')? {
                return Some(n);
            }
        }
    }

    /// `messages`: an array of message objects.
    fn messages(&mut self) -> Option<Vec<Message<'a>>> {
        if self.peek()? != b'[' {
            return None;
        }
        self.i += 1;
        self.ws();
        let mut out = Vec::new();
        if self.peek()? == b']' {
            self.i += 1;
            return Some(out);
        }
        loop {
            out.push(self.message()?);
            if !self.next_or_close(b']')? {
                return Some(out);
            }
        }
    }

    /// One message: `role`, `content` (a string or a list of parts) and whether it has `tool_calls`.
    fn message(&mut self) -> Option<Message<'a>> {
        let mut role = None;
        let mut content: Option<Option<(Vec<Cow<'a, str>>, bool)>> = None;
        let mut tool_calls = None;
        self.object(3, |s, key| match key {
            b"role" => {
                let v = s.nullable(|s| s.string())?;
                once(&mut role, v)
            }
            b"content" => {
                let v = s.nullable(|s| s.content())?;
                once(&mut content, v)
            }
            b"tool_calls" => {
                // Only its presence matters; its value is validated and skipped.
                let present = s.nullable(|s| s.skip(3))?.is_some();
                once(&mut tool_calls, present)
            }
            _ => s.skip(3),
        })?;
        let (parts, non_text) = content.flatten().unwrap_or_default();
        Some(Message {
            role: role.flatten(),
            parts,
            non_text,
            tool_calls: tool_calls.unwrap_or(false),
        })
    }

    /// A message's content: its text parts, and whether it had parts that are not text.
    fn content(&mut self) -> Option<(Vec<Cow<'a, str>>, bool)> {
        match self.peek()? {
            b'"' => return Some((vec![self.string()?], false)),
            b'[' => {}
            _ => return None,
        }
        self.i += 1;
        self.ws();
        let mut parts = Vec::new();
        let mut non_text = false;
        if self.peek()? == b']' {
            self.i += 1;
            return Some((parts, non_text));
        }
        loop {
            let mut kind: Option<Option<Cow<'a, str>>> = None;
            let mut text: Option<Option<Cow<'a, str>>> = None;
            self.object(5, |s, key| match key {
                b"type" => {
                    let v = s.nullable(|s| s.string())?;
                    once(&mut kind, v)
                }
                b"text" => {
                    let v = s.nullable(|s| s.string())?;
                    once(&mut text, v)
                }
                _ => s.skip(5),
            })?;
            match (kind.flatten(), text.flatten()) {
                (None, Some(t)) => parts.push(t),
                (Some(k), Some(t)) if k == "text" => parts.push(t),
                _ => non_text = true,
            }
            if !self.next_or_close(b']')? {
                return Some((parts, non_text));
            }
        }
    }

    /// An object at `{`, each member's value read by `member` (given the unescaped key).
    fn object(
        &mut self,
        depth: usize,
        mut member: impl FnMut(&mut Self, &'a [u8]) -> Option<()>,
    ) -> Option<()> {
        if self.peek()? != b'{' || depth > MAX_DEPTH {
            return None;
        }
        self.i += 1;
        self.ws();
        if self.peek()? == b'}' {
            self.i += 1;
            return Some(());
        }
        loop {
            let key = self.key()?;
            member(self, key)?;
            if !self.next_or_close(b'}')? {
                return Some(());
            }
        }
    }

    /// Skips any JSON value nested `depth` deep, validating it as serde_json does when it ignores a
    /// value (string escapes and control characters, number syntax, literals, structure).
    /// Any JSON value, validated as [`Scanner::skip`] validates it; its text as it stands in the body.
    fn raw(&mut self) -> Option<&'a str> {
        let start = self.i;
        self.skip(1)?;
        core::str::from_utf8(self.b.get(start..self.i)?).ok()
    }

    pub(super) fn skip(&mut self, depth: usize) -> Option<()> {
        match self.peek()? {
            b'"' => self.string_span(true).map(|_| ()),
            b'{' => self.object(depth + 1, |s, _| s.skip(depth + 1)),
            b'[' => {
                if depth + 1 > MAX_DEPTH {
                    return None;
                }
                self.i += 1;
                self.ws();
                if self.peek()? == b']' {
                    self.i += 1;
                    return Some(());
                }
                loop {
                    self.skip(depth + 1)?;
                    if !self.next_or_close(b']')? {
                        return Some(());
                    }
                }
            }
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    /// Any JSON number: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`.
    fn number(&mut self) -> Option<()> {
        let digits = |s: &mut Self| {
            let start = s.i;
            while s.peek().is_some_and(|c| c.is_ascii_digit()) {
                s.i += 1;
            }
            s.i - start
        };
        if self.peek() == Some(b'-') {
            self.i += 1;
        }
        match self.peek()? {
            b'0' => self.i += 1,
            b'1'..=b'9' => {
                digits(self);
            }
            _ => return None,
        }
        if self.peek() == Some(b'.') {
            self.i += 1;
            if digits(self) == 0 {
                return None;
            }
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            if digits(self) == 0 {
                return None;
            }
        }
        Some(())
    }
}

#[cfg(test)]
mod tests;
