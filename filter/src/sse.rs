//! Following a server-sent-events response stream chunk by chunk.
//!
//! The filter must return `Continue` for every response body chunk (pausing would buffer the stream and
//! destroy time-to-first-token), so it watches the stream as it passes. Engines send one `data:` event per
//! generated token (vLLM, SGLang), but a proxy is free to cut the byte stream anywhere: an event, a line,
//! even a UTF-8 sequence can straddle two chunks. The tracker keeps the unfinished line as carry-over
//! state per stream, bounded so a hostile upstream cannot grow it without limit.

/// Longest line kept across chunks. A longer line is dropped (counted) and parsing resumes at the next
/// newline; a token event is a few hundred bytes, a final usage chunk well under a kilobyte.
pub const MAX_CARRY: usize = 64 * 1024;

/// What one chunk told us.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// Token events seen in this chunk.
    pub tokens: u64,
    /// The stream's `[DONE]` sentinel arrived.
    pub done: bool,
    /// An engine error event arrived in this chunk (`data: {"error": ...}`, as vLLM sends when
    /// generation fails after the 200 went out).
    pub error: bool,
}

#[derive(Clone, Debug, Default)]
pub struct SseTracker {
    carry: Vec<u8>,
    /// Token events seen so far.
    pub tokens: u64,
    /// `usage.completion_tokens` reported by the engine, if any (the latest).
    pub reported_completion_tokens: Option<u64>,
    /// `tokens` when the latest usage arrived (that chunk's own token event included).
    tokens_at_usage: u64,
    /// `usage.prompt_tokens_details.cached_tokens` reported by the engine, if any.
    pub reported_cached_tokens: Option<u64>,
    pub done: bool,
    /// An engine error event was seen.
    pub error: bool,
    /// Lines longer than [`MAX_CARRY`] that were skipped.
    pub oversized_lines: u64,
    skipping: bool,
}

impl SseTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds one body chunk; returns what it added.
    pub fn push(&mut self, chunk: &[u8]) -> Progress {
        let mut progress = Progress::default();
        let mut rest = chunk;
        while let Some(nl) = rest.iter().position(|&b| b == b'\n') {
            let (head, tail) = rest.split_at(nl);
            rest = &tail[1..];
            if self.skipping {
                self.skipping = false;
                self.carry.clear();
                continue;
            }
            if self.carry.is_empty() {
                self.line(head, &mut progress);
            } else {
                let mut line = std::mem::take(&mut self.carry);
                line.extend_from_slice(head);
                self.line(&line, &mut progress);
                line.clear();
                self.carry = line;
            }
        }
        if !rest.is_empty() && !self.skipping {
            if self.carry.len() + rest.len() > MAX_CARRY {
                self.carry.clear();
                self.skipping = true;
                self.oversized_lines += 1;
            } else {
                self.carry.extend_from_slice(rest);
            }
        }
        progress
    }

    fn line(&mut self, line: &[u8], progress: &mut Progress) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(payload) = line.strip_prefix(b"data:") else {
            return; // comments, event:, id:, retry: and blank separators carry no tokens
        };
        let payload = payload.trim_ascii();
        if payload == b"[DONE]" {
            self.done = true;
            progress.done = true;
            return;
        }
        if payload.is_empty() {
            return;
        }
        // An engine error: a JSON object with a non-null top-level `error` (vLLM's
        // `{"error": {"message": ..., "type": ..., "code": 500}}`). Token events are not parsed: only
        // payloads that mention the key and carry no choices.
        if contains(payload, b"\"error\"")
            && !contains(payload, b"\"choices\":[{")
            && is_error_event(payload)
        {
            self.error = true;
            progress.error = true;
            return;
        }
        // A usage chunk has empty choices in OpenAI's and vLLM's shape; it may also ride on the last
        // token chunk. Only parse JSON when usage is present: token chunks are counted without parsing.
        let token_event =
            !(contains(payload, b"\"choices\":[]") || contains(payload, b"\"choices\": []"));
        if token_event {
            self.tokens += 1;
            progress.tokens += 1;
        }
        if contains(payload, b"\"usage\"") && contains(payload, b"\"completion_tokens\"") {
            self.read_usage(payload);
        }
    }

    fn read_usage(&mut self, payload: &[u8]) {
        let Ok(v) = serde_json::from_slice::<serde_json::Value>(payload) else {
            return;
        };
        let usage = &v["usage"];
        if let Some(n) = usage["completion_tokens"].as_u64() {
            self.reported_completion_tokens = Some(n);
            self.tokens_at_usage = self.tokens;
        }
        if let Some(n) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
            self.reported_cached_tokens = Some(n);
        }
    }

    /// Best count of generated tokens so far: the engine's own count from its latest usage, plus the
    /// token events after it (none after a final usage chunk; vLLM's continuous usage stats put one
    /// in every chunk). Without usage, the token events. Events are not tokens one for one: a final
    /// event may carry only the finish reason (empty text), which the engine's count does not
    /// include, and a stop string can end a stream mid-token.
    pub fn generated(&self) -> u64 {
        self.reported_completion_tokens.map_or(self.tokens, |n| {
            n.saturating_add(self.tokens.saturating_sub(self.tokens_at_usage))
        })
    }
}

