//! `model.vocab` as one byte arena and an index: the token strings end to end in one buffer, their
//! ends and ids in two `u32` lists, and a hash table of token numbers. A `HashMap<String, u32>` of
//! 128K tokens costs a heap block and 32 bytes of bucket per token (about 8 MB for Llama 3.1, most of
//! a bundle's load peak); this is about 3 MB. It resolves the merges while the bundle loads, and is
//! kept afterwards only for `ignore_merges` (a piece that is a whole token is that token).

use super::merges::Str;
use super::model::MAX_VOCAB;
use hashbrown::{DefaultHashBuilder, HashTable};
use serde::de::{Deserialize, Deserializer, Error, MapAccess, Visitor};
use std::fmt;
use std::hash::BuildHasher;

/// The vocabulary: token string (as `tokenizer.json` writes it) -> id.
#[derive(Default)]
pub struct VocabIndex {
    arena: Vec<u8>,
    /// End of token `i`'s string in `arena` (its start is the end of `i - 1`).
    ends: Vec<u32>,
    ids: Vec<u32>,
    /// Token numbers (indices into `ends` and `ids`); a string listed twice keeps its last id, as
    /// serde's map does.
    table: HashTable<u32>,
    hasher: DefaultHashBuilder,
}

impl VocabIndex {
    fn bytes_of(&self, i: u32) -> &[u8] {
        let i = i as usize;
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.arena[start..self.ends[i] as usize]
    }

    /// The id of a token, by its UTF-8 bytes.
    pub fn get_bytes(&self, key: &[u8]) -> Option<u32> {
        let hash = self.hasher.hash_one(key);
        self.table
            .find(hash, |&i| self.bytes_of(i) == key)
            .map(|&i| self.ids[i as usize])
    }

    pub fn get(&self, key: &str) -> Option<u32> {
        self.get_bytes(key.as_bytes())
    }

    /// Distinct strings.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// The ids of the distinct strings.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.table.iter().map(|&i| self.ids[i as usize])
    }

    /// Bytes held on the heap (for memory reports).
    pub fn heap_bytes(&self) -> usize {
        self.arena.capacity()
            + 4 * (self.ends.capacity() + self.ids.capacity())
            + self.table.allocation_size()
    }

    fn push(&mut self, s: &str, id: u32) {
        self.arena.extend_from_slice(s.as_bytes());
        self.ends.push(self.arena.len() as u32);
        self.ids.push(id);
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
        let v: VocabIndex =
            serde_json::from_str(r#"{"a": 0, "": 7, "ab": 1, "Ġx": 2, "a": 3, "\u0041": 4}"#)
                .unwrap();
        assert_eq!(v.len(), 5);
        assert_eq!(v.get("a"), Some(3));
        assert_eq!(v.get(""), Some(7));
        assert_eq!(v.get("ab"), Some(1));
        assert_eq!(v.get("Ġx"), Some(2));
        assert_eq!(v.get("A"), Some(4));
        assert_eq!(v.get("b"), None);
        let mut ids: Vec<u32> = v.ids().collect();
        ids.sort();
        assert_eq!(ids, vec![1, 2, 3, 4, 7]);
    }
}
