//! The pre-tokenizer of a `tokenizer.json`: `Split` steps (a regex or literal, with its behavior and
//! `invert`), `Sequence`s of them and `ByteLevel` (GPT-2's own regex when `use_regex`). Each step cuts
//! every piece the previous one left, as `tokenizers`' `PreTokenizedString::split` does; empty pieces
//! are dropped. Patterns run on fancy-regex, a backtracking engine like the Oniguruma `tokenizers` uses,
//! so look-ahead (`\s+(?!\S)`) means the same; a regex error (the backtrack limit) fails the encode
//! instead of guessing.

use serde_json::Value;
use std::ops::Range;

/// GPT-2's split, what `ByteLevel` applies when `use_regex` is true.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Longest pattern accepted: hostile configuration must not make the regex compiler do unbounded work.
const MAX_PATTERN_BYTES: usize = 16 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Behavior {
    Removed,
    Isolated,
    MergedWithPrevious,
    MergedWithNext,
    Contiguous,
}

struct Split {
    regex: fancy_regex::Regex,
    behavior: Behavior,
    invert: bool,
}

/// The compiled pre-tokenizer.
pub struct PreTokenizer {
    splits: Vec<Split>,
    /// `ByteLevel`'s `add_prefix_space`: a space before a text that does not start with one. Accepted
    /// only when `ByteLevel` comes first, where it applies to the whole text.
    pub prefix_space: bool,
}

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.as_object().and_then(|o| o.get(name))
}

fn flag(v: &Value, name: &str) -> bool {
    field(v, name).and_then(Value::as_bool).unwrap_or(false)
}

fn compile(pattern: &str) -> Result<fancy_regex::Regex, String> {
    if pattern.len() > MAX_PATTERN_BYTES {
        return Err(format!("pattern of {} bytes", pattern.len()));
    }
    fancy_regex::Regex::new(pattern).map_err(|e| format!("pattern {pattern:?}: {e}"))
}

impl PreTokenizer {
    /// Reads the `pre_tokenizer` value (null: the whole text is one piece).
    pub fn from_json(v: &Value) -> Result<PreTokenizer, String> {
        let mut p = PreTokenizer {
            splits: Vec::new(),
            prefix_space: false,
        };
        if !v.is_null() {
            p.add(v, 0)?;
        }
        Ok(p)
    }

    fn add(&mut self, v: &Value, depth: usize) -> Result<(), String> {
        let kind = field(v, "type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "Sequence" if depth < 4 => {
                let steps = field(v, "pretokenizers")
                    .and_then(Value::as_array)
                    .ok_or("Sequence without pretokenizers")?;
                steps.iter().try_for_each(|s| self.add(s, depth + 1))
            }
            "Split" => self.add_split(v),
            "ByteLevel" => {
                if flag(v, "add_prefix_space") {
                    if !self.splits.is_empty() {
                        return Err(
                            "ByteLevel add_prefix_space after a Split is not supported".into()
                        );
                    }
                    self.prefix_space = true;
                }
                if field(v, "use_regex")
                    .and_then(Value::as_bool)
                    .unwrap_or(true)
                {
                    self.splits.push(Split {
                        regex: compile(GPT2_PATTERN)?,
                        behavior: Behavior::Isolated,
                        invert: false,
                    });
                }
                Ok(())
            }
            other => Err(format!("pre_tokenizer type {other:?} is not supported")),
        }
    }

    fn add_split(&mut self, v: &Value) -> Result<(), String> {
        let pattern = field(v, "pattern").ok_or("Split without pattern")?;
        let regex = if let Some(r) = field(pattern, "Regex").and_then(Value::as_str) {
            compile(r)?
        } else if let Some(s) = field(pattern, "String").and_then(Value::as_str) {
            compile(&fancy_regex::escape(s))?
        } else {
            return Err("Split pattern is neither Regex nor String".into());
        };
        let behavior = match field(v, "behavior").and_then(Value::as_str) {
            Some("Removed") => Behavior::Removed,
            Some("Isolated") => Behavior::Isolated,
            Some("MergedWithPrevious") => Behavior::MergedWithPrevious,
            Some("MergedWithNext") => Behavior::MergedWithNext,
            Some("Contiguous") => Behavior::Contiguous,
            other => return Err(format!("Split behavior {other:?} is not supported")),
        };
        self.splits.push(Split {
            regex,
            behavior,
            invert: flag(v, "invert"),
        });
        Ok(())
    }

    /// The pieces of `text`, as byte ranges, in order; Err on a regex failure.
    pub fn pieces(&self, text: &str) -> Result<Vec<Range<usize>>, String> {
        let mut pieces: Vec<Range<usize>> = std::iter::once(0..text.len()).collect();
        let mut next = Vec::new();
        for split in &self.splits {
            next.clear();
            for r in &pieces {
                split.apply(text, r.clone(), &mut next)?;
            }
            std::mem::swap(&mut pieces, &mut next);
        }
        pieces.retain(|r| !r.is_empty());
        Ok(pieces)
    }
}

