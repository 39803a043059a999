//! Server mode: one engine per replica behind an OpenAI-compatible HTTP API, the feed, `/metrics`
//! and fault knobs, in real time (optionally scaled).
//!
//! Each replica has a *driver* thread that owns the clock: it advances the engine to "now" (virtual
//! microseconds = wall microseconds x time scale), hands each request's events to the connection
//! thread waiting for them, and sleeps until the next step ends or a new request arrives. Connection
//! threads parse, submit, then stream what the driver sends them. A client that goes away is noticed
//! when its next event cannot be delivered, and its request is aborted so nothing leaks.

use crate::engine::{Engine, EngineConfig, EngineEvent, EngineRequest, FinishReason};
use crate::http::{self, Chunked, HttpError, Request};
use crate::metrics;
use crate::output::{VOCAB, mix64, unit};
use crate::tokenize::{token_text, tokenize};
use hashbrown::HashMap;
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FEED_PATH, FeedQuery};
use serde_json::{Value, json};
use std::io::{self, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Header naming the replica on every response.
pub const REPLICA_HEADER: &str = "x-kvsteer-replica";
/// Connections served at once; more are answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 1024;

/// One replica's settings.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    pub name: String,
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// Virtual seconds per wall second (10 runs the simulated GPU ten times faster than real).
    pub time_scale: f64,
    /// Served model name (requests may name any model; it is echoed back).
    pub model: String,
    pub engine: EngineConfig,
    /// Data-parallel ranks behind this endpoint (1: one engine). Each rank is its own engine (own
    /// cache and queue, seeds derived from the rank); a request's rank comes from the
    /// `x-data-parallel-rank` header, else from vLLM's internal balancer
    /// ([`crate::dp::DpBalancer`]). docs/dp.md.
    pub dp_ranks: usize,
}

/// Fault knobs set through `POST /admin/fault`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Fraction of generation requests answered with HTTP 500.
    pub error_rate: f64,
    /// The feed answers 503 while set.
    pub feed_outage: bool,
}

struct Core {
    /// One engine per DP rank (one without ranks).
    engines: Vec<Engine>,
    /// The rank each request in flight runs on.
    rank_of: HashMap<u64, usize>,
    balancer: crate::dp::DpBalancer,
    /// The endpoint's rank-blind feed (polls without `rank` when there are several ranks).
    union: crate::dp::UnionFeed,
    subs: HashMap<u64, Sender<EngineEvent>>,
    next_id: u64,
    faults: Faults,
    fault_draws: u64,
}

struct Clock {
    start: Instant,
    scale: f64,
}

impl Clock {
    fn now_us(&self) -> u64 {
        (self.start.elapsed().as_secs_f64() * 1e6 * self.scale) as u64
    }

    /// Wall time until virtual time `t_us`, at most a second (the driver wakes and re-reads the clock).
    fn real_until(&self, now_us: u64, t_us: u64) -> Duration {
        let secs = t_us.saturating_sub(now_us) as f64 / 1e6 / self.scale;
        Duration::try_from_secs_f64(secs.min(1.0)).unwrap_or(Duration::from_secs(1))
    }
}

