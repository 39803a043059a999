//! Reading `tokenizer.json`'s `model` (byte-level BPE) and `post_processor` from bytes. The
//! vocabulary is read into one arena and an index (`vocab.rs`) and merges are resolved as they are
//! read (`merges.rs`), so a 9 MB file is read without a map of its tokens; only what encoding needs
//! is kept: the 256 byte ids, the merge table and, with `ignore_merges`, the vocabulary index.

use super::bpe::ByteLevelBpe;
use super::merges;
use super::vocab::VocabIndex;
use serde::Deserialize;
use serde_json::Value;

/// Bounds on what a bundle may hold, well above any released model (Llama 3.1: 128,000 tokens and
/// 280,147 merges), so hostile input cannot ask for unbounded tables.
pub const MAX_VOCAB: usize = 4 << 20;

#[derive(Deserialize)]
pub struct ModelJson {
    #[serde(rename = "type", default)]
    pub kind: Option<String>,
    pub vocab: VocabIndex,
    #[serde(default)]
    pub ignore_merges: bool,
    #[serde(default)]
    pub byte_fallback: bool,
    #[serde(default)]
    pub dropout: Option<f64>,
    #[serde(default)]
    pub continuing_subword_prefix: Option<String>,
    #[serde(default)]
    pub end_of_word_suffix: Option<String>,
}

/// Builds the BPE. Refused: models other than BPE, and the BPE options byte-level families do not use
/// (`byte_fallback`, dropout, subword prefixes and suffixes), rather than encoding them wrongly.
/// The vocabulary is moved into the BPE with `ignore_merges`, else dropped.
pub fn build_bpe(m: ModelJson, file: &[u8]) -> Result<ByteLevelBpe, String> {
    if m.kind.as_deref().is_some_and(|k| k != "BPE") {
        return Err(format!("model type {:?}: only BPE is supported", m.kind));
    }
    if m.byte_fallback {
        return Err("model.byte_fallback is not supported (not a byte-level BPE)".into());
    }
    if m.dropout.is_some_and(|d| d > 0.0) {
        return Err("model.dropout is not supported".into());
    }
    let affix = |a: &Option<String>| a.as_deref().is_some_and(|s| !s.is_empty());
    if affix(&m.continuing_subword_prefix) || affix(&m.end_of_word_suffix) {
        return Err(
            "model: continuing_subword_prefix / end_of_word_suffix are not supported".into(),
        );
    }
    if m.vocab.len() > MAX_VOCAB {
        return Err(format!(
            "model: {} tokens, over the bound of {MAX_VOCAB}",
            m.vocab.len()
        ));
    }
    let mut byte_ids = [None; 256];
    for (b, slot) in byte_ids.iter_mut().enumerate() {
        *slot = m.vocab.get_bytes(&[b as u8]);
    }
    let merges = merges::merge_table(file, &m.vocab)?;
    let words = m.ignore_merges.then_some(m.vocab);
    Ok(ByteLevelBpe::new(byte_ids, merges, words))
}

/// The ids the post-processor puts around a single sequence (`add_special_tokens`, what an engine
/// applies to a completions prompt): `TemplateProcessing`'s special tokens before and after `$A`,
/// through `Sequence`s; `ByteLevel` adds none. Other processors are refused.
pub fn post_processor_ids(v: &Value) -> Result<(Vec<u32>, Vec<u32>), String> {
    let (mut before, mut after) = (Vec::new(), Vec::new());
    add_post(v, &mut before, &mut after, 0)?;
    Ok((before, after))
}

fn add_post(
    v: &Value,
    before: &mut Vec<u32>,
    after: &mut Vec<u32>,
    depth: usize,
) -> Result<(), String> {
    if v.is_null() {
        return Ok(());
    }
    match v.get("type").and_then(Value::as_str).unwrap_or("") {
        "ByteLevel" => Ok(()),
        "Sequence" if depth < 4 => v
            .get("processors")
            .and_then(Value::as_array)
            .ok_or("post_processor: Sequence without processors")?
            .iter()
            .try_for_each(|p| add_post(p, before, after, depth + 1)),
        "TemplateProcessing" => {
            let single = v
                .get("single")
                .and_then(Value::as_array)
                .ok_or("post_processor: TemplateProcessing without single")?;
            let mut seen_a = false;
            for item in single {
                if item.get("Sequence").is_some() {
                    seen_a = true;
                    continue;
                }
                let name = item
                    .pointer("/SpecialToken/id")
                    .and_then(Value::as_str)
                    .ok_or("post_processor: template item is neither Sequence nor SpecialToken")?;
                let ids = v
                    .pointer(&format!(
                        "/special_tokens/{}",
                        name.replace('~', "~0").replace('/', "~1")
                    ))
                    .and_then(|t| t.get("ids"))
                    .and_then(|ids| serde_json::from_value::<Vec<u32>>(ids.clone()).ok())
                    .ok_or_else(|| format!("post_processor: special token {name:?} has no ids"))?;
                let into = if seen_a { &mut *after } else { &mut *before };
                into.extend(ids);
            }
            Ok(())
        }
        other => Err(format!("post_processor type {other:?} is not supported")),
    }
}