impl Split {
    /// Cuts `text[r]` into matches and gaps, then keeps or joins them as the behavior says
    /// (`tokenizers`' `NormalizedString::split`).
    fn apply(
        &self,
        text: &str,
        r: Range<usize>,
        out: &mut Vec<Range<usize>>,
    ) -> Result<(), String> {
        let hay = &text[r.clone()];
        let mut parts: Vec<(Range<usize>, bool)> = Vec::new();
        let mut prev = 0;
        for m in self.regex.find_iter(hay) {
            let m = m.map_err(|e| e.to_string())?;
            if m.start() > prev {
                parts.push((prev..m.start(), false));
            }
            if m.end() > m.start() {
                parts.push((m.start()..m.end(), true));
            }
            prev = m.end();
        }
        if prev < hay.len() {
            parts.push((prev..hay.len(), false));
        }
        let parts = parts
            .into_iter()
            .map(|(p, m)| (r.start + p.start..r.start + p.end, m != self.invert));
        // `tokenizers`' folds: a match joins its neighbour only when the piece before it (after it,
        // for MergedWithNext) is not a match itself.
        let acc = match self.behavior {
            Behavior::Isolated => parts.map(|(p, _)| p).collect(),
            Behavior::Removed => parts.filter(|(_, m)| !m).map(|(p, _)| p).collect(),
            Behavior::MergedWithPrevious => fold(parts, |m, prev| m && !prev),
            Behavior::MergedWithNext => {
                let mut acc = fold(parts.rev(), |m, prev| m && !prev);
                acc.reverse();
                acc
            }
            Behavior::Contiguous => fold(parts, |m, prev| m == prev),
        };
        out.extend(acc);
        Ok(())
    }
}

/// Joins a piece into the last one kept when `rule(is_match, previous_is_match)` says so.
fn fold(
    parts: impl Iterator<Item = (Range<usize>, bool)>,
    rule: impl Fn(bool, bool) -> bool,
) -> Vec<Range<usize>> {
    let mut acc: Vec<Range<usize>> = Vec::new();
    let mut prev = false;
    for (p, m) in parts {
        match acc.last_mut() {
            Some(last) if rule(m, prev) => *last = last.start.min(p.start)..last.end.max(p.end),
            _ => acc.push(p),
        }
        prev = m;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pattern: &str, behavior: &str, text: &str) -> Vec<String> {
        let v = serde_json::json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": behavior, "invert": false});
        let p = PreTokenizer::from_json(&v).unwrap();
        let ranges = p.pieces(text).unwrap();
        ranges.into_iter().map(|r| text[r].to_string()).collect()
    }

    #[test]
    fn behaviors_cut_as_tokenizers_does() {
        assert_eq!(
            split("-", "Isolated", "a-b--c"),
            ["a", "-", "b", "-", "-", "c"]
        );
        assert_eq!(split("-", "Removed", "a-b--c"), ["a", "b", "c"]);
        assert_eq!(
            split("-", "MergedWithPrevious", "a-b--c"),
            ["a-", "b-", "-", "c"]
        );
        assert_eq!(
            split("-", "MergedWithNext", "a-b--c"),
            ["a", "-b", "-", "-c"]
        );
        assert_eq!(
            split("-", "Contiguous", "a-b--c"),
            ["a", "-", "b", "--", "c"]
        );
    }

    #[test]
    fn unsupported_steps_are_refused_by_name() {
        let v = serde_json::json!({"type": "Metaspace"});
        let e = PreTokenizer::from_json(&v).err().unwrap();
        assert!(e.contains("Metaspace"), "{e}");
    }
}
