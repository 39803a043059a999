//! A prefill/decode (P/D) fleet in virtual time (docs/design/pd.md): prefill-role and decode-role
//! simulated engines in front of the **compiled filter**, which carries out vLLM's two-leg protocol
//! for each request: the same `.wasm`, host and engines as the wasm harness, each engine's feed
//! polled by the filter on its own timer and answered from the engine.
//!
//! Per request: the filter reads the client's request (a streamed completion), picks a prefill
//! replica and a decode replica, books both legs and sends the prefill leg as a callout; the host
//! runs it on the prefill engine it names as a 1-token request (vLLM's `max_tokens: 1` with
//! `do_remote_decode`) and, when it finishes, answers the callout with `kv_transfer_params` in the NIXL
//! producer's shape. The filter then releases the client's request to the decode replica its
//! destination header names, which the host submits to that engine with remote KV
//! ([`kvsteer_sim::Engine::submit_remote`]: the prompt not cached there is read over the link, then
//! the last token is computed); the decode engine's tokens stream back through the filter (SSE, one
//! chunk per step) and end it. TTFT is measured from issue to the decode engine's first token, so it
//! holds the prefill queue and compute, the transfer and the decode engine's first step. The prefill
//! leg's token is discarded, as vLLM's proxies do. Callouts are answered with no network latency.

use crate::openai::{SseWriter, completion_body, request_headers, sse_headers};
use crate::outcome::Outcome;
use crate::{
    CallOutcome, Callout, FilterModule, HarnessStats, HostError, HostMode, Proxy, ProxyOptions,
    WorkerVm,
};
use kvsteer_core::disaggregation::{PdParams, Role};
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FeedQuery};
use kvsteer_sim::kv_link::KvLink;
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest, FinishReason};
use kvsteer_workload::{Driver, Issue, Mode, Recorder, Workload};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// The destination header the filter writes (its default).
const DESTINATION: &str = "x-gateway-destination-endpoint";

/// A P/D fleet replay's settings.
#[derive(Clone, Debug)]
pub struct PdConfig {
    /// Prefill-role engines (indices `0..prefill`), then decode-role ones.
    pub prefill: usize,
    pub decode: usize,
    /// The template every engine is built from (`EngineConfig::for_replica`).
    pub engine: EngineConfig,
    /// The router's configuration (`policy`: `round_robin` gives round robin on each side, any
    /// other the P/D scores).
    pub routing: serde_json::Value,
    pub params: PdParams,
    pub link: KvLink,
    /// How often each engine's feed is polled into the router (the filter's default 200 ms).
    pub feed_period_us: u64,
    /// Decode-block sampling period (the herding plots).
    pub sample_us: u64,
}

impl PdConfig {
    pub fn new(
        prefill: usize,
        decode: usize,
        engine: EngineConfig,
        routing: serde_json::Value,
    ) -> Self {
        PdConfig {
            prefill,
            decode,
            engine,
            routing,
            params: PdParams::default(),
            link: KvLink::default(),
            feed_period_us: 200_000,
            sample_us: 500_000,
        }
    }

    pub fn roles(&self) -> Vec<Role> {
        (0..self.prefill + self.decode)
            .map(|i| {
                if i < self.prefill {
                    Role::Prefill
                } else {
                    Role::Decode
                }
            })
            .collect()
    }
}

/// Counters of a P/D replay beside the recorder's figures.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PdStats {
    pub requests: u64,
    pub failed: u64,
    /// Prompt tokens read over the link by decode engines, and the prompt tokens of the decode legs.
    pub transferred_tokens: u64,
    pub decode_prompt_tokens: u64,
    /// Decode legs whose decode engine held part of the prompt already.
    pub decode_local_hits: u64,
    /// Prompt tokens the router's index said the chosen prefill replicas held (from the feeds).
    pub prefill_matched_tokens: u64,
}