struct Shared {
    name: String,
    model: String,
    core: Mutex<Core>,
    cv: Condvar,
    clock: Clock,
    shutdown: AtomicBool,
    connections: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panicking connection thread must not take the replica down with a poisoned lock.
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A running replica.
pub struct Replica {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl Replica {
    /// Binds, starts the driver and the accept loop, and returns once listening.
    pub fn start(cfg: ReplicaConfig) -> io::Result<Replica> {
        let listener = TcpListener::bind((cfg.host.as_str(), cfg.port))?;
        let addr = listener.local_addr()?;
        let scale = if cfg.time_scale.is_finite() && cfg.time_scale > 0.0 {
            cfg.time_scale
        } else {
            1.0
        };
        let shared = Arc::new(Shared {
            name: cfg.name,
            model: cfg.model,
            core: Mutex::new(Core {
                engines: (0..cfg.dp_ranks.max(1))
                    .map(|r| {
                        let mut e = cfg.engine.clone();
                        if r > 0 {
                            e.seed = mix64(e.seed ^ (r as u64).rotate_left(24));
                            e.epoch = mix64(e.epoch ^ r as u64) | 1;
                        }
                        Engine::new(e)
                    })
                    .collect(),
                rank_of: HashMap::new(),
                balancer: crate::dp::DpBalancer::new(cfg.dp_ranks.max(1)),
                union: crate::dp::UnionFeed::new(
                    cfg.dp_ranks.max(1),
                    mix64(cfg.engine.epoch ^ 0xD9),
                    cfg.engine.feed_log_hashes,
                ),
                subs: HashMap::new(),
                next_id: 1,
                faults: Faults::default(),
                fault_draws: 0,
            }),
            cv: Condvar::new(),
            clock: Clock {
                start: Instant::now(),
                scale,
            },
            shutdown: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
        });
        let s = shared.clone();
        thread::Builder::new()
            .name(format!("{}-driver", shared.name))
            .spawn(move || drive(s))?;
        let s = shared.clone();
        thread::Builder::new()
            .name(format!("{}-accept", shared.name))
            .spawn(move || accept(s, listener))?;
        Ok(Replica { shared, addr })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Stops accepting and driving. Connections in progress end when their client does.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.cv.notify_all();
        // Wake the accept loop.
        let _ = TcpStream::connect(self.addr);
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn drive(shared: Arc<Shared>) {
    let mut events = Vec::new();
    let mut g = shared.lock();
    while !shared.shutdown.load(Ordering::SeqCst) {
        let now = shared.clock.now_us();
        for e in g.engines.iter_mut() {
            e.advance(now, &mut events);
        }
        let mut dead = Vec::new();
        for ev in events.drain(..) {
            let id = ev.id();
            let fin = matches!(ev, EngineEvent::Finished { .. });
            if let Some(tx) = g.subs.get(&id)
                && tx.send(ev).is_err()
            {
                dead.push(id);
            }
            if fin {
                g.subs.remove(&id);
                g.rank_of.remove(&id);
            }
        }
        if !dead.is_empty() {
            for id in dead {
                g.subs.remove(&id);
                let r = g.rank_of.remove(&id).unwrap_or(0);
                if let Some(e) = g.engines.get_mut(r) {
                    e.abort(now, id);
                }
            }
            continue;
        }
        let wait = match g.engines.iter().filter_map(Engine::next_event_time).min() {
            Some(t) => shared.clock.real_until(now, t),
            None => Duration::from_millis(500),
        };
        g = shared
            .cv
            .wait_timeout(g, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn accept(shared: Arc<Shared>, listener: TcpListener) {
    for conn in listener.incoming() {
        if shared.shutdown.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = conn else {
            // Out of descriptors or a reset before accept: back off instead of spinning.
            thread::sleep(Duration::from_millis(10));
            continue;
        };
        let n = shared.connections.fetch_add(1, Ordering::SeqCst);
        let s = shared.clone();
        let spawned = thread::Builder::new()
            .name(format!("{}-conn", shared.name))
            .spawn(move || {
                if n >= MAX_CONNECTIONS {
                    let mut w = stream;
                    let _ = error_response(&s, &mut w, &ApiError::busy(), false);
                } else {
                    serve_connection(&s, stream);
                }
                s.connections.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            shared.connections.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn serve_connection(shared: &Shared, stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(http::IDLE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(http::IDLE_TIMEOUT));
    let Ok(read_half) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(read_half);
    let mut w = stream;
    loop {
        match http::read_request(&mut reader) {
            Err(HttpError::Closed) => return,
            Err(e) => {
                let err = ApiError::new(e.status(), "invalid_request_error", e.message(), None);
                let _ = error_response(shared, &mut w, &err, false);
                return;
            }
            Ok(req) => {
                let keep = req.keep_alive;
                if route(shared, &req, &mut w).is_err() || !keep {
                    return;
                }
            }
        }
    }
}

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: u16,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ApiError {
    fn new(status: u16, kind: &'static str, message: String, param: Option<&'static str>) -> Self {
        Self {
            status,
            kind,
            message,
            param,
        }
    }

    fn bad(param: &'static str, message: impl Into<String>) -> Self {
        Self::new(400, "invalid_request_error", message.into(), Some(param))
    }

    fn busy() -> Self {
        Self::new(503, "server_error", "too many connections".into(), None)
    }

    fn body(&self) -> Vec<u8> {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param,
            "code": self.status}})
        .to_string()
        .into_bytes()
    }
}

fn error_response(
    shared: &Shared,
    w: &mut TcpStream,
    e: &ApiError,
    keep_alive: bool,
) -> io::Result<()> {
    http::write_response(
        w,
        e.status,
        "application/json",
        &[(REPLICA_HEADER, &shared.name)],
        &e.body(),
        keep_alive,
    )
}

fn json_response(shared: &Shared, w: &mut TcpStream, v: &Value, keep: bool) -> io::Result<()> {
    http::write_response(
        w,
        200,
        "application/json",
        &[(REPLICA_HEADER, &shared.name)],
        v.to_string().as_bytes(),
        keep,
    )
}

fn route(shared: &Shared, req: &Request, w: &mut TcpStream) -> io::Result<()> {
    let keep = req.keep_alive;
    let method_err = |allowed: &str| {
        ApiError::new(
            405,
            "invalid_request_error",
            format!(
                "method {} not allowed on {}; use {allowed}",
                req.method, req.path
            ),
            None,
        )
    };
    match (req.path.as_str(), req.method.as_str()) {
        ("/v1/completions", "POST") => generate(shared, req, Api::Completions, w),
        ("/v1/chat/completions", "POST") => generate(shared, req, Api::Chat, w),
        ("/admin/fault", "POST") => match admin_fault(shared, &req.body) {
            Ok(v) => json_response(shared, w, &v, keep),
            Err(e) => error_response(shared, w, &e, keep),
        },
        // What the peer routers of docs/results/peers.md ask a replica besides generation:
        // vLLM's tokenizer and renderer endpoints (vllm-router's cache_aware on text prompts) and
        // SGLang's server, model and load reports (sglang-router's worker discovery and
        // power_of_two).
        ("/tokenize", "POST") => match tokenize_endpoint(shared, &req.body) {
            Ok(v) => json_response(shared, w, &v, keep),
            Err(e) => error_response(shared, w, &e, keep),
        },
        ("/v1/completions/render", "POST") => match render(shared, &req.body, Api::Completions) {
            Ok(v) => json_response(shared, w, &v, keep),
            Err(e) => error_response(shared, w, &e, keep),
        },
        ("/v1/chat/completions/render", "POST") => match render(shared, &req.body, Api::Chat) {
            Ok(v) => json_response(shared, w, &v, keep),
            Err(e) => error_response(shared, w, &e, keep),
        },
        ("/server_info" | "/get_server_info", "GET") => {
            json_response(shared, w, &server_info(shared), keep)
        }
        ("/model_info" | "/get_model_info", "GET") => {
            json_response(shared, w, &model_info(shared), keep)
        }
        ("/get_load", "GET") => json_response(shared, w, &get_load(shared), keep),
        (
            "/v1/completions"
            | "/v1/chat/completions"
            | "/admin/fault"
            | "/tokenize"
            | "/v1/completions/render"
            | "/v1/chat/completions/render",
            _,
        ) => error_response(shared, w, &method_err("POST"), keep),
        (
            "/server_info" | "/get_server_info" | "/model_info" | "/get_model_info" | "/get_load",
            _,
        ) => error_response(shared, w, &method_err("GET"), keep),
        ("/health", "GET") => http::write_response(
            w,
            200,
            "text/plain",
            &[(REPLICA_HEADER, &shared.name)],
            b"",
            keep,
        ),
        ("/v1/models", "GET") => {
            let max_len = shared.lock().engines[0].config().max_model_len;
            let v = json!({"object": "list", "data": [{"id": shared.model, "object": "model",
                "created": unix_now(), "owned_by": "kvsteer-sim", "root": shared.model,
                "max_model_len": max_len}]});
            json_response(shared, w, &v, keep)
        }
        ("/metrics", "GET") => {
            // With DP ranks, one rank's engine (`?rank=R`, rank 0 without).
            let text = {
                let g = shared.lock();
                let r = match kvsteer_core::feed::query_rank(&req.query) {
                    Ok(Some(r)) if (r as usize) < g.engines.len() => r as usize,
                    _ => 0,
                };
                metrics::render(&g.engines[r], &shared.model)
            };
            http::write_response(
                w,
                200,
                "text/plain; version=0.0.4",
                &[(REPLICA_HEADER, &shared.name)],
                text.as_bytes(),
                keep,
            )
        }
        (FEED_PATH, "GET") => {
            let q = match FeedQuery::parse(&req.query) {
                Ok(q) => q,
                Err(m) => return error_response(shared, w, &ApiError::bad("query", m), keep),
            };
            let rank = match kvsteer_core::feed::query_rank(&req.query) {
                Ok(r) => r,
                Err(m) => return error_response(shared, w, &ApiError::bad("rank", m), keep),
            };
            let body = {
                let mut g = shared.lock();
                if g.faults.feed_outage {
                    drop(g);
                    let e = ApiError::new(503, "server_error", "feed outage (fault)".into(), None);
                    return error_response(shared, w, &e, keep);
                }
                let core = &mut *g;
                let n = core.engines.len();
                match rank {
                    // Rank R's own feed, stamped with R.
                    Some(r) if (r as usize) < n => {
                        core.engines[r as usize].feed(&q).encode_for_rank(r)
                    }
                    Some(r) => {
                        drop(g);
                        let e = ApiError::bad(
                            "rank",
                            format!("no data-parallel rank {r} here ({n} rank(s))"),
                        );
                        return error_response(shared, w, &e, keep);
                    }
                    None if n == 1 => core.engines[0].feed(&q).encode(),
                    // A rank-blind poll of a DP endpoint: the union of its ranks' caches.
                    None => {
                        let mut engines: Vec<&mut Engine> = core.engines.iter_mut().collect();
                        core.union.answer(&mut engines, &q).encode()
                    }
                }
            };
            http::write_response(
                w,
                200,
                FEED_CONTENT_TYPE,
                &[(REPLICA_HEADER, &shared.name)],
                &body,
                keep,
            )
        }
        ("/health" | "/v1/models" | "/metrics" | FEED_PATH, _) => {
            error_response(shared, w, &method_err("GET"), keep)
        }
        _ => {
            let e = ApiError::new(
                404,
                "not_found_error",
                format!("no route for {} {}", req.method, req.path),
                None,
            );
            error_response(shared, w, &e, keep)
        }
    }
}

fn admin_fault(shared: &Shared, body: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("malformed JSON: {e}")))?;
    let Some(obj) = v.as_object() else {
        return Err(ApiError::bad("body", "expected a JSON object"));
    };
    let mut g = shared.lock();
    for (k, v) in obj {
        match k.as_str() {
            "restart" => match v.as_bool() {
                Some(true) => {
                    let now = shared.clock.now_us();
                    for e in g.engines.iter_mut() {
                        e.restart(now);
                    }
                }
                Some(false) => {}
                None => return Err(ApiError::bad("restart", "restart must be a boolean")),
            },
            "slowdown" => match v.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => {
                    for e in g.engines.iter_mut() {
                        e.set_slowdown(f);
                    }
                }
                _ => {
                    return Err(ApiError::bad(
                        "slowdown",
                        "slowdown must be a positive number",
                    ));
                }
            },
            "error_rate" => match v.as_f64() {
                Some(f) if (0.0..=1.0).contains(&f) => g.faults.error_rate = f,
                _ => {
                    return Err(ApiError::bad(
                        "error_rate",
                        "error_rate must be a number in [0, 1]",
                    ));
                }
            },
            "feed_outage" => match v.as_bool() {
                Some(b) => g.faults.feed_outage = b,
                None => {
                    return Err(ApiError::bad(
                        "feed_outage",
                        "feed_outage must be a boolean",
                    ));
                }
            },
            _ => {
                return Err(ApiError::bad(
                    "body",
                    format!(
                        "unknown fault {k:?}; known: restart, slowdown, error_rate, feed_outage"
                    ),
                ));
            }
        }
    }
    shared.cv.notify_all();
    Ok(
        json!({"epoch": g.engines[0].epoch(), "slowdown": g.engines[0].slowdown(),
        "error_rate": g.faults.error_rate, "feed_outage": g.faults.feed_outage}),
    )
}

/// The request body as a JSON object, or an OpenAI-style error.
fn body_object(body: &[u8]) -> Result<serde_json::Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("malformed JSON: {e}")))?;
    match v {
        Value::Object(o) => Ok(o),
        _ => Err(ApiError::bad(
            "body",
            "the request body must be a JSON object",
        )),
    }
}

/// The prompt's token ids as generation would compute them: `prompt` (completions) or `messages`
/// (chat, with the server's framing).
fn request_prompt(o: &serde_json::Map<String, Value>, api: Api) -> Result<Vec<u32>, ApiError> {
    match api {
        Api::Completions => completion_prompt(o.get("prompt")),
        Api::Chat => chat_prompt(o.get("messages")),
    }
}

/// `POST /tokenize`, as vLLM answers it: `{"prompt": ...}` or `{"messages": [...]}` to
/// `{"count", "max_model_len", "tokens", "token_strs"}`, with the ids generation would use.
fn tokenize_endpoint(shared: &Shared, body: &[u8]) -> Result<Value, ApiError> {
    let o = body_object(body)?;
    let api = if o.contains_key("messages") && !o.contains_key("prompt") {
        Api::Chat
    } else {
        Api::Completions
    };
    let ids = request_prompt(&o, api)?;
    let max_len = shared.lock().engines[0].config().max_model_len;
    Ok(json!({"count": ids.len(), "max_model_len": max_len, "tokens": ids, "token_strs": null}))
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
fn server_info(shared: &Shared) -> Value {
    let g = shared.lock();
    let cfg = g.engines[0].config();
    json!({"served_model_name": shared.model, "version": env!("CARGO_PKG_VERSION"),
        "dp_size": g.engines.len(), "max_running_requests": cfg.max_running,
        "max_prefill_tokens": cfg.max_batch_tokens,
        "max_total_tokens": cfg.kv_blocks as u64 * cfg.block_size as u64,
        "page_size": cfg.block_size, "context_length": cfg.max_model_len})
}

/// `GET /model_info` (and `/get_model_info`): a generation model without a tokenizer path.
fn model_info(shared: &Shared) -> Value {
    json!({"model_path": null, "tokenizer_path": null, "is_generation": true,
        "model_type": "kvsteer-sim", "architectures": ["KvsteerSim"],
        "served_model_name": shared.model})
}

/// `GET /get_load`, as SGLang answers it: one entry per data-parallel rank with the requests
/// running and waiting and the tokens held or queued ([`Engine::load_tokens`]).
fn get_load(shared: &Shared) -> Value {
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
    Value::Array(ranks)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

struct GenParams {
    model: String,
    prompt: Vec<u32>,
    max_tokens: Option<u32>,
    ignore_eos: bool,
    min_tokens: u32,
    stream: bool,
    return_token_ids: bool,
    /// `kv_transfer_params.do_remote_decode`: a P/D prefill leg (docs/pd.md); its answer carries
    /// `kv_transfer_params` for the decode leg.
    remote_decode: bool,
    /// `kv_transfer_params.do_remote_prefill`: a P/D decode leg; the prompt's KV is read over the
    /// modelled link ([`crate::Engine::submit_remote`]) instead of computed.
    remote_prefill: bool,
}

/// The P/D flags of a request's `kv_transfer_params` (absent or null: neither). vLLM takes any JSON
/// object there; a value that is not an object, or flags that are not booleans, are refused here.
fn kv_transfer_flags(o: &serde_json::Map<String, Value>) -> Result<(bool, bool), ApiError> {
    const K: &str = "kv_transfer_params";
    match o.get(K) {
        None | Some(Value::Null) => Ok((false, false)),
        Some(Value::Object(kv)) => {
            let flag = |k: &str| match kv.get(k) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(ApiError::bad(K, format!("{K}.{k} must be a boolean"))),
            };
            Ok((flag("do_remote_decode")?, flag("do_remote_prefill")?))
        }
        Some(_) => Err(ApiError::bad(K, format!("{K} must be an object"))),
    }
}

fn get_bool(o: &serde_json::Map<String, Value>, k: &'static str) -> Result<bool, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(k, format!("{k} must be a boolean"))),
    }
}

fn get_u32(o: &serde_json::Map<String, Value>, k: &'static str) -> Result<Option<u32>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| ApiError::bad(k, format!("{k} must be a non-negative integer"))),
    }
}

fn token_ids(a: &[Value]) -> Option<Vec<u32>> {
    a.iter()
        .map(|v| v.as_u64().filter(|&n| n < VOCAB as u64).map(|n| n as u32))
        .collect()
}

fn completion_prompt(v: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let bad = |m: &str| ApiError::bad("prompt", m.to_string());
    match v {
        None | Some(Value::Null) => Err(bad("prompt is required")),
        Some(Value::String(s)) => Ok(tokenize(s)),
        Some(Value::Array(a)) if a.is_empty() => Err(bad("prompt must not be empty")),
        Some(Value::Array(a)) if a[0].is_number() => {
            token_ids(a).ok_or_else(|| bad(&format!("token ids must be integers below {VOCAB}")))
        }
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(tokenize(s)),
            Value::Array(ids) => token_ids(ids)
                .ok_or_else(|| bad(&format!("token ids must be integers below {VOCAB}"))),
            _ => Err(bad(
                "prompt must be a string, a list of token ids, or a list of one of those",
            )),
        },
        Some(Value::Array(_)) => Err(bad(
            "batched prompts are not supported: send one prompt a request",
        )),
        Some(_) => Err(bad("prompt must be a string or a list of token ids")),
    }
}

