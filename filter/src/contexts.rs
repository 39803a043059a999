//! The proxy-wasm contexts: all host calls are made here (through [`crate::abi`], each with a
//! fallback), all decisions in [`crate::router_state`].

use crate::abi;
use crate::config::{FilterConfig, OutputMode};
use crate::pd::{self, LegFailure, PrefillAnswer};
use crate::router_state::{
    BodyFallback, DecisionOutput, FeedFailure, FeedPoll, FeedResult, PdRoute, RouterState,
    is_inference_path,
};
use crate::sse::SseTracker;
use crate::store::SharedStore;
use kvsteer_core::health::Outcome;
use kvsteer_core::request::EarlyScan;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType, LogLevel, MapType, MetricType};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

fn now_ms() -> u64 {
    now_ns() / 1_000_000
}

thread_local! {
    /// The last time the proxy's clock was read ([`now_ns`]).
    static LAST_NS: Cell<u64> = const { Cell::new(0) };
}

/// The proxy's clock in nanoseconds (Envoy: the system clock, read afresh on every call, nanosecond
/// resolution), for the feed's time budget. A refused read answers the last time read (0 before
/// any): the clock stands still for a moment rather than jumping back to 1970, which would make
/// every deadline and age in the router look expired or fresh at once.
fn now_ns() -> u64 {
    match abi::now_ns() {
        Ok(t) => {
            LAST_NS.set(t);
            t
        }
        Err(_) => LAST_NS.get(),
    }
}

/// A log line; one the proxy refuses is only counted ([`abi::log`]).
fn log(level: LogLevel, msg: &str) {
    abi::log(level, msg);
}

fn header(map: MapType, name: &str) -> Option<Vec<u8>> {
    abi::get_header(map, name).ok().flatten()
}

/// The proxy's shared data, for the feed lease and relay, worker numbers and shared load. A read the
/// proxy refuses reads as absent and a refused write did not happen ([`SharedStore`]'s "absent or
/// unavailable" and `false`), as a lost CAS race does: the lease, relay and peer records already
/// treat both as normal (another worker got there first, or nothing is shared yet).
struct HostStore {
    /// The host writes a key without a CAS token only if it does not exist yet (ngx_wasm_module),
    /// so a record is replaced by reading its token first ([`SharedStore::overwrite`]). Envoy writes
    /// such a key whatever it holds, in one call, as the filter always has there.
    cas_zero_creates: bool,
}

static ENVOY_STORE: HostStore = HostStore {
    cas_zero_creates: false,
};
static NGX_STORE: HostStore = HostStore {
    cas_zero_creates: true,
};

/// The shared data of the proxy this configuration is for (nginx mode: ngx_wasm_module's CAS rule).
fn host_store(cfg: &FilterConfig) -> &'static HostStore {
    if cfg.output == OutputMode::NginxVariable {
        &NGX_STORE
    } else {
        &ENVOY_STORE
    }
}

impl SharedStore for HostStore {
    fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
        abi::get_shared_data(key).ok().flatten()
    }
    fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
        matches!(abi::set_shared_data(key, value, cas), Ok(true))
    }
    fn overwrite(&self, key: &str, value: &[u8]) -> bool {
        if self.cas_zero_creates {
            crate::store::overwrite_by_cas(self, key, value)
        } else {
            self.set(key, value, None)
        }
    }
}

/// Metric ids, defined once per VM at configure time. A host without metrics leaves them `None`.
#[derive(Default)]
struct Metrics {
    decisions: Vec<Option<u32>>,
    feed_errors: Vec<Option<u32>>,
    feed_timeouts: Vec<Option<u32>>,
    feed_oversized: Vec<Option<u32>>,
    feed_stale: Vec<Option<u32>>,
    feed_pending_blocks: Option<u32>,
    feed_time_cuts: Option<u32>,
    last_time_cuts: u64,
    down: Vec<Option<u32>>,
    upstream_failures: Vec<Option<u32>>,
    ejected: Vec<Option<u32>>,
    /// The working-set term's view per replica (docs/design/design.md section 2.6): its recent working set
    /// and its cache size, in blocks (0: unknown, the term is off for it).
    working_set_blocks: Vec<Option<u32>>,
    cache_size_blocks: Vec<Option<u32>>,
    /// `kv_time`: each replica's observed against predicted time to first token, in thousandths.
    speed_milli: Vec<Option<u32>>,
    /// Other workers' working-set entries missed and journals refused, and the totals last counted.
    working_set_missed: Option<u32>,
    working_set_refused: Option<u32>,
    last_working_set_sharing: (u64, u64),
    /// The working-set exchange with other proxies ([`crate::exchange`]) and its last counts.
    peer_polls: Option<u32>,
    peer_poll_failures: Option<u32>,
    peer_answers_refused: Option<u32>,
    peer_entries_applied: Option<u32>,
    peer_requests_refused: Option<u32>,
    peer_requests_served: Option<u32>,
    last_exchange: crate::exchange::ExchangeStats,
    health_probes: Vec<Option<u32>>,
    last_failures: Vec<u64>,
    last_probes: Vec<u64>,
    routed: Option<u32>,
    fallbacks: Option<u32>,
    matched_tokens: Option<u32>,
    prompt_tokens: Option<u32>,
    spoofed: Option<u32>,
    feed_rank_mismatches: Option<u32>,
    index_blocks: Option<u32>,
    index_evictions: Option<u32>,
    release_anomalies: Option<u32>,
    feed_resets: Option<u32>,
    /// P/D (docs/design/pd.md): requests split into two legs, prefill legs that failed (502), requests
    /// with no prefill replica up (503), decode legs sent without `kv_transfer_params` (the prefill
    /// answer had none), requests sent whole to a decode replica (body not splittable), and
    /// prefill legs sent on to their side's backup after a failure.
    pd_split: Option<u32>,
    pd_prefill_failures: Option<u32>,
    pd_unavailable: Option<u32>,
    pd_plain_decodes: Option<u32>,
    pd_whole: Option<u32>,
    pd_prefill_retries: Option<u32>,
    early_declined: Option<u32>,
    early_bodies: Option<u32>,
    bookings: Option<u32>,
    releases: Option<u32>,
    /// Host calls the proxy refused ([`abi`]: each has a fallback; docs/design/filter.md).
    host_call_refusals: Option<u32>,
    last_refusals: u64,
    last_bookings: (u64, u64),
    last_evictions: u64,
    last_anomalies: u64,
    last_resets: u64,
    #[cfg(feature = "tokenizer")]
    tokenizer: Option<TokenizerMetrics>,
}

