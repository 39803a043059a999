//! Hugging Face tokenizers, read at run time from a model's `tokenizer.json` and
//! `tokenizer_config.json` bytes (nothing compiled in: the proxy gets the files from its host), for the
//! byte-level BPE families: Llama 3.x, Qwen 2.5, DeepSeek V3, Mistral Nemo (Tekken) and others built
//! the same way. The pipeline is `tokenizers`' own: added tokens, normalizer, pre-tokenizer, BPE,
//! and for a completions prompt the post-processor's special tokens. Anything in a file outside that
//! (a Unigram or WordPiece model, a Metaspace pre-tokenizer, `byte_fallback` ...) refuses the bundle
//! with a message naming it, so a model is either tokenized as its engine does or not at all.
//!
//! Loading never panics on hostile bytes: sizes are bounded before parsing, serde_json bounds nesting,
//! table sizes are bounded, and every lookup is checked.

pub mod added;
pub mod bpe;
pub mod merges;
pub mod model;
pub mod pretokenize;
pub mod vocab;

use crate::vocabulary::Segment;
use added::{AddedToken, AddedTokens, Normalizer, Piece};
use bpe::ByteLevelBpe;
use model::ModelJson;
use pretokenize::PreTokenizer;
use serde::Deserialize;
use serde_json::Value;
use std::borrow::Cow;

/// Default bound on each file of a bundle: the covered families' `tokenizer.json` are 7-9.3 MB.
pub const DEFAULT_MAX_BUNDLE_BYTES: usize = 32 << 20;

#[derive(Deserialize)]
struct FileJson<'a> {
    model: ModelJson,
    #[serde(default)]
    normalizer: Value,
    #[serde(default)]
    pre_tokenizer: Value,
    #[serde(default)]
    post_processor: Value,
    #[serde(default, borrow)]
    added_tokens: Vec<AddedToken<'a>>,
}

/// A loaded `tokenizer.json`.
pub struct HfTokenizer {
    bpe: ByteLevelBpe,
    pre: PreTokenizer,
    normalizer: Normalizer,
    added: AddedTokens,
    /// The post-processor's ids before and after a single sequence.
    around: (Vec<u32>, Vec<u32>),
    vocab_size: usize,
}

fn distinct_ids(file: &FileJson<'_>) -> usize {
    let vocab = file.model.vocab.ids();
    let added = file.added_tokens.iter().map(|t| t.id);
    let mut ids: Vec<u32> = vocab.chain(added).collect();
    ids.sort_unstable();
    ids.dedup();
    ids.len()
}

impl std::fmt::Debug for HfTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfTokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("merges", &self.bpe.merge_count())
            .finish_non_exhaustive()
    }
}

fn bounded<'b>(bytes: &'b [u8], file: &str, max_bytes: usize) -> Result<&'b [u8], String> {
    if bytes.len() > max_bytes {
        return Err(format!(
            "{file}: {} bytes, over the bound of {max_bytes}",
            bytes.len()
        ));
    }
    Ok(bytes)
}

impl HfTokenizer {
    /// Reads `tokenizer.json`. The error starts with `tokenizer.json:` and names what was refused.
    pub fn from_bytes(tokenizer_json: &[u8], max_bytes: usize) -> Result<HfTokenizer, String> {
        let bytes = bounded(tokenizer_json, "tokenizer.json", max_bytes)?;
        let file: FileJson =
            serde_json::from_slice(bytes).map_err(|e| format!("tokenizer.json: {e}"))?;
        fn at(what: &'static str) -> impl Fn(String) -> String {
            move |e| format!("tokenizer.json: {what}: {e}")
        }
        let normalizer = Normalizer::from_json(&file.normalizer).map_err(at("normalizer"))?;
        let added =
            AddedTokens::new(&file.added_tokens, &normalizer).map_err(at("added_tokens"))?;
        let pre = PreTokenizer::from_json(&file.pre_tokenizer).map_err(at("pre_tokenizer"))?;
        let around =
            model::post_processor_ids(&file.post_processor).map_err(at("post_processor"))?;
        let vocab_size = distinct_ids(&file);
        Ok(HfTokenizer {
            bpe: model::build_bpe(file.model, bytes).map_err(at("model"))?,
            pre,
            around,
            normalizer,
            added,
            vocab_size,
        })
    }

    /// Distinct ids of the model's vocabulary and the added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Merges held (for memory reports).
    pub fn merge_count(&self) -> usize {
        self.bpe.merge_count()
    }

    /// Heap bytes of the merge table and of the vocabulary index kept for `ignore_merges` (0
    /// without), for memory reports.
    pub fn table_bytes(&self) -> (usize, usize) {
        self.bpe.heap_bytes()
    }

