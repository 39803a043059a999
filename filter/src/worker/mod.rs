//! One worker VM's routing state ([`WorkerState`]), free of host calls so it can be tested
//! natively. The proxy-wasm contexts ([`crate::host`]) call its methods, one per thing that happened
//! or is to be done, and only move bytes to and from the host. The state is a composition of parts,
//! each owning its fields with its own tests; this file holds the composition and the requests'
//! routing, and each other job has its own room in `worker/`:
//!
//! - [`feeds`]: when to poll each replica's feed, and its answers; [`pollers`]: the poll state per
//!   replica and the callouts out;
//! - [`relay`]: one feed poll per replica for the whole proxy (the lease) and the batches relayed
//!   to the other workers; [`follow`]: following the holder's relayed batches and its word on down
//!   replicas;
//! - [`failures`]: what a failed poll means (stale, down);
//! - [`budget`]: each tick's budgets ([`TickBudget`]), and accepted feed batches applied in slices
//!   within them;
//! - [`discovery`]: membership at run time, polled and seated in the slots after the static list
//!   (its [`discovery::roster`]);
//! - [`share`]: the load, health, working set and text-prompt records this worker shares with the
//!   proxy's other workers, and its worker number ([`Sharing`]);
//! - [`exchange`]: the working-set exchange with other proxies (`peers`);
//! - [`admission`]: classes and shedding before a request is booked ([`AdmissionGate`]);
//! - [`counters`]: the request path's own counters (bookings, fallbacks, removed headers);
//! - [`health`]: request outcomes and health probes;
//! - [`leg_booking`] and [`leg_bodies`]: prefill/decode requests split into two legs, booked
//!   ([`PdLegs`]: the roles and the legs' request ids) and carried out;
//! - [`output`]: where and how a decision is written for the proxy (the destinations);
//! - [`prompts`]: the text-prompt tokenizer ([`Prompts`]); `bundle` (full build): a Hugging Face
//!   tokenizer bundle fetched at run time, checked and loaded.

mod admission;
mod budget;
#[cfg(feature = "tokenizer")]
pub mod bundle;
mod counters;
pub mod discovery;
pub mod exchange;
mod failures;
mod feeds;
mod follow;
mod health;
pub mod leg_bodies;
mod leg_booking;
mod output;
mod pollers;
mod prompts;
pub mod relay;
pub mod share;

pub use admission::AdmissionGate;
pub use budget::{FEED_MIN_SLICE, TickBudget};
pub use counters::RequestCounters;
pub use discovery::{DiscoveryPoll, DiscoveryResult, DiscoveryState};
pub use failures::{FeedFailure, proxy_could_not_connect, proxy_timed_out};
pub use feeds::{FeedPoll, FeedResult};
pub use health::{Origin, answer_outcome};
pub use leg_booking::{PdLegs, PdRoute};
pub use output::{DecisionOutput, Destinations};
pub use pollers::{FeedPollers, FeedState};
pub use prompts::Prompts;
pub use share::{Sharing, WORKING_SET_KEEP_TICKS};

use crate::config::{ConfigError, FilterConfig};
use crate::worker::exchange::Exchange;
use kvsteer_core::request::EarlyScan;
use kvsteer_core::router::{Decision, Router, RouterStats};

/// Request paths the filter routes; everything else passes through untouched.
pub const INFERENCE_PATHS: [&str; 2] = ["/v1/completions", "/v1/chat/completions"];

/// Whether `path` (query string allowed) is an inference request the filter routes.
pub fn is_inference_path(path: &[u8]) -> bool {
    let path = path.split(|&b| b == b'?').next().unwrap_or(path);
    INFERENCE_PATHS.iter().any(|p| p.as_bytes() == path)
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
    /// Holding it would pass `body_hold_max_bytes`: routed before it arrived, unread.
    HoldLimit,
}

