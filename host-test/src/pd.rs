//! A prefill/decode (P/D) fleet in virtual time (docs/pd.md): prefill-role and decode-role simulated
//! engines, and a proxy that carries out vLLM's two-leg protocol for each request with the routing
//! core's P/D decision ([`kvsteer_core::Router::route_pd`]).
//!
//! **This runs the core natively, not the compiled filter**: the filter does not do P/D yet (the
//! HTTP callout to the prefill replica is the next step, docs/pd.md). Everything else is the same
//! parts as the wasm harness: the same engines, the same feed (each engine's feed polled every
//! `feed_period_us` into the router, as the filter polls it), the same workload driver and recorder.
//!
//! Per request: the router picks a prefill replica and a decode replica and books both legs; the
//! prefill leg runs on the prefill engine as a 1-token request (vLLM's `max_tokens: 1` with
//! `do_remote_decode`); when it finishes, the decode leg is submitted to the decode engine with
//! remote KV ([`kvsteer_sim::Engine::submit_remote`]: the prompt not cached there is read over the
//! link, then the last token is computed), and the client's stream is the decode engine's. TTFT is
//! measured from issue to the decode engine's first token, so it holds the prefill queue and compute,
//! the transfer and the decode engine's first step. The prefill leg's token is discarded, as vLLM's
//! proxies do.

use crate::HarnessStats;
use crate::bench::run::Outcome;
use kvsteer_core::block::BlockHasher;
use kvsteer_core::pd::{PdParams, Role};
use kvsteer_core::request::{Endpoint, PromptIdentity, RouteRequest};
use kvsteer_core::{Router, RoutingConfig};
use kvsteer_sim::pd::KvLink;
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest, FinishReason};
use kvsteer_workload::{Driver, Mode, Recorder, Workload};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

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
    prompt: Arc<[u32]>,
    max_tokens: u32,
    decode: usize,
    /// The prefill leg's cached prompt tokens (the hit rate reported is the prefill side's).
    prefill_cached: u64,
    output: Vec<u32>,
}

fn route_request(
    hasher: &BlockHasher,
    prompt: &[u32],
    max_tokens: u32,
    session: &str,
) -> RouteRequest {
    RouteRequest {
        endpoint: Endpoint::Completions,
        model: None,
        stream: true,
        output_hint: Some(max_tokens as u64),
        session_key: Some(session.to_string()),
        prompt_tokens: prompt.len() as u64,
        identity: PromptIdentity::Exact(hasher.sequence_hashes(prompt)),
    }
}