/// Renders chat messages with a fixed template and tokenizes them with the stand-in.
fn chat_prompt(v: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let bad = |m: String| ApiError::bad("messages", m);
    let Some(Value::Array(msgs)) = v else {
        return Err(bad("messages must be a list of messages".into()));
    };
    if msgs.is_empty() {
        return Err(bad("messages must not be empty".into()));
    }
    let mut text = String::new();
    for (i, m) in msgs.iter().enumerate() {
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return Err(bad(format!("messages[{i}].role must be a string")));
        };
        text.push_str("<|start|>");
        text.push_str(role);
        text.push('\n');
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => text.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => {
                            return Err(bad(format!(
                                "messages[{i}].content parts must be text parts"
                            )));
                        }
                    }
                }
            }
            Some(_) => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of parts"
                )));
            }
        }
        text.push_str("<|end|>\n");
    }
    text.push_str("<|start|>assistant\n");
    Ok(tokenize(&text))
}

fn parse_params(body: &[u8], api: Api) -> Result<GenParams, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("malformed JSON: {e}")))?;
    let Some(o) = v.as_object() else {
        return Err(ApiError::bad(
            "body",
            "the request body must be a JSON object",
        ));
    };
    let model = match o.get("model") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad("model", "model must be a string")),
    };
    let prompt = match api {
        Api::Completions => completion_prompt(o.get("prompt"))?,
        Api::Chat => chat_prompt(o.get("messages"))?,
    };
    let mut max_tokens = get_u32(o, "max_tokens")?;
    if api == Api::Chat {
        max_tokens = get_u32(o, "max_completion_tokens")?.or(max_tokens);
    }
    if max_tokens == Some(0) {
        return Err(ApiError::bad("max_tokens", "max_tokens must be at least 1"));
    }
    let (remote_decode, remote_prefill) = kv_transfer_flags(o)?;
    Ok(GenParams {
        model,
        prompt,
        max_tokens,
        ignore_eos: get_bool(o, "ignore_eos")?,
        min_tokens: get_u32(o, "min_tokens")?.unwrap_or(0),
        stream: get_bool(o, "stream")?,
        return_token_ids: get_bool(o, "return_token_ids")?,
        remote_decode,
        remote_prefill,
    })
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt as u64 + completion as u64,
        "prompt_tokens_details": {"cached_tokens": cached}})
}

