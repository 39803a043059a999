//! The HTTP traffic the harness pushes through the filter: OpenAI completions requests as a client sends
//! them and vLLM-shaped SSE responses as an engine streams them.
//!
//! Request: `POST /v1/completions` with a token-id prompt, `stream: true`, `max_tokens`, `ignore_eos`
//! and `stream_options.include_usage` (so the last event carries `usage` with
//! `prompt_tokens_details.cached_tokens`, as vLLM sends it).
//!
//! Response: vLLM sends one `data: {...}\n\n` event per engine step. To keep the demo fast the harness
//! coalesces the tokens of consecutive steps into one event (see [`SseWriter`]), which is what vLLM
//! itself does when the client reads slower than the engine produces; the shape of each event is
//! vLLM's `text_completion` chunk.

use crate::abi::Pairs;
use crate::host::pairs;
use std::fmt::Write as _;

/// Model name the harness puts in requests and responses.
pub const MODEL: &str = "kvsteer-sim";

/// Request headers of a completions call.
pub fn request_headers(
    path: &str,
    body_len: usize,
    session: Option<(&str, &str)>,
    extra: &[(String, String)],
) -> Pairs {
    let len = body_len.to_string();
    let mut h = pairs(&[
        (":method", "POST"),
        (":path", path),
        (":scheme", "http"),
        (":authority", "kvsteer.local"),
        ("content-type", "application/json"),
        ("content-length", &len),
        ("accept", "text/event-stream"),
    ]);
    if let Some((name, value)) = session {
        h.extend(pairs(&[(name, value)]));
    }
    for (k, v) in extra {
        h.push((k.to_ascii_lowercase().into_bytes(), v.clone().into_bytes()));
    }
    h
}

/// A completions body with a token-id prompt.
pub fn completion_body(prompt: &[u32], max_tokens: u32) -> Vec<u8> {
    completion_body_for(None, prompt, max_tokens)
}

/// [`completion_body`] for `model` (a LoRA adapter's name; `None`: [`MODEL`]). The name is written
/// as a JSON string.
pub fn completion_body_for(model: Option<&str>, prompt: &[u32], max_tokens: u32) -> Vec<u8> {
    let mut s = String::with_capacity(prompt.len() * 7 + 160);
    let model = serde_json::to_string(model.unwrap_or(MODEL)).unwrap_or_default();
    let _ = write!(s, "{{\"model\":{model},\"prompt\":[");
    for (i, t) in prompt.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(s, "{t}");
    }
    let _ = write!(
        s,
        "],\"max_tokens\":{max_tokens},\"stream\":true,\"ignore_eos\":true,\
         \"stream_options\":{{\"include_usage\":true}}}}"
    );
    s.into_bytes()
}

/// Response headers of a streamed completion.
pub fn sse_headers() -> Pairs {
    pairs(&[
        (":status", "200"),
        ("content-type", "text/event-stream; charset=utf-8"),
        ("cache-control", "no-cache"),
    ])
}

/// Response headers and body of an engine refusal (vLLM answers 400 with an error object).
pub fn error_response(message: &str) -> (Pairs, Vec<u8>) {
    let body = serde_json::json!({
        "object": "error", "message": message, "type": "BadRequestError", "param": null, "code": 400
    })
    .to_string()
    .into_bytes();
    let len = body.len().to_string();
    (
        pairs(&[
            (":status", "400"),
            ("content-type", "application/json"),
            ("content-length", &len),
        ]),
        body,
    )
}

/// Response headers and body of an engine failure with `status` (vLLM's error object).
pub fn engine_error_response(status: u16, message: &str) -> (Pairs, Vec<u8>) {
    let body = serde_json::json!({
        "object": "error", "message": message, "type": "InternalServerError", "param": null,
        "code": status
    })
    .to_string()
    .into_bytes();
    let len = body.len().to_string();
    let code = status.to_string();
    (
        pairs(&[
            (":status", &code),
            ("content-type", "application/json"),
            ("content-length", &len),
        ]),
        body,
    )
}

/// vLLM's in-stream error event, sent when generation fails after the 200 went out.
pub fn sse_error_event(message: &str) -> Vec<u8> {
    let event = serde_json::json!({
        "error": {"object": "error", "message": message, "type": "InternalServerError",
                  "param": null, "code": 500}
    });
    format!("data: {event}\n\n").into_bytes()
}

/// Builds the SSE body of one streamed completion, chunk by chunk.
///
/// Chunking, on purpose: every `split_every`-th body chunk (when non-zero) holds back the last few bytes
/// of its last event and sends them at the start of the next chunk, so the filter sees events split
/// across chunk boundaries, as it does behind a real network.
#[derive(Clone, Debug)]
pub struct SseWriter {
    id: String,
    created: u64,
    carry: Vec<u8>,
    chunks: u64,
    split_every: u64,
}

/// Bytes held back when an event is split across chunks.
const SPLIT_TAIL: usize = 11;

