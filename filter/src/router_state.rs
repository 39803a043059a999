//! One VM's routing state ([`RouterState`]), free of host calls so it can be tested natively: the
//! router, the feed pollers' state machine (with the lease and relay), the load shared with the other
//! workers, and the per-request bookkeeping the stream contexts drive. The proxy-wasm contexts call its
//! methods, one per thing that happened or is to be done, and only move bytes to and from the host.

use crate::config::{ConfigError, FilterConfig, OutputMode};
use crate::exchange::{Exchange, ExchangeStats, PeerCall, PeerResponse};
use crate::relay;
use crate::store::SharedStore;
use crate::workers;
use kvsteer_core::feed::FeedFrame;
use kvsteer_core::health::{Health, Outcome};
use kvsteer_core::pd::{PdParams, Role};
use kvsteer_core::request::{EarlyScan, PromptTokenizer, RouteRequest};
use kvsteer_core::router::{Decision, FeedOutcome, Router, RouterStats};
#[cfg(feature = "tokenizer")]
use kvsteer_tokenizer::TextTokenizer;
use std::borrow::Cow;
use std::collections::HashMap;

/// Request paths the filter routes; everything else passes through untouched.
pub const INFERENCE_PATHS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

/// Whether `path` (query string allowed) is an inference request the filter routes.
pub fn is_inference_path(path: &[u8]) -> bool {
    let path = path.split(|&b| b == b'?').next().unwrap_or(path);
    INFERENCE_PATHS.iter().any(|p| p.as_bytes() == path)
}

/// Whether a callout's answer is the proxy saying it could not reach the replica, rather than the
/// replica answering. Envoy 1.40 reports a refused or reset connection to a `dispatch_http_call` as
/// its own 503 (`upstream connect error or disconnect/reset before headers ...`, which covers a
/// connect timeout too) and a cluster without a healthy host as 503 `no healthy upstream`; a live
/// replica's own errors never start with these phrases. A feed that answers too slowly is not this
/// ([`proxy_timed_out`]).
pub fn proxy_could_not_connect(status: u16, body: Option<&[u8]>) -> bool {
    const MARKERS: [&[u8]; 2] = [b"upstream connect error", b"no healthy upstream"];
    status == 503 && body.is_some_and(|b| MARKERS.iter().any(|m| b.starts_with(m)))
}

/// Whether a callout's answer is the proxy saying the replica did not answer within the callout's
/// timeout (Envoy: its own 504 `upstream request timeout`). The replica was reached: its feed is slow,
/// which makes the feed stale but does not mark the replica down.
pub fn proxy_timed_out(status: u16, body: Option<&[u8]>) -> bool {
    status == 504 && body.is_some_and(|b| b.starts_with(b"upstream request timeout"))
}

/// Why a feed poll failed. Only [`FeedFailure::Unreachable`] counts toward marking a replica down;
/// every kind counts toward making its feed stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FeedFailure {
    /// The connection was refused or reset (or the proxy had no healthy host for it).
    Unreachable,
    /// No answer within `feed_timeout_ms`.
    Slow,
    /// The answer was over `feed_max_bytes`, or held more events than `feed_max_events`: refused
    /// unread.
    Oversized,
    /// The replica answered with an HTTP error.
    Http(u16),
    /// The answer was not a feed batch.
    Malformed,
    /// The proxy refused to dispatch the callout.
    NotDispatched,
    /// The answer describes another data-parallel rank than the unit polled (or one the endpoint
    /// does not have): refused whole, its blocks would be booked on the wrong cache.
    WrongRank { reported: u16 },
}

/// Why a request was routed without reading its body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyFallback {
    /// POST without a body.
    Empty,
    /// Larger than the configured limit.
    TooLarge,
    /// The core's parser refused it.
    Unreadable,
    /// The host could not hand the body over.
    HostError,
}

/// Poll state of one replica's feed. Whether the replica is stale or down is not kept here: the
/// router holds it ([`RouterState::is_stale`], [`RouterState::is_down`]), the one place routing reads.
#[derive(Clone, Debug, Default)]
pub struct FeedState {
    pub in_flight: Option<u32>,
    /// When the poll in flight (or the last one) was sent: its answer's load holds every request
    /// admitted before then (`reported_load` `merge`).
    pub polled_ms: u64,
    pub next_poll_ms: u64,
    pub consecutive_failures: u32,
    pub polls: u64,
    pub failures: u64,
    /// Last time a batch for this replica was applied (polled or relayed).
    pub last_ok_ms: Option<u64>,
    /// This worker holds the replica's feed lease and relays what it polls.
    pub leased: bool,
    /// Newest relay number applied from the shared ring.
    pub relay_seen: u64,
    /// Batches applied from other workers' polls.
    pub relayed: u64,
    /// Polls in a row that could not reach the replica at all (connection refused or reset, as
    /// opposed to a slow or oversized answer or an HTTP error from a live server).
    pub consecutive_unreachable: u32,
    /// Polls that timed out (slow feed).
    pub timeouts: u64,
    /// Answers refused for their size.
    pub oversized: u64,
    /// A batch accepted but not yet wholly applied (applied in slices, `feed_apply_blocks_per_tick`
    /// per tick): this replica is not polled, nor its relay read, until it is done.
    pub pending: Option<FeedFrame>,
    /// Batches that took more than one slice.
    pub deferred: u64,
}

/// A feed poll to dispatch now: `GET path` to `upstream` (cluster or address) with `:authority`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FeedPoll {
    pub replica: usize,
    pub upstream: String,
    pub authority: String,
    pub path: String,
    /// This VM has just taken the replica's lease from no one or from another VM (worth a log line:
    /// it happens once per replica at start and at each handover).
    pub took_lease: bool,
}

/// Where a routing decision is written for the proxy to read it, and what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecisionOutput<'a> {
    /// A request header (the destination or the cluster header). With the cluster header the route
    /// was chosen before the header existed, so Envoy must be told to choose again
    /// (`clear_route_cache`).
    Header {
        name: &'a str,
        value: Cow<'a, str>,
        clear_route_cache: bool,
    },
    /// nginx: the variable `["ngx", name]`.
    NginxVariable { name: &'a str, value: Cow<'a, str> },
}

/// The values a decision is written as, formatted at configure time so that a request only picks
/// one: per replica its own value (endpoint, or cluster in cluster-header mode) and, in
/// destination-header mode with `retry_backup`, every `primary,backup` pair while the fleet is
/// small enough for the table ([`Destinations::MAX_PAIR_TABLE`] replicas: 4,096 pairs); larger
/// fleets format the pair per request.
#[derive(Clone, Debug, Default)]
pub struct Destinations {
    single: Vec<String>,
    /// `pairs[primary * replicas + backup]`; empty when not used or too large.
    pairs: Vec<String>,
}

impl Destinations {
    pub const MAX_PAIR_TABLE: usize = 64;

    fn new(cfg: &FilterConfig) -> Destinations {
        let single: Vec<String> = cfg
            .replicas
            .iter()
            .map(|r| match cfg.output {
                OutputMode::ClusterHeader => {
                    r.cluster.clone().unwrap_or_else(|| r.endpoint.clone())
                }
                _ => r.endpoint.clone(),
            })
            .collect();
        let n = cfg.replicas.len();
        let pairs = if cfg.output == OutputMode::DestinationHeader
            && cfg.retry_backup
            && n <= Self::MAX_PAIR_TABLE
        {
            (0..n * n)
                .map(|k| {
                    format!(
                        "{},{}",
                        cfg.replicas[k / n].endpoint,
                        cfg.replicas[k % n].endpoint
                    )
                })
                .collect()
        } else {
            Vec::new()
        };
        Destinations { single, pairs }
    }

    /// The value for `replica` with an optional backup (indices clamped to the fleet: the routing
    /// path must not panic).
    fn value<'a>(
        &'a self,
        cfg: &FilterConfig,
        replica: usize,
        backup: Option<usize>,
    ) -> Cow<'a, str> {
        let n = self.single.len();
        let last = n.saturating_sub(1);
        let r = replica.min(last);
        let single = || Cow::Borrowed(self.single.get(r).map_or("", String::as_str));
        match (cfg.output, backup) {
            (OutputMode::DestinationHeader, Some(b)) => {
                let b = b.min(last);
                match self.pairs.get(r * n + b) {
                    Some(v) => Cow::Borrowed(v.as_str()),
                    None => Cow::Owned(format!(
                        "{},{}",
                        self.single.get(r).map_or("", String::as_str),
                        self.single.get(b).map_or("", String::as_str)
                    )),
                }
            }
            _ => single(),
        }
    }
}

/// How a request in a P/D fleet goes (docs/design/pd.md), from [`RouterState::route_pd`].
#[derive(Clone, Debug, PartialEq)]
pub enum PdRoute {
    /// Both legs booked, the prefill leg under `prefill_id`, the decode leg under `decode_id`: send
    /// `prefill_body` to `prefill`, then the client's request (with the answer's
    /// `kv_transfer_params`) where `decode` says.
    Legs {
        prefill: usize,
        decode: Decision,
        client: serde_json::Map<String, serde_json::Value>,
        prefill_body: Vec<u8>,
        prefill_matched_tokens: u64,
        /// Where to send the prefill leg if it fails with a 5xx or no answer (the side's backup, its
        /// cached prompt tokens) and the request, to book it there
        /// ([`RouterState::rebook_prefill`]): for a health probe the side's own choice, otherwise
        /// the next cheapest replica that prefills when `pd.retry_prefill` is on.
        prefill_backup: Option<(usize, u64, Box<RouteRequest>)>,
    },
    /// The body is not a request the filter can split (too large, not JSON, no prompt): sent whole,
    /// by load, to a replica that decodes, booked under `decode_id`. `body`: the body to send
    /// instead of the client's when it was a JSON object carrying its own `kv_transfer_params`
    /// (dropped: only the filter may set them in a P/D fleet).
    Whole {
        decision: Decision,
        body: Option<Vec<u8>>,
    },
    /// No prefill replica can take it (the chosen one is down: every one that prefills is): nothing
    /// booked; the client gets a 503.
    Unavailable { replica: Option<usize>, why: String },
}

/// What a feed answer did, for logs and metrics.
#[derive(Clone, Debug, PartialEq)]
pub enum FeedResult {
    Applied {
        replica: usize,
        outcome: FeedOutcome,
    },
    Failed {
        replica: usize,
        cause: FeedFailure,
        reason: String,
        became_stale: bool,
        became_down: bool,
    },
    /// A response for a token this worker does not know (late after reconfiguration): ignored.
    Unknown,
}

/// Feed work (block hashes and events) applied between two reads of the clock, and the least a
/// batch with work left gets per tick whatever the time budget says. Applying 256 blocks takes tens
/// of microseconds; a clock read is one host call.
pub const FEED_MIN_SLICE: u64 = 256;

/// A worker's working-set journal keeps this many ticks of its admissions for the other workers.
pub const WORKING_SET_KEEP_TICKS: u64 = 4;

/// One VM's (one proxy worker's) routing state: its configuration, the core `Router`, the feed
/// pollers and the per-request bookkeeping.
pub struct RouterState {
    cfg: FilterConfig,
    router: Router,
    feeds: Vec<FeedState>,
    callouts: HashMap<u32, usize>,
    /// Body fallbacks by reason, in [`BodyFallback`] order.
    body_fallbacks: [u64; 4],
    /// Client-supplied copies of the routing header that were removed.
    spoofed_headers: u64,
    /// Feed answers refused for naming another DP rank than the unit polled.
    rank_mismatches: u64,
    /// Other workers' working-set entries this worker never read (dropped before it ticked).
    working_set_missed: u64,
    /// Other workers' working-set journals refused as malformed or for another replica count.
    working_set_refused: u64,
    /// Per unit, the rank header's value (`None`: a unit without a rank), formatted once.
    rank_values: Vec<Option<String>>,
    /// This worker's number among the proxy's workers; `None` without shared data.
    worker_id: Option<u32>,
    started_ms: Option<u64>,
    /// Callouts (feed and peer polls) planned in this tick, counted only where a tick's callouts are
    /// bounded ([`RouterState::callouts_per_tick`]).
    tick_callouts: usize,
    /// Where the next bounded tick starts looking for a feed to poll, so every replica gets its turn.
    poll_cursor: usize,
    /// Feed work (block hashes and events) this worker may still do in this tick.
    budget_left: u64,
    /// When this tick's budget was granted (`None`: never).
    budget_from_ms: Option<u64>,
    /// Nanoseconds of feed work this worker may still spend in this tick
    /// (`feed_apply_us_per_tick`; `u64::MAX` without a time bound).
    time_left_ns: u64,
    /// The proxy's clock in nanoseconds, read between feed slices. Unit tests keep the default,
    /// which never moves (only the block budget then bounds a tick), or install their own.
    clock: fn() -> u64,
    /// Feed slices cut short by the time budget (the block budget had room left).
    time_cuts: u64,
    scratch: Vec<u64>,
    /// Every value [`RouterState::destination`] can write, formatted once per VM (see
    /// [`Destinations`]).
    destinations: Destinations,
    /// Text-prompt tokenizer, when configured (full build only).
    #[cfg(feature = "tokenizer")]
    tokenizer: Option<TextTokenizer>,
    /// Every replica's P/D role; `disaggregated` when some role is not `both`.
    roles: Vec<Role>,
    disaggregated: bool,
    pd_params: PdParams,
    /// The P/D requests' `x-request-id`: this VM's random nonce and a counter.
    pd_nonce: u64,
    pd_requests: u64,
    /// Bookings in the load table (a request, or one leg of a P/D request) made and released by
    /// this worker: their difference is what it has in flight, so a proxy whose counters (summed
    /// over its workers) differ once traffic stops has leaked load.
    bookings: u64,
    releases: u64,
    /// The working-set exchange with other proxies (`peers`; [`crate::exchange`]).
    exchange: Exchange,
}

