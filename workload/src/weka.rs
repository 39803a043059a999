//! Reader for the coding-agent trace `weka_cc_sample36.jsonl` (real Claude Code sessions, one JSON
//! session per line; see `traces/README.md`).
//!
//! Choices (all documented in `docs/design/workloads.md`):
//! - **Namespaces.** `hash_ids` are local to a session: id `x` of session `S` becomes the block key
//!   `("weka:S", x)`. Sub-agent requests use their parent's namespace.
//! - **Shared tool+system prefix.** Every Claude Code request starts with the tool definitions and the
//!   system prompt (`tool_tokens + system_tokens` tokens), which are the same across sessions of one
//!   client version. The trace encodes them as the leading `floor((tool_tokens + system_tokens) / 64)`
//!   ids of the session's requests, under local ids. We find the session's *trunk*: position by position,
//!   the id most main requests carry there (among those that agreed so far), and make the trunk's block at
//!   position `i` the global block `("global:weka-main", i)`. Sessions whose prefixes are of different
//!   lengths share up to the shorter one. `shared_prefix_fraction` scales how much of the prefix is made
//!   global (1.0 = all of it). Sub-agents get the same treatment per `subagent_type`
//!   (`("global:weka-sub:<type>", i)`).
//! - **Over-long requests** (prompt above `max_prompt_tokens`, default 131,072) are skipped (default) or
//!   truncated to the cap; the count is in the workload's notes. A session left with no request is
//!   dropped (counted).
//! - **Timing.** A turn waits its recorded `think_time` (scaled by `think_scale`, capped at
//!   `max_think_s`) after the previous turn completed, as kv-cache-tester's default `think-only` strategy.
//! - **Sub-agents** are flattened into the parent session, in trace order, with their own think times;
//!   the parent's next think time is reduced by the sub-agent's recorded `duration_ms` (the recorded
//!   think time includes the wait for the sub-agent, which the replay now performs for real).
//! - **Outputs**: `out` tokens, at least 1.

use crate::driver::Mode;
use crate::error::{WorkloadError, read_file};
use crate::session::{BlockPrompt, Prompt, Session, Turn, Workload};
use crate::token_blocks::{block_key, sub_key};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::PathBuf;

/// What to do with a request above the prompt cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverLong {
    Skip,
    Truncate,
}

#[derive(Clone, Debug, PartialEq)]
pub struct WekaParams {
    pub path: PathBuf,
    pub max_prompt_tokens: u32,
    pub over_long: OverLong,
    pub shared_prefix_fraction: f64,
    pub think_scale: f64,
    pub max_think_s: f64,
    /// Sessions in flight (closed loop); the benchmark uses 8, 16, 24, 32, 40 (docs/design/design.md section 7).
    pub concurrency: usize,
    /// Read only the first N sessions.
    pub max_sessions: Option<usize>,
    /// Replay each session this many times (at least 1). Copy `k` of session `S` is session `S#k` with
    /// its own namespace, sharing only the global tool+system prefix with the others, as a new user
    /// running the same conversation would. Copies come after all originals, so a closed loop works
    /// through the originals first. Lets concurrency levels above the session count mean something.
    pub copies: usize,
    /// Each turn's think time is multiplied by a factor drawn uniformly from `[1 - j, 1 + j]` (0: the
    /// recorded times), the draw fixed by [`WekaParams::jitter_seed`] and the turn. The trace's
    /// structure is otherwise fixed, so without it two seeds of a closed-loop replay differ only in
    /// tie-breaks, and a policy that breaks few ties replays the same run every seed: one sample of
    /// a system whose figures jump with small changes (docs/reports/results.md). Jitter makes the seeds
    /// independent draws of the same users.
    pub think_jitter: f64,
    /// Seed of the think-time jitter.
    pub jitter_seed: u64,
}

/// File name of the vendored trace in `traces/` (see `traces/README.md`).
pub const FILE: &str = "weka_cc_sample36.jsonl.xz";

/// The three coding-agent validation samples in `traces/` (36 other sessions of the same corpus
/// each, the same format): validation data, never tuned on (`traces/README.md`). Read them by
/// passing `traces/<file>` as [`WekaParams::path`].
pub const VALIDATION_FILES: [&str; 3] = [
    "weka_cc_validation_v1.jsonl.xz",
    "weka_cc_validation_v2.jsonl.xz",
    "weka_cc_validation_v3.jsonl.xz",
];

