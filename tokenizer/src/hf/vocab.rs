//! `model.vocab` as one byte arena and an index: the tokens' bytes end to end in one buffer, their
//! ends and ids in two `u32` lists, and a hash table of token numbers. A `HashMap<String, u32>` of
//! 128K tokens costs a heap block and 32 bytes of bucket per token (about 8 MB for Llama 3.1, most of
//! a bundle's load peak); this is about 3 MB. It resolves the merges while the bundle loads, and is
//! kept afterwards only for `ignore_merges` (a piece that is a whole token is that token).
//!
//! A token is keyed by its bytes: its string is written in GPT-2's byte characters
//! ([`byte_chars`]), one character a byte, so a piece is looked up as it is. The rare string with a
//! character outside that table (no piece can be it) is kept apart, as written, for the merges.

use super::bpe::byte_chars;
use super::merges::Str;
use super::model::MAX_VOCAB;
use hashbrown::{DefaultHashBuilder, HashMap, HashTable};
use serde::de::{Deserialize, Deserializer, Error, MapAccess, Visitor};
use std::fmt;
use std::hash::BuildHasher;

/// The byte each of [`byte_chars`]' characters stands for, by code point (all are under U+0200).
fn char_bytes() -> Box<[Option<u8>; 512]> {
    let mut table = Box::new([None; 512]);
    for (b, c) in byte_chars().iter().enumerate() {
        table[*c as usize] = Some(b as u8);
    }
    table
}

/// The vocabulary: token string (as `tokenizer.json` writes it) -> id.
pub struct VocabIndex {
    arena: Vec<u8>,
    /// End of token `i`'s string in `arena` (its start is the end of `i - 1`).
    ends: Vec<u32>,
    ids: Vec<u32>,
    /// Token numbers (indices into `ends` and `ids`); a string listed twice keeps its last id, as
    /// serde's map does.
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
    /// Strings with a character outside the byte table, as written.
    other: HashMap<String, u32>,
    char_bytes: Box<[Option<u8>; 512]>,
}

impl Default for VocabIndex {
    fn default() -> VocabIndex {
        VocabIndex {
            arena: Vec::new(),
            ends: Vec::new(),
            ids: Vec::new(),
            table: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
            other: HashMap::new(),
            char_bytes: char_bytes(),
        }
    }
}

impl VocabIndex {
    fn bytes_of(&self, i: u32) -> &[u8] {
        let i = i as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.arena[start..self.ends[i] as usize]
    }

    /// The id of the token that is these bytes (a piece, or one byte).
    pub fn get_bytes(&self, key: &[u8]) -> Option<u32> {
        let hash = self.hasher.hash_one(key);
        self.table
            .find(hash, |&i| self.bytes_of(i) == key)
            .map(|&i| self.ids[i as usize])
    }

    /// Appends the bytes `s` stands for; false (`out` then unspecified) when a character is
    /// outside the byte table.
    fn decode(&self, s: &str, out: &mut Vec<u8>) -> bool {
        for c in s.chars() {
            match self.char_bytes.get(c as usize).copied().flatten() {
                Some(b) => out.push(b),
                None => return false,
            }
        }
        true
    }

    /// The id of a token as `tokenizer.json` writes it.
    pub fn get(&self, key: &str) -> Option<u32> {
        let mut buf = Vec::with_capacity(key.len());
        if self.decode(key, &mut buf) {
            self.get_bytes(&buf)
        } else {
            self.other.get(key).copied()
        }
    }

    /// Distinct strings.
    pub fn len(&self) -> usize {
        self.table.len() + self.other.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The ids of the distinct strings.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        let other = self.other.values().copied();
        self.table
            .iter()
            .map(|&i| self.ids[i as usize])
            .chain(other)
    }

    /// Bytes held on the heap (for memory reports).
    pub fn heap_bytes(&self) -> usize {
        self.arena.capacity()
            + 4 * (self.ends.capacity() + self.ids.capacity())
            + self.table.allocation_size()
            + self.other.allocation_size()
            + self.other.keys().map(String::capacity).sum::<usize>()
    }

    fn push(&mut self, s: &str, id: u32) {
        let start = self.arena.len();
        let mut arena = std::mem::take(&mut self.arena);
        let decoded = self.decode(s, &mut arena);
        self.arena = arena;
        if decoded {
            self.ends.push(self.arena.len() as u32);
            self.ids.push(id);
        } else {
            self.arena.truncate(start);
            self.other.insert(s.to_string(), id);
        }
    }

    /// Indexes the strings pushed, each once: the table is sized once, for all of them.
    fn index(&mut self) {
        self.arena.shrink_to_fit();
        self.ends.shrink_to_fit();
        self.ids.shrink_to_fit();
        let mut table = HashTable::with_capacity(self.ends.len());
        for i in 0..self.ends.len() as u32 {
            let key = self.bytes_of(i);
            let hash = self.hasher.hash_one(key);
            match table.find_mut(hash, |&j| self.bytes_of(j) == key) {
                Some(j) => *j = i,
                None => {
                    table.insert_unique(hash, i, |&j| self.hasher.hash_one(self.bytes_of(j)));
                }
            }
        }
        self.table = table;
    }
}

struct VocabVisitor;

impl<'de> Visitor<'de> for VocabVisitor {
    type Value = VocabIndex;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map of token strings to ids")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<VocabIndex, A::Error> {
        let mut v = VocabIndex::default();
        while let Some(key) = map.next_key::<Str>()? {
            if v.ends.len() >= MAX_VOCAB {
                return Err(A::Error::custom(format!("model: over {MAX_VOCAB} tokens")));
            }
            let id: u32 = map.next_value()?;
            if v.arena.len() + key.0.len() > u32::MAX as usize {
                return Err(A::Error::custom("model: vocabulary strings over 4 GiB"));
            }
            v.push(&key.0, id);
        }
        v.index();
        Ok(v)
    }
}

impl<'de> Deserialize<'de> for VocabIndex {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(VocabVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_and_duplicates_follow_a_map() {
        let v: VocabIndex = serde_json::from_str(
            r#"{"a": 0, "": 7, "ab": 1, "Ġx": 2, "a": 3, "\u0041": 4, "a b": 5, "a b": 6, "Ċ": 8}"#,
        )
        .unwrap();
        assert_eq!(v.len(), 7);
        assert_eq!(v.get("a"), Some(3));
        assert_eq!(v.get(""), Some(7));
        assert_eq!(v.get("ab"), Some(1));
        assert_eq!(v.get("Ġx"), Some(2));
        assert_eq!(v.get("A"), Some(4));
        assert_eq!(v.get("b"), None);
        // A literal space is outside the byte table: kept as written, never a piece.
        assert_eq!(v.get("a b"), Some(6));
        assert_eq!(v.get_bytes(b"a b"), None);
        assert_eq!(v.get_bytes(b" x"), Some(2));
        assert_eq!(v.get_bytes(b"\n"), Some(8));
        let mut ids: Vec<u32> = v.ids().collect();
        ids.sort();
        assert_eq!(ids, vec![1, 2, 3, 4, 6, 7, 8]);
    }
}
