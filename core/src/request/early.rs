//! The early scan: reading a token-id prompt while the body is still arriving.
//!
//! Why: a proxy holds a request until its body has arrived (the route depends on the prompt), and
//! reading the body only once it has all arrived put the whole read (about 1 ms for a 128K-token
//! prompt in wasmtime, several for text through a tokenizer) after the last byte, in one callback,
//! on a worker thread that also serves other streams. Envoy hands the body to the filter in slices
//! as it arrives (its 16 KiB reads), and the filter may look at the part buffered so far each time.
//! The early scan reads each slice as it comes: it finds where the `prompt` array starts (member by
//! member, going on from the last complete member each time), then runs the one-pass reader's own
//! id loop ([`one_pass::id_run`]) over the ids that have arrived, hashing blocks as they fill, and
//! pauses [`MARGIN`] bytes short of what has arrived, so that no step it takes can have been cut
//! short by the end of a slice.
//!
//! The final read ([`super::read_request_early`]) reads the whole body as before: every field, every
//! check, every fallback. When it reaches the same array (the same byte offset) under the same hash
//! namespace, it takes the scan's builder and goes on from where the scan paused: the same loop
//! over the same bytes, so exactly the same result, which the property tests check by splitting
//! bodies at every place (`core/tests/request_props.rs`). Whatever the scan does not follow (a body
//! that is not an object, a prompt that is not a flat id array, odd whitespace at a pause, a
//! `cache_salt` after the prompt, malformed JSON) leaves it off or unused, and the final read reads
//! the prompt from its start as before. So a client cannot make the two disagree; at worst the scan's
//! work is wasted, and it looks at each byte a bounded number of times (the members before the
//! prompt are read again only once the unread part has doubled).
//!
//! The caller need not keep the bytes: [`EarlyScan::advance_window`] takes the part of the body from
//! any offset up to what has arrived, as long as it begins at or before [`EarlyScan::keep_from`] (the
//! first byte the scan may still look at); every offset the scan keeps is one into the whole body. So a
//! proxy filter holds only the unread tail of a token-id prompt (about one slice) per stream, not a
//! copy of the whole body, while the body arrives. The final read gets the whole body, beginning
//! with the same bytes the scan saw.

use super::one_pass::{IdStop, Scanner, id_run};
use crate::block::{BlockHasher, SequenceBuilder};

/// Bytes the id loop stays short of the end of what has arrived: one step looks at most 72 bytes
/// ahead (a 64-byte window and the 8-byte word of its last id), and the runs that look further
/// (whitespace, digits) are caught where they reach the end (the scan turns off).
const MARGIN: usize = 80;

/// The members before the prompt are read again after a slice that ended inside one only when
/// this many bytes (or as many as were unread, if more) have arrived since.
const RETRY_BYTES: usize = 1024;

/// What an early scan read of a token-id prompt, for the final read to go on from.
#[derive(Debug)]
pub(super) struct Resume {
    /// The byte offset of the array's `[`.
    pub(super) at: usize,
    /// The hash namespace the ids were hashed under (the `cache_salt` seen before the prompt).
    pub(super) seed: u64,
    pub(super) block_size: usize,
    pub(super) builder: SequenceBuilder,
    pub(super) stop: IdStop,
}

#[derive(Debug)]
enum State {
    /// Looking for the prompt: the next member starts at `next` (once the object has `opened`;
    /// before, `next` is 0), under the namespace of the salt seen so far; tried again once the body
    /// has `retry_len` bytes.
    Locating {
        next: usize,
        opened: bool,
        hasher: BlockHasher,
        retry_len: usize,
    },
    /// Reading the prompt's ids.
    Ids(Resume),
    /// Nothing (more) to do: the scan does not follow this body.
    Off,
}

/// A body's token-id prompt read as the body arrives (see the module docs).
#[derive(Debug)]
pub struct EarlyScan {
    plain: Option<BlockHasher>,
    state: State,
}

impl EarlyScan {
    /// A scan for a router with blocks of `block_size` tokens (an invalid size leaves it off).
    pub fn new(block_size: usize) -> Self {
        let plain = BlockHasher::new(block_size).ok();
        let state = match &plain {
            Some(p) => State::Locating {
                next: 0,
                opened: false,
                hasher: p.namespaced(None, None),
                retry_len: 0,
            },
            None => State::Off,
        };
        Self { plain, state }
    }

    /// Reads what it can of `body`, the body as far as it has arrived (each call's `body` begins
    /// with the previous call's).
    pub fn advance(&mut self, body: &[u8]) {
        self.advance_window(0, body);
    }

