//! RL rollouts with stragglers (docs/design/design.md section 7), the workload `kv_load` is built to win.
//!
//! `steps x rollouts_per_step` rollouts, each `turns` serial turns. Turn 1's prompt is
//! `system_tokens` shared by every rollout, then `step_tokens` shared by the rollouts of one step, then
//! `rollout_tokens` of the rollout's own task. Each later turn appends the previous turn's output (the
//! model's action, as the engine generated it) and an environment/tool reply of `env_tokens_min..=
//! env_tokens_max` new tokens (chosen per turn from a hash of (step, rollout, turn), so it is
//! reproducible). Every turn generates `output_tokens`, except the last turn of the straggler rollouts
//! (`stragglers`, indices within a step), which generates `straggler_output_tokens`.

use crate::driver::Mode;
use crate::error::WorkloadError;
use crate::session::{Prompt, Session, Turn, Workload};
use crate::token_blocks::{block_key, pick, sub_key, tokens};

#[derive(Clone, Debug, PartialEq)]
pub struct RlParams {
    pub steps: usize,
    pub rollouts_per_step: usize,
    pub turns: usize,
    pub system_tokens: usize,
    pub step_tokens: usize,
    pub rollout_tokens: usize,
    pub env_tokens_min: usize,
    pub env_tokens_max: usize,
    pub output_tokens: u32,
    pub straggler_output_tokens: u32,
    /// Indices within a step whose last turn is a straggler.
    pub stragglers: Vec<usize>,
    pub block_size: u32,
    /// Rollouts in flight (closed loop).
    pub concurrency: usize,
    /// Think time before each turn after the first (environment step time), us.
    pub think_us: u64,
    /// Varies every token (not the structure).
    pub seed: u64,
}

impl Default for RlParams {
    /// docs/design/design.md section 7 exactly.
    fn default() -> Self {
        RlParams {
            steps: 10,
            rollouts_per_step: 8,
            turns: 10,
            system_tokens: 2048,
            step_tokens: 512,
            rollout_tokens: 1024,
            env_tokens_min: 128,
            env_tokens_max: 256,
            output_tokens: 1024,
            straggler_output_tokens: 8192,
            stragglers: vec![0, 4],
            block_size: 16,
            concurrency: 16,
            think_us: 0,
            seed: 0,
        }
    }
}

impl RlParams {
    /// A scaled-down variant with the same structure (for tests and CI): 2 steps x 8 rollouts x 4 turns,
    /// prompts and outputs divided by 8.
    pub fn small() -> Self {
        RlParams {
            steps: 2,
            turns: 4,
            system_tokens: 256,
            step_tokens: 64,
            rollout_tokens: 128,
            env_tokens_min: 16,
            env_tokens_max: 32,
            output_tokens: 128,
            straggler_output_tokens: 1024,
            concurrency: 4,
            ..Self::default()
        }
    }

    fn check(&self) -> Result<(), WorkloadError> {
        let bad = |m: &str| Err(WorkloadError::Param(m.to_string()));
        if self.turns == 0 || self.rollouts_per_step == 0 {
            return bad("turns and rollouts_per_step must be at least 1");
        }
        if self.env_tokens_min > self.env_tokens_max {
            return bad("env_tokens_min > env_tokens_max");
        }
        if self.block_size == 0 {
            return bad("block_size must be at least 1");
        }
        Ok(())
    }
}

/// Builds the workload. Rollouts are ordered step by step, so a closed loop runs the steps in order with
/// `concurrency` rollouts in flight.
pub fn generate(p: &RlParams) -> Result<Workload, WorkloadError> {
    p.check()?;
    let root = sub_key(block_key("rl", p.seed), &[]);
    let system = tokens(sub_key(root, &[0]), p.system_tokens);
    let mut sessions = Vec::with_capacity(p.steps * p.rollouts_per_step);
    for step in 0..p.steps {
        let step_state = tokens(sub_key(root, &[1, step as u64]), p.step_tokens);
        for r in 0..p.rollouts_per_step {
            let key = sub_key(root, &[2, step as u64, r as u64]);
            let mut turns = Vec::with_capacity(p.turns);
            for t in 0..p.turns {
                let new = if t == 0 {
                    let mut v =
                        Vec::with_capacity(system.len() + step_state.len() + p.rollout_tokens);
                    v.extend_from_slice(&system);
                    v.extend_from_slice(&step_state);
                    v.extend(tokens(key, p.rollout_tokens));
                    v
                } else {
                    let tk = sub_key(key, &[t as u64]);
                    let n = pick(tk, p.env_tokens_min as u64, p.env_tokens_max as u64);
                    tokens(tk, n as usize)
                };
                let straggler = t + 1 == p.turns && p.stragglers.contains(&r);
                turns.push(Turn {
                    prompt: Prompt::Append(new),
                    output_tokens: if straggler {
                        p.straggler_output_tokens
                    } else {
                        p.output_tokens
                    },
                    think_us: if t == 0 { 0 } else { p.think_us },
                    arrival_us: None,
                });
            }
            sessions.push(Session {
                id: format!("rl-s{step}-r{r}"),
                turns,
            });
        }
    }
    let params = vec![
        ("steps".into(), p.steps.to_string()),
        ("rollouts_per_step".into(), p.rollouts_per_step.to_string()),
        ("turns".into(), p.turns.to_string()),
        ("system_tokens".into(), p.system_tokens.to_string()),
        ("step_tokens".into(), p.step_tokens.to_string()),
        ("rollout_tokens".into(), p.rollout_tokens.to_string()),
        (
            "env_tokens".into(),
            format!("{}..={}", p.env_tokens_min, p.env_tokens_max),
        ),
        ("output_tokens".into(), p.output_tokens.to_string()),
        (
            "straggler_output_tokens".into(),
            p.straggler_output_tokens.to_string(),
        ),
        ("stragglers".into(), format!("{:?}", p.stragglers)),
        ("concurrency".into(), p.concurrency.to_string()),
        ("seed".into(), p.seed.to_string()),
    ];
    Ok(Workload {
        name: "rl".into(),
        params,
        block_size: p.block_size,
        default_mode: Mode::Closed {
            concurrency: p.concurrency,
        },
        sessions,
        notes: vec![],
    })
}