/// The session ids of every coding-agent file in `traces/` ([`FILE`] and [`VALIDATION_FILES`]),
/// one line per file: `<file>: <id> <id> ...` (`#` lines are comments).
pub const SESSIONS_FILE: &str = "weka_cc_validation_sessions.txt";

/// Default location of the trace, relative to the repository root.
pub const DEFAULT_PATH: &str = "traces/weka_cc_sample36.jsonl.xz";

impl Default for WekaParams {
    fn default() -> Self {
        WekaParams {
            path: DEFAULT_PATH.into(),
            max_prompt_tokens: 131_072,
            over_long: OverLong::Skip,
            shared_prefix_fraction: 1.0,
            think_scale: 1.0,
            max_think_s: 60.0,
            concurrency: 16,
            max_sessions: None,
            copies: 1,
            think_jitter: 0.0,
            jitter_seed: 0,
        }
    }
}

#[derive(Deserialize)]
struct RawSession {
    id: String,
    #[serde(default = "default_block")]
    block_size: u32,
    #[serde(default)]
    tool_tokens: u64,
    #[serde(default)]
    system_tokens: u64,
    #[serde(default)]
    requests: Vec<RawRequest>,
}

fn default_block() -> u32 {
    64
}

#[derive(Deserialize)]
struct RawRequest {
    #[serde(rename = "type", default)]
    kind: String,
    #[serde(rename = "in", default)]
    input: u64,
    #[serde(default)]
    out: u64,
    #[serde(default)]
    hash_ids: Vec<u64>,
    #[serde(default)]
    think_time: Option<f64>,
    // Sub-agent entries only:
    #[serde(default)]
    requests: Vec<RawRequest>,
    #[serde(default)]
    subagent_type: Option<String>,
    #[serde(default)]
    tool_tokens: u64,
    #[serde(default)]
    system_tokens: u64,
    #[serde(default)]
    duration_ms: Option<f64>,
}

/// Notes recorded by the reader.
pub use crate::session::NOTE_SKIPPED;
pub const NOTE_TRUNCATED: &str = "requests over the prompt cap truncated";
pub const NOTE_DROPPED_SESSIONS: &str = "sessions dropped (no request left)";
pub const NOTE_SUBAGENT_REQUESTS: &str = "sub-agent requests flattened into their parent";
pub const NOTE_GLOBAL_BLOCKS: &str = "distinct local ids made global (tool+system prefix)";
pub const NOTE_ZERO_OUTPUT: &str = "requests with out=0 given 1 output token";

/// The majority trunk of a group of requests' leading `k` ids (see the module docs).
fn trunk(requests: &[&RawRequest], k: usize) -> Vec<u64> {
    let mut cands: Vec<&RawRequest> = requests
        .iter()
        .copied()
        .filter(|r| !r.hash_ids.is_empty())
        .collect();
    let mut out = Vec::new();
    let mut counts: HashMap<u64, usize> = HashMap::new();
    for i in 0..k {
        counts.clear();
        for r in &cands {
            if let Some(&id) = r.hash_ids.get(i) {
                *counts.entry(id).or_default() += 1;
            }
        }
        let Some((&id, _)) = counts.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0))) else {
            break;
        };
        out.push(id);
        cands.retain(|r| r.hash_ids.get(i) == Some(&id));
    }
    out
}

fn prefix_blocks(tool: u64, system: u64, block_size: u32, fraction: f64) -> usize {
    let k = (tool.saturating_add(system) / u64::from(block_size.max(1))) as f64;
    (k * fraction.clamp(0.0, 1.0)).floor() as usize
}

#[derive(Default)]
struct Counters {
    skipped: u64,
    truncated: u64,
    zero_out: u64,
    subagent: u64,
}

/// Reads the trace at `p.path`.
pub fn read(p: &WekaParams) -> Result<Workload, WorkloadError> {
    let text = read_file(&p.path)?;
    parse(&text, p)
}