/// Tokenizer counters (defined only when a tokenizer is configured).
#[cfg(feature = "tokenizer")]
#[derive(Default)]
struct TokenizerMetrics {
    exact: Option<u32>,
    fallbacks: Vec<Option<u32>>,
    cache_hits: Option<u32>,
    cache_misses: Option<u32>,
    cache_tokens: Option<u32>,
    last: kvsteer_tokenizer::TokenizerStats,
}

#[cfg(feature = "tokenizer")]
impl TokenizerMetrics {
    fn define() -> TokenizerMetrics {
        use MetricType::{Counter, Gauge};
        TokenizerMetrics {
            exact: define(Counter, "kvsteer_tokenizer_exact"),
            fallbacks: kvsteer_tokenizer::FallbackReason::ALL
                .iter()
                .map(|r| define(Counter, &format!("kvsteer_tokenizer_fallback_{}", r.name())))
                .collect(),
            cache_hits: define(Counter, "kvsteer_tokenizer_cache_hits"),
            cache_misses: define(Counter, "kvsteer_tokenizer_cache_misses"),
            cache_tokens: define(Gauge, "kvsteer_tokenizer_cache_tokens"),
            last: Default::default(),
        }
    }

    fn update(&mut self, now: kvsteer_tokenizer::TokenizerStats) {
        inc(self.exact, now.exact.saturating_sub(self.last.exact));
        for (i, id) in self.fallbacks.iter().enumerate() {
            inc(*id, now.fallbacks[i].saturating_sub(self.last.fallbacks[i]));
        }
        inc(
            self.cache_hits,
            now.cache_hits.saturating_sub(self.last.cache_hits),
        );
        inc(
            self.cache_misses,
            now.cache_misses.saturating_sub(self.last.cache_misses),
        );
        gauge(self.cache_tokens, now.cache_tokens);
        self.last = now;
    }
}

fn define(kind: MetricType, name: &str) -> Option<u32> {
    abi::define_metric(kind, name).ok()
}

fn inc(id: Option<u32>, by: u64) {
    if let Some(id) = id
        && by > 0
    {
        let _ = abi::increment_metric(id, by.min(i64::MAX as u64) as i64);
    }
}

fn gauge(id: Option<u32>, v: u64) {
    if let Some(id) = id {
        let _ = abi::record_metric(id, v);
    }
}

impl Metrics {
    fn define(cfg: &FilterConfig) -> Metrics {
        use MetricType::{Counter, Gauge};
        let policy = cfg.routing.policy.name();
        let per = |kind, what: &str| -> Vec<Option<u32>> {
            cfg.replicas
                .iter()
                .map(|r| define(kind, &format!("kvsteer_{what}_{}", r.name)))
                .collect()
        };
        Metrics {
            decisions: cfg
                .replicas
                .iter()
                .map(|r| define(Counter, &format!("kvsteer_decisions_{policy}_{}", r.name)))
                .collect(),
            feed_errors: per(Counter, "feed_errors"),
            feed_timeouts: per(Counter, "feed_timeouts"),
            feed_oversized: per(Counter, "feed_oversized"),
            feed_stale: per(Gauge, "feed_stale"),
            feed_pending_blocks: define(Gauge, "kvsteer_feed_pending_blocks"),
            feed_time_cuts: define(Counter, "kvsteer_feed_apply_time_cuts"),
            down: per(Gauge, "down"),
            upstream_failures: per(Counter, "upstream_failures"),
            ejected: per(Gauge, "ejected"),
            working_set_blocks: per(Gauge, "working_set_blocks"),
            cache_size_blocks: per(Gauge, "cache_size_blocks"),
            speed_milli: per(Gauge, "ttft_observed_per_predicted_milli"),
            health_probes: per(Counter, "health_probes"),
            last_failures: vec![0; cfg.replicas.len()],
            last_probes: vec![0; cfg.replicas.len()],
            routed: define(Counter, "kvsteer_requests_routed"),
            fallbacks: define(Counter, "kvsteer_fallbacks"),
            matched_tokens: define(Counter, "kvsteer_matched_tokens"),
            prompt_tokens: define(Counter, "kvsteer_prompt_tokens"),
            spoofed: define(Counter, "kvsteer_spoofed_headers_removed"),
            feed_rank_mismatches: define(Counter, "kvsteer_feed_rank_mismatches"),
            working_set_missed: define(Counter, "kvsteer_working_set_missed"),
            working_set_refused: define(Counter, "kvsteer_working_set_refused"),
            last_working_set_sharing: (0, 0),
            peer_polls: define(Counter, "kvsteer_peer_polls"),
            peer_poll_failures: define(Counter, "kvsteer_peer_poll_failures"),
            peer_answers_refused: define(Counter, "kvsteer_peer_answers_refused"),
            peer_entries_applied: define(Counter, "kvsteer_peer_entries_applied"),
            peer_requests_refused: define(Counter, "kvsteer_peer_requests_refused"),
            peer_requests_served: define(Counter, "kvsteer_peer_requests_served"),
            last_exchange: Default::default(),
            index_blocks: define(Gauge, "kvsteer_index_blocks"),
            index_evictions: define(Counter, "kvsteer_index_evictions"),
            release_anomalies: define(Counter, "kvsteer_release_anomalies"),
            feed_resets: define(Counter, "kvsteer_feed_resets"),
            pd_split: define(Counter, "kvsteer_pd_requests"),
            pd_prefill_failures: define(Counter, "kvsteer_pd_prefill_failures"),
            pd_unavailable: define(Counter, "kvsteer_pd_unavailable"),
            pd_plain_decodes: define(Counter, "kvsteer_pd_plain_decodes"),
            pd_whole: define(Counter, "kvsteer_pd_whole_requests"),
            pd_prefill_retries: define(Counter, "kvsteer_pd_prefill_retries"),
            early_declined: define(Counter, "kvsteer_early_scan_declined"),
            early_bodies: define(Counter, "kvsteer_early_scan_bodies"),
            bookings: define(Counter, "kvsteer_bookings"),
            releases: define(Counter, "kvsteer_releases"),
            host_call_refusals: define(Counter, "kvsteer_host_call_refusals"),
            #[cfg(feature = "tokenizer")]
            tokenizer: cfg.tokenizer.as_ref().map(|_| TokenizerMetrics::define()),
            ..Metrics::default()
        }
    }
}

