//! kvsteer's routing core as a WebAssembly component: the world `router-component` of the WIT package
//! `kvsteer:router@0.1.0` (`wit/router.wit`), built for `wasm32-wasip2` (`scripts/component`).
//!
//! This crate is an adapter and nothing more: every decision is `kvsteer_core::Router`'s, called the
//! way the proxy-wasm filter calls it (`filter/src/worker/mod.rs`: read the body, route, admit under
//! the request id; a body that cannot be read is routed by load and tracked at `bytes / 4` tokens).
//! What is here converts between the core's Rust types and the WIT records and variants, so that a
//! component host sees the same decisions the filter makes (`host-test/tests/component.rs` checks it).

use std::cell::RefCell;

use kvsteer_core::feed::{FeedBatch, FeedError as CoreFeedError};
use kvsteer_core::{
    ConfigError as CoreConfigError, Decision as CoreDecision, FallbackReason as CoreFallback,
    FeedOutcome as CoreFeedOutcome, LoadTotals as CoreLoadTotals, PolicyKind,
    RequestError as CoreRequestError, Router as CoreRouter, RoutingConfig,
};

wit_bindgen::generate!({
    path: "../wit",
    world: "router-component",
});

use exports::kvsteer::router::routing::{Guest, GuestRouter, Router as RouterHandle};
use kvsteer::router::types::{
    ConfigError, Decision, EventFault, FallbackReason, FeedError, FeedOutcome, FeedQuery,
    LoadTotals, Policy, ReplicaLoad, Request, RequestError, ResetInfo, RouterStats, SizeLimit,
};

/// The exported component.
pub struct Component;

impl Guest for Component {
    type Router = Routing;
}

/// One router instance: one proxy worker's routing brain. Resource methods take `&self`, and a
/// component instance is single-threaded, so the core router sits in a `RefCell`.
pub struct Routing {
    inner: RefCell<CoreRouter>,
}

impl Routing {
    /// Parses the configuration and builds the core router (what `configure` does, minus the handle).
    pub fn new(config_json: &str, replicas: u32) -> Result<Routing, ConfigError> {
        let cfg = RoutingConfig::from_json(config_json).map_err(config_error)?;
        let router = CoreRouter::new(cfg, replicas as usize).map_err(config_error)?;
        Ok(Routing {
            inner: RefCell::new(router),
        })
    }
}

impl GuestRouter for Routing {
    fn configure(config_json: String, replicas: u32) -> Result<RouterHandle, ConfigError> {
        Routing::new(&config_json, replicas).map(RouterHandle::new)
    }

    fn feed_query(&self, replica: u32, max_events: u32) -> FeedQuery {
        let q = self.inner.borrow().feed_query(replica as usize, max_events);
        FeedQuery {
            epoch: q.epoch,
            cursor: q.cursor,
            max_events: q.max_events,
            path: q.to_path(),
        }
    }

    fn apply_feed(&self, replica: u32, payload: Vec<u8>) -> Result<FeedOutcome, FeedError> {
        let batch = FeedBatch::decode(&payload).map_err(feed_error)?;
        Ok(
            match self.inner.borrow_mut().apply_feed(replica as usize, &batch) {
                CoreFeedOutcome::Applied { events } => FeedOutcome::Applied(saturate(events)),
                CoreFeedOutcome::Reset { events, epoch } => FeedOutcome::Reset(ResetInfo {
                    events: saturate(events),
                    epoch,
                }),
                CoreFeedOutcome::Gap => FeedOutcome::Gap,
                CoreFeedOutcome::BadReplica => FeedOutcome::BadReplica,
            },
        )
    }

    fn set_stale(&self, replica: u32, stale: bool) {
        self.inner.borrow_mut().set_stale(replica as usize, stale);
    }

    fn set_down(&self, replica: u32, down: bool) {
        self.inner.borrow_mut().set_down(replica as usize, down);
    }

    fn route(
        &self,
        request_id: u64,
        request: Request,
        now_ms: u64,
    ) -> Result<Decision, RequestError> {
        let mut router = self.inner.borrow_mut();
        let req = router
            .read_request(&request.path, &request.body, request.session_key.as_deref())
            .map_err(request_error)?;
        Ok(decision(&router.route_and_admit(request_id, &req, now_ms)))
    }

    fn route_unread(&self, request_id: u64, body_bytes: u64, now_ms: u64) -> Decision {
        let mut router = self.inner.borrow_mut();
        // The WIT interface carries the size as u64; a body beyond usize cannot have been buffered.
        let bytes = usize::try_from(body_bytes).unwrap_or(usize::MAX);
        decision(&router.route_unread(request_id, bytes, now_ms))
    }

    fn first_token(&self, request_id: u64) {
        self.inner.borrow_mut().first_token(request_id);
    }

    fn decode_progress(&self, request_id: u64, generated_tokens: u64) {
        self.inner
            .borrow_mut()
            .decode_progress(request_id, generated_tokens);
    }

