//! A stream context: one request, from its headers (client copies of the routing headers removed),
//! through its body (read as it arrives, then routed), to its response (followed to the last token,
//! its outcome reported for the replica's health) and the release of its load. The P/D leg is in
//! `prefill.rs`; the headers a client must not set in `stream/client_headers.rs`, the body while
//! it is held in `stream/body.rs`, the outcome for the replica's health in `stream/outcome.rs`.

use super::clock::now_ms;
use super::metrics::inc;
use super::prefill::{PrefillLeg, prefill_id};
use super::store::host_store;
use super::vm::{Pool, Shared, header, log};
use crate::config::OutputMode;
use crate::config::PoolChoice;
use crate::host::abi;
use crate::sse::SseTracker;
use crate::worker::{BodyFallback, DecisionOutput, Origin, answer_outcome, is_inference_path};
use kvsteer_core::admission::{Class, Shed};
use kvsteer_core::health::Outcome;
use kvsteer_core::request::{EarlyScan, ModelField};
use kvsteer_core::router::Decision;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, LogLevel, MapType};

mod body;
mod client_headers;
mod outcome;

/// Where a stream is in its life, as far as the router's load table is concerned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Phase {
    /// Not an inference request, or not routed yet.
    #[default]
    Untracked,
    /// Waiting for the whole body.
    Buffering,
    /// P/D: both legs booked, the prefill leg's callout in flight, the request held.
    Prefilling,
    /// Admitted: its load is on the chosen replica.
    Admitted,
    /// First token seen: prefill load moved to decode.
    Decoding,
    /// Released: nothing more to do.
    Released,
}

#[derive(Default)]
pub struct Stream {
    pub(super) vm: Option<Shared>,
    pub(super) id: u64,
    pub(super) phase: Phase,
    pub(super) path: String,
    pub(super) session: Option<String>,
    sse: Option<SseTracker>,
    /// The replica the filter chose for this request.
    pub(super) replica: Option<usize>,
    /// The request's outcome was reported for its replica's health, or settled as counting for
    /// nothing (at most once).
    outcome_reported: bool,
    /// Who produced the response (read with its headers); `None` before them.
    origin: Option<Origin>,
    /// The body was over `max_body_bytes` and routed unread: its failures count against no replica
    /// (`worker::answer_outcome`).
    oversized: bool,
    /// The request body's size as buffered: what a rewrite of it replaces.
    pub(super) body_len: usize,
    /// P/D: the prefill leg in flight (phase `Prefilling`).
    pub(super) prefill: Option<PrefillLeg>,
    /// The part of the request body the early scan has not read yet (from offset `base` to
    /// `seen`), read slice by slice while it is buffered (docs/design/filter.md, "The body as it
    /// arrives"): what the scan has read is dropped, so a stream holds about one slice, not a copy
    /// of its body. Empty when the body is read only at the end.
    arrived: Vec<u8>,
    /// The body offset of `arrived[0]`.
    base: usize,
    /// Bytes of the body read so far as it arrived (`base + arrived.len()`).
    seen: usize,
    /// The early scan over `arrived`; None when the body is read only once it has all arrived
    /// (`early_body_scan` false, a P/D fleet, the VM's share for held bodies spent, or the host
    /// handed over something inconsistent).
    early: Option<EarlyScan>,
    /// The capacity of `arrived` counted in the VM's `early_held`.
    held: usize,
    /// The bytes of this body the proxy buffers while the filter holds it, counted in the VM's
    /// `body_held` (`body_hold_max_bytes`): what has arrived, or its declared length if more.
    hold: usize,
    /// The body's `content-length` (up to `routing.max_body_bytes`), 0 when not declared: counted
    /// in `hold` from the headers on, so a declared body is refused its hold before it arrives.
    declared: usize,
    /// The decision explained for the configured `explain_header`, written on the response.
    explain: Option<String>,
    /// The class the trusted priority header names (`routing.admission`); `None` without one.
    header_class: Option<Class>,
    /// The pool this request is routed in (`pools`; 0, the only one, without): until its body's
    /// `model` is read, the pool of the model header, else the default pool, else the first.
    pub(super) pool: usize,
    /// Whether `pool` was chosen by the request (its model header or body) or the default pool,
    /// rather than taken as the first for want of either.
    pool_known: bool,
}