/// A configured VM: the worker's routing state plus its host-facing bits.
struct Vm {
    state: RouterState,
    metrics: Metrics,
    /// Bytes of request bodies this VM's streams hold for the early scan (their buffers'
    /// capacity), kept under `early_body_scan_max_bytes`.
    early_held: usize,
}

type Shared = Rc<RefCell<Vm>>;

#[derive(Default)]
pub struct Root {
    vm: Option<Shared>,
}

impl Root {
    fn poll_feeds(vm: &mut Vm, now: u64) {
        let timeout = Duration::from_millis(vm.state.config().feed_timeout_ms);
        let store = vm.state.shared(host_store(vm.state.config()));
        if let Some(store) = store {
            for r in vm.state.follow_relays(store, now) {
                Self::report_feed(vm, &r);
            }
            vm.state.follow_health(store);
        }
        for replica in vm.state.check_staleness(now) {
            let name = vm.state.replica_name(replica);
            log(
                LogLevel::Warn,
                &format!("kvsteer: no feed from {name} lately; routing it by load only"),
            );
        }
        for poll in vm.state.plan_polls(store, now) {
            let FeedPoll {
                replica,
                upstream,
                authority,
                path,
                took_lease,
            } = poll;
            if took_lease {
                let name = vm.state.replica_name(replica);
                let id = vm.state.worker_id().unwrap_or(0);
                let role = if vm.state.has_routed() {
                    "routing requests"
                } else {
                    "routing none yet"
                };
                log(
                    LogLevel::Info,
                    &format!("kvsteer: VM {id} ({role}) now polls {name}'s feed for the proxy"),
                );
            }
            let headers = vec![
                (":method", "GET"),
                (":path", path.as_str()),
                (":authority", authority.as_str()),
                ("accept", kvsteer_core::feed::FEED_CONTENT_TYPE),
            ];
            match abi::dispatch_http_call(&upstream, headers, None, timeout) {
                Ok(token) => vm.state.poll_started(replica, token, now),
                Err(status) => {
                    let r = vm
                        .state
                        .poll_not_started(replica, &format!("{status:?}"), now);
                    Self::report_feed(vm, &r);
                }
            }
        }
    }

    /// Polls the peer proxies that are due for their working-set journals (`peers`).
    fn poll_peers(vm: &mut Vm, now: u64) {
        let Some(p) = vm.state.config().peers.clone() else {
            return;
        };
        let timeout = Duration::from_millis(p.timeout_ms);
        for call in vm.state.plan_peer_polls(now) {
            let headers = vec![
                (":method", "GET"),
                (":path", call.path.as_str()),
                (":authority", call.authority.as_str()),
                ("accept", crate::exchange::BUNDLE_CONTENT_TYPE),
                (p.token_header.as_str(), p.token.as_str()),
            ];
            match abi::dispatch_http_call(&call.upstream, headers, None, timeout) {
                Ok(token) => vm.state.peer_poll_started(call.peer, token, now),
                Err(_) => vm.state.peer_poll_not_started(call.peer, now),
            }
        }
    }

    fn report_feed(vm: &Vm, r: &FeedResult) {
        match r {
            FeedResult::Failed {
                replica,
                cause,
                reason,
                became_stale,
                became_down,
            } => {
                let m = &vm.metrics;
                inc(m.feed_errors.get(*replica).copied().flatten(), 1);
                match cause {
                    FeedFailure::Slow => inc(m.feed_timeouts.get(*replica).copied().flatten(), 1),
                    FeedFailure::Oversized => {
                        inc(m.feed_oversized.get(*replica).copied().flatten(), 1)
                    }
                    FeedFailure::WrongRank { .. } => inc(m.feed_rank_mismatches, 1),
                    _ => {}
                }
                let name = vm.state.replica_name(*replica);
                if *became_down {
                    log(
                        LogLevel::Warn,
                        &format!("kvsteer: {name} is unreachable ({reason}); avoiding it"),
                    );
                }
                if *became_stale {
                    log(
                        LogLevel::Warn,
                        &format!(
                            "kvsteer: feed of {name} is stale ({reason}); routing it by load only"
                        ),
                    );
                }
            }
            FeedResult::Applied { .. } | FeedResult::Unknown => {}
        }
    }

