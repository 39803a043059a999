//! The common model of every workload: sessions of serial turns.
//!
//! A session is what a client keeps open (an RL rollout, a coding-agent conversation, a single trace
//! request): its turns run one after another, each after the previous one completed plus a think time.
//! Prompts are kept compact until a turn is issued: trace prompts of 100K tokens are stored as block keys
//! ([`BlockPrompt`]) and expanded to token ids only when the driver issues them.

use crate::driver::Mode;
use crate::token_blocks::{extend_tokens, sub_key};
use serde::Serialize;

/// How a turn's prompt is formed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// The previous turn's prompt, then the previous turn's output tokens, then these tokens (RL rollouts:
    /// each turn appends the model's answer and the environment's reply). For the first turn of a session
    /// the previous prompt and output are empty.
    Append(Vec<u32>),
    /// The whole prompt, as given.
    Full(Vec<u32>),
    /// The whole prompt, built on demand from trace block ids (see [`BlockPrompt`]).
    Blocks(BlockPrompt),
}

/// A prompt named by block keys: the tokens of each key's block in order, cut or padded to `len` tokens.
/// Padding is request-unique (derived from `pad_key`), so it is never shared with another request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockPrompt {
    /// One key per block ([`crate::token_blocks::block_key`]).
    pub keys: Vec<u64>,
    /// Tokens per block.
    pub block_size: u32,
    /// Prompt length in tokens.
    pub len: u32,
    /// Key of this request's private padding.
    pub pad_key: u64,
}

impl BlockPrompt {
    /// Expands the prompt to token ids.
    pub fn tokens(&self) -> Vec<u32> {
        let len = self.len as usize;
        let bs = self.block_size as usize;
        let mut out = Vec::with_capacity(len);
        for &k in &self.keys {
            if out.len() >= len {
                break;
            }
            let take = bs.min(len - out.len());
            extend_tokens(k, take, &mut out);
        }
        if out.len() < len {
            let missing = len - out.len();
            extend_tokens(sub_key(self.pad_key, &[u64::MAX]), missing, &mut out);
        }
        out
    }
}

/// One request of a session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Turn {
    pub prompt: Prompt,
    /// Tokens the engine is told to generate (with `ignore_eos`), so every policy faces the same work.
    pub output_tokens: u32,
    /// Client delay before this turn, after the previous turn completed (or after the session started).
    pub think_us: u64,
    /// Open-loop arrival time (from the start of the run); `None` in closed-loop workloads.
    pub arrival_us: Option<u64>,
}

impl Turn {
    /// Prompt length in tokens, when it does not depend on earlier outputs.
    pub fn fixed_prompt_len(&self) -> Option<usize> {
        match &self.prompt {
            Prompt::Append(_) => None,
            Prompt::Full(t) => Some(t.len()),
            Prompt::Blocks(b) => Some(b.len as usize),
        }
    }
}

/// A sequence of serial turns sharing a session id (sent as the session header).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    pub id: String,
    pub turns: Vec<Turn>,
}

impl Session {
    /// A request that arrives on its own at `arrival_us`, as its own session: how the open-loop traces
    /// without conversations (Mooncake, Azure) are replayed, so the driver treats them like any other
    /// workload. `output_tokens` is clamped to at least 1 (the engine must produce a first token).
    pub fn single_request(
        id: String,
        prompt: BlockPrompt,
        output_tokens: u64,
        arrival_us: u64,
    ) -> Session {
        Session {
            id,
            turns: vec![Turn {
                prompt: Prompt::Blocks(prompt),
                output_tokens: output_tokens.clamp(1, u64::from(u32::MAX)) as u32,
                think_us: 0,
                arrival_us: Some(arrival_us),
            }],
        }
    }
}

/// The note a trace reader files for requests it skipped because their prompt exceeds its cap.
pub const NOTE_SKIPPED: &str = "requests over the prompt cap skipped";

/// A named set of sessions, with the block size it intends and the parameters it was built with.
#[derive(Clone, Debug)]
pub struct Workload {
    pub name: String,
    /// Parameters as (name, value) pairs, for reports.
    pub params: Vec<(String, String)>,
    /// KV block size the workload's sharing is laid out for.
    pub block_size: u32,
    /// How the workload is meant to be driven (the consumer may choose another).
    pub default_mode: Mode,
    pub sessions: Vec<Session>,
    /// What a reader left out or changed, as (what, count) pairs (over-long requests, dropped sessions).
    pub notes: Vec<(String, u64)>,
}

/// Counts of a workload, for reports and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct WorkloadStats {
    pub sessions: usize,
    pub requests: usize,
    /// Sum of prompt tokens over turns whose prompt length is fixed (trace turns).
    pub fixed_prompt_tokens: u64,
    pub output_tokens: u64,
}

impl Workload {
    /// An open-loop trace replay: one [`Session::single_request`] per row, driven at the rows'
    /// arrival times, with the count of skipped over-long rows filed under [`NOTE_SKIPPED`].
    pub fn open_trace(
        name: &str,
        params: Vec<(String, String)>,
        block_size: u32,
        sessions: Vec<Session>,
        skipped: u64,
    ) -> Workload {
        Workload {
            name: name.into(),
            params,
            block_size,
            default_mode: Mode::Open,
            sessions,
            notes: vec![(NOTE_SKIPPED.into(), skipped)],
        }
    }

    pub fn total_requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    pub fn stats(&self) -> WorkloadStats {
        let mut s = WorkloadStats {
            sessions: self.sessions.len(),
            ..Default::default()
        };
        for t in self.sessions.iter().flat_map(|s| &s.turns) {
            s.requests += 1;
            s.fixed_prompt_tokens += t.fixed_prompt_len().unwrap_or(0) as u64;
            s.output_tokens += u64::from(t.output_tokens);
        }
        s
    }

    /// The value of a parameter, if present.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The count of a note, 0 if absent.
    pub fn note(&self, what: &str) -> u64 {
        self.notes
            .iter()
            .find(|(k, _)| k == what)
            .map(|(_, v)| *v)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::token_blocks::{block_key, tokens};

    #[test]
    fn block_prompt_cuts_last_block_and_pads_uniquely() {
        let a = BlockPrompt {
            keys: vec![block_key("g", 1), block_key("g", 2)],
            block_size: 4,
            len: 6,
            pad_key: 1,
        };
        let t = a.tokens();
        assert_eq!(t.len(), 6);
        assert_eq!(&t[..4], &tokens(block_key("g", 1), 4)[..]);
        assert_eq!(&t[4..], &tokens(block_key("g", 2), 2)[..]);

        let mut b = a.clone();
        b.len = 11;
        let tb = b.tokens();
        assert_eq!(
            &tb[..8],
            &[&t[..4], &tokens(block_key("g", 2), 4)[..]].concat()[..]
        );
        let mut c = b.clone();
        c.pad_key = 2;
        let tc = c.tokens();
        assert_eq!(tb[..8], tc[..8]);
        assert_ne!(tb[8..], tc[8..], "padding is request-unique");
    }
}