    fn done(&self, request_id: u64) -> bool {
        self.inner.borrow_mut().release(request_id)
    }

    fn load(&self) -> Vec<ReplicaLoad> {
        let router = self.inner.borrow();
        let tracked = router.local_load();
        let effective = router.effective_load();
        let decisions = router.stats().decisions;
        (0..router.replicas())
            .map(|r| ReplicaLoad {
                tracked: totals(tracked.get(r)),
                effective: totals(effective.get(r)),
                stale: router.is_stale(r),
                down: router.is_down(r),
                decisions: decisions.get(r).copied().unwrap_or(0),
            })
            .collect()
    }

    fn stats(&self) -> RouterStats {
        let s = self.inner.borrow().stats();
        RouterStats {
            prompt_tokens: s.prompt_tokens,
            matched_tokens: s.matched_tokens,
            active_requests: s.active_requests,
            release_anomalies: s.release_anomalies,
            index_blocks: s.index_blocks,
            index_evictions: s.index_evictions,
            feed_events: s.feed_events,
            feed_gaps: s.feed_gaps,
            feed_resets: s.feed_resets,
            fallbacks: s.fallback_no_session_key
                + s.fallback_below_match_threshold
                + s.fallback_body_unreadable,
            bad_replica: s.bad_replica,
        }
    }
}

fn saturate(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn totals(t: Option<&CoreLoadTotals>) -> LoadTotals {
    let t = t.copied().unwrap_or_default();
    LoadTotals {
        prefill_tokens: t.prefill_tokens,
        decode_blocks: t.decode_blocks,
        active_requests: t.active_requests,
    }
}

fn config_error(e: CoreConfigError) -> ConfigError {
    ConfigError {
        field: e.field,
        message: e.message,
    }
}

fn request_error(e: CoreRequestError) -> RequestError {
    match e {
        CoreRequestError::TooLarge { len, max } => RequestError::TooLarge(SizeLimit {
            len: len as u64,
            max: max as u64,
        }),
        CoreRequestError::UnsupportedPath(p) => RequestError::UnsupportedPath(p),
        CoreRequestError::NotUtf8 => RequestError::NotUtf8,
        CoreRequestError::Json(m) => RequestError::Json(m),
        CoreRequestError::MissingPrompt => RequestError::MissingPrompt,
        CoreRequestError::BadPrompt(m) => RequestError::BadPrompt(m.to_string()),
    }
}

fn feed_error(e: CoreFeedError) -> FeedError {
    match e {
        CoreFeedError::TooShort { len } => FeedError::TooShort(len as u64),
        CoreFeedError::BadMagic => FeedError::BadMagic,
        CoreFeedError::UnsupportedVersion(v) => FeedError::UnsupportedVersion(v),
        CoreFeedError::UnknownFlags(v) => FeedError::UnknownFlags(v),
        CoreFeedError::BadEventKind { index, kind } => {
            FeedError::BadEventKind(EventFault { index, value: kind })
        }
        CoreFeedError::BadTier { index, tier } => {
            FeedError::BadTier(EventFault { index, value: tier })
        }
        CoreFeedError::Truncated { index } => FeedError::Truncated(index),
        CoreFeedError::TrailingBytes { extra } => FeedError::TrailingBytes(extra as u64),
        CoreFeedError::InconsistentSequence => FeedError::InconsistentSequence,
        CoreFeedError::BadAdapters(what) => FeedError::BadAdapters(what.to_string()),
    }
}

fn policy(p: PolicyKind) -> Policy {
    match p {
        PolicyKind::RoundRobin => Policy::RoundRobin,
        PolicyKind::LeastLoad => Policy::LeastLoad,
        PolicyKind::SessionHash => Policy::SessionHash,
        PolicyKind::PrefixAffinity => Policy::PrefixAffinity,
        PolicyKind::KvAffinity => Policy::KvAffinity,
        PolicyKind::KvLoad => Policy::KvLoad,
        PolicyKind::KvTime => Policy::KvTime,
        PolicyKind::AdapterAffinity => Policy::AdapterAffinity,
    }
}

fn decision(d: &CoreDecision) -> Decision {
    Decision {
        replica: saturate(d.replica),
        backup: d.backup.map(saturate),
        policy: policy(d.policy),
        fallback: d.fallback.map(|f| match f {
            CoreFallback::NoSessionKey => FallbackReason::NoSessionKey,
            CoreFallback::BelowMatchThreshold => FallbackReason::BelowMatchThreshold,
            CoreFallback::BodyUnreadable => FallbackReason::BodyUnreadable,
        }),
        prompt_tokens: d.prompt_tokens,
        matched_tokens: d.matched_tokens.clone(),
        costs: d.costs.clone(),
    }
}

// Only the wasm32 build exports the component's functions: their names (`kvsteer:router/...#[method]`)
// are not valid in a native linker's version script, and `cargo test --workspace` links this crate's
// cdylib natively.
#[cfg(target_arch = "wasm32")]
export!(Component);