    fn update_gauges(vm: &mut Vm) {
        let stats = vm.state.stats();
        gauge(vm.metrics.index_blocks, stats.index_blocks);
        gauge(vm.metrics.feed_pending_blocks, vm.state.pending_blocks());
        let m = &mut vm.metrics;
        inc(
            m.index_evictions,
            stats.index_evictions.saturating_sub(m.last_evictions),
        );
        m.last_evictions = stats.index_evictions;
        inc(
            m.release_anomalies,
            stats.release_anomalies.saturating_sub(m.last_anomalies),
        );
        m.last_anomalies = stats.release_anomalies;
        inc(
            m.feed_resets,
            stats.feed_resets.saturating_sub(m.last_resets),
        );
        m.last_resets = stats.feed_resets;
        let (booked, released) = vm.state.bookings();
        inc(m.bookings, booked.saturating_sub(m.last_bookings.0));
        inc(m.releases, released.saturating_sub(m.last_bookings.1));
        m.last_bookings = (booked, released);
        let refusals = abi::refusals();
        inc(
            m.host_call_refusals,
            refusals.saturating_sub(m.last_refusals),
        );
        m.last_refusals = refusals;
        let cuts = vm.state.feed_time_cuts();
        inc(m.feed_time_cuts, cuts.saturating_sub(m.last_time_cuts));
        m.last_time_cuts = cuts;
        let (missed, refused) = vm.state.working_set_sharing();
        let (last_missed, last_refused) = m.last_working_set_sharing;
        inc(m.working_set_missed, missed.saturating_sub(last_missed));
        inc(m.working_set_refused, refused.saturating_sub(last_refused));
        m.last_working_set_sharing = (missed, refused);
        let x = vm.state.exchange_stats();
        let last = m.last_exchange;
        inc(m.peer_polls, x.polls.saturating_sub(last.polls));
        inc(m.peer_poll_failures, x.failed.saturating_sub(last.failed));
        inc(
            m.peer_answers_refused,
            x.refused.saturating_sub(last.refused),
        );
        inc(
            m.peer_entries_applied,
            x.applied.saturating_sub(last.applied),
        );
        inc(m.working_set_missed, x.missed.saturating_sub(last.missed));
        inc(
            m.peer_requests_refused,
            x.requests_refused.saturating_sub(last.requests_refused),
        );
        inc(m.peer_requests_served, x.served.saturating_sub(last.served));
        m.last_exchange = x;
        #[cfg(feature = "tokenizer")]
        if let (Some(tm), Some(t)) = (m.tokenizer.as_mut(), vm.state.tokenizer_stats()) {
            tm.update(t);
        }
        for i in 0..vm.state.replicas() {
            gauge(
                m.feed_stale.get(i).copied().flatten(),
                vm.state.is_stale(i) as u64,
            );
            gauge(m.down.get(i).copied().flatten(), vm.state.is_down(i) as u64);
            gauge(
                m.ejected.get(i).copied().flatten(),
                vm.state.is_ejected(i) as u64,
            );
            let (ws, cap) = vm.state.working_set(i);
            // Only a VM that routes applies the other workers' admissions (`share_load`); one that
            // has routed nothing (Envoy's main thread, an idle worker) knows part of the working set
            // and must not overwrite the stat the routing workers write.
            if vm.state.has_routed() {
                gauge(m.working_set_blocks.get(i).copied().flatten(), ws as u64);
            }
            gauge(m.cache_size_blocks.get(i).copied().flatten(), cap as u64);
            if vm.state.has_routed() {
                let speed = vm.state.speed_factor(i);
                gauge(
                    m.speed_milli.get(i).copied().flatten(),
                    (speed * 1e3) as u64,
                );
            }
        }
        let health = vm.state.health();
        for (i, (&f, &p)) in health.failures().iter().zip(health.probes()).enumerate() {
            if let (Some(lf), Some(lp)) = (m.last_failures.get_mut(i), m.last_probes.get_mut(i)) {
                inc(
                    m.upstream_failures.get(i).copied().flatten(),
                    f.saturating_sub(*lf),
                );
                inc(
                    m.health_probes.get(i).copied().flatten(),
                    p.saturating_sub(*lp),
                );
                *lf = f;
                *lp = p;
            }
        }
    }
}