/// One VM's (one proxy worker's) routing state: its configuration and the core `Router`, composed
/// with the parts that own the rest ([`FeedPollers`], [`TickBudget`], [`DiscoveryState`],
/// [`RequestCounters`], [`Sharing`], [`Destinations`], [`Prompts`], [`PdLegs`], [`Exchange`],
/// [`AdmissionGate`]); its methods are what happened or is to be done, each delegating to a part or
/// coordinating the router with one.
///
/// Over 30 methods: it is the one entry point the proxy-wasm contexts call, a method per event.
pub struct WorkerState {
    cfg: FilterConfig,
    router: Router,
    /// The feed pollers: each unit's poll state and the callouts out.
    feeds: FeedPollers,
    /// Membership read at run time (`discovery`): the roster and its poll.
    discovery: DiscoveryState,
    /// Bookings, body fallbacks, removed headers, unblamed failures.
    counters: RequestCounters,
    /// This worker's number, and what it took in of the other workers' journals.
    sharing: share::Sharing,
    /// This tick's budgets: feed work, and callouts in nginx mode.
    budget: TickBudget,
    /// Every value [`WorkerState::destination`] and [`WorkerState::rank_value`] can write, formatted
    /// once per VM and again per membership (see [`Destinations`]).
    destinations: Destinations,
    /// The text-prompt tokenizer and its bundle's fetch (full build only).
    prompts: Prompts,
    /// The P/D roles and the P/D requests' ids.
    pd: PdLegs,
    /// The working-set exchange with other proxies (`peers`; [`crate::worker::exchange`]).
    exchange: Exchange,
    /// Priority classes and shedding (`routing.admission`), and their counters.
    admission: AdmissionGate,
}

/// Per unit, the first unit with its address: the ranks of one endpoint share it, and a retry
/// backup is taken from another one.
fn address_groups(units: &[crate::config::Unit]) -> Vec<usize> {
    units
        .iter()
        .map(|r| {
            units
                .iter()
                .position(|o| o.endpoint == r.endpoint)
                .unwrap_or(0)
        })
        .collect()
}

