//! A request in a prefill/decode fleet (docs/design/pd.md): both legs booked, the prefill leg sent
//! as a callout while the client's request is held, then the request sent on as the decode leg with
//! the prefill answer's `kv_transfer_params`; a leg that fails ends in a 502 naming it.

use super::clock::now_ms;
use super::metrics::inc;
use super::store::host_store;
use super::stream::{Phase, Stream};
use super::vm::{Pool, callout_status, header, log};
use crate::host::abi;
use crate::worker::PdRoute;
use crate::worker::leg_bodies::{self, LegFailure, PrefillAnswer};
use kvsteer_core::health::Outcome;
use kvsteer_core::request::RouteRequest;
use kvsteer_core::router::Decision;
use proxy_wasm::types::{Action, BufferType, LogLevel, MapType};
use std::time::Duration;

/// A P/D request's prefill leg while its callout is out.
pub(super) struct PrefillLeg {
    pub(super) token: u32,
    replica: usize,
    /// Where the decode leg goes once the prefill leg has answered.
    decode: Decision,
    /// The client's request, rewritten into the decode leg.
    client: serde_json::Map<String, serde_json::Value>,
    request_id: String,
    /// A probe of an ejected prefill replica: where the leg goes if it fails (replica, its cached
    /// prompt tokens, the request to book it with).
    backup: Option<(usize, u64, Box<RouteRequest>)>,
}

/// The load-table id of a stream's prefill leg: outside the 32-bit context ids the decode leg (and
/// every other request) is booked under.
pub(super) fn prefill_id(stream: u64) -> u64 {
    stream | 1 << 32
}