impl RouterState {
    pub fn new(cfg: FilterConfig) -> Result<RouterState, ConfigError> {
        let mut router = Router::new(cfg.routing.clone(), cfg.replicas.len())
            .map_err(|e| ConfigError(format!("routing: {e}")))?;
        // The ranks of one endpoint share its address: a retry backup is taken from another one.
        router.set_address_groups(
            cfg.replicas
                .iter()
                .map(|r| {
                    cfg.replicas
                        .iter()
                        .position(|o| o.endpoint == r.endpoint)
                        .unwrap_or(0)
                })
                .collect(),
        );
        let feeds = vec![FeedState::default(); cfg.replicas.len()];
        #[cfg(feature = "tokenizer")]
        let tokenizer = match &cfg.tokenizer {
            Some(t) => {
                Some(TextTokenizer::new(t).map_err(|e| ConfigError(format!("tokenizer.{e}")))?)
            }
            None => None,
        };
        let destinations = Destinations::new(&cfg);
        let rank_values = cfg
            .replicas
            .iter()
            .map(|r| r.rank.map(|k| k.to_string()))
            .collect();
        let roles = cfg.roles();
        let disaggregated = cfg.disaggregated();
        let pd_params = cfg.pd.params();
        let exchange = Exchange::new(&cfg);
        Ok(RouterState {
            exchange,
            roles,
            disaggregated,
            pd_params,
            pd_nonce: 0,
            pd_requests: 0,
            bookings: 0,
            releases: 0,
            rank_values,
            #[cfg(feature = "tokenizer")]
            tokenizer,
            destinations,
            cfg,
            router,
            feeds,
            callouts: HashMap::new(),
            body_fallbacks: [0; 4],
            spoofed_headers: 0,
            rank_mismatches: 0,
            working_set_missed: 0,
            working_set_refused: 0,
            worker_id: None,
            started_ms: None,
            tick_callouts: 0,
            poll_cursor: 0,
            budget_left: 0,
            budget_from_ms: None,
            time_left_ns: 0,
            clock: || 0,
            time_cuts: 0,
            scratch: Vec::new(),
        })
    }

    /// Installs the proxy's clock (nanoseconds; any epoch), read between feed slices to bound the
    /// time a tick spends applying feed batches (`feed_apply_us_per_tick`).
    pub fn set_clock(&mut self, clock: fn() -> u64) {
        self.clock = clock;
    }

    /// Feed slices cut short by the time budget while the block budget had room left.
    pub fn feed_time_cuts(&self) -> u64 {
        self.time_cuts
    }

    /// The plugin configuration (read-only).
    /// Gives the router this proxy's identity (Envoy's node id) for its tie-breaks, so proxies sharing
    /// one configuration do not draw the same tie-break sequence (`kvsteer_core::rng::proxy_seed`;
    /// docs/reports/proxies.md). Empty: the configured `routing.seed` alone, as a lone proxy always had.
    pub fn set_proxy_identity(&mut self, identity: &[u8]) {
        self.router.set_proxy_identity(identity);
    }

    /// `kv_time`'s explanation of the last decision, for the configured `explain_header`: the winner,
    /// then each candidate's cost and terms in seconds. None without the header or the terms.
    pub fn explanation(&self, winner: usize) -> Option<String> {
        self.cfg.explain_header.as_ref()?;
        let terms = self.router.last_terms();
        if terms.is_empty() {
            return None;
        }
        let k = &self.cfg.routing.kv_time;
        let mut out = format!("winner={winner}");
        for (r, t) in terms.iter().enumerate() {
            out.push_str(&format!(
                "; {r}: cost={:.4} wait={:.4} prefill={:.4} decode={:.4} stall={:.4} evict={:.4}",
                t.cost(k),
                t.wait,
                t.prefill,
                t.decode,
                t.stall,
                t.evict
            ));
        }
        Some(out)
    }

    pub fn config(&self) -> &FilterConfig {
        &self.cfg
    }

    /// Number of replicas.
    pub fn replicas(&self) -> usize {
        self.cfg.replicas.len()
    }

    /// A replica's name, for logs (`?` for an unknown index).
    pub fn replica_name(&self, replica: usize) -> &str {
        self.cfg
            .replicas
            .get(replica)
            .map_or("?", |r| r.name.as_str())
    }

    /// The working-set term's view of a replica, in blocks: (its recent working set, 0 with the term
    /// off; its cache size, configured or learned from the feed, 0 while unknown).
    pub fn working_set(&self, replica: usize) -> (f64, f64) {
        (
            self.router.working_set_blocks(replica),
            self.router.cache_size_blocks(replica),
        )
    }

    /// `kv_time`'s learned time factor of a replica against its profile (1 under other policies).
    pub fn speed_factor(&self, replica: usize) -> f64 {
        self.router.speed_factor(replica)
    }

    /// The router's counters and sizes.
    pub fn stats(&self) -> RouterStats {
        self.router.stats()
    }

    /// Body fallbacks so far, by reason in [`BodyFallback`] order.
    pub fn body_fallbacks(&self) -> [u64; 4] {
        self.body_fallbacks
    }

    /// The text-prompt tokenizer's counters, when one is configured.
    #[cfg(feature = "tokenizer")]
    pub fn tokenizer_stats(&self) -> Option<kvsteer_tokenizer::TokenizerStats> {
        self.tokenizer.as_ref().map(|t| t.stats())
    }

    // --- Workers: numbers and shared load ---

    /// This worker's number among the proxy's workers; `None` until claimed, or without shared data.
    pub fn worker_id(&self) -> Option<u32> {
        self.worker_id
    }

    /// Claims this worker's number from the shared counter ([`workers::claim_worker_id`]).
    pub fn claim_worker_id(&mut self, store: &dyn SharedStore) -> Option<u32> {
        self.worker_id = workers::claim_worker_id(store, &self.cfg.shared_key_prefix);
        if self.worker_id.is_some() {
            self.router.share_working_set();
        }
        self.worker_id
    }