struct Flight {
    /// The filter's stream of this request.
    stream: u32,
    prompt: Arc<[u32]>,
    max_tokens: u32,
    /// The prefill callout, until the prefill engine has answered it.
    call: Option<Callout>,
    decode: usize,
    /// The prefill leg's cached prompt tokens (the hit rate reported is the prefill side's).
    prefill_cached: u64,
    output: Vec<u32>,
    /// Tokens generated since the last response chunk handed to the filter.
    pending: Vec<u32>,
    sse: SseWriter,
    headers_sent: bool,
}

/// The prefill replica of replica `r` is named by its cluster; its endpoint is `127.0.0.1:18000+r`.
fn endpoint(r: usize) -> String {
    format!("127.0.0.1:{}", 18000 + r)
}

fn replica_of_destination(dest: &str) -> Option<usize> {
    let first = dest.split(',').next()?;
    let port: usize = first.rsplit(':').next()?.parse().ok()?;
    port.checked_sub(18000)
}

/// The filter's plugin configuration for a P/D fleet: prefill replicas `r0..`, then decode ones,
/// one prefill cluster per prefill replica, the fleet's routing and P/D coefficients.
pub fn plugin_config(cfg: &PdConfig) -> Value {
    let replicas: Vec<Value> = cfg
        .roles()
        .iter()
        .enumerate()
        .map(|(i, role)| {
            let mut r = json!({"name": format!("r{i}"), "endpoint": endpoint(i),
                "feed_cluster": format!("kvsteer_feed_r{i}"), "feed_authority": endpoint(i)});
            if *role == Role::Prefill {
                r["role"] = json!("prefill");
                r["prefill_cluster"] = json!(format!("prefill_r{i}"));
            } else {
                r["role"] = json!("decode");
            }
            r
        })
        .collect();
    let p = &cfg.params;
    json!({"replicas": replicas, "routing": cfg.routing,
        "feed_period_ms": (cfg.feed_period_us / 1000).max(TICK_MS), "tick_ms": TICK_MS,
        "pd": {"prefill_queue_weight": p.prefill_queue_weight,
            "transfer_weight": p.transfer_weight,
            "active_request_weight": p.active_request_weight,
            "max_prefill_response_bytes": 64 << 20}})
}

/// The filter's timer period in the replay (its default).
const TICK_MS: u64 = 100;

/// The prefill engine's answer, in the NIXL producer's shape (the simulator's server answers the
/// same): the prompt's block ids stand in for the KV's location.
fn prefill_answer(id: u64, replica: usize, prompt_len: usize, block_size: usize) -> Vec<u8> {
    let mut blocks = String::with_capacity(prompt_len / block_size.max(1) * 6 + 2);
    for b in 0..prompt_len / block_size.max(1) {
        if b > 0 {
            blocks.push(',');
        }
        blocks.push_str(&b.to_string());
    }
    format!(
        "{{\"id\":\"cmpl-{id}\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\
         \"text\":\"x\",\"finish_reason\":\"length\"}}],\"kv_transfer_params\":\
         {{\"do_remote_prefill\":true,\"do_remote_decode\":false,\"remote_block_ids\":[{blocks}],\
         \"remote_engine_id\":\"r{replica}\",\"remote_request_id\":\"cmpl-{id}\",\
         \"remote_host\":null,\"remote_port\":null,\"tp_size\":1}}}}"
    )
    .into_bytes()
}

fn host(e: HostError) -> String {
    e.to_string()
}

/// Replays `workload` on a P/D fleet through the compiled filter; `label` names the run in the
/// summary.
pub fn replay_pd(
    module: &FilterModule,
    workload: Workload,
    mode: Mode,
    cfg: &PdConfig,
    label: &str,
    seed: u64,
    mut progress: impl FnMut(u64, u64),
) -> Result<(Outcome, PdStats), String> {
    let started = Instant::now();
    let mut r = PdReplay::new(module, workload, mode, cfg, label)?;
    loop {
        r.proxy.set_now_ns(r.now * 1000);
        r.engine_events()?;
        r.flush_tokens()?;
        if r.now >= r.next_tick {
            r.tick()?;
        }
        if r.now >= r.next_sample {
            let blocks: Vec<u64> = r.engines.iter().map(|e| e.decode_blocks()).collect();
            r.rec.sample(r.now, &blocks);
            r.next_sample = r.now + cfg.sample_us.max(1);
        }
        r.issue_due()?;
        progress(r.done, r.total);
        match r.next_time()? {
            Some(next) => r.now = next,
            None => break,
        }
    }
    r.finish(seed, started)
}