impl SseWriter {
    pub fn new(request_id: u64, created_s: u64, split_every: u64) -> SseWriter {
        SseWriter {
            id: format!("cmpl-{request_id:016x}"),
            created: created_s,
            carry: Vec::new(),
            chunks: 0,
            split_every,
        }
    }

    /// One `data:` event, as vLLM writes a streamed completion chunk. Written by hand rather than through
    /// a JSON tree: the harness writes one per generated token, millions in a replay.
    fn event(&self, text: &str, finish: Option<&str>, out: &mut Vec<u8>) {
        use std::io::Write as _;
        let text = serde_json::to_string(text).expect("a string always serialises");
        let finish = finish.map_or_else(|| "null".to_string(), |f| format!("\"{f}\""));
        // Writing into a Vec cannot fail.
        let _ = write!(
            out,
            "data: {{\"id\":\"{}\",\"object\":\"text_completion\",\"created\":{},\"model\":\"{MODEL}\",\
             \"choices\":[{{\"index\":0,\"text\":{text},\"logprobs\":null,\"finish_reason\":{finish},\
             \"stop_reason\":null}}],\"usage\":null}}\n\n",
            self.id, self.created
        );
    }

    /// One event per token, as engines stream them (vLLM and SGLang send one `data:` event per generated
    /// token); the last one carries `finish` when given. No token at all still gets one event when
    /// `finish` is given, with empty text, as vLLM sends for a stop without new text.
    fn token_events(&self, ids: &[u32], finish: Option<&str>, out: &mut Vec<u8>) {
        let mut text = String::new();
        for (i, &id) in ids.iter().enumerate() {
            text.clear();
            kvsteer_sim::tokenize::token_text(id, &mut text);
            let last = i + 1 == ids.len();
            self.event(&text, if last { finish } else { None }, out);
        }
        if ids.is_empty() && finish.is_some() {
            self.event("", finish, out);
        }
    }

    fn emit(&mut self, mut bytes: Vec<u8>, last: bool) -> Vec<u8> {
        let mut chunk = std::mem::take(&mut self.carry);
        chunk.append(&mut bytes);
        self.chunks += 1;
        if !last
            && self.split_every > 0
            && self.chunks.is_multiple_of(self.split_every)
            && chunk.len() > SPLIT_TAIL
        {
            self.carry = chunk.split_off(chunk.len() - SPLIT_TAIL);
        }
        chunk
    }

    /// A body chunk carrying some generated tokens, one event each: a proxy hands the filter several
    /// events in one chunk when the upstream sends them faster than the filter reads.
    pub fn tokens(&mut self, ids: &[u32]) -> Vec<u8> {
        let mut b = Vec::with_capacity(ids.len() * 200);
        self.token_events(ids, None, &mut b);
        self.emit(b, false)
    }

    /// The last body chunk: the remaining tokens (the last with the finish reason), the usage event,
    /// `[DONE]`.
    pub fn finish(
        &mut self,
        ids: &[u32],
        reason: &str,
        prompt_tokens: u32,
        completion_tokens: u32,
        cached_tokens: u32,
    ) -> Vec<u8> {
        let mut b = Vec::with_capacity(ids.len() * 200 + 600);
        self.token_events(ids, Some(reason), &mut b);
        let usage = serde_json::json!({
            "id": self.id, "object": "text_completion", "created": self.created, "model": MODEL,
            "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens,
                      "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        });
        b.extend_from_slice(b"data: ");
        b.extend_from_slice(usage.to_string().as_bytes());
        b.extend_from_slice(b"\n\ndata: [DONE]\n\n");
        self.emit(b, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_is_json_with_the_prompt() {
        let b = completion_body(&[1, 2, 300], 7);
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["prompt"], serde_json::json!([1, 2, 300]));
        assert_eq!(v["max_tokens"], 7);
        assert_eq!(v["stream"], true);
        assert_eq!(v["ignore_eos"], true);
    }

    #[test]
    fn split_events_reassemble_to_whole_events() {
        let mut w = SseWriter::new(5, 0, 2);
        let mut all = Vec::new();
        let mut split = false;
        for i in 0..5u32 {
            let c = w.tokens(&[2 * i + 300, 2 * i + 301]);
            split |= !c.ends_with(b"\n\n");
            all.extend(c);
        }
        all.extend(w.finish(&[400], "length", 10, 11, 4));
        assert!(split, "some chunk must end inside an event");
        let text = String::from_utf8(all).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
        // One event per token (11), the usage event, [DONE].
        assert_eq!(events.len(), 13);
        assert_eq!(events[12], "data: [DONE]");
        let usage: serde_json::Value =
            serde_json::from_str(events[11].strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
        for (i, e) in events[..11].iter().enumerate() {
            let v: serde_json::Value =
                serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(v["object"], "text_completion");
            let finish = &v["choices"][0]["finish_reason"];
            assert_eq!(finish.as_str(), (i == 10).then_some("length"), "event {i}");
        }
    }
}
