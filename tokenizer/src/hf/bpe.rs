//! Byte-level BPE exactly as Hugging Face `tokenizers` runs it (`models/bpe/word.rs`): a piece's bytes
//! start as one symbol each, then the adjacent pair with the lowest merge rank is merged, leftmost
//! first on ties, until no pair has a merge. That is not tiktoken's rule (tiktoken ranks a pair by the
//! id of the token it makes), so the merge list's own order is kept here.

use super::merges::MergeTable;
use super::vocab::VocabIndex;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// GPT-2's byte-to-character table: the printable bytes stand for themselves, the others (space,
/// control bytes ...) for the characters from U+0100 on, in byte order. Vocabulary and merge strings
/// are written in these characters.
pub fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        *slot = if printable {
            char::from(b as u8)
        } else {
            next += 1;
            char::from_u32(next - 1).unwrap_or('\0')
        };
    }
    table
}

/// The loaded model: what each byte starts as, and every merge with its rank.
pub struct ByteLevelBpe {
    /// Id of the one-byte token of each byte; None when the vocabulary lacks it (`tokenizers` then
    /// drops that byte when there is no `unk_token`, and so does this).
    byte_ids: [Option<u32>; 256],
    merges: MergeTable,
    /// `ignore_merges`: a piece that is a whole vocabulary entry is that token, merges or not.
    words: Option<VocabIndex>,
}

#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: usize,
    next: usize,
    alive: bool,
}

const NONE: usize = usize::MAX;

impl ByteLevelBpe {
    pub fn new(
        byte_ids: [Option<u32>; 256],
        merges: MergeTable,
        words: Option<VocabIndex>,
    ) -> ByteLevelBpe {
        ByteLevelBpe {
            byte_ids,
            merges,
            words,
        }
    }

    /// Heap bytes of the merge table and of the whole-token vocabulary (for memory reports).
    pub fn heap_bytes(&self) -> (usize, usize) {
        let words = self.words.as_ref().map_or(0, VocabIndex::heap_bytes);
        (self.merges.heap_bytes(), words)
    }

    /// Number of merges (for the memory estimate in reports).
    pub fn merge_count(&self) -> usize {
        self.merges.len()
    }

    /// Appends the ids of one pre-tokenized piece.
    pub fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let Some(id) = self.words.as_ref().and_then(|w| w.get_bytes(piece)) {
            out.push(id);
            return;
        }
        let mut syms: Vec<Symbol> = Vec::with_capacity(piece.len());
        for b in piece {
            if let Some(id) = self.byte_ids[*b as usize] {
                let i = syms.len();
                syms.push(Symbol {
                    id,
                    prev: if i == 0 { NONE } else { i - 1 },
                    next: i + 1,
                    alive: true,
                });
            }
        }
        if let Some(last) = syms.last_mut() {
            last.next = NONE;
        }
        if syms.len() > 1 {
            self.merge_all(&mut syms);
        }
        out.extend(syms.iter().filter(|s| s.alive).map(|s| s.id));
    }

    /// `tokenizers`' `Word::merge_all`: a heap of (rank, position); stale entries (a side already
    /// merged away, or the pair changed) are skipped when popped.
    fn merge_all(&self, syms: &mut [Symbol]) {
        let mut heap = BinaryHeap::with_capacity(syms.len());
        for i in 0..syms.len() - 1 {
            if let Some((rank, _)) = self.merges.get(syms[i].id, syms[i + 1].id) {
                heap.push(Reverse((rank, i)));
            }
        }
        while let Some(Reverse((rank, pos))) = heap.pop() {
            let left = syms[pos];
            if !left.alive || left.next == NONE {
                continue;
            }
            let right = syms[left.next];
            let Some((r, new_id)) = self.merges.get(left.id, right.id) else {
                continue;
            };
            if r != rank {
                continue;
            }
            syms[pos].id = new_id;
            syms[pos].next = right.next;
            syms[left.next].alive = false;
            if right.next != NONE {
                syms[right.next].prev = pos;
            }
            if left.prev != NONE
                && let Some((r, _)) = self.merges.get(syms[left.prev].id, new_id)
            {
                heap.push(Reverse((r, left.prev)));
            }
            if right.next != NONE
                && let Some((r, _)) = self.merges.get(new_id, syms[right.next].id)
            {
                heap.push(Reverse((r, pos)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[0], 'Ā');
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn merges_follow_rank_then_position() {
        // a=0 b=1 c=2; ab=3 (rank 1), bc=4 (rank 0), abc=5 from a+bc (rank 2)
        let mut byte_ids = [None; 256];
        byte_ids[b'a' as usize] = Some(0);
        byte_ids[b'b' as usize] = Some(1);
        byte_ids[b'c' as usize] = Some(2);
        // In rank order: (left, right, merged). A pair listed twice keeps its last rank.
        let twice = MergeTable::from_list(&[[1, 2, 4], [0, 1, 3], [1, 2, 4]]).unwrap();
        assert_eq!(
            (twice.get(1, 2), twice.get(0, 1)),
            (Some((2, 4)), Some((1, 3)))
        );
        assert_eq!(
            (twice.get(4, 0), twice.get(0, 2), twice.len()),
            (None, None, 2)
        );
        let merges = MergeTable::from_list(&[[1, 2, 4], [0, 1, 3], [0, 4, 5]]).unwrap();
        let bpe = ByteLevelBpe::new(byte_ids, merges, None);
        let mut out = Vec::new();
        bpe.encode_piece(b"abc", &mut out);
        assert_eq!(out, vec![5]);
        out.clear();
        bpe.encode_piece(b"abab", &mut out);
        assert_eq!(out, vec![3, 3]);
        out.clear();
        // An unknown byte is dropped, as `tokenizers` does without an unk token.
        bpe.encode_piece(b"a\xffb", &mut out);
        assert_eq!(out, vec![3]);
    }
}
