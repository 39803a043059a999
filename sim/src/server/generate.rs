//! A generation request (`/v1/completions`, `/v1/chat/completions`): submitted to the engine of its
//! rank, then answered whole when it finishes or handed to [`super::stream`] as it runs. A client
//! that leaves drops its handler or its stream, and the request is aborted then ([`Abandon`]).

use super::api::{ApiError, json_response};
use super::openai::{Api, GenParams, parse_params};
use super::stream::SseBody;
use super::{RANK_HEADER, Shared, unix_now};
use crate::engine::{EngineConfig, EngineEvent, EngineRequest, FinishReason};
use crate::output::{mix64, unit};
use crate::tokenize::token_text;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

pub(super) async fn completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(s, &headers, &body, Api::Completions).await
}

pub(super) async fn chat(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(s, &headers, &body, Api::Chat).await
}

/// The `usage` object of an answer or of a stream's last chunk.
pub(super) fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt as u64 + completion as u64,
        "prompt_tokens_details": {"cached_tokens": cached}})
}

/// Aborts its request when dropped before [`Abandon::finished`]: the handler or the stream was
/// dropped because the client left (hyper notices a closed connection while a request is in
/// flight), so the engine stops spending steps, and cache, on it.
pub(super) struct Abandon {
    shared: Arc<Shared>,
    id: u64,
    done: bool,
}

impl Abandon {
    pub(super) fn new(shared: Arc<Shared>, id: u64) -> Self {
        Self {
            shared,
            id,
            done: false,
        }
    }

    /// The request ended on its own; nothing to abort.
    pub(super) fn finished(&mut self) {
        self.done = true;
    }
}

impl Drop for Abandon {
    fn drop(&mut self) {
        if !self.done {
            self.shared.abandon(self.id);
        }
    }
}

/// What names an answer: its id, object type, model and creation time.
pub(super) struct Answer {
    pub api: Api,
    pub rid: String,
    pub model: String,
    pub created: u64,
    pub return_token_ids: bool,
}

struct Done {
    prompt_tokens: u32,
    cached_tokens: u32,
    completion_tokens: u32,
    reason: FinishReason,
}

async fn generate(shared: Arc<Shared>, headers: &HeaderMap, body: &[u8], api: Api) -> Response {
    let p = match parse_params(body, api) {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    // The profile's request overhead (a real engine's API server), as latency before the engine
    // sees the request, in wall time at the replica's time scale.
    let overhead_us = shared.lock().engines[0]
        .config()
        .profile
        .request_overhead_us;
    if overhead_us > 0.0 {
        let wall = overhead_us / 1e6 / shared.clock.scale;
        tokio::time::sleep(Duration::try_from_secs_f64(wall).unwrap_or(Duration::ZERO)).await;
    }
    let rank_header = headers.get(RANK_HEADER).and_then(|v| v.to_str().ok());
    let (id, mut rx) = match submit(&shared, &p, api, rank_header) {
        Ok(x) => x,
        Err(e) => return e.into_response(),
    };
    let guard = Abandon::new(shared.clone(), id);
    let a = Answer {
        api,
        rid: match api {
            Api::Completions => format!("cmpl-{}-{id}", shared.name),
            Api::Chat => format!("chatcmpl-{}-{id}", shared.name),
        },
        model: if p.model.is_empty() {
            shared.model.clone()
        } else {
            p.model.clone()
        },
        created: unix_now(),
        return_token_ids: p.return_token_ids,
    };
    if p.stream {
        let body = SseBody::new(a, rx, guard);
        return (
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            Body::new(body),
        )
            .into_response();
    }
    whole(&shared, a, &p, &mut rx, guard).await
}

/// Waits for the request to finish and answers it in one JSON object.
async fn whole(
    shared: &Shared,
    a: Answer,
    p: &GenParams,
    rx: &mut UnboundedReceiver<EngineEvent>,
    mut guard: Abandon,
) -> Response {
    let mut text = String::new();
    let mut ids = Vec::new();
    let done = loop {
        match rx.recv().await {
            Some(EngineEvent::FirstToken { token, .. } | EngineEvent::Token { token, .. }) => {
                token_text(token, &mut text);
                ids.push(token);
            }
            Some(EngineEvent::Finished {
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                ..
            }) => {
                break Done {
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                    reason,
                };
            }
            None => {
                let mut r = ApiError::aborted().into_response();
                r.headers_mut()
                    .insert(header::CONNECTION, "close".parse().expect("a header value"));
                return r;
            }
        }
    };
    guard.finished();
    if done.reason == FinishReason::Abort {
        return ApiError::aborted().into_response();
    }
    let mut choice = match a.api {
        Api::Completions => json!({"index": 0, "text": text, "logprobs": null,
            "finish_reason": done.reason.as_str()}),
        Api::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": null, "finish_reason": done.reason.as_str()}),
    };
    if p.return_token_ids {
        choice["token_ids"] = json!(ids);
        choice["prompt_token_ids"] = json!(p.prompt);
    }
    let object = match a.api {
        Api::Completions => "text_completion",
        Api::Chat => "chat.completion",
    };
    let mut v = json!({"id": a.rid, "object": object, "created": a.created, "model": a.model,
        "choices": [choice],
        "usage": usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)});
    if p.remote_decode && done.reason == FinishReason::Length {
        v["kv_transfer_params"] = prefill_answer(shared, &a.rid, &p.prompt);
    }
    json_response(&v)
}

