//! Prompt text to token ids, two ways, chosen once per process with [`select`] (the CLI's
//! `--tokenizer`):
//! - `stand_in` (the default): text is cut into chunks of 4 bytes (about the 4 bytes a token of English
//!   text costs with BPE tokenizers) and each chunk is hashed to an id. It is *not* a real tokenizer:
//!   counts are approximate and ids mean nothing. What it keeps is the property routing depends on:
//!   prompts that share a text prefix share a token prefix (every whole chunk before the first
//!   differing byte), so prefix caching and KV-aware routing behave as with a real tokenizer.
//! - `o200k_harmony` / `o200k_base`: the real BPE from `kvsteer-tokenizer`, the same code the filter
//!   runs, so a filter configured with the same vocabulary (and the `kvsteer_sim` chat template, which
//!   reproduces the server's chat framing) computes exactly the engine's block hashes, and the
//!   `cached_tokens` the engine reports are real. Special tokens in the text (`<|start|>`) are
//!   recognised, as engines' tokenizers do. Text the BPE cannot encode falls back to the stand-in.
//!
//! - a Hugging Face bundle (`--huggingface DIR`, [`select_huggingface`]): the model folder's
//!   `tokenizer.json` and `tokenizer_config.json` read by `kvsteer-tokenizer`, the filter's own code:
//!   completions text is tokenized with the post-processor's special tokens, and chats are rendered
//!   with the bundle's own chat template (the request's `tools` included), as an engine serving that
//!   model renders them; a chat the template refuses falls back to the fixed framing below.
//!
//! Output ids are rendered back to text by [`detokenize`] as short pseudo-words.

use crate::output::{VOCAB, mix64};
pub use kvsteer_tokenizer::Vocabulary;
use kvsteer_tokenizer::{Bpe, Segment};
use std::sync::OnceLock;

/// Which tokenizer turns prompt text into ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    StandIn,
    Bpe(Vocabulary),
}

impl std::str::FromStr for TokenizerKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "stand_in" => Ok(TokenizerKind::StandIn),
            "o200k_base" => Ok(TokenizerKind::Bpe(Vocabulary::O200kBase)),
            "o200k_harmony" => Ok(TokenizerKind::Bpe(Vocabulary::O200kHarmony)),
            _ => Err(format!(
                "unknown tokenizer {s:?} (stand_in, o200k_base, o200k_harmony)"
            )),
        }
    }
}

static SELECTED: OnceLock<Option<Bpe>> = OnceLock::new();
static HUGGING_FACE: OnceLock<std::sync::Mutex<kvsteer_tokenizer::TextTokenizer>> = OnceLock::new();

/// Chooses a Hugging Face bundle for the process (instead of `--tokenizer`): `dir` holds
/// `tokenizer.json` and `tokenizer_config.json`. Errors name the file.
pub fn select_huggingface(dir: &std::path::Path) -> Result<(), String> {
    let read =
        |f: &str| std::fs::read(dir.join(f)).map_err(|e| format!("{}/{f}: {e}", dir.display()));
    let (json, config) = (read("tokenizer.json")?, read("tokenizer_config.json")?);
    let cfg = kvsteer_tokenizer::TokenizerConfig::default();
    let t = kvsteer_tokenizer::TextTokenizer::with_huggingface(&cfg, &json, Some(&config))
        .map_err(|e| format!("{}: {e}", dir.display()))?;
    HUGGING_FACE
        .set(std::sync::Mutex::new(t))
        .map_err(|_| "the Hugging Face bundle was already chosen for this process".to_string())
}

