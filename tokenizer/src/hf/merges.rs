//! `model.merges`, read in a second pass over `tokenizer.json` once the vocabulary is known: each
//! merge is resolved to ids as serde reads it, so the 280K merges never exist as a list of strings
//! (which, with its growth, was half of a bundle's load peak). Either spelling is read: `"a b"` (older
//! files) or `["a", "b"]`. The table is compact: the merges grouped by their left token, each group
//! sorted by the right token (12 bytes a merge, against 32 in a hash map at its load factor).

use super::model::MAX_VOCAB;
use super::vocab::VocabIndex;
use serde::Deserialize;
use serde::de::{DeserializeSeed, Error, IgnoredAny, MapAccess, SeqAccess, Visitor};
use std::borrow::Cow;
use std::fmt;

/// Bound on the number of merges, well above any released model (Llama 3.1: 280,147).
pub const MAX_MERGES: usize = MAX_VOCAB;

/// One merge in its left token's group.
#[derive(Clone, Copy, Default)]
struct Merge {
    right: u32,
    rank: u32,
    id: u32,
}

/// (left id, right id) -> (rank, merged id): `starts[left]..starts[left + 1]` are the left token's
/// merges in `merges`, sorted by right id.
#[derive(Default)]
pub struct MergeTable {
    starts: Vec<u32>,
    merges: Vec<Merge>,
}

impl MergeTable {
    /// The table of `list`, each entry (left id, right id, merged id) in rank order. A pair listed
    /// twice keeps its last rank, as `tokenizers` collects its map. Left ids must be under
    /// [`MAX_VOCAB`] (they index the groups).
    pub fn from_list(list: &[[u32; 3]]) -> Result<MergeTable, String> {
        let Some(max_left) = list.iter().map(|m| m[0]).max() else {
            return Ok(MergeTable::default());
        };
        if max_left as usize >= MAX_VOCAB {
            return Err(format!("a merge of token id {max_left}, over {MAX_VOCAB}"));
        }
        let mut starts = vec![0u32; max_left as usize + 2];
        for m in list {
            starts[m[0] as usize + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut next = starts.clone();
        let mut merges = vec![Merge::default(); list.len()];
        for (rank, &[left, right, id]) in list.iter().enumerate() {
            let at = &mut next[left as usize];
            merges[*at as usize] = Merge {
                right,
                rank: rank as u32,
                id,
            };
            *at += 1;
        }
        drop(next);
        // Each group sorted by right id, then rank; a repeated pair keeps its last (highest) rank.
        let mut kept = 0usize;
        for left in 0..starts.len() - 1 {
            let (a, b) = (starts[left] as usize, starts[left + 1] as usize);
            starts[left] = kept as u32;
            merges[a..b].sort_unstable_by_key(|m| (m.right, m.rank));
            for i in a..b {
                if i + 1 < b && merges[i + 1].right == merges[i].right {
                    continue;
                }
                merges[kept] = merges[i];
                kept += 1;
            }
        }
        *starts.last_mut().unwrap_or(&mut 0) = kept as u32;
        merges.truncate(kept);
        merges.shrink_to_fit();
        Ok(MergeTable { starts, merges })
    }

    /// The rank of merging `left` and `right`, and the token it makes.
    #[inline]
    pub fn get(&self, left: u32, right: u32) -> Option<(u32, u32)> {
        let l = left as usize;
        let (&a, &b) = (self.starts.get(l)?, self.starts.get(l + 1)?);
        let group = &self.merges[a as usize..b as usize];
        let i = group.binary_search_by_key(&right, |m| m.right).ok()?;
        Some((group[i].rank, group[i].id))
    }

    /// Distinct pairs.
    pub fn len(&self) -> usize {
        self.merges.len()
    }

    pub fn is_empty(&self) -> bool {
        self.merges.is_empty()
    }

    /// Bytes held on the heap (for memory reports).
    pub fn heap_bytes(&self) -> usize {
        4 * self.starts.capacity() + std::mem::size_of::<Merge>() * self.merges.capacity()
    }
}

/// The vocabulary as `model.vocab` reads it.
pub type Vocab = VocabIndex;

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
pub fn merge_table(file: &[u8], vocab: &Vocab) -> Result<MergeTable, String> {
    let mut de = serde_json::Deserializer::from_slice(file);
    Section { vocab, depth: 0 }
        .deserialize(&mut de)
        .map_err(|e| e.to_string())
}

/// The top-level object (depth 0) or `model` (depth 1): only the key leading to the merges is read.
struct Section<'v> {
    vocab: &'v Vocab,
    depth: u8,
}

impl<'de> DeserializeSeed<'de> for Section<'_> {
    type Value = MergeTable;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<MergeTable, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for Section<'_> {
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
struct Merges<'v>(&'v Vocab);

impl<'de> DeserializeSeed<'de> for Merges<'_> {
    type Value = MergeTable;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<MergeTable, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for Merges<'_> {
    type Value = MergeTable;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of merges")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MergeTable, A::Error> {
        // Sized for the vocabulary (the covered families have 1 to 2.2 merges a token), so the list
        // rarely grows: a growth would hold the old and the new list at once.
        let guess = (self.0.len() * 9 / 4).min(MAX_MERGES);
        let mut list: Vec<[u32; 3]> = Vec::with_capacity(seq.size_hint().unwrap_or(guess));
        let mut joined = String::new();
        while let Some(merge) = seq.next_element::<MergeJson>()? {
            let rank = list.len();
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
                self.0.get(s).ok_or_else(|| {
                    A::Error::custom(format!("merges[{rank}]: {s:?} is not in the vocabulary"))
                })
            };
            list.push([id(a)?, id(b)?, id(&joined)?]);
        }
        list.shrink_to_fit();
        MergeTable::from_list(&list).map_err(|e| A::Error::custom(format!("merges: {e}")))
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