/// A P/D replay in progress: the filter's worker, the engines and the workload's driver, with the
/// requests in flight between them. Each step of [`replay_pd`]'s loop is one method.
struct PdReplay<'a> {
    cfg: &'a PdConfig,
    label: &'a str,
    proxy: Proxy,
    w: WorkerVm,
    engines: Vec<Engine>,
    driver: Driver,
    rec: Recorder,
    stats: PdStats,
    flights: HashMap<u64, Flight>,
    now: u64,
    next_tick: u64,
    next_sample: u64,
    /// Requests ended, failed or not, and the workload's total (the progress callback's figures).
    done: u64,
    total: u64,
    /// Buffers kept across steps: the step's engine events, one engine's events, the driver's
    /// issues, and the streams with tokens to hand to the filter.
    events: Vec<(usize, EngineEvent)>,
    scratch: Vec<EngineEvent>,
    issues: Vec<Issue>,
    dirty: Vec<u64>,
}

impl<'a> PdReplay<'a> {
    fn new(
        module: &FilterModule,
        workload: Workload,
        mode: Mode,
        cfg: &'a PdConfig,
        label: &'a str,
    ) -> Result<Self, String> {
        if cfg.prefill == 0 || cfg.decode == 0 {
            return Err(format!(
                "a P/D fleet needs both roles ({} prefill, {} decode)",
                cfg.prefill, cfg.decode
            ));
        }
        let proxy = Proxy::new(
            module,
            ProxyOptions::new(HostMode::Envoy, plugin_config(cfg).to_string()),
        );
        let w = proxy.start_worker().map_err(host)?;
        let engines = (0..cfg.prefill + cfg.decode)
            .map(|i| Engine::new(cfg.engine.for_replica(i)))
            .collect();
        let total = workload.total_requests() as u64;
        Ok(PdReplay {
            cfg,
            label,
            proxy,
            w,
            engines,
            driver: Driver::new(workload, mode),
            rec: Recorder::new(),
            stats: PdStats::default(),
            flights: HashMap::new(),
            now: 0,
            next_tick: 0,
            next_sample: 0,
            done: 0,
            total,
            events: Vec::new(),
            scratch: Vec::new(),
            issues: Vec::new(),
            dirty: Vec::new(),
        })
    }

    /// Every engine step ending by `now`, in engine order, each handed to its role's handler.
    fn engine_events(&mut self) -> Result<(), String> {
        let mut events = std::mem::take(&mut self.events);
        events.clear();
        for (e, eng) in self.engines.iter_mut().enumerate() {
            self.scratch.clear();
            eng.advance(self.now, &mut self.scratch);
            events.extend(self.scratch.drain(..).map(|ev| (e, ev)));
        }
        for (e, ev) in events.drain(..) {
            if e < self.cfg.prefill {
                self.on_prefill_event(e, ev)?;
            } else {
                self.on_decode_event(ev)?;
            }
        }
        self.events = events;
        Ok(())
    }