impl Stream {
    pub(super) fn new(vm: Option<Shared>, context_id: u32) -> Stream {
        Stream {
            vm,
            id: context_id as u64,
            ..Stream::default()
        }
    }

    /// Writes the decision where the proxy will read it.
    pub(super) fn write_destination(vm: &Pool, d: &Decision) {
        match vm.state.decision_output(d) {
            DecisionOutput::Header {
                name,
                value,
                clear_route_cache,
            } => {
                let _ = abi::set_header(MapType::HttpRequestHeaders, name, value.as_bytes());
                if let Some(rank) = vm.state.rank_value(d) {
                    // A DP rank of a multi-rank endpoint: the engine's API server reads the rank
                    // from this header (vLLM: `X-data-parallel-rank`).
                    let _ = abi::set_header(
                        MapType::HttpRequestHeaders,
                        vm.state.rank_header(),
                        rank.as_bytes(),
                    );
                }
                if clear_route_cache {
                    // The route was chosen before the header existed: make Envoy choose again.
                    let _ = abi::call_foreign_function("clear_route_cache");
                }
            }
            DecisionOutput::NginxVariable { name, value } => {
                let _ = abi::set_property(&["ngx", name], value.as_bytes());
                if let Some(rank) = vm.state.rank_value(d) {
                    let _ = abi::set_header(
                        MapType::HttpRequestHeaders,
                        vm.state.rank_header(),
                        rank.as_bytes(),
                    );
                }
            }
        }
    }

    /// Routes by load alone (the body unread); `Pause` when the request was shed and answered.
    /// With `pools` an unread body has no model: it goes to the model header's pool, else the
    /// default pool, else it is refused (413 for a body over the limit, 400 otherwise).
    fn route_fallback(&mut self, why: BodyFallback, body_bytes: usize) -> Action {
        self.return_hold();
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let mut vm = vm.borrow_mut();
        if vm.gateway.pooled() && !self.pool_known {
            let limit = vm.pools[self.pool].state.max_body_bytes();
            inc(vm.models_missing, 1);
            drop(vm);
            return if why == BodyFallback::TooLarge {
                self.refuse(
                    413,
                    "invalid_request_error",
                    &format!(
                        "kvsteer: the request body is over routing.max_body_bytes ({limit}), so its \
                         model cannot be read, and no model header or default pool names its pool"
                    ),
                )
            } else {
                self.refuse(
                    400,
                    "invalid_request_error",
                    "kvsteer: the request body could not be read for its model, and no model \
                     header or default pool names its pool",
                )
            };
        }
        let pool = &mut vm.pools[self.pool];
        let routed = pool.state.route_fallback_admitted(
            self.id,
            why,
            body_bytes,
            self.header_class,
            now_ms(),
        );
        let d = match routed {
            Ok(d) => d,
            Err(shed) => {
                drop(vm);
                return self.shed(&shed);
            }
        };
        pool.metrics.decision(&d);
        Self::write_destination(pool, &d);
        self.replica = Some(d.replica);
        self.oversized = why == BodyFallback::TooLarge;
        self.phase = Phase::Admitted;
        Action::Continue
    }

