//! What `tokenizers` does before the pre-tokenizer (`tokenizer/added_vocabulary.rs`): added tokens
//! whose `normalized` is false are found in the raw text first; the text between them is normalized;
//! then the added tokens whose `normalized` is true are found in that normalized text. Matching is
//! leftmost-longest over all of them at once (aho-corasick), anywhere in the text, special or not: an
//! engine tokenizing a rendered chat template does the same, so `<|eot_id|>` written by the template is
//! one token.

use aho_corasick::{AhoCorasick, MatchKind};
use serde::Deserialize;
use serde_json::Value;
use std::borrow::Cow;
use unicode_normalization_alignments::UnicodeNormalization;
use unicode_normalization_alignments::{IsNormalized, is_nfc_quick, is_nfkc_quick};

/// One entry of `added_tokens`.
#[derive(Deserialize)]
pub struct AddedToken<'a> {
    pub id: u32,
    #[serde(borrow)]
    pub content: Cow<'a, str>,
    #[serde(default)]
    pub normalized: bool,
    #[serde(default)]
    pub lstrip: bool,
    #[serde(default)]
    pub rstrip: bool,
    #[serde(default)]
    pub single_word: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    Nfc,
    Nfd,
    Nfkc,
    Nfkd,
}

/// The `normalizer`: a list of Unicode normalization forms, applied in order. Other normalizers
/// (`Replace`, `Prepend`, `Lowercase` ...) belong to families not covered here and are refused.
#[derive(Default)]
pub struct Normalizer {
    forms: Vec<Form>,
}

impl Normalizer {
    pub fn from_json(v: &Value) -> Result<Normalizer, String> {
        let mut n = Normalizer::default();
        if !v.is_null() {
            n.add(v, 0)?;
        }
        Ok(n)
    }

    fn add(&mut self, v: &Value, depth: usize) -> Result<(), String> {
        let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
        let form = match kind {
            "Sequence" if depth < 4 => {
                let list = v
                    .get("normalizers")
                    .and_then(Value::as_array)
                    .ok_or("Sequence without normalizers")?;
                return list.iter().try_for_each(|n| self.add(n, depth + 1));
            }
            "NFC" => Form::Nfc,
            "NFD" => Form::Nfd,
            "NFKC" => Form::Nfkc,
            "NFKD" => Form::Nfkd,
            other => return Err(format!("normalizer type {other:?} is not supported")),
        };
        self.forms.push(form);
        Ok(())
    }

    /// The normalized text; borrowed when nothing changes (the usual case: NFC text stays as it is).
    /// Unicode 9.0 data, as `tokenizers` has it: marks assigned later count as class 0.
    pub fn apply<'t>(&self, text: &'t str) -> Cow<'t, str> {
        let mut out = Cow::Borrowed(text);
        for form in &self.forms {
            let done = match form {
                Form::Nfc => is_nfc_quick(out.chars()) == IsNormalized::Yes,
                Form::Nfkc => is_nfkc_quick(out.chars()) == IsNormalized::Yes,
                Form::Nfd | Form::Nfkd => false,
            };
            if done {
                continue;
            }
            let text: &str = &out;
            let s: String = match form {
                Form::Nfc => text.nfc().map(|(c, _)| c).collect(),
                Form::Nfd => text.nfd().map(|(c, _)| c).collect(),
                Form::Nfkc => text.nfkc().map(|(c, _)| c).collect(),
                Form::Nfkd => text.nfkd().map(|(c, _)| c).collect(),
            };
            if s != *out {
                out = Cow::Owned(s);
            }
        }
        out
    }
}

/// One automaton and the id of each of its patterns.
struct Matcher {
    automaton: AhoCorasick,
    ids: Vec<u32>,
}

impl Matcher {
    fn new(tokens: Vec<(String, u32)>) -> Result<Option<Matcher>, String> {
        if tokens.is_empty() {
            return Ok(None);
        }
        let (patterns, ids): (Vec<String>, Vec<u32>) = tokens.into_iter().unzip();
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .map_err(|e| format!("added_tokens: {e}"))?;
        Ok(Some(Matcher { automaton, ids }))
    }
}

/// The added tokens, split into the two passes.
pub struct AddedTokens {
    raw: Option<Matcher>,
    normalized: Option<Matcher>,
}

/// A piece of text as the added-token passes leave it.
pub enum Piece<'t> {
    Text(&'t str),
    Token(u32),
}

impl AddedTokens {
    /// Builds both automata. `lstrip`, `rstrip` and `single_word` (whitespace absorbed around the token,
    /// word-boundary matching) are refused: none of the covered families sets them, and silently
    /// ignoring them would give ids that differ from the engine's.
    pub fn new(tokens: &[AddedToken<'_>], normalizer: &Normalizer) -> Result<AddedTokens, String> {
        let (mut raw, mut normalized) = (Vec::new(), Vec::new());
        for t in tokens {
            if t.lstrip || t.rstrip || t.single_word {
                return Err(format!(
                    "added token {:?}: lstrip, rstrip and single_word are not supported",
                    t.content
                ));
            }
            if t.content.is_empty() {
                continue;
            }
            if t.normalized {
                normalized.push((normalizer.apply(&t.content).into_owned(), t.id));
            } else {
                raw.push((t.content.to_string(), t.id));
            }
        }
        Ok(AddedTokens {
            raw: Matcher::new(raw)?,
            normalized: Matcher::new(normalized)?,
        })
    }

    /// Calls `f` for the added tokens and the normalized text between them, in order.
    pub fn split(&self, text: &str, normalizer: &Normalizer, f: &mut dyn FnMut(Piece<'_>)) {
        each_piece(self.raw.as_ref(), text, &mut |p| match p {
            Piece::Token(id) => f(Piece::Token(id)),
            Piece::Text(gap) => {
                let norm = normalizer.apply(gap);
                each_piece(self.normalized.as_ref(), &norm, f);
            }
        });
    }
}

fn each_piece(m: Option<&Matcher>, text: &str, f: &mut dyn FnMut(Piece<'_>)) {
    let Some(m) = m else {
        if !text.is_empty() {
            f(Piece::Text(text));
        }
        return;
    };
    let mut at = 0;
    for hit in m.automaton.find_iter(text) {
        if hit.start() > at {
            f(Piece::Text(&text[at..hit.start()]));
        }
        f(Piece::Token(m.ids[hit.pattern().as_usize()]));
        at = hit.end();
    }
    if at < text.len() {
        f(Piece::Text(&text[at..]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_then_normalized_tokens() {
        let norm = Normalizer::from_json(&serde_json::json!({"type": "NFC"})).unwrap();
        let toks = vec![
            AddedToken {
                id: 7,
                content: "<s>".into(),
                normalized: false,
                lstrip: false,
                rstrip: false,
                single_word: false,
            },
            AddedToken {
                id: 8,
                content: "<so>".into(),
                normalized: true,
                lstrip: false,
                rstrip: false,
                single_word: false,
            },
        ];
        let added = AddedTokens::new(&toks, &norm).unwrap();
        let mut got = Vec::new();
        added.split("a<s>e\u{301}<so>b", &norm, &mut |p| {
            got.push(match p {
                Piece::Text(t) => t.to_string(),
                Piece::Token(id) => format!("#{id}"),
            })
        });
        assert_eq!(got, ["a", "#7", "\u{e9}", "#8", "b"]);
    }
}
