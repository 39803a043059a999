//! The root context: the VM's configuration (`on_configure`) and its tick (`on_tick`: load shared
//! with the other workers, feeds polled and followed, peer proxies polled, metrics brought up to
//! date), and the answers to the callouts the tick sent.

use super::clock::{now_ms, now_ns};
use super::metrics::Metrics;
use super::store::host_store;
use super::stream::Stream;
use super::vm::{Shared, Vm, callout_body, callout_status, log};
use crate::config::FilterConfig;
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
            Self::send_feed_poll(vm, poll, timeout, now);
        }
    }

    fn send_feed_poll(vm: &mut Vm, poll: FeedPoll, timeout: Duration, now: u64) {
        let FeedPoll {
            replica,
            upstream,
            authority,
            path,
            took_lease,
            destination,
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
                ("accept", crate::worker::exchange::BUNDLE_CONTENT_TYPE),
                (p.token_header.as_str(), p.token.as_str()),
            ];
            match abi::dispatch_http_call(&call.upstream, headers, None, timeout) {
                Ok(token) => vm.state.peer_poll_started(call.peer, token, now),
                Err(_) => vm.state.peer_poll_not_started(call.peer, now),
            }
        }
    }

    fn report_feed(vm: &Vm, r: &FeedResult) {
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
                &format!("kvsteer: feed of {name} is stale ({reason}); routing it by load only"),
            );
        }
    }

    /// Adopts the roster other workers wrote, then polls the discovery source when due.
    fn poll_discovery(vm: &mut Vm, now: u64) {
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
    fn on_discovery_answer(vm: &mut Vm, token: u32, status: Option<u16>, body_size: usize) {
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
    fn on_peer_answer(vm: &mut Vm, token: u32, status: Option<u16>, body_size: usize) {
        let fits = vm.state.peer_answer_fits(body_size);
        let body = if fits && status == Some(200) {
            callout_body(body_size)
        } else {
            None
        };
        vm.state
            .on_peer_answer(token, status, body.as_deref(), !fits, now_ms());
    }

    fn on_feed_answer(vm: &mut Vm, token: u32, status: Option<u16>, body_size: usize) {
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
fn read_configuration() -> Option<FilterConfig> {
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
    match FilterConfig::from_json(&bytes) {
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
        #[cfg(feature = "tokenizer")]
        if vm.state.is_bundle_fetch(token) {
            super::bundle::on_bundle_answer(&mut vm, status, body_size);
            return;
        }
        if vm.state.is_discovery_poll(token) {
            Self::on_discovery_answer(&mut vm, token, status, body_size);
        } else if vm.state.is_peer_poll(token) {
            Self::on_peer_answer(&mut vm, token, status, body_size);
        } else {
            Self::on_feed_answer(&mut vm, token, status, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Some(cfg) = read_configuration() else {
            return false;
        };
        let mut state = match WorkerState::new(cfg) {
            Ok(s) => s,
            Err(e) => {
                log(
                    LogLevel::Error,
                    &format!("kvsteer: configuration refused: {e}"),
                );
                return false;
            }
        };
        let node_id = node_id();
        state.set_proxy_identity(&node_id);
        state.set_pd_nonce(pd_nonce(&node_id));
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
                    "kvsteer: tokenizer bundle to be fetched from {} {} (sha256 {}); text prompts \
                     keep the approximate identity until it is loaded",
                    f.cluster, f.path, f.sha256
                ),
            );
        }
        self.vm = Some(Rc::new(RefCell::new(Vm {
            state,
            metrics,
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
        let store = host_store(vm.state.config());
        vm.state.share_load(store, now);
        // This tick's feed budget, spent first on batches earlier ticks left half applied.
        vm.state.start_tick(now);
        Self::poll_discovery(&mut vm, now);
        Self::poll_feeds(&mut vm, now);
        Self::poll_peers(&mut vm, now);
        #[cfg(feature = "tokenizer")]
        super::bundle::fetch_bundle(&mut vm, now);
        let vm = &mut *vm;
        vm.metrics.update(&vm.state);
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Stream::new(self.vm.clone(), context_id)))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}
