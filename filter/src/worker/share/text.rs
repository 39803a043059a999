//! The approximate text identity's records shared between the proxy's worker VMs
//! (`kvsteer_core::approx`): a text prompt without a `tokenizer` section is matched only against
//! where the proxy itself sent earlier prompts, and each worker VM keeps its own index of that. Each
//! worker publishes the journal of its own text-prompt admissions of the last
//! [`super::WORKING_SET_KEEP_TICKS`] ticks under `<prefix>:text:<worker>` (the core's encoding,
//! which starts with `published_ms`) and applies the others' entries it has not applied yet, so a
//! follow-up that reaches another worker than its first turn still finds the first turn's replica.
//!
//! Unlike the working set, a VM applies them from its first tick, routed or not: a follow-up is
//! matched against everything the proxy sent within `prefix_affinity.ttl_ms`, and a worker whose
//! first request is a follow-up would otherwise have missed its first turn for good (the journals
//! keep a few ticks). A worker that never admitted a text prompt publishes nothing, and a proxy
//! that sees none does nothing but look for the others' keys.

use crate::host::store::SharedStore;
use crate::worker::WorkerState;
use crate::worker::share::WORKING_SET_KEEP_TICKS;

/// Other workers' text-prompt records this worker applied, missed and refused (since start).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TextSharing {
    /// Entries (one a text prompt another worker admitted) applied to this worker's index.
    pub applied: u64,
    /// Entries a worker dropped from its journal before this one read it (a tick stalled for more
    /// than [`WORKING_SET_KEEP_TICKS`] ticks, or more text admissions in those ticks than the
    /// journal holds).
    pub missed: u64,
    /// Journals refused whole: malformed, over the bounds, or for another replica count.
    pub refused: u64,
}

/// Shared-data key of a worker's text-record journal.
pub fn text_key(prefix: &str, worker: u32) -> String {
    format!("{prefix}:text:{worker}")
}

/// Worker `peer`'s text-record journal if it is at most `ttl_ms` old (a worker that went away
/// publishes nothing new, and is not decoded every tick).
pub fn read_text_fresh(
    store: &dyn SharedStore,
    prefix: &str,
    peer: u32,
    now_ms: u64,
    ttl_ms: u64,
) -> Option<Vec<u8>> {
    super::read_journal_fresh(store, &text_key(prefix, peer), now_ms, ttl_ms)
}

impl WorkerState {
    /// Publishes worker `me`'s text-prompt records and applies those of the other `count - 1`
    /// workers (part of [`WorkerState::share_load`]).
    pub(super) fn share_text_records(
        &mut self,
        store: &dyn SharedStore,
        me: u32,
        count: u32,
        now_ms: u64,
    ) {
        let prefix = &self.cfg.shared_key_prefix;
        let keep = self.cfg.tick_ms.saturating_mul(WORKING_SET_KEEP_TICKS);
        if let Some(journal) = self.router.text_records_journal(now_ms, keep) {
            store.overwrite(&text_key(prefix, me), &journal);
        }
        let ttl = self.cfg.peer_ttl_ms;
        for peer in (0..count).filter(|&p| p != me) {
            let Some(journal) = read_text_fresh(store, prefix, peer, now_ms, ttl) else {
                continue;
            };
            match self.router.apply_peer_text_records(peer, &journal, now_ms) {
                Some(got) => {
                    self.sharing.text.applied += got.entries;
                    self.sharing.text.missed += got.missed;
                }
                None => self.sharing.text.refused += 1,
            }
        }
    }

    /// Other workers' text-prompt records applied, missed and refused (counters since start).
    pub fn text_sharing(&self) -> TextSharing {
        self.sharing.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::store::tests::{MemStore, NgxStore};
    use crate::worker::testing::*;

    fn chat(text: &str) -> Vec<u8> {
        let m = serde_json::json!([{"role": "user", "content": text}]);
        format!(r#"{{"messages":{m},"max_tokens":4}}"#).into_bytes()
    }

    /// A text prompt's first turn through worker `a`, its follow-up through worker `b` after both
    /// ticked: the follow-up goes where the first turn went, for each of eight conversations.
    fn follow_ups_find_their_first_turn(store: &dyn SharedStore) {
        let (mut a, mut b) = (worker("kv_load"), worker("kv_load"));
        let mut idle = worker("kv_load");
        a.claim_worker_id(store);
        b.claim_worker_id(store);
        idle.claim_worker_id(store);
        let path = "/v1/chat/completions";
        let mut now = 0;
        for s in 0..8u64 {
            let first: String = (0..300).map(|i| format!("s{s} word{i} ")).collect();
            let d = a.route_body(2 * s, path, &chat(&first), None, now);
            a.release(2 * s);
            now += 100;
            for w in [&mut a, &mut b, &mut idle] {
                w.share_load(store, now);
            }
            let follow = format!("{first} then the second turn");
            let d2 = b.route_body(2 * s + 1, path, &chat(&follow), None, now + 50);
            b.release(2 * s + 1);
            assert_eq!(d2.replica, d.replica, "conversation {s}");
            now += 100;
        }
        assert_eq!(b.text_sharing().applied, 8);
        // a's eight first turns and b's follow-ups but the last (admitted after the last tick).
        assert_eq!(
            idle.text_sharing().applied,
            15,
            "a VM that routes nothing applies them too"
        );
        assert_eq!(a.text_sharing().refused + b.text_sharing().refused, 0);
    }

    #[test]
    fn a_text_follow_up_on_another_worker_finds_its_first_turn() {
        follow_ups_find_their_first_turn(&MemStore::default());
        // ngx_wasm_module's CAS rule: a key written without a token lands only once.
        follow_ups_find_their_first_turn(&NgxStore::default());
    }

    #[test]
    fn a_bad_journal_is_refused_and_counted() {
        let store = MemStore::default();
        let (mut a, mut b) = (worker("kv_load"), worker("kv_load"));
        a.claim_worker_id(&store);
        b.claim_worker_id(&store);
        assert_eq!(a.worker_id(), Some(0));
        let mut bad = 10u64.to_le_bytes().to_vec();
        bad.extend_from_slice(&[0xff; 40]);
        store.set(&text_key(&b.cfg.shared_key_prefix, 0), &bad, None);
        b.share_load(&store, 10);
        assert_eq!(b.text_sharing().refused, 1);
        // Too old: not read at all.
        b.share_load(&store, 10 + b.cfg.peer_ttl_ms + 1);
        assert_eq!(b.text_sharing().refused, 1);
        // Nothing published by a worker that admitted no text prompt.
        let lone = MemStore::default();
        let mut c = worker("kv_load");
        c.claim_worker_id(&lone);
        c.route_body(1, "/v1/completions", br#"{"prompt":[1,2,3]}"#, None, 0);
        c.share_load(&lone, 10);
        assert!(lone.get(&text_key(&c.cfg.shared_key_prefix, 0)).is_none());
    }
}