impl WorkerState {
    pub fn new(cfg: FilterConfig) -> Result<WorkerState, ConfigError> {
        let mut router = Router::new(cfg.routing.clone(), cfg.units.len())
            .map_err(|e| ConfigError::at("routing", e.to_string()))?;
        router.set_address_groups(address_groups(&cfg.units));
        let feeds = FeedPollers::new(cfg.units.len());
        let prompts = Prompts::new(&cfg)?;
        let destinations = Destinations::new(&cfg);
        let pd = PdLegs::new(&cfg);
        let exchange = Exchange::new(&cfg);
        let discovery = DiscoveryState::new(cfg.units.len() - cfg.static_units());
        // Discovery's slots start empty: nothing is routed to them until a member is seated.
        for unit in cfg.static_units()..cfg.units.len() {
            router.set_membership(unit, kvsteer_core::router::Membership::Vacant);
        }
        let admission = AdmissionGate::new(&cfg);
        Ok(WorkerState {
            exchange,
            discovery,
            admission,
            pd,
            prompts,
            destinations,
            cfg,
            router,
            feeds,
            counters: RequestCounters::default(),
            sharing: share::Sharing::default(),
            budget: TickBudget::default(),
        })
    }

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
            // Only where a replica must load the request's LoRA adapter: the header of a fleet
            // without adapters reads as before.
            if t.adapter != 0.0 {
                out.push_str(&format!(" adapter={:.4}", t.adapter));
            }
            // Only where `kv_time.later_weight` is on and the fleet has a backlog.
            if t.later != 0.0 {
                out.push_str(&format!(" later={:.4}", t.later));
            }
        }
        Some(out)
    }

    /// The plugin configuration (read-only).
    pub fn config(&self) -> &FilterConfig {
        &self.cfg
    }

    /// Number of replicas.
    pub fn replicas(&self) -> usize {
        self.cfg.units.len()
    }

    /// A replica's name, for logs (`?` for an unknown index).
    pub fn replica_name(&self, replica: usize) -> &str {
        self.cfg.units.get(replica).map_or("?", |r| r.name.as_str())
    }

    /// The working-set term's view of a replica, in blocks: (its recent working set, 0 with the term
    /// off; its cache size as the policy prices it, configured or from the feed, 0 while unknown).
    pub fn working_set(&self, replica: usize) -> (f64, f64) {
        (
            self.router.working_set_blocks(replica),
            self.router.priced_cache_blocks(replica),
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
    pub fn body_fallbacks(&self) -> [u64; 5] {
        self.counters.body_fallbacks()
    }

    /// The text-prompt tokenizer's counters, when one is configured.
    #[cfg(feature = "tokenizer")]
    pub fn tokenizer_stats(&self) -> Option<kvsteer_tokenizer::TokenizerStats> {
        self.prompts.stats()
    }

    /// A client's copy of the routing header was removed.
    pub fn spoofed_header_removed(&mut self) {
        self.counters.spoofed_header_removed();
    }

    /// Client copies of the routing header removed so far.
    pub fn spoofed_headers(&self) -> u64 {
        self.counters.spoofed_headers()
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
    /// (`early_body_scan`), the body will be routed by [`WorkerState::route_body_early`] (not in
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

    /// [`WorkerState::route_body`] for a body an [`EarlyScan`] followed as it arrived.
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
        let tok = self.prompts.tokenizer();
        let (d, unread) = self
            .router
            .route_body_early(request_id, path, body, session, tok, early, now_ms);
        self.counters.booked(1);
        if unread.is_some() {
            self.counters.fallback(BodyFallback::Unreadable);
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
        self.counters.fallback(why);
        self.counters.booked(1);
        if self.pd.disaggregated() {
            return self
                .router
                .route_unread_pd(request_id, body_bytes, self.pd.roles(), now_ms);
        }
        self.router.route_unread(request_id, body_bytes, now_ms)
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
        self.counters.released(released);
        released
    }

    /// Whether this VM has routed a request: only such a VM applies the other workers'
    /// working-set journals (`share_load`) and so only it has a working set worth reporting.
    pub fn has_routed(&self) -> bool {
        self.counters.has_booked()
    }

    /// Bookings made and released so far (requests, and each leg of a P/D request).
    pub fn bookings(&self) -> (u64, u64) {
        self.counters.bookings()
    }
}

/// Workers built from small configurations, for the unit tests of every part of the state.
#[cfg(test)]
mod testing {
    pub use super::*;
    pub use kvsteer_core::feed::FeedBatch;

    pub fn worker(policy: &str) -> WorkerState {
        worker_routing(&format!(r#"{{"policy":"{policy}"}}"#))
    }

    /// Two replicas with the given `routing` section.
    pub fn worker_routing(routing: &str) -> WorkerState {
        let json = format!(
            r#"{{"replicas":[
                {{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}},
                {{"name":"r1","endpoint":"127.0.0.1:8001","feed_cluster":"f1"}}],
               "routing":{routing}, "stale_after_failures": 2}}"#
        );
        WorkerState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
    }

    /// Two replicas, `stale_after_failures` 2, the given extra top-level fields.
    pub fn worker_with(extra: &str) -> WorkerState {
        let json = format!(
            r#"{{"replicas":[
                {{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f0"}},
                {{"name":"r1","endpoint":"127.0.0.1:8001","feed_cluster":"f1"}}],
               "stale_after_failures": 2 {extra}}}"#
        );
        WorkerState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap()
    }

    pub fn snapshot(epoch: u64, keys: std::ops::Range<u64>) -> FeedBatch {
        FeedBatch::snapshot(epoch, keys.collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::testing::*;

    #[test]
    fn inference_paths() {
        assert!(is_inference_path(b"/v1/completions"));
        assert!(is_inference_path(b"/v1/chat/completions?x=1"));
        assert!(!is_inference_path(b"/v1/completionsX"));
        assert!(!is_inference_path(b"/v1/models"));
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
        let mut w = WorkerState::new(FilterConfig::from_json(json.as_bytes()).unwrap()).unwrap();
        let body = br#"{"messages":[{"role":"user","content":"hello world"}]}"#;
        let d = w.route_body(1, "/v1/chat/completions", body, None, 0);
        // <|start|> user \n hello world <|end|> \n <|start|> assistant \n
        assert_eq!(d.prompt_tokens, 10);
        let t = w.tokenizer_stats().unwrap();
        assert_eq!(t.exact, 1);
        let d = w.route_body(
            2,
            "/v1/chat/completions",
            br#"{"messages":[{"role":"x"}]}"#,
            None,
            0,
        );
        assert!(d.fallback.is_none());
        assert_eq!(w.tokenizer_stats().unwrap().fallbacks[1], 1);
        // Without the section nothing changes: no tokenizer.
        assert!(worker("kv_load").tokenizer_stats().is_none());
        let bad = json.replace("kvsteer_sim", "nope");
        let e = WorkerState::new(FilterConfig::from_json(bad.as_bytes()).unwrap()).err();
        assert!(e.unwrap().to_string().contains("tokenizer.chat_template"));
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
}
