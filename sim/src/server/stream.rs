//! A streamed answer as server-sent events, as vLLM frames it: one `data:` event per token (chat
//! opens with the assistant's role), a chunk with `finish_reason`, a chunk with `"choices": []` and
//! `usage`, then `data: [DONE]`. Each event is its own body frame, so hyper sends each as its own
//! HTTP chunk as soon as the engine produces it.

use super::api::ApiError;
use super::generate::{Abandon, Answer, usage};
use super::openai::Api;
use crate::engine::{EngineEvent, FinishReason};
use crate::tokenize::token_text;
use axum::body::Bytes;
use http_body::{Body, Frame, SizeHint};
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::sync::mpsc::UnboundedReceiver;

/// The response body of a streamed request: events from the driver, framed as SSE. Dropping it
/// before the end (hyper does when the client leaves) aborts the request through its [`Abandon`].
pub(super) struct SseBody {
    a: Answer,
    rx: UnboundedReceiver<EngineEvent>,
    guard: Abandon,
    /// Events framed but not yet handed to hyper.
    queued: VecDeque<Bytes>,
    /// `[DONE]` is queued: nothing more comes from the engine.
    ended: bool,
    piece: String,
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

const DONE: &[u8] = b"data: [DONE]\n\n";

impl SseBody {
    pub(super) fn new(a: Answer, rx: UnboundedReceiver<EngineEvent>, guard: Abandon) -> Self {
        let mut s = Self {
            a,
            rx,
            guard,
            queued: VecDeque::new(),
            ended: false,
            piece: String::new(),
        };
        if s.a.api == Api::Chat {
            let first = s.chunk(
                json!({"index": 0, "delta": {"role": "assistant", "content": ""},
                "logprobs": null, "finish_reason": null}),
            );
            s.queued.push_back(sse(&first));
        }
        s
    }

    fn object(&self) -> &'static str {
        match self.a.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion.chunk",
        }
    }

    fn chunk(&self, choice: Value) -> Value {
        json!({"id": self.a.rid, "object": self.object(), "created": self.a.created,
            "model": self.a.model, "choices": [choice]})
    }

    /// Frames one engine event (or the end of the events, `None`) into the queue.
    fn on_event(&mut self, ev: Option<EngineEvent>) {
        match ev {
            Some(EngineEvent::FirstToken { token, .. } | EngineEvent::Token { token, .. }) => {
                self.piece.clear();
                token_text(token, &mut self.piece);
                let mut choice = match self.a.api {
                    Api::Completions => json!({"index": 0, "text": self.piece, "logprobs": null,
                        "finish_reason": null}),
                    Api::Chat => json!({"index": 0, "delta": {"content": self.piece},
                        "logprobs": null, "finish_reason": null}),
                };
                if self.a.return_token_ids {
                    choice["token_ids"] = json!([token]);
                }
                let c = self.chunk(choice);
                self.queued.push_back(sse(&c));
            }
            Some(EngineEvent::Finished {
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                ..
            }) => {
                self.guard.finished();
                if reason == FinishReason::Abort {
                    let e = ApiError::aborted();
                    self.queued
                        .push_back(sse(&json!({"error": {"message": e.message,
                        "type": e.kind, "code": e.status}})));
                } else {
                    let choice = match self.a.api {
                        Api::Completions => json!({"index": 0, "text": "", "logprobs": null,
                            "finish_reason": reason.as_str()}),
                        Api::Chat => json!({"index": 0, "delta": {}, "logprobs": null,
                            "finish_reason": reason.as_str()}),
                    };
                    let c = self.chunk(choice);
                    self.queued.push_back(sse(&c));
                    // vLLM sends usage in a last chunk with no choices when
                    // stream_options.include_usage is set; it is always sent here.
                    let u = json!({"id": self.a.rid, "object": self.object(),
                        "created": self.a.created, "model": self.a.model, "choices": [],
                        "usage": usage(prompt_tokens, completion_tokens, cached_tokens)});
                    self.queued.push_back(sse(&u));
                }
                self.queued.push_back(Bytes::from_static(DONE));
                self.ended = true;
            }
            // The driver dropped the request without finishing it.
            None => {
                self.queued.push_back(sse(&json!({"error": {
                    "message": "the request was aborted", "type": "server_error", "code": 503}})));
                self.queued.push_back(Bytes::from_static(DONE));
                self.ended = true;
            }
        }
    }
}

impl Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        loop {
            if let Some(b) = self.queued.pop_front() {
                return Poll::Ready(Some(Ok(Frame::data(b))));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            let ev = std::task::ready!(self.rx.poll_recv(cx));
            self.on_event(ev);
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.queued.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}