/// Whether an SSE payload is an engine error event: a JSON object whose `error` is not null.
fn is_error_event(payload: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(payload)
        .ok()
        .and_then(|v| v.get("error").map(|e| !e.is_null()))
        .unwrap_or(false)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = concat!(
        "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"text\":\"Hel\"}]}\n\n",
        ": keep-alive comment\n\n",
        "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"text\":\"lo\"}]}\r\n\r\n",
        "data: {\"id\":\"a\",\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,",
        "\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n",
        "data: [DONE]\n\n"
    );

    #[test]
    fn the_engines_usage_wins_over_a_finish_only_event() {
        // Two tokens, then an event carrying only the finish reason, then usage: 2 generated, not 3.
        let mut t = SseTracker::new();
        t.push(
            b"data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\n",
        );
        t.push(b"data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}]}\n\n");
        assert_eq!(t.generated(), 3, "events alone, before usage");
        t.push(b"data: {\"choices\":[],\"usage\":{\"completion_tokens\":2}}\n\ndata: [DONE]\n\n");
        assert_eq!(t.generated(), 2);
        // Continuous usage stats: usage in each token chunk counts that chunk's token once.
        let mut c = SseTracker::new();
        c.push(b"data: {\"choices\":[{\"text\":\"a\"}],\"usage\":{\"completion_tokens\":1}}\n\n");
        assert_eq!(c.generated(), 1);
        c.push(b"data: {\"choices\":[{\"text\":\"b\"}]}\n\n");
        assert_eq!(c.generated(), 2, "a token event after the usage adds one");
        c.push(b"data: {\"choices\":[{\"text\":\"c\"}],\"usage\":{\"completion_tokens\":3}}\n\n");
        assert_eq!(c.generated(), 3);
    }

    #[test]
    fn whole_stream_counts_tokens_usage_and_done() {
        let mut t = SseTracker::new();
        let p = t.push(STREAM.as_bytes());
        assert_eq!(p.tokens, 2);
        assert!(p.done && t.done);
        assert_eq!(t.reported_completion_tokens, Some(2));
        assert_eq!(t.reported_cached_tokens, Some(32));
        assert_eq!(t.generated(), 2);
    }

    #[test]
    fn every_split_point_gives_the_same_answer() {
        let bytes = STREAM.as_bytes();
        for cut in 0..bytes.len() {
            let mut t = SseTracker::new();
            let a = t.push(&bytes[..cut]);
            let b = t.push(&bytes[cut..]);
            assert_eq!(a.tokens + b.tokens, 2, "cut at {cut}");
            assert!(t.done, "cut at {cut}");
            assert_eq!(t.reported_cached_tokens, Some(32), "cut at {cut}");
        }
    }

    #[test]
    fn byte_by_byte() {
        let mut t = SseTracker::new();
        let mut tokens = 0;
        for b in STREAM.as_bytes() {
            tokens += t.push(std::slice::from_ref(b)).tokens;
        }
        assert_eq!(tokens, 2);
        assert!(t.done);
    }

    #[test]
    fn oversized_line_is_skipped_and_parsing_resumes() {
        let mut t = SseTracker::new();
        let junk = vec![b'x'; MAX_CARRY + 10];
        t.push(b"data: ");
        t.push(&junk);
        t.push(&junk);
        assert_eq!(t.oversized_lines, 1);
        let p = t.push(b"tail\ndata: {\"choices\":[{\"text\":\"a\"}]}\n\n");
        assert_eq!(p.tokens, 1);
        assert!(t.carry.len() <= MAX_CARRY);
    }

    #[test]
    fn an_engine_error_event_is_seen_and_is_not_a_token() {
        // vLLM's in-stream error after the 200 went out, split everywhere.
        let stream = concat!(
            "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"text\":\"Hel\"}]}\n\n",
            "data: {\"error\": {\"object\": \"error\", \"message\": \"engine dead\", ",
            "\"type\": \"InternalServerError\", \"code\": 500}}\n\n",
            "data: [DONE]\n\n"
        )
        .as_bytes();
        for cut in 0..stream.len() {
            let mut t = SseTracker::new();
            let a = t.push(&stream[..cut]);
            let b = t.push(&stream[cut..]);
            assert_eq!(a.tokens + b.tokens, 1, "cut at {cut}");
            assert!(t.error && (a.error || b.error), "cut at {cut}");
            assert!(t.done);
        }
        // Not errors: a token whose text says "error", a null error, a non-JSON payload.
        let mut t = SseTracker::new();
        let p = t.push(
            b"data: {\"choices\":[{\"text\":\"\\\"error\\\"\"}]}\n\n\
              data: {\"error\": null, \"choices\": []}\n\n\
              data: \"error\" here\n\n",
        );
        assert!(!t.error && !p.error, "{p:?}");
        // The token and the last (unparsed, counted as engines' token events are) payload.
        assert_eq!(p.tokens, 2);
    }

    #[test]
    fn garbage_never_panics_and_counts_nothing_odd() {
        let mut t = SseTracker::new();
        let p = t.push(&[0xff, 0xfe, b'\n', b'd', b'a', 0, b'\n', b'\n']);
        assert_eq!(p.tokens, 0);
        let p = t.push(b"data: {\"usage\": {\"completion_tokens\": \"x\"}, \"choices\":[]}\n");
        assert_eq!(p.tokens, 0);
        assert_eq!(t.reported_completion_tokens, None);
    }
}
