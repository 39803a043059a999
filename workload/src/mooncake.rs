//! Reader for the Mooncake synthetic trace (open loop, arrival timestamps in ms, global 512-token block
//! ids). Each row is one request and one single-turn session (`mc-<row>`): the trace keeps no session
//! ids. Block id `h` becomes the global block key `("global:mooncake", h)`, so equal leading ids give
//! equal token prefixes across requests, exactly the sharing the trace recorded; the prompt is those
//! blocks cut to `input_length` (the last block may be partial) and padded with request-unique tokens.

use crate::error::{WorkloadError, read_file};
use crate::session::{BlockPrompt, Session, Workload};
use crate::token_blocks::block_key;
use serde::Deserialize;
use std::path::PathBuf;

/// File name of the vendored trace in `traces/` (see `traces/README.md`).
pub const FILE: &str = "mooncake_synthetic_trace.jsonl.xz";

/// Default location of the trace, relative to the repository root.
pub const DEFAULT_PATH: &str = "traces/mooncake_synthetic_trace.jsonl.xz";
pub const BLOCK_SIZE: u32 = 512;
pub use crate::session::NOTE_SKIPPED;

#[derive(Clone, Debug, PartialEq)]
pub struct MooncakeParams {
    pub path: PathBuf,
    /// Replay speed: 2.0 issues the trace twice as fast (arrival = timestamp / speed).
    pub speed: f64,
    /// Read only the first N rows.
    pub max_requests: Option<usize>,
    /// Rows with a longer prompt are skipped (counted). The trace's longest is 191,378 tokens.
    pub max_prompt_tokens: u32,
    /// Each gap between consecutive arrivals drawn within this share of the recorded one
    /// ([`crate::arrivals::jitter_gaps`]); 0 (the default) replays the recorded times.
    pub arrival_jitter: f64,
    /// The draw of `arrival_jitter`.
    pub jitter_seed: u64,
}

impl Default for MooncakeParams {
    fn default() -> Self {
        MooncakeParams {
            path: DEFAULT_PATH.into(),
            speed: 1.0,
            max_requests: None,
            max_prompt_tokens: 1 << 20,
            arrival_jitter: 0.0,
            jitter_seed: 0,
        }
    }
}

#[derive(Deserialize)]
struct Row {
    timestamp: u64,
    input_length: u64,
    output_length: u64,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

pub fn read(p: &MooncakeParams) -> Result<Workload, WorkloadError> {
    parse(&read_file(&p.path)?, p)
}

pub fn parse(text: &str, p: &MooncakeParams) -> Result<Workload, WorkloadError> {
    if !(p.speed > 0.0 && p.speed.is_finite()) {
        return Err(WorkloadError::Param(format!(
            "speed must be > 0, got {}",
            p.speed
        )));
    }
    crate::arrivals::check_jitter(p.arrival_jitter)?;
    let mut sessions = Vec::new();
    let mut skipped = 0u64;
    let mut rows = 0usize;
    for (ln, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if p.max_requests.is_some_and(|m| rows >= m) {
            break;
        }
        rows += 1;
        let r: Row = serde_json::from_str(line).map_err(|e| WorkloadError::Parse {
            line: ln + 1,
            message: e.to_string(),
        })?;
        if r.input_length > u64::from(p.max_prompt_tokens) {
            skipped += 1;
            continue;
        }
        let keys = r
            .hash_ids
            .iter()
            .take((r.input_length as usize).div_ceil(BLOCK_SIZE as usize))
            .map(|&h| block_key("global:mooncake", h))
            .collect();
        let arrival_us = (r.timestamp as f64 * 1000.0 / p.speed) as u64;
        let prompt = BlockPrompt {
            keys,
            block_size: BLOCK_SIZE,
            len: r.input_length as u32,
            pad_key: block_key("mooncake-pad", ln as u64),
        };
        sessions.push(Session::single_request(
            format!("mc-{ln}"),
            prompt,
            r.output_length,
            arrival_us,
        ));
    }
    let mut params = vec![
        ("path".into(), p.path.display().to_string()),
        ("speed".into(), p.speed.to_string()),
        ("max_prompt_tokens".into(), p.max_prompt_tokens.to_string()),
    ];
    crate::arrivals::redraw(
        &mut sessions,
        &mut params,
        p.arrival_jitter,
        p.jitter_seed,
        "mooncake-arrival",
    );
    Ok(Workload::open_trace(
        "mooncake", params, BLOCK_SIZE, sessions, skipped,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::Prompt;

    #[test]
    fn rows_share_blocks_and_scale_time() {
        let text = "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 2, \"hash_ids\": [0, 1]}\n\
                    {\"timestamp\": 10, \"input_length\": 700, \"output_length\": 0, \"hash_ids\": [0, 5]}\n";
        let w = parse(
            text,
            &MooncakeParams {
                speed: 2.0,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(w.sessions.len(), 2);
        assert_eq!(w.sessions[1].turns[0].arrival_us, Some(5_000));
        assert_eq!(w.sessions[1].turns[0].output_tokens, 1);
        let (Prompt::Blocks(a), Prompt::Blocks(b)) = (
            &w.sessions[0].turns[0].prompt,
            &w.sessions[1].turns[0].prompt,
        ) else {
            panic!("block prompts expected")
        };
        let (ta, tb) = (a.tokens(), b.tokens());
        assert_eq!(ta.len(), 1000);
        assert_eq!(tb.len(), 700);
        assert_eq!(ta[..512], tb[..512]);
        assert_ne!(ta[512..600], tb[512..600]);
    }

    #[test]
    fn bad_rows_and_params_are_errors() {
        let p = MooncakeParams::default();
        assert!(matches!(
            parse("{\"timestamp\": -1}", &p),
            Err(WorkloadError::Parse { .. })
        ));
        let p0 = MooncakeParams {
            speed: 0.0,
            ..Default::default()
        };
        assert!(matches!(parse("", &p0), Err(WorkloadError::Param(_))));
        let wild = MooncakeParams {
            arrival_jitter: 1.5,
            ..Default::default()
        };
        assert!(matches!(parse("", &wild), Err(WorkloadError::Param(_))));
    }

    #[test]
    fn arrival_jitter_redraws_the_gaps_per_seed_and_keeps_the_rest() {
        let text: String = (0..20)
            .map(|i| {
                format!(
                    "{{\"timestamp\": {}, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, {i}]}}\n",
                    i * 100
                )
            })
            .collect();
        let at = |jitter, seed| {
            let p = MooncakeParams {
                arrival_jitter: jitter,
                jitter_seed: seed,
                ..Default::default()
            };
            let w = parse(&text, &p).unwrap();
            let t: Vec<u64> = w
                .sessions
                .iter()
                .map(|s| s.turns[0].arrival_us.unwrap())
                .collect();
            (
                t,
                w.sessions
                    .iter()
                    .map(|s| s.turns[0].prompt.clone())
                    .collect::<Vec<_>>(),
            )
        };
        let (recorded, prompts) = at(0.0, 0);
        let (a, pa) = at(0.2, 1);
        let (b, _) = at(0.2, 2);
        assert_ne!(a, recorded);
        assert_ne!(a, b);
        assert_eq!(pa, prompts, "only the times move");
        for i in 1..a.len() {
            let gap = (a[i] - a[i - 1]) as f64;
            assert!((79_000.0..=121_000.0).contains(&gap), "{a:?}");
        }
    }
}
