//! The routes, OpenAI-style errors, and every answer but generation: health, models, `/metrics`, the
//! feed, the fault knobs, and what the peer routers of docs/reports/results/peers.md ask a replica
//! besides generation (vLLM's tokenizer and renderer endpoints, SGLang's server, model and load
//! reports).

use super::openai::{Api, body_object, get_bool, get_u32, request_prompt};
use super::{REPLICA_HEADER, Shared, admin, generate, unix_now};
use crate::engine::Engine;
use crate::metrics;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::http::{HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FEED_PATH, FeedQuery, query_rank};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

type S = State<Arc<Shared>>;

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    pub(super) fn new(
        status: u16,
        kind: &'static str,
        message: String,
        param: Option<&'static str>,
    ) -> Self {
        Self {
            status,
            kind,
            message,
            param,
        }
    }

    /// A 400 naming the parameter at fault.
    pub(super) fn bad(param: &'static str, message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", message.into(), Some(param))
    }

    /// A 500 or 503 of the server's own making.
    pub(super) fn server(status: u16, message: &str) -> Self {
        Self::new(status, "server_error", message.into(), None)
    }

    /// A request a restart aborted (the engine's `abort` finish).
    pub(super) fn aborted() -> Self {
        Self::server(503, "the request was aborted (engine restart)")
    }

    /// The error as its JSON body.
    pub(super) fn json(&self) -> String {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param,
            "code": self.status}})
        .to_string()
    }

    /// The answer, with the replica's name (the connection layer answers outside the router, where
    /// the header is not added for it).
    pub(super) fn response(&self, replica: &str) -> Response {
        let mut r = self.clone().into_response();
        name_replica(replica, &mut r);
        r
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            self.json(),
        )
            .into_response()
    }
}

/// A 200 with a JSON body.
pub(super) fn json_response(v: &Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// A JSON answer or its error.
fn answer(r: Result<Value, ApiError>) -> Response {
    match r {
        Ok(v) => json_response(&v),
        Err(e) => e.into_response(),
    }
}

fn name_replica(replica: &str, r: &mut Response) {
    if let Ok(v) = HeaderValue::from_str(replica) {
        r.headers_mut().insert(REPLICA_HEADER, v);
    }
}

/// Every route the replica serves; a known path asked with another method gets 405 naming the one
/// it takes, an unknown path 404, both as OpenAI errors. Every answer names the replica.
pub(super) fn router(shared: Arc<Shared>) -> Router {
    let post_only = |r: MethodRouter<Arc<Shared>>| r.fallback(wrong_method("POST"));
    let get_only = |r: MethodRouter<Arc<Shared>>| r.fallback(wrong_method("GET"));
    Router::new()
        .route("/v1/completions", post_only(post(generate::completions)))
        .route("/v1/chat/completions", post_only(post(generate::chat)))
        .route("/admin/fault", post_only(post(fault)))
        .route("/admin/stalls", get_only(get(stalls)))
        .route("/tokenize", post_only(post(tokenize)))
        .route(
            "/v1/completions/render",
            post_only(post(render_completions)),
        )
        .route("/v1/chat/completions/render", post_only(post(render_chat)))
        .route("/server_info", get_only(get(server_info)))
        .route("/get_server_info", get_only(get(server_info)))
        .route("/model_info", get_only(get(model_info)))
        .route("/get_model_info", get_only(get(model_info)))
        .route("/get_load", get_only(get(get_load)))
        .route("/health", get_only(get(health)))
        .route("/v1/models", get_only(get(models)))
        .route("/metrics", get_only(get(prometheus)))
        .route(FEED_PATH, get_only(get(feed)))
        .fallback(no_route)
        // The connection layer already refuses a body over MAX_BODY from its header; axum's own
        // default (2 MB) would refuse a long prompt's body that the connection accepted.
        .layer(axum::extract::DefaultBodyLimit::max(super::conn::MAX_BODY))
        .layer(axum::middleware::map_response_with_state(
            shared.clone(),
            |State(s): S, mut r: Response| async move {
                name_replica(&s.name, &mut r);
                r
            },
        ))
        .with_state(shared)
}

/// The 405 handler of a path that takes only `allowed`.
fn wrong_method(
    allowed: &'static str,
) -> impl Fn(Method, Uri) -> std::future::Ready<Response> + Clone + Send + Sync + 'static {
    move |method: Method, uri: Uri| {
        let e = ApiError::new(
            405,
            "invalid_request_error",
            format!(
                "method {method} not allowed on {}; use {allowed}",
                uri.path()
            ),
            None,
        );
        std::future::ready(e.into_response())
    }
}

