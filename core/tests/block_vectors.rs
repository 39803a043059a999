//! Block identity checked against an independent implementation: vectors written by
//! `scripts/gen_block_vectors.py` with the Python `xxhash` package (the reference C library).

use kvsteer_core::block::{BlockHasher, TextHasher, namespace_seed};
use serde_json::Value;

fn vectors() -> Value {
    let text = include_str!("data/block_vectors.json");
    serde_json::from_str(text).expect("block_vectors.json parses")
}

fn u64s(v: &Value) -> Vec<u64> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|s| s.as_str().expect("string").parse().expect("u64"))
        .collect()
}

#[test]
fn token_sequence_hashes_match_python_xxhash() {
    let v = vectors();
    let cases = v["token_cases"].as_array().expect("token_cases");
    assert!(cases.len() >= 8);
    let mut namespaced = 0;
    for case in cases {
        let bs = case["block_size"].as_u64().unwrap() as usize;
        let lora = case["lora_name"].as_str();
        let salt = case["cache_salt"].as_str();
        let seed: u64 = case["seed"].as_str().unwrap().parse().unwrap();
        assert_eq!(
            namespace_seed(lora, salt),
            seed,
            "seed for {lora:?}/{salt:?}"
        );
        if lora.is_some() || salt.is_some() {
            namespaced += 1;
        }
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let hasher = BlockHasher::new(bs).unwrap().namespaced(lora, salt);
        let got: Vec<u64> = hasher
            .sequence_hashes(&tokens)
            .iter()
            .map(|h| h.0)
            .collect();
        let want = u64s(&case["sequence_hashes"]);
        assert_eq!(want.len(), tokens.len() / bs);
        assert_eq!(got, want, "block_size {bs}, lora {lora:?}, salt {salt:?}");
    }
    assert!(namespaced >= 3, "namespace cases present");
}

#[test]
fn text_hashes_match_python_xxhash() {
    let v = vectors();
    for case in v["text_cases"].as_array().expect("text_cases") {
        let bs = case["block_size"].as_u64().unwrap() as usize;
        let text = case["text"].as_str().unwrap();
        let got: Vec<u64> = TextHasher::new(bs)
            .unwrap()
            .hashes(text)
            .iter()
            .map(|h| h.0)
            .collect();
        let want = u64s(&case["text_hashes"]);
        assert!(!want.is_empty());
        assert_eq!(got, want, "block_size {bs}");
    }
}