    /// The prefill leg: only its end matters (its one token is discarded). The filter's callout is
    /// answered, and the request goes on to the decode replica the filter then names.
    fn on_prefill_event(&mut self, e: usize, ev: EngineEvent) -> Result<(), String> {
        let id = ev.id();
        let EngineEvent::Finished {
            t_us,
            cached_tokens,
            reason,
            ..
        } = ev
        else {
            return Ok(());
        };
        let Some(f) = self.flights.get_mut(&id) else {
            return Ok(());
        };
        let Some(call) = f.call.take() else {
            return Ok(());
        };
        f.prefill_cached = cached_tokens as u64;
        let answer = if reason == FinishReason::Abort {
            CallOutcome::ok(500, "application/json", b"{\"error\":\"aborted\"}".to_vec())
        } else {
            let body = prefill_answer(id, e, f.prompt.len(), self.cfg.engine.block_size);
            CallOutcome::ok(200, "application/json", body)
        };
        self.w.answer_callout(&call, answer).map_err(host)?;
        let label = self.label;
        let st = self
            .w
            .stream(f.stream)
            .ok_or_else(|| format!("{label}: stream of request {id} vanished"))?;
        let n = self.engines.len();
        let decode = st
            .upstream_header(DESTINATION)
            .and_then(replica_of_destination)
            .filter(|&d| d < n && st.local_response.is_none());
        let sent = match decode {
            Some(d) => {
                f.decode = d;
                self.rec.routed(id, d);
                let req = EngineRequest {
                    id,
                    prompt: f.prompt.to_vec(),
                    max_tokens: f.max_tokens,
                    ignore_eos: true,
                    min_tokens: 0,
                };
                self.engines[d]
                    .submit_remote(t_us, req, &self.cfg.link)
                    .map_err(|e| e.to_string())
            }
            None => Err("the prefill leg failed".into()),
        };
        match sent {
            Ok(moved) => {
                self.stats.transferred_tokens += moved;
                self.stats.decode_prompt_tokens += f.prompt.len() as u64;
                if (moved as usize) < f.prompt.len() {
                    self.stats.decode_local_hits += 1;
                }
                Ok(())
            }
            Err(_) => {
                // Either leg failing fails the request; the filter releases its load.
                let f = self.flights.remove(&id).expect("checked above");
                self.fail(f, id, t_us)
            }
        }
    }

    /// The decode leg: its tokens wait for this step's chunk; its end closes the client's stream,
    /// or fails the request when the engine aborted it.
    fn on_decode_event(&mut self, ev: EngineEvent) -> Result<(), String> {
        let id = ev.id();
        let Some(f) = self.flights.get_mut(&id) else {
            return Ok(());
        };
        match ev {
            EngineEvent::FirstToken { t_us, token, .. } => {
                f.output.push(token);
                f.pending.push(token);
                self.rec.first_token(id, t_us);
                self.dirty.push(id);
            }
            EngineEvent::Token { token, .. } => {
                f.output.push(token);
                f.pending.push(token);
                self.dirty.push(id);
            }
            EngineEvent::Finished {
                t_us,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                ..
            } => {
                let mut f = self.flights.remove(&id).expect("checked above");
                if reason == FinishReason::Abort {
                    return self.fail(f, id, t_us);
                }
                self.done += 1;
                if !f.headers_sent {
                    self.w
                        .response_headers(f.stream, sse_headers(), false)
                        .map_err(host)?;
                }
                let last = f.sse.finish(
                    &f.pending,
                    "length",
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                );
                self.w.response_body(f.stream, &last, true).map_err(host)?;
                self.w.end_stream(f.stream).map_err(host)?;
                self.rec
                    .finished(id, t_us, f.prefill_cached, completion_tokens as u64);
                let _ = self.driver.complete(id, t_us, &f.output);
            }
        }
        Ok(())
    }

    /// The tokens of this step reach the filter as one chunk per stream, as a proxy hands over
    /// what arrived since its last read.
    fn flush_tokens(&mut self) -> Result<(), String> {
        for id in self.dirty.drain(..) {
            let Some(f) = self.flights.get_mut(&id) else {
                continue;
            };
            if f.pending.is_empty() {
                continue;
            }
            if !f.headers_sent {
                self.w
                    .response_headers(f.stream, sse_headers(), false)
                    .map_err(host)?;
                f.headers_sent = true;
            }
            let chunk = f.sse.tokens(&f.pending);
            f.pending.clear();
            self.w
                .response_body(f.stream, &chunk, false)
                .map_err(host)?;
        }
        Ok(())
    }