    /// With `pools`, the pool of a body's `model`: `Err` with the stream answered (404 for a model
    /// no pool serves, 400 for none without a default pool) or let through unrouted (its pool has
    /// no member yet). A body whose `model` cannot be found keeps the header's or default pool;
    /// without `pools`, always the one pool.
    fn choose_pool(&mut self, body: &[u8]) -> Result<(), Action> {
        let Some(vm) = self.vm.clone() else {
            return Ok(());
        };
        let vm = vm.borrow();
        if !vm.gateway.pooled() {
            return Ok(());
        }
        let field = kvsteer_core::request::model_of(body);
        let choice = match &field {
            ModelField::Named(m) => vm.gateway.choose(Some(m)),
            ModelField::Absent => vm.gateway.choose(None),
            ModelField::Unreadable if self.pool_known => PoolChoice::Pool(self.pool),
            ModelField::Unreadable => vm.gateway.choose(None),
        };
        match choice {
            PoolChoice::Pool(p) => {
                self.pool = p;
                self.pool_known = true;
                if !vm.pools[p].state.has_members() {
                    // Discovery has seated nobody in this pool yet: the proxy's own balancing
                    // takes the request, nothing booked.
                    drop(vm);
                    self.phase = Phase::Released;
                    self.return_hold();
                    return Err(Action::Continue);
                }
                Ok(())
            }
            PoolChoice::Unknown => {
                inc(vm.models_unknown, 1);
                let model = match &field {
                    ModelField::Named(m) => m.chars().take(256).collect::<String>(),
                    _ => String::new(),
                };
                drop(vm);
                let err = serde_json::to_vec(&serde_json::json!({"error": {
                    "message": format!("The model `{model}` does not exist."),
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": "model_not_found",
                }}))
                .unwrap_or_default();
                self.phase = Phase::Released;
                self.return_hold();
                Self::send_error(404, &err);
                Err(Action::Pause)
            }
            PoolChoice::Missing => {
                inc(vm.models_missing, 1);
                drop(vm);
                Err(self.refuse(
                    400,
                    "invalid_request_error",
                    "kvsteer: the request names no model, and this gateway has no default pool",
                ))
            }
        }
    }

    /// Answers a request shed at saturation (`routing.admission`): 429 with `Retry-After` and an
    /// OpenAI-style error body. Nothing was booked for it.
    fn shed(&mut self, shed: &Shed) -> Action {
        self.phase = Phase::Released;
        let retry = shed.retry_after_s.to_string();
        let headers = [
            ("content-type", "application/json"),
            ("retry-after", retry.as_str()),
        ];
        if abi::send_local_response(429, &headers, &shed.body()).is_err() {
            // The stream stays paused: a shed request must not go upstream unbooked.
            log(
                LogLevel::Warn,
                "kvsteer: the proxy refused a local response to a shed request",
            );
        }
        Action::Pause
    }

    /// In a P/D fleet a body the filter could not read is refused, not forwarded: only the filter may
    /// set `kv_transfer_params` there (they name the host a decode engine pulls KV from), and an
    /// unread body may carry a client's own. `status`: 413 for a body over `max_body_bytes`, 500 when
    /// the proxy would not hand the body over. Nothing is booked.
    fn refuse_unread_pd(&mut self, status: u32, why: &str) -> Action {
        log(
            LogLevel::Warn,
            &format!("kvsteer: P/D request refused: {why}"),
        );
        let kind = if status == 413 {
            "invalid_request_error"
        } else {
            "internal_error"
        };
        self.refuse(
            status,
            kind,
            &format!(
                "kvsteer: {why}; a prefill/decode fleet forwards only request bodies it has checked"
            ),
        )
    }

    /// Answers the client itself with an OpenAI-style error (`kind`: its `type`) and ends this
    /// stream's part in routing; nothing is booked for it.
    fn refuse(&mut self, status: u32, kind: &str, message: &str) -> Action {
        let err = serde_json::to_vec(&serde_json::json!({"error": {
            "message": message, "type": kind, "code": status,
        }}))
        .unwrap_or_default();
        self.phase = Phase::Released;
        self.return_hold();
        Self::send_error(status, &err);
        Action::Pause
    }