struct Done {
    prompt_tokens: u32,
    cached_tokens: u32,
    completion_tokens: u32,
    reason: FinishReason,
}

/// The header vLLM's OpenAI server reads to pin a request to a DP rank (lower-cased, as the HTTP
/// reader keeps names).
pub const RANK_HEADER: &str = kvsteer_core::dp::DEFAULT_RANK_HEADER;

fn submit(
    shared: &Shared,
    p: &GenParams,
    api: Api,
    rank_header: Option<&str>,
) -> Result<(u64, usize, Receiver<EngineEvent>), ApiError> {
    let mut g = shared.lock();
    let rate = g.faults.error_rate;
    if rate > 0.0 {
        g.fault_draws += 1;
        if unit(mix64(g.fault_draws ^ 0x0066_6175_6c74)) <= rate {
            return Err(ApiError::new(
                500,
                "server_error",
                "injected error (fault)".into(),
                None,
            ));
        }
    }
    let cfg = g.engines[0].config();
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
    let max_tokens = match (p.max_tokens, api) {
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
    };
    let id = g.next_id;
    let req = EngineRequest {
        id,
        prompt: p.prompt.clone(),
        max_tokens,
        ignore_eos: p.ignore_eos,
        min_tokens: p.min_tokens,
    };
    let now = shared.clock.now_us();
    // The header's rank when it is one of ours (vLLM ignores a value that is not an integer),
    // else vLLM's internal balancer.
    let n = g.engines.len();
    let named = rank_header
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&r| r < n);
    let rank = match named {
        Some(r) => r,
        None if n == 1 => 0,
        None => {
            let core = &mut *g;
            let engines = &core.engines;
            core.balancer.choose(now, |r| {
                let l = engines[r].load();
                (l.waiting, l.running)
            })
        }
    };
    let sent = if p.remote_prefill {
        g.engines[rank]
            .submit_remote(now, req, &crate::pd::KvLink::default())
            .map(|_| ())
    } else {
        g.engines[rank].submit(now, req)
    };
    sent.map_err(|e| ApiError::bad("prompt", e.to_string()))?;
    g.next_id += 1;
    let (tx, rx) = channel();
    g.subs.insert(id, tx);
    g.rank_of.insert(id, rank);
    shared.cv.notify_all();
    Ok((id, rank, rx))
}