    /// Reads what it can of `window`, the body's bytes from offset `base` up to what has arrived.
    /// `base` past [`EarlyScan::keep_from`] (bytes the scan still needed are gone) turns the scan
    /// off: the final read then reads the prompt from its start, as without the scan.
    pub fn advance_window(&mut self, base: usize, window: &[u8]) {
        if base > self.keep_from() {
            self.state = State::Off;
            return;
        }
        if let State::Locating { .. } = self.state {
            self.locate(base, window);
        }
        if let State::Ids(_) = self.state {
            self.read_ids(base, window);
        }
    }

    /// The first byte offset of the body the next [`EarlyScan::advance_window`] may look at: the
    /// caller may drop every byte before it. `usize::MAX` once the scan needs nothing more (off, or
    /// the prompt's array closed).
    pub fn keep_from(&self) -> usize {
        match &self.state {
            State::Locating { next, .. } => *next,
            State::Ids(Resume {
                stop: IdStop::Paused(i),
                ..
            }) => *i,
            State::Ids(_) | State::Off => usize::MAX,
        }
    }

    /// Token ids read so far (0 before the prompt is found): the filter counts a body as read
    /// early (`kvsteer_early_scan_bodies`) when this is above 0 at its last slice.
    pub fn tokens(&self) -> u64 {
        match &self.state {
            State::Ids(r) => r.builder.tokens(),
            _ => 0,
        }
    }

    /// Whether the scan still follows the body (it found nothing it cannot follow so far).
    pub fn is_on(&self) -> bool {
        !matches!(self.state, State::Off)
    }

    /// What the final read takes over (None when the scan found no prompt to follow).
    pub(super) fn into_resume(self) -> Option<Resume> {
        match self.state {
            State::Ids(r) => Some(r),
            _ => None,
        }
    }

    /// `window`: the body from offset `base` on (`base` at most the next member's offset, checked
    /// by the caller); every offset kept is one into the whole body.
    fn locate(&mut self, base: usize, window: &[u8]) {
        // Kept whole: one resumable walk over the members; each early return sets where to resume.
        let State::Locating {
            mut next,
            mut opened,
            mut hasher,
            retry_len,
        } = std::mem::replace(&mut self.state, State::Off)
        else {
            return;
        };
        let Some(plain) = &self.plain else {
            return;
        };
        let end = base + window.len();
        if end < retry_len {
            self.state = State::Locating {
                next,
                opened,
                hasher,
                retry_len,
            };
            return;
        }
        // Where the body ran out (or is not yet readable): try again from the member at `next`
        // once more has arrived.
        let wait = |next: usize, opened: bool, hasher: BlockHasher| State::Locating {
            next,
            opened,
            hasher,
            retry_len: end + (end - next.min(end)).max(RETRY_BYTES),
        };
        let mut s = Scanner {
            b: window,
            i: next - base,
            early: None,
        };
        if !opened {
            s.ws();
            match s.peek() {
                None => return self.state = wait(next, opened, hasher),
                Some(b'{') => {}
                Some(_) => return,
            }
            s.i += 1;
            s.ws();
            match s.peek() {
                None => return self.state = wait(next, opened, hasher),
                Some(b'}') => return,
                Some(_) => {}
            }
            opened = true;
            next = base + s.i;
        }
        loop {
            s.i = next - base;
            let Some(key) = s.key() else {
                return self.state = wait(next, opened, hasher);
            };
            match key {
                b"prompt" => {
                    match s.peek() {
                        None => return self.state = wait(next, opened, hasher),
                        Some(b'[') => {}
                        Some(_) => return,
                    }
                    let at = base + s.i;
                    s.i += 1;
                    s.ws();
                    return match s.peek() {
                        None => self.state = wait(next, opened, hasher),
                        Some(b'0'..=b'9') => {
                            self.state = State::Ids(Resume {
                                at,
                                seed: hasher.seed(),
                                block_size: hasher.block_size(),
                                builder: hasher.builder(),
                                stop: IdStop::Paused(base + s.i),
                            })
                        }
                        // An empty array, a batch, text: nothing worth reading early.
                        Some(_) => {}
                    };
                }
                b"cache_salt" => {
                    let Some(salt) = s.nullable(|s| s.string()) else {
                        return self.state = wait(next, opened, hasher);
                    };
                    hasher = plain.namespaced(None, salt.as_deref());
                }
                _ => {
                    if s.skip(1).is_none() {
                        return self.state = wait(next, opened, hasher);
                    }
                }
            }
            match s.next_or_close(b'}') {
                Some(true) => next = base + s.i,
                // The object closed without a prompt.
                Some(false) => return,
                None => return self.state = wait(next, opened, hasher),
            }
        }
    }