async fn no_route(method: Method, uri: Uri) -> Response {
    ApiError::new(
        404,
        "not_found_error",
        format!("no route for {method} {}", uri.path()),
        None,
    )
    .into_response()
}

async fn health() -> Response {
    ([(header::CONTENT_TYPE, "text/plain")], "").into_response()
}

async fn models(State(s): S) -> Response {
    let max_len = s.lock().engines[0].config().max_model_len;
    json_response(
        &json!({"object": "list", "data": [{"id": s.model, "object": "model",
        "created": unix_now(), "owned_by": "kvsteer-sim", "root": s.model,
        "max_model_len": max_len}]}),
    )
}

/// `GET /metrics`: vLLM's Prometheus text; with DP ranks, one rank's engine (`?rank=R`, rank 0
/// without).
async fn prometheus(State(s): S, RawQuery(q): RawQuery) -> Response {
    let text = {
        let g = s.lock();
        let r = match query_rank(q.as_deref().unwrap_or("")) {
            Ok(Some(r)) if (r as usize) < g.engines.len() => r as usize,
            _ => 0,
        };
        metrics::render(&g.engines[r], &s.model)
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// `GET /kvsteer/feed` (docs/reference/feed.md): one rank's feed with `rank=R`, the union of the
/// ranks' caches without it; 503 while the `feed_outage` fault is set.
async fn feed(State(s): S, RawQuery(q): RawQuery) -> Response {
    let q = q.unwrap_or_default();
    match feed_body(&s, &q) {
        Ok(body) => (
            [(header::CONTENT_TYPE, FEED_CONTENT_TYPE)],
            Body::from(body),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

fn feed_body(s: &Shared, query: &str) -> Result<Vec<u8>, ApiError> {
    let q = FeedQuery::parse(query).map_err(|m| ApiError::bad("query", m))?;
    let rank = query_rank(query).map_err(|m| ApiError::bad("rank", m))?;
    let mut g = s.lock();
    if g.faults.feed_outage {
        return Err(ApiError::server(503, "feed outage (fault)"));
    }
    let core = &mut *g;
    let n = core.engines.len();
    Ok(match rank {
        // Rank R's own feed, stamped with R.
        Some(r) if (r as usize) < n => core.engines[r as usize].feed_answer(&q, query, Some(r)),
        Some(r) => {
            return Err(ApiError::bad(
                "rank",
                format!("no data-parallel rank {r} here ({n} rank(s))"),
            ));
        }
        None if n == 1 => core.engines[0].feed_answer(&q, query, None),
        // A rank-blind poll of a DP endpoint: the union of its ranks' caches.
        None => {
            let mut engines: Vec<&mut Engine> = core.engines.iter_mut().collect();
            core.union.answer(&mut engines, &q).encode()
        }
    })
}

async fn fault(State(s): S, body: Bytes) -> Response {
    answer(admin::set_faults(&s, &body))
}

/// `GET /admin/stalls`: the random stalls that held up a step, per data-parallel rank, as
/// `[from, end]` pairs of engine microseconds, with what places them on the wall clock
/// (`clock_start_unix_us`, the Unix time of engine time 0, and `time_scale`). A bench reads them
/// to tell the time a request waited out a stall from the time its routing cost it.
async fn stalls(State(s): S) -> Response {
    let g = s.lock();
    let ranks: Vec<Vec<[u64; 2]>> = g
        .engines
        .iter()
        .map(|e| e.held_stalls().map(|(a, b)| [a, b]).collect())
        .collect();
    json_response(&json!({"clock_start_unix_us": s.clock.start_unix_us,
        "time_scale": s.clock.scale, "ranks": ranks}))
}

/// `POST /tokenize`, as vLLM answers it: `{"prompt": ...}` or `{"messages": [...]}` to
/// `{"count", "max_model_len", "tokens", "token_strs"}`, with the ids generation would use.
async fn tokenize(State(s): S, body: Bytes) -> Response {
    answer((|| {
        let o = body_object(&body)?;
        let api = if o.contains_key("messages") && !o.contains_key("prompt") {
            Api::Chat
        } else {
            Api::Completions
        };
        let ids = request_prompt(&o, api)?;
        let max_len = s.lock().engines[0].config().max_model_len;
        Ok(
            json!({"count": ids.len(), "max_model_len": max_len, "tokens": ids,
            "token_strs": null}),
        )
    })())
}

async fn render_completions(State(s): S, body: Bytes) -> Response {
    answer(render(&s, &body, Api::Completions))
}

async fn render_chat(State(s): S, body: Bytes) -> Response {
    answer(render(&s, &body, Api::Chat))
}

static RENDERS: AtomicUsize = AtomicUsize::new(0);

/// `POST /v1/completions/render` and `/v1/chat/completions/render`, as vLLM's renderer answers
/// them: the token-in request generation would run (`token_ids`, `sampling_params`, `model`,
/// `request_id`); a list of one for completions, the object itself for chat. Nothing is generated.
fn render(shared: &Shared, body: &[u8], api: Api) -> Result<Value, ApiError> {
    let o = body_object(body)?;
    let ids = request_prompt(&o, api)?;
    let model = match o.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        _ => shared.model.clone(),
    };
    let mut max_tokens = get_u32(&o, "max_tokens")?;
    if api == Api::Chat {
        max_tokens = get_u32(&o, "max_completion_tokens")?.or(max_tokens);
    }
    let n = RENDERS.fetch_add(1, Ordering::Relaxed);
    let prefix = match api {
        Api::Completions => "cmpl",
        Api::Chat => "chatcmpl",
    };
    let one = json!({"request_id": format!("{prefix}-{}-render-{n}", shared.name),
        "model": model, "token_ids": ids,
        "sampling_params": {"max_tokens": max_tokens,
            "ignore_eos": get_bool(&o, "ignore_eos")?}});
    Ok(match api {
        Api::Completions => json!([one]),
        Api::Chat => one,
    })
}

/// `GET /server_info` (and SGLang's older `/get_server_info`): the fields SGLang reports that the
/// simulator has an answer for. No `model_path`: there is no model to load a tokenizer from.
async fn server_info(State(shared): S) -> Response {
    let g = shared.lock();
    let cfg = g.engines[0].config();
    json_response(
        &json!({"served_model_name": shared.model, "version": env!("CARGO_PKG_VERSION"),
        "dp_size": g.engines.len(), "max_running_requests": cfg.max_running,
        "max_prefill_tokens": cfg.max_batch_tokens,
        "max_total_tokens": cfg.kv_blocks as u64 * cfg.block_size as u64,
        "page_size": cfg.block_size, "context_length": cfg.max_model_len}),
    )
}

/// `GET /model_info` (and `/get_model_info`): a generation model without a tokenizer path.
async fn model_info(State(shared): S) -> Response {
    json_response(
        &json!({"model_path": null, "tokenizer_path": null, "is_generation": true,
        "model_type": "kvsteer-sim", "architectures": ["KvsteerSim"],
        "served_model_name": shared.model}),
    )
}

/// `GET /get_load`, as SGLang answers it: one entry per data-parallel rank with the requests
/// running and waiting and the tokens held or queued ([`Engine::load_tokens`]).
async fn get_load(State(shared): S) -> Response {
    let g = shared.lock();
    let ranks: Vec<Value> = g
        .engines
        .iter()
        .enumerate()
        .map(|(r, e)| {
            let load = e.load();
            json!({"dp_rank": r, "num_reqs": load.running + load.waiting,
                "num_waiting_reqs": load.waiting, "num_tokens": e.load_tokens()})
        })
        .collect();
    json_response(&Value::Array(ranks))
}