/// Parses trace text (one session per line).
pub fn parse(text: &str, p: &WekaParams) -> Result<Workload, WorkloadError> {
    if !(0.0..=1.0).contains(&p.think_jitter) {
        return Err(WorkloadError::Param("think_jitter must be in 0..=1".into()));
    }
    if !(p.think_scale >= 0.0 && p.max_think_s >= 0.0) {
        return Err(WorkloadError::Param(
            "think_scale and max_think_s must be >= 0".into(),
        ));
    }
    let mut sessions = Vec::new();
    let mut c = Counters::default();
    let mut dropped = 0u64;
    let mut global_ids = 0u64;
    let mut copies: Vec<Vec<Session>> = vec![Vec::new(); p.copies.saturating_sub(1)];
    let mut block_size = None;
    for (ln, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if p.max_sessions
            .is_some_and(|m| sessions.len() + dropped as usize >= m)
        {
            break;
        }
        let raw: RawSession = serde_json::from_str(line).map_err(|e| WorkloadError::Parse {
            line: ln + 1,
            message: e.to_string(),
        })?;
        check_block_size(&raw, ln, &mut block_size)?;
        let global = trunk_keys(&raw, p);
        global_ids += global.len() as u64;

        let ns = format!("weka:{}", raw.id);
        let turns = build_turns(&raw, &ns, &global, p, &mut c);
        if turns.is_empty() {
            dropped += 1;
            continue;
        }
        sessions.push(Session {
            id: raw.id.clone(),
            turns,
        });
        for (copy, list) in (1..).zip(copies.iter_mut()) {
            // Copies count nothing: the notes describe the trace itself.
            let mut ignore = Counters::default();
            let id = format!("{}#{copy}", raw.id);
            let turns = build_turns(&raw, &format!("weka:{id}"), &global, p, &mut ignore);
            list.push(Session { id, turns });
        }
    }
    sessions.extend(copies.into_iter().flatten());
    let over_note = match p.over_long {
        OverLong::Skip => (NOTE_SKIPPED.to_string(), c.skipped),
        OverLong::Truncate => (NOTE_TRUNCATED.to_string(), c.truncated),
    };
    Ok(Workload {
        name: "weka".into(),
        params: params(p),
        block_size: block_size.unwrap_or(64),
        default_mode: Mode::Closed {
            concurrency: p.concurrency,
        },
        sessions,
        notes: vec![
            over_note,
            (NOTE_DROPPED_SESSIONS.into(), dropped),
            (NOTE_SUBAGENT_REQUESTS.into(), c.subagent),
            (NOTE_GLOBAL_BLOCKS.into(), global_ids),
            (NOTE_ZERO_OUTPUT.into(), c.zero_out),
        ],
    })
}

/// Checks a session's block size: in range, and the same as every earlier session's (`first`, set
/// by the first session read).
fn check_block_size(
    raw: &RawSession,
    ln: usize,
    first: &mut Option<u32>,
) -> Result<(), WorkloadError> {
    if raw.block_size == 0 || raw.block_size > 4096 {
        return Err(WorkloadError::Parse {
            line: ln + 1,
            message: format!("block_size {} out of range", raw.block_size),
        });
    }
    match *first {
        None => *first = Some(raw.block_size),
        Some(b) if b != raw.block_size => {
            return Err(WorkloadError::Parse {
                line: ln + 1,
                message: format!(
                    "block_size {} differs from earlier sessions' {b}",
                    raw.block_size
                ),
            });
        }
        _ => {}
    }
    Ok(())
}

/// A session's local block ids mapped to global keys, for the tool+system trunks: the main
/// agent's shared with every session's main agent, each subagent type's with that type's.
fn trunk_keys(raw: &RawSession, p: &WekaParams) -> HashMap<u64, u64> {
    let mut global: HashMap<u64, u64> = HashMap::new();
    let main: Vec<&RawRequest> = raw
        .requests
        .iter()
        .filter(|r| r.kind != "subagent")
        .collect();
    let k = prefix_blocks(
        raw.tool_tokens,
        raw.system_tokens,
        raw.block_size,
        p.shared_prefix_fraction,
    );
    for (i, id) in trunk(&main, k).into_iter().enumerate() {
        global
            .entry(id)
            .or_insert_with(|| block_key("global:weka-main", i as u64));
    }
    let mut by_type: Vec<(String, Vec<&RawRequest>, usize)> = Vec::new();
    for sa in raw.requests.iter().filter(|r| r.kind == "subagent") {
        let ty = sa.subagent_type.clone().unwrap_or_default();
        let k = prefix_blocks(
            sa.tool_tokens,
            sa.system_tokens,
            raw.block_size,
            p.shared_prefix_fraction,
        );
        match by_type.iter_mut().find(|(t, _, _)| *t == ty) {
            Some((_, reqs, kk)) => {
                reqs.extend(sa.requests.iter());
                *kk = (*kk).min(k);
            }
            None => by_type.push((ty, sa.requests.iter().collect(), k)),
        }
    }
    for (ty, reqs, k) in &by_type {
        let gns = format!("global:weka-sub:{ty}");
        for (i, id) in trunk(reqs, *k).into_iter().enumerate() {
            global
                .entry(id)
                .or_insert_with(|| block_key(&gns, i as u64));
        }
    }
    global
}