/// A chat's ids with the Hugging Face bundle's template, when one is chosen and renders it.
pub fn hf_chat(
    turns: &[kvsteer_core::request::ChatTurn<'_>],
    tools: Option<&str>,
) -> Option<Vec<u32>> {
    use kvsteer_core::request::PromptTokenizer;
    let mut t = HUGGING_FACE
        .get()?
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    t.tokenize_chat_tools(turns, tools)
}

/// Whether a Hugging Face bundle is chosen.
pub fn huggingface() -> bool {
    HUGGING_FACE.get().is_some()
}

/// Chooses the process's tokenizer (loading a vocabulary takes a moment). Only the first call counts;
/// a later one with another choice is an error. Without a call the stand-in is used.
pub fn select(kind: TokenizerKind) -> Result<(), String> {
    let want = match kind {
        TokenizerKind::StandIn => None,
        TokenizerKind::Bpe(v) => Some(v),
    };
    let got = SELECTED.get_or_init(|| want.map(Bpe::load));
    if got.as_ref().map(Bpe::vocabulary) == want {
        Ok(())
    } else {
        Err("the tokenizer was already chosen for this process".into())
    }
}

/// Token ids of `text` with the selected tokenizer.
pub fn tokenize(text: &str) -> Vec<u32> {
    if let Some(hf) = HUGGING_FACE.get() {
        use kvsteer_core::request::PromptTokenizer;
        let ids = hf
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .tokenize_text(text);
        return ids.unwrap_or_else(|| stand_in(text));
    }
    match SELECTED.get() {
        Some(Some(bpe)) => bpe_tokenize(bpe, text).unwrap_or_else(|| stand_in(text)),
        _ => stand_in(text),
    }
}

fn bpe_tokenize(bpe: &Bpe, text: &str) -> Option<Vec<u32>> {
    let mut out = Vec::with_capacity(text.len() / 4 + 4);
    let mut ok = true;
    bpe.segments(text, |s| match s {
        Segment::Special(id) => out.push(id),
        Segment::Text(t) if ok => match bpe.encode_ordinary(t) {
            Some(ids) => out.extend(ids),
            None => ok = false,
        },
        Segment::Text(_) => {}
    });
    ok.then_some(out)
}

/// Bytes per token of the stand-in.
pub const BYTES_PER_TOKEN: usize = 4;

/// Token ids of `text` with the stand-in.
pub fn stand_in(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len().div_ceil(BYTES_PER_TOKEN));
    for chunk in text.as_bytes().chunks(BYTES_PER_TOKEN) {
        let mut v = [0u8; 8];
        v[..chunk.len()].copy_from_slice(chunk);
        v[7] = chunk.len() as u8;
        out.push((mix64(u64::from_le_bytes(v)) % VOCAB as u64) as u32);
    }
    out
}

const SYLLABLES: [&str; 16] = [
    "ka", "lo", "mi", "ne", "ru", "ta", "vo", "zen", "pa", "shi", "do", "ri", "bu", "ge", "fa",
    "yo",
];

/// Text of one output token: a space and a two-syllable pseudo-word.
pub fn token_text(id: u32, out: &mut String) {
    out.push(' ');
    out.push_str(SYLLABLES[(id & 15) as usize]);
    out.push_str(SYLLABLES[((id >> 4) & 15) as usize]);
}

/// Text of a run of output tokens.
pub fn detokenize(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 5);
    for &id in ids {
        token_text(id, &mut s);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_text_prefix_shares_tokens() {
        let a = stand_in("You are a helpful assistant. Question one?");
        let b = stand_in("You are a helpful assistant. Question two!");
        assert_eq!(a.len(), 11);
        let shared = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert!(shared >= 8, "{shared}");
        assert_ne!(a, b);
        assert_eq!(stand_in("abcd"), stand_in("abcd"));
        assert_ne!(stand_in("abc"), stand_in("abc\0"));
        assert!(stand_in("").is_empty());
    }

    #[test]
    fn the_real_bpe_recognises_the_servers_chat_framing() {
        let bpe = Bpe::load(Vocabulary::O200kHarmony);
        let ids = bpe_tokenize(&bpe, "<|start|>user\nhello world<|end|>\n").unwrap();
        assert_eq!(ids.first(), Some(&200006));
        assert!(ids.contains(&200007));
        assert!(ids.windows(2).any(|w| w == [24912, 2375]));
        assert!("o200k_harmony".parse::<TokenizerKind>().is_ok());
        assert!("gpt2".parse::<TokenizerKind>().is_err());
    }

    #[test]
    fn detokenize_is_plain_text() {
        let s = detokenize(&[0, 17, 255]);
        assert_eq!(s, " kaka lolo yoyo");
    }
}
