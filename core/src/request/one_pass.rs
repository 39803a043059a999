//! The one-pass request reader: finds the fields routing needs and reads the prompt in a single pass
//! over the body, without building a JSON tree. Token ids are parsed as they go by, a 64-byte window
//! at a time ([`token_id_window`]), and each block is hashed as soon as its last id is read, so the
//! list of ids is never stored; text is borrowed from the body unless it has escapes.
//!
//! It reads the shapes clients send: a top-level object whose known fields (`model`, `stream`,
//! `max_tokens`, `max_completion_tokens`, `cache_salt`, `prompt`, `messages`) hold the values
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
    let mut prompt = match f.prompt.flatten() {
        None => None,
        Some(PromptScan::Text(t)) => Some(Final::Text(t)),
        Some(PromptScan::Texts { first, rest_chars }) => Some(Final::Texts { first, rest_chars }),
        // Hashed before the salt or the adapter was known: read the array again under the
        // request's namespace.
        Some(PromptScan::Tokens { at, ids }) => {
            let ids = if ids.seed != hasher.seed() {
                rehash(body, at, &hasher, false)?
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
                rehash(body, at, &hasher, true)?
            } else {
                first.builder
            };
            Some(Final::Tokens {
                count,
                hashes: first.finish(),
            })
        }
    };
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
        turns.as_deref(),
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

/// Eight bytes starting at `i`, little-endian, if there are eight.
#[inline]
fn word(b: &[u8], i: usize) -> Option<u64> {
    let w: [u8; 8] = b.get(i..i.checked_add(8)?)?.try_into().ok()?;
    Some(u64::from_le_bytes(w))
}

/// The value of up to eight decimal digits held one a byte (0..=9), most significant in the lowest
/// byte, with leading zero bytes: three multiply-and-shift steps combine pairs, then quads, then
/// the two halves.
#[inline]
fn eight_digits(v: u64) -> u64 {
    let v = (v & 0x0F0F_0F0F_0F0F_0F0F).wrapping_mul(2561) >> 8;
    let v = (v & 0x00FF_00FF_00FF_00FF).wrapping_mul(6_553_601) >> 16;
    (v & 0x0000_FFFF_0000_FFFF).wrapping_mul(42_949_672_960_001) >> 32
}

/// A token id at `i`: a JSON integer that fits in `u32` (no sign, fraction, exponent or leading
/// zero); returns it and the index past its digits. Numbers of up to seven digits (every id of a
/// vocabulary under ten million) are read from one 8-byte word without a branch per digit.
#[inline]
fn token_id(b: &[u8], i: usize) -> Option<(u32, usize)> {
    if let Some(w) = word(b, i) {
        let x = w ^ (0x30 * ONES);
        // A byte's high bit is set here iff it is not an ASCII digit: x > 9 either has its own high
        // bit set or carries into it when 0x76 is added. Carries only move up, into later bytes,
        // so the lowest flagged byte is exactly the first non-digit.
        let non_digit = (x.wrapping_add(0x76 * ONES) | x) & HIGH;
        let n = (non_digit.trailing_zeros() / 8) as usize;
        if n == 0 || (n > 1 && x & 0xFF == 0) {
            return None;
        }
        if n < 8 {
            let v = eight_digits(x << (64 - 8 * n as u32));
            return Some((v as u32, i + n));
        }
    }
    let start = i;
    let mut i = i;
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
    if digits == 0 || (digits > 1 && b.get(start) == Some(&b'0')) {
        return None;
    }
    Some((v as u32, i))
}

/// Bit `k` set iff byte `k` of `w` is an ASCII digit. Each byte is tested on its own (the sums
/// cannot carry out of a byte: 0x7F + 0x50 < 0x100), then the eight high bits are gathered into
/// one byte by a multiply whose partial products land on distinct bits.
#[inline]
// A SIMD128 build reads windows with `window_digits`'s vector form; the tests still check this one.
#[cfg_attr(
    all(target_family = "wasm", target_feature = "simd128"),
    allow(dead_code)
)]
fn digit_bits(w: u64) -> u64 {
    const LOW7: u64 = 0x7F * ONES;
    let y = w & LOW7;
    let at_least_0 = y + (0x80 - b'0' as u64) * ONES;
    let above_9 = y + (0x80 - b'9' as u64 - 1) * ONES;
    let high = at_least_0 & !above_9 & !w & HIGH;
    high.wrapping_mul(0x0002_0408_1020_4081) >> 56
}

/// The digit mask of a 64-byte window (bit `k` set iff byte `k` is an ASCII digit), from its eight
/// little-endian words `at(0)`, `at(8)`, ... `at(56)`.
#[cfg(not(all(target_family = "wasm", target_feature = "simd128")))]
#[inline(always)]
fn window_digits(at: &impl Fn(usize) -> u64) -> u64 {
    let mut digits = 0u64;
    for k in 0..8 {
        digits |= digit_bits(at(8 * k)) << (8 * k);
    }
    digits
}

