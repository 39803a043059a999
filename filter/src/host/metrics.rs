//! The filter's metrics: defined once per VM at configure time, counted as requests are routed and
//! feeds answered, and brought up to date with the router's own counters on every tick. A host
//! without metrics leaves every id `None`, and nothing is counted.

use crate::config::FilterConfig;
use crate::host::abi;
use crate::worker::{FeedFailure, WorkerState};
use kvsteer_core::router::Decision;
use proxy_wasm::types::MetricType;

thread_local! {
    /// While one pool's metrics are being defined (`pools`), its name: every metric it defines is
    /// named `kvsteer_pool_<pool>_...` instead of `kvsteer_...`. Proxy-wasm metrics have no
    /// labels, and pool names hold no `_`, so one stats-tag rule turns the pool into a label.
    static POOL: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

fn define(kind: MetricType, name: &str) -> Option<u32> {
    POOL.with_borrow(|pool| match (pool, name.strip_prefix("kvsteer_")) {
        (Some(p), Some(rest)) => abi::define_metric(kind, &format!("kvsteer_pool_{p}_{rest}")).ok(),
        _ => abi::define_metric(kind, name).ok(),
    })
}

/// A gateway counter, defined outside any pool (`kvsteer_models_unknown`, ...).
pub(super) fn gateway_counter(name: &str) -> Option<u32> {
    define(MetricType::Counter, name)
}

pub(super) fn inc(id: Option<u32>, by: u64) {
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

/// The id of a per-replica metric, `None` for a replica out of range.
fn of(ids: &[Option<u32>], replica: usize) -> Option<u32> {
    ids.get(replica).copied().flatten()
}

/// A counter that mirrors a running total kept elsewhere (the router's, the exchange's, the ABI's):
/// each update adds what the total gained since the last one, so the host's counter and the total
/// agree without the filter counting anything twice.
#[derive(Default)]
struct TotalCounter {
    id: Option<u32>,
    last: u64,
}

impl TotalCounter {
    fn define(name: &str) -> TotalCounter {
        TotalCounter {
            id: define(MetricType::Counter, name),
            last: 0,
        }
    }

    /// Brings the counter up to `total`.
    fn update(&mut self, total: u64) {
        inc(self.id, total.saturating_sub(self.last));
        self.last = total;
    }
}

/// Metric ids, defined once per VM at configure time. A host without metrics leaves them `None`.
pub(super) struct Metrics {
    decisions: Vec<Option<u32>>,
    feed_errors: Vec<Option<u32>>,
    feed_timeouts: Vec<Option<u32>>,
    feed_oversized: Vec<Option<u32>>,
    feed_stale: Vec<Option<u32>>,
    feed_pending_blocks: Option<u32>,
    feed_time_cuts: TotalCounter,
    down: Vec<Option<u32>>,
    upstream_failures: Vec<TotalCounter>,
    ejected: Vec<Option<u32>>,
    /// The working-set term's view per replica (docs/design/design.md section 2.6): its recent working set
    /// and its cache size, in blocks (0: no replica has shown one yet, the term is off).
    working_set_blocks: Vec<Option<u32>>,
    cache_size_blocks: Vec<Option<u32>>,
    /// `kv_time`: each replica's observed against predicted time to first token, in thousandths.
    speed_milli: Vec<Option<u32>>,
    /// Other workers' working-set entries missed (and other proxies' too, [`crate::worker::exchange`]) and
    /// journals refused.
    working_set_missed: TotalCounter,
    working_set_refused: TotalCounter,
    /// Other workers' text-prompt records (the approximate text identity) applied, missed and
    /// refused ([`crate::worker::share::TextSharing`]).
    text_records_applied: TotalCounter,
    text_records_missed: TotalCounter,
    text_records_refused: TotalCounter,
    /// The working-set exchange with other proxies ([`crate::worker::exchange`]).
    peer_polls: TotalCounter,
    peer_poll_failures: TotalCounter,
    peer_answers_refused: TotalCounter,
    peer_entries_applied: TotalCounter,
    peer_requests_refused: TotalCounter,
    peer_requests_served: TotalCounter,
    health_probes: Vec<TotalCounter>,
    pub(super) routed: Option<u32>,
    fallbacks: Option<u32>,
    pub(super) matched_tokens: Option<u32>,
    pub(super) prompt_tokens: Option<u32>,
    pub(super) spoofed: Option<u32>,
    /// Failed answers held against no replica (the proxy's own, or an oversized body's).
    pub(super) failures_not_blamed: Option<u32>,
    feed_rank_mismatches: Option<u32>,
    index_blocks: Option<u32>,
    index_evictions: TotalCounter,
    release_anomalies: TotalCounter,
    feed_resets: TotalCounter,
    /// P/D (docs/design/pd.md): requests split into two legs, prefill legs that failed (502), requests
    /// with no prefill replica up (503), decode legs sent without `kv_transfer_params` (the prefill
    /// answer had none), requests sent whole to a decode replica (body not splittable), and
    /// prefill legs sent on to their side's backup after a failure.
    pub(super) pd_split: Option<u32>,
    pub(super) pd_prefill_failures: Option<u32>,
    pub(super) pd_unavailable: Option<u32>,
    pub(super) pd_plain_decodes: Option<u32>,
    pub(super) pd_whole: Option<u32>,
    pub(super) pd_prefill_retries: Option<u32>,
    pub(super) early_declined: Option<u32>,
    pub(super) early_bodies: Option<u32>,
    pub(super) body_hold_fallbacks: Option<u32>,
    bookings: TotalCounter,
    releases: TotalCounter,
    /// Priority classes (`routing.admission`; defined only with the section), in
    /// [`kvsteer_core::admission::Class::ALL`] order: requests admitted, requests shed (answered
    /// 429), and client copies of an untrusted priority header removed.
    /// Mirrored from the worker's totals on each tick. `None` without the section.
    admission: Option<([TotalCounter; 3], [TotalCounter; 3], TotalCounter)>,
    /// Host calls the proxy refused ([`abi`]: each has a fallback; docs/design/filter.md).
    host_call_refusals: TotalCounter,
    #[cfg(feature = "tokenizer")]
    tokenizer: Option<TokenizerMetrics>,
    /// Membership at run time (defined only with a `discovery` section).
    discovery: Option<DiscoveryMetrics>,
}

/// The discovery source's counters (docs/design/discovery.md), mirrored from the worker's totals.
struct DiscoveryMetrics {
    polls: TotalCounter,
    poll_failures: TotalCounter,
    updates: TotalCounter,
    /// By [`crate::worker::discovery::roster::Refusal::KINDS`].
    refused: Vec<TotalCounter>,
    joined: TotalCounter,
    left: TotalCounter,
    vacated: TotalCounter,
    dropped_bookings: TotalCounter,
    members: Option<u32>,
}

impl DiscoveryMetrics {
    fn define() -> DiscoveryMetrics {
        let c = |what: &str| TotalCounter::define(&format!("kvsteer_discovery_{what}"));
        DiscoveryMetrics {
            polls: c("polls"),
            poll_failures: c("poll_failures"),
            updates: c("updates"),
            refused: crate::worker::discovery::roster::Refusal::KINDS
                .iter()
                .map(|k| c(&format!("refused_{k}")))
                .collect(),
            joined: c("joined"),
            left: c("left"),
            vacated: c("vacated"),
            dropped_bookings: c("dropped_bookings"),
            members: define(MetricType::Gauge, "kvsteer_discovery_members"),
        }
    }

    fn update(&mut self, state: &WorkerState) {
        let d = state.discovery();
        self.polls.update(d.polls);
        self.poll_failures.update(d.failures);
        self.updates.update(d.updates);
        for (c, &n) in self.refused.iter_mut().zip(&d.refused) {
            c.update(n);
        }
        self.joined.update(d.joined);
        self.left.update(d.left);
        self.vacated.update(d.vacated);
        self.dropped_bookings.update(d.dropped_bookings);
        gauge(self.members, d.roster.listed() as u64);
    }
}

/// Tokenizer counters (defined only when a tokenizer is configured).
#[cfg(feature = "tokenizer")]
struct TokenizerMetrics {
    exact: TotalCounter,
    fallbacks: Vec<TotalCounter>,
    cache_hits: TotalCounter,
    cache_misses: TotalCounter,
    cache_tokens: Option<u32>,
    /// 1 once text prompts are tokenized (at once with inline files; a fetched bundle once loaded).
    ready: Option<u32>,
    bundle_refused: TotalCounter,
    bundle_fetch_failures: TotalCounter,
}

#[cfg(feature = "tokenizer")]
impl TokenizerMetrics {
    fn define() -> TokenizerMetrics {
        TokenizerMetrics {
            exact: TotalCounter::define("kvsteer_tokenizer_exact"),
            fallbacks: kvsteer_tokenizer::FallbackReason::ALL
                .iter()
                .map(|r| TotalCounter::define(&format!("kvsteer_tokenizer_fallback_{}", r.name())))
                .collect(),
            cache_hits: TotalCounter::define("kvsteer_tokenizer_cache_hits"),
            cache_misses: TotalCounter::define("kvsteer_tokenizer_cache_misses"),
            cache_tokens: define(MetricType::Gauge, "kvsteer_tokenizer_cache_tokens"),
            ready: define(MetricType::Gauge, "kvsteer_tokenizer_ready"),
            bundle_refused: TotalCounter::define("kvsteer_tokenizer_bundle_refused"),
            bundle_fetch_failures: TotalCounter::define("kvsteer_tokenizer_bundle_fetch_failures"),
        }
    }

    /// Readiness and the bundle fetch's counters, brought up to date every tick.
    fn update_bundle(&mut self, state: &WorkerState) {
        gauge(self.ready, u64::from(state.tokenizer_ready()));
        if let Some((_, refused, failed)) = state.bundle_fetch_counts() {
            self.bundle_refused.update(refused);
            self.bundle_fetch_failures.update(failed);
        }
    }

    fn update(&mut self, now: kvsteer_tokenizer::TokenizerStats) {
        self.exact.update(now.exact);
        for (c, &n) in self.fallbacks.iter_mut().zip(&now.fallbacks) {
            c.update(n);
        }
        self.cache_hits.update(now.cache_hits);
        self.cache_misses.update(now.cache_misses);
        gauge(self.cache_tokens, now.cache_tokens);
    }
}

impl Metrics {
    /// The metrics of one pool: named as always without `pools`, `kvsteer_pool_<pool>_...` in a
    /// named pool.
    pub(super) fn define(cfg: &FilterConfig, pool: Option<&str>) -> Metrics {
        POOL.set(pool.map(str::to_owned));
        let m = Self::define_all(cfg);
        POOL.set(None);
        m
    }

    fn define_all(cfg: &FilterConfig) -> Metrics {
        // Kept whole: one definition per metric, a flat list.
        use MetricType::{Counter, Gauge};
        let policy = cfg.routing.policy.name();
        let per = |kind, what: &str| -> Vec<Option<u32>> {
            cfg.units
                .iter()
                .map(|r| define(kind, &format!("kvsteer_{what}_{}", r.name)))
                .collect()
        };
        let per_total = |what: &str| -> Vec<TotalCounter> {
            cfg.units
                .iter()
                .map(|r| TotalCounter::define(&format!("kvsteer_{what}_{}", r.name)))
                .collect()
        };
        let per_class = |what: &str| {
            kvsteer_core::admission::Class::ALL
                .map(|c| TotalCounter::define(&format!("kvsteer_{what}_{}", c.name())))
        };
        Metrics {
            discovery: cfg.discovery.as_ref().map(|_| DiscoveryMetrics::define()),
            admission: cfg.routing.admission.as_ref().map(|_| {
                (
                    per_class("admitted"),
                    per_class("shed"),
                    TotalCounter::define("kvsteer_priority_headers_removed"),
                )
            }),
            decisions: cfg
                .units
                .iter()
                .map(|r| define(Counter, &format!("kvsteer_decisions_{policy}_{}", r.name)))
                .collect(),
            feed_errors: per(Counter, "feed_errors"),
            feed_timeouts: per(Counter, "feed_timeouts"),
            feed_oversized: per(Counter, "feed_oversized"),
            feed_stale: per(Gauge, "feed_stale"),
            feed_pending_blocks: define(Gauge, "kvsteer_feed_pending_blocks"),
            feed_time_cuts: TotalCounter::define("kvsteer_feed_apply_time_cuts"),
            down: per(Gauge, "down"),
            upstream_failures: per_total("upstream_failures"),
            ejected: per(Gauge, "ejected"),
            working_set_blocks: per(Gauge, "working_set_blocks"),
            cache_size_blocks: per(Gauge, "cache_size_blocks"),
            speed_milli: per(Gauge, "ttft_observed_per_predicted_milli"),
            health_probes: per_total("health_probes"),
            routed: define(Counter, "kvsteer_requests_routed"),
            fallbacks: define(Counter, "kvsteer_fallbacks"),
            matched_tokens: define(Counter, "kvsteer_matched_tokens"),
            prompt_tokens: define(Counter, "kvsteer_prompt_tokens"),
            spoofed: define(Counter, "kvsteer_spoofed_headers_removed"),
            failures_not_blamed: define(Counter, "kvsteer_failures_not_blamed"),
            feed_rank_mismatches: define(Counter, "kvsteer_feed_rank_mismatches"),
            working_set_missed: TotalCounter::define("kvsteer_working_set_missed"),
            working_set_refused: TotalCounter::define("kvsteer_working_set_refused"),
            text_records_applied: TotalCounter::define("kvsteer_text_records_applied"),
            text_records_missed: TotalCounter::define("kvsteer_text_records_missed"),
            text_records_refused: TotalCounter::define("kvsteer_text_records_refused"),
            peer_polls: TotalCounter::define("kvsteer_peer_polls"),
            peer_poll_failures: TotalCounter::define("kvsteer_peer_poll_failures"),
            peer_answers_refused: TotalCounter::define("kvsteer_peer_answers_refused"),
            peer_entries_applied: TotalCounter::define("kvsteer_peer_entries_applied"),
            peer_requests_refused: TotalCounter::define("kvsteer_peer_requests_refused"),
            peer_requests_served: TotalCounter::define("kvsteer_peer_requests_served"),
            index_blocks: define(Gauge, "kvsteer_index_blocks"),
            index_evictions: TotalCounter::define("kvsteer_index_evictions"),
            release_anomalies: TotalCounter::define("kvsteer_release_anomalies"),
            feed_resets: TotalCounter::define("kvsteer_feed_resets"),
            pd_split: define(Counter, "kvsteer_pd_requests"),
            pd_prefill_failures: define(Counter, "kvsteer_pd_prefill_failures"),
            pd_unavailable: define(Counter, "kvsteer_pd_unavailable"),
            pd_plain_decodes: define(Counter, "kvsteer_pd_plain_decodes"),
            pd_whole: define(Counter, "kvsteer_pd_whole_requests"),
            pd_prefill_retries: define(Counter, "kvsteer_pd_prefill_retries"),
            early_declined: define(Counter, "kvsteer_early_scan_declined"),
            early_bodies: define(Counter, "kvsteer_early_scan_bodies"),
            body_hold_fallbacks: define(Counter, "kvsteer_body_hold_fallbacks"),
            bookings: TotalCounter::define("kvsteer_bookings"),
            releases: TotalCounter::define("kvsteer_releases"),
            host_call_refusals: TotalCounter::define("kvsteer_host_call_refusals"),
            #[cfg(feature = "tokenizer")]
            tokenizer: cfg.tokenizer.as_ref().map(|_| TokenizerMetrics::define()),
        }
    }

    /// A request routed by `d`.
    pub(super) fn decision(&self, d: &Decision) {
        inc(self.routed, 1);
        inc(of(&self.decisions, d.replica), 1);
        if d.fallback.is_some() {
            inc(self.fallbacks, 1);
        }
        inc(self.prompt_tokens, d.prompt_tokens);
        inc(
            self.matched_tokens,
            d.matched_tokens.get(d.replica).copied().unwrap_or(0),
        );
    }

    /// A P/D request split into two legs: counted as routed to its decode replica, with the tokens
    /// its prefill replica holds as matched.
    pub(super) fn split(&self, decode: &Decision, prefill_matched_tokens: u64) {
        inc(self.pd_split, 1);
        inc(self.routed, 1);
        inc(of(&self.decisions, decode.replica), 1);
        inc(self.prompt_tokens, decode.prompt_tokens);
        inc(self.matched_tokens, prefill_matched_tokens);
    }

    /// A feed poll of `replica` that failed.
    pub(super) fn feed_failed(&self, replica: usize, cause: FeedFailure) {
        inc(of(&self.feed_errors, replica), 1);
        match cause {
            FeedFailure::Slow => inc(of(&self.feed_timeouts, replica), 1),
            FeedFailure::Oversized => inc(of(&self.feed_oversized, replica), 1),
            FeedFailure::WrongRank { .. } => inc(self.feed_rank_mismatches, 1),
            _ => {}
        }
    }

    /// The gauges as they stand and the counters the router keeps, brought up to date (each tick).
    pub(super) fn update(&mut self, state: &WorkerState) {
        let stats = state.stats();
        gauge(self.index_blocks, stats.index_blocks);
        gauge(self.feed_pending_blocks, state.pending_blocks());
        self.index_evictions.update(stats.index_evictions);
        self.release_anomalies.update(stats.release_anomalies);
        self.feed_resets.update(stats.feed_resets);
        let (booked, released) = state.bookings();
        self.bookings.update(booked);
        self.releases.update(released);
        self.host_call_refusals.update(abi::refusals());
        if let Some((admitted, shed, removed)) = self.admission.as_mut() {
            let (a, s, r) = state.admission_counts();
            for (c, n) in admitted.iter_mut().zip(a) {
                c.update(n);
            }
            for (c, n) in shed.iter_mut().zip(s) {
                c.update(n);
            }
            removed.update(r);
        }
        self.feed_time_cuts.update(state.feed_time_cuts());
        let (missed, refused) = state.working_set_sharing();
        let x = state.exchange_stats();
        // Entries missed from this proxy's other workers and from other proxies, in one counter.
        self.working_set_missed
            .update(missed.saturating_add(x.missed));
        self.working_set_refused.update(refused);
        let text = state.text_sharing();
        self.text_records_applied.update(text.applied);
        self.text_records_missed.update(text.missed);
        self.text_records_refused.update(text.refused);
        self.peer_polls.update(x.polls);
        self.peer_poll_failures.update(x.failed);
        self.peer_answers_refused.update(x.refused);
        self.peer_entries_applied.update(x.applied);
        self.peer_requests_refused.update(x.requests_refused);
        self.peer_requests_served.update(x.served);
        #[cfg(feature = "tokenizer")]
        if let Some(tm) = self.tokenizer.as_mut() {
            tm.update_bundle(state);
            if let Some(t) = state.tokenizer_stats() {
                tm.update(t);
            }
        }
        if let Some(d) = self.discovery.as_mut() {
            d.update(state);
        }
        self.update_replicas(state);
    }

    fn update_replicas(&mut self, state: &WorkerState) {
        for i in 0..state.replicas() {
            gauge(of(&self.feed_stale, i), state.is_stale(i) as u64);
            gauge(of(&self.down, i), state.is_down(i) as u64);
            gauge(of(&self.ejected, i), state.is_ejected(i) as u64);
            let (ws, cap) = state.working_set(i);
            // Only a VM that routes applies the other workers' admissions (`share_load`); one that
            // has routed nothing (Envoy's main thread, an idle worker) knows part of the working set
            // and must not overwrite the stat the routing workers write.
            if state.has_routed() {
                gauge(of(&self.working_set_blocks, i), ws as u64);
            }
            gauge(of(&self.cache_size_blocks, i), cap as u64);
            if state.has_routed() {
                let speed = state.speed_factor(i);
                gauge(of(&self.speed_milli, i), (speed * 1e3) as u64);
            }
        }
        let health = state.health();
        for (c, &f) in self.upstream_failures.iter_mut().zip(health.failures()) {
            c.update(f);
        }
        for (c, &p) in self.health_probes.iter_mut().zip(health.probes()) {
            c.update(p);
        }
    }
}
