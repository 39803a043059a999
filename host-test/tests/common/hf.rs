//! Llama 3.1's Hugging Face bundle and its reference ids, as tokenizer/scripts/hf-fetch leaves them
//! (target/tokenizers/, or `KVSTEER_HF_DIR`): the files are the model's own (its licence forbids
//! vendoring them), so tests read them where the fetcher put them.

use kvsteer_core::block::BlockHasher;
use serde_json::Value;
use std::path::PathBuf;

/// The bundle's two files and the reference corpus' multi-turn chat with its ids.
pub struct LlamaBundle {
    pub tokenizer_json: Vec<u8>,
    pub tokenizer_config_json: Vec<u8>,
    /// The chat's `messages`, as a client sends them.
    pub messages: Value,
    /// The ids the `tokenizers` library gives the chat's rendered prompt.
    pub ids: Vec<u32>,
}

/// The bundle, or None (saying so) when hf-fetch has not run; under `CI=true` its absence fails
/// the test instead, since `scripts/test` fetches it first.
pub fn llama_bundle() -> Option<LlamaBundle> {
    let dir = std::env::var_os("KVSTEER_HF_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../target/tokenizers").into())
        .join("llama3_1");
    let read = |f: &str| std::fs::read(dir.join(f));
    let (Ok(tokenizer_json), Ok(tokenizer_config_json), Ok(reference)) = (
        read("tokenizer.json"),
        read("tokenizer_config.json"),
        read("reference.json"),
    ) else {
        let msg = format!(
            "no Llama 3.1 bundle in {} (tokenizer/scripts/hf-fetch)",
            dir.display()
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        println!("{msg}: skipped");
        return None;
    };
    let reference: Value = serde_json::from_slice(&reference).unwrap();
    let case = reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "multi_turn")
        .unwrap();
    let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
    assert!(held_blocks(&ids).len() > 20, "{}", ids.len());
    Some(LlamaBundle {
        tokenizer_json,
        tokenizer_config_json,
        messages: case["messages"].clone(),
        ids,
    })
}

/// The 16-token block hashes an engine holding `ids` reports.
pub fn held_blocks(ids: &[u32]) -> Vec<u64> {
    BlockHasher::new(16)
        .unwrap()
        .sequence_hashes(ids)
        .into_iter()
        .map(|h| h.0)
        .collect()
}
