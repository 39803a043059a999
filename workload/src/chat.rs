//! Multi-turn chat behind one shared system prompt: the workload that showed a cache-aware cost
//! starving a replica (docs/design/design.md, "No replica starved").
//!
//! Sessions arrive open-loop (exponential gaps at `sessions_per_s`); each has a Zipf-distributed
//! number of turns (`P(k) ~ k^-zipf_s`, 1..=`max_turns`). Turn 1's prompt is the `system_tokens`
//! every request shares, then the user's first message; each later turn appends the previous output
//! and a new user message of `user_tokens_min..=user_tokens_max` tokens, after `think_us`. A share
//! `long_output_share` of the sessions generate `long_output_factor` times the usual output. Every
//! draw comes from a hash of the seed and the session, so a seed is one reproducible draw.

use crate::driver::Mode;
use crate::error::WorkloadError;
use crate::session::{Prompt, Session, Turn, Workload};
use crate::token_blocks::{block_key, pick, sub_key, tokens};

#[derive(Clone, Debug, PartialEq)]
pub struct ChatParams {
    pub sessions: usize,
    /// New sessions per second (open loop).
    pub sessions_per_s: f64,
    pub system_tokens: usize,
    pub user_tokens_min: usize,
    pub user_tokens_max: usize,
    pub output_tokens: u32,
    /// Share of sessions whose every turn generates `long_output_factor` times `output_tokens`.
    pub long_output_share: f64,
    pub long_output_factor: u32,
    pub zipf_s: f64,
    pub max_turns: usize,
    /// Client think time between a turn's completion and the next turn, us.
    pub think_us: u64,
    pub block_size: u32,
    pub seed: u64,
}

impl Default for ChatParams {
    /// About 580 requests over about 40 s of arrivals.
    fn default() -> Self {
        ChatParams {
            sessions: 165,
            sessions_per_s: 4.0,
            system_tokens: 4096,
            user_tokens_min: 64,
            user_tokens_max: 512,
            output_tokens: 200,
            long_output_share: 0.1,
            long_output_factor: 20,
            zipf_s: 1.5,
            max_turns: 20,
            think_us: 3_000_000,
            block_size: 16,
            seed: 0,
        }
    }
}

/// A uniform draw in [0, 1) from a key.
fn unit(key: u64) -> f64 {
    (key >> 11) as f64 / (1u64 << 53) as f64
}

/// Turns of a session: the Zipf inverse CDF at a uniform draw.
fn zipf_turns(u: f64, s: f64, max: usize) -> usize {
    let weights: Vec<f64> = (1..=max).map(|k| (k as f64).powf(-s)).collect();
    let total: f64 = weights.iter().sum();
    let mut acc = 0.0;
    for (i, w) in weights.iter().enumerate() {
        acc += w / total;
        if u < acc {
            return i + 1;
        }
    }
    max
}

pub fn generate(p: &ChatParams) -> Result<Workload, WorkloadError> {
    let bad = |m: &str| Err(WorkloadError::Param(m.to_string()));
    if p.max_turns == 0 || p.block_size == 0 || p.user_tokens_min > p.user_tokens_max {
        return bad("max_turns and block_size must be at least 1, user_tokens_min <= max");
    }
    if !(p.sessions_per_s.is_finite() && p.sessions_per_s > 0.0) {
        return bad("sessions_per_s must be a positive number");
    }
    if !(0.0..=1.0).contains(&p.long_output_share) || !p.zipf_s.is_finite() {
        return bad("long_output_share must be in 0..=1 and zipf_s finite");
    }
    let root = sub_key(block_key("chat", p.seed), &[]);
    let system = tokens(sub_key(root, &[0]), p.system_tokens);
    let mut sessions = Vec::with_capacity(p.sessions);
    let mut arrival_s = 0.0;
    for i in 0..p.sessions {
        let key = sub_key(root, &[1, i as u64]);
        // Exponential gap; 1 - u keeps the logarithm finite.
        arrival_s += -(1.0 - unit(sub_key(key, &[0]))).ln() / p.sessions_per_s;
        let turns = zipf_turns(unit(sub_key(key, &[1])), p.zipf_s, p.max_turns);
        let long = unit(sub_key(key, &[2])) < p.long_output_share;
        let output = if long {
            p.output_tokens.saturating_mul(p.long_output_factor)
        } else {
            p.output_tokens
        };
        let turns = (0..turns)
            .map(|t| {
                let tk = sub_key(key, &[3, t as u64]);
                let n = pick(tk, p.user_tokens_min as u64, p.user_tokens_max as u64) as usize;
                let mut new = if t == 0 { system.clone() } else { Vec::new() };
                new.extend(tokens(tk, n));
                Turn {
                    prompt: Prompt::Append(new),
                    output_tokens: output.max(1),
                    think_us: if t == 0 { 0 } else { p.think_us },
                    arrival_us: (t == 0).then_some((arrival_s * 1e6) as u64),
                }
            })
            .collect();
        sessions.push(Session {
            id: format!("chat-{i}"),
            turns,
        });
    }
    let params = vec![
        ("sessions".into(), p.sessions.to_string()),
        ("sessions_per_s".into(), p.sessions_per_s.to_string()),
        ("system_tokens".into(), p.system_tokens.to_string()),
        (
            "user_tokens".into(),
            format!("{}..={}", p.user_tokens_min, p.user_tokens_max),
        ),
        ("output_tokens".into(), p.output_tokens.to_string()),
        (
            "long_output".into(),
            format!("{} x{}", p.long_output_share, p.long_output_factor),
        ),
        ("zipf_s".into(), p.zipf_s.to_string()),
        ("seed".into(), p.seed.to_string()),
    ];
    Ok(Workload {
        name: "chat".into(),
        params,
        block_size: p.block_size,
        default_mode: Mode::Open,
        sessions,
        notes: vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_session_starts_with_the_shared_system_prompt_and_the_shape_holds() {
        let w = generate(&ChatParams::default()).unwrap();
        let n: usize = w.sessions.iter().map(|s| s.turns.len()).sum();
        assert!((450..=750).contains(&n), "{n} requests");
        let long = w
            .sessions
            .iter()
            .filter(|s| s.turns[0].output_tokens == 4000)
            .count();
        assert!((5..=35).contains(&long), "{long} long sessions");
        let first = |s: &Session| match &s.turns[0].prompt {
            Prompt::Append(v) => v[..4096].to_vec(),
            _ => unreachable!(),
        };
        assert!(w.sessions.iter().all(|s| first(s) == first(&w.sessions[0])));
        // Arrivals increase at about 4 a second.
        let last = w.sessions.last().unwrap().turns[0].arrival_us.unwrap() as f64 / 1e6;
        assert!((25.0..60.0).contains(&last), "{last}");
        // Another seed is another draw.
        let other = generate(&ChatParams {
            seed: 1,
            ..ChatParams::default()
        })
        .unwrap();
        assert_ne!(first(&other.sessions[0]), first(&w.sessions[0]));
    }

    #[test]
    fn bad_parameters_are_refused() {
        for p in [
            ChatParams {
                max_turns: 0,
                ..ChatParams::default()
            },
            ChatParams {
                sessions_per_s: 0.0,
                ..ChatParams::default()
            },
            ChatParams {
                long_output_share: 2.0,
                ..ChatParams::default()
            },
        ] {
            assert!(generate(&p).is_err());
        }
    }
}