    /// The filter's timer: feed polls when due, answered at once from the engines.
    fn tick(&mut self) -> Result<(), String> {
        self.w.tick().map_err(host)?;
        loop {
            let calls = self.w.take_callouts();
            if calls.is_empty() {
                break;
            }
            for call in calls {
                let r = call
                    .upstream
                    .strip_prefix("kvsteer_feed_r")
                    .and_then(|s| s.parse::<usize>().ok())
                    .filter(|&r| r < self.engines.len())
                    .ok_or_else(|| {
                        format!("{}: unexpected callout to {}", self.label, call.upstream)
                    })?;
                let path = call.header(":path").unwrap_or("");
                let q = path.split_once('?').map_or("", |p| p.1);
                let outcome = match FeedQuery::parse(q) {
                    Ok(q) => {
                        CallOutcome::ok(200, FEED_CONTENT_TYPE, self.engines[r].feed(&q).encode())
                    }
                    Err(e) => CallOutcome::ok(400, "text/plain", e.into_bytes()),
                };
                self.w.answer_callout(&call, outcome).map_err(host)?;
            }
        }
        self.next_tick = self.now + TICK_MS * 1000;
        Ok(())
    }

    /// The requests the workload issues by `now`, each handed to the filter.
    fn issue_due(&mut self) -> Result<(), String> {
        let mut issues = std::mem::take(&mut self.issues);
        issues.clear();
        self.driver.poll(self.now, &mut issues);
        for issue in issues.drain(..) {
            self.issue(&issue)?;
        }
        self.issues = issues;
        Ok(())
    }

    /// Starts the prefill leg on the prefill engine the filter's callout names; a request with no
    /// prefill leg (the filter answered it, 503, or sent it whole) or one the engine refuses fails.
    fn issue(&mut self, issue: &Issue) -> Result<(), String> {
        self.rec.issued_from(issue);
        self.stats.requests += 1;
        let id = issue.request_id;
        let (stream, call) = self.open_stream(issue)?;
        let mut f = Flight {
            stream,
            prompt: issue.prompt.clone(),
            max_tokens: issue.output_tokens,
            call: None,
            decode: 0,
            prefill_cached: 0,
            output: Vec::new(),
            pending: Vec::new(),
            sse: SseWriter::new(id, self.now / 1_000_000, 0),
            headers_sent: false,
        };
        let prefill = call.as_ref().and_then(|c| {
            c.upstream
                .strip_prefix("prefill_r")
                .and_then(|s| s.parse::<usize>().ok())
                .filter(|&p| p < self.cfg.prefill)
        });
        let sent = match (prefill, call) {
            (Some(p), Some(call)) => {
                f.call = Some(call);
                let req = EngineRequest {
                    id,
                    prompt: issue.prompt.to_vec(),
                    max_tokens: 1,
                    ignore_eos: true,
                    min_tokens: 0,
                };
                self.engines[p]
                    .submit(self.now, req)
                    .map_err(|e| e.to_string())
            }
            _ => Err("no prefill leg".into()),
        };
        if sent.is_err() {
            if let Some(call) = f.call.take() {
                let refused =
                    CallOutcome::ok(503, "application/json", b"{\"error\":\"full\"}".to_vec());
                self.w.answer_callout(&call, refused).map_err(host)?;
            }
            return self.fail(f, id, self.now);
        }
        self.flights.insert(id, f);
        Ok(())
    }

    /// Hands the client's request to the filter: its stream, and the prefill callout it made, if
    /// any.
    fn open_stream(&mut self, issue: &Issue) -> Result<(u32, Option<Callout>), String> {
        let body = completion_body(&issue.prompt, issue.output_tokens);
        let stream = self.w.new_stream().map_err(host)?;
        let headers = request_headers(
            "/v1/completions",
            body.len(),
            Some(("x-session-id", issue.session_id.as_str())),
            &[],
        );
        self.w
            .request_headers(stream, headers, false)
            .map_err(host)?;
        self.w.request_body(stream, &body, true).map_err(host)?;
        let mut calls = self.w.take_callouts();
        match calls.len() {
            1 => Ok((stream, calls.pop())),
            0 => Ok((stream, None)),
            more => Err(format!("{}: {more} callouts for one request", self.label)),
        }
    }