/// [`window_digits`] with WebAssembly SIMD128, in builds that enable it
/// (`RUSTFLAGS="-C target-feature=+simd128"`; the release build does not, so that it runs on any
/// runtime): 16 bytes a step, a wrapping subtract and an unsigned compare, `bitmask` for the bits.
#[cfg(all(target_family = "wasm", target_feature = "simd128"))]
#[inline(always)]
fn window_digits(at: &impl Fn(usize) -> u64) -> u64 {
    use core::arch::wasm32::{u8x16_bitmask, u8x16_lt, u8x16_splat, u8x16_sub, u64x2};
    let mut digits = 0u64;
    for k in 0..4 {
        let v = u64x2(at(16 * k), at(16 * k + 8));
        let d = u8x16_lt(u8x16_sub(v, u8x16_splat(b'0')), u8x16_splat(10));
        digits |= (u8x16_bitmask(d) as u64) << (16 * k);
    }
    digits
}

/// Reads the token ids that start in the 64 bytes at `i` (a number's first digit), as long as each
/// is followed by `,` or `, ` and then another number in the window; pushes them into `ids` and
/// returns where the first id it did not read starts (`i` when it read none: the caller's
/// one-id-at-a-time loop then reads it, and anything unusual: the end of the array, other
/// whitespace, ids of eight or more digits, anything that is not JSON).
///
/// Why: one id at a time, finding where an id ends is a chain (load, classify, count, advance)
/// that the next id waits for. Here the window's digit positions are found first, eight bytes a
/// step, and the ids' starts and ends come from that mask by clearing its lowest bits, so the
/// ids' conversions do not wait on each other.
#[inline]
fn token_id_window(b: &[u8], i: usize, ids: &mut SequenceBuilder) -> usize {
    // Eight bytes past the window for the last id's 8-byte load. A fixed-size array and indices
    // masked to the window let the compiler drop the bounds checks from the loop.
    let Some(bytes) = b.get(i..i.saturating_add(72)) else {
        return i;
    };
    let Ok(bytes) = <&[u8; 72]>::try_from(bytes) else {
        return i;
    };
    let at = |k: usize| -> u64 {
        let k = k & 63;
        let mut w = [0u8; 8];
        w.copy_from_slice(&bytes[k..k + 8]);
        u64::from_le_bytes(w)
    };
    let digits = window_digits(&at);
    let mut starts = digits & !(digits << 1);
    let mut ends = digits & !(digits >> 1);
    if starts & 1 == 0 {
        return i;
    }
    starts &= starts - 1;
    let mut s = 0usize;
    ids.extend_with(|| {
        if starts == 0 {
            return None;
        }
        let next = starts.trailing_zeros() as usize;
        let last = ends.trailing_zeros() as usize;
        let n = last + 1 - s;
        let x = at(s) ^ (0x30 * ONES);
        // Eight digits or more, or a leading zero: left to `token_id`.
        if n > 7 || (n > 1 && x & 0xFF == 0) {
            return None;
        }
        // What follows the id: "," then the next id, or ", " then the next id, read from the
        // id's own word (digits and separators XORed with b'0' alike). `sep` is zero in the low
        // byte iff a comma follows, and in the low two bytes iff a comma and a space do (an id of
        // seven digits has no room for the space in its word: zero shifted in, so it fails and
        // `token_id` reads it); shifted up by a byte when the gap is one byte, its low two bytes
        // are zero iff the separator holds.
        let gap = next - last - 1;
        let sep = ((x >> (8 * n as u32)) ^ (u16::from_le_bytes(*b", ") ^ 0x3030) as u64) & 0xFFFF;
        if gap > 2 || (sep << (8 * (2 - gap) as u32)) & 0xFFFF != 0 {
            return None;
        }
        s = next;
        starts &= starts - 1;
        ends &= ends - 1;
        Some(eight_digits(x << (64 - 8 * n as u32)) as u32)
    });
    i + s
}

/// Where [`id_run`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum IdStop {
    /// The array closed; the index past its `]`.
    Closed(usize),
    /// At the pause mark: the index where the next step starts (the first digit of an id, in a
    /// well-formed array).
    Paused(usize),
}