impl Context for Root {
    fn on_http_call_response(
        &mut self,
        token: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let Some(vm) = &self.vm else { return };
        let status = if num_headers == 0 {
            None
        } else {
            header(MapType::HttpCallResponseHeaders, ":status")
                .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok())
        };
        let mut vm = vm.borrow_mut();
        if vm.state.is_peer_poll(token) {
            // A peer proxy's answer: refused unread when too large, checked whole before use.
            let fits = vm.state.peer_answer_fits(body_size);
            let body = if fits && body_size > 0 && status == Some(200) {
                abi::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                    .ok()
                    .flatten()
            } else {
                None
            };
            vm.state
                .on_peer_answer(token, status, body.as_deref(), !fits, now_ms());
            return;
        }
        let store = vm.state.shared(host_store(vm.state.config()));
        let r = if body_size > vm.state.config().feed_max_bytes {
            // Refused before it is copied into the VM, let alone parsed.
            vm.state
                .on_feed_response_oversized(token, status, body_size, store, now_ms())
        } else {
            let body = if body_size > 0 {
                // A body the proxy will not hand over reads as none: a failed poll.
                abi::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                    .ok()
                    .flatten()
            } else {
                None
            };
            vm.state
                .on_feed_answer(token, status, body, store, now_ms())
        };
        Self::report_feed(&vm, &r);
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let bytes = match abi::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
            Ok(b) => b.unwrap_or_default(),
            Err(e) => {
                log(
                    LogLevel::Error,
                    &format!(
                        "kvsteer: configuration refused: the proxy did not hand it over (status {e})"
                    ),
                );
                return false;
            }
        };
        let cfg = match FilterConfig::from_json(&bytes) {
            Ok(c) => c,
            Err(e) => {
                log(
                    LogLevel::Error,
                    &format!("kvsteer: configuration refused: {e}"),
                );
                return false;
            }
        };
        let mut state = match RouterState::new(cfg) {
            Ok(s) => s,
            Err(e) => {
                log(
                    LogLevel::Error,
                    &format!("kvsteer: configuration refused: {e}"),
                );
                return false;
            }
        };
        // Envoy's node id (`--service-node` or the bootstrap's `node.id`; Istio makes it unique per
        // pod): the same in every worker of one proxy, different between proxies, so independent
        // proxies break ties differently. A host without it (nginx) or an empty id keeps `routing.seed`.
        // Envoy names the node `xds.node` (its CEL attributes); older builds and other hosts `node`.
        let node_id = [vec!["xds", "node", "id"], vec!["node", "id"]]
            .into_iter()
            .find_map(|path| abi::get_property(&path).ok().flatten())
            .unwrap_or_default();
        state.set_proxy_identity(&node_id);
        // The P/D requests' ids must not repeat across workers, proxies or restarts: a random nonce
        // (the std hasher's keys come from the host's random source, WASI `random_get`).
        {
            use std::hash::BuildHasher;
            let nonce =
                std::collections::hash_map::RandomState::new().hash_one((now_ns(), &node_id));
            state.set_pd_nonce(nonce);
        }
        let metrics = Metrics::define(state.config());
        state.set_clock(now_ns);
        state.claim_worker_id(host_store(state.config()));
        let tick = Duration::from_millis(state.config().tick_ms);
        log(
            LogLevel::Info,
            &format!(
                "kvsteer: configured {} replicas, policy {}, worker {:?}, node id {:?}",
                state.replicas(),
                state.config().routing.policy.name(),
                state.worker_id(),
                String::from_utf8_lossy(&node_id)
            ),
        );
        for warning in state.config().warnings() {
            log(LogLevel::Warn, &format!("kvsteer: {warning}"));
        }
        self.vm = Some(Rc::new(RefCell::new(Vm {
            state,
            metrics,
            early_held: 0,
        })));
        if let Err(e) = abi::set_tick_period(tick) {
            // Requests are still routed, with what the filter knows without ticks.
            log(
                LogLevel::Error,
                &format!(
                    "kvsteer: the proxy refused a tick period of {} ms (status {e}): feeds are \
                     not polled, load is not shared with other workers, gauges are not updated",
                    tick.as_millis()
                ),
            );
        }
        true
    }

    fn on_tick(&mut self) {
        let Some(vm) = &self.vm else { return };
        let now = now_ms();
        let mut vm = vm.borrow_mut();
        let store = host_store(vm.state.config());
        vm.state.share_load(store, now);
        // This tick's feed budget, spent first on batches earlier ticks left half applied.
        vm.state.start_tick(now);
        Self::poll_feeds(&mut vm, now);
        Self::poll_peers(&mut vm, now);
        Self::update_gauges(&mut vm);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream {
            vm: self.vm.clone(),
            id: context_id as u64,
            ..Stream::default()
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Where a stream is in its life, as far as the router's load table is concerned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum Phase {
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
    vm: Option<Shared>,
    id: u64,
    phase: Phase,
    path: String,
    session: Option<String>,
    sse: Option<SseTracker>,
    /// The replica the filter chose for this request.
    replica: Option<usize>,
    /// The request's outcome was reported for its replica's health (at most once).
    outcome_reported: bool,
    /// The request body's size as buffered: what a rewrite of it replaces.
    body_len: usize,
    /// P/D: the prefill leg in flight (phase `Prefilling`).
    prefill: Option<PrefillLeg>,
    /// The request body as far as it has arrived, read slice by slice while it is buffered
    /// (docs/design/filter.md, "The body as it arrives"); empty when it is read only at the end.
    arrived: Vec<u8>,
    /// The early scan over `arrived`; None when the body is read only once it has all arrived
    /// (`early_body_scan` false, a P/D fleet, the VM's share for held bodies spent, or the host
    /// handed over something inconsistent).
    early: Option<EarlyScan>,
    /// The capacity of `arrived` counted in the VM's `early_held`.
    held: usize,
    /// The decision explained for the configured `explain_header`, written on the response.
    explain: Option<String>,
}

/// A P/D request's prefill leg while its callout is out.
struct PrefillLeg {
    token: u32,
    replica: usize,
    /// Where the decode leg goes once the prefill leg has answered.
    decode: kvsteer_core::router::Decision,
    /// The client's request, rewritten into the decode leg.
    client: serde_json::Map<String, serde_json::Value>,
    request_id: String,
    /// A probe of an ejected prefill replica: where the leg goes if it fails (replica, its cached
    /// prompt tokens, the request to book it with).
    backup: Option<(usize, u64, Box<kvsteer_core::request::RouteRequest>)>,
}

/// The load-table id of a stream's prefill leg: outside the 32-bit context ids the decode leg (and
/// every other request) is booked under.
fn prefill_id(stream: u64) -> u64 {
    stream | 1 << 32
}

/// Replaces the buffered request body, keeping a `content-length` the client sent true.
fn replace_request_body(old_len: usize, body: &[u8]) -> Result<(), u32> {
    abi::set_request_body(old_len, body)?;
    if header(MapType::HttpRequestHeaders, "content-length").is_some() {
        let _ = abi::set_header(
            MapType::HttpRequestHeaders,
            "content-length",
            body.len().to_string().as_bytes(),
        );
    }
    Ok(())
}

impl Stream {
    /// Writes the decision where the proxy will read it.
    fn write_destination(vm: &Vm, d: &kvsteer_core::router::Decision) {
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

    fn record_decision(vm: &mut Vm, d: &kvsteer_core::router::Decision) {
        let m = &vm.metrics;
        inc(m.routed, 1);
        inc(m.decisions.get(d.replica).copied().flatten(), 1);
        if d.fallback.is_some() {
            inc(m.fallbacks, 1);
        }
        inc(m.prompt_tokens, d.prompt_tokens);
        inc(
            m.matched_tokens,
            d.matched_tokens.get(d.replica).copied().unwrap_or(0),
        );
    }

    fn route_fallback(&mut self, why: BodyFallback, body_bytes: usize) {
        let Some(vm) = &self.vm else { return };
        let mut vm = vm.borrow_mut();
        let d = vm.state.route_fallback(self.id, why, body_bytes, now_ms());
        Self::record_decision(&mut vm, &d);
        Self::write_destination(&vm, &d);
        self.replica = Some(d.replica);
        self.phase = Phase::Admitted;
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
        Self::send_error(status, &err);
        Action::Pause
    }

    /// Reads the slice of the body that arrived since the last call (the host's buffer holds
    /// `body_size` bytes so far, from the start) and lets the early scan go on. Anything
    /// inconsistent (a buffer shorter than what was read, a host error, fewer bytes than asked) or
    /// the VM's share for held bodies spent turns the early reading off for this request: the body
    /// is then read whole at the end, as without the scan.
    fn read_arrived(&mut self, body_size: usize) {
        let (Some(vm), Some(_)) = (self.vm.clone(), self.early.as_ref()) else {
            return;
        };
        let have = self.arrived.len();
        if body_size == have {
            return;
        }
        let want = body_size.saturating_sub(have);
        let slice = match abi::get_buffer(BufferType::HttpRequestBody, have, want) {
            Ok(Some(slice)) if body_size > have && slice.len() == want => slice,
            _ => return self.drop_arrived(),
        };
        if have == 0 {
            self.arrived = slice;
        } else {
            self.arrived.extend_from_slice(&slice);
        }
        let capacity = self.arrived.capacity();
        {
            let mut vm = vm.borrow_mut();
            let others = vm.early_held.saturating_sub(self.held);
            if others + capacity > vm.state.config().early_body_scan_max_bytes {
                inc(vm.metrics.early_declined, 1);
                drop(vm);
                return self.drop_arrived();
            }
            vm.early_held = others + capacity;
            self.held = capacity;
        }
        if let Some(scan) = self.early.as_mut() {
            scan.advance(&self.arrived);
        }
    }

    /// Gives up the early reading of this request's body (the body is read whole at the end) and
    /// returns its buffer's share to the VM.
    fn drop_arrived(&mut self) {
        self.early = None;
        self.arrived = Vec::new();
        self.return_held();
    }

    fn return_held(&mut self) {
        if self.held > 0
            && let Some(vm) = &self.vm
            && let Ok(mut vm) = vm.try_borrow_mut()
        {
            vm.early_held = vm.early_held.saturating_sub(self.held);
            self.held = 0;
        }
    }

    /// The whole request body, up to `max` bytes: the rest after what [`Stream::read_arrived`]
    /// read, or all of it from the start.
    fn take_body(&mut self, max: usize) -> Result<Vec<u8>, u32> {
        let mut body = std::mem::take(&mut self.arrived);
        self.return_held();
        if body.is_empty() || self.early.is_none() || max < body.len() {
            self.early = None;
            return abi::get_buffer(BufferType::HttpRequestBody, 0, max)
                .map(Option::unwrap_or_default);
        }
        if let Some(rest) =
            abi::get_buffer(BufferType::HttpRequestBody, body.len(), max - body.len())?
        {
            body.extend_from_slice(&rest);
        }
        Ok(body)
    }

    /// Reads the whole buffered request body (at most `max` bytes asked for), routes the request by
    /// it and admits it; every way the body cannot be read is routed by load instead (refused in a
    /// P/D fleet, [`Stream::refuse_unread_pd`]). In a P/D fleet
    /// the request is split into its two legs ([`Stream::route_pd`]) and may be held (`Pause`).
    fn route_buffered(&mut self, max: usize) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let limit = vm.borrow().state.max_body_bytes();
        let pd = vm.borrow().state.disaggregated();
        let body = match self.take_body(max) {
            Ok(b) => b,
            Err(_) if pd => {
                return self.refuse_unread_pd(500, "the proxy did not hand over the request body");
            }
            Err(_) => {
                self.route_fallback(BodyFallback::HostError, max.min(limit));
                return Action::Continue;
            }
        };
        if body.is_empty() {
            self.route_fallback(BodyFallback::Empty, 0);
            return Action::Continue;
        }
        if body.len() > limit {
            if pd {
                return self.refuse_unread_pd(
                    413,
                    &format!("the request body is over routing.max_body_bytes ({limit})"),
                );
            }
            self.route_fallback(BodyFallback::TooLarge, body.len());
            return Action::Continue;
        }
        self.body_len = body.len();
        if vm.borrow().state.disaggregated() {
            return self.route_pd(&body);
        }
        let mut vm = vm.borrow_mut();
        let now = now_ms();
        let store = vm.state.shared(host_store(vm.state.config()));
        vm.state.claim_probe(store, now);
        if self.early.as_ref().is_some_and(|s| s.tokens() > 0) {
            inc(vm.metrics.early_bodies, 1);
        }
        let d = vm.state.route_body_early(
            self.id,
            &self.path,
            &body,
            self.session.as_deref(),
            self.early.take(),
            now,
        );
        Self::record_decision(&mut vm, &d);
        Self::write_destination(&vm, &d);
        self.explain = vm.state.explanation(d.replica);
        self.replica = Some(d.replica);
        self.phase = Phase::Admitted;
        Action::Continue
    }

    /// A P/D request (docs/design/pd.md): books both legs and sends the prefill leg as a callout, holding
    /// the request until it answers ([`Stream::on_prefill_answer`]); a body that cannot be split goes
    /// whole to a decode replica; with no prefill replica up the client gets a 503.
    fn route_pd(&mut self, body: &[u8]) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let mut vm = vm.borrow_mut();
        let vm = &mut *vm;
        let now = now_ms();
        let store = vm.state.shared(host_store(vm.state.config()));
        vm.state.claim_probe(store, now);
        let route = vm.state.route_pd(
            prefill_id(self.id),
            self.id,
            &self.path,
            body,
            self.session.as_deref(),
            now,
        );
        match route {
            PdRoute::Whole { decision, body } => {
                inc(vm.metrics.pd_whole, 1);
                Self::record_decision(vm, &decision);
                Self::write_destination(vm, &decision);
                if let Some(b) = body
                    && replace_request_body(self.body_len, &b).is_err()
                {
                    log(
                        LogLevel::Warn,
                        "kvsteer: could not drop a client's kv_transfer_params",
                    );
                }
                self.replica = Some(decision.replica);
                self.phase = Phase::Admitted;
                Action::Continue
            }
            PdRoute::Unavailable { replica, why } => {
                inc(vm.metrics.pd_unavailable, 1);
                let name =
                    replica.map_or("any replica that prefills", |r| vm.state.replica_name(r));
                log(
                    LogLevel::Warn,
                    &format!("kvsteer: P/D request refused: {name} {why}"),
                );
                let err = pd::error_body(503, "prefill", name, &why);
                self.phase = Phase::Released;
                Self::send_error(503, &err);
                Action::Pause
            }
            PdRoute::Legs {
                prefill,
                decode,
                client,
                prefill_body,
                prefill_matched_tokens,
                prefill_backup,
            } => {
                let m = &vm.metrics;
                inc(m.pd_split, 1);
                inc(m.routed, 1);
                inc(m.decisions.get(decode.replica).copied().flatten(), 1);
                inc(m.prompt_tokens, decode.prompt_tokens);
                inc(m.matched_tokens, prefill_matched_tokens);
                let request_id = vm.state.next_pd_request_id();
                let sent = Self::send_prefill(vm, prefill, &self.path, &prefill_body, &request_id);
                match sent {
                    Ok(token) => {
                        self.prefill = Some(PrefillLeg {
                            token,
                            replica: prefill,
                            decode,
                            client,
                            request_id,
                            backup: prefill_backup,
                        });
                        self.phase = Phase::Prefilling;
                    }
                    Err(why) => {
                        vm.state.release(prefill_id(self.id));
                        vm.state.release(self.id);
                        inc(vm.metrics.pd_prefill_failures, 1);
                        let name = vm.state.replica_name(prefill);
                        log(
                            LogLevel::Warn,
                            &format!("kvsteer: the prefill leg on {name} {why}"),
                        );
                        self.phase = Phase::Released;
                        Self::send_error(502, &pd::error_body(502, "prefill", name, &why));
                    }
                }
                Action::Pause
            }
        }
    }

    /// Sends a prefill leg to `prefill`'s cluster: the callout's token, or why it could not be sent.
    fn send_prefill(
        vm: &Vm,
        prefill: usize,
        path: &str,
        body: &[u8],
        request_id: &str,
    ) -> Result<u32, String> {
        let cfg = vm.state.config();
        let length = body.len().to_string();
        let auth = header(MapType::HttpRequestHeaders, "authorization")
            .and_then(|v| String::from_utf8(v).ok());
        let mut headers = vec![
            (":method", "POST"),
            (":path", path),
            (":authority", cfg.prefill_authority(prefill)),
            ("content-type", "application/json"),
            ("content-length", length.as_str()),
            ("x-request-id", request_id),
        ];
        if let Some(rank) = vm.state.rank_of_unit(prefill) {
            headers.push((vm.state.rank_header(), rank));
        }
        // An engine behind an API key wants the client's key on both legs.
        if let Some(a) = auth.as_deref() {
            headers.push(("authorization", a));
        }
        let timeout = Duration::from_millis(cfg.pd.prefill_timeout_ms);
        abi::dispatch_http_call(cfg.prefill_upstream(prefill), headers, Some(body), timeout)
            .map_err(|status| LegFailure::NotSent(format!("{status:?}")).to_string())
    }

    /// The prefill leg's answer (or its failure): on success the client's request becomes the decode
    /// leg (body rewritten with the answer's `kv_transfer_params`, destination written) and goes on;
    /// on failure the client gets a 502 naming the leg. Either way the prefill leg's booking ends
    /// here, and on failure the decode leg's too.
    fn on_prefill_answer(&mut self, leg: PrefillLeg, num_headers: usize, body_size: usize) {
        let Some(vm) = self.vm.clone() else { return };
        let status = if num_headers == 0 {
            None
        } else {
            header(MapType::HttpCallResponseHeaders, ":status")
                .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok())
        };
        let max = vm.borrow().state.config().pd.max_prefill_response_bytes;
        let answer = pd::read_prefill_answer(status, body_size, max, || {
            abi::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
        });
        let mut vm = vm.borrow_mut();
        let vm = &mut *vm;
        let now = now_ms();
        let replica_failed = matches!(
            answer,
            Err(LegFailure::NoAnswer | LegFailure::Status(500..))
        );
        if replica_failed && let Some((backup, matched, req)) = leg.backup.as_ref() {
            // A prefill leg that fails where Envoy's retry policy would retry a plain request (5xx,
            // no answer) goes once more, to its side's backup (for a failed health probe, the
            // side's own choice), under the same request id; the failure counts against the
            // replica's health as any other.
            vm.state
                .request_outcome(leg.replica, None, Outcome::Failure, now);
            inc(vm.metrics.pd_prefill_retries, 1);
            let name = vm.state.replica_name(leg.replica);
            let why = answer.as_ref().err().map(ToString::to_string);
            log(
                LogLevel::Info,
                &format!(
                    "kvsteer: the prefill leg on {name} {}; sent on to {}",
                    why.unwrap_or_default(),
                    vm.state.replica_name(*backup)
                ),
            );
            vm.state
                .rebook_prefill(prefill_id(self.id), req, *backup, *matched, now);
            let body = pd::prefill_body(&leg.client);
            match Self::send_prefill(vm, *backup, &self.path, &body, &leg.request_id) {
                Ok(token) => {
                    self.prefill = Some(PrefillLeg {
                        token,
                        replica: *backup,
                        backup: None,
                        ..leg
                    });
                    return;
                }
                Err(why) => {
                    vm.state.release(prefill_id(self.id));
                    vm.state.release(self.id);
                    inc(vm.metrics.pd_prefill_failures, 1);
                    let name = vm.state.replica_name(*backup);
                    self.phase = Phase::Released;
                    Self::send_error(502, &pd::error_body(502, "prefill", name, &why));
                    return;
                }
            }
        }
        vm.state.release(prefill_id(self.id));
        let params = match answer {
            Ok(a) => {
                vm.state
                    .request_outcome(leg.replica, None, Outcome::Success, now);
                match a {
                    PrefillAnswer::Params(p) => Some(p),
                    PrefillAnswer::Plain => {
                        inc(vm.metrics.pd_plain_decodes, 1);
                        None
                    }
                }
            }
            Err(f) => {
                if replica_failed {
                    // The prefill replica (or the proxy on its behalf) failed it.
                    vm.state
                        .request_outcome(leg.replica, None, Outcome::Failure, now);
                }
                vm.state.release(self.id);
                inc(vm.metrics.pd_prefill_failures, 1);
                let name = vm.state.replica_name(leg.replica);
                let why = f.to_string();
                log(
                    LogLevel::Warn,
                    &format!("kvsteer: the prefill leg on {name} {why}"),
                );
                self.phase = Phase::Released;
                Self::send_error(502, &pd::error_body(502, "prefill", name, &why));
                return;
            }
        };
        let body = pd::decode_body(leg.client, params);
        if replace_request_body(self.body_len, &body).is_err() {
            vm.state.release(self.id);
            inc(vm.metrics.pd_prefill_failures, 1);
            self.phase = Phase::Released;
            let why = "could not be handed to the decode leg (the proxy refused the body)";
            Self::send_error(
                502,
                &pd::error_body(
                    502,
                    "decode",
                    vm.state.replica_name(leg.decode.replica),
                    why,
                ),
            );
            return;
        }
        let _ = abi::set_header(
            MapType::HttpRequestHeaders,
            "x-request-id",
            leg.request_id.as_bytes(),
        );
        Self::write_destination(vm, &leg.decode);
        self.replica = Some(leg.decode.replica);
        self.phase = Phase::Admitted;
        if abi::resume_request().is_err() {
            log(
                LogLevel::Warn,
                "kvsteer: the proxy refused to resume a request",
            );
        }
    }

    /// Answers the client with a JSON error in place of the upstream.
    /// Answers a request for the reserved peer path itself ([`crate::exchange`]): served to a peer
    /// proxy with the token, refused otherwise, never forwarded.
    fn serve_peer(&mut self, vm: &Shared, method: &[u8], path: &[u8]) -> Action {
        let mut vm = vm.borrow_mut();
        let token = header(MapType::HttpRequestHeaders, vm.state.peer_token_header());
        let store = host_store(vm.state.config());
        let r = vm
            .state
            .serve_peer(store, method, path, token.as_deref(), now_ms());
        self.phase = Phase::Released;
        let ct = if r.status == 200 {
            crate::exchange::BUNDLE_CONTENT_TYPE
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

    fn send_error(status: u32, body: &[u8]) {
        if abi::send_local_response(status, &[("content-type", "application/json")], body).is_err()
        {
            log(
                LogLevel::Warn,
                "kvsteer: the proxy refused a local response",
            );
        }
    }

    /// Reports how the request ended for its replica's health, once: the replica the proxy says
    /// answered (`upstream.address`, Envoy) tells a retry elsewhere from the first choice's answer.
    fn report_outcome(&mut self, outcome: Outcome) {
        if self.outcome_reported {
            return;
        }
        let (Some(replica), Some(vm)) = (self.replica, self.vm.as_ref()) else {
            return;
        };
        self.outcome_reported = true;
        let served = abi::get_property(&["upstream", "address"]).ok().flatten();
        vm.borrow_mut()
            .state
            .request_outcome(replica, served.as_deref(), outcome, now_ms());
    }

    fn release(&mut self) {
        if matches!(
            self.phase,
            Phase::Admitted | Phase::Decoding | Phase::Prefilling
        ) && let Some(vm) = &self.vm
        {
            let mut vm = vm.borrow_mut();
            vm.state.release(self.id);
            if self.phase == Phase::Prefilling {
                // The client left while the prefill leg was out: its answer will find no stream.
                vm.state.release(prefill_id(self.id));
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
        // A stream that ends before its body has (a client gone mid-upload) gives back its share.
        self.drop_arrived();
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
        {
            // Clients must never choose a replica: drop any copy of the routing header they sent,
            // on every request, routed or not. (The header names are borrowed from the VM's
            // configuration; host calls never re-enter the VM, so the borrow is safe across them.)
            let mut vm = vm.borrow_mut();
            let vm = &mut *vm;
            // The rank header too: a client must not pick a DP rank either.
            let mut removed = 0;
            let mut stuck = None;
            let map = MapType::HttpRequestHeaders;
            for name in [vm.state.routing_header(), vm.state.rank_header()] {
                let present = abi::get_header(map, name);
                if matches!(present, Ok(None)) {
                    continue;
                }
                // Present, or the host would not say: remove it either way.
                match abi::remove_header(map, name) {
                    Ok(()) => removed += present.is_ok() as usize,
                    Err(e) => stuck = Some((name.to_string(), e)),
                }
            }
            for _ in 0..removed {
                vm.state.spoofed_header_removed();
                inc(vm.metrics.spoofed, 1);
            }
            if let Some((name, e)) = stuck {
                // A client's copy that cannot be removed must not reach the proxy's balancer.
                log(
                    LogLevel::Warn,
                    &format!(
                        "kvsteer: could not remove the client's {name} header (status {e}); request refused"
                    ),
                );
                return self.refuse(
                    500,
                    "internal_error",
                    &format!("kvsteer: the request's {name} header could not be removed"),
                );
            }
        }
        let method = header(MapType::HttpRequestHeaders, ":method").unwrap_or_default();
        let path = header(MapType::HttpRequestHeaders, ":path").unwrap_or_default();
        if vm.borrow().state.is_peer_path(&path) {
            return self.serve_peer(&vm, &method, &path);
        }
        if method != b"POST" || !is_inference_path(&path) {
            return Action::Continue;
        }
        self.path = String::from_utf8_lossy(&path).into_owned();
        self.session = header(
            MapType::HttpRequestHeaders,
            vm.borrow().state.session_header(),
        )
        .filter(|v| !v.is_empty() && v.len() <= 512)
        .map(|v| String::from_utf8_lossy(&v).into_owned());
        if end_of_stream {
            self.route_fallback(BodyFallback::Empty, 0);
            return Action::Continue;
        }
        self.phase = Phase::Buffering;
        self.early = vm.borrow().state.early_scan(&self.path);
        if vm.borrow().state.config().output == OutputMode::NginxVariable {
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
        let limit = vm.borrow().state.max_body_bytes();
        if body_size > limit {
            if vm.borrow().state.disaggregated() {
                return self.refuse_unread_pd(
                    413,
                    &format!("the request body is over routing.max_body_bytes ({limit})"),
                );
            }
            // Stop buffering a body we will not read; route it by load and let it flow.
            self.drop_arrived();
            self.route_fallback(BodyFallback::TooLarge, body_size);
            return Action::Continue;
        }
        if !end_of_stream {
            // The rest of the body, or trailers (HTTP/2, gRPC-style clients), end the request.
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
        let limit = vm.borrow().state.max_body_bytes();
        self.route_buffered(limit.saturating_add(1))
    }
    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if let (Some(text), Some(vm)) = (self.explain.take(), self.vm.as_ref())
            && let Some(name) = vm.borrow().state.config().explain_header.clone()
        {
            let _ = abi::set_header(MapType::HttpResponseHeaders, &name, text.as_bytes());
        }
        if !matches!(self.phase, Phase::Admitted | Phase::Decoding) {
            return Action::Continue;
        }
        let status = header(MapType::HttpResponseHeaders, ":status")
            .and_then(|s| std::str::from_utf8(&s).ok()?.parse::<u16>().ok())
            .unwrap_or(0);
        if status >= 500 {
            // The replica (or the proxy on its behalf: refused, reset, timed out) failed it.
            self.report_outcome(Outcome::Failure);
        }
        if !(200..300).contains(&status) || end_of_stream {
            if (200..300).contains(&status) {
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
                    vm.state.first_token(self.id, now_ms());
                    self.phase = Phase::Decoding;
                }
                vm.state.decode_progress(self.id, tracker.generated());
            }
        }
        if engine_error {
            // An engine error inside a 200 stream (vLLM's `data: {"error": ...}`).
            self.report_outcome(Outcome::Failure);
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
