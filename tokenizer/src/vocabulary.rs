//! The BPE vocabularies: OpenAI's `o200k_base` and its gpt-oss variant `o200k_harmony` (same 199,998
//! merges, plus the harmony format's special tokens `<|start|>`, `<|message|>`, `<|end|>`, ...).
//! Both come compiled into the binary from the `tiktoken-rs` crate, so a proxy needs no network at
//! start; the price is about 3.6 MB of vocabulary text in the `.wasm` and a one-time parse per VM.
//!
//! Encoding is split at special tokens by this module rather than by tiktoken, so that each ordinary
//! segment between two special tokens can be cached on its own (see `segment_cache`): the BPE pieces
//! never cross a special token, so encoding the segments one by one gives exactly the ids of encoding
//! the whole text.

use hashbrown::HashMap;
use std::collections::HashSet;
use tiktoken_rs::CoreBPE;

/// Which vocabulary to tokenize with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Vocabulary {
    /// `o200k_base` (GPT-4o family): special tokens `<|endoftext|>`, `<|endofprompt|>`.
    O200kBase,
    /// `o200k_harmony` (gpt-oss): o200k_base plus the harmony special tokens.
    #[default]
    O200kHarmony,
}

impl Vocabulary {
    pub fn name(self) -> &'static str {
        match self {
            Vocabulary::O200kBase => "o200k_base",
            Vocabulary::O200kHarmony => "o200k_harmony",
        }
    }

    fn bpe(self) -> &'static CoreBPE {
        match self {
            Vocabulary::O200kBase => tiktoken_rs::o200k_base_singleton(),
            Vocabulary::O200kHarmony => tiktoken_rs::o200k_harmony_singleton(),
        }
    }
}

/// One loaded vocabulary with its special-token table.
pub struct Bpe {
    vocabulary: Vocabulary,
    bpe: &'static CoreBPE,
    specials: HashMap<&'static str, u32>,
    /// The longest special token, in bytes: bounds the search for a closing `|>`.
    longest_special: usize,
    no_specials: HashSet<&'static str>,
}

/// A piece of rendered text: ordinary text to encode, or one special token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Segment<'a> {
    Text(&'a str),
    Special(u32),
}

impl Bpe {
    /// Loads (first use in this process parses the vocabulary: tens of milliseconds natively).
    pub fn load(vocabulary: Vocabulary) -> Bpe {
        let bpe = vocabulary.bpe();
        let mut specials = HashMap::new();
        for s in bpe.special_tokens() {
            let mut only = HashSet::new();
            only.insert(s);
            if let Ok((ids, _)) = bpe.encode(s, &only)
                && let [id] = ids[..]
            {
                specials.insert(s, id);
            }
        }
        let longest_special = specials.keys().map(|s| s.len()).max().unwrap_or(0);
        Bpe {
            vocabulary,
            bpe,
            specials,
            longest_special,
            no_specials: HashSet::new(),
        }
    }

    pub fn vocabulary(&self) -> Vocabulary {
        self.vocabulary
    }

    /// Id of a special token (`<|start|>`), if the vocabulary has it.
    pub fn special(&self, token: &str) -> Option<u32> {
        self.specials.get(token).copied()
    }

    /// Encodes ordinary text, special-token look-alikes included as plain text. Errors (the regex
    /// engine's backtrack limit) come back as `None`, never a panic.
    pub fn encode_ordinary(&self, text: &str) -> Option<Vec<u32>> {
        self.bpe
            .encode(text, &self.no_specials)
            .ok()
            .map(|(v, _)| v)
    }

    /// Calls `f` for each segment of `text` in order: special tokens (as engines' tokenizers do, they
    /// are recognised anywhere in the rendered prompt) and the ordinary text between them.
    pub fn segments<'a>(&self, text: &'a str, mut f: impl FnMut(Segment<'a>)) {
        let b = text.as_bytes();
        let mut start = 0;
        let mut i = 0;
        while let Some(off) = find2(&b[i..], b'<', b'|') {
            let at = i + off;
            let window_end = (at + self.longest_special).min(b.len());
            let close = find2(&b[at + 2..window_end], b'|', b'>').map(|c| at + 2 + c + 2);
            match close.and_then(|end| Some((end, *self.specials.get(&text[at..end])?))) {
                Some((end, id)) => {
                    if at > start {
                        f(Segment::Text(&text[start..at]));
                    }
                    f(Segment::Special(id));
                    start = end;
                    i = end;
                }
                None => i = at + 1,
            }
        }
        if start < b.len() {
            f(Segment::Text(&text[start..]));
        }
    }
}

/// Offset of the first `a` immediately followed by `b`.
fn find2(hay: &[u8], a: u8, b: u8) -> Option<usize> {
    hay.windows(2).position(|w| w[0] == a && w[1] == b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_split_at_specials_only() {
        let bpe = Bpe::load(Vocabulary::O200kHarmony);
        let start = bpe.special("<|start|>").unwrap();
        let end = bpe.special("<|end|>").unwrap();
        assert_eq!(start, 200006);
        assert_eq!(end, 200007);
        let mut got = Vec::new();
        bpe.segments("<|start|>user a <|x|> <|b<|end|>tail", |s| got.push(s));
        assert_eq!(
            got,
            vec![
                Segment::Special(start),
                Segment::Text("user a <|x|> <|b"),
                Segment::Special(end),
                Segment::Text("tail"),
            ]
        );
        // <|start|> is not special in plain o200k_base.
        let base = Bpe::load(Vocabulary::O200kBase);
        let mut n = 0;
        base.segments("<|start|>x", |_| n += 1);
        assert_eq!(n, 1);
    }

    #[test]
    fn known_o200k_ids() {
        // Reference ids from OpenAI's tiktoken for o200k_base.
        let bpe = Bpe::load(Vocabulary::O200kBase);
        assert_eq!(
            bpe.encode_ordinary("hello world").unwrap(),
            vec![24912, 2375]
        );
        assert_eq!(bpe.special("<|endoftext|>"), Some(199999));
    }
}