/// The token-id array's loop from `i` (where an id starts, after `[` or a separator), each id
/// pushed into `ids` (so hashed block by block): the hot loop of a token-id body. Stops when the
/// array closes, or before a step that would start at or past `pause` (`usize::MAX`: never), so
/// that [`super::early`] can run it over the part of a body that has arrived and go on from the
/// same place later (`PAUSES`: whether to look at `pause` at all; the final read's loop does
/// not); None where the one-pass reader leaves the body to serde_json. Each step looks
/// at most 72 bytes past where it starts, except the whitespace and digit runs, which stop at the
/// end of `b` (the early scan only pauses where that cannot have cut them short). `ids` is taken
/// and given back by value so that its fields can live in registers through the loop (through a
/// `&mut` they were stored on every id; measured slower natively).
#[inline]
pub(super) fn id_run<const PAUSES: bool>(
    b: &[u8],
    mut i: usize,
    mut ids: SequenceBuilder,
    pause: usize,
) -> Option<(SequenceBuilder, IdStop)> {
    loop {
        if PAUSES && i >= pause {
            return Some((ids, IdStop::Paused(i)));
        }
        let next = token_id_window(b, i, &mut ids);
        if next > i {
            i = next;
            continue;
        }
        let (v, next) = token_id(b, i)?;
        ids.push(v);
        i = next;
        match *b.get(i)? {
            b',' => {
                i += 1;
                // `[1,2]` or `[1, 2]`; anything else takes the general whitespace loop.
                if b.get(i) == Some(&b' ') {
                    i += 1;
                }
                while b.get(i).is_some_and(|&c| is_ws(c)) {
                    i += 1;
                }
            }
            b']' => return Some((ids, IdStop::Closed(i + 1))),
            c if is_ws(c) => {
                let mut s = Scanner { b, i, early: None };
                if !s.next_or_close(b']')? {
                    return Some((ids, IdStop::Closed(s.i)));
                }
                i = s.i;
            }
            _ => return None,
        }
    }
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

/// A string's value from its raw text (escapes already checked for form). None for a lone
/// surrogate, which serde_json refuses in a string it reads.
fn unescape(raw: &str) -> Option<String> {
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(p) = rest.find('\\') {
        out.push_str(rest.get(..p)?);
        let esc = rest.get(p + 1..)?;
        let mut chars = esc.chars();
        let c = match chars.next()? {
            '"' => '"',
            '\\' => '\\',
            '/' => '/',
            'b' => '\u{8}',
            'f' => '\u{c}',
            'n' => '\n',
            'r' => '\r',
            't' => '\t',
            'u' => {
                let hi = hex4(esc.get(1..5)?)?;
                match hi {
                    0xD800..=0xDBFF => {
                        if esc.get(5..7)? != "\\u" {
                            return None;
                        }
                        let lo = hex4(esc.get(7..11)?)?;
                        if !(0xDC00..=0xDFFF).contains(&lo) {
                            return None;
                        }
                        let c = 0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00);
                        out.push(char::from_u32(c)?);
                        rest = esc.get(11..)?;
                        continue;
                    }
                    0xDC00..=0xDFFF => return None,
                    _ => {
                        out.push(char::from_u32(hi)?);
                        rest = esc.get(5..)?;
                        continue;
                    }
                }
            }
            _ => return None,
        };
        out.push(c);
        rest = esc.get(1..)?;
    }
    out.push_str(rest);
    Some(out)
}

/// The code unit of the `\uXXXX` escape at `b[at..]`; None when there is none.
fn hex_escape(b: &[u8], at: usize) -> Option<u32> {
    if b.get(at..at + 2)? != b"\\u" {
        return None;
    }
    hex4(core::str::from_utf8(b.get(at + 2..at + 6)?).ok()?)
}