/// The parameters a workload built from this trace records.
fn params(p: &WekaParams) -> Vec<(String, String)> {
    vec![
        ("path".into(), p.path.display().to_string()),
        ("max_prompt_tokens".into(), p.max_prompt_tokens.to_string()),
        ("over_long".into(), format!("{:?}", p.over_long)),
        (
            "shared_prefix_fraction".into(),
            p.shared_prefix_fraction.to_string(),
        ),
        ("think_scale".into(), p.think_scale.to_string()),
        ("max_think_s".into(), p.max_think_s.to_string()),
        ("concurrency".into(), p.concurrency.to_string()),
        ("copies".into(), p.copies.to_string()),
        ("think_jitter".into(), p.think_jitter.to_string()),
    ]
}

/// The turns of one session (or one copy of it, under namespace `ns`).
fn build_turns(
    raw: &RawSession,
    ns: &str,
    global: &HashMap<u64, u64>,
    p: &WekaParams,
    c: &mut Counters,
) -> Vec<Turn> {
    let mut turns = Vec::new();
    let mut think_credit_s = 0.0f64;
    let pad_root = block_key(ns, u64::MAX);
    let mut n = 0u64;
    for r in &raw.requests {
        if r.kind == "subagent" {
            for q in &r.requests {
                c.subagent += 1;
                let think = q.think_time.unwrap_or(0.0);
                let pad = sub_key(pad_root, &[n]);
                push_turn(&mut turns, q, ns, global, raw.block_size, think, p, c, pad);
                n += 1;
            }
            think_credit_s += r.duration_ms.unwrap_or(0.0).max(0.0) / 1000.0;
        } else {
            let think = (r.think_time.unwrap_or(0.0) - think_credit_s).max(0.0);
            think_credit_s = 0.0;
            let pad = sub_key(pad_root, &[n]);
            push_turn(&mut turns, r, ns, global, raw.block_size, think, p, c, pad);
            n += 1;
        }
    }
    turns
}

