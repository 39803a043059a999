//! Hostile bodies: the request reader and the feed decoder never panic, whatever the bytes.

use kvsteer_core::feed::FeedBatch;
use kvsteer_core::request::read_request;
use proptest::prelude::*;

const SAMPLE: &str = r#"{"model":"m","stream":true,"max_tokens":5,"prompt":[1,2,3,4,5,6,7,8],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn random_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = read_request("/v1/completions", &body, None, 16, 1 << 20);
        let _ = read_request("/v1/chat/completions", &body, Some("s"), 16, 1 << 20);
        let _ = FeedBatch::decode(&body);
    }

    #[test]
    fn mutated_valid_bodies_never_panic(pos in 0usize..SAMPLE.len(), byte in any::<u8>(), cut in 0usize..=SAMPLE.len()) {
        let mut b = SAMPLE.as_bytes().to_vec();
        b[pos] = byte;
        b.truncate(cut.max(pos));
        let _ = read_request("/v1/completions", &b, None, 4, 1 << 20);
        let _ = read_request("/v1/chat/completions", &b, None, 4, 1 << 20);
    }
}
