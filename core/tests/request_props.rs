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

proptest! {
    /// Token-id prompts read by the fast scanner equal the general parser's reading, whatever the
    /// spacing.
    #[test]
    fn token_prompts_read_exactly(tokens in prop::collection::vec(any::<u32>(), 0..100), sep in "[ \n\t]{0,2},[ \n\t]{0,2}") {
        use kvsteer_core::block::BlockHasher;
        use kvsteer_core::PromptIdentity;
        let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let body = format!("{{\"prompt\": [ {} ] }}", list.join(&sep));
        let r = read_request("/v1/completions", body.as_bytes(), None, 4, 1 << 20).unwrap();
        prop_assert_eq!(r.prompt_tokens, tokens.len() as u64);
        prop_assert_eq!(r.identity, PromptIdentity::Exact(BlockHasher::new(4).unwrap().sequence_hashes(&tokens)));
    }
}

fn oracle_tokens(body: &[u8]) -> Option<Result<Vec<u32>, ()>> {
    // None: not valid JSON. Some(Err): valid JSON but no flat u32 prompt.
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let arr = match v.get("prompt").and_then(|p| p.as_array()) {
        Some(a) => a,
        None => return Some(Err(())),
    };
    let t: Option<Vec<u32>> = arr
        .iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect();
    Some(t.ok_or(()))
}

const EXTRA: &[&str] = &[
    r#""model":"a\"b}{][,""#,
    r#""stream":true"#,
    r#""max_tokens":12"#,
    r#""logit_bias":{"1":[2,{"x":"]"}]}"#,
    r#""stop":["\\","\n"]"#,
    r#""user":null"#,
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The token-prompt fast path reads exactly what a general JSON parser sees, wherever the prompt sits
    /// among other fields, and refuses what the general parser refuses.
    #[test]
    fn fast_path_agrees_with_a_general_parser(
        tokens in prop::collection::vec(any::<u32>(), 0..40),
        extras in prop::collection::vec(0usize..EXTRA.len(), 0..4),
        at in 0usize..5,
        mutate in prop::option::of((any::<prop::sample::Index>(), any::<u8>())),
    ) {
        use kvsteer_core::block::BlockHasher;
        use kvsteer_core::PromptIdentity;
        let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let mut fields: Vec<String> = extras.iter().map(|&i| EXTRA[i].to_string()).collect();
        fields.insert(at.min(fields.len()), format!("\"prompt\":[{}]", list.join(",")));
        let mut body = format!("{{{}}}", fields.join(",")).into_bytes();
        if let Some((ix, byte)) = mutate {
            let i = ix.index(body.len());
            body[i] = byte;
        }
        let got = read_request("/v1/completions", &body, None, 4, 1 << 20);
        let hasher = BlockHasher::new(4).unwrap();
        match oracle_tokens(&body) {
            None => prop_assert!(got.is_err(), "invalid JSON accepted: {:?}", String::from_utf8_lossy(&body)),
            Some(Ok(t)) => {
                // Duplicate keys (a mutation can make one) are refused by the reader, accepted by Value.
                if let Ok(r) = got {
                    prop_assert_eq!(r.identity, PromptIdentity::Exact(hasher.sequence_hashes(&t)));
                    prop_assert_eq!(r.prompt_tokens, t.len() as u64);
                }
            }
            // Other prompt shapes (text, lists) are covered by the reader's unit tests.
            Some(Err(())) => {}
        }
    }
}