/// How often a non-streamed request checks that its client is still there.
const CLIENT_CHECK: Duration = Duration::from_millis(250);

/// Whether the peer closed its side (a non-streamed client that gave up waiting).
fn client_gone(w: &TcpStream) -> bool {
    if w.set_nonblocking(true).is_err() {
        return false;
    }
    let mut b = [0u8; 1];
    let gone = match w.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != io::ErrorKind::WouldBlock,
    };
    let _ = w.set_nonblocking(false);
    gone
}

/// Aborts a request whose client left, at once (not at its next token: it may still be queued).
fn abandon(shared: &Shared, id: u64) {
    let mut g = shared.lock();
    if g.subs.remove(&id).is_some() {
        let now = shared.clock.now_us();
        let r = g.rank_of.remove(&id).unwrap_or(0);
        if let Some(e) = g.engines.get_mut(r) {
            e.abort(now, id);
        }
        shared.cv.notify_all();
    }
}

fn aborted_error() -> ApiError {
    ApiError::new(
        503,
        "server_error",
        "the request was aborted (engine restart)".into(),
        None,
    )
}

fn generate(shared: &Shared, req: &Request, api: Api, w: &mut TcpStream) -> io::Result<()> {
    let keep = req.keep_alive;
    let p = match parse_params(&req.body, api) {
        Ok(p) => p,
        Err(e) => return error_response(shared, w, &e, keep),
    };
    // The profile's request overhead (a real engine's API server), as latency before the engine
    // sees the request, in wall time at the replica's time scale.
    let overhead_us = shared.lock().engines[0]
        .config()
        .profile
        .request_overhead_us;
    if overhead_us > 0.0 {
        let wall = overhead_us / 1e6 / shared.clock.scale;
        thread::sleep(Duration::try_from_secs_f64(wall).unwrap_or(Duration::ZERO));
    }
    let (id, _rank, rx) = match submit(shared, &p, api, req.header(RANK_HEADER)) {
        Ok(x) => x,
        Err(e) => return error_response(shared, w, &e, keep),
    };
    let model = if p.model.is_empty() {
        shared.model.clone()
    } else {
        p.model.clone()
    };
    let created = unix_now();
    let (rid, object) = match api {
        Api::Completions => (format!("cmpl-{}-{id}", shared.name), "text_completion"),
        Api::Chat => (format!("chatcmpl-{}-{id}", shared.name), "chat.completion"),
    };
    if p.stream {
        let res = stream(shared, w, keep, api, &p, &rx, &rid, &model, created);
        if res.is_err() {
            abandon(shared, id);
        }
        return res;
    }
    let mut text = String::new();
    let mut ids = Vec::new();
    let mut last_check = Instant::now();
    let done = loop {
        if last_check.elapsed() >= CLIENT_CHECK {
            last_check = Instant::now();
            if client_gone(w) {
                abandon(shared, id);
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "client left",
                ));
            }
        }
        match rx.recv_timeout(CLIENT_CHECK) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(EngineEvent::FirstToken { token, .. } | EngineEvent::Token { token, .. }) => {
                token_text(token, &mut text);
                ids.push(token);
            }
            Ok(EngineEvent::Finished {
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
            Err(RecvTimeoutError::Disconnected) => {
                return error_response(shared, w, &aborted_error(), false);
            }
        }
    };
    if done.reason == FinishReason::Abort {
        return error_response(shared, w, &aborted_error(), keep);
    }
    let mut choice = match api {
        Api::Completions => json!({"index": 0, "text": text, "logprobs": null,
            "finish_reason": done.reason.as_str()}),
        Api::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
            "logprobs": null, "finish_reason": done.reason.as_str()}),
    };
    if p.return_token_ids {
        choice["token_ids"] = json!(ids);
        choice["prompt_token_ids"] = json!(p.prompt);
    }
    let mut v = json!({"id": rid, "object": object, "created": created, "model": model,
        "choices": [choice],
        "usage": usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)});
    if p.remote_decode && done.reason == FinishReason::Length {
        v["kv_transfer_params"] = prefill_answer(shared, &rid, &p.prompt);
    }
    json_response(shared, w, &v, keep)
}