fn hex4(s: &str) -> Option<u32> {
    if s.len() != 4 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(s, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_read_every_length_and_refuse_what_is_not_a_u32() {
        for v in [
            0u64, 7, 10, 99, 1234567, 9999999, 12345678, 123456789, 4294967295,
        ] {
            for tail in [",", "]", " ", ",1,2,3,4,5,6,7,8"] {
                let s = format!("{v}{tail}");
                assert_eq!(
                    token_id(s.as_bytes(), 0),
                    Some((v as u32, v.to_string().len())),
                    "{s}"
                );
            }
        }
        for s in [
            "4294967296",
            "01",
            "00,",
            "-1",
            "",
            "a",
            ",1",
            "99999999999",
        ] {
            assert_eq!(token_id(s.as_bytes(), 0), None, "{s}");
        }
    }

    /// The shapes clients send are read here, not left to serde (the property tests compare results,
    /// which would also agree if this reader left every body to serde).
    #[test]
    fn common_bodies_are_read_in_one_pass() {
        let ids: Vec<String> = (0..100).map(|i| (i * 7919 % 150_000).to_string()).collect();
        for (endpoint, body) in [
            (Endpoint::Completions, format!(r#"{{"model":"m","prompt":[{}],"max_tokens":7,"stream":true}}"#, ids.join(","))),
            (Endpoint::Completions, format!(r#"{{"prompt": [{}], "cache_salt": "s", "logit_bias": {{"5": -1.5e2}}}}"#, ids.join(", "))),
            (Endpoint::Completions, format!(r#"{{"prompt":[[{}],[1,2]]}}"#, ids.join(","))),
            (Endpoint::Completions, r#"{"prompt":"a \"quoted\" text\n","stop":["\n"],"temperature":0.7}"#.to_string()),
            (Endpoint::Completions, r#"{"prompt":["one","two é"]}"#.to_string()),
            (Endpoint::ChatCompletions, r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}],"max_completion_tokens":5,"stream_options":{"include_usage":true}}"#.to_string()),
        ] {
            let r = read(endpoint, body.as_bytes(), None, 16, None, None, None);
            assert!(matches!(r, Some(Ok(_))), "{body}: {r:?}");
        }
    }

    #[test]
    fn digit_bits_mark_exactly_the_digits() {
        for seed in 0..2000u64 {
            let w = seed
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left((seed % 64) as u32)
                ^ 0x3535_3030_3939_2f3a;
            let want = (0..8).fold(0u64, |m, k| {
                m | ((((w >> (8 * k)) as u8).is_ascii_digit() as u64) << k)
            });
            assert_eq!(digit_bits(w), want, "{w:016x}");
        }
    }

    #[test]
    fn the_window_reads_what_one_id_at_a_time_reads() {
        let bodies = [
            "1,22,333,4444,55555,666666,7777777,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25]",
            "1, 22, 333, 4444, 55555, 666666, 7777777, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]",
            "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,012,22,23,24,25,26,27,28,29,30,31,32,33,34]",
            "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,1.5,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38]",
            "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,123456789,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36]",
            "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17 ,18,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38]",
            "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,,18,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36,37,38]",
        ];
        for body in bodies {
            let b = body.as_bytes();
            let h = BlockHasher::new(1).unwrap();
            let mut fast = h.builder();
            let end = token_id_window(b, 0, &mut fast);
            let mut slow = h.builder();
            let mut i = 0;
            while i < end {
                let (v, next) = token_id(b, i).unwrap();
                slow.push(v);
                i = next + 1;
                if b[i] == b' ' {
                    i += 1;
                }
            }
            assert_eq!(i, end, "{body}");
            assert!(end > 0 && end < 64, "{body}: {end}");
            assert_eq!(fast.finish(), slow.finish(), "{body}");
        }
    }

    /// Whole arrays of ids of every length up to ten digits (the window reads up to seven, and its
    /// separator check reads the space of ", " from the id's own word, which a seven-digit id has
    /// no room for), in mixed order, joined by "," or ", ": every id is read, hashed as
    /// `sequence_hashes` hashes them.
    #[test]
    fn arrays_of_every_id_length_read_whole() {
        let mut seed = 3u64;
        for sep in [",", ", "] {
            for _ in 0..50 {
                let ids: Vec<u32> = (0..300)
                    .map(|_| {
                        seed = seed
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        let digits = (seed >> 60) % 10 + 1;
                        ((seed >> 20) % 10u64.pow(digits as u32)).min(u32::MAX as u64) as u32
                    })
                    .collect();
                let list: Vec<String> = ids.iter().map(u32::to_string).collect();
                let body = format!("[{}]", list.join(sep));
                let h = BlockHasher::new(16).unwrap();
                let mut sc = Scanner {
                    b: body.as_bytes(),
                    i: 0,
                    early: None,
                };
                let got = sc.token_ids(h.builder()).unwrap();
                assert_eq!(sc.i, body.len(), "{body}");
                assert_eq!(got.tokens(), ids.len() as u64);
                assert_eq!(got.finish(), h.sequence_hashes(&ids), "{body}");
            }
        }
    }

    #[test]
    fn strings_unescape_as_serde_does() {
        for s in [
            r#""plain""#,
            r#""a\"b\\c\/d\b\f\n\r\t""#,
            r#""\u00e9\u65e5\ud83e\udd80x""#,
            r#""é日🦀 long enough to take the word loop""#,
        ] {
            let mut sc = Scanner {
                b: s.as_bytes(),
                i: 0,
                early: None,
            };
            let want: String = serde_json::from_str(s).unwrap();
            assert_eq!(sc.string().as_deref(), Some(want.as_str()), "{s}");
            assert_eq!(sc.i, s.len());
        }
        for s in [
            r#""\ud83e""#,
            r#""\udd80""#,
            r#""\x""#,
            r#""\u12g4""#,
            "\"a\u{1}b\"",
            "\"unterminated",
        ] {
            let mut sc = Scanner {
                b: s.as_bytes(),
                i: 0,
                early: None,
            };
            assert!(sc.string().is_none(), "{s}");
        }
    }
}