    /// Calls `f` with each added token and the normalized text between them, in order. Segments are
    /// what the per-segment cache keys on: BPE never crosses an added token.
    pub fn segments(&self, text: &str, mut f: impl FnMut(Segment<'_>)) {
        self.added.split(text, &self.normalizer, &mut |p| match p {
            Piece::Token(id) => f(Segment::Special(id)),
            Piece::Text(t) => f(Segment::Text(t)),
        });
    }

    /// Ids of one segment from [`HfTokenizer::segments`] (normalized, no added tokens in it): the
    /// pre-tokenizer's pieces, each through the BPE. None when the pre-tokenizer's regex fails.
    pub fn encode_ordinary(&self, text: &str) -> Option<Vec<u32>> {
        let text: Cow<str> = if self.pre.prefix_space && !text.starts_with(' ') {
            Cow::Owned(format!(" {text}"))
        } else {
            Cow::Borrowed(text)
        };
        let pieces = self.pre.pieces(&text).ok()?;
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        for r in pieces {
            self.bpe.encode_piece(&text.as_bytes()[r], &mut out);
        }
        Some(out)
    }

    /// `tokenizers`' `encode(text, add_special_tokens)` without a cache.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Option<Vec<u32>> {
        let mut out = Vec::new();
        if add_special_tokens {
            out.extend_from_slice(&self.around.0);
        }
        let mut ok = true;
        self.segments(text, |s| match s {
            Segment::Special(id) => out.push(id),
            Segment::Text(t) => match self.encode_ordinary(t) {
                Some(ids) => out.extend(ids),
                None => ok = false,
            },
        });
        if add_special_tokens {
            out.extend_from_slice(&self.around.1);
        }
        ok.then_some(out)
    }

    /// The post-processor's ids before and after a single sequence.
    pub fn special_around(&self) -> (&[u32], &[u32]) {
        (&self.around.0, &self.around.1)
    }
}

/// What `tokenizer_config.json` gives the chat template.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HfChatConfig {
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// A token in `tokenizer_config.json`: a string, or an `AddedToken` object with its `content`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

impl HfChatConfig {
    /// Reads `chat_template` (a string, or transformers' list of named templates, of which `default`
    /// is the one chat completions use), `bos_token` and `eos_token`.
    pub fn from_bytes(
        tokenizer_config_json: &[u8],
        max_bytes: usize,
    ) -> Result<HfChatConfig, String> {
        let bytes = bounded(tokenizer_config_json, "tokenizer_config.json", max_bytes)?;
        let v: Value =
            serde_json::from_slice(bytes).map_err(|e| format!("tokenizer_config.json: {e}"))?;
        let chat_template = match v.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => Some(
                list.iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str())
                    .ok_or("tokenizer_config.json: chat_template: no template named \"default\"")?
                    .to_string(),
            ),
            Some(_) => return Err("tokenizer_config.json: chat_template is not a string".into()),
        };
        Ok(HfChatConfig {
            chat_template,
            bos_token: token_text(v.get("bos_token")),
            eos_token: token_text(v.get("eos_token")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_bytes_are_errors_not_panics() {
        for bad in [
            &b""[..],
            b"{",
            b"[]",
            b"{\"model\": 1}",
            b"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a\"]}}",
            b"{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": [[\"a\", \"b\"]]}}",
            b"{\"model\": {\"type\": \"Unigram\", \"vocab\": {}}}",
            b"{\"model\": {\"vocab\": {}}, \"pre_tokenizer\": {\"type\": \"Split\", \"pattern\": {\"Regex\": \"(\"}}}",
            &[0xff, 0xfe, 0x00],
        ] {
            assert!(HfTokenizer::from_bytes(bad, 1 << 20).is_err(), "{bad:?}");
        }
        let deep = "[".repeat(100_000);
        assert!(HfTokenizer::from_bytes(deep.as_bytes(), 1 << 20).is_err());
        assert!(
            HfTokenizer::from_bytes(b"{}", 1)
                .unwrap_err()
                .contains("over the bound")
        );
        assert!(HfChatConfig::from_bytes(b"{\"chat_template\": 3}", 100).is_err());
    }

    #[test]
    fn a_small_bundle_encodes() {
        let json = serde_json::json!({
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "Ġ": 2, "ab": 3, "Ġab": 4, "<x>": 5},
                      "merges": ["a b", ["Ġ", "ab"]]},
            "added_tokens": [{"id": 9, "content": "<x>", "special": true, "normalized": false}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<x>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "special_tokens": {"<x>": {"id": "<x>", "ids": [9], "tokens": ["<x>"]}}}
        });
        let t = HfTokenizer::from_bytes(json.to_string().as_bytes(), 1 << 20).unwrap();
        assert_eq!(t.encode("ab ab<x>ab", false).unwrap(), vec![3, 4, 9, 3]);
        assert_eq!(t.encode("ab", true).unwrap(), vec![9, 3]);
        let cfg = br#"{"chat_template": [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}],
                      "bos_token": {"content": "<s>"}, "eos_token": "</s>"}"#;
        let c = HfChatConfig::from_bytes(cfg, 1 << 10).unwrap();
        assert_eq!(c.chat_template.as_deref(), Some("d"));
        assert_eq!(c.bos_token.as_deref(), Some("<s>"));
        assert_eq!(c.eos_token.as_deref(), Some("</s>"));
    }
}