/// The `kv_transfer_params` a prefill leg answers with, in the NIXL producer's shape (docs/pd.md).
/// The simulator moves no real KV: the block ids are stand-ins (one per full prompt block), the side
/// channel host and port are null, and the decode leg only reads the `do_remote_prefill` flag.
fn prefill_answer(shared: &Shared, rid: &str, prompt: &[u32]) -> Value {
    let bs = shared.lock().engines[0].config().block_size.max(1);
    let blocks: Vec<usize> = (0..prompt.len() / bs).collect();
    json!({"do_remote_prefill": true, "do_remote_decode": false,
        "remote_block_ids": blocks, "remote_engine_id": shared.name,
        "remote_request_id": rid, "remote_host": null, "remote_port": null, "tp_size": 1})
}

fn sse(v: &Value) -> Vec<u8> {
    format!("data: {v}\n\n").into_bytes()
}

#[allow(clippy::too_many_arguments)]
fn stream(
    shared: &Shared,
    w: &mut TcpStream,
    keep: bool,
    api: Api,
    p: &GenParams,
    rx: &Receiver<EngineEvent>,
    rid: &str,
    model: &str,
    created: u64,
) -> io::Result<()> {
    let object = match api {
        Api::Completions => "text_completion",
        Api::Chat => "chat.completion.chunk",
    };
    let chunk = |choice: Value| {
        json!({"id": rid, "object": object, "created": created, "model": model,
            "choices": [choice]})
    };
    let mut out = Chunked::start(
        w,
        "text/event-stream",
        &[(REPLICA_HEADER, &shared.name)],
        keep,
    )?;
    if api == Api::Chat {
        out.send(&sse(&chunk(
            json!({"index": 0, "delta": {"role": "assistant", "content": ""},
            "logprobs": null, "finish_reason": null}),
        )))?;
    }
    let mut piece = String::new();
    loop {
        let ev = match rx.recv_timeout(CLIENT_CHECK) {
            Ok(ev) => ev,
            // Queued with nothing to send yet: make sure someone is still waiting.
            Err(RecvTimeoutError::Timeout) => {
                if client_gone(out.stream()) {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "client left",
                    ));
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => {
                out.send(&sse(
                    &json!({"error": {"message": "the request was aborted",
                    "type": "server_error", "code": 503}}),
                ))?;
                out.send(b"data: [DONE]\n\n")?;
                return out.finish();
            }
        };
        match ev {
            EngineEvent::FirstToken { token, .. } | EngineEvent::Token { token, .. } => {
                piece.clear();
                token_text(token, &mut piece);
                let mut choice = match api {
                    Api::Completions => json!({"index": 0, "text": piece, "logprobs": null,
                        "finish_reason": null}),
                    Api::Chat => json!({"index": 0, "delta": {"content": piece},
                        "logprobs": null, "finish_reason": null}),
                };
                if p.return_token_ids {
                    choice["token_ids"] = json!([token]);
                }
                out.send(&sse(&chunk(choice)))?;
            }
            EngineEvent::Finished {
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                ..
            } => {
                if reason == FinishReason::Abort {
                    let e = aborted_error();
                    out.send(&sse(
                        &json!({"error": {"message": e.message, "type": e.kind,
                        "code": e.status}}),
                    ))?;
                } else {
                    let choice = match api {
                        Api::Completions => json!({"index": 0, "text": "", "logprobs": null,
                            "finish_reason": reason.as_str()}),
                        Api::Chat => json!({"index": 0, "delta": {}, "logprobs": null,
                            "finish_reason": reason.as_str()}),
                    };
                    out.send(&sse(&chunk(choice)))?;
                    // vLLM sends usage in a last chunk with no choices when
                    // stream_options.include_usage is set; it is always sent here.
                    let u = json!({"id": rid, "object": object, "created": created,
                        "model": model, "choices": [],
                        "usage": usage(prompt_tokens, completion_tokens, cached_tokens)});
                    out.send(&sse(&u))?;
                }
                out.send(b"data: [DONE]\n\n")?;
                return out.finish();
            }
        }
    }
}

/// Starts `n` replicas named `<prefix><i>` on consecutive ports from `base.port` (0: any free ports).
pub fn start_replicas(base: &ReplicaConfig, n: usize, prefix: &str) -> io::Result<Vec<Replica>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut cfg = base.clone();
        cfg.name = format!("{prefix}{i}");
        cfg.port = if base.port == 0 {
            0
        } else {
            base.port
                .checked_add(i as u16)
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "port overflow"))?
        };
        cfg.engine.seed = mix64(base.engine.seed ^ i as u64);
        if cfg.engine.epoch == 0 {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            cfg.engine.epoch = mix64(nanos ^ (i as u64).rotate_left(40)) | 1;
        }
        out.push(Replica::start(cfg)?);
    }
    Ok(out)
}