    /// Reads the whole buffered request body (at most `max` bytes asked for), routes the request by
    /// it and admits it; every way the body cannot be read is routed by load instead (refused in a
    /// P/D fleet, [`Stream::refuse_unread_pd`]). In a P/D fleet
    /// the request is split into its two legs ([`Stream::route_pd`]) and may be held (`Pause`).
    fn route_buffered(&mut self, max: usize) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let limit = vm.borrow().pools[self.pool].state.max_body_bytes();
        let pd = vm.borrow().pools[self.pool].state.disaggregated();
        let body = match self.take_body(max) {
            Ok(b) => b,
            Err(_) if pd => {
                return self.refuse_unread_pd(500, "the proxy did not hand over the request body");
            }
            Err(_) => return self.route_fallback(BodyFallback::HostError, max.min(limit)),
        };
        if body.is_empty() {
            return self.route_fallback(BodyFallback::Empty, 0);
        }
        if body.len() > limit {
            if pd {
                return self.refuse_unread_pd(
                    413,
                    &format!("the request body is over routing.max_body_bytes ({limit})"),
                );
            }
            return self.route_fallback(BodyFallback::TooLarge, body.len());
        }
        self.body_len = body.len();
        if let Err(action) = self.choose_pool(&body) {
            return action;
        }
        if vm.borrow().pools[self.pool].state.disaggregated() {
            return self.route_pd(&body);
        }
        let mut vm = vm.borrow_mut();
        let named = vm.gateway.pooled();
        let pool = &mut vm.pools[self.pool];
        let now = now_ms();
        let store = pool.state.shared(host_store(pool.state.config()));
        pool.state.claim_probe(store, now);
        if self.early.as_ref().is_some_and(|s| s.tokens() > 0) {
            inc(pool.metrics.early_bodies, 1);
        }
        let routed = pool.state.route_body_admitted(
            self.id,
            &self.path,
            &body,
            self.session.as_deref(),
            self.early.take(),
            self.header_class,
            now,
        );
        let d = match routed {
            Ok(d) => d,
            Err(shed) => {
                drop(vm);
                return self.shed(&shed);
            }
        };
        pool.metrics.decision(&d);
        Self::write_destination(pool, &d);
        self.explain = pool.state.explanation(d.replica).map(|e| match &pool.name {
            Some(name) if named => format!("pool={name}; {e}"),
            _ => e,
        });
        self.replica = Some(d.replica);
        self.phase = Phase::Admitted;
        Action::Continue
    }

    /// With `pools`, the pool a request heads for before its body is read: the one serving the
    /// model the operator's header names (`model_header`), else the default pool. The body's
    /// `model` wins over both ([`Stream::choose_pool`]), so a client that forges the header moves
    /// only its own unreadable body.
    fn pool_from_header(&mut self, vm: &Shared) {
        let vm = vm.borrow();
        if !vm.gateway.pooled() {
            return;
        }
        let named = vm
            .gateway
            .model_header
            .as_deref()
            .and_then(|h| header(MapType::HttpRequestHeaders, h))
            .filter(|v| v.len() <= 256)
            .and_then(|v| String::from_utf8(v).ok());
        let choice = named.map(|m| vm.gateway.choose(Some(&m)));
        let pool = match choice {
            Some(PoolChoice::Pool(p)) => Some(p),
            _ => vm.gateway.default_pool,
        };
        if let Some(p) = pool {
            self.pool = p;
            self.pool_known = true;
        }
    }

    /// Answers a request for the reserved peer path itself ([`crate::worker::exchange`]): served to a peer
    /// proxy with the token, refused otherwise, never forwarded.
    fn serve_peer(&mut self, vm: &Shared, method: &[u8], path: &[u8]) -> Action {
        let mut vm = vm.borrow_mut();
        let token = header(
            MapType::HttpRequestHeaders,
            vm.pools[self.pool].state.peer_token_header(),
        );
        let store = host_store(vm.pools[self.pool].state.config());
        let r =
            vm.pools[self.pool]
                .state
                .serve_peer(store, method, path, token.as_deref(), now_ms());
        self.phase = Phase::Released;
        let ct = if r.status == 200 {
            crate::worker::exchange::BUNDLE_CONTENT_TYPE
        } else {
            "text/plain"
        };
        if abi::send_local_response(r.status, &[("content-type", ct)], &r.body).is_err() {
            // The stream stays paused: it must not go upstream either way.
            log(
                LogLevel::Warn,
                "kvsteer: the proxy refused a local response to a peer poll",
            );
        }
        Action::Pause
    }

    /// Answers the client with a JSON error in place of the upstream.
    pub(super) fn send_error(status: u32, body: &[u8]) {
        if abi::send_local_response(status, &[("content-type", "application/json")], body).is_err()
        {
            log(
                LogLevel::Warn,
                "kvsteer: the proxy refused a local response",
            );
        }
    }

    fn release(&mut self) {
        if matches!(
            self.phase,
            Phase::Admitted | Phase::Decoding | Phase::Prefilling
        ) && let Some(vm) = &self.vm
        {
            let mut vm = vm.borrow_mut();
            vm.pools[self.pool].state.release(self.id);
            if self.phase == Phase::Prefilling {
                // The client left while the prefill leg was out: its answer will find no stream.
                vm.pools[self.pool].state.release(prefill_id(self.id));
                self.prefill = None;
            }
        }
        if self.phase != Phase::Untracked {
            self.phase = Phase::Released;
        }
    }
}