/// Replays `workload` on a P/D fleet; `label` names the run in the summary.
pub fn replay_pd(
    workload: Workload,
    mode: Mode,
    cfg: &PdConfig,
    label: &str,
    seed: u64,
    mut progress: impl FnMut(u64, u64),
) -> Result<(Outcome, PdStats), String> {
    let started = Instant::now();
    let n = cfg.prefill + cfg.decode;
    if cfg.prefill == 0 || cfg.decode == 0 {
        return Err(format!(
            "a P/D fleet needs both roles ({} prefill, {} decode)",
            cfg.prefill, cfg.decode
        ));
    }
    let roles = cfg.roles();
    let rc = RoutingConfig::from_json(&cfg.routing.to_string()).map_err(|e| e.to_string())?;
    let block_size = rc.block_size;
    let hasher = BlockHasher::new(block_size).map_err(|e| format!("block size: {e:?}"))?;
    let mut router = Router::new(rc, n).map_err(|e| e.to_string())?;
    let mut engines: Vec<Engine> = (0..n)
        .map(|i| Engine::new(cfg.engine.for_replica(i)))
        .collect();
    let total = workload.total_requests() as u64;
    let mut driver = Driver::new(workload, mode);
    let mut rec = Recorder::new();
    let mut stats = PdStats::default();
    let mut flights: HashMap<u64, Flight> = HashMap::new();
    let mut now: u64 = 0;
    let mut next_feed: u64 = 0;
    let mut next_sample: u64 = 0;
    let mut events: Vec<(usize, EngineEvent)> = Vec::new();
    let mut scratch = Vec::new();
    let mut issues = Vec::new();
    let mut done: u64 = 0;
    loop {
        // Every engine step ending by `now`, in engine order.
        events.clear();
        for (e, eng) in engines.iter_mut().enumerate() {
            scratch.clear();
            eng.advance(now, &mut scratch);
            events.extend(scratch.drain(..).map(|ev| (e, ev)));
        }
        for (e, ev) in events.drain(..) {
            let id = ev.id();
            if e < cfg.prefill {
                // The prefill leg: only its end matters (its one token is discarded).
                let EngineEvent::Finished {
                    t_us,
                    cached_tokens,
                    reason,
                    ..
                } = ev
                else {
                    continue;
                };
                router.release(2 * id);
                let Some(f) = flights.get_mut(&id) else {
                    continue;
                };
                f.prefill_cached = cached_tokens as u64;
                let req = EngineRequest {
                    id,
                    prompt: f.prompt.to_vec(),
                    max_tokens: f.max_tokens,
                    ignore_eos: true,
                    min_tokens: 0,
                };
                let sent = if reason == FinishReason::Abort {
                    Err("prefill leg aborted".to_string())
                } else {
                    engines[f.decode]
                        .submit_remote(t_us, req, &cfg.link)
                        .map_err(|e| e.to_string())
                };
                match sent {
                    Ok(moved) => {
                        stats.transferred_tokens += moved;
                        stats.decode_prompt_tokens += f.prompt.len() as u64;
                        if (moved as usize) < f.prompt.len() {
                            stats.decode_local_hits += 1;
                        }
                    }
                    Err(_) => {
                        // Either leg failing fails the request and releases all its load.
                        flights.remove(&id);
                        router.release(2 * id + 1);
                        rec.failed(id, t_us);
                        let _ = driver.fail(id, t_us);
                        stats.failed += 1;
                        done += 1;
                    }
                }
                continue;
            }
            let Some(f) = flights.get_mut(&id) else {
                continue;
            };
            match ev {
                EngineEvent::FirstToken { t_us, token, .. } => {
                    f.output.push(token);
                    rec.first_token(id, t_us);
                    router.first_token(2 * id + 1);
                }
                EngineEvent::Token { token, .. } => {
                    f.output.push(token);
                    if f.output.len() % 16 == 0 {
                        router.decode_progress(2 * id + 1, f.output.len() as u64);
                    }
                }
                EngineEvent::Finished {
                    t_us,
                    completion_tokens,
                    reason,
                    ..
                } => {
                    let f = flights.remove(&id).expect("checked above");
                    router.release(2 * id + 1);
                    done += 1;
                    if reason == FinishReason::Abort {
                        rec.failed(id, t_us);
                        let _ = driver.fail(id, t_us);
                        stats.failed += 1;
                    } else {
                        rec.finished(id, t_us, f.prefill_cached, completion_tokens as u64);
                        let _ = driver.complete(id, t_us, &f.output);
                    }
                }
            }
        }
        if now >= next_feed {
            // The poll time is the router's clock (its latest decision), as the filter's is.
            for (r, eng) in engines.iter_mut().enumerate() {
                let q = router.feed_query(r, kvsteer_core::feed::DEFAULT_MAX_EVENTS);
                let b = eng.feed(&q);
                router.apply_feed(r, &b);
            }
            next_feed = now + cfg.feed_period_us.max(1);
        }
        if now >= next_sample {
            let blocks: Vec<u64> = engines.iter().map(|e| e.decode_blocks()).collect();
            rec.sample(now, &blocks);
            next_sample = now + cfg.sample_us.max(1);
        }
        issues.clear();
        driver.poll(now, &mut issues);
        for issue in issues.drain(..) {
            rec.issued_from(&issue);
            stats.requests += 1;
            let id = issue.request_id;
            let req = route_request(
                &hasher,
                &issue.prompt,
                issue.output_tokens,
                &issue.session_id,
            );
            let d = router
                .route_pd(&req, &roles, &cfg.params, now / 1000)
                .map_err(|e| e.to_string())?;
            router.admit_pd(2 * id, 2 * id + 1, &req, &d, now / 1000);
            stats.prefill_matched_tokens += d.prefill_matched_tokens;
            rec.routed(id, d.decode);
            let sent = engines[d.prefill].submit(
                now,
                EngineRequest {
                    id,
                    prompt: issue.prompt.to_vec(),
                    max_tokens: 1,
                    ignore_eos: true,
                    min_tokens: 0,
                },
            );
            if sent.is_err() {
                router.release(2 * id);
                router.release(2 * id + 1);
                rec.failed(id, now);
                let _ = driver.fail(id, now);
                stats.failed += 1;
                done += 1;
                continue;
            }
            flights.insert(
                id,
                Flight {
                    prompt: issue.prompt.clone(),
                    max_tokens: issue.output_tokens,
                    decode: d.decode,
                    prefill_cached: 0,
                    output: Vec::new(),
                },
            );
        }
        progress(done, total);
        let engine_next = engines.iter().filter_map(|e| e.next_event_time()).min();
        let driver_next = driver.next_wakeup();
        if driver_next.is_none() && flights.is_empty() {
            break;
        }
        if driver_next.is_none() && engine_next.is_none() {
            return Err(format!(
                "{label}: {} requests in flight and no engine event to finish them",
                flights.len()
            ));
        }
        let next = [engine_next, driver_next, Some(next_feed), Some(next_sample)]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(now + 1);
        // Everything due at `now` was handled, so the clock always moves on.
        now = next.max(now + 1);
    }
    let hs = HarnessStats {
        requests: stats.requests,
        failed: stats.failed,
        ..HarnessStats::default()
    };
    let outcome = Outcome {
        policy: label.to_string(),
        seed,
        summary: rec.summary(label),
        ttft_ms: rec.ttft_ms(),
        decode_series: rec.decode_series(),
        rows: rec.rows(),
        stats: hs,
        wall_s: started.elapsed().as_secs_f64(),
        virtual_s: now as f64 / 1e6,
    };
    Ok((outcome, stats))
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

/// One bench replay of a P/D scenario: `policy` as the bench takes it (`kv_load`, `round_robin`,
/// variants, plus `@pd.KEY=NUMBER`), engines as the bench builds them, the router's tie-break seeded
/// as the filter's is in the bench.
pub fn replay_pd_spec(
    workload: Workload,
    mode: Mode,
    policy: &str,
    seed: u64,
    (prefill, decode): (usize, usize),
    progress: impl FnMut(u64, u64),
) -> Result<(Outcome, PdStats), String> {
    if crate::bench::run::is_oracle(policy) {
        return Err(format!("{policy}: the oracle has no P/D form"));
    }
    let (spec, params) = split_pd_params(policy)?;
    let mut routing = crate::bench::run::routing(&spec)?;
    let block_size = workload.block_size;
    routing["block_size"] = block_size.into();
    routing["seed"] = crate::bench::run::ROUTER_SEED.wrapping_add(seed).into();
    let engine = crate::bench::scenario::Scenario::engine(block_size, seed);
    let mut cfg = PdConfig::new(prefill, decode, engine, routing);
    cfg.params = params;
    replay_pd(workload, mode, &cfg, policy, seed, progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::scenario::{Scale, pd_matrix};

    #[test]
    fn pd_params_parse_and_refuse() {
        let (s, p) = split_pd_params("kv_load@pd.transfer_weight=2@queue_weight=1").unwrap();
        assert_eq!(s, "kv_load@queue_weight=1");
        assert_eq!(p.transfer_weight, 2.0);
        assert!(split_pd_params("kv_load@pd.nope=1").is_err());
        assert!(split_pd_params("kv_load@pd.transfer_weight=-1").is_err());
        assert!(split_pd_params("kv_load@pd.transfer_weight").is_err());
    }

    /// Every request completes on a small RL workload under both policies; decode legs land only on
    /// decode engines (the recorder's replica is the decode one, always >= 2); kv_load's decode side
    /// sends a rollout's later turns where its earlier turns' KV already is, so its decode legs read
    /// far less over the link than round robin's.
    #[test]
    fn a_small_pd_fleet_serves_every_request() {
        let run = |policy: &str| {
            let sc = &pd_matrix(Scale::Smoke)[0];
            assert_eq!(
                (sc.id.as_str(), sc.pd_prefill, sc.endpoints),
                ("pd-rl", 2, 6)
            );
            let (w, mode) = sc.build(std::path::Path::new("traces"), 1).unwrap();
            let (o, st) = replay_pd_spec(w, mode, policy, 1, (2, 4), |_, _| {}).unwrap();
            assert_eq!(st.failed, 0, "{policy}");
            assert_eq!(o.summary.failed, 0, "{policy}");
            assert!(st.requests > 0 && o.summary.requests as u64 == st.requests);
            assert!(o.rows.iter().all(|r| r.replica.is_none_or(|d| d >= 2)));
            assert!(st.transferred_tokens > 0 && st.transferred_tokens <= st.decode_prompt_tokens);
            // The router's index learned the caches from the feeds.
            assert!(
                st.prefill_matched_tokens > 0,
                "{policy}: the feed never reached the index"
            );
            (o, st)
        };
        let read = |st: &PdStats| st.transferred_tokens as f64 / st.decode_prompt_tokens as f64;
        let (_, kv) = run("kv_load");
        let (_, rr) = run("round_robin");
        assert!(
            read(&kv) * 1.5 < read(&rr),
            "{} vs {}",
            read(&kv),
            read(&rr)
        );
    }
}