#[allow(clippy::too_many_arguments)]
fn push_turn(
    turns: &mut Vec<Turn>,
    r: &RawRequest,
    ns: &str,
    global: &HashMap<u64, u64>,
    block_size: u32,
    think_s: f64,
    p: &WekaParams,
    c: &mut Counters,
    pad_key: u64,
) {
    let mut len = r.input;
    if len > u64::from(p.max_prompt_tokens) {
        match p.over_long {
            OverLong::Skip => {
                c.skipped += 1;
                return;
            }
            OverLong::Truncate => {
                c.truncated += 1;
                len = u64::from(p.max_prompt_tokens);
            }
        }
    }
    let nblocks = (len / u64::from(block_size)) as usize;
    let keys = r
        .hash_ids
        .iter()
        .take(nblocks)
        .map(|id| {
            global
                .get(id)
                .copied()
                .unwrap_or_else(|| block_key(ns, *id))
        })
        .collect();
    let out = if r.out == 0 {
        c.zero_out += 1;
        1
    } else {
        r.out.min(u64::from(u32::MAX)) as u32
    };
    let think_s = if think_s.is_finite() { think_s } else { 0.0 };
    let jitter = if p.think_jitter > 0.0 {
        crate::arrivals::band_factor(pad_key, p.jitter_seed, p.think_jitter)
    } else {
        1.0
    };
    let think_us = ((think_s * p.think_scale * jitter).min(p.max_think_s) * 1e6) as u64;
    turns.push(Turn {
        prompt: Prompt::Blocks(BlockPrompt {
            keys,
            block_size,
            len: len as u32,
            pad_key,
        }),
        output_tokens: out,
        think_us,
        arrival_us: None,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_lines_are_typed_errors() {
        let p = WekaParams::default();
        assert!(matches!(
            parse("{not json", &p),
            Err(WorkloadError::Parse { line: 1, .. })
        ));
        let neg = r#"{"id":"a","requests":[{"type":"n","in":10,"out":1,"hash_ids":[-1]}]}"#;
        assert!(matches!(parse(neg, &p), Err(WorkloadError::Parse { .. })));
        let bs = r#"{"id":"a","block_size":0,"requests":[]}"#;
        assert!(matches!(parse(bs, &p), Err(WorkloadError::Parse { .. })));
    }

    #[test]
    fn trunk_follows_the_majority() {
        let mk = |ids: Vec<u64>| RawRequest {
            kind: "n".into(),
            input: 0,
            out: 0,
            hash_ids: ids,
            think_time: None,
            requests: vec![],
            subagent_type: None,
            tool_tokens: 0,
            system_tokens: 0,
            duration_ms: None,
        };
        let a = mk(vec![1, 2, 3]);
        let b = mk(vec![9, 8, 7]);
        let c = mk(vec![9, 8, 6]);
        let d = mk(vec![9, 8, 6, 5]);
        assert_eq!(trunk(&[&a, &b, &c, &d], 4), vec![9, 8, 6, 5]);
        assert_eq!(trunk(&[&a, &b, &c, &d], 2), vec![9, 8]);
    }

    #[test]
    fn over_long_skip_or_truncate() {
        let line = r#"{"id":"a","block_size":4,"requests":[{"type":"n","in":8,"out":0,"hash_ids":[1,2]},{"type":"n","in":20,"out":3,"hash_ids":[1,2,3,4,5]}]}"#;
        let mut p = WekaParams {
            max_prompt_tokens: 10,
            ..Default::default()
        };
        let w = parse(line, &p).unwrap();
        assert_eq!(w.total_requests(), 1);
        assert_eq!(w.note(NOTE_SKIPPED), 1);
        assert_eq!(w.note(NOTE_ZERO_OUTPUT), 1);
        p.over_long = OverLong::Truncate;
        let w = parse(line, &p).unwrap();
        assert_eq!(w.total_requests(), 2);
        assert_eq!(w.note(NOTE_TRUNCATED), 1);
        assert_eq!(w.sessions[0].turns[1].fixed_prompt_len(), Some(10));
    }

    #[test]
    fn think_jitter_draws_each_turn_within_its_band_by_seed() {
        let line = r#"{"id":"a","block_size":4,"requests":[{"type":"n","in":8,"out":2,"hash_ids":[1,2],"think_time":0},{"type":"n","in":8,"out":2,"hash_ids":[1,2],"think_time":10},{"type":"n","in":8,"out":2,"hash_ids":[1,2],"think_time":10},{"type":"n","in":8,"out":2,"hash_ids":[1,2],"think_time":10}]}"#;
        let thinks = |j: f64, seed: u64| -> Vec<u64> {
            let p = WekaParams {
                think_jitter: j,
                jitter_seed: seed,
                ..Default::default()
            };
            let w = parse(line, &p).unwrap();
            w.sessions[0].turns.iter().map(|t| t.think_us).collect()
        };
        assert_eq!(thinks(0.0, 7), vec![0, 10_000_000, 10_000_000, 10_000_000]);
        let a = thinks(0.2, 1);
        assert_eq!(a, thinks(0.2, 1), "the same seed draws the same");
        assert_ne!(a, thinks(0.2, 2), "another seed draws again");
        assert_eq!(a[0], 0);
        assert!(
            a[1..]
                .iter()
                .all(|&t| (8_000_000..=12_000_000).contains(&t)),
            "{a:?}"
        );
        assert!(
            a[1] != a[2] || a[2] != a[3],
            "each turn draws its own: {a:?}"
        );
        let bad = WekaParams {
            think_jitter: 1.5,
            ..Default::default()
        };
        assert!(matches!(parse(line, &bad), Err(WorkloadError::Param(_))));
    }
}