impl Context for Stream {
    fn on_done(&mut self) -> bool {
        self.release();
        // A stream that ends before its body has (a client gone mid-upload) gives back its shares.
        self.drop_arrived();
        self.return_hold();
        true
    }

    /// Only a P/D prefill leg's answer comes here; one for a stream no longer waiting for it (or with
    /// another token) is ignored.
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if self.phase != Phase::Prefilling {
            return;
        }
        match self.prefill.take() {
            Some(leg) if leg.token == token => self.on_prefill_answer(leg, num_headers, body_size),
            other => self.prefill = other,
        }
    }
}

impl HttpContext for Stream {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        if let Err(action) = self.remove_client_routing_headers(&vm) {
            return action;
        }
        let method = header(MapType::HttpRequestHeaders, ":method").unwrap_or_default();
        let path = header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        if vm.borrow().pools[self.pool].state.is_peer_path(&path) {
            return self.serve_peer(&vm, &method, &path);
        }
        if method != b"POST" || !is_inference_path(&path) {
            return Action::Continue;
        }
        self.pool_from_header(&vm);
        if !vm.borrow().pools.iter().any(|p| p.state.has_members()) {
            // Discovery has seated nobody yet (and no static replica): the proxy's own balancing
            // takes the request; nothing is booked against an empty slot.
            return Action::Continue;
        }
        self.path = String::from_utf8_lossy(&path).into_owned();
        self.session = header(
            MapType::HttpRequestHeaders,
            vm.borrow().pools[self.pool].state.session_header(),
        )
        .filter(|v| !v.is_empty() && v.len() <= 512)
        .map(|v| String::from_utf8_lossy(&v).into_owned());
        if end_of_stream {
            return self.route_fallback(BodyFallback::Empty, 0);
        }
        self.phase = Phase::Buffering;
        // A declared length counts from now on (the hostile value bounded by the body limit, past
        // which the body is not held anyway): a stream the bound cannot take is routed before the
        // proxy buffers any of it.
        let limit = vm.borrow().pools[self.pool].state.max_body_bytes();
        self.declared = header(MapType::HttpRequestHeaders, "content-length")
            .filter(|v| v.len() <= 20)
            .and_then(|v| std::str::from_utf8(&v).ok()?.trim().parse::<u64>().ok())
            .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX).min(limit));
        if !self.count_hold(0) {
            return self.route_over_hold(self.declared);
        }
        self.early = vm.borrow().pools[self.pool].state.early_scan(&self.path);
        if vm.borrow().pools[self.pool].state.config().output == OutputMode::NginxVariable {
            // ngx_wasm_module calls this in nginx's rewrite phase, always without end of stream,
            // and parks a paused request there until something resumes it; it reads the body only
            // later, in the content phase, and hands it over whole, with end of stream, before
            // `proxy_pass` reads the variable. A pause here would hold every request for good.
            return Action::Continue;
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.phase != Phase::Buffering {
            return Action::Continue;
        }
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let limit = vm.borrow().pools[self.pool].state.max_body_bytes();
        if body_size > limit {
            if vm.borrow().pools[self.pool].state.disaggregated() {
                return self.refuse_unread_pd(
                    413,
                    &format!("the request body is over routing.max_body_bytes ({limit})"),
                );
            }
            // Stop buffering a body we will not read; route it by load and let it flow.
            self.drop_arrived();
            return self.route_fallback(BodyFallback::TooLarge, body_size);
        }
        if !end_of_stream {
            // The rest of the body, or trailers (HTTP/2, gRPC-style clients), end the request.
            if !self.count_hold(body_size) {
                return self.route_over_hold(body_size);
            }
            self.read_arrived(body_size);
            return Action::Pause;
        }
        self.route_buffered(body_size)
    }

    /// A request that ends with trailers: end of stream arrives here, not on the body, and the whole
    /// body is buffered (Envoy hands the buffered body to `get_buffer` during this callback). Routed
    /// exactly as if the last body chunk had carried end of stream.
    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        if self.phase != Phase::Buffering {
            return Action::Continue;
        }
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        // Ask for one byte past the limit: a body over it is routed by load without being copied.
        let limit = vm.borrow().pools[self.pool].state.max_body_bytes();
        self.route_buffered(limit.saturating_add(1))
    }
    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if let (Some(text), Some(vm)) = (self.explain.take(), self.vm.as_ref())
            && let Some(name) = vm.borrow().pools[self.pool]
                .state
                .config()
                .explain_header
                .clone()
        {
            let _ = abi::set_header(MapType::HttpResponseHeaders, &name, text.as_bytes());
        }
        if !matches!(self.phase, Phase::Admitted | Phase::Decoding) {
            return Action::Continue;
        }
        let status = header(MapType::HttpResponseHeaders, ":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok())
            .unwrap_or(0);
        let origin = self.answer_origin();
        self.origin = Some(origin);
        let judged = answer_outcome(status, origin, self.oversized);
        let failed = status >= 500 || origin == Origin::ReplicaFailed;
        match judged {
            // The replica failed it (its own 5xx, or the proxy's answer for an attempt it failed).
            Some(Outcome::Failure) => self.report_outcome(Outcome::Failure),
            // Success is only known at the end of the answer.
            Some(Outcome::Success) => {}
            // The proxy's own answer, a 4xx, or an oversized body's failure: no replica's doing.
            None => self.settle_unblamed(failed),
        }
        if !(200..300).contains(&status) || end_of_stream {
            if judged == Some(Outcome::Success) {
                self.report_outcome(Outcome::Success);
            }
            // An upstream error (or an empty answer) ends the request's load now.
            self.release();
            return Action::Continue;
        }
        let is_sse = header(MapType::HttpResponseHeaders, "content-type").is_some_and(|v| {
            v.windows(17)
                .any(|w| w.eq_ignore_ascii_case(b"text/event-stream"))
        });
        if is_sse {
            self.sse = Some(SseTracker::new());
        } else {
            // A whole (non-streamed) answer: the engine finished before the headers went out.
            self.report_outcome(Outcome::Success);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !matches!(self.phase, Phase::Admitted | Phase::Decoding) {
            return Action::Continue;
        }
        let mut engine_error = false;
        if let (Some(tracker), Some(vm)) = (self.sse.as_mut(), self.vm.as_ref())
            && body_size > 0
        {
            // A chunk the proxy will not hand over is followed as empty: its tokens are missed.
            let chunk = abi::get_buffer(BufferType::HttpResponseBody, 0, body_size)
                .ok()
                .flatten()
                .unwrap_or_default();
            let p = tracker.push(&chunk);
            engine_error = p.error;
            if p.tokens > 0 {
                let mut vm = vm.borrow_mut();
                if self.phase == Phase::Admitted {
                    vm.pools[self.pool].state.first_token(self.id, now_ms());
                    self.phase = Phase::Decoding;
                }
                vm.pools[self.pool]
                    .state
                    .decode_progress(self.id, tracker.generated());
            }
        }
        if engine_error {
            // An engine error inside a 200 stream (vLLM's `data: {"error": ...}`), counted when the
            // stream is the replica's own and its failures count (as for a 5xx).
            match self.origin.map(|o| answer_outcome(500, o, self.oversized)) {
                Some(Some(Outcome::Failure)) => self.report_outcome(Outcome::Failure),
                _ => self.settle_unblamed(true),
            }
        }
        if end_of_stream {
            if self.sse.is_some() {
                // The stream ran to its end without an engine error (else already reported).
                self.report_outcome(Outcome::Success);
            }
            self.release();
        }
        Action::Continue
    }
}