    /// The shared store, for the operations that need one, once this worker has a number: without one
    /// (no shared data) feeds are polled and load is kept per worker.
    pub fn shared<'a>(&self, store: &'a dyn SharedStore) -> Option<&'a dyn SharedStore> {
        self.worker_id.map(|_| store)
    }

    /// Publishes this worker's in-flight load and takes in the other workers' (records older than
    /// `peer_ttl_ms` are dropped): the exchange each tick makes. Nothing without a worker number.
    pub fn share_load(&mut self, store: &dyn SharedStore, now_ms: u64) {
        let Some(me) = self.worker_id else {
            return;
        };
        let prefix = &self.cfg.shared_key_prefix;
        let rec = workers::WorkerLoad {
            totals: self.router.local_load(),
            since: self.router.local_load_since(),
            released: self.router.local_released_since(),
            held: self.router.local_held(),
        };
        workers::publish(store, prefix, me, now_ms, &rec);
        workers::publish_health(store, prefix, me, now_ms, &self.router.local_health(now_ms));
        // Kept for a few ticks, so every worker reads each entry at least once (ticks drift), and
        // with peer proxies for a few of their polls too (they read the same records).
        let poll_ms = self.cfg.peers.as_ref().map_or(0, |p| p.poll_ms);
        let keep = self
            .cfg
            .tick_ms
            .max(poll_ms)
            .saturating_mul(WORKING_SET_KEEP_TICKS);
        if let Some(journal) = self.router.working_set_journal(now_ms, keep) {
            workers::publish_working_set(store, prefix, me, &journal);
        }
        let count = workers::worker_count(store, prefix);
        let replicas = self.cfg.replicas.len();
        let ttl = self.cfg.peer_ttl_ms;
        for peer in (0..count).filter(|&p| p != me) {
            match workers::read_fresh(store, prefix, peer, replicas, now_ms, ttl) {
                Some(rec) => {
                    self.router.set_peer_load(peer, &rec.totals);
                    self.router
                        .set_peer_load_since(peer, &rec.since, &rec.released);
                    self.router.set_peer_held(peer, &rec.held);
                }
                None => self.router.clear_peer(peer),
            }
            match workers::read_health_fresh(store, prefix, peer, replicas, now_ms, ttl) {
                Some((at, counts)) => self.router.set_peer_health(peer, at, &counts),
                None => self.router.clear_peer_health(peer),
            }
            // A VM that has routed nothing yet needs no working set: Envoy's main thread runs one
            // (it gets ticks and callouts, never a stream), and a worker whose connections are all
            // elsewhere is another. Applying every other worker's admissions costs each such VM as
            // much as a routing one (docs/guide/envoy.md, "Where the p99 goes"); a worker starts with its
            // first request, from what the journals still hold (a few ticks' worth), and its
            // estimate fills in over the window. (Peer proxies' working sets are still polled from
            // the start: `plan_peer_polls`.)
            if !self.has_routed() {
                continue;
            }
            if let Some(journal) = workers::read_working_set_fresh(store, prefix, peer, now_ms, ttl)
            {
                match self.router.apply_peer_working_set(peer, &journal) {
                    Some(applied) => self.working_set_missed += applied.missed,
                    None => self.working_set_refused += 1,
                }
            }
        }
        self.router.refresh_health(now_ms);
    }

    // --- Requests ---

    /// The header that carries the routing decision (destination or cluster header): clients must
    /// never send it.
    pub fn routing_header(&self) -> &str {
        match self.cfg.output {
            OutputMode::ClusterHeader => &self.cfg.cluster_header,
            _ => &self.cfg.destination_header,
        }
    }

    /// The header carrying the chosen DP rank: clients must never send it either (always removed,
    /// whether or not any replica has ranks).
    pub fn rank_header(&self) -> &str {
        &self.cfg.rank_header
    }

    /// The rank header's value for a decision: `Some` only when the chosen unit is a DP rank.
    pub fn rank_value(&self, d: &Decision) -> Option<&str> {
        self.rank_values.get(d.replica)?.as_deref()
    }

    /// Other workers' working-set entries missed and journals refused (counters since start).
    pub fn working_set_sharing(&self) -> (u64, u64) {
        (self.working_set_missed, self.working_set_refused)
    }

    // --- The working-set exchange with other proxies ([`crate::exchange`]) ---

    /// The peer polls due at `now_ms` (none without `peers`, or while this worker has no working
    /// set to share: before it has a number in shared data, or with the term off).
    pub fn plan_peer_polls(&mut self, now_ms: u64) -> Vec<PeerCall> {
        // From the start, unlike the other workers' journals (`share_load`): a proxy that takes
        // traffic later needs what the others served before, and their journals keep only a few
        // polls' worth.
        let sharing = self.worker_id.is_some() && self.router.has_working_set();
        let busy = self.callout_out(now_ms);
        let mut calls = self.exchange.plan(&self.cfg, &self.router, sharing, now_ms);
        let limit = self.callouts_per_tick();
        if limit != usize::MAX {
            if busy {
                calls.clear();
            }
            // Over the tick's bound (feed polls come first): planning marks nothing, so a peer
            // left out is due again next tick.
            calls.truncate(limit.saturating_sub(self.tick_callouts));
            self.tick_callouts += calls.len();
        }
        calls
    }

    pub fn peer_poll_started(&mut self, peer: usize, token: u32, now_ms: u64) {
        self.exchange.started(&self.cfg, peer, token, now_ms);
    }

    pub fn peer_poll_not_started(&mut self, peer: usize, now_ms: u64) {
        self.exchange.not_started(&self.cfg, peer, now_ms);
    }

    /// Whether a callout's answer is a peer poll's (not a feed's).
    pub fn is_peer_poll(&self, token: u32) -> bool {
        self.exchange.owns(token)
    }

    /// Whether a peer's answer of `body_size` bytes may be read.
    pub fn peer_answer_fits(&self, body_size: usize) -> bool {
        Exchange::accepts_size(&self.cfg, body_size)
    }

    /// A peer poll's answer ([`Exchange::answered`]).
    pub fn on_peer_answer(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: Option<&[u8]>,
        oversized: bool,
        now_ms: u64,
    ) {
        self.exchange
            .answered(&mut self.router, token, status, body, oversized, now_ms);
    }

    /// Whether a request's path is the reserved one peers poll: the filter answers it and never
    /// forwards it.
    pub fn is_peer_path(&self, path: &[u8]) -> bool {
        crate::exchange::is_reserved(path, self.cfg.peer_path())
    }

    /// The header a peer's poll carries the shared token in.
    pub fn peer_token_header(&self) -> &str {
        self.cfg.peer_token_header()
    }

    /// Answers a request for the reserved path ([`Exchange::serve`]).
    pub fn serve_peer(
        &mut self,
        store: &dyn SharedStore,
        method: &[u8],
        path: &[u8],
        token: Option<&[u8]>,
        now_ms: u64,
    ) -> PeerResponse {
        let store = self.worker_id.map(|_| store);
        self.exchange
            .serve(&self.cfg, store, method, path, token, now_ms)
    }

    /// The exchange's counters since start.
    pub fn exchange_stats(&self) -> ExchangeStats {
        self.exchange.stats
    }

    /// Feed answers refused because they named another DP rank than the unit polled.
    pub fn rank_mismatches(&self) -> u64 {
        self.rank_mismatches
    }

    /// A client's copy of the routing header was removed.
    pub fn spoofed_header_removed(&mut self) {
        self.spoofed_headers += 1;
    }

    /// Client copies of the routing header removed so far.
    pub fn spoofed_headers(&self) -> u64 {
        self.spoofed_headers
    }

    /// The header naming a request's session (`session_hash`).
    pub fn session_header(&self) -> &str {
        &self.cfg.session_header
    }

    /// Bodies over this many bytes are not read (routed by load alone).
    pub fn max_body_bytes(&self) -> usize {
        self.cfg.routing.max_body_bytes
    }

    /// Routes a request whose body could be read; admits it under `request_id`.
    pub fn route_body(
        &mut self,
        request_id: u64,
        path: &str,
        body: &[u8],
        session: Option<&str>,
        now_ms: u64,
    ) -> Decision {
        self.route_body_early(request_id, path, body, session, None, now_ms)
    }

    /// A scan for a request body that will arrive in slices, when the configuration wants one
    /// (`early_body_scan`), the body will be routed by [`RouterState::route_body_early`] (not in
    /// a P/D fleet, whose bodies are split rather than routed whole) and it is for
    /// `/v1/completions`, the one endpoint whose prompt can be token ids (a chat body's would be
    /// copied slice by slice for nothing).
    pub fn early_scan(&self, path: &str) -> Option<EarlyScan> {
        let completions = matches!(
            kvsteer_core::request::endpoint(path),
            Ok(kvsteer_core::request::Endpoint::Completions)
        );
        (self.cfg.early_body_scan && completions && !self.disaggregated())
            .then(|| EarlyScan::new(self.cfg.routing.block_size))
    }

    /// [`RouterState::route_body`] for a body an [`EarlyScan`] followed as it arrived.
    pub fn route_body_early(
        &mut self,
        request_id: u64,
        path: &str,
        body: &[u8],
        session: Option<&str>,
        early: Option<EarlyScan>,
        now_ms: u64,
    ) -> Decision {
        if body.len() > self.cfg.routing.max_body_bytes {
            return self.route_fallback(request_id, BodyFallback::TooLarge, body.len(), now_ms);
        }
        #[cfg(feature = "tokenizer")]
        let tok = self
            .tokenizer
            .as_mut()
            .map(|t| t as &mut dyn PromptTokenizer);
        // Lean build: text prompts keep the approximate identity (a tokenizer section was refused).
        #[cfg(not(feature = "tokenizer"))]
        let tok: Option<&mut dyn PromptTokenizer> = None;
        let (d, unread) = self
            .router
            .route_body_early(request_id, path, body, session, tok, early, now_ms);
        self.bookings += 1;
        if unread.is_some() {
            self.body_fallbacks[BodyFallback::Unreadable as usize] += 1;
        }
        d
    }

    /// Routes by load alone and tracks the request, its prompt estimated at 4 body bytes a token (the
    /// same ratio as the approximate text identity). In a P/D fleet only replicas that decode take it.
    pub fn route_fallback(
        &mut self,
        request_id: u64,
        why: BodyFallback,
        body_bytes: usize,
        now_ms: u64,
    ) -> Decision {
        self.body_fallbacks[why as usize] += 1;
        self.bookings += 1;
        if self.disaggregated {
            return self
                .router
                .route_unread_pd(request_id, body_bytes, &self.roles, now_ms);
        }
        self.router.route_unread(request_id, body_bytes, now_ms)
    }

    // --- Prefill/decode disaggregation (docs/design/pd.md) ---

    /// Whether requests are split into a prefill and a decode leg: some replica's role is not `both`.
    pub fn disaggregated(&self) -> bool {
        self.disaggregated
    }

    /// Seeds the P/D request ids with a value of this VM's own (random at configure time).
    pub fn set_pd_nonce(&mut self, nonce: u64) {
        self.pd_nonce = nonce;
    }

    /// A fresh `x-request-id` for both legs of one P/D request.
    pub fn next_pd_request_id(&mut self) -> String {
        self.pd_requests += 1;
        crate::pd::request_id(self.pd_nonce, self.pd_requests)
    }

    /// The rank header's value for a unit (`None`: a unit without a rank).
    pub fn rank_of_unit(&self, replica: usize) -> Option<&str> {
        self.rank_values.get(replica)?.as_deref()
    }

    /// Routes a P/D request: reads it, picks both ends (`Router::route_pd`) and books both legs, or
    /// sends it whole to a decode replica when it cannot be split, or gives up when no replica that
    /// prefills is up.
    pub fn route_pd(
        &mut self,
        prefill_id: u64,
        decode_id: u64,
        path: &str,
        body: &[u8],
        session: Option<&str>,
        now_ms: u64,
    ) -> PdRoute {
        let whole = |s: &mut Self, why: BodyFallback| {
            let decision = s.route_fallback(decode_id, why, body.len(), now_ms);
            let body = crate::pd::client_request(body)
                .filter(|m| m.contains_key(crate::pd::KV_TRANSFER_PARAMS))
                .map(|m| crate::pd::decode_body(m, None));
            PdRoute::Whole { decision, body }
        };
        if body.len() > self.cfg.routing.max_body_bytes {
            return whole(self, BodyFallback::TooLarge);
        }
        #[cfg(feature = "tokenizer")]
        let tok = self
            .tokenizer
            .as_mut()
            .map(|t| t as &mut dyn PromptTokenizer);
        #[cfg(not(feature = "tokenizer"))]
        let tok: Option<&mut dyn PromptTokenizer> = None;
        let req = match self.router.read_request_with(path, body, session, tok) {
            Ok(r) => r,
            Err(_) => return whole(self, BodyFallback::Unreadable),
        };
        let Some(client) = crate::pd::client_request(body) else {
            return whole(self, BodyFallback::Unreadable);
        };
        let d = match self
            .router
            .route_pd(&req, &self.roles, &self.pd_params, now_ms)
        {
            Ok(d) => d,
            Err(e) => {
                return PdRoute::Unavailable {
                    replica: None,
                    why: e.to_string(),
                };
            }
        };
        if self.router.is_down(d.prefill) {
            // route_pd keeps to replicas that are up while its side has one: every one is down.
            return PdRoute::Unavailable {
                replica: Some(d.prefill),
                why: "is down, as is every replica that prefills".into(),
            };
        }
        self.router
            .admit_pd(prefill_id, decode_id, &req, &d, now_ms);
        self.bookings += 2;
        let decode = self.router.pd_decode_decision(&d, &self.roles);
        PdRoute::Legs {
            prefill: d.prefill,
            decode,
            prefill_body: crate::pd::prefill_body(&client),
            client,
            prefill_matched_tokens: d.prefill_matched_tokens,
            prefill_backup: d
                .prefill_backup
                .filter(|_| d.prefill_probe || self.cfg.pd.retry_prefill)
                .map(|(r, matched)| (r, matched, Box::new(req))),
        }
    }

    /// A prefill leg failed (a health probe, or a leg retried on its side's backup): it is released
    /// there and booked again under the same id on `replica`, where it is sent next.
    pub fn rebook_prefill(
        &mut self,
        prefill_id: u64,
        req: &RouteRequest,
        replica: usize,
        matched_tokens: u64,
        now_ms: u64,
    ) {
        self.release(prefill_id);
        self.router
            .admit_prefill_leg(prefill_id, req, replica, matched_tokens, now_ms);
        self.bookings += 1;
    }

    /// The request's first token arrived at `now_ms`: its prefill load becomes decode load (and
    /// `kv_time` learns its replica's speed from when it came).
    pub fn first_token(&mut self, request_id: u64, now_ms: u64) {
        self.router.first_token_at(request_id, now_ms);
    }

    /// The request has generated this many tokens so far.
    pub fn decode_progress(&mut self, request_id: u64, generated_tokens: u64) {
        self.router.decode_progress(request_id, generated_tokens);
    }

    /// The request ended (finished, failed or aborted): its load is released. `false` for a request
    /// not tracked (counted as a release anomaly).
    pub fn release(&mut self, request_id: u64) -> bool {
        let released = self.router.release(request_id);
        self.releases += released as u64;
        released
    }

    /// Whether this VM has routed a request: only such a VM applies the other workers'
    /// working-set journals (`share_load`) and so only it has a working set worth reporting.
    pub fn has_routed(&self) -> bool {
        self.bookings > 0
    }

    /// Bookings made and released so far (requests, and each leg of a P/D request).
    pub fn bookings(&self) -> (u64, u64) {
        (self.bookings, self.releases)
    }

    /// How a routed request ended, for the replicas' health (`kvsteer_core::health`). `chosen`: the
    /// replica the filter chose; `served_by`: the upstream address the proxy reports for the answer
    /// (Envoy's `upstream.address`), if any. An answer from another replica means the proxy retried
    /// there, so the first choice's attempt failed: both are recorded.
    pub fn request_outcome(
        &mut self,
        chosen: usize,
        served_by: Option<&[u8]>,
        outcome: Outcome,
        now_ms: u64,
    ) {
        let served = served_by
            .and_then(|a| std::str::from_utf8(a).ok())
            .and_then(|a| {
                let a = a.trim();
                // Several DP ranks share one address: an answer from the chosen unit's own address
                // is the chosen unit's, not a retry to its endpoint's first rank.
                match self.cfg.replicas.get(chosen) {
                    Some(r) if r.endpoint == a => Some(chosen),
                    _ => self.replica_of_address(a),
                }
            });
        match served {
            Some(s) if s != chosen => {
                self.router.record_outcome(chosen, Outcome::Failure, now_ms);
                self.router.record_outcome(s, outcome, now_ms);
            }
            _ => self.router.record_outcome(chosen, outcome, now_ms),
        }
    }

    /// Before routing a request: when an ejected replica's health probe is due, claims it for the
    /// whole proxy in shared data, so one worker sends it per `health.probe_interval_ms` however
    /// many there are; a worker that loses waits a full interval from the winner's probe. Without
    /// shared data (`store` None) each worker probes on its own.
    pub fn claim_probe(&mut self, store: Option<&dyn SharedStore>, now_ms: u64) {
        let Some(store) = store else { return };
        let Some(r) = self.router.probe_due(now_ms) else {
            return;
        };
        let interval = self.cfg.routing.health.probe_interval_ms;
        if let Err(last) =
            workers::claim_probe(store, &self.cfg.shared_key_prefix, r, now_ms, interval)
        {
            self.router.probed_elsewhere(r, last);
        }
    }

    /// The replica whose `endpoint` is `address` (`IP:port`).
    pub fn replica_of_address(&self, address: &str) -> Option<usize> {
        self.cfg.replicas.iter().position(|r| r.endpoint == address)
    }

    /// Whether `replica` is ejected for failing requests.
    pub fn is_ejected(&self, replica: usize) -> bool {
        self.router.is_ejected(replica)
    }

    /// Health as learned from completions.
    pub fn health(&self) -> &Health {
        self.router.health()
    }

    // --- Feeds ---

    /// A replica's poll state.
    pub fn feed(&self, replica: usize) -> Option<&FeedState> {
        self.feeds.get(replica)
    }

    /// Whether the replica's feed is stale: its index and reported load are not trusted.
    pub fn is_stale(&self, replica: usize) -> bool {
        self.router.is_stale(replica)
    }

    /// Whether the replica is believed down: policies avoid it while another replica is up.
    pub fn is_down(&self, replica: usize) -> bool {
        self.router.is_down(replica)
    }

    /// Replicas whose feed this worker should poll now, with the query path. With shared data, a
    /// replica is polled only by the worker holding its lease (the others follow the relay), except
    /// that a worker needing a snapshot polls for it itself. Marks nothing in flight until
    /// [`RouterState::poll_started`] or [`RouterState::poll_not_started`] is called for each.
    ///
    /// In nginx mode at most [`RouterState::callouts_per_tick`] polls a tick, and none while a
    /// callout is out ([`RouterState::callout_out`]), taken in turn from where the last bounded tick
    /// stopped; a replica over the bound is not examined (no lease is taken for a poll that is not
    /// sent) and waits for a later tick.
    pub fn plan_polls(&mut self, store: Option<&dyn SharedStore>, now_ms: u64) -> Vec<FeedPoll> {
        self.started_ms.get_or_insert(now_ms);
        let hold = self.cfg.feed_period_ms.saturating_mul(3);
        let mut out = Vec::new();
        let limit = self.callouts_per_tick();
        let bounded = limit != usize::MAX;
        if bounded && self.callout_out(now_ms) {
            return out;
        }
        let n = self.feeds.len();
        let start = if bounded && n > 0 {
            self.poll_cursor % n
        } else {
            0
        };
        for k in 0..n {
            if bounded && self.tick_callouts + out.len() >= limit {
                break;
            }
            let i = (start + k) % n;
            let f = &self.feeds[i];
            if f.in_flight.is_some() || f.pending.is_some() || f.next_poll_ms > now_ms {
                continue;
            }
            let q = self.router.feed_query(i, self.cfg.feed_max_events);
            let mut took_lease = false;
            let poll = match (store, self.worker_id) {
                (Some(s), Some(me)) if q.epoch != 0 => {
                    let prefix = &self.cfg.shared_key_prefix;
                    let routing = self.has_routed();
                    let got = relay::try_lease(s, prefix, i, me, now_ms, hold, routing);
                    took_lease = got && !self.feeds[i].leased;
                    self.feeds[i].leased = got;
                    got
                }
                _ => {
                    self.feeds[i].leased = false;
                    true
                }
            };
            if poll {
                out.push(FeedPoll {
                    replica: i,
                    upstream: self.cfg.feed_upstream(i).to_string(),
                    authority: self.cfg.feed_authority(i).to_string(),
                    path: match self.cfg.rank_of(i) {
                        Some(r) => format!("{}{}&rank={r}", self.cfg.feed_path_prefix, q.to_path()),
                        None => format!("{}{}", self.cfg.feed_path_prefix, q.to_path()),
                    },
                    took_lease,
                });
                if bounded {
                    self.poll_cursor = i + 1;
                }
            } else {
                self.feeds[i].next_poll_ms = now_ms.saturating_add(self.cfg.feed_period_ms);
            }
        }
        if bounded {
            self.tick_callouts += out.len();
        }
        out
    }

    /// Callouts one tick may dispatch: one in nginx mode, since ngx_wasm_module leaves the
    /// connection of every callout a tick dispatches but the last open for good (a worker runs out
    /// of `worker_connections` within minutes of polling 4 replicas); no bound elsewhere. Counted
    /// from [`RouterState::start_tick`].
    ///
    /// The module's rule is in fact wider: a callout answered while another one of the VM is still
    /// out keeps its connection (the module releases them only when none is left), so in nginx mode
    /// no callout is sent while one is out either ([`RouterState::callout_out`]).
    /// Whether a feed or peer poll of this worker is out. A feed poll out for more than twice its
    /// timeout and a second counts as lost (the proxy answers every callout, a timeout included), so
    /// that one never answered cannot stop the polling for good.
    pub fn callout_out(&self, now_ms: u64) -> bool {
        let lost_after = self
            .cfg
            .feed_timeout_ms
            .saturating_mul(2)
            .saturating_add(1_000);
        self.exchange.any_in_flight()
            || self
                .feeds
                .iter()
                .any(|f| f.in_flight.is_some() && now_ms.saturating_sub(f.polled_ms) < lost_after)
    }

    pub fn callouts_per_tick(&self) -> usize {
        if self.cfg.output == OutputMode::NginxVariable {
            1
        } else {
            usize::MAX
        }
    }

    /// Applies the batches other workers relayed for the feeds this worker does not poll, oldest
    /// first, within this tick's feed budget: a batch that does not fit is finished over the next
    /// ticks, and the relays after it wait until it is.
    pub fn follow_relays(&mut self, store: &dyn SharedStore, now_ms: u64) -> Vec<FeedResult> {
        let mut results = Vec::new();
        for i in 0..self.feeds.len() {
            if self.feeds[i].leased {
                continue;
            }
            while self.feeds[i].pending.is_none() {
                let (relayed, seen) = relay::next_unseen(
                    store,
                    &self.cfg.shared_key_prefix,
                    i,
                    self.feeds[i].relay_seen,
                );
                self.feeds[i].relay_seen = seen;
                let Some((bytes, polled_ms)) = relayed else {
                    break;
                };
                // The holder relays only what it accepted; the same limits keep a follower safe.
                if bytes.len() > self.cfg.feed_max_bytes {
                    continue;
                }
                let Ok(mut frame) = FeedFrame::parse(bytes) else {
                    continue;
                };
                let rank = kvsteer_core::feed::payload_rank(frame.bytes()).unwrap_or(0);
                if self
                    .cfg
                    .rank_of(i)
                    .is_some_and(|want| want != u32::from(rank))
                {
                    continue;
                }
                if frame.events() > self.cfg.feed_max_events {
                    continue;
                }
                let q = self.router.feed_query(i, self.cfg.feed_max_events);
                if !frame.trim_to_cursor(&q) {
                    continue;
                }
                self.refill(now_ms);
                let outcome = self.accept_frame(i, frame, polled_ms);
                self.feeds[i].relayed += 1;
                if outcome != FeedOutcome::Gap {
                    self.feed_ok(i, now_ms, false);
                }
                results.push(FeedResult::Applied {
                    replica: i,
                    outcome,
                });
            }
        }
        results
    }

    /// Grants a new tick's feed budget when a tick period has passed since the last grant (answers
    /// arrive between ticks; [`RouterState::start_tick`] grants one on every tick).
    fn refill(&mut self, now_ms: u64) {
        let due = self
            .budget_from_ms
            .is_none_or(|from| now_ms >= from.saturating_add(self.cfg.tick_ms));
        if due {
            self.grant(now_ms);
        }
    }

    fn grant(&mut self, now_ms: u64) {
        self.budget_left = self.cfg.feed_apply_blocks_per_tick as u64;
        self.time_left_ns = match self.cfg.feed_apply_us_per_tick {
            0 => u64::MAX,
            us => u64::from(us) * 1000,
        };
        self.budget_from_ms = Some(now_ms);
    }

    /// Starts a tick's feed budgets (`feed_apply_blocks_per_tick`, `feed_apply_us_per_tick`) and
    /// spends them on the batches still being applied: first an even split among them, each getting
    /// at least a first slice of [`FEED_MIN_SLICE`] whatever the clock says (so every batch
    /// completes, however slow the machine), then what is left in replica order.
    pub fn start_tick(&mut self, now_ms: u64) {
        self.tick_callouts = 0;
        self.grant(now_ms);
        let waiting: Vec<usize> = (0..self.feeds.len())
            .filter(|&i| self.feeds[i].pending.is_some())
            .collect();
        if waiting.is_empty() {
            return;
        }
        let fair = (self.budget_left / waiting.len() as u64).max(1);
        for &i in &waiting {
            self.drain(i, fair, FEED_MIN_SLICE);
        }
        for &i in &waiting {
            self.drain(i, u64::MAX, 0);
        }
    }

    /// Whether the index holds `key` for `replica` on the GPU tier (tests).
    #[cfg(test)]
    fn index_holds(&self, replica: usize, key: u64) -> bool {
        self.router
            .index()
            .holds(replica, kvsteer_core::feed::Tier::Gpu, key)
    }

    /// Block hashes accepted and not yet applied, all replicas together.
    pub fn pending_blocks(&self) -> u64 {
        self.feeds
            .iter()
            .filter_map(|f| f.pending.as_ref())
            .map(FeedFrame::hashes_left)
            .sum()
    }

    /// Accepts a checked batch (cursor, reset for a snapshot) and applies what this tick's budget
    /// allows; the rest stays pending. The outcome counts the batch's events.
    fn accept_frame(&mut self, replica: usize, frame: FeedFrame, polled_ms: u64) -> FeedOutcome {
        let events = frame.events() as usize;
        let outcome = match self
            .router
            .accept_feed_polled_at(replica, frame.header(), polled_ms)
        {
            FeedOutcome::Applied { .. } => FeedOutcome::Applied { events },
            FeedOutcome::Reset { epoch, .. } => FeedOutcome::Reset { events, epoch },
            other => return other,
        };
        if !frame.is_done() {
            self.feeds[replica].pending = Some(frame);
            // A small batch (the usual incremental answer) is applied at once even when another
            // replica's flood spent this tick's time.
            self.drain(replica, u64::MAX, FEED_MIN_SLICE);
            if self.feeds[replica].pending.is_some() {
                self.feeds[replica].deferred += 1;
            }
        }
        outcome
    }

    /// Applies up to `allowance` units (a block hash or an event each) of a replica's pending batch,
    /// within what is left of the tick's block budget, in slices of at most [`FEED_MIN_SLICE`] with
    /// the clock read after each: it stops once the tick's time budget is spent, but only after
    /// `floor` units (the progress owed to this batch whatever the clock says).
    fn drain(&mut self, replica: usize, allowance: u64, floor: u64) {
        let allow = allowance.min(self.budget_left);
        if allow == 0 || (self.time_left_ns == 0 && floor == 0) {
            return;
        }
        let Some(mut frame) = self.feeds.get_mut(replica).and_then(|f| f.pending.take()) else {
            return;
        };
        let timed = self.time_left_ns != u64::MAX;
        let started = if timed { (self.clock)() } else { 0 };
        let mut spent = 0u64;
        let mut out = std::mem::take(&mut self.scratch);
        let mut used = 0u64;
        while used < allow {
            if timed && used >= floor && spent >= self.time_left_ns {
                self.time_cuts += 1;
                break;
            }
            let room = (allow - used).min(FEED_MIN_SLICE) as usize;
            let Some(slice) = frame.next_slice(room, &mut out) else {
                break;
            };
            self.router.apply_feed_slice(replica, slice, &out);
            used += (out.len() as u64).max(1);
            if timed {
                // The proxy's clock is wall time (Envoy) and may step back: never negative.
                spent = (self.clock)().saturating_sub(started);
            }
        }
        self.scratch = out;
        self.budget_left = self.budget_left.saturating_sub(used);
        if timed {
            self.time_left_ns = self.time_left_ns.saturating_sub(spent);
        }
        if !frame.is_done() {
            self.feeds[replica].pending = Some(frame);
        }
    }

    /// Marks replicas stale whose feed has not been applied for `stale_after_failures + 1` periods
    /// (a follower learns of a failing poller this way). Returns the replicas that just became stale.
    pub fn check_staleness(&mut self, now_ms: u64) -> Vec<usize> {
        let started = *self.started_ms.get_or_insert(now_ms);
        let limit = self
            .cfg
            .feed_period_ms
            .saturating_mul(self.cfg.stale_after_failures as u64 + 1);
        let mut out = Vec::new();
        for (i, f) in self.feeds.iter().enumerate() {
            let last = f.last_ok_ms.unwrap_or(started);
            // A replica whose batch is still being applied has not gone quiet: this worker is busy.
            if f.pending.is_none()
                && !self.router.is_stale(i)
                && now_ms.saturating_sub(last) > limit
            {
                self.router.set_stale(i, true);
                out.push(i);
            }
        }
        out
    }

    fn feed_ok(&mut self, replica: usize, now_ms: u64, more: bool) {
        if let Some(f) = self.feeds.get_mut(replica) {
            f.consecutive_failures = 0;
            f.last_ok_ms = Some(now_ms);
            if more {
                // More log entries wait: poll again at the next tick instead of a whole period later.
                f.next_poll_ms = now_ms;
            }
            self.router.set_stale(replica, false);
        }
    }

    pub fn poll_started(&mut self, replica: usize, token: u32, now_ms: u64) {
        if let Some(f) = self.feeds.get_mut(replica) {
            f.in_flight = Some(token);
            f.polled_ms = now_ms;
            f.polls += 1;
            f.next_poll_ms = now_ms.saturating_add(self.cfg.feed_period_ms);
            self.callouts.insert(token, replica);
        }
    }

    /// The host refused to dispatch (unknown cluster, no resolver...): a failure like any other.
    pub fn poll_not_started(&mut self, replica: usize, reason: &str, now_ms: u64) -> FeedResult {
        if let Some(f) = self.feeds.get_mut(replica) {
            f.next_poll_ms = now_ms.saturating_add(self.cfg.feed_period_ms);
        }
        self.fail(
            replica,
            FeedFailure::NotDispatched,
            format!("dispatch refused: {reason}"),
        )
    }

    /// Handles a feed callout's answer. `status` is the HTTP status (None when the call failed,
    /// which hosts report as a response with no headers); `body` the whole body.
    pub fn on_feed_response(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: Option<&[u8]>,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        self.on_feed_answer(token, status, body.map(<[u8]>::to_vec), store, now_ms)
    }

    /// [`RouterState::on_feed_response`] taking the body the host handed over, without copying it.
    pub fn on_feed_answer(
        &mut self,
        token: u32,
        status: Option<u16>,
        body: Option<Vec<u8>>,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        let Some(replica) = self.callouts.remove(&token) else {
            return FeedResult::Unknown;
        };
        if let Some(f) = self.feeds.get_mut(replica) {
            f.in_flight = None;
        }
        match status {
            Some(200) => {}
            Some(s) if proxy_could_not_connect(s, body.as_deref()) => {
                let r = self.fail(
                    replica,
                    FeedFailure::Unreachable,
                    format!("HTTP {s} from the proxy: replica unreachable"),
                );
                return self.unreachable(replica, r, store, now_ms);
            }
            Some(s) if proxy_timed_out(s, body.as_deref()) => {
                self.feeds[replica].timeouts += 1;
                return self.fail(
                    replica,
                    FeedFailure::Slow,
                    format!(
                        "no answer within {} ms: slow feed",
                        self.cfg.feed_timeout_ms
                    ),
                );
            }
            Some(s) => return self.fail(replica, FeedFailure::Http(s), format!("HTTP {s}")),
            None => {
                let r = self.fail(
                    replica,
                    FeedFailure::Unreachable,
                    "connection refused or reset".into(),
                );
                return self.unreachable(replica, r, store, now_ms);
            }
        }
        let body = body.unwrap_or_default();
        let body_len = body.len();
        if body_len > self.cfg.feed_max_bytes {
            return self.oversized_body(replica, body_len, store, now_ms);
        }
        let frame = match FeedFrame::parse(body) {
            Ok(f) => f,
            Err(e) => {
                return self.fail(replica, FeedFailure::Malformed, format!("bad payload: {e}"));
            }
        };
        if let Some(want) = self.cfg.rank_of(replica) {
            let reported = kvsteer_core::feed::payload_rank(frame.bytes()).unwrap_or(0);
            if u32::from(reported) != want {
                self.rank_mismatches += 1;
                return self.fail(
                    replica,
                    FeedFailure::WrongRank { reported },
                    format!("answer for DP rank {reported}, polled rank {want}: refused"),
                );
            }
        }
        if frame.events() > self.cfg.feed_max_events {
            return self.oversized(
                replica,
                format!(
                    "{} events, over feed_max_events {}",
                    frame.events(),
                    self.cfg.feed_max_events
                ),
                store,
                now_ms,
            );
        }
        let more = frame.header().more;
        let polled_ms = self.feeds[replica].polled_ms;
        if let (Some(store), true) = (store, self.feeds[replica].leased) {
            let prefix = &self.cfg.shared_key_prefix;
            let n = relay::publish(store, prefix, replica, frame.bytes(), polled_ms);
            // Our own batch: followers apply it, we apply it below.
            self.feeds[replica].relay_seen = n;
        }
        self.refill(now_ms);
        let outcome = self.accept_frame(replica, frame, polled_ms);
        self.feed_ok(replica, now_ms, more);
        self.set_down(replica, false, store, now_ms);
        FeedResult::Applied { replica, outcome }
    }

    /// A feed answer whose body is over `feed_max_bytes`, refused before it is read (the proxy
    /// reports the body's size first). An answer that is not a 200 is judged by its status alone.
    pub fn on_feed_response_oversized(
        &mut self,
        token: u32,
        status: Option<u16>,
        body_len: usize,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        if status != Some(200) {
            return self.on_feed_response(token, status, None, store, now_ms);
        }
        let Some(replica) = self.callouts.remove(&token) else {
            return FeedResult::Unknown;
        };
        if let Some(f) = self.feeds.get_mut(replica) {
            f.in_flight = None;
        }
        self.oversized_body(replica, body_len, store, now_ms)
    }

    /// [`Self::oversized`] for an answer of `body_len` bytes, over `feed_max_bytes`.
    fn oversized_body(
        &mut self,
        replica: usize,
        body_len: usize,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        let why = format!(
            "{body_len} bytes, over feed_max_bytes {}",
            self.cfg.feed_max_bytes
        );
        self.oversized(replica, why, store, now_ms)
    }

    /// An answer refused for its size: the replica answered, so it is up, but its feed is not
    /// applied (stale after `stale_after_failures` in a row).
    fn oversized(
        &mut self,
        replica: usize,
        reason: String,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        if let Some(f) = self.feeds.get_mut(replica) {
            f.oversized += 1;
        }
        self.set_down(replica, false, store, now_ms);
        self.fail(replica, FeedFailure::Oversized, reason)
    }

    /// A poll that could not reach the replica: after `stale_after_failures` in a row it is down, and
    /// the lease holder tells the other workers through shared data.
    fn unreachable(
        &mut self,
        replica: usize,
        mut result: FeedResult,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) -> FeedResult {
        let limit = self.cfg.stale_after_failures;
        let Some(f) = self.feeds.get_mut(replica) else {
            return result;
        };
        f.consecutive_unreachable = f.consecutive_unreachable.saturating_add(1);
        if f.consecutive_unreachable >= limit && !self.router.is_down(replica) {
            self.set_down(replica, true, store, now_ms);
            if let FeedResult::Failed { became_down, .. } = &mut result {
                *became_down = true;
            }
        }
        result
    }

    fn set_down(
        &mut self,
        replica: usize,
        down: bool,
        store: Option<&dyn SharedStore>,
        now_ms: u64,
    ) {
        let Some(f) = self.feeds.get_mut(replica) else {
            return;
        };
        if !down {
            f.consecutive_unreachable = 0;
        }
        let leased = f.leased;
        self.router.set_down(replica, down);
        if let (Some(store), true) = (store, leased) {
            relay::publish_health(store, &self.cfg.shared_key_prefix, replica, down, now_ms);
        }
    }

    /// Takes the lease holders' word on which replicas are down, for the feeds this worker follows.
    pub fn follow_health(&mut self, store: &dyn SharedStore) {
        for i in 0..self.feeds.len() {
            if self.feeds[i].leased {
                continue;
            }
            if let Some(down) = relay::health(store, &self.cfg.shared_key_prefix, i) {
                self.router.set_down(i, down);
            }
        }
    }

    fn fail(&mut self, replica: usize, cause: FeedFailure, reason: String) -> FeedResult {
        let limit = self.cfg.stale_after_failures;
        let Some(f) = self.feeds.get_mut(replica) else {
            return FeedResult::Unknown;
        };
        f.failures += 1;
        f.consecutive_failures = f.consecutive_failures.saturating_add(1);
        let became_stale = !self.router.is_stale(replica) && f.consecutive_failures >= limit;
        if became_stale {
            self.router.set_stale(replica, true);
        }
        FeedResult::Failed {
            replica,
            cause,
            reason,
            became_stale,
            became_down: false,
        }
    }

    /// The value to write for the chosen replica, per output mode. With the destination header and
    /// `retry_backup`, the router's second choice follows after a comma: Envoy's override_host policy
    /// tries the listed hosts in order on retries, so a request whose replica just died is retried on
    /// the next best one rather than wherever the fallback policy lands.
    pub fn destination(&self, d: &Decision) -> Cow<'_, str> {
        let backup = d.backup.filter(|_| self.cfg.retry_backup);
        self.destinations.value(&self.cfg, d.replica, backup)
    }

    /// Where and what to write for a decision, per output mode.
    pub fn decision_output(&self, d: &Decision) -> DecisionOutput<'_> {
        let value = self.destination(d);
        match self.cfg.output {
            OutputMode::DestinationHeader => DecisionOutput::Header {
                name: &self.cfg.destination_header,
                value,
                clear_route_cache: false,
            },
            OutputMode::ClusterHeader => DecisionOutput::Header {
                name: &self.cfg.cluster_header,
                value,
                clear_route_cache: true,
            },
            OutputMode::NginxVariable => DecisionOutput::NginxVariable {
                name: &self.cfg.nginx_variable,
                value,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsteer_core::feed::{FeedBatch, FeedEvent, ReplicaLoad, Tier};

    fn worker(policy: &str) -> RouterState {
        worker_routing(&format!(r#"{{"policy":"{policy}"}}"#))
    }

    #[test]
    fn peers_are_polled_only_with_a_working_set_to_share() {
        let with = |policy: &str| {
            let json = format!(
                r#"{{"replicas":[{{"name":"r0","endpoint":"10.0.0.1:8000","feed_cluster":"f0"}}],
                    "routing":{{"policy":"{policy}"}},
                    "peers":{{"proxies":[{{"cluster":"b"}}],"token":"0123456789abcdef"}}}}"#
            );
            RouterState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
        };
        let store = crate::store::tests::MemStore::default();
        let mut kv = with("kv_load");
        assert!(kv.plan_peer_polls(0).is_empty(), "no worker number yet");
        kv.claim_worker_id(&store);
        assert_eq!(kv.plan_peer_polls(0).len(), 1, "before any request too");
        // Without the working-set term there is nothing to exchange: no polls, no empty answers
        // counted as refused.
        let mut rr = with("round_robin");
        rr.claim_worker_id(&store);
        assert!(rr.plan_peer_polls(0).is_empty());
    }

    fn pd_worker() -> RouterState {
        let json = r#"{"replicas":[
            {"name":"p0","endpoint":"10.0.0.1:8000","feed_cluster":"f0","role":"prefill","prefill_cluster":"c0"},
            {"name":"p1","endpoint":"10.0.0.2:8000","feed_cluster":"f1","role":"prefill","prefill_cluster":"c1"},
            {"name":"d0","endpoint":"10.0.0.3:8000","feed_cluster":"f2","role":"decode"},
            {"name":"d1","endpoint":"10.0.0.4:8000","feed_cluster":"f3","role":"decode"}]}"#;
        RouterState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
    }

    /// A readable request is split into two booked legs (prefill side, decode side), each released
    /// apart; one that cannot be split goes whole to a decode replica without the client's
    /// `kv_transfer_params`; with every prefill replica down nothing is booked.
    #[test]
    fn pd_requests_are_split_sent_whole_or_refused() {
        let mut w = pd_worker();
        assert!(w.disaggregated() && !worker("kv_load").disaggregated());
        let body = br#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":9,"stream":true}"#;
        let PdRoute::Legs {
            prefill,
            decode,
            client,
            prefill_body,
            ..
        } = w.route_pd(1 << 32 | 5, 5, "/v1/completions", body, None, 0)
        else {
            panic!("two legs expected");
        };
        assert!(
            prefill < 2 && (2..4).contains(&decode.replica),
            "{prefill} {decode:?}"
        );
        assert!(decode.backup.is_some_and(|b| (2..4).contains(&b)));
        assert_eq!(client["max_tokens"], 9);
        let pb: serde_json::Value = serde_json::from_slice(&prefill_body).unwrap();
        assert_eq!(pb["max_tokens"], 1);
        assert_eq!(w.router.local_load()[prefill].active_requests, 1);
        assert_eq!(w.router.local_load()[decode.replica].active_requests, 1);
        assert_eq!(w.bookings(), (2, 0));
        assert!(w.release(1 << 32 | 5) && w.release(5));
        assert!(!w.release(5), "each leg is booked once");
        assert_eq!(w.bookings(), (2, 2));

        for (bad, stripped) in [
            (
                &br#"{"max_tokens":9,"kv_transfer_params":{"remote_host":"x"}}"#[..],
                true,
            ),
            (b"not json", false),
        ] {
            let PdRoute::Whole { decision, body } =
                w.route_pd(1 << 32 | 6, 6, "/v1/completions", bad, None, 0)
            else {
                panic!("whole expected");
            };
            assert!((2..4).contains(&decision.replica));
            assert_eq!(body.is_some(), stripped);
            if let Some(b) = body {
                assert!(!String::from_utf8(b).unwrap().contains("kv_transfer_params"));
            }
            assert!(w.release(6));
            assert!(!w.release(1 << 32 | 6), "nothing booked for a prefill leg");
        }

        w.router.set_down(0, true);
        w.router.set_down(1, true);
        let r = w.route_pd(1 << 32 | 7, 7, "/v1/completions", body, None, 0);
        assert!(
            matches!(
                r,
                PdRoute::Unavailable {
                    replica: Some(0 | 1),
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(!w.release(7) && !w.release(1 << 32 | 7), "nothing booked");
        assert_eq!(w.bookings(), (4, 4));
        assert_ne!(w.next_pd_request_id(), w.next_pd_request_id());
    }

    /// The destination table gives what formatting per request gave, for small fleets (the table)
    /// and large ones (formatted per request), in every output mode.
    #[test]
    fn destinations_are_the_formatted_values() {
        let mut checked = 0;
        for n in [1usize, 3, Destinations::MAX_PAIR_TABLE + 1] {
            for extra in [
                r#""output":"destination_header""#,
                r#""output":"destination_header","retry_backup":false"#,
                r#""output":"cluster_header""#,
                r#""output":"nginx_variable""#,
            ] {
                let replicas: Vec<String> = (0..n)
                    .map(|i| {
                        let cluster = if i % 2 == 0 { format!(r#","cluster":"c{i}""#) } else { String::new() };
                        format!(r#"{{"name":"r{i}","endpoint":"10.0.0.{i}:8000","feed_cluster":"f{i}"{cluster}}}"#)
                    })
                    .collect();
                let json = format!(r#"{{"replicas":[{}],{extra}}}"#, replicas.join(","));
                let Ok(cfg) = FilterConfig::from_json(json.as_bytes()) else {
                    continue;
                };
                let mut w = RouterState::new(cfg.clone()).unwrap();
                let mut d = w.router.route_fallback(0);
                for (r, b) in [
                    (0, None),
                    (n - 1, Some(0)),
                    (0, Some(n - 1)),
                    (n / 2, Some(n / 3)),
                    (n + 5, Some(n + 9)),
                ] {
                    d.replica = r;
                    d.backup = b;
                    let last = n - 1;
                    let rep = &cfg.replicas[r.min(last)];
                    let want = match cfg.output {
                        OutputMode::ClusterHeader => {
                            rep.cluster.clone().unwrap_or_else(|| rep.endpoint.clone())
                        }
                        OutputMode::NginxVariable => rep.endpoint.clone(),
                        OutputMode::DestinationHeader => match b.filter(|_| cfg.retry_backup) {
                            Some(b) => {
                                format!("{},{}", rep.endpoint, cfg.replicas[b.min(last)].endpoint)
                            }
                            None => rep.endpoint.clone(),
                        },
                    };
                    assert_eq!(w.destination(&d), want, "{json} {r} {b:?}");
                    checked += 1;
                }
            }
        }
        assert!(checked >= 30, "{checked} configurations checked");
    }

    /// Two replicas with the given `routing` section.
    fn worker_routing(routing: &str) -> RouterState {
        let json = format!(
            r#"{{"replicas":[
                {{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}},
                {{"name":"r1","endpoint":"127.0.0.1:8001","feed_cluster":"f1"}}],
               "routing":{routing}, "stale_after_failures": 2}}"#
        );
        RouterState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn outcomes_are_attributed_through_the_upstream_address() {
        let mut w = worker("round_robin");
        // Envoy answered from r1 although the filter chose r0: r0's attempt failed and was retried.
        for t in 0..3 {
            w.request_outcome(0, Some(b"127.0.0.1:8001"), Outcome::Success, t);
        }
        assert!(w.is_ejected(0), "three failed attempts in a row");
        assert!(!w.is_ejected(1));
        assert_eq!(w.health().failures(), &[3, 0]);
        // No address (nginx, a local reply) or one outside the fleet: the choice itself.
        let mut w = worker("round_robin");
        w.request_outcome(1, None, Outcome::Failure, 0);
        w.request_outcome(1, Some(b"10.9.9.9:1"), Outcome::Failure, 1);
        w.request_outcome(1, Some(&[0xff, 0xfe]), Outcome::Failure, 2);
        assert!(w.is_ejected(1) && !w.is_ejected(0));
        // The same address as the choice: its own outcome, a success.
        w.request_outcome(0, Some(b" 127.0.0.1:8000 "), Outcome::Success, 3);
        assert_eq!(w.health().failures(), &[0, 3]);
        assert!(!w.is_ejected(0));
        // Out of range: ignored, never a panic.
        w.request_outcome(7, Some(b"127.0.0.1:8000"), Outcome::Failure, 4);
    }

    #[test]
    fn a_worker_applies_the_others_working_sets_from_its_first_request() {
        let store = crate::store::tests::MemStore::default();
        let (mut a, mut b) = (worker("kv_load"), worker("kv_load"));
        a.claim_worker_id(&store);
        b.claim_worker_id(&store);
        let ids: Vec<String> = (0..4_000).map(|i| i.to_string()).collect();
        let body = format!(r#"{{"prompt":[{}]}}"#, ids.join(","));
        for id in 0..2 {
            a.route_body(id, "/v1/completions", body.as_bytes(), Some("s"), 5);
            a.release(id);
        }
        let held = |w: &RouterState| w.working_set(0).0 + w.working_set(1).0;
        assert!(held(&a) > 0.0, "a asked for its prompt twice");
        a.share_load(&store, 10);
        b.share_load(&store, 10);
        assert_eq!(held(&b), 0.0, "b has routed nothing: it applies nothing");
        b.route_body(1, "/v1/completions", br#"{"prompt":[7,8,9]}"#, None, 15);
        b.share_load(&store, 20);
        assert_eq!(
            held(&b),
            held(&a),
            "from its first request on, b applies a's journal"
        );
    }

    #[test]
    fn health_is_shared_between_workers() {
        let store = crate::store::tests::MemStore::default();
        let mut a = worker("least_load");
        let mut b = worker("least_load");
        a.claim_worker_id(&store);
        b.claim_worker_id(&store);
        for t in 0..3 {
            a.request_outcome(1, None, Outcome::Failure, t);
        }
        assert!(a.is_ejected(1) && !b.is_ejected(1));
        a.share_load(&store, 10);
        b.share_load(&store, 10);
        assert!(b.is_ejected(1), "b learns it from a's record");
        let body = br#"{"prompt":[1,2,3,4,5,6,7,8]}"#;
        for id in 0..20 {
            let d = b.route_body(id, "/v1/completions", body, None, 20);
            assert_eq!(d.replica, 0, "only r0 is usable (no probe due yet)");
            b.release(id);
        }
        // A second later b claims the probe for the proxy and sends it to r1, with r0 as its
        // backup; a, a moment later, finds it claimed and routes as usual.
        b.claim_probe(b.shared(&store), 1_020);
        let d = b.route_body(99, "/v1/completions", body, None, 1_020);
        assert!(d.probe && d.replica == 1 && d.backup == Some(0), "{d:?}");
        assert_eq!(b.destination(&d), "127.0.0.1:8001,127.0.0.1:8000");
        a.claim_probe(a.shared(&store), 1_030);
        let d = a.route_body(100, "/v1/completions", body, None, 1_030);
        assert!(!d.probe && d.replica == 0, "{d:?}");
        a.claim_probe(a.shared(&store), 2_019);
        assert!(
            !a.route_body(101, "/v1/completions", body, None, 2_019)
                .probe
        );
        a.claim_probe(a.shared(&store), 2_020);
        assert!(
            a.route_body(102, "/v1/completions", body, None, 2_020)
                .probe
        );
    }

    /// nginx mode: one feed poll a tick, the replicas in turn; Envoy: every due replica at once.
    #[test]
    fn nginx_mode_sends_one_callout_a_tick_in_turn() {
        let json = |output: &str| {
            format!(
                r#"{{"replicas":[
                {{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0","feed_address":"127.0.0.1:8000"}},
                {{"name":"r1","endpoint":"127.0.0.1:8001","feed_cluster":"f1","feed_address":"127.0.0.1:8001"}},
                {{"name":"r2","endpoint":"127.0.0.1:8002","feed_cluster":"f2","feed_address":"127.0.0.1:8002"}}],
               "output":"{output}","feed_period_ms":100,"tick_ms":100,"feed_timeout_ms":500}}"#
            )
        };
        let mut envoy = RouterState::new(
            FilterConfig::from_json(json("destination_header").as_bytes()).unwrap(),
        )
        .unwrap();
        envoy.start_tick(0);
        assert_eq!(envoy.plan_polls(None, 0).len(), 3);
        let mut w =
            RouterState::new(FilterConfig::from_json(json("nginx_variable").as_bytes()).unwrap())
                .unwrap();
        assert_eq!(w.callouts_per_tick(), 1);
        let mut order = Vec::new();
        for tick in 0..6u64 {
            let now = tick * 100;
            w.start_tick(now);
            let due = w.plan_polls(None, now);
            assert_eq!(due.len(), 1, "tick {tick}");
            assert!(
                w.plan_polls(None, now).is_empty(),
                "the tick's callout is spent"
            );
            order.push(due[0].replica);
            w.poll_not_started(due[0].replica, "refused", now);
        }
        assert_eq!(order, [0, 1, 2, 0, 1, 2]);
        // While a poll is out, no other is sent (the module would keep the connection of one
        // answered meanwhile), until it is answered, or counts as lost.
        w.start_tick(600);
        let due = w.plan_polls(None, 600);
        assert_eq!(due.len(), 1);
        w.poll_started(due[0].replica, 7, 600);
        for now in [700, 800, 2_500] {
            w.start_tick(now);
            assert!(w.plan_polls(None, now).is_empty(), "at {now}: one is out");
        }
        w.start_tick(2_601);
        assert_eq!(
            w.plan_polls(None, 2_601).len(),
            1,
            "the one out counts as lost"
        );
        w.on_feed_response(7, None, None, None, 3_001);
        w.start_tick(3_100);
        assert_eq!(w.plan_polls(None, 3_100).len(), 1);
        assert!(!w.callout_out(3_100));
    }

    #[test]
    fn inference_paths() {
        assert!(is_inference_path(b"/v1/completions"));
        assert!(is_inference_path(b"/v1/chat/completions?x=1"));
        assert!(!is_inference_path(b"/v1/completionsX"));
        assert!(!is_inference_path(b"/v1/models"));
    }

    /// One endpoint with 4 DP ranks beside a plain replica: five units, the ranks polled with their
    /// rank, an answer for another rank (or an out-of-range one) refused and counted, the rank's own
    /// answer applied to that rank alone, and the decision carrying the rank header's value.
    #[test]
    fn dp_ranks_are_units_with_their_own_feed_and_rank_header() {
        let json = r#"{"replicas":[
            {"name":"e0","endpoint":"127.0.0.1:8000","feed_cluster":"f0","dp_ranks":4},
            {"name":"e1","endpoint":"127.0.0.1:8001","feed_cluster":"f1"}],
           "routing":{"policy":"kv_load","block_size":4}}"#;
        let mut w = RouterState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap();
        assert_eq!(w.replicas(), 5);
        assert_eq!(w.replica_name(2), "e0_dp2");
        assert_eq!(w.replica_name(4), "e1");
        let due = w.plan_polls(None, 0);
        assert_eq!(due.len(), 5);
        assert!(due[2].path.ends_with("&rank=2"), "{}", due[2].path);
        assert_eq!(due[2].upstream, "f0");
        assert!(!due[4].path.contains("rank"), "{}", due[4].path);
        for (i, p) in due.iter().enumerate() {
            w.poll_started(p.replica, 10 + i as u32, 0);
        }
        let prompt = br#"{"prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#;
        let req = w
            .router
            .read_request("/v1/completions", prompt, None)
            .unwrap();
        let hashes: Vec<u64> = match &req.identity {
            kvsteer_core::PromptIdentity::Exact(h) => h.iter().map(|h| h.0).collect(),
            other => panic!("{other:?}"),
        };
        let snap = FeedBatch::snapshot(3, hashes.clone());
        // Rank 2's poll answered by rank 1, then by rank 900: refused, counted, nothing stored.
        for (token, bad) in [(12, 1u16), (10, 900)] {
            let r = w.on_feed_response(token, Some(200), Some(&snap.encode_for_rank(bad)), None, 5);
            assert!(
                matches!(r, FeedResult::Failed { cause: FeedFailure::WrongRank { reported }, .. } if reported == bad),
                "{r:?}"
            );
        }
        assert_eq!(w.rank_mismatches(), 2);
        assert_eq!(w.stats().index_blocks, 0);
        w.poll_started(2, 30, 300);
        let r = w.on_feed_response(30, Some(200), Some(&snap.encode_for_rank(2)), None, 300);
        assert!(matches!(r, FeedResult::Applied { replica: 2, .. }), "{r:?}");
        assert!(w.index_holds(2, hashes[0]));
        assert!(!w.index_holds(1, hashes[0]) && !w.index_holds(3, hashes[0]));
        // The plain replica takes an answer whatever rank it names (an externally balanced rank).
        let r = w.on_feed_response(14, Some(200), Some(&snap.encode_for_rank(7)), None, 300);
        assert!(matches!(r, FeedResult::Applied { replica: 4, .. }), "{r:?}");
        w.poll_started(4, 31, 600);
        // The request goes to rank 2 of e0 (its prefix is there; e1's copy ties, then rank 2 wins on
        // nothing else: make e1 busy first).
        let busy = br#"{"prompt":[99,98,97,96,95,94,93,92]}"#;
        for id in 0..4 {
            let d = w.route_body(id, "/v1/completions", busy, None, 600);
            if d.replica != 4 {
                w.release(id);
            }
        }
        let d = w.route_body(50, "/v1/completions", prompt, None, 600);
        assert_eq!(d.replica, 2, "{d:?}");
        assert_eq!(w.rank_value(&d), Some("2"));
        assert_eq!(w.destination(&d).split(',').next(), Some("127.0.0.1:8000"));
        let mut plain = d.clone();
        plain.replica = 4;
        assert_eq!(w.rank_value(&plain), None);
        plain.replica = 99;
        assert_eq!(
            w.rank_value(&plain),
            None,
            "out of range: no header, no panic"
        );
        // An answer from the chosen rank's own address is its own, not a retry to rank 0.
        for t in 0..3 {
            w.request_outcome(2, Some(b"127.0.0.1:8000"), Outcome::Failure, 700 + t);
        }
        assert!(w.is_ejected(2) && !w.is_ejected(0));
    }

    #[test]
    fn feed_applies_and_staleness_comes_and_goes() {
        let mut w = worker("kv_load");
        let due = w.plan_polls(None, 0);
        assert_eq!(due.len(), 2);
        assert!(due[0].path.starts_with("/kvsteer/feed?epoch=0"));
        assert_eq!(
            (due[1].upstream.as_str(), due[1].authority.as_str()),
            ("f1", "127.0.0.1:8001")
        );
        w.poll_started(0, 7, 0);
        w.poll_started(1, 8, 0);
        assert!(
            w.plan_polls(None, 0).is_empty(),
            "one poll in flight per replica"
        );
        let snap = FeedBatch {
            epoch: 3,
            resync: true,
            more: false,
            first_seq: 5,
            next_seq: 5,
            load: ReplicaLoad::default(),
            events: vec![
                FeedEvent::Cleared,
                FeedEvent::Stored {
                    tier: Tier::Gpu,
                    hashes: vec![1, 2, 3],
                },
            ],
        };
        let r = w.on_feed_response(7, Some(200), Some(&snap.encode()), None, 10);
        assert!(matches!(r, FeedResult::Applied { replica: 0, .. }), "{r:?}");
        assert_eq!(w.stats().index_blocks, 3);
        // Replica 1 fails twice: stale after the second.
        let r = w.on_feed_response(8, None, None, None, 10);
        assert!(matches!(
            r,
            FeedResult::Failed {
                became_stale: false,
                ..
            }
        ));
        w.poll_started(1, 9, 300);
        let r = w.on_feed_response(9, Some(200), Some(b"garbage"), None, 300);
        assert!(
            matches!(
                r,
                FeedResult::Failed {
                    became_stale: true,
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(w.is_stale(1) && w.router.is_stale(1));
        w.poll_started(1, 10, 600);
        let mut ok = snap.clone();
        ok.events.clear();
        w.on_feed_response(10, Some(200), Some(&ok.encode()), None, 600);
        assert!(!w.is_stale(1), "recovers when the feed returns");
        assert_eq!(
            w.on_feed_response(999, Some(200), None, None, 0),
            FeedResult::Unknown
        );
    }

    #[test]
    fn unreadable_bodies_fall_back_and_are_counted() {
        let mut w = worker("kv_load");
        let d = w.route_body(1, "/v1/completions", b"{not json", None, 0);
        assert!(d.replica < 2);
        assert_eq!(w.body_fallbacks()[BodyFallback::Unreadable as usize], 1);
        let d = w.route_body(2, "/v1/completions", &[0xff; 10], None, 0);
        assert!(d.replica < 2);
        assert_eq!(w.body_fallbacks()[BodyFallback::Unreadable as usize], 2);
        assert!(w.release(1));
        assert!(w.release(2));
    }

    #[cfg(feature = "tokenizer")]
    #[test]
    fn a_configured_tokenizer_gives_chat_prompts_exact_token_counts() {
        let json = r#"{"replicas":[{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}],
            "tokenizer":{"vocabulary":"o200k_harmony","chat_template":"kvsteer_sim"}}"#;
        let mut w = RouterState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap();
        let body = br#"{"messages":[{"role":"user","content":"hello world"}]}"#;
        let d = w.route_body(1, "/v1/chat/completions", body, None, 0);
        // <|start|> user \n hello world <|end|> \n <|start|> assistant \n
        assert_eq!(d.prompt_tokens, 10);
        let t = w.tokenizer.as_ref().unwrap().stats();
        assert_eq!(t.exact, 1);
        let d = w.route_body(
            2,
            "/v1/chat/completions",
            br#"{"messages":[{"role":"x"}]}"#,
            None,
            0,
        );
        assert!(d.fallback.is_none());
        assert_eq!(w.tokenizer.as_ref().unwrap().stats().fallbacks[1], 1);
        // Without the section nothing changes: no tokenizer.
        assert!(worker("kv_load").tokenizer.is_none());
        let bad = json.replace("kvsteer_sim", "nope");
        let e = RouterState::new(FilterConfig::from_json(bad.as_bytes()).unwrap()).err();
        assert!(e.unwrap().0.contains("tokenizer.chat_template"));
        let typo = json.replace("\"vocabulary\"", "\"vocab\"");
        assert!(FilterConfig::from_json(typo.as_bytes()).is_err());
    }

    #[test]
    fn session_hash_is_sticky_through_the_worker() {
        let mut w = worker("session_hash");
        let body = br#"{"model":"m","prompt":"hello there"}"#;
        let a = w
            .route_body(1, "/v1/completions", body, Some("s-1"), 0)
            .replica;
        for id in 2..20 {
            assert_eq!(
                w.route_body(id, "/v1/completions", body, Some("s-1"), 0)
                    .replica,
                a
            );
        }
    }

    #[test]
    fn merge_marks_a_relayed_report_with_the_leaders_poll_time_and_shares_bookings_since() {
        use crate::store::tests::MemStore;
        let store = MemStore::default();
        let routing = r#"{"policy":"kv_load","kv_load":{"reported_load":"merge"}}"#;
        let mut lead = worker_routing(routing);
        let mut follow = worker_routing(routing);
        assert_eq!(lead.claim_worker_id(&store), Some(0));
        assert_eq!(follow.claim_worker_id(&store), Some(1));
        let batch = |resync: bool, decode: u64| FeedBatch {
            epoch: 5,
            resync,
            more: false,
            first_seq: 0,
            next_seq: 0,
            load: ReplicaLoad {
                decode_blocks: decode,
                running: 1,
                ..ReplicaLoad::default()
            },
            events: if resync {
                vec![FeedEvent::Cleared]
            } else {
                vec![]
            },
        };
        for (w, base) in [(&mut lead, 100), (&mut follow, 200)] {
            for p in w.plan_polls(Some(&store), 0) {
                let tok = base + p.replica as u32;
                w.poll_started(p.replica, tok, 0);
                let b = batch(true, 0).encode();
                w.on_feed_response(tok, Some(200), Some(&b), Some(&store), 0);
            }
        }
        // The leader polls at 1,000; the follower admits a request at 1,050, while the poll is out;
        // the answer (which cannot hold that request) comes back at 1,100 and is relayed.
        let polls = lead.plan_polls(Some(&store), 1_000);
        assert_eq!(polls.len(), 2);
        for p in &polls {
            lead.poll_started(p.replica, 900 + p.replica as u32, 1_000);
        }
        let body = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#;
        let d = follow.route_body(1, "/v1/completions", body, None, 1_050);
        for p in &polls {
            let b = batch(false, 7).encode();
            let tok = 900 + p.replica as u32;
            lead.on_feed_response(tok, Some(200), Some(&b), Some(&store), 1_100);
        }
        assert_eq!(follow.follow_relays(&store, 1_150).len(), 2);
        assert_eq!(follow.router.report_polled_ms(d.replica), Some(1_000));
        let mine = follow.router.local_load_since()[d.replica];
        assert_eq!(mine.active_requests, 1, "admitted after the poll went out");
        assert_eq!(mine.decode_blocks, 2, "17 tokens: 2 blocks of 16");
        let eff = follow.router.effective_load()[d.replica];
        assert_eq!((eff.decode_blocks, eff.active_requests), (7 + 2, 1 + 1));
        // The leader learns the follower's booking through shared data, and adds it to the report.
        follow.share_load(&store, 1_150);
        lead.share_load(&store, 1_150);
        let eff = lead.router.effective_load()[d.replica];
        assert_eq!((eff.decode_blocks, eff.active_requests), (7 + 2, 1 + 1));
        let other = 1 - d.replica;
        assert_eq!(lead.router.effective_load()[other].decode_blocks, 7);
    }

    #[test]
    fn a_follower_of_an_idle_replica_stays_fresh_and_takes_its_load() {
        use crate::store::tests::MemStore;
        let store = MemStore::default();
        // Reports combined by max, so the relayed load shows in what the policies see.
        let routing = r#"{"policy":"kv_load","kv_load":{"reported_load":"max"}}"#;
        let mut lead = worker_routing(routing);
        let mut follow = worker_routing(routing);
        lead.worker_id = Some(0);
        follow.worker_id = Some(1);
        let snap = |epoch| FeedBatch {
            epoch,
            resync: true,
            more: false,
            first_seq: 0,
            next_seq: 0,
            load: ReplicaLoad::default(),
            events: vec![FeedEvent::Cleared],
        };
        // Both start with their own snapshots (no lease needed for a resync).
        for (w, base) in [(&mut lead, 100), (&mut follow, 200)] {
            let due = w.plan_polls(Some(&store), 0);
            assert_eq!(due.len(), 2);
            for p in due {
                let i = p.replica;
                w.poll_started(i, base + i as u32, 0);
                w.on_feed_response(
                    base + i as u32,
                    Some(200),
                    Some(&snap(5).encode()),
                    Some(&store),
                    0,
                );
            }
        }
        // From now on only the lease holder polls; the follower reads the relay.
        let mut t = 0;
        for round in 1..=20u32 {
            t += 200;
            let polls = lead.plan_polls(Some(&store), t);
            assert_eq!(polls.len(), 2, "round {round}: the leader polls both");
            assert!(
                follow.plan_polls(Some(&store), t).is_empty(),
                "follower does not poll"
            );
            for p in polls {
                let i = p.replica;
                let token = 1000 * round + i as u32;
                lead.poll_started(i, token, t);
                let mut idle = snap(5);
                idle.resync = false;
                idle.load.decode_blocks = round as u64;
                idle.events.clear();
                let r =
                    lead.on_feed_response(token, Some(200), Some(&idle.encode()), Some(&store), t);
                assert!(matches!(r, FeedResult::Applied { .. }), "{r:?}");
            }
            let got = follow.follow_relays(&store, t);
            assert_eq!(got.len(), 2, "round {round}: one relayed batch per replica");
            assert!(follow.check_staleness(t).is_empty(), "round {round}");
        }
        assert!(!follow.is_stale(0) && !follow.is_stale(1));
        assert_eq!(
            follow.router.effective_load()[0].decode_blocks,
            20,
            "reported load arrives"
        );
    }

    #[test]
    fn unreachable_replicas_go_down_http_errors_only_stale() {
        use crate::store::tests::MemStore;
        let store = MemStore::default();
        let mut w = worker("kv_load");
        let mut follower = worker("kv_load");
        w.worker_id = Some(0);
        follower.worker_id = Some(1);
        // Make worker 0 the lease holder of both feeds.
        for f in &mut w.feeds {
            f.leased = true;
        }
        let mut token = 0;
        let mut poll = |w: &mut RouterState, replica: usize, status: Option<u16>, t: u64| {
            token += 1;
            w.poll_started(replica, token, t);
            w.on_feed_response(token, status, None, Some(&store), t)
        };
        // Replica 1 answers HTTP 503 (feed outage on a live server): stale, never down.
        for t in 0..4 {
            poll(&mut w, 1, Some(503), t * 200);
        }
        assert!(w.is_stale(1) && !w.is_down(1));
        // Replica 0 cannot be reached: down after two (stale_after_failures) in a row.
        let r = poll(&mut w, 0, None, 0);
        assert!(matches!(
            r,
            FeedResult::Failed {
                became_down: false,
                ..
            }
        ));
        let r = poll(&mut w, 0, None, 200);
        assert!(
            matches!(
                r,
                FeedResult::Failed {
                    became_down: true,
                    ..
                }
            ),
            "{r:?}"
        );
        assert!(w.router.is_down(0));
        for id in 0..20 {
            let d = w.route_body(id, "/v1/completions", br#"{"prompt":[1,2,3]}"#, None, 300);
            assert_eq!(d.replica, 1, "the down replica is avoided");
            assert_eq!(
                w.destination(&d),
                "127.0.0.1:8001",
                "no down backup offered"
            );
        }
        // The follower learns it from shared data.
        follower.follow_health(&store);
        assert!(follower.router.is_down(0) && !follower.router.is_down(1));
        // Back: one good answer brings it up, for both.
        let mut snap = FeedBatch {
            epoch: 1,
            resync: true,
            more: false,
            first_seq: 0,
            next_seq: 0,
            load: ReplicaLoad::default(),
            events: vec![FeedEvent::Cleared],
        };
        snap.events.clear();
        w.poll_started(0, 99, 400);
        w.on_feed_response(99, Some(200), Some(&snap.encode()), Some(&store), 400);
        assert!(!w.router.is_down(0));
        follower.follow_health(&store);
        assert!(!follower.router.is_down(0));
    }

    #[test]
    fn the_destination_header_lists_a_backup_for_retries() {
        let mut w = worker("kv_load");
        let d = w.route_body(1, "/v1/completions", br#"{"prompt":[1,2,3]}"#, None, 0);
        let v = w.destination(&d);
        let parts: Vec<&str> = v.split(',').collect();
        assert_eq!(parts.len(), 2, "{v}");
        assert_ne!(parts[0], parts[1]);
        w.cfg.retry_backup = false;
        assert!(!w.destination(&d).contains(','));
    }

    #[test]
    fn envoy_local_replies_for_unreachable_hosts_mean_down() {
        let envoy_503 = b"upstream connect error or disconnect/reset before headers. reset reason: remote connection failure";
        assert!(proxy_could_not_connect(503, Some(envoy_503)));
        assert!(proxy_could_not_connect(503, Some(b"no healthy upstream")));
        // A timeout is a slow feed, not an unreachable replica.
        assert!(!proxy_could_not_connect(
            504,
            Some(b"upstream request timeout")
        ));
        assert!(proxy_timed_out(504, Some(b"upstream request timeout")));
        assert!(!proxy_timed_out(
            504,
            Some(b"gateway timeout from the replica")
        ));
        assert!(!proxy_timed_out(503, Some(envoy_503)));
        // The replica's own feed outage: stale, not down.
        assert!(!proxy_could_not_connect(
            503,
            Some(br#"{"error":{"message":"feed outage"}}"#)
        ));
        assert!(!proxy_could_not_connect(500, Some(envoy_503)));
        assert!(!proxy_could_not_connect(503, None));

        let mut w = worker("kv_load");
        for t in 0..2 {
            w.poll_started(0, 50 + t, t as u64 * 200);
            w.on_feed_response(50 + t, Some(503), Some(envoy_503), None, t as u64 * 200);
        }
        assert!(w.is_down(0));
    }

    #[test]
    fn workers_share_their_load_through_the_store_and_forget_silent_ones() {
        use crate::store::tests::MemStore;
        let store = MemStore::default();
        let (mut a, mut b) = (worker("least_load"), worker("least_load"));
        let mut lone = worker("least_load");
        lone.share_load(&store, 0);
        assert!(
            store.0.borrow().is_empty(),
            "nothing shared without a worker number"
        );
        assert_eq!(a.claim_worker_id(&store), Some(0));
        assert_eq!(b.claim_worker_id(&store), Some(1));
        assert!(a.shared(&store).is_some() && lone.shared(&store).is_none());
        let body = br#"{"prompt":[1,2,3,4,5,6,7,8]}"#;
        let d = a.route_body(1, "/v1/completions", body, None, 0);
        a.share_load(&store, 0);
        b.share_load(&store, 0);
        let seen = b.router.effective_load()[d.replica];
        assert_eq!(seen, a.router.local_load()[d.replica], "b sees a's request");
        assert_eq!(seen.active_requests, 1);
        // b's own admission lands elsewhere: least_load counts a's request.
        assert_ne!(
            b.route_body(2, "/v1/completions", body, None, 0).replica,
            d.replica
        );
        // a goes quiet: past peer_ttl_ms its record is dropped.
        let ttl = b.config().peer_ttl_ms;
        b.share_load(&store, ttl + 1);
        assert_eq!(b.router.effective_load()[d.replica].active_requests, 0);
        assert!(a.release(1));
    }

    /// Two replicas, `stale_after_failures` 2, the given extra top-level fields.
    fn worker_with(extra: &str) -> RouterState {
        let json = format!(
            r#"{{"replicas":[
                {{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}},
                {{"name":"r1","endpoint":"127.0.0.1:8001","feed_cluster":"f1"}}],
               "stale_after_failures": 2 {extra}}}"#
        );
        RouterState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
    }

    fn snapshot(epoch: u64, keys: std::ops::Range<u64>) -> FeedBatch {
        FeedBatch::snapshot(epoch, keys.collect())
    }

    #[test]
    fn slow_and_oversized_feeds_go_stale_but_never_down() {
        let mut w = worker_with(r#", "feed_max_bytes": 1000, "feed_max_events": 4"#);
        let timeout = b"upstream request timeout".as_slice();
        let mut token = 0;
        let mut poll = |w: &mut RouterState, replica: usize, status, body: Option<&[u8]>, t| {
            token += 1;
            w.poll_started(replica, token, t);
            w.on_feed_response(token, status, body, None, t)
        };
        // r0 times out, again and again: stale after two, never down.
        for n in 0..6u64 {
            let r = poll(&mut w, 0, Some(504), Some(timeout), n * 200);
            assert!(
                matches!(
                    r,
                    FeedResult::Failed {
                        cause: FeedFailure::Slow,
                        became_down: false,
                        ..
                    }
                ),
                "{r:?}"
            );
        }
        assert!(w.is_stale(0) && !w.is_down(0));
        assert_eq!(w.feed(0).unwrap().timeouts, 6);
        // r1 answers 200 with a valid snapshot over the byte cap, then one with too many events.
        let big = snapshot(3, 0..200).encode();
        assert!(big.len() > 1000);
        let r = poll(&mut w, 1, Some(200), Some(&big), 0);
        assert!(
            matches!(
                r,
                FeedResult::Failed {
                    cause: FeedFailure::Oversized,
                    ..
                }
            ),
            "{r:?}"
        );
        let mut many = snapshot(3, 0..1);
        many.events = vec![FeedEvent::Cleared; 5];
        let r = poll(&mut w, 1, Some(200), Some(&many.encode()), 200);
        assert!(
            matches!(
                r,
                FeedResult::Failed {
                    cause: FeedFailure::Oversized,
                    became_stale: true,
                    became_down: false,
                    ..
                }
            ),
            "{r:?}"
        );
        assert_eq!(w.stats().index_blocks, 0, "nothing of either was applied");
        assert_eq!(w.feed(1).unwrap().oversized, 2);
        // The proxy reports the size first: refused unread, same verdict.
        w.poll_started(1, 900, 400);
        let r = w.on_feed_response_oversized(900, Some(200), 50 << 20, None, 400);
        assert!(matches!(
            r,
            FeedResult::Failed {
                cause: FeedFailure::Oversized,
                became_down: false,
                ..
            }
        ));
        assert_eq!(w.feed(1).unwrap().oversized, 3);
        assert!(w.feed(1).unwrap().in_flight.is_none());
        // Both still get traffic (by load): neither is avoided.
        let mut seen = [false; 2];
        for id in 0..20 {
            let d = w.route_body(id, "/v1/completions", br#"{"prompt":[1,2,3]}"#, None, 500);
            seen[d.replica] = true;
        }
        assert_eq!(seen, [true, true]);
        // A reset connection, on the other hand, is unreachable: down after two.
        for n in 0..2u64 {
            poll(&mut w, 0, None, None, 1000 + n * 200);
        }
        assert!(w.is_down(0));
        // And a timeout after that neither adds to nor clears it.
        poll(&mut w, 0, Some(504), Some(timeout), 1400);
        assert!(w.is_down(0));
    }

    #[test]
    fn on_a_clock_that_runs_out_at_once_each_tick_still_applies_a_first_slice() {
        // Every read of this clock is 1 ms after the last: the 500 us budget is spent by the first
        // slice, so a tick applies exactly the first slice owed to each batch with work left.
        fn slow_clock() -> u64 {
            thread_local!(static T: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });
            T.with(|t| {
                t.set(t.get() + 1_000_000);
                t.get()
            })
        }
        let mut w = worker_with("");
        w.set_clock(slow_clock);
        w.start_tick(0);
        for p in w.plan_polls(None, 0) {
            w.poll_started(p.replica, 10 + p.replica as u32, 0);
        }
        let big = snapshot(1, 0..10_000).encode();
        w.on_feed_response(10, Some(200), Some(&big), None, 0);
        // The cleared event (one unit, short of the first slice's 256) and 256 hashes, not the
        // 8,192 of the block budget.
        assert_eq!(w.stats().index_blocks, 256);
        let mut ticks = 0;
        while w.pending_blocks() > 0 {
            let before = w.stats().index_blocks;
            ticks += 1;
            w.start_tick(ticks * 100);
            assert_eq!(
                w.stats().index_blocks - before,
                w.stats().index_blocks.min(before + 256) - before
            );
            assert!(ticks < 100, "the batch never completed");
        }
        assert_eq!(w.stats().index_blocks, 10_000);
        assert_eq!(ticks, 39, "(10,000 - 256) / 256 rounded up");
        assert!(w.feed_time_cuts() >= 39);
    }

    #[test]
    fn a_large_snapshot_is_applied_in_slices_across_ticks() {
        let mut w = worker_with(r#", "feed_apply_blocks_per_tick": 1000"#);
        w.start_tick(0);
        for p in w.plan_polls(None, 0) {
            w.poll_started(p.replica, 10 + p.replica as u32, 0);
        }
        // r0: 10,000 blocks. At most 1,000 units (hashes or events) per tick.
        let big = snapshot(1, 0..10_000).encode();
        let r = w.on_feed_response(10, Some(200), Some(&big), None, 0);
        assert!(
            matches!(
                r,
                FeedResult::Applied {
                    outcome: FeedOutcome::Reset { events: 2, .. },
                    ..
                }
            ),
            "{r:?}"
        );
        assert_eq!(
            w.stats().index_blocks,
            999,
            "the cleared event and 999 hashes"
        );
        assert_eq!(w.pending_blocks(), 9001);
        // r1's small batch arrives in the same tick: the budget is spent, it waits for the next.
        let small = snapshot(1, 50_000..50_010).encode();
        w.on_feed_response(11, Some(200), Some(&small), None, 10);
        assert_eq!(w.pending_blocks(), 9011);
        assert!(!w.index_holds(1, 50_000));
        // Neither is polled while its batch is pending; neither goes stale.
        let mut ticks = 0;
        let mut t = 0;
        while w.pending_blocks() > 0 {
            t += 100;
            let before = w.stats().index_blocks;
            w.start_tick(t);
            ticks += 1;
            assert!(w.stats().index_blocks - before <= 1000, "tick {ticks}");
            if ticks == 1 {
                assert!(w.index_holds(1, 50_009), "the even split serves r1 at once");
            }
            let polls = w.plan_polls(None, t);
            assert!(
                w.pending_blocks() == 0 || polls.iter().all(|p| p.replica != 0),
                "no poll of a replica still applying"
            );
            // r1 is not polled again here, so it may go quiet; r0 is busy, not quiet.
            w.check_staleness(t);
            assert!(w.pending_blocks() == 0 || !w.is_stale(0), "tick {ticks}");
            assert!(ticks < 20);
        }
        assert_eq!(ticks, 10);
        assert_eq!(w.stats().index_blocks, 10_010);
        assert!(w.index_holds(0, 9_999));
        assert_eq!(w.feed(0).unwrap().deferred, 1);
        assert!(
            w.plan_polls(None, t).iter().any(|p| p.replica == 0),
            "polled again once done"
        );
    }

    #[test]
    fn a_follower_applies_relayed_batches_in_slices_and_in_order() {
        use crate::store::tests::MemStore;
        let store = MemStore::default();
        let extra = r#", "feed_apply_blocks_per_tick": 500"#;
        let (mut lead, mut follow) = (worker_with(extra), worker_with(extra));
        lead.worker_id = Some(0);
        follow.worker_id = Some(1);
        // Both take their own snapshot of an empty r0, then the leader holds the lease.
        for (w, token) in [(&mut lead, 1), (&mut follow, 2)] {
            w.start_tick(0);
            w.poll_started(0, token, 0);
            w.on_feed_response(
                token,
                Some(200),
                Some(&snapshot(4, 0..0).encode()),
                Some(&store),
                0,
            );
        }
        lead.feeds[0].leased = true;
        // Two incremental batches relayed: 2,000 hashes, then 10.
        let inc = |first: u64, keys: std::ops::Range<u64>| FeedBatch {
            epoch: 4,
            resync: false,
            more: false,
            first_seq: first,
            next_seq: first + 1,
            load: ReplicaLoad::default(),
            events: vec![FeedEvent::Stored {
                tier: Tier::Gpu,
                hashes: keys.collect(),
            }],
        };
        lead.start_tick(0);
        for (token, b) in [(3, inc(0, 0..2000)), (4, inc(1, 9000..9010))] {
            lead.poll_started(0, token, 0);
            lead.on_feed_response(token, Some(200), Some(&b.encode()), Some(&store), 0);
            // The leader needs several ticks too; its next poll waits for them.
            while lead.pending_blocks() > 0 {
                lead.start_tick(0);
            }
        }
        assert_eq!(lead.stats().index_blocks, 2010);
        let mut ticks = 0;
        while !follow.index_holds(0, 9009) {
            follow.start_tick(100 * ticks);
            follow.follow_relays(&store, 100 * ticks);
            ticks += 1;
            assert!(follow.stats().index_blocks <= 500 * ticks);
            assert!(ticks < 10);
        }
        assert_eq!(
            ticks, 5,
            "2,000 hashes at 500 a tick, then the second batch"
        );
        assert_eq!(follow.stats().index_blocks, 2010);
        assert_eq!(follow.stats().feed_gaps, 0, "applied in order, no resync");
    }
}
