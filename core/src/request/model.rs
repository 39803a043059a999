//! The request's `model`, found without reading the rest of the body: a gateway with several
//! pools (one fleet per model) must know which pool's router reads the body before any of them
//! does, because pools differ in block size, adapters and tokenizer.
//!
//! The scan walks the top-level object's members and skips every other value by counting
//! brackets outside strings, so it costs one pass over the bytes up to `model` (clients that send
//! `model` first pay almost nothing; a chat body with `messages` first is skipped at memory
//! speed). It is not a validator: a body it names a model for may still be refused by the pool's
//! reader, which then routes it by load like any unreadable body.

use std::borrow::Cow;

/// What the top-level `model` member of a request body says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelField<'a> {
    /// `"model": "<name>"` (escapes decoded).
    Named(Cow<'a, str>),
    /// The body is an object without a `model` member.
    Absent,
    /// Not a JSON object, `model` not a string, or malformed before `model` was found.
    Unreadable,
}

/// The top-level `model` of a JSON request body (should a hostile body repeat it, the one either
/// scan meets first: the pool's reader refuses such a body anyway).
pub fn model_of(body: &[u8]) -> ModelField<'_> {
    let mut s = Scan { b: body, i: 0 };
    // Before the first value that may be long is skipped, the end is tried once: a client that
    // sends `model` first never pays for the tail, one that sends it after `messages` never pays
    // for the messages.
    let mut tail_tried = false;
    s.ws();
    if !s.eat(b'{') {
        return ModelField::Unreadable;
    }
    s.ws();
    if s.eat(b'}') {
        return ModelField::Absent;
    }
    loop {
        s.ws();
        let Some(key) = s.string() else {
            return ModelField::Unreadable;
        };
        s.ws();
        if !s.eat(b':') {
            return ModelField::Unreadable;
        }
        s.ws();
        if decoded(key).as_deref() == Some("model") {
            return match s.string().and_then(decoded) {
                Some(name) => ModelField::Named(name),
                None => ModelField::Unreadable,
            };
        }
        if !tail_tried && matches!(s.b.get(s.i), Some(b'[' | b'{' | b'"')) {
            tail_tried = true;
            if let Some(name) = model_in_tail(body) {
                return ModelField::Named(name);
            }
        }
        if !s.skip_value() {
            return ModelField::Unreadable;
        }
        s.ws();
        if s.eat(b',') {
            continue;
        }
        return if s.eat(b'}') {
            ModelField::Absent
        } else {
            ModelField::Unreadable
        };
    }
}

/// How far from the end [`model_in_tail`] looks: the members after a chat body's `messages` (its
/// model, sampling settings, `stream`) fit in it.
const TAIL_BYTES: usize = 4096;

/// `model` among the top-level members at the end of the body, read backwards over at most
/// [`TAIL_BYTES`]; `None` when it is not there or the tail cannot be read (the forward scan then
/// decides). Chat clients send `model` after `messages` (the OpenAI Python client does), so
/// without this the forward scan walks every message; token-id bodies that send it first leave
/// the tail at once, at their prompt's closing bracket. Backwards is exact on JSON: inside a string
/// every quote is escaped, so a string opens at the nearest quote before its close that an even
/// run of backslashes precedes.
fn model_in_tail(b: &[u8]) -> Option<Cow<'_, str>> {
    let floor = b.len().saturating_sub(TAIL_BYTES);
    let mut i = back_ws(b, b.len(), floor);
    if i <= floor || b[i - 1] != b'}' {
        return None;
    }
    i -= 1;
    loop {
        let end = back_ws(b, i, floor);
        let start = back_value(b, end, floor)?;
        i = back_ws(b, start, floor);
        if i <= floor || b[i - 1] != b':' {
            return None;
        }
        i = back_ws(b, i - 1, floor);
        if i <= floor || b[i - 1] != b'"' {
            return None;
        }
        let open = string_open(b, i - 1, floor)?;
        let before = back_ws(b, open, floor);
        let member = before > floor && matches!(b[before - 1], b',' | b'{');
        if member && decoded(&b[open + 1..i - 1]).as_deref() == Some("model") {
            return (b[start] == b'"')
                .then(|| decoded(&b[start + 1..end - 1]))
                .flatten();
        }
        i = back_ws(b, open, floor);
        if i <= floor || b[i - 1] != b',' {
            return None;
        }
        i -= 1;
    }
}

/// Where the whitespace that ends at `end` starts (not below `floor`).
fn back_ws(b: &[u8], mut end: usize, floor: usize) -> usize {
    while end > floor && matches!(b[end - 1], b' ' | b'\t' | b'\n' | b'\r') {
        end -= 1;
    }
    end
}