/// Replaces the buffered request body, keeping a `content-length` the client sent true.
pub(super) fn replace_request_body(old_len: usize, body: &[u8]) -> Result<(), u32> {
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

/// Sends a prefill leg to `prefill`'s cluster: the callout's token, or why it could not be sent.
fn send_prefill(
    vm: &Pool,
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

impl Stream {
    /// A P/D request (docs/design/pd.md): books both legs and sends the prefill leg as a callout, holding
    /// the request until it answers ([`Stream::on_prefill_answer`]); a body that cannot be split goes
    /// whole to a decode replica; with no prefill replica up the client gets a 503.
    pub(super) fn route_pd(&mut self, body: &[u8]) -> Action {
        let Some(vm) = self.vm.clone() else {
            return Action::Continue;
        };
        let mut vm = vm.borrow_mut();
        let vm = &mut vm.pools[self.pool];
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
                vm.metrics.decision(&decision);
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
            PdRoute::Unavailable { replica, why } => self.refuse_unavailable(vm, replica, &why),
            PdRoute::Legs {
                prefill,
                decode,
                client,
                prefill_body,
                prefill_matched_tokens,
                prefill_backup,
            } => {
                vm.metrics.split(&decode, prefill_matched_tokens);
                let request_id = vm.state.next_pd_request_id();
                match send_prefill(vm, prefill, &self.path, &prefill_body, &request_id) {
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
                        let name = vm.state.replica_name(prefill);
                        log(
                            LogLevel::Warn,
                            &format!("kvsteer: the prefill leg on {name} {why}"),
                        );
                        self.fail_leg(vm, "prefill", prefill, &why);
                    }
                }
                Action::Pause
            }
        }
    }

    /// Answers a P/D request no prefill replica can take (`replica`: the one chosen, when the
    /// failure is its) with a 503; nothing was booked for it.
    fn refuse_unavailable(&mut self, vm: &Pool, replica: Option<usize>, why: &str) -> Action {
        inc(vm.metrics.pd_unavailable, 1);
        let name = replica.map_or("any replica that prefills", |r| vm.state.replica_name(r));
        log(
            LogLevel::Warn,
            &format!("kvsteer: P/D request refused: {name} {why}"),
        );
        let err = leg_bodies::error_body(503, "prefill", name, why);
        self.phase = Phase::Released;
        Self::send_error(503, &err);
        Action::Pause
    }

    /// The prefill leg's answer (or its failure): on success the client's request becomes the decode
    /// leg (body rewritten with the answer's `kv_transfer_params`, destination written) and goes on;
    /// on failure the client gets a 502 naming the leg. Either way the prefill leg's booking ends
    /// here, and on failure the decode leg's too.
    pub(super) fn on_prefill_answer(
        &mut self,
        leg: PrefillLeg,
        num_headers: usize,
        body_size: usize,
    ) {
        let Some(vm) = self.vm.clone() else { return };
        let status = callout_status(num_headers);
        let max = vm.borrow().pools[self.pool]
            .state
            .config()
            .pd
            .max_prefill_response_bytes;
        let answer = leg_bodies::read_prefill_answer(status, body_size, max, || {
            abi::get_buffer(BufferType::HttpCallResponseBody, 0, body_size)
                .ok()
                .flatten()
        });
        let mut vm = vm.borrow_mut();
        let vm = &mut vm.pools[self.pool];
        let now = now_ms();
        let replica_failed = matches!(
            answer,
            Err(LegFailure::NoAnswer | LegFailure::Status(500..))
        );
        if replica_failed && leg.backup.is_some() {
            let why = answer.err().map(|f| f.to_string()).unwrap_or_default();
            return self.retry_prefill(vm, leg, &why, now);
        }
        vm.state.release(prefill_id(self.id));
        let params = match answer {
            Ok(a) => {
                vm.state
                    .request_outcome(leg.replica, None, Outcome::Success, true, now);
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
                        .request_outcome(leg.replica, None, Outcome::Failure, true, now);
                }
                let name = vm.state.replica_name(leg.replica);
                let why = f.to_string();
                log(
                    LogLevel::Warn,
                    &format!("kvsteer: the prefill leg on {name} {why}"),
                );
                return self.fail_leg(vm, "prefill", leg.replica, &why);
            }
        };
        self.send_decode(vm, leg, params);
    }

    /// A prefill leg that fails where Envoy's retry policy would retry a plain request (5xx, no
    /// answer) goes once more, to its side's backup (for a failed health probe, the side's own
    /// choice), under the same request id; the failure counts against the replica's health as any
    /// other.
    fn retry_prefill(&mut self, vm: &mut Pool, leg: PrefillLeg, why: &str, now: u64) {
        let Some((backup, matched, req)) = leg.backup.as_ref() else {
            return;
        };
        let backup = *backup;
        vm.state
            .request_outcome(leg.replica, None, Outcome::Failure, true, now);
        inc(vm.metrics.pd_prefill_retries, 1);
        let name = vm.state.replica_name(leg.replica);
        log(
            LogLevel::Info,
            &format!(
                "kvsteer: the prefill leg on {name} {why}; sent on to {}",
                vm.state.replica_name(backup)
            ),
        );
        vm.state
            .rebook_prefill(prefill_id(self.id), req, backup, *matched, now);
        let body = leg_bodies::prefill_body(&leg.client);
        match send_prefill(vm, backup, &self.path, &body, &leg.request_id) {
            Ok(token) => {
                self.prefill = Some(PrefillLeg {
                    token,
                    replica: backup,
                    backup: None,
                    ..leg
                });
            }
            Err(why) => {
                vm.state.release(prefill_id(self.id));
                self.fail_leg(vm, "prefill", backup, &why);
            }
        }
    }

    /// The prefill leg answered: the client's request goes on as the decode leg, its body carrying
    /// the answer's `kv_transfer_params` (`None`: the answer had none), under the leg's request id.
    fn send_decode(&mut self, vm: &mut Pool, leg: PrefillLeg, params: Option<serde_json::Value>) {
        let body = leg_bodies::decode_body(leg.client, params);
        if replace_request_body(self.body_len, &body).is_err() {
            let why = "could not be handed to the decode leg (the proxy refused the body)";
            return self.fail_leg(vm, "decode", leg.decode.replica, why);
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

    /// A leg failed (`leg`: `prefill` or `decode`, on `replica`): the request's booking ends and the
    /// client gets a 502 naming the leg. The prefill leg's booking is the caller's to end.
    fn fail_leg(&mut self, vm: &mut Pool, leg: &str, replica: usize, why: &str) {
        vm.state.release(self.id);
        inc(vm.metrics.pd_prefill_failures, 1);
        self.phase = Phase::Released;
        let name = vm.state.replica_name(replica);
        Self::send_error(502, &leg_bodies::error_body(502, leg, name, why));
    }
}