/// The `kv_transfer_params` a prefill leg answers with, in the NIXL producer's shape
/// (docs/design/pd.md). The simulator moves no real KV: the block ids are stand-ins (one per full
/// prompt block), the side channel host and port are null, and the decode leg only reads the
/// `do_remote_prefill` flag.
fn prefill_answer(shared: &Shared, rid: &str, prompt: &[u32]) -> Value {
    let bs = shared.lock().engines[0].config().block_size.max(1);
    let blocks: Vec<usize> = (0..prompt.len() / bs).collect();
    json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": blocks, "remote_engine_id": shared.name,
        "remote_request_id": rid, "remote_host": null, "remote_port": null, "tp_size": 1})
}

/// Hands the request to its rank's engine (the rank header's, else vLLM's balancer) and returns its
/// id and where its events arrive; refusals (injected faults, too long a prompt) come back as errors.
fn submit(
    shared: &Shared,
    p: &GenParams,
    api: Api,
    rank_header: Option<&str>,
) -> Result<(u64, UnboundedReceiver<EngineEvent>), ApiError> {
    let mut g = shared.lock();
    let rate = g.faults.error_rate;
    if rate > 0.0 {
        g.fault_draws += 1;
        if unit(mix64(g.fault_draws ^ 0x0066_6175_6c74)) <= rate {
            return Err(ApiError::server(500, "injected error (fault)"));
        }
    }
    let max_tokens = max_tokens(g.engines[0].config(), p, api)?;
    let id = g.next_id;
    let req = EngineRequest {
        id,
        prompt: p.prompt.clone(),
        max_tokens,
        ignore_eos: p.ignore_eos,
        min_tokens: p.min_tokens,
    };
    let now = shared.clock.now_us();
    let rank = g.rank_for(now, rank_header);
    let sent = if p.remote_prefill {
        g.engines[rank]
            .submit_remote(now, req, &crate::kv_link::KvLink::default())
            .map(|_| ())
    } else {
        // vLLM serves a LoRA adapter under its own name: any `model` but the served one names one.
        let adapter = Some(p.model.as_str()).filter(|m| !m.is_empty() && *m != shared.model);
        g.engines[rank].submit_with_adapter(now, req, adapter)
    };
    sent.map_err(|e| ApiError::bad("prompt", e.to_string()))?;
    g.next_id += 1;
    let (tx, rx) = unbounded_channel();
    g.subs.insert(id, tx);
    g.rank_of.insert(id, rank);
    shared.cv.notify_all();
    Ok((id, rx))
}

/// The request's `max_tokens`, or a 400 if its prompt leaves no room in the context (vLLM's wording).
fn max_tokens(cfg: &EngineConfig, p: &GenParams, api: Api) -> Result<u32, ApiError> {
    let prompt_len = p.prompt.len() as u64;
    if prompt_len >= cfg.max_model_len as u64 {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "this model's maximum context length is {} tokens, but the prompt has {prompt_len} tokens",
                cfg.max_model_len
            ),
        ));
    }
    Ok(match (p.max_tokens, api) {
        (Some(n), _) => n,
        (None, Api::Completions) => 16,
        // Chat defaults to the rest of the context (as vLLM), bounded by what the cache can hold.
        (None, Api::Chat) => {
            let cache_tokens = cfg.kv_blocks as u64 * cfg.block_size as u64;
            (cfg.max_model_len as u64)
                .min(cache_tokens)
                .saturating_sub(prompt_len)
                .clamp(1, u32::MAX as u64) as u32
        }
    })
}
