//! `model.merges`, read in a second pass over `tokenizer.json` once the vocabulary is known: each
//! merge is resolved to ids as serde reads it, so the 280K merges never exist as a list of strings
//! (which, with its growth, was half of a bundle's load peak). Either spelling is read: `"a b"` (older
//! files) or `["a", "b"]`.

use super::model::MAX_VOCAB;
use hashbrown::HashMap;
use serde::Deserialize;
use serde::de::{DeserializeSeed, Error, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::borrow::Cow;
use std::fmt;

/// Bound on the number of merges, well above any released model (Llama 3.1: 280,147).
pub const MAX_MERGES: usize = MAX_VOCAB;

/// (left id, right id) -> (rank, merged id).
pub type MergeTable = HashMap<(u32, u32), (u32, u32)>;

/// The vocabulary as `model.vocab` reads it.
pub type Vocab<'a> = std::collections::HashMap<Str<'a>, u32>;

/// A JSON string borrowed from the input when it has no escapes (almost every token), owned when it
/// has: serde's own `Cow` always copies, which for 400K strings is most of a bundle's load peak.
#[derive(PartialEq, Eq, Hash)]
pub struct Str<'a>(pub Cow<'a, str>);

impl std::borrow::Borrow<str> for Str<'_> {
    fn borrow(&self) -> &str {
        &self.0
    }
}

struct StrVisitor;

impl<'de> serde::de::Visitor<'de> for StrVisitor {
    type Value = Str<'de>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Str<'de>, E> {
        Ok(Str(Cow::Borrowed(v)))
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Str<'de>, E> {
        Ok(Str(Cow::Owned(v.to_string())))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_str(StrVisitor)
    }
}

/// A merge in either of `tokenizers`' two spellings: `"a b"` (older files) or `["a", "b"]`. Read by
/// hand rather than as an untagged enum, which would buffer each of the 280K entries first.
pub enum MergeJson<'a> {
    Line(Str<'a>),
    Pair(Str<'a>, Str<'a>),
}

struct MergeVisitor;

impl<'de> serde::de::Visitor<'de> for MergeVisitor {
    type Value = MergeJson<'de>;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a merge: \"a b\" or [\"a\", \"b\"]")
    }
    fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        StrVisitor.visit_borrowed_str(v).map(MergeJson::Line)
    }
    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        StrVisitor.visit_str(v).map(MergeJson::Line)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        use serde::de::Error;
        let a = seq
            .next_element()?
            .ok_or_else(|| A::Error::invalid_length(0, &self))?;
        let b = seq
            .next_element()?
            .ok_or_else(|| A::Error::invalid_length(1, &self))?;
        if seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
            return Err(A::Error::invalid_length(3, &self));
        }
        Ok(MergeJson::Pair(a, b))
    }
}

impl<'de: 'a, 'a> Deserialize<'de> for MergeJson<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MergeVisitor)
    }
}

/// Reads `model.merges` of `file` into the table; errors name the merge (`merges[17]: ...`).
pub fn merge_table(file: &[u8], vocab: &Vocab<'_>) -> Result<MergeTable, String> {
    let mut de = serde_json::Deserializer::from_slice(file);
    Section { vocab, depth: 0 }
        .deserialize(&mut de)
        .map_err(|e| e.to_string())
}

/// The top-level object (depth 0) or `model` (depth 1): only the key leading to the merges is read.
struct Section<'v, 'a> {
    vocab: &'v Vocab<'a>,
    depth: u8,
}

impl<'de> DeserializeSeed<'de> for Section<'_, '_> {
    type Value = MergeTable;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<MergeTable, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Section<'_, '_> {
    type Value = MergeTable;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<MergeTable, A::Error> {
        let mut table = None;
        while let Some(key) = map.next_key::<Str>()? {
            match (self.depth, key.0.as_ref()) {
                (0, "model") if table.is_none() => {
                    let seed = Section {
                        vocab: self.vocab,
                        depth: 1,
                    };
                    table = Some(map.next_value_seed(seed)?);
                }
                (1, "merges") if table.is_none() => {
                    table = Some(map.next_value_seed(Merges(self.vocab))?);
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(table.unwrap_or_default())
    }
}

/// The `merges` list.
struct Merges<'v, 'a>(&'v Vocab<'a>);

impl<'de> DeserializeSeed<'de> for Merges<'_, '_> {
    type Value = MergeTable;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<MergeTable, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Merges<'_, '_> {
    type Value = MergeTable;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of merges")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MergeTable, A::Error> {
        let mut table = MergeTable::with_capacity(seq.size_hint().unwrap_or(0).min(MAX_MERGES));
        let mut joined = String::new();
        while let Some(merge) = seq.next_element::<MergeJson>()? {
            let rank = table.len();
            if rank >= MAX_MERGES {
                return Err(A::Error::custom(format!("merges: over {MAX_MERGES}")));
            }
            let (a, b) = merge
                .sides()
                .map_err(|e| A::Error::custom(format!("merges[{rank}]: {e}")))?;
            joined.clear();
            joined.push_str(a);
            joined.push_str(b);
            let id = |s: &str| {
                self.0.get(s).copied().ok_or_else(|| {
                    A::Error::custom(format!("merges[{rank}]: {s:?} is not in the vocabulary"))
                })
            };
            // A pair listed twice keeps its last rank, as `tokenizers` collects its map.
            table.insert((id(a)?, id(b)?), (rank as u32, id(&joined)?));
        }
        Ok(table)
    }
}

impl MergeJson<'_> {
    fn sides(&self) -> Result<(&str, &str), String> {
        match self {
            MergeJson::Line(Str(l)) => l
                .split_once(' ')
                .filter(|(_, b)| !b.contains(' '))
                .ok_or_else(|| format!("{l:?} is not two tokens")),
            MergeJson::Pair(a, b) => Ok((&a.0, &b.0)),
        }
    }
}
