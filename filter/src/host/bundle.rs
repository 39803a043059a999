//! The host side of a Hugging Face bundle fetched at run time (`tokenizer.huggingface.fetch`): the
//! callout the worker's state asks for ([`crate::worker::bundle`]), its answer handed over (refused
//! unread when larger than `max_bytes`), and one log line for each thing that happened.

use super::abi;
use super::clock::now_ms;
use super::vm::{Pool, callout_body, log};
use crate::worker::bundle::BundleOutcome;
use proxy_wasm::types::LogLevel;
use std::time::Duration;

/// Sends the fetch when one is due (the first tick, then after each wait).
pub(super) fn fetch_bundle(vm: &mut Pool, now: u64) {
    let Some(req) = vm.state.plan_bundle_fetch(now) else {
        return;
    };
    let headers = vec![
        (":method", "GET"),
        (":path", req.path.as_str()),
        (":authority", req.authority.as_str()),
        ("accept", kvsteer_core::bundle::BUNDLE_CONTENT_TYPE),
    ];
    let timeout = Duration::from_millis(req.timeout_ms);
    match abi::dispatch_http_call(&req.upstream, headers, None, timeout) {
        Ok(token) => vm.state.bundle_fetch_started(token, now),
        Err(status) => {
            let out = vm
                .state
                .bundle_fetch_not_started(&format!("{status:?}"), now);
            report(&req.upstream, &req.path, &out);
        }
    }
}

/// The fetch's answer: copied into the VM only when it fits `max_bytes`, then checked and loaded.
pub(super) fn on_bundle_answer(vm: &mut Pool, status: Option<u16>, body_size: usize) {
    let body = if status == Some(200) && body_size <= vm.state.bundle_max_bytes() {
        callout_body(body_size)
    } else {
        None
    };
    let started = now_ms();
    let out = vm
        .state
        .on_bundle_answer(status, body_size, body.as_deref(), started);
    drop(body);
    let (upstream, path) = vm
        .state
        .config()
        .tokenizer
        .as_ref()
        .and_then(kvsteer_tokenizer::TextTokenizer::deferred)
        .map(|f| (f.cluster.clone(), f.path.clone()))
        .unwrap_or_default();
    if let BundleOutcome::Loaded { .. } = out {
        let ms = now_ms().saturating_sub(started);
        log(
            LogLevel::Info,
            &format!("{}, in {ms} ms", describe(&upstream, &path, &out)),
        );
    } else {
        report(&upstream, &path, &out);
    }
}

fn report(upstream: &str, path: &str, out: &BundleOutcome) {
    if !matches!(out, BundleOutcome::Unknown) {
        log(LogLevel::Warn, &describe(upstream, path, out));
    }
}

fn describe(upstream: &str, path: &str, out: &BundleOutcome) -> String {
    let from = format!("tokenizer bundle from {upstream} {path}");
    match out {
        BundleOutcome::Loaded {
            bytes,
            model,
            sha256,
        } => format!(
            "kvsteer: {from} loaded ({bytes} bytes, sha256 {sha256}, model {}); text prompts now \
             get the exact identity",
            model.as_deref().unwrap_or("not named")
        ),
        BundleOutcome::Refused { why, retry_in_ms } => format!(
            "kvsteer: {from} refused: {why}; text prompts keep the approximate identity, fetching \
             again in {retry_in_ms} ms"
        ),
        BundleOutcome::Failed { why, retry_in_ms } => format!(
            "kvsteer: {from} not fetched: {why}; text prompts keep the approximate identity, \
             fetching again in {retry_in_ms} ms"
        ),
        BundleOutcome::Unknown => String::new(),
    }
}