    /// `window`: the body from offset `base` on (`base` at most the pause's offset, checked by the
    /// caller); the loop runs on the window's offsets and the stop is kept as one into the body.
    fn read_ids(&mut self, base: usize, window: &[u8]) {
        let State::Ids(r) = std::mem::replace(&mut self.state, State::Off) else {
            return;
        };
        let IdStop::Paused(i) = r.stop else {
            self.state = State::Ids(r);
            return;
        };
        let pause = window.len().saturating_sub(MARGIN);
        let Some(i) = i.checked_sub(base).filter(|&i| i < pause) else {
            self.state = State::Ids(r);
            return;
        };
        match id_run::<true>(window, i, r.builder, pause) {
            // A pause at the very end: a whitespace run reached it and may go on past it.
            Some((_, IdStop::Paused(j))) if j >= window.len() => {}
            Some((builder, stop)) => {
                let stop = match stop {
                    IdStop::Paused(j) => IdStop::Paused(base + j),
                    IdStop::Closed(j) => IdStop::Closed(base + j),
                };
                self.state = State::Ids(Resume { builder, stop, ..r })
            }
            // Not a body the one-pass reader reads through, or cut short by the end: off, and
            // the final read reads the prompt from its start.
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{RouteRequest, read_request, read_request_early};

    fn ids_body(n: u32, head: &str, sep: &str) -> String {
        let ids: Vec<String> = (0..n).map(|t| (t * 7919 % 151_000).to_string()).collect();
        format!(
            "{{{head}\"prompt\": [{}], \"max_tokens\": 7}}",
            ids.join(sep)
        )
    }

    /// The final read of `body` after `scan`.
    fn read_after(scan: EarlyScan, body: &[u8]) -> Result<RouteRequest, crate::RequestError> {
        read_request_early(
            "/v1/completions",
            body,
            None,
            16,
            1 << 24,
            None,
            Some(scan),
            None,
        )
    }

    /// Feeds `body` to a scan in slices of `step` bytes (all but the last), then reads it.
    fn scan_then_read(body: &[u8], step: usize) -> (EarlyScan, RouteRequest) {
        let mut scan = EarlyScan::new(16);
        let mut n = 0;
        while n + step < body.len() {
            n += step;
            scan.advance(&body[..n]);
        }
        let seen = EarlyScan {
            plain: scan.plain.clone(),
            state: match &scan.state {
                State::Ids(r) => State::Ids(Resume {
                    builder: r.builder.clone(),
                    ..*r
                }),
                State::Locating { .. } => State::Off,
                State::Off => State::Off,
            },
        };
        (seen, read_after(scan, body).unwrap())
    }

    #[test]
    fn ids_are_read_as_the_slices_arrive_and_the_result_is_the_same() {
        for sep in [",", ", ", " , ", ",\n  "] {
            let body = ids_body(20_000, "\"model\": \"m\", ", sep);
            let plain =
                read_request("/v1/completions", body.as_bytes(), None, 16, 1 << 24).unwrap();
            for step in [16 * 1024, 1000, 97] {
                let (scan, r) = scan_then_read(body.as_bytes(), step);
                assert_eq!(r, plain, "sep {sep:?} step {step}");
                // All but the last slice (and the margin) were read early.
                let behind = 20_000 - scan.tokens();
                assert!(scan.is_on(), "sep {sep:?} step {step}");
                assert!(
                    behind * 3 < (step as u64 + 2 * MARGIN as u64),
                    "sep {sep:?} step {step}: {behind} ids left for the final read"
                );
            }
        }
    }

    /// Feeds `body` in slices of `step` bytes as a filter that keeps only what the scan has not
    /// read does; returns the bytes it held at most, and the final read.
    fn scan_windowed(
        body: &[u8],
        step: usize,
    ) -> (usize, Result<RouteRequest, crate::RequestError>) {
        let mut scan = EarlyScan::new(16);
        let (mut base, mut n, mut most) = (0, 0, 0);
        while n + step < body.len() {
            n += step;
            scan.advance_window(base, &body[base..n]);
            most = most.max(n - base);
            base = base.max(scan.keep_from().min(n));
        }
        (most, read_after(scan, body))
    }

    #[test]
    fn a_scan_given_only_what_it_has_not_read_reads_the_same() {
        let ids = ids_body(20_000, "\"model\": \"m\", \"cache_salt\": \"t\", ", ", ");
        let text = format!("{{\"prompt\": \"{}\"}}", "word ".repeat(2000));
        let long_member = format!(
            "{{\"model\": \"{}\", \"prompt\": [{}]}}",
            "m".repeat(10_000),
            "7, ".repeat(3000) + "8"
        );
        for body in [ids, text, long_member] {
            let plain = read_request("/v1/completions", body.as_bytes(), None, 16, 1 << 24);
            for step in [1, 97, 1000, 16 * 1024] {
                let (most, r) = scan_windowed(body.as_bytes(), step);
                assert_eq!(
                    format!("{r:?}"),
                    format!("{plain:?}"),
                    "{:.40} step {step}",
                    body
                );
                if body.len() > 50_000 {
                    // A token-id prompt: about one slice held (or the bytes the member search
                    // waits for before it tries again), never the body.
                    assert!(
                        most <= step + RETRY_BYTES + 2 * MARGIN,
                        "step {step}: held {most}"
                    );
                }
            }
        }
        // Bytes the scan still needed dropped: it turns off, and the result is still the same.
        let body = ids_body(5000, "", ", ");
        let plain = read_request("/v1/completions", body.as_bytes(), None, 16, 1 << 24).unwrap();
        let mut scan = EarlyScan::new(16);
        scan.advance_window(0, &body.as_bytes()[..8000]);
        let past = scan.keep_from() + 1;
        scan.advance_window(past, &body.as_bytes()[past..12_000]);
        assert!(!scan.is_on());
        assert_eq!(read_after(scan, body.as_bytes()).unwrap(), plain);
    }

    #[test]
    fn a_salt_before_the_prompt_is_followed_and_one_after_it_read_again() {
        let before = ids_body(3000, "\"cache_salt\": \"tenant-a\", ", ", ");
        let plain = read_request("/v1/completions", before.as_bytes(), None, 16, 1 << 24).unwrap();
        let (scan, r) = scan_then_read(before.as_bytes(), 4096);
        assert!(scan.tokens() > 2000);
        assert_eq!(r, plain);
        let unsalted = ids_body(3000, "", ", ");
        let other = read_request("/v1/completions", unsalted.as_bytes(), None, 16, 1 << 24);
        assert_ne!(r.identity, other.unwrap().identity);

        let after = format!(
            "{},\"cache_salt\":\"tenant-a\"}}",
            ids_body(3000, "", ", ").trim_end_matches('}')
        );
        let plain = read_request("/v1/completions", after.as_bytes(), None, 16, 1 << 24).unwrap();
        let (scan, r) = scan_then_read(after.as_bytes(), 4096);
        assert!(scan.tokens() > 2000, "read early under the plain namespace");
        assert_eq!(r, plain, "and hashed again under the salt's");
    }

    #[test]
    fn what_the_scan_does_not_follow_leaves_it_off_and_the_result_the_same() {
        let long_ws = format!(
            "{{\"prompt\": [1, 2,{}3, 4]}}",
            " ".repeat(300) // a whitespace run across a pause
        );
        let text = format!("{{\"prompt\": \"{}\"}}", "word ".repeat(2000));
        let batch = format!(
            "{{\"prompt\": [[1, 2, 3], [{}]]}}",
            "5, ".repeat(2000) + "6"
        );
        let not_object = format!("[{}]", "1, ".repeat(2000) + "2");
        let broken = format!("{{\"prompt\": [{}x]}}", "12, ".repeat(2000));
        for body in [long_ws, text, batch, not_object, broken] {
            let plain = read_request("/v1/completions", body.as_bytes(), None, 16, 1 << 24);
            for step in [1, 50, 4096] {
                let mut scan = EarlyScan::new(16);
                let mut n = 0;
                while n + step < body.len() {
                    n += step;
                    scan.advance(&body.as_bytes()[..n]);
                }
                let r = read_after(scan, body.as_bytes());
                assert_eq!(
                    format!("{r:?}"),
                    format!("{plain:?}"),
                    "{:.60} step {step}",
                    body
                );
            }
        }
    }

    #[test]
    fn the_members_before_the_prompt_are_not_read_again_at_every_slice() {
        // A long member before the prompt, arriving a byte at a time: it is read again only once
        // the unread part has doubled, so the whole scan stays linear in the body.
        let body = format!(
            "{{\"model\": \"{}\", \"prompt\": [{}]}}",
            "m".repeat(100_000),
            "7, ".repeat(1000) + "8"
        );
        let mut scan = EarlyScan::new(16);
        let mut tries = 0;
        for n in 1..body.len() {
            let before = match &scan.state {
                State::Locating { retry_len, .. } => *retry_len,
                _ => usize::MAX,
            };
            scan.advance(&body.as_bytes()[..n]);
            if let State::Locating { retry_len, .. } = &scan.state
                && *retry_len != before
            {
                tries += 1;
            }
        }
        assert!(tries < 40, "the members were read again {tries} times");
        let plain = read_request("/v1/completions", body.as_bytes(), None, 16, 1 << 24).unwrap();
        assert_eq!(read_after(scan, body.as_bytes()).unwrap(), plain);
    }
}