/// The start of the value that ends at `end` (exclusive), read backwards; `None` past `floor`.
fn back_value(b: &[u8], end: usize, floor: usize) -> Option<usize> {
    if end <= floor {
        return None;
    }
    match b[end - 1] {
        b'"' => string_open(b, end - 1, floor),
        b'}' | b']' => {
            let mut depth = 0usize;
            let mut j = end;
            while j > floor {
                j -= 1;
                match b[j] {
                    b'"' => j = string_open(b, j, floor)?,
                    b'}' | b']' => depth += 1,
                    b'{' | b'[' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(j);
                        }
                    }
                    _ => {}
                }
            }
            None
        }
        _ => {
            let mut j = end;
            while j > floor
                && !matches!(
                    b[j - 1],
                    b',' | b':' | b'[' | b'{' | b' ' | b'\t' | b'\n' | b'\r'
                )
            {
                j -= 1;
            }
            (j > floor && j < end).then_some(j)
        }
    }
}

/// The index of the quote that opens the string whose closing quote is at `close`; `None` when it
/// is not found above `floor` (or a run of backslashes reaches it, which leaves the parity open).
fn string_open(b: &[u8], close: usize, floor: usize) -> Option<usize> {
    let mut j = close;
    loop {
        j = floor + b[floor..j].iter().rposition(|&c| c == b'"')?;
        let mut k = j;
        while k > floor && b[k - 1] == b'\\' {
            k -= 1;
        }
        if k == floor && k > 0 && b[k - 1] == b'\\' {
            return None;
        }
        if (j - k).is_multiple_of(2) {
            return Some(j);
        }
    }
}

/// A JSON string's raw bytes between its quotes, decoded: borrowed when it has no escape.
fn decoded(raw: &[u8]) -> Option<Cow<'_, str>> {
    if !raw.contains(&b'\\') {
        return std::str::from_utf8(raw).ok().map(Cow::Borrowed);
    }
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice::<String>(&quoted)
        .ok()
        .map(Cow::Owned)
}

struct Scan<'a> {
    b: &'a [u8],
    i: usize,
}

impl<'a> Scan<'a> {
    fn ws(&mut self) {
        while matches!(self.b.get(self.i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.b.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    /// A string at the cursor: its raw bytes between the quotes, the cursor after the closing one.
    fn string(&mut self) -> Option<&'a [u8]> {
        if !self.eat(b'"') {
            return None;
        }
        let start = self.i;
        let end = string_end(self.b, start)?;
        self.i = end + 1;
        Some(&self.b[start..end])
    }

    /// Skips one value of any kind; false when the body ends inside it or it is malformed in a
    /// way the skip notices (unbalanced brackets, a bare value that is empty).
    fn skip_value(&mut self) -> bool {
        match self.b.get(self.i) {
            Some(b'"') => self.string().is_some(),
            Some(b'{' | b'[') => {
                let mut depth = 0usize;
                while let Some(&c) = self.b.get(self.i) {
                    match c {
                        b'"' => match string_end(self.b, self.i + 1) {
                            Some(end) => self.i = end,
                            None => return false,
                        },
                        b'{' | b'[' => depth += 1,
                        b'}' | b']' => {
                            depth -= 1;
                            if depth == 0 {
                                self.i += 1;
                                return true;
                            }
                        }
                        _ => {}
                    }
                    self.i += 1;
                }
                false
            }
            Some(_) => {
                let start = self.i;
                while let Some(&c) = self.b.get(self.i) {
                    if matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                        break;
                    }
                    self.i += 1;
                }
                self.i > start
            }
            None => false,
        }
    }
}

/// The first `"` or `\\` in `h`. Most of a chat body is string bytes, and wasm32 has no SIMD
/// here, so eight bytes are tested at a time as one `u64` (a byte equal to `c` is a zero byte of
/// `w ^ c*0x01..01`, and `(x - 0x01..01) & !x & 0x80..80` is non-zero exactly when `x` has one).
/// In the filter this took about 200 us off a 512 KB chat body (`filter-bench --pools 16`).
fn quote_or_escape(h: &[u8]) -> Option<usize> {
    const LO: u64 = 0x0101_0101_0101_0101;
    const HI: u64 = 0x8080_8080_8080_8080;
    const QUOTE: u64 = LO * b'"' as u64;
    const ESCAPE: u64 = LO * b'\\' as u64;
    let mut i = 0;
    for word in h.chunks_exact(8) {
        let w = u64::from_le_bytes(word.try_into().unwrap_or([0; 8]));
        let (q, e) = (w ^ QUOTE, w ^ ESCAPE);
        if ((q.wrapping_sub(LO) & !q) | (e.wrapping_sub(LO) & !e)) & HI != 0 {
            break;
        }
        i += 8;
    }
    h[i..]
        .iter()
        .position(|&c| c == b'"' || c == b'\\')
        .map(|p| p + i)
}

/// The index of the quote that closes a string whose contents start at `from`.
fn string_end(b: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let rel = quote_or_escape(b.get(from..)?)?;
        let at = from + rel;
        if b[at] == b'"' {
            return Some(at);
        }
        // An escape: the next byte is taken whatever it is.
        from = at + 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(s: &str) -> ModelField<'_> {
        ModelField::Named(Cow::Borrowed(s))
    }

