//! Text prompts without a tokenizer, through the real `.wasm` with several worker VMs: a chat's
//! follow-up is matched against where the proxy sent its first turn (the approximate text identity,
//! `kvsteer_core::approx`), and each worker VM keeps its own index of that. The workers share their
//! text-prompt records through shared data (`filter/src/worker/share/text.rs`), so a follow-up that
//! reaches another worker than its first turn goes to the first turn's replica. Before the sharing
//! such a follow-up was routed by load alone: here a one-in-four draw per conversation.

mod common;
use common::*;
use kvsteer_host_test::{Harness, HarnessConfig, HostMode, Output, RequestSpec};
use serde_json::json;

const CONVERSATIONS: u64 = 8;

/// A chat body: a long system prompt of the conversation's own, then `turns` user messages.
fn chat(conversation: u64, turns: u64) -> Vec<u8> {
    let system: String = (0..300)
        .map(|i| format!("c{conversation} rule {i}. "))
        .collect();
    let mut messages = vec![json!({"role": "system", "content": system})];
    for t in 0..turns {
        messages.push(json!({"role": "user", "content": format!("turn {t} of {conversation}")}));
        messages.push(json!({"role": "assistant", "content": format!("answer {t} ok")}));
    }
    json!({"model": "sim", "max_tokens": 8, "messages": messages})
        .to_string()
        .into_bytes()
}

/// The replica a chat body is routed to through worker `w`. (The simulated engine runs token
/// ids only and refuses the chat body with a 400, after the filter routed and booked it.)
fn send(h: &mut Harness, body: Vec<u8>, w: usize) -> usize {
    let spec = RequestSpec {
        raw_body: Some(body),
        path: Some("/v1/chat/completions".into()),
        ..RequestSpec::new(Vec::new(), 8)
    }
    .worker(w);
    let id = h.send(&spec).unwrap();
    let r = h.record(id).unwrap();
    assert!(r.released && !r.fallback, "{r:?}");
    r.replica.unwrap()
}

/// Each conversation's first turn through one worker, its follow-up (the same system prompt and
/// more) through the next, 300 ms later: the follow-ups that went to their first turn's replica.
///
/// With every replica idle the choice is a tie broken by the worker's seeded generator, and the
/// workers' generators start from the same seed: worker `i` first routes `3 i + 1` short requests
/// of its own, so the workers do not draw in step (in step, a blind follow-up would land on its
/// first turn's replica by drawing what the first turn drew).
fn follow_ups_on_their_first_turns_replica(cfg: HarnessConfig) -> (u64, Harness) {
    let workers = cfg.workers;
    let mut h = harness_with(cfg);
    for w in 0..workers {
        for i in 0..3 * w as u64 + 1 {
            let spec = RequestSpec::new(tokens(1_000 * w as u64 + i, 64), 1).worker(w);
            h.send(&spec).unwrap();
        }
    }
    h.run_until_idle(600_000_000).unwrap();
    h.run_for(300_000).unwrap();
    let mut same = 0;
    for c in 0..CONVERSATIONS {
        let w = c as usize % workers;
        let home = send(&mut h, chat(c, 1), w);
        h.run_for(300_000).unwrap();
        let next = send(&mut h, chat(c, 2), (w + 1) % workers);
        same += (next == home) as u64;
        h.run_for(100_000).unwrap();
    }
    h.run_until_idle(600_000_000).unwrap();
    assert_clean(&h);
    eprintln!(
        "{workers} workers: {same} of {CONVERSATIONS} follow-ups on their first turn's replica"
    );
    (same, h)
}

fn metric(h: &Harness, name: &str) -> i64 {
    h.proxy().metric(name).map_or(0, |m| m.value)
}

#[test]
fn a_text_follow_up_on_another_worker_goes_to_its_first_turns_replica() {
    for workers in [2, 4] {
        let mut cfg = HarnessConfig::small("kv_time");
        cfg.routing = json!({"block_size": 16});
        cfg.workers = workers;
        let (same, h) = follow_ups_on_their_first_turns_replica(cfg);
        assert_eq!(same, CONVERSATIONS, "{workers} workers");
        // Every worker applies every other worker's records: the first turns and the follow-ups.
        let applied = metric(&h, "kvsteer_text_records_applied");
        let floor = (workers as i64 - 1) * CONVERSATIONS as i64;
        assert!(applied >= floor, "{workers} workers: {applied} applied");
        assert_eq!(metric(&h, "kvsteer_text_records_refused"), 0);
        assert_eq!(metric(&h, "kvsteer_text_records_missed"), 0);
    }
}

#[test]
fn in_nginx_mode_too() {
    // ngx_wasm_module's shared data: a key written without a CAS token lands only once, so a
    // journal republished tick after tick must still show the newest.
    let mut cfg = HarnessConfig::small("kv_time");
    cfg.routing = json!({"block_size": 16});
    cfg.mode = HostMode::Nginx;
    cfg.output = Output::NginxVariable;
    let (same, h) = follow_ups_on_their_first_turns_replica(cfg);
    assert_eq!(same, CONVERSATIONS);
    assert!(metric(&h, "kvsteer_text_records_applied") >= CONVERSATIONS as i64);
}
