//! Sharing the approximate text identity's records with the proxy's other worker VMs
//! ([`crate::approx`]): without a tokenizer a text prompt is matched only against the router's own
//! past decisions, and a follow-up that reaches another worker than its first turn would find none.

use super::Router;
use crate::approx;

impl Router {
    /// Starts journaling this router's text-prompt records for the proxy's other workers, and
    /// applying theirs (the filter calls it once the worker has a number in shared data).
    pub fn share_text_records(&mut self) {
        self.approx_text.start_journal();
    }

    /// This router's text-prompt records of the last `keep_ms` for the other workers, stamped
    /// `now_ms`; `None` before [`Router::share_text_records`], and before any text prompt was
    /// admitted.
    pub fn text_records_journal(&mut self, now_ms: u64, keep_ms: u64) -> Option<Vec<u8>> {
        self.approx_text
            .encode_journal(now_ms, keep_ms, self.replicas())
    }

    /// Applies another worker's text-prompt records, the entries not applied yet, as of `now_ms`;
    /// `None`, nothing applied, for a journal that is malformed or for another replica count, or
    /// while not sharing ([`approx::ApproxIndex::apply_peer`]).
    pub fn apply_peer_text_records(
        &mut self,
        peer: u32,
        journal: &[u8],
        now_ms: u64,
    ) -> Option<approx::Applied> {
        self.approx_text
            .apply_peer(peer, journal, self.replicas(), now_ms)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::RoutingConfig;
    use crate::router::Router;

    fn router() -> Router {
        let cfg = RoutingConfig::from_json(r#"{"policy":"kv_load"}"#).unwrap();
        Router::new(cfg, 4).unwrap()
    }

    fn chat(text: &str) -> Vec<u8> {
        serde_json::json!({"messages": [{"role": "user", "content": text}], "max_tokens": 4})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn a_text_follow_up_on_another_worker_goes_where_the_first_turn_went() {
        let (mut a, mut b) = (router(), router());
        a.share_text_records();
        b.share_text_records();
        let path = "/v1/chat/completions";
        let first: String = (0..400).map(|i| format!("word{i} ")).collect();
        let req = a.read_request(path, &chat(&first), None).unwrap();
        let d = a.route_and_admit(1, &req, 10);
        let j = a.text_records_journal(100, 400).unwrap();
        assert!(b.text_records_journal(100, 400).is_none(), "b sent nothing");
        let got = b.apply_peer_text_records(0, &j, 110).unwrap();
        assert_eq!(got.entries, 1);
        let follow = format!("{first} and then some more words about it");
        let req = b.read_request(path, &chat(&follow), None).unwrap();
        let d2 = b.route(&req, 200);
        assert_eq!(d2.replica, d.replica);
        assert!(d2.matched_tokens[d.replica] > 0, "{:?}", d2.matched_tokens);
        // Another replica count (a worker on another configuration): refused whole.
        let cfg = RoutingConfig::from_json(r#"{"policy":"kv_load"}"#).unwrap();
        let mut three = Router::new(cfg, 3).unwrap();
        three.share_text_records();
        assert!(three.apply_peer_text_records(0, &j, 110).is_none());
    }
}