    #[test]
    fn finds_the_model_wherever_it_is() {
        assert_eq!(model_of(br#"{"model":"a","prompt":[1,2]}"#), named("a"));
        assert_eq!(
            model_of(br#" { "prompt" : [[1,2],[3]], "stream":true, "model" : "llama-3.1-8b" } "#),
            named("llama-3.1-8b")
        );
        let chat = br#"{"messages":[{"role":"user","content":"a \"model\": \"x\" {[}"}],"max_tokens":3,"model":"q"}"#;
        assert_eq!(model_of(chat), named("q"));
        assert_eq!(
            model_of(br#"{"n":null,"t":-1.5e3,"o":{"model":"inner"},"model":"outer"}"#),
            named("outer")
        );
    }

    #[test]
    fn escapes_are_decoded_in_keys_and_names() {
        assert_eq!(
            model_of(br#"{"mod\u0065l":"a\/b\u00e9"}"#),
            ModelField::Named(Cow::Owned("a/b\u{e9}".into()))
        );
        assert_eq!(model_of(br#"{"x":"\\","model":"m"}"#), named("m"));
    }

    #[test]
    fn absent_and_unreadable_are_told_apart() {
        assert_eq!(model_of(b"{}"), ModelField::Absent);
        assert_eq!(model_of(br#"{"prompt":[1,2,3]}"#), ModelField::Absent);
        for bad in [
            &b""[..],
            b"[]",
            b"null",
            br#"{"model":3}"#,
            br#"{"model":null}"#,
            br#"{"prompt":[1,2"#,
            br#"{"prompt":"abc"#,
            br#"{"prompt" [1]}"#,
            br#"{"a":1 "model":"m"}"#,
            b"{\"model\":\"\xff\"}",
        ] {
            assert_eq!(model_of(bad), ModelField::Unreadable, "{bad:?}");
        }
        assert_eq!(model_of(br#"{"a":,"model":"m"}"#), ModelField::Unreadable);
        // Read from the end, a well-formed last member is found whatever malformed member
        // before it the forward scan has not reached: the scan is no validator, and the pool's
        // reader refuses such a body.
        assert_eq!(model_of(br#"{"a":[1,,],"model":"m"}"#), named("m"));
    }

    #[test]
    fn the_word_scan_finds_the_first_quote_or_escape() {
        for len in 0..40 {
            for at in 0..=len {
                for c in [b'"', b'\\'] {
                    let mut h = vec![b'a'; len];
                    if at < len {
                        h[at] = c;
                        // A later one must not be taken for the first.
                        if at + 3 < len {
                            h[at + 3] = b'"';
                        }
                    }
                    let want = (at < len).then_some(at);
                    assert_eq!(quote_or_escape(&h), want, "len {len} at {at}");
                }
            }
        }
        // Bytes next to the two (0x21, 0x23, 0x5b, 0x5d) and high bytes are not taken for them.
        assert_eq!(quote_or_escape(b"!#[]\x80\xff\xa2\xdcabcdefgh\""), Some(16));
    }

    #[test]
    fn the_tail_is_read_backwards_and_left_when_model_is_not_there() {
        let long = "x\\\"y".repeat(2000);
        // After a long `messages`, as chat clients send it: found in the tail.
        let chat = format!(
            r#"{{"messages":[{{"role":"user","content":"{long}"}}],"model":"q\"1","stream":true}}"#
        );
        assert_eq!(
            model_of(chat.as_bytes()),
            ModelField::Named(Cow::Owned("q\"1".into()))
        );
        assert_eq!(model_in_tail(chat.as_bytes()).as_deref(), Some("q\"1"));
        // First, before a long prompt: not in the tail, found going forward.
        let ids = format!(r#"{{"model":"m","prompt":[{}]}}"#, "7,".repeat(3000) + "7");
        assert_eq!(model_in_tail(ids.as_bytes()), None);
        assert_eq!(model_of(ids.as_bytes()), named("m"));
        // Inside a nested object at the end: not top level, so not taken.
        let nested = br#"{"prompt":[1],"metadata":{"model":"inner"}}"#;
        assert_eq!(model_in_tail(nested), None);
        assert_eq!(model_of(nested), ModelField::Absent);
        // A string whose escapes reach the window's edge: left to the forward scan.
        let edge = format!(r#"{{"model":"m","s":"{}"}}"#, "\\".repeat(3000));
        assert_eq!(model_of(edge.as_bytes()), named("m"));
    }

    #[test]
    fn hostile_bodies_end_without_a_panic() {
        // Deep nesting is counted, not recursed into; truncation anywhere ends the scan.
        let deep = format!(
            "{{\"a\":{}{},\"model\":\"m\"}}",
            "[".repeat(100_000),
            "]".repeat(100_000)
        );
        assert_eq!(model_of(deep.as_bytes()), named("m"));
        let body = br#"{"messages":[{"role":"user","content":"hi \"there\""}],"model":"m"}"#;
        for cut in 0..body.len() {
            let _ = model_of(&body[..cut]);
        }
        assert_eq!(model_of(br#"{"a":"\"#), ModelField::Unreadable);
    }
}
