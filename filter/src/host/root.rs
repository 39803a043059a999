//! The root context: the VM's configuration (`on_configure`) and its tick (`on_tick`: load shared
//! with the other workers, feeds polled and followed, peer proxies polled, metrics brought up to
//! date), and the answers to the callouts the tick sent.

use super::clock::{now_ms, now_ns};
use super::metrics::{Metrics, gateway_counter};
use super::store::host_store;
use super::stream::Stream;
use super::vm::{Pool, Shared, Vm, callout_body, callout_status, log};
use crate::config::GatewayConfig;
use crate::host::abi;
use crate::worker::{DiscoveryResult, FeedPoll, FeedResult, WorkerState};
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{BufferType, ContextType, LogLevel};
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

#[derive(Default)]
pub struct Root {
    vm: Option<Shared>,
}

impl Root {
    /// One pool's worker state and metrics, configured and logged; `None` (logged) when the
    /// router refuses the configuration.
    fn configure_pool(
        name: Option<String>,
        cfg: crate::config::FilterConfig,
        node_id: &[u8],
    ) -> Option<Pool> {
        let mut state = match WorkerState::new(cfg) {
            Ok(s) => s,
            Err(e) => {
                let at = name
                    .as_deref()
                    .map_or(String::new(), |n| format!("pool {n}: "));
                log(
                    LogLevel::Error,
                    &format!("kvsteer: configuration refused: {at}{e}"),
                );
                return None;
            }
        };
        state.set_proxy_identity(node_id);
        state.set_pd_nonce(pd_nonce(node_id));
        let metrics = Metrics::define(state.config(), name.as_deref());
        state.set_clock(now_ns);
        state.claim_worker_id(host_store(state.config()));
        let pool = name
            .as_deref()
            .map_or(String::new(), |n| format!("pool {n}: "));
        log(
            LogLevel::Info,
            &format!(
                "kvsteer: {pool}configured {} replicas, policy {}, worker {:?}, node id {:?}",
                state.replicas(),
                state.config().routing.policy.name(),
                state.worker_id(),
                String::from_utf8_lossy(node_id)
            ),
        );
        for warning in state.config().warnings() {
            log(LogLevel::Warn, &format!("kvsteer: {pool}{warning}"));
        }
        #[cfg(feature = "tokenizer")]
        if let Some(f) = state
            .config()
            .tokenizer
            .as_ref()
            .and_then(kvsteer_tokenizer::TextTokenizer::deferred)
        {
            log(
                LogLevel::Info,
                &format!(
                    "kvsteer: {pool}tokenizer bundle to be fetched from {} {} (sha256 {}); text \
                     prompts keep the approximate identity until it is loaded",
                    f.cluster, f.path, f.sha256
                ),
            );
        }
        Some(Pool {
            name,
            state,
            metrics,
        })
    }

    fn poll_feeds(vm: &mut Pool, now: u64) {
        let timeout = Duration::from_millis(vm.state.config().feed_timeout_ms);
        let store = vm.state.shared(host_store(vm.state.config()));
        if let Some(store) = store {
            for r in vm.state.follow_relays(store, now) {
                Self::report_feed(vm, &r);
            }
            vm.state.follow_health(store);
        }
        for replica in vm.state.check_staleness(now) {
            let name = vm.replica_name(replica);
            log(
                LogLevel::Warn,
                &format!("kvsteer: no feed from {name} lately; routing it by load only"),
            );
        }
        for poll in vm.state.plan_polls(store, now) {
            Self::send_feed_poll(vm, poll, timeout, now);
        }
    }