    /// Ends a request that failed: the filter's stream is ended (releasing whatever it booked).
    fn fail(&mut self, f: Flight, id: u64, t_us: u64) -> Result<(), String> {
        self.done += 1;
        self.w.end_stream(f.stream).map_err(host)?;
        self.rec.failed(id, t_us);
        let _ = self.driver.fail(id, t_us);
        self.stats.failed += 1;
        Ok(())
    }

    /// When the loop runs next: `None` once the workload is done and nothing is in flight.
    fn next_time(&self) -> Result<Option<u64>, String> {
        let engine_next = self
            .engines
            .iter()
            .filter_map(|e| e.next_event_time())
            .min();
        let driver_next = self.driver.next_wakeup();
        if driver_next.is_none() && self.flights.is_empty() {
            return Ok(None);
        }
        if driver_next.is_none() && engine_next.is_none() {
            return Err(format!(
                "{}: {} requests in flight and no engine event to finish them",
                self.label,
                self.flights.len()
            ));
        }
        let next = [
            engine_next,
            driver_next,
            Some(self.next_tick),
            Some(self.next_sample),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(self.now + 1);
        // Everything due at `now` was handled, so the clock always moves on.
        Ok(Some(next.max(self.now + 1)))
    }

    /// The run's outcome: the recorder's figures, the counters, and the filter's own view of what
    /// the prefill replicas held.
    fn finish(mut self, seed: u64, started: Instant) -> Result<(Outcome, PdStats), String> {
        // Prompt tokens the filter's index expected cached on the chosen prefill replicas.
        self.stats.prefill_matched_tokens = self
            .proxy
            .metric("kvsteer_matched_tokens")
            .map_or(0, |m| m.value.max(0) as u64);
        if self.w.is_dead() {
            return Err(format!("{}: the filter's worker died", self.label));
        }
        let hs = HarnessStats {
            requests: self.stats.requests,
            failed: self.stats.failed,
            ..HarnessStats::default()
        };
        let label = self.label;
        let outcome = Outcome {
            policy: label.to_string(),
            seed,
            summary: self.rec.summary(label),
            ttft_ms: self.rec.ttft_ms(),
            decode_series: self.rec.decode_series(),
            rows: self.rec.rows(),
            stats: hs,
            wall_s: started.elapsed().as_secs_f64(),
            virtual_s: self.now as f64 / 1e6,
        };
        Ok((outcome, self.stats))
    }
}

/// Splits the `@pd.KEY=NUMBER` parts (`transfer_weight`, `prefill_queue_weight`,
/// `active_request_weight`) off a policy spec into [`PdParams`]; the rest is the router's spec.
pub fn split_pd_params(spec: &str) -> Result<(String, PdParams), String> {
    let mut p = PdParams::default();
    let mut kept = Vec::new();
    for (i, part) in spec.split('@').enumerate() {
        let Some(kv) = part.strip_prefix("pd.").filter(|_| i > 0) else {
            kept.push(part);
            continue;
        };
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("policy spec {spec:?}: {part:?} is not pd.KEY=NUMBER"))?;
        let v: f64 = v
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite() && *v >= 0.0)
            .ok_or_else(|| format!("policy spec {spec:?}: pd.{k} must be a number >= 0"))?;
        match k {
            "transfer_weight" => p.transfer_weight = v,
            "prefill_queue_weight" => p.prefill_queue_weight = v,
            "active_request_weight" => p.active_request_weight = v,
            _ => return Err(format!("policy spec {spec:?}: unknown P/D field pd.{k}")),
        }
    }
    Ok((kept.join("@"), p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pd_params_parse_and_refuse() {
        let (s, p) = split_pd_params("kv_load@pd.transfer_weight=2@queue_weight=1").unwrap();
        assert_eq!(s, "kv_load@queue_weight=1");
        assert_eq!(p.transfer_weight, 2.0);
        assert!(split_pd_params("kv_load@pd.nope=1").is_err());
        assert!(split_pd_params("kv_load@pd.transfer_weight=-1").is_err());
        assert!(split_pd_params("kv_load@pd.transfer_weight").is_err());
    }
}