    fn send_feed_poll(vm: &mut Pool, poll: FeedPoll, timeout: Duration, now: u64) {
        let FeedPoll {
            replica,
            upstream,
            authority,
            path,
            took_lease,
            destination,
        } = poll;
        if took_lease {
            let name = vm.replica_name(replica);
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
        let mut headers = vec![
            (":method", "GET"),
            (":path", path.as_str()),
            (":authority", authority.as_str()),
            ("accept", kvsteer_core::feed::FEED_CONTENT_TYPE),
        ];
        // A discovered member's feed is reached through one cluster holding every member, whose
        // override_host picks the host from the destination header.
        let destination_header = vm.state.config().destination_header.clone();
        if let Some(d) = destination.as_deref() {
            headers.push((destination_header.as_str(), d));
        }
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

    /// Polls the peer proxies that are due for their working-set journals (`peers`).
    fn poll_peers(vm: &mut Pool, now: u64) {
        let Some(p) = vm.state.config().peers.clone() else {
            return;
        };
        let timeout = Duration::from_millis(p.timeout_ms);
        for call in vm.state.plan_peer_polls(now) {
            let headers = vec![
                (":method", "GET"),
                (":path", call.path.as_str()),
                (":authority", call.authority.as_str()),
                ("accept", crate::worker::exchange::BUNDLE_CONTENT_TYPE),
                (p.token_header.as_str(), p.token.as_str()),
            ];
            match abi::dispatch_http_call(&call.upstream, headers, None, timeout) {
                Ok(token) => vm.state.peer_poll_started(call.peer, token, now),
                Err(_) => vm.state.peer_poll_not_started(call.peer, now),
            }
        }
    }

    fn report_feed(vm: &Pool, r: &FeedResult) {
        let FeedResult::Failed {
            replica,
            cause,
            reason,
            became_stale,
            became_down,
        } = r
        else {
            return;
        };
        vm.metrics.feed_failed(*replica, *cause);
        let name = vm.replica_name(*replica);
        if *became_down {
            log(
                LogLevel::Warn,
                &format!("kvsteer: {name} is unreachable ({reason}); avoiding it"),
            );
        }
        if *became_stale {
            log(
                LogLevel::Warn,
                &format!("kvsteer: feed of {name} is stale ({reason}); routing it by load only"),
            );
        }
    }

    /// Adopts the roster other workers wrote, then polls the discovery source when due.
    fn poll_discovery(vm: &mut Pool, now: u64) {
        let store = vm.state.shared(host_store(vm.state.config()));
        vm.state.sync_roster(store, now);
        let Some(poll) = vm.state.plan_discovery_poll(now) else {
            return;
        };
        let headers = vec![
            (":method", "GET"),
            (":path", poll.path.as_str()),
            (":authority", poll.authority.as_str()),
            ("accept", "application/json"),
        ];
        let timeout = Duration::from_millis(poll.timeout_ms);
        match abi::dispatch_http_call(&poll.upstream, headers, None, timeout) {
            Ok(token) => vm.state.discovery_poll_started(token, now),
            Err(status) => {
                vm.state.discovery_poll_not_started(now);
                log(
                    LogLevel::Warn,
                    &format!(
                        "kvsteer: discovery poll of {} not dispatched ({status:?}); membership kept",
                        poll.upstream
                    ),
                );
            }
        }
    }

    /// The discovery source's answer: refused unread when too large, checked whole before use.
    fn on_discovery_answer(vm: &mut Pool, token: u32, status: Option<u16>, body_size: usize) {
        let limit = vm
            .state
            .config()
            .discovery
            .as_ref()
            .map_or(0, |d| d.max_response_bytes);
        let store = vm.state.shared(host_store(vm.state.config()));
        let now = now_ms();
        let r = if body_size > limit {
            // Refused before it is copied into the VM.
            vm.state.on_discovery_oversized(token, body_size)
        } else {
            let body = callout_body(body_size);
            vm.state
                .on_discovery_answer(token, status, body.as_deref(), store, now)
        };
        match r {
            DiscoveryResult::Changed {
                joined,
                left,
                vacated,
                members,
            } => log(
                LogLevel::Info,
                &format!(
                    "kvsteer: discovery: {members} members ({joined} joined, {left} leaving, {vacated} slots vacated)"
                ),
            ),
            DiscoveryResult::Refused(why) => log(
                LogLevel::Warn,
                &format!(
                    "kvsteer: discovery answer refused ({}): {why}; the last good membership stays",
                    why.kind()
                ),
            ),
            DiscoveryResult::Failed(why) => log(
                LogLevel::Warn,
                &format!("kvsteer: discovery poll failed: {why}; the last good membership stays"),
            ),
            DiscoveryResult::Unchanged | DiscoveryResult::Unknown => {}
        }
    }

    /// A peer proxy's answer: refused unread when too large, checked whole before use.
    fn on_peer_answer(vm: &mut Pool, token: u32, status: Option<u16>, body_size: usize) {
        let fits = vm.state.peer_answer_fits(body_size);
        let body = if fits && status == Some(200) {
            callout_body(body_size)
        } else {
            None
        };
        vm.state
            .on_peer_answer(token, status, body.as_deref(), !fits, now_ms());
    }

    fn on_feed_answer(vm: &mut Pool, token: u32, status: Option<u16>, body_size: usize) {
        let store = vm.state.shared(host_store(vm.state.config()));
        let r = if body_size > vm.state.config().feed_max_bytes {
            // Refused before it is copied into the VM, let alone parsed.
            vm.state
                .on_feed_response_oversized(token, status, body_size, store, now_ms())
        } else {
            // A body the proxy will not hand over reads as none: a failed poll.
            let body = callout_body(body_size);
            vm.state
                .on_feed_answer(token, status, body, store, now_ms())
        };
        Self::report_feed(vm, &r);
    }
}

/// The plugin configuration as the proxy hands it over, parsed and checked; `None` (logged) when
/// the proxy does not hand it over or it is refused.
fn read_configuration() -> Option<GatewayConfig> {
    let bytes = match abi::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX) {
        Ok(b) => b.unwrap_or_default(),
        Err(e) => {
            log(
                LogLevel::Error,
                &format!(
                    "kvsteer: configuration refused: the proxy did not hand it over (status {e})"
                ),
            );
            return None;
        }
    };
    match GatewayConfig::from_json(&bytes) {
        Ok(c) => Some(c),
        Err(e) => {
            log(
                LogLevel::Error,
                &format!("kvsteer: configuration refused: {e}"),
            );
            None
        }
    }
}

/// Envoy's node id (`--service-node` or the bootstrap's `node.id`; Istio makes it unique per pod):
/// the same in every worker of one proxy, different between proxies, so independent proxies break
/// ties differently. A host without it (nginx) or an empty id keeps `routing.seed`. Envoy names the
/// node `xds.node` (its CEL attributes); older builds and other hosts `node`.
fn node_id() -> Vec<u8> {
    [vec!["xds", "node", "id"], vec!["node", "id"]]
        .into_iter()
        .find_map(|path| abi::get_property(&path).ok().flatten())
        .unwrap_or_default()
}

/// A random nonce for this VM's P/D request ids, which must not repeat across workers, proxies or
/// restarts (the std hasher's keys come from the host's random source, WASI `random_get`).
fn pd_nonce(node_id: &[u8]) -> u64 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one((now_ns(), node_id))
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
        let status = callout_status(num_headers);
        let mut vm = vm.borrow_mut();
        // Each pool sends its own callouts; tokens are the host's, unique in the VM. An unknown
        // token goes to the first pool, which ignores it as before pools.
        let p = if vm.pools.len() == 1 {
            0
        } else {
            vm.pools
                .iter()
                .position(|p| p.state.owns_callout(token))
                .unwrap_or(0)
        };
        let Some(vm) = vm.pools.get_mut(p) else {
            return;
        };
        #[cfg(feature = "tokenizer")]
        if vm.state.is_bundle_fetch(token) {
            super::bundle::on_bundle_answer(vm, status, body_size);
            return;
        }
        if vm.state.is_discovery_poll(token) {
            Self::on_discovery_answer(vm, token, status, body_size);
        } else if vm.state.is_peer_poll(token) {
            Self::on_peer_answer(vm, token, status, body_size);
        } else {
            Self::on_feed_answer(vm, token, status, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(mut gateway) = read_configuration() else {
            return false;
        };
        let node_id = node_id();
        let mut pools = Vec::with_capacity(gateway.pools.len());
        for p in std::mem::take(&mut gateway.pools) {
            match Self::configure_pool(p.name, p.cfg, &node_id) {
                Some(pool) => pools.push(pool),
                None => return false,
            }
        }
        let Some(tick_ms) = pools.first().map(|p| p.state.config().tick_ms) else {
            return false;
        };
        let tick = Duration::from_millis(tick_ms);
        let pooled = gateway.pooled();
        let define = |name: &str| pooled.then(|| gateway_counter(name)).flatten();
        self.vm = Some(Rc::new(RefCell::new(Vm {
            models_unknown: define("kvsteer_models_unknown"),
            models_missing: define("kvsteer_models_missing"),
            pools,
            gateway,
            poll_cursor: 0,
            early_held: 0,
            body_held: 0,
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
        let vm = &mut *vm;
        // ngx_wasm_module keeps the connection of a callout answered while another of the VM's
        // is out: where a tick's callouts are bounded, the bound (one a tick, none while one is
        // out) is the VM's, and the pools take turns at it.
        let n = vm.pools.len();
        let bounded = n > 1 && vm.pools[0].state.callouts_per_tick() != usize::MAX;
        let mut held = bounded && vm.pools.iter().any(|p| p.state.callout_out(now));
        let mut next = None;
        let start = if bounded { vm.poll_cursor % n } else { 0 };
        for k in 0..n {
            let i = (start + k) % n;
            let vm = &mut vm.pools[i];
            let store = host_store(vm.state.config());
            vm.state.share_load(store, now);
            // This tick's feed budget, spent first on batches earlier ticks left half applied.
            vm.state.start_tick(now);
            if held {
                vm.state.hold_callouts();
            }
            Self::poll_discovery(vm, now);
            Self::poll_feeds(vm, now);
            Self::poll_peers(vm, now);
            #[cfg(feature = "tokenizer")]
            super::bundle::fetch_bundle(vm, now);
            vm.metrics.update(&vm.state);
            if bounded && !held && vm.state.callouts_planned() > 0 {
                held = true;
                next = Some(i + 1);
            }
        }
        if let Some(c) = next {
            vm.poll_cursor = c;
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream::new(self.vm.clone(), context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
